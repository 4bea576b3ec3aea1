"""A dataset's also_metrics: further metrics scored on the same predictions, reported in a second table."""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from data_helpers import default_config
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.checks.config import load_config
from workflow_scripts.tasks import generation, metrics

pytest.importorskip("smatchpp")

from test_smatchpp import PAIRS  # noqa: E402  (hand-written PENMAN pairs, one where hill climbing misses)


def test_the_demo_scores_amr_with_smatch_and_smatchpp():
    config = default_config()
    assert config["datasets"]["amr_demo"]["metric"] == "smatch"
    assert config["datasets"]["amr_demo"]["also_metrics"] == ["smatchpp"]


@pytest.mark.parametrize("dataset, also, message", [
    ("amr_demo", ["accuracy"], "'accuracy' cannot be scored on the predictions of task 'generation'"),
    ("amr_demo", ["smatch"], "'smatch' is the dataset's main metric already"),
    ("topics_demo", ["macro_f1"], "'macro_f1' cannot be scored on the predictions of task 'classification'"),
    ("corpus_demo", ["perplexity"], "'perplexity' cannot be scored on the predictions of task 'masked_lm'"),
])
def test_a_metric_that_does_not_fit_is_refused_naming_the_key(tmp_path, dataset, also, message):
    config = default_config()
    config["datasets"][dataset]["also_metrics"] = also
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.key == f"datasets.{dataset}.also_metrics"
    assert message in str(caught.value)


# --- evaluate: the same predictions, scored twice ---------------------------------------------------------
from test_evaluate import tiny_model  # noqa: E402,F401  (fixture)

AMR = [(f"a{index}", f"sentence {index}", gold, prediction) for index, (prediction, gold) in enumerate(PAIRS)]
AMR.append(("a5", "sentence 5", PAIRS[0][1], "not a graph"))


@pytest.fixture(scope="module")
def amr_data(tmp_path_factory):
    from datasets import Dataset, DatasetDict

    directory = tmp_path_factory.mktemp("amr") / "data"
    split = Dataset.from_dict({"id": [r[0] for r in AMR], "question": [r[1] for r in AMR],
                               "answers": [[r[2]] for r in AMR]})
    DatasetDict({"train": split, "test": split}).save_to_disk(str(directory))
    (directory / "task_meta.json").write_text(json.dumps({"task": "generation"}))
    return directory


def evaluate_amr(tmp_path, tiny_model, data, also, monkeypatch):
    from workflow_scripts import evaluate

    # The model's outputs are the hand-written predictions (a random tiny model writes no PENMAN); the rest
    # of evaluate (extraction, scoring, writing) runs as in the workflow.
    calls = []

    def generate(model, tokenizer, variant, prompts, batch_size, max_new_tokens, device):
        calls.append(prompts)
        return [next(r[3] for r in AMR if r[1] in prompt) for prompt in prompts]

    monkeypatch.setattr(generation, "generate", generate)
    variant = {"prompt": "{question}", "target": " {answer}", "extractor": {"type": "whole"}, "chat_template": False}
    evaluation = {"split": "test", "max_new_tokens": 4, "batch_size": 2, "max_examples": None, "gpus": 0}
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model), "--data", str(data), "--task", "generation", "--variant", json.dumps(variant),
            "--metric", "smatch", "--evaluation", json.dumps(evaluation), "--dataset-name", "amr",
            "--variant-name", "baseline", "--seed", "1", "--predictions-out", str(out / "predictions.jsonl"),
            "--summary-out", str(out / "eval.json")]
    assert evaluate.main(argv + (["--also-metrics", json.dumps(also)] if also is not None else [])) == 0
    assert len(calls) == 1  # one generation, however many metrics
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return records, json.loads((out / "eval.json").read_text())


def test_evaluate_scores_the_same_predictions_with_smatchpp_too(tmp_path, tiny_model, amr_data, monkeypatch):
    records, summary = evaluate_amr(tmp_path, tiny_model, amr_data, ["smatchpp"], monkeypatch)
    direct = [metrics.score_example("smatchpp", prediction, [gold]) for _, _, gold, prediction in AMR]
    assert [r["also_scores"]["smatchpp"]["counts"] for r in records] == [list(s.counts) for s in direct]
    assert [r["also_scores"]["smatchpp"]["score"] for r in records] == [s.score for s in direct]
    assert summary["also_scores"]["smatchpp"]["score"] == pytest.approx(metrics.corpus_score("smatchpp", direct))
    assert summary["also_scores"]["smatchpp"]["n_unparseable"] == 1
    # the main metric is untouched: smatch over the same predictions
    smatch = [metrics.score_example("smatch", prediction, [gold]) for _, _, gold, prediction in AMR]
    assert summary["metric"] == "smatch" and summary["score"] == pytest.approx(metrics.corpus_score("smatch", smatch))
    assert all(len(r["counts"]) == 3 and len(r["also_scores"]["smatchpp"]["counts"]) == 4 for r in records)

    plain, plain_summary = evaluate_amr(tmp_path / "plain", tiny_model, amr_data, None, monkeypatch)
    assert "also_scores" not in plain_summary and all("also_scores" not in r for r in plain)
    assert [r["counts"] for r in plain] == [r["counts"] for r in records]


