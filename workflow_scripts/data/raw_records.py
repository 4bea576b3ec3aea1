"""Reading the raw records that ``download`` stored, one split at a time, exactly as they are.

Raw layouts (see docs/architecture.md): a hub dataset is a ``DatasetDict.save_to_disk`` directory;
url and local sources are files named ``<source split>.<format>`` (jsonl, json, csv or parquet), or a
folder ``<source split>/`` (``data/split_layouts``): an image folder (``metadata.<format>`` with its images)
or a split's several files, read in file-name order with one running row index (:func:`split_files`).
Records are yielded with their 0-based row index and never repaired: a row that cannot be decoded
(a JSONL line that is not JSON, a CSV line whose field count differs from the header's) comes back
as :class:`Unparseable`, so normalisation can reject it with a reason. A file that cannot be read at
all (not UTF-8 text, a corrupt Parquet file, a CSV header naming a column twice) raises one
WorkflowError naming it.

Where a row is, as the user's editor shows it: :func:`iter_placed_records` gives each record's
:class:`Place` (the 1-based line of a JSONL or CSV file, a CSV's header being line 1; the row index
of a JSON list, Parquet file or saved dataset).
"""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from workflow_scripts.core.errors import WorkflowError

FORMATS = ("jsonl", "json", "csv", "parquet")
# Text files are UTF-8; a byte order mark (Excel writes one) is skipped, never read as data.
TEXT_ENCODING = "utf-8-sig"
# Bytes that do not decode come through ``surrogateescape`` as these code points, so a JSONL or CSV row
# that is not UTF-8 can be found and, under the dataset's ``on_invalid_text: reject_row``, rejected alone.
_UNDECODED = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True)
class Unparseable:
    """A raw row that could not be decoded at all (e.g. a JSONL line that is not JSON)."""

    error: str


@dataclass(frozen=True)
class Place:
    """Where a record is: its 0-based row index and, for JSONL and CSV, the 1-based line it starts on."""

    index: int
    line: int | None = None
    file: str | None = None  # the file it is in, where a split has several (else the split's one file)

    def __str__(self) -> str:
        return f"line {self.line}" if self.line is not None else f"row index {self.index}"


def is_saved_dataset(raw_dir: Path) -> bool:
    return (Path(raw_dir) / "dataset_dict.json").exists()


def available_splits(raw_dir: Path, fmt: str) -> list[str]:
    raw_dir = Path(raw_dir)
    if is_saved_dataset(raw_dir):
        return json.loads((raw_dir / "dataset_dict.json").read_text())["splits"]
    folders = [path.name for path in raw_dir.iterdir() if path.is_dir() and split_files(raw_dir, path.name, fmt)]
    return sorted([path.name[: -len(fmt) - 1] for path in raw_dir.glob(f"*.{fmt}")] + folders)


def split_files(raw_dir: Path, split: str, fmt: str) -> list[Path]:
    """A split's raw files in read order: ``<split>.<format>``, an image folder's ``<split>/metadata.<format>``,
    or the files of format ``fmt`` in folder ``<split>/``, sorted by name."""
    from workflow_scripts.data.split_layouts import metadata_file, suffixes

    folder = Path(raw_dir) / split
    if not folder.is_dir():
        return [Path(raw_dir) / f"{split}.{fmt}"]
    if metadata_file(folder, fmt).is_file():
        return [metadata_file(folder, fmt)]
    return sorted((path for path in folder.iterdir() if path.is_file() and path.name.endswith(suffixes(fmt))),
                  key=lambda path: path.name)


def split_location(raw_dir: Path, split: str, fmt: str) -> Path:
    """The file holding a source split (an image folder's metadata), or its saved split directory, or the
    folder of its several files."""
    from workflow_scripts.data.split_layouts import metadata_file

    raw_dir, folder = Path(raw_dir), Path(raw_dir) / split
    if is_saved_dataset(raw_dir):
        return folder
    if not folder.is_dir():
        return raw_dir / f"{split}.{fmt}"
    return metadata_file(folder, fmt) if metadata_file(folder, fmt).is_file() else folder


def iter_records(raw_dir: Path, split: str, fmt: str) -> Iterator[tuple[int, Any]]:
    """(row index, record) for every row of one source split."""
    for place, record in iter_placed_records(raw_dir, split, fmt):
        yield place.index, record


