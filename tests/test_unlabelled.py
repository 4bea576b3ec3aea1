"""Unlabelled splits (``unlabelled: [test]``) and answers given as a bare string among lists.

- normalise: an unlabelled split's gold may be null or missing (written as None, a field derived from
  it too); gold in some rows only is an error naming the first such row; gold in every row is reported
  (``gold_ignored``) and left out; the contamination check still compares the split's inputs;
  ``task_meta.json`` and the report record ``unlabelled``; classification's label alike;
- a bare string among list answers is one answer, counted per split (``answers_as_bare_string``) and logged;
- config: only test may be unlabelled, it must be a split of the dataset, of a task that can predict,
  and never the split evaluate scores (one line naming ``evaluation_split: validation``);
- the predict stage writes the submission format (``[{questionId, answer}]`` / JSONL), predictions and
  a manifest, never a score; evaluate refuses the unlabelled split;
- one chain through Snakemake: an InfographicVQA set laid out as the hub's Parquet files (test answers
  null), configured through YAML only, trained on a tiny LLaVA for a few steps: predictions written for
  test in the submission format, scores on validation, no score for test anywhere.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

import snakemake_fork
from data_helpers import ROOT, local_dataset, run_download, run_normalise, single_model_config
from vlm_layouts import cover_jpeg
from workflow_scripts import evaluate, predict, prepare_model
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.checks.config import check_config
from workflow_scripts.checks.sections import validate_section
from workflow_scripts.core.config_files import validate_schema

TINY_LLAMA = {"name": "tiny-llama", "source": "tiny",
              "tiny": {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                       "num_heads": 4, "vocab_size": 512, "seed": 0}}
EVALUATION = {"split": "validation", "max_new_tokens": 4, "batch_size": 4, "max_examples": None, "gpus": 0,
              "max_length": 64}
BASELINE = {"prompt": "Question: {question}\nAnswer:", "target": " {answer}"}


def train_rows(n: int = 6) -> list[dict]:
    return [{"id": f"r{k}", "q": f"How many bars are in chart {k}?", "a": [str(k), f"{k} bars"]} for k in range(n)]


def held_out(n: int = 2) -> list[dict]:
    return [{"id": f"v{k}", "q": f"Which colour is bar {k}?", "a": ["red", f"colour {k}"]} for k in range(n)]


def normalised(tmp_path: Path, files: dict, name: str = "ds", **settings) -> tuple[Path, dict, dict]:
    """(normalised dir, report, settings) of a local JSONL dataset with ``unlabelled: [test]`` by default."""
    settings = {"splits": {"train": "train", "validation": "validation", "test": "test"},
                "fields": {"id": "id", "question": "q", "answers": "a"}, "unlabelled": ["test"], **settings}
    raw_settings = local_dataset(tmp_path / "source", files, **settings)
    checked = validate_section(raw_settings, "datasets", f"datasets.{name}")
    data, report = run_normalise(name, checked, run_download(name, checked, tmp_path), tmp_path)
    return data, json.loads(report.read_text()), checked


def split_rows(data: Path, split: str) -> list[dict]:
    from datasets import load_from_disk

    return load_from_disk(str(data))[split].to_list()


def test_null_and_missing_answers_of_an_unlabelled_split_are_kept_without_gold(tmp_path):
    test = [{"id": "t0", "q": "What is the title?", "a": None}, {"id": "t1", "q": "Which year?"}]
    data, report, _ = normalised(tmp_path, {"train": train_rows(), "validation": held_out(), "test": test},
                                 derived={"aux": {"transform": "answer_kind", "field": "answer"},
                                          "q_kind": {"transform": "answer_kind", "field": "question"}})
    rows = split_rows(data, "test")
    assert [row["id"] for row in rows] == ["t0", "t1"]
    assert all(row["answers"] is None and row["aux"] is None for row in rows)  # derived from the gold: none
    assert all(row["q_kind"] for row in rows)  # derived from the input: computed as for any row
    assert report["unlabelled"] == ["test"]
    assert report["splits"]["test"]["unlabelled"] is True and report["splits"]["test"]["gold_ignored"] == 0
    assert report["splits"]["test"]["kept"] == 2 and "unlabelled" not in report["splits"]["train"]
    assert json.loads((data / "task_meta.json").read_text()) == {"task": "generation", "unlabelled": ["test"]}
    from datasets import load_from_disk

    stored = load_from_disk(str(data))
    assert stored["test"].features["answers"] == stored["train"].features["answers"]  # same column types


def test_a_test_split_without_answers_not_declared_unlabelled_suggests_declaring_it(tmp_path):
    test = [{"id": "t0", "q": "What is the title?", "a": None}, {"id": "t1", "q": "Which year?", "a": None}]
    with pytest.raises(WorkflowError) as failure:
        normalised(tmp_path, {"train": train_rows(), "validation": held_out(), "test": test}, unlabelled=[])
    message = str(failure.value)
    assert message.startswith(f"{tmp_path / 'source' / 'test.jsonl'}: 2 of 2 rows of split 'test' rejected")
    assert message.endswith("every row lacks its answers ('a'), as in a test set whose answers are withheld: declare "
                            "it with datasets.ds.unlabelled: [test] (predicted for a submission, never scored), or fix "
                            "the rows")


def test_a_partly_labelled_unlabelled_split_is_an_error_naming_the_row(tmp_path):
    test = [{"id": "t0", "q": "What is the title?", "a": None}, {"id": "t1", "q": "Which year?", "a": ["1999"]},
            {"id": "t2", "q": "Who wrote it?"}]
    with pytest.raises(WorkflowError) as failure:
        normalised(tmp_path, {"train": train_rows(), "validation": held_out(), "test": test})
    message = str(failure.value)
    assert "test.jsonl line 2: field 'a' holds a gold answer" in message
    assert "datasets.ds.unlabelled" in message and "2 of its 3 rows have none" in message
    assert "\n" not in message


def test_gold_in_every_row_of_an_unlabelled_split_is_reported_and_left_out(tmp_path, capsys):
    test = [{"id": "t0", "q": "What is the title?", "a": ["x"]}, {"id": "t1", "q": "Which year?", "a": "1999"}]
    data, report, _ = normalised(tmp_path, {"train": train_rows(), "validation": held_out(), "test": test})
    assert report["splits"]["test"]["gold_ignored"] == 2
    assert all(row["answers"] is None for row in split_rows(data, "test"))
    assert "declared unlabelled, but all 2 rows hold 'a'" in capsys.readouterr().out


def test_the_contamination_check_still_compares_an_unlabelled_splits_inputs(tmp_path):
    train = train_rows()
    test = [{"id": "t0", "q": train[0]["q"], "a": None}, {"id": "t1", "q": "Something new?", "a": None}]
    validation = [{"id": "v", "q": "Entirely new?", "a": "x"}]
    with pytest.raises(WorkflowError, match="1 of 2 rows of split 'test' .* overlapping ids .*'t0' = 'r0'"):
        normalised(tmp_path, {"train": train, "validation": validation, "test": test},
                   contamination={"max_fraction": 0.1})
    _, report, _ = normalised(tmp_path / "accepted", {"train": train, "validation": validation, "test": test},
                              contamination={"accept": True})
    assert report["contamination"]["splits"]["test"]["overlapping"] == 1


def test_flattened_records_of_an_unlabelled_split_give_every_question_without_gold(tmp_path):
    train = [{"id": "b0", "q": ["Genre?", "Title?"], "a": ["History", "Old Roads"]},
             {"id": "b1", "q": ["Genre?", "Author?"], "a": ["Travel", "Ann Lee"]}]
    test = [{"id": "b2", "q": ["Genre?", "Year?", "Title?"], "a": None}]
    data, report, _ = normalised(tmp_path, {"train": train, "test": test}, flatten=True,
                                 splits={"train": "train", "test": "test"}, max_rejected_fraction=0.0,
                                 contamination={"accept": True})
    rows = split_rows(data, "test")
    assert [(row["id"], row["question"], row["answers"]) for row in rows] == [
        ("b2-q0", "Genre?", None), ("b2-q1", "Year?", None), ("b2-q2", "Title?", None)]
    assert report["splits"]["test"]["kept"] == 3


def test_a_bare_string_among_list_answers_is_one_answer_counted_per_split(tmp_path, capsys):
    train = train_rows()
    train[1]["a"], train[4]["a"] = "1", "four"
    validation = [{"id": "v0", "q": "Which colour?", "a": "red"}, {"id": "v1", "q": "How tall?", "a": ["3 m"]}]
    data, report, _ = normalised(tmp_path, {"train": train, "validation": validation,
                                            "test": [{"id": "t", "q": "Unseen?"}]})
    assert report["splits"]["train"]["answers_as_bare_string"] == 2
    assert report["splits"]["validation"]["answers_as_bare_string"] == 1
    assert report["splits"]["train"]["answers_as_bare_string_ids"] == [train[1]["id"], train[4]["id"]]  # named
    assert report["splits"]["validation"]["answers_as_bare_string_ids"] == ["v0"]
    assert "answers_as_bare_string" not in report["splits"]["test"]  # no gold read there
    answers = {row["id"]: row["answers"] for row in split_rows(data, "train")}
    assert answers["r1"] == ["1"] and answers["r4"] == ["four"] and answers["r0"] == ["0", "0 bars"]
    out = capsys.readouterr().out
    assert "ds/train: 2 rows give their answers as one bare string where other rows give lists" in out
    assert "ds/validation: 1 rows give their answers" in out


def test_answers_all_bare_strings_are_not_flagged(tmp_path):
    rows = [{"id": f"r{k}", "q": f"Sentence {k}?", "a": f"graph {k}"} for k in range(4)]
    _, report, _ = normalised(tmp_path, {"train": rows, "test": [{"id": "t", "q": "New?", "a": "g"}]},
                              unlabelled=[], splits={"train": "train", "test": "test"})
    assert all("answers_as_bare_string" not in split for split in report["splits"].values())


def test_classification_unlabelled_test_has_no_label_and_no_class_balance(tmp_path):
    train = [{"id": f"r{k}", "s": f"text number {k}", "y": ["sport", "art"][k % 2]} for k in range(6)]
    test = [{"id": "t0", "s": "an unseen text", "y": None}, {"id": "t1", "s": "another unseen text"}]
    data, report, _ = normalised(tmp_path, {"train": train, "test": test}, task="classification",
                                 fields={"id": "id", "text": "s", "label": "y"}, metric="accuracy",
                                 splits={"train": "train", "test": "test"})
    assert [row["label"] for row in split_rows(data, "test")] == [None, None]
    assert set(report["class_balance"]) == {"train"} and report["labels"] == ["art", "sport"]
    meta = json.loads((data / "task_meta.json").read_text())
    assert meta == {"task": "classification", "labels": ["art", "sport"], "unlabelled": ["test"]}


# --- config ---
def config_with(**dataset_changes) -> dict:
    config = single_model_config()
    config["datasets"]["chartqa_demo"].update(dataset_changes)
    return config


def checked(config: dict) -> dict:
    config = copy.deepcopy(config)
    validate_schema(config)
    check_config(config)
    return config


@pytest.mark.parametrize("changes, key, message", [
    ({"unlabelled": ["test"]}, "datasets.chartqa_demo.evaluation_split",
     "evaluated on 'test', which is unlabelled (nothing to score); set datasets.chartqa_demo.evaluation_split: validation"),
    ({"unlabelled": ["train"], "evaluation_split": "validation"}, "datasets.chartqa_demo.unlabelled",
     "'train' cannot be unlabelled"),
    ({"unlabelled": ["validation"], "evaluation_split": "test"}, "datasets.chartqa_demo.unlabelled",
     "'validation' cannot be unlabelled: training and its held-out loss read the gold"),
    ({"unlabelled": ["test"], "splits": {"train": "train", "validation": "val"}, "evaluation_split": "validation"},
     "datasets.chartqa_demo.unlabelled", "'test' is not a split of the dataset"),
])
def test_config_refuses_a_bad_unlabelled_split_in_one_line(changes, key, message):
    with pytest.raises(ConfigError) as failure:
        checked(config_with(**changes))
    assert failure.value.key == key and message in str(failure.value) and "\n" not in str(failure.value)


def test_config_refuses_a_global_test_evaluation_and_accepts_validation():
    config = config_with(unlabelled=["test"])
    config["evaluation"] = {"split": "test"}
    with pytest.raises(ConfigError, match="evaluation_split: validation"):
        checked(config)
    config["evaluation"] = {"split": "validation"}
    assert checked(config)["datasets"]["chartqa_demo"]["submission"] == {
        "format": "json", "id_key": "questionId", "id_type": "string", "answer_key": "answer"}
    assert checked(config_with(unlabelled=["test"], evaluation_split="validation"))


def test_config_refuses_unlabelled_splits_for_tasks_that_cannot_predict():
    settings = {"task": "conversation", "source": {"type": "local", "path": "/nowhere"}, "fields": {"messages": "m"},
                "metric": "exact_match", "unlabelled": ["test"], "evaluation_split": "validation"}
    with pytest.raises(ConfigError, match="task 'conversation' cannot predict an unlabelled split"):
        validate_section(settings, "datasets", "datasets.chats")


# --- predict ---
@pytest.fixture(scope="module")
def generation_set(tmp_path_factory) -> tuple[Path, Path]:
    """(normalised data with an unlabelled test whose ids are integers, a tiny llama built on it)."""
    tmp = tmp_path_factory.mktemp("predict")
    test = [{"id": 65000 + k, "q": f"How many bars are in chart {k}?", "a": None} for k in range(5)]
    data, _, _ = normalised(tmp, {"train": train_rows(), "validation": held_out(3), "test": test},
                            contamination={"accept": True})
    model = tmp / "model"
    assert prepare_model.main(["--model", json.dumps(TINY_LLAMA), "--out", str(model), "--corpus", str(data)]) == 0
    return data, model


def predict_argv(data: Path, model: Path, out: Path, *, submission: dict, split: str = "test",
                 task: str = "generation", variant: dict = BASELINE, metric: str = "anls",
                 suffix: str | None = None) -> list[str]:
    suffix = suffix or submission.get("format", "json")
    return ["--model", str(model), "--data", str(data), "--split", split, "--task", task,
            "--variant", json.dumps(variant), "--metric", metric, "--evaluation", json.dumps(EVALUATION),
            "--submission", json.dumps(submission), "--dataset-name", "ds", "--variant-name", "baseline",
            "--seed", "base", "--submission-out", str(out / f"submission_{split}.{suffix}"),
            "--predictions-out", str(out / "predictions.jsonl"), "--manifest-out", str(out / "manifest.json")]


def test_predict_writes_the_submission_format_and_never_a_score(generation_set, tmp_path, capsys):
    data, model = generation_set
    argv = predict_argv(data, model, tmp_path, submission={"id_type": "integer"})
    assert predict.main(argv) == 0
    submission = json.loads((tmp_path / "submission_test.json").read_text())
    assert isinstance(submission, list) and [entry["questionId"] for entry in submission] == list(range(65000, 65005))
    assert all(set(entry) == {"questionId", "answer"} and isinstance(entry["answer"], str) for entry in submission)
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [str(65000 + k) for k in range(5)]
    assert all("score" not in r and "gold" not in r and r["prompt"].startswith("Question: ") for r in records)
    assert [entry["answer"] for entry in submission] == [r["extracted"] or "" for r in records]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["scored"] is False and "score" not in manifest and manifest["n_examples"] == 5
    assert manifest["split"] == "test" and manifest["manifest"]["stage"] == "predict"
    assert manifest["n_unparseable"] == sum(not r["parsed"] for r in records)
    assert "not scored: no gold" in capsys.readouterr().out


def test_predict_writes_jsonl_with_the_configured_keys(generation_set, tmp_path):
    data, model = generation_set
    submission = {"format": "jsonl", "id_key": "question_id", "answer_key": "prediction"}
    assert predict.main(predict_argv(data, model, tmp_path, submission=submission)) == 0
    lines = [json.loads(line) for line in (tmp_path / "submission_test.jsonl").read_text().splitlines()]
    assert [line["question_id"] for line in lines] == [str(65000 + k) for k in range(5)]  # id_type string
    assert all(set(line) == {"question_id", "prediction"} for line in lines)


@pytest.mark.parametrize("changes, message", [
    ({"split": "validation"}, "split 'validation' is labelled"),
    ({"suffix": "jsonl"}, "ends in '.jsonl', but submission.format is json"),
])
def test_predict_refuses_a_labelled_split_and_a_misnamed_output(generation_set, tmp_path, changes, message):
    data, model = generation_set
    with pytest.raises(WorkflowError, match=message):
        predict.main(predict_argv(data, model, tmp_path, submission={}, **changes))
    assert not list(tmp_path.iterdir())


def test_evaluate_refuses_the_unlabelled_split(generation_set, tmp_path):
    data, model = generation_set
    with pytest.raises(ConfigError, match="split 'test' .* is unlabelled .* evaluate this dataset on validation"):
        evaluate.main(["--model", str(model), "--data", str(data), "--task", "generation", "--variant",
                       json.dumps(BASELINE), "--metric", "anls", "--evaluation", json.dumps({**EVALUATION, "split": "test"}),
                       "--dataset-name", "ds", "--variant-name", "baseline", "--seed", "base",
                       "--predictions-out", str(tmp_path / "p.jsonl"), "--summary-out", str(tmp_path / "e.json")])
    assert not list(tmp_path.iterdir())


def test_classification_predicts_a_label_per_unlabelled_row(tmp_path):
    train = [{"id": f"r{k}", "s": f"text number {k}", "y": ["sport", "art"][k % 2]} for k in range(6)]
    test = [{"id": f"t{k}", "s": f"an unseen text {k}"} for k in range(3)]
    data, _, _ = normalised(tmp_path, {"train": train, "test": test}, task="classification",
                            fields={"id": "id", "text": "s", "label": "y"}, metric="accuracy",
                            splits={"train": "train", "test": "test"})
    model = tmp_path / "model"
    assert prepare_model.main(["--model", json.dumps(TINY_LLAMA), "--out", str(model), "--corpus", str(data)]) == 0
    out = tmp_path / "out"
    assert predict.main(predict_argv(data, model, out, submission={"id_key": "id", "answer_key": "label"},
                                     task="classification", variant={"input": "{text}"}, metric="accuracy")) == 0
    submission = json.loads((out / "submission_test.json").read_text())
    assert [entry["id"] for entry in submission] == ["t0", "t1", "t2"]
    assert all(entry["label"] in ("art", "sport") for entry in submission)


# --- the chain: InfographicVQA as the hub ships it, through Snakemake and YAML only ---
INFOGRAPHIC_HUB_ROWS = {"train": 8, "validation": 4, "test": 3}


def write_infographicvqa_hub(directory: Path) -> dict:
    """Parquet files with the hub's InfographicVQA columns: ``questionId``, ``question``, ``answers`` (a list;
    null in test), ``answer_type``, ``image`` as the datasets Image struct ``{bytes, path}``."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({
        "questionId": datasets.Value("int64"), "question": datasets.Value("string"),
        "answers": datasets.List(datasets.Value("string")), "answer_type": datasets.List(datasets.Value("string")),
        "image": datasets.Image(),
    })
    for offset, (split, n) in enumerate(INFOGRAPHIC_HUB_ROWS.items()):
        rows = []
        for k in range(n):
            number = 10 * offset + k
            answers = None if split == "test" else [f"{10 + k}%", f"{10 + k} percent"]
            rows.append({"questionId": 60000 + 100 * offset + k, "question": f"What share chose option {number}?",
                         "answers": answers, "answer_type": None if split == "test" else ["single span"],
                         "image": {"bytes": cover_jpeg(number), "path": f"{split}_{k}.jpg"}})
        pq.write_table(pa.Table.from_pylist(rows, schema=features.arrow_schema), directory / f"{split}.parquet")
    return {split: [60000 + 100 * offset + k for k in range(n)] for offset, (split, n) in enumerate(INFOGRAPHIC_HUB_ROWS.items())}


