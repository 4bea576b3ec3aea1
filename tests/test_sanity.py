"""The preflight gate: a healthy set-up passes; each planted fault fails with its cause and fix."""
import json
import socket

import pytest
import torch
import torch.distributed as dist

from conftest import build_tiny_tokenised, tiny_training_settings, training_json
from workflow_scripts.model import memory_estimate, model_loading, parameter_names
from workflow_scripts.training import preflight_checks, training_setup
from workflow_scripts import sanity
from workflow_scripts.tasks import generation
from workflow_scripts.training.distributed import DistributedContext
from workflow_scripts.training.preflight_checks import PreflightError


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def run_gate(tmp_path, model_dir, data_dir, **overrides):
    settings = tiny_training_settings(**{"sanity_batches": 1, **overrides})
    out = tmp_path / "sanity.json"
    code = sanity.main(["--model", str(model_dir), "--data", str(data_dir), "--training", training_json(settings),
                        "--seed", "1", "--out", str(out)])
    return code, out


def gate_error(tmp_path, model_dir, data_dir, **overrides) -> str:
    with pytest.raises(PreflightError) as caught:
        run_gate(tmp_path, model_dir, data_dir, **overrides)
    assert not (tmp_path / "sanity.json").exists()  # a failed gate leaves no report behind
    assert "Fix:" in str(caught.value)
    return str(caught.value)


def patch_build(monkeypatch, after):
    """Plant a fault in the built set-up, as a bug in model preparation would."""
    original = training_setup.build

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)
        after(setup)
        return setup

    monkeypatch.setattr(training_setup, "build", build)


def test_healthy_setup_passes(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    code, out = run_gate(tmp_path, tiny_model_dir, tiny_tokenised_dir)
    report = json.loads(out.read_text())
    assert code == 0 and report["passed"]
    names = {c["name"] for c in report["checks"]}
    assert {"device_count", "precision", "trainable_parameters", "placement", "name_lookup", "memory",
            "data_scan", "train_mode", "gradients", "data"} <= names
    assert report["memory_estimate"]["total"] > 0 and report["world_size"] == 1
    assert report["seed"] == 1  # the gate runs once per experiment: the report names the seed it ran with


# 1. trainable parameters
def test_frozen_lora_parameters(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    def freeze_after_peft(setup):  # seed: a tower frozen after PEFT added its adapters
        for name, p in setup.peft_model.named_parameters():
            if "layers.0." in name:
                p.requires_grad_(False)

    patch_build(monkeypatch, freeze_after_peft)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir)
    assert message.startswith("trainable_parameters:") and "requires_grad=False" in message


def test_no_trainable_parameters(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    patch_build(monkeypatch, lambda setup: setup.peft_model.requires_grad_(False))
    assert "no trainable parameters" in gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir)


# 2. gradients
def test_detached_loss(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    forward = generation.TargetTokenLoss.forward
    monkeypatch.setattr(generation.TargetTokenLoss, "forward", lambda self, *a: forward(self, *a).detach())
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir)
    assert message.startswith("gradients:") and "detached" in message


def test_reentrant_checkpointing_without_input_grads(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    original = model_loading.add_lora

    def reentrant(model, lora, gradient_checkpointing, task_type):  # the seed's: frozen embeddings, reentrant
        peft_model = original(model, lora, False, task_type)
        base = peft_model.get_base_model()
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        base.disable_input_require_grads()  # transformers 5 turns them on by itself; the seed had none
        return peft_model

    monkeypatch.setattr(model_loading, "add_lora", reentrant)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir)
    assert message.startswith("gradients:")


@pytest.mark.parametrize("value, expected", [(0.0, "all-zero gradients"), (float("nan"), "NaN/Inf gradients")])
def test_zero_or_nan_gradients(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir, value, expected):
    def hook_grads(setup):
        for name, p in setup.peft_model.named_parameters():
            if "lora_B" in name and "layers.1." in name:
                p.register_hook(lambda grad: torch.full_like(grad, value))

    patch_build(monkeypatch, hook_grads)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir)
    assert message.startswith("gradients:") and expected in message and "layers.1" in message


