"""`make gpu-check`: what only a CUDA GPU shows, in one call that fits the minutes a GPU is lent for.

    python -m benchmarks.gpu_check --out benchmarks/gpu_check        # on the GPU machine (make gpu-check)
    python -m benchmarks.gpu_check --plan                            # phases and expected times, no GPU needed
    python -m benchmarks.gpu_check --summary benchmarks/gpu_check    # rebuild summary.md from the records

Phases run in priority order under a time budget (--minutes, default $GPU_CHECK_MINUTES or 8), wheel
installation included; a phase whose expected time no longer fits is skipped with the reason, and a
running phase is stopped when the budget ends. Every check appends its record to
OUT/measurements.jsonl the moment it ends (benchmarks/check_records.py), so a run killed at any point
keeps every figure measured before the kill; OUT/summary.md is rebuilt from those records after each
phase, and by --summary after a kill.

The expected times are for one H100/H200 (from the first gpu-check run, issue 24); each phase's record
holds its measured time beside them, to correct them by.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks import check_records

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MINUTES = 8.0
RESERVE_SECONDS = 5.0  # left at the end for the last summary
PREFLIGHT_SECONDS = 5.0  # before the phases: does the python import torch and see a CUDA device
GPU_CONFIG = "config/gpu_smoke.yaml"
LOG_NAME = "checks.log"  # every phase's output, each under a header
WORKFLOW_COMMAND = ["snakemake", "--configfile", GPU_CONFIG, "--profile", "profiles/local", "--cores", "all",
                    "--resources", "gpu=1"]


@dataclass
class Context:
    out: Path                     # absolute
    python: str
    wheels: Path
    cpu: bool                     # the harness on CPU (tests): CUDA phases skip, the benchmark runs tiny on CPU
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Phase:
    name: str
    expected_seconds: float
    what: str
    needs_cuda: bool
    command: Callable[[Context], list[str] | None]  # None: nothing to run (the reason is in `reason`)
    reason: Callable[[Context], str | None] = lambda context: None  # why it is skipped before it runs
    collect: Callable[[Context, int, float], dict] | None = None  # a record from what the phase left behind
    details: Callable[[], list[str]] = lambda: []  # lines the plan prints under the phase

    @property
    def limit_seconds(self) -> float:
        """A phase that hangs is stopped here, so that the phases after it still get their turn."""
        return 2 * self.expected_seconds + 30


def _pytest(marker: str) -> Callable[[Context], list[str]]:
    # Files named: collecting every test module would import what these checks do not need.
    return lambda context: [context.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", marker,
                            "tests/test_gpu.py", "tests/test_evaluate.py", "tests/test_batch_invariance.py"]


def _wheels_command(context: Context) -> list[str] | None:
    wheels = sorted(context.wheels.glob("*.whl"))
    if not wheels:
        return None
    return [context.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--upgrade", "--target", context.env["GPU_CHECK_SITE"], *map(str, wheels)]


def _environment_command(context: Context) -> list[str]:
    return [context.python, "-m", "benchmarks.gpu_check", "--environment", str(context.out / "environment.txt")]


def _workflow_command(context: Context) -> list[str]:
    return [context.python, "-m", *WORKFLOW_COMMAND]


def _workflow_reason(context: Context) -> str | None:
    if (REPO / "results" / "comparison.md").exists():
        return "results/comparison.md already exists here: the workflow would have nothing to do (move results/ away)"
    return None


def collect_workflow(context: Context, exit_code: int, seconds: float) -> dict:
    """The workflow phase's figures: wall time, the comparison, each train job's start-up cost."""
    import json

    results = REPO / "results"
    comparison = results / "comparison.md"
    if comparison.exists():
        shutil.copy(comparison, context.out / "comparison.md")
    jobs = {}
    for log in sorted(results.glob("*/*/*/seed*/train_log.jsonl")):
        first = json.loads(log.read_text().splitlines()[0])
        manifest_path = log.parent / "run_manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        jobs[str(log.parent.relative_to(results))] = {
            "seconds_from_stage_start": first.get("seconds_from_stage_start"),
            "steps_logged": len(log.read_text().splitlines()), "final_loss": manifest.get("final_loss"),
            "devices": manifest.get("devices"), "peak_memory_bytes": manifest.get("peak_memory_bytes")}
    evaluations = {}
    for path in sorted(results.glob("*/*/*/seed*/eval.json")):
        summary = json.loads(path.read_text())
        evaluations[str(path.parent.relative_to(results))] = {key: summary.get(key) for key in
                                                             ("score", "device", "dtype", "n_examples")}
    job_seconds = {}  # each job's wall time, from the rules' benchmark: files (Snakemake's first column, s)
    for path in sorted((results / "benchmarks").rglob("*.tsv")):
        lines = path.read_text().splitlines()
        if len(lines) > 1:
            job_seconds[str(path.relative_to(results / "benchmarks").with_suffix(""))] = float(lines[1].split("\t")[0])
    return {"command": " ".join(WORKFLOW_COMMAND), "wall_seconds": seconds, "comparison": comparison.exists(),
            "train_jobs": jobs, "evaluations": evaluations, "job_seconds": job_seconds}


def _benchmark_7b_details() -> list[str]:
    """The 7B phase's plan: its sides, each repeated (interleaved), and the profile of the best side."""
    from benchmarks import bench_gpu_7b as bench

    settings = bench.SCALES["7b"]
    sides = [side for side in bench.SIDES if side.name in bench.DEFAULT_SIDES]
    per_round = sum(side.expected for side in sides)
    lines = [f"{settings['repetitions']} interleaved repetitions of {' '.join(s.name for s in sides)} "
             f"(about {per_round:.0f} s a round, {settings['repetitions'] * per_round:.0f} s of measurement), "
             f"each: a shape pass, {settings['warmup_steps']} warm-up + {settings['timed_steps']} timed steps of "
             f"{settings['effective_batch']} rows"]
    lines += [f"side {side.name:<8} ~{side.expected:>3.0f} s  {side.what}" for side in sides]
    lines.append(f"profile  ~{bench.PROFILE_SECONDS:>3.0f} s  one micro-step of the best side of ours under the profiler")
    return lines


