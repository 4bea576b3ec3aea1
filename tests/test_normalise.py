"""normalise: the declarative mapping, every rejection reason, flattening, split aliases, the guards."""
import json
import re

import pytest
from datasets import load_from_disk

from data_helpers import demo_settings, leftovers, local_dataset, run_download, run_normalise
from workflow_scripts import normalise
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.checks.sections import validate_section


def good(i):
    return {"q": f"question {i}?", "a": f"answer {i}"}


def prepare(tmp_path, train, test=None, **settings):
    settings = local_dataset(tmp_path / "src", {"train": train, "test": test or [good(10_000)]}, **settings)
    return settings, run_download("d", settings, tmp_path)


def args(settings, raw, tmp_path):
    return ["--name", "d", "--dataset", json.dumps(settings), "--raw", str(raw),
            "--out", str(tmp_path / "out" / "normalised"), "--report", str(tmp_path / "out" / "report.json")]


# --- the demo datasets: renamed fields, a split alias, flattening, derived fields, planted bad rows ---
def test_chartqa_layout_renames_fields_and_aliases_val(tmp_path):
    settings = demo_settings("chartqa_demo")
    out, report_path = run_normalise("chartqa", settings, run_download("chartqa", settings, tmp_path), tmp_path)
    data, report = load_from_disk(str(out)), json.loads(report_path.read_text())
    assert list(data) == ["train", "validation", "test"]
    assert report["splits"]["validation"]["source_split"] == "val"
    row = data["train"][0]
    assert set(row) == {"id", "question", "answers", "image", "aux"}
    assert row["id"] == "train-0" and row["question"].startswith("What is the value of")
    assert row["answers"] == ["64"] and row["aux"] == "number" and row["image"].startswith("charts/")
    # the four planted bad rows: label missing, query empty, label [17], label []
    assert report["splits"]["train"]["reasons"] == {"missing_field": 1, "empty_value": 1, "wrong_type": 1}
    assert report["splits"]["validation"]["reasons"] == {"empty_value": 1}
    example = report["reasons"]["missing_field"]["examples"][0]
    assert (example["split"], example["row"], example["field"]) == ("train", 40, "label")
    assert example["file"] == settings["source"]["path"] + "/train.jsonl"  # the user's file, not the raw copy


def test_ocrvqa_layout_is_flattened_with_stable_ids(tmp_path):
    settings = demo_settings("ocrvqa_demo")
    raw = run_download("ocr", settings, tmp_path)
    out, report_path = run_normalise("ocr", settings, raw, tmp_path)
    train, report = load_from_disk(str(out))["train"], json.loads(report_path.read_text())
    first = json.loads((raw / "train.jsonl").read_text().splitlines()[0])
    rows = [r for r in train if r["id"].startswith(first["image_id"] + "-q")]
    assert [r["id"] for r in rows] == [f"{first['image_id']}-q{k}" for k in range(len(first["questions"]))]
    assert [r["question"] for r in rows] == first["questions"]
    assert [r["answers"] for r in rows] == [[a] for a in first["answers"]]
    assert all(r["title"] == first["title"] for r in rows)
    mismatch = report["reasons"]["length_mismatch"]["examples"][0]
    assert mismatch["row"] == 25 and re.match(r"(\d+) questions but (\d+) answers", mismatch["detail"])
    assert not any(r["id"].startswith("cover00025") for r in train)  # reported, not guessed
    assert len(set(train["id"])) == len(train)


def test_amr_layout_derives_the_skeleton_and_rejects_a_broken_graph(tmp_path):
    settings = demo_settings("amr_demo")
    out, report_path = run_normalise("amr", settings, run_download("amr", settings, tmp_path), tmp_path)
    row = load_from_disk(str(out))["train"][0]
    assert row["id"] == "amr-train-0000" and " / " not in row["aux"] and row["aux"].startswith("(")
    report = json.loads(report_path.read_text())
    assert report["reasons"]["transform_failed"]["examples"][0]["row"] == 400


