"""Disjoint GPUs and a private rendezvous port for each concurrent job on one machine.

Snakemake counts ``gpu`` against ``--resources gpu=8`` but assigns no device ids (snakemake #281),
so two 4-GPU jobs started together would both see all eight GPUs and pile onto the first ones,
and a fixed ``MASTER_PORT`` makes their rendezvous collide. Here each job leases its GPUs and a
port: one lock file per GPU id (and per port) in a per-user lease directory, held with
``fcntl.flock`` for the job's lifetime. The kernel drops a flock when the last descriptor of the
file closes, so a job that dies, even by SIGKILL, releases its lease without any clean-up.

A scheduler's allocation is left alone: inside a SLURM job whose GPUs SLURM already chose
(``CUDA_VISIBLE_DEVICES`` / ``SLURM_JOB_GPUS``), the job keeps exactly those devices.

Environment:
    LORA_WORKFLOW_GPU_IDS        the machine's GPU ids, e.g. "0,1,2,3" (tests; overrides detection)
    LORA_WORKFLOW_LEASE_DIR      where the lock files live (default: per-user under the temp dir)
    LORA_WORKFLOW_LEASE_TIMEOUT  seconds to wait for enough free GPUs (default 3600)
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from workflow_scripts.core.errors import WorkflowError

GPU_IDS_ENV = "LORA_WORKFLOW_GPU_IDS"
LEASE_DIR_ENV = "LORA_WORKFLOW_LEASE_DIR"
TIMEOUT_ENV = "LORA_WORKFLOW_LEASE_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 3600.0
POLL_SECONDS = 0.2


@dataclass
class Lease:
    """What one job holds: its GPU ids (None: leave CUDA_VISIBLE_DEVICES as it is) and its port."""

    gpu_ids: list[str] | None
    port: int
    lock_fds: list[int] = field(default_factory=list)

    def environment(self) -> dict[str, str]:
        """Variables the job's processes must see."""
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port)}
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_ids)
        return env


def scheduler_gpus(environ: dict[str, str] | None = None) -> list[str] | None:
    """The GPU ids a scheduler allocated to this job, or None outside a scheduler's GPU allocation."""
    environ = os.environ if environ is None else environ
    if not environ.get("SLURM_JOB_ID"):
        return None
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if name in environ:
            return _split_ids(environ[name])
    return None


def machine_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """This machine's GPU ids: the test override, else what the user made visible, else nvidia-smi/torch."""
    environ = os.environ if environ is None else environ
    if GPU_IDS_ENV in environ:
        return _split_ids(environ[GPU_IDS_ENV])
    if "CUDA_VISIBLE_DEVICES" in environ:
        # The user narrowed the machine down (e.g. to the GPUs nobody else uses): lease from those.
        return _split_ids(environ["CUDA_VISIBLE_DEVICES"])
    return _detected_gpus()


def _detected_gpus() -> list[str]:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=60, check=True,
            ).stdout
            return _split_ids(out.replace("\n", ","))
        except (subprocess.SubprocessError, OSError):
            pass
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def _split_ids(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def lease_dir(environ: dict[str, str] | None = None) -> Path:
    """Per-user directory of lock files, shared by every workflow this user runs on the machine."""
    environ = os.environ if environ is None else environ
    path = Path(environ.get(LEASE_DIR_ENV) or Path(tempfile.gettempdir()) / f"lora-workflow-leases-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _try_lock(path: Path, holder: str) -> int | None:
    """Take an exclusive flock on ``path`` without waiting; return its descriptor, or None if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    # Who holds it, for the message a waiting job prints; the lock itself is the flock.
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)
    return fd


def _gpu_lock(directory: Path, gpu: str) -> Path:
    # MIG ids contain slashes; keep one flat file per device.
    return directory / ("gpu-" + gpu.replace("/", "_") + ".lock")


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def release(lease: Lease) -> None:
    """Drop the lease now (closing the descriptors releases the flocks)."""
    for fd in lease.lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    lease.lock_fds.clear()


def _lease_port(directory: Path, holder: str) -> tuple[int, int]:
    """A port the kernel reports free and no other job of ours holds; returns (port, lock fd)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        fd = _try_lock(directory / f"port-{port}.lock", holder)
        if fd is not None:
            return port, fd
    raise WorkflowError(f"no free rendezvous port found after 200 tries (lease directory {directory})")


def _lease_gpus(pool: list[str], count: int, directory: Path, holder: str, timeout: float) -> list[tuple[str, int]]:
    """Lock ``count`` GPUs of ``pool`` together (all or none), waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        taken: list[tuple[str, int]] = []
        for gpu in pool:
            fd = _try_lock(_gpu_lock(directory, gpu), holder)
            if fd is not None:
                taken.append((gpu, fd))
                if len(taken) == count:
                    return taken
        for _, fd in taken:
            os.close(fd)
        if time.monotonic() >= deadline:
            busy = {gpu: _holder(_gpu_lock(directory, gpu)) for gpu in pool}
            raise WorkflowError(
                f"waited {timeout:.0f} s for {count} free GPUs of {pool} but only {len(taken)} were free; "
                f"held by: {busy} (lock files in {directory}). Wait for those jobs, lower the job's "
                f"'gpus', or raise {TIMEOUT_ENV}"
            )
        time.sleep(POLL_SECONDS)


def acquire(gpus: int, label: str = "", timeout: float | None = None, environ: dict[str, str] | None = None) -> Lease:
    """Lease ``gpus`` GPUs disjoint from every other concurrent job, and a free rendezvous port.

    Inside a scheduler's GPU allocation the devices are left as the scheduler set them, unless the
    allocation holds more GPUs than the job declared (Snakemake run locally inside a big
    allocation): then the job leases its share of the allocation's devices.
    """
    environ = os.environ if environ is None else environ
    directory = lease_dir(environ)
    if timeout is None:
        timeout = float(environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS))
    holder = f"pid {os.getpid()} on {socket.gethostname()}" + (f": {label}" if label else "")
    allocated = scheduler_gpus(environ)
    if allocated is not None:
        pool = allocated
        if gpus == 0 or gpus >= len(allocated):
            port, port_fd = _lease_port(directory, holder)
            return Lease(gpu_ids=None, port=port, lock_fds=[port_fd])
        # Lock files per allocation: with device cgroups each job numbers its GPUs from 0.
        directory = directory / f"slurm-{environ['SLURM_JOB_ID']}"
        directory.mkdir(exist_ok=True, mode=0o700)
    else:
        pool = machine_gpus(environ)
    if gpus > len(pool):
        raise WorkflowError(
            f"the job declares {gpus} GPUs but this machine has {len(pool)} ({pool or 'none'}); "
            f"lower training.gpus / evaluation.gpus, or run where there are enough GPUs"
        )
    port, port_fd = _lease_port(directory, holder)
    if gpus == 0:
        # A job that declared no GPU must not touch one: Snakemake did not count it against gpu=.
        return Lease(gpu_ids=[], port=port, lock_fds=[port_fd])
    try:
        taken = _lease_gpus(pool, gpus, directory, holder, timeout)
    except BaseException:
        os.close(port_fd)
        raise
    return Lease(gpu_ids=[gpu for gpu, _ in taken], port=port, lock_fds=[port_fd] + [fd for _, fd in taken])


@contextlib.contextmanager
def leased(gpus: int, label: str = "", timeout: float | None = None) -> Iterator[Lease]:
    """``acquire`` for the duration of a ``with`` block."""
    lease = acquire(gpus, label, timeout)
    try:
        yield lease
    finally:
        release(lease)
