"""The train stage: outputs, loss falls, 1 vs 2 processes agree, kill-and-resume is exact, NaN stops.

The stage runs in this process, or in ranks forked from it (tests/ranks.py: no fresh interpreter pays the
imports again); the launch through torchrun has its own tests (tests/test_train_ddp_resume.py,
tests/test_launcher.py)."""
import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ranks
from float_tolerance import assert_same_curve, assert_same_tensors
from conftest import tiny_training_settings, training_json
from workflow_scripts.training import checkpointing, training_setup
from workflow_scripts import train

REPO = Path(__file__).resolve().parent.parent
LOG_FIELDS = {"step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "padding_share",
              "peak_memory_bytes", "elapsed_seconds", "update_skipped"}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def train_argv(out: Path, model_dir, data_dir, settings: dict, seed: int = 1) -> list[str]:
    return ["--model", str(model_dir), "--data", str(data_dir), "--training", training_json(settings),
            "--seed", str(seed), "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
            "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")]


def subprocess_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return env


def log_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def adapter(out: Path) -> dict:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def test_train_writes_peft_adapter_log_and_manifest(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    settings = tiny_training_settings(max_steps=24, learning_rate=3e-2, checkpoint_every=100,
                                      lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"]})
    assert train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
    rows = log_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 25)) and all(set(r) == LOG_FIELDS for r in rows[1:])
    # The first step also says what start-up cost the stage: from its process start to that step's end.
    assert set(rows[0]) == LOG_FIELDS | {"seconds_from_stage_start"} and rows[0]["seconds_from_stage_start"] > 0
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-4:]) / 4
    assert last < first - 0.1, (first, last)
    assert max(r["padding_share"] for r in rows) < 0.2
    manifest = json.loads((tmp_path / "run_manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["settings"]["max_steps"] == 24
    assert manifest["memory_estimate"]["total"] > 0 and manifest["peak_memory_bytes"] > 0
    assert manifest["data_cache_key"] == "tiny-0-96" and "torch" in manifest["packages"]
    # The adapter is standard PEFT: plain PeftModel.from_pretrained loads it, safetensors only.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert not list((tmp_path / "adapter").glob("*.bin"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(tmp_path / "adapter"))
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    saved = adapter(tmp_path)
    assert len(loaded) == len(saved) == 28
    trained = next(t for n, t in saved.items() if "lora_B" in n)
    assert trained.abs().sum() > 0  # lora_B starts at zero: non-zero means it trained


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_one_and_two_processes_follow_the_same_loss_curve(tmp_path, tiny_model_dir, tiny_tokenised_dir, dropout):
    """Real DDP on CPU (gloo): same effective batch, 1 vs 2 processes (two ranks forked from this one,
    in torchrun's worker environment).

    With LoRA dropout on, each micro-batch's mask is seeded from (seed, step, micro-batch index), so
    both runs draw the same masks; what remains is the order of float sums across ranks (DDP's
    all-reduce), hence a tolerance rather than bit identity: the float32 reordering bound
    (tests/float_tolerance.py).
    """
    curves, adapters = [], []
    for processes in (1, 2):
        settings = tiny_training_settings(max_steps=5, cpu_processes=processes, checkpoint_every=100,
                                          lora={"dropout": dropout})
        out = tmp_path / f"p{processes}"
        if processes == 1:  # in this process: no launch needed
            assert train.main(train_argv(out, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
        else:
            ranks.assert_succeeded(ranks.run_stage(train.main, train_argv(out, tiny_model_dir, tiny_tokenised_dir,
                                                                          settings), timeout=180))
        assert json.loads((out / "run_manifest.json").read_text())["world_size"] == processes
        curves.append([r["loss"] for r in log_rows(out)])
        adapters.append(adapter(out))
    assert_same_curve(curves[1], curves[0], settings)
    assert_same_tensors(adapters[1], adapters[0], settings, steps=len(curves[0]))


def slow_micro_steps():
    """In a forked rank: each micro-step slowed, so the test can signal the run mid-way; the training code is
    unchanged."""
    step = training_setup.micro_step

    def slowed(*args, **kwargs):
        time.sleep(0.1)
        return step(*args, **kwargs)

    training_setup.micro_step = slowed


def start_slow_argv(argv: list[str], world_size: int = 1, local_world_size: int | None = None) -> ranks.Ranks:
    """The train stage with ``argv`` in ``world_size`` ranks forked from this process, each micro-step slowed."""
    return ranks.start_stage(train.main, argv, world_size, before=slow_micro_steps, local_world_size=local_world_size)


def start_slow(out, model_dir, data_dir, settings) -> ranks.Ranks:
    return start_slow_argv(train_argv(out, model_dir, data_dir, settings))


def wait_for(condition, process, timeout=120):
    """Until ``condition()``; fails if ``process`` (a Popen or forked ranks) ends first or time runs out."""
    deadline = time.time() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(process.communicate()[0][-3000:] if isinstance(process, ranks.Ranks)
                                 else process.stdout.read()[-3000:])
        if time.time() >= deadline:
            output = process.communicate(timeout=0)[0] if isinstance(process, ranks.Ranks) else ""
            raise AssertionError(f"timed out\n{output}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def resume_settings():
    # dropout > 0: a resumed run must restore the RNG to draw the same dropout masks.
    return tiny_training_settings(max_steps=10, checkpoint_every=2, lora={"dropout": 0.1})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir, tiny_tokenised_dir, resume_settings):
    out = tmp_path_factory.mktemp("uninterrupted")
    finish(out, tiny_model_dir, tiny_tokenised_dir, resume_settings)
    return out


def train_here(argv: list[str]) -> str:
    """The train stage with ``argv`` in this process, to its end; what it printed."""
    torch.set_num_threads(1)  # as in the forked ranks (a module fixture may run before the autouse one)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert train.main(argv) == 0
    return printed.getvalue()


def finish(out, model_dir, data_dir, settings) -> str:
    """The train stage in this process, to its end; what it printed."""
    return train_here(train_argv(out, model_dir, data_dir, settings))


def assert_same_run(out, reference):
    ours, theirs = adapter(out), adapter(reference)
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert [r["loss"] for r in log_rows(out)] == [r["loss"] for r in log_rows(reference)]


def test_killed_run_resumes_to_identical_adapter(tmp_path, tiny_model_dir, tiny_tokenised_dir, resume_settings, uninterrupted):
    process = start_slow(tmp_path, tiny_model_dir, tiny_tokenised_dir, resume_settings)
    wait_for(lambda: (tmp_path / "checkpoints" / "step-00000004" / "state.json").exists(), process)
    process.send_signal(signal.SIGKILL)  # no chance to clean up, as with an OOM kill or node failure
    process.wait()
    assert not (tmp_path / "adapter").exists()
    stdout = finish(tmp_path, tiny_model_dir, tiny_tokenised_dir, resume_settings)
    assert "resumed from" in stdout
    assert_same_run(tmp_path, uninterrupted)


def test_sigusr1_checkpoints_and_exits_for_requeue(tmp_path, tiny_model_dir, tiny_tokenised_dir, resume_settings, uninterrupted):
    process = start_slow(tmp_path, tiny_model_dir, tiny_tokenised_dir, resume_settings)
    running_log = tmp_path / "checkpoints" / "train_log.running.jsonl"
    wait_for(lambda: running_log.exists() and len(running_log.read_text().splitlines()) >= 3, process)
    process.send_signal(signal.SIGUSR1)  # SLURM's warning before a time limit (--signal=USR1@...)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == train.PREEMPTED_EXIT_CODE, output[-2000:]
    step, _ = checkpointing.checkpoints(tmp_path / "checkpoints")[-1]
    last_logged = json.loads(running_log.read_text().splitlines()[-1])["step"]
    assert 3 <= step == last_logged < resume_settings.max_steps  # checkpointed where it stopped
    assert "received SIGUSR1" in output
    finish(tmp_path, tiny_model_dir, tiny_tokenised_dir, resume_settings)
    assert_same_run(tmp_path, uninterrupted)


def test_nan_loss_stops_at_once_and_keeps_last_good_checkpoint(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    original = training_setup.build
    calls = {"n": 0}

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)

        def poison(module, inputs, output):  # the 9th forward (step 5) returns NaN logits
            calls["n"] += 1
            return output * float("nan") if calls["n"] >= 9 else output

        setup.peft_model.get_base_model().lm_head.register_forward_hook(poison)
        return setup

    monkeypatch.setattr(training_setup, "build", build)
    settings = tiny_training_settings(max_steps=8, checkpoint_every=2)
    with pytest.raises(train.NonFiniteError, match=r"step 5: the loss is nan; training stopped.*step-00000004.*Fix:"):
        train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings))
    assert [s for s, _ in checkpointing.checkpoints(tmp_path / "checkpoints")] == [4]
    good = load_file(str(tmp_path / "checkpoints" / "step-00000004" / "adapter.safetensors"))
    assert all(torch.isfinite(t).all() for t in good.values())
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "train_log.jsonl").exists()


def plant_checkpoint(out: Path, model_dir, data_dir, settings: dict, step: int = 2) -> Path:
    """A checkpoint as a preempted run with ``settings`` would have left it."""
    setup = training_setup.build(model_dir, settings, train.distributed.setup(use_cuda=False))
    fingerprint = train.run_fingerprint(settings, train.batching.read_meta(data_dir), str(model_dir), 1)
    return checkpointing.save(out / "checkpoints", step, setup.peft_model, setup.optimizer, setup.scheduler, None,
                              [checkpointing.rng_state(torch.device("cpu"))], fingerprint)


def test_finished_run_leaves_nothing_to_resume(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    settings = tiny_training_settings(max_steps=4, checkpoint_every=2)
    assert train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
    assert checkpointing.checkpoints(tmp_path / "checkpoints") == []  # a forced rerun trains afresh


def test_more_wall_time_and_other_runtime_settings_resume(tmp_path, tiny_model_dir, tiny_tokenised_dir, capsys):
    """A preempted job given more wall time, memory, workers or other intervals resumes where it stopped."""
    settings = tiny_training_settings(max_steps=4, checkpoint_every=2)
    plant_checkpoint(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)
    changed = {**settings.to_dict(), "runtime_minutes": settings.runtime_minutes * 4, "mem_mb": 128000, "log_every": 2,
               "checkpoint_every": 3, "dataloader_workers": 1, "memory_headroom": 0.8, "sanity_batches": 3,
               "signal_grace_seconds": 60}
    capsys.readouterr()
    assert train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, changed)) == 0
    assert "at step 2" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "run_manifest.json").read_text())
    assert manifest["resumed_from_step"] == 2


