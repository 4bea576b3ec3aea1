"""LoRA's target_modules against the model's own module names, refused when the workflow is read where those names
are known then (a tiny text model, a local or prepared model's config.json), so a BERT-style model on a decoder's
default names stops at ``snakemake -n``, not at the sanity gate (issue 42)."""
from __future__ import annotations

import json

import pytest
import yaml

from data_helpers import single_model_config
from workflow_scripts.checks.config import load_config
from workflow_scripts.checks.lora_targets import check_lora_targets
from workflow_scripts.core.errors import ConfigError

BERT_CONFIG = {"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 2}


def topic_classifier(tmp_path, model: dict, variant_training: dict | None = None) -> dict:
    """The demo's topic classifier, run on ``model`` as the one model, read as the Snakefile reads it."""
    config = single_model_config()
    config["model"] = {"name": "enc", **model}
    config["datasets"] = {"topics_demo": config["datasets"]["topics_demo"]}
    config["variants"] = {name: {**variant, "training": variant_training or {}}
                          for name, variant in config["variants"].items() if variant.get("task") == "classification"}
    config["comparison"]["reference_variant"] = "plain"
    for variant in config["variants"].values():
        if not variant["training"]:
            del variant["training"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path)


def local_bert(tmp_path) -> dict:
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps(BERT_CONFIG))
    return {"source": "local", "path": str(tmp_path / "bert")}


def test_a_local_bert_on_the_default_targets_is_refused_naming_the_shared_key(tmp_path):
    config = topic_classifier(tmp_path, local_bert(tmp_path))
    with pytest.raises(ConfigError, match=r"config key 'training\.lora\.target_modules': 'q_proj' matches no module of "
                                          r"model 'enc' \(source: local, whose projection layers are named \['dense', "
                                          r"'key', 'query', 'value'\]\).*e\.g\. under model\.training\.lora"):
        check_lora_targets(config, "c.yaml", root=tmp_path)


def test_a_variants_override_is_the_key_named(tmp_path):
    config = topic_classifier(tmp_path, local_bert(tmp_path),
                              {"lora": {"target_modules": ["query", "valeu"]}})
    with pytest.raises(ConfigError, match=r"config key 'variants\.framed\.training\.lora\.target_modules': 'valeu' "
                                          r"matches no module"):
        check_lora_targets(config, "c.yaml", root=tmp_path)


def test_bert_names_pass_and_a_model_not_here_yet_is_left_to_the_gate(tmp_path):
    check_lora_targets(topic_classifier(tmp_path, local_bert(tmp_path),
                                        {"lora": {"target_modules": ["query", "key", "value", "dense"]}}), root=tmp_path)
    hub = {"source": "hub", "hub_id": "org/some-bert", "revision": "0123456789abcdef0123456789abcdef01234567"}
    (tmp_path / "hub").mkdir()
    check_lora_targets(topic_classifier(tmp_path / "hub", hub), root=tmp_path)  # nothing readable yet: the gate judges it


def test_the_demo_passes():
    check_lora_targets(load_config("config/config.yaml"), "config/config.yaml")
