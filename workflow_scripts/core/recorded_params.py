"""What the rules record as a stage's params (Snakemake's rerun trigger), built from resolved values (issue 44).

A config that means the same thing must record the same params: a key written out at a default that only the
code knows (``encoding: utf-8``, ``validation.criterion: loss``) is dropped, as it would be absent; a training
key that cannot change what is learned (``config_reads.RUNTIME_TRAINING_KEYS``) is recorded at its schema
default whatever its value (the stage receives the real value unrecorded), so raising ``runtime_minutes``
retrains nothing, and a run whose runtime keys were at their defaults records what it recorded before.
Keys the schema fills with a default stay as they are: Snakemake fills them in the config, so both spellings
already record the same value, and dropping them would change every finished run's params.
"""
from __future__ import annotations

import codecs
import copy
import dataclasses
import functools
import json
from typing import Any, Callable, Mapping

from workflow_scripts.core import config_reads
from workflow_scripts.core.entry_settings import DatasetSettings, ModelSettings, VariantSettings


def without_code_defaults(given: Mapping[str, Any], typed: Callable[[Mapping], Any],
                          filled: Callable[[Mapping], Mapping]) -> dict:
    """``given`` less each key (at the top or one level down) that the schema does not fill (absent from
    ``filled(given less it)``) and whose removal leaves ``typed(given)`` as it is: a key written at the code's
    default. ``typed`` may raise for a mapping that is not valid without the key: that key stays."""
    result = copy.deepcopy(dict(given))
    reference = typed(result)

    def same_without(path: tuple[str, ...]) -> bool:
        candidate = copy.deepcopy(result)
        holder = candidate
        for part in path[:-1]:
            holder = holder[part]
        holder.pop(path[-1])
        check = filled(candidate)
        for part in path[:-1]:
            check = check.get(part, {}) if isinstance(check, Mapping) else {}
        if isinstance(check, Mapping) and path[-1] in check:
            return False  # the schema fills it: both spellings already record the same value
        try:
            return typed(candidate) == reference
        except Exception:  # noqa: BLE001 (not valid without it: it means something)
            return False

    for key in list(result):
        value = result[key]
        if isinstance(value, Mapping):
            for inner in list(value):
                if same_without((key, inner)):
                    result[key].pop(inner)
            if not result[key] and same_without((key,)):  # {} or emptied: as if not written
                result.pop(key)
        elif same_without((key,)):
            result.pop(key)
    return result


def _entry_typed(parse: Callable[[Mapping], Any]) -> Callable[[Mapping], Any]:
    """An entry's typed settings without the mapping they were parsed from (``given``): what the stage sees."""
    def typed(value: Mapping) -> Any:
        return dataclasses.replace(parse(value), given={})
    return typed


def _entry_filled(parse: Callable[[Mapping], Any], as_given: Callable[[Any], Mapping]) -> Callable[[Mapping], Mapping]:
    """An entry as validated (the schema's defaults filled), or as written where it is not valid without a key."""
    def filled(value: Mapping) -> Mapping:
        try:
            return as_given(parse(value))
        except Exception:  # noqa: BLE001 (not valid without the key: keep it, same_without says so)
            return value
    return filled


# Training ---------------------------------------------------------------------------------------------------
def _training_filled(value: Mapping) -> dict:
    from workflow_scripts.core.settings import _training_validator

    checked = copy.deepcopy(dict(value))
    list(_training_validator().iter_errors(checked))  # fills the schema's defaults in place
    return checked


def _training_typed(value: Mapping) -> dict:
    from workflow_scripts.core.settings import TrainingSettings

    return TrainingSettings.parse(value).to_dict()


def recorded_training(resolved: Mapping[str, Any]) -> dict:
    """sanity's and train's recorded params for the resolved training mapping of one (model, variant): the
    runtime-only keys at their schema defaults (absent where the schema has none), code defaults dropped."""
    return json.loads(_recorded_training(json.dumps(resolved, sort_keys=True)))


# Memoised by the mapping's JSON: the Snakefile asks per job, and each check parses the settings again.
@functools.lru_cache(maxsize=1024)
def _recorded_training(text: str) -> str:
    defaults = _training_filled({})
    record = json.loads(text)
    for key in config_reads.RUNTIME_TRAINING_KEYS:
        record.pop(key, None)
        if key in defaults:
            record[key] = defaults[key]
    return json.dumps(without_code_defaults(record, _training_typed, _training_filled), sort_keys=True)


