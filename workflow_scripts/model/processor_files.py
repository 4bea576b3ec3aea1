"""A vision-language model's processor settings, read the same way from both file layouts a model directory holds.

- transformers 4, and the Hub's own files of most released VLMs (Qwen2/2.5/3-VL, LLaVA-1.5, Gemma 3):
  ``preprocessor_config.json``, the image processor's settings at the top level, with ``processor_class``
  beside them (Qwen's as ``min_pixels`` / ``max_pixels``, or ``size``);
- transformers 5 (``ProcessorMixin.save_pretrained``, what ``prepare_model`` writes): ``processor_config.json``, the
  processor's own settings with the image processor's nested under ``image_processor``.

One reader for the memory check (``checks/memory``, before any job), the processor's loading (pretokenise,
training's collator through tokenise_meta.json, evaluation: ``vision_language_model.load_processor``) and the
early refusal of a dynamic-resolution model without its processor file (``missing_processor_problem``), so no
reader prices or loads one layout differently from the other. Plain JSON reading: no transformers import, so the
config checks pay nothing for it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from workflow_scripts.core.errors import WorkflowError

PROCESSOR_FILE = "processor_config.json"  # transformers' PROCESSOR_NAME
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"  # transformers' IMAGE_PROCESSOR_NAME
# Image processors whose size is a pixel count (Qwen's smart_resize: size.shortest_edge / longest_edge are
# min_pixels / max_pixels); the other families' size is an edge or a tile.
DYNAMIC_RESOLUTION = "Qwen2VLImageProcessor"
# model_type of config.json -> the processor file it cannot run without (its image tokens follow each image's
# size, so neither the tokens nor the memory can be known without the image processor's settings).
NEEDS_PROCESSOR = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class ProcessorSettings:
    """What the files of one model directory say about its processor."""

    processor_class: str | None
    image_processor: dict[str, Any]  # flat, as ``preprocessor_config.json`` holds it
    own: dict[str, Any] = field(default_factory=dict)  # processor_config.json's other keys (num_image_tokens...)
    files: tuple[str, ...] = ()  # the files read, for messages
    model_type: str | None = None  # config.json's, read where the image processor names no image_processor_type

    @property
    def dynamic_resolution(self) -> bool:
        kind = self.image_processor.get("image_processor_type")
        if kind is None:  # transformers' AutoImageProcessor then takes the class config.json's model_type maps to
            return self.model_type in NEEDS_PROCESSOR  # (all three: Qwen2VLImageProcessor)
        return str(kind).startswith(DYNAMIC_RESOLUTION)

    def max_pixels(self) -> int | None:
        """A dynamic-resolution processor's own pixel budget (``size.longest_edge``, or ``max_pixels`` as the Hub's
        Qwen files write it); None for the other families (a fixed size or tiles)."""
        if not self.dynamic_resolution:
            return None
        size = self.image_processor.get("size")
        # A top-level max_pixels overrides size.longest_edge, as Qwen2VLImageProcessor's loading applies it (a user who
        # edits max_pixels in the Hub's file gets that budget; pricing size's would miss the difference).
        budget = self.image_processor.get("max_pixels") or (size.get("longest_edge") if isinstance(size, Mapping) else None)
        return budget if isinstance(budget, int) and not isinstance(budget, bool) else None


def read_json(path: Path, what: str) -> Any:
    """A JSON file's value, or a WorkflowError naming the file and ``what`` it should be."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise WorkflowError(f"{path} cannot be read as {what} ({str(error).splitlines()[0]}); restore the file from "
                            "the model's release or prepare the model again") from None


