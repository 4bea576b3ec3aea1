"""Every way normalise stops goes through its failure report (``normalise_report.failed.json``, beside the
declared report): an unreadable file, a field absent from every row, a partly labelled unlabelled split, an
integer submission id that is not one, a label set train cannot give, and a task's own normalisation (a
damaged gzip corpus). The report lists every failing split in one run; nothing is written at ``--out``."""
from __future__ import annotations

import gzip
import json

import pytest

from data_helpers import leftovers, local_dataset, run_download, write_jsonl
from workflow_scripts import normalise
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.checks.sections import validate_section


def good(i: int) -> dict:
    return {"id": f"r{i}", "q": f"question {i}?", "a": f"answer {i}"}


def run(tmp_path, settings: dict) -> tuple[str, dict]:
    """normalise's message and its failure report (the stage must fail)."""
    settings = validate_section(settings, "datasets", "datasets.d")
    raw = run_download("d", settings, tmp_path)
    report = tmp_path / "out" / "normalise_report.json"
    argv = ["--name", "d", "--dataset", json.dumps(settings), "--raw", str(raw),
            "--out", str(tmp_path / "out" / "normalised"), "--report", str(report)]
    with pytest.raises(WorkflowError) as caught:
        normalise.main(argv)
    assert leftovers(tmp_path / "out") == []
    return str(caught.value), json.loads(normalise.failure_report_path(report).read_text())


def test_an_unreadable_split_and_a_field_absent_from_another_are_both_in_one_report(tmp_path):
    src = tmp_path / "src"
    write_jsonl(src / "train.jsonl", [good(i) for i in range(5)])
    (src / "validation.jsonl").write_bytes(b'{"q": "ok?", "a": "x"}\n{"q": "caf\xe9?", "a": "x"}\n')
    write_jsonl(src / "test.jsonl", [{"question": "no q here?", "a": "x"}])
    settings = local_dataset(src, {}, splits={"train": "train", "validation": "validation", "test": "test"})
    message, report = run(tmp_path, settings)
    assert message.startswith("2 problems, all listed in ")
    assert f"{src / 'validation.jsonl'} line 2: not UTF-8 text" in message
    assert f"{src / 'test.jsonl'}: field 'q' (datasets.d.fields.question) is absent from every row" in message
    assert report["failed"] == [report["splits"]["validation"]["problem"], report["splits"]["test"]["problem"]]
    assert report["splits"]["validation"]["counts_partial"] is True and report["splits"]["train"]["kept"] == 5


def test_a_partly_labelled_unlabelled_split_and_a_bad_integer_id_are_reported(tmp_path):
    src = tmp_path / "src"
    write_jsonl(src / "train.jsonl", [good(i) for i in range(5)])
    write_jsonl(src / "test.jsonl", [{"id": "1", "q": "which?", "a": "x"}, {"id": "2", "q": "which?"}])
    settings = local_dataset(src, {}, fields={"id": "id", "question": "q", "answers": "a"}, unlabelled=["test"],
                             submission={"id_type": "integer"})
    message, report = run(tmp_path, settings)
    assert "declared unlabelled (datasets.d.unlabelled)" in message and report["failed"] == [message]
    write_jsonl(src / "test.jsonl", [{"id": "1", "q": "which?"}, {"id": "q-2", "q": "which?"}])
    message, report = run(tmp_path / "again", settings)
    assert "datasets.d.submission.id_type" in message and "'q-2'" in message and report["failed"] == [message]


def test_a_classifier_whose_train_split_gives_no_label_set_is_reported(tmp_path):
    src = tmp_path / "src"
    write_jsonl(src / "train.jsonl", [{"t": f"text {i}", "y": "only"} for i in range(4)])
    write_jsonl(src / "test.jsonl", [{"t": "text x", "y": "only"}])
    settings = local_dataset(src, {}, task="classification", fields={"text": "t", "label": "y"}, metric="accuracy")
    message, report = run(tmp_path, settings)
    assert "at least two classes" in message and report["failed"] == [message]
    assert report["splits_not_read"] == ["test"]


def test_a_damaged_gzip_corpus_is_reported(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    whole = gzip.compress("".join(f"line {i} of the corpus\n" for i in range(2000)).encode())
    (src / "train.txt.gz").write_bytes(whole[: len(whole) // 2])
    (src / "test.txt").write_text("a held-out line\n")
    settings = {"task": "masked_lm", "format": "text", "metric": "masked_accuracy",
                "source": {"type": "local", "path": str(src)}, "splits": {"train": "train", "test": "test"}}
    with pytest.raises(WorkflowError):  # download counts the lines, so the damage shows there first...
        run_download("d", validate_section(settings, "datasets", "datasets.d"), tmp_path)
    (src / "train.txt.gz").write_bytes(whole)  # ...so damage the copy download kept, as a disk fault would
    settings = validate_section(settings, "datasets", "datasets.d")
    raw = run_download("d", settings, tmp_path)
    (raw / "train.txt.gz").write_bytes(whole[: len(whole) // 2])
    report = tmp_path / "out" / "normalise_report.json"
    with pytest.raises(WorkflowError, match=r"the gzip stream is damaged or cut short after line \d+") as caught:
        normalise.main(["--name", "d", "--dataset", json.dumps(settings), "--raw", str(raw),
                        "--out", str(tmp_path / "out" / "normalised"), "--report", str(report)])
    failed = json.loads(normalise.failure_report_path(report).read_text())
    assert failed["failed"] == [str(caught.value)] and failed["task"] == "masked_lm"
    assert str(src / "train.txt.gz") in str(caught.value)  # the user's file, not the raw copy


def test_an_unreadable_train_split_is_reported_and_the_other_splits_still_read(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_bytes(b'{"q": "ok?", "a": "x"}\n{"q": "caf\xe9?", "a": "x"}\n')
    write_jsonl(src / "test.jsonl", [good(1)])
    message, report = run(tmp_path, local_dataset(src, {}))
    assert message.startswith(f"{src / 'train.jsonl'} line 2: not UTF-8 text") and report["failed"] == [message]
    assert "splits_not_read" not in report and report["splits"]["train"]["counts_partial"] is True
    assert report["splits"]["test"]["kept"] == 1


def test_a_file_level_stop_in_train_still_names_the_other_unreadable_split(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_bytes(b'{"q": "ok?", "a": "x"}\n{"q": "caf\xe9?", "a": "x"}\n')
    (src / "test.jsonl").write_bytes(b'{"q": "na\xefve?", "a": "x"}\n')
    message, report = run(tmp_path, local_dataset(src, {}))
    assert [problem.split(":")[0] for problem in report["failed"]] == [f"{src / 'train.jsonl'} line 2",
                                                                       f"{src / 'test.jsonl'} line 1"]
    assert message.startswith("2 problems")
