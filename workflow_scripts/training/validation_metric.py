"""The task's metric during training (``training.validation.metric_examples``), beside the held-out loss.

At each validation point the main process scores the model being trained with the task's own
``evaluate`` (what the evaluate stage runs: same prompts, decoding and scoring) on the first N rows of
each dataset's normalised validation split (a mixture: each component); the other processes receive
the figures, so every process selects and stops alike. ``criterion: metric`` selects the best adapter
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

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.section_settings import EvaluationSettings
from workflow_scripts.training import distributed, training_setup
from workflow_scripts.core.settings import ValidationSettings
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
    variant: dict
    evaluation: EvaluationSettings
    sources: list[MetricSource]

    @property
    def lower_is_better(self) -> bool:
        return all(source.metric in LOWER_IS_BETTER for source in self.sources)


def open_metric(text: str | None, settings: ValidationSettings, model_dir: str,
                trust_remote_code: bool) -> ValidationMetric | None:
    """The ``--validation-metric`` argument (JSON: task, variant, evaluation {max_new_tokens, batch_size,
    max_length}, datasets [{name, data, metric}]) with its rows and tokenizer; None when the metric is off."""
    from workflow_scripts import evaluate
    from workflow_scripts.model.model_loading import load_tokenizer
    from workflow_scripts.tasks import task_named

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
        variant = task.check_variant(spec["variant"])
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
        rows = evaluate.load_test_rows(data_dir, "validation", examples)
        evaluate.check_templates(variant, rows, data_dir, "validation")
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


def score(setup: training_setup.TrainingSetup, state: ValidationMetric) -> dict[str, float]:
    """The task's corpus score per dataset, as train_log fields: ``validation_metric`` (alone), or
    ``validation_metric/<dataset>`` per component and their mean as ``validation_metric`` when they share
    one metric. Computed on the main process with its model; every process gets the same figures."""
    context = setup.context

    def scored() -> dict[str, float]:  # rank 0 alone: generation takes as long as metric_examples asks
        was_training = setup.model.training
        setup.model.eval()
        try:
            with _random_state_kept(context.device), torch.no_grad(), setup.autocast():
                scores = {source.name: float(state.task.evaluate(
                    setup.peft_model, state.tokenizer, state.variant, source.rows, source.metric, state.evaluation,
                    context.device).score) for source in state.sources}
        finally:
            setup.model.train(was_training)
        if len(scores) == 1:
            return {METRIC_KEY: next(iter(scores.values()))}
        values = {f"{METRIC_KEY}/{name}": value for name, value in scores.items()}
        if len({source.metric for source in state.sources}) == 1:
            values[METRIC_KEY] = sum(scores.values()) / len(scores)
        return values

    # The others wait for it in on_main (no collective timeout) and get the figures: every process decides alike.
    return distributed.on_main(context, "scoring the validation metric", scored, share_result=True)
