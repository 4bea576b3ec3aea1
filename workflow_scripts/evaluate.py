"""The ``evaluate`` stage: the dataset's task predicts on the evaluation split and scores it.

Used for trained adapters (``--adapter``) and for the untrained base model (no ``--adapter``), so
both go through exactly the same inputs, decoding and scoring. How predictions are made is the
task's (``tasks/``; for generation: greedy decoding with every logits processor neutral, batched
with left padding; ``eval.json`` records what the task reports about it). This stage picks the
device (a leased GPU or the CPU), loads model and adapter, and writes predictions and summary.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from workflow_scripts.launch import device_leases
from workflow_scripts.data.normalised_data import load_rows, read_task_meta
from workflow_scripts.tasks import also_metrics, task_named
from workflow_scripts.model import model_loading, quantization
from workflow_scripts.core.atomic_output import write_json, write_jsonl
from workflow_scripts.core.errors import ConfigError, WorkflowError, run_main
from workflow_scripts.core.run_manifest import build_manifest
from workflow_scripts.core.section_settings import EvaluationSettings
from workflow_scripts.core.stage_arguments import StageArgumentParser, json_setting
from workflow_scripts.tasks.templates import check_row_templates


def add_prediction_arguments(parser: argparse.ArgumentParser, verb: str, record: str) -> None:
    """What evaluate and predict both take: the model, adapter, data, task settings and the run's names."""
    parser.add_argument("--model", required=True, help="base model directory (prepare_model output)")
    parser.add_argument("--adapter", help=f"PEFT adapter directory; omit to {verb} the untrained base model")
    parser.add_argument("--data", required=True, help="normalised DatasetDict directory")
    parser.add_argument("--task", required=True, help="the dataset's task type (tasks.TASK_MODULES)")
    parser.add_argument("--variant", required=True, help="the variant as JSON (its keys depend on the task)")
    parser.add_argument("--metric", required=True, help="one of the task's metrics")
    parser.add_argument("--evaluation", required=True, help="the config's evaluation settings as JSON")
    parser.add_argument("--model-name", help=f"the model's name in the config, recorded in {record} "
                        "(default: the model directory's name)")
    parser.add_argument("--dataset-name", required=True, help=f"dataset name, recorded in {record}")
    parser.add_argument("--variant-name", required=True, help=f"variant name, recorded in {record}")
    parser.add_argument("--seed", required=True, help="the experiment's seed, or 'base' for the untrained model")
    parser.add_argument("--trust-remote-code", action="store_true")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = StageArgumentParser(description=__doc__.splitlines()[0])
    add_prediction_arguments(parser, "evaluate", "eval.json")
    parser.add_argument("--base-quantization", type=lambda text: json_setting(text, "--base-quantization"),
                        help="without --adapter: the bitsandbytes settings (JSON, as base_quantization.json beside a "
                        "QLoRA adapter) that the variant's adapters are scored with, so that its untrained model is "
                        "scored the same way (evaluation.qlora_base: quantised)")
    parser.add_argument("--also-metrics", default="[]", help="JSON list of further metrics scored on the same "
                        "predictions (the dataset's also_metrics)")
    parser.add_argument("--predictions-out", required=True)
    parser.add_argument("--summary-out", required=True)
    return parser.parse_args(argv)


def parse_seed(text: str) -> int | str:
    if text == "base":
        return text
    try:
        return int(text)
    except ValueError:
        raise WorkflowError(f"argument --seed: expected an integer or 'base', got {text!r}") from None


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


def file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    device_name: str
    base: dict = field(default_factory=dict)  # which base a QLoRA adapter was scored on (quantization.evaluation_base)


@contextlib.contextmanager
def loaded_model(args: argparse.Namespace, task, task_meta: Mapping[str, Any], gpus: int,
                 label: str, qlora_base: str = "quantised", compute_dtype: str = "auto") -> Iterator[LoadedModel]:
    """The model (with ``args.adapter`` when given) on the evaluation device, as evaluate and predict load it,
    in the dtype ``evaluation.dtype`` (``compute_dtype``) asks for (auto: bf16 on a GPU that supports it, else
    fp32; fp32 computes in fp32 on a GPU too, where bf16 rounding changes greedy predictions, Yuan et al. 2025); a QLoRA adapter on its base quantised as in
    training, or unquantised (``evaluation.qlora_base``)."""
    torch.manual_seed(0)  # greedy decoding draws nothing, but keep any stray randomness fixed
    if args.adapter and hasattr(task, "trained_task_meta"):  # a classifier: the label set it was trained on
        task_meta = task.trained_task_meta(task_meta, args.adapter, args.dataset_name)
    with evaluation_device(gpus, label) as device:
        bf16 = compute_dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
        dtype = torch.bfloat16 if bf16 else torch.float32
        tokenizer = model_loading.load_tokenizer(args.model, args.trust_remote_code)
        quantised, base = quantization.evaluation_base(args.adapter, qlora_base, device, dtype,
                                                       getattr(args, "base_quantization", None))
        model = model_loading.load_with_adapter(args.model, args.adapter, device, dtype, args.trust_remote_code,
                                                task.auto_model_class, {**task.model_kwargs(task_meta), **quantised})
        task.prepare_model(model, tokenizer.pad_token_id, task_meta)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        yield LoadedModel(model, tokenizer, device, dtype, device_name, base)


