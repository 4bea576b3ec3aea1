"""Loading the base model, its tokenizer and LoRA adapters — one code path for sanity, train and evaluate.

Placement rule (seeds: meta tensors with CPU offload, ``device_map="auto"`` under DDP): the whole
model is materialised on exactly one device per process. No ``device_map`` is ever passed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from workflow_scripts.core.errors import WorkflowError

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def weights_dtype(precision: str, device: torch.device) -> torch.dtype:
    """Frozen base weights are stored in bf16 on GPUs when training in bf16; fp32 otherwise.

    fp16 keeps fp32 master weights (autocast + GradScaler), and CPU runs stay fp32 for exactness.
    """
    if precision == "bf16" and device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    if not getattr(tokenizer, "is_fast", False):
        raise WorkflowError(f"{model_dir}: the tokenizer is not a fast tokenizer; batched pre-tokenisation needs one")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    auto_class: str = "AutoModelForCausalLM",
    model_kwargs: Mapping[str, Any] | None = None,
):
    """Load the model fully onto ``device`` (never a device map, never offload).

    ``auto_class`` is the task's transformers Auto class (``tasks.base.Task.auto_model_class``);
    ``model_kwargs`` the task's extra ``from_pretrained`` arguments (a classifier's labels).
    """
    import transformers

    if not Path(model_dir, "config.json").exists():
        raise WorkflowError(f"{model_dir}: no config.json; run the prepare_model rule first")
    model = getattr(transformers, auto_class).from_pretrained(
        str(model_dir), dtype=dtype, trust_remote_code=trust_remote_code, low_cpu_mem_usage=False,
        **dict(model_kwargs or {}),
    )
    return model.to(device)


def add_lora(model, lora: Mapping[str, Any], gradient_checkpointing: bool, task_type: str | None = "CAUSAL_LM"):
    """Wrap ``model`` with fresh LoRA adapters; the base stays frozen, adapters are trainable.

    PEFT is applied *after* any freezing (seed: a tower frozen after adapters were added left them
    frozen); non-reentrant checkpointing plus input gradients keeps gradients flowing to adapters
    when the embeddings are frozen.
    """
    from peft import LoraConfig, get_peft_model

    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    check_module_names(model, "modules_to_save", lora.get("modules_to_save", []))
    check_module_names(model, "target_modules", lora["target_modules"])
    config = LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=list(lora["target_modules"]),
        modules_to_save=list(lora.get("modules_to_save", [])) or None,
        task_type=task_type,
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as error:
        raise WorkflowError(f"training.lora.target_modules {list(lora['target_modules'])}: {error}") from None
    keep_trainable_in_fp32(peft_model)
    return peft_model


def check_module_names(model, key: str, names) -> None:
    """Each ``target_modules`` / ``modules_to_save`` entry must name a module of this model.

    PEFT matches an entry against the end of module names and skips one that matches nothing without
    a word, so a typo would train fewer adapters (or leave a head frozen and unsaved) in silence.
    """
    import difflib

    modules = [name for name, _ in model.named_modules() if name]
    for entry in names:
        if not any(name == entry or name.endswith("." + entry) for name in modules):
            close = difflib.get_close_matches(entry, sorted({m.rsplit(".", 1)[-1] for m in modules}), n=3)
            raise WorkflowError(f"training.lora.{key}: '{entry}' matches no module of this model "
                                f"(closest: {close}); fix the name or remove it")


def keep_trainable_in_fp32(model) -> None:
    """Every trainable tensor in fp32; autocast still computes in bf16/fp16.

    PEFT upcasts LoRA A/B but not ``modules_to_save`` copies (an ``lm_head`` listed there stays bf16
    when the base is bf16), and a bf16 weight loses most updates at typical learning rates: an update
    below half a bf16 ulp (2^-8 relative) rounds to nothing.
    """
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()


def load_with_adapter(model_dir: str | Path, adapter_dir: str | Path | None, device: torch.device,
                      dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                      auto_class: str = "AutoModelForCausalLM", model_kwargs: Mapping[str, Any] | None = None):
    """Base model plus a trained adapter (or the bare base model when ``adapter_dir`` is None), in eval mode."""
    model = load_base_model(model_dir, device, dtype, trust_remote_code, auto_class, model_kwargs)
    if adapter_dir is not None:
        from peft import PeftModel

        if not Path(adapter_dir, "adapter_config.json").exists():
            raise WorkflowError(f"{adapter_dir}: no adapter_config.json; is this a PEFT adapter directory?")
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()
