"""The compare stage on synthetic eval/prediction/manifest/log files laid out as the workflow writes them."""
from __future__ import annotations

import csv
import json
import re

import numpy as np
import pytest
import yaml

from workflow_scripts import compare
from workflow_scripts.analysis import fairness, paired_bootstrap
from workflow_scripts.core.errors import ConfigError, WorkflowError

TRAINING = {
    "lora": {"rank": 128, "alpha": 256, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]},
    "max_length": 512, "effective_batch": 16, "micro_batch": 1, "max_steps": 100, "learning_rate": 2e-4,
    "precision": "bf16", "gpus": 1, "cpu_processes": 1, "nodes": 1, "dataloader_workers": 2,
    "checkpoint_every": 50, "log_every": 10, "runtime_minutes": 720, "mem_mb": 64000,
    "sanity_batches": 2, "memory_headroom": 0.9,
}
EVALUATION = {"split": "test", "max_new_tokens": 64, "batch_size": 16, "max_examples": None, "gpus": 0}
COMPARISON = {"reference_variant": "baseline", "bootstrap_resamples": 1000, "bootstrap_seed": 0, "intended_differences": []}
N = 20


def write_experiment(root, dataset, variant, seed, scores, metric="exact_match", training=None, counts=None,
                     model_sha="m" * 64, evaluation=EVALUATION, model="tiny"):
    """One experiment's outputs; ``scores`` are per-example scores (or ``counts`` for smatch)."""
    directory = root / model / dataset / variant / (f"seed{seed}" if seed != "base" else "base")
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for index, score in enumerate(scores):
        row = {"id": f"ex{index:03d}", "prompt": "p", "raw_output": "o", "extracted": "o", "auxiliary": None,
               "gold": ["g"], "score": score, "parsed": True}
        if counts is not None:
            row["counts"] = counts[index]
        rows.append(row)
    (directory / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if counts is not None:
        m, t, g = np.sum(counts, axis=0)
        corpus = 2 * m / (t + g) if m else 0.0
    else:
        corpus = float(np.mean(scores))
    summary = {"model": model, "dataset": dataset, "variant": variant, "seed": seed, "metric": metric, "score": corpus,
               "n_examples": len(rows), "n_unparseable": 1, "model_dir": "resources/models/tiny",
               "model_manifest_sha256": model_sha,
               "manifest": {"settings": {"evaluation": evaluation, "metric": metric}}}
    (directory / "eval.json").write_text(json.dumps(summary))
    if seed != "base":
        manifest = {"stage": "train", "settings": training or TRAINING, "seed": seed, "world_size": 1,
                    "model_dir": "resources/models/tiny", "model_manifest_sha256": model_sha,
                    "data_cache_key": f"{variant}-key"}
        (directory / "run_manifest.json").write_text(json.dumps(manifest))
        log = [{"step": step, "loss": 3.0 / step + seed * 0.01, "learning_rate": 1e-4} for step in range(1, 11)]
        (directory / "train_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
    return directory


def correct(k):
    """N per-example scores with the first k correct."""
    return [1.0] * k + [0.0] * (N - k)


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    for seed, (base_k, mtup_k) in {1: (10, 16), 2: (12, 18)}.items():
        write_experiment(root, "chart", "baseline", seed, correct(base_k))
        write_experiment(root, "chart", "mtup", seed, correct(mtup_k))
    write_experiment(root, "chart", "baseline", "base", correct(2))
    write_experiment(root, "chart", "mtup", "base", correct(1))
    return root


EXPERIMENTS = [["tiny", "chart", "baseline", 1], ["tiny", "chart", "baseline", 2], ["tiny", "chart", "mtup", 1],
               ["tiny", "chart", "mtup", 2]]


def run(tmp_path, root, experiments=EXPERIMENTS, comparison=COMPARISON, with_base=True):
    out = tmp_path / "out"
    argv = ["--results-dir", str(root), "--experiments", json.dumps(experiments),
            "--comparison", json.dumps(comparison), "--out-csv", str(out / "comparison.csv"),
            "--out-markdown", str(out / "comparison.md"), "--plots-dir", str(out / "plots")]
    assert compare.main(argv + (["--with-base"] if with_base else [])) == 0
    with open(out / "comparison.csv") as handle:
        rows = list(csv.DictReader(handle))
    return rows, (out / "comparison.md").read_text()


def test_table_holds_means_stds_base_and_a_significant_difference(tmp_path, results):
    rows, text = run(tmp_path, results)
    baseline, mtup = rows
    assert (baseline["variant"], mtup["variant"]) == ("baseline", "mtup")
    assert float(baseline["mean"]) == pytest.approx(0.55) and float(mtup["mean"]) == pytest.approx(0.85)
    assert float(baseline["std"]) == pytest.approx(np.std([0.5, 0.6], ddof=1), abs=1e-6)
    assert baseline["seed_scores"] == "0.5000 0.6000" and baseline["seeds"] == "1 2"
    assert float(baseline["base_score"]) == pytest.approx(0.1) and float(mtup["base_score"]) == pytest.approx(0.05)
    assert float(mtup["gain_over_base"]) == pytest.approx(0.80)
    assert baseline["difference"] == "" and baseline["p_value"] == ""
    assert float(mtup["difference"]) == pytest.approx(0.30)
    # mtup is right wherever baseline is, so every resample favours it: p is the smallest possible value.
    assert float(mtup["p_value"]) == pytest.approx(1 / 1001)
    assert 0 < float(mtup["difference_ci_low"]) <= 0.30 <= float(mtup["difference_ci_high"])
    assert float(baseline["ci_low"]) < 0.55 < float(baseline["ci_high"])
    assert "| chart | exact_match | mtup | 2 | 0.8500 ± 0.0707" in text
    assert "+0.3000" in text and "1000 resamples" in text


def test_identical_variants_have_zero_difference_and_p_one(tmp_path):
    root = tmp_path / "results"
    scores = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5] * 3
    for seed in (1, 2):
        for variant in ("baseline", "mtup"):
            write_experiment(root, "chart", variant, seed, scores)
    rows, _ = run(tmp_path, root, with_base=False)
    assert float(rows[1]["difference"]) == 0.0
    assert float(rows[1]["difference_ci_low"]) == 0.0 == float(rows[1]["difference_ci_high"])
    assert float(rows[1]["p_value"]) == 1.0
    assert rows[0]["base_score"] == ""


def test_pairing_is_by_example_id_not_file_order(tmp_path, results):
    """Shuffling one file's lines must not change anything: examples are matched by id."""
    first, _ = run(tmp_path, results)
    path = results / "tiny" / "chart" / "mtup" / "seed1" / "predictions.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(reversed(lines)) + "\n")
    second, _ = run(tmp_path, results)
    assert first == second


def test_same_seed_same_table_other_seed_other_interval(tmp_path, results):
    first, _ = run(tmp_path, results)
    again, _ = run(tmp_path, results)
    other, _ = run(tmp_path, results, comparison={**COMPARISON, "bootstrap_seed": 7})
    assert first == again
    assert other[1]["difference"] == first[1]["difference"]
    assert other != first  # the resampled figures (interval, p) depend on the bootstrap seed


def test_smatch_bootstrap_resamples_counts_and_recomputes_micro_f1():
    counts = np.array([[7, 7, 7], [0, 0, 4], [3, 4, 4]])
    assert paired_bootstrap.corpus_statistic("smatch", counts[:2]) == pytest.approx(14 / 18)
    variant, reference = [counts], [np.array([[7, 7, 7], [0, 0, 4], [0, 0, 4]])]
    result = paired_bootstrap.paired_difference("smatch", variant, reference, 1, seed=3)
    assert result.difference == pytest.approx(20 / 26 - 14 / 22)  # micro F1 of summed (10, 11, 15) vs (7, 7, 15)
    draw = np.random.default_rng(3).integers(0, 3, size=(1, 3))[0]  # the one resample the function drew
    expected = (paired_bootstrap.corpus_statistic("smatch", counts[draw])
                - paired_bootstrap.corpus_statistic("smatch", reference[0][draw]))
    assert result.low == pytest.approx(expected) == pytest.approx(result.high)


def test_smatch_comparison_uses_micro_f1_per_seed(tmp_path):
    root = tmp_path / "results"
    good = [[7, 7, 7], [3, 4, 4]] * 5
    poor = [[7, 7, 7], [0, 0, 4]] * 5
    for seed in (1, 2):
        write_experiment(root, "amr", "baseline", seed, [0.0] * 10, metric="smatch", counts=poor)
        write_experiment(root, "amr", "mtup", seed, [0.0] * 10, metric="smatch", counts=good)
    experiments = [["tiny", "amr", v, s] for v in ("baseline", "mtup") for s in (1, 2)]
    rows, _ = run(tmp_path, root, experiments=experiments, with_base=False)
    assert float(rows[0]["mean"]) == pytest.approx(14 / 18, abs=1e-6)
    assert float(rows[1]["mean"]) == pytest.approx(10 / 11, abs=1e-6)
    assert float(rows[1]["difference"]) == pytest.approx(10 / 11 - 14 / 18, abs=1e-6)


def test_fairness_guard_refuses_the_seeds_512_vs_2048_runs(tmp_path, results):
    """The seed post-mortem: baseline at MAX_SEQ_LENGTH 512, MTUP at 2048, fairness argued by hand."""
    write_experiment(results, "chart", "mtup", 1, correct(16), training={**TRAINING, "max_length": 2048})
    with pytest.raises(WorkflowError) as caught:
        run(tmp_path, results)
    message = str(caught.value)
    assert message == (
        f"unfair comparison on model 'tiny', dataset 'chart', seed 1: the variants differ in more than the prompt format: "
        f"training.max_length: baseline=512, mtup=2048 (from {results}/tiny/chart/{{baseline,mtup}}/seed1/run_manifest.json). "
        "Fix: make these settings equal (remove the variants.<name>.training overrides) and rerun, or, if the "
        "difference is intended, list it under comparison.intended_differences: [training.max_length]"
    )
    assert not (tmp_path / "out" / "comparison.csv").exists() and not (tmp_path / "out" / "plots").exists()
    rows, text = run(tmp_path, results, comparison={**COMPARISON, "intended_differences": ["training.max_length"]})
    assert len(rows) == 2 and "except the intended differences training.max_length" in text


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"lora": {**TRAINING["lora"], "rank": 64}}, "training.lora.rank"),
        ({"effective_batch": 32}, "training.effective_batch"),
        ({"max_steps": 200}, "training.max_steps"),
    ],
)
def test_fairness_guard_names_each_training_difference(tmp_path, results, change, key):
    write_experiment(results, "chart", "mtup", 2, correct(18), training={**TRAINING, **change})
    with pytest.raises(WorkflowError, match=rf"seed 2: [^\n]*: {re.escape(key)}: baseline=[^\n]*intended_differences: \[{re.escape(key)}\]$"):
        run(tmp_path, results)


