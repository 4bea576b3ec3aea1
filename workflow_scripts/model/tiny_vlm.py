"""The offline demo's vision-language model: a tiny LLaVA (CLIP tower + projector + Llama), Idefics3
(SmolVLM's SigLIP-style tower + pixel-shuffle connector + Llama) or Qwen2-VL / Qwen2.5-VL / Qwen3-VL (a
dynamic-resolution tower whose merger folds 2x2 patches, M-RoPE in the language model), random weights,
the demo tokenizer with the family's image tokens, and the processor that expands one image placeholder
into exactly as many image tokens as the model makes features. Same seed and corpus give the same files.

Every family is built from transformers' own config, processor and (PIL) image-processor classes: the
fast image processors need torchvision, which the CPU build cannot have beside it, and the Qwen video
processors likewise, so the Qwen processors are built without one (images only).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model import tiny_model

ARCHITECTURES = ("llava", "idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava_onevision")
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # dynamic resolution: image tokens follow the image's size
# Qwen's vision tokens, as the released tokenizers spell them (the chat template writes the first three).
QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# Gemma 3's tokens, as its tokenizer names them: the processor writes boi + image tokens + eoi for each image.
GEMMA3_TOKENS = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
QWEN_MERGE = 2  # spatial_merge_size: the merger folds 2x2 patches into one image token (all released models)
# Vision keys of model.tiny that the text-only tiny model does not have, with their defaults:
# 32 px images in 8 px patches keep a training step at batch 16 well under a second on a CPU.
VISION_DEFAULTS = {"image_size": 32, "patch_size": 8, "vision_hidden_size": 32, "vision_layers": 1,
                   "vision_heads": 2, "scale_factor": 2}
IMAGE_TOKEN = "<image>"
# Idefics3's processor writes these around each image; as special tokens each is one id, not BPE pieces.
IDEFICS3_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
# tiny_model's chat format, plus list-of-parts content ({"type": "image"} / {"type": "text"}) as the
# processors' apply_chat_template passes it; plain string content still renders as before.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN
    + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] != 'user' %}" + tiny_model.EOS_TOKEN + "{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Qwen's chat templates wrap each image in <|vision_start|> ... <|vision_end|>; the rest is tiny_model's.
QWEN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(IMAGE_TOKEN, "<|vision_start|><|image_pad|><|vision_end|>")
# Gemma 3's chat template writes <start_of_image> for an image part: the slot its processor expands (boi, the
# image's tokens, eoi). Written as "<image>" the processor found no image slot and pretokenise stopped.
GEMMA3_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(IMAGE_TOKEN, GEMMA3_TOKENS["boi_token"])


def settings(tiny: Mapping[str, Any]) -> dict[str, Any]:
    """``tiny`` with the vision defaults filled in, checked so that the image grid is whole."""
    # Qwen's towers see 4 px patches in the tiny model: a 32 px image is then 8x8 patches, 16 image tokens after
    # the 2x2 merger, and images of other sizes and aspects give other counts (dynamic resolution).
    merged = {**VISION_DEFAULTS, **({"patch_size": 4} if tiny.get("architecture") in QWEN else {}), **tiny}
    if merged["architecture"] not in ARCHITECTURES:
        raise WorkflowError(f"model.tiny.architecture '{merged['architecture']}' is not a vision-language "
                            f"architecture; use one of {list(ARCHITECTURES)} for a vision_language task")
    for hidden, heads in (("hidden_size", "num_heads"), ("vision_hidden_size", "vision_heads")):
        if merged[hidden] % merged[heads]:
            raise WorkflowError(f"model.tiny.{hidden} {merged[hidden]} is not divisible by "
                                f"model.tiny.{heads} {merged[heads]}")
    side, rest = divmod(merged["image_size"], merged["patch_size"])
    if rest or side < 1:
        raise WorkflowError(f"model.tiny.image_size {merged['image_size']} is not a multiple of "
                            f"model.tiny.patch_size {merged['patch_size']}")
    # Idefics3's connector folds scale_factor x scale_factor patches into one token (pixel shuffle).
    if merged["architecture"] in QWEN and merged["hidden_size"] // merged["num_heads"] % 4:
        raise WorkflowError(f"model.tiny: M-RoPE splits each head's {merged['hidden_size'] // merged['num_heads']} "
                            "dimensions over 3 axes in pairs; make hidden_size / num_heads a multiple of 4")
    # Gemma 3's projector average-pools the patch grid to mm_tokens_per_image (scale_factor^2 patches each).
    if merged["architecture"] in ("idefics3", "gemma3") and side % merged["scale_factor"]:
        raise WorkflowError(f"model.tiny: {side} patches per side (image_size / patch_size) is not a multiple of "
                            f"model.tiny.scale_factor {merged['scale_factor']}")
    return merged


def image_tokens_per_image(tiny: Mapping[str, Any]) -> int:
    """Image tokens of one image_size x image_size image (for Qwen: of such an image; others vary with size)."""
    side = tiny["image_size"] // tiny["patch_size"]
    if tiny["architecture"] in QWEN:
        return (side // QWEN_MERGE) ** 2
    if tiny["architecture"] == "llava_onevision":  # the image whole, then as one tile unpadded, a newline per row
        return side * side + side * side + side
    if tiny["architecture"] in ("idefics3", "gemma3"):
        return (side // tiny["scale_factor"]) ** 2
    return side * side  # LLaVA's "default" strategy drops CLIP's class token: one feature per patch


def text_config(tiny: Mapping[str, Any], tokenizer):
    """The language model: tiny_model's Llama settings (same initializer_range reasoning)."""
    from transformers import LlamaConfig

    return LlamaConfig(**tiny_model.decoder_settings(tiny, tokenizer))


