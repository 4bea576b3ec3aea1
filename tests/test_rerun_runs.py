"""Exact reruns, run for real (issue 35): on one finished run of the demo's AMR experiment (baseline and mtup,
one seed, a few training steps and a few test examples), each common change is brought up to date by ONE
``snakemake``, after which a dry run plans nothing and the comparison reflects the change.

Before issue 35: a seed added ran only the power estimate (exit 0; the seed was never trained), an evaluation
setting left the trained runs' evaluations stale beside rerun untrained ones, and a scoring change reran the
data chain and retrained (test_reruns.py checks the same plans by dry runs, cheaply).
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import yaml

import snakemake_fork
from test_dag import absolute_demo_config

ROOT = Path(__file__).resolve().parent.parent
RUN = Path("results/tiny-llama/amr_demo")

pytestmark = pytest.mark.slow


def small_config() -> dict:
    config = absolute_demo_config(["amr_demo"])
    config["seeds"] = [1]
    config["training"].update(max_steps=12, warmup_steps=2, validation={"every_steps": 6})
    config["evaluation"].update(max_examples=6, max_new_tokens=24)
    return config


def run(directory: Path, config: dict, *arguments: str) -> str:
    """One ``snakemake`` (or a dry run) in ``directory`` on ``config``; the jobs it ran, from its log."""
    (directory / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--configfile", "config.yaml",
                                       "--replace-workflow-config", "--cores", "2", *arguments],
                                      cwd=directory, timeout=1500)
    assert code == 0, output[-6000:]
    return output


def ran(output: str) -> set[tuple[str, str | None]]:
    """(rule, seed) of the jobs a run executed."""
    jobs = set()
    for block in re.split(r"\n(?=(?:local)?(?:rule|checkpoint) \w+:)", output):
        rule = re.match(r"(?:local)?(?:rule|checkpoint) (\w+):", block)
        if rule and rule.group(1) != "all":
            seed = re.search(r"wildcards: .*?seed=(\d+)", block)
            jobs.add((rule.group(1), seed.group(1) if seed else None))
    return jobs


def up_to_date(directory: Path, config: dict) -> None:
    output = run(directory, config, "--dry-run")
    assert "Nothing to be done" in output, output[-3000:]


def comparison_rows(directory: Path) -> list[dict]:
    return list(csv.DictReader((directory / "results" / "comparison.csv").open()))


def eval_jsons(directory: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted((directory / RUN).glob("*/*/eval.json"))]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reruns")
    config = small_config()
    run(directory, config)
    up_to_date(directory, config)
    return directory, config


def test_a_seed_added_is_trained_evaluated_and_compared_in_one_run(finished):
    directory, config = finished
    config["seeds"] = [1, 2]
    jobs = ran(run(directory, config))
    assert jobs == {("train", "2"), ("evaluate", "2"), ("compare", None)}, jobs
    up_to_date(directory, config)
    assert {row["seeds"] for row in comparison_rows(directory)} == {"1 2"}


def test_an_evaluation_setting_reevaluates_trained_and_untrained_runs_without_training(finished):
    directory, config = finished
    config["evaluation"]["max_new_tokens"] = 16
    jobs = ran(run(directory, config))
    assert {rule for rule, _ in jobs} == {"evaluate", "evaluate_base", "power", "compare"}, jobs
    up_to_date(directory, config)
    recorded = {e["manifest"]["settings"]["evaluation"]["max_new_tokens"] for e in eval_jsons(directory)}
    assert recorded == {16}  # trained and untrained alike, which compare now checks


def test_a_scoring_change_rescores_without_data_or_training_stages(finished):
    """A further metric that reads no PENMAN graph (exact_match): the dataset's graph metrics stay smatch and
    smatchpp, so normalise's gold-graph check, and so the data and training, are untouched (dropping smatchpp
    changes which gold graphs are kept, and renormalises: tests/test_reruns.py)."""
    directory, config = finished
    assert "smatchpp" in (directory / "results" / "comparison.md").read_text()
    config["datasets"]["amr_demo"]["also_metrics"] = ["smatchpp", "exact_match"]
    jobs = ran(run(directory, config))
    assert {rule for rule, _ in jobs} == {"evaluate", "evaluate_base", "power", "compare"}, jobs
    up_to_date(directory, config)
    assert {row["metric"] for row in comparison_rows(directory)} == {"smatch", "smatchpp", "exact_match"}


def test_a_training_setting_retrains_every_seed_and_reevaluates(finished):
    directory, config = finished
    config["training"]["learning_rate"] *= 0.5
    jobs = ran(run(directory, config))
    assert {rule for rule, _ in jobs} == {"sanity", "train", "evaluate", "compare"}, jobs
    up_to_date(directory, config)
    manifests = [json.loads(p.read_text()) for p in (directory / RUN).glob("*/seed*/run_manifest.json")]
    assert {m["settings"]["learning_rate"] for m in manifests} == {config["training"]["learning_rate"]}
    compared = (directory / "results" / "comparison.md").stat().st_mtime
    assert all(compared >= p.stat().st_mtime for p in (directory / RUN).glob("*/seed*/eval.json"))


def test_a_template_change_reruns_that_variant_only(finished):
    directory, config = finished
    config["variants"]["mtup"]["prompt"] = "Q: {question}\nSolve Task 1 then Task 2.\n"
    jobs = ran(run(directory, config))
    assert {rule for rule, _ in jobs} == {"pretokenise", "evaluate_base", "power", "sanity", "train", "evaluate",
                                          "compare"}, jobs
    up_to_date(directory, config)
    evaluated = [e for e in eval_jsons(directory) if e["variant"] == "mtup"]
    assert {e["manifest"]["settings"]["variant"]["prompt"] for e in evaluated} == {
        config["variants"]["mtup"]["prompt"]}
