"""Each metric pinned to values worked out by hand from its published convention."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from workflow_scripts.tasks import metrics
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.tasks.metrics import ExampleScore, anls, exact_match, relaxed_accuracy, token_f1

WANT_BOY = "(w / want-01 :ARG0 (b / boy))"  # triples: 2 instances, TOP, ARG0 = 4
WANT_GO = "(w / want-01 :ARG0 (b / boy) :ARG1 (g / go-02 :ARG0 b))"  # 3 instances, TOP, 3 relations = 7


# --- exact match: strict (OCR-VQA) and SQuAD ------------------------------------------------------
# Strict rule: prediction.strip().lower() == gold.strip().lower(), nothing else.

@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("  Blue ", ["blue"], 1.0),                 # strip + lower-case
        # Was 1.0 when exact_match also collapsed inner whitespace; the strict rule keeps it:
        # "blue   sky" != "blue sky" after strip + lower.
        ("blue   sky", ["Blue Sky"], 0.0),
        ("Blue Sky\n", ["blue sky"], 1.0),          # a trailing newline is stripped
        ("blue\tsky", ["blue sky"], 0.0),           # an inner tab is not a space
        ("the blue", ["blue"], 0.0),                # articles are kept (OCR-VQA convention, not SQuAD)
        ("", ["blue"], 0.0),                        # empty prediction
        ("yes", ["red", "Yes"], 1.0),               # any gold answer
        ("blue.", ["blue"], 0.0),                   # punctuation is kept
    ],
)
def test_exact_match(prediction, golds, expected):
    assert exact_match(prediction, golds) == expected


# SQuAD v1.1 exact_match_score: normalize_answer(pred) == normalize_answer(gold), where
# normalize_answer = white_space_fix(remove_articles(remove_punc(lower(s)))).
@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("The Blue  Sky.", ["blue sky"], 1.0),      # lower, '.' dropped, 'the' dropped, spaces collapsed
        ("blue   sky", ["Blue Sky"], 1.0),          # same text strict exact_match now rejects
        ("an apple", ["Apple!"], 1.0),              # 'an' and '!' dropped -> 'apple' == 'apple'
        ("U.S.", ["us"], 1.0),                      # punctuation removed inside words: 'us'
        ("theory", ["ory"], 0.0),                   # \b(a|an|the)\b: 'the' inside a word is kept
        ("blue", ["red", "BLUE"], 1.0),             # max over golds
        ("The", ["a"], 1.0),                        # both normalise to '' and '' == '' in the script
        ("blue sky", ["sky blue"], 0.0),            # order matters (unlike token F1)
    ],
)
def test_exact_match_squad(prediction, golds, expected):
    assert metrics.exact_match_squad(prediction, golds) == expected


# --- SQuAD v1.1 token F1 -------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("the cat sat", ["a cat sat on the mat"], 2 / 3),     # P = 2/2, R = 2/4
        ("the cat sat", ["dog", "cat sat on mat"], 2 / 3),    # max over golds
        ("x x y", ["x y y"], 2 / 3),                          # bag of tokens: common = 1 + 1
        ("Paris!", ["paris"], 1.0),                           # punctuation and case dropped
        ("", ["cat"], 0.0),                                   # empty prediction
        # Was 1.0 ("both empty scores 1", SQuAD v2.0's rule). In v1.1's f1_score both token lists
        # are empty, Counter() & Counter() is empty, num_same == 0 -> return 0.
        ("", ["The"], 0.0),
        ("a", ["the"], 0.0),                                  # same: '' vs '' after normalisation
        ("an apple", ["pear"], 0.0),
    ],
)
def test_token_f1(prediction, golds, expected):
    assert token_f1(prediction, golds) == pytest.approx(expected)


def test_token_f1_of_two_empty_answers_is_zero_as_in_squad_v1_1():
    # evaluate-v1.1.py: common = Counter([]) & Counter([]) -> num_same = 0 -> "if num_same == 0: return 0".
    assert token_f1("", [""]) == 0.0
    assert metrics.score_example("token_f1", "  ", ["?!"]) == ExampleScore(0.0)  # punctuation-only gold -> ''


# --- ChartQA relaxed accuracy: the pix2struct reference -------------------------------------------
# Reference (pix2struct/metrics.py, relaxed_correctness(target, prediction)):
#   _to_float(text): float(text.rstrip('%')) / 100.0 if text.endswith('%') else float(text); None on ValueError
#   if prediction_float is not None and target_float:        # a target of 0.0 is falsy
#       return abs(prediction_float - target_float) / abs(target_float) <= 0.05
#   else: return prediction.lower() == target.lower()

@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        # Rows whose expected value changed from the old (lenient) implementation, which stripped
        # ',' '$' '%' and treated a gold 0 numerically; the reference does none of that:
        ("45%", ["45"], 0.0),            # 45% -> 0.45; |0.45 - 45| / 45 = 0.99 > 0.05 (was 1.0)
        ("0.45", ["45%"], 1.0),          # gold 45% -> 0.45; pred 0.45: relative change 0 (was 0.0)
        ("45%", ["0.46"], 1.0),          # 0.45 vs 0.46: 0.01/0.46 = 2.2%
        ("1,234", ["1234"], 0.0),        # float('1,234') fails -> strings '1,234' != '1234' (was 1.0)
        ("$1,290", ["1,234"], 0.0),      # neither parses -> strings differ (was 1.0)
        ("$5", ["$5"], 1.0),             # neither parses -> equal strings
        ("0.0", ["0"], 0.0),             # gold 0.0 is falsy -> strings '0.0' != '0' (was 1.0)
        ("-0", ["0"], 0.0),              # likewise (was 1.0)
        (" yes", ["yes"], 0.0),          # string branch: nothing stripped (was 1.0)
        # Rows with the same value before and after, worked out from the reference:
        ("0", ["0"], 1.0),               # gold 0 -> string branch: '0' == '0'
        ("0.01", ["0"], 0.0),            # string branch: '0.01' != '0'
        ("105", ["100"], 1.0),           # 5/100 = 0.05 <= 0.05: inclusive
        ("105.1", ["100"], 0.0),         # 5.1%
        ("-10", ["-10.4"], 1.0),         # 0.4/10.4 = 3.8%
        ("1e3", ["1000"], 1.0),          # float('1e3') = 1000.0
        (" 12", ["12"], 1.0),            # float(' 12') = 12.0: float itself ignores the space
        ("1_000", ["1000"], 1.0),        # float('1_000') = 1000.0 (Python's float, as in the reference)
        ("inf", ["inf"], 0.0),           # |inf - inf| / inf = nan; nan <= 0.05 is False
        ("Yes", ["yes"], 1.0),           # text: case-insensitive equality
        ("blu", ["blue"], 0.0),
        ("2", ["two"], 0.0),
        ("", ["0"], 0.0),                # float('') fails -> '' != '0'
        ("Twelve", ["12", "twelve"], 1.0),
        ("13", ["twelve", "12.5"], 1.0), # max over golds: 0.5/12.5 = 4%
    ],
)
def test_relaxed_accuracy(prediction, golds, expected):
    assert relaxed_accuracy(prediction, golds) == expected


def test_relaxed_accuracy_handles_a_trailing_percent_as_a_hundredth():
    # _to_float('12.5%') = float('12.5') / 100 = 0.125; the old code stripped '%' and read 12.5.
    assert relaxed_accuracy("0.125", ["12.5%"]) == 1.0
    assert relaxed_accuracy("12.5", ["12.5%"]) == 0.0   # |12.5 - 0.125| / 0.125 = 99
    assert relaxed_accuracy("12.5%", ["12.5%"]) == 1.0


# The old behaviour, kept under its own name (not a published scorer).
@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("45%", ["45"], 1.0),            # '%' stripped
        ("1,234", ["1234"], 1.0),        # thousands separator
        ("$1,290", ["1,234"], 1.0),      # 56/1234 = 4.5% off
        ("105", ["100"], 1.0),           # exactly 5%: inclusive
        ("105.1", ["100"], 0.0),         # 5.1%
        ("0", ["0"], 1.0),               # gold 0: only a numeric zero matches
        ("0.0", ["0"], 1.0),
        ("-0", ["0"], 1.0),
        ("0.01", ["0"], 0.0),
        ("0.45", ["45%"], 0.0),          # '%' is stripped, not divided by 100
        (" yes", ["Yes"], 1.0),          # text: stripped, case-insensitive
        ("inf", ["inf"], 1.0),           # not a number here: equal strings
        ("", ["0"], 0.0),
    ],
)
def test_relaxed_accuracy_lenient(prediction, golds, expected):
    assert metrics.relaxed_accuracy_lenient(prediction, golds) == expected
    assert metrics.score_example("relaxed_accuracy_lenient", prediction, golds).score == expected


def test_parse_number_refuses_what_float_would_accept():
    assert metrics.parse_number("nan") is None and metrics.parse_number("inf") is None
    assert metrics.parse_number("1_000") is None and metrics.parse_number("12 apples") is None
    assert metrics.parse_number(" $3,000.5% ") == 3000.5


# --- ANLS: the official DocVQA / InfographicVQA (RRC) script ----------------------------------------
# Reference, per gold answer:
#   gt, det = ' '.join(answer.strip().lower().split()), ' '.join(pred.strip().lower().split())
#   NL = levenshtein(gt, det) / max(len(answer.upper()), len(pred.upper()))   (0 if that length is 0)
#   question_result = 1 - min(NL over golds); 0 if question_result < 0.5

@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("Hello", ["hello"], 1.0),
        ("helo", ["hello"], 0.8),                 # 1 edit / 5
        ("kitten", ["sitting"], 1 - 3 / 7),
        # Was 0.0 (the old code zeroed NL >= 0.5). 1 edit / 2 -> similarity 1 - 0.5 = 0.5, which
        # is not < 0.5, so the script keeps 0.5.
        ("ab", ["ac"], 0.5),
        ("abcd", ["abxy"], 0.5),                  # 2 edits / 4: exactly at the threshold
        ("abcdef", ["abxyzw"], 0.0),              # 4 edits / 6: similarity 1/3 < 0.5
        ("abc", ["abd"], 2 / 3),
        ("abc", ["xyz", "abd", "abcd"], 0.75),    # max over golds: 'abcd' is 1 edit / 4
        ("", ["abc"], 0.0),                       # empty prediction: 3 edits / 3
        ("", [""], 1.0),                          # length 0 -> NL 0 -> 1
        ("new  york ", ["New York"], 1.0),        # lower-case, whitespace collapsed: 0 edits
        # Length from the raw strings: gt 'new york' vs det 'new yrk' is 1 edit, divided by
        # max(len('new  york'), len('new yrk')) = 9, not by 8 -> 1 - 1/9 (old code: 1 - 1/8).
        ("new yrk", ["new  york"], 1 - 1 / 9),
    ],
)
def test_anls(prediction, golds, expected):
    assert anls(prediction, golds) == pytest.approx(expected)


def test_anls_similarity_of_exactly_half_scores_half():
    # 'abc' vs 'xyz' (3 edits / 6) padded: 'abcxyz' vs 'abcabc' -> 3 substitutions / 6 = 0.5.
    assert anls("abcxyz", ["abcabc"]) == 0.5
    assert metrics.score_example("anls", "abcxyz", ["abcabc"]) == ExampleScore(0.5)
    # One more edit (4 / 6) drops below the threshold.
    assert anls("abxxyz", ["abcabc"]) == 0.0


def test_anls_distance_comes_from_rapidfuzz(monkeypatch):
    assert not hasattr(metrics, "levenshtein")  # the hand-written DP is gone
    calls = []

    class Spy:
        @staticmethod
        def distance(a, b):
            calls.append((a, b))
            return 1

    monkeypatch.setattr(metrics, "Levenshtein", Spy)
    assert anls("Kitten", ["sitting"]) == pytest.approx(1 - 1 / 7)
    assert calls == [("sitting", "kitten")]


def test_rapidfuzz_levenshtein_is_unit_cost():
    # The ANLS reference counts insert, delete and substitute as 1 each (plain Levenshtein).
    from rapidfuzz.distance import Levenshtein

    for a, b, distance in [("kitten", "sitting", 3), ("", "abc", 3), ("flaw", "lawn", 2), ("a", "a", 0)]:
        assert Levenshtein.distance(a, b) == distance == Levenshtein.distance(b, a)


def test_smatch_pair_counts():
    assert metrics.smatch_counts(WANT_BOY, WANT_BOY) == (4, 4, 4)
    assert metrics.smatch_counts("(x / want-01 :ARG0 (y / boy))", WANT_BOY) == (4, 4, 4)  # variable names do not matter
    assert metrics.smatch_counts("(w / want-01 :ARG0 (g / girl))", WANT_BOY) == (3, 4, 4)  # boy != girl
    assert metrics.smatch_counts(WANT_GO, WANT_GO) == (7, 7, 7)


@pytest.mark.parametrize("broken", ["(w / want-01 :ARG0 (b))", "not a graph", "", None])
def test_unparseable_graph_scores_zero_counts_without_crashing(broken):
    assert metrics.smatch_counts(broken, WANT_GO) == (0, 0, 7)
    assert metrics.score_example("smatch", broken, [WANT_GO]) == ExampleScore(0.0, (0, 0, 7))


def test_smatch_is_micro_averaged_over_the_corpus():
    perfect = metrics.score_example("smatch", WANT_GO, [WANT_GO])            # (7, 7, 7), F1 1
    partial = metrics.score_example("smatch", "(w / want-01 :ARG0 (g / girl))", [WANT_BOY])  # (3, 4, 4), F1 0.75
    assert partial.score == pytest.approx(0.75)
    assert metrics.corpus_score("smatch", [perfect, partial]) == pytest.approx(10 / 11)  # macro would be 0.875
    missing = metrics.score_example("smatch", None, [WANT_BOY])                 # (0, 0, 4)
    # P = 7/7, R = 7/11: F1 = 2 * (7/11) / (1 + 7/11) = 14/18
    assert metrics.corpus_score("smatch", [perfect, missing]) == pytest.approx(14 / 18)


def test_smatch_cache_is_cleared_between_pairs():
    """smatch caches triple matches by node names (a0, b0...), which every pair reuses."""
    import smatch

    alone = metrics.smatch_counts("(w / want-01 :ARG0 (g / girl))", WANT_BOY)
    metrics.smatch_counts(WANT_GO, "(x / go-02 :ARG1 (y / want-01) :ARG0 (z / boy))")
    after_another = metrics.smatch_counts("(w / want-01 :ARG0 (g / girl))", WANT_BOY)
    assert alone == after_another == (3, 4, 4)
    assert not smatch.match_triple_dict


def test_smatch_with_several_golds_keeps_the_best_pair():
    scored = metrics.score_example("smatch", WANT_BOY, [WANT_GO, WANT_BOY])
    assert scored == ExampleScore(1.0, (4, 4, 4))


def test_smatch_refuses_a_broken_gold_graph():
    with pytest.raises(WorkflowError, match="gold graph"):
        metrics.smatch_counts(WANT_BOY, "(a / b :x (c))")


def test_corpus_score_is_the_mean_and_none_scores_zero():
    scores = [metrics.score_example("exact_match", p, ["a"]) for p in ("a", "b", None, "A")]
    assert [s.score for s in scores] == [1.0, 0.0, 0.0, 1.0]
    assert metrics.corpus_score("exact_match", scores) == 0.5


def test_unknown_metric_and_empty_inputs_are_refused():
    with pytest.raises(WorkflowError, match="unknown metric 'bleu'"):
        metrics.score_example("bleu", "a", ["a"])
    with pytest.raises(WorkflowError, match="no gold answers"):
        metrics.score_example("anls", "a", [])
    with pytest.raises(WorkflowError, match="no examples"):
        metrics.corpus_score("anls", [])


# --- registry: every metric name works end to end ------------------------------------------------

@pytest.mark.parametrize("metric", [m for m in metrics.METRICS if m not in metrics.GRAPH_METRICS])
def test_every_string_metric_scores_and_averages(metric):
    from workflow_scripts.analysis import paired_bootstrap

    metrics.check_metric(metric)
    scores = [metrics.score_example(metric, p, ["12"]) for p in ("12", "nonsense", None)]
    assert [s.score for s in scores] == [1.0, 0.0, 0.0]
    assert metrics.corpus_score(metric, scores) == pytest.approx(1 / 3)
    # The bootstrap's corpus statistic (it branches only on "smatch") agrees with corpus_score.
    values = np.array([s.score for s in scores])
    assert paired_bootstrap.corpus_statistic(metric, values) == pytest.approx(1 / 3)
    interval = paired_bootstrap.score_interval(metric, [values, values], resamples=20, seed=0)
    assert interval.score == pytest.approx(1 / 3) and 0.0 <= interval.low <= interval.high <= 1.0
    same = paired_bootstrap.paired_difference(metric, [values, values], [values, values], resamples=20, seed=0)
    assert same.difference == 0.0 and same.p_value == 1.0


def test_new_metric_names_are_distinct_scorers():
    # Same inputs, different conventions: the config's metric: key decides.
    assert metrics.score_example("exact_match", "The sky.", ["sky"]).score == 0.0
    assert metrics.score_example("exact_match_squad", "The sky.", ["sky"]).score == 1.0
    assert metrics.score_example("relaxed_accuracy", "1,000", ["1000"]).score == 0.0
    assert metrics.score_example("relaxed_accuracy_lenient", "1,000", ["1000"]).score == 1.0


def test_schema_enum_lists_exactly_the_known_metrics():
    schema = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "schema.yaml").read_text())
    def enums(node):  # every metric enum in the dataset schema's task branches (if/then/else)
        if isinstance(node, dict):
            metric = node.get("properties", {}).get("metric", {})
            if isinstance(metric, dict) and "enum" in metric:
                yield list(metric["enum"])
            for value in node.values():
                yield from enums(value)

    generation = [enum for enum in enums(schema["properties"]["datasets"]) if "smatch" in enum]
    assert generation == [list(metrics.METRICS)]
