"""Power before training: the smallest difference between two variants the planned comparison can detect.

Miller (2024), "Adding Error Bars to Evals: A Statistical Approach to Language Model Evaluations"
(arXiv:2411.00640), its power analysis: a paired difference of means over ``n`` test examples is
detected at two-sided level alpha with probability ``power`` when it exceeds

    MDE = (z_{1 - alpha/2} + z_{power}) * sqrt(Var(d) / n)

with ``Var(d)`` the variance of the per-example score difference. Seeds are not extra examples. Miller's
adaptation to K draws per question, Var = (Var(x) + E[sigma_i^2] / K) / n, divides only the within-example
variance by the draws; the examples' own spread (the same examples are hard for every seed, the usual case)
does not shrink with seeds. Before training that split is unknown, so the figure is the one-seed one: the
whole per-example variance over n, which bounds the examples-only bootstrap's variance for any number of
seeds. The two-level bootstrap (seeds, then examples) adds a seed-to-seed term, unknown before training, which
only widens the interval. So the estimate never advises seeds as a substitute for test examples, and it does
not depend on the seed count (adding a seed to a finished design reruns nothing here).

The paired variance is unknown before training. The assumption used and named in the report: the two
variants' per-example scores correlate with rho >= 1/2. For a score in [0, 1] (standard deviations x, y <= 1/2)
that bounds the variance of the difference: Var(a - b) = x^2 + y^2 - 2 rho x y <= x^2 + y^2 - x y
<= max(x, y)^2 <= 1/4 (Popoviciu). So 1/4 is used, or the untrained model's per-example variance (the largest
over the variants' prompts) where that is larger (a ratio metric's linearised contributions can be). The
untrained model's own variance alone is no guide: it scores near its floor (the demo's AMR model: micro F1
0.003, whose spread gave +-0.01 against the +-0.12 the trained variants achieved). The estimate is no bound
on what a run achieves: variants that correlate less (rho < 1/2) and the two-level bootstrap's seed term
both widen the achieved interval, which compare reports beside each difference (``achieved_lines``). An
unbounded metric (mlm_loss, perplexity) takes the untrained model's variance, and has no estimate where that
is 0.

Ratio-of-sums metrics (smatch's micro F1, the masked-LM ratios) are not means of per-example scores: each
example enters through its linearised contribution (delta method), (num_i - R * den_i) / mean(den) for
smatch's 2M / (T + G) and the masked-LM ratios, the numerical gradient for Smatch++'s 2PR / (P + R) and for
macro-F1 (the mean over the label set of 2TP / (gold + predicted) from per-class counts, metrics.class_counts),
so the variance is that of the corpus score's own estimator.

Macro-F1 is a score in [0, 1], but its contributions are not: an example of a rare class moves that class's F1,
weighted 1/K, by about 1 / (K * its frequency), so 1/4 does not bound its variance (three classes at 80/10/10 %:
a classifier that finds a quarter of each rare class, and predicts it nowhere else, has a variance of 0.74).
Its bound is over every classifier on the test set's gold class frequencies pi_k, the same rho >= 1/2 argument
then bounding the difference (``macro_f1_variance_bound``). The contribution of an example with gold j and
prediction l is (1/K)(2(1 - F_j)/d_j) when j == l, else -(1/K)(F_j/d_j + F_l/d_l), with F_k = 2TP_k / (G_k + P_k)
and d_k = (G_k + P_k) / n. With (x + y)^2 <= 2x^2 + 2y^2 its mean square is at most
(1/K^2) sum_k 4 a_k e_k / (2 a_k + e_k)^3, where a_k is class k's true-positive share and e_k its share of
errors (false negatives pi_k - a_k, plus false positives). Each term is largest at e_k = (1 + sqrt 3) a_k with no
false positive (a_k = pi_k / (2 + sqrt 3)), giving (2 sqrt 3 / 9) / pi_k; a class absent from the test set adds
0 (its F1 is 0 on every resample). So Var <= (2 sqrt 3 / 9) / K^2 * sum_k 1 / pi_k (0.385 for two balanced
classes, whose worst classifier reaches 0.263; 0.909 for 80/10/10 %, worst 0.75).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any, Mapping, Sequence

import numpy as np

from workflow_scripts.analysis import paired_bootstrap
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.tasks import metrics, smatchpp_metric

ALPHA = 0.05
POWER = 0.8
BOUNDED_VARIANCE = 0.25  # the largest variance of a score in [0, 1] (Popoviciu)
UNBOUNDED_METRICS = tuple(metrics.UNBOUNDED_RANGES)
# The best score an unbounded metric reaches (lower is better): a mean loss of 0 nats, a perplexity of 1. Two
# variants that train below the untrained model's score differ by less than its distance to this floor.
UNBOUNDED_FLOORS = {"mlm_loss": 0.0, "perplexity": 1.0}
VARIANCE_FROM_BASE = "untrained model's per-example variance (largest over the variants' prompts)"
VARIANCE_FROM_BOUND = ("1/4: for scores in [0, 1] whose variants correlate with rho >= 1/2, Var(a - b) <= 1/4; the "
                       "untrained model's per-example variance is smaller")
VARIANCE_FROM_MACRO_F1_BOUND = (
    "macro-F1's bound for the test set's class frequencies: (2 sqrt 3 / 9) / K^2 * sum_k 1 / pi_k bounds the "
    "per-example variance of any classifier's macro-F1, so Var(a - b) for variants that correlate with rho >= 1/2; "
    "the untrained model's per-example variance is smaller")
MACRO_F1_CLASS_BOUND = 2 * math.sqrt(3) / 9  # max over a classifier of one class's 4ae / (2a + e)^3, times pi_k


def z_sum(alpha: float = ALPHA, power: float = POWER) -> float:
    """z_{1 - alpha/2} + z_{power}: 1.96 + 0.84 = 2.80 at the defaults."""
    normal = NormalDist()
    return normal.inv_cdf(1 - alpha / 2) + normal.inv_cdf(power)


def minimum_detectable_effect(variance: float, n_examples: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """Miller (2024) eq. for the paired MDE over ``n_examples`` test examples: the one-seed figure (see the
    module docstring: seeds do not lower it)."""
    if n_examples < 1:
        raise WorkflowError(f"power: needs at least one test example, got {n_examples}")
    return z_sum(alpha, power) * math.sqrt(variance / n_examples)


def examples_needed(variance: float, target: float) -> int:
    """The fewest test examples whose MDE is at most ``target``."""
    return max(1, math.ceil(z_sum() ** 2 * variance / target ** 2))


def example_contributions(metric: str, records: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Per-example values whose mean's variance / n is the corpus score's: the per-example score for a mean
    metric, the linearised contribution for a ratio of sums (smatch: F1 = 2M / (T + G); masked-LM: R = a / b,
    perplexity = exp(a / b); macro-F1 of the records' per-class ``counts``, metrics.class_counts)."""
    if not records:
        raise WorkflowError("power: no predictions to estimate the variance from")
    if not metrics.summed_counts(metric):
        return np.asarray([float(record["score"]) for record in records])
    counts = np.asarray([record["counts"] for record in records], dtype=float)
    if metric == "smatchpp":
        return _linearised(smatchpp_metric.micro_f1, counts)
    if metric in metrics.CLASS_COUNT_METRICS:  # macro-F1 of summed per-class counts, as compare resamples it
        return _linearised(metrics.macro_f1_from_sums, counts)
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


