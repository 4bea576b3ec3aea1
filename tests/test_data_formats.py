"""The data users bring (issue 37): AMR in PENMAN text, compressed line files, integer labels, other encodings,
duplicates within a split, gold graphs a metric cannot read, lists in CSV cells; each defect planted and named."""
from __future__ import annotations

import bz2
import copy
import gzip
import json
import os
from pathlib import Path

import penman
import pytest
from datasets import load_from_disk

from data_helpers import ROOT, demo_settings, run_download, run_normalise, write_jsonl
from workflow_scripts import normalise
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.data.split_names import check_local_splits


def normalise_args(name: str, settings: dict, raw: Path, tmp: Path) -> list[str]:
    return ["--name", name, "--dataset", json.dumps(settings), "--raw", str(raw),
            "--out", str(tmp / "out" / "normalised"), "--report", str(tmp / "out" / "report.json")]


def failing(settings: dict, raw: Path, tmp: Path, name: str = "d") -> str:
    with pytest.raises(WorkflowError) as caught:
        normalise.main(normalise_args(name, settings, raw, tmp))
    assert not (tmp / "out" / "normalised").exists()
    return str(caught.value)


def parse_check(name: str, settings: dict) -> None:
    """The checks snakemake -n runs on a local dataset (rules/common.smk's check_local_splits)."""
    check_local_splits({name: DatasetSettings.parse(settings, name)})


# --- AMR in PENMAN text ------------------------------------------------------------------------------------
HEADER = "# AMR release (demo); corpus: demo; section: {split}; number of AMRs: {n}\n\n"


def penman_text(records: list[dict], split: str) -> str:
    """Demo records as an AMR release writes them: a header comment, then per block ``# ::id``, ``# ::snt`` and the
    graph indented over several lines. A record whose sentence is no string, or without a graph, loses that line."""
    blocks = []
    for record in records:
        lines = [f"# ::id {record['id']} ::date 2026-11-28T00:00:00"]
        if isinstance(record.get("sentence"), str) and record["sentence"].strip():
            lines.append(f"# ::snt {record['sentence']}")
        graph = record.get("graph")
        if graph is not None:
            try:
                lines.append(penman.format(penman.parse(graph)))  # indented, as the releases print graphs
            except penman.exceptions.DecodeError:
                lines.append(graph)  # the planted broken graph, kept broken
        blocks.append("\n".join(lines))
    return HEADER.format(split=split, n=len(records)) + "\n\n".join(blocks) + "\n"


def write_demo_amr_as_penman(directory: Path, compress: bool = False) -> None:
    for split in ("train", "validation", "test"):
        records = [json.loads(line) for line in (ROOT / "demo_data" / "amr" / f"{split}.jsonl").read_text().splitlines()]
        text = penman_text(records, split)
        directory.mkdir(parents=True, exist_ok=True)
        if compress:
            (directory / f"{split}.txt.gz").write_bytes(gzip.compress(text.encode()))
        else:
            (directory / f"{split}.txt").write_text(text)


def penman_settings(path: Path, **changes) -> dict:
    settings = demo_settings("amr_demo")
    settings.update({"source": {"type": "local", "path": str(path)}, "format": "penman",
                     "fields": {"id": "id", "question": "snt", "answers": "graph"}, **changes})
    settings.pop("models", None)
    return settings


@pytest.mark.parametrize("compress", [False, True], ids=["txt", "txt.gz"])
def test_the_demo_amr_data_as_penman_text_gives_the_same_normalised_rows_as_its_jsonl(tmp_path, compress):
    jsonl = demo_settings("amr_demo")
    jsonl.pop("models", None)
    write_demo_amr_as_penman(tmp_path / "penman", compress)
    settings = penman_settings(tmp_path / "penman")
    parse_check("amr", settings)  # snakemake -n accepts the layout
    expected_out, _ = run_normalise("amr", jsonl, run_download("amr", jsonl, tmp_path / "a"), tmp_path / "a")
    out, report = run_normalise("amr", settings, run_download("amr", settings, tmp_path / "b"), tmp_path / "b")
    expected, got = load_from_disk(str(expected_out)), load_from_disk(str(out))
    for split in ("train", "validation", "test"):
        columns = ["id", "question", "answers", "aux"]
        assert got[split].select_columns(columns).to_list() == expected[split].select_columns(columns).to_list()
    # the block metadata ride along as fields of the record (mapped as extra fields when wanted)
    assert json.loads(report.read_text())["splits"]["train"]["kept"] == expected["train"].num_rows


