"""Split layouts beyond one ``<split>.<format>`` file per split, for local sources (``datasets.<ds>.source``).

- ``layout: imagefolder``: the Hugging Face ``datasets`` image-folder convention
  (https://huggingface.co/docs/datasets/image_dataset#imagefolder): each split is a folder
  ``<source.path>/<split>/`` holding ``metadata.jsonl`` (or ``metadata.csv`` / ``metadata.parquet``, the
  dataset's ``format``) whose ``file_name`` column gives each row's image relative to that folder (images
  may sit in subfolders). ``datasets.load_dataset("imagefolder")`` is not used to read it: it decodes
  the images as it loads and stops at the first missing or corrupt file naming no row, where normalise
  must judge each row (file, line, field) and keep the shipped bytes. So the folder is copied as it is
  at download (hard links where possible), its metadata read row by row like any split file, and
  ``file_name`` resolved inside the split folder only (``..`` out of it is ``image_outside_dataset``).
- ``files: {<source split>: <file, glob or list of them>}``: several files per split (a sharded corpus
  ``shards/part-*.txt.gz``, jsonl shards), relative to ``source.path`` or absolute, so a held-out file may
  sit in another folder. A split's files are read in the order of their file names (sorted: stable
  whatever the glob or list order), so row indices and line ids do not depend on the file system.

Both are checked when the workflow is parsed (``check_layouts``, from ``split_names.check_local_splits``):
a glob matching nothing, a missing file or split folder is refused at ``snakemake -n`` naming the
dataset and key. In the raw copy each such split is a folder ``raw/<split>/`` (``raw_records`` reads it).
"""
from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.data import file_formats

IMAGEFOLDER = "imagefolder"
IMAGEFOLDER_FORMATS = ("jsonl", "csv", "parquet")  # datasets' metadata files (json is not among them)
METADATA = "metadata"  # metadata.<format> in a split folder: what marks an image folder in the raw copy
RELATIVE = "paths and globs are relative to source.path, or absolute"


def layout(settings: DatasetSettings) -> str | None:
    return settings.source.layout


def listed_files(settings: DatasetSettings) -> dict[str, list[str]]:
    """``source.files`` with each value as a list of paths or globs."""
    files = settings.source.files
    return {split: [value] if isinstance(value, str) else list(value) for split, value in files.items()}


def handles(settings: DatasetSettings, split: str) -> bool:
    """Whether source split ``split`` is laid out here (not as one ``<split>.<format>`` file)."""
    return settings.source.type == "local" and (layout(settings) == IMAGEFOLDER or split in listed_files(settings))


def suffixes(fmt: str) -> tuple[str, ...]:
    """The file-name endings of a split file in format ``fmt`` (a line format's also compressed: ``data/file_formats``)."""
    return file_formats.suffixes(fmt)


def metadata_file(folder: Path, fmt: str) -> Path:
    return Path(folder) / f"{METADATA}.{fmt}"


def resolve(directory: Path, patterns: list[str], fmt: str) -> tuple[list[Path], str | None]:
    """(a split's files in read order, the problem with them or None)."""
    found: list[Path] = []
    for pattern in patterns:
        full = Path(os.path.normpath(Path(directory) / pattern))  # absolute stays absolute; '..' is the user's
        if glob.has_magic(pattern):
            matched = sorted(Path(p) for p in glob.glob(str(full), recursive=True) if os.path.isfile(p))
            if not matched:
                return [], f"'{pattern}' matches no file under {directory} ({RELATIVE})"
            found += matched
        elif not full.is_file():
            return [], f"{full} is not a file ({RELATIVE})"
        else:
            found.append(full)
    found = sorted(dict.fromkeys(found), key=lambda path: (path.name, str(path)))
    names: dict[str, Path] = {}
    for path in found:
        if not path.name.endswith(suffixes(fmt)):
            return [], f"{path} is not a {fmt} file (a {fmt} split file ends in {', '.join(suffixes(fmt))})"
        if path.name in names:
            return [], (f"{names[path.name]} and {path} have the same file name; a split's files are read in file-name "
                        "order, so rename one of them")
        if path.name.startswith(METADATA + "."):
            return [], f"{path}: a split's file may not be named {path.name} (the image-folder metadata name); rename it"
        names[path.name] = path
    return found, None


def split_sources(directory: Path, settings: DatasetSettings, split: str) -> list[Path]:
    """The source files of a laid-out split (for the rule's inputs and hashes): an image folder's metadata
    file, or the listed files in read order. Raises WorkflowError when they are not there."""
    fmt = settings.format
    if layout(settings) == IMAGEFOLDER:
        return [metadata_file(Path(directory) / split, fmt)]
    files, problem = resolve(Path(directory), listed_files(settings)[split], fmt)
    if problem:
        raise WorkflowError(f"split '{split}' (source.files): {problem}")
    return files


