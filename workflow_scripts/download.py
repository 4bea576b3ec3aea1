"""Stage ``download``: fetch one dataset's raw records and write a manifest (a local rule).

Sources (``datasets.<name>.source``):
- ``hub``: ``datasets.load_dataset(id, config_name, revision=...)`` at a pinned revision, saved with
  ``save_to_disk`` (Arrow keeps the hub's own types).
- ``url``: an http(s) URL with a required sha256. Streamed to a temporary file and verified before
  anything is placed. The file is either a ``.zip``/``.tar.gz``/``.tgz`` archive holding one
  ``<split>.<format>`` file per split (in any folder), or a single ``.json`` file holding an object
  that maps split names to lists of records.
- ``local``: a directory with one ``<split>.<format>`` file per split; format ``text`` (plain-text
  corpora, one example per line) takes ``<split>.txt`` (or compressed: ``.txt.gz``, ``.bz2``, ``.zst``) and counts
  non-blank lines.
  ``source.layout: imagefolder`` copies each split's folder (``metadata.<format>`` and its images) and
  ``source.files`` a split's several files (a glob or list) into ``<split>/`` (``data/split_layouts``).
For url and local sources the raw files are kept byte for byte (rows may be malformed; normalise
judges them). A checksum mismatch or an interrupted transfer leaves no output and says why.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, Sequence

from workflow_scripts.data import raw_records, split_layouts, split_names, text_lines
from workflow_scripts.data.source_paths import SourceNames
from workflow_scripts.core.atomic_output import atomic_path, check_writable, write_json
from workflow_scripts.core.errors import ConfigError, WorkflowError, run_main
from workflow_scripts.checks.sections import dataset_argument
from workflow_scripts.core import config_reads
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.core.run_manifest import build_manifest
from workflow_scripts.core.stage_arguments import StageArgumentParser

CHUNK_BYTES = 1 << 20
IMAGES_DIR = "images"  # beside the split files: what image paths in the records refer to
ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def source_splits(settings: DatasetSettings) -> list[str]:
    """The split names the config expects in the source (after aliasing)."""
    return list(dict.fromkeys(settings.splits.values()))


def fetch_url(url: str, destination: Path, timeout: float = 60.0) -> str:
    """Stream ``url`` into ``destination``; return its sha256. Raises on a short or failed transfer."""
    digest, received, expected = hashlib.sha256(), 0, None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(destination, "wb") as handle:
            length = response.headers.get("Content-Length")
            expected = int(length) if length and length.isdigit() else None
            for block in iter(lambda: response.read(CHUNK_BYTES), b""):
                digest.update(block)
                handle.write(block)
                received += len(block)
    except http.client.IncompleteRead as error:
        received += len(error.partial)
        raise WorkflowError(
            f"download of {url} was interrupted after {received} of {expected or '?'} bytes; nothing was written"
        ) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        reason = getattr(error, "reason", None) or error
        raise WorkflowError(f"download of {url} failed: {reason}; nothing was written") from None
    if expected is not None and received != expected:
        raise WorkflowError(
            f"download of {url} was interrupted after {received} of {expected} bytes; nothing was written"
        )
    return digest.hexdigest()


def _place_archive(archive: Path, url_path: str, out: Path, fmt: str, splits: list[str], url: str) -> None:
    """Extract the ``<split>.<format>`` members (by base name only, so no path escapes ``out``); a line format's
    split may be compressed (``<split>.jsonl.gz``...), one file per split."""
    wanted = {split + suffix: split for split in splits for suffix in split_names.SUFFIXES[fmt]}
    found: dict[str, int] = {}
    try:
        if url_path.endswith(".zip"):
            with zipfile.ZipFile(archive) as bundle:
                for info in bundle.infolist():
                    name = Path(info.filename).name
                    if not info.is_dir() and name in wanted:
                        found[name] = found.get(name, 0) + 1
                        with bundle.open(info) as source, open(out / name, "wb") as target:
                            shutil.copyfileobj(source, target)
        else:
            with tarfile.open(archive, "r:gz") as bundle:
                for member in bundle.getmembers():
                    name = Path(member.name).name
                    if member.isfile() and name in wanted:
                        found[name] = found.get(name, 0) + 1
                        with bundle.extractfile(member) as source, open(out / name, "wb") as target:
                            shutil.copyfileobj(source, target)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as error:
        raise WorkflowError(f"{url}: the archive cannot be read ({error}); nothing was written") from None
    duplicated = sorted(name for name, count in found.items() if count > 1)
    if duplicated:
        raise WorkflowError(f"{url}: the archive holds several files named {duplicated}; which one is meant is ambiguous")
    per_split = {split: sorted(name for name in found if wanted[name] == split) for split in splits}
    ambiguous = sorted(names for names in per_split.values() if len(names) > 1)
    if ambiguous:
        raise WorkflowError(f"{url}: the archive holds {ambiguous[0]} for one split; which one is meant is ambiguous")
    missing = sorted(f"{split}.{fmt}" for split, names in per_split.items() if not names)
    if missing:
        raise WorkflowError(f"{url}: the archive has no file {missing} (it needs one <split>.{fmt} per configured split)")


def _place_single_json(path: Path, out: Path, splits: list[str], url: str) -> None:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise WorkflowError(f"{url}: not valid JSON ({error}); nothing was written") from None
    if not isinstance(content, dict):
        raise WorkflowError(f"{url}: a single-file source must be a JSON object mapping split names to record lists")
    for split in splits:
        records = content.get(split)
        if not isinstance(records, list):
            raise WorkflowError(f"{url}: key '{split}' is missing or not a list of records (keys: {sorted(content)})")
        (out / f"{split}.json").write_text(json.dumps(records))


def download_url(settings: DatasetSettings, out: Path, work: Path) -> dict[str, Any]:
    source, fmt, splits = settings.source, settings.format, source_splits(settings)
    url = source.url
    url_path = urllib.parse.urlparse(url).path.lower()
    fetched = work / "download"
    actual = fetch_url(url, fetched)
    if actual != source.sha256.lower():
        raise WorkflowError(
            f"download of {url}: sha256 mismatch (config says {source.sha256}, received {actual}); nothing was written"
        )
    if url_path.endswith(ARCHIVE_SUFFIXES):
        _place_archive(fetched, url_path, out, fmt, splits, url)
    elif fmt == "json":
        _place_single_json(fetched, out, splits, url)
    else:
        raise WorkflowError(
            f"{url}: a single downloaded file is read as JSON mapping splits to records, but the dataset's "
            f"format is '{fmt}'; serve a .zip or .tar.gz with one <split>.{fmt} per split, or set format: json"
        )
    return {"url": url, "sha256": actual}


def local_split_file(directory: Path, split: str, fmt: str) -> Path:
    """A split's file: ``<split>.<format>``, or its compressed ``<split>.<format>.gz`` / ``.bz2`` / ``.zst`` (a line format's)."""
    if fmt == text_lines.TEXT_FORMAT:
        return text_lines.split_file(directory, split)
    return raw_records.split_file(directory, split, fmt)


def copy_local(settings: DatasetSettings, out: Path) -> dict[str, Any]:
    directory, fmt = Path(settings.source.path), settings.format
    if not directory.is_dir():
        raise WorkflowError(f"{directory}: source.path is not a directory (it must hold one <split>.{fmt} file per split)")
    if split_names.format_problem(settings):
        raise WorkflowError(f"format: {split_names.format_problem(settings)}")
    problem = split_names.local_split_problem(directory, settings)
    if problem is not None:
        raise WorkflowError(f"split '{problem[0]}': {problem[1]}")
    for split in source_splits(settings):
        if split_layouts.copy_split(directory, settings, split, out, copy_images):
            continue
        path = local_split_file(directory, split, fmt)
        shutil.copyfile(path, out / path.name)
    if "image" in settings.fields and (directory / IMAGES_DIR).is_dir():
        copy_images(directory / IMAGES_DIR, out / IMAGES_DIR)
    return {"path": str(directory)}


def copy_images(source: Path, target: Path) -> None:
    """The dataset's ``images/`` folder (or an image folder's split), so the raw snapshot holds what its
    records refer to.

    Hard links where the filesystem allows (no second copy of a large image set), copies otherwise;
    symbolic links are refused: the snapshot must not change when their targets do.
    """
    import os

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    for path in source.rglob("*"):
        if path.is_symlink():
            raise WorkflowError(f"{path}: a symbolic link in the images folder; copy the file in instead")
    shutil.copytree(source, target, copy_function=link_or_copy)


def download_hub(settings: DatasetSettings, out: Path) -> dict[str, Any]:
    import datasets

    source = settings.source
    try:
        data = datasets.load_dataset(source.id, source.config_name, revision=source.revision)
    except Exception as error:  # the hub client raises many types; report one line, never a token
        raise WorkflowError(f"hub dataset {source.id}@{source.revision}: {type(error).__name__}: {error}") from None
    if not isinstance(data, datasets.DatasetDict):
        raise WorkflowError(f"hub dataset {source.id}: expected splits, got a {type(data).__name__}")
    missing = [split for split in source_splits(settings) if split not in data]
    if missing:
        fix = split_names.missing_split_fix(missing[0], settings.splits, list(data))
        raise WorkflowError(f"hub dataset {source.id}: no split {missing} (it has {sorted(data)}); {fix}")
    data.save_to_disk(str(out))
    return {"id": source.id, "config_name": source.config_name, "revision": source.revision}


def rows_per_split(out: Path, settings: DatasetSettings) -> dict[str, int]:
    if raw_records.is_saved_dataset(out):
        from datasets import load_from_disk

        data = load_from_disk(str(out))
        return {split: data[split].num_rows for split in data}
    fmt = settings.format
    if fmt == text_lines.TEXT_FORMAT:  # rows = non-blank lines (a stream: corpora are large)
        return {split: sum(map(text_lines.count_lines, text_lines.split_files(out, split)))
                for split in source_splits(settings)}
    return {split: sum(raw_records.count_rows(path, fmt, settings.encoding) for path in raw_records.split_files(out, split, fmt))
            for split in source_splits(settings)}


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): sha256_file(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def fetch(settings: DatasetSettings, out: Path, final: Path) -> tuple[dict, dict, dict]:
    """The raw files into ``out`` (the staging directory of ``final``): origin, file hashes, rows per split."""
    kind = settings.source.type
    out.mkdir(parents=True, exist_ok=True)
    if kind == "hub":
        origin = download_hub(settings, out)
    elif kind == "url":
        with tempfile.TemporaryDirectory(prefix=".download.", dir=final.parent) as work:
            origin = download_url(settings, out, Path(work))
    else:
        origin = copy_local(settings, out)
    return origin, file_hashes(out), rows_per_split(out, settings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = StageArgumentParser(description="Download one dataset's raw records and write a manifest.")
    parser.add_argument("--name", required=True, help="Dataset name (the key under datasets in the config).")
    parser.add_argument("--dataset", required=True, help="The dataset's settings as JSON.")
    parser.add_argument("--out", required=True, type=Path, help="Raw data directory to create.")
    parser.add_argument("--manifest", required=True, type=Path, help="download_manifest.json to write.")
    args = parser.parse_args(argv)
    # read through what core/config_reads.py declares for download: a key its params do not carry cannot be read
    settings = config_reads.Declared(dataset_argument(args.dataset, args.name), "download", "datasets.*")
    kind = settings.source.type
    split_layouts.check_layouts(args.name, settings, "--dataset")  # as at parse time: the key named, nothing copied
    if settings.format == text_lines.TEXT_FORMAT and kind != "local":
        raise ConfigError(f"datasets.{args.name}.format", f"'text' is read from local directories only, not a {kind} source")

    check_writable(args.out, args.manifest)
    with atomic_path(args.out, directory=True) as out:
        try:
            origin, files, rows = fetch(settings, out, args.out)
        except WorkflowError as error:  # a copied file is named as the user knows it, not by its staging path
            raise SourceNames(out, settings).reraise(error) from None
        manifest = build_manifest(
            "download", settings.to_dict(), dataset=args.name, source_type=kind, source=origin,
            revision=settings.source.revision,
            sha256=origin.get("sha256") or hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest(),
            files=files, rows=rows,
        )
    write_json(args.manifest, manifest)
    print(f"{args.name}: {kind} source, rows per split {rows}")
    return 0


if __name__ == "__main__":
    run_main(main)