CHAIN_YAML = """
models:
  tiny-llava:
    source: tiny
    tiny: {architecture: llava, hidden_size: 64, intermediate_size: 128, num_layers: 2, num_heads: 4, vocab_size: 512}
datasets:
  infographicvqa:
    task: vision_language
    source: {type: local, path: SOURCE}
    format: parquet
    fields: {id: questionId, question: question, answers: answers, image: image}
    metric: anls
    unlabelled: [test]                # the hub's test answers are null: predicted for the leaderboard
    evaluation_split: validation      # scores come from validation
    submission: {format: json, id_key: questionId, id_type: integer, answer_key: answer}
    contamination: {accept: true}     # the tiny covers repeat colours
variants:
  vision:
    task: vision_language
    prompt: "Question: {question}\\nAnswer:"
    target: " {answer}"
seeds: [1]
training:
  lora: {rank: 4, alpha: 8, target_modules: [q_proj, v_proj], train_projector: true}
  max_length: 64
  effective_batch: 4
  micro_batch: 2
  max_steps: 2
  precision: fp32
  checkpoint_every: 100
  log_every: 1
evaluation:
  max_new_tokens: 4
  batch_size: 4
  evaluate_base_model: false
comparison:
  reference_variant: vision
"""


@pytest.mark.slow
def test_infographicvqa_hub_layout_with_an_unlabelled_test_runs_through_yaml_alone(tmp_path):
    """Only a real run shows a config written as a user would (YAML alone) carry a split without labels through
    every stage to its submission file, with no score for it anywhere in results/."""
    ids = write_infographicvqa_hub(tmp_path / "source")
    (tmp_path / "config.yaml").write_text(CHAIN_YAML.replace("SOURCE", str(tmp_path / "source")))
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--configfile", str(tmp_path / "config.yaml"),
                                       "--cores", "2"], cwd=tmp_path)  # in a fork of this process
    assert code == 0, output[-6000:]
    run = tmp_path / "results" / "tiny-llava" / "infographicvqa" / "vision" / "seed1"
    submission = json.loads((run / "submission_test.json").read_text())
    assert [entry["questionId"] for entry in submission] == ids["test"]
    assert all(set(entry) == {"questionId", "answer"} and isinstance(entry["answer"], str) for entry in submission)
    manifest = json.loads((run / "submission_test.json.manifest.json").read_text())
    assert manifest["scored"] is False and manifest["images"] is True and manifest["n_examples"] == 3
    summary = json.loads((run / "eval.json").read_text())
    assert summary["split"] == "validation" and summary["metric"] == "anls" and summary["n_examples"] == 4
    report = json.loads((tmp_path / "results" / "data" / "infographicvqa" / "normalise_report.json").read_text())
    assert report["unlabelled"] == ["test"] and report["splits"]["test"]["kept"] == 3
    # No score for test anywhere: every eval.json is validation's, and no prediction record holds a score for a test id.
    test_ids = {str(i) for i in ids["test"]}
    for path in (tmp_path / "results").rglob("eval.json"):
        assert json.loads(path.read_text())["split"] == "validation", path
    for path in (tmp_path / "results").rglob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if isinstance(record, dict) and record.get("id") in test_ids:
                assert "score" not in record and "gold" not in record, path
    assert (tmp_path / "results" / "comparison.csv").exists()
