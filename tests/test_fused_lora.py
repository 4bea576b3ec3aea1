"""One GEMM for the LoRA A matrices of a shared input (workflow_scripts/model/fused_lora.py, issue 45).

Tiny random Llama and Qwen2 (tests/test_packing.py's ``tiny``), LoRA on every projection with random B matrices
(PEFT starts B at zero, where the A gradients would be zero on both paths), float32, dropout 0.

Tolerance, from the computation. The fused path changes only summation orders: each slice of x @ cat(A)^T is
the same K-term dot product (K = hidden size) as the member's own; backward sums each A gradient over the same
T tokens, and x's gradient over the group's R = sum of ranks columns at once instead of per member. A float32
sum of n terms in another order differs by at most (n - 1) u sum |x_i| (Higham eq. 4.4); float_tolerance's
``reordering_bound(n, 1)`` = 2 n u covers it with n the longest reordered sum, max(K, T, R). Every fused group on
the path adds such an error once (first order), so the bound is G x 2 n u with G the fused groups. It applies to
the loss (a mean of non-negative token losses: relative) and, as in float_tolerance, to each gradient tensor as
a whole (norm of the difference over the norm), since an element whose terms cancel has no relative bound. A
real fault (a wrong slice, a lost scaling, B applied to another member's product) moves the loss or a gradient
by orders of magnitude more (the B matrices are N(0, 0.1), so each LoRA term is ~1e-1 of its output).
"""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY_VOCAB, tiny_training_settings
from float_tolerance import reordering_bound
from test_packing import COMMON, lora_with_nonzero_b, tiny
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model import fused_lora, model_loading

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS, LENGTH = 3, 20


def lora_model(architecture: str, dropout: float = 0.0, targets=ALL):
    settings = tiny_training_settings(lora={"target_modules": targets, "dropout": dropout})
    return lora_with_nonzero_b(architecture, settings.lora, seed=1)


def batch():
    generator = torch.Generator().manual_seed(2)
    return torch.randint(3, TINY_VOCAB, (ROWS, LENGTH), generator=generator)


def loss_and_gradients(peft_model):
    peft_model.zero_grad(set_to_none=True)
    ids = batch()
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}


def bound(groups: int, rank: int = 4, members: int = 3) -> float:
    longest_sum = max(COMMON["hidden_size"], ROWS * LENGTH, rank * members)
    return groups * reordering_bound(longest_sum, steps=1)


def assert_same(fused, plain, groups):
    (fused_loss, fused_grads), (plain_loss, plain_grads) = fused, plain
    tolerance = bound(groups)
    assert abs(fused_loss - plain_loss) <= tolerance * abs(plain_loss), (fused_loss, plain_loss, tolerance)
    assert fused_grads.keys() == plain_grads.keys()
    for name, expected in plain_grads.items():
        difference = float(torch.linalg.vector_norm((fused_grads[name] - expected).double()))
        scale = float(torch.linalg.vector_norm(expected.double()))
        assert scale > 0, name  # every LoRA tensor has a gradient (random B): the comparison is not vacuous
        assert difference <= tolerance * scale, (name, difference / scale, tolerance)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_fused_path_gives_the_plain_loss_and_gradients(architecture):
    torch.set_num_threads(1)
    peft_model = lora_model(architecture)
    plain = loss_and_gradients(peft_model)
    report = fused_lora.fuse_lora_a(peft_model, require=True)
    layers = COMMON["num_hidden_layers"]
    assert len(report.fused) == 2 * layers and not report.skipped, report
    assert any(r.endswith("self_attn q_proj+k_proj+v_proj") for r in report.fused)
    assert any(r.endswith("mlp gate_proj+up_proj") for r in report.fused)
    assert_same(loss_and_gradients(peft_model), plain, groups=2 * layers)
    assert fused_lora.unfuse_lora_a(peft_model) == 5 * layers
    assert_same(loss_and_gradients(peft_model), plain, groups=0 + 1)  # PEFT's own path again (bound of 1 group)


def test_a_group_whose_members_read_different_inputs_stays_exact():
    """o_proj reads the attention output, not q_proj's input: the cache is keyed by the input tensor, so each
    member recomputes on its own input (slower, never wrong)."""
    torch.set_num_threads(1)
    peft_model = lora_model("llama")
    plain = loss_and_gradients(peft_model)
    report = fused_lora.fuse_lora_a(peft_model, groups=(("q_proj", "o_proj"),))
    assert len(report.fused) == COMMON["num_hidden_layers"]
    assert_same(loss_and_gradients(peft_model), plain, groups=2 * COMMON["num_hidden_layers"])


