"""GPU benchmark at the seeds' size (issue 28): LoRA bf16 training of the Qwen2.5-7B architecture, ours
with each speed switch (training/kernels.py) off and on, against HF Trainer + PEFT at its defaults and
Trainer + PEFT with ``use_liger_kernel=True``, in ONE process on the same data and effective batch.

    python -m benchmarks.bench_gpu --scale 7b --out-dir OUT          # the GPU check's phase benchmark_7b
    python -m benchmarks.bench_gpu --scale 7b-tiny --cpu --out-dir OUT   # the harness on CPU (tests)

* Model: Qwen2.5-7B's published config.json (below), random weights created directly on the GPU in
  bf16 (built on the meta device, ``to_empty`` on CUDA, then initialised there): nothing downloaded,
  nothing written to disk. Built once; each side adds its adapters and removes them (``unload``).
* LoRA on every linear layer of the decoder (q, k, v, o, gate, up, down), r = 16 and r = 128 (the seed's).
* Data: a long-tailed length mix (log-normal, 64..4096 tokens, median 600), a prompt share masked.
  Ours packs each micro-batch into rows of at most 4,096 tokens (data/packing.py); the Trainer pads each
  micro-batch to its longest row (its default collator, random order).
* Ours here is the training loop's parts called in-process (``model_loading.add_lora``,
  ``TargetTokenLoss``, ``kernels``, ``PackingCollator``, fused AdamW, one optimizer step as
  ``training_setup`` takes it), not the train stage: the stage would need the 15 GB weights on disk.
* Report per side: non-padding tokens/s over the timed steps (warm-up steps and compile time apart),
  MFU = tokens/s x LoRA-adjusted model FLOPs per token / 989 TFLOP/s (dense bf16 of the H100 SXM and the
  H200, one compute die), the measured large-matmul ceiling beside it, peak memory against the gate's
  estimate (``memory_estimate.estimate``). Model FLOPs as NeMo counts them for LoRA: frozen weights do
  forward and input-gradient matmuls only (4 x params), adapters 6 x params, attention
  12 x layers x hidden x context (context per example: packed documents attend only within themselves),
  the LM head at target positions only (4 x hidden x vocab x target share; the loss needs no more).
* Sides run in priority order within the phase's seconds (``--seconds``, or $GPU_CHECK_PHASE_SECONDS
  given by benchmarks/gpu_check.py); a side that would not fit is recorded as skipped. Liger patches
  the model instance for good, so every side before the first Liger side runs on the unpatched model.
  Each side's record is appended to $GPU_CHECK_REPORT the moment it is measured (check_records).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time

import numpy as np

from benchmarks import check_records, synthetic

NAME = "gpu_lora_7b"
TITLE = "GPU: LoRA bf16 training of the Qwen2.5-7B architecture, ours (switches off/on) vs Trainer + PEFT (+ Liger)"

# Qwen/Qwen2.5-7B config.json (published values).
QWEN25_7B = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEAK_BF16_TFLOPS = 989.0  # H100 SXM and H200: one compute die, the same dense bf16 peak
GOALS = {"mfu": 0.40, "vs_trainer": 1.5, "vs_trainer_liger": 1.0, "estimate_over_peak": (1.0, 1.3)}
SCALES = {
    "7b": {"max_length": 4096, "micro_batch": 8, "effective_batch": 16, "warmup_steps": 1, "timed_steps": 2,
           "length": {"low": 64, "high": 4096, "median": 600, "sigma": 1.0}, "ranks": (16, 128)},
    "7b-tiny": {"max_length": 128, "micro_batch": 4, "effective_batch": 8, "warmup_steps": 1, "timed_steps": 2,
                "length": {"low": 8, "high": 128, "median": 24, "sigma": 1.0}, "ranks": (4, 8)},
}
# (side, rank index, our switches or the Trainer's use_liger_kernel, rough seconds on one H100 at 7b scale),
# in priority order: the goals' sides first. "fast" = the exact switches (the candidates for the GPU default).
# Liger's patches are undone after each side (liger_undone), so order does not leak between sides.
FAST = {"flex_attention": True, "fused_cross_entropy": True, "liger_kernels": True}
SIDES = [
    ("ours_fast", 0, FAST, 30),  # the first flex side compiles FlexAttention's kernel
    ("trainer", 0, {"use_liger_kernel": False}, 25),
    ("trainer_liger", 0, {"use_liger_kernel": True}, 20),
    ("ours_off", 0, {}, 15),
    ("ours_fast", 1, FAST, 15),
    ("trainer_liger", 1, {"use_liger_kernel": True}, 20),
    ("trainer", 1, {"use_liger_kernel": False}, 25),
    ("ours_flex", 0, {"flex_attention": True}, 15),
    ("ours_flex_fused_ce", 0, {"flex_attention": True, "fused_cross_entropy": True}, 15),
    ("ours_fast_offload", 0, {**FAST, "activation_offloading": True}, 20),
    ("ours_fast_compile", 0, {**FAST, "compile_layers": True}, 60),
]
LIGER_SIDES = {"ours_fast", "trainer_liger", "ours_fast_offload", "ours_fast_compile"}


@contextlib.contextmanager
def liger_undone(base):
    """Undo what Liger patches (module functions and classes of the model's family, methods bound on the
    instance's modules) when the side ends, so the next side runs on the model as transformers builds it."""
    import importlib

    family = importlib.import_module(type(base).__module__)
    functions = dict(vars(family))
    methods = {cls: dict(vars(cls)) for cls in functions.values() if isinstance(cls, type)
               and getattr(cls, "__module__", None) == family.__name__}
    try:
        yield
    finally:
        for name, value in functions.items():
            setattr(family, name, value)
        for cls, attributes in methods.items():
            for name in ("forward", "extra_repr"):
                if name in attributes:
                    setattr(cls, name, attributes[name])
        for module in base.modules():
            for name in ("forward", "extra_repr"):
                module.__dict__.pop(name, None)


def model_config(tiny: bool):
    from transformers import Qwen2Config

    values = dict(QWEN25_7B)
    if tiny:
        values.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2Config(**values, pad_token_id=synthetic.PAD_ID, eos_token_id=synthetic.EOS_ID, bos_token_id=None)


def lora_params(config, rank: int) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    h, i = config.hidden_size, config.intermediate_size
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    return config.num_hidden_layers * sum(rank * (a + b) for a, b in shapes)


def flops_per_token(config, lengths: np.ndarray, target_share: float, rank: int) -> float:
    """LoRA-adjusted model FLOPs per non-padding token (module docstring)."""
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    h, i = config.hidden_size, config.intermediate_size
    frozen = config.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * i)
    mean_context = float((lengths.astype(np.float64) ** 2).sum() / lengths.sum())
    attention = 12 * config.num_hidden_layers * h * mean_context
    return 4 * frozen + 4 * h * config.vocab_size * target_share + 6 * lora_params(config, rank) + attention


