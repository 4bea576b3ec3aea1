"""The ``train`` stage: LoRA (or, with ``training.finetune: full``, whole-model) fine-tuning, one process per
GPU (or gloo processes on CPU), resumable.

One readable loop: each optimizer step takes this rank's micro-batches of the step's global batch,
normalises the loss by the target tokens of the whole global batch (so 1 and N processes agree),
clips, checks for NaN/Inf, steps, logs, and checkpoints every N steps or when SLURM signals.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import random
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from workflow_scripts.data import batching
from workflow_scripts.tasks import stored_columns
from workflow_scripts.training import checkpointing, distributed, fsdp, preflight_checks, training_setup, validation
from workflow_scripts.training import kernels, validation_metric
from workflow_scripts.analysis import fairness
from workflow_scripts.launch import launcher
from workflow_scripts.model import memory_estimate, model_loading, quantization
from workflow_scripts.core.atomic_output import atomic_path, write_json
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.core.run_manifest import build_manifest
from workflow_scripts.core.section_settings import TrackingSettings
from workflow_scripts.core.settings import TrainingSettings
from workflow_scripts.core.stage_arguments import StageArgumentParser
from workflow_scripts.training import trackers
from workflow_scripts.training.training_log import TrainingLog

# Exit code after a checkpoint on SIGTERM/SIGUSR1 (EX_TEMPFAIL): "requeue me", not "I failed".
PREEMPTED_EXIT_CODE = 75


class NonFiniteError(WorkflowError):
    """The loss or the gradient norm became NaN/Inf."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = StageArgumentParser(prog="python -m workflow_scripts.train", description=__doc__)
    add_common_arguments(parser)
    parser.add_argument("--checkpoint-dir", required=True, help="resumable state; kept across failed jobs")
    parser.add_argument("--adapter-out", required=True, help="PEFT adapter directory (safetensors); under "
                        "training.finetune: full the whole model (save_pretrained layout) and full_model.json")
    parser.add_argument("--log-out", required=True, help="train_log.jsonl")
    parser.add_argument("--manifest-out", required=True, help="run_manifest.json")
    parser.add_argument("--tensorboard-dir", default=None, help="TensorBoard event directory (optional)")
    parser.add_argument("--tracking", default=None, help="experiment trackers as JSON (config tracking:); runtime "
                        "only: not part of the resume fingerprint or the comparison")
    parser.add_argument("--validation-metric", default=None, help="with training.validation.metric_examples: JSON "
                        "{task, variant, evaluation {max_new_tokens, batch_size, max_length}, datasets [{name, data "
                        "(normalised directory), metric}]}, the task's metric scored at each validation point")
    return parser.parse_args(argv)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="base model directory (HF layout, safetensors)")
    parser.add_argument("--data", required=True, help="pre-tokenised data directory (save_to_disk)")
    parser.add_argument("--training", required=True, help="resolved training settings as JSON")
    parser.add_argument("--seed", required=True, type=int)
    parser.add_argument("--trust-remote-code", action="store_true")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def run_fingerprint(training: TrainingSettings, meta: dict, model_dir: str, seed: int) -> dict:
    """What a checkpoint must share with this run to be resumed: everything that changes what is learned.

    Runtime settings (wall time, memory request, logging and checkpoint intervals, workers, process
    count: see fairness.RUNTIME_ONLY_TRAINING_KEYS) are left out, so a preempted job given more wall
    time or other GPUs resumes where it stopped.
    """
    return {
        "settings": {k: v for k, v in training.to_dict().items() if k not in fairness.RUNTIME_ONLY_TRAINING_KEYS},
        "data_cache_key": meta.get("cache_key"),
        "model_manifest_sha256": file_sha256(Path(model_dir, "model_manifest.json")),
        "model_config_sha256": file_sha256(Path(model_dir, "config.json")),
        "seed": seed,
    }


def start_up_checks(setup: training_setup.TrainingSetup, training: TrainingSettings,
                    image_processor: dict | None = None) -> dict:
    """The gate's cheap checks, repeated at start-up: the job may land on another machine than the gate.
    ``image_processor``: a VLM's image-processor settings from tokenise_meta.json (its pixel budget)."""
    context = setup.context
    checks = preflight_checks
    checks.check_device_count(training.gpus, torch.cuda.device_count() if training.gpus else 0,
                              context.local_world_size, context.world_size, training.world_size)
    checks.check_trainable(setup.model)
    checks.check_placement(setup.model, context.device)
    checks.check_name_lookup(setup.model)
    checks.check_precision(training.precision, context.device, setup.scaler, training_setup.bf16_supported)
    estimate = memory_estimate.estimate(setup.peft_model, training, context.device, image_processor)
    processes_here = context.local_world_size if context.device.type == "cpu" else 1
    capacity = memory_estimate.device_capacity(context.device, processes_here)
    checks.check_memory(estimate, capacity, training.memory_headroom, training, context.device,
                        memory_estimate.loading_estimate(setup.peft_model, training, context.device))
    return {**estimate, "device_capacity": capacity}


