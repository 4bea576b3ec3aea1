"""Small builders shared by the data-stage tests (datasets on disk, settings, a tiny model)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterable

import yaml

ROOT = Path(__file__).resolve().parent.parent


def default_config() -> dict:
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def without_idle_models(config: dict) -> dict:
    """``config`` with only the models some kept dataset or mixture trains (a model no dataset lists is refused)."""
    if "models" in config:
        entries = [*config["datasets"].values(), *(config.get("mixtures") or {}).values()]
        used = {model for entry in entries for model in (entry.get("models") or config["models"])}
        config["models"] = {name: spec for name, spec in config["models"].items() if name in used}
    return config


def single_model_config(model: str = "tiny-llama") -> dict:
    """The demo config as a one-model config (``model:``): its datasets and variants for that model only."""
    config = default_config()
    spec = config.pop("models")[model]
    config["model"] = {"name": model, **spec}
    kept = {name: d for name, d in config["datasets"].items() if model in d.get("models", [model])}
    for dataset in kept.values():
        dataset.pop("models", None)
    config["datasets"] = kept
    tasks = {d.get("task", "generation") for d in kept.values()}
    config["variants"] = {n: v for n, v in config["variants"].items() if v.get("task", "generation") in tasks}
    reference = config["comparison"]["reference_variant"]
    if isinstance(reference, dict):
        config["comparison"]["reference_variant"] = {t: v for t, v in reference.items() if t in tasks}
    return config


def demo_settings(name: str) -> dict:
    """A demo dataset's settings from config/config.yaml, with an absolute source path."""
    settings = copy.deepcopy(default_config()["datasets"][name])
    if settings["source"]["type"] == "local":
        settings["source"]["path"] = str(ROOT / settings["source"]["path"])
    return settings


def write_jsonl(path: Path, rows: Iterable[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def local_dataset(directory: Path, files: dict[str, list], **settings: Any) -> dict:
    """Write ``<split>.jsonl`` files and return settings for a local source over them."""
    for split, rows in files.items():
        write_jsonl(directory / f"{split}.jsonl", rows)
    base = {
        "source": {"type": "local", "path": str(directory)},
        "splits": {"train": "train", "test": "test"},
        "fields": {"question": "q", "answers": "a"},
        "metric": "exact_match",
    }
    base.update(settings)
    return base


def run_download(name: str, settings: dict, tmp: Path) -> Path:
    from workflow_scripts import download

    raw = tmp / "results" / name / "raw"
    assert download.main(["--name", name, "--dataset", json.dumps(settings), "--out", str(raw),
                          "--manifest", str(tmp / "results" / name / "download_manifest.json")]) == 0
    return raw


def run_normalise(name: str, settings: dict, raw: Path, tmp: Path) -> tuple[Path, Path]:
    from workflow_scripts import normalise

    out, report = tmp / "results" / name / "normalised", tmp / "results" / name / "normalise_report.json"
    assert normalise.main(["--name", name, "--dataset", json.dumps(settings), "--raw", str(raw),
                           "--out", str(out), "--report", str(report)]) == 0
    return out, report


def leftovers(directory: Path) -> list[str]:
    """Files or folders left in ``directory`` (temporary '.partial' ones included); a failed normalise's
    report (``*.failed.json``, its account of the failure, not an output) is not counted."""
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".failed.json")) if directory.exists() else []


def typed_variant(given: dict, task: str = "generation", name: str = "v"):
    """A variant's keys as a stage types them (``--variant``: core.entry_settings.VariantSettings, the schema's
    defaults filled), for calling the tasks directly."""
    from workflow_scripts.core.entry_settings import VariantSettings

    return VariantSettings.parse(given, task, name)
