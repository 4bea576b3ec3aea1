"""training.strategy: fsdp (FSDP2, gloo on CPU) on the tiny Llama.

- 2 FSDP processes follow the loss curve of 1 plain process (micro_batch 2: gradient accumulation too,
  so skipping the reduce-scatter on early micro-steps is exercised): a tolerance, as the ranks' float
  sums meet in another order;
- the saved adapter is a plain PEFT adapter (PeftModel.from_pretrained onto the base model);
- a 2-process FSDP run killed mid-way (SIGKILL to all its processes) resumes to the *bit-identical*
  adapter and losses: same world, same shards, gloo's reductions are deterministic and the checkpoint
  holds the full fp32 state exactly, so nothing may differ;
- that FSDP checkpoint resumes under DDP in one process too (strategy and process count are runtime-only)
  and ends at the uninterrupted run's adapter within tolerance;
- the gate passes under fsdp; bf16 trains through MixedPrecisionPolicy; a world of one shards too;
- what FSDP cannot run is refused naming training.strategy.

The uninterrupted and the killed 2-process runs are two gloo ranks forked from this process (tests/ranks.py);
the resume goes through the workflow's launcher and torchrun, exactly as the rules start it, and must end
bit-identical to the forked uninterrupted run.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

import ranks
from float_tolerance import assert_same_curve, assert_same_tensors
from conftest import build_tiny_tokenised, tiny_training_settings, training_json
from test_train import REPO, adapter, log_rows, start_slow_argv, subprocess_env, train_argv, wait_for
from workflow_scripts import sanity, train
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.training import checkpointing, fsdp

STEPS, CHECKPOINT_EVERY = 8, 3


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def settings(strategy: str, processes: int, **overrides) -> dict:
    # dropout on: each rank's randomness must be the same after the resume, and as in one process.
    return tiny_training_settings(**{"max_steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "micro_batch": 2,
                                     "cpu_processes": processes, "strategy": strategy, "lora": {"dropout": 0.1},
                                     **overrides})


def run_train(out, model_dir, data_dir, training: dict) -> str:
    """The train stage as the rules run it, a command (the launcher starts torchrun for 2 processes); its stdout."""
    done = subprocess.run([sys.executable, "-m", "workflow_scripts.train", *train_argv(out, model_dir, data_dir, training)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, tiny_tokenised_dir):
    """The reference: one plain (unsharded) process, in this process."""
    out = tmp_path_factory.mktemp("ddp-1p")
    torch.set_num_threads(1)
    assert train.main(train_argv(out, tiny_model_dir, tiny_tokenised_dir, settings("ddp", 1))) == 0
    return out


@pytest.fixture(scope="module")
def fsdp_two(tmp_path_factory, tiny_model_dir, tiny_tokenised_dir):
    """The uninterrupted 2-process FSDP run: two gloo ranks forked from this process."""
    out = tmp_path_factory.mktemp("fsdp-2p")
    ranks.assert_succeeded(ranks.run_stage(train.main, train_argv(out, tiny_model_dir, tiny_tokenised_dir,
                                                                  settings("fsdp", 2)), timeout=300))
    return out


def test_two_fsdp_processes_follow_the_one_process_loss_curve(one_process, fsdp_two):
    manifest = json.loads((fsdp_two / "run_manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["settings"]["strategy"] == "fsdp"
    assert manifest["gradient_accumulation"] == 2  # 8 rows = 2 ranks x 2 micro-batches x 2 rows
    one, two = [r["loss"] for r in log_rows(one_process)], [r["loss"] for r in log_rows(fsdp_two)]
    assert len(one) == STEPS
    assert_same_curve(two, one, settings("ddp", 1))  # float32 reordering bound (tests/float_tolerance.py)
    assert sum(one[-3:]) < sum(one[:3])  # it learns: not two flat curves
    grad_norms = [[r["grad_norm"] for r in log_rows(out)] for out in (one_process, fsdp_two)]
    assert_same_curve(grad_norms[1], grad_norms[0], settings("ddp", 1))  # clipping saw the global norm
    ours, theirs = adapter(fsdp_two), adapter(one_process)
    assert set(ours) == set(theirs)
    assert_same_tensors(ours, theirs, settings("ddp", 1), steps=STEPS)
    assert not checkpointing.checkpoints(fsdp_two / "checkpoints")  # a finished run leaves nothing to resume


def test_fsdp_adapter_is_a_plain_peft_adapter(tiny_model_dir, one_process, fsdp_two):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    directory = fsdp_two / "adapter"
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in (one_process / "adapter").iterdir())
    config, reference = ({key: sorted(v) if isinstance(v, list) else v  # PEFT writes target_modules from a set
                          for key, v in json.loads((d / "adapter_config.json").read_text()).items()}
                         for d in (directory, one_process / "adapter"))
    assert config == reference
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(directory))
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    saved = adapter(fsdp_two)
    assert len(loaded) == len(saved) == 12 and all(t.dtype == torch.float32 and not t.is_meta for t in saved.values())
    for name, tensor in saved.items():  # full tensors, not one rank's shard
        assert torch.equal(loaded[name], tensor), name
    assert any(t.abs().sum() > 0 for n, t in saved.items() if "lora_B" in n)  # lora_B starts at zero: it trained


@pytest.fixture(scope="module")
def killed_fsdp_run(tmp_path_factory, tiny_model_dir, tiny_tokenised_dir):
    """A 2-process FSDP run (two forked ranks, each micro-step slowed) killed after its first checkpoint
    (SIGKILL to both ranks: no clean-up, as a node failure)."""
    out = tmp_path_factory.mktemp("fsdp-killed")
    process = start_slow_argv(train_argv(out, tiny_model_dir, tiny_tokenised_dir, settings("fsdp", 2)), world_size=2)
    wait_for(lambda: (out / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}" / "state.json").exists(), process, 180)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    step, path = checkpointing.checkpoints(out / "checkpoints")[-1]
    assert CHECKPOINT_EVERY <= step < STEPS and not (out / "adapter").exists()
    state = json.loads((path / "state.json").read_text())
    assert state["strategy"] == "fsdp" and state["world_size"] == 2
    copy = tmp_path_factory.mktemp("fsdp-killed-copy")
    shutil.copytree(out / "checkpoints", copy / "checkpoints")
    return out, copy, step


def test_killed_fsdp_run_resumes_to_the_identical_adapter(tiny_model_dir, tiny_tokenised_dir, fsdp_two, killed_fsdp_run):
    out, _, step = killed_fsdp_run
    stdout = run_train(out, tiny_model_dir, tiny_tokenised_dir, settings("fsdp", 2))
    assert f"resumed from {out / 'checkpoints' / f'step-{step:08d}'}" in stdout
    assert json.loads((out / "run_manifest.json").read_text())["resumed_from_step"] == step
    ours, theirs = adapter(out), adapter(fsdp_two)
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert [r["loss"] for r in log_rows(out)] == [r["loss"] for r in log_rows(fsdp_two)]


def test_fsdp_checkpoint_resumes_under_ddp_in_one_process(capsys, tiny_model_dir, tiny_tokenised_dir, one_process,
                                                          killed_fsdp_run):
    _, out, step = killed_fsdp_run
    capsys.readouterr()
    assert train.main(train_argv(out, tiny_model_dir, tiny_tokenised_dir, settings("ddp", 1))) == 0
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((out / "run_manifest.json").read_text())["resumed_from_step"] == step
    # Adam's moments came back too: without them the first resumed update would be far off.
    assert_same_curve([r["loss"] for r in log_rows(out)], [r["loss"] for r in log_rows(one_process)], settings("ddp", 1))
    assert_same_tensors(adapter(out), adapter(one_process), settings("ddp", 1), steps=STEPS)


def test_gate_passes_under_fsdp(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    """The sanity stage's checks (gradients, names, placement) read the sharded DTensor parameters. In one
    process to keep the file quick (it passed with 2 processes as well when this test was written)."""
    out = tmp_path / "sanity.json"
    assert sanity.main(["--model", str(tiny_model_dir), "--data", str(tiny_tokenised_dir), "--training",
                        training_json(settings("fsdp", 1, sanity_batches=2)), "--seed", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["world_size"] == 1 and len(report["probe_losses"]) == 2
    assert {"gradients", "trainable_parameters", "name_lookup", "placement"} <= {c["name"] for c in report["checks"]}
    assert not torch.distributed.is_initialized()


def test_bf16_trains_under_fsdp_in_one_process(tmp_path, tiny_model_dir, tiny_tokenised_dir, one_process):
    """A world of one still shards (FSDP needs a process group: one is started and ended);
    bf16 compute through MixedPrecisionPolicy keeps the fp32 adapters."""
    training = settings("fsdp", 1, precision="bf16", max_steps=4)
    assert train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, training)) == 0
    losses = [r["loss"] for r in log_rows(tmp_path)]
    reference = [r["loss"] for r in log_rows(one_process)][:4]
    assert losses == pytest.approx(reference, rel=5e-2) and losses != reference  # bf16: close, not the same
    assert all(t.dtype == torch.float32 for t in adapter(tmp_path).values())
    assert not torch.distributed.is_initialized()  # the world-of-one group was ended


@pytest.mark.parametrize("overrides, named", [
    ({"precision": "fp16"}, "precision fp16"),
])
def test_what_fsdp_cannot_run_is_refused(tmp_path, tiny_model_dir, tiny_tokenised_dir, overrides, named):
    training = settings("fsdp", 1, **overrides)
    data = build_tiny_tokenised(tmp_path / "data", validation_rows=8) if "validation" in overrides else tiny_tokenised_dir
    with pytest.raises(WorkflowError, match=r"^training\.strategy: fsdp .*Fix: .*training\.strategy: ddp$") as caught:
        train.main(train_argv(tmp_path, tiny_model_dir, data, training))
    assert named in str(caught.value) and not torch.distributed.is_initialized()


def test_fsdp_refuses_the_validation_metric():  # each rank generates its own rows, for its own number of steps
    training = settings("fsdp", 2, validation={"every_steps": 2, "metric_examples": 4})
    with pytest.raises(WorkflowError, match=r"^training\.strategy: fsdp does not support training\.validation\.metric_examples"):
        fsdp.check_settings(training, "generation")


def test_fsdp_validation_with_fewer_batches_than_ranks_matches_one_process(tmp_path, tiny_model_dir):
    # One validation batch for two ranks: the other rank runs a zero-weight forward, as every sharded
    # forward gathers parameters from all ranks (issue 23, point 1).
    data = build_tiny_tokenised(tmp_path / "data", validation_rows=8)
    checks = {"every_steps": 2, "max_examples": 2, "keep": "best"}  # best: gathered from the shards
    losses = []
    for strategy, processes in (("ddp", 1), ("fsdp", 2)):
        out = tmp_path / strategy
        training = settings(strategy, processes, max_steps=4, validation=checks)
        if processes == 1:
            assert train.main(train_argv(out, tiny_model_dir, data, training)) == 0
        else:  # two gloo ranks forked from this process; ranks out of step hang until the timeout fails them
            ranks.assert_succeeded(ranks.run_stage(train.main, train_argv(out, tiny_model_dir, data, training),
                                                   timeout=180))
        losses.append([r["validation_loss"] for r in log_rows(out) if "validation_loss" in r])
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-4)
    kept = [adapter(tmp_path / strategy) for strategy in ("ddp", "fsdp")]
    for name in kept[0]:
        assert torch.allclose(kept[0][name], kept[1][name], atol=1e-5), name


def test_a_model_without_findable_decoder_layers_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)]))
    with pytest.raises(WorkflowError, match=r"training\.strategy: fsdp cannot find the decoder layers of Sequential"):
        fsdp.decoder_layers(model)