PHASES = [
    Phase("wheels", 20, "install the packages the image lacks from .whl (make gpu-wheels) into a private site",
          False, _wheels_command,
          reason=lambda context: None if any(context.wheels.glob("*.whl")) else f"no wheels in {context.wheels}"),
    Phase("environment", 10, "GPU, driver and package versions", False, _environment_command),
    # Issue 45: the 7B benchmark that cannot mislead takes the budget (about 6 minutes of measurement); the
    # checks that passed on the first H200 run (issue 24: cuda_training, launcher, workflow) run by name.
    Phase("benchmark_7b", 420, "LoRA bf16 on the Qwen2.5-7B architecture (random weights made on the GPU): ours A-D "
          "vs TRL SFTTrainer padding-free + Liger and Trainer defaults on the same rows; tokens counted where the "
          "model sees them, a shape pass before timing, medians of interleaved repetitions, MFU, peak vs estimate",
          True, lambda context: [context.python, "-m", "benchmarks.bench_gpu", "--out-dir", str(context.out),
                                 *(["--scale", "7b-tiny", "--cpu", "--sides", "A", "trainer", "--repetitions", "1"]
                                   if context.cpu else ["--scale", "7b"])],
          details=_benchmark_7b_details),
]
OPTIONAL_PHASES = [  # not in the default run (the budget is spent); --only names them
    Phase("cuda_training", 90, "the CUDA tests in ONE process: gate + training in bf16 and fp16 (GradScaler), the "
          "same seed twice, the LLaVA and Qwen2.5-VL VLMs (tiny) in bf16 with their evaluation, evaluation in bf16", True,
          _pytest("cuda and not launcher")),
    Phase("launcher", 50, "the gate and training through the launcher and torchrun, exactly as the rules run them "
          "(device lease, CUDA_VISIBLE_DEVICES); start-up cost of each stage", True, _pytest("cuda and launcher")),
    Phase("workflow", 190, f"the workflow as users run it: {' '.join(WORKFLOW_COMMAND)} -> results/comparison.md",
          True, _workflow_command, reason=_workflow_reason, collect=collect_workflow),
    Phase("benchmark", 110, "LoRA bf16 training of a 0.5B-class model, tokens/s and MFU, ours vs Trainer + PEFT "
          "(one pair of runs, DataLoader workers on)", True,
          lambda context: [context.python, "-m", "benchmarks.bench_gpu", "--out-dir", str(context.out),
                           *(["--scale", "tiny", "--cpu"] if context.cpu else ["--scale", "check"])]),
]
# In the CPU harness (tests) the benchmark runs, tiny, on the CPU.
RUNS_ON_CPU_HARNESS = {"wheels", "environment", "benchmark", "benchmark_7b"}


