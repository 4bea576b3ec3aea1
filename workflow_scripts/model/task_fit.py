"""A dataset on a model its task cannot load, refused when the workflow is parsed (``snakemake -n``).

Where the model's config can be read without downloading anything (a tiny model's ``model.tiny.architecture``,
a local model folder's ``config.json``, or a model already prepared under ``resources/models/<name>/``), a
vision_language dataset listed for (or, without a ``models:`` list, run on) a model that has no vision part,
and a masked_lm dataset on a model without a masked-LM form (a causal LM), are refused naming the dataset and
model. Otherwise (a hub model not yet downloaded) the stage-time check ``model_loading.check_task_architecture``
gives the same verdict once the model is there.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core.errors import ConfigError

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import ModelSettings


def text_only_reason(name: str, spec: "ModelSettings", root: Path, key: str | None = None) -> str | None:
    """Why model ``name`` reads text only (its type, where it was read), or None (a vision model, or not known yet)."""
    from workflow_scripts.model import tiny_vlm

    if spec.source == "tiny":
        architecture = spec.tiny.architecture
        return None if architecture in tiny_vlm.ARCHITECTURES else (
            f"a tiny '{architecture}' model ({key or f'models.{name}'}.tiny.architecture; the vision ones are "
            f"{list(tiny_vlm.ARCHITECTURES)})")
    known = saved_model_type(name, spec, root)
    if known is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return None if known[0] in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES else f"a '{known[0]}' model (per {known[1]})"


def saved_model_type(name: str, spec: "ModelSettings", root: Path) -> tuple[str, Path] | None:
    """(model_type, its config.json) of a local or already prepared model that transformers knows, or None (not
    here yet, unreadable, or a model with its own code, which the loader judges)."""
    folders = [root / "resources" / "models" / name]
    if spec.source == "local":
        folders.insert(0, Path(spec.path))
    config_file = next((folder / "config.json" for folder in folders if (folder / "config.json").is_file()), None)
    if config_file is None:
        return None
    try:
        fields = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # prepare_model names a broken config.json
    if not isinstance(fields, dict) or fields.get("auto_map"):
        return None  # the model's own code decides; the loader judges it
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = fields.get("model_type")
    return (model_type, config_file) if model_type in CONFIG_MAPPING_NAMES else None


def no_masked_lm_reason(name: str, spec: "ModelSettings", root: Path, key: str | None = None) -> str | None:
    """Why model ``name`` has no masked-LM form (its type, where it was read), or None (it has, or not known yet)."""
    from workflow_scripts.model import tiny_bert

    if spec.source == "tiny":  # decided without importing transformers (and torch): every job reads this
        architecture = spec.tiny.architecture
        return None if architecture in tiny_bert.ARCHITECTURES else (
            f"a tiny '{architecture}' model ({key or f'models.{name}'}.tiny.architecture; the masked LMs are "
            f"{list(tiny_bert.ARCHITECTURES)})")
    known = saved_model_type(name, spec, root)
    if known is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return None if known[0] in MODEL_FOR_MASKED_LM_MAPPING_NAMES else f"a '{known[0]}' model (per {known[1]})"


def _first_misfit(config: Mapping[str, Any], task: str, reason_of, source: str | None, root: str | Path):
    """(dataset, its settings, model, reason, every model entry) of the first dataset of ``task`` run on a model
    that ``reason_of(name, entry, root, key)`` says cannot serve it, or None."""
    all_models = xc.model_entries(config, source)
    for dataset, settings in xc.dataset_entries(config, source).items():
        if settings.task != task:
            continue
        for model in xc.dataset_models(config, dataset):
            reason = reason_of(model, all_models[model], Path(root), xc.model_key(config, model))
            if reason is not None:
                return dataset, settings, model, reason, all_models
    return None


def check_masked_lm_models(config: Mapping[str, Any], source: str | None = None, root: str | Path = ".") -> None:
    """Refuse a masked_lm dataset run on a model whose known config has no masked-LM form (a causal LM): its
    untrained model's evaluation, the first job scheduled, would otherwise stop in transformers' traceback."""
    misfit = _first_misfit(config, "masked_lm", no_masked_lm_reason, source, root)
    if misfit is None:
        return
    dataset, settings, model, reason, all_models = misfit
    fix = (f"remove '{model}' from datasets.{dataset}.models" if settings.models else
           "run it on a masked language model (e.g. a tiny one with tiny.architecture: bert)"
           if len(all_models) == 1 else
           f"give datasets.{dataset} a models: list of masked language models (e.g. a tiny one with "
           "tiny.architecture: bert)")
    raise ConfigError(f"datasets.{dataset}.models", f"task masked_lm needs a masked language model (an "
                      f"encoder such as BERT, with a [MASK] token and a head that predicts it), but "
                      f"'{model}' is {reason}, which predicts the next token only; {fix}", source)


# How each family sizes its images (model_type, and model.tiny.architecture alike): a pixel budget changes the
# dynamic-resolution and the tiling ones (max_pixels only) and nothing in the others, which resize every image to
# one size (vision_language_model.apply_pixel_budget refuses the same at pretokenise for a model not known here).
DYNAMIC_RESOLUTION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TILING = ("llava_onevision", "llava_next")


def model_family(name: str, spec: "ModelSettings", root: Path) -> tuple[str, str] | None:
    """(model_type, where it was read) of a tiny or already readable model, or None (not known yet)."""
    if spec.source == "tiny":
        return spec.tiny.architecture, f"models.{name}.tiny.architecture"
    known = saved_model_type(name, spec, root)
    return None if known is None else (known[0], str(known[1]))


def budget_problem(variant: str, settings, model_type: str, where: str) -> tuple[str, str] | None:
    """(key, message) when a variant's pixel budget cannot apply to a model of ``model_type``, or None."""
    if settings.max_pixels is None and settings.min_pixels is None:
        return None
    if model_type in DYNAMIC_RESOLUTION:
        return None
    if model_type in TILING:
        if settings.min_pixels is None:
            return None
        return (f"variants.{variant}.min_pixels", f"a '{model_type}' model ({where}) tiles an image on a grid and never "
                "scales one up; remove min_pixels (max_pixels bounds the grid)")
    key = "max_pixels" if settings.max_pixels is not None else "min_pixels"
    return (f"variants.{variant}.{key}", f"a '{model_type}' model ({where}) resizes every image to one fixed size, "
            "so a pixel budget changes nothing; remove max_pixels and min_pixels from the variant, or run it on a "
            "dynamic-resolution or tiling model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision)")


