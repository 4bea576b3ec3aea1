"""The ``mix`` stage: one mixture's pre-tokenised training data from its datasets' pre-tokenised data.

    python -m workflow_scripts.mix --mixture NAME --settings JSON --component NAME=DIR [...] --out DIR --report FILE

train: rows drawn in the mixture's fixed proportions (data/mixture.py); validation: every component's
validation rows, when all have them. The output has pretokenise's layout, so sanity and train read it
like any dataset's.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Sequence

from workflow_scripts.core.atomic_output import atomic_path, write_json
from workflow_scripts.core.errors import WorkflowError, run_main
from workflow_scripts.core.section_settings import MixtureSettings
from workflow_scripts.core.stage_arguments import StageArgumentParser
from workflow_scripts.data import mixture


def parse_component(text: str) -> tuple[str, Path]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise WorkflowError(f"argument --component: expected NAME=DIR, got {text!r}")
    return name, Path(directory)


def main(argv: Sequence[str] | None = None) -> int:
    parser = StageArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixture", required=True, help="The mixture's name (mixtures.<name>).")
    parser.add_argument("--settings", required=True, help="The mixture's settings as JSON.")
    parser.add_argument("--component", action="append", required=True, type=parse_component,
                        help="NAME=DIR: a component dataset's pre-tokenised data (repeat, in the mixture's order).")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--report", required=True, type=Path)
    args = parser.parse_args(argv)
    components = dict(args.component)
    if len(components) != len(args.component) or len(components) < 2:
        raise WorkflowError("argument --component: give at least two different components")
    settings = MixtureSettings.from_json(args.settings, args.mixture)

    from datasets import DatasetDict, load_from_disk

    metas = {name: mixture.read_meta(directory) for name, directory in components.items()}
    meta = mixture.mixed_meta(metas, args.mixture)
    data = {name: load_from_disk(str(directory)) for name, directory in components.items()}
    names = list(components)
    sizes = {name: len(data[name]["train"]) for name in names}
    order = mixture.plan(sizes, settings)
    mixture.check_passes(order, sizes, settings, args.mixture)
    report = {
        "mixture": args.mixture, "seed": settings.seed,
        "components": {name: {"data": str(components[name]), "train_rows": sizes[name], "share": order.shares[name],
                              "drawn": order.counts[name],
                              "passes": round(order.counts[name] / sizes[name], 4)} for name in names},
        "splits": {"train": {"rows": int(len(order.rows))}},
    }
    oversampled = [name for name in names if order.counts[name] > sizes[name]]
    if oversampled:
        report["oversampled"] = oversampled
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{args.out.name}.work.", dir=args.out.parent) as work:
        splits = {"train": mixture.mix_split("train", [data[n]["train"] for n in names], names, order, Path(work))}
        with_validation = [name for name in names if "validation" in data[name]]
        if len(with_validation) == len(names):
            splits["validation"] = mixture.mix_split("validation", [data[n]["validation"] for n in names], names, None, Path(work))
            report["splits"]["validation"] = {"rows": len(splits["validation"])}
        elif with_validation:
            report["validation"] = (f"not mixed: only {with_validation} have a validation split, and a held-out "
                                    "loss over some components only would misstate the mixture's")
        meta.update({"mixture": report, "input_fingerprint": mixture_fingerprint(metas, settings)})
        meta["report"] = report
        with atomic_path(args.out, directory=True) as out:
            DatasetDict(splits).save_to_disk(str(out))
            (out / mixture.META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    write_json(args.report, report)
    for name, part in report["components"].items():
        print(f"{name}: {part['drawn']} of {part['train_rows']} train rows (share {part['share']:.3f})")
    return 0


def mixture_fingerprint(metas, settings) -> str:
    from workflow_scripts.core.run_manifest import config_hash

    return config_hash({"components": {name: meta.get("input_fingerprint") for name, meta in metas.items()},
                        "settings": settings.to_dict()})


if __name__ == "__main__":
    run_main(main)
