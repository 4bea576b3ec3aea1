"""The tiny vision-language models (LLaVA, Idefics3) and what differs for them in loading, LoRA and the gate."""
from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest
import torch

from workflow_scripts.core.settings import LoraSettings
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model import model_loading, tiny_model, tiny_vlm
from workflow_scripts.model import vision_language_model as vlm
from workflow_scripts.training.preflight_checks import PreflightError

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 512, "seed": 0}
FAMILIES = ["llava", "idefics3"]
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0}


def png(colour, size=(40, 24)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A normalised vision set as normalise writes it: string fields plus an images column of PNG bytes."""
    from datasets import Dataset, DatasetDict

    directory = tmp_path_factory.mktemp("chart_corpus")
    n = 24
    rows = {
        "id": [f"train-{k}" for k in range(n)],
        "question": [f"What is the value of the bar labelled {k}?" for k in range(n)],
        "answers": [[str(k * 7)] for k in range(n)],
        "images": [[png((10 * k, 100, 200))] for k in range(n)],
    }
    DatasetDict({"train": Dataset.from_dict(rows)}).save_to_disk(str(directory))
    (directory / "task_meta.json").write_text(json.dumps({"task": "vision_language"}))
    return directory


@pytest.fixture(scope="module", params=FAMILIES)
def built(request, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    facts = tiny_vlm.build({**TINY, "architecture": request.param}, [corpus], out)
    return out, facts


def load(directory: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoProcessor.from_pretrained(str(directory)), AutoModelForImageTextToText.from_pretrained(str(directory))


def training_batch(processor, answers=("21", "140")):
    """Chat prompts with one image each, plus the answer; labels -100 on the prompt (image tokens included)."""
    from PIL import Image

    prompts, texts, images = [], [], []
    for k, answer in enumerate(answers):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Value of bar {k}?"}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(prompt)
        texts.append(prompt + answer + tiny_model.EOS_TOKEN)
        images.append(Image.open(io.BytesIO(png((30 * k, 80, 160), size=(48 + 16 * k, 32)))))
    processor.tokenizer.padding_side = "right"
    batch = processor(text=texts, images=images, padding=True, return_tensors="pt")
    labels = batch["input_ids"].clone()
    for row, (prompt, image) in enumerate(zip(prompts, images)):
        prompt_length = processor(text=[prompt], images=[image], return_tensors="pt")["input_ids"].shape[1]
        labels[row, :prompt_length] = -100
    labels[batch["attention_mask"] == 0] = -100
    return dict(batch), labels


def lora_model(directory: Path, *, train_tower=False, train_projector=True, targets=("q_proj", "v_proj")):
    """Through the workflow's own add_lora, with the full names lora_target_modules resolves."""
    _, model = load(directory)
    lora = LoraSettings(**{**LORA, "target_modules": vlm.lora_target_modules(model, list(targets), train_tower=train_tower),
                           "modules_to_save": vlm.modules_to_save(model, train_projector=train_projector)})
    return model_loading.add_lora(model, lora, gradient_checkpointing=False, task_type="CAUSAL_LM")


def backward(peft_model, processor):
    batch, labels = training_batch(processor)
    peft_model.train()
    loss = peft_model(**batch, labels=labels).loss
    loss.backward()
    return loss


# --- building and loading ----------------------------------------------------------------------------
def test_corpus_texts_skip_the_image_bytes(corpus):
    texts = list(tiny_model.corpus_texts([corpus]))
    assert texts and all(isinstance(t, str) for t in texts)
    assert len(texts) == 24 * 3  # id, question and the one answer of each row; the PNG bytes are skipped


def test_loads_offline_through_the_auto_classes(built, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory, facts = built
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "processor_config.json",
            "chat_template.jinja"} <= names
    processor, model = load(directory)
    expected = {"llava": ("LlavaProcessor", "LlavaForConditionalGeneration"),
                "idefics3": ("Idefics3Processor", "Idefics3ForConditionalGeneration")}[facts["architecture"]]
    assert (type(processor).__name__, type(model).__name__) == expected == (expected[0], facts["model_class"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    assert tokenizer.is_fast and tokenizer.pad_token == tiny_model.PAD_TOKEN  # not load_tokenizer's eos fallback
    assert model_loading.load_tokenizer(directory).pad_token == tiny_model.PAD_TOKEN
    assert tokenizer.chat_template == processor.chat_template == tiny_vlm.CHAT_TEMPLATE  # text-only templates too
    chat = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    tokenizer.chat_template = tiny_model.CHAT_TEMPLATE  # string content renders as on the text-only tiny model
    assert rendered == tokenizer.apply_chat_template(chat, tokenize=False)
    assert len(tokenizer) == facts["vocab_size"] == model.config.text_config.vocab_size
    image_token_id = tokenizer.convert_tokens_to_ids(tiny_vlm.IMAGE_TOKEN)
    assert image_token_id == model.config.image_token_id == facts["image_token_id"]
    assert facts["parameters"] == sum(p.numel() for p in model.parameters()) < 300_000
    assert 0 < facts["vision_parameters"] < facts["parameters"]
    assert model.config.text_config.initializer_range == TINY["hidden_size"] ** -0.5
    base = model_loading.load_base_model(directory, torch.device("cpu"), auto_class="AutoModelForImageTextToText")
    assert type(base).__name__ == facts["model_class"]


def test_build_is_deterministic(corpus, tmp_path):
    for family in FAMILIES:
        first, second, other = (tmp_path / f"{family}-{k}" for k in ("a", "b", "c"))
        tiny_vlm.build({**TINY, "architecture": family}, [corpus], first)
        tiny_vlm.build({**TINY, "architecture": family}, [corpus], second)
        tiny_vlm.build({**TINY, "architecture": family, "seed": 1}, [corpus], other)
        for name in ("model.safetensors", "tokenizer.json", "processor_config.json", "config.json"):
            assert (first / name).read_bytes() == (second / name).read_bytes(), (family, name)
        assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_tiny_settings_are_checked(corpus, tmp_path):
    with pytest.raises(WorkflowError, match=r"model.tiny.architecture 'llama' is not a vision-language"):
        tiny_vlm.build({**TINY, "architecture": "llama"}, [corpus], tmp_path / "a")
    with pytest.raises(WorkflowError, match=r"model.tiny.image_size 30 is not a multiple of model.tiny.patch_size 8"):
        tiny_vlm.build({**TINY, "architecture": "llava", "image_size": 30}, [corpus], tmp_path / "b")
    with pytest.raises(WorkflowError, match=r"not a multiple of model.tiny.scale_factor 2"):
        tiny_vlm.build({**TINY, "architecture": "idefics3", "image_size": 24}, [corpus], tmp_path / "c")
    with pytest.raises(WorkflowError, match=r"needs --corpus"):
        tiny_vlm.build({**TINY, "architecture": "llava"}, [], tmp_path / "d")


# --- image tokens, forward and backward ----------------------------------------------------------------
def test_processor_expands_each_image_into_the_models_feature_count(built):
    directory, facts = built
    processor, model = load(directory)
    batch, _ = training_batch(processor)
    per_row = (batch["input_ids"] == model.config.image_token_id).sum(dim=1)
    assert per_row.tolist() == [facts["image_tokens_per_image"]] * 2
    with torch.no_grad():
        extra = {"pixel_attention_mask": batch["pixel_attention_mask"]} if "pixel_attention_mask" in batch else {}
        features = model.model.get_image_features(batch["pixel_values"], **extra).pooler_output
    assert sum(f.reshape(-1, f.shape[-1]).shape[0] for f in features) == int(per_row.sum())
    assert vlm.check_image_tokens(batch, model) == f"2 images, {facts['image_tokens_per_image']} image tokens each"

    first = (batch["input_ids"][0] == model.config.image_token_id).nonzero()[0, 0]
    damaged = {**batch, "input_ids": batch["input_ids"].clone()}
    damaged["input_ids"][0, first] = processor.tokenizer.pad_token_id  # a truncation that cut one image token
    expected = 2 * facts["image_tokens_per_image"]
    with pytest.raises(PreflightError, match=rf"^image_tokens: the batch has {expected - 1} image tokens .* "
                                             rf"give {expected} image features"):
        vlm.check_image_tokens(damaged, model)


def test_forward_and_backward_with_masked_prompt_give_a_finite_loss(built):
    directory, _ = built
    processor, model = load(directory)
    batch, labels = training_batch(processor)
    image_positions = batch["input_ids"] == model.config.image_token_id
    assert (labels[image_positions] == -100).all() and (labels != -100).sum() >= 4
    loss = model(**batch, labels=labels).loss
    loss.backward()
    assert math.isfinite(loss.item()) and 4.0 < loss.item() < 9.0  # near ln(vocab) for random weights
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_pixel_dtype(built):
    processor, _ = load(built[0])
    batch, _ = training_batch(processor)
    assert vlm.check_pixel_dtype(batch, torch.float32).startswith("pixel_values")
    with pytest.raises(PreflightError,
                       match=r"^pixel_dtype: pixel_values are torch.float32 but the model runs in torch.bfloat16"):
        vlm.check_pixel_dtype(batch, torch.bfloat16)
    with pytest.raises(PreflightError, match=r"NaN or Inf"):
        vlm.check_pixel_dtype({**batch, "pixel_values": batch["pixel_values"] * float("nan")}, torch.float32)


# --- components and LoRA targets -----------------------------------------------------------------------
def test_components_name_each_part(built):
    directory, facts = built
    _, model = load(directory)
    parts = vlm.components(model)
    expected = {"llava": ("model.vision_tower", "model.multi_modal_projector", "model.language_model"),
                "idefics3": ("model.vision_model", "model.connector", "model.text_model")}[facts["architecture"]]
    assert (parts["vision_tower"], parts["projector"], parts["language_model"]) == expected
    modules = dict(model.named_modules())
    assert all(parts[key] in modules for key in ("vision_tower", "projector", "language_model", "output_layer"))
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["model.language_model.layers.0.self_attn.q_proj"
                                                                     if facts["architecture"] == "llava" else
                                                                     "model.text_model.layers.0.self_attn.q_proj"]))
    assert vlm.components(wrapped)["vision_tower"] == "base_model.model." + expected[0]
    with pytest.raises(WorkflowError, match=r"model class LlamaForCausalLM is not a supported vision-language model "
                                            r"for task vision_language \(supported: LlavaForConditionalGeneration"):
        from transformers import LlamaConfig, LlamaForCausalLM

        vlm.components(LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, vocab_size=16)))


