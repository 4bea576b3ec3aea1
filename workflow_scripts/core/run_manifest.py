"""What produced an output: package versions, git commit, host, devices and the settings hash."""
from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from workflow_scripts.core.experiment_config import config_hash

PACKAGES = (
    "torch", "transformers", "peft", "accelerate", "datasets", "tokenizers",
    "safetensors", "snakemake", "pandas", "PyYAML", "smatch",
)
SECRET_MARKERS = ("token", "secret", "password", "api_key")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed versions of ``names`` (None for a package that is not installed)."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(directory: str | Path | None = None) -> str | None:
    """The workflow's git commit (with '-dirty' when it has uncommitted changes), or None outside git."""
    directory = Path(directory or Path(__file__).resolve().parents[2])
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=directory, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("-dirty" if dirty else "")


def redact(value: Any) -> Any:
    """Drop values whose key looks like a credential, so manifests and logs never hold secrets."""
    if isinstance(value, Mapping):
        return {
            key: "<redacted>" if any(marker in str(key).lower() for marker in SECRET_MARKERS) else redact(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact(item) for item in value]
    return value


def build_manifest(stage: str, settings: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """A manifest for one stage run; ``extra`` adds stage-specific facts (seed, world size, devices...)."""
    return {
        "stage": stage,
        "settings": redact(settings),
        "settings_sha256": config_hash(settings),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": platform.node(),
        "git_commit": git_commit(),
        "created_unix": time.time(),
        **extra,
    }
