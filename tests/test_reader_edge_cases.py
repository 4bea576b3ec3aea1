"""Odd-but-valid inputs a reviewer fed the new readers (issue 43's follow-up): each was altered or refused where
the reference library reads it. Compared with ``zstandard`` (``read_across_frames``), ``pandas.read_csv`` and
PIL + transformers' ``convert_to_rgb``."""
from __future__ import annotations

import io
import struct

import numpy as np
import zstandard
from datasets import load_from_disk

from data_helpers import run_download, run_normalise
from test_text_formats import ROWS, TEST, jsonl, settings_for, source, sst2_settings


def _skippable(payload: bytes) -> bytes:
    # A zstd skippable frame (magic 0x184D2A50..5F, then its size): pzstd writes one before every frame.
    return struct.pack("<II", 0x184D2A50, len(payload)) + payload


def test_a_zst_file_that_starts_with_a_skippable_frame_is_read_as_zstd(tmp_path):
    data = jsonl(ROWS)
    packed = _skippable(b"\x10\x00\x00\x00") + zstandard.ZstdCompressor().compress(data)
    reference = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(packed), read_across_frames=True).read()
    assert reference == data
    directory = source(tmp_path, {"train.jsonl.zst": packed, "test.jsonl": jsonl(TEST[:1])})
    settings = settings_for(directory)
    out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path), tmp_path)
    assert load_from_disk(str(out))["train"]["question"] == [row["q"] for row in ROWS]


def test_a_tsv_and_a_csv_value_longer_than_128_kib_is_read_as_pandas_reads_it(tmp_path):
    import pandas as pd

    long = "word " * 40_000  # 200,000 characters: a long document, above the csv module's default field limit
    for fmt, sep in (("tsv", "\t"), ("csv", ",")):
        data = f"sentence{sep}label\n{long}{sep}1\nshort{sep}0\n".encode()
        reference = pd.read_csv(io.BytesIO(data), sep=sep, quoting=3 if fmt == "tsv" else 0, dtype=str)
        directory = source(tmp_path / fmt, {f"train.{fmt}": data, f"dev.{fmt}": b"sentence%slabel\nok%s1\n" % ((sep.encode(),) * 2)})
        settings = {**sst2_settings(directory), "format": fmt}
        out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path / fmt), tmp_path / fmt)
        # normalise strips a text field's outer whitespace (as the SST-2 test above shows)
        assert list(load_from_disk(str(out))["train"]["text"]) == [text.strip() for text in reference["sentence"]]


