"""config/examples/: one complete config per kind of experiment (docs/tasks/*.md link them), each planned by
``snakemake -n`` as a user runs it from the repository's root on the demo data, offline (``source: tiny``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from data_helpers import ROOT
from test_dag import job_counts, snakemake

EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.yaml"))
# The kinds of experiment each example is for (docs/tasks/index.md); conversation has no demo data.
KINDS = {"generation.yaml": "generation", "classification.yaml": "classification", "masked-lm.yaml": "masked_lm",
         "vision-language.yaml": "vision_language"}


def test_one_example_per_kind_and_each_task_page_links_its_own():
    assert sorted(path.name for path in EXAMPLES) == sorted(KINDS)
    pages = {"generation": "generation.md", "classification": "classification.md", "masked_lm": "masked-lm.md",
             "vision_language": "vision-language.md"}
    for name, task in KINDS.items():
        config = yaml.safe_load((ROOT / "config" / "examples" / name).read_text())
        assert {dataset.get("task", "generation") for dataset in config["datasets"].values()} == {task}, name
        assert config["model"]["source"] == "tiny" and len(config["seeds"]) > 1, name
        assert f"config/examples/{name}" in (ROOT / "docs" / "tasks" / pages[task]).read_text(), pages[task]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.stem)
def test_an_example_is_planned_offline_from_the_repository_root(tmp_path, example):
    # The working directory a user runs it in: the repository's root, with the demo data (read, never written).
    (tmp_path / "demo_data").symlink_to(ROOT / "demo_data")
    code, output = snakemake(tmp_path, "-n", "--configfile", str(example), "--cores", "2")
    assert code == 0, output
    config = yaml.safe_load(example.read_text())
    counts = job_counts(output)
    experiments = len(config["variants"]) * len(config["seeds"])
    assert counts["train"] == counts["evaluate"] == experiments, counts
    assert counts["prepare_model"] == counts["download"] == counts["normalise"] == 1, counts
    assert not any(Path(tmp_path, folder).exists() for folder in ("results", "resources")), "a dry run wrote outputs"
