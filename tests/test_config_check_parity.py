"""``python -m workflow_scripts.checks FILE ...`` against what ``snakemake -n --configfile FILE ...`` does with the
same files: a JSON file read as Snakemake reads it (JSON first: ``1e-05`` is a number, a tab is whitespace), the
workflow's tracking check run too, and the next command printed so that it can be pasted back."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from workflow_scripts.checks.__main__ import main
from workflow_scripts.core.config_files import read_config_file
from workflow_scripts.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config" / "examples" / "classification.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_a_json_config_reads_its_numbers_as_json_does(tmp_path, capsys):
    """json.dumps writes 2e-05 (YAML 1.1 reads that as text): Snakemake reads the file as JSON first."""
    config = example()
    config["training"]["learning_rate"] = 2e-05
    path = tmp_path / "exported.json"
    path.write_text(json.dumps(config, indent="\t"))  # tabs: whitespace to JSON, refused in YAML's indentation
    assert "2e-05" in path.read_text()
    assert read_config_file(path)["training"]["learning_rate"] == 2e-05
    assert main([str(path)]) == 0
    assert "valid (" in capsys.readouterr().out


def test_a_key_given_twice_in_a_json_config_is_still_refused(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('{"seeds": [1], "seeds": [2]}')
    with pytest.raises(ConfigError, match="'seeds' is given twice"):
        read_config_file(path)


def test_the_tracking_check_of_the_workflow_runs_too(tmp_path):
    """rules/common.smk refuses an unknown run_name field (trackers.check_workflow_tracking) in snakemake -n."""
    config = example()
    config["tracking"] = {"mlflow": {"run_name": "{model}-{lr}"}}
    path = tmp_path / "tracked.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"tracking.mlflow.run_name': unknown fields \['lr'\]") as caught:
        main([str(path)])
    assert str(caught.value).startswith(f"{path}: ")


def test_the_next_command_quotes_a_path_with_a_space(tmp_path, capsys):
    path = tmp_path / "my experiment.yaml"
    path.write_text(EXAMPLE.read_text())
    assert main([str(path)]) == 0
    command = capsys.readouterr().out.split("`")[1]
    assert shlex.split(command) == ["snakemake", "-n", "--configfile", str(path)]


def test_a_key_given_twice_in_a_tab_indented_json_config_is_named(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('{\n\t"seeds": [1],\n\t"seeds": [2]\n}')
    with pytest.raises(ConfigError, match="'seeds' is given twice"):
        read_config_file(path)


def test_the_summary_counts_the_train_jobs_snakemake_plans(tmp_path, capsys):
    """The demo (three models, datasets of four tasks, each variant on its task's datasets, models by dataset):
    the training runs the summary counts are the train jobs of ``snakemake -n``, not models x datasets x variants x
    seeds."""
    import re
    import subprocess
    import sys

    demo = ROOT / "config" / "config.yaml"
    assert main([str(demo)]) == 0
    runs = int(re.search(r"(\d+) training runs", capsys.readouterr().out)[1])
    (tmp_path / "demo_data").symlink_to(ROOT / "demo_data")
    done = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--snakefile", str(ROOT / "Snakefile"),
                           "--configfile", str(demo)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    planned = re.search(r"^train\s+(\d+)$", done.stdout, flags=re.M)
    assert planned and runs == int(planned[1]), done.stdout[-2000:]


def test_a_nan_is_named_by_the_file_that_holds_it(tmp_path):
    """NaN is unequal to itself: the file's value must still be recognised as the one the config holds."""
    override = tmp_path / "override.yaml"
    override.write_text("training:\n  learning_rate: .nan\n")
    with pytest.raises(ConfigError) as caught:
        main([str(EXAMPLE), str(override)])
    assert str(caught.value).startswith(f"{override}: config key 'training.learning_rate': is nan, not a finite")
