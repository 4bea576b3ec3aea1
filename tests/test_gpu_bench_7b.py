"""The 7B GPU benchmark's parts that can fail on its first CUDA run, checked on CPU (benchmarks/bench_gpu_7b.py)."""
from __future__ import annotations

import time

import pytest
import torch

from benchmarks import bench_gpu_7b


def test_the_trainer_side_halves_its_micro_batch_when_cuda_runs_out_of_memory(monkeypatch):
    """At micro-batch 8 x 4,096 tokens Trainer's fp32 logits can exceed an 80 GB H100: the side is then
    measured at the largest micro-batch that fits, the effective batch kept, and says so."""
    tried = []

    def run_trainer(base, rows, settings, side, device, micro_batch=None):
        tried.append((micro_batch, settings["effective_batch"]))
        if micro_batch > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 19.84 GiB")
        return {"tokens_per_second": 1000.0}

    monkeypatch.setattr(bench_gpu_7b, "run_trainer", run_trainer)
    settings = bench_gpu_7b.SCALES["7b"]
    side = next(s for s in bench_gpu_7b.SIDES if s.name == "trainer")
    result = bench_gpu_7b.trainer_that_fits(None, [], settings, side, torch.device("cpu"),
                                            time.monotonic() + 60, log=lambda message: None)
    assert tried == [(8, 16), (4, 16), (2, 16)]
    assert result == {"tokens_per_second": 1000.0, "micro_batch": 2, "out_of_memory_at_micro_batch": [8, 4]}
    with pytest.raises(torch.cuda.OutOfMemoryError):  # the phase's time spent: the failure is recorded as such
        bench_gpu_7b.trainer_that_fits(None, [], settings, side, torch.device("cpu"), time.monotonic() - 1,
                                       log=lambda message: None)


def test_liger_patches_the_benchmark_model_and_are_undone_after_the_side():
    """Liger's instance patching (ours' liger_kernels, Trainer's use_liger_kernel) on the 7B family under the
    installed transformers, and liger_undone restoring the model for the next side. The patching is Python;
    only running the patched kernels needs CUDA."""
    pytest.importorskip("liger_kernel", reason="liger-kernel (the gpu extra) is not installed here")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    base = bench_gpu_7b.build_model(bench_gpu_7b.model_config(tiny=True), torch.device("cpu"), torch.float32)
    mlp = base.model.layers[0].mlp
    forward = type(mlp).forward
    with bench_gpu_7b.liger_undone(base):
        _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
        assert "Liger" in mlp.forward.__qualname__
    assert "forward" not in vars(mlp) and type(mlp).forward is forward
    assert "Liger" not in base.model.norm.forward.__qualname__


# --- issue 45: a benchmark that cannot mislead ---
def _timed_rows_tokens(settings):
    """Each step's non-padding tokens when step k trains rows[k x E : (k+1) x E] in file order."""
    config = bench_gpu_7b.model_config(tiny=True)
    e, steps = settings["effective_batch"], settings["warmup_steps"] + settings["timed_steps"]
    rows = bench_gpu_7b.example_rows(settings, config.vocab_size, steps * e)
    return [sum(len(r["input_ids"]) for r in rows[k * e:(k + 1) * e]) for k in range(steps)]


