"""`make bench`: run every benchmark and write benchmarks/results.json and benchmarks/RESULTS.md.

    python -m benchmarks.run                       # everything, full size (about 45 min on 2 CPU cores)
    python -m benchmarks.run --only worker_memory  # one benchmark
    python -m benchmarks.run --only worker_memory --update   # re-measure one, keep the others' records
    python -m benchmarks.run --scale tiny --out-dir <dir>   # the harness at a tiny size (tests)

A benchmark that cannot run here (no GPU) is recorded as skipped with the reason; one that fails is
recorded as failed with its error, the others still run, and the exit code is 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

from benchmarks import (bench_gpu, bench_packing, bench_pretokenise, bench_training, bench_worker_memory,
                        bench_workflow_overhead, records, report)
from benchmarks import bench_corpus, bench_strategies, bench_vision_batches
from workflow_scripts.core.atomic_output import atomic_path, write_json

BENCHMARKS = {
    module.NAME: module
    # The workflow benchmark may first run a reduced demo; it goes before the longest one, whose extra
    # repetitions give way when time runs short.
    for module in (bench_training, bench_packing, bench_pretokenise, bench_workflow_overhead, bench_worker_memory, bench_gpu)
}
BENCHMARKS[bench_vision_batches.NAME] = bench_vision_batches  # VLM batches: workers, memory, pixel cache
# Past one process's memory: DDP vs FSDP vs QLoRA through the train stage, two gloo processes.
BENCHMARKS[bench_strategies.NAME] = bench_strategies
# Text corpus (masked LM): normalise + pretokenise of 1M and 10M generated lines, the longest benchmark.
BENCHMARKS[bench_corpus.NAME] = bench_corpus
HERE = Path(__file__).resolve().parent


def run_all(names: list[str], scale: str, work_dir: Path | None, budget_s: float, log=print) -> list[dict]:
    deadline = time.monotonic() + budget_s
    results = []
    for position, name in enumerate(names):
        module = BENCHMARKS[name]
        # Leave the benchmarks still to come at least their minimal run.
        later = sum(BENCHMARKS[n].MIN_SECONDS for n in names[position + 1:]) if scale == "full" else 0
        log(f"[{name}] {module.TITLE}")
        started = time.perf_counter()
        try:
            result = module.run(scale=scale, work_dir=work_dir, log=log, deadline=deadline - later)
        except Exception as error:  # one broken benchmark must not hide the others' figures
            log(traceback.format_exc())
            result = records.not_run(name, module.TITLE, "failed", f"{type(error).__name__}: {error}")
        result["seconds"] = time.perf_counter() - started
        log(f"[{name}] {result['status']} in {result['seconds']:.0f} s")
        results.append(result)
    return results


def plain(value):
    """JSON for numpy scalars and paths; anything else unknown is a bug, not a string."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    parser.add_argument("--scale", choices=["full", "tiny"], default="full",
                        help="full: the sizes the goals are set for; tiny: seconds, for testing the harness")
    parser.add_argument("--out-dir", type=Path, default=HERE, help="where results.json and RESULTS.md go")
    parser.add_argument("--work-dir", type=Path, default=None, help="parent of temporary data (default: system temp)")
    parser.add_argument("--update", action="store_true",
                        help="keep the other benchmarks' records already in OUT_DIR/results.json (with --only)")
    parser.add_argument("--budget-minutes", type=float, default=50.0,
                        help="time for the whole run; the optional reduced demo is skipped when it would not fit")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    names = [name for name in BENCHMARKS if name in args.only] if args.only else list(BENCHMARKS)
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    results = run_all(names, args.scale, args.work_dir, 60 * args.budget_minutes)
    run_info = {
        "scale": args.scale,
        "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "total_seconds": time.perf_counter() - started,
        "load_average_start": load_start,
        "hardware": records.hardware(),
        "packages": records.packages(),
        "command": " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])]),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results_path = args.out_dir / "results.json"
    if args.update and results_path.exists():
        previous = json.loads(results_path.read_text())
        fresh = {r["name"] for r in results}
        kept = [r for r in previous["benchmarks"] if r["name"] not in fresh]
        results = [r for name in BENCHMARKS for r in kept + results if r["name"] == name]
        run_info["updated"] = sorted(fresh)
        run_info["total_seconds"] += previous["run"]["total_seconds"]
    document = json.loads(json.dumps({"run": run_info, "benchmarks": results}, default=plain))
    write_json(results_path, document)
    with atomic_path(args.out_dir / "RESULTS.md") as path:
        path.write_text(report.render(document["benchmarks"], document["run"]))
    print(f"wrote {args.out_dir / 'results.json'} and {args.out_dir / 'RESULTS.md'} "
          f"in {run_info['total_seconds']:.0f} s")
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
