"""``python -m workflow_scripts.checks FILE ...``: config files checked without Snakemake, in one line; and the
troubleshooting page's quoted command lines, run against the installed Snakemake (so the page stays true)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workflow_scripts.checks.__main__ import main
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.core.experiment_config import experiments

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "config" / "examples" / "classification.yaml"
PAGE = ROOT / "docs" / "troubleshooting.md"


def broken_flow_mapping(text: str) -> str:
    """The example with the closing brace of line 16's flow mapping (``fields: {...}``) removed: the page's
    YAML-syntax case."""
    lines = text.splitlines(keepends=True)
    assert lines[15].rstrip().endswith("topic}"), "the example's line 16 moved: update this test and the page"
    lines[15] = lines[15].replace("topic}", "topic", 1)
    return "".join(lines)


def test_a_valid_config_is_summarised_as_the_workflow_will_run_it(capsys):
    import yaml

    assert main([str(EXAMPLE)]) == 0
    line = capsys.readouterr().out.strip()
    config = yaml.safe_load(EXAMPLE.read_text())
    runs = len(list(experiments(_with_defaults(config))))
    assert line.startswith(f"{EXAMPLE}: valid (1 model, 1 dataset, 2 variants, 3 seeds, {runs} training runs)")
    assert "\n" not in line and runs == 6


def _with_defaults(config: dict) -> dict:
    from workflow_scripts.core.config_files import validate_schema

    validate_schema(config, "config")
    return config


def test_a_yaml_syntax_error_is_named_by_file_line_and_the_bracket_that_opened(tmp_path):
    path = tmp_path / "my_experiment.yaml"
    path.write_text(broken_flow_mapping(EXAMPLE.read_text()))
    with pytest.raises(ConfigError) as caught:
        main([str(path)])
    message = str(caught.value)
    assert message.startswith(f"{path}: config key '<file>': not valid YAML at line 17, column 11")
    assert "flow mapping at line 16, column 13" in message


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: tmp / "my_expermient.yaml", "config file not found"),
    (lambda tmp: tmp, "is a folder, not a config file"),
])
def test_a_missing_file_or_a_folder_is_one_line_not_a_traceback(tmp_path, make, expected):
    target = make(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(f"{target}: config key '<file>': {expected}")):
        main([str(EXAMPLE), str(target)])


def test_a_fault_is_named_by_the_later_file_that_sets_the_key(tmp_path):
    """Several files merge in order, as Snakemake merges several --configfile files; the fault is the
    override's, so the message names the override, not the example."""
    override = tmp_path / "override.yaml"
    override.write_text("training:\n  max_steps: -5\n")
    with pytest.raises(ConfigError) as caught:
        main([str(EXAMPLE), str(override)])
    assert str(caught.value).startswith(f"{override}: config key 'training.max_steps'")


def test_a_check_beyond_the_schema_runs_too(tmp_path):
    """checks/config.py's checks (here: the reference variant must be one of the variants), not only the schema."""
    config = tmp_path / "reference.yaml"
    config.write_text(EXAMPLE.read_text().replace("reference_variant: plain", "reference_variant: plian"))
    with pytest.raises(ConfigError, match="comparison.reference_variant"):
        main([str(config)])


def test_no_file_is_a_usage_error():
    with pytest.raises(WorkflowError, match="FILE"):
        main([])


def page_commands() -> list[tuple[str, str, str]]:
    """(section, command, quoted last line) of each ``$ ...`` block of the troubleshooting page's first part."""
    part = PAGE.read_text().split("\n## ")[1]
    found, section = [], "intro"
    for block in re.split(r"^```\w*\n", part, flags=re.M):
        heading = re.findall(r"^### (.+)$", block, flags=re.M)
        if block.startswith("$ "):
            lines = block.split("```")[0].strip().splitlines()
            found.append((section, lines[0][2:], lines[-1]))
        if heading:
            section = heading[-1]
    return found


def test_the_page_has_each_case():
    sections = {section for section, _, _ in page_commands()}
    assert {"intro", "A misspelt `--configfile` path", "A target written after `--configfile`",
            "A YAML syntax error in a `--configfile`", "A dotted key in `--config`"} <= sections


@pytest.mark.parametrize("section, command, last_line", page_commands(), ids=lambda value: str(value)[:40])
def test_the_pages_quoted_lines_are_what_the_command_prints(tmp_path, section, command, last_line):
    """Each quoted command, run in a folder holding ``config/my_experiment.yaml`` (the classification
    example; with the page's syntax error in the YAML case), ends with the line the page quotes."""
    (tmp_path / "config").mkdir()
    text = EXAMPLE.read_text()
    (tmp_path / "config" / "my_experiment.yaml").write_text(
        broken_flow_mapping(text) if "YAML syntax" in section else text)
    words = command.split()
    if words[0] == "snakemake":
        words = [str(Path(sys.executable).with_name("snakemake")), *words[1:], "--snakefile", str(ROOT / "Snakefile")]
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    printed = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert printed, f"{command} printed nothing"
    assert printed[-1] == last_line, f"{command}: the page quotes {last_line!r}, the command printed {printed[-1]!r}"
    assert (result.returncode == 0) == ("valid (" in last_line)
    # the folder holds only what the test wrote: no job ran
    assert sorted(path.name for path in tmp_path.iterdir() if path.name != ".snakemake") == ["config"]
