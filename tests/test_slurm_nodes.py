"""Several nodes for real: the sanity and train rules with ``training.nodes: 2`` through the SLURM
profile on a two-node cluster brought up on this machine (tests/slurm/namespaced.py: one slurmctld,
two slurmd, each node in its own network namespace with its own host name and address).

srun starts one torchrun per node, they meet at the rendezvous on the first node, and the adapter
equals that of one node running the same world size. Needs root and network namespaces (CI has
both); elsewhere the test says why and skips, and the command-line test in test_slurm.py stays.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "slurm"))
import cluster as slurm_cluster  # noqa: E402
import namespaced  # noqa: E402
from workspace import make_workspace, reduced_config, run_snakemake, train_reference  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1800)]  # a real two-node cluster: `make test-fast` leaves it out
# (pytest-timeout above each run's own timeout, which kills its Snakemake and names the queue's state.)

SLURM_ARGS = ["--profile", "profiles/slurm", "--slurm-status-command", "squeue",
              "--slurm-init-seconds-before-status-checks", "1", "--slurm-keep-successful-logs", "--verbose"]


@pytest.fixture(scope="module")
def two_nodes():
    reason = slurm_cluster.why_unavailable()
    if reason and os.environ.get("LORA_WORKFLOW_REQUIRE_SLURM") == "1":
        pytest.fail(f"LORA_WORKFLOW_REQUIRE_SLURM=1 (CI) but: {reason}")
    reason = reason or namespaced.why_unavailable()
    if reason:
        pytest.skip(reason)
    slurm_cluster.install_packages()
    running = namespaced.start_namespaced_cluster(cpus=8, root=Path(tempfile.mkdtemp(prefix="lora-slurm2-")))
    try:
        yield running
    finally:
        try:
            subprocess.run(["scancel", "--user", "root"], env=running.env(), capture_output=True, timeout=60)
        finally:
            running.stop()


def two_node_config() -> dict:
    config = reduced_config(steps=8, checkpoint_every=100)
    config["variants"] = {"baseline": config["variants"]["baseline"]}
    # One gloo process per node: world size 2 across the two nodes.
    config["training"].update(nodes=2, gpus=0, cpu_processes=1, effective_batch=8, micro_batch=4)
    config["evaluation"]["evaluate_base_model"] = False
    return config


def test_two_nodes_train_through_slurm_and_match_one_node(two_nodes, tmp_path):
    config = two_node_config()
    (tmp_path / "workflow").mkdir()
    workflow = make_workspace(tmp_path / "workflow", config)
    env = two_nodes.env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["OMP_NUM_THREADS"] = "1"
    for name in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK"):
        env.pop(name, None)
    model, dataset = next(iter(config["models"])), next(iter(config["datasets"]))
    target = f"results/{model}/{dataset}/baseline/seed{config['seeds'][0]}"
    run = workflow / target
    result = run_snakemake(workflow, [*SLURM_ARGS, f"{target}/adapter"], env, timeout=900)
    assert result.returncode == 0, result.stdout[-8000:] + two_nodes.logs("slurmd")

    calls = [c for c in result.stdout.splitlines() if "sbatch call:" in c and re.search(r"rule_(sanity|train)_", c)]
    assert len(calls) == 2 and all("--nodes=2" in c and "--ntasks=2" in c for c in calls), calls
    manifest = json.loads((run / "run_manifest.json").read_text())
    assert manifest["world_size"] == 2
    train_log = (workflow / f"logs/{model}/{dataset}/baseline/seed{config['seeds'][0]}/train.log").read_text()
    launch = re.search(r"launcher: (srun .*)", train_log)
    assert launch and "--nnodes 2" in launch.group(1) and "--rdzv-endpoint lora-node1:" in launch.group(1), train_log[-3000:]
    assert manifest["hosts"] == ["lora-node1", "lora-node2"], manifest["hosts"]  # rank 0 and rank 1

    # One node, the same world size (2 gloo processes), the same settings and data: the same adapter.
    from workflow_scripts.checks.config import load_config
    from workflow_scripts.core.experiment_config import resolved_training

    settings = {**resolved_training(load_config(workflow / "config" / "config.yaml"), "baseline", model),
                "nodes": 1, "cpu_processes": 2}
    from safetensors.torch import load_file

    one = train_reference(workflow, model, dataset, "baseline", settings, config["seeds"][0], tmp_path / "one_node", env)
    two = load_file(run / "adapter" / "adapter_model.safetensors")
    assert two.keys() == one.keys()
    for name, tensor in one.items():
        assert (two[name] == tensor).all(), f"{name}: two nodes and one node trained different adapters"
