"""Benchmark 4: Snakemake's own overhead with the real Snakefile.

(a) ``snakemake -n`` over a generated config of 4 datasets x 3 variants x 5 seeds (60 experiments,
    215 jobs), in a temporary working directory whose local split files exist but are empty (a dry
    run reads no data);
(b) a no-op rerun (``snakemake --cores 2`` with nothing to do) of the completed demo: the repository's
    own results when ``make demo`` has completed them, otherwise a reduced demo (one dataset, one
    variant, one seed, a few steps) run first in a temporary directory. If neither can be had, (b) is
    reported as not measured, with the reason;
(c) in the same completed directory, each stage's fixed cost per job (``benchmarks/stage_startup.py``): one
    recorded job of each stage rerun, timed from process start to its first useful line, with its imports.

Both are wall-clock times of the whole ``snakemake`` command, start-up included, as a user sees them.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks import stage_startup
from benchmarks.records import Goal, Series, record

NAME = "workflow_overhead"
MIN_SECONDS = 30  # a minimal run at full scale on 2 quiet cores, for run.py's time planning
TITLE = "Workflow overhead: dry run of 60 experiments; no-op rerun of the completed demo"
REPO = Path(__file__).resolve().parent.parent
SCALES = {"full": {"repetitions": 5, "datasets": 4, "variants": 3, "seeds": 5, "demo_budget_s": 300,
                   "startup_repetitions": 3},
          "tiny": {"repetitions": 1, "datasets": 1, "variants": 1, "seeds": 1, "demo_budget_s": 0,
                   "startup_repetitions": 0}}
NOTHING_TO_DO = "Nothing to be done"


def snakemake_command(workdir: Path, configfile: Path | None, *args: str) -> list[str]:
    command = [str(Path(sys.executable).with_name("snakemake")), "-s", str(REPO / "Snakefile"),
               "--directory", str(workdir), "--cores", "2"]
    if configfile is not None:
        command += ["--configfile", str(configfile)]
    return command + list(args)


def snakemake_env() -> dict:
    env = dict(os.environ)
    # Rules call `python -m ...`: the venv's python must come first, as `make demo` arranges.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def timed(command: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=snakemake_env())
    return time.perf_counter() - start, done


def matrix_config(workdir: Path, datasets: int, variants: int, seeds: int) -> Path:
    """A config with datasets x variants x seeds experiments over empty local split files."""
    variant_pool = {
        "baseline": {"prompt": "Question: {question}\nAnswer:", "target": " {answer}"},
        "mtup": {"prompt": "Question: {question}\nSolve Task 1 then Task 2.\n",
                 "target": "Task 1: {answer}\nTask 2: {answer}",
                 "extractor": {"type": "section", "marker": "Task 2:"}},
        "terse": {"prompt": "{question} =>", "target": " {answer}"},
    }
    config = {
        "model": {"name": "tiny-llama", "source": "tiny"},
        "datasets": {},
        "variants": dict(list(variant_pool.items())[:variants]),
        "seeds": list(range(1, seeds + 1)),
        "training": {"max_steps": 100},
    }
    splits = {"train": "train", "validation": "validation", "test": "test"}
    for i in range(datasets):
        directory = workdir / "data" / f"set{i}"
        directory.mkdir(parents=True, exist_ok=True)
        for split in splits.values():  # the download rule's inputs must exist; a dry run never reads them
            (directory / f"{split}.jsonl").touch()
        config["datasets"][f"set{i}"] = {"source": {"type": "local", "path": f"data/set{i}"}, "splits": splits,
                                         "format": "jsonl", "fields": {"question": "question", "answers": "answers"},
                                         "metric": "exact_match"}
    path = workdir / "matrix.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def dry_run_times(repetitions: int, datasets: int, variants: int, seeds: int, work_dir: Path | None) -> tuple[list[float], int]:
    with tempfile.TemporaryDirectory(prefix="bench-dryrun-", dir=work_dir) as tmp:
        tmp = Path(tmp)
        configfile = matrix_config(tmp, datasets, variants, seeds)
        times, jobs = [], 0
        for _ in range(repetitions):
            seconds, done = timed(snakemake_command(tmp, configfile, "-n"), timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"snakemake -n failed: {(done.stderr or done.stdout)[-2000:]}")
            times.append(seconds)
            jobs = _job_total(done.stdout + done.stderr)
        return times, jobs


def _job_total(output: str) -> int:
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "total" and parts[1].isdigit():
            return int(parts[1])
    return 0


def _pending_jobs(workdir: Path, configfile: Path | None) -> tuple[bool, str]:
    """(True, '') when a dry run finds nothing to do in ``workdir``; else (False, why)."""
    _, done = timed(snakemake_command(workdir, configfile, "-n"), timeout=300)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        return False, f"snakemake -n failed there: {output.strip().splitlines()[-1] if output.strip() else done.returncode}"
    if NOTHING_TO_DO in output:
        return True, ""
    return False, f"{_job_total(output)} jobs still to run"


def reduced_demo(tmp: Path, budget_s: float) -> tuple[Path | None, Path | None, str]:
    """Run a reduced demo (1 dataset, 1 variant, 1 seed, few steps) to completion in ``tmp``."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    first_dataset = next(iter(config["datasets"]))
    reduced = copy.deepcopy(config)
    reduced["datasets"] = {first_dataset: config["datasets"][first_dataset]}
    kept_models = config["datasets"][first_dataset].get("models") or list(config["models"])
    reduced["models"] = {name: config["models"][name] for name in kept_models}  # a model no dataset trains is refused
    reduced["variants"] = {"baseline": config["variants"]["baseline"]}
    reduced["seeds"] = config["seeds"][:1]
    reduced.setdefault("training", {}).update({"max_steps": 4, "warmup_steps": 0, "checkpoint_every": 2, "log_every": 1})
    reduced.setdefault("evaluation", {}).update({"max_examples": 8, "max_new_tokens": 8})
    reduced.setdefault("comparison", {})
    os.symlink(REPO / "demo_data", tmp / "demo_data")
    configfile = tmp / "reduced_demo.yaml"
    configfile.write_text(yaml.safe_dump(reduced, sort_keys=False))
    try:
        seconds, done = timed(snakemake_command(tmp, configfile), timeout=budget_s)
    except subprocess.TimeoutExpired:
        return None, None, f"the reduced demo did not finish within {budget_s:.0f} s"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return None, None, "the reduced demo failed: " + " | ".join(tail)
    return tmp, configfile, f"reduced demo (1 dataset, 1 variant, 1 seed, 4 steps) completed in {seconds:.0f} s"


