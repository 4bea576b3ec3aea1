"""One exception type for bad input, so every stage ends with one clear message."""
from __future__ import annotations

import sys
from typing import Callable, Sequence


class WorkflowError(Exception):
    """Bad user input or a failed check: the message names the file, key/field and row."""


class ConfigError(WorkflowError):
    """A configuration value is missing, malformed or inconsistent."""

    def __init__(self, key: str, message: str, source: str | None = None):
        where = f"{source}: " if source else ""
        super().__init__(f"{where}config key '{key}': {message}")
        self.key, self.problem = key, message


class PreflightError(WorkflowError):
    """A failed check of the sanity gate (training/preflight_checks.py, a task's gate hooks): the check's
    name, the cause and the fix, in one line."""

    def __init__(self, check: str, cause: str, fix: str):
        super().__init__(f"{check}: {cause}. Fix: {fix}")
        self.check = check


def few_names(names, limit: int = 5) -> str:
    """The first ``limit`` names, sorted, and how many more (for one-line messages)."""
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


#: The exit code of a stage stopped by Ctrl-C (SIGINT): 128 + the signal's number, as a shell reports it.
INTERRUPTED_EXIT_CODE = 130


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> None:
    """Run a stage's ``main`` as a command: a WorkflowError becomes one line on stderr and exit code 2;
    Ctrl-C one line and exit code 130 (the stages' ``finally`` blocks have removed their partial outputs by
    the time the KeyboardInterrupt reaches here, so a traceback would only hide that line)."""
    try:
        code = main(argv)
    except WorkflowError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        stage = getattr(main, "__module__", None) or "the stage"
        if stage == "__main__":  # python -m workflow_scripts.<stage>: the module's own name
            spec = getattr(sys.modules["__main__"], "__spec__", None)
            stage = spec.name if spec is not None else sys.argv[0]
        print(f"interrupted: {stage} stopped by Ctrl-C (SIGINT); it left no output, rerun it to start again",
              file=sys.stderr)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    raise SystemExit(code or 0)
