"""The ``vision_language`` task: a VLM learns (image, question) -> answer (ChartQA, InfographicVQA, OCR-VQA).

What differs from ``generation`` lives here: rows carry their images (the encoded files' bytes, in
the Arrow data, read memory-mapped by every worker); the model's processor expands the image
placeholder into the model's image tokens when pre-tokenising, so an example whose image tokens and
prompt leave no room for the target is dropped with its reason (never cut through the image
tokens); the collator turns the bytes into pixel values in the DataLoader workers (no pixel cache:
see ``benchmarks/bench_vision_batches.py``); LoRA attaches to the language model only unless the
config trains the projector or the tower (``model/vision_language_model.py``); evaluation generates
conditioned on the image. Templates, the target-token loss, greedy decoding and scoring are
generation's. A variant with ``images: false`` is the text-only control: same model, same
questions, no image.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.settings import LoraSettings, TrainingSettings
from workflow_scripts.data.rows import Rejected, RecordMapper
from workflow_scripts.tasks import generation, templates
from workflow_scripts.tasks.base import Predictions

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings, VariantSettings
    from torch import nn

VARIANT_KEYS = generation.VARIANT_KEYS + ("images", "max_pixels", "min_pixels")


def check_variant(variant: "VariantSettings") -> "VariantSettings":
    """Generation's templates; ``images`` (default true) the schema has checked."""
    return generation.check_variant(variant)


def variant_record(variant: "VariantSettings") -> dict[str, Any]:
    """Generation's record of the templates, then ``images`` (pretokenise's cache key: see generation's)."""
    templates_only = {key: value for key, value in variant.to_dict().items() if key != "images"}
    # The pixel budget rides along where set (its absence keeps the records of variants written before it).
    return {"extractor": {"type": "whole"}, "chat_template": False, **templates_only, "images": variant.images}


# --- normalise: generation's mapping plus the image field, decoded once and stored as bytes ---
class ImageRecordMapper(RecordMapper):
    """Generation's question/answers mapping, plus ``images``: the bytes of each image of the record.

    ``raw_dir`` is set by normalise (image paths are relative to the dataset's files, or to an
    ``images/`` folder beside them; in an image folder, to the split's folder). Flattened records (OCR-VQA) give every question the same images.
    """

    raw_dir = None

    def __init__(self, settings: "DatasetSettings", key: str):
        super().__init__(settings, key)
        self.image_field = settings.fields["image"]
        self.source_splits, self.format = settings.splits, settings.format
        self.stats: dict[str, Any] = {}  # split -> data.images.ImageStats

    def rows(self, record, split: str, row: int):
        from workflow_scripts.data import images

        results = list(super().rows(record, split, row))
        if not any(isinstance(result, dict) for result in results):
            yield from results
            return
        value = record.get(self.image_field)
        if value is None:
            decoded = Rejected("missing_field", self.image_field,
                               "is missing" if self.image_field not in record else "is null")
        else:
            record_stats = images.ImageStats()  # this record's images, counted once per kept row below
            decoded = images.image_field_bytes(value, field=self.image_field,
                                               base_dirs=self.base_dirs(split),
                                               stats=record_stats)
        split_stats = self.stats.setdefault(split, images.ImageStats())
        for result in results:
            if isinstance(result, dict) and not isinstance(decoded, Rejected):
                split_stats.merge(record_stats, row=result["id"])  # each kept row stores its own copy of the images
                yield {**result, "images": decoded}
            else:
                yield decoded if isinstance(result, dict) else result

    def base_dirs(self, split: str):
        """An image folder's split folder alone (datasets' ``file_name`` is relative to it), else the defaults."""
        from workflow_scripts.data import images, split_layouts

        return (split_layouts.image_base_dirs(self.raw_dir, self.source_splits[split], self.format)
                or images.default_base_dirs(self.raw_dir))

    def report(self, splits) -> dict[str, Any]:
        return {**super().report(splits), "images": {split: stats.summary() for split, stats in self.stats.items()}}

    def notes(self) -> list[str]:
        """The log's lines on images read otherwise than datasets + transformers read them (16-bit grey)."""
        return [*getattr(super(), "notes", lambda: [])(),
                *(line for split, stats in self.stats.items() for line in stats.notes(split))]