def test_lora_targets_cover_the_language_model_only_unless_the_tower_is_trained(built):
    directory, _ = built
    _, model = load(directory)
    parts = vlm.components(model)
    names = vlm.lora_target_modules(model, ["q_proj", "v_proj"], train_tower=False)
    assert len(names) == 2 * TINY["num_layers"] and all(n.startswith(parts["language_model"] + ".") for n in names)
    assert all(n.endswith((".q_proj", ".v_proj")) for n in names)
    with_tower = vlm.lora_target_modules(model, ["q_proj", "v_proj"], train_tower=True)
    tower = [n for n in with_tower if n.startswith(parts["vision_tower"] + ".")]
    assert set(names) < set(with_tower) and len(tower) == 2 and set(with_tower) == set(names) | set(tower)
    with_head = vlm.lora_target_modules(model, ["lm_head", "q_proj"], train_tower=False)
    assert with_head == sorted(names[::2] + ["lm_head"])  # the output layer is on the language side
    assert vlm.modules_to_save(model, train_projector=True) == [parts["projector"]]
    assert vlm.modules_to_save(model, train_projector=False) == []


def test_lora_targets_refuse_typos_tower_paths_and_projector_layers(built):
    directory, _ = built
    _, model = load(directory)
    parts = vlm.components(model)
    with pytest.raises(WorkflowError, match=r"^training.lora.target_modules: 'q_prj' matches no Linear layer of the "
                                            r"language model \(closest: \['q_proj'"):
        vlm.lora_target_modules(model, ["q_prj"], train_tower=False)
    tower_layer = f"{parts['vision_tower']}.encoder.layers.0.self_attn.q_proj"
    for entry in (tower_layer, r".*\.q_proj", "fc1"):  # a path, a pattern, a name only the tower has
        with pytest.raises(WorkflowError, match=rf"^training.lora.target_modules: '{re.escape(entry)}' reaches into "
                                                r"the vision tower .* set training.lora.train_vision_tower: true"):
            vlm.lora_target_modules(model, [entry], train_tower=False)
    assert vlm.lora_target_modules(model, [tower_layer], train_tower=True) == [tower_layer]
    projector_layer = next(n for n, m in model.named_modules()
                           if n.startswith(parts["projector"] + ".") and isinstance(m, torch.nn.Linear))
    with pytest.raises(WorkflowError, match=r"names projector layers .* training.lora.train_projector: true"):
        vlm.lora_target_modules(model, [projector_layer.rsplit(".", 1)[-1]], train_tower=False)
    with pytest.raises(WorkflowError, match=r"'\(q_proj' is not a valid regular expression"):
        vlm.lora_target_modules(model, ["(q_proj"], train_tower=False)