def test_fairness_message_is_one_line_listing_every_difference():
    settings = {"baseline": {"training.max_length": 512, "evaluation.max_new_tokens": 64, "training.seed_only": 1},
                "mtup": {"training.max_length": 2048, "evaluation.max_new_tokens": 512}}
    sources = {"baseline": "r/amr/baseline/seed3/run_manifest.json", "mtup": "elsewhere/mtup/run_manifest.json"}
    with pytest.raises(WorkflowError) as caught:
        fairness.check_fair("dataset 'amr'", 3, settings, sources, intended=[])
    assert str(caught.value) == (
        "unfair comparison on dataset 'amr', seed 3: the variants differ in more than the prompt format: "
        "evaluation.max_new_tokens: baseline=64, mtup=512; training.max_length: baseline=512, mtup=2048; "
        "training.seed_only: baseline=1, mtup='<absent>' (from baseline: r/amr/baseline/seed3/run_manifest.json; "
        "mtup: elsewhere/mtup/run_manifest.json). Fix: make these settings equal (remove the variants.<name>.training "
        "overrides) and rerun, or, if the difference is intended, list it under comparison.intended_differences: "
        "[evaluation.max_new_tokens, training.max_length, training.seed_only]"
    )


def test_fairness_guard_refuses_another_base_model(tmp_path, results):
    write_experiment(results, "chart", "mtup", 1, correct(16), model_sha="x" * 64)
    with pytest.raises(WorkflowError, match="model.manifest_sha256"):
        run(tmp_path, results)


