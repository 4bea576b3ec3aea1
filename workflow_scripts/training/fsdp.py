"""FSDP2 (``training.strategy: fsdp``): the frozen base and the adapters sharded over the processes.

``torch.distributed.fsdp.fully_shard`` turns each decoder layer, then the PEFT model as the root, into
per-parameter DTensors sharded over the world: a process holds 1/N of the base weights and gathers one
layer at a time for compute. On several nodes the mesh is hybrid by default (``training.fsdp_mesh``,
core/fsdp_mesh.py): sharded over a node's ranks and replicated over the nodes (HSDP), so a rank holds
1/(ranks per node) and only the gradients' all-reduce between replicas crosses the network. FSDP2
shards each parameter on its own, so the frozen base and the trainable LoRA tensors share a layer's
unit; only the trainable ones get gradients (reduce-scattered, and all-reduced over the replicas of a
hybrid mesh, averaged over all ranks as DDP averages them, so the loop's loss scaling is the same).

Loading (issue 23): no process holds the whole model on its device. Rank 0 reads the weights into host
memory (``loading_device``), the other ranks build the same architecture on the meta device; every rank
shards, and ``set_model_state_dict(..., broadcast_from_rank0=True)`` sends rank 0's tensors one at a
time, each rank keeping its shard (on a hybrid mesh, every node's ranks take theirs from rank 0). A
device then holds its shard plus one unit (rank 0's before ``fully_shard`` shards it, or the one tensor
being broadcast); rank 0 alone holds the whole model, on the host.

State leaves this module as full tensors under the PEFT model's own parameter names, gathered to rank 0
(``get_model_state_dict(..., full_state_dict=True, cpu_offload=True)``): the adapter then goes through
PEFT's ``save_pretrained``, and a checkpoint holds exactly what an unsharded run's holds (adapter
tensors, the optimizer's ``state_dict`` numbered as ``torch.optim`` numbers it). The trainable state of
LoRA is small (adapters and two Adam moments, no base weights), so gathering it costs little, and a
checkpoint resumes under either strategy and any process count.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from workflow_scripts.core import fsdp_mesh
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.settings import TrainingSettings, sharding_problem
from workflow_scripts.training import distributed
from workflow_scripts.training.distributed import DistributedContext

STRATEGIES = ("ddp", "fsdp")


def refusal(reason: str, fix: str) -> WorkflowError:
    return WorkflowError(f"training.strategy: fsdp {reason}. Fix: {fix}, or set training.strategy: ddp")


def check_settings(training: TrainingSettings, task_name: str) -> None:
    """What FSDP2 cannot run here, refused before anything is sharded (core/settings.sharding_problem, which the
    config check refuses already when the workflow is read)."""
    problem = sharding_problem(training, task_name)
    if problem is not None:
        _, reason, fix = problem
        raise refusal(reason, fix)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules in a ``ModuleList`` whose class is one of the model's
    ``_no_split_modules`` (what transformers and accelerate treat as indivisible blocks)."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [child for module in model.modules() if isinstance(module, nn.ModuleList)
              for child in module if type(child).__name__ in block_names]
    if not layers:
        raise refusal(f"cannot find the decoder layers of {type(model).__name__} (no module listed in its "
                      f"_no_split_modules {sorted(block_names)} sits in a layer list)", "use a transformers "
                      "model that declares its decoder layer class")
    return layers


def mixed_precision(precision: str):
    """Compute in bf16 with the fp32 master weights kept sharded; gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def loading_device(context: DistributedContext) -> torch.device:
    """Where this rank builds the model before :func:`shard`: rank 0 reads the weights into host memory,
    the others build on the meta device (shapes, no storage) and receive rank 0's values at sharding."""
    return torch.device("cpu") if context.rank == 0 else torch.device("meta")


