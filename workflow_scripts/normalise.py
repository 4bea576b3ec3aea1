"""Stage ``normalise``: one dataset's raw records -> the canonical schema, driven only by the config.

Canonical row: ``id`` (stable), ``question`` (non-empty str), ``answers`` (non-empty list of
non-empty str), each ``extra_fields`` name carried unchanged, each ``derived`` name (str, from a
named transform in workflow_scripts.data.transforms). Splits are renamed to train/validation/test.

Bad rows are rejected, never repaired: no fallback value is ever filled in and no empty row is
ever written (seed: "fallback values for missing data" trained a model on empty strings).
The report counts rejections per reason with examples (file, split, row, field). The stage fails
with one message when a mapped field is absent from every row of a split, or when a split's
rejected share passes ``max_rejected_fraction``.

Contamination (``data/contamination.py``): the kept validation and test rows are compared with the
train rows on their normalised input (question and extra fields / images, a classification text, a
masked LM's line); the report's ``contamination`` section counts the overlap per split, and above
``contamination.max_fraction`` of a split the stage stops naming the overlapping ids, unless
``contamination.accept`` is true. Either way nothing is written before the check has passed.

Duplicates within a split (the kept rows repeating an earlier row's input and gold, image bytes included) are
counted with their ids in the report, and stop the stage above ``duplicates.max_fraction`` when set. Gold answers
of a dataset scored by smatch or smatchpp must be one PENMAN graph its metrics can read (``unreadable_gold``).
Files in another encoding than the dataset's (a UTF-16/32 mark, NUL-interleaved text) stop the stage before
any row is read, every such file named; so does a valid UTF-8 file declared in a single-byte encoding (latin-1,
cp1252: it would decode into mojibake without an error), with both readings of its first such line
(docs/data-formats.md).

Counting: a row is one record, or one question/answer pair of a flattened record; a flattened
record that cannot be split into pairs (not lists, or lists of different lengths) counts as one.

Unlabelled splits (``unlabelled: [test]``, a leaderboard's test set whose answers are withheld): the
gold field is not read and is written as None; the gold must be absent or null in every record of the
split (a few records with gold is an error naming the first; gold in every record is reported as
``gold_ignored`` and left out). The report and ``task_meta.json`` record ``unlabelled``; the
contamination check compares their inputs as for any split. Answers given as one bare string where
other rows give lists are taken as one answer each and counted (``answers_as_bare_string``).
"""
from __future__ import annotations

import argparse
import codecs
import functools
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.data import contamination, raw_records
from workflow_scripts.data.source_paths import SourceNames
from workflow_scripts.data.rows import Rejected
from workflow_scripts.core.atomic_output import atomic_path, check_writable, write_json
from workflow_scripts.core.errors import ConfigError, WorkflowError, run_main
from workflow_scripts.checks.sections import dataset_argument
from workflow_scripts.core import config_reads
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.core.stage_arguments import StageArgumentParser
from workflow_scripts.tasks import task_named

CANONICAL_SPLITS = ("train", "validation", "test")  # train first: later splits may be checked against it
TASK_META = "task_meta.json"  # what the task learned while normalising (e.g. a label set)
EXAMPLES_PER_REASON = 5
REASONS = {
    "unparseable_record": "the raw row could not be decoded",
    "missing_field": "a mapped field is absent or null",
    "empty_value": "a string, list or answer is empty",
    "wrong_type": "a value has a type the field cannot hold (e.g. a number where text is needed)",
    "length_mismatch": "a flattened record's question and answer lists differ in length",
    "duplicate_id": "the id was already used by an earlier row of the split",
    "transform_failed": "a derived field's transform rejected its input",
    "unknown_label": "the label is not in the label set (declared labels:, else the train split's)",
    "unreadable_gold": "a gold graph the dataset's graph metric (smatch, smatchpp) cannot read",
}
NAMED_DUPLICATES = 20  # the report names the first duplicate rows of a split (their ids and the earlier row's)


