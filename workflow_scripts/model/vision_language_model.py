"""What differs for vision-language models in loading, LoRA and the gate: where the vision tower, the
projector and the language model live, which modules get adapters, and the checks that the tower
stays frozen and that every image placeholder meets one image feature.

Seeds: a LoRA target pattern that silently caught the vision tower's ``q_proj``/``v_proj`` too; a
tower frozen around PEFT that left adapters with ``requires_grad=False`` (shirg-lora-gradient-fix).
"""
from __future__ import annotations

import difflib
import functools
import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from workflow_scripts.core.errors import WorkflowError

TRAIN_TOWER_KEY = "training.lora.train_vision_tower"  # the schema's key
TRAIN_PROJECTOR_KEY = "training.lora.train_projector"
TARGETS_KEY = "training.lora.target_modules"
PEFT_PREFIX = "base_model.model."
# transformers 5 class name -> attribute paths inside it. The ForConditionalGeneration classes keep
# the parts one level down in ``model`` (LlavaModel / Idefics3Model / Qwen2_5_VLModel...), beside ``lm_head``.
# The Qwen towers hold their projector (the 2x2 patch merger) inside: the tower's parameters are those
# under vision_tower and not under projector.
QWEN_PARTS = {"vision_tower": "model.visual", "projector": "model.visual.merger", "language_model": "model.language_model"}
FAMILIES = {
    "LlavaForConditionalGeneration": {
        "vision_tower": "model.vision_tower", "projector": "model.multi_modal_projector",
        "language_model": "model.language_model",
    },
    "Idefics3ForConditionalGeneration": {
        "vision_tower": "model.vision_model", "projector": "model.connector", "language_model": "model.text_model",
    },
    "SmolVLMForConditionalGeneration": {  # SmolVLM2; SmolVLM (v1) checkpoints are Idefics3 classes
        "vision_tower": "model.vision_model", "projector": "model.connector", "language_model": "model.text_model",
    },
    "Qwen2VLForConditionalGeneration": QWEN_PARTS,
    "Qwen2_5_VLForConditionalGeneration": QWEN_PARTS,
    "Qwen3VLForConditionalGeneration": QWEN_PARTS,  # its deepstack mergers count as tower (frozen with it)
    "Gemma3ForConditionalGeneration": {
        "vision_tower": "model.vision_tower", "projector": "model.multi_modal_projector",
        "language_model": "model.language_model",
    },
    "LlavaOnevisionForConditionalGeneration": {
        "vision_tower": "model.vision_tower", "projector": "model.multi_modal_projector",
        "language_model": "model.language_model",
    },
}
# How each family turns one image into image features (see image_features): a fixed count per image size
# (select_strategy, pixel_shuffle), or the image's own patch grid (image_grid_thw) folded by the merger.
FEATURE_RULES = {"LlavaForConditionalGeneration": "select_strategy",
                 "Idefics3ForConditionalGeneration": "pixel_shuffle",
                 "SmolVLMForConditionalGeneration": "pixel_shuffle",
                 "Qwen2VLForConditionalGeneration": "grid_merge",
                 "Qwen2_5_VLForConditionalGeneration": "grid_merge",
                 "Qwen3VLForConditionalGeneration": "grid_merge",
                 "Gemma3ForConditionalGeneration": "pooled",
                 "LlavaOnevisionForConditionalGeneration": "anyres"}
# Families whose forward finds the image tokens through a token-type input (1 = image), which the loss module
# and evaluation always pass (token_type_inputs): the Qwen families' M-RoPE places image tokens by (time,
# height, width) from mm_token_type_ids, and without it falls back to 1-D positions silently; Gemma 3 lets an
# image's tokens attend to each other both ways from token_type_ids, and without it attends causally, silently.
TOKEN_TYPES = {"Qwen2VLForConditionalGeneration": "mm_token_type_ids",
               "Qwen2_5_VLForConditionalGeneration": "mm_token_type_ids",
               "Qwen3VLForConditionalGeneration": "mm_token_type_ids",
               "Gemma3ForConditionalGeneration": "token_type_ids"}
WITHOUT_TOKEN_TYPES = {"mm_token_type_ids": "its M-RoPE would give the image tokens 1-D text positions instead of "
                                            "(time, height, width)",
                       "token_type_ids": "its image tokens would attend causally instead of both ways within "
                                         "their image"}
