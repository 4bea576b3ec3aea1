"""The task's metric during training (training.validation.metric_examples and criterion): logged at each
validation point, equal to what evaluate computes for the adapter of that step, selecting the kept adapter,
leaving training unchanged, the same on 1 and 2 processes, and refused where it cannot work."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

import ranks
from conftest import tiny_training_settings
from test_evaluate import BASELINE, QUESTIONS, tiny_model  # noqa: F401 (a fixture)
from test_mixtures import mixture_config
from test_train import adapter, log_rows, train_argv
from workflow_scripts import evaluate, pretokenise, train
from workflow_scripts.checks.config import check_config
from workflow_scripts.core.config_files import validate_schema
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.training import validation, validation_metric
from workflow_scripts.training.training_log import validation_metric_curves

METRIC = "token_f1"  # partial credit: a tiny model's outputs score between 0 and 1
EXAMPLES = 4


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def normalised(tmp_path_factory):
    """Normalised QA rows with train and validation splits; the validation split longer than metric_examples."""
    from datasets import Dataset, DatasetDict

    def split(prefix, rows):
        return Dataset.from_dict({"id": [f"{prefix}-{k}" for k in range(len(rows))], "question": [r[1] for r in rows],
                                  "answers": [r[2] for r in rows], "aux": ["number"] * len(rows)})

    directory = tmp_path_factory.mktemp("normalised") / "data"
    DatasetDict({"train": split("train", QUESTIONS * 3), "validation": split("validation", QUESTIONS)}
                ).save_to_disk(str(directory))
    (directory / "task_meta.json").write_text(json.dumps({"task": "generation"}))
    return directory


@pytest.fixture(scope="module")
def tokenised(tiny_model, normalised, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("tokenised") / "data"
    assert pretokenise.main(["--model", str(tiny_model), "--data", str(normalised), "--task", "generation",
                             "--variant", json.dumps(BASELINE), "--max-length", "64",
                             "--out", str(out), "--report", str(out.parent / "report.json")]) == 0
    return out


def metric_argument(normalised, metric=METRIC) -> str:
    return json.dumps({"task": "generation", "variant": BASELINE,
                       "evaluation": {"max_new_tokens": 6, "batch_size": 4, "max_length": 64},
                       "datasets": [{"name": "chart", "data": str(normalised), "metric": metric}]})


def settings_with(**validation_settings) -> dict:
    return tiny_training_settings(max_steps=6, checkpoint_every=100, micro_batch=4, effective_batch=8,
                                  lora={"dropout": 0.1}, validation=validation_settings)


def argv(out, model, data, settings, normalised=None) -> list[str]:
    extra = ["--validation-metric", metric_argument(normalised)] if normalised is not None else []
    return train_argv(out, model, data, settings) + extra


def evaluated(tmp_path, model, adapter_dir, normalised) -> float:
    """What the evaluate stage scores for ``adapter_dir`` on the first EXAMPLES validation rows."""
    name = Path(adapter_dir).name
    evaluation = {"split": "validation", "max_new_tokens": 6, "batch_size": 4, "max_examples": EXAMPLES, "gpus": 0}
    summary = tmp_path / f"eval-{name}.json"
    assert evaluate.main(["--model", str(model), "--adapter", str(adapter_dir), "--data", str(normalised),
                          "--task", "generation", "--variant", json.dumps(BASELINE), "--metric", METRIC,
                          "--evaluation", json.dumps(evaluation), "--dataset-name", "chart", "--variant-name",
                          "baseline", "--seed", "1", "--predictions-out", str(tmp_path / f"pred-{name}.jsonl"),
                          "--summary-out", str(summary)]) == 0
    result = json.loads(summary.read_text())
    assert result["n_examples"] == EXAMPLES
    return result["score"]


def test_the_metric_is_logged_at_each_validation_point_and_equals_evaluate_on_that_steps_adapter(
        monkeypatch, tmp_path, tiny_model, tokenised, normalised):  # noqa: F811
    saved = {}
    real_score = validation_metric.score

    def score_and_keep_the_adapter(setup, state):
        values = real_score(setup, state)
        step = len(saved) + 1
        setup.peft_model.save_pretrained(str(tmp_path / f"at-{step}"), safe_serialization=True)
        saved[step] = values
        return values

    monkeypatch.setattr(validation_metric, "score", score_and_keep_the_adapter)
    # Fast enough learning that the score moves (0 at first, then partial answers).
    settings = tiny_training_settings(max_steps=12, checkpoint_every=100, learning_rate=3e-2, lora={
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
        validation={"every_steps": 3, "metric_examples": EXAMPLES})
    out = tmp_path / "run"
    assert train.main(argv(out, tiny_model, tokenised, settings, normalised)) == 0
    rows = log_rows(out)
    points = [3, 6, 9, 12]
    assert [r["step"] for r in rows if "validation_metric" in r] == points
    assert [r["step"] for r in rows if "validation_loss" in r] == points
    logged = [r["validation_metric"] for r in rows if "validation_metric" in r]
    assert logged == [saved[k]["validation_metric"] for k in (1, 2, 3, 4)]
    assert len(set(logged)) > 1  # the adapters differ in what they answer, so the comparison below means something
    for k, value in zip((1, 2, 3, 4), logged):
        assert value == pytest.approx(evaluated(tmp_path, tiny_model, tmp_path / f"at-{k}", normalised), abs=1e-9)
    recorded = json.loads((out / "run_manifest.json").read_text())["validation"]
    assert recorded["criterion"] == "loss" and recorded["metric_examples"] == EXAMPLES
    assert recorded["validation_metrics"] == [[s, {"validation_metric": v}] for s, v in zip(points, logged)]
    assert validation_metric_curves(rows) == {"validation_metric": (points, logged)}


def test_the_metric_leaves_training_unchanged(tmp_path, tiny_model, tokenised, normalised):  # noqa: F811
    """Scoring (generation, eval mode, no gradients) changes no weight and draws from no training generator."""
    with_metric = settings_with(every_steps=2, metric_examples=EXAMPLES)
    assert train.main(argv(tmp_path / "a", tiny_model, tokenised, with_metric, normalised)) == 0
    assert train.main(argv(tmp_path / "b", tiny_model, tokenised, settings_with())) == 0
    assert [r["loss"] for r in log_rows(tmp_path / "a")] == [r["loss"] for r in log_rows(tmp_path / "b")]
    ours, theirs = adapter(tmp_path / "a"), adapter(tmp_path / "b")
    assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in ours)


def scripted(monkeypatch, values):
    sequence = iter(values)
    monkeypatch.setattr(validation, "held_out_loss", lambda *args, **kwargs: 1.0)  # flat: only the metric moves
    monkeypatch.setattr(validation_metric, "score", lambda *args: {"validation_metric": next(sequence)})


def test_criterion_metric_keeps_the_step_with_the_highest_score_and_stops_on_it(
        monkeypatch, tmp_path, tiny_model, tokenised, normalised):  # noqa: F811
    scripted(monkeypatch, [0.2, 0.6, 0.4, 0.5, 0.9])
    saved = {}
    real_save = validation.save_best

    def save_best(setup, checkpoint_dir, step):
        real_save(setup, checkpoint_dir, step)
        saved[step] = True

    monkeypatch.setattr(validation, "save_best", save_best)
    settings = tiny_training_settings(max_steps=10, checkpoint_every=100, validation={
        "every_steps": 2, "keep": "best", "early_stopping_patience": 2, "metric_examples": 2, "criterion": "metric"})
    assert train.main(argv(tmp_path, tiny_model, tokenised, settings, normalised)) == 0
    assert log_rows(tmp_path)[-1]["step"] == 8  # best 0.6 at step 4, then 0.4 and 0.5: stopped
    recorded = json.loads((tmp_path / "run_manifest.json").read_text())["validation"]
    assert recorded["best_step"] == 4 and recorded["best_validation_metric"] == 0.6
    assert recorded["criterion"] == "metric" and recorded["stopped_early_at_step"] == 8
    assert sorted(saved) == [2, 4]  # under criterion loss the flat loss would keep step 2 only


def test_selection_follows_the_metrics_direction():
    higher = validation.Selection()
    lower = validation.Selection()
    for step, value in ((1, 5.0), (2, 3.0), (3, 4.0)):
        higher.update(step, 1.0, {"validation_metric": value}, "metric", lower_is_better=False)
        lower.update(step, 1.0, {"validation_metric": value}, "metric", lower_is_better=True)
    assert (higher.best_step, higher.best_metric, higher.since_best) == (1, 5.0, 2)
    assert (lower.best_step, lower.best_metric, lower.since_best) == (2, 3.0, 1)
    by_loss = validation.Selection()
    for step, loss in ((1, 2.0), (2, 1.0)):
        by_loss.update(step, loss, {"validation_metric": 0.0})
    assert by_loss.best_step == 2 and by_loss.metric_history == [[1, {"validation_metric": 0.0}],
                                                                 [2, {"validation_metric": 0.0}]]
    restored = validation.Selection.from_dict({"best_step": 3, "best_loss": 1.0, "since_best": 0, "history": []})
    assert restored.best_metric is None and restored.metric_history == []  # checkpoints written before the metric
    assert {"perplexity", "mlm_loss"} <= validation_metric.LOWER_IS_BETTER
    assert "masked_accuracy" not in validation_metric.LOWER_IS_BETTER


def test_two_processes_report_the_metric_of_one(tmp_path, tiny_model, tokenised, normalised):  # noqa: F811
    settings = tiny_training_settings(max_steps=4, checkpoint_every=100, validation={
        "every_steps": 2, "metric_examples": EXAMPLES})
    assert train.main(argv(tmp_path / "p1", tiny_model, tokenised, settings, normalised)) == 0
    two = settings.replace(cpu_processes=2)
    # Two gloo ranks forked from this process (tests/ranks.py); each rank's stdout and stderr together.
    results = ranks.run_stage(train.main, argv(tmp_path / "p2", tiny_model, tokenised, two, normalised), timeout=300)
    ranks.assert_succeeded(results)
    output = "\n".join(result.output for result in results)
    metrics = [[r["validation_metric"] for r in log_rows(tmp_path / out) if "validation_metric" in r]
               for out in ("p1", "p2")]
    assert len(metrics[0]) == 2 and metrics[0] == pytest.approx(metrics[1], abs=1e-9)
    # Each rank generated its half of the rows at each of the 2 validation points (not rank 0 all of them).
    generated = re.findall(r"validation metric chart: rank (\d) generated (\d+) of (\d+) rows",
                           output)
    assert sorted(generated) == [("0", "2", "4")] * 2 + [("1", "2", "4")] * 2, output[-3000:]
    # generation's own progress line (one per batch of one generate call): 2 rows per call, never all 4.
    progress = re.findall(r"generated (\d+)/(\d+)(?!\d)(?! of)", output)
    assert progress == [("2", "2")] * 4, output[-3000:]


@pytest.mark.parametrize("count, world_size", [(4, 2), (5, 2), (1, 2), (3, 8), (0, 3), (100, 7)])
def test_the_rank_blocks_cover_the_rows_in_order_rank_0_first(count, world_size):
    blocks = [validation_metric.rank_block(count, rank, world_size) for rank in range(world_size)]
    rows = list(range(count))
    assert [row for block in blocks for row in rows[block]] == rows
    sizes = [len(rows[block]) for block in blocks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert count == 0 or sizes[0] > 0  # rank 0's predictions carry the details the scoring reads


@pytest.mark.parametrize("validation_settings, given, message", [
    ({"every_steps": 2, "metric_examples": 2}, False, "train got no --validation-metric argument"),
    ({"every_steps": 2}, True, "argument --validation-metric: given, but training.validation.metric_examples"),
])
def test_train_refuses_a_metric_argument_that_does_not_match_the_settings(
        tmp_path, tiny_model, tokenised, normalised, validation_settings, given, message):  # noqa: F811
    settings = tiny_training_settings(max_steps=2, validation=validation_settings)
    with pytest.raises(WorkflowError, match=message):
        train.main(argv(tmp_path, tiny_model, tokenised, settings, normalised if given else None))
    assert not (tmp_path / "adapter").exists()


def test_train_refuses_data_without_a_validation_split(tmp_path, tiny_model, tokenised, normalised):  # noqa: F811
    from datasets import load_from_disk

    only_train = tmp_path / "only_train"
    load_from_disk(str(normalised))["train"].save_to_disk(str(only_train / "train"))
    (only_train / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    settings = tiny_training_settings(max_steps=2, validation={"every_steps": 2, "metric_examples": 2})
    with pytest.raises(WorkflowError, match="no 'validation' split to score"):
        train.main(argv(tmp_path / "out", tiny_model, tokenised, settings, only_train))


def configured(validation_settings, config=None):
    config = copy.deepcopy(config or mixture_config())
    config["training"]["validation"] = validation_settings
    validate_schema(config)
    check_config(config)
    return config


@pytest.mark.parametrize("validation_settings, key, message", [
    ({"every_steps": 5, "criterion": "metric"}, "training.validation.criterion",
     "is 'metric' but metric_examples is not set"),
    ({"metric_examples": 8}, "training.validation.metric_examples", "is set but every_steps is not"),
    ({"every_steps": 5, "metric_examples": 5001}, "training.validation.metric_examples",
     "5001 is greater than the maximum of 5000"),  # every validation point generates them
    ({"every_steps": 5, "metric_examples": 8, "criterion": "metric"}, "training.validation.criterion",
     "mixture 'qa_mix' mixes metrics ['exact_match', 'relaxed_accuracy']"),
])
def test_the_config_refuses_a_metric_criterion_it_cannot_follow(validation_settings, key, message):
    with pytest.raises(ConfigError) as caught:
        configured(validation_settings)
    assert caught.value.key == key and message in str(caught.value)


def test_the_config_accepts_the_metric_and_a_mixture_of_one_metric():
    configured({"every_steps": 5, "metric_examples": 8})
    same = mixture_config()
    same["datasets"]["ocrvqa_demo"]["metric"] = "relaxed_accuracy"
    configured({"every_steps": 5, "metric_examples": 8, "criterion": "metric"}, same)
    with pytest.raises(Exception, match="criterion"):
        configured({"every_steps": 5, "criterion": "accuracy"})  # the schema's enum


def test_the_train_rule_gets_the_normalised_data_and_the_argument_only_when_the_metric_is_on(tmp_path):
    from test_dag import ROOT, config_file
    from test_dry_run_families import dry_run

    config = mixture_config()
    for name in list(config["datasets"]):
        config["datasets"][name]["source"]["path"] = str(ROOT / config["datasets"][name]["source"]["path"])
    config["seeds"] = [1]
    config["variants"]["baseline"]["training"] = {"validation": {"every_steps": 5, "metric_examples": 3}}
    config["comparison"]["intended_differences"] = ["training.validation.every_steps",
                                                    "training.validation.metric_examples"]
    code, output = dry_run(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "8")
    assert code == 0, output[-3000:]
    commands = [line for line in output.splitlines() if "workflow_scripts.train " in line]
    with_metric = [line for line in commands if "/baseline/seed1/" in line]
    without = [line for line in commands if "/baseline/seed1/" not in line]
    assert with_metric and without and not any("--validation-metric" in line for line in without)
    for line in with_metric:
        assert "--validation-metric" in line and '"metric_examples": 3' in line
    mixed = next(line for line in with_metric if "/qa_mix/" in line)
    assert "results/data/chartqa_demo/normalised" in mixed and "results/data/ocrvqa_demo/normalised" in mixed
    assert '"name": "ocrvqa_demo"' in mixed and '"metric": "exact_match"' in mixed


def test_the_loss_plot_draws_the_metric_on_a_second_axis(tmp_path, monkeypatch):
    from workflow_scripts.analysis import plots

    drawn = {}
    real_save = plots._save

    def save(figure, path):
        drawn["axes"] = [(axes.get_ylabel(), len(axes.get_lines())) for axes in figure.axes]
        real_save(figure, path)

    monkeypatch.setattr(plots, "_save", save)
    curves = {("baseline", 1): ([1, 2, 3, 4], [3.0, 2.5, 2.0, 1.8], [2, 4], [2.6, 2.1],
                                {"validation_metric": ([2, 4], [0.1, 0.4])}),
              ("mtup", 1): ([1, 2, 3, 4], [3.1, 2.7, 2.2, 2.0], [2, 4], [2.8, 2.3])}
    plots.loss_plot(tmp_path / "loss.png", "chart", curves)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert drawn["axes"] == [("loss per target token", 4), ("validation metric (squares)", 1)]
    plots.loss_plot(tmp_path / "plain.png", "chart", {k: v[:4] for k, v in curves.items()})
    assert drawn["axes"] == [("loss per target token", 4)]  # no metric: no second axis


def test_a_mixture_logs_each_component_and_their_mean(tmp_path, tiny_model, tokenised, normalised):  # noqa: F811
    spec = json.loads(metric_argument(normalised))
    spec["datasets"] = [{"name": "first", "data": str(normalised), "metric": METRIC},
                        {"name": "second", "data": str(normalised), "metric": "exact_match"}]
    settings = tiny_training_settings(max_steps=2, checkpoint_every=100, validation={
        "every_steps": 2, "metric_examples": 2})
    assert train.main(train_argv(tmp_path, tiny_model, tokenised, settings) + ["--validation-metric",
                                                                              json.dumps(spec)]) == 0
    record = log_rows(tmp_path)[-1]
    assert set(k for k in record if k.startswith("validation_metric")) == {
        "validation_metric/first", "validation_metric/second"}  # two metrics: no mean to select by
    spec["datasets"][1]["metric"] = METRIC
    out = tmp_path / "same"
    assert train.main(train_argv(out, tiny_model, tokenised, settings) + ["--validation-metric", json.dumps(spec)]) == 0
    record = log_rows(out)[-1]
    assert record["validation_metric"] == pytest.approx(
        (record["validation_metric/first"] + record["validation_metric/second"]) / 2)