def llava_parts(tiny: Mapping[str, Any], tokenizer):
    """LLaVA-1.5's layout: CLIP tower, 2-layer GELU projector, Llama; the config and its processor."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    vision = CLIPVisionConfig(
        hidden_size=tiny["vision_hidden_size"], intermediate_size=2 * tiny["vision_hidden_size"],
        num_hidden_layers=tiny["vision_layers"], num_attention_heads=tiny["vision_heads"],
        image_size=tiny["image_size"], patch_size=tiny["patch_size"], projection_dim=tiny["vision_hidden_size"],
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text_config(tiny, tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=image_tokens_per_image(tiny),
        # LLaVA-1.5 reads layer -2; with a 1-layer tower that is the patch embeddings, and the tower's
        # only layer would sit off the path to the loss (no gradient for a tower adapter).
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    # do_pad squares the image with its mean colour before resize + crop (LLaVA-1.5's "pad" aspect
    # mode): a wide chart keeps its axes instead of losing them to the centre crop.
    image_processor = LlavaImageProcessorPil(
        size={"shortest_edge": tiny["image_size"]},
        crop_size={"height": tiny["image_size"], "width": tiny["image_size"]}, do_pad=True,
    )
    # num_additional_image_tokens=1 counts CLIP's class token, which "default" then drops again:
    # the placeholder becomes (image_size / patch_size)^2 image tokens, the model's feature count.
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=tiny["patch_size"],
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN, chat_template=CHAT_TEMPLATE,
    )
    return config, processor


def idefics3_parts(tiny: Mapping[str, Any], tokenizer):
    """Idefics3 / SmolVLM: SigLIP-style tower, pixel-shuffle connector, Llama; one fixed-size image each."""
    from transformers import Idefics3Config, Idefics3Processor, Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    vision = Idefics3VisionConfig(
        hidden_size=tiny["vision_hidden_size"], intermediate_size=2 * tiny["vision_hidden_size"],
        num_hidden_layers=tiny["vision_layers"], num_attention_heads=tiny["vision_heads"],
        image_size=tiny["image_size"], patch_size=tiny["patch_size"],
    )
    config = Idefics3Config(
        vision_config=vision, text_config=text_config(tiny, tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), scale_factor=tiny["scale_factor"],
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    # No splitting: each image is resized to one image_size square, so it is always the same
    # image_seq_len tokens (splitting would add a variable number of tiles plus row/column tokens).
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": tiny["image_size"]},
        max_image_size={"longest_edge": tiny["image_size"]},
    )
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_tokens_per_image(tiny),
        chat_template=CHAT_TEMPLATE,
    )
    return config, processor


def qwen_pixel_budget(tiny: Mapping[str, Any]) -> dict[str, int]:
    """The tiny Qwen processor's own budget: from one merged token (factor^2 pixels) up to 4 image_size squares,
    so the demo's images keep their size and aspect and a larger one is scaled down (smart_resize)."""
    factor = tiny["patch_size"] * QWEN_MERGE
    return {"shortest_edge": factor * factor, "longest_edge": 4 * tiny["image_size"] ** 2}


