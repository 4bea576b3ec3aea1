"""Benchmark 3: memory of 8 DataLoader workers over a large pre-tokenised set.

Ours: the train stage's own ``TokenisedSplit`` (workflow_scripts/data/batching.py), the pre-tokenised set
opened with ``datasets.load_from_disk`` (memory-mapped Arrow), which workers inherit as a file mapping. Reference: the same rows held as an in-memory Python list of
dicts, like the seed's ``TextLineDataset`` (cnm-bert post-mortem), which forked workers inherit
copy-on-write; reference counting then writes to every object a worker touches, so pages it reads
become private copies (pytorch #63301).

Each side runs in a fresh process that reads one full shuffled epoch through 8 persistent workers;
memory is the proportional set size (PSS, /proc/<pid>/smaps_rollup) summed over the main process and
its workers, so pages they share are counted once. The fixed cost of nine Python processes with torch
is measured the same way on a small set and subtracted to give the dataset's share.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import synthetic
from benchmarks.records import Goal, Series, record

NAME = "worker_memory"
MIN_SECONDS = 480  # one run of each side at full scale on 2 quiet cores, for run.py's time planning
TITLE = "Worker memory: main + 8 DataLoader workers, PSS over one epoch"
MiB = 2**20

SCALES = {
    # Short rows keep the in-memory reference (~1 KiB of Python objects per row) inside this
    # machine's RAM at two million rows; the Arrow side would be the same at any row length.
    "full": {"rows": 2_000_000, "fixed_rows": 2_000, "workers": 8, "batch_size": 256, "repetitions": 3,
             "reference_repetitions": 1,
             "length": {"low": 8, "high": 64, "median": 14, "sigma": 0.5}},
    "tiny": {"rows": 4_000, "fixed_rows": 400, "workers": 2, "batch_size": 64, "repetitions": 1,
             "reference_repetitions": 1,
             "length": {"low": 8, "high": 32, "median": 10, "sigma": 0.5}},
}
VOCAB = 32_000


def smaps_rollup(pid: int) -> dict[str, int]:
    """Pss, Pss_Anon and Pss_File of one process, in bytes: shared pages are divided among the
    processes sharing them, so summing over processes counts each page once."""
    wanted = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file"}
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            key = line.split(maxsplit=1)[0]
            if key in wanted:
                found[wanted[key]] = int(line.split()[1]) * 1024
    if "pss" not in found:
        raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss line")
    return found


def family_pss(pid: int) -> tuple[int, list[dict]]:
    """(PSS of pid and its descendants, per-process breakdown)."""
    import psutil

    processes = [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    breakdown = []
    for member in processes:
        try:
            breakdown.append({"pid": member, **smaps_rollup(member)})
        except (FileNotFoundError, ProcessLookupError):  # a worker exiting between listing and reading
            pass
    return sum(p["pss"] for p in breakdown), breakdown


class PythonListDataset:
    """The reference: every row as a Python dict of Python lists, loaded once into the main process."""

    def __init__(self, data_dir: str):
        from datasets import load_from_disk

        table = load_from_disk(data_dir)["train"].data.table
        self.rows = []  # what the seed's TextLineDataset held: every row as Python objects
        offsets = table.column("input_ids").combine_chunks().offsets.to_numpy()
        ids = table.column("input_ids").combine_chunks().values.to_numpy()
        labels = table.column("labels").combine_chunks().values.to_numpy()
        for i, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            self.rows.append({"id": f"row-{i}", "input_ids": ids[start:end].tolist(),
                              "labels": labels[start:end].tolist(), "length": end - start})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def probe(kind: str, data_dir: str, workers: int, batch_size: int, seed: int, cap_bytes: int) -> dict:
    """Read one shuffled epoch through ``workers`` persistent workers; report the family's PSS.

    The epoch stops early when the family passes ``cap_bytes`` (the machine is shared; the
    in-memory reference can grow past its RAM); the figure is then a lower bound, marked ``capped``.
    """
    import torch
    from torch.utils.data import DataLoader

    from workflow_scripts.data import batching

    torch.set_num_threads(1)
    before, _ = family_pss(os.getpid())
    started = time.perf_counter()
    if kind == "arrow":
        dataset = batching.TokenisedSplit(data_dir, "train")  # the train stage's own data set class
        lengths = dataset.lengths()
    else:
        dataset = PythonListDataset(data_dir)
        lengths = np.array([row["length"] for row in dataset.rows])
    load_seconds = time.perf_counter() - started
    after_load, _ = family_pss(os.getpid())
    # The train stage's sampler and collator on both sides: one micro-batch of `batch_size` per step.
    plan = batching.GlobalBatchPlan(lengths, batch_size, seed)
    batch_sampler = batching.RankBatchSampler(plan, batch_size, 0, 1, 0, plan.batches_per_epoch)
    collator = batching.PaddingCollator(synthetic.PAD_ID, VOCAB)

    peak, peak_breakdown = [0], [[]]
    stop, capped = threading.Event(), threading.Event()

    def sample() -> None:  # PSS while the epoch runs; the peak may come before the end
        while not stop.wait(0.5):
            total, breakdown = family_pss(os.getpid())
            if total > peak[0]:
                peak[0], peak_breakdown[0] = total, breakdown
            if peak[0] > cap_bytes:
                capped.set()

    loader = DataLoader(dataset, batch_sampler=batch_sampler, num_workers=workers, collate_fn=collator,
                        persistent_workers=True, multiprocessing_context="fork")
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    tokens = rows = 0
    for batch in loader:
        tokens += batch["target_tokens"]
        rows += batch["input_ids"].shape[0]
        if capped.is_set():
            break
    epoch_seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    end, processes = family_pss(os.getpid())  # workers are persistent: still alive here
    return {"kind": kind, "rows": rows, "epoch_rows": plan.batches_per_epoch * batch_size, "capped": capped.is_set(), "cap_bytes": cap_bytes,
            "target_tokens": tokens, "workers": len(processes) - 1,
            "breakdown_end": processes, "breakdown_peak": peak_breakdown[0],
            "pss_start": before, "pss_after_load": after_load, "pss_end": end, "pss_peak": max(peak[0], end),
            "load_seconds": load_seconds, "epoch_seconds": epoch_seconds}


def memory_cap() -> int:
    """The most the reference may take: 70% of the memory available now, at most 20 GiB."""
    import psutil

    return int(min(0.7 * psutil.virtual_memory().available, 20 * 2**30))


def run_probe(kind: str, data_dir: Path, workers: int, batch_size: int, seed: int) -> dict:
    """One measurement in a fresh interpreter, so nothing from this process is counted."""
    command = [sys.executable, "-m", "benchmarks.bench_worker_memory", "--kind", kind, "--data", str(data_dir),
               "--workers", str(workers), "--batch-size", str(batch_size), "--seed", str(seed),
               "--cap-bytes", str(memory_cap())]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise RuntimeError(f"worker-memory probe ({kind}) failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_set(directory: Path, rows: int, length: dict, seed: int) -> tuple[Path, np.ndarray]:
    lengths = synthetic.long_tailed_lengths(rows, length["low"], length["high"], length["median"], length["sigma"], seed)
    table = synthetic.tokenised_table(lengths, VOCAB, seed)
    return synthetic.save_tokenised(table, directory, VOCAB, int(length["high"])), lengths


def run(scale: str = "full", work_dir: Path | None = None, log=print, deadline: float | None = None) -> dict:
    """``deadline`` (time.monotonic()): repetitions beyond the first of each side are dropped when they
    would not finish by then (recorded in the notes)."""
    settings = SCALES[scale]
    skipped_for_time: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-worker-memory-", dir=work_dir) as tmp:
        tmp = Path(tmp)
        large, lengths = build_set(tmp / "large", settings["rows"], settings["length"], seed=3)
        small, _ = build_set(tmp / "small", settings["fixed_rows"], settings["length"], seed=4)
        dataset_bytes = synthetic.arrow_bytes(large)
        log(f"  worker memory: {settings['rows']:,} rows, Arrow data {dataset_bytes / MiB:.0f} MiB")
        measured: dict[str, list[dict]] = {"arrow": [], "pylist": []}
        fixed: dict[str, dict] = {}
        seconds: dict[str, float] = {}

        def measure(kind: str) -> None:
            started = time.monotonic()
            result = run_probe(kind, large, settings["workers"], settings["batch_size"], seed=len(measured[kind]))
            seconds[kind] = time.monotonic() - started
            measured[kind].append(result)
            log(f"  worker memory {kind} #{len(measured[kind])}: PSS end {result['pss_end'] / MiB:.0f} MiB, "
                f"peak {result['pss_peak'] / MiB:.0f} MiB (fixed cost {fixed[kind]['pss_peak'] / MiB:.0f} MiB), "
                f"load {result['load_seconds']:.0f} s, epoch {result['epoch_seconds']:.0f} s")

        for kind in ("arrow", "pylist"):  # one of each first, so both sides are always measured
            fixed[kind] = run_probe(kind, small, settings["workers"], settings["batch_size"], seed=0)
            measure(kind)
        for kind, wanted in (("arrow", settings["repetitions"]), ("pylist", settings["reference_repetitions"])):
            while len(measured[kind]) < wanted:
                if deadline is not None and time.monotonic() + 1.2 * seconds[kind] > deadline:
                    skipped_for_time.append(f"{kind}: {len(measured[kind])} of {wanted} runs (time budget)")
                    break
                measure(kind)

    def side(kind: str, point: str) -> Series:
        """Dataset-attributable PSS: the family's total at ``point`` (peak or end) minus the fixed cost."""
        runs = measured[kind]
        samples = [(r[f"pss_{point}"] - fixed[kind][f"pss_{point}"]) / MiB for r in runs]
        who = {"arrow": "ours: the train stage's TokenisedSplit (memory-mapped Arrow)",
               "pylist": "reference: in-memory Python list of rows"}[kind]
        return Series(
            f"{who}, {point}" if point != "peak" else who,
            samples, f"MiB PSS attributable to the dataset (main + workers, {point} of the epoch)",
            {"fixed_cost_mib": fixed[kind][f"pss_{point}"] / MiB,
             "total_mib": [r[f"pss_{point}"] / MiB for r in runs],
             "main_after_load_mib": [(r["pss_after_load"] - r["pss_start"]) / MiB for r in runs],
             "epoch_seconds": [r["epoch_seconds"] for r in runs],
             "load_seconds": [r["load_seconds"] for r in runs],
             "capped_lower_bound": any(r["capped"] for r in runs),
             "rows_read": [r["rows"] for r in runs], "epoch_rows": runs[0]["epoch_rows"],
             "worker_processes": runs[0]["workers"],
             "per_process_at_peak_mib": [{k: round(v / MiB, 1) for k, v in p.items() if k != "pid"}
                                         for p in runs[0]["breakdown_peak"]]},
        )

    def split(kind: str, result: dict) -> dict[str, float]:
        """Anonymous (heap) and file-backed (mapped Arrow, libraries) PSS at the peak, MiB."""
        rows = result["breakdown_peak"] or result["breakdown_end"]
        return {key: sum(p.get(key, 0) for p in rows) / MiB for key in ("anon", "file")}

    ours, reference = side("arrow", "peak"), side("pylist", "peak")
    first, base = split("arrow", measured["arrow"][0]), split("arrow", fixed["arrow"])
    heap, mapped = first["anon"] - base["anon"], first["file"] - base["file"]
    first_run = measured["arrow"][0]

    def worker_heaps(result: dict) -> list[float]:
        return [p["anon"] / MiB for p in (result["breakdown_peak"] or result["breakdown_end"])[1:]] or [0.0]

    workers_heap, base_workers_heap = worker_heaps(first_run), worker_heaps(fixed["arrow"])
    why = (f"of the dataset's share, {mapped:.0f} MiB are file-backed pages (the mapped Arrow data, counted once "
           f"however many processes read it; the set is {dataset_bytes / MiB:.0f} MiB) and {heap:.0f} MiB are private "
           f"heap. Each worker holds about {np.median(workers_heap):.0f} MiB of heap against "
           f"{np.median(base_workers_heap):.0f} MiB on the small set: forked workers write into the heap they inherit, "
           f"so whatever the main process allocated before forking is copied into each of them. Before forking, the "
           f"main process spent {first_run['load_seconds']:.0f} s opening the set and reading its lengths "
           f"(TokenisedSplit.lengths) and grew by {(first_run['pss_after_load'] - first_run['pss_start']) / MiB:.0f} MiB")
    ours_end, reference_end = side("arrow", "end"), side("pylist", "end")
    size_mib = dataset_bytes / MiB
    total_ours = Series("ours: total PSS of main + workers, peak (fixed cost included)", ours.details["total_mib"], "MiB")
    total_reference = Series("reference: total PSS of main + workers, peak (fixed cost included)",
                             reference.details["total_mib"], "MiB")
    goals = [
        Goal("ours: dataset-attributable PSS of main + 8 workers (peak over the epoch) <= 1.1x the dataset's Arrow size",
             ours.median / size_mib, 1.1, higher_is_better=False, why=why),
        Goal("ours, literal reading: total PSS of main + 8 workers incl. the fixed cost of 9 Python+torch processes "
             "<= 1.1x the dataset's size", total_ours.median / size_mib, 1.1, higher_is_better=False,
             why=f"the fixed cost alone (interpreter, torch and datasets in 9 processes, no data) is "
                 f"{fixed['arrow']['pss_peak'] / MiB:.0f} MiB, {fixed['arrow']['pss_peak'] / dataset_bytes:.2f}x this "
                 "set; only a set several times larger could meet this reading"),
    ]
    notes = ["Memory values are MiB; goal values are multiples of the dataset's Arrow size.",
             "Fixed cost = the same probe over a small set (Python + torch in 9 processes); it is subtracted "
             "from each side's total to give the dataset's share.",
             "Both sides use the train stage's own batch plan, sampler and collator (workflow_scripts/data/batching.py), "
             "fork start method and persistent workers; ours reads through the stage's TokenisedSplit. One full "
             "epoch is read before the end figure is taken."]
    if settings["reference_repetitions"] < settings["repetitions"]:
        notes.append(f"The reference ran {settings['reference_repetitions']} time(s), ours {settings['repetitions']}: "
                     "each reference run builds two million rows of Python objects and holds many GiB, and its "
                     "figure is tens of times ours, so its run-to-run noise cannot change the comparison.")
    if skipped_for_time:
        notes.append("Fewer repetitions than planned, to stay within `make bench`'s time limit: "
                     + "; ".join(skipped_for_time) + ".")
    if reference.details["capped_lower_bound"]:
        read = min(r["rows"] for r in measured["pylist"]) / measured["pylist"][0]["epoch_rows"]
        notes.append(f"The reference passed the memory cap (70% of the RAM available when it started, "
                     f"{measured['pylist'][0]['cap_bytes'] / 2**30:.1f} GiB) after {read:.0%} of its epoch and was "
                     "stopped there: its figure is a lower bound.")
    return record(
        NAME, TITLE, ours, reference, higher_is_better=False, goals=goals,
        others=[ours_end, reference_end, total_ours, total_reference],
        setup={"rows": settings["rows"], "workers": settings["workers"], "batch_size": settings["batch_size"],
               "ours_attributable_split_mib": {"file_backed": mapped, "heap": heap},
               "dataset_arrow_mib": size_mib, "lengths": synthetic.length_summary(lengths),
               "start_method": "fork", "persistent_workers": True, "fixed_cost_rows": settings["fixed_rows"]},
        notes=notes,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One worker-memory probe (run by the benchmark in a fresh process).")
    parser.add_argument("--kind", choices=["arrow", "pylist"], required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--cap-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.kind, args.data, args.workers, args.batch_size, args.seed, args.cap_bytes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