OUTPUT_LAYER = "lm_head"  # outside language_model, but on the language side (text models can adapt it)
# Characters that make a target_modules entry a regular expression (matched in full against module
# names), not a module name; a dot alone stays a name separator.
PATTERN_CHARACTERS = set("*?[]()|^$\\+{}")


# Processors with a video slot whose video processor needs torchvision (absent beside the CPU torch build; its
# lookup even fails inside transformers 5.23 then). The workflow trains on images only, so these are built
# without it, on every machine alike (one code path): the tokenizer, the PIL image processor, the class.
IMAGE_ONLY_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "LlavaOnevisionProcessor")


@functools.lru_cache(maxsize=None)
def image_only(processor_class: type) -> type:
    """``processor_class`` without its video slot (ProcessorMixin's attributes come from ``__init__``'s
    signature); saved under the original class name, so its files stay the family's own."""
    class ImageOnly(processor_class):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **kwargs)

    import inspect

    # The parent's signature without the video slot: ProcessorMixin saves (and reloads) the settings it names.
    signature = inspect.signature(processor_class.__init__)
    ImageOnly.__init__.__signature__ = signature.replace(
        parameters=[p for name, p in signature.parameters.items() if name != "video_processor"])
    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class.__name__
    return ImageOnly


def load_processor(model_dir: str | Path):
    """The model's processor: ``AutoProcessor``'s, or for the families above the image-only one, from either file
    layout (``model/processor_files``: the Hub's ``preprocessor_config.json`` or transformers 5's
    ``processor_config.json``), with the PIL image processor (the torchvision one cannot be installed here)."""
    import inspect

    import transformers

    from workflow_scripts.model import processor_files

    settings = processor_files.read(model_dir)
    if settings is None:
        problem = processor_files.missing_processor_problem(model_dir, _model_type(model_dir))
        if problem is not None:
            raise WorkflowError(problem)
    recorded = settings.processor_class if settings is not None else None
    if recorded not in IMAGE_ONLY_PROCESSORS:
        return transformers.AutoProcessor.from_pretrained(str(model_dir))
    processor_class = getattr(transformers, recorded)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    # AutoImageProcessor reads either layout and picks the PIL backend without torchvision.
    image_processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
    # The processor's own settings (LLaVA-OneVision's num_image_tokens, vision_aspect_ratio...), as saved.
    own = {key: value for key, value in settings.own.items() if key in inspect.signature(processor_class.__init__).parameters
           and key not in ("image_processor", "tokenizer", "video_processor", "chat_template")}
    # The chat template where the processor files keep it (chat_template.jinja, or the Hub's chat_template.json),
    # as transformers' own processor loading finds it; else the tokenizer's.
    template = transformers.ProcessorMixin.get_processor_dict(str(model_dir))[0].get("chat_template")
    return image_only(processor_class)(image_processor=image_processor, tokenizer=tokenizer,
                                       chat_template=template or tokenizer.chat_template, **own)


def _model_type(model_dir: str | Path) -> str | None:
    from workflow_scripts.model import processor_files

    path = Path(model_dir) / "config.json"
    fields = processor_files.read_json(path, "a model config") if path.is_file() else {}
    return fields.get("model_type") if isinstance(fields, dict) else None


MAX_PIXELS_KEY, MIN_PIXELS_KEY = "variants.<name>.max_pixels", "variants.<name>.min_pixels"


def dynamic_resolution(image_processor) -> bool:
    """Qwen's image processors: size.shortest_edge / longest_edge are pixel counts (min_pixels / max_pixels), and
    smart_resize keeps each image's aspect within them, in multiples of patch_size x merge_size."""
    return type(image_processor).__name__.startswith("Qwen2VLImageProcessor")


def tiled(image_processor) -> bool:
    """LLaVA-OneVision / LLaVA-NeXT: any-resolution tiling over the grids in image_grid_pinpoints."""
    return getattr(image_processor, "image_grid_pinpoints", None) is not None


