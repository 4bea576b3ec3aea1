"""Answer metrics, each following the published scorer of the datasets that use it.

Every metric scores one prediction against a non-empty list of gold answers (the best gold wins)
and returns an :class:`ExampleScore`; :func:`corpus_score` turns a list of them into the corpus
figure. A prediction of ``None`` (the extractor found no answer) scores 0 everywhere. A dataset
picks its metric by name with the ``metric:`` key of its config (``config/schema.yaml``).

Metrics and the reference each one reproduces (see the function docstrings for the details):

- ``exact_match``: strict, OCR-VQA style: ``.strip().lower()`` on both sides, then equality.
  Inner whitespace and punctuation are kept.
- ``exact_match_squad``: ``exact_match_score`` of the official SQuAD v1.1 script
  (``evaluate-v1.1.py``): equality after ``normalize_answer`` (lower-case, drop ASCII punctuation,
  drop the articles a/an/the, collapse whitespace).
- ``token_f1``: ``f1_score`` of the same SQuAD v1.1 script: bag-of-tokens F1 after
  ``normalize_answer``; no common token (``num_same == 0``) gives 0, so two answers that are both
  empty after normalisation also score 0.
- ``relaxed_accuracy``: ChartQA's relaxed accuracy, ``relaxed_correctness`` of
  google-research/pix2struct ``pix2struct/metrics.py`` (evaluation harnesses such as lmms-eval
  copy it), reproduced exactly: nothing is stripped, a trailing ``%`` divides by 100, floats match
  within 5% relative change (inclusive), and a gold that is not a number or is numerically 0 falls
  back to case-insensitive string equality.
- ``relaxed_accuracy_lenient``: this workflow's earlier, more forgiving variant (``,`` ``$`` ``%``
  removed, ``%`` *not* divided by 100, a gold of 0 matched by any numeric 0). Not a published
  scorer; kept, under its own name, to reproduce earlier numbers.
- ``anls``: DocVQA / InfographicVQA ANLS as the official RRC evaluation script computes it
  (https://rrc.cvc.uab.es/?ch=17&com=downloads): distance between the stripped, lower-cased,
  whitespace-collapsed strings (from ``rapidfuzz``), divided by the longer *raw* length. Similarity
  exactly 0.5 scores 0.5: only a similarity strictly below the 0.5 threshold is set to 0.
- ``smatch``: the PyPI ``smatch`` package, micro-averaged: (match, test, gold) triple counts are
  summed over the corpus before computing F1. A graph ``smatch`` cannot parse counts
  (0 matched, 0 predicted, gold triples), so it lowers recall without crashing the run.
- ``masked_accuracy``, ``mlm_loss``, ``perplexity`` (task masked_lm, scored in ``tasks/masked_lm``):
  ratios of sums over test lines, as smatch: each line's record carries ``counts`` =
  ``[correct, masked]`` or ``[summed cross-entropy, masked]``; the corpus score is
  sum(first) / sum(masked), and perplexity exp of the mean loss. So the comparison resamples lines
  and recomputes the ratio (a mean of per-line ratios would weight short lines as long ones).
- ``smatchpp``: optimal Smatch (Smatch++, the ``smatchpp`` package: AMR standardisation, ILP alignment),
  micro-averaged from each pair's ``[a, b, c, d]`` statistic as the package's command line computes it
  (``tasks/smatchpp_metric``). Beside ``smatch``, whose hill climbing can miss the best alignment.
"""
from __future__ import annotations

import contextlib
import io
import math
import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from rapidfuzz.distance import Levenshtein

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.tasks import smatchpp_metric

RELATIVE_TOLERANCE = 0.05
ANLS_THRESHOLD = 0.5
SMATCH_SEED = 0


@dataclass(frozen=True)
class ExampleScore:
    score: float
    counts: tuple[float, ...] | None = None  # ratio-of-sums metrics only (COUNTS_WIDTH): smatch's triples...


def _collapse(text: str) -> str:
    return " ".join(text.split())


# --- exact match ------------------------------------------------------------------------------

def normalise_exact(text: str) -> str:
    """Strict normalisation: surrounding whitespace removed, lower-cased, nothing else."""
    return text.strip().lower()


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """Strict exact match, OCR-VQA style: ``prediction.strip().lower() == gold.strip().lower()``.

    Inner whitespace, punctuation and articles are significant (``"blue  sky"`` does not match
    ``"blue sky"``, ``"blue."`` does not match ``"blue"``). For SQuAD's normalisation use
    :func:`exact_match_squad`.
    """
    return float(any(normalise_exact(prediction) == normalise_exact(gold) for gold in golds))