def plan(phases: list[Phase], minutes: float) -> str:
    budget = 60 * minutes
    lines = [f"gpu-check plan: budget {minutes:g} min ({budget:.0f} s), phases in priority order "
             "(expected seconds on one H100/H200):"]
    total = PREFLIGHT_SECONDS + RESERVE_SECONDS
    lines.append(f"  {'preflight':<14} {PREFLIGHT_SECONDS:>5.0f} s  python imports torch and sees a CUDA device; "
                 f"{RESERVE_SECONDS:.0f} s are kept for the last summary")
    for phase in phases:
        total += phase.expected_seconds
        fits = "runs" if total <= budget else "skipped unless earlier phases finish early"
        lines.append(f"  {phase.name:<14} {phase.expected_seconds:>5.0f} s  (cumulative {total:>4.0f} s, {fits})  "
                     f"{phase.what}")
        lines += [f"      - {line}" for line in phase.details()]
    lines.append(f"  total expected {total:.0f} s = {total / 60:.1f} min of {minutes:g} min")
    return "\n".join(lines)


class Stopped(Exception):
    """The driver was asked to stop (SIGTERM, SIGINT): the running phase is stopped, the records kept."""


def _stop_requested(signum, _frame):
    raise Stopped(signal.Signals(signum).name)


def _own_group_dying_with_the_driver() -> None:
    """In the phase's process, before it runs: its own process group (stopped as one at the budget's end;
    the same session, so whoever ends the driver's session ends it too), and SIGTERM if the driver dies."""
    os.setpgrp()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _run_streaming(command: list[str], log_path: Path, env: dict, timeout: float) -> tuple[int | None, float]:
    """Run ``command`` in its own process group, its output to stdout and ``log_path``; stop the whole
    group at ``timeout`` or when the driver is stopped. Returns (exit code, or None when stopped; seconds)."""
    started = time.monotonic()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   preexec_fn=_own_group_dying_with_the_driver)
        deadline = started + timeout
        os.set_blocking(process.stdout.fileno(), False)
        stopped = False
        try:
            while True:
                chunk = process.stdout.read()
                if chunk:
                    log.write(chunk)
                    log.flush()
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                if process.poll() is not None:
                    rest = process.stdout.read()
                    if rest:
                        log.write(rest)
                        sys.stdout.buffer.write(rest)
                        sys.stdout.flush()
                    break
                if time.monotonic() > deadline and not stopped:
                    stopped = True
                    _stop_group(process)
                time.sleep(0.2)
        finally:
            if process.poll() is None:  # the driver itself is being stopped
                _stop_group(process)
    return (None if stopped else process.returncode), time.monotonic() - started


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _phase_env(context: Context) -> dict:
    env = dict(os.environ)
    env.update(context.env)
    site = env.get("GPU_CHECK_SITE")
    if site and any(Path(site).iterdir()):
        env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_phases(context: Context, phases: list[Phase], budget_seconds: float, log=print) -> int:
    """Run ``phases`` in order within ``budget_seconds``; return 0 when every phase that ran passed."""
    started = time.monotonic()
    report = context.out / "measurements.jsonl"
    status = 0
    for phase in phases:
        left = budget_seconds - RESERVE_SECONDS - (time.monotonic() - started)
        base = {"check": "phase", "phase": phase.name, "expected_seconds": phase.expected_seconds}
        reason = None
        if context.cpu and phase.name not in RUNS_ON_CPU_HARNESS:
            reason = "needs CUDA (CPU harness run)"
        elif phase.expected_seconds > left:
            reason = f"would not fit: expected {phase.expected_seconds:.0f} s, {max(left, 0):.0f} s of the budget left"
        else:
            reason = phase.reason(context)
        command = None if reason else phase.command(context)
        if command is None:
            reason = reason or "nothing to run"
            log(f"gpu-check [{phase.name}] skipped: {reason}")
            check_records.append({**base, "status": "skipped", "reason": reason}, report)
            write_summary(context.out)
            continue
        log(f"gpu-check [{phase.name}] {phase.what} (expected {phase.expected_seconds:.0f} s, {left:.0f} s left)")
        # The CPU harness runs in tests on a shared 2-core machine, where importing torch alone can take the
        # GPU machine's whole expected time: there a phase gets 4x its limit (still within the budget).
        limit = min(left, phase.limit_seconds * (4 if context.cpu else 1))
        # One log for all phases: a GPU machine hands back only a few files (the device tool: 8).
        with open(context.out / LOG_NAME, "a", encoding="utf-8") as log_file:
            log_file.write(f"\n===== gpu-check [{phase.name}]: {' '.join(command)}\n")
        phase_started = time.monotonic()
        try:
            env = {**_phase_env(context), "GPU_CHECK_PHASE_SECONDS": str(int(limit))}  # a phase may plan within it
            exit_code, seconds = _run_streaming(command, context.out / LOG_NAME, env, limit)
        except Stopped as stop:
            check_records.append({**base, "status": "stopped", "reason": f"the check was stopped ({stop})",
                                  "seconds": round(time.monotonic() - phase_started, 1), "log": LOG_NAME}, report)
            raise
        outcome = "cut_off" if exit_code is None else ("passed" if exit_code == 0 else "failed")
        record = {**base, "status": outcome, "seconds": round(seconds, 1), "exit_code": exit_code,
                  "log": LOG_NAME}
        if outcome == "cut_off":
            record["reason"] = (f"stopped at the end of the budget after {seconds:.0f} s" if limit == left else
                                f"stopped after {seconds:.0f} s, twice its expected time and 30 s more")
        if phase.collect is not None:
            try:
                record.update(phase.collect(context, exit_code, seconds))
            except Exception as error:  # what was measured stays; the collection's fault is recorded
                record["collect_error"] = f"{type(error).__name__}: {error}"
        check_records.append(record, report)
        log(f"gpu-check [{phase.name}] {outcome} in {seconds:.0f} s")
        status = status or int(outcome != "passed")
        write_summary(context.out)
    return status


