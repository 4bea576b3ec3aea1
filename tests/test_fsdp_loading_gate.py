"""The gate estimates FSDP's loading peak beside the loop's (issue 23, point 2) and names it when it is
the one that does not fit. The estimate against the measured loading: tests/test_fsdp_loading.py."""
import pytest
import torch

from conftest import TINY_VOCAB, tiny_training_settings
from workflow_scripts.model import memory_estimate
from workflow_scripts.training import preflight_checks, training_setup
from workflow_scripts.training.distributed import DistributedContext

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
# The tiny Llama (fp32): embeddings + lm_head + final norm, and one decoder layer with its rank-4 LoRA on
# q, v (32x32) and down (64 -> 32).
ROOT = 4 * (2 * TINY_VOCAB * 32 + 32)
LAYER = 4 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32 + 4 * (32 + 32) * 2 + 4 * (64 + 32))


@pytest.fixture(scope="module")
def tiny_peft_model(tiny_model_dir):
    torch.set_num_threads(1)
    return training_setup.build(tiny_model_dir, tiny_training_settings(),
                                DistributedContext(0, 0, 1, 1, CPU, None)).peft_model


def test_loading_peak_is_a_share_plus_one_whole_unit_and_rank0s_host_copy(tiny_peft_model):
    whole = sum(p.numel() * p.element_size() for p in tiny_peft_model.parameters())
    fsdp = tiny_training_settings(cpu_processes=2, strategy="fsdp")
    on_cpu = memory_estimate.loading_estimate(tiny_peft_model, fsdp, CPU)
    # Every dim 0 of the tiny model is even: the half is exact. The root (vocab rows) is the largest unit.
    assert on_cpu == {"shards": whole // 2, "whole_unit": max(ROOT, LAYER), "host_copy": whole,
                      "runtime_overhead": 0, "total": whole // 2 + max(ROOT, LAYER) + whole}
    on_gpu = memory_estimate.loading_estimate(tiny_peft_model, fsdp, CUDA)  # rank 0's copy is in host memory
    assert on_gpu["host_copy"] == 0 and on_gpu["runtime_overhead"] == memory_estimate.CUDA_RUNTIME_OVERHEAD
    assert on_gpu["total"] == whole // 2 + max(ROOT, LAYER) + memory_estimate.CUDA_RUNTIME_OVERHEAD
    # Unsharded, or sharded over one process (its values stay where they are): no loading peak of its own.
    assert memory_estimate.loading_estimate(tiny_peft_model, tiny_training_settings(cpu_processes=2), CPU) is None
    assert memory_estimate.loading_estimate(tiny_peft_model, tiny_training_settings(strategy="fsdp"), CPU) is None


def test_gate_names_the_loading_peak_when_it_does_not_fit(tiny_peft_model):
    fsdp = tiny_training_settings(cpu_processes=2, strategy="fsdp")
    loop = memory_estimate.estimate(tiny_peft_model, fsdp, CPU)
    loop["activations"] = 0  # a short batch: rank 0's copy of the whole model dominates, as for a large model
    loop["total"] = sum(v for k, v in loop.items() if k != "total")
    loading = memory_estimate.loading_estimate(tiny_peft_model, fsdp, CPU)
    assert loading["total"] > loop["total"]
    between = int((loop["total"] + loading["total"]) / 2 / 0.9)  # the loop fits, the loading does not
    with pytest.raises(preflight_checks.PreflightError,
                       match=r"memory: the estimated loading peak .*host_copy .*Fix: give the node more memory "
                             r"\(training\.mem_mb"):
        preflight_checks.check_memory(loop, between, 0.9, fsdp, CPU, loading)
    ok = preflight_checks.check_memory(loop, 2 * loading["total"], 0.9, fsdp, CPU, loading)
    assert "loading peak" in ok
    # The loop's peak, when it is the larger, is refused as before.
    gpu_loop = {**loop, "activations": 10 * loading["total"]}
    gpu_loop["total"] = sum(v for k, v in gpu_loop.items() if k != "total")
    with pytest.raises(preflight_checks.PreflightError, match=r"memory: the estimated peak "):
        preflight_checks.check_memory(gpu_loop, loading["total"], 0.9, fsdp, CPU, loading)


def test_a_gpu_loading_peak_over_the_device_asks_for_more_shards(tiny_peft_model):
    fsdp = tiny_training_settings(cpu_processes=2, strategy="fsdp")
    loading = {"shards": 600, "whole_unit": 300, "host_copy": 0, "runtime_overhead": 0, "total": 900}
    loop = {"weights": 100, "activations": 10, "total": 110}
    with pytest.raises(preflight_checks.PreflightError, match=r"loading peak .*Fix: shard over more processes"):
        preflight_checks.check_memory(loop, 500, 0.9, fsdp, CUDA, loading)


# --- from config.json alone (model/config_memory_estimate), before any job ---
def test_config_estimate_gives_fsdps_loading_peak_per_gpu():
    from test_config_memory_estimate import CONFIGS

    from workflow_scripts.model import config_memory_estimate as cme

    run = {"lora": {"rank": 16, "target_modules": ["q_proj", "v_proj"]}, "micro_batch": 1, "max_length": 512}
    model = cme.meta_model(CONFIGS / "Meta-Llama-3-70B.json")
    total_base, root, layer = cme.base_weight_bytes(model, 2, None)  # bf16 on GPUs
    lora = cme.lora_parameters(model, 16, ["q_proj", "v_proj"])[0] * 4
    loading = cme.loading_from_config(model, strategy="fsdp", world_size=8, **run)
    # Its share of the weights (70.6B bf16 and the fp32 adapters), and the root (embeddings + head) whole.
    assert loading == {"shards": (total_base + lora) // 8, "whole_unit": max(root, layer), "host_copy": 0,
                       "runtime_overhead": 2**30, "total": (total_base + lora) // 8 + max(root, layer) + 2**30}
    assert cme.loading_from_config(model, strategy="ddp", world_size=8, **run) is None
    advice = cme.advise(model, capacity=80 * 2**30, strategy="fsdp", world_size=8, **run)
    assert advice["fits"] and advice["loading"] == loading  # on a GPU the loop's peak is the larger
    assert loading["total"] < advice["estimate"]["total"]


def test_declared_memory_refuses_a_cpu_fsdp_run_whose_loading_does_not_fit(tmp_path):
    """On the CPU rank 0's host copy of the whole model shares the node with every process's share: a
    model whose weights dominate (8 layers of hidden 1024, one short row) fits the loop, not the loading."""
    from test_config_memory_estimate import demo_config

    from workflow_scripts.checks.memory import check_declared_memory
    from workflow_scripts.core.errors import ConfigError

    def config(mem_mb):
        raw = demo_config(cpu_processes=2, effective_batch=32, strategy="fsdp", micro_batch=1, max_length=8,
                          mem_mb=mem_mb)
        raw["models"]["tiny-llama"]["tiny"].update(hidden_size=1024, intermediate_size=4096, num_layers=8)
        return raw

    checked = check_declared_memory(config(64000), root=tmp_path)[0]
    loop_node = 2 * checked["estimate"]["total"]
    loading = checked["loading"]
    loading_node = loading["host_copy"] + 2 * (loading["total"] - loading["host_copy"])
    assert loading["host_copy"] > 500 * 2**20 and loading_node > loop_node / 0.9
    between = int((loop_node / 0.9 + loading_node / 0.9) / 2 / 2**20) + 1  # headroom 90%
    with pytest.raises(ConfigError, match=r"training\.mem_mb.*loading under training\.strategy: fsdp .*rank 0's host "
                                          r"copy of the whole model .*Fix: raise training\.mem_mb"):
        check_declared_memory(config(between), root=tmp_path)