# --- SQuAD v1.1: exact match and token F1 -----------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalise_squad(text: str) -> str:
    """SQuAD v1.1 ``normalize_answer``: lower, drop punctuation, drop articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return _collapse(_ARTICLES.sub(" ", text))


def exact_match_squad(prediction: str, golds: Sequence[str]) -> float:
    """SQuAD v1.1 ``exact_match_score``: ``normalize_answer(prediction) == normalize_answer(gold)``.

    Reference: ``evaluate-v1.1.py`` of the SQuAD v1.1 release (rajpurkar.github.io/SQuAD-explorer),
    maximised over gold answers as its ``metric_max_over_ground_truths`` does. Two answers that
    normalise to the empty string (``"The"`` and ``"a"``) are equal there, so they match here.
    """
    predicted = normalise_squad(prediction)
    return float(any(predicted == normalise_squad(gold) for gold in golds))


def _f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(prediction_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:  # also the case when either side, or both, has no tokens
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    """SQuAD v1.1 ``f1_score``, maximised over gold answers.

    Reference: ``evaluate-v1.1.py`` of the SQuAD v1.1 release. Both sides go through
    ``normalize_answer`` and are split on whitespace; ``num_same`` is the size of the multiset
    intersection, and ``num_same == 0`` returns 0 before precision and recall are computed. Two
    answers that are both empty after normalisation therefore score 0 (unlike SQuAD v2.0's script,
    which scores that case 1).
    """
    tokens = normalise_squad(prediction).split()
    return max(_f1(tokens, normalise_squad(gold).split()) for gold in golds)


# --- ChartQA relaxed accuracy ----------------------------------------------------------------

def _reference_float(text: str) -> float | None:
    """pix2struct's ``_to_float``: ``float(text)``, or ``float(text.rstrip('%')) / 100`` for ``...%``.

    Python's ``float`` is the parser, with all it accepts (surrounding whitespace, ``1_000``,
    ``1e3``, ``nan``, ``inf``) and all it refuses (``1,234``, ``$5``): no cleaning is added.
    """
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_correctness(prediction: str, gold: str) -> bool:
    """One pair, exactly as ``relaxed_correctness(target, prediction)`` in pix2struct ``metrics.py``.

    If the prediction parses as a float and the gold parses as a *non-zero* float (the reference
    tests ``target_float`` for truth), the pair matches when
    ``abs(pred - gold) / abs(gold) <= 0.05``. Otherwise (a non-numeric side, or a gold of 0, where
    a relative change is undefined) it compares ``prediction.lower() == gold.lower()``, so gold
    ``"0"`` is matched by ``"0"`` but not by ``"0.0"``. Nothing is stripped: ``","`` and ``"$"`` make
    a string non-numeric, and a leading space only passes where ``float`` ignores it. A gold of
    ``nan`` or ``inf`` never matches (the relative change is NaN), as in the reference.
    """
    predicted, target = _reference_float(prediction), _reference_float(gold)
    if predicted is not None and target:
        return abs(predicted - target) / abs(target) <= RELATIVE_TOLERANCE
    return prediction.lower() == gold.lower()


def relaxed_accuracy(prediction: str, golds: Sequence[str]) -> float:
    """ChartQA relaxed accuracy (the reference scorer), maximised over gold answers.

    Reference: ``relaxed_correctness`` in google-research/pix2struct ``pix2struct/metrics.py``,
    applied through its ``aggregate_metrics`` (max over targets, no normalisation); it implements
    the rule of the ChartQA paper (Masry et al. 2022, end of section 5.1): numeric answers within 5%
    of the gold are correct, other answers need an exact match. See :func:`relaxed_correctness`.
    """
    return float(any(relaxed_correctness(prediction, gold) for gold in golds))


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def parse_number(text: str) -> float | None:
    """Lenient variant only: a finite number after removing ``,`` separators, ``$`` and ``%``."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip("%").strip()
    if not _NUMBER.match(cleaned):
        return None
    return float(cleaned)


def _lenient_match(prediction: str, gold: str) -> bool:
    predicted, target = parse_number(prediction), parse_number(gold)
    if predicted is not None and target is not None:
        if target == 0:
            return predicted == 0
        return abs(predicted - target) / abs(target) <= RELATIVE_TOLERANCE
    return prediction.strip().lower() == gold.strip().lower()