def macro_f1_variance_bound(records: Sequence[Mapping[str, Any]]) -> float:
    """The largest per-example variance of macro-F1 over every classifier scored on these records' gold labels
    (their ``counts``: metrics.class_counts, [TP, gold, predicted] per class of the label set): (2 sqrt 3 / 9) /
    K^2 * sum over the classes present of 1 / pi_k (the module docstring derives it)."""
    counts = np.asarray([record["counts"] for record in records], dtype=float)
    width = counts.shape[1] // 3
    frequencies = counts[:, width:2 * width].sum(axis=0) / len(counts)
    present = frequencies[frequencies > 0]
    return float(MACRO_F1_CLASS_BOUND / width ** 2 * np.sum(1.0 / present))


ASSUMPTION = ("a one-seed figure: more seeds do not lower it where the same examples are hard for every seed; "
              "under the two-level bootstrap (comparison.bootstrap seeds_and_examples, or auto with 3 or more seeds) "
              "the seed-to-seed variance, unknown before training, only adds to it")


@dataclass(frozen=True)
class PowerEstimate:
    dataset: str
    model: str
    metric: str
    n_examples: int
    base_variance: float
    variance: float
    variance_source: str
    mde: float | None
    alpha: float = ALPHA
    power: float = POWER
    base_score: float | None = None  # the untrained model's corpus score, the largest over the variants' prompts

    def line(self) -> str:
        where = f"{self.dataset} ({self.model}, {self.metric})"
        if self.mde is None:
            return (f"{where}: with {self.n_examples} test examples, the detectable difference cannot be "
                    "estimated: the untrained model's scores do not vary and the metric is unbounded")
        variance = {VARIANCE_FROM_BOUND: "1/4 (bound at rho >= 1/2)",
                    VARIANCE_FROM_MACRO_F1_BOUND: f"{self.variance:.3g} (macro-F1's bound for the test set's class "
                                                  "frequencies, at rho >= 1/2)"}.get(
            self.variance_source, f"{self.variance:.3g} (the untrained model's)")
        return (f"{where}: with {self.n_examples} test examples, a difference below ±{self.mde:.2f} will not be "
                f"detectable (alpha {self.alpha}, power {self.power}; assumes a per-example difference variance of "
                f"{variance}; {ASSUMPTION})")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "assumption": ASSUMPTION, "line": self.line()}


