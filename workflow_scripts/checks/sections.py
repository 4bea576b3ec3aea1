"""One model's or one dataset's settings checked beyond the schema (required keys per source, pinned
revisions, split names, transforms, unlabelled splits); :func:`validate_section` gives a stage run by hand
the same defaults and checks as the Snakefile applies to the whole config.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

import yaml

from workflow_scripts.core.config_schema import SCHEMA_PATH, _validator_with_defaults, schema_error
from workflow_scripts.core.errors import ConfigError


def _require(mapping: Mapping[str, Any], keys: tuple[str, ...], prefix: str, why: str, source: str | None) -> None:
    for key in keys:
        if not mapping.get(key):
            raise ConfigError(f"{prefix}.{key}", f"required {why}", source)


MOVING_REVISIONS = ("main", "master", "head")


def _check_pinned(revision: Any, key: str, source: str | None) -> None:
    """A branch name moves: the same config would fetch different weights or rows next month."""
    if isinstance(revision, str) and revision.strip().lower() in MOVING_REVISIONS:
        raise ConfigError(key, f"'{revision}' is a branch, not a pinned revision; use a commit hash or a tag", source)


def check_model(model: Mapping[str, Any], source: str | None, key: str = "model") -> None:
    needs = {"hub": ("hub_id", "revision"), "local": ("path",), "gguf": ("gguf",), "tiny": ()}[model["source"]]
    _require(model, needs, key, f"when {key}.source is '{model['source']}'", source)
    if model["source"] == "hub":
        _check_pinned(model["revision"], f"{key}.revision", source)


def check_dataset(name: str, dataset: Mapping[str, Any], source: str | None,
                   evaluated_split: str | None = None) -> None:
    """``evaluated_split``: the split evaluate scores for this dataset (its own, else the evaluation
    section's), when the whole config is known; alone, the dataset's own ``evaluation_split`` if set."""
    _check_unlabelled(name, dataset, source, evaluated_split or dataset.get("evaluation_split"))
    src = dataset["source"]
    for canonical, split in dataset["splits"].items():  # a split is one file <split>.<format> (or a hub split)
        if "/" in split or "\\" in split or split.startswith(".") or not split.strip():
            from workflow_scripts.data.split_names import bad_split_name_fix

            raise ConfigError(f"datasets.{name}.splits.{canonical}", f"'{split}' cannot be a split name: a split is "
                              "one file <split>.<format> in the source directory (or a hub split), so it holds no "
                              "folder, no '/' and does not start with '.'; "
                              + bad_split_name_fix(canonical, split, dataset["splits"], dataset["format"],
                                                   dataset.get("task", "generation")), source)
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
        check_dataset(key.split(".")[-1], value, source)
    else:
        check_model(value, source)
    return value
