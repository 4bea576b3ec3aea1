"""Reading the raw records that ``download`` stored, one split at a time, exactly as they are.

Raw layouts (see docs/architecture.md): a hub dataset is a ``DatasetDict.save_to_disk`` directory;
url and local sources are files named ``<source split>.<format>`` (jsonl, json, csv, tsv, parquet, or penman: AMR
graphs in PENMAN text; the line formats also gzip-, bzip2- or zstd-compressed, ``data/file_formats``), or a
folder ``<source split>/`` (``data/split_layouts``): an image folder (``metadata.<format>`` with its images)
or a split's several files, read in file-name order with one running row index (:func:`split_files`).
Records are yielded with their 0-based row index and never repaired: a row that cannot be decoded
(a JSONL line that is not JSON, a CSV line whose field count differs from the header's) comes back
as :class:`Unparseable`, so normalisation can reject it with a reason. A file that cannot be read at
all (not UTF-8 text, a corrupt Parquet file, a CSV header naming a column twice) raises one
WorkflowError naming it.

Where a row is, as the user's editor shows it: :func:`iter_placed_records` gives each record's
:class:`Place` (the 1-based line of a JSONL or CSV file, a CSV's header being line 1; the row index
of a JSON list, Parquet file or saved dataset; a PENMAN block's number and first line).

PENMAN text (``format: penman``, the AMR releases' and shared tasks' layout): blocks separated by blank lines,
each ``# ::id ...``, ``# ::snt ...`` (any ``# ::key value`` metadata, several on a line as LDC writes them)
and an indented graph over several lines; a block of comments only (a file's header) holds no record. A
block's record is its metadata (``id``, ``snt``, ...) plus ``graph``: the graph on one line, re-formatted by the
``penman`` library from its parse (so the answer is the same whether the file indents it or not). A graph that
does not parse (unbalanced brackets...) or a block without a graph is Unparseable, named by block and line.
"""
from __future__ import annotations

import codecs
import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data import file_formats

FORMATS = ("jsonl", "json", "csv", "tsv", "parquet", "penman")
# Text files are UTF-8; a byte order mark (Excel writes one) is skipped, never read as data.
TEXT_ENCODING = "utf-8-sig"
# The delimited formats' csv dialects: CSV as Python's csv reads it (double quotes quote a value); TSV with quoting
# off (csv.QUOTE_NONE), as GLUE's loaders and pandas' read_csv(sep="\t", quoting=3) read it: a lone " in a
# sentence is a character, never the start of a quoted value running on over the next lines.
DELIMITED: dict[str, dict[str, Any]] = {"csv": {}, "tsv": {"delimiter": "\t", "quoting": csv.QUOTE_NONE}}
# The csv module refuses a value over 128 KiB ("field larger than field limit"), a limit of the module, not of the
# format: pandas and datasets read a long document's cell whole. The limit is process-wide; this module reads files
# only, so it lifts it when it reads a delimited file (2**31 - 1: the largest every platform's C long holds).
_FIELD_LIMIT = 2**31 - 1


class _Lines:
    """The file's lines as the csv reader takes them, keeping the last one, so a record read from one line can be
    told blank by its raw text (the csv module gives a line of spaces as a field of spaces, like a quoted one)."""

    def __init__(self, handle):
        self.handle, self.last = handle, ""

    def __iter__(self):
        return self

    def __next__(self) -> str:
        self.last = next(self.handle)
        return self.last


def _delimited_reader(handle, fmt: str, **options: Any):
    """(a csv reader over ``handle``, its :class:`_Lines`)."""
    csv.field_size_limit(_FIELD_LIMIT)
    lines = _Lines(handle)
    return csv.reader(lines, **options, **DELIMITED[fmt]), lines


