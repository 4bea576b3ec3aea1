"""Issue 37's config-level refusals that need more than tests/test_bad_inputs.py's table: the interpreter jobs
run with, the SLURM profile's warning signal, keys accepted where they were wrongly refused, the file a schema
fault names."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import snakemake_fork
from data_helpers import ROOT, single_model_config
from test_dag import absolute_demo_config
from workflow_scripts.checks import scheduler
from workflow_scripts.checks.config import load_config
from workflow_scripts.core.config_files import check_workflow_config
from workflow_scripts.core.errors import ConfigError, WorkflowError


def write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def test_jobs_run_the_python_that_runs_snakemake_not_the_first_on_path(tmp_path):
    """`.venv/bin/snakemake` with the venv not on PATH: a `python` earlier on PATH (here one that fails, as the
    system python without the workflow's packages does) must not run the jobs. A real run of one job."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\necho 'the wrong python ran the job' >&2\nexit 3\n")
    (fake / "python").chmod(0o755)
    config = write(tmp_path / "config.yaml", absolute_demo_config(["amr_demo"]))
    snakemake = Path(sys.executable).parent / "snakemake"  # its shebang names the venv's python, as a user runs it
    environment = {**os.environ, "PATH": f"{fake}:/usr/bin:/bin"}
    environment.pop("PYTHONPATH", None)
    done = subprocess.run([str(snakemake), "-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "--cores", "1",
                           "results/data/amr_demo/download_manifest.json", "--configfile", str(config)],
                          cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    log = tmp_path / "logs" / "download" / "amr_demo.log"
    assert done.returncode == 0, (done.stderr[-3000:], log.read_text() if log.exists() else "")
    assert (tmp_path / "results" / "data" / "amr_demo" / "download_manifest.json").is_file()
    assert "wrong python" not in log.read_text()


PROFILE = ("the profile's --signal=USR1@300 (set-resources: train: slurm_extra, profiles/slurm), which SLURM sends "
           "300 s before the job's time limit")


GRACE = (f"is 400 s, not below {PROFILE}: SLURM would kill the step before the checkpoint ends; set it below 300 "
         "(e.g. 270), or raise the @seconds of --signal in the profile")
RUNTIME = (f"is 3 min, no longer than {PROFILE}: the warning would come before training starts, so no checkpoint is "
           "ever kept; set runtime_minutes above 5 (the time a run needs, plus the warning)")


def test_the_slurm_profile_refuses_a_grace_its_warning_signal_defeats(tmp_path):
    """snakemake -n --profile profiles/slurm: the figure is the one the profile gives the train rule."""
    config = absolute_demo_config(["amr_demo"])
    config["training"]["signal_grace_seconds"] = 400
    path = write(tmp_path / "config.yaml", config)
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "-n",
                                       "--profile", str(ROOT / "profiles" / "slurm"), "--configfile", str(path)])
    assert code != 0 and f"config key 'training.signal_grace_seconds': {GRACE}" in output, output[-3000:]


@pytest.mark.parametrize("setting, value, expected", [("signal_grace_seconds", 400, GRACE), ("runtime_minutes", 3, RUNTIME)])
def test_time_settings_against_the_shipped_profiles_warning_and_without_one(tmp_path, setting, value, expected):
    """The shipped profile's set-resources as Snakemake hands them over (profiles/slurm/config.yaml); a run
    without a warning signal (the local profile) checks nothing."""
    profile = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    config = single_model_config()
    config["training"][setting] = value
    config = load_config(write(tmp_path / "config.yaml", config))
    with pytest.raises(ConfigError) as caught:
        scheduler.check_signal_timing(config, profile["set-resources"], "config.yaml")
    assert str(caught.value) == f"config.yaml: config key 'training.{setting}': {expected}"
    local = yaml.safe_load((ROOT / "profiles" / "local" / "config.yaml").read_text())
    scheduler.check_signal_timing(config, local.get("set-resources"), "config.yaml")


def test_the_warning_is_read_as_sbatch_writes_it(tmp_path):
    assert scheduler.signal_warning({"train": {"slurm_extra": "'--signal=USR1@300'"}}) == (300, "--signal=USR1@300")
    assert scheduler.signal_warning({"train": {"slurm_extra": "--qos=x --signal=B:USR1@120"}})[0] == 120
    assert scheduler.signal_warning({"train": {"slurm_extra": "--signal=USR1"}})[0] == 60  # sbatch's default
    assert scheduler.signal_warning({"train": {"slurm_extra": "--qos=x"}}) is None
    assert scheduler.signal_warning({"evaluate": {"slurm_extra": "--signal=USR1@300"}}) is None
    assert scheduler.signal_warning(None) is None
    config = single_model_config()
    for variant in ("baseline", "mtup"):  # the same for both: a fair comparison
        config["variants"][variant]["training"] = {"signal_grace_seconds": 100}
    config = load_config(write(tmp_path / "config.yaml", config))
    with pytest.raises(ConfigError, match=r"^config key 'variants\.baseline\.training\.signal_grace_seconds': is 100 s"):
        scheduler.check_signal_timing(config, {"train": {"slurm_extra": "--signal=USR1@90"}})


