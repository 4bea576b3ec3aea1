"""Checkpoints restore everything a resumed run needs, and appear whole or not at all."""
import random

import numpy as np
import pytest
import torch

from conftest import tiny_training_settings
from workflow_scripts.training import checkpointing
from workflow_scripts.training import training_setup
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.training.distributed import DistributedContext

CPU = DistributedContext(0, 0, 1, 1, torch.device("cpu"), None)


@pytest.fixture
def setup(tiny_model_dir):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    built = training_setup.build(tiny_model_dir, tiny_training_settings(), CPU)
    for p in built.trainable_parameters():  # one real optimizer step so Adam has state
        p.grad = torch.randn_like(p)
    built.optimizer.step()
    built.scheduler.step()
    return built


def test_round_trip_restores_adapter_optimizer_scheduler_and_rng(tmp_path, setup, tiny_model_dir):
    fingerprint = {"settings_sha256": "a"}
    random.seed(5); np.random.seed(5); torch.manual_seed(5)
    checkpointing.save(tmp_path, 7, setup.peft_model, setup.optimizer, setup.scheduler, None,
                       [checkpointing.rng_state(torch.device("cpu"))], fingerprint)
    expected_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    torch.manual_seed(123)
    fresh = training_setup.build(tiny_model_dir, tiny_training_settings(), CPU)
    path = checkpointing.latest_compatible(tmp_path, fingerprint)
    assert checkpointing.load(path, fresh.peft_model, fresh.optimizer, fresh.scheduler, None, 0, torch.device("cpu")) == 7
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected_draws
    for (name, a), b in zip(setup.peft_model.named_parameters(), fresh.peft_model.parameters()):
        assert torch.equal(a, b), name
    assert fresh.scheduler.get_last_lr() == setup.scheduler.get_last_lr()
    old, new = setup.optimizer.state_dict(), fresh.optimizer.state_dict()
    for key in old["state"]:
        assert torch.equal(old["state"][key]["exp_avg_sq"], new["state"][key]["exp_avg_sq"])


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, setup, monkeypatch):
    args = (setup.peft_model, setup.optimizer, setup.scheduler, None, [checkpointing.rng_state(torch.device("cpu"))], {})
    checkpointing.save(tmp_path, 2, *args)

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpointing.torch, "save", crash)
    with pytest.raises(OSError):
        checkpointing.save(tmp_path, 4, *args)
    assert [s for s, _ in checkpointing.checkpoints(tmp_path)] == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]  # no partial directory


def test_only_newest_kept_and_another_runs_checkpoint_refused_not_deleted(tmp_path, setup):
    args = (setup.peft_model, setup.optimizer, setup.scheduler, None, [checkpointing.rng_state(torch.device("cpu"))])
    for step in (2, 4, 6):
        checkpointing.save(tmp_path, step, *args, {"data_cache_key": "old", "settings": {"lora": {"rank": 4}}})
    assert [s for s, _ in checkpointing.checkpoints(tmp_path)] == [6]
    with pytest.raises(WorkflowError, match=r"step-00000006: this checkpoint \(step 6\) was written by a run with "
                                             r"different data_cache_key, settings.lora.rank; .*Fix:"):
        checkpointing.latest_compatible(tmp_path, {"data_cache_key": "new", "settings": {"lora": {"rank": 8}}})
    assert [s for s, _ in checkpointing.checkpoints(tmp_path)] == [6]  # kept: the user decides
