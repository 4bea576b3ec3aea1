"""What the SLURM plugin would submit for training jobs, checked at parse time (a dry run's resources fed to
the plugin's own sbatch builder): GPUs per node for multi-node jobs, one-node and multi-node variants in
one matrix, cores per rank and its DataLoader workers (issue 23, points 7 and 8 and "Slow")."""
import re

import pytest
import yaml

import snakemake_fork
from data_helpers import ROOT

pytest.importorskip("snakemake_executor_plugin_slurm")


class Resources(dict):
    __getattr__ = dict.__getitem__


class Job:
    def __init__(self, threads, resources):
        self.threads, self.resources = threads, Resources(resources)


def dry_run_jobs(tmp_path, config) -> dict[tuple[str, str], Job]:
    """(rule, variant) -> the job's threads and resources as the dry run prints them."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "-n",
                                       "--configfile", str(path), "--replace-workflow-config", "--cores", "64",
                                       "--until", "sanity"], timeout=300)  # in a fork of this process
    assert code == 0, output[-3000:]
    jobs = {}
    for block in output.split("\nrule ")[1:]:
        rule = block.split(":", 1)[0]
        variant = re.search(r"variant=(\w+)", block)
        if rule not in ("sanity", "train") or not variant:
            continue
        threads = int(re.search(r"threads: (\d+)", block).group(1))
        resources = {}
        for item in re.search(r"resources: (.*)", block).group(1).split(", "):
            key, _, value = item.partition("=")
            resources[key] = int(value) if value.isdigit() else value
        jobs[rule, variant.group(1)] = Job(threads, resources)
    return jobs


def sbatch(job: Job) -> str:
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    profile = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    job.resources.update(profile["set-resources"]["sanity"])  # tasks_per_gpu: 0, as for every GPU rule
    params = {"run_uuid": "u", "slurm_logfile": "log", "comment_str": "c", "account": "", "partition": "",
              "workdir": None}
    return get_submit_command(job, params) + set_gres_string(job)  # as the plugin's run_job builds it


def mixed_matrix():
    config = yaml.safe_load((ROOT / "config" / "real_hub.yaml").read_text())
    config["seeds"] = [1]
    config["training"]["micro_batch"] = 2  # 32 rows: 2 micro-batches on 8 ranks, 1 on 16
    config["variants"]["mtup"]["training"] = {"nodes": 2}
    return config


def test_a_two_node_job_asks_for_gpus_per_node_beside_a_one_node_job(tmp_path):
    jobs = dry_run_jobs(tmp_path, mixed_matrix())
    two_nodes, one_node = sbatch(jobs["sanity", "mtup"]), sbatch(jobs["sanity", "baseline"])
    # --gpus=16 could come as 6 + 2 + 8; --gres counts per node, so each of the 2 nodes has its 8
    assert "--gres=gpu:8" in two_nodes and "--gpus=" not in two_nodes, two_nodes
    assert "--nodes=2" in two_nodes and "--ntasks=2" in two_nodes and "--ntasks-per-gpu" not in two_nodes
    # the one-node variant in the same matrix: no task count (the plugin refused tasks=1 under mpi)
    assert "--gpus=8" in one_node and "--nodes=1" in one_node and "--ntasks" not in one_node, one_node
    assert "--gres" not in one_node
    assert jobs["sanity", "baseline"].resources["mpi"] == "" and jobs["sanity", "mtup"].resources["mpi"] == "srun"


def test_cores_cover_every_rank_and_its_dataloader_workers(tmp_path):
    jobs = dry_run_jobs(tmp_path, mixed_matrix())
    # real_hub: 8 GPUs per node, 4 DataLoader workers per rank: 8 x (4 + 1) cores per node (one task each)
    for key in (("sanity", "baseline"), ("sanity", "mtup")):
        assert jobs[key].threads == 40
        assert "--cpus-per-task=40" in sbatch(jobs[key])