def test_bad_penman_blocks_are_rejected_each_named_by_file_block_and_line(tmp_path):
    blocks = [f"# ::id a{k}\n# ::snt Sentence {k}.\n(s / sleep-01\n   :ARG0 (b / boy{k}))" for k in range(30)]
    blocks[4] = "# ::id a4\n# ::snt The boy sleeps.\n(s / sleep-01\n   :ARG0 (b / boy)"  # unbalanced
    blocks[9] = "# ::id a9\n(s / sleep-01 :ARG0 (g / girl))"  # no ::snt
    blocks[14] = "# ::id a3\n# ::snt Again.\n(s / sleep-01 :ARG0 (d / dog))"  # duplicate id
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.txt").write_text("# a header comment\n\n" + "\n\n".join(blocks) + "\n")
    (source / "test.txt").write_text("# ::id t1\n# ::snt A test.\n(t / test-01)\n")
    settings = penman_settings(source, max_rejected_fraction=0.5, derived={}, metric="smatch", also_metrics=[],
                               splits={"train": "train", "test": "test"})
    raw = run_download("d", settings, tmp_path)
    _, report = run_normalise("d", settings, raw, tmp_path)
    reasons = json.loads(report.read_text())["reasons"]
    shown = {reason: [(e["file"], e.get("block"), e["line"], e["field"], e["detail"]) for e in entry["examples"]]
             for reason, entry in reasons.items()}
    train = str(source / "train.txt")
    # numbered as a user counts the graphs: blocks[4] is the 5th (the header comment is no graph)
    assert shown["unparseable_record"] == [(train, 5, 23, None, "not valid PENMAN: block 5 (line 23): Unexpected end of "
                                            "input at line 26")]
    assert shown["missing_field"] == [(train, 10, 48, "snt", "is missing")]
    assert shown["duplicate_id"] == [(train, 15, 71, "id", "id 'a3' occurs earlier in the split")]
    assert normalise.describe(reasons["missing_field"]["examples"][0]) == f"{train} block 10 (line 48): field 'snt': is missing"


def penman_source(tmp_path, train: str, test: str = "# ::id t1\n# ::snt A test.\n(t / test-01)\n") -> tuple[dict, Path]:
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "train.txt").write_text(train)
    (source / "test.txt").write_text(test)
    settings = penman_settings(source, max_rejected_fraction=0.5, derived={}, metric="smatch", also_metrics=[],
                               splits={"train": "train", "test": "test"})
    return settings, source


def penman_reasons(settings: dict, tmp_path) -> dict:
    _, report = run_normalise("d", settings, run_download("d", settings, tmp_path), tmp_path)
    reasons = json.loads(report.read_text())["reasons"]
    return {reason: [normalise.describe(example) for example in entry["examples"]] for reason, entry in reasons.items()}


GOOD_BLOCKS = [f"# ::id a{k}\n# ::snt Sentence {k}.\n(s / sleep-01\n   :ARG0 (b / boy{k}))" for k in range(6)]


def test_a_top_node_closed_one_line_early_is_refused_naming_block_line_and_the_leftover_text(tmp_path):
    blocks = list(GOOD_BLOCKS)
    blocks[2] = "# ::id a2\n# ::snt The girl does not sleep.\n(s / sleep-01\n   :ARG0 (g / girl))\n   :polarity -"
    settings, source = penman_source(tmp_path, "# AMR release; header\n\n" + "\n\n".join(blocks) + "\n")
    # the graphs are numbered as a user counts them (the header comment is no graph): the third is block 3
    assert penman_reasons(settings, tmp_path)["unparseable_record"] == [
        f"{source}/train.txt block 3 (line 13): not valid PENMAN: block 3 (line 13): text after the graph's last "
        "bracket at line 17: ':polarity -' (a graph ends with its top node's bracket: is the top node closed early?)"]


def test_the_gold_graph_check_refuses_text_after_the_top_node_and_counts_nothing_else():
    from workflow_scripts.data.raw_records import penman_graph_problem

    assert penman_graph_problem("(s / sleep-01 :ARG0 (g / girl)) :polarity -") == (
        "text after the graph's last bracket at line 1: ':polarity -' (a graph ends with its top node's bracket: is "
        "the top node closed early?)")
    assert penman_graph_problem("(s / sleep-01 :ARG0 (g / girl) :polarity -)") is None
    assert penman_graph_problem('(s / say-01 :ARG1 (q / "a (quoted) text)"))') is None


def test_a_sentence_holding_double_colons_is_read_whole(tmp_path):
    from workflow_scripts.data import raw_records

    path = tmp_path / "train.txt"
    path.write_text("# ::id a1 ::date 2026-11-29 ::annotator x\n# ::snt Call std::sort on it.\n(c / call-02)\n")
    [(_, record)] = raw_records.read_placed(path, "penman")
    assert record == {"id": "a1", "date": "2026-11-29", "annotator": "x", "snt": "Call std::sort on it.",
                      "graph": "(c / call-02)"}


def test_a_graph_nested_thousands_deep_is_refused_by_block_not_a_recursion_error(tmp_path):
    from workflow_scripts.data import raw_records

    deep = "".join(f"(n{i} / thing :mod " for i in range(4000)) + "(z / zero)" + ")" * 4000
    blocks = list(GOOD_BLOCKS)
    blocks[1] = "# ::id a1\n# ::snt Deep.\n" + deep
    settings, source = penman_source(tmp_path, "\n\n".join(blocks) + "\n")
    assert penman_reasons(settings, tmp_path)["unparseable_record"] == [
        f"{source}/train.txt block 2 (line 6): not valid PENMAN: block 2 (line 6): the graph nests 4001 levels deep, "
        f"more than the {raw_records.PENMAN_MAX_DEPTH} this reader (and penman's writer) can follow; an AMR graph "
        "nests a few dozen: check the block"]
    assert raw_records.penman_graph_problem(deep).startswith("the graph nests 4001 levels deep")


def test_json_lines_in_a_penman_file_stop_naming_the_real_cause(tmp_path):
    lines = "".join(json.dumps({"id": f"a{k}", "snt": "x", "graph": "(a / b)"}) + "\n\n" for k in range(3))
    settings, source = penman_source(tmp_path, lines)
    message = failing(settings, run_download("d", settings, tmp_path), tmp_path)
    assert "absent from every row" not in message
    assert (f"for example {source}/train.txt block 1 (line 1): not valid PENMAN: block 1 (line 1) does not start "
            "with a graph but with '{\"id\": \"a0\", \"snt\": \"x\", \"graph\": \"(a / b)\"}' (a graph starts with "
            "'('; a file of JSON lines is format: jsonl)") in message


