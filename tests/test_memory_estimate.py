"""The memory estimate responds to the knobs it names, and the gate refuses a run that will not fit."""
import pytest
import torch
from transformers import LlamaConfig

from conftest import tiny_training_settings
from workflow_scripts.model import memory_estimate
from workflow_scripts.training import preflight_checks, training_setup
from workflow_scripts.training.distributed import DistributedContext

CONFIG_7B = LlamaConfig(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064)  # Qwen2.5-7B's shape, no weights


def activations(**kw):
    args = dict(micro_batch=2, max_length=2048, activation_dtype_bytes=2, gradient_checkpointing=True,
                lora_rank=128, lora_targets=7)
    return memory_estimate.activation_bytes(CONFIG_7B, **{**args, **kw})


def test_activation_estimate_follows_the_knobs():
    base = activations()
    assert activations(micro_batch=1) == pytest.approx(base / 2)
    assert activations(max_length=512) == pytest.approx(base / 4)
    assert activations(gradient_checkpointing=False) > 4 * base  # logits (not checkpointed) dilute the 15x
    # The seed's 7B run: micro-batch 1, 512 tokens, checkpointing: activations ~ a few GiB at most.
    assert 0.5 * 2**30 < activations(micro_batch=1, max_length=512) < 4 * 2**30


def test_estimate_counts_weights_adapters_and_optimizer(tiny_model_dir):
    torch.set_num_threads(1)
    settings = tiny_training_settings()
    setup = training_setup.build(tiny_model_dir, settings, DistributedContext(0, 0, 1, 1, torch.device("cpu"), None))
    parts = memory_estimate.estimate(setup.peft_model, settings, torch.device("cpu"))
    trainable = sum(p.numel() for p in setup.trainable_parameters())
    frozen = sum(p.numel() for p in setup.peft_model.parameters() if not p.requires_grad)
    assert parts["weights"] == frozen * 4 and parts["adapters"] == trainable * 4
    assert parts["optimizer"] == trainable * 8 and parts["gradients"] == trainable * 4
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


def test_gate_names_the_knob_for_the_largest_part():
    settings = tiny_training_settings(micro_batch=4, max_length=2048, gradient_checkpointing=True, precision="fp32")
    cuda = torch.device("cuda", 0)
    act_heavy = {"weights": 10, "adapters": 1, "gradients": 1, "optimizer": 2, "activations": 900, "runtime_overhead": 0}
    act_heavy["total"] = sum(act_heavy.values())
    with pytest.raises(preflight_checks.PreflightError, match=r"memory: .*Fix: lower training.micro_batch \(now 4"):
        preflight_checks.check_memory(act_heavy, 500, 0.9, settings, cuda)
    weight_heavy = {**act_heavy, "weights": 5000, "activations": 1}
    weight_heavy["total"] = sum(v for k, v in weight_heavy.items() if k != "total")
    with pytest.raises(preflight_checks.PreflightError, match="precision: bf16"):
        preflight_checks.check_memory(weight_heavy, 500, 0.9, settings, cuda)
    assert "allowed" in preflight_checks.check_memory(act_heavy, 10_000, 0.9, settings, cuda)


def test_a_token_budget_bounds_the_activations_by_its_tokens(tiny_model_dir):
    """training.micro_batch_tokens: activations from the budget's token slots, not micro_batch x max_length;
    the gate's advice names the budget, and the config-time estimate rounds it up to whole rows."""
    from workflow_scripts.model import config_memory_estimate

    assert activations(tokens=4096) == activations(micro_batch=2, max_length=2048)
    assert activations(tokens=2048) == pytest.approx(activations(micro_batch=1))
    torch.set_num_threads(1)
    fixed = tiny_training_settings(micro_batch=4, max_length=64)
    setup = training_setup.build(tiny_model_dir, fixed, DistributedContext(0, 0, 1, 1, torch.device("cpu"), None))
    cpu = torch.device("cpu")
    same = memory_estimate.estimate(setup.peft_model, fixed.replace(micro_batch_tokens=256), cpu)  # 4 x 64 slots
    assert same == memory_estimate.estimate(setup.peft_model, fixed, cpu)
    larger = memory_estimate.estimate(setup.peft_model, fixed.replace(micro_batch_tokens=1024), cpu)
    assert larger["activations"] == pytest.approx(4 * same["activations"])  # whatever micro_batch says
    assert config_memory_estimate.training_arguments(fixed.replace(micro_batch_tokens=100))["micro_batch"] == 2
    heavy = {"weights": 10, "adapters": 1, "gradients": 1, "optimizer": 2, "activations": 900, "runtime_overhead": 0}
    heavy["total"] = sum(heavy.values())
    with pytest.raises(preflight_checks.PreflightError, match=r"Fix: lower training.micro_batch_tokens \(now 1024"):
        preflight_checks.check_memory(heavy, 500, 0.9, fixed.replace(micro_batch_tokens=1024), torch.device("cuda", 0))


