"""What the demo generators share: their command line and the JSON-lines writer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from workflow_scripts.core.atomic_output import atomic_path
from workflow_scripts.core.stage_arguments import StageArgumentParser


def write_jsonl(path: Path, rows: Iterable[Any]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))


def generator_parser(description: str, out_help: str) -> StageArgumentParser:
    """``--out DIR`` and ``--seed N`` (the committed demo uses seed 0)."""
    parser = StageArgumentParser(description=description)
    parser.add_argument("--out", required=True, type=Path, help=out_help)
    parser.add_argument("--seed", type=int, default=0, help="Random seed (the committed demo uses 0).")
    return parser


def run_generator(argv: Sequence[str] | None, description: str, out_help: str,
                  write: Callable[[Path, int], Any]) -> int:
    """A generator's ``main``: parse ``--out``/``--seed`` and write."""
    args = generator_parser(description, out_help).parse_args(argv)
    write(args.out, args.seed)
    return 0