@pytest.fixture(scope="module")
def tiny_base():
    """The 7b-tiny model, its rows and settings, shared by this module's side runs (each side removes its
    adapters again, as in the benchmark)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    settings = bench_gpu_7b.SCALES["7b-tiny"]
    config = bench_gpu_7b.model_config(tiny=True)
    rows = bench_gpu_7b.example_rows(settings, config.vocab_size,
                                     (settings["warmup_steps"] + settings["timed_steps"]) * settings["effective_batch"])
    base = bench_gpu_7b.build_model(config, torch.device("cpu"), torch.float32)
    for p in base.parameters():
        p.requires_grad_(False)
    yield base, rows, settings
    torch.set_num_threads(threads)
    torch._dynamo.reset()


def _side(name):
    return next(s for s in bench_gpu_7b.SIDES if s.name == name)


@pytest.mark.bench
def test_the_trainer_side_counts_the_tokens_it_trained(tiny_base):
    """Issue 45's audit: Trainer fetches a step's micro-batches before on_step_begin and accelerate reads one
    batch ahead, so the tokens a collator counted by on_step_end were not the ones trained (1.30x under-counted
    on the H200; 456 counted for 568 trained here before the fix), and its random sampler timed other rows than
    ours. The side's tokens over its timed window must be exactly those of the timed steps' rows in file order."""
    base, rows, settings = tiny_base
    run = bench_gpu_7b.run_side(base, rows, settings, _side("trainer"), torch.device("cpu"), time.monotonic() + 600,
                                lambda message: None)
    per_step = _timed_rows_tokens(settings)
    assert round(run["tokens_per_second"] * run["timed_seconds"]) == sum(per_step[settings["warmup_steps"]:])
    assert [s["tokens"] for s in run["steps"]] == per_step  # each step: its own rows, where the model saw them
    assert run["trainer_tokens_seen"] == sum(per_step)  # Trainer's own non_padding count agrees
    assert run["shape_pass"]["shapes"] >= 1 and all(s["seconds"] > 0 for s in run["steps"])


def test_a_shape_pass_leaves_no_compile_in_the_timed_steps():
    """What compiles per shape (FlexAttention, compiled layers: torch.compile) must compile before the clock
    runs. Dynamo's ``eager`` backend: real graphs, guards and recompiles, no code generation. Without the
    shape pass a timed step meets a new shape and compiles (the first H200 run's ours_fast r16)."""
    torch._dynamo.reset()
    layer = torch.nn.Linear(8, 8)
    compiled = torch.compile(layer, backend="eager")

    def step(batch):
        compiled(batch["x"]).sum().backward()
        layer.zero_grad(set_to_none=True)

    batches = [{"x": torch.randn(n, 8)} for n in (3, 5, 3, 7, 5)]
    counter = bench_gpu_7b.TokenCounter(torch.nn.Identity(), pad_id=0)
    before = bench_gpu_7b.dynamo_graphs()
    shapes = bench_gpu_7b.shape_pass(step, batches)
    assert shapes["shapes"] == 3 and shapes["new_graphs"] >= 1 and bench_gpu_7b.dynamo_graphs() - before == shapes["new_graphs"]
    clock = bench_gpu_7b.StepClock(torch.device("cpu"), counter)
    for batch in batches:
        step(batch)
        clock.mark()
    assert [s["new_graphs"] for s in clock.steps(warmup=0)] == [0] * len(batches)
    torch._dynamo.reset()  # the control: no shape pass, so a timed step compiles
    compiled = torch.compile(layer, backend="eager")
    clock = bench_gpu_7b.StepClock(torch.device("cpu"), counter)
    for batch in batches:
        step(batch)
        clock.mark()
    assert sum(s["new_graphs"] for s in clock.steps(warmup=1)) >= 1
    torch._dynamo.reset()


@pytest.mark.bench
def test_the_benchmark_interleaves_repetitions_on_the_same_rows_and_keeps_the_raw_records(tmp_path, monkeypatch):
    """Three repetitions interleaved (A C trainer, A C trainer, A C trainer), every side on the same rows
    (the same tokens per step; C fills full rows: padding under 5 %), medians with min-max in the summary,
    the raw records (steps included) in OUT/gpu_benchmark_7b.jsonl, a profile of the best side of ours; the
    TRL side skipped with the reason where trl is not installed."""
    import json

    from benchmarks import bench_gpu, check_records

    report = tmp_path / "measurements.jsonl"
    monkeypatch.setenv(check_records.VARIABLE, str(report))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert bench_gpu.main(["--scale", "7b-tiny", "--cpu", "--out-dir", str(tmp_path / "out"),
                               "--sides", "A", "C", "trl", "trainer"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = [r for r in check_records.read(report) if r.get("check") == bench_gpu_7b.NAME]
    runs = [(r["side"], r["repetition"]) for r in rows if r.get("repetition")]
    assert runs == [(side, k) for k in (1, 2, 3) for side in ("A", "C", "trl", "trainer")]
    measured = [r for r in rows if r.get("status") == "measured" and r.get("repetition")]
    per_step = _timed_rows_tokens(bench_gpu_7b.SCALES["7b-tiny"])
    for run in measured:
        assert [s["tokens"] for s in run["steps"]] == per_step, run["side"]
        assert run["new_graphs_in_timed_steps"] == 0
    c = next(r for r in measured if r["side"] == "C")
    assert c["padding_share"] < 0.05 and c["collation"] == "DataLoader workers" and c["full_rows"]
    assert set(c["cpu_without"]) == {"flex_attention", "fused_cross_entropy", "liger_kernels"}
    trl = [r for r in rows if r["side"] == "trl"]
    if bench_gpu_7b.trl_missing():
        assert all(r["status"] == "skipped" and "trl" in r["reason"] for r in trl)
    else:
        assert all(r["status"] == "measured" and r["padding_share"] == 0 for r in trl)
    summary = json.loads((tmp_path / "out" / "gpu_benchmark_7b.json").read_text())
    trainer = summary["sides"]["trainer"]["tokens_per_second"]
    values = [r["tokens_per_second"] for r in measured if r["side"] == "trainer"]
    assert trainer == {"median": sorted(values)[1], "min": min(values), "max": max(values), "n": 3}
    assert summary["best_ours"] in {"A", "C"} and "Name" in summary["profile"]
    assert f"{summary['best_ours']} / trainer" in summary["ratios"]
    raw = [json.loads(line) for line in (tmp_path / "out" / "gpu_benchmark_7b.jsonl").read_text().splitlines()]
    assert [(r["side"], r["repetition"]) for r in raw] == runs and all("steps" in r for r in raw if r["status"] == "measured")
    from benchmarks import gpu_check  # make gpu-check's summary.md shows the medians, ratios and the profile

    text = gpu_check.render_summary(check_records.read(report))
    median = f"{trainer['median']:,.0f} ({trainer['min']:,.0f}-{trainer['max']:,.0f}, 3)"
    assert f"| trainer | {median} |" in text and f"Profile of {summary['best_ours']}" in text
    assert f"- {summary['best_ours']} / trainer: " in text and "NeMo AutoModel" in text


@pytest.mark.bench
def test_compiled_layers_compile_in_the_shape_pass_only(tiny_base):
    """Side D (compiled decoder layers, Dynamo's eager backend on CPU): graphs compiled in the shape pass, none
    in a step; its batches come from DataLoader workers, as the shape pass's do (an in-process batch there
    left a recompile in step 1: a worker's shared-memory tensor fails guards an in-process one passed)."""
    base, rows, settings = tiny_base
    result = bench_gpu_7b.run_side(base, rows, settings, _side("D"), torch.device("cpu"), time.monotonic() + 600,
                                   lambda message: None)
    assert result["switches"]["compile_layers"] and result["compile_backend"] == "eager"
    # and D's LoRA A GEMMs fused (model/fused_lora.py): q/k/v and gate/up of every layer, traced by the compile
    assert result["fused_lora_a_groups"] == 2 * base.config.num_hidden_layers
    assert result["shape_pass"]["new_graphs"] >= 1
    assert [s["new_graphs"] for s in result["steps"]] == [0] * len(result["steps"])


def _saved_activation_bytes(loss_module, batch, parameters) -> int:
    """An accounting of what one micro-batch's forward keeps for the backward: every tensor autograd saves
    (each storage once, the model's own weights left out), plus the gradient of the target logits, which the
    backward of the head makes at full size (the estimate charges logits and their gradient)."""
    import torch

    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss_module(batch)
    vocab = loss_module.wrapped.get_base_model().config.vocab_size
    return sum(saved.values()) + batch["target_tokens"] * vocab * 4


@pytest.mark.parametrize("name", ["A", "C"])
def test_the_memory_estimate_counts_the_slots_a_packed_micro_batch_holds(tiny_base, name):
    """The gate's activation estimate for the benchmark's packed micro-batches is within 1.0-1.3x of an
    accounting of their tensors (the largest micro-batch sets the peak). Charging micro_batch x max_length
    slots (what it did: 2.78x over on the H200, 32,768 slots where packed micro-batches held at most 12,288)
    would be far above it and refuse the configurations that run fastest."""
    from workflow_scripts.data.packing import PackingCollator
    from workflow_scripts.model import memory_estimate, model_loading
    from workflow_scripts.tasks.generation import TargetTokenLoss

    base, rows, settings = tiny_base
    side = _side(name)
    estimated = bench_gpu_7b.estimate_settings(settings, side, {}, False, False, rows)
    peft_model = model_loading.add_lora(base, estimated.lora, gradient_checkpointing=False)
    peft_model.train()
    try:
        parameters = {p.untyped_storage().data_ptr() for p in peft_model.parameters()}
        collator = PackingCollator(bench_gpu_7b.synthetic.PAD_ID, base.config.vocab_size, settings["max_length"],
                                   "sdpa", one_row=side.full_rows, width_multiple=settings["width_multiple"])
        loss_module = TargetTokenLoss(peft_model)
        accounted = max(_saved_activation_bytes(loss_module, collator(m), parameters)
                        for step in bench_gpu_7b.step_rows(rows, settings)
                        for m in bench_gpu_7b.ours_micro_batches(step, settings, side.full_rows))
        estimate = memory_estimate.estimate(peft_model, estimated, torch.device("cpu"))["activations"]
        assert 1.0 <= estimate / accounted <= 1.3, (estimate, accounted, estimated.micro_batch_tokens)
        if not side.full_rows:  # micro_batch x max_length, as before the fix
            old = bench_gpu_7b.training_settings(settings, side, {}, False, recompute=False)
            assert memory_estimate.estimate(peft_model, old, torch.device("cpu"))["activations"] / accounted > 1.5
    finally:
        peft_model.unload()


def test_the_summary_gives_the_fused_lora_a_share_of_side_d_when_d_unfused_ran():
    """D_unfused (by name) is D without the fused LoRA A GEMM: the summary's ratio D / D_unfused is its share."""
    import numpy as np

    def run(side, tokens_per_second):
        return {"side": side, "status": "measured", "tokens_per_second": tokens_per_second, "padding_share": 0.01,
                "new_graphs_in_timed_steps": 0, "mfu": None}

    settings = bench_gpu_7b.SCALES["7b-tiny"]
    config = bench_gpu_7b.model_config(tiny=True)
    lengths = np.array([64, 128, 600])
    raw = [run("D", 110.0), run("D_unfused", 100.0), run("D", 120.0), run("D_unfused", 100.0)]
    summary = bench_gpu_7b.summarise(raw, settings, "cpu", None, config, lengths, 0.5, {})
    assert summary["ratios"]["D / D_unfused"] == pytest.approx(1.15)
    assert "D / D_unfused" not in bench_gpu_7b.summarise(raw[::2], settings, "cpu", None, config, lengths, 0.5,
                                                          {})["ratios"]
    assert "D_unfused" not in bench_gpu_7b.DEFAULT_SIDES  # by name only: the plan has no room for it
