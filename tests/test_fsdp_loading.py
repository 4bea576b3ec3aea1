"""training.strategy: fsdp loads from rank 0 (issue 23, point 2): 2 gloo processes build the training
model (``training_setup.build``) of a 12-layer Llama of about 200 MB, and no rank other than 0 ever
holds the whole model.

Measured per rank (tests/fsdp_loading_memory.py): the resident-set peak while building, over the
resident set before, and the storage the model holds after. A rank holds about half the model plus
one layer (its shards, and the one tensor being broadcast); rank 0 also holds the host copy it reads,
which is expected. When every rank loaded the whole model before sharding, rank 1's peak was the
whole model. That the loss after rank-0 loading is the one-process loss is
``tests/test_fsdp.py::test_two_fsdp_processes_follow_the_one_process_loss_curve``.

The measured loading runs under torchrun, in fresh interpreters: a rank forked from this process would
inherit its heap, and could reuse memory the test process freed without the resident set growing. The
classification head's check compares values only, on two ranks forked from this process (tests/ranks.py).
"""
from __future__ import annotations

import json
import subprocess

import pytest

import fsdp_classification_head
import ranks
from conftest import build_tiny_model, tiny_training_settings
from test_train import REPO, subprocess_env
from test_train_ddp_resume import torchrun

MiB = 2**20


def build_measured_model(directory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=1024, max_position_embeddings=256,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp-loading")
    warm, measured, out = build_tiny_model(root / "warm"), build_measured_model(root / "model"), root / "out"
    out.mkdir()
    training = tiny_training_settings(strategy="fsdp", cpu_processes=2, micro_batch=2)
    done = subprocess.run(torchrun([str(REPO / "tests" / "fsdp_loading_memory.py"), str(warm), str(measured),
                                    json.dumps(training.to_dict()), str(out)]),
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:  # the figures, for the record (pytest -s)
        print({k: round(v / MiB, 1) if k.endswith("bytes") or k.startswith("peak") else v for k, v in report.items()
               if k != "loading_estimate"}, {k: round(v / MiB, 1) for k, v in report["loading_estimate"].items()})
    return reports


def test_no_rank_but_0_holds_the_whole_model_while_loading(per_rank):
    rank0, rank1 = per_rank
    full, layer = rank1["full_bytes"], rank1["largest_layer_bytes"]
    assert rank1["sharded"] and full > 150 * MiB and layer < full / 10
    # Rank 1: its shards plus the tensor being broadcast; a margin of one more layer for the allocator.
    assert rank1["peak_rss_increase"] < full / 2 + 2 * layer, (rank1["peak_rss_increase"] / MiB, full / MiB)
    # Rank 0 reads the whole model into host memory (the copy it broadcasts from): expected.
    assert rank0["peak_rss_increase"] > full


def test_each_rank_keeps_half_the_model_after_loading(per_rank):
    for report in per_rank:
        full = report["full_bytes"]
        assert 0.45 * full < report["model_bytes"] < 0.55 * full, (report["rank"], report["model_bytes"] / MiB)


def test_rank0s_non_persistent_buffers_reach_every_rank(per_rank):
    # RoPE's inv_freq is in no state dict: rank 1 built it on the meta device and got rank 0's values.
    assert all(r["inv_freq_matches_rank0"] and r["inv_freq_is_finite"] for r in per_rank)


def test_every_rank_continues_from_rank0s_random_state(per_rank):
    # Rank 0 drew the adapters' initial values, rank 1 built them on the meta device and drew nothing.
    assert all(r["rng_state_matches_rank0"] for r in per_rank)


def test_the_gates_loading_estimate_covers_the_measured_peaks(per_rank):
    """memory_estimate.loading_estimate, per process: its shards plus one whole unit, plus (on the host)
    rank 0's copy of the whole model. Rank 1 holds no copy: its peak is measured against the rest."""
    rank0, rank1 = per_rank
    estimate = rank0["loading_estimate"]
    assert estimate == rank1["loading_estimate"] and estimate["host_copy"] == pytest.approx(rank0["full_bytes"], rel=1e-3)
    assert rank0["peak_rss_increase"] < estimate["total"]
    without_copy = estimate["total"] - estimate["host_copy"]
    # The estimate counts tensors; the resident set also grows by the module objects and the broadcast's
    # bookkeeping, a few MiB that do not grow with the model (measured 105-119 MiB against 114.5 estimated).
    python_objects = 16 * MiB
    assert 0.8 * without_copy < rank1["peak_rss_increase"] < without_copy + python_objects


def test_a_classification_head_reaches_every_rank_from_rank0(tmp_path, tiny_model_dir):
    """A sequence-classification model under rank-0 loading: its head is not in the checkpoint (rank 0 draws
    it), PEFT keeps a trainable copy (modules_to_save); the meta-built rank must end with rank 0's values,
    not uninitialised storage. Compared with the same model built unsharded from the same seed."""
    training = tiny_training_settings(strategy="fsdp", cpu_processes=2, micro_batch=2)
    ranks.assert_succeeded(ranks.run(  # two gloo ranks forked from this process (tests/ranks.py)
        lambda: fsdp_classification_head.main(str(tiny_model_dir), json.dumps(training.to_dict()), str(tmp_path)),
        timeout=300))
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        names = report["names"]
        assert names == report["reference_names"] and len(names) == 2, names  # the original head and PEFT's copy
        assert any("modules_to_save" in n for n in names) and any("original_module" in n for n in names)
        for name, equal in report["equal"].items():
            assert equal["full"] and equal["shard"], (report["rank"], name)
    assert sum(r["equal"][n]["shard_rows"] for r in reports for n in reports[0]["names"][:1]) == 3  # 3 classes, sharded
