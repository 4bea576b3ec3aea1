"""training.micro_batch_tokens (data/batching.py): micro-batches filled to a token budget train the same
optimizer steps as fixed micro-batches, on one process and in lockstep on two.

Tolerance: the examples of a step are the same and the loss is normalised by the step's target tokens in both
runs (train.run_steps), so only the grouping of float sums differs (which rows share a forward, how gradients
are accumulated, DDP's all-reduce): the float32 reordering bound of tests/float_tolerance.py, on each step's
loss and on each adapter tensor's norm. LoRA dropout is off: its masks are drawn per micro-batch.
"""
import signal

import numpy as np
import pytest
import torch

import ranks
from float_tolerance import assert_same_curve, assert_same_tensors
from conftest import tiny_training_settings
from test_train import adapter, log_rows, train_argv
from workflow_scripts import train


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def assert_same_training(reference, other, settings):
    losses = [r["loss"] for r in log_rows(reference)]
    assert_same_curve([r["loss"] for r in log_rows(other)], losses, settings)
    assert_same_tensors(adapter(other), adapter(reference), settings, steps=len(losses))


def test_a_token_budget_trains_as_fixed_micro_batches(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    """Budget 128 = 2 x max_length (rows of 6..37 tokens): 3 to 8 examples per micro-batch, the step's count
    varying with its lengths, against micro_batch 2 (4 micro-steps every step)."""
    fixed = tiny_training_settings(max_steps=5, micro_batch=2, checkpoint_every=100)
    budget = fixed.replace(micro_batch_tokens=128)
    for name, settings in (("fixed", fixed), ("budget", budget)):
        assert train.main(train_argv(tmp_path / name, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
    steps = [r["micro_steps"] for r in log_rows(tmp_path / "budget")]
    assert "micro_steps" not in log_rows(tmp_path / "fixed")[0] and len(set(steps)) > 1 and sum(steps) < 4 * len(steps)
    assert_same_training(tmp_path / "fixed", tmp_path / "budget", fixed)


def count_micro_steps():
    """In a forked rank: every micro-step prints its optimizer step (training code unchanged)."""
    from workflow_scripts.training import training_setup

    step = training_setup.micro_step

    def counted(setup, batch, loss_scale, last_micro_step, randomness):
        print(f"micro-step of step {randomness[1]}", flush=True)
        return step(setup, batch, loss_scale, last_micro_step, randomness)

    training_setup.micro_step = counted


def test_two_ranks_with_a_token_budget_run_in_lockstep_and_train_as_one(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    """Two DDP ranks (gloo, forked): rank 0 is dealt the longer example of every pair, so its share sometimes
    needs more micro-batches than rank 1's; both run the plan's count, and the run trains as one process with
    fixed micro-batches. Each rank counts its own micro-steps: under DDP's no_sync a rank running fewer would
    still train right (gradients accumulate locally), but FSDP gathers parameters at every forward, where the
    other rank would wait for ever."""
    from workflow_scripts.data import batching

    # A random plan (length_grouping: false) mixes lengths within a step, so the two shares differ more.
    one = tiny_training_settings(max_steps=6, micro_batch=2, checkpoint_every=100, length_grouping=False)
    two = one.replace(micro_batch_tokens=64, cpu_processes=2)
    plan = batching.GlobalBatchPlan(batching.TokenisedSplit(tiny_tokenised_dir).lengths(), two.effective_batch, 1,
                                    group_by_length=False)
    needs = []  # per step, what each rank's share (the step's rows longest first, dealt in turn) needs alone
    for step in range(6):
        rows = plan.global_batch(step)
        rows = rows[np.argsort(-plan.lengths[rows], kind="stable")]
        needs.append([len(batching.fewest_cuts(plan.lengths[rows[r::2]], 64)) for r in range(2)])
    assert any(a != b for a, b in needs), needs  # the shares' own counts differ: lockstep is exercised
    assert train.main(train_argv(tmp_path / "one", tiny_model_dir, tiny_tokenised_dir, one)) == 0
    results = ranks.run_stage(train.main, train_argv(tmp_path / "two", tiny_model_dir, tiny_tokenised_dir, two),
                              timeout=180, before=count_micro_steps)
    ranks.assert_succeeded(results)
    for result in results:
        counted = [sum(line == f"micro-step of step {step}" for line in result.output.splitlines())
                   for step in range(6)]
        assert counted == [max(n) for n in needs], (result.rank, counted, needs)
    assert [r["micro_steps"] for r in log_rows(tmp_path / "two")] == [max(n) for n in needs]
    assert_same_training(tmp_path / "one", tmp_path / "two", one)


def test_a_killed_run_with_a_token_budget_resumes_to_the_identical_adapter(tmp_path, tiny_model_dir,
                                                                           tiny_tokenised_dir):
    """The budget's micro-batches are a function of (seed, step): a run killed after its step-4 checkpoint and
    resumed trains bit for bit as the uninterrupted one (LoRA dropout on: the masks follow the micro-batches)."""
    from test_train import assert_same_run, finish, start_slow, wait_for

    settings = tiny_training_settings(max_steps=8, checkpoint_every=2, lora={"dropout": 0.1}, micro_batch_tokens=128)
    finish(tmp_path / "uninterrupted", tiny_model_dir, tiny_tokenised_dir, settings)
    out = tmp_path / "killed"
    process = start_slow(out, tiny_model_dir, tiny_tokenised_dir, settings)
    wait_for(lambda: (out / "checkpoints" / "step-00000004" / "state.json").exists(), process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "adapter").exists()
    assert "resumed from" in finish(out, tiny_model_dir, tiny_tokenised_dir, settings)
    assert_same_run(out, tmp_path / "uninterrupted")
    assert len({r["micro_steps"] for r in log_rows(out)}) > 1


def test_the_gate_probes_the_budget_micro_batches(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    """sanity runs its probe steps through the same budget plan as training, and estimates activations from
    the budget's tokens: 128 slots estimate as micro_batch 2 x max_length 64, whatever micro_batch says."""
    import json

    from conftest import training_json
    from workflow_scripts import sanity

    reports = {}
    for name, settings in (("budget", tiny_training_settings(sanity_batches=2, micro_batch=4, micro_batch_tokens=128)),
                           ("fixed", tiny_training_settings(sanity_batches=2, micro_batch=2))):
        out = tmp_path / f"{name}.json"
        assert sanity.main(["--model", str(tiny_model_dir), "--data", str(tiny_tokenised_dir), "--training",
                            training_json(settings), "--seed", "1", "--out", str(out)]) == 0
        reports[name] = json.loads(out.read_text())
    assert reports["budget"]["passed"] and reports["budget"]["gradient_accumulation"] is None
    assert reports["budget"]["memory_estimate"]["activations"] == reports["fixed"]["memory_estimate"]["activations"]