class StopRequest:
    """SIGTERM/SIGUSR1 only set a flag; the loop checkpoints at the next step boundary and exits."""

    def __init__(self):
        self.requested = False
        self.signal_name = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    training = TrainingSettings.from_json(args.training)
    quantization.leave_out_bitsandbytes("workflow_scripts.train", training.quantization is not None)
    return launcher.run_here_or_launch("workflow_scripts.train", argv, training, lambda: train(args, training))


def train(args: argparse.Namespace, training: TrainingSettings) -> int:
    stop = StopRequest()
    stop.install()
    seed_everything(args.seed)
    context = distributed.setup(use_cuda=training.gpus > 0)
    log, tracker = None, None
    try:
        tracking = TrackingSettings.from_json(args.tracking)
        meta = batching.read_meta(args.data)
        model_loading.check_tokenised_for_model(args.data, meta, args.model)
        dataset = batching.TokenisedSplit(args.data, "train", stored_columns(meta))
        training = training.with_length(len(dataset))  # epochs -> steps, for the schedule too
        held_out = validation.open_split(args.data, training.validation, stored_columns(meta))
        scorer = validation_metric.open_metric(args.validation_metric, training.validation, args.model,
                                               args.trust_remote_code)
        setup = training_setup.build(args.model, training, context, args.trust_remote_code, meta, seed=args.seed)
        estimate = start_up_checks(setup, training, meta.get("image_processor"))
        if meta.get("vocab_size") is not None and meta["vocab_size"] > setup.vocab_size:
            raise WorkflowError(f"{args.data}/tokenise_meta.json: vocab_size {meta['vocab_size']} exceeds the "
                                f"model's {setup.vocab_size}; the data was tokenised for another model")
        fingerprint = run_fingerprint(training, meta, args.model, args.seed)
        messages = print if context.is_main else (lambda *_: None)
        start_step = 0
        resume_from, refusal = None, None
        if context.is_main:  # one rank decides; every rank learns the decision (or the refusal) from it
            try:
                resume_from = checkpointing.latest_compatible(args.checkpoint_dir, fingerprint)
            except WorkflowError as error:
                refusal = str(error)
        resume_from, refusal = distributed.all_gather_objects((resume_from, refusal), context)[0]
        if refusal is not None:
            raise WorkflowError(refusal)
        selection = validation.Selection()
        if resume_from is not None:
            start_step = checkpointing.load(resume_from, setup.peft_model, setup.optimizer, setup.scheduler,
                                            setup.scaler, context.rank, context.device, messages)
            selection = validation.Selection.from_dict(checkpointing.extra_state(resume_from).get("validation"))
            messages(f"resumed from {resume_from} at step {start_step}")
        running_log = Path(args.checkpoint_dir, "train_log.running.jsonl")

        def open_outputs():  # rank 0: best adapters a resume no longer needs, the tracker, the running log
            validation.prune(args.checkpoint_dir, selection, resumed_step=start_step)
            opened = trackers.open_tracker(tracking, args.checkpoint_dir, start_step, training.to_dict(), args.seed,
                                           args.model)
            return opened, TrainingLog(running_log, start_step, training.max_steps, training.log_every,
                                       args.tensorboard_dir, tracker=opened)

        tracker, log = distributed.on_main(context, "opening the training log and tracker", open_outputs) or (
            None, TrainingLog(running_log, start_step, training.max_steps, training.log_every, enabled=False))
        log.message(
            f"training {training.max_steps} steps on {context.world_size} process(es), device {context.device}, "
            + (f"{setup.accumulation} micro-batches of {training.micro_batch}" if setup.accumulation else
               f"micro-batches of up to {training.micro_batch_tokens} token slots")
            + " per process per step, "
            f"estimated peak {memory_estimate.human(estimate['total'])}"
        )
        outcome, stopped_early_at = run_steps(setup, dataset, meta, training, args, start_step, stop, log,
                                              fingerprint, held_out, selection, scorer)
        if outcome == "preempted":
            return PREEMPTED_EXIT_CODE
        peak = max(distributed.all_gather_objects(memory_estimate.peak_memory_bytes(context.device), context))
        devices = distributed.all_gather_objects(distributed.device_name(context.device), context)
        hosts = distributed.all_gather_objects(socket.gethostname(), context)  # rank order: where each ran
        adapter_state = fsdp.gather_adapter(setup.peft_model)  # every rank: FSDP gathers the shards; None under DDP

        def write_outputs():  # rank 0 alone (the others wait in on_main, not in a collective)
            with atomic_path(args.adapter_out, directory=True) as directory:
                if training.validation.keep == "best":  # the best step by the configured criterion
                    shutil.copytree(validation.best_adapter(args.checkpoint_dir, selection), directory,
                                    dirs_exist_ok=True)
                elif training.full:
                    model_loading.save_full_model(setup.peft_model, directory)
                else:
                    model_loading.save_adapter(setup.peft_model, directory, adapter_state)
                quantization.write_adapter_record(directory, training)  # QLoRA: the base evaluation loads
            log.finish(args.log_out)
            write_json(args.manifest_out, build_manifest(
                "train", training.to_dict(), seed=args.seed, world_size=context.world_size, devices=devices, hosts=hosts,
                model_dir=str(args.model), model_manifest_sha256=fingerprint["model_manifest_sha256"],
                data_cache_key=fingerprint["data_cache_key"], memory_estimate=estimate, peak_memory_bytes=peak,
                # CPU: the process's peak resident set, Python and libraries included; CUDA: allocated bytes.
                peak_memory_kind="cuda_max_allocated" if context.device.type == "cuda" else "cpu_max_rss",
                gradient_accumulation=setup.accumulation, resumed_from_step=start_step,
                final_loss=log.records[-1]["loss"] if log.records else None,
                skipped_updates=sum(bool(r.get("update_skipped")) for r in log.records),
                validation=validation.summary(selection, training.validation, stopped_early_at),
                tracking=tracker.manifest_entry() if tracker is not None else None,
            ))
            if tracker is not None:
                tracker.log_outputs(args.manifest_out, args.log_out, args.adapter_out)
            checkpointing.clear(args.checkpoint_dir)
            validation.clear(args.checkpoint_dir)

        distributed.on_main(context, "writing the adapter, training log and manifest", write_outputs)
        return 0
    finally:
        if log is not None:
            log.close()
        if tracker is not None:  # no-op after log_outputs; KILLED: a preempted run is continued on requeue
            tracker.close("FAILED" if sys.exc_info()[0] is not None else "KILLED")
        distributed.teardown(context)


