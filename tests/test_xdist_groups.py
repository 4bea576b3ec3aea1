"""`make test` runs two pytest-xdist workers: tests/conftest.py keeps together what must share a worker.

The whole-workflow runs form two groups that start first, side by side on two workers, each running its
tests one after another: the real-SLURM tests (one cluster per machine) and the local Snakemake runs; tests
using a module-scoped fixture stay with their module (the fixture is built once); the rest are free. Collected in a child pytest that sees itself as an xdist worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import GROUPS_FILE_VARIABLE

ROOT = Path(__file__).resolve().parent.parent

COLLECT = """
import json, sys, pytest
class Groups:
    def pytest_collection_finish(self, session):
        marks = [(item.nodeid, [m.args[0] for m in item.iter_markers("xdist_group")]) for item in session.items]
        print("GROUPS=" + json.dumps(marks))
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Groups()]))
"""

FILES = ["tests/test_launcher.py", "tests/test_bad_inputs.py", "tests/test_slurm.py", "tests/test_workflow_e2e.py"]


def outside_this_run(**extra: str) -> dict:
    """This environment without what marks this test run's xdist worker and its controller's groups file: the
    child pytest is a run of its own (run under `make test`, it would otherwise take itself for a worker)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_") and k != GROUPS_FILE_VARIABLE}
    return {**env, **extra}


def collected_groups(env_extra: dict) -> list[tuple[str, list[str]]]:
    env = outside_this_run(**env_extra)
    result = subprocess.run([sys.executable, "-c", COLLECT, *FILES], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("GROUPS="))
    return [tuple(pair) for pair in json.loads(line.removeprefix("GROUPS="))]


def test_whole_workflow_runs_form_a_slurm_and_a_snakemake_group_that_come_first_and_module_fixtures_keep_their_module():
    items = collected_groups({"PYTEST_XDIST_WORKER": "gw0"})
    groups = dict(items)
    by_group = {group: [nodeid for nodeid, marks in items if marks == [group]] for group in ("slurm_cluster", "snakemake_runs")}
    assert {nodeid.split("::")[0] for nodeid in by_group["slurm_cluster"]} == {"tests/test_slurm.py"}
    assert {nodeid.split("::")[0] for nodeid in by_group["snakemake_runs"]} == {"tests/test_workflow_e2e.py"}
    assert all(groups[n] == ["slurm_cluster"] for n in groups if n.startswith("tests/test_slurm.py"))
    assert all(groups[n] == ["snakemake_runs"] for n in groups if n.startswith("tests/test_workflow_e2e.py"))
    # The two serial groups head the queue, one after the other (make test keeps this order with
    # --no-loadscope-reorder): the scheduler hands them to two workers at the start.
    serial = by_group["slurm_cluster"] + by_group["snakemake_runs"]
    assert [nodeid for nodeid, _ in items[: len(serial)]] == serial
    # test_bad_inputs' module fixture `shared`: every test using it stays on one worker.
    bad_inputs = [marks for nodeid, marks in items if nodeid.startswith("tests/test_bad_inputs.py")]
    assert ["test_bad_inputs"] in bad_inputs
    assert all(marks in ([], ["test_bad_inputs"]) for marks in bad_inputs)
    # The launcher's tests share no module fixture: free to run on either worker.
    assert any(nodeid.startswith("tests/test_launcher.py") and not marks for nodeid, marks in items)


def test_make_test_runs_two_workers_that_honour_the_groups():
    makefile = (ROOT / "Makefile").read_text()
    assert "PYTEST_WORKERS ?= 2" in makefile
    assert "--dist loadgroup --no-loadscope-reorder" in makefile
    test_recipe = makefile.split("\ntest: install\n", 1)[1].split("\n\n", 1)[0]
    assert "$(XDIST)" in test_recipe and "--durations" in test_recipe


PROBE_TESTS = '''
import json, os, time, pytest

def record(kind, name):
    with open(os.environ["PROBE_LOG"], "a") as log:
        log.write(json.dumps([kind, name, os.environ["PYTEST_XDIST_WORKER"], time.monotonic()]) + "\\n")

@pytest.fixture(scope="module")
def shared():
    record("built", "shared")
    return os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.parametrize("k", range(4))
def test_free(k):
    record("free", k)
    time.sleep(0.2)

@pytest.mark.parametrize("k", range(4))
def test_shares_the_module_fixture(shared, k):
    record("shared", k)
    assert shared == os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.slurm
@pytest.mark.parametrize("k", range(2))
def test_a_cluster_run(k):
    record("slurm", k)
    time.sleep(0.5)

@pytest.mark.slurm
@pytest.mark.slow
def test_a_slow_cluster_run():
    record("slurm", "slow")
    time.sleep(0.5)

@pytest.mark.slow
@pytest.mark.parametrize("k", range(3))
def test_an_end_to_end_run(k):
    record("snakemake", k)
    time.sleep(0.5)
'''


def test_two_workers_run_the_slurm_and_snakemake_groups_side_by_side_and_build_a_module_fixture_once(tmp_path):
    """Run for real with -n 2 --dist loadgroup (xdist's own loadgroup no longer groups under pytest 9: the
    conftest's scheduler must)."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(PROBE_TESTS)
    log = tmp_path / "probe.jsonl"
    env = outside_this_run(PROBE_LOG=str(log))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                             "loadgroup", "-W", "ignore::pytest.PytestUnknownMarkWarning", "test_probe.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = ("slurm", "snakemake", "shared", "built", "free")
    workers = {kind: {worker for k, _, worker, _ in records if k == kind} for kind in kinds}
    assert all(len(workers[kind]) == 1 for kind in ("slurm", "snakemake", "shared")), workers
    assert [name for kind, name, _, _ in records if kind == "built"] == ["shared"]  # built once
    # The SLURM group and the local Snakemake group run side by side, on two workers, each first on its worker.
    slurm_worker, snakemake_worker = workers["slurm"].pop(), workers["snakemake"].pop()
    assert slurm_worker != snakemake_worker
    for kind, worker in (("slurm", slurm_worker), ("snakemake", snakemake_worker)):
        on_worker = [k for k, _, w, _ in sorted(records, key=lambda r: r[3]) if w == worker]
        assert on_worker[:3] == [kind] * 3, on_worker
    starts = {kind: sorted(at for k, _, _, at in records if k == kind) for kind in ("slurm", "snakemake")}
    assert starts["slurm"][0] < starts["snakemake"][-1] and starts["snakemake"][0] < starts["slurm"][-1], starts