@dataclass
class SplitTally:
    source_split: str
    file: str
    examined: int = 0
    kept: int = 0
    reasons: Counter = field(default_factory=Counter)
    present: Counter = field(default_factory=Counter)  # source field -> rows that have it
    first: dict = field(default_factory=dict)  # reason -> the split's first example of it
    seen_keys: set = field(default_factory=set)
    unlabelled: bool = False
    records: int = 0       # raw records with fields (for an unlabelled split's gold check)
    gold_records: int = 0  # of them, records whose gold field holds a value
    first_gold: raw_records.Place | None = None
    problem: str | None = None  # what stops the stage besides the counts (an unreadable file, a field in no row...)
    unreadable: bool = False    # the file could not be read to its end: the counts are partial
    row_keys: dict = field(default_factory=dict)  # a kept row's input + gold hash -> its id (duplicates within the split)
    duplicates: int = 0
    duplicate_ids: list = field(default_factory=list)  # [id, the earlier row's id] of the first duplicates

    @property
    def rejected(self) -> int:
        return self.examined - self.kept


@dataclass
class Rejections:
    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, error: Rejected, file: str, split: str, place: raw_records.Place) -> dict:
        example = {"file": file, "split": split, "row": place.index, "line": place.line, "field": error.field,
                   "detail": error.detail, **({"block": place.block} if place.block is not None else {})}
        self.counts[error.reason] += 1
        kept = self.examples.setdefault(error.reason, [])
        if len(kept) < EXAMPLES_PER_REASON:
            kept.append(example)
        return example


def describe(example: Mapping[str, Any]) -> str:
    where = f"{example['file']} {raw_records.Place(example['row'], example['line'], block=example.get('block'))}"
    return f"{where}: field '{example['field']}': {example['detail']}" if example["field"] else f"{where}: {example['detail']}"


def normalise_split(mapper, raw_dir: Path, fmt: str, canonical: str, source_split: str,
                    rejections: Rejections, key: str, names: SourceNames,
                    on_invalid_text: str = "stop", encoding: str | None = None,
                    gold_check=None) -> tuple[list[dict], SplitTally]:
    location = names.shown(raw_records.split_location(raw_dir, source_split, fmt))  # the user's file
    unlabelled = canonical in getattr(mapper, "unlabelled", ())
    tally = SplitTally(source_split=source_split, file=location, unlabelled=unlabelled)
    kept, ids = [], set()
    source_fields = mapper.source_fields()
    gold = mapper.gold_source if unlabelled else None
    if gold is not None:  # an unlabelled split may lack its gold field in every row
        source_fields = {key: name for key, name in source_fields.items() if name != gold}
    try:
        _tally_records(mapper, raw_dir, fmt, canonical, source_split, (on_invalid_text, encoding), rejections, names,
                       tally, kept, ids, source_fields, gold, location, None if unlabelled else gold_check)
    except WorkflowError as error:  # a file that cannot be read on: counted in the report with the rest, not alone
        tally.problem, tally.unreadable = names.translate(str(error)), True
        return kept, tally
    for config_key, source in source_fields.items():
        # Only over rows that had fields: where no record could be read at all (JSON lines in a PENMAN file), the
        # rejections' reason is the cause, said by tally_problem, and the fields are not absent but unread.
        if tally.seen_keys and not tally.present[source]:
            tally.problem = (
                f"{location}: field '{source}' ({key}.{config_key}) is absent from every row of split "
                f"'{source_split}'; the rows have fields {sorted(tally.seen_keys)}"
            )
            return kept, tally
    if 0 < tally.gold_records < tally.records:
        tally.problem = (
            f"{location} {tally.first_gold}: field '{gold}' holds a gold answer, but split '{canonical}' is declared "
            f"unlabelled ({key}.unlabelled) and {tally.records - tally.gold_records} of its {tally.records} rows have "
            f"none; a split is labelled in every row or in none: remove '{canonical}' from {key}.unlabelled and "
            "complete its answers, or clear the stray ones")
    return kept, tally


