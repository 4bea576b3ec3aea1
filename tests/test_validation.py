"""Training by epochs, the held-out validation loss, the best adapter and early stopping (training.validation)."""
import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ranks
from float_tolerance import assert_same_curve
from conftest import build_tiny_tokenised, tiny_training_settings, training_json
from test_train import adapter, finish, log_rows, start_slow, train_argv, wait_for
from workflow_scripts import sanity, train
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.training import validation


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return build_tiny_tokenised(tmp_path_factory.mktemp("with_validation"), rows=96, validation_rows=24)


def manifest(out):
    return json.loads((out / "run_manifest.json").read_text())


def test_epochs_set_the_step_count_and_the_schedule(tmp_path, tiny_model_dir, data_dir):
    # 96 rows, effective batch 8: 12 steps per epoch; 1.5 epochs = 18 steps, the schedule over 18.
    settings = tiny_training_settings(max_steps=None, epochs=1.5, checkpoint_every=100, lr_scheduler="linear")
    assert train.main(train_argv(tmp_path, tiny_model_dir, data_dir, settings)) == 0
    rows = log_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 19))
    assert manifest(tmp_path)["settings"]["max_steps"] == 18 and manifest(tmp_path)["settings"]["epochs"] == 1.5
    assert rows[-1]["learning_rate"] > 0 and rows[-1]["learning_rate"] < rows[1]["learning_rate"] / 5


@pytest.mark.parametrize("changes, key, message", [
    ({"max_steps": None}, "training.max_steps", "how long to train is not set"),
    ({"max_steps": 10, "epochs": 2}, "training.epochs", "both max_steps (10) and epochs (2) are set; keep one"),
])
def test_length_is_given_exactly_once(changes, key, message):
    with pytest.raises(ConfigError) as caught:
        tiny_training_settings(**changes)
    assert caught.value.key == key and message in str(caught.value)


def test_validation_loss_is_logged_and_the_same_on_one_and_two_processes(tmp_path, tiny_model_dir, data_dir):
    losses = []
    for processes in (1, 2):
        settings = tiny_training_settings(max_steps=8, cpu_processes=processes, checkpoint_every=100,
                                          validation={"every_steps": 3})
        out = tmp_path / f"p{processes}"
        if processes == 1:
            assert train.main(train_argv(out, tiny_model_dir, data_dir, settings)) == 0
        else:  # two gloo ranks forked from this process (tests/ranks.py)
            ranks.assert_succeeded(ranks.run_stage(train.main, train_argv(out, tiny_model_dir, data_dir, settings)))
        rows = log_rows(out)
        assert [r["step"] for r in rows if "validation_loss" in r] == [3, 6, 8]  # every 3 steps and the last
        losses.append([r["validation_loss"] for r in rows if "validation_loss" in r])
        recorded = manifest(out)["validation"]
        assert recorded["adapter_kept"] == "final" and [s for s, _ in recorded["validation_losses"]] == [3, 6, 8]
    assert_same_curve(losses[1], losses[0], settings, steps=[3, 6, 8])  # float32 reordering bound
    assert losses[0][-1] < losses[0][0]  # the model learns what the validation rows ask too


def test_validation_leaves_training_unchanged(tmp_path, tiny_model_dir, data_dir):
    """Evaluating draws nothing at random and changes no weight: the training curve is the same without it."""
    with_checks = tiny_training_settings(max_steps=6, checkpoint_every=100, lora={"dropout": 0.1},
                                         validation={"every_steps": 2})
    without = tiny_training_settings(max_steps=6, checkpoint_every=100, lora={"dropout": 0.1})
    assert train.main(train_argv(tmp_path / "a", tiny_model_dir, data_dir, with_checks)) == 0
    assert train.main(train_argv(tmp_path / "b", tiny_model_dir, data_dir, without)) == 0
    assert [r["loss"] for r in log_rows(tmp_path / "a")] == [r["loss"] for r in log_rows(tmp_path / "b")]
    for name, tensor in adapter(tmp_path / "a").items():
        assert torch.equal(tensor, adapter(tmp_path / "b")[name]), name


def scripted_losses(monkeypatch, values):
    """Validation returns ``values`` in turn; the adapter saved at each new best is recorded."""
    sequence, saved = iter(values), {}
    real_save = validation.save_best

    def save_best(setup, checkpoint_dir, step):
        real_save(setup, checkpoint_dir, step)
        saved[step] = load_file(str(Path(checkpoint_dir) / f"best-step-{step:08d}" / "adapter_model.safetensors"))

    monkeypatch.setattr(validation, "held_out_loss", lambda *args, **kwargs: next(sequence))
    monkeypatch.setattr(validation, "save_best", save_best)
    return saved