# --- the summary, rebuilt from the records ----------------------------------------------------------

def _mib(value) -> str:
    return f"{value / 2**20:,.0f}" if isinstance(value, (int, float)) else "-"


def _seconds(value) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


def render_summary(rows: list[dict]) -> str:
    import json

    phases = [r for r in rows if r.get("check") == "phase"]
    tests = [r for r in rows if "test" in r]
    bench = [r for r in rows if r.get("check") in ("gpu_lora_bf16", "gpu_lora_7b") and "tokens_per_second" in r
             or r.get("check") == "gpu_lora_bf16" or r.get("check") == "gpu_lora_7b" and r.get("status") in ("failed", "skipped")]
    devices = sorted({r["device"] for r in rows if r.get("device")})
    versions = next((r["versions"] for r in rows if r.get("check") == "environment"), [])
    lines = ["# make gpu-check", "", f"Device: {', '.join(devices) or 'none recorded'}. "
             f"{len(rows)} records (benchmarks/gpu_check.py; rebuilt from measurements.jsonl).", ""]
    if versions:
        lines += ["Environment: " + "; ".join(versions) + ".", ""]
    lines += ["| phase | status | seconds (expected) | note |", "|---|---|---|---|"]
    for r in phases:
        note = r.get("reason") or r.get("collect_error") or (f"exit {r['exit_code']}, see {r['log']}"
                                                             if r.get("exit_code") else "")
        lines.append(f"| {r['phase']} | {r['status']} | {_seconds(r.get('seconds'))} ({r['expected_seconds']:.0f}) | "
                     f"{note} |")
    if tests:
        lines += ["", "| check | loss first -> last | median step s | stage start -> first step s | "
                  "peak / estimate (MiB) | other |", "|---|---|---|---|---|---|"]
        skip = {"test", "device", "first_loss", "last_loss", "median_step_seconds", "peak_memory_bytes",
                "estimated_bytes", "devices", "peak_memory_kind", "steps", "seconds_from_stage_start"}
        for r in tests:
            other = {k: v for k, v in r.items() if k not in skip}
            loss = f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}" if "first_loss" in r else "-"
            lines.append(f"| {r['test']} | {loss} | {_seconds(r.get('median_step_seconds'))} | "
                         f"{_seconds(r.get('seconds_from_stage_start'))} | {_mib(r.get('peak_memory_bytes'))} / "
                         f"{_mib(r.get('estimated_bytes'))} | {json.dumps(other)} |")
    if bench:
        lines += ["", "| benchmark side | run | status | non-padding tokens/s | MFU | padding share | "
                  "stage start -> first step s |", "|---|---|---|---|---|---|---|"]
        for r in bench:
            if r.get("status") == "measured":
                mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
                lines.append(f"| {r['side']} | {r['repetition']} | measured | {r['tokens_per_second']:,.0f} | {mfu} | "
                             f"{r['padding_share']:.1%} | {_seconds(r.get('seconds_from_stage_start'))} |")
            else:
                lines.append(f"| {r['side']} | {r['repetition']} | {r.get('status')} | - | - | "
                             f"{str(r.get('error') or r.get('reason', ''))[:200]} | - |")
    for r in rows:  # the 7b benchmark: medians of its interleaved repetitions, ratios, goals, the profile
        if r.get("check") == "gpu_lora_7b" and r.get("side") == "summary":
            lines += render_7b_summary(r)
    for r in phases:
        if r.get("phase") == "workflow" and "wall_seconds" in r:
            lines += ["", f"Workflow (`{r['command']}`): {r['wall_seconds']:.0f} s wall, exit {r['exit_code']}, "
                      f"results/comparison.md {'written' if r['comparison'] else 'missing'}."]
            for job, facts in r.get("train_jobs", {}).items():
                lines.append(f"- train {job}: stage start -> first step {_seconds(facts['seconds_from_stage_start'])} s, "
                             f"final loss {facts['final_loss']}, devices {facts['devices']}")
            if r.get("job_seconds"):
                lines.append("- job wall seconds: " + ", ".join(f"{job} {value:.1f}" for job, value in r["job_seconds"].items()))
            for job, facts in r.get("evaluations", {}).items():
                lines.append(f"- evaluate {job}: score {facts['score']}, device {facts['device']}, dtype {facts['dtype']}")
    return "\n".join(lines) + "\n"


