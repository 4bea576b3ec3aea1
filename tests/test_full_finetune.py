"""``training.finetune: full`` and ``model.initialise: random``: masked-LM pretraining from scratch as the
CNM-BERT seed did it, and full fine-tuning of a classifier.

Masked LM: tests/test_masked_lm_chain.py's learnable corpus through download -> normalise, a tiny BERT
from model/tiny_bert.py (prepare_model's ``tiny`` source), copied by prepare_model's ``local`` source with
``initialise: random`` (so train draws fresh weights from the experiment seed), then pretokenise, sanity,
train and evaluate as the rules call them. The harnesses of tests/test_train.py and
tests/test_task_distributed.py give the 1-vs-2-process and kill-and-resume checks; the classification data
and tiny Llama classifier are tests/test_task_gates.py's."""
from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ranks
from float_tolerance import assert_same_curve, assert_same_tensors
from conftest import tiny_training_settings, training_json
from data_helpers import default_config, run_download, run_normalise
from test_masked_lm_chain import EVALUATION, FACTS, corpus
from test_task_gates import CLASSIFIER_MAX_LENGTH, CLASSIFIER_VARIANT, build_classification_data
from test_train import log_rows, start_slow, train_argv, wait_for
from workflow_scripts import evaluate, prepare_model, pretokenise, sanity, train
from workflow_scripts.analysis import fairness
from workflow_scripts.core.errors import ConfigError, WorkflowError, run_main
from workflow_scripts.checks.config import check_config
from workflow_scripts.core.config_files import validate_schema
from workflow_scripts.core.settings import LoraSettings
from workflow_scripts.model import memory_estimate, model_loading
from workflow_scripts.training import checkpointing, training_setup
from workflow_scripts.training.distributed import DistributedContext

MAX_LENGTH = 32
VARIANT = {"mask_rate": 0.15, "grouping": "lines"}
STEPS, CHECKPOINT_EVERY = 12, 4
CPU = DistributedContext(0, 0, 1, 1, torch.device("cpu"), None)
QUERY_LORA = LoraSettings(rank=2, alpha=4, dropout=0.0, target_modules=("query",))
TINY_BERT = {"architecture": "bert", "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2,
             "vocab_size": 120, "seed": 0}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def full_settings(**overrides) -> dict:
    return tiny_training_settings(**{"finetune": "full", "max_length": MAX_LENGTH, "learning_rate": 3e-3,
                                     "max_steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "effective_batch": 8,
                                     "micro_batch": 4, "gradient_checkpointing": False, **overrides})


@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    """(random-initialise model dir, tokenised dir, normalised data dir, the tiny BERT as built)."""
    tmp = tmp_path_factory.mktemp("scratch")
    source = tmp / "corpus"
    source.mkdir()
    (source / "train.txt").write_text("\n".join(corpus(200, seed=1)) + "\n", encoding="utf-8")
    (source / "test.txt").write_text("\n".join(corpus(30, seed=2)) + "\n", encoding="utf-8")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(source)}, "format": "text",
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy",
                "contamination": {"accept": True}}  # a few facts, repeated by design
    data, _ = run_normalise("lines", settings, run_download("lines", settings, tmp), tmp)
    tiny = {"name": "tiny-bert", "source": "tiny", "tiny": TINY_BERT}
    assert prepare_model.main(["--model", json.dumps(tiny), "--out", str(tmp / "tiny"), "--corpus", str(data)]) == 0
    scratch = {"name": "scratch-bert", "source": "local", "path": str(tmp / "tiny"), "initialise": "random"}
    assert prepare_model.main(["--model", json.dumps(scratch), "--out", str(tmp / "model")]) == 0
    tokenised = tmp / "tokenised"
    assert pretokenise.main(["--model", str(tmp / "model"), "--data", str(data), "--task", "masked_lm",
                             "--variant", json.dumps(VARIANT), "--max-length", str(MAX_LENGTH), "--out", str(tokenised),
                             "--report", str(tmp / "tokenise_report.json")]) == 0
    return tmp / "model", tokenised, data, tmp / "tiny"


