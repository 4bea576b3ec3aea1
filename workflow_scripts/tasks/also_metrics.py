"""A dataset's ``also_metrics``: further metrics scored on the SAME predictions as its main ``metric``.

No second generation: evaluate rescoring each record's extracted answer against its gold with the extra
metric (``metrics.score_example``, exactly as the main metric is scored), so e.g. the AMR demo reports
smatch and smatchpp side by side. Each record of predictions.jsonl keeps the extra metric's per-example
value under ``also_scores.<metric>`` (``score``, and ``counts`` for a ratio-of-sums metric), so compare runs
the same paired bootstrap on it; eval.json keeps ``also_scores.<metric>: {score, n_unparseable}``.

Only the answer metrics (``metrics.METRICS``: generation, vision_language, conversation) can be rescored
from a record; a classifier's or masked LM's metric needs the model again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.tasks import metrics

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings

FIELD = "also_scores"


def check_config(dataset: "DatasetSettings", task_metrics: Sequence[str], source: str | None = None) -> None:
    """``datasets.<name>.also_metrics``: metrics of the dataset's task, rescored from the answer, not the main one."""
    key = f"datasets.{dataset.name}.also_metrics"
    for metric in dataset.also_metrics:
        if metric == dataset.metric:
            raise ConfigError(key, f"'{metric}' is the dataset's main metric already; list only other metrics", source)
        if metric not in task_metrics or metric not in metrics.METRICS:
            fitting = [m for m in task_metrics if m in metrics.METRICS and m != dataset.metric]
            raise ConfigError(key, f"'{metric}' cannot be scored on the predictions of task "
                              f"'{dataset.task}' (choose from {fitting}, or remove the key)", source)


def parse_argument(text: str, task: str, task_metrics: Sequence[str], main_metric: str) -> list[str]:
    """evaluate's ``--also-metrics``: a JSON list of metrics that ``rescore`` can score for this task."""
    from workflow_scripts.core.stage_arguments import json_setting

    names = json_setting(text, "--also-metrics")
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise WorkflowError(f"argument --also-metrics: expected a JSON list of metric names, got {text!r}")
    for name in names:
        if name == main_metric or name not in task_metrics or name not in metrics.METRICS:
            raise WorkflowError(f"argument --also-metrics: {name!r} is not another answer metric of task {task!r} "
                                f"(choose from {[m for m in task_metrics if m in metrics.METRICS and m != main_metric]})")
    return names


def rescore(records: Sequence[dict], names: Sequence[str]) -> dict[str, dict]:
    """Adds ``also_scores`` to each record (in place); returns eval.json's ``also_scores``."""
    summary = {}
    for metric in names:
        metrics.check_metric(metric)
        scores = []
        for record in records:
            if "extracted" not in record or "gold" not in record:
                raise WorkflowError(f"also_metrics: record {record.get('id')!r} has no extracted answer and gold "
                                    f"to score {metric} on; only answer metrics ({list(metrics.METRICS)}) can be added")
            example = metrics.score_example(metric, record["extracted"], record["gold"])
            scores.append(example)
            value = {"score": example.score}
            if example.counts is not None:
                value["counts"] = list(example.counts)
            record.setdefault(FIELD, {})[metric] = value
        unparseable = sum(record["extracted"] is None or (metric in metrics.GRAPH_METRICS and not
                          metrics.graph_readable(metric, record["extracted"])) for record in records)
        summary[metric] = {"score": metrics.corpus_score(metric, scores), "n_unparseable": unparseable}
    return summary