# --- the gate's tower checks -----------------------------------------------------------------------------
def test_frozen_tower_after_peft_and_the_planted_faults(built):
    directory, _ = built
    peft_model = lora_model(directory)
    parts = vlm.components(peft_model)
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if n.startswith(parts["vision_tower"]))
    projector = [p for n, p in peft_model.named_parameters()
                 if n.startswith(parts["projector"]) and "modules_to_save" in n]
    assert projector and all(p.requires_grad for p in projector)  # saved and trained whole
    assert "vision tower frozen" in vlm.check_frozen_tower(peft_model, train_tower=False)

    for p in lora.values():  # the seed: adapters left with requires_grad=False
        p.requires_grad_(False)
    with pytest.raises(PreflightError, match=r"^frozen_tower: \d+ LoRA parameters have requires_grad=False .* Fix: "
                                             r"freeze the vision tower before PEFT"):
        vlm.check_frozen_tower(peft_model, train_tower=False)
    for p in lora.values():
        p.requires_grad_(True)
    tower_weight = next(p for n, p in peft_model.named_parameters() if n.startswith(parts["vision_tower"]))
    tower_weight.requires_grad_(True)
    for train_tower in (False, True):  # the tower's own weights never train, only its adapters may
        with pytest.raises(PreflightError, match=r"^frozen_tower: 1 vision-tower weights are trainable, not only"):
            vlm.check_frozen_tower(peft_model, train_tower=train_tower)


