"""Differential tests (issue 43, "The method"): generated odd-but-valid inputs read by the workflow and by the
reference readers, which must agree: the same normalised rows, or a refusal by both with the row named.

- PENMAN (``format: penman``): the reference is ``penman.decode`` with every token of the graph consumed (penman's
  own parse stops silently at the first token that does not start a graph, so the reference checks that its
  re-encoding holds as many tokens as the text), and the metadata the generator wrote (penman's metadata reader
  cuts a sentence at its last ``::``, so it cannot be the reference for ``# ::snt``). Each block set is written
  as three files: LF with a header comment and a final newline, CRLF, and without the final newline.
- Classification labels: the reference is ``datasets``: ``Features.from_arrow_schema`` of a Parquet file's schema
  (its ``huggingface`` metadata) and ``ClassLabel.int2str`` for a ClassLabel column, matched by name to a declared
  ``labels:`` list; for a column of numbers with numeric declared labels, the one ``ClassLabel`` reading (by name,
  or ``int2str`` by index) that reads every value, or a refusal where both read every value differently or
  neither does.

:data:`SUMMARY` is docs/data-formats.md's table ("Checked against reference readers"), checked here.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import penman
import pytest
from datasets import load_from_disk

from data_helpers import ROOT, write_jsonl
from workflow_scripts import normalise
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data import raw_records

REFUSED = "refused"


# --- PENMAN --------------------------------------------------------------------------------------------------
@dataclass
class Block:
    """One generated block: its text lines, and the metadata it was written with (None: no record expected)."""

    name: str
    lines: list[str]
    metadata: dict = field(default_factory=dict)


def blocks() -> list[Block]:
    deep = "".join(f"(n{i} / thing :mod " for i in range(4000)) + "(z / zero)" + ")" * 4000
    made = [  # (name, further comment lines, the metadata they hold, graph)
        ("one-line", [], {}, "(s / sleep-01 :ARG0 (g / girl))"),
        ("indented", [], {}, "(w / want-01\n   :ARG0 (b / boy)\n   :ARG1 (g / go-02\n            :ARG0 b))"),
        ("tab-indented", [], {}, "(w / want-01\n\t:ARG0 (b / boy))"),
        ("ldc-metadata", ["# ::date 2012-12-19T12:53:14 ::annotator SDL-AMR-09 ::preferred"],
         {"date": "2012-12-19T12:53:14", "annotator": "SDL-AMR-09", "preferred": ""}, "(r / run-02 :ARG0 (d / dog))"),
        ("save-date-line", ["# ::save-date Sat Jun 30, 2012 ::file bolt_0001.txt"],
         {"save-date": "Sat Jun 30, 2012", "file": "bolt_0001.txt"}, "(e / eat-01 :ARG0 (c / cat))"),
        ("re-entrancy", [], {}, "(w / want-01 :ARG0 (b / boy) :ARG1 (b2 / believe-01 :ARG0 (g / girl) :ARG1 b))"),
        ("inverse-role", [], {}, "(b / boy :ARG0-of (w / want-01 :ARG1 (g / go-02)))"),
        ("quoted-brackets", [], {}, '(s / say-01 :ARG1 (q / quote :value "a (quoted) text)"))'),
        ("quoted-escape", [], {}, '(s / say-01 :ARG1 (q / quote :value "he said \\"hi (there)\\""))'),
        ("named-entity", [], {}, '(p / person :wiki "Barack_Obama" :name (n / name :op1 "Barack" :op2 "Obama"))'),
        ("polarity-quant", [], {}, "(h / have-01 :polarity - :ARG1 (c / cup :quant 3.5))"),
        ("alignments", [], {}, "(w / want-01~e.2 :ARG0 (b / boy~e.1))"),
        ("plain-comment-inside", ["# a note the annotator left"], {}, "(t / tree)"),
    ]
    out = []
    for k, (name, extra, metadata, graph) in enumerate(made):
        snt = f"Sentence {k} ({name})."
        out.append(Block(name, [f"# ::id b{k}", *extra, f"# ::snt {snt}", *graph.split("\n")],
                         {"id": f"b{k}", **metadata, "snt": snt}))
    odd_sentences = [("double-colon-snt", "Call std::sort on it."), ("spaced-double-colon", "Use a :: b here."),
                     ("colon-key-like-snt", "See the ::note marker."), ("unicode-snt", "Qué café 中文 ok?")]
    for name, snt in odd_sentences:
        k = len(out)
        out.append(Block(name, [f"# ::id b{k}", f"# ::snt {snt}", f"(s{k} / say-01 :ARG1 (t / thing-{k}))"],
                         {"id": f"b{k}", "snt": snt}))
    refused = [
        ("early-closed-top", "(s / sleep-01\n   :ARG0 (g / girl))\n   :polarity -"),
        ("trailing-token", "(a / apple) extra"),
        ("two-graphs", "(a / apple)\n(b / banana)"),
        ("unbalanced", "(a / apple :mod (r / red)"),
        ("closing-bracket-too-many", "(a / apple :mod (r / red)))"),
        ("json-line", '{"id": "x", "graph": "(a / b)"}'),
        ("deep-4000", deep),
    ]
    for name, graph in refused:
        k = len(out)
        out.append(Block(name, [f"# ::id b{k}", f"# ::snt Refused {k}.", *graph.split("\n")], {}))
    return out


def tokens(text: str) -> int:
    from penman._lexer import lex

    return sum(1 for token in lex(text.splitlines()) if token.type != "COMMENT")


def reference_graph(block: Block) -> str:
    """penman.decode's graph, re-encoded on one line, or REFUSED where penman cannot read it or leaves tokens."""
    text = "\n".join(line for line in block.lines if not line.lstrip().startswith("#"))
    try:
        graph = penman.decode(text)
        encoded = penman.encode(graph, indent=None)
    except (penman.exceptions.PenmanError, RecursionError):
        return REFUSED
    return encoded if tokens(encoded) == tokens(text) else REFUSED


