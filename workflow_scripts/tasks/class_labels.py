"""How a classification dataset's label column names its classes, decided once per column before a row is mapped.

Two sources of ambiguity, each resolved for the whole column, never row by row:

- A ``datasets.ClassLabel`` column (a Parquet file exported by ``datasets``, a saved dataset) holds class ids;
  its names sit in the features (``data/raw_records.class_label_names``). An id is read as ``datasets`` reads it,
  ``names[id]``; with ``labels:`` declared, those names are then matched by NAME, so a declared list in another
  order swaps nothing, and without ``labels:`` the names are the classes (not ``'0'``/``'1'``).
- Declared labels that are numbers (star ratings ``["1", ..., "5"]``) make a raw integer readable two ways: as a
  declared name or as a class id into the list. :func:`column_reading` reads the column's values (every labelled
  split) and decides: all by name, or all by index; a column where every value reads both ways, or where some
  read only as names and others only as ids, is refused naming the key, with the mappings the rows would get.
  Declared labels that are not numbers read every value one way only (a name, or an id), so no decision is needed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data.rows import Rejected

INTEGER = re.compile(r"^[+-]?\d+$")


def class_id(label: str) -> int | None:
    """The class id a label string is, or None: only the canonical decimal form of an integer (``"1"``, ``"-1"``)
    is an id. ``datasets``' ``ClassLabel.str2int`` falls back to ``int(value)``, so ``"01"``, ``"+1"`` and ``"007"``
    become ids 1, 1 and 7; a column of zero-padded numbers (``"01"``, ``"02"``...) is nearly always a numbering from
    01, read that way one class off, and nothing would say so. A user who writes ``"01"`` means the text ``01`` (a
    name, matched as written when declared), so it is never read as an index here (:func:`padded_number_problem`)."""
    if not INTEGER.match(label) or str(int(label)) != label:
        return None
    return int(label)


def padded_number_problem(label: str, names: Sequence[str]) -> str | None:
    """Why ``label``, a number not in its canonical form (``"01"``, ``"+2"``) and not one of ``names``, is read
    neither as a name nor as an id (:func:`class_id`), with what to write in ``labels:``; None for any other label."""
    if not INTEGER.match(label) or class_id(label) is not None or label in names:
        return None
    index = int(label)
    # \d and int() take any Unicode decimal digit ('１', '٣'): name the digits, not a leading zero they lack
    written = "with a leading zero or a sign" if label.isascii() else "in digits other than ASCII 0-9"
    datasets_reading = (f"id {index}, {names[index]!r}" if 0 <= index < len(names) else f"id {index}, outside "
                        f"0..{len(names) - 1}")
    return (f"label {label!r} is not a declared name, and a number written {written} is not read as a class id "
            f"(datasets' ClassLabel would read it as {datasets_reading}: a numbering from 01 read one class off); to "
            f"read the values by name declare them as the rows write them (labels: [{label!r}, ...]), or write the "
            f"class ids 0..{len(names) - 1} without leading zeros")


@dataclass(frozen=True)
class LabelReading:
    """One split's reading of its label column: ``class_names``, the source's ClassLabel names that its integer ids
    index (None: no ClassLabel); ``by``: ``"name"`` or ``"index"`` where the declared labels are numbers (the whole
    column read one way), None where each value has one reading only."""

    class_names: tuple[str, ...] | None = None
    by: str | None = None


def source_class_name(label: str, names: Sequence[str], source: str) -> str:
    """The ClassLabel name of an id (``datasets``' ``int2str``); an id outside the names is ``Rejected``."""
    index = class_id(label)
    if index is not None:
        if 0 <= index < len(names):
            return names[index]
        if index == -1:  # ClassLabel's "no label" (datasets encodes a missing label as -1)
            raise Rejected("unknown_label", source, "label -1 is datasets' mark of a row without a label (GLUE's test "
                           "splits hold only -1): the row has no class to train or score on; use a labelled split "
                           "(e.g. validation) as the test split, or drop such rows")
        raise Rejected("unknown_label", source, f"label {label} is not a class id 0..{len(names) - 1} of the source's "
                       f"ClassLabel names {list(names)} (the file's datasets features)")
    return label  # a name where the column holds names: matched against the label set later


def class_names_mismatch(raw: str, name: str, names: Sequence[str], declared: Sequence[str]) -> str | None:
    """Why the ClassLabel name ``name`` (of id ``raw``) is not a declared label where the ClassLabel's names and
    ``labels:`` are the same numbers written otherwise (``['01', '02']`` against ``['1', '2']``): the names are
    matched as written, so every row of such a column is refused; the message names both lists and the fix. None
    for any other name (where no name is a declared number written otherwise, ``check_label`` refuses it)."""
    if name in declared:
        return None
    by_number = {value: label for value in names if INTEGER.match(value)
                 for label in declared if INTEGER.match(label) and label != value and int(label) == int(value)}
    if not by_number:
        return None
    return (f"label {name!r} (class id {raw} of the source's ClassLabel names {list(names)}) is not a declared label: "
            f"labels: {list(declared)} writes the same numbers otherwise ({_mapping(by_number.items())}), and a "
            f"ClassLabel's names are matched as written; declare labels: exactly as the ClassLabel names them "
            f"({list(names)}), or drop labels: to use the ClassLabel's names")


def numbers_among(declared: Sequence[str] | None) -> bool:
    """Whether some declared label reads as an integer, so a raw integer could be a name or an id."""
    return bool(declared) and any(INTEGER.match(name) for name in declared)


def _mapping(pairs: Iterable[tuple[str, str]]) -> str:
    return ", ".join(f"{raw} -> {name}" for raw, name in pairs)


def _sorted(values: Iterable[str]) -> list[str]:
    return sorted(values, key=lambda value: (0, int(value), value) if INTEGER.match(value) else (1, 0, value))


def column_reading(values: Iterable[str], declared: Sequence[str], key: str, source: str) -> str | None:
    """``"name"`` or ``"index"``: how every value of a label column reads against declared labels that are numbers
    (None: no value reads both ways, each keeps its one reading). Values that read neither way are left to the
    rows (rejected there, ``unknown_label``). Raises WorkflowError where the column does not decide."""
    names, count = list(declared), len(declared)
    as_name = {value for value in values if value in names}
    as_index = {value for value in values if class_id(value) is not None and 0 <= int(value) < count}
    both, name_only, index_only = as_name & as_index, as_name - as_index, as_index - as_name
    # Declared names with leading zeros ('01', '02', '03'; or in other digits, '١') and rows writing the same numbers
    # without them ('1', '2'): each row is a declared name by its number, and as a class id (datasets' str2int too)
    # the next class, so a numbering from 01 would be read one class off. A column of only such values: refused.
    by_number = {value: name for value in index_only for name in names
                 if name != value and INTEGER.match(name) and int(name) == int(value)}
    if index_only and not name_only and set(by_number) == index_only:
        shown = _sorted(index_only)
        raise WorkflowError(
            f"{key}.labels: the declared labels {names} are numbers written otherwise than column '{source}' writes "
            f"them ({shown}), each a declared name by its number and a class id 0..{count - 1}: by number "
            f"{_mapping((value, by_number[value]) for value in shown)}, or by index "
            f"{_mapping((value, names[int(value)]) for value in shown)}; write the rows' labels as declared, or give "
            f"the rows the ids 0..{count - 1} with 0 among them")
    if not (name_only and index_only) and all(names[int(value)] == value for value in both):
        return None  # no value reads two ways (["0", "1"] read by name or by index alike)
    if name_only and index_only:
        per_row = [(value, value if value in names else names[int(value)]) for value in _sorted(as_name | as_index)]
        raise WorkflowError(
            f"{key}.labels: the declared labels {names} are numbers, and column '{source}' holds "
            f"{_sorted(as_name | as_index)}: {_sorted(index_only)} only a class id, {_sorted(name_only)} only a declared "
            f"name, so no one reading fits the column (row by row: {_mapping(per_row)}, two values onto one class); "
            f"give the rows the ids 0..{count - 1} or the declared names, not both")
    if name_only or index_only:
        return "name" if name_only else "index"
    shown = _sorted(both)
    raise WorkflowError(
        f"{key}.labels: the declared labels {names} are numbers, and column '{source}' holds {shown}, each both a "
        f"declared name and a class id 0..{count - 1}, so the rows cannot say which they are: by name "
        f"{_mapping((value, value) for value in shown)}, or by index "
        f"{_mapping((value, names[int(value)]) for value in shown)}; give the rows the ids 0..{count - 1} or name "
        "every class at least once, or declare labels that are not numbers")
