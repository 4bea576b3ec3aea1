"""Text formats, encodings and compression (issue 43): each case plants what a user's file really holds and checks
that it is read as the reference reader reads it, or refused naming the file, the line and the fix."""
from __future__ import annotations

import bz2
import gzip
import json
from pathlib import Path

import pytest
import zstandard
from datasets import load_from_disk

from data_helpers import run_download, run_normalise
from workflow_scripts import download, normalise
from workflow_scripts.checks.sections import check_dataset
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.data.split_names import check_local_splits

QA = {"fields": {"question": "q", "answers": "a"}, "metric": "exact_match", "splits": {"train": "train", "test": "test"}}
CORPUS = {"task": "masked_lm", "format": "text", "metric": "masked_accuracy", "splits": {"train": "train", "test": "test"}}


def source(tmp: Path, files: dict[str, bytes]) -> Path:
    directory = tmp / "src"
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


def settings_for(directory: Path, base: dict = QA, **changes) -> dict:
    return {**base, "source": {"type": "local", "path": str(directory)}, **changes}


def failing_normalise(settings: dict, tmp: Path, name: str = "d") -> str:
    raw = run_download(name, settings, tmp)
    with pytest.raises(WorkflowError) as caught:
        normalise.main(["--name", name, "--dataset", json.dumps(settings), "--raw", str(raw),
                        "--out", str(tmp / "out" / "normalised"), "--report", str(tmp / "out" / "report.json")])
    assert not (tmp / "out" / "normalised").exists()
    return str(caught.value)


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


ROWS = [{"q": f"question {i}?", "a": str(i)} for i in range(20)]
TEST = [{"q": f"held-out question {i}?", "a": str(i)} for i in range(20)]
SPANISH = [{"q": "¿Qué valor tiene la barra señalada?", "a": "7"}]


# --- 1. a declared encoding that the bytes contradict ----------------------------------------------------------
@pytest.mark.parametrize("declared", ["latin-1", "cp1252", "iso8859-15"])
def test_a_utf8_jsonl_file_declared_single_byte_stops_with_both_readings_of_its_first_such_line(tmp_path, declared):
    directory = source(tmp_path, {"train.jsonl": jsonl(ROWS[:3] + SPANISH + ROWS[3:]), "test.jsonl": jsonl(TEST[:1])})
    message = failing_normalise(settings_for(directory, encoding=declared), tmp_path)
    as_declared = '{"q": "¿Qué valor tiene la barra señalada?", "a": "7"}'.encode().decode(declared)
    assert message == (f"{directory}/train.jsonl line 4: the dataset declares encoding: {declared}, but the file is valid "
                       f"UTF-8 with multi-byte characters: read as {declared} the line is {as_declared[:60]!r}, read as "
                       f"UTF-8 it is {json.dumps(SPANISH[0], ensure_ascii=False)[:60]!r}; remove datasets.d.encoding "
                       "(UTF-8 is the default) if the UTF-8 reading is right")


def test_a_utf8_corpus_declared_latin1_stops_too_and_a_real_latin1_corpus_is_read(tmp_path):
    text = "a plain line\nthe café on the corner\n"
    directory = source(tmp_path, {"train.txt": text.encode(), "test.txt": b"held out\n"})
    message = failing_normalise(settings_for(directory, CORPUS, encoding="latin-1"), tmp_path, "c")
    assert message.startswith(f"{directory}/train.txt line 2: the dataset declares encoding: latin-1, but the file is "
                              "valid UTF-8 with multi-byte characters: read as latin-1 the line is 'the cafÃ© on the corner'")
    (directory / "train.txt").write_bytes(text.encode("latin-1"))  # what latin-1 really is: read as declared
    settings = settings_for(directory, CORPUS, encoding="latin-1")
    out, _ = run_normalise("c", settings, run_download("c", settings, tmp_path / "real"), tmp_path / "real")
    assert load_from_disk(str(out))["train"]["text"] == ["a plain line", "the café on the corner"]


