"""Exact reruns, run for real (issue 35): on one finished run of the demo's AMR experiment (baseline and mtup,
one seed, a few training steps and a few test examples), each common change is brought up to date by ONE
``snakemake``, after which a dry run plans nothing and the comparison reflects the change.

Before issue 35: a seed added ran only the power estimate (exit 0; the seed was never trained), an evaluation
setting left the trained runs' evaluations stale beside rerun untrained ones, and a scoring change reran the
data chain and retrained (test_reruns.py checks the same plans by dry runs, cheaply). What only these real runs
show: that Snakemake then runs what it planned (its ancient() inputs once skipped planned jobs while running,
snakemake#4166), and that the results on disk follow the change.

The finished run is made once per module; each test changes its own copy of it (``cp -a``: the files, their
times and Snakemake's records), so every test starts from the same one-seed run and reruns only its change.
"""
from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

import snakemake_fork
from test_dag import absolute_demo_config

ROOT = Path(__file__).resolve().parent.parent
RUN = Path("results/tiny-llama/amr_demo")
VARIANTS = ("baseline", "mtup")

pytestmark = pytest.mark.slow


def small_config() -> dict:
    config = absolute_demo_config(["amr_demo"])
    config["seeds"] = [1]
    # As small as the points allow: what reruns does not depend on how long training runs or how much is scored.
    config["training"].update(max_steps=4, warmup_steps=1, validation={"every_steps": 2})
    config["evaluation"].update(max_examples=4, max_new_tokens=12)
    return config


def run(directory: Path, config: dict, *arguments: str) -> str:
    """One ``snakemake`` (or a dry run) in ``directory`` on ``config``; the jobs it ran, from its log."""
    (directory / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--configfile", "config.yaml",
                                       "--replace-workflow-config", "--cores", "2", *arguments],
                                      cwd=directory, timeout=1500)
    assert code == 0, output[-6000:]
    return output


def ran(output: str) -> set[tuple[str, str | None, str | None]]:
    """(rule, variant, seed) of the jobs a run executed (None where the job has no such wildcard)."""
    jobs = set()
    for block in re.split(r"\n(?=(?:local)?(?:rule|checkpoint) \w+:)", output):
        rule = re.match(r"(?:local)?(?:rule|checkpoint) (\w+):", block)
        if rule and rule.group(1) != "all":
            found = re.search(r"^\s*wildcards: (.*)$", block, re.MULTILINE)
            wildcards = dict(item.split("=", 1) for item in found.group(1).split(", ")) if found else {}
            jobs.add((rule.group(1), wildcards.get("variant"), wildcards.get("seed")))
    return jobs


def up_to_date(directory: Path, config: dict) -> None:
    output = run(directory, config, "--dry-run")
    assert "Nothing to be done" in output, output[-3000:]


def comparison_rows(directory: Path) -> list[dict]:
    return list(csv.DictReader((directory / "results" / "comparison.csv").open()))


def eval_jsons(directory: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((directory / RUN).glob("*/*/eval.json"))]


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory) -> Path:
    """The finished one-seed run, made once: the tests change copies of it."""
    directory = tmp_path_factory.mktemp("reruns") / "run"
    directory.mkdir()
    config = small_config()
    run(directory, config)
    up_to_date(directory, config)
    return directory


@pytest.fixture
def finished(finished_once, tmp_path) -> tuple[Path, dict]:
    """This test's own copy of the finished run, and its config (a fresh one, the test's to change)."""
    directory = tmp_path / "run"
    # cp -a keeps every file's and directory's times and Snakemake's records (.snakemake): still up to date.
    subprocess.run(["cp", "-a", str(finished_once), str(directory)], check=True)
    return directory, small_config()


def every_variant(*jobs: tuple[str, str | None]) -> set[tuple[str, str | None, str | None]]:
    """(rule, variant, seed) for each (rule, seed) given, in every variant."""
    return {(rule, variant, seed) for rule, seed in jobs for variant in VARIANTS}


COMPARE, POWER = ("compare", None, None), ("power", None, None)


def test_a_seed_added_is_trained_evaluated_and_compared_in_one_run(finished):
    """Only a real run shows the new seed trained: a dry run planned it before issue 35 too, and then the run
    itself executed only the power estimate (exit 0)."""
    directory, config = finished
    config["seeds"] = [1, 2]
    jobs = ran(run(directory, config))
    assert jobs == every_variant(("train", "2"), ("evaluate", "2")) | {COMPARE}, jobs
    up_to_date(directory, config)
    assert {row["seeds"] for row in comparison_rows(directory)} == {"1 2"}