def _blank(fields: list[str], lines: _Lines, first_line: int, reader, fmt: str) -> bool:
    """Whether a record holds no data: an empty line, or one line of spaces (and of tabs where the tab is no
    delimiter), which pandas.read_csv's default skip_blank_lines=True skips alike (its C engine; a quoted value of
    spaces and a form feed are data for it, and a line of spaces inside a quoted value belongs to that value)."""
    if not fields:
        return True
    blank = " " if fmt == "tsv" else " \t"
    return reader.line_num == first_line and lines.last.rstrip("\r\n").strip(blank) == ""


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
    block: int | None = None  # a PENMAN block's 1-based number, as a user counts graphs (a header comment not counted)

    def __str__(self) -> str:
        if self.block is not None:
            return f"block {self.block} (line {self.line})"
        return f"line {self.line}" if self.line is not None else f"row index {self.index}"


def is_saved_dataset(raw_dir: Path) -> bool:
    return (Path(raw_dir) / "dataset_dict.json").exists()


def available_splits(raw_dir: Path, fmt: str) -> list[str]:
    raw_dir = Path(raw_dir)
    if is_saved_dataset(raw_dir):
        return json.loads((raw_dir / "dataset_dict.json").read_text())["splits"]
    folders = [path.name for path in raw_dir.iterdir() if path.is_dir() and split_files(raw_dir, path.name, fmt)]
    names = (file_formats.strip_suffix(path.name, fmt) for path in raw_dir.iterdir() if path.is_file())
    return sorted({name for name in names if name} | set(folders))


def split_file(raw_dir: Path, split: str, fmt: str) -> Path:
    """The one file of a split laid out as one file: ``<split>.<format>`` or a compressed ``<split>.<format>.gz``..."""
    candidates = [Path(raw_dir) / (split + suffix) for suffix in file_formats.suffixes(fmt)]
    return next((path for path in candidates if path.is_file()), candidates[0])


def split_files(raw_dir: Path, split: str, fmt: str) -> list[Path]:
    """A split's raw files in read order: ``<split>.<format>``, an image folder's ``<split>/metadata.<format>``,
    or the files of format ``fmt`` in folder ``<split>/``, sorted by name."""
    from workflow_scripts.data.split_layouts import metadata_file, suffixes

    folder = Path(raw_dir) / split
    if not folder.is_dir():
        return [split_file(raw_dir, split, fmt)]
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
        return split_file(raw_dir, split, fmt)
    return metadata_file(folder, fmt) if metadata_file(folder, fmt).is_file() else folder


def iter_records(raw_dir: Path, split: str, fmt: str) -> Iterator[tuple[int, Any]]:
    """(row index, record) for every row of one source split."""
    for place, record in iter_placed_records(raw_dir, split, fmt):
        yield place.index, record


def iter_placed_records(raw_dir: Path, split: str, fmt: str, on_invalid_text: str = "stop",
                        encoding: str | None = None) -> Iterator[tuple[Place, Any]]:
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
        yield from read_placed(split_location(raw_dir, split, fmt), fmt, on_invalid_text, encoding)
    else:  # several files: one running row index (ids stay unique), each row's own file and line
        offset = 0
        for path in split_files(raw_dir, split, fmt):
            size = 0
            for place, record in read_placed(path, fmt, on_invalid_text, encoding):
                size = place.index + 1
                yield Place(offset + place.index, place.line, str(path), place.block), record
            offset += size


