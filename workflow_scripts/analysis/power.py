"""Power before training: the smallest difference between two variants the planned comparison can detect.

Miller (2024), "Adding Error Bars to Evals: A Statistical Approach to Language Model Evaluations"
(arXiv:2411.00640), its power analysis: a paired difference of means over ``n`` test examples is
detected at two-sided level alpha with probability ``power`` when it exceeds

    MDE = (z_{1 - alpha/2} + z_{power}) * sqrt(Var(d) / n)

with ``Var(d)`` the variance of the per-example score difference. Adapted to seeds here: the comparison
averages each variant over ``k`` seeds, and the seeds are treated as independent replications of every
example (as Miller's resampling of K answers per question, with K = k), so ``n`` becomes ``n * k``. This
is optimistic where the examples' difficulty, not the seed, dominates the variance; the report says so.

The paired variance is unknown before training. The assumption used and named in the report: the two
variants' per-example scores correlate with rho >= 1/2. For a score in [0, 1] (standard deviations x, y <= 1/2)
that bounds the variance of the difference: Var(a - b) = x^2 + y^2 - 2 rho x y <= x^2 + y^2 - x y
<= max(x, y)^2 <= 1/4 (Popoviciu). So 1/4 is used, or the untrained model's per-example variance (the largest
over the variants' prompts) where that is larger (a ratio metric's linearised contributions can be). The
untrained model's own variance alone is no guide: it scores near its floor (the demo's AMR model: micro F1
0.003, whose spread gave +-0.01 against the +-0.12 the trained variants achieved). The estimate is therefore
conservative: the demo's achieved MDEs are 0.5 to 1.0 times it. An unbounded metric (mlm_loss, perplexity)
takes the untrained model's variance, and has no estimate where that is 0.

Ratio-of-sums metrics (smatch's micro F1, the masked-LM ratios) are not means of per-example scores: each
example enters through its linearised contribution (delta method), (num_i - R * den_i) / mean(den) for
smatch's 2M / (T + G) and the masked-LM ratios, the numerical gradient for Smatch++'s 2PR / (P + R), so the
variance is that of the corpus score's own estimator.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, Mapping, Sequence

import numpy as np

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.tasks import metrics, smatchpp_metric

ALPHA = 0.05
POWER = 0.8
BOUNDED_VARIANCE = 0.25  # the largest variance of a score in [0, 1] (Popoviciu)
UNBOUNDED_METRICS = ("mlm_loss", "perplexity")
VARIANCE_FROM_BASE = "untrained model's per-example variance (largest over the variants' prompts)"
VARIANCE_FROM_BOUND = ("1/4: for scores in [0, 1] whose variants correlate with rho >= 1/2, Var(a - b) <= 1/4; the "
                       "untrained model's per-example variance is smaller")


def z_sum(alpha: float = ALPHA, power: float = POWER) -> float:
    """z_{1 - alpha/2} + z_{power}: 1.96 + 0.84 = 2.80 at the defaults."""
    normal = NormalDist()
    return normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)


def minimum_detectable_effect(variance: float, n_examples: int, n_seeds: int,
                              alpha: float = ALPHA, power: float = POWER) -> float:
    """Miller (2024) eq. for the paired MDE, with n * seeds replications (see the module docstring)."""
    if n_examples < 1 or n_seeds < 1:
        raise WorkflowError(f"power: needs at least one test example and one seed, got {n_examples} and {n_seeds}")
    return z_sum(alpha, power) * math.sqrt(variance / (n_examples * n_seeds))


def examples_needed(variance: float, n_seeds: int, target: float) -> int:
    """The fewest test examples whose MDE with ``n_seeds`` seeds is at most ``target``."""
    return max(1, math.ceil(z_sum() ** 2 * variance / (target ** 2 * n_seeds)))


def seeds_needed(variance: float, n_examples: int, target: float) -> int:
    """The fewest seeds whose MDE over ``n_examples`` test examples is at most ``target``."""
    return max(1, math.ceil(z_sum() ** 2 * variance / (target ** 2 * n_examples)))


def example_contributions(metric: str, records: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Per-example values whose mean's variance / n is the corpus score's: the per-example score for a mean
    metric, the linearised contribution for a ratio of sums (smatch: F1 = 2M / (T + G); masked-LM: R = a / b,
    perplexity = exp(a / b))."""
    if not records:
        raise WorkflowError("power: no predictions to estimate the variance from")
    width = metrics.counts_width(metric)
    if width is None:
        return np.asarray([float(record["score"]) for record in records])
    counts = np.asarray([record["counts"] for record in records], dtype=float)
    if metric == "smatchpp":
        return _linearised(smatchpp_metric.micro_f1, counts)
    if metric == "smatch":
        numerator, denominator = 2 * counts[:, 0], counts[:, 1] + counts[:, 2]
    else:
        numerator, denominator = counts[:, 0], counts[:, 1]
    if denominator.sum() <= 0:
        return np.zeros(len(records))
    ratio = numerator.sum() / denominator.sum()
    contributions = (numerator - ratio * denominator) / denominator.mean()
    return contributions * math.exp(ratio) if metric == "perplexity" else contributions