def test_fairness_guard_refuses_other_decoding_settings(tmp_path, results):
    write_experiment(results, "chart", "mtup", 1, correct(16), evaluation={**EVALUATION, "max_new_tokens": 512})
    with pytest.raises(WorkflowError, match="evaluation.max_new_tokens: baseline=64, mtup=512"):
        run(tmp_path, results)


def test_runtime_only_keys_never_count(tmp_path, results):
    runtime = {"gpus": 8, "cpu_processes": 4, "nodes": 2, "dataloader_workers": 0, "checkpoint_every": 5,
               "log_every": 1, "runtime_minutes": 60, "mem_mb": 1000, "sanity_batches": 1, "memory_headroom": 0.5,
               "strategy": "fsdp", "signal_grace_seconds": 60, "fsdp_mesh": "hybrid"}
    assert set(runtime) == fairness.RUNTIME_ONLY_TRAINING_KEYS
    write_experiment(results, "chart", "mtup", 1, correct(16), training={**TRAINING, **runtime})
    rows, _ = run(tmp_path, results)
    assert len(rows) == 2


def test_intended_difference_covers_keys_below_it():
    settings = {"baseline": {"training.lora.rank": 128, "training.lora.alpha": 256, "training.max_length": 512},
                "mtup": {"training.lora.rank": 64, "training.lora.alpha": 128, "training.max_length": 512}}
    assert fairness.differences(settings, ["training.lora"]) == {}
    assert set(fairness.differences(settings, ["training.lora.rank"])) == {"training.lora.alpha"}
    assert set(fairness.differences(settings, ["training.lor"])) == {"training.lora.alpha", "training.lora.rank"}


