"""QLoRA (training.quantization): a tiny Llama with bitsandbytes 4-bit weights trains on CPU through the
same build and optimizer-step functions as every run; its adapter is a plain PEFT adapter, evaluated on
the base quantised as in training (or, asked, the unquantised one); memory estimates (from the built model and from config.json alone) agree
with figures worked by hand; bad settings end in one line."""
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_PAD, tiny_training_settings, training_json
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.data import batching
from workflow_scripts.model import config_memory_estimate as cme
from workflow_scripts.model import memory_estimate, model_loading, quantization
from workflow_scripts.training import training_setup
from workflow_scripts.training.distributed import DistributedContext

bnb = pytest.importorskip("bitsandbytes")

CPU = DistributedContext(0, 0, 1, 1, torch.device("cpu"), None)
CONFIGS = Path(__file__).parent / "model_configs"
GiB = 2**30
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QLORA = {"bits": 4, "type": "nf4", "double_quant": True, "compute_dtype": "fp32"}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def qlora_model_dir(tmp_path_factory):
    """The demo's tiny Llama (workflow_scripts/model/tiny_model.py): hidden 64, intermediate 128, 2 layers,
    its byte-level tokenizer's 258 ids; initialised so that adapters can move the loss within 20 steps."""
    from workflow_scripts.model import tiny_model

    tokenizer = tiny_model.train_tokenizer(iter(["qlora"]), 128)
    directory = tmp_path_factory.mktemp("qlora_model")
    tiny = {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
            "seed": 0}
    tiny_model.build_model(tiny, tokenizer).save_pretrained(str(directory))
    assert len(tokenizer) == VOCAB
    return directory


VOCAB = 258


def qlora_settings(**overrides):
    return tiny_training_settings(**{"quantization": QLORA, "lora": {"target_modules": ALL_PROJ},
                                     "max_steps": 20, "learning_rate": 2e-2, **overrides})


@pytest.fixture(scope="module")
def trained(qlora_model_dir, tiny_tokenised_dir, tmp_path_factory):
    """20 optimizer steps of 2 micro-batches of 4 rows, as train.py runs them; the adapter saved as train.py
    saves it."""
    from datasets import load_from_disk

    torch.manual_seed(0)
    settings = qlora_settings()
    setup = training_setup.build(qlora_model_dir, settings, CPU)
    rows = load_from_disk(str(tiny_tokenised_dir))["train"]  # token ids below 128: valid for this model too
    collate = batching.PaddingCollator(pad_token_id=TINY_PAD, vocab_size=VOCAB)
    losses = []
    for step in range(settings.max_steps):
        start = (step * 8) % 96
        micro = [collate([rows[i] for i in range(start + 4 * k, start + 4 * k + 4)]) for k in range(2)]
        scale = 1.0 / sum(int(b["target_tokens"]) for b in micro)
        loss = sum(float(training_setup.micro_step(setup, b, scale, k == 1, (0, step, k))) for k, b in enumerate(micro))
        training_setup.unscale_and_clip(setup)
        assert training_setup.apply_update(setup)
        losses.append(loss)
    adapter = tmp_path_factory.mktemp("qlora_adapter")
    setup.peft_model.save_pretrained(str(adapter), safe_serialization=True)
    return setup, losses, adapter, micro


def test_base_weights_are_4bit_norms_fp32_only_lora_trains(trained):
    setup = trained[0]
    base = setup.peft_model.get_base_model()
    # PEFT wraps each targeted layer; the layer it wraps (base_layer) is bitsandbytes'.
    linears = [m.base_layer for n, m in base.named_modules() if n.rsplit(".", 1)[-1] in ALL_PROJ]
    assert len(linears) == 14 and all(isinstance(m, bnb.nn.Linear4bit) for m in linears)
    weights = [m.weight for m in linears]
    assert all(isinstance(w, bnb.nn.Params4bit) and w.dtype == torch.uint8 for w in weights)
    assert {w.quant_state.quant_type for w in weights} == {"nf4"} and all(w.quant_state.nested for w in weights)
    norms = {n: p for n, p in base.named_parameters() if "norm" in n}
    assert len(norms) == 5 and all(p.dtype == torch.float32 for p in norms.values())
    assert base.lm_head.weight.dtype == torch.float32 and not isinstance(base.lm_head, bnb.nn.Linear4bit)
    trainable = [n for n, p in setup.peft_model.named_parameters() if p.requires_grad]
    assert len(trainable) == 28 and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in setup.trainable_parameters())


