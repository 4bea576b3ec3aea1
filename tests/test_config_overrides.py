"""``snakemake --config key=value``: the overrides users reach for work, or are refused before any job.

Snakemake reads a ``--config`` value with YAML's BaseLoader, so numbers inside a list or a mapping
arrive as text (``seeds=[1,2]`` gives ``['1', '2']``); ``check_workflow_config`` gives them back the
type the schema asks for. A dotted key (``training.max_steps=10``) is refused by Snakemake itself, in its
command-line parsing, before the workflow is read (so the workflow cannot word that message); a section's
key given at the top level (``max_steps=10``) is refused naming the form that works.
"""
import copy
import json
import re

import pytest

from data_helpers import default_config
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.core.config_files import (check_workflow_config, deep_merge, retype_command_line_values,
                                                validate_schema)


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


@pytest.mark.parametrize("overrides, message", [
    ({"max_steps": 10}, "--config: config key 'max_steps': is not a top-level setting but a key of training; set it "
                        "with --config 'training={max_steps: 10}' (Snakemake takes no dotted keys)"),
    ({"precision": "bf16"}, "--config: config key 'precision': is not a top-level setting but a key of training; set "
                            "it with --config 'training={precision: bf16}' (Snakemake takes no dotted keys)"),
    ({"gpus": 2}, "--config: config key 'gpus': is not a top-level setting but a key of training or evaluation; set "
                  "it with --config 'training={gpus: 2}' or --config 'evaluation={gpus: 2}' (Snakemake takes no dotted keys)"),
])
def test_a_section_key_given_at_the_top_level_names_the_form_that_works(tmp_path, overrides, message):
    from test_dag import config_file

    path = config_file(tmp_path, default_config())
    with pytest.raises(ConfigError) as caught:
        check_workflow_config([path], deep_merge(default_config(), overrides))
    assert str(caught.value) == message


def test_the_form_it_names_is_accepted(tmp_path):
    from test_dag import config_file

    path = config_file(tmp_path, default_config())
    config = deep_merge(default_config(), {"training": {"max_steps": "10"}})  # as Snakemake reads 'training={max_steps: 10}'
    check_workflow_config([path], config)
    assert config["training"]["max_steps"] == 10


def test_a_misplaced_key_in_a_config_file_gets_the_schema_message(tmp_path):
    """In a file the key is a plain unknown key: the --config hint would be wrong advice there."""
    from test_dag import config_file

    config = {**default_config(), "max_steps": 10}
    path = config_file(tmp_path, config)
    with pytest.raises(ConfigError, match=r"Additional properties are not allowed \('max_steps' was unexpected\)"):
        check_workflow_config([path], copy.deepcopy(config))


def training_arguments(output: str) -> list[dict]:
    return [json.loads(text) for text in re.findall(r"--training '(\{.*?\})'", output)]


def test_a_dry_run_takes_seeds_and_training_overrides(tmp_path):
    from test_dag import absolute_demo_config, config_file
    from test_dry_run_families import dry_run

    code, output = dry_run(tmp_path, "-n", "-p", "--configfile",
                           str(config_file(tmp_path, absolute_demo_config(["amr_demo"]))),
                           "--replace-workflow-config", "--cores", "1",
                           "--config", "seeds=[3,4]", "training={max_steps: 17, learning_rate: 2e-4}")
    assert code == 0, output[-3000:]
    settings = training_arguments(output)
    assert settings and all(s["max_steps"] == 17 and s["learning_rate"] == 2e-4 for s in settings), output[-3000:]
    assert "seed3" in output and "seed4" in output and "seed1" not in output


def test_a_dry_run_refuses_a_dotted_key_before_any_job(tmp_path):
    from test_dag import absolute_demo_config, config_file
    from test_dry_run_families import dry_run

    code, output = dry_run(tmp_path, "-n", "--configfile",
                           str(config_file(tmp_path, absolute_demo_config(["amr_demo"]))),
                           "--replace-workflow-config", "--cores", "1", "--config", "training.max_steps=10")
    assert code != 0 and "Job stats" not in output and not (tmp_path / "results").exists()
    assert "Invalid config definition: Config entry must start with a valid identifier." in output, output[-2000:]
