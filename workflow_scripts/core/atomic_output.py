"""Outputs appear whole or not at all: written beside their final path, then renamed into place."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; on success rename it onto ``final``, on error delete it.

    Renaming within one directory is atomic on POSIX file systems, so a reader (or a resumed job)
    never sees half an output, and a failed stage leaves nothing behind.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))
    target = temporary if directory else temporary / final.name
    try:
        yield target
        if final.exists():
            _remove(final)
        os.replace(target, final)
    finally:
        _remove(temporary)


def write_json(path: str | os.PathLike, value: Any) -> None:
    """Write JSON atomically, pretty-printed with sorted keys (stable across runs)."""
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def write_jsonl(path: str | os.PathLike, rows) -> None:
    """Write one JSON object per line, atomically."""
    with atomic_path(path) as temporary, open(temporary, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True, default=str) + "\n")
