"""Benchmark: the vision_language batch pipeline: examples/s with 0, 1 and 2 DataLoader workers, the
memory each worker adds, where the time goes, and pixel values computed in the workers vs cached.

The data is made the way the workflow makes it: generated shapes-like PNGs (coloured discs on grey,
with +-3 levels of pixel noise, so a 336 px PNG is ~180 KiB as a real image of that size is, not a few
KiB of flat colour), two questions per image, written as a local dataset, then the workflow's own ``download``, ``normalise``, ``prepare_model``
(a tiny LLaVA: CLIP-style tower at ``image_size`` 224, ``patch_size`` 14, so 256 image tokens and
LLaVA-1.5's image processor: pad to square, resize, centre crop, rescale, normalise) and
``pretokenise`` stages. The images are larger than the processor's size (336 px -> 224 px), as
source images are, so the processor really resizes.

Measured, each in a fresh process (``torch.set_num_threads(1)``, fork start method), over the same
shuffled micro-batches of the train stage's ``GlobalBatchPlan`` / ``RankBatchSampler``:

- ours: ``build_loader(TokenisedSplit, RankBatchSampler, VisionCollator)`` exactly as the train stage
  builds it (``task.collator``; workers decode the PNG bytes from the memory-mapped Arrow data and run
  the image processor), with 0, 1 and 2 workers; examples/s from the first batch to the last (worker
  start-up is reported beside it), and the CPU time and minor page faults of main + workers per example;
- the limits, one core: the dataset's read of the rows plus the text padding alone, PIL decode alone,
  and the image processor alone on images decoded beforehand (per micro-batch, as the collator calls it);
- the alternative: pixel values computed once (the same collator, in row order) into a float32 numpy
  memmap, then a loader that reads the rows without image bytes and takes ``pixel_values`` from the
  memmap; its one-off build time and disk size;
- memory: PSS (``/proc/<pid>/smaps_rollup``, as ``bench_worker_memory``) of the main process and each
  worker, read at fixed points of the runs with 1 and 2 workers, on the set and on the same set repeated
  ``large_factor`` times (as many rows read from each): what one more worker adds (anonymous, file-backed,
  shared memory), and each worker's private dirty memory.

    python -m benchmarks.run --only vision_batches
    BENCH_VISION_EXAMPLES=200 python -m benchmarks.run --only vision_batches --out-dir "$(mktemp -d)"   # development
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.records import Goal, Series, record

NAME = "vision_batches"
TITLE = ("Vision-language batches: examples/s of TokenisedSplit + VisionCollator with 0/1/2 workers, "
         "PSS per worker, vs cached pixel values")
MIN_SECONDS = 240  # one run at full scale on 2 quiet cores, for run.py's time planning
REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
# BENCH_VISION_EXAMPLES=200 overrides the number of examples (development on a shared machine).
SIZE_VARIABLE = "BENCH_VISION_EXAMPLES"
SCALES = {
    "full": {"examples": 2000, "large_factor": 4, "image_side": 336, "processor_size": 224, "patch_size": 14,
             "workers": (0, 1, 2), "cached_workers": (0, 2), "repetitions": 3,
             "limit_examples": 400, "run_rows": 480, "micro_batch": 8, "effective_batch": 16,
             "one_process": False},
    "tiny": {"examples": 48, "large_factor": 2, "image_side": 42, "processor_size": 28, "patch_size": 14,
             "workers": (0, 1, 2), "cached_workers": (0, 2), "repetitions": 1,
             "limit_examples": 16, "run_rows": None, "micro_batch": 4, "effective_batch": 8,
             "one_process": True},
}
NOISE = 3  # +- grey levels of per-pixel noise: real images do not compress to flat colour
VARIANT = {"prompt": "Question: {question}\nAnswer:", "target": " {answer}", "images": True}
MEMORY_POINTS = (0.3, 0.5, 0.7, 0.9)  # fractions of a run's rows at which PSS is read
STAGES = ("read", "decode", "process")  # of the limits probe: rows + text padding, PIL decode, image processor
MEMORY_WORKERS = (1, 2)  # PSS with 1 and with 2 workers: the difference is what one more worker adds


# --- the data: generated images through the workflow's own stages ---
def draw(side: int, rng: random.Random) -> tuple[bytes, str, int]:
    """A ``side`` x ``side`` PNG of 1-4 discs of one colour (make_images' palette) with pixel noise."""
    from PIL import Image, ImageDraw

    from workflow_scripts.demo import make_images as demo

    image = Image.new("RGB", (side, side), demo.BACKGROUND)
    pen = ImageDraw.Draw(image)
    colour, count, cell = rng.choice(list(demo.COLOURS)), rng.randint(1, 4), side // 2
    for quadrant in sorted(rng.sample(range(4), count)):
        size = int(cell * rng.uniform(0.7, 0.88))
        left = (quadrant % 2) * cell + rng.randint(1, max(1, cell - 1 - size))
        top = (quadrant // 2) * cell + rng.randint(1, max(1, cell - 1 - size))
        pen.ellipse((left, top, left + size - 1, top + size - 1), fill=demo.COLOURS[colour])
    pixels = np.asarray(image).astype(np.int16)
    pixels += np.random.default_rng(rng.getrandbits(32)).integers(-NOISE, NOISE + 1, pixels.shape, dtype=np.int16)
    buffer = io.BytesIO()
    # zlib level 1: level 6 of noisy pixels costs 5x the CPU for 15% smaller files; decoding costs the same
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue(), colour, count


def write_raw(directory: Path, examples: int, side: int, seed: int = 0) -> dict:
    """``train.jsonl`` (and a small ``test.jsonl``, which the dataset schema requires) + ``images/`` in
    the shapes demo's layout, two questions per image (its colour, its number of shapes; OCR-VQA and
    ChartQA also ask several questions of one image, each row holding the image's bytes); returns the
    train rows' PNG sizes."""
    rng = random.Random(seed)
    (directory / "images").mkdir(parents=True)
    sizes = []
    for split, count in (("train", examples), ("test", 8)):
        rows = []
        for k in range(0, count, 2):
            blob, colour, shapes = draw(side, rng)
            name = f"images/{split}-{k // 2:05d}.png"
            (directory / name).write_bytes(blob)
            questions = (("How many shapes are there?", str(shapes)), ("What colour are the shapes?", colour))
            for j, (question, answer) in enumerate(questions[:count - k]):
                rows.append(json.dumps({"id": f"{split}-{k + j:05d}", "question": question, "answer": answer,
                                        "image": name}))
                sizes += [len(blob)] if split == "train" else []
        (directory / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    return {"png_bytes_mean": float(np.mean(sizes)), "png_bytes_total": int(np.sum(sizes))}


def build_sets(tmp: Path, settings: dict, log=print) -> dict:
    """raw -> download -> normalise -> prepare_model (tiny LLaVA) -> pretokenise; the large copy; seconds."""
    from workflow_scripts import download, normalise, prepare_model, pretokenise

    seconds = {}
    started = time.perf_counter()
    facts = write_raw(tmp / "source", settings["examples"], settings["image_side"])
    seconds["generate_images"] = time.perf_counter() - started
    dataset = {"task": "vision_language", "source": {"type": "local", "path": str(tmp / "source")},
               "fields": {"id": "id", "question": "question", "answers": "answer", "image": "image"},
               "metric": "exact_match", "splits": {"train": "train", "test": "test"}}
    started = time.perf_counter()
    quiet(download.main, ["--name", "bench", "--dataset", json.dumps(dataset), "--out", str(tmp / "raw"),
                          "--manifest", str(tmp / "download_manifest.json")])
    quiet(normalise.main, ["--name", "bench", "--dataset", json.dumps(dataset), "--raw", str(tmp / "raw"),
                           "--out", str(tmp / "normalised"), "--report", str(tmp / "normalise_report.json")])
    seconds["download_normalise"] = time.perf_counter() - started
    tiny = {"architecture": "llava", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
            "vocab_size": 512, "seed": 0, "image_size": settings["processor_size"], "patch_size": settings["patch_size"]}
    image_tokens = (settings["processor_size"] // settings["patch_size"]) ** 2
    started = time.perf_counter()
    quiet(prepare_model.main, ["--model", json.dumps({"name": "tiny-llava", "source": "tiny", "tiny": tiny}),
                               "--out", str(tmp / "model"), "--corpus", str(tmp / "normalised")])
    seconds["prepare_model"] = time.perf_counter() - started
    started = time.perf_counter()
    quiet(pretokenise.main, ["--model", str(tmp / "model"), "--data", str(tmp / "normalised"),
                             "--task", "vision_language", "--variant", json.dumps(VARIANT),
                             "--max-length", str(image_tokens + 48), "--out", str(tmp / "small"),
                             "--report", str(tmp / "tokenise_report.json")])
    seconds["pretokenise"] = time.perf_counter() - started
    report = json.loads((tmp / "tokenise_report.json").read_text())["splits"]["train"]
    if report["kept"] != settings["examples"]:
        raise RuntimeError(f"pretokenise kept {report['kept']} of {settings['examples']} rows: {report}")
    started = time.perf_counter()
    repeat_set(tmp / "small", tmp / "large", settings["large_factor"])
    seconds["large_copy"] = time.perf_counter() - started
    log(f"  vision batches: {settings['examples']} examples, {settings['image_side']} px PNGs of "
        f"{facts['png_bytes_mean'] / 1024:.0f} KiB, {image_tokens} image tokens; built in "
        + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()))
    return {**facts, "image_tokens": image_tokens, "mean_length": report["mean_length"], "build_seconds": seconds}


def quiet(main, argv: list[str]) -> None:
    """A stage's ``main`` with its prints kept out of the benchmark's log (shown if it fails)."""
    import contextlib

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = main(argv)
    if code != 0:
        raise RuntimeError(f"{main.__module__} exited {code}: {captured.getvalue()[-2000:]}")


def repeat_set(small: Path, large: Path, factor: int) -> None:
    """The pre-tokenised train split repeated ``factor`` times (new ids), with the same meta file."""
    import pyarrow as pa
    from datasets import Dataset, DatasetDict, load_from_disk

    table = load_from_disk(str(small / "train")).data.table
    ids = table.column("id")
    copies = [table] + [table.set_column(table.schema.get_field_index("id"), "id",
                                         pa.array([f"{i}-copy{k}" for i in ids.to_pylist()], pa.string()))
                        for k in range(1, factor)]
    DatasetDict({"train": Dataset(pa.concat_tables(copies))}).save_to_disk(str(large))
    shutil.copy(small / "tokenise_meta.json", large / "tokenise_meta.json")


def without_images(source: Path, out: Path) -> None:
    """The pre-tokenised set without its image bytes: what a loader over cached pixel values reads."""
    from datasets import DatasetDict, load_from_disk

    DatasetDict({"train": load_from_disk(str(source / "train")).remove_columns(["images"])}).save_to_disk(str(out))
    shutil.copy(source / "tokenise_meta.json", out / "tokenise_meta.json")


def arrow_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*.arrow"))


# --- probes: each runs in a fresh process ---
class CachedPixelsCollator:
    """The alternative: the text padded as VisionCollator pads it, ``pixel_values`` read from the cache.

    Only the cache's path travels to workers; each opens the memmap itself.
    """

    def __init__(self, meta: dict, vocab_size: int, cache: str):
        from workflow_scripts.data.batching import PaddingCollator

        self.text = PaddingCollator(meta["pad_token_id"], vocab_size)
        self.cache = str(cache)
        self._pixels = None

    def __getstate__(self):
        return {**self.__dict__, "_pixels": None}

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        if self._pixels is None:
            self._pixels = np.load(self.cache, mmap_mode="r")
        batch = self.text(rows)
        batch["images_in_batch"] = len(rows)
        batch["pixel_values"] = torch.from_numpy(self._pixels[np.array([row["index"] for row in rows])])
        return batch


def batch_plan(dataset, settings: dict, seed: int):
    from workflow_scripts.data import batching

    return batching.GlobalBatchPlan(dataset.lengths(), settings["effective_batch"], seed)


def steps_for(plan, rows: int | None, effective_batch: int) -> int:
    return plan.batches_per_epoch if rows is None else min(plan.batches_per_epoch, math.ceil(rows / effective_batch))


def smaps_rollup(pid: int) -> dict[str, int]:
    """Bytes of one process from /proc/<pid>/smaps_rollup: ``pss`` (shared pages divided among the
    processes sharing them, so sums over processes count each page once), its ``anon`` and ``file``
    parts and ``shmem`` (shared memory: batches on their way from a worker), and the pages no other process maps: ``private_dirty`` (written: what a forked worker has
    allocated or copied on write) and ``private_clean`` (read only, mostly file pages only it has touched)."""
    wanted = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem",
              "Private_Clean:": "private_clean", "Private_Dirty:": "private_dirty"}
    found = dict.fromkeys(wanted.values(), 0)
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            key = line.split(maxsplit=1)[0]
            if key in wanted:
                found[wanted[key]] += int(line.split()[1]) * 1024
    return found


def family_sample(workers: list) -> list[dict]:
    """smaps_rollup of this process, then of each live worker (psutil processes)."""
    members = [smaps_rollup(os.getpid())]
    for worker in workers:
        try:
            members.append(smaps_rollup(worker.pid))
        except (FileNotFoundError, ProcessLookupError):  # a worker exiting
            pass
    return members


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have exited (the epoch's workers), in seconds."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class FamilyCpu:
    """CPU seconds of this process and of a loader iterator's live workers, read from /proc per call."""

    def __init__(self, iterator):
        import psutil

        self.workers = [psutil.Process(worker.pid) for worker in getattr(iterator, "_workers", [])]

    def seconds(self) -> float:
        total = time.process_time()
        for worker in self.workers:
            times = worker.cpu_times()
            total += times.user + times.system
        return total

    def minor_faults(self) -> int:
        """Minor page faults so far (a page mapped afresh: newly allocated memory, or memory given back to
        the system and allocated again)."""
        import resource

        total = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for worker in self.workers:
            with open(f"/proc/{worker.pid}/stat") as handle:
                total += int(handle.read().rsplit(")", 1)[1].split()[7])  # field 10, minflt
        return total


def probe_loader(data_dir: str, mode: str, workers: int, repetitions: int, rows: int | None, settings: dict,
                 cache: str | None = None, sample_memory: bool = False) -> dict:
    """Epochs of the train stage's loader; examples/s counted from the first batch to the last."""
    from workflow_scripts.data import batching
    from workflow_scripts.tasks import stored_columns, task_named

    meta = batching.read_meta(data_dir)
    if mode == "compute":  # the train stage's own objects (train.py: TokenisedSplit, task.collator, build_loader)
        dataset = batching.TokenisedSplit(data_dir, "train", stored_columns(meta))
        collator = task_named(meta["task"]).collator(meta, meta["vocab_size"], seed=0)
    else:
        dataset = batching.TokenisedSplit(data_dir, "train", ("labels",))
        collator = CachedPixelsCollator(meta, meta["vocab_size"], cache)
    pickled = {"dataset": len(pickle.dumps(dataset)), "collator": len(pickle.dumps(collator))}
    plan = batch_plan(dataset, settings, seed=0)
    steps = steps_for(plan, rows, settings["effective_batch"])
    runs, memory = [], []
    for rep in range(repetitions):  # each repetition a different epoch of the plan (another shuffle)
        start = rep * plan.batches_per_epoch
        sampler = batching.RankBatchSampler(plan, settings["micro_batch"], 0, 1, start, start + steps)
        loader = batching.build_loader(dataset, sampler, collator, workers, pin_memory=False, seed=0)
        cpu, started = cpu_seconds(), time.perf_counter()
        first, examples, images, pixels_shape = None, 0, 0, None
        # Memory: PSS at fixed points of the run, every worker alive; the time the samples take (reading
        # smaps_rollup costs ~10 ms of CPU a process) is left out of the run's time and CPU.
        points = [int(f * steps * settings["effective_batch"]) for f in MEMORY_POINTS] if sample_memory else []
        samples, paused_wall, paused_cpu = [], 0.0, 0.0
        batches = iter(loader)
        for batch in batches:
            size = batch["input_ids"].shape[0]
            if first is None:
                first, first_rows = time.perf_counter(), size
                pixels_shape = list(batch["pixel_values"].shape)
                family = FamilyCpu(batches)
                steady_from, faults_from = family.seconds(), family.minor_faults()
            # CPU and page faults of main + workers up to this batch (the workers exit after the last one)
            steady_to, faults_to = family.seconds(), family.minor_faults()
            if any(examples < point <= examples + size for point in points):
                wall_0, cpu_0 = time.perf_counter(), time.process_time()
                samples.append(family_sample(family.workers))
                paused_wall += time.perf_counter() - wall_0
                paused_cpu += time.process_time() - cpu_0
            examples += size
            images += batch["images_in_batch"]
        ended = time.perf_counter()
        memory.append(samples)
        del loader  # exhausted: its workers have exited and been joined, so their CPU time is counted
        runs.append({"examples": examples, "images": images, "seconds": ended - started,
                     "cpu_seconds": cpu_seconds() - cpu,
                     "first_batch_seconds": first - started,
                     "steady_cpu_ms_per_example": 1000 * (steady_to - steady_from - paused_cpu) / max(1, examples - first_rows),
                     "memory_sampling_seconds": paused_wall,
                     "minor_faults_per_example": (faults_to - faults_from) / max(1, examples - first_rows),
                     "examples_per_second": (examples - first_rows) / (ended - first - paused_wall)})
    return {"mode": mode, "workers": workers, "runs": runs, "memory": memory, "pickled_bytes": pickled,
            "pixel_values_shape": pixels_shape, "rows_in_set": len(dataset)}


def probe_limits(data_dir: str, repetitions: int, rows: int, settings: dict) -> dict:
    """One core: the read of the rows + text padding, PIL decode, and the image processor, timed apart
    over the loader's micro-batches (each repetition a different epoch's first ``rows`` rows)."""
    from workflow_scripts.data import batching
    from workflow_scripts.tasks import stored_columns, task_named
    from workflow_scripts.tasks.vision_language import open_images

    meta = batching.read_meta(data_dir)
    dataset = batching.TokenisedSplit(data_dir, "train", stored_columns(meta))
    collator = task_named(meta["task"]).collator(meta, meta["vocab_size"], seed=0)
    processor = collator.image_processor
    plan = batch_plan(dataset, settings, seed=0)
    steps = steps_for(plan, rows, settings["effective_batch"])
    runs = []
    for rep in range(repetitions):
        start = rep * plan.batches_per_epoch
        sampler = batching.RankBatchSampler(plan, settings["micro_batch"], 0, 1, start, start + steps)
        wall, cpu, examples = dict.fromkeys(STAGES, 0.0), dict.fromkeys(STAGES, 0.0), 0
        for indices in sampler:
            marks = [(time.perf_counter(), time.process_time())]
            batch_rows = dataset.__getitems__(indices)
            collator.text(batch_rows)
            marks.append((time.perf_counter(), time.process_time()))
            images = [image for row in batch_rows for image in open_images(row["images"])]
            marks.append((time.perf_counter(), time.process_time()))
            processor(images, return_tensors="pt")  # LLaVA's processor takes the flat list
            marks.append((time.perf_counter(), time.process_time()))
            for stage, (before, after) in zip(STAGES, zip(marks, marks[1:])):
                wall[stage] += after[0] - before[0]
                cpu[stage] += after[1] - before[1]
            examples += len(batch_rows)
        runs.append({"examples": examples, **{f"{k}_per_second": examples / v for k, v in wall.items()},
                     **{f"{k}_cpu_ms": 1000 * v / examples for k, v in cpu.items()}})
    return {"runs": runs}


def rss_file() -> int:
    """Bytes of file-backed pages mapped into this process (RssFile of /proc/self/status)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssFile line")


def probe_mapping(data_dir: str, rows: int) -> dict:
    """How much of the memory-mapped file reading one row maps into the process: rows far apart, in a
    set this process has not read before."""
    from workflow_scripts.data import batching
    from workflow_scripts.tasks import stored_columns

    meta = batching.read_meta(data_dir)
    dataset = batching.TokenisedSplit(data_dir, "train", stored_columns(meta))
    mapped, row_bytes = [], []
    for index in np.linspace(0, len(dataset) - 1, rows).astype(int).tolist():
        before = rss_file()
        row = dataset.__getitems__([index])[0]
        mapped.append(rss_file() - before)
        row_bytes.append(sum(len(blob) for blob in row["images"]))
    return {"mapped_bytes": mapped, "image_bytes": row_bytes}


def probe_build_cache(data_dir: str, cache: str, settings: dict) -> dict:
    """pixel_values of every row, in row order, through the same collator, into a float32 .npy memmap."""
    import torch

    from workflow_scripts.data import batching
    from workflow_scripts.tasks import stored_columns, task_named

    meta = batching.read_meta(data_dir)
    dataset = batching.TokenisedSplit(data_dir, "train", stored_columns(meta))
    collator = task_named(meta["task"]).collator(meta, meta["vocab_size"], seed=0)
    started = time.perf_counter()
    chunk, pixels = 64, None
    for begin in range(0, len(dataset), chunk):
        values = collator(dataset.__getitems__(list(range(begin, min(begin + chunk, len(dataset))))))["pixel_values"]
        if pixels is None:
            pixels = np.lib.format.open_memmap(cache, mode="w+", dtype=np.float32,
                                               shape=(len(dataset), *values.shape[1:]))
        pixels[begin:begin + len(values)] = values.numpy()
    pixels.flush()
    del pixels
    seconds = time.perf_counter() - started
    # The cache holds what the collator makes: check a few rows against a fresh computation.
    check = sorted(random.Random(1).sample(range(len(dataset)), min(8, len(dataset))))
    fresh = collator(dataset.__getitems__(check))["pixel_values"]
    matches = bool(torch.equal(torch.from_numpy(np.load(cache, mmap_mode="r")[check]), fresh))
    return {"seconds": seconds, "examples_per_second": len(dataset) / seconds, "bytes": os.path.getsize(cache),
            "matches_collator": matches}


def run_probes(probes: list[tuple[str, dict]]) -> list[dict]:
    """Probes run one after the other in a fresh interpreter, so nothing measured before them (or in
    this process) is counted."""
    command = [sys.executable, "-m", "benchmarks.bench_vision_batches", json.dumps(probes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"vision-batches probes {[kind for kind, _ in probes]} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_rate(result: dict) -> float:
    return float(statistics.median(r["examples_per_second"] for r in result["runs"]))


def train_stage_imports() -> None:
    """What the train stage's main process has loaded before it forks its workers (it has built the model
    and its adapters), so the workers inherit these modules' pages instead of importing them each."""
    import peft  # noqa: F401
    import transformers

    transformers.AutoModelForImageTextToText  # noqa: B018 (the lazy module loads on first access)


# --- memory summaries ---
def memory_summary(result: dict) -> dict:
    """Medians over the samples of all repetitions with every worker alive: the family (main + workers),
    the main process and each worker (MiB)."""
    workers = result["workers"]
    samples = [s for run in result["memory"] for s in run if len(s) == workers + 1]
    if not samples:
        raise RuntimeError(f"no PSS sample with all {workers} workers alive")
    summary = {"samples": len(samples)}
    for key in ("pss", "anon", "file", "shmem"):
        summary[f"family_{key}"] = float(statistics.median(sum(p[key] for p in s) for s in samples)) / MiB
        summary[f"main_{key}"] = float(statistics.median(s[0][key] for s in samples)) / MiB
    for key in ("pss", "anon", "file", "private_dirty", "private_clean"):
        summary[f"worker_{key}"] = float(statistics.median(p[key] for s in samples for p in s[1:])) / MiB
    return summary


def run(scale: str = "full", work_dir: Path | None = None, log=print, deadline: float | None = None) -> dict:
    """``deadline`` (time.monotonic()): probes that start after it make one repetition, not three."""
    settings = dict(SCALES[scale])
    if os.environ.get(SIZE_VARIABLE):
        settings["examples"] = int(os.environ[SIZE_VARIABLE])
    reps, rows = settings["repetitions"], settings["examples"]
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-vision-batches-", dir=work_dir) as tmp:
        tmp = Path(tmp)
        facts = build_sets(tmp, settings, log)
        small, large, cache = tmp / "small", tmp / "large", tmp / "pixel_values.npy"
        without_images(small, tmp / "cached_rows")
        sizes = {"small": arrow_bytes(small), "large": arrow_bytes(large)}

        def loader(data_dir: Path, mode: str, workers: int, **more) -> tuple[str, dict]:
            return ("loader", {"data_dir": str(data_dir), "mode": mode, "workers": workers, "settings": settings,
                               "rows": settings["run_rows"], "repetitions": reps,
                               "sample_memory": mode == "compute" and workers > 0,
                               **more})

        # Groups of probes, each group in one fresh process. 0 workers comes first in its process, then
        # the limits, the cache's build and its loaders (that process's memory is not measured); each
        # measured worker count has a process of its own, so its main process holds only what the train
        # stage's would. At the tiny scale (a test of the harness) everything shares one process.
        groups = [
            {"compute 0": loader(small, "compute", 0),
             "mapping": ("mapping", {"data_dir": str(large), "rows": 8}),
             "limits": ("limits", {"data_dir": str(small), "repetitions": reps, "settings": settings,
                                   "rows": min(rows, settings["limit_examples"])}),
             "build cache": ("build_cache", {"data_dir": str(small), "cache": str(cache), "settings": settings}),
             **{f"cached {w}": loader(tmp / "cached_rows", "cached", w, cache=str(cache))
                for w in settings["cached_workers"]}},
            *({f"compute {w}": loader(small, "compute", w)} for w in settings["workers"] if w),
            *({f"large {w}": loader(large, "compute", w, repetitions=1)} for w in MEMORY_WORKERS),
        ]
        if settings["one_process"]:
            groups = [{name: probe for group in groups for name, probe in group.items()}]
        results = {}
        for group in groups:
            if deadline is not None and reps > 1 and time.monotonic() > deadline:
                for name, (kind, arguments) in group.items():
                    if arguments.get("repetitions", 1) > 1:
                        arguments["repetitions"] = 1
                        notes.append(f"{name}: 1 run instead of {reps} (time budget)")
            results.update(zip(group, run_probes(list(group.values()))))
            log("  vision batches: " + "; ".join(
                f"{name} {median_rate(results[name]):,.0f} examples/s" for name in group if "runs" in results[name]
                and "examples_per_second" in results[name]["runs"][0]))
        cache_rows_bytes = arrow_bytes(tmp / "cached_rows")

    compute = {w: results[f"compute {w}"] for w in settings["workers"]}
    cached = {w: results[f"cached {w}"] for w in settings["cached_workers"]}
    built, limits, mapping = results["build cache"], results["limits"], results["mapping"]
    mapped_mib = float(statistics.median(mapping["mapped_bytes"])) / MiB
    row_kib = float(statistics.median(mapping["image_bytes"])) / 1024
    memory = {(size, w): memory_summary(results[f"{'compute' if size == 'small' else 'large'} {w}"])
              for size in ("small", "large") for w in MEMORY_WORKERS}

    def cpu_ms(result: dict) -> float:  # CPU of main + workers per example, from the first batch to the last
        return float(statistics.median(r["steady_cpu_ms_per_example"] for r in result["runs"]))

    def faults(result: dict) -> float:  # main + workers, first batch to last
        return float(statistics.median(r["minor_faults_per_example"] for r in result["runs"]))

    def rate_series(result: dict, label: str) -> Series:
        runs = result["runs"]
        return Series(label, [r["examples_per_second"] for r in runs], "examples/s",
                      {"cpu_ms_per_example": cpu_ms(result), "run_seconds": [r["seconds"] for r in runs],
                       "minor_faults_per_example": faults(result),
                       "run_cpu_seconds_with_start_up": [r["cpu_seconds"] for r in runs],
                       "first_batch_seconds": [r["first_batch_seconds"] for r in runs],
                       "examples_per_run": runs[0]["examples"], "rows_in_set": result["rows_in_set"],
                       "pickled_bytes": result["pickled_bytes"], "pixel_values_shape": result["pixel_values_shape"]})

    top, top_cached = max(settings["workers"]), max(settings["cached_workers"])
    ours = rate_series(compute[top], f"ours: pixel values computed in {top} DataLoader workers "
                                     "(the train stage's build_loader + TokenisedSplit + VisionCollator)")
    reference = rate_series(cached[top_cached], "alternative: pixel values computed once into a float32 memmap, "
                                                f"read by {top_cached} workers")
    others = [rate_series(compute[w], f"ours: computed, {w} worker{'s' if w != 1 else ''}"
                          + (" (in the main process)" if w == 0 else "")) for w in settings["workers"] if w != top]
    others += [rate_series(cached[w], f"alternative: cached, {w} workers" + (" (main process)" if w == 0 else ""))
               for w in settings["cached_workers"] if w != top_cached]
    limit = {stage: Series(label, [r[f"{stage}_per_second"] for r in limits["runs"]], "examples/s",
                           {"cpu_ms_per_example": statistics.median(r[f"{stage}_cpu_ms"] for r in limits["runs"]),
                            "examples_per_run": limits["runs"][0]["examples"]})
             for stage, label in (("read", "limit, 1 core: rows read (TokenisedSplit, image bytes included) + text padding only"),
                                  ("decode", "limit, 1 core: PIL decode (PNG bytes -> RGB) only"),
                                  ("process", "limit, 1 core: image processor only, on images decoded beforehand"))}
    others += list(limit.values())
    wall_ms = {stage: 1000.0 / series.median for stage, series in limit.items()}
    stage_cpu = {stage: series.details["cpu_ms_per_example"] for stage, series in limit.items()}
    predicted = 1000.0 / sum(wall_ms.values())  # one core, if these three were all the work
    others.append(Series("alternative: one-off build of the pixel cache (the collator over every row in order, 1 core)",
                         [built["examples_per_second"]], "examples/s", {"seconds": built["seconds"]}))
    added = {}
    for size in ("small", "large"):
        one, two = memory[(size, 1)], memory[(size, 2)]
        what = (f"{rows * (1 if size == 'small' else settings['large_factor']):,}-row set "
                f"({sizes[size] / MiB:,.0f} MiB Arrow)")
        added[size] = {key: two[f"family_{key}"] - one[f"family_{key}"] for key in ("pss", "anon", "file", "shmem")}
        others += [
            Series(f"PSS one more worker adds (main + 2 workers minus main + 1 worker), {what}", [added[size]["pss"]],
                   "MiB", {"anonymous": added[size]["anon"], "file_backed": added[size]["file"],
                           "shared_memory": added[size]["shmem"],
                           "with_1_worker": one, "with_2_workers": two}),
            Series(f"  of which anonymous (heap), {what}", [added[size]["anon"]], "MiB"),
            Series(f"private dirty memory of each worker (pages it alone has written), {what}",
                   [two["worker_private_dirty"]], "MiB",
                   {k: two[f"worker_{k}"] for k in ("pss", "anon", "file", "private_clean")}),
        ]
    grown = (sizes["large"] - sizes["small"]) / MiB
    rate = {w: median_rate(r) for w, r in compute.items()}
    cpu = {w: cpu_ms(r) for w, r in compute.items()}
    cached_rate = {w: median_rate(r) for w, r in cached.items()}
    png_kib, cache_kib = facts["png_bytes_mean"] / 1024, built["bytes"] / rows / 1024
    dirty = {size: memory[(size, 2)]["worker_private_dirty"] for size in ("small", "large")}
    goals = [
        Goal(f"heap (anonymous PSS) one more worker adds grows by <= 5% of the data added ({grown:,.0f} MiB more "
             f"Arrow in the {settings['large_factor']}x set): images are not copied into workers",
             (added["large"]["anon"] - added["small"]["anon"]) / grown, 0.05, higher_is_better=False,
             why=f"one more worker adds {added['small']['anon']:.1f} MiB of heap on the 1x set, "
                 f"{added['large']['anon']:.1f} MiB on the {settings['large_factor']}x set"),
        Goal(f"a worker's private dirty memory grows by <= 5% of the data added ({grown:,.0f} MiB)",
             (dirty["large"] - dirty["small"]) / grown, 0.05, higher_is_better=False,
             why=f"{dirty['small']:.1f} MiB on the 1x set, {dirty['large']:.1f} MiB on the "
                 f"{settings['large_factor']}x set"),
    ]
    decision = (
        "Decision: pixel values are computed in the DataLoader workers, every epoch, from the image bytes in the "
        f"memory-mapped Arrow data; no cache. Computing costs {cpu[0]:.1f} ms of CPU per example in the main process "
        f"({rate[0]:,.0f} examples/s) and {cpu[top]:.1f} ms with {top} workers, main process included (the batch "
        "crosses to the main process through shared memory, and the workers fault their memory in afresh for every "
        "batch: see below), so each core the workers get makes about "
        f"{1000 / cpu[top]:,.0f} examples/s ({top} workers here: {rate[top]:,.0f} examples/s, {rate[top] / rate[0]:.2f}x "
        "0 workers, on 2 cores shared with the main process and, when the load average says so, other work). "
        "Training waits on it only if a step consumes examples faster than that; more workers then help, and one "
        f"more adds {added['small']['pss']:.0f} MiB PSS ({added['small']['anon']:.0f} MiB heap; "
        f"{added['large']['anon']:.0f} MiB on the {settings['large_factor']}x set). The cache is read "
        f"{cached_rate[0] / rate[0]:.0f}x faster in the main process ({cached_rate[0]:,.0f} examples/s; "
        f"{cached_rate[top_cached]:,.0f} with {top_cached} workers) but holds {cache_kib:,.0f} KiB of float32 per "
        f"example against {png_kib:,.0f} KiB of PNG ({cache_kib / png_kib:.1f}x: {built['bytes'] / MiB:,.0f} MiB here, "
        f"{cache_kib * 100_000 / 2**20:,.0f} GiB for 100,000 examples, beyond page cache, so read from disk every "
        f"epoch), takes a full pass to build ({built['seconds']:.0f} s here) and is tied to the image processor's "
        "settings (size, crop, mean and std): another model or image size rebuilds it. Keeping pixel values in RAM "
        f"after the first epoch instead would make the workers hold {cache_kib / 1024:.2f} MiB per example seen, "
        "growing with the set, which they must not do."
    )
    notes += [
        decision,
        f"Where the time goes, per example on one core (wall; CPU in brackets): rows read + text padding "
        f"{wall_ms['read']:.2f} ms ({stage_cpu['read']:.2f}), PIL decode {wall_ms['decode']:.2f} ms "
        f"({stage_cpu['decode']:.2f}), image processor {wall_ms['process']:.2f} ms ({stage_cpu['process']:.2f}); "
        f"together {predicted:,.0f} examples/s, against {rate[0]:,.0f} measured with 0 workers. CPU per example, main "
        "process and workers together, first batch to last: computed " + ", ".join(
            f"{w} worker{'s' if w != 1 else ''} {cpu[w]:.1f} ms" for w in sorted(cpu))
        + "; cached " + ", ".join(f"{w} workers {cpu_ms(cached[w]):.1f} ms" for w in sorted(cached))
        + ". With workers each batch's pixel values also cross to the main process through shared memory (the "
        f"cache's {cpu_ms(cached[top_cached]) - cpu_ms(cached[0]):.1f} ms more with {top_cached} workers), and the "
        "workers map their memory afresh for every batch: minor page faults per example, computed, "
        + ", ".join(f"{w} worker{'s' if w != 1 else ''} {faults(compute[w]):,.0f}" for w in sorted(compute)) + ".",
        f"Data: {rows:,} examples, two questions per generated {settings['image_side']} px PNG (discs on grey, "
        f"+-{NOISE} levels of noise, {png_kib:.0f} KiB), through download, normalise, prepare_model (tiny LLaVA at "
        f"image_size {settings['processor_size']}, patch_size {settings['patch_size']}: {facts['image_tokens']} "
        f"image tokens, mean row {facts['mean_length']:.0f} tokens) and pretokenise; LLaVA-1.5's image processor "
        f"(pad to square, resize to {settings['processor_size']}, centre crop, rescale, normalise; transformers' PIL "
        f"backend). Micro-batches of {settings['micro_batch']} from the train stage's batch plan; torch 1 thread; "
        "fork; prefetch_factor 4; the probe's main process has imported transformers and peft before forking, as "
        "the train stage's has.",
        f"Each run reads {settings['run_rows'] or 'all the'} rows of another epoch (another shuffle) of the same "
        "plan, the same for every worker count; examples/s counts from the first batch to the last (the train "
        "stage keeps one iterator for all steps); wall time with worker start-up and CPU time are in results.json.",
        f"What travels to a worker: the pickled TokenisedSplit, {compute[top]['pickled_bytes']['dataset']} bytes, and "
        f"VisionCollator, {compute[top]['pickled_bytes']['collator']} bytes (paths and settings, no image); workers "
        "read the image bytes from the memory-mapped Arrow files.",
        "Memory: /proc/<pid>/smaps_rollup of the main process and each worker, read at "
        + ", ".join(f"{f:.0%}" for f in MEMORY_POINTS) + " of each run's rows (the reads left out of its time); "
        f"medians over the runs. The {settings['large_factor']}x set is the same rows "
        "repeated, and the same number of rows is read from each. File-backed PSS is libraries and the pages of "
        "the memory-mapped Arrow files a process has touched: page cache, shared, counted once over the processes "
        f"and reclaimable, not copies. One more worker adds {added['small']['file']:.0f} MiB of it on the 1x set and "
        f"{added['large']['file']:.0f} MiB on the {settings['large_factor']}x set. Each of 2 workers has "
        f"{memory[('small', 2)]['worker_file']:.0f} MiB of file-backed PSS on the 1x set and "
        f"{memory[('large', 2)]['worker_file']:.0f} MiB on the {settings['large_factor']}x set for as many rows "
        f"read: reading a row maps more of the file than the row (one row of {row_kib:.0f} KiB of image mapped "
        f"{mapped_mib:.2f} MiB, median of {len(mapping['mapped_bytes'])} rows far apart), so what a worker maps "
        "follows the rows it reads and how far apart they lie in the file. Shared memory (batches on their way to "
        "the main process) is the rest of the PSS.",
        f"Cache: {built['bytes'] / MiB:,.0f} MiB of float32 pixel values for {rows:,} examples (plus "
        f"{cache_rows_bytes / MiB:.1f} MiB of rows without image bytes) against {facts['png_bytes_total'] / MiB:.0f} "
        "MiB of PNG in the rows; float16 would halve it, uint8 after resize and crop quarter it (rescale and normalise "
        f"then in the collator). Bit-identical to the collator's output: {built['matches_collator']}. Read from page "
        "cache here (just written): a set larger than RAM would be read from disk every epoch.",
    ]
    return record(
        NAME, TITLE, ours, reference, higher_is_better=True, goals=goals, others=others,
        setup={**settings, "png_bytes_mean": facts["png_bytes_mean"], "image_tokens": facts["image_tokens"],
               "build_seconds": facts["build_seconds"], "arrow_bytes": sizes, "cache_bytes": built["bytes"],
               "cache_rows_bytes": cache_rows_bytes, "predicted_one_core_examples_per_second": predicted,
               "per_example_wall_ms": wall_ms, "mapped_per_row_read_bytes": mapping["mapped_bytes"], "per_example_cpu_ms": stage_cpu, "cache_matches_collator": built["matches_collator"],
               "memory_mib": {f"{size}_set_{w}_workers": v for (size, w), v in memory.items()}},
        notes=notes,
    )


PROBES = {"loader": probe_loader, "limits": probe_limits, "build_cache": probe_build_cache, "mapping": probe_mapping}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Vision-batches probes (run by the benchmark in a fresh process).")
    parser.add_argument("probes", help=f"JSON list of [kind, keyword arguments]; kinds: {', '.join(PROBES)}")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    train_stage_imports()
    print(json.dumps([PROBES[kind](**arguments) for kind, arguments in json.loads(args.probes)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