def estimate(dataset: str, model: str, metric: str,
             base_records: Mapping[str, Sequence[Mapping[str, Any]]]) -> PowerEstimate:
    """The MDE of ``dataset`` from the untrained model's predictions per variant (``base_records``)."""
    sizes = {variant: len(records) for variant, records in base_records.items()}
    if len(set(sizes.values())) != 1:
        raise WorkflowError(f"power: dataset '{dataset}': the untrained model's evaluations have different test "
                            f"sizes per variant {sizes}; rerun evaluate_base with the same evaluation settings")
    n_examples = next(iter(sizes.values()))
    variances = [float(np.var(example_contributions(metric, records), ddof=1)) if n_examples > 1 else 0.0
                 for records in base_records.values()]
    base_variance = max(variances)
    if metric in metrics.CLASS_COUNT_METRICS:  # every variant is scored on the same gold labels
        bound, bound_source = macro_f1_variance_bound(next(iter(base_records.values()))), VARIANCE_FROM_MACRO_F1_BOUND
    else:
        bound, bound_source = BOUNDED_VARIANCE, VARIANCE_FROM_BOUND
    if metric not in UNBOUNDED_METRICS and base_variance <= bound:
        variance, source = bound, bound_source
    elif base_variance > 0:
        variance, source = base_variance, VARIANCE_FROM_BASE
    else:
        variance, source = 0.0, "none: the untrained model's scores do not vary and the metric is unbounded"
    mde = None if variance == 0 else minimum_detectable_effect(variance, n_examples)
    scores = [_corpus_score(metric, records) for records in base_records.values()]
    base_score = max(scores) if all(math.isfinite(score) for score in scores) else None  # no masked token: none
    return PowerEstimate(dataset, model, metric, n_examples, base_variance, variance, source, mde,
                         base_score=base_score)


def _corpus_score(metric: str, records: Sequence[Mapping[str, Any]]) -> float:
    """The corpus score of one evaluation's records, as compare computes it (paired_bootstrap.corpus_statistic)."""
    field = "counts" if metrics.summed_counts(metric) else "score"
    return float(paired_bootstrap.corpus_statistic(metric, np.asarray([record[field] for record in records], dtype=float)))


def check_threshold(estimate: PowerEstimate, threshold: float | None) -> None:
    """comparison.min_detectable_effect: stop before training when the planned comparison cannot resolve it, and
    refuse a threshold outside the reach of an unbounded metric's differences (the [0, 1] metrics' is refused
    with the config: checks/config)."""
    if threshold is None:
        return
    floor = UNBOUNDED_FLOORS.get(estimate.metric)
    if floor is not None and estimate.base_score is not None and threshold >= estimate.base_score - floor:
        reach = estimate.base_score - floor
        raise ConfigError(
            "comparison.min_detectable_effect",
            f"is {threshold:g}, but dataset '{estimate.dataset}' is scored by {estimate.metric}, "
            f"{metrics.score_range(estimate.metric)}, and the untrained model '{estimate.model}' scores "
            f"{estimate.base_score:.3g}: variants that train below that differ by less than {reach:.3g}, so the "
            f"threshold would never stop a run; give it in the metric's own units, well below {reach:.3g} (e.g. "
            f"{reach / 100:.2g})")
    if estimate.mde is None or estimate.mde <= threshold:
        return
    examples = examples_needed(estimate.variance, threshold)
    raise WorkflowError(
        f"dataset '{estimate.dataset}' (model '{estimate.model}'): with {estimate.n_examples} test examples the "
        f"minimum detectable effect is ±{estimate.mde:.3f}, above comparison.min_detectable_effect {threshold}. "
        f"Fix: use at least {examples} test examples (under the assumption in the power report; more seeds are "
        "no substitute: the examples' difficulty is shared across seeds), or raise comparison.min_detectable_effect")


def markdown(estimate: PowerEstimate) -> str:
    return "\n".join([
        f"# Power before training: {estimate.dataset} ({estimate.model})",
        "",
        estimate.line() + ".",
        "",
        f"- metric: {estimate.metric}; test examples: {estimate.n_examples}",
        f"- variance of the paired per-example difference assumed: {estimate.variance:.4g} ({estimate.variance_source})",
        f"- MDE = (z_(1-alpha/2) + z_power) * sqrt(variance / examples), alpha {estimate.alpha}, power "
        f"{estimate.power} (Miller 2024, \"Adding Error Bars to Evals\"): {ASSUMPTION}. Miller's Var = (Var(x) + "
        "E[sigma_i^2] / K) / n divides only the within-example variance by the K seeds; before training that share "
        "is unknown, so the whole per-example variance is divided by the examples alone.",
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
