"""Stage ``pretokenise``: the dataset's task tokenises the normalised rows for one variant, in
chunks of ``BATCH_SIZE`` rows with the model's fast tokenizer, and the token ids are written in
``save_to_disk``'s layout.

What is tokenised and how (prompt/target with masked labels, text + label, lines for masked LM) is
the task's (``tasks/``); this stage runs it over each split, counts truncated and dropped rows, and
keeps the output fresh. Training opens the result with ``load_from_disk`` (memory-mapped Arrow), so
data-loader workers share pages instead of receiving pickled copies (seed: 1.5 GB pickled per rank).

Streaming (``data/arrow_split``): the input is read chunk by chunk from its Arrow files (not through a
memory map) and the kept rows go straight to the output's record batches of up to 32,768 rows, so
memory does not grow with the corpus. ``--threads N``: a split of at least ``PROCESS_MIN_ROWS`` rows
is cut into N contiguous ranges at chunk boundaries, tokenised by N forked processes (one tokenizer
thread each) into piece files that are then appended in order: the output is byte-identical to one
process's. Smaller splits use the tokenizer's N threads in this process.

``tokenise_meta.json`` holds a cache key over the task, the tokenizer files, the variant, the max length
and the input data files: an existing output with the same key is reused, anything else
re-tokenises (seen elsewhere: axolotl reusing a stale cache after the tokenizer changed).
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.data import arrow_split
from workflow_scripts.data.fingerprints import input_fingerprint, tokenizer_fingerprint
from workflow_scripts.data.normalised_data import read_task_meta
from workflow_scripts.tasks import task_named, templates
from workflow_scripts.core.entry_settings import VariantSettings
from workflow_scripts.core.atomic_output import atomic_path, scratch_directory, stop_signals_exit, write_json
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.core.run_manifest import config_hash
from workflow_scripts.core.stage_arguments import StageArgumentParser

TRAINING_SPLITS = ("train", "validation")
META_NAME = "tokenise_meta.json"
FORMAT_VERSION = 3  # bump when the stored layout, the masking or the prompt rendering changes (2: large record
# batches; 3: masked LM word starts, and vision_language chat prompts as typed parts so a text-only control keeps
# its question)
BATCH_SIZE = 2000  # rows per tokenizer call (a chunk): large enough to keep the tokenizer's thread pool busy
PROCESS_MIN_ROWS = 10 * BATCH_SIZE  # a split this large is shared out between --threads processes
REPORT_COLUMNS = ("truncated", "dropped")  # counted for the report, not stored
NAMED_PER_COUNT = 20  # the report names the first rows of each count (truncated_ids, dropped_ids)


def cache_key(tokenizer_fp: str, variant: Mapping[str, Any], max_length: int, input_fp: str,
              task: str = "generation") -> str:
    return config_hash({"format": FORMAT_VERSION, "task": task, "tokenizer": tokenizer_fp, "templates": variant,
                        "max_length": max_length, "input": input_fp})


def use_tokenizer_threads(threads: int) -> None:
    """Threads of the fast tokenizer's own Rust pool in this process (1 where processes share the work).

    The pool reads these variables when it first starts, so set them before any encoding.
    """
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"


def process_count(threads: int, split_rows: Sequence[int]) -> int:
    """``--threads`` processes when a split is large enough to share out, else one (with ``threads``
    tokenizer threads). Processes split all of the work: the tokenizer's threads parallelise only its
    Rust encoder, 85% of a masked LM's time, so two of them reached 1.05x on two cores
    (benchmarks/RESULTS.md); forked processes each run everything on their own core."""
    return threads if threads > 1 and max(split_rows, default=0) >= PROCESS_MIN_ROWS else 1


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


@dataclass
class SplitStats:
    """The report's counts for one split, summed chunk by chunk (in any order)."""

    rows: int = 0
    dropped: int = 0
    truncated: int = 0
    max_length_seen: int = 0
    length_sum: int = 0
    truncated_ids: list = field(default_factory=list)  # the first NAMED_PER_COUNT, in row order
    dropped_ids: list = field(default_factory=list)

    def add(self, other: "SplitStats") -> None:
        """``other`` holds the rows after this one's (chunks and processes are added in row order)."""
        self.rows += other.rows
        self.dropped += other.dropped
        self.truncated += other.truncated
        self.truncated_ids = (self.truncated_ids + other.truncated_ids)[:NAMED_PER_COUNT]
        self.dropped_ids = (self.dropped_ids + other.dropped_ids)[:NAMED_PER_COUNT]
        self.max_length_seen = max(self.max_length_seen, other.max_length_seen)
        self.length_sum += other.length_sum

    def report(self) -> dict[str, Any]:
        return {"rows": self.rows, "kept": self.rows - self.dropped, "dropped": self.dropped,
                "truncated": self.truncated, "max_length_seen": self.max_length_seen,
                "truncated_ids": self.truncated_ids, "dropped_ids": self.dropped_ids,
                "mean_length": self.length_sum / self.rows if self.rows else 0.0}


