"""Dataset mixtures and evaluation-only datasets: the sampling plan, the mix stage, the config checks, the
matrix, and a two-model, two-dataset mixture run through Snakemake whose comparison groups by model."""
from __future__ import annotations

import copy
import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import build_tiny_tokenised
from data_helpers import default_config
from workflow_scripts import mix
from workflow_scripts.checks.config import check_config
from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core.config_files import validate_schema
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.core.section_settings import MixtureSettings
from workflow_scripts.data import mixture

ROOT = Path(__file__).resolve().parent.parent


# The plan ------------------------------------------------------------------------------------------

def test_weights_are_normalised_and_temperature_flattens_towards_uniform():
    sizes = {"big": 900, "small": 100}
    assert mixture.proportions(sizes, {"big": 1, "small": 3}) == {"big": 0.25, "small": 0.75}
    by_size = mixture.proportions(sizes)
    assert by_size == pytest.approx({"big": 0.9, "small": 0.1})
    warm = mixture.proportions(sizes, temperature=2)  # sqrt: 30 vs 10
    assert warm == pytest.approx({"big": 0.75, "small": 0.25})
    assert mixture.proportions(sizes, temperature=1e6)["small"] == pytest.approx(0.5, abs=1e-4)


def test_counts_sum_exactly_to_the_rows_asked_for():
    shares = {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}
    assert mixture.counts(shares, 100) == {"a": 34, "b": 33, "c": 33}
    assert sum(mixture.counts({"a": 0.123, "b": 0.877}, 997).values()) == 997


def test_a_small_dataset_is_repeated_only_after_every_row_was_used():
    picked = mixture.draw(10, 25, np.random.default_rng(0))
    assert len(picked) == 25
    assert sorted(picked[:10]) == list(range(10)) and sorted(picked[10:20]) == list(range(10))
    assert max(Counter(picked.tolist()).values()) == 3


def test_the_plan_follows_the_proportions_and_its_seed():
    sizes = {"a": 50, "b": 10}
    first = mixture.plan(sizes, MixtureSettings.parse({"datasets": ["a", "b"], "weights": {"a": 1, "b": 1}, "rows": 40,
                                                       "seed": 3}))
    assert first.counts == {"a": 20, "b": 20}
    assert Counter(first.sources.tolist()) == {0: 20, 1: 20}
    again = mixture.plan(sizes, MixtureSettings.parse({"datasets": ["a", "b"], "weights": {"a": 1, "b": 1}, "rows": 40,
                                                       "seed": 3}))
    assert np.array_equal(first.rows, again.rows) and np.array_equal(first.sources, again.sources)
    other = mixture.plan(sizes, MixtureSettings.parse({"datasets": ["a", "b"], "weights": {"a": 1, "b": 1}, "rows": 40,
                                                       "seed": 4}))
    assert not np.array_equal(first.rows, other.rows)
    default = mixture.plan(sizes, MixtureSettings.parse({"datasets": ["a", "b"]}))
    assert default.counts == {"a": 50, "b": 10}  # no weights, no temperature: every row once


# The mix stage ---------------------------------------------------------------------------------------

def _components(tmp_path, **metas):
    first = build_tiny_tokenised(tmp_path / "first", rows=30, seed=1, validation_rows=4)
    second = build_tiny_tokenised(tmp_path / "second", rows=10, seed=2, validation_rows=3)
    for key, value in metas.items():
        meta = json.loads((second / "tokenise_meta.json").read_text())
        meta[key] = value
        (second / "tokenise_meta.json").write_text(json.dumps(meta))
    return first, second


def _mix(tmp_path, first, second, settings):
    out, report = tmp_path / "mixed", tmp_path / "mixed_report.json"
    settings = {"datasets": ["first", "second"], **settings}  # as the rule passes the mixture
    code = mix.main(["--mixture", "both", "--settings", json.dumps(settings), "--component", f"first={first}",
                     "--component", f"second={second}", "--out", str(out), "--report", str(report)])
    return code, out, report