# --- pre-tokenising: the processor expands the image placeholder ---
@functools.lru_cache(maxsize=4)
def _processor(model_dir: str, max_pixels: int | None, min_pixels: int | None):
    from workflow_scripts.model import vision_language_model as vlm

    processor = vlm.load_processor(model_dir)
    vlm.apply_pixel_budget(processor, max_pixels=max_pixels, min_pixels=min_pixels)
    return processor


def processor_for(tokenizer, variant: "VariantSettings"):
    """The model's processor, found from its tokenizer's directory, under the variant's pixel budget.

    The task interface hands stages a tokenizer; a VLM's processor lives in the same model directory
    (``prepare_model`` saves both), so it is loaded from there once per process. The budget
    (``max_pixels`` / ``min_pixels``) is set on its image processor here, the one place pretokenise and
    evaluation take it from; training's collator rebuilds that image processor from tokenise_meta.json.
    """
    return _processor(str(tokenizer.name_or_path), variant.max_pixels, variant.min_pixels)


def open_images(blobs: Sequence[bytes]):
    """Each image as the model sees it: upright, RGB, transparency on white (``data.images.decode_rgb``, the one
    reading of pretokenise, training's collator and evaluation)."""
    from workflow_scripts.data.images import decode_rgb

    return [decode_rgb(blob) for blob in blobs]


