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

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import bench_gpu_7b, bench_training, check_records, synthetic
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
# Dense bf16 peak, TFLOP/s, from vendor sheets. H100 SXM and H200 share one compute die: 989 for both
# (issue 28; about 790 is the large-matmul ceiling measured on them, bench_gpu_7b.matmul_ceiling, not a peak).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
LONG_TAIL = {"low": 32, "high": 1024, "median": 200, "sigma": 0.8}
SCALES = {
    "full": {"epoch_steps": 30, "steps": 60, "repetitions": 3, "effective_batch": 32, "micro_batch": 8, "precision": "bf16", "gpus": 1,
             "dataloader_workers": 2, "length": LONG_TAIL},
    # make gpu-check: one pair of runs that fits its time budget (benchmarks/gpu_check.py), workers on as at full size.
    "check": {"epoch_steps": 12, "steps": 24, "repetitions": 1, "effective_batch": 32, "micro_batch": 8, "precision": "bf16", "gpus": 1,
              "dataloader_workers": 2, "length": LONG_TAIL},
    # The harness in seconds; DataLoader workers on, as at the sizes that count (counts must cross processes).
    "tiny": {"epoch_steps": 2, "steps": 4, "repetitions": 1, "effective_batch": 4, "micro_batch": 2, "precision": "bf16", "gpus": 1,
             "dataloader_workers": 1, "length": {"low": 16, "high": 64, "median": 24, "sigma": 0.6}},
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
    failures: dict[str, str] = {}
    sides = {"ours": lambda seed: bench_training.run_ours(model_dir, data_dir, settings, seed, work),
             "trainer": lambda seed: bench_training.run_trainer(model_dir, data_dir, settings, seed, False, work)}
    for repetition in range(settings["repetitions"]):
        for side, run_side in sides.items():
            # Each side's figure is kept the moment it exists: a failing or killed other side loses none of it.
            base = {"check": NAME, "side": side, "repetition": repetition + 1, "device": device_name}
            try:
                result = run_side(repetition + 1)
            except Exception as error:
                failures.setdefault(side, f"{type(error).__name__}: {error}")
                log(f"  gpu {side} #{repetition + 1} failed: {failures[side][:300]}")
                check_records.append({**base, "status": "failed", "error": f"{type(error).__name__}: {error}"[-2000:]})
                continue
            runs[side].append(result)
            log(f"  gpu {side} #{repetition + 1}: {result['tokens_per_second']:.0f} tokens/s")
            check_records.append({**base, "status": "measured", **result,
                                  "mfu": result["tokens_per_second"] * per_token / peak if peak else None})
    if not runs["ours"]:
        raise RuntimeError("; ".join(f"{side}: {error}" for side, error in failures.items()))

    def series(side: str, label: str) -> Series:
        results = runs[side]
        rates = [r["tokens_per_second"] for r in results]
        return Series(label, rates, "non-padding tokens/s", {
            "padding_share": [float(r["padding_share"]) for r in results],
            "mfu": [rate * per_token / peak for rate in rates] if peak else None,
            **{key: results[0][key] for key in ("optimizer", "attention", "torch_compile") if key in results[0]},
        })

    ours = series("ours", "ours: train stage (length-grouped), bf16 autocast")
    reference = series("trainer", "reference: HF Trainer + PEFT, defaults, bf16=True") if runs["trainer"] else None
    ours_attention = attention_implementation(config)
    context = (f"measured context: ours {ours.median:.0f} tokens/s x {per_token / 1e9:.2f} GFLOP per token = "
               f"{ours.median * per_token / 1e12:.0f} TFLOP/s; padding ours {np.median(ours.details['padding_share']):.1%}, "
               + (f"Trainer {np.median(reference.details['padding_share']):.1%}" if reference else "Trainer not measured")
               + f"; attention '{ours_attention}', fused AdamW, "
               "no torch.compile, no packing across sequences; a profile on the GPU would name the bottleneck")
    goals = []
    if reference:
        goals.append(Goal("ours tokens/s / Trainer >= 1.0x (ahead of Trainer)", ours.median / reference.median, 1.0,
                          True, why=context))
    if peak:
        goals.insert(0, Goal(f"ours MFU >= {GOAL_MFU:.0%} (peak {peak / 1e12:.0f} TFLOP/s dense bf16)",
                             ours.median * per_token / peak, GOAL_MFU, True, why=context))
    failed_sides = "; ".join(f"{side} failed: {error}" for side, error in failures.items()) or None
    return record(
        NAME, TITLE, ours, reference, higher_is_better=True, goals=goals, message=failed_sides,
        setup={"device": device_name, "model": "Qwen2.5-0.5B architecture, random weights" if config.hidden_size == 896
               else "tiny Qwen2 (harness check)", "model_config": config.to_diff_dict(),
               "lora": bench_training.LORA, "effective_batch": settings["effective_batch"],
               "micro_batch": settings["micro_batch"], "steps": settings["steps"], "precision": settings["precision"],
               "lengths": synthetic.length_summary(lengths), "model_flops_per_token": per_token,
               "peak_flops": peak, "target_share": target_share,
               "kernels": {"ours": {"attention": ours_attention, "fused_adamw": settings["gpus"] > 0,
                                    "torch_compile": False},
                           "trainer": {key: runs["trainer"][0].get(key) for key in ("attention", "optimizer", "torch_compile")}
                           if runs["trainer"] else None},
               "dataloader_workers": settings["dataloader_workers"], "failures": failures},
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


def cpu_settings(scale: str) -> dict:
    """The harness on CPU (tests, ``make gpu-check`` without a GPU in its test mode): the same runs at a
    scale's sizes, fp32 on the CPU, DataLoader workers as the scale has them. Measures nothing about GPUs."""
    return {**SCALES[scale], "gpus": 0, "precision": "fp32", "torch_threads": 1}


def run(scale: str = "full", work_dir: Path | None = None, log=print, deadline: float | None = None,
        on_cpu: bool = False) -> dict:
    import torch

    if on_cpu:
        settings, device_name = cpu_settings(scale), "cpu"
    elif not torch.cuda.is_available():
        return not_run(NAME, TITLE, "skipped",
                       "no CUDA device visible (torch.cuda.is_available() is False); run `make bench` on a GPU "
                       "machine to measure it", setup={"model_config": QWEN25_05B, "goal_mfu": GOAL_MFU})
    else:
        settings, device_name = SCALES[scale], torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir=work_dir) as tmp:
        return measure(settings, model_config(tiny=scale == "tiny"), device_name, Path(tmp), log)


def main(argv: list[str] | None = None) -> int:
    """One run of this benchmark for ``make gpu-check``: each side's figure goes to $GPU_CHECK_REPORT as it
    is measured; the whole record to OUT/gpu_benchmark.json and .md. Exit 1 when a side failed."""
    import argparse
    import datetime

    from benchmarks import report
    from workflow_scripts.core.atomic_output import atomic_path, write_json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_gpu", description=main.__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES) + sorted(bench_gpu_7b.SCALES), default="check",
                        help="7b: the Qwen2.5-7B architecture, every side in one process (benchmarks/bench_gpu_7b.py)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="the harness on CPU (tests); tiny scales only")
    parser.add_argument("--sides", nargs="+", help="7b: only these sides (bench_gpu_7b.SIDES; default "
                        "bench_gpu_7b.DEFAULT_SIDES)")
    parser.add_argument("--seconds", type=float, help="7b: the time the sides may take (default: the phase's)")
    parser.add_argument("--repetitions", type=int, help="7b: interleaved repetitions of every side (default: the scale's)")
    args = parser.parse_args(argv)
    if args.scale in bench_gpu_7b.SCALES:
        if args.cpu and not args.scale.endswith("tiny"):
            parser.error("--cpu runs the 7b harness at --scale 7b-tiny only")
        return bench_gpu_7b.main(args.scale, args.cpu, args.out_dir, args.sides, args.seconds, args.repetitions)
    if args.cpu and args.scale != "tiny":
        parser.error("--cpu runs the harness at --scale tiny only")
    started = time.perf_counter()
    load = os.getloadavg()[0]
    try:
        result = run(args.scale, work_dir=None, on_cpu=args.cpu)
    except Exception as error:  # recorded, as make bench records it; the sides' own lines are already written
        result = not_run(NAME, TITLE, "failed", f"{type(error).__name__}: {error}")
    result["seconds"] = time.perf_counter() - started
    run_info = {"scale": args.scale, "total_seconds": result["seconds"], "load_average_start": load,
                "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "hardware": result["hardware"], "packages": result["packages"]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    document = json.loads(json.dumps(result, default=str))
    write_json(args.out_dir / "gpu_benchmark.json", document)
    with atomic_path(args.out_dir / "gpu_benchmark.md") as path:
        path.write_text(report.render([document], run_info))
    print(f"gpu benchmark: {result['status']}" + (f" ({result['message']})" if result.get("message") else ""))
    return 0 if result["status"] in {"measured", "skipped"} and not result.get("message") else 1


if __name__ == "__main__":
    raise SystemExit(main())