def check_vision_language_models(config: Mapping[str, Any], source: str | None = None, root: str | Path = ".") -> None:
    """Refuse a vision_language dataset run on a model whose known config has no vision part; then, for each
    vision_language (model, variant) whose model is known, a pixel budget its family cannot apply, and a
    dynamic-resolution model folder without its processor file (``model/processor_files``)."""
    misfit = _first_misfit(config, "vision_language", text_only_reason, source, root)
    if misfit is None:
        check_vision_language_inputs(config, source, root)
        return
    dataset, settings, model, reason, all_models = misfit
    fix = (f"remove '{model}' from datasets.{dataset}.models" if settings.models else
           "run it on a vision-language model (e.g. a tiny one with tiny.architecture: llava)"
           if len(all_models) == 1 else
           f"give datasets.{dataset} a models: list of vision-language models only")
    raise ConfigError(f"datasets.{dataset}.models", f"task vision_language needs a model with a vision part, "
                      f"but '{model}' is {reason}, which reads text only; {fix}", source)


def check_vision_language_inputs(config: Mapping[str, Any], source: str | None = None, root: str | Path = ".") -> None:
    """The pixel budget against the model's family, and the processor file a dynamic-resolution model needs."""
    from workflow_scripts.model import processor_files

    models = xc.model_entries(config, source)
    variants = {name: entry for name, entry in xc.variant_entries(config, source).items()
                if entry.task == "vision_language"} if config.get("variants") else {}
    checked = set()
    for dataset, settings in xc.dataset_entries(config, source).items():
        if settings.task != "vision_language":
            continue
        for model in xc.dataset_models(config, dataset):
            if model in checked:
                continue
            checked.add(model)
            spec = models[model]
            known = model_family(model, spec, Path(root))
            if known is None:
                continue
            for variant, entry in variants.items():
                problem = budget_problem(variant, entry, *known)
                if problem is not None:
                    raise ConfigError(problem[0], f"model '{model}': {problem[1]}", source)
            if spec.source == "local":  # the user's folder; a prepared copy holds what prepare_model checked
                missing = processor_files.missing_processor_problem(Path(spec.path), known[0])
                if missing is not None:
                    raise ConfigError(f"models.{model}.path", missing, source)