def test_mix_draws_the_planned_rows_with_their_dataset_in_the_id(tmp_path):
    from datasets import load_from_disk

    first, second = _components(tmp_path)
    code, out, report_path = _mix(tmp_path, first, second, {"weights": {"first": 1, "second": 1}, "rows": 40, "seed": 0})
    assert code == 0
    data = load_from_disk(str(out))
    report = json.loads(report_path.read_text())
    assert report["components"]["first"]["drawn"] == 20 and report["components"]["second"]["drawn"] == 20
    assert report["oversampled"] == ["second"] and report["components"]["second"]["passes"] == 2.0
    sources = Counter(row_id.split("/")[0] for row_id in data["train"]["id"])
    assert sources == {"first": 20, "second": 20}
    # Every row is a component's row, unchanged but for the prefixed id.
    originals = {f"{name}/{row['id']}": row["input_ids"] for name, directory in (("first", first), ("second", second))
                 for row in load_from_disk(str(directory))["train"]}
    assert all(originals[row["id"]] == row["input_ids"] for row in data["train"])
    assert len(data["validation"]) == 7  # held out whole: 4 + 3
    meta = json.loads((out / "tokenise_meta.json").read_text())
    assert meta["task"] == "generation" and meta["mixture"]["components"]["first"]["share"] == 0.5
    (tmp_path / "again").mkdir()
    _, again, _ = _mix(tmp_path / "again", first, second, {"weights": {"first": 1, "second": 1}, "rows": 40, "seed": 0})
    assert load_from_disk(str(again))["train"]["id"] == data["train"]["id"]  # the same seed, the same rows


def test_components_tokenised_differently_are_refused_naming_the_key(tmp_path):
    first, second = _components(tmp_path, max_length=128)
    with pytest.raises(ConfigError, match=r"mixtures\.both\.datasets': 'first' and 'second' were tokenised with "
                                          r"different max_length \(64 vs 128\)"):
        _mix(tmp_path, first, second, {})
    assert not (tmp_path / "mixed").exists() and not (tmp_path / "mixed_report.json").exists()


def test_a_mixture_repeating_a_component_far_beyond_its_rows_is_refused_unless_allowed(tmp_path):
    """rows: 1000000 from 1,033 rows repeated each ~968 times without a word; now more than max_passes (10 by
    default) repetitions stop the mix stage, naming the key, the component and its rows."""
    first, second = _components(tmp_path)  # 30 and 10 train rows
    settings = {"weights": {"first": 1, "second": 1}, "rows": 240, "seed": 0}  # second: 120 of 10 rows
    with pytest.raises(ConfigError, match=r"config key 'mixtures\.both\.rows': draws 120 rows from 'second', whose "
                                          r"train split has 10: each row would be repeated about 12 times, more "
                                          r"than max_passes \(10\); .*raise mixtures\.both\.max_passes"):
        _mix(tmp_path, first, second, settings)
    assert not (tmp_path / "mixed").exists() and not (tmp_path / "mixed_report.json").exists()
    code, _, report = _mix(tmp_path, first, second, {**settings, "max_passes": 12})
    assert code == 0 and json.loads(report.read_text())["components"]["second"]["passes"] == 12.0


def test_a_component_argument_without_a_directory_is_one_line(tmp_path):
    with pytest.raises(WorkflowError, match=r"argument --component: expected NAME=DIR, got 'first'"):
        mix.main(["--mixture", "m", "--settings", "{}", "--component", "first", "--component", "b=x",
                  "--out", str(tmp_path / "o"), "--report", str(tmp_path / "r.json")])


# The config ---------------------------------------------------------------------------------------

def mixture_config() -> dict:
    """The demo config with a mixture of two generation datasets (one trained only inside it) and an
    evaluation-only dataset."""
    config = default_config()
    config["mixtures"] = {"qa_mix": {"datasets": ["chartqa_demo", "ocrvqa_demo"], "temperature": 2,
                                     "models": ["tiny-llama"]}}
    config["datasets"]["ocrvqa_demo"]["train_alone"] = False
    evaluation_only = copy.deepcopy(config["datasets"]["chartqa_demo"])
    evaluation_only.update(splits={"validation": "val", "test": "test"}, evaluation_split="validation")
    config["datasets"]["chart_eval"] = evaluation_only
    return config


