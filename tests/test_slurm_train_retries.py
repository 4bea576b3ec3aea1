"""The run-start SLURM check asks whether a checkpointed train job is really resubmitted: the retries Snakemake
gives the train rule, not only whether train is named a preemptible rule.

``--preemptible-rules train`` without ``--preemptible-retries`` gives train no retry count at all: Snakemake
then ends in a TypeError traceback at the first train job that exits 75. ``--retries N`` resubmits train as well
as ``preemptible-rules`` does. Each run here targets only download (a local rule), so no job is ever submitted.
"""
from __future__ import annotations

import snakemake_fork
from data_helpers import ROOT
from test_config_refusals import write
from test_dag import absolute_demo_config

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
