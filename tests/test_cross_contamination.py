"""The check across datasets: a mixture's components and evaluation-only datasets against the train rows of
the other datasets a run trains on (workflow_scripts/cross_contamination.py), before the run's gate."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from data_helpers import local_dataset, run_download, run_normalise
from test_dry_run_families import dry_run
from test_mixtures import checked, mixture_config
from workflow_scripts import cross_contamination
from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core.errors import WorkflowError

ROOT = Path(__file__).resolve().parent.parent
LIMITS = {"max_fraction": 0.05, "accept": False}


def qa(prefix: str, count: int, start: int = 0) -> list[dict]:
    return [{"q": f"{prefix} question {i}?", "a": f"answer {i}"} for i in range(start, start + count)]


def normalised(tmp_path: Path, name: str, files: dict) -> Path:
    settings = local_dataset(tmp_path / "sources" / name, files, splits={split: split for split in files})
    return run_normalise(name, settings, run_download(name, settings, tmp_path), tmp_path)[0]


def run(tmp_path: Path, trained: dict, checked_sets: dict, limits=LIMITS) -> dict:
    out = tmp_path / "cross.json"
    arguments = [*(f"--train={name}={path}" for name, path in trained.items()),
                 *(f"--checked={name}={path}" for name, path in checked_sets.items())]
    settings = {name: {"contamination": limits, "derived": []} for name in {**trained, **checked_sets}}
    assert cross_contamination.main([*arguments, "--settings", json.dumps(settings), "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Three small QA sets: 'charts' and 'tables' train together; 'leaky' repeats 6 of charts' train
    questions in its test split; 'held' is evaluation-only and clean."""
    tmp = tmp_path_factory.mktemp("cross")
    return tmp, {
        "charts": normalised(tmp, "charts", {"train": qa("chart", 40), "test": qa("chart", 10, 100)}),
        "tables": normalised(tmp, "tables", {"train": qa("table", 40), "test": qa("table", 10, 100)}),
        "leaky": normalised(tmp, "leaky", {"train": qa("leak", 20), "test": qa("chart", 6) + qa("leak", 14, 100)}),
        "held": normalised(tmp, "held", {"test": qa("held", 10)}),
    }


def test_clean_datasets_pass_and_the_report_says_what_was_compared(datasets, tmp_path):
    _, sets = datasets
    report = run(tmp_path, {"charts": sets["charts"], "tables": sets["tables"]},
                 {"charts": sets["charts"], "tables": sets["tables"], "held": sets["held"]})
    assert report["trained"] == ["charts", "tables"]
    assert report["checked"]["charts"]["compared_with"] == ["tables"]  # never with its own train (normalise's)
    assert report["checked"]["held"]["compared_with"] == ["charts", "tables"]
    assert report["checked"]["held"]["splits"]["test"] == {
        "checked": 10, "overlapping": 0, "fraction": 0.0, "overlapping_by_dataset": {"charts": 0, "tables": 0},
        "examples": [], "above_max_fraction": False, "accepted": False}
    assert report["checked"]["held"]["fields_compared"] == {"charts": ["question"], "tables": ["question"]}


def test_a_component_whose_test_rows_repeat_another_components_train_is_refused(datasets, tmp_path):
    _, sets = datasets
    with pytest.raises(WorkflowError) as raised:
        run(tmp_path, {"charts": sets["charts"], "leaky": sets["leaky"]}, {"charts": sets["charts"], "leaky": sets["leaky"]})
    message = str(raised.value)
    assert message.startswith("datasets.leaky: 6 of 20 rows of split 'test' (30.0%) repeat a train row of charts")
    assert "'leaky/test-0' = 'charts/train-0'" in message and "datasets.leaky.contamination.accept: true" in message
    assert "\n" not in message and not (tmp_path / "cross.json").exists()  # no report: the gate waits


def test_accepting_the_overlap_runs_and_records_it(datasets, tmp_path):
    _, sets = datasets
    report = run(tmp_path, {"charts": sets["charts"]}, {"leaky": sets["leaky"]}, {"max_fraction": 0.05, "accept": True})
    split = report["checked"]["leaky"]["splits"]["test"]
    assert (split["overlapping"], split["accepted"]) == (6, True)
    assert split["examples"][0] == {"id": "leaky/test-0", "train_id": "charts/train-0"}


def test_a_missing_directory_or_setting_is_one_line(datasets, tmp_path):
    _, sets = datasets
    with pytest.raises(WorkflowError, match=r"argument --train: .*nowhere is not a normalised data directory"):
        cross_contamination.main(["--train", f"x={tmp_path / 'nowhere'}", "--settings", "{}", "--out", str(tmp_path / "o")])
    with pytest.raises(WorkflowError, match=r"argument --settings: no settings for \['charts'\]"):
        cross_contamination.main(["--train", f"charts={sets['charts']}", "--settings", "{}", "--out", str(tmp_path / "o")])


