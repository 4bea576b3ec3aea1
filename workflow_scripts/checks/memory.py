"""Before any job runs: each (model, variant) whose model config is here, estimated against the memory
its config declares (model/config_memory_estimate prices it; the task types say which models are causal LMs).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch

from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.model import memory_estimate
from workflow_scripts.model.config_memory_estimate import (
    PROCESS_HOST_BYTES, estimate_from_config, host_memory, host_memory_problem, is_causal_lm, loading_from_config,
    local_model_config, mesh_arguments, meta_model, training_arguments)
from workflow_scripts.tasks import task_named


def check_declared_memory(config: Mapping[str, Any], root: Path | str = ".") -> list[dict[str, Any]]:
    """Estimate every (model, variant) whose model config is here, before any job runs, and raise a
    ConfigError naming ``training.mem_mb`` and the figure needed when one needs more host memory per node
    than the config declares (``config_memory_estimate.host_memory``: CPU and GPU jobs; CPU fsdp's loading).

    Returns what was checked: ``[{model, variant, estimate, host, loading, declared, processes}]``
    (``estimate``/``loading``: the per-process figures of a CPU job, None for a GPU job, whose device memory
    the gate checks).
    """
    root = Path(root)
    checked = []
    # Only the (model, variant) pairs the matrix runs, and only where the task loads a causal LM (the model
    # meta_model builds): a BERT under a masked-LM task is not estimated as BertLMHeadModel.
    pairs = {(model, variant) for model, entry, variant in xc.model_entry_variants(config)
             if task_named(xc.entry_task(config, entry)).auto_model_class == "AutoModelForCausalLM"}
    for name, spec in xc.model_entries(config).items():
        variants = [variant for variant in config["variants"] if (name, variant) in pairs]
        source = local_model_config(name, spec, root)
        if source is None or not variants or not is_causal_lm(source):
            continue  # nothing to read without a download
        model = meta_model(source)
        for variant in variants:
            training = xc.training_settings(config, variant, name)
            parts = loading = None
            if training.gpus == 0:
                parts = estimate_from_config(model, device="cpu", **mesh_arguments(training),
                                             **training_arguments(training))
                loading = loading_from_config(model, device="cpu", **mesh_arguments(training),
                                              **training_arguments(training))
            host = host_memory(model, training, parts)
            checked.append({"model": name, "variant": variant, "estimate": parts, "host": host, "loading": loading,
                            "declared": training.mem_mb * 2**20, "processes": host["ranks"]})
            # CPU fsdp's loading: rank 0's copy of the whole model once, beside every process and its share and unit.
            if loading is not None:
                per_process = PROCESS_HOST_BYTES + loading["total"] - loading["host_copy"]
                loading_node = loading["host_copy"] + host["ranks"] * per_process
                budget = int(training.mem_mb * 2**20 * training.memory_headroom)
                if loading_node > max(budget, host["total"]):
                    h = memory_estimate.human
                    raise ConfigError(
                        "training.mem_mb",
                        f"model '{name}', variant '{variant}': loading under training.strategy: fsdp is estimated at "
                        f"{h(loading_node)} on the node (rank 0's host copy of the whole model {h(loading['host_copy'])}, "
                        f"and each of {host['ranks']} processes with its share and one whole unit), over "
                        f"{training.memory_headroom:.0%} of the declared mem_mb {training.mem_mb} ({h(budget)}). "
                        f"Fix: raise training.mem_mb to at least "
                        f"{math.ceil(loading_node / training.memory_headroom / 2**20)}, or use a smaller model")
            problem = host_memory_problem(name, variant, host, training)
            if problem is not None:
                if parts is not None:  # CPU: the training state itself may be what is too big
                    problem += f", or {memory_estimate.knob_advice(parts, training, torch.device('cpu'))}"
                raise ConfigError("training.mem_mb", problem)
    return checked
