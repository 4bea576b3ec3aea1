"""Parameter names of a model that DDP or a task's loss module may wrap: the model inside, and names as
PEFT spells them. Shared by training (the optimizer step, checkpoints) and the gate checks of the tasks."""
from __future__ import annotations

from torch import nn

WRAPPER_PREFIXES = ("module.", "wrapped.")  # DDP's prefix, then the task loss module's attribute


def unwrap(model: nn.Module) -> nn.Module:
    """The PEFT model inside DDP and the task's loss module (which keeps it as ``wrapped``)."""
    while isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "wrapped"):
        model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model.wrapped
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