VARIANTS = {  # name -> (newline, header comment, final newline)
    "lf-header": ("\n", True, True),
    "crlf": ("\r\n", False, True),
    "no-final-newline": ("\n", True, False),
}


def penman_file(path: Path, made: list[Block], variant: str) -> dict[str, tuple[int, int]]:
    """Write the blocks; block name -> (its number as a user counts graphs, its first line)."""
    newline, header, final = VARIANTS[variant]
    lines, places = [], {}
    if header:
        lines += ["# AMR release (generated); number of AMRs: %d" % len(made), ""]
    for number, block in enumerate(made, start=1):
        places[block.name] = (number, len(lines) + 1)
        lines += [*block.lines, ""]
    text = newline.join(lines[:-1]) + (newline if final else "")
    path.write_bytes(text.encode("utf-8"))
    return places


def run_normalise(name: str, settings: dict, raw: Path, tmp: Path) -> tuple[Path, dict]:
    out, report = tmp / name / "normalised", tmp / name / "report.json"
    assert normalise.main(["--name", name, "--dataset", json.dumps(settings), "--raw", str(raw),
                           "--out", str(out), "--report", str(report)]) == 0
    return out, json.loads(report.read_text())


@pytest.fixture(scope="module")
def penman_outcomes(tmp_path_factory) -> list[tuple[str, str, object, object]]:
    """(variant, block, reference, workflow) for every generated block in every file variant; each a row
    ``{id, question, answers, metadata}`` or ``(REFUSED, message)``."""
    made = blocks()
    outcomes = []
    for variant in VARIANTS:
        tmp = tmp_path_factory.mktemp(f"penman-{variant}")
        raw = tmp / "raw"
        raw.mkdir()
        places = penman_file(raw / "train.txt", made, variant)
        (raw / "test.txt").write_text("# ::id t1\n# ::snt A test.\n(t / test-01)\n")
        settings = {"source": {"type": "local", "path": str(raw)}, "format": "penman",
                    "splits": {"train": "train", "test": "test"}, "derived": {},
                    # smatchpp: its reader reads every valid graph here (smatch's refuses an escaped quote in a
                    # string, which the gold check then rejects naming the metric: that reader is not under test)
                    "fields": {"id": "id", "question": "snt", "answers": "graph"}, "metric": "smatchpp",
                    "max_rejected_fraction": 1.0}
        out, report = run_normalise("amr", settings, raw, tmp)
        rows = {row["id"]: row for row in load_from_disk(str(out))["train"].to_list()}
        read = {place.block: (place, record) for place, record in raw_records.read_placed(raw / "train.txt", "penman")}
        assert report["splits"]["train"]["rejected"] == sum(reference_graph(block) == REFUSED for block in made)
        for block in made:
            number, line = places[block.name]
            place, record = read[number]
            assert place.line == line, (variant, block.name)  # the block is named where the user's editor shows it
            graph = reference_graph(block)
            expected = ((REFUSED, f"block {number} (line {line})") if graph == REFUSED else
                        {"id": block.metadata["id"], "question": block.metadata["snt"], "answers": [graph],
                         "metadata": block.metadata})
            if isinstance(record, raw_records.Unparseable):
                got = (REFUSED, re.search(r"block \d+ \(line \d+\)", record.error).group())
                assert record.error.startswith(f"not valid PENMAN: block {number} (line {line})"), record.error
            else:
                row = rows.get(block.metadata.get("id"), {})
                got = {"id": row.get("id"), "question": row.get("question"), "answers": row.get("answers"),
                       "metadata": {key: value for key, value in record.items() if key != "graph"}}
            outcomes.append((variant, block.name, expected, got))
    return outcomes


