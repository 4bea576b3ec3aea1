"""A split the config expects but the source lacks: name what is there and the ``splits:`` mapping that fits.

Sources name their splits their own way (ChartQA's ``val``, GLUE's ``dev``); the config maps each
canonical split (train, validation, test) to the source's name. When a source lacks a mapped split,
the message names the files that are there and the whole ``splits:`` mapping that would use them (the
whole one: a ``splits:`` mapping replaces the default, so ``{validation: val}`` alone would drop train
and test). Local sources are checked when the workflow is parsed (``check_local_splits``, from
rules/common.smk; with the image-folder and listed-files layouts of ``split_layouts``), so ``snakemake -n``
refuses them before any job; ``download`` gives the same hints
for local, hub and archive sources.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings

from workflow_scripts.core.errors import ConfigError
from workflow_scripts.data import file_formats, split_layouts, text_lines

CANONICAL = ("train", "validation", "test")
# Names sources commonly give each canonical split, most likely first.
SYNONYMS = {
    "train": ("train", "training", "trn"),
    "validation": ("validation", "val", "valid", "dev", "development", "eval", "evaluation"),
    "test": ("test", "testing", "tst", "eval", "evaluation"),
}
# format -> the file suffixes of a split in it (a line format's plain or compressed: data/file_formats)
SUFFIXES = {fmt: file_formats.suffixes(fmt) for fmt in file_formats.PLAIN_SUFFIXES}


def split_file_names(split: str, fmt: str) -> list[str]:
    return [split + suffix for suffix in SUFFIXES[fmt]]


def mapping_text(splits: Mapping[str, str]) -> str:
    """A ``splits:`` mapping as the user writes it, in canonical order."""
    ordered = [name for name in CANONICAL if name in splits] + [name for name in splits if name not in CANONICAL]
    return "splits: {" + ", ".join(f"{name}: {splits[name]}" for name in ordered) + "}"


def bad_split_name_fix(canonical: str, split: str, splits: Mapping[str, str], fmt: str, task: str = "generation") -> str:
    """The fix for a split name holding a folder (``train/metadata``): the layouts of ``split_layouts`` that
    express it, as the YAML to write (the whole ``splits:`` mapping: it replaces the default)."""
    path = split.replace("\\", "/")
    if "/" not in path:
        return "name the split by its file name without the suffix"
    file = path if path.endswith(SUFFIXES[fmt]) else split_file_names(path, fmt)[0]
    folder, base = path.rsplit("/", 1)
    listed = mapping_text({**splits, canonical: canonical})
    if base == split_layouts.METADATA:  # metadata.<format> names an image folder's metadata, never a listed file
        if task == "vision_language" and "/" not in folder and fmt in split_layouts.IMAGEFOLDER_FORMATS:
            return (f"for a Hugging Face image folder ({file} beside its images), write "
                    f"{mapping_text({**splits, canonical: folder})} and, under source:, layout: imagefolder")
        renamed = f"{folder}/{split_file_names(canonical, fmt)[0]}"
        return (f"rename {file} to {renamed} ({split_layouts.METADATA}.{fmt} is an image folder's metadata) and "
                f"write {listed} and, under source:, files: {{{canonical}: {renamed}}}")
    return (f"to read {file} (under source.path) as the {canonical} split, write {listed} and, under source:, "
            f"files: {{{canonical}: {file}}} (a glob or a list of files works too)")


def missing_split_fix(source_split: str, splits: Mapping[str, str], available: Iterable[str], fmt: str | None = None) -> str:
    """What to do about ``source_split`` missing from a source whose splits are ``available``.

    The alias of an unused split that looks like it (``val`` for validation), else the only unused
    split, else adding the file (or leaving out validation, the one optional split).
    """
    available = sorted(available)
    canonical = next((name for name, source in splits.items() if source == source_split), source_split)
    unused = [name for name in available if name not in splits.values()]
    likely = [name for name in SYNONYMS.get(canonical, ()) if name in unused]
    candidate = likely[0] if likely else (unused[0] if len(unused) == 1 else None)
    shown = (lambda split: split_file_names(split, fmt)[0]) if fmt else (lambda split: f"split '{split}'")
    if candidate is not None:
        return (f"if {shown(candidate)} is the {canonical} split, map it: "
                f"{mapping_text({**splits, canonical: candidate})}")
    rest = {name: source for name, source in splits.items() if source != source_split}
    if canonical == "validation" and rest:  # the one optional split
        return f"add {shown(source_split)}, or leave {canonical} out: {mapping_text(rest)}"
    if unused:
        return f"add {shown(source_split)}, or map {canonical} to one of {unused}"
    return f"add {shown(source_split)}"


def _other_format(directory: Path, split: str, fmt: str, task: str = "generation") -> str | None:
    """The fix when ``split``'s file is there in another format than ``fmt`` (``train.json`` for jsonl).

    Only a format the schema accepts for the task is suggested: masked_lm reads text only, and text is masked_lm's.
    """
    for other, suffixes in SUFFIXES.items():
        for suffix in suffixes:
            name = split + suffix
            if other == fmt or not (directory / name).is_file() or (fmt, other) in (("text", "penman"), ("penman", "text")):
                continue
            if other == "penman" and task != "masked_lm":
                return f"{name} is there: if it holds AMR graphs in PENMAN text, set format: penman"
            if other == "penman":
                continue  # a .txt file is text's too
            if (other == text_lines.TEXT_FORMAT) == (task == "masked_lm"):
                return f"{name} is there: set format: {other}"
            if task == "masked_lm":
                return (f"{name} is there, but task masked_lm reads plain text only: write its examples one per line "
                        f"to {split}.txt (or {split}.txt.gz)")
            return (f"{name} is there, but format text (one example per line) is read by task masked_lm only; "
                    f"give task {task} its records as {split}.jsonl, .json, .csv or .parquet")
    return None


def available_splits(directory: Path, fmt: str) -> list[str]:
    """The split names of the files of format ``fmt`` in ``directory``."""
    names = [path.name for path in directory.iterdir() if path.is_file()]
    return sorted({name[: -len(suffix)] for name in names for suffix in SUFFIXES[fmt] if name.endswith(suffix)})


def format_problem(settings: "DatasetSettings") -> str | None:
    """Why the dataset's format cannot hold its task's records (plain text lines have no fields), or None."""
    if settings.format == text_lines.TEXT_FORMAT and settings.task != "masked_lm":
        return (f"format text (one example per line, no fields) is read by task masked_lm only, not {settings.task}; "
                "for AMR graphs in PENMAN text (# ::id, # ::snt and a graph per block) set format: penman; other "
                "records belong in jsonl, json, csv or parquet files")
    if settings.format == "penman" and settings.task != "generation":
        return f"format penman (AMR graphs) is read by task generation only, not {settings.task}"
    return None


def local_split_problem(directory: Path, settings: "DatasetSettings") -> tuple[str, str] | None:
    """(canonical split, one-line problem) for the first mapped split without its one file, or None."""
    fmt, splits = settings.format, settings.splits
    for canonical, split in splits.items():
        if split_layouts.handles(settings, split):  # an image folder or listed files (split_layouts checks them)
            continue
        present = [name for name in split_file_names(split, fmt) if (directory / name).is_file()]
        if len(present) == 1:
            continue
        if len(present) > 1:
            return canonical, f"{directory} holds both {present[0]} and {present[1]}; keep one"
        holds = sorted(path.name for path in directory.iterdir())
        fix = _other_format(directory, split, fmt, settings.task) or missing_split_fix(split, splits, available_splits(directory, fmt), fmt)
        return canonical, f"{directory / split_file_names(split, fmt)[0]} is missing (the directory holds {holds}); {fix}"
    return None


def check_local_splits(datasets: Mapping[str, "DatasetSettings"], source: str | None = None) -> None:
    """Refuse, when the workflow is parsed, a local source lacking the file of a mapped split."""
    for name, settings in datasets.items():
        if format_problem(settings):
            raise ConfigError(f"datasets.{name}.format", format_problem(settings), source)
        split_layouts.check_layouts(name, settings, source)
        if settings.source.type != "local":
            continue
        directory = Path(settings.source.path)
        if not directory.is_dir():
            raise ConfigError(f"datasets.{name}.source.path", f"{directory} is not a directory (it must hold one "
                              f"{split_file_names('<split>', settings.format)[0]} file per split)", source)
        problem = local_split_problem(directory, settings)
        if problem is not None:
            raise ConfigError(f"datasets.{name}.splits.{problem[0]}", problem[1], source)
        problem = encoding_problem(settings, f"datasets.{name}")
        if problem is not None:
            raise ConfigError(f"datasets.{name}.encoding", problem, source)


def encoding_problem(settings: "DatasetSettings", key: str) -> str | None:
    """Every local split file that starts like another encoding (a UTF-16/32 mark, NUL-interleaved text) while the
    dataset reads UTF-8, named in one message with the setting that reads them; None when there is none.
    Only the first bytes of each file are read (``file_formats.sniff_encoding``), so this is cheap at parse time."""
    import codecs

    if settings.format not in file_formats.LINE_FORMATS or (
            settings.encoding is not None and codecs.lookup(settings.encoding).name != "utf-8"):
        return None
    files = [str(path) for split in dict.fromkeys(settings.splits.values())
             for path in split_layouts.local_files(settings, split) if path.is_file()]
    found = {file: kind for file in files if (kind := file_formats.sniff_encoding(file))}
    return file_formats.encoding_problem(files, found, key) if found else None
