"""normalise's train/test contamination check (workflow_scripts/data/contamination.py): planted overlaps stop
the stage naming them; an accepted overlap runs and is reported; the key per task (question, image bytes,
classification text, masked LM line); the max_fraction boundary; nothing written on a stop."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from data_helpers import leftovers, local_dataset, run_download, run_normalise
from workflow_scripts import normalise
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data import contamination
from workflow_scripts.data.rows import RecordMapper

IDS = {"id": "id", "question": "q", "answers": "a"}


def train_rows(n: int = 20) -> list[dict]:
    return [{"id": f"r{i}", "q": f"Question {i}?", "a": f"answer {i}"} for i in range(n)]


def fail(name: str, settings: dict, raw, tmp_path) -> str:
    """normalise's message; asserts that nothing was written (no data, no report, no '.partial')."""
    out = tmp_path / "results" / name
    with pytest.raises(WorkflowError) as caught:
        normalise.main(["--name", name, "--dataset", json.dumps(settings), "--raw", str(raw),
                        "--out", str(out / "normalised"), "--report", str(out / "normalise_report.json")])
    assert not (out / "normalised").exists() and not (out / "normalise_report.json").exists()
    assert [name for name in leftovers(out) if name != "raw" and not name.endswith("manifest.json")] == []
    message = str(caught.value)
    assert "\n" not in message
    return message


def report_of(name: str, settings: dict, raw, tmp_path) -> dict:
    out, report = run_normalise(name, settings, raw, tmp_path)
    assert out.is_dir()
    return json.loads(report.read_text())["contamination"]


# --- generation: a planted overlap (copies with other case, spacing and Unicode form) ---
def planted_test() -> list[dict]:
    copies = [
        {"id": "t0", "q": "  QUESTION 0?  ", "a": "answer 0"},
        {"id": "t1", "q": "question\t1?", "a": "ANSWER 1"},          # answers compared normalised too
        {"id": "t2", "q": "Question\u00a02?", "a": "answer 2"},      # a no-break space
        {"id": "t3", "q": "\uff31uestion 3?", "a": "answer 3"},      # a full-width Q (NFKC)
        {"id": "t4", "q": "question   4?", "a": "answer 4"},
        {"id": "t5", "q": "QUESTION 5?", "a": "answer 5"},
        {"id": "t6", "q": "question 6?", "a": "another answer"},     # same question, other answer
        {"id": "t7", "q": "question 7?", "a": "another answer"},
    ]
    return copies + [{"id": "t8", "q": "What is new?", "a": "x"}, {"id": "t9", "q": "Question 99?", "a": "y"}]


def planted(tmp_path, **settings):
    settings = local_dataset(tmp_path / "src", {"train": train_rows(), "test": planted_test()}, fields=IDS, **settings)
    return settings, run_download("d", settings, tmp_path)


def test_planted_overlap_stops_normalise_naming_the_overlapping_ids(tmp_path):
    settings, raw = planted(tmp_path)
    assert fail("d", settings, raw, tmp_path) == (
        f"{settings['source']['path']}/test.jsonl: 8 of 10 rows of split 'test' (80.0%) repeat a row of split 'train' (same question, "
        "ignoring case, spacing and Unicode form; 6 with the same answers too), more than "
        "datasets.d.contamination.max_fraction = 0.01; overlapping ids (test = train): 't0' = 'r0', 't1' = 'r1', "
        "'t2' = 'r2', ...; set datasets.d.contamination.accept: true to run anyway, or deduplicate the splits")


def test_accepting_the_overlap_runs_and_reports_it(tmp_path):
    settings, raw = planted(tmp_path, contamination={"accept": True})
    section = report_of("d", settings, raw, tmp_path)
    assert section == {
        "compared_with": "train", "key": ["question"], "max_fraction": 0.01, "accept": True,
        "splits": {"test": {
            "checked": 10, "overlapping": 8, "fraction": 0.8, "pairs_overlapping": 6,
            "examples": [{"id": f"t{i}", "train_id": f"r{i}"} for i in range(5)],
            "above_max_fraction": True, "accepted": True}},
    }


