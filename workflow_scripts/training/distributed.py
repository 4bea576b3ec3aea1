"""Process-group set-up for one training process: rank, local rank, world size and its device.

torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; a plain ``python -m`` run is a world of one and never
starts a process group. Each rank owns exactly one device (``cuda:{local_rank}``, or the CPU with
gloo), so no model is ever spread over several devices within a rank.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def setup(use_cuda: bool, timeout_minutes: int = 30) -> DistributedContext:
    """Read torchrun's environment, pick this rank's device and start the process group when world > 1."""
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if world_size > 1:
        if not dist.is_initialized():
            dist.init_process_group(
                backend, timeout=datetime.timedelta(minutes=timeout_minutes),
                **({"device_id": device} if use_cuda else {}),
            )
    else:
        backend = None
    return DistributedContext(rank, local_rank, world_size, local_world_size, device, backend)


# A world-of-one process group started by ensure_process_group (FSDP needs one even for one process).
_SOLO_GROUP = {"started": False}


def ensure_process_group(context: DistributedContext) -> None:
    """Start a process group of this one process when none runs (a world of one never starts one)."""
    if dist.is_initialized():
        return
    backend = "nccl" if context.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": context.device} if context.device.type == "cuda" else {}))
    _SOLO_GROUP["started"] = True


def teardown(context: DistributedContext | None) -> None:
    if not dist.is_initialized():
        return
    if (context is not None and context.is_distributed) or _SOLO_GROUP["started"]:
        dist.destroy_process_group()
        _SOLO_GROUP["started"] = False


def all_reduce_sum(tensor: torch.Tensor, context: DistributedContext) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (a no-op in a world of one)."""
    if context.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(value, context: DistributedContext) -> list:
    """Every rank's ``value``, in rank order (``[value]`` in a world of one)."""
    if not context.is_distributed:
        return [value]
    gathered = [None] * context.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def barrier(context: DistributedContext) -> None:
    if context.is_distributed:
        dist.barrier()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"
