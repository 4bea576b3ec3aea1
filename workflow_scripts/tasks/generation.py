"""The ``generation`` task: a causal LM learns text -> text (question answering, AMR parsing, MTUP).

Everything that is particular to generation lives here: the variant's templates (prompt, target,
extractor), tokenising prompt and target with labels on the target only, the target-token loss,
greedy decoding and scoring the extracted answer. See ``tasks/base.py`` for the interface.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data.rows import RecordMapper
from workflow_scripts.tasks import metrics, templates
from workflow_scripts.tasks.base import EvaluationResult, Predictions

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings, VariantSettings
    import torch
    from torch import nn

    from workflow_scripts.core.settings import LoraSettings, TrainingSettings

VARIANT_KEYS = ("prompt", "target", "extractor", "chat_template")


def check_variant(variant: "VariantSettings") -> "VariantSettings":
    """The typed variant (the schema has refused unknown keys and filled the extractor); it must have
    both templates, as a variant typed for another task has not."""
    if variant.prompt is None or variant.target is None:
        raise WorkflowError(f"argument --variant: a {variant.task} variant, but this task needs 'prompt' and 'target'")
    return variant


def variant_record(variant: "VariantSettings") -> dict[str, Any]:
    """The variant as pretokenise's cache key, its ``templates`` record and the manifests hold it: the
    mapping the rules pass (``to_dict()``) with the extractor and chat_template defaults first, as the
    records have always been written (changing it would re-tokenise every finished run)."""
    return {"extractor": {"type": "whole"}, "chat_template": False, **variant.to_dict()}



def tokenise_batch(batch: Mapping[str, list], *, tokenizer, variant: "VariantSettings", max_length: int) -> dict[str, list]:
    """Batched map function: render, tokenise prompt and target separately, mask, truncate."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    prompts = [templates.render_prompt(variant, row, tokenizer) for row in rows]
    targets = [templates.render_target(variant, row) for row in rows]
    prompt_ids = templates.encode_prompts(tokenizer, variant, prompts)
    target_ids = templates.encode_targets(tokenizer, targets)
    input_ids, labels, lengths, truncated, target_lost = [], [], [], [], []
    for prompt, target in zip(prompt_ids, target_ids):
        full_length = len(prompt) + len(target)
        if full_length > max_length:  # cut from the end; rare, so the common path copies nothing twice
            input_ids.append((prompt + target)[:max_length])
            labels.append(([-100] * len(prompt) + target)[:max_length])
        else:
            input_ids.append(prompt + target)
            labels.append([-100] * len(prompt) + target)
        lengths.append(min(full_length, max_length))
        truncated.append(full_length > max_length)
        target_lost.append(len(prompt) >= max_length)
    return {"id": list(batch["id"]), "input_ids": input_ids, "labels": labels, "length": lengths,
            "truncated": truncated, "dropped": target_lost}


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokenizer's eos (what training targets end with) plus any eos the model's generation config adds."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    ids.discard(None)
    if not ids:
        raise templates.NoEosToken(f"{tokenizer.name_or_path}: the tokenizer has no EOS token and the model's "
                                   "generation_config names none, so generation could not stop; "
                                   + templates.no_eos_fix())
    return sorted(ids)


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """Generated ids up to (not including) the first stop token."""
    ids = list(ids)
    for position, token in enumerate(ids):
        if token in stop_ids:
            return ids[:position]
    return ids


def greedy_generation_config(max_new_tokens: int, stop_ids: Sequence[int], pad_token_id: int | None):
    """Greedy decoding, every logits processor neutral, each field set explicitly.

    ``generate`` fills any field the caller leaves at its library default from the model's own
    ``generation_config``; instruct models ship ``repetition_penalty``, ``no_repeat_ngram_size`` and
    the like, which keep acting with sampling off. Every field that can change which token is chosen
    is therefore given here, and the model's own config is swapped for this one while generating
    (:func:`decoding_with`), so decoding is exactly what ``eval.json`` records.
    """
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=0, min_length=0, do_sample=False, num_beams=1,
        num_beam_groups=1, penalty_alpha=None, temperature=1.0, top_k=None, top_p=None, min_p=None,
        typical_p=None, epsilon_cutoff=None, eta_cutoff=None, repetition_penalty=1.0,
        encoder_repetition_penalty=1.0, length_penalty=1.0, no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0, bad_words_ids=None, force_words_ids=None, sequence_bias=None,
        suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None,
        forced_eos_token_id=None, exponential_decay_length_penalty=None, renormalize_logits=False,
        guidance_scale=None, watermarking_config=None, prompt_lookup_num_tokens=None,
        eos_token_id=list(stop_ids), pad_token_id=pad_token_id, use_cache=True,
    )