def test_a_16_bit_grey_png_with_a_transparent_value_is_white_there_as_convert_to_rgb_makes_it():
    from PIL import Image

    from workflow_scripts.data.images import decode_rgb

    values = np.array([[0, 30000, 65535], [12345, 30000, 500]], dtype=np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, "PNG", transparency=30000)
    assert Image.open(io.BytesIO(buffer.getvalue())).info["transparency"] == 30000
    seen = np.asarray(decode_rgb(buffer.getvalue()))
    expected = np.repeat(((values.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)[..., None], 3, axis=2)
    expected[values == 30000] = 255  # transparent: composited on white, as convert_to_rgb does for every other mode
    assert seen.tolist() == expected.tolist()


def test_an_ascii_file_with_a_utf8_bom_declared_latin1_shows_the_bom_in_the_declared_reading(tmp_path):
    # Excel's "CSV UTF-8" writes a BOM before plain ASCII: read as latin-1 the first column would be named 'ï»¿q'.
    # The refusal stands; its two readings must differ where the file does (they were the same text, 'q\ta').
    from test_text_formats import failing_normalise

    data = b"\xef\xbb\xbfq\ta\n" + b"".join(b"question %d?\t%d\n" % (i, i) for i in range(5))
    directory = source(tmp_path, {"train.tsv": data, "test.tsv": b"q\ta\nheld out?\t1\n"})
    message = failing_normalise(settings_for(directory, format="tsv", encoding="latin-1"), tmp_path)
    assert message.startswith(f"{directory}/train.tsv line 1: the dataset declares encoding: latin-1, but the file is "
                              "valid UTF-8")
    assert f"read as latin-1 the line is {data[:6].decode('latin-1')!r}, read as UTF-8 it is 'q\\ta'" in message


QWEN = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _budget_transformers_uses(directory) -> int:
    import transformers

    return transformers.AutoImageProcessor.from_pretrained(str(directory)).size["longest_edge"]


def test_the_memory_checks_pixel_budget_is_the_one_transformers_loads(tmp_path):
    """The memory check priced one budget and transformers loaded another: (a) both layouts present (a folder saved by
    transformers 5 over the Hub's files), where transformers reads the nested processor_config.json first; (b) a
    preprocessor_config.json with both size.longest_edge and a top-level max_pixels (a user's edit of one), where
    Qwen2VLImageProcessor lets max_pixels override size. Each time the check's budget was 4x below the real one."""
    import json

    from workflow_scripts.model import processor_files

    both = tmp_path / "both"
    both.mkdir()
    (both / processor_files.IMAGE_PROCESSOR_FILE).write_text(json.dumps({**QWEN, "max_pixels": 500_000,
                                                                          "processor_class": "Qwen2_5_VLProcessor"}))
    (both / processor_files.PROCESSOR_FILE).write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor", "image_processor": {
        **QWEN, "size": {"shortest_edge": 3136, "longest_edge": 2_000_000}}}))
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / processor_files.IMAGE_PROCESSOR_FILE).write_text(json.dumps({
        **QWEN, "max_pixels": 2_000_000, "size": {"shortest_edge": 3136, "longest_edge": 500_000}}))
    for directory in (both, edited):
        assert _budget_transformers_uses(directory) == 2_000_000
        assert processor_files.read(directory).max_pixels() == 2_000_000, directory.name


def test_a_corpus_with_carriage_return_line_ends_is_not_read_as_one_example(tmp_path):
    """Classic Mac line ends (a bare \\r, Excel for Mac's text export): split on \\n only, the whole file was one
    example ('one\\rtwo\\rthree') at exit 0; datasets' text loader (str.splitlines) reads three lines. Stopped naming the
    line, or under on_invalid_text: reject_row that line is rejected and counted."""
    from test_text_formats import CORPUS, failing_normalise

    from workflow_scripts.data.text_lines import LineCounts, iter_lines

    data = b"one\rtwo\rthree\r"
    assert data.decode().splitlines() == ["one", "two", "three"]  # the reference reads three examples
    directory = source(tmp_path, {"train.txt": data, "test.txt": b"held out\n"})
    message = failing_normalise(settings_for(directory, CORPUS), tmp_path, "c")
    assert message.startswith(f"{directory}/train.txt line 1: a carriage return (\\r) at character 3 of the line is not "
                              "followed by a line feed")
    counts = LineCounts()
    kept = list(iter_lines([directory / "test.txt", directory / "train.txt"], counts, on_invalid_text="reject_row"))
    assert [text for _, _, text in kept] == ["held out"]
    assert counts.files[str(directory / "train.txt")]["invalid_text_lines"] == [1]
    # CR LF converted twice ("\r\r\n"): splitlines reads each line and a blank one; the line is read, not stopped at
    (directory / "twice.txt").write_bytes(b"one\r\r\ntwo\r\r\n")
    assert [text for _, _, text in iter_lines([directory / "twice.txt"])] == ["one", "two"]


