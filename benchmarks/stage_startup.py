"""Each model stage's fixed cost per job: process start to its first useful line.

Every workflow job is a fresh interpreter, so what a stage imports and builds before it does its own work is
paid once per job. This reruns one job of each stage of a completed workflow directory (the commands Snakemake
recorded in ``.snakemake/metadata``), in a copy of its ``results/`` and ``resources/`` so that the original
outputs keep their modification times, under ``python -X importtime`` and a probe that timestamps:

- ``main``: the stage's ``main()`` entered (the entry module and what it imports at the top are loaded);
- ``ready``: the first useful point: the model built for training (``training_setup.build`` returned: sanity,
  train), the model (with its adapter) loaded for evaluation (``model_loading.load_with_adapter``), the
  tokenizer loaded (``model_loading.load_tokenizer``: pretokenise); the data stages have none besides ``main``;
- ``step``: train's first optimizer step applied (``training_setup.apply_update``);
- ``end``: the process exited (not for train, which the probe ends after its first step).

Times are wall seconds from just before the process is started. ``imports`` is the sum of the top-level
``-X importtime`` cumulative times (everything the process imported, lazily or not), and the share of it that
torch, transformers, peft and bitsandbytes took where they were imported at the top level of an import chain
(as the one that first pulled them in). Run: ``python -m benchmarks.stage_startup --workdir <completed demo>``.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (label, Snakemake rule, a piece of the job's output path that picks one job of the rule)
# (evaluate before train: the probe's train run replaces the adapter the evaluation reads.)
JOBS = (
    ("normalise", "normalise", "normalise_report.json"),
    ("pretokenise", "pretokenise", "/baseline_report.json"),
    ("evaluate (base)", "evaluate_base", "/baseline/base/eval.json"),
    ("evaluate (adapter)", "evaluate", "/baseline/seed1/eval.json"),
    ("sanity", "sanity", "/baseline/sanity.json"),  # one gate per experiment since issue 25
    ("train", "train", "/baseline/seed1/run_manifest.json"),
    ("compare", "compare", "comparison.md"),
)
DATASET = "amr_demo"  # the generation dataset: its jobs are the demo's most common kind
HEAVY = ("torch", "transformers", "peft", "bitsandbytes")

# Run in the job's interpreter before the stage: timestamps the first return of the functions that mark
# "ready" and "step", hooked when their module is first imported (so the probe changes no import order).
PROBE = r"""
import importlib.abc, importlib.machinery, json, os, runpy, sys, time
EVENTS_FILE, STOP_AT, STAGE = sys.argv[1], sys.argv[2], sys.argv[3]
sys.argv = [STAGE] + sys.argv[4:]
HOOKS = {"workflow_scripts.training.training_setup": {"build": "ready", "apply_update": "step"},
         "workflow_scripts.model.model_loading": {"load_with_adapter": "ready", "load_tokenizer": "tokenizer"},
         "workflow_scripts.core.errors": {"run_main": "main"}}
import atexit
events = {}
def save():
    loaded = [name for name in ("torch", "transformers", "peft", "bitsandbytes") if sys.modules.get(name)]
    with open(EVENTS_FILE, "w") as handle:
        json.dump({"events": events, "loaded": loaded}, handle)
def note(event):
    events.setdefault(event, time.time())
    save()
    if event == STOP_AT:  # train: its start-up is measured, not its 300 steps
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
def after(function, event):
    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        note(event)
        return result
    return wrapped
def entered(function, event):
    def wrapped(*args, **kwargs):
        note(event)
        return function(*args, **kwargs)
    return wrapped
def run_main_hook(run_main):  # the stage's `if __name__ == "__main__": run_main(main)`: time main's entry
    def wrapped(main, *args, **kwargs):
        return run_main(entered(main, "main"), *args, **kwargs)
    return wrapped
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module
        def exec_module(module):
            execute(module)
            for name, event in HOOKS[fullname].items():
                function = getattr(module, name, None)
                if function is not None:
                    setattr(module, name, run_main_hook(function) if event == "main" else after(function, event))
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Finder())
atexit.register(save)
runpy.run_module(STAGE, run_name="__main__", alter_sys=True)
"""


def recorded_jobs(workdir: Path) -> dict[str, tuple[str, str]]:
    """{output path: (rule, shell command without its log redirection)} from Snakemake's metadata."""
    jobs = {}
    for entry in (workdir / ".snakemake" / "metadata").iterdir():
        try:
            output = base64.b64decode(entry.name.replace("@", "/") + "==").decode()
            record = json.loads(entry.read_text())
        except (ValueError, UnicodeDecodeError, OSError):
            continue
        command = record.get("shellcmd") or ""
        if record.get("rule") and command:
            jobs[output] = (record["rule"], command.split(" > ")[0].strip())
    return jobs


def pick(jobs: dict[str, tuple[str, str]], rule: str, piece: str) -> str | None:
    """The recorded command of ``rule`` whose output contains ``piece``: DATASET's where there is one."""
    found = [(DATASET not in output, output, command) for output, (job_rule, command) in jobs.items()
             if job_rule == rule and piece in output]
    return min(found)[2] if found else None


