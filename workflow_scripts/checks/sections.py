"""One model's or one dataset's typed settings checked beyond the schema (required keys per source, pinned
revisions, split names, transforms, unlabelled splits); :func:`dataset_argument` and :func:`model_argument`
give a stage run by hand the same typed settings, defaults and checks as the Snakefile applies to the whole config.
"""
from __future__ import annotations

from typing import Any

from workflow_scripts.core.entry_settings import DatasetSettings, ModelSettings
from workflow_scripts.core.errors import ConfigError, WorkflowError


def _require(settings: Any, keys: tuple[str, ...], prefix: str, why: str, source: str | None) -> None:
    for key in keys:
        if not getattr(settings, key):
            raise ConfigError(f"{prefix}.{key}", f"required {why}", source)


MOVING_REVISIONS = ("main", "master", "head")


def _check_pinned(revision: Any, key: str, source: str | None) -> None:
    """A branch name moves: the same config would fetch different weights or rows next month."""
    if isinstance(revision, str) and revision.strip().lower() in MOVING_REVISIONS:
        raise ConfigError(key, f"'{revision}' is a branch, not a pinned revision; use a commit hash or a tag", source)


def check_model(model: ModelSettings, source: str | None, key: str = "model") -> None:
    needs = {"hub": ("hub_id", "revision"), "local": ("path",), "gguf": ("gguf",), "tiny": ()}[model.source]
    _require(model, needs, key, f"when {key}.source is '{model.source}'", source)
    if model.source == "hub":
        _check_pinned(model.revision, f"{key}.revision", source)


def check_dataset(dataset: DatasetSettings, source: str | None, evaluated_split: str | None = None) -> None:
    """``evaluated_split``: the split evaluate scores for this dataset (its own, else the evaluation
    section's), when the whole config is known; alone, the dataset's own ``evaluation_split`` if set."""
    name = dataset.name
    _check_unlabelled(dataset, source, evaluated_split or dataset.evaluation_split)
    src = dataset.source
    for canonical, split in dataset.splits.items():  # a split is one file <split>.<format> (or a hub split)
        if "/" in split or "\\" in split or split.startswith(".") or not split.strip():
            from workflow_scripts.data.split_names import bad_split_name_fix

            raise ConfigError(f"datasets.{name}.splits.{canonical}", f"'{split}' cannot be a split name: a split is "
                              "one file <split>.<format> in the source directory (or a hub split), so it holds no "
                              "folder, no '/' and does not start with '.'; "
                              + bad_split_name_fix(canonical, split, dataset.splits, dataset.format, dataset.task), source)
    needs = {"hub": ("id", "revision"), "url": ("url", "sha256"), "local": ("path",)}[src.type]
    _require(src, needs, f"datasets.{name}.source", f"when source.type is '{src.type}'", source)
    if src.type == "hub":
        _check_pinned(src.revision, f"datasets.{name}.source.revision", source)
    if dataset.encoding is not None:
        from workflow_scripts.data.file_formats import BINARY_FORMATS, check_encoding

        if dataset.format in BINARY_FORMATS:  # the setting would be accepted and do nothing
            raise ConfigError(f"datasets.{name}.encoding", f"format {dataset.format} is binary (its text is UTF-8 inside "
                              f"the file, as Parquet stores it), so encoding: {dataset.encoding} would do nothing; remove "
                              f"datasets.{name}.encoding", source)
        if src.type == "hub":  # likewise: load_dataset decodes the hub's files, saved as Arrow (UTF-8)
            raise ConfigError(f"datasets.{name}.encoding", f"a hub dataset is read by datasets.load_dataset, which decodes "
                              f"its files itself, so encoding: {dataset.encoding} would do nothing; remove "
                              f"datasets.{name}.encoding", source)
        try:
            check_encoding(dataset.encoding)
        except WorkflowError as error:
            raise ConfigError(f"datasets.{name}.encoding", str(error), source) from None
    from workflow_scripts.data.transforms import TRANSFORMS

    for field, spec in dataset.derived.items():
        if spec.transform not in TRANSFORMS:
            raise ConfigError(
                f"datasets.{name}.derived.{field}.transform",
                f"unknown transform '{spec.transform}'; known: {sorted(TRANSFORMS)}",
                source,
            )


def _check_unlabelled(dataset: DatasetSettings, source: str | None, evaluated_split: str | None) -> None:
    """An unlabelled split (no gold: predicted for a leaderboard, never scored) is a test split of this
    dataset, of a task that can predict without gold, and not the split evaluate scores."""
    name, unlabelled = dataset.name, dataset.unlabelled
    key = f"datasets.{name}.unlabelled"
    for split in unlabelled:
        if split not in dataset.splits:
            raise ConfigError(key, f"'{split}' is not a split of the dataset (datasets.{name}.splits: "
                              f"{sorted(dataset.splits)}); list only its own splits", source)
        if split != "test":
            raise ConfigError(key, f"'{split}' cannot be unlabelled: training and its held-out loss read the gold of "
                              "train and validation; only test may be unlabelled", source)
    if not unlabelled:
        return
    from workflow_scripts.tasks import task_named

    if not hasattr(task_named(dataset.task), "predict"):
        raise ConfigError(key, f"task '{dataset.task}' cannot predict an unlabelled split (generation, "
                          "vision_language and classification can); remove the key", source)
    if evaluated_split in unlabelled:
        raise ConfigError(f"datasets.{name}.evaluation_split", f"the dataset is evaluated on '{evaluated_split}', which "
                          f"is unlabelled (nothing to score); set datasets.{name}.evaluation_split: validation", source)


def dataset_argument(text: str, name: str, flag: str = "--dataset") -> DatasetSettings:
    """A stage's ``--dataset`` JSON typed, with the checks beyond the schema (as the Snakefile's)."""
    dataset = DatasetSettings.from_json(text, name, flag)
    check_dataset(dataset, flag)
    return dataset


def model_argument(text: str, flag: str = "--model") -> ModelSettings:
    """prepare_model's ``--model`` JSON typed, with the checks beyond the schema (as the Snakefile's)."""
    model = ModelSettings.from_json(text, flag)
    check_model(model, flag)
    return model


def validate_section(value: Any, section: str, key: str, source: str | None = None) -> dict:
    """One dataset's (``section`` "datasets", ``key`` datasets.<name>) or the model's ("model") settings as
    the rule passes them: typed and checked as above, back as the JSON mapping (to build a stage's argument)."""
    if section == "datasets":
        dataset = DatasetSettings.parse(value, key.split(".")[-1], source, key)
        check_dataset(dataset, source)
        return dataset.to_dict()
    model = ModelSettings.parse(value, None, key, source)
    check_model(model, source, key)
    return model.to_dict()
