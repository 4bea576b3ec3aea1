"""An estimate of one training process's peak memory, compared with its device before the run starts.

Weights, adapters, gradients and optimizer state are counted from the built model; activations come
from the model's shape and the micro-batch (per token and layer, for an SDPA decoder layer), so the
gate can say which knob to turn. The seed's hand-made budget (20 GB "should fit" in 24 GB) is what
this replaces; training records the measured peak beside it.
"""
from __future__ import annotations

import os
from typing import Mapping

import torch
from torch import nn

from workflow_scripts.core import fsdp_mesh
from workflow_scripts.core.settings import TrainingSettings

CUDA_RUNTIME_OVERHEAD = 1 << 30  # CUDA context, cuBLAS workspaces and allocator fragmentation
FP32 = 4


def _config_value(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def activation_bytes(config, micro_batch: int, max_length: int, activation_dtype_bytes: int,
                     gradient_checkpointing: bool, lora_rank: int, lora_targets: int,
                     activation_offloading: bool = False, fused_cross_entropy: bool = False,
                     tokens: int | None = None, checkpointed_layers: int | None = None) -> int:
    """Saved activations of one micro-batch of full-length rows, plus the target-token logits.

    ``tokens``: the micro-batch's token slots when not ``micro_batch x max_length``: under
    ``training.micro_batch_tokens`` the budget bounds rows x width (the padded or packed tensor), and no
    row is wider than max_length, so attention scores stay within tokens x max_length per head.

    ``activation_offloading`` (with checkpointing): the layer inputs checkpointing keeps live in host
    memory, so the device holds only the layer being recomputed. ``checkpointed_layers`` (with checkpointing):
    only that many layers recompute (``model_loading.checkpoint_first_layers``), the others keep their
    activations; None: every layer. ``fused_cross_entropy``: Liger's fused
    loss computes the logits in chunks of about tokens / ceil(vocab / hidden) rows, so it holds about
    tokens x hidden fp32 logits (and their gradient) instead of tokens x vocab."""
    hidden = _config_value(config, "hidden_size", "n_embd", "d_model")
    inter = _config_value(config, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _config_value(config, "num_attention_heads", "n_head")
    vocab = _config_value(config, "vocab_size")
    tokens = micro_batch * max_length if tokens is None else tokens
    # Per token and layer: norms, q/k/v/o in and out, residuals (~11 h) and the gated MLP (~4 I),
    # plus each LoRA layer's rank-r intermediate.
    per_layer = 11 * hidden + 4 * inter + lora_rank * lora_targets
    if getattr(config, "_attn_implementation", "sdpa") == "eager":
        per_layer += 2 * heads * max_length  # attention scores and probabilities
    checkpointed = layers if checkpointed_layers is None else max(0, min(layers, checkpointed_layers))
    if gradient_checkpointing and checkpointed:
        # Each checkpointed layer keeps its input (on the host when offloaded); the layers left out keep all their
        # activations. The backward frees those (the last layers) before it recomputes the checkpointed ones, one
        # at a time, so the peak holds per_layer for max(left out, 1) layers: with every layer checkpointed, the
        # one being recomputed.
        elements = tokens * ((0 if activation_offloading else hidden * checkpointed)
                             + per_layer * max(layers - checkpointed, 1))
    else:
        elements = tokens * per_layer * layers
    # fp32 logits and their gradient, for target tokens (at most every token).
    logits = tokens * (min(hidden, vocab) if fused_cross_entropy else vocab) * FP32 * 2
    return elements * activation_dtype_bytes + logits


def tower_patches_per_image(vision, image_processor: Mapping | None = None) -> int:
    """Patches the vision tower sees for one image: a fixed-size tower's (image_size / patch_size)^2 plus a class
    token (times the tiles of a tiling processor's largest grid, the whole image included), or under a
    dynamic-resolution processor's pixel budget (``image_processor``: its settings, as tokenise_meta.json holds
    them) max_pixels / patch_size^2, the most one image can become."""
    from workflow_scripts.model.vision_language_model import max_image_tokens

    from workflow_scripts.model.vision_language_model import max_tiles

    budget = max_image_tokens(image_processor) if image_processor else None
    if budget is not None:
        return budget * image_processor["merge_size"] ** 2
    size, patch = _config_value(vision, "image_size", default=0), _config_value(vision, "patch_size", default=1)
    tiles = max_tiles(image_processor) if image_processor else None  # any-resolution tiling: every tile a pass
    return (tiles or 1) * ((size // max(1, patch)) ** 2 + 1)


def image_tokens_per_image(vision, image_processor: Mapping | None = None) -> int:
    """Image tokens one image puts in the language sequence: under a pixel budget max_pixels / (patch x merge)^2,
    else one per patch (the fixed-size estimate: LLaVA's count; Idefics3's pixel shuffle makes fewer)."""
    from workflow_scripts.model.vision_language_model import max_image_tokens

    budget = max_image_tokens(image_processor) if image_processor else None
    if budget is not None:
        return budget
    size, patch = _config_value(vision, "image_size", default=0), _config_value(vision, "patch_size", default=1)
    return (size // max(1, patch)) ** 2


def images_per_micro_batch(training: TrainingSettings, vision, image_processor: Mapping | None = None) -> int:
    """Images (one per row) in a VLM micro-batch: micro_batch, or under a token budget the budget over the
    image tokens each row holds (its language sequence counts them), so at most that many rows fit."""
    if training.micro_batch_tokens is None:
        return training.micro_batch
    return max(1, training.micro_batch_tokens // max(1, image_tokens_per_image(vision, image_processor)))


def vision_activation_bytes(vision, images: int, dtype_bytes: int, trains: bool,
                            image_processor: Mapping | None = None) -> int:
    """The vision tower on ``images`` images (one per row): one layer's working set when frozen (nothing
    is saved for backward), every layer's saved activations when it trains; each image at the most patches
    its processor's budget allows."""
    hidden = _config_value(vision, "embed_dim", "hidden_size", default=0)  # Qwen2-VL: embed_dim is the width
    inter = _config_value(vision, "intermediate_size", default=4 * hidden)
    layers = _config_value(vision, "num_hidden_layers", "depth", default=1)
    tokens = images * tower_patches_per_image(vision, image_processor)
    per_layer = 11 * hidden + 2 * inter
    return tokens * per_layer * (layers if trains else 1) * dtype_bytes


def _largest_shard(param: torch.Tensor, shards: int) -> int:
    """Elements of the largest dim-0 chunk FSDP2 gives a rank (rank 0's: ceil(rows / shards) rows)."""
    if shards == 1 or param.dim() == 0:
        return param.numel()
    rows = param.shape[0]
    return -(-rows // shards) * (param.numel() // max(1, rows))


def _bytes(params, shards: int = 1) -> int:
    return sum(_largest_shard(p, shards) * p.element_size() for p in params)


def _units(peft_model: nn.Module) -> list[list[torch.Tensor]]:
    """fsdp.shard's units, each as its parameters: the root (what no decoder layer holds: embeddings,
    final norm, head) first, then the decoder layers."""
    base = peft_model.get_base_model()
    blocks = set(getattr(base, "_no_split_modules", None) or ())
    # Once sharded, a layer's class is FSDP<Layer>, a subclass.
    layers = [child for module in base.modules() if isinstance(module, nn.ModuleList) for child in module
              if any(cls.__name__ in blocks for cls in type(child).__mro__)]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    return [[p for p in peft_model.parameters() if id(p) not in in_layers], *(list(l.parameters()) for l in layers)]


def gathered_bytes(peft_model: nn.Module, precision: str) -> int:
    """What FSDP2 holds unsharded at once: the root unit (embeddings, final norm, head) from forward to
    backward, and one decoder layer computing while the next is prefetched, in the compute dtype."""
    def unsharded(params) -> int:  # MixedPrecisionPolicy(param_dtype=bf16) gathers bf16 copies
        return sum(p.numel() * (2 if precision == "bf16" else p.element_size()) for p in params)

    root, *layers = _units(peft_model)
    return unsharded(root) + 2 * max((unsharded(layer) for layer in layers), default=0)


def loading_estimate(peft_model: nn.Module, training: TrainingSettings, device: torch.device) -> dict[str, int] | None:
    """FSDP's loading peak per process (``fsdp.shard``), by part, with ``total``; None unless the model is
    sharded over several processes (a world of one keeps no second copy).

    ``shards``: this rank's share of every parameter, as stored; ``whole_unit``: the largest unit whole
    (rank 0's ``fully_shard`` moves one unit at a time to the device before sharding it; the tensor
    ``set_model_state_dict`` broadcasts is smaller); ``host_copy``: the whole model rank 0 reads into host
    memory, counted when the device is the host (the CPU), for the process that holds it.
    """
    if not training.sharded or training.world_size < 2:
        return None
    shards = fsdp_mesh.shards(training)  # a node's ranks on a hybrid mesh, else the world
    params = list(peft_model.parameters())
    parts = {
        "shards": _bytes(params, shards),
        "whole_unit": max(_bytes(unit) for unit in _units(peft_model)),
        "host_copy": _bytes(params) if device.type == "cpu" else 0,
        "runtime_overhead": CUDA_RUNTIME_OVERHEAD if device.type == "cuda" else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


def estimate(peft_model: nn.Module, training: TrainingSettings, device: torch.device,
             image_processor: Mapping | None = None, checkpointed_layers: int | None = None) -> dict[str, int]:
    """Bytes per process by component; ``total`` includes the CUDA runtime overhead on GPUs.

    ``image_processor``: a VLM's image-processor settings as pretokenise recorded them (tokenise_meta.json),
    whose pixel budget bounds the patches each image gives the tower.

    Under ``training.strategy: fsdp`` every parameter is sharded over the world size, or on a hybrid
    mesh over a node's ranks (``fsdp.shard`` wraps each decoder layer and the root), so weights, adapters, gradients and AdamW state count one
    rank's share, plus the units gathered for compute. The model may be sharded already or not: sizes
    are read from the parameters' full shapes either way (a DTensor reports its global shape).
    """
    from workflow_scripts.model.quantization import quant_state_bytes

    sharded = training.sharded
    shards = fsdp_mesh.shards(training)  # 1 unsharded; a node's ranks on a hybrid mesh
    # A bitsandbytes weight counts as stored (a Params4bit holds n/2 uint8), plus its absmax/scales.
    frozen = _bytes((p for p in peft_model.parameters() if not p.requires_grad), shards)
    frozen += quant_state_bytes(peft_model)  # FSDP refuses quantised weights: never sharded
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    adapters = _bytes(trainable, shards)
    gradients = adapters
    if not sharded and training.world_size > 1:
        gradients *= 2  # DDP's reducer buckets hold a second copy (gradient_as_bucket_view=False)
    optimizer = sum(_largest_shard(p, shards) for p in trainable) * FP32 * 2  # AdamW: two fp32 moments
    activation_dtype_bytes = 2 if training.precision in ("bf16", "fp16") else FP32
    config = getattr(peft_model, "get_base_model", lambda: peft_model)().config  # no PEFT wrap when finetune: full
    # A VLM: the language model's sequence holds the image tokens (max_length counts them), and the
    # vision tower runs on each image; its activations are kept only when it trains.
    language = getattr(config, "text_config", None) or config
    lora_targets = sum(1 for name, _ in peft_model.named_modules() if name.endswith("lora_A"))
    layers = _config_value(language, "num_hidden_layers", "n_layer", "num_layers", default=1)
    activations = activation_bytes(
        language, training.micro_batch, training.max_length, activation_dtype_bytes,
        training.gradient_checkpointing, training.lora.rank, max(1, lora_targets // max(1, layers)),
        training.activation_offloading, training.fused_cross_entropy, training.micro_batch_tokens,
        checkpointed_layers,
    )
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        activations += vision_activation_bytes(vision, images_per_micro_batch(training, vision, image_processor),
                                               activation_dtype_bytes, training.lora.train_vision_tower,
                                               image_processor)
    overhead = CUDA_RUNTIME_OVERHEAD if device.type == "cuda" else 0
    parts = {
        "weights": frozen, "gathered_weights": gathered_bytes(peft_model, training.precision) if shards > 1 else 0,
        "adapters": adapters, "gradients": gradients,
        "optimizer": optimizer, "activations": activations, "runtime_overhead": overhead,
    }
    parts["total"] = sum(parts.values())
    return parts


def layers_to_checkpoint(peft_model: nn.Module, training: TrainingSettings, device: torch.device,
                         capacity: int) -> int | None:
    """The fewest decoder layers to checkpoint (``checkpointed_layers``) for the estimate to fit ``capacity``:
    0 when every activation fits (no recompute), None when even full checkpointing does not fit. Recompute
    costs about a third of a layer's forward-backward, so each layer left out of it is time saved."""
    import dataclasses

    config = getattr(peft_model, "get_base_model", lambda: peft_model)().config
    language = getattr(config, "text_config", None) or config
    layers = _config_value(language, "num_hidden_layers", "n_layer", "num_layers", default=1)
    checkpointed = dataclasses.replace(training, gradient_checkpointing=True)
    for count in range(layers + 1):
        if estimate(peft_model, checkpointed, device, checkpointed_layers=count)["total"] <= capacity:
            return count
    return None


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


def knob_advice(parts: Mapping[str, int], training: TrainingSettings, device: torch.device) -> str:
    """What to change, starting from the largest component of the estimate."""
    largest = max(("weights", "activations", "optimizer", "adapters"), key=lambda k: parts[k])
    if largest == "activations":
        advice = [f"lower training.micro_batch (now {training.micro_batch}; gradient accumulation keeps "
                  f"the effective batch)" if training.micro_batch_tokens is None else
                  f"lower training.micro_batch_tokens (now {training.micro_batch_tokens}; more micro-steps keep "
                  "the effective batch)", f"or training.max_length (now {training.max_length})"]
        if not training.gradient_checkpointing:
            advice.insert(0, "set training.gradient_checkpointing: true")
        return ", ".join(advice)
    if largest == "weights":
        qlora = "" if training.quantization is not None else ", or set training.quantization: {bits: 4} (QLoRA)"
        if device.type == "cuda" and training.precision != "bf16":
            return ("set training.precision: bf16 (frozen weights are then stored in bf16), or use a GPU with more "
                    "memory" + qlora)
        return ("use a device with more memory or a smaller model" + qlora + "; the frozen weights alone need "
                + human(parts["weights"]))
    if training.full:  # every weight trains: its gradients and AdamW state dominate
        return ("train LoRA adapters instead (training.finetune: lora), use a smaller model, or use a device with "
                "more memory; full fine-tuning holds " + human(parts["adapters"] + parts["optimizer"])
                + " of trainable weights and optimizer state")
    return f"lower training.lora.rank (now {training.lora.rank}) or the number of training.lora.target_modules"


def loading_advice(loading: Mapping[str, int], training: TrainingSettings) -> str:
    """What to change when FSDP's loading peak (:func:`loading_estimate`) is the one that does not fit."""
    if loading["host_copy"] >= max(loading["shards"], loading["whole_unit"]):
        return (f"give the node more memory (training.mem_mb, now {training.mem_mb}) or use a smaller model: rank 0 "
                f"reads the whole model ({human(loading['host_copy'])}) into host memory before sharding it")
    hybrid = len(fsdp_mesh.shape(training)) == 2
    over = (f"{fsdp_mesh.shards(training)}, a node's ranks on the hybrid mesh: set training.fsdp_mesh: flat to "
            f"shard over all {training.world_size}" if hybrid else f"{training.world_size}")
    return (f"shard over more processes (each holds a smaller share; now {over}), or use a device "
            "with more memory or a smaller model")


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
