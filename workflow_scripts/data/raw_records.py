"""Reading the raw records that ``download`` stored, one split at a time, exactly as they are.

Raw layouts (see docs/architecture.md): a hub dataset is a ``DatasetDict.save_to_disk`` directory;
url and local sources are files named ``<source split>.<format>`` (jsonl, json, csv or parquet).
Records are yielded with their 0-based row index and never repaired: a line that is not JSON comes
back as :class:`Unparseable`, so normalisation can reject it with a reason.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from workflow_scripts.core.errors import WorkflowError

FORMATS = ("jsonl", "json", "csv", "parquet")


@dataclass(frozen=True)
class Unparseable:
    """A raw row that could not be decoded at all (e.g. a JSONL line that is not JSON)."""

    error: str


def is_saved_dataset(raw_dir: Path) -> bool:
    return (Path(raw_dir) / "dataset_dict.json").exists()


def available_splits(raw_dir: Path, fmt: str) -> list[str]:
    raw_dir = Path(raw_dir)
    if is_saved_dataset(raw_dir):
        return json.loads((raw_dir / "dataset_dict.json").read_text())["splits"]
    return sorted(path.name[: -len(fmt) - 1] for path in raw_dir.glob(f"*.{fmt}"))


def split_location(raw_dir: Path, split: str, fmt: str) -> Path:
    """The file (or saved split directory) holding a source split."""
    raw_dir = Path(raw_dir)
    return raw_dir / split if is_saved_dataset(raw_dir) else raw_dir / f"{split}.{fmt}"


def iter_records(raw_dir: Path, split: str, fmt: str) -> Iterator[tuple[int, Any]]:
    """(row index, record) for every row of one source split."""
    raw_dir = Path(raw_dir)
    if split not in available_splits(raw_dir, fmt):
        raise WorkflowError(
            f"{raw_dir}: no split '{split}' (found {available_splits(raw_dir, fmt)}); "
            "check the dataset's splits mapping in the config"
        )
    if is_saved_dataset(raw_dir):
        yield from _saved_split(raw_dir, split)
    else:
        yield from read_file(split_location(raw_dir, split, fmt), fmt)


def read_file(path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as handle:
            for row, line in enumerate(handle):
                if not line.strip():
                    continue
                try:
                    yield row, json.loads(line)
                except json.JSONDecodeError as error:
                    yield row, Unparseable(f"not valid JSON: {error.msg}")
    elif fmt == "json":
        records = _json_list(path)
        yield from enumerate(records)
    elif fmt == "csv":
        with open(path, encoding="utf-8", newline="") as handle:
            yield from enumerate(csv.DictReader(handle))
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(path).to_pylist())
    else:
        raise WorkflowError(f"{path}: unknown format '{fmt}'; known: {list(FORMATS)}")


def count_rows(path: Path, fmt: str) -> int:
    """Rows in a raw file, without judging them (for the download manifest)."""
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as handle:
            return sum(1 for line in handle if line.strip())
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return sum(1 for _ in read_file(path, fmt))


def _json_list(path: Path) -> list:
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise WorkflowError(f"{path}: not valid JSON (line {error.lineno}): {error.msg}") from None
    if not isinstance(records, list):
        raise WorkflowError(f"{path}: a json split file must hold a list of records, not a {type(records).__name__}")
    return records


def _saved_split(raw_dir: Path, split: str) -> Iterator[tuple[int, Any]]:
    from datasets import Image, load_from_disk

    dataset = load_from_disk(str(raw_dir))[split]
    # Images ride along as {bytes, path}; decoding them would only cost time on the text path.
    for name, feature in dataset.features.items():
        if isinstance(feature, Image):
            dataset = dataset.cast_column(name, Image(decode=False))
    yield from enumerate(dataset)
