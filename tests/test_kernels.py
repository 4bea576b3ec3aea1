"""The speed switches under ``training`` (workflow_scripts/training/kernels.py): each gives the loss it
gives off, within a stated tolerance, or is refused clearly where its kernel needs CUDA; the memory
estimate counts what each saves. flex_attention's exactness is tests/test_packing.py's per-example test
(parametrised over it)."""
from __future__ import annotations

import pytest
import torch

from conftest import TINY_PAD, TINY_VOCAB, tiny_training_settings
from test_packing import MAX_LENGTH, example_rows, tiny
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.data import packing
from workflow_scripts.model import memory_estimate, model_loading
from workflow_scripts.tasks.generation import TargetTokenLoss
from workflow_scripts.training import kernels


def lora_model(gradient_checkpointing=False, family="llama"):
    torch.manual_seed(0)
    model = model_loading.add_lora(tiny(family), tiny_training_settings().lora, gradient_checkpointing)
    with torch.no_grad():  # non-zero adapters, so their gradients depend on everything
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    return model


def loss_and_gradients(model, batch, context=None):
    model.zero_grad(set_to_none=True)
    loss_module = TargetTokenLoss(model) if not isinstance(model, TargetTokenLoss) else model
    with context or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = loss_module(batch)
    loss.backward()
    peft = loss_module.wrapped
    return loss.detach(), {n: p.grad.clone() for n, p in peft.named_parameters() if p.requires_grad}


def packed_batch():
    return packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH)(example_rows())


def test_switches_are_off_by_default_and_refused_where_they_cannot_work():
    settings = tiny_training_settings()
    assert not any(kernels.switches(settings).values())
    for overrides, key, words in (
            ({"fused_cross_entropy": True}, "training.fused_cross_entropy", "CUDA"),
            ({"liger_kernels": True}, "training.liger_kernels", "CUDA"),
            ({"flex_attention": True, "gpus": 1}, "training.flex_attention", "packing: true"),
            # FlexAttention's forward runs on CPU (tests/test_packing.py checks it), its backward does not
            ({"flex_attention": True, "packing": True}, "training.flex_attention", "no backward on CPU"),
            ({"activation_offloading": True, "gradient_checkpointing": False}, "training.activation_offloading",
             "gradient_checkpointing: true")):
        with pytest.raises(ConfigError) as caught:
            tiny_training_settings(**overrides)
        assert key in str(caught.value) and words in str(caught.value)
    # On a GPU config, a CPU process (a stage run by hand) is still refused at build time, naming the key.
    on_gpu = tiny_training_settings(gpus=1, fused_cross_entropy=True, liger_kernels=True)
    with pytest.raises(WorkflowError, match=r"training\.fused_cross_entropy: .*CUDA"):
        kernels.fused_cross_entropy(lora_model(), on_gpu, torch.device("cpu"))
    with pytest.raises(WorkflowError, match=r"training\.liger_kernels: .*CUDA"):
        kernels.apply_before_lora(tiny("llama"), on_gpu, torch.device("cpu"))
    flex = tiny_training_settings(gpus=1, packing=True, flex_attention=True)
    assert kernels.attn_implementation(flex, torch.device("cuda")) == "flex_attention"
    with pytest.raises(WorkflowError, match=r"training\.flex_attention: .*no backward on cpu"):
        kernels.attn_implementation(flex, torch.device("cpu"))


def test_fused_cross_entropy_refuses_a_head_it_cannot_fuse():
    model = tiny("llama")
    assert kernels.fused_cross_entropy_problem(model) is None
    model.config.logit_scale = 0.5  # what Cohere applies after its head
    assert "logit_scale" in kernels.fused_cross_entropy_problem(model)
    wrapped = model_loading.add_lora(tiny("llama"), tiny_training_settings(
        lora={"target_modules": ["q_proj", "lm_head"]}).lora, False)
    assert "plain bias-free Linear" in kernels.fused_cross_entropy_problem(wrapped.get_base_model())


