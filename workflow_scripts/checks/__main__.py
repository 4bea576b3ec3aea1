"""Check config files without Snakemake: ``python -m workflow_scripts.checks FILE [FILE ...]``.

Snakemake reads a ``--configfile`` before the workflow does, and its own reading names neither the file nor
the line of a YAML syntax error, and ends a missing file in a traceback (docs/troubleshooting.md). This reads
the files the way the workflow does: each strictly (a key given twice is refused), merged in the order given
as Snakemake merges several ``--configfile`` files, validated against ``config/schema.yaml`` and checked by
:func:`workflow_scripts.checks.config.checked_sections`. It prints one line: the first fault, named by the file
that holds its key, or what the files define. ``snakemake -n --configfile FILE`` checks the rest (the data
files, the models' own configs, the resources) once this passes.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any, Mapping, Sequence

from workflow_scripts.checks.config import checked_sections
from workflow_scripts.core import config_files
from workflow_scripts.core.errors import ConfigError, run_main
from workflow_scripts.core.experiment_config import experiments, models, variant_entries
from workflow_scripts.core.stage_arguments import StageArgumentParser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = StageArgumentParser(prog="python -m workflow_scripts.checks", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="config files, in the order you give them to snakemake --configfile")
    return parser.parse_args(argv)


def checked_config(paths: Sequence[str]) -> dict:
    """The merged config of ``paths`` with the schema's defaults, after every check that needs no data file;
    a fault is a ConfigError named by the file that holds its key."""
    _, merged = config_files.read_files(paths)
    config_files.check_workflow_config(paths, merged)  # as the Snakefile: the schema, its defaults filled
    try:
        checked_sections(merged, "config")  # the Snakefile's list of the checks of the config alone
    except ConfigError as error:
        raise config_files.in_user_file(error, paths) from None
    return merged


def summary(config: Mapping[str, Any]) -> str:
    """What the config defines, counted the way the workflow will run it."""
    def counted(number: int, noun: str) -> str:
        return f"{number} {noun}{'' if number == 1 else 's'}"

    runs = sum(1 for _ in experiments(config))
    return ", ".join([counted(len(models(config)), "model"), counted(len(config["datasets"]), "dataset"),
                      counted(len(variant_entries(config)), "variant"), counted(len(config["seeds"]), "seed"),
                      counted(runs, "training run")])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = checked_config(args.files)
    print(f"{', '.join(args.files)}: valid ({summary(config)}); next, `snakemake -n --configfile "
          f"{shlex.join(args.files)}` checks the data files, the models and the resources")
    return 0


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
