"""Issue 43's vision-language inputs: what the processors are given, from every layout a model ships in.

- both processor file layouts (the Hub's / transformers 4's ``preprocessor_config.json``, transformers 5's
  ``processor_config.json``) read the same way by the memory check, pretokenise (hence training's collator, which
  rebuilds the image processor from tokenise_meta.json) and evaluation's processor; Qwen2/2.5/3-VL in the Hub's
  own layout load in this environment (no torchvision) with the PIL image processor, no network;
- a dynamic-resolution model folder without its processor file refused naming the user's folder and the file;
  a pixel budget on a fixed-size family, or below its own floor, refused when the config is read;
- tiny Gemma 3 under ``chat_template: true`` (its template's image slot), a chat template without one refused;
- LLaVA-OneVision with two images in a row: the model gets ``batch_num_images``, so the gate and evaluation agree
  with the tokens the processor wrote.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from test_vision_language_chain import run_evaluate, run_pretokenise
from test_vision_language_families import EVALUATION, TINY, VISION, gate_batch, png, prepare_tiny_vlms, split_rows
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.model import processor_files
from workflow_scripts.model import vision_language_model as vlm

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
BUILT = (*QWEN, "gemma3", "llava_onevision")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def charts(tmp_path_factory) -> Path:
    """A normalised set whose train and test rows hold two images each (test: one image, for the gate's mix)."""
    from datasets import Dataset, DatasetDict

    def two_images(prefix, n, offset=0):
        rows = split_rows(prefix, n, offset)
        rows["images"] = [images + [png((200, 40, 40), (24 + 4 * (k % 3), 32))] for k, images in enumerate(rows["images"])]
        return rows

    directory = tmp_path_factory.mktemp("two_images") / "data"
    DatasetDict({"train": Dataset.from_dict(two_images("train", 8)),
                 "test": Dataset.from_dict(two_images("test", 4, 8))}).save_to_disk(str(directory))
    (directory / "task_meta.json").write_text(json.dumps({"task": "vision_language"}))
    return directory


@pytest.fixture(scope="module")
def models(charts, tmp_path_factory) -> dict:
    return prepare_tiny_vlms(BUILT, charts, tmp_path_factory)


def vlm_config(tmp_path: Path, model: dict, variant: dict | None = None) -> tuple[dict, str]:
    """The demo's shapes dataset on one model ``m`` with its vision variant (plus ``variant``), read by load_config."""
    import yaml

    from test_dag import absolute_demo_config
    from workflow_scripts.checks.config import load_config

    config = absolute_demo_config(["shapes_demo"])
    config["models"] = {"m": model}
    config["datasets"]["shapes_demo"]["models"] = ["m"]
    config["variants"] = {"vision": {**config["variants"]["vision"], **(variant or {})}}
    config["comparison"]["reference_variant"] = {"vision_language": "vision"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path), str(path)


def hub_layout(prepared: Path, out: Path, *, pixel_keys: bool = False) -> Path:
    """``prepared`` (transformers 5's files) rewritten as the Hub ships the released Qwen-VL / LLaVA / Gemma 3
    repositories: ``preprocessor_config.json`` (the image processor's settings flat, with processor_class; Qwen's
    budget as min_pixels / max_pixels with ``pixel_keys``), ``chat_template.json``, processor_class in the
    tokenizer config, the processor's own settings (if any) flat in processor_config.json; no chat_template.jinja."""
    out.mkdir(parents=True)
    nested = json.loads((prepared / processor_files.PROCESSOR_FILE).read_text())
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        shutil.copyfile(prepared / name, out / name)
    flat = {**nested["image_processor"], "processor_class": nested["processor_class"]}
    if pixel_keys:
        size = flat.pop("size")
        flat.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    (out / processor_files.IMAGE_PROCESSOR_FILE).write_text(json.dumps(flat))
    own = {key: value for key, value in nested.items() if key != "image_processor"}
    if set(own) - {"processor_class"}:  # Gemma 3's image_seq_length, LLaVA-OneVision's num_image_tokens...: flat
        (out / processor_files.PROCESSOR_FILE).write_text(json.dumps(own))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": (prepared / "chat_template.jinja").read_text()}))
    tokenizer = json.loads((prepared / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "processor_class": nested["processor_class"]}))
    return out


