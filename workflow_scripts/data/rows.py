"""One raw record -> canonical rows: the value checks and the record mappers every task uses.

A mapper turns a raw record into canonical rows (or ``Rejected`` reasons) for one dataset:
:class:`RecordMapper` for generation (question/answers, flattening, derived fields) and
:class:`FieldsMapper` for tasks whose rows a ``normalise_fields`` method builds (classification).
``split_done`` tells a mapper a split is complete (train first), so a later split can be checked
against it (a classification label set); ``task_meta`` is what the mapper learned, written beside
the normalised data for the stages after it.

A split named in the dataset's ``unlabelled`` list has no gold: its rows are mapped without reading
the gold field (``gold_source``) and carry the gold column as None (a field derived from the gold
too); normalise checks that the split holds no gold, or holds it in every row (then it is ignored and
reported). Generation's mapper also counts, per split, the rows that give their answers as one bare
string where other rows give lists (``answers_as_bare_string`` in the report).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from workflow_scripts.core.errors import ConfigError
from workflow_scripts.data import raw_records
from workflow_scripts.data.transforms import TRANSFORMS

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings

NAMED_PER_COUNT = 20  # the report names the first rows of a count (e.g. answers_as_bare_string_ids)


class Rejected(Exception):
    def __init__(self, reason: str, field: str | None, detail: str):
        super().__init__(detail)
        self.reason, self.field, self.detail = reason, field, detail


# --- value checks: each returns the clean value or raises Rejected ---
def record_problem(record: Any) -> Rejected | None:
    """Why a raw record cannot be a row at all (unparseable, or not an object with fields), or None."""
    if isinstance(record, raw_records.Unparseable):
        return Rejected("unparseable_record", None, record.error)
    if not isinstance(record, Mapping):
        return Rejected("wrong_type", None, f"the row is a {type(record).__name__}, not an object with fields")
    return None


def present(record: Mapping[str, Any], name: str) -> Any:
    if name not in record or record[name] is None:
        raise Rejected("missing_field", name, "is missing" if name not in record else "is null")
    return record[name]


# A list where one question is expected: the record holds several Q&A pairs (OCR-VQA's layout).
FLATTEN_HINT = "; a record holding several questions, with a parallel list of answers, needs the dataset's flatten: true"


def text(value: Any, name: str, list_hint: str = "") -> str:
    if not isinstance(value, str):
        hint = list_hint if isinstance(value, list) else ""
        raise Rejected("wrong_type", name, f"expected a string, got {type(value).__name__} {value!r:.60}{hint}")
    if not value.strip():
        raise Rejected("empty_value", name, "is empty")
    return value.strip()


def _answers(value: Any, name: str) -> list[str]:
    """One answer string, or a list of gold answers (each a non-empty string)."""
    if isinstance(value, str):
        return [text(value, name)]
    if not isinstance(value, list):
        raise Rejected("wrong_type", name, f"expected a string or a list of strings, got {type(value).__name__}")
    if not value:
        raise Rejected("empty_value", name, "is an empty list")
    return [text(item, f"{name}[{index}]") for index, item in enumerate(value)]


def csv_list(value: Any, name: str) -> Any:
    """A CSV cell holding a list as JSON text (``["64"]``, what pandas and datasets write for a list column) ->
    the list; any other value unchanged. A bracketed cell that is not valid JSON is rejected naming the column:
    taken as text, ``'["64"]'`` would become the literal answer of every row."""
    if not isinstance(value, str):
        return value
    stripped = value.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return value
    try:
        parsed = json.loads(stripped)
    except json.JSONDecodeError as error:
        raise Rejected("wrong_type", name, f"holds {stripped[:60]!r}, a list written as text that is not valid JSON "
                       f"({error.msg}); write the list as JSON, e.g. [\"a\", \"b\"], or one value without brackets") from None
    return parsed


def _record_id(value: Any, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise Rejected("wrong_type", name, f"an id must be a string or an integer, got {type(value).__name__}")
    return text(str(value), name)


def _kind(value: Any) -> str:
    """The coarse type an extra field must keep across rows (Arrow needs one type per column)."""
    for name, types in (("bool", bool), ("number", (int, float)), ("string", str), ("bytes", bytes),
                        ("list", list), ("mapping", dict)):
        if isinstance(value, types):
            return name
    return type(value).__name__


class RecordMapper:
    """Applies one dataset's declarative mapping to raw records."""

    def __init__(self, settings: "DatasetSettings", key: str):
        self.fields = settings.fields
        self.flatten = settings.flatten
        self.extra = settings.extra_fields
        self.derived = settings.derived
        self.extra_kinds: dict[str, str] = {}
        self.unlabelled = frozenset(settings.unlabelled)
        self.gold_source = self.fields["answers"]  # the source field an unlabelled split must not hold
        self.lists_as_text = settings.format in ("csv", "tsv")  # a CSV/TSV cell holds a list only as JSON text
        self.bare_string_ids: dict[str, set[str]] = {}  # split -> ids of rows whose answers were one string
        self.list_answers_seen = False
        available = {"id", "question", "answer"} | set(self.extra)
        for name, spec in self.derived.items():
            if spec.field not in available:
                raise ConfigError(
                    f"{key}.derived.{name}.field",
                    f"'{spec.field}' is not a field of the normalised row (choose from {sorted(available)})",
                )
            available.add(name)

    def source_fields(self) -> dict[str, str]:
        """Config key -> source field name, for the 'absent from every row' check."""
        mapped = {f"fields.{name}": source for name, source in self.fields.items()}
        mapped.update({f"extra_fields.{name}": source for name, source in self.extra.items()})
        return mapped

    def rows(self, record: Any, split: str, row: int) -> Iterable[dict[str, Any] | Rejected]:
        """Canonical rows of one record; a bad pair or record comes out as a Rejected instead."""
        problem = record_problem(record)
        if problem is not None:
            yield problem
            return
        labelled = split not in self.unlabelled  # an unlabelled split's gold is never read
        try:
            id_field = self.fields.get("id")
            record_id = _record_id(present(record, id_field), id_field) if id_field else f"{split}-{row}"
            extras = {name: self._extra(record, name, source) for name, source in self.extra.items()}
            if self.lists_as_text:
                record = {**record, **{source: csv_list(record[source], source) for source in
                                       (self.fields["answers"], *((self.fields["question"],) if self.flatten else ()))
                                       if source in record and not (source == self.fields["answers"] and not labelled)}}
            if self.flatten:
                pairs = self._pairs(record, labelled)
            else:
                answers = present(record, self.fields["answers"]) if labelled else None
                pairs = [(present(record, self.fields["question"]), answers, None)]
        except Rejected as error:
            yield error
            return
        for question, answers, index in pairs:
            suffix = "" if index is None else f"[{index}]"
            try:
                canonical = {
                    "id": record_id if index is None else f"{record_id}-q{index}",
                    "question": text(question, self.fields["question"] + suffix, "" if self.flatten else FLATTEN_HINT),
                    "answers": _answers(answers, self.fields["answers"] + suffix) if labelled else None,
                    **extras,
                }
                canonical = self._derive(canonical)
            except Rejected as error:
                yield error
                continue
            if labelled:
                self._count_answer_form(split, canonical["id"], answers)
            yield canonical

    def _count_answer_form(self, split: str, row_id: str, answers: Any) -> None:
        bare = self.bare_string_ids.setdefault(split, set())
        if isinstance(answers, str):
            bare.add(row_id)
        else:
            self.list_answers_seen = True

    def _extra(self, record: Mapping[str, Any], name: str, source: str) -> Any:
        value = present(record, source)
        if isinstance(value, (str, list, bytes)) and not value:
            raise Rejected("empty_value", source, "is empty")
        kind = self.extra_kinds.setdefault(name, _kind(value))
        if _kind(value) != kind:
            raise Rejected("wrong_type", source, f"is a {_kind(value)} where earlier rows hold a {kind}")
        return value

    def _pairs(self, record: Mapping[str, Any], labelled: bool = True) -> list[tuple[Any, Any, int]]:
        questions = present(record, self.fields["question"])
        if not labelled:  # every question of the record, without gold
            if not isinstance(questions, list):
                raise Rejected("wrong_type", self.fields["question"], f"flatten needs a list, got {type(questions).__name__}")
            if not questions:
                raise Rejected("empty_value", self.fields["question"], "is an empty list")
            return [(q, None, k) for k, q in enumerate(questions)]
        answers = present(record, self.fields["answers"])
        for name, value in ((self.fields["question"], questions), (self.fields["answers"], answers)):
            if not isinstance(value, list):
                raise Rejected("wrong_type", name, f"flatten needs a list, got {type(value).__name__}")
            if not value:
                raise Rejected("empty_value", name, "is an empty list")
        if len(questions) != len(answers):
            raise Rejected(
                "length_mismatch", f"{self.fields['question']}/{self.fields['answers']}",
                f"{len(questions)} questions but {len(answers)} answers; pairs cannot be matched",
            )
        return [(q, a, k) for k, (q, a) in enumerate(zip(questions, answers))]

    def _derive(self, row: dict[str, Any]) -> dict[str, Any]:
        fields = {**row, "answer": row["answers"][0] if row["answers"] is not None else None}
        for name, spec in self.derived.items():
            if fields[spec.field] is None:  # derived from the gold of an unlabelled row: no gold, no value
                row[name] = fields[name] = None
                continue
            try:
                value = TRANSFORMS[spec.transform](fields[spec.field])
            except (ValueError, TypeError) as error:
                raise Rejected("transform_failed", spec.field, f"transform '{spec.transform}' failed: {error}") from None
            if not isinstance(value, str) or not value.strip():
                raise Rejected("transform_failed", spec.field, f"transform '{spec.transform}' gave an empty result")
            row[name] = fields[name] = value
        return row

    def split_done(self, split: str, rows: list[dict]) -> None:
        """Generation rows need nothing from another split."""

    def task_meta(self) -> dict[str, Any]:
        return {}

    def report(self, rows_by_split: Mapping[str, list[dict]]) -> dict[str, Any]:
        return {}

    def split_report(self, split: str, rows: list[dict]) -> dict[str, Any]:
        """The split's entry in the report gets ``answers_as_bare_string``: kept rows whose answers were one
        string, when other rows give lists (each such string is taken as the row's one answer)."""
        if not self.list_answers_seen or split in self.unlabelled:
            return {}
        bare = self.bare_string_ids.get(split, set())
        named = [row["id"] for row in rows if row["id"] in bare]
        return {"answers_as_bare_string": len(named), "answers_as_bare_string_ids": named[:NAMED_PER_COUNT]}

    # Normalise's train/test overlap check (data/contamination.py): the key is the row's input fields
    # (question, extra fields, images), never a field derived from them or the gold.
    def contamination_fields(self, row: Mapping[str, Any]) -> list[str]:
        from workflow_scripts.data import contamination

        return contamination.key_fields(row, skip=self.derived)

    def contamination_key(self, row: Mapping[str, Any]) -> tuple[int, int | None]:
        from workflow_scripts.data import contamination

        return contamination.row_keys(row, skip=self.derived)



