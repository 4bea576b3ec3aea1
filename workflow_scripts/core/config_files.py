"""Reading the config: YAML files read strictly, ``--config`` values retyped, the schema's faults in one line.

The Snakefile calls :func:`check_workflow_config` before ``snakemake.utils.validate``: each config file is
re-read with :class:`StrictLoader` (which refuses duplicate keys), ``--config`` values get the types YAML
would give them, and the schema is checked with one-line messages that never echo a secret. The checks a
JSON schema cannot express come after, in ``workflow_scripts/checks/`` (they ask the task types).
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import yaml

from workflow_scripts.core.config_schema import SCHEMA_PATH, _validator_with_defaults, schema_error
from workflow_scripts.core.errors import ConfigError


def validate_schema(config: dict, source: str | None = None) -> dict:
    """Validate against config/schema.yaml in place, filling defaults; raise ConfigError on the first fault."""
    from jsonschema.exceptions import best_match

    _refuse_non_finite(config, (), source)
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


def _refuse_non_finite(value: Any, path: tuple[str, ...], source: str | None) -> None:
    """YAML's .inf and .nan (JSON's Infinity, NaN) are numbers to the schema: an infinite learning rate passes
    ``exclusiveMinimum: 0``, and a NaN compares unequal to itself (the fairness check would call it a difference)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(".".join(path) or "<top level>", f"is {value}, not a finite number (YAML reads .inf and "
                          ".nan as numbers); give a finite value", source)
    if isinstance(value, Mapping):
        for key, item in value.items():
            _refuse_non_finite(item, (*path, str(key)), source)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _refuse_non_finite(item, (*path, str(index)), source)


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


# What to do about an unclosed or unseparated flow collection ([a, b] or {k: v}): PyYAML names the collection's
# start, but reports the fault where it stopped, often a line later.
_FLOW_FIXES = {
    "while parsing a flow sequence": "; the [ list opened at {at} needs its closing ] and a comma between items: "
                                     "close it, add the missing comma, or quote an item that holds ':' or a bracket",
    "while parsing a flow mapping": "; the {{ mapping opened at {at} needs its closing }} and a comma between "
                                    "entries: close it, add the missing comma, or quote a value that holds ',', ':' "
                                    "or a bracket",
}


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
            text += _FLOW_FIXES.get(error.context, "").format(
                at=f"line {error.context_mark.line + 1}, column {error.context_mark.column + 1}"
                if error.context_mark is not None else "above")
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
        raise ConfigError("<file>", "config file not found (a relative path is read from the directory you run "
                          "in)", str(path)) from None
    except IsADirectoryError:
        raise ConfigError("<file>", "is a folder, not a config file", str(path)) from None
    except PermissionError:
        raise ConfigError("<file>", "not readable (permission denied)", str(path)) from None
    except UnicodeDecodeError as error:
        raise ConfigError("<file>", f"not UTF-8 text (byte {error.start + 1})", str(path)) from None
    try:
        # As Snakemake reads a config file: JSON first (where 1e-05 is a number and a tab is whitespace; YAML 1.1
        # reads the one as text and refuses the other), YAML when that fails. A key given twice: YAML names its line.
        config = json.loads(text, object_pairs_hook=_unique_json_keys)
    except (json.JSONDecodeError, _DuplicateJsonKey) as error:
        config, twice = None, error if isinstance(error, _DuplicateJsonKey) else None
    try:
        if config is None:
            config = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
    except DuplicateKeyError as error:
        raise ConfigError(
            ".".join(error.key_path),
            f"line {error.line}: key '{error.key_path[-1]}' is given twice (first at line {error.first_line}); "
            "YAML would silently keep only the last, so remove or rename one",
            str(path),
        ) from None
    except yaml.YAMLError as error:
        if twice is not None:  # JSON that YAML cannot read (tabs): named without its line
            raise ConfigError(twice.key, f"key '{twice.key}' is given twice in one object; JSON would silently keep "
                              "only the last, so remove or rename one", str(path)) from None
        raise ConfigError("<file>", _yaml_problem(error), str(path)) from None
    if not isinstance(config, dict):
        raise ConfigError("<top level>", "the config must be a mapping", str(path))
    return config