# 3. placement
def test_meta_device_parameter(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    def to_meta(setup):  # seed: device_map with CPU offload left weights on meta
        layer = setup.peft_model.get_base_model().model.layers[1].mlp.up_proj
        layer.weight = torch.nn.Parameter(torch.empty_like(layer.weight, device="meta"), requires_grad=False)

    patch_build(monkeypatch, to_meta)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir)
    assert message.startswith("placement:") and "meta device" in message and "device_map" in message


def test_several_devices_in_one_process(tiny_model_dir):
    model = model_loading.load_base_model(tiny_model_dir, torch.device("cpu"))
    model.lm_head.to("meta")  # stands in for a second GPU, as device_map="auto" would spread layers
    model.model.layers[0].to(torch.device("cpu"))
    with pytest.raises(PreflightError, match="meta device"):
        preflight_checks.check_placement(model, torch.device("cpu"))
    model = model_loading.load_base_model(tiny_model_dir, torch.device("cpu"))
    model.lm_head.weight.data = model.lm_head.weight.data.to(torch.float64)  # same device, still one
    assert "on cpu" in preflight_checks.check_placement(model, torch.device("cpu"))


def test_placement_names_several_devices(monkeypatch):
    fake = torch.nn.Module()
    fake.a = torch.nn.Parameter(torch.zeros(1))
    fake.b = torch.nn.Parameter(torch.zeros(1))
    # A CPU build cannot place tensors on two real devices; report them as the check would see them.
    monkeypatch.setattr(preflight_checks, "named_parameters",
                        lambda model: {"a": fake.a, "b": type("T", (), {"device": torch.device("cuda", 1)})()})
    with pytest.raises(PreflightError, match=r"several devices \['cpu', 'cuda:1'\].*device_map='auto'"):
        preflight_checks.check_placement(fake, torch.device("cpu"))


# 4. name lookups with DDP
@pytest.fixture
def gloo_world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield DistributedContext(0, 0, 1, 1, torch.device("cpu"), "gloo")
    dist.destroy_process_group()


def test_name_lookup_with_real_ddp(monkeypatch, tiny_model_dir, gloo_world_of_one):
    setup = training_setup.build(tiny_model_dir, tiny_training_settings(), gloo_world_of_one)
    assert isinstance(setup.model, torch.nn.parallel.DistributedDataParallel)
    assert next(iter(dict(setup.model.named_parameters()))).startswith("module.")
    plain = parameter_names.lora_parameters(setup.peft_model)
    wrapped = parameter_names.lora_parameters(setup.model)
    assert set(plain) == set(wrapped) and len(plain) == 12
    assert all(plain[n] is wrapped[n] for n in plain)
    assert "through DistributedDataParallel" in preflight_checks.check_name_lookup(setup.model)
    preflight_checks.check_trainable(setup.model)
    # Plant the seed's bug: matching names without stripping DDP's prefix.
    monkeypatch.setattr(parameter_names, "strip_wrapper_prefix", lambda name: name)
    with pytest.raises(PreflightError, match="name_lookup: .* finds 0 of 12 LoRA parameters.*'module.' prefix"):
        preflight_checks.check_name_lookup(setup.model)


# 5. precision
def test_bf16_where_unsupported(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    monkeypatch.setattr(training_setup, "bf16_supported", lambda device: False)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir, precision="bf16")
    assert message.startswith("precision:") and "no bf16 support" in message


def test_fp16_without_scaler(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    def drop_scaler(setup):
        setup.scaler = None

    patch_build(monkeypatch, drop_scaler)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir, precision="fp16")
    assert "fp16 training without a gradient scaler" in message


def test_fp16_scale_collapse(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    def overflow(setup):  # every step's gradients overflow, so the scaler halves its scale each time
        for p in setup.trainable_parameters():
            p.register_hook(lambda grad: torch.full_like(grad, float("inf")))

    patch_build(monkeypatch, overflow)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir, precision="fp16")
    assert "loss scale collapsed from 65536" in message


