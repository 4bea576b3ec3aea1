"""Vision-language LoRA end to end: the stages as the rules call them (download -> normalise ->
prepare_model -> pretokenise -> sanity -> train -> evaluate) for tiny LLaVA and Idefics3 models.

- the demo shapes data (``make_images``, small) through the gate, a few training steps and the
  evaluation, for both model families, and what the adapter holds;
- the hub layouts (tests/vlm_layouts.py: ChartQA Parquet, InfographicVQA and OCR-VQA JSONL) driven
  only by dataset settings written as YAML, their planted faults rejected with reasons, then ChartQA
  on through the chain;
- pretokenise drops rows whose image tokens and prompt leave no room, never cutting image tokens;
- DDP on two gloo processes with a frozen tower, the projector trained, and micro-batches that mix
  rows with and without images (the demo tokenised with ``images: true`` and ``images: false``,
  interleaved): the same loss curve as one process;
- a run killed mid-way resumes to the same adapter;
- the text-only control (``images: false``): no image tokens, no pixel values.

Learnability is the demo's business (``make_images`` + config.yaml's 150 steps), not this file's:
the steps here are few. Helpers for DDP and kill-and-resume are tests/test_train.py's.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml

import ranks
from conftest import tiny_training_settings, training_json
from data_helpers import run_download, run_normalise
from test_train import adapter, log_rows, start_slow, train_argv, wait_for
from vlm_layouts import write_chartqa, write_infographicvqa, write_ocrvqa
from workflow_scripts import evaluate, prepare_model, pretokenise, sanity, train
from workflow_scripts.demo import make_images
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.checks.sections import validate_section
from workflow_scripts.data import batching
from workflow_scripts.training import checkpointing

FAMILIES = ("llava", "idefics3")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 512, "seed": 0}
IMAGE_TOKENS = {"llava": 16, "idefics3": 4}  # 32 px images in 8 px patches; idefics3 folds 2x2 patches
SHAPES_SETTINGS = {"task": "vision_language", "fields": {"id": "id", "question": "question", "answers": "answer",
                                                          "image": "image"},
                   "metric": "exact_match", "splits": {"train": "train", "validation": "validation", "test": "test"},
                   "max_rejected_fraction": 0.05}  # as config.yaml's shapes_demo: the demo plants a few faults
PROMPT = {"prompt": "Question: {question}\nAnswer:", "target": " {answer}"}
VISION, TEXT_ONLY = {**PROMPT, "images": True}, {**PROMPT, "images": False}
MAX_LENGTH = 64
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EVALUATION = {"split": "test", "max_new_tokens": 8, "batch_size": 32, "max_examples": None, "gpus": 0,
              "max_length": MAX_LENGTH}
# Parts of the model, as the adapter's tensor names spell them (transformers 5 layout, PEFT prefix).
LANGUAGE = {"llava": "base_model.model.model.language_model.", "idefics3": "base_model.model.model.text_model."}
PROJECTOR = {"llava": "base_model.model.model.multi_modal_projector.", "idefics3": "base_model.model.model.connector."}
TOWER = {"llava": "base_model.model.model.vision_tower.", "idefics3": "base_model.model.model.vision_model."}
OUTPUT_LAYER = "base_model.model.lm_head."


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# --- shared builders ---
def build_model(tmp: Path, family: str, corpus: Path) -> Path:
    tiny = {"name": f"tiny-{family}", "source": "tiny", "tiny": {"architecture": family, **TINY}}
    out = tmp / f"model-{family}"
    assert prepare_model.main(["--model", json.dumps(tiny), "--out", str(out), "--corpus", str(corpus)]) == 0
    return out


def run_pretokenise(model_dir: Path, data: Path, variant: dict, out: Path, max_length: int = MAX_LENGTH) -> Path:
    assert pretokenise.main(["--model", str(model_dir), "--data", str(data), "--task", "vision_language",
                             "--variant", json.dumps(variant), "--max-length", str(max_length), "--out", str(out),
                             "--report", str(out.parent / f"{out.name}_report.json")]) == 0
    return out


def tokenise_report(out: Path) -> dict:
    return json.loads((out.parent / f"{out.name}_report.json").read_text())


def run_evaluate(tmp: Path, model_dir: Path, data: Path, variant: dict, name: str, seed: str, adapter_dir=None,
                 metric: str = "exact_match", evaluation: dict = EVALUATION) -> dict:
    argv = ["--model", str(model_dir), "--data", str(data), "--task", "vision_language",
            "--variant", json.dumps(variant), "--metric", metric, "--evaluation", json.dumps(evaluation),
            "--dataset-name", "shapes", "--variant-name", name, "--seed", seed,
            "--predictions-out", str(tmp / name / seed / "predictions.jsonl"),
            "--summary-out", str(tmp / name / seed / "eval.json")]
    assert evaluate.main(argv + (["--adapter", str(adapter_dir)] if adapter_dir else [])) == 0
    return json.loads((tmp / name / seed / "eval.json").read_text())


def record_generate_calls(monkeypatch, loaded: list | None = None) -> list[dict]:
    """The keyword arguments of every model.generate call evaluate makes (names and tensor shapes);
    the models evaluate loads are appended to ``loaded`` when given."""
    from workflow_scripts.model import model_loading

    calls, load = [], model_loading.load_with_adapter

    def loading(*args, **kwargs):
        model = load(*args, **kwargs)
        if loaded is not None:
            loaded.append(model)
        generate = model.generate

        def recording(*a, **kw):
            calls.append({name: tuple(value.shape) if isinstance(value, torch.Tensor) else value
                          for name, value in kw.items() if name != "generation_config"})
            return generate(*a, **kw)

        model.generate = recording
        return model

    monkeypatch.setattr(model_loading, "load_with_adapter", loading)
    return calls


def image_token_id(model_dir: Path) -> int:
    return json.loads((model_dir / "model_manifest.json").read_text())["image_token_id"]


def prompt_lengths(tokenised: Path, split: str = "train") -> list[int]:
    from datasets import load_from_disk

    return [sum(label == -100 for label in labels) for labels in load_from_disk(str(tokenised))[split]["labels"]]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """The demo's shapes data, small, through download and normalise."""
    tmp = tmp_path_factory.mktemp("shapes")
    assert make_images.main(["--out", str(tmp / "shapes"), "--train", "96", "--validation", "16",
                                  "--test", "32"]) == 0
    settings = validate_section({**SHAPES_SETTINGS, "source": {"type": "local", "path": str(tmp / "shapes")}},
                                "datasets", "datasets.shapes")
    data, report = run_normalise("shapes", settings, run_download("shapes", settings, tmp), tmp)
    report = json.loads(report.read_text())
    assert {split: s["kept"] for split, s in report["splits"].items()} == {"train": 96, "validation": 16, "test": 32}
    assert report["splits"]["train"]["reasons"] == {"missing_image": 1, "unreadable_image": 1, "empty_value": 1}
    assert report["images"]["train"]["formats"] == {"PNG": 96}
    return data