def test_tower_gradients_after_one_backward(built, tmp_path):
    directory, _ = built
    processor, _ = load(directory)
    peft_model = lora_model(directory)
    parts = vlm.components(peft_model)
    loss = backward(peft_model, processor)
    assert math.isfinite(loss.item())
    tower = [p for n, p in peft_model.named_parameters() if n.startswith(parts["vision_tower"])]
    assert all(p.grad is None for p in tower)
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)
    assert "no gradients" in vlm.check_tower_gradients(peft_model, train_tower=False)
    assert "image tokens each" in vlm.check_image_tokens(training_batch(processor)[0], peft_model)

    peft_model.save_pretrained(str(tmp_path / "adapter"))  # the projector rides along with the adapter
    from safetensors import safe_open

    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as saved:
        keys = list(saved.keys())
    assert any(parts["projector"].split(".", 2)[-1] in key for key in keys)
    assert not any(parts["vision_tower"].split(".", 2)[-1] in key for key in keys)

    peft_model.zero_grad(set_to_none=True)
    for n, p in peft_model.named_parameters():  # planted: the tower left trainable
        if n.startswith(parts["vision_tower"]):
            p.requires_grad_(True)
    backward(peft_model, processor)
    with pytest.raises(PreflightError, match=r"^tower_gradients: \d+ vision-tower parameters received gradients "
                                             r"though training.lora.train_vision_tower is false"):
        vlm.check_tower_gradients(peft_model, train_tower=False)


def test_an_adapted_tower_gets_gradients(built):
    directory, _ = built
    processor, _ = load(directory)
    peft_model = lora_model(directory, train_tower=True, train_projector=False)
    assert "4 of them in the vision tower" in vlm.check_frozen_tower(peft_model, train_tower=True)
    with pytest.raises(PreflightError, match=r"^frozen_tower: 4 vision-tower adapter parameters are trainable though "
                                             r"training.lora.train_vision_tower is false"):
        vlm.check_frozen_tower(peft_model, train_tower=False)
    backward(peft_model, processor)
    detail = vlm.check_tower_gradients(peft_model, train_tower=True)
    assert detail == "2 vision-tower adapters have non-zero gradients"

    tower_module = peft_model.get_submodule(vlm.components(peft_model)["vision_tower"])
    tower_module.requires_grad_(False)  # the seed's order: the tower frozen after PEFT added its adapters
    with pytest.raises(PreflightError, match=r"^frozen_tower: 4 LoRA parameters have requires_grad=False"):
        vlm.check_frozen_tower(peft_model, train_tower=True)

    plain = lora_model(directory, train_tower=False)
    with pytest.raises(PreflightError, match=r"^frozen_tower: training.lora.train_vision_tower is true but no "
                                             r"vision-tower parameter is trainable"):
        vlm.check_frozen_tower(plain, train_tower=True)
    backward(plain, processor)
    with pytest.raises(PreflightError, match=r"^tower_gradients: 0 of 0 vision-tower adapters got no gradient"):
        vlm.check_tower_gradients(plain, train_tower=True)