class MatmulCount(TorchDispatchMode):
    OPS = {"aten::mm", "aten::addmm", "aten::bmm"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def matmuls(peft_model) -> tuple[int, int]:
    ids = batch()
    with MatmulCount() as forward:
        loss = peft_model(input_ids=ids, labels=ids).loss
    with MatmulCount() as backward:
        loss.backward()
    return forward.count, backward.count


def test_fused_path_runs_fewer_matmuls():
    peft_model = lora_model("llama")
    plain_forward, plain_backward = matmuls(peft_model)
    fused_lora.fuse_lora_a(peft_model, require=True)
    fused_forward, fused_backward = matmuls(peft_model)
    layers = COMMON["num_hidden_layers"]
    # per layer the A GEMMs go from 3 + 2 to 1 + 1. Backward each A GEMM has two: its weight's gradient, and x's
    # where x needs one; the first layer's attention input (the frozen embeddings, normed) needs none, so there
    # the plain path runs 3 GEMMs and the fused 1.
    assert plain_forward - fused_forward == 3 * layers, (plain_forward, fused_forward)
    assert plain_backward - fused_backward == 2 * 3 * layers - 2, (plain_backward, fused_backward)


def test_a_bf16_base_with_fp32_adapters_computes_the_product_once():
    """PEFT casts x to the A dtype per member, a new tensor each time where the base runs in bf16 and the
    adapters in fp32 (model_loading.keep_trainable_in_fp32): the cache is keyed by the input before the cast, so
    the fused path still runs one A GEMM per group; and gives PEFT's output."""
    settings = tiny_training_settings(lora={"target_modules": ALL})
    peft_model = model_loading.add_lora(tiny("llama").to(torch.bfloat16), settings.lora,
                                        gradient_checkpointing=False)
    assert {p.dtype for p in peft_model.parameters() if p.requires_grad} == {torch.float32}
    ids = batch()
    with torch.no_grad(), MatmulCount() as plain:
        plain_logits = peft_model(input_ids=ids).logits
    fused_lora.fuse_lora_a(peft_model, require=True)
    with torch.no_grad(), MatmulCount() as fused:
        fused_logits = peft_model(input_ids=ids).logits
    assert plain.count - fused.count == 3 * COMMON["num_hidden_layers"], (plain.count, fused.count)
    # B starts at zero here: the LoRA terms add exactly 0 on both paths, so the logits are the base's, bit for bit
    assert torch.equal(fused_logits, plain_logits)


def test_saved_adapter_is_peft_format_unchanged(tmp_path):
    from safetensors import safe_open

    peft_model = lora_model("qwen2")
    peft_model.save_pretrained(tmp_path / "plain")
    fused_lora.fuse_lora_a(peft_model, require=True)
    loss_and_gradients(peft_model)  # a fused forward and backward first: no cache or extra state is saved
    peft_model.save_pretrained(tmp_path / "fused")

    def tensors(directory):
        with safe_open(str(directory / "adapter_model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    plain, fused = tensors(tmp_path / "plain"), tensors(tmp_path / "fused")
    assert list(fused) == list(plain)
    assert {k: (v.shape, v.dtype) for k, v in fused.items()} == {k: (v.shape, v.dtype) for k, v in plain.items()}
    assert all(torch.equal(fused[k], plain[k]) for k in plain)
    assert (json.loads((tmp_path / "fused" / "adapter_config.json").read_text())
            == json.loads((tmp_path / "plain" / "adapter_config.json").read_text()))
    assert ([n for n, p in peft_model.named_parameters() if p.requires_grad]
            == [n for n, p in lora_model("qwen2").named_parameters() if p.requires_grad])


def test_dropout_groups_are_skipped_with_the_reason_and_refused_when_required():
    peft_model = lora_model("llama", dropout=0.1)
    report = fused_lora.fuse_lora_a(peft_model)
    assert not report.fused and len(report.skipped) == 2 * COMMON["num_hidden_layers"]
    assert all("lora_dropout [0.1]" in s and "set it to 0" in s for s in report.skipped), report.skipped
    with pytest.raises(WorkflowError, match=r"self_attn q_proj\+k_proj\+v_proj: lora_dropout \[0.1\]"):
        fused_lora.fuse_lora_a(peft_model, require=True)


def test_a_lone_target_is_not_a_group_and_required_fusion_says_so():
    peft_model = lora_model("llama", targets=["q_proj", "down_proj"])
    assert fused_lora.fuse_lora_a(peft_model).fused == []
    with pytest.raises(WorkflowError, match="no module has two or more LoRA layers"):
        fused_lora.fuse_lora_a(peft_model, require=True)


def test_disabled_adapters_fall_back_to_peft():
    torch.set_num_threads(1)
    peft_model = lora_model("llama")
    ids = batch()
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits = peft_model(input_ids=ids).logits
    fused_lora.fuse_lora_a(peft_model, require=True)
    with torch.no_grad(), peft_model.disable_adapter():
        assert torch.equal(peft_model(input_ids=ids).logits, base_logits)
    with torch.no_grad():
        assert not torch.equal(peft_model(input_ids=ids).logits, base_logits)


def test_fusing_twice_is_refused():
    peft_model = lora_model("llama")
    fused_lora.fuse_lora_a(peft_model)
    with pytest.raises(WorkflowError, match="already has its forward replaced"):
        fused_lora.fuse_lora_a(peft_model)


def test_compiled_decoder_layers_trace_the_fused_path_without_graph_breaks():
    """The 7B benchmark's side D compiles each decoder layer (training/kernels.apply_after_lora); Dynamo (its
    eager backend here: real graphs and guards) traces the fused forward, its cache included, in one graph per
    layer, and the result is the plain path's."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    torch._dynamo.reset()
    peft_model = lora_model("qwen2")
    plain = loss_and_gradients(peft_model)
    fused_lora.fuse_lora_a(peft_model, require=True)
    for layer in peft_model.get_base_model().model.layers:
        layer.compile(backend="eager")
    counters.clear()
    try:
        assert_same(loss_and_gradients(peft_model), plain, groups=2 * COMMON["num_hidden_layers"])
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] >= 1
    finally:
        torch._dynamo.reset()
