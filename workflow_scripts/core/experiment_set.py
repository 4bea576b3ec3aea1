"""The identity of an experiment set: which comparison ``results/comparison.{md,csv}`` currently holds.

Snakemake does not rerun a job whose outputs exist merely because its inputs are missing, nor (open bugs
snakemake#2011 and #2626) a multi-output job whose inputs or params changed. With ``results/comparison.*``
as the only final targets, a second experiment set run in the same directory (another model, another
dataset) would plan nothing. So ``compare`` also writes a stamp, ``results/experiment_sets/<hash>.json``,
named by a hash of everything it compares, and removes the stamps of other sets: a config whose set has
no stamp here reruns ``compare``, and with it every missing job upstream; an unchanged one plans nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from workflow_scripts.core.atomic_output import write_json

STAMP_DIR = "results/experiment_sets"


def identity_json(identity: Mapping[str, Any]) -> str:
    return json.dumps(identity, sort_keys=True)


def stamp_path(identity: Mapping[str, Any]) -> str:
    """The stamp of this set: its name is the first 16 hex digits of the sha256 of ``identity`` as JSON."""
    digest = hashlib.sha256(identity_json(identity).encode()).hexdigest()[:16]
    return f"{STAMP_DIR}/{digest}.json"


def write_stamp(path: str | os.PathLike, identity: Mapping[str, Any]) -> None:
    """Write this set's stamp and delete every other set's: the comparison now holds this set only."""
    path = Path(path)
    write_json(path, identity)
    for other in path.parent.glob("*.json"):
        if other.name != path.name:
            other.unlink(missing_ok=True)
