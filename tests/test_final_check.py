"""The final check after a run (core/final_check.py, the Snakefile's onsuccess:): a run that leaves a planned
job out of date exits non-zero naming it, never a silent 0 (issue 35). Shown on snakemake#4166 itself: a
small workflow whose gate takes an ancient() input from a job that reruns, so Snakemake skips the new seed's
training after it."""
from __future__ import annotations

import snakemake_fork
from data_helpers import ROOT

SNAKEFILE = """
import sys
sys.path.insert(0, {root!r})
from workflow_scripts.core import final_check

SEEDS = config.get("seeds", [1])

rule all:
    input: "compare.txt"

rule power:
    output: "power.txt"
    params: seeds=len(SEEDS)
    shell: "echo {{params.seeds}} > {{output}}"

rule sanity:
    input: ancient("power.txt")
    output: "sanity.txt"
    shell: "echo gate > {{output}}"

rule train:
    input: "sanity.txt"
    output: "train_{{seed}}.txt"
    shell: "echo trained > {{output}}"

rule compare:
    input: expand("train_{{seed}}.txt", seed=SEEDS)
    output: "compare.txt"
    shell: "cat {{input}} > {{output}}"

onsuccess:
    final_check.check_up_to_date(workflow)
"""


def test_a_run_that_leaves_a_planned_job_out_of_date_fails_naming_it(tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE.format(root=str(ROOT)))
    code, output = snakemake_fork.run(["--cores", "1"], cwd=tmp_path)
    assert code == 0, output[-3000:]  # a first run: everything runs, nothing is left
    code, output = snakemake_fork.run(["--cores", "1", "--config", "seeds=[1,2]"], cwd=tmp_path)
    assert not (tmp_path / "train_2.txt").exists()  # snakemake#4166: only power ran
    assert code != 0, output[-3000:]
    assert "job(s) it should have run are still out of date" in output
    assert "train (train_2.txt): Missing output files: train_2.txt" in output
    assert "Run snakemake again" in output
    # as the message says: the next run brings it up to date, and passes the check
    code, output = snakemake_fork.run(["--cores", "1", "--config", "seeds=[1,2]"], cwd=tmp_path)
    assert code == 0 and (tmp_path / "train_2.txt").exists(), output[-3000:]
