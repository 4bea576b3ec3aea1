"""Outputs appear whole or not at all: written beside their final path, then renamed into place.

Temporary paths are named ``.<final name>.<host>-<pid>-<random>.partial`` (``.work`` for a stage's
scratch directory), so a later run can tell debris from work in progress: a stage killed before its
cleanup ran (SIGKILL, a node lost, SIGTERM in a process without :func:`stop_signals_exit`) leaves its
temporary path behind, and the next :func:`atomic_path` or :func:`scratch_directory` for the same
final path removes every one whose process, on this host, is gone. Another host's are left alone
(its process cannot be checked from here).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator

from workflow_scripts.core.errors import WorkflowError

KINDS = ("partial", "work")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _host() -> str:
    return socket.gethostname() or "localhost"


def _prefix(final: Path) -> str:
    return f".{final.name}.{_host()}-{os.getpid()}-"


def _owner_gone(pid: int, path: Path) -> bool:
    """True when process ``pid`` no longer runs, or runs but started after ``path`` was last changed
    (the pid was reused, so it cannot be the process that wrote there)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's live process
        return False
    try:
        import psutil

        return psutil.Process(pid).create_time() > path.lstat().st_mtime + 1
    except Exception:  # the process ended meanwhile, or psutil cannot tell: keep it this time
        return False


def remove_stale(final: str | os.PathLike) -> list[Path]:
    """Delete the temporary paths of ``final`` left by processes of this host that are gone; returns them.

    Also matches a temporary path nested in one (``..<final>.<host>-<pid>-...partial.<...>.partial``: a
    stage writing into another's staging directory), by the outer owner."""
    final = Path(final)
    pattern = re.compile(r"\.{1,2}" + re.escape(final.name) + r"\.(?P<host>.+?)-(?P<pid>\d+)-[a-z0-9_]{8}\.(?:"
                         + "|".join(KINDS) + r")(?:\.|$)")
    host, removed = _host(), []
    try:
        entries = list(os.scandir(final.parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if not entry.name.startswith("."):
            continue
        match = pattern.match(entry.name)
        if match and match["host"] == host and _owner_gone(int(match["pid"]), Path(entry.path)):
            _remove(Path(entry.path))
            removed.append(Path(entry.path))
    return removed


def current_umask() -> int:
    """The process's umask, read without changing it (os.umask sets while it reads, racing other threads)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_beside(final: Path, suffix: str) -> Path:
    """A new temporary directory beside ``final`` (its parents made); an output that cannot be written there
    (a file where a folder should be, no permission, a read-only file system) is one message naming it."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(final)
        return Path(tempfile.mkdtemp(prefix=_prefix(final), suffix=suffix, dir=final.parent))
    except OSError as error:
        blocking = next((parent for parent in final.parents if parent.exists()), None)
        if blocking is not None and not blocking.is_dir():
            reason = f"{blocking} is a file, not a folder"
        else:
            reason = f"{error.strerror or type(error).__name__} in {blocking or final.parent}"
        raise WorkflowError(f"{final}: cannot be written here ({reason}); choose another output path or "
                            "make its folder writable") from None


def check_writable(*finals: str | os.PathLike) -> None:
    """Refuse, before any work, outputs that could not be written (so a stage never leaves one output
    written and the next one failed, e.g. normalised data without their report)."""
    for final in finals:
        _remove(_make_beside(Path(final), ".partial"))


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; on success rename it onto ``final``, on error delete it.

    Renaming within one directory is atomic on POSIX file systems, so a reader (or a resumed job)
    never sees half an output, and a failed stage leaves nothing behind. Debris of an earlier run
    that was killed is removed first (see the module docstring).
    """
    final = Path(final)
    temporary = _make_beside(final, ".partial")
    if directory:  # mkdtemp makes it 0700 whatever the umask: a lab's group could not read the output
        temporary.chmod(0o777 & ~current_umask())
    target = temporary if directory else temporary / final.name
    try:
        yield target
        if final.exists():
            _remove(final)
        os.replace(target, final)
    finally:
        _remove(temporary)


@contextlib.contextmanager
def scratch_directory(final: str | os.PathLike) -> Iterator[Path]:
    """A working directory beside ``final`` (same file system, never ``/tmp`` or ``~/.cache``) for
    intermediate files, deleted on exit; an earlier killed run's is deleted on entry."""
    final = Path(final)
    work = _make_beside(final, ".work")
    try:
        yield work
    finally:
        _remove(work)


@contextlib.contextmanager
def stop_signals_exit() -> Iterator[None]:
    """Inside, SIGTERM raises ``SystemExit(143)`` (SIGINT already raises KeyboardInterrupt), so the
    ``finally`` blocks that delete temporary paths run when Snakemake or SLURM stop the stage. A second
    SIGTERM during that cleanup is ignored. Outside the main thread it changes nothing."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: signals cannot be handled here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_json(path: str | os.PathLike, value: Any) -> None:
    """Write JSON atomically, pretty-printed with sorted keys (stable across runs)."""
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def write_jsonl(path: str | os.PathLike, rows) -> None:
    """Write one JSON object per line, atomically."""
    with atomic_path(path) as temporary, open(temporary, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True, default=str) + "\n")
