"""What only a CUDA GPU shows (``make gpu-check``): every test here is skipped, with the reason, without one.

CI has no GPU, so these run when a GPU machine is lent (see docs/gpu-check.md). Each
test asserts what must hold on CUDA as on CPU (the loss falls, the gate passes, the stage outputs are
the same kind) and records what it measured as one JSON line in the file named by $GPU_CHECK_REPORT
(peak memory against the gate's estimate, step times, repeatability), which ``make gpu-check``
summarises for benchmarks/RESULTS.md.

The stages run in this test process (a world of one, as torchrun's worker would see it), so the CUDA
tests pay Python's imports and CUDA's start-up once, not twice per test; the one test marked
``launcher`` goes through the launcher and torchrun exactly as the rules do. Each records the time from
its stage's start to the end of the first training step (``seconds_from_stage_start``).
"""
from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from benchmarks import check_records
from conftest import tiny_training_settings, training_json
from test_train import adapter, log_rows, train_argv
from workflow_scripts import sanity, train
from workflow_scripts.launch import launcher

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run make gpu-check on a GPU machine"),
]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def record(request):
    """A dict the test fills with measurements; appended as one JSON line to $GPU_CHECK_REPORT."""
    measured: dict = {}
    yield measured
    if measured:
        check_records.append({"test": request.node.name, "device": torch.cuda.get_device_name(0), **measured})


@pytest.fixture(autouse=True)
def _private_leases(tmp_path, monkeypatch):
    # GPU stages take a lease on their device (launch/device_leases.py); keep the tests' leases apart.
    monkeypatch.setenv("LORA_WORKFLOW_LEASE_DIR", str(tmp_path / "leases"))


@pytest.fixture(autouse=True)
def _stages_in_this_process(request, monkeypatch):
    """A world of one as torchrun's environment describes it: the stages' main runs its worker here, in
    this process, instead of starting torchrun (tests marked ``launcher`` go through torchrun)."""
    if request.node.get_closest_marker("launcher") is None:
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(name, value)
    # What an earlier test left in reference cycles (a PEFT model) would still count in this test's
    # peak allocation, which is checked against the gate's estimate: free it first.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage_starts_now(monkeypatch) -> None:
    """The next stage's start-up is counted from now (through torchrun too: the launcher hands it on)."""
    monkeypatch.setenv(launcher.STAGE_STARTED_VARIABLE, repr(time.time()))


def run_summary(out: Path) -> dict:
    rows = log_rows(out)
    manifest = json.loads((out / "run_manifest.json").read_text())
    step_seconds = [b["elapsed_seconds"] - a["elapsed_seconds"] for a, b in zip(rows, rows[1:])]
    return {
        "steps": len(rows),
        "first_loss": rows[0]["loss"],
        "last_loss": statistics.mean(r["loss"] for r in rows[-5:]),
        "median_step_seconds": statistics.median(step_seconds) if step_seconds else None,
        "peak_memory_bytes": manifest["peak_memory_bytes"],
        "peak_memory_kind": manifest["peak_memory_kind"],
        "estimated_bytes": manifest["memory_estimate"]["total"],
        "devices": manifest["devices"],
        "skipped_updates": manifest["skipped_updates"],
        "seconds_from_stage_start": rows[0].get("seconds_from_stage_start"),
    }


def assert_trained_on_cuda(summary: dict) -> None:
    assert summary["peak_memory_kind"] == "cuda_max_allocated", summary
    assert all("cpu" not in str(device) for device in summary["devices"]), summary
    assert summary["last_loss"] < summary["first_loss"] - 0.1, summary
    # The gate refuses configs whose estimate exceeds the device; it must not under-estimate what ran.
    assert summary["estimated_bytes"] >= summary["peak_memory_bytes"], summary


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_generation_gate_and_training_on_cuda(precision, tmp_path, tiny_model_dir, tiny_tokenised_dir, record,
                                              monkeypatch):
    """bf16 autocast over bf16 frozen weights, and fp16 with fp32 master weights and the GradScaler
    (the classification seed's AMP path); the gate first, then training, in this process."""
    settings = tiny_training_settings(max_steps=30, learning_rate=3e-2, gpus=1, precision=precision,
                                      checkpoint_every=100, lora={"target_modules": ALL_LINEAR})
    common = ["--model", str(tiny_model_dir), "--data", str(tiny_tokenised_dir), "--training", training_json(settings),
              "--seed", "1"]
    assert sanity.main([*common, "--out", str(tmp_path / "sanity.json")]) == 0
    gate = json.loads((tmp_path / "sanity.json").read_text())
    assert gate["passed"], gate
    stage_starts_now(monkeypatch)
    assert train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
    summary = run_summary(tmp_path)
    record.update(precision=precision, gate_checks=len(gate["checks"]), in_process=True, **summary)
    assert_trained_on_cuda(summary)
    if precision == "fp16":
        assert summary["skipped_updates"] <= 3, summary  # a few at the start while the scale settles