def qwen_parts(tiny: Mapping[str, Any], tokenizer):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the family's vision transformer with its 2x2 merger, the family's
    text model with M-RoPE (3 position axes: time, height, width), and the family's processor (no video)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from workflow_scripts.model.vision_language_model import image_only

    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(
        ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"), QWEN_TOKENS)}
    head_dim = tiny["hidden_size"] // tiny["num_heads"]
    # M-RoPE: the head's rotary pairs (head_dim / 2) split over time, height and width as the released
    # models split them (16/24/24 of 64 pairs), so every axis has at least one pair.
    pairs = head_dim // 2
    section = [pairs - 2 * (3 * pairs // 8), 3 * pairs // 8, 3 * pairs // 8]
    width, heads, layers = tiny["vision_hidden_size"], tiny["vision_heads"], tiny["vision_layers"]
    text = {**tiny_model.decoder_settings(tiny, tokenizer),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}
    common_vision = dict(depth=layers, num_heads=heads, patch_size=tiny["patch_size"],
                         spatial_merge_size=QWEN_MERGE, temporal_patch_size=2)
    architecture = tiny["architecture"]
    if architecture == "qwen2_vl":
        vision = dict(embed_dim=width, hidden_size=tiny["hidden_size"], mlp_ratio=2, **common_vision)
        config_class, processor_class = transformers.Qwen2VLConfig, transformers.Qwen2VLProcessor
    elif architecture == "qwen2_5_vl":
        # window attention over windows of window_size pixels; block 0 attends globally, as 7/15/23/31 do in 7B
        vision = dict(hidden_size=width, intermediate_size=2 * width, out_hidden_size=tiny["hidden_size"],
                      window_size=2 * tiny["patch_size"] * QWEN_MERGE, fullatt_block_indexes=[0], **common_vision)
        config_class, processor_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLProcessor
    else:  # qwen3_vl: learned position embeddings interpolated to the grid; deepstack features from layer 0
        vision = dict(hidden_size=width, intermediate_size=2 * width, out_hidden_size=tiny["hidden_size"],
                      num_position_embeddings=(tiny["image_size"] // tiny["patch_size"]) ** 2,
                      deepstack_visual_indexes=[0], **common_vision)
        text = {**text, "head_dim": head_dim}
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        config_class, processor_class = transformers.Qwen3VLConfig, transformers.Qwen3VLProcessor
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    image_processor = Qwen2VLImageProcessorPil(
        size=qwen_pixel_budget(tiny), patch_size=tiny["patch_size"], merge_size=QWEN_MERGE, temporal_patch_size=2)
    processor = image_only(processor_class)(image_processor=image_processor, tokenizer=tokenizer,
                                            chat_template=QWEN_CHAT_TEMPLATE)
    return config, processor


def gemma3_parts(tiny: Mapping[str, Any], tokenizer):
    """Gemma 3: SigLIP tower, average-pooling projector to mm_tokens_per_image, Gemma 3 text model (sliding and
    global attention layers); image tokens attend bidirectionally within their image (token_type_ids).
    Pan-and-scan is off by default, as in the released processor: every image is one image_size square."""
    from transformers import Gemma3Config, Gemma3Processor, PreTrainedTokenizerFast, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    # Gemma 3's processor reads image_token / boi_token / eoi_token as named tokens of the tokenizer.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer, eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token,
        model_max_length=tokenizer.model_max_length, extra_special_tokens=GEMMA3_TOKENS, chat_template=GEMMA3_CHAT_TEMPLATE)
    head_dim = tiny["hidden_size"] // tiny["num_heads"]
    text = {**tiny_model.decoder_settings(tiny, tokenizer), "head_dim": head_dim, "query_pre_attn_scalar": head_dim,
            "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * (tiny["num_layers"] // 2)
            + ["full_attention"] * (tiny["num_layers"] % 2)}
    vision = SiglipVisionConfig(
        hidden_size=tiny["vision_hidden_size"], intermediate_size=2 * tiny["vision_hidden_size"],
        num_hidden_layers=tiny["vision_layers"], num_attention_heads=tiny["vision_heads"],
        image_size=tiny["image_size"], patch_size=tiny["patch_size"], vision_use_head=False)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_TOKENS.items()}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=image_tokens_per_image(tiny),
                          image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
                          eoi_token_index=ids["eoi_token"], tie_word_embeddings=False)
    image_processor = Gemma3ImageProcessorPil(size={"height": tiny["image_size"], "width": tiny["image_size"]},
                                              do_pan_and_scan=False)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3_CHAT_TEMPLATE,
                                image_seq_length=image_tokens_per_image(tiny))
    return config, processor


