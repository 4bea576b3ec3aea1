"""Builds the training model, optimizer, scheduler and precision — one code path for sanity and train.

The gate is only worth something if it checks what training will run, so both stages call
:func:`build` and :func:`micro_step`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from workflow_scripts.model import model_loading
from workflow_scripts.training import distributed, fsdp, kernels
from workflow_scripts.training.distributed import DistributedContext
from workflow_scripts.core.settings import TrainingSettings, finetune_problem



@dataclass
class TrainingSetup:
    context: DistributedContext
    training: TrainingSettings
    peft_model: nn.Module  # the PEFT model; under training.finetune: full the plain model, every parameter trainable
    model: nn.Module  # what the loop calls: the task's loss module, DDP-wrapped when world > 1
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    autocast_dtype: torch.dtype | None
    accumulation: int
    vocab_size: int
    task: Any  # tasks.base.Task: the collator and the loss come from it
    packing: tuple[int, str] | None = None  # (max_length, attention implementation) when packing

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.context.device.type, dtype=self.autocast_dtype)

    def no_sync(self, last_micro_step: bool):
        """Skip DDP's gradient all-reduce (FSDP's reduce-scatter) on all but the last micro-step of an accumulation."""
        if fsdp.is_sharded(self.peft_model):  # FSDP2: a flag on the root, not a context manager
            self.peft_model.set_requires_gradient_sync(last_micro_step)
            return contextlib.nullcontext()
        if last_micro_step or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.peft_model.parameters() if p.requires_grad]


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return True  # CPU autocast supports bf16 (slowly on CPUs without AVX512-BF16/AMX)


def build_optimizer_and_scheduler(parameters, training: TrainingSettings, device: torch.device):
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW(
        parameters, lr=training.learning_rate, weight_decay=training.weight_decay, fused=device.type == "cuda",
    )
    name = "constant_with_warmup" if training.lr_scheduler == "constant" else training.lr_scheduler
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=training.warmup_steps,
                              num_training_steps=training.max_steps)
    return optimizer, scheduler


def check_finetune(training: TrainingSettings, initialise: str, task_name: str | None = None) -> None:
    problem = finetune_problem(training, initialise, task_name)
    if problem is not None:
        from workflow_scripts.core.errors import WorkflowError

        raise WorkflowError(f"{problem[0]}: {problem[1]}")


def build(model_dir, training: TrainingSettings, context: DistributedContext,
          trust_remote_code: bool = False, data_meta: Mapping[str, Any] | None = None, seed: int = 0) -> TrainingSetup:
    """Load the task's model onto this rank's device (under FSDP: rank 0 on the host, the others on the meta
    device, sharded and filled from rank 0 by ``fsdp.shard``), add LoRA (or, with ``training.finetune: full``, make
    every parameter trainable), wrap the task's loss for DDP; optimizer, precision.

    ``data_meta`` is the pre-tokenised data's ``tokenise_meta.json``: its task chooses model class, LoRA
    task type and loss (generation when None, as in tests that build a model without data). ``seed``
    draws the weights of a ``model.initialise: random`` model (the experiment seed).
    """
    from workflow_scripts.tasks import task_named

    data_meta = data_meta or {"task": "generation"}
    task = task_named(data_meta["task"])
    task_meta = data_meta.get("task_meta", {})
    device = context.device
    check_finetune(training, model_loading.initialisation(model_dir), task.name)
    # Full: fp32 master weights from the start (a bf16 load would round pretrained fp32 weights first).
    dtype = torch.float32 if training.full else model_loading.weights_dtype(training.precision, device)
    from workflow_scripts.model import quantization  # QLoRA: bitsandbytes weights when training.quantization is set

    model_kwargs = {**task.model_kwargs(task_meta), **quantization.from_pretrained_kwargs(training, device)}
    if training.sharded:  # refused before loading; rank 0 loads on the host, the others on meta
        fsdp.check_settings(training, task.name)
    load_device = fsdp.loading_device(context) if training.sharded else device
    base = model_loading.load_base_model(model_dir, load_device, dtype, trust_remote_code, task.auto_model_class,
                                         model_kwargs, seed=seed)
    task.prepare_model(base, data_meta.get("pad_token_id"), task_meta)
    if hasattr(task, "align_model"):  # optional hook: a VLM's model follows the image settings pretokenise used
        task.align_model(base, data_meta)
    if kernels.attn_implementation(training, device):  # training.flex_attention: packed rows keep a fused kernel
        base.set_attn_implementation(kernels.attn_implementation(training, device))
    kernels.apply_before_lora(base, training, device)  # training.liger_kernels
    vocab_size = base.get_input_embeddings().num_embeddings
    if training.full:
        peft_model = model_loading.prepare_full(base, training.gradient_checkpointing)
    else:
        # The task may rewrite the LoRA settings for its model (a VLM: adapters on the language model only).
        lora_settings = getattr(task, "lora_settings", None)
        lora = lora_settings(base, training.lora) if lora_settings else training.lora
        base = quantization.prepare(base, training, lora, task.peft_task_type)  # no-op when off
        peft_model = model_loading.add_lora(base, lora, training.gradient_checkpointing, task.peft_task_type)
    peft_model.train()
    kernels.apply_after_lora(peft_model, training)  # training.compile_layers
    packing = None
    if training.packing:
        from workflow_scripts.core.errors import WorkflowError
        from workflow_scripts.data import packing as packing_module

        if not hasattr(task, "packs"):
            raise WorkflowError(f"training.packing: task '{task.name}' does not pack examples. Fix: set training.packing: false")
        if training.sharded:  # the other ranks hold the model on the meta device until sharding: rank 0 probes
            ok, reason = distributed.all_gather_objects(
                packing_module.supports_packing(peft_model, training.max_length) if context.rank == 0 else None,
                context)[0]
        else:
            ok, reason = packing_module.supports_packing(peft_model, training.max_length)
        if not ok:
            raise WorkflowError(f"training.packing: {reason}. Fix: set training.packing: false")
        packing = (training.max_length, base.config._attn_implementation)
    model: nn.Module = task.loss_module(peft_model)
    fused = kernels.fused_cross_entropy(peft_model, training, device)  # training.fused_cross_entropy
    if fused is not None:
        from workflow_scripts.tasks.generation import TargetTokenLoss

        # The fused path calls the decoder alone: a loss that feeds the model more (a VLM's pixels) cannot use it.
        if not isinstance(model, TargetTokenLoss) or type(model).model_inputs is not TargetTokenLoss.model_inputs:
            from workflow_scripts.core.errors import WorkflowError

            raise WorkflowError(f"training.fused_cross_entropy: task '{task.name}' computes its loss without the "
                                "text-only target-token head it fuses. Fix: set training.fused_cross_entropy: false")
        model.fused_cross_entropy = fused
    if training.sharded:  # sharded in place, before the optimizer takes the parameters
        fsdp.shard(peft_model, training, context, task.name)
    elif context.is_distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
        )
    optimizer, scheduler = build_optimizer_and_scheduler(
        [p for p in peft_model.parameters() if p.requires_grad], training, device
    )
    autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[training.precision]
    scaler = torch.amp.GradScaler(device.type) if training.precision == "fp16" else None
    return TrainingSetup(context, training, peft_model, model, optimizer, scheduler, scaler,
                         autocast_dtype, training.accumulation, vocab_size, task, packing)


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict:
    non_blocking = device.type == "cuda"
    return {
        key: value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
    }


def seed_micro_batch(seed: int, step: int, micro_batch_index: int) -> None:
    """Seed the randomness of one micro-batch (LoRA dropout) from (seed, step, global micro-batch index).

    A micro-batch then draws the same dropout mask whichever process runs it and after how many
    others, so 1 and N processes (and a resumed run) train identically with dropout on.
    """
    import numpy as np

    torch.manual_seed(int(np.random.SeedSequence([seed, step, micro_batch_index]).generate_state(1)[0]))


def step_loss_scale(local_denominator: float, context: DistributedContext):
    """``micro_step``'s ``loss_scale``: world_size / the step's loss denominator summed over the ranks (its target
    tokens; under class weights sum_i w[y_i], a float). Only a denominator of exactly 0 divides by 1 instead: a step
    with nothing to score (whole-word masking can leave every row unmasked, as BERT's
    create_masked_lm_predictions does) is a zero loss. Any other sum, below 1 too, is divided by as it is, so a
    class-weighted step is torch's CrossEntropyLoss(weight=w) mean and matches the held-out loss's scale."""
    if not context.is_distributed:
        return 1.0 / (local_denominator if local_denominator != 0 else 1.0)
    total = distributed.all_reduce_sum(torch.tensor(float(local_denominator), device=context.device), context)
    return context.world_size / torch.where(total == 0, torch.ones_like(total), total)


def micro_step(setup: TrainingSetup, batch: Mapping[str, Any], loss_scale, last_micro_step: bool,
               randomness: tuple[int, int, int]) -> torch.Tensor:
    """Forward and backward on one micro-batch; returns this micro-batch's share of the step's mean loss.

    ``loss_scale`` (:func:`step_loss_scale`) is world_size / target tokens of the global batch: DDP averages gradients over
    ranks, so multiplying by the world size makes the result the per-token mean of the global batch.
    ``randomness`` is (seed, step, global micro-batch index), see :func:`seed_micro_batch`.
    """
    seed_micro_batch(*randomness)
    with setup.no_sync(last_micro_step):
        with setup.autocast(), kernels.offloading(setup.training, setup.context.device):
            loss_sum = setup.model(batch)
        loss = loss_sum * loss_scale
        if setup.scaler is not None:
            setup.scaler.scale(loss).backward()
        else:
            loss.backward()
    return loss.detach() / setup.context.world_size


def global_micro_batch_index(setup: TrainingSetup, local_index: int) -> int:
    """Rank r runs the step's micro-batches r, r+W, r+2W, ... (batching.RankBatchSampler)."""
    return setup.context.rank + local_index * setup.context.world_size