# --- both layouts, every family, read alike ---
@pytest.mark.parametrize("family", BUILT)
def test_both_processor_layouts_are_read_alike_by_every_reader(family, models, charts, tmp_path):
    from datasets import load_from_disk

    from workflow_scripts.checks.memory import processor_max_pixels
    from workflow_scripts.core.entry_settings import ModelSettings

    prepared = models[family]
    hub = hub_layout(prepared, tmp_path / "hub", pixel_keys=family in QWEN)
    mine, theirs = processor_files.read(prepared), processor_files.read(hub)
    assert mine.processor_class == theirs.processor_class and mine.max_pixels() == theirs.max_pixels()
    # The memory check (snakemake -n) prices both at the processor's own budget (Qwen) or the tower's size.
    for directory in (prepared, hub):
        spec = ModelSettings.parse({"name": "m", "source": "local", "path": str(directory)}, "m", "model")
        assert processor_max_pixels("m", spec, tmp_path) == (4096 if family in QWEN else None)
    # pretokenise (the Hub layout loads without torchvision, the PIL image processor), training's recorded image
    # processor and evaluation's processor: the same.
    loaded = vlm.load_processor(hub)
    assert type(loaded).__name__ == mine.processor_class and type(loaded.image_processor).__name__.endswith("Pil")
    ours = run_pretokenise(prepared, charts, VISION, tmp_path / "ours", max_length=160)
    hubs = run_pretokenise(hub, charts, VISION, tmp_path / "hubs", max_length=160)
    assert load_from_disk(str(ours))["train"]["input_ids"] == load_from_disk(str(hubs))["train"]["input_ids"]
    recorded = [json.loads((path / "tokenise_meta.json").read_text())["image_processor"] for path in (ours, hubs)]
    assert recorded[0] == recorded[1]


def test_the_memory_check_prices_a_transformers_5_qwen_folder_at_its_budget(models, tmp_path):
    """Planted: before, only preprocessor_config.json was read, so a folder saved by transformers 5 was priced at
    one patch per image."""
    from workflow_scripts.checks.memory import processor_max_pixels
    from workflow_scripts.core.entry_settings import ModelSettings

    assert not (models["qwen2_5_vl"] / processor_files.IMAGE_PROCESSOR_FILE).exists()
    spec = ModelSettings.parse({"name": "m", "source": "local", "path": str(models["qwen2_5_vl"])}, "m", "model")
    assert processor_max_pixels("m", spec, tmp_path) == 4096


# --- a dynamic-resolution folder without its processor file ---
def test_a_qwen_folder_without_its_processor_file_is_refused_naming_the_folder_and_file(models, tmp_path):
    from workflow_scripts import prepare_model
    from workflow_scripts.model import task_fit

    folder = hub_layout(models["qwen2_vl"], tmp_path / "qwen")
    (folder / processor_files.IMAGE_PROCESSOR_FILE).unlink()
    expected = f"{folder} holds no preprocessor_config.json (nor processor_config.json)"
    config, path = vlm_config(tmp_path, {"source": "local", "path": str(folder)})
    with pytest.raises(ConfigError, match=re.escape(f"{path}: config key 'models.m.path': {expected}")):
        task_fit.check_vision_language_models(config, path, root=tmp_path)
    model = {"name": "q", "source": "local", "path": str(folder)}
    with pytest.raises(WorkflowError, match=re.escape(f"model.path {folder}: {expected}")):
        prepare_model.main(["--model", json.dumps(model), "--out", str(tmp_path / "prepared")])
    assert not (tmp_path / "prepared").exists()
    with pytest.raises(WorkflowError, match=re.escape(expected)):
        vlm.load_processor(folder)


