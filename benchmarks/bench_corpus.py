"""Benchmark: a plain-text corpus of 1M and 10M lines through normalise and pretokenise (task masked_lm).

The corpus is generated at bench time into a temporary directory (never committed): deterministic
lines of 10-40 words (log-normal, median 20), half Chinese (words of 1-3 characters, ``，`` and
``。``, 5% Latin words mixed in) and half Latin-script words made of syllables, Zipf-distributed, as
a stand-in for the CNM-BERT seed's 14.7M-line Chinese/English corpus. The 1M-line file is the first
million lines of the 10M-line one. The tokenizer is a WordPiece fast tokenizer set up as
bert-base-chinese's (BertNormalizer splitting Chinese characters, case kept; BertPreTokenizer;
``[CLS] line [SEP]``), trained offline with ``tokenizers`` on the corpus' first lines and saved with
a tiny BERT config as a model directory (pretokenise reads only the tokenizer).

Measured, each in a fresh process pinned to N cores (``sched_setaffinity`` before any thread pool
starts, ``RAYON_NUM_THREADS=N``), timed from after its imports, with wall and CPU seconds, the
peak RSS of its largest process (``ru_maxrss`` of RUSAGE_SELF and RUSAGE_CHILDREN: pretokenise
``--threads 2`` forks two tokenising processes) and a 0.1 s sampler of RSS, RssAnon and RssFile
summed over it and its children:
- the stages as the rules run them: ``normalise.main`` (1 core; its ``text_lines.write_normalised``
  part timed apart) and ``pretokenise.main`` (``--threads 1`` on one core and ``--threads 2`` on two at
  1M; ``--threads 2`` at 10M; its ``tokenise_split`` part timed apart), on the 1M and the 10M corpus;
- the tokenizer alone: ``tokenizer(batch)`` over the corpus' first lines in batches of pretokenise's
  batch size (``TOKENIZERS_PARALLELISM=false`` on one core; two Rayon threads on two), the lines read
  into a list first (not timed), and the Rust encoder alone (``backend_tokenizer.encode_batch``);
- what a user would write: ``datasets.load_dataset("text", ...)`` then ``.map(tokenize, batched=True,
  num_proc=2)`` with run_mlm.py's ``tokenize_function`` (``return_special_tokens_mask=True``, no
  ``group_texts``), on two cores;
- PSS (/proc/<pid>/smaps_rollup) of main + W DataLoader workers reading the same batches of the
  tokenised set with the train stage's TokenisedSplit, batch plan and the masked_lm collator, for
  W = 1 and 3, on the 1M and the 10M set: (PSS(3) - PSS(1)) / 2 is what each extra worker adds.

The long part is the 10M-line pretokenise (the tokenizer alone needs ~100 us a line on one core of
the 2-core development machine); repetitions at 1M come after everything was measured once and are
dropped when ``run.py``'s deadline is near. ``BENCH_CORPUS_LINES=small,large`` overrides the sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.records import Goal, Series, record

NAME = "corpus_pretokenise"
TITLE = "Text corpus (masked LM): normalise + pretokenise of 1M and 10M lines, vs the tokenizer alone and datasets.map"
MIN_SECONDS = 1300  # every measurement once at full scale on 2 quiet cores (the 10M-line pretokenise ~15 min)
REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
# BENCH_CORPUS_LINES="20000,200000" overrides the two corpus sizes (development on a shared machine).
SIZES_VARIABLE = "BENCH_CORPUS_LINES"
SCALES = {
    # tokenizer_lines: the first lines of the smaller corpus timed through the tokenizer alone;
    # train_lines: those the WordPiece vocabulary is trained on.
    "full": {"sizes": (1_000_000, 10_000_000), "repetitions": 3, "tokenizer_lines": 200_000, "train_lines": 100_000,
             "worker_batches": 150, "batch_size": 32, "worker_repetitions": 2},
    "tiny": {"sizes": (2_000, 8_000), "repetitions": 1, "tokenizer_lines": 2_000, "train_lines": 2_000,
             "worker_batches": 8, "batch_size": 8, "worker_repetitions": 1},
}
CHUNK_LINES = 100_000  # generated per seeded chunk: a smaller corpus is a prefix of a larger one
VARIANT = {"mask_rate": 0.15, "grouping": "blocks"}
MAX_LENGTH = 128  # BERT's phase-1 pretraining length; blocks of exactly this many tokens
VOCAB_SIZE = 30_522  # bert-base-uncased's
ENCODER_LINES = 50_000  # lines timed through the Rust encoder alone (its share of the stage's time)
BATCH_SIZE = 2000  # rows per tokenizer call, as pretokenise.BATCH_SIZE (checked in run())
WORKERS = (1, 3)
SEED = 2024
# Words per line: log-normal, median 20, clipped to 10..40 (sentence lengths are right-skewed).
WORDS_MEDIAN, WORDS_SIGMA, WORDS_MIN, WORDS_MAX = 20, 0.4, 10, 40
# Characters per Chinese word (1, 2, 3): mean 1.8, as in segmented Chinese running text.
CHINESE_WORD_CHARS = (0.35, 0.5, 0.15)


# The corpus ---------------------------------------------------------------------------------------
_SYLLABLES = [c + v for c in ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
                              "z", "st", "tr", "ch", "sh")
              for v in ("a", "e", "i", "o", "u", "ai", "ou", "er", "an", "in")]


def _unique_words(rng: np.random.Generator, alphabet: list[str], count: int, low: int, high: int,
                  p: np.ndarray | None = None, lengths_p: tuple[float, ...] | None = None) -> list[str]:
    words: set[str] = set()
    while len(words) < count:
        lengths = rng.choice(np.arange(low, high + 1), size=2 * count, p=lengths_p)
        parts = rng.choice(len(alphabet), size=int(lengths.sum()), p=p).tolist()
        start = 0
        for end in np.cumsum(lengths).tolist():
            words.add("".join(alphabet[k] for k in parts[start:end]))
            start = end
    ordered = sorted(words)
    return [ordered[k] for k in rng.permutation(len(ordered))[:count]]


def _zipf(n: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1)
    return weights / weights.sum()


DRAW_BUCKETS = 1 << 22


def _inverse_cdf(p: np.ndarray) -> np.ndarray:
    """A lookup table: ``table[uniform integer below DRAW_BUCKETS]`` draws index k with probability
    ``p[k]`` to within 1/DRAW_BUCKETS (10x faster than ``Generator.choice(p=...)``)."""
    return np.searchsorted(np.cumsum(p), (np.arange(DRAW_BUCKETS) + 0.5) / DRAW_BUCKETS).clip(0, len(p) - 1).astype(np.int32)


class CorpusGenerator:
    """Deterministic lines: chunk ``c`` of ``CHUNK_LINES`` lines comes from seed (SEED, c) alone."""

    def __init__(self, seed: int = SEED):
        rng = np.random.default_rng(seed)
        latin = _unique_words(rng, _SYLLABLES, 50_000, 1, 4) + [str(k) for k in range(2000)]
        hanzi = [chr(0x4E00 + k) for k in rng.permutation(0x9FA5 - 0x4E00)[:3500]]
        chinese = _unique_words(rng, hanzi, 20_000, 1, 3, _zipf(len(hanzi)), lengths_p=CHINESE_WORD_CHARS)
        self.seed, self.latin, self.chinese = seed, len(latin), len(chinese)
        # Piece table: " word", "Word" (line start), Chinese words, then separators and line ends.
        table = [" " + w for w in latin] + [w.capitalize() for w in latin] + chinese + ["", ",", "，", ".\n", "。\n"]
        encoded = [piece.encode() for piece in table]
        self.blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self.piece_len = np.array([len(b) for b in encoded], dtype=np.int32)
        self.piece_off = (np.cumsum(self.piece_len, dtype=np.int32) - self.piece_len).astype(np.int32)
        base = 2 * len(latin) + len(chinese)
        self.empty, self.comma, self.comma_zh, self.end, self.end_zh = range(base, base + 5)
        self.draw_latin, self.draw_chinese = _inverse_cdf(_zipf(len(latin))), _inverse_cdf(_zipf(len(chinese)))

    def chunk(self, index: int, lines: int = CHUNK_LINES) -> bytes:
        rng = np.random.default_rng([self.seed, index])
        chinese_line = rng.random(lines) < 0.5
        words = np.clip(np.rint(rng.lognormal(np.log(WORDS_MEDIAN), WORDS_SIGMA, size=lines)),
                        WORDS_MIN, WORDS_MAX).astype(np.int64)
        total = int(words.sum())
        starts = np.concatenate([[0], np.cumsum(words)[:-1]])
        line_of = np.repeat(np.arange(lines), words)
        first = np.zeros(total, dtype=bool)
        first[starts] = True
        last = np.zeros(total, dtype=bool)
        last[starts + words - 1] = True
        zh = chinese_line[line_of] & (rng.random(total) >= 0.05)  # a Chinese line keeps 5% Latin words
        ids = np.where(zh, 2 * self.latin + self.draw_chinese[rng.integers(0, DRAW_BUCKETS, size=total)],
                       self.draw_latin[rng.integers(0, DRAW_BUCKETS, size=total)])
        ids = np.where(first & ~zh, ids + self.latin, ids)  # a Latin line starts with a capital, no space
        zh_line = chinese_line[line_of]
        separators = np.where(rng.random(total) < 0.08, np.where(zh_line, self.comma_zh, self.comma), self.empty)
        separators = np.where(last, np.where(zh_line, self.end_zh, self.end), separators)
        stream = np.empty(2 * total, dtype=np.int32)
        stream[0::2], stream[1::2] = ids, separators
        # Byte k of the chunk is byte (k - start of its piece in the chunk) of its piece in the table;
        # int32 throughout (a chunk is ~20 MB): int64 index arrays made this 4x slower.
        lengths = self.piece_len[stream]
        out_start = np.cumsum(lengths, dtype=np.int32) - lengths
        source = np.repeat(self.piece_off[stream] - out_start, lengths)
        source += np.arange(len(source), dtype=np.int32)
        return self.blob[source].tobytes()


def write_corpora(directories: dict[int, Path], generator: CorpusGenerator) -> dict[int, dict]:
    """``<dir>/train.txt`` of each size (prefixes of the largest) and a small ``test.txt``; sizes in bytes."""
    largest = max(directories)
    handles = {}
    for size, directory in directories.items():
        directory.mkdir(parents=True, exist_ok=True)
        handles[size] = open(directory / "train.txt", "wb")
        (directory / "test.txt").write_bytes(generator.chunk(10**6, min(1000, size)))
    try:
        written = 0
        for index in range(-(-largest // CHUNK_LINES)):
            lines = min(CHUNK_LINES, largest - written)
            block = generator.chunk(index)
            if lines < CHUNK_LINES:
                block = b"".join(block.splitlines(keepends=True)[:lines])
            for size, handle in handles.items():
                if written < size:
                    keep = min(lines, size - written)
                    handle.write(block if keep == lines else b"".join(block.splitlines(keepends=True)[:keep]))
            written += lines
    finally:
        for handle in handles.values():
            handle.close()
    return {size: {"lines": size, "bytes": (directory / "train.txt").stat().st_size}
            for size, directory in directories.items()}


def build_model_dir(corpus: Path, out: Path, lines: int) -> dict:
    """A WordPiece tokenizer trained on the corpus' first ``lines`` lines, saved with a tiny BERT config."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, PreTrainedTokenizerFast

    def head():
        with open(corpus, encoding="utf-8") as handle:
            for k, line in enumerate(handle):
                if k >= lines:
                    return
                yield line.rstrip("\n")

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    # bert-base-chinese's normaliser (the seed continued Chinese BERT): cleaned, CJK characters split
    # into words of their own, case and accents kept.
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                    lowercase=False)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.train_from_iterator(head(), trainers.WordPieceTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=MAX_LENGTH, pad_token_id=tokenizer.pad_token_id)
    config.to_json_file(str(out / "config.json"))
    return {"kind": "WordPiece, BERT-style as bert-base-chinese (BertNormalizer: Chinese characters split, "
                    "case kept; BertPreTokenizer; [CLS] line [SEP])",
            "vocab_size": len(tokenizer), "trained_on_lines": lines}