# One dataset ------------------------------------------------------------------------------------------------
def canonical_encoding(name: str | None) -> str | None:
    """The codec a text encoding names (Python's canonical name), None for UTF-8: the reader's default."""
    if name is None:
        return None
    try:
        canonical = codecs.lookup(name).name
    except LookupError:
        return name  # refused when the config is read (checks.sections)
    return None if canonical == "utf-8" else canonical


def _dataset_typed(name: str) -> Callable[[Mapping], Any]:
    def typed(value: Mapping) -> Any:
        settings = DatasetSettings.parse(value, name)
        return dataclasses.replace(settings, given={}, encoding=canonical_encoding(settings.encoding))
    return typed


def _dataset_filled(name: str) -> Callable[[Mapping], Mapping]:
    return _entry_filled(lambda value: DatasetSettings.parse(value, name), DatasetSettings.to_dict)


@functools.lru_cache(maxsize=1024)
def _resolved_entry(name: str, text: str) -> str:
    """One dataset entry (JSON) less its code defaults, the encoding by its codec's name."""
    entry = without_code_defaults(json.loads(text), _dataset_typed(name), _dataset_filled(name))
    if "encoding" in entry:
        entry["encoding"] = canonical_encoding(entry["encoding"])
        if entry["encoding"] is None:
            entry.pop("encoding")
    return json.dumps(entry, sort_keys=True)


def recorded_dataset(dataset: DatasetSettings, stage: str,
                     narrowings: Mapping[str, tuple[str, Callable[[DatasetSettings], Any]]] | None = None) -> dict:
    """What ``stage`` records of one dataset: the keys it declares (config_reads.READS) from the resolved entry
    (code defaults dropped, the encoding by its codec's name), and the parts of its narrowed reads
    (config_reads.NARROWED_READS) under ``narrowed``: ``narrowings[key]`` is (the part's name, its value from the
    typed dataset, None: nothing recorded), so keys read for one part (a dataset's metrics) record it once."""
    entry = json.loads(_resolved_entry(dataset.name, json.dumps(dataset.to_dict(), sort_keys=True)))
    record = config_reads.pick(entry, stage, "datasets.*")
    narrowed = {}
    for name, key in config_reads.NARROWED_READS:
        if name == stage:
            part, value_of = (narrowings or {})[key]  # a narrowed read the rules cannot record: KeyError
            value = value_of(dataset)
            if value is not None:
                narrowed[part] = value
    if narrowed:
        record["narrowed"] = narrowed
    return record


# A variant, a model ---------------------------------------------------------------------------------------------
def recorded_variant(variant: VariantSettings, without: tuple[str, ...] = ()) -> dict:
    """A variant as pretokenise, evaluate and predict receive and record it (``--variant``), less the keys
    written at the code's default (``images: true``) and less ``without`` (keys the stage does not read)."""
    return json.loads(_recorded_variant(variant.task, variant.name, json.dumps(variant.to_dict(), sort_keys=True),
                                        without))


@functools.lru_cache(maxsize=1024)
def _recorded_variant(task: str, name: str, text: str, without: tuple[str, ...]) -> str:
    def parse(value: Mapping) -> VariantSettings:
        return VariantSettings.parse(value, task, name)

    given = {key: value for key, value in json.loads(text).items() if key not in without}
    return json.dumps(without_code_defaults(given, _entry_typed(parse), _entry_filled(parse, VariantSettings.to_dict)),
                      sort_keys=True)


def recorded_model(model: ModelSettings) -> dict:
    """What prepare_model receives and records of a model (its building settings: not its training overrides),
    less the keys written at the code's default (``initialise: pretrained``)."""
    return json.loads(_recorded_model(json.dumps(model.building_settings(), sort_keys=True)))


@functools.lru_cache(maxsize=256)
def _recorded_model(text: str) -> str:
    def parse(value: Mapping) -> ModelSettings:
        return dataclasses.replace(ModelSettings.parse(value), training={})

    return json.dumps(without_code_defaults(json.loads(text), _entry_typed(parse),
                                            _entry_filled(parse, ModelSettings.building_settings)), sort_keys=True)