@pytest.mark.launcher
def test_gate_and_training_through_the_launcher_and_torchrun(tmp_path, tiny_model_dir, tiny_tokenised_dir, record,
                                                             monkeypatch):
    """The one check that starts the stages as the rules do: the launcher leases the GPU (its
    CUDA_VISIBLE_DEVICES and rendezvous port) and starts torchrun, whose worker trains in bf16. Records each
    stage's wall time and training's start-up (launcher + torchrun + imports + CUDA + model, to step 1)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    settings = tiny_training_settings(max_steps=30, learning_rate=3e-2, gpus=1, precision="bf16",
                                      checkpoint_every=100, lora={"target_modules": ALL_LINEAR})
    common = ["--model", str(tiny_model_dir), "--data", str(tiny_tokenised_dir), "--training", training_json(settings),
              "--seed", "1"]
    assert launcher.needs_launch(settings.gpus, settings.cpu_processes)  # not a world-of-one shortcut
    started = time.perf_counter()
    assert sanity.main([*common, "--out", str(tmp_path / "sanity.json")]) == 0
    gate_seconds = time.perf_counter() - started
    assert json.loads((tmp_path / "sanity.json").read_text())["passed"]
    stage_starts_now(monkeypatch)
    started = time.perf_counter()
    assert train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
    train_seconds = time.perf_counter() - started
    summary = run_summary(tmp_path)
    record.update(in_process=False, gate_wall_seconds=gate_seconds, train_wall_seconds=train_seconds, **summary)
    assert_trained_on_cuda(summary)
    assert summary["seconds_from_stage_start"] is not None and 0 < summary["seconds_from_stage_start"] < train_seconds


def test_the_same_seed_gives_the_same_adapter_on_cuda(tmp_path, tiny_model_dir, tiny_tokenised_dir, record):
    """Reproducibility on the GPU: two runs of one config and seed; the difference is measured (cuBLAS
    may pick other kernels between runs) and must stay far below what one step changes."""
    settings = tiny_training_settings(max_steps=12, learning_rate=1e-2, gpus=1, precision="bf16", checkpoint_every=100)
    adapters = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert train.main(train_argv(out, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
        adapters.append(adapter(out))
    first, second = adapters
    difference = max(float((first[name].float() - second[name].float()).abs().max()) for name in first)
    scale = max(float(first[name].float().abs().max()) for name in first if "lora_B" in name)
    identical = all(torch.equal(first[name], second[name]) for name in first)
    record.update(bit_identical=identical, max_abs_difference=difference, largest_lora_b=scale)
    assert difference <= 1e-2 * scale, (difference, scale)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_vision_language_trains_in_bf16_on_cuda(family, tmp_path, record, monkeypatch):
    """Issue 12: a VLM family trains in bf16 on CUDA: the frozen tower in bf16, pixel values in the
    training precision, the projector trained whole; then evaluation generates on the GPU. Issue 38: the
    same for a tiny Qwen2.5-VL (dynamic resolution, M-RoPE positions from mm_token_type_ids, its merger as
    the projector); 20 steps each, so the two fit the phase's time that one family's 40 took."""
    import test_vision_language_chain as vlm
    from workflow_scripts.demo import make_images
    from workflow_scripts.checks.sections import validate_section
    from data_helpers import run_download, run_normalise

    assert make_images.main(["--out", str(tmp_path / "shapes"), "--train", "96", "--validation", "16",
                                  "--test", "32"]) == 0
    settings = validate_section({**vlm.SHAPES_SETTINGS, "source": {"type": "local", "path": str(tmp_path / "shapes")}},
                                "datasets", "datasets.shapes")
    data, _ = run_normalise("shapes", settings, run_download("shapes", settings, tmp_path), tmp_path)
    model_dir = vlm.build_model(tmp_path, family, data)
    tokenised = vlm.run_pretokenise(model_dir, data, vlm.VISION, tmp_path / "tokenised")
    training = tiny_training_settings(max_steps=20, learning_rate=3e-3, effective_batch=16, micro_batch=8,
                                      max_length=vlm.MAX_LENGTH, warmup_steps=5, checkpoint_every=100, gpus=1,
                                      precision="bf16", lora={"rank": 8, "alpha": 16,
                                                             "target_modules": [*ALL_LINEAR, "lm_head"],
                                                             "train_projector": True})
    common = ["--model", str(model_dir), "--data", str(tokenised), "--training", training_json(training), "--seed", "1"]
    assert sanity.main([*common, "--out", str(tmp_path / "sanity.json")]) == 0
    gate = json.loads((tmp_path / "sanity.json").read_text())
    assert gate["passed"], gate
    out = tmp_path / "run"
    stage_starts_now(monkeypatch)
    assert train.main(train_argv(out, model_dir, tokenised, training)) == 0
    summary = run_summary(out)
    result = vlm.run_evaluate(tmp_path, model_dir, data, vlm.VISION, "vision", "1", out / "adapter",
                              evaluation={**vlm.EVALUATION, "gpus": 1})
    record.update(family=family, score=result["score"], eval_device=result.get("device"), **summary)
    assert_trained_on_cuda(summary)
    assert result["n_examples"] == 32 and str(result.get("device", "cuda")).startswith("cuda")