def _tally_records(mapper, raw_dir: Path, fmt: str, canonical: str, source_split: str, reading: tuple,
                   rejections: Rejections, names: SourceNames, tally: SplitTally, kept: list, ids: set,
                   source_fields: Mapping[str, str], gold: str | None, location: str, gold_check=None) -> None:
    """Map every record of the split onto rows, counting each rejection (``normalise_split``'s loop).
    ``reading``: (on_invalid_text, encoding); ``gold_check(row)`` raises Rejected for a gold its metric cannot read."""
    for place, record in raw_records.iter_placed_records(raw_dir, source_split, fmt, *reading):
        row = place.index
        if isinstance(record, Mapping):
            tally.seen_keys.update(record)
            tally.present.update(name for name in set(source_fields.values()) if name in record)
            if gold is not None:
                tally.records += 1
                if record.get(gold) is not None:
                    tally.gold_records += 1
                    tally.first_gold = tally.first_gold or place
        for result in mapper.rows(record, canonical, row):
            tally.examined += 1
            if isinstance(result, dict) and result["id"] in ids:
                result = Rejected("duplicate_id", mapper.fields.get("id", "id"), f"id '{result['id']}' occurs earlier in the split")
            if isinstance(result, dict) and gold_check is not None:
                try:
                    gold_check(result)
                except Rejected as error:
                    result = error
            if isinstance(result, Rejected):
                result = Rejected(result.reason, result.field, names.translate(result.detail))  # an image's path
                example = rejections.add(result, names.shown(place.file) if place.file else location, canonical, place)
                tally.first.setdefault(result.reason, example)
                tally.reasons[result.reason] += 1
            else:
                ids.add(result["id"])
                kept.append(result)
                tally.kept += 1
                _count_duplicate(mapper, result, tally)


def _count_duplicate(mapper, row: dict, tally: SplitTally) -> None:
    """A kept row repeating an earlier row of its split: the same input (image bytes included) and gold."""
    input_key, pair_key = mapper.contamination_key(row)
    row_key = input_key if pair_key is None else pair_key
    earlier = tally.row_keys.setdefault(row_key, row["id"])
    if earlier != row["id"]:
        tally.duplicates += 1
        if len(tally.duplicate_ids) < NAMED_DUPLICATES:
            tally.duplicate_ids.append([row["id"], earlier])


def duplicates_problem(tally: SplitTally, canonical: str, limit: float, key: str) -> str | None:
    """The stop when a split's duplicates pass ``duplicates.max_fraction``, or None."""
    if not tally.kept or tally.duplicates / tally.kept <= limit:
        return None
    named = ", ".join(f"'{row}' = '{earlier}'" for row, earlier in tally.duplicate_ids)
    more = f" (the first {len(tally.duplicate_ids)} named)" if tally.duplicates > len(tally.duplicate_ids) else ""
    return (f"{tally.file}: {tally.duplicates} of {tally.kept} kept rows of split '{canonical}' "
            f"({tally.duplicates / tally.kept:.1%}) repeat an earlier row of the split (same input and gold), more than "
            f"{key}.duplicates.max_fraction = {limit}; duplicates{more}: {named}; deduplicate the split or raise "
            f"{key}.duplicates.max_fraction")


def check_submission_ids(rows: list[dict], tally: SplitTally, settings: DatasetSettings, key: str) -> None:
    """An unlabelled split submitted with integer ids must have integer ids: refused here, not after training."""
    if not tally.unlabelled or settings.submission.id_type != "integer":
        return
    for index, row in enumerate(rows):
        try:
            int(row["id"])
        except ValueError:
            raise ConfigError(f"{key}.submission.id_type", f"is integer, but split '{tally.source_split}' of "
                              f"{tally.file} has id {row['id']!r} (its kept row {index}), which is not an integer; "
                              f"set {key}.submission.id_type: string, or give integer ids") from None


def tally_problem(tally: SplitTally, threshold: float, key: str, canonical: str = "",
                  gold: str | None = None) -> str | None:
    """Why a split stops the stage (no rows, or too many rejected), or None. A held-out split whose every row
    lacks the gold (``gold``, the source field) is most likely a leaderboard's test set: say how to declare it."""
    if tally.problem:
        return tally.problem
    if tally.examined == 0:
        return f"{tally.file}: split '{tally.source_split}' has no rows"
    share = tally.rejected / tally.examined
    if tally.kept and share <= threshold:
        return None
    reasons = ", ".join(f"{reason} {count}" for reason, count in tally.reasons.most_common())
    example = describe(tally.first[tally.reasons.most_common(1)[0][0]])
    limit, fix = ((f"more than {key}.max_rejected_fraction = {threshold}",
                   f"fix the rows or raise {key}.max_rejected_fraction") if tally.kept else
                  ("so no row is left", "fix the rows (or the field mapping, if every row fails alike)"))
    withheld = (not tally.kept and canonical in ("validation", "test") and not tally.unlabelled and gold
                and set(tally.reasons) == {"missing_field"} and tally.first["missing_field"]["field"] == gold)
    if withheld:
        fix = (f"every row lacks its answers ('{gold}'), as in a test set whose answers are withheld: declare it "
               f"with {key}.unlabelled: [{canonical}] (predicted for a submission, never scored), or fix the rows")
    return (f"{tally.file}: {tally.rejected} of {tally.examined} rows of split '{tally.source_split}' rejected "
            f"({share:.1%}), {limit}; reasons: {reasons}; for example {example}; {fix}")


