"""The ``compare`` stage: models x datasets x variants x seeds in one table, each variant against the reference.

For every (model, dataset): the seed-averaged score of each variant (mean and sample standard deviation over
seeds, and a 95% bootstrap interval), the untrained base model's score with the same prompt, and
the gain of each variant over the untrained model (paired over the same test examples), and
each variant minus the reference variant with a paired bootstrap over the same test examples, or
with a two-level one (seeds, then test examples) when ``comparison.bootstrap`` says so or, under
``auto``, when every compared variant has 3 or more seeds (see paired_bootstrap.py for the pairing,
the interval and the p-value; the table names the mode used). Before any number is
computed, the fairness guard (fairness.py) refuses variants whose runs differ in more than the
prompt format. Writes CSV, Markdown and PNG plots.
"""
from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from workflow_scripts.analysis import excluded_rows, fairness, paired_bootstrap, plots, power
from workflow_scripts.tasks import also_metrics, metrics
from workflow_scripts.core import experiment_set, json_files
from workflow_scripts.core.atomic_output import atomic_path
from workflow_scripts.core.experiment_config import evaluation_subdirectory, plot_names
from workflow_scripts.core.section_settings import ComparisonSettings
from workflow_scripts.core.errors import ConfigError, WorkflowError, run_main
from workflow_scripts.core.stage_arguments import StageArgumentParser, json_setting

COLUMNS = (
    "model", "dataset", "trained_on", "metric", "variant", "n_seeds", "seeds", "seed_scores", "mean", "std", "ci_low", "ci_high",
    "base_score", "gain_over_base", "gain_ci_low", "gain_ci_high", "reference", "difference", "difference_ci_low", "difference_ci_high",
    "p_value", "n_examples", "unparseable_share", "bootstrap",
)


@dataclass
class Run:
    """One experiment's evaluation on one dataset: eval summary, per-example values keyed by id, and the
    training run's manifest and log (``run_directory``; ``directory`` holds the evaluation)."""
    model: str
    dataset: str
    variant: str
    seed: int
    directory: Path
    summary: dict
    values: dict[str, Any] = field(repr=False)
    manifest: dict = field(repr=False)
    trained: str = ""  # the dataset or mixture the adapter was trained on ("" : ``dataset``)
    run_directory: Path | None = None

    def __post_init__(self):
        self.trained = self.trained or self.dataset
        self.run_directory = self.run_directory or self.directory


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = StageArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", required=True, help="root of results/{model}/{dataset}/{variant}/seed{seed}/")
    parser.add_argument("--experiments", required=True, help="JSON list of [model, dataset, variant, seed] or "
                        "[model, trained on, variant, seed, evaluated dataset] (a mixture, or an evaluation-only dataset)")
    parser.add_argument("--comparison", required=True, help="the config's comparison settings as JSON")
    parser.add_argument("--with-base", action="store_true", help="read the untrained model's results/{model}/{dataset}/{variant}/base/ eval.json and predictions")
    parser.add_argument("--normalise-reports", nargs="+", default=[], help="each evaluated dataset's "
                        "normalise_report.json: the report lists the scored split's rows normalise excluded, and why")
    parser.add_argument("--out-csv", required=True)
    parser.add_argument("--out-markdown", required=True)
    parser.add_argument("--plots-dir", required=True, help="writes scores_{model}_{dataset}.png and loss_{model}_{dataset}.png here")
    parser.add_argument("--experiment-set-out", help="the stamp naming this experiment set (core/experiment_set.py); "
                        "other sets' stamps beside it are removed")
    return parser.parse_args(argv)


def parse_experiments(text: str) -> list[tuple[str, str, str, int, str]]:
    """(model, trained on, variant, seed, evaluated dataset) per item; a 4-item entry is scored on its own dataset."""
    value = json_setting(text, "--experiments")
    if not isinstance(value, list) or not value:
        raise WorkflowError("argument --experiments: expected a non-empty JSON list of [model, dataset, variant, seed]")
    experiments = []
    for index, item in enumerate(value):
        if (not isinstance(item, list) or len(item) not in (4, 5) or not all(isinstance(name, str) for name in item[:3])
                or not isinstance(item[3], int) or isinstance(item[3], bool)
                or (len(item) == 5 and not isinstance(item[4], str))):
            raise WorkflowError(f"argument --experiments item {index}: expected [model, dataset, variant, seed] or "
                                f"[model, trained on, variant, seed, evaluated dataset], got {item!r}")
        experiment = (item[0], item[1], item[2], item[3], item[4] if len(item) == 5 else item[1])
        if experiment in experiments:
            raise WorkflowError(f"argument --experiments item {index}: {item!r} is listed twice")
        experiments.append(experiment)
    return experiments