@pytest.mark.parametrize("fmt", ["parquet"])
def test_encoding_on_a_binary_format_or_a_hub_source_is_refused_at_config_time_naming_the_key(fmt):
    settings = {**QA, "format": fmt, "encoding": "latin-1", "source": {"type": "local", "path": "data"}}
    with pytest.raises(ConfigError) as caught:
        check_dataset(DatasetSettings.parse(settings, "d"), "config.yaml")
    assert str(caught.value) == ("config.yaml: config key 'datasets.d.encoding': format parquet is binary (its text is "
                                 "UTF-8 inside the file, as Parquet stores it), so encoding: latin-1 would do nothing; "
                                 "remove datasets.d.encoding")
    hub = {**QA, "encoding": "cp1252", "source": {"type": "hub", "id": "org/set", "revision": "0" * 40}}
    with pytest.raises(ConfigError) as caught:
        check_dataset(DatasetSettings.parse(hub, "d"), "config.yaml")
    assert str(caught.value) == ("config.yaml: config key 'datasets.d.encoding': a hub dataset is read by "
                                 "datasets.load_dataset, which decodes its files itself, so encoding: cp1252 would do "
                                 "nothing; remove datasets.d.encoding")


# --- 2. unclear stops -------------------------------------------------------------------------------------------
def test_format_json_with_explicit_utf8_reads_a_bom_as_the_default_does(tmp_path):
    data = b"\xef\xbb\xbf" + json.dumps(ROWS, ensure_ascii=False).encode()
    directory = source(tmp_path, {"train.json": data, "test.json": json.dumps(TEST[:1]).encode()})
    for encoding in (None, "utf-8", "UTF8"):
        settings = settings_for(directory, format="json", **({"encoding": encoding} if encoding else {}))
        out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path / str(encoding)), tmp_path / str(encoding))
        assert load_from_disk(str(out))["train"]["question"][0] == "question 0?"


def test_cp1252_with_an_undefined_byte_names_its_line_and_the_declared_encoding(tmp_path):
    lines = [json.dumps({"q": f"café {i}?", "a": "1"}, ensure_ascii=False).encode("cp1252") for i in range(20)]
    lines[12] = b'{"q": "bad \x81 byte?", "a": "1"}'  # 0x81: undefined in cp1252
    directory = source(tmp_path, {"train.jsonl": b"\n".join(lines) + b"\n", "test.jsonl": jsonl(TEST[:1])})
    message = failing_normalise(settings_for(directory, encoding="cp1252"), tmp_path)
    assert message == (f"{directory}/train.jsonl line 13: not cp1252 text (byte 0x81, which cp1252 does not define, at "
                       "byte 11 of the line), the dataset's encoding; fix that line or set the dataset's encoding to "
                       "the file's, or set the dataset's on_invalid_text: reject_row to reject and count such rows")
    settings = settings_for(directory, encoding="cp1252", on_invalid_text="reject_row", max_rejected_fraction=0.1)
    out, report = run_normalise("d", settings, run_download("d", settings, tmp_path / "r"), tmp_path / "r")
    assert load_from_disk(str(out))["train"]["question"][0] == "café 0?"
    example = json.loads(report.read_text())["reasons"]["unparseable_record"]["examples"][0]
    assert example["line"] == 13 and "not cp1252 text" in example["detail"]


def test_cp1252_corpus_with_an_undefined_byte_names_its_line(tmp_path):
    lines = [f"café line {i}".encode("cp1252") for i in range(3000)]
    lines[2500] = b"bad \x81 byte"
    directory = source(tmp_path, {"train.txt": b"\n".join(lines) + b"\n", "test.txt": b"held out\n"})
    message = failing_normalise(settings_for(directory, CORPUS, encoding="cp1252"), tmp_path, "c")
    assert message.startswith(f"{directory}/train.txt line 2501: not cp1252 text (byte 0x81, which cp1252 does not "
                              "define, at byte 4 of the line)")


