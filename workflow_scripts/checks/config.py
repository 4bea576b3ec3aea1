"""The whole config checked beyond the JSON schema, when the workflow is read; each failure names the key and the fix.

:func:`check_config` asks each task type about its variants, the fairness guard (analysis.fairness) about
the variants of one task, and the matrix (core.experiment_config) about what runs: so it sits above them.
:func:`load_config` reads, validates and checks a config file the way the Snakefile does.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import yaml

from workflow_scripts.analysis import fairness, paired_bootstrap
from workflow_scripts.checks.sections import check_dataset, check_model
from workflow_scripts.core.config_files import deep_merge, read_config_file, refuse_unused_qlora_base, validate_schema
from workflow_scripts.core.config_schema import SCHEMA_PATH
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.core.recorded_params import recorded_training
from workflow_scripts.core.experiment_config import (
    RESERVED_MODEL_NAMES, dataset_entries, dataset_models, entry_task, evaluation_split, mixtures, model_dataset_variants,
    model_entries, model_entry_variants, models, resolved_training, training_settings, variant_entries)
from workflow_scripts.core.section_settings import ComparisonSettings, EvaluationSettings, TrackingSettings
from workflow_scripts.core.settings import finetune_problem, sharding_problem
from workflow_scripts.tasks import check_also_metrics, task_named

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import ModelSettings
    from workflow_scripts.core.settings import TrainingSettings, ValidationSettings


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict:
    """Read a YAML config with :class:`StrictLoader` (a SafeLoader), validate it, fill defaults and check consistency."""
    path = Path(path)
    config = read_config_file(path)
    if overrides:
        config = deep_merge(config, overrides)
    given = copy.deepcopy(config)  # as written: validation fills the schema's defaults in place
    validate_schema(config, str(path))
    check_config(config, str(path))
    refuse_unused_qlora_base(given, str(path))
    return config


def checked_sections(config: Mapping[str, Any],
                     source: str | None = None) -> tuple[ComparisonSettings, EvaluationSettings, TrackingSettings]:
    """Every check of the config alone (no data file, model or resource read): :func:`check_config`, then the
    typed sections the rules hand the stages, and the tracking settings' own check. One list for the Snakefile
    (rules/common.smk, which keeps the typed sections) and ``python -m workflow_scripts.checks``."""
    from workflow_scripts.training.trackers import check_workflow_tracking

    check_config(config, source)
    comparison = ComparisonSettings.parse(config["comparison"], "comparison", source)
    evaluation = EvaluationSettings.parse(config["evaluation"], "evaluation", source)
    tracking = TrackingSettings.parse(config["tracking"], "tracking", source)
    check_workflow_tracking(tracking)
    return comparison, evaluation, tracking


def check_config(config: Mapping[str, Any], source: str | None = None) -> None:
    """Checks beyond the JSON schema; each failure names the key and the fix."""
    if ("model" in config) == ("models" in config):
        raise ConfigError("model", "give the base model under model: (one) or under models: (several, by name), "
                          "not both" if "model" in config else "missing: give the base model under model: "
                          "(one) or models: (several, by name)", source)
    typed_models = model_entries(config, source)
    for name, model in typed_models.items():
        key = "model" if "model" in config else f"models.{name}"
        if name in RESERVED_MODEL_NAMES:  # results/{model}/... sits beside these folders
            raise ConfigError(f"{key}.name" if "model" in config else key,
                              f"'{name}' is reserved for results/{name}/; choose another model name", source)
        check_model(model, source, key)
        unknown = set(model.training) - _training_keys()
        if unknown:
            raise ConfigError(f"{key}.training", f"unknown training keys {sorted(unknown)}", source)
    typed_datasets = dataset_entries(config, source)
    for name, dataset in typed_datasets.items():
        check_dataset(dataset, source, evaluation_split(config, name))
        if dataset.also_metrics:
            check_also_metrics(dataset, source)
        check_gold_graphs(dataset, source)
        for model in dataset.models or ():
            if model not in models(config):
                raise ConfigError(f"datasets.{name}.models", f"'{model}' is not a model of this config "
                                  f"(models: {sorted(models(config))})", source)
    training_keys = _training_keys()  # a key without a schema default is known too (micro_batch_tokens)
    typed_variants = variant_entries(config, source)
    for name, variant in config["variants"].items():
        key = f"variants.{name}"
        unknown = set(variant.get("training", {})) - training_keys
        if unknown:
            raise ConfigError(f"{key}.training", f"unknown training keys {sorted(unknown)}", source)
        task = task_named(variant["task"])
        datasets = {ds: d for ds, d in typed_datasets.items() if d.task == variant["task"]}
        try:  # the task's own checks: templates against each dataset of its task, leaks of the gold
            task.check_config_variant(name, typed_variants[name], datasets)
        except ConfigError as error:
            raise ConfigError(error.key, error.problem, source) from None
        except WorkflowError as error:
            raise ConfigError(key, str(error), source) from None
        for model in models(config):
            training_settings(config, name, model, source)  # the schema, the batch shape and the length
    _check_target_templates(typed_variants, source)
    _check_mixtures(config, source)
    _check_evaluated(config, source)
    for model, entry, variant in model_entry_variants(config):
        training = training_settings(config, variant, model, source)
        _check_finetune(training, typed_models[model], entry_task(config, entry),
                        f"variants.{variant}.training" if config["variants"][variant].get("training") else "training",
                        "model" if "model" in config else f"models.{model}", source)
        _check_switches(config, training, model, variant, entry_task(config, entry), source)
        for dataset in mixtures(config)[entry]["datasets"] if entry in mixtures(config) else [entry]:
            if training.validating and "validation" not in config["datasets"][dataset]["splits"]:
                raise ConfigError("training.validation.every_steps", f"dataset '{dataset}' has no validation split "
                                  f"(datasets.{dataset}.splits), so there is no held-out loss to compute; add one or "
                                  "switch validation off for it with a variant's training override", source)
        _check_validation_metric(config, entry, training.validation, source)
        _check_gpu_only_switches(config, model, variant, training, source)
    comparison = ComparisonSettings.parse(config["comparison"], "comparison", source)
    _check_bootstrap_seeds(config, comparison, source)
    _check_detectable_effect(config, comparison, source)
    tasks_in_use = {dataset["task"] for dataset in config["datasets"].values()}
    for task_name in sorted(tasks_in_use):
        if not any(variant["task"] == task_name for variant in config["variants"].values()):
            raise ConfigError("variants", f"no variant has task '{task_name}', so its datasets would not run; "
                              f"add one with task: {task_name}", source)
        reference = comparison.reference_for(task_name)
        if reference not in config["variants"] or config["variants"][reference]["task"] != task_name:
            choices = sorted(v for v, settings in config["variants"].items() if settings["task"] == task_name)
            raise ConfigError("comparison.reference_variant",
                              f"'{reference}' is not one of the {task_name} variants {choices}; with variants of "
                              "several tasks give a mapping, e.g. {generation: baseline, classification: plain}", source)
        for model in models(config):
            _check_fair_training(config, task_name, reference, comparison.intended_differences, source, model)
    running = {model for model, _, _ in model_entry_variants(config)}
    for name in models(config):
        if name not in running:
            raise ConfigError("model" if "model" in config else f"models.{name}", f"no dataset or mixture trains "
                              f"on '{name}' (their models: lists leave it out), so it would silently drop out of the "
                              f"matrix; add '{name}' to the models: list of a dataset or mixture, or remove it", source)
    _check_power_threshold(config, comparison, source)
    if config["evaluation"]["gpus"] > 1:  # evaluate decodes on cuda:0 alone; the rest would sit reserved
        raise ConfigError("evaluation.gpus", f"is {config['evaluation']['gpus']}, but evaluation runs on one GPU "
                          "(the others would be reserved and idle); set evaluation.gpus: 1 (or 0 for the CPU)", source)


def _check_switches(config: Mapping[str, Any], training: "TrainingSettings", model: str, variant: str, task: str,
                    source: str | None) -> None:
    """The training switches against the strategy and the task, refused here rather than in the first job:
    FSDP's refusals (core/settings.sharding_problem, as training/fsdp.check_settings), packing for a task that does
    not pack, the fused cross-entropy for a task whose loss is not the text-only target-token head."""
    model_key = "model" if "model" in config else f"models.{model}"
    model_entry = config["model"] if "model" in config else config["models"][model]

    def where(key: str) -> str:  # the key as the user set it: a variant's override, a model's, or the shared one
        name = key.removeprefix("training.")
        if name.split(".")[0] in config["variants"][variant].get("training", {}):
            return f"variants.{variant}.training.{name}"
        if name.split(".")[0] in model_entry.get("training", {}):
            return f"{model_key}.training.{name}"
        return key

    problem = sharding_problem(training, task)
    if problem is not None:
        key, reason, fix = problem
        raise ConfigError(where(key), f"training.strategy: fsdp {reason}; {fix}, or set training.strategy: ddp "
                          f"(model '{model}', variant '{variant}')", source)
    task_type = task_named(task)
    if training.packing and not getattr(task_type, "packs", None):
        raise ConfigError(where("training.packing"), f"is true, but task '{task}' (variant '{variant}') does not pack "
                          "examples; set training.packing: false for it", source)
    if training.fused_cross_entropy and not getattr(task_type, "fuses_output_head", False):
        raise ConfigError(where("training.fused_cross_entropy"), f"is true, but task '{task}' (variant '{variant}') "
                          "computes its loss without the text-only target-token head it fuses; set "
                          "training.fused_cross_entropy: false for it", source)


def _check_bootstrap_seeds(config: Mapping[str, Any], comparison: ComparisonSettings, source: str | None) -> None:
    """comparison.bootstrap: seeds_and_examples resamples seeds, so it needs 2 or more: refused here rather than
    by compare, the last job (every variant runs the config's seeds: the matrix crosses them)."""
    if comparison.bootstrap == paired_bootstrap.SEEDS_AND_EXAMPLES and len(config["seeds"]) < 2:
        raise ConfigError("comparison.bootstrap", f"'{paired_bootstrap.SEEDS_AND_EXAMPLES}' resamples seeds, which needs "
                          f"at least 2, but seeds is {list(config['seeds'])}; add seeds, or use 'examples' (or 'auto', "
                          f"which resamples seeds from {paired_bootstrap.AUTO_MIN_SEEDS} on)", source)
def _check_power_threshold(config: Mapping[str, Any], comparison: ComparisonSettings, source: str | None) -> None:
    """The power check (rules/power.smk) estimates from the untrained model's scores: a threshold that nothing
    would check must not pass in silence (every training job would run, no message)."""
    if comparison.min_detectable_effect is not None and not config["evaluation"]["evaluate_base_model"]:
        raise ConfigError("comparison.min_detectable_effect", f"is {comparison.min_detectable_effect}, but "
                          "evaluation.evaluate_base_model is false, and the power check estimates from the untrained "
                          "model's scores: set evaluation.evaluate_base_model: true, or remove the threshold", source)


def _check_validation_metric(config: Mapping[str, Any], entry: str, validation: "ValidationSettings",
                             source: str | None) -> None:
    """The validation metric needs validation points; selecting by it needs it, and one metric to average."""
    key = "training.validation"
    if validation.metric_examples is not None and not validation.every_steps:
        raise ConfigError(f"{key}.metric_examples", "is set but every_steps is not, so the metric would never be "
                          "computed; set training.validation.every_steps", source)
    if validation.criterion != "metric":
        return
    if validation.metric_examples is None:
        raise ConfigError(f"{key}.criterion", "is 'metric' but metric_examples is not set; set "
                          "training.validation.metric_examples or use criterion: loss", source)
    if entry in mixtures(config):
        used = {config["datasets"][name]["metric"] for name in mixtures(config)[entry]["datasets"]}
        if len(used) > 1:
            raise ConfigError(f"{key}.criterion", f"is 'metric' but mixture '{entry}' mixes metrics {sorted(used)}, "
                              "which have no common scale to average; use criterion: loss for it", source)


def _check_mixtures(config: Mapping[str, Any], source: str | None) -> None:
    """A mixture names datasets of one task that have train splits, and one way to weigh them."""
    for name, mixture in mixtures(config).items():
        key = f"mixtures.{name}"
        if name in config["datasets"]:
            raise ConfigError(key, f"'{name}' is also a dataset name; results/{{model}}/{name}/ would hold both: "
                              "rename the mixture", source)
        for dataset in mixture["datasets"]:
            if dataset not in config["datasets"]:
                raise ConfigError(f"{key}.datasets", f"'{dataset}' is not a dataset of this config "
                                  f"(datasets: {sorted(config['datasets'])})", source)
            if "train" not in config["datasets"][dataset]["splits"]:
                raise ConfigError(f"{key}.datasets", f"'{dataset}' has no train split (datasets.{dataset}.splits), "
                                  "so it cannot be mixed into training; list it as an evaluation-only dataset instead",
                                  source)
        tasks = {dataset: config["datasets"][dataset]["task"] for dataset in mixture["datasets"]}
        if len(set(tasks.values())) > 1:
            raise ConfigError(f"{key}.datasets", f"components of different tasks {tasks}; one run trains one task: "
                              "mix datasets of one task", source)
        weights = mixture.get("weights")
        if weights is not None and mixture.get("temperature") is not None:
            raise ConfigError(key, "give weights or temperature, not both", source)
        if weights is not None and set(weights) != set(mixture["datasets"]):
            raise ConfigError(f"{key}.weights", f"needs one weight per component {sorted(mixture['datasets'])}, "
                              f"got {sorted(weights)}", source)
        for model in mixture.get("models", []):
            if model not in models(config):
                raise ConfigError(f"{key}.models", f"'{model}' is not a model of this config "
                                  f"(models: {sorted(models(config))})", source)
    mixed = {dataset for mixture in mixtures(config).values() for dataset in mixture["datasets"]}
    for name, dataset in config["datasets"].items():
        if "train" in dataset["splits"] and not dataset.get("train_alone", True) and name not in mixed:
            raise ConfigError(f"datasets.{name}.train_alone", "false, but no mixture holds this dataset, so it "
                              "would never train; add it to a mixture or drop train_alone: false", source)


def _check_evaluated(config: Mapping[str, Any], source: str | None) -> None:
    """Each dataset's evaluation split exists; an evaluation-only dataset is scored by some trained model."""
    scored = {dataset for _, dataset, _ in model_dataset_variants(config)}
    for name, dataset in config["datasets"].items():
        split = evaluation_split(config, name)
        if split not in dataset["splits"]:
            where = f"datasets.{name}.evaluation_split" if dataset.get("evaluation_split") else "evaluation.split"
            held_out = [s for s in ("validation", "test") if s in dataset["splits"]]  # what the schema accepts
            fix = (f"set datasets.{name}.evaluation_split to {' or '.join(held_out)}" if held_out else
                   f"it has no held-out split to score; add one to datasets.{name}.splits (e.g. test: <the source "
                   "split of held-out rows>)")
            raise ConfigError(where, f"'{split}' is not a split of dataset '{name}' (its splits: "
                              f"{sorted(dataset['splits'])}); {fix}", source)
        if name not in scored:
            raise ConfigError(f"datasets.{name}", f"no model trained on a dataset or mixture of task "
                              f"'{dataset['task']}' runs on its models ({sorted(dataset_models(config, name))}), so it "
                              "would never be scored; add a training dataset of that task or list the model", source)


def _check_fair_training(config: Mapping[str, Any], task: str, reference: str, intended: Sequence[str],
                         source: str | None, model: str | None = None) -> None:
    """The fairness guard at parse time: the variants of one task train alike, up to intended differences.

    ``compare`` would refuse the finished runs anyway; refusing here saves the GPU hours between.
    Variants are compared with their task's reference variant (not with the shared block, so all
    classification variants may override, say, the LoRA targets the same way).
    """
    def comparable(variant: str) -> dict[str, Any]:
        # as train records them: a key written at the value its absence means (micro_batch_tokens: null,
        # validation.criterion: loss) is no difference
        settings = recorded_training(resolved_training(config, variant, model))
        return {key: value for top, item in settings.items() if top not in fairness.RUNTIME_ONLY_TRAINING_KEYS
                for key, value in fairness.flatten(item, f"training.{top}").items()}

    expected = comparable(reference)
    for name, variant in config["variants"].items():
        if variant["task"] != task or name == reference:
            continue
        ours = comparable(name)
        for key in sorted(set(expected) | set(ours)):
            mine, theirs = ours.get(key, fairness.ABSENT), expected.get(key, fairness.ABSENT)
            if mine != theirs and not fairness.is_intended(key, intended):
                if fairness.ABSENT in (mine, theirs):  # a block on one side, null on the other: name the whole block
                    key = ".".join(key.split(".")[:2])
                    # A key without a schema default may be unset on one side (micro_batch_tokens): missing as missing.
                    mine = resolved_training(config, name, model).get(key.split(".")[1], fairness.ABSENT)
                    theirs = resolved_training(config, reference, model).get(key.split(".")[1], fairness.ABSENT)
                sets = "leaves it unset" if mine is fairness.ABSENT else f"sets {mine!r}"
                uses = "leaves it unset" if theirs is fairness.ABSENT else f"uses {theirs!r}"
                raise ConfigError(
                    f"variants.{name}.{key}",
                    f"{sets} where the reference variant '{reference}' {uses}, so the comparison "
                    "would not be fair; make them equal, or list it under comparison.intended_differences: "
                    f"[{key}] if the difference is the point", source)
        # What the task's evaluation takes from training (masked LM: the tokens scored), intended apart.
        theirs_eval = fairness.eval_mask_settings(task_named(task), resolved_training(config, reference, model))
        for key, mine in fairness.eval_mask_settings(task_named(task), resolved_training(config, name, model)).items():
            if mine != theirs_eval.get(key, fairness.ABSENT) and not fairness.is_intended(key, intended):
                setting = key.rsplit(".", 1)[1]
                raise ConfigError(
                    f"variants.{name}.training.{setting}",
                    f"sets {mine!r} where the reference variant '{reference}' uses {theirs_eval.get(key)!r}, and "
                    f"{task} evaluation cuts test lines at training.{setting} ({key}), so the variants would be "
                    "scored on different tokens; make them equal, or list evaluation.eval_mask under "
                    f"comparison.intended_differences (beside training.{setting}) if comparing on different tokens "
                    "is the point", source)


def _check_finetune(training: "TrainingSettings", model: "ModelSettings", task: str, where: str,
                    model_key: str, source: str | None) -> None:
    """training.finetune against model.initialise, quantization, strategy and the task (training_setup's rule)."""
    problem = finetune_problem(training, model.initialise, task)
    if problem is not None:
        key, message = problem
        raise ConfigError(key.replace("model", model_key, 1) if key.startswith("model.")
                          else where + key.removeprefix("training"), message, source)


GOLD_ROWS_SAMPLED = 5  # the first gold answers of each local split read at parse time (the whole file is normalise's)


def check_gold_graphs(dataset, source: str | None = None) -> None:
    """A graph metric (smatch, smatchpp as ``metric`` or in ``also_metrics``) on a local dataset whose gold answers
    are no graphs (a QA set's '25.5'): refused at parse time, naming the dataset, file, row and key, where the first
    gold answers of a split can be read then and none of the first :data:`GOLD_ROWS_SAMPLED` is a PENMAN graph.
    The sample is read with the ``penman`` reader (fast to import, where smatchpp costs a second at every parse);
    normalise checks every gold answer with the metric's own reader (``unreadable_gold``)."""
    from workflow_scripts.data import raw_records, split_layouts
    from workflow_scripts.data.rows import csv_list
    from workflow_scripts.tasks.metrics import GRAPH_METRICS

    parsing = [(key, metric) for key, metric in [("metric", dataset.metric)] + [("also_metrics", m) for m in dataset.also_metrics]
               if metric in GRAPH_METRICS]
    answers = dataset.fields.get("answers")
    if not parsing or dataset.source.type != "local" or not answers or split_layouts.layout(dataset):
        return
    for canonical in ("train", "validation", "test"):
        split = dataset.splits.get(canonical)
        if split is None or canonical in dataset.unlabelled:
            continue
        try:
            files = split_layouts.local_files(dataset, split)
            sample = _gold_sample(files, dataset, answers, raw_records, csv_list)
        except (WorkflowError, OSError):
            continue  # a missing or unreadable file is named by the split checks and by normalise
        if sample and not any(_penman_graph(gold) for _, _, gold in sample):
            file, place, gold = sample[0]
            key, metric = parsing[0]
            raise ConfigError(f"datasets.{dataset.name}.{key}", f"is {metric}, which scores AMR graphs in PENMAN "
                              f"notation, but the gold answers of split '{split}' are no graphs: {file} {place}, field "
                              f"'{answers}': {gold[:60]!r} (and the first {len(sample)} alike); score the dataset with a "
                              "metric for its answers (exact_match, token_f1, relaxed_accuracy...)", source)


def _gold_sample(files, dataset, answers: str, raw_records, csv_list) -> list[tuple[str, Any, str]]:
    """(file, place, gold answer) of the first gold answers of a split's files."""
    sample = []
    for path in files:
        if not Path(path).is_file():
            continue
        for place, record in raw_records.read_placed(path, dataset.format, "reject_row", dataset.encoding):
            if not isinstance(record, Mapping) or record.get(answers) is None:
                continue
            value = csv_list(record[answers], answers) if dataset.format in ("csv", "tsv") else record[answers]
            golds = value if isinstance(value, list) else [value]
            sample += [(str(path), place, gold) for gold in golds[:1] if isinstance(gold, str)]
            if len(sample) >= GOLD_ROWS_SAMPLED:
                return sample
    return sample


def _penman_graph(text: str) -> bool:
    from workflow_scripts.data.raw_records import penman_graph_problem

    return penman_graph_problem(text) is None
@functools.lru_cache(maxsize=1)
def _training_keys() -> frozenset[str]:
    """Every key a training block may hold: the schema's ``training_settings``, with or without a default."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    return frozenset(schema["$defs"]["training_settings"]["properties"])


def where_set(config: Mapping[str, Any], model: str, variant: str, name: str) -> str:
    """The training block that sets ``name`` for this (model, variant), as resolved_training merges them
    (the variant's over the model's over the shared one): its key, for messages."""
    model_key = "model" if "model" in config else f"models.{model}"
    layers = ((f"variants.{variant}.training", config["variants"][variant].get("training", {})),
              (f"{model_key}.training", models(config)[model].get("training", {})))
    return next((f"{key}.{name}" for key, layer in layers if name in layer), f"training.{name}")


def _check_gpu_only_switches(config: Mapping[str, Any], model: str, variant: str, training: "TrainingSettings",
                             source: str | None) -> None:
    """activation_offloading on a CPU run: the activations live in host memory already, so it would only copy
    them (TrainingSettings refuses the CUDA-only kernels alike; a stage run by hand on CPU is still allowed)."""
    if training.activation_offloading and training.gpus == 0:
        raise ConfigError(where_set(config, model, variant, "activation_offloading"),
                          "is true but training.gpus is 0: offloading moves the checkpointed activations from GPU "
                          "memory to host memory, where a CPU run keeps them already, so it would do nothing; set "
                          "activation_offloading: false, or train on GPUs (training.gpus > 0)", source)


def _check_target_templates(typed_variants: Mapping[str, Any], source: str | None) -> None:
    """What a target teaches the model to write: no list's Python text, and the extractor's marker.

    Runs after each task's own template checks (their syntax and fields)."""
    from workflow_scripts.tasks import templates

    for name, variant in typed_variants.items():
        if not variant.target:
            continue
        pieces = templates.parse_template(variant.target)
        if "answers" in {field for _, field in pieces}:
            raise ConfigError(f"variants.{name}.target", "{answers} is the list of gold answers, which renders as "
                              "its Python text (['64'], brackets and quotes included), so the model would learn to "
                              "write that; use {answer} (the first gold answer)", source)
        marker = variant.extractor.marker
        # The literal text joined (fields left out): a marker written across a field is not refused.
        if variant.extractor.type == "section" and marker and marker not in "".join(text for text, _ in pieces):
            raise ConfigError(f"variants.{name}.extractor.marker", f"{marker!r} never occurs in the target "
                              f"{variant.target!r}, so the model is never taught to write it and every prediction "
                              "would be unparseable; use the text the target puts before {answer} as the marker "
                              "(e.g. 'Task 2:'), or add it to the target", source)


def _check_detectable_effect(config: Mapping[str, Any], comparison: ComparisonSettings, source: str | None) -> None:
    """min_detectable_effect is in the metric's units: on a [0, 1] metric no difference of two variants reaches 1,
    so a threshold of 1 or more (points meant as a fraction) would never bind."""
    from workflow_scripts.analysis.power import UNBOUNDED_METRICS

    threshold = comparison.min_detectable_effect
    if threshold is None or threshold < 1:
        return
    bounded = {name: dataset["metric"] for name, dataset in config["datasets"].items()
               if dataset["metric"] not in UNBOUNDED_METRICS}
    if bounded:
        name = sorted(bounded)[0]
        raise ConfigError("comparison.min_detectable_effect", f"is {threshold:g}, but dataset '{name}' is scored by "
                          f"{bounded[name]}, in [0, 1], where no difference between two variants reaches 1, so the "
                          f"threshold would never stop a run; give it as a fraction of the metric's range (e.g. "
                          f"{threshold / 100:g} for {threshold:g} points)", source)

