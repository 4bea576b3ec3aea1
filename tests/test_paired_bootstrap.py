"""The paired bootstrap on its own: the mode choice, the two-level draw, and what seed variation does to intervals."""
from __future__ import annotations

import numpy as np
import pytest

from workflow_scripts.analysis import paired_bootstrap
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.analysis.paired_bootstrap import EXAMPLES, SEEDS_AND_EXAMPLES


@pytest.mark.parametrize(
    ("setting", "counts", "mode"),
    [
        ("auto", [2, 2], EXAMPLES),
        ("auto", [1], EXAMPLES),
        ("auto", [3, 3], SEEDS_AND_EXAMPLES),
        ("auto", [5, 5, 5], SEEDS_AND_EXAMPLES),
        ("auto", [3, 3, 2], EXAMPLES),  # every compared variant needs 3 or more
        ("examples", [5, 5], EXAMPLES),
        ("seeds_and_examples", [2, 2], SEEDS_AND_EXAMPLES),
    ],
)
def test_auto_picks_the_mode_by_seed_count(setting, counts, mode):
    assert paired_bootstrap.resolve_mode(setting, counts) == mode


def test_bad_settings_are_named():
    with pytest.raises(ConfigError, match="comparison.bootstrap.*must be one of auto, examples, seeds_and_examples"):
        paired_bootstrap.resolve_mode("seeds", [3])
    with pytest.raises(ConfigError, match="comparison.bootstrap.*at least 2 seeds"):
        paired_bootstrap.resolve_mode("seeds_and_examples", [1, 1])
    with pytest.raises(WorkflowError, match="unknown bootstrap mode"):
        paired_bootstrap.paired_difference("exact_match", [np.ones(3)], [np.ones(3)], 10, 0, mode="auto")


def test_descriptions_name_the_mode_and_the_seeds():
    assert paired_bootstrap.describe(EXAMPLES, [2, 2]) == "intervals: paired bootstrap over test examples, seeds fixed (2 seeds)"
    assert paired_bootstrap.describe(SEEDS_AND_EXAMPLES, [3, 3]) == "intervals: two-level bootstrap: seeds, then test examples (3 seeds)"
    assert paired_bootstrap.describe(EXAMPLES, [1]).endswith("(1 seed)")
    assert paired_bootstrap.describe(EXAMPLES, [2, 4]).endswith("(2-4 seeds)")


def seed_spread(n=200, gains=(5, 60, 115), base=50):
    """Per-seed 0/1 scores: the variant is right wherever the reference is plus ``gains[s]`` more examples,
    so within a seed the difference is consistent, while the size of the gain varies a lot between seeds."""
    reference, variant = [], []
    for gain in gains:
        reference.append(np.array([1.0] * base + [0.0] * (n - base)))
        variant.append(np.array([1.0] * (base + gain) + [0.0] * (n - base - gain)))
    return variant, reference


def test_two_level_interval_is_wider_when_seeds_disagree():
    variant, reference = seed_spread()
    examples = paired_bootstrap.paired_difference("exact_match", variant, reference, 1000, 0, mode=EXAMPLES)
    two_level = paired_bootstrap.paired_difference("exact_match", variant, reference, 1000, 0, mode=SEEDS_AND_EXAMPLES)
    assert examples.difference == two_level.difference == pytest.approx(np.mean([5, 60, 115]) / 200)
    width = lambda result: result.high - result.low  # noqa: E731
    assert width(two_level) > 2 * width(examples)
    # Seed gains 0.025, 0.30, 0.575: drawing seeds alone can give a mean gain as low as ~0.03 or as high as ~0.58.
    assert two_level.low < 0.15 < 0.45 < two_level.high
    assert examples.low > 0.2 and examples.high < 0.4
    interval = paired_bootstrap.score_interval("exact_match", variant, 1000, 0, mode=SEEDS_AND_EXAMPLES)
    narrow = paired_bootstrap.score_interval("exact_match", variant, 1000, 0, mode=EXAMPLES)
    assert interval.score == narrow.score and interval.high - interval.low > 2 * (narrow.high - narrow.low)


def test_consistent_seeds_leave_the_interval_alone():
    """With the same per-seed results, resampling seeds adds nothing: the two modes agree closely."""
    variant, reference = seed_spread(gains=(60, 60, 60))
    examples = paired_bootstrap.paired_difference("exact_match", variant, reference, 1000, 0, mode=EXAMPLES)
    two_level = paired_bootstrap.paired_difference("exact_match", variant, reference, 1000, 0, mode=SEEDS_AND_EXAMPLES)
    assert two_level.high - two_level.low == pytest.approx(examples.high - examples.low, abs=0.02)


def test_two_level_draw_is_seeds_then_examples_shared_by_both_systems():
    rng = np.random.default_rng(11)
    variant = [rng.random(7) for _ in range(3)]
    reference = [rng.random(7) for _ in range(3)]
    result = paired_bootstrap.paired_difference("exact_match", variant, reference, 1, seed=5, mode=SEEDS_AND_EXAMPLES)
    draws = np.random.default_rng(5)
    seeds = draws.integers(0, 3, size=(1, 3))[0]
    examples = draws.integers(0, 7, size=(1, 7))[0]
    expected = np.mean([variant[s][examples].mean() - reference[s][examples].mean() for s in seeds])
    assert result.low == pytest.approx(expected) == pytest.approx(result.high)


def test_two_level_smatch_sums_counts_per_drawn_seed():
    rng = np.random.default_rng(2)
    variant = [rng.integers(0, 9, size=(6, 3)) for _ in range(3)]
    reference = [rng.integers(0, 9, size=(6, 3)) for _ in range(3)]
    replicated = paired_bootstrap._replicates("smatch", [variant, reference], 1, 8, SEEDS_AND_EXAMPLES)
    draws = np.random.default_rng(8)
    seeds = draws.integers(0, 3, size=(1, 3))[0]
    examples = draws.integers(0, 6, size=(1, 6))[0]
    for k, system in enumerate((variant, reference)):
        expected = np.mean([paired_bootstrap.corpus_statistic("smatch", system[s][examples]) for s in seeds])
        assert replicated[k, 0] == pytest.approx(expected)


def test_fixed_bootstrap_seed_gives_the_same_figures():
    variant, reference = seed_spread(n=50, gains=(2, 10, 20), base=10)
    first = paired_bootstrap.paired_difference("exact_match", variant, reference, 1000, 4, mode=SEEDS_AND_EXAMPLES)
    again = paired_bootstrap.paired_difference("exact_match", variant, reference, 1000, 4, mode=SEEDS_AND_EXAMPLES)
    other = paired_bootstrap.paired_difference("exact_match", variant, reference, 1000, 5, mode=SEEDS_AND_EXAMPLES)
    assert first == again
    assert other.difference == first.difference and other != first


def test_identical_systems_two_level_have_zero_difference_and_p_one():
    rng = np.random.default_rng(0)
    seeds = [rng.random(30) for _ in range(4)]
    result = paired_bootstrap.paired_difference("exact_match", seeds, [s.copy() for s in seeds], 1000, 0,
                                                mode=SEEDS_AND_EXAMPLES)
    assert (result.difference, result.low, result.high, result.p_value) == (0.0, 0.0, 0.0, 1.0)


def test_systems_with_other_seed_counts_are_refused():
    with pytest.raises(WorkflowError, match="same seeds"):
        paired_bootstrap.paired_difference("exact_match", [np.ones(3)] * 3, [np.ones(3)] * 2, 10, 0,
                                           mode=SEEDS_AND_EXAMPLES)
