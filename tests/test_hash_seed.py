"""Every job's command and recorded parameters are the same whatever the hash seed of the Snakemake that plans it.

Snakemake reruns a job whose recorded parameters changed. A parameter built by iterating a set of strings
(whose order follows Python's per-process hash seed) would differ from one ``snakemake`` invocation to the next
and rerun finished jobs for nothing; within this suite it would go unseen, because the tests' Snakemake runs
are forked from one test process (tests/snakemake_fork.py) and share its seed. Here the demo config (every task
type, several models; no mixture) is planned by two fresh interpreters with different seeds, and each job's
shell command and its parameters as Snakemake records them (a `reads` parameter is in no command) compared.
"""
from __future__ import annotations

import os
import subprocess
import sys

from data_helpers import ROOT


# snakemake's command line, its dry run also printing each job's parameters as Snakemake records them for the
# params rerun trigger (persistence._params): a parameter a shell command does not show (a rule's `reads`) counts.
SNAKEMAKE_PRINTING_PARAMS = """
import sys
from snakemake.executors import dryrun
from snakemake.cli import main

def run_job(self, job, _run_job=dryrun.Executor.run_job):
    print("Params:", job.rule.name, sorted(map(str, job.output)), self.workflow.persistence._params(job), flush=True)
    return _run_job(self, job)

dryrun.Executor.run_job = run_job
sys.argv[0] = "snakemake"
main()
"""


def planned_commands(tmp_path, seed: int) -> list[str]:
    """The shell command and the recorded parameters of every job of the demo's plan, sorted (the order Snakemake
    lists jobs in may vary)."""
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    done = subprocess.run([sys.executable, "-c", SNAKEMAKE_PRINTING_PARAMS, "-n", "--printshellcmds", "--cores", "2",
                           "--snakefile", str(ROOT / "Snakefile"),
                           "--configfile", str(ROOT / "config" / "config.yaml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    commands = sorted(line for line in done.stdout.splitlines() if line.startswith(("Shell command: ", "Params: ")))
    assert sum(line.startswith("Params: normalise") for line in commands) > 1, done.stdout[-2000:]
    assert len(commands) > 200, done.stdout[-2000:]
    return commands


def test_the_plan_does_not_depend_on_the_hash_seed(tmp_path):
    (tmp_path / "demo_data").symlink_to(ROOT / "demo_data")
    first, second = planned_commands(tmp_path, 0), planned_commands(tmp_path, 1)
    differing = [(a, b) for a, b in zip(first, second) if a != b]
    assert len(first) == len(second) and not differing, differing[:2]