@pytest.fixture(scope="module")
def models(shapes, tmp_path_factory) -> dict:
    """family -> prepared tiny model directory (tokenizer trained on the shapes data)."""
    tmp = tmp_path_factory.mktemp("models")
    return {family: build_model(tmp, family, shapes) for family in FAMILIES}


@pytest.fixture(scope="module")
def tokenised(shapes, models, tmp_path_factory) -> dict:
    """(family, 'vision' | 'text') -> pre-tokenised shapes data."""
    tmp = tmp_path_factory.mktemp("tokenised")
    return {(family, name): run_pretokenise(models[family], shapes, variant, tmp / f"{family}-{name}")
            for family in FAMILIES for name, variant in (("vision", VISION), ("text", TEXT_ONLY))}


# --- 1. both families through sanity -> train -> evaluate ---
@pytest.mark.parametrize("family, train_projector", [("llava", True), ("idefics3", False)])
def test_gate_train_and_evaluate_both_families(family, train_projector, shapes, models, tokenised, tmp_path,
                                               monkeypatch):
    model_dir, data = models[family], tokenised[(family, "vision")]
    settings = tiny_training_settings(max_steps=20, learning_rate=3e-3, effective_batch=16, micro_batch=8,
                                      max_length=MAX_LENGTH, warmup_steps=5, checkpoint_every=100, log_every=5,
                                      lora={"rank": 8, "alpha": 16, "target_modules": [*ALL_LINEAR, "lm_head"],
                                            "train_projector": train_projector})
    common = ["--model", str(model_dir), "--data", str(data), "--training", training_json(settings), "--seed", "1"]
    assert sanity.main([*common, "--out", str(tmp_path / "sanity.json")]) == 0
    gate = json.loads((tmp_path / "sanity.json").read_text())
    checks = {c["name"]: c for c in gate["checks"]}
    assert gate["passed"] and all(c["passed"] for c in gate["checks"])
    assert {"vision_language_model", "vision_language_gradients", "vision_language_batch"} <= set(checks)
    assert "vision tower frozen" in checks["vision_language_model"]["detail"]
    assert f"{IMAGE_TOKENS[family]} image tokens each" in checks["vision_language_batch"]["detail"]

    out = tmp_path / "run"
    assert train.main([*common, "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
                       "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")]) == 0
    assert [r["step"] for r in log_rows(out)] == list(range(1, 21))

    saved = adapter(out)
    lora_names = [n for n in saved if "lora_" in n]
    assert lora_names and all(n.startswith((LANGUAGE[family], OUTPUT_LAYER)) for n in lora_names), lora_names
    assert not [n for n in saved if n.startswith(TOWER[family])]  # nothing of the vision tower
    projector = [n for n in saved if n.startswith(PROJECTOR[family])]
    assert bool(projector) == train_projector and all("lora_" not in n for n in projector)  # saved whole
    # Anything else is PEFT's save_embedding_layers="auto" copy of the output layer (lm_head is targeted).
    others = set(saved) - set(lora_names) - set(projector)
    assert all(n.startswith(OUTPUT_LAYER) for n in others), others
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert not [t for t in config["target_modules"] if "vision" in t]
    assert (config["modules_to_save"] or []) == ([PROJECTOR[family][len("base_model.model."):-1]]
                                                 if train_projector else [])
    trained = [saved[n] for n in lora_names if "lora_B" in n]
    assert all(t.abs().sum() > 0 for t in trained)  # lora_B starts at zero: every adapter trained

    loaded = []
    calls = record_generate_calls(monkeypatch, loaded)
    result = run_evaluate(tmp_path, model_dir, shapes, VISION, "vision", "1", out / "adapter")
    from peft import get_peft_model_state_dict

    evaluated = get_peft_model_state_dict(loaded[0])  # what evaluate generates with: the trained projector too
    assert set(saved) <= set(evaluated)
    for name in saved:
        assert torch.equal(evaluated[name], saved[name]), name
    assert result["task"] == "vision_language" and result["images"] is True
    assert result["metric"] == "exact_match" and 0.0 <= result["score"] <= 1.0 and result["n_examples"] == 32
    assert calls and all("pixel_values" in call for call in calls)
    assert sum(call["input_ids"][0] for call in calls) == 32
    predictions = (tmp_path / "vision" / "1" / "predictions.jsonl").read_text().splitlines()
    assert len(predictions) == 32


