"""Train/test contamination: validation and test rows that repeat a train row, found at normalise.

A test example that also occurs in train measures memory, not learning: a dataset whose test pairs
mostly occur in train runs to a perfect score. Normalise therefore compares every validation and
test row with the train split on a normalised key and reports the overlap; above
``datasets.<name>.contamination.max_fraction`` of a split it stops, naming the overlapping ids,
unless the config accepts the overlap (``contamination.accept: true``), which the report records.

The key is data-driven, from the canonical field names of the rows (no task is named here):
- the INPUT of a row is every field except ``id``, the gold fields (:data:`GOLD_FIELDS`: ``answers``,
  ``label``) and the fields its mapper derives from others (``derived``): generation's ``question``
  and its ``extra_fields`` (e.g. the image path or a context), vision_language's ``question`` and
  ``images``, classification's ``text`` and ``text_pair``, a masked LM's line ``text``. Two rows
  overlap when their inputs are equal after normalisation; a row whose input AND gold fields match a
  train row also counts as a ``pairs_overlapping`` row (the same question with the same answers).
- a field holding input and gold together is split by :data:`SPLIT_FIELDS`: a conversation's
  ``messages`` are its input up to the last turn, and that (assistant) turn is its gold.
- across two different datasets (the cross_contamination stage) the key keeps only the fields
  :func:`compared_fields` gives for the pair: the tasks' own input fields (:data:`TASK_INPUT_FIELDS`) and
  the extra fields both datasets carry, so a column only one of them has does not hide a repeat.
- text is compared normalised: Unicode NFKC, case-folded, whitespace runs collapsed to one space
  and trimmed; bytes (image files) by their sha256, so the same question on another image is not an
  overlap; lists element by element (answers as a set); mappings key by key.

Memory: flat in the size of train. The checked splits' keys are held as sorted 64-bit hashes (8 bytes
a distinct row, plus as much for the pairs), and train is streamed past them once, batch by batch,
marking which of them it holds; a saved split is read from its Arrow files with ``read()``, not
through a memory map, whose touched pages would stay in the process (1.9 GB at 10M lines). The few
ids named in a message are found by a second pass over the checked split and over train that stops
as soon as they are found. A false match of two different 64-bit hashes is about 1 in 10**6 for ten
million train rows against a million test rows.
"""
from __future__ import annotations

import functools
import hashlib
import unicodedata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import ContaminationSettings
    import numpy as np

ID_FIELD = "id"
GOLD_FIELDS = ("answers", "label")  # compared only for pairs_overlapping
# The input fields the task types themselves define (generation/vision_language: question, images;
# classification: text, text_pair; masked LM: text; conversation: messages); any other input field is
# a dataset's extra field.
TASK_INPUT_FIELDS = ("question", "images", "text", "text_pair", "messages")
EXAMPLES = 3  # overlapping ids named in a message
REPORT_EXAMPLES = 5  # overlapping id pairs kept in the report per split
BATCH = 65_536  # rows keyed and looked up at once
CHECKED_SPLITS = ("validation", "test")
REFERENCE_SPLIT = "train"


