"""The 7B GPU benchmark's parts that can fail on its first CUDA run, checked on CPU (benchmarks/bench_gpu_7b.py)."""
from __future__ import annotations

import time

import pytest
import torch

from benchmarks import bench_gpu_7b


def test_the_trainer_side_halves_its_micro_batch_when_cuda_runs_out_of_memory(monkeypatch):
    """At micro-batch 8 x 4,096 tokens Trainer's fp32 logits can exceed an 80 GB H100: the side is then
    measured at the largest micro-batch that fits, the effective batch kept, and says so."""
    tried = []

    def run_trainer(base, rows, settings, rank, use_liger_kernel, device):
        tried.append((settings["micro_batch"], settings["effective_batch"]))
        if settings["micro_batch"] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 19.84 GiB")
        return {"tokens_per_second": 1000.0}

    monkeypatch.setattr(bench_gpu_7b, "run_trainer", run_trainer)
    settings = bench_gpu_7b.SCALES["7b"]
    result = bench_gpu_7b.trainer_that_fits(None, [], settings, 16, False, torch.device("cpu"),
                                            time.monotonic() + 60, log=lambda message: None)
    assert tried == [(8, 16), (4, 16), (2, 16)]
    assert result == {"tokens_per_second": 1000.0, "micro_batch": 2, "out_of_memory_at_micro_batch": [8, 4]}
    with pytest.raises(torch.cuda.OutOfMemoryError):  # the phase's time spent: the failure is recorded as such
        bench_gpu_7b.trainer_that_fits(None, [], settings, 16, False, torch.device("cpu"), time.monotonic() - 1,
                                       log=lambda message: None)


def test_liger_patches_the_benchmark_model_and_are_undone_after_the_side():
    """Liger's instance patching (ours' liger_kernels, Trainer's use_liger_kernel) on the 7B family under the
    installed transformers, and liger_undone restoring the model for the next side. The patching is Python;
    only running the patched kernels needs CUDA."""
    pytest.importorskip("liger_kernel", reason="liger-kernel (the gpu extra) is not installed here")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    base = bench_gpu_7b.build_model(bench_gpu_7b.model_config(tiny=True), torch.device("cpu"), torch.float32)
    mlp = base.model.layers[0].mlp
    forward = type(mlp).forward
    with bench_gpu_7b.liger_undone(base):
        _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
        assert "Liger" in mlp.forward.__qualname__
    assert "forward" not in vars(mlp) and type(mlp).forward is forward
    assert "Liger" not in base.model.norm.forward.__qualname__
