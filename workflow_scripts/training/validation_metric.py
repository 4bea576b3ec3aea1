"""The task's metric during training (``training.validation.metric_examples``), beside the held-out loss.

At each validation point the model being trained is scored as the task's own ``evaluate`` scores (what
the evaluate stage runs: same prompts, decoding and scoring) on the first N rows of each dataset's
normalised validation split (a mixture: each component): over several processes each rank generates
its share of the rows and rank 0 scores them all (:func:`score`); every process receives the figures,
so every process selects and stops alike. ``criterion: metric`` selects the best adapter
by it (a mixture: the mean over its components, which the config allows only when they share one
metric). Scoring keeps every random generator's state, so training is the same with or without it.
"""
from __future__ import annotations

import contextlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workflow_scripts.core.entry_settings import VariantSettings
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.section_settings import EvaluationSettings
from workflow_scripts.training import distributed, training_setup
from workflow_scripts.core.settings import ValidationSettings
from workflow_scripts.tasks.base import Predictions
from workflow_scripts.training.validation import METRIC_KEY

# Metrics where lower is better (tasks/masked_lm's losses); every other metric is a score to maximise.
LOWER_IS_BETTER = frozenset({"mlm_loss", "perplexity"})


@dataclass
class MetricSource:
    """One dataset the validation metric scores: its name, metric and first ``metric_examples`` rows."""
    name: str
    metric: str
    rows: list[dict]


@dataclass
class ValidationMetric:
    """What scoring needs beside the model: the task, its tokenizer, the variant and the decoding settings."""
    task: Any
    tokenizer: Any
    variant: VariantSettings
    evaluation: EvaluationSettings
    sources: list[MetricSource]

    @property
    def lower_is_better(self) -> bool:
        return all(source.metric in LOWER_IS_BETTER for source in self.sources)


def open_metric(text: str | None, settings: ValidationSettings, model_dir: str,
                trust_remote_code: bool) -> ValidationMetric | None:
    """The ``--validation-metric`` argument (JSON: task, variant, evaluation {max_new_tokens, batch_size,
    max_length}, datasets [{name, data, metric}]) with its rows and tokenizer; None when the metric is off."""
    from workflow_scripts.data.normalised_data import load_rows
    from workflow_scripts.model.model_loading import load_tokenizer
    from workflow_scripts.tasks import task_named
    from workflow_scripts.tasks.templates import check_row_templates

    examples = settings.metric_examples
    if examples is None:
        if text:
            raise WorkflowError("argument --validation-metric: given, but training.validation.metric_examples "
                                "is not set; set it or drop the argument")
        return None
    if not settings.every_steps:
        raise WorkflowError("training.validation.metric_examples is set but every_steps is not; set "
                            "training.validation.every_steps")
    if not text:
        raise WorkflowError("training.validation.metric_examples is set but train got no --validation-metric "
                            "argument (the workflow's train rule passes it)")
    try:
        spec = json.loads(text)
        task = task_named(spec["task"], "argument --validation-metric: task")
        variant = task.check_variant(VariantSettings.parse(spec["variant"], task.name, source="--validation-metric",
                                                           key="variant"))
        evaluation = {**spec["evaluation"], "split": "validation", "max_examples": examples, "gpus": 0}
        datasets = [(entry["name"], entry["data"], entry["metric"]) for entry in spec["datasets"]]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise WorkflowError(f"argument --validation-metric: expected JSON with task, variant, evaluation and "
                            f"datasets [{{name, data, metric}}] ({type(error).__name__}: {error})") from None
    evaluation = EvaluationSettings.parse(evaluation, "evaluation", "--validation-metric")
    sources = []
    for name, data_dir, metric in datasets:
        if metric not in task.metrics:
            raise WorkflowError(f"argument --validation-metric: dataset {name!r}: {metric!r} is not a metric of "
                                f"task {task.name!r} (choose from {list(task.metrics)})")
        if not Path(data_dir, "validation").is_dir():
            raise WorkflowError(f"{data_dir}: no 'validation' split to score, but training.validation."
                                f"metric_examples is set; give dataset '{name}' a validation split or unset it")
        rows = load_rows(data_dir, "validation", examples)
        check_row_templates(variant, rows, data_dir, "validation")
        sources.append(MetricSource(name, metric, rows))
    if not sources:
        raise WorkflowError("argument --validation-metric: no dataset to score")
    return ValidationMetric(task, load_tokenizer(model_dir, trust_remote_code), variant, evaluation, sources)