# --- each rejection reason, planted on purpose ---
@pytest.mark.parametrize("bad, reason, field", [
    ('{"q": "broken', "unparseable_record", None),
    ({"a": "x"}, "missing_field", "q"),
    ({"q": None, "a": "x"}, "missing_field", "q"),
    ({"q": "  ", "a": "x"}, "empty_value", "q"),
    ({"q": "ok?", "a": []}, "empty_value", "a"),
    ({"q": "ok?", "a": ["x", ""]}, "empty_value", "a[1]"),
    ({"q": 42, "a": "x"}, "wrong_type", "q"),
    ({"q": "ok?", "a": {"text": "x"}}, "wrong_type", "a"),
    ({"q": "ok?", "a": ["x", 3]}, "wrong_type", "a[1]"),
    (["q", "a"], "wrong_type", None),
])
def test_each_rejection_reason_is_counted_with_an_example(tmp_path, bad, reason, field):
    settings, raw = prepare(tmp_path, [good(i) for i in range(30)] + [bad], max_rejected_fraction=0.1)
    out, report_path = run_normalise("d", settings, raw, tmp_path)
    report = json.loads(report_path.read_text())
    assert report["splits"]["train"]["reasons"] == {reason: 1}
    # the bad record is row index 30, on line 31 of the file (one record per line, no blank lines)
    assert (raw / "train.jsonl").read_text().splitlines()[30] == (bad if isinstance(bad, str) else json.dumps(bad))
    example = report["reasons"][reason]["examples"][0]
    assert report["reasons"][reason]["examples"] == [
        {"file": str(tmp_path / "src" / "train.jsonl"), "split": "train", "row": 30, "line": 31, "field": field,
         "detail": example["detail"]}]
    where = f"{tmp_path / 'src' / 'train.jsonl'} line 31: " + (f"field '{field}': " if field else "")
    assert normalise.describe(example) == where + example["detail"]
    train = load_from_disk(str(out))["train"]
    assert len(train) == 30 and all(r["question"].strip() and all(a.strip() for a in r["answers"]) for r in train)


def test_duplicate_ids_and_failed_transforms_are_rejected(tmp_path):
    rows = [{"id": i, "q": f"q{i}?", "a": "(b / boy)"} for i in range(30)]
    rows += [{"id": 3, "q": "again?", "a": "(b / boy)"}, {"id": 99, "q": "graph?", "a": "not a graph"}]
    settings, raw = prepare(tmp_path, rows, test=[{"id": "t", "q": "q?", "a": "(d / dog)"}],
                            fields={"id": "id", "question": "q", "answers": "a"},
                            derived={"aux": {"transform": "penman_skeleton", "field": "answer"}},
                            max_rejected_fraction=0.1)
    out, report_path = run_normalise("d", settings, raw, tmp_path)
    assert json.loads(report_path.read_text())["splits"]["train"]["reasons"] == {"duplicate_id": 1, "transform_failed": 1}
    train = load_from_disk(str(out))["train"]
    assert train[3] == {"id": "3", "question": "q3?", "answers": ["(b / boy)"], "aux": "(boy)"}


def test_extra_field_of_another_type_is_rejected_not_coerced(tmp_path):
    rows = [{**good(i), "img": f"p{i}.png"} for i in range(30)] + [{**good(30), "img": 7}]
    settings, raw = prepare(tmp_path, rows, test=[{**good(0), "img": "t.png"}], extra_fields={"image": "img"},
                            max_rejected_fraction=0.1)
    out, report_path = run_normalise("d", settings, raw, tmp_path)
    assert json.loads(report_path.read_text())["splits"]["train"]["reasons"] == {"wrong_type": 1}
    assert load_from_disk(str(out))["train"]["image"][:2] == ["p0.png", "p1.png"]


def test_flatten_accepts_several_golds_per_question_and_rejects_single_bad_pairs(tmp_path):
    record = {"id": "r", "qs": ["one?", "", "three?"], "as": [["1", "uno"], "2", "3"]}
    settings, raw = prepare(tmp_path, [record] * 1 + [{"id": f"k{i}", "qs": ["x?"], "as": ["y"]} for i in range(30)],
                            test=[{"id": "t", "qs": ["held out?"], "as": ["y"]}],
                            fields={"id": "id", "question": "qs", "answers": "as"}, flatten=True,
                            max_rejected_fraction=0.1)
    out, report_path = run_normalise("d", settings, raw, tmp_path)
    train = load_from_disk(str(out))["train"]
    assert train[0] == {"id": "r-q0", "question": "one?", "answers": ["1", "uno"]}
    assert train[1]["id"] == "r-q2"
    example = json.loads(report_path.read_text())["reasons"]["empty_value"]["examples"][0]
    assert (example["row"], example["field"]) == (0, "qs[1]")


