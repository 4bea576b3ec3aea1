"""Opening the canonical dataset that the normalise stage writes (one error message for every reader)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workflow_scripts.core.errors import ConfigError, WorkflowError


def open_normalised(directory: str | Path, required_split: str | None = "train"):
    """The normalised ``DatasetDict`` at ``directory``; fails naming the directory when it is not one
    or lacks ``required_split`` (None: the caller checks the splits it needs)."""
    from datasets import load_from_disk

    try:
        data = load_from_disk(str(directory))
    except (FileNotFoundError, ValueError) as error:
        raise WorkflowError(f"{directory}: not a normalised dataset ({error}); run normalise first") from None
    if required_split is not None and required_split not in data:
        raise WorkflowError(f"{directory}: has no '{required_split}' split (it has {sorted(data)})")
    return data


def read_task_meta(data_dir: Path, task: str) -> dict[str, Any]:
    """What normalise learned for the task (e.g. a label set), from ``task_meta.json``; it must be the same task."""
    path = Path(data_dir, "task_meta.json")
    try:
        task_meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkflowError(f"{data_dir}: no task_meta.json, so this is not normalise output (or an older "
                            "version's); run the normalise rule") from None
    if task_meta.get("task") != task:
        raise WorkflowError(f"{data_dir}: normalised for task {task_meta.get('task')!r}, but --task is {task!r}; "
                            "set the dataset's task in the config and re-run normalise")
    return task_meta


def load_rows(data_dir: str | Path, split: str, max_examples: int | None) -> list[dict]:
    """Rows of a normalised split to score or predict (evaluate, predict, training's validation metric), in
    stored order (the first ``max_examples`` when set); each row's id is unique."""
    data = open_normalised(data_dir, required_split=None)
    if split not in data:
        raise ConfigError("evaluation.split", f"'{split}' is not a split of {data_dir} (it has {sorted(data)})")
    table = data[split]
    if "id" not in table.column_names:
        raise WorkflowError(f"{data_dir} split '{split}': no 'id' column; is this normalise output?")
    if max_examples is not None:
        table = table.select(range(min(max_examples, len(table))))
    rows = table.to_list()
    if not rows:
        raise WorkflowError(f"{data_dir} split '{split}': no rows to evaluate")
    seen = set()
    for index, row in enumerate(rows):
        if row["id"] in seen:
            raise WorkflowError(f"{data_dir} split '{split}' row {index}: duplicate id {row['id']!r}")
        seen.add(row["id"])
    return rows