def class_label_names(raw_dir: Path, split: str, fmt: str) -> dict[str, list[str]]:
    """Field -> the class names of a ``datasets.ClassLabel`` column of one source split, whose rows hold the ids:
    a Parquet file written by ``datasets`` keeps its features in the schema's ``huggingface`` metadata, a saved
    dataset in ``<split>/dataset_info.json``; other formats have none. Read with datasets' own ``Features``, so the
    names are the ones ``datasets.load_dataset`` would decode the ids with. A split of several Parquet files whose
    names differ is refused naming both files."""
    raw_dir = Path(raw_dir)
    if is_saved_dataset(raw_dir):
        info = raw_dir / split / "dataset_info.json"
        features = json.loads(info.read_text(encoding="utf-8")).get("features") if info.is_file() else None
        return _class_labels(features)
    if fmt != "parquet" or split not in available_splits(raw_dir, fmt):
        return {}
    import pyarrow as pa
    import pyarrow.parquet as pq

    found: dict[str, tuple[list[str], Path]] = {}
    for path in split_files(raw_dir, split, fmt):
        try:
            metadata = pq.read_schema(path).metadata or {}
        except (pa.ArrowException, OSError) as error:
            raise _not_parquet(path, error) from None
        try:
            features = json.loads(metadata[b"huggingface"]).get("info", {}).get("features") if b"huggingface" in metadata else None
        except (ValueError, AttributeError):
            raise WorkflowError(f"{path}: the schema's 'huggingface' metadata is not the JSON datasets writes; export the "
                                "file again, or remove that metadata") from None
        for name, names in _class_labels(features).items():
            earlier = found.setdefault(name, (names, path))
            if earlier[0] != names:
                raise WorkflowError(f"{path}: column '{name}' has the ClassLabel names {names}, but {earlier[1]} (the "
                                    f"same split) has {earlier[0]}: the same id would name two classes; export the "
                                    "split's files with one set of names")
    return {name: names for name, (names, _) in found.items()}


def _class_labels(features: Any) -> dict[str, list[str]]:
    """The ClassLabel columns of a features mapping as ``datasets`` serialises it (top-level columns)."""
    if not isinstance(features, dict):
        return {}
    from datasets import ClassLabel, Features

    try:
        parsed = Features.from_dict(features)
    except Exception:  # noqa: BLE001 - another column's type this datasets version lacks: the ClassLabels as written
        return {name: [str(label) for label in spec["names"]] for name, spec in features.items()
                if isinstance(spec, dict) and spec.get("_type") == "ClassLabel" and isinstance(spec.get("names"), list)}
    return {name: list(feature.names) for name, feature in parsed.items() if isinstance(feature, ClassLabel)}