def apply_pixel_budget(processor, *, max_pixels: int | None, min_pixels: int | None) -> None:
    """Set the variant's pixel budget on the processor's image processor (in place), or refuse it by name where
    the family resizes every image to one fixed size (the budget would change nothing).

    Dynamic resolution (Qwen): the resized image's area lies within [min_pixels, max_pixels]. Tiling
    (LLaVA-OneVision): the tiling grids are those of at most max_pixels, so an image is tiled on a grid within
    the budget (the tower also sees the image whole, at one tile's size); min_pixels has no meaning there."""
    from transformers.image_utils import SizeDict

    if max_pixels is None and min_pixels is None:
        return
    image_processor = processor.image_processor
    kind = type(image_processor).__name__
    if tiled(image_processor):
        if min_pixels is not None:
            raise WorkflowError(f"{MIN_PIXELS_KEY}: {kind} tiles an image on a grid, it never scales one up; remove "
                                "min_pixels (max_pixels bounds the grid)")
        grids = [grid for grid in image_processor.image_grid_pinpoints if grid[0] * grid[1] <= max_pixels]
        if not grids:
            smallest = min(image_processor.image_grid_pinpoints, key=lambda grid: grid[0] * grid[1])
            raise WorkflowError(f"{MAX_PIXELS_KEY}: {max_pixels} is below {kind}'s smallest tiling grid "
                                f"{smallest[0]}x{smallest[1]} ({smallest[0] * smallest[1]} pixels); raise it")
        image_processor.image_grid_pinpoints = grids
        return
    if not dynamic_resolution(image_processor):
        raise WorkflowError(
            f"{MAX_PIXELS_KEY} / {MIN_PIXELS_KEY}: the model's image processor {kind} resizes every image to "
            f"{dict((k, v) for k, v in dict(image_processor.size).items() if v)}, so a pixel budget changes nothing; "
            "remove max_pixels and min_pixels from the variant, or use a dynamic-resolution or tiling model "
            "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision)")
    size = image_processor.size
    low = size.shortest_edge if min_pixels is None else min_pixels
    high = size.longest_edge if max_pixels is None else max_pixels
    factor = image_processor.patch_size * image_processor.merge_size
    if high < factor * factor:
        raise WorkflowError(f"{MAX_PIXELS_KEY}: {high} is below one image token of {kind} ({factor}x{factor} = "
                            f"{factor * factor} pixels); raise it")
    if low > high:
        raise WorkflowError(f"{MIN_PIXELS_KEY}: {low} is above max_pixels {high}; lower min_pixels or raise max_pixels")
    image_processor.size = SizeDict(shortest_edge=low, longest_edge=high)


def max_image_tokens(image_processor_settings: Mapping[str, Any]) -> int | None:
    """The most image tokens one image can become under a dynamic-resolution processor's budget (its
    ``to_dict()``, as tokenise_meta.json holds it): max_pixels over the pixels one token covers; None for the
    other families (their count is the model's, image_features_per_image)."""
    if not str(image_processor_settings.get("image_processor_type", "")).startswith("Qwen2VLImageProcessor"):
        return None
    factor = image_processor_settings["patch_size"] * image_processor_settings["merge_size"]
    return image_processor_settings["size"]["longest_edge"] // (factor * factor)


def max_tiles(image_processor_settings: Mapping[str, Any]) -> int | None:
    """Tiles the tower sees for one image under a tiling processor's grids, the whole image included (one tile's
    size each); None for the other families."""
    grids = image_processor_settings.get("image_grid_pinpoints")
    if not grids:
        return None
    size = image_processor_settings["size"]
    tile = size.get("height") or size.get("shortest_edge")
    return max(rows * columns for rows, columns in grids) // (tile * tile) + 1


def align_tiling(model: nn.Module, grids) -> str | None:
    """Give a tiling model (LLaVA-OneVision) the processor's tiling grids, as the pixel budget left them: the model
    counts each image's tiles and unpads its features from its config's grids, so they must be the ones the
    images were tiled on. Nothing for the other families (no grids, or none given)."""
    from workflow_scripts.model.parameter_names import unwrap

    base, _ = base_of(unwrap(model))
    if not grids or getattr(base.config, "image_grid_pinpoints", None) is None:
        return None
    base.config.image_grid_pinpoints = [list(grid) for grid in grids]
    return f"{len(grids)} tiling grids"


def image_placeholder(processor) -> str:
    """What a prompt without a chat template writes for one image: the processor's image token, which it expands
    into the image's tokens; Qwen's between its vision start and end tokens, as its chat template writes it."""
    if type(processor).__name__ in IMAGE_ONLY_PROCESSORS and type(processor).__name__.startswith("Qwen"):
        return "<|vision_start|>" + processor.image_token + "<|vision_end|>"
    return processor.image_token