# --- the guards: whole-split failures leave no output ---
def test_a_field_absent_from_every_row_fails_naming_file_field_and_key(tmp_path):
    settings, raw = prepare(tmp_path, [{"question": "x?", "a": "y"}] * 5)
    with pytest.raises(WorkflowError, match=r"train\.jsonl: field 'q' \(datasets\.d\.fields\.question\) is absent from every row.*\['a', 'question'\]"):
        normalise.main(args(settings, raw, tmp_path))
    assert leftovers(tmp_path / "out") == []


def test_every_failing_split_is_reported_in_one_run_with_the_users_file_and_a_report(tmp_path):
    """Two failing splits: one message counts both, and the failure's report lists each with its reasons;
    every file is named as the user gave it (the source directory), never the raw copy."""
    src = tmp_path / "src"
    settings, raw = prepare(tmp_path, [good(i) for i in range(8)] + [{"q": "", "a": "x"}] * 2,
                            test=[good(100), {"q": "x?"}, {"q": 3, "a": "y"}])
    with pytest.raises(WorkflowError) as caught:
        normalise.main(args(settings, raw, tmp_path))
    failed_path = tmp_path / "out" / "report.failed.json"
    message = str(caught.value)
    assert message.startswith(f"2 problems, all listed in {failed_path}: (1) {src / 'train.jsonl'}: 2 of 10 rows")
    assert f"(2) {src / 'test.jsonl'}: 2 of 3 rows of split 'test' rejected" in message
    assert "missing_field 1, wrong_type 1" in message and str(raw) not in message
    failed = json.loads(failed_path.read_text())
    assert {split: entry["reasons"] for split, entry in failed["splits"].items()} == {
        "train": {"empty_value": 2}, "test": {"missing_field": 1, "wrong_type": 1}}
    assert len(failed["failed"]) == 2 and failed["splits"]["test"]["file"] == str(src / "test.jsonl")
    assert not (tmp_path / "out" / "normalised").exists() and not (tmp_path / "out" / "report.json").exists()
    # fixed, the run succeeds and the stale failure report goes
    settings, raw = prepare(tmp_path, [good(i) for i in range(8)])
    normalise.main(args(settings, raw, tmp_path))
    assert (tmp_path / "out" / "report.json").exists() and not failed_path.exists()


def test_rejected_share_above_the_threshold_fails_with_counts_and_an_example(tmp_path):
    settings, raw = prepare(tmp_path, [good(i) for i in range(97)] + [{"q": "", "a": "x"}] * 3)
    with pytest.raises(WorkflowError, match=r"3 of 100 rows of split 'train' rejected \(3\.0%\), more than datasets\.d\.max_rejected_fraction = 0\.01.*empty_value 3; for example .*train\.jsonl line 98: field 'q': is empty; fix the rows or raise datasets\.d\.max_rejected_fraction$"):
        normalise.main(args(settings, raw, tmp_path))
    assert leftovers(tmp_path / "out") == []  # no data, no report at the declared path
    failed = json.loads((tmp_path / "out" / "report.failed.json").read_text())  # but the failure's report
    assert failed["splits"]["train"]["reasons"] == {"empty_value": 3} and len(failed["failed"]) == 1


def test_flatten_length_mismatches_beyond_the_threshold_fail(tmp_path):
    rows = [{"id": f"r{i}", "qs": ["a?", "b?"], "as": ["1"] if i % 2 else ["1", "2"]} for i in range(20)]
    settings, raw = prepare(tmp_path, rows, test=[{"id": "t", "qs": ["x?"], "as": ["y"]}],
                            fields={"id": "id", "question": "qs", "answers": "as"}, flatten=True)
    with pytest.raises(WorkflowError, match="length_mismatch 10"):
        normalise.main(args(settings, raw, tmp_path))


def test_a_split_with_every_row_rejected_fails_even_at_threshold_one(tmp_path):
    settings, raw = prepare(tmp_path, [{"q": "", "a": "x"}], max_rejected_fraction=1.0)
    with pytest.raises(WorkflowError, match=r"1 of 1 rows of split .train. rejected \(100.0%\), so no row is left"):
        normalise.main(args(settings, raw, tmp_path))


def test_a_missing_source_split_names_the_alias(tmp_path):
    settings, raw = prepare(tmp_path, [good(0)])
    settings["splits"]["validation"] = "dev"
    with pytest.raises(WorkflowError, match=r"no split 'dev' \(found \['test', 'train'\]\)"):
        normalise.main(args(settings, raw, tmp_path))