def relaxed_accuracy_lenient(prediction: str, golds: Sequence[str]) -> float:
    """This workflow's earlier relaxed accuracy; NOT the published ChartQA scorer.

    Differences from :func:`relaxed_accuracy` (the reference): both sides are stripped; ``,``
    thousands separators, ``$`` and a trailing ``%`` are removed before parsing, and ``%`` is *not*
    divided by 100 (``"45%"`` equals ``"45"`` but not ``"0.45"``); only finite plain decimals count
    as numbers (no ``nan``/``inf``/``1_000``); a gold of 0 is matched by any numeric 0 (``0.0``,
    ``-0``). Tolerance otherwise as the reference (5% relative, inclusive). Choose it with
    ``metric: relaxed_accuracy_lenient`` in a dataset's config, and report it as such: its numbers
    are not comparable with published ChartQA relaxed accuracy.
    """
    return float(any(_lenient_match(prediction, gold) for gold in golds))


# --- ANLS ---------------------------------------------------------------------------------------

def _anls_one(prediction: str, gold: str) -> float:
    """One pair, as the official DocVQA/InfographicVQA (RRC) script scores it.

    Both sides are normalised with ``' '.join(s.strip().lower().split())`` and their Levenshtein
    distance (``rapidfuzz.distance.Levenshtein.distance``) is divided by
    ``max(len(gold.upper()), len(prediction.upper()))`` of the *un-normalised* strings, as the
    script does (0 when both are empty). The similarity ``1 - NL`` is kept when it is >= 0.5.
    """
    length = max(len(gold.upper()), len(prediction.upper()))
    if length == 0:
        normalised_distance = 0.0
    else:
        distance = Levenshtein.distance(_collapse(gold.strip().lower()), _collapse(prediction.strip().lower()))
        normalised_distance = distance / length
    similarity = 1 - normalised_distance
    return 0.0 if similarity < ANLS_THRESHOLD else similarity


def anls(prediction: str, golds: Sequence[str]) -> float:
    """ANLS of DocVQA and InfographicVQA (Biten et al. 2019, eq. 1), maximised over gold answers.

    Reference: the official evaluation script of the DocVQA challenge at the RRC
    (https://rrc.cvc.uab.es/?ch=17&com=downloads, "Infographics VQA Evaluation scripts", the URL
    pix2struct's ``anls_metric`` cites), which computes
    ``question_result = 1 - min(NL over golds)`` and sets it to 0 only ``if question_result <
    ANLS_THRESHOLD`` (0.5). So a normalised similarity of exactly 0.5 (``NL == 0.5``) scores 0.5,
    not 0; zero is given only strictly below the threshold. (pix2struct's ``anls_metric`` agrees at
    the boundary: ``1 - NL if NL <= 0.5 else 0``.) Thresholding the best gold equals the maximum of
    the thresholded per-gold scores, which is what is computed here. See :func:`_anls_one` for the
    normalisation.
    """
    return max(_anls_one(prediction, gold) for gold in golds)


# --- Smatch -------------------------------------------------------------------------------------

class _ReproducibleRandom(random.Random):
    """smatch reseeds its restarts from OS entropy (``random.seed()``); reseed from a fixed value."""

    def seed(self, a=None, version=2):
        super().seed(SMATCH_SEED if a is None else a, version)


@contextlib.contextmanager
def _quiet_reproducible_smatch():
    import amr  # installed by the smatch package
    import smatch

    # Parse errors of predictions are expected (they score 0); keep them out of the job's log.
    saved = smatch.random, smatch.ERROR_LOG, amr.ERROR_LOG
    smatch.random, smatch.ERROR_LOG, amr.ERROR_LOG = _ReproducibleRandom(SMATCH_SEED), io.StringIO(), io.StringIO()
    smatch.match_triple_dict.clear()  # its cache is keyed by node names, which repeat across pairs
    try:
        yield smatch
    finally:
        smatch.match_triple_dict.clear()
        smatch.random, smatch.ERROR_LOG, amr.ERROR_LOG = saved


def graph_triples(graph: str) -> int | None:
    """Number of triples smatch sees in ``graph``, or None when it cannot parse it."""
    with _quiet_reproducible_smatch():
        import amr

        try:
            parsed = amr.AMR.parse_AMR_line(_collapse(graph))
        except Exception:  # smatch raises assorted IndexError/ValueError on malformed text
            return None
        if parsed is None:
            return None
        instances, attributes, relations = parsed.get_triples()
        return len(instances) + len(attributes) + len(relations)


