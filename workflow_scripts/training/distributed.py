"""Process-group set-up for one training process: rank, local rank, world size and its device.

torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; a plain ``python -m`` run is a world of one and never
starts a process group. Each rank owns exactly one device (``cuda:{local_rank}``, or the CPU with
gloo), so no model is ever spread over several devices within a rank.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from workflow_scripts.core.errors import WorkflowError

T = TypeVar("T")

# How long the other ranks wait for work that rank 0 does alone (writing checkpoints and outputs, scoring the
# validation metric, the tracker). Not the collective timeout (30 minutes), which is there to catch ranks
# out of step, not a slow disk or a long generation: the job's wall time ends a stuck rank 0 first, and a
# rank 0 that dies closes its sockets, which ends the wait at once (torchrun then stops the job).
MAIN_WORK_TIMEOUT = datetime.timedelta(days=7)
_MAIN_WORK_GROUP: dict = {}


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
        # A gloo group (CPU sockets, also beside NCCL) with a long timeout, for waiting on rank 0: on_main.
        _MAIN_WORK_GROUP["group"] = dist.new_group(backend="gloo", timeout=MAIN_WORK_TIMEOUT)
    else:
        backend = None
    return DistributedContext(rank, local_rank, world_size, local_world_size, device, backend)


def on_main(context: DistributedContext, what: str, work: Callable[[], T], share_result: bool = False) -> T | None:
    """Run ``work`` on rank 0 alone while the other ranks wait for it, and stop every rank if it fails.

    Rank-0-only work (files, uploads, a metric) followed by a collective let the others wait in that
    collective, under its 30-minute timeout, and a failure on rank 0 left them there (NCCL: until its
    watchdog; issue 23, point 6). Here they wait on a gloo group with MAIN_WORK_TIMEOUT (7 days),
    then learn the outcome: a failure raises on every rank, naming ``what`` and rank 0's message.
    ``work`` must not call collectives. Returns its result on rank 0, and on the others too with
    ``share_result`` (it must pickle), else None there.
    """
    if not context.is_distributed or context.world_size == 1:
        return work()
    outcome: list = [None]
    failure: BaseException | None = None
    result = None
    if context.is_main:
        try:
            result = work()
            outcome = [("done", result if share_result else None)]
        except BaseException as error:  # whatever stops rank 0 must release the others
            failure = error
            outcome = [("failed", _failure_message(error))]
    dist.broadcast_object_list(outcome, src=0, group=_MAIN_WORK_GROUP.get("group"))
    if failure is not None:
        raise failure
    status, value = outcome[0]
    if status == "failed":
        raise WorkflowError(f"rank {context.rank} stops: rank 0 failed while {what}: {value}")
    return result if context.is_main else value


def _failure_message(error: BaseException) -> str:
    return str(error) if isinstance(error, WorkflowError) else f"{type(error).__name__}: {error}"


def gather_on_main(context: DistributedContext, what: str, work: Callable[[], T]) -> list[T] | None:
    """Run ``work`` on every rank and gather its results on rank 0, in rank order (None on the others).

    For work split over the ranks (the validation metric's generation): ranks that finish first wait in
    the gather on the gloo group with MAIN_WORK_TIMEOUT, as :func:`on_main`'s do, not under the collective
    timeout. A failure on any rank raises on every rank, naming ``what``, the rank and its message.
    ``work`` must not call collectives; its result must pickle. A world of one returns ``[work()]``.
    """
    if not context.is_distributed or context.world_size == 1:
        return [work()]
    group = _MAIN_WORK_GROUP.get("group")
    failure: BaseException | None = None
    try:
        outcome = ("done", work())
    except BaseException as error:  # whatever stops this rank must release the others
        failure = error
        outcome = ("failed", _failure_message(error))
    gathered = [None] * context.world_size if context.is_main else None
    dist.gather_object(outcome, gathered, dst=0, group=group)
    failed = [[(rank, value) for rank, (status, value) in enumerate(gathered) if status == "failed"]
              if context.is_main else None]
    dist.broadcast_object_list(failed, src=0, group=group)
    if failure is not None:
        raise failure
    if failed[0]:
        rank, message = failed[0][0]
        raise WorkflowError(f"rank {context.rank} stops: rank {rank} failed while {what}: {message}")
    return [value for _, value in gathered] if context.is_main else None


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
        _MAIN_WORK_GROUP.clear()


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
