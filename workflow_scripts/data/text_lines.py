"""Plain-text corpora, one example per line: a streaming reader and the normalised Arrow data.

Seed (CNM-BERT): pretraining on a 14.7M-line corpus, where every DataLoader worker received a
pickled 1.5 GB copy of the text. Here the text is never held in Python memory: :func:`iter_lines`
reads one line at a time (gzip included) and :func:`write_normalised` writes that stream as Arrow
record batches (``writer_batch_size`` rows at a time) straight into ``save_to_disk``'s layout, so
memory stays flat whatever the corpus size (benchmarks/bench_corpus.py: peak RSS at 10M lines
against 1M); the result is memory-mapped by every later reader.

Rules:
- One example per line. A line is split on ``\\n`` only (``\\r\\n``, or ``\\r\\r\\n``, loses its ``\\r``); other
  Unicode line breaks (U+2028, ``\\x0b``...) stay inside the line, as ``str.splitlines`` would
  otherwise cut a corpus line in two and shift every line number after it.
- Lines that are empty or whitespace only are skipped and counted (``blank``), never examples.
- A carriage return not followed by a line feed (classic Mac line ends, ``\\r`` alone) would make the lines it
  separates one example, where ``datasets``' text loader (``str.splitlines``) reads them apart: such a line is
  handled as an invalid one (``stop`` naming it, or ``reject_row``), never read as one merged example.
- Bytes must be UTF-8; by default (``on_invalid_text: stop``) the first invalid line fails the whole
  read, naming the file and the 1-based line (``file.txt line 17: ...``), rather than being replaced
  or skipped silently; with ``on_invalid_text: reject_row`` such a line is skipped and counted
  (``invalid_text``, the first lines named in ``invalid_text_lines``), as normalise rejects a bad row.
- A line holding a NUL byte is never an example (no text holds one: it is another encoding read as UTF-8,
  e.g. UTF-16): it stops the read, or under ``reject_row`` is counted as ``invalid_text``; normalise
  first checks every file's start for another encoding (``data/file_formats.sniff_encoding``) and names them all.
- Another encoding is read with the dataset's ``encoding:`` (a Python codec), lines split on ``\n`` only; a byte
  that codec does not decode is handled as invalid UTF-8 is (``stop`` naming the line and the encoding, or
  ``reject_row``).
- A damaged or cut-short gzip, bzip2 or zstd stream names the last line that decoded whole (found by decoding the
  file again in small steps: the buffered reader loses the lines of the read that failed).
- A UTF-8 byte-order mark at the start of a file is removed (editors on Windows write one).
- ``.gz``, ``.bz2`` and ``.zst`` files are recognised by their magic bytes, not by their name (``data/file_formats``).
- Ids are ``<file stem>-<line>`` (stem without ``.gz``/``.bz2``/``.zst`` and the text suffix; line 1-based), stable as
  long as the file is; two input files with the same stem are refused (their ids would collide).
"""
from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data import file_formats

GZIP_MAGIC = file_formats.GZIP_MAGIC
BOM = "\ufeff"
# Rows per Arrow record batch: ~2 MB of text per batch for 200-byte lines; the writer holds at most
# this many rows in memory.
WRITER_BATCH_ROWS = 10_000
NAMED_PER_COUNT = 20  # the report names the first blank lines of each file (``blank_lines``), not only their count


def _features():
    from datasets import Features, Value

    return Features({"id": Value("string"), "text": Value("string")})


@dataclass
class LineCounts:
    """What :func:`iter_lines` saw, per file: ``lines`` read, ``kept`` (yielded), ``blank`` (skipped),
    ``invalid_text`` (not UTF-8, skipped under ``reject_row``) and the first :data:`NAMED_PER_COUNT`
    line numbers (1-based) of the last two, ``blank_lines`` and ``invalid_text_lines``."""

    files: dict[str, dict] = field(default_factory=dict)

    def total(self, key: str) -> int:
        return sum(counts[key] for counts in self.files.values())

    def as_report(self) -> dict:
        return {"files": {name: dict(c) for name, c in self.files.items()},
                **{key: self.total(key) for key in ("lines", "kept", "blank", "invalid_text")}}


def file_stem(path: str | os.PathLike) -> str:
    """``corpus/part-01.txt.gz`` -> ``part-01``: the name without ``.gz`` (``.bz2``, ``.zst``) and its text suffix."""
    name = Path(path).name
    for compressed in file_formats.COMPRESSIONS:
        name = name.removesuffix(compressed)
    return Path(name).stem if "." in name else name


