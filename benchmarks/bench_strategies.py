"""Past one process's memory: per-rank peak memory and tokens/s of DDP, FSDP and QLoRA on one tiny model.

Every run is the ``train`` stage as its rule runs it (``python -m workflow_scripts.train``), on CPU with
two gloo processes (torchrun, through the stage's own launcher), on the same tiny Llama and the same
pre-tokenised rows: ``training.strategy: ddp``, ``training.strategy: fsdp`` (FSDP2, each decoder layer
and the root sharded) and QLoRA (``training.quantization: {bits: 4}``, nf4 base weights, DDP). The model
is made deep and narrow-vocabulary on purpose, so that decoder-layer weights (what FSDP shards and QLoRA
packs) are most of its memory.

Memory is each rank's resident set, read from ``/proc/<pid>/status`` while it runs: ``VmHWM`` over the
whole process (model loading included), and over the training loop alone (``VmHWM`` is reset through
``/proc/<pid>/clear_refs`` when the stage prints that training starts, after both ranks have built their
model). The runs use glibc's fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor's pages
go back to the system and the resident set follows the live tensors rather than the allocator's cache.
Beside each figure: the gate's estimate for that rank (``memory_estimate`` as ``run_manifest.json``
records it), and what a process that only imports the stage holds (the interpreter and libraries, which
the estimate leaves out on CPU). Tokens/s: non-padding tokens over all ranks per second, from
``train_log.jsonl``, the first step left out. Medians over interleaved repetitions.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import synthetic
from benchmarks.bench_training import child_env, log_window
from benchmarks.records import Goal, Series, record

NAME = "strategies"
MIN_SECONDS = 180  # a minimal run at full scale on 2 quiet cores, for run.py's time planning
TITLE = "Past one process's memory: per-rank peak memory and tokens/s, DDP vs FSDP vs QLoRA (2 CPU processes)"
REPO = Path(__file__).resolve().parent.parent
SCALES = {
    "full": {"steps": 6, "repetitions": 2, "rows": 96, "micro_batch": 2, "effective_batch": 4,
             "model": {"hidden_size": 512, "layers": 12, "heads": 8, "intermediate_size": 1376, "vocab_size": 2048},
             "length": {"low": 48, "high": 64, "median": 56, "sigma": 0.1}},
    "tiny": {"steps": 2, "repetitions": 1, "rows": 16, "micro_batch": 2, "effective_batch": 4,
             "model": {"hidden_size": 32, "layers": 2, "heads": 2, "intermediate_size": 64, "vocab_size": 256},
             "length": {"low": 12, "high": 16, "median": 14, "sigma": 0.1}},
}
PROCESSES = 2
LORA = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
STRATEGIES = {  # label -> the training keys that differ
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "qlora": {"strategy": "ddp", "quantization": {"bits": 4, "type": "nf4", "double_quant": True, "compute_dtype": "fp32"}},
}
LOOP_STARTS = "training "  # the stage's first message once every rank has built its model (train.py)
POLL_SECONDS = 0.02
# Fixed threshold: freed tensors of 64 KiB or more are unmapped at once (glibc otherwise raises the
# threshold after the first large free and keeps later frees in its heap, in the resident set).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}


def training_settings(settings: dict, strategy: str) -> dict:
    """The stage's --training JSON (keys of config/schema.yaml)."""
    steps = settings["steps"]
    return {"lora": LORA, "max_length": settings["length"]["high"], "effective_batch": settings["effective_batch"],
            "micro_batch": settings["micro_batch"], "max_steps": steps, "learning_rate": 1e-3,
            "lr_scheduler": "constant", "warmup_steps": 0, "precision": "fp32", "gradient_checkpointing": False,
            "checkpoint_every": steps + 1, "log_every": 1, "gpus": 0, "cpu_processes": PROCESSES,
            "dataloader_workers": 0, "length_grouping": True, **STRATEGIES[strategy]}


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _reset_peak(pid: int) -> bool:
    """VmHWM back to the current resident set (Linux >= 4.0: ``echo 5 > /proc/PID/clear_refs``)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class RankMemory:
    """Polls the stage's rank processes (those torchrun gave a LOCAL_RANK) for their peak resident set."""

    def __init__(self, root_pid: int):
        import psutil

        self.root = psutil.Process(root_pid)
        self.ranks: dict[int, int] = {}  # pid -> local rank
        self.whole: dict[int, int] = {}  # local rank -> VmHWM over the whole process, bytes
        self.loop: dict[int, int] = {}  # local rank -> VmHWM since the loop started, bytes
        self.loop_started = threading.Event()
        self.reset_done = False

    def _find_ranks(self) -> None:
        import psutil

        try:
            children = self.root.children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            if child.pid in self.ranks:
                continue
            try:
                rank = child.environ().get("LOCAL_RANK")
            except psutil.Error:
                continue
            if rank is not None:
                self.ranks[child.pid] = int(rank)

    def poll(self) -> None:
        self._find_ranks()
        for pid, rank in self.ranks.items():
            peak = _status_kib(pid, "VmHWM")
            if peak is None:  # gone: its last reading stands
                continue
            if self.reset_done:
                self.loop[rank] = peak * 1024
            self.whole[rank] = max(self.whole.get(rank, 0), peak * 1024)
        if self.loop_started.is_set() and not self.reset_done and len(self.ranks) == PROCESSES:
            # The whole-process peaks were read just above; from here VmHWM counts the loop only.
            self.reset_done = all([_reset_peak(pid) for pid in self.ranks])


