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


def run_main(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> None:
    """Run a stage's ``main`` as a command: a WorkflowError becomes one line on stderr and exit code 2."""
    try:
        code = main(argv)
    except WorkflowError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(code or 0)