def run_train(out: Path, model_dir, tokenised, settings, seed: int = 1) -> Path:
    assert train.main(train_argv(out, model_dir, tokenised, settings, seed)) == 0
    return out


def full_model(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "model.safetensors"))


def run_evaluate(out: Path, model_dir, data, adapter, task="masked_lm", variant=VARIANT, metric="masked_accuracy",
                 evaluation=EVALUATION) -> dict:
    argv = ["--model", str(model_dir), "--data", str(data), "--task", task, "--variant", json.dumps(variant),
            "--metric", metric, "--evaluation", json.dumps(evaluation), "--dataset-name", "d", "--variant-name", "v",
            "--seed", "1" if adapter else "base", "--predictions-out", str(out / "predictions.jsonl"),
            "--summary-out", str(out / "eval.json")]
    assert evaluate.main(argv + (["--adapter", str(adapter)] if adapter else [])) == 0
    return json.loads((out / "eval.json").read_text())


# --- model.initialise: random ------------------------------------------------------------------------
def test_random_initialise_draws_fresh_weights_from_the_seed(mlm, tmp_path):
    model_dir, _, _, tiny = mlm
    cpu = torch.device("cpu")
    assert model_loading.initialisation(model_dir) == "random"
    one, again, other = (model_loading.load_base_model(model_dir, cpu, auto_class="AutoModelForMaskedLM", seed=s)
                         for s in (1, 1, 2))
    stored = model_loading.load_base_model(tiny, cpu, auto_class="AutoModelForMaskedLM")
    name = "bert.encoder.layer.0.attention.self.query.weight"
    weights = {k: dict(m.named_parameters())[name] for k, m in (("one", one), ("again", again), ("other", other),
                                                                  ("stored", stored))}
    assert torch.equal(weights["one"], weights["again"])  # seeded: every process draws the same
    assert not torch.equal(weights["one"], weights["other"]) and not torch.equal(weights["one"], weights["stored"])
    assert one.get_output_embeddings().weight is one.get_input_embeddings().weight  # ties kept, as from_pretrained
    # A tiny model is random already: with initialise random in its manifest it is loaded as built.
    copy = tmp_path / "tiny"
    shutil.copytree(model_dir, copy)
    manifest = json.loads((copy / "model_manifest.json").read_text())
    manifest["settings"]["source"] = "tiny"
    (copy / "model_manifest.json").write_text(json.dumps(manifest))
    as_built = model_loading.load_base_model(copy, cpu, auto_class="AutoModelForMaskedLM", seed=1)
    assert torch.equal(dict(as_built.named_parameters())[name], weights["stored"])


# --- pretraining from scratch: gate, training, evaluation -----------------------------------------------
@pytest.fixture(scope="module")
def pretrained_from_scratch(mlm, tmp_path_factory):
    model_dir, tokenised, _, _ = mlm
    return run_train(tmp_path_factory.mktemp("mlm-full"), model_dir, tokenised,
                     full_settings(max_steps=60, checkpoint_every=100, warmup_steps=2))


def test_the_gate_checks_every_parameter_and_counts_all_as_trainable(mlm, tmp_path):
    model_dir, tokenised, _, _ = mlm
    out = tmp_path / "sanity.json"
    assert sanity.main(gate_argv(model_dir, tokenised, out)) == 0
    report = json.loads(out.read_text())
    checks = {c["name"]: c["detail"] for c in report["checks"]}
    setup = training_setup.build(model_dir, full_settings(), CPU,
                                 data_meta=json.loads((tokenised / "tokenise_meta.json").read_text()), seed=1)
    params = dict(setup.peft_model.named_parameters())
    assert f"all {len(params)} parameter tensors have finite, non-zero gradients" in checks["gradients"]
    assert f"all {len(params)} parameter tensors trainable" in checks["trainable_parameters"]
    assert f"{len(params)} parameters found by name" in checks["name_lookup"]
    estimate = report["memory_estimate"]  # every parameter is trainable: fp32 weights, gradients, two Adam moments
    total = sum(p.numel() for p in params.values())
    assert estimate["weights"] == 0 and estimate["adapters"] == estimate["gradients"] == 4 * total
    assert estimate["optimizer"] == 8 * total
    assert memory_estimate.estimate(setup.peft_model, full_settings(), torch.device("cpu"))["adapters"] == 4 * total


