"""A stage stopped by SIGTERM, SIGINT or SIGKILL leaves no temporary debris that outlives its next run.

pretokenise is started as a command on a corpus large enough to be shared out between two processes,
stopped while its processes write their pieces, then run again: the rerun must leave only the output
and the report in the output's directory, byte-identical to an uninterrupted run's, and the tokenising
processes of the stopped run must be gone. normalise's next run removes a killed run's staging
directory (core/atomic_output: temporary paths carry host and pid)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from data_helpers import run_download, run_normalise
from workflow_scripts import normalise, pretokenise
from workflow_scripts.core import atomic_output

REPO = Path(__file__).resolve().parent.parent
VARIANT = {"mask_rate": 0.15, "grouping": "blocks"}
MAX_LENGTH = 32
LINES = 2 * pretokenise.PROCESS_MIN_ROWS  # two processes, each for seconds on a busy machine


@pytest.fixture(scope="module")
def corpus_inputs(tmp_path_factory):
    """A normalised corpus of LINES lines and a tiny BERT; and an uninterrupted --threads 2 run's output."""
    from test_masked_lm_chain import corpus, save_tiny_bert

    tmp = tmp_path_factory.mktemp("interrupted")
    source = tmp / "corpus"
    source.mkdir()
    lines = corpus(LINES, seed=3)
    (source / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (source / "test.txt").write_text("\n".join(corpus(20, seed=4)) + "\n", encoding="utf-8")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(source)}, "format": "text",
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy",
                "contamination": {"accept": True}}  # a small grammar: lines repeat by design
    data, _ = run_normalise("lines", settings, run_download("lines", settings, tmp), tmp)
    save_tiny_bert(lines[:2000], tmp / "model")
    reference = tmp / "reference" / "tokenised"
    pretokenise_here(tmp / "model", data, reference)
    return tmp / "model", data, reference


def arguments(model: Path, data: Path, out: Path) -> list[str]:
    return ["--model", str(model), "--data", str(data), "--task", "masked_lm", "--variant", json.dumps(VARIANT),
            "--max-length", str(MAX_LENGTH), "--threads", "2", "--out", str(out),
            "--report", str(out.parent / "report.json")]


def command(model: Path, data: Path, out: Path) -> list[str]:
    """The stage as the rules start it: the run that is stopped, so the signal reaches a process of its own."""
    return [sys.executable, "-m", "workflow_scripts.pretokenise", *arguments(model, data, out)]


def pretokenise_here(model: Path, data: Path, out: Path) -> None:
    """An uninterrupted run (the reference, and the run after a stopped one) in this process; the tokenizer
    settings the stage puts in the environment are put back."""
    saved = {name: os.environ.get(name) for name in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    try:
        assert pretokenise.main(arguments(model, data, out)) == 0
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def contents(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def pending_signals(process: psutil.Process) -> set[int]:
    """The signals sent to ``process`` and not yet delivered (a stopped process keeps them pending)."""
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return set()
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))]
    return {bit + 1 for mask in masks for bit in range(64) if mask >> bit & 1}