# Which runs get the check ------------------------------------------------------------------------------
def test_only_runs_over_several_datasets_are_checked():
    config = checked(mixture_config())
    assert xc.cross_contamination_datasets(config, "qa_mix") == (["chartqa_demo", "ocrvqa_demo"],
                                                                 ["chartqa_demo", "ocrvqa_demo", "chart_eval"])
    assert xc.cross_contamination_datasets(config, "chartqa_demo") == (["chartqa_demo"], ["chart_eval"])
    assert xc.cross_contamination_datasets(config, "topics_demo") == ([], [])  # no evaluation-only dataset of its task
    demo = checked(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    assert all(xc.cross_contamination_datasets(demo, entry) == ([], []) for entry in xc.training_entries(demo))


def test_the_gate_of_a_mixture_waits_for_the_check(tmp_path):
    config = mixture_config()
    for dataset in config["datasets"].values():
        if dataset["source"]["type"] == "local":
            dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    code, output = dry_run(tmp_path, "results/tiny-llama/qa_mix/baseline/sanity.json", "-n", "-p", "--cores", "2",
                           "--configfile", str(tmp_path / "config.yaml"))  # snakemake in a fork of this process
    assert code == 0, output[-3000:]
    assert "rule cross_contamination:" in output and "--settings" in output
    assert ("--train chartqa_demo=results/data/chartqa_demo/normalised --train ocrvqa_demo=results/data/ocrvqa_demo/"
            "normalised --checked chartqa_demo=") in output and "--checked chart_eval=results/data/chart_eval/normalised" in output


# --- datasets whose extra fields differ: compared on the task's input fields ---
def chart_rows(split: str, questions: list[int], charts: list[int], **extra) -> list[dict]:
    """vision_language canonical rows (normalise's columns): the question, the chart's bytes, the answers."""
    return [{"id": f"{split}-{k}", "question": f"What is the value of bar {q}?", "answers": [str(q)],
             "images": [f"PNG chart {c}".encode()], **extra} for k, (q, c) in enumerate(zip(questions, charts))]


def saved(tmp_path: Path, name: str, splits: dict) -> Path:
    from datasets import Dataset, DatasetDict

    directory = tmp_path / name / "normalised"
    DatasetDict({split: Dataset.from_list(rows) for split, rows in splits.items()}).save_to_disk(str(directory))
    return directory


def test_the_same_question_on_the_same_chart_matches_whatever_other_columns_a_dataset_carries(tmp_path):
    # 'human' has a source column, 'augmented' none; 4 of augmented's 10 test rows ask human's train questions
    # on the same chart bytes; one more asks a train question on another chart (not a repeat).
    human = saved(tmp_path, "human", {"train": chart_rows("train", list(range(20)), list(range(20)), source="human"),
                                      "test": chart_rows("test", [100], [100], source="human")})
    augmented = saved(tmp_path, "augmented", {
        "train": chart_rows("train", list(range(200, 210)), list(range(200, 210))),
        "test": chart_rows("test", [0, 1, 2, 3, 4] + list(range(300, 305)), [0, 1, 2, 3, 99] + list(range(300, 305)))})
    with pytest.raises(WorkflowError) as raised:
        run(tmp_path, {"human": human, "augmented": augmented}, {"augmented": augmented})
    message = str(raised.value)
    assert message.startswith("datasets.augmented: 4 of 10 rows of split 'test' (40.0%) repeat a train row of human "
                              "(same images + question, ignoring case"), message
    assert "'augmented/test-0' = 'human/train-0'" in message
    # The other way round (the checked dataset carries the extra column), and the report names the fields.
    report = run(tmp_path, {"augmented": augmented, "human": human}, {"human": human},
                 {"max_fraction": 0.05, "accept": True})
    assert report["checked"]["human"]["fields_compared"] == {"augmented": ["images", "question"]}
    accepted = run(tmp_path, {"human": human, "augmented": augmented}, {"augmented": augmented},
                   {"max_fraction": 0.05, "accept": True})["checked"]["augmented"]
    assert accepted["fields_compared"] == {"human": ["images", "question"]}
    assert accepted["splits"]["test"]["overlapping"] == accepted["splits"]["test"]["overlapping_by_dataset"]["human"] == 4


def test_an_extra_field_both_datasets_carry_is_compared(tmp_path):
    # A context (or an image path) that both carry is part of the input: another context, another question.
    first = saved(tmp_path, "first", {"train": [{"id": "t0", "question": "Who won?", "context": "The 1990 final",
                                                "answers": ["A"], "source": "x"}]})
    second = saved(tmp_path, "second", {"test": [{"id": "s0", "question": "who  WON?", "context": "The 1990 final",
                                                 "answers": ["A"]},
                                                {"id": "s1", "question": "Who won?", "context": "The 2002 final",
                                                 "answers": ["B"]}]})
    report = run(tmp_path, {"first": first}, {"second": second}, {"max_fraction": 0.9, "accept": False})
    assert report["checked"]["second"]["fields_compared"] == {"first": ["context", "question"]}
    assert report["checked"]["second"]["splits"]["test"]["overlapping"] == 1
    assert report["checked"]["second"]["splits"]["test"]["examples"] == [{"id": "second/s0", "train_id": "first/t0"}]
