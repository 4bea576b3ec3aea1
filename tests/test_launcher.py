"""The launcher: concurrent torchrun jobs on disjoint (simulated) GPUs with their own rendezvous
ports, signal forwarding to the workers, and the multi-node srun/torchrun command."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workflow_scripts.launch import device_leases, launcher
from workflow_scripts.core.errors import WorkflowError

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

LAUNCH = "import sys; from workflow_scripts.launch import launcher; sys.exit(launcher.launch('launcher_probe', sys.argv[2:], int(sys.argv[1]), 1))"


@pytest.fixture
def simulated_gpus(tmp_path, monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return {**os.environ, device_leases.GPU_IDS_ENV: "0,1,2,3", device_leases.LEASE_DIR_ENV: str(tmp_path / "leases"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "OMP_NUM_THREADS": "1"}


def start_job(env, reports: Path, name: str, gpus: int, peers: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LAUNCH, str(gpus), str(reports), name, str(peers)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, seconds: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"job exited with {process.returncode}:\n{process.stdout.read()}")
        assert time.monotonic() < deadline, f"{path.name} did not appear within {seconds} s"
        time.sleep(0.1)


def test_two_concurrent_jobs_get_disjoint_gpus_and_their_own_rendezvous(simulated_gpus, tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    jobs = {name: start_job(simulated_gpus, reports, name, gpus=2, peers=1) for name in ("a", "b")}
    for name, process in jobs.items():
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, output
    seen = {name: [json.loads((reports / f"{name}-rank{r}.json").read_text()) for r in (0, 1)] for name in jobs}
    for name, ranks in seen.items():
        assert [r["world_size"] for r in ranks] == [2, 2]
        assert [r["all_reduce"] for r in ranks] == [3.0, 3.0]  # 1 + 2: both ranks met in one group
        assert ranks[0]["cuda_visible_devices"] == ranks[1]["cuda_visible_devices"]
    devices = {name: set(ranks[0]["cuda_visible_devices"].split(",")) for name, ranks in seen.items()}
    assert len(devices["a"]) == len(devices["b"]) == 2 and not devices["a"] & devices["b"]
    ports = {name: ranks[0]["master_port"] for name, ranks in seen.items()}
    assert ports["a"] != ports["b"] and "29500" not in ports.values()


def test_a_signal_reaches_the_workers_and_killing_the_launcher_frees_its_gpus(simulated_gpus, tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "sig.hold").touch()
    process = start_job(simulated_gpus, reports, "sig", gpus=2, peers=0)
    for rank in (0, 1):
        wait_for(reports / f"sig-rank{rank}.json", 120, process)
    process.send_signal(signal.SIGUSR1)  # SLURM's "time is nearly up": only the launcher gets it here
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0, output
    assert {(reports / f"sig-rank{r}.signal").read_text() for r in (0, 1)} == {"SIGUSR1"}

    (reports / "kill.hold").touch()
    process = start_job(simulated_gpus, reports, "kill", gpus=4, peers=0)
    wait_for(reports / "kill-rank0.json", 120, process)
    process.kill()  # torchrun dies with it (PDEATHSIG) and the leases go with the last descriptor
    process.wait()
    environ = {device_leases.GPU_IDS_ENV: "0,1,2,3", device_leases.LEASE_DIR_ENV: simulated_gpus[device_leases.LEASE_DIR_ENV]}
    lease = device_leases.acquire(4, timeout=60, environ=environ)
    assert sorted(lease.gpu_ids) == ["0", "1", "2", "3"]
    device_leases.release(lease)


# torch 2.11's torchrun (the GPU image's, the oldest supported) has no --shutdown-timeout: the launcher leaves the
# option out there and torchrun's own 30 s grace applies (tests/test_gpu_image_versions.py).
needs_shutdown_timeout = pytest.mark.skipif(not launcher.torchrun_has_shutdown_timeout(),
                                            reason="this torchrun has no --shutdown-timeout (torch 2.11)")


@needs_shutdown_timeout
@pytest.mark.parametrize("grace, survives", [(2, False), (20, True)])
def test_torchrun_gives_a_signalled_checkpoint_the_configured_grace(simulated_gpus, tmp_path, grace, survives):
    # A 6 s checkpoint after SIGUSR1: killed under a 2 s grace, finished under 20 s. Before the launcher passed
    # --shutdown-timeout, torchrun's own 30 s applied whatever the setting (issue 23, point 4).
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "slow.hold").touch()
    launch = ("import sys; from workflow_scripts.launch import launcher; "
              f"sys.exit(launcher.launch('launcher_probe', sys.argv[1:], 0, 2, grace_seconds={grace}))")
    process = subprocess.Popen([sys.executable, "-c", launch, str(reports), "slow", "0"], cwd=ROOT,
                               env={**simulated_gpus, "PROBE_CHECKPOINT_SECONDS": "6"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for rank in (0, 1):
        wait_for(reports / f"slow-rank{rank}.json", 120, process)
    process.send_signal(signal.SIGUSR1)
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0, output
    written = [(reports / f"slow-rank{r}.signal").exists() for r in (0, 1)]
    assert written == [survives, survives], output[-3000:]


# What the Snakefile does in a SLURM job step, then what the rule's shell and the training do there.
_WARNED_JOB_STEP = """
import os, signal, subprocess, sys
from workflow_scripts.launch import launcher
print("ignoring:", launcher.ignore_scheduler_warning_in_job(os.environ), flush=True)
os.kill(os.getpid(), signal.SIGUSR1)
subprocess.run(["bash", "-c", "kill -USR1 $$; echo shell alive"], check=True)
trainer = "import os, signal; got = []; signal.signal(signal.SIGUSR1, lambda *_: got.append(1)); " \\
          "os.kill(os.getpid(), signal.SIGUSR1); print('trainer handled', len(got))"