def import_seconds(stderr: str) -> tuple[float, dict[str, float]]:
    """(sum of the top-level cumulative import times, {heavy package: its top-level cumulative time})."""
    total, heavy = 0.0, {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|", 2)
        if not cumulative.strip().isdigit() or name.startswith("  "):  # two spaces: imported by another module
            continue
        seconds = int(cumulative) / 1e6
        total += seconds
        package = name.strip().split(".")[0]
        if package in HEAVY:
            heavy[package] = heavy.get(package, 0.0) + seconds
    return total, heavy


def probe(command: str, workdir: Path, stop_at: str = "", timeout: float = 600, code: Path = REPO) -> dict:
    """Run one recorded stage command in ``workdir`` under the probe; its event times, imports and exit code.
    ``stop_at``: an event after which the process exits (``step`` for train); ``code``: the checkout whose
    workflow_scripts runs (another commit's, to compare before and after)."""
    words = shlex.split(command)
    if words[:2] != ["python", "-m"]:
        raise ValueError(f"not a stage command: {command[:80]}")
    stage, arguments = words[2], words[3:]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        events_file = handle.name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]))
    start = time.time()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE, events_file, stop_at, stage, *arguments],
                          cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env)
    end = time.time()
    recorded = json.loads(Path(events_file).read_text()) if Path(events_file).stat().st_size else {}
    events = recorded.get("events", {})
    os.unlink(events_file)
    imports, heavy = import_seconds(done.stderr)
    result = {"stage": stage, "returncode": done.returncode, **({} if stop_at else {"end": end - start}), "imports": imports,
              "heavy_imports": heavy, "loaded": recorded.get("loaded", []), **{name: at - start for name, at in events.items()}}
    if "ready" not in result and "tokenizer" in result:  # pretokenise: the tokenizer is what it needs
        result["ready"] = result["tokenizer"]
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if not line.startswith("import time:")][-5:]
        result["error"] = " | ".join(tail)
    return result


def copy_workdir(workdir: Path, into: Path) -> Path:
    """results/ and resources/ copied (the jobs rewrite their outputs), the rest linked."""
    for name in ("results", "resources"):
        if (workdir / name).exists():
            shutil.copytree(workdir / name, into / name, symlinks=True)
    for name in ("demo_data", "config"):
        if (workdir / name).exists():
            os.symlink(workdir / name, into / name)
    return into


def clean_train_outputs(command: str, workdir: Path) -> None:
    """train resumes from its checkpoints: remove them and its outputs so that it trains from step 0."""
    words = shlex.split(command)
    for flag in ("--checkpoint-dir", "--adapter-out", "--tensorboard-dir"):
        if flag in words:
            shutil.rmtree(workdir / words[words.index(flag) + 1], ignore_errors=True)


def measure(workdir: Path, repetitions: int = 1, codes: dict[str, Path] | None = None, log=print,
            only: set[str] | None = None) -> list[dict]:
    """One row per job of JOBS (and per checkout of ``codes``, run alternately so that a load change on a
    shared machine touches each alike): medians over ``repetitions`` runs of each event time and the imports."""
    codes = codes or {"": REPO}
    jobs = recorded_jobs(workdir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="stage-startup-") as tmp:
        copy = copy_workdir(workdir, Path(tmp))
        for label, rule, piece in JOBS:
            if only and label not in only:
                continue
            command = pick(jobs, rule, piece)
            if command is None:
                log(f"  {label}: no recorded job of rule {rule} in {workdir}")
                continue
            runs = {name: [] for name in codes}
            for _ in range(repetitions):
                for name, code in codes.items():
                    if rule == "train":
                        clean_train_outputs(command, copy)
                    run = probe(command, copy, stop_at="step" if rule == "train" else "", code=code)
                    if run["returncode"] != 0:
                        raise RuntimeError(f"{label} ({name or code}) failed: {run.get('error')}")
                    runs[name].append(run)
            for name, done in runs.items():
                row = {"stage": f"{label} {name}".strip(), "repetitions": repetitions}
                for key in ("main", "ready", "step", "end", "imports"):
                    values = [run[key] for run in done if key in run]
                    if values:
                        row[key] = statistics.median(values)
                        row.setdefault("samples", {})[key] = values
                for package in HEAVY:
                    row[package] = statistics.median(run["heavy_imports"].get(package, 0.0) for run in done)
                row["loaded"] = sorted(set().union(*(run.get("loaded", []) for run in done)))
                rows.append(row)
                log("  " + table_row(row))
    return rows


def table_row(row: dict) -> str:
    def cell(key):
        return f"{row[key]:.2f}" if key in row else "-"
    shares = ", ".join(f"{package} {row[package]:.1f}" for package in HEAVY if row.get(package))
    return (f"| {row['stage']} | {cell('main')} | {cell('ready')} | {cell('step')} | {cell('end')} | "
            f"{cell('imports')} | {shares or '-'} | {', '.join(row.get('loaded', [])) or 'none'} |")


TABLE_HEAD = ("| stage (job) | main() entered (s) | first useful line (s) | first step (s) | job ends (s) | "
              "imports (s) | of which, first pulled in at the top (s) | loaded |\n|---|---:|---:|---:|---:|---:|---|---|")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=REPO, help="a directory where the demo has completed")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--code", action="append", default=[], metavar="NAME=DIR",
                        help="a checkout to run the stages from (repeat to compare, e.g. before=../old-checkout); "
                        "default: this one")
    parser.add_argument("--json-out", type=Path, help="the rows as JSON")
    parser.add_argument("--only", action="append", help="a stage label of the table (repeat); default: all")
    args = parser.parse_args(argv)
    print(TABLE_HEAD)
    codes = {name: Path(path).resolve() for name, _, path in (item.partition("=") for item in args.code)}
    rows = measure(args.workdir.resolve(), args.repetitions, codes or None, only=set(args.only or []))
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
