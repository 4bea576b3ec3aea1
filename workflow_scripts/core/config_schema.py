"""The config schema (config/schema.yaml): its path, a validator that fills defaults, and one-line faults.

Shared by the whole-config checks (``experiment_config``) and the typed settings (``settings``), which
validate one section each.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator, Mapping

from workflow_scripts.core.errors import ConfigError
from workflow_scripts.core.run_manifest import is_secret_key, redact

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"


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


def _looks_secret(name: Any) -> bool:
    return is_secret_key(name)


def _secret_values(value: Any, secret: bool = False) -> Iterator[Any]:
    """Every scalar inside ``value`` that sits under a secret-looking key (all of it when ``secret``)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _secret_values(item, secret or _looks_secret(key))
    elif isinstance(value, list):
        for item in value:
            yield from _secret_values(item, secret)
    elif secret and value is not None and not isinstance(value, bool):
        yield value


def schema_error(error, prefix: str | None = None, source: str | None = None) -> ConfigError:
    """One line for a jsonschema error: the key path, what was expected and what was found.

    A missing required key is named in the key path; a value under a key that looks like a secret
    (token, secret, password, api_key) is never echoed, however jsonschema's message quotes it.
    """
    if error.validator == "unevaluatedProperties":  # task-dependent keys (if/then): same words as any unknown key
        error.message = error.message.replace("Unevaluated properties", "Additional properties")
    path = [str(part) for part in error.absolute_path]
    instance = error.instance
    if error.validator == "required" and isinstance(instance, Mapping):
        missing = next((name for name in error.validator_value
                        if name not in instance and error.message.startswith(repr(name))), None)
        if missing is not None:
            key = ".".join(filter(None, [prefix, *path, str(missing)]))
            where = ".".join(filter(None, [prefix, *path])) or "the config"
            hint = ""
            if (len(path) == 2 and path[0] == "variants" and not prefix and missing in ("prompt", "target")
                    and not {"prompt", "target"} & set(instance)):  # written for another task, task: forgotten
                hint = (f"; a variant without task: is a generation variant (prompt and target); for another task's "
                        f"datasets set {where}.task (e.g. task: classification)")
            return ConfigError(key, f"required, but missing ({where} has keys {sorted(map(str, instance))}){hint}", source)
    key = ".".join(filter(None, [prefix, *path])) or "<top level>"
    message = error.message
    secret = any(_looks_secret(part) for part in path)
    if secret:
        message = message.replace(repr(instance), "<redacted>")
    else:
        message = message.replace(repr(instance), repr(redact(instance)))
    for value in _secret_values(instance, secret):
        message = message.replace(repr(value), "<redacted>")
        if isinstance(value, str) and len(value) >= 4:
            message = message.replace(value, "<redacted>")
    return ConfigError(key, " ".join(message.split("\n")), source)
