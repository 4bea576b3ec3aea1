"""The run-start SLURM check (checks/scheduler.py check_slurm_submission).

Whether a checkpointed train job is really resubmitted: the retries Snakemake gives the train rule, not only
whether train is named a preemptible rule. ``--preemptible-rules train`` without ``--preemptible-retries`` gives
train no retry count at all: Snakemake then ends in a TypeError traceback at the first train job that exits 75.
``--retries N`` resubmits train as well as ``preemptible-rules`` does. Each run here targets only download (a
local rule), so no job is ever submitted. And whether training receives the warning signal at all.
"""
from __future__ import annotations

import pytest
import yaml

import snakemake_fork
from data_helpers import ROOT
from test_config_refusals import write
from test_dag import absolute_demo_config
from workflow_scripts.checks import scheduler
from workflow_scripts.checks.config import load_config
from workflow_scripts.core.errors import WorkflowError

SIGNAL = "train:slurm_extra='--signal=USR1@300'"
REFUSAL = "a train job that checkpoints at the warning exits 75 and is not resubmitted"


def slurm_run(tmp_path, *options: str) -> tuple[int, str]:
    path = write(tmp_path / "config.yaml", absolute_demo_config(["amr_demo"]))
    return snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--directory", str(tmp_path), "--jobs", "1",
                               "results/data/amr_demo/raw", "--executor", "slurm", *options, "--set-resources", SIGNAL,
                               "--configfile", str(path)], timeout=300)


def test_preemptible_rules_without_retries_is_refused_before_the_first_job(tmp_path):
    code, output = slurm_run(tmp_path, "--preemptible-rules", "train")
    assert code != 0 and REFUSAL in output, output[-3000:]
    assert not (tmp_path / "results").exists()


def test_retries_resubmit_train_so_the_run_is_not_refused(tmp_path):
    code, output = slurm_run(tmp_path, "--retries", "2")
    assert REFUSAL not in output, output[-3000:]
    assert code == 0, output[-3000:]


@pytest.mark.parametrize("extra, expected", [
    ("'--signal=B:USR1@300'", "signals only the batch shell"),
    ("--qos=x --signal=B:USR1@300", "signals only the batch shell"),
    ("'--signal=USR2@300'", "sends SIGUSR2"),
    ("--signal=TERM@300", "sends SIGTERM"),
])
def test_a_warning_that_training_never_receives_is_refused(tmp_path, extra, expected):
    """docs/cluster.md, Signals: B: signals the plugin's --wrap batch shell, which has no trap and dies, ending
    the job; the job's own Snakemake ignores SIGUSR1 alone (launcher.ignore_scheduler_warning_in_job), so it dies
    of any other signal and the step ends before training checkpoints."""
    config = load_config(write(tmp_path / "config.yaml", absolute_demo_config(["amr_demo"])))
    resources = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())["set-resources"]
    scheduler.check_slurm_submission(config, "slurm", resources, 3)  # the profile's own --signal=USR1@300
    for accepted in ("--signal=USR1@300", "--signal=SIGUSR1@300", "--qos=x --signal=R:USR1@300"):
        scheduler.check_slurm_submission(config, "slurm", {**resources, "train": {"slurm_extra": accepted}}, 3)
    with pytest.raises(WorkflowError, match=expected):
        scheduler.check_slurm_submission(config, "slurm", {**resources, "train": {"slurm_extra": extra}}, 3)


def test_a_warning_given_in_default_resources_reaches_train_and_is_read(tmp_path):
    """``--default-resources "slurm_extra='--signal=USR1@300'"`` reaches train (every rule gets it): it was read from
    set-resources alone, so such a run was refused as having no warning, and its timing went unchecked. A
    set-resources value for train still wins over the default, as Snakemake applies them."""
    from snakemake.resources import Resources

    config = load_config(write(tmp_path / "config.yaml", absolute_demo_config(["amr_demo"])))
    defaults = Resources.from_mapping({"slurm_extra": "'--signal=USR1@300'", "mem_mb": 4000})
    train = scheduler.with_default_resources(defaults, {"evaluate": {"runtime": 120}})
    scheduler.check_slurm_submission(config, "slurm", train, 3)
    assert scheduler.signal_warning(train) == (300, "--signal=USR1@300")
    overridden = scheduler.with_default_resources(defaults, {"train": {"slurm_extra": "'--signal=USR1@120'"}})
    assert scheduler.signal_warning(overridden) == (120, "--signal=USR1@120")
    assert scheduler.with_default_resources(None, None) == {"train": {}}