def gate_argv(model_dir, tokenised, out: Path, settings: dict | None = None) -> list[str]:
    return ["--model", str(model_dir), "--data", str(tokenised), "--training",
            training_json(settings or full_settings(sanity_batches=1)), "--seed", "1", "--out", str(out)]


def freeze_one(monkeypatch):
    original = training_setup.build

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)
        dict(setup.peft_model.named_parameters())["bert.encoder.layer.1.output.dense.weight"].requires_grad_(False)
        return setup

    monkeypatch.setattr(training_setup, "build", build)


def zero_one_gradient(monkeypatch):
    original = training_setup.build

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)
        dict(setup.peft_model.named_parameters())["bert.encoder.layer.0.intermediate.dense.bias"].register_hook(
            torch.zeros_like)
        return setup

    monkeypatch.setattr(training_setup, "build", build)


def add_unused(monkeypatch):
    """A parameter off the path to the loss (a module the forward never calls)."""
    original = training_setup.build

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)
        setup.peft_model.bert.unused = torch.nn.Linear(2, 2)
        return setup

    monkeypatch.setattr(training_setup, "build", build)


@pytest.mark.parametrize("plant, check, cause", [
    (freeze_one, "trainable_parameters",
     "training.finetune is full but 1 of 42 parameters have requires_grad=False (bert.encoder.layer.1.output.dense.weight)"),
    (zero_one_gradient, "gradients", "parameters have all-zero gradients (bert.encoder.layer.0.intermediate.dense.bias)"),
    (add_unused, "gradients", "2 of 44 parameters got no gradient after backward (bert.unused.bias, bert.unused.weight)"),
], ids=["frozen", "zero_gradient", "off_the_loss_path"])
def test_the_gate_refuses_a_parameter_that_would_not_train(monkeypatch, capsys, tmp_path, mlm, plant, check, cause):
    model_dir, tokenised, _, _ = mlm
    plant(monkeypatch)
    out = tmp_path / "sanity.json"
    with pytest.raises(SystemExit) as exited:
        run_main(sanity.main, gate_argv(model_dir, tokenised, out))
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: {check}: ") and cause in error and ". Fix: " in error, error
    assert not out.exists()


def test_pretraining_from_scratch_learns_and_the_saved_model_scores(mlm, pretrained_from_scratch, tmp_path):
    model_dir, _, data, _ = mlm
    out = pretrained_from_scratch
    losses = [r["loss"] for r in log_rows(out)]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
    saved = out / "adapter"
    assert (saved / model_loading.FULL_MODEL_MARKER).is_file() and (saved / "config.json").is_file()
    assert not (saved / "adapter_config.json").exists() and model_loading.adapter_kind(saved) == "full"
    weights = full_model(out)
    assert all(t.dtype == torch.float32 for t in weights.values())  # fp32 master weights
    initial = model_loading.load_base_model(model_dir, torch.device("cpu"), auto_class="AutoModelForMaskedLM", seed=1)
    trained_params = {n for n, p in initial.named_parameters()}
    assert trained_params <= set(weights)  # the whole model (its tied output layer once)
    changed = [n for n, p in initial.named_parameters() if not torch.equal(p.detach(), weights[n])]
    assert set(changed) == trained_params  # every parameter moved: all of them trained
    manifest = json.loads((out / "run_manifest.json").read_text())
    assert manifest["settings"]["finetune"] == "full"
    trained = run_evaluate(tmp_path / "trained", model_dir, data, saved)
    untrained = run_evaluate(tmp_path / "base", model_dir, data, None)  # random weights from seed 0
    assert trained["masked_tokens"] == untrained["masked_tokens"]
    assert trained["score"] > untrained["score"] + 0.2, (trained["score"], untrained["score"])
    assert trained["adapter_dir"] == str(saved)


