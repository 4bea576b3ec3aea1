"""The identity of an experiment set: which comparison ``results/comparison.{md,csv}`` currently holds.

Snakemake does not rerun a job whose outputs exist merely because its inputs are missing, nor (open bugs
snakemake#2011 and #2626) a multi-output job whose inputs or params changed. With ``results/comparison.*``
as the only final targets, a second experiment set run in the same directory (another model, another
dataset) would plan nothing. So ``compare`` also writes a stamp, ``results/experiment_sets/<hash>.json``,
named by a hash of everything it compares, and removes the stamps of other sets: a config whose set has
no stamp here reruns ``compare``, and with it every missing job upstream; an unchanged one plans nothing.

The stamp also records the sha256 of the tables compare published (``published``): Snakemake never looks at an
output's content, so a hand-edited ``results/comparison.md`` would otherwise survive every rerun ("Nothing to be
done"). ``edited_outputs`` names a table that no longer matches (core/final_check.check_published refuses it).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.core.atomic_output import write_json
from workflow_scripts.core.errors import WorkflowError

STAMP_DIR = "results/experiment_sets"
PUBLISHED = "published"  # the stamp's key: {path as compare was given it: sha256 of the file it wrote}


def identity_json(identity: Mapping[str, Any]) -> str:
    return json.dumps(identity, sort_keys=True)


def stamp_path(identity: Mapping[str, Any]) -> str:
    """The stamp of this set: its name is the first 16 hex digits of the sha256 of ``identity`` as JSON."""
    digest = hashlib.sha256(identity_json(identity).encode()).hexdigest()[:16]
    return f"{STAMP_DIR}/{digest}.json"


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def write_stamp(path: str | os.PathLike, identity: Mapping[str, Any],
                published: Sequence[str | os.PathLike] = ()) -> None:
    """Write this set's stamp, with the sha256 of each ``published`` file as written, and delete every other
    set's: the comparison now holds this set only."""
    path = Path(path)
    write_json(path, {**identity, PUBLISHED: {str(file): file_sha256(file) for file in published}})
    for other in path.parent.glob("*.json"):
        if other.name != path.name:
            other.unlink(missing_ok=True)


def edited_outputs(stamp: str | os.PathLike) -> list[str]:
    """The files ``stamp`` records as published whose content differs now. None without the stamp (another set,
    or none compared yet), for a missing file (Snakemake reruns compare for it) or a stamp written before the
    record was kept."""
    stamp = Path(stamp)
    if not stamp.is_file():
        return []
    try:
        recorded = json.loads(stamp.read_text(encoding="utf-8")).get(PUBLISHED, {})
    except (ValueError, AttributeError) as error:
        raise WorkflowError(f"{stamp}: not the JSON object compare writes ({error}); delete it, and run snakemake "
                            "again: compare writes it anew") from None
    return [file for file, digest in recorded.items() if Path(file).is_file() and file_sha256(file) != digest]