def test_fsdp_shards_weights_adapters_gradients_and_optimizer_by_the_world_size(tiny_model_dir):
    """Two gloo processes: FSDP2 shards every parameter (each decoder layer and the root), so each rank holds
    half of weights, adapters, gradients and AdamW state, plus the root and two decoder layers gathered;
    DDP holds everything, and its reducer a second copy of the gradients."""
    from conftest import TINY_VOCAB

    torch.set_num_threads(1)
    ddp = tiny_training_settings(cpu_processes=2)
    fsdp = tiny_training_settings(cpu_processes=2, strategy="fsdp")
    setup = training_setup.build(tiny_model_dir, ddp, DistributedContext(0, 0, 1, 1, torch.device("cpu"), None))
    on_ddp = memory_estimate.estimate(setup.peft_model, ddp, torch.device("cpu"))
    on_fsdp = memory_estimate.estimate(setup.peft_model, fsdp, torch.device("cpu"))
    # Every dim 0 of the tiny model (vocab, 32, 64, rank 4) is even: the halves are exact.
    assert on_fsdp["weights"] * 2 == on_ddp["weights"]
    assert on_fsdp["adapters"] * 2 == on_ddp["adapters"] and on_fsdp["optimizer"] * 2 == on_ddp["optimizer"]
    assert on_fsdp["gradients"] * 4 == on_ddp["gradients"] == 2 * on_ddp["adapters"]
    assert on_ddp["gathered_weights"] == 0 and on_ddp["activations"] == on_fsdp["activations"]
    # Gathered (fp32 run): embeddings + lm_head + final norm, and two decoder layers with their LoRA
    # (q, k, v, o 32x32; gate, up, down 32x64; two norms; rank-4 adapters on q, v and down).
    layer = 4 * 32 * 32 + 3 * 32 * 64 + 2 * 32 + 4 * (32 + 32) * 2 + 4 * (64 + 32)
    assert on_fsdp["gathered_weights"] == 4 * (2 * TINY_VOCAB * 32 + 32) + 2 * 4 * layer
    assert on_fsdp["total"] == sum(v for k, v in on_fsdp.items() if k != "total")
    # A rank's share of an uneven dim 0 is the larger chunk, as torch.chunk cuts it (rank 0's).
    assert memory_estimate._largest_shard(torch.empty(5, 3), 2) == 9
    one_process = memory_estimate.estimate(setup.peft_model, tiny_training_settings(strategy="fsdp"), torch.device("cpu"))
    assert one_process["weights"] == on_ddp["weights"] and one_process["gathered_weights"] == 0


def test_advice_under_full_fine_tuning_names_lora_not_its_rank():
    import torch

    from workflow_scripts.model import memory_estimate

    parts = {"weights": 0, "activations": 10, "optimizer": 800, "adapters": 400}
    training = tiny_training_settings(finetune="full", lora={"rank": 16}, micro_batch=1, max_length=64,
                                      gradient_checkpointing=False)
    advice = memory_estimate.knob_advice(parts, training, torch.device("cpu"))
    assert advice.startswith("train LoRA adapters instead (training.finetune: lora)") and "1.2 KiB" in advice
    assert "lora.rank" in memory_estimate.knob_advice(parts, training.replace(finetune="lora"), torch.device("cpu"))


# --- issue 45: partial checkpointing where full recompute is not needed ---
def test_partial_checkpointing_is_counted_between_none_and_full():
    """``checkpointed_layers``: 0 counts every activation (as no checkpointing), all layers as full
    checkpointing, and each layer left out of the recompute adds its activations in between. Checkpointing
    the last layer too saves nothing: some layer's recompute holds a layer's activations anyway."""
    full, none = activations(), activations(gradient_checkpointing=False)
    assert activations(checkpointed_layers=28) == full and activations(checkpointed_layers=0) == none
    partial = [activations(checkpointed_layers=k) for k in range(28)]
    assert all(a > b for a, b in zip(partial, partial[1:]))  # each checkpointed layer saves memory
    assert partial[-1] < full


def test_the_fewest_layers_to_checkpoint_for_a_capacity(tiny_model_dir):
    torch.set_num_threads(1)
    settings = tiny_training_settings()
    setup = training_setup.build(tiny_model_dir, settings, DistributedContext(0, 0, 1, 1, torch.device("cpu"), None))
    layers = setup.peft_model.get_base_model().config.num_hidden_layers

    def total(count):
        return memory_estimate.estimate(setup.peft_model, settings, torch.device("cpu"), checkpointed_layers=count)["total"]

    assert memory_estimate.layers_to_checkpoint(setup.peft_model, settings, torch.device("cpu"), total(0)) == 0
    assert memory_estimate.layers_to_checkpoint(setup.peft_model, settings, torch.device("cpu"), total(1)) == 1
    least = min(total(k) for k in range(layers + 1))
    assert memory_estimate.layers_to_checkpoint(setup.peft_model, settings, torch.device("cpu"), least - 1) is None


def test_partial_checkpointing_gives_the_same_loss_and_gradients():
    """Only the first layer recomputes: the loss and LoRA gradients equal those without checkpointing and with
    it on every layer. Recompute replays the same kernels on the same inputs on CPU, so they are bit-identical
    (no tolerance to derive); the recompute really happens on layer 0 only (its forward runs twice)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from workflow_scripts.model import model_loading

    torch.set_num_threads(1)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("none", "partial", "full"):
        torch.manual_seed(0)
        model = model_loading.add_lora(Qwen2ForCausalLM(config), tiny_training_settings().lora, mode != "none")
        if mode == "partial":
            assert model_loading.checkpoint_first_layers(model, 1) == 1
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        model.train()
        calls = []
        for k, layer in enumerate(model.get_base_model().model.layers):
            # a pre-hook at the layer's first call: the recompute stops early, once it has what backward needs
            layer.self_attn.register_forward_pre_hook(lambda module, args, k=k: calls.append(k))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[mode] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad},
                         sorted(calls))
    for mode in ("partial", "full"):
        assert torch.equal(results[mode][0], results["none"][0])
        for name, grad in results["none"][1].items():
            assert torch.equal(results[mode][1][name], grad), (mode, name)
    assert results["none"][2] == [0, 1, 2] and results["partial"][2] == [0, 0, 1, 2]
    assert results["full"][2] == [0, 0, 1, 1, 2, 2]
