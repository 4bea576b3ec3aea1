"""What the comparison's scores leave out: the evaluated split's rows that normalise excluded, per dataset.

A row rejected at normalise (``unknown_label``, ``duplicate_id``, a malformed record; up to
``datasets.<name>.max_rejected_fraction``) is in no prediction file, so no score counts it. Where the
excluded rows are ones a model would get wrong (a classifier's test row whose label lies outside the
label set can never be predicted), every score is higher than on the whole split. The comparison
report therefore lists, per evaluated dataset, how many rows of the scored split were excluded and
why, read from that dataset's ``normalise_report.json`` (normalise's ``splits.<split>``: ``examined``,
``rejected`` and ``reasons``; a text corpus's ``lines`` and ``blank`` lines, which are not examples).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError


@dataclass(frozen=True)
class Exclusions:
    """The rows of one dataset's evaluated split that normalise left out, by reason."""
    dataset: str
    split: str
    examined: int
    excluded: int
    reasons: dict[str, int]
    blank_lines: int = 0  # a text corpus's skipped blank lines (not examples, so not excluded rows)


def read_reports(paths: Sequence[str | Path]) -> dict[str, tuple[Path, dict]]:
    """dataset name -> (path, normalise report), from the reports' own ``dataset`` field."""
    reports: dict[str, tuple[Path, dict]] = {}
    for path in map(Path, paths):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise WorkflowError(f"{path}: not found; run the normalise rule first") from None
        except (ValueError, UnicodeDecodeError) as error:
            raise WorkflowError(f"{path}: not a normalise report (valid JSON): {error}") from None
        name = report.get("dataset") if isinstance(report, dict) else None
        if not isinstance(name, str) or not isinstance(report.get("splits"), dict):
            raise WorkflowError(f"{path}: not a normalise report (a JSON object with 'dataset' and 'splits'); "
                                "rerun normalise")
        if name in reports:
            raise WorkflowError(f"{path}: a second normalise report for dataset '{name}' (the first is {reports[name][0]})")
        reports[name] = (path, report)
    return reports


def _count(entry: Mapping[str, Any], key: str, path: Path, split: str) -> int:
    value = entry.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WorkflowError(f"{path}: splits.{split}.{key} is {value!r}, not a row count; rerun normalise")
    return value


def exclusions(reports: Mapping[str, tuple[Path, dict]], dataset: str, split: str) -> Exclusions:
    """The excluded rows of ``dataset``'s ``split``, refused when its report or split is missing."""
    if dataset not in reports:
        raise WorkflowError(f"dataset '{dataset}': no normalise report among --normalise-reports "
                            f"({sorted(reports)}); pass results/data/{dataset}/normalise_report.json")
    path, report = reports[dataset]
    entry = report["splits"].get(split)
    if not isinstance(entry, dict):
        raise WorkflowError(f"{path}: no split '{split}' (the evaluated split; it has {sorted(report['splits'])}); "
                            "rerun normalise")
    if "examined" in entry:  # records: each examined row was kept or rejected for a reason
        reasons = entry.get("reasons", {})
        if not isinstance(reasons, dict) or not all(isinstance(n, int) for n in reasons.values()):
            raise WorkflowError(f"{path}: splits.{split}.reasons is not a mapping reason -> count; rerun normalise")
        excluded = _count(entry, "rejected", path, split)
        if sum(reasons.values()) != excluded:
            raise WorkflowError(f"{path}: splits.{split}: {excluded} rows rejected but the reasons count "
                                f"{sum(reasons.values())}; rerun normalise")
        return Exclusions(dataset, split, _count(entry, "examined", path, split), excluded, dict(reasons))
    if "lines" in entry:  # a text corpus: blank lines are skipped, every other line is an example
        return Exclusions(dataset, split, _count(entry, "kept", path, split), 0, {},
                          _count(entry, "blank", path, split))
    raise WorkflowError(f"{path}: splits.{split} has neither 'examined' (records) nor 'lines' (a text corpus); "
                        "rerun normalise")


def describe(item: Exclusions, scored: int) -> str:
    """One line of the report, e.g. "topics: 1 of 41 rows of split 'test' excluded at normalise (unknown_label 1); 40 scored"."""
    if item.excluded:
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(item.reasons.items(), key=lambda r: (-r[1], r[0])))
        what = f"{item.excluded} of {item.examined} rows of split '{item.split}' excluded at normalise ({reasons})"
    else:
        what = f"no row of split '{item.split}' excluded at normalise ({item.examined} rows"
        what += f"; {item.blank_lines} blank lines skipped, not examples)" if item.blank_lines else ")"
    return f"- {item.dataset}: {what}; {scored} scored."


def lines(items: Sequence[tuple[Exclusions, int]]) -> list[str]:
    """The report's section: one line per (exclusions, rows scored), and what an exclusion does to a score."""
    if not items:
        return []
    return ["Rows of the scored split excluded at normalise (each dataset's normalise_report.json) are in no score; "
            "where they are rows a model would get wrong (a classifier's unknown_label rows can never be predicted "
            "right), every score is higher than it would be on the whole split:", "",
            *(describe(item, scored) for item, scored in items), ""]
