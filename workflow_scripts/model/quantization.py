"""QLoRA: the frozen base weights quantised by bitsandbytes (through transformers), LoRA trained on top.

``training.quantization: {bits: 4 | 8, type: nf4 | fp4, double_quant: true, compute_dtype: bf16 | fp16 | fp32}``
(null: off; checked and defaulted in core.settings). Loading gets a ``BitsAndBytesConfig`` through ``load_base_model``'s ``model_kwargs``; the loaded
model is prepared with PEFT's ``prepare_model_for_kbit_training`` (everything frozen, the unquantised
weights - embeddings, norms, lm_head - upcast to fp32); ``model_loading.add_lora`` then turns on
non-reentrant checkpointing with input gradients as for any model. Adapters are saved as plain PEFT
adapters, with :data:`ADAPTER_RECORD` beside them naming the bitsandbytes settings of the base they were
trained on.

Evaluation (``evaluation.qlora_base``): ``quantised`` (default) loads the base as it was trained, with the
recorded bitsandbytes settings, and the adapter on top, as the QLoRA paper evaluates (Dettmers et al. 2023,
github.com/artidoro/qlora: ``qlora.py`` scores the adapter on the 4-bit model it trained); the score is
then the trained model's. ``unquantised`` loads the adapter onto the base's original weights in the evaluation
dtype (as a deployment without bitsandbytes would run it): a model that was never trained as such, whose
score may differ. ``eval.json`` records which (``qlora_base``).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.settings import LoraSettings, QuantizationSettings, TrainingSettings

KEY = "training.quantization"
EVALUATION_KEY = "evaluation.qlora_base"
QLORA_BASES = ("quantised", "unquantised")
ADAPTER_RECORD = "base_quantization.json"  # beside a QLoRA adapter: the settings its base was loaded with
INSTALL = "pip install bitsandbytes"
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# PEFT trains these heads whole on its own for sequence classification (PeftModelForSequenceClassification).
SEQ_CLS_HEADS = ("classifier", "score")


def compute_dtype(quantization: QuantizationSettings, precision: str) -> torch.dtype:
    """The dtype 4-bit layers dequantise to for their matmuls; by default the training precision's."""
    return COMPUTE_DTYPES[quantization.compute_dtype or precision]


def leave_out_bitsandbytes(stage: str, quantised: bool) -> bool:
    """Keep bitsandbytes out of ``stage``'s own interpreter when its job quantises nothing; True if left out.

    peft imports bitsandbytes whenever it is installed (``peft/helpers.py``, on ``import peft``), and
    bitsandbytes imports ``torch._inductor`` and probes for its CPU kernels (the "No module named 'kernels'"
    line in the logs): seconds of every LoRA job that uses none of it (benchmarks/RESULTS.md, "Each stage's
    fixed cost"). A ``None`` in ``sys.modules`` makes ``import bitsandbytes`` raise ImportError and
    ``importlib.util.find_spec`` answer None, which is how peft and transformers decide it is not installed.

    Only where the process runs ``stage`` as its command (``python -m <stage>``, also each torchrun rank),
    and only before peft or transformers is imported (both remember their answer: peft's
    ``is_bnb_available`` is cached). A test or notebook calling the stage's ``main()`` keeps its interpreter
    as it is, since a QLoRA run later in the same process needs the package.
    """
    main = sys.modules.get("__main__")
    if quantised or getattr(getattr(main, "__spec__", None), "name", None) != stage:
        return False
    if any(name in sys.modules for name in ("bitsandbytes", "peft", "transformers")):
        return False
    sys.modules["bitsandbytes"] = None
    return True


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
    record = base_record(training)
    return {} if record is None else loading_kwargs(record, device)


def base_record(training: TrainingSettings) -> dict[str, Any] | None:
    """The bitsandbytes settings the base is loaded with (compute dtype resolved), or None when off: written
    beside the adapter, so evaluation can load the same base (TrainingSettings.quantization_record)."""
    return training.quantization_record()


def loading_kwargs(record: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """``from_pretrained`` arguments that load a base quantised as ``record`` (:func:`base_record`) says."""
    require_bitsandbytes()
    from transformers import BitsAndBytesConfig

    if record["bits"] == 8:
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=record["type"], bnb_4bit_use_double_quant=record["double_quant"],
            bnb_4bit_compute_dtype=COMPUTE_DTYPES[record["compute_dtype"]],
        )
    return {"quantization_config": config, "device_map": {"": str(device)}}


