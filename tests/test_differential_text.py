"""Differential tests of the text readers (issue 43, "the method"): odd-but-valid inputs, each read by the
workflow and by the reference library for its kind of file, must give the same rows, or be refused by both with
the same line named.

The references: Python's ``csv`` dialects through ``pandas.read_csv`` (CSV: pandas' defaults; TSV: ``sep="\\t"``,
``quoting=csv.QUOTE_NONE``, as GLUE's loaders read SST-2), ``json.loads`` per ``\\n``-separated line (JSON
Lines), ``str.split("\\n")`` (a text corpus: one example per line), Python's ``gzip``, ``bz2`` and the
``zstandard`` library for compression (every member, stream or frame), and ``codecs`` for encodings.

The workflow's side is what normalise reads: ``raw_records.read_placed`` (records, with the line each starts on;
``Unparseable`` or WorkflowError is a refusal) and ``text_lines.iter_lines`` (a corpus's lines as normalise writes
them); :func:`test_the_agreeing_inputs_normalise_to_the_reference_rows` runs download and normalise over them, grouped
by format and encoding, and compares the normalised rows. docs/data-formats.md's table ("Checked against reference
readers") is checked against the counts here.
"""
from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import io
import json
import random
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import zstandard
from datasets import load_from_disk

from data_helpers import ROOT, run_download, run_normalise
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data import file_formats, raw_records, text_lines


@dataclass(frozen=True)
class Refused:
    """A refusal, with the (1-based) line it names: for a cut-short stream, the lines read whole before it."""

    line: int


@dataclass
class Case:
    reader: str  # the table's row: csv, tsv, jsonl, text, compression, encoding
    name: str
    file: str  # its file name: the suffix gives the format and the compression
    data: bytes
    fmt: str
    encoding: str | None = None
    expected: list | Refused = field(default_factory=list)  # the reference's reading, filled by reference()
    # Where the reference alters the data silently (invents column names) or reads what breaks the format's rule (two
    # JSON values on one line) and the workflow refuses it on purpose: the workflow's refusal, naming this line
    # ("refused by the workflow alone").
    alone: Refused | None = None
    # A JSON Lines file whose lines end in a bare \r is no JSON Lines file: its reference is datasets' json reader,
    # pyarrow.json (a stream of JSON values), not json.loads per \n-separated line.
    pyarrow: bool = False


# --- the generator -----------------------------------------------------------------------------------------------
ODD_VALUES = ["plain", "with, a comma", 'with "double" quotes', "two\nlines", "a\ttab", " padded ", "café ☕ naïve",
              "'single'", "back\\slash", "trailing quote\"", "crlf\r\ninside", "#hash", "ünïcödé ∑"]


def csv_cases(rng: random.Random) -> list[Case]:
    cases = []
    for number in range(14):
        rows = [[rng.choice(ODD_VALUES), rng.choice(ODD_VALUES)] for _ in range(rng.randint(1, 6))]
        buffer = io.StringIO()
        terminator = "\r\n" if number % 2 else "\n"
        quoting = csv.QUOTE_ALL if number % 3 == 0 else csv.QUOTE_MINIMAL
        csv.writer(buffer, lineterminator=terminator, quoting=quoting).writerows([["q", "a"], *rows])
        text = buffer.getvalue()
        if number % 4 == 1:
            text = text.removesuffix(terminator)  # no final line break
        if number % 5 == 2:
            text = text.replace(terminator, terminator + terminator, 1)  # a blank line after the header
        data = text.encode()
        if number % 4 == 3:
            data = codecs.BOM_UTF8 + data  # Excel's "CSV UTF-8"
        cases.append(Case("csv", f"csv-{number:02d}", f"c{number:02d}.csv", data, "csv"))
    cases.append(Case("csv", "csv-extra-field", "extra.csv", b"q,a\nx,1\ny,2,3\nz,4\n", "csv"))
    cases.append(Case("csv", "csv-unterminated-quote", "quote.csv", b'q,a\nx,1\n"open,2\nz,4\n', "csv"))
    return cases


TSV_VALUES = ["plain", 'a lone " quote', '"quoted at both ends"', '"starts with a quote', "it 's , commas , too",
              "back\\slash", "café ☕", " padded ", "'single'", "#hash"]