# --- 2. hub layouts through the dataset settings only ---
LAYOUT_YAML = {
    "chartqa": """
        task: vision_language
        format: parquet
        splits: {train: train, validation: val, test: test}
        fields: {question: query, answers: label, image: image}
        metric: relaxed_accuracy
        max_rejected_fraction: 0.5
        contamination: {accept: true}   # vlm_layouts draws val/test charts equal to train's first ones
    """,
    "infographicvqa": """
        task: vision_language
        splits: {train: train, test: validation}   # its test split is unlabelled: evaluate on val
        fields: {id: questionId, question: question, answers: answers, image: image}
        metric: anls
        max_rejected_fraction: 0.5
    """,
    "ocrvqa": """
        task: vision_language
        flatten: true
        fields: {id: image_id, question: questions, answers: answers, image: image}
        metric: exact_match
        max_rejected_fraction: 0.5
    """,
}
WRITERS = {"chartqa": write_chartqa, "infographicvqa": write_infographicvqa, "ocrvqa": write_ocrvqa}


def layout_settings(name: str, directory: Path) -> dict:
    settings = yaml.safe_load(LAYOUT_YAML[name])
    settings["source"] = {"type": "local", "path": str(directory)}
    return validate_section(settings, "datasets", f"datasets.{name}")


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    """name -> (settings, planted faults, normalised dir, normalise report)."""
    out = {}
    for name, writer in WRITERS.items():
        tmp = tmp_path_factory.mktemp(name)
        planted = writer(tmp / "source")
        settings = layout_settings(name, tmp / "source")
        data, report = run_normalise(name, settings, run_download(name, settings, tmp), tmp)
        out[name] = (settings, planted, data, json.loads(report.read_text()))
    return out


