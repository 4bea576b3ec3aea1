"""Exact reruns (issue 35): on a finished run, one change plans exactly the stages that read it.

Dry runs on a finished run planted at no cost (test_gate_once.make_finished, recorded by ``--touch --forceall``
as a real run records params and code), with the untrained model's evaluation on (the default), so the power
estimate is part of the run: before issue 35 its ancient() input made Snakemake skip the planned work after it
(snakemake#4166): a seed added ran only the estimate, an evaluation setting left the trained runs' evaluations
stale. The real runs of the same changes are in test_rerun_runs.py.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import time

import pytest

from test_dag import absolute_demo_config, config_file, job_counts
from test_dry_run_families import dry_run
from test_gate_once import make_finished, plan


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-seed run of the demo's AMR experiment (baseline and mtup), the base model scored."""
    workdir = tmp_path_factory.mktemp("finished")
    config = absolute_demo_config(["amr_demo"])
    config["seeds"] = [1]
    # its source copied, the train file past Snakemake's 1 MB checksum limit (the rows repeated; a dry run reads
    # none of them): content, not clocks, must decide for large files too
    source = workdir / "amr"
    shutil.copytree(config["datasets"]["amr_demo"]["source"]["path"], source)
    rows = (source / "train.jsonl").read_text()
    (source / "train.jsonl").write_text(rows * (2**20 // len(rows) + 1))
    assert (source / "train.jsonl").stat().st_size > 2**20
    config["datasets"]["amr_demo"]["source"]["path"] = str(source)
    assert config["evaluation"].get("evaluate_base_model", True)
    code, output = dry_run(workdir, "-n", "-p", "--configfile", str(config_file(workdir, config)),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0 and job_counts(output)["power"] == 1, output[-3000:]
    make_finished(workdir, output)
    code, output = dry_run(workdir, "--touch", "--forceall", "--configfile", str(config_file(workdir, config)),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0, output[-3000:]
    assert plan(workdir, config) == set()
    return workdir, config


def test_a_seed_added_trains_and_evaluates_it_and_compares_without_the_power_estimate(finished):
    workdir, config = finished
    assert plan(workdir, {**config, "seeds": [1, 2]}) == {("train", "2"), ("evaluate", "2"), ("compare", None),
                                                          ("all", None)}


def test_an_evaluation_setting_reevaluates_every_run_and_the_estimate_but_retrains_nothing(finished):
    workdir, config = finished
    changed = copy.deepcopy(config)
    changed["evaluation"]["max_new_tokens"] = 64
    assert plan(workdir, changed) == {("evaluate_base", None), ("evaluate", "1"), ("power", None),
                                      ("compare", None), ("all", None)}


@pytest.mark.parametrize("change", ["also_metrics", "metric"])
def test_a_scoring_change_rescores_and_reruns_no_data_or_training_stage(finished, change):
    """The dataset's graph metrics (smatch, smatchpp) stay the same: normalise's gold-graph check reads nothing
    else of the metrics, so no data stage reruns."""
    workdir, config = finished
    changed = copy.deepcopy(config)
    if change == "also_metrics":
        changed["datasets"]["amr_demo"]["also_metrics"] = [*config["datasets"]["amr_demo"]["also_metrics"], "exact_match"]
    else:
        changed["datasets"]["amr_demo"]["metric"] = "smatchpp"
        changed["datasets"]["amr_demo"]["also_metrics"] = ["smatch"]
    assert plan(workdir, changed) == {("evaluate_base", None), ("evaluate", "1"), ("power", None),
                                      ("compare", None), ("all", None)}


def test_a_training_setting_retrains_every_seed_after_its_gate(finished):
    workdir, config = finished
    changed = copy.deepcopy(config)
    changed["training"]["learning_rate"] *= 0.5
    assert plan(workdir, changed) == {("sanity", None), ("train", "1"), ("evaluate", "1"), ("compare", None),
                                      ("all", None)}


@pytest.mark.parametrize("change", ["metric", "also_metrics"])
def test_a_graph_metric_switched_off_renormalises_and_everything_after(finished, change):
    """normalise rejects the gold graphs its dataset's graph metrics cannot read (issue 44): smatch switched to
    exact_match, or smatchpp dropped, changes which rows are kept, so the data are normalised again, and every
    stage after (a dry run said nothing to do, and the comparison kept scoring the rows smatch filtered)."""
    workdir, config = finished
    changed = copy.deepcopy(config)
    if change == "metric":
        changed["datasets"]["amr_demo"]["metric"] = "exact_match"
        changed["datasets"]["amr_demo"].pop("also_metrics")
    else:
        changed["datasets"]["amr_demo"]["also_metrics"] = []
    planned_jobs = plan(workdir, changed)
    assert {("normalise", None), ("pretokenise", None), ("train", "1"), ("evaluate_base", None),
            ("evaluate", "1"), ("compare", None)} <= planned_jobs
    assert ("download", None) not in planned_jobs


def test_runtime_only_training_keys_retrain_nothing(finished):
    """Wall time, memory, checkpoint cadence, signal grace, workers, the gate's batches cannot change what is
    learned (config_reads.RUNTIME_TRAINING_KEYS): changed on a finished run, nothing is planned (issue 44: each
    retrained every seed from step 1)."""
    workdir, config = finished
    changed = copy.deepcopy(config)
    changed["training"].update(runtime_minutes=1440, mem_mb=32000, checkpoint_every=7, signal_grace_seconds=200,
                               dataloader_workers=1, sanity_batches=3)
    assert plan(workdir, changed) == set()


def test_a_default_written_out_plans_nothing(finished):
    """The params are built from resolved values: ``encoding: utf-8`` (the reader's default, no schema default)
    and ``on_invalid_text: stop`` written out mean what their absence means (issue 44: each retrained every
    seed)."""
    workdir, config = finished
    changed = copy.deepcopy(config)
    changed["datasets"]["amr_demo"].update(encoding="utf-8", on_invalid_text="stop")
    assert plan(workdir, changed) == set()


def test_max_length_on_a_generation_dataset_reruns_no_untrained_evaluation(finished):
    """A generation prompt is never cut at max_length: the untrained model's predictions, and the power estimate
    after them, do not depend on it (issue 44); the trained runs are retrained and evaluated again."""
    workdir, config = finished
    changed = copy.deepcopy(config)
    changed["training"]["max_length"] = config["training"]["max_length"] + 32
    assert plan(workdir, changed) == {("pretokenise", None), ("sanity", None), ("train", "1"), ("evaluate", "1"),
                                      ("compare", None), ("all", None)}


def test_the_power_threshold_reruns_the_estimate_alone(finished):
    """comparison.min_detectable_effect is read by power alone: compare (which does not read it) is not rerun
    (issue 44: its experiment-set stamp held the whole comparison section)."""
    workdir, config = finished
    changed = copy.deepcopy(config)
    changed["comparison"]["min_detectable_effect"] = 0.99
    assert plan(workdir, changed) - {("all", None)} == {("power", None)}


def _kept(paths):
    """The bytes and times of ``paths`` (restored by _restore): the finished run stays finished for the others."""
    return {path: (path.read_bytes(), path.stat()) for path in paths if path.exists()}


def _restore(kept):
    for path, (data, times) in kept.items():
        path.write_bytes(data)
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


def test_touching_a_source_file_over_1_mb_reruns_nothing(finished):
    """Snakemake checksums only inputs under 1 MB: download's input is a stamp of its files' content
    (data/source_files.content_stamp), so a touch alone (issue 44: the whole chain) plans nothing."""
    workdir, config = finished
    big = workdir / "amr" / "train.jsonl"
    kept = _kept([big])
    try:
        later = time.time() + 10_000  # newer than every planted output
        os.utime(big, (later, later))
        assert plan(workdir, config) == set()
    finally:
        _restore(kept)


def test_new_content_in_a_source_file_over_1_mb_reruns_its_chain(finished):
    workdir, config = finished
    big = workdir / "amr" / "train.jsonl"
    stamps = sorted((workdir / ".snakemake" / "content_stamps").glob("*.json"))
    assert stamps, "no content stamp written"
    kept = _kept([big, *stamps])
    try:
        lines = big.read_text().splitlines(keepends=True)
        big.write_text("".join(lines[:-1]))  # one row fewer, the time kept: content alone decides
        os.utime(big, ns=(kept[big][1].st_atime_ns, kept[big][1].st_mtime_ns))
        planned_jobs = plan(workdir, config)
    finally:
        _restore(kept)
    assert {("download", None), ("normalise", None), ("train", "1"), ("compare", None)} <= planned_jobs


def test_until_sanity_plans_a_gate_that_never_ran(finished):
    """Issue 44: a gate that never ran waits for the power checkpoint, and Snakemake dropped it from ``--until
    sanity`` once the checkpoint's dependencies were updated (rules/common.smk keep_gate_under_until): no gate
    planned, exit 0. Only the gate that never ran is planned, nothing after it."""
    workdir, config = finished
    gate = workdir / "results" / "tiny-llama" / "amr_demo" / "baseline" / "sanity.json"
    kept, times = gate.read_bytes(), gate.stat()
    gate.unlink()
    try:
        planned_jobs = plan(workdir, config, "--until", "sanity")
    finally:
        gate.write_bytes(kept)
        os.utime(gate, ns=(times.st_atime_ns, times.st_mtime_ns))  # the finished run stays finished for the others
    assert ("sanity", None) in planned_jobs


@pytest.fixture(scope="module")
def finished_local_model(tmp_path_factory):
    """A finished run whose model is a local folder (``source: local``): a small Llama config and weights file
    (a dry run loads neither)."""
    workdir = tmp_path_factory.mktemp("local-model")
    folder = workdir / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024,
        "max_position_embeddings": 256, "torch_dtype": "float32"}))
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    config = absolute_demo_config(["amr_demo"])
    config["seeds"] = [1]
    config["evaluation"]["evaluate_base_model"] = False
    config["models"] = {"mine": {"source": "local", "path": str(folder)}}
    config["datasets"]["amr_demo"]["models"] = ["mine"]
    code, output = dry_run(workdir, "-n", "-p", "--configfile", str(config_file(workdir, config)),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0, output[-3000:]
    make_finished(workdir, output)
    code, output = dry_run(workdir, "--touch", "--forceall", "--configfile", str(config_file(workdir, config)),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0, output[-3000:]
    assert plan(workdir, config) == set()
    return workdir, config, folder


def test_files_of_a_local_model_folder_that_prepare_model_never_reads_rerun_nothing(finished_local_model):
    """``huggingface-cli download --local-dir`` rewrites the timestamps in ``.cache/huggingface/download/*.metadata``
    on every call, and a clone's ``.git/`` changes with git commands: prepare_model copies neither (nor a pickle
    weights file), so neither may rerun the copy and the training after it (model/model_files.py)."""
    workdir, config, folder = finished_local_model
    metadata = folder / ".cache" / "huggingface" / "download" / "model.safetensors.metadata"
    metadata.parent.mkdir(parents=True)
    metadata.write_text("a09a35458c702b33eeacc393d103063234e8bc28\nabc\n1764400000.0\n")
    (folder / "pytorch_model.bin").write_bytes(b"\2" * 64)
    try:
        assert plan(workdir, config) == set()
        metadata.write_text("a09a35458c702b33eeacc393d103063234e8bc28\nabc\n1764400999.5\n")
        assert plan(workdir, config) == set()
    finally:
        shutil.rmtree(folder / ".cache")
        (folder / "pytorch_model.bin").unlink()


def test_new_weights_in_a_local_model_folder_rerun_everything_after_it(finished_local_model):
    """``source: local`` copies the folder once: new weights at the same path (their old time kept, as ``cp -p``
    does) must copy it again and rerun every stage after (issue 44: nothing reran)."""
    workdir, config, folder = finished_local_model
    weights = folder / "model.safetensors"
    before = weights.stat()
    weights.write_bytes(b"\1" * 4096)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert {("prepare_model", None), ("pretokenise", None), ("sanity", None), ("train", "1"), ("evaluate", "1"),
            ("compare", None)} <= plan(workdir, config)
