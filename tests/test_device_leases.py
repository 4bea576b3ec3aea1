"""GPU and port leases for concurrent local jobs, on a simulated 8-GPU machine (no GPU needed).

Each "job" is a real process that leases GPUs through workflow_scripts.launch.device_leases, reports
what it got, and holds the lease until told to exit (or until it is killed).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workflow_scripts.launch import device_leases
from workflow_scripts.core.errors import WorkflowError

ROOT = Path(__file__).resolve().parent.parent
EIGHT_GPUS = "0,1,2,3,4,5,6,7"

JOB = r"""
import json, os, sys, time
from pathlib import Path
from workflow_scripts.launch import device_leases
gpus, report, release, timeout = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
lease = device_leases.acquire(gpus, label=report.name, timeout=timeout)
report.write_text(json.dumps({"pid": os.getpid(), "gpus": lease.gpu_ids, "port": lease.port,
                              "env": lease.environment()}))
while not release.exists():
    time.sleep(0.05)
"""


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A simulated 8-GPU machine with its own lease directory, for this process and its children."""
    for name in ("SLURM_JOB_ID", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(device_leases.GPU_IDS_ENV, EIGHT_GPUS)
    monkeypatch.setenv(device_leases.LEASE_DIR_ENV, str(tmp_path / "leases"))
    return tmp_path


class Jobs:
    def __init__(self, root: Path):
        self.root, self.processes = root, {}

    def start(self, name: str, gpus: int, timeout: float = 60.0) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", JOB, str(gpus), str(self.root / f"{name}.json"), str(self.root / f"{name}.release"),
             str(timeout)],
            cwd=ROOT, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.processes[name] = process
        return process

    def lease(self, name: str, within: float = 30.0) -> dict:
        report, deadline = self.root / f"{name}.json", time.monotonic() + within
        while time.monotonic() < deadline:
            if report.exists() and report.stat().st_size:
                return json.loads(report.read_text())
            if self.processes[name].poll() is not None:
                raise AssertionError(f"job {name} exited: {self.processes[name].stderr.read()}")
            time.sleep(0.05)
        raise AssertionError(f"job {name} got no lease within {within} s")

    def finish(self, name: str) -> None:
        (self.root / f"{name}.release").touch()
        assert self.processes[name].wait(timeout=30) == 0

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def jobs(machine):
    running = Jobs(machine)
    yield running
    running.stop_all()


def test_concurrent_jobs_get_disjoint_gpus_and_distinct_ports(jobs):
    for name in "abcd":
        jobs.start(name, gpus=2)
    leases = {name: jobs.lease(name) for name in "abcd"}
    gpu_sets = [set(lease["gpus"]) for lease in leases.values()]
    assert all(len(s) == 2 for s in gpu_sets)
    assert set().union(*gpu_sets) == set(EIGHT_GPUS.split(","))  # four 2-GPU jobs fill the 8 GPUs, no overlap
    assert len({lease["port"] for lease in leases.values()}) == 4
    assert all(lease["port"] != 29500 for lease in leases.values())
    for lease in leases.values():
        assert lease["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(lease["gpus"])
        assert lease["env"]["MASTER_PORT"] == str(lease["port"])


def test_a_job_waits_for_gpus_and_gets_those_a_killed_job_released(jobs):
    for name in "abcd":
        jobs.start(name, gpus=2)
    leases = {name: jobs.lease(name) for name in "abcd"}
    jobs.start("waiting", gpus=2, timeout=60)
    time.sleep(1.0)
    assert not (jobs.root / "waiting.json").exists(), "a job got GPUs while all eight were leased"
    os.kill(leases["b"]["pid"], signal.SIGKILL)  # no clean-up runs: the kernel must drop the flocks
    assert set(jobs.lease("waiting")["gpus"]) == set(leases["b"]["gpus"])


def test_normal_exit_releases_the_lease(jobs):
    jobs.start("a", gpus=8)
    first = jobs.lease("a")
    jobs.finish("a")
    jobs.start("b", gpus=8)
    assert sorted(jobs.lease("b")["gpus"]) == sorted(first["gpus"])


def test_waiting_gives_up_with_a_message_naming_the_holders(jobs):
    jobs.start("holder", gpus=7)
    holder = jobs.lease("holder")
    with pytest.raises(WorkflowError) as caught:
        device_leases.acquire(2, label="late job", timeout=0.5)
    message = str(caught.value)
    assert "2 free GPUs" in message and "only 1 were free" in message
    assert f"pid {holder['pid']}" in message and device_leases.TIMEOUT_ENV in message


def test_more_gpus_than_the_machine_has_fails_at_once(machine):
    started = time.monotonic()
    with pytest.raises(WorkflowError, match="declares 9 GPUs but this machine has 8"):
        device_leases.acquire(9, timeout=30)
    assert time.monotonic() - started < 5


def test_a_cpu_job_sees_no_gpu_but_gets_its_own_port(machine):
    first, second = device_leases.acquire(0), device_leases.acquire(0)
    try:
        assert first.environment()["CUDA_VISIBLE_DEVICES"] == ""
        assert first.port != second.port
    finally:
        device_leases.release(first)
        device_leases.release(second)


def test_the_users_cuda_visible_devices_narrows_the_pool(machine, monkeypatch):
    monkeypatch.delenv(device_leases.GPU_IDS_ENV)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    lease = device_leases.acquire(2)
    try:
        assert sorted(lease.gpu_ids) == ["5", "6"]
        with pytest.raises(WorkflowError, match="declares 3 GPUs but this machine has 2"):
            device_leases.acquire(3)
    finally:
        device_leases.release(lease)


def test_a_slurm_allocation_is_left_as_slurm_set_it(machine, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    # Another local job holding GPUs 3 and 5 must not matter: SLURM gave these to this job.
    other = device_leases.acquire(2, environ={device_leases.GPU_IDS_ENV: "3,5",
                                              device_leases.LEASE_DIR_ENV: os.environ[device_leases.LEASE_DIR_ENV]})
    lease = device_leases.acquire(2, timeout=0.5)
    try:
        assert lease.gpu_ids is None
        assert "CUDA_VISIBLE_DEVICES" not in lease.environment()
    finally:
        device_leases.release(lease)
        device_leases.release(other)


def test_jobs_inside_a_larger_allocation_share_it_disjointly(machine, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_GPUS", "4,5,6,7")
    first, second = device_leases.acquire(2), device_leases.acquire(2)
    try:
        assert set(first.gpu_ids) | set(second.gpu_ids) == {"4", "5", "6", "7"}
        assert not set(first.gpu_ids) & set(second.gpu_ids)
        with pytest.raises(WorkflowError):
            device_leases.acquire(1, timeout=0.3)
    finally:
        device_leases.release(first)
        device_leases.release(second)
