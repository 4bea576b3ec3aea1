"""The vision-language families of issue 38 (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: dynamic resolution and M-RoPE;
Gemma 3: pooled image tokens attending both ways; LLaVA-OneVision: any-resolution tiles) on their tiny random models (model/tiny_vlm.py), through the
stages as the rules call them:

- pretokenise -> gate -> a few training steps -> evaluation, the tower frozen, and the text-only control;
- the gate's placeholder/feature check catches a planted mismatch, and a batch without M-RoPE token types;
- the pixel budget (variants.<v>.max_pixels / min_pixels): an image above it is resized to fit, checked against
  the family's own processor (transformers' smart_resize), recorded for training, and counted by the memory
  estimate; an example whose image tokens and text cannot fit max_length is dropped by name;
- greedy predictions with batch 1 and batch 8 are equal on CPU in fp32 (left padding moves M-RoPE positions);
- packing is refused with a message.

Images differ in size and aspect, so with the Qwen families each row has its own number of image tokens.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_training_settings, training_json
from test_train import adapter, log_rows, train_argv
from test_vision_language_chain import record_generate_calls, run_evaluate, run_pretokenise, tokenise_report
from workflow_scripts import sanity, train
from workflow_scripts.core.errors import PreflightError, WorkflowError
from workflow_scripts.model import tiny_vlm
from workflow_scripts.model import vision_language_model as vlm

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FAMILIES = (*QWEN, "gemma3", "llava_onevision")
TOKEN_TYPES = {**{family: "mm_token_type_ids" for family in QWEN}, "gemma3": "token_type_ids"}
GATE_DETAIL = {**{family: "M-RoPE positions from mm_token_type_ids" for family in QWEN},
               "gemma3": "image tokens attend within their image (token_type_ids)", "llava_onevision": "image tokens"}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 512, "seed": 0}
PROMPT = {"prompt": "Question: {question}\nAnswer:", "target": " {answer}"}
VISION, TEXT_ONLY = {**PROMPT, "images": True}, {**PROMPT, "images": False}
MAX_LENGTH = 96
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EVALUATION = {"split": "test", "max_new_tokens": 6, "batch_size": 8, "max_examples": None, "gpus": 0,
              "max_length": MAX_LENGTH, "dtype": "fp32"}
# (width, height) of the images: wide, tall, square and small, so rows hold different numbers of image tokens.
SIZES = [(40, 32), (24, 36), (32, 32), (48, 16), (16, 40), (28, 28), (56, 24), (20, 20)]
WORDS = "what is the value of the highest bar in this small chart about the share of all the groups".split()
TOWER = {**{family: "base_model.model.model.visual." for family in QWEN},
         "gemma3": "base_model.model.model.vision_tower.", "llava_onevision": "base_model.model.model.vision_tower."}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def png(colour, size) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(image).rectangle((1, size[1] // 3, size[0] // 2, size[1] - 2), fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def split_rows(prefix: str, n: int, offset: int = 0) -> dict:
    rows = {"id": [], "question": [], "answers": [], "images": []}
    for k in range(offset, offset + n):
        rows["id"].append(f"{prefix}-{k:02d}")
        rows["question"].append(" ".join((WORDS * 2)[: 2 + (7 * k) % 19]))  # 2 to 20 words: left padding varies
        rows["answers"].append([str(10 + k % 7)])
        rows["images"].append([png((30 * k % 255, 120, 200 - 10 * k % 200), SIZES[k % len(SIZES)])])
    return rows


@pytest.fixture(scope="module")
def charts(tmp_path_factory) -> Path:
    """A normalised vision_language set as normalise writes it (images as PNG bytes), images of eight sizes."""
    from datasets import Dataset, DatasetDict

    directory = tmp_path_factory.mktemp("charts") / "data"
    DatasetDict({"train": Dataset.from_dict(split_rows("train", 16)),
                 "validation": Dataset.from_dict(split_rows("validation", 4, 16)),
                 "test": Dataset.from_dict(split_rows("test", 16, 20))}).save_to_disk(str(directory))
    (directory / "task_meta.json").write_text(json.dumps({"task": "vision_language"}))
    return directory


def prepare_tiny_vlms(families, corpus: Path, tmp_path_factory) -> dict:
    """family -> a tiny model of that family prepared by prepare_model, its tokenizer trained on ``corpus``."""
    from workflow_scripts import prepare_model

    out = {}
    for family in families:
        tiny = {"name": f"tiny-{family}", "source": "tiny", "tiny": {"architecture": family, **TINY}}
        out[family] = tmp_path_factory.mktemp(family) / "model"
        assert prepare_model.main(["--model", json.dumps(tiny), "--out", str(out[family]),
                                   "--corpus", str(corpus)]) == 0
    return out


@pytest.fixture(scope="module")
def models(charts, tmp_path_factory) -> dict:
    return prepare_tiny_vlms(FAMILIES, charts, tmp_path_factory)


def image_token_id(model_dir: Path) -> int:
    return json.loads((model_dir / "model_manifest.json").read_text())["image_token_id"]


# --- 1. each family through pretokenise -> gate -> train -> evaluate, and the text-only control ---
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_and_evaluates_with_a_frozen_tower_and_the_text_only_control(family, charts, models, tmp_path,
                                                                                   monkeypatch):
    from datasets import load_from_disk

    model_dir = models[family]
    data = run_pretokenise(model_dir, charts, VISION, tmp_path / "vision", max_length=MAX_LENGTH)
    text = run_pretokenise(model_dir, charts, TEXT_ONLY, tmp_path / "text", max_length=MAX_LENGTH)
    token = image_token_id(model_dir)
    counts = [ids.count(token) for ids in load_from_disk(str(data))["train"]["input_ids"]]
    assert min(counts) > 0
    if family in (*QWEN, "llava_onevision"):
        assert len(set(counts)) > 2  # dynamic resolution or tiling: the count follows each image's size
    assert all(token not in ids for ids in load_from_disk(str(text))["train"]["input_ids"])
    settings = tiny_training_settings(max_steps=3, effective_batch=8, micro_batch=4, max_length=MAX_LENGTH,
                                      checkpoint_every=100, lora={"target_modules": [*ALL_LINEAR, "lm_head"]})
    common = ["--model", str(model_dir), "--data", str(data), "--training", training_json(settings), "--seed", "1"]
    assert sanity.main([*common, "--out", str(tmp_path / "sanity.json")]) == 0
    gate = json.loads((tmp_path / "sanity.json").read_text())
    checks = {c["name"]: c for c in gate["checks"]}
    assert gate["passed"] and "vision tower frozen" in checks["vision_language_model"]["detail"]
    assert GATE_DETAIL[family] in checks["vision_language_batch"]["detail"]
    assert "no gradients" in checks["vision_language_gradients"]["detail"]
    out = tmp_path / "run"
    assert train.main(train_argv(out, model_dir, data, settings)) == 0
    assert [row["step"] for row in log_rows(out)] == [1, 2, 3]
    saved = adapter(out)
    assert saved and not [name for name in saved if name.startswith(TOWER[family])]  # nothing of the tower
    calls = record_generate_calls(monkeypatch)
    result = run_evaluate(tmp_path, model_dir, charts, VISION, "vision", "1", out / "adapter",
                          evaluation=EVALUATION)
    assert result["images"] is True and result["n_examples"] == 16
    assert calls and all({"pixel_values", TOKEN_TYPES.get(family, "image_sizes")} <= set(call) for call in calls)
    assert family not in QWEN or all("image_grid_thw" in call for call in calls)
    # The text-only control: same model, same questions, no image inputs at all.
    text_settings = training_json(settings)
    assert train.main(train_argv(tmp_path / "text_run", model_dir, text, settings)) == 0, text_settings
    calls.clear()
    control = run_evaluate(tmp_path, model_dir, charts, TEXT_ONLY, "text_only", "1", tmp_path / "text_run" / "adapter",
                           evaluation=EVALUATION)
    assert control["images"] is False and control["n_examples"] == 16
    assert calls and not [call for call in calls if set(call) & {"pixel_values", TOKEN_TYPES.get(family, "x")}]


# --- 2. the gate's placeholder/feature check, per family ---
def gate_batch(model_dir: Path, data: Path, rows: int = 4):
    """A training micro-batch as the collator makes it, and the loaded model."""
    from datasets import load_from_disk
    from transformers import AutoModelForImageTextToText

    from workflow_scripts.data import batching
    from workflow_scripts.tasks import vision_language

    meta = batching.read_meta(str(data))
    collator = vision_language.TASK.collator(meta, meta["vocab_size"])
    table = load_from_disk(str(data))["train"]
    batch = collator([table[k] for k in range(rows)])
    return batch, AutoModelForImageTextToText.from_pretrained(str(model_dir))


def onevision_image_features(height: int, width: int, config) -> int:
    """LLaVA-OneVision's image features for one ``height`` x ``width`` image, by its any-resolution recipe written
    out here (not the processor's count, nor the model's): the image whole at the tower's size (side x side
    features), then on the grid that keeps most of its pixels (and of those, wastes fewest), that grid's features
    unpadded to the image's aspect, a newline feature per row. (The model's anyres_max_9 cap never bites here:
    the tiny grids go up to 3 x 3 tiles.)"""
    tile = config.vision_config.image_size
    side = tile // config.vision_config.patch_size

    def fit(grid: list[int]) -> tuple[int, int]:
        grid_height, grid_width = grid
        scale = min(grid_width / width, grid_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        return kept, kept - grid_height * grid_width  # most pixels kept, then fewest wasted (the first on a tie)

    grid_height, grid_width = max(config.image_grid_pinpoints, key=fit)
    rows, columns = grid_height // tile * side, grid_width // tile * side
    if width / height > columns / rows:  # wider than the grid: rows of padding above and below are cut
        rows -= 2 * ((rows - int(round(height * columns / width, 7))) // 2)
    else:  # as wide or narrower: columns at the sides
        columns -= 2 * ((columns - int(round(width * rows / height, 7))) // 2)
    return side * side + rows * (columns + 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_gate_catches_a_placeholder_without_its_image_feature(family, charts, models, tmp_path):
    from workflow_scripts.tasks.vision_language import TASK
    from workflow_scripts.tasks.vision_language_loss import VisionTargetTokenLoss

    data = run_pretokenise(models[family], charts, VISION, tmp_path / "vision", max_length=MAX_LENGTH)
    batch, model = gate_batch(models[family], data)
    token = model.config.image_token_id
    fed = {**batch, **VisionTargetTokenLoss(model).model_inputs(batch)}
    detail = vlm.check_image_tokens(fed, model)
    tokens = int((batch["input_ids"] == token).sum())
    if family in QWEN:
        features = (batch["image_grid_thw"].prod(-1) // 4).tolist()
    elif family == "llava_onevision":  # from each image's size, by the recipe written out here
        features = [onevision_image_features(height, width, model.config)
                    for height, width in batch["image_sizes"].tolist()]
    else:
        features = [model.config.mm_tokens_per_image] * batch["pixel_values"].shape[0]
    assert tokens == sum(features) and GATE_DETAIL[family] in detail
    assert TASK.check_batch(batch, None, model).startswith(f"{len(features)} images")
    # Planted: one image token of the first row becomes text (as a prompt cut through its image would).
    planted = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    first = int((planted["input_ids"][0] == token).nonzero()[0])
    planted["input_ids"][0, first] = batch["input_ids"][0][batch["input_ids"][0] != token][0]  # a text token
    with pytest.raises(PreflightError, match=rf"image_tokens.*{tokens - 1} image tokens .* give {tokens} "
                                             "image features"):
        TASK.check_batch(planted, None, model)
    if family in QWEN:  # Planted: one image's grid says fewer patches than its pixel values hold.
        planted = {**batch, "image_grid_thw": batch["image_grid_thw"].clone()}
        planted["image_grid_thw"][0, 1] -= 2
        with pytest.raises(PreflightError, match="image_grid_thw gives"):
            TASK.check_batch(planted, None, model)
    else:  # Planted: one image fewer than the batch's placeholders.
        planted = {**batch, "pixel_values": batch["pixel_values"][1:],
                   **({"image_sizes": batch["image_sizes"][1:]} if "image_sizes" in batch else {})}
        with pytest.raises(PreflightError, match=rf"{tokens} image tokens .* give {tokens - features[0]} image"):
            TASK.check_batch(planted, None, model)
    # Planted: the forward without its token types (M-RoPE positions, or Gemma 3's attention within images).
    if family in TOKEN_TYPES:
        with pytest.raises(PreflightError, match=f"no {TOKEN_TYPES[family]}: its "):
            vlm.check_image_tokens(batch, model)


# --- 3. the pixel budget ---
def test_an_image_above_the_budget_is_resized_to_fit_as_the_family_processor_does(models, charts, tmp_path):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from workflow_scripts.core.entry_settings import VariantSettings
    from workflow_scripts.model.model_loading import load_tokenizer
    from workflow_scripts.tasks import vision_language

    model_dir = models["qwen2_5_vl"]
    tokenizer = load_tokenizer(model_dir)
    budget = 24 * 24  # nine image tokens at 8x8 pixels each (patch 4 x merge 2)
    variant = VariantSettings.parse({**VISION, "max_pixels": budget}, "vision_language")
    processor = vision_language.processor_for(tokenizer, variant)
    large = Image.new("RGB", (300, 120), (10, 20, 30))
    grid = processor.image_processor([large], return_tensors="pt")["image_grid_thw"][0].tolist()
    height, width = grid[1] * 4, grid[2] * 4
    assert height * width <= budget < 300 * 120
    assert (height, width) == smart_resize(120, 300, factor=8, min_pixels=processor.image_processor.size.shortest_edge,
                                           max_pixels=budget)
    assert width > height  # the aspect is kept
    # Without a budget the processor's own (4 x 32 x 32 for the tiny model) applies: more tokens.
    own = vision_language.processor_for(tokenizer, VariantSettings.parse(VISION, "vision_language"))
    assert own.image_processor([large], return_tensors="pt")["image_grid_thw"][0].prod() > grid[0] * grid[1] * grid[2]
    # pretokenise applies it, tokenise_meta.json records it, and the collator (training) makes the same grids.
    small = run_pretokenise(model_dir, charts, {**VISION, "max_pixels": budget}, tmp_path / "budget")
    meta = json.loads((small / "tokenise_meta.json").read_text())
    assert meta["image_processor"]["size"]["longest_edge"] == budget
    assert meta["templates"]["max_pixels"] == budget
    batch, model = gate_batch(model_dir, small, rows=8)
    assert int((batch["image_grid_thw"].prod(-1) // 4).max()) <= budget // 64
    vlm.check_image_tokens({**batch, **vlm.token_type_inputs(model, batch["input_ids"])}, model)


def test_the_budget_is_refused_for_a_fixed_size_family_and_when_inverted(models):
    class Processor:  # LLaVA's image processor: every image becomes one 32x32 square
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
        image_processor = LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})

    with pytest.raises(WorkflowError, match=r"variants.<name>.max_pixels / variants.<name>.min_pixels: the model's "
                                            r"image processor LlavaImageProcessorPil resizes every image"):
        vlm.apply_pixel_budget(Processor, max_pixels=4096, min_pixels=None)
    with pytest.raises(WorkflowError, match="image processor Gemma3ImageProcessorPil resizes every image"):
        vlm.apply_pixel_budget(vlm.load_processor(models["gemma3"]), max_pixels=4096, min_pixels=None)
    processor = vlm.load_processor(models["qwen2_vl"])
    with pytest.raises(WorkflowError, match="min_pixels: 4096 is above max_pixels 1024"):
        vlm.apply_pixel_budget(processor, max_pixels=1024, min_pixels=4096)
    with pytest.raises(WorkflowError, match="max_pixels: 32 is below one image token"):
        vlm.apply_pixel_budget(processor, max_pixels=32, min_pixels=None)


def test_an_example_whose_image_tokens_do_not_fit_max_length_is_dropped_by_name(models, charts, tmp_path):
    from datasets import load_from_disk

    model_dir = models["qwen2_5_vl"]
    full = run_pretokenise(model_dir, charts, VISION, tmp_path / "full", max_length=MAX_LENGTH)
    prompts = {row["id"]: sum(label == -100 for label in row["labels"]) for row in load_from_disk(str(full))["train"]}
    cut = sorted(prompts.values())[len(prompts) // 2]  # about half the prompts (image tokens included) reach it
    out = run_pretokenise(model_dir, charts, VISION, tmp_path / "cut", max_length=cut)
    train_report = tokenise_report(out)["splits"]["train"]
    dropped = sorted(name for name, length in prompts.items() if length >= cut)
    assert 0 < len(dropped) < len(prompts)
    assert train_report["dropped"] == len(dropped) and sorted(train_report["dropped_ids"]) == dropped
    token = image_token_id(model_dir)
    full_rows = {row["id"]: row for row in load_from_disk(str(full))["train"]}
    for row in load_from_disk(str(out))["train"]:  # the rows kept have every image token
        assert row["input_ids"].count(token) == full_rows[row["id"]]["input_ids"].count(token)


def test_the_memory_estimate_counts_the_budget(models):
    from transformers import AutoConfig

    from workflow_scripts.model import memory_estimate

    vision = AutoConfig.from_pretrained(str(models["qwen2_5_vl"])).vision_config
    settings = {"image_processor_type": "Qwen2VLImageProcessorPil", "patch_size": 4, "merge_size": 2,
                "size": {"shortest_edge": 64, "longest_edge": 4096}}
    assert vlm.max_image_tokens(settings) == 4096 // 64
    assert memory_estimate.tower_patches_per_image(vision, settings) == 4096 // 16
    small = memory_estimate.vision_activation_bytes(vision, 4, 2, False, settings)
    large = memory_estimate.vision_activation_bytes(
        vision, 4, 2, False, {**settings, "size": {"shortest_edge": 64, "longest_edge": 4 * 4096}})
    assert large == 4 * small > 0


# --- 4. batch-1 == batch-8 greedy predictions on CPU fp32 ---
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_predictions_do_not_depend_on_the_evaluation_batch_size(family, charts, models, tmp_path):
    one = run_evaluate(tmp_path, models[family], charts, VISION, "b1", "base",
                       evaluation={**EVALUATION, "batch_size": 1})
    eight = run_evaluate(tmp_path, models[family], charts, VISION, "b8", "base",
                         evaluation={**EVALUATION, "batch_size": 8})
    assert one["n_examples"] == eight["n_examples"] == 16

    def outputs(name):
        lines = (tmp_path / name / "base" / "predictions.jsonl").read_text().splitlines()
        return [json.loads(line)["raw_output"] for line in lines]

    assert outputs("b8") == outputs("b1")
    assert len(set(outputs("b1"))) > 1  # the outputs depend on the inputs: the comparison means something


def test_m_rope_positions_need_the_token_types_under_left_padding(models, charts):
    """Why evaluation passes mm_token_type_ids: without them a left-padded row's image tokens get 1-D text
    positions and its logits change (the batch-1 == batch-8 test above would not see this on its own)."""
    from transformers import AutoModelForImageTextToText

    from workflow_scripts.model.model_loading import load_tokenizer
    from workflow_scripts.core.entry_settings import VariantSettings
    from workflow_scripts.tasks import vision_language

    model_dir = models["qwen2_5_vl"]
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir)).eval()
    tokenizer = load_tokenizer(model_dir)
    variant = VariantSettings.parse(VISION, "vision_language")
    processor = vision_language.processor_for(tokenizer, variant)
    image = vision_language.open_images([png((200, 10, 10), (40, 32))])
    prompt = vision_language.render_prompt(tokenizer, variant, {"question": "what is it", "images": [b"x"]})
    encoded = processor(text=[prompt], images=[image], return_tensors="pt")
    inputs = {k: encoded[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}
    with torch.no_grad():
        with_types = model(**inputs, **vlm.token_type_inputs(model, inputs["input_ids"])).logits
        model.model.rope_deltas = None
        without = model(**inputs).logits
    assert not torch.allclose(with_types, without)


# --- 5. packing ---
def test_packing_is_refused_for_the_families(charts, models, tmp_path):
    from workflow_scripts.tasks.vision_language import TASK

    assert TASK.packs is None
    with pytest.raises(WorkflowError, match="vision_language examples are not packed; set training.packing: false"):
        TASK.collator({"pad_token_id": 0}, 100, packing_for="flash_attention_2")


def test_tiny_families_build_with_their_own_classes(models):
    for family, directory in models.items():
        manifest = json.loads((directory / "model_manifest.json").read_text())
        config = json.loads((directory / "config.json").read_text())
        processor = vlm.load_processor(directory)
        assert config["model_type"] == family
        assert type(processor).__name__ == {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                                            "qwen3_vl": "Qwen3VLProcessor", "gemma3": "Gemma3Processor",
                                            "llava_onevision": "LlavaOnevisionProcessor"}[family]
        if family in QWEN:
            assert manifest["image_token"] == "<|image_pad|>"
            assert manifest["image_tokens_per_image"] == 16  # a 32 px image: 8x8 patches of 4 px, merged 2x2
        elif family == "llava_onevision":  # 16 for the image whole, 16 for it as one tile, 4 newlines
            assert manifest["image_tokens_per_image"] == 36 and processor.num_image_tokens == 16
        else:  # 4x4 patches of 8 px, pooled 2x2; the processor's placeholder is the begin-of-image token
            assert manifest["image_token"] == "<image_soft_token>" and processor.image_token == "<start_of_image>"
            assert manifest["image_tokens_per_image"] == config["mm_tokens_per_image"] == 4
        # The processor's own expansion of one image_size x image_size image, against the manifest (tiny_vlm's
        # count, which the gate and the memory estimate use).
        from PIL import Image

        side = tiny_vlm.settings({**TINY, "architecture": family})["image_size"]
        encoded = processor(text=[vlm.image_placeholder(processor)], images=[[Image.new("RGB", (side, side), "white")]])
        assert list(encoded["input_ids"][0]).count(manifest["image_token_id"]) == manifest["image_tokens_per_image"]


def test_the_config_level_estimate_prices_a_vlm_from_its_config_and_budget():
    """Qwen2.5-VL-7B from its config.json alone (tests/model_configs): LoRA on the language model only, the
    same adapters as Qwen2.5-7B's (the same decoder); the frozen tower's activations follow max_pixels."""
    from workflow_scripts.model import config_memory_estimate as cme
    from workflow_scripts.model import memory_estimate

    configs = Path(__file__).parent / "model_configs"
    lora = {"rank": 128, "target_modules": ALL_LINEAR}
    common = dict(strategy="fsdp", world_size=8, lora=lora, micro_batch=1, max_length=2560)
    vl = cme.meta_model(configs / "Qwen2.5-VL-7B-Instruct.json")
    text = cme.meta_model(configs / "Qwen2.5-7B-Instruct.json")
    assert type(vl).__name__ == "Qwen2_5_VLForConditionalGeneration"
    budget, larger = 2048 * 28 * 28, 4 * 2048 * 28 * 28
    with_budget = cme.estimate_from_config(vl, max_pixels=budget, **common)
    assert with_budget["adapters"] == cme.estimate_from_config(text, **common)["adapters"]
    bigger = cme.estimate_from_config(vl, max_pixels=larger, **common)
    tower = memory_estimate.vision_activation_bytes(vl.config.vision_config, 1, 2, False,
                                                    cme.budget_settings(vl.config, budget))
    assert tower == 8192 * (11 * 1280 + 2 * 3420) * 2  # 2048 tokens = 8192 patches of 14 px, one layer's set
    assert bigger["activations"] - with_budget["activations"] == 3 * tower


def test_the_real_qwen2_5_vl_config_builds_its_dag(tmp_path):
    """config/real_vlm_hub.yaml: Qwen2.5-VL-7B on ChartQA (hub) and InfographicVQA (local, as the registration
    download gives it; written here in that layout) under the pixel budget, dry-run offline."""
    import re

    import snakemake_fork
    from vlm_layouts import write_infographicvqa

    root = Path(__file__).resolve().parent.parent
    write_infographicvqa(tmp_path / "data" / "infographicvqa")
    code, output = snakemake_fork.run(["-s", str(root / "Snakefile"), "--directory", str(tmp_path), "-n", "-p",
                                       "--configfile", str(root / "config" / "real_vlm_hub.yaml"),
                                       "--replace-workflow-config", "--cores", "8", "--resources", "gpu=8"],
                                      timeout=600)
    assert code == 0, output[-4000:]
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", output.split("Job stats:", 1)[1], re.MULTILINE))
    # two datasets x two variants (vision, text_only) x three seeds on one model
    assert {k: int(counts[k]) for k in ("download", "normalise", "prepare_model", "pretokenise", "train")} == {
        "download": 2, "normalise": 2, "prepare_model": 1, "pretokenise": 4, "train": 12}
    assert "Qwen/Qwen2.5-VL-7B-Instruct" in output and '"max_pixels": 1605632' in output


def test_the_budget_bounds_llava_onevision_tiling_grid(models, charts, tmp_path):
    """LLaVA-OneVision: max_pixels keeps the tiling grids within it, so a large image is tiled on fewer tiles
    (fewer image tokens); the grids travel to training in tokenise_meta.json and the memory estimate counts them."""
    from datasets import load_from_disk
    from PIL import Image

    from workflow_scripts.core.entry_settings import VariantSettings
    from workflow_scripts.model import memory_estimate
    from workflow_scripts.model.model_loading import load_tokenizer
    from workflow_scripts.tasks import vision_language

    model_dir = models["llava_onevision"]
    tokenizer = load_tokenizer(model_dir)
    budget = 64 * 32  # grids of at most two 32 px tiles
    processor = vision_language.processor_for(
        tokenizer, VariantSettings.parse({**VISION, "max_pixels": budget}, "vision_language"))
    assert all(rows * columns <= budget for rows, columns in processor.image_processor.image_grid_pinpoints)
    large = Image.new("RGB", (96, 90), (10, 20, 30))  # tiled 3 x 3 without the budget
    tiles = processor.image_processor([large], return_tensors="pt")["pixel_values"].shape[1]
    own = vision_language.processor_for(tokenizer, VariantSettings.parse(VISION, "vision_language"))
    assert tiles == 1 + 2 < own.image_processor([large], return_tensors="pt")["pixel_values"].shape[1] == 1 + 9
    with pytest.raises(WorkflowError, match="min_pixels: LlavaOnevisionImageProcessorPil tiles an image"):
        vlm.apply_pixel_budget(vlm.load_processor(model_dir), max_pixels=None, min_pixels=64)
    with pytest.raises(WorkflowError, match="max_pixels: 512 is below LlavaOnevisionImageProcessorPil's smallest"):
        vlm.apply_pixel_budget(vlm.load_processor(model_dir), max_pixels=512, min_pixels=None)
    full = run_pretokenise(model_dir, charts, VISION, tmp_path / "full", max_length=MAX_LENGTH)
    small = run_pretokenise(model_dir, charts, {**VISION, "max_pixels": 32 * 32}, tmp_path / "small",
                            max_length=MAX_LENGTH)
    token = image_token_id(model_dir)
    counts = {name: [ids.count(token) for ids in load_from_disk(str(path))["train"]["input_ids"]]
              for name, path in (("full", full), ("small", small))}
    assert max(counts["small"]) <= 36 < max(counts["full"])  # one tile each under the budget (unpadded: fewer)
    meta = json.loads((small / "tokenise_meta.json").read_text())["image_processor"]
    assert meta["image_grid_pinpoints"] == [[32, 32]] and vlm.max_tiles(meta) == 2
    batch, model = gate_batch(model_dir, small, rows=8)
    # The model tiles by its config's grids: left at the full grid it splits the tiles otherwise (the gate says so)
    large_batch = {**batch, "pixel_values": processor.image_processor([large], return_tensors="pt")["pixel_values"],
                   "image_sizes": torch.tensor([[90, 96]])}
    with pytest.raises(PreflightError, match="the model's tiling grids do not give the batch's"):
        vlm.check_image_tokens({**large_batch, "input_ids": torch.full((1, 4), token)}, model)
    from workflow_scripts.tasks.vision_language import TASK

    TASK.align_model(model, json.loads((small / "tokenise_meta.json").read_text()))  # as training_setup does
    assert model.config.image_grid_pinpoints == [[32, 32]]
    vlm.check_image_tokens(batch, model)  # training's collator tiles as pretokenise did
    vision = model.config.vision_config
    assert memory_estimate.tower_patches_per_image(vision, meta) == 2 * (16 + 1)