def smatch_counts(prediction: str | None, gold: str) -> tuple[int, int, int]:
    """(match, test, gold) triple counts of one pair; an unparseable prediction gives (0, 0, gold)."""
    gold_total = graph_triples(gold)
    if gold_total is None:
        raise WorkflowError(f"gold graph is not valid PENMAN for smatch: {gold[:80]!r}")
    if prediction is None or not prediction.strip() or graph_triples(prediction) is None:
        return 0, 0, gold_total
    with _quiet_reproducible_smatch() as smatch:
        match, test, gold_count = smatch.get_amr_match(_collapse(prediction), _collapse(gold))
    return int(match), int(test), int(gold_count)


def f1_from_counts(match: float, test: float, gold: float) -> float:
    """smatch's ``compute_f``: 0 when either side has no triples."""
    if test == 0 or gold == 0 or match == 0:
        return 0.0
    precision, recall = match / test, match / gold
    return 2 * precision * recall / (precision + recall)


def smatch_example(prediction: str | None, golds: Sequence[str]) -> ExampleScore:
    """The gold graph giving the best pair F1 (the first on ties); its counts enter the corpus sums."""
    best = None
    for gold in golds:
        counts = smatch_counts(prediction, gold)
        score = f1_from_counts(*counts)
        if best is None or score > best.score:
            best = ExampleScore(score, counts)
    return best


def smatchpp_example(prediction: str | None, golds: Sequence[str]) -> ExampleScore:
    """Smatch++: the gold graph giving the best pair F1 (the first on ties), as for smatch."""
    best = None
    for gold in golds:
        counts = smatchpp_metric.pair_counts(prediction, gold)
        score = smatchpp_metric.pair_f1(counts)
        if best is None or score > best.score:
            best = ExampleScore(score, counts)
    return best


def graph_readable(metric: str, graph: str) -> bool:
    """Whether the graph metric's own reader can read ``graph`` (else it scores as unparseable)."""
    if metric == "smatchpp":
        return smatchpp_metric.readable(graph)
    return graph_triples(graph) is not None


# --- registry -------------------------------------------------------------------------------------

STRING_METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "exact_match": exact_match,
    "exact_match_squad": exact_match_squad,
    "token_f1": token_f1,
    "relaxed_accuracy": relaxed_accuracy,
    "relaxed_accuracy_lenient": relaxed_accuracy_lenient,
    "anls": anls,
}
METRICS = (*STRING_METRICS, "smatch", "smatchpp")
GRAPH_METRICS = ("smatch", "smatchpp")


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise WorkflowError(f"unknown metric '{metric}'; known: {', '.join(METRICS)}")


def score_example(metric: str, prediction: str | None, golds: Sequence[str]) -> ExampleScore:
    check_metric(metric)
    if not golds:
        raise WorkflowError("an example has no gold answers")
    if metric == "smatch":
        return smatch_example(prediction, golds)
    if metric == "smatchpp":
        return smatchpp_example(prediction, golds)
    if prediction is None:
        return ExampleScore(0.0)
    return ExampleScore(STRING_METRICS[metric](prediction, golds))


# Metrics whose corpus score is computed from counts summed over the examples (not a mean of the
# examples' scores): how many counts each record carries.
COUNTS_WIDTH = {"smatch": 3, "smatchpp": smatchpp_metric.COUNTS, "masked_accuracy": 2, "mlm_loss": 2, "perplexity": 2}
RATIO_METRICS = ("masked_accuracy", "mlm_loss", "perplexity")  # counts = [numerator, masked tokens]

# A classifier's macro-F1 is a function of per-class counts summed over the examples; a record's counts
# (class_counts) are 3 per class of the label set, so their width is the label set's, not the metric's.
CLASS_COUNT_METRICS = ("macro_f1",)

# Corpus scores the comparison can recompute and resample from per-example records: the means (a
# classifier's accuracy too: 1/0 per example), smatch's micro F1, the masked-LM ratios and macro-F1.
COMPARABLE_METRICS = (*METRICS, "accuracy", *RATIO_METRICS, *CLASS_COUNT_METRICS)


# What each comparable corpus score ranges over, for the line under the comparison table: a score in [0, 1]
# (higher is better) but for the masked LM's mean loss (nats) and its exponential.
UNBOUNDED_RANGES = {"mlm_loss": "[0, ∞), lower is better", "perplexity": "[1, ∞), lower is better"}