def test_training_keys_without_schema_defaults_are_known_in_variants_and_models(tmp_path):
    """micro_batch_tokens (like the speed switches) has no schema default, so the shared block lacks it unless
    set: a variant's or a model's override of it is still a training key."""
    config = single_model_config()
    for variant in ("baseline", "mtup"):
        config["variants"][variant]["training"] = {"micro_batch_tokens": 256}
    config["model"]["training"] = {"compile_layers": False}
    checked = load_config(write(tmp_path / "config.yaml", config))
    assert checked["variants"]["mtup"]["training"] == {"micro_batch_tokens": 256}
    config["variants"]["mtup"]["training"] = {"micro_batch_tokns": 256}  # a misspelt key is still refused
    with pytest.raises(ConfigError, match=r"unknown training keys \['micro_batch_tokns'\]"):
        load_config(write(tmp_path / "config.yaml", config))


@pytest.mark.parametrize("written", [{"micro_batch_tokens": None}, {"validation": {"criterion": "loss"}},
                                     {"compile_layers": False}])
def test_a_variant_writing_out_what_the_reference_leaves_unset_trains_alike(tmp_path, written):
    """The fairness guard compares the training settings as train records them: a key written at the value its
    absence means is no difference (they were refused as unfair: 'sets None where the reference variant leaves it
    unset'); a real difference still is."""
    config = single_model_config()
    config["variants"]["mtup"]["training"] = written
    load_config(write(tmp_path / "config.yaml", config))
    config["variants"]["mtup"]["training"] = {"micro_batch_tokens": 256}
    with pytest.raises(ConfigError, match="so the comparison would not be fair"):
        load_config(write(tmp_path / "config.yaml", config))


def test_a_qlora_base_choice_with_qlora_training_is_accepted(tmp_path):
    config = single_model_config()
    config["evaluation"]["qlora_base"] = "unquantised"
    config["training"].update(quantization={"bits": 4}, gpus=1, precision="bf16")
    load_config(write(tmp_path / "config.yaml", config))


def test_a_schema_fault_names_the_configfile_that_holds_it(tmp_path):
    """Snakemake's --configfile: the fault is named by the user's file (the last that sets the key), not 'config'."""
    first = single_model_config()
    first["seeds"] = [1, 2 ** 32]
    first_path = write(tmp_path / "base.yaml", first)
    second_path = write(tmp_path / "override.yaml", {"training": {"max_steps": "many"}})
    for files, config, key, where in (
            ([first_path], first, "seeds.1", first_path),
            ([first_path, second_path], {**first, "seeds": [1], "training": {**first["training"], "max_steps": "many"}},
             "training.max_steps", second_path),
            ([first_path], {**first, "seeds": [1], "variants": {**first["variants"], "mtup": {"prompt": "Q"}}},
             "variants.mtup.target", "--config")):
        with pytest.raises(ConfigError) as caught:
            check_workflow_config([str(path) for path in files], config)
        assert str(caught.value).startswith(f"{where}: config key '{key}': "), str(caught.value)


def test_a_check_after_the_schema_is_named_by_the_file_or_the_command_line(tmp_path):
    """rules/common.smk names the checks' faults as the schema's (config_files.in_user_file)."""
    from workflow_scripts.core.config_files import in_user_file

    path = write(tmp_path / "experiment.yaml", single_model_config())
    fault = ConfigError("variants.mtup.training.max_length", "sets 256 where ...", "config")
    assert str(in_user_file(fault, [path])).startswith(f"{path}: config key 'variants.mtup.training.max_length': ")
    on_command_line = in_user_file(fault, [path], {"variants": {"mtup": {"training": {"max_length": "256"}}}})
    assert str(on_command_line).startswith("--config: config key 'variants.mtup.training.max_length': ")
    default = ConfigError("training.effective_batch", "16 is not a multiple ...", "config")  # training: is written
    assert str(in_user_file(default, [path])).startswith(f"{path}: config key 'training.effective_batch': ")


def test_a_written_qlora_base_without_qlora_is_refused_where_snakemake_reads_the_config(tmp_path):
    """The Snakefile's check (config_files.check_workflow_config) sees the config as written: even the default
    value, written out, is refused there, naming the file."""
    config = single_model_config()
    config["evaluation"]["qlora_base"] = "quantised"
    path = write(tmp_path / "experiment.yaml", config)
    with pytest.raises(ConfigError) as caught:
        check_workflow_config([str(path)], yaml.safe_load(path.read_text()))
    assert str(caught.value).startswith(f"{path}: config key 'evaluation.qlora_base': is 'quantised', but no training")
    del config["evaluation"]["qlora_base"]  # left out: the default, nothing to refuse
    path = write(tmp_path / "experiment.yaml", config)
    check_workflow_config([str(path)], yaml.safe_load(path.read_text()))


