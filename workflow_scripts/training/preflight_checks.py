"""The gate's checks: small functions that raise ``PreflightError("<check>: <cause>. Fix: <fix>")``.

``sanity`` runs all of them on a few real batches; ``train`` runs the cheap ones again at start-up
(the set-up could differ from the gate's if the machine did). Each check returns a short detail string
for the report when it passes.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn

from workflow_scripts.core.errors import PreflightError, WorkflowError
from workflow_scripts.core.errors import few_names as _names
from workflow_scripts.model import memory_estimate
from workflow_scripts.model.parameter_names import lora_parameters, named_parameters, strip_wrapper_prefix, unwrap

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import VariantSettings
    from workflow_scripts.core.settings import TrainingSettings


def is_full(model: nn.Module) -> bool:
    """training.finetune: full: the model under the loss module (and DDP) is not PEFT-wrapped."""
    return not hasattr(unwrap(model), "peft_config")


# 1. trainable parameters ---------------------------------------------------------------------------
def check_trainable(model: nn.Module) -> str:
    params = named_parameters(model)
    trainable = [n for n, p in params.items() if p.requires_grad]
    if is_full(model):
        frozen = [n for n, p in params.items() if not p.requires_grad]
        if frozen:
            raise PreflightError(
                "trainable_parameters", f"training.finetune is full but {len(frozen)} of {len(params)} parameters "
                f"have requires_grad=False ({_names(frozen)})",
                "freeze nothing under full fine-tuning (every weight must train), or use training.finetune: lora")
        count = sum(p.numel() for p in params.values())
        return f"all {len(params)} parameter tensors trainable ({count} parameters, full fine-tuning)"
    if not trainable:
        raise PreflightError("trainable_parameters", "the model has no trainable parameters",
                             "check training.lora.target_modules match the model's linear layers and that "
                             "nothing freezes parameters after PEFT adds the adapters")
    lora = lora_parameters(model)
    if not lora:
        raise PreflightError("trainable_parameters", "no LoRA parameters were found in the model",
                             "set training.lora.target_modules to module names the model has")
    frozen = [n for n, p in lora.items() if not p.requires_grad]
    if frozen:
        raise PreflightError(
            "trainable_parameters",
            f"{len(frozen)} LoRA parameters have requires_grad=False ({_names(frozen)})",
            "freeze base-model parts before PEFT adds adapters, never after (a module frozen afterwards "
            "takes its adapters with it)",
        )
    count = sum(params[n].numel() for n in trainable)
    return f"{len(trainable)} trainable tensors, {count} parameters, all LoRA parameters trainable"


# 2. gradients after one backward -------------------------------------------------------------------
def check_full_gradients(model: nn.Module) -> str:
    """training.finetune: full: EVERY parameter got a finite gradient that is not all zero."""
    params = named_parameters(model)
    missing = [n for n, p in params.items() if p.grad is None]
    if missing:
        raise PreflightError(
            "gradients", f"{len(missing)} of {len(params)} parameters got no gradient after backward ({_names(missing)})",
            "every weight must lie on the path to the loss and stay trainable under full fine-tuning: do not freeze "
            "or detach them (use training.finetune: lora to train part of a model)")
    non_finite = [n for n, p in params.items() if not torch.isfinite(p.grad).all()]
    if non_finite:
        raise PreflightError("gradients", f"NaN/Inf gradients in {_names(non_finite)}",
                             "lower training.learning_rate, check the data for corrupt rows, or use bf16 instead of fp16")
    zero = [n for n, p in params.items() if not p.grad.any()]
    if zero:
        raise PreflightError(
            "gradients", f"{len(zero)} of {len(params)} parameters have all-zero gradients ({_names(zero)})",
            "check that those weights lie on the path to the loss (an unused module trains nothing) and that the "
            "targets are not all masked")
    norm = math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in params.values()))
    return f"all {len(params)} parameter tensors have finite, non-zero gradients (norm {norm:.4g})"


def check_gradients(model: nn.Module) -> str:
    if is_full(model):
        return check_full_gradients(model)
    lora = lora_parameters(model)
    missing = [n for n, p in lora.items() if p.grad is None]
    if missing:
        raise PreflightError(
            "gradients",
            f"{len(missing)} of {len(lora)} LoRA parameters got no gradient after backward ({_names(missing)})",
            "make sure the loss is not detached before backward (no .detach()/.item()/torch.no_grad "
            "around the forward) and that gradient checkpointing is non-reentrant "
            "(use_reentrant=False) with input gradients enabled",
        )
    non_finite = [n for n, p in named_parameters(model).items()
                  if p.grad is not None and not torch.isfinite(p.grad).all()]
    if non_finite:
        raise PreflightError("gradients", f"NaN/Inf gradients in {_names(non_finite)}",
                             "lower training.learning_rate, check the data for corrupt rows, or use bf16 instead of fp16")
    # lora_B starts at zero, so lora_A's gradient is zero on the first step by design; lora_B's must not be.
    zero = [n for n, p in lora.items() if "lora_B" in n and not p.grad.any()]
    if zero:
        raise PreflightError(
            "gradients", f"{len(zero)} LoRA parameters have all-zero gradients ({_names(zero)})",
            "check that the targets are not all masked and that the adapted layers lie on the path to the loss",
        )
    norm = math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in lora.values()))
    return f"{len(lora)} LoRA parameters have finite, non-zero gradients (norm {norm:.4g})"


# 3. placement --------------------------------------------------------------------------------------
def check_placement(model: nn.Module, device: torch.device) -> str:
    tensors = list(named_parameters(model).items()) + [
        (strip_wrapper_prefix(n), b) for n, b in model.named_buffers()
    ]
    meta = [n for n, t in tensors if t.device.type == "meta"]
    if meta:
        raise PreflightError(
            "placement", f"{len(meta)} tensors are on the meta device ({_names(meta)})",
            "load the model without device_map or CPU offload (offloaded weights break gradient checkpointing)",
        )
    devices = {str(t.device) for _, t in tensors}
    if len(devices) > 1:
        raise PreflightError(
            "placement", f"one process holds the model on several devices {sorted(devices)}",
            "never use device_map='auto' for training; each process loads the whole model onto its own device",
        )
    (only,) = devices
    if torch.device(only) != device and not (device.type == "cuda" and torch.device(only).index is None):
        raise PreflightError("placement", f"the model is on {only}, this process's device is {device}",
                             "load onto the local rank's device (cuda:LOCAL_RANK)")
    return f"all {len(tensors)} tensors on {only}"


# 4. name lookups with and without DDP --------------------------------------------------------------
def check_name_lookup(model: nn.Module) -> str:
    inner = unwrap(model)
    full = is_full(model)  # full fine-tuning: every parameter is looked up by name (checkpoints, the gate)
    expected = {n for n, _ in inner.named_parameters() if full or "lora_" in n}
    found = named_parameters(model) if full else lora_parameters(model)
    if set(found) != expected:
        raise PreflightError(
            "name_lookup",
            f"looking parameters up by name on the {type(model).__name__} finds {len(set(found) & expected)} of "
            f"{len(expected)} {'' if full else 'LoRA '}parameters (names seen: {_names(found)})",
            "strip DDP's 'module.' prefix before matching names (parameter_names.named_parameters does)",
        )
    by_name = dict(inner.named_parameters())
    wrong = [n for n, p in found.items() if by_name[n] is not p]
    if wrong:
        raise PreflightError("name_lookup", f"names resolve to different tensors: {_names(wrong)}",
                             "look parameters up on the unwrapped PEFT model")
    return f"{len(found)} {'' if full else 'LoRA '}parameters found by name through {type(model).__name__}"


# 5. precision --------------------------------------------------------------------------------------
def check_precision(precision: str, device: torch.device, scaler, bf16_supported: Callable[[torch.device], bool]) -> str:
    if precision == "bf16" and not bf16_supported(device):
        raise PreflightError("precision", f"training.precision is bf16 but {device} has no bf16 support",
                             "set training.precision: fp16 (with loss scaling) or fp32, or use an Ampere-or-newer GPU")
    if precision == "fp16" and scaler is None:
        raise PreflightError("precision", "fp16 training without a gradient scaler underflows small gradients to zero",
                             "use torch.amp.GradScaler with fp16, or train in bf16")
    if precision != "fp16" and scaler is not None:
        raise PreflightError("precision", f"a gradient scaler is active with {precision}",
                             "use a GradScaler only with fp16")
    return f"{precision} on {device}" + (" with a gradient scaler" if scaler is not None else "")


MIN_LOSS_SCALE = 1.0


def check_scaler_scale(scaler, initial_scale: float) -> str:
    scale = float(scaler.get_scale())
    if scale < MIN_LOSS_SCALE:
        raise PreflightError(
            "precision", f"the fp16 loss scale collapsed from {initial_scale:g} to {scale:g}: gradients overflow "
            "at every step", "train in bf16 or fp32, or lower training.learning_rate",
        )
    return f"fp16 loss scale {scale:g}"


# 6. memory -----------------------------------------------------------------------------------------
def check_memory(parts: Mapping[str, int], capacity: int, headroom: float, training: TrainingSettings,
                 device: torch.device, loading: Mapping[str, int] | None = None) -> str:
    """The loop's estimated peak (``parts``) and, under FSDP, the loading's (``loading``,
    memory_estimate.loading_estimate) against ``headroom`` of ``capacity``; the refusal names the larger."""
    budget = int(capacity * headroom)
    human = memory_estimate.human
    summary = ", ".join(f"{k} {human(v)}" for k, v in parts.items() if k != "total")
    if loading is not None and loading["total"] > budget and loading["total"] > parts["total"]:
        loaded = ", ".join(f"{k} {human(v)}" for k, v in loading.items() if k != "total")
        raise PreflightError(
            "memory",
            f"the estimated loading peak {human(loading['total'])} (FSDP's loading from rank 0: {loaded}) "
            f"exceeds {headroom:.0%} of {device}'s {human(capacity)}",
            memory_estimate.loading_advice(loading, training),
        )
    if parts["total"] > budget:
        raise PreflightError(
            "memory",
            f"the estimated peak {human(parts['total'])} ({summary}) exceeds {headroom:.0%} of {device}'s "
            f"{human(capacity)}",
            memory_estimate.knob_advice(parts, training, device),
        )
    loaded = "" if loading is None else f"; loading peak {human(loading['total'])}"
    return f"estimate {human(parts['total'])} of {human(budget)} allowed ({summary}){loaded}"


# 7. device count -----------------------------------------------------------------------------------
def check_device_count(declared_gpus: int, visible_gpus: int, local_world_size: int, world_size: int,
                       expected_world_size: int) -> str:
    if declared_gpus > 0 and visible_gpus != declared_gpus:
        raise PreflightError(
            "device_count",
            f"the job declared gpus={declared_gpus} but this process sees {visible_gpus} GPUs",
            "give the job exactly its GPUs: one task with all of them (SLURM: tasks_per_gpu=0 so the plugin "
            "does not start one task per GPU), and a CUDA_VISIBLE_DEVICES set of that size",
        )
    per_node = declared_gpus if declared_gpus > 0 else None
    if world_size != expected_world_size or (per_node is not None and local_world_size != per_node):
        raise PreflightError(
            "device_count",
            f"the job runs {world_size} processes ({local_world_size} on this node) but its config implies "
            f"{expected_world_size}" + (f" ({per_node} per node)" if per_node else ""),
            "launch through the workflow (one torchrun with one process per declared GPU), not several "
            "independent tasks",
        )
    return f"{world_size} processes, {visible_gpus} visible GPUs, {declared_gpus} declared per node"


# 8. data -------------------------------------------------------------------------------------------
def check_batch(batch: Mapping[str, Any], device: torch.device, vocab_size: int) -> str:
    input_ids, labels = batch["input_ids"], batch["labels"]
    rows = batch.get("row_ids") or []
    if input_ids.numel() == 0 or input_ids.shape[0] == 0:
        raise PreflightError("data", "an empty batch reached the model", "check the training split is not empty")
    wrong = {k: str(v.device) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device != device}
    if wrong:
        raise PreflightError("data", f"batch tensors {wrong} are not on the model's device {device}",
                             "move each batch to the process's device before the forward pass")
    if not (labels != -100).any():
        raise PreflightError("data", f"every label in the batch is masked (rows {rows})",
                             "check the variant's target template and that max_length leaves room for the target")
    high = int(input_ids.max())
    if high >= vocab_size or int(input_ids.min()) < 0:
        raise PreflightError("data", f"token id {high} is outside the model's vocabulary of {vocab_size} (rows {rows})",
                             "re-tokenise the data with this model's tokenizer")
    return f"{input_ids.shape[0]} rows x {input_ids.shape[1]} tokens"


def check_chat_prompt(task, tokenizer, recorded: Mapping[str, Any] | None) -> str | None:
    """A variant rendered through the tokenizer's chat template still shows the prompt's own text.

    A template can drop the user's content without an error: VLM templates (SmolVLM/Idefics3, llava-1.5-hf)
    read ``content`` as a list of typed parts and render a plain string as nothing, so the model would be
    trained and scored without its question. The task's ``render_prompt(tokenizer, variant, row)`` renders
    a probe row whose fields hold distinct texts. ``recorded``: the variant as pretokenise recorded it
    (``tokenise_meta.json`` ``templates``), typed here. None when the task or variant uses no chat template.
    """
    from workflow_scripts.tasks import templates

    if recorded is None:
        return None
    if hasattr(task, "dropped_chat_turn"):  # conversation: always rendered through the chat template
        return _check_chat_turns(task, tokenizer, _typed_variant(task, recorded))
    render = getattr(task, "render_prompt", None)
    if render is None or not recorded:
        return None
    variant = _typed_variant(task, recorded)
    if not variant.chat_template:
        return None
    missing = templates.missing_prompt_text(render, tokenizer, variant)
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    if missing is not None:
        text, rendered = missing
        raise PreflightError(
            "chat_prompt", f"the chat template of {name} renders the variant's prompt {text!r} as {rendered!r}, "
            "without the prompt's own text (a template that reads typed content parts renders plain-string "
            "content as nothing)", "use a model whose chat template renders the user's content, or set the "
            "variant's chat_template: false")
    return f"the chat template of {name} keeps the prompt's text ({task.name}, probe row)"


def _typed_variant(task, recorded: Mapping[str, Any]) -> "VariantSettings":
    from workflow_scripts.core.entry_settings import VariantSettings

    return task.check_variant(VariantSettings.from_record(dict(recorded), task.name))


def _check_chat_turns(task, tokenizer, variant: "VariantSettings") -> str | None:
    """A task whose rows are conversations: its ``dropped_chat_turn(tokenizer, variant)`` renders a probe
    conversation as the variant shows it; refused when a turn's content (e.g. the variant's system prompt)
    is not in the rendering."""
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    try:
        dropped = task.dropped_chat_turn(tokenizer, variant)
    except WorkflowError as error:
        raise PreflightError("chat_prompt", str(error), "use a model whose chat template renders every turn, or "
                             "change the variant's system_prompt") from None
    if dropped is not None:
        what, rendered = dropped
        raise PreflightError(
            "chat_prompt", f"the chat template of {name} renders the probe conversation of variant {task.variant_record(variant)} as "
            f"{rendered!r}, without {what}, so the model would be trained and scored without it",
            "use a model whose chat template renders every turn's content (a template without a system role "
            "needs the variant's system_prompt: false)")
    return f"the chat template of {name} renders every turn ({task.name}, probe conversation of variant {task.variant_record(variant)})"


def check_train_mode(model: nn.Module) -> str:
    inner = unwrap(model)
    off = [n for n, m in inner.named_modules() if not m.training]
    if not model.training or off:
        raise PreflightError("data", f"the model is in eval mode ({_names(off) or 'top level'})",
                             "call model.train() before training (dropout is otherwise off)")
    return "model in train mode"


def scan_dataset(dataset, vocab_size: int, chunk_rows: int = 50_000) -> str:
    """Whole-split data check on the Arrow columns: token ids in range, some target in every row."""
    import numpy as np
    import pyarrow.compute as pc

    table = dataset.table.data.table if hasattr(dataset.table.data, "table") else dataset.table.data
    ids_column, id_column = table.column("input_ids"), table.column("id")
    # Per-token labels (generation) must leave a target in every row; a per-row class label always is one.
    labels_column = table.column("labels") if "labels" in table.column_names else None
    if table.num_rows == 0:
        raise PreflightError("data", f"{dataset.data_dir}/{dataset.split} has no rows", "check the pretokenise report")
    for start in range(0, table.num_rows, chunk_rows):
        ids = ids_column.slice(start, chunk_rows).combine_chunks()
        flat = ids.flatten()
        if len(flat):
            high, low = pc.max(flat).as_py(), pc.min(flat).as_py()
            if high >= vocab_size or low < 0:
                lengths = np.asarray(pc.list_value_length(ids))
                parents = np.repeat(np.arange(len(ids)), lengths)
                values = flat.to_numpy()
                row = start + int(parents[(values >= vocab_size) | (values < 0)][0])
                raise PreflightError(
                    "data", f"row {row} (id '{id_column[row].as_py()}') has token id "
                    f"{high if high >= vocab_size else low} outside the model's vocabulary of {vocab_size}",
                    "re-tokenise the data with this model's tokenizer (rerun pretokenise)",
                )
        if labels_column is None:
            continue
        labels = labels_column.slice(start, chunk_rows).combine_chunks()
        lengths = np.asarray(pc.list_value_length(labels))
        values = labels.flatten().to_numpy()
        parents = np.repeat(np.arange(len(labels)), lengths)
        targets = np.bincount(parents[values != -100], minlength=len(labels))
        empty = np.flatnonzero(targets == 0)
        if len(empty):
            row = start + int(empty[0])
            raise PreflightError(
                "data", f"{len(empty)} rows have every label masked, first row {row} (id '{id_column[row].as_py()}')",
                "rerun pretokenise (it drops such rows) or raise max_length so the target survives truncation",
            )
    return f"{table.num_rows} rows: token ids within the vocabulary, every row has a target"
