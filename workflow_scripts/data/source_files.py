"""Content fingerprints of local source files, so reruns follow content rather than clocks.

Snakemake reruns a job when an input's modification time is newer than its outputs; a file copied in
with its old time (``cp -p``, ``rsync -a``) or restored from a backup slips through. The download
rule therefore also takes each local source file's sha256 as a parameter: other bytes, other
parameter, rerun. Hashing a multi-GB corpus at every ``snakemake -n`` would cost minutes, so a hash
is kept beside the workflow's state and reused while the file's size, mtime, ctime and inode are
unchanged (``cp -p`` can restore an mtime but never a ctime).

Images are copied by ``download`` but are not rule inputs (thousands of them would swell the DAG), so
``tree_fingerprint`` of the image folders is a ``download`` parameter too: one digest over the cached
per-file hashes, so an unchanged image set costs one ``stat`` per image at each parse, not a read.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings

CACHE = Path(".snakemake", "source_sha256.json")


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _load(cache_file: Path) -> dict:
    try:
        return json.loads(cache_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _save(cache: dict, cache_file: Path) -> None:
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    temporary = cache_file.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(cache, sort_keys=True))
    os.replace(temporary, cache_file)  # concurrent snakemake invocations never see half a file


def sha256_of_many(paths: list[str | Path], cache_file: Path = CACHE) -> list[str]:
    """Each file's sha256, from the cache when the file is provably unchanged since it was hashed.

    The cache is read and written once for all ``paths`` (thousands of images at every parse); only
    new or changed files are read, streamed in 1 MiB blocks.
    """
    cache, changed, digests = _load(cache_file), False, []
    for path in map(Path, paths):
        stat, key = path.stat(), os.path.abspath(path)  # not resolve(): a syscall per folder, per image
        entry = cache.get(key)
        if not (entry and entry["identity"] == _identity(stat)):
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
            cache[key] = entry = {"identity": _identity(stat), "sha256": digest.hexdigest()}
            changed = True
        digests.append(entry["sha256"])
    if changed:
        _save(cache, cache_file)
    return digests


def sha256_of(path: str | Path, cache_file: Path = CACHE) -> str:
    """The file's sha256, from the cache when the file is provably unchanged since it was hashed."""
    return sha256_of_many([path], cache_file)[0]


def image_dirs(settings: "DatasetSettings") -> list[Path]:
    """The folders of a local dataset's images that ``download`` copies: an image folder's split folders
    (``source.layout: imagefolder``), else the ``images/`` folder beside the split files of a dataset
    with an image field (as ``download.copy_local`` decides)."""
    source = settings.source
    if source.type != "local":
        return []
    directory = Path(source.path)
    if source.layout == "imagefolder":
        return [directory / split for split in dict.fromkeys(settings.splits.values())]
    return [directory / "images"] if "image" in settings.fields else []


def tree_fingerprint(directories: list[Path], cache_file: Path = CACHE) -> str:
    """One sha256 over every file under ``directories`` (relative path and content), '' when there is none.

    A parameter of ``download``: an image replaced by other bytes changes it and reruns the dataset's
    chain, while a touched or re-copied image with the same bytes changes nothing. One digest rather than
    a map per file keeps Snakemake's stored parameters small for large image sets.
    """
    return files_fingerprint([(directory, path) for directory in directories if directory.is_dir()
                              for path in sorted(directory.rglob("*")) if path.is_file()], cache_file)


def files_fingerprint(files: list[tuple[Path, Path]], cache_file: Path = CACHE) -> str:
    """:func:`tree_fingerprint` of the chosen ``files``, each (its folder, the file below it)."""
    if not files:
        return ""
    digests = sha256_of_many([path for _, path in files], cache_file)
    combined = hashlib.sha256()
    for (directory, path), digest in zip(files, digests):
        combined.update(f"{directory.name}/{path.relative_to(directory).as_posix()}\0{digest}\n".encode())
    return f"{len(files)} files, sha256 {combined.hexdigest()}"


def sha256_of_existing(paths: list[str]) -> dict[str, str | None]:
    """sha256 per path; None for a file that is not there (download then fails naming it)."""
    return {path: sha256_of(path) if os.path.isfile(path) else None for path in paths}


STAMPS = Path(".snakemake", "content_stamps")


def content_stamp(name: str, paths: list[str | Path], stamp_dir: Path = STAMPS, cache_file: Path = CACHE) -> str:
    """A small file standing for ``paths``' content, to be a rule's input instead of them (issue 44).

    Snakemake checksums only inputs under 1 MB: touching a larger source file (or a local model's weights) made
    it newer than the outputs and reran the whole chain although no byte changed. The stamp (``stamp_dir``/
    ``name``.json: each path's sha256) is rewritten, with the current time, only when the content changes, so
    its time moves with content alone. A new stamp takes the newest time of the files it stands for: the
    outputs of a finished run stay as new as before (nothing reruns for the stamp's creation). Missing files
    are recorded as None (the stage fails naming them). Returns the stamp's path."""
    stamp = stamp_dir / f"{name}.json"
    files = [str(path) for path in paths]
    digests = {path: (sha256_of(path, cache_file) if os.path.isfile(path) else None) for path in files}
    text = json.dumps(digests, indent=1, sort_keys=True) + "\n"
    try:
        current = stamp.read_text()
    except OSError:
        current = None
    if current == text:
        return str(stamp)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    partial = stamp.with_name(f"{stamp.name}.{os.getpid()}.partial")
    partial.write_text(text)
    if current is None:
        times = [os.stat(path).st_mtime_ns for path in files if os.path.isfile(path)]
        if times:
            os.utime(partial, ns=(max(times), max(times)))
    os.replace(partial, stamp)
    return str(stamp)


def files_under(directory: str | Path) -> list[Path]:
    """Every file below ``directory`` (sorted), none when it is not a directory."""
    root = Path(directory)
    return sorted(path for path in root.rglob("*") if path.is_file()) if root.is_dir() else []
