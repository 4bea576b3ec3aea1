"""Work rank 0 does alone (checkpoints, outputs, the validation metric, the tracker) while the other ranks
wait: a slow rank 0 must not trip the collective timeout, and a failing one must stop every rank with its
message (issue 23, point 6). Two gloo processes; the planted slowness or failure comes in through a
sitecustomize module on the workers' PYTHONPATH, and the collective timeout is shortened there too."""
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import tiny_training_settings
from test_train import REPO, log_rows, subprocess_env, train_argv
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.training import distributed

# Only in torchrun's workers (RANK set): shorten the process group's timeout on every rank, and make one
# function slow or failing on rank 0.
PLANT = '''
import os
if os.environ.get("RANK") is not None and os.environ.get("PLANTED_FUNCTION"):
    import importlib
    import time

    from workflow_scripts.training import distributed

    distributed.setup.__defaults__ = (float(os.environ["PLANTED_COLLECTIVE_TIMEOUT_MINUTES"]),)
    module_name, name = os.environ["PLANTED_FUNCTION"].rsplit(".", 1)
    module = importlib.import_module(module_name)
    original = getattr(module, name)

    def planted(*args, **kwargs):
        if os.environ["RANK"] == "0":
            if os.environ["PLANTED_FAILURE"] == "slow":
                time.sleep(float(os.environ["PLANTED_SECONDS"]))
            else:
                raise OSError(28, "No space left on device")
        return original(*args, **kwargs)

    setattr(module, name, planted)
'''
# A rank-zero write 2.5 times the collective timeout; the timeout still leaves the ranks' start-up some slack.
TIMEOUT_SECONDS, SLOW_SECONDS = 6, 15


def run_two_processes(tmp_path, model_dir, data_dir, function, failure, **settings):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PLANT)
    env = dict(subprocess_env(), PYTHONPATH=f"{site}{os.pathsep}{REPO}", PLANTED_FUNCTION=function,
               PLANTED_FAILURE=failure, PLANTED_SECONDS=str(SLOW_SECONDS),
               PLANTED_COLLECTIVE_TIMEOUT_MINUTES=str(TIMEOUT_SECONDS / 60))
    training = tiny_training_settings(cpu_processes=2, **settings)
    out = tmp_path / "run"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "workflow_scripts.train",
                             *train_argv(out, model_dir, data_dir, training)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    return result, result.stdout + result.stderr, out, time.monotonic() - started


def test_a_rank_zero_write_longer_than_the_collective_timeout_finishes(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    # The periodic checkpoint (the whole model under finetune: full): rank 1 used to wait in a barrier under the
    # (here 6 s) collective timeout. The output at the end, the best adapter, the metric and the tracker wait
    # through the same distributed.on_main (the failure test below goes through the end's). One checkpoint, at
    # step 2, with a step after it: training goes on after the long wait.
    result, output, out, elapsed = run_two_processes(tmp_path, tiny_model_dir, tiny_tokenised_dir,
                                                     "workflow_scripts.training.checkpointing.save", "slow",
                                                     max_steps=3, checkpoint_every=2)
    assert result.returncode == 0, output[-3000:]
    assert [r["step"] for r in log_rows(out)] == [1, 2, 3] and (out / "adapter").is_dir()
    assert elapsed > SLOW_SECONDS  # the planted write did run


def test_a_rank_zero_failure_stops_every_rank_with_its_message(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    result, output, out, _ = run_two_processes(
        tmp_path, tiny_model_dir, tiny_tokenised_dir, "workflow_scripts.model.model_loading.save_adapter", "fail",
        max_steps=2, checkpoint_every=100)
    assert result.returncode != 0
    assert ("rank 1 stops: rank 0 failed while writing the adapter, training log and manifest: OSError: "
            "[Errno 28] No space left on device") in output, output[-3000:]
    assert not (out / "adapter").exists() and not (out / "run_manifest.json").exists()


# --- on_main and gather_on_main themselves, two gloo processes without a model ---

def _two_ranks(rank, port, failure, results, work_of, call):
    """One of two gloo ranks whose collectives time out after 2 s: ``call(context, work)`` with this rank's
    work, its outcome (or its error) in ``results[rank]``; the group must still work afterwards."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    context = distributed.setup(use_cuda=False, timeout_minutes=2 / 60)
    try:
        try:
            results[rank] = ("done", call(context, work_of(rank, failure)))
        except (WorkflowError, OSError) as error:
            results[rank] = ("failed", f"{type(error).__name__}: {error}")
        dist.all_reduce(torch.ones(1))  # the process group is still usable afterwards
    finally:
        distributed.teardown(context)


def _run_two_ranks(failure, work_of, call) -> dict:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_two_ranks, args=(port, failure, results, work_of, call), nprocs=2, join=True)
    return results


def _scoring(rank, failure):
    def work():
        time.sleep(5)  # longer than the collective timeout
        if failure:
            raise OSError(28, "No space left on device")
        return {"score": 0.5}
    return work


def _share_scoring(context, work):
    return distributed.on_main(context, "scoring", work, share_result=True)


@pytest.mark.parametrize("failure", [False, True])
def test_on_main_waits_past_the_collective_timeout_and_shares_the_outcome(failure):
    results = _run_two_ranks(failure, _scoring, _share_scoring)
    if failure:
        assert results[0] == ("failed", "OSError: [Errno 28] No space left on device")
        assert results[1] == ("failed", "WorkflowError: rank 1 stops: rank 0 failed while scoring: "
                                        "OSError: [Errno 28] No space left on device")
    else:
        assert results[0] == results[1] == ("done", {"score": 0.5})


# --- gather_on_main: work split over the ranks (the validation metric's generation) ---

def _generating(rank, failure):
    def work():
        if rank == 1:
            time.sleep(5)  # rank 0 waits longer than the collective timeout
            if failure:
                raise OSError(12, "Cannot allocate memory")
        return [f"prediction of rank {rank}"]
    return work


def _gather_generating(context, work):
    return distributed.gather_on_main(context, "generating", work)


@pytest.mark.parametrize("failure", [False, True])
def test_gather_on_main_waits_past_the_collective_timeout_and_stops_every_rank_on_a_failure(failure):
    results = _run_two_ranks(failure, _generating, _gather_generating)
    if failure:
        assert results[1] == ("failed", "OSError: [Errno 12] Cannot allocate memory")
        assert results[0] == ("failed", "WorkflowError: rank 0 stops: rank 1 failed while generating: "
                                        "OSError: [Errno 12] Cannot allocate memory")
    else:  # rank 0 holds every rank's result in rank order; the others None
        assert results[0] == ("done", [["prediction of rank 0"], ["prediction of rank 1"]])
        assert results[1] == ("done", None)