def render_prompt(tokenizer, variant: "VariantSettings", row: Mapping[str, Any]) -> str:
    """The prompt text with one image placeholder per image of the row (none for the text-only control):
    before the prompt, or with ``chat_template`` inside the user turn, where the model's chat format puts it.

    With ``chat_template`` the user turn's content is always a list of typed parts, also without an image:
    VLM templates (SmolVLM/Idefics3, llava-1.5-hf) iterate ``content`` as parts and render a plain string
    as nothing, which would train and score the text-only control without its question."""
    count = len(row.get("images") or []) if variant.images else 0
    text = templates._render(variant.prompt, row, "prompt")
    if not variant.chat_template:
        from workflow_scripts.model import vision_language_model as vlm

        return vlm.image_placeholder(processor_for(tokenizer, variant)) * count + "\n" + text if count else text
    templates.require_chat_template(tokenizer)
    content = [{"type": "image"}] * count + [{"type": "text", "text": text}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    # The stages' tokenizer comes from the prepared model directory, where the processor lies beside it; a bare
    # tokenizer (the gate's template checks, tests) has no processor to name the slot, and is not checked here.
    if count and Path(str(tokenizer.name_or_path)).is_dir():
        from workflow_scripts.model import vision_language_model as vlm

        slot = vlm.image_placeholder(processor_for(tokenizer, variant))
        if rendered.count(slot) != count:  # the processor would stop in its own words, naming no setting
            raise WorkflowError(
                f"chat_template: true: the chat template of the model in {tokenizer.name_or_path} writes "
                f"{rendered.count(slot)} image slots ({slot!r}, where its processor puts each image's tokens) for "
                f"the row's {count} image(s), so the images cannot reach the prompt; give the model a chat template "
                "that renders {'type': 'image'} parts as its image slot, or set the variant's chat_template: false")
    return rendered


def encode_prompt(processor, tokenizer, variant, prompt: str, blobs: Sequence[bytes]) -> list[int]:
    if not variant.images or not blobs:
        return templates.encode_prompts(tokenizer, variant, [prompt])[0]
    encoded = processor(text=[prompt], images=[open_images(blobs)],
                        add_special_tokens=not variant.chat_template)
    return list(encoded["input_ids"][0])


def tokenise_batch(batch: Mapping[str, list], *, tokenizer, variant: "VariantSettings", max_length: int) -> dict[str, list]:
    processor = processor_for(tokenizer, variant) if variant.images else None
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    targets = templates.encode_targets(tokenizer, [templates.render_target(variant, row) for row in rows])
    out = {name: [] for name in ("id", "input_ids", "labels", "length", "truncated", "dropped", "images")}
    for row, target in zip(rows, targets):
        blobs = list(row["images"]) if variant.images else []
        prompt = encode_prompt(processor, tokenizer, variant, render_prompt(tokenizer, variant, row), blobs)
        full = len(prompt) + len(target)
        # Image tokens sit in the prompt: a row whose prompt fills max_length is dropped, never cut.
        out["dropped"].append(len(prompt) >= max_length)
        out["truncated"].append(full > max_length)
        out["input_ids"].append((prompt + target)[:max_length])
        out["labels"].append(([-100] * len(prompt) + target)[:max_length])
        out["length"].append(min(full, max_length))
        out["id"].append(row["id"])
        out["images"].append(blobs)
    return out


# --- batches: text as generation pads it, pixel values made in the worker ---
class VisionCollator:
    """Generation's padded batch plus the processor's image inputs for the rows that have images.

    The image processor is rebuilt from the settings stored in ``tokenise_meta.json``, so workers
    need neither the model directory nor a pickled processor.
    """

    def __init__(self, meta: Mapping[str, Any], vocab_size: int):
        from workflow_scripts.data.batching import PaddingCollator

        self.text = PaddingCollator(meta["pad_token_id"], vocab_size)
        self.image_processor_settings = meta.get("image_processor")
        self._image_processor = None

    @property
    def image_processor(self):
        if self._image_processor is None:
            import transformers

            settings = dict(self.image_processor_settings)
            kind = settings.get("image_processor_type")
            if not kind or not hasattr(transformers, kind):
                raise WorkflowError(f"tokenise_meta.json: image_processor_type {kind!r} is not a transformers "
                                    "image processor; re-run pretokenise with this transformers version")
            self._image_processor = getattr(transformers, kind).from_dict(settings)
        return self._image_processor

    def __call__(self, rows: list[dict]) -> dict:
        from workflow_scripts.tasks.vision_language_loss import IMAGE_INPUTS

        batch = self.text(rows)
        blobs = [blob for row in rows for blob in row.get("images") or []]
        batch["images_in_batch"] = len(blobs)
        if blobs:
            # Idefics3-style processors take a list of images per example; LLaVA-style a flat list.
            per_row = [open_images(row["images"]) for row in rows if row.get("images")]
            try:
                processed = self.image_processor(per_row, return_tensors="pt")
            except (TypeError, ValueError):
                processed = self.image_processor([image for images in per_row for image in images], return_tensors="pt")
            for name in IMAGE_INPUTS:
                if name in processed:
                    batch[name] = processed[name]
        return batch


# --- evaluation: greedy generation conditioned on the image ---
def generate(model, tokenizer, variant, rows, prompts, batch_size: int, max_new_tokens: int, device) -> list[str]:
    import torch

    from workflow_scripts.model import vision_language_model as vlm
    from workflow_scripts.tasks.vision_language_loss import IMAGE_INPUTS

    processor = processor_for(tokenizer, variant) if variant.images else None
    if processor is not None:  # LLaVA-OneVision: the model tiles on the grids the pixel budget left
        vlm.align_tiling(model, getattr(processor.image_processor, "image_grid_pinpoints", None))
    stop_ids = generation.stop_token_ids(tokenizer, model)
    tokenizer.padding_side = "left"
    config = generation.greedy_generation_config(max_new_tokens, stop_ids, tokenizer.pad_token_id)
    outputs: list[str | None] = [None] * len(rows)
    with torch.no_grad(), generation.decoding_with(model, config):
        for start in range(0, len(rows), batch_size):
            index = list(range(start, min(start + batch_size, len(rows))))
            encoded = [encode_prompt(processor, tokenizer, variant, prompts[i], rows[i]["images"] if variant.images else [])
                       for i in index]
            padded = tokenizer.pad({"input_ids": encoded}, padding=True, return_tensors="pt")
            inputs = {"input_ids": padded["input_ids"].to(device), "attention_mask": padded["attention_mask"].to(device)}
            if variant.images:
                processed = processor.image_processor([open_images(rows[i]["images"]) for i in index], return_tensors="pt") \
                    if _takes_nested(processor) else processor.image_processor(
                        [image for i in index for image in open_images(rows[i]["images"])], return_tensors="pt")
                dtype = next(model.parameters()).dtype
                for name in IMAGE_INPUTS:
                    if name in processed:
                        value = processed[name].to(device)
                        inputs[name] = value.to(dtype) if name == "pixel_values" else value
                # M-RoPE (Qwen): image tokens found by type, positions counted past the left padding
                inputs.update(vlm.token_type_inputs(model, inputs["input_ids"]))
            generated = model.generate(**inputs, generation_config=config)
            width = inputs["input_ids"].shape[1]
            for row, i in enumerate(index):
                outputs[i] = tokenizer.decode(generation.cut_at_stop(generated[row, width:].tolist(), stop_ids),
                                              skip_special_tokens=True)
            print(f"generated {index[-1] + 1}/{len(rows)}", flush=True)
    return outputs


def _takes_nested(processor) -> bool:
    """Idefics3-style image processors take one list of images per example; so does LLaVA-OneVision's, which counts
    each row's images from the nesting (batch_num_images: a row of several images is not tiled)."""
    return (type(processor.image_processor).__name__.startswith(("Idefics", "SmolVLM"))
            or "batch_num_images" in getattr(processor.image_processor, "model_input_names", ()))


class VisionLanguageTask(generation.GenerationTask):
    name = "vision_language"
    packs = None  # no packing: image tokens and pixel values would have to be packed together
    fuses_output_head = False  # its loss feeds the model pixels: the fused path calls the text decoder alone
    auto_model_class = "AutoModelForImageTextToText"
    peft_task_type = "CAUSAL_LM"
    variant_keys = frozenset(VARIANT_KEYS)
    dropped_reason = "the image tokens and the prompt leave no room for a target token within max_length"
    all_dropped_hint = " (the prompt includes its image tokens: the processor expands each image into the model's image tokens)"

    @property
    def rejection_reasons(self) -> dict[str, str]:  # normalise's report describes the image reasons
        from workflow_scripts.data.images import IMAGE_REASONS

        return IMAGE_REASONS

    def check_variant(self, variant: "VariantSettings") -> "VariantSettings":
        return check_variant(variant)

    def variant_record(self, variant: "VariantSettings") -> dict[str, Any]:
        return variant_record(variant)

    def tokenised_features(self):
        from datasets import Features, List, Value

        return Features({
            "id": Value("string"), "input_ids": List(Value("int32")), "labels": List(Value("int32")),
            "length": Value("int32"), "truncated": Value("bool"), "dropped": Value("bool"),
            "images": List(Value("binary")),
        })

    def tokenise_batch(self, batch, *, tokenizer, variant, max_length, task_meta=None):
        return tokenise_batch(batch, tokenizer=tokenizer, variant=variant, max_length=max_length)

    def render_prompt(self, tokenizer, variant, row) -> str:
        return render_prompt(tokenizer, variant, row)

    def check_config_variant(self, name, variant, datasets) -> None:
        generation.check_config_variant(name, variant, datasets)
        check_config_budget(name, variant)

    def record_mapper(self, settings, key):
        return ImageRecordMapper(settings, key)

    def tokenise_meta(self, variant, task_meta, *, tokenizer=None) -> dict[str, Any]:
        """The image processor's settings, so the collator can make pixel values without the model directory."""
        if not variant.images:
            return {"image_processor": None}
        settings = processor_for(tokenizer, variant).image_processor.to_dict()
        return {"image_processor": {k: v for k, v in settings.items() if not k.startswith("_")}}

    def collator(self, meta, vocab_size, packing_for=None, *, seed=None):
        if packing_for:
            raise WorkflowError("training.packing: vision_language examples are not packed; set training.packing: false")
        return VisionCollator(meta, vocab_size)

    def loss_module(self, peft_model: nn.Module) -> nn.Module:
        from workflow_scripts.tasks.vision_language_loss import VisionTargetTokenLoss

        return VisionTargetTokenLoss(peft_model)

    def lora_settings(self, model: nn.Module, lora: LoraSettings) -> LoraSettings:
        """LoRA on the language model's modules only (and the projector saved whole when asked)."""
        from workflow_scripts.model import vision_language_model as vlm

        targets = vlm.lora_target_modules(model, list(lora.target_modules), train_tower=lora.train_vision_tower)
        saved = list(lora.modules_to_save) + vlm.modules_to_save(model, train_projector=lora.train_projector)
        return dataclasses.replace(lora, target_modules=tuple(targets), modules_to_save=tuple(saved))

    def align_model(self, model, data_meta) -> None:
        """Training: a tiling model (LLaVA-OneVision) takes the grids pretokenise tiled with (the pixel budget's)."""
        from workflow_scripts.model import vision_language_model as vlm

        vlm.align_tiling(model, (data_meta.get("image_processor") or {}).get("image_grid_pinpoints"))

    def check_model(self, peft_model, task_meta, training) -> str | None:
        from workflow_scripts.model import vision_language_model as vlm

        return vlm.check_frozen_tower(peft_model, train_tower=_trains_tower(training))

    def check_batch(self, batch, tokenizer, model) -> str | None:
        """Image tokens against the model's image features, and pixel values in the model's precision."""
        from workflow_scripts.model import vision_language_model as vlm
        from workflow_scripts.tasks.vision_language_loss import VisionTargetTokenLoss

        if "pixel_values" not in batch:
            return f"no image in this batch ({batch['input_ids'].shape[0]} rows, text only)"
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        dtype = next(base.parameters()).dtype
        fed = {**batch, **VisionTargetTokenLoss(model).model_inputs(batch)}  # what the forward will receive
        return "; ".join([vlm.check_image_tokens(fed, base), vlm.check_pixel_dtype(fed, dtype)])

    def check_gradients(self, peft_model, training) -> str | None:
        from workflow_scripts.model import vision_language_model as vlm

        return vlm.check_tower_gradients(peft_model, train_tower=_trains_tower(training))

    def predict(self, model, tokenizer, variant, rows, metric, evaluation, device) -> Predictions:
        """Generation's predictions, conditioned on each row's images (none for the text-only control)."""
        variant = check_variant(variant)
        if variant.images:
            missing = [row["id"] for row in rows if not row.get("images")]
            if missing:
                raise WorkflowError(f"rows {missing[:3]}: no image; is this normalise output of a vision_language dataset?")
        prompts = [render_prompt(tokenizer, variant, row) for row in rows]
        outputs = generate(model, tokenizer, variant, rows, prompts, evaluation.batch_size,
                           evaluation.max_new_tokens, device)
        decoding = generation.recorded_decoding(generation.greedy_generation_config(
            evaluation.max_new_tokens, generation.stop_token_ids(tokenizer, model), tokenizer.pad_token_id))
        return Predictions(generation.prediction_records(rows, prompts, outputs, variant, metric), "extracted",
                           {"decoding": "greedy", "generation_config": decoding, "images": variant.images})

    # evaluate: generation's (check the rows, self.predict, score the records).


def check_config_budget(name: str, variant: "VariantSettings") -> None:
    """At parse time: a pixel budget whose floor lies above its ceiling (the model's family is checked by
    ``model.task_fit.check_vision_language_models``, where its config can be read)."""
    from workflow_scripts.core.errors import ConfigError

    if variant.max_pixels is not None and variant.min_pixels is not None and variant.min_pixels > variant.max_pixels:
        raise ConfigError(f"variants.{name}.max_pixels", f"{variant.max_pixels} is below min_pixels "
                          f"{variant.min_pixels}: no image size lies within the budget; raise max_pixels or lower "
                          "min_pixels")


def _trains_tower(training: TrainingSettings) -> bool:
    """What the config asks (the gate then checks the built model against it)."""
    return training.lora.train_vision_tower


TASK = VisionLanguageTask()


def __getattr__(name: str):
    """``vision_language.VisionTargetTokenLoss`` without torch at import: normalise and compare load this module
    for its task object's data (image rows, rejection reasons) and must not pay for torch."""
    if name == "VisionTargetTokenLoss":
        from workflow_scripts.tasks.vision_language_loss import VisionTargetTokenLoss

        return VisionTargetTokenLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
