"""Stage ``pretokenise``: the dataset's task tokenises the normalised rows for one variant, in
batches with the model's fast tokenizer, and the token ids are saved with ``save_to_disk``.

What is tokenised and how (prompt/target with masked labels, text + label, lines for masked LM) is
the task's (``tasks/``); this stage runs it over each split, counts truncated and dropped rows, and
keeps the output fresh. Training opens the result with ``load_from_disk`` (memory-mapped Arrow), so
data-loader workers share pages instead of receiving pickled copies (seed: 1.5 GB pickled per rank).

``tokenise_meta.json`` holds a cache key over the task, the tokenizer files, the variant, the max length
and the input data files: an existing output with the same key is reused, anything else
re-tokenises (seen elsewhere: axolotl reusing a stale cache after the tokenizer changed).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.data.normalised_data import read_task_meta
from workflow_scripts.tasks import task_named
from workflow_scripts.core.atomic_output import atomic_path, write_json
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.core.experiment_config import config_hash
from workflow_scripts.core.stage_arguments import StageArgumentParser, json_setting

TRAINING_SPLITS = ("train", "validation")
META_NAME = "tokenise_meta.json"
FORMAT_VERSION = 1  # bump when the stored layout or the masking rule changes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   # a VLM's processor expands image placeholders and normalises pixels: part of the key too
                   "processor_config.json", "preprocessor_config.json")
BATCH_SIZE = 2000  # rows per tokenizer call: large enough to keep the tokenizer's thread pool busy


def files_fingerprint(directory: Path, names: Sequence[str] | None = None, pattern: str | None = None) -> str:
    """sha256 over (relative name, content hash) of the chosen files, in a stable order."""
    directory = Path(directory)
    if names is not None:
        paths = [directory / name for name in names if (directory / name).is_file()]
    else:
        paths = sorted(p for p in directory.rglob(pattern or "*") if p.is_file())
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def tokenizer_fingerprint(model_dir: Path) -> str:
    return files_fingerprint(model_dir, TOKENIZER_FILES)


def input_fingerprint(data_dir: Path) -> str:
    """The normalised data's content: its Arrow files and split list (not datasets' random fingerprints)."""
    digest = hashlib.sha256(files_fingerprint(data_dir, pattern="data-*.arrow").encode())
    dict_file = Path(data_dir) / "dataset_dict.json"
    if dict_file.is_file():
        digest.update(dict_file.read_bytes())
    return digest.hexdigest()


def cache_key(tokenizer_fp: str, variant: Mapping[str, Any], max_length: int, input_fp: str,
              task: str = "generation") -> str:
    return config_hash({"format": FORMAT_VERSION, "task": task, "tokenizer": tokenizer_fp, "templates": variant,
                        "max_length": max_length, "input": input_fp})


def use_tokenizer_threads(threads: int) -> None:
    """Parallelism is the fast tokenizer's own Rust thread pool, in this one process.

    Measured (benchmarks/bench_pretokenise.py): ``datasets.map(num_proc=2)`` was slower than one
    process (fork, pickling the tokenizer, merging shards), while batched calls on the tokenizer's
    pool scale. The pool reads these variables when it first starts, so set them before any encoding.
    """
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"


@contextlib.contextmanager
def cyclic_gc_paused():
    """The per-row lists made here hold no cycles, so reference counting frees them; meanwhile each
    full cyclic collection walks the ~400k objects the imports left (torch), which cost about 15%
    of the per-row time (measured 86 -> 73 us/row on one core)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def tokenise_split(task, dataset, tokenizer, variant: Mapping[str, Any], max_length: int, work: Path, split: str,
                   task_meta: Mapping[str, Any]):
    """The task's batched tokenising over one split, written to ``work`` (never beside the input data)."""
    return dataset.map(
        functools.partial(task.tokenise_batch, tokenizer=tokenizer, variant=dict(variant), max_length=max_length,
                          task_meta=task_meta),
        batched=True,
        batch_size=BATCH_SIZE,
        remove_columns=dataset.column_names,
        features=task.tokenised_features(),
        cache_file_name=str(work / f"{split}.arrow"),  # never beside the input data
        desc=f"tokenising {split}",
    )


def split_statistics(full) -> tuple[dict[str, Any], Any]:
    """The report's counts for one tokenised split, and the indices of the rows to keep (None: all).

    Read as Arrow columns: iterating ``full["length"]`` row by row in Python took a quarter of the stage.
    """
    import numpy as np
    import pyarrow.compute as pc

    table = full.with_format("arrow")
    lengths = table["length"]
    lost = table["dropped"].to_numpy(zero_copy_only=False)
    rows = len(full)
    kept = np.flatnonzero(~lost) if lost.any() else None
    stats = {
        "rows": rows,
        "kept": rows if kept is None else len(kept),
        "dropped": 0 if kept is None else rows - len(kept),
        "truncated": int(table["truncated"].to_numpy(zero_copy_only=False).sum()),
        "max_length_seen": pc.max(lengths).as_py() if rows else 0,
        "mean_length": pc.sum(lengths).as_py() / rows if rows else 0.0,
    }
    return stats, kept