# Measuring inside a probe process -------------------------------------------------------------------
def _status_bytes(pid: int) -> dict[str, int]:
    found = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                found[key] = int(line.split()[1]) * 1024
    return found


class MemorySampler:
    """Peak RSS and RssAnon summed over this process and its children, sampled every ``interval`` s."""

    def __init__(self, interval: float = 0.1):
        import psutil

        self.interval, self.me = interval, psutil.Process()
        self.peak = {"rss": 0, "anon": 0, "file": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        total = {"rss": 0, "anon": 0, "file": 0}
        for pid in [self.me.pid] + [c.pid for c in self.me.children(recursive=True)]:
            try:
                status = _status_bytes(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
            total["rss"] += status.get("VmRSS", 0)
            total["anon"] += status.get("RssAnon", 0)
            total["file"] += status.get("RssFile", 0)
        for key in total:
            self.peak[key] = max(self.peak[key], total[key])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def _max_rss() -> dict[str, int]:
    return {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def _cpu_seconds() -> float:
    """CPU time of this process and its waited-for children (user + system)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_ACTIVE: list[MemorySampler] = []  # the sampler of the running _timed, for phases inside it


def _timed(action) -> dict:
    baseline = _status_bytes(os.getpid())
    with MemorySampler() as sampler:
        _ACTIVE.append(sampler)
        cpu, started = _cpu_seconds(), time.perf_counter()
        try:
            extra = action() or {}
        finally:
            _ACTIVE.pop()
        seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu, "baseline_rss": baseline["VmRSS"], "baseline_anon": baseline["RssAnon"],
            "peak_rss": _max_rss()["self"], "peak_rss_children": _max_rss()["children"],
            "sampled_peak": sampler.peak, **extra}


def probe_normalise(raw: Path, out: Path) -> dict:
    """The normalise stage; its text_lines.write_normalised part (streaming the lines into Arrow) is timed
    apart from what the stage does after it (the train/test contamination check)."""
    from workflow_scripts import normalise
    from workflow_scripts.data import text_lines

    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(raw)}, "format": "text",
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy"}
    report = out.parent / f"{out.name}.report.json"
    write: dict = {}

    def action():
        code = normalise.main(["--name", "corpus", "--dataset", json.dumps(settings), "--raw", str(raw),
                               "--out", str(out), "--report", str(report)])
        if code:
            raise RuntimeError(f"normalise exited with {code}")

    restore = _phase(text_lines, "write_normalised", write)
    try:
        result = _timed(action)
    finally:
        restore()
    result["lines"] = json.loads(report.read_text())["splits"]["train"]["kept"]
    result["write"] = write
    return result


def _phase(module, name: str, into: dict):
    """Wrap ``module.name`` to record its wall and CPU seconds (summed over calls) and the peak RSS
    (ru_maxrss, and the running sampler's RssAnon / RssFile peaks) when it returns."""
    original = getattr(module, name)

    def timed(*args, **kwargs):
        cpu, started = _cpu_seconds(), time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into["seconds"] = into.get("seconds", 0.0) + time.perf_counter() - started
            into["cpu_seconds"] = into.get("cpu_seconds", 0.0) + _cpu_seconds() - cpu
            into["peak_rss"] = _max_rss()["self"]
            if _ACTIVE:
                _ACTIVE[-1].sample()
                into["sampled_peak"] = dict(_ACTIVE[-1].peak)

    setattr(module, name, timed)
    return lambda: setattr(module, name, original)


def probe_pretokenise(model: Path, data: Path, out: Path, threads: int) -> dict:
    """The pretokenise stage; its tokenising part (pretokenise.tokenise_split: reading, tokenising and
    writing each split, in N processes with --threads N) is timed apart from the rest (loading, the key)."""
    from workflow_scripts import pretokenise

    report = out.parent / f"{out.name}.report.json"
    mapped: dict = {}

    def action():
        code = pretokenise.main(["--model", str(model), "--data", str(data), "--task", "masked_lm",
                                 "--variant", json.dumps(VARIANT), "--max-length", str(MAX_LENGTH),
                                 "--threads", str(threads), "--out", str(out), "--report", str(report)])
        if code:
            raise RuntimeError(f"pretokenise exited with {code}")

    restore = _phase(pretokenise, "tokenise_split", mapped)
    try:
        result = _timed(action)
    finally:
        restore()
    from datasets import load_from_disk

    result["lines"] = len(load_from_disk(str(data))["train"])
    result["report"] = json.loads(report.read_text())["splits"]["train"]
    result["map"] = mapped
    result["processes"] = pretokenise.process_count(threads, [result["lines"]])
    result["process_min_rows"] = pretokenise.PROCESS_MIN_ROWS
    return result


def _read_lines(path: Path, limit: int | None) -> list[str]:
    lines = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            lines.append(line.rstrip("\n"))
            if limit is not None and len(lines) >= limit:
                break
    return lines


def probe_tokenizer(model: Path, corpus: Path, limit: int | None, batch_size: int) -> dict:
    """``tokenizer(batch)`` over the lines: the tokenizer's own batched throughput, its output
    returned as Python lists as it is to any caller (transformers' BatchEncoding)."""
    from workflow_scripts.model.model_loading import load_tokenizer

    tokenizer = load_tokenizer(model)
    lines = _read_lines(corpus, limit)
    tokenizer(lines[:batch_size])  # warm-up: the first call builds caches and the thread pool
    tokens = 0
    cpu, started = _cpu_seconds(), time.perf_counter()
    for start in range(0, len(lines), batch_size):
        encoded = tokenizer(lines[start:start + batch_size])
        tokens += sum(map(len, encoded["input_ids"]))
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    encoder_lines = lines[:ENCODER_LINES]
    rust_cpu, started = _cpu_seconds(), time.perf_counter()
    for start in range(0, len(encoder_lines), batch_size):  # the Rust encoder alone, no Python lists
        tokenizer.backend_tokenizer.encode_batch(encoder_lines[start:start + batch_size])
    rust, rust_cpu = time.perf_counter() - started, _cpu_seconds() - rust_cpu
    return {"lines": len(lines), "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu,
            "encoder_lines": len(encoder_lines), "rust_seconds": rust, "rust_cpu_seconds": rust_cpu,
            "peak_rss": _max_rss()["self"]}


def probe_map(model: Path, corpus: Path, cache: Path, num_proc: int) -> dict:
    """What a user would write: load_dataset("text") then map(tokenize, batched=True, num_proc)."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))

    def tokenize_function(examples):  # transformers' examples/pytorch/language-modeling/run_mlm.py
        return tokenizer(examples["text"], return_special_tokens_mask=True)

    loaded = {}

    def load():
        loaded["data"] = datasets.load_dataset("text", data_files={"train": str(corpus)}, cache_dir=str(cache),
                                               split="train")

    def tokenise():
        mapped = loaded["data"].map(tokenize_function, batched=True, num_proc=num_proc, remove_columns=["text"])
        return {"rows": len(mapped)}

    load_result = _timed(load)
    map_result = _timed(tokenise)
    return {"lines": len(loaded["data"]), "load": load_result, "map": map_result,
            "seconds": load_result["seconds"] + map_result["seconds"]}


def _smaps_pss(pid: int) -> dict[str, int]:
    wanted = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file"}
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            key = line.split(maxsplit=1)[0]
            if key in wanted:
                found[wanted[key]] = int(line.split()[1]) * 1024
    return found


def family_pss() -> dict:
    import psutil

    members = [os.getpid()] + [c.pid for c in psutil.Process().children(recursive=True)]
    parts = []
    for pid in members:
        try:
            parts.append({"pid": pid, **_smaps_pss(pid)})
        except (FileNotFoundError, ProcessLookupError):
            pass
    return {key: sum(p.get(key, 0) for p in parts) for key in ("pss", "anon", "file")} | {"processes": parts}


def probe_workers(data: Path, workers: int, batches: int, batch_size: int) -> dict:
    """PSS of main + ``workers`` persistent DataLoader workers after reading the first ``batches`` batches
    of the train stage's batch plan, masked by the task's collator (the same batches for any W)."""
    import torch
    from torch.utils.data import DataLoader

    from workflow_scripts.data import batching
    from workflow_scripts.tasks import task_named

    torch.set_num_threads(1)
    meta = json.loads((data / "tokenise_meta.json").read_text())
    task = task_named("masked_lm")
    dataset = batching.TokenisedSplit(data, "train", columns=("special_tokens_mask", "word_start"))
    plan = batching.GlobalBatchPlan(dataset.lengths(), batch_size, seed=0)
    sampler = batching.RankBatchSampler(plan, batch_size, 0, 1, 0, min(batches, plan.batches_per_epoch))
    collator = task.collator(meta, meta["vocab_size"], seed=0)
    before = family_pss()
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers, collate_fn=collator,
                        persistent_workers=True, multiprocessing_context="fork", prefetch_factor=2)
    rows = 0
    started = time.perf_counter()
    for batch in loader:
        rows += batch["input_ids"].shape[0]
    seconds = time.perf_counter() - started
    after = family_pss()  # persistent workers: still alive here
    return {"workers": workers, "rows": rows, "seconds": seconds, "set_rows": len(dataset),
            "record_batches": len(dataset.table.data.to_batches()), "before": before, "after": after}


PROBES = {"normalise": probe_normalise, "pretokenise": probe_pretokenise, "tokenizer": probe_tokenizer,
          "map": probe_map, "workers": probe_workers}


def run_probe(kind: str, cores: int, **arguments) -> dict:
    """One measurement in a fresh interpreter pinned to ``cores`` cores."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(cores), OMP_NUM_THREADS=str(cores),
               HF_DATASETS_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="true" if cores > 1 else "false")
    if kind == "map":  # each of map's processes encodes on its own core
        env["TOKENIZERS_PARALLELISM"] = "false"
    if "cache" in arguments:
        env["HF_DATASETS_CACHE"] = str(arguments["cache"])  # never the shared ~/.cache
    payload = json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in arguments.items()})
    command = [sys.executable, "-m", "benchmarks.bench_corpus", "--probe", kind, "--cores", str(cores),
               "--arguments", payload]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"corpus probe {kind} ({arguments}) failed: {(done.stderr or done.stdout)[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def available_cores(threads: int = 2, seconds: float = 1.0) -> float:
    """Cores this process actually gets now: CPU / wall seconds of ``threads`` threads hashing (hashlib
    releases the GIL) for about ``seconds``. On an idle 2-core machine it is close to 2; other jobs lower it."""
    import hashlib

    block = b"\0" * (1 << 20)
    stop = time.perf_counter() + seconds

    def spin() -> None:
        digest = hashlib.sha256()
        while time.perf_counter() < stop:
            digest.update(block)

    workers = [threading.Thread(target=spin) for _ in range(threads)]
    cpu, started = time.process_time(), time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return (time.process_time() - cpu) / (time.perf_counter() - started)


def _sizes(scale: str) -> tuple[int, int]:
    override = os.environ.get(SIZES_VARIABLE)
    if override:
        small, large = (int(x.replace("_", "")) for x in override.split(","))
        return small, large
    return SCALES[scale]["sizes"]


def _rate(result: dict, lines: int, clock: str = "seconds") -> float:
    return lines / result[clock]


def run(scale: str = "full", work_dir: Path | None = None, log=print, deadline: float | None = None) -> dict:
    """``deadline`` (time.monotonic()): repetitions beyond the first are dropped when they would not
    finish by then (recorded in the notes). ``BENCH_CORPUS_LINES=small,large`` overrides the sizes."""
    from workflow_scripts import pretokenise as stage

    if stage.BATCH_SIZE != BATCH_SIZE:
        raise RuntimeError(f"pretokenise now calls the tokenizer with {stage.BATCH_SIZE} rows; set BATCH_SIZE to match")
    settings = SCALES[scale]
    small, large = _sizes(scale)
    two = min(2, len(os.sched_getaffinity(0)))
    planned = settings["repetitions"]
    skipped: list[str] = []
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-corpus-", dir=work_dir) as tmp:
        work = Path(tmp)
        started = time.monotonic()
        raw = {small: work / "raw-small", large: work / "raw-large"}
        corpora = write_corpora(raw, CorpusGenerator())
        generated = time.monotonic() - started
        model = work / "model"
        tokenizer_info = build_model_dir(raw[small] / "train.txt", model, min(settings["train_lines"], small))
        log(f"  corpus: {small:,} and {large:,} lines ({corpora[large]['bytes'] / MiB:,.0f} MiB) generated in "
            f"{generated:.0f} s; tokenizer: {tokenizer_info['vocab_size']:,} WordPiece tokens")
        runs: dict[str, list[dict]] = {}
        seconds: dict[str, float] = {}
        cores_free: list[float] = []  # available_cores() before each 2-core measurement

        def measure(key: str, kind: str, cores: int, **arguments) -> dict:
            begun = time.monotonic()
            result = run_probe(kind, cores, **arguments)
            seconds[key] = time.monotonic() - begun
            runs.setdefault(key, []).append(result)
            lines = result.get("lines") or small
            cpu = f", {result['cpu_seconds']:.1f} s CPU" if "cpu_seconds" in result else ""  # map: children's not counted
            log(f"  {key} #{len(runs[key])}: {_rate(result, lines):,.0f} lines/s ({result['seconds']:.1f} s{cpu})")
            return result

        def normalise(size: int, name: str) -> Path:
            out = work / name
            shutil.rmtree(out, ignore_errors=True)
            measure(f"normalise-{size}", "normalise", 1, raw=raw[size], out=out)
            return out

        def pretokenise(size: int, data: Path, threads: int, keep: bool = False) -> Path:
            if threads > 1:
                two_core_check()
            out = work / f"tokenised-{size}-{threads}"
            shutil.rmtree(out, ignore_errors=True)  # an existing output with the same key would be reused
            measure(f"pretokenise-{size}-{threads}", "pretokenise", threads, model=model, data=data, out=out,
                    threads=threads)
            if not keep:
                shutil.rmtree(out, ignore_errors=True)
            return out

        def two_core_check() -> None:
            cores_free.append(available_cores(two))

        def tokenizer_alone(cores: int) -> None:
            if cores > 1:
                two_core_check()
            measure(f"tokenizer-{cores}", "tokenizer", cores, model=model, corpus=raw[small] / "train.txt",
                    limit=settings["tokenizer_lines"], batch_size=BATCH_SIZE)

        def user_map() -> None:
            cache = work / "hf-cache"
            shutil.rmtree(cache, ignore_errors=True)
            two_core_check()
            measure("map", "map", two, model=model, corpus=raw[small] / "train.txt", cache=cache, num_proc=2)
            shutil.rmtree(cache, ignore_errors=True)

        # Everything once, the long 10M-line stage runs before any repetition.
        data_small = normalise(small, "normalised-small")
        tokenizer_alone(1)
        if two > 1:
            tokenizer_alone(two)
        pretokenise(small, data_small, 1)
        tokenised_small = pretokenise(small, data_small, two, keep=True)
        user_map()
        data_large = normalise(large, "normalised-large")
        tokenised_large = pretokenise(large, data_large, two, keep=True)
        shutil.rmtree(data_large, ignore_errors=True)
        pss: dict[int, dict[int, list[dict]]] = {small: {}, large: {}}
        for _ in range(settings["worker_repetitions"]):
            for size, data in ((small, tokenised_small), (large, tokenised_large)):
                for workers in WORKERS:
                    result = run_probe("workers", two, data=data, workers=workers, batches=settings["worker_batches"],
                                       batch_size=settings["batch_size"])
                    pss[size].setdefault(workers, []).append(result)
                    log(f"  {size:,}-line set, {workers} worker(s): PSS {result['after']['pss'] / MiB:,.0f} MiB "
                        f"({result['rows']:,} rows of {result['set_rows']:,} read)")
        # Repetitions, while they fit.
        extra = [("normalise-small", lambda: normalise(small, "normalised-small-again")),
                 ("tokenizer-1", lambda: tokenizer_alone(1)),
                 ("pretokenise-1", lambda: pretokenise(small, data_small, 1)),
                 ("pretokenise-2", lambda: pretokenise(small, data_small, two)),
                 ("map", user_map)]
        keys = {"normalise-small": f"normalise-{small}", "tokenizer-1": "tokenizer-1",
                "pretokenise-1": f"pretokenise-{small}-1", "pretokenise-2": f"pretokenise-{small}-{two}", "map": "map"}
        for _ in range(planned - 1):
            for name, action in extra:
                if deadline is not None and time.monotonic() + 1.2 * seconds[keys[name]] > deadline:
                    skipped.append(name)
                    continue
                action()
        total_seconds = time.monotonic() - started
    return _record(scale, small, large, two, runs, pss, corpora, tokenizer_info, settings, planned, skipped,
                   generated, total_seconds, load_start, cores_free)


def _record(scale, small, large, two, runs, pss, corpora, tokenizer_info, settings, planned, skipped,
            generated, total_seconds, load_start, cores_free) -> dict:
    def series(key: str, label: str, lines: int, clock: str = "seconds", units: str = "lines/s") -> Series:
        results = runs[key]
        return Series(label, [lines / r[clock] for r in results], units,
                      {"lines": lines, "seconds": [r["seconds"] for r in results],
                       "cpu_seconds": [r.get("cpu_seconds") for r in results]})

    def median(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    def median_of(results: list[dict], value) -> float:
        return statistics.median(value(r) for r in results)

    def peak(key: str) -> float:  # MiB: the stage's largest process (itself or one it forked)
        return statistics.median(max(r["peak_rss"], r.get("peak_rss_children", 0)) for r in runs[key]) / MiB

    def sampled(key: str, part: str) -> float:
        return statistics.median(r["sampled_peak"][part] for r in runs[key]) / MiB

    sample = runs["tokenizer-1"][0]["lines"]
    pre1, pre2 = f"pretokenise-{small}-1", f"pretokenise-{small}-{two}"
    ours = series(pre1, f"ours: pretokenise stage, --threads 1, pinned to 1 core, {small:,} lines", small)
    reference = series("tokenizer-1", f"limit: the tokenizer alone, tokenizer(batch of {BATCH_SIZE:,} lines), 1 core, "
                       f"the first {sample:,} lines", sample)
    ours_cpu = series(pre1, "ours: pretokenise, 1 core, per CPU-second", small, "cpu_seconds", "lines per CPU-second")
    reference_cpu = series("tokenizer-1", "limit: the tokenizer alone, 1 core, per CPU-second", sample, "cpu_seconds",
                           "lines per CPU-second")
    encoder_cpu = Series("the Rust encoder alone (backend encode_batch, no Python lists), 1 core, per CPU-second",
                         [r["encoder_lines"] / r["rust_cpu_seconds"] for r in runs["tokenizer-1"]],
                         "lines per CPU-second")
    ours_2 = series(pre2, f"ours: pretokenise stage, --threads {two}, pinned to {two} cores, {small:,} lines", small)
    map_only = Series(f"what a user would write: datasets .map(tokenize, batched=True, num_proc=2), {two} cores, "
                      f"{small:,} lines", [small / r["map"]["seconds"] for r in runs["map"]], "lines/s",
                      {"seconds": [r["map"]["seconds"] for r in runs["map"]]})
    user_total = Series(f"user, end to end: load_dataset('text') + map(num_proc=2), {two} cores",
                        [small / r["seconds"] for r in runs["map"]], "lines/s",
                        {"load_seconds": [r["load"]["seconds"] for r in runs["map"]]})
    norm_small = series(f"normalise-{small}", f"ours: normalise stage, 1 core, {small:,} lines", small)
    norm_large = series(f"normalise-{large}", f"ours: normalise stage, 1 core, {large:,} lines", large)
    pre_large = series(f"pretokenise-{large}-{two}", f"ours: pretokenise stage, --threads {two}, {two} cores, "
                       f"{large:,} lines", large)
    ours_total = Series(f"ours, end to end: normalise (1 core) + pretokenise --threads {two} ({two} cores), {small:,} lines",
                        [small / (median(f"normalise-{small}", "seconds") + r["seconds"]) for r in runs[pre2]], "lines/s")
    others = [ours_cpu, reference_cpu, encoder_cpu, ours_2]
    if two > 1:
        others.append(series(f"tokenizer-{two}", f"limit on {two} cores: the tokenizer alone, {two} Rayon threads",
                             sample))
    others += [map_only, user_total, ours_total, norm_small, norm_large, pre_large]

    rss = {}
    phases = {"normalise": ("write", "text_lines.write_normalised"), "pretokenise": ("map", "pretokenise.tokenise_split")}
    for stage, key_small, key_large in (("normalise", f"normalise-{small}", f"normalise-{large}"),
                                        ("pretokenise", pre2, f"pretokenise-{large}-{two}")):
        phase = phases[stage][0]
        rss[stage] = {"small": peak(key_small), "large": peak(key_large),
                      "anon_small": sampled(key_small, "anon"), "anon_large": sampled(key_large, "anon"),
                      "file_small": sampled(key_small, "file"), "file_large": sampled(key_large, "file"),
                      "baseline": median(key_small, "baseline_rss") / MiB,
                      # at the end of the stage's first part (the write / the map)
                      "phase_small": median_of(runs[key_small], lambda r: r[phase]["peak_rss"]) / MiB,
                      "phase_large": median_of(runs[key_large], lambda r: r[phase]["peak_rss"]) / MiB,
                      "phase_anon_large": median_of(runs[key_large], lambda r: r[phase]["sampled_peak"]["anon"]) / MiB,
                      "phase_file_large": median_of(runs[key_large], lambda r: r[phase]["sampled_peak"]["file"]) / MiB,
                      "phase_seconds_large": median_of(runs[key_large], lambda r: r[phase]["seconds"]),
                      "seconds_large": median(key_large, "seconds")}
        for size, key in ((small, key_small), (large, key_large)):
            others.append(Series(f"{stage}: peak RSS of its largest process (ru_maxrss of the stage or of a process "
                                 f"it forked), {size:,} lines",
                                 [max(r["peak_rss"], r.get("peak_rss_children", 0)) / MiB for r in runs[key]], "MiB",
                                 {"stage_process": [r["peak_rss"] / MiB for r in runs[key]],
                                  "forked_processes": [r.get("peak_rss_children", 0) / MiB for r in runs[key]],
                                  "sampled_sum_of_processes": [r["sampled_peak"]["rss"] / MiB for r in runs[key]]}))
    others.append(Series(f"normalise's text_lines.write_normalised part: lines/s, {large:,} lines",
                         [large / r["write"]["seconds"] for r in runs[f"normalise-{large}"]], "lines/s",
                         {"cpu_seconds": [r["write"]["cpu_seconds"] for r in runs[f"normalise-{large}"]]}))
    others.append(Series(f"normalise's text_lines.write_normalised part: peak RSS when it returns, {small:,} lines",
                         [r["write"]["peak_rss"] / MiB for r in runs[f"normalise-{small}"]], "MiB"))
    others.append(Series(f"normalise's text_lines.write_normalised part: peak RSS when it returns, {large:,} lines",
                         [r["write"]["peak_rss"] / MiB for r in runs[f"normalise-{large}"]], "MiB"))

    def per_worker(size: int) -> tuple[list[float], dict]:
        """What each extra worker adds: (PSS(W high) - PSS(W low)) / (high - low), per repetition; and the
        medians of its anonymous and file-backed parts."""
        low, high = min(WORKERS), max(WORKERS)
        pairs = list(zip(pss[size][low], pss[size][high]))
        parts = {part: statistics.median((b["after"][part] - a["after"][part]) / (high - low) / MiB for a, b in pairs)
                 for part in ("pss", "anon", "file")}
        return [(b["after"]["pss"] - a["after"]["pss"]) / (high - low) / MiB for a, b in pairs], parts

    samples_small, split_small = per_worker(small)
    samples_large, split_large = per_worker(large)
    worker_series_small = Series(f"PSS each extra DataLoader worker adds, {small:,}-line tokenised set", samples_small,
                                 "MiB", {"split_mib": split_small, "rows": pss[small][max(WORKERS)][0]["set_rows"]})
    worker_series_large = Series(f"PSS each extra DataLoader worker adds, {large:,}-line tokenised set", samples_large,
                                 "MiB", {"split_mib": split_large, "rows": pss[large][max(WORKERS)][0]["set_rows"]})
    worker_small, worker_large = worker_series_small.median, worker_series_large.median
    others += [worker_series_small, worker_series_large]

    # Causes, from the measurements.
    stage_us = 1e6 / ours_cpu.median
    tokenizer_us = 1e6 / reference_cpu.median
    encoder_us = 1e6 / encoder_cpu.median
    normalise_us = 1e6 * median(f"normalise-{small}", "cpu_seconds") / small
    write_us = 1e6 * median_of(runs[f"normalise-{small}"], lambda r: r["write"]["cpu_seconds"]) / small
    encoder_share = min(encoder_us / stage_us, 1.0)
    tokenizer_scaling = statistics.median(sample / r["seconds"] for r in runs[f"tokenizer-{two}"]) / reference.median
    quiet_bound = 1 / ((1 - encoder_share) + encoder_share / two)  # Amdahl, the encoder alone on `two` cores
    cores_used = median_of(runs[pre2], lambda r: r["cpu_seconds"] / r["seconds"])
    load_end = os.getloadavg()[0]
    why_one_core = (f"per CPU-second on one core the tokenizer alone takes {tokenizer_us:.0f} us a line (the Rust "
                    f"encoder {encoder_us:.0f} us of it, the rest building its Python lists), the pretokenise stage "
                    f"{stage_us:.0f} us: {stage_us - encoder_us:.0f} us a line outside the encoder (the task's "
                    "flattening and blocking in tasks/masked_lm.py, the lists converted to Arrow, the write)")
    free = statistics.median(cores_free) if cores_free else float("nan")
    contention = (f"In this run the machine's other jobs (load average {load_start:.1f} -> {load_end:.1f} on "
                  f"{len(os.sched_getaffinity(0))} cores) left about {free:.1f} cores: {two} threads hashing got "
                  f"{free:.2f} cores (median before each {two}-core measurement), " if free < 0.8 * two else
                  f"{two} threads hashing got {free:.2f} cores (median before each {two}-core measurement), ")
    processes = runs[pre2][0].get("processes")
    why_scaling = (f"--threads {two} forks {two} tokenising processes for a split of at least "
                   f"{runs[pre2][0].get('process_min_rows', 0):,} rows (one tokenizer thread each), each on a "
                   f"contiguous range of the corpus, and appends their pieces in order afterwards. {contention}the "
                   f"--threads {two} runs used {cores_used:.2f} cores (CPU / wall seconds; the stage and its "
                   f"processes{'' if processes is None else f', {processes} of them'}) and the tokenizer alone ran "
                   f"{tokenizer_scaling:.2f}x as fast on {two} Rayon threads as on one")
    goals = [
        Goal("pretokenise on one core >= 0.9x the tokenizer alone on one core (lines per CPU-second, so time "
             "other jobs took from the core is left out)", ours_cpu.median / reference_cpu.median, 0.9, True,
             why=why_one_core),
        Goal("literal reading: normalise + pretokenise on one core >= 0.9x the tokenizer alone (lines per CPU-second)",
             (1e6 / (stage_us + normalise_us)) / reference_cpu.median, 0.9, True,
             why=f"normalise adds {normalise_us:.1f} us a line ({write_us:.1f} us in text_lines.write_normalised, "
                 f"the rest in the contamination check that reads the written train split back and hashes every "
                 f"line) to pretokenise's {stage_us:.0f}; {why_one_core}"),
        Goal(f"pretokenise on {two} cores (--threads {two}) >= 1.8x its own one-core rate (wall lines/s)",
             ours_2.median / ours.median, 1.8, True, why=why_scaling),
        Goal(f"pretokenise on {two} cores beats datasets.map(tokenize, batched=True, num_proc=2) on {two} cores "
             "(tokenising only, wall lines/s)", ours_2.median / map_only.median, 1.0, True,
             why=f"both run two processes of the whole tokenising; {why_scaling}"),
        Goal("end to end: normalise + pretokenise beats load_dataset('text') + map(num_proc=2) (wall lines/s)",
             ours_total.median / user_total.median, 1.0, True,
             why=f"normalise takes {1e6 / norm_small.median:.1f} us a line against load_dataset's "
                 f"{1e6 * statistics.median(r['load']['seconds'] for r in runs['map']) / small:.1f}; {why_scaling}"),
    ]
    causes = {
        "normalise": ("the contamination check (data/contamination.py) holds the checked splits' keys and streams "
                      "the train split past them, read with read() from its Arrow files (no memory map)"),
        "pretokenise": ("the input is read chunk by chunk from its Arrow files (no memory map) and the kept blocks "
                        "are written straight to the output (data/arrow_split.SplitWriter); with --threads 2 each "
                        "forked process does the same for its range, then the stage appends the pieces"),
    }
    for stage in ("normalise", "pretokenise"):
        r = rss[stage]
        goals.append(Goal(f"{stage}: peak RSS at {large:,} lines <= 1.2x that at {small:,} lines",
                          r["large"] / r["small"], 1.2, False,
                          why=(f"peak RSS {r['small']:,.0f} -> {r['large']:,.0f} MiB, of which anonymous memory "
                               f"{r['anon_small']:,.0f} -> {r['anon_large']:,.0f} MiB "
                               f"({r['anon_large'] / r['anon_small']:.2f}x) and file-backed pages "
                               f"{r['file_small']:,.0f} -> {r['file_large']:,.0f} MiB (sampled peaks); at the end "
                               f"of {phases[stage][1]} it was {r['phase_small']:,.0f} -> {r['phase_large']:,.0f} "
                               f"MiB. Cause: {causes[stage]}")))
        if stage == "normalise":
            goals.append(Goal(f"normalise's own streaming part (text_lines.write_normalised): peak RSS at {large:,} "
                              f"lines <= 1.2x that at {small:,} lines", r["phase_large"] / r["phase_small"], 1.2, False,
                              why=f"{r['phase_small']:,.0f} -> {r['phase_large']:,.0f} MiB"))
    batches_small = pss[small][max(WORKERS)][0].get("record_batches")
    batches_large = pss[large][max(WORKERS)][0].get("record_batches")
    goals.append(Goal(f"PSS each extra DataLoader worker adds on the {large:,}-line set <= 1.2x that on the "
                      f"{small:,}-line set (does not grow with the corpus)", worker_large / worker_small, 1.2, False,
                      why=f"per extra worker {worker_small:.1f} -> {worker_large:.1f} MiB: anonymous "
                          f"{split_small['anon']:.1f} -> {split_large['anon']:.1f} MiB, file-backed "
                          f"{split_small['file']:.1f} -> {split_large['file']:.1f} MiB; the sets have "
                          f"{batches_small:,} -> {batches_large:,} Arrow record batches (pretokenise writes up to "
                          "32,768 rows each: a forked worker copies the heap pages of the batch metadata it touches)"))
    notes = [
        f"Corpus generated at bench time ({generated:.0f} s), never committed: {small:,} and {large:,} lines, "
        f"{corpora[large]['bytes'] / large:.0f} bytes a line on average; the smaller file is the larger one's first "
        "lines. Tokenizer: " + f"{tokenizer_info['kind']}, {tokenizer_info['vocab_size']:,} tokens, trained on the "
        f"first {tokenizer_info['trained_on_lines']:,} lines; variant {VARIANT}, max length {MAX_LENGTH}.",
        "Pinning: each measurement is a fresh process; sched_setaffinity to its first N usable cores before any "
        "thread pool starts, RAYON_NUM_THREADS=N; one core: TOKENIZERS_PARALLELISM=false; two cores: "
        "pretokenise --threads 2 (two tokenising processes), the tokenizer alone with 2 Rayon "
        "threads, map with num_proc=2 and TOKENIZERS_PARALLELISM=false in each process.",
        "pretokenise --threads N: N forked tokenising processes (one tokenizer thread each) for a split of at least "
        "pretokenise.PROCESS_MIN_ROWS rows; peak RSS is that of the stage's largest process (ru_maxrss of the stage, "
        "or RUSAGE_CHILDREN's for the processes it forked), the sampled sum over them is in results.json.",
        f"The 1-core goal compares lines per CPU-second (both sides single-threaded on one core): with a load "
        f"average of {load_start:.1f} at the start and {load_end:.1f} at the end on {len(os.sched_getaffinity(0))} "
        "cores, wall time includes time other jobs took. The 2-core goals can only use wall time; before each "
        f"2-core measurement, {two} threads hashing (GIL released) got "
        + ", ".join(f"{c:.2f}" for c in cores_free) + " cores (CPU / wall seconds).",
        f"Worker PSS: main + W persistent fork workers reading the same first {settings['worker_batches']} batches of "
        f"{settings['batch_size']} rows (the train stage's TokenisedSplit, batch plan and the masked_lm collator), "
        f"W = {WORKERS[0]} and {WORKERS[-1]}; per extra worker = the PSS difference / {WORKERS[-1] - WORKERS[0]}.",
        f"Peak RSS: getrusage(RUSAGE_SELF).ru_maxrss of the stage's process (imports included, "
        f"{rss['normalise']['baseline']:,.0f} MiB before the stage starts), with RssAnon / RssFile sampled every 0.1 s.",
        f"This benchmark took {total_seconds:.0f} s in all.",
    ]
    if skipped:
        notes.append(f"Fewer repetitions than the {planned} planned, to stay within `make bench`'s time limit: "
                     + ", ".join(sorted(set(skipped))) + ".")
    return record(NAME, TITLE, ours, reference, higher_is_better=True, goals=goals, others=others, notes=notes,
                  setup={"scale": scale, "lines": [small, large], "corpus": corpora, "tokenizer": tokenizer_info,
                         "variant": VARIANT, "max_length": MAX_LENGTH, "cores": two, "rss_mib": rss,
                         "worker_pss_mib": {str(size): {str(w): [{k: r["after"][k] / MiB for k in ("pss", "anon", "file")}
                                                              for r in results] for w, results in by.items()}
                                            for size, by in pss.items()},
                         "generation_seconds": generated, "total_seconds": total_seconds,
                         "available_cores_before_two_core_runs": cores_free,
                         "load_average": [load_start, load_end]})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One corpus-benchmark probe (started by the benchmark).")
    parser.add_argument("--probe", choices=sorted(PROBES), required=True)
    parser.add_argument("--cores", type=int, required=True)
    parser.add_argument("--arguments", required=True, help="the probe's keyword arguments as JSON")
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])  # before any thread pool starts
    import datasets  # noqa: F401  (imports stay outside the timed part)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    datasets.disable_progress_bars()
    arguments = json.loads(args.arguments)
    paths = {"raw", "out", "model", "data", "corpus", "cache"}
    arguments = {k: Path(v) if k in paths else v for k, v in arguments.items()}
    print(json.dumps(PROBES[args.probe](**arguments)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