def test_a_float_image_scaled_to_0_1_is_refused_not_turned_black():
    """A 32-bit float TIFF holding 0..1 (how scientific pipelines save images) passed the 0..255 range check, and
    Pillow's conversion (convert_to_rgb's too) truncates each value to 0 or 1: an all-black image at exit 0."""
    import pytest
    from PIL import Image

    from workflow_scripts.data.images import check_image, decode_rgb
    from workflow_scripts.data.rows import Rejected

    buffer = io.BytesIO()
    Image.fromarray(np.array([[0.2, 0.9], [0.5, 1.0]], dtype=np.float32)).save(buffer, "TIFF")
    assert np.asarray(decode_rgb(buffer.getvalue())).max() <= 1  # what the model would have seen: black
    with pytest.raises(Rejected) as caught:
        check_image(buffer.getvalue())
    assert caught.value.reason == "image_value_range"
    assert "values 0.2..1, all within 0..1" in str(caught.value.detail)
    buffer = io.BytesIO()  # a float image of 0..255 values converts as they are, and stays accepted
    Image.fromarray(np.array([[0.0, 17.0], [128.0, 255.0]], dtype=np.float32)).save(buffer, "TIFF")
    assert check_image(buffer.getvalue()).mode == "F"


def test_a_json_file_in_its_declared_utf16_is_read_not_refused_at_download(tmp_path):
    """Windows PowerShell's Out-File writes UTF-16 with a BOM; declared encoding: utf-16, download's row count read
    the file as UTF-8 and stopped with 'not valid JSON (line 1 column 1): Expecting value'."""
    import json

    records = [{"q": f"question {i} \u00e9?", "a": str(i)} for i in range(5)]
    directory = source(tmp_path, {"train.json": json.dumps(records).encode("utf-16"),
                                  "test.json": json.dumps(records[:1]).encode("utf-16")})
    settings = settings_for(directory, format="json", encoding="utf-16", contamination={"accept": True})
    out, _ = run_normalise("d", settings, run_download("d", settings, tmp_path), tmp_path)
    assert load_from_disk(str(out))["train"]["question"] == [record["q"] for record in records]
    manifest = json.loads((tmp_path / "results" / "d" / "download_manifest.json").read_text())
    assert manifest["rows"] == {"train": 5, "test": 1}


def test_a_classlabel_id_of_minus_1_is_named_as_an_unlabelled_row():
    """datasets writes -1 for a row without a label (GLUE's test splits, exported to Parquet): the message said only
    'not a class id 0..1', where the cause is a split with no labels to evaluate against."""
    import pytest

    from workflow_scripts.data.rows import Rejected
    from workflow_scripts.tasks.class_labels import source_class_name

    assert source_class_name("1", ["neg", "pos"], "label") == "pos"
    with pytest.raises(Rejected) as caught:
        source_class_name("-1", ["neg", "pos"], "label")
    assert caught.value.reason == "unknown_label"
    assert caught.value.detail.startswith("label -1 is datasets' mark of a row without a label (GLUE's test splits hold "
                                          "only -1)")


def test_a_zero_padded_number_is_never_read_as_a_class_id():
    """datasets' ClassLabel.str2int falls back to int(value), so '01', '+1' and '007' were class ids 1, 1 and 7: a
    column numbered from 01 read one class off at exit 0. Only a label's canonical decimal form is an id; '01' is a
    name (matched as written when declared) or the row is refused saying what to write in labels:."""
    import pytest
    from datasets import ClassLabel

    from workflow_scripts.data.rows import Rejected
    from workflow_scripts.tasks.class_labels import column_reading
    from workflow_scripts.tasks.classification import declared_label

    names = ["neg", "neu", "pos"]
    assert ClassLabel(names=names).str2int("01") == 1  # the reference's reading, refused here on purpose
    for label in ("01", "+1", "007", "-0"):
        with pytest.raises(Rejected) as caught:
            declared_label(label, names)
        assert caught.value.reason == "unknown_label"
        assert caught.value.detail.startswith(f"label {label!r} is not a declared name, and a number written with a "
                                              "leading zero or a sign is not read as a class id")
    assert declared_label("1", names) == ("neu", True)  # the canonical form stays an id, as datasets reads it
    assert declared_label("01", ["01", "02"]) == ("01", False)  # declared as written: read by name
    # Against declared numbers: '01' is no id 1 (it read as one, and with '3' beside it refused the column as mixed)
    assert column_reading({"01", "02", "3"}, ["1", "2", "3"], "datasets.d", "label") is None


