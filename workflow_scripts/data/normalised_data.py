"""Opening the canonical dataset that the normalise stage writes (one error message for every reader)."""
from __future__ import annotations

from pathlib import Path

from workflow_scripts.core.errors import WorkflowError


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
