"""Typed settings of the config's ``evaluation``, ``comparison``, ``tracking`` sections and of one mixture, as ``core/settings.py`` types
``training``: validated once against config/schema.yaml (its defaults filled) into frozen dataclasses that
the stages read by attribute.

The Snakefile parses each section when the workflow is read (``checks/config.check_config``); a stage
parses its JSON argument the same way, so a stage run by hand gets the same defaults and the same refusals,
each naming the key. The JSON the rules pass is the validated section itself (keys sorted), so typing a
section reruns nothing.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import types
from dataclasses import dataclass
from typing import Any, Mapping

from workflow_scripts.core.errors import ConfigError
from workflow_scripts.core.stage_arguments import json_object_setting, json_setting


def _validated(value: Any, section: str, key: str, source: str | None, entry: bool = False) -> dict[str, Any]:
    """``value`` checked against the schema's top-level ``section`` (``entry``: one entry of that mapping, such as
    one mixture), defaults filled; ConfigError naming the key."""
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping of {section} settings", source)
    checked = copy.deepcopy(dict(value))
    errors = list(_section_validator(section, entry).iter_errors(checked))
    if errors:
        from jsonschema.exceptions import best_match

        from workflow_scripts.core.config_schema import schema_error

        raise schema_error(best_match(errors), key, source)
    return checked


@functools.lru_cache(maxsize=None)
def _section_validator(section: str, entry: bool = False):
    """The schema's top-level ``section`` (or one entry of it) with its ``$defs``, read once per process."""
    import yaml

    from workflow_scripts.core.config_schema import SCHEMA_PATH, _validator_with_defaults

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    part = schema["properties"][section]
    return _validator_with_defaults()({**(part["additionalProperties"] if entry else part), "$defs": schema["$defs"]})


