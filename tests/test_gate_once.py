"""The sanity gate runs once per experiment (model, dataset or mixture, variant), not once per seed (issue 25).

It checks the configuration; an experiment's seeds differ only in initialisation and data order. It runs
with the first configured seed, a param, so adding seeds reruns no gate, and train takes it as an ancient
input, so a rerun gate retrains nothing already trained. Dry runs in a fork (test_dry_run_families.dry_run).
"""
from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path

from data_helpers import ROOT
from test_dag import absolute_demo_config, config_file, job_counts, nothing_to_do
from test_dry_run_families import dry_run
from test_mixtures import mixture_config


def planned(output: str) -> list[dict]:
    """Every job of a dry run (-n -p): its rule, wildcards, inputs, outputs and shell command."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", output):
        rule = re.match(r"(?:local)?rule (\w+):", block)
        if not rule:
            continue

        def listed(key):
            found = re.search(rf"^\s*{key}: (.*)$", block, re.MULTILINE)
            return found.group(1).split(", ") if found else []

        wildcards = dict(item.split("=", 1) for item in listed("wildcards"))
        jobs.append({"rule": rule.group(1), "wildcards": wildcards, "input": listed("input"),
                     "output": listed("output"), "block": block})
    return jobs


def experiment(job: dict) -> tuple[str, str, str]:
    return job["wildcards"]["model"], job["wildcards"]["dataset"], job["wildcards"]["variant"]


def test_one_gate_per_experiment_with_the_first_seed_and_every_seed_waits_for_it(tmp_path):
    """Every task family of the demo and a mixture, with 3 seeds: one gate per experiment, which every seed's
    training reads, run with the first seed as configured (3, not the smallest)."""
    config = mixture_config()
    for dataset in config["datasets"].values():
        if dataset["source"]["type"] == "local":
            dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
    config["seeds"] = [3, 1, 2]
    code, output = dry_run(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0, output[-3000:]
    jobs = planned(output)
    gates = [job for job in jobs if job["rule"] == "sanity"]
    trains = [job for job in jobs if job["rule"] == "train"]
    per_experiment = Counter(experiment(job) for job in gates)
    assert per_experiment and set(per_experiment.values()) == {1}, per_experiment
    assert "qa_mix" in {dataset for _, dataset, _ in per_experiment}  # a mixture's gate too
    assert {experiment(job) for job in trains} == set(per_experiment)
    assert Counter(experiment(job) for job in trains) == {e: 3 for e in per_experiment}
    for gate in gates:
        model, dataset, variant = experiment(gate)
        assert gate["output"] == [f"results/{model}/{dataset}/{variant}/sanity.json"], gate["output"]
        assert "seed" not in gate["wildcards"]
        assert re.search(r"python -m workflow_scripts\.sanity .* --seed 3 ", gate["block"]), gate["block"][-2000:]
    for train in trains:
        model, dataset, variant = experiment(train)
        assert f"results/{model}/{dataset}/{variant}/sanity.json" in train["input"], train["input"]


# Stage order: a file of a later stage is newer than every file of an earlier one, as after a real run.
STAGES = ("download", "normalise", "prepare_model", "pretokenise", "mix", "cross_contamination", "evaluate_base",
          "power", "sanity", "train", "evaluate", "evaluate_on", "predict", "predict_on", "compare", "all")


def make_finished(workdir: Path, output: str) -> None:
    """Create every output of a dry run's jobs, directories where the name has no suffix, each stage's newer
    than the one before: a finished run, at no cost (no .snakemake metadata, so only times and presence count)."""
    for job in planned(output):
        for path in (workdir / name for name in job["output"]):
            if path.suffix:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("{}\n")
            else:
                path.mkdir(parents=True, exist_ok=True)
                (path / "done").write_text("")
    stamp = int(time.time())  # after the demo's source files (download's inputs)
    for job in planned(output):
        moment = stamp + 100 * STAGES.index(job["rule"])
        for path in (workdir / name for name in job["output"]):
            for inside in [path, *(path.rglob("*") if path.is_dir() else [])]:
                os.utime(inside, (moment, moment))


def test_a_new_seed_runs_its_own_training_only_and_a_rerun_gate_retrains_nothing(tmp_path):
    config = absolute_demo_config(["amr_demo"])
    config["seeds"] = [1]
    config["evaluation"]["evaluate_base_model"] = True
    base = ["--replace-workflow-config", "--cores", "2"]
    code, output = dry_run(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)), *base)
    assert code == 0 and job_counts(output)["sanity"] == 2, output[-3000:]
    make_finished(tmp_path, output)
    code, output = dry_run(tmp_path, "-n", "--configfile", str(config_file(tmp_path, config)), *base)
    assert code == 0 and nothing_to_do(output), output[-3000:]  # the planted run counts as finished

    config["seeds"] = [1, 2]
    code, output = dry_run(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)), *base)
    assert code == 0, output[-3000:]
    jobs = planned(output)
    assert {(job["rule"], job["wildcards"].get("seed")) for job in jobs} == {
        ("train", "2"), ("evaluate", "2"), ("compare", None), ("all", None)}, [(j["rule"], j["wildcards"]) for j in jobs]
    assert job_counts(output)["train"] == 2  # baseline and mtup

    # A gate rerun (a code change, a new first seed) leaves it newer than the seeds' training: none retrains.
    config["seeds"] = [1]
    later = int(time.time()) + 10_000
    gates = list(tmp_path.glob("results/tiny-llama/amr_demo/*/sanity.json"))
    assert len(gates) == 2
    for gate in gates:
        os.utime(gate, (later, later))
    code, output = dry_run(tmp_path, "-n", "--configfile", str(config_file(tmp_path, config)), *base)
    assert code == 0 and nothing_to_do(output), output[-3000:]
