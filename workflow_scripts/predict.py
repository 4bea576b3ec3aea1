"""The ``predict`` stage: an unlabelled split (a leaderboard's test set, answers withheld) predicted in
the leaderboard's submission format, never scored.

The model and adapter load as ``evaluate`` loads them (``evaluate.loaded_model``), and the task's own
prediction path (``Task.predict``: the same decoding and extraction ``evaluate`` scores) runs over every
row of the split (``evaluation.max_examples`` does not apply: a submission needs every id). Outputs:
the submission (``[{<id_key>: id, <answer_key>: answer}, ...]`` as JSON, or one object per line as
JSONL), every prediction with its prompt and raw output (JSONL), and a manifest with the counts. An
output the extractor could not parse is submitted as the empty string and counted (``n_unparseable``).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts import evaluate
from workflow_scripts.core.atomic_output import write_json, write_jsonl
from workflow_scripts.core.entry_settings import SubmissionSettings
from workflow_scripts.core.errors import ConfigError, WorkflowError, run_main
from workflow_scripts.core.run_manifest import build_manifest
from workflow_scripts.core.section_settings import EvaluationSettings
from workflow_scripts.core.stage_arguments import StageArgumentParser, json_object_setting
from workflow_scripts.data.normalised_data import load_rows, read_task_meta
from workflow_scripts.model import model_loading, quantization
from workflow_scripts.tasks import task_named
from workflow_scripts.tasks.templates import check_row_templates

SUBMISSION_DEFAULTS = SubmissionSettings().to_dict()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = StageArgumentParser(description=__doc__.splitlines()[0])
    evaluate.add_prediction_arguments(parser, "predict with", "the manifest")
    parser.add_argument("--split", required=True, help="the unlabelled split to predict (task_meta.json lists it)")
    parser.add_argument("--submission", required=True, help="the dataset's submission settings as JSON")
    parser.add_argument("--submission-out", required=True, help="the submission file (.json or .jsonl, as its format)")
    parser.add_argument("--predictions-out", required=True, help="every prediction with prompt and raw output (JSONL)")
    parser.add_argument("--manifest-out", required=True)
    return parser.parse_args(argv)


def submission_settings(text: str) -> SubmissionSettings:
    """``--submission``: ``datasets.<name>.submission`` as the rule passes it (its defaults filled)."""
    settings = {**SUBMISSION_DEFAULTS, **json_object_setting(text, "--submission")}
    unknown = sorted(set(settings) - set(SUBMISSION_DEFAULTS))
    if unknown:
        raise ConfigError("submission", f"unknown keys {unknown} (known: {sorted(SUBMISSION_DEFAULTS)})")
    if settings["format"] not in ("json", "jsonl"):
        raise ConfigError("submission.format", f"must be json or jsonl, got {settings['format']!r}")
    if settings["id_type"] not in ("string", "integer"):
        raise ConfigError("submission.id_type", f"must be string or integer, got {settings['id_type']!r}")
    return SubmissionSettings(**settings)


def submitted_id(row_id: str, id_type: str, where: str) -> str | int:
    if id_type == "string":
        return row_id
    try:
        return int(row_id)
    except ValueError:
        raise WorkflowError(f"{where}: id {row_id!r} is not an integer, but submission.id_type is integer; "
                            "set submission.id_type: string") from None


def submission_entries(rows: Sequence[Mapping[str, Any]], answers: Sequence[str | None],
                       settings: SubmissionSettings, where: str) -> list[dict]:
    """One entry per row, in the split's order: its id and its answer ('' where none could be parsed)."""
    return [{settings.id_key: submitted_id(row["id"], settings.id_type, f"{where} row {index}"),
             settings.answer_key: answer if answer is not None else ""}
            for index, (row, answer) in enumerate(zip(rows, answers, strict=True))]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    task = task_named(args.task, "argument --task")
    if not hasattr(task, "predict"):
        raise WorkflowError(f"argument --task: task {args.task!r} cannot predict an unlabelled split")
    from workflow_scripts.core.entry_settings import VariantSettings

    variant = task.check_variant(VariantSettings.from_json(args.variant, args.task, args.variant_name))
    if args.metric not in task.metrics:
        raise WorkflowError(f"argument --metric: {args.metric!r} is not a metric of task {args.task!r} "
                            f"(choose from {list(task.metrics)})")
    evaluation = EvaluationSettings.from_json(args.evaluation)
    quantization.leave_out_bitsandbytes("workflow_scripts.predict",
                                        quantization.evaluation_quantises(args.adapter, evaluation.qlora_base))
    submission = submission_settings(args.submission)
    suffix = Path(args.submission_out).suffix
    if suffix != f".{submission.format}":
        raise WorkflowError(f"argument --submission-out: {args.submission_out} ends in {suffix!r}, but "
                            f"submission.format is {submission.format}; name it *.{submission.format}")
    seed = evaluate.parse_seed(args.seed)

    rows = load_rows(args.data, args.split, None)  # every row: a submission needs every id
    where = f"{args.data} split '{args.split}'"
    check_row_templates(variant, rows, args.data, args.split)
    model_loading.check_model_directory(args.model)
    model_loading.check_task_architecture(args.model, task)  # a causal LM for masked_lm: one line, no traceback
    task_meta = read_task_meta(args.data, args.task)
    if args.split not in task_meta.get("unlabelled", []):
        raise WorkflowError(f"{where} is labelled (task_meta.json unlabelled: {task_meta.get('unlabelled', [])}); "
                            "the evaluate rule scores it, predict writes submissions for unlabelled splits only")
    label = f"predict {args.model_name or Path(args.model).name}/{args.dataset_name}/{args.variant_name}/{seed}"
    with evaluate.loaded_model(args, task, task_meta, evaluation.gpus, label, evaluation.qlora_base,
                               evaluation.compute_dtype) as loaded:
        predicted = task.predict(loaded.model, loaded.tokenizer, variant, rows, args.metric, evaluation, loaded.device)
    answers = [record[predicted.answer_field] for record in predicted.records]
    entries = submission_entries(rows, answers, submission, where)
    manifest = {
        **evaluate.run_identity(args, seed),
        "split": args.split,
        "task": args.task,
        "scored": False,  # the split has no gold: the leaderboard scores the submission
        "n_examples": len(entries),
        "n_unparseable": predicted.unparseable,
        "unparseable_ids": [record["id"] for record in predicted.records if not record["parsed"]][:20],
        "submission": {**submission.to_dict(), "file": str(args.submission_out)},
        **predicted.details,
        **evaluate.model_facts(args, loaded),
        "manifest": build_manifest("predict", {"evaluation": evaluation.to_dict(), "variant": task.variant_record(variant), "metric": args.metric,
                                               "submission": submission.to_dict()}),
    }
    write_jsonl(args.predictions_out, predicted.records)
    if submission.format == "json":
        write_json(args.submission_out, entries)
    else:
        write_jsonl(args.submission_out, entries)
    write_json(args.manifest_out, manifest)
    print(f"{args.dataset_name}/{args.variant_name}/seed {seed}: {len(entries)} predictions for unlabelled split "
          f"'{args.split}' written to {args.submission_out} (not scored: no gold); {predicted.unparseable} unparseable, "
          "submitted as ''")
    return 0


if __name__ == "__main__":
    run_main(main)
