"""The ``cross_contamination`` stage: held-out rows of one dataset that repeat a train row of ANOTHER dataset
of the same run, checked before the run's gate.

    python -m workflow_scripts.cross_contamination --train NAME=DIR [...] --checked NAME=DIR [...]
        --settings JSON --out FILE

normalise checks each dataset's validation and test rows against its own train split. A run that trains
on a mixture, or that is scored on an evaluation-only dataset, can still see test rows in training when
two datasets share examples (ChartQA and a chart-QA set built from the same charts, a classifier's test
texts scraped from the pretraining corpus of another component). Here each checked dataset's validation
and test splits (normalised) are keyed as normalise keys them (data/contamination.py) and compared with the
train split of each trained dataset other than itself, on the input fields the two share (the task's own:
question, images, text, text_pair, messages; and the extra fields, an image path or a context, that both
carry), so a column only one dataset has (a ``source``, a title) hides no repeat; above the checked dataset's
``contamination.max_fraction`` the stage stops unless its ``contamination.accept`` is true. The report
(JSON) names, per checked dataset, the fields compared with each other dataset (``fields_compared``) and
the overlap per checked split (in all, and per dataset) with example ids as ``dataset/id``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.core.atomic_output import write_json
from workflow_scripts.core.entry_settings import ContaminationSettings
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.core.stage_arguments import StageArgumentParser, json_setting
from workflow_scripts.data import contamination


def named_directory(text: str, flag: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise WorkflowError(f"argument {flag}: expected NAME=DIR, got {text!r}")
    if not Path(directory).is_dir():
        raise WorkflowError(f"argument {flag}: {directory} is not a normalised data directory")
    return name, Path(directory)


def open_splits(directory: Path) -> Mapping[str, Any]:
    from datasets import load_from_disk

    return load_from_disk(str(directory))


class PrefixedIds:
    """A batch's ids read as ``dataset/id``. Only the ids of overlapping rows are ever read, so nothing is
    converted per row (a 10M-line corpus streams past untouched)."""

    def __init__(self, name: str, ids):
        self.name, self.ids = name, ids

    def __getitem__(self, index: int) -> str:
        value = self.ids[index]
        return f"{self.name}/{value.as_py() if hasattr(value, 'as_py') else value}"


def keyed(name: str, split, skip: Sequence[str], only: Sequence[str]) -> contamination.Keyed:
    """A split's key batches on the ``only`` input fields, with its ids prefixed by the dataset's name, so a
    message says which dataset."""
    for ids, keys, pairs in contamination.keyed_batches(split, skip, only=only):
        yield PrefixedIds(name, ids), keys, pairs


def input_fields(splits, skip: Sequence[str]) -> list[str]:
    """The input fields of a dataset's rows (every canonical field but the id, the gold and derived fields)."""
    columns = dict.fromkeys(column for split in splits.values() for column in split.column_names)
    return contamination.key_fields(columns, skip)


@dataclass
class CrossOverlap:
    """One checked split against every other trained dataset: the overlap with each (compared on the fields
    the two share, :func:`contamination.compared_fields`) and the rows overlapping any of them."""

    total: contamination.SplitOverlap
    by_dataset: dict  # other dataset -> its SplitOverlap
    fields: dict      # other dataset -> the fields compared with it


def check_dataset(name: str, splits, trained: Mapping[str, Any], derived: Mapping[str, Sequence[str]]) -> list[CrossOverlap]:
    """The checked dataset's validation and test splits against the train split of each other trained dataset.

    Each pair of datasets is compared on its own fields (the task's input fields, and the extra fields both
    carry), so a column only one of them has does not hide a repeated question; a row counts once however
    many datasets repeat it."""
    import numpy as np

    others = {other: data for other, data in trained.items() if other != name and "train" in data}
    names = [split for split in contamination.CHECKED_SPLITS if split in splits]
    if not others or not names:
        return []
    own = input_fields({split: splits[split] for split in names}, derived.get(name, ()))
    per_dataset, fields = {}, {}
    for other, data in others.items():
        fields[other] = contamination.compared_fields(own, input_fields({"train": data["train"]}, derived.get(other, ())))
        train = functools.partial(keyed, other, data["train"], derived.get(other, ()), fields[other])
        checked = {split: functools.partial(keyed, name, splits[split], derived.get(name, ()), fields[other])
                   for split in names}
        per_dataset[other] = contamination.check(train, checked)
    results = []
    for index, split in enumerate(names):
        mine = {other: overlaps[index] for other, overlaps in per_dataset.items()}
        found = np.logical_or.reduce([result.found for result in mine.values()])
        total = contamination.SplitOverlap(split, checked=len(found), overlapping=int(found.sum()), found=found)
        for result in mine.values():  # examples: each dataset's first overlapping rows, a row named once
            named = {test_id for test_id, _ in total.first}
            total.first += [(test_id, key) for test_id, key in result.first if test_id not in named]
            total.train_ids.update(result.train_ids)
        results.append(CrossOverlap(total, mine, fields))
    return results


