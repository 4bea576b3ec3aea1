"""The sanity gate runs once per experiment (model, dataset or mixture, variant), not once per seed (issue 25).

It checks the configuration; an experiment's seeds differ only in initialisation and data order. It runs
with the first configured seed, passed so that Snakemake does not record it (RuntimeOnly), so adding seeds
or putting another first reruns no gate and retrains nothing; train takes the gate as an ordinary input (not
ancient: Snakemake 9 then skips what a training change must rerun, snakemake/snakemake#4166), so a change of
the training settings reruns the gate and every seed. Dry runs in a fork (test_dry_run_families.dry_run).
"""
from __future__ import annotations

import copy
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
    for block in re.split(r"\n(?=(?:local)?(?:rule|checkpoint) \w+:)", output):
        rule = re.match(r"(?:local)?(?:rule|checkpoint) (\w+):", block)
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


def plan(workdir: Path, config: dict, *args: str) -> set[tuple[str, str | None]]:
    code, output = dry_run(workdir, "-n", "--configfile", str(config_file(workdir, config)),
                           "--replace-workflow-config", "--cores", "2", *args)
    assert code == 0, output[-3000:]
    return {(job["rule"], job["wildcards"].get("seed")) for job in planned(output)}


def test_a_finished_run_adds_seeds_without_its_gate_and_retrains_on_a_training_change(tmp_path):
    """A finished one-seed run (every output planted, stage by stage, and recorded by ``--touch --forceall``
    as a real run records it: params and code, the rerun triggers). Without the untrained model's evaluation;
    the same changes with it (and the power estimate, no longer an ancient() input, snakemake#4166) are
    test_reruns.py's."""
    config = absolute_demo_config(["amr_demo"])
    config["seeds"] = [1]
    config["evaluation"]["evaluate_base_model"] = False
    code, output = dry_run(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0 and job_counts(output)["sanity"] == 2, output[-3000:]
    make_finished(tmp_path, output)
    code, output = dry_run(tmp_path, "--touch", "--forceall", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0, output[-3000:]
    assert plan(tmp_path, config) == set()  # finished

    new_seed = {("train", "2"), ("evaluate", "2"), ("compare", None), ("all", None)}
    assert plan(tmp_path, {**config, "seeds": [1, 2]}) == new_seed  # baseline's and mtup's seed 2
    # A new first seed: the gate's seed is no rerun trigger, so no gate and no finished seed runs again.
    assert plan(tmp_path, {**config, "seeds": [2, 1]}) == new_seed

    # A training setting the gate checks: the gate and then every seed's training again (not only the gate).
    changed = copy.deepcopy(config)
    changed["training"]["learning_rate"] *= 0.5
    assert plan(tmp_path, changed) == {("sanity", None), ("train", "1"), ("evaluate", "1"), ("compare", None),
                                       ("all", None)}
