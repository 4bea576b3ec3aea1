"""A vision_language dataset on a text-only model is refused when the workflow is parsed, where the model's
config is readable then (a tiny model, a local model folder, a prepared model); a hub model not yet
downloaded is left to the stage-time check (model_loading.check_task_architecture)."""
from __future__ import annotations

import json

import pytest

from workflow_scripts.core.errors import ConfigError
from workflow_scripts.model.task_fit import check_vision_language_models

VLM_DATASET = {"task": "vision_language", "source": {"type": "local", "path": "x"}, "metric": "exact_match",
               "fields": {"question": "q", "answers": "a", "image": "image"}}


def config(model: dict, listed: bool = True) -> dict:
    return {"models": {"m": model, "vlm": {"source": "tiny", "tiny": {"architecture": "llava"}}},
            "datasets": {"charts": {**VLM_DATASET, **({"models": ["vlm", "m"]} if listed else {})}}}


def local_model(tmp_path, model_type: str) -> dict:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": model_type}))
    return {"source": "local", "path": str(tmp_path / "model")}


def test_a_local_text_only_model_folder_is_refused_naming_its_config(tmp_path):
    with pytest.raises(ConfigError, match=r"datasets\.charts\.models.*'m' is a 'qwen2' model \(per .*model/config\.json\), "
                                          r"which reads text only; remove 'm' from datasets\.charts\.models"):
        check_vision_language_models(config(local_model(tmp_path, "qwen2")), root=tmp_path)


def test_without_a_models_list_the_fix_is_to_give_one(tmp_path):
    with pytest.raises(ConfigError, match=r"give datasets\.charts a models: list of vision-language models only"):
        check_vision_language_models(config({"source": "tiny", "tiny": {"architecture": "bert"}}, listed=False),
                                     root=tmp_path)


@pytest.mark.parametrize("model_type", ["llava", "idefics3"])
def test_a_local_vision_model_passes(tmp_path, model_type):
    check_vision_language_models(config(local_model(tmp_path, model_type)), root=tmp_path)


def test_an_unprepared_hub_model_is_left_to_the_stage_and_a_prepared_one_is_judged(tmp_path):
    hub = {"source": "hub", "hub_id": "org/text-model", "revision": "abc123"}
    check_vision_language_models(config(hub), root=tmp_path)  # nothing readable yet: the stage judges it
    (tmp_path / "resources" / "models" / "m").mkdir(parents=True)
    (tmp_path / "resources" / "models" / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"'m' is a 'llama' model \(per .*resources/models/m/config\.json\)"):
        check_vision_language_models(config(hub), root=tmp_path)


def test_a_model_with_its_own_code_is_left_to_the_loader(tmp_path):
    model = local_model(tmp_path, "custom_thing")
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen2", "auto_map": {"AutoModel": "x.Y"}}))
    check_vision_language_models(config(model), root=tmp_path)


# A masked_lm dataset on a model without a masked-LM form (issue 37): the same readable configs.
CORPUS = {"task": "masked_lm", "source": {"type": "local", "path": "x"}, "format": "text", "metric": "masked_accuracy"}


def corpus_config(model: dict) -> dict:
    return {"models": {"m": model, "bert": {"source": "tiny", "tiny": {"architecture": "bert"}}},
            "datasets": {"lines": {**CORPUS, "models": ["bert", "m"]}}}


@pytest.mark.parametrize("model_type, refused", [("llama", True), ("qwen2", True), ("bert", False), ("roberta", False)])
def test_a_masked_lm_dataset_on_a_local_model_is_judged_by_its_type(tmp_path, model_type, refused):
    from workflow_scripts.model.task_fit import check_masked_lm_models

    config = corpus_config(local_model(tmp_path, model_type))
    if not refused:
        check_masked_lm_models(config, root=tmp_path)
        return
    with pytest.raises(ConfigError, match=rf"datasets\.lines\.models.*'m' is a '{model_type}' model \(per .*model/config"
                                          r"\.json\), which predicts the next token only; remove 'm' from datasets\.lines"):
        check_masked_lm_models(config, root=tmp_path)


def test_a_masked_lm_dataset_on_an_unprepared_hub_model_is_left_to_the_stage(tmp_path):
    from workflow_scripts.model.task_fit import check_masked_lm_models

    check_masked_lm_models(corpus_config({"source": "hub", "hub_id": "org/causal", "revision": "abc123"}), root=tmp_path)