@pytest.mark.parametrize("also, message", [
    (["accuracy"], "'accuracy' is not another answer metric of task 'generation'"),
    (["smatch"], "'smatch' is not another answer metric"),
    ("smatchpp", "expected a JSON list of metric names"),
])
def test_evaluate_refuses_an_extra_metric_it_cannot_score(tmp_path, tiny_model, amr_data, also, message, monkeypatch):
    with pytest.raises(WorkflowError, match="argument --also-metrics: " + message):
        evaluate_amr(tmp_path, tiny_model, amr_data, also, monkeypatch)


# --- compare: a second table under the main one -------------------------------------------------------
def write_amr_experiments(root, with_also):
    from test_compare import write_experiment

    for variant_index, variant in enumerate(["baseline", "mtup"]):
        for seed in ("base", 1, 2):
            keep = [(index + (seed if seed != "base" else 0)) % 3 != variant_index for index in range(len(PAIRS) * 4)]
            pairs = [(prediction if k else None, gold) for (prediction, gold), k in zip(PAIRS * 4, keep)]
            smatch = [metrics.score_example("smatch", p, [g]) for p, g in pairs]
            directory = write_experiment(root, "amr", variant, seed, [s.score for s in smatch], metric="smatch",
                                         counts=[list(s.counts) for s in smatch])
            if with_also:
                # other predictions than smatch's here (on these pairs the two scores happen to agree), so the
                # test tells the extra metric's values from the main one's; compare only needs them consistent
                also_keep = [index % (2 + variant_index) != 0 for index in range(len(PAIRS) * 4)]
                smatchpp = [metrics.score_example("smatchpp", p if k else None, [g])
                            for (p, g), k in zip(PAIRS * 4, also_keep)]
                records = [json.loads(line) for line in (directory / "predictions.jsonl").read_text().splitlines()]
                (directory / "predictions.jsonl").write_text("".join(json.dumps(
                    {**r, "also_scores": {"smatchpp": {"score": s.score, "counts": list(s.counts)}}}) + "\n"
                    for r, s in zip(records, smatchpp)))
                summary = json.loads((directory / "eval.json").read_text())
                summary["also_scores"] = {"smatchpp": {"score": metrics.corpus_score("smatchpp", smatchpp),
                                                       "n_unparseable": 1}}
                (directory / "eval.json").write_text(json.dumps(summary))


EXPERIMENTS = [["tiny", "amr", variant, seed] for variant in ("baseline", "mtup") for seed in (1, 2)]


def test_compare_shows_the_extra_metric_beside_the_main_one(tmp_path):
    from test_compare import run

    write_amr_experiments(tmp_path / "plain", with_also=False)
    plain_rows, plain_text = run(tmp_path / "p", tmp_path / "plain", EXPERIMENTS)
    write_amr_experiments(tmp_path / "also", with_also=True)
    rows, text = run(tmp_path / "a", tmp_path / "also", EXPERIMENTS)

    assert rows[:2] == plain_rows  # the main rows do not change
    main_table = plain_text.split("\n\n")[1]
    assert text.split("\n\n")[1] == main_table
    assert [(row["metric"], row["variant"]) for row in rows[2:]] == [("smatchpp", "baseline"), ("smatchpp", "mtup")]
    baseline, mtup = rows[2:]
    assert mtup["mean"] != rows[1]["mean"] and mtup["difference"] != rows[1]["difference"]

    # treated as the main metric would be: the corpus Smatch++ of each seed, the paired bootstrap on its counts
    from workflow_scripts import compare
    from workflow_scripts.analysis import paired_bootstrap

    def counts(variant, seed):
        return np.asarray([v for v in compare.scored_with(tmp_path / "also" / "tiny" / "amr" / variant / f"seed{seed}",
                                                          json.loads((tmp_path / "also" / "tiny" / "amr" / variant /
                                                                      f"seed{seed}" / "eval.json").read_text()),
                                                          "smatchpp")[1].values()])

    seed_scores = [metrics.corpus_score("smatchpp", [metrics.ExampleScore(0.0, tuple(c)) for c in counts("mtup", s)])
                   for s in (1, 2)]
    assert mtup["seed_scores"] == " ".join(f"{s:.4f}" for s in seed_scores)
    difference = paired_bootstrap.paired_difference("smatchpp", [counts("mtup", s) for s in (1, 2)],
                                                    [counts("baseline", s) for s in (1, 2)], 1000, 0, "examples")
    assert float(mtup["difference"]) == pytest.approx(difference.difference, abs=1e-6)
    assert float(mtup["difference_ci_low"]) == pytest.approx(difference.low, abs=1e-6)
    assert baseline["base_score"] != "" and mtup["gain_over_base"] != ""
    assert "Also scored on the same predictions" in text
    assert f"| amr | smatchpp | mtup | 2 | {float(mtup['mean']):.4f} ±" in text


def test_compare_refuses_a_run_without_the_extra_metric(tmp_path):
    from test_compare import run

    write_amr_experiments(tmp_path / "also", with_also=True)
    stale = tmp_path / "also" / "tiny" / "amr" / "mtup" / "seed2"
    summary = json.loads((stale / "eval.json").read_text())
    del summary["also_scores"]
    (stale / "eval.json").write_text(json.dumps(summary))
    with pytest.raises(WorkflowError, match=r"mtup/seed2/eval.json: field 'also_scores.smatchpp' is missing"):
        run(tmp_path / "a", tmp_path / "also", EXPERIMENTS)
