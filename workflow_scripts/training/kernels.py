"""The speed switches under ``training`` (each off by default): what each needs, and applying it to the
built model. One place, so the gate (sanity) and training build the same thing through
``training_setup.build``.

* ``flex_attention``: packed rows through PyTorch FlexAttention with a document BlockMask
  (data/packing.py: ``document_block_mask``); the model is loaded with ``attn_implementation=
  'flex_attention'``. Exact: the same mask predicate as the dense 4D mask (tests/test_packing.py, forward
  on CPU). CUDA only for training: FlexAttention has no backward on CPU.
* ``fused_cross_entropy``: Liger's fused linear cross-entropy (``LigerFusedLinearCrossEntropyLoss``)
  on the target positions only (tasks/generation.py's ``TargetTokenLoss``): the logits are computed
  and consumed chunk by chunk, never held whole. Triton, so CUDA only.
* ``liger_kernels``: Liger's RMSNorm, SwiGLU and RoPE kernels patched into the model instance, for the
  model types Liger lists (``MODEL_TYPE_TO_APPLY_LIGER_FN``). Triton, so CUDA only.
* ``compile_layers``: ``torch.compile`` on each decoder layer (regional compilation, as torchtune and
  transformers' own docs do it): one layer's graph is compiled once and reused by every layer, so compile
  time stays small; the train log reports ``compile_seconds`` apart from the step time.
* ``activation_offloading``: with gradient checkpointing, what autograd saves outside the checkpointed
  regions (the inputs of each checkpointed layer) goes to host memory during the forward
  (``torch.autograd.graph.save_on_cpu``, pinned on CUDA) and comes back during the backward; values
  are copied, not changed, so the loss and gradients are bit-identical.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.settings import TrainingSettings

LIGER_INSTALL = "pip install liger-kernel (the `gpu` extra)"
# Applied after the head in some families; the fused loss never sees the logits, so it would skip them.
LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "final_logit_softcapping")


def attn_implementation(training: TrainingSettings, device: torch.device | None = None) -> str | None:
    """The attention implementation to load the model with (None: transformers' default). FlexAttention
    has no backward on CPU (torch 2.13: NotImplementedError), so a CPU process is refused here."""
    if not training.flex_attention:
        return None
    if device is not None and device.type != "cuda":
        raise WorkflowError(f"training.flex_attention: PyTorch's FlexAttention has no backward on {device.type}; "
                            "Fix: set training.flex_attention: false (packing keeps the dense mask) or train on a GPU")
    return "flex_attention"


def _require_cuda(key: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise WorkflowError(f"training.{key}: Liger's kernels are Triton kernels and need a CUDA device; this "
                            f"process runs on {device.type}. Fix: set training.{key}: false or train on a GPU")


def _liger(key: str):
    try:
        import liger_kernel.transformers as liger
    except ImportError as error:
        raise WorkflowError(f"training.{key}: liger-kernel is not importable ({error}). Fix: {LIGER_INSTALL}, "
                            f"or set training.{key}: false") from None
    return liger


def liger_supports(model_type: str) -> tuple[bool, str]:
    """Whether Liger patches this model family (its own table), and why not."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return True, ""
    return False, (f"Liger has no kernels for model type '{model_type}' (it supports "
                   f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})")


def apply_before_lora(base: nn.Module, training: TrainingSettings, device: torch.device) -> None:
    """Liger's RMSNorm / SwiGLU / RoPE kernels on the plain model, before LoRA wraps its Linear layers."""
    if not training.liger_kernels:
        return
    _require_cuda("liger_kernels", device)
    _liger("liger_kernels")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance  # as transformers.integrations.liger

    ok, reason = liger_supports(base.config.model_type)
    if not ok:
        raise WorkflowError(f"training.liger_kernels: {reason}. Fix: set training.liger_kernels: false")
    _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def apply_after_lora(peft_model: nn.Module, training: TrainingSettings, backend: str | None = None) -> None:
    """Regional compilation: each decoder layer compiled in place (``nn.Module.compile``). ``backend``: torch's
    default (Inductor) unless named; the benchmark's CPU harness names Dynamo's ``eager`` (graphs, guards and
    recompiles as Inductor would see them, without its code generation)."""
    if not training.compile_layers:
        return
    from workflow_scripts.training.fsdp import decoder_layers

    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    for layer in decoder_layers(base):
        layer.compile(**({"backend": backend} if backend else {}))


def fused_cross_entropy(peft_model: nn.Module, training: TrainingSettings,
                        device: torch.device) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The summed fused linear cross-entropy for ``TargetTokenLoss``, or None when the switch is off."""
    if not training.fused_cross_entropy:
        return None
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    problem = fused_cross_entropy_problem(base)
    if problem:
        raise WorkflowError(f"training.fused_cross_entropy: {problem}. Fix: set training.fused_cross_entropy: false")
    _require_cuda("fused_cross_entropy", device)
    liger = _liger("fused_cross_entropy")
    loss = liger.LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return lambda hidden, weight, targets: loss(weight, hidden, targets)


def fused_cross_entropy_problem(base: nn.Module) -> str | None:
    """Why the head cannot be fused into the loss (None: it can): the fused loss takes a plain weight and
    sees no logits, so a trained or wrapped head, or a transform after it, would be skipped."""
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return (f"the output layer is {type(head).__name__}{' with a bias' if head is not None and getattr(head, 'bias', None) is not None else ''}, "
                "not a plain bias-free Linear (a LoRA-wrapped or trained head cannot be fused)")
    config = base.config
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"{type(base).__name__} applies {name}={value} after its head, which the fused loss would skip"
    if not hasattr(base, "get_decoder") or base.get_decoder() is None:
        return f"{type(base).__name__} has no decoder to take the hidden states from"
    return None


def reference_fused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the fused kernel computes, unfused (tests: the wiring on CPU): summed CE of hidden @ weight.T."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")


def offloading(training: TrainingSettings, device: torch.device):
    """The context a micro-step's forward runs in: saved activations go to host memory, or nothing."""
    if not training.activation_offloading:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def compile_seconds() -> float:
    """Seconds torch.compile (Dynamo and Inductor) has spent in this process so far."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # a private API: a torch without it reports no compile time rather than failing
        return 0.0


def switches(training: TrainingSettings) -> dict[str, bool]:
    """The switches as the run sets them (benchmarks and manifests)."""
    return {name: bool(getattr(training, name)) for name in
            ("flex_attention", "fused_cross_entropy", "liger_kernels", "compile_layers", "activation_offloading")}
