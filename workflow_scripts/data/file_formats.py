"""The file formats a local or url source may be in, their file-name endings, compression and text encoding.

One source of truth for which files make a split (``split_names``, ``split_layouts``, ``raw_records``,
``text_lines`` and ``download`` ask here):

- ``jsonl``, ``csv``, ``tsv`` (tab-separated, quoting off, as GLUE ships it), ``text`` (one example per line) and
  ``penman`` (AMR graphs in PENMAN text, blank-line separated blocks) are line-based: each may also be compressed
  with gzip (``.gz``), bzip2 (``.bz2``) or zstd (``.zst``), read as a stream by Python's own ``gzip`` / ``bz2``
  and by the ``zstandard`` library (as ``datasets`` reads zstd). A gzip file of several members, a bzip2 file of
  several streams and a zstd file of several frames are read whole. Line numbers in messages count lines of the
  decompressed text. A compressed file is recognised by its magic bytes (a ``.gz`` name alone proves nothing).
  A damaged or cut-short stream is named with the lines that decoded whole before it (:func:`lines_before_damage`).
- ``json`` (one list) and ``parquet`` (compressed inside) are read whole and never compressed outside.

Encodings (``datasets.<name>.encoding``): text is UTF-8 unless the dataset names another Python codec. A file
that starts with a UTF-16/32 byte-order mark, or whose first bytes are NUL-interleaved (UTF-16 without a
mark), is not UTF-8: :func:`sniff_encoding` names the encoding it looks like, so normalise can stop naming
every such file and the setting that reads them, instead of failing on the first line as "not UTF-8". The
converse: a file declared in a single-byte encoding (latin-1, cp1252...) that is valid UTF-8 holding multi-byte
characters would decode without an error into mojibake (``QuÃ©``): :func:`contradicted_encoding` finds its first
such line, so normalise stops with both readings of it. An explicit ``utf-8`` reads a byte-order mark as the
default does (Python's ``utf-8-sig``): :func:`text_codec`.
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

LINE_FORMATS = ("jsonl", "csv", "tsv", "text", "penman")
BINARY_FORMATS = ("parquet",)  # text inside is UTF-8 by the format's own definition: ``encoding:`` does nothing there
# format -> the endings of an uncompressed split file
PLAIN_SUFFIXES = {"jsonl": (".jsonl",), "json": (".json",), "csv": (".csv",), "tsv": (".tsv",), "parquet": (".parquet",),
                  "text": (".txt",), "penman": (".txt", ".amr", ".penman")}
COMPRESSIONS = (".gz", ".bz2", ".zst")
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
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


def _is_skippable_frame(head: bytes) -> bool:
    """A zstd skippable frame (magic 0x184D2A50..0x184D2A5F, little-endian) opens the file: pzstd writes one before
    every frame, and zstandard reads such a file as zstd; read as plain bytes its size field's NUL bytes stopped it."""
    return len(head) >= 4 and head[1:4] == b"\x2a\x4d\x18" and head[0] & 0xF0 == 0x50


def compression(path: str | Path) -> str | None:
    """``gzip``, ``bz2``, ``zstd`` or None, from the file's first bytes."""
    with open(path, "rb") as probe:
        head = probe.read(10)
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] in _BZIP2_BLOCKS:
        return "bz2"
    if head[:4] == ZSTD_MAGIC or _is_skippable_frame(head):
        return "zstd"
    return None


class ZstdCutShort(OSError):
    """A zstd stream that ends inside a frame."""


class _ZstdReader(io.RawIOBase):
    """A zstd file's bytes, every frame in turn, through ``zstandard``'s decompressor objects.

    Not ``ZstdDecompressor().stream_reader``: it returns what it has and then EOF when the file ends inside a
    frame (a cut-short download reads as a shorter file, at exit 0). Here the end of the input inside a frame
    raises :class:`ZstdCutShort`, as Python's gzip and bz2 raise EOFError."""

    def __init__(self, path: str | Path):
        import zstandard

        self._zstd = zstandard
        self._file = open(path, "rb")
        self._decoder = zstandard.ZstdDecompressor().decompressobj()
        self._started = False  # the current frame has been fed bytes
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._pending:
            block = self._file.read(1 << 16)
            if not block:
                if self._started and not self._decoder.eof:
                    raise ZstdCutShort("the input ends inside a zstd frame")
                return 0
            while block:
                if self._decoder.eof:  # the next frame of a multi-frame file
                    self._decoder = self._zstd.ZstdDecompressor().decompressobj()
                self._started = True
                self._pending += self._decoder.decompress(block)
                block = self._decoder.unused_data if self._decoder.eof else b""
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def close(self) -> None:
        self._file.close()
        super().close()