NODES = ("is 2, but this run executes its jobs here, outside a SLURM allocation (no SLURM_JOB_ID): one torchrun per "
         "node needs SLURM's srun; run with --profile profiles/slurm, inside an allocation (salloc), or set "
         "training.nodes: 1")


def multi_node_config(tmp_path: Path) -> Path:
    config = absolute_demo_config(["amr_demo"])
    config["training"].update(nodes=2, gpus=0, cpu_processes=1, effective_batch=16, micro_batch=8)
    return write(tmp_path / "config.yaml", config)


def test_a_multi_node_experiment_run_here_outside_slurm_stops_before_its_first_job(tmp_path):
    """Train would refuse it only after the data stages and the gate; the executor is known when the run starts."""
    path = multi_node_config(tmp_path)
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "--cores", "1",
                                       "--configfile", str(path)], timeout=300)
    assert code != 0 and f"{path}: config key 'training.nodes': {NODES}" in output, output[-3000:]
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()  # no job ran


def test_a_multi_node_experiment_is_planned_by_a_dry_run_and_allowed_inside_an_allocation(tmp_path):
    path = multi_node_config(tmp_path)
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "-n",
                                       "--configfile", str(path)])
    assert code == 0, output[-3000:]
    config = load_config(path)
    scheduler.check_multi_node_allocation(config, True, {"SLURM_JOB_ID": "42"})  # salloc -N 2, then snakemake
    scheduler.check_multi_node_allocation(config, False, {})  # the SLURM executor submits each job
    with pytest.raises(ConfigError, match="outside a SLURM allocation"):
        scheduler.check_multi_node_allocation(config, True, {})


def slurm_profile() -> dict:
    return yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())


def test_a_slurm_run_without_the_profile_stops_before_its_first_job(tmp_path):
    """``--executor slurm`` without ``--profile profiles/slurm``: no warning signal (a job at its time limit is
    killed without a checkpoint) and no resubmission of a checkpointed train job; both named, before any job is
    submitted (the check needs no SLURM daemon: it runs when the run starts)."""
    path = write(tmp_path / "config.yaml", absolute_demo_config(["amr_demo"]))
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "--jobs", "1",
                                       "--executor", "slurm", "--configfile", str(path)], timeout=300)
    assert code != 0, output[-3000:]
    assert ("this run submits its jobs to SLURM (--executor slurm) without settings of profiles/slurm that training "
            "relies on: train gets no warning before its time limit") in output, output[-3000:]
    assert "(preemptible-rules: [train], preemptible-retries: 3)" in output
    assert not (tmp_path / "results").exists() and not (tmp_path / ".snakemake" / "slurm_logs").exists()


def test_the_shipped_slurm_profile_has_what_a_slurm_run_needs_and_each_missing_setting_is_named(tmp_path):
    profile = slurm_profile()
    resources = profile["set-resources"]
    assert "train" in profile["preemptible-rules"]
    config = load_config(multi_node_config(tmp_path))
    scheduler.check_slurm_submission(config, "slurm", resources, True)  # the profile's own settings pass
    scheduler.check_slurm_submission(config, None, {}, False)  # the local executor: nothing to check here
    scheduler.check_slurm_submission(config, "slurm-jobstep", {}, False)  # a job's own Snakemake inside SLURM
    without_signal = {**resources, "train": {key: value for key, value in resources["train"].items()
                                             if key != "slurm_extra"}}
    with pytest.raises(WorkflowError, match="train gets no warning") as caught:
        scheduler.check_slurm_submission(config, "slurm", without_signal, True)
    assert "preemptible" not in str(caught.value) and "tasks_per_gpu" not in str(caught.value)
    with pytest.raises(WorkflowError, match=r"not resubmitted to resume \(preemptible-rules: \[train\]"):
        scheduler.check_slurm_submission(config, "slurm", resources, False)
    without_tasks = {**resources, "train": {**resources["train"], "tasks_per_gpu": None}}
    with pytest.raises(WorkflowError, match=r"tasks per GPU \(set-resources: train: tasks_per_gpu: 0\)"):
        scheduler.check_slurm_submission(config, "slurm", without_tasks, True)
    one_node = load_config(write(tmp_path / "one.yaml", absolute_demo_config(["amr_demo"])))
    scheduler.check_slurm_submission(one_node, "slurm", without_tasks, True)  # one node: the plugin sets no tasks
