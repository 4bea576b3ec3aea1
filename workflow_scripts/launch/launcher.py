"""Starting a stage as a distributed job: torchrun with one process per GPU (or gloo processes on CPU).

A stage's ``main`` calls :func:`needs_launch`; when it is true the stage hands its own argv to
:func:`launch`, which re-runs the same module under torchrun and returns its exit code. Inside
torchrun (``LOCAL_RANK`` set) the stage runs as a worker.

One node: the job leases disjoint GPUs and a free rendezvous port from
:mod:`workflow_scripts.launch.device_leases` (a scheduler's allocation is left as it is), and torchrun
gets them through ``CUDA_VISIBLE_DEVICES`` and ``--rdzv-endpoint``.
Several nodes (``training.nodes > 1``, inside a SLURM allocation): one torchrun per node through
``srun``, with a c10d rendezvous on the allocation's first host and ``SLURM_JOB_ID`` as its id.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable, Mapping, Sequence

from workflow_scripts.launch import device_leases
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.settings import TrainingSettings

# What SLURM sends before a time limit or preemption (USR1 via --signal) and on cancel (TERM):
# torchrun must hand them on to the workers, which checkpoint, instead of dying of them.
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
DEFAULT_GRACE_SECONDS = 270  # the schema's training.signal_grace_seconds: inside the SLURM profile's --signal=USR1@300


# SLURM's `--signal=USR1@300` (the SLURM profile's train rule) reaches every process of the job step, not only
# the training processes: also the Snakemake process the plugin runs there and the rule's bash. Neither
# handles SIGUSR1, so by default they die of it; the step's task is gone, and SLURM then kills what is left
# of the step, the training before it has checkpointed. Snakemake ignores it there instead (see below).
SCHEDULER_WARNING_SIGNAL = signal.SIGUSR1


def ignore_scheduler_warning_in_job(environ: Mapping[str, str] | None = None) -> bool:
    """Inside a SLURM job, make this process and what it starts ignore SIGUSR1 (called by the Snakefile).

    The rule's shell inherits the ignored disposition and so outlives the signal too; the processes that
    act on it install their own handlers, which replace an ignored one: the launcher forwards it, torchrun
    hands it on (``--signals-to-handle``), and the training loop checkpoints (``train.StopRequest``).
    Returns whether it did; outside SLURM, or off the main thread (where Python cannot set a handler),
    nothing changes.
    """
    environ = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in environ or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(SCHEDULER_WARNING_SIGNAL, signal.SIG_IGN)
    return True


# When the stage's first process started (seconds since the epoch), handed on to torchrun's workers so
# that a stage can report what start-up cost it: launcher, torchrun, imports, CUDA, model loading.
STAGE_STARTED_VARIABLE = "LORA_WORKFLOW_STAGE_STARTED"


def stage_started_at() -> float:
    """Wall-clock time the stage started: set by whoever started it (the launcher for torchrun's workers,
    a harness timing an in-process call), else this process's own start."""
    given = os.environ.get(STAGE_STARTED_VARIABLE)
    if given:
        return float(given)
    import psutil

    return psutil.Process().create_time()


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


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def torchrun_has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes --shutdown-timeout (torch 2.11, the oldest supported, does not:
    it refuses the whole command). Read from its source, so that the launcher need not import torch: found from
    the top-level package's location (find_spec of a submodule would import torch and torch.distributed)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torch")
    try:
        source = Path(spec.submodule_search_locations[0], "distributed", "run.py")
        return "--shutdown-timeout" in source.read_text(encoding="utf-8")
    except (AttributeError, TypeError, IndexError, OSError):
        return False


