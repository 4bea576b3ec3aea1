"""The ``cross_contamination`` stage: held-out rows of one dataset that repeat a train row of ANOTHER dataset
of the same run, checked before the run's gate.

    python -m workflow_scripts.cross_contamination --train NAME=DIR [...] --checked NAME=DIR [...]
        --settings JSON --out FILE

normalise checks each dataset's validation and test rows against its own train split. A run that trains
on a mixture, or that is scored on an evaluation-only dataset, can still see test rows in training when
two datasets share examples (ChartQA and a chart-QA set built from the same charts, a classifier's test
texts scraped from the pretraining corpus of another component). Here each checked dataset's validation
and test splits (normalised) are keyed as normalise keys them (data/contamination.py) and compared with the
train splits of every trained dataset other than itself; above the checked dataset's
``contamination.max_fraction`` the stage stops unless its ``contamination.accept`` is true. The report
(JSON) names the overlap per checked split with example ids as ``dataset/id``.
"""
from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.core.atomic_output import write_json
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


def keyed(name: str, split, skip: Sequence[str]) -> contamination.Keyed:
    """A split's key batches with its ids prefixed by the dataset's name, so a message says which dataset."""
    for ids, keys, pairs in contamination.keyed_batches(split, skip):
        yield PrefixedIds(name, ids), keys, pairs


def check_dataset(name: str, splits, trained: Mapping[str, Any], derived: Mapping[str, Sequence[str]]):
    """The checked dataset's validation and test splits against the train splits of the other trained datasets."""
    others = {other: data for other, data in trained.items() if other != name and "train" in data}
    if not others:
        return []

    def train_stream():
        return itertools.chain.from_iterable(keyed(other, data["train"], derived.get(other, ()))
                                             for other, data in others.items())

    checked = {split: functools.partial(keyed, name, splits[split], derived.get(name, ()))
               for split in contamination.CHECKED_SPLITS if split in splits}
    return [(sorted(others), result) for result in contamination.check(train_stream, checked)]


def problem(name: str, compared: Sequence[str], result: contamination.SplitOverlap, limits: Mapping[str, Any]) -> str | None:
    if not contamination.exceeds(result, limits) or limits["accept"]:
        return None
    named = ", ".join(f"'{e['id']}' = '{e['train_id']}'" for e in result.examples(contamination.EXAMPLES))
    return (f"datasets.{name}: {result.overlapping} of {result.checked} rows of split '{result.split}' "
            f"({result.fraction:.1%}) repeat a train row of {', '.join(compared)} (same input, ignoring case, spacing "
            f"and Unicode form), more than datasets.{name}.contamination.max_fraction = {limits['max_fraction']}; "
            f"overlapping ids: {named}{', ...' if result.overlapping > contamination.EXAMPLES else ''}; deduplicate "
            f"the datasets, or set datasets.{name}.contamination.accept: true to run anyway")


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
        limits = settings[name]["contamination"]
        for compared, result in check_dataset(name, opened[name], {t: opened[t] for t in trained}, derived):
            entry = report["checked"].setdefault(name, {"compared_with": compared, "splits": {}})
            entry["splits"][result.split] = {
                "checked": result.checked, "overlapping": result.overlapping, "fraction": result.fraction,
                "examples": result.examples(), "above_max_fraction": contamination.exceeds(result, limits),
                "accepted": contamination.exceeds(result, limits) and limits["accept"]}
            print(f"{name} {result.split} against {', '.join(compared)}: {contamination.summary(result, limits)}")
            message = problem(name, compared, result, limits)
            if message:
                problems.append(message)
    if problems:
        raise WorkflowError(problems[0])  # nothing written: the gate waits for a clean (or accepted) check
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    run_main(main)
