"""Benchmark 1: training throughput in non-padding tokens per second.

Ours: the ``train`` stage run as its rule runs it (``python -m workflow_scripts.train ...``), which
groups similar lengths into micro-batches (workflow_scripts/data/batching.py). Reference: Hugging Face
``Trainer`` with PEFT at its defaults (random batches padded to the longest by
``DataCollatorForSeq2Seq``), and the same ``Trainer`` with ``group_by_length=True`` (in transformers 5:
``train_sampling_strategy="group_by_length"``, the same ``LengthGroupedSampler``).

All three train the same LoRA adapters on the same tiny model, from the same pre-tokenised set whose
lengths follow a long-tailed mix from 16 to 512 tokens, at the same effective batch (micro-batch x
accumulation), fp32 on CPU, one torch thread each, no DataLoader workers and no gradient checkpointing
(Trainer's default; a memory/speed trade-off separate from batching). Each run trains two epochs of the
same rows and is timed over the second: the first carries start-up and the first sight of every tensor
shape, which costs CPU kernels far more than later steps. Throughput = non-padding tokens of the timed
steps / their wall time. Each run is a fresh process; the three are interleaved and repeated, and
medians are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import synthetic
from benchmarks.records import Goal, Series, record

NAME = "training_throughput"
MIN_SECONDS = 150  # a minimal run at full scale on 2 quiet cores, for run.py's time planning
TITLE = "Training throughput: non-padding tokens/s, ours vs HF Trainer + PEFT"
REPO = Path(__file__).resolve().parent.parent
SCALES = {
    # One epoch = epoch_steps x effective_batch rows; two epochs are trained, the second is timed.
    "full": {"epoch_steps": 32, "steps": 64, "repetitions": 3, "torch_threads": 1, "effective_batch": 16,
             "micro_batch": 8, "plan_rows": 20_000,
             "model": {"hidden_size": 128, "layers": 2, "heads": 4, "intermediate_size": 344, "vocab_size": 2048},
             "length": {"low": 16, "high": 512, "median": 64, "sigma": 0.9}},
    "tiny": {"epoch_steps": 2, "steps": 4, "repetitions": 1, "torch_threads": 1, "effective_batch": 4,
             "micro_batch": 2, "plan_rows": 200,
             "model": {"hidden_size": 32, "layers": 1, "heads": 2, "intermediate_size": 64, "vocab_size": 512},
             "length": {"low": 16, "high": 64, "median": 24, "sigma": 0.6}},
}
LORA = {"rank": 16, "alpha": 32, "dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
LEARNING_RATE = 3e-4


def training_settings(settings: dict) -> dict:
    """Our stage's --training JSON for this benchmark (keys of config/schema.yaml)."""
    steps = settings["steps"]
    return {"lora": LORA, "max_length": settings["length"]["high"], "effective_batch": settings["effective_batch"],
            "micro_batch": settings["micro_batch"], "max_steps": steps, "learning_rate": LEARNING_RATE,
            "lr_scheduler": "linear", "warmup_steps": 0, "precision": settings.get("precision", "fp32"),
            "gradient_checkpointing": False, "checkpoint_every": steps + 1, "log_every": steps,
            "gpus": settings.get("gpus", 0), "cpu_processes": 1,
            "dataloader_workers": settings.get("dataloader_workers", 0), "length_grouping": True}


def window(step_ends: list[float], real: list[float], padded: list[float], skip: int = 1) -> dict:
    """Throughput over steps skip+1..N from per-step end times (seconds since the loop started) and
    per-step token counts; the first ``skip`` steps (start-up, first sight of each shape) are left out."""
    if len(step_ends) <= skip:
        raise RuntimeError(f"need more than {skip} steps to leave out the first {skip}")
    seconds = step_ends[-1] - step_ends[skip - 1] if skip else step_ends[-1]
    tokens, pads = float(sum(real[skip:])), float(sum(padded[skip:]))
    return {"tokens_per_second": tokens / seconds, "padding_share": pads / (tokens + pads),
            "window_seconds": float(seconds), "window_real_tokens": tokens, "all_real_tokens": float(sum(real)),
            "steps": len(step_ends)}


# --- ours -------------------------------------------------------------------------------------------