def _linearised(score, counts: np.ndarray) -> np.ndarray:
    """Delta-method contributions of a corpus score of summed counts: the gradient of ``score`` at the mean
    counts (central differences; the score is a ratio, so means and sums give the same value) applied to each
    example's deviation from the mean."""
    mean = counts.mean(axis=0)
    steps = np.maximum(np.abs(mean), 1.0) * 1e-6
    gradient = np.array([(float(score(mean + step * unit)) - float(score(mean - step * unit))) / (2 * step)
                         for step, unit in zip(steps, np.eye(len(mean)))])
    return (counts - mean) @ gradient


@dataclass(frozen=True)
class PowerEstimate:
    dataset: str
    model: str
    metric: str
    n_examples: int
    n_seeds: int
    base_variance: float
    variance: float
    variance_source: str
    mde: float | None
    alpha: float = ALPHA
    power: float = POWER

    def line(self) -> str:
        seeds = f"{self.n_seeds} seed{'s' if self.n_seeds != 1 else ''}"
        where = f"{self.dataset} ({self.model}, {self.metric})"
        if self.mde is None:
            return (f"{where}: with {self.n_examples} test examples and {seeds}, the detectable difference cannot be "
                    "estimated: the untrained model's scores do not vary and the metric is unbounded")
        return (f"{where}: with {self.n_examples} test examples and {seeds}, a difference below ±{self.mde:.2f} "
                f"will not be detectable (alpha {self.alpha}, power {self.power})")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "line": self.line()}


def estimate(dataset: str, model: str, metric: str, base_records: Mapping[str, Sequence[Mapping[str, Any]]],
             n_seeds: int) -> PowerEstimate:
    """The MDE of ``dataset`` from the untrained model's predictions per variant (``base_records``)."""
    sizes = {variant: len(records) for variant, records in base_records.items()}
    if len(set(sizes.values())) != 1:
        raise WorkflowError(f"power: dataset '{dataset}': the untrained model's evaluations have different test "
                            f"sizes per variant {sizes}; rerun evaluate_base with the same evaluation settings")
    n_examples = next(iter(sizes.values()))
    variances = [float(np.var(example_contributions(metric, records), ddof=1)) if n_examples > 1 else 0.0
                 for records in base_records.values()]
    base_variance = max(variances)
    if metric not in UNBOUNDED_METRICS and base_variance <= BOUNDED_VARIANCE:
        variance, source = BOUNDED_VARIANCE, VARIANCE_FROM_BOUND
    elif base_variance > 0:
        variance, source = base_variance, VARIANCE_FROM_BASE
    else:
        variance, source = 0.0, "none: the untrained model's scores do not vary and the metric is unbounded"
    mde = None if variance == 0 else minimum_detectable_effect(variance, n_examples, n_seeds)
    return PowerEstimate(dataset, model, metric, n_examples, n_seeds, base_variance, variance, source, mde)