subprocess.run([sys.executable, "-c", trainer], check=True)
"""


@pytest.mark.parametrize("in_slurm_job", [True, False])
def test_in_a_slurm_job_snakemake_and_the_rules_shell_outlive_the_warning_signal(in_slurm_job):
    # SLURM's --signal=USR1@300 reaches every process of the job step (issue 23, point 5)
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    if in_slurm_job:
        env["SLURM_JOB_ID"] = "42"
    done = subprocess.run([sys.executable, "-c", _WARNED_JOB_STEP], env=env, capture_output=True, text=True,
                          timeout=120)
    if in_slurm_job:
        assert done.returncode == 0, done.stderr
        # the training still gets the signal: its own handler replaces the inherited "ignore"
        assert done.stdout.split("\n")[:3] == ["ignoring: True", "shell alive", "trainer handled 1"], done.stdout
    else:  # outside SLURM nothing changes: the signal's default action ends the process
        assert done.returncode == -signal.SIGUSR1 and done.stdout == "ignoring: False\n", (done.returncode, done.stdout)


@needs_shutdown_timeout
def test_the_grace_comes_from_the_training_settings(monkeypatch):
    from conftest import tiny_training_settings

    seen = {}
    monkeypatch.setattr(launcher, "launch", lambda *args, **kwargs: seen.update(args=args) or 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    launcher.run_here_or_launch("m", [], tiny_training_settings(cpu_processes=2, signal_grace_seconds=123), lambda: 1)
    assert seen["args"][-1] == 123
    command = launcher.torchrun_command("m", [], nproc=2)
    assert command[command.index("--shutdown-timeout") + 1] == "270"  # the schema's default, inside USR1@300


def test_torchrun_command_uses_the_leased_port_and_forwards_slurm_signals():
    command = launcher.torchrun_command("workflow_scripts.train", ["--seed", "1"], nproc=4, rendezvous_port=41234)
    assert command[command.index("--rdzv-endpoint") + 1] == "127.0.0.1:41234"
    assert "SIGUSR1" in command[command.index("--signals-to-handle") + 1].split(",")
    assert command[-4:] == ["-m", "workflow_scripts.train", "--seed", "1"]


@pytest.mark.parametrize("nodelist, hosts", [
    ("node07", ["node07"]),
    ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
    ("gpu[1,3-4],login2", ["gpu1", "gpu3", "gpu4", "login2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a[098-101].cluster", ["a098.cluster", "a099.cluster", "a100.cluster", "a101.cluster"]),
])
def test_parse_hostlist_expands_like_scontrol(nodelist, hosts):
    assert launcher.parse_hostlist(nodelist) == hosts


def test_parse_hostlist_names_a_list_it_cannot_read():
    with pytest.raises(WorkflowError, match=r"gpu\[a-b\]"):
        launcher.parse_hostlist("gpu[a-b]")


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """An scontrol that knows one job (the jobstep executor strips SLURM_JOB_NODELIST from rules)."""
    script = tmp_path / "bin" / "scontrol"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n"
                      "if [ \"$2\" = hostnames ]; then printf 'gpu07\\ngpu08\\n'; exit 0; fi\n"
                      "echo 'JobId=4242 JobName=x NodeList=gpu[07-08] NumNodes=2 CPUs/Task=16 TRES=cpu=32'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")


def test_multinode_command_from_the_allocation(fake_scontrol):
    command = launcher.multinode_command("workflow_scripts.train", ["--seed", "3"], gpus=8, cpu_processes=1,
                                         nodes=2, rendezvous_port=40123, environ={"SLURM_JOB_ID": "4242"})
    torchrun = command.index("torch.distributed.run")
    assert command[:torchrun - 2] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                                      "--kill-on-bad-exit=1", "--gpus-per-node=8", "--cpus-per-task=16"]
    assert command[torchrun - 2:torchrun] == [sys.executable, "-m"]
    args = command[torchrun + 1:]
    assert args[:10] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "gpu07:40123", "--rdzv-id", "4242"]
    assert args[-4:] == ["-m", "workflow_scripts.train", "--seed", "3"]


def test_multinode_command_prefers_the_environment_and_falls_back_to_the_parser(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol at all
    environ = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "cn[3-4]", "SLURM_CPUS_PER_TASK": "4"}
    command = launcher.multinode_command("m", [], gpus=0, cpu_processes=2, nodes=2, rendezvous_port=1234, environ=environ)
    assert "--gpus-per-node" not in " ".join(command)
    assert command[command.index("--rdzv-endpoint") + 1] == "cn3:1234"
    assert command[command.index("--nproc-per-node") + 1] == "2"


def test_multinode_needs_slurm_and_the_node_count_it_declared(fake_scontrol):
    with pytest.raises(WorkflowError, match="needs a SLURM allocation"):
        launcher.multinode_command("m", [], 8, 1, 2, 1234, environ={})
    with pytest.raises(WorkflowError, match="training.nodes is 4 but SLURM job 4242 holds 2 node"):
        launcher.multinode_command("m", [], 8, 1, 4, 1234, environ={"SLURM_JOB_ID": "4242"})


def test_needs_launch():
    assert not launcher.needs_launch(0, 1, 1)
    assert launcher.needs_launch(1, 1, 1) and launcher.needs_launch(0, 2, 1) and launcher.needs_launch(0, 1, 2)


def test_the_launcher_hands_the_stage_start_to_torchrun(monkeypatch, tmp_path):
    """A stage's start-up (train_log's seconds_from_stage_start) counts from the launcher's own start,
    not the worker's: torchrun's start and the worker's imports are part of what the stage costs."""
    import psutil

    started: dict = {}
    monkeypatch.setenv("LORA_WORKFLOW_LEASE_DIR", str(tmp_path / "leases"))
    monkeypatch.delenv(launcher.STAGE_STARTED_VARIABLE, raising=False)
    monkeypatch.setattr(launcher, "run_forwarding_signals",
                        lambda command, env, fds=(): started.setdefault("at", env[launcher.STAGE_STARTED_VARIABLE]) and 0)
    assert launcher.launch("workflow_scripts.train", [], gpus=0, cpu_processes=2) == 0
    assert float(started["at"]) == pytest.approx(psutil.Process().create_time())
    monkeypatch.setenv(launcher.STAGE_STARTED_VARIABLE, "1234.5")  # a harness timing an in-process call says when
    started.clear()
    assert launcher.launch("workflow_scripts.train", [], gpus=0, cpu_processes=2) == 0
    assert started["at"] == "1234.5" and launcher.stage_started_at() == 1234.5