def test_a_clean_dataset_reports_zero_for_validation_and_test(tmp_path):
    files = {"train": train_rows(), "validation": [{"id": "v0", "q": "Something else?", "a": "x"}],
             "test": [{"id": "t0", "q": "What is new?", "a": "x"}, {"id": "t1", "q": "Question 1 again?", "a": "y"}]}
    settings = local_dataset(tmp_path / "src", files, fields=IDS,
                             splits={"train": "train", "validation": "validation", "test": "test"})
    section = report_of("d", settings, run_download("d", settings, tmp_path), tmp_path)
    clean = {"overlapping": 0, "pairs_overlapping": 0, "examples": [], "above_max_fraction": False, "accepted": False}
    assert section["splits"] == {"validation": {"checked": 1, "fraction": 0.0, **clean},
                                 "test": {"checked": 2, "fraction": 0.0, **clean}}
    assert (section["accept"], section["max_fraction"]) == (False, 0.01)  # the schema's defaults


def test_validation_is_checked_against_train_too(tmp_path):
    files = {"train": train_rows(), "validation": [{"id": "v0", "q": "question 4?", "a": "x"}],
             "test": [{"id": "t0", "q": "new?", "a": "x"}]}
    settings = local_dataset(tmp_path / "src", files, fields=IDS,
                             splits={"train": "train", "validation": "dev", "test": "test"})
    (tmp_path / "src" / "validation.jsonl").rename(tmp_path / "src" / "dev.jsonl")
    raw = run_download("d", settings, tmp_path)
    assert fail("d", settings, raw, tmp_path).startswith(
        f"{settings['source']['path']}/dev.jsonl: 1 of 1 rows of split 'validation' (100.0%) repeat a row of split 'train'")


# --- the max_fraction boundary: above it stops, at it is reported ---
@pytest.mark.parametrize("copied, max_fraction, stops", [
    (1, 0.01, False),   # 1 of 100 = max_fraction: reported, not fatal
    (2, 0.01, True),    # 2 of 100 is above it
    (0, 0.0, False),    # nothing overlaps: never fatal
    (1, 0.0, True),     # max_fraction 0: any overlap stops
    (100, 1.0, False),  # max_fraction 1: never stops
])
def test_the_max_fraction_boundary(tmp_path, copied, max_fraction, stops):
    test = [{"id": f"t{i}", "q": f"question {i}?" if i < copied else f"new question {i}?", "a": "x"} for i in range(100)]
    settings = local_dataset(tmp_path / "src", {"train": train_rows(100), "test": test}, fields=IDS,
                             contamination={"max_fraction": max_fraction})
    raw = run_download("d", settings, tmp_path)
    if stops:
        assert fail("d", settings, raw, tmp_path).startswith(
            f"{settings['source']['path']}/test.jsonl: {copied} of 100 rows of split 'test' ({copied}.0%) repeat a row of split 'train'")
    else:
        split = report_of("d", settings, raw, tmp_path)["splits"]["test"]
        assert (split["overlapping"], split["fraction"], split["above_max_fraction"], split["accepted"]) == \
            (copied, copied / 100, False, False)


def test_rejections_are_reported_before_the_overlap(tmp_path):
    """A file with too many bad rows is fixed first: its message wins over the overlap's."""
    train = train_rows() + [{"id": f"bad{i}", "q": "", "a": "x"} for i in range(5)]
    settings = local_dataset(tmp_path / "src", {"train": train, "test": planted_test()}, fields=IDS)
    raw = run_download("d", settings, tmp_path)
    assert "rows of split 'train' rejected" in fail("d", settings, raw, tmp_path)


# --- the key: the input fields (extra fields included, derived ones not) ---
def test_an_extra_field_is_part_of_the_key_and_a_derived_field_is_not(tmp_path):
    """ChartQA's layout: the same question about another chart (its image path) is another example;
    a field derived from the answer never makes two rows differ."""
    train = [{"id": f"r{i}", "q": "What is the highest value?", "a": str(i), "img": f"chart{i}.png"} for i in range(10)]
    test = [{"id": "t0", "q": "What is the highest value?", "a": "5", "img": "chart99.png"},
            {"id": "t1", "q": "what is the highest value?", "a": "12%", "img": "CHART3.png"}]
    settings = local_dataset(tmp_path / "src", {"train": train, "test": test}, fields=IDS,
                             extra_fields={"image": "img"}, derived={"aux": {"transform": "answer_kind", "field": "answer"}},
                             contamination={"max_fraction": 1.0})
    section = report_of("d", settings, run_download("d", settings, tmp_path), tmp_path)
    assert section["key"] == ["image", "question"]
    assert section["splits"]["test"]["examples"] == [{"id": "t1", "train_id": "r3"}]
    assert section["splits"]["test"]["pairs_overlapping"] == 0


