"""Loading, validating and resolving the experiment configuration.

The Snakefile validates ``config`` with ``snakemake.utils.validate`` (which fills schema
defaults) and then calls :func:`check_config` for the checks a JSON schema cannot express.
Scripts and tests use :func:`load_config`, which does both the same way.
"""
from __future__ import annotations

import copy
import hashlib
import json
import string
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from workflow_scripts.errors import ConfigError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "config" / "schema.yaml"
CANONICAL_FIELDS = ("id", "question", "answers", "answer")
TRAINING_SHAPE_KEYS = ("effective_batch", "micro_batch")


def _validator_with_defaults():
    """A Draft 2020-12 validator that fills ``default`` values, as snakemake.utils.validate does."""
    from jsonschema import Draft202012Validator, validators

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from Draft202012Validator.VALIDATORS["properties"](validator, properties, instance, schema)

    return validators.extend(Draft202012Validator, {"properties": set_defaults})


def validate_schema(config: dict, source: str | None = None) -> dict:
    """Validate against config/schema.yaml in place, filling defaults; raise ConfigError on the first fault."""
    from jsonschema.exceptions import best_match

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    validator_class = _validator_with_defaults()
    # Defaults are set on the way down, so nested objects created by a default get theirs too.
    errors = list(validator_class(schema).iter_errors(config))
    if errors:
        error = best_match(errors)
        key = ".".join(str(part) for part in error.absolute_path) or "<top level>"
        raise ConfigError(key, error.message, source)
    return config


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict:
    """Read a YAML config with ``yaml.safe_load``, validate it, fill defaults and check consistency."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError("<file>", "config file not found", str(path)) from None
    except yaml.YAMLError as error:
        raise ConfigError("<file>", f"not valid YAML: {error}", str(path)) from None
    if not isinstance(config, dict):
        raise ConfigError("<top level>", "the config must be a mapping", str(path))
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


def resolved_training(config: Mapping[str, Any], variant: str) -> dict:
    """Shared training settings with the variant's overrides applied."""
    return deep_merge(config["training"], config["variants"][variant].get("training", {}))


def world_size(training: Mapping[str, Any]) -> int:
    """Processes in one training job: nodes x (GPUs per node, or CPU processes without GPUs)."""
    per_node = training["gpus"] if training["gpus"] > 0 else training["cpu_processes"]
    return training["nodes"] * per_node


def gradient_accumulation(training: Mapping[str, Any], key: str = "training", source: str | None = None) -> int:
    """Micro-steps per optimizer step; the effective batch must split evenly over processes."""
    processes = world_size(training)
    per_step = training["micro_batch"] * processes
    if training["effective_batch"] % per_step:
        raise ConfigError(
            f"{key}.effective_batch",
            f"{training['effective_batch']} is not a multiple of micro_batch ({training['micro_batch']}) "
            f"x processes ({processes}); choose an effective batch divisible by {per_step} "
            "or change micro_batch",
            source,
        )
    return training["effective_batch"] // per_step


def experiments(config: Mapping[str, Any]) -> Iterator[tuple[str, str, int]]:
    """The experiment matrix: every (dataset, variant, seed)."""
    for dataset in config["datasets"]:
        for variant in config["variants"]:
            for seed in config["seeds"]:
                yield dataset, variant, seed


def template_fields(template: str) -> set[str]:
    """Top-level field names a ``str.format`` template refers to."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            names.add(field.split(".")[0].split("[")[0])
    return names


def dataset_fields(dataset: Mapping[str, Any]) -> set[str]:
    """Fields a normalised row of this dataset offers to templates."""
    return set(CANONICAL_FIELDS) | set(dataset.get("extra_fields", {})) | set(dataset.get("derived", {}))


def config_hash(value: Any) -> str:
    """A stable sha256 of any JSON-serialisable value (key order ignored)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_config(config: Mapping[str, Any], source: str | None = None) -> None:
    """Checks beyond the JSON schema; each failure names the key and the fix."""
    _check_model(config["model"], source)
    for name, dataset in config["datasets"].items():
        _check_dataset(name, dataset, source)
    training_keys = set(config["training"])
    for name, variant in config["variants"].items():
        key = f"variants.{name}"
        if variant["extractor"]["type"] == "section" and not variant["extractor"].get("marker"):
            raise ConfigError(f"{key}.extractor.marker", "a section extractor needs the final task's marker", source)
        unknown = set(variant.get("training", {})) - training_keys
        if unknown:
            raise ConfigError(f"{key}.training", f"unknown training keys {sorted(unknown)}", source)
        for ds_name, dataset in config["datasets"].items():
            available = dataset_fields(dataset)
            for part in ("prompt", "target"):
                missing = template_fields(variant[part]) - available
                if missing:
                    raise ConfigError(
                        f"{key}.{part}",
                        f"refers to {sorted(missing)}, which dataset '{ds_name}' does not provide "
                        f"(it has {sorted(available)}); add them under datasets.{ds_name}.extra_fields or derived",
                        source,
                    )
        gradient_accumulation(resolved_training(config, name), f"{key}.training" if variant.get("training") else "training", source)
    reference = config["comparison"]["reference_variant"]
    if reference not in config["variants"]:
        raise ConfigError("comparison.reference_variant", f"'{reference}' is not one of the variants {sorted(config['variants'])}", source)


def _require(mapping: Mapping[str, Any], keys: tuple[str, ...], prefix: str, why: str, source: str | None) -> None:
    for key in keys:
        if not mapping.get(key):
            raise ConfigError(f"{prefix}.{key}", f"required {why}", source)


MOVING_REVISIONS = ("main", "master", "head")


def _check_pinned(revision: Any, key: str, source: str | None) -> None:
    """A branch name moves: the same config would fetch different weights or rows next month."""
    if isinstance(revision, str) and revision.strip().lower() in MOVING_REVISIONS:
        raise ConfigError(key, f"'{revision}' is a branch, not a pinned revision; use a commit hash or a tag", source)


def _check_model(model: Mapping[str, Any], source: str | None) -> None:
    needs = {"hub": ("hub_id", "revision"), "local": ("path",), "gguf": ("gguf",), "tiny": ()}[model["source"]]
    _require(model, needs, "model", f"when model.source is '{model['source']}'", source)
    if model["source"] == "hub":
        _check_pinned(model["revision"], "model.revision", source)


def _check_dataset(name: str, dataset: Mapping[str, Any], source: str | None) -> None:
    src = dataset["source"]
    needs = {"hub": ("id", "revision"), "url": ("url", "sha256"), "local": ("path",)}[src["type"]]
    _require(src, needs, f"datasets.{name}.source", f"when source.type is '{src['type']}'", source)
    if src["type"] == "hub":
        _check_pinned(src["revision"], f"datasets.{name}.source.revision", source)
    from workflow_scripts.transforms import TRANSFORMS

    for field, spec in dataset.get("derived", {}).items():
        if spec["transform"] not in TRANSFORMS:
            raise ConfigError(
                f"datasets.{name}.derived.{field}.transform",
                f"unknown transform '{spec['transform']}'; known: {sorted(TRANSFORMS)}",
                source,
            )


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
        error = best_match(errors)
        path = ".".join(str(p) for p in error.absolute_path)
        raise ConfigError(".".join(filter(None, [key, path])), error.message, source)
    if section == "datasets":
        _check_dataset(key.split(".")[-1], value, source)
    else:
        _check_model(value, source)
    return value