def build_model(config, device, dtype):
    """Random weights made where they will live: structure on the meta device, storage on ``device``,
    then the model's own initialisation there (no CPU copy of 15 GB)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            model._init_weights(module)
    rotary = model.model.rotary_emb  # its inv_freq buffer is computed at construction, not initialised
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(config=model.config)
    return model.eval()


def example_rows(settings: dict, vocab: int, rows: int) -> list[dict]:
    length = settings["length"]
    lengths = synthetic.long_tailed_lengths(rows, length["low"], length["high"], length["median"], length["sigma"], seed=41)
    rng = np.random.default_rng(42)
    out = []
    for k, n in enumerate(lengths.tolist()):
        ids = rng.integers(3, vocab, size=n).tolist()
        prompt = int(n * 0.6)
        out.append({"id": f"ex-{k}", "input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def matmul_ceiling(device) -> float | None:
    """Achieved TFLOP/s of a large bf16 matmul (8192^3): what the chip gives a dense GEMM here."""
    import torch

    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * repeats / (time.perf_counter() - started) / 1e12


def training_settings(settings: dict, rank: int, switches: dict, on_gpu: bool):
    from workflow_scripts.core.settings import TrainingSettings

    steps = settings["warmup_steps"] + settings["timed_steps"]
    return TrainingSettings.parse({
        "lora": {"rank": rank, "alpha": 2 * rank, "dropout": 0.0, "target_modules": ALL_LINEAR},
        "max_length": settings["max_length"], "effective_batch": settings["effective_batch"],
        "micro_batch": settings["micro_batch"], "max_steps": steps, "warmup_steps": 0,
        "precision": "bf16" if on_gpu else "fp32", "gradient_checkpointing": True, "packing": True,
        "gpus": 1 if on_gpu else 0, "dataloader_workers": 0, **switches})


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_ours(base, rows, settings, rank, switches, device, profile: bool = False) -> dict:
    """Our loop's parts on the shared base model; the adapters are removed again at the end."""
    import torch

    from workflow_scripts.data.packing import PackingCollator
    from workflow_scripts.model import memory_estimate, model_loading
    from workflow_scripts.tasks.generation import TargetTokenLoss
    from workflow_scripts.training import kernels, training_setup

    on_gpu = device.type == "cuda"
    training = training_settings(settings, rank, switches, on_gpu)
    base.set_attn_implementation(kernels.attn_implementation(training) or "sdpa")
    kernels.apply_before_lora(base, training, device)
    _reset_peak(device)
    peft_model = model_loading.add_lora(base, training.lora, training.gradient_checkpointing)
    peft_model.train()
    try:
        kernels.apply_after_lora(peft_model, training)
        loss_module = TargetTokenLoss(peft_model)
        loss_module.fused_cross_entropy = kernels.fused_cross_entropy(peft_model, training, device)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer, _ = training_setup.build_optimizer_and_scheduler(trainable, training, device)
        collator = PackingCollator(synthetic.PAD_ID, base.config.vocab_size, training.max_length,
                                   base.config._attn_implementation)
        estimate = memory_estimate.estimate(peft_model, training, device)
        micro, accumulation = training.micro_batch, training.accumulation
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext()
        ends, real, padded = [], [], []
        compiled_before = kernels.compile_seconds()
        started = time.perf_counter()
        for step in range(training.max_steps):
            batches = [collator(rows[(step * accumulation + k) * micro:(step * accumulation + k + 1) * micro])
                       for k in range(accumulation)]
            targets = sum(b["target_tokens"] for b in batches)
            for batch in batches:
                batch = training_setup.to_device(batch, device)
                with autocast, kernels.offloading(training, device):
                    loss = loss_module(batch)
                (loss / targets).backward()
            torch.nn.utils.clip_grad_norm_(trainable, training.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            ends.append(time.perf_counter() - started)
            real.append(sum(b["real_tokens"] for b in batches))
            padded.append(sum(b["padded_tokens"] for b in batches))
        compile_seconds = kernels.compile_seconds() - compiled_before
        result = window(ends, real, padded, settings["warmup_steps"])
        result.update(compile_seconds=compile_seconds, estimated_bytes=estimate["total"],
                      estimate=estimate, switches=kernels.switches(training),
                      attention=str(base.config._attn_implementation))
        if on_gpu:
            result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        if profile:
            result["profile"] = profile_step(loss_module, collator, rows[:micro], device, training, autocast)
        return result
    finally:
        base_again = peft_model.get_base_model()
        for layer in base_again.model.layers:
            layer._compiled_call_impl = None  # undo compile_layers for the next side
        peft_model.unload()
        del peft_model
        _reset_peak(device)


def profile_step(loss_module, collator, rows, device, training, autocast) -> str:
    """The top kernels of one micro-step (forward + backward): where the time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from workflow_scripts.training import kernels, training_setup

    batch = training_setup.to_device(collator(rows), device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with autocast, kernels.offloading(training, device):
            loss = loss_module(batch)
        loss.backward()
        _sync(device)
    loss_module.wrapped.zero_grad(set_to_none=True)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60)


def window(ends: list[float], real: list[float], padded: list[float], skip: int) -> dict:
    seconds = ends[-1] - ends[skip - 1] if skip else ends[-1]
    timed_real, timed_padded = sum(real[skip:]), sum(padded[skip:])
    return {"tokens_per_second": timed_real / max(seconds, 1e-9), "timed_seconds": seconds,
            "padding_share": timed_padded / max(1, timed_real + timed_padded), "steps": len(ends),
            "warmup_seconds": ends[skip - 1] if skip else 0.0}


def run_trainer(base, rows, settings, rank, use_liger_kernel: bool, device) -> dict:
    """HF Trainer + PEFT at its defaults (random order, each micro-batch padded to its longest row), bf16,
    fused AdamW as Trainer picks it; gradient checkpointing on as ours (without it 7B at 8 x 4096 padded
    tokens does not fit), optionally ``use_liger_kernel=True``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    on_gpu = device.type == "cuda"
    base.set_attn_implementation("sdpa")
    _reset_peak(device)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=ALL_LINEAR,
                                            task_type="CAUSAL_LM"))
    counted: list[tuple[int, int]] = []

    def pad(batch):
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), width), synthetic.PAD_ID)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for k, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[k, :n], labels[k, :n], mask[k, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
        counted.append((int(mask.sum()), mask.numel()))
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    marks: list[tuple[float, int]] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not hasattr(self, "started"):
                self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            marks.append((time.perf_counter() - self.started, len(counted)))

    data = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
    steps = settings["warmup_steps"] + settings["timed_steps"]
    with tempfile.TemporaryDirectory(prefix="bench-7b-trainer-") as out:
        arguments = TrainingArguments(
            output_dir=out, per_device_train_batch_size=settings["micro_batch"],
            gradient_accumulation_steps=settings["effective_batch"] // settings["micro_batch"], max_steps=steps,
            learning_rate=2e-4, save_strategy="no", report_to="none", bf16=on_gpu, use_cpu=not on_gpu,
            gradient_checkpointing=True, use_liger_kernel=use_liger_kernel, dataloader_num_workers=0,
            disable_tqdm=True, remove_unused_columns=False, logging_steps=steps, seed=0)
        trainer = Trainer(model=model, args=arguments, train_dataset=data, data_collator=pad, callbacks=[StepTimes()])
        try:
            trainer.train()
            ends = [m[0] for m in marks]
            real, padded, first = [], [], 0
            for _, last in marks:
                real.append(sum(r for r, _ in counted[first:last]))
                padded.append(sum(t - r for r, t in counted[first:last]))
                first = last
            # The first step's clock starts at its beginning: its time counts as warm-up like ours.
            result = window([m for m in ends], real, padded, settings["warmup_steps"])
            result["optimizer"] = str(getattr(arguments.optim, "value", arguments.optim))
            result["use_liger_kernel"] = use_liger_kernel
            if on_gpu:
                result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
            return result
        finally:
            del trainer
            model.unload()
            _reset_peak(device)


def trainer_that_fits(base, rows, settings, rank, use_liger_kernel: bool, device, deadline: float, log=print) -> dict:
    """Trainer + PEFT at the largest micro-batch that fits, the effective batch kept: at its defaults its
    loss materialises the logits of every padded position in fp32 (8 x 4096 x 152,064 x 4 B = 20 GB, twice
    with log-softmax), which can exceed an 80 GB H100 at micro-batch 8; a user would halve it, so the side
    halves it on CUDA's out-of-memory error (while the phase's time lasts) and records what it used."""
    import gc

    import torch

    micro, refused = settings["micro_batch"], []
    while True:
        try:
            result = run_trainer(base, rows, {**settings, "micro_batch": micro}, rank, use_liger_kernel, device)
            break
        except torch.cuda.OutOfMemoryError:
            if micro == 1 or time.monotonic() > deadline:
                raise
            refused.append(micro)
        gc.collect()  # the failed attempt's tensors, held by its frames until here
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"  7b trainer: out of memory at micro-batch {micro}; trying {micro // 2}")
        micro //= 2
    result.update(micro_batch=micro, out_of_memory_at_micro_batch=refused)
    return result