def test_penman_blocks_read_as_penman_decode_reads_them_whole_or_refused_by_both(penman_outcomes):
    disagreeing = [(variant, name, expected, got) for variant, name, expected, got in penman_outcomes if expected != got]
    assert not disagreeing


# --- classification labels -----------------------------------------------------------------------------------
@dataclass
class LabelCase:
    name: str
    fmt: str  # parquet (a datasets export with a ClassLabel column), saved (a hub dataset as download saves it), csv, jsonl
    values: list  # the raw label column of train (ids for a ClassLabel column)
    class_names: list[str] | None = None  # the ClassLabel names of a Parquet export
    declared: list[str] | None = None


STARS = ["1", "2", "3", "4", "5"]
LABEL_CASES = [
    LabelCase("classlabel-undeclared", "parquet", [0, 1, 1, 0] * 3, ["neg", "pos"]),
    LabelCase("classlabel-declared-same-order", "parquet", [0, 1, 1, 0] * 3, ["neg", "pos"], ["neg", "pos"]),
    LabelCase("classlabel-declared-reversed", "parquet", [0, 1, 1, 0] * 3, ["neg", "pos"], ["pos", "neg"]),
    LabelCase("classlabel-three-shuffled", "parquet", [0, 1, 2] * 4, ["neg", "neu", "pos"], ["pos", "neg", "neu"]),
    LabelCase("classlabel-numeric-names", "parquet", [0, 1, 2, 3, 4] * 3, STARS),
    LabelCase("classlabel-numeric-names-reversed", "parquet", [0, 1, 2, 3, 4] * 3, STARS, STARS[::-1]),
    LabelCase("classlabel-name-not-declared", "parquet", [0, 1, 2] * 4, ["neg", "neu", "pos"], ["neg", "pos"]),
    LabelCase("saved-hub-classlabel-undeclared", "saved", [1, 0, 1] * 4, ["neg", "pos"]),
    LabelCase("saved-hub-classlabel-reversed", "saved", [1, 0, 1] * 4, ["neg", "pos"], ["pos", "neg"]),
    LabelCase("numeric-declared-ids-from-zero", "csv", [0, 1, 2, 3, 4] * 3, None, STARS),
    LabelCase("numeric-declared-names", "csv", [1, 2, 3, 4, 5] * 3, None, STARS),
    LabelCase("numeric-declared-both-ways", "csv", [1, 2, 3, 4] * 3, None, STARS),
    LabelCase("numeric-declared-names-and-ids", "csv", [0, 1, 2, 3, 4, 5] * 2, None, STARS),
    LabelCase("numeric-declared-identity", "csv", [0, 1, 2] * 4, None, ["0", "1", "2"]),
    LabelCase("ids-declared-names", "jsonl", [0, 1, 2] * 4, None, ["neg", "neu", "pos"]),
    LabelCase("names-declared", "jsonl", ["pos", "neg", "neu"] * 4, None, ["neg", "neu", "pos"]),
    LabelCase("names-undeclared", "csv", ["b", "a", "c"] * 4),
]


def write_label_split(path: Path, case: LabelCase, values: list, prefix: str) -> None:
    texts = [f"{prefix} sentence {i}" for i in range(len(values))]
    if case.fmt == "saved":  # both splits at once: DatasetDict.save_to_disk, download's layout of a hub source
        from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

        features = Features({"text": Value("string"), "label": ClassLabel(names=case.class_names)})
        DatasetDict({split: Dataset.from_dict({"text": [f"{split} sentence {i}" for i in range(len(rows))], "label": rows},
                                              features=features)
                     for split, rows in (("train", values), ("test", values[:2]))}).save_to_disk(str(path.parent))
    elif case.fmt == "parquet":
        from datasets import ClassLabel, Dataset, Features, Value

        features = Features({"text": Value("string"), "label": ClassLabel(names=case.class_names)})
        Dataset.from_dict({"text": texts, "label": values}, features=features).to_parquet(str(path))
    elif case.fmt == "csv":
        path.write_text("text,label\n" + "".join(f"{text},{value}\n" for text, value in zip(texts, values)))
    else:
        write_jsonl(path, [{"text": text, "label": value} for text, value in zip(texts, values)])