def base_of(model: nn.Module) -> tuple[nn.Module, str]:
    """The transformers model inside a PEFT wrapper (and the prefix PEFT puts before its names)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return model.get_base_model(), PEFT_PREFIX
    return model, ""


def components(model: nn.Module) -> dict[str, str]:
    """Module-name prefixes of ``vision_tower``, ``projector``, ``language_model`` and ``output_layer``
    (as ``model.named_modules()`` spells them, so with ``base_model.model.`` for a PEFT model)."""
    base, prefix = base_of(model)
    family = FAMILIES.get(type(base).__name__)
    if family is None:
        raise WorkflowError(f"model class {type(base).__name__} is not a supported vision-language model for "
                            f"task vision_language (supported: {', '.join(FAMILIES)})")
    modules = dict(base.named_modules())
    missing = [path for path in family.values() if path not in modules]
    if missing:  # a transformers release that moved the parts: fail here, not with a tower left unfrozen
        raise WorkflowError(f"model class {type(base).__name__} has no module {missing[0]} in this transformers "
                            "version; update vision_language_model.FAMILIES")
    return {**{part: prefix + path for part, path in family.items()}, "output_layer": prefix + OUTPUT_LAYER}


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def is_pattern(entry: str) -> bool:
    return bool(PATTERN_CHARACTERS & set(entry))


def matches(entry: str, name: str) -> bool:
    """PEFT's rule for a list entry (the name, or a dotted suffix of it); regex entries in full."""
    if is_pattern(entry):
        return re.fullmatch(entry, name) is not None
    return name == entry or name.endswith("." + entry)


def lora_target_modules(model: nn.Module, target_modules: list[str], *, train_tower: bool) -> list[str]:
    """Full names of the Linear layers that ``target_modules`` selects on the language side (the
    language model and the output layer), plus the vision tower's when ``train_tower``.

    Returned as a list of full names rather than one regex: PEFT matches a list entry exactly (or as a
    dotted suffix), so the adapter config records exactly which layers were adapted, and nothing in
    the tower can match by accident. Bare names (``q_proj``) select by layer type; a dotted path or a
    regex names places, so one that reaches into the tower without ``train_tower`` is refused.
    Typos are reported here rather than by ``model_loading.check_module_names``: its closest names come
    from every module (the tower's too) and it knows no regex entries.
    """
    base, prefix = base_of(model)
    if prefix:  # PEFT's LoRA layers are no nn.Linear, so a wrapped model's q_proj would match nothing
        raise TypeError("lora_target_modules takes the model before get_peft_model wraps it")
    parts = components(base)
    linear = [name for name, module in base.named_modules() if isinstance(module, nn.Linear)]
    language = [n for n in linear if under(n, parts["language_model"]) or under(n, parts["output_layer"])]
    projector = [n for n in linear if under(n, parts["projector"])]
    tower = [n for n in linear if under(n, parts["vision_tower"]) and n not in projector]
    chosen: list[str] = []
    for entry in target_modules:
        if is_pattern(entry):
            try:
                re.compile(entry)
            except re.error as error:
                raise WorkflowError(f"{TARGETS_KEY}: '{entry}' is not a valid regular expression ({error})") from None
        hit_language = [n for n in language if matches(entry, n)]
        hit_tower = [n for n in tower if matches(entry, n)]
        hit_projector = [n for n in projector if matches(entry, n)]
        names_a_place = is_pattern(entry) or "." in entry
        if hit_tower and not train_tower and (names_a_place or not hit_language):
            raise WorkflowError(
                f"{TARGETS_KEY}: '{entry}' reaches into the vision tower ({len(hit_tower)} layers, e.g. "
                f"{hit_tower[0]}) but {TRAIN_TOWER_KEY} is false; set {TRAIN_TOWER_KEY}: true to adapt the tower, "
                "or name language-model layers only")
        if hit_projector and (names_a_place or not hit_language):
            raise WorkflowError(
                f"{TARGETS_KEY}: '{entry}' names projector layers ({hit_projector[0]}); the projector is trained "
                f"whole with {TRAIN_PROJECTOR_KEY}: true, not with LoRA")
        selected = hit_language + (hit_tower if train_tower else [])
        if not selected:
            pool = language + (tower if train_tower else [])
            leaves = sorted({n if names_a_place else n.rsplit(".", 1)[-1] for n in pool})
            close = difflib.get_close_matches(entry, leaves, n=3)
            raise WorkflowError(f"{TARGETS_KEY}: '{entry}' matches no Linear layer of the language model "
                                f"(closest: {close}); fix the name or remove it")
        chosen.extend(n for n in selected if n not in chosen)
    return sorted(chosen)