def measure(scale: str, on_cpu: bool, seconds: float, sides: list[str] | None = None, log=print) -> dict:
    import torch

    settings = SCALES[scale]
    device = torch.device("cpu" if on_cpu else "cuda")
    device_name = "cpu" if on_cpu else torch.cuda.get_device_name(0)
    deadline = time.monotonic() + seconds
    config = model_config(tiny=scale.endswith("tiny"))
    steps = settings["warmup_steps"] + settings["timed_steps"]
    rows = example_rows(settings, config.vocab_size, steps * settings["effective_batch"])
    lengths = np.array([len(r["input_ids"]) for r in rows])
    target_share = float(np.mean([sum(t != -100 for t in r["labels"][1:]) / len(r["labels"]) for r in rows]))
    ceiling = matmul_ceiling(device)
    built = time.perf_counter()
    base = build_model(config, device, torch.float32 if on_cpu else torch.bfloat16)
    for p in base.parameters():
        p.requires_grad_(False)
    build_seconds = time.perf_counter() - built
    common = {"check": NAME, "device": device_name, "scale": scale, "repetition": 1}
    check_records.append({**common, "side": "setup", "status": "built", "build_seconds": build_seconds,
                          "matmul_ceiling_tflops": ceiling, "lengths": synthetic.length_summary(lengths)})
    log(f"  7b: model built in {build_seconds:.1f} s on {device_name}; matmul ceiling {ceiling} TFLOP/s")
    measured: dict[str, dict] = {}
    for side, rank_index, switches, expected in SIDES:
        rank = settings["ranks"][rank_index]
        label = f"{side} r{rank}"
        if sides and side not in sides:
            continue
        record = {**common, "side": label, "rank": rank, "switches": switches}
        left = deadline - time.monotonic()
        needs_cuda = side in LIGER_SIDES or any(switches.get(k) for k in ("fused_cross_entropy", "use_liger_kernel",
                                                                         "flex_attention"))
        budget = expected if not on_cpu else 0
        if needs_cuda and on_cpu:
            reason = "needs CUDA (Liger's Triton kernels; FlexAttention has no backward on CPU); refused on CPU"
        elif budget > left:
            reason = f"would not fit: about {budget} s expected, {left:.0f} s left (run --only benchmark_7b for all sides)"
        else:
            reason = None
        if reason:
            check_records.append({**record, "status": "skipped", "reason": reason})
            log(f"  7b {label}: skipped ({reason})")
            continue
        started = time.perf_counter()
        try:
            with liger_undone(base):
                if side.startswith("trainer"):
                    result = trainer_that_fits(base, rows, settings, rank, switches["use_liger_kernel"], device,
                                               deadline, log)
                else:
                    result = run_ours(base, rows, settings, rank, switches, device)
        except Exception as error:
            check_records.append({**record, "status": "failed", "error": f"{type(error).__name__}: {error}"[-2000:]})
            log(f"  7b {label}: failed: {type(error).__name__}: {str(error)[:300]}")
            continue
        per_token = flops_per_token(config, lengths, target_share, rank)
        result["mfu"] = result["tokens_per_second"] * per_token / (PEAK_BF16_TFLOPS * 1e12) if not on_cpu else None
        result["mfu_of_matmul_ceiling"] = (result["tokens_per_second"] * per_token / (ceiling * 1e12)) if ceiling else None
        result["side_seconds"] = time.perf_counter() - started
        result.pop("estimate", None)
        measured[label] = result
        check_records.append({**record, "status": "measured", "model_flops_per_token": per_token, **result})
        log(f"  7b {label}: {result['tokens_per_second']:.0f} tokens/s, MFU {result['mfu']}, "
            f"{result['side_seconds']:.0f} s")
    return summarise(measured, settings, device_name, ceiling, config, lengths, target_share, common)


