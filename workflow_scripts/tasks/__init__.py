"""What differs by kind of experiment: one module per task type (``base.Task``), plus templates and metrics.

Stages call :func:`task_named` with a dataset's ``task`` and never branch on the name themselves.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from workflow_scripts.core.errors import WorkflowError

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings

TASK_MODULES = {
    "generation": "workflow_scripts.tasks.generation",
    "classification": "workflow_scripts.tasks.classification",
    "masked_lm": "workflow_scripts.tasks.masked_lm",
    "vision_language": "workflow_scripts.tasks.vision_language",
    "conversation": "workflow_scripts.tasks.conversation",
}


def task_named(name: str, where: str | None = None):
    """The task object of a task type (imported on first use: a stage loads only its own)."""
    import importlib

    if name not in TASK_MODULES:
        raise WorkflowError(f"{where + ': ' if where else ''}unknown task {name!r}; known: {sorted(TASK_MODULES)}")
    return importlib.import_module(TASK_MODULES[name]).TASK


def check_also_metrics(dataset: "DatasetSettings", source: str | None = None) -> None:
    """At parse time: ``datasets.<name>.also_metrics`` against the dataset's task (``also_metrics.check_config``)."""
    from workflow_scripts.tasks import also_metrics

    also_metrics.check_config(dataset, task_named(dataset.task, f"datasets.{dataset.name}.task").metrics, source)


def stored_columns(meta: dict) -> list[str]:
    """The task's own columns in the pre-tokenised data (what its collator reads), from the task's features;
    ``meta`` is the data's ``tokenise_meta.json``."""
    features = task_named(meta["task"]).tokenised_features()
    return [name for name in features if name not in ("id", "input_ids", "length", "truncated", "dropped")]