def modules_to_save(model: nn.Module, *, train_projector: bool) -> list[str]:
    """The projector's full module name when it is trained (PEFT then saves it whole with the adapter)."""
    base, _ = base_of(model)
    return [components(base)["projector"]] if train_projector else []


def tower_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The vision tower's parameters under PEFT-relative names (DDP's and the loss module's wrappers removed)."""
    from workflow_scripts.model.parameter_names import named_parameters, unwrap

    parts = components(unwrap(model))
    return {name: p for name, p in named_parameters(model).items()
            if under(name, parts["vision_tower"]) and not under(name, parts["projector"])}


def check_frozen_tower(peft_model: nn.Module, *, train_tower: bool) -> str:
    """Every LoRA parameter trainable; the tower's own weights frozen, and its adapters only with ``train_tower``."""
    from workflow_scripts.core.errors import PreflightError
    from workflow_scripts.core.errors import few_names as _names
    from workflow_scripts.model.parameter_names import lora_parameters

    lora = lora_parameters(peft_model)
    frozen = [n for n, p in lora.items() if not p.requires_grad]
    if frozen:
        raise PreflightError(
            "frozen_tower", f"{len(frozen)} LoRA parameters have requires_grad=False ({_names(frozen)})",
            "freeze the vision tower before PEFT adds the adapters, never after (requires_grad_(False) on a "
            "module that already holds adapters freezes them too)")
    tower = tower_parameters(peft_model)
    trainable = [n for n, p in tower.items() if p.requires_grad]
    weights = [n for n in trainable if "lora_" not in n]
    if weights:
        raise PreflightError(
            "frozen_tower",
            f"{len(weights)} vision-tower weights are trainable, not only adapters ({_names(weights)})",
            f"leave the tower's own weights frozen; adapt it through {TRAIN_TOWER_KEY}: true instead")
    if trainable and not train_tower:
        raise PreflightError(
            "frozen_tower",
            f"{len(trainable)} vision-tower adapter parameters are trainable though {TRAIN_TOWER_KEY} is false "
            f"({_names(trainable)})",
            f"keep tower layers out of {TARGETS_KEY} (lora_target_modules resolves them), "
            f"or set {TRAIN_TOWER_KEY}: true")
    if train_tower:
        if not trainable:
            raise PreflightError(
                "frozen_tower", f"{TRAIN_TOWER_KEY} is true but no vision-tower parameter is trainable",
                f"name tower layers in {TARGETS_KEY} (e.g. q_proj, v_proj) or set {TRAIN_TOWER_KEY}: false")
        return f"{len(lora)} LoRA parameters trainable, {len(trainable)} of them in the vision tower"
    return f"{len(lora)} LoRA parameters trainable; vision tower frozen ({len(tower)} tensors)"


def check_tower_gradients(peft_model: nn.Module, *, train_tower: bool) -> str:
    """After one backward: a frozen tower holds no gradient; an adapted tower's lora_B gradients are non-zero."""
    from workflow_scripts.core.errors import PreflightError
    from workflow_scripts.core.errors import few_names as _names

    tower = tower_parameters(peft_model)
    with_grad = [n for n, p in tower.items() if p.grad is not None and p.grad.any()]
    if not train_tower:
        if with_grad:
            raise PreflightError(
                "tower_gradients", f"{len(with_grad)} vision-tower parameters received gradients though "
                f"{TRAIN_TOWER_KEY} is false ({_names(with_grad)})",
                f"freeze the tower before PEFT wraps the model and keep its layers out of {TARGETS_KEY}")
        return f"vision tower frozen: no gradients in its {len(tower)} tensors"
    # lora_B starts at zero, so lora_A's first gradient is zero by design (as in check_gradients).
    adapters = [n for n in tower if "lora_B" in n]
    silent = [n for n in adapters if n not in with_grad]
    if silent or not adapters:
        raise PreflightError(
            "tower_gradients", f"{len(silent)} of {len(adapters)} vision-tower adapters got no gradient "
            f"({_names(silent) or 'none adapted'})",
            "the adapted tower layers must lie on the path to the loss (check the model's vision_feature_layer "
            "and that pixel_values reach the forward)")
    return f"{len(adapters)} vision-tower adapters have non-zero gradients"