def run_steps(setup, dataset, meta, training, args, start_step, stop, log, fingerprint, held_out=None,
              selection=None, scorer=None) -> tuple[str, int | None]:
    """The optimizer steps; returns ("done" | "preempted", the step training stopped early at, or None)."""
    selection = selection if selection is not None else validation.Selection()
    checks = training.validation
    context = setup.context
    device = context.device
    plan = batching.GlobalBatchPlan(dataset.lengths(), training.effective_batch, args.seed, training.length_grouping)
    sampler = batching.RankBatchSampler(plan, training.micro_batch, context.rank, context.world_size,
                                        start_step, training.max_steps, training.micro_batch_tokens)
    collator = setup.task.collator(meta, setup.vocab_size, seed=args.seed,
                                   **({"packing_for": setup.packing} if setup.packing else {}))
    loader = batching.build_loader(dataset, sampler, collator, training.dataloader_workers, device.type == "cuda", args.seed)
    batches = iter(loader)
    last_checkpoint = None
    stage_started = launcher.stage_started_at()
    started = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    setup.model.train()
    compiled = kernels.compile_seconds()
    if trackers.is_enabled(TrackingSettings.from_json(args.tracking)):
        # Logging a step to the tracker is a network call on rank 0 that may retry for minutes: the others
        # wait for it in on_main rather than in the next step's all-reduce (one small broadcast per step).
        def log_step(record):
            distributed.on_main(context, f"logging step {record['step']}", lambda: log.write(record))
    else:
        log_step = log.write
    for step in range(start_step, training.max_steps):
        step_started = time.perf_counter()
        micro_batches = [next(batches) for _ in range(sampler.micro_steps(step))]  # the same count on every rank
        loss_scale = training_setup.step_loss_scale(sum(b["target_tokens"] for b in micro_batches), context)
        step_loss = torch.zeros((), device=device)
        for k, batch in enumerate(micro_batches):
            batch = training_setup.to_device(batch, device)
            randomness = (args.seed, step, training_setup.global_micro_batch_index(setup, k))
            step_loss += training_setup.micro_step(setup, batch, loss_scale, k == len(micro_batches) - 1, randomness)
        grad_norm = training_setup.unscale_and_clip(setup)
        # One small all-reduce and one host sync per step: the NaN check and the log need them anyway.
        counts = torch.tensor([sum(b["real_tokens"] for b in micro_batches),
                               sum(b["padded_tokens"] for b in micro_batches), float(stop.requested)])
        stats = torch.cat([step_loss.float().reshape(1), counts.to(device, non_blocking=True)])
        distributed.all_reduce_sum(stats, context)
        loss, real_tokens, padded_tokens, stop_votes = stats.tolist()
        norm = float(grad_norm)
        if not math.isfinite(loss) or (not math.isfinite(norm) and setup.scaler is None):
            rows = [r for b in micro_batches for r in b["row_ids"]]
            raise NonFiniteError(
                f"step {step + 1}: the {'loss' if not math.isfinite(loss) else 'gradient norm'} is "
                f"{loss if not math.isfinite(loss) else norm}; training stopped before applying the update. "
                f"Last good checkpoint: {last_checkpoint or checkpointing.checkpoints(args.checkpoint_dir)[-1:] or 'none'}. "
                f"Rows in this step on rank {context.rank}: {rows[:8]}. Fix: lower training.learning_rate, "
                "check those rows, or use bf16 instead of fp16"
            )
        learning_rate = setup.scheduler.get_last_lr()[0]
        applied = training_setup.apply_update(setup)
        if setup.scaler is not None:
            preflight_checks.check_scaler_scale(setup.scaler, 65536.0)
        if not applied:
            log.message(f"step {step + 1}: fp16 gradients overflowed; the scaler skipped this update and the "
                        "learning-rate schedule did not advance")
        completed = step + 1
        now = time.perf_counter()
        record = {}
        if held_out is not None and validation.due(checks, completed, training.max_steps):
            record["validation_loss"] = validation.finite(
                validation.held_out_loss(setup, held_out, collator, checks), completed)
            metrics = validation_metric.score(setup, scorer) if scorer is not None else {}
            record.update(metrics)
            if selection.update(completed, record["validation_loss"], metrics, checks.criterion,
                                scorer is not None and scorer.lower_is_better):
                validation.save_best(setup, args.checkpoint_dir, completed)
        if step == start_step:  # what start-up cost this stage: process (or torchrun) start to this step's end
            record["seconds_from_stage_start"] = time.time() - stage_started
        # training.compile_layers: compilation (first steps, recompiles) is logged apart and not counted as step time
        compiling, compiled = kernels.compile_seconds() - compiled, kernels.compile_seconds()
        if training.compile_layers:
            record["compile_seconds"] = compiling
        log_step({**record,
            "step": completed,
            "loss": loss,
            "learning_rate": learning_rate,
            "grad_norm": norm,
            "tokens_per_second": real_tokens / max(now - step_started - compiling, 1e-9),
            "padding_share": padded_tokens / max(real_tokens + padded_tokens, 1.0),
            "peak_memory_bytes": memory_estimate.peak_memory_bytes(device),
            "elapsed_seconds": now - started,
            "update_skipped": not applied,
            **({"micro_steps": len(micro_batches)} if training.micro_batch_tokens else {}),  # varies per step
        })
        preempted = stop_votes > 0
        if completed % training.checkpoint_every == 0 or (preempted and completed < training.max_steps):
            last_checkpoint = save_checkpoint(setup, args, completed, fingerprint, selection)
        if preempted and completed < training.max_steps:
            log.message(f"received {stop.signal_name or 'a stop signal on another rank'}: checkpointed step "
                        f"{completed}; exiting with {PREEMPTED_EXIT_CODE} so the job is requeued and resumes")
            return "preempted", None
        patience = checks.early_stopping_patience
        if patience and "validation_loss" in record and selection.since_best >= patience:
            by_metric = checks.criterion == "metric"
            best = selection.best_metric if by_metric else selection.best_loss
            log.message(f"step {completed}: the validation {'metric' if by_metric else 'loss'} has not improved for "
                        f"{patience} evaluations (best {best:.4f} at step {selection.best_step}); stopping early")
            return "done", completed
    return "done", None


def save_checkpoint(setup, args, step: int, fingerprint: dict, selection: validation.Selection | None = None):
    context = setup.context
    rng_states = distributed.all_gather_objects(checkpointing.rng_state(context.device), context)
    state = checkpointing.gather_state(setup.peft_model, setup.optimizer, context.is_main)  # collective under FSDP
    selection = selection if selection is not None else validation.Selection()

    def write():  # rank 0 alone: a whole model under finetune: full can take minutes
        path = checkpointing.save(args.checkpoint_dir, step, setup.peft_model, setup.optimizer, setup.scheduler,
                                  setup.scaler, rng_states, fingerprint, extra={"validation": selection.as_dict()},
                                  state=state, strategy=setup.training.strategy)
        validation.prune(args.checkpoint_dir, selection)
        return path

    return distributed.on_main(context, f"writing the checkpoint of step {step}", write, share_result=True)


if __name__ == "__main__":
    run_main(main)
