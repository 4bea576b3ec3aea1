"""GPU benchmark at the seeds' size (issues 28, 45): LoRA bf16 training of the Qwen2.5-7B architecture, ours
side by side with the set-ups a user would pick instead, in ONE process on the same rows in the same order.

    python -m benchmarks.bench_gpu --scale 7b --out-dir OUT              # the GPU check's phase benchmark_7b
    python -m benchmarks.bench_gpu --scale 7b-tiny --cpu --out-dir OUT   # the harness on CPU (tests)

A measurement that cannot mislead (issue 45's audit of the first H200 figures):

* **Tokens counted where the model sees them**: a forward pre-hook on the decoder (``TokenCounter``) counts
  the non-padding tokens of every forward, and each step's count is what ran between two step ends. Trainer
  fetches a step's micro-batches before ``on_step_begin`` and accelerate's ``DataLoaderShard`` reads one batch
  ahead, so a count taken in the collator runs ahead of training (it under-counted the Trainer sides 1.30x).
  Trainer's own ``num_input_tokens_seen`` (``include_num_input_tokens_seen="non_padding"``) is recorded beside.
* **The same rows in the same order** for every side: step k trains rows[k x E : (k+1) x E] (E the effective
  batch); the Trainer sides take a ``SequentialSampler`` (``_get_train_sampler``), not Trainer's random one.
* **A shape pass before timing**: every micro-batch shape of the run once, forward and backward, so no
  compile (FlexAttention's, compiled layers', Triton autotuning) falls in a timed step; each step records the
  Dynamo graphs compiled during it (``torch._dynamo.utils.counters``) and the compile seconds.
* **Repetitions interleaved** (A B C ..., A B C ..., A B C ...), per-step times (CUDA events on the GPU,
  ``perf_counter`` on CPU), medians with min-max; every run's raw record (its steps included) goes to
  $GPU_CHECK_REPORT and OUT/gpu_benchmark_7b.jsonl, the summary to OUT/gpu_benchmark_7b.json.

Sides (``SIDES``): ours A (today's switches: FlexAttention, fused cross-entropy, Liger; full activation
recompute; each micro-batch of 8 packed; collation inline), B (A without recompute, where the memory estimate
says the activations fit; else only the fewest first layers that make it fit recompute), C (B + full rows: each micro-batch one padding-free row filled to a token budget,
``micro_batch_tokens``, collated in DataLoader workers off the critical path), D (C + compiled decoder layers + one
GEMM for the LoRA A matrices of q/k/v and of gate/up, ``model/fused_lora.py``; its share of D over C is measured
by running ``D_unfused`` by name: it did not fit the plan's 8 minutes as a default side);
TRL ``SFTTrainer`` + PEFT with ``padding_free=True`` and ``use_liger_kernel=True`` (the strongest peer set-up;
skipped with the reason where trl is not installed); HF Trainer + PEFT at its defaults (each micro-batch padded
to its longest row); Trainer + Liger when time is left; then a profile table of the best side of ours.
FlexAttention and Liger are CUDA-only: on CPU (the harness) a side runs without them and its record says so;
compiled layers then use Dynamo's ``eager`` backend (real graphs and guards, no Inductor code generation).

* Model: Qwen2.5-7B's published config.json (below), random weights created directly on the GPU in
  bf16 (meta device, ``to_empty`` on CUDA, initialised there): nothing downloaded, nothing written to disk.
  Built once; each side adds its adapters and removes them (``unload``). LoRA r = 16 on every linear layer.
* Data: a long-tailed length mix (log-normal, 64..4096 tokens, median 600), a prompt share masked.
* MFU = tokens/s x LoRA-adjusted model FLOPs per token / 989 TFLOP/s (dense bf16 of the H100 SXM and the
  H200). Model FLOPs as NeMo counts them for LoRA: frozen weights forward and input-gradient matmuls only
  (4 x params), adapters 6 x params, attention 12 x layers x hidden x context (per document), the LM head at
  target positions only. NeMo's own convention (head at every position, attention causal-halved) gives about
  0.93x of ours on its run (docs: 42.8 % there is 45.9 % here).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks import check_records, synthetic

NAME = "gpu_lora_7b"
TITLE = "GPU: LoRA bf16 training of the Qwen2.5-7B architecture, ours (A-D) vs TRL padding-free + Liger and Trainer"

# Qwen/Qwen2.5-7B config.json (published values).
QWEN25_7B = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEAK_BF16_TFLOPS = 989.0  # H100 SXM and H200: one compute die, the same dense bf16 peak
NEMO = {"tokens_per_second": 14110, "mfu_own_convention": 0.428, "mfu_our_convention": 0.459,
        "what": "NeMo AutoModel, Qwen2.5-7B LoRA r16, one H100, 4,096-token rows, no recompute"}
GOALS = {"mfu": 0.40, "vs_strongest_peer": 1.3, "estimate_over_peak": (1.0, 1.3)}
SCALES = {
    # row_tokens: the token budget of one full row (sides C, D); width_multiple: one-row widths rounded up to
    # FlexAttention's 128-token blocks (fewer shapes to compile, padding < 128 tokens per micro-batch).
    "7b": {"max_length": 4096, "micro_batch": 8, "effective_batch": 16, "warmup_steps": 1, "timed_steps": 3,
           "repetitions": 3, "row_tokens": 16384, "workers": 2, "width_multiple": 128, "rank": 16,
           "length": {"low": 64, "high": 4096, "median": 600, "sigma": 1.0}},
    "7b-tiny": {"max_length": 128, "micro_batch": 4, "effective_batch": 8, "warmup_steps": 1, "timed_steps": 2,
                "repetitions": 3, "row_tokens": 256, "workers": 1, "width_multiple": 8, "rank": 4,
                "length": {"low": 8, "high": 128, "median": 24, "sigma": 1.0}},
}
FAST = {"flex_attention": True, "fused_cross_entropy": True, "liger_kernels": True}
CUDA_ONLY = ("flex_attention", "fused_cross_entropy", "liger_kernels", "use_liger_kernel")


@dataclass(frozen=True)
class Side:
    name: str
    kind: str                   # ours | trainer | trl
    switches: dict = field(default_factory=dict)  # ours: training/kernels.py's; Trainer, TRL: use_liger_kernel
    recompute: bool = True      # full activation recompute (gradient checkpointing)
    full_rows: bool = False     # ours: one padding-free row per micro-batch, filled to row_tokens
    workers: bool = False       # ours: collation in DataLoader workers
    fused_lora_a: bool = False  # ours: one GEMM for the A matrices of projections sharing an input (fused_lora)
    expected: float = 20.0      # seconds of one run on one H200 at 7b scale (estimate; runs record theirs)
    what: str = ""


# Expected seconds per run on one H200 (estimates from the first H200 run's rates, corrected: ours about 7,000
# tokens/s, Trainer about 2,400; a step holds about 14,000 tokens; a shape pass costs about one more pass where
# every micro-batch has its own shape, plus compiling; the runs record side_seconds to correct them by).
SIDES = [
    Side("A", "ours", FAST, expected=16, what="today's switches (flex, fused CE, Liger), full recompute, "
         "micro-batches of 8 packed, collation inline"),
    Side("B", "ours", FAST, recompute=False, expected=14, what="A without recompute where the estimate fits (else "
         "only as many layers as it needs recompute)"),
    Side("C", "ours", FAST, recompute=False, full_rows=True, workers=True, expected=12,
         what="B + full padding-free rows of row_tokens, collation in DataLoader workers"),
    Side("D", "ours", {**FAST, "compile_layers": True}, recompute=False, full_rows=True, workers=True,
         fused_lora_a=True, expected=20, what="C + compiled decoder layers + one GEMM for the LoRA A matrices of "
         "q/k/v and of gate/up"),
    Side("trl", "trl", {"use_liger_kernel": True}, expected=18,
         what="TRL SFTTrainer + PEFT, padding_free=True, use_liger_kernel=True, FlexAttention"),
    Side("trainer", "trainer", {"use_liger_kernel": False}, expected=40,
         what="HF Trainer + PEFT defaults (padded to the longest row), gradient checkpointing"),
    Side("trainer_liger", "trainer", {"use_liger_kernel": True}, expected=35,
         what="Trainer + PEFT + use_liger_kernel=True"),
    Side("D_unfused", "ours", {**FAST, "compile_layers": True}, recompute=False, full_rows=True, workers=True,
         expected=20, what="D without the fused LoRA A GEMM (PEFT's one A GEMM per projection)"),
]
DEFAULT_SIDES = ["A", "B", "C", "D", "trl", "trainer"]  # trainer_liger, D_unfused run by name (--sides)
PROFILE_SECONDS = 20  # the best side once more, one micro-step under the profiler


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
        ids = rng.integers(3, vocab, size=n).tolist()  # never the pad id: TokenCounter counts ids != pad
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


def training_settings(settings: dict, side: Side, switches: dict, on_gpu: bool, recompute: bool,
                      slots: int | None = None):
    """The side's settings; ``slots``: the most token slots one of its micro-batches holds, given to the memory
    estimate as ``micro_batch_tokens`` (full rows: the budget itself), so that it counts what a packed
    micro-batch really holds and not micro_batch x max_length (2.78x over on the first H200 run)."""
    from workflow_scripts.core.settings import TrainingSettings

    steps = settings["warmup_steps"] + settings["timed_steps"]
    rank = settings["rank"]
    budget = settings["row_tokens"] if side.full_rows else slots
    return TrainingSettings.parse({
        "lora": {"rank": rank, "alpha": 2 * rank, "dropout": 0.0, "target_modules": ALL_LINEAR},
        "max_length": settings["max_length"], "effective_batch": settings["effective_batch"],
        "micro_batch": settings["micro_batch"], "max_steps": steps, "warmup_steps": 0,
        **({"micro_batch_tokens": max(budget, settings["max_length"])} if budget else {}),
        "precision": "bf16" if on_gpu else "fp32", "gradient_checkpointing": recompute, "packing": True,
        "gpus": 1 if on_gpu else 0, "dataloader_workers": settings["workers"] if side.workers else 0, **switches})


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def dynamo_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (0 where torch lacks the counter)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # a private API: a torch without it reports no graphs rather than failing
        return 0


class TokenCounter:
    """A forward pre-hook on the decoder: each forward's non-padding tokens and slots, where the model sees
    them (the synthetic rows never hold the pad id, so a pad id is padding). Every side's decoder is called
    once per micro-batch (gradient checkpointing recomputes layers, not the decoder's forward)."""

    def __init__(self, decoder, pad_id: int):
        self.pad_id, self.forwards, self.active = pad_id, [], True
        self.handle = decoder.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else (args[0] if args else None)
        if self.active and ids is not None:
            self.forwards.append((int((ids != self.pad_id).sum()), int(ids.numel())))

    def remove(self):
        self.handle.remove()


class StepClock:
    """Step ends marked after each optimizer step: per-step seconds from CUDA events (the GPU's own timeline,
    no synchronisation per step) or perf_counter on CPU, with the tokens the decoder saw, the Dynamo graphs
    and the compile seconds of each step."""

    def __init__(self, device, counter: TokenCounter):
        from workflow_scripts.training import kernels

        self.device, self.counter, self.kernels = device, counter, kernels
        self.marks = []
        self.mark()

    def mark(self):
        import torch

        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append({"host": time.perf_counter(), "event": event, "forwards": len(self.counter.forwards),
                           "graphs": dynamo_graphs(), "compile": self.kernels.compile_seconds()})

    def steps(self, warmup: int) -> list[dict]:
        _sync(self.device)
        out = []
        for k, (a, b) in enumerate(zip(self.marks, self.marks[1:])):
            seconds = (a["event"].elapsed_time(b["event"]) / 1000 if a["event"] is not None
                       else b["host"] - a["host"])
            seen = self.counter.forwards[a["forwards"]:b["forwards"]]
            out.append({"step": k, "timed": k >= warmup, "seconds": seconds, "micro_batches": len(seen),
                        "tokens": sum(r for r, _ in seen), "slots": sum(t for _, t in seen),
                        "new_graphs": b["graphs"] - a["graphs"], "compile_seconds": b["compile"] - a["compile"]})
        return out


def summarise_steps(steps: list[dict]) -> dict:
    timed = [s for s in steps if s["timed"]]
    seconds, tokens, slots = (sum(s[k] for s in timed) for k in ("seconds", "tokens", "slots"))
    return {"tokens_per_second": tokens / max(seconds, 1e-9), "timed_seconds": seconds, "timed_tokens": tokens,
            "padding_share": 1 - tokens / max(1, slots), "timed_steps": len(timed),
            "new_graphs_in_timed_steps": sum(s["new_graphs"] for s in timed),
            "compile_seconds_in_timed_steps": sum(s["compile_seconds"] for s in timed),
            "step_seconds": [s["seconds"] for s in timed]}


def step_rows(rows: list[dict], settings: dict) -> list[list[dict]]:
    """Step k's rows: rows[k x E : (k+1) x E], in file order, for every side."""
    e = settings["effective_batch"]
    return [rows[k * e:(k + 1) * e] for k in range(len(rows) // e)]


def ours_micro_batches(step: list[dict], settings: dict, full_rows: bool) -> list[list[dict]]:
    from workflow_scripts.data.packing import full_row_cuts

    if full_rows:
        return [step[a:b] for a, b in full_row_cuts([len(r["input_ids"]) for r in step], settings["row_tokens"])]
    m = settings["micro_batch"]
    return [step[k:k + m] for k in range(0, len(step), m)]


def micro_batch_slots(micro: list[dict], settings: dict, full_rows: bool) -> int:
    """Token slots (rows x width) the collator gives this micro-batch: one row rounded up to width_multiple,
    or the fewest-slots packing of data/packing.py."""
    from workflow_scripts.data.packing import pack

    lengths = [len(r["input_ids"]) for r in micro]
    if full_rows:
        return -(-sum(lengths) // settings["width_multiple"]) * settings["width_multiple"]
    bins = pack(lengths, settings["max_length"])
    return len(bins) * max(sum(lengths[i] for i in b) for b in bins)


def estimate_settings(settings: dict, side: Side, switches: dict, on_gpu: bool, recompute: bool, rows: list[dict]):
    """The settings the memory estimate sees for this side on these rows: its largest micro-batch's slots."""
    micro = [m for step in step_rows(rows, settings) for m in ours_micro_batches(step, settings, side.full_rows)]
    slots = max(micro_batch_slots(m, settings, side.full_rows) for m in micro)
    return training_settings(settings, side, switches, on_gpu, recompute, slots=slots)


def shape_pass(run_micro_step, batches) -> dict:
    """Every distinct micro-batch shape once, forward and backward (``run_micro_step(batch)`` does both and
    clears the gradients), so that whatever compiles per shape compiles here and not in a timed step."""
    from workflow_scripts.training import kernels

    seen, started, graphs, compiled = set(), time.perf_counter(), dynamo_graphs(), kernels.compile_seconds()
    for batch in batches:
        key = tuple(tuple(v.shape) for v in batch.values() if hasattr(v, "shape"))
        if key not in seen:
            seen.add(key)
            run_micro_step(batch)
    return {"shapes": len(seen), "seconds": time.perf_counter() - started, "new_graphs": dynamo_graphs() - graphs,
            "compile_seconds": kernels.compile_seconds() - compiled}


def cpu_adjusted(side: Side, on_cpu: bool) -> tuple[dict, list[str]]:
    """The side's switches as this device runs them: on CPU without the CUDA-only ones (named)."""
    if not on_cpu:
        return dict(side.switches), []
    dropped = [k for k in CUDA_ONLY if side.switches.get(k)]
    return {k: v for k, v in side.switches.items() if k not in dropped}, dropped


def layers_to_recompute(peft_model, estimated, device) -> tuple[int | None, str]:
    """How many decoder layers must recompute for the gate's estimate to fit 90 % of the device: 0 (none),
    some (partial checkpointing), or None (even full recompute does not fit: kept full, the run says so)."""
    from workflow_scripts.model import memory_estimate

    if device.type != "cuda":
        return 0, "CPU: no device memory limit"
    capacity = int(0.9 * memory_estimate.device_capacity(device))
    count = memory_estimate.layers_to_checkpoint(peft_model, estimated, device, capacity)
    return count, (f"the estimate fits {capacity / 2**30:.0f} GiB with {count} layers recomputed" if count is not None
                   else f"the estimate exceeds {capacity / 2**30:.0f} GiB even with full recompute")


def _plain_base(base):
    """The shared base as the next side expects it: no gradient checkpointing, no input-gradient hook."""
    if getattr(base, "is_gradient_checkpointing", False):
        base.gradient_checkpointing_disable()
    with contextlib.suppress(Exception):
        base.disable_input_require_grads()


def run_ours(base, rows, settings, side: Side, device, compile_backend: str | None = None,
             profile: bool = False) -> dict:
    """Our loop's parts on the shared base model; the adapters are removed again at the end."""
    import torch

    from workflow_scripts.data.packing import PackingCollator
    from workflow_scripts.model import fused_lora, memory_estimate, model_loading
    from workflow_scripts.tasks.generation import TargetTokenLoss
    from workflow_scripts.training import kernels, training_setup

    on_gpu = device.type == "cuda"
    switches, dropped = cpu_adjusted(side, not on_gpu)
    training = training_settings(settings, side, switches, on_gpu, recompute=side.recompute)
    estimated = estimate_settings(settings, side, switches, on_gpu, side.recompute, rows)
    _plain_base(base)
    base.set_attn_implementation(kernels.attn_implementation(training) or "sdpa")
    kernels.apply_before_lora(base, training, device)
    _reset_peak(device)
    layers = base.config.num_hidden_layers
    recomputed, recompute_reason = (layers, "full recompute (today's default)") if side.recompute else (0, "")
    peft_model = model_loading.add_lora(base, training.lora, gradient_checkpointing=False)
    if not side.recompute:
        recomputed, recompute_reason = layers_to_recompute(peft_model, estimated, device)
        recomputed = layers if recomputed is None else recomputed
    if recomputed:  # full, or partial: only the first layers recompute (model_loading.checkpoint_first_layers)
        training = training_settings(settings, side, switches, on_gpu, recompute=True)
        estimated = estimate_settings(settings, side, switches, on_gpu, True, rows)
        model_loading.enable_gradient_checkpointing(base, input_gradients=True)
        model_loading.checkpoint_first_layers(base, recomputed)
    peft_model.train()
    counter = TokenCounter(base.get_decoder(), synthetic.PAD_ID)
    loader = None
    try:
        # before compiling, so that the compiled layers trace the fused forward; require: a skipped group is a
        # failed side (its record says which and why), not a D silently measured without the switch
        fused = fused_lora.fuse_lora_a(peft_model, require=True).fused if side.fused_lora_a else []
        kernels.apply_after_lora(peft_model, training, backend=compile_backend)
        loss_module = TargetTokenLoss(peft_model)
        loss_module.fused_cross_entropy = kernels.fused_cross_entropy(peft_model, training, device)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer, _ = training_setup.build_optimizer_and_scheduler(trainable, training, device)
        collator = PackingCollator(synthetic.PAD_ID, base.config.vocab_size, training.max_length,
                                   base.config._attn_implementation, one_row=side.full_rows,
                                   width_multiple=settings["width_multiple"] if side.full_rows else 1)
        estimate = memory_estimate.estimate(peft_model, estimated, device, checkpointed_layers=recomputed or None)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext()
        steps = step_rows(rows, settings)
        plan = [ours_micro_batches(step, settings, side.full_rows) for step in steps]
        targets = [sum(sum(t != -100 for t in r["labels"][1:]) for r in step) for step in steps]

        def micro_step(batch, scale=1.0):
            batch = training_setup.to_device(batch, device)
            with autocast, kernels.offloading(training, device):
                loss = loss_module(batch)
            (loss / scale).backward()

        def shape_step(batch):
            micro_step(batch)
            peft_model.zero_grad(set_to_none=True)

        flat = [m for micro in plan for m in micro]
        index = {id(r): k for k, r in enumerate(rows)}

        def batches_of(micro_batches):
            if side.workers:  # collation in worker processes, prefetched while the GPU trains
                return iter(torch.utils.data.DataLoader(
                    rows, batch_sampler=[[index[id(r)] for r in m] for m in micro_batches], collate_fn=collator,
                    num_workers=training.dataloader_workers, pin_memory=on_gpu, prefetch_factor=4))
            return (collator(m) for m in micro_batches)

        # The shape pass takes its batches from the same source as the timed steps: a batch from a worker
        # (shared memory) fails guards that an in-process one passed (seen on CPU: Dynamo recompiled in step 1).
        counter.active = False
        shapes = shape_pass(shape_step, batches_of(flat))
        counter.active = True
        _sync(device)
        batches = batches_of(flat)
        clock = StepClock(device, counter)
        for micro, target in zip(plan, targets):
            for _ in micro:
                micro_step(next(batches), target)
            torch.nn.utils.clip_grad_norm_(trainable, training.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.mark()
        step_records = clock.steps(settings["warmup_steps"])
        result = summarise_steps(step_records)
        result.update(steps=step_records, shape_pass=shapes, estimated_bytes=estimate["total"],
                      estimated_slots=estimated.micro_batch_tokens,
                      estimate=estimate, switches=kernels.switches(training), cpu_without=dropped,
                      recomputed_layers=recomputed, recompute_reason=recompute_reason, full_rows=side.full_rows,
                      collation="DataLoader workers" if side.workers else "inline", fused_lora_a_groups=len(fused),
                      compile_backend=compile_backend if training.compile_layers else None,
                      attention=str(base.config._attn_implementation))
        if on_gpu:
            result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        if profile:
            result["profile"] = profile_step(micro_step, collator(flat[0]), device)
            peft_model.zero_grad(set_to_none=True)
        return result
    finally:
        counter.remove()
        del loader
        fused_lora.unfuse_lora_a(peft_model)
        base_again = peft_model.get_base_model()
        for layer in base_again.model.layers:
            layer._compiled_call_impl = None  # undo compile_layers for the next side
        peft_model.unload()
        del peft_model
        _plain_base(base)
        _reset_peak(device)


def profile_step(micro_step, batch, device) -> str:
    """The top kernels of one micro-step (forward + backward): where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        micro_step(batch)
        _sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60)


def tiny_tokenizer():
    """A tokenizer holding the pad and eos ids (TRL asks for one; the rows are token ids already)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": synthetic.PAD_ID, "<eos>": synthetic.EOS_ID, "<unk>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as error:
        return (f"trl is not importable ({error}): pip install trl (benchmarks/gpu_requirements.txt pins it; "
                "make gpu-wheels fetches it)")
    return None


def run_trainer(base, rows, settings, side: Side, device, micro_batch: int | None = None) -> dict:
    """HF Trainer + PEFT (``side.kind == 'trainer'``: each micro-batch padded to its longest row) or TRL's
    SFTTrainer + PEFT with ``padding_free=True`` (``'trl'``: each micro-batch one row, no padding), bf16, the
    optimizer Trainer picks, gradient checkpointing on (Trainer at 8 x 4096 padded tokens needs it), rows in
    file order (a SequentialSampler), optionally ``use_liger_kernel=True``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    on_gpu = device.type == "cuda"
    switches, dropped = cpu_adjusted(side, not on_gpu)
    use_liger = bool(switches.get("use_liger_kernel"))
    micro = micro_batch or settings["micro_batch"]
    rank = settings["rank"]
    _plain_base(base)
    # TRL's padding-free rows: transformers finds the documents from the restarting position_ids (no mask) and
    # FlexAttention skips the blocks between them, as ours; on CPU sdpa with the same derived block mask.
    attention = "flex_attention" if side.kind == "trl" and on_gpu else "sdpa"
    base.set_attn_implementation(attention)
    _reset_peak(device)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=ALL_LINEAR,
                                            task_type="CAUSAL_LM"))
    counter = TokenCounter(base.get_decoder(), synthetic.PAD_ID)
    clocks = []

    class StepEnds(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            counter.active = True
            clocks.append(StepClock(device, counter))

        def on_step_end(self, args, state, control, **kwargs):
            clocks[0].mark()

    def pad(batch):  # Trainer's default collator's padding, with labels padded by -100
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((len(batch), width), synthetic.PAD_ID)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for k, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[k, :n], labels[k, :n], mask[k, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    data = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]
    steps = settings["warmup_steps"] + settings["timed_steps"]
    common = dict(per_device_train_batch_size=micro, gradient_accumulation_steps=settings["effective_batch"] // micro,
                  max_steps=steps, learning_rate=2e-4, save_strategy="no", report_to="none", bf16=on_gpu,
                  use_cpu=not on_gpu, gradient_checkpointing=True, use_liger_kernel=use_liger,
                  dataloader_num_workers=0, disable_tqdm=True, logging_steps=steps, seed=0,
                  include_num_input_tokens_seen="non_padding")

    def sequential(cls):  # the same rows in the same order as ours, not Trainer's random sampler
        return type(f"Sequential{cls.__name__}", (cls,), {
            "_get_train_sampler": lambda self, *a, **k: torch.utils.data.SequentialSampler(self.train_dataset)})

    with tempfile.TemporaryDirectory(prefix="bench-7b-trainer-") as out:
        if side.kind == "trl":
            from datasets import Dataset
            from trl import SFTConfig, SFTTrainer

            arguments = SFTConfig(output_dir=out, padding_free=True, max_length=None,
                                  dataset_kwargs={"skip_prepare_dataset": True}, **common)
            trainer = sequential(SFTTrainer)(model=model, args=arguments, train_dataset=Dataset.from_list(data),
                                             processing_class=tiny_tokenizer(), callbacks=[StepEnds()])
        else:
            arguments = TrainingArguments(output_dir=out, remove_unused_columns=False, **common)
            trainer = sequential(Trainer)(model=model, args=arguments, train_dataset=data, data_collator=pad,
                                          callbacks=[StepEnds()])
        try:
            counter.active = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=arguments.gradient_checkpointing_kwargs)
            model.train()

            def shape_step(batch):
                with trainer.compute_loss_context_manager():
                    loss = trainer.compute_loss(model, trainer._prepare_inputs(batch))
                loss.backward()
                model.zero_grad(set_to_none=True)

            shapes = shape_pass(shape_step, list(trainer.get_train_dataloader()))
            trainer.train()
            step_records = clocks[0].steps(settings["warmup_steps"])
            result = summarise_steps(step_records)
            result.update(steps=step_records, shape_pass=shapes, use_liger_kernel=use_liger, cpu_without=dropped,
                          optimizer=str(getattr(arguments.optim, "value", arguments.optim)), attention=attention,
                          trainer_tokens_seen=int(trainer.state.num_input_tokens_seen),
                          counted_tokens=sum(s["tokens"] for s in step_records),
                          padding_free=side.kind == "trl", micro_batch=micro)
            if on_gpu:
                result["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
            return result
        finally:
            counter.remove()
            del trainer
            model.unload()
            _plain_base(base)
            _reset_peak(device)


def trainer_that_fits(base, rows, settings, side: Side, device, deadline: float, log=print) -> dict:
    """Trainer + PEFT at the largest micro-batch that fits, the effective batch kept: at its defaults its
    loss materialises the logits of every padded position in fp32 (8 x 4096 x 152,064 x 4 B = 20 GB, twice
    with log-softmax), which can exceed an 80 GB H100 at micro-batch 8; a user would halve it, so the side
    halves it on CUDA's out-of-memory error (while the phase's time lasts) and records what it used."""
    import gc

    import torch

    micro, refused = settings["micro_batch"], []
    while True:
        try:
            result = run_trainer(base, rows, settings, side, device, micro_batch=micro)
            break
        except torch.cuda.OutOfMemoryError:
            if micro == 1 or time.monotonic() > deadline:
                raise
            refused.append(micro)
        gc.collect()  # the failed attempt's tensors, held by its frames until here
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"  7b {side.name}: out of memory at micro-batch {micro}; trying {micro // 2}")
        micro //= 2
    result.update(micro_batch=micro, out_of_memory_at_micro_batch=refused)
    return result


def skip_reason(side: Side, on_cpu: bool, left: float) -> str | None:
    if side.kind == "trl" and trl_missing():
        return trl_missing()
    if on_cpu and side.kind == "trainer" and side.switches.get("use_liger_kernel"):
        return "needs CUDA (Liger's Triton kernels): on CPU it would be the Trainer defaults side again"
    if not on_cpu and side.expected > left:
        return (f"would not fit: about {side.expected:.0f} s expected, {left:.0f} s left "
                "(python -m benchmarks.gpu_check --only benchmark_7b --minutes N gives it more)")
    return None


def run_side(base, rows, settings, side: Side, device, deadline: float, log, profile: bool = False) -> dict:
    import torch

    from benchmarks import bench_gpu_7b  # through the module, so that tests can replace a side's runner

    # Every run compiles afresh in its shape pass: a side's new adapters fail the guards of the last run's
    # graphs, and three repetitions' recompiles would reach Dynamo's recompile limit (8), past which it runs
    # the layers uncompiled without a word.
    torch._dynamo.reset()

    with liger_undone(base):  # Liger patches the shared model's instance: undone for the next side
        if side.kind == "ours":
            return bench_gpu_7b.run_ours(base, rows, settings, side, device,
                                         compile_backend="eager" if device.type != "cuda" else None, profile=profile)
        if side.kind == "trainer":
            return bench_gpu_7b.trainer_that_fits(base, rows, settings, side, device, deadline, log)
        return bench_gpu_7b.run_trainer(base, rows, settings, side, device)


def measure(scale: str, on_cpu: bool, seconds: float, sides: list[str] | None = None, log=print,
            repetitions: int | None = None) -> tuple[dict, list[dict]]:
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
    common = {"check": NAME, "device": device_name, "scale": scale}
    check_records.append({**common, "side": "setup", "status": "built", "build_seconds": build_seconds,
                          "matmul_ceiling_tflops": ceiling, "lengths": synthetic.length_summary(lengths)})
    log(f"  7b: model built in {build_seconds:.1f} s on {device_name}; matmul ceiling {ceiling} TFLOP/s")
    chosen = [s for s in SIDES if s.name in (sides or DEFAULT_SIDES)]
    per_token = flops_per_token(config, lengths, target_share, settings["rank"])
    raw: list[dict] = []
    for repetition in range(1, (repetitions or settings["repetitions"]) + 1):  # interleaved: A B C.., A B C..
        for side in chosen:
            record = {**common, "side": side.name, "repetition": repetition, "kind": side.kind, "what": side.what}
            reason = skip_reason(side, on_cpu, deadline - time.monotonic())
            if reason:
                record.update(status="skipped", reason=reason)
                check_records.append(record)
                raw.append(record)
                log(f"  7b {side.name} #{repetition}: skipped ({reason})")
                continue
            started = time.perf_counter()
            try:
                result = run_side(base, rows, settings, side, device, deadline, log)
            except Exception as error:
                record.update(status="failed", error=f"{type(error).__name__}: {error}"[-2000:])
                check_records.append(record)
                raw.append(record)
                log(f"  7b {side.name} #{repetition}: failed: {type(error).__name__}: {str(error)[:300]}")
                continue
            result.pop("estimate", None)
            result["mfu"] = result["tokens_per_second"] * per_token / (PEAK_BF16_TFLOPS * 1e12) if not on_cpu else None
            result["mfu_of_matmul_ceiling"] = (result["tokens_per_second"] * per_token / (ceiling * 1e12)
                                               if ceiling else None)
            result["side_seconds"] = time.perf_counter() - started
            record.update(status="measured", model_flops_per_token=per_token, **result)
            check_records.append(record)
            raw.append(record)
            log(f"  7b {side.name} #{repetition}: {result['tokens_per_second']:.0f} tokens/s, padding "
                f"{result['padding_share']:.1%}, graphs in timed steps {result['new_graphs_in_timed_steps']}, "
                f"{result['side_seconds']:.0f} s")
    summary = summarise(raw, settings, device_name, ceiling, config, lengths, target_share, common)
    best = next((s for s in SIDES if s.name == summary["best_ours"]), None)
    if best is not None and (on_cpu or deadline - time.monotonic() > PROFILE_SECONDS):
        try:
            summary["profile_side"] = best.name
            summary["profile"] = run_side(base, rows, settings, best, device, deadline, log, profile=True)["profile"]
        except Exception as error:
            summary["profile"] = f"profile failed: {type(error).__name__}: {error}"[:2000]
    elif best is not None:
        summary["profile"] = f"not run: fewer than {PROFILE_SECONDS} s of the phase left"
    check_records.append(summary)
    return summary, raw


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(raw, settings, device_name, ceiling, config, lengths, target_share, common) -> dict:
    """Medians (min-max) per side, the ratios and goals from whatever was measured; a goal whose sides are
    missing says so."""
    sides = {}
    for side in SIDES:
        runs = [r for r in raw if r["side"] == side.name and r.get("status") == "measured"]
        if not runs:
            continue
        sides[side.name] = {
            "kind": side.kind, "what": side.what, "tokens_per_second": spread([r["tokens_per_second"] for r in runs]),
            "padding_share": statistics.median(r["padding_share"] for r in runs),
            "new_graphs_in_timed_steps": sum(r["new_graphs_in_timed_steps"] for r in runs),
            "mfu": statistics.median(r["mfu"] for r in runs) if runs[0].get("mfu") is not None else None,
            "estimate_over_peak": (statistics.median(r["estimated_bytes"] / r["peak_memory_bytes"] for r in runs)
                                   if runs[0].get("estimated_bytes") and runs[0].get("peak_memory_bytes") else None)}
    ours = {k: v for k, v in sides.items() if v["kind"] == "ours"}
    best = max(ours, key=lambda k: ours[k]["tokens_per_second"]["median"], default=None)

    def ratio(other):
        if best is None or other not in sides:
            return None
        return sides[best]["tokens_per_second"]["median"] / sides[other]["tokens_per_second"]["median"]

    goals = {
        f"MFU of {best} >= {GOALS['mfu']:.0%}": (sides[best]["mfu"] if best else None, GOALS["mfu"]),
        f"{best} / TRL padding-free + Liger >= {GOALS['vs_strongest_peer']}x": (ratio("trl"), GOALS["vs_strongest_peer"]),
    }
    ratios = {f"{best} / {other}": ratio(other) for other in ("trl", "trainer", "trainer_liger")
              if ratio(other) is not None}
    if {"D", "D_unfused"} <= sides.keys():  # the fused LoRA A GEMM's share of D (D_unfused runs by name)
        ratios["D / D_unfused"] = (sides["D"]["tokens_per_second"]["median"]
                                   / sides["D_unfused"]["tokens_per_second"]["median"])
    return {
        **common, "side": "summary", "status": "measured" if sides else "nothing measured", "best_ours": best,
        "sides": sides, "ratios": ratios,
        "goals": {name: {"value": value, "goal": goal, "met": None if value is None else value >= goal}
                  for name, (value, goal) in goals.items()},
        "estimate_goal": GOALS["estimate_over_peak"], "nemo": NEMO,
        "peak_tflops": PEAK_BF16_TFLOPS, "matmul_ceiling_tflops": ceiling, "model_config": config.to_diff_dict(),
        "target_share": target_share, "lengths": synthetic.length_summary(lengths),
        "settings": {k: v for k, v in settings.items() if k != "length"},
    }


def main(scale: str, on_cpu: bool, out_dir, sides: list[str] | None = None, seconds: float | None = None,
         repetitions: int | None = None) -> int:
    import json

    from workflow_scripts.core.atomic_output import atomic_path, write_json

    seconds = seconds or float(os.environ.get("GPU_CHECK_PHASE_SECONDS") or 420) - 40  # start-up, build, summary
    started = time.perf_counter()
    result, raw = measure(scale, on_cpu, seconds, sides, repetitions=repetitions)
    result["seconds"] = time.perf_counter() - started
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "gpu_benchmark_7b.json", json.loads(json.dumps(result, default=str)))
    with atomic_path(out_dir / "gpu_benchmark_7b.jsonl") as path:  # every run's raw record, its steps included
        path.write_text("".join(json.dumps(r, default=str) + "\n" for r in raw))
    print(json.dumps(result["goals"], indent=1, default=str))
    return 0 if result["status"] == "measured" else 1
