"""Reading the JSON files stages hand each other (eval.json, predictions.jsonl, reports), each fault one
message naming the file and line, and what to run."""
from __future__ import annotations

import json
from pathlib import Path

from workflow_scripts.core.errors import WorkflowError


def read_json_object(path: Path, missing: str = "run the stage that writes it first") -> dict:
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise WorkflowError(f"{path}: not found; {missing}") from None
    except json.JSONDecodeError as error:
        raise WorkflowError(f"{path}: not valid JSON at line {error.lineno}: {error.msg}") from None
    if not isinstance(value, dict):
        raise WorkflowError(f"{path}: expected a JSON object")
    return value


def read_jsonl_objects(path: Path, missing: str = "run the stage that writes it first") -> list[tuple[int, dict]]:
    """(line number, object) of every line; an empty file is refused."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise WorkflowError(f"{path}: not found; {missing}") from None
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise WorkflowError(f"{path} line {number}: not valid JSON: {error.msg}") from None
        if not isinstance(row, dict):
            raise WorkflowError(f"{path} line {number}: expected a JSON object")
        rows.append((number, row))
    if not rows:
        raise WorkflowError(f"{path}: empty")
    return rows