def test_keep_best_writes_the_best_steps_adapter_and_early_stopping_stops(monkeypatch, tmp_path, tiny_model_dir, data_dir):
    saved = scripted_losses(monkeypatch, [3.0, 1.0, 2.0, 2.5, 0.5])
    settings = tiny_training_settings(max_steps=10, checkpoint_every=100, validation={
        "every_steps": 2, "keep": "best", "early_stopping_patience": 2})
    out = tmp_path
    assert train.main(train_argv(out, tiny_model_dir, data_dir, settings)) == 0
    rows = log_rows(out)
    assert rows[-1]["step"] == 8  # evaluations at 2, 4 (best), 6, 8: two without improvement -> stop
    recorded = manifest(out)["validation"]
    assert recorded["best_step"] == 4 and recorded["best_validation_loss"] == 1.0
    assert recorded["stopped_early_at_step"] == 8 and recorded["adapter_kept"] == "best"
    kept = adapter(out)
    assert set(kept) == set(saved[4]) and all(torch.equal(kept[n], saved[4][n]) for n in kept)
    final_step = {n: t for n, t in saved[2].items()}
    assert any(not torch.equal(kept[n], final_step[n]) for n in kept)  # not just any adapter
    assert not list((out / "checkpoints").glob("best-step-*"))  # nothing left beside the output


def test_a_resumed_run_keeps_the_same_best_adapter(tmp_path, tiny_model_dir, data_dir):
    """Killed after its best step and a checkpoint: the resumed run selects and writes the same adapter."""
    settings = tiny_training_settings(max_steps=12, checkpoint_every=4, lora={"dropout": 0.1},
                                      validation={"every_steps": 2, "keep": "best"})
    reference = tmp_path / "reference"
    finish(reference, tiny_model_dir, data_dir, settings)
    out = tmp_path / "killed"
    process = start_slow(out, tiny_model_dir, data_dir, settings)
    wait_for(lambda: (out / "checkpoints" / "step-00000008" / "state.json").exists(), process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finish(out, tiny_model_dir, data_dir, settings)
    assert manifest(out)["validation"] == manifest(reference)["validation"]
    ours, theirs = adapter(out), adapter(reference)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_validation_without_a_validation_split_is_refused_by_the_gate(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    settings = tiny_training_settings(max_steps=4, validation={"every_steps": 2})
    with pytest.raises(WorkflowError, match="no 'validation' split, but training.validation.every_steps is set"):
        sanity.main(["--model", str(tiny_model_dir), "--data", str(tiny_tokenised_dir), "--training",
                     training_json(settings), "--seed", "1", "--out", str(tmp_path / "sanity.json")])
    assert not (tmp_path / "sanity.json").exists()


def test_the_config_refuses_validation_for_a_dataset_without_that_split():
    from data_helpers import default_config
    from workflow_scripts.checks.config import check_config
    from workflow_scripts.core.config_files import validate_schema

    config = default_config()
    config["training"]["validation"] = {"every_steps": 50}
    config["datasets"]["amr_demo"]["splits"] = {"train": "train", "test": "test"}  # the default names validation
    validate_schema(config)
    with pytest.raises(ConfigError, match="dataset 'amr_demo' has no validation split"):
        check_config(config)


def test_two_processes_with_fewer_validation_batches_than_ranks_finish_with_the_same_loss(tmp_path, tiny_model_dir,
                                                                                          data_dir):
    # max_examples 4 at micro_batch 4: one validation batch for two ranks. Under DDP, the forward after a
    # synced step broadcasts buffers (RoPE's inv_freq); a rank with no batch skipped it and went straight to
    # the all_reduce, and both ranks hung (issue 23, point 1).
    losses = []
    for processes in (1, 2):
        settings = tiny_training_settings(max_steps=4, cpu_processes=processes, checkpoint_every=100,
                                          validation={"every_steps": 2, "max_examples": 4})
        out = tmp_path / f"p{processes}"
        if processes == 1:
            assert train.main(train_argv(out, tiny_model_dir, data_dir, settings)) == 0
        else:  # two gloo ranks forked from this process (tests/ranks.py); hung ranks are killed at the timeout
            job = ranks.start_stage(train.main, train_argv(out, tiny_model_dir, data_dir, settings))
            try:
                job.wait(timeout=90)
            except AssertionError as hung:
                pytest.fail("two processes with one validation batch between them did not finish (collectives out "
                            f"of step)\n{hung}")
            assert job.returncode == 0, job.outputs()
        losses.append([r["validation_loss"] for r in log_rows(out) if "validation_loss" in r])
    assert len(losses[0]) == 2
    assert_same_curve(losses[1], losses[0], settings, steps=[2, 4])  # float32 reordering bound (tests/float_tolerance.py)
