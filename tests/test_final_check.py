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


def test_compare_records_the_tables_it_publishes_and_a_hand_edit_is_refused(tmp_path):
    """Issue 44: a hand-edited results/comparison.md survived every rerun (Snakemake never reads an output's
    content). compare records the sha256 of the tables it writes in the set's stamp; the check names an edited
    one, and lets an unchanged table, a missing one and a stamp written before the record through."""
    import hashlib
    import json

    import pytest
    from test_compare import COMPARISON, EXPERIMENTS, write_experiment  # noqa: F401
    from workflow_scripts import compare
    from workflow_scripts.core import final_check
    from workflow_scripts.core.errors import WorkflowError

    from test_compare import correct
    root = tmp_path / "results"
    for experiment in EXPERIMENTS:
        _, dataset, variant, seed = experiment
        write_experiment(root, dataset, variant, seed, correct(10 if variant == "baseline" else 15))
    out, stamp = tmp_path / "out", tmp_path / "stamp.json"
    assert compare.main(["--results-dir", str(root), "--experiments", json.dumps(EXPERIMENTS), "--comparison",
                         json.dumps(COMPARISON), "--out-csv", str(out / "c.csv"), "--out-markdown", str(out / "c.md"),
                         "--plots-dir", str(out / "plots"), "--experiment-set-out", str(stamp)]) == 0
    recorded = json.loads(stamp.read_text())["published"]
    assert recorded == {str(out / name): hashlib.sha256((out / name).read_bytes()).hexdigest() for name in ("c.md", "c.csv")}
    final_check.check_published(str(stamp))  # as written

    table = (out / "c.md").read_text()
    (out / "c.md").write_text(table.replace("| mtup |", "| mtup (best) |", 1))
    with pytest.raises(WorkflowError) as caught:
        final_check.check_published(str(stamp))
    message = str(caught.value)
    assert message.startswith(f"{out / 'c.md'} changed since compare wrote it (the sha256 recorded in {stamp} ")
    assert message.endswith(f"then delete {out / 'c.md'} and run snakemake again (or run it with --forcerun compare): compare writes it anew")
    assert "\n" not in message
    assert (out / "c.md").read_text() != table  # the user's edit is left as it is

    (out / "c.md").write_text(table)
    final_check.check_published(str(stamp))
    (out / "c.md").unlink()  # missing: Snakemake reruns compare for it
    final_check.check_published(str(stamp))
    stamp.write_text(json.dumps({"experiments": EXPERIMENTS}))  # written before the record was kept
    final_check.check_published(str(stamp))
    final_check.check_published(str(tmp_path / "no-stamp.json"))


def test_a_hand_edited_comparison_stops_the_workflow_before_it_plans(tmp_path):
    """The real Snakefile, dry runs: the table of the current set edited after compare wrote it ends in the
    check's one message (a run with nothing to do reaches no onsuccess:), leaving the edit; with the table
    deleted, as the message says, compare is planned to write it anew."""
    import hashlib
    import json
    import re

    from test_dag import absolute_demo_config, config_file
    from test_dry_run_families import dry_run

    config = config_file(tmp_path, absolute_demo_config(datasets=["amr_demo"]))
    arguments = ("--configfile", str(config), "--replace-workflow-config", "--cores", "1")
    code, output = dry_run(tmp_path, "-n", "-p", *arguments)
    assert code == 0, output[-3000:]
    (stamp,) = set(re.findall(r"--experiment-set-out (results/experiment_sets/[0-9a-f]{16}\.json)", output))
    table = tmp_path / "results" / "comparison.md"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text("| model | dataset |\n")
    (tmp_path / stamp).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / stamp).write_text(json.dumps({"published": {
        "results/comparison.md": hashlib.sha256(table.read_bytes()).hexdigest()}}))
    code, output = dry_run(tmp_path, "-n", *arguments)
    assert code == 0, output[-3000:]

    table.write_text("| model | dataset | (edited) |\n")
    code, output = dry_run(tmp_path, "-n", *arguments)
    assert code != 0
    assert f"results/comparison.md changed since compare wrote it (the sha256 recorded in {stamp} " in output
    assert table.read_text() == "| model | dataset | (edited) |\n"
    # the message's other way out: compare forced writes the table anew (the check is made when the plan is built,
    # where the forced rules are known; Snakemake reads the workflow before it knows them)
    code, output = dry_run(tmp_path, "-n", "--forcerun", "compare", *arguments)
    assert code == 0 and "rule compare:" in output, output[-3000:]
    table.unlink()
    code, output = dry_run(tmp_path, "-n", *arguments)
    assert code == 0 and "rule compare:" in output, output[-3000:]