# --- DDP (gloo) and resume ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_process(mlm, tmp_path_factory):
    model_dir, tokenised, _, _ = mlm
    out = run_train(tmp_path_factory.mktemp("mlm-1p"), model_dir, tokenised, full_settings())
    assert json.loads((out / "run_manifest.json").read_text())["world_size"] == 1
    return out


def test_one_and_two_gloo_processes_follow_the_same_loss_curve(mlm, one_process, tmp_path):
    model_dir, tokenised, _, _ = mlm
    ranks.assert_succeeded(ranks.run_stage(  # two gloo ranks forked from this process (tests/ranks.py)
        train.main, train_argv(tmp_path, model_dir, tokenised, full_settings(cpu_processes=2)), timeout=300))
    assert json.loads((tmp_path / "run_manifest.json").read_text())["world_size"] == 2
    one, two = [r["loss"] for r in log_rows(one_process)], [r["loss"] for r in log_rows(tmp_path)]
    assert len(one) == STEPS
    assert_same_curve(two, one, full_settings())  # float32 reordering bound (tests/float_tolerance.py)
    assert sum(one[-3:]) < sum(one[:3])  # it learns: not two flat curves
    ours, theirs = full_model(one_process), full_model(tmp_path)
    assert set(ours) == set(theirs)
    assert_same_tensors(theirs, ours, full_settings(), steps=STEPS)


def test_killed_run_resumes_to_the_identical_model(mlm, one_process, tmp_path, capsys):
    model_dir, tokenised, _, _ = mlm
    settings = full_settings()
    process = start_slow(tmp_path, model_dir, tokenised, settings)  # each micro-step slowed, in a forked process
    wait_for(lambda: (tmp_path / "checkpoints" / f"step-{CHECKPOINT_EVERY:08d}" / "state.json").exists(), process,
             timeout=180)
    process.send_signal(signal.SIGKILL)  # no clean-up, as with an OOM kill or a node failure
    process.communicate()
    step, path = checkpointing.checkpoints(tmp_path / "checkpoints")[-1]
    assert CHECKPOINT_EVERY <= step < STEPS and not (tmp_path / "adapter").exists()
    assert (path / "model.safetensors").is_file() and not (path / "adapter.safetensors").exists()
    assert len(load_file(str(path / "model.safetensors"))) == len(full_model(one_process))  # the whole model
    capsys.readouterr()
    run_train(tmp_path, model_dir, tokenised, settings)
    assert "resumed from" in capsys.readouterr().out
    ours, theirs = full_model(tmp_path), full_model(one_process)
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert [r["loss"] for r in log_rows(tmp_path)] == [r["loss"] for r in log_rows(one_process)]


def test_a_lora_checkpoint_is_not_resumed_as_a_full_model(mlm, tmp_path):
    model_dir, tokenised, _, _ = mlm
    cpu = torch.device("cpu")
    settings = full_settings()
    base = model_loading.load_base_model(model_dir, cpu, auto_class="AutoModelForMaskedLM", seed=1)
    lora = model_loading.add_lora(base, QUERY_LORA, False, None)
    optimizer, scheduler = training_setup.build_optimizer_and_scheduler(
        [p for p in lora.parameters() if p.requires_grad], settings, cpu)
    path = checkpointing.save(tmp_path, 2, lora, optimizer, scheduler, None, [checkpointing.rng_state(cpu)], {})
    whole = model_loading.prepare_full(
        model_loading.load_base_model(model_dir, cpu, auto_class="AutoModelForMaskedLM", seed=1), False)
    optimizer, scheduler = training_setup.build_optimizer_and_scheduler(list(whole.parameters()), settings, cpu)
    with pytest.raises(WorkflowError, match="holds a LoRA run's adapter, not model.safetensors"):
        checkpointing.load(path, whole, optimizer, scheduler, None, 0, cpu)


