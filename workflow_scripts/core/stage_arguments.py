"""Parsing the JSON settings that rules pass to stages as one argument (e.g. ``--dataset '{...}'``)."""
from __future__ import annotations

import json
from typing import Any

from workflow_scripts.core.errors import WorkflowError


def json_setting(text: str, flag: str) -> Any:
    """Decode a JSON command-line argument; a malformed one names the flag and the position."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise WorkflowError(f"argument {flag}: not valid JSON at character {error.pos}: {error.msg}") from None