def noop_rerun_times(repetitions: int, budget_s: float, work_dir: Path | None,
                     startup_repetitions: int = 0) -> tuple[list[float], str, list[dict]]:
    """Times of a no-op rerun, a description of what was rerun (or why nothing could be), and with
    ``startup_repetitions`` the stage start-up rows (stage_startup.measure) of the same completed directory."""
    ready, why_not = ((REPO / "results" / "comparison.md").exists(), "no results/comparison.md in the repository")
    if ready:
        ready, why_not = _pending_jobs(REPO, None)
        why_not = f"the repository's demo is not complete: {why_not}" if not ready else ""
    if ready:
        return (_time_noop(REPO, None, repetitions), "the repository's completed demo (`make demo`, default config)",
                _startup(REPO, startup_repetitions))
    if budget_s < 60:
        return [], (f"not measured: {why_not}, and too little of the benchmark's time budget is left "
                    f"({max(budget_s, 0):.0f} s) to run a reduced demo first"), []
    with tempfile.TemporaryDirectory(prefix="bench-demo-", dir=work_dir) as tmp:
        workdir, configfile, what = reduced_demo(Path(tmp), budget_s)
        if workdir is None:
            return [], f"not measured: {why_not}; {what}", []
        ready, pending = _pending_jobs(workdir, configfile)
        if not ready:
            return [], f"not measured: after the reduced demo a dry run still finds work ({pending})", []
        return _time_noop(workdir, configfile, repetitions), what + f"; {why_not}", _startup(workdir, startup_repetitions)


