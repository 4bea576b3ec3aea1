"""The conda environments of the rules pin the same versions as constraints.txt (the tested set)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def pinned(lines):
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def conda_pip_pins(path: Path) -> dict[str, str]:
    spec = yaml.safe_load(path.read_text())
    pip_sections = [item["pip"] for item in spec["dependencies"] if isinstance(item, dict) and "pip" in item]
    assert pip_sections, f"{path.name} has no pip section"
    return pinned(pip_sections[0])


CONSTRAINTS = pinned((ROOT / "constraints.txt").read_text().splitlines())
ENV_FILES = sorted((ROOT / "envs").glob("*.yaml"))


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_conda_env_pins_agree_with_constraints(env_file):
    pins = conda_pip_pins(env_file)
    assert pins, f"{env_file.name} pins nothing"
    for name, version in pins.items():
        assert name in CONSTRAINTS, f"{env_file.name}: {name} is not pinned in constraints.txt"
        assert CONSTRAINTS[name] == version, f"{env_file.name}: {name}=={version}, constraints.txt has {CONSTRAINTS[name]}"


def test_every_rule_env_exists():
    referenced = set()
    for smk in (ROOT / "rules").glob("*.smk"):
        for line in smk.read_text().splitlines():
            if line.strip().startswith('"../envs/'):
                referenced.add(line.strip().strip('",').removeprefix("../"))
    assert referenced, "no rule names a conda environment"
    for env in referenced:
        assert (ROOT / env).exists(), f"a rule uses {env}, which does not exist"


def test_installed_versions_match_constraints():
    """The environment the tests run in is the pinned one, so results can be rebuilt."""
    import importlib.metadata

    for name in ("torch", "transformers", "peft", "accelerate", "datasets", "snakemake"):
        installed = importlib.metadata.version(name).split("+")[0]
        assert installed == CONSTRAINTS[name], f"{name}: installed {installed}, pinned {CONSTRAINTS[name]}"