@contextlib.contextmanager
def decoding_with(model, config) -> Iterator[None]:
    """The model's own generation config replaced by ``config`` while generating, so nothing is inherited."""
    holders = [model]
    if hasattr(model, "get_base_model"):  # PEFT: generate runs on the base model and reads its config
        holders.append(model.get_base_model())
    saved = [(holder, getattr(holder, "generation_config", None)) for holder in holders]
    try:
        for holder in holders:
            holder.generation_config = config
        yield
    finally:
        for holder, original in saved:
            holder.generation_config = original


def recorded_decoding(config) -> dict:
    """The generation settings that decided the tokens, as eval.json records them."""
    return {key: value for key, value in sorted(config.to_dict().items()) if not key.startswith("_")
            and key not in ("transformers_version", "generation_kwargs")}


def generate(model, tokenizer, variant: "VariantSettings", prompts: Sequence[str], batch_size: int,
             max_new_tokens: int, device: torch.device) -> list[str]:
    """Greedy continuations of ``prompts``, batched by similar length, returned in input order."""
    import torch

    with torch.no_grad():
        return _generate(model, tokenizer, variant, prompts, batch_size, max_new_tokens, device)


def _generate(model, tokenizer, variant, prompts, batch_size, max_new_tokens, device) -> list[str]:
    stop_ids = stop_token_ids(tokenizer, model)
    tokenizer.padding_side = "left"  # decoder-only: padding on the right would sit between prompt and answer
    config = greedy_generation_config(max_new_tokens, stop_ids, tokenizer.pad_token_id)
    encoded = templates.encode_prompts(tokenizer, variant, prompts)  # the ids training saw
    # Longest first (stable), so each batch holds similar lengths and little compute goes to padding.
    order = sorted(range(len(prompts)), key=lambda index: -len(encoded[index]))
    outputs: list[str | None] = [None] * len(prompts)
    with decoding_with(model, config):
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            padded = tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, padding=True, return_tensors="pt")
            input_ids = padded["input_ids"].to(device)
            generated = model.generate(
                input_ids=input_ids, attention_mask=padded["attention_mask"].to(device), generation_config=config
            )
            for row, index in enumerate(batch):
                new_ids = cut_at_stop(generated[row, input_ids.shape[1]:].tolist(), stop_ids)
                outputs[index] = tokenizer.decode(new_ids, skip_special_tokens=True)
            print(f"generated {min(start + batch_size, len(order))}/{len(order)}", flush=True)
    return outputs


def is_parsed(metric: str, extracted: str | None) -> bool:
    """The extractor found an answer and, for graph outputs, smatch can read the graph."""
    if extracted is None:
        return False
    return metric not in metrics.GRAPH_METRICS or metrics.graph_readable(metric, extracted)


def prediction_records(rows: Sequence[dict], prompts: Sequence[str], outputs: Sequence[str],
                       variant: "VariantSettings", metric: str) -> list[dict]:
    """Per-example predictions, unscored: ``{id, prompt, raw_output, extracted, auxiliary, parsed}``."""
    records = []
    for row, prompt, output in zip(rows, prompts, outputs, strict=True):
        extracted, auxiliary = templates.extract_answer(variant, output)
        records.append({"id": row["id"], "prompt": prompt, "raw_output": output, "extracted": extracted,
                        "auxiliary": auxiliary, "parsed": is_parsed(metric, extracted)})
    return records


def score_records(rows: Sequence[dict], predicted: Sequence[dict], metric: str) -> tuple[list[dict], float, int]:
    """Prediction records with their gold and score, the corpus score and the number of unparseable outputs."""
    records, scores = [], []
    for row, prediction in zip(rows, predicted, strict=True):
        example = metrics.score_example(metric, prediction["extracted"], row["answers"])
        scores.append(example)
        record = {key: prediction[key] for key in ("id", "prompt", "raw_output", "extracted", "auxiliary")}
        record.update({"gold": list(row["answers"]), "score": example.score, "parsed": prediction["parsed"]})
        if example.counts is not None:
            record["counts"] = list(example.counts)
        records.append(record)
    unparseable = sum(not record["parsed"] for record in records)
    return records, metrics.corpus_score(metric, scores), unparseable