def render_7b_summary(r: dict) -> list[str]:
    """The 7B benchmark's summary record as Markdown: per side the median tokens/s (min-max, runs), padding,
    Dynamo graphs compiled in timed steps (0 when the shape pass did its job), MFU, estimate / peak."""
    lines = ["", f"7B benchmark (peak {r['peak_tflops']:.0f} TFLOP/s; measured matmul ceiling "
             f"{r.get('matmul_ceiling_tflops') or 0:.0f} TFLOP/s); medians of interleaved repetitions, raw records in "
             "gpu_benchmark_7b.jsonl:", "",
             "| side | tokens/s median (min-max, runs) | padding | graphs in timed steps | MFU | estimate / peak |",
             "|---|---|---|---|---|---|"]
    for name, side in r.get("sides", {}).items():
        t = side["tokens_per_second"]
        mfu = f"{side['mfu']:.1%}" if side.get("mfu") is not None else "-"
        estimate = f"{side['estimate_over_peak']:.2f}" if side.get("estimate_over_peak") else "-"
        lines.append(f"| {name} | {t['median']:,.0f} ({t['min']:,.0f}-{t['max']:,.0f}, {t['n']}) | "
                     f"{side['padding_share']:.1%} | {side['new_graphs_in_timed_steps']} | {mfu} | {estimate} |")
    lines.append("")
    lines += [f"- {name}: {value:.2f}x" for name, value in r.get("ratios", {}).items()]
    for name, goal in r.get("goals", {}).items():
        value = "not measured" if goal["value"] is None else f"{goal['value']:.3g} ({'met' if goal['met'] else 'missed'})"
        lines.append(f"- {name}: {value}")
    nemo = r.get("nemo")
    if nemo:
        lines.append(f"- beside: {nemo['what']}: {nemo['tokens_per_second']:,} tokens/s, MFU {nemo['mfu_own_convention']:.1%} "
                     f"in its convention, {nemo['mfu_our_convention']:.1%} in ours")
    if r.get("profile"):
        lines += ["", f"Profile of {r.get('profile_side')} (one micro-step, forward + backward):", "", "```",
                  str(r["profile"]).rstrip(), "```"]
    return lines


def write_summary(out: Path) -> Path:
    from workflow_scripts.core.atomic_output import atomic_path

    path = out / "summary.md"
    with atomic_path(path) as temporary:
        temporary.write_text(render_summary(check_records.read(out / "measurements.jsonl")))
    return path


def write_environment(path: Path) -> None:
    """The GPU, driver and package versions, one per line."""
    import importlib

    lines = []
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True)
        lines.append((done.stdout or done.stderr).strip())
    import torch

    lines.append(f"torch {torch.__version__} cuda {torch.version.cuda} device "
                 f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}")
    from importlib import metadata

    for name in ("transformers", "peft", "accelerate", "datasets", "bitsandbytes", "snakemake", "liger_kernel",
                 "triton"):
        try:
            module = importlib.import_module(name)  # imported, not only installed: what the checks will meet
            version = getattr(module, "__version__", None) or metadata.version(name.replace("_", "-"))
            lines.append(f"{name} {version}")
        except Exception as error:  # a missing package is reported; its checks skip with the reason
            lines.append(f"{name} unavailable: {type(error).__name__} {str(error).splitlines()[0][:120]}")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    check_records.append({"check": "environment", "versions": lines})


