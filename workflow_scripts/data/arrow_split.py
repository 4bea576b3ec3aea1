"""One split of a saved ``DatasetDict``, read and written as a stream of Arrow record batches.

``Dataset.save_to_disk``'s layout (``data-NNNNN-of-NNNNN.arrow`` IPC streams of at most
``datasets.config.MAX_SHARD_SIZE``, ``state.json``, ``dataset_info.json``), so ``load_from_disk``
memory-maps what :class:`SplitWriter` writes like any saved set. Streams are read with ``read()``
into a buffer freed batch by batch (:func:`read_batches`), not memory-mapped: a memory map leaves
every page it touched mapped, so a process that reads a 10M-line corpus through one grows by the
corpus (file-backed pages, counted in its RSS; benchmarks/bench_corpus.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from workflow_scripts.core.errors import WorkflowError

if TYPE_CHECKING:
    import pyarrow as pa

# A record batch of the written data holds the output of whole input chunks until it reaches this
# many rows or bytes. Large batches: a DataLoader worker forked from a process that opened the
# memory-mapped table copies per-batch metadata it touches, so its memory grows with the batch count
# (1,000-row batches: 11.9 -> 16.9 MiB per worker from a 1M- to a 10M-line corpus; 32,768 rows: flat).
BATCH_ROWS = 32_768
BATCH_BYTES = 64 << 20


def data_files(split_dir: str | os.PathLike) -> list[Path]:
    """The Arrow files of one saved split, in order (``state.json``'s ``_data_files``)."""
    split_dir = Path(split_dir)
    state = split_dir / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except FileNotFoundError:
        raise WorkflowError(f"{state}: missing; {split_dir} is not a split saved by save_to_disk") from None
    except (ValueError, KeyError, TypeError) as error:
        raise WorkflowError(f"{state}: unreadable ({error}); rerun the stage that wrote {split_dir}") from None
    return [split_dir / name for name in names]


def read_batches(files: Sequence[str | os.PathLike], columns: Sequence[str] | None = None) -> Iterator["pa.RecordBatch"]:
    """The record batches of Arrow IPC stream files, read (not memory-mapped) one at a time."""
    import pyarrow as pa

    for path in files:
        with pa.OSFile(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                yield batch.select(list(columns)) if columns is not None else batch


def row_chunks(batches: Iterable["pa.RecordBatch"], size: int, start: int = 0,
               stop: int | None = None) -> Iterator["pa.Table"]:
    """Tables of exactly ``size`` rows (the last may be shorter) covering rows ``[start, stop)`` of the
    stream: chunk k begins at row ``start + k * size`` whatever the record batches' sizes."""
    import pyarrow as pa

    position, pending, pending_rows = 0, [], 0
    for batch in batches:
        end = position + batch.num_rows
        if end <= start:  # wholly before the range
            position = end
            continue
        if stop is not None and position >= stop:
            break
        low, high = max(start - position, 0), batch.num_rows if stop is None else min(stop - position, batch.num_rows)
        position = end
        piece = batch.slice(low, high - low)
        while piece.num_rows:
            take = min(size - pending_rows, piece.num_rows)
            pending.append(piece.slice(0, take))
            pending_rows += take
            piece = piece.slice(take)
            if pending_rows == size:
                yield pa.Table.from_batches(pending)
                pending, pending_rows = [], 0
    if pending_rows:
        yield pa.Table.from_batches(pending)


class SplitWriter:
    """Write one split in ``save_to_disk``'s layout from a stream of tables.

    Each :meth:`write` is one unit (e.g. the output of one tokenised input chunk); units are joined
    into a record batch until it holds ``batch_rows`` rows or ``batch_bytes`` bytes, and a shard file
    is closed once it holds ``datasets.config.MAX_SHARD_SIZE``. The files therefore depend only on
    the sequence of units written (and their sizes), never on how the producer was split up. ``fingerprint`` goes to
    ``state.json`` (a content-derived one keeps reruns byte-identical)."""

    def __init__(self, directory: str | os.PathLike, features, split: str, fingerprint: str,
                 batch_rows: int | None = None, batch_bytes: int | None = None):
        from datasets import config
        from datasets.utils.py_utils import convert_file_size_to_int

        self.directory, self.features, self.split, self.fingerprint = Path(directory), features, split, fingerprint
        self.schema = features.arrow_schema
        self.batch_rows = BATCH_ROWS if batch_rows is None else batch_rows
        self.batch_bytes = BATCH_BYTES if batch_bytes is None else batch_bytes
        self.shard_bytes = convert_file_size_to_int(config.MAX_SHARD_SIZE)
        self.directory.mkdir(parents=True)
        self.parts: list[Path] = []
        self.rows = self.bytes = 0
        self._pending: list = []
        self._pending_rows = self._pending_bytes = 0
        self._sink = self._writer = None
        self._shard_written = 0

    def write(self, table: "pa.Table", nbytes: int | None = None) -> None:
        """Add one unit; ``nbytes`` is its size as its producer measured it (``table.nbytes`` there):
        the same rows read back from a file can differ in buffer layout, and so in ``nbytes``."""
        if table.num_rows == 0:
            return
        if table.schema != self.schema:
            table = table.select(self.schema.names).cast(self.schema)
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self._pending_bytes += table.nbytes if nbytes is None else nbytes
        if self._pending_rows >= self.batch_rows or self._pending_bytes >= self.batch_bytes:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if not self._pending_rows:
            return
        batch = pa.concat_tables(self._pending).combine_chunks().to_batches(max_chunksize=None)
        if self._writer is None:
            self.parts.append(self.directory / f"part-{len(self.parts)}.arrow")
            self._sink = pa.OSFile(str(self.parts[-1]), "wb")
            self._writer = pa.ipc.new_stream(self._sink, self.schema)
            self._shard_written = 0
        for record_batch in batch:  # one, unless a column outgrew 32-bit offsets
            self._writer.write_batch(record_batch)
        self.rows += self._pending_rows
        self.bytes += self._pending_bytes
        self._shard_written += self._pending_bytes
        self._pending, self._pending_rows, self._pending_bytes = [], 0, 0
        if self._shard_written >= self.shard_bytes:  # the next batch starts a new shard, as save_to_disk shards
            self._close_shard()

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = self._sink = None

    def abort(self) -> None:
        self._close_shard()

    def close(self) -> int:
        """Write the last batch, ``state.json`` and ``dataset_info.json``; returns the row count."""
        import pyarrow as pa
        from datasets import DatasetInfo, SplitDict, SplitInfo, config

        self._flush()
        if not self.parts:  # no row at all: one empty shard, as save_to_disk writes for an empty set
            self.parts.append(self.directory / "part-0.arrow")
            with pa.OSFile(str(self.parts[-1]), "wb") as sink, pa.ipc.new_stream(sink, self.schema):
                pass
        self._close_shard()
        names = [f"data-{k:05d}-of-{len(self.parts):05d}.arrow" for k in range(len(self.parts))]
        for part, name in zip(self.parts, names):
            part.rename(self.directory / name)
        info = DatasetInfo(features=self.features, splits=SplitDict(), dataset_size=self.bytes)
        info.splits.add(SplitInfo(name=self.split, num_bytes=self.bytes, num_examples=self.rows))
        info.write_to_directory(str(self.directory), pretty_print=True)
        state = {"_data_files": [{"filename": name} for name in names], "_fingerprint": self.fingerprint,
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
                 "_split": self.split}
        (self.directory / config.DATASET_STATE_JSON_FILENAME).write_text(json.dumps(state, indent=2, sort_keys=True))
        return self.rows


def write_dataset_dict(directory: str | os.PathLike, splits: Sequence[str]) -> None:
    from datasets import config

    Path(directory, config.DATASETDICT_JSON_FILENAME).write_text(json.dumps({"splits": list(splits)}))