def tsv_cases(rng: random.Random) -> list[Case]:
    cases = []
    for number in range(10):
        rows = [[rng.choice(TSV_VALUES), str(rng.randint(0, 1))] for _ in range(rng.randint(1, 6))]
        terminator = "\r\n" if number % 3 == 1 else "\n"
        text = terminator.join("\t".join(row) for row in [["sentence", "label"], *rows]) + terminator
        data = (codecs.BOM_UTF8 if number % 4 == 2 else b"") + text.encode()
        cases.append(Case("tsv", f"tsv-{number:02d}", f"t{number:02d}.tsv", data, "tsv"))
    cases.append(Case("tsv", "tsv-embedded-tab", "tab.tsv", b"sentence\tlabel\nfine\t1\na\ttab inside\t0\nok\t1\n", "tsv"))
    cases.append(Case("tsv", "tsv-embedded-tab-late", "tab2.tsv", b"sentence\tlabel\n" + b"ok\t1\n" * 5 + b"x\ty\tz\n", "tsv"))
    # A header line of tabs and spaces: pandas names the columns ' ' and ' .1'; refused naming line 1
    cases.append(Case("tsv", "tsv-blank-header", "blank-header.tsv", b" \t \nhello\t1\nbye\t0\n", "tsv", alone=Refused(1)))
    return cases


JSON_VALUES = ["plain", "with \"quotes\"", "line\u2028separator", "next\u0085line", "tab\there", "emoji 😀", "nul\\u0000-free",
               "</script>", "  spaced  ", "back\\slash", "ünïcödé"]


def jsonl_cases(rng: random.Random) -> list[Case]:
    cases = []
    for number in range(10):
        rows = [{"q": rng.choice(JSON_VALUES), "a": rng.choice(JSON_VALUES)} for _ in range(rng.randint(1, 6))]
        lines = [json.dumps(row, ensure_ascii=number % 2 == 0) for row in rows]
        if number % 3 == 1:
            lines = [line.replace(", ", ",\r ") for line in lines]  # a bare CR as JSON whitespace inside a line
        terminator = "\r\n" if number % 4 == 3 else "\n"
        text = terminator.join(lines) + ("" if number % 5 == 4 else terminator)
        if number % 5 == 2:
            text = text.replace(terminator, terminator + terminator, 1)  # a blank line
        cases.append(Case("jsonl", f"jsonl-{number:02d}", f"j{number:02d}.jsonl", text.encode(), "jsonl"))
    cases.append(Case("jsonl", "jsonl-bad-line", "bad.jsonl", b'{"q": "x", "a": "1"}\n{"q": "cut\n{"q": "z", "a": "2"}\n', "jsonl"))
    # Old Mac line ends (a bare \r): read as pyarrow reads them
    cases.append(Case("jsonl", "jsonl-cr-line-ends", "cr.jsonl", b'{"q": "x", "a": "1"}\r{"q": "y",\r "a": "2"}\r', "jsonl",
                      pyarrow=True))
    # Two records on one CR-ended line: pyarrow reads both; the workflow keeps to one JSON value per line, as on
    # \n-ended lines, and refuses the line
    cases.append(Case("jsonl", "jsonl-cr-two-on-a-line", "cr-two.jsonl",
                      b'{"q": "x", "a": "1"} {"q": "y", "a": "2"}\r{"q": "z", "a": "3"}\r', "jsonl",
                      pyarrow=True, alone=Refused(1)))
    # Two records on one \n-ended line break JSON Lines: json.loads refuses the line, and so does the workflow
    cases.append(Case("jsonl", "jsonl-two-on-a-lf-line", "lf-two.jsonl",
                      b'{"q": "x", "a": "1"}\n{"q": "y", "a": "2"} {"q": "z", "a": "3"}\n', "jsonl"))
    return cases


TEXT_LINES = ["a line", "  leading spaces", "trailing spaces  ", "vertical\x0btab", "line\u2028separator",
              "next\u0085line", "form\x0cfeed", "café ☕", "", "   ", "tab\tinside"]


def text_cases(rng: random.Random) -> list[Case]:
    cases = []
    for number in range(8):
        lines = [rng.choice(TEXT_LINES) for _ in range(rng.randint(2, 8))] + ["a last line"]
        terminator = "\r\n" if number % 2 else "\n"
        text = terminator.join(lines) + ("" if number % 3 == 0 else terminator)
        data = (codecs.BOM_UTF8 if number % 4 == 1 else b"") + text.encode()
        cases.append(Case("text", f"text-{number:02d}", f"x{number:02d}.txt", data, "text"))
    cases.append(Case("text", "text-invalid-utf8", "bad.txt", b"fine\nbad \xff byte\nfine\n", "text"))
    return cases