def onevision_grid(tiny: Mapping[str, Any]) -> list[list[int]]:
    """LLaVA-OneVision's any-resolution grids, in tiles of image_size: up to 3 x 3 tiles, as the released
    models' grid goes up to 6 x 6 tiles of 384 px."""
    side = tiny["image_size"]
    return [[side * rows, side * columns] for rows in range(1, 4) for columns in range(1, 4)]


def llava_onevision_parts(tiny: Mapping[str, Any], tokenizer):
    """LLaVA-OneVision: SigLIP tower on the whole image resized plus its tiles (any-resolution: the grid that
    fits the image best, unpadded, a newline feature per row), 2-layer projector, Qwen2 language model."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionProcessor, Qwen2Config, SiglipVisionConfig
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    from workflow_scripts.model.vision_language_model import image_only

    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, "<video>"]})
    vision = SiglipVisionConfig(
        hidden_size=tiny["vision_hidden_size"], intermediate_size=2 * tiny["vision_hidden_size"],
        num_hidden_layers=tiny["vision_layers"], num_attention_heads=tiny["vision_heads"],
        image_size=tiny["image_size"], patch_size=tiny["patch_size"], vision_use_head=False)
    grid = onevision_grid(tiny)
    config = LlavaOnevisionConfig(
        vision_config=vision, text_config=Qwen2Config(**tiny_model.decoder_settings(tiny, tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full", vision_feature_layer=-1, image_grid_pinpoints=grid,
        tie_word_embeddings=False)
    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": tiny["image_size"], "width": tiny["image_size"]}, image_grid_pinpoints=grid)
    processor = image_only(LlavaOnevisionProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
        num_image_tokens=(tiny["image_size"] // tiny["patch_size"]) ** 2, vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_9")
    return config, processor


def build_model(tiny: Mapping[str, Any], corpus_dirs: Sequence[str | Path]):
    """The randomly initialised model (seeded by ``tiny.seed``) and its processor (holding the tokenizer)."""
    import torch
    from transformers import AutoModelForImageTextToText

    tiny = settings(tiny)
    tokenizer = tiny_model.train_tokenizer(tiny_model.corpus_texts(corpus_dirs), tiny["vocab_size"])
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE if tiny["architecture"] in QWEN else CHAT_TEMPLATE
    parts = {"llava": llava_parts, "idefics3": idefics3_parts, "gemma3": gemma3_parts,
             "llava_onevision": llava_onevision_parts,
             **{name: qwen_parts for name in QWEN}}[tiny["architecture"]]
    config, processor = parts(tiny, tokenizer)  # adds the image tokens first: they count in vocab_size
    torch.manual_seed(tiny["seed"])
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model, processor


def build(tiny: Mapping[str, Any], corpus_dirs: Sequence[str | Path], out: Path) -> dict[str, Any]:
    """Write config, safetensors weights, tokenizer and processor files into ``out``; return manifest facts."""
    if not corpus_dirs:
        raise WorkflowError("model.source 'tiny' needs --corpus: the normalised datasets to train its tokenizer on")
    from workflow_scripts.model.vision_language_model import components

    tiny = settings(tiny)
    model, processor = build_model(tiny, corpus_dirs)
    model.save_pretrained(str(out), safe_serialization=True)
    processor.save_pretrained(str(out))  # processor_config.json, tokenizer files, chat_template.jinja
    parts = components(model)

    def count(prefix: str) -> int:
        return sum(p.numel() for name, p in model.named_parameters() if name.startswith(prefix + "."))

    return {
        "architecture": tiny["architecture"],
        "model_class": type(model).__name__,
        "vocab_size": len(processor.tokenizer),
        "requested_vocab_size": tiny["vocab_size"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "vision_parameters": count(parts["vision_tower"]),
        "projector_parameters": count(parts["projector"]),
        "image_size": tiny["image_size"],
        "patch_size": tiny["patch_size"],
        "image_tokens_per_image": image_tokens_per_image(tiny),
        "image_token": processor.tokenizer.convert_ids_to_tokens(model.config.image_token_id),
        "image_token_id": model.config.image_token_id,
        "corpus": [str(d) for d in corpus_dirs],
    }