def check_unique_stems(paths: Iterable[str | os.PathLike]) -> None:
    seen: dict[str, str] = {}
    for path in paths:
        stem = file_stem(path)
        if stem in seen:
            raise WorkflowError(f"{path}: has the same name stem '{stem}' as {seen[stem]}, so their line ids "
                                "'<stem>-<line>' would collide; rename one of the files")
        seen[stem] = str(path)


def _open_bytes(path: Path):
    # gzip's, bz2's and zstd's line iteration reads in small steps; file_formats' 1 MiB buffer halves its cost.
    return file_formats.open_binary(path)


def _open_lines(path: Path, encoding: str | None):
    """The file's lines: bytes (decoded line by line, so one bad line can be rejected alone) for UTF-8, else
    text decoded by Python's codec for ``encoding`` (lines split on ``\\n`` only), a byte it does not decode
    surrogate-escaped, so that line alone is stopped at or rejected, named by its own number."""
    if file_formats.is_utf8(encoding):
        return _open_bytes(path)
    return io.TextIOWrapper(_open_bytes(path), encoding=file_formats.text_codec(encoding, path), errors="surrogateescape",
                            newline="\n")


class SplitProblems(WorkflowError):
    """Every split's problem (``problems``), raised once after all splits were read."""

    def __init__(self, problems: list[str]):
        text = problems[0] if len(problems) == 1 else " ".join(
            f"({number}) {problem}" for number, problem in enumerate(problems, start=1))
        super().__init__(text)
        self.problems = problems


ON_INVALID_TEXT = ("stop", "reject_row")  # the dataset's ``on_invalid_text``


# A byte the codec does not decode comes through ``surrogateescape`` as one of these code points.
_ESCAPED = re.compile("[\udc80-\udcff]")


class _Undecodable(Exception):
    """A line holding a byte the dataset's (non-UTF-8) encoding does not decode: ``found`` is (line, byte, offset)."""

    def __init__(self, found: tuple[int, int, int | None]):
        super().__init__(found)
        self.found = found


class _BareReturn(Exception):
    """A line holding a carriage return that no line feed follows: ``position`` is its character in the line."""

    def __init__(self, position: int):
        super().__init__(position)
        self.position = position


def _invalid_utf8(path: Path, number: int, error: Exception, encoding: str | None = None) -> WorkflowError:
    # No iconv suggestion: converting a UTF-8 file with one bad line from another encoding would damage the rest.
    if isinstance(error, _BareReturn):
        return WorkflowError(
            f"{path} line {number}: a carriage return (\\r) at character {error.position} of the line is not followed by "
            "a line feed, so the lines it separates would be one example (classic Mac line ends?); convert the file's "
            "line ends to \\n (e.g. tr '\\r' '\\n'), or set the dataset's on_invalid_text: reject_row to reject and "
            "count such lines")
    if isinstance(error, _Undecodable):
        found = error.found
        return WorkflowError(
            f"{file_formats.undecodable_problem(str(path), encoding, found)}, the dataset's encoding; fix or remove "
            "that line or set the dataset's encoding to the file's, or set the dataset's on_invalid_text: reject_row "
            "to reject and count such lines")
    assert isinstance(error, UnicodeDecodeError)
    return WorkflowError(
        f"{path} line {number}: invalid UTF-8 at byte {error.start} of the line ({error.reason}); fix or remove "
        "that line, or set the dataset's on_invalid_text: reject_row to reject and count such lines")