class _DuplicateJsonKey(ValueError):
    """A JSON object names a key twice (``json`` would keep the last)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_json_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            raise _DuplicateJsonKey(name)
        seen.add(name)
    return dict(pairs)


def check_workflow_config(configfiles: Iterable[str | Path], config: dict) -> None:
    """For the Snakefile, before ``snakemake.utils.validate``: the checks Snakemake's own reading skips.

    Snakemake reads config files with plain PyYAML (the last of two equal keys wins) and reports a schema
    fault as a multi-line dump of the whole config; this re-reads each file strictly and validates
    ``config`` with one-line messages that never echo a secret (defaults filled the same way).
    """
    files, from_files = read_files(configfiles)
    retype_command_line_values(config, from_files)
    _refuse_misplaced_command_line_keys(config, from_files)
    given = copy.deepcopy(config)  # as written: validation fills the schema's defaults in place
    try:
        validate_schema(config, "config")
        refuse_unused_qlora_base(given, "config")
    except ConfigError as error:  # named by the file (or --config) that gives the key, as the user wrote it
        raise ConfigError(error.key, error.problem, origin(error.key, files, given, from_files)) from None


def refuse_unused_qlora_base(given: Mapping[str, Any], source: str | None = None) -> None:
    """``evaluation.qlora_base`` picks the base a QLoRA adapter is scored on; set while no training block (the
    shared one, a model's or a variant's) quantises, it changes nothing. ``given``: the config as written, before
    the schema's default fills ``qlora_base`` (afterwards a set value and the default look alike), which is why
    this check sits here, where the config is read, rather than in checks/config."""
    as_written = given.get("evaluation")  # the raw mapping: this check runs before EvaluationSettings exist
    if not isinstance(as_written, Mapping) or "qlora_base" not in as_written:
        return
    entries = [given.get("model")] if "model" in given else list((given.get("models") or {}).values())
    entries += list((given.get("variants") or {}).values())
    blocks = [given.get("training"), *(entry.get("training") for entry in entries if isinstance(entry, Mapping))]
    if not any(isinstance(block, Mapping) and block.get("quantization") is not None for block in blocks):
        raise ConfigError("evaluation.qlora_base", f"is {as_written['qlora_base']!r}, but no training block sets "
                          "training.quantization (QLoRA), so there is no QLoRA adapter to score and it would change "
                          "nothing; remove evaluation.qlora_base, or set training.quantization (e.g. {bits: 4}) to "
                          "train QLoRA", source)


def in_user_file(error: ConfigError, configfiles: Iterable[str | Path],
                 command_line: Mapping[str, Any] | None = None) -> ConfigError:
    """``error`` of a check after validation (its config has the schema's defaults) named by the user's file
    that holds its key, or ``--config`` (``command_line``: Snakemake's ``--config`` values)."""
    files, from_files = read_files(configfiles)
    given = deep_merge(from_files, dict(command_line or {}))
    return ConfigError(error.key, error.problem, origin(error.key, files, given, from_files))


def read_files(configfiles: Iterable[str | Path]) -> tuple[list[tuple[str, dict]], dict]:
    """Each config file read strictly, (path, content), and all of them merged in order, as Snakemake merges them."""
    files = [(str(path), read_config_file(path)) for path in configfiles]
    merged: dict = {}
    for _, content in files:
        merged = deep_merge(merged, content)
    return files, merged


def origin(key: str, files: list[tuple[str, Mapping[str, Any]]], given: Mapping[str, Any],
           from_files: Mapping[str, Any]) -> str:
    """Where the user wrote ``key`` (dotted, as ConfigError names it): ``--config`` where the command line
    changed the value, else the last config file that holds it (or the deepest part of its path that is
    written: a missing key is named by its parent's file); all files where nothing of it is written."""
    path = [] if key.startswith("<") else key.split(".")
    for depth in range(len(path), 0, -1):
        found, value = _lookup(given, path[:depth])
        if not found:
            continue
        in_files, file_value = _lookup(from_files, path[:depth])
        if not in_files or (file_value != value and not (_is_nan(file_value) and _is_nan(value))):
            return "--config"
        return [name for name, content in files if _lookup(content, path[:depth])[0]][-1]
    return ", ".join(name for name, _ in files) or "config"


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)  # unequal to itself, yet the same value as read


def _lookup(tree: Any, path: list[str]) -> tuple[bool, Any]:
    """(found, value) of a dotted key's parts in nested mappings and lists (a list index as its digits)."""
    for part in path:
        if isinstance(tree, Mapping) and part in tree:
            tree = tree[part]
        elif isinstance(tree, list) and part.isdigit() and int(part) < len(tree):
            tree = tree[int(part)]
        else:
            return False, None
    return True, tree


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


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict:
    """Return ``base`` with ``override`` merged in recursively (override wins)."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
