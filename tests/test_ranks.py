"""tests/ranks.py, the forked-ranks harness the distributed tests use: torchrun's worker environment, every
rank's exit code and output, a hung rank killed at the timeout (the test fails instead of hanging), and no
fork while a process group runs in the test process."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ranks
from workflow_scripts.launch import launcher
from workflow_scripts.training import distributed


def _report_environment():
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    print({name: os.environ[name] for name in names}, launcher.is_worker(), torch.get_num_threads())


def test_each_rank_gets_torchruns_worker_environment():
    results = ranks.run(_report_environment, world_size=4, local_world_size=2, timeout=60)
    ranks.assert_succeeded(results)
    for result in results:
        expected = {"RANK": str(result.rank), "LOCAL_RANK": str(result.rank % 2), "WORLD_SIZE": "4",
                    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        assert f"{expected} True 1" in result.output  # a worker, one intra-op thread


def _all_reduce_ranks():
    context = distributed.setup(use_cuda=False, timeout_minutes=1)
    total = distributed.all_reduce_sum(torch.tensor([context.rank + 1.0]), context)
    print(f"rank {context.rank} of {context.world_size}: {total.item()}")
    distributed.teardown(context)


def test_the_ranks_start_a_gloo_group_as_under_torchrun():
    results = ranks.run(_all_reduce_ranks, timeout=120)
    ranks.assert_succeeded(results)
    assert [r.output.strip().splitlines()[-1] for r in results] == ["rank 0 of 2: 3.0", "rank 1 of 2: 3.0"]


def _rank_one_fails():
    if os.environ["RANK"] == "1":
        raise ValueError("planted failure on rank 1")
    return 0


def test_a_failing_rank_gives_its_exit_code_and_traceback():
    results = ranks.run(_rank_one_fails, timeout=60)
    assert [r.exit_code for r in results] == [0, 1]
    assert "ValueError: planted failure on rank 1" in results[1].output
    with pytest.raises(AssertionError, match="planted failure on rank 1"):
        ranks.assert_succeeded(results)


def _hang():
    print("rank waiting for ever", flush=True)
    time.sleep(600)


def test_a_hung_rank_is_killed_at_the_timeout_and_the_test_fails_with_its_output():
    started = time.monotonic()
    job = ranks.start(_hang)
    with pytest.raises(AssertionError, match=r"did not finish within 2 s(.|\n)*rank waiting for ever"):
        job.wait(timeout=2)
    assert time.monotonic() - started < 30
    for pid in job.pids:  # killed and reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_a_signal_reaches_every_rank():
    job = ranks.start(_hang)
    time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == -signal.SIGTERM


def test_no_fork_while_a_process_group_runs_here(tmp_path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="a process group runs in the test process"):
            ranks.start(_hang)
    finally:
        dist.destroy_process_group()
