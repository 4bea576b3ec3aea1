"""Memory from config.json alone: meta-device counts equal hand-worked formulas, and a 70B LoRA run on
8 x 80 GiB is refused under DDP and accepted under FSDP and QLoRA, with every figure worked by hand."""
import json
import math
import time
from pathlib import Path

import pytest

from workflow_scripts.checks.config import load_config
from workflow_scripts.checks.memory import check_declared_memory
from workflow_scripts.model import config_memory_estimate as cme
from workflow_scripts.core.errors import ConfigError

CONFIGS = Path(__file__).parent / "model_configs"
GiB = 2**30
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def decoder_params(h, inter, layers, heads, kv_heads, vocab, tied=False, qkv_bias=False):
    """Llama/Qwen2 decoder: GQA attention, gated MLP, two RMSNorms per layer, final norm, lm_head."""
    kv = kv_heads * (h // heads)
    attn = h * h + 2 * h * kv + h * h + ((h + 2 * kv) if qkv_bias else 0)
    layer = attn + 3 * h * inter + 2 * h
    return vocab * h + layers * layer + h + (0 if tied else vocab * h)


@pytest.mark.parametrize("name, shape, expected", [
    ("Meta-Llama-3-8B", dict(h=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256), 8_030_261_248),
    ("Meta-Llama-3-70B", dict(h=8192, inter=28672, layers=80, heads=64, kv_heads=8, vocab=128256), 70_553_706_496),
    ("Qwen2.5-7B-Instruct", dict(h=3584, inter=18944, layers=28, heads=28, kv_heads=4, vocab=152064, qkv_bias=True),
     7_615_616_512),
    ("Qwen2.5-0.5B", dict(h=896, inter=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied=True,
                          qkv_bias=True), 494_032_768),
])
def test_meta_count_equals_the_hand_formula(name, shape, expected):
    assert decoder_params(**shape) == expected
    assert cme.count_parameters(CONFIGS / f"{name}.json") == expected


def test_counting_70b_is_fast_and_allocates_nothing():
    start = time.perf_counter()
    model = cme.meta_model(CONFIGS / "Meta-Llama-3-70B.json")
    assert time.perf_counter() - start < 5
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_config_dict_and_directory_are_accepted(tmp_path):
    config = json.loads((CONFIGS / "Qwen2.5-0.5B.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cme.count_parameters(config) == cme.count_parameters(tmp_path) == 494_032_768


def test_lora_parameters_are_rank_times_in_plus_out():
    model = cme.meta_model(CONFIGS / "Meta-Llama-3-8B.json")
    h, i, kv, r = 4096, 14336, 1024, 8
    assert cme.lora_parameters(model, r, ["q_proj", "v_proj"]) == (32 * r * (2 * h + h + kv), 64)
    assert cme.lora_parameters(model, r, ["lm_head"]) == (r * (h + 128256), 1)
    with pytest.raises(ConfigError, match="match no nn.Linear"):
        cme.lora_parameters(model, r, ["c_attn"])


def test_qlora_prices_linears_in_nf4_and_keeps_embeddings_norms_and_lm_head_in_bf16():
    model = cme.meta_model(CONFIGS / "Meta-Llama-3-8B.json")
    h, i, kv, L, V = 4096, 14336, 1024, 32, 128256
    linear = L * (2 * h * h + 2 * h * kv + 3 * h * i)  # every block count is a multiple of 64 * 256
    rest = 2 * V * h + 2 * L * h + h  # embed_tokens, lm_head (transformers' default skip), norms
    double, _, _ = cme.base_weight_bytes(model, 2, {"bits": 4, "double_quant": True})
    single, _, _ = cme.base_weight_bytes(model, 2, {"bits": 4, "double_quant": False})
    int8, _, _ = cme.base_weight_bytes(model, 2, {"bits": 8})
    assert double == linear // 2 + linear // 64 + 4 * (linear // 64 // 256) + 2 * rest
    assert (double - 2 * rest) * 8 / linear == pytest.approx(4.127, abs=1e-3)  # 0.127 bits/param constants
    assert single == linear // 2 + 4 * (linear // 64) + 2 * rest  # 0.5 bits/param constants
    out_rows = L * (h + 2 * kv + h + 2 * i + h)  # SCB: one fp32 scale per output row
    assert int8 == linear + 4 * out_rows + 2 * rest
    upcast, _, _ = cme.base_weight_bytes(model, 2, {"bits": 4, "fp32_unquantized": True})
    assert upcast - double == 2 * rest


# A 70B LoRA run: rank 16 on all seven projections, bf16, micro-batch 1, 2048 tokens, checkpointing.
H, I, L, KV, V, R = 8192, 28672, 80, 1024, 128256, 16
LINEAR = 2 * H * H + 2 * H * KV + 3 * H * I  # 855,638,016 per layer
TOTAL = L * (LINEAR + 2 * H) + 2 * V * H + H  # 70,553,706,496
LORA = L * R * (4 * H + 2 * (H + KV) + 3 * (H + I))  # 207,093,760
ACTIVATIONS = 2048 * (H * L + 11 * H + 4 * I + R * 7) * 2 + 2048 * V * 4 * 2  # 5,625,020,416
RUN = dict(world_size=8, lora={"rank": R, "target_modules": ALL_PROJ}, precision="bf16", micro_batch=1,
           max_length=2048, gradient_checkpointing=True)
CAPACITY, BUDGET = 80 * GiB, 77_309_411_328  # 90% of 80 GiB


@pytest.fixture(scope="module")
def llama70b():
    return cme.meta_model(CONFIGS / "Meta-Llama-3-70B.json")


def test_70b_lora_worked_by_hand(llama70b):
    assert (TOTAL, LORA, ACTIVATIONS) == (70_553_706_496, 207_093_760, 5_625_020_416)
    ddp = cme.estimate_from_config(llama70b, strategy="ddp", **RUN)
    # bf16 weights; fp32 adapters; gradients twice (DDP buckets); two fp32 AdamW moments; 1 GiB runtime.
    assert ddp == {"weights": 2 * TOTAL, "gathered_weights": 0, "adapters": 4 * LORA, "gradients": 8 * LORA,
                   "optimizer": 8 * LORA, "activations": ACTIVATIONS, "runtime_overhead": GiB,
                   "total": 151_948_050_432}  # 141.5 GiB
    fsdp = cme.estimate_from_config(llama70b, strategy="fsdp", **RUN)
    root, layer = 2 * (2 * V * H + H), 2 * (LINEAR + 2 * H)  # embeddings+lm_head+norm; one decoder layer
    assert fsdp["weights"] == 2 * TOTAL // 8 and fsdp["optimizer"] == 8 * LORA // 8
    assert fsdp["gathered_weights"] == root + 2 * layer == 7_625_326_592
    assert fsdp["total"] == 32_376_702_976  # 30.2 GiB
    qlora = cme.estimate_from_config(llama70b, strategy="qlora", **RUN)
    nf4 = L * LINEAR // 2 + L * LINEAR // 64 + 4 * (L * LINEAR // 64 // 256)  # 35,311,779,840
    kept = 4 * (2 * V * H + 2 * L * H + H)  # 8,410,660,864: PEFT's k-bit preparation upcasts them to fp32
    assert qlora["weights"] == nf4 + kept == 43_722_440_704
    assert qlora["total"] == nf4 + kept + 20 * LORA + ACTIVATIONS + GiB == 54_563_078_144  # 50.8 GiB
    assert fsdp["total"] < BUDGET < ddp["total"] and qlora["total"] < BUDGET


def test_advice_refuses_ddp_and_names_what_fits(llama70b):
    result = cme.advise(llama70b, capacity=CAPACITY, strategy="ddp", **RUN)
    assert not result["fits"]
    assert [label for label, _ in result["alternatives"]] == ["--strategy fsdp", "--strategy qlora"]
    assert result["line"] == ("does not fit: ddp on 8 GPU(s) needs 141.5 GiB per GPU; 72.0 GiB allowed "
                              "(90% of 80.0 GiB). Would fit: --strategy fsdp (30.2 GiB); --strategy qlora (50.8 GiB)")
    assert cme.advise(llama70b, capacity=CAPACITY, strategy="fsdp", **RUN)["line"].startswith("fits: fsdp")
    assert cme.advise(llama70b, capacity=CAPACITY, strategy="qlora", **RUN)["fits"]
    alone = cme.advise(llama70b, capacity=24 * GiB, strategy="ddp", **{**RUN, "world_size": 1})
    assert alone["line"].endswith("no single change tried fits (fsdp, qlora, checkpointing, micro-batch): "
                                  "use fsdp over more GPUs, a shorter --max-length or a smaller model")


def test_qlora_advice_quotes_fsdp_over_the_gpus_asked(llama70b):
    """Regression: from qlora on 8 GPUs the fsdp alternative kept the nf4 weights (which FSDP cannot shard)
    and quoted 23.1 GiB, the 16-GPU figure, instead of fsdp's 32.9 GiB on 8."""
    run = {**RUN, "lora": {"rank": 128, "target_modules": ALL_PROJ}, "micro_batch": 4, "max_length": 512}
    result = cme.advise(llama70b, capacity=CAPACITY, strategy="qlora", **run)
    fsdp_on_8 = cme.estimate_from_config(llama70b, strategy="fsdp", **run)["total"]
    assert not result["fits"] and dict(result["alternatives"])["--strategy fsdp"] == fsdp_on_8
    assert result["line"].endswith("Would fit: --strategy fsdp (32.9 GiB)")
    with pytest.raises(ConfigError, match="fsdp shards unquantised weights only"):
        cme.estimate_from_config(llama70b, strategy="fsdp", quantization={"bits": 4}, **run)


def test_advice_offers_a_smaller_micro_batch_when_activations_are_the_problem():
    model = cme.meta_model(CONFIGS / "Qwen2.5-0.5B.json")
    run = dict(lora={"rank": 16, "target_modules": ["q_proj", "v_proj"]}, max_length=1024)
    assert cme.advise(model, capacity=32 * GiB, micro_batch=4, **run)["fits"]
    # 16 rows without checkpointing: 42.0 GiB, of which 40.0 GiB activations (fp32 logits alone: 18.5 GiB).
    result = cme.advise(model, capacity=32 * GiB, micro_batch=16, gradient_checkpointing=False, **run)
    assert not result["fits"]
    assert result["line"] == ("does not fit: ddp on 1 GPU(s) needs 42.0 GiB per GPU; 28.8 GiB allowed (90% of "
                              "32.0 GiB). Would fit: gradient checkpointing on (22.0 GiB); --micro-batch 8 (22.0 GiB)")


def test_bad_settings_are_config_errors(llama70b):
    with pytest.raises(ConfigError, match="strategy"):
        cme.estimate_from_config(llama70b, strategy="zero3")
    with pytest.raises(ConfigError, match="full fine-tune needs lora"):
        cme.estimate_from_config(llama70b, strategy="qlora", lora=None)
    with pytest.raises(ConfigError, match="bits"):
        cme.estimate_from_config(llama70b, quantization={"bits": 3}, lora=RUN["lora"])


def test_full_fine_tune_is_sixteen_bytes_a_parameter(llama70b):
    parts = cme.estimate_from_config(llama70b, strategy="fsdp", world_size=64, lora=None, max_length=2048)
    assert parts["weights"] + parts["gradients"] + parts["optimizer"] == 16 * TOTAL // 64


def test_cli_prints_the_table_and_exits_1_when_it_does_not_fit(capsys):
    args = ["--config-json", str(CONFIGS / "Meta-Llama-3-70B.json"), "--gpus", "8", "--gpu-memory", "80GiB",
            "--lora-rank", "16", "--target-modules", ",".join(ALL_PROJ), "--max-length", "2048"]
    assert cme.main(args + ["--strategy", "ddp"]) == 1
    out = capsys.readouterr().out
    assert "weights" in out and "141.5 GiB" in out and "Would fit: --strategy fsdp" in out
    assert cme.main(args + ["--strategy", "qlora"]) == 0
    assert cme.parse_size("80GB") == 80 * 10**9 and cme.parse_size("81920MiB") == 80 * GiB
    with pytest.raises(ConfigError, match="gpu-memory"):
        cme.parse_size("lots")


# --- before any job: every (model, variant) whose config is here, against the memory the config declares ---
DEMO = Path(__file__).parent.parent / "config" / "config.yaml"


def demo_config(**training):
    overrides = {"training": training} if training else None
    if training.get("strategy") == "fsdp":  # FSDP refuses the vision_language task: its variants stay on DDP
        overrides["variants"] = {name: {"training": {"strategy": "ddp"}} for name in ("vision", "text_only")}
    return load_config(DEMO, overrides)


def test_demo_config_is_estimated_for_its_tiny_causal_lm_and_fits(tmp_path):
    checked = check_declared_memory(demo_config(), root=tmp_path)
    config = demo_config()
    # tiny-llama is built from model.tiny on the meta device; tiny-bert and tiny-llava (not causal LMs,
    # and not prepared here) are left to the gate.
    assert {c["model"] for c in checked} == {"tiny-llama"}
    # Only the variants it runs whose task loads a causal LM: not the classifier's (a sequence-classification
    # head) nor the other models' tasks.
    assert {c["variant"] for c in checked} == {v for v, s in config["variants"].items() if s["task"] == "generation"}
    first = checked[0]
    assert first["declared"] == config["training"]["mem_mb"] * 2**20 and first["processes"] == 1
    # CPU: fp32 weights, no CUDA runtime; the demo's model: vocab 1024, hidden 64, 2 layers.
    h, i, v = 64, 128, 1024
    weights = 2 * v * h + 2 * (4 * h * h + 3 * h * i + 2 * h) + h
    assert first["estimate"]["weights"] == 4 * weights and first["estimate"]["runtime_overhead"] == 0


def test_declared_cpu_memory_too_small_is_refused_naming_model_variant_and_knob(tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'training.mem_mb': model 'tiny-llama', variant '\w+': "
                                          r"1 training process\(es\) .* Fix: raise training.mem_mb"):
        check_declared_memory(demo_config(mem_mb=1), root=tmp_path)


def test_gpu_ranks_host_memory_over_mem_mb_is_refused_naming_the_key_and_the_figure(tmp_path):
    # 8 GPU ranks on a node, each the process with its CUDA context (3 GiB) and the largest tensor on its way
    # to the GPU, plus 2 DataLoader workers each (0.5 GiB): about 32 GiB, against 16000 MB (issue 23, point 3).
    settings = dict(gpus=8, effective_batch=128, dataloader_workers=2)
    with pytest.raises(ConfigError) as caught:
        check_declared_memory(demo_config(mem_mb=16000, **settings), root=tmp_path)
    message = str(caught.value)
    assert caught.value.key == "training.mem_mb"
    assert "8 GPU rank(s) on a node need about 32.0 GiB of host memory" in message
    assert "plus 8.0 GiB for 2 DataLoader worker(s) per rank" in message
    assert message.endswith("Fix: raise training.mem_mb to at least 36412")  # 32.0 GiB / 90%, in MiB
    checked = check_declared_memory(demo_config(mem_mb=36412, **settings), root=tmp_path)
    assert checked and all(c["host"]["ranks"] == 8 and c["estimate"] is None for c in checked)
    # FSDP: rank 0 also holds one full copy of the weights to hand out the shards.
    fsdp = check_declared_memory(demo_config(mem_mb=40000, strategy="fsdp", **settings), root=tmp_path)[0]
    h, i, v = 64, 128, 1024
    assert fsdp["host"]["rank0_full_copy"] == 4 * (2 * v * h + 2 * (4 * h * h + 3 * h * i + 2 * h) + h)


def test_fsdp_processes_share_the_node_but_each_holds_a_shard(tmp_path):
    ddp = check_declared_memory(demo_config(cpu_processes=2, effective_batch=32), root=tmp_path)[0]
    fsdp = check_declared_memory(demo_config(cpu_processes=2, effective_batch=32, strategy="fsdp"), root=tmp_path)[0]
    assert ddp["processes"] == fsdp["processes"] == 2
    assert fsdp["estimate"]["weights"] * 2 == ddp["estimate"]["weights"]
    assert fsdp["estimate"]["optimizer"] * 2 == ddp["estimate"]["optimizer"]


def test_a_hub_model_is_estimated_only_once_prepared_here(tmp_path):
    from data_helpers import single_model_config

    raw = single_model_config()
    raw["model"] = {"name": "qwen", "source": "hub", "hub_id": "Qwen/Qwen2.5-0.5B", "revision": "0" * 40}
    # checkpointing on and micro-batches of 8, so that the weights, not the activations, are what does not fit
    raw["training"].update(mem_mb=2000, lora={"target_modules": ["q_proj", "v_proj"]}, gradient_checkpointing=True,
                           micro_batch=8)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(json.dumps(raw))  # JSON is YAML
    config = load_config(config_path)
    assert check_declared_memory(config, root=tmp_path) == []  # not downloaded: nothing to read
    prepared = tmp_path / "resources" / "models" / "qwen"
    prepared.mkdir(parents=True)
    (prepared / "config.json").write_text((CONFIGS / "Qwen2.5-0.5B.json").read_text())
    # 494M parameters in fp32 on CPU: 1.8 GiB of weights alone, over 90% of 2000 MB.
    with pytest.raises(ConfigError, match=r"model 'qwen', variant .* Fix: raise training.mem_mb to at least \d+, or use "
                                          r"a device with more memory or a smaller model, or set training.quantization"):
        check_declared_memory(config, root=tmp_path)
    (prepared / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"models.qwen.*config.json cannot be read"):
        check_declared_memory(config, root=tmp_path)


@pytest.mark.parametrize("training", [{"mem_mb": 1},
                                      # GPU ranks' host memory (issue 23, point 3): 8 x 3 GiB over 16000 MB
                                      {"mem_mb": 16000, "gpus": 8, "effective_batch": 128}])
def test_snakemake_dry_run_refuses_before_any_job(tmp_path, training):
    import yaml

    from data_helpers import ROOT
    from test_dry_run_families import dry_run

    config = yaml.safe_load(DEMO.read_text())
    for dataset in config["datasets"].values():
        dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
    config["training"].update(training)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    code, output = dry_run(tmp_path, "-n", "--configfile", str(tmp_path / "config.yaml"), "--replace-workflow-config",
                           "--cores", "1")  # snakemake in a fork of this process
    assert code != 0
    assert "config key 'training.mem_mb': model 'tiny-llama', variant" in output
    assert "Job stats" not in output and "Traceback" not in output
    assert not (tmp_path / "results").exists() and not (tmp_path / "resources").exists()


def test_a_prepared_masked_lm_is_not_estimated_as_a_causal_lm(tmp_path):
    """Regression: after the demo prepared tiny-bert, its BERT config.json (a causal-LM model type in
    transformers' mapping, as BertLMHeadModel) was built with the generation variants' LoRA targets and
    every later snakemake call failed at parse time."""
    from transformers import BertConfig

    prepared = tmp_path / "resources" / "models" / "tiny-bert"
    prepared.mkdir(parents=True)
    (prepared / "config.json").write_text(json.dumps(BertConfig(hidden_size=32, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=64).to_dict()))
    checked = check_declared_memory(demo_config(), root=tmp_path)
    assert {c["model"] for c in checked} == {"tiny-llama"}


def test_host_estimate_is_not_below_a_real_runs_peak_resident_memory(tmp_path, tiny_model_dir, tiny_tokenised_dir):
    """A tiny CPU train run's peak RSS (getrusage of a fresh parent whose only child is the run) is within the
    per-process host estimate; a config declaring that measured peak as mem_mb is refused. Before, only the
    tensors were counted (well under 1 MiB here), and such a config passed."""
    import subprocess
    import sys

    from conftest import tiny_training_settings
    from test_train import REPO, subprocess_env, train_argv

    settings = tiny_training_settings(max_steps=4, checkpoint_every=2)
    measure = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")  # KiB on Linux
    result = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "workflow_scripts.train",
                             *train_argv(tmp_path, tiny_model_dir, tiny_tokenised_dir, settings)],
                            cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    peak = int(result.stdout.split()[-1]) * 1024
    host = cme.host_memory(cme.meta_model(tiny_model_dir), settings)
    assert host["ranks"] == 1 and peak <= host["per_rank"] == host["total"], (peak, host)
    # The demo's tiny-llama is larger than this tiny model: a node declaring only the measured peak is refused.
    with pytest.raises(ConfigError, match=r"config key 'training.mem_mb': .*Fix: raise training.mem_mb to at least"):
        check_declared_memory(demo_config(mem_mb=peak // 2**20), root=tmp_path)


REAL_VLM = Path(__file__).parent.parent / "config" / "real_vlm_hub.yaml"
QWEN_VL = "qwen2_5-vl-7b-instruct"  # real_vlm_hub.yaml's model name
INFOGRAPHIC_BUDGET, SMALL_BUDGET = 2048 * 28 * 28, 512 * 28 * 28  # pixels: at most 2048 / 512 image tokens


def qwen_vl_cpu_config(tmp_path, max_pixels, mem_mb):
    """real_vlm_hub.yaml's Qwen2.5-VL-7B as prepared here (its config.json only: no weights), trained on CPU."""
    prepared = tmp_path / "resources" / "models" / QWEN_VL
    prepared.mkdir(parents=True, exist_ok=True)
    (prepared / "config.json").write_text((CONFIGS / "Qwen2.5-VL-7B-Instruct.json").read_text())
    if max_pixels is not None:
        return load_config(REAL_VLM, {"training": {"gpus": 0, "mem_mb": mem_mb, "dataloader_workers": 0},
                                      "variants": {"vision": {"max_pixels": max_pixels}}})
    import yaml

    raw = yaml.safe_load(REAL_VLM.read_text())  # the variant without a budget of its own
    del raw["variants"]["vision"]["max_pixels"]
    raw["training"].update(gpus=0, mem_mb=mem_mb, dataloader_workers=0)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_config(tmp_path / "config.yaml")


def test_a_vision_language_model_is_refused_at_a_pixel_budget_its_declared_memory_cannot_hold(tmp_path):
    """Issue 38: check_declared_memory skipped vision-language models, so Qwen2.5-VL-7B at InfographicVQA's budget
    passed `snakemake -n` whatever mem_mb said. Now its images count at the variant's budget: at the mem_mb a
    512-token budget needs, that budget passes and the 2048-token one is refused by model, variant, key and figure."""
    from workflow_scripts.core import experiment_config as xc

    small = {c["variant"]: c for c in check_declared_memory(qwen_vl_cpu_config(tmp_path, SMALL_BUDGET, 10**7),
                                                             root=tmp_path)}
    assert {(variant, c["model"]) for variant, c in small.items()} == {("vision", QWEN_VL), ("text_only", QWEN_VL)}
    assert small["vision"]["max_pixels"] == SMALL_BUDGET and small["text_only"]["max_pixels"] is None
    large = check_declared_memory(qwen_vl_cpu_config(tmp_path, INFOGRAPHIC_BUDGET, 10**7), root=tmp_path)[0]
    # The frozen tower's one-layer working set per image (memory_estimate.vision_activation_bytes): patches
    # (max_pixels / 14^2) x (11 x hidden 1280 + 2 x intermediate 3420) elements in bf16, the tower of
    # tests/model_configs/Qwen2.5-VL-7B-Instruct.json; nothing else follows the budget.
    per_patch = (11 * 1280 + 2 * 3420) * 2
    assert large["host"]["total"] - small["vision"]["host"]["total"] == (8192 - 2048) * per_patch
    headroom = xc.training_settings(qwen_vl_cpu_config(tmp_path, SMALL_BUDGET, 10**7), "vision").memory_headroom
    fits_small = math.ceil(small["vision"]["host"]["total"] / headroom / 2**20)
    needs_large = math.ceil(large["host"]["total"] / headroom / 2**20)
    assert needs_large > fits_small
    assert check_declared_memory(qwen_vl_cpu_config(tmp_path, SMALL_BUDGET, fits_small), root=tmp_path)
    with pytest.raises(ConfigError) as caught:
        check_declared_memory(qwen_vl_cpu_config(tmp_path, INFOGRAPHIC_BUDGET, fits_small), root=tmp_path)
    message = str(caught.value)
    assert caught.value.key == "training.mem_mb"
    assert f"model '{QWEN_VL}', variant 'vision'" in message
    assert f"Fix: raise training.mem_mb to at least {needs_large}" in message
    assert f"or lower variants.vision.max_pixels (now {INFOGRAPHIC_BUDGET}" in message


def test_a_variant_without_a_budget_counts_its_prepared_processors_own(tmp_path):
    """Qwen2.5-VL's released processor allows 12,845,056 pixels (16,384 image tokens): a variant that sets no
    max_pixels is estimated at that, read from the prepared preprocessor_config.json, not at one patch."""
    config = qwen_vl_cpu_config(tmp_path, None, 10**7)
    unknown = check_declared_memory(config, root=tmp_path)[0]
    assert unknown["variant"] == "vision" and unknown["max_pixels"] is None  # no processor file: nothing to read
    (tmp_path / "resources" / "models" / QWEN_VL / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
         "max_pixels": 12845056, "min_pixels": 3136}))
    own = check_declared_memory(config, root=tmp_path)[0]
    infographic = check_declared_memory(qwen_vl_cpu_config(tmp_path, INFOGRAPHIC_BUDGET, 10**7), root=tmp_path)[0]
    assert own["max_pixels"] == 12845056
    per_patch = (11 * 1280 + 2 * 3420) * 2  # as in the test above
    assert own["host"]["total"] - infographic["host"]["total"] == (12845056 - INFOGRAPHIC_BUDGET) // 14**2 * per_patch


def test_a_prepared_tiny_vision_language_model_is_estimated_with_its_variants(tmp_path):
    """The demo's tiny-llava, once prepare_model has built it (its config.json here, made as tiny_vlm makes it),
    is estimated for the vision_language variants it runs: a fixed-size tower, so no pixel budget."""
    from workflow_scripts.model import tiny_model, tiny_vlm

    config = demo_config()
    tiny = tiny_vlm.settings({**config["models"]["tiny-llava"]["tiny"], "seed": 0})
    texts = [f"a chart of {n} bars, the tallest is {n % 7}" for n in range(50)]
    vlm_config, _ = tiny_vlm.llava_parts(tiny, tiny_model.train_tokenizer(texts, tiny["vocab_size"]))
    prepared = tmp_path / "resources" / "models" / "tiny-llava"
    prepared.mkdir(parents=True)
    (prepared / "config.json").write_text(json.dumps(vlm_config.to_dict()))
    checked = check_declared_memory(config, root=tmp_path)
    vision_language = {v for v, s in config["variants"].items() if s["task"] == "vision_language"}
    assert {c["variant"] for c in checked if c["model"] == "tiny-llava"} == vision_language
    assert all(c["max_pixels"] is None and c["estimate"]["activations"] > 0 for c in checked)