def check_layouts(name: str, settings: DatasetSettings, source: str | None = None) -> None:
    """Parse-time checks of one dataset's ``source.layout`` and ``source.files`` (ConfigError naming the key)."""
    src, key = settings.source, f"datasets.{name}"
    given = [option for option in ("layout", "files") if getattr(src, option)]
    if not given:
        return
    for option in given:
        if src.type != "local":
            raise ConfigError(f"{key}.source.{option}", f"is read from local sources only, not a {src.type} "
                              "source (a hub dataset in this layout is read by the hub's own loader: use type hub)", source)
    if len(given) == 2:
        raise ConfigError(f"{key}.source.files", "an image folder's split is its folder; give layout: imagefolder or "
                          "files, not both", source)
    directory, fmt, splits = Path(src.path), settings.format, settings.splits
    if layout(settings) == IMAGEFOLDER:
        if settings.task != "vision_language":
            raise ConfigError(f"{key}.source.layout", f"imagefolder holds images: it is read by task vision_language, "
                              f"not {settings.task}", source)
        if fmt not in IMAGEFOLDER_FORMATS:
            raise ConfigError(f"{key}.format", f"an image folder's metadata is metadata.jsonl, metadata.csv or "
                              f"metadata.parquet: set format to jsonl, csv or parquet, not {fmt}", source)
        for canonical, split in splits.items():
            metadata = metadata_file(directory / split, fmt)
            several = sorted(path.name for path in (directory / split).glob(f"{METADATA}.*")
                             if path.suffix[1:] in IMAGEFOLDER_FORMATS) if (directory / split).is_dir() else []
            if len(several) > 1:  # as datasets' own image folder: one metadata file per split, none silently ignored
                raise ConfigError(f"{key}.splits.{canonical}", f"{directory / split} holds {len(several)} metadata files "
                                  f"{several}; an image folder's split has one (format {fmt} reads {metadata.name}): "
                                  "merge them into one and remove the others", source)
            if not metadata.is_file():
                holds = sorted(p.name for p in (directory / split).iterdir()) if (directory / split).is_dir() else None
                where = f"the folder holds {holds}" if holds is not None else f"there is no folder {directory / split}"
                raise ConfigError(f"{key}.splits.{canonical}", f"{metadata} is missing ({where}); an image folder's "
                                  f"split is a folder <source.path>/<split>/ with {METADATA}.{fmt} and its images", source)
        return
    for split, patterns in listed_files(settings).items():
        if split not in splits.values():
            raise ConfigError(f"{key}.source.files.{split}", f"'{split}' is not a split of the dataset (its splits "
                              f"mapping names {sorted(splits.values())}); key files by the source split name", source)
        if not patterns:
            raise ConfigError(f"{key}.source.files.{split}", "is an empty list; give a file, a glob or a list of them", source)
        _, problem = resolve(directory, patterns, fmt)
        if problem:
            raise ConfigError(f"{key}.source.files.{split}", problem, source)


def copy_split(directory: Path, settings: DatasetSettings, split: str, out: Path, copy_tree) -> bool:
    """Copy a laid-out split into ``out/<split>/`` (False when the split is one plain file: not ours)."""
    if not handles(settings, split):
        return False
    if layout(settings) == IMAGEFOLDER:
        copy_tree(Path(directory) / split, Path(out) / split)  # the metadata with its images, subfolders kept
        return True
    (Path(out) / split).mkdir()
    for path in split_sources(directory, settings, split):
        shutil.copyfile(path, Path(out) / split / path.name)
    return True


def copied_names(settings: DatasetSettings) -> dict[str, str]:
    """``<split>/<file name>`` in the raw copy -> the listed source file it was copied from (for messages)."""
    if settings.source.type != "local" or not listed_files(settings):
        return {}
    names = {}
    for split, patterns in listed_files(settings).items():
        files, _ = resolve(Path(settings.source.path), patterns, settings.format)
        names[split] = f"the files of split '{split}' ({', '.join(patterns)})"
        names.update({f"{split}/{path.name}": str(path) for path in files})
    return names


def image_base_dirs(raw_dir: Path, source_split: str, fmt: str) -> tuple[Path, ...] | None:
    """Where an image folder's ``file_name`` paths are looked up: its split folder alone; None for other layouts."""
    folder = Path(raw_dir) / source_split
    return (folder,) if metadata_file(folder, fmt).is_file() else None


def local_files(settings: DatasetSettings, split: str) -> list[Path]:
    """A split's source files as the download rule's inputs (editing one reruns its chain): a laid-out
    split's files (an image folder's metadata: its images are copied, not hashed at every parse), else
    ``<split>.<format>``."""
    directory = Path(settings.source.path)
    if handles(settings, split):
        return split_sources(directory, settings, split)
    names = [split + suffix for suffix in suffixes(settings.format)]
    return [next((directory / name for name in names if (directory / name).is_file()), directory / names[0])]