def failure_report_path(report: Path) -> Path:
    """Where a failed run's report goes: beside the report, not at it, because Snakemake deletes a failed
    job's declared outputs (and a report at the declared path would read as a finished one)."""
    return report.with_name(f"{report.stem}.failed{report.suffix}")


def fail_with_report(report: dict, problems: list[str], report_path: Path) -> None:
    """Write the report with every problem (``failed``) beside ``report_path`` and stop with one message that
    counts them all: a user learns every failing split in one run, not one per run."""
    failed = failure_report_path(report_path)
    write_json(failed, {**report, "failed": problems})
    print(json.dumps(report, indent=2, default=str), file=sys.stderr)  # the log keeps the evidence
    if len(problems) == 1:
        raise WorkflowError(problems[0])
    listed = " ".join(f"({number}) {problem}" for number, problem in enumerate(problems, start=1))
    raise WorkflowError(f"{len(problems)} problems, all listed in {failed}: {listed}")


def contamination_outcome(results, fields: list[str], gold: list[str], settings: DatasetSettings,
                          files: Mapping[str, str], key: str) -> tuple[dict, list[str]]:
    """The report's ``contamination`` section, and the messages that stop the stage, one per split whose
    overlap passes ``max_fraction`` (none when within it or accepted)."""
    limits = settings.contamination
    section = contamination.report(results, limits, fields)
    problems = (contamination.problem(r, limits, file=files[r.split], key=key, fields=fields, gold=gold) for r in results)
    return section, [message for message in problems if message]


def check_record_contamination(mapper, splits: Mapping[str, list[dict]], settings: DatasetSettings,
                               files: Mapping[str, str], key: str) -> tuple[dict, list[str], list]:
    """Kept validation/test rows against the kept train rows, keyed by the mapper (``contamination_key``)."""
    keyed = functools.partial(contamination.keyed_rows, key=mapper.contamination_key)
    results = contamination.check(functools.partial(keyed, splits.get("train", [])),
                                  {split: functools.partial(keyed, rows) for split, rows in splits.items()
                                   if split in contamination.CHECKED_SPLITS})
    sample = next((rows[0] for rows in splits.values() if rows), {})
    section, messages = contamination_outcome(results, mapper.contamination_fields(sample),
                                              contamination.gold_fields(sample), settings, files, key)
    return section, messages, results


def to_dataset(rows: list[dict], location: str, like=None):
    """The kept rows as one table; ``like`` (the train split) gives the types of columns that hold only
    None here (an unlabelled split's gold), so every split of the data has the same columns and types."""
    from datasets import Dataset

    try:
        data = Dataset.from_list(rows)
        if like is not None:
            for name, feature in data.features.items():
                if getattr(feature, "dtype", None) == "null" and name in like.features:
                    data = data.cast_column(name, like.features[name])
        return data
    except Exception as error:  # Arrow cannot hold a carried field's values in one column
        raise WorkflowError(f"{location}: the kept rows cannot be stored as one table: {error}") from None


def normalise_by_task(normalise_source, args: argparse.Namespace, settings: DatasetSettings,
                      names: SourceNames) -> int:
    """A task's own normalisation (``Task.normalise_source``): it writes the normalised data, with
    ``task_meta.json`` inside in the same atomic step, and returns its part of the report.

    The task writes into this stage's staging directory, which is published only after the
    contamination check has passed (streamed from the written Arrow data, memory-mapped)."""
    from datasets import load_from_disk

    task_meta = {"task": settings.task}
    key = f"datasets.{args.name}"
    with atomic_path(args.out, directory=True) as staging:
        staging.rmdir()  # the task creates its output itself, as it would at args.out
        report = {"dataset": args.name, "raw": str(args.raw), "task": settings.task}
        try:
            extras = normalise_source(args.raw, settings, staging, extra_json={TASK_META: task_meta})
        except WorkflowError as error:  # a damaged or undecodable file: the report says so too, every split's
            problems = getattr(error, "problems", None) or [str(error)]
            fail_with_report(report, [names.translate(problem) for problem in problems], args.report)
        extras = json.loads(names.translate(json.dumps(extras)))  # the report names the user's files
        report.update(extras)
        data = load_from_disk(str(staging))
        columns = {name: None for name in next(iter(data.values())).column_names}
        keyed = contamination.keyed_batches
        # An evaluation-only dataset has no train split here (cross_contamination checks it against the trained ones).
        results = contamination.check(functools.partial(keyed, data["train"]),
                                      {split: functools.partial(keyed, data[split]) for split in data
                                       if split in contamination.CHECKED_SPLITS}) if "train" in data else []
        files = {split: report.get("splits", {}).get(split, {}).get("file", str(args.raw)) for split in data}
        report["contamination"], messages = contamination_outcome(
            results, contamination.key_fields(columns), contamination.gold_fields(columns), settings, files, key)
        del data  # the memory maps, before the directory is renamed or removed
        if messages:
            fail_with_report(report, messages, args.report)
    write_json(args.report, report)
    failure_report_path(args.report).unlink(missing_ok=True)  # an earlier failure's, now stale
    for canonical, split in report.get("splits", {}).items():
        print(f"{args.name}/{canonical}: {json.dumps({k: v for k, v in split.items() if k != 'files'})}")
    print_contamination(args.name, results, settings)
    return 0


