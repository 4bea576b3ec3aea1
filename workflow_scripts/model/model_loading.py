"""Loading the base model, its tokenizer and LoRA adapters — one code path for sanity, train and evaluate.

Placement rule (seeds: meta tensors with CPU offload, ``device_map="auto"`` under DDP): the whole
model is materialised on exactly one device per process, loaded straight onto it with
``device_map={"": device}`` (never ``"auto"``, never offload): transformers 5 ignores
``low_cpu_mem_usage``, so without it each of 8 ranks on a node would first build a full copy in host memory.

``training.finetune: full`` trains every parameter without PEFT (:func:`prepare_full`); its output
directory holds the whole model (``save_pretrained`` safetensors) and :data:`FULL_MODEL_MARKER`, and
:func:`load_adapter` loads either kind. ``model.initialise: random`` (recorded by prepare_model in
``model_manifest.json``) builds the model from its config with fresh seeded weights instead of loading them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.core.settings import LoraSettings
from workflow_scripts.model.model_files import MANIFEST_NAME

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# A tokenizer needs at least one of these (the rest, e.g. tokenizer_config.json, only configure it).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
REPREPARE = "run the prepare_model rule again (snakemake --forcerun prepare_model)"
# Beside a fully fine-tuned model's weights: what evaluate reads to load it whole instead of as a LoRA adapter.
FULL_MODEL_MARKER = "full_model.json"


def weights_dtype(precision: str, device: torch.device) -> torch.dtype:
    """Frozen base weights are stored in bf16 on GPUs when training in bf16; fp32 otherwise.

    fp16 keeps fp32 master weights (autocast + GradScaler), and CPU runs stay fp32 for exactness.
    """
    if precision == "bf16" and device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def check_model_directory(model_dir: str | Path) -> None:
    """A prepared model directory: a config.json that parses as a JSON object, and safetensors weights.

    Checked before transformers reads it, whose errors are multi-line tracebacks that do not say which
    file is wrong (or, for bad JSON, where).
    """
    directory = Path(model_dir)
    config = directory / "config.json"
    if not config.is_file():
        raise WorkflowError(f"{model_dir}: no config.json; run the prepare_model rule first")
    try:
        fields = json.loads(config.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        raise WorkflowError(f"{config}: not UTF-8 text (byte offset {error.start}); {REPREPARE}") from None
    except json.JSONDecodeError as error:
        raise WorkflowError(f"{config}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}; "
                            f"{REPREPARE}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise WorkflowError(f"{config}: not a transformers model config (a JSON object with 'model_type'); {REPREPARE}")
    if initialisation(directory) == "random":  # weights drawn from the config at load: none needed
        return
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # sharded weights: every shard the index names must be there
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WorkflowError(f"{index}: not a safetensors index (JSON with a 'weight_map'); {REPREPARE}") from None
        missing = [shard for shard in shards if not (directory / shard).is_file()]
        if missing:
            raise WorkflowError(f"{model_dir}: weight shards {missing} named in {index.name} are missing; {REPREPARE}")
    elif not any(directory.glob("*.safetensors")):
        raise WorkflowError(f"{model_dir}: no model weights (no *.safetensors file); {REPREPARE}")


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    directory = Path(model_dir)
    if not any((directory / name).is_file() for name in VOCABULARY_FILES):
        raise WorkflowError(f"{model_dir}: no tokenizer files ({', '.join(VOCABULARY_FILES[:-1])} or "
                            f"{VOCABULARY_FILES[-1]}); {REPREPARE}, from a source that ships its tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as error:  # transformers' multi-line reasons, cut to their first line
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise WorkflowError(f"{model_dir}: the tokenizer cannot be loaded ({type(error).__name__}: {first_line}); "
                            f"{REPREPARE}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise WorkflowError(f"{model_dir}: the tokenizer is not a fast tokenizer; batched pre-tokenisation needs one")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_tokenised_for_model(data_dir: str | Path, meta: Mapping[str, Any], model_dir: str | Path) -> None:
    """Pre-tokenised data must come from this model's tokenizer (sanity and train call this).

    The ids of another tokenizer below the model's vocabulary size pass every range check and train on
    the wrong tokens, so the fingerprint pretokenise recorded is compared with the model's tokenizer
    files, computed the same way. A model directory without tokenizer files cannot be compared (nothing
    could have been tokenised with it); there the vocabulary-size checks still apply.
    """
    from workflow_scripts.data.fingerprints import TOKENIZER_FILES, tokenizer_fingerprint  # pretokenise's key

    check_model_directory(model_dir)
    recorded = meta.get("tokenizer_fingerprint")
    if recorded is None or not any(Path(model_dir, name).is_file() for name in TOKENIZER_FILES):
        return
    current = tokenizer_fingerprint(Path(model_dir))
    if recorded != current:
        raise WorkflowError(
            f"{Path(data_dir, 'tokenise_meta.json')}: tokenised with tokenizer fingerprint {recorded[:12]}, but the "
            f"tokenizer of {model_dir} has fingerprint {current[:12]}; the data was tokenised for another model: "
            "re-run the pretokenise rule for this model (snakemake --forcerun pretokenise)")


def _prepared_settings(model_dir: str | Path) -> dict:
    """The model settings prepare_model recorded in ``model_manifest.json`` ({} without a manifest)."""
    manifest = Path(model_dir, MANIFEST_NAME)
    if not manifest.is_file():
        return {}
    try:
        settings = json.loads(manifest.read_text(encoding="utf-8")).get("settings") or {}
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise WorkflowError(f"{manifest}: not a JSON object with 'settings'; {REPREPARE}") from None
    return settings if isinstance(settings, dict) else {}


def initialisation(model_dir: str | Path) -> str:
    """``model.initialise`` as prepare_model recorded it: ``random`` (fresh weights from the config,
    pretraining from scratch) or ``pretrained`` (when absent, or for a directory without a manifest)."""
    initialise = _prepared_settings(model_dir).get("initialise", "pretrained")
    if initialise not in ("pretrained", "random"):
        raise WorkflowError(f"{Path(model_dir, MANIFEST_NAME)}: settings.initialise is {initialise!r}, not pretrained "
                            f"or random; {REPREPARE}")
    return initialise


def load_base_model(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    auto_class: str = "AutoModelForCausalLM",
    model_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
):
    """Load the model fully onto ``device`` (one device for the whole model, never offload).

    ``auto_class`` is the task's transformers Auto class (``tasks.base.Task.auto_model_class``);
    ``model_kwargs`` the task's extra ``from_pretrained`` arguments (a classifier's labels). With
    ``model.initialise: random`` the weights are drawn from ``seed`` (the experiment seed in training;
    0 for evaluate's untrained baseline), on the CPU, so every process and device draws the same.

    ``device`` meta (FSDP's ranks other than 0, ``fsdp.loading_device``): the same architecture built
    from the config without storage or weights; ``fsdp.shard`` then gives it rank 0's values.
    """
    import transformers

    check_model_directory(model_dir)
    auto = getattr(transformers, auto_class)
    if device.type == "meta":
        config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code,
                                                         **dict(model_kwargs or {}))
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        model.config.name_or_path = str(model_dir)  # as from_pretrained records it (PEFT's adapter_config reads it)
        return model
    # A tiny model (source tiny) is random already, drawn from model.tiny.seed: used as built.
    if initialisation(model_dir) == "random" and _prepared_settings(model_dir).get("source") != "tiny":
        config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code,
                                                         **dict(model_kwargs or {}))
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
            torch.manual_seed(seed)
            model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        return model.to(device)
    kwargs = {"device_map": {"": str(device)}, **dict(model_kwargs or {})}  # QLoRA passes the same map
    model = auto.from_pretrained(str(model_dir), dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    return model.to(device)


def enable_gradient_checkpointing(model, input_gradients: bool) -> None:
    """Non-reentrant checkpointing (gradients reach parameters the recomputed segments use); input
    gradients only when the embeddings are frozen (LoRA), so the checkpointed segments see a grad input."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if input_gradients:
        model.enable_input_require_grads()


def checkpoint_first_layers(model, count: int) -> int:
    """Partial activation checkpointing: with checkpointing enabled, only the first ``count`` decoder layers
    recompute in the backward; the others keep their activations (transformers checkpoints per layer, by each
    layer's ``gradient_checkpointing`` flag). The first ones: the backward reaches them last, after the layers
    that kept their activations have freed them, so a recompute never adds to those. For when all activations
    do not fit but some do (``memory_estimate.layers_to_checkpoint``). Returns how many layers checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for k, layer in enumerate(layers):
        layer.gradient_checkpointing = k < count  # an instance flag over the class default (False)
    return min(count, len(layers))


def prepare_full(model, gradient_checkpointing: bool):
    """``training.finetune: full``: no PEFT wrap, every parameter trainable and held in fp32 (master
    weights; autocast still computes in bf16/fp16)."""
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, input_gradients=False)
    model.requires_grad_(True)
    keep_trainable_in_fp32(model)
    return model


def add_lora(model, lora: LoraSettings, gradient_checkpointing: bool, task_type: str | None = "CAUSAL_LM"):
    """Wrap ``model`` with fresh LoRA adapters; the base stays frozen, adapters are trainable.

    PEFT is applied *after* any freezing (seed: a tower frozen after adapters were added left them
    frozen); non-reentrant checkpointing plus input gradients keeps gradients flowing to adapters
    when the embeddings are frozen.
    """
    from peft import LoraConfig, get_peft_model

    if gradient_checkpointing:
        enable_gradient_checkpointing(model, input_gradients=True)
    check_module_names(model, "modules_to_save", lora.modules_to_save)
    check_module_names(model, "target_modules", lora.target_modules)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=list(lora.modules_to_save) or None,
        task_type=task_type,
    )
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as error:
        raise WorkflowError(f"training.lora.target_modules {list(lora.target_modules)}: {error}") from None
    keep_trainable_in_fp32(peft_model)
    return peft_model


def check_module_names(model, key: str, names) -> None:
    """Each ``target_modules`` / ``modules_to_save`` entry must name a module of this model.

    PEFT matches an entry against the end of module names and skips one that matches nothing without
    a word, so a typo would train fewer adapters (or leave a head frozen and unsaved) in silence.
    """
    import difflib

    modules = [name for name, _ in model.named_modules() if name]
    for entry in names:
        if not any(name == entry or name.endswith("." + entry) for name in modules):
            close = difflib.get_close_matches(entry, sorted({m.rsplit(".", 1)[-1] for m in modules}), n=3)
            raise WorkflowError(f"training.lora.{key}: '{entry}' matches no module of this model "
                                f"(closest: {close}); fix the name or remove it")


def keep_trainable_in_fp32(model) -> None:
    """Every trainable tensor in fp32; autocast still computes in bf16/fp16.

    PEFT upcasts LoRA A/B but not ``modules_to_save`` copies (an ``lm_head`` listed there stays bf16
    when the base is bf16), and a bf16 weight loses most updates at typical learning rates: an update
    below half a bf16 ulp (2^-8 relative) rounds to nothing.
    """
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()


def load_with_adapter(model_dir: str | Path, adapter_dir: str | Path | None, device: torch.device,
                      dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                      auto_class: str = "AutoModelForCausalLM", model_kwargs: Mapping[str, Any] | None = None):
    """Base model plus a trained adapter (or the bare base model when ``adapter_dir`` is None), in eval mode."""
    model = load_base_model(model_dir, device, dtype, trust_remote_code, auto_class, model_kwargs)
    if adapter_dir is not None:
        model = load_adapter(model, model_dir, adapter_dir)
    return model.eval()


def adapter_kind(adapter_dir: str | Path) -> str:
    """``full`` (a whole model beside :data:`FULL_MODEL_MARKER`) or ``lora`` (a PEFT adapter directory)."""
    directory = Path(adapter_dir)
    full, lora = (directory / FULL_MODEL_MARKER).is_file(), (directory / "adapter_config.json").is_file()
    if full and lora:
        raise WorkflowError(f"{adapter_dir}: holds both {FULL_MODEL_MARKER} and adapter_config.json, so it is "
                            "neither a whole model nor an adapter; train it again into an empty directory")
    if full:
        return "full"
    if lora:
        return "lora"
    if (directory / "config.json").is_file():
        raise WorkflowError(f"{adapter_dir}: a model directory without {FULL_MODEL_MARKER}, not the output of "
                            "training (neither a PEFT adapter nor a fully fine-tuned model); train it again")
    raise WorkflowError(f"{adapter_dir}: no adapter_config.json; is this a PEFT adapter directory?")


def save_adapter(peft_model, directory: str | Path, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
    """A LoRA adapter in PEFT's layout, with the base model's config as trained beside it (``config.json``):
    a classifier's ``id2label`` there names the class ids of the head saved with the adapter, as
    ``save_pretrained`` records them for a whole model (evaluation reads it, ``tasks/classification``)."""
    peft_model.save_pretrained(str(directory), safe_serialization=True, state_dict=state_dict)
    peft_model.get_base_model().config.to_json_file(str(Path(directory, "config.json")), use_diff=False)


def save_full_model(model, directory: str | Path) -> None:
    """The whole trained model in ``save_pretrained``'s safetensors layout, then the marker that
    makes :func:`load_adapter` load it whole (written last: its presence marks a complete save)."""
    model.save_pretrained(str(directory))
    if not any(Path(directory).glob("*.safetensors")):
        raise WorkflowError(f"{directory}: save_pretrained wrote no safetensors weights")
    Path(directory, FULL_MODEL_MARKER).write_text(json.dumps(
        {"finetune": "full", "base_model": model.name_or_path, "model_class": type(model).__name__},
        indent=2, sort_keys=True))


def load_full_model(model, model_dir: str | Path, full_dir: str | Path):
    """``model`` (the base, as built for this task) with every weight replaced by ``full_dir``'s.

    Refused unless the two fit exactly: every stored tensor names a tensor of the model with its shape,
    and every tensor of the model is stored (or tied to one that is: save_pretrained writes a tied
    output layer once). Loaded in place, so ``model`` keeps the caller's device and dtype.
    """
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        raise WorkflowError(f"{full_dir}: a fully fine-tuned model, not a LoRA adapter; load it on the base "
                            "model alone (model_loading.load_adapter), not on a PEFT model")
    directory = Path(full_dir)
    index = directory / "model.safetensors.index.json"
    try:
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else [p.name for p in sorted(directory.glob("*.safetensors"))])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise WorkflowError(f"{index}: not a safetensors index (JSON with a 'weight_map'); train the model again") from None
    if not files or not all((directory / name).is_file() for name in files):
        raise WorkflowError(f"{full_dir}: weight files {files or '*.safetensors'} are missing; train the model again")
    stored: dict[str, torch.Tensor] = {}
    for name in files:
        stored.update(load_file(str(directory / name)))
    own = model.state_dict()
    advice = f"evaluate it with the base model it was trained from, or train a model for {model_dir}"
    unused = sorted(set(stored) - set(own))
    if unused:
        raise WorkflowError(f"{full_dir}: made for another base model: {len(unused)} of its {len(stored)} tensors "
                            f"fit no tensor of {model_dir} (e.g. {unused[0]}); {advice}")
    wrong = sorted(n for n in stored if tuple(stored[n].shape) != tuple(own[n].shape))
    if wrong:
        raise WorkflowError(f"{full_dir}: made for another base model: tensor {wrong[0]} has shape "
                            f"{tuple(stored[wrong[0]].shape)} there but {tuple(own[wrong[0]].shape)} in {model_dir}; {advice}")
    loaded = {own[n].data_ptr() for n in stored}
    untrained = sorted(n for n in set(own) - set(stored) if own[n].data_ptr() not in loaded)  # not tied to a stored one
    if untrained:
        raise WorkflowError(f"{full_dir}: has no tensor for {len(untrained)} weights of {model_dir} "
                            f"(e.g. {untrained[0]}); {advice}")
    model.load_state_dict(stored, strict=False)
    return model


def load_adapter(model, model_dir: str | Path, adapter_dir: str | Path, finetune: str | None = None):
    """``model`` with the trained weights of ``adapter_dir``: a whole fully fine-tuned model
    (:func:`load_full_model`) or a PEFT adapter. ``finetune`` (optional: ``lora`` / ``full``) is what
    the caller expects; a directory of the other kind is refused.

    For an adapter: refused unless every adapter tensor fits the model.
    PEFT loads the tensors whose names exist in the wrapped model and silently ignores the rest, so an
    adapter trained on another base model (more layers, other module names) would be evaluated as a
    partly untrained one. Every stored tensor must land, and every adapter tensor of the model must be
    stored; a shape mismatch (another hidden size) is PEFT's own refusal, reworded.
    """
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    kind = adapter_kind(adapter_dir)
    if finetune is not None and kind != finetune:
        what = {"full": "a fully fine-tuned model", "lora": "a LoRA adapter"}
        raise WorkflowError(f"{adapter_dir}: holds {what[kind]}, but training.finetune is {finetune}; "
                            f"use the output of a {finetune} run, or set training.finetune: {kind}")
    if kind == "full":
        return load_full_model(model, model_dir, adapter_dir)
    config_file = Path(adapter_dir, "adapter_config.json")
    weights = Path(adapter_dir, "adapter_model.safetensors")
    if not weights.is_file():
        raise WorkflowError(f"{adapter_dir}: no adapter_model.safetensors; train the adapter again")
    trained_on = _adapter_base_model(config_file)
    advice = (f"evaluate it with the base model it was trained on{trained_on}, or train an adapter for "
              f"{model_dir}")
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    except (RuntimeError, ValueError) as error:  # PEFT's "size mismatch" / "target modules not found"
        raise WorkflowError(f"{adapter_dir}: made for another base model: {_first_mismatch(error)}; {advice}") from None
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as handle:
        stored = set(handle.keys())
    # False: "auto" may look the base model up on the Hub; whole embedding matrices PEFT saves beside the
    # adapter carry the model's own parameter names, so they count as fitting when the model has them.
    expected = set(get_peft_model_state_dict(peft_model, save_embedding_layers=False))
    own = set(peft_model.state_dict())
    unused, untrained = sorted(stored - expected - own), sorted(expected - stored)
    if unused or untrained:
        what = (f"{len(unused)} of its {len(stored)} tensors fit no module of {model_dir} (e.g. {unused[0]})"
                if unused else f"it has no tensor for {len(untrained)} adapter weights of {model_dir} "
                               f"(e.g. {untrained[0]})")
        raise WorkflowError(f"{adapter_dir}: made for another base model: {what}; {advice}")
    return peft_model


def _adapter_base_model(config_file: Path) -> str:
    """`` ('<base_model_name_or_path>')`` from adapter_config.json, for the message; empty if not recorded."""
    try:
        name = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (ValueError, AttributeError):
        raise WorkflowError(f"{config_file}: not a valid adapter config (JSON object); train the adapter again") from None
    return f" ({name!r}, per adapter_config.json)" if name else ""


def _first_mismatch(error: Exception) -> str:
    """The first reason in PEFT's / torch's multi-line loading error, as one line."""
    text = str(error)
    found = re.search(r"size mismatch for ([^:]+): copying a param with shape (torch\.Size\(\[[^\]]*\]\)) from "
                      r"checkpoint, the shape in current model is (torch\.Size\(\[[^\]]*\]\))", text)
    if found:
        name, stored, current = found.groups()
        return f"tensor {name} has shape {stored} in the adapter but {current} in the model"
    return " ".join(text.split())[:300]


# What a task needs of the model's architecture, said in the user's words (the task's auto class -> why).
CANNOT_RUN = {
    "AutoModelForCausalLM": "this model cannot generate (it has no causal language-model head, e.g. an encoder such as BERT)",
    "AutoModelForImageTextToText": "this model has no vision part (it reads text only)",
    "AutoModelForMaskedLM": "this model has no masked language-model head",
    "AutoModelForSequenceClassification": "this model has no sequence-classification form",
}


def check_task_architecture(model_dir: str | Path, task) -> None:
    """Refuse a model whose architecture the task's Auto class cannot load (a generation dataset on a BERT, a
    vision_language dataset on a text-only model) before any work, rather than with a traceback later.

    Read from ``config.json`` alone. A model with its own code (``auto_map``) or a config transformers cannot
    read is left to the loader, which names ``model.trust_remote_code``."""
    import transformers

    try:
        config_json = json.loads((Path(model_dir) / "config.json").read_text())
        config = transformers.AutoConfig.from_pretrained(str(model_dir))
    except Exception:  # remote code, or an unknown model type: judged where the model is loaded
        return
    if task.auto_model_class in (config_json.get("auto_map") or {}):
        return
    auto = getattr(transformers, task.auto_model_class, None)
    mapping = getattr(auto, "_model_mapping", None)
    loadable = mapping is not None and type(config) in mapping
    if loadable and task.auto_model_class == "AutoModelForCausalLM":
        # BERT has a causal form (BertLMHeadModel) that a BERT checkpoint was never trained as: judge by what was saved.
        saved = config_json.get("architectures") or []
        loadable = (not saved or config_json.get("is_decoder", False)
                    or any(re.search(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration)$", name) for name in saved))
    if mapping is None or loadable:
        return
    reason = CANNOT_RUN.get(task.auto_model_class, f"this model has no {task.auto_model_class} form")
    raise WorkflowError(
        f"{model_dir}: task '{task.name}' needs a model that {task.auto_model_class} loads, but this is a "
        f"'{config.model_type}' model: {reason}; run the dataset on another model (the dataset's models: list)")


def check_remote_code(model_dir: str | Path, trust_remote_code: bool, where: str) -> None:
    """A model whose ``config.json`` needs its own Python code (``auto_map``, or a ``model_type`` this
    transformers does not know) is refused at prepare_model unless ``model.trust_remote_code`` is set,
    instead of a long transformers traceback at the first stage that loads it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if trust_remote_code:
        return
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # check_model_dir names a missing or broken config.json
    model_type, auto_map = config.get("model_type"), config.get("auto_map")
    unknown = model_type is not None and model_type not in CONFIG_MAPPING_NAMES
    if not (unknown or auto_map):
        return
    why = (f"model_type '{model_type}', which this transformers does not know" if unknown else
           f"its own code for {sorted(auto_map)} (auto_map)")
    raise WorkflowError(f"{where}: config.json needs {why}, so loading it would run Python code shipped with the "
                        "model; set model.trust_remote_code: true if you trust that code (or models.<name>."
                        "trust_remote_code), else choose a model that transformers supports")