def described(fields: Mapping[str, Sequence[str]]) -> str:
    """``'question + images'`` when every dataset was compared on the same fields, else per dataset."""
    kinds = {tuple(names) for names in fields.values()}
    if len(kinds) == 1:
        return " + ".join(next(iter(kinds)))
    return "; ".join(f"{' + '.join(names)} with {other}" for other, names in fields.items())


def problem(name: str, compared: Sequence[str], result: contamination.SplitOverlap, limits: Mapping[str, Any],
            fields: str = "input") -> str | None:
    if not contamination.exceeds(result, limits) or limits.accept:
        return None
    named = ", ".join(f"'{e['id']}' = '{e['train_id']}'" for e in result.examples(contamination.EXAMPLES))
    return (f"datasets.{name}: {result.overlapping} of {result.checked} rows of split '{result.split}' "
            f"({result.fraction:.1%}) repeat a train row of {', '.join(compared)} (same {fields}, ignoring case, "
            f"spacing and Unicode form), more than datasets.{name}.contamination.max_fraction = {limits.max_fraction}; "
            f"overlapping ids: {named}{', ...' if result.overlapping > contamination.EXAMPLES else ''}; deduplicate "
            f"the datasets, or set datasets.{name}.contamination.accept: true to run anyway")


def contamination_limits(value: Any, name: str) -> ContaminationSettings:
    """``datasets.<name>.contamination`` as the rule passes it (its defaults filled) in ``--settings``."""
    try:
        return ContaminationSettings(**value)
    except TypeError:
        raise WorkflowError(f"argument --settings: {name}.contamination: expected {{max_fraction, accept}}, "
                            f"got {value!r:.80}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = StageArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="append", default=[], help="NAME=DIR: a trained dataset's normalised data")
    parser.add_argument("--checked", action="append", default=[], help="NAME=DIR: a dataset whose held-out rows "
                        "are checked against the other trained datasets")
    parser.add_argument("--settings", required=True, help="JSON {name: {contamination: {...}, derived: [...]}} for "
                        "every dataset named")
    parser.add_argument("--out", required=True, type=Path, help="the report (JSON)")
    args = parser.parse_args(argv)
    settings = json_setting(args.settings, "--settings")
    trained = dict(named_directory(text, "--train") for text in args.train)
    checked = dict(named_directory(text, "--checked") for text in args.checked)
    missing = sorted((set(trained) | set(checked)) - set(settings))
    if missing:
        raise WorkflowError(f"argument --settings: no settings for {missing}")
    derived = {name: list(settings[name].get("derived", [])) for name in settings}
    opened = {name: open_splits(directory) for name, directory in {**trained, **checked}.items()}
    report, problems = {"trained": sorted(trained), "checked": {}}, []
    for name in checked:
        limits = contamination_limits(settings[name].get("contamination"), name)
        for cross in check_dataset(name, opened[name], {t: opened[t] for t in trained}, derived):
            result, compared = cross.total, sorted(cross.by_dataset)
            entry = report["checked"].setdefault(name, {"compared_with": compared, "fields_compared": cross.fields,
                                                        "splits": {}})
            entry["splits"][result.split] = {
                "checked": result.checked, "overlapping": result.overlapping, "fraction": result.fraction,
                "overlapping_by_dataset": {other: overlap.overlapping for other, overlap in cross.by_dataset.items()},
                "examples": result.examples(), "above_max_fraction": contamination.exceeds(result, limits),
                "accepted": contamination.exceeds(result, limits) and limits.accept}
            print(f"{name} {result.split} against {', '.join(compared)} (on {described(cross.fields)}): "
                  f"{contamination.summary(result, limits)}")
            message = problem(name, compared, result, limits, described(cross.fields))
            if message:
                problems.append(message)
    if problems:
        raise WorkflowError(problems[0])  # nothing written: the gate waits for a clean (or accepted) check
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    run_main(main)
