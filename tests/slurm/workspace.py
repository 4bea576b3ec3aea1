"""A throwaway copy of the workflow with a reduced config, and a guarded Snakemake call."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW_PARTS = ("Snakefile", "rules", "workflow_scripts", "envs", "report", "profiles")


def reduced_config(steps: int = 24, checkpoint_every: int = 4) -> dict:
    """The demo config cut to one dataset, both variants, one seed and a few training steps."""
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    name = next(iter(config["datasets"]))
    config["datasets"] = {name: config["datasets"][name]}
    kept_models = config["datasets"][name].get("models") or list(config["models"])
    config["models"] = {model: config["models"][model] for model in kept_models}
    # The first dataset is a generation one: keep only the variants that run on it.
    config["variants"] = {n: v for n, v in config["variants"].items() if v.get("task", "generation") == "generation"}
    config["comparison"]["reference_variant"] = "baseline"
    config["seeds"] = [config["seeds"][0]]
    config["training"].update(max_steps=steps, checkpoint_every=checkpoint_every, log_every=1,
                              warmup_steps=min(config["training"].get("warmup_steps", 0), steps // 4),
                              runtime_minutes=30, mem_mb=2000)
    config.setdefault("evaluation", {}).update(max_examples=16, max_new_tokens=16)
    return config


def make_workspace(directory: Path, config: dict) -> Path:
    """Copy the workflow (not results) into ``directory`` and write ``config`` as its config."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in WORKFLOW_PARTS:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, directory / part, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, directory / part)
    (directory / "config").mkdir()
    shutil.copy2(ROOT / "config" / "schema.yaml", directory / "config" / "schema.yaml")
    (directory / "config" / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for dataset in config["datasets"].values():
        source = dataset["source"]
        if source["type"] == "local":
            shutil.copytree(ROOT / source["path"], directory / source["path"])
    return directory


# snakemake-executor-plugin-slurm (2.x) polls squeue at growing intervals: 10 s after the first submission, then
# 10 s longer after every poll that saw no job finish (up to 180 s), with no setting for the step. On a real
# cluster that spares slurmctld; on the tests' own cluster it made Snakemake see a 20 s job finish 40 s late, and
# the SLURM tests waited more than they computed. Here Snakemake polls every POLL_SECONDS instead; what it
# submits, and how, is the plugin's as shipped.
POLL_SECONDS = 2
SNAKEMAKE_POLLING_EVERY = f"""
import runpy
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor
from snakemake_executor_plugin_slurm import Executor
assert issubclass(Executor, RemoteExecutor)
shipped = RemoteExecutor.next_seconds_between_status_checks
Executor.next_seconds_between_status_checks = property(lambda self: min(shipped.fget(self), {POLL_SECONDS}),
                                                       shipped.fset)
runpy.run_module("snakemake", run_name="__main__", alter_sys=True)
"""


# A SLURM run that ran past its timeout, this session: the later SLURM runs fail at once, naming it, instead of
# each waiting out its own timeout on a cluster that does not run jobs (the whole group would outlast CI's limit).
_TIMED_OUT: list[str] = []


def cluster_state(env: dict[str, str]) -> str:
    """The queue with each job's state and reason, and the nodes' states: why jobs wait."""
    parts = []
    for command in (["squeue", "-h", "-o", "%i %j %T %r %M"], ["sinfo", "-N", "-h", "-o", "%N %T %E"]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=20)
            parts.append(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as error:
            parts.append(f"$ {' '.join(command)}: {error}")
    return "\n".join(parts)


def run_snakemake(workdir: Path, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Snakemake (polling SLURM every POLL_SECONDS) with a hard timeout: on expiry its whole process group is killed
    and the test fails, with the queue's and the nodes' states."""
    if _TIMED_OUT:
        raise AssertionError(f"not run: an earlier SLURM run in this session ran past its timeout:\n{_TIMED_OUT[0]}")
    command = [sys.executable, "-c", SNAKEMAKE_POLLING_EVERY, *args]
    process = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        state = cluster_state(env)
        os.killpg(process.pid, signal.SIGKILL)
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a process it started in a session of its own still holds the pipe
            output = "(no output: a process Snakemake started outlived it and holds its output pipe)"
        _TIMED_OUT.append(f"snakemake {' '.join(args)} ran past {timeout} s in {workdir}\n{state}")
        raise AssertionError(f"snakemake {' '.join(args)} ran past {timeout} s and was killed:\n{output[-6000:]}\n"
                             f"{state}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def train_reference(workflow: Path, model: str, dataset: str, variant: str, settings: dict, seed: int, out: Path,
                    env: dict[str, str]) -> dict:
    """The train stage run directly (no scheduler) on a workflow copy's inputs; returns its adapter tensors."""
    from safetensors.torch import load_file

    done = subprocess.run(
        [sys.executable, "-m", "workflow_scripts.train", "--model", str(workflow / "resources/models" / model),
         "--data", str(workflow / f"results/data/{dataset}/tokenised/{model}/{variant}"),
         "--training", json.dumps(settings), "--seed", str(seed),
         "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
         "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(out / "adapter" / "adapter_model.safetensors")
