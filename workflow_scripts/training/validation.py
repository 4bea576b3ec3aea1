"""Held-out loss during training, the best adapter so far, and early stopping (``training.validation``).

The validation loss is the training objective on the dataset's validation split: the task's own loss
module (summed over target tokens) divided by the target tokens of the whole split, with dropout off
and no gradients. Every process evaluates a fixed share of the split's micro-batches and the sums are
all-reduced, so 1 and N processes report the same figure. Nothing here draws from a random generator:
the training that follows is the same whether or not validation ran.

Which adapter is "best" travels in every checkpoint (:class:`Selection`), and the best adapters are
kept as ``best-step-XXXXXXXX/`` beside the checkpoints until a checkpoint no longer needs them, so a
resumed run selects exactly what an uninterrupted one would.

With ``metric_examples`` the task's metric is computed at the same points (``validation_metric.py``) and
``criterion: metric`` selects the best adapter by it.
"""
from __future__ import annotations

import math
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from workflow_scripts.core.atomic_output import atomic_path
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.settings import ValidationSettings
from workflow_scripts.model import model_loading
from workflow_scripts.training import distributed, fsdp, training_setup

BEST_DIR = re.compile(r"^best-step-(\d{8})$")
METRIC_KEY = "validation_metric"  # the train_log field of the criterion's metric (a mixture: the mean)


@dataclass
class Selection:
    """What validation has seen so far: the best step (by the criterion) with its loss and metric, and
    evaluations since it improved."""
    best_step: int | None = None
    best_loss: float | None = None
    since_best: int = 0
    history: list[list[float]] = field(default_factory=list)  # [step, loss] of every evaluation
    best_metric: float | None = None
    metric_history: list[list] = field(default_factory=list)  # [step, {train_log field: value}]

    def update(self, step: int, loss: float, metrics: Mapping[str, float] | None = None,
               criterion: str = "loss", lower_is_better: bool = True) -> bool:
        """Record an evaluation; True when it is a new best (strictly better by ``criterion``)."""
        self.history.append([step, loss])
        metric = None
        if metrics:
            self.metric_history.append([step, dict(metrics)])
            metric = metrics.get(METRIC_KEY)
        if criterion == "metric":
            if metric is None:
                raise WorkflowError(f"step {step}: training.validation.criterion is 'metric' but no validation "
                                    "metric was computed; set training.validation.metric_examples")
            value, best, lower = metric, self.best_metric, lower_is_better
        else:
            value, best, lower = loss, self.best_loss, True
        if best is None or (value < best if lower else value > best):
            self.best_step, self.best_loss, self.best_metric, self.since_best = step, loss, metric, 0
            return True
        self.since_best += 1
        return False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any] | None) -> "Selection":
        return cls(**value) if value else cls()


def due(settings: ValidationSettings, completed: int, max_steps: int) -> bool:
    every = settings.every_steps
    return bool(every) and (completed % every == 0 or completed == max_steps)


def open_split(data_dir: str, settings: ValidationSettings, columns) -> Any:
    """The tokenised validation split (None when validation is off)."""
    from workflow_scripts.data import batching

    if not settings.every_steps:
        return None
    if not Path(data_dir, "validation").is_dir():
        raise WorkflowError(f"{data_dir}: no 'validation' split, but training.validation.every_steps is set; "
                            "give the dataset a validation split (datasets.<name>.splits) or switch validation off")
    return batching.TokenisedSplit(data_dir, "validation", columns)