def test_loss_falls_over_twenty_steps(trained):
    losses = trained[1]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 1.5, losses  # about 6.0 to 3.7 (the unquantised model's curve is within 0.1)


def test_saved_adapter_is_plain_peft_and_loads_onto_the_unquantised_base(trained, qlora_model_dir):
    from safetensors.torch import load_file

    setup, _, adapter, (batch, _) = trained
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(saved) == 28 and all("lora_" in k and t.dtype == torch.float32 for k, t in saved.items())
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == sorted(ALL_PROJ)
    plain = model_loading.load_with_adapter(qlora_model_dir, adapter, torch.device("cpu"))
    assert not quantization.quantized_modules(plain)
    trained_lora = {n: p for n, p in setup.peft_model.named_parameters() if "lora_" in n}
    loaded_lora = {n: p for n, p in plain.named_parameters() if "lora_" in n}
    assert trained_lora.keys() == loaded_lora.keys()
    assert all(torch.equal(trained_lora[n].detach(), loaded_lora[n].detach()) for n in trained_lora)

    def mean_loss(model):
        with torch.no_grad():
            return float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               labels=batch["labels"]).loss)

    bare = model_loading.load_base_model(qlora_model_dir, torch.device("cpu")).eval()
    # What the adapter learned on the 4-bit base carries over to the full-precision one.
    assert mean_loss(plain) < mean_loss(bare) - 1.0