class FieldsMapper:
    """Rows built by a task's ``normalise_fields(record, settings)``; one row per record."""

    def __init__(self, task, settings: "DatasetSettings", key: str):
        self.task, self.settings, self.key = task, settings, key
        self.fields = settings.fields
        self.state = task.normalise_state(settings) if hasattr(task, "normalise_state") else None
        self.unlabelled = frozenset(settings.unlabelled)
        # The source field of the gold (a classifier's label); None for a task whose gold sits inside its input.
        gold = getattr(task, "gold_field", None)
        self.gold_source = self.fields.get(gold) if gold else None

    def source_fields(self) -> dict[str, str]:
        return {f"fields.{name}": source for name, source in self.fields.items()}

    def rows(self, record: Any, split: str, row: int) -> Iterable[dict[str, Any] | Rejected]:
        problem = record_problem(record)
        if problem is not None:
            yield problem
            return
        try:
            # a task state's reading of the split (a classifier's label column), decided before any row
            reading = {"reading": self.state.reading(split)} if hasattr(self.state, "reading") else {}
            if split in self.unlabelled:  # the gold is never read: the row's gold field is None
                canonical = self.task.normalise_fields(record, self.settings, labelled=False, **reading)
            else:
                canonical = self.task.normalise_fields(record, self.settings, **reading)
            canonical.setdefault("id", f"{split}-{row}")
            if self.state is not None:
                self.state.check(canonical, split)
                if hasattr(self.state, "note_record"):
                    self.state.note_record(record, canonical)
            yield canonical
        except Rejected as error:
            yield error

    def prepare(self, raw_dir) -> None:
        """Before any row is mapped: what the task's state reads from the raw data as a whole (a classifier's
        ClassLabel names and label column reading); raises WorkflowError."""
        if hasattr(self.state, "prepare"):
            self.state.prepare(raw_dir, self.key)

    def split_done(self, split: str, rows: list[dict]) -> None:
        if self.state is not None:
            self.state.split_done(split, rows)

    def task_meta(self) -> dict[str, Any]:
        return self.state.task_meta() if self.state is not None else {}

    def report(self, rows_by_split: Mapping[str, list[dict]]) -> dict[str, Any]:
        return self.state.report(rows_by_split) if self.state is not None else {}

    def split_report(self, split: str, rows: list[dict]) -> dict[str, Any]:
        return {}

    def notes(self) -> list[str]:
        """Lines for the log on what the task learned (a classifier's label mapping)."""
        return self.state.notes() if self.state is not None and hasattr(self.state, "notes") else []

    # Normalise's train/test overlap check (data/contamination.py): every field but the id and the gold.
    def contamination_fields(self, row: Mapping[str, Any]) -> list[str]:
        from workflow_scripts.data import contamination

        return contamination.key_fields(row)

    def contamination_key(self, row: Mapping[str, Any]) -> tuple[int, int | None]:
        from workflow_scripts.data import contamination

        return contamination.row_keys(row)
