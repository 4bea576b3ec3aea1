"""The records of ``make gpu-check``: one JSON object per line, appended the moment a check ends.

Every writer (the driver, the CUDA tests, the GPU benchmark's sides) appends to the file named by
$GPU_CHECK_REPORT and flushes it to disk at once, so a run killed at any point keeps every figure
measured before the kill; the summary is rebuilt from whatever lines exist.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

VARIABLE = "GPU_CHECK_REPORT"


def append(record: dict, path: str | os.PathLike | None = None) -> None:
    """Append ``record`` as one line to ``path`` (default $GPU_CHECK_REPORT; nothing when neither is set)."""
    path = path or os.environ.get(VARIABLE)
    if not path:
        return
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as handle:  # one write of one line: appends do not interleave
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def read(path: str | os.PathLike) -> list[dict]:
    """Every complete record in ``path``; a line cut off by a kill mid-write is left out."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
