"""Content fingerprints of a model's tokenizer files and of a saved data set: what pretokenise's cache key
is made of, and what training checks tokenised data against (model_loading.check_tokenised_for_model).

By hand (sha256 over names and bytes) because datasets' own fingerprints are random for data loaded
from disk and cover no tokenizer files.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   # a VLM's processor expands image placeholders and normalises pixels: part of the key too
                   "processor_config.json", "preprocessor_config.json")


def files_fingerprint(directory: Path, names: Sequence[str] | None = None, pattern: str | None = None) -> str:
    """sha256 over (relative name, content hash) of the chosen files, in a stable order."""
    directory = Path(directory)
    if names is not None:
        paths = [directory / name for name in names if (directory / name).is_file()]
    else:
        paths = sorted(p for p in directory.rglob(pattern or "*") if p.is_file())
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def tokenizer_fingerprint(model_dir: Path) -> str:
    return files_fingerprint(model_dir, TOKENIZER_FILES)


def input_fingerprint(data_dir: Path) -> str:
    """The normalised data's content: its Arrow files and split list (not datasets' random fingerprints)."""
    digest = hashlib.sha256(files_fingerprint(data_dir, pattern="data-*.arrow").encode())
    dict_file = Path(data_dir) / "dataset_dict.json"
    if dict_file.is_file():
        digest.update(dict_file.read_bytes())
    return digest.hexdigest()