def cut(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def many_rows(n: int = 300) -> bytes:
    import random

    rng = random.Random(0)  # incompressible text, so the cut falls well inside the rows
    return jsonl([{"q": f"{rng.getrandbits(128):x}?", "a": str(i)} for i in range(n)])


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".zst"])
def test_a_cut_short_jsonl_stream_is_named_by_the_whole_lines_read(tmp_path, suffix):
    data = many_rows(6000)  # bzip2 at level 1 holds 100 kB blocks: several, so the cut leaves whole ones
    compress = {".gz": gzip.compress, ".bz2": lambda data: bz2.compress(data, 1), ".zst": zst}[suffix]
    directory = source(tmp_path, {f"train.jsonl{suffix}": cut(compress(data)), "test.jsonl": jsonl(TEST[:1])})
    settings = settings_for(directory)
    with pytest.raises(WorkflowError) as caught:
        run_download("d", settings, tmp_path)
    message = str(caught.value)
    kind = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}[suffix]
    prefix = f"{directory}/train.jsonl{suffix}: the {kind} stream is damaged or cut short after line "
    assert message.startswith(prefix), message
    whole = int(message[len(prefix):].split(",")[0])
    # the lines a streaming decompressor gives whole before the cut: the reference count
    assert whole == reference_whole_lines(cut(compress(data)), kind) and whole > 100


def reference_whole_lines(data: bytes, kind: str) -> int:
    import zlib

    if kind == "gzip":
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif kind == "bz2":
        decoder = bz2.BZ2Decompressor()
    else:
        decoder = zstandard.ZstdDecompressor().decompressobj()
    out = b""
    for start in range(0, len(data), 1024):
        try:
            out += decoder.decompress(data[start:start + 1024])
        except Exception:
            break
    return out.count(b"\n")


# --- 3. zstd ------------------------------------------------------------------------------------------------------
def zst(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


def test_a_zst_split_and_zst_shards_are_read_for_every_line_format(tmp_path):
    directory = source(tmp_path, {"train.jsonl.zst": zst(jsonl(ROWS)), "test.jsonl": jsonl(TEST[:1])})
    settings = settings_for(directory)
    check_local_splits({"d": DatasetSettings.parse(settings, "d")})
    out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path / "a"), tmp_path / "a")
    assert load_from_disk(str(out))["train"]["question"] == [row["q"] for row in ROWS]
    shards = source(tmp_path / "b", {"part-0.jsonl.zst": zst(jsonl(ROWS[:10])), "part-1.jsonl.zst": zst(jsonl(ROWS[10:])),
                                     "test.jsonl": jsonl(TEST[:1])})
    settings = settings_for(shards, source={"type": "local", "path": str(shards), "files": {"train": "part-*.jsonl.zst"}})
    check_local_splits({"d": DatasetSettings.parse(settings, "d")})
    out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path / "b"), tmp_path / "b")
    assert load_from_disk(str(out))["train"]["question"] == [row["q"] for row in ROWS]
    csv = b"q,a\n" + b"".join(b"q%d?,%d\n" % (i, i) for i in range(5))
    tsv = b"q\ta\n" + b"".join(b"q%d?\t%d\n" % (i, i) for i in range(5))
    for fmt, name, data in [("csv", "train.csv.zst", csv), ("tsv", "train.tsv.zst", tsv)]:
        directory = source(tmp_path / fmt, {name: zst(data), f"test.{fmt}": data.replace(b"?", b"!")})
        settings = settings_for(directory, format=fmt)
        out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path / fmt), tmp_path / fmt)
        assert load_from_disk(str(out))["train"]["question"] == [f"q{i}?" for i in range(5)]
    corpus = source(tmp_path / "text", {"train.txt.zst": zst(b"one\n\ntwo\n"), "test.txt": b"x\n"})
    settings = settings_for(corpus, CORPUS)
    out, _ = run_normalise("c", settings, run_download("c", settings, tmp_path / "text"), tmp_path / "text")
    assert load_from_disk(str(out))["train"]["id"] == ["train-1", "train-3"]
    amr = source(tmp_path / "amr", {"train.txt.zst": zst(b"# ::id a\n# ::snt A boy.\n(b / boy)\n"),
                                    "test.txt": b"# ::id t\n# ::snt A girl.\n(g / girl)\n"})
    settings = settings_for(amr, format="penman", fields={"id": "id", "question": "snt", "answers": "graph"}, metric="smatch")
    out, _ = run_normalise("p", settings, run_download("p", settings, tmp_path / "amr"), tmp_path / "amr")
    assert load_from_disk(str(out))["train"]["answers"] == [["(b / boy)"]]