def checked(config: dict) -> dict:
    config = copy.deepcopy(config)
    validate_schema(config)
    check_config(config)
    return config


def test_the_matrix_trains_datasets_and_mixtures_and_scores_each_on_its_datasets():
    config = checked(mixture_config())
    trained = {(m, d) for m, d, _, _ in xc.experiments(config)}
    assert ("tiny-llama", "qa_mix") in trained and ("tiny-llama", "chartqa_demo") in trained
    assert ("tiny-llama", "ocrvqa_demo") not in trained and ("tiny-llama", "chart_eval") not in trained
    scored = {(d, e) for m, d, v, s, e in xc.evaluations(config) if v == "baseline"}
    assert {("qa_mix", "chartqa_demo"), ("qa_mix", "ocrvqa_demo"), ("qa_mix", "chart_eval"),
            ("chartqa_demo", "chartqa_demo"), ("chartqa_demo", "chart_eval"), ("amr_demo", "chart_eval")} <= scored
    # Classification runs are not scored on a generation dataset.
    assert not {e for m, d, v, s, e in xc.evaluations(config) if d == "topics_demo"} - {"topics_demo"}
    assert ("tiny-llama", "chart_eval", "mtup") in set(xc.model_dataset_variants(config))
    assert xc.evaluation_split(config, "chart_eval") == "validation"
    assert xc.evaluation_split(config, "chartqa_demo") == "test"


@pytest.mark.parametrize("change, message", [
    (lambda c: c["mixtures"].update(chartqa_demo={"datasets": ["amr_demo", "ocrvqa_demo"]}),
     r"mixtures\.chartqa_demo': 'chartqa_demo' is also a dataset name"),
    (lambda c: c["mixtures"]["qa_mix"].update(datasets=["chartqa_demo", "nope"]),
     r"mixtures\.qa_mix\.datasets': 'nope' is not a dataset of this config"),
    (lambda c: c["mixtures"]["qa_mix"].update(datasets=["chartqa_demo", "chart_eval"]),
     r"mixtures\.qa_mix\.datasets': 'chart_eval' has no train split"),
    (lambda c: c["mixtures"]["qa_mix"].update(datasets=["chartqa_demo", "topics_demo"]),
     r"mixtures\.qa_mix\.datasets': components of different tasks"),
    (lambda c: c["mixtures"]["qa_mix"].update(weights={"chartqa_demo": 1, "ocrvqa_demo": 2}),
     r"mixtures\.qa_mix': give weights or temperature, not both"),
    (lambda c: (c["mixtures"]["qa_mix"].pop("temperature"), c["mixtures"]["qa_mix"].update(weights={"chartqa_demo": 1})),
     r"mixtures\.qa_mix\.weights': needs one weight per component"),
    (lambda c: c["mixtures"]["qa_mix"].update(models=["gpt-5"]),
     r"mixtures\.qa_mix\.models': 'gpt-5' is not a model of this config"),
    (lambda c: c.pop("mixtures"),
     r"datasets\.ocrvqa_demo\.train_alone': false, but no mixture holds this dataset"),
    (lambda c: c["datasets"]["chart_eval"].update(evaluation_split="test", splits={"validation": "val"}),
     r"datasets\.chart_eval\.evaluation_split': 'test' is not a split of dataset 'chart_eval'"),
    (lambda c: c["datasets"]["ocrvqa_demo"].update(splits={"train": "train"}),  # a component without held-out rows
     r"evaluation\.split': 'test' is not a split of dataset 'ocrvqa_demo' \(its splits: \['train'\]\); it has no "
     r"held-out split to score; add one to datasets\.ocrvqa_demo\.splits \(e\.g\. test: <the source split of held-out rows>\)$"),
    (lambda c: c["datasets"]["chart_eval"].update(models=["tiny-bert"]),
     r"datasets\.chart_eval': no model trained on a dataset or mixture of task 'generation' runs on its models"),
])
def test_mixture_and_evaluation_only_mistakes_are_refused_in_one_line(change, message):
    config = mixture_config()
    change(config)
    with pytest.raises(ConfigError, match=message):
        checked(config)