def iter_lines(paths: Sequence[str | os.PathLike], counts: LineCounts | None = None,
               on_invalid_text: str = "stop", encoding: str | None = None) -> Iterator[tuple[str, int, str]]:
    """``(file, line number (1-based), text)`` for every non-blank line of ``paths``, in order.

    Reads line by line (never a whole file); ``counts`` (optional) is filled as the stream advances.
    The text keeps everything but the line terminator (leading/trailing spaces are the tokenizer's).
    ``on_invalid_text``: ``stop`` at the first line that is not UTF-8, or ``reject_row`` (skip and count it).
    """
    if on_invalid_text not in ON_INVALID_TEXT:
        raise WorkflowError(f"on_invalid_text: unknown value {on_invalid_text!r}; known: {list(ON_INVALID_TEXT)}")
    if isinstance(paths, (str, os.PathLike)):
        raise WorkflowError(f"iter_lines takes a list of files, got the single path {paths!s}")
    if not paths:
        raise WorkflowError("no text files given")
    check_unique_stems(paths)
    for path in map(Path, paths):
        number = kept = invalid = 0
        blank_lines: list[int] = []
        invalid_lines: list[int] = []
        with _open_lines(path, encoding) as handle:
            try:
                for raw in handle:
                    number += 1
                    try:
                        if isinstance(raw, str):
                            text = raw.rstrip("\n").rstrip("\r")  # "\r\r\n" (CRLF converted twice): a line, then a blank one
                            escaped = _ESCAPED.search(text)
                            if escaped is not None:  # a byte the dataset's encoding does not decode
                                offset = escaped.start() if file_formats.is_single_byte(encoding) else None
                                raise _Undecodable((number, ord(escaped[0]) - 0xDC00, offset))
                        else:
                            text = raw.rstrip(b"\n").rstrip(b"\r").decode("utf-8")
                        if "\r" in text:  # a line end that this split (on \\n only) would not see
                            raise _BareReturn(text.index("\r"))
                        if "\x00" in text:  # another encoding read as UTF-8 (UTF-16...): never an example
                            raise UnicodeDecodeError("utf-8", raw if isinstance(raw, bytes) else b"", 0, 1,
                                                     "a NUL byte, which no text holds (another encoding, e.g. UTF-16?)")
                    except (UnicodeDecodeError, _Undecodable, _BareReturn) as error:
                        if on_invalid_text == "stop":
                            raise _invalid_utf8(path, number, error, encoding) from None
                        invalid += 1
                        if len(invalid_lines) < NAMED_PER_COUNT:
                            invalid_lines.append(number)
                        continue
                    if number == 1:
                        text = text.removeprefix(BOM)
                    if text.isspace() or not text:
                        if len(blank_lines) < NAMED_PER_COUNT:
                            blank_lines.append(number)
                        continue
                    kept += 1
                    yield str(path), number, text
            except UnicodeDecodeError as error:  # a codec's error mid-stream (UTF-16 cut inside a character)
                raise WorkflowError(f"{path} line {number + 1}: not valid {encoding} text ({error.reason}); check the "
                                    "dataset's encoding setting") from None
            except file_formats.DAMAGED as error:
                raise file_formats.damaged(path, number, error) from None
            finally:  # counted once per file, not per line (the loop runs millions of times)
                if counts is not None:
                    counts.files[str(path)] = {"lines": number, "kept": kept, "blank": number - kept - invalid,
                                               "blank_lines": blank_lines, "invalid_text": invalid,
                                               "invalid_text_lines": invalid_lines}