def test_a_derived_field_over_an_unknown_field_is_a_config_error(tmp_path):
    settings, raw = prepare(tmp_path, [good(0)], derived={"aux": {"transform": "answer_kind", "field": "label"}})
    with pytest.raises(ConfigError, match=r"datasets\.d\.derived\.aux\.field"):
        normalise.main(args(settings, raw, tmp_path))


# --- other raw layouts ---
def test_csv_parquet_and_json_files_are_read(tmp_path):
    import pandas as pd

    frame = pd.DataFrame({"q": ["a?", "b?"], "a": ["1", "2"]})
    for fmt, write in (("csv", lambda p: frame.to_csv(p, index=False)), ("parquet", frame.to_parquet),
                       ("json", lambda p: p.write_text(frame.to_json(orient="records")))):
        src = tmp_path / fmt / "src"
        src.mkdir(parents=True)
        for split in ("train", "test"):
            write(src / f"{split}.{fmt}")
        settings = {"source": {"type": "local", "path": str(src)}, "format": fmt, "splits": {"train": "train", "test": "test"},
                    "fields": {"question": "q", "answers": "a"}, "metric": "exact_match",
                    "contamination": {"accept": True}}  # one file read as both splits
        out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path / fmt), tmp_path / fmt)
        assert load_from_disk(str(out))["train"]["answers"] == [["1"], ["2"]], fmt


def test_hub_layout_with_images_carries_them_undecoded(tmp_path):
    import io

    from datasets import Dataset, DatasetDict, Features, Image, List, Value
    from PIL import Image as PILImage

    buffer = io.BytesIO()
    PILImage.new("RGB", (2, 2)).save(buffer, format="PNG")
    features = Features({"query": Value("string"), "label": List(Value("string")), "image": Image()})
    rows = [{"query": "q?", "label": ["1"], "image": {"bytes": buffer.getvalue(), "path": None}}]
    raw = tmp_path / "raw"
    DatasetDict({"train": Dataset.from_list(rows, features=features),
                 "test": Dataset.from_list(rows, features=features)}).save_to_disk(str(raw))
    settings = {"source": {"type": "hub", "id": "x/y", "revision": "r"}, "splits": {"train": "train", "test": "test"},
                "fields": {"question": "query", "answers": "label"}, "extra_fields": {"image": "image"},
                "metric": "relaxed_accuracy", "contamination": {"accept": True}}  # the same row in both splits
    out, _ = run_normalise("d", settings, raw, tmp_path)
    row = load_from_disk(str(out))["train"][0]
    assert row["image"]["bytes"] == buffer.getvalue() and row["id"] == "train-0"


def test_output_is_deterministic(tmp_path):
    settings = demo_settings("amr_demo")
    raw = run_download("amr", settings, tmp_path)
    first, _ = run_normalise("amr", settings, raw, tmp_path / "a")
    second, _ = run_normalise("amr", settings, raw, tmp_path / "b")
    arrows = sorted(p.relative_to(first) for p in first.rglob("data-*.arrow"))
    assert arrows and all((first / p).read_bytes() == (second / p).read_bytes() for p in arrows)


# --- reading raw files strictly (raw_records): where each row is, and files that cannot be read ---
def source_files(tmp_path, fmt, train: bytes, test: bytes):
    src = tmp_path / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / f"train.{fmt}").write_bytes(train)
    (src / f"test.{fmt}").write_bytes(test)
    return {"source": {"type": "local", "path": str(src)}, "format": fmt, "splits": {"train": "train", "test": "test"},
            "fields": {"question": "q", "answers": "a"}, "metric": "exact_match", "max_rejected_fraction": 0.5}


