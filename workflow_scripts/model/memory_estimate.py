"""An estimate of one training process's peak memory, compared with its device before the run starts.

Weights, adapters, gradients and optimizer state are counted from the built model; activations come
from the model's shape and the micro-batch (per token and layer, for an SDPA decoder layer), so the
gate can say which knob to turn. The seed's hand-made budget (20 GB "should fit" in 24 GB) is what
this replaces; training records the measured peak beside it.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch import nn

CUDA_RUNTIME_OVERHEAD = 1 << 30  # CUDA context, cuBLAS workspaces and allocator fragmentation
FP32 = 4


def _config_value(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def activation_bytes(config, micro_batch: int, max_length: int, activation_dtype_bytes: int,
                     gradient_checkpointing: bool, lora_rank: int, lora_targets: int) -> int:
    """Saved activations of one micro-batch of full-length rows, plus the target-token logits."""
    hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
    inter = _config_value(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_value(config, "num_attention_heads", "n_head")
    vocab = _config_value(config, "vocab_size")
    tokens = micro_batch * max_length
    # Per token and layer: norms, q/k/v/o in and out, residuals (~11 h) and the gated MLP (~4 I),
    # plus each LoRA layer's rank-r intermediate.
    per_layer = 11 * hidden + 4 * inter + lora_rank * lora_targets
    if getattr(config, "_attn_implementation", "sdpa") == "eager":
        per_layer += 2 * heads * max_length  # attention scores and probabilities
    if gradient_checkpointing:
        # Each layer keeps its input; one layer at a time is recomputed in full during backward.
        elements = tokens * (hidden * layers + per_layer)
    else:
        elements = tokens * per_layer * layers
    # fp32 logits and their gradient, for target tokens (at most every token).
    logits = tokens * vocab * FP32 * 2
    return elements * activation_dtype_bytes + logits


def vision_activation_bytes(vision, images: int, dtype_bytes: int, trains: bool) -> int:
    """The vision tower on ``images`` images (one per row): one layer's working set when frozen (nothing
    is saved for backward), every layer's saved activations when it trains."""
    hidden = _config_value(vision, "hidden_size", default=0)
    inter = _config_value(vision, "intermediate_size", default=4 * hidden)
    layers = _config_value(vision, "num_hidden_layers", default=1)
    size, patch = _config_value(vision, "image_size", default=0), _config_value(vision, "patch_size", default=1)
    tokens = images * ((size // max(1, patch)) ** 2 + 1)
    per_layer = 11 * hidden + 2 * inter
    return tokens * per_layer * (layers if trains else 1) * dtype_bytes


def estimate(peft_model: nn.Module, training: Mapping[str, Any], device: torch.device) -> dict[str, int]:
    """Bytes per process by component; ``total`` includes the CUDA runtime overhead on GPUs."""
    from workflow_scripts.model.quantization import quant_state_bytes

    # A bitsandbytes weight counts as stored (a Params4bit holds n/2 uint8), plus its absmax/scales.
    frozen = sum(p.numel() * p.element_size() for p in peft_model.parameters() if not p.requires_grad)
    frozen += quant_state_bytes(peft_model)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    adapters = sum(p.numel() * p.element_size() for p in trainable)
    gradients = adapters
    optimizer = sum(p.numel() for p in trainable) * FP32 * 2  # AdamW: two fp32 moments
    activation_dtype_bytes = 2 if training["precision"] in ("bf16", "fp16") else FP32
    config = peft_model.get_base_model().config
    # A VLM: the language model's sequence holds the image tokens (max_length counts them), and the
    # vision tower runs on each image; its activations are kept only when it trains.
    language = getattr(config, "text_config", None) or config
    lora_targets = sum(1 for name, _ in peft_model.named_modules() if name.endswith("lora_A"))
    layers = _config_value(language, "num_hidden_layers", "n_layer", "num_layers", default=1)
    activations = activation_bytes(
        language, training["micro_batch"], training["max_length"], activation_dtype_bytes,
        training["gradient_checkpointing"], training["lora"]["rank"], max(1, lora_targets // max(1, layers)),
    )
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        activations += vision_activation_bytes(vision, training["micro_batch"], activation_dtype_bytes,
                                               bool(training["lora"].get("train_vision_tower")))
    overhead = CUDA_RUNTIME_OVERHEAD if device.type == "cuda" else 0
    parts = {
        "weights": frozen, "adapters": adapters, "gradients": gradients,
        "optimizer": optimizer, "activations": activations, "runtime_overhead": overhead,
    }
    parts["total"] = sum(parts.values())
    return parts


def device_capacity(device: torch.device, processes_on_device: int = 1) -> int:
    """Memory one process may count on: the GPU's total, or this node's RAM shared by its processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as handle:
            info = dict(line.split(":", 1) for line in handle)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return available // max(1, processes_on_device)


def knob_advice(parts: Mapping[str, int], training: Mapping[str, Any], device: torch.device) -> str:
    """What to change, starting from the largest component of the estimate."""
    largest = max(("weights", "activations", "optimizer", "adapters"), key=lambda k: parts[k])
    if largest == "activations":
        advice = [f"lower training.micro_batch (now {training['micro_batch']}; gradient accumulation keeps "
                  f"the effective batch)", f"or training.max_length (now {training['max_length']})"]
        if not training["gradient_checkpointing"]:
            advice.insert(0, "set training.gradient_checkpointing: true")
        return ", ".join(advice)
    if largest == "weights":
        qlora = "" if training.get("quantization") else ", or set training.quantization: {bits: 4} (QLoRA)"
        if device.type == "cuda" and training["precision"] != "bf16":
            return ("set training.precision: bf16 (frozen weights are then stored in bf16), or use a GPU with more "
                    "memory" + qlora)
        return ("use a device with more memory or a smaller model" + qlora + "; the frozen weights alone need "
                + human(parts["weights"]))
    return f"lower training.lora.rank (now {training['lora']['rank']}) or the number of training.lora.target_modules"


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def peak_memory_bytes(device: torch.device) -> int:
    """Measured peak: allocated CUDA memory, or this process's maximum resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