def score_outputs(rows: Sequence[dict], prompts: Sequence[str], outputs: Sequence[str],
                  variant: "VariantSettings", metric: str) -> tuple[list[dict], float, int]:
    """Per-example prediction records, the corpus score and the number of unparseable outputs."""
    return score_records(rows, prediction_records(rows, prompts, outputs, variant, metric), metric)




class GenerationTask:
    name = "generation"
    packs = True  # training.packing: data/packing.PackingCollator
    fuses_output_head = True  # training.fused_cross_entropy: TargetTokenLoss, text only
    auto_model_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    variant_keys = frozenset(VARIANT_KEYS)
    metrics = metrics.METRICS
    dropped_reason = "no target token left after truncation to max_length"
    normalise_source = None  # raw records go through record_mapper

    def check_variant(self, variant: "VariantSettings") -> "VariantSettings":
        return check_variant(variant)

    def variant_record(self, variant: "VariantSettings") -> dict[str, Any]:
        return variant_record(variant)

    def tokenised_features(self):
        from datasets import Features, List, Value

        return Features({
            "id": Value("string"), "input_ids": List(Value("int32")), "labels": List(Value("int32")),
            "length": Value("int32"), "truncated": Value("bool"), "dropped": Value("bool"),
        })

    def tokenise_batch(self, batch, *, tokenizer, variant, max_length, task_meta=None):
        return tokenise_batch(batch, tokenizer=tokenizer, variant=variant, max_length=max_length)

    def check_config_variant(self, name: str, variant: "VariantSettings", datasets: Mapping[str, "DatasetSettings"]) -> None:
        check_config_variant(name, variant, datasets)

    def record_mapper(self, settings: "DatasetSettings", key: str) -> RecordMapper:
        return RecordMapper(settings, key)

    def tokenise_meta(self, variant, task_meta, *, tokenizer=None) -> dict[str, Any]:
        return {}

    def model_kwargs(self, task_meta) -> dict[str, Any]:
        return {}

    def prepare_model(self, model, pad_token_id, task_meta) -> None:
        """A causal LM needs nothing beyond loading."""

    def collator(self, meta: Mapping[str, Any], vocab_size: int, packing_for: tuple[int, str] | None = None, *,
                 seed: int | None = None):
        """Padded micro-batches, or packed ones (``packing_for`` = (max_length, attention implementation)).
        ``seed`` is ignored: these batches draw nothing at random."""
        if packing_for:
            from workflow_scripts.data.packing import PackingCollator

            return PackingCollator(meta["pad_token_id"], vocab_size, *packing_for)
        from workflow_scripts.data.batching import PaddingCollator

        return PaddingCollator(meta["pad_token_id"], vocab_size)

    def loss_module(self, peft_model: nn.Module) -> nn.Module:
        from workflow_scripts.tasks.target_token_loss import TargetTokenLoss

        return TargetTokenLoss(peft_model)

    def lora_settings(self, model: nn.Module, lora: LoraSettings) -> LoraSettings:
        """The LoRA settings as the config gives them: a text model needs no rewriting."""
        return refuse_vision_keys(lora)

    def render_prompt(self, tokenizer, variant: "VariantSettings", row: Mapping[str, Any]) -> str:
        """The prompt as training and evaluation render it (the gate's chat_prompt check renders a probe row)."""
        return templates.render_prompt(variant, row, tokenizer)

    def check_tokenizer(self, tokenizer) -> str | None:
        return None  # no task-specific gate check: preflight_checks covers generation's batches

    def check_batch(self, batch: Mapping[str, Any], tokenizer, model: nn.Module) -> str | None:
        return None

    def check_model(self, peft_model: nn.Module, task_meta: Mapping[str, Any], training: TrainingSettings) -> str | None:
        return None

    def check_gradients(self, peft_model: nn.Module, training: TrainingSettings) -> str | None:
        return None

    def predict(self, model, tokenizer, variant, rows, metric, evaluation, device) -> Predictions:
        """Greedy outputs and extracted answers, no gold read (evaluate scores them; predict submits them)."""
        prompts = [templates.render_prompt(variant, row, tokenizer) for row in rows]
        outputs = generate(model, tokenizer, variant, prompts, evaluation.batch_size,
                           evaluation.max_new_tokens, device)
        decoding = recorded_decoding(greedy_generation_config(
            evaluation.max_new_tokens, stop_token_ids(tokenizer, model), tokenizer.pad_token_id))
        return Predictions(prediction_records(rows, prompts, outputs, variant, metric), "extracted",
                           {"decoding": "greedy", "generation_config": decoding})

    def evaluate(self, model, tokenizer, variant, rows, metric, evaluation, device) -> EvaluationResult:
        check_rows(rows)  # before generating: a row without answers fails at once
        return self.score_predictions(rows, self.predict(model, tokenizer, variant, rows, metric, evaluation,
                                                         device), metric)

    def score_predictions(self, rows, predicted: Predictions, metric: str) -> EvaluationResult:
        """``predict``'s records (in ``rows``' order) scored against each row's answers: evaluate's scoring."""
        check_rows(rows)
        records, score, unparseable = score_records(rows, predicted.records, metric)
        return EvaluationResult(records, score, unparseable, predicted.details)