def test_rows_are_placed_as_the_editor_shows_them(tmp_path):
    from workflow_scripts.data.raw_records import Place, Unparseable, read_placed

    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"q": "a?"}\n\n{"q": \n')
    assert [(str(p), p.index, r) for p, r in read_placed(jsonl, "jsonl")] == [
        ("line 1", 0, {"q": "a?"}), ("line 3", 2, Unparseable("not valid JSON: line 3 column 7: Expecting value"))]
    csv_file = tmp_path / "t.csv"  # header on line 1, a blank line, a quoted value over two lines, a bad line
    csv_file.write_bytes(b'q,a\r\n\r\n"two\r\nlines?",1\r\nthree?,3,x\r\nfour?,4\r\n')
    assert [(str(p), p.index, r) for p, r in read_placed(csv_file, "csv")] == [
        ("line 3", 0, {"q": "two\r\nlines?", "a": "1"}),
        ("line 5", 1, Unparseable("not valid CSV: line 5 has 3 fields where the header (line 1) has 2; "
                                  "a value that holds a comma must be in double quotes")),
        ("line 6", 2, {"q": "four?", "a": "4"})]
    import pandas as pd

    pd.DataFrame({"q": ["a?", "b?"]}).to_parquet(tmp_path / "t.parquet")
    assert [(str(p), r) for p, r in read_placed(tmp_path / "t.parquet", "parquet")] == [
        ("row index 0", {"q": "a?"}), ("row index 1", {"q": "b?"})]
    assert str(Place(6)) == "row index 6" and str(Place(6, 7)) == "line 7"


def test_a_csv_line_with_an_unquoted_comma_is_counted_unparseable_not_shifted(tmp_path):
    lines = [f"question {i}?,answer {i}" for i in range(9)] + ["how many?,1,000", "short?"]
    settings = source_files(tmp_path, "csv", ("q,a\n" + "\n".join(lines) + "\n").encode(), b"q,a\nx?,1\n")
    raw = run_download("d", settings, tmp_path)
    assert json.loads((tmp_path / "results" / "d" / "download_manifest.json").read_text())["rows"]["train"] == 11
    out, report_path = run_normalise("d", settings, raw, tmp_path)
    report = json.loads(report_path.read_text())
    assert report["splits"]["train"]["reasons"] == {"unparseable_record": 2}
    assert [(e["row"], e["detail"].split(";")[0]) for e in report["reasons"]["unparseable_record"]["examples"]] == [
        (9, "not valid CSV: line 11 has 3 fields where the header (line 1) has 2"),
        (10, "not valid CSV: line 12 has 1 field where the header (line 1) has 2")]
    assert load_from_disk(str(out))["train"]["answers"] == [[f"answer {i}"] for i in range(9)]


def test_a_rejected_csv_row_is_named_by_its_file_line_and_a_parquet_row_by_its_row_index(tmp_path):
    import pandas as pd

    # line 1 the header, lines 2-3 one record (a quoted value over two lines), line 4 the empty question
    csv_settings = source_files(tmp_path / "csv", "csv", b'q,a\n"two\nlines?",1\n,2\nthree?,3\n', b"q,a\nx?,1\n")
    raw = run_download("d", csv_settings, tmp_path / "csv")
    _, report_path = run_normalise("d", csv_settings, raw, tmp_path / "csv")
    example = json.loads(report_path.read_text())["reasons"]["empty_value"]["examples"][0]
    assert example == {"file": str(tmp_path / "csv" / "src" / "train.csv"), "split": "train", "row": 1, "line": 4,
                       "field": "q", "detail": "is empty"}
    assert normalise.describe(example) == f"{tmp_path / 'csv' / 'src' / 'train.csv'} line 4: field 'q': is empty"

    train, test = pd.DataFrame({"q": ["a?", "", "c?"], "a": ["1", "2", "3"]}), pd.DataFrame({"q": ["x?"], "a": ["1"]})
    parquet_settings = source_files(tmp_path / "parquet", "parquet", train.to_parquet(), test.to_parquet())
    raw = run_download("d", parquet_settings, tmp_path / "parquet")
    _, report_path = run_normalise("d", parquet_settings, raw, tmp_path / "parquet")
    example = json.loads(report_path.read_text())["reasons"]["empty_value"]["examples"][0]
    assert example == {"file": str(tmp_path / "parquet" / "src" / "train.parquet"), "split": "train", "row": 1,
                       "line": None, "field": "q", "detail": "is empty"}
    assert normalise.describe(example) == f"{tmp_path / 'parquet' / 'src' / 'train.parquet'} row index 1: field 'q': is empty"


def test_a_byte_order_mark_is_not_part_of_the_first_column_name(tmp_path):
    settings = source_files(tmp_path, "csv", "\ufeffq,a\nx?,1\n".encode(), "\ufeffq,a\ny?,2\n".encode())
    out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path), tmp_path)
    assert load_from_disk(str(out))["train"][0] == {"id": "train-0", "question": "x?", "answers": ["1"]}