@dataclass
class Tokeniser:
    """The task's batched tokenising of input chunks into the stored columns (dropped rows removed)."""

    task: Any
    tokenizer: Any
    variant: VariantSettings
    max_length: int
    task_meta: Mapping[str, Any]
    input_features: Any

    def __post_init__(self):
        from datasets.formatting import PythonFormatter

        self.features = self.task.tokenised_features()
        self.stored = type(self.features)({k: v for k, v in self.features.items() if k not in REPORT_COLUMNS})
        # As datasets.map hands a batch to the function: lazily decoded by the input's features.
        self.formatter = PythonFormatter(features=self.input_features, lazy=True)

    def chunk(self, table) -> tuple[Any, SplitStats]:
        """One input chunk -> (its kept rows as an Arrow table, its counts)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        output = self.task.tokenise_batch(self.formatter.format_batch(table), tokenizer=self.tokenizer,
                                          variant=self.variant, max_length=self.max_length,
                                          task_meta=self.task_meta)
        if not isinstance(output, pa.Table):
            if set(output) != set(self.features):
                raise WorkflowError(f"task {self.task.name}: tokenise_batch returned columns {sorted(output)}, but "
                                    f"tokenised_features declares {sorted(self.features)}")
            output = pa.Table.from_pydict(dict(output), schema=self.features.arrow_schema)  # as map's ArrowWriter
        lengths, dropped = output["length"], output["dropped"]
        rows = output.num_rows
        stats = SplitStats(rows=rows, dropped=int(pc.sum(dropped).as_py() or 0),
                           truncated=int(pc.sum(output["truncated"]).as_py() or 0),
                           max_length_seen=int(pc.max(lengths).as_py() or 0) if rows else 0,
                           length_sum=int(pc.sum(lengths).as_py() or 0))
        for flag, named in (("truncated", stats.truncated_ids), ("dropped", stats.dropped_ids)):
            if getattr(stats, flag):  # which rows, not only how many (filtered by Arrow, not per row in Python)
                named.extend(output["id"].filter(output[flag]).slice(0, NAMED_PER_COUNT).to_pylist())
        kept = output.filter(pc.invert(dropped)) if stats.dropped else output
        return kept.drop_columns(list(REPORT_COLUMNS)), stats

    def chunks(self, files: Sequence[Path], start: int = 0, stop: int | None = None):
        """(kept table, counts) of each ``BATCH_SIZE``-row chunk of rows ``[start, stop)``, read as a stream."""
        for table in arrow_split.row_chunks(arrow_split.read_batches(files), BATCH_SIZE, start, stop):
            yield self.chunk(table)


def chunk_ranges(rows: int, processes: int) -> list[tuple[int, int]]:
    """Contiguous row ranges, one per process, cut at multiples of ``BATCH_SIZE``: blocks are grouped per
    chunk, so the chunks (and the result) are those of one process reading the whole split."""
    chunks = -(-rows // BATCH_SIZE)
    per = -(-chunks // max(processes, 1))
    return [(k * per * BATCH_SIZE, min((k + 1) * per * BATCH_SIZE, rows)) for k in range(processes)
            if k * per * BATCH_SIZE < rows]


def _die_with_parent(parent: int) -> None:
    """A process that tokenises for a killed stage must not outlive it (Linux's PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the call above
        os._exit(1)


def _tokenise_piece(connection, parent: int, tokeniser: Tokeniser, files, start: int, stop: int, piece: Path) -> None:
    """In a forked process: rows ``[start, stop)`` -> ``piece`` (one stream, any batching), then
    ``("ok", counts, [(rows, nbytes) per non-empty chunk])`` or ``("error", message)`` on ``connection``."""
    import pyarrow as pa

    _die_with_parent(parent)
    try:
        stats, units = SplitStats(), []
        with cyclic_gc_paused(), pa.OSFile(str(piece), "wb") as sink, \
                pa.ipc.new_stream(sink, tokeniser.stored.arrow_schema) as writer:
            for kept, chunk_stats in tokeniser.chunks(files, start, stop):
                stats.add(chunk_stats)
                if kept.num_rows:
                    units.append((kept.num_rows, kept.nbytes))
                    writer.write_table(kept)
        connection.send(("ok", stats, units))
    except WorkflowError as error:
        connection.send(("error", str(error)))


def _piece_units(piece: Path, units: Sequence[tuple[int, int]]):
    """The units a process wrote, read back as (table, nbytes as it measured them)."""
    import pyarrow as pa

    batches = arrow_split.read_batches([piece])
    for rows, nbytes in units:
        parts, got = [], 0
        while got < rows:
            parts.append(next(batches))
            got += parts[-1].num_rows
        yield pa.Table.from_batches(parts), nbytes


def tokenise_in_processes(tokeniser: Tokeniser, files, rows: int, processes: int, work: Path, split: str,
                          writer: arrow_split.SplitWriter) -> SplitStats:
    """Each process tokenises a contiguous range into a piece file; the pieces are then appended in
    order, so the written split is byte-identical to one process's."""
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork")  # the tokenizer and the task are inherited, not pickled
    ranges = chunk_ranges(rows, processes)
    pieces = [work / f"{split}-{k}.arrow" for k in range(len(ranges))]
    children, receivers = [], {}
    results: list = [None] * len(ranges)
    try:
        for k, ((start, stop), piece) in enumerate(zip(ranges, pieces)):
            receiver, sender = context.Pipe(duplex=False)
            child = context.Process(target=_tokenise_piece, daemon=True, name=f"pretokenise-{split}-{k}",
                                    args=(sender, os.getpid(), tokeniser, files, start, stop, piece))
            child.start()
            sender.close()
            children.append(child)
            receivers[receiver] = k
        while receivers:
            for receiver in wait(list(receivers)):
                k = receivers.pop(receiver)
                try:
                    results[k] = receiver.recv()
                except EOFError:
                    children[k].join()
                    raise WorkflowError(
                        f"split '{split}' rows {ranges[k][0]}-{ranges[k][1] - 1}: the tokenising process ended with "
                        f"exit code {children[k].exitcode} and no result (killed, or out of memory?); rerun with "
                        "--threads 1 to see its error") from None
                if results[k][0] == "error":
                    raise WorkflowError(results[k][1])
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()
        for child in children:
            child.join()
    stats = SplitStats()
    for (_, piece_stats, units), piece in zip(results, pieces):
        stats.add(piece_stats)
        for table, nbytes in _piece_units(piece, units):
            writer.write(table, nbytes)
        piece.unlink()
    return stats


def tokenise_split(tokeniser: Tokeniser, files, rows: int, processes: int, work: Path, split: str,
                   writer: arrow_split.SplitWriter) -> SplitStats:
    """Tokenise one split into ``writer``, streaming: no more than a chunk and a record batch in memory."""
    if processes > 1 and rows >= PROCESS_MIN_ROWS:
        return tokenise_in_processes(tokeniser, files, rows, processes, work, split, writer)
    stats = SplitStats()
    with cyclic_gc_paused():
        for kept, chunk_stats in tokeniser.chunks(files):
            stats.add(chunk_stats)
            writer.write(kept)
    return stats


def open_inputs(data_dir: Path, model_dir: Path):
    """The normalised data (memory-mapped: only its row counts, features and files are read here)."""
    from workflow_scripts.data.normalised_data import open_normalised

    if not (model_dir / "config.json").is_file():
        raise WorkflowError(f"{model_dir}: not a model directory (no config.json); run prepare_model first")
    return open_normalised(data_dir), model_dir


def load_tokenizer_for(model_dir: Path):
    from workflow_scripts.model.model_loading import load_tokenizer

    return load_tokenizer(model_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = StageArgumentParser(description="Pre-tokenise one dataset for one prompt variant.")
    parser.add_argument("--model", required=True, type=Path, help="Prepared model directory (its tokenizer is used).")
    parser.add_argument("--data", required=True, type=Path, help="Normalised DatasetDict directory.")
    parser.add_argument("--task", required=True, help="The dataset's task type (tasks.TASK_MODULES).")
    parser.add_argument("--variant", required=True, help="The variant as JSON (its keys depend on the task).")
    parser.add_argument("--max-length", required=True, type=int, help="Tokens per example, prompt and target together.")
    parser.add_argument("--threads", type=int, default=1,
                        help="Cores: processes for a split of at least PROCESS_MIN_ROWS rows, else tokenizer threads.")
    parser.add_argument("--out", required=True, type=Path, help="Tokenised DatasetDict directory to create.")
    parser.add_argument("--report", required=True, type=Path, help="Tokenise report JSON to write.")
    args = parser.parse_args(argv)
    task = task_named(args.task, "argument --task")
    variant = task.check_variant(VariantSettings.from_json(args.variant, args.task))
    if args.max_length < 2:
        raise WorkflowError(f"argument --max-length: {args.max_length} leaves no room for a prompt and a target")
    if args.threads < 1:
        raise WorkflowError(f"argument --threads: {args.threads} must be at least 1")

    with stop_signals_exit():  # a stopped stage removes its temporary files on the way out
        return tokenise_all(args, task, variant)


def tokenise_all(args, task, variant: VariantSettings) -> int:
    data, tokenizer_dir = open_inputs(args.data, args.model)
    from workflow_scripts.model.model_loading import check_task_architecture

    check_task_architecture(args.model, task)  # e.g. a generation dataset on a BERT: one message, not a traceback
    splits = [split for split in TRAINING_SPLITS if split in data]
    processes = process_count(args.threads, [len(data[split]) for split in splits])
    use_tokenizer_threads(1 if processes > 1 else args.threads)
    tokenizer = load_tokenizer_for(tokenizer_dir)
    task_meta = read_task_meta(args.data, args.task)
    try:  # a template naming a field the data lacks fails here, once, naming the data
        task.tokenise_batch(data["train"][:1], tokenizer=tokenizer, variant=variant, max_length=args.max_length,
                            task_meta=task_meta)
    except templates.NoEosToken:  # the model's fault, not the row's
        raise
    except WorkflowError as error:
        raise WorkflowError(f"{args.data} split 'train' row 0: {error}") from None
    record = task.variant_record(variant)  # the variant as the cache key and the records have always held it
    meta = {
        "tokenizer_fingerprint": tokenizer_fingerprint(args.model),
        "task": args.task,
        "templates": record,
        "max_length": args.max_length,
        "input_fingerprint": input_fingerprint(args.data),
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "task_meta": task_meta,
        **task.tokenise_meta(variant, task_meta, tokenizer=tokenizer),
    }
    meta["cache_key"] = cache_key(meta["tokenizer_fingerprint"], record, args.max_length, meta["input_fingerprint"],
                                  args.task)

    existing = args.out / META_NAME
    if existing.is_file():
        previous = json.loads(existing.read_text())
        if previous.get("cache_key") == meta["cache_key"] and "report" in previous:
            write_json(args.report, previous["report"])
            print(f"{args.out}: up to date (cache key {meta['cache_key'][:12]}); not re-tokenised")
            return 0

    report = {"data": str(args.data), "model": str(args.model), "task": args.task, "templates": record,
              "max_length": args.max_length, "cache_key": meta["cache_key"], "splits": {}}
    with scratch_directory(args.out) as work, atomic_path(args.out, directory=True) as out:
        for split in splits:
            tokeniser = Tokeniser(task, tokenizer, variant, args.max_length, task_meta, data[split].features)
            fingerprint = hashlib.sha256(f"{meta['cache_key']}/{split}".encode()).hexdigest()[:16]
            writer = arrow_split.SplitWriter(out / split, tokeniser.stored, split, fingerprint)
            try:
                stats = tokenise_split(tokeniser, [Path(f["filename"]) for f in data[split].cache_files],
                                       len(data[split]), processes, work, split, writer)
            except BaseException:
                writer.abort()
                raise
            report["splits"][split] = stats.report()
            if stats.rows == stats.dropped:
                writer.abort()
                raise WorkflowError(
                    f"{args.data} split '{split}': every prompt is at least --max-length {args.max_length} tokens, "
                    f"so no row keeps a target token{getattr(task, 'all_dropped_hint', '')}; raise training.max_length "
                    "or shorten the prompt template"
                )
            writer.close()
        arrow_split.write_dataset_dict(out, splits)
        meta["report"] = report
        (out / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    write_json(args.report, report)
    for split, stats in report["splits"].items():
        print(f"{split}: {stats}")
    return 0


if __name__ == "__main__":
    run_main(main)