def unscale_and_clip(setup: TrainingSetup, inspect: Callable[[], None] | None = None) -> torch.Tensor:
    """The first half of an optimizer step: true-scale gradients, clipped; returns the norm before clipping.

    ``inspect`` (the gate's gradient checks) sees the unscaled gradients before clipping, which would
    spread one NaN over every tensor.
    """
    if setup.scaler is not None:
        setup.scaler.unscale_(setup.optimizer)
    if inspect is not None:
        inspect()
    norm = torch.nn.utils.clip_grad_norm_(setup.trainable_parameters(), setup.training.max_grad_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor over the shards' norms


def apply_update(setup: TrainingSetup) -> bool:
    """The second half: update, advance the schedule, clear gradients. Returns whether the update happened.

    With fp16 the scaler skips the update when gradients overflowed; the learning-rate schedule then
    does not advance either (as HF Trainer does), so the schedule counts only updates that happened.
    """
    applied = True
    if setup.scaler is not None:
        scale_before = setup.scaler.get_scale()
        setup.scaler.step(setup.optimizer)
        setup.scaler.update()
        applied = setup.scaler.get_scale() >= scale_before  # a skipped step backs the scale off
    else:
        setup.optimizer.step()
    if applied:
        setup.scheduler.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return applied


def load_training_settings(text: str) -> TrainingSettings:
    """The --training JSON, parsed and validated into typed settings (core.settings)."""
    return TrainingSettings.from_json(text)