def write_adapter_record(directory: str | Path, training: TrainingSettings) -> None:
    """A QLoRA adapter's :data:`ADAPTER_RECORD` (nothing for an adapter trained on an unquantised base)."""
    record = base_record(training)
    if record is not None:
        Path(directory, ADAPTER_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_adapter_record(adapter_dir: str | Path | None) -> dict[str, Any] | None:
    """The bitsandbytes settings an adapter was trained against, or None (not a QLoRA adapter, or no adapter)."""
    if adapter_dir is None:
        return None
    path = Path(adapter_dir, ADAPTER_RECORD)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        record = None
    return checked_record(record, str(path), "train the adapter again")


def checked_record(record: Any, where: str, fix: str) -> dict[str, Any]:
    """``record`` if it is a :func:`base_record`, else one line naming ``where`` and ``fix``."""
    try:
        bits, kind, dtype = record["bits"], record["type"], record["compute_dtype"]
        valid = bits in (4, 8) and kind in ("nf4", "fp4") and dtype in COMPUTE_DTYPES and isinstance(record["double_quant"], bool)
    except (KeyError, TypeError):
        valid = False
    if not valid:
        raise WorkflowError(f"{where}: not the record train writes ({{bits: 4|8, type: nf4|fp4, double_quant, "
                            f"compute_dtype: {'|'.join(COMPUTE_DTYPES)}}}); {fix}")
    return record


def evaluation_quantises(adapter_dir: str | Path | None, qlora_base: str, base_quantization: Mapping | None = None) -> bool:
    """Whether evaluating ``adapter_dir`` loads a quantised base (a QLoRA adapter, ``qlora_base: quantised``), or,
    for the untrained model of a QLoRA variant, ``base_quantization`` (evaluate's ``--base-quantization``) asks
    for one."""
    if qlora_base != "quantised":
        return False
    return (base_quantization is not None) if adapter_dir is None else read_adapter_record(adapter_dir) is not None


def evaluation_base(adapter_dir: str | Path | None, qlora_base: str, device: torch.device,
                    dtype: torch.dtype | None = None, base_quantization: Mapping | None = None,
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(extra ``from_pretrained`` arguments, facts for eval.json) for evaluating ``adapter_dir``.

    A QLoRA adapter is scored on the base quantised as in training unless ``qlora_base`` is ``unquantised``;
    the untrained model of a QLoRA variant (no adapter, ``base_quantization``: the variant's
    :func:`base_record`, from the rule) is quantised the same way, so its score is the untrained model's as the
    adapters are scored, and "gain over untrained" holds no quantisation effect. Any other adapter (and the
    untrained model of any other variant) loads unquantised, and the facts say so. ``dtype``: the evaluation's
    compute dtype; the 4-bit layers compute in it too (the NF4/FP4 weights are the trained ones either way), so
    eval.json's ``dtype`` holds for every layer and ``base_quantization`` records the compute dtype used.
    """
    if qlora_base not in QLORA_BASES:
        raise WorkflowError(f"{EVALUATION_KEY}: {qlora_base!r} is not one of {list(QLORA_BASES)}")
    if adapter_dir is not None and base_quantization is not None:
        raise WorkflowError("argument --base-quantization: only for the untrained model (no --adapter); an adapter's "
                            f"base is read from its {ADAPTER_RECORD}")
    if adapter_dir is None:
        record = None if base_quantization is None else checked_record(
            base_quantization, "argument --base-quantization", "pass the variant's training.quantization as the rule does")
    else:
        record = read_adapter_record(adapter_dir)
    if record is None:
        return {}, {"qlora_base": None, "base_quantization": None}
    if qlora_base != "quantised":
        return {}, {"qlora_base": qlora_base, "base_quantization": None}
    if dtype is not None:
        record = {**record, "compute_dtype": next(name for name, value in COMPUTE_DTYPES.items() if value == dtype)}
    return loading_kwargs(record, device), {"qlora_base": qlora_base, "base_quantization": record}


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