def test_a_line_of_spaces_in_a_csv_or_tsv_is_skipped_as_pandas_skips_it(tmp_path):
    """pandas.read_csv (skip_blank_lines=True, its C engine) skips a line of spaces, or of spaces and tabs where the
    tab is no delimiter, as it skips an empty one; the reader refused it as a row of 1 field where the header has 2.
    A quoted value of spaces stays a row (it is one for pandas too), as does a TSV line holding a tab."""
    import pandas as pd

    from workflow_scripts.data import raw_records

    inputs = {  # name -> (format, file text)
        "csv-spaces": ("csv", "q,a\nx,1\n   \ny,2\n"),
        "csv-tab-and-spaces": ("csv", "q,a\nx,1\n \t \ny,2\n"),
        "csv-crlf-spaces": ("csv", "q,a\r\nx,1\r\n  \r\ny,2\r\n"),
        "csv-spaces-before-header": ("csv", "  \nq,a\nx,1\n"),
        "csv-spaces-at-end": ("csv", "q,a\nx,1\n    "),
        "csv-one-column-spaces": ("csv", "q\nx\n  \ny\n"),
        "csv-one-column-quoted-spaces": ("csv", 'q\nx\n"  "\ny\n'),
        "csv-spaces-inside-a-quoted-value": ("csv", 'q,a\n"two\n   \nlines",1\ny,2\n'),
        "tsv-spaces": ("tsv", "q\ta\nx\t1\n   \ny\t2\n"),
    }
    for name, (fmt, text) in inputs.items():
        options = {"sep": "\t", "quoting": 3} if fmt == "tsv" else {}
        reference = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, **options).to_dict("records")
        path = tmp_path / f"{name}.{fmt}"
        path.write_bytes(text.encode())
        got = [record for _, record in raw_records.read_placed(path, fmt)]
        assert got == reference, name
        assert raw_records.count_rows(path, fmt) == len(reference), name
    places = [place.line for place, _ in raw_records.read_placed(tmp_path / "csv-spaces.csv", "csv")]
    assert places == [2, 4]  # the row after the skipped line keeps its own line number


def test_a_jsonl_file_with_carriage_return_line_ends_is_read_as_datasets_reads_it(tmp_path):
    """Old Mac line ends (a bare \\r after each record): the file was one line, rejected as 'Extra data' with no word
    on its line ends; datasets' json reader (pyarrow's) reads each record. A record whose \\r is JSON whitespace inside
    it stays one record, and a bad record among CR-ended ones is refused at its own line."""
    import json

    import datasets

    from workflow_scripts.data import raw_records

    records = [{"q": f"question {i}?", "a": str(i)} for i in range(3)]
    files = {"cr.jsonl": "".join(json.dumps(record) + "\r" for record in records),
             "cr-then-lf.jsonl": json.dumps(records[0]) + "\r" + json.dumps(records[1]) + "\n" + json.dumps(records[2]) + "\n",
             "cr-inside.jsonl": '{"q": "question 0?",\r "a": "0"}\n' + json.dumps(records[1]) + "\n"}
    for name, text in files.items():
        path = tmp_path / name
        path.write_bytes(text.encode())
        reference = datasets.load_dataset("json", data_files=str(path), split="train",
                                          cache_dir=str(tmp_path / "cache")).to_list()
        placed = list(raw_records.read_placed(path, "jsonl"))
        assert [record for _, record in placed] == reference, name
        assert raw_records.count_rows(path, "jsonl") == len(reference), name
    assert [place.line for place, _ in raw_records.read_placed(tmp_path / "cr-then-lf.jsonl", "jsonl")] == [1, 2, 3]
    (tmp_path / "bad.jsonl").write_bytes(b'{"q": "x?", "a": "1"}\r{"q": "cut\r{"q": "z?", "a": "2"}\r')
    placed = list(raw_records.read_placed(tmp_path / "bad.jsonl", "jsonl"))
    assert [place.line for place, _ in placed] == [1, 2, 3]
    assert placed[0][1] == {"q": "x?", "a": "1"} and placed[2][1] == {"q": "z?", "a": "2"}
    assert isinstance(placed[1][1], raw_records.Unparseable)
    assert placed[1][1].error.startswith("not valid JSON: line 2 column 7: Unterminated string starting here (the "
                                         "file ends its lines with a bare carriage return")