def read(directory: Path | str) -> ProcessorSettings | None:
    """The processor settings of ``directory`` from whichever layout it holds (both: the nested ``image_processor`` of
    processor_config.json wins for its settings, as transformers' AutoImageProcessor reads it first, the flat file
    only where that one holds none); None where it holds neither."""
    directory = Path(directory)
    nested_path, flat_path = directory / PROCESSOR_FILE, directory / IMAGE_PROCESSOR_FILE
    nested = read_json(nested_path, "a processor config") if nested_path.is_file() else None
    flat = read_json(flat_path, "an image processor config") if flat_path.is_file() else None
    for path, value in ((nested_path, nested), (flat_path, flat)):
        if value is not None and not isinstance(value, dict):
            raise WorkflowError(f"{path} holds a {type(value).__name__}, not a JSON object; restore the file from the "
                                "model's release or prepare the model again")
    if nested is None and flat is None:
        return None
    nested = nested or {}
    inner = nested.get("image_processor")
    image_processor = dict(inner) if isinstance(inner, dict) else dict(flat or {})
    processor_class = (nested.get("processor_class") or image_processor.pop("processor_class", None)
                       or (flat or {}).get("processor_class"))
    if processor_class is None:  # the Hub's tokenizer_config.json names it too
        tokenizer_config = directory / "tokenizer_config.json"
        if tokenizer_config.is_file():
            tokenizer = read_json(tokenizer_config, "a tokenizer config")
            processor_class = tokenizer.get("processor_class") if isinstance(tokenizer, dict) else None
    image_processor.pop("processor_class", None)
    own = {key: value for key, value in nested.items() if key not in ("image_processor", "processor_class")}
    files = tuple(str(path) for path, value in ((flat_path, flat), (nested_path, nested or None)) if value is not None)
    model_type = None
    if "image_processor_type" not in image_processor and (directory / "config.json").is_file():
        config = read_json(directory / "config.json", "a model config")
        model_type = config.get("model_type") if isinstance(config, dict) else None
    settings = ProcessorSettings(processor_class, image_processor, own, files, model_type)
    if settings.dynamic_resolution:
        where = (nested_path, "image_processor.size") if isinstance(inner, dict) else (flat_path, "size")
        _check_pixel_size(image_processor, *where)
    return settings


# transformers' default smallest image for Qwen2VLImageProcessor (size.shortest_edge: 56 * 56 pixels)
DEFAULT_MIN_PIXELS = 56 * 56


def _check_pixel_size(image_processor: Mapping[str, Any], path: Path, key: str) -> None:
    """Refuse a Qwen2-VL ``size`` that transformers cannot resize by. transformers 4.45-4.48 saved it as
    ``{min_pixels, max_pixels}`` beside top-level ``min_pixels``/``max_pixels``; the installed Qwen2VLImageProcessor
    moves those top-level keys into ``size.shortest_edge``/``longest_edge`` and drops size's own, so such a file
    loads the same budget (read by :meth:`ProcessorSettings.max_pixels`). Where a size key is not replaced that way,
    transformers keeps it and stops at the first image (``size`` must hold shortest_edge and longest_edge), and the
    memory check found no budget to price: refused here, when the workflow is read, naming the file and key."""
    size = image_processor.get("size")
    if not isinstance(size, Mapping):
        return
    # transformers replaces size's min_pixels / max_pixels only where the same key is set at the top level
    if not any(name in size and image_processor.get(name) is None for name in ("min_pixels", "max_pixels")):
        return
    # the budget transformers' own top-level keys would give, else size's
    low = image_processor.get("min_pixels") or size.get("min_pixels", size.get("shortest_edge", DEFAULT_MIN_PIXELS))
    high = image_processor.get("max_pixels") or size.get("max_pixels", size.get("longest_edge"))
    write = (f'write "size": {{"shortest_edge": {low}, "longest_edge": {high}}} there (the same budget)'
             if high is not None else 'write "size": {"shortest_edge": ..., "longest_edge": <the pixel budget>} there')
    raise WorkflowError(
        f"{path}: key '{key}' holds {dict(size)}, the layout transformers 4.45-4.48 saved, which the installed "
        "transformers does not read as the pixel budget (its Qwen2-VL image processor resizes by size.shortest_edge "
        f"and size.longest_edge, and stops at the first image without them); {write}, or save the processor again "
        "with the installed transformers")


def missing_processor_problem(directory: Path | str, model_type: str | None) -> str | None:
    """Why a model directory cannot give its images to the model: a dynamic-resolution family (Qwen2/2.5/3-VL)
    without either processor file. None where nothing is missing (or the family can do without)."""
    if model_type not in NEEDS_PROCESSOR:
        return None
    if (Path(directory) / PROCESSOR_FILE).is_file() or (Path(directory) / IMAGE_PROCESSOR_FILE).is_file():
        return None
    return (f"{directory} holds no {IMAGE_PROCESSOR_FILE} (nor {PROCESSOR_FILE}): a {model_type} model's image "
            "processor settings (patch size, merge size, pixel budget) come from it; copy it from the model's release "
            "beside config.json")
