"""Benchmark 5 (GPU only): tokens/s and model FLOPs utilisation of LoRA bf16 training on a 0.5B-class
model, ours against HF Trainer + PEFT in the same run. Skipped, with the reason, where no GPU is visible.

The model is Qwen2.5-0.5B's published architecture (values below, from its config.json) with random
weights: nothing is downloaded. Both sides run on the same data (a long-tailed length mix), effective
batch, LoRA settings and bf16, through the same harness as the CPU training benchmark
(benchmarks/bench_training.py): ours is the train stage launched as its rule launches it.

MFU = achieved model FLOP/s / the GPU's dense bf16 peak. Model FLOPs per non-padding token (PaLM's
convention, attention not halved for the causal mask; padding and recomputation are not model work):
  frozen matmuls 4 x params (forward + input gradients; frozen weights get no weight gradients),
  LoRA matmuls 6 x params, attention 12 x layers x hidden x sequence length,
  LM head only at target positions (ours computes it there alone; the loss needs no more).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from benchmarks import bench_training, synthetic
from benchmarks.records import Goal, Series, not_run, record

NAME = "gpu_lora_bf16"
MIN_SECONDS = 0  # a minimal run at full scale on 2 quiet cores, for run.py's time planning
TITLE = "GPU: LoRA bf16 training of a 0.5B-class model, tokens/s and MFU, ours vs Trainer + PEFT"

# Qwen/Qwen2.5-0.5B config.json (published values), written here so nothing is downloaded.
QWEN25_05B = {
    "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
}
# Dense bf16 peak, TFLOP/s. H100: the figure issue 6 sets (about 790); others from vendor sheets.
PEAK_TFLOPS = {"H100": 790.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
SCALES = {
    "full": {"epoch_steps": 30, "steps": 60, "repetitions": 3, "effective_batch": 32, "micro_batch": 8, "precision": "bf16", "gpus": 1,
             "dataloader_workers": 2, "length": {"low": 32, "high": 1024, "median": 200, "sigma": 0.8}},
    "tiny": {"epoch_steps": 2, "steps": 4, "repetitions": 1, "effective_batch": 4, "micro_batch": 2, "precision": "bf16", "gpus": 1,
             "dataloader_workers": 0, "length": {"low": 16, "high": 64, "median": 24, "sigma": 0.6}},
}
GOAL_MFU = 0.45


def peak_flops(device_name: str) -> float | None:
    for key, tflops in PEAK_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


def lora_params(config) -> int:
    """Parameters of rank-r adapters on every attention and MLP projection."""
    rank = bench_training.LORA["rank"]
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = [(config.hidden_size, config.hidden_size), (config.hidden_size, kv), (config.hidden_size, kv),
              (config.hidden_size, config.hidden_size), (config.hidden_size, config.intermediate_size),
              (config.hidden_size, config.intermediate_size), (config.intermediate_size, config.hidden_size)]
    return config.num_hidden_layers * sum(rank * (i + o) for i, o in shapes)


def flops_per_token(config, lengths: np.ndarray, target_share: float) -> float:
    """Model FLOPs per non-padding token of LoRA training (see the module docstring)."""
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = (2 * config.hidden_size * config.hidden_size + 2 * config.hidden_size * kv
                 + 3 * config.hidden_size * config.intermediate_size)
    frozen = config.num_hidden_layers * per_layer
    head = config.hidden_size * config.vocab_size
    mean_context = float((lengths.astype(np.float64) ** 2).sum() / lengths.sum())
    attention = 12 * config.num_hidden_layers * config.hidden_size * mean_context
    return 4 * frozen + 4 * head * target_share + 6 * lora_params(config) + attention


def model_config(tiny: bool):
    from transformers import Qwen2Config

    values = dict(QWEN25_05B)
    if tiny:  # the same arithmetic on a model a CPU test can afford
        values.update(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    return Qwen2Config(**values, pad_token_id=synthetic.PAD_ID, eos_token_id=synthetic.EOS_ID, bos_token_id=None)


def measure(settings: dict, config, device_name: str, work: Path, log=print) -> dict:
    """Run ours and Trainer + PEFT on ``config``; return the record."""
    model_dir = synthetic.save_model_dir(config, work / "model")
    length = settings["length"]
    rows = settings["epoch_steps"] * settings["effective_batch"]  # two epochs; the second is timed
    lengths = synthetic.long_tailed_lengths(rows, length["low"], length["high"], length["median"], length["sigma"], seed=31)
    table = synthetic.tokenised_table(lengths, config.vocab_size, seed=32)
    data_dir = synthetic.save_tokenised(table, work / "data", config.vocab_size, length["high"], model_dir)
    labels = table.column("labels").combine_chunks().values.to_numpy()
    target_share = float((labels != -100).mean())
    per_token = flops_per_token(config, lengths, target_share)
    peak = peak_flops(device_name)

    runs: dict[str, list[dict]] = {"ours": [], "trainer": []}
    for repetition in range(settings["repetitions"]):
        runs["ours"].append(bench_training.run_ours(model_dir, data_dir, settings, repetition + 1, work))
        runs["trainer"].append(bench_training.run_trainer(model_dir, data_dir, settings, repetition + 1, False, work))
        for side in runs:
            log(f"  gpu {side} #{repetition + 1}: {runs[side][-1]['tokens_per_second']:.0f} tokens/s")

    def series(side: str, label: str) -> Series:
        results = runs[side]
        rates = [r["tokens_per_second"] for r in results]
        return Series(label, rates, "non-padding tokens/s", {
            "padding_share": [float(r["padding_share"]) for r in results],
            "mfu": [rate * per_token / peak for rate in rates] if peak else None,
            **{key: results[0][key] for key in ("optimizer", "attention", "torch_compile") if key in results[0]},
        })

    ours = series("ours", "ours: train stage (length-grouped), bf16 autocast")
    reference = series("trainer", "reference: HF Trainer + PEFT, defaults, bf16=True")
    ours_attention = attention_implementation(config)
    context = (f"measured context: ours {ours.median:.0f} tokens/s x {per_token / 1e9:.2f} GFLOP per token = "
               f"{ours.median * per_token / 1e12:.0f} TFLOP/s; padding ours {np.median(ours.details['padding_share']):.1%}, "
               f"Trainer {np.median(reference.details['padding_share']):.1%}; attention '{ours_attention}', fused AdamW, "
               "no torch.compile, no packing across sequences; a profile on the GPU would name the bottleneck")
    goals = [Goal("ours tokens/s / Trainer >= 1.0x (ahead of Trainer)", ours.median / reference.median, 1.0, True,
                  why=context)]
    if peak:
        goals.insert(0, Goal(f"ours MFU >= {GOAL_MFU:.0%} (peak {peak / 1e12:.0f} TFLOP/s dense bf16)",
                             ours.median * per_token / peak, GOAL_MFU, True, why=context))
    return record(
        NAME, TITLE, ours, reference, higher_is_better=True, goals=goals,
        setup={"device": device_name, "model": "Qwen2.5-0.5B architecture, random weights" if config.hidden_size == 896
               else "tiny Qwen2 (harness check)", "model_config": config.to_diff_dict(),
               "lora": bench_training.LORA, "effective_batch": settings["effective_batch"],
               "micro_batch": settings["micro_batch"], "steps": settings["steps"], "precision": settings["precision"],
               "lengths": synthetic.length_summary(lengths), "model_flops_per_token": per_token,
               "peak_flops": peak, "target_share": target_share,
               "kernels": {"ours": {"attention": ours_attention, "fused_adamw": settings["gpus"] > 0,
                                    "torch_compile": False},
                           "trainer": {"attention": runs["trainer"][0].get("attention"),
                                       "optimizer": runs["trainer"][0].get("optimizer"),
                                       "torch_compile": runs["trainer"][0].get("torch_compile")}}},
        notes=["MFU counts model FLOPs of non-padding tokens only (see bench_gpu.py's docstring for the formula).",
               "Ours: fused AdamW on CUDA (training_setup.build_optimizer_and_scheduler), attention as loaded by "
               "transformers' default implementation, no torch.compile."],
    )


def attention_implementation(config) -> str:
    """The attention kernel transformers picks for this config by default (what our loader gets)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return str(model.config._attn_implementation)


def run(scale: str = "full", work_dir: Path | None = None, log=print, deadline: float | None = None) -> dict:
    import torch

    if not torch.cuda.is_available():
        return not_run(NAME, TITLE, "skipped",
                       "no CUDA device visible (torch.cuda.is_available() is False); run `make bench` on a GPU "
                       "machine to measure it", setup={"model_config": QWEN25_05B, "goal_mfu": GOAL_MFU})
    settings = SCALES[scale]
    device_name = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=work_dir) as tmp:
        return measure(settings, model_config(tiny=scale == "tiny"), device_name, Path(tmp), log)