def test_a_qwen_processor_saved_with_size_min_pixels_max_pixels_is_read_as_transformers_loads_it(tmp_path):
    """transformers 4.45-4.48 saved Qwen2-VL's size as {min_pixels, max_pixels}, with the same two keys at the top
    level. The installed transformers turns the top-level keys into size.shortest_edge/longest_edge; a file with the
    size alone loads without a budget and stops at the first image, where the memory check priced none (the tower's
    own size) at exit 0: refused when the file is read, naming the file and key and what to write."""
    import json
    import types

    import pytest

    from workflow_scripts.checks.memory import processor_max_pixels
    from workflow_scripts.core.errors import ConfigError, WorkflowError
    from workflow_scripts.model import processor_files

    saved = tmp_path / "saved"  # as 4.45-4.48's save_pretrained wrote it (the top-level keys are what it ran on)
    saved.mkdir()
    (saved / processor_files.IMAGE_PROCESSOR_FILE).write_text(json.dumps({
        **QWEN, "min_pixels": 3136, "max_pixels": 500_000, "size": {"min_pixels": 3136, "max_pixels": 500_000}}))
    assert _budget_transformers_uses(saved) == 500_000 == processor_files.read(saved).max_pixels()
    size_only = tmp_path / "size_only"
    size_only.mkdir()
    path = size_only / processor_files.IMAGE_PROCESSOR_FILE
    path.write_text(json.dumps({**QWEN, "size": {"min_pixels": 3136, "max_pixels": 2_000_000}}))
    assert _budget_transformers_uses(size_only) is None  # transformers has no budget to resize by
    expected = (f"{path}: key 'size' holds {{'min_pixels': 3136, 'max_pixels': 2000000}}, the layout transformers "
                "4.45-4.48 saved, which the installed transformers does not read as the pixel budget (its Qwen2-VL "
                "image processor resizes by size.shortest_edge and size.longest_edge, and stops at the first image "
                "without them); write \"size\": {\"shortest_edge\": 3136, \"longest_edge\": 2000000} there (the same "
                "budget), or save the processor again with the installed transformers")
    with pytest.raises(WorkflowError) as caught:
        processor_files.read(size_only)
    assert str(caught.value) == expected
    spec = types.SimpleNamespace(source="local", path=str(size_only))
    with pytest.raises(ConfigError) as caught:  # the memory check at snakemake -n, naming the model's key
        processor_max_pixels("qwen", spec, tmp_path, "models.qwen")
    assert expected in str(caught.value)


def test_a_raw_carriage_return_inside_a_jsonl_string_is_one_bad_record_not_three_rows(tmp_path):
    """A \\n-ended line whose string value holds raw (unescaped) carriage returns fails whole, as json and pyarrow's
    reader refuse it ("Invalid encoding in string"). It was then cut at its \\r as old Mac line ends because one piece
    ('42') parsed alone: one record became three rows, the bare number among them, each blamed on the file's line
    ends. CR line ends are taken only where a piece is a JSON object, a record; otherwise the line's own error stands."""
    import io

    import pyarrow.json
    import pytest

    from workflow_scripts.data import raw_records

    text = b'{"text": "Hello\r42\rworld", "label": "a"}\n{"text": "ok", "label": "b"}\n'
    with pytest.raises(Exception, match="Invalid encoding in string"):  # the reference refuses the record
        pyarrow.json.read_json(io.BytesIO(text))
    path = tmp_path / "raw-cr.jsonl"
    path.write_bytes(text)
    placed = list(raw_records.read_placed(path, "jsonl"))
    assert [place.line for place, _ in placed] == [1, 2]
    assert isinstance(placed[0][1], raw_records.Unparseable)
    assert placed[0][1].error == "not valid JSON: line 1 column 16: Invalid control character here"
    assert placed[1][1] == {"text": "ok", "label": "b"}
    assert raw_records.count_rows(path, "jsonl") == 2