@pytest.mark.parametrize("fmt, train, message", [
    ("jsonl", '{"q": "café?", "a": "x"}\n'.encode("latin-1"), r"train\.jsonl line 1: not UTF-8 text \(byte 0xe9 at byte offset 10 of the file\); re-save the file as UTF-8, or set the dataset's on_invalid_text: reject_row to reject and count such rows"),
    ("csv", "q,a\nGrüße?,x\n".encode("cp1252"), r"train\.csv line 2: not UTF-8 text \(byte 0xfc at byte offset 6 of the file\); re-save the file as UTF-8, or set the dataset's on_invalid_text: reject_row to reject and count such rows"),
    ("parquet", b"PAR1", r"train\.parquet: not a readable Parquet file \(.*\); it is truncated or corrupt: download or export it again"),
])
def test_a_file_that_cannot_be_read_downloads_then_fails_normalise_naming_it(tmp_path, fmt, train, message):
    test = {"jsonl": b'{"q": "x?", "a": "1"}\n', "csv": b"q,a\nx?,1\n"}.get(fmt, b"PAR1")
    settings = source_files(tmp_path, fmt, train, test)
    if fmt == "parquet":  # the download manifest counts rows from the footer, so a corrupt file stops download
        with pytest.raises(WorkflowError, match="^" + re.escape(str(tmp_path / "src")) + "/" + message):
            run_download("d", settings, tmp_path)  # the user's file, not download's staging copy
        return
    raw = run_download("d", settings, tmp_path)  # download keeps the bytes; normalise judges them
    with pytest.raises(WorkflowError, match="^" + re.escape(str(tmp_path / "src")) + "/" + message + "$"):
        normalise.main(args(settings, raw, tmp_path))
    assert leftovers(tmp_path / "out") == []


# --- bytes that are not UTF-8: stop naming the line, or reject and count it (on_invalid_text: reject_row) ---
def test_a_jsonl_row_that_is_not_utf8_is_rejected_and_counted_under_reject_row(tmp_path):
    lines = [json.dumps(good(i)).encode() for i in range(30)]
    lines.insert(7, '{"q": "café?", "a": "x"}'.encode("latin-1"))
    settings = source_files(tmp_path, "jsonl", b"\n".join(lines) + b"\n", b'{"q": "x?", "a": "1"}\n')
    raw = run_download("d", settings, tmp_path)
    with pytest.raises(WorkflowError, match="train.jsonl line 8: not UTF-8 text .*on_invalid_text: reject_row"):
        normalise.main(args(settings, raw, tmp_path))
    settings["on_invalid_text"] = "reject_row"
    out, report_path = run_normalise("d", settings, raw, tmp_path)
    report = json.loads(report_path.read_text())
    assert report["splits"]["train"]["reasons"] == {"unparseable_record": 1}
    example = report["reasons"]["unparseable_record"]["examples"][0]
    assert (example["file"], example["line"]) == (str(tmp_path / "src" / "train.jsonl"), 8)
    assert load_from_disk(str(out))["train"].num_rows == 30


def test_a_corpus_line_that_is_not_utf8_is_counted_under_reject_row(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "train.txt").write_bytes(b"first line\ncaf\xe9 au lait\n\nlast line\n")
    (src / "test.txt").write_text("held out\n")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(src)}, "format": "text",
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy", "on_invalid_text": "reject_row"}
    out, report_path = run_normalise("m", settings, run_download("m", settings, tmp_path), tmp_path)
    train = json.loads(report_path.read_text())["splits"]["train"]
    entry = train["files"][str(src / "train.txt")]  # the user's file, not the raw copy
    assert (train["invalid_text"], entry["invalid_text_lines"], entry["blank_lines"]) == (1, [2], [3])
    assert load_from_disk(str(out))["train"]["id"] == ["train-1", "train-4"]


def test_an_evaluation_only_masked_lm_corpus_is_normalised(tmp_path):
    """No train split: the held-out lines are normalised (the check against trained datasets is cross_contamination's)."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "test.txt").write_text("held out line one\n\nheld out line two\n")
    settings = validate_section({"task": "masked_lm", "source": {"type": "local", "path": str(src)}, "format": "text",
                                 "splits": {"test": "test"}, "metric": "masked_accuracy"}, "datasets", "datasets.m")
    out, report_path = run_normalise("m", settings, run_download("m", settings, tmp_path), tmp_path)
    assert load_from_disk(str(out))["test"]["id"] == ["test-1", "test-3"]
    report = json.loads(report_path.read_text())
    assert report["splits"]["test"]["kept"] == 2 and report["contamination"]["splits"] == {}