def test_different_test_sets_are_refused(tmp_path, results):
    write_experiment(results, "chart", "mtup", 2, correct(18)[:-1])
    with pytest.raises(WorkflowError, match=r"mtup/seed2/predictions.jsonl: not the same test examples.*missing ids \['ex019'\]"):
        run(tmp_path, results)


def test_stale_eval_summary_is_refused(tmp_path, results):
    path = results / "tiny" / "chart" / "mtup" / "seed1" / "eval.json"
    summary = json.loads(path.read_text())
    path.write_text(json.dumps({**summary, "score": 0.99}))
    with pytest.raises(WorkflowError, match="does not match its predictions.jsonl"):
        run(tmp_path, results)


def test_summary_for_another_experiment_is_refused(tmp_path, results):
    path = results / "tiny" / "chart" / "mtup" / "seed1" / "eval.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "seed": 2}))
    with pytest.raises(WorkflowError, match=r"mtup/seed1/eval.json: field 'seed' is 2, but the path is for seed 1"):
        run(tmp_path, results)


def test_bad_prediction_and_log_rows_name_file_and_line(tmp_path, results):
    predictions = results / "tiny" / "chart" / "mtup" / "seed1" / "predictions.jsonl"
    lines = predictions.read_text().splitlines()
    good = list(lines)
    lines[3] = json.dumps({**json.loads(lines[3]), "score": "high"})
    predictions.write_text("\n".join(lines) + "\n")
    with pytest.raises(WorkflowError, match=r"mtup/seed1/predictions.jsonl line 4: field 'score'"):
        run(tmp_path, results)
    predictions.write_text("\n".join(good) + "\n")
    log = results / "tiny" / "chart" / "baseline" / "seed2" / "train_log.jsonl"
    log.write_text(log.read_text() + '{"step": 11}\n')
    with pytest.raises(WorkflowError, match=r"baseline/seed2/train_log.jsonl line 11: fields 'step'"):
        run(tmp_path, results)


def test_missing_seed_of_a_variant_is_refused(tmp_path, results):
    experiments = EXPERIMENTS[:3]
    with pytest.raises(WorkflowError, match=r"variant 'mtup' has seeds \[1\], the reference 'baseline' has \[1, 2\]"):
        run(tmp_path, results, experiments=experiments)


@pytest.mark.parametrize(
    ("comparison", "key"),
    [
        ({**COMPARISON, "bootstrap_resamples": 999}, "comparison.bootstrap_resamples"),
        ({**COMPARISON, "reference_variant": "plain"}, "comparison.reference_variant"),
        ({**COMPARISON, "bootstrap_seed": "one"}, "comparison.bootstrap_seed"),  # a missing key gets the schema default
        ({**COMPARISON, "bootstrap": "seeds"}, "comparison.bootstrap"),
    ],
)
def test_bad_comparison_settings_are_named(tmp_path, results, comparison, key):
    with pytest.raises(ConfigError, match=key):
        run(tmp_path, results, comparison=comparison)


def test_the_stamp_names_the_compared_set_and_replaces_the_previous_sets(tmp_path, results):
    """results/experiment_sets/ holds one stamp: the set results/comparison.* now compares (core/experiment_set)."""
    from workflow_scripts.core import experiment_set

    identity = {"experiments": EXPERIMENTS, "comparison": COMPARISON, "with_base": True}
    stamp = tmp_path / experiment_set.stamp_path(identity)
    stamp.parent.mkdir(parents=True)
    (stamp.parent / "0123456789abcdef.json").write_text("{}")  # another set's, compared earlier
    out = tmp_path / "out"
    assert compare.main(["--results-dir", str(results), "--experiments", json.dumps(EXPERIMENTS), "--comparison",
                         json.dumps(COMPARISON), "--with-base", "--out-csv", str(out / "c.csv"), "--out-markdown",
                         str(out / "c.md"), "--plots-dir", str(out / "plots"), "--experiment-set-out", str(stamp)]) == 0
    assert [path.name for path in stamp.parent.iterdir()] == [stamp.name]
    assert json.loads(stamp.read_text())["experiments"] == EXPERIMENTS
    other = experiment_set.stamp_path({**identity, "experiments": EXPERIMENTS[:2]})
    assert other != experiment_set.stamp_path(identity)


