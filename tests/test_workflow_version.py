"""The workflow's version (pyproject.toml) is in every run manifest and has its CHANGELOG.md entry."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from workflow_scripts.core import run_manifest

ROOT = Path(__file__).resolve().parents[1]


def pyproject_version() -> str:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_every_manifest_records_the_workflow_version():
    manifest = run_manifest.build_manifest("train", {"seed": 1})
    assert manifest["workflow_version"] == pyproject_version()


def test_the_changelog_has_an_entry_for_the_version():
    headings = re.findall(r"(?m)^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text())
    assert pyproject_version() in headings, headings


@pytest.mark.parametrize("without_tomllib", [False, True])
def test_the_version_is_read_from_the_project_table(tmp_path, monkeypatch, without_tomllib):
    (tmp_path / "pyproject.toml").write_text('[tool.other]\nversion = "0.0.9"\n\n[project]\nname = "x"\n'
                                             'version = "2.3.4"\n\n[tool.more]\nversion = "7"\n')
    if without_tomllib:  # Python 3.10 has no tomllib
        monkeypatch.setitem(sys.modules, "tomllib", None)
    assert run_manifest.workflow_version(tmp_path) == "2.3.4"