def signal_handling(grace_seconds: int = DEFAULT_GRACE_SECONDS) -> list[str]:
    """torchrun's options for a scheduler's signal: forward it to the workers, then give them
    ``grace_seconds`` (``training.signal_grace_seconds``) to checkpoint and exit before SIGKILL; torchrun's
    own default of 30 s is too short to write a large adapter with its optimizer state. A torchrun without
    --shutdown-timeout keeps its 30 s (said on stderr)."""
    options = ["--max-restarts", "0", "--signals-to-handle", ",".join(FORWARDED_SIGNALS)]
    if torchrun_has_shutdown_timeout():
        return [*options, "--shutdown-timeout", str(grace_seconds)]
    print(f"launcher: this torch's torchrun has no --shutdown-timeout: a signalled checkpoint gets torchrun's "
          f"30 s, not training.signal_grace_seconds ({grace_seconds} s)", file=sys.stderr)
    return options


def torchrun_command(module: str, argv: Sequence[str], nproc: int, rendezvous_port: int | None = None,
                     grace_seconds: int = DEFAULT_GRACE_SECONDS) -> list[str]:
    """A single-node torchrun command for ``python -m module argv``."""
    command = [*_torchrun(), "--nnodes", "1", "--nproc-per-node", str(nproc)]
    if rendezvous_port is None:
        command.append("--standalone")
    else:
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rendezvous_port}",
                    "--rdzv-id", f"local-{os.getpid()}"]
    command += signal_handling(grace_seconds)
    return command + ["-m", module, *argv]


# ---- SLURM node lists -------------------------------------------------------------------------