def cuda_visible(python: str) -> tuple[bool, str]:
    """Whether ``python`` imports torch and sees a CUDA device, and what to say when not."""
    try:
        done = subprocess.run([python, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"],
                              capture_output=True, text=True)
    except OSError:
        done = subprocess.CompletedProcess([python], 127)
    if done.returncode == 3:
        return False, f"no CUDA device visible to {python}; nothing was checked"
    if done.returncode != 0:
        return False, f"{python} cannot import torch; name the python that has it: make gpu-check GPU_PYTHON=..."
    return True, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu_check"),
                        help="where records and logs go; relative to the current directory or absolute")
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("GPU_CHECK_MINUTES") or DEFAULT_MINUTES),
                        help="the time budget, wheel installation included (default $GPU_CHECK_MINUTES or 8)")
    parser.add_argument("--python", default=os.environ.get("GPU_PYTHON") or sys.executable,
                        help="the python with the GPU's torch (default $GPU_PYTHON or this one)")
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl", help="wheels to install first (make gpu-wheels)")
    parser.add_argument("--only", nargs="+", choices=[p.name for p in PHASES + OPTIONAL_PHASES],
                        help=f"run only these phases ({', '.join(p.name for p in OPTIONAL_PHASES)} only when named)")
    parser.add_argument("--plan", action="store_true", help="print the phases and their expected times; run nothing")
    parser.add_argument("--summary", type=Path, metavar="OUT", help="rebuild OUT/summary.md from OUT/measurements.jsonl")
    parser.add_argument("--cpu", action="store_true",
                        help="test the harness without a GPU: CUDA phases skip, the benchmark runs tiny on the CPU")
    parser.add_argument("--environment", type=Path, help=argparse.SUPPRESS)  # the environment phase's own process
    args = parser.parse_args(argv)
    # Any phase named comes with the wheels (skipped where .whl/ has none): on a registry-less GPU machine every
    # phase imports what they install (the first H200 run, `--only benchmark_7b`: each side of ours lacked rapidfuzz).
    named = {*args.only, "wheels"} if args.only else None
    phases = [p for p in PHASES + OPTIONAL_PHASES if (p.name in named if named else p in PHASES)]
    if args.plan:
        print(plan(phases, args.minutes))
        return 0
    if args.environment:
        write_environment(args.environment)
        return 0
    if args.summary:
        path = write_summary(args.summary.resolve())
        print(path.read_text())
        return 0
    started = time.monotonic()
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out  # children run in the repository
    if not args.cpu:
        visible, message = cuda_visible(args.python)
        if not visible:
            print(f"gpu-check: {message}", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    report = out / "measurements.jsonl"
    report.unlink(missing_ok=True)
    (out / LOG_NAME).unlink(missing_ok=True)
    site = tempfile.mkdtemp(prefix="gpu-check-site-")
    python_bin = tempfile.mkdtemp(prefix="gpu-check-bin-")  # `python` for the rules' shell commands
    wrapper = Path(python_bin) / "python"  # a script, not a link: a link to a venv's python loses the venv
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(shutil.which(args.python) or args.python)} \"$@\"\n")
    wrapper.chmod(0o755)
    context = Context(out=out, python=args.python, wheels=args.wheels.resolve(), cpu=args.cpu,
                      env={check_records.VARIABLE: str(report), "GPU_CHECK_SITE": site, "PYTHONUNBUFFERED": "1",
                           "PATH": python_bin + os.pathsep + os.environ.get("PATH", ""),
                           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"})
    check_records.append({"check": "start", "budget_minutes": args.minutes, "python": args.python,
                          "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          "cpu_harness": args.cpu}, report)
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), _stop_requested)
    try:
        status = run_phases(context, phases, 60 * args.minutes - (time.monotonic() - started))
    except Stopped as stop:
        check_records.append({"check": "stopped", "signal": str(stop)}, report)
        print(f"gpu-check: stopped by {stop}; the records so far are kept in {report}", file=sys.stderr)
        status = 1
    finally:
        shutil.rmtree(site, ignore_errors=True)
        shutil.rmtree(python_bin, ignore_errors=True)
        write_summary(out)
    print(f"gpu-check: wrote {out} (exit {status}); summary:\n{(out / 'summary.md').read_text()}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
