"""Paired bootstrap over test examples, for a metric averaged over seeds.

Design (documented in docs/architecture.md, "Comparison"):
- The unit resampled is the test example. One set of resampled example indices is drawn per
  bootstrap replicate and applied to every seed of both systems, so the pairing is by example
  *and* by seed (seed s of a variant is paired with seed s of the reference).
- The statistic is the seed-averaged corpus metric: for each seed, the corpus score of the resample
  (the mean of per-example scores, or for smatch the F1 of the summed triple counts, i.e. counts
  are resampled and micro F1 recomputed), then the mean over seeds. The difference is the mean
  over seeds of (variant - reference).
- 95% interval: percentiles 2.5 and 97.5 of the replicated differences.
- p-value: two-sided, for "no difference", by the shift method used in sacrebleu's paired bootstrap:
  centre the replicated differences on zero and count how often they are at least as far from zero
  as the observed difference, p = (c + 1) / (B + 1). It is never 0, and 1 for identical systems.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from workflow_scripts.errors import WorkflowError

CHUNK = 100  # replicates per block, so (replicates x examples x 3) smatch counts stay small in memory


@dataclass(frozen=True)
class Difference:
    difference: float
    low: float
    high: float
    p_value: float
    resamples: int


@dataclass(frozen=True)
class Interval:
    score: float
    low: float
    high: float


def corpus_statistic(metric: str, values: np.ndarray) -> np.ndarray:
    """Corpus score along the example axis: ``values`` is (..., n) scores or (..., n, 3) smatch counts."""
    if metric != "smatch":
        return values.mean(axis=-1)
    match, test, gold = np.moveaxis(values.sum(axis=-2).astype(float), -1, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        f1 = 2 * match / (test + gold)  # = 2PR / (P + R) with P = m/t, R = m/g
    return np.where((test > 0) & (gold > 0) & (match > 0), f1, 0.0)


def _check(metric: str, systems: Sequence[Sequence[np.ndarray]]) -> int:
    shapes = {np.shape(values) for seeds in systems for values in seeds}
    if len(shapes) != 1:
        raise WorkflowError(f"paired bootstrap needs the same examples everywhere; got arrays of shapes {sorted(shapes)}")
    shape = shapes.pop()
    if metric == "smatch" and (len(shape) != 2 or shape[1] != 3):
        raise WorkflowError("smatch needs (match, test, gold) counts per example")
    if shape[0] == 0:
        raise WorkflowError("paired bootstrap over zero examples")
    return shape[0]


def _replicates(metric: str, systems: Sequence[Sequence[np.ndarray]], resamples: int, seed: int) -> np.ndarray:
    """(systems, resamples) seed-averaged corpus scores, one shared index set per replicate."""
    n = _check(metric, systems)
    if resamples < 1:
        raise WorkflowError(f"bootstrap resamples must be positive, got {resamples}")
    rng = np.random.default_rng(seed)
    out = np.empty((len(systems), resamples))
    for start in range(0, resamples, CHUNK):
        size = min(CHUNK, resamples - start)
        indices = rng.integers(0, n, size=(size, n))
        for k, seeds in enumerate(systems):
            per_seed = [corpus_statistic(metric, np.asarray(values)[indices]) for values in seeds]
            out[k, start:start + size] = np.mean(per_seed, axis=0)
    return out


def seed_mean(metric: str, seeds: Sequence[np.ndarray]) -> float:
    return float(np.mean([corpus_statistic(metric, np.asarray(values)) for values in seeds]))


def paired_difference(metric: str, variant: Sequence[np.ndarray], reference: Sequence[np.ndarray],
                      resamples: int, seed: int) -> Difference:
    """Variant minus reference; ``variant[s]`` and ``reference[s]`` hold seed s's per-example values, same order."""
    if len(variant) != len(reference) or not variant:
        raise WorkflowError(f"paired bootstrap needs the same seeds for both systems ({len(variant)} vs {len(reference)})")
    observed = seed_mean(metric, variant) - seed_mean(metric, reference)
    replicated = _replicates(metric, [variant, reference], resamples, seed)
    deltas = replicated[0] - replicated[1]
    low, high = np.percentile(deltas, [2.5, 97.5])
    # Tolerance: float noise must not turn an exact tie (|centred delta| == |observed|) into a miss.
    extreme = np.abs(deltas - deltas.mean()) >= abs(observed) - 1e-12
    p_value = (int(extreme.sum()) + 1) / (resamples + 1)
    return Difference(float(observed), float(low), float(high), float(p_value), resamples)


def score_interval(metric: str, seeds: Sequence[np.ndarray], resamples: int, seed: int) -> Interval:
    """The seed-averaged score with a 95% percentile interval over resampled examples."""
    replicated = _replicates(metric, [seeds], resamples, seed)[0]
    low, high = np.percentile(replicated, [2.5, 97.5])
    return Interval(seed_mean(metric, seeds), float(low), float(high))