def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: 'a[1,3],b' -> ['a[1,3]', 'b']."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part for part in parts if part]


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]+)\]", name)
    if not match:
        return [name]
    head, tail = name[: match.start()], name[match.end():]
    hosts = []
    for item in match.group(1).split(","):
        low, _, high = item.partition("-")
        if not high:
            numbers = [low]
        else:
            width = len(low)  # zero padding is part of the name: node[01-03] -> node01..node03
            numbers = [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
        for number in numbers:
            hosts += _expand_one(f"{head}{number}{tail}")
    return hosts


def parse_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM host list ('gpu[01-02,07],login3') the way ``scontrol show hostnames`` does."""
    try:
        return [host for part in _split_top_level(nodelist.strip()) for host in _expand_one(part)]
    except ValueError:
        raise WorkflowError(f"cannot read the SLURM node list '{nodelist}'") from None


def expand_hostnames(nodelist: str) -> list[str]:
    """Hosts of a node list: ``scontrol show hostnames`` where it exists, else :func:`parse_hostlist`."""
    if shutil.which("scontrol"):
        result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if result.returncode == 0 and result.stdout.split():
            return result.stdout.split()
    return parse_hostlist(nodelist)


def _job_fields(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as key=value pairs (the jobstep executor drops SLURM_JOB_NODELIST & co)."""
    if not shutil.which("scontrol"):
        return {}
    result = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        return {}
    return dict(item.split("=", 1) for item in result.stdout.split() if "=" in item)


def allocation(environ: Mapping[str, str]) -> tuple[str, list[str], int | None]:
    """(job id, hosts, CPUs per task) of the SLURM allocation this process runs in."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        raise WorkflowError(
            "training.nodes > 1 needs a SLURM allocation (SLURM_JOB_ID is not set): run the workflow with "
            "--profile profiles/slurm, or set training.nodes to 1 to train on this machine"
        )
    fields = {} if environ.get("SLURM_JOB_NODELIST") and environ.get("SLURM_CPUS_PER_TASK") else _job_fields(job_id)
    nodelist = environ.get("SLURM_JOB_NODELIST") or fields.get("NodeList")
    if not nodelist:
        raise WorkflowError(f"cannot find the node list of SLURM job {job_id} (no SLURM_JOB_NODELIST, no scontrol)")
    cpus = environ.get("SLURM_CPUS_PER_TASK") or fields.get("CPUs/Task")
    return job_id, expand_hostnames(nodelist), int(cpus) if cpus and cpus.isdigit() else None


def multinode_command(module: str, argv: Sequence[str], gpus: int, cpu_processes: int, nodes: int,
                      rendezvous_port: int, environ: Mapping[str, str] | None = None,
                      grace_seconds: int = DEFAULT_GRACE_SECONDS) -> list[str]:
    """``srun`` one torchrun per node, rendezvous (c10d) on the first host of the allocation."""
    environ = os.environ if environ is None else environ
    job_id, hosts, cpus_per_task = allocation(environ)
    if len(hosts) != nodes:
        raise WorkflowError(
            f"training.nodes is {nodes} but SLURM job {job_id} holds {len(hosts)} node(s) ({','.join(hosts)}); "
            "the rule's 'nodes' resource must equal training.nodes"
        )
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if gpus > 0:
        srun.append(f"--gpus-per-node={gpus}")
    if cpus_per_task:
        srun.append(f"--cpus-per-task={cpus_per_task}")
    return [
        *srun, *_torchrun(),
        "--nnodes", str(nodes), "--nproc-per-node", str(processes_per_node(gpus, cpu_processes)),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0]}:{rendezvous_port}", "--rdzv-id", job_id,
        *signal_handling(grace_seconds),
        "-m", module, *argv,
    ]


def multinode_port(environ: Mapping[str, str]) -> tuple[int, list[int]]:
    """A rendezvous port free on the first host: the batch step runs there, so lease one locally.

    Off the first host (an unusual set-up) nothing local says what is free there, so take a port
    derived from the job id: distinct for concurrent jobs, never the shared default 29500.
    """
    _, hosts, _ = allocation(environ)
    if socket.gethostname().split(".")[0] == hosts[0].split(".")[0]:
        lease = device_leases.acquire(0, label="rendezvous")
        return lease.port, lease.lock_fds
    return 30000 + int(environ["SLURM_JOB_ID"]) % 20000, []


# ---- running --------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """If the launcher is killed (even SIGKILL), torchrun gets SIGTERM and stops its workers."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


def run_forwarding_signals(command: Sequence[str], env: Mapping[str, str], pass_fds: Sequence[int] = ()) -> int:
    """Run ``command``, hand it the signals this process receives, return its exit code."""
    process = subprocess.Popen(list(command), env=dict(env), pass_fds=tuple(pass_fds), preexec_fn=_die_with_parent)
    previous = {}
    for name in FORWARDED_SIGNALS:
        number = getattr(signal, name)
        previous[number] = signal.signal(number, lambda signum, _frame: process.send_signal(signum))
    try:
        return process.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if process.poll() is None:
            process.kill()
            process.wait()


def launch(module: str, argv: Sequence[str], gpus: int, cpu_processes: int, nodes: int = 1,
           grace_seconds: int = DEFAULT_GRACE_SECONDS) -> int:
    """Run ``module`` under torchrun (through srun on several nodes) and return its exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env[STAGE_STARTED_VARIABLE] = str(stage_started_at())
    if nodes > 1:
        port, fds = multinode_port(env)
        command = multinode_command(module, argv, gpus, cpu_processes, nodes, port, env, grace_seconds)
        print(f"launcher: {' '.join(command)}", file=sys.stderr, flush=True)
        try:
            return run_forwarding_signals(command, env, fds)
        finally:
            for fd in fds:
                os.close(fd)
    with device_leases.leased(gpus, label=module) as lease:
        env.update(lease.environment())
        command = torchrun_command(module, argv, processes_per_node(gpus, cpu_processes), lease.port, grace_seconds)
        devices = "as allocated by the scheduler" if lease.gpu_ids is None else (",".join(lease.gpu_ids) or "none")
        print(f"launcher: GPUs {devices}, rendezvous port {lease.port}: {' '.join(command)}", file=sys.stderr, flush=True)
        # torchrun inherits the lock descriptors: the lease lasts as long as it or this process lives.
        return run_forwarding_signals(command, env, lease.lock_fds)


def run_here_or_launch(module: str, argv: Sequence[str], training: TrainingSettings, worker: Callable[[], int]) -> int:
    """A distributed stage's entry: run ``worker`` in this process, or re-run ``module`` under torchrun.

    ``training`` gives the job's ``gpus``, ``cpu_processes`` and ``nodes``.
    """
    if needs_launch(training.gpus, training.cpu_processes, training.nodes):
        return launch(module, argv, training.gpus, training.cpu_processes, training.nodes,
                      training.signal_grace_seconds)
    return worker()