def _plain(value: Any) -> Any:
    """JSON values back from the frozen forms (tuples, read-only mappings)."""
    if isinstance(value, Mapping):
        return {name: _plain(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


@dataclass(frozen=True)
class EvaluationSettings:
    """``evaluation`` as evaluate, predict and the validation metric receive it: the section, with the
    dataset's own split and training's ``max_length`` (inputs are cut as in training) set by the rule."""
    split: str  # validation | test
    max_new_tokens: int
    batch_size: int
    max_examples: int | None
    gpus: int
    evaluate_base_model: bool
    qlora_base: str  # quantised | unquantised
    dtype: str | None  # auto | fp32; None: not set (no schema default, so leaving it out reruns nothing)
    max_length: int | None  # training's; None where the rule did not pass it

    @classmethod
    def parse(cls, value: Any, key: str = "evaluation", source: str | None = None) -> "EvaluationSettings":
        if not isinstance(value, Mapping):
            raise ConfigError(key, "must be a mapping of evaluation settings", source)
        max_length = value.get("max_length")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 1):
            raise ConfigError(f"{key}.max_length", f"must be a positive integer (training's), got {max_length!r}",
                              source)
        checked = _validated({name: item for name, item in value.items() if name != "max_length"},
                             "evaluation", key, source)
        if checked.get("dtype") == "auto":  # what leaving it out means: one spelling, so writing it reruns nothing
            del checked["dtype"]
        return cls(**{"dtype": None, **checked}, max_length=max_length)

    @classmethod
    def from_json(cls, text: str, flag: str = "--evaluation") -> "EvaluationSettings":
        return cls.parse(json_object_setting(text, flag), "evaluation", flag)

    @property
    def compute_dtype(self) -> str:
        """``dtype`` with its meaning when not set: auto (bf16 on a GPU that supports it, else fp32)."""
        return self.dtype or "auto"

    def to_dict(self) -> dict[str, Any]:
        """As the rule passes it (keys sorted; ``dtype`` and ``max_length`` only when set): the manifests' record."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return dict(sorted((name, value) for name, value in values.items()
                           if value is not None or name not in ("dtype", "max_length")))

    def replace(self, **changes: Any) -> "EvaluationSettings":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ComparisonSettings:
    """``comparison``: how compare pairs, resamples and judges the variants (and power's threshold)."""
    reference_variant: str | Mapping[str, str]  # one name, or task -> name (read-only)
    bootstrap_resamples: int
    bootstrap_seed: int
    bootstrap: str  # auto | examples | seeds_and_examples
    intended_differences: tuple[str, ...]
    min_detectable_effect: float | None

    @classmethod
    def parse(cls, value: Any, key: str = "comparison", source: str | None = None) -> "ComparisonSettings":
        checked = _validated(value, "comparison", key, source)
        reference = checked["reference_variant"]
        return cls(reference_variant=(types.MappingProxyType(dict(reference)) if isinstance(reference, Mapping)
                                      else reference),
                   bootstrap_resamples=checked["bootstrap_resamples"], bootstrap_seed=checked["bootstrap_seed"],
                   bootstrap=checked["bootstrap"], intended_differences=tuple(checked["intended_differences"]),
                   min_detectable_effect=checked["min_detectable_effect"])

    @classmethod
    def from_json(cls, text: str, flag: str = "--comparison") -> "ComparisonSettings":
        return cls.parse(json_object_setting(text, flag), "comparison", flag)

    def reference_for(self, task: str) -> str | None:
        """The variant the others of ``task`` are compared with (None: the mapping names none for it)."""
        if isinstance(self.reference_variant, Mapping):
            return self.reference_variant.get(task)
        return self.reference_variant

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, keys sorted as the rules pass them (the experiment-set stamp, the comparison's record)."""
        return dict(sorted(_plain({field.name: getattr(self, field.name)
                                   for field in dataclasses.fields(self)}).items()))


@dataclass(frozen=True)
class MlflowSettings:
    enabled: bool
    tracking_uri: str | None
    experiment: str
    run_name: str


@dataclass(frozen=True)
class TrackingSettings:
    """``tracking``: experiment trackers beside TensorBoard (runtime only, never part of a fingerprint).

    ``run`` (model, dataset, variant, seed: the experiment a train job runs) is added by the workflow's
    train rule, not the config."""
    mlflow: MlflowSettings
    run: Mapping[str, Any] = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    @classmethod
    def parse(cls, value: Any, key: str = "tracking", source: str | None = None) -> "TrackingSettings":
        if isinstance(value, Mapping) and "run" in value:
            run = value["run"]
            if not isinstance(run, Mapping):
                raise ConfigError(f"{key}.run", "must be a mapping of model, dataset, variant and seed", source)
            value = {name: item for name, item in value.items() if name != "run"}
        else:
            run = {}
        checked = _validated(value, "tracking", key, source)
        return cls(mlflow=MlflowSettings(**checked["mlflow"]), run=types.MappingProxyType(dict(run)))

    @classmethod
    def from_json(cls, text: str | None, flag: str = "--tracking") -> "TrackingSettings":
        """train's ``--tracking`` (absent: every tracker off)."""
        value = {} if text is None else json_setting(text, flag)
        if not isinstance(value, dict):
            raise ConfigError(flag, "must be a JSON object such as {\"mlflow\": {\"enabled\": true}}")
        return cls.parse(value, "tracking", flag)

    def with_run(self, model: str, dataset: str, variant: str, seed: int) -> "TrackingSettings":
        """One experiment's tracking: its identity, and the run name filled in from it."""
        run = {"model": model, "dataset": dataset, "variant": variant, "seed": int(seed)}
        mlflow = dataclasses.replace(self.mlflow, run_name=self.mlflow.run_name.format(**run))
        return dataclasses.replace(self, mlflow=mlflow, run=types.MappingProxyType(run))

    def to_dict(self) -> dict[str, Any]:
        return _plain({"mlflow": dataclasses.asdict(self.mlflow), "run": self.run})


@dataclass(frozen=True)
class MixtureSettings:
    """One entry of ``mixtures``, as the mix stage receives it: its components and how they are drawn."""
    datasets: tuple[str, ...]
    weights: Mapping[str, float] | None  # dataset -> relative weight (read-only)
    temperature: float | None  # neither weights nor temperature: temperature 1, the train sizes
    rows: int | None  # None: the components' total
    seed: int
    max_passes: int | None  # None: data/mixture.MAX_PASSES
    models: tuple[str, ...] | None  # None: every model

    @classmethod
    def parse(cls, value: Any, key: str = "mixtures.<name>", source: str | None = None) -> "MixtureSettings":
        checked = _validated(value, "mixtures", key, source, entry=True)
        weights, models = checked.get("weights"), checked.get("models")
        return cls(datasets=tuple(checked["datasets"]),
                   weights=None if weights is None else types.MappingProxyType(dict(weights)),
                   temperature=checked.get("temperature"), rows=checked["rows"], seed=checked["seed"],
                   max_passes=checked.get("max_passes"), models=None if models is None else tuple(models))

    @classmethod
    def from_json(cls, text: str, name: str, flag: str = "--settings") -> "MixtureSettings":
        return cls.parse(json_object_setting(text, flag), f"mixtures.{name}", flag)

    def to_dict(self) -> dict[str, Any]:
        """The mixture as the rule passes it (optional keys without a default only when set): the mixed data's
        fingerprint, so typing the mixture re-tokenises nothing."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        optional = ("weights", "temperature", "max_passes", "models")
        return _plain({name: value for name, value in values.items() if value is not None or name not in optional})
