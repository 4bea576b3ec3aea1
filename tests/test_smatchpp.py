"""metric: smatchpp (optimal Smatch, a wrapper over the smatchpp package) against the package's own command line."""
from __future__ import annotations

import io

import numpy as np
import pytest

from workflow_scripts.analysis import paired_bootstrap
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.tasks import metrics, smatchpp_metric

pytest.importorskip("smatchpp")

# Hand-written (prediction, gold) PENMAN pairs.
PAIRS = [
    ("(w / want-01 :ARG0 (b / boy) :ARG1 (g / go-02 :ARG0 b))", "(w / want-01 :ARG0 (b / boy) :ARG1 (g / go-02 :ARG0 b))"),
    ("(w / want-01 :ARG0 (b / boy) :ARG1 (g / go-02 :ARG0 b))", "(w / want-01 :ARG0 (b / boy) :ARG1 (g / go-01 :ARG0 b))"),
    # Hill-climbing smatch with one restart stops at 4 matched triples here; the optimum is 5.
    ("(v0 / a :ARG2 (v1 / b) :ARG1 (v2 / a) :ARG1 (v3 / a))", "(v0 / a :ARG1 (v1 / b :ARG2 (v2 / b)) :ARG0 (v3 / a :ARG0 v1))"),
    ("(x / dog :quant 2 :mod (y / big))", "(d / dog :quant 3)"),
    ("(p / possible-01 :ARG1 (s / sing-01 :ARG0 (g / girl) :polarity -))", "(s2 / sing-01 :ARG0 (g2 / girl) :ARG1-of (p2 / possible-01))"),
]
# Computed with smatchpp 1.8.0's command line, the predictions in pred.txt and the golds in gold.txt (one graph
# per blank-line-separated block, in PAIRS' order):
#   python -m smatchpp -a pred.txt -b gold.txt -solver ilp -graph_type amr -score_type pairwise -output_format json
#   python -m smatchpp -a pred.txt -b gold.txt -solver ilp -graph_type amr -score_type micro -output_format json
# It prints F1 in percent rounded to 2 decimals.
CLI_PAIR_F1 = [100.0, 85.71, 58.82, 50.0, 76.92]
CLI_MICRO_F1 = 75.76
# The same pair through PyPI smatch 1.0.4 with smatch.iteration_num = 1 (get_amr_match): (match, test, gold).
HILL_CLIMBING_ONE_RESTART = (4, 8, 9)


def test_pair_scores_and_micro_f1_match_the_package_command_line():
    scores = [metrics.score_example("smatchpp", prediction, [gold]) for prediction, gold in PAIRS]
    assert [round(100 * s.score, 2) for s in scores] == CLI_PAIR_F1
    assert round(100 * metrics.corpus_score("smatchpp", scores), 2) == CLI_MICRO_F1
    # the comparison's bootstrap recomputes the same corpus score from the summed statistics
    counts = np.asarray([s.counts for s in scores], dtype=float)
    assert float(paired_bootstrap.corpus_statistic("smatchpp", counts)) == pytest.approx(CLI_MICRO_F1 / 100, abs=5e-5)


def test_optimal_alignment_beats_hill_climbing_with_one_restart(monkeypatch):
    import amr
    import smatch

    prediction, gold = PAIRS[2]
    monkeypatch.setattr(smatch, "iteration_num", 1)
    monkeypatch.setattr(smatch, "ERROR_LOG", io.StringIO())
    monkeypatch.setattr(amr, "ERROR_LOG", io.StringIO())
    smatch.match_triple_dict.clear()
    assert smatch.get_amr_match(prediction, gold) == HILL_CLIMBING_ONE_RESTART
    hill_climbing = metrics.f1_from_counts(*HILL_CLIMBING_ONE_RESTART)
    optimal = smatchpp_metric.pair_counts(prediction, gold)
    assert optimal == (5, 5, 8, 9)  # the same triples (8 and 9) as smatch counts, one more matched
    assert smatchpp_metric.pair_f1(optimal) > hill_climbing


def test_unparseable_prediction_loses_recall_and_a_bad_gold_is_refused():
    gold = PAIRS[0][1]
    assert smatchpp_metric.pair_counts(None, gold) == (0, 0, 0, 7)
    assert smatchpp_metric.pair_counts("not a graph", gold) == (0, 0, 0, 7)
    assert metrics.score_example("smatchpp", "not a graph", [gold]).score == 0.0
    with pytest.raises(WorkflowError, match="gold graph is not valid PENMAN for smatchpp"):
        smatchpp_metric.pair_counts(gold, "not a graph")


def test_the_best_gold_wins():
    prediction, gold = PAIRS[1]
    score = metrics.score_example("smatchpp", prediction, [gold, prediction])
    assert score.score == 1.0 and score.counts == (7, 7, 7, 7)


def test_compare_resamples_smatchpp_statistics_and_recomputes_its_micro_f1(tmp_path):
    import json

    from test_compare import run, write_experiment

    root = tmp_path / "results"
    scored = {variant: [metrics.score_example("smatchpp", prediction if keep else None, [gold])
                        for index, (prediction, gold) in enumerate(PAIRS * 4) for keep in [index % 3 != variant_index]]
              for variant_index, variant in enumerate(["baseline", "mtup"])}
    for seed in (1, 2):
        for variant, scores in scored.items():
            # the helper writes per-example scores; add each record's [a, b, c, d] and the corpus micro F1
            directory = write_experiment(root, "chart", variant, seed, [s.score for s in scores], metric="smatchpp")
            records = [json.loads(line) for line in (directory / "predictions.jsonl").read_text().splitlines()]
            (directory / "predictions.jsonl").write_text("".join(
                json.dumps({**record, "counts": list(s.counts)}) + "\n" for record, s in zip(records, scores)))
            summary = json.loads((directory / "eval.json").read_text())
            summary["score"] = metrics.corpus_score("smatchpp", scores)
            (directory / "eval.json").write_text(json.dumps(summary))
    rows, text = run(tmp_path, root, with_base=False)
    assert [row["metric"] for row in rows] == ["smatchpp", "smatchpp"]
    assert float(rows[0]["mean"]) == pytest.approx(metrics.corpus_score("smatchpp", scored["baseline"]), abs=1e-6)
    assert float(rows[1]["difference_ci_low"]) <= float(rows[1]["difference"]) <= float(rows[1]["difference_ci_high"])


def test_an_unreadable_graph_counts_as_unparseable_in_generation():
    from workflow_scripts.tasks import generation

    assert generation.is_parsed("smatchpp", PAIRS[0][0])
    assert not generation.is_parsed("smatchpp", "not a graph") and not generation.is_parsed("smatchpp", None)
