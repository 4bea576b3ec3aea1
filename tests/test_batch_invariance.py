"""Evaluation that does not move with how it was batched: greedy predictions on CPU in fp32 are the same for
evaluation batch sizes 1 and 8 (left padding, a mixed-length test set), eval.json records how the evaluation
ran, and the fairness guard refuses variants evaluated differently."""
from __future__ import annotations

import json
import os

import pytest
import torch

from test_evaluate import BASELINE, EVALUATION, run, tiny_model  # noqa: F401 (tiny_model is a fixture)
from workflow_scripts import evaluate
from workflow_scripts.analysis import fairness
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.model import model_loading

# From one word to about forty: batches of 8 then mix lengths, so most rows are left-padded.
WORDS = "what is the total share of the bars shown in this very long chart about the years of all groups".split()
MIXED = [(f"m{index:02d}", " ".join((WORDS * 3)[:length]), ["12"]) for index, length in
         enumerate([1, 40, 3, 17, 2, 29, 8, 5, 36, 11, 4, 23, 6, 14, 33, 9])]


@pytest.fixture(scope="module")
def mixed_lengths(tmp_path_factory):
    from datasets import Dataset, DatasetDict

    def split(rows):
        return Dataset.from_dict({"id": [r[0] for r in rows], "question": [r[1] for r in rows],
                                  "answers": [r[2] for r in rows]})

    directory = tmp_path_factory.mktemp("mixed") / "data"
    DatasetDict({"train": split(MIXED[:2]), "test": split(MIXED)}).save_to_disk(str(directory))
    (directory / "task_meta.json").write_text(json.dumps({"task": "generation"}))
    return directory


def test_greedy_predictions_do_not_depend_on_the_evaluation_batch_size(tmp_path, tiny_model, mixed_lengths):
    tokenizer = model_loading.load_tokenizer(tiny_model)
    lengths = {len(tokenizer(BASELINE["prompt"].format(question=q))["input_ids"]) for _, q, _ in MIXED}
    assert max(lengths) - min(lengths) > 30  # the set really mixes lengths: batches of 8 carry left padding
    evaluation = {**EVALUATION, "max_new_tokens": 8, "dtype": "fp32"}
    one, one_summary = run(tmp_path, tiny_model, mixed_lengths, evaluation={**evaluation, "batch_size": 1}, name="b1")
    eight, eight_summary = run(tmp_path, tiny_model, mixed_lengths, evaluation={**evaluation, "batch_size": 8}, name="b8")
    assert [row["raw_output"] for row in eight] == [row["raw_output"] for row in one]
    assert len({row["raw_output"] for row in one}) > 1  # the check means something only if outputs vary
    # eval.json says how each evaluation ran
    assert (one_summary["batch_size"], eight_summary["batch_size"]) == (1, 8)
    for summary in (one_summary, eight_summary):
        assert summary["dtype"] == "float32" and summary["dtype_setting"] == "fp32"
        assert summary["device"] == "cpu" and summary["processes"] == 1


def test_a_bad_evaluation_dtype_is_named(tmp_path, tiny_model, mixed_lengths):
    with pytest.raises(ConfigError, match=r"config key 'evaluation.dtype': 'fp16' is not one of \['auto', 'fp32'\]"):
        run(tmp_path, tiny_model, mixed_lengths, evaluation={**EVALUATION, "dtype": "fp16"})


MANIFEST = {"settings": {"max_length": 512}, "model_dir": "m", "model_manifest_sha256": "x"}


def summary(**fields):
    return {"manifest": {"settings": {"evaluation": {"split": "test"}}}, "batch_size": 16, "dtype": "bfloat16",
            "device": "cuda:0", "device_name": "NVIDIA H100", "processes": 1, **fields}


@pytest.mark.parametrize("field, value", [("batch_size", 1), ("dtype", "float32"), ("device_name", "NVIDIA A100"),
                                          ("processes", 2), ("device", "cpu")])
def test_fairness_guard_refuses_variants_evaluated_differently(field, value):
    settings = {"baseline": fairness.comparable_settings(MANIFEST, summary()),
                "mtup": fairness.comparable_settings(MANIFEST, summary(**{field: value}))}
    with pytest.raises(WorkflowError, match=rf"evaluation\.{field}: baseline=.*, mtup={value!r}"):
        fairness.check_fair("chart", 1, settings, {"baseline": "a", "mtup": "b"}, [])
    fairness.check_fair("chart", 1, settings, {"baseline": "a", "mtup": "b"}, [f"evaluation.{field}"])


def differing_share(first, second) -> float:
    return sum(a["raw_output"] != b["raw_output"] for a, b in zip(first, second)) / len(first)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_batch_invariance_in_bf16_and_fp32_is_measured(tmp_path, tiny_model, mixed_lengths, monkeypatch):
    """make gpu-check: batch sizes 1 and 8 on the GPU, in bf16 (auto) and under evaluation.dtype: fp32; the
    share of predictions that differ is reported (measurements.jsonl), not asserted: GPU kernels may differ."""
    monkeypatch.setenv("LORA_WORKFLOW_LEASE_DIR", str(tmp_path / "leases"))
    measured, runs = {}, {}
    for setting in ("auto", "fp32"):
        for batch_size in (1, 8):
            evaluation = {**EVALUATION, "gpus": 1, "max_new_tokens": 8, "batch_size": batch_size, "dtype": setting}
            runs[setting, batch_size] = run(tmp_path, tiny_model, mixed_lengths, evaluation=evaluation,
                                            name=f"{setting}-{batch_size}")
        summary = runs[setting, 8][1]
        assert summary["device"] == "cuda:0" and summary["dtype_setting"] == setting
        measured[f"{summary['dtype']}_share_differing_1_vs_8"] = differing_share(runs[setting, 1][0], runs[setting, 8][0])
    assert runs["fp32", 8][1]["dtype"] == "float32"
    assert runs["auto", 8][1]["dtype"] == ("bfloat16" if torch.cuda.is_bf16_supported() else "float32")
    path = os.environ.get("GPU_CHECK_REPORT")
    if path:
        with open(path, "a") as report:
            report.write(json.dumps({"test": "evaluation_batch_invariance", "device": torch.cuda.get_device_name(0),
                                     "examples": len(MIXED), **measured}) + "\n")
    print(measured)


def test_the_comparison_names_how_the_evaluations_ran():
    note = fairness.evaluation_note([summary(), summary(), summary(dtype="float32", batch_size=1)])
    assert note == ("Evaluation (greedy): bfloat16 on NVIDIA H100, batch size 16, 1 process(es); "
                    "float32 on NVIDIA H100, batch size 1, 1 process(es).\n")
    assert "not recorded" in fairness.evaluation_note([{"dtype": "float32"}])
