"""Two gloo processes, signalled mid-run as SLURM does before a time limit, resume to the same adapter.

The DDP family's run through torchrun: the signalled run is torchrun's (it hands the signal to both ranks, as
under SLURM); the uninterrupted reference and the resume are two ranks forked from this process
(tests/ranks.py), and the resumed run must match the reference bit for bit."""
import json
import signal
import subprocess
import sys
import time

import torch

import ranks
from conftest import tiny_training_settings
from test_train import REPO, adapter, log_rows, subprocess_env, train_argv
from workflow_scripts import train
from workflow_scripts.training import checkpointing


def torchrun(entry: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *entry]


def test_two_process_run_signalled_and_resumed_matches_uninterrupted(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    # dropout > 0: each rank's RNG must be saved and restored for the same dropout masks.
    settings = tiny_training_settings(max_steps=8, checkpoint_every=100, cpu_processes=2, lora={"dropout": 0.1})
    env = subprocess_env()
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"

    ranks.assert_succeeded(ranks.run_stage(train.main, train_argv(reference, tiny_model_dir, tiny_tokenised_dir,
                                                                  settings)))

    slowed = subprocess.Popen(torchrun([str(REPO / "tests" / "slowed_train.py"),
                                        *train_argv(resumed, tiny_model_dir, tiny_tokenised_dir, settings)]),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    running_log = resumed / "checkpoints" / "train_log.running.jsonl"
    deadline = time.time() + 120
    while not (running_log.exists() and len(running_log.read_text().splitlines()) >= 2):
        assert slowed.poll() is None and time.time() < deadline, slowed.stdout.read()[-3000:]
        time.sleep(0.02)
    slowed.send_signal(signal.SIGTERM)  # torchrun hands it to both ranks
    output = slowed.communicate(timeout=120)[0]
    assert slowed.returncode != 0 and "checkpointed step" in output and "exiting with 75" in output, output[-3000:]
    (step, path), = checkpointing.checkpoints(resumed / "checkpoints")
    assert 2 <= step < settings.max_steps
    assert json.loads((path / "state.json").read_text())["world_size"] == 2  # both ranks' RNG states
    assert not (resumed / "adapter").exists()

    finished = ranks.assert_succeeded(ranks.run_stage(train.main, train_argv(resumed, tiny_model_dir,
                                                                             tiny_tokenised_dir, settings)))
    assert f"resumed from {path}" in finished
    ours, theirs = adapter(resumed), adapter(reference)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    assert [r["loss"] for r in log_rows(resumed)] == [r["loss"] for r in log_rows(reference)]