def test_a_penman_file_of_comments_only_stops_naming_it(tmp_path):
    settings, source = penman_source(tmp_path, "# AMR release; header\n\n# another comment\n")
    message = failing(settings, run_download("d", settings, tmp_path), tmp_path)
    assert message.startswith(f"{source}/train.txt: holds no PENMAN graph: its 2 blocks are comments only")


def test_penman_files_are_read_under_source_files_globs_too(tmp_path):
    source = tmp_path / "src"
    write_demo_amr_as_penman(source / "parts", compress=True)
    settings = penman_settings(source, source={"type": "local", "path": str(source),
                                               "files": {"train": "parts/train*.txt.gz", "validation": "parts/validation.txt.gz",
                                                         "test": "parts/test.txt.gz"}})
    parse_check("amr", settings)
    out, _ = run_normalise("amr", settings, run_download("amr", settings, tmp_path), tmp_path)
    assert load_from_disk(str(out))["train"].num_rows > 500


def test_format_text_for_amr_records_is_refused_at_parse_time_pointing_at_penman(tmp_path):
    write_demo_amr_as_penman(tmp_path / "amr")
    settings = penman_settings(tmp_path / "amr", format="text")
    with pytest.raises(ConfigError, match=r"datasets\.amr\.format': format text .* is read by task masked_lm only, not "
                                          r"generation; for AMR graphs in PENMAN text .* set format: penman"):
        parse_check("amr", settings)