def test_checkpoint_of_another_experiment_stops_and_is_kept(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    settings = tiny_training_settings(max_steps=4, checkpoint_every=2)
    planted = plant_checkpoint(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)
    changed = {**settings.to_dict(), "learning_rate": settings.learning_rate / 2,
               "lora": {**settings.to_dict()["lora"], "rank": 8}}
    with pytest.raises(train.WorkflowError) as raised:
        train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, changed))
    message = str(raised.value)
    assert "\n" not in message and str(planted) in message
    assert "settings.learning_rate" in message and "settings.lora.rank" in message and "Fix:" in message
    assert planted.is_dir() and (planted / "adapter.safetensors").is_file()  # never deleted: the user decides
    assert not (tmp_path / "adapter").exists()


def test_skipped_fp16_updates_do_not_advance_the_schedule(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    """As HF Trainer: an update the scaler skipped (overflow) leaves the learning-rate schedule where it was."""
    original = training_setup.build
    overflowing_backwards = {"left": 4}  # 2 micro-batches per step: the first two steps overflow

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)
        name, param = next((n, p) for n, p in setup.peft_model.named_parameters() if "lora_B" in n)

        def overflow(grad):
            if overflowing_backwards["left"] > 0:
                overflowing_backwards["left"] -= 1
                return torch.full_like(grad, float("inf"))
            return grad
        param.register_hook(overflow)
        return setup

    monkeypatch.setattr(training_setup, "build", build)
    settings = tiny_training_settings(max_steps=6, precision="fp16", warmup_steps=4, lr_scheduler="linear",
                                      learning_rate=1e-2, checkpoint_every=100)
    assert train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
    rows = log_rows(tmp_path)
    assert [r["update_skipped"] for r in rows] == [True, True, False, False, False, False]
    # Warm-up 0, 1/4, 2/4, 3/4 of the peak: the schedule starts moving at the first real update (step 3).
    assert [r["learning_rate"] for r in rows] == pytest.approx([0.0, 0.0, 0.0, 2.5e-3, 5e-3, 7.5e-3])
    assert json.loads((tmp_path / "run_manifest.json").read_text())["skipped_updates"] == 2