def test_a_label_in_non_ascii_digits_is_refused_as_such_not_as_zero_padded():
    """'１' (full-width) and '٣' (Arabic-Indic) match \\d and int() reads them (datasets' str2int makes '１' id 1):
    refused as no class id, as '01' is, but the message said 'written with a leading zero or a sign', which they are
    not. It names the digits instead."""
    import pytest
    from datasets import ClassLabel

    from workflow_scripts.data.rows import Rejected
    from workflow_scripts.tasks.classification import declared_label

    names = ["neg", "neu", "pos"]
    assert ClassLabel(names=names).str2int("１") == 1
    for label in ("１", "٣", "٠"):
        with pytest.raises(Rejected) as caught:
            declared_label(label, names)
        assert caught.value.detail.startswith(f"label {label!r} is not a declared name, and a number written in "
                                              "digits other than ASCII 0-9 is not read as a class id"), label


def test_declared_zero_padded_labels_beside_rows_of_plain_numbers_are_refused_not_read_one_class_off():
    """The mirror of '01' rows against plain ids: labels: ['01', '02', '03'] declared, rows writing 1, 2, 3. Every
    value is one of the declared names written without its zeros, and as a class id ('1' -> '02', datasets' str2int
    alike) one class off, the top class's rows alone refused; with fewer classes in the rows nothing was refused.
    The column reads two ways, so it is refused naming both readings; rows holding 0 are ids and stay so."""
    import pytest

    from workflow_scripts.core.errors import WorkflowError
    from workflow_scripts.tasks.class_labels import column_reading
    from workflow_scripts.tasks.classification import declared_label

    declared = ["01", "02", "03"]
    for values in ({"1", "2", "3"}, {"1", "2"}):
        with pytest.raises(WorkflowError) as caught:
            column_reading(values, declared, "datasets.d", "label")
        assert str(caught.value).startswith("datasets.d.labels: the declared labels ['01', '02', '03'] are numbers "
                                            "written otherwise than column 'label' writes them (['1', '2"), values
        assert "by index 1 -> 02, 2 -> 03" in str(caught.value)
    assert column_reading({"0", "1", "2"}, declared, "datasets.d", "label") is None  # 0 names no class: ids only
    assert declared_label("1", declared) == ("02", True)
    assert column_reading({"01", "02", "03"}, declared, "datasets.d", "label") is None  # as declared


