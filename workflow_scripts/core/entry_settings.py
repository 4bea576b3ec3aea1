"""Typed settings of one entry of ``datasets``, of ``model``/``models`` and of ``variants``, as
``core/section_settings.py`` types the other sections: validated once against config/schema.yaml (its defaults
filled) into frozen dataclasses that the stages and the library read by attribute.

A dataset's and a variant's keys depend on their task (the schema's if/then branches). Every key the schema
allows for some task is an attribute here, and a key of another task holds its empty value (``derived`` {},
``flatten`` False, ``labels`` None, a variant's ``prompt`` None...): a reader needs no switch on the task, and
the schema has already refused a key where the task does not take it. ``fields`` (canonical field -> source
field, whose canonical names are the task's) stays a read-only mapping, as it is data, not settings.

The JSON the rules pass is the validated entry itself, so ``to_dict()`` gives back exactly that mapping (the
stage's fingerprint and manifest record; typing an entry reruns nothing): an optional key without a default is
absent there when the user left it out, which the typed value alone could not tell from an explicit null.
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from workflow_scripts.core.errors import ConfigError
from workflow_scripts.core.section_settings import _plain, _validated
from workflow_scripts.core.stage_arguments import json_object_setting

EMPTY: Mapping[str, Any] = types.MappingProxyType({})


def _frozen(value: Any) -> Any:
    """Read-only mappings and tuples all the way down."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({name: _frozen(item) for name, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


def _optional_tuple(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


# Datasets ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SourceSettings:
    """``datasets.<name>.source``: where download fetches the raw records (the keys of other types None)."""
    type: str  # hub | url | local
    id: str | None = None
    config_name: str | None = None
    revision: str | None = None
    url: str | None = None
    sha256: str | None = None
    path: str | None = None
    layout: str | None = None  # imagefolder (local)
    files: Mapping[str, str | tuple[str, ...]] = field(default_factory=lambda: EMPTY)  # source split -> file, glob or list of them (local)


@dataclass(frozen=True)
class DerivedField:
    """One entry of ``derived``: ``transform`` applied to canonical field ``field``."""
    transform: str
    field: str


@dataclass(frozen=True)
class ContaminationSettings:
    max_fraction: float = 0.01
    accept: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DuplicateSettings:
    """Rows repeated within one split (same input and gold): above ``max_fraction`` of a split normalise stops."""
    max_fraction: float = 1.0  # not set: reported and counted, never a stop

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SubmissionSettings:
    """How an unlabelled split's predictions are written."""
    format: str = "json"
    id_key: str = "questionId"
    id_type: str = "string"
    answer_key: str = "answer"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DatasetSettings:
    """One entry of ``datasets`` (download's and normalise's ``--dataset``), with its name."""
    name: str
    task: str
    source: SourceSettings
    format: str
    splits: Mapping[str, str]  # canonical split -> the source's split name (read-only)
    fields: Mapping[str, str]  # canonical field -> source field; which canonical fields is the task's (read-only)
    extra_fields: Mapping[str, str]
    metric: str
    also_metrics: tuple[str, ...]  # () when not set
    max_rejected_fraction: float
    on_invalid_text: str  # stop (when not set) | reject_row
    contamination: ContaminationSettings
    unlabelled: tuple[str, ...]
    submission: SubmissionSettings
    train_alone: bool
    evaluation_split: str | None  # None: the evaluation section's split
    models: tuple[str, ...] | None  # None: every model
    # The task's own keys (the empty value where the task has none):
    flatten: bool = False  # generation, vision_language: parallel question/answer lists
    derived: Mapping[str, DerivedField] = field(default_factory=lambda: EMPTY)  # generation, vision_language
    labels: tuple[str, ...] | None = None  # classification: the label set in class-id order
    keys: Mapping[str, str] = field(default_factory=lambda: EMPTY)  # conversation: a turn's role/content key names in the source
    roles: Mapping[str, str] = field(default_factory=lambda: EMPTY)  # conversation: canonical role -> the source's name
    encoding: str | None = None  # the raw text files' codec; None: UTF-8
    duplicates: DuplicateSettings = field(default_factory=lambda: DuplicateSettings())
    given: Mapping[str, Any] = field(default_factory=lambda: EMPTY, repr=False)  # the validated entry (to_dict)

    @classmethod
    def parse(cls, value: Any, name: str, source: str | None = None, key: str | None = None) -> "DatasetSettings":
        """``value`` checked against the schema's ``datasets`` entry (defaults filled); ConfigError naming
        ``key`` (default ``datasets.<name>``)."""
        checked = _validated(value, "datasets", key or f"datasets.{name}", source, entry=True)
        src = checked["source"]
        return cls(
            name=name, task=checked["task"],
            source=SourceSettings(**{**src, "files": _frozen(src.get("files", {}))}),
            format=checked["format"], splits=_frozen(checked["splits"]), fields=_frozen(checked.get("fields", {})),
            extra_fields=_frozen(checked["extra_fields"]), metric=checked["metric"],
            also_metrics=tuple(checked.get("also_metrics", ())), max_rejected_fraction=checked["max_rejected_fraction"],
            on_invalid_text=checked.get("on_invalid_text", "stop"),
            contamination=ContaminationSettings(**checked["contamination"]), unlabelled=tuple(checked["unlabelled"]),
            submission=SubmissionSettings(**checked["submission"]), train_alone=checked["train_alone"],
            evaluation_split=checked.get("evaluation_split"), models=_optional_tuple(checked.get("models")),
            flatten=checked.get("flatten", False),
            derived=types.MappingProxyType({field_name: DerivedField(**spec)
                                            for field_name, spec in checked.get("derived", {}).items()}),
            labels=_optional_tuple(checked.get("labels")), keys=_frozen(checked.get("keys", {})),
            roles=_frozen(checked.get("roles", {})), encoding=checked.get("encoding"),
            duplicates=DuplicateSettings(**checked.get("duplicates", {})), given=_frozen(checked))

    @classmethod
    def from_json(cls, text: str, name: str, flag: str = "--dataset") -> "DatasetSettings":
        return cls.parse(json_object_setting(text, flag), name, flag)

    def to_dict(self) -> dict[str, Any]:
        """The entry as the rules pass it (defaults filled, optional keys only where set)."""
        return _plain(self.given)


# Models -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GgufSettings:
    package: str
    file: str
    tokenizer_id: str | None = None


@dataclass(frozen=True)
class TinySettings:
    """``tiny``: a small random model; the VLM sizes None mean the builder's defaults."""
    architecture: str = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    vocab_size: int = 1024
    seed: int = 0
    image_size: int | None = None
    patch_size: int | None = None
    vision_hidden_size: int | None = None
    vision_layers: int | None = None
    vision_heads: int | None = None
    scale_factor: int | None = None

    def builder_settings(self) -> dict[str, Any]:
        """The keys set, as the tiny builders take them (``model/tiny_*.build``, also called directly by tests
        and benchmarks with a plain mapping; a VLM size left out gets the builder's default)."""
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}


