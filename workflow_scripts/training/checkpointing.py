"""Atomic, resumable training checkpoints: adapter, optimizer, scheduler, scaler, RNG states, data position.

A checkpoint is a directory ``step-00000050/`` renamed into place only when complete, so a job killed
while writing leaves the previous checkpoint intact. The data position is the step itself: global
batches are a function of (seed, effective batch, step) (see batching.py). A checkpoint written by a
run that learned something else (other settings, data, model or seed) is not resumed and not deleted:
the job stops and names the difference (runtime-only settings such as wall time are not part of it).

The files are the same under DDP and FSDP (full adapter tensors, the optimizer's numbered state_dict;
training/fsdp.py gathers and scatters the shards), so a checkpoint resumes under either
``training.strategy`` and any process count. Under ``training.finetune: full`` (a model without PEFT)
the tensors are the whole model's, every parameter and persistent buffer, in ``model.safetensors``
instead of ``adapter.safetensors``; everything else is the same, and so are the resume guarantees.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from workflow_scripts.core.atomic_output import atomic_path
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.training import fsdp

STEP_DIR = re.compile(r"^step-(\d{8})$")


def rng_state(device: torch.device) -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def restore_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


ADAPTER_FILE, FULL_MODEL_FILE = "adapter.safetensors", "model.safetensors"


def is_full_model(model) -> bool:
    """Fully fine-tuned (training.finetune: full): the model is not PEFT-wrapped."""
    return not hasattr(model, "peft_config")


def weights_file(model) -> str:
    return FULL_MODEL_FILE if is_full_model(model) else ADAPTER_FILE


def _saved_tensors(model) -> dict[str, torch.Tensor]:
    """What a checkpoint holds: the trainable parameters (LoRA); every parameter (tied ones once) and
    persistent buffer (full)."""
    tensors = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if is_full_model(model):
        persistent = set(model.state_dict())
        tensors.update({n: b for n, b in model.named_buffers() if n in persistent})
    return tensors


def trainable_state(peft_model) -> dict[str, torch.Tensor]:
    return {n: t.detach().to("cpu", copy=True).contiguous() for n, t in _saved_tensors(peft_model).items()}


def gather_state(peft_model, optimizer, is_main: bool) -> tuple[dict, dict] | None:
    """(adapter tensors, optimizer state_dict) to save; every rank calls it, as FSDP gathers the shards
    to rank 0 collectively. None on the other ranks of an unsharded model."""
    if fsdp.is_sharded(peft_model):
        return fsdp.gather_adapter(peft_model), fsdp.gather_optimizer(peft_model, optimizer)
    return (trainable_state(peft_model), optimizer.state_dict()) if is_main else None


def checkpoints(checkpoint_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / "state.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def save(checkpoint_dir: str | Path, step: int, peft_model, optimizer, scheduler, scaler,
         rng_states: list[dict], fingerprint: Mapping[str, Any], keep: int = 1,
         extra: Mapping[str, Any] | None = None, state: tuple[dict, dict] | None = None,
         strategy: str = "ddp") -> Path:
    """Write the checkpoint for ``step`` atomically (main rank only), then drop all but the newest ``keep``.

    ``extra``: JSON state of the loop itself (validation's best step so far), read back by :func:`extra_state`.
    ``state``: :func:`gather_state`'s result (required for a sharded model); read from the objects when None.
    """
    if state is None:
        state = gather_state(peft_model, optimizer, is_main=True)
    adapter, optimizer_state = state
    final = Path(checkpoint_dir, f"step-{step:08d}")
    with atomic_path(final, directory=True) as directory:
        save_file(adapter, str(directory / weights_file(peft_model)))
        torch.save(optimizer_state, directory / "optimizer.pt")
        torch.save({
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng_states,
        }, directory / "training_state.pt")
        # state.json is written last: its presence marks a complete checkpoint even on odd file systems.
        (directory / "state.json").write_text(json.dumps(
            {"step": step, "world_size": len(rng_states), "fingerprint": dict(fingerprint), "extra": dict(extra or {}),
             "strategy": strategy},  # for the reader only: any strategy resumes it
            indent=2, sort_keys=True))
    for _, old in checkpoints(checkpoint_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_compatible(checkpoint_dir: str | Path, fingerprint: Mapping[str, Any]) -> Path | None:
    """The newest checkpoint, if it was written under the same fingerprint.

    A checkpoint from a run that learned something else is never deleted here (it may be days of
    work): the job stops and names the differing keys, and the user decides.
    """
    found = checkpoints(checkpoint_dir)
    if not found:
        return None
    step, path = found[-1]
    state = json.loads((path / "state.json").read_text())
    theirs = state.get("fingerprint", {})
    if theirs != dict(fingerprint):
        differing = differing_keys(theirs, fingerprint)
        raise WorkflowError(
            f"{path}: this checkpoint (step {step}) was written by a run with different {', '.join(differing)}; "
            "resuming it would mix two experiments. Fix: restore those settings to resume, or move or delete "
            f"{Path(checkpoint_dir)} to train afresh"
        )
    return path


def differing_keys(ours: Mapping[str, Any], theirs: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ (nested mappings compared key by key)."""
    differing = []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            differing += differing_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            differing.append(f"{prefix}{key}")
    return differing


def load(path: str | Path, peft_model, optimizer, scheduler, scaler, rank: int, device: torch.device,
         log=print) -> int:
    """Restore a checkpoint into the built objects; returns the number of completed steps.

    Every rank calls it; a sharded (FSDP) model takes its shards of the full tensors collectively.
    """
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    name = weights_file(peft_model)
    if not (path / name).is_file():
        other = {ADAPTER_FILE: "a LoRA run's adapter", FULL_MODEL_FILE: "a fully fine-tuned run's model"}
        raise WorkflowError(f"{path}: holds {other[ADAPTER_FILE if name == FULL_MODEL_FILE else FULL_MODEL_FILE]}, "
                            f"not {name} as training.finetune now needs; move or delete {path.parent} to train afresh")
    adapter = load_file(str(path / name))
    params = _saved_tensors(peft_model)
    if set(adapter) != set(params):
        raise WorkflowError(f"{path}: its {name} tensors do not match the model's trainable parameters; "
                            "delete the checkpoint directory to start afresh")
    optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if fsdp.is_sharded(peft_model):
        fsdp.restore(peft_model, optimizer, adapter, optimizer_state)
    else:
        with torch.no_grad():
            for name, tensor in adapter.items():
                params[name].copy_(tensor)
        optimizer.load_state_dict(optimizer_state)
    training_state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(training_state["scheduler"])
    if scaler is not None and training_state["scaler"] is not None:
        scaler.load_state_dict(training_state["scaler"])
    rng = training_state["rng"]
    if rank < len(rng):
        restore_rng_state(rng[rank], device)
    else:
        log(f"{path}: written by {len(rng)} processes; rank {rank} keeps its own RNG state "
            "(dropout masks do not depend on it: each micro-batch is seeded from its step and index)")
    return int(state["step"])


def extra_state(path: str | Path) -> dict[str, Any]:
    """The loop state a checkpoint carries beside the tensors (``save(..., extra=)``)."""
    return json.loads(Path(path, "state.json").read_text()).get("extra", {})


def clear(checkpoint_dir: str | Path) -> None:
    """After a finished run: nothing is left to resume, so a forced rerun trains afresh."""
    for _, path in checkpoints(checkpoint_dir):
        shutil.rmtree(path, ignore_errors=True)
