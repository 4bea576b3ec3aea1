"""Loading, validating and resolving the experiment configuration.

The Snakefile first calls :func:`check_workflow_config` (each config file re-read with
:class:`StrictLoader`, which refuses duplicate keys, then the schema with one-line messages), validates
``config`` with ``snakemake.utils.validate`` (which fills schema defaults) and then calls
:func:`check_config` for the checks a JSON schema cannot express. Scripts and tests use
:func:`load_config`, which does all of this the same way.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import yaml

from workflow_scripts.core.config_schema import SCHEMA_PATH, _validator_with_defaults, schema_error
from workflow_scripts.core.errors import ConfigError

if TYPE_CHECKING:
    from workflow_scripts.core.settings import TrainingSettings, ValidationSettings

CANONICAL_FIELDS = ("id", "question", "answers", "answer")
BATCH_SHAPE_KEYS = ("effective_batch", "micro_batch", "gpus", "nodes", "cpu_processes")


def validate_schema(config: dict, source: str | None = None) -> dict:
    """Validate against config/schema.yaml in place, filling defaults; raise ConfigError on the first fault."""
    from jsonschema.exceptions import best_match

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    validator_class = _validator_with_defaults()
    # Defaults are set on the way down, so nested objects created by a default get theirs too.
    errors = list(validator_class(schema).iter_errors(config))
    if errors:
        raise schema_error(best_match(errors), None, source)
    if isinstance(config, dict) and ("model" in config) == ("models" in config):
        raise ConfigError("model", "give the base model under model: (one) or under models: (several, by name), "
                          "not both" if "model" in config else "required, but missing: give the base model under "
                          f"model: (one) or models: (several, by name) (the config has keys {sorted(config)})", source)
    return config


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping names the same key twice (plain PyYAML would silently keep the last)."""

    def __init__(self, key_path: tuple[str, ...], first_line: int, mark):
        super().__init__(problem=f"duplicate key {key_path[-1]!r} (first at line {first_line})", problem_mark=mark)
        self.key_path = key_path
        self.first_line = first_line
        self.line = mark.line + 1


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, at any depth.

    Plain PyYAML keeps the last of two equal keys, so a second dataset or variant with the same name
    silently replaces the first. Merge keys (``<<: *anchor``) may still be overridden, as YAML intends.
    """

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        self._refuse_duplicate_keys(node)
        return self.construct_document(node)

    def _refuse_duplicate_keys(self, root) -> None:
        pending, visited = [(root, ())], set()
        while pending:
            node, path = pending.pop()
            if id(node) in visited:  # an alias: already checked (and may be recursive)
                continue
            visited.add(id(node))
            if isinstance(node, yaml.SequenceNode):
                pending.extend((item, path + (str(index),)) for index, item in enumerate(node.value))
            elif isinstance(node, yaml.MappingNode):
                first_lines: dict[Any, int] = {}
                for key_node, value_node in node.value:
                    if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node)
                    key_path = path + (str(key_node.value),)
                    try:
                        if key in first_lines:
                            raise DuplicateKeyError(key_path, first_lines[key], key_node.start_mark)
                        first_lines[key] = key_node.start_mark.line + 1
                    except TypeError:  # an unhashable key: construct_mapping explains it
                        continue
                    pending.append((value_node, key_path))


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line with its 1-based line and column, without PyYAML's multi-line snippet."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        text = f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
        if error.context:
            context = f"{error.context}"
            if error.context_mark is not None:
                context += f" at line {error.context_mark.line + 1}, column {error.context_mark.column + 1}"
            text += f" ({context})"
    elif isinstance(error, yaml.reader.ReaderError):
        text = f"not valid YAML: {error.reason} at character {error.position + 1}"
    else:
        text = f"not valid YAML: {error}"
    return " ".join(text.split())


def read_config_file(path: str | Path) -> dict:
    """A YAML (or JSON) config file as a mapping, read with :class:`StrictLoader`; ConfigError in one line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("<file>", "config file not found", str(path)) from None
    except UnicodeDecodeError as error:
        raise ConfigError("<file>", f"not UTF-8 text (byte {error.start + 1})", str(path)) from None
    try:
        config = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
    except DuplicateKeyError as error:
        raise ConfigError(
            ".".join(error.key_path),
            f"line {error.line}: key '{error.key_path[-1]}' is given twice (first at line {error.first_line}); "
            "YAML would silently keep only the last, so remove or rename one",
            str(path),
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError("<file>", _yaml_problem(error), str(path)) from None
    if not isinstance(config, dict):
        raise ConfigError("<top level>", "the config must be a mapping", str(path))
    return config


def check_workflow_config(configfiles: Iterable[str | Path], config: dict) -> None:
    """For the Snakefile, before ``snakemake.utils.validate``: the checks Snakemake's own reading skips.

    Snakemake reads config files with plain PyYAML (the last of two equal keys wins) and reports a schema
    fault as a multi-line dump of the whole config; this re-reads each file strictly and validates
    ``config`` with one-line messages that never echo a secret (defaults filled the same way).
    """
    from_files: dict = {}
    for path in configfiles:
        from_files = deep_merge(from_files, read_config_file(path))  # in order, as Snakemake merges them
    retype_command_line_values(config, from_files)
    _refuse_misplaced_command_line_keys(config, from_files)
    validate_schema(config, "config")


def _refuse_misplaced_command_line_keys(config: Mapping[str, Any], from_files: Mapping[str, Any]) -> None:
    """A ``--config`` key that is no top-level setting but a key of a section (``max_steps=10``) names
    the form that works: Snakemake takes no dotted keys (``training.max_steps=10`` stops in its own
    command-line parsing, before the workflow is read), only a section with a mapping."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    sections = {}
    for section, spec in schema["properties"].items():
        if "$ref" in spec:
            spec = schema["$defs"][spec["$ref"].rsplit("/", 1)[-1]]
        sections[section] = spec.get("properties", {})
    for key, value in config.items():
        owners = [section for section, keys in sections.items() if key in keys]
        if key in sections or key in from_files or not owners:
            continue
        shown = value if isinstance(value, str) else json.dumps(value)  # as YAML reads it back
        forms = " or ".join(f"--config '{section}={{{key}: {shown}}}'" for section in owners)
        raise ConfigError(key, f"is not a top-level setting but a key of {' or '.join(owners)}; set it with "
                               f"{forms} (Snakemake takes no dotted keys)", "--config")


def retype_command_line_values(config: dict, from_files: Mapping[str, Any]) -> None:
    """Give ``--config`` values inside a list or mapping the types YAML would give them, where the schema
    asks for that type (in place, before validation).

    Snakemake reads ``--config seeds=[1,2]`` or ``--config 'training={max_steps: 10}'`` with YAML's
    BaseLoader, so every number inside arrives as text ('1', '10') and the schema would refuse it.
    Only values that differ from the config files are touched, and only where the schema refuses the
    text and accepts the number, boolean or null it spells; other text stays text.
    """
    from jsonschema import Draft202012Validator

    texts = dict(_command_line_texts(config, from_files, ()))
    if not texts:
        return
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    for _ in range(len(texts)):  # each pass fixes at least one value, or stops
        fixed = False
        for error in _validator_with_defaults()(schema).iter_errors(copy.deepcopy(config)):
            path = tuple(error.absolute_path)
            if error.validator != "type" or path not in texts:
                continue
            value = _yaml_scalar(texts.pop(path))
            wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
            if any(Draft202012Validator(schema).is_type(value, kind) for kind in wanted):
                parent = config
                for part in path[:-1]:
                    parent = parent[part]
                parent[path[-1]] = value
                fixed = True
        if not fixed:
            return


def _command_line_texts(value: Any, in_files: Any, path: tuple) -> Iterator[tuple[tuple, str]]:
    """(path, text) of the strings inside ``value`` that the config files do not give (so --config did)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            inner = in_files.get(key) if isinstance(in_files, Mapping) else None
            yield from _command_line_texts(item, inner, path + (key,))
    elif value == in_files:
        return
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _command_line_texts(item, None, path + (index,))
    elif isinstance(value, str) and len(path) > 1:  # a top-level value Snakemake has typed already
        yield path, value


def _yaml_scalar(text: str) -> Any:
    """What YAML makes of ``text`` (``1e-4`` too, which YAML 1.1 keeps as text), else the text."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return text
    return value


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict:
    """Read a YAML config with :class:`StrictLoader` (a SafeLoader), validate it, fill defaults and check consistency."""
    path = Path(path)
    config = read_config_file(path)
    if overrides:
        config = deep_merge(config, overrides)
    validate_schema(config, str(path))
    check_config(config, str(path))
    return config


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict:
    """Return ``base`` with ``override`` merged in recursively (override wins)."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def resolved_training(config: Mapping[str, Any], variant: str, model: str | None = None) -> dict:
    """Shared training settings, then the model's overrides, then the variant's (the last wins).

    ``model`` None: the config's only model (a config with several models must name one).
    """
    spec = model_settings(config, model)
    with_model = deep_merge(config["training"], spec.get("training", {}))
    return deep_merge(with_model, config["variants"][variant].get("training", {}))


RESERVED_MODEL_NAMES = ("data", "plots", "benchmarks")


def models(config: Mapping[str, Any]) -> dict[str, dict]:
    """name -> model settings: ``models:``, or the single ``model:`` under its own name."""
    if "models" in config:
        return {name: dict(spec) for name, spec in config["models"].items()}
    return {config["model"]["name"]: dict(config["model"])}


def model_settings(config: Mapping[str, Any], model: str | None = None) -> dict:
    """One model's settings as prepare_model receives them (with its name)."""
    all_models = models(config)
    if model is None:
        if len(all_models) != 1:
            raise ConfigError("models", f"several models ({sorted(all_models)}): name the model", None)
        model = next(iter(all_models))
    return {**all_models[model], "name": model}


def dataset_models(config: Mapping[str, Any], dataset: str) -> list[str]:
    """The models a dataset (or a mixture) runs on: its ``models:`` list, or every model."""
    entry = config["datasets"].get(dataset) or mixtures(config)[dataset]
    return list(entry.get("models") or models(config))


def mixtures(config: Mapping[str, Any]) -> dict[str, dict]:
    return dict(config.get("mixtures") or {})


def entry_task(config: Mapping[str, Any], entry: str) -> str:
    """The task of a dataset, or of a mixture (its components' task)."""
    if entry in config["datasets"]:
        return config["datasets"][entry]["task"]
    return config["datasets"][mixtures(config)[entry]["datasets"][0]]["task"]


def trains_alone(dataset: Mapping[str, Any]) -> bool:
    """A dataset trains on its own unless it is evaluation-only (no train split) or ``train_alone: false``."""
    return "train" in dataset["splits"] and dataset.get("train_alone", True)


def training_entries(config: Mapping[str, Any]) -> list[str]:
    """What a run trains on: each dataset that trains alone, then each mixture."""
    return [name for name, dataset in config["datasets"].items() if trains_alone(dataset)] + list(mixtures(config))


def evaluated_datasets(config: Mapping[str, Any], entry: str, model: str) -> list[str]:
    """The datasets a model trained on ``entry`` is scored on: the dataset itself (or the mixture's
    components), then every evaluation-only dataset of the same task that runs on ``model``."""
    own = mixtures(config)[entry]["datasets"] if entry in mixtures(config) else [entry]
    task = entry_task(config, entry)
    evaluation_only = [name for name, dataset in config["datasets"].items()
                       if "train" not in dataset["splits"] and dataset["task"] == task
                       and model in dataset_models(config, name)]
    return list(own) + evaluation_only


def cross_contamination_datasets(config: Mapping[str, Any], entry: str) -> tuple[list[str], list[str]]:
    """(trained datasets, checked datasets) of the check across datasets for a run on ``entry``: each
    component of a mixture against the others' train rows, and each evaluation-only dataset the run is
    scored on against every trained dataset. ([], []) when the run trains and is scored on one dataset."""
    trained = list(mixtures(config)[entry]["datasets"]) if entry in mixtures(config) else [entry]
    evaluation_only = [name for model in dataset_models(config, entry)
                       for name in evaluated_datasets(config, entry, model) if name not in trained]
    checked = (trained if len(trained) > 1 else []) + list(dict.fromkeys(evaluation_only))
    return (trained, checked) if checked else ([], [])


def training_settings(config: Mapping[str, Any], variant: str, model: str | None = None,
                      source: str | None = None) -> "TrainingSettings":
    """One (model, variant)'s resolved training settings, validated and typed (core.settings).

    A refusal names the key where the user set it: the batch shape under the variant's or the model's
    ``training`` when one of them sets a batch-shape key, any other key under the variant's ``training``
    when the variant overrides training, else ``training``.
    """
    from workflow_scripts.core.settings import TrainingSettings

    spec = model_settings(config, model)
    variant_training = config["variants"][variant].get("training", {})
    where = f"variants.{variant}.training" if variant_training else "training"
    model_key = "model" if "model" in config else f"models.{spec['name']}"
    layers = ((f"variants.{variant}.training", variant_training), (f"{model_key}.training", spec.get("training", {})))
    batch_key = next((key for key, layer in layers if set(BATCH_SHAPE_KEYS) & set(layer)), "training")
    return TrainingSettings.parse(resolved_training(config, variant, model), where, source, batch_key)


def experiments(config: Mapping[str, Any]) -> Iterator[tuple[str, str, str, int]]:
    """The training matrix: every (model, entry, variant of the entry's task, seed); an entry is a dataset
    that trains alone or a mixture."""
    for model, entry, variant in model_entry_variants(config):
        for seed in config["seeds"]:
            yield model, entry, variant, seed


def evaluations(config: Mapping[str, Any]) -> Iterator[tuple[str, str, str, int, str]]:
    """Every (model, entry, variant, seed, evaluated dataset): each experiment on each dataset it is scored on."""
    for model, entry, variant, seed in experiments(config):
        for dataset in evaluated_datasets(config, entry, model):
            yield model, entry, variant, seed, dataset


def model_entry_variants(config: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """Every (model, entry, variant) with the variant of the entry's task and the model among the entry's."""
    for entry in training_entries(config):
        for variant, variant_config in config["variants"].items():
            if variant_config.get("task", "generation") == entry_task(config, entry):
                for model in dataset_models(config, entry):
                    yield model, entry, variant


def model_dataset_variants(config: Mapping[str, Any]) -> Iterator[tuple[str, str, str]]:
    """Every (model, evaluated dataset, variant) of the matrix: where the untrained model is scored too."""
    seen = dict.fromkeys((model, dataset, variant) for model, _, variant, _, dataset in evaluations(config))
    yield from seen


def trained_datasets(config: Mapping[str, Any], model: str) -> list[str]:
    """The datasets whose train splits ``model`` trains on, alone or in a mixture (a tiny model's tokenizer
    learns from these: never from an evaluation-only dataset)."""
    names = []
    for entry in dict.fromkeys(entry for m, entry, _ in model_entry_variants(config) if m == model):
        names += mixtures(config)[entry]["datasets"] if entry in mixtures(config) else [entry]
    return list(dict.fromkeys(names))


def evaluation_subdirectory(trained: str, dataset: str) -> str:
    """Where an experiment's evaluation on ``dataset`` lies inside its run directory."""
    return "" if trained == dataset else f"on_{dataset}"


def plot_names(model: str, trained: str, dataset: str) -> tuple[str, str]:
    """The score plot of one (model, trained on, dataset) group and the loss plot of its training runs."""
    scores = f"scores_{model}_{dataset}.png" if trained == dataset else f"scores_{model}_{trained}_on_{dataset}.png"
    return scores, f"loss_{model}_{trained}.png"


def dataset_fields(dataset: Mapping[str, Any]) -> set[str]:
    """Fields a normalised row of this dataset offers to templates."""
    return set(CANONICAL_FIELDS) | set(dataset.get("extra_fields", {})) | set(dataset.get("derived", {}))


def gold_fields(dataset: Mapping[str, Any]) -> dict[str, str]:
    """Fields of this dataset's rows that are, or are computed from, the gold answers -> why (for messages).

    ``answer``/``answers`` themselves, an extra field carrying the answers' source field, and every derived
    field whose input is one of these (transitively: a derived field may take an earlier derived field).
    """
    gold = {"answer": "is the first gold answer", "answers": "holds the gold answers"}
    answers_source = dataset.get("fields", {}).get("answers")
    for name, source_field in dataset.get("extra_fields", {}).items():
        if source_field == answers_source:
            gold[name] = f"carries source field '{source_field}', the gold answers"
    chains: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, spec in dataset.get("derived", {}).items():
            if name not in gold and spec["field"] in gold:
                step = f"{name} = {spec['transform']}({spec['field']})"
                chains[name] = f"{step}, {chains[spec['field']]}" if spec["field"] in chains else step
                gold[name] = f"is derived from the gold answer ({chains[name]})"
                changed = True
    return gold


def check_config(config: Mapping[str, Any], source: str | None = None) -> None:
    """Checks beyond the JSON schema; each failure names the key and the fix."""
    from workflow_scripts.core.errors import WorkflowError
    from workflow_scripts.tasks import check_also_metrics, task_named

    if ("model" in config) == ("models" in config):
        raise ConfigError("model", "give the base model under model: (one) or under models: (several, by name), "
                          "not both" if "model" in config else "missing: give the base model under model: "
                          "(one) or models: (several, by name)", source)
    for name, model in models(config).items():
        key = "model" if "model" in config else f"models.{name}"
        if name in RESERVED_MODEL_NAMES:  # results/{model}/... sits beside these folders
            raise ConfigError(f"{key}.name" if "model" in config else key,
                              f"'{name}' is reserved for results/{name}/; choose another model name", source)
        _check_model(model, source, key)
        unknown = set(model.get("training", {})) - set(config["training"])
        if unknown:
            raise ConfigError(f"models.{name}.training", f"unknown training keys {sorted(unknown)}", source)
    for name, dataset in config["datasets"].items():
        _check_dataset(name, dataset, source, evaluation_split(config, name))
        if dataset.get("also_metrics"):
            check_also_metrics(name, dataset, source)
        for model in dataset.get("models", []):
            if model not in models(config):
                raise ConfigError(f"datasets.{name}.models", f"'{model}' is not a model of this config "
                                  f"(models: {sorted(models(config))})", source)
    training_keys = set(config["training"])
    for name, variant in config["variants"].items():
        key = f"variants.{name}"
        unknown = set(variant.get("training", {})) - training_keys
        if unknown:
            raise ConfigError(f"{key}.training", f"unknown training keys {sorted(unknown)}", source)
        task = task_named(variant["task"])
        datasets = {ds: d for ds, d in config["datasets"].items() if d["task"] == variant["task"]}
        try:  # the task's own checks: templates against each dataset of its task, leaks of the gold
            task.check_config_variant(name, variant_settings(variant), datasets)
        except ConfigError as error:
            raise ConfigError(error.key, error.problem, source) from None
        except WorkflowError as error:
            raise ConfigError(key, str(error), source) from None
        for model in models(config):
            training_settings(config, name, model, source)  # the schema, the batch shape and the length
    _check_mixtures(config, source)
    _check_evaluated(config, source)
    for model, entry, variant in model_entry_variants(config):
        training = training_settings(config, variant, model, source)
        _check_finetune(training, models(config)[model], entry_task(config, entry),
                        f"variants.{variant}.training" if config["variants"][variant].get("training") else "training",
                        "model" if "model" in config else f"models.{model}", source)
        for dataset in mixtures(config)[entry]["datasets"] if entry in mixtures(config) else [entry]:
            if training.validating and "validation" not in config["datasets"][dataset]["splits"]:
                raise ConfigError("training.validation.every_steps", f"dataset '{dataset}' has no validation split "
                                  f"(datasets.{dataset}.splits), so there is no held-out loss to compute; add one or "
                                  "switch validation off for it with a variant's training override", source)
        _check_validation_metric(config, entry, training.validation, source)
    tasks_in_use = {dataset["task"] for dataset in config["datasets"].values()}
    for task_name in sorted(tasks_in_use):
        if not any(variant["task"] == task_name for variant in config["variants"].values()):
            raise ConfigError("variants", f"no variant has task '{task_name}', so its datasets would not run; "
                              f"add one with task: {task_name}", source)
        reference = reference_variant(config, task_name)
        if reference not in config["variants"] or config["variants"][reference]["task"] != task_name:
            choices = sorted(v for v, settings in config["variants"].items() if settings["task"] == task_name)
            raise ConfigError("comparison.reference_variant",
                              f"'{reference}' is not one of the {task_name} variants {choices}; with variants of "
                              "several tasks give a mapping, e.g. {generation: baseline, classification: plain}", source)
        for model in models(config):
            _check_fair_training(config, task_name, reference, source, model)
    running = {model for model, _, _ in model_entry_variants(config)}
    for name in models(config):
        if name not in running:
            raise ConfigError("model" if "model" in config else f"models.{name}", f"no dataset or mixture trains "
                              f"on '{name}' (their models: lists leave it out), so it would silently drop out of the "
                              f"matrix; add '{name}' to the models: list of a dataset or mixture, or remove it", source)
    if config["evaluation"]["gpus"] > 1:  # evaluate decodes on cuda:0 alone; the rest would sit reserved
        raise ConfigError("evaluation.gpus", f"is {config['evaluation']['gpus']}, but evaluation runs on one GPU "
                          "(the others would be reserved and idle); set evaluation.gpus: 1 (or 0 for the CPU)", source)


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


def evaluation_split(config: Mapping[str, Any], dataset: str) -> str:
    """The split evaluate scores for ``dataset``: its own ``evaluation_split``, else the evaluation section's."""
    return config["datasets"][dataset].get("evaluation_split") or config["evaluation"]["split"]


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


def variant_settings(variant: Mapping[str, Any]) -> dict[str, Any]:
    """What a stage receives as ``--variant``: the variant without its task and training overrides."""
    return {k: v for k, v in variant.items() if k not in ("task", "training")}


def reference_variant(config: Mapping[str, Any], task: str) -> str | None:
    """The variant the others of ``task`` are compared with (comparison.reference_variant: a name or task -> name)."""
    reference = config["comparison"]["reference_variant"]
    return reference.get(task) if isinstance(reference, Mapping) else reference


def _check_fair_training(config: Mapping[str, Any], task: str, reference: str, source: str | None,
                         model: str | None = None) -> None:
    """The fairness guard at parse time: the variants of one task train alike, up to intended differences.

    ``compare`` would refuse the finished runs anyway; refusing here saves the GPU hours between.
    Variants are compared with their task's reference variant (not with the shared block, so all
    classification variants may override, say, the LoRA targets the same way).
    """
    from workflow_scripts.analysis import fairness
    from workflow_scripts.tasks import task_named

    intended = config["comparison"].get("intended_differences", [])

    def comparable(variant: str) -> dict[str, Any]:
        settings = resolved_training(config, variant, model)
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
                raise ConfigError(
                    f"variants.{name}.{key}",
                    f"sets {mine!r} where the reference variant '{reference}' uses {theirs!r}, so the comparison "
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


def _check_finetune(training: "TrainingSettings", model: Mapping[str, Any], task: str, where: str,
                    model_key: str, source: str | None) -> None:
    """training.finetune against model.initialise, quantization, strategy and the task (training_setup's rule)."""
    from workflow_scripts.core.settings import finetune_problem

    problem = finetune_problem(training, model.get("initialise", "pretrained"), task)
    if problem is not None:
        key, message = problem
        raise ConfigError(key.replace("model", model_key, 1) if key.startswith("model.")
                          else where + key.removeprefix("training"), message, source)


def _require(mapping: Mapping[str, Any], keys: tuple[str, ...], prefix: str, why: str, source: str | None) -> None:
    for key in keys:
        if not mapping.get(key):
            raise ConfigError(f"{prefix}.{key}", f"required {why}", source)


MOVING_REVISIONS = ("main", "master", "head")


def _check_pinned(revision: Any, key: str, source: str | None) -> None:
    """A branch name moves: the same config would fetch different weights or rows next month."""
    if isinstance(revision, str) and revision.strip().lower() in MOVING_REVISIONS:
        raise ConfigError(key, f"'{revision}' is a branch, not a pinned revision; use a commit hash or a tag", source)


def _check_model(model: Mapping[str, Any], source: str | None, key: str = "model") -> None:
    needs = {"hub": ("hub_id", "revision"), "local": ("path",), "gguf": ("gguf",), "tiny": ()}[model["source"]]
    _require(model, needs, key, f"when {key}.source is '{model['source']}'", source)
    if model["source"] == "hub":
        _check_pinned(model["revision"], f"{key}.revision", source)


def _check_dataset(name: str, dataset: Mapping[str, Any], source: str | None,
                   evaluated_split: str | None = None) -> None:
    """``evaluated_split``: the split evaluate scores for this dataset (its own, else the evaluation
    section's), when the whole config is known; alone, the dataset's own ``evaluation_split`` if set."""
    _check_unlabelled(name, dataset, source, evaluated_split or dataset.get("evaluation_split"))
    src = dataset["source"]
    for canonical, split in dataset["splits"].items():  # a split is one file <split>.<format> (or a hub split)
        if "/" in split or "\\" in split or split.startswith(".") or not split.strip():
            raise ConfigError(f"datasets.{name}.splits.{canonical}", f"'{split}' cannot be a split name: a split is "
                              "one file <split>.<format> in the source directory (or a hub split), so it holds no "
                              "folder, no '/' and does not start with '.'; put the split's file beside the others "
                              "and name it by its file name without the suffix", source)
    needs = {"hub": ("id", "revision"), "url": ("url", "sha256"), "local": ("path",)}[src["type"]]
    _require(src, needs, f"datasets.{name}.source", f"when source.type is '{src['type']}'", source)
    if src["type"] == "hub":
        _check_pinned(src["revision"], f"datasets.{name}.source.revision", source)
    from workflow_scripts.data.transforms import TRANSFORMS

    for field, spec in dataset.get("derived", {}).items():
        if spec["transform"] not in TRANSFORMS:
            raise ConfigError(
                f"datasets.{name}.derived.{field}.transform",
                f"unknown transform '{spec['transform']}'; known: {sorted(TRANSFORMS)}",
                source,
            )


def _check_unlabelled(name: str, dataset: Mapping[str, Any], source: str | None, evaluated_split: str | None) -> None:
    """An unlabelled split (no gold: predicted for a leaderboard, never scored) is a test split of this
    dataset, of a task that can predict without gold, and not the split evaluate scores."""
    unlabelled = dataset.get("unlabelled") or []
    key = f"datasets.{name}.unlabelled"
    for split in unlabelled:
        if split not in dataset["splits"]:
            raise ConfigError(key, f"'{split}' is not a split of the dataset (datasets.{name}.splits: "
                              f"{sorted(dataset['splits'])}); list only its own splits", source)
        if split != "test":
            raise ConfigError(key, f"'{split}' cannot be unlabelled: training and its held-out loss read the gold of "
                              "train and validation; only test may be unlabelled", source)
    if not unlabelled:
        return
    from workflow_scripts.tasks import task_named

    if not hasattr(task_named(dataset["task"]), "predict"):
        raise ConfigError(key, f"task '{dataset['task']}' cannot predict an unlabelled split (generation, "
                          "vision_language and classification can); remove the key", source)
    if evaluated_split in unlabelled:
        raise ConfigError(f"datasets.{name}.evaluation_split", f"the dataset is evaluated on '{evaluated_split}', which "
                          f"is unlabelled (nothing to score); set datasets.{name}.evaluation_split: validation", source)


def validate_section(value: Any, section: str, key: str, source: str | None = None) -> dict:
    """Validate one dataset's or the model's settings (as a stage receives them), filling defaults.

    ``section`` is ``"datasets"`` or ``"model"``; stages called without Snakemake get the same
    defaults and the same checks as the Snakefile applies to the whole config.
    """
    from jsonschema.exceptions import best_match

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    part = schema["properties"][section]
    if section == "datasets":
        part = part["additionalProperties"]
    part = {**part, "$defs": schema["$defs"]}
    value = copy.deepcopy(value)
    errors = list(_validator_with_defaults()(part).iter_errors(value))
    if errors:
        raise schema_error(best_match(errors), key, source)
    if section == "datasets":
        _check_dataset(key.split(".")[-1], value, source)
    else:
        _check_model(value, source)
    return value