# Through Snakemake: two models x two datasets, mixed, plus an evaluation-only dataset -------------------

@pytest.mark.slow
def test_a_two_model_two_dataset_mixture_runs_and_the_comparison_groups_by_model(tmp_path):
    """Only a real run shows the mixed set drawn, trained and scored on each part and on an evaluation-only
    dataset per model, and the published comparison grouped by model (the tests above check the plan and the
    config's refusals without running it)."""
    from test_workflow_e2e import snakemake

    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    llama = config["models"]["tiny-llama"]
    config["models"] = {"tiny-a": llama, "tiny-b": {**copy.deepcopy(llama), "tiny": {**llama["tiny"], "hidden_size": 32}}}
    datasets = {name: config["datasets"][name] for name in ("chartqa_demo", "ocrvqa_demo")}
    for dataset in datasets.values():
        dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
        dataset.pop("models")
        dataset["train_alone"] = False
    evaluation_only = copy.deepcopy(datasets["chartqa_demo"])
    evaluation_only.update(splits={"validation": "val"}, evaluation_split="validation", models=["tiny-a"])
    config["datasets"] = {**datasets, "chart_val": evaluation_only}
    config["mixtures"] = {"qa_mix": {"datasets": ["chartqa_demo", "ocrvqa_demo"], "weights": {"chartqa_demo": 1, "ocrvqa_demo": 1},
                                     "rows": 60}}
    config["variants"] = {"baseline": config["variants"]["baseline"]}
    config["comparison"]["reference_variant"] = "baseline"
    config["seeds"] = [1]
    # The point is the matrix and its grouping, not learning: a few steps and examples (issue 25: 90 s before).
    config["training"].update(max_steps=6, warmup_steps=1, log_every=2, validation={"every_steps": 3})
    config["evaluation"]["max_examples"] = 12
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake(tmp_path)

    rows = list(csv.DictReader((tmp_path / "results" / "comparison.csv").open()))
    assert {(r["model"], r["trained_on"], r["dataset"]) for r in rows} == {
        ("tiny-a", "qa_mix", "chartqa_demo"), ("tiny-a", "qa_mix", "ocrvqa_demo"), ("tiny-a", "qa_mix", "chart_val"),
        ("tiny-b", "qa_mix", "chartqa_demo"), ("tiny-b", "qa_mix", "ocrvqa_demo")}
    # Grouped by model: all of tiny-a's rows come before tiny-b's.
    models = [r["model"] for r in rows]
    assert models == sorted(models, key=["tiny-a", "tiny-b"].index)
    # The untrained model's score (evaluate_base per model and evaluated dataset) reaches every mixture row.
    assert all(r["base_score"] != "" for r in rows), rows
    report = json.loads((tmp_path / "results/data/qa_mix/tokenised/tiny-a/baseline_report.json").read_text())
    assert {name: part["drawn"] for name, part in report["components"].items()} == {"chartqa_demo": 30, "ocrvqa_demo": 30}
    evaluated = json.loads((tmp_path / "results/tiny-a/qa_mix/baseline/seed1/on_chart_val/eval.json").read_text())
    assert evaluated["split"] == "validation" and evaluated["dataset"] == "chart_val"
    markdown = (tmp_path / "results" / "comparison.md").read_text()
    assert "| model | trained on | dataset |" in markdown
    assert (tmp_path / "results/plots/scores_tiny-b_qa_mix_on_ocrvqa_demo.png").is_file()
    assert (tmp_path / "results/plots/loss_tiny-a_qa_mix.png").is_file()
