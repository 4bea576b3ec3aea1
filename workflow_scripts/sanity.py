"""The ``sanity`` stage: a gate in front of every training job.

It builds the model exactly as ``train`` does (training_setup.build: same loading, LoRA, precision,
gradient checkpointing, device placement and DDP wrapping, through the same launcher), runs a few
real optimizer steps on the experiment's pre-tokenised data, and fails with
``error: <check>: <cause>. Fix: <fix>`` on the first problem. On success it writes sanity.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Sequence

import torch

from workflow_scripts.data import batching
from workflow_scripts.tasks import stored_columns
from workflow_scripts.training import distributed, preflight_checks as checks, training_setup, validation
from workflow_scripts.launch import launcher
from workflow_scripts.model import memory_estimate, model_loading, quantization
from workflow_scripts.analysis import power
from workflow_scripts.core import json_files
from workflow_scripts.core.atomic_output import write_json
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.core.settings import TrainingSettings
from workflow_scripts.core.stage_arguments import StageArgumentParser
from workflow_scripts.training.preflight_checks import PreflightError
from workflow_scripts.train import add_common_arguments, seed_everything

# fp16 overflows are normal at first (the scaler backs off); allow enough to go from 2^16 below 1.
MAX_FP16_OVERFLOW_STEPS = 20


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = StageArgumentParser(prog="python -m workflow_scripts.sanity", description=__doc__)
    add_common_arguments(parser)
    parser.add_argument("--out", required=True, help="sanity.json report")
    parser.add_argument("--min-detectable-effect", type=float, default=None,
                        help="comparison.min_detectable_effect, checked against each --power-report before the gate")
    parser.add_argument("--power-report", action="append", default=[], metavar="POWER_JSON",
                        help="the power report of a dataset the entry is scored on (repeatable)")
    return parser.parse_args(argv)


def check_power_reports(reports: Sequence[str], threshold: float | None) -> None:
    """comparison.min_detectable_effect against the power reports, whenever the gate runs. The power checkpoint
    stands in front of a gate only until it first passes (rules/common.smk, power_gate), so a threshold added
    later, with the gate rerun as a target, would otherwise never be checked."""
    if threshold is None:
        return
    for path in reports:
        report = json_files.read_json_object(Path(path), f"run snakemake {path} first, which estimates it")
        known = {field.name for field in dataclasses.fields(power.PowerEstimate)}
        try:
            estimate = power.PowerEstimate(**{key: value for key, value in report.items() if key in known})
        except TypeError as error:
            raise WorkflowError(f"{path}: not a power report ({error}); delete it and run snakemake {path}") from None
        power.check_threshold(estimate, threshold)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    check_power_reports(args.power_report, args.min_detectable_effect)
    training = TrainingSettings.from_json(args.training)
    quantization.leave_out_bitsandbytes("workflow_scripts.sanity", training.quantization is not None)
    return launcher.run_here_or_launch("workflow_scripts.sanity", argv, training, lambda: run_gate(args, training))


class Report:
    def __init__(self, is_main: bool):
        self.checks: list[dict] = []
        self.is_main = is_main

    def record(self, name: str, detail: str) -> None:
        self.checks.append({"name": name, "passed": True, "detail": detail})
        if self.is_main:
            print(f"ok   {name}: {detail}", flush=True)


def run_gate(args: argparse.Namespace, training: TrainingSettings) -> int:
    seed_everything(args.seed)
    context = distributed.setup(use_cuda=training.gpus > 0)
    report = Report(context.is_main)
    try:
        visible = torch.cuda.device_count() if training.gpus else 0
        report.record("device_count", checks.check_device_count(
            training.gpus, visible, context.local_world_size, context.world_size, training.world_size))
        report.record("precision", checks.check_precision(
            training.precision, context.device, torch.amp.GradScaler(context.device.type)
            if training.precision == "fp16" else None, training_setup.bf16_supported))
        meta = batching.read_meta(args.data)
        model_loading.check_tokenised_for_model(args.data, meta, args.model)
        dataset = batching.TokenisedSplit(args.data, "train", stored_columns(meta))
        training = training.with_length(len(dataset))
        held_out = validation.open_split(args.data, training.validation, stored_columns(meta))
        if held_out is not None:
            report.record("validation_split", f"{len(held_out)} rows for the held-out loss every "
                                              f"{training.validation.every_steps} steps")
        setup = training_setup.build(args.model, training, context, args.trust_remote_code, meta, seed=args.seed)
        # Re-checked on the built objects: the scaler is the one training will use.
        checks.check_precision(training.precision, context.device, setup.scaler, training_setup.bf16_supported)
        report.record("trainable_parameters", checks.check_trainable(setup.model))
        report.record("placement", checks.check_placement(setup.model, context.device))
        report.record("name_lookup", checks.check_name_lookup(setup.model))
        record_task_check(report, f"{setup.task.name}_model", setup.task.check_model(setup.peft_model, meta.get("task_meta") or {}, training))
        estimate = memory_estimate.estimate(setup.peft_model, training, context.device, meta.get("image_processor"))
        processes_here = context.local_world_size if context.device.type == "cpu" else 1
        capacity = memory_estimate.device_capacity(context.device, processes_here)
        loading = memory_estimate.loading_estimate(setup.peft_model, training, context.device)  # FSDP's loading peak
        report.record("memory", checks.check_memory(estimate, capacity, training.memory_headroom, training, context.device,
                                                    loading))
        report.record("data_scan", checks.scan_dataset(dataset, setup.vocab_size))
        # The task's own checks (tasks.base: check_tokenizer / check_batch) may read the model's tokenizer.
        tokenizer = LazyTokenizer(args.model, args.trust_remote_code)
        record_task_check(report, f"{setup.task.name}_tokenizer", setup.task.check_tokenizer(tokenizer))
        record_task_check(report, "chat_prompt", checks.check_chat_prompt(setup.task, tokenizer, meta.get("templates")))
        losses, padding = run_probe_steps(setup, dataset, meta, training, args.seed, report, tokenizer)
        devices = distributed.all_gather_objects(distributed.device_name(context.device), context)
        report_json = {
            "passed": True,
            "checks": report.checks,
            "memory_estimate": {**estimate, "device_capacity": capacity},
            **({"loading_memory_estimate": loading} if loading else {}),
            "world_size": context.world_size,
            "devices": devices,
            "gradient_accumulation": setup.accumulation,
            "probe_losses": losses,
            "padding_share": padding,
            "seed": args.seed,
        }
        distributed.on_main(context, f"writing {args.out}", lambda: write_json(args.out, report_json))
        return 0
    finally:
        distributed.teardown(context)


class LazyTokenizer:
    """The model's tokenizer, loaded when a task check first reads it: a task without tokenizer checks
    never loads it, so its gate does not require tokenizer files it would not otherwise use."""

    def __init__(self, model_dir: str, trust_remote_code: bool):
        self._args, self._tokenizer = (model_dir, trust_remote_code), None

    def _loaded(self):
        if self._tokenizer is None:
            from workflow_scripts.model.model_loading import load_tokenizer

            self._tokenizer = load_tokenizer(*self._args)
        return self._tokenizer

    def __getattr__(self, name: str):
        return getattr(self._loaded(), name)

    def __len__(self) -> int:
        return len(self._loaded())


def record_task_check(report: Report, name: str, detail: str | None) -> None:
    """A task check's detail goes into the report; None means the task has no such check."""
    if detail is not None:
        report.record(name, detail)