def _startup(workdir: Path, repetitions: int) -> list[dict]:
    return stage_startup.measure(workdir, repetitions, log=lambda line: None) if repetitions else []


def _time_noop(workdir: Path, configfile: Path | None, repetitions: int) -> list[float]:
    times = []
    for _ in range(repetitions):
        seconds, done = timed(snakemake_command(workdir, configfile), timeout=300)
        output = done.stdout + done.stderr
        if done.returncode != 0 or NOTHING_TO_DO not in output:
            raise RuntimeError(f"the no-op rerun in {workdir} did something or failed: {output[-2000:]}")
        times.append(seconds)
    return times


def run(scale: str = "full", work_dir: Path | None = None, log=print, deadline: float | None = None) -> dict:
    """``deadline`` (time.monotonic()) caps the reduced demo, so `make bench` keeps its time limit."""
    settings = SCALES[scale]
    experiments = settings["datasets"] * settings["variants"] * settings["seeds"]
    dry, jobs = dry_run_times(settings["repetitions"], settings["datasets"], settings["variants"], settings["seeds"], work_dir)
    ours = Series(f"snakemake -n, {experiments} experiments ({jobs} jobs)", dry, "seconds", {"jobs": jobs})
    log(f"  dry run of {experiments} experiments ({jobs} jobs): " + ", ".join(f"{t:.2f}" for t in dry) + " s")
    startup, _ = timed([str(Path(sys.executable).with_name("snakemake")), "--version"], timeout=120)
    why = (f"`snakemake --version` alone (interpreter and imports) takes {startup:.1f} s on this machine; the rest is "
           f"parsing the Snakefile, validating the config and building the DAG of {jobs} jobs")
    goals = [Goal(f"dry run of {experiments} experiments < 10 s", ours.median, 10.0, higher_is_better=False, why=why)]
    others, notes = [], []
    budget = settings["demo_budget_s"]
    if deadline is not None:
        budget = min(budget, deadline - time.monotonic() - 30 * settings["repetitions"])
    rerun, what, startup = noop_rerun_times(settings["repetitions"], budget, work_dir, settings["startup_repetitions"])
    log(f"  no-op rerun: {what}" + (": " + ", ".join(f"{t:.2f} s" for t in rerun) if rerun else ""))
    if rerun:
        noop = Series("no-op rerun of the completed demo (snakemake --cores 2)", rerun, "seconds", {"what": what})
        others.append(noop)
        goals.append(Goal("no-op rerun of the completed demo < 10 s", noop.median, 10.0, higher_is_better=False,
                          why=why.replace(f"the DAG of {jobs} jobs", "the DAG and checking every output's "
                                          "modification time, parameters and code")))
    else:
        notes.append(f"No-op rerun {what}.")
    for row in startup:  # (c): what every job of the stage pays before its own work
        samples = row["samples"].get("ready") or row["samples"].get("end")
        others.append(Series(f"{row['stage']}: process start to its first useful line", samples, "seconds",
                             {key: row[key] for key in row if key != "samples"}))
    if startup:
        notes.append("Stage start-up (first useful line: the model built for training, loaded for evaluation, the "
                     "tokenizer loaded for pretokenise, main() for the others):\n\n" + stage_startup.TABLE_HEAD
                     + "\n" + "\n".join(stage_startup.table_row(row) for row in startup) + "\n")
    notes.append("No tool is compared here: the reference is the 10 s goal; times include Snakemake's start-up.")
    return record(NAME, TITLE, ours, None, higher_is_better=False, goals=goals, others=others, notes=notes,
                  setup={"datasets": settings["datasets"], "variants": settings["variants"], "seeds": settings["seeds"],
                         "experiments": experiments, "jobs": jobs, "noop_rerun": what,
                         "snakemake_version_seconds": startup})


if __name__ == "__main__":
    import json

    print(json.dumps(run("full"), indent=2))
