"""Stage command lines: the parser every stage uses, and the JSON settings that rules pass to stages as
one argument (e.g. ``--dataset '{...}'``)."""
from __future__ import annotations

import argparse
import json
from typing import Any, NoReturn

from workflow_scripts.core.errors import WorkflowError


def json_setting(text: str, flag: str) -> Any:
    """Decode a JSON command-line argument; a malformed one names the flag and the position."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise WorkflowError(f"argument {flag}: not valid JSON at character {error.pos}: {error.msg}") from None


def json_object_setting(text: str, flag: str) -> dict:
    """:func:`json_setting` for an argument that must be a JSON object (a stage's settings section)."""
    value = json_setting(text, flag)
    if not isinstance(value, dict):
        raise WorkflowError(f"argument {flag}: expected a JSON object, got {type(value).__name__}")
    return value


class StageArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error (a missing flag, ``--seed one``) is a WorkflowError like any other bad
    input: run_main prints it as its one ``error: ...`` line and exits 2, instead of argparse's usage
    block and SystemExit (which a caller of ``main`` cannot tell from a deliberate exit)."""

    def error(self, message: str) -> NoReturn:
        raise WorkflowError(message)