def test_an_evaluation_setting_reevaluates_trained_and_untrained_runs_without_training(finished):
    """Only a real run shows every evaluation redone with the new setting: before issue 35 the trained runs'
    evaluations stayed stale beside rerun untrained ones, a plan that a dry run does not reveal."""
    directory, config = finished
    config["evaluation"]["max_new_tokens"] = 8
    jobs = ran(run(directory, config))
    assert jobs == every_variant(("evaluate", "1"), ("evaluate_base", None)) | {POWER, COMPARE}, jobs
    up_to_date(directory, config)
    recorded = {e["manifest"]["settings"]["evaluation"]["max_new_tokens"] for e in eval_jsons(directory)}
    assert recorded == {8}  # trained and untrained alike, which compare now checks


def test_a_scoring_change_rescores_without_data_or_training_stages(finished):
    """Only a real run shows the published table follow a scoring change with no data or training stage run. A
    further metric that reads no PENMAN graph (exact_match): the dataset's graph metrics stay smatch and smatchpp,
    so normalise's gold-graph check, and so the data and training, are untouched (dropping smatchpp changes which
    gold graphs are kept, and renormalises: a dry run shows it)."""
    directory, config = finished
    assert "smatchpp" in (directory / "results" / "comparison.md").read_text()
    config["datasets"]["amr_demo"]["also_metrics"] = ["smatchpp", "exact_match"]
    jobs = ran(run(directory, config))
    assert jobs == every_variant(("evaluate", "1"), ("evaluate_base", None)) | {POWER, COMPARE}, jobs
    up_to_date(directory, config)
    assert {row["metric"] for row in comparison_rows(directory)} == {"smatch", "smatchpp", "exact_match"}


def test_a_training_setting_retrains_every_seed_and_reevaluates(finished):
    """Only a real run shows the adapters retrained with the new setting (their manifests) and the comparison
    made after every new evaluation."""
    directory, config = finished
    config["training"]["learning_rate"] *= 0.5
    jobs = ran(run(directory, config))
    assert jobs == every_variant(("sanity", None), ("train", "1"), ("evaluate", "1")) | {COMPARE}, jobs
    up_to_date(directory, config)
    manifests = [json.loads(p.read_text()) for p in (directory / RUN).glob("*/seed*/run_manifest.json")]
    assert len(manifests) == len(VARIANTS)
    assert {m["settings"]["learning_rate"] for m in manifests} == {config["training"]["learning_rate"]}
    compared = (directory / "results" / "comparison.md").stat().st_mtime
    assert all(compared >= p.stat().st_mtime for p in (directory / RUN).glob("*/seed*/eval.json"))


def test_a_template_change_reruns_that_variant_only(finished):
    """Only a real run shows the changed variant's chain rerun with its new template and the other variant's
    results kept: every job the run executed is named with its variant, so a run that redid baseline fails."""
    directory, config = finished
    config["variants"]["mtup"]["prompt"] = "Q: {question}\nSolve Task 1 then Task 2.\n"
    kept = {path: path.stat().st_mtime_ns for path in (directory / RUN / "baseline").rglob("*")}
    jobs = ran(run(directory, config))
    assert jobs == {("pretokenise", "mtup", None), ("evaluate_base", "mtup", None), ("sanity", "mtup", None),
                    ("train", "mtup", "1"), ("evaluate", "mtup", "1"), POWER, COMPARE}, jobs
    up_to_date(directory, config)
    assert kept and {path: path.stat().st_mtime_ns for path in (directory / RUN / "baseline").rglob("*")} == kept
    evaluated = [e for e in eval_jsons(directory) if e["variant"] == "mtup"]
    assert {e["manifest"]["settings"]["variant"]["prompt"] for e in evaluated} == {
        config["variants"]["mtup"]["prompt"]}


def test_until_sanity_on_a_fresh_run_runs_every_gate_after_the_power_estimate(tmp_path):
    """Issue 44: a gate that never ran waits for the power checkpoint, and after the checkpoint ran Snakemake
    dropped every gate from ``--until sanity`` whose own inputs were made by then ("8 of 10 steps (80%) done",
    exit 0, no gate; rules/common.smk keep_gate_under_until). Every gate runs now, after the estimate and nothing after the gates;
    a later full run plans no gate again (the gate's recorded inputs do not change)."""
    directory = tmp_path / "run"
    directory.mkdir()
    config = small_config()
    # The data stages first: a gate whose own inputs were still being made when the estimate finished was kept
    # (those jobs gave it a reason to run), so without this the old failure depended on the job order.
    run(directory, config, "--until", "pretokenise")
    jobs = ran(run(directory, config, "--until", "sanity"))
    assert every_variant(("sanity", None)) <= jobs and POWER in jobs, jobs
    assert not {rule for rule, _, _ in jobs} & {"train", "evaluate", "compare"}, jobs
    assert all((directory / RUN / variant / "sanity.json").exists() for variant in VARIANTS)
    planned = ran(run(directory, config, "--dry-run"))
    assert ("train", "baseline", "1") in planned and not {job for job in planned if job[0] in ("sanity", "power")}