def check_config_variant(name: str, variant: "VariantSettings", datasets: Mapping[str, "DatasetSettings"]) -> None:
    """At parse time: the extractor, the templates' syntax, their fields in every dataset, no gold in the prompt."""
    from workflow_scripts.core.errors import ConfigError
    from workflow_scripts.core.experiment_config import dataset_fields, gold_fields

    key = f"variants.{name}"
    for ds_name, dataset in datasets.items():
        if "image" in dataset.fields and dataset.task != "vision_language":
            raise ConfigError(f"datasets.{ds_name}.fields.image", "an image field needs task: vision_language (a "
                              f"{dataset.task} model would never see the image); set datasets.{ds_name}.task: "
                              "vision_language or carry it under extra_fields")
        if dataset.task == "vision_language" and "image" not in dataset.fields:
            raise ConfigError(f"datasets.{ds_name}.fields", "a vision_language dataset needs fields.image: the "
                              "source field with its image (a path, {bytes, path} or bytes)")
    if variant.task == "generation":  # vision_language keys, which a text model would ignore silently
        for setting in ("max_pixels", "min_pixels"):
            if setting in variant.given:
                raise ConfigError(f"{key}.{setting}", "a pixel budget is a vision_language setting; a generation "
                                  f"variant has no images. Set variants.{name}.task: vision_language, or remove it")
    if variant.extractor.type == "section" and not variant.extractor.marker:
        raise ConfigError(f"{key}.extractor.marker", "a section extractor needs the final task's marker")
    fields = {}
    for part in ("prompt", "target"):
        try:
            fields[part] = templates.template_fields(getattr(variant, part))
        except ValueError as error:
            raise ConfigError(f"{key}.{part}", str(error)) from None
        if not fields[part] and not getattr(variant, part).strip():
            raise ConfigError(f"{key}.{part}", f"the {part} is empty for every row; write a template such as "
                              + ("'Question: {question}'" if part == "prompt" else "' {answer}'"))
    for ds_name, dataset in datasets.items():
        available = dataset_fields(dataset)
        for part in ("prompt", "target"):
            missing = set(fields[part]) - available
            if missing:
                raise ConfigError(f"{key}.{part}", f"refers to {sorted(missing)}, which dataset '{ds_name}' does not "
                                  f"provide (it has {sorted(available)}); add them under datasets.{ds_name}.extra_fields "
                                  "or derived")
        gold = gold_fields(dataset)
        for field in fields["prompt"]:
            if field in gold:
                raise ConfigError(
                    f"{key}.prompt", f"shows field '{field}', which in dataset '{ds_name}' {gold[field]}, so "
                    "evaluation would put the gold answer into every test prompt; remove {" + field + "} from "
                    "the prompt (a field computed from the answer belongs in the target, as MTUP's aux does)")


def refuse_vision_keys(lora: LoraSettings) -> LoraSettings:
    """``train_projector`` / ``train_vision_tower`` mean something only for a VLM: never ignored in silence."""
    for key in ("train_projector", "train_vision_tower"):
        if getattr(lora, key):
            raise WorkflowError(f"training.lora.{key}: this model has no vision part (it applies to "
                                "vision_language datasets only); remove it")
    return lora


def check_rows(rows: Sequence[dict]) -> None:
    for index, row in enumerate(rows):
        missing = [column for column in ("question", "answers") if column not in row]
        if missing:
            raise WorkflowError(f"row {index} (id {row.get('id')!r}): missing columns {missing}")
        if not row["answers"]:
            raise WorkflowError(f"row {index} (id {row['id']!r}): field 'answers' is empty")


TASK = GenerationTask()


def __getattr__(name: str):
    """``generation.TargetTokenLoss`` without torch at import: normalise and compare load this module for its
    task object's data (row mapping, comparison note) and must not pay for torch (tests/test_stage_imports.py)."""
    if name == "TargetTokenLoss":
        from workflow_scripts.tasks.target_token_loss import TargetTokenLoss

        return TargetTokenLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
