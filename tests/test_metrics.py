"""Each metric pinned to values worked out by hand from its published convention."""
from __future__ import annotations

import pytest

from workflow_scripts import metrics
from workflow_scripts.errors import WorkflowError
from workflow_scripts.metrics import ExampleScore, anls, exact_match, relaxed_accuracy, token_f1

WANT_BOY = "(w / want-01 :ARG0 (b / boy))"  # triples: 2 instances, TOP, ARG0 = 4
WANT_GO = "(w / want-01 :ARG0 (b / boy) :ARG1 (g / go-02 :ARG0 b))"  # 3 instances, TOP, 3 relations = 7


@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("  Blue ", ["blue"], 1.0),                 # strip + lower-case
        ("blue   sky", ["Blue Sky"], 1.0),          # whitespace collapsed
        ("the blue", ["blue"], 0.0),                # articles are kept (OCR-VQA convention, not SQuAD)
        ("", ["blue"], 0.0),                        # empty prediction
        ("yes", ["red", "Yes"], 1.0),               # any gold answer
        ("blue.", ["blue"], 0.0),                   # punctuation is kept
    ],
)
def test_exact_match(prediction, golds, expected):
    assert exact_match(prediction, golds) == expected


@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("the cat sat", ["a cat sat on the mat"], 2 / 3),     # P = 2/2, R = 2/4
        ("the cat sat", ["dog", "cat sat on mat"], 2 / 3),    # max over golds
        ("x x y", ["x y y"], 2 / 3),                          # bag of tokens: common = 1 + 1
        ("Paris!", ["paris"], 1.0),                           # punctuation and case dropped
        ("", ["cat"], 0.0),                                   # empty prediction
        ("", ["The"], 1.0),                                   # both sides empty after normalisation
        ("an apple", ["pear"], 0.0),
    ],
)
def test_token_f1(prediction, golds, expected):
    assert token_f1(prediction, golds) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("45%", ["45"], 1.0),            # '%' stripped
        ("1,234", ["1234"], 1.0),        # thousands separator
        ("$1,290", ["1,234"], 1.0),      # 56/1234 = 4.5% off
        ("105", ["100"], 1.0),           # exactly 5%: inclusive
        ("105.1", ["100"], 0.0),         # 5.1%
        ("-10", ["-10.4"], 1.0),         # 0.4/10.4 = 3.8%
        ("1e3", ["1000"], 1.0),
        ("0", ["0"], 1.0),               # gold 0: only a numeric zero matches
        ("0.0", ["0"], 1.0),
        ("-0", ["0"], 1.0),
        ("0.01", ["0"], 0.0),
        ("0.45", ["45%"], 0.0),          # '%' is stripped, not divided by 100
        ("Yes", ["yes"], 1.0),           # text: case-insensitive equality
        ("blu", ["blue"], 0.0),
        ("2", ["two"], 0.0),
        ("", ["0"], 0.0),                # empty prediction
        ("Twelve", ["12", "twelve"], 1.0),
        ("13", ["twelve", "12.5"], 1.0), # max over golds: 0.5/12.5 = 4%
    ],
)
def test_relaxed_accuracy(prediction, golds, expected):
    assert relaxed_accuracy(prediction, golds) == expected


def test_parse_number_refuses_what_float_would_accept():
    assert metrics.parse_number("nan") is None and metrics.parse_number("inf") is None
    assert metrics.parse_number("1_000") is None and metrics.parse_number("12 apples") is None
    assert metrics.parse_number(" $3,000.5% ") == 3000.5


@pytest.mark.parametrize(("a", "b", "distance"), [("kitten", "sitting", 3), ("", "abc", 3), ("flaw", "lawn", 2), ("a", "a", 0)])
def test_levenshtein(a, b, distance):
    assert metrics.levenshtein(a, b) == distance == metrics.levenshtein(b, a)


@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("Hello", ["hello"], 1.0),
        ("helo", ["hello"], 0.8),                 # 1 edit / 5
        ("kitten", ["sitting"], 1 - 3 / 7),
        ("ab", ["ac"], 0.0),                      # distance 0.5 is not below the 0.5 threshold
        ("abc", ["abd"], 2 / 3),
        ("abc", ["xyz", "abd", "abcd"], 0.75),    # max over golds: 'abcd' is 1 edit / 4
        ("", ["abc"], 0.0),                       # empty prediction
        ("new  york ", ["New York"], 1.0),        # lower-case, whitespace collapsed
    ],
)
def test_anls(prediction, golds, expected):
    assert anls(prediction, golds) == pytest.approx(expected)


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