def rank_share(batches: list, rank: int, world_size: int) -> list[tuple[Any, float]]:
    """This rank's (batch, weight) pairs: batches rank, rank + W, ..., padded with the first batch at
    weight 0 so every rank runs the same number of forwards (a sharded model's forward is collective)."""
    share = [(indices, 1.0) for indices in batches[rank::world_size]]
    forwards = -(-len(batches) // world_size)
    return share + [(batches[0], 0.0)] * (forwards - len(share))


@torch.no_grad()
def held_out_loss(setup: training_setup.TrainingSetup, dataset, collator, settings: ValidationSettings) -> float:
    """Mean loss per target token over the (capped) validation split, the same on every process."""
    context = setup.context
    rows = len(dataset) if settings.max_examples is None else min(len(dataset), settings.max_examples)
    size = setup.training.micro_batch
    batches = [list(range(start, min(start + size, rows))) for start in range(0, rows, size)]
    summed = torch.zeros(2, dtype=torch.float64, device=context.device)  # loss, target tokens
    # The loss module without DDP: after a synced step DDP's forward broadcasts the buffers (RoPE's
    # inv_freq), a collective that a rank without a batch would skip (issue 23: both ranks hung).
    model = setup.model.module if isinstance(setup.model, torch.nn.parallel.DistributedDataParallel) else setup.model
    was_training = model.training
    model.eval()
    try:
        for indices, weight in rank_share(batches, context.rank, context.world_size):
            batch = training_setup.to_device(collator(dataset.__getitems__(indices)), context.device)
            with setup.autocast():
                loss = model(batch)
            summed += weight * torch.tensor([float(loss), float(batch["target_tokens"])], dtype=torch.float64,
                                            device=context.device)
    finally:
        model.train(was_training)
    distributed.all_reduce_sum(summed, context)
    loss, targets = summed.tolist()
    if targets == 0:
        raise WorkflowError("the validation split has no target tokens; check its rows or switch validation off")
    return loss / targets


def best_dirs(checkpoint_dir: str | Path) -> list[tuple[int, Path]]:
    root = Path(checkpoint_dir)
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := BEST_DIR.match(p.name))] if root.is_dir() else []
    return sorted(found)


def save_best(setup: training_setup.TrainingSetup, checkpoint_dir: str | Path, step: int) -> None:
    """The adapter of a new best step, in the PEFT format (every rank calls it; the main process writes)."""
    state = fsdp.gather_adapter(setup.peft_model)  # collective under FSDP (the shards gathered); None otherwise

    def write():  # rank 0 alone; the others wait in on_main, not in the next step's all-reduce
        with atomic_path(Path(checkpoint_dir, f"best-step-{step:08d}"), directory=True) as directory:
            if setup.training.full:  # the whole model, as train's output holds it
                model_loading.save_full_model(setup.peft_model, directory)
            else:
                model_loading.save_adapter(setup.peft_model, directory, state)

    distributed.on_main(setup.context, f"writing the best adapter (step {step})", write)


def prune(checkpoint_dir: str | Path, selection: Selection, resumed_step: int | None = None) -> None:
    """Drop best adapters no checkpoint refers to: older than the recorded best, or (after a resume)
    written past the resumed step by the interrupted run (they will be written again, identically)."""
    for step, path in best_dirs(checkpoint_dir):
        older = selection.best_step is not None and step < selection.best_step
        lost = resumed_step is not None and step > resumed_step
        if older or lost:
            shutil.rmtree(path, ignore_errors=True)


def clear(checkpoint_dir: str | Path) -> None:
    """After a finished run (as checkpointing.clear): no best adapter is kept beside the output."""
    for _, path in best_dirs(checkpoint_dir):
        shutil.rmtree(path, ignore_errors=True)


def best_adapter(checkpoint_dir: str | Path, selection: Selection) -> Path:
    if selection.best_step is None:
        raise WorkflowError("training.validation.keep is 'best' but no validation loss was computed; "
                            "set training.validation.every_steps")
    path = Path(checkpoint_dir, f"best-step-{selection.best_step:08d}")
    if not any((path / name).is_file() for name in ("adapter_config.json", model_loading.FULL_MODEL_MARKER)):
        raise WorkflowError(f"{path}: the best adapter (step {selection.best_step}) is missing; delete "
                            f"{checkpoint_dir} and train again")
    return path


def summary(selection: Selection, settings: ValidationSettings, stopped_early_at: int | None) -> dict[str, Any]:
    """What the run manifest records about validation and the adapter it kept."""
    recorded = {
        "adapter_kept": settings.keep,
        "best_step": selection.best_step,
        "best_validation_loss": selection.best_loss,
        "validation_losses": selection.history,
        "stopped_early_at_step": stopped_early_at,
    }
    if settings.metric_examples is not None:
        recorded.update(criterion=settings.criterion, metric_examples=settings.metric_examples,
                        best_validation_metric=selection.best_metric, validation_metrics=selection.metric_history)
    return recorded


def finite(loss: float, step: int) -> float:
    if not math.isfinite(loss):
        raise WorkflowError(f"step {step}: the validation loss is {loss}; check the validation rows or lower "
                            "training.learning_rate")
    return loss
