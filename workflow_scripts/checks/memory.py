"""Before any job runs: each (model, variant) whose model config is here, estimated against the memory
its config declares (model/config_memory_estimate prices it; the task types say which models are causal LMs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.model import memory_estimate
from workflow_scripts.model.config_memory_estimate import (
    declared_memory, estimate_from_config, is_causal_lm, local_model_config, meta_model, training_arguments)
from workflow_scripts.tasks import task_named


def check_declared_memory(config: Mapping[str, Any], root: Path | str = ".") -> list[dict[str, Any]]:
    """Estimate every (model, variant) whose model config is here, before any job runs, and raise a
    ConfigError naming the model, the variant and the knob when one exceeds the memory its config declares.

    Returns what was checked: ``[{model, variant, estimate, declared, processes}]``.
    """
    root = Path(root)
    checked = []
    # Only the (model, variant) pairs the matrix runs, and only where the task loads a causal LM (the model
    # meta_model builds): a BERT under a masked-LM task is not estimated as BertLMHeadModel.
    pairs = {(model, variant) for model, entry, variant in xc.model_entry_variants(config)
             if task_named(xc.entry_task(config, entry)).auto_model_class == "AutoModelForCausalLM"}
    for name, spec in xc.models(config).items():
        declared_by = {variant: declared_memory(xc.training_settings(config, variant, name))
                       for variant in config["variants"] if (name, variant) in pairs}
        source = local_model_config(name, spec, root)
        if source is None or not any(declared_by.values()) or not is_causal_lm(source):
            continue  # nothing to read without a download, or nothing declared to compare with
        model = meta_model(source)
        for variant, declared in declared_by.items():
            if declared is None:
                continue
            training = xc.training_settings(config, variant, name)
            capacity, processes = declared
            parts = estimate_from_config(
                model, strategy=training.strategy, world_size=training.world_size,
                device="cpu", **training_arguments(training))
            checked.append({"model": name, "variant": variant, "estimate": parts, "declared": capacity,
                            "processes": processes})
            budget = int(capacity * training.memory_headroom)
            if parts["total"] * processes > budget:
                h = memory_estimate.human
                advice = memory_estimate.knob_advice(parts, training, torch.device("cpu"))
                raise ConfigError(
                    "training.mem_mb",
                    f"model '{name}', variant '{variant}': {processes} training process(es) on a node are "
                    f"estimated at {h(parts['total'])} each ({h(parts['total'] * processes)} together), over "
                    f"{training.memory_headroom:.0%} of the declared mem_mb {training.mem_mb} "
                    f"({h(budget)}). Fix: raise training.mem_mb, or {advice}")
    return checked
