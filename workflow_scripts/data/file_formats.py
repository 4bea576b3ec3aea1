"""The file formats a local or url source may be in, their file-name endings, compression and text encoding.

One source of truth for which files make a split (``split_names``, ``split_layouts``, ``raw_records``,
``text_lines`` and ``download`` ask here):

- ``jsonl``, ``csv``, ``text`` (one example per line) and ``penman`` (AMR graphs in PENMAN text, blank-line
  separated blocks) are line-based: each may also be compressed with gzip (``.gz``) or bzip2 (``.bz2``),
  read as a stream by Python's own ``gzip`` / ``bz2``. Line numbers in messages count lines of the
  decompressed text. A compressed file is recognised by its magic bytes (a ``.gz`` name alone proves nothing).
  zstd is not read: no zstd library is a dependency of the workflow (recompress with gzip).
- ``json`` (one list) and ``parquet`` (compressed inside) are read whole and never compressed outside.

Encodings (``datasets.<name>.encoding``): text is UTF-8 unless the dataset names another Python codec. A file
that starts with a UTF-16/32 byte-order mark, or whose first bytes are NUL-interleaved (UTF-16 without a
mark), is not UTF-8: :func:`sniff_encoding` names the encoding it looks like, so normalise can stop naming
every such file and the setting that reads them, instead of failing on the first line as "not UTF-8".
"""
from __future__ import annotations

import bz2
import codecs
import gzip
import io
import zlib
from pathlib import Path
from typing import IO

from workflow_scripts.core.errors import WorkflowError

LINE_FORMATS = ("jsonl", "csv", "text", "penman")
# format -> the endings of an uncompressed split file
PLAIN_SUFFIXES = {"jsonl": (".jsonl",), "json": (".json",), "csv": (".csv",), "parquet": (".parquet",),
                  "text": (".txt",), "penman": (".txt", ".amr", ".penman")}
COMPRESSIONS = (".gz", ".bz2")
GZIP_MAGIC = b"\x1f\x8b"
# bzip2: 'BZh', the block size digit, then the first block's magic (pi) or the end-of-stream magic (sqrt pi)
_BZIP2_BLOCKS = (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90")
SNIFF_BYTES = 4096


def suffixes(fmt: str) -> tuple[str, ...]:
    """Every ending of a split file in format ``fmt``, plain first, then compressed (line formats only)."""
    plain = PLAIN_SUFFIXES.get(fmt, (f".{fmt}",))
    if fmt not in LINE_FORMATS:
        return plain
    return plain + tuple(suffix + compression for suffix in plain for compression in COMPRESSIONS)


def strip_suffix(name: str, fmt: str) -> str | None:
    """``name`` without its ending of format ``fmt`` (the longest that fits), or None when it has none."""
    fitting = [suffix for suffix in suffixes(fmt) if name.endswith(suffix) and len(name) > len(suffix)]
    return name[: -len(max(fitting, key=len))] if fitting else None


def compression(path: str | Path) -> str | None:
    """``gzip``, ``bz2`` or None, from the file's first bytes."""
    with open(path, "rb") as probe:
        head = probe.read(10)
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in _BZIP2_BLOCKS:
        return "bz2"
    return None


def open_binary(path: str | Path) -> IO[bytes]:
    """The file's bytes, decompressed when it is gzip or bzip2 (buffered: their line iteration reads small steps)."""
    try:
        kind = compression(path)
        if kind == "gzip":
            return io.BufferedReader(gzip.open(path, "rb"), 1 << 20)
        if kind == "bz2":
            return io.BufferedReader(bz2.open(path, "rb"), 1 << 20)
        return open(path, "rb")
    except FileNotFoundError:
        raise WorkflowError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WorkflowError(f"{path}: is a directory, not a file") from None


# What a damaged or cut-short compressed stream raises while it is read.
DAMAGED = (EOFError, gzip.BadGzipFile, zlib.error, OSError)


def damaged(path: str | Path, line: int, error: Exception) -> WorkflowError:
    """One message for a compressed stream that breaks after ``line`` lines."""
    kind = compression(path) or "compressed"
    return WorkflowError(f"{path}: the {kind} stream is damaged or cut short after line {line}, the last line read "
                         f"whole ({error}); download or compress the file again")


def open_text(path: str | Path, encoding: str | None = None, errors: str = "strict", newline: str | None = None) -> IO[str]:
    """The file as text in ``encoding`` (UTF-8, a byte-order mark skipped, when None), decompressed as needed."""
    codec = "utf-8-sig" if encoding is None or codecs.lookup(encoding).name == "utf-8" else encoding
    return io.TextIOWrapper(open_binary(path), encoding=codec, errors=errors, newline=newline)


def check_encoding(name: str | None) -> str | None:
    """``name`` if Python's codecs know it as a text encoding (else WorkflowError): the ``encoding`` setting's check."""
    if name is None:
        return None
    try:
        text = getattr(codecs.lookup(name), "_is_text_encoding", True)  # False for rot13, base64... (bytes codecs)
    except LookupError:
        text = False
    if not text:
        raise WorkflowError(f"{name!r} is not a text encoding Python knows (e.g. utf-8, utf-16, utf-16-le, cp1252, "
                            "latin-1)")
    return name


_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF16_LE, "utf-16"),
         (codecs.BOM_UTF16_BE, "utf-16"))


def sniff_encoding(path: str | Path) -> str | None:
    """The encoding the start of ``path`` (decompressed) shows when it is not UTF-8 text: ``utf-16`` /
    ``utf-32`` for a byte-order mark, ``utf-16-le`` / ``utf-16-be`` for NUL-interleaved text without one;
    None for anything else (UTF-8, or bytes this cannot tell)."""
    try:
        with open_binary(path) as handle:
            head = handle.read(SNIFF_BYTES)
    except DAMAGED:
        return None  # the reader names the damage
    for bom, name in _BOMS:
        if head.startswith(bom):
            return name
    if len(head) >= 4 and head.count(b"\x00") * 4 >= len(head):  # a quarter NUL: no UTF-8 text looks so
        even, odd = head[0::2].count(b"\x00"), head[1::2].count(b"\x00")
        return "utf-16-be" if even > odd else "utf-16-le"
    return None


def encoding_problem(files: list[str], found: dict[str, str], key: str) -> str:
    """The one message naming every file that is not in the dataset's encoding, and the setting that reads them."""
    kinds = sorted(set(found.values()))
    listed = ", ".join(f"{file} ({found[file]})" for file in files if file in found)
    fix = (f"set {key}.encoding: {kinds[0]}" if len(kinds) == 1 else
           f"re-save them in one encoding and set {key}.encoding to it")
    count = f"{len(found)} files of the dataset are" if len(found) > 1 else "1 file of the dataset is"
    return (f"{count} not UTF-8 text but {' / '.join(kinds)} (a byte-order mark or "
            f"NUL bytes between the characters): {listed}; {fix} (decoded with Python's codecs), or re-save them as UTF-8")