def rejected(report: dict, reason: str) -> list[dict]:
    return report["reasons"].get(reason, {}).get("examples", [])


def test_layout_settings_get_their_defaults():
    from workflow_scripts.core.errors import ConfigError

    settings = layout_settings("chartqa", Path("/nowhere"))
    assert settings["format"] == "parquet" and settings["flatten"] is False
    assert layout_settings("infographicvqa", Path("/nowhere"))["format"] == "jsonl"
    assert layout_settings("ocrvqa", Path("/nowhere"))["splits"] == {"train": "train", "validation": "validation",
                                                                     "test": "test"}
    # Every dataset is evaluated on evaluation.split unless it names its own evaluation_split: one without
    # a test split is refused by name, and runs once it names validation.
    from data_helpers import default_config
    from workflow_scripts.checks.config import check_config
    from workflow_scripts.core.config_files import validate_schema

    test_left_out = yaml.safe_load(LAYOUT_YAML["infographicvqa"])
    test_left_out.update(splits={"train": "train", "validation": "validation"}, models=["tiny-llava"],
                         source={"type": "local", "path": "/nowhere"})
    config = default_config()
    config["datasets"]["infographicvqa"] = test_left_out
    validate_schema(config)
    with pytest.raises(ConfigError, match="'evaluation.split': 'test' is not a split of dataset 'infographicvqa'.*"
                                          "set datasets.infographicvqa.evaluation_split to validation$"):
        check_config(config)
    test_left_out["evaluation_split"] = "validation"
    check_config(config)


def test_chartqa_parquet_rejects_the_empty_query_and_the_truncated_image(layouts):
    _, planted, data, report = layouts["chartqa"]
    train = report["splits"]["train"]
    assert (train["examined"], train["kept"]) == (6, 4)
    assert train["reasons"] == {"empty_value": 1, "unreadable_image": 1}
    (empty,) = rejected(report, "empty_value")
    assert (empty["split"], empty["row"], empty["field"]) == ("train", planted["empty_query"]["row"], "query")
    assert empty["file"].endswith("train.parquet")
    (broken,) = rejected(report, "unreadable_image")
    assert (broken["split"], broken["row"], broken["field"]) == ("train", planted["truncated_image"]["row"], "image")
    assert broken["file"].endswith("train.parquet") and "cannot be decoded" in broken["detail"]
    assert report["splits"]["validation"]["source_split"] == "val"
    overlap = report["contamination"]["splits"]["validation"]  # accepted in the YAML, still reported
    assert overlap["accepted"] and overlap["overlapping"] == 2
    images = report["images"]
    assert images["train"]["examples"] == images["train"]["images"] == 4
    assert images["train"]["formats"] == {"PNG": 4} and images["train"]["max_images_per_example"] == 1
    assert images["train"]["width"] == {"min": 40, "median": 40, "max": 40}
    assert images["train"]["height"] == {"min": 32, "median": 32, "max": 32}
    assert images["test"]["examples"] == 3
    from datasets import load_from_disk

    rows = load_from_disk(str(data))["train"].to_list()
    assert len(rows) == 4 and all(len(row["images"]) == 1 and row["images"][0][:4] == b"\x89PNG" for row in rows)