# --- compressed line files -----------------------------------------------------------------------------------
def test_gzipped_jsonl_shards_are_accepted_at_parse_time_and_lines_are_counted_decompressed(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for k in range(2):
        lines = [json.dumps({"q": f"q{k}.{i}?", "a": "1"}) for i in range(30)]
        if k == 1:
            lines[20] = '{"q": "cut'
        (source / f"train-{k:05d}-of-00002.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    (source / "test.jsonl.bz2").write_bytes(bz2.compress(b'{"q": "x?", "a": "1"}\n'))
    settings = {"source": {"type": "local", "path": str(source), "files": {"train": "train-*.jsonl.gz"}},
                "splits": {"train": "train", "test": "test"}, "fields": {"question": "q", "answers": "a"},
                "metric": "exact_match", "max_rejected_fraction": 0.5}
    parse_check("d", settings)
    raw = run_download("d", settings, tmp_path)
    _, report = run_normalise("d", settings, raw, tmp_path)
    example = json.loads(report.read_text())["reasons"]["unparseable_record"]["examples"][0]
    assert (example["file"], example["line"]) == (str(source / "train-00001-of-00002.jsonl.gz"), 21)
    assert json.loads(report.read_text())["splits"]["test"]["kept"] == 1


def test_a_plain_csv_split_may_be_gzipped_and_a_text_corpus_bzip2ed(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.csv.gz").write_bytes(gzip.compress(b"q,a\n" + b"".join(b"q%d?,%d\n" % (i, i) for i in range(20))))
    (source / "test.csv").write_text("q,a\nx?,1\n")
    settings = {"source": {"type": "local", "path": str(source)}, "format": "csv", "splits": {"train": "train", "test": "test"},
                "fields": {"question": "q", "answers": "a"}, "metric": "exact_match"}
    parse_check("d", settings)
    out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path / "csv"), tmp_path / "csv")
    assert load_from_disk(str(out))["train"].num_rows == 20
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt.bz2").write_bytes(bz2.compress(b"one line\n\nanother line\n"))
    (corpus / "test.txt").write_text("a test line\n")
    text = {"task": "masked_lm", "format": "text", "source": {"type": "local", "path": str(corpus)},
            "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy"}
    parse_check("c", text)
    out, report = run_normalise("c", text, run_download("c", text, tmp_path / "text"), tmp_path / "text")
    assert load_from_disk(str(out))["train"]["id"] == ["train-1", "train-3"]


# --- gold graphs a graph metric cannot read -----------------------------------------------------------------
def test_an_unbalanced_gold_graph_is_rejected_at_normalise_without_any_derived_field(tmp_path):
    source = tmp_path / "src"
    rows = [{"id": f"r{i}", "s": f"The boy {i} sleeps.", "g": f"(s / sleep-01 :ARG0 (b / boy{i}))"} for i in range(20)]
    rows[7]["g"] = "(s / sleep-01 :ARG0 (b / boy)"
    write_jsonl(source / "train.jsonl", rows)
    write_jsonl(source / "test.jsonl", [{"id": "t", "s": "A dog runs.", "g": "(r / run-02 :ARG0 (d / dog))"}])
    settings = {"source": {"type": "local", "path": str(source)}, "splits": {"train": "train", "test": "test"},
                "fields": {"id": "id", "question": "s", "answers": "g"}, "metric": "smatch"}
    message = failing(settings, run_download("d", settings, tmp_path), tmp_path)
    assert message == (f"{source}/train.jsonl: 1 of 20 rows of split 'train' rejected (5.0%), more than "
                       "datasets.d.max_rejected_fraction = 0.01; reasons: unreadable_gold 1; for example "
                       f"{source}/train.jsonl line 8: field 'g': gold graph '(s / sleep-01 :ARG0 (b / boy)' is not one "
                       "PENMAN graph (Unexpected end of input), so metric smatch would score it as read by guesswork; fix "
                       "the graph; fix the rows or raise datasets.d.max_rejected_fraction")


@pytest.mark.parametrize("key", ["metric", "also_metrics"])
def test_smatchpp_on_a_dataset_without_graphs_is_refused_at_parse_time(tmp_path, key):
    from workflow_scripts.checks.config import check_gold_graphs

    source = tmp_path / "src"
    write_jsonl(source / "train.jsonl", [{"q": f"How tall is bar {i}?", "a": [f"{i}.5"]} for i in range(10)])
    write_jsonl(source / "test.jsonl", [{"q": "x?", "a": ["25.5"]}])
    settings = {"source": {"type": "local", "path": str(source)}, "splits": {"train": "train", "test": "test"},
                "fields": {"question": "q", "answers": "a"}, "metric": "smatchpp" if key == "metric" else "exact_match",
                **({"also_metrics": ["smatchpp"]} if key == "also_metrics" else {})}
    with pytest.raises(ConfigError) as caught:
        check_gold_graphs(DatasetSettings.parse(settings, "chart"), "config.yaml")
    assert str(caught.value) == (
        f"config.yaml: config key 'datasets.chart.{key}': is smatchpp, which scores AMR graphs in PENMAN notation, but "
        f"the gold answers of split 'train' are no graphs: {source}/train.jsonl line 1, field 'a': '0.5' (and the first "
        "5 alike); score the dataset with a metric for its answers (exact_match, token_f1, relaxed_accuracy...)")
    check_gold_graphs(DatasetSettings.parse(demo_settings("amr_demo"), "amr_demo"))  # the AMR demo passes


# --- integer labels --------------------------------------------------------------------------------------------
def classification(tmp_path, labels: list[str], declared: list[str] | None, test: str = "q,a\nan odd one,1\n"):
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    (source / "train.csv").write_text("text,label\n" + "".join(f"sentence {i},{label}\n" for i, label in enumerate(labels)))
    (source / "test.csv").write_text("text,label\na test sentence,1\n")
    settings = {"task": "classification", "format": "csv", "source": {"type": "local", "path": str(source)},
                "splits": {"train": "train", "test": "test"}, "fields": {"text": "text", "label": "label"},
                "metric": "accuracy", **({"labels": declared} if declared else {})}
    return settings, run_download("d", settings, tmp_path)


def test_integer_labels_are_mapped_to_the_declared_names_by_index_and_the_mapping_is_said(tmp_path, capsys):
    settings, raw = classification(tmp_path, ["0", "1", "2"] * 10, ["neg", "neu", "pos"])
    out, report = run_normalise("d", settings, raw, tmp_path)
    assert load_from_disk(str(out))["train"]["label"][:3] == ["neg", "neu", "pos"]
    assert load_from_disk(str(out))["test"]["label"] == ["neu"]
    assert json.loads(report.read_text())["label_mapping"] == {"by_index": {"0": "neg", "1": "neu", "2": "pos"}, "rows": 31}
    assert ("d: labels: declared ['neg', 'neu', 'pos']; 31 rows gave integer class ids, mapped to the declared labels "
            "by index (0 -> neg, 1 -> neu, 2 -> pos), as datasets' ClassLabel does") in capsys.readouterr().out


def test_an_integer_label_outside_the_declared_labels_is_rejected_by_row(tmp_path):
    settings, raw = classification(tmp_path, ["0", "1", "2"] * 10 + ["3"], ["neg", "neu", "pos"])
    message = failing(settings, raw, tmp_path)
    assert message.endswith(f"for example {tmp_path}/src/train.csv line 32: field 'label': label 3 is neither a declared "
                            "name nor a class id 0..2 of the declared labels ['neg', 'neu', 'pos'] (integer labels are "
                            "mapped by index); fix the rows or raise datasets.d.max_rejected_fraction")


def test_without_labels_the_inferred_set_is_printed_with_counts_and_a_rare_class_flagged(tmp_path, capsys):
    settings, raw = classification(tmp_path, ["0", "1", "2"] * 12 + ["3"], None)
    settings["max_rejected_fraction"] = 0.5
    _, report = run_normalise("d", settings, raw, tmp_path)
    log = capsys.readouterr().out
    assert "d: labels: not declared, so inferred from the train split: 0: 12, 1: 12, 2: 12, 3: 1" in log
    assert "d: warning: labels ['3'] occur in fewer than 5 train rows ({'3': 1})" in log
    assert json.loads(report.read_text())["rare_classes"] == {"3": 1}


def test_integer_labels_that_are_not_ids_from_zero_are_flagged(tmp_path, capsys):
    settings, raw = classification(tmp_path, ["1", "2", "5"] * 6, None)
    settings["max_rejected_fraction"] = 0.5
    run_normalise("d", settings, raw, tmp_path)
    assert ("d: warning: the integer labels ['1', '2', '5'] are not the class ids 0..2: each is taken as a class name; "
            "if they are ids into a list of names, declare labels:") in capsys.readouterr().out


def test_a_fractional_label_among_integers_is_rejected_not_made_a_class(tmp_path):
    settings, raw = classification(tmp_path, ["0", "1", "2"] * 12 + ["1.0"], None)
    message = failing(settings, raw, tmp_path)
    assert ("field 'label': label '1.0' is a number but not an integer class id (it would become a class of its own); "
            "write integer ids (0, 1, 2...) or class names") in message


def classlabel_parquet(tmp_path, names: list[str], ids: list[int], declared: list[str] | None) -> tuple[dict, Path]:
    """A classification split exported by datasets (``Dataset.to_parquet``) with a ClassLabel column: the ids in
    the rows, the names only in the schema's ``huggingface`` metadata."""
    from datasets import ClassLabel, Dataset, Features, Value

    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    features = Features({"text": Value("string"), "label": ClassLabel(names=names)})
    for split, rows in (("train", ids), ("test", ids[:2])):
        Dataset.from_dict({"text": [f"{split} sentence {i}" for i in range(len(rows))], "label": rows},
                          features=features).to_parquet(str(source / f"{split}.parquet"))
    settings = {"task": "classification", "format": "parquet", "source": {"type": "local", "path": str(source)},
                "splits": {"train": "train", "test": "test"}, "fields": {"text": "text", "label": "label"},
                "metric": "accuracy", **({"labels": declared} if declared else {})}
    return settings, run_download("d", settings, tmp_path)


@pytest.mark.parametrize("declared", [None, ["neg", "pos"], ["pos", "neg"]], ids=["undeclared", "same-order", "reversed"])
def test_a_classlabel_parquet_export_is_read_by_its_names_whatever_the_declared_order(tmp_path, capsys, declared):
    ids = [0, 1, 1, 0] * 5
    settings, raw = classlabel_parquet(tmp_path, ["neg", "pos"], ids, declared)
    out, report = run_normalise("d", settings, raw, tmp_path)
    assert load_from_disk(str(out))["train"]["label"] == [["neg", "pos"][i] for i in ids]  # never swapped
    meta = json.loads((out / "task_meta.json").read_text())
    assert meta["labels"] == (declared or ["neg", "pos"])  # without labels: the names, not '0'/'1'
    assert json.loads(report.read_text())["class_names"] == {"train": ["neg", "pos"], "test": ["neg", "pos"]}
    assert "d: labels: the source's ClassLabel names ['neg', 'pos'] name its class ids" in capsys.readouterr().out


def test_a_hub_dataset_saved_with_a_classlabel_column_is_read_by_its_names(tmp_path):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"text": Value("string"), "label": ClassLabel(names=["neg", "pos"])})
    ids = [1, 0, 1, 1] * 3
    raw = tmp_path / "raw"  # as download saves a hub source (DatasetDict.save_to_disk)
    DatasetDict({split: Dataset.from_dict({"text": [f"{split} {i}" for i in range(len(ids))], "label": ids}, features=features)
                 for split in ("train", "test")}).save_to_disk(str(raw))
    settings = {"task": "classification", "source": {"type": "hub", "id": "some/dataset", "revision": "0" * 40},
                "splits": {"train": "train", "test": "test"}, "fields": {"text": "text", "label": "label"},
                "metric": "accuracy", "labels": ["pos", "neg"]}
    out, _ = run_normalise("d", settings, raw, tmp_path)
    assert load_from_disk(str(out))["train"]["label"] == [["neg", "pos"][i] for i in ids]


