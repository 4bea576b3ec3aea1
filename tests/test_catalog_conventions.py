"""The Snakemake workflow catalog's conventions: config/README.md describes every config section with a
minimal example that the workflow accepts, and .snakemake-workflow-catalog.yml names the usage."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from workflow_scripts.checks.config import load_config
from workflow_scripts.core import experiment_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG_README = ROOT / "config" / "README.md"


def test_config_readme_describes_every_section_of_the_schema():
    sections = set(yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())["properties"])
    described = set(re.findall(r"(?m)^### (\w+)$", CONFIG_README.read_text()))
    assert sections - described == set(), f"config/README.md lacks a '### <section>' for {sorted(sections - described)}"
    assert described - sections == set(), f"config/README.md describes sections the schema lacks: {sorted(described - sections)}"


def test_the_minimal_example_is_a_valid_config(tmp_path, monkeypatch):
    examples = re.findall(r"(?ms)^## Minimal example$.*?^```yaml\n(.*?)^```", CONFIG_README.read_text())
    assert len(examples) == 1
    path = tmp_path / "minimal.yaml"
    path.write_text(examples[0])
    monkeypatch.chdir(ROOT)  # its dataset path is relative to the workflow, as the Snakefile's are
    config = load_config(path)
    assert list(experiment_config.experiments(config)) == [("tiny-llama", "amr_demo", "baseline", 1)]


def test_the_catalog_file_names_the_usage():
    settings = yaml.safe_load((ROOT / ".snakemake-workflow-catalog.yml").read_text())
    usage = settings["usage"]
    assert set(usage) <= {"mandatory-flags", "software-stack-deployment", "report"}
    deployment = usage["software-stack-deployment"]
    assert set(deployment) <= {"conda", "apptainer", "apptainer+conda"} and any(deployment.values())
    assert set(usage["mandatory-flags"]) == {"desc", "flags"}
    if deployment.get("conda"):  # every rule names its conda environment, and the file exists
        rules = "\n".join(path.read_text() for path in (ROOT / "rules").glob("*.smk"))
        named = set(re.findall(r'conda:\s*\n\s*"\.\./(envs/[\w.]+)"', rules))
        assert named and all((ROOT / env).is_file() for env in named)
        assert rules.count("\nrule ") + rules.count("\ncheckpoint ") == len(re.findall(r"\n    conda:", rules)), "a rule without conda:"
