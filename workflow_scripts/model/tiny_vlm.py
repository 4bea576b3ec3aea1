"""The offline demo's vision-language model: a tiny LLaVA (CLIP tower + projector + Llama) or Idefics3
(SmolVLM's SigLIP-style tower + pixel-shuffle connector + Llama), random weights, the demo tokenizer
with the family's image tokens, and the processor that expands one image placeholder into exactly as
many image tokens as the model makes features. Same seed and corpus give the same files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model import tiny_model

ARCHITECTURES = ("llava", "idefics3")
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


def settings(tiny: Mapping[str, Any]) -> dict[str, Any]:
    """``tiny`` with the vision defaults filled in, checked so that the image grid is whole."""
    merged = {**VISION_DEFAULTS, **tiny}
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
    if merged["architecture"] == "idefics3" and side % merged["scale_factor"]:
        raise WorkflowError(f"model.tiny: {side} patches per side (image_size / patch_size) is not a multiple of "
                            f"model.tiny.scale_factor {merged['scale_factor']}")
    return merged


def image_tokens_per_image(tiny: Mapping[str, Any]) -> int:
    side = tiny["image_size"] // tiny["patch_size"]
    if tiny["architecture"] == "idefics3":
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


def build_model(tiny: Mapping[str, Any], corpus_dirs: Sequence[str | Path]):
    """The randomly initialised model (seeded by ``tiny.seed``) and its processor (holding the tokenizer)."""
    import torch
    from transformers import AutoModelForImageTextToText

    tiny = settings(tiny)
    tokenizer = tiny_model.train_tokenizer(tiny_model.corpus_texts(corpus_dirs), tiny["vocab_size"])
    tokenizer.chat_template = CHAT_TEMPLATE
    parts = {"llava": llava_parts, "idefics3": idefics3_parts}[tiny["architecture"]]
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
        "image_token": IMAGE_TOKEN,
        "image_token_id": processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "corpus": [str(d) for d in corpus_dirs],
    }