def bootstrap_mode(comparison: ComparisonSettings, experiments: Sequence[tuple]) -> str:
    """The bootstrap used for the whole table: ``comparison.bootstrap``, with ``auto`` resolved over every
    compared (model, trained on, dataset, variant)'s seed count, so all rows use one mode."""
    counts: dict[tuple, int] = {}
    for model, trained, variant, _, *evaluated in experiments:
        key = (model, trained, variant, *evaluated)
        counts[key] = counts.get(key, 0) + 1
    return paired_bootstrap.resolve_mode(comparison.bootstrap, counts.values())


read_json = json_files.read_json_object
read_jsonl = json_files.read_jsonl_objects


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_predictions(path: Path, metric: str, also: bool = False, labels: Sequence[str] = ()) -> dict[str, Any]:
    """id -> per-example score, or the record's ``counts`` for a ratio-of-sums metric (metrics.COUNTS_WIDTH:
    smatch's (match, test, gold) triples; a masked-LM metric's (numerator, masked tokens)), or for macro-F1
    the per-class counts of the record's (gold, predicted) pair over ``labels`` (metrics.class_counts);
    ``also``: the values of ``metric`` under the record's ``also_scores`` (a dataset's also_metrics)."""
    values: dict[str, Any] = {}
    prefix = f"{also_metrics.FIELD}.{metric}." if also else ""
    for number, record in read_jsonl(path):
        example_id = record.get("id")
        row = (record.get(also_metrics.FIELD) or {}).get(metric) if also else record
        if not isinstance(row, dict):
            raise WorkflowError(f"{path} line {number}: field '{prefix[:-1]}' is missing; rerun evaluate")
        if not isinstance(example_id, str) or not example_id:
            raise WorkflowError(f"{path} line {number}: field 'id' is missing or not a string")
        if example_id in values:
            raise WorkflowError(f"{path} line {number}: duplicate id {example_id!r}")
        width = metrics.counts_width(metric)
        if metric in metrics.CLASS_COUNT_METRICS:
            gold, predicted = row.get("gold"), row.get("predicted")
            if not (isinstance(gold, str) and gold in labels and isinstance(predicted, str) and predicted in labels):
                raise WorkflowError(f"{path} line {number}: fields 'gold' and 'predicted' must be labels of eval.json's "
                                    f"'labels' {list(labels)}; rerun evaluate")
            values[example_id] = metrics.class_counts(gold, predicted, labels)
        elif metric in metrics.GRAPH_METRICS:
            counts = row.get("counts")
            if not (isinstance(counts, list) and len(counts) == width and all(isinstance(c, int) and c >= 0 for c in counts)):
                raise WorkflowError(f"{path} line {number}: field '{prefix}counts' must be {width} triple counts "
                                    f"({'match, test, gold' if metric == 'smatch' else 'a, b, c, d'})")
            values[example_id] = counts
        elif width is not None:  # a masked-LM ratio: [correct or summed loss (float), masked tokens]
            counts = row.get("counts")
            if not (isinstance(counts, list) and len(counts) == width
                    and all(_is_number(c) and c >= 0 for c in counts) and isinstance(counts[-1], int)):
                raise WorkflowError(f"{path} line {number}: field '{prefix}counts' must be [non-negative number, masked "
                                    f"token count] for {metric}")
            values[example_id] = [float(c) for c in counts]
        else:
            if not _is_number(row.get("score")):
                raise WorkflowError(f"{path} line {number}: field '{prefix}score' is missing or not a finite number")
            values[example_id] = float(row["score"])
    return values


