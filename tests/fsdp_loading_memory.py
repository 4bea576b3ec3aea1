"""tests/test_fsdp_loading.py's torchrun entry: each rank builds the FSDP training model through
``training_setup.build`` (the train and sanity stages' path) and writes what its memory held while
loading and after, as ``<out>/rank<N>.json``.

Argument order: warm-up model dir, measured model dir, --training JSON, output dir. The warm-up build
(a small model of the same architecture) imports every module and starts the process group first, so
the measured build's peak is the loading's own.

Measured on the CPU (gloo), where model tensors live in this process's resident memory:
- ``peak_rss_increase``: the resident-set high-water mark while building (``VmHWM``, reset through
  ``/proc/self/clear_refs`` just before) minus the resident set before; Linux's own figure;
- ``model_bytes``: the storage this rank's model holds after loading (its local shards, its buffers),
  each storage counted once;
- ``full_bytes``: the whole model's tensors (global shapes), ``largest_layer_bytes`` one decoder layer's;
- ``loading_estimate``: the gate's estimate of the loading peak (memory_estimate.loading_estimate).
"""
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workflow_scripts.core.settings import TrainingSettings  # noqa: E402
from workflow_scripts.model import memory_estimate  # noqa: E402
from workflow_scripts.training import distributed, fsdp, training_setup  # noqa: E402


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise KeyError(field)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def model_bytes(model: torch.nn.Module) -> int:
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor = local(tensor)
        if not tensor.is_meta:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def full_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # a DTensor reports its global shape


def main(warm_dir: str, model_dir: str, training_text: str, out_dir: str) -> None:
    """``training_text``: one training mapping (reports in ``out_dir``), or a list of them, built one after the
    other in the same ranks (reports in ``out_dir/<index>``; only the first build's peak is the loading's own,
    the later ones' start from a resident set the earlier builds grew)."""
    torch.set_num_threads(1)
    parsed = json.loads(training_text)
    runs = ([(TrainingSettings.from_json(json.dumps(item)), Path(out_dir, str(index))) for index, item in enumerate(parsed)]
            if isinstance(parsed, list) else [(TrainingSettings.from_json(training_text), Path(out_dir))])
    context = distributed.setup(use_cuda=False)
    warm = training_setup.build(warm_dir, runs[0][0], context)
    del warm
    for training, out in runs:
        gc.collect()
        out.mkdir(parents=True, exist_ok=True)
        report_loading(model_dir, training, context, out)
    distributed.teardown(context)


def report_loading(model_dir: str, training: TrainingSettings, context, out: Path) -> None:
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    setup = training_setup.build(model_dir, training, context)
    peak = status_bytes("VmHWM")
    model = setup.peft_model
    layers = model.get_base_model().model.layers  # sharded: their class is FSDPLlamaDecoderLayer now
    inv_freq = [b for name, b in model.named_buffers() if name.endswith("rotary_emb.inv_freq")]
    gathered, rng = [None] * context.world_size, [None] * context.world_size
    torch.distributed.all_gather_object(gathered, [b.tolist() for b in inv_freq])
    torch.distributed.all_gather_object(rng, torch.get_rng_state().tolist())
    report = {
        "rank": context.rank, "world_size": context.world_size,
        "sharded": fsdp.is_sharded(model),
        "peak_rss_increase": peak - before,
        "model_bytes": model_bytes(model),
        "full_bytes": full_bytes([*model.parameters(), *model.buffers()]),
        "largest_layer_bytes": max(full_bytes(layer.parameters()) for layer in layers),
        "inv_freq_matches_rank0": gathered[context.rank] == gathered[0] and len(inv_freq) > 0,
        "inv_freq_is_finite": all(bool(torch.isfinite(b).all()) for b in inv_freq),
        "rng_state_matches_rank0": rng[context.rank] == rng[0],
        "loading_estimate": memory_estimate.loading_estimate(model, training, context.device),  # the gate's
    }
    Path(out, f"rank{context.rank}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:5])
