"""The files of a model folder that the workflow reads: one definition for prepare_model's copy of a local model
(``source: local``) and for what decides when that copy is redone (rules/common.smk, ``local_model_stamp``).

Only the folder's own files are copied, never a pickle (loading one can run code: safetensors only) nor a
manifest of ours. What lies below the folder (huggingface_hub's ``.cache/`` of download metadata, whose
timestamps ``huggingface-cli download --local-dir`` rewrites on every call; a clone's ``.git/``) is never read,
so changing it must rerun nothing.
"""
from __future__ import annotations

from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MANIFEST_NAME = "model_manifest.json"  # prepare_model's; its settings hold model.initialise


def local_model_files(folder: str | Path) -> list[Path]:
    """The files prepare_model copies from ``folder``, sorted (none when it is not a folder)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir()
                  if path.is_file() and not path.name.endswith(PICKLE_SUFFIXES) and path.name != MANIFEST_NAME)
