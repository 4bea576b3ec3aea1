"""Builds the training model, optimizer, scheduler and precision — one code path for sanity and train.

The gate is only worth something if it checks what training will run, so both stages call
:func:`build` and :func:`micro_step`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from workflow_scripts import model_loading
from workflow_scripts.distributed import DistributedContext
from workflow_scripts.experiment_config import gradient_accumulation

WRAPPER_PREFIXES = ("module.", "causal_lm.")  # DDP's prefix, then TargetTokenLoss's attribute


class TargetTokenLoss(nn.Module):
    """Summed cross-entropy over target tokens only; logits are computed for those tokens alone.

    The loss is a sum, not a mean: the caller divides by the target tokens of the whole global batch,
    so every token weighs the same whatever the micro-batch split or the number of processes.
    """

    def __init__(self, causal_lm: nn.Module):
        super().__init__()
        self.causal_lm = causal_lm  # the PEFT model
        base = causal_lm.get_base_model()
        # Models that post-process logits (soft-capping) or lack the usual decoder/head split (some
        # remote-code models) take the full forward instead.
        decoder = getattr(base, "get_decoder", lambda: None)()
        self._head_only = (
            getattr(base.config, "final_logit_softcapping", None) is None
            and decoder is not None and decoder is not base and base.get_output_embeddings() is not None
        )

    def forward(self, input_ids, attention_mask, target_index, target_ids):
        base = self.causal_lm.get_base_model()
        if self._head_only:
            hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, target_index)
            logits = base.get_output_embeddings()(hidden)
        else:
            logits = self.causal_lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            logits = logits[:, :-1].reshape(-1, logits.shape[-1]).index_select(0, target_index)
        return F.cross_entropy(logits.float(), target_ids, reduction="sum")


@dataclass
class TrainingSetup:
    context: DistributedContext
    training: Mapping[str, Any]
    peft_model: nn.Module
    model: nn.Module  # what the loop calls: TargetTokenLoss, DDP-wrapped when world > 1
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    autocast_dtype: torch.dtype | None
    accumulation: int
    vocab_size: int
    extras: dict = field(default_factory=dict)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.context.device.type, dtype=self.autocast_dtype)

    def no_sync(self, last_micro_step: bool):
        """Skip DDP's gradient all-reduce on all but the last micro-step of an accumulation."""
        if last_micro_step or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.peft_model.parameters() if p.requires_grad]


def unwrap(model: nn.Module) -> nn.Module:
    """The PEFT model inside DDP and TargetTokenLoss wrappers."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, TargetTokenLoss)):
        model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model.causal_lm
    return model


def strip_wrapper_prefix(name: str) -> str:
    """A parameter name as the PEFT model spells it, whether or not DDP (``module.``) wraps it."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters under PEFT-relative names, for plain and wrapped models alike (seed: lookups failed
    after DDP added its ``module.`` prefix)."""
    return {strip_wrapper_prefix(name): p for name, p in model.named_parameters()}


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in named_parameters(model).items() if "lora_" in name}


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return True  # CPU autocast supports bf16 (slowly on CPUs without AVX512-BF16/AMX)


def build_optimizer_and_scheduler(parameters, training: Mapping[str, Any], device: torch.device):
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW(
        parameters, lr=training["learning_rate"], weight_decay=training["weight_decay"],
        fused=device.type == "cuda",
    )
    name = training["lr_scheduler"]
    if name == "constant":
        name = "constant_with_warmup"
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=training["warmup_steps"],
                              num_training_steps=training["max_steps"])
    return optimizer, scheduler


def build(model_dir, training: Mapping[str, Any], context: DistributedContext,
          trust_remote_code: bool = False) -> TrainingSetup:
    """Load the base model onto this rank's device, add LoRA, wrap for DDP; optimizer and precision."""
    device = context.device
    dtype = model_loading.weights_dtype(training["precision"], device)
    base = model_loading.load_base_model(model_dir, device, dtype, trust_remote_code)
    vocab_size = base.get_input_embeddings().num_embeddings
    peft_model = model_loading.add_lora(base, training["lora"], training["gradient_checkpointing"])
    peft_model.train()
    model: nn.Module = TargetTokenLoss(peft_model)
    if context.is_distributed:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
        )
    optimizer, scheduler = build_optimizer_and_scheduler(
        [p for p in peft_model.parameters() if p.requires_grad], training, device
    )
    precision = training["precision"]
    autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    accumulation = gradient_accumulation(training)
    return TrainingSetup(context, training, peft_model, model, optimizer, scheduler, scaler,
                         autocast_dtype, accumulation, vocab_size)


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict:
    non_blocking = device.type == "cuda"
    return {
        key: value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
    }


def micro_step(setup: TrainingSetup, batch: Mapping[str, Any], loss_scale, last_micro_step: bool) -> torch.Tensor:
    """Forward and backward on one micro-batch; returns this micro-batch's share of the step's mean loss.

    ``loss_scale`` is world_size / target tokens of the global batch: DDP averages gradients over
    ranks, so multiplying by the world size makes the result the per-token mean of the global batch.
    """
    with setup.no_sync(last_micro_step):
        with setup.autocast():
            loss_sum = setup.model(batch["input_ids"], batch["attention_mask"], batch["target_index"], batch["target_ids"])
        loss = loss_sum * loss_scale
        if setup.scaler is not None:
            setup.scaler.scale(loss).backward()
        else:
            loss.backward()
    return loss.detach() / setup.context.world_size


def load_training_settings(text: str) -> dict:
    """The --training JSON: parsed and validated against config/schema.yaml's training_settings."""
    import copy
    import json

    import yaml

    from workflow_scripts.errors import ConfigError
    from workflow_scripts.experiment_config import SCHEMA_PATH, _validator_with_defaults

    try:
        settings = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError("--training", f"not valid JSON ({error})") from None
    if not isinstance(settings, dict):
        raise ConfigError("--training", "must be a JSON object of training settings")
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    sub_schema = copy.deepcopy(schema["$defs"]["training_settings"])
    sub_schema["$defs"] = schema["$defs"]
    errors = list(_validator_with_defaults()(sub_schema).iter_errors(settings))
    if errors:
        from jsonschema.exceptions import best_match

        error = best_match(errors)
        key = ".".join(["training", *map(str, error.absolute_path)])
        raise ConfigError(key, error.message, "--training")
    gradient_accumulation(settings)
    return settings
