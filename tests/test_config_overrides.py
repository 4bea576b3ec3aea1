"""``snakemake --config key=value``: the overrides users reach for work, or are refused before any job.

Snakemake reads a ``--config`` value with YAML's BaseLoader, so numbers inside a list or a mapping
arrive as text (``seeds=[1,2]`` gives ``['1', '2']``); ``check_workflow_config`` gives them back the
type the schema asks for. A dotted key (``training.max_steps=10``) is refused by Snakemake itself.
"""
import json
import re

import pytest

from data_helpers import default_config
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.core.experiment_config import deep_merge, retype_command_line_values, validate_schema


def overridden(overrides: dict) -> tuple[dict, dict]:
    """The demo config with ``overrides`` merged in as Snakemake merges --config, and the file's own config."""
    from_file = default_config()
    return deep_merge(from_file, overrides), from_file


def test_numbers_inside_lists_and_mappings_get_their_types_back():
    config, from_file = overridden({"seeds": ["1", "2"], "training": {"max_steps": "10", "learning_rate": "1e-4",
                                                                     "gradient_checkpointing": "false"},
                                    "evaluation": {"max_examples": "null"}})
    retype_command_line_values(config, from_file)
    assert config["seeds"] == [1, 2]
    assert config["training"]["max_steps"] == 10 and config["training"]["learning_rate"] == 1e-4
    assert config["training"]["gradient_checkpointing"] is False and config["evaluation"]["max_examples"] is None
    validate_schema(config, "config")  # and the config is valid


def test_text_stays_text_where_the_schema_wants_text_or_the_text_spells_nothing():
    config, from_file = overridden({"datasets": {"amr_demo": {"source": {"path": "2024"}}},
                                    "training": {"max_steps": "many"}})
    retype_command_line_values(config, from_file)
    assert config["datasets"]["amr_demo"]["source"]["path"] == "2024"
    with pytest.raises(ConfigError, match=r"config key 'training\.max_steps': 'many' is not of type 'integer', 'null'"):
        validate_schema(config, "config")


def test_a_quoted_number_in_a_config_file_is_still_refused():
    """Only what --config changed is retyped: a file's own '10' is a mistake in the file."""
    from_file = default_config()
    from_file["training"]["max_steps"] = "10"
    config = deep_merge(from_file, {})
    retype_command_line_values(config, from_file)
    with pytest.raises(ConfigError, match=r"config key 'training\.max_steps': '10' is not of type"):
        validate_schema(config, "config")


def training_arguments(output: str) -> list[dict]:
    return [json.loads(text) for text in re.findall(r"--training '(\{.*?\})'", output)]


def test_a_dry_run_takes_seeds_and_training_overrides(tmp_path):
    from test_dag import absolute_demo_config, config_file, snakemake

    code, output = snakemake(tmp_path, "-n", "-p", "--configfile",
                             str(config_file(tmp_path, absolute_demo_config(["amr_demo"]))),
                             "--replace-workflow-config", "--cores", "1",
                             "--config", "seeds=[3,4]", "training={max_steps: 7, learning_rate: 2e-4}")
    assert code == 0, output[-3000:]
    settings = training_arguments(output)
    assert settings and all(s["max_steps"] == 7 and s["learning_rate"] == 2e-4 for s in settings), output[-3000:]
    assert "seed3" in output and "seed4" in output and "seed1" not in output


def test_a_dry_run_refuses_a_dotted_key_before_any_job(tmp_path):
    from test_dag import absolute_demo_config, config_file, snakemake

    code, output = snakemake(tmp_path, "-n", "--configfile",
                             str(config_file(tmp_path, absolute_demo_config(["amr_demo"]))),
                             "--replace-workflow-config", "--cores", "1", "--config", "training.max_steps=10")
    assert code != 0 and "Job stats" not in output
    assert "Invalid config definition" in output, output[-2000:]