def test_infographicvqa_rejects_the_missing_image_and_leaves_the_unlabelled_test(layouts):
    _, planted, data, report = layouts["infographicvqa"]
    missing = planted["missing_image"]
    assert report["splits"]["train"]["reasons"] == {"missing_image": 1}
    (example,) = rejected(report, "missing_image")
    assert (example["split"], example["row"], example["field"]) == ("train", missing["row"], "image")
    assert example["file"].endswith("train.jsonl") and example["line"] == missing["row"] + 1
    assert missing["path"] in example["detail"]
    assert {canonical: s["source_split"] for canonical, s in report["splits"].items()} == {
        "train": "train", "test": "validation"}
    assert not (Path(report["raw"]) / "test.jsonl").exists()  # download copies the mapped splits only
    assert report["images"]["train"]["examples"] == 5 and report["images"]["train"]["formats"] == {"JPEG": 5}
    assert report["images"]["train"]["width"]["max"] == 24 and report["images"]["train"]["height"]["max"] == 36


def test_infographicvqa_unlabelled_test_split_fails_normalise_by_name(layouts, tmp_path):
    settings, planted, _, _ = layouts["infographicvqa"]
    settings = {**settings, "splits": {"train": "train", "test": "test"}}
    raw = Path(settings["source"]["path"])
    with pytest.raises(WorkflowError) as failure:
        run_normalise("infographicvqa", settings, raw, tmp_path)
    message = str(failure.value)
    assert "split 'test'" in message and "so no row is left" in message and "missing_field" in message
    assert "'answers'" in message


def test_ocrvqa_flattened_rejects_the_length_mismatch(layouts):
    _, planted, data, report = layouts["ocrvqa"]
    mismatch = planted["length_mismatch"]
    train = report["splits"]["train"]
    assert train["reasons"] == {"length_mismatch": 1} and train["kept"] == planted["pairs"]["train"]
    (example,) = rejected(report, "length_mismatch")
    assert (example["split"], example["row"]) == ("train", mismatch["row"]) and example["file"].endswith("train.jsonl")
    from datasets import load_from_disk

    rows = load_from_disk(str(data))["train"].to_list()
    assert len(rows) == planted["pairs"]["train"] and all(len(row["images"]) == 1 for row in rows)
    assert report["images"]["train"]["formats"] == {"JPEG": report["images"]["train"]["images"]}


def test_ocrvqa_image_statistics_count_the_rows_that_reach_the_data(layouts):
    _, planted, _, report = layouts["ocrvqa"]
    for split in ("train", "validation", "test"):
        assert report["images"][split]["examples"] == report["splits"][split]["kept"], split


def test_chartqa_through_the_chain_with_a_tiny_llava(layouts, tmp_path, monkeypatch):
    settings, _, data, _ = layouts["chartqa"]
    model_dir = build_model(tmp_path, "llava", data)
    tokenised_dir = run_pretokenise(model_dir, data, VISION | {"prompt": "{question}", "target": " {answer}"},
                                    tmp_path / "tokenised")
    assert tokenise_report(tokenised_dir)["splits"]["train"]["kept"] == 4
    training = tiny_training_settings(max_steps=3, effective_batch=4, micro_batch=2, max_length=MAX_LENGTH,
                                      checkpoint_every=100, lora={"train_projector": True})
    common = ["--model", str(model_dir), "--data", str(tokenised_dir), "--training", training_json(training), "--seed", "1"]
    assert sanity.main([*common, "--out", str(tmp_path / "sanity.json")]) == 0
    gate = json.loads((tmp_path / "sanity.json").read_text())
    assert gate["passed"]
    # ChartQA's 40x32 charts are padded square and resized: still 16 image tokens each.
    assert "16 image tokens each" in {c["name"]: c for c in gate["checks"]}["vision_language_batch"]["detail"]
    out = tmp_path / "run"
    assert train.main([*common, "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
                       "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")]) == 0
    calls = record_generate_calls(monkeypatch)
    result = run_evaluate(tmp_path, model_dir, data, VISION | {"prompt": "{question}", "target": " {answer}"},
                          "chartqa", "1", out / "adapter", metric=settings["metric"],
                          evaluation={**EVALUATION, "batch_size": 2})
    assert result["metric"] == "relaxed_accuracy" and result["n_examples"] == 3 and result["images"] is True
    assert len(calls) == 2 and all(call["pixel_values"][0] == call["input_ids"][0] for call in calls)


