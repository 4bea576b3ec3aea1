"""tests/job_zygote.py: a job forked from the pre-loaded interpreter behaves as `python -m` run afresh (its
arguments, working directory, environment, standard streams, exit code, signals), and it is really forked."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import job_zygote

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def shim():
    folder = job_zygote.start()
    if folder is None:
        pytest.skip("the zygote is off here (LORA_WORKFLOW_FRESH_JOBS=1, or no fork)")
    deadline = time.monotonic() + 180
    while not (folder / "socket").exists():
        assert time.monotonic() < deadline, "the zygote did not start listening"
        time.sleep(0.1)
    return folder / "python"


def environment(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(TESTS), "PROBE_MARKER": "m1",
            job_zygote.MODULES_VARIABLE: "zygote_probe", job_zygote.SOCKET_VARIABLE: str(job_zygote.start() / "socket"),
            **extra}


def run(python, *args, cwd, env, input_text=""):
    return subprocess.run([str(python), "-m", "zygote_probe", *args], cwd=cwd, env=env, input=input_text,
                          capture_output=True, text=True, timeout=120)


def test_a_served_job_sees_what_a_fresh_interpreter_sees(shim, tmp_path):
    served = run(shim, "echo", "--flag", "a b", cwd=tmp_path, env=environment(), input_text="from stdin")
    fresh = run(sys.executable, "echo", "--flag", "a b", cwd=tmp_path, env=environment(), input_text="from stdin")
    assert served.returncode == fresh.returncode == 0, served.stderr
    got, expected = json.loads(served.stdout), json.loads(fresh.stdout)
    for key in ("argv", "cwd", "marker", "stdin", "name"):
        assert got[key] == expected[key], key
    assert got["torch_loaded"] and not expected["torch_loaded"]  # forked from the pre-loaded interpreter
    assert served.stderr == fresh.stderr == "to stderr\n"


@pytest.mark.parametrize("action, code", [("exit", 5), ("raise", 1)])
def test_exit_codes_and_tracebacks_are_the_jobs(shim, tmp_path, action, code):
    args = (action, str(code)) if action == "exit" else (action,)
    served = run(shim, *args, cwd=tmp_path, env=environment())
    fresh = run(sys.executable, *args, cwd=tmp_path, env=environment())
    assert served.returncode == fresh.returncode == code
    assert served.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]


def test_a_job_killed_by_a_signal_ends_its_shim_by_that_signal(shim, tmp_path):
    assert run(shim, "kill_self", cwd=tmp_path, env=environment()).returncode == -signal.SIGKILL


def test_sigterm_to_the_shim_reaches_the_job(shim, tmp_path):
    marker = tmp_path / "terminated"
    process = subprocess.Popen([str(shim), "-m", "zygote_probe", "wait", str(marker)], cwd=tmp_path,
                               env=environment(), stdout=subprocess.PIPE, text=True)
    json.loads(process.stdout.readline())  # it is running
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 7 and marker.read_text() == "terminated"


def test_a_killed_shim_takes_its_job_with_it(shim, tmp_path):
    process = subprocess.Popen([str(shim), "-m", "zygote_probe", "wait", str(tmp_path / "x")], cwd=tmp_path,
                               env=environment(), stdout=subprocess.PIPE, text=True)
    job = json.loads(process.stdout.readline())["pid"]
    assert job != process.pid
    process.kill()
    process.wait(timeout=60)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{job}").exists() and "Z" not in Path(f"/proc/{job}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "the job outlived its shim"
        time.sleep(0.05)


def test_an_import_time_variable_that_differs_gets_a_fresh_interpreter(shim, tmp_path):
    served = run(shim, "exit", "0", cwd=tmp_path, env=environment(HF_HOME=str(tmp_path / "hf")))
    report = json.loads(served.stdout)
    assert served.returncode == 0 and not report["torch_loaded"]