def test_a_split_of_parquet_files_with_different_classlabel_names_is_refused_naming_both(tmp_path):
    from datasets import ClassLabel, Dataset, Features, Value
    from workflow_scripts.data import raw_records

    for part, names in (("train-0", ["neg", "pos"]), ("train-1", ["pos", "neg"])):
        features = Features({"text": Value("string"), "label": ClassLabel(names=names)})
        (tmp_path / "train").mkdir(exist_ok=True)
        Dataset.from_dict({"text": ["a"], "label": [0]}, features=features).to_parquet(str(tmp_path / "train" / f"{part}.parquet"))
    with pytest.raises(WorkflowError) as caught:
        raw_records.class_label_names(tmp_path, "train", "parquet")
    assert str(caught.value) == (
        f"{tmp_path}/train/train-1.parquet: column 'label' has the ClassLabel names ['pos', 'neg'], but "
        f"{tmp_path}/train/train-0.parquet (the same split) has ['neg', 'pos']: the same id would name two classes; "
        "export the split's files with one set of names")


def test_a_parquet_file_without_datasets_metadata_has_no_class_names(tmp_path):
    import pandas as pd
    from workflow_scripts.data import raw_records

    pd.DataFrame({"text": ["a", "b"], "label": [0, 1]}).to_parquet(tmp_path / "train.parquet")
    assert raw_records.class_label_names(tmp_path, "train", "parquet") == {}


def test_a_classlabel_id_outside_the_names_is_rejected_by_row(tmp_path):
    from workflow_scripts.tasks.classification import LabelReading

    settings = DatasetSettings.parse({"task": "classification", "source": {"type": "local", "path": "x"},
                                      "fields": {"text": "text", "label": "label"}, "metric": "accuracy"}, "d")
    from workflow_scripts.tasks.classification import TASK
    with pytest.raises(normalise.Rejected, match=r"label 2 is not a class id 0..1 of the source's ClassLabel names"):
        TASK.normalise_fields({"text": "a", "label": 2}, settings, reading=LabelReading(class_names=("neg", "pos")))


STARS = ["1", "2", "3", "4", "5"]