# --- 3. pretokenise drops, never truncates through image tokens ---
def test_pretokenise_drops_rows_whose_image_tokens_fill_max_length(shapes, models, tokenised, tmp_path):
    model_dir = models["llava"]
    lengths = prompt_lengths(tokenised[("llava", "vision")])
    shortest = min(lengths)
    assert shortest > IMAGE_TOKENS["llava"] and max(lengths) > shortest  # two question lengths: some rows survive
    cut = shortest + 1  # room for one target token after the shortest prompts only
    out = run_pretokenise(model_dir, shapes, VISION, tmp_path / "short", max_length=cut)
    train = tokenise_report(out)["splits"]["train"]
    expected_dropped = sum(length >= cut for length in lengths)
    assert train["rows"] == 96 and train["dropped"] == expected_dropped > 0
    # "truncated" counts the dropped rows too (their target is cut entirely), as generation's report does.
    assert train["kept"] == 96 - expected_dropped and train["truncated"] == 96
    from datasets import load_from_disk

    token = image_token_id(model_dir)
    for row in load_from_disk(str(out))["train"]:
        assert row["input_ids"].count(token) == IMAGE_TOKENS["llava"]  # every image token kept
        assert len(row["input_ids"]) == cut and row["labels"][-1] != -100  # one target token left
        assert len(row["images"]) == 1


def test_pretokenise_with_no_row_left_fails_with_one_message(shapes, models, tokenised, tmp_path):
    cut = min(prompt_lengths(tokenised[("llava", "vision")]))
    with pytest.raises(WorkflowError) as failure:
        run_pretokenise(models["llava"], shapes, VISION, tmp_path / "none", max_length=cut)
    message = str(failure.value)
    assert "split 'train'" in message and f"--max-length {cut}" in message and "no row keeps a target token" in message
    assert not (tmp_path / "none").exists() and not (tmp_path / "none_report.json").exists()
    # Below the image tokens alone: the same refusal, not a cut through them.
    with pytest.raises(WorkflowError, match="no row keeps a target token"):
        run_pretokenise(models["llava"], shapes, VISION, tmp_path / "tiny", max_length=IMAGE_TOKENS["llava"] - 4)


def test_pretokenise_no_row_left_message_names_the_image_tokens(shapes, models, tokenised, tmp_path):
    cut = min(prompt_lengths(tokenised[("llava", "vision")]))
    with pytest.raises(WorkflowError, match="image tokens"):
        run_pretokenise(models["llava"], shapes, VISION, tmp_path / "none", max_length=cut)


def test_pretokenise_cache_follows_the_processor_config(shapes, models, tmp_path):
    import shutil

    model_dir = shutil.copytree(models["idefics3"], tmp_path / "model")
    out = run_pretokenise(model_dir, shapes, VISION, tmp_path / "tokenised")
    config = json.loads((model_dir / "processor_config.json").read_text())
    mean = [0.48145466, 0.4578275, 0.40821073]  # CLIP's, instead of 0.5
    assert config["image_processor"]["image_mean"] != mean
    config["image_processor"]["image_mean"] = mean
    (model_dir / "processor_config.json").write_text(json.dumps(config))
    from workflow_scripts.tasks import vision_language

    vision_language._processor.cache_clear()  # a new stage process would load the processor afresh
    run_pretokenise(model_dir, shapes, VISION, out)
    assert json.loads((out / "tokenise_meta.json").read_text())["image_processor"]["image_mean"] == mean