# --- loading a trained directory: the full model, or the refusal --------------------------------------
def test_the_output_loads_as_what_it_is_and_nothing_else(mlm, one_process, tmp_path):
    model_dir, _, _, _ = mlm
    cpu = torch.device("cpu")
    saved = one_process / "adapter"

    def base():
        return model_loading.load_base_model(model_dir, cpu, auto_class="AutoModelForMaskedLM")

    loaded = model_loading.load_adapter(base(), model_dir, saved, finetune="full")
    for name, tensor in full_model(one_process).items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with pytest.raises(WorkflowError, match="holds a fully fine-tuned model, but training.finetune is lora"):
        model_loading.load_adapter(base(), model_dir, saved, finetune="lora")
    with pytest.raises(WorkflowError, match="a fully fine-tuned model, not a LoRA adapter"):
        model_loading.load_adapter(model_loading.add_lora(base(), QUERY_LORA, False, None),
                                   model_dir, saved)
    adapter = tmp_path / "lora"
    model_loading.add_lora(base(), QUERY_LORA, False, None).save_pretrained(str(adapter))
    with pytest.raises(WorkflowError, match="holds a LoRA adapter, but training.finetune is full"):
        model_loading.load_adapter(base(), model_dir, adapter, finetune="full")
    both = tmp_path / "both"
    shutil.copytree(saved, both)
    shutil.copy(adapter / "adapter_config.json", both)
    with pytest.raises(WorkflowError, match="holds both full_model.json and adapter_config.json"):
        model_loading.load_adapter(base(), model_dir, both)
    unmarked = tmp_path / "unmarked"
    shutil.copytree(saved, unmarked)
    (unmarked / model_loading.FULL_MODEL_MARKER).unlink()
    with pytest.raises(WorkflowError, match="a model directory without full_model.json"):
        model_loading.load_adapter(base(), model_dir, unmarked)
    from transformers import BertConfig, BertForMaskedLM

    wider = BertForMaskedLM(BertConfig(vocab_size=base().config.vocab_size, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=64))
    with pytest.raises(WorkflowError, match="made for another base model: tensor .* has shape"):
        model_loading.load_adapter(wider, model_dir, saved)