def run_ours(model_dir: Path, data_dir: Path, settings: dict, seed: int, work: Path) -> dict:
    out = work / f"ours-{seed}"
    command = [sys.executable, "-m", "workflow_scripts.train", "--model", str(model_dir), "--data", str(data_dir),
               "--training", json.dumps(training_settings(settings)), "--seed", str(seed),
               "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
               "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=child_env(settings.get("torch_threads")))
    if done.returncode != 0:
        raise RuntimeError(f"our train stage failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    steps = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    return log_window(steps, skip=settings["epoch_steps"])


def log_window(steps: list[dict], skip: int = 1) -> dict:
    """Throughput from train_log.jsonl records (docs/architecture.md): each step's tokens/s and padding
    share, times its duration (elapsed_seconds is cumulative from the start of the loop)."""
    ends = [s["elapsed_seconds"] for s in steps]
    durations = np.diff([0.0] + ends)
    real = [s["tokens_per_second"] * d for s, d in zip(steps, durations)]
    padded = [r * s["padding_share"] / max(1.0 - s["padding_share"], 1e-12) for r, s in zip(real, steps)]
    # The stage's start-up: its process start (torchrun's too) to the end of the first step.
    return {**window(ends, real, padded, skip), "seconds_from_stage_start": steps[0].get("seconds_from_stage_start")}


# --- reference: HF Trainer + PEFT --------------------------------------------------------------------

def trainer_probe(model_dir: str, data_dir: str, settings: dict, seed: int, group_by_length: bool, out_dir: str) -> dict:
    """Train with transformers.Trainer + PEFT at its defaults (random batches padded to the longest)."""
    import torch
    from datasets import load_from_disk
    from peft import LoraConfig, get_peft_model
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer,
                              TrainerCallback, TrainingArguments)

    on_gpu = settings.get("gpus", 0) > 0
    bf16 = settings.get("precision", "fp32") == "bf16"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Trainer's usual recipe: bf16 weights when training in bf16 (as ours stores frozen weights on GPUs).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16 and on_gpu else torch.float32)
    model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                             target_modules=LORA["target_modules"], task_type="CAUSAL_LM"))
    data = load_from_disk(data_dir)["train"].remove_columns(["id"])
    pad_collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    # Counted where the batches arrive, in this process: the collator runs inside the DataLoader's worker
    # processes when there are any, and counts kept there never reach this process. Kept as tensors and
    # read after training, so counting adds no host sync to the timed steps.
    micro_batches: list[tuple] = []  # (real tokens as a tensor, tokens with padding)

    class CountingTrainer(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            mask = inputs["attention_mask"]
            micro_batches.append((mask.sum(), mask.numel()))
            return super().training_step(model, inputs, *args, **kwargs)

    marks: list[tuple[float, int]] = []  # (seconds since the loop started, micro-batches seen) at each step's end

    class StepTimes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter() - self.started, len(micro_batches)))

    arguments = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=settings["micro_batch"],
        gradient_accumulation_steps=settings["effective_batch"] // settings["micro_batch"],
        max_steps=settings["steps"], learning_rate=LEARNING_RATE, lr_scheduler_type="linear", warmup_steps=0,
        # transformers 5 spells the old `group_by_length=True` as this strategy (same LengthGroupedSampler)
        train_sampling_strategy="group_by_length" if group_by_length else "random", save_strategy="no", report_to="none", logging_steps=settings["steps"],
        use_cpu=not on_gpu, bf16=bf16, seed=seed, dataloader_num_workers=settings.get("dataloader_workers", 0),
        disable_tqdm=True,
    )
    trainer = CountingTrainer(model=model, args=arguments, train_dataset=data, data_collator=pad_collator,
                      callbacks=[StepTimes()])
    trainer.train()
    ends = [m[0] for m in marks]
    real, padded, first = [], [], 0
    for _, last in marks:
        step_real = sum(int(tokens) for tokens, _ in micro_batches[first:last])
        real.append(step_real)
        padded.append(sum(total for _, total in micro_batches[first:last]) - step_real)
        first = last
    result = window(ends, real, padded, skip=settings["epoch_steps"])
    result["optimizer"] = str(getattr(arguments.optim, "value", arguments.optim))
    result["attention"] = str(model.config._attn_implementation)
    result["torch_compile"] = bool(arguments.torch_compile)
    return result