@pytest.mark.parametrize(("architecture", "budget", "key", "words"), [
    ("llava", {"max_pixels": 4096}, "max_pixels", "resizes every image to one fixed size"),
    ("gemma3", {"max_pixels": 4096}, "max_pixels", "resizes every image to one fixed size"),
    ("llava_onevision", {"min_pixels": 1024}, "min_pixels", "never scales one up"),
])
def test_a_budget_the_family_cannot_apply_is_refused_when_the_config_is_read(architecture, budget, key, words, tmp_path):
    from workflow_scripts.model import task_fit

    model = {"source": "tiny", "tiny": {"architecture": architecture, **TINY}}
    config, path = vlm_config(tmp_path, model, budget)
    with pytest.raises(ConfigError, match=f"config key 'variants.vision.{key}': model 'm': a '{architecture}' model "
                                          f"\\(models.m.tiny.architecture\\) .*{words}"):
        task_fit.check_vision_language_models(config, path, root=tmp_path)
    model["tiny"]["architecture"] = "qwen2_vl"  # dynamic resolution: the budget applies
    task_fit.check_vision_language_models(*vlm_config(tmp_path, model, budget), root=tmp_path)


def test_a_budget_whose_floor_is_above_its_ceiling_is_refused_by_the_config_check(tmp_path):
    from workflow_scripts.core.entry_settings import VariantSettings
    from workflow_scripts.tasks import vision_language

    model = {"source": "tiny", "tiny": {"architecture": "qwen2_vl", **TINY}}
    with pytest.raises(ConfigError, match=r"config key 'variants.vision.max_pixels': 1024 is below min_pixels 4096"):
        vlm_config(tmp_path, model, {"max_pixels": 1024, "min_pixels": 4096})


# --- chat templates and their image slot ---
def test_tiny_gemma3_pretokenises_under_its_chat_template(models, charts, tmp_path):
    from datasets import load_from_disk

    data = run_pretokenise(models["gemma3"], charts, {**VISION, "chat_template": True}, tmp_path / "chat", max_length=160)
    token = json.loads((models["gemma3"] / "model_manifest.json").read_text())["image_token_id"]
    assert all(ids.count(token) == 2 * 4 for ids in load_from_disk(str(data))["train"]["input_ids"])  # 2 images x 4


def test_a_chat_template_without_an_image_slot_is_refused_naming_the_setting(models, charts, tmp_path):
    from workflow_scripts.model import tiny_vlm

    folder = tmp_path / "model"
    shutil.copytree(models["gemma3"], folder)
    (folder / "chat_template.jinja").write_text(tiny_vlm.CHAT_TEMPLATE)  # "<image>": not Gemma 3's slot
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    with pytest.raises(WorkflowError, match=r"chat_template: true: the chat template of the model in .* writes 0 image "
                                            r"slots \('<start_of_image>'.* for the row's 2 image\(s\)"):
        run_pretokenise(folder, charts, {**VISION, "chat_template": True}, tmp_path / "chat", max_length=160)


# --- LLaVA-OneVision: rows of two images ---
def test_llava_onevision_rows_of_two_images_pass_the_gate_and_evaluate(models, charts, tmp_path):
    from workflow_scripts.tasks.vision_language import TASK

    model_dir = models["llava_onevision"]
    data = run_pretokenise(model_dir, charts, VISION, tmp_path / "two", max_length=400)
    batch, model = gate_batch(model_dir, data)
    assert batch["batch_num_images"].tolist() == [2, 2, 2, 2]
    assert TASK.check_batch(batch, None, model).startswith("8 images")
    result = run_evaluate(tmp_path, model_dir, charts, VISION, "vision", "1", evaluation={**EVALUATION, "max_length": 400})
    assert result["n_examples"] == 4


def test_a_damaged_processor_file_is_named_by_the_memory_check(tmp_path):
    """Either layout's file, unreadable, stops snakemake -n naming the model and the file (not a JSON traceback)."""
    from workflow_scripts.checks.memory import processor_max_pixels
    from workflow_scripts.core.entry_settings import ModelSettings

    folder = tmp_path / "resources" / "models" / "m"
    folder.mkdir(parents=True)
    (folder / processor_files.PROCESSOR_FILE).write_text('{"image_processor": {')
    spec = ModelSettings.parse({"name": "m", "source": "hub", "hub_id": "o/m", "revision": "abc"}, "m", "model")
    with pytest.raises(ConfigError, match=re.escape(f"config key 'models.m': {folder / processor_files.PROCESSOR_FILE} "
                                                    "cannot be read as a processor config (")):
        processor_max_pixels("m", spec, tmp_path)