# --- vision_language: the question AND the image's bytes ---
def png(colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_vision_language_same_question_other_image_is_not_contamination_same_image_is(tmp_path):
    src = tmp_path / "src"
    (src / "images").mkdir(parents=True)
    for name, colour in (("red.png", "red"), ("blue.png", "blue"), ("green.png", "green"), ("red_copy.png", "red")):
        (src / "images" / name).write_bytes(png(colour))
    train = [{"id": "r0", "q": "What colour is the square?", "a": "red", "img": "red.png"},
             {"id": "r1", "q": "What colour is the square?", "a": "blue", "img": "blue.png"}]
    test = [{"id": "t0", "q": "What colour is the square?", "a": "green", "img": "green.png"},  # other image
            {"id": "t1", "q": "what colour is  the square?", "a": "red", "img": "red_copy.png"},  # same bytes
            {"id": "t2", "q": "Which shape is it?", "a": "square", "img": "red.png"}]  # same image, other question
    fields = {**IDS, "image": "img"}
    settings = local_dataset(src, {"train": train, "test": test}, task="vision_language", fields=fields)
    raw = run_download("v", settings, tmp_path)
    assert fail("v", settings, raw, tmp_path) == (
        f"{settings['source']['path']}/test.jsonl: 1 of 3 rows of split 'test' (33.3%) repeat a row of split 'train' (same images + question, "
        "ignoring case, spacing and Unicode form; 1 with the same answers too), more than "
        "datasets.v.contamination.max_fraction = 0.01; overlapping ids (test = train): 't1' = 'r0'; "
        "set datasets.v.contamination.accept: true to run anyway, or deduplicate the splits")
    section = report_of("v", {**settings, "contamination": {"accept": True}}, raw, tmp_path)
    assert section["key"] == ["images", "question"]
    assert section["splits"]["test"]["examples"] == [{"id": "t1", "train_id": "r0"}]


# --- classification: text (+ text_pair) ---
def test_classification_text_overlap_and_text_pair(tmp_path):
    train = [{"id": f"r{i}", "s": f"Sentence number {i}.", "p": "context", "y": "pos" if i % 2 else "neg"} for i in range(10)]
    test = [{"id": "t0", "s": "SENTENCE number 3.", "p": "Context", "y": "neg"},    # same text + pair, other label
            {"id": "t1", "s": "Sentence number 4.", "p": "another context", "y": "neg"},  # other pair
            {"id": "t2", "s": "Sentence number 5.", "p": "context", "y": "pos"}]    # same text, pair and label
    fields = {"id": "id", "text": "s", "text_pair": "p", "label": "y"}
    settings = local_dataset(tmp_path / "src", {"train": train, "test": test}, task="classification",
                             fields=fields, metric="accuracy", contamination={"max_fraction": 0.5})
    raw = run_download("c", settings, tmp_path)
    assert fail("c", settings, raw, tmp_path) == (
        f"{settings['source']['path']}/test.jsonl: 2 of 3 rows of split 'test' (66.7%) repeat a row of split 'train' (same text + text_pair, "
        "ignoring case, spacing and Unicode form; 1 with the same label too), more than "
        "datasets.c.contamination.max_fraction = 0.5; overlapping ids (test = train): 't0' = 'r3', 't2' = 'r5'; "
        "set datasets.c.contamination.accept: true to run anyway, or deduplicate the splits")
    section = report_of("c", {**settings, "contamination": {"max_fraction": 0.5, "accept": True}}, raw, tmp_path)
    assert section["key"] == ["text", "text_pair"]
    assert section["splits"]["test"]["pairs_overlapping"] == 1


# --- masked LM: whole lines, streamed from the written corpus before it is published ---
def corpus(tmp_path, test_lines: list[str], **settings):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "train.txt").write_text("\n".join(f"Line number {i} of the corpus." for i in range(50)) + "\n")
    (src / "test.txt").write_text("\n".join(test_lines) + "\n")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(src)}, "format": "text",
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy", **settings}
    return settings, run_download("m", settings, tmp_path)


