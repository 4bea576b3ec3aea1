"""The ``evaluate`` stage: generate answers for the test split, extract them, score them.

Used for trained adapters (``--adapter``) and for the untrained base model (no ``--adapter``), so
both go through exactly the same prompts, decoding and scoring. Decoding is greedy with every logits
processor neutral (a model's own generation defaults, such as Qwen-Instruct's ``do_sample=True`` or a
``repetition_penalty``, are not inherited; ``eval.json`` records the full config), batched with LEFT padding so every prompt ends where generation starts, and
stops at the end-of-sequence token the training targets end with.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from workflow_scripts.launch import device_leases
from workflow_scripts.tasks import metrics, templates
from workflow_scripts.model import model_loading
from workflow_scripts.core.atomic_output import write_json, write_jsonl
from workflow_scripts.core.errors import ConfigError, WorkflowError, run_main
from workflow_scripts.core.run_manifest import build_manifest
from workflow_scripts.core.stage_arguments import json_setting

EVALUATION_KEYS = ("split", "max_new_tokens", "batch_size", "max_examples", "gpus")
REQUIRED_COLUMNS = ("id", "question", "answers")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="base model directory (prepare_model output)")
    parser.add_argument("--adapter", help="PEFT adapter directory; omit to evaluate the untrained base model")
    parser.add_argument("--data", required=True, help="normalised DatasetDict directory")
    parser.add_argument("--variant", required=True, help="the variant's templates as JSON")
    parser.add_argument("--metric", required=True, choices=metrics.METRICS)
    parser.add_argument("--evaluation", required=True, help="the config's evaluation settings as JSON")
    parser.add_argument("--dataset-name", required=True, help="dataset name, recorded in eval.json")
    parser.add_argument("--variant-name", required=True, help="variant name, recorded in eval.json")
    parser.add_argument("--seed", required=True, help="the experiment's seed, or 'base' for the untrained model")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--predictions-out", required=True)
    parser.add_argument("--summary-out", required=True)
    return parser.parse_args(argv)


def parse_json_argument(text: str, name: str) -> dict:
    value = json_setting(text, name)
    if not isinstance(value, dict):
        raise WorkflowError(f"argument {name}: expected a JSON object, got {type(value).__name__}")
    return value


def check_evaluation(evaluation: Mapping[str, Any]) -> None:
    for key in EVALUATION_KEYS:
        if key not in evaluation:
            raise ConfigError(f"evaluation.{key}", "missing from the --evaluation argument")
    for key in ("max_new_tokens", "batch_size"):
        if not isinstance(evaluation[key], int) or isinstance(evaluation[key], bool) or evaluation[key] < 1:
            raise ConfigError(f"evaluation.{key}", f"must be a positive integer, got {evaluation[key]!r}")


def parse_seed(text: str) -> int | str:
    if text == "base":
        return text
    try:
        return int(text)
    except ValueError:
        raise WorkflowError(f"argument --seed: expected an integer or 'base', got {text!r}") from None


def load_test_rows(data_dir: str, split: str, max_examples: int | None) -> list[dict]:
    """Rows of the evaluation split, in stored order (the first ``max_examples`` when set)."""
    from workflow_scripts.data.normalised_data import open_normalised

    data = open_normalised(data_dir, required_split=None)
    if split not in data:
        raise ConfigError("evaluation.split", f"'{split}' is not a split of {data_dir} (it has {sorted(data)})")
    table = data[split]
    missing = [column for column in REQUIRED_COLUMNS if column not in table.column_names]
    if missing:
        raise WorkflowError(f"{data_dir} split '{split}': missing columns {missing}")
    if max_examples is not None:
        table = table.select(range(min(max_examples, len(table))))
    rows = table.to_list()
    if not rows:
        raise WorkflowError(f"{data_dir} split '{split}': no rows to evaluate")
    seen = set()
    for index, row in enumerate(rows):
        if row["id"] in seen:
            raise WorkflowError(f"{data_dir} split '{split}' row {index}: duplicate id {row['id']!r}")
        seen.add(row["id"])
        if not row["answers"]:
            raise WorkflowError(f"{data_dir} split '{split}' row {index} (id {row['id']!r}): field 'answers' is empty")
    return rows


@contextlib.contextmanager
def evaluation_device(gpus: int, label: str) -> Iterator[torch.device]:
    """cuda:0 of a GPU leased for this job when the rule declares GPUs, else the CPU.

    The lease (device_leases) gives concurrent local jobs disjoint GPUs through CUDA_VISIBLE_DEVICES,
    set before CUDA is first touched, and keeps a scheduler's allocation as it is. A job that declared
    GPUs on a machine without any fails there with a message, rather than quietly running on CPU.
    """
    if gpus == 0:
        yield torch.device("cpu")
        return
    with device_leases.leased(gpus, label) as lease:
        if lease.gpu_ids is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(lease.gpu_ids)
        if not torch.cuda.is_available():
            raise WorkflowError(f"evaluation.gpus is {gpus} but CUDA sees no device here; set evaluation.gpus: 0 to evaluate on CPU")
        yield torch.device("cuda:0")


def stop_token_ids(tokenizer, model) -> list[int]:
    """The tokenizer's eos (what training targets end with) plus any eos the model's generation config adds."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    ids.discard(None)
    if not ids:
        raise WorkflowError("the tokenizer has no eos token, so generation could not stop")
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


