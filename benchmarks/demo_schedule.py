"""The demo's quiet wall time for more seeds or fewer steps, estimated from one completed quiet demo.

A shared machine cannot time the demo, but a quiet one-seed run's benchmark files (``results/benchmarks/``) give
each job's quiet seconds, and its ``train_log.jsonl`` files the seconds of the training steps
(``elapsed_seconds`` per step; the rest of the train job is its fixed part). The jobs and their dependencies
(download -> normalise -> pretokenise and evaluate_base -> power -> sanity -> train -> evaluate -> compare) are
list-scheduled on 2 cores as Snakemake runs them (pretokenise takes both; the sanity gate once per experiment,
every seed's train after it), with a per-job overhead fitted so that the one-seed schedule matches its measured
wall time.

    python -m benchmarks.demo_schedule --results <completed 1-seed demo>/results --measured 376
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


class Demo:
    def __init__(self, results: Path):
        self.results = results
        self.pairs = sorted(tuple(path.relative_to(results / "benchmarks").parts[:3])
                            for path in (results / "benchmarks").glob("tiny-*/*/*/seed1/train.tsv"))

    def wall(self, relative: str) -> float:
        header, values = (self.results / "benchmarks" / f"{relative}.tsv").read_text().splitlines()[:2]
        return float(dict(zip(header.split("\t"), values.split("\t")))["s"])

    def train_split(self, model: str, dataset: str, variant: str) -> tuple[float, dict[int, float]]:
        """(the train job's seconds besides its steps, {step: elapsed seconds of the steps})."""
        elapsed = {}
        for line in (self.results / model / dataset / variant / "seed1" / "train_log.jsonl").read_text().splitlines():
            record = json.loads(line)
            elapsed[record["step"]] = record["elapsed_seconds"]
        return self.wall(f"{model}/{dataset}/{variant}/seed1/train") - elapsed[max(elapsed)], elapsed

    def gate_wall(self, model: str, dataset: str, variant: str) -> float:
        """The gate's seconds: results/benchmarks/<experiment>/sanity.tsv, or seed1/sanity.tsv in a run made
        before the gate ran once per experiment (issue 25)."""
        once = f"{model}/{dataset}/{variant}/sanity"
        return self.wall(once if (self.results / "benchmarks" / f"{once}.tsv").exists() else
                         f"{model}/{dataset}/{variant}/seed1/sanity")

    def jobs(self, seeds: int, steps: dict[int, int], peft_saving: float = 0.0,
             gate_per_seed: bool = False) -> dict[str, tuple[float, int, list[str]]]:
        """{job: (seconds, cores, dependencies)}; ``steps`` maps a run's step count to the new one, ``peft_saving``
        is taken off each peft job (sanity, train, evaluate with an adapter). One gate per experiment, as the
        rules run it; ``gate_per_seed``: one per experiment and seed, as the rules did before issue 25."""
        jobs = {}
        for dataset in sorted({d for _, d, _ in self.pairs}):
            jobs[f"download/{dataset}"] = (self.wall(f"download/{dataset}"), 1, [])
            jobs[f"normalise/{dataset}"] = (self.wall(f"normalise/{dataset}"), 1, [f"download/{dataset}"])
        for model in sorted({m for m, _, _ in self.pairs}):
            jobs[f"prepare_model/{model}"] = (self.wall(f"prepare_model/{model}"), 1, [])
        for m, d, v in self.pairs:
            inputs = [f"normalise/{d}", f"prepare_model/{m}"]
            jobs[f"pretokenise/{d}/{m}/{v}"] = (self.wall(f"pretokenise/{d}/{m}/{v}"), 2, inputs)
            jobs[f"evaluate_base/{m}/{d}/{v}"] = (self.wall(f"{m}/{d}/{v}/base/evaluate"), 1, inputs)
        for m, d in sorted({(m, d) for m, d, _ in self.pairs}):
            jobs[f"power/{m}/{d}"] = (self.wall(f"{m}/{d}/power"), 1,
                                      [f"evaluate_base/{m}/{d}/{v}" for mm, dd, v in self.pairs if (mm, dd) == (m, d)])
        finals = []
        for m, d, v in self.pairs:
            fixed, elapsed = self.train_split(m, d, v)
            last = max(elapsed)
            train = fixed + elapsed[steps.get(last, last)] - peft_saving
            gate_inputs = [f"pretokenise/{d}/{m}/{v}", f"power/{m}/{d}"]
            if not gate_per_seed:
                jobs[f"sanity/{m}/{d}/{v}"] = (self.gate_wall(m, d, v) - peft_saving, 1, gate_inputs)
            for seed in range(1, seeds + 1):
                run = f"{m}/{d}/{v}/{seed}"
                gate = f"sanity/{run}" if gate_per_seed else f"sanity/{m}/{d}/{v}"
                if gate_per_seed:
                    jobs[gate] = (self.gate_wall(m, d, v) - peft_saving, 1, gate_inputs)
                jobs[f"train/{run}"] = (train, 1, [gate])
                jobs[f"evaluate/{run}"] = (self.wall(f"{m}/{d}/{v}/seed1/evaluate") - peft_saving, 1, [f"train/{run}"])
                finals.append(f"evaluate/{run}")
        jobs["compare"] = (self.wall("compare"), 1, finals + [job for job in jobs if job.startswith("evaluate_base/")])
        return jobs


def schedule(jobs: dict[str, tuple[float, int, list[str]]], cores: int = 2, overhead: float = 0.0) -> float:
    """Wall seconds of a greedy list schedule: every free core takes the next ready job, in the jobs' order."""
    finished, running, now, free, pending = {}, [], 0.0, cores, dict(jobs)
    while pending or running:
        for name in [n for n in jobs if n in pending and all(d in finished for d in pending[n][2])]:
            seconds, needs, _ = pending[name]
            if min(needs, cores) <= free:
                free -= min(needs, cores)
                running.append((now + seconds + overhead, name, min(needs, cores)))
                del pending[name]
        running.sort()
        end, name, needs = running.pop(0)
        now, free, finished[name] = end, free + needs, end
    return now


def fitted_overhead(demo: Demo, measured: float) -> float:
    """The per-job overhead (0.1 s grid) that makes the one-seed schedule closest to its measured wall time."""
    one = demo.jobs(1, {})
    return min((k / 10 for k in range(0, 31)), key=lambda o: abs(schedule(one, overhead=o) - measured))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, required=True, help="results/ of a completed quiet one-seed demo")
    parser.add_argument("--measured", type=float, required=True, help="its measured wall seconds")
    parser.add_argument("--peft-saving", type=float, default=1.3, help="seconds saved per peft job (bitsandbytes left out)")
    args = parser.parse_args(argv)
    demo = Demo(args.results)
    overhead = fitted_overhead(demo, args.measured)
    cut = {300: 200, 120: 100}
    cases = [("1 seed", demo.jobs(1, {})),
             ("3 seeds, a gate per seed, as it was", demo.jobs(3, {}, gate_per_seed=True)),
             ("3 seeds, a gate per seed, bitsandbytes left out", demo.jobs(3, {}, args.peft_saving, gate_per_seed=True)),
             ("3 seeds, bitsandbytes left out, one gate per experiment", demo.jobs(3, {}, args.peft_saving)),
             ("... + 200 steps instead of 300, 100 instead of 120", demo.jobs(3, cut, args.peft_saving)),
             ("... + 150 steps instead of 300", demo.jobs(3, {300: 150, 120: 100}, args.peft_saving)),
             ("2 seeds, bitsandbytes left out, one gate per experiment", demo.jobs(2, {}, args.peft_saving))]
    print(f"per-job overhead fitted to the measured {args.measured:.0f} s: {overhead:.1f} s")
    print("| demo | jobs | job-seconds | simulated quiet wall |\n|---|---:|---:|---:|")
    for label, jobs in cases:
        wall = schedule(jobs, overhead=overhead)
        print(f"| {label} | {sum(1 for j in jobs.values() if j[0] > 0)} | {sum(j[0] for j in jobs.values()):,.0f} | "
              f"{int(wall // 60)} min {wall % 60:.0f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
