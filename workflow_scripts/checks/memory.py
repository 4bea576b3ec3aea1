"""Before any job runs: each (model, variant) whose model config is here, estimated against the memory
its config declares (model/config_memory_estimate prices it; the task types say which models are causal LMs
and which vision-language models, whose images count at the variant's pixel budget).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch

from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.model import memory_estimate
from workflow_scripts.model.config_memory_estimate import (
    PROCESS_HOST_BYTES, estimate_from_config, host_memory, host_memory_problem, is_causal_lm, is_vision_language,
    loading_from_config, local_model_config, mesh_arguments, model_folders, meta_model, training_arguments)
from workflow_scripts.tasks import task_named


def check_declared_memory(config: Mapping[str, Any], root: Path | str = ".") -> list[dict[str, Any]]:
    """Estimate every (model, variant) whose model config is here, before any job runs, and raise a
    ConfigError naming ``training.mem_mb`` and the figure needed when one needs more host memory per node
    than the config declares (``config_memory_estimate.host_memory``: CPU and GPU jobs; CPU fsdp's loading).

    A vision-language model (a family of model/vision_language_model.FAMILIES, under the vision_language task)
    is estimated with its images at the variant's pixel budget (``variants.<v>.max_pixels``; a fixed-size
    tower at its image size), as pretokenise and training apply it.

    Returns what was checked: ``[{model, variant, estimate, host, loading, declared, processes, max_pixels}]``
    (``estimate``/``loading``: the per-process figures of a CPU job, None for a GPU job, whose device memory
    the gate checks).
    """
    root = Path(root)
    checked = []
    # Only the (model, variant) pairs the matrix runs, each with the class its task loads; a model is estimated
    # only as the class meta_model builds from its config: a BERT under a masked-LM task is not estimated as
    # BertLMHeadModel, nor a text-only model under vision_language (task_fit refuses that).
    pairs = {(model, variant): task_named(xc.entry_task(config, entry)).auto_model_class
             for model, entry, variant in xc.model_entry_variants(config)}
    variant_entries = xc.variant_entries(config)
    for name, spec in xc.model_entries(config).items():
        source = local_model_config(name, spec, root, xc.model_key(config, name))
        if source is None:
            continue  # nothing to read without a download
        loads = ("AutoModelForImageTextToText" if is_vision_language(source) else
                 "AutoModelForCausalLM" if is_causal_lm(source) else None)
        variants = [variant for variant in config["variants"] if loads and pairs.get((name, variant)) == loads]
        if not variants:
            continue
        model = meta_model(source)
        for variant in variants:
            training = xc.training_settings(config, variant, name)
            # The variant's pixel budget (else the prepared processor's own) bounds each image's patches in the
            # tower (the language sequence's image tokens are within max_length); the text-only control has none.
            settings = variant_entries[variant]
            max_pixels = None
            if loads == "AutoModelForImageTextToText" and settings.images:
                max_pixels = settings.max_pixels or processor_max_pixels(name, spec, root, xc.model_key(config, name))
            parts = loading = None
            if training.gpus == 0:
                parts = estimate_from_config(model, device="cpu", **mesh_arguments(training),
                                             **training_arguments(training), max_pixels=max_pixels)
                loading = loading_from_config(model, device="cpu", **mesh_arguments(training),
                                              **training_arguments(training))
            host = host_memory(model, training, parts)
            checked.append({"model": name, "variant": variant, "estimate": parts, "host": host, "loading": loading,
                            "declared": training.mem_mb * 2**20, "processes": host["ranks"],
                            "max_pixels": max_pixels})
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
                    if max_pixels is not None:
                        now = "" if settings.max_pixels else ", the processor's own"
                        problem += (f", or lower variants.{variant}.max_pixels (now {max_pixels}{now}: each image's "
                                    "patches in the vision tower count at it)")
                raise ConfigError("training.mem_mb", problem)
    return checked


def processor_max_pixels(name: str, spec, root: Path, key: str | None = None) -> int | None:
    """A dynamic-resolution processor's own budget, for a variant that sets none (Qwen2.5-VL's is 12,845,056 pixels,
    16,384 image tokens), read from the model's folder in either layout (``model/processor_files``: the Hub's
    ``preprocessor_config.json`` or transformers 5's ``processor_config.json``), as pretokenise, training and
    evaluation read it. None where there is no such file or budget (the tower's own size)."""
    from workflow_scripts.model import processor_files

    for directory in model_folders(name, spec, root):
        try:
            settings = processor_files.read(directory)
        except WorkflowError as error:
            raise ConfigError(key or f"models.{name}", str(error)) from None
        if settings is not None:
            return settings.max_pixels()
    return None