def read_file(path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
    """(row index, record) for every row of one raw file."""
    for place, record in read_placed(path, fmt):
        yield place.index, record


def read_placed(path: Path, fmt: str, on_invalid_text: str = "stop",
                encoding: str | None = None) -> Iterator[tuple[Place, Any]]:
    """(place, record) for every row of one raw file (a line format's file decompressed as it is read)."""
    if fmt == "jsonl":
        yield from _jsonl(path, on_invalid_text, encoding)
    elif fmt == "penman":
        yield from _penman(path, on_invalid_text, encoding)
    elif fmt == "json":
        for index, record in enumerate(_json_list(path, encoding=encoding)):
            yield Place(index), record
    elif fmt in DELIMITED:
        yield from _csv(path, on_invalid_text, encoding, fmt)
    elif fmt == "parquet":
        for index, record in enumerate(_parquet_rows(path)):
            yield Place(index), record
    else:
        raise WorkflowError(f"{path}: unknown format '{fmt}'; known: {list(FORMATS)}")


def count_rows(path: Path, fmt: str, encoding: str | None = None) -> int:
    """Rows in a raw file, without judging them (for the download manifest; normalise judges them), read in the
    dataset's ``encoding`` (a UTF-16 JSON file read as UTF-8 is no JSON at all)."""
    if fmt == "jsonl":
        try:
            with file_formats.open_binary(path) as handle:  # bytes: a file that is not UTF-8 is normalise's to report
                return sum(_jsonl_line_rows(line) for line in handle if line.strip())
        except file_formats.DAMAGED as error:
            raise file_formats.damaged(path, 0, error) from None
    if fmt == "penman":
        return sum(1 for _ in _penman(path, "reject_row", encoding, empty_ok=True))
    if fmt in DELIMITED:
        try:
            with file_formats.open_text(path, encoding, errors="replace", newline="") as handle:
                reader, lines = _delimited_reader(handle, fmt)
                records = 0
                while True:
                    first_line = reader.line_num + 1
                    fields = next(reader, None)
                    if fields is None:
                        return max(records - 1, 0)  # minus the header
                    records += not _blank(fields, lines, first_line, reader, fmt)
        except csv.Error as error:
            raise WorkflowError(f"{path}: not valid {fmt.upper()}: {error}") from None
        except (UnicodeError, *file_formats.DAMAGED) as error:
            raise file_formats.damaged(path, 0, error) from None
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as error:  # a truncated or corrupt file
            raise _not_parquet(path, error) from None
    if fmt == "json":
        return len(_json_list(path, errors="replace", encoding=encoding))
    raise WorkflowError(f"{path}: unknown format '{fmt}'; known: {list(FORMATS)}")


def _jsonl_line_rows(line: bytes) -> int:
    """Rows in one \\n-ended JSON line: one, or where it holds bare carriage returns and fails whole, as many as
    :func:`_jsonl` reads there (old Mac line ends)."""
    body = line.removesuffix(b"\n").removesuffix(b"\r")
    if b"\r" not in body:
        return 1
    text = body.decode("utf-8", errors="replace")
    try:
        json.loads(text)
        return 1
    except json.JSONDecodeError:
        cr_lines = _cr_lines(text)
        return 1 if cr_lines is None else len(cr_lines)


# --- the formats ---
def _not_utf8_row(path: Path, line: int, on_invalid_text: str, encoding: str | None = None) -> Unparseable:
    if on_invalid_text != "reject_row":
        raise _not_utf8(path, rows=True, encoding=encoding)
    name = "UTF-8" if file_formats.is_utf8(encoding) else encoding
    return Unparseable(f"not {name} text: line {line} holds bytes that do not decode or NUL bytes "
                       "(on_invalid_text: reject_row)")


CR_LINE_ENDS = ("the file ends its lines with a bare carriage return (\\r, old Mac line ends), each read as a line end "
                "as datasets' json reader reads them")


def _cr_lines(body: str) -> list[tuple[int, Any]] | None:
    """A JSON line holding bare carriage returns that does not parse whole, read as lines ended by them (old Mac
    line ends, which datasets' json reader, pyarrow's, reads as line ends): (0-based line within, record or
    Unparseable) for each non-blank one; None where none of them parses as a JSON object (the \r were no line ends,
    so the line's own failure stands)."""
    streamed = _cr_separated_objects(body)
    if streamed is not None:
        return streamed
    read = []
    for offset, piece in enumerate(body.split("\r")):
        if piece.strip():
            try:
                read.append((offset, json.loads(piece)))
            except json.JSONDecodeError as error:
                read.append((offset, error))
    # A JSONL record is an object: a piece that parses only as a number or string ("42" between raw \r inside a
    # string value, which json and pyarrow refuse whole) shows no CR line ends, and the line's own failure stands.
    if not any(isinstance(record, dict) for _, record in read):
        return None
    return read


_DECODER = json.JSONDecoder()
_JSON_SPACE = re.compile(r"[ \t\r]*")  # JSON whitespace but \n, which ends the line read


def _cr_separated_objects(body: str) -> list[tuple[int, Any]] | None:
    """``body`` as JSON objects one after another, a bare \r between each two, where it reads so whole (else None):
    pyarrow's json reader parses a block as a stream of values, so a record whose \r inside is JSON whitespace
    (``{"a":\r1}\r{"a":2}``) stays one record there, where cutting at every \r would refuse both halves."""
    read, position, previous_end, line, counted = [], 0, None, 0, 0
    while True:
        start = _JSON_SPACE.match(body, position).end()  # no slicing: a CR-ended file is one such line, read once
        if start == len(body):
            return read
        if previous_end is not None and "\r" not in body[previous_end:start]:
            return None  # two values on one line: not line ends
        try:
            record, position = _DECODER.raw_decode(body, start)
        except json.JSONDecodeError:
            return None
        if not isinstance(record, dict):
            return None
        line, counted = line + body.count("\r", counted, start), start
        read.append((line, record))
        previous_end = position


def _jsonl(path: Path, on_invalid_text: str = "stop", encoding: str | None = None) -> Iterator[tuple[Place, Any]]:
    index = 0
    extra = 0  # bare carriage returns read as line ends so far: an editor counts each as a line
    try:
        # newline="\n": JSON Lines are separated by \n only; a bare \r is JSON whitespace inside a line, where
        # universal newlines would cut the line in two (a line that fails whole is then tried at them: _cr_lines)
        with file_formats.open_text(path, encoding, errors="surrogateescape", newline="\n") as handle:
            for index, line in enumerate(handle):
                number = index + 1 + extra
                if not line.strip():
                    continue
                if _UNDECODED.search(line) or "\x00" in line:
                    yield Place(index + extra, number), _not_utf8_row(path, number, on_invalid_text, encoding)
                    continue
                # Only the line's own end is dropped: the columns json reports stay the editor's.
                body = line.removesuffix("\n").removesuffix("\r")
                try:
                    yield Place(index + extra, number), json.loads(body)
                    continue
                except json.JSONDecodeError as error:
                    failure = error
                cr_lines = _cr_lines(body) if "\r" in body else None
                if cr_lines is None:
                    yield Place(index + extra, number), Unparseable(
                        f"not valid JSON: line {number} column {failure.colno}: {_json_problem(failure)}")
                    continue
                for offset, record in cr_lines:
                    if isinstance(record, json.JSONDecodeError):
                        record = Unparseable(f"not valid JSON: line {number + offset} column {record.colno}: "
                                             f"{_json_problem(record)} ({CR_LINE_ENDS})")
                    yield Place(index + extra + offset, number + offset), record
                extra += body.count("\r")
    except UnicodeError:  # UnicodeDecodeError, or a UTF-16 codec's "does not start with BOM"
        raise _not_utf8(path, encoding=encoding) from None
    except file_formats.DAMAGED as error:
        raise file_formats.damaged(path, index, error) from None


def _penman_blocks(path: Path, encoding: str | None) -> Iterator[tuple[int, list[str]]]:
    """(first line, lines) of each blank-line separated block. Split here, not by ``penman.iterparse``: that one
    stops the whole file at its first bad graph, where each bad block must be rejected alone, named by its line."""
    block: list[str] = []
    start = 0
    with file_formats.open_text(path, encoding, errors="surrogateescape") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                if not block:
                    start = number
                block.append(line.rstrip("\r\n"))
            elif block:
                yield start, block
                block = []
    if block:
        yield start, block


def _penman(path: Path, on_invalid_text: str = "stop", encoding: str | None = None,
            empty_ok: bool = False) -> Iterator[tuple[Place, Any]]:
    """One record per PENMAN block: its ``# ::`` metadata and ``graph`` (one line), or Unparseable. Blocks are
    numbered as a user counts graphs: a comment block (the release's header) is not counted. A file of comment
    blocks only stops naming it (``empty_ok``: counted as 0 rows, for the download manifest)."""
    import penman

    index, line, blocks = 0, 0, 0
    try:
        for blocks, (line, lines) in enumerate(_penman_blocks(path, encoding), start=1):
            comments = [text for text in lines if text.lstrip().startswith("#")]
            if len(comments) == len(lines) and not any("::" in text for text in comments):
                continue  # a header or comment block (the LDC release's first block) holds no graph
            number = index + 1
            place = Place(index, line, block=number)
            index += 1
            if any(_UNDECODED.search(text) or "\x00" in text for text in lines):
                yield place, _not_utf8_row(path, line, on_invalid_text, encoding)
                continue
            if len(comments) == len(lines):
                yield place, Unparseable(f"not a PENMAN block: block {number} (line {line}) has metadata but no graph")
                continue
            try:
                tree = _decode_graph(lines, line)
            except _GraphProblem as problem:
                yield place, Unparseable(f"not valid PENMAN: block {number} (line {line}){problem.text}")
                continue
            yield place, {**_penman_metadata(comments), "graph": penman.format(tree, indent=None)}
    except UnicodeError:  # UnicodeDecodeError, or a UTF-16 codec's "does not start with BOM"
        raise _not_utf8(path, encoding=encoding) from None
    except file_formats.DAMAGED as error:
        raise file_formats.damaged(path, line, error) from None
    if blocks and not index and not empty_ok:
        raise WorkflowError(f"{path}: holds no PENMAN graph: its {_count(blocks, 'block')} {'is a comment' if blocks == 1 else 'are comments only'} "
                            "(format: penman reads blank-line separated blocks of '# ::' metadata lines and a graph); "
                            "check that this is the file of graphs")


# An AMR graph nests a few dozen levels. penman parses and writes a graph recursively (about two frames a level,
# under Python's limit of 1000 frames: some 450 levels read and written in a bare interpreter, fewer deeper in a
# stage), and so do the smatch readers; a deeper graph is refused by name, not left to a RecursionError.
PENMAN_MAX_DEPTH = 200

# Metadata keys whose value is free text to the line's end (LDC's ``# ::snt``, ``# ::tok``): a sentence may hold
# ``::`` (``std::sort``), which penman's own reader takes for the start of another key.
_TEXT_KEYS = ("snt", "tok")
# A key starts a comment line's metadata or follows whitespace (``# ::id a1 ::date ...``), never inside a word.
_META_KEY = re.compile(r"(?:^|(?<=\s))::(\S+)")


class _GraphProblem(Exception):
    """Why a block's text is not one PENMAN graph; ``text`` follows the block's name in the message."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def _penman_metadata(comments: list[str]) -> dict[str, str]:
    """``# ::key value`` metadata of a block's comment lines, as penman reads it (a value without its line end;
    a later line's key wins), except that a sentence (``::snt``, ``::tok``) runs to the line's end."""
    metadata: dict[str, str] = {}
    for text in comments:
        body = text.lstrip()[1:]
        keys = list(_META_KEY.finditer(body))
        for position, key in enumerate(keys):
            whole = key.group(1) in _TEXT_KEYS or position + 1 == len(keys)
            value = body[key.end():len(body) if whole else keys[position + 1].start()]
            metadata[key.group(1)] = value.removeprefix(" ").rstrip()
            if whole:
                break
    return metadata


def _decode_graph(lines: list[str], first_line: int = 1, in_file: bool = True):
    """The one graph of ``lines`` (comments skipped) as a penman Tree, every token of it consumed: penman's own
    ``iterparse`` stops silently at the first token that does not start a graph, so a top node closed one line
    early (``(s / sleep-01 :ARG0 (g / girl)) :polarity -``) would lose its last edges. ``first_line``: the file's
    line of ``lines[0]``, for the messages; ``in_file``: the lines are a PENMAN file's block (not one field's value).
    Raises _GraphProblem."""
    # penman's lexer and node parser (its public parse functions do not say what they left unread); the
    # lexer is a loop, so the nesting can be measured before the recursive parser meets it.
    from penman import Tree
    from penman._lexer import TokenIterator, lex
    from penman._parse import _parse_node
    from penman.exceptions import PenmanError

    tokens = [token for token in lex(lines) if token.type != "COMMENT"]
    depth = deepest = 0
    for token in tokens:
        depth += 1 if token.type == "LPAREN" else -1 if token.type == "RPAREN" else 0
        deepest = max(deepest, depth)
    if deepest > PENMAN_MAX_DEPTH:
        raise _GraphProblem(f": the graph nests {deepest} levels deep, more than the {PENMAN_MAX_DEPTH} this reader "
                            "(and penman's writer) can follow; an AMR graph nests a few dozen: check the block")
    if not tokens or tokens[0].type != "LPAREN":
        shown = (tokens[0].line[tokens[0].offset:].strip() if tokens else "")[:60]
        jsonl = "; a file of JSON lines is format: jsonl" if in_file else ""
        raise _GraphProblem(f" does not start with a graph but with {shown!r} (a graph starts with '('{jsonl})")
    stream = TokenIterator(iter(tokens))
    try:
        node = _parse_node(stream)
    except PenmanError as error:
        at = f" at line {first_line + error.lineno - 1}" if in_file and getattr(error, "lineno", None) else ""
        raise _GraphProblem(f": {_penman_problem(error)}{at}") from None
    if stream:
        rest = stream.peek()
        hint = {"RPAREN": "a closing bracket more than the opening ones",
                "LPAREN": "a second graph: a block holds one graph, and blocks are separated by a blank line"}.get(
            rest.type, "a graph ends with its top node's bracket: is the top node closed early?")
        raise _GraphProblem(f": text after the graph's last bracket at line {first_line + rest.lineno - 1}: "
                            f"{rest.line[rest.offset:].strip()[:60]!r} ({hint})")
    return Tree(node)


def penman_graph_problem(graph: str) -> str | None:
    """Why ``graph`` is not exactly one PENMAN graph read whole (by the ``penman`` library's parser), or None."""
    try:
        _decode_graph(graph.splitlines(), in_file=False)
    except _GraphProblem as problem:
        return problem.text.removeprefix(": ").strip()
    return None


def _penman_problem(error: Exception) -> str:
    message = getattr(error, "message", None)
    if message:
        return message
    """penman's message on one line (it draws the offending line with a caret under it)."""
    lines = [text.strip() for text in str(error).splitlines() if text.strip() and set(text.strip()) != {"^"}]
    return lines[-1] if lines else type(error).__name__


def _json_list(path: Path, errors: str = "strict", encoding: str | None = None) -> list:
    try:
        # file_formats.text_codec: an explicit utf-8 skips a byte-order mark as the default does (utf-8-sig)
        records = json.loads(Path(path).read_text(encoding=file_formats.text_codec(encoding, path), errors=errors))
    except UnicodeError:
        raise _not_utf8(path, encoding=encoding) from None
    except json.JSONDecodeError as error:
        raise WorkflowError(
            f"{path}: not valid JSON (line {error.lineno} column {error.colno}): {_json_problem(error)}"
        ) from None
    if not isinstance(records, list):
        raise WorkflowError(f"{path}: a json split file must hold a list of records, not a {type(records).__name__}")
    return records


def _csv(path: Path, on_invalid_text: str = "stop", encoding: str | None = None,
         fmt: str = "csv") -> Iterator[tuple[Place, Any]]:
    """Strict CSV (or TSV, ``fmt``): a line with more or fewer fields than the header is Unparseable, never shifted
    or padded."""
    line = 0
    name = fmt.upper()
    separator = "a tab" if fmt == "tsv" else "a comma"
    try:
        with file_formats.open_text(path, encoding, errors="surrogateescape", newline="") as handle:
            reader, lines = _delimited_reader(handle, fmt, strict=True)
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
                        raise WorkflowError(f"{path} line {line}: the header is not valid {name}: {error}") from None
                    yield Place(index, line), Unparseable(f"not valid {name}: line {line}: {error}")
                    index += 1
                    continue
                if _blank(fields, lines, line, reader, fmt):  # a blank line holds no record
                    continue
                if any(_UNDECODED.search(value) or "\x00" in value for value in fields):
                    if header is None:
                        raise _not_utf8(path, encoding=encoding)
                    yield Place(index, line), _not_utf8_row(path, line, on_invalid_text, encoding)
                    index += 1
                    continue
                if header is None:
                    header, header_line = fields, line
                    # spaces as _blank counts them (a non-breaking space or a form feed is a name for pandas)
                    if all(not value.strip(" " if fmt == "tsv" else " \t") for value in fields):
                        # Delimiters and spaces only (a spreadsheet's empty first row): pandas reads it, inventing
                        # the names ('Unnamed: 0', ' .1'), so no field mapping would find its column.
                        separated = "tabs" if fmt == "tsv" else "commas"
                        example = "sentence<TAB>label" if fmt == "tsv" else "text,label"
                        raise WorkflowError(
                            f"{path} line {line}: the header line is blank (spaces and {separated} only), so the "
                            f"columns have no names; write the column names on line {line}, separated by {separated} "
                            f"(e.g. {example}), or remove the line if the next one is the header")
                    twice = sorted({name for name in fields if fields.count(name) > 1})
                    if twice:
                        raise WorkflowError(
                            f"{path} line {line}: the header names column {twice} more than once, so one "
                            "column's values would be lost; rename the columns apart"
                        )
                    continue
                if len(fields) != len(header):
                    more = ("a value holding a tab splits into two fields (TSV has no quoting): replace the tab "
                            "inside the value" if fmt == "tsv" else "a value that holds a comma must be in double quotes")
                    hint = (more if len(fields) > len(header)
                            else f"every line needs one value per column (an empty value is still separated by {separator})")
                    yield Place(index, line), Unparseable(
                        f"not valid {name}: line {line} has {_count(len(fields), 'field')} where the header "
                        f"(line {header_line}) has {len(header)}; {hint}"
                    )
                else:
                    yield Place(index, line), dict(zip(header, fields))
                index += 1
    except UnicodeError:  # UnicodeDecodeError, or a UTF-16 codec's "does not start with BOM"
        raise _not_utf8(path, encoding=encoding) from None
    except file_formats.DAMAGED as error:
        raise file_formats.damaged(path, max(line - 1, 0), error) from None


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


def _not_utf8(path: Path, rows: bool = False, encoding: str | None = None) -> WorkflowError:
    """Where a file stops being text in its encoding: the first line (1-based, of the decompressed text) holding a
    byte that does not decode or a NUL byte. A file in another encoding (a UTF-16 byte-order mark, NUL-interleaved
    text) is named as such with the dataset's ``encoding`` setting as the fix, never reject_row: no row of it
    would decode. ``rows``: the file's rows are lines (JSONL, CSV), so such a row could be rejected alone instead."""
    sniffed = file_formats.sniff_encoding(path)
    unset = encoding is None or codecs.lookup(encoding).name == "utf-8"
    if sniffed and unset:
        return WorkflowError(f"{path}: not UTF-8 text but {sniffed} (a byte-order mark or NUL bytes between the "
                             f"characters); set the dataset's encoding: {sniffed}, or re-save the file as UTF-8")
    if not unset:
        try:
            found = file_formats.undecodable_line(path, encoding)
        except (UnicodeError, *file_formats.DAMAGED):
            found = None
        fix = "fix that line or set the dataset's encoding to the file's" + (
            ", or set the dataset's on_invalid_text: reject_row to reject and count such rows" if rows else "")
        if found:
            return WorkflowError(f"{file_formats.undecodable_problem(str(path), encoding, found)}, the dataset's "
                                 f"encoding; {fix}")
        return WorkflowError(f"{path}: not valid {encoding} text (the dataset's encoding); check the file's encoding")
    fix = "re-save the file as UTF-8" + (
        ", or set the dataset's on_invalid_text: reject_row to reject and count such rows" if rows else "")
    offset = 0
    with file_formats.open_binary(path) as handle:  # split on b"\n" only: in UTF-8 that byte never sits inside a character
        for number, line in enumerate(handle, start=1):
            if b"\x00" in line:
                return WorkflowError(f"{path} line {number}: a NUL byte at byte offset {offset + line.index(0)} of the "
                                     f"file, which no text holds; {fix}")
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