def run_stage(model_dir: Path, data_dir: Path, settings: dict, strategy: str, seed: int, work: Path) -> dict:
    """One train stage run, its ranks' memory polled while it runs."""
    out = work / f"{strategy}-{seed}"
    command = [sys.executable, "-m", "workflow_scripts.train", "--model", str(model_dir), "--data", str(data_dir),
               "--training", json.dumps(training_settings(settings, strategy)), "--seed", str(seed),
               "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
               "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")]
    env = {**child_env(1), **MALLOC_ENV, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    memory = RankMemory(process.pid)
    lines: list[str] = []

    def read_output() -> None:
        for line in process.stdout:
            lines.append(line)
            if line.startswith(LOOP_STARTS):
                memory.loop_started.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    while process.poll() is None:
        memory.poll()
        time.sleep(POLL_SECONDS)
    reader.join()
    if process.returncode != 0:
        errors = [line.strip() for line in lines if line.startswith("error:")]  # run_main's one line
        raise RuntimeError(f"the train stage ({strategy}) failed: {(errors or [''.join(lines)])[-1][-2000:]}")
    if len(memory.whole) != PROCESSES or len(memory.loop) != PROCESSES:
        raise RuntimeError(f"{strategy}: read the memory of ranks {sorted(memory.whole)} (loop: {sorted(memory.loop)}) "
                           f"of {PROCESSES}; the run may be too short to poll")
    steps = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if line.strip()]
    manifest = json.loads((out / "run_manifest.json").read_text())
    return {"tokens_per_second": log_window(steps, skip=1)["tokens_per_second"],
            "loop_peak": max(memory.loop.values()), "whole_peak": max(memory.whole.values()),
            "loop_peak_by_rank": [memory.loop[r] for r in sorted(memory.loop)],
            "whole_peak_by_rank": [memory.whole[r] for r in sorted(memory.whole)],
            "estimate": manifest["memory_estimate"], "world_size": manifest["world_size"],
            "stage_peak_rss": manifest["peak_memory_bytes"]}


def baseline_rss(with_bitsandbytes: bool = False) -> tuple[int, int | None]:
    """Resident set of a process that imports what a rank imports and builds nothing, and (``with_bitsandbytes``)
    of the same process once it has imported bitsandbytes too. One probe process for both: the second figure is
    the peak after the extra import, as a second process importing everything at once would reach."""
    code = ("import resource, torch.distributed, transformers, peft, workflow_scripts.train;"
            "from transformers import LlamaForCausalLM;"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True);"
            + ("import bitsandbytes;print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
               if with_bitsandbytes else ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**child_env(1), **MALLOC_ENV},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the baseline probe failed: {done.stderr.strip()[-2000:]}")
    figures = [int(line) for line in done.stdout.split() if line.isdigit()]
    return figures[0], (figures[1] if with_bitsandbytes else None)