def test_chat_template_puts_the_image_inside_the_user_turn(shapes, models, tmp_path):
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    out = run_pretokenise(models["llava"], shapes, {**VISION, "chat_template": True}, tmp_path / "chat")
    text = AutoTokenizer.from_pretrained(str(models["llava"])).decode(load_from_disk(str(out))["train"][0]["input_ids"])
    assert text.index("<|user|>") < text.index("<image>") < text.index("<|assistant|>"), text


# --- 4 and 5. DDP with mixed image/text micro-batches; kill and resume ---
STEPS, CHECKPOINT_EVERY = 8, 4


def ddp_settings(processes: int) -> dict:
    return tiny_training_settings(max_steps=STEPS, checkpoint_every=CHECKPOINT_EVERY, cpu_processes=processes,
                                  effective_batch=16, micro_batch=4, max_length=MAX_LENGTH,
                                  # Length grouping would put the (longer) image rows into global batches of
                                  # their own; without it each global batch mixes both kinds.
                                  length_grouping=False, lora={"dropout": 0.1, "train_projector": True})


@pytest.fixture(scope="module")
def mixed(tokenised, tmp_path_factory) -> Path:
    """The llava shapes data with images (even rows) and without (odd rows), interleaved: one tokenised set.

    Built from two real pretokenise outputs; the text rows hold ``images: []`` and no image token, as
    ``images: false`` writes them. The meta is the image variant's (its image processor settings)."""
    from datasets import DatasetDict, concatenate_datasets, load_from_disk

    vision, text = tokenised[("llava", "vision")], tokenised[("llava", "text")]
    with_images, without = load_from_disk(str(vision))["train"], load_from_disk(str(text))["train"]
    assert with_images["id"] == without["id"]
    half = len(with_images) // 2
    combined = concatenate_datasets([with_images.select(range(0, 2 * half, 2)), without.select(range(1, 2 * half, 2))])
    order = [k for pair in zip(range(half), range(half, 2 * half)) for k in pair]
    train_split = combined.select(order).flatten_indices()
    out = tmp_path_factory.mktemp("mixed") / "tokenised"
    DatasetDict({"train": train_split, "validation": load_from_disk(str(vision))["validation"]}).save_to_disk(str(out))
    meta = json.loads((vision / "tokenise_meta.json").read_text())
    meta["cache_key"] = "mixed-" + meta["cache_key"]
    (out / "tokenise_meta.json").write_text(json.dumps(meta))
    return out


