"""QLoRA: the frozen base weights quantised by bitsandbytes (through transformers), LoRA trained on top.

``training.quantization: {bits: 4 | 8, type: nf4 | fp4, double_quant: true, compute_dtype: bf16 | fp16 | fp32}``
(null: off; checked and defaulted in core.settings). Loading gets a ``BitsAndBytesConfig`` through ``load_base_model``'s ``model_kwargs``; the loaded
model is prepared with PEFT's ``prepare_model_for_kbit_training`` (everything frozen, the unquantised
weights - embeddings, norms, lm_head - upcast to fp32); ``model_loading.add_lora`` then turns on
non-reentrant checkpointing with input gradients as for any model. Adapters are saved as plain PEFT
adapters, so evaluation loads them onto the unquantised base.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.settings import LoraSettings, QuantizationSettings, TrainingSettings

KEY = "training.quantization"
INSTALL = "pip install bitsandbytes"
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# PEFT trains these heads whole on its own for sequence classification (PeftModelForSequenceClassification).
SEQ_CLS_HEADS = ("classifier", "score")


def compute_dtype(quantization: QuantizationSettings, precision: str) -> torch.dtype:
    """The dtype 4-bit layers dequantise to for their matmuls; by default the training precision's."""
    return COMPUTE_DTYPES[quantization.compute_dtype or precision]


def require_bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as error:  # also raised by a bitsandbytes build without a backend for this machine
        raise WorkflowError(f"{KEY} is set but bitsandbytes cannot be imported ({error}). "
                            f"Fix: {INSTALL} (or set {KEY}: null)") from None
    return bitsandbytes


def from_pretrained_kwargs(training: TrainingSettings, device: torch.device) -> dict[str, Any]:
    """Extra ``from_pretrained`` arguments: ``{}`` when off, else the ``quantization_config``.

    The device map names this process's one device: without it transformers' bitsandbytes quantizer
    picks the current CUDA device, even for a CPU run on a machine with a GPU. Still one device per
    process, as model_loading requires (its ``.to(device)`` afterwards is then a no-op).
    """
    quantization = training.quantization
    if quantization is None:
        return {}
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if quantization.bits == 8:
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quantization.type,
            bnb_4bit_use_double_quant=quantization.double_quant,
            bnb_4bit_compute_dtype=compute_dtype(quantization, training.precision),
        )
    return {"quantization_config": config, "device_map": {"": str(device)}}


def quantized_modules(model: nn.Module) -> list[str]:
    """Names of the modules whose weight bitsandbytes stores quantised."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return []
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return [name for name, module in model.named_modules() if isinstance(module, kinds)]


def _matching(names: Sequence[str], entry: str) -> list[str]:
    return [name for name in names if name == entry or name.endswith("." + entry) or name.startswith(entry + ".")
            or ("." + entry + ".") in name]


def prepare(model: nn.Module, training: TrainingSettings, lora: LoraSettings, peft_task_type: str | None):
    """Make a quantised base ready for adapters (a no-op when quantization is off).

    Refuses whole-module training of quantised modules (``lora.modules_to_save``, a classifier head):
    a 4/8-bit integer weight cannot take gradients, and PEFT's error would not say which setting to change.
    """
    if training.quantization is None:
        return model
    quantized = quantized_modules(model)
    if not quantized:
        raise WorkflowError(f"{KEY}: bitsandbytes quantised no layer of {type(model).__name__} (it has no "
                            f"nn.Linear layers it converts). Fix: set {KEY}: null for this model")
    listed = list(lora.modules_to_save)
    heads = [head for head in SEQ_CLS_HEADS if head not in listed] if peft_task_type == "SEQ_CLS" else []
    for entry in listed + heads:
        hit = _matching(quantized, entry)
        if not hit:
            continue
        why, fix = ((f"the classification head '{entry}' is trained whole", f"set {KEY}: null for this task")
                    if entry in heads else
                    (f"'{entry}' is trained whole (training.lora.modules_to_save)",
                     f"remove '{entry}' from training.lora.modules_to_save, or set {KEY}: null"))
        raise WorkflowError(f"{KEY}: {why} but bitsandbytes quantised its weights ({hit[0]}); quantised "
                            f"weights cannot be trained. Fix: {fix}")
    from peft import prepare_model_for_kbit_training

    # Checkpointing is left to add_lora (non-reentrant, with input gradients), as for unquantised models.
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def quant_state_bytes(model: nn.Module) -> int:
    """Bytes bitsandbytes keeps beside the packed weights: 4-bit absmax per block (8-bit plus the nested
    fp32 absmax with double quant) and the code books; 8-bit one fp32 scale per output row (SCB).
    Parameters count the packed weights themselves (a Params4bit holds n/2 uint8)."""
    seen: set[int] = set()
    total = 0

    def add(tensor) -> None:
        nonlocal total
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()

    for parameter in model.parameters():
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            add(state.absmax)
            add(state.code)
            if getattr(state, "nested", False):
                add(state.state2.absmax)
                add(state.state2.code)
                add(state.offset)
        add(getattr(parameter, "SCB", None))
    for module in model.modules():  # 8-bit: the first forward moves the row scales onto the layer's state
        add(getattr(getattr(module, "state", None), "SCB", None))
    return total