def test_the_fused_head_path_gives_the_same_loss_and_gradients():
    """The wiring of training.fused_cross_entropy on CPU, with the unfused reference of the kernel in place
    of Liger's (which needs CUDA): decoder hidden states at the target positions, the head's weight and
    the targets give the loss of the model's own forward. Tolerance 1e-5 relative (fp32): the same
    matmuls, only the order of the head's gather and the final norm differ."""
    torch.set_num_threads(1)
    model, batch = lora_model(), packed_batch()
    plain_loss, plain_grads = loss_and_gradients(model, batch)
    fused = TargetTokenLoss(model)
    fused.fused_cross_entropy = kernels.reference_fused_cross_entropy
    calls = []
    fused.fused_cross_entropy = lambda *args: calls.append(args[0].shape) or kernels.reference_fused_cross_entropy(*args)
    fused_loss, fused_grads = loss_and_gradients(fused, batch)
    assert calls == [(batch["target_tokens"], 32)]  # only the target positions reach the loss
    assert float(fused_loss) == pytest.approx(float(plain_loss), rel=1e-5)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_activation_offloading_gives_bit_identical_loss_and_gradients():
    """save_on_cpu copies saved tensors to host memory and back: no arithmetic changes, so exactly equal
    (on CPU the copy is CPU to CPU; on CUDA it is device to pinned host memory, the same values)."""
    torch.set_num_threads(1)
    model, batch = lora_model(gradient_checkpointing=True), packed_batch()
    model.train()
    settings = tiny_training_settings(activation_offloading=True)
    off_loss, off_grads = loss_and_gradients(model, batch)
    packed = []

    class Counting(torch.autograd.graph.save_on_cpu):  # sees that tensors really go through the offload hooks
        def __init__(self):
            super().__init__()
            pack = self.pack_hook
            self.pack_hook = lambda t: packed.append(1) or pack(t)

    context = kernels.offloading(settings, torch.device("cpu"))
    assert isinstance(context, torch.autograd.graph.save_on_cpu)
    on_loss, on_grads = loss_and_gradients(model, batch, Counting())
    assert packed, "nothing was offloaded"
    assert torch.equal(on_loss, off_loss)
    for name, grad in off_grads.items():
        assert torch.equal(on_grads[name], grad), name


def test_compiled_decoder_layers_give_the_same_loss_within_float_tolerance():
    """Regional torch.compile (Inductor, also on CPU) fuses and reorders fp32 elementwise work (norms,
    SiLU, softmax), so sums round differently: relative 1e-5 on the loss, 1e-4 on gradients."""
    torch.set_num_threads(1)
    batch = packed_batch()
    eager_loss, eager_grads = loss_and_gradients(lora_model(gradient_checkpointing=True).train(), batch)
    compiled = lora_model(gradient_checkpointing=True).train()
    kernels.apply_after_lora(compiled, tiny_training_settings(compile_layers=True))
    layers = compiled.get_base_model().model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    before = kernels.compile_seconds()
    compiled_loss, compiled_grads = loss_and_gradients(compiled, batch)
    assert kernels.compile_seconds() > before  # what train's log reports as compile_seconds
    assert float(compiled_loss) == pytest.approx(float(eager_loss), rel=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5)


def test_the_memory_estimate_counts_what_offloading_and_fused_cross_entropy_save():
    model = lora_model(gradient_checkpointing=True)
    device = torch.device("cpu")
    plain = memory_estimate.estimate(model, tiny_training_settings(), device)["activations"]
    offloaded = memory_estimate.estimate(model, tiny_training_settings(activation_offloading=True), device)["activations"]
    fused = memory_estimate.estimate(model, tiny_training_settings(gpus=1, fused_cross_entropy=True), device)["activations"]
    config = model.get_base_model().config
    tokens = 4 * 64  # micro_batch x max_length
    assert plain - offloaded == tokens * config.hidden_size * config.num_hidden_layers * 4  # fp32 layer inputs
    assert plain - fused == tokens * (config.vocab_size - config.hidden_size) * 4 * 2  # logits and their gradient


def test_the_train_stage_runs_the_switches_and_logs_compile_time_apart(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    """Through train.main (build, micro_step, the log): activation offloading gives the very losses of a
    run without it (bit-identical copies); compile_layers logs compile_seconds, the first step's larger than
    the later ones' (no recompiles), and keeps it out of tokens_per_second."""
    from test_train import log_rows, train_argv
    from workflow_scripts import train

    torch.set_num_threads(1)
    base = dict(max_steps=3, checkpoint_every=100, micro_batch=4, packing=True)
    runs = {}
    for name, switches in (("off", {}), ("offload", {"activation_offloading": True}),
                           ("compile", {"compile_layers": True})):
        out = tmp_path / name
        assert train.main(train_argv(out, tiny_model_dir, tiny_tokenised_dir, tiny_training_settings(**base, **switches))) == 0
        runs[name] = log_rows(out)
    assert [r["loss"] for r in runs["offload"]] == [r["loss"] for r in runs["off"]]
    assert "compile_seconds" not in runs["off"][0]
    compiled = runs["compile"]
    assert compiled[0]["compile_seconds"] > 0 and all(r["compile_seconds"] < compiled[0]["compile_seconds"]
                                                      for r in compiled[1:])
    for row, reference in zip(compiled, runs["off"]):
        assert row["loss"] == pytest.approx(reference["loss"], rel=1e-4)  # Inductor's float reordering