def test_gate_estimate_counts_packed_weights_and_quant_state_by_hand(trained, qlora_model_dir):
    setup = trained[0]
    parts = memory_estimate.estimate(setup.peft_model, setup.training, torch.device("cpu"))
    # Per layer q/k/v/o 64x64 and gate/up/down 64x128: 7 quantised tensors, 40,960 weights; 2 layers.
    sizes = [4096] * 4 + [8192] * 3
    packed = 2 * sum(n // 2 for n in sizes)  # two 4-bit weights per byte: 40,960
    blocks = 2 * sum(n // 64 for n in sizes)  # blocksize 64: 1,280 uint8 absmax (double quant)
    # Each tensor: one nested fp32 absmax (<= 256 blocks), an fp32 offset, its fp32 code books: 16 nf4
    # values and the 256-entry dynamic code of the 8-bit absmaxes.
    per_tensor = 4 * 1 + 4 + 16 * 4 + 256 * 4
    tensors = 14
    state = blocks + tensors * per_tensor
    assert quantization.quant_state_bytes(setup.peft_model) == state
    unquantised = 4 * (VOCAB * 64 + VOCAB * 64 + 5 * 64)  # embeddings, lm_head, 5 RMSNorms: fp32 after preparation
    assert parts["weights"] == packed + state + unquantised == 40_960 + 1_280 + 14 * 1_096 + 133_376
    lora = 2 * 4 * (4 * (64 + 64) + 3 * (64 + 128))  # rank 4 on all 7 projections, 2 layers: 8,704
    assert parts["adapters"] == parts["gradients"] == 4 * lora and parts["optimizer"] == 8 * lora
    # The config-only estimate prices the same tensors without the per-tensor code books.
    meta = cme.meta_model(qlora_model_dir)
    config_bytes, _, _ = cme.base_weight_bytes(meta, 4, {"bits": 4, "double_quant": True, "fp32_unquantized": True})
    assert config_bytes == packed + blocks + tensors * 4 + unquantised


# Config-only estimates (the gate before any weights exist), from training settings.
def big_run(**quant):
    return tiny_training_settings(lora={"rank": 16, "target_modules": ALL_PROJ}, precision="bf16", micro_batch=1,
                                  max_length=2048, effective_batch=8, gradient_checkpointing=True, **quant)


def test_qwen7b_4bit_weights_worked_by_hand():
    L, h, kv, i, V = 28, 3584, 512, 18944, 152064  # tests/model_configs/Qwen2.5-7B-Instruct.json
    linear = L * (2 * h * h + 2 * h * kv + 3 * h * i)  # every tensor's block count is a multiple of 256
    kept = 2 * V * h + L * 2 * h + h + L * (h + 2 * kv)  # embeddings, lm_head, norms, q/k/v biases
    nf4 = linear // 2 + linear // 64 + 4 * (linear // 64 // 256)  # 4.127 bits a weight
    args = cme.training_arguments(big_run(quantization={"bits": 4}))
    parts = cme.estimate_from_config(CONFIGS / "Qwen2.5-7B-Instruct.json", **args)
    assert parts["weights"] == nf4 + 4 * kept == 3_262_644_224 + 101_957_632 + 1_593_088 + 4_361_312_256
    plain = cme.estimate_from_config(CONFIGS / "Qwen2.5-7B-Instruct.json", **cme.training_arguments(big_run()))
    assert plain["weights"] == 2 * (linear + kept) == 15_231_233_024  # bf16: 14.2 GiB against 7.2 GiB
    single = cme.estimate_from_config(CONFIGS / "Qwen2.5-7B-Instruct.json",
                                      **cme.training_arguments(big_run(quantization={"double_quant": False})))
    assert single["weights"] == linear // 2 + 4 * (linear // 64) + 4 * kept  # fp32 absmax: 4.5 bits a weight
    out_rows = L * (3 * h + 2 * kv + 2 * i)
    int8 = cme.estimate_from_config(CONFIGS / "Qwen2.5-7B-Instruct.json",
                                    **cme.training_arguments(big_run(quantization={"bits": 8})))
    assert int8["weights"] == linear + 4 * out_rows + 4 * kept == 10_892_163_072


def test_70b_on_8x80gb_refused_with_bf16_lora_accepted_with_qlora():
    model = cme.meta_model(CONFIGS / "Meta-Llama-3-70B.json")
    H, I, L, KV, V, R = 8192, 28672, 80, 1024, 128256, 16
    linear = L * (2 * H * H + 2 * H * KV + 3 * H * I)
    lora = L * R * (4 * H + 2 * (H + KV) + 3 * (H + I))
    activations = 2048 * (H * L + 11 * H + 4 * I + R * 7) * 2 + 2048 * V * 4 * 2
    lora_run = cme.advise(model, capacity=80 * GiB, world_size=8, **cme.training_arguments(big_run()))
    assert not lora_run["fits"] and lora_run["estimate"]["total"] == 151_948_050_432  # 141.5 GiB a GPU
    qlora_run = cme.advise(model, capacity=80 * GiB, world_size=8,
                           **cme.training_arguments(big_run(quantization={"bits": 4, "type": "nf4"})))
    nf4 = linear // 2 + linear // 64 + 4 * (linear // 64 // 256)
    kept = 4 * (2 * V * H + 2 * L * H + H)
    # DDP's reducer holds adapter gradients twice: adapters 4, gradients 8, AdamW 8 bytes a parameter.
    assert qlora_run["estimate"]["total"] == nf4 + kept + 20 * lora + activations + GiB == 54_563_078_144
    assert qlora_run["fits"] and qlora_run["line"].startswith("fits: ddp on 8 GPU(s) needs 50.8 GiB per GPU")


# Bad settings: one line each, naming the key and the fix.
def test_bits_3_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as schema:
        tiny_training_settings(quantization={"bits": 3})
    assert "training.quantization.bits" in str(schema.value) and "\n" not in str(schema.value)


def test_missing_bitsandbytes_names_the_pip_command(monkeypatch, qlora_model_dir):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes now raises ImportError
    with pytest.raises(WorkflowError, match=r"cannot be imported .*Fix: pip install bitsandbytes") as error:
        training_setup.build(qlora_model_dir, qlora_settings(), CPU)
    assert "\n" not in str(error.value)
    assert quantization.from_pretrained_kwargs(tiny_training_settings(), CPU.device) == {}  # off: not needed


def test_training_a_quantised_module_whole_is_refused(qlora_model_dir):
    settings = qlora_settings(lora={"target_modules": ["q_proj"], "modules_to_save": ["gate_proj"]})
    with pytest.raises(WorkflowError, match=r"'gate_proj' is trained whole .* quantised its weights "
                                            r"\(model.layers.0.mlp.gate_proj\).*Fix: remove 'gate_proj'") as error:
        training_setup.build(qlora_model_dir, settings, CPU)
    assert "\n" not in str(error.value)
    # lm_head stays unquantised (transformers' default), so training it whole is fine.
    setup = training_setup.build(qlora_model_dir, qlora_settings(lora={"target_modules": ["q_proj"],
                                                                      "modules_to_save": ["lm_head"]}), CPU)
    head = [n for n, p in setup.peft_model.named_parameters() if p.requires_grad and "lm_head" in n]
    assert head and all(p.dtype == torch.float32 for n, p in setup.peft_model.named_parameters() if n in head)


def test_train_stage_with_quantization_writes_a_plain_adapter(tmp_path, qlora_model_dir, tiny_tokenised_dir, trained):
    from safetensors.torch import load_file

    from workflow_scripts import train

    settings = qlora_settings(max_steps=6, checkpoint_every=3)
    argv = ["--model", str(qlora_model_dir), "--data", str(tiny_tokenised_dir), "--training", training_json(settings),
            "--seed", "1", "--checkpoint-dir", str(tmp_path / "checkpoints"),
            "--adapter-out", str(tmp_path / "adapter"),
            "--log-out", str(tmp_path / "train_log.jsonl"), "--manifest-out", str(tmp_path / "run_manifest.json")]
    started = time.perf_counter()
    assert train.main(argv) == 0
    assert time.perf_counter() - started < 60
    manifest = json.loads((tmp_path / "run_manifest.json").read_text())
    assert manifest["settings"]["quantization"] == QLORA
    # The stage records the gate's figure for the 4-bit model, as worked by hand above.
    gate = memory_estimate.estimate(trained[0].peft_model, trained[0].training, torch.device("cpu"))
    assert manifest["memory_estimate"]["weights"] == gate["weights"] == 190_960
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == 28 and all("lora_" in k for k in saved)
    # Beside it, the bitsandbytes settings its base was trained with: evaluation loads the same base.
    assert json.loads((tmp_path / "adapter" / quantization.ADAPTER_RECORD).read_text()) == QLORA


def test_8bit_trains_on_cpu_and_its_row_scales_are_counted(qlora_model_dir, tiny_tokenised_dir):
    from datasets import load_from_disk

    setup = training_setup.build(qlora_model_dir, qlora_settings(quantization={"bits": 8}), CPU)
    layers = [m for m in setup.peft_model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert len(layers) == 14 and all(m.weight.dtype == torch.int8 for m in layers)
    rows = load_from_disk(str(tiny_tokenised_dir))["train"]
    batch = batching.PaddingCollator(pad_token_id=TINY_PAD, vocab_size=VOCAB)([rows[i] for i in range(4)])
    loss = training_setup.micro_step(setup, batch, 1.0 / int(batch["target_tokens"]), True, (0, 0, 0))
    assert math.isfinite(float(loss)) and all(p.grad is not None for p in setup.trainable_parameters())
    # LLM.int8: one byte a weight plus one fp32 scale per output row (q/k/v/o 64 rows, gate/up 128, down 64).
    out_rows = 2 * (4 * 64 + 2 * 128 + 64)
    assert quantization.quant_state_bytes(setup.peft_model) == 4 * out_rows
    parts = memory_estimate.estimate(setup.peft_model, setup.training, torch.device("cpu"))
    assert parts["weights"] == 81_920 + 4 * out_rows + 4 * (VOCAB * 64 * 2 + 5 * 64)


# Evaluation: the adapter is scored on the base it was trained on (evaluation.qlora_base, model/quantization.py).
def test_evaluation_scores_a_qlora_adapter_on_its_quantised_base_by_default(trained, qlora_model_dir, tmp_path):
    import argparse
    import shutil

    from workflow_scripts import evaluate
    from workflow_scripts.tasks import generation

    from workflow_scripts.model import tiny_model

    setup, _, adapter, (batch, _) = trained
    recorded, model_dir = tmp_path / "adapter", tmp_path / "model"
    shutil.copytree(adapter, recorded)
    quantization.write_adapter_record(recorded, qlora_settings())  # as train.py writes it beside the adapter
    shutil.copytree(qlora_model_dir, model_dir)  # evaluation loads the tokenizer too: the fixture's own
    tiny_model.train_tokenizer(iter(["qlora"]), 128).save_pretrained(str(model_dir))
    args = argparse.Namespace(model=str(model_dir), adapter=str(recorded), trust_remote_code=False)

    def mean_loss(model):
        with torch.no_grad():
            return float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               labels=batch["labels"]).loss)

    setup.peft_model.eval()
    try:
        trained_loss = mean_loss(setup.peft_model)  # the model as it was trained: NF4 base + adapter
    finally:
        setup.peft_model.train()
    with evaluate.loaded_model(args, generation.TASK, {}, 0, "test") as loaded:
        assert len(quantization.quantized_modules(loaded.model)) == 14
        assert loaded.base == {"qlora_base": "quantised", "base_quantization": QLORA}
        assert evaluate.model_facts(args, loaded)["qlora_base"] == "quantised"  # eval.json names it
        assert mean_loss(loaded.model) == pytest.approx(trained_loss, abs=1e-5)
    with evaluate.loaded_model(args, generation.TASK, {}, 0, "test", qlora_base="unquantised") as loaded:
        assert not quantization.quantized_modules(loaded.model)
        assert loaded.base == {"qlora_base": "unquantised", "base_quantization": None}
        # Another model than the one trained: its loss is not the trained model's.
        assert abs(mean_loss(loaded.model) - trained_loss) > 1e-3


def test_fp32_evaluation_computes_the_4bit_layers_in_fp32_and_records_it(trained, qlora_model_dir, tmp_path):
    """Issue 36: under evaluation.dtype fp32 the 4-bit layers computed in the training's compute dtype (bf16)
    while eval.json said float32. They now compute in the evaluation's dtype, on the same NF4 weights, and
    base_quantization records the compute dtype used."""
    import argparse
    import shutil

    import bitsandbytes as bnb

    from workflow_scripts import evaluate
    from workflow_scripts.model import tiny_model
    from workflow_scripts.tasks import generation

    setup, _, adapter, (batch, _) = trained
    recorded, model_dir = tmp_path / "adapter", tmp_path / "model"
    shutil.copytree(adapter, recorded)
    quantization.write_adapter_record(recorded, qlora_settings(quantization={**QLORA, "compute_dtype": "bf16"}))
    shutil.copytree(qlora_model_dir, model_dir)
    tiny_model.train_tokenizer(iter(["qlora"]), 128).save_pretrained(str(model_dir))
    args = argparse.Namespace(model=str(model_dir), adapter=str(recorded), trust_remote_code=False)
    setup.peft_model.eval()
    try:
        with torch.no_grad():  # trained with fp32 compute: the same NF4 weights in fp32 give its loss
            trained_loss = float(setup.peft_model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss)
    finally:
        setup.peft_model.train()
    with evaluate.loaded_model(args, generation.TASK, {}, 0, "test", compute_dtype="fp32") as loaded:
        layers = [m for m in loaded.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(layers) == 14 and {m.compute_dtype for m in layers} == {torch.float32}
        facts = evaluate.model_facts(args, loaded)
        assert facts["dtype"] == "float32" and facts["base_quantization"] == {**QLORA, "compute_dtype": "fp32"}
        with torch.no_grad():
            loss = float(loaded.model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss)
        assert loss == pytest.approx(trained_loss, abs=1e-5)


def test_the_untrained_model_of_a_qlora_variant_is_scored_on_the_quantised_base(qlora_model_dir, tmp_path):
    """Issue 36: evaluate_base scored a QLoRA variant's untrained model on the unquantised base, so 'gain over
    untrained' held the effect of quantisation. With the variant's settings (--base-quantization, from the
    rule) it loads quantised as the adapters are scored; evaluation.qlora_base: unquantised keeps it plain."""
    import argparse
    import shutil

    from workflow_scripts import evaluate
    from workflow_scripts.model import tiny_model
    from workflow_scripts.tasks import generation

    model_dir = tmp_path / "model"
    shutil.copytree(qlora_model_dir, model_dir)
    tiny_model.train_tokenizer(iter(["qlora"]), 128).save_pretrained(str(model_dir))
    args = argparse.Namespace(model=str(model_dir), adapter=None, trust_remote_code=False, base_quantization=QLORA)
    with evaluate.loaded_model(args, generation.TASK, {}, 0, "test") as loaded:
        assert len(quantization.quantized_modules(loaded.model)) == 14
        assert loaded.base == {"qlora_base": "quantised", "base_quantization": QLORA}
    with evaluate.loaded_model(args, generation.TASK, {}, 0, "test", qlora_base="unquantised") as loaded:
        assert not quantization.quantized_modules(loaded.model)
        assert loaded.base == {"qlora_base": "unquantised", "base_quantization": None}