def run_identity(args: argparse.Namespace, seed: int | str) -> dict[str, Any]:
    """Whose predictions these are: the head of evaluate's summary and of predict's manifest."""
    return {"model": args.model_name or Path(args.model).name, "dataset": args.dataset_name,
            "variant": args.variant_name, "seed": seed}


def model_facts(args: argparse.Namespace, loaded) -> dict[str, Any]:
    """What predicted: the model and adapter directories and the device and dtype they ran in."""
    return {"model_dir": str(args.model),
            "model_manifest_sha256": file_sha256(Path(args.model, "model_manifest.json")),
            "adapter_dir": str(args.adapter) if args.adapter else None,
            "device": str(loaded.device), "device_name": loaded.device_name,
            "dtype": str(loaded.dtype).removeprefix("torch."), **loaded.base}


def refuse_unlabelled(task_meta: Mapping[str, Any], data_dir: str, split: str) -> None:
    if split in task_meta.get("unlabelled", []):
        raise ConfigError("evaluation_split", f"split '{split}' of {data_dir} is unlabelled (no gold to score): it is "
                          "predicted by the predict rule, never evaluated; evaluate this dataset on validation")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    task = task_named(args.task, "argument --task")
    from workflow_scripts.core.entry_settings import VariantSettings

    variant = task.check_variant(VariantSettings.from_json(args.variant, args.task, args.variant_name))
    if args.metric not in task.metrics:
        raise WorkflowError(f"argument --metric: {args.metric!r} is not a metric of task {args.task!r} "
                            f"(choose from {list(task.metrics)})")
    extra_metrics = also_metrics.parse_argument(args.also_metrics, args.task, task.metrics, args.metric)
    evaluation = EvaluationSettings.from_json(args.evaluation)
    quantization.leave_out_bitsandbytes("workflow_scripts.evaluate", quantization.evaluation_quantises(
        args.adapter, evaluation.qlora_base, args.base_quantization))
    seed = parse_seed(args.seed)

    rows = load_rows(args.data, evaluation.split, evaluation.max_examples)
    check_row_templates(variant, rows, args.data, evaluation.split)
    model_loading.check_model_directory(args.model)
    model_loading.check_task_architecture(args.model, task)  # a causal LM for masked_lm: one line, no traceback
    task_meta = read_task_meta(args.data, args.task)
    refuse_unlabelled(task_meta, args.data, evaluation.split)
    label = f"evaluate {args.model_name or Path(args.model).name}/{args.dataset_name}/{args.variant_name}/{seed}"
    with loaded_model(args, task, task_meta, evaluation.gpus, label, evaluation.qlora_base,
                      evaluation.compute_dtype) as loaded:
        result = task.evaluate(loaded.model, loaded.tokenizer, variant, rows, args.metric, evaluation, loaded.device)
    records, score, unparseable = result.records, result.score, result.unparseable
    also = also_metrics.rescore(records, extra_metrics)

    summary = {
        **run_identity(args, seed),
        "metric": args.metric,
        "score": score,
        "n_examples": len(records),
        "n_unparseable": unparseable,
        "split": evaluation.split,
        "task": args.task,
        **({"also_scores": also} if also else {}),
        **result.details,
        **model_facts(args, loaded),
        # how it was batched and computed: greedy outputs can move with these (the fairness guard compares them)
        "batch_size": evaluation.batch_size, "processes": 1, "dtype_setting": evaluation.compute_dtype,
        "manifest": build_manifest("evaluate", {"evaluation": evaluation.to_dict(), "variant": task.variant_record(variant), "metric": args.metric}),
    }
    write_jsonl(args.predictions_out, records)
    write_json(args.summary_out, summary)
    print(f"{args.dataset_name}/{args.variant_name}/seed {seed}: {args.metric} = {score:.4f} "
          f"over {len(records)} examples, {unparseable} unparseable"
          + "".join(f"; {name} = {value['score']:.4f}" for name, value in also.items()))
    return 0


if __name__ == "__main__":
    run_main(main)
