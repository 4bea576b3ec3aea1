"""The experiment matrix and each run's resolved settings, read from a validated config.

What runs: every (model, entry, variant of the entry's task, seed), where an entry is a dataset that
trains alone or a mixture, and each run's evaluated datasets; where its outputs lie; and each (model,
variant)'s training settings, merged (shared, then the model's, then the variant's) and typed
(core.settings). Reading and validating the config is ``core/config_files``; the checks beyond the
schema are ``workflow_scripts/checks/``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping

from workflow_scripts.core.config_files import deep_merge
from workflow_scripts.core.errors import ConfigError

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings, ModelSettings, VariantSettings
    from workflow_scripts.core.settings import TrainingSettings

CANONICAL_FIELDS = ("id", "question", "answers", "answer")
BATCH_SHAPE_KEYS = ("effective_batch", "micro_batch", "micro_batch_tokens", "gpus", "nodes", "cpu_processes")


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


def model_key(config: Mapping[str, Any], name: str) -> str:
    """The key the user wrote for model ``name``: ``model`` (one model) or ``models.<name>``, for messages."""
    return "model" if "model" in config else f"models.{name}"


def model_settings(config: Mapping[str, Any], model: str | None = None) -> dict:
    """One model's settings as prepare_model receives them (with its name)."""
    all_models = models(config)
    if model is None:
        if len(all_models) != 1:
            raise ConfigError("models", f"several models ({sorted(all_models)}): name the model", None)
        model = next(iter(all_models))
    return {**all_models[model], "name": model}


def model_entries(config: Mapping[str, Any], source: str | None = None) -> dict[str, "ModelSettings"]:
    """name -> the model's typed settings (core.entry_settings), each key named as the config spells it."""
    from workflow_scripts.core.entry_settings import ModelSettings

    single = "model" in config
    return {name: ModelSettings.parse(spec, name, "model" if single else f"models.{name}", source)
            for name, spec in models(config).items()}


def dataset_entries(config: Mapping[str, Any], source: str | None = None) -> dict[str, "DatasetSettings"]:
    """name -> the dataset's typed settings (core.entry_settings)."""
    from workflow_scripts.core.entry_settings import DatasetSettings

    return {name: DatasetSettings.parse(dataset, name, source) for name, dataset in config["datasets"].items()}


def variant_entries(config: Mapping[str, Any], source: str | None = None) -> dict[str, "VariantSettings"]:
    """name -> the variant's typed settings (core.entry_settings; its training overrides are read by
    :func:`resolved_training`)."""
    from workflow_scripts.core.entry_settings import VariantSettings

    return {name: VariantSettings.parse(variant, variant.get("task", "generation"), name, source)
            for name, variant in config["variants"].items()}


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


def dataset_fields(dataset: "DatasetSettings") -> set[str]:
    """Fields a normalised row of this dataset offers to templates."""
    return set(CANONICAL_FIELDS) | set(dataset.extra_fields) | set(dataset.derived)


def gold_fields(dataset: "DatasetSettings") -> dict[str, str]:
    """Fields of this dataset's rows that are, or are computed from, the gold answers -> why (for messages).

    ``answer``/``answers`` themselves, an extra field carrying the answers' source field, and every derived
    field whose input is one of these (transitively: a derived field may take an earlier derived field).
    """
    gold = {"answer": "is the first gold answer", "answers": "holds the gold answers"}
    answers_source = dataset.fields.get("answers")
    for name, source_field in dataset.extra_fields.items():
        if source_field == answers_source:
            gold[name] = f"carries source field '{source_field}', the gold answers"
    chains: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, spec in dataset.derived.items():
            if name not in gold and spec.field in gold:
                step = f"{name} = {spec.transform}({spec.field})"
                chains[name] = f"{step}, {chains[spec.field]}" if spec.field in chains else step
                gold[name] = f"is derived from the gold answer ({chains[name]})"
                changed = True
    return gold


def evaluation_split(config: Mapping[str, Any], dataset: str) -> str:
    """The split evaluate scores for ``dataset``: its own ``evaluation_split``, else the evaluation section's."""
    return config["datasets"][dataset].get("evaluation_split") or config["evaluation"]["split"]


def variant_settings(variant: Mapping[str, Any]) -> dict[str, Any]:
    """What a stage receives as ``--variant``: the variant without its task and training overrides."""
    return {k: v for k, v in variant.items() if k not in ("task", "training")}