@dataclass(frozen=True)
class ModelSettings:
    """One base model (``model``, or one entry of ``models`` with its name): prepare_model's ``--model``."""
    name: str
    source: str  # tiny | hub | gguf | local
    hub_id: str | None
    revision: str | None
    path: str | None
    gguf: GgufSettings | None
    tiny: TinySettings
    initialise: str  # pretrained (when not set) | random
    trust_remote_code: bool
    training: Mapping[str, Any]  # the model's training overrides, merged by experiment_config (read-only)
    given: Mapping[str, Any] = field(default_factory=lambda: EMPTY, repr=False)

    @classmethod
    def parse(cls, value: Any, name: str | None = None, key: str = "model",
              source: str | None = None) -> "ModelSettings":
        """``value``: a model's keys (``name`` among them, or given apart for an entry of ``models``)."""
        if not isinstance(value, Mapping):
            raise ConfigError(key, "must be a mapping of model settings", source)
        value = {**value, **({"name": name} if name is not None else {})}
        checked = _validated(value, "model", key, source)  # name and source required
        gguf = checked.get("gguf")
        return cls(name=checked["name"], source=checked["source"], hub_id=checked.get("hub_id"),
                   revision=checked.get("revision"), path=checked.get("path"),
                   gguf=None if gguf is None else GgufSettings(**gguf), tiny=TinySettings(**checked["tiny"]),
                   initialise=checked.get("initialise", "pretrained"), trust_remote_code=checked["trust_remote_code"],
                   training=_frozen(checked["training"]), given=_frozen(checked))

    @classmethod
    def from_json(cls, text: str, flag: str = "--model") -> "ModelSettings":
        return cls.parse(json_object_setting(text, flag), None, "model", flag)

    def to_dict(self) -> dict[str, Any]:
        """The model's keys as validated (prepare_model's manifest record)."""
        return _plain(self.given)

    def building_settings(self) -> dict[str, Any]:
        """What prepare_model's rule passes: not the training overrides (changing those must not rebuild it)."""
        return {name: value for name, value in self.to_dict().items() if name != "training"}