def test_masked_lm_lines_overlap_stops_and_accepting_reports(tmp_path):
    lines = ["line number 7 of the corpus.", "A new line.", "", "  LINE NUMBER 8 OF THE CORPUS. ", "Another new line."]
    settings, raw = corpus(tmp_path, lines)
    assert fail("m", settings, raw, tmp_path) == (
        f"{settings['source']['path']}/test.txt: 2 of 4 rows of split 'test' (50.0%) repeat a row of split 'train' (same text, ignoring case, "
        "spacing and Unicode form), more than datasets.m.contamination.max_fraction = 0.01; overlapping ids "
        "(test = train): 'test-1' = 'train-8', 'test-4' = 'train-9'; set datasets.m.contamination.accept: true to run "
        "anyway, or deduplicate the splits")
    section = report_of("m", {**settings, "contamination": {"accept": True}}, raw, tmp_path)
    assert section["key"] == ["text"]
    assert section["splits"]["test"] == {
        "checked": 4, "overlapping": 2, "fraction": 0.5, "pairs_overlapping": None,
        "examples": [{"id": "test-1", "train_id": "train-8"}, {"id": "test-4", "train_id": "train-9"}],
        "above_max_fraction": True, "accepted": True}


def test_masked_lm_clean_corpus_reports_zero(tmp_path):
    settings, raw = corpus(tmp_path, ["A new line.", "Another new line."])
    assert report_of("m", settings, raw, tmp_path)["splits"]["test"]["overlapping"] == 0


# --- the pieces ---
@pytest.mark.parametrize("text, normalised", [
    ("  What IS   x? ", "what is x?"),
    ("tab\tand\nnewline", "tab and newline"),
    ("no\u00a0break", "no break"),
    ("\uff21\uff22", "ab"),           # full-width letters (NFKC)
    ("Stra\u00dfe", "strasse"),        # casefold, not lower
    ("e\u0301", "\u00e9"),             # composed (NFKC)
])
def test_normalise_text(text, normalised):
    assert contamination.normalise_text(text) == normalised


def test_row_keys_ignore_the_id_and_derived_fields_and_treat_answers_as_a_set():
    mapper = RecordMapper(DatasetSettings.parse({"source": {"type": "local", "path": "d"}, "fields": IDS, "metric": "exact_match",
                                                 "derived": {"aux": {"transform": "answer_kind", "field": "answer"}}}, "d"),
                          "datasets.d")
    one = {"id": "a", "question": "Q?", "answers": ["x", "y"], "aux": "text"}
    other = {"id": "b", "question": " q? ", "answers": ["Y", "x"], "aux": "number"}
    assert mapper.contamination_key(one) == mapper.contamination_key(other)
    assert mapper.contamination_fields(one) == ["question"]
    assert mapper.contamination_key(one)[0] == mapper.contamination_key({**one, "answers": ["z"]})[0]
    assert mapper.contamination_key(one)[1] != mapper.contamination_key({**one, "answers": ["z"]})[1]
    image = {"id": "a", "question": "Q?", "answers": ["x"], "images": [b"\x89PNG one"]}
    assert contamination.row_keys(image)[0] != contamination.row_keys({**image, "images": [b"\x89PNG two"]})[0]


def test_a_conversation_is_keyed_on_its_turns_before_the_last_and_paired_with_the_last():
    def chat(question, reply, system=None):
        turns = [{"role": "system", "content": system}] if system else []
        return {"id": "c", "messages": turns + [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]}
    key, pair = contamination.row_keys(chat("Hi there", "Hello!"))
    assert contamination.row_keys(chat(" hi  THERE", "hello!")) == (key, pair)
    other_reply = contamination.row_keys(chat("Hi there", "Go away."))
    assert other_reply[0] == key and other_reply[1] != pair  # the same prompt: an overlap, not a pair
    assert contamination.row_keys(chat("Hi there", "Hello!", system="Be terse."))[0] != key
    assert contamination.key_fields(chat("a", "b")) == ["messages"]
    assert contamination.gold_fields(chat("a", "b")) == ["last turn"]


