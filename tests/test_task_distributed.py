"""Classification and masked LM under DDP (gloo on CPU): 1 and 2 processes follow the same loss curve, and
a run killed mid-way (SIGKILL: no clean-up) resumes from its last checkpoint to the same adapter.

The generation task's versions are tests/test_train.py::test_one_and_two_processes_follow_the_same_loss_curve
and ::test_killed_run_resumes_to_identical_adapter; the helpers are theirs. Data and tiny models come from
tests/test_task_gates.py's builders (the demo topics data with a tiny Llama classifier; a tiny BERT on a
learnable corpus), both through the real normalise -> pretokenise stages. LoRA dropout is on in both,
and BERT's own dropout too: each micro-batch's randomness must be the same in any process and after
the resume (masked LM masks come from the seed and the batch's row ids).

The 2-process runs are two gloo ranks forked from this process (tests/ranks.py), so no rank pays the imports
again; the launch through torchrun has its own tests (tests/test_train_ddp_resume.py, tests/test_launcher.py)."""
from __future__ import annotations

import json
import signal

import pytest
import torch

import ranks
from float_tolerance import assert_same_curve, assert_same_tensors
from conftest import tiny_training_settings
from test_task_gates import CLASSIFIER_MAX_LENGTH, build_classification_data, build_masked_lm_data
from test_train import adapter, log_rows, start_slow, train_argv, wait_for
from workflow_scripts import train
from workflow_scripts.training import checkpointing

STEPS, CHECKPOINT_EVERY = 12, 4
SETTINGS = {
    "classification": {"max_length": CLASSIFIER_MAX_LENGTH, "lora": {"target_modules": ["q_proj", "v_proj"]}},
    # A random base: its tied output layer is trained too (as test_masked_lm_chain), so the adapter holds it.
    "masked_lm": {"max_length": 32, "lora": {"target_modules": ["query", "value"], "modules_to_save": ["cls"]}},
}
BUILDERS = {"classification": build_classification_data, "masked_lm": build_masked_lm_data}
HEADS = {"classification": "score.", "masked_lm": "cls."}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def settings_for(task: str, processes: int) -> dict:
    overrides = SETTINGS[task]
    return tiny_training_settings(max_steps=STEPS, checkpoint_every=CHECKPOINT_EVERY, cpu_processes=processes,
                                  max_length=overrides["max_length"], lora={"dropout": 0.1, **overrides["lora"]})


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def task_data(request, tmp_path_factory):
    """(task, model dir, tokenised dir)."""
    model_dir, tokenised = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    assert json.loads((tokenised / "tokenise_meta.json").read_text())["task"] == request.param
    return request.param, model_dir, tokenised


@pytest.fixture(scope="module")
def one_process(task_data, tmp_path_factory):
    """An uninterrupted run in this process."""
    task, model_dir, tokenised = task_data
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp(f"{task}-1p")
    assert train.main(train_argv(out, model_dir, tokenised, settings_for(task, 1))) == 0
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 1
    return out


@pytest.fixture(scope="module")
def two_processes(task_data, tmp_path_factory):
    """An uninterrupted 2-process run (gloo): two ranks forked from this process."""
    task, model_dir, tokenised = task_data
    out = tmp_path_factory.mktemp(f"{task}-2p")
    ranks.assert_succeeded(ranks.run_stage(train.main, train_argv(out, model_dir, tokenised, settings_for(task, 2)),
                                           timeout=300))
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 2
    return out


def test_one_and_two_processes_follow_the_same_loss_curve(task_data, one_process, two_processes):
    task = task_data[0]
    one, two = [r["loss"] for r in log_rows(one_process)], [r["loss"] for r in log_rows(two_processes)]
    assert len(one) == STEPS
    assert_same_curve(two, one, settings_for(task, 1))  # float32 reordering bound (tests/float_tolerance.py)
    assert sum(one[-3:]) < sum(one[:3])  # it learns: not a comparison of two flat curves
    ours, theirs = adapter(one_process), adapter(two_processes)
    assert set(ours) == set(theirs) and any(HEADS[task] in name for name in ours)  # the trained head is saved
    assert_same_tensors(theirs, ours, settings_for(task, 1), steps=STEPS)


def test_two_fsdp_processes_with_activation_offloading_train_as_one(task_data, one_process, tmp_path):
    """The switches x strategies x tasks table (tests/test_switch_table.py) accepts these tasks under strategy fsdp
    with the CPU switches: two sharded ranks with activation offloading (exact) follow the one-process run. (A
    token budget regroups the micro-batches, so with dropout on, as here, its masks differ: the budget's own
    probe under fsdp is test_switch_table.py's, dropout off.)"""
    task, model_dir, tokenised = task_data
    reference = settings_for(task, 1)
    sharded = reference.replace(strategy="fsdp", cpu_processes=2, activation_offloading=True,
                                gradient_checkpointing=True)
    ranks.assert_succeeded(ranks.run_stage(train.main, train_argv(tmp_path, model_dir, tokenised, sharded), timeout=300))
    one = [r["loss"] for r in log_rows(one_process)]
    assert_same_curve([r["loss"] for r in log_rows(tmp_path)], one, reference)
    assert_same_tensors(adapter(tmp_path), adapter(one_process), reference, steps=STEPS)


def test_killed_run_resumes_to_identical_adapter(tmp_path, capsys, task_data, one_process):
    task, model_dir, tokenised = task_data
    settings = settings_for(task, 1)
    process = start_slow(tmp_path, model_dir, tokenised, settings)  # each micro-step slowed, in a forked process
    wait_for(lambda: (tmp_path / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}" / "state.json").exists(), process,
             timeout=180)
    process.send_signal(signal.SIGKILL)  # no chance to clean up, as with an OOM kill or node failure
    process.communicate()
    step, path = checkpointing.checkpoints(tmp_path / "checkpoints")[-1]
    assert CHECKPOINT_EVERY <= step < STEPS and not (tmp_path / "adapter").exists()
    capsys.readouterr()
    assert train.main(train_argv(tmp_path, model_dir, tokenised, settings)) == 0
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((tmp_path / "run_manifest.json").read_text())["resumed_from_step"] == step
    ours, theirs = adapter(tmp_path), adapter(one_process)
    assert set(ours) == set(theirs) and any(HEADS[task] in name for name in ours)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert [r["loss"] for r in log_rows(tmp_path)] == [r["loss"] for r in log_rows(one_process)]