def read_loss_curve(path: Path) -> tuple[list[int], list[float], list[int], list[float], dict]:
    """Training loss per step, the validation loss at the steps where training computed it, and the task's
    validation metric there (training.validation.metric_examples; empty when off)."""
    from workflow_scripts.training.training_log import validation_metric_curves

    steps, losses, validation_steps, validation_losses = [], [], [], []
    rows = read_jsonl(path)
    for number, row in rows:
        if not isinstance(row.get("step"), int) or not _is_number(row.get("loss")):
            raise WorkflowError(f"{path} line {number}: fields 'step' (integer) and 'loss' (finite number) are required")
        steps.append(row["step"])
        losses.append(float(row["loss"]))
        if "validation_loss" in row:
            if not _is_number(row["validation_loss"]):
                raise WorkflowError(f"{path} line {number}: field 'validation_loss' is not a finite number")
            validation_steps.append(row["step"])
            validation_losses.append(float(row["validation_loss"]))
    return steps, losses, validation_steps, validation_losses, validation_metric_curves([row for _, row in rows])


def check_summary(summary: Mapping[str, Any], path: Path, model: str, dataset: str, variant: str, seed: int | str) -> None:
    """eval.json must describe the experiment its path names (a stale or copied file would not)."""
    for key in ("metric", "score", "n_examples", "n_unparseable"):
        if key not in summary:
            raise WorkflowError(f"{path}: field '{key}' is missing")
    expected = {"model": model, "dataset": dataset, "variant": variant, "seed": seed}
    for key, value in expected.items():
        if summary.get(key) != value:
            raise WorkflowError(f"{path}: field '{key}' is {summary.get(key)!r}, but the path is for {key} {value!r}")
    if summary["metric"] not in metrics.COMPARABLE_METRICS:
        raise WorkflowError(f"{path}: field 'metric' is {summary['metric']!r}; the comparison resamples "
                            f"{', '.join(metrics.COMPARABLE_METRICS)}")


def load_run(results_dir: Path, model: str, trained: str, variant: str, seed: int, dataset: str | None = None) -> Run:
    """An adapter trained on ``trained`` scored on ``dataset`` (its own, or under on_<dataset>/)."""
    dataset = dataset or trained
    run_directory = results_dir / model / trained / variant / f"seed{seed}"
    directory = run_directory / evaluation_subdirectory(trained, dataset)
    summary, values = read_evaluation(directory, model, dataset, variant, seed)
    return Run(model, dataset, variant, seed, directory, summary, values, read_json(run_directory / "run_manifest.json"),
               trained, run_directory)


def read_evaluation(directory: Path, model: str, dataset: str, variant: str, seed: int | str) -> tuple[dict, dict]:
    """eval.json and its per-example values, checked against each other and against the path."""
    summary = read_json(directory / "eval.json")
    check_summary(summary, directory / "eval.json", model, dataset, variant, seed)
    values = read_predictions(directory / "predictions.jsonl", summary["metric"], labels=label_set(summary, directory))
    check_recomputed(directory, summary, values)
    return summary, values


def label_set(summary: Mapping[str, Any], directory: Path) -> list[str]:
    """A classifier's label set, sorted so that every run's class counts line up ([] for other metrics)."""
    if summary["metric"] not in metrics.CLASS_COUNT_METRICS:
        return []
    labels = summary.get("labels")
    if not (isinstance(labels, list) and labels and all(isinstance(label, str) for label in labels)
            and len(set(labels)) == len(labels)):
        raise WorkflowError(f"{directory / 'eval.json'}: field 'labels' (the label set macro-F1 averages over) is "
                            "missing or not a list of distinct names; rerun evaluate")
    return sorted(labels)


def check_same_labels(directories: Sequence[Path], summaries: Sequence[Mapping[str, Any]]) -> None:
    """macro-F1 runs of one dataset must average over one label set, or their class counts would not pair."""
    first = sorted(summaries[0].get("labels") or [])
    for directory, summary in zip(directories, summaries):
        if sorted(summary.get("labels") or []) != first:
            raise WorkflowError(f"{directory / 'eval.json'}: label set {sorted(summary.get('labels') or [])} differs "
                                f"from {directories[0] / 'eval.json'}'s {first}; macro-F1 is compared over one label "
                                "set: rerun evaluate")


def check_recomputed(directory: Path, summary: Mapping[str, Any], values: Mapping[str, Any], where: str = "") -> None:
    """predictions.jsonl's values must give eval.json's score (``where``: the field it is in, when not 'score')."""
    if len(values) != summary["n_examples"]:
        raise WorkflowError(f"{directory / 'predictions.jsonl'}: {len(values)} rows, but eval.json says n_examples={summary['n_examples']}")
    recomputed = metrics.corpus_score(summary["metric"], [
        metrics.ExampleScore(0.0, tuple(v)) if metrics.summed_counts(summary["metric"]) else metrics.ExampleScore(v)
        for v in values.values()
    ])
    if not math.isclose(recomputed, summary["score"], abs_tol=1e-9):
        raise WorkflowError(f"{directory}: eval.json {where or 'score'} {summary['score']} does not match its "
                            f"predictions.jsonl ({recomputed}); the two files come from different runs: rerun evaluate")


