"""What produced an output: package versions, git commit, host, devices and the settings hash."""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping


def config_hash(value: Any) -> str:
    """A stable sha256 of any JSON-serialisable value (key order ignored)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


PACKAGES = (
    "torch", "transformers", "peft", "accelerate", "datasets", "tokenizers",
    "safetensors", "snakemake", "pandas", "PyYAML", "smatch", "smatchpp",
)
# Key names that hold credentials, matched as whole words of the key (snake_case, kebab-case, dotted or
# camelCase parts), so 'hf_token', 'HF_TOKEN', 'apiKey' and 'client_secret' are secrets while
# 'max_new_tokens', 'tokenizer_id' and 'pad_token_id' are not. Each marker is one word or two adjacent words.
SECRET_MARKERS = (
    "token", "secret", "secrets", "password", "passwords", "passwd", "passphrase", "credential", "credentials",
    "apikey", "api_key", "private_key", "access_key", "authorization",
)
# 'token' is a credential as the key's last word ('hf_token', 'access_token'), except a tokenizer's special
# tokens ('pad_token' holds '<pad>'); before another word it names something else ('pad_token_id').
SPECIAL_TOKEN_ROLES = frozenset({"pad", "eos", "bos", "unk", "sep", "cls", "mask", "sos", "additional_special"})
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")


def key_words(name: Any) -> list[str]:
    """A key's words, lower-cased: 'HF_TOKEN' -> ['hf', 'token'], 'apiKey' -> ['api', 'key']."""
    return [word.lower() for word in _WORD.findall(str(name))]


def is_secret_key(name: Any) -> bool:
    """Whether a settings key names a credential (its value must never reach a manifest, log or message)."""
    words = key_words(name)
    for marker in SECRET_MARKERS:
        parts = marker.split("_")
        for start in range(len(words) - len(parts) + 1):
            if words[start:start + len(parts)] != parts:
                continue
            if marker != "token":
                return True
            roles = {"_".join(words[max(start - n, 0):start]) for n in (1, 2)}  # the one or two words before it
            if start == len(words) - 1 and not roles & SPECIAL_TOKEN_ROLES:
                return True
    return False


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed versions of ``names`` (None for a package that is not installed)."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


WORKFLOW_ROOT = Path(__file__).resolve().parents[2]


def workflow_version(root: str | Path = WORKFLOW_ROOT) -> str | None:
    """This workflow's version: pyproject.toml's ``project.version`` beside the code (CHANGELOG.md lists
    each), else the installed package's; None when neither is found."""
    pyproject = Path(root) / "pyproject.toml"
    if pyproject.is_file():
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: read the [project] table's version line
            table = re.search(r"(?ms)^\[project\]\n(.*?)(?=^\[)", pyproject.read_text() + "\n[")
            found = table and re.search(r'(?m)^version\s*=\s*"([^"]+)"', table.group(1))
            return found.group(1) if found else None
        return tomllib.loads(pyproject.read_text()).get("project", {}).get("version")
    try:
        return importlib.metadata.version("lora-experiment-workflow")
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(directory: str | Path | None = None) -> str | None:
    """The workflow's git commit (with '-dirty' when it has uncommitted changes), or None outside git."""
    directory = Path(directory or WORKFLOW_ROOT)
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
            key: "<redacted>" if is_secret_key(key) else redact(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact(item) for item in value]
    return value


def build_manifest(stage: str, settings: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """A manifest for one stage run; ``extra`` adds stage-specific facts (seed, world size, devices...)."""
    return {
        "stage": stage,
        "workflow_version": workflow_version(),
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