def load_inputs(data_dir: Path, model_dir: Path):
    from workflow_scripts.model.model_loading import load_tokenizer
    from workflow_scripts.data.normalised_data import open_normalised

    if not (model_dir / "config.json").is_file():
        raise WorkflowError(f"{model_dir}: not a model directory (no config.json); run prepare_model first")
    data = open_normalised(data_dir)
    tokenizer = load_tokenizer(model_dir)
    return data, tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = StageArgumentParser(description="Pre-tokenise one dataset for one prompt variant.")
    parser.add_argument("--model", required=True, type=Path, help="Prepared model directory (its tokenizer is used).")
    parser.add_argument("--data", required=True, type=Path, help="Normalised DatasetDict directory.")
    parser.add_argument("--task", required=True, help="The dataset's task type (tasks.TASK_MODULES).")
    parser.add_argument("--variant", required=True, help="The variant as JSON (its keys depend on the task).")
    parser.add_argument("--max-length", required=True, type=int, help="Tokens per example, prompt and target together.")
    parser.add_argument("--threads", type=int, default=1, help="Threads of the fast tokenizer's pool (one process).")
    parser.add_argument("--out", required=True, type=Path, help="Tokenised DatasetDict directory to create.")
    parser.add_argument("--report", required=True, type=Path, help="Tokenise report JSON to write.")
    args = parser.parse_args(argv)
    task = task_named(args.task, "argument --task")
    variant = task.check_variant(json_setting(args.variant, "--variant"))
    if args.max_length < 2:
        raise WorkflowError(f"argument --max-length: {args.max_length} leaves no room for a prompt and a target")
    if args.threads < 1:
        raise WorkflowError(f"argument --threads: {args.threads} must be at least 1")

    use_tokenizer_threads(args.threads)
    data, tokenizer = load_inputs(args.data, args.model)
    task_meta = read_task_meta(args.data, args.task)
    try:  # a template naming a field the data lacks fails here, once, naming the data
        task.tokenise_batch(data["train"][:1], tokenizer=tokenizer, variant=variant, max_length=args.max_length,
                            task_meta=task_meta)
    except WorkflowError as error:
        raise WorkflowError(f"{args.data} split 'train' row 0: {error}") from None
    meta = {
        "tokenizer_fingerprint": tokenizer_fingerprint(args.model),
        "task": args.task,
        "templates": variant,
        "max_length": args.max_length,
        "input_fingerprint": input_fingerprint(args.data),
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "task_meta": task_meta,
        **task.tokenise_meta(variant, task_meta, tokenizer=tokenizer),
    }
    meta["cache_key"] = cache_key(meta["tokenizer_fingerprint"], variant, args.max_length, meta["input_fingerprint"],
                                  args.task)

    existing = args.out / META_NAME
    if existing.is_file():
        previous = json.loads(existing.read_text())
        if previous.get("cache_key") == meta["cache_key"] and "report" in previous:
            write_json(args.report, previous["report"])
            print(f"{args.out}: up to date (cache key {meta['cache_key'][:12]}); not re-tokenised")
            return 0

    from datasets import DatasetDict

    report = {"data": str(args.data), "model": str(args.model), "task": args.task, "templates": variant,
              "max_length": args.max_length, "cache_key": meta["cache_key"], "splits": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{args.out.name}.work.", dir=args.out.parent) as work:
        tokenised = {}
        for split in TRAINING_SPLITS:
            if split not in data:
                continue
            with cyclic_gc_paused():
                full = tokenise_split(task, data[split], tokenizer, variant, args.max_length, Path(work), split,
                                      task_meta)
            stats, kept_rows = split_statistics(full)
            kept = full if kept_rows is None else full.select(kept_rows)
            report["splits"][split] = stats
            if len(kept) == 0:
                raise WorkflowError(
                    f"{args.data} split '{split}': every prompt is at least --max-length {args.max_length} tokens, "
                    f"so no row keeps a target token{getattr(task, 'all_dropped_hint', '')}; raise training.max_length "
                    "or shorten the prompt template"
                )
            tokenised[split] = kept.remove_columns(["truncated", "dropped"])
        meta["report"] = report
        with atomic_path(args.out, directory=True) as out:
            DatasetDict(tokenised).save_to_disk(str(out))
            (out / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    write_json(args.report, report)
    for split, stats in report["splits"].items():
        print(f"{split}: {stats}")
    return 0


if __name__ == "__main__":
    run_main(main)