def test_plots_are_written_as_png(tmp_path, results):
    run(tmp_path, results)
    for name in ("scores_tiny_chart.png", "loss_tiny_chart.png"):
        data = (tmp_path / "out" / "plots" / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_rules_call_evaluate_and_compare_with_arguments_they_accept(tmp_path):
    """A dry run of the default config: every evaluate/compare command line parses with the scripts' CLI."""
    import shlex
    import shutil
    from pathlib import Path

    from test_dry_run_families import dry_run
    from workflow_scripts import evaluate

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "config").mkdir()
    shutil.copy(root / "config" / "config.yaml", tmp_path / "config" / "config.yaml")
    (tmp_path / "demo_data").symlink_to(root / "demo_data")
    code, output = dry_run(tmp_path, "-n", "-p", "results/comparison.md")  # snakemake in a fork of this process
    assert code == 0, output
    commands = [line.removeprefix("Shell command: ") for line in output.splitlines()
                if line.startswith("Shell command: python -m workflow_scripts.")]
    parsed = {"evaluate": [], "compare": []}
    for command in commands:
        words = shlex.split(command)
        module = words[2].removeprefix("workflow_scripts.")
        if module in parsed:
            stage = evaluate if module == "evaluate" else compare
            parsed[module].append(stage.parse_args(words[3:words.index(">")]))
    # 12 model x dataset x variant triples (tiny-llama: 3 x 2 generation, 1 x 2 classification; tiny-bert:
    # 1 x 2 masked_lm; tiny-llava: 1 x 2 vision_language), each seed of the demo config + base each.
    seeds = len(yaml.safe_load((root / "config" / "config.yaml").read_text())["seeds"])
    assert len(parsed["evaluate"]) == 12 * seeds + 12 and len(parsed["compare"]) == 1
    assert sorted(str(args.seed) for args in parsed["evaluate"]).count("base") == 12
    assert {args.model_name for args in parsed["evaluate"]} == {"tiny-llama", "tiny-bert", "tiny-llava"}
    (arguments,) = parsed["compare"]
    assert arguments.with_base and arguments.plots_dir == "results/plots"
    assert re.fullmatch(r"results/experiment_sets/[0-9a-f]{16}\.json", arguments.experiment_set_out)
    assert len(json.loads(arguments.experiments)) == 12 * seeds
    assert arguments.normalise_reports == sorted({f"results/data/{item[-1]}/normalise_report.json"
                                                  for item in json.loads(arguments.experiments)})
    assert "results/plots/scores_tiny-llama_amr_demo.png" in output and "results/plots/loss_tiny-llama_ocrvqa_demo.png" in output
    assert "results/plots/scores_tiny-llava_shapes_demo.png" in output


@pytest.mark.parametrize(
    ("experiments", "message"),
    [
        (EXPERIMENTS + [["tiny", "chart", "mtup", 2]], r"item 4: \['tiny', 'chart', 'mtup', 2\] is listed twice"),
        ([["tiny", "chart", "baseline", "1"]], r"item 0: expected \[model, dataset, variant, seed\]"),
        ([["chart", "baseline", 1]], r"item 0: expected \[model, dataset, variant, seed\]"),
        ([], "non-empty JSON list"),
    ],
)
def test_bad_experiment_lists_are_named(tmp_path, results, experiments, message):
    with pytest.raises(WorkflowError, match=message):
        run(tmp_path, results, experiments=experiments)


def test_two_seeds_use_the_examples_bootstrap_and_say_so(tmp_path, results):
    rows, text = run(tmp_path, results)
    assert {row["bootstrap"] for row in rows} == {"examples"}
    assert "Intervals: paired bootstrap over test examples, seeds fixed (2 seeds); comparison.bootstrap: auto" in text
    assert "Seeds are held fixed" in text and "two-level" not in text