def batches(ids: list[str], keys: list[int], size: int = 7):
    """Key batches of ``size`` rows (several per split), no pair keys."""
    for start in range(0, len(ids), size):
        yield ids[start:start + size], np.array(keys[start:start + size], dtype=np.uint64), None


def test_checked_keys_hold_eight_bytes_a_distinct_checked_row_and_train_streams_past():
    train_ids, train_keys = [f"r{i}" for i in range(1000)], [i * 2 for i in range(1000)]
    test_ids, test_keys = [f"t{i}" for i in range(100)] + ["t-again"], list(range(100)) + [0]
    checked = contamination.CheckedKeys({"test": batches(test_ids, test_keys)})
    assert checked.keys.nbytes == 8 * 100 and checked.pairs.size == 0
    checked.add_train(batches(train_ids + ["again"], train_keys + [0]))
    # train passed by in batches of 7 and left nothing behind but the flags
    assert checked.train_rows == 1001 and checked.keys.nbytes == 8 * 100 and checked.in_train.sum() == 50
    result = contamination.overlap("test", checked, lambda: batches(test_ids, test_keys))
    assert (result.checked, result.overlapping, result.pairs_overlapping) == (101, 51, None)
    assert [test_id for test_id, _ in result.first] == ["t0", "t2", "t4", "t6", "t8"]
    contamination.name_train_ids([result], batches(train_ids, train_keys))
    assert result.examples(2) == [{"id": "t0", "train_id": "r0"}, {"id": "t2", "train_id": "r1"}]


def test_a_saved_split_is_read_from_its_files_not_its_memory_map(tmp_path, monkeypatch):
    from datasets import Dataset, load_from_disk

    rows = [{"id": f"x{i}", "text": f"Line {i % 50}"} for i in range(2500)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "set"))
    saved = load_from_disk(str(tmp_path / "set"))
    monkeypatch.setattr(type(saved), "with_format", lambda *a, **k: pytest.fail("read through the memory map"))
    streamed = list(contamination.keyed_batches(saved, batch_size=1000))
    assert [len(keys) for _, keys, _ in streamed] == [1000, 1000, 500]
    assert np.array_equal(np.concatenate([keys for _, keys, _ in streamed]),
                          contamination.line_keys([row["text"] for row in rows]))
    assert streamed[2][0][499].as_py() == "x2499"


def test_keyed_rows_and_keyed_batches_agree_on_the_same_rows():
    from datasets import Dataset

    rows = [{"id": f"x{i}", "text": f"Line  {i % 5}", "label": "a"} for i in range(23)]
    [(ids, keys, pairs)] = contamination.keyed_rows(rows)
    streamed = list(contamination.keyed_batches(Dataset.from_list(rows), batch_size=10))
    assert len(streamed) == 3 and ids == [row["id"] for row in rows]
    assert np.array_equal(np.concatenate([b[1] for b in streamed]), keys)
    assert np.array_equal(np.concatenate([b[2] for b in streamed]), pairs)
    lines = Dataset.from_list([{"id": "l0", "text": "A  line"}, {"id": "l1", "text": "a line"}])
    [(line_ids, line_keys, none)] = contamination.keyed_batches(lines)
    assert line_keys[0] == line_keys[1] and none is None and line_ids[1].as_py() == "l1"


def test_contamination_settings_are_checked_by_the_schema(tmp_path):
    from workflow_scripts.core.errors import ConfigError

    settings = local_dataset(tmp_path / "src", {"train": train_rows(), "test": planted_test()}, fields=IDS,
                             contamination={"max_fraction": 1.5})
    raw = run_download("d", {**settings, "contamination": {}}, tmp_path)
    with pytest.raises(ConfigError, match=r"datasets\.d\.contamination\.max_fraction': 1\.5 is greater than the maximum of 1"):
        normalise.main(["--name", "d", "--dataset", json.dumps(settings), "--raw", str(raw),
                        "--out", str(tmp_path / "o"), "--report", str(tmp_path / "r.json")])