def shard(peft_model: nn.Module, training: TrainingSettings, context: DistributedContext, task_name: str) -> None:
    """Shard each decoder layer, then the PEFT model (the root: embeddings, final norm, head), in place,
    and fill every rank's shards with rank 0's weights (built on :func:`loading_device`).

    Done before the optimizer is built: it must hold the sharded parameters. A world of one still gets
    a process group (FSDP needs one), started here and ended by distributed.teardown.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_settings(training, task_name)
    layers = decoder_layers(peft_model.get_base_model())
    distributed.ensure_process_group(context)
    fsdp_mesh.check_launch(training, context.local_world_size, context.world_size)
    shape = fsdp_mesh.shape(training)
    if len(shape) == 1:  # flat: over the processes that run (a world of one for the gate's in-process probe)
        shape = (context.world_size,)
    # Hybrid (HSDP): FSDP shards over the last dimension (a node's ranks) and replicates over the first.
    mesh = init_device_mesh(context.device.type, shape,
                            mesh_dim_names=fsdp_mesh.DIMENSION_NAMES if len(shape) == 2 else None)
    policy = mixed_precision(training.precision)
    # Rank 0's full tensors (host memory), the base weights and the freshly drawn adapters, taken before
    # fully_shard replaces each parameter by its shard (on a GPU it moves one unit there at a time).
    # A world of one has its values in place already: nothing to send, and no second copy is kept.
    sends = context.world_size > 1
    full_state = peft_model.state_dict() if sends and context.rank == 0 else {}
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(peft_model, mesh=mesh, mp_policy=policy)
    if sends:
        load_from_rank0(peft_model, full_state, context)


def load_from_rank0(peft_model: nn.Module, full_state: dict[str, torch.Tensor], context: DistributedContext) -> None:
    """Collective: rank 0's ``full_state`` (``{}`` on the other ranks) into every rank's shards, then what
    no state dict carries: the non-persistent buffers and the CPU random-number state."""
    import itertools

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in itertools.chain(peft_model.parameters(), peft_model.buffers())):
        # Storage for this rank's shards (and its whole buffers) on its device; the values follow.
        peft_model.to_empty(device=context.device)
    # One tensor at a time from rank 0, each rank keeping the slice of its shard.
    set_model_state_dict(peft_model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Written by hand: non-persistent buffers (RoPE's inv_freq) are in no state dict, so the call above
    # leaves them empty on the meta-built ranks. FSDP keeps buffers whole: rank 0's are broadcast.
    persistent = set(peft_model.state_dict())
    for name, buffer in peft_model.named_buffers():
        if name not in persistent:
            dist.broadcast(buffer, src=0)
    # Rank 0 drew the adapters' initial values from the CPU generator, the meta-built ranks drew nothing:
    # every rank continues from rank 0's state, as when each rank built the model alike.
    rng = [torch.get_rng_state() if context.rank == 0 else None]
    dist.broadcast_object_list(rng, src=0)
    torch.set_rng_state(rng[0])


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _full_options(**overrides):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # The frozen base is never saved: it is read again from the model directory.
    return StateDictOptions(full_state_dict=True, ignore_frozen_params=True, **overrides)


def gather_adapter(peft_model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Every rank calls it (collective): the full trainable tensors on CPU, on rank 0 (``{}`` elsewhere).

    None for an unsharded model, whose own tensors PEFT reads directly.
    """
    if not is_sharded(peft_model):
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(peft_model, options=_full_options(cpu_offload=True))
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _parameter_names(peft_model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The optimizer's parameters by name, in the order ``optimizer.state_dict()`` numbers them."""
    names = {id(p): n for n, p in peft_model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_optimizer(peft_model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: the full optimizer state on rank 0, numbered as an unsharded ``optimizer.state_dict()``."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(peft_model, optimizer, options=_full_options(cpu_offload=True))
    if not state:  # ranks other than 0
        return {}
    index = {name: i for i, name in enumerate(_parameter_names(peft_model, optimizer))}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in state["param_groups"]],
    }


def restore(peft_model: nn.Module, optimizer: torch.optim.Optimizer, adapter: Mapping[str, torch.Tensor],
            optimizer_state: Mapping[str, Any]) -> None:
    """Collective: full adapter tensors and a numbered optimizer state (every rank holds them, read from
    the checkpoint) scattered into this rank's shards."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    result = set_model_state_dict(peft_model, dict(adapter), options=_full_options(strict=False))
    if result.unexpected_keys:
        raise WorkflowError(f"the checkpoint holds tensors the model lacks: {sorted(result.unexpected_keys)[:4]}")
    names = _parameter_names(peft_model, optimizer)
    named = {
        "state": {names[int(i)]: value for i, value in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                         for group in optimizer_state["param_groups"]],
    }
    set_optimizer_state_dict(peft_model, optimizer, named, options=_full_options())