def three_seeds_that_disagree(root, n=100):
    """mtup is right wherever baseline is, plus 2, 30 or 58 more examples depending on the seed."""
    for seed, gain in {1: 2, 2: 30, 3: 58}.items():
        write_experiment(root, "chart", "baseline", seed, [1.0] * 20 + [0.0] * (n - 20))
        write_experiment(root, "chart", "mtup", seed, [1.0] * (20 + gain) + [0.0] * (n - 20 - gain))
    return [["tiny", "chart", variant, seed] for variant in ("baseline", "mtup") for seed in (1, 2, 3)]


def test_three_seeds_use_the_two_level_bootstrap_which_widens_the_interval(tmp_path):
    root = tmp_path / "results"
    experiments = three_seeds_that_disagree(root)
    rows, text = run(tmp_path, root, experiments=experiments, with_base=False)
    assert {row["bootstrap"] for row in rows} == {"seeds_and_examples"}
    assert "Intervals: two-level bootstrap: seeds, then test examples (3 seeds); comparison.bootstrap: auto" in text
    assert "first draws seeds with replacement" in text
    fixed, fixed_text = run(tmp_path, root, experiments=experiments, with_base=False,
                            comparison={**COMPARISON, "bootstrap": "examples"})
    assert {row["bootstrap"] for row in fixed} == {"examples"}
    assert "seeds fixed (3 seeds); comparison.bootstrap: examples." in fixed_text
    assert rows[1]["difference"] == fixed[1]["difference"] and float(rows[1]["difference"]) == pytest.approx(0.30)
    width = lambda row, low, high: float(row[high]) - float(row[low])  # noqa: E731
    assert width(rows[1], "difference_ci_low", "difference_ci_high") > 2 * width(fixed[1], "difference_ci_low", "difference_ci_high")
    assert width(rows[1], "ci_low", "ci_high") > 2 * width(fixed[1], "ci_low", "ci_high")
    # Within every seed mtup never loses, so the examples-only p is minimal; with seeds resampled it cannot be.
    assert float(fixed[1]["p_value"]) == pytest.approx(1 / 1001)
    assert float(rows[1]["p_value"]) > 5 / 1001


def test_two_level_table_is_deterministic_for_a_fixed_bootstrap_seed(tmp_path):
    root = tmp_path / "results"
    experiments = three_seeds_that_disagree(root)
    first, first_text = run(tmp_path, root, experiments=experiments, with_base=False)
    again, again_text = run(tmp_path, root, experiments=experiments, with_base=False)
    other, _ = run(tmp_path, root, experiments=experiments, with_base=False, comparison={**COMPARISON, "bootstrap_seed": 3})
    assert (first, first_text) == (again, again_text)
    assert other[1]["difference"] == first[1]["difference"] and other != first


def test_explicit_two_level_bootstrap_with_two_seeds(tmp_path, results):
    rows, text = run(tmp_path, results, comparison={**COMPARISON, "bootstrap": "seeds_and_examples"})
    assert {row["bootstrap"] for row in rows} == {"seeds_and_examples"}
    assert "two-level bootstrap: seeds, then test examples (2 seeds); comparison.bootstrap: seeds_and_examples." in text


def normalise_report(path, dataset, split_entry, split="test"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"dataset": dataset, "splits": {"train": {"examined": 5, "kept": 5, "rejected": 0,
                                                                         "reasons": {}}, split: split_entry}}))
    return path


def test_report_lists_test_rows_excluded_at_normalise_and_the_macro_f1_convention(tmp_path):
    """Rows normalise rejected are in no score (a classifier's unknown_label rows would all be wrong): the
    report names how many per dataset and why, and the convention of the classifier's macro-F1."""
    root = tmp_path / "results"
    for variant, k in (("baseline", 10), ("framed", 14)):
        for seed in (1, 2):
            directory = write_experiment(root, "topics", variant, seed, correct(k), metric="accuracy")
            summary = json.loads((directory / "eval.json").read_text())
            (directory / "eval.json").write_text(json.dumps({**summary, "task": "classification", "split": "test"}))
    reports = [str(normalise_report(tmp_path / "data" / "topics" / "normalise_report.json", "topics", {
        "examined": 23, "kept": 20, "rejected": 3, "reasons": {"unknown_label": 2, "duplicate_id": 1}}))]
    experiments = [["tiny", "topics", variant, seed] for variant in ("baseline", "framed") for seed in (1, 2)]
    out = tmp_path / "out"
    argv = ["--results-dir", str(root), "--experiments", json.dumps(experiments), "--comparison", json.dumps(COMPARISON),
            "--out-csv", str(out / "comparison.csv"), "--out-markdown", str(out / "comparison.md"),
            "--plots-dir", str(out / "plots")]
    assert compare.main(argv + ["--normalise-reports", *reports]) == 0
    text = (out / "comparison.md").read_text()
    assert ("- topics: 3 of 23 rows of split 'test' excluded at normalise (unknown_label 2, duplicate_id 1); "
            "20 scored.") in text
    assert "labels=<label set>, average='macro', zero_division=0" in text  # under the table, a classifier compared
    # A report for another dataset only, or without the scored split: refused, naming what is missing.
    other = normalise_report(tmp_path / "data" / "other" / "normalise_report.json", "other", {"examined": 1, "kept": 1,
                                                                                             "rejected": 0, "reasons": {}})
    with pytest.raises(WorkflowError, match="dataset 'topics': no normalise report"):
        compare.main(argv + ["--normalise-reports", str(other)])
    no_test = normalise_report(tmp_path / "data" / "t2" / "normalise_report.json", "topics", {}, split="validation")
    with pytest.raises(WorkflowError, match="no split 'test'"):
        compare.main(argv + ["--normalise-reports", str(no_test)])