def held(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_stopped_pretokenise_leaves_nothing_after_its_next_run(corpus_inputs, tmp_path, stop):
    model, data, reference = corpus_inputs
    out = tmp_path / "run" / "tokenised"
    # The stage gets SIGINT's default disposition, as a command a user interrupts has: a shell that starts a
    # job in the background (CI's runner, `cmd &`) leaves SIGINT ignored, and Python then never raises
    # KeyboardInterrupt, so the stage would finish as if not stopped (seen in a backgrounded .ci/run).
    stage = subprocess.Popen(command(model, data, out), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    workers: list[psutil.Process] = []
    try:
        # Stopped while both tokenising processes write their pieces into the scratch directory.
        def started():
            if stage.poll() is not None:
                pytest.fail(f"the stage ended first: {stage.communicate()}")
            pieces = list(out.parent.glob(".tokenised.*.work/train-*.arrow"))
            found = [c for c in psutil.Process(stage.pid).children() if c.status() != "zombie"]
            return found if len(pieces) == 2 and len(found) == 2 else None

        workers = wait_for(started, 240, "the two tokenising processes and their pieces")
        # Held mid-work (SIGSTOP) until the stage has answered the signal: the stage cannot finish its work first,
        # however late a loaded machine lets the signal land (a signal sent while the stage was finishing its last
        # seconds of work gave exit 0, once an xfail). A stage that ignores the signal is not let off: its workers
        # are let go after a minute, it finishes, and its exit code 0 fails the test.
        for worker in workers:
            worker.send_signal(signal.SIGSTOP)
        wait_for(lambda: all(held(w) or not w.is_running() for w in workers), 30, "the tokenising processes held")
        frozen = [worker for worker in workers if held(worker)]
        assert frozen, "both tokenising processes finished before they could be held: make the corpus larger"
        stage.send_signal(stop)
        # The answer: the stage ends its workers (a SIGTERM waits on each held one), or a killed stage's workers get
        # theirs from the kernel (pretokenise's PR_SET_PDEATHSIG).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(signal.SIGTERM in pending_signals(w) for w in frozen):
            time.sleep(0.02)
        for worker in frozen:
            worker.send_signal(signal.SIGCONT)
        code = stage.wait(60)
    finally:
        for worker in workers:
            if worker.is_running():
                worker.send_signal(signal.SIGCONT)
        if stage.poll() is None:
            stage.kill()
            stage.wait()
    gone, alive = psutil.wait_procs(workers, timeout=30)
    for worker in alive:  # killed before the stage's pipes are read: they hold them open (a read would hang)
        worker.kill()
    expected = {signal.SIGTERM: (143,), signal.SIGINT: (130,), signal.SIGKILL: (-9,)}[stop]
    stderr = stage.stderr.read().decode()
    assert code in expected, f"exit code {code} after {stop.name} (expected {expected[0]}): {stderr[-2000:]}"
    if stop == signal.SIGINT:  # Ctrl-C: one line, no traceback (core/errors.run_main)
        assert "Traceback" not in stderr and stderr.splitlines()[-1] == (
            "interrupted: workflow_scripts.pretokenise stopped by Ctrl-C (SIGINT); it left no output, rerun it to "
            "start again"), stderr[-2000:]
    assert not alive, f"tokenising processes outlived the stopped stage: {alive}"
    assert not out.exists()
    if stop == signal.SIGKILL:  # nothing could clean up: the debris is there until the next run
        assert [p.name for p in out.parent.iterdir() if p.name.startswith(".tokenised.")]

    pretokenise_here(model, data, out)  # the next run
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.json", "tokenised"]
    assert contents(out) == contents(reference)


def test_normalise_removes_a_killed_runs_staging_directory_and_keeps_a_live_ones(tmp_path):
    from test_masked_lm_chain import corpus

    source = tmp_path / "corpus"
    source.mkdir()
    (source / "train.txt").write_text("\n".join(corpus(50, seed=1)) + "\n", encoding="utf-8")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(source)}, "format": "text",
                "splits": {"train": "train"}, "metric": "masked_accuracy"}
    raw = run_download("lines", settings, tmp_path)
    out = tmp_path / "normalised" / "lines"
    out.parent.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = atomic_output._host()
    stale = out.parent / f".lines.{host}-{int(dead.stdout)}-abcd_123.partial"
    nested = out.parent / f"..lines.{host}-{int(dead.stdout)}-abcd_123.partial.{host}-{int(dead.stdout)}-efgh_456.partial"
    live = out.parent / f".lines.{host}-{os.getppid()}-ijkl_789.partial"  # pytest's parent still runs
    other_host = out.parent / f".lines.elsewhere-{int(dead.stdout)}-mnop_012.partial"
    for path in (stale, nested, live, other_host):
        (path / "train").mkdir(parents=True)
        (path / "train" / "data-00000-of-00001.arrow").write_bytes(b"half written")
    assert normalise.main(["--name", "lines", "--dataset", json.dumps(settings), "--raw", str(raw), "--out", str(out),
                           "--report", str(tmp_path / "report.json")]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["lines", live.name, other_host.name])


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o002, 0o775), (0o077, 0o700)])
def test_directory_outputs_follow_the_umask(tmp_path, umask, mode):
    """mkdtemp's staging directory is 0700 whatever the umask; a renamed-in output must not stay so (a lab's
    group reads results on a shared file system). A stage's real output too: download's raw/."""
    from test_masked_lm_chain import corpus

    source = tmp_path / "corpus"
    source.mkdir()
    (source / "train.txt").write_text("\n".join(corpus(5, seed=1)) + "\n", encoding="utf-8")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(source)}, "format": "text",
                "splits": {"train": "train"}, "metric": "masked_accuracy"}
    previous = os.umask(umask)
    try:
        with atomic_output.atomic_path(tmp_path / "out", directory=True) as out:
            (out / "file.txt").write_text("x")
        raw = run_download("lines", settings, tmp_path)
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == mode
    assert Path(raw).stat().st_mode & 0o777 == mode