def test_a_truncated_zstd_corpus_is_refused_naming_file_and_line(tmp_path):
    directory = source(tmp_path, {"train.txt.zst": cut(zst(many_rows(3000))), "test.txt": b"held out\n"})
    with pytest.raises(WorkflowError) as caught:
        run_download("c", settings_for(directory, CORPUS), tmp_path)
    assert str(caught.value).startswith(f"{directory}/train.txt.zst: the zstd stream is damaged or cut short after line ")


def test_multi_member_gzip_and_multi_stream_bz2_are_read_whole(tmp_path):
    directory = source(tmp_path, {"train.jsonl.gz": gzip.compress(jsonl(ROWS[:7])) + gzip.compress(jsonl(ROWS[7:])),
                                  "test.jsonl.bz2": bz2.compress(jsonl(TEST[:2])) + bz2.compress(jsonl(TEST[2:4]))})
    settings = settings_for(directory)
    out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path), tmp_path)
    assert load_from_disk(str(out))["train"].num_rows == 20 and load_from_disk(str(out))["test"].num_rows == 4


# --- 4. TSV --------------------------------------------------------------------------------------------------------
SST2 = (b"sentence\tlabel\nhide new secretions from the parental units \t0\n"
        b'the "director\'s cut is " better\t1\nit \'s a lone " quote \t1\nthe greatest musicians \t1\n'
        b"contains no wit , only labored gags \t0\n")
DEV = (b"sentence\tlabel\nit 's a charming and often affecting journey . \t1\nunflinchingly bleak \t0\n"
       b'a "quoted" film \t1\n')


def sst2_settings(directory: Path, **changes) -> dict:
    return settings_for(directory, {"task": "classification", "format": "tsv", "metric": "accuracy",
                                    "fields": {"text": "sentence", "label": "label"},
                                    "splits": {"train": "train", "test": "dev"}}, **changes)


@pytest.mark.parametrize("suffix", ["", ".gz", ".bz2", ".zst"])
def test_glue_sst2_tsv_is_read_with_quoting_off(tmp_path, suffix):
    compress = {"": lambda data: data, ".gz": gzip.compress, ".bz2": bz2.compress, ".zst": zst}[suffix]
    directory = source(tmp_path, {f"train.tsv{suffix}": compress(SST2), "dev.tsv": DEV})
    settings = sst2_settings(directory, max_rejected_fraction=0.5)
    check_local_splits({"d": DatasetSettings.parse(settings, "d")})
    out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path), tmp_path)
    train = load_from_disk(str(out))["train"]
    assert train["text"][1:3] == ['the "director\'s cut is " better', 'it \'s a lone " quote']  # a lone " merges nothing
    assert train["label"] == ["0", "1", "1", "1", "0"]
    assert load_from_disk(str(out))["test"]["text"][2] == 'a "quoted" film'  # quotes kept as they are


def test_a_tsv_row_with_an_embedded_tab_is_refused_naming_the_row(tmp_path):
    data = SST2 + b"one\ttab too many\t1\n" + b"".join(b"sentence %d\t1\n" % i for i in range(20))
    directory = source(tmp_path, {"train.tsv": data, "dev.tsv": DEV})
    message = failing_normalise(sst2_settings(directory), tmp_path)
    assert message.endswith(f"for example {directory}/train.tsv line 7: not valid TSV: line 7 has 3 fields where the "
                            "header (line 1) has 2; a value holding a tab splits into two fields (TSV has no quoting): "
                            "replace the tab inside the value; fix the rows or raise datasets.d.max_rejected_fraction")


def test_a_tsv_file_under_format_csv_points_at_format_tsv(tmp_path):
    directory = source(tmp_path, {"train.tsv": SST2, "dev.tsv": DEV})
    with pytest.raises(ConfigError) as caught:
        check_local_splits({"d": DatasetSettings.parse(sst2_settings(directory, format="csv"), "d")})
    assert "train.tsv is there: set format: tsv" in str(caught.value)