def scored_with(directory: Path, summary: Mapping[str, Any], metric: str) -> tuple[dict, dict]:
    """eval.json and predictions.jsonl as if ``metric``, one of the dataset's also_metrics that evaluate scored
    on the same predictions (eval.json's ``also_scores``), were the main metric: so compare's rows, intervals
    and paired bootstrap apply to it unchanged."""
    also = (summary.get(also_metrics.FIELD) or {}).get(metric)
    if not (isinstance(also, dict) and _is_number(also.get("score")) and isinstance(also.get("n_unparseable"), int)):
        raise WorkflowError(f"{directory / 'eval.json'}: field '{also_metrics.FIELD}.{metric}' is missing or not "
                            "{score, n_unparseable}; rerun evaluate with the dataset's also_metrics")
    summary = {**summary, "metric": metric, "score": float(also["score"]), "n_unparseable": also["n_unparseable"]}
    values = read_predictions(directory / "predictions.jsonl", metric, also=True)
    check_recomputed(directory, summary, values, f"{also_metrics.FIELD}.{metric}.score")
    return summary, values


def also_scored_rows(dataset: str, runs: Sequence[Run], reference: str, comparison: ComparisonSettings,
                     base: Mapping[str, "BaseRun"] | None, mode: str) -> list[dict]:
    """Rows of each further metric the runs were scored with on the same predictions (also_metrics), built as
    the main rows are, from the runs read as if that metric were their main one."""
    rows = []
    for metric in dict.fromkeys(name for run in runs for name in run.summary.get(also_metrics.FIELD) or {}):
        as_metric = [replace(run, summary=summary, values=values) for run in runs
                     for summary, values in [scored_with(run.directory, run.summary, metric)]]
        base_as_metric = None if base is None else {
            variant: BaseRun(run.directory, summary["score"], values) for variant, run in base.items()
            for summary, values in [scored_with(run.directory, read_json(run.directory / "eval.json"), metric)]}
        rows.extend(compare_dataset(dataset, as_metric, reference, comparison, base_as_metric, mode))
    return rows


def aligned_ids(runs: Sequence[Run]) -> list[str]:
    """The test ids every run of a dataset scored; any disagreement breaks the pairing and is refused."""
    first = runs[0]
    ids = set(first.values)
    for run in runs[1:]:
        if set(run.values) != ids:
            missing, extra = sorted(ids - set(run.values))[:3], sorted(set(run.values) - ids)[:3]
            raise WorkflowError(
                f"{run.directory / 'predictions.jsonl'}: not the same test examples as "
                f"{first.directory / 'predictions.jsonl'} (missing ids {missing}, extra ids {extra}); "
                "paired comparison needs identical test sets: rerun evaluate with the same evaluation settings"
            )
    return sorted(ids)


def check_fairness(runs: Sequence[Run], intended: Sequence[str]) -> None:
    for model, trained, dataset, seed in sorted({(run.model, run.trained, run.dataset, run.seed) for run in runs}):
        same = [run for run in runs
                if (run.model, run.trained, run.dataset, run.seed) == (model, trained, dataset, seed)]
        settings, sources = {}, {}
        for run in same:
            try:
                settings[run.variant] = fairness.comparable_settings(run.manifest, run.summary)
            except WorkflowError as error:
                raise WorkflowError(f"{run.run_directory / 'run_manifest.json'}: {error}") from None
            sources[run.variant] = str(run.run_directory / "run_manifest.json")
        where = dataset if trained == dataset else f"{trained}, scored on {dataset}"
        fairness.check_fair(f"model '{model}', dataset '{where}'", seed, settings, sources, intended)


