"""Config validation: the JSON schema (with defaults) and the checks it cannot express."""
import copy

import pytest
import yaml

from data_helpers import ROOT, default_config
from workflow_scripts.errors import ConfigError
from workflow_scripts.experiment_config import check_config, load_config, validate_schema, validate_section


def write(tmp_path, config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("name", ["config.yaml", "smollm2.yaml", "real_hub.yaml"])
def test_shipped_configs_are_valid(name):
    config = load_config(ROOT / "config" / name)
    assert config["datasets"] and config["variants"]


def test_real_hub_config_names_the_real_ids_and_rank_128():
    config = load_config(ROOT / "config" / "real_hub.yaml")
    assert config["model"]["hub_id"] == "Qwen/Qwen2.5-7B-Instruct" and len(config["model"]["revision"]) == 40
    assert config["datasets"]["chartqa"]["source"]["id"] == "HuggingFaceM4/ChartQA"
    assert config["training"]["lora"]["rank"] == 128


def test_defaults_are_filled():
    config = load_config(ROOT / "config" / "config.yaml")
    ocr = config["datasets"]["ocrvqa_demo"]
    assert ocr["splits"] == {"train": "train", "validation": "validation", "test": "test"}
    assert ocr["format"] == "jsonl" and config["variants"]["baseline"]["extractor"] == {"type": "whole"}


def edit(path, value):
    """default config with ``value`` set at the dotted ``path`` (None deletes the key)."""
    config = default_config()
    *parents, last = path.split(".")
    node = config
    for part in parents:
        node = node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return config


@pytest.mark.parametrize("path, value, key, message", [
    ("datasets.chartqa_demo.source", {"type": "url", "url": "https://x/y.zip"}, "datasets.chartqa_demo.source.sha256", "required when source.type is 'url'"),
    ("datasets.chartqa_demo.source", {"type": "url", "url": "https://x/y.zip", "sha256": "abc"}, "datasets.chartqa_demo.source.sha256", "does not match"),
    ("datasets.chartqa_demo.source", {"type": "url", "url": "ftp://x/y.zip", "sha256": "0" * 64}, "datasets.chartqa_demo.source.url", "does not match"),
    ("datasets.chartqa_demo.source", {"type": "hub", "id": "HuggingFaceM4/ChartQA"}, "datasets.chartqa_demo.source.revision", "required"),
    ("datasets.chartqa_demo.source", {"type": "hub", "id": "HuggingFaceM4/ChartQA", "revision": "main"}, "datasets.chartqa_demo.source.revision", "a branch, not a pinned revision"),
    ("datasets.chartqa_demo.source", {"type": "local"}, "datasets.chartqa_demo.source.path", "required"),
    ("model", {"name": "m", "source": "hub", "hub_id": "Qwen/Qwen2.5-7B-Instruct", "revision": "master"}, "model.revision", "a branch"),
    ("model", {"name": "m", "source": "hub", "hub_id": "Qwen/Qwen2.5-7B-Instruct"}, "model.revision", "required"),
    ("model", {"name": "m", "source": "gguf"}, "model.gguf", "required"),
    ("model.name", "bad name!", "model.name", "does not match"),
    ("datasets.amr_demo.derived.aux.transform", "no_such_transform", "datasets.amr_demo.derived.aux.transform", "unknown transform"),
    ("datasets.chartqa_demo.splits", {"train": "train"}, "datasets.chartqa_demo.splits", "'test' is a required property"),
    ("datasets.chartqa_demo.fields", {"question": "query", "answer": "label"}, "datasets.chartqa_demo.fields", ""),
    ("datasets.chartqa_demo.max_rejected_fraction", 1.5, "datasets.chartqa_demo.max_rejected_fraction", "greater than the maximum"),
    ("datasets.chartqa_demo.derived", None, "variants.mtup.target", "refers to ['aux'], which dataset 'chartqa_demo' does not provide"),
    ("variants.mtup.extractor", {"type": "section"}, "variants.mtup.extractor.marker", "needs the final task's marker"),
    ("variants.baseline.prompt", "Title: {title}\n{question}", "variants.baseline.prompt", "refers to ['title']"),
    ("training.micro_batch", 5, "training.effective_batch", "not a multiple of micro_batch"),
    ("comparison.reference_variant", "plain", "comparison.reference_variant", "not one of the variants"),
])
def test_bad_config_names_the_key(tmp_path, path, value, key, message):
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, edit(path, value)))
    assert caught.value.key == key
    assert message in str(caught.value) and str(tmp_path / "config.yaml") in str(caught.value)


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_validate_section_fills_defaults_like_the_whole_config():
    settings = validate_section({"source": {"type": "local", "path": "d"}, "fields": {"question": "q", "answers": "a"},
                                 "metric": "exact_match"}, "datasets", "datasets.d")
    assert settings["format"] == "jsonl" and settings["flatten"] is False
    assert settings["max_rejected_fraction"] == 0.01 and settings["extra_fields"] == {} and settings["derived"] == {}
    model = validate_section({"name": "t", "source": "tiny"}, "model", "model")
    assert model["tiny"]["architecture"] == "llama" and model["trust_remote_code"] is False
    with pytest.raises(ConfigError, match=r"datasets\.d\.source\.type"):
        validate_section({"source": {"type": "ftp"}, "fields": {"question": "q", "answers": "a"}, "metric": "exact_match"},
                         "datasets", "datasets.d")


def test_validation_does_not_change_a_valid_config_a_second_time():
    config = validate_schema(default_config())
    again = validate_schema(copy.deepcopy(config))
    check_config(again)
    assert again == config