def test_report_without_exclusions_or_classifiers_says_so(tmp_path, results):
    reports = [str(normalise_report(tmp_path / "data" / "chart" / "normalise_report.json", "chart",
                                    {"examined": 20, "kept": 20, "rejected": 0, "reasons": {}}))]
    for directory in results.glob("tiny/chart/*/*"):
        summary = json.loads((directory / "eval.json").read_text())
        (directory / "eval.json").write_text(json.dumps({**summary, "split": "test"}))
    out = tmp_path / "out"
    argv = ["--results-dir", str(results), "--experiments", json.dumps(EXPERIMENTS), "--comparison", json.dumps(COMPARISON),
            "--out-csv", str(out / "comparison.csv"), "--out-markdown", str(out / "comparison.md"),
            "--plots-dir", str(out / "plots"), "--normalise-reports", *reports]
    assert compare.main(argv) == 0
    text = (out / "comparison.md").read_text()
    assert "- chart: no row of split 'test' excluded at normalise (20 rows); 20 scored." in text
    assert "macro-F1" not in text  # no classifier compared


def test_fairness_guard_refuses_masked_lm_variants_scored_on_different_tokens(tmp_path):
    """Issue 22 (decision): masked-LM test lines are cut at each variant's training max_length, so variants
    that differ there are scored on different tokens. Listing training.max_length does not make them
    comparable: the guard names evaluation.eval_mask.* (eval.json's eval_mask, tasks/masked_lm.evaluate)."""
    root = tmp_path / "results"
    for variant, length in (("baseline", 512), ("mtup", 2048)):
        for seed in (1, 2):
            directory = write_experiment(root, "corpus", variant, seed, correct(10 + seed),
                                         training={**TRAINING, "max_length": length})
            summary = json.loads((directory / "eval.json").read_text())
            summary["eval_mask"] = {"rate": 0.15, "unit": "token", "max_length": length,
                                    "positions_sha256": f"{length:064d}"}
            (directory / "eval.json").write_text(json.dumps(summary))
    experiments = [["tiny", "corpus", v, s] for v in ("baseline", "mtup") for s in (1, 2)]
    intended = {**COMPARISON, "intended_differences": ["training.max_length"]}
    with pytest.raises(WorkflowError) as caught:
        run(tmp_path, root, experiments=experiments, with_base=False, comparison=intended)
    message = str(caught.value)
    assert "evaluation.eval_mask.max_length: baseline=512, mtup=2048" in message
    assert "evaluation.eval_mask.positions_sha256" in message and "training.max_length:" not in message
    assert message.endswith("intended_differences: [evaluation.eval_mask.max_length, "
                            "evaluation.eval_mask.positions_sha256]")
    accepted = {**COMPARISON, "intended_differences": ["training.max_length", "evaluation.eval_mask"]}
    rows, _ = run(tmp_path, root, experiments=experiments, with_base=False, comparison=accepted)
    assert len(rows) == 2


# --- issue 36: macro-F1 rows and the range of each metric under the table ---
LABEL_SET = ["food", "sport", "weather"]


