"""Per-GPU memory of a fine-tune worked out from a model's config.json alone, before any weights exist.

The gate (memory_estimate) needs the built model; choosing a strategy for a model bigger than one
GPU has to happen earlier. The model is built on the meta device (shapes, no storage, well under a
second for 70B), then parameters are priced per strategy:
  ddp   every GPU holds all base weights, the adapters, their gradients and AdamW state;
  fsdp  all of that is sharded over the world size, plus the units gathered for compute; its loading
        peak (:func:`loading_from_config`: a share plus one whole unit, rank 0's host copy) is checked too;
  qlora ddp with the base Linear weights in 4-bit nf4 (bitsandbytes through transformers) and the
        rest in fp32, as the workflow's QLoRA holds them (model/quantization.py, PEFT's k-bit preparation).
``python -m workflow_scripts.model.config_memory_estimate --config-json PATH --gpus 8 --gpu-memory 80GiB``
prints the table and one line saying whether it fits and what else would; exit status 1 if not.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from workflow_scripts.model import memory_estimate
from workflow_scripts.core.errors import ConfigError, WorkflowError, run_main
from workflow_scripts.core import fsdp_mesh
from workflow_scripts.core.fsdp_mesh import MESHES
from workflow_scripts.core.settings import TrainingSettings
from workflow_scripts.model.model_loading import weights_dtype

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import ModelSettings

STRATEGIES = ("ddp", "fsdp", "qlora")
QLORA_DEFAULT = {"bits": 4, "double_quant": True}
NF4_BLOCK = 64  # bitsandbytes' 4-bit blocksize: one absmax per 64 weights
NESTED_BLOCK = 256  # double quant: absmaxes stored in 8 bit, one fp32 scale per 256 of them
FP32 = memory_estimate.FP32


def meta_model(source) -> nn.Module:
    """A causal LM (or a vision-language model: a config with a ``vision_config``) with every tensor on the meta
    device, from a config.json path/dir, dict or config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

    if isinstance(source, nn.Module):
        return source
    if isinstance(source, (str, Path)):
        path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
        try:
            source = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise WorkflowError(f"{path}: cannot read a model config ({error})") from None
    if isinstance(source, Mapping):
        fields = dict(source)
        if "model_type" not in fields:
            raise ConfigError("model_type", "missing; is this a transformers config.json?")
        source = AutoConfig.for_model(fields.pop("model_type"), **fields)
    if not isinstance(source, PretrainedConfig):
        raise WorkflowError(f"not a model config: {type(source).__name__}")
    auto = AutoModelForImageTextToText if is_vision_language(source) else AutoModelForCausalLM
    with torch.device("meta"):  # no storage is allocated, so 70B costs what 70M does
        return auto.from_config(source)