def open_binary(path: str | Path) -> IO[bytes]:
    """The file's bytes, decompressed when it is gzip, bzip2 or zstd (buffered: their line iteration reads small
    steps)."""
    try:
        kind = compression(path)
        if kind == "gzip":
            return io.BufferedReader(gzip.open(path, "rb"), 1 << 20)
        if kind == "bz2":
            return io.BufferedReader(bz2.open(path, "rb"), 1 << 20)
        if kind == "zstd":
            return io.BufferedReader(_ZstdReader(path), 1 << 20)
        return open(path, "rb")
    except FileNotFoundError:
        raise WorkflowError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise WorkflowError(f"{path}: is a directory, not a file") from None


def _zstd_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


# What a damaged or cut-short compressed stream raises while it is read (ZstdCutShort is an OSError).
DAMAGED = (EOFError, gzip.BadGzipFile, zlib.error, OSError, _zstd_error())


def _decoder(kind: str):
    if kind == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if kind == "bz2":
        return bz2.BZ2Decompressor()
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


def lines_before_damage(path: str | Path) -> int:
    """Lines that decode whole from a damaged compressed file, decoded again in small steps (error path only:
    the buffered reader loses the lines of the read that failed, so the reader's own count is too low)."""
    kind = compression(path)
    if kind is None:
        return 0
    lines, decoder = 0, _decoder(kind)
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 14), b""):
                while block:
                    lines += decoder.decompress(block).count(b"\n")
                    block = decoder.unused_data if decoder.eof else b""
                    if decoder.eof:  # the next member / stream / frame
                        decoder = _decoder(kind)
    except (*DAMAGED, ValueError):
        pass
    return lines


def damaged(path: str | Path, line: int, error: Exception, shown: str | Path | None = None) -> WorkflowError:
    """One message for a compressed stream that breaks after ``line`` lines (or the lines that decode whole, when
    more: ``line`` may lag behind the buffered reader). ``shown``: the name to give the file (else ``path``)."""
    kind = compression(path) or "compressed"
    whole = max(line, lines_before_damage(path))
    return WorkflowError(f"{shown or path}: the {kind} stream is damaged or cut short after line {whole}, the last line "
                         f"read whole ({error}); download or compress the file again")


def is_utf8(encoding: str | None) -> bool:
    """Whether the ``encoding`` setting reads UTF-8 (not set, or any spelling of utf-8)."""
    return encoding is None or codecs.lookup(encoding).name == "utf-8"


# An endian-specific codec keeps a byte-order mark as the character U+FEFF; its marked sibling skips it.
_MARKED = {"utf-16-le": ("utf-16", codecs.BOM_UTF16_LE), "utf-16-be": ("utf-16", codecs.BOM_UTF16_BE),
           "utf-32-le": ("utf-32", codecs.BOM_UTF32_LE), "utf-32-be": ("utf-32", codecs.BOM_UTF32_BE)}


def text_codec(encoding: str | None, path: str | Path | None = None) -> str:
    """The codec that reads ``encoding``: UTF-8, explicit or not, skips a byte-order mark (``utf-8-sig``, as Excel
    writes one and as the default has always read it), so ``encoding: utf-8`` reads what leaving it out reads.
    Likewise a file (``path``) declared ``utf-16-le`` (-be, utf-32-...) that starts with that byte order's mark is
    read by the codec that skips it (``utf-16``): a mark is never data (pandas drops it too), where ``utf-16-le``
    alone would make it the first character of the first row (a header ``\ufeffq``, a JSON line that does not parse)."""
    if is_utf8(encoding):
        return "utf-8-sig"
    marked = _MARKED.get(codecs.lookup(encoding).name)
    if marked and path is not None:
        try:
            with open_binary(path) as handle:
                head = handle.read(4)
        except (*DAMAGED, WorkflowError):
            return encoding
        if head.startswith(marked[1]) and not (marked[0] == "utf-16" and head.startswith(codecs.BOM_UTF32_LE)):
            return marked[0]
    return encoding