def test_healthy_fp16_passes(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    code, out = run_gate(tmp_path, tiny_model_dir, tiny_tokenised_dir, precision="fp16")
    assert code == 0 and "loss_scale" in {c["name"] for c in json.loads(out.read_text())["checks"]}


# 6. memory
def test_estimate_exceeds_device(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    monkeypatch.setattr(memory_estimate, "device_capacity", lambda device, processes=1: 200_000)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir, gradient_checkpointing=False)
    assert message.startswith("memory:") and "exceeds 90%" in message
    assert "gradient_checkpointing: true" in message and "training.micro_batch (now 4" in message


# 7. device count
def test_world_differs_from_declared(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    # Two independent single-process tasks instead of one 2-process job (SLURM one-task-per-GPU pitfall).
    monkeypatch.setenv("LOCAL_RANK", "0")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir, cpu_processes=2)
    assert message.startswith("device_count:") and "runs 1 processes" in message and "implies 2" in message


def test_visible_gpus_differ_from_declared():
    with pytest.raises(PreflightError, match="declared gpus=2 but this process sees 1 GPUs.*tasks_per_gpu=0"):
        preflight_checks.check_device_count(2, 1, 1, 1, 2)
    with pytest.raises(PreflightError, match="sees 8 GPUs"):
        preflight_checks.check_device_count(4, 8, 4, 4, 4)
    assert "4 processes" in preflight_checks.check_device_count(4, 4, 4, 4, 4)


# 8. data
def test_token_ids_outside_vocabulary(tmp_path, tiny_model_dir):
    data = build_tiny_tokenised(tmp_path / "wide", rows=32, vocab_size=300)  # another tokenizer's ids
    message = gate_error(tmp_path, tiny_model_dir, data)
    assert message.startswith("data:") and "outside the model's vocabulary of 128" in message and "id 'train-" in message


def test_rows_with_all_labels_masked(tmp_path, tiny_model_dir):
    from datasets import load_from_disk

    data = build_tiny_tokenised(tmp_path / "masked", rows=32)
    split = load_from_disk(str(data / "train"))
    masked = split.map(lambda row, i: {"labels": [-100] * len(row["labels"]) if i == 7 else row["labels"]},
                       with_indices=True)
    masked.save_to_disk(str(tmp_path / "masked2" / "train"))
    (tmp_path / "masked2" / "tokenise_meta.json").write_text((data / "tokenise_meta.json").read_text())
    message = gate_error(tmp_path, tiny_model_dir, tmp_path / "masked2")
    assert "every label masked, first row 7 (id 'train-7')" in message


def test_model_left_in_eval_mode(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    patch_build(monkeypatch, lambda setup: setup.model.eval())
    message = gate_error(tmp_path, tiny_model_dir, tiny_tokenised_dir)
    assert message.startswith("data:") and "eval mode" in message


def test_batch_checks():
    device = torch.device("cpu")
    good = {"input_ids": torch.tensor([[3, 4]]), "labels": torch.tensor([[-100, 4]]), "row_ids": ["x"]}
    assert "1 rows x 2 tokens" in preflight_checks.check_batch(good, device, 10)
    with pytest.raises(PreflightError, match="empty batch"):
        preflight_checks.check_batch({**good, "input_ids": torch.zeros((0, 2), dtype=torch.long)}, device, 10)
    with pytest.raises(PreflightError, match="every label in the batch is masked"):
        preflight_checks.check_batch({**good, "labels": torch.tensor([[-100, -100]])}, device, 10)
    with pytest.raises(PreflightError, match="token id 12 is outside"):
        preflight_checks.check_batch({**good, "input_ids": torch.tensor([[3, 12]])}, device, 10)
    on_meta = {**good, "labels": good["labels"].to("meta")}
    with pytest.raises(PreflightError, match=r"batch tensors \{'labels': 'meta'\} are not on the model's device cpu"):
        preflight_checks.check_batch(on_meta, device, 10)