def iter_placed_records(raw_dir: Path, split: str, fmt: str,
                        on_invalid_text: str = "stop") -> Iterator[tuple[Place, Any]]:
    """(place, record) for every row of one source split; a JSONL or CSV row that is not UTF-8 stops the
    read (``on_invalid_text: stop``) or comes back Unparseable (``reject_row``)."""
    raw_dir = Path(raw_dir)
    if split not in available_splits(raw_dir, fmt):
        raise WorkflowError(
            f"{raw_dir}: no split '{split}' (found {available_splits(raw_dir, fmt)}); "
            "check the dataset's splits mapping in the config"
        )
    if is_saved_dataset(raw_dir):
        for index, record in _saved_split(raw_dir, split):
            yield Place(index), record
    elif not split_location(raw_dir, split, fmt).is_dir():
        yield from read_placed(split_location(raw_dir, split, fmt), fmt, on_invalid_text)
    else:  # several files: one running row index (ids stay unique), each row's own file and line
        offset = 0
        for path in split_files(raw_dir, split, fmt):
            size = 0
            for place, record in read_placed(path, fmt, on_invalid_text):
                size = place.index + 1
                yield Place(offset + place.index, place.line, str(path)), record
            offset += size


def read_file(path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
    """(row index, record) for every row of one raw file."""
    for place, record in read_placed(path, fmt):
        yield place.index, record


def read_placed(path: Path, fmt: str, on_invalid_text: str = "stop") -> Iterator[tuple[Place, Any]]:
    """(place, record) for every row of one raw file."""
    if fmt == "jsonl":
        yield from _jsonl(path, on_invalid_text)
    elif fmt == "json":
        for index, record in enumerate(_json_list(path)):
            yield Place(index), record
    elif fmt == "csv":
        yield from _csv(path, on_invalid_text)
    elif fmt == "parquet":
        for index, record in enumerate(_parquet_rows(path)):
            yield Place(index), record
    else:
        raise WorkflowError(f"{path}: unknown format '{fmt}'; known: {list(FORMATS)}")


def count_rows(path: Path, fmt: str) -> int:
    """Rows in a raw file, without judging them (for the download manifest; normalise judges them)."""
    if fmt == "jsonl":
        with open(path, "rb") as handle:  # bytes: a file that is not UTF-8 is normalise's to report
            return sum(1 for line in handle if line.strip())
    if fmt == "csv":
        try:
            with open(path, encoding=TEXT_ENCODING, errors="replace", newline="") as handle:
                return max(sum(1 for fields in csv.reader(handle) if fields) - 1, 0)  # minus the header
        except csv.Error as error:
            raise WorkflowError(f"{path}: not valid CSV: {error}") from None
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as error:  # a truncated or corrupt file
            raise _not_parquet(path, error) from None
    if fmt == "json":
        return len(_json_list(path, errors="replace"))
    raise WorkflowError(f"{path}: unknown format '{fmt}'; known: {list(FORMATS)}")


# --- the formats ---
def _not_utf8_row(path: Path, line: int, on_invalid_text: str) -> Unparseable:
    if on_invalid_text != "reject_row":
        raise _not_utf8(path, rows=True)
    return Unparseable(f"not UTF-8 text: line {line} holds bytes that do not decode (on_invalid_text: reject_row)")


def _jsonl(path: Path, on_invalid_text: str = "stop") -> Iterator[tuple[Place, Any]]:
    try:
        with open(path, encoding=TEXT_ENCODING, errors="surrogateescape") as handle:
            for index, line in enumerate(handle):
                if not line.strip():
                    continue
                if _UNDECODED.search(line):
                    yield Place(index, index + 1), _not_utf8_row(path, index + 1, on_invalid_text)
                    continue
                try:
                    # Only the line's own end is dropped: the columns json reports stay the editor's.
                    yield Place(index, index + 1), json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as error:
                    yield Place(index, index + 1), Unparseable(
                        f"not valid JSON: line {index + 1} column {error.colno}: {_json_problem(error)}"
                    )
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _json_list(path: Path, errors: str = "strict") -> list:
    try:
        records = json.loads(Path(path).read_text(encoding=TEXT_ENCODING, errors=errors))
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    except json.JSONDecodeError as error:
        raise WorkflowError(
            f"{path}: not valid JSON (line {error.lineno} column {error.colno}): {_json_problem(error)}"
        ) from None
    if not isinstance(records, list):
        raise WorkflowError(f"{path}: a json split file must hold a list of records, not a {type(records).__name__}")
    return records


def _csv(path: Path, on_invalid_text: str = "stop") -> Iterator[tuple[Place, Any]]:
    """Strict CSV: a line with more or fewer fields than the header is Unparseable, never shifted or padded."""
    try:
        with open(path, encoding=TEXT_ENCODING, errors="surrogateescape", newline="") as handle:
            reader = csv.reader(handle, strict=True)
            header, header_line = None, 0
            index = 0
            while True:
                line = reader.line_num + 1  # the line this record starts on
                try:
                    fields = next(reader)
                except StopIteration:
                    return
                except csv.Error as error:
                    if header is None:
                        raise WorkflowError(f"{path} line {line}: the header is not valid CSV: {error}") from None
                    yield Place(index, line), Unparseable(f"not valid CSV: line {line}: {error}")
                    index += 1
                    continue
                if not fields:  # a blank line holds no record
                    continue
                if any(_UNDECODED.search(value) for value in fields):
                    if header is None:
                        raise _not_utf8(path)
                    yield Place(index, line), _not_utf8_row(path, line, on_invalid_text)
                    index += 1
                    continue
                if header is None:
                    header, header_line = fields, line
                    twice = sorted({name for name in fields if fields.count(name) > 1})
                    if twice:
                        raise WorkflowError(
                            f"{path} line {line}: the header names column {twice} more than once, so one "
                            "column's values would be lost; rename the columns apart"
                        )
                    continue
                if len(fields) != len(header):
                    hint = ("a value that holds a comma must be in double quotes" if len(fields) > len(header)
                            else "every line needs one value per column (an empty value is still separated by a comma)")
                    yield Place(index, line), Unparseable(
                        f"not valid CSV: line {line} has {_count(len(fields), 'field')} where the header "
                        f"(line {header_line}) has {len(header)}; {hint}"
                    )
                else:
                    yield Place(index, line), dict(zip(header, fields))
                index += 1
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _parquet_rows(path: Path) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as error:  # ArrowInvalid (bad footer), OSError (bad page data)
        raise _not_parquet(path, error) from None


def _saved_split(raw_dir: Path, split: str) -> Iterator[tuple[int, Any]]:
    from datasets import Image, load_from_disk

    dataset = load_from_disk(str(raw_dir))[split]
    # Images ride along as {bytes, path}; decoding them would only cost time on the text path.
    for name, feature in dataset.features.items():
        if isinstance(feature, Image):
            dataset = dataset.cast_column(name, Image(decode=False))
    yield from enumerate(dataset)


# --- one message per unreadable file ---
def _json_problem(error: json.JSONDecodeError) -> str:
    """json's message without its dangling 'at' (the position is given separately)."""
    return re.sub(r" at$", " here", error.msg)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _not_utf8(path: Path, rows: bool = False) -> WorkflowError:
    """Where a file stops being UTF-8: the first line (1-based) holding a byte that does not decode.
    ``rows``: the file's rows are lines (JSONL, CSV), so such a row could be rejected alone instead."""
    fix = "re-save the file as UTF-8" + (
        ", or set the dataset's on_invalid_text: reject_row to reject and count such rows" if rows else "")
    offset = 0
    with open(path, "rb") as handle:  # split on b"\n" only: in UTF-8 that byte never sits inside a character
        for number, line in enumerate(handle, start=1):
            try:
                line.decode(TEXT_ENCODING if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                bad = line[error.start]
                return WorkflowError(
                    f"{path} line {number}: not UTF-8 text (byte {bad:#04x} at byte offset {offset + error.start} "
                    f"of the file); {fix}"
                )
            offset += len(line)
    return WorkflowError(f"{path}: not UTF-8 text; {fix}")


def _not_parquet(path: Path, error: Exception) -> WorkflowError:
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    reason = re.sub(r"^Could not open Parquet input source '.*?': ", "", reason)
    return WorkflowError(
        f"{path}: not a readable Parquet file ({reason}); it is truncated or corrupt: download or export it again"
    )