def open_text(path: str | Path, encoding: str | None = None, errors: str = "strict", newline: str | None = None) -> IO[str]:
    """The file as text in ``encoding`` (UTF-8, a byte-order mark skipped, when None), decompressed as needed."""
    return io.TextIOWrapper(open_binary(path), encoding=text_codec(encoding, path), errors=errors, newline=newline)


def is_single_byte(encoding: str) -> bool:
    """Whether every byte alone is one character of ``encoding`` (latin-1, cp1252, iso8859-*...): then a file in
    another encoding never fails to decode, it only decodes wrong. Asked of the codec's incremental decoder: a
    multi-byte codec (UTF-8, UTF-16, Shift-JIS...) holds back a lead byte until its sequence is complete."""
    if is_utf8(encoding):
        return False
    for byte in range(256):
        decoder = codecs.getincrementaldecoder(encoding)(errors="replace")
        if len(decoder.decode(bytes([byte]), final=False)) != 1:
            return False
    return True


def contradicted_encoding(path: str | Path, encoding: str | None) -> tuple[int, str, str] | None:
    """(line, the line read as ``encoding``, the line read as UTF-8) for the first line holding a multi-byte UTF-8
    character, when ``encoding`` is single-byte and the whole file is valid UTF-8; else None. Such a file decodes
    without an error in the declared encoding, every accented letter turned into two (mojibake)."""
    if encoding is None or not is_single_byte(encoding):
        return None
    first: tuple[int, bytes] | None = None
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with open_binary(path) as handle:
            for number, line in enumerate(handle, start=1):
                decoder.decode(line)  # raises at the first byte that is not UTF-8: then the declaration may be right
                if first is None and not line.isascii():
                    first = (number, line)
            decoder.decode(b"", final=True)
    except (UnicodeDecodeError, *DAMAGED):
        return None  # not UTF-8 (or damaged: the reader names the damage)
    if first is None:
        return None
    number, line = first
    text = line.rstrip(b"\r\n")
    # The declared reading keeps a UTF-8 byte-order mark (a single-byte codec reads it as three letters, 'ï»¿', the
    # start of the first column's name): for an ASCII file with a BOM it is the only difference the message can show.
    utf8 = text.removeprefix(codecs.BOM_UTF8) if number == 1 else text
    return number, text.decode(encoding, errors="replace"), utf8.decode("utf-8")


def contradiction_problem(file: str, key: str, encoding: str, found: tuple[int, str, str]) -> str:
    """The message for a file that :func:`contradicted_encoding` found."""
    number, declared, utf8 = found
    return (f"{file} line {number}: the dataset declares encoding: {encoding}, but the file is valid UTF-8 with "
            f"multi-byte characters: read as {encoding} the line is {declared[:60]!r}, read as UTF-8 it is "
            f"{utf8[:60]!r}; remove {key}.encoding (UTF-8 is the default) if the UTF-8 reading is right")


def undecodable_line(path: str | Path, encoding: str | None) -> tuple[int, int, int | None] | None:
    """(line, byte, offset of that byte in the line where known) for the first line holding a byte that ``encoding``
    does not decode (surrogate-escaped by Python's codec), or None. Lines are split on \\n, as the readers split them."""
    with open_text(path, encoding, errors="surrogateescape", newline="\n") as handle:
        for number, line in enumerate(handle, start=1):
            for position, char in enumerate(line):
                if "\udc80" <= char <= "\udcff":
                    return number, ord(char) - 0xDC00, _byte_offset(line[:position], encoding)
    return None


def _byte_offset(head: str, encoding: str | None) -> int | None:
    """How many bytes ``head`` (the start of a line) took in the file, where the codec says it without a doubt."""
    if is_utf8(encoding):
        return len(head.encode("utf-8", errors="surrogateescape"))
    return len(head) if is_single_byte(encoding) else None


def undecodable_problem(file: str, encoding: str | None, found: tuple[int, int, int | None]) -> str:
    """``file line N: not <encoding> text (byte 0x.., ...)``: the start of the message for :func:`undecodable_line`."""
    number, byte, offset = found
    name = "UTF-8" if is_utf8(encoding) else encoding
    where = f" at byte {offset} of the line" if offset is not None else ""
    what = f", which {name} does not define," if is_single_byte(encoding or "utf-8") else " that does not decode"
    return f"{file} line {number}: not {name} text (byte {byte:#04x}{what}{where})"


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