def summarise(measured, settings, device_name, ceiling, config, lengths, target_share, common) -> dict:
    """The goals from whatever was measured; a goal whose sides are missing says so."""
    rank = settings["ranks"][0]
    ours = max((r for k, r in measured.items() if k.startswith("ours") and k.endswith(f"r{rank}")),
               key=lambda r: r["tokens_per_second"], default=None)
    best = next((k for k, r in measured.items() if r is ours), None)

    def ratio(side):
        other = measured.get(f"{side} r{rank}")
        return ours["tokens_per_second"] / other["tokens_per_second"] if ours and other else None

    goals = {
        f"MFU of {best} >= {GOALS['mfu']:.0%}": (ours.get("mfu") if ours else None, GOALS["mfu"]),
        f"{best} / Trainer + PEFT >= {GOALS['vs_trainer']}x": (ratio("trainer"), GOALS["vs_trainer"]),
        f"{best} / Trainer + PEFT + Liger >= {GOALS['vs_trainer_liger']}x": (ratio("trainer_liger"), GOALS["vs_trainer_liger"]),
    }
    estimates = {k: r["estimated_bytes"] / r["peak_memory_bytes"] for k, r in measured.items()
                 if r.get("estimated_bytes") and r.get("peak_memory_bytes")}
    result = {
        **common, "side": "summary", "status": "measured" if measured else "nothing measured",
        "best_ours": best, "goals": {name: {"value": value, "goal": goal, "met": None if value is None else value >= goal}
                                      for name, (value, goal) in goals.items()},
        "estimate_over_peak": estimates, "estimate_goal": GOALS["estimate_over_peak"],
        "peak_tflops": PEAK_BF16_TFLOPS, "matmul_ceiling_tflops": ceiling, "model_config": config.to_diff_dict(),
        "target_share": target_share, "lengths": synthetic.length_summary(lengths),
        "settings": {k: v for k, v in settings.items() if k != "length"},
    }
    check_records.append(result)
    return result


def main(scale: str, on_cpu: bool, out_dir, sides: list[str] | None = None, seconds: float | None = None) -> int:
    import json

    from workflow_scripts.core.atomic_output import write_json

    seconds = seconds or float(os.environ.get("GPU_CHECK_PHASE_SECONDS") or 240) - 15  # 15 s: start-up and the summary
    started = time.perf_counter()
    result = measure(scale, on_cpu, seconds, sides)
    result["seconds"] = time.perf_counter() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "gpu_benchmark_7b.json", json.loads(json.dumps(result, default=str)))
    print(json.dumps(result["goals"], indent=1, default=str))
    return 0 if result["status"] == "measured" else 1
