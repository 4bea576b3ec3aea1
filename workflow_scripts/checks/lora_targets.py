"""Before any job runs: each (model, variant)'s ``training.lora.target_modules`` against the module names of its
model, where they are known when the workflow is read (a tiny text model built from ``model.tiny``, or a local or
already prepared model's config.json), so a BERT-style model left on the default ``[q_proj, k_proj, v_proj,
o_proj]`` (a decoder's names; BERT's are ``query``, ``key``, ``value``, ``dense``) is refused at ``snakemake -n``,
not at the sanity gate after download, normalise and pretokenise.

The names are read from the model built on the meta device (no storage, no download) with the class its task
loads, and matched as PEFT matches a list of names: an entry names a module or the end of one's dotted name
(``model_loading.check_module_names``, the gate's same check). Vision-language models are left to the gate: their
entries are looked up in the language model only, and may be patterns (``model/vision_language_model``).
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Mapping

from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.tasks import task_named

DEFAULT_KEY = "training.lora.target_modules"


def known_config(name: str, spec, root: Path) -> dict[str, Any] | None:
    """The model's config fields without downloading anything, or None where its module names are not known
    yet (a hub or GGUF model not prepared, a model with its own code, a vision-language model, a tiny VLM)."""
    from workflow_scripts.model import tiny_bert
    from workflow_scripts.model.config_memory_estimate import TINY_CAUSAL

    if spec.source == "tiny":
        tiny = spec.tiny
        if tiny.architecture not in (*TINY_CAUSAL, *tiny_bert.ARCHITECTURES):
            return None
        # The module names depend on the architecture and the layer count only, not on the sizes.
        return {"model_type": tiny.architecture, "vocab_size": tiny.vocab_size, "hidden_size": tiny.hidden_size,
                "intermediate_size": tiny.intermediate_size, "num_hidden_layers": tiny.num_layers,
                "num_attention_heads": tiny.num_heads, "num_key_value_heads": tiny.num_heads}
    folders = [root / "resources" / "models" / name]
    if spec.source == "local":
        folders.insert(0, root / spec.path)
    path = next((folder / "config.json" for folder in folders if (folder / "config.json").is_file()), None)
    if path is None:
        return None
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # prepare_model names a broken config.json
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if not isinstance(fields, dict) or fields.get("auto_map") or fields.get("model_type") not in CONFIG_MAPPING_NAMES \
            or "vision_config" in fields:
        return None
    return fields


def module_names(fields: Mapping[str, Any], auto_class: str) -> list[str] | None:
    """Every module name of the model ``auto_class`` builds from ``fields``, on the meta device; None where that
    class has no form for this model type (task_fit refuses that pairing with its own message)."""
    import torch
    import transformers
    from transformers import AutoConfig

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    try:
        with torch.device("meta"):
            model = getattr(transformers, auto_class).from_config(config)
    except ValueError:  # "Unrecognized configuration class ... for this kind of AutoModel"
        return None
    return [module for module, _ in model.named_modules() if module]


def target_modules_key(config: Mapping[str, Any], model: str, variant: str) -> str:
    """The key that sets target_modules for this (model, variant): the variant's, the model's, else the shared one."""
    model_key = xc.model_key(config, model)
    layers = ((f"variants.{variant}.training", config["variants"][variant].get("training", {})),
              (f"{model_key}.training", xc.models(config)[model].get("training", {})))
    return next((f"{key}.lora.target_modules" for key, layer in layers
                 if "target_modules" in (layer.get("lora") or {})), DEFAULT_KEY)


def check_lora_targets(config: Mapping[str, Any], source: str | None = None, root: str | Path = ".") -> None:
    """Raise ConfigError naming the key that sets ``target_modules`` when an entry matches no module of a model
    whose module names are known now."""
    root = Path(root)
    entries = xc.model_entries(config, source)
    names: dict[tuple[str, str], list[str] | None] = {}
    for model, entry, variant in xc.model_entry_variants(config):
        training = xc.training_settings(config, variant, model, source)
        if training.full:
            continue  # no LoRA
        auto_class = task_named(xc.entry_task(config, entry)).auto_model_class
        if (model, auto_class) not in names:
            fields = known_config(model, entries[model], root)
            names[model, auto_class] = None if fields is None else module_names(fields, auto_class)
        modules = names[model, auto_class]
        if modules is None:
            continue
        for target in training.lora.target_modules:
            if any(module == target or module.endswith("." + target) for module in modules):
                continue
            leaves = sorted({module.rsplit(".", 1)[-1] for module in modules})
            close = difflib.get_close_matches(target, leaves, n=3)
            layers = sorted(set(leaves) & LINEAR_HINTS) or close
            where = f"{xc.model_key(config, model)}.training.lora"
            raise ConfigError(
                target_modules_key(config, model, variant),
                f"'{target}' matches no module of model '{model}' ({fields_kind(entries[model])}, whose "
                f"projection layers are named {layers}); set target_modules to names the model has (a BERT-style "
                f"encoder: [query, key, value, dense]; a decoder: [q_proj, k_proj, v_proj, o_proj]), e.g. under "
                f"{where}", source)


# The attention and feed-forward projections' leaf names of the families seen here, shown first in the message.
LINEAR_HINTS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                          "query", "key", "value", "dense", "c_attn", "c_proj", "c_fc", "qkv_proj"})


def fields_kind(spec) -> str:
    """How the model was known: its tiny architecture or its source."""
    return f"tiny.architecture: {spec.tiny.architecture}" if spec.source == "tiny" else f"source: {spec.source}"