def reference_labels(raw: Path, case: LabelCase) -> tuple[list[str], list] | tuple[str, str]:
    """(the label set, each train row's class name or REFUSED) as datasets reads the column, or (REFUSED, why) for
    a column it reads two ways."""
    import pyarrow.parquet as pq
    from datasets import ClassLabel, Features

    if case.fmt in ("parquet", "saved"):
        feature = (Features.from_arrow_schema(pq.read_schema(raw / "train.parquet"))["label"] if case.fmt == "parquet"
                   else load_from_disk(str(raw))["train"].features["label"])
        names = [feature.int2str(int(value)) for value in case.values]
        label_set = case.declared or list(feature.names)
        return label_set, [name if name in label_set else REFUSED for name in names]
    values = [str(value) for value in case.values]
    if case.declared is None:
        return sorted(set(values)), values
    feature = ClassLabel(names=case.declared)
    by_name = [value if value in case.declared else None for value in values]
    by_index = [feature.int2str(int(value)) if re.fullmatch(r"\d+", value) and int(value) < feature.num_classes
                else None for value in values]
    readings = [reading for reading in (by_name, by_index) if None not in reading]
    if not readings or (len(readings) == 2 and by_name != by_index):
        return REFUSED, "the column reads both ways" if readings else "the column reads neither way"
    return list(case.declared), readings[0]


def workflow_labels(raw: Path, case: LabelCase, tmp: Path) -> tuple[list[str], list] | tuple[str, str]:
    source = ({"type": "hub", "id": "some/dataset", "revision": "0" * 40} if case.fmt == "saved" else
              {"type": "local", "path": str(raw)})
    settings = {"task": "classification", "format": "parquet" if case.fmt == "saved" else case.fmt, "source": source,
                "splits": {"train": "train", "test": "test"}, "fields": {"text": "text", "label": "label"},
                "metric": "accuracy", "max_rejected_fraction": 1.0,
                **({"labels": case.declared} if case.declared else {})}
    try:
        out, report = run_normalise("labels", settings, raw, tmp)
    except WorkflowError as error:
        assert f"datasets.labels.labels: the declared labels {case.declared}" in str(error)  # names the key
        return REFUSED, str(error)
    rows = {row["text"]: row["label"] for row in load_from_disk(str(out))["train"].to_list()}
    named = {example["row"] for example in report["reasons"].get("unknown_label", {}).get("examples", [])}
    labels = [rows.get(f"train sentence {i}", REFUSED) for i in range(len(case.values))]
    assert {i for i, label in enumerate(labels) if label == REFUSED} >= named  # every refused row is one named
    return json.loads((out / "task_meta.json").read_text())["labels"], labels


@pytest.fixture(scope="module")
def label_outcomes(tmp_path_factory) -> list[tuple[str, object, object]]:
    outcomes = []
    for case in LABEL_CASES:
        tmp = tmp_path_factory.mktemp(f"labels-{case.name}")
        raw = tmp / "raw"
        raw.mkdir()
        if case.fmt == "saved":
            write_label_split(raw / "train", case, case.values, "train")
        else:
            write_label_split(raw / f"train.{case.fmt}", case, case.values, "train")
            write_label_split(raw / f"test.{case.fmt}", case, case.values[:2], "test")
        reference = reference_labels(raw, case)
        got = workflow_labels(raw, case, tmp)
        if reference[0] == REFUSED and got[0] == REFUSED:
            got = reference  # refused by both (the workflow's message checked to name the key above)
        outcomes.append((case.name, reference, got))
    return outcomes


def test_label_columns_read_as_datasets_classlabel_reads_them_or_refused_by_both(label_outcomes):
    disagreeing = [(name, reference, got) for name, reference, got in label_outcomes if reference != got]
    assert not disagreeing


# --- the docs' table -------------------------------------------------------------------------------------------
def refusing(outcome: object) -> bool:
    """Whether an outcome is a refusal: of the whole input, or of one of its rows."""
    if isinstance(outcome, tuple):
        return outcome[0] == REFUSED or (len(outcome) == 2 and isinstance(outcome[1], list) and REFUSED in outcome[1])
    return False


def summary(outcomes: list[tuple]) -> tuple[int, int, int]:
    """(inputs, read alike, refused by both: the input or a row of it) of a reader's outcomes."""
    alike = [reference for *_, reference, got in outcomes if reference == got]
    refused = sum(1 for reference in alike if refusing(reference))
    return len(outcomes), len(alike) - refused, refused  # the text readers' table counts the same way


def test_the_data_formats_page_carries_these_counts(penman_outcomes, label_outcomes):
    page = (ROOT / "docs" / "data-formats.md").read_text()
    assert "## Checked against reference readers" in page
    for reader, outcomes in (("PENMAN (`format: penman`)", penman_outcomes),
                             ("classification labels", label_outcomes)):
        inputs, agreeing, refused = summary(outcomes)
        assert f"| {reader} | {inputs} | {agreeing} | {refused} |" in page, (reader, inputs, agreeing, refused)