def check_evaluation_settings(model: str, trained: str, dataset: str, runs: Sequence[Run],
                              base: Mapping[str, "BaseRun"] | None) -> None:
    """The runs of one table group and the untrained model's evaluations beside them: the same evaluation
    settings (fairness.check_same_evaluation), so no row mixes settings."""
    settings, sources = {}, {}
    for run in runs:
        name = f"{run.variant} seed {run.seed}"
        settings[name], sources[name] = fairness.evaluation_settings(run.summary), str(run.directory / "eval.json")
    for variant, base_run in (base or {}).items():
        name = f"{variant} untrained"
        settings[name] = fairness.evaluation_settings(read_json(base_run.directory / "eval.json"))
        sources[name] = str(base_run.directory / "eval.json")
    where = dataset if trained == dataset else f"{trained}, scored on {dataset}"
    fairness.check_same_evaluation(f"model '{model}', dataset '{where}'", settings, sources)


def _round(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else round(value, 6)


def compare_dataset(dataset: str, runs: Sequence[Run], reference: str, comparison: ComparisonSettings,
                    base: Mapping[str, "BaseRun"] | None, mode: str | None = None) -> list[dict]:
    """Rows of one (model, dataset); ``base``: the untrained model's evaluation per variant (None: not run);
    ``mode`` is the bootstrap mode (None: resolve ``comparison.bootstrap`` from these runs)."""
    model = runs[0].model
    metric_names = {run.summary["metric"] for run in runs}
    if len(metric_names) != 1:
        raise WorkflowError(f"dataset '{dataset}': runs were scored with different metrics {sorted(metric_names)}")
    metric = metric_names.pop()
    ids = aligned_ids(runs)
    if metric in metrics.CLASS_COUNT_METRICS:
        check_same_labels([run.directory for run in runs] + [run.directory for run in (base or {}).values()],
                          [run.summary for run in runs] + [run.summary for run in (base or {}).values()])
    if base is not None:
        for variant, base_run in base.items():
            if set(base_run.values) != set(ids):
                raise WorkflowError(f"{base_run.directory / 'predictions.jsonl'}: not the same test examples as the "
                                    f"trained runs of '{dataset}'; rerun evaluate_base with the same evaluation settings")
    by_variant: dict[str, dict[int, Run]] = {}
    for run in runs:
        by_variant.setdefault(run.variant, {})[run.seed] = run
    if reference not in by_variant:
        raise ConfigError("comparison.reference_variant", f"'{reference}' has no runs for dataset '{dataset}' (variants: {sorted(by_variant)})")
    seeds = sorted(by_variant[reference])
    for variant, seed_runs in by_variant.items():
        if sorted(seed_runs) != seeds:
            raise WorkflowError(f"dataset '{dataset}': variant '{variant}' has seeds {sorted(seed_runs)}, "
                                f"the reference '{reference}' has {seeds}; pairing by seed needs the same seeds")

    def arrays(variant: str) -> list[np.ndarray]:
        return [np.asarray([by_variant[variant][seed].values[i] for i in ids]) for seed in seeds]

    if mode is None:
        mode = paired_bootstrap.resolve_mode(comparison.bootstrap, [len(seeds)] * len(by_variant))
    resamples, bootstrap_seed = comparison.bootstrap_resamples, comparison.bootstrap_seed
    order = [reference] + [variant for variant in by_variant if variant != reference]
    rows = []
    for variant in order:
        seed_scores = [by_variant[variant][seed].summary["score"] for seed in seeds]
        interval = paired_bootstrap.score_interval(metric, arrays(variant), resamples, bootstrap_seed, mode)
        base_score = None if base is None else base[variant].score
        row = {
            "model": model, "dataset": dataset, "trained_on": runs[0].trained, "metric": metric, "variant": variant, "n_seeds": len(seeds),
            "seeds": " ".join(map(str, seeds)), "seed_scores": seed_scores,
            "mean": interval.score, "std": float(np.std(seed_scores, ddof=1)) if len(seeds) > 1 else None,
            "ci_low": interval.low, "ci_high": interval.high,
            "base_score": base_score, "gain_over_base": None, "gain_ci_low": None, "gain_ci_high": None,
            "reference": reference, "difference": None, "difference_ci_low": None, "difference_ci_high": None,
            "p_value": None, "n_examples": len(ids),
            "unparseable_share": float(np.mean([by_variant[variant][s].summary["n_unparseable"] / len(ids) for s in seeds])),
            "bootstrap": mode,
            # Not a CSV column: the report's note on which base QLoRA adapters were scored on (eval.json).
            "qlora_base": " / ".join(sorted({by_variant[variant][s].summary.get("qlora_base") or "" for s in seeds}
                                            - {""})) or None,
            # Nor this: which base the untrained model was scored on (evaluate_base of a QLoRA variant).
            "untrained_qlora_base": None if base is None else base[variant].summary.get("qlora_base"),
        }
        if base is not None:  # the untrained model is one model for every seed: its values repeat per seed
            untrained = [np.asarray([base[variant].values[i] for i in ids])] * len(seeds)
            gain = paired_bootstrap.paired_difference(metric, arrays(variant), untrained, resamples, bootstrap_seed, mode)
            row.update(gain_over_base=gain.difference, gain_ci_low=gain.low, gain_ci_high=gain.high)
        if variant != reference:
            result = paired_bootstrap.paired_difference(metric, arrays(variant), arrays(reference), resamples,
                                                        bootstrap_seed, mode)
            row.update(difference=result.difference, difference_ci_low=result.low,
                       difference_ci_high=result.high, p_value=result.p_value)
        rows.append({key: _round(value) if isinstance(value, float) else value for key, value in row.items()})
    return rows


@dataclass
class BaseRun:
    """The untrained model's evaluation with one variant's prompt."""
    directory: Path
    score: float
    values: dict[str, Any] = field(repr=False)
    summary: dict = field(default_factory=dict, repr=False)


def read_base_runs(results_dir: Path, model: str, dataset: str, variants: Sequence[str], metric: str) -> dict[str, BaseRun]:
    runs = {}
    for variant in variants:
        directory = results_dir / model / dataset / variant / "base"
        summary, values = read_evaluation(directory, model, dataset, variant, "base")
        if summary["metric"] != metric:
            raise WorkflowError(f"{directory / 'eval.json'}: metric '{summary['metric']}' differs from the trained "
                                f"runs' '{metric}'")
        runs[variant] = BaseRun(directory, float(summary["score"]), values, summary)
    return runs


def _cell(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def bootstrap_lines(rows: Sequence[Mapping[str, Any]], comparison: ComparisonSettings) -> list[str]:
    """One line per bootstrap mode in the table, e.g. "intervals: two-level bootstrap: seeds, then test examples (3 seeds)"."""
    setting = comparison.bootstrap
    lines = []
    for mode in dict.fromkeys(row["bootstrap"] for row in rows):
        counts = [row["n_seeds"] for row in rows if row["bootstrap"] == mode]
        why = (f"comparison.bootstrap: auto (seeds are resampled only when every variant has "
               f"{paired_bootstrap.AUTO_MIN_SEEDS} or more)" if setting == "auto" else f"comparison.bootstrap: {setting}")
        text = paired_bootstrap.describe(mode, counts)
        lines.append(f"{text[0].upper()}{text[1:]}; {why}.")
    return lines


def _method(mode: str, reference: str, comparison: ComparisonSettings) -> str:
    settings = f"{comparison.bootstrap_resamples} resamples, seed {comparison.bootstrap_seed}"
    if mode == paired_bootstrap.SEEDS_AND_EXAMPLES:
        return (
            f"Δ is the variant minus '{reference}', from a two-level paired bootstrap ({settings}): each resample "
            "first draws seeds with replacement, the same seed numbers for every variant (seed k of a variant "
            "shares data order and initialisation with seed k of the reference), then draws test examples with "
            "replacement, one draw for every drawn seed of every variant (paired by id), and averages the per-seed "
            "corpus scores over the drawn seeds (smatch: triple counts summed, micro F1 recomputed). The intervals "
            "and p therefore include the seed-to-seed variation."
        )
    return (
        f"Δ is the variant minus '{reference}', from a paired bootstrap over the same test examples ({settings}): "
        "each resample draws test examples with replacement, applies the same draw to every seed of both variants "
        "(seed paired with seed), and averages the per-seed corpus scores (smatch: triple counts summed, micro F1 "
        "recomputed). Seeds are held fixed, so the intervals and p leave out the seed-to-seed variation."
    )


def reference_for(comparison: ComparisonSettings, task: str) -> str:
    """comparison.reference_variant: one name, or a mapping task -> name."""
    reference = comparison.reference_for(task)
    if reference is None:
        raise ConfigError("comparison.reference_variant",
                          f"names no reference for task '{task}' ({dict(comparison.reference_variant)})")
    return reference


def markdown(rows: Sequence[Mapping[str, Any]], comparison: ComparisonSettings, notes: Sequence[str] = (),
             also_rows: Sequence[Mapping[str, Any]] = ()) -> str:
    """The table, then how its numbers were made; ``notes``: further lines (excluded rows, tasks' conventions);
    ``also_rows``: the datasets' also_metrics, in a second table under the main one."""
    reference = " / ".join(dict.fromkeys(row["reference"] for row in rows))
    lines = ["# Comparison of prompt variants", "", *table_lines(rows, reference)]
    if also_rows:
        lines += ["", "Also scored on the same predictions (the datasets' also_metrics; same intervals and paired "
                  "bootstrap):", "", *table_lines(also_rows, reference)]
    intended = comparison.intended_differences
    modes = dict.fromkeys(row["bootstrap"] for row in rows)
    lines += ["", *bootstrap_lines(rows, comparison), "", *(line + "\n" for line in power.achieved_lines(rows))]
    ranges = "; ".join(f"{metric} {metrics.score_range(metric)}"
                       for metric in dict.fromkeys(row["metric"] for row in [*rows, *also_rows]))
    lines += [
        f"Mean and sample standard deviation over seeds. Ranges: {ranges}. "
        + " ".join(_method(mode, reference, comparison) for mode in modes)
        + " Gain over untrained: the same paired bootstrap against the untrained base model's predictions with "
        "the variant's own prompt (one model, repeated for every seed)."
        + " 95% CI: percentile interval. "
        "p: two-sided, shift method as in sacrebleu, (c + 1) / (B + 1), with c the resamples whose centred "
        "difference is at least as far from 0 as the observed one.",
        "",
        *qlora_lines(rows),
        "Fairness: variants were checked to differ only in the prompt format"
        + (f", except the intended differences {', '.join(intended)}." if intended else "."),
        "",
        *notes,
    ]
    return "\n".join(lines)


def table_lines(rows: Sequence[Mapping[str, Any]], reference: str) -> list[str]:
    """The Markdown table of ``rows``, one line each."""
    # A "trained on" column only where some adapter is scored on another dataset than it trained on
    # (a mixture's components, evaluation-only datasets).
    crossed = any(row["trained_on"] != row["dataset"] for row in rows)
    lines = [
        f"| model | {'trained on | ' if crossed else ''}dataset | metric | variant | seeds | mean ± std | 95% CI | untrained "
        f"| gain over untrained [95% CI] | Δ vs {reference} [95% CI] | p |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if crossed else ""),
    ]
    for row in rows:
        delta = "—" if row["difference"] is None else (
            f"{row['difference']:+.4f} [{row['difference_ci_low']:+.4f}, {row['difference_ci_high']:+.4f}]"
            f"{power.delta_note(row)}")
        gain = "n/a" if row["gain_over_base"] is None else (
            f"{row['gain_over_base']:+.4f} [{row['gain_ci_low']:+.4f}, {row['gain_ci_high']:+.4f}]")
        lines.append(
            f"| {row['model']} | {row['trained_on'] + ' | ' if crossed else ''}{row['dataset']} | {row['metric']} | {row['variant']} | {row['n_seeds']} | "
            f"{_cell(row['mean'])} ± {_cell(row['std'])} | [{_cell(row['ci_low'])}, {_cell(row['ci_high'])}] | "
            f"{_cell(row['base_score'])}{untrained_note(row)} | {gain} | {delta} | {'—' if row['p_value'] is None else _cell(row['p_value'])} |"
        )
    return lines


def report_notes(runs: Sequence[Run], rows: Sequence[Mapping[str, Any]], normalise_reports: Sequence[str]) -> list[str]:
    """Lines under the table: each evaluated dataset's rows excluded at normalise (when the reports are given),
    then the conventions of the compared tasks' metrics (a task's ``comparison_note``)."""
    from workflow_scripts.tasks import task_named

    lines = []
    if normalise_reports:
        reports = excluded_rows.read_reports(normalise_reports)
        items = []
        for dataset in dict.fromkeys(run.dataset for run in runs):
            run = next(run for run in runs if run.dataset == dataset)
            if not isinstance(run.summary.get("split"), str):
                raise WorkflowError(f"{run.directory / 'eval.json'}: field 'split' is missing; rerun evaluate")
            scored = next(row["n_examples"] for row in rows if row["dataset"] == dataset)
            items.append((excluded_rows.exclusions(reports, dataset, run.summary["split"]), scored))
        lines += excluded_rows.lines(items)
    for task in dict.fromkeys(run.summary.get("task", "generation") for run in runs):
        note = getattr(task_named(task, "eval.json field 'task'"), "comparison_note", None)
        lines += [note, ""] if note else []
    return lines


def untrained_note(row: Mapping[str, Any]) -> str:
    """After the untrained score in the table: the base a QLoRA variant's untrained model was scored on."""
    return f" ({row['untrained_qlora_base']} base)" if row.get("untrained_qlora_base") else ""


def qlora_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Which base the QLoRA adapters, and their variants' untrained models, were scored on
    (evaluation.qlora_base), when any row has one."""
    scored, untrained = {}, {}
    for row in rows:
        if row.get("qlora_base"):
            scored.setdefault(row["qlora_base"], []).append(f"{row['dataset']}/{row['variant']}")
        if row.get("untrained_qlora_base"):
            untrained.setdefault(row["untrained_qlora_base"], []).append(f"{row['dataset']}/{row['variant']}")
    what = {"quantised": "the quantised base, as they were trained", "unquantised": "the unquantised base "
            "(not the model that was trained)"}
    lines = [f"QLoRA adapters ({', '.join(dict.fromkeys(names))}) were scored on "
             f"{what.get(base, base)} (evaluation.qlora_base: {base})." for base, names in scored.items()]
    lines += [f"The untrained model of QLoRA variants ({', '.join(dict.fromkeys(names))}) was scored on the {base} "
              "base, as their adapters were (evaluation.qlora_base), so the gain over untrained holds no "
              "quantisation effect." for base, names in untrained.items()]
    return lines + ([""] if lines else [])


def write_csv(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    with atomic_path(path) as temporary, open(temporary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            cells = {key: "" if row[key] is None else row[key] for key in COLUMNS}
            cells["seed_scores"] = " ".join(f"{score:.4f}" for score in row["seed_scores"])
            writer.writerow(cells)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    experiments = parse_experiments(args.experiments)
    comparison = ComparisonSettings.from_json(args.comparison)
    results_dir = Path(args.results_dir)
    runs = [load_run(results_dir, *experiment) for experiment in experiments]
    check_fairness(runs, comparison.intended_differences)
    mode = bootstrap_mode(comparison, experiments)

    rows, also_rows, loss_curves = [], [], {}
    groups = list(dict.fromkeys((model, trained, dataset) for model, trained, _, _, dataset in experiments))
    for model, trained, dataset in groups:
        group_runs = [run for run in runs if (run.model, run.trained, run.dataset) == (model, trained, dataset)]
        metric = group_runs[0].summary["metric"]
        variants = list(dict.fromkeys(run.variant for run in group_runs))
        base = read_base_runs(results_dir, model, dataset, variants, metric) if args.with_base else None
        check_evaluation_settings(model, trained, dataset, group_runs, base)
        reference = reference_for(comparison, group_runs[0].summary.get("task", "generation"))
        rows.extend(compare_dataset(dataset, group_runs, reference, comparison, base, mode))
        also_rows.extend(also_scored_rows(dataset, group_runs, reference, comparison, base, mode))
        loss_curves.setdefault((model, trained), {}).update(
            {(run.variant, run.seed): read_loss_curve(run.run_directory / "train_log.jsonl") for run in group_runs})

    plots_dir = Path(args.plots_dir)
    for model, trained, dataset in groups:
        group_rows = [row for row in rows if (row["model"], row["trained_on"], row["dataset"]) == (model, trained, dataset)]
        scores, loss = plot_names(model, trained, dataset)
        title = f"{dataset} ({model})" if trained == dataset else f"{dataset}, trained on {trained} ({model})"
        plots.score_plot(plots_dir / scores, title, group_rows[0]["metric"], group_rows)
    for (model, trained), curves in loss_curves.items():
        plots.loss_plot(plots_dir / plot_names(model, trained, trained)[1], f"{trained} ({model})", curves)
    write_csv(args.out_csv, rows + also_rows)
    text = markdown(rows, comparison, report_notes(runs, rows, args.normalise_reports), also_rows) + fairness.evaluation_note(
        [run.summary for run in runs])
    with atomic_path(args.out_markdown) as temporary:
        temporary.write_text(text)
    if args.experiment_set_out:
        experiment_set.write_stamp(args.experiment_set_out, {
            "experiments": json_setting(args.experiments, "--experiments"), "comparison": comparison.to_dict(),
            "with_base": args.with_base}, published=[args.out_markdown, args.out_csv])
    print(text)
    return 0


if __name__ == "__main__":
    run_main(main)