# --- classification ------------------------------------------------------------------------------------
def test_a_classifier_fully_fine_tuned_passes_the_gate_learns_and_scores(tmp_path):
    model_dir, tokenised = build_classification_data(tmp_path / "topics")
    settings = tiny_training_settings(finetune="full", max_length=CLASSIFIER_MAX_LENGTH, effective_batch=16,
                                      micro_batch=8, max_steps=20, learning_rate=3e-3, checkpoint_every=100,
                                      sanity_batches=1)
    out = tmp_path / "sanity.json"
    assert sanity.main(gate_argv(model_dir, tokenised, out, settings)) == 0
    checks = {c["name"]: c["detail"] for c in json.loads(out.read_text())["checks"]}
    assert "'score' trainable and saved" in checks["classification_model"]
    assert "parameter tensors have finite, non-zero gradients" in checks["gradients"]
    assert "classification_gradients" in checks
    run = run_train(tmp_path / "run", model_dir, tokenised, settings)
    losses = [r["loss"] for r in log_rows(run)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert any(name.startswith("score.") for name in full_model(run))
    data = tmp_path / "topics" / "results" / "topics_demo" / "normalised"
    evaluation = {**EVALUATION, "max_length": CLASSIFIER_MAX_LENGTH}
    summary = run_evaluate(tmp_path / "eval", model_dir, data, run / "adapter", "classification", CLASSIFIER_VARIANT,
                           "accuracy", evaluation)
    untrained = run_evaluate(tmp_path / "base", model_dir, data, None, "classification", CLASSIFIER_VARIANT,
                             "accuracy", evaluation)
    assert summary["score"] > untrained["score"], (summary["score"], untrained["score"])


# --- refusals ------------------------------------------------------------------------------------------
def mlm_config(**training) -> dict:
    """The demo config, its masked_lm variants overridden alike with ``training``."""
    config = default_config()
    for name, variant in config["variants"].items():
        if variant.get("task") == "masked_lm":
            variant["training"] = {**variant.get("training", {}), **training}
    return config


def refused_config(config) -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        check_config(validate_schema(config))
    assert "\n" not in str(raised.value)
    return raised.value


def test_the_config_allows_pretraining_from_scratch_and_refuses_what_cannot_run():
    config = mlm_config(finetune="full")
    config["models"]["tiny-bert"]["initialise"] = "random"
    check_config(validate_schema(config))  # the README's example: fine
    config = default_config()
    config["models"]["tiny-bert"]["initialise"] = "random"
    error = refused_config(config)
    assert error.key == "models.tiny-bert.initialise" and "needs training.finetune: full" in error.problem
    error = refused_config(mlm_config(finetune="full", quantization={"bits": 4}))
    assert error.key == "variants.mlm_tokens.training.quantization" and "quantised" in error.problem
    error = refused_config(mlm_config(finetune="full", strategy="fsdp"))
    assert error.key == "variants.mlm_tokens.training.strategy" and "strategy: ddp" in error.problem
    config = default_config()
    config["variants"]["vision"]["training"] = {"finetune": "full"}
    config["variants"]["text_only"]["training"] = {"finetune": "full"}
    error = refused_config(config)
    assert error.key.endswith("training.finetune") and "vision_language" in error.problem


def test_variants_must_agree_on_finetune():
    config = default_config()
    config["variants"]["mlm_whole_word"]["training"] = {"finetune": "full"}
    error = refused_config(config)
    assert error.key == "variants.mlm_whole_word.training.finetune" and "would not be fair" in error.problem
    config["comparison"]["intended_differences"] = ["training.finetune"]
    check_config(validate_schema(config))
    # compare's guard (the run manifests) compares it too: not a runtime-only key.
    assert "finetune" not in fairness.RUNTIME_ONLY_TRAINING_KEYS
    settings = fairness.comparable_settings({"settings": full_settings().to_dict()})
    assert settings["training.finetune"] == "full"


@pytest.mark.parametrize("overrides, initialise, message", [
    ({}, "random", "model.initialise: random (pretraining from scratch) trains every weight"),
    ({"finetune": "full", "quantization": {"bits": 4}}, "pretrained", "training.quantization: full fine-tuning"),
    ({"finetune": "full", "strategy": "fsdp"}, "pretrained", "training.strategy: fsdp shards LoRA training only"),
])
def test_train_refuses_what_full_fine_tuning_cannot_run(mlm, overrides, initialise, message):
    model_dir, tokenised, _, tiny = mlm
    meta = json.loads((tokenised / "tokenise_meta.json").read_text())
    settings = tiny_training_settings(**{"max_length": MAX_LENGTH, **overrides})
    with pytest.raises(WorkflowError) as raised:
        training_setup.build(model_dir if initialise == "random" else tiny, settings, CPU, data_meta=meta)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)
    problem = training_setup.finetune_problem(tiny_training_settings(finetune="full"), "pretrained", "vision_language")
    assert problem[0] == "training.finetune" and "vision_language" in problem[1]


def test_a_variant_asking_for_full_training_is_pointed_to_the_training_setting():
    from workflow_scripts.core.entry_settings import VariantSettings

    for value in ("full", "lora"):  # lora too: the variant's value would be ignored while training.finetune decides
        with pytest.raises(WorkflowError, match="'variants.v.finetune': how the model trains .* set training.finetune: full"):
            VariantSettings.parse({"finetune": value}, "masked_lm", "v")
    with pytest.raises(WorkflowError, match="'variants.v.from_scratch'.*model.initialise: random"):
        VariantSettings.parse({"from_scratch": True}, "masked_lm", "v")
