"""Paired bootstrap for a metric averaged over seeds: over test examples, or over seeds then test examples.

Design (documented in docs/architecture.md, "Comparison"):
- Two modes (``comparison.bootstrap``; ``auto`` resolves with ``resolve_mode``):
  - ``examples``: the unit resampled is the test example and the seeds are held fixed. One set of
    resampled example indices is drawn per replicate and applied to every seed of every system, so
    the pairing is by example *and* by seed (seed s of a variant is paired with seed s of the
    reference). The interval leaves out seed-to-seed variation (initialisation, data order).
  - ``seeds_and_examples``: a two-level bootstrap. Each replicate first draws S seed positions with
    replacement out of the S seeds, the same positions for every system (seed k of a variant shares
    data order and initialisation with seed k of the reference, so the pairing is kept), then draws
    test examples with replacement, one draw applied to every drawn seed of every system (paired by
    id). Seeds and test examples are crossed (every seed is scored on the same test set), so the two
    draws are independent. The interval then includes the seed-to-seed variation.
- The statistic is the seed-averaged corpus metric: for each (drawn) seed, the corpus score of the
  resampled examples (the mean of per-example scores, or for smatch the F1 of the summed triple
  counts, i.e. counts are resampled and micro F1 recomputed; for macro-F1 the per-class counts of the
  resampled (gold, predicted) pairs, macro-F1 recomputed), then the mean over the (drawn) seeds.
  The difference is the mean over seeds of (variant - reference).
- 95% interval: percentiles 2.5 and 97.5 of the replicated statistics.
- p-value: two-sided, for "no difference", by the shift method used in sacrebleu's paired bootstrap:
  centre the replicated differences on zero and count how often they are at least as far from zero
  as the observed difference, p = (c + 1) / (B + 1). It is never 0, and 1 for identical systems.
- Vectorised: per block of replicates, the example draws become a (replicates x examples) matrix of
  multiplicities, and one matrix product with the (examples x seeds) values gives every seed's
  resampled sum (smatch: summed counts) for the whole block. The seed level then only gathers and
  averages those (replicates x seeds) corpus scores, so the two-level mode costs about the same as
  the examples-only one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.tasks import metrics, smatchpp_metric

CHUNK = 100  # replicates per block, so (replicates x examples x 3) smatch counts stay small in memory
EXAMPLES = "examples"
SEEDS_AND_EXAMPLES = "seeds_and_examples"
MODES = (EXAMPLES, SEEDS_AND_EXAMPLES)
SETTINGS = ("auto",) + MODES
AUTO_MIN_SEEDS = 3  # auto resamples seeds only when every compared variant has at least this many


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


def resolve_mode(setting: str, seed_counts: Iterable[int]) -> str:
    """``comparison.bootstrap`` -> the mode used; ``seed_counts``: the number of seeds of every compared variant."""
    counts = list(seed_counts)
    if setting not in SETTINGS:
        raise ConfigError("comparison.bootstrap", f"must be one of {', '.join(SETTINGS)}, got {setting!r}")
    if not counts:
        raise WorkflowError("bootstrap mode: no compared variants")
    if setting == "auto":
        return SEEDS_AND_EXAMPLES if min(counts) >= AUTO_MIN_SEEDS else EXAMPLES
    if setting == SEEDS_AND_EXAMPLES and min(counts) < 2:
        raise ConfigError("comparison.bootstrap", f"'{SEEDS_AND_EXAMPLES}' needs at least 2 seeds per variant to "
                                                  f"resample seeds, but a variant has {min(counts)}; use 'examples' or 'auto'")
    return setting


def describe(mode: str, seed_counts: Iterable[int]) -> str:
    """One line naming the mode and the number of seeds, for tables and reports."""
    counts = sorted(set(seed_counts))
    seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    seeds += " seed" if counts == [1] else " seeds"
    if mode == EXAMPLES:
        return f"intervals: paired bootstrap over test examples, seeds fixed ({seeds})"
    if mode == SEEDS_AND_EXAMPLES:
        return f"intervals: two-level bootstrap: seeds, then test examples ({seeds})"
    raise WorkflowError(f"unknown bootstrap mode {mode!r}; known: {', '.join(MODES)}")


def micro_f1(sums: np.ndarray) -> np.ndarray:
    """Smatch F1 from summed (match, test, gold) triple counts along the last axis."""
    match, test, gold = np.moveaxis(np.asarray(sums, dtype=float), -1, 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        f1 = 2 * match / (test + gold)  # = 2PR / (P + R) with P = m/t, R = m/g
    return np.where((test > 0) & (gold > 0) & (match > 0), f1, 0.0)


def from_sums(metric: str, sums: np.ndarray) -> np.ndarray:
    """The corpus score from counts summed over examples (last axis: the counts): smatch's micro F1,
    or a masked-LM ratio (metrics.ratio_from_sums: sum of the first count over sum of masked tokens)."""
    if metric == "smatch":
        return micro_f1(sums)
    if metric == "smatchpp":
        return smatchpp_metric.micro_f1(sums)
    if metric in metrics.CLASS_COUNT_METRICS:
        return metrics.macro_f1_from_sums(sums)
    return metrics.ratio_from_sums(metric, sums[..., 0], sums[..., 1])


def corpus_statistic(metric: str, values: np.ndarray) -> np.ndarray:
    """Corpus score along the example axis: ``values`` is (..., n) scores or (..., n, k) counts
    (metrics.counts_width: smatch's 3, a masked-LM ratio's 2; macro-F1's 3 per class), summed before the score
    is taken."""
    if not metrics.summed_counts(metric):
        return values.mean(axis=-1)
    return from_sums(metric, values.sum(axis=-2))


def _resampled_scores(metric: str, multiplicities: np.ndarray, stacked: np.ndarray) -> np.ndarray:
    """(replicates, seeds) corpus scores: ``multiplicities`` (replicates, n) counts how often each example
    was drawn; ``stacked`` is (n, seeds) scores or (n, seeds, 3) counts, as float."""
    n = multiplicities.shape[1]
    sums = (multiplicities @ stacked.reshape(n, -1)).reshape((len(multiplicities),) + stacked.shape[1:])
    return from_sums(metric, sums) if metrics.summed_counts(metric) else sums / n


def _check(metric: str, systems: Sequence[Sequence[np.ndarray]]) -> tuple[int, int]:
    """(examples, seeds), after checking that every system has the same seeds and examples."""
    n_seeds = {len(seeds) for seeds in systems}
    if len(n_seeds) != 1 or 0 in n_seeds:
        raise WorkflowError(f"paired bootstrap needs the same (non-zero) number of seeds for every system; got {sorted(n_seeds)}")
    shapes = {np.shape(values) for seeds in systems for values in seeds}
    if len(shapes) != 1:
        raise WorkflowError(f"paired bootstrap needs the same examples everywhere; got arrays of shapes {sorted(shapes)}")
    shape = shapes.pop()
    width = metrics.counts_width(metric)
    if width is not None and (len(shape) != 2 or shape[1] != width):
        raise WorkflowError(f"{metric} needs {width} counts per example (smatch: match, test, gold; a masked-LM "
                            "ratio: numerator, masked tokens)")
    if metric in metrics.CLASS_COUNT_METRICS and (len(shape) != 2 or shape[1] == 0 or shape[1] % 3):
        raise WorkflowError(f"{metric} needs 3 counts per class per example (metrics.class_counts), got shape {shape}")
    if shape[0] == 0:
        raise WorkflowError("paired bootstrap over zero examples")
    return shape[0], n_seeds.pop()


def _replicates(metric: str, systems: Sequence[Sequence[np.ndarray]], resamples: int, seed: int,
                mode: str = EXAMPLES) -> np.ndarray:
    """(systems, resamples) seed-averaged corpus scores; one shared seed draw (two-level mode) and one
    shared example draw per replicate, applied to every system."""
    if mode not in MODES:
        raise WorkflowError(f"unknown bootstrap mode {mode!r}; known: {', '.join(MODES)}")
    n, n_seeds = _check(metric, systems)
    if resamples < 1:
        raise WorkflowError(f"bootstrap resamples must be positive, got {resamples}")
    # (n, seeds) or (n, seeds, 3) per system; float so the products use BLAS (exact for counts below 2**53).
    stacked = [np.stack([np.asarray(values, dtype=float) for values in seeds], axis=1) for seeds in systems]
    rng = np.random.default_rng(seed)
    out = np.empty((len(systems), resamples))
    for start in range(0, resamples, CHUNK):
        size = min(CHUNK, resamples - start)
        # Draw order (seeds, then examples) is part of the result: a fixed bootstrap_seed gives the same table.
        drawn_seeds = rng.integers(0, n_seeds, size=(size, n_seeds)) if mode == SEEDS_AND_EXAMPLES else None
        indices = rng.integers(0, n, size=(size, n))
        rows = (indices + np.arange(size)[:, None] * n).ravel()
        multiplicities = np.bincount(rows, minlength=size * n).reshape(size, n).astype(float)
        for k, values in enumerate(stacked):
            per_seed = _resampled_scores(metric, multiplicities, values)  # (size, seeds)
            if drawn_seeds is not None:
                per_seed = np.take_along_axis(per_seed, drawn_seeds, axis=1)
            out[k, start:start + size] = per_seed.mean(axis=1)
    return out


def seed_mean(metric: str, seeds: Sequence[np.ndarray]) -> float:
    return float(np.mean([corpus_statistic(metric, np.asarray(values)) for values in seeds]))


def paired_difference(metric: str, variant: Sequence[np.ndarray], reference: Sequence[np.ndarray],
                      resamples: int, seed: int, mode: str = EXAMPLES) -> Difference:
    """Variant minus reference; ``variant[s]`` and ``reference[s]`` hold seed s's per-example values, same order."""
    if len(variant) != len(reference) or not variant:
        raise WorkflowError(f"paired bootstrap needs the same seeds for both systems ({len(variant)} vs {len(reference)})")
    observed = seed_mean(metric, variant) - seed_mean(metric, reference)
    replicated = _replicates(metric, [variant, reference], resamples, seed, mode)
    deltas = replicated[0] - replicated[1]
    low, high = np.percentile(deltas, [2.5, 97.5])
    # Tolerance: float noise must not turn an exact tie (|centred delta| == |observed|) into a miss.
    extreme = np.abs(deltas - deltas.mean()) >= abs(observed) - 1e-12
    p_value = (int(extreme.sum()) + 1) / (resamples + 1)
    return Difference(float(observed), float(low), float(high), float(p_value), resamples)


def score_interval(metric: str, seeds: Sequence[np.ndarray], resamples: int, seed: int,
                   mode: str = EXAMPLES) -> Interval:
    """The seed-averaged score with a 95% percentile interval over resampled examples (and seeds)."""
    replicated = _replicates(metric, [seeds], resamples, seed, mode)[0]
    low, high = np.percentile(replicated, [2.5, 97.5])
    return Interval(seed_mean(metric, seeds), float(low), float(high))
