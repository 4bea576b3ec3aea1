"""Content fingerprints of local source files, so reruns follow content rather than clocks.

Snakemake reruns a job when an input's modification time is newer than its outputs; a file copied in
with its old time (``cp -p``, ``rsync -a``) or restored from a backup slips through. The download
rule therefore also takes each local source file's sha256 as a parameter: other bytes, other
parameter, rerun. Hashing a multi-GB corpus at every ``snakemake -n`` would cost minutes, so a hash
is kept beside the workflow's state and reused while the file's size, mtime, ctime and inode are
unchanged (``cp -p`` can restore an mtime but never a ctime).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE = Path(".snakemake", "source_sha256.json")


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def sha256_of(path: str | Path, cache_file: Path = CACHE) -> str:
    """The file's sha256, from the cache when the file is provably unchanged since it was hashed."""
    path = Path(path)
    stat = path.stat()
    key = str(path.resolve())
    try:
        cache = json.loads(cache_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    entry = cache.get(key)
    if entry and entry["identity"] == _identity(stat):
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    cache[key] = {"identity": _identity(stat), "sha256": digest.hexdigest()}
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    temporary = cache_file.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(cache, sort_keys=True))
    os.replace(temporary, cache_file)  # concurrent snakemake invocations never see half a file
    return cache[key]["sha256"]


def sha256_of_existing(paths: list[str]) -> dict[str, str | None]:
    """sha256 per path; None for a file that is not there (download then fails naming it)."""
    return {path: sha256_of(path) if os.path.isfile(path) else None for path in paths}
