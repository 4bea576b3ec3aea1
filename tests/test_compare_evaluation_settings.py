"""compare refuses a table that mixes evaluation settings (issue 35): trained runs of one variant across seeds,
and the untrained model's evaluations beside the trained ones, as the fairness guard does between variants."""
from __future__ import annotations

import pytest

from test_compare import EVALUATION, correct, results, run, write_experiment  # noqa: F401 (results: a fixture)
from workflow_scripts.core.errors import WorkflowError


def test_untrained_evaluations_decoded_otherwise_are_refused_naming_the_setting_and_runs(tmp_path, results):
    """The issue's case: evaluation.max_new_tokens changed, evaluate_base rerun, the trained runs not."""
    write_experiment(results, "chart", "baseline", "base", correct(2), evaluation={**EVALUATION, "max_new_tokens": 32})
    with pytest.raises(WorkflowError) as error:
        run(tmp_path, results)
    message = str(error.value)
    assert "mixed evaluation settings on model 'tiny', dataset 'chart'" in message
    assert "evaluation.max_new_tokens: baseline seed 1=64, baseline seed 2=64" in message
    assert "baseline untrained=32" in message and "chart/baseline/base/eval.json" in message
    assert "\n" not in message


def test_one_seed_evaluated_otherwise_is_refused(tmp_path, results):
    """Both variants of seed 2 alike (the guard between variants passes), but not as seed 1."""
    write_experiment(results, "chart", "baseline", 2, correct(12), evaluation={**EVALUATION, "max_examples": 5})
    write_experiment(results, "chart", "mtup", 2, correct(18), evaluation={**EVALUATION, "max_examples": 5})
    with pytest.raises(WorkflowError, match=r"evaluation.max_examples: .*baseline seed 2=5"):
        run(tmp_path, results)


def test_the_same_settings_everywhere_pass(tmp_path, results):
    rows, _ = run(tmp_path, results)
    assert len(rows) == 2