def image_features_per_image(model: nn.Module, height: int, width: int) -> int:
    """How many features the model's tower + projector make for one image of ``height`` x ``width`` pixels
    (the fixed-size families; a Qwen image's count follows its grid: :func:`image_features`)."""
    from workflow_scripts.model.parameter_names import unwrap

    base, _ = base_of(unwrap(model))
    config = base.config
    components(base)  # refuses an unsupported family by name
    patch = config.vision_config.patch_size
    patches = (height // patch) * (width // patch)
    rule = FEATURE_RULES[type(base).__name__]
    if rule == "pooled":  # Gemma 3: the projector pools every image (or pan-and-scan crop) to a fixed count
        return config.mm_tokens_per_image
    if rule == "grid_merge":
        return patches // config.vision_config.spatial_merge_size ** 2
    if rule == "select_strategy":
        # CLIP towers prepend a class token (SigLIP's do not); "default" drops the first position.
        has_class_token = config.vision_config.model_type == "clip_vision_model"
        return patches + int(has_class_token) - int(config.vision_feature_select_strategy == "default")
    return patches // config.scale_factor ** 2  # Idefics3 / SmolVLM: pixel shuffle folds scale^2 patches


def count_images(pixel_values: torch.Tensor) -> int:
    """Images the model will encode: LLaVA takes (images, C, H, W); Idefics3 takes (batch, images, C, H, W)
    and skips padding images, which it recognises as all-zero pixel tensors."""
    if pixel_values.dim() == 4:
        return pixel_values.shape[0]
    flat = pixel_values.reshape(-1, *pixel_values.shape[-3:])
    return int((flat != 0).flatten(1).any(dim=1).sum())


def image_features(batch: Mapping[str, Any], model: nn.Module) -> tuple[int, str]:
    """(image features the tower + projector make for the batch's images, how they were counted)."""
    from workflow_scripts.model.parameter_names import unwrap

    base, _ = base_of(unwrap(model))
    components(base)
    pixel_values = batch["pixel_values"]
    if FEATURE_RULES[type(base).__name__] == "anyres":
        # LLaVA-OneVision: the base image and its tiles, unpadded to the image's aspect, a newline feature per
        # row, capped by vision_aspect_ratio; counted by the model's own code (one pass of the frozen tower).
        sizes = batch.get("image_sizes")
        if sizes is None:
            raise _refusal("image_tokens", "the batch has pixel_values but no image_sizes",
                           "collate the processor's image_sizes with the pixel values (IMAGE_INPUTS)")
        dtype = next(base.parameters()).dtype
        try:
            with torch.no_grad():
                features = base.model.get_image_features(pixel_values=pixel_values.to(dtype), image_sizes=sizes,
                                                         batch_num_images=batch.get("batch_num_images"),
                                                         return_dict=True).pooler_output
        except RuntimeError as error:  # the model splits the tiles by its own grids: another count fails here
            raise _refusal("image_tokens", f"the model's tiling grids do not give the batch's {pixel_values.shape} "
                           f"tiles ({str(error).splitlines()[0]})",
                           "give the model the grids the processor tiled with (vision_language_model.align_tiling; "
                           "the pixel budget changes them)") from None
        counts = sorted({len(feature) for feature in features})
        return sum(len(feature) for feature in features), (
            f"{len(features)} images, {counts[0]}-{counts[-1]} image tokens each" if len(counts) > 1
            else f"{len(features)} images, {counts[0]} image tokens each")
    if FEATURE_RULES[type(base).__name__] == "grid_merge":
        grid = batch.get("image_grid_thw")
        if grid is None:
            raise _refusal("image_tokens", "the batch has pixel_values but no image_grid_thw",
                           "collate the processor's image_grid_thw with the pixel values (IMAGE_INPUTS)")
        merge = base.config.vision_config.spatial_merge_size
        per_image = (grid.prod(-1) // merge ** 2).tolist()
        if grid.prod(-1).sum() != pixel_values.shape[0]:
            raise _refusal("image_tokens", f"image_grid_thw gives {int(grid.prod(-1).sum())} patches but pixel_values "
                           f"holds {pixel_values.shape[0]}", "collate pixel_values and image_grid_thw from one "
                           "processor call")
        counts = sorted(set(per_image))
        return sum(per_image), (f"{len(per_image)} images, {counts[0]}-{counts[-1]} image tokens each"
                                if len(counts) > 1 else f"{len(per_image)} images, {counts[0]} image tokens each")
    height, width = pixel_values.shape[-2:]
    images = count_images(pixel_values)
    per_image = image_features_per_image(model, height, width)
    return images * per_image, f"{images} images, {per_image} image tokens each"


def token_type_inputs(model: nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The token-type input a family's forward needs beside input_ids (TOKEN_TYPES: 1 on image tokens, 0
    elsewhere, as its processor makes them); nothing for the other families."""
    from workflow_scripts.model.parameter_names import unwrap

    base, _ = base_of(unwrap(model))
    name = TOKEN_TYPES.get(type(base).__name__)
    if name is None:
        return {}
    return {name: (input_ids == base.config.image_token_id).to(torch.int32 if name.startswith("mm_") else torch.long)}


def _refusal(name: str, problem: str, fix: str):
    from workflow_scripts.core.errors import PreflightError

    return PreflightError(name, problem, fix)


def check_image_tokens(batch: Mapping[str, Any], model: nn.Module) -> str:
    """The image-token ids in ``input_ids`` equal the image features the model makes for ``pixel_values``
    (a truncated prompt that cut an image's tokens fails inside the forward otherwise, far from the cause),
    and a family with a token-type input (TOKEN_TYPES) gets it on exactly those tokens."""
    from workflow_scripts.model.parameter_names import unwrap

    base, _ = base_of(unwrap(model))
    image_token_id = base.config.image_token_id
    pixel_values = batch.get("pixel_values")
    is_image = batch["input_ids"] == image_token_id
    tokens = int(is_image.sum())
    if pixel_values is None:
        if tokens:
            raise _refusal("image_tokens", f"the batch has {tokens} image tokens but no pixel_values",
                           "collate the processor's pixel_values with the rows that hold image tokens")
        return "no images in this batch"
    features, detail = image_features(batch, model)
    if tokens != features:
        raise _refusal(
            "image_tokens", f"the batch has {tokens} image tokens (id {image_token_id}) but its images give "
            f"{features} image features ({detail})",
            "build prompts with the model's processor (it expands each image placeholder) and keep "
            "pretokenise's max_length long enough that no image's tokens are truncated")
    name = TOKEN_TYPES.get(type(base).__name__)
    if name is not None:
        types = batch.get(name)
        if types is None or not torch.equal(types.bool(), is_image):
            raise _refusal(
                "image_tokens", f"{type(base).__name__} gets " + (f"no {name}" if types is None else
                                                                  f"{name} that miss its image tokens")
                + f": {WITHOUT_TOKEN_TYPES[name]}",
                "pass vision_language_model.token_type_inputs(model, input_ids) to the forward and to generate")
        detail += ("; M-RoPE positions from mm_token_type_ids" if name == "mm_token_type_ids"
                   else "; image tokens attend within their image (token_type_ids)")
    return detail


def check_pixel_dtype(batch: Mapping[str, Any], dtype: torch.dtype) -> str:
    """``pixel_values`` are finite and in the dtype the vision tower computes in."""
    from workflow_scripts.core.errors import PreflightError

    pixel_values = batch.get("pixel_values")
    if pixel_values is None:
        raise PreflightError("pixel_dtype", "the batch has no pixel_values",
                             "collate the processor's pixel_values into every vision_language batch")
    if pixel_values.dtype != dtype:
        raise PreflightError("pixel_dtype", f"pixel_values are {pixel_values.dtype} but the model runs in {dtype}",
                             f"cast pixel_values to {dtype} in the collator, as the model's weights are")
    if not torch.isfinite(pixel_values).all():
        raise PreflightError("pixel_dtype", "pixel_values hold NaN or Inf",
                             "check the images decode and the processor's normalisation (image_std must not be 0)")
    return f"pixel_values {tuple(pixel_values.shape)} {dtype}"