def score_range(metric: str) -> str:
    """``metric``'s range and direction, e.g. "[0, 1], higher is better"."""
    return UNBOUNDED_RANGES.get(metric, "[0, 1], higher is better")


def counts_width(metric: str) -> int | None:
    """How many summed counts a record of ``metric`` carries; None for a mean of per-example scores or a
    width set by the label set (macro_f1: ``summed_counts`` says it sums counts all the same)."""
    return COUNTS_WIDTH.get(metric)


def summed_counts(metric: str) -> bool:
    """Whether ``metric``'s corpus score comes from counts summed over examples (not a mean of scores)."""
    return metric in COUNTS_WIDTH or metric in CLASS_COUNT_METRICS


def class_counts(gold: str, predicted: str, labels: Sequence[str]) -> list[int]:
    """One classified example's counts over ``labels`` (in that order): [true positive per class, gold per class,
    predicted per class]. Summed over the examples they give macro-F1 (``macro_f1_from_sums``), so a bootstrap
    resamples them as smatch's triple counts."""
    if gold not in labels or predicted not in labels:
        raise WorkflowError(f"label {gold if gold not in labels else predicted!r} is not one of the label set {list(labels)}")
    width = len(labels)
    counts = [0] * (3 * width)
    counts[labels.index(gold)] = int(gold == predicted)
    counts[width + labels.index(gold)] = 1
    counts[2 * width + labels.index(predicted)] = 1
    return counts


def macro_f1_from_sums(sums):
    """Macro-F1 from ``class_counts`` summed over examples (last axis: 3 x classes; numpy arrays of any leading
    shape): the unweighted mean over the whole label set of 2TP / (gold + predicted) = 2TP / (2TP + FP + FN),
    a class neither in the gold nor predicted counting 0 (scikit-learn's f1_score(labels=<set>, average='macro',
    zero_division=0), as tasks/classification.macro_f1)."""
    import numpy as np

    sums = np.asarray(sums, dtype=float)
    width = sums.shape[-1] // 3
    true_positive, gold, predicted = sums[..., :width], sums[..., width:2 * width], sums[..., 2 * width:]
    denominator = gold + predicted
    with np.errstate(divide="ignore", invalid="ignore"):
        per_class = np.where(denominator > 0, 2 * true_positive / denominator, 0.0)
    return per_class.mean(axis=-1)


def ratio_from_sums(metric: str, numerator, masked):
    """masked_accuracy / mlm_loss = numerator / masked; perplexity = exp(that). Works on numpy arrays
    (the bootstrap's resampled sums) and on floats; no masked token gives NaN, never a made-up score."""
    import numpy as np

    if metric not in RATIO_METRICS:
        raise WorkflowError(f"'{metric}' is not a ratio-of-sums metric ({', '.join(RATIO_METRICS)})")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.asarray(numerator, dtype=float) / np.asarray(masked, dtype=float)
    return np.exp(ratio) if metric == "perplexity" else ratio


def corpus_score(metric: str, scores: Sequence[ExampleScore]) -> float:
    """Mean of per-example scores, or for smatch the F1 of the summed triple counts (micro)."""
    if metric not in COMPARABLE_METRICS:
        raise WorkflowError(f"metric '{metric}' is not a mean over examples nor smatch, so the comparison cannot "
                            f"resample it; compare with one of {', '.join(COMPARABLE_METRICS)} (e.g. accuracy)")
    if not scores:
        raise WorkflowError("no examples to score")
    if metric == "smatch":
        return f1_from_counts(*(sum(s.counts[k] for s in scores) for k in range(3)))
    if metric == "smatchpp":
        return float(smatchpp_metric.micro_f1([sum(s.counts[k] for s in scores) for k in range(smatchpp_metric.COUNTS)]))
    if metric in CLASS_COUNT_METRICS:
        return float(macro_f1_from_sums([math.fsum(s.counts[k] for s in scores) for k in range(len(scores[0].counts))]))
    if metric in RATIO_METRICS:
        masked = math.fsum(s.counts[1] for s in scores)
        if masked <= 0:
            raise WorkflowError(f"{metric}: no masked token in any example")
        return float(ratio_from_sums(metric, math.fsum(s.counts[0] for s in scores), masked))
    return math.fsum(s.score for s in scores) / len(scores)
