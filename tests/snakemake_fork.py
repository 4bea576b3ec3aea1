"""Snakemake's command line in a fork of the test process, dry runs and real runs alike (issue 25).

A fresh ``python -m snakemake`` imports snakemake and, through the Snakefile's config checks, the task modules
(torch among them): ~5 s of CPU before it plans anything, in every one of the suite's many Snakemake runs. A
fork of the test process has them loaded already. The jobs a real run starts (``python -m
workflow_scripts.<stage>``) are forked from a pre-loaded interpreter likewise (tests/job_zygote.py, which says
what differs); what the tests that call the command itself (``python -m snakemake``) check, and jobs in fresh
interpreters, are still checked by the SLURM tests, the lint test and the demo.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import job_zygote


def run(args: list[str], cwd: Path | None = None, timeout: float = 1200) -> tuple[int, str]:
    """``snakemake *args`` (run in ``cwd``) -> (exit code, stdout and stderr together). Past ``timeout``
    seconds the run and every job it started are killed and ``TimeoutError`` is raised with its output."""
    if not hasattr(os, "fork"):
        import subprocess

        done = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
        return done.returncode, done.stdout + done.stderr
    from snakemake import cli as snakemake_cli
    from workflow_scripts.tasks import TASK_MODULES, task_named

    for name in TASK_MODULES:  # what the Snakefile's config checks import: loaded once, here
        task_named(name)
    # Its jobs forked from one pre-loaded interpreter (tests/job_zygote.py), started before this fork.
    shim_dir = job_zygote.start()
    with tempfile.TemporaryFile() as output:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: snakemake's command line, its output into the file
            code = 1
            try:
                # The test process's objects (torch, transformers, ...) out of the collector's sight: a long run
                # would otherwise walk them in every full collection, copying their pages on write as it goes.
                gc.freeze()
                os.setpgid(0, 0)  # its own process group: a timeout kills the jobs it started too
                if cwd is not None:
                    os.chdir(cwd)
                if shim_dir is not None:  # the rules run `python` from this folder (rules/common.smk)
                    os.environ[job_zygote.SOCKET_VARIABLE] = str(shim_dir / "socket")
                    sys.executable = str(shim_dir / "python")
                os.dup2(output.fileno(), 1)
                os.dup2(output.fileno(), 2)
                # pytest's capture has replaced sys.stdout/err: snakemake's log must reach the file
                sys.stdout = sys.stderr = open(output.fileno(), "w", buffering=1, closefd=False)
                snakemake_cli.main(list(args))
                code = 0
            except SystemExit as error:
                code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        try:
            os.setpgid(pid, pid)  # as the child does: whichever comes first
        except OSError:
            pass
        deadline = time.monotonic() + timeout
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"snakemake {' '.join(args)} ran past {timeout} s")
                time.sleep(0.1)
        except BaseException as error:  # the timeout, or the test stopped (Ctrl-C): no run left behind
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            if isinstance(error, TimeoutError):
                output.seek(0)
                raise TimeoutError(f"{error}:\n{output.read().decode(errors='replace')[-6000:]}") from None
            raise
        output.seek(0)
        return os.waitstatus_to_exitcode(status), output.read().decode(errors="replace")