def _write_split(split: str, files: list[str], directory: Path, writer_batch_size: int,
                 on_invalid_text: str = "stop", encoding: str | None = None) -> LineCounts:
    """Stream one split's lines into ``directory`` laid out as ``Dataset.save_to_disk`` lays it out
    (``data/arrow_split.SplitWriter``: shards of at most ``datasets.config.MAX_SHARD_SIZE``, ``state.json``,
    ``dataset_info.json``), so ``load_from_disk`` memory-maps it like any saved set.

    Written once, ``writer_batch_size`` rows per record batch, and never read back: the earlier
    ``Dataset.from_generator`` + ``save_to_disk`` wrote every row twice, encoded it example by example
    (three quarters of the stage's time), and read the first copy back through a memory map, so the
    process's RSS grew by the whole corpus (file-backed pages).
    """
    import pyarrow as pa
    from datasets.fingerprint import generate_random_fingerprint

    from workflow_scripts.data.arrow_split import SplitWriter

    writer = SplitWriter(directory, _features(), split, generate_random_fingerprint(), batch_rows=writer_batch_size)
    counts = LineCounts()
    stems = {path: file_stem(path) for path in files}  # per file, not per line (Path() costs microseconds)
    ids: list[str] = []
    texts: list[str] = []

    def flush() -> None:
        writer.write(pa.table({"id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string())},
                              schema=writer.schema))
        ids.clear()
        texts.clear()

    try:
        for path, number, text in iter_lines(files, counts, on_invalid_text, encoding):
            ids.append(f"{stems[path]}-{number}")
            texts.append(text)
            if len(texts) >= writer_batch_size:
                flush()
        flush()
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return counts


def write_normalised(splits: Mapping[str, Sequence[str | os.PathLike]], out_dir: str | os.PathLike,
                     *, writer_batch_size: int = WRITER_BATCH_ROWS, extra_json: Mapping[str, object] | None = None,
                     on_invalid_text: str = "stop", encoding: str | None = None) -> dict:
    """Write the normalised ``DatasetDict`` (columns ``id``, ``text``) of text files, split by split.

    ``splits`` maps a canonical split name (``train``, ``test``, ``validation``) to its files.
    Returns the report ``{split: {files: {file: {lines, kept, blank}}, lines, kept, blank}}``.
    ``extra_json`` (file name -> value) is written inside the output in the same atomic step (the
    normalise stage's ``task_meta.json``), so the data never appears without it.
    The output appears whole or not at all (``atomic_output``): it is written straight into the
    temporary directory that is renamed into place (never into the shared ``~/.cache``).
    Memory stays flat whatever the corpus size: one record batch of ``writer_batch_size`` rows.
    """
    from datasets import config

    from workflow_scripts.core.atomic_output import atomic_path

    if not splits:  # an evaluation-only corpus has no train split, only held-out ones
        raise WorkflowError("text corpus: no split given")
    check_unique_stems([p for files in splits.values() for p in files])
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    problems: list[str] = []
    with atomic_path(out_dir, directory=True) as out:
        for split, files in splits.items():  # every split is read, so one run names every failing one
            files = [str(p) for p in files]
            try:
                counts = _write_split(split, files, out / split, writer_batch_size, on_invalid_text, encoding)
            except WorkflowError as error:
                problems.append(str(error))
                continue
            counts.files = {name: counts.files[name] for name in files}  # input order
            report[split] = counts.as_report()
            if report[split]["kept"] == 0:
                problems.append(f"text corpus split '{split}': no non-blank line in {files}")
        if problems:
            raise SplitProblems(problems)
        (out / config.DATASETDICT_JSON_FILENAME).write_text(json.dumps({"splits": list(splits)}))
        for name, value in (extra_json or {}).items():
            Path(out, name).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    return report


# Raw files of a split ------------------------------------------------------------------------------
TEXT_FORMAT = "text"  # the dataset ``format`` of plain-text corpora
SPLIT_SUFFIXES = file_formats.suffixes(TEXT_FORMAT)  # ``<split>.txt``, or compressed ``<split>.txt.gz`` / ``.bz2`` / ``.zst``


def split_file(directory: str | os.PathLike, split: str) -> Path:
    """The one file of ``split`` in ``directory``: ``<split>.txt`` or ``<split>.txt.gz`` (both is
    ambiguous, so refused rather than one picked silently)."""
    directory = Path(directory)
    found = [directory / f"{split}{suffix}" for suffix in SPLIT_SUFFIXES if (directory / f"{split}{suffix}").is_file()]
    if not found:
        present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        raise WorkflowError(f"{directory / (split + '.txt')}: missing; split '{split}' needs <split>.txt or "
                            f"<split>.txt.gz / .txt.bz2 / .txt.zst (the directory holds {present})")
    if len(found) > 1:
        raise WorkflowError(f"{directory}: both {found[0].name} and {found[1].name} exist for split '{split}'; keep one")
    return found[0]


def split_files(directory: str | os.PathLike, split: str) -> list[Path]:
    """A split's files in read order: its one file, or the text files of folder ``<split>/`` (a split given as
    several files, ``source.files``), sorted by name."""
    folder = Path(directory) / split
    if not folder.is_dir():
        return [split_file(directory, split)]
    return sorted((p for p in folder.iterdir() if p.is_file() and p.name.endswith(SPLIT_SUFFIXES)), key=lambda p: p.name)


def available_splits(directory: str | os.PathLike) -> list[str]:
    names = [p.name for p in Path(directory).iterdir() if p.is_file()]
    folders = [p.name for p in Path(directory).iterdir() if p.is_dir()]
    return sorted({name[: -len(suffix)] for name in names for suffix in SPLIT_SUFFIXES if name.endswith(suffix)}
                  | set(folders))


def count_lines(path: str | os.PathLike) -> int:
    """Non-blank lines of one file, read as a stream (download's count: a line that is not UTF-8 is counted
    here and judged by normalise, which knows the dataset's on_invalid_text)."""
    counts = LineCounts()
    for _ in iter_lines([path], counts, on_invalid_text="reject_row"):
        pass
    return counts.total("kept") + counts.total("invalid_text")