def test_bad_training_json_is_one_clear_error(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    from workflow_scripts.core.errors import ConfigError

    settings = tiny_training_settings().to_dict()
    settings["micro_batch"] = 3
    with pytest.raises(ConfigError, match="effective_batch.*not a multiple of micro_batch"):
        train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings))
    settings["micro_batch"] = "four"
    with pytest.raises(ConfigError, match="training.micro_batch"):
        train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings))
    assert not any(tmp_path.iterdir())


def test_nan_gradient_stops_before_the_update(monkeypatch, tmp_path, tiny_model_dir, tiny_tokenised_dir):
    original = training_setup.build

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)
        name, param = next((n, p) for n, p in setup.peft_model.named_parameters() if "lora_B" in n)
        param.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        return setup

    monkeypatch.setattr(training_setup, "build", build)
    with pytest.raises(train.NonFiniteError, match=r"step 1: the gradient norm is nan.*Last good checkpoint: none"):
        train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, tiny_training_settings(max_steps=3)))
    assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, tiny_model_dir, tiny_tokenised_dir, precision):
    settings = tiny_training_settings(max_steps=3, precision=precision, checkpoint_every=2)
    assert train.main(train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log_rows(tmp_path))
    assert all(t.dtype == torch.float32 for t in adapter(tmp_path).values())  # fp32 adapters, autocast compute


def test_packed_training_follows_the_unpacked_loss_curve(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    """training.packing packs each micro-batch's rows (block-diagonal attention, restarting positions):
    the same examples, the same loss per step and the same adapter, up to float summation order."""
    curves, adapters = [], []
    for packing in (False, True):
        out = tmp_path / f"packing-{packing}"
        settings = tiny_training_settings(max_steps=4, checkpoint_every=100, packing=packing, max_length=64)
        assert train.main(train_argv(out, tiny_model_dir, tiny_tokenised_dir, settings)) == 0
        curves.append([r["loss"] for r in log_rows(out)])
        adapters.append(adapter(out))
        if packing:
            assert max(r["padding_share"] for r in log_rows(out)) < max(r["padding_share"] for r in log_rows(tmp_path / "packing-False"))
    assert_same_curve(curves[1], curves[0], settings)  # float32 reordering bound (tests/float_tolerance.py)
    assert_same_tensors(adapters[1], adapters[0], settings, steps=len(curves[0]))