def test_a_qwen_processor_file_without_image_processor_type_is_read_by_the_models_type_as_transformers_reads_it(tmp_path):
    """A preprocessor_config.json naming no image_processor_type: transformers' AutoImageProcessor takes the class
    config.json's model_type maps to (qwen2_vl: Qwen2VLImageProcessor), so its max_pixels is the budget and a size of
    {min_pixels, max_pixels} stops at the first image. Both were read as a fixed-size processor: no budget priced,
    the size not refused."""
    import json

    import pytest
    from transformers import AutoImageProcessor

    from workflow_scripts.core.errors import WorkflowError
    from workflow_scripts.model import processor_files

    common = {"processor_class": "Qwen2VLProcessor", "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
              "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    for name, fields in (("top", {"min_pixels": 3136, "max_pixels": 50176}),
                         ("size", {"size": {"min_pixels": 3136, "max_pixels": 1003520}})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
        (folder / "preprocessor_config.json").write_text(json.dumps({**common, **fields}))
        loaded = AutoImageProcessor.from_pretrained(str(folder))
        assert type(loaded).__name__.startswith("Qwen2VLImageProcessor")
        if name == "top":
            assert loaded.size["longest_edge"] == 50176
            assert processor_files.read(folder).max_pixels() == 50176
        else:
            with pytest.raises(WorkflowError, match="key 'size' holds"):
                processor_files.read(folder)


def test_a_cr_ended_jsonl_record_with_a_cr_inside_it_as_json_whitespace_is_one_record_as_pyarrow_reads_it(tmp_path):
    """Old Mac line ends, and a record broken over two lines at a \\r that is JSON whitespace there: pyarrow's json
    reader (datasets') parses the stream of values and reads both records. Cutting at every \\r refused both halves
    of the first as two bad rows. Two values on one line, or a bad record, still go to the per-line reading."""
    import io

    import pyarrow.json

    from workflow_scripts.data import raw_records

    text = b'{"q": "question 0?",\r "a": "0"}\r{"q": "question 1?", "a": "1"}\r'
    path = tmp_path / "cr-record-over-two-lines.jsonl"
    path.write_bytes(text)
    reference = pyarrow.json.read_json(io.BytesIO(text)).to_pylist()
    placed = list(raw_records.read_placed(path, "jsonl"))
    assert [record for _, record in placed] == reference
    assert [place.line for place, _ in placed] == [1, 3]  # each record at the line it starts on
    assert raw_records.count_rows(path, "jsonl") == 2
    # Two values on one line of a \n-ended file are refused (JSON Lines, json.loads per line): that stays so
    # where no \r separates values (the \r here is whitespace inside the first record).
    (tmp_path / "two-on-a-lf-line.jsonl").write_bytes(b'{"a":\r1} {"a": 2}\n{"a": 3}\n')
    placed = list(raw_records.read_placed(tmp_path / "two-on-a-lf-line.jsonl", "jsonl"))
    assert isinstance(placed[0][1], raw_records.Unparseable) and placed[1][1] == {"a": 3}


# --- readers, round 3 (leftovers of the review) ---
def test_a_tsv_or_csv_whose_header_line_is_blank_is_refused_naming_the_line_not_a_duplicated_column(tmp_path):
    """A header line of tabs and spaces only (' \\t ', a spreadsheet's empty first row saved as TSV): it was refused
    as 'the header names column [' '] more than once', which is not what is wrong. pandas.read_csv(sep='\\t',
    quoting=QUOTE_NONE) reads it, inventing the names ('Unnamed: 0', ' .1'), so every field mapping misses: refused
    here naming the file, the line and what to write there."""
    import csv

    import pandas as pd
    import pytest

    from workflow_scripts.core.errors import WorkflowError
    from workflow_scripts.data import raw_records

    for fmt, header, invented in (("tsv", " \t \n", [" ", " .1"]), ("tsv", "\t\n", ["Unnamed: 0", "Unnamed: 1"]),
                                  ("csv", " , \n", [" ", " .1"])):
        text = header + ("hello\t1\nbye\t0\n" if fmt == "tsv" else "hello,1\nbye,0\n")
        options = {"sep": "\t", "quoting": csv.QUOTE_NONE} if fmt == "tsv" else {}
        assert list(pd.read_csv(io.StringIO(text), dtype=str, **options).columns) == invented  # the reference reads it
        path = tmp_path / f"blank-header.{fmt}"
        path.write_text(text)
        with pytest.raises(WorkflowError) as caught:
            list(raw_records.read_placed(path, fmt))
        separated = "tabs" if fmt == "tsv" else "commas"
        assert str(caught.value) == (
            f"{path} line 1: the header line is blank (spaces and {separated} only), so the columns have no names; "
            f"write the column names on line 1, separated by {separated} "
            f"(e.g. {'sentence<TAB>label' if fmt == 'tsv' else 'text,label'}), or remove the line if the next one is "
            "the header"), fmt
    path = tmp_path / "blank-then-header.tsv"  # a line of spaces alone is a blank line (pandas skips it alike)
    path.write_text("   \nsentence\tlabel\nhello\t1\n")
    assert [record for _, record in raw_records.read_placed(path, "tsv")] == [{"sentence": "hello", "label": "1"}]


def test_two_json_records_on_one_cr_ended_line_are_refused_as_on_any_line(tmp_path):
    """One JSON value per line, whatever ends the line: two records on one CR-ended line are refused as two on one
    \\n-ended line are (pyarrow, a stream reader, reads both in either case), naming the line; the record on the
    next line is kept."""
    from workflow_scripts.data import raw_records

    (tmp_path / "two-on-a-cr-line.jsonl").write_bytes(b'{"a": 1} {"a": 2}\r{"a": 3}\r')
    placed = list(raw_records.read_placed(tmp_path / "two-on-a-cr-line.jsonl", "jsonl"))
    assert isinstance(placed[0][1], raw_records.Unparseable) and placed[1][1] == {"a": 3}
    assert [place.line for place, _ in placed] == [1, 2]


def test_a_classlabel_whose_names_write_the_declared_numbers_otherwise_is_refused_naming_both(tmp_path):
    """A ClassLabel column named ['01', '02', '03'] (a datasets export) and labels: ['1', '2', '3']: each row's class
    is the ClassLabel's name, matched by name, so every row is refused (as datasets reads '01', it is not '1'). The
    message said only that '01' is not in the label set; it names the ClassLabel's names against labels:, and the
    fix."""
    import json

    import pytest
    from datasets import ClassLabel, Dataset, Features, Value

    from workflow_scripts import normalise
    from workflow_scripts.core.errors import WorkflowError

    raw = tmp_path / "raw"
    raw.mkdir()
    features = Features({"text": Value("string"), "label": ClassLabel(names=["01", "02", "03"])})
    for split in ("train", "test"):
        Dataset.from_dict({"text": [f"{split} {i}" for i in range(6)], "label": [0, 1, 2] * 2},
                          features=features).to_parquet(str(raw / f"{split}.parquet"))
    settings = {"task": "classification", "format": "parquet", "source": {"type": "local", "path": str(raw)},
                "splits": {"train": "train", "test": "test"}, "fields": {"text": "text", "label": "label"},
                "metric": "accuracy", "labels": ["1", "2", "3"]}
    with pytest.raises(WorkflowError) as caught:
        normalise.main(["--name", "d", "--dataset", json.dumps(settings), "--raw", str(raw),
                        "--out", str(tmp_path / "out"), "--report", str(tmp_path / "report.json")])
    detail = ("field 'label': label '01' (class id 0 of the source's ClassLabel names ['01', '02', '03']) is not a "
              "declared label: labels: ['1', '2', '3'] writes the same numbers otherwise (01 -> 1, 02 -> 2, 03 -> 3), "
              "and a ClassLabel's names are matched as written; declare labels: exactly as the ClassLabel names them "
              "(['01', '02', '03']), or drop labels: to use the ClassLabel's names")
    assert f"{raw}/train.parquet row index 0: {detail}" in str(caught.value)
    assert "str2int" not in str(caught.value) and "\n" not in str(caught.value)
    from workflow_scripts.tasks.class_labels import class_names_mismatch

    # A name the declared list lacks altogether, beside names it writes otherwise: the same mismatch named
    assert class_names_mismatch("2", "03", ["01", "02", "03"], ["1", "2"]).startswith(
        "label '03' (class id 2 of the source's ClassLabel names ['01', '02', '03']) is not a declared label: labels: "
        "['1', '2'] writes the same numbers otherwise (01 -> 1, 02 -> 2)")
    assert class_names_mismatch("1", "neu", ["neg", "neu", "pos"], ["neg", "pos"]) is None  # check_label's message
    assert class_names_mismatch("0", "01", ["01", "02"], ["01", "02"]) is None  # declared as named


def test_a_header_of_non_breaking_spaces_is_named_as_pandas_names_it(tmp_path):
    """A blank header is one of spaces (and tabs, in a CSV) as a blank line is (pandas skips those): a non-breaking
    space is a name for pandas, and was refused as 'spaces and commas only' (found by a review)."""
    import io

    import pandas as pd

    from workflow_scripts.data import raw_records

    text = "\u00a0,\u00a0\u00a0\n1,2\n"
    path = tmp_path / "nbsp.csv"
    path.write_text(text, encoding="utf-8")
    reference = pd.read_csv(io.StringIO(text), dtype=str).to_dict("records")
    assert [record for _, record in raw_records.read_placed(path, "csv")] == reference