def test_numeric_names_on_ids_from_zero_are_read_by_index_for_the_whole_column(tmp_path, capsys):
    settings, raw = classification(tmp_path, ["0", "1", "2", "3", "4"] * 4, STARS)
    out, report = run_normalise("d", settings, raw, tmp_path)
    assert load_from_disk(str(out))["train"]["label"][:5] == STARS  # raw 0 -> "1", raw 1 -> "2": never both "1"
    assert load_from_disk(str(out))["test"]["label"] == ["2"]  # the test split's raw 1, by index as the column
    log = capsys.readouterr().out
    assert ("d: labels: declared ['1', '2', '3', '4', '5']; 21 rows gave integer class ids, mapped to the declared "
            "labels by index (0 -> 1, 1 -> 2, 2 -> 3, 3 -> 4, 4 -> 5), as datasets' ClassLabel does") in log
    assert json.loads(report.read_text())["label_mapping"]["read_as"] == "index"


def test_numeric_names_on_the_names_are_read_by_name_for_the_whole_column(tmp_path, capsys):
    settings, raw = classification(tmp_path, STARS * 4, STARS)
    out, report = run_normalise("d", settings, raw, tmp_path)
    assert load_from_disk(str(out))["train"]["label"][:5] == STARS
    assert load_from_disk(str(out))["test"]["label"] == ["1"]
    assert json.loads(report.read_text())["label_mapping"] == {"by_index": {str(i): name for i, name in enumerate(STARS)}, "rows": 0,
                                                               "read_as": "name"}
    assert "d: labels: declared ['1', '2', '3', '4', '5']; every row gave a declared name" in capsys.readouterr().out


def test_a_numeric_label_column_that_reads_both_ways_is_refused_naming_the_key(tmp_path):
    settings, raw = classification(tmp_path, ["1", "2", "3", "4"] * 5, STARS)
    message = failing(settings, raw, tmp_path)
    assert message == (
        "datasets.d.labels: the declared labels ['1', '2', '3', '4', '5'] are numbers, and column "
        "'label' holds ['1', '2', '3', '4'], each both a declared name and a class id 0..4, so the rows cannot say "
        "which they are: by name 1 -> 1, 2 -> 2, 3 -> 3, 4 -> 4, or by index 1 -> 2, 2 -> 3, 3 -> 4, 4 -> 5; give "
        "the rows the ids 0..4 or name every class at least once, or declare labels that are not numbers")


def test_a_numeric_label_column_mixing_names_and_ids_is_refused_showing_the_mapping_rows_would_get(tmp_path):
    settings, raw = classification(tmp_path, ["0", "1", "2", "3", "4", "5"] * 4, STARS)
    message = failing(settings, raw, tmp_path)
    assert message == (
        "datasets.d.labels: the declared labels ['1', '2', '3', '4', '5'] are numbers, and column "
        "'label' holds ['0', '1', '2', '3', '4', '5']: ['0'] only a class id, ['5'] only a declared name, so no one "
        "reading fits the column (row by row: 0 -> 1, 1 -> 1, 2 -> 2, 3 -> 3, 4 -> 4, 5 -> 5, two values onto one "
        "class); give the rows the ids 0..4 or the declared names, not both")


def test_float_labels_stop_naming_the_field_and_a_row_not_an_empty_label_set(tmp_path):
    source = tmp_path / "src"
    write_jsonl(source / "train.jsonl", [{"text": f"s {i}", "label": float(i % 2)} for i in range(10)])
    write_jsonl(source / "test.jsonl", [{"text": "t", "label": 1.0}])
    settings = {"task": "classification", "source": {"type": "local", "path": str(source)},
                "splits": {"train": "train", "test": "test"}, "fields": {"text": "text", "label": "label"},
                "metric": "accuracy"}
    message = failing(settings, run_download("d", settings, tmp_path), tmp_path)
    assert "labels []" not in message
    assert (f"{source}/train.jsonl: 10 of 10 rows of split 'train' rejected (100.0%), so no row is left; reasons: "
            f"wrong_type 10; for example {source}/train.jsonl line 1: field 'label': a label must be a string or an "
            "integer, got float 0.0") in message