def write_classifier(root, variant, seed, pairs, labels=LABEL_SET):
    """A classifier's evaluation scored with macro_f1: per-example (gold, predicted) pairs, the label set in
    eval.json, as tasks/classification.score_predictions writes them."""
    from workflow_scripts.tasks import classification

    directory = write_experiment(root, "topics", variant, seed, [float(g == p) for g, p in pairs], metric="macro_f1")
    records = [{"id": f"ex{index:03d}", "text": "t", "predicted": p, "gold": g, "score": int(g == p), "parsed": True}
               for index, (g, p) in enumerate(pairs)]
    (directory / "predictions.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    summary = json.loads((directory / "eval.json").read_text())
    score = classification.macro_f1([g for g, _ in pairs], [p for _, p in pairs], labels)
    (directory / "eval.json").write_text(json.dumps({**summary, "task": "classification", "score": score,
                                                     "labels": labels, "n_unparseable": 0}))
    return directory, score


def classifier_pairs(rng, n, accuracy):
    golds = rng.choice(LABEL_SET[:2] + LABEL_SET, size=n)  # 'weather' the rare class
    return [(g, g if rng.random() < accuracy else rng.choice([x for x in LABEL_SET if x != g])) for g in golds]


def test_macro_f1_runs_are_compared_by_resampling_gold_predicted_pairs(tmp_path):
    """Issue 36: metric macro_f1 trained everything and only compare refused it. The rows now hold the seed
    mean of eval.json's macro-F1, and every resample recomputes macro-F1 from the drawn (gold, predicted) pairs."""
    rng = np.random.default_rng(7)
    root = tmp_path / "results"
    scores = {}
    for variant, accuracy in (("baseline", 0.5), ("framed", 0.9)):
        for seed in (1, 2):
            scores[variant, seed] = write_classifier(root, variant, seed, classifier_pairs(rng, 40, accuracy))[1]
    experiments = [["tiny", "topics", variant, seed] for variant in ("baseline", "framed") for seed in (1, 2)]
    rows, text = run(tmp_path, root, experiments, with_base=False)
    baseline, framed = rows
    assert baseline["metric"] == "macro_f1" == framed["metric"]
    assert float(framed["mean"]) == pytest.approx((scores["framed", 1] + scores["framed", 2]) / 2, abs=1e-6)
    assert float(framed["difference"]) > 0 and float(framed["difference_ci_low"]) > 0
    assert "| tiny | topics | macro_f1 | framed | 2 |" in text
    assert "Ranges: macro_f1 [0, 1], higher is better." in text


def test_bootstrap_recomputes_macro_f1_per_replicate():
    """Each replicate's statistic is macro-F1 of the resampled pairs (classification.macro_f1), not a mean of
    0/1 scores: the same draws as paired_bootstrap makes, scored by hand."""
    from workflow_scripts.tasks import classification, metrics

    rng = np.random.default_rng(3)
    pairs = classifier_pairs(rng, 30, 0.6)
    counts = np.asarray([metrics.class_counts(g, p, LABEL_SET) for g, p in pairs], dtype=float)
    replicated = paired_bootstrap._replicates("macro_f1", [[counts]], 50, seed=11)[0]
    draws = np.random.default_rng(11).integers(0, len(pairs), size=(50, len(pairs)))
    expected = [classification.macro_f1([pairs[i][0] for i in row], [pairs[i][1] for i in row], LABEL_SET)
                for row in draws]
    assert replicated == pytest.approx(expected, abs=1e-12)
    assert paired_bootstrap.seed_mean("macro_f1", [counts]) == pytest.approx(
        classification.macro_f1([g for g, _ in pairs], [p for _, p in pairs], LABEL_SET), abs=1e-12)


def test_macro_f1_runs_with_other_label_sets_are_refused(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "results"
    for variant in ("baseline", "framed"):
        for seed in (1, 2):
            pairs = classifier_pairs(rng, 20, 0.7)
            labels = LABEL_SET + ["music"] if (variant, seed) == ("framed", 2) else LABEL_SET
            write_classifier(root, variant, seed, pairs, labels)
    experiments = [["tiny", "topics", variant, seed] for variant in ("baseline", "framed") for seed in (1, 2)]
    with pytest.raises(WorkflowError, match=r"framed/seed2/eval.json: label set .* differs"):
        run(tmp_path, root, experiments, with_base=False)


def test_each_metric_range_is_stated_under_the_table(tmp_path, results):
    """Issue 36: 'scores are in [0, 1]' was printed under every table, perplexity's and mlm_loss's included."""
    from workflow_scripts.tasks import metrics

    _, text = run(tmp_path, results)
    assert "scores are in [0, 1]" not in text and "Ranges: exact_match [0, 1], higher is better." in text
    assert metrics.score_range("perplexity") == "[1, ∞), lower is better"
    assert metrics.score_range("mlm_loss") == "[0, ∞), lower is better"