def print_contamination(name: str, results, settings: DatasetSettings) -> None:
    for result in results:
        print(f"{name}/{result.split}: contamination: {contamination.summary(result, settings.contamination)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Every message names the user's file (the configured source), never the raw copy."""
    parser = StageArgumentParser(description="Map one dataset's raw records onto the canonical schema.")
    parser.add_argument("--name", required=True, help="Dataset name (the key under datasets in the config).")
    parser.add_argument("--dataset", required=True, help="The dataset's settings as JSON.")
    parser.add_argument("--raw", required=True, type=Path, help="Raw data directory written by download.")
    parser.add_argument("--out", required=True, type=Path, help="Normalised DatasetDict directory to create.")
    parser.add_argument("--report", required=True, type=Path, help="normalise_report.json to write.")
    args = parser.parse_args(argv)
    key = f"datasets.{args.name}"
    # read through what core/config_reads.py declares for normalise: a key its params do not carry cannot be read
    settings = config_reads.Declared(dataset_argument(args.dataset, args.name), "normalise", "datasets.*")
    if not args.raw.is_dir():
        raise WorkflowError(f"{args.raw}: raw data directory not found; run the download rule first")
    check_writable(args.out, args.report)
    names = SourceNames(args.raw, settings)
    try:
        return normalise(args, settings, key, names)
    except WorkflowError as error:
        raise names.reraise(error) from None


def check_encodings(args: argparse.Namespace, settings: DatasetSettings, key: str, names: SourceNames) -> None:
    """Stop, naming every file of every split, when files look like another encoding (a UTF-16/32 byte-order mark,
    NUL-interleaved text) than the dataset reads: read as UTF-8 they fail line by line, or worse, under
    on_invalid_text: reject_row, NUL-laden lines would pass on. And stop at the first file that is valid UTF-8
    with multi-byte characters while the dataset declares a single-byte encoding (latin-1, cp1252...), which
    would decode without an error into mojibake: the message gives both readings of its first such line."""
    from workflow_scripts.data import file_formats, text_lines

    fmt = settings.format
    if (fmt not in file_formats.LINE_FORMATS and fmt != "json") or raw_records.is_saved_dataset(args.raw):
        return
    files: list[str] = []
    for split in dict.fromkeys(settings.splits.values()):
        try:
            found = (text_lines.split_files(args.raw, split) if fmt == text_lines.TEXT_FORMAT
                     else raw_records.split_files(args.raw, split, fmt))
        except WorkflowError:
            continue  # a missing split is named by the read itself
        files += [str(path) for path in found if Path(path).is_file()]
    for file in files:
        contradicted = file_formats.contradicted_encoding(file, settings.encoding)
        if contradicted:
            raise WorkflowError(file_formats.contradiction_problem(names.shown(file), key, settings.encoding, contradicted))
    unset = settings.encoding is None or codecs.lookup(settings.encoding).name == "utf-8"
    sniffed = {file: kind for file in files if (kind := file_formats.sniff_encoding(file))} if unset else {}
    if sniffed:
        shown = {names.shown(file): kind for file, kind in sniffed.items()}
        raise WorkflowError(file_formats.encoding_problem([names.shown(file) for file in files], shown, key))


def gold_graph_check(settings: DatasetSettings):
    """``check(row)`` raising Rejected for a gold answer that the dataset's graph metrics (smatch, smatchpp: its
    metric and also_metrics) cannot read, or None when no metric of the dataset parses its answers."""
    from workflow_scripts.tasks import metrics

    parsing = [name for name in (settings.metric, *settings.also_metrics) if name in metrics.GRAPH_METRICS]
    if not parsing:
        return None
    source = settings.fields.get("answers", "answers")

    def check(row: Mapping[str, Any]) -> None:
        for index, answer in enumerate(row.get("answers") or ()):
            where = source if len(row["answers"]) == 1 else f"{source}[{index}]"
            problem = raw_records.penman_graph_problem(answer)  # the metrics' readers are lenient: smatch reads '(a / b' as '(a / b)'
            if problem:
                raise Rejected("unreadable_gold", where, f"gold graph {answer[:60]!r} is not one PENMAN graph "
                               f"({problem}), so metric {parsing[0]} would score it as read by guesswork; fix the graph")
            for metric in parsing:
                if not metrics.graph_readable(metric, answer):
                    raise Rejected("unreadable_gold", where, f"gold graph {answer[:60]!r} cannot be read by metric "
                                   f"{metric} (not valid PENMAN / AMR); fix the graph, or score the dataset with a "
                                   "metric for its answers")
    return check


def normalise(args: argparse.Namespace, settings: DatasetSettings, key: str, names: SourceNames) -> int:
    fmt = settings.format
    task = task_named(settings.task)
    try:
        check_encodings(args, settings, key, names)
    except WorkflowError as error:
        fail_with_report({"dataset": args.name, "raw": str(args.raw)}, [str(error)], args.report)
    own_normalisation = getattr(task, "normalise_source", None)
    if own_normalisation is not None:  # the task reads its raw files itself (e.g. plain text, line by line)
        if settings.unlabelled:
            raise ConfigError(f"{key}.unlabelled", f"task '{settings.task}' has no unlabelled splits; remove the key")
        return normalise_by_task(own_normalisation, args, settings, names)
    descriptions = {**REASONS, **getattr(task, "rejection_reasons", {})}  # a task's own reasons (images...)
    mapper = task.record_mapper(settings, key)
    mapper.raw_dir = args.raw  # files a record refers to (images) are found beside its split files
    try:  # what the mapper reads of the data as a whole (a label column's ClassLabel names and its one reading)
        getattr(mapper, "prepare", lambda raw_dir: None)(args.raw)
    except WorkflowError as error:
        fail_with_report({"dataset": args.name, "raw": str(args.raw)}, [names.translate(str(error))], args.report)
    gold_check = gold_graph_check(settings)
    rejections, splits, tallies = Rejections(), {}, {}
    for canonical in CANONICAL_SPLITS:
        if canonical not in settings.splits:
            continue
        rows, tally = normalise_split(mapper, args.raw, fmt, canonical, settings.splits[canonical], rejections, key, names,
                                     settings.on_invalid_text, settings.encoding, gold_check)
        splits[canonical], tallies[canonical] = rows, tally
        if tally.problem is None:
            try:
                check_submission_ids(rows, tally, settings, key)
            except ConfigError as error:
                tally.problem = str(error)
        if tally.unreadable:  # its rows are partial: no later split is judged against them, but every split is
            continue          # still read, so one run names each unreadable file (a later split's label set unchecked)
        try:
            mapper.split_done(canonical, rows)  # train first: a later split may be checked against it
        except WorkflowError as error:  # e.g. no label set from train: the later splits cannot be judged
            if rows:  # with no row kept, the rejections are the cause (tally_problem), not an empty label set
                tally.problem = tally.problem or str(error)
            if canonical == "train":
                break
    files = {canonical: tally.file for canonical, tally in tallies.items()}
    if "train" in tallies and tallies["train"].unreadable:  # against train's partial rows the overlap means nothing
        overlap, overlap_problem, overlaps = {"not_checked": "the train split could not be read to its end"}, [], []
    else:
        overlap, overlap_problem, overlaps = check_record_contamination(mapper, splits, settings, files, key)

    report = {
        "dataset": args.name,
        "raw": str(args.raw),
        "max_rejected_fraction": settings.max_rejected_fraction,
        "splits": {
            canonical: {
                "source_split": t.source_split, "file": t.file, "examined": t.examined, "kept": t.kept,
                "rejected": t.rejected, "rejected_fraction": t.rejected / t.examined if t.examined else None,
                "reasons": dict(t.reasons),
                **({"unlabelled": True, "gold_ignored": t.gold_records} if t.unlabelled else {}),
                **({"problem": t.problem, "counts_partial": t.unreadable} if t.problem else {}),
                "duplicates": t.duplicates, "duplicate_ids": t.duplicate_ids,
                **mapper.split_report(canonical, splits[canonical]),
            }
            for canonical, t in tallies.items()
        },
        "unlabelled": [canonical for canonical, t in tallies.items() if t.unlabelled],
        # Splits left unread because train failed (they are checked against it): the report says so.
        **({"splits_not_read": not_read} if (not_read := [canonical for canonical in CANONICAL_SPLITS
                                                          if canonical in settings.splits and canonical not in tallies])
           else {}),
        "reasons": {
            reason: {"count": count, "description": descriptions[reason], "examples": rejections.examples[reason]}
            for reason, count in sorted(rejections.counts.items())
        },
        **mapper.report(splits),
        "ignored_source_splits": sorted(
            set(raw_records.available_splits(args.raw, fmt)) - set(settings.splits.values())
        ),
        "contamination": overlap,
    }
    problems = [problem for canonical, tally in tallies.items()
                if (problem := tally_problem(tally, settings.max_rejected_fraction, key, canonical,
                                             getattr(mapper, "gold_source", None)))]
    problems += [problem for canonical, tally in tallies.items()
                 if (problem := duplicates_problem(tally, canonical, settings.duplicates.max_fraction, key))]
    problems += overlap_problem  # after the rejections: a file with bad rows is fixed first
    if problems:
        fail_with_report(report, problems, args.report)

    from datasets import DatasetDict

    data, problems = DatasetDict(), []
    for canonical in sorted(splits, key=lambda name: tallies[name].unlabelled):  # labelled splits give the types
        labelled = next((data[name] for name in data if not tallies[name].unlabelled), None)
        try:
            data[canonical] = to_dataset(splits[canonical], tallies[canonical].file, like=labelled)
        except WorkflowError as error:
            problems.append(str(error))
    if problems:
        fail_with_report(report, problems, args.report)
    data = DatasetDict({canonical: data[canonical] for canonical in splits})  # in canonical order
    unlabelled = {"unlabelled": report["unlabelled"]} if report["unlabelled"] else {}
    with atomic_path(args.out, directory=True) as out:
        data.save_to_disk(str(out))
        write_json(out / TASK_META, {"task": settings.task, **mapper.task_meta(), **unlabelled})
    write_json(args.report, report)
    failure_report_path(args.report).unlink(missing_ok=True)  # an earlier failure's, now stale
    for canonical, tally in tallies.items():
        print(f"{args.name}/{canonical}: kept {tally.kept} of {tally.examined} rows; rejected {dict(tally.reasons)}")
        print_split_notes(args.name, canonical, tally, report["splits"][canonical], mapper)
    for line in getattr(mapper, "notes", lambda: [])():  # what the task says of the data (a label mapping...)
        print(f"{args.name}: {line}")
    print_contamination(args.name, overlaps, settings)
    return 0


def print_split_notes(name: str, canonical: str, tally: SplitTally, entry: Mapping[str, Any], mapper) -> None:
    """What the log must say beside the counts: an unlabelled split, answers taken from a bare string."""
    if tally.unlabelled:
        print(f"{name}/{canonical}: unlabelled: no gold; predicted in the submission format, never scored")
        if tally.gold_records:
            print(f"{name}/{canonical}: warning: declared unlabelled, but all {tally.gold_records} rows hold "
                  f"'{mapper.gold_source}'; it is left out (remove '{canonical}' from unlabelled to score this split)")
    if entry.get("duplicates"):
        named = ", ".join(f"{row} = {earlier}" for row, earlier in entry["duplicate_ids"][:5])
        print(f"{name}/{canonical}: {entry['duplicates']} rows repeat an earlier row of the split (same input and gold; "
              f"e.g. {named}); all named in the report's duplicate_ids (the first {NAMED_DUPLICATES})")
    if entry.get("answers_as_bare_string"):
        print(f"{name}/{canonical}: {entry['answers_as_bare_string']} rows give their answers as one bare string "
              "where other rows give lists; each is taken as that row's one answer")


if __name__ == "__main__":
    run_main(main)
