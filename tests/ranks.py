"""Gloo ranks forked from the test process: a stage's distributed logic without torchrun's fresh interpreters.

torchrun starts each rank as a new Python that imports torch, transformers and peft again (5-7 s of CPU per
rank). Where a test's point is the training logic under DDP/FSDP (the same loss curve on 1 and 2 processes,
a resume, a rank-0 failure), not the launch, the ranks are forked from this already-imported process
instead. Each child gets the environment torchrun gives a worker (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``launcher.is_worker()`` holds and the stage's ``main``
runs as a worker, and ``distributed.setup`` starts its gloo group from ``env://`` as under torchrun.
What torchrun itself does (the launcher's command, its signal forwarding, its rendezvous) keeps its own
tests, which still launch it: tests/test_launcher.py, and one torchrun run per feature family
(test_train_ddp_resume, test_fsdp's killed run, test_fsdp_hybrid, test_validation's stuck rank).

Fork safety: a child has only the forking thread. One intra-op thread in each child (torch then runs its
parallel loops inline, never waking an OpenMP pool the parent may have started), and no process group may
be running in the parent (a child would inherit it and never start its own). A child that does not finish
within the timeout is killed and the test fails with every rank's output, rather than hanging.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


@dataclass
class RankResult:
    rank: int
    exit_code: int
    output: str  # the rank's stdout and stderr together


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _child(rank: int, world_size: int, local_world_size: int, port: int, log_path: str,
           target: Callable[[], int | None]) -> None:
    """In the forked child: torchrun's worker environment, output to the rank's log, run, never return."""
    code = 1
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.setpgid(0, 0)  # a group of its own: the parent can kill whatever the rank starts
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % local_world_size), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(local_world_size), GROUP_RANK=str(rank // local_world_size),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for name in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # not pytest's handlers
            signal.signal(name, signal.SIG_DFL)
        import torch

        torch.set_num_threads(1)
        result = target()
        code = 0 if result is None else int(result)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever ends the rank is reported through its log and exit code
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class Ranks:
    """Forked ranks running, with what the tests use of ``subprocess.Popen``: ``poll``, ``send_signal``,
    ``wait``, ``communicate`` (every rank's output), ``returncode`` (the first non-zero rank's, else 0)."""

    def __init__(self, pids: list[int], logs: list[Path], directory: tempfile.TemporaryDirectory):
        self.pids, self.logs, self._directory = pids, logs, directory
        self.codes: dict[int, int] = {}
        self._parent = os.getpid()

    @property
    def returncode(self) -> int | None:
        if len(self.codes) < len(self.pids):
            return None
        return next((code for _, code in sorted(self.codes.items()) if code != 0), 0)

    def poll(self) -> int | None:
        """Reap the ranks that have exited; the return code once every one has, else None."""
        for rank, pid in enumerate(self.pids):
            if rank not in self.codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[rank] = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int, ranks: Sequence[int] | None = None) -> None:
        for rank in (range(len(self.pids)) if ranks is None else ranks):
            if rank not in self.codes:
                os.kill(self.pids[rank], signum)

    def outputs(self) -> str:
        return "\n".join(f"--- rank {rank} (exit {self.codes.get(rank, 'still running')}) ---\n"
                         f"{log.read_text(errors='replace')[-3000:] if log.exists() else ''}"
                         for rank, log in enumerate(self.logs))

    def kill(self) -> None:
        for rank, pid in enumerate(self.pids):
            if rank not in self.codes:
                for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                    try:  # the rank's group (what it started), and the rank itself if it had no group yet
                        kill()
                    except ProcessLookupError:
                        pass
                self.codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def wait(self, timeout: float | None = 240) -> int:
        """Every rank's exit; past ``timeout`` seconds they are killed and the test fails with their output."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the forked ranks did not finish within {timeout} s:\n{self.outputs()}")
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = 240) -> tuple[str, None]:
        self.wait(timeout)
        return self.outputs(), None

    def results(self, timeout: float | None = 240) -> list[RankResult]:
        self.wait(timeout)
        results = [RankResult(rank, self.codes[rank], log.read_text(errors="replace"))
                   for rank, log in enumerate(self.logs)]
        self._directory.cleanup()
        return results

    def __del__(self):  # a test that failed half-way leaves no rank running
        if os.getpid() != self._parent:  # a copy inherited by a later fork: not that process's ranks
            return
        try:
            self.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def start(target: Callable[[], int | None], world_size: int = 2, local_world_size: int | None = None) -> Ranks:
    """Fork ``world_size`` ranks, each calling ``target()`` (its return value is the rank's exit code)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("a process group runs in the test process: forked ranks would inherit it")
    directory = tempfile.TemporaryDirectory(prefix="ranks-")
    logs = [Path(directory.name, f"rank{rank}.log") for rank in range(world_size)]
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _child(rank, world_size, local_world_size or world_size, port, str(logs[rank]), target)
        pids.append(pid)
    return Ranks(pids, logs, directory)


def run(target: Callable[[], int | None], world_size: int = 2, timeout: float = 240,
        local_world_size: int | None = None) -> list[RankResult]:
    """``target()`` on ``world_size`` forked ranks, to their end (see :meth:`Ranks.wait`)."""
    return start(target, world_size, local_world_size).results(timeout)


def start_stage(main: Callable[[Sequence[str]], int | None], argv: Sequence[str], world_size: int = 2,
                before: Callable[[], None] | None = None, local_world_size: int | None = None) -> Ranks:
    """A stage's ``main(argv)`` on ``world_size`` forked ranks, as ``core.errors.run_main`` runs it under
    torchrun (a WorkflowError: one line on stderr, exit code 2); ``before`` runs first in each rank."""
    from workflow_scripts.core.errors import run_main

    def target():
        if before is not None:
            before()
        run_main(main, list(argv))

    return start(target, world_size, local_world_size)


def run_stage(main: Callable[[Sequence[str]], int | None], argv: Sequence[str], world_size: int = 2,
              timeout: float = 240, before: Callable[[], None] | None = None,
              local_world_size: int | None = None) -> list[RankResult]:
    return start_stage(main, argv, world_size, before, local_world_size).results(timeout)


def assert_succeeded(results: list[RankResult]) -> str:
    """Every rank exited 0; returns rank 0's output."""
    assert all(result.exit_code == 0 for result in results), "\n".join(
        f"--- rank {r.rank} (exit {r.exit_code}) ---\n{r.output[-3000:]}" for r in results)
    return results[0].output