# --- encodings ---------------------------------------------------------------------------------------------------
def test_a_utf16_corpus_is_named_file_by_file_with_the_encoding_setting_as_the_fix(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "test"):
        (corpus / f"{split}.txt").write_bytes("\n".join(f"{split} line {i} on the mat" for i in range(50)).encode("utf-16"))
    settings = {"task": "masked_lm", "format": "text", "source": {"type": "local", "path": str(corpus)},
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy", "on_invalid_text": "reject_row"}
    with pytest.raises(ConfigError) as caught:  # snakemake -n names them already
        parse_check("c", settings)
    assert str(caught.value).startswith(f"config key 'datasets.c.encoding': 2 files of the dataset are not UTF-8 text "
                                        f"but utf-16 (a byte-order mark or NUL bytes between the characters): {corpus}/train.txt")
    raw = run_download("c", settings, tmp_path)
    message = failing(settings, raw, tmp_path, name="c")
    assert message == (f"2 files of the dataset are not UTF-8 text but utf-16 (a byte-order mark or NUL bytes between "
                       f"the characters): {corpus}/train.txt (utf-16), {corpus}/test.txt (utf-16); set "
                       "datasets.c.encoding: utf-16 (decoded with Python's codecs), or re-save them as UTF-8")
    report = json.loads((tmp_path / "out" / "report.failed.json").read_text())
    assert report["failed"] == [message]
    settings["encoding"] = "utf-16"
    out, _ = run_normalise("c", settings, raw, tmp_path)
    assert load_from_disk(str(out))["train"]["text"][:1] == ["train line 0 on the mat"]


def test_nul_laden_lines_are_never_kept_even_under_reject_row(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [f"line {i} of the corpus".encode() for i in range(200)]
    lines[10] = "a line in utf-16".encode("utf-16-le")  # a stray line: the file still starts as UTF-8
    (corpus / "train.txt").write_bytes(b"\n".join(lines) + b"\n")
    (corpus / "test.txt").write_text("a test line\n")
    settings = {"task": "masked_lm", "format": "text", "source": {"type": "local", "path": str(corpus)},
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy", "on_invalid_text": "reject_row"}
    out, report = run_normalise("c", settings, run_download("c", settings, tmp_path), tmp_path)
    assert not any("\x00" in text for text in load_from_disk(str(out))["train"]["text"])
    assert json.loads(report.read_text())["splits"]["train"]["files"][f"{corpus}/train.txt"]["invalid_text_lines"] == [11]


def test_a_utf16_jsonl_file_is_read_with_the_encoding_setting(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.jsonl").write_bytes("".join(json.dumps({"q": f"qüestion {i}?", "a": "1"}) + "\n"
                                                 for i in range(5)).encode("utf-16"))
    (source / "test.jsonl").write_bytes('{"q": "x?", "a": "1"}\n'.encode("utf-16"))
    settings = {"source": {"type": "local", "path": str(source)}, "splits": {"train": "train", "test": "test"},
                "fields": {"question": "q", "answers": "a"}, "metric": "exact_match"}
    raw = run_download("d", settings, tmp_path)
    assert "train.jsonl (utf-16), " in failing(settings, raw, tmp_path)
    out, _ = run_normalise("d", {**settings, "encoding": "utf-16"}, raw, tmp_path)
    assert load_from_disk(str(out))["train"]["question"][0] == "qüestion 0?"


# --- duplicates within a split ---------------------------------------------------------------------------------
def test_duplicates_within_a_split_are_counted_with_ids_and_stop_above_the_setting(tmp_path, capsys):
    source = tmp_path / "src"
    rows = [{"id": f"r{i}", "q": f"question {i}?", "a": "1"} for i in range(20)]
    rows += [{"id": "r20", "q": "Question 3?", "a": "1"}, {"id": "r21", "q": "question 4?", "a": "2"}]  # r21: other gold
    write_jsonl(source / "train.jsonl", rows)
    write_jsonl(source / "test.jsonl", [{"id": "t", "q": "x?", "a": "1"}])
    settings = {"source": {"type": "local", "path": str(source)}, "splits": {"train": "train", "test": "test"},
                "fields": {"id": "id", "question": "q", "answers": "a"}, "metric": "exact_match"}
    raw = run_download("d", settings, tmp_path)
    _, report = run_normalise("d", settings, raw, tmp_path)
    split = json.loads(report.read_text())["splits"]["train"]
    assert (split["duplicates"], split["duplicate_ids"]) == (1, [["r20", "r3"]])
    assert "d/train: 1 rows repeat an earlier row of the split (same input and gold; e.g. r20 = r3)" in capsys.readouterr().out
    message = failing({**settings, "duplicates": {"max_fraction": 0.01}}, raw, tmp_path / "again")
    assert message == (f"{source}/train.jsonl: 1 of 22 kept rows of split 'train' (4.5%) repeat an earlier row of the "
                       "split (same input and gold), more than datasets.d.duplicates.max_fraction = 0.01; duplicates: "
                       "'r20' = 'r3'; deduplicate the split or raise datasets.d.duplicates.max_fraction")


def image_folder(source: Path, duplicate: bool = True, empty: bool = False) -> None:
    from vlm_layouts import bar_chart_png

    for split, n in (("train", 8), ("test", 2)):
        (source / split).mkdir(parents=True)
        rows = []
        for k in range(n):
            (source / split / f"img{k:03d}.png").write_bytes(bar_chart_png([k + 1, 3, len(split)]))
            rows.append({"file_name": f"img{k:03d}.png", "query": f"How tall is bar {k}?", "label": str(k)})
        if split == "train" and duplicate:  # another file with the same bytes, question and answer
            (source / split / "copy.png").write_bytes((source / split / "img002.png").read_bytes())
            rows.append({"file_name": "copy.png", "query": "How tall is bar 2?", "label": "2"})
        if split == "train" and empty:
            (source / split / "img004.png").write_bytes(b"")
        write_jsonl(source / split / "metadata.jsonl", rows)


IMAGEFOLDER = {"task": "vision_language", "fields": {"question": "query", "answers": "label", "image": "file_name"},
               "splits": {"train": "train", "test": "test"}, "metric": "exact_match"}


def test_image_rows_repeating_bytes_question_and_answer_are_duplicates(tmp_path):
    image_folder(tmp_path / "src")
    settings = {**IMAGEFOLDER, "source": {"type": "local", "path": str(tmp_path / "src"), "layout": "imagefolder"}}
    _, report = run_normalise("d", settings, run_download("d", settings, tmp_path), tmp_path)
    split = json.loads(report.read_text())["splits"]["train"]
    assert (split["duplicates"], split["duplicate_ids"]) == (1, [["train-8", "train-2"]])


def test_an_empty_image_is_named_by_the_users_file_when_the_raw_copy_is_relative(tmp_path, monkeypatch):
    image_folder(tmp_path / "src", duplicate=False, empty=True)
    settings = {**IMAGEFOLDER, "source": {"type": "local", "path": str(tmp_path / "src"), "layout": "imagefolder"}}
    run_download("d", settings, tmp_path)
    monkeypatch.chdir(tmp_path)  # the rules run from the workflow directory: the raw copy's path is relative
    message = failing(settings, Path("results/d/raw"), tmp_path)
    assert f"field 'file_name': image file {tmp_path}/src/train/img004.png is empty (0 bytes)" in message
    assert "results/d/raw" not in message


def test_an_image_folder_with_two_metadata_files_is_refused_at_parse_time(tmp_path):
    image_folder(tmp_path / "src", duplicate=False)
    (tmp_path / "src" / "train" / "metadata.csv").write_text("file_name,query,label\nimg000.png,Other?,9\n")
    settings = {**IMAGEFOLDER, "source": {"type": "local", "path": str(tmp_path / "src"), "layout": "imagefolder"}}
    with pytest.raises(ConfigError) as caught:
        parse_check("d", settings)
    assert str(caught.value) == (f"config key 'datasets.d.splits.train': {tmp_path}/src/train holds 2 metadata files "
                                 "['metadata.csv', 'metadata.jsonl']; an image folder's split has one (format jsonl reads "
                                 "metadata.jsonl): merge them into one and remove the others")


# --- every failing check listed ------------------------------------------------------------------------------------
def test_validation_and_test_overlap_are_both_in_the_stopping_message(tmp_path):
    source = tmp_path / "src"
    write_jsonl(source / "train.jsonl", [{"q": f"question {i}?", "a": "1"} for i in range(10)])
    write_jsonl(source / "validation.jsonl", [{"q": "question 1?", "a": "1"}])
    write_jsonl(source / "test.jsonl", [{"q": "question 2?", "a": "1"}])
    settings = {"source": {"type": "local", "path": str(source)}, "fields": {"question": "q", "answers": "a"},
                "metric": "exact_match"}
    message = failing(settings, run_download("d", settings, tmp_path), tmp_path)
    assert message.startswith(f"2 problems, all listed in {tmp_path}/out/report.failed.json: (1) {source}/validation.jsonl: ")
    assert f"(2) {source}/test.jsonl: 1 of 1 rows of split 'test' (100.0%) repeat a row of split 'train'" in message


def test_a_file_level_stop_still_reports_every_failing_split(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_bytes(b"good line\nbad \xff line\n")
    (corpus / "test.txt").write_bytes(b"bad \xfe too\n")
    settings = {"task": "masked_lm", "format": "text", "source": {"type": "local", "path": str(corpus)},
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy"}
    message = failing(settings, run_download("c", settings, tmp_path), tmp_path, name="c")
    failed = json.loads((tmp_path / "out" / "report.failed.json").read_text())["failed"]
    assert [problem.split(":")[0] for problem in failed] == [f"{corpus}/train.txt line 2", f"{corpus}/test.txt line 1"]
    assert message.startswith("2 problems")


# --- a list written as JSON text in a CSV cell ------------------------------------------------------------------
def csv_answers(tmp_path, cell: str):
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.csv").write_text("q,a,\n".replace(",\n", "\n") + "".join(f'question {i}?,"[""{i}""]"\n' for i in range(9))
                                      + f"odd one?,{cell}\n")
    (source / "test.csv").write_text('q,a\nx?,"[""64""]"\n')
    settings = {"source": {"type": "local", "path": str(source)}, "format": "csv", "splits": {"train": "train", "test": "test"},
                "fields": {"question": "q", "answers": "a"}, "metric": "exact_match",
                "derived": {"kind": {"transform": "answer_kind", "field": "answer"}}}
    return settings, run_download("d", settings, tmp_path)


def test_a_csv_answer_column_holding_json_lists_is_read_as_the_lists(tmp_path):
    settings, raw = csv_answers(tmp_path, '"[""7"", ""seven""]"')
    out, _ = run_normalise("d", settings, raw, tmp_path)
    data = load_from_disk(str(out))
    assert data["test"]["answers"] == [["64"]] and data["train"]["answers"][-1] == ["7", "seven"]
    assert data["test"]["kind"] == ["number"]


def test_a_csv_answer_cell_with_broken_json_is_rejected_naming_the_column(tmp_path):
    settings, raw = csv_answers(tmp_path, '"[""7"" ""seven""]"')
    assert failing(settings, raw, tmp_path).endswith(
        f"for example {tmp_path}/src/train.csv line 11: field 'a': holds '[\"7\" \"seven\"]', a list written as text that "
        "is not valid JSON (Expecting ',' delimiter); write the list as JSON, e.g. [\"a\", \"b\"], or one value without brackets; fix "
        "the rows or raise datasets.d.max_rejected_fraction")


def test_a_csv_label_column_holding_json_lists_is_rejected_naming_the_column(tmp_path):
    settings, raw = classification(tmp_path, ["pos", "neg"] * 5 + ['"[""pos""]"'], ["neg", "pos"])
    assert failing(settings, raw, tmp_path).endswith(
        f"for example {tmp_path}/src/train.csv line 12: field 'label': label '[\"pos\"]' is a list written as text (JSON in "
        "a CSV column?); column 'label' must hold one class name or integer id per row; fix the rows or raise "
        "datasets.d.max_rejected_fraction")