def normalise_text(value: str) -> str:
    """NFKC, case-folded, whitespace collapsed: ``'  What IS\\u00a0x? '`` -> ``'what is x?'``."""
    if value.isascii():  # NFKC leaves ASCII alone, and casefold is lower (the common, fast case)
        return " ".join(value.lower().split())
    return " ".join(unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", value).casefold()).split())


def _canonical(value: Any, as_set: bool = False) -> str:
    """One value as comparable text (see the module docstring)."""
    if isinstance(value, str):
        return normalise_text(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "sha256:" + hashlib.sha256(value).hexdigest()
    if isinstance(value, (list, tuple)):
        parts = [_canonical(item) for item in value]
        return "[" + "\x1d".join(sorted(set(parts)) if as_set else parts) + "]"
    if isinstance(value, Mapping):
        return "{" + "\x1d".join(f"{name}\x1c{_canonical(value[name])}" for name in sorted(value)) + "}"
    return repr(value)  # numbers, booleans, None: as they are


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _last_turn(messages: Any) -> tuple[Any, Any]:
    """A conversation's input is every turn before the last (assistant) turn; that turn is its gold."""
    if isinstance(messages, (list, tuple)) and messages:
        return list(messages[:-1]), messages[-1]
    return messages, None


# Canonical fields that hold input and gold together: name -> (input part, gold part), and the gold's name.
SPLIT_FIELDS: dict[str, tuple[Callable[[Any], tuple[Any, Any]], str]] = {"messages": (_last_turn, "last turn")}


def key_fields(row: Mapping[str, Any], skip: Iterable[str] = ()) -> list[str]:
    """The fields of ``row`` that make up its input key (sorted)."""
    return list(_split_fields(tuple(row), tuple(skip))[0])


def compared_fields(checked: Iterable[str], train: Iterable[str]) -> list[str]:
    """The input fields two DIFFERENT datasets are compared on: the tasks' own input fields
    (:data:`TASK_INPUT_FIELDS`) that either holds, and the other input fields (extra fields: an image path,
    a context) that both hold under the same name. A field only one dataset carries (a ``source``, a title)
    is left out, so the same question on the same image matches across datasets whatever else they carry."""
    checked, train = set(checked), set(train)
    return sorted(name for name in checked | train if name in TASK_INPUT_FIELDS or (name in checked and name in train))


def gold_fields(row: Mapping[str, Any], skip: Iterable[str] = ()) -> list[str]:
    """What a pair adds to the input, by name: ``answers``, ``label``, a conversation's ``last turn``."""
    fields, gold = _split_fields(tuple(row), tuple(skip))
    return [*(SPLIT_FIELDS[name][1] for name in fields if name in SPLIT_FIELDS), *gold]


@functools.lru_cache(maxsize=64)
def _split_fields(names: tuple[str, ...], skip: tuple[str, ...],
                  only: tuple[str, ...] | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input fields sorted, gold fields) of rows with these field names: rows of a split share them.
    ``only``: the input fields kept (across datasets, :func:`compared_fields`)."""
    left_out = {ID_FIELD, *GOLD_FIELDS, *skip}
    inputs = (name for name in names if name not in left_out and (only is None or name in only))
    return tuple(sorted(inputs)), tuple(n for n in GOLD_FIELDS if n in names)


def row_keys(row: Mapping[str, Any], skip: Iterable[str] = (),
             only: Sequence[str] | None = None) -> tuple[int, int | None]:
    """``(input key, input + gold key)`` hashes of one canonical row; the second is None without a gold.
    ``only`` restricts the input to these fields (a row lacking one of them is keyed without it)."""
    fields, gold = _split_fields(tuple(row), tuple(skip), None if only is None else tuple(only))
    inputs, golds = [], []
    for name in fields:
        value = row[name]
        if name in SPLIT_FIELDS:
            value, reply = SPLIT_FIELDS[name][0](value)
            golds.append(f"{name}[-1]\x1f{_canonical(reply)}")
        inputs.append(f"{name}\x1f{_canonical(value)}")
    golds += [f"{name}\x1f{_canonical(row[name], as_set=True)}" for name in gold]
    digest = hashlib.blake2b("\x1e".join(inputs).encode("utf-8", "surrogatepass"), digest_size=8)
    key = int.from_bytes(digest.digest(), "little")
    if not golds:
        return key, None
    digest.update(("\x1e\x1d" + "\x1e".join(golds)).encode("utf-8", "surrogatepass"))
    return key, int.from_bytes(digest.digest(), "little")


# A stream of key batches: (ids, input keys, pair keys or None), the keys uint64 arrays aligned with the
# ids; ``ids[i]`` is a row id (a list, or an Arrow column: only the ids of overlapping rows are read).
KeyBatch = tuple[Any, "np.ndarray", "np.ndarray | None"]
Keyed = Iterable[KeyBatch]


def _keys_of(rows: Sequence[Mapping[str, Any]], key) -> tuple["np.ndarray", "np.ndarray | None"]:
    import numpy as np

    pairs_of = [key(row) for row in rows]
    keys = np.fromiter((k for k, _ in pairs_of), dtype=np.uint64, count=len(pairs_of))
    if not pairs_of or pairs_of[0][1] is None:
        return keys, None
    return keys, np.fromiter((p for _, p in pairs_of), dtype=np.uint64, count=len(pairs_of))


def keyed_rows(rows: Sequence[Mapping[str, Any]], key=row_keys, batch_size: int = BATCH) -> Iterator[KeyBatch]:
    """Key batches of in-memory rows; ``key`` is a mapper's ``contamination_key`` (or :func:`row_keys`)."""
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        yield ([row[ID_FIELD] for row in chunk], *_keys_of(chunk, key))


def line_keys(texts: Sequence[str]) -> "np.ndarray":
    """Keys of plain-text lines (a masked LM's rows ``{id, text}``: the input is the line)."""
    import numpy as np

    return np.fromiter((_digest("text\x1f" + normalise_text(text)) for text in texts), dtype=np.uint64, count=len(texts))


def _arrow_tables(dataset, batch_size: int):
    """``batch_size``-row Arrow tables of a ``datasets.Dataset``: read from its files when it is a saved
    set as it was loaded (no selection, no column change), else through its own (memory-mapped) table."""
    from workflow_scripts.data.arrow_split import read_batches, row_chunks

    files = [entry["filename"] for entry in dataset.cache_files]
    replays = getattr(dataset.data, "replays", None) or []  # load_from_disk's own: the schema metadata
    if files and dataset._indices is None and all(step[0] == "replace_schema_metadata" for step in replays):
        yield from row_chunks(read_batches(files, dataset.column_names), batch_size)
    else:
        yield from dataset.with_format("arrow").iter(batch_size=batch_size)


def keyed_batches(dataset, skip: Iterable[str] = (), batch_size: int = 10_000,
                  only: Sequence[str] | None = None) -> Iterator[KeyBatch]:
    """Key batches of a saved ``datasets.Dataset``, read ``batch_size`` rows at a time: memory stays
    flat (a masked LM's corpus is never held whole, nor mapped into memory). ``only``: as :func:`row_keys`."""
    skip = tuple(skip)
    lines = (sorted(dataset.column_names) == [ID_FIELD, "text"] and "text" not in skip  # a plain-text corpus
             and (only is None or "text" in only))
    for batch in _arrow_tables(dataset, batch_size):
        if lines:  # one line a row: the fast path, the same keys as row_keys gives
            yield batch.column(ID_FIELD), line_keys(batch.column("text").to_pylist()), None
            continue
        yield (batch.column(ID_FIELD), *_keys_of(batch.to_pylist(), lambda row: row_keys(row, skip, only)))


def _row_id(ids, index: int) -> str:
    value = ids[int(index)]
    return value.as_py() if hasattr(value, "as_py") else value  # an Arrow scalar, or a str


def _positions(sorted_keys: "np.ndarray", values: "np.ndarray") -> tuple["np.ndarray", "np.ndarray"]:
    """(index of each value in ``sorted_keys``, whether it is there)."""
    import numpy as np

    if not len(sorted_keys):
        return np.zeros(len(values), np.intp), np.zeros(len(values), bool)
    found = np.searchsorted(sorted_keys, values).clip(max=len(sorted_keys) - 1)
    return found, sorted_keys[found] == values


def _member(sorted_keys: "np.ndarray", values: "np.ndarray") -> "np.ndarray":
    return _positions(sorted_keys, values)[1]


def _concat(arrays: list) -> "np.ndarray":
    import numpy as np

    return np.concatenate(arrays) if arrays else np.zeros(0, np.uint64)


class CheckedKeys:
    """The checked splits' keys, and which of them train holds.

    Per split: the input (and pair) key of every row in row order; together: the sorted distinct keys
    (8 bytes each) with a flag per key set while train streams past (:meth:`add_train`). Nothing here
    grows with train."""

    def __init__(self, splits: Mapping[str, Keyed]):
        import numpy as np

        self.rows: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
        for name, keyed in splits.items():
            keys, pairs = [], []
            for _, batch_keys, batch_pairs in keyed:
                keys.append(batch_keys)
                if batch_pairs is not None:
                    pairs.append(batch_pairs)
            self.rows[name] = (_concat(keys), _concat(pairs) if pairs else None)
        self.keys = np.unique(_concat([keys for keys, _ in self.rows.values()]))
        self.pairs = np.unique(_concat([pairs for _, pairs in self.rows.values() if pairs is not None]))
        self.in_train = np.zeros(len(self.keys), bool)
        self.pair_in_train = np.zeros(len(self.pairs), bool)
        self.train_rows = 0

    def add_train(self, keyed: Keyed) -> "CheckedKeys":
        for _, keys, pairs in keyed:
            self.train_rows += len(keys)
            where, hit = _positions(self.keys, keys)
            self.in_train[where[hit]] = True
            if pairs is not None:
                where, hit = _positions(self.pairs, pairs)
                self.pair_in_train[where[hit]] = True
        return self

    def found(self, keys: "np.ndarray", pairs: bool = False) -> "np.ndarray":
        """Per row: does train hold its key (its pair key with ``pairs``)?"""
        sorted_keys, flags = (self.pairs, self.pair_in_train) if pairs else (self.keys, self.in_train)
        where, hit = _positions(sorted_keys, keys)
        return hit & flags[where] if len(flags) else hit


@dataclass
class SplitOverlap:
    """One checked split against train: counts and the first overlapping rows (test id, key)."""

    split: str
    checked: int = 0
    overlapping: int = 0
    pairs_overlapping: int | None = None
    first: list = field(default_factory=list)  # [(test id, key)], at most REPORT_EXAMPLES
    train_ids: dict = field(default_factory=dict)  # key -> the first train row id with that key
    found: Any = None  # per checked row (in order): does train hold its input key (a bool array)

    @property
    def fraction(self) -> float | None:
        return self.overlapping / self.checked if self.checked else None

    def examples(self, limit: int = REPORT_EXAMPLES) -> list[dict]:
        return [{"id": test_id, "train_id": self.train_ids.get(key)} for test_id, key in self.first[:limit]]


def overlap(split: str, checked: CheckedKeys, keyed: Callable[[], Keyed]) -> SplitOverlap:
    """Count the rows of ``split`` whose key (and whose pair key) train holds; ``keyed`` gives the
    split's key batches again, read only when something overlaps, for the ids of the first rows."""
    import numpy as np

    keys, pairs = checked.rows[split]
    found = checked.found(keys)
    result = SplitOverlap(split, checked=len(keys), overlapping=int(found.sum()), found=found)
    if pairs is not None:
        result.pairs_overlapping = int(checked.found(pairs, pairs=True).sum())
    wanted = np.flatnonzero(found)[:REPORT_EXAMPLES]
    if len(wanted):
        offset = 0
        for ids, batch_keys, _ in keyed():
            for index in wanted[(wanted >= offset) & (wanted < offset + len(batch_keys))]:
                result.first.append((_row_id(ids, index - offset), int(keys[index])))
            offset += len(batch_keys)
            if offset > wanted[-1]:
                break
    return result


def name_train_ids(overlaps: Sequence[SplitOverlap], train_keyed: Keyed) -> None:
    """Fill each overlap's ``train_ids`` for its example keys: one pass over train that stops early."""
    import numpy as np

    wanted = {key for result in overlaps for _, key in result.first}
    targets = np.array(sorted(wanted), dtype=np.uint64)
    found: dict[int, str] = {}
    if wanted:
        for ids, keys, _ in train_keyed:
            for index in np.flatnonzero(_member(targets, keys)):
                found.setdefault(int(keys[index]), _row_id(ids, index))
            if len(found) == len(wanted):
                break
    for result in overlaps:
        result.train_ids = {key: found.get(key) for _, key in result.first}


# --- the policy: the limit, the report section and the stop ---
def exceeds(result: SplitOverlap, limits: "ContaminationSettings") -> bool:
    return bool(result.checked) and result.overlapping / result.checked > limits.max_fraction


def report(results: Sequence[SplitOverlap], limits: "ContaminationSettings", fields: Sequence[str]) -> dict[str, Any]:
    """The normalise report's ``contamination`` section."""
    return {
        "compared_with": REFERENCE_SPLIT,
        "key": list(fields),
        "max_fraction": limits.max_fraction,
        "accept": limits.accept,
        "splits": {
            result.split: {
                "checked": result.checked, "overlapping": result.overlapping, "fraction": result.fraction,
                "pairs_overlapping": result.pairs_overlapping, "examples": result.examples(),
                "above_max_fraction": exceeds(result, limits),
                "accepted": exceeds(result, limits) and limits.accept,
            }
            for result in results
        },
    }


def check(train: Callable[[], Keyed], splits: Mapping[str, Callable[[], Keyed]]) -> list[SplitOverlap]:
    """Each of ``splits`` against ``train``; each value is a callable giving a fresh stream of key batches.
    Train is read once for the overlap and, when something overlaps, once more (stopping early) to
    name the train ids; a checked split is read once more for the ids of its first overlapping rows."""
    checked = CheckedKeys({name: keyed() for name, keyed in splits.items()}).add_train(train())
    results = [overlap(name, checked, keyed) for name, keyed in splits.items()]
    if any(result.overlapping for result in results):
        name_train_ids(results, train())
    return results


def problem(result: SplitOverlap, limits: "ContaminationSettings", *, file: str, key: str, fields: Sequence[str],
            gold: Sequence[str] = ()) -> str | None:
    """The one-line message that stops normalise for this split, or None (within the limit, or accepted)."""
    if not exceeds(result, limits) or limits.accept:
        return None
    named = ", ".join(f"'{e['id']}' = '{e['train_id']}'" for e in result.examples(EXAMPLES))
    more = ", ..." if result.overlapping > EXAMPLES else ""
    pairs = f"; {result.pairs_overlapping} with the same {' + '.join(gold)} too" if gold and result.pairs_overlapping is not None else ""
    return (
        f"{file}: {result.overlapping} of {result.checked} rows of split '{result.split}' ({result.fraction:.1%}) repeat "
        f"a row of split '{REFERENCE_SPLIT}' (same {' + '.join(fields)}, ignoring case, spacing and Unicode form{pairs}), "
        f"more than {key}.contamination.max_fraction = {limits.max_fraction}; overlapping ids ({result.split} = "
        f"{REFERENCE_SPLIT}): {named}{more}; set {key}.contamination.accept: true to run anyway, or deduplicate the splits"
    )


def summary(result: SplitOverlap, limits: "ContaminationSettings") -> str:
    """One log line per checked split."""
    state = ("accepted by contamination.accept" if limits.accept else "") if exceeds(result, limits) \
        else f"within max_fraction {limits.max_fraction}"
    return (f"{result.overlapping} of {result.checked} rows ({(result.fraction or 0):.1%}) repeat a train row"
            + (f"; {state}" if state else ""))