def run_probe_steps(setup, dataset, meta, training, seed: int, report: Report, tokenizer):
    """A few real optimizer steps through the training code, checking batches and gradients."""
    context = setup.context
    report.record("train_mode", checks.check_train_mode(setup.model))
    plan = batching.GlobalBatchPlan(dataset.lengths(), training.effective_batch, seed, training.length_grouping)
    steps = training.sanity_batches + (MAX_FP16_OVERFLOW_STEPS if setup.scaler is not None else 0)
    sampler = batching.RankBatchSampler(plan, training.micro_batch, context.rank, context.world_size, 0, steps,
                                        training.micro_batch_tokens)
    collator = setup.task.collator(meta, setup.vocab_size, seed=seed,
                                   **({"packing_for": setup.packing} if setup.packing else {}))
    batches = iter(batching.build_loader(dataset, sampler, collator, 0, False, seed))
    parameters = setup.trainable_parameters()
    losses, padding, gradients_checked = [], [], False
    initial_scale = float(setup.scaler.get_scale()) if setup.scaler is not None else None
    for step in range(steps):
        micro_batches = [next(batches) for _ in range(sampler.micro_steps(step))]
        padding.append(batching.padding_share(micro_batches))
        loss_scale = training_setup.step_loss_scale(sum(b["target_tokens"] for b in micro_batches), context)  # as train's
        step_loss = 0.0
        for k, batch in enumerate(micro_batches):
            batch = training_setup.to_device(batch, context.device)
            detail = checks.check_batch(batch, context.device, setup.vocab_size)
            task_detail = setup.task.check_batch(batch, tokenizer, setup.peft_model)  # PreflightError on a bad batch
            randomness = (seed, step, training_setup.global_micro_batch_index(setup, k))
            try:
                step_loss += float(training_setup.micro_step(setup, batch, loss_scale, k == len(micro_batches) - 1,
                                                             randomness))
            except RuntimeError as error:
                if "does not require grad" in str(error) or "doesn't require grad" in str(error):
                    raise PreflightError(
                        "gradients", "the loss does not require grad (it was detached, or computed under "
                        "torch.no_grad, before backward)", "keep the loss attached to the graph until backward; "
                        "log loss.item() only after it",
                    ) from None
                raise
        step_loss = float(distributed.all_reduce_sum(torch.tensor([step_loss], device=context.device), context))
        if not math.isfinite(step_loss):
            raise PreflightError("gradients", f"the loss is {step_loss} on probe step {step + 1}",
                                 "check the data and lower training.learning_rate")
        # The optimizer step is training's own (training_setup): unscale, check, clip, update.
        def check_gradients_once():
            nonlocal gradients_checked
            overflow = setup.scaler is not None and not all(
                torch.isfinite(p.grad).all() for p in parameters if p.grad is not None)
            if not overflow and not gradients_checked:
                report.record("gradients", checks.check_gradients(setup.model))
                record_task_check(report, f"{setup.task.name}_gradients", setup.task.check_gradients(setup.peft_model, training))
                gradients_checked = True

        training_setup.unscale_and_clip(setup, check_gradients_once)
        training_setup.apply_update(setup)
        if setup.scaler is not None:
            checks.check_scaler_scale(setup.scaler, initial_scale)
        losses.append(step_loss)
        if step == 0:
            report.record("data", detail)
            record_task_check(report, f"{setup.task.name}_batch", task_detail)
        if gradients_checked and step + 1 >= training.sanity_batches:
            break
    if setup.scaler is not None:
        report.record("loss_scale", checks.check_scaler_scale(setup.scaler, initial_scale))
    return losses, sum(padding) / len(padding)


if __name__ == "__main__":
    run_main(main)