def test_mixed_set_mixes_images_within_micro_batches_and_ranks(mixed, models):
    """What the DDP test relies on: micro-batches with and without images, and steps where one rank's
    synchronising (last) micro-batch has no image while the projector is trained."""
    from datasets import load_from_disk

    table = load_from_disk(str(mixed))["train"]
    has_image = [bool(images) for images in table["images"]]
    token = image_token_id(models["llava"])
    assert all((token in ids) == image for ids, image in zip(table["input_ids"], has_image))
    assert sum(has_image) == len(has_image) // 2
    settings = ddp_settings(2)
    plan = batching.GlobalBatchPlan(table["length"], settings.effective_batch, 1, settings.length_grouping)
    mixed_batches, textual_sync = 0, 0
    for step in range(STEPS):
        micro = plan.micro_batches(step, settings.micro_batch)
        kinds = [{has_image[i] for i in batch} for batch in micro]
        mixed_batches += sum(kind == {True, False} for kind in kinds)
        textual_sync += sum(kinds[rank + (len(micro) // 2 - 1) * 2] == {False} for rank in range(2))
    assert mixed_batches > 0 and textual_sync > 0


@pytest.fixture(scope="module")
def one_process(models, mixed, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixed-1p")
    assert train.main(train_argv(out, models["llava"], mixed, ddp_settings(1))) == 0
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 1
    return out


@pytest.fixture(scope="module")
def two_processes(models, mixed, tmp_path_factory):
    """The 2-process run (gloo), two ranks forked from this process (tests/ranks.py): (out dir, the ranks'
    results)."""
    out = tmp_path_factory.mktemp("mixed-2p")
    return out, ranks.run_stage(train.main, train_argv(out, models["llava"], mixed, ddp_settings(2)), timeout=240)


def test_one_and_two_processes_follow_the_same_loss_curve_with_mixed_batches(one_process, two_processes):
    out, results = two_processes
    output = "\n".join(result.output for result in results)
    for symptom in ("unused", "finished reduction", "collective mismatch"):
        assert symptom not in output, output[-3000:]
    ranks.assert_succeeded(results)
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 2
    one, two = [r["loss"] for r in log_rows(one_process)], [r["loss"] for r in log_rows(out)]
    assert len(one) == STEPS and one == pytest.approx(two, rel=1e-5, abs=1e-6)
    assert sum(one[-3:]) < sum(one[:3])  # it learns: not a comparison of two flat curves
    ours, theirs = adapter(one_process), adapter(out)
    assert set(ours) == set(theirs) and any(n.startswith(PROJECTOR["llava"]) for n in ours)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-6)


def test_killed_run_resumes_to_identical_adapter(tmp_path, capsys, models, mixed, one_process):
    settings = ddp_settings(1)
    process = start_slow(tmp_path, models["llava"], mixed, settings)  # each micro-step slowed, in a forked process
    wait_for(lambda: (tmp_path / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}" / "state.json").exists(), process,
             timeout=180)
    process.send_signal(signal.SIGKILL)  # no chance to clean up, as with an OOM kill or node failure
    process.communicate()
    step, _ = checkpointing.checkpoints(tmp_path / "checkpoints")[-1]
    assert CHECKPOINT_EVERY <= step < STEPS and not (tmp_path / "adapter").exists()
    capsys.readouterr()
    assert train.main(train_argv(tmp_path, models["llava"], mixed, settings)) == 0
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((tmp_path / "run_manifest.json").read_text())["resumed_from_step"] == step
    ours, theirs = adapter(tmp_path), adapter(one_process)
    assert set(ours) == set(theirs) and any(n.startswith(PROJECTOR["llava"]) for n in ours)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert [r["loss"] for r in log_rows(tmp_path)] == [r["loss"] for r in log_rows(one_process)]


# --- 6. the text-only control ---
@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_control_has_no_image_tokens_and_evaluates_without_pixels(family, shapes, models, tokenised,
                                                                             tmp_path, monkeypatch):
    from datasets import load_from_disk

    text, vision = tokenised[(family, "text")], tokenised[(family, "vision")]
    meta = json.loads((text / "tokenise_meta.json").read_text())
    assert meta["templates"]["images"] is False and meta["image_processor"] is None
    assert json.loads((vision / "tokenise_meta.json").read_text())["image_processor"]["image_processor_type"]
    token = image_token_id(models[family])
    text_rows, vision_rows = load_from_disk(str(text)), load_from_disk(str(vision))
    for split in ("train", "validation"):
        assert all(token not in ids for ids in text_rows[split]["input_ids"])
        assert all(images == [] for images in text_rows[split]["images"])
        assert all(ids.count(token) == IMAGE_TOKENS[family] for ids in vision_rows[split]["input_ids"])
        # Same questions and targets: the image's tokens (and their separator) are the whole difference.
        assert text_rows[split]["id"] == vision_rows[split]["id"]
        for with_image, without in zip(vision_rows[split]["labels"], text_rows[split]["labels"]):
            assert [t for t in with_image if t != -100] == [t for t in without if t != -100]
    calls = record_generate_calls(monkeypatch)
    result = run_evaluate(tmp_path, models[family], shapes, TEXT_ONLY, "text_only", "base")
    assert result["images"] is False and result["n_examples"] == 32 and 0.0 <= result["score"] <= 1.0
    assert calls and not [call for call in calls if set(call) & {"pixel_values", "pixel_attention_mask"}]
