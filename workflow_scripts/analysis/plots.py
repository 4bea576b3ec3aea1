"""PNG figures for the comparison: scores per variant with intervals, and training loss curves."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: jobs run without a display
import matplotlib.pyplot as plt  # noqa: E402

from workflow_scripts.core.atomic_output import atomic_path  # noqa: E402


def _save(figure, path: str | Path) -> None:
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(figure)


def score_plot(path: str | Path, dataset: str, metric: str, rows: Sequence[Mapping]) -> None:
    """One bar per variant: seed-averaged score with its 95% bootstrap interval, seeds as dots, base as a dash.

    ``rows``: dicts with variant, mean, ci_low, ci_high, seed_scores (list), base_score (or None).
    """
    figure, axes = plt.subplots(figsize=(1.6 + 1.4 * len(rows), 3.6))
    positions = range(len(rows))
    means = [row["mean"] for row in rows]
    errors = [[row["mean"] - row["ci_low"] for row in rows], [row["ci_high"] - row["mean"] for row in rows]]
    axes.bar(positions, means, yerr=errors, capsize=6, color="#8fb3d9", edgecolor="#2b5d8a", label="mean over seeds (95% CI)")
    for position, row in zip(positions, rows):
        seeds = row["seed_scores"]
        axes.scatter([position] * len(seeds), seeds, color="#2b5d8a", zorder=3, s=14,
                     label="single seed" if position == 0 else None)
        if row.get("base_score") is not None:
            axes.hlines(row["base_score"], position - 0.4, position + 0.4, colors="#c0392b", linestyles="--",
                        label="untrained base model" if position == 0 else None)
    axes.set_xticks(list(positions), [row["variant"] for row in rows])
    axes.set_ylabel(metric)
    axes.set_ylim(0, 1.05)
    axes.set_title(f"{dataset}: {metric} per prompt variant")
    axes.legend(fontsize=7, loc="upper left")
    _save(figure, path)


def loss_plot(path: str | Path, dataset: str, curves: Mapping[tuple[str, int], Sequence[Sequence]]) -> None:
    """Training loss against optimizer step, one line per (variant, seed), colour by variant; the held-out
    validation loss (when training computed it) as markers joined by a thin line in the same colour; the
    task's validation metric (training.validation.metric_examples) as square markers on a second axis.

    ``curves``: (variant, seed) -> (steps, losses), (steps, losses, validation steps, validation losses), or
    that and a mapping train_log field -> (steps, values) of the validation metric
    (``training_log.validation_metric_curves``).
    """
    figure, axes = plt.subplots(figsize=(6, 3.6))
    variants = sorted({variant for variant, _ in curves})
    colours = {variant: plt.get_cmap("tab10")(k % 10) for k, variant in enumerate(variants)}
    styles = ["-", "--", ":", "-."]
    seeds = sorted({seed for _, seed in curves})
    validated = False
    metric_axes = None
    for (variant, seed), curve in sorted(curves.items()):
        steps, losses = curve[0], curve[1]
        style = styles[seeds.index(seed) % len(styles)]
        axes.plot(steps, losses, color=colours[variant], linestyle=style, linewidth=1.2, label=f"{variant}, seed {seed}")
        if len(curve) > 2 and curve[2]:
            validated = True
            axes.plot(curve[2], curve[3], color=colours[variant], linestyle=style, linewidth=0.8, marker="o",
                      markersize=3, label=f"{variant}, seed {seed} (validation)")
        for name, (metric_steps, values) in sorted((curve[4] if len(curve) > 4 else {}).items()):
            if metric_axes is None:
                metric_axes = axes.twinx()
            metric_axes.plot(metric_steps, values, color=colours[variant], linestyle=style, linewidth=0.8, marker="s",
                             markersize=3, alpha=0.7, label=f"{variant}, seed {seed} ({name})")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss per target token")
    axes.set_title(f"{dataset}: training" + (" and validation" if validated else "") + " loss"
                   + (", validation metric" if metric_axes is not None else ""))
    handles, labels = axes.get_legend_handles_labels()
    if metric_axes is not None:
        metric_axes.set_ylabel("validation metric (squares)")
        more = metric_axes.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    axes.legend(handles, labels, fontsize=7)
    _save(figure, path)