def run_trainer(model_dir: Path, data_dir: Path, settings: dict, seed: int, group_by_length: bool, work: Path) -> dict:
    out = work / f"trainer-{'grouped' if group_by_length else 'random'}-{seed}"
    command = [sys.executable, "-m", "benchmarks.bench_training", "--model", str(model_dir), "--data", str(data_dir),
               "--settings", json.dumps(settings), "--seed", str(seed), "--out-dir", str(out)]
    if group_by_length:
        command.append("--group-by-length")
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=child_env(settings.get("torch_threads")))
    if done.returncode != 0:
        raise RuntimeError(f"the Trainer reference failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child_env(threads: int | None) -> dict:
    """The same environment for both sides. On CPU, one intra-op thread each: a model this small gains
    little from a second thread, and with more threads than free cores OpenMP's barriers make step
    times swing tenfold whenever other work shares the machine."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    return env


# --- padding of the batch plans at a realistic size (no model: the samplers alone) ------------------

def plan_padding(lengths: np.ndarray, effective_batch: int, micro_batch: int, seed: int) -> dict[str, float]:
    """Padding share of one epoch's micro-batches under each side's own sampler.

    Ours: workflow_scripts.data.batching.GlobalBatchPlan, exactly as the train stage builds it. Trainer:
    torch's RandomSampler (defaults) and transformers' LengthGroupedSampler (group_by_length), cut
    into consecutive micro-batches as its DataLoader does.
    """
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    from workflow_scripts.data.batching import GlobalBatchPlan

    def share(micro_batches) -> float:
        real = padded = 0
        for batch in micro_batches:
            group = lengths[np.asarray(batch)]
            real += int(group.sum())
            padded += int(group.max()) * len(group) - int(group.sum())
        return padded / (real + padded)

    plan = GlobalBatchPlan(lengths, effective_batch, seed, group_by_length=True)
    ours = [mb for step in range(plan.batches_per_epoch) for mb in plan.micro_batches(step, micro_batch)]
    generator = torch.Generator().manual_seed(seed)
    random_order = torch.randperm(len(lengths), generator=generator).tolist()
    grouped_order = list(LengthGroupedSampler(effective_batch, lengths=lengths.tolist(),
                                              generator=torch.Generator().manual_seed(seed)))

    def cut(order):
        return [order[i:i + micro_batch] for i in range(0, len(order), micro_batch)]

    return {"ours": share(ours), "random": share(cut(random_order)), "grouped": share(cut(grouped_order))}


# --- the benchmark -----------------------------------------------------------------------------------

def build_inputs(work: Path, settings: dict) -> tuple[Path, Path, np.ndarray]:
    m = settings["model"]
    config = synthetic.tiny_model_config(m["vocab_size"], m["hidden_size"], m["layers"], m["heads"],
                                         m["intermediate_size"], max_positions=settings["length"]["high"] + 8)
    model_dir = synthetic.save_model_dir(config, work / "model")
    rows = settings["epoch_steps"] * settings["effective_batch"]  # every run sees the same rows
    length = settings["length"]
    lengths = synthetic.long_tailed_lengths(rows, length["low"], length["high"], length["median"], length["sigma"], seed=11)
    table = synthetic.tokenised_table(lengths, m["vocab_size"], seed=12)
    data_dir = synthetic.save_tokenised(table, work / "data", m["vocab_size"], length["high"], model_dir)
    return model_dir, data_dir, lengths


def run(scale: str = "full", work_dir: Path | None = None, log=print, deadline: float | None = None) -> dict:
    settings = SCALES[scale]
    runs: dict[str, list[dict]] = {"ours": [], "random": [], "grouped": []}
    with tempfile.TemporaryDirectory(prefix="bench-training-", dir=work_dir) as tmp:
        work = Path(tmp)
        model_dir, data_dir, lengths = build_inputs(work, settings)
        for repetition in range(settings["repetitions"]):
            seed = repetition + 1
            for side in ("ours", "random", "grouped"):
                if side == "ours":
                    result = run_ours(model_dir, data_dir, settings, seed, work)
                else:
                    result = run_trainer(model_dir, data_dir, settings, seed, side == "grouped", work)
                runs[side].append(result)
                log(f"  training {side} #{repetition + 1}: {result['tokens_per_second']:.0f} tokens/s, "
                    f"padding {result['padding_share']:.1%}")

    def series(side: str, label: str) -> Series:
        results = runs[side]
        return Series(label, [r["tokens_per_second"] for r in results], "non-padding tokens/s",
                      {"padding_share": [r["padding_share"] for r in results],
                       "padding_share_median": float(np.median([r["padding_share"] for r in results])),
                       "window_seconds": [r["window_seconds"] for r in results],
                       "window_real_tokens": [r["window_real_tokens"] for r in results],
                       "all_real_tokens": [r["all_real_tokens"] for r in results],
                       **({"optimizer": results[0]["optimizer"]} if "optimizer" in results[0] else {})})

    ours = series("ours", "ours: train stage (length-grouped micro-batches)")
    reference = series("random", "reference: HF Trainer + PEFT, defaults (random batches, padded to longest)")
    grouped = series("grouped", "HF Trainer + PEFT, group_by_length=True")
    length = settings["length"]
    plan_lengths = synthetic.long_tailed_lengths(settings["plan_rows"], length["low"], length["high"],
                                                 length["median"], length["sigma"], seed=13)
    plans = plan_padding(plan_lengths, settings["effective_batch"], settings["micro_batch"], seed=1)
    log(f"  padding over a {settings['plan_rows']:,}-row epoch: ours {plans['ours']:.1%}, "
        f"Trainer random {plans['random']:.1%}, Trainer group_by_length {plans['grouped']:.1%}")
    def computed_rate(side: Series) -> float:
        """Tokens pushed through the model per second, padding included."""
        return side.median / (1.0 - side.details["padding_share_median"])

    def speed_why(other: Series) -> str:
        return (f"ours' padding share is {ours.details['padding_share_median']:.1%} against "
                f"{other.details['padding_share_median']:.1%}, but ours moves {computed_rate(ours):.0f} tokens/s "
                f"through the model counting padding, against {computed_rate(other):.0f}: per computed token ours is "
                f"{'slower' if computed_rate(ours) < computed_rate(other) else 'not slower'}, so the gap is in the "
                "cost per step, not in padding (load average during the run: see the header)")

    goals = [
        Goal("ours / Trainer defaults >= 1.5x non-padding tokens/s", ours.median / reference.median, 1.5, True,
             why=speed_why(reference)),
        Goal(f"ours padding share < 5% in the timed runs (a {int(lengths.size)}-row set)",
             ours.details["padding_share_median"], 0.05, False,
             why=f"the timed set has only {int(lengths.size)} rows, so even sorted neighbours in the long tail differ "
                 f"in length; the same batch plan over {settings['plan_rows']:,} rows pads {plans['ours']:.1%}"),
        Goal(f"ours padding share < 5% over a {settings['plan_rows']:,}-row epoch (batch plan only, no model)",
             plans["ours"], 0.05, False, why="the length-grouping window of the batch plan is too small"),
        Goal("ours / Trainer group_by_length >= 1.0x (not slower)", ours.median / grouped.median, 1.0, True,
             why=speed_why(grouped)),
    ]
    for side in (ours, reference, grouped):
        side.details["computed_tokens_per_second_incl_padding"] = computed_rate(side)
    return record(
        NAME, TITLE, ours, reference, higher_is_better=True, goals=goals, others=[grouped],
        setup={"model": {"architecture": "llama", **settings["model"]}, "lora": LORA,
               "effective_batch": settings["effective_batch"], "micro_batch": settings["micro_batch"],
               "accumulation": settings["effective_batch"] // settings["micro_batch"], "steps": settings["steps"],
               "rows": int(lengths.size), "lengths": synthetic.length_summary(lengths), "precision": "fp32",
               "gradient_checkpointing": False, "dataloader_workers": 0, "device": "cpu",
               "torch_threads_per_run": settings["torch_threads"],
               "measured_steps": f"{settings['epoch_steps'] + 1}..{settings['steps']} (the second epoch)",
               "padding_share_of_batch_plans": {"rows": settings["plan_rows"], **plans,
                                                "lengths": synthetic.length_summary(plan_lengths)}},
        notes=["Same rows for every run: two epochs over the same set; the second is timed.",
               "Ours' per-step tokens come from its train_log.jsonl (tokens/s x step time); the Trainer's are counted "
               "from each batch its training_step receives (in the main process, DataLoader workers or not) and "
               "read by a step-end callback.",
               "Ours also computes the LM head only at target positions (tasks.generation.TargetTokenLoss); "
               "the Trainer computes logits at every position."],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One Trainer + PEFT reference run (started by the benchmark).")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--group-by-length", action="store_true")
    args = parser.parse_args(argv)
    result = trainer_probe(args.model, args.data, json.loads(args.settings), args.seed, args.group_by_length, args.out_dir)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