def zstd_frames(*parts: bytes) -> bytes:
    return b"".join(zstandard.ZstdCompressor().compress(part) for part in parts)


COMPRESSORS = {".gz": lambda *parts: b"".join(gzip.compress(part) for part in parts),
               ".bz2": lambda *parts: b"".join(bz2.compress(part, 1) for part in parts),
               ".zst": zstd_frames}


def compression_cases(rng: random.Random) -> list[Case]:
    noise = random.Random(7)  # incompressible text: a cut falls well inside the data, several blocks deep
    jsonl = [json.dumps({"q": f"{noise.getrandbits(96):x}?", "a": str(i)}).encode() + b"\n" for i in range(12000)]
    corpus = [f"{noise.getrandbits(96):x} line {i}\n".encode() for i in range(12000)]

    def joined(lines: list[bytes], *bounds: int) -> list[bytes]:
        """The lines cut into parts at these line numbers (each part a member / stream / frame of its own)."""
        edges = [0, *bounds, len(lines)]
        return [b"".join(lines[start:end]) for start, end in zip(edges, edges[1:])]

    cases = []
    for suffix, compress in COMPRESSORS.items():
        kind = suffix[1:]
        cases.append(Case("compression", f"{kind}-one", f"one-{kind}.jsonl{suffix}", compress(*joined(jsonl[:60])), "jsonl"))
        cases.append(Case("compression", f"{kind}-several", f"many-{kind}.jsonl{suffix}",  # members / streams / frames
                          compress(*joined(jsonl[:90], 20, 55)), "jsonl"))
        cases.append(Case("compression", f"{kind}-split-line", f"split-{kind}.jsonl{suffix}",  # a line across two parts
                          compress(b"".join(jsonl[:10])[:123], b"".join(jsonl[:10])[123:]), "jsonl"))
        cases.append(Case("compression", f"{kind}-text-several", f"many-{kind}.txt{suffix}",
                          compress(*joined(corpus[:70], 30)), "text"))
        cases.append(Case("compression", f"{kind}-empty-member", f"empty-{kind}.txt{suffix}",
                          compress(b"", b"".join(corpus[:40]), b""), "text"))
        whole = compress(*joined(jsonl, 5000))
        cases.append(Case("compression", f"{kind}-cut", f"cut-{kind}.jsonl{suffix}", whole[: len(whole) * 3 // 4], "jsonl"))
        whole = compress(*joined(corpus, 7000))
        cases.append(Case("compression", f"{kind}-text-cut", f"cut-{kind}.txt{suffix}", whole[: len(whole) * 2 // 3], "text"))
    return cases


def encoding_cases(rng: random.Random) -> list[Case]:
    rows = [{"q": "¿Qué valor tiene la barra señalada?", "a": "7"}, {"q": "Prix: 12 € – “cher”", "a": "oui"},
            {"q": "Straße", "a": "ß"}]
    jsonl = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    csv_text = "q,a\n" + "".join(f"\"{row['q']}\",{row['a']}\n" for row in rows)
    corpus = "Qué tal\nl'été\nPrix 12 €\n"
    cases = []
    for codec, bom in [("utf-16", b""), ("utf-16-le", b""), ("utf-16-be", b""), ("utf-16", None), ("cp1252", b""),
                       ("utf-8", codecs.BOM_UTF8)]:
        for fmt, text, suffix in [("jsonl", jsonl, ".jsonl"), ("csv", csv_text, ".csv"), ("text", corpus, ".txt")]:
            if codec != "cp1252" and fmt == "csv" and codec != "utf-16":
                continue
            data = (bom or b"") + text.encode(codec)  # "utf-16" writes its own byte-order mark
            declared = codec if bom is not None else "utf-16-le"  # None: a UTF-16 file with its mark read as utf-16-le
            name = f"{codec}{'-bom' if bom else ''}{'-mark-as-le' if bom is None else ''}"
            cases.append(Case("encoding", f"{name}-{fmt}", f"{name}{suffix}", data, fmt, declared))
    latin = "Ça coûte 12 francs\nnaïve\n"
    cases.append(Case("encoding", "latin-1-text", "latin.txt", latin.encode("latin-1"), "text", "latin-1"))
    cases.append(Case("encoding", "cp1252-undefined-byte-jsonl", "undefined.jsonl",
                      jsonl.encode("cp1252") + b'{"q": "bad \x81 byte", "a": "1"}\n', "jsonl", "cp1252"))
    cases.append(Case("encoding", "cp1252-undefined-byte-text", "undefined.txt", b"fine\nbad \x8d byte\n", "text", "cp1252"))
    cases.append(Case("encoding", "utf-16-odd-byte", "odd.txt", "a line\n".encode("utf-16-le") + b"x", "text", "utf-16-le"))
    return cases


def all_cases() -> list[Case]:
    rng = random.Random(43)
    cases = [*csv_cases(rng), *tsv_cases(rng), *jsonl_cases(rng), *text_cases(rng), *compression_cases(rng),
             *encoding_cases(rng)]
    for case in cases:
        case.expected = reference(case)
    return cases


# --- the references --------------------------------------------------------------------------------------------
def decompressed(case: Case) -> bytes | Refused:
    """The file's bytes as Python's gzip / bz2 and zstandard decompress them (all members, streams, frames);
    Refused(lines decoded whole) when the stream breaks."""
    data = case.data
    kind = Path(case.file).suffix
    if kind not in COMPRESSORS:
        return data
    if kind == ".zst":
        out, rest = b"", data
        while rest:
            decoder = zstandard.ZstdDecompressor().decompressobj()
            out += decoder.decompress(rest)
            if not decoder.eof:
                return Refused(out.count(b"\n"))
            rest = decoder.unused_data
        return out
    try:
        return gzip.decompress(data) if kind == ".gz" else bz2.decompress(data)
    except (EOFError, OSError, ValueError, zlib.error):  # bz2.decompress: ValueError for a cut stream
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if kind == ".gz" else bz2.BZ2Decompressor()
        out, rest = b"", data
        while rest:
            try:
                out += decoder.decompress(rest)
            except (EOFError, OSError, zlib.error):
                break
            rest = decoder.unused_data if decoder.eof else b""
            if decoder.eof:
                decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if kind == ".gz" else bz2.BZ2Decompressor()
        return Refused(out.count(b"\n"))


def decoded(data: bytes, encoding: str | None) -> str | Refused:
    """``codecs``' reading: UTF-8 with its byte-order mark skipped (utf-8-sig), or the declared codec, strict;
    Refused at the line holding the first byte it does not decode."""
    codec = "utf-8-sig" if encoding is None or codecs.lookup(encoding).name == "utf-8" else encoding
    try:
        return codecs.decode(data, codec).removeprefix("\ufeff")  # a mark is no data (pandas drops it too)
    except UnicodeDecodeError as error:
        good = codecs.decode(data[: error.start], codec, errors="ignore")
        return Refused(good.count("\n") + 1)


def reference(case: Case) -> list | Refused:
    data = decompressed(case)
    if isinstance(data, Refused):
        return data
    text = decoded(data, case.encoding)
    if isinstance(text, Refused):
        return text
    if case.fmt == "text":
        lines = [line.removesuffix("\r") for line in text.split("\n")]
        return [line for line in lines if line.strip()]
    if case.fmt == "jsonl" and case.pyarrow:
        import pyarrow as pa
        import pyarrow.json

        try:
            return pyarrow.json.read_json(io.BytesIO(text.encode())).to_pylist()
        except pa.ArrowInvalid:
            return Refused(0)  # pyarrow names no line: only reading cases use this reference
    if case.fmt == "jsonl":
        rows = []
        for number, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    return Refused(number)
        return rows
    options = {"sep": "\t", "quoting": csv.QUOTE_NONE} if case.fmt == "tsv" else {}
    try:
        frame = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, **options)
    except pd.errors.ParserError as error:
        found = re.search(r"in line (\d+)|starting at row (\d+)", str(error))
        return Refused(int(found[1]) if found[1] else int(found[2]) + 1)
    return frame.to_dict("records")


# --- the workflow's reading --------------------------------------------------------------------------------------
LINE = re.compile(r" line (\d+)")


def workflow(case: Case, directory: Path) -> list | Refused:
    path = directory / case.file
    path.write_bytes(case.data)
    try:
        if case.fmt == "text":
            return [text for _, _, text in text_lines.iter_lines([path], encoding=case.encoding)]
        rows = []
        for place, record in raw_records.read_placed(path, case.fmt, "stop", case.encoding):
            if isinstance(record, raw_records.Unparseable):
                return Refused(place.line)
            rows.append(record)
        return rows
    except WorkflowError as error:
        found = LINE.search(str(error))
        assert found, f"a refusal naming no line: {error}"
        return Refused(int(found[1]))


CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_workflow_reads_each_input_as_its_reference_reader(case, tmp_path):
    if case.alone is not None:  # the reference reads it (altered), the workflow refuses it naming the line
        assert not isinstance(case.expected, Refused) and case.expected
        assert workflow(case, tmp_path) == case.alone
        return
    assert workflow(case, tmp_path) == case.expected


def agreeing_groups() -> dict[tuple[str, str | None], list[Case]]:
    """The inputs that are read (not refused), by (format, encoding): each group is one dataset's train split."""
    groups: dict[tuple[str, str | None], list[Case]] = {}
    for case in CASES:
        if not isinstance(case.expected, Refused) and case.expected and case.alone is None:
            groups.setdefault((case.fmt, case.encoding), []).append(case)
    return groups


def test_the_agreeing_inputs_normalise_to_the_reference_rows(tmp_path):
    """download + normalise over every read input, one run per (format, encoding): the normalised rows are the
    reference's, each text stripped as normalise strips every field (data/rows.text)."""
    for number, ((fmt, encoding), cases) in enumerate(agreeing_groups().items()):
        work = tmp_path / f"g{number}"
        source = work / "src"
        (source / "train").mkdir(parents=True)
        files = []
        for index, case in enumerate(cases):
            (source / "train" / f"{index:03d}-{case.file}").write_bytes(case.data)
            files.append(f"train/{index:03d}-{case.file}")
        held_out = {"text": "a held-out line\n", "jsonl": '{"q": "held out?", "a": "h"}\n',
                    "csv": "q,a\nheld out?,h\n", "tsv": "sentence\tlabel\nheld out\t1\n"}[fmt]
        (source / f"test.{file_formats.PLAIN_SUFFIXES[fmt][0][1:]}").write_bytes(held_out.encode(
            file_formats.text_codec(encoding)).removeprefix(codecs.BOM_UTF8))
        settings = {"source": {"type": "local", "path": str(source), "files": {"train": files}}, "format": fmt,
                    "splits": {"train": "train", "test": "test"}, "max_rejected_fraction": 0.0,
                    **({"encoding": encoding} if encoding else {})}
        if fmt == "text":
            settings.update(task="masked_lm", metric="masked_accuracy")
        elif fmt == "tsv":
            settings.update(task="classification", metric="accuracy", fields={"text": "sentence", "label": "label"})
        else:
            settings.update(metric="exact_match", fields={"question": "q", "answers": "a"})
        out, _ = run_normalise("d", settings, run_download("d", settings, work), work)
        train = load_from_disk(str(out))["train"]
        expected = [row for case in cases for row in case.expected]
        if fmt == "text":
            assert train["text"] == expected, (fmt, encoding)
        elif fmt == "tsv":
            assert train["text"] == [row["sentence"].strip() for row in expected], (fmt, encoding)
            assert train["label"] == [row["label"] for row in expected]
        else:
            assert train["question"] == [row["q"].strip() for row in expected], (fmt, encoding)
            assert train["answers"] == [[row["a"].strip()] for row in expected], (fmt, encoding)


def summary() -> dict[str, tuple[int, int, int, int]]:
    """reader -> (inputs, agreeing, refused by both, refused by the workflow alone) for docs/data-formats.md (every
    case agrees or is refused as planted: the test above fails on any that is not)."""
    table: dict[str, tuple[int, int, int, int]] = {}
    for case in CASES:
        inputs, agreeing, refused, alone = table.get(case.reader, (0, 0, 0, 0))
        both = isinstance(case.expected, Refused)
        only = case.alone is not None
        table[case.reader] = (inputs + 1, agreeing + (not both and not only), refused + both, alone + only)
    return table


READERS = {"csv": "CSV (`format: csv`)", "tsv": "TSV (`format: tsv`)", "jsonl": "JSON Lines (`format: jsonl`)",
           "text": "text corpus (`format: text`)", "compression": "gzip, bzip2, zstd", "encoding": "encodings (`encoding:`)"}


def test_the_generator_covers_each_kind_and_the_docs_table_gives_its_counts():
    table = summary()
    assert set(table) == set(READERS) and sum(inputs for inputs, *_ in table.values()) >= 60
    assert all(refused for _, _, refused, _ in table.values()), "each reader has a refusal to agree on"
    page = (ROOT / "docs" / "data-formats.md").read_text()
    for reader, (inputs, agreeing, refused, alone) in table.items():
        row = f"| {READERS[reader]} | {inputs} | {agreeing} | {refused} | {alone} |"
        assert row in page, f"docs/data-formats.md lacks the row {row}"
