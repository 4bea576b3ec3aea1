"""The gate's task-specific checks (tasks.base: check_tokenizer / check_model / check_batch /
check_gradients), one planted fault per check, and the sanity stage running them end to end.

Classification: a tiny random Llama (``score`` head) and BERT (``classifier`` head) built here, and the
demo topics data through normalise -> prepare_model -> pretokenise for the stage. Masked LM: the tiny
BERT and corpus of tests/test_masked_lm_chain.py through the same stages."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_training_settings, training_json
from data_helpers import demo_settings, run_download, run_normalise
from workflow_scripts.core.settings import LoraSettings
from workflow_scripts import prepare_model, pretokenise, sanity
from workflow_scripts.core.errors import run_main
from workflow_scripts.model import model_loading
from workflow_scripts.tasks import classification, masked_lm
from workflow_scripts.training import training_setup
from workflow_scripts.training.preflight_checks import PreflightError

LABELS = ["food", "sport", "weather"]
CLASSIFIER_VARIANT = {"input": "Which topic: {text}"}
CLASSIFIER_MAX_LENGTH = 48
LORA = {"llama": ["q_proj", "v_proj"], "bert": ["query", "value"]}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


# --- shared builders (tests/test_task_distributed.py uses them too) ---
def build_classification_data(tmp: Path) -> tuple[Path, Path]:
    """The demo topics data, a tiny Llama (prepare_model's ``tiny`` source) and its pre-tokenised ids:
    (model dir, tokenised dir), as the rules produce them."""
    settings = demo_settings("topics_demo")
    data, _ = run_normalise("topics_demo", settings, run_download("topics_demo", settings, tmp), tmp)
    tiny = {"name": "tiny", "source": "tiny", "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                                                      "num_heads": 4, "vocab_size": 300, "seed": 0}}
    assert prepare_model.main(["--model", json.dumps(tiny), "--out", str(tmp / "model"), "--corpus", str(data)]) == 0
    tokenised = tmp / "tokenised"
    assert pretokenise.main(["--model", str(tmp / "model"), "--data", str(data), "--task", "classification",
                             "--variant", json.dumps(CLASSIFIER_VARIANT), "--max-length", str(CLASSIFIER_MAX_LENGTH),
                             "--out", str(tokenised), "--report", str(tmp / "tokenise_report.json")]) == 0
    return tmp / "model", tokenised


def build_masked_lm_data(tmp: Path) -> tuple[Path, Path]:
    """tests/test_masked_lm_chain.py's learnable corpus and tiny BERT (with its WordPiece tokenizer),
    normalised and pre-tokenised into blocks: (model dir, tokenised dir)."""
    from test_masked_lm_chain import MAX_LENGTH, VARIANT, corpus, save_tiny_bert

    source = tmp / "corpus"
    source.mkdir()
    lines = corpus(200, seed=1)
    (source / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (source / "test.txt").write_text("\n".join(corpus(20, seed=2)) + "\n", encoding="utf-8")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(source)}, "format": "text",
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy",
                "contamination": {"accept": True}}  # a few facts, repeated by design (test_masked_lm_chain)
    data, _ = run_normalise("lines", settings, run_download("lines", settings, tmp), tmp)
    save_tiny_bert(lines, tmp / "model")
    tokenised = tmp / "tokenised"
    assert pretokenise.main(["--model", str(tmp / "model"), "--data", str(data), "--task", "masked_lm",
                             "--variant", json.dumps(VARIANT), "--max-length", str(MAX_LENGTH), "--out", str(tokenised),
                             "--report", str(tmp / "tokenise_report.json")]) == 0
    return tmp / "model", tokenised


def refused(call, check: str) -> str:
    """The PreflightError ``call`` raises: its check name, and a message with a cause and a fix."""
    with pytest.raises(PreflightError) as caught:
        call()
    message = str(caught.value)
    assert caught.value.check == check and message.startswith(f"{check}: ") and ". Fix: " in message, message
    return message


# --- classification: the checks on a model built here ---
def tiny_classifier(kind: str, labels=LABELS):
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "pad_token_id": 0, **classification.model_kwargs(labels)}
    if kind == "llama":
        return LlamaForSequenceClassification(LlamaConfig(num_key_value_heads=4, **shape))
    return BertForSequenceClassification(BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **shape))


def peft_classifier(kind: str = "llama", task_type: str | None = "SEQ_CLS", labels=LABELS):
    """As training_setup.build makes it: the task's prepare_model, then LoRA with the task's PEFT type."""
    model = tiny_classifier(kind, labels)
    classification.TASK.prepare_model(model, 0, {"labels": labels})
    return model_loading.add_lora(model, LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules=LORA[kind]),
                                  False, task_type)


def head(peft_model) -> torch.nn.Module:
    (_, module), = classification.classification_heads(peft_model)
    return module


def batch(labels, rows=None) -> dict:
    ids = torch.arange(1, 1 + 5 * len(labels)).reshape(len(labels), 5) % 60 + 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor(labels),
            "target_tokens": len(labels), "row_ids": rows or [f"train-{k}" for k in range(len(labels))]}


def backward(peft_model, labels=(0, 1, 2, 1)) -> None:
    classification.TASK.loss_module(peft_model)(batch(list(labels))).backward()


@pytest.mark.parametrize("kind, name", [("llama", "score"), ("bert", "classifier")])
def test_a_healthy_classifier_passes_every_check(kind, name):
    task = classification.TASK
    model = peft_classifier(kind)
    assert task.check_tokenizer(None) is None  # classification has no tokenizer check
    assert f"'{name}' trainable and saved" in task.check_model(model, {"labels": LABELS}, {})
    assert "class ids within 0..2" in task.check_batch(batch([0, 1, 2, 2]), None, model)
    backward(model)
    assert "finite, non-zero gradients" in task.check_gradients(model, {})


def test_head_frozen_after_peft_is_refused():
    model = peft_classifier()
    head(model).requires_grad_(False)  # seed: the head frozen after PEFT made its copy trainable
    message = refused(lambda: classification.TASK.check_model(model, {"labels": LABELS}, {}), "classification_model")
    assert "'score' is frozen" in message and "score.weight" in message


def test_head_outside_modules_to_save_is_refused():
    model = peft_classifier(task_type=None)  # not SEQ_CLS: PEFT neither trains nor saves the new head
    assert not any("score" in name for name in model.state_dict() if "modules_to_save" in name)
    message = refused(lambda: classification.TASK.check_model(model, {"labels": LABELS}, {}), "classification_model")
    assert "'score' is not in the adapter's modules_to_save" in message and "task type SEQ_CLS (not None)" in message


def test_head_that_seq_cls_does_not_name_is_refused():
    """PEFT's SEQ_CLS saves only modules named 'classifier' or 'score'; BART's is 'classification_head'."""
    from transformers import BartConfig, BartForSequenceClassification

    torch.manual_seed(0)
    model = BartForSequenceClassification(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=1,
        **classification.model_kwargs(LABELS)))
    lora = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj"))
    message = refused(lambda: classification.TASK.check_model(model_loading.add_lora(model, lora, False, "SEQ_CLS"),
                                                              {"labels": LABELS}, {}), "classification_model")
    assert "'classification_head' is not in the adapter's modules_to_save" in message
    assert "list 'classification_head' in training.lora.modules_to_save" in message
    fixed = model_loading.add_lora(BartForSequenceClassification(model.config),
                                   dataclasses.replace(lora, modules_to_save=("classification_head",)), False, "SEQ_CLS")
    assert "'classification_head' trainable and saved" in classification.TASK.check_model(fixed, {"labels": LABELS}, {})


def test_head_sized_for_another_label_set_is_refused():
    model = peft_classifier()
    four = [*LABELS, "politics"]  # tokenise_meta.json's label set is not the one the head was built for
    message = refused(lambda: classification.TASK.check_model(model, {"labels": four}, {}), "classification_model")
    assert "outputs 3 classes" in message and "label set has 4" in message


def test_id2label_other_than_the_label_set_is_refused():
    model = peft_classifier()
    model.config.id2label = dict(enumerate(reversed(LABELS)))
    message = refused(lambda: classification.TASK.check_model(model, {"labels": LABELS}, {}), "classification_model")
    assert "id2label" in message and "weather" in message


@pytest.mark.parametrize("labels, ids", [([0, 3, 1, 7], "[3, 7]"), ([0, -100, 1, 2], "[-100]")])
def test_class_id_outside_the_head_is_refused_naming_ids_and_rows(labels, ids):
    task = classification.TASK
    rows = ["a-0", "a-1", "a-2", "a-3"]
    message = refused(lambda: task.check_batch(batch(labels, rows), None, peft_classifier()), "classification_batch")
    bad_rows = [row for row, label in zip(rows, labels) if not 0 <= label < 3]
    assert f"class ids {ids} are outside the model's 3 classes" in message and str(bad_rows) in message
    # The head's size is read from the model (a 2-class head: id 2 is outside too).
    two = peft_classifier(labels=LABELS[:2])
    message = refused(lambda: task.check_batch(batch([0, 1, 2], rows[:3]), None, two), "classification_batch")
    assert "class ids [2] are outside the model's 2 classes (0..1) in rows ['a-2']" in message


@pytest.mark.parametrize("plant, expected", [("none", "got no gradient"), ("zero", "got an all-zero gradient")])
def test_no_gradient_on_the_head_is_refused(plant, expected):
    model = peft_classifier()
    weight = dict(head(model).named_parameters())["modules_to_save.default.weight"]
    if plant == "zero":  # e.g. logits replaced by something the head does not produce
        weight.register_hook(torch.zeros_like)
        backward(model)
    message = refused(lambda: classification.TASK.check_gradients(model, {}), "classification_gradients")
    assert expected in message and "score.weight" in message


# --- masked LM: each batch / tokenizer check with its planted fault ---
@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    model_dir, tokenised = build_masked_lm_data(tmp_path_factory.mktemp("mlm"))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    meta = json.loads((tokenised / "tokenise_meta.json").read_text())
    rows = list(load_from_disk(str(tokenised / "train")).select(range(6)))
    good = masked_lm.TASK.collator(meta, len(tokenizer), seed=0)(rows)
    assert "masked tokens" in masked_lm.TASK.check_batch(good, tokenizer, None)
    return model_dir, tokenised, tokenizer, good


def planted(good: dict, labels: torch.Tensor) -> dict:
    """``good`` with other labels; target_index follows them, as a collator making such labels would."""
    return {**good, "labels": labels, "target_index": (labels != -100).reshape(-1).nonzero().squeeze(1)}


def test_tokenizer_without_mask_token_is_refused(mlm):
    from transformers import PreTrainedTokenizerFast

    _, _, tokenizer, _ = mlm
    assert "[MASK]" in masked_lm.TASK.check_tokenizer(tokenizer)
    no_mask = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, pad_token="[PAD]")
    message = refused(lambda: masked_lm.TASK.check_tokenizer(no_mask), "masked_lm_tokenizer")
    assert "no mask token" in message


def test_batch_with_nothing_masked_is_refused(mlm):
    _, _, tokenizer, good = mlm
    message = refused(lambda: masked_lm.TASK.check_batch(planted(good, torch.full_like(good["labels"], -100)), tokenizer, None),
                      "masked_lm_batch")
    assert "no token is masked" in message and good["row_ids"][0] in message


def test_labels_on_unmasked_positions_are_refused(mlm):
    _, _, tokenizer, good = mlm
    plain = (good["attention_mask"] == 1) & ~torch.isin(good["input_ids"], torch.tensor(tokenizer.all_special_ids))
    causal_style = torch.where(plain, good["input_ids"], -100)  # every token labelled, as a causal-LM collator does
    message = refused(lambda: masked_lm.TASK.check_batch(planted(good, causal_style), tokenizer, None), "masked_lm_batch")
    assert "labels sit on unmasked positions" in message


def test_masked_special_token_is_refused(mlm):
    _, _, tokenizer, good = mlm
    labels = good["labels"].clone()
    labels[:, 0] = tokenizer.cls_token_id  # each block starts with [CLS]
    message = refused(lambda: masked_lm.TASK.check_batch(planted(good, labels), tokenizer, None), "masked_lm_batch")
    assert f"special token id {tokenizer.cls_token_id} is masked" in message


def test_labels_on_padding_are_refused(mlm):
    _, _, tokenizer, good = mlm
    padded = {**good, "attention_mask": good["attention_mask"].clone()}
    first_target = int(good["target_index"][0])
    padded["attention_mask"].view(-1)[first_target] = 0  # a labelled position the model does not attend to
    message = refused(lambda: masked_lm.TASK.check_batch(padded, tokenizer, None), "masked_lm_batch")
    assert "padding positions carry labels" in message


# --- the sanity stage end to end on a classifier ---
@pytest.fixture(scope="module")
def classifier_data(tmp_path_factory):
    return build_classification_data(tmp_path_factory.mktemp("topics"))


def gate_argv(model_dir, tokenised, out: Path) -> list[str]:
    settings = tiny_training_settings(max_length=CLASSIFIER_MAX_LENGTH, effective_batch=16, micro_batch=8,
                                      sanity_batches=1, lora={"target_modules": LORA["llama"]})
    return ["--model", str(model_dir), "--data", str(tokenised), "--training", training_json(settings), "--seed", "1",
            "--out", str(out)]


def test_the_gate_passes_a_classifier_and_reports_the_task_checks(tmp_path, classifier_data):
    out = tmp_path / "sanity.json"
    assert sanity.main(gate_argv(*classifier_data, out)) == 0
    checks = {c["name"]: c["detail"] for c in json.loads(out.read_text())["checks"]}
    assert {"classification_model", "classification_batch", "classification_gradients"} <= set(checks)
    assert "classification_tokenizer" not in checks  # the task has no tokenizer check (None: not reported)
    assert "'score' trainable and saved" in checks["classification_model"]
    assert "class ids within 0..2" in checks["classification_batch"]


def freeze_head(monkeypatch):
    original = training_setup.build

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)
        head(setup.peft_model).requires_grad_(False)
        return setup

    monkeypatch.setattr(training_setup, "build", build)


def zero_head_gradient(monkeypatch):
    original = training_setup.build

    def build(*args, **kwargs):
        setup = original(*args, **kwargs)
        for parameter in head(setup.peft_model).modules_to_save.parameters():
            parameter.register_hook(torch.zeros_like)
        return setup

    monkeypatch.setattr(training_setup, "build", build)


def shift_labels(monkeypatch):
    """A collator bug: class ids one too high (the last class becomes id 3 of a 3-class head)."""
    task = classification.TASK
    original = type(task).collator

    def collator(meta, vocab_size, **kwargs):
        inner = original(task, meta, vocab_size, **kwargs)

        def shifted(rows):
            made = inner(rows)
            return {**made, "labels": made["labels"] + 1}
        return shifted

    monkeypatch.setattr(task, "collator", collator)


@pytest.mark.parametrize("plant, check, cause", [
    (freeze_head, "classification_model", "the classification head 'score' is frozen"),
    (shift_labels, "classification_batch", "class ids [3] are outside the model's 3 classes (0..2) in rows ['"),
    (zero_head_gradient, "classification_gradients", "score.weight got an all-zero gradient"),
], ids=["head_frozen", "label_out_of_range", "head_gradient_zero"])
def test_the_gate_stops_a_classifier_with_a_planted_fault(monkeypatch, capsys, tmp_path, classifier_data,
                                                          plant, check, cause):
    plant(monkeypatch)
    out = tmp_path / "sanity.json"
    with pytest.raises(SystemExit) as exited:  # as `python -m workflow_scripts.sanity` ends
        run_main(sanity.main, gate_argv(*classifier_data, out))
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: {check}: ") and cause in error and ". Fix: " in error, error
    assert not out.exists()  # a failed gate leaves no report
