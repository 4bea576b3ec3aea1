"""Starting a stage as a distributed job: torchrun with one process per GPU (or gloo processes on CPU).

A stage's ``main`` calls :func:`needs_launch`; when it is true the stage hands its own argv to
:func:`launch`, which re-runs the same module under torchrun and returns its exit code. Inside
torchrun (``LOCAL_RANK`` set) the stage runs as a worker.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence


def is_worker() -> bool:
    """True inside a torchrun-launched process."""
    return "LOCAL_RANK" in os.environ


def processes_per_node(gpus: int, cpu_processes: int) -> int:
    return gpus if gpus > 0 else cpu_processes


def needs_launch(gpus: int, cpu_processes: int, nodes: int = 1) -> bool:
    """A job with GPUs or more than one process goes through torchrun; one CPU process runs in place."""
    if is_worker():
        return False
    return gpus > 0 or cpu_processes > 1 or nodes > 1


def torchrun_command(module: str, argv: Sequence[str], nproc: int, rendezvous_port: int | None = None) -> list[str]:
    """A single-node torchrun command for ``python -m module argv``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    if rendezvous_port is None:
        command.append("--standalone")
    else:
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rendezvous_port}"]
    return command + ["-m", module, *argv]


def launch(module: str, argv: Sequence[str], gpus: int, cpu_processes: int, nodes: int = 1) -> int:
    """Run ``module`` under torchrun on this node and return its exit code."""
    nproc = processes_per_node(gpus, cpu_processes)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(torchrun_command(module, argv, nproc), env=env).returncode
