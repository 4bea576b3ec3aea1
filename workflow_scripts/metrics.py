"""Answer metrics, each following the published convention of the datasets that use it.

Every metric scores one prediction against a non-empty list of gold answers (the best gold wins)
and returns an :class:`ExampleScore`; :func:`corpus_score` turns a list of them into the corpus
figure. A prediction of ``None`` (the extractor found no answer) scores 0 everywhere.

Conventions (see docs/architecture.md, "Metrics"):
- ``exact_match``: OCR-VQA style, strip + lower-case + collapse whitespace, then equality.
- ``token_f1``: SQuAD v1.1 normalisation (lower-case, drop punctuation and articles, collapse
  whitespace), bag-of-tokens F1; an empty normalised side scores 1 only when both are empty.
- ``relaxed_accuracy``: ChartQA; numbers (after removing ``,`` ``$`` ``%``) match within 5% relative
  error of the gold, anything else by case-insensitive equality. A gold of 0 has no relative
  tolerance, so only a prediction numerically equal to 0 (``0``, ``0.0``, ``-0``) matches; the
  original pix2struct code compares strings there and would reject ``0.0``.
- ``anls``: InfoVQA/DocVQA, 1 - normalised Levenshtein distance on lower-cased, whitespace-collapsed
  text, set to 0 when the distance is >= 0.5 (the official ``NL < tau`` rule).
- ``smatch``: the PyPI ``smatch`` package, micro-averaged: (match, test, gold) triple counts are
  summed over the corpus before computing F1. A graph ``smatch`` cannot parse counts
  (0 matched, 0 predicted, gold triples), so it lowers recall without crashing the run.
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

from workflow_scripts.errors import WorkflowError

RELATIVE_TOLERANCE = 0.05
ANLS_THRESHOLD = 0.5
SMATCH_SEED = 0


@dataclass(frozen=True)
class ExampleScore:
    score: float
    counts: tuple[int, int, int] | None = None  # smatch only: (match, test, gold) triples


def _collapse(text: str) -> str:
    return " ".join(text.split())


# --- exact match ------------------------------------------------------------------------------

def normalise_exact(text: str) -> str:
    return _collapse(text.strip().lower())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    return float(any(normalise_exact(prediction) == normalise_exact(gold) for gold in golds))


# --- SQuAD token F1 ---------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalise_squad(text: str) -> str:
    """SQuAD v1.1 ``normalize_answer``: lower, drop punctuation, drop articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return _collapse(_ARTICLES.sub(" ", text))


def _f1(prediction_tokens: list[str], gold_tokens: list[str]) -> float:
    if not prediction_tokens or not gold_tokens:
        return float(prediction_tokens == gold_tokens)
    common = sum((Counter(prediction_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(prediction_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    tokens = normalise_squad(prediction).split()
    return max(_f1(tokens, normalise_squad(gold).split()) for gold in golds)


# --- ChartQA relaxed accuracy ----------------------------------------------------------------

_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def parse_number(text: str) -> float | None:
    """A finite number from ``text`` after removing ``,`` thousands separators, ``$`` and ``%``."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip("%").strip()
    if not _NUMBER.match(cleaned):
        return None
    return float(cleaned)


def _relaxed_match(prediction: str, gold: str) -> bool:
    predicted, target = parse_number(prediction), parse_number(gold)
    if predicted is not None and target is not None:
        if target == 0:
            return predicted == 0
        return abs(predicted - target) / abs(target) <= RELATIVE_TOLERANCE
    return prediction.strip().lower() == gold.strip().lower()


def relaxed_accuracy(prediction: str, golds: Sequence[str]) -> float:
    return float(any(_relaxed_match(prediction, gold) for gold in golds))


# --- ANLS ---------------------------------------------------------------------------------------

def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute cost 1), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _anls_one(prediction: str, gold: str) -> float:
    prediction, gold = _collapse(prediction.lower()), _collapse(gold.lower())
    longest = max(len(prediction), len(gold))
    if longest == 0:
        return 1.0
    distance = levenshtein(prediction, gold) / longest
    return 1.0 - distance if distance < ANLS_THRESHOLD else 0.0


def anls(prediction: str, golds: Sequence[str]) -> float:
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


# --- registry -------------------------------------------------------------------------------------

STRING_METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "exact_match": exact_match,
    "token_f1": token_f1,
    "relaxed_accuracy": relaxed_accuracy,
    "anls": anls,
}
METRICS = (*STRING_METRICS, "smatch")


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise WorkflowError(f"unknown metric '{metric}'; known: {', '.join(METRICS)}")


def score_example(metric: str, prediction: str | None, golds: Sequence[str]) -> ExampleScore:
    check_metric(metric)
    if not golds:
        raise WorkflowError("an example has no gold answers")
    if metric == "smatch":
        return smatch_example(prediction, golds)
    if prediction is None:
        return ExampleScore(0.0)
    return ExampleScore(STRING_METRICS[metric](prediction, golds))


def corpus_score(metric: str, scores: Sequence[ExampleScore]) -> float:
    """Mean of per-example scores, or for smatch the F1 of the summed triple counts (micro)."""
    check_metric(metric)
    if not scores:
        raise WorkflowError("no examples to score")
    if metric == "smatch":
        return f1_from_counts(*(sum(s.counts[k] for s in scores) for k in range(3)))
    return math.fsum(s.score for s in scores) / len(scores)