@contextlib.contextmanager
def _random_state_kept(device: torch.device):
    """Whatever scoring draws (nothing, for greedy decoding and fixed masks) leaves training's generators as
    they were: the run is the same with and without the metric."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _splits(task) -> bool:
    """A task whose predictions and scoring are apart (``predict`` / ``score_predictions``: generation,
    vision_language, classification) has its rows generated by every rank; the others (conversation,
    masked_lm) are scored by rank 0 alone."""
    return hasattr(task, "predict") and hasattr(task, "score_predictions")


def rank_block(count: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s contiguous block of ``count`` rows: sizes differ by one at most, the larger first, so
    rank 0's is never empty (its predictions carry the details scoring reads) and concatenating the blocks in
    rank order gives the rows' order back."""
    size, larger = divmod(count, world_size)  # the first ``larger`` ranks take one row more

    def start(of_rank: int) -> int:
        return of_rank * size + min(of_rank, larger)

    return slice(start(rank), start(rank + 1))


@contextlib.contextmanager
def _scoring_mode(setup: training_setup.TrainingSetup):
    """Eval mode, no gradients, training's autocast, every random generator's state kept."""
    was_training = setup.model.training
    setup.model.eval()
    try:
        with _random_state_kept(setup.context.device), torch.no_grad(), setup.autocast():
            yield
    finally:
        setup.model.train(was_training)


def _figures(state: ValidationMetric, scores: dict[str, float]) -> dict[str, float]:
    if len(scores) == 1:
        return {METRIC_KEY: next(iter(scores.values()))}
    values = {f"{METRIC_KEY}/{name}": value for name, value in scores.items()}
    if len({source.metric for source in state.sources}) == 1:
        values[METRIC_KEY] = sum(scores.values()) / len(scores)
    return values


def _merged(source: MetricSource, parts: list) -> Predictions:
    """The ranks' predictions (rank order) as one process's: every row once, in the rows' order."""
    first = parts[0]  # rank 0's block is never empty
    merged = Predictions([record for part in parts if part is not None for record in part.records],
                         first.answer_field, first.details)
    if [record["id"] for record in merged.records] != [row["id"] for row in source.rows]:
        raise WorkflowError(f"validation metric, dataset {source.name!r}: the ranks' predictions do not cover its "
                            f"{len(source.rows)} rows once each in order (a bug; please report it)")
    return merged


def score(setup: training_setup.TrainingSetup, state: ValidationMetric) -> dict[str, float]:
    """The task's corpus score per dataset, as train_log fields: ``validation_metric`` (alone), or
    ``validation_metric/<dataset>`` per component and their mean as ``validation_metric`` when they share
    one metric. Every process gets the same figures: one process's.

    Over several processes, a task with ``predict`` and ``score_predictions`` has each rank generate its
    contiguous block of the rows (:func:`rank_block`) through the unwrapped PEFT model (no DDP collective);
    rank 0 gathers the predictions, not scores, in the rows' order and scores them all at once with the task's
    own scoring (a corpus metric such as smatch or macro-F1 is not a mean of per-rank figures), as evaluate
    does. The figure equals one process's up to which rows share a padded generation batch. Other tasks
    are scored by rank 0 alone while the others wait (``distributed.on_main``). FSDP is refused with the
    metric (``fsdp.check_settings``): each rank's generation stops at its own length, and every sharded
    forward needs all ranks.
    """
    context, task = setup.context, state.task
    if not _splits(task):
        def evaluated() -> dict[str, float]:  # rank 0 alone: generation takes as long as metric_examples asks
            with _scoring_mode(setup):
                return _figures(state, {source.name: float(task.evaluate(
                    setup.peft_model, state.tokenizer, state.variant, source.rows, source.metric, state.evaluation,
                    context.device).score) for source in state.sources})

        return distributed.on_main(context, "scoring the validation metric", evaluated, share_result=True)

    def predicted() -> list[Predictions | None]:  # every rank: its block of each dataset's rows
        results = []
        with _scoring_mode(setup):
            for source in state.sources:
                rows = source.rows[rank_block(len(source.rows), context.rank, context.world_size)]
                results.append(task.predict(setup.peft_model, state.tokenizer, state.variant, rows, source.metric,
                                            state.evaluation, context.device) if rows else None)
                print(f"validation metric {source.name}: rank {context.rank} generated {len(rows)} of "
                      f"{len(source.rows)} rows", flush=True)
        return results

    gathered = distributed.gather_on_main(context, "generating the validation metric's predictions", predicted)

    def scored() -> dict[str, float]:  # rank 0: the task's scoring over all rows
        return _figures(state, {source.name: float(task.score_predictions(
            source.rows, _merged(source, [part[index] for part in gathered]), source.metric).score)
            for index, source in enumerate(state.sources)})

    # The others wait for it in on_main and get the figures: every process decides alike.
    return distributed.on_main(context, "scoring the validation metric", scored, share_result=True)