def check_threshold(estimate: PowerEstimate, threshold: float | None) -> None:
    """comparison.min_detectable_effect: stop before training when the planned comparison cannot resolve it."""
    if threshold is None or estimate.mde is None or estimate.mde <= threshold:
        return
    examples = examples_needed(estimate.variance, estimate.n_seeds, threshold)
    seeds = seeds_needed(estimate.variance, estimate.n_examples, threshold)
    raise WorkflowError(
        f"dataset '{estimate.dataset}' (model '{estimate.model}'): with {estimate.n_examples} test examples and "
        f"{estimate.n_seeds} seed(s) the minimum detectable effect is ±{estimate.mde:.3f}, above "
        f"comparison.min_detectable_effect {threshold}. Fix: use at least {examples} test examples with "
        f"{estimate.n_seeds} seed(s), or {seeds} seeds with {estimate.n_examples} test examples (under the "
        "assumption in the power report), or raise comparison.min_detectable_effect")


def markdown(estimate: PowerEstimate) -> str:
    return "\n".join([
        f"# Power before training: {estimate.dataset} ({estimate.model})",
        "",
        estimate.line() + ".",
        "",
        f"- metric: {estimate.metric}; test examples: {estimate.n_examples}; seeds per variant: {estimate.n_seeds}",
        f"- variance of the paired per-example difference assumed: {estimate.variance:.4g} ({estimate.variance_source})",
        f"- MDE = (z_(1-alpha/2) + z_power) * sqrt(variance / (examples x seeds)), alpha {estimate.alpha}, power "
        f"{estimate.power} (Miller 2024, \"Adding Error Bars to Evals\"); seeds are counted as independent "
        "replications of each example, which is optimistic when example difficulty dominates.",
        "",
    ])


def achieved_mde(ci_low: float, ci_high: float) -> float:
    """The MDE a finished comparison achieved: its 95% interval's half-width is z_{0.975} standard errors,
    so the MDE at alpha 0.05 and power 0.8 is (z_{0.975} + z_{0.8}) / z_{0.975} times it."""
    z = NormalDist().inv_cdf(1 - ALPHA / 2)
    return (ci_high - ci_low) / 2 / z * z_sum()


def resolved(ci_low: float, ci_high: float) -> bool:
    """A difference is resolved when its interval excludes zero; else it is 'not resolved at this size'."""
    return ci_low > 0 or ci_high < 0


def delta_note(row: Mapping[str, Any]) -> str:
    """What the comparison table adds after a Δ: nothing when resolved, else the reason it says nothing."""
    if row.get("difference") is None or resolved(row["difference_ci_low"], row["difference_ci_high"]):
        return ""
    return " not resolved at this size"


def achieved_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Under the comparison table: the MDE each Δ achieved (alpha 0.05, power 0.8, from its interval)."""
    parts = []
    for row in rows:
        if row.get("difference") is None:
            continue
        where = row["dataset"] if row["trained_on"] == row["dataset"] else f"{row['dataset']} (trained on {row['trained_on']})"
        parts.append(f"{row['variant']} vs {row['reference']} on {where}, {row['model']}: "
                     f"±{achieved_mde(row['difference_ci_low'], row['difference_ci_high']):.3f}")
    if not parts:
        return []
    return ["Minimum detectable effect achieved (alpha 0.05, power 0.8; (z_0.975 + z_0.8) / z_0.975 times the "
            "half-width of Δ's 95% interval): " + "; ".join(parts) + ". A Δ whose interval spans zero is marked "
            "'not resolved at this size': the test set and seeds cannot tell it from no difference, which is not "
            "evidence of no difference."]