# Variants ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExtractorSettings:
    type: str = "whole"  # whole | section
    marker: str | None = None  # section: the final task's header


# Keys that ask how the model trains: training settings, not variant keys (named in the refusal).
TRAINING_NOT_VARIANT_KEYS = ("finetune", "full_finetune", "from_scratch", "pretrain_from_scratch")


@dataclass(frozen=True)
class VariantSettings:
    """One entry of ``variants`` as a stage receives it (``--variant``: without ``task`` and ``training``,
    which the rule passes apart, as ``--task``, and merges into the training settings)."""
    name: str
    task: str
    # generation, vision_language:
    prompt: str | None = None
    target: str | None = None
    extractor: ExtractorSettings = ExtractorSettings()
    chat_template: bool = False
    images: bool = True  # vision_language: false is the text-only control
    max_pixels: int | None = None  # vision_language: the pixel budget per image (None: the processor's own)
    min_pixels: int | None = None
    # classification:
    input: str | None = None
    class_weights: Mapping[str, float] | None = None
    # masked_lm:
    mask_rate: float = 0.15
    whole_word: bool = False
    grouping: str = "blocks"
    # conversation: None keeps each conversation's own system message, a string replaces or adds it, False drops it
    system_prompt: str | bool | None = None
    given: Mapping[str, Any] = field(default_factory=lambda: EMPTY, repr=False)

    @classmethod
    def parse(cls, value: Any, task: str, name: str = "<name>", source: str | None = None,
              key: str | None = None) -> "VariantSettings":
        """``value``: the variant's own keys (its ``task`` given apart; ``training`` is not read here)."""
        key = key or f"variants.{name}"
        if not isinstance(value, Mapping):
            raise ConfigError(key, "must be a mapping of variant settings", source)
        own = {setting: item for setting, item in value.items() if setting not in ("task", "training")}
        asked = [setting for setting in TRAINING_NOT_VARIANT_KEYS if setting in own]
        if asked:  # any value: a variant's 'lora' here would be ignored while training.finetune decides
            raise ConfigError(f"{key}.{asked[0]}", "how the model trains is a training setting, not a variant key; "
                              "set training.finetune: full (and model.initialise: random to pretrain from scratch) "
                              "under training:, or under the variant's training: block", source)
        checked = _validated({**own, "task": task}, "variants", key, source, entry=True)
        del checked["task"], checked["training"]
        extractor, weights = checked.get("extractor"), checked.get("class_weights")
        return cls(name=name, task=task, prompt=checked.get("prompt"), target=checked.get("target"),
                   extractor=ExtractorSettings(**extractor) if extractor else ExtractorSettings(),
                   chat_template=checked.get("chat_template", False), images=checked.get("images", True),
                   max_pixels=checked.get("max_pixels"), min_pixels=checked.get("min_pixels"),
                   input=checked.get("input"),
                   class_weights=None if weights is None else types.MappingProxyType(dict(weights)),
                   mask_rate=checked.get("mask_rate", 0.15), whole_word=checked.get("whole_word", False),
                   grouping=checked.get("grouping", "blocks"), system_prompt=checked.get("system_prompt"),
                   given=_frozen(checked))

    @classmethod
    def from_json(cls, text: str, task: str, name: str = "<name>", flag: str = "--variant") -> "VariantSettings":
        return cls.parse(json_object_setting(text, flag), task, name, flag, key=f"variants.{name}")

    @classmethod
    def from_record(cls, record: Any, task: str, source: str = "tokenise_meta.json") -> "VariantSettings":
        """The variant as pretokenise recorded it (``templates``: the task's ``variant_record``, defaults filled),
        typed again for sanity's and train's readers; classification records no class weights as null."""
        if not isinstance(record, Mapping):
            raise ConfigError("templates", "must be a mapping of variant settings; rerun pretokenise", source)
        given = {setting: item for setting, item in record.items() if not (setting == "class_weights" and item is None)}
        return cls.parse(given, task, "<recorded>", source, key="templates")

    def to_dict(self) -> dict[str, Any]:
        """The variant as the rules pass it (``--variant``). What pretokenise's cache key and the records hold
        is the task's ``variant_record`` of it (the task's defaults filled, as they have always been written)."""
        return _plain(self.given)