@functools.cache  # one probe process per benchmark process: the harness and its test both ask
def qlora_available() -> str | None:
    """None when bitsandbytes imports here, else why QLoRA is left out."""
    done = subprocess.run([sys.executable, "-c", "import bitsandbytes"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"bitsandbytes cannot be imported: {done.stderr.strip()[-300:]}"


def build_inputs(work: Path, settings: dict) -> tuple[Path, Path]:
    m, length = settings["model"], settings["length"]
    config = synthetic.tiny_model_config(m["vocab_size"], m["hidden_size"], m["layers"], m["heads"],
                                         m["intermediate_size"], max_positions=length["high"] + 8)
    model_dir = synthetic.save_model_dir(config, work / "model")
    lengths = synthetic.long_tailed_lengths(settings["rows"], length["low"], length["high"], length["median"],
                                            length["sigma"], seed=21)
    table = synthetic.tokenised_table(lengths, m["vocab_size"], seed=22)
    data_dir = synthetic.save_tokenised(table, work / "data", m["vocab_size"], length["high"], model_dir)
    return model_dir, data_dir


MiB = 2**20


def run(scale: str = "full", work_dir: Path | None = None, log=print, deadline: float | None = None) -> dict:
    settings = SCALES[scale]
    skipped = qlora_available()
    strategies = [s for s in STRATEGIES if s != "qlora" or skipped is None]
    runs: dict[str, list[dict]] = {s: [] for s in strategies}
    with tempfile.TemporaryDirectory(prefix="bench-strategies-", dir=work_dir) as tmp:
        work = Path(tmp)
        model_dir, data_dir = build_inputs(work, settings)
        # QLoRA's ranks also load bitsandbytes' native library: measured apart, not guessed.
        baseline, with_bitsandbytes = baseline_rss(with_bitsandbytes=skipped is None)
        for repetition in range(settings["repetitions"]):
            if repetition and deadline is not None and time.monotonic() > deadline:
                log(f"  out of time after {repetition} repetition(s)")
                break
            for strategy in strategies:  # interleaved: a slow spell of the machine hits every strategy
                result = run_stage(model_dir, data_dir, settings, strategy, repetition + 1, work)
                runs[strategy].append(result)
                log(f"  {strategy} #{repetition + 1}: {result['tokens_per_second']:.0f} tokens/s, peak RSS per rank "
                    f"{result['loop_peak'] / MiB:.0f} MiB in the loop, {result['whole_peak'] / MiB:.0f} MiB overall; "
                    f"estimate {result['estimate']['total'] / MiB:.1f} MiB")

    def memory(strategy: str, which: str = "loop_peak") -> Series:
        results = runs[strategy]
        estimate = results[0]["estimate"]  # the same model and settings every repetition
        what = "in the training loop" if which == "loop_peak" else "whole process, loading included"
        return Series(f"{strategy}: peak RSS per rank, {what}", [r[which] / MiB for r in results], "MiB",
                      {"by_rank": [r[f"{which}_by_rank"] for r in results],
                       "estimate_mib": {k: v / MiB for k, v in estimate.items() if k != "device_capacity"},
                       "above_baseline_mib": statistics.median(r[which] - baseline for r in results) / MiB,
                       "world_size": results[0]["world_size"]})

    def speed(strategy: str) -> Series:
        return Series(f"{strategy}: tokens/s over both ranks", [r["tokens_per_second"] for r in runs[strategy]],
                      "non-padding tokens/s")

    ddp, fsdp = memory("ddp"), memory("fsdp")
    others = [*(memory(s) for s in strategies if s != "ddp" and s != "fsdp"),
              *(memory(s, "whole_peak") for s in strategies), *(speed(s) for s in strategies)]
    estimate = {s: runs[s][0]["estimate"]["total"] / MiB for s in strategies}
    measured = {s: statistics.median(r["loop_peak"] for r in runs[s]) / MiB for s in strategies}
    saving = estimate["ddp"] - estimate["fsdp"]
    measured_saving = measured["ddp"] - measured["fsdp"]
    goals = [
        Goal("FSDP / DDP peak RSS per rank in the training loop <= 1.0", fsdp.median / ddp.median, 1.0, False,
             why=f"FSDP's loop peak is {measured['fsdp']:.0f} MiB against DDP's {measured['ddp']:.0f} MiB, while the "
                 f"estimates are {estimate['fsdp']:.0f} and {estimate['ddp']:.0f} MiB"),
        Goal("measured FSDP saving >= half the estimated saving (DDP - FSDP, MiB)",
             measured_saving / saving if saving > 0 else 0.0, 0.5, True,
             why=f"measured {measured_saving:.0f} MiB saved against {saving:.0f} MiB estimated"),
    ]
    if "qlora" in runs:
        extra = (with_bitsandbytes - baseline) / MiB
        goals.append(Goal("QLoRA / DDP peak RSS per rank in the training loop <= 1.0", measured["qlora"] / ddp.median,
                          1.0, False, why=f"the estimate saves {estimate['ddp'] - estimate['qlora']:.0f} MiB of "
                          f"tensors; importing bitsandbytes alone adds {extra:.0f} MiB to a process (measured)"))
    m = settings["model"]
    notes = ["Memory is the resident set (RSS) of each rank process, the larger rank reported; the estimate is the "
             "gate's per-rank figure, which leaves out the interpreter and libraries (see setup.baseline_rss_mib).",
             "The whole-process peak includes loading: load_base_model reads the full model on every rank before "
             "FSDP shards it, so FSDP lowers the training loop's peak, not the loading peak."]
    if skipped:
        notes.append(f"QLoRA left out: {skipped}")
    return record(
        NAME, TITLE, fsdp, ddp, higher_is_better=False, goals=goals, others=others,
        setup={"model": {"architecture": "llama", **m}, "lora": LORA, "processes": PROCESSES, "device": "cpu",
               "precision": "fp32", "steps": settings["steps"], "micro_batch": settings["micro_batch"],
               "effective_batch": settings["effective_batch"], "max_length": settings["length"]["high"],
               "gradient_checkpointing": False, "torch_threads_per_rank": 1, "malloc": MALLOC_ENV,
               "strategies": {s: STRATEGIES[s] for s in strategies},
               "baseline_rss_mib": baseline / MiB,
               "baseline_rss_with_bitsandbytes_mib": with_bitsandbytes / MiB if with_bitsandbytes else None,
               "estimate_mib": estimate, "loop_peak_mib": measured,
               "loop_peak_above_baseline_mib": {s: measured[s] - baseline / MiB for s in strategies},
               "ratios_vs_ddp": {s: {"memory": measured[s] / measured["ddp"],
                                     "tokens_per_second": speed(s).median / speed("ddp").median,
                                     "estimate": estimate[s] / estimate["ddp"]} for s in strategies}},
        notes=notes,
    )
