"""The ``power`` stage: the minimum detectable effect of one dataset's comparison, before any training.

    python -m workflow_scripts.power --model-name M --dataset-name D --base VARIANT=DIR [...] --seeds K
        --comparison JSON --out-json FILE --out-markdown FILE

Reads the untrained model's evaluation (``DIR/eval.json``, ``DIR/predictions.jsonl``, one per variant's
prompt), estimates the MDE (analysis/power.py: Miller 2024, and the variance assumption it names), writes a
JSON and a Markdown report and prints one line. With ``comparison.min_detectable_effect`` set and the
estimate above it, the stage fails naming what would fit, and the rule's output (an input of sanity) is
never written: no training job starts.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from workflow_scripts.analysis import power
from workflow_scripts.core import json_files
from workflow_scripts.core.atomic_output import atomic_path, write_json
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.core.section_settings import ComparisonSettings
from workflow_scripts.core.stage_arguments import StageArgumentParser
from workflow_scripts.tasks import metrics


def parse_args(argv: Sequence[str] | None):
    parser = StageArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--dataset-name", required=True)
    parser.add_argument("--base", action="append", required=True, metavar="VARIANT=DIR",
                        help="the untrained model's evaluation directory with one variant's prompt (repeatable)")
    # The rule passes none (a seed added must not rerun the estimate); the seed-free estimate is issue 36's.
    parser.add_argument("--seeds", type=int, default=1, help="seeds per variant in the comparison (default 1)")
    parser.add_argument("--comparison", required=True, help="the config's comparison settings as JSON")
    parser.add_argument("--out-json", required=True)
    parser.add_argument("--out-markdown", required=True)
    return parser.parse_args(argv)


def read_base(text: str) -> tuple[str, str, list[dict]]:
    """(variant, metric, prediction records) of one ``VARIANT=DIR``, checked against its eval.json."""
    variant, sep, directory = text.partition("=")
    if not sep or not variant or not directory:
        raise WorkflowError(f"argument --base: expected VARIANT=DIR, got {text!r}")
    summary_path, predictions_path = Path(directory, "eval.json"), Path(directory, "predictions.jsonl")
    summary = json_files.read_json_object(summary_path, "run evaluate_base first")
    metric = summary.get("metric")
    if not isinstance(metric, str):
        raise WorkflowError(f"{summary_path}: field 'metric' is missing")
    width = metrics.counts_width(metric)
    records = []
    for number, record in json_files.read_jsonl_objects(predictions_path, "run evaluate_base first"):
        value = record.get("counts") if width else record.get("score")
        numbers = value if width else [value]
        if not (isinstance(numbers, list) and len(numbers) == (width or 1)
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in numbers)):
            field = f"'counts' ({width} numbers)" if width else "'score' (a finite number)"
            raise WorkflowError(f"{predictions_path} line {number}: field {field} is missing or malformed")
        records.append(record)
    if len(records) != summary.get("n_examples"):
        raise WorkflowError(f"{predictions_path}: {len(records)} rows, but {summary_path} says "
                            f"n_examples={summary.get('n_examples')!r}; rerun evaluate_base")
    return variant, metric, records


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    limit = ComparisonSettings.from_json(args.comparison).min_detectable_effect
    if args.seeds < 1:
        raise WorkflowError(f"argument --seeds: expected a positive number of seeds, got {args.seeds}")
    bases = [read_base(text) for text in args.base]
    metric_names = {metric for _, metric, _ in bases}
    if len(metric_names) != 1:
        raise WorkflowError(f"dataset '{args.dataset_name}': the untrained model's evaluations use different metrics "
                            f"{sorted(metric_names)}")
    estimate = power.estimate(args.dataset_name, args.model_name, metric_names.pop(),
                              {variant: records for variant, _, records in bases}, args.seeds)
    print(estimate.line())
    power.check_threshold(estimate, limit)
    write_json(args.out_json, {**estimate.to_dict(), "min_detectable_effect": limit})
    with atomic_path(args.out_markdown) as temporary:
        Path(temporary).write_text(power.markdown(estimate))
    return 0


if __name__ == "__main__":
    run_main(main)
