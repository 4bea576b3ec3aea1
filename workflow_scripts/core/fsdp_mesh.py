"""The device mesh FSDP shards over (``training.fsdp_mesh``): its shape, and the refusals at parse time.

``flat``: one dimension over every process of every node; each rank holds 1/world of the model, and
every layer's all-gather and reduce-scatter crosses the network between nodes.
``hybrid`` (HSDP): ``(nodes, ranks per node)`` with dimensions ``("replicate", "shard")``; each node
holds a whole sharded copy (a rank holds 1/ranks-per-node), so the per-layer collectives stay inside a
node and only the gradients' all-reduce over the replicas crosses the network, once per step (PyTorch's
``fully_shard(mesh=2-D)`` docs, "HSDP"; Zhao et al. 2023, PyTorch FSDP, hybrid sharding).

The key has no schema default, so the settings of runs that do not set it stay as they were (Snakemake
reruns nothing). Unset, it resolves here: ``hybrid`` when the job spans several nodes with several
processes each, else ``flat`` (on one node the two are the same mesh).
"""
from __future__ import annotations

from typing import Protocol

from workflow_scripts.core.errors import ConfigError, WorkflowError

MESHES = ("hybrid", "flat")
DIMENSION_NAMES = ("replicate", "shard")


class MeshSettings(Protocol):
    """What this module reads of ``core.settings.TrainingSettings`` (which imports this module)."""
    gpus: int
    cpu_processes: int
    nodes: int
    strategy: str
    fsdp_mesh: str | None

    @property
    def world_size(self) -> int: ...

    @property
    def sharded(self) -> bool: ...


def ranks_per_node(training: MeshSettings) -> int:
    return training.gpus if training.gpus > 0 else training.cpu_processes


def resolved(training: MeshSettings) -> str:
    """``hybrid`` or ``flat``: the setting, or unset, ``hybrid`` for several nodes of several processes."""
    if training.fsdp_mesh is not None:
        return training.fsdp_mesh
    return "hybrid" if training.nodes > 1 and ranks_per_node(training) > 1 else "flat"


def shape(training: MeshSettings) -> tuple[int, ...]:
    """The mesh's shape: ``(world,)`` flat, ``(nodes, ranks per node)`` hybrid over several nodes."""
    if resolved(training) == "hybrid" and training.nodes > 1:
        return (training.nodes, ranks_per_node(training))
    return (training.world_size,)


def shards(training: MeshSettings) -> int:
    """Processes one parameter is split over: the mesh's last dimension under fsdp, else 1 (whole copies)."""
    return shape(training)[-1] if training.sharded else 1


def check(training: MeshSettings, key: str = "training", source: str | None = None) -> None:
    """Parse time (``TrainingSettings.parse``): a mesh setting that cannot mean what it says."""
    if training.fsdp_mesh is None:
        return
    if not training.sharded:
        raise ConfigError(f"{key}.fsdp_mesh", f"'{training.fsdp_mesh}' applies to training.strategy: fsdp only "
                          f"(the strategy is {training.strategy}); remove fsdp_mesh or set strategy: fsdp", source)
    # The shape is (nodes, ranks per node), which always multiplies to the world; what can go wrong is
    # a shard dimension of one.
    if training.fsdp_mesh == "hybrid" and training.nodes > 1:
        shard = ranks_per_node(training)
        if shard == 1:
            raise ConfigError(f"{key}.fsdp_mesh", f"hybrid with one process per node shards nothing: each of the "
                              f"{training.nodes} nodes' single rank would hold the whole model (as ddp). Set "
                              "fsdp_mesh: flat to shard over the nodes, or more gpus per node", source)


def check_launch(training: MeshSettings, local_world_size: int, world_size: int) -> None:
    """Run time: a hybrid mesh's shard groups must be the processes of one node, as torchrun started them
    (ranks of one node are consecutive); else its 'node-local' collectives would cross nodes."""
    mesh = shape(training)
    if len(mesh) == 2 and (world_size != mesh[0] * mesh[1] or local_world_size != mesh[1]):
        raise WorkflowError(
            f"training.fsdp_mesh: hybrid expects {mesh[0]} nodes of {mesh[1]} processes, but this job runs "
            f"{world_size} processes, {local_world_size} on this node; launch through the workflow (one torchrun "
            "per node with training.gpus or cpu_processes processes) or set training.fsdp_mesh: flat")