def is_vision_language(config) -> bool:
    """A VLM of a family the workflow trains (model/vision_language_model.FAMILIES), from its config or fields."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from workflow_scripts.model.vision_language_model import FAMILIES

    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type) in FAMILIES


def budget_settings(config, max_pixels: int | None) -> dict[str, Any] | None:
    """A VLM's image-processor settings under ``max_pixels`` as tokenise_meta.json would hold them, for
    memory_estimate's tower patches: a dynamic-resolution tower's budget, or a tiling model's grids within it
    (all of them without a budget); None for a fixed-size tower."""
    vision = config.vision_config
    grids = getattr(config, "image_grid_pinpoints", None)
    if grids:
        kept = [grid for grid in grids if max_pixels is None or grid[0] * grid[1] <= max_pixels] or grids[:1]
        return {"image_grid_pinpoints": kept, "size": {"height": vision.image_size}}
    merge = getattr(vision, "spatial_merge_size", None)
    if max_pixels is None or merge is None:
        return None
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": vision.patch_size, "merge_size": merge,
            "size": {"longest_edge": max_pixels}}


def count_parameters(source) -> int:
    return sum(p.numel() for p in meta_model(source).parameters())  # parameters() counts tied ones once


def lora_parameters(model: nn.Module, rank: int, target_modules: Sequence[str]) -> tuple[int, int]:
    """(adapter parameters, adapted layers): rank*(in+out) per targeted nn.Linear, matched as PEFT does
    (the full module name, or its last dotted parts)."""
    params = layers = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in target_modules):
            params += rank * (module.in_features + module.out_features)
            layers += 1
    if not layers:
        raise ConfigError("lora.target_modules", f"{list(target_modules)} match no nn.Linear of the model")
    return params, layers


def _quantized_weight_bytes(module: nn.Linear, bits: int, double_quant: bool) -> int:
    n = module.weight.numel()
    if bits == 8:  # LLM.int8: int8 weights plus one fp32 scale per output row (SCB)
        return n + FP32 * module.out_features
    blocks = math.ceil(n / NF4_BLOCK)
    if double_quant:  # 8-bit absmax per block + fp32 scale per 256 blocks: ~0.127 bits/param
        return math.ceil(n / 2) + blocks + FP32 * math.ceil(blocks / NESTED_BLOCK)
    return math.ceil(n / 2) + FP32 * blocks  # fp32 absmax per block: 0.5 bits/param


def base_weight_bytes(model: nn.Module, dtype_bytes: int, quantization: Mapping[str, Any] | None):
    """(all base weights, the FSDP root unit, the largest FSDP unit) in bytes as stored.

    Quantised Linears are the ones transformers' bitsandbytes quantizer converts: plain nn.Linear not
    named by get_keys_to_not_convert (lm_head, the last module and tied weights). Embeddings, norms
    and biases stay in the compute dtype. FSDP units are the model's _no_split_modules (the decoder
    layers), as accelerate's auto-wrap policy picks them; everything else forms the root unit.
    """
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = get_keys_to_not_convert(model) if quantization else []
    units = {n for n, m in model.named_modules() if type(m).__name__ in (model._no_split_modules or ())}
    per_unit: dict[str, int] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        quantize = bool(quantization) and type(module) is nn.Linear and should_convert_module(name, skip)
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight is stored once
                continue
            seen.add(id(param))
            if quantize and pname == "weight":
                size = _quantized_weight_bytes(module, quantization["bits"], quantization.get("double_quant", True))
            else:  # peft.prepare_model_for_kbit_training would upcast these to fp32: fp32_unquantized
                size = param.numel() * (FP32 if quantization and quantization.get("fp32_unquantized") else dtype_bytes)
            prefixes = [name.rsplit(".", k)[0] for k in range(name.count(".") + 1)] if name else []
            unit = next((p for p in prefixes if p in units), "")
            per_unit[unit] = per_unit.get(unit, 0) + size
    root = per_unit.pop("", 0)
    return root + sum(per_unit.values()), root, max(per_unit.values(), default=0)


def estimate_from_config(source, *, strategy: str = "ddp", world_size: int = 1, shard_size: int | None = None,
                         lora: Mapping[str, Any] | None = None, precision: str = "bf16",
                         quantization: Mapping[str, Any] | None = None, micro_batch: int = 1,
                         max_length: int = 512, gradient_checkpointing: bool = True,
                         device: str = "cuda", max_pixels: int | None = None) -> dict[str, int]:
    """Bytes per GPU (per process with ``device="cpu"``) by part, and ``total``. ``lora=None`` is a full
    fine-tune; ``source`` may also be a meta model from :func:`meta_model`, so that several estimates
    build it once. ``shard_size``: the processes fsdp shards over when not the world (a hybrid mesh: a
    node's GPUs, core/fsdp_mesh.py).

    A vision-language model: LoRA on the language model only (as training adapts it, the tower frozen),
    its activations for ``max_length`` tokens (image tokens included), plus the frozen tower's working set on
    ``micro_batch`` images of at most ``max_pixels`` each (the variant's pixel budget; a fixed-size tower
    its image_size)."""
    if strategy not in STRATEGIES:
        raise ConfigError("strategy", f"'{strategy}' is not one of {', '.join(STRATEGIES)}")
    if world_size < 1:
        raise ConfigError("world_size", f"{world_size} must be at least 1")
    if strategy == "qlora":
        quantization = quantization or QLORA_DEFAULT
    if quantization is not None:  # prepare_model_for_kbit_training upcasts every unquantised weight to fp32
        quantization = {"fp32_unquantized": True, **quantization}
    if quantization is not None and quantization.get("bits") not in (4, 8):
        raise ConfigError("quantization.bits", f"{quantization.get('bits')} must be 4 or 8")
    if quantization is not None and lora is None:
        raise ConfigError("quantization", "quantised weights cannot be trained; a full fine-tune needs lora")
    if quantization is not None and strategy == "fsdp":  # as training/fsdp.py refuses it
        raise ConfigError("quantization", "fsdp shards unquantised weights only; use qlora or ddp for quantised ones")
    model = meta_model(source)
    vision = getattr(model.config, "vision_config", None)
    language = getattr(model.config, "text_config", None) or model.config
    shards = (shard_size or world_size) if strategy == "fsdp" else 1
    # The project stores frozen weights as model_loading does: bf16 on GPUs for bf16 runs, else fp32.
    dtype_bytes = torch.empty((), dtype=weights_dtype(precision, torch.device(device))).element_size()
    compute_bytes = 2 if precision in ("bf16", "fp16") else FP32
    total_base, root, largest_unit = base_weight_bytes(model, dtype_bytes, quantization)
    if lora is None:
        # Full fine-tune, mixed precision: fp32 master weights, fp32 gradients, two fp32 AdamW moments
        # (bf16 weights alone would lose updates below bf16's resolution).
        trainable = sum(p.numel() for p in model.parameters())
        weights, adapters, rank, adapted = trainable * FP32, 0, 0, 0
        # FSDP gathers units in the compute dtype (MixedPrecision param_dtype), not as stored.
        root, largest_unit = root * compute_bytes // dtype_bytes, largest_unit * compute_bytes // dtype_bytes
    else:
        rank = lora["rank"]
        targets = lora["target_modules"]
        if vision is not None:  # full names inside the language model: the tower's q_proj is no target
            from workflow_scripts.model.vision_language_model import lora_target_modules

            targets = lora_target_modules(model, list(targets), train_tower=False)
        trainable, adapted = lora_parameters(model, rank, targets)
        weights, adapters = total_base, trainable * FP32  # PEFT keeps adapters in fp32
    gradients = trainable * FP32
    if strategy != "fsdp" and world_size > 1:
        gradients *= 2  # DDP's reducer buckets hold a second copy (gradient_as_bucket_view=False)
    parts = {
        "weights": weights // shards,
        # The root unit stays gathered from forward to backward; one decoder layer is computed while
        # the next is prefetched. Adapters inside a gathered unit are too small to matter.
        "gathered_weights": root + 2 * largest_unit if shards > 1 else 0,
        "adapters": adapters // shards,
        "gradients": gradients // shards,
        "optimizer": trainable * FP32 * 2 // shards,
        "activations": memory_estimate.activation_bytes(
            language, micro_batch, max_length, compute_bytes, gradient_checkpointing,
            rank, adapted // max(1, language.num_hidden_layers) if adapted else 0) + (
            memory_estimate.vision_activation_bytes(vision, micro_batch, compute_bytes, False,
                                                    budget_settings(model.config, max_pixels)) if vision is not None else 0),
        "runtime_overhead": memory_estimate.CUDA_RUNTIME_OVERHEAD if device == "cuda" else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


def loading_from_config(source, *, strategy: str = "ddp", world_size: int = 1, shard_size: int | None = None,
                        lora: Mapping[str, Any] | None = None,
                        precision: str = "bf16", device: str = "cuda", **_loop_settings) -> dict[str, int] | None:
    """FSDP's loading peak per GPU (per process with ``device="cpu"``), by part as
    ``memory_estimate.loading_estimate`` gives it, with ``total``; None unless fsdp over 2+ processes.

    ``shards`` (its share of every weight, over ``shard_size`` processes if given), ``whole_unit`` (the
    largest unit whole: rank 0 moves one unit at a time to its GPU before sharding it), ``host_copy`` (rank
    0's copy of the whole model, counted on the CPU, where it shares the node with the processes)."""
    if strategy != "fsdp" or world_size < 2:
        return None
    model = meta_model(source)
    dtype_bytes = torch.empty((), dtype=weights_dtype(precision, torch.device(device))).element_size()
    total_base, root, largest_unit = base_weight_bytes(model, dtype_bytes, None)
    if lora is None:  # a full fine-tune loads fp32 master weights
        scale = FP32 / dtype_bytes
        whole, unit = sum(p.numel() for p in model.parameters()) * FP32, int(max(root, largest_unit) * scale)
    else:
        whole, unit = total_base + lora_parameters(model, lora["rank"], lora["target_modules"])[0] * FP32, max(root, largest_unit)
    parts = {"shards": whole // (shard_size or world_size), "whole_unit": unit,
             "host_copy": whole if device == "cpu" else 0,
             "runtime_overhead": memory_estimate.CUDA_RUNTIME_OVERHEAD if device == "cuda" else 0}
    parts["total"] = sum(parts.values())
    return parts


def training_arguments(training: TrainingSettings) -> dict[str, Any]:
    """estimate_from_config's settings from typed training settings (training.quantization included)."""
    quantization = training.quantization
    return {
        "lora": None if training.full else dataclasses.asdict(training.lora), "precision": training.precision,
        # A token budget bounds a micro-batch's slots; as whole rows of max_length, rounded up (a safe side).
        "micro_batch": (training.micro_batch if training.micro_batch_tokens is None
                        else -(-training.micro_batch_tokens // training.max_length)),
        "max_length": training.max_length,
        "gradient_checkpointing": training.gradient_checkpointing,
        "quantization": None if quantization is None else {"bits": quantization.bits,
                                                           "double_quant": quantization.double_quant},
    }


def mesh_arguments(training: TrainingSettings) -> dict[str, Any]:
    """estimate_from_config's strategy, world size and, on a hybrid FSDP mesh, the shard size (a node's ranks)."""
    return {"strategy": training.strategy, "world_size": training.world_size,
            "shard_size": fsdp_mesh.shards(training) if training.sharded else None}


def advise(source, *, capacity: int, headroom: float = 0.9, **settings) -> dict[str, Any]:
    """Whether the run fits ``headroom`` of ``capacity`` bytes per GPU, and if not which one change would:
    ``fits``, ``estimate``, ``alternatives`` ([(change, total)] that fit) and ``line`` for the user."""
    model = meta_model(source)
    settings = {"strategy": "ddp", "world_size": 1, "micro_batch": 1, "gradient_checkpointing": True, **settings}
    budget = int(capacity * headroom)
    parts = estimate_from_config(model, **settings)
    loading = loading_from_config(model, **settings)
    h = memory_estimate.human
    need = max(parts["total"], loading["total"] if loading else 0)
    while_loading = " (its loading peak)" if need > parts["total"] else ""
    mesh = (f" (hybrid: sharded over {settings['shard_size']} per node)"
            if settings["strategy"] == "fsdp" and settings.get("shard_size") else "")
    head = (f"{settings['strategy']} on {settings['world_size']} GPU(s){mesh} needs {h(need)} per GPU{while_loading}; "
            f"{h(budget)} allowed ({headroom:.0%} of {h(capacity)})")
    if need <= budget:
        return {"fits": True, "estimate": parts, "loading": loading, "alternatives": [], "line": f"fits: {head}"}
    tries: list[tuple[str, dict]] = []
    if settings["strategy"] != "fsdp" and settings["world_size"] > 1:
        # FSDP shards unquantised weights: from qlora, the fsdp figure is bf16 weights over the same GPUs.
        tries.append(("--strategy fsdp", {"strategy": "fsdp", "quantization": None}))
    if settings.get("lora") is not None and not (settings["strategy"] == "qlora" or settings.get("quantization")):
        tries.append(("--strategy qlora", {"strategy": "qlora", "quantization": None}))
    if not settings["gradient_checkpointing"]:
        tries.append(("gradient checkpointing on", {"gradient_checkpointing": True}))
    alternatives = []
    def peak(changed) -> int:  # the loop's or, under fsdp, the loading's, whichever is larger
        loads = loading_from_config(model, **changed)
        return max(estimate_from_config(model, **changed)["total"], loads["total"] if loads else 0)

    for label, change in tries:
        total = peak({**settings, **change})
        if total <= budget:
            alternatives.append((label, total))
    micro = settings["micro_batch"] // 2
    while micro >= 1:  # the largest smaller micro-batch that fits; gradient accumulation keeps the batch
        total = peak({**settings, "micro_batch": micro})
        if total <= budget:
            alternatives.append((f"--micro-batch {micro}", total))
            break
        micro //= 2
    if alternatives:
        fixes = "; ".join(f"{label} ({h(total)})" for label, total in alternatives)
        line = f"does not fit: {head}. Would fit: {fixes}"
    else:
        line = (f"does not fit: {head}; no single change tried fits (fsdp, qlora, checkpointing, micro-batch): "
                "use fsdp over more GPUs, a shorter --max-length or a smaller model")
    return {"fits": False, "estimate": parts, "loading": loading, "alternatives": alternatives, "line": line}


# Declared memory ---------------------------------------------------------------------------------
# Tiny architectures whose config this module can build from model.tiny alone (the causal LMs).
TINY_CAUSAL = ("llama", "qwen2")


def model_folders(name: str, spec: "ModelSettings", root: Path) -> list[Path]:
    """Where a model's files are before any job runs: its prepared ``resources/models/<name>/``, then a local
    model's own directory (the config-time readers of config.json and of the processor files look in these)."""
    return [root / "resources" / "models" / name] + ([root / spec.path] if spec.source == "local" else [])


def local_model_config(name: str, spec: "ModelSettings", root: Path, key: str | None = None) -> dict | None:
    """The model's config without downloading anything: its prepared ``resources/models/<name>/config.json``,
    a local model's own directory, or for a tiny causal LM one built from ``model.tiny``; None otherwise
    (a hub or GGUF model not yet prepared: the gate estimates it once it exists)."""
    from workflow_scripts.model.processor_files import read_json

    for folder in model_folders(name, spec, root):
        path = folder / "config.json"
        if path.is_file():
            try:
                fields = read_json(path, "a model config")
            except WorkflowError as error:
                raise ConfigError(key or f"models.{name}", str(error)) from None
            return fields if isinstance(fields, dict) else {}
    tiny = spec.tiny
    if spec.source == "tiny" and tiny.architecture in TINY_CAUSAL:
        # model.tiny.vocab_size bounds the trained tokenizer's size, so the estimate cannot fall short.
        return {"model_type": tiny.architecture, "vocab_size": tiny.vocab_size,
                "hidden_size": tiny.hidden_size, "intermediate_size": tiny.intermediate_size,
                "num_hidden_layers": tiny.num_layers, "num_attention_heads": tiny.num_heads,
                "num_key_value_heads": tiny.num_heads, "tie_word_embeddings": False}
    return None


def is_causal_lm(fields: Mapping[str, Any]) -> bool:
    """Only causal LMs are built here (meta_model); others (VLMs, encoders) are left to the gate."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return fields.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


# Host memory (training.mem_mb, per node) --------------------------------------------------------
GiB = 2**30
# One training process beside the tensors it keeps in host memory: the interpreter with torch, transformers
# and the workflow imported. A tiny CPU train run peaks at about 550 MiB resident (torch 2.13, transformers
# 5.23; tests/test_config_memory_estimate.py measures it on every run); 1 GiB leaves room for other builds.
PROCESS_HOST_BYTES = GiB
# A CUDA process adds its context and the host side of the CUDA libraries (cuBLAS, cuDNN, NCCL): our
# convention, not measured here (the machine that wrote this has no GPU).
CUDA_HOST_BYTES = 2 * GiB
# A DataLoader worker (a fork of its rank): its own heap and the batches it prefetches and collates.
DATALOADER_WORKER_BYTES = GiB // 2


def host_memory(model: nn.Module, training: TrainingSettings, parts: Mapping[str, int] | None = None) -> dict[str, int]:
    """Host memory one node of a training job needs (bytes), by part, and ``total``.

    Every rank on the node (``training.gpus``, or ``cpu_processes`` on CPU) holds the process itself and its
    host copy during loading: on CPU the whole training state (``parts``, estimate_from_config's per-process
    figure); on a GPU, where model_loading loads with ``device_map={"": device}`` so each tensor goes straight
    to the GPU, the largest tensor on its way there (counted in fp32, as a checkpoint may store it). FSDP adds
    one full copy of the weights as loaded, for rank 0 to load and hand out the shards. Each rank's
    ``training.dataloader_workers`` come on top. The safetensors files' pages (page cache, shared by the
    ranks and reclaimable) are not counted.
    """
    cuda = training.gpus > 0
    ranks = training.gpus if cuda else training.cpu_processes
    if cuda:
        copy = max(p.numel() for p in model.parameters()) * FP32
        per_rank = PROCESS_HOST_BYTES + CUDA_HOST_BYTES + copy
    else:
        if parts is None:
            parts = estimate_from_config(model, device="cpu", **mesh_arguments(training),
                                         **training_arguments(training))
        copy = parts["total"]
        per_rank = PROCESS_HOST_BYTES + copy
    full_copy = 0
    if cuda and training.strategy == "fsdp":
        dtype_bytes = torch.empty((), dtype=weights_dtype(training.precision, torch.device("cuda"))).element_size()
        full_copy = base_weight_bytes(model, dtype_bytes, None)[0]
    workers = ranks * training.dataloader_workers * DATALOADER_WORKER_BYTES
    return {"ranks": ranks, "per_rank": per_rank, "host_copy": copy, "rank0_full_copy": full_copy,
            "dataloader_workers": workers, "total": ranks * per_rank + full_copy + workers}


def host_memory_problem(name: str, variant: str, host: Mapping[str, int], training: TrainingSettings) -> str | None:
    """The message when ``host`` exceeds the headroom share of ``training.mem_mb``; None when it fits."""
    declared = training.mem_mb * 2**20
    budget = int(declared * training.memory_headroom)
    if host["total"] <= budget:
        return None
    h = memory_estimate.human
    needed_mb = math.ceil(host["total"] / training.memory_headroom / 2**20)
    what = (f"{host['ranks']} GPU rank(s) on a node need about {h(host['total'])} of host memory: each "
            f"{h(host['per_rank'])} (the process with its CUDA context, and {h(host['host_copy'])} for the largest "
            "tensor on its way to the GPU)" if training.gpus > 0 else
            f"{host['ranks']} training process(es) on a node need about {h(host['total'])}: each "
            f"{h(host['per_rank'])} (the process, and {h(host['host_copy'])} of weights, adapters, optimizer state "
            "and activations)")
    if host["rank0_full_copy"]:
        what += f", plus {h(host['rank0_full_copy'])} for rank 0's full copy of the weights (fsdp)"
    if host["dataloader_workers"]:
        what += (f", plus {h(host['dataloader_workers'])} for {training.dataloader_workers} DataLoader "
                 "worker(s) per rank")
    return (f"model '{name}', variant '{variant}': {what}; over {training.memory_headroom:.0%} of the declared "
            f"mem_mb {training.mem_mb} ({h(budget)}). Fix: raise training.mem_mb to at least {needed_mb}")


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '81920MiB' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ConfigError("gpu-memory", f"'{text}' is not a size such as 80GiB or 80GB")
    unit = (match.group(2) or "B").upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    return int(float(match.group(1)) * base ** " KMGT".index((unit.rstrip("I") or " ")))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflow_scripts.model.config_memory_estimate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-json", required=True, help="a model's config.json, or its directory")
    parser.add_argument("--gpus", type=int, default=1, help="world size: GPUs over all nodes")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (evenly)")
    parser.add_argument("--fsdp-mesh", choices=MESHES, help="fsdp on several nodes: hybrid (default: shard "
                        "within a node, replicate across nodes) or flat (shard over all GPUs)")
    parser.add_argument("--gpu-memory", type=parse_size, required=True, help="per GPU, e.g. 80GiB")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tune")
    parser.add_argument("--target-modules", default="q_proj,k_proj,v_proj,o_proj", help="comma-separated")
    parser.add_argument("--bits", type=int, choices=(4, 8), help="quantise the base weights (default 4 for qlora)")
    parser.add_argument("--no-double-quant", action="store_true", help="4-bit: fp32 absmax per block")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--max-pixels", type=int, help="a vision-language model's pixel budget per image (the variant's "
                        "max_pixels); the frozen tower's activations follow it")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--headroom", type=float, default=0.9, help="share of GPU memory the estimate may use")
    args = parser.parse_args(argv)
    lora = {"rank": args.lora_rank, "target_modules": args.target_modules.split(",")} if args.lora_rank else None
    quantization = {"bits": args.bits, "double_quant": not args.no_double_quant} if args.bits else None
    if args.strategy == "qlora" and quantization is None:
        quantization = {**QLORA_DEFAULT, "double_quant": not args.no_double_quant}
    if args.nodes < 1 or args.gpus % args.nodes:
        raise ConfigError("nodes", f"{args.nodes} nodes cannot share {args.gpus} GPUs evenly; give --gpus as a "
                          "multiple of --nodes (the GPUs over all nodes)")
    hybrid = args.nodes > 1 and args.gpus > args.nodes and args.fsdp_mesh != "flat"  # fsdp only; also its alternative
    result = advise(args.config_json, capacity=args.gpu_memory, headroom=args.headroom, strategy=args.strategy,
                    world_size=args.gpus, shard_size=args.gpus // args.nodes if hybrid else None, lora=lora,
                    precision=args.precision, quantization=quantization,
                    micro_batch=args.micro_batch, max_length=args.max_length,
                    gradient_checkpointing=not args.no_gradient_checkpointing, max_pixels=args.max_pixels)
    for part, size in result["estimate"].items():
        print(f"{part:<18}{memory_estimate.human(size):>12}")
    if result["loading"]:  # fsdp: the peak while rank 0's weights are sharded out, before the loop
        print("loading peak " + ", ".join(f"{k} {memory_estimate.human(v)}" for k, v in result["loading"].items()))
    print(result["line"])
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    run_main(main)