@torch.no_grad()
def generate(model, tokenizer, variant: Mapping[str, Any], prompts: Sequence[str], batch_size: int,
             max_new_tokens: int, device: torch.device) -> list[str]:
    """Greedy continuations of ``prompts``, batched by similar length, returned in input order."""
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
    return metric != "smatch" or metrics.graph_triples(extracted) is not None


def score_outputs(rows: Sequence[dict], prompts: Sequence[str], outputs: Sequence[str],
                  variant: Mapping[str, Any], metric: str) -> tuple[list[dict], float, int]:
    """Per-example prediction records, the corpus score and the number of unparseable outputs."""
    records, scores = [], []
    for row, prompt, output in zip(rows, prompts, outputs, strict=True):
        extracted, auxiliary = templates.extract_answer(variant, output)
        example = metrics.score_example(metric, extracted, row["answers"])
        scores.append(example)
        record = {
            "id": row["id"], "prompt": prompt, "raw_output": output, "extracted": extracted,
            "auxiliary": auxiliary, "gold": list(row["answers"]), "score": example.score,
            "parsed": is_parsed(metric, extracted),
        }
        if example.counts is not None:
            record["counts"] = list(example.counts)
        records.append(record)
    unparseable = sum(not record["parsed"] for record in records)
    return records, metrics.corpus_score(metric, scores), unparseable


def file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    variant = parse_json_argument(args.variant, "--variant")
    evaluation = parse_json_argument(args.evaluation, "--evaluation")
    check_evaluation(evaluation)
    seed = parse_seed(args.seed)

    rows = load_test_rows(args.data, evaluation["split"], evaluation["max_examples"])
    torch.manual_seed(0)  # greedy decoding draws nothing, but keep any stray randomness fixed
    label = f"evaluate {args.dataset_name}/{args.variant_name}/{seed}"
    with evaluation_device(evaluation["gpus"], label) as device:
        dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        tokenizer = model_loading.load_tokenizer(args.model, args.trust_remote_code)
        model = model_loading.load_with_adapter(args.model, args.adapter, device, dtype, args.trust_remote_code)
        prompts = [templates.render_prompt(variant, row, tokenizer) for row in rows]
        outputs = generate(model, tokenizer, variant, prompts, evaluation["batch_size"],
                           evaluation["max_new_tokens"], device)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    records, score, unparseable = score_outputs(rows, prompts, outputs, variant, args.metric)

    summary = {
        "dataset": args.dataset_name,
        "variant": args.variant_name,
        "seed": seed,
        "metric": args.metric,
        "score": score,
        "n_examples": len(records),
        "n_unparseable": unparseable,
        "split": evaluation["split"],
        "decoding": "greedy",
        "generation_config": recorded_decoding(greedy_generation_config(
            evaluation["max_new_tokens"], stop_token_ids(tokenizer, model), tokenizer.pad_token_id)),
        "model_dir": str(args.model),
        "model_manifest_sha256": file_sha256(Path(args.model, "model_manifest.json")),
        "adapter_dir": str(args.adapter) if args.adapter else None,
        "device": str(device),
        "device_name": device_name,
        "dtype": str(dtype).removeprefix("torch."),
        "manifest": build_manifest("evaluate", {"evaluation": evaluation, "variant": variant, "metric": args.metric}),
    }
    write_jsonl(args.predictions_out, records)
    write_json(args.summary_out, summary)
    print(f"{args.dataset_name}/{args.variant_name}/seed {seed}: {args.metric} = {score:.4f} "
          f"over {len(records)} examples, {unparseable} unparseable")
    return 0


if __name__ == "__main__":
    run_main(main)
