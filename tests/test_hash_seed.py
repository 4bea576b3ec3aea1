"""Every job's command is the same whatever the hash seed of the Snakemake that plans it.

Snakemake reruns a job whose recorded parameters changed. A parameter built by iterating a set of strings
(whose order follows Python's per-process hash seed) would differ from one ``snakemake`` invocation to the next
and rerun finished jobs for nothing; within this suite it would go unseen, because the tests' Snakemake runs
are forked from one test process (tests/snakemake_fork.py) and share its seed. Here the demo config (every task
type, several models, a mixture) is planned by two fresh interpreters with different seeds.
"""
from __future__ import annotations

import os
import subprocess
import sys

from data_helpers import ROOT


def planned_commands(tmp_path, seed: int) -> list[str]:
    """The shell command of every job of the demo's plan, sorted (the order Snakemake lists jobs in may vary)."""
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    done = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--printshellcmds", "--cores", "2",
                           "--snakefile", str(ROOT / "Snakefile"),
                           "--configfile", str(ROOT / "config" / "config.yaml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    commands = sorted(line for line in done.stdout.splitlines() if line.startswith("Shell command: "))
    assert len(commands) > 100, done.stdout[-2000:]
    return commands


def test_the_plan_does_not_depend_on_the_hash_seed(tmp_path):
    (tmp_path / "demo_data").symlink_to(ROOT / "demo_data")
    first, second = planned_commands(tmp_path, 0), planned_commands(tmp_path, 1)
    differing = [(a, b) for a, b in zip(first, second) if a != b]
    assert len(first) == len(second) and not differing, differing[:2]
