"""One GEMM for the LoRA A matrices of projections that read the same input (issue 45).

In a decoder layer q_proj, k_proj and v_proj read the same hidden states, and so do gate_proj and up_proj. PEFT's
``lora.Linear.forward`` (peft 0.21, vanilla LoRA) computes, for each projection on its own,

    result = base_layer(x) + lora_B(lora_A(dropout(x))) * scaling

so a layer runs three small A GEMMs ([tokens, hidden] x [hidden, r]) for attention and two for the MLP; each is
too thin to use the GPU well. ``fuse_lora_a`` replaces the grouped layers' ``forward`` (an instance attribute:
the modules, their parameters and their state_dict stay PEFT's, so the optimiser sees the same tensors and the
adapter saves byte-identical names and shapes) with one that computes ``x @ cat(A_q, A_k, A_v)^T`` once, at the
first member's call, and hands each member its slice of r columns; each B stays its own GEMM (their outputs
differ in width and are added to different base outputs).

Exactness: a slice of the fused product is, element by element, the same K-term dot product (K = in_features)
as the member's own product, in possibly another summation order; backward sums x's gradient over 3r columns at
once instead of r and r and r, and each A's gradient over the same tokens. Only float rounding changes
(tests/test_fused_lora.py derives its tolerance from that).

The cached product is keyed by the input tensor's identity: a member called with another tensor (a model that
does not feed the group one input) recomputes, so a wrong grouping is slower, never wrong. The cache is dropped
once every member has taken its slice, so nothing outlives the forward (a member that is not called, e.g. a
checkpointed recompute stopped early, leaves it held until the group's next call, which replaces it).

Fused only where exact: lora_dropout 0 (each projection would draw its own dropout mask, which one product
cannot reproduce), one active adapter present in every member, vanilla LoRA (no DoRA or other variant), A
without bias, the same in_features, dtype and device. Other groups are skipped and the reason returned (or, with
``require=True``, refused with a WorkflowError naming them). At call time a member falls back to PEFT's own
forward whenever its state no longer matches what was fused (adapters disabled, merged, another adapter active,
per-call ``adapter_names``, or a dropout module in training mode with p > 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workflow_scripts.core.errors import WorkflowError

# Projections that read the same input in Llama-style decoders (Llama, Qwen2, Mistral, Qwen3...): the attention
# module feeds its hidden states to q, k and v; the MLP feeds its input to gate and up.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class FusionReport:
    fused: list[str] = field(default_factory=list)     # "...model.layers.0.self_attn q_proj+k_proj+v_proj"
    skipped: list[str] = field(default_factory=list)   # "model.layers.0.self_attn q_proj+v_proj: why"


class _Group:
    """The members of one group and the product of their shared input with the concatenated A weights."""

    def __init__(self, layers: list, adapter: str):
        self.layers = layers
        self.adapter = adapter
        ranks = [layer.lora_A[adapter].out_features for layer in layers]
        self.slices = [slice(sum(ranks[:k]), sum(ranks[:k + 1])) for k in range(len(ranks))]
        self._input = None
        self._product = None
        self._taken: set[int] = set()

    def slice_for(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """``member``'s lora_A(x), ``x`` as the layer received it (before PEFT's cast to the A dtype: the cast
        makes a new tensor per member where the base runs in bf16 and the adapters in fp32, which would miss)."""
        if self._input is not x or member in self._taken:  # a new input, or a second call on the same one
            weight = torch.cat([layer.lora_A[self.adapter].weight for layer in self.layers])
            cast = self.layers[0]._cast_input_dtype(x, weight.dtype)  # PEFT's cast, once (one A dtype: checked)
            self._input, self._product, self._taken = x, F.linear(cast, weight), set()
        product = self._product[..., self.slices[member]]
        self._taken.add(member)
        if len(self._taken) == len(self.layers):  # every member served: keep nothing past this forward
            self._input = self._product = None
            self._taken = set()
        return product


def _fusable(layer, adapter: str) -> bool:
    """``layer``'s state still is what was fused (else PEFT's own forward runs)."""
    if layer.disable_adapters or layer.merged or list(layer.active_adapters) != [adapter]:
        return False
    dropout = layer.lora_dropout[adapter]
    return isinstance(dropout, torch.nn.Identity) or not dropout.training or dropout.p == 0


def _fused_forward(layer, group: _Group, member: int, peft_forward):
    adapter = group.adapter

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not all(_fusable(other, adapter) for other in group.layers):
            return peft_forward(x, *args, **kwargs)
        layer._check_forward_args(x)
        # PEFT's vanilla branch, with lora_A(dropout(x)) (dropout the identity here) taken from the group's product
        result = layer.base_layer(x)
        torch_result_dtype = result.dtype
        result = result + layer.lora_B[adapter](group.slice_for(member, x)) * layer.scaling[adapter]
        return result.to(torch_result_dtype)

    return forward


def _why_not(layers: list, adapter_of) -> str | None:
    from peft.tuners.lora.layer import Linear

    if any(not isinstance(layer, Linear) for layer in layers):
        return "not all are PEFT LoRA Linear layers"
    adapters = {tuple(layer.active_adapters) for layer in layers}
    if len(adapters) != 1 or len(next(iter(adapters))) != 1:
        return f"active adapters {sorted(adapters)}: fusing needs one active adapter shared by the group"
    adapter = adapter_of(layers[0])
    if any(adapter not in layer.lora_A for layer in layers):
        return f"adapter {adapter!r} is missing in some layer"
    if any(adapter in layer.lora_variant for layer in layers):
        return "a LoRA variant (DoRA, ...) computes its own path"
    dropouts = {float(getattr(layer.lora_dropout[adapter], "p", 0.0)) for layer in layers}
    if dropouts != {0.0}:
        return f"lora_dropout {sorted(dropouts)}: each projection draws its own dropout mask; set it to 0"
    a = [layer.lora_A[adapter] for layer in layers]
    if any(m.bias is not None for m in a):
        return "an A matrix has a bias"
    if len({(m.in_features, m.weight.dtype, m.weight.device) for m in a}) != 1:
        return "A matrices differ in in_features, dtype or device"
    return None


def fuse_lora_a(model, groups=SHARED_INPUT_GROUPS, require: bool = False) -> FusionReport:
    """Fuse the A GEMMs of each group of sibling LoRA layers in ``model`` (a PeftModel or the model inside it).

    A group is the children of one module named in one entry of ``groups`` that PEFT wrapped (two at least).
    Returns which groups were fused and which skipped, and why; ``require``: a skipped group, or none fused, is
    a WorkflowError. ``unfuse_lora_a`` restores PEFT's forward.
    """
    report = FusionReport()
    for parent_name, parent in model.named_modules():
        for names in groups:
            present = [n for n in names if hasattr(parent, n) and hasattr(getattr(parent, n), "lora_A")]
            if len(present) < 2:
                continue
            layers = [getattr(parent, n) for n in present]
            label = f"{parent_name} {'+'.join(present)}"
            why = _why_not(layers, lambda layer: layer.active_adapters[0])
            if why:
                report.skipped.append(f"{label}: {why}")
                continue
            group = _Group(layers, layers[0].active_adapters[0])
            for member, layer in enumerate(layers):
                if "forward" in layer.__dict__:
                    raise WorkflowError(f"fused LoRA: {parent_name}.{present[member]} already has its forward "
                                        "replaced (fused twice?); call unfuse_lora_a first")
                layer.forward = _fused_forward(layer, group, member, layer.forward)
                layer._fused_lora_group = group
            report.fused.append(label)
    if require and (report.skipped or not report.fused):
        reasons = "; ".join(report.skipped) or "no module has two or more LoRA layers of " + str(groups)
        raise WorkflowError(f"fused LoRA A GEMM: cannot fuse: {reasons}")
    return report


def unfuse_lora_a(model) -> int:
    """PEFT's own forward again on every fused layer; returns how many layers were restored."""
    restored = 0
    for module in model.modules():
        if "_fused_lora_group" in module.__dict__:
            del module.forward
            del module._fused_lora_group
            restored += 1
    return restored
