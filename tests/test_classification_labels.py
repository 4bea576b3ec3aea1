"""A trained classifier evaluated on a dataset other than its own: its head keeps the label set it was trained on.

The label set travels with the weights (``id2label`` in the ``config.json`` beside a LoRA adapter or in a full
model's own); evaluate builds the head with it, so a dataset that declares the same classes in another order
is scored by class name, and one with other classes is refused. Tiny random Llama, its own tokenizer (offline).
"""
from __future__ import annotations

import json

import pytest
import torch

from workflow_scripts.core.section_settings import EvaluationSettings
from workflow_scripts import evaluate
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model import model_loading
from workflow_scripts.tasks import classification
from workflow_scripts.tasks.classification import TASK
from data_helpers import typed_variant

TRAINED = ["negative", "positive"]
TEXTS = ["the film was dull and far too long", "a warm and funny story", "I loved every minute of it",
         "the plot made no sense at all", "great acting, great music", "boring", "a masterpiece of its kind",
         "the worst film of the year", "charming and clever", "I left before the end"]
VARIANT = {"input": "Review: {text}"}
EVALUATION = {"split": "test", "max_new_tokens": 8, "batch_size": 4, "max_examples": None, "gpus": 0, "max_length": 32}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A prepared base model directory: a causal Llama (the head is new at load) and a byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("model")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([f"Review: {text}" for text in TEXTS] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def classifier(model_dir, labels=TRAINED):
    """The base model with a fresh head for ``labels``, as training builds it."""
    tokenizer = model_loading.load_tokenizer(model_dir)
    model = model_loading.load_base_model(model_dir, torch.device("cpu"), torch.float32,
                                          auto_class=TASK.auto_model_class, model_kwargs=TASK.model_kwargs({"labels": labels}))
    TASK.prepare_model(model, tokenizer.pad_token_id, {"labels": labels})
    return model, tokenizer


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """A LoRA adapter (head saved with it, as train saves it), a fully fine-tuned model, and the classes each
    predicts for TEXTS (the gold of the 'own' dataset below, so each scores 1.0 on its own label order)."""
    from peft import LoraConfig, get_peft_model

    rows = [{"id": f"r{k}", "text": text, "label": TRAINED[0]} for k, text in enumerate(TEXTS)]
    model, tokenizer = classifier(model_dir)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  modules_to_save=["score"], init_lora_weights=False,
                                                  task_type=TASK.peft_task_type))
    with torch.no_grad():  # a head far from the random one a load would draw: its class ids matter
        peft_model.base_model.model.score.modules_to_save["default"].weight.normal_(0, 2.0)
    adapter = tmp_path_factory.mktemp("adapter")
    model_loading.save_adapter(peft_model, adapter)
    full_model, _ = classifier(model_dir)
    with torch.no_grad():
        full_model.score.weight.normal_(0, 2.0)
    full = tmp_path_factory.mktemp("full")
    model_loading.save_full_model(full_model, full)
    predicted = {}
    for name, model in (("adapter", peft_model.eval()), ("full", full_model.eval())):
        result = TASK.predict(model, tokenizer, TASK.check_variant(typed_variant(VARIANT, "classification")), rows, "accuracy", EvaluationSettings.parse(EVALUATION),
                              torch.device("cpu"))
        predicted[name] = [record["predicted"] for record in result.records]
    return {"adapter": adapter, "full": full}, predicted


def normalised(directory, labels, golds):
    from datasets import Dataset, DatasetDict

    split = Dataset.from_dict({"id": [f"r{k}" for k in range(len(TEXTS))], "text": TEXTS, "label": list(golds)})
    DatasetDict({"train": split, "test": split}).save_to_disk(str(directory))
    (directory / "task_meta.json").write_text(json.dumps({"task": "classification", "labels": labels}))
    return directory


def run_evaluate(tmp_path, model_dir, data, trained_dir, name, dataset="reviews"):
    out = tmp_path / name
    assert evaluate.main(["--model", str(model_dir), "--adapter", str(trained_dir), "--data", str(data),
                          "--task", "classification", "--variant", json.dumps(VARIANT), "--metric", "accuracy",
                          "--evaluation", json.dumps(EVALUATION), "--dataset-name", dataset, "--variant-name", "plain",
                          "--seed", "1", "--predictions-out", str(out / "predictions.jsonl"),
                          "--summary-out", str(out / "eval.json")]) == 0
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return json.loads((out / "eval.json").read_text()), [record["predicted"] for record in records]


@pytest.mark.parametrize("kind", ["adapter", "full"])
def test_a_dataset_declaring_the_classes_in_another_order_is_scored_by_class_name(kind, tmp_path, model_dir, trained):
    """A head trained on [negative, positive] scores 1.0 on its own data; a dataset declaring [positive, negative]
    with the same rows and labels must score the same, not have every prediction relabelled (0.0)."""
    directories, predicted = trained
    golds = predicted[kind]
    assert classification.trained_label_set(directories[kind]) == TRAINED
    own, own_predictions = run_evaluate(tmp_path, model_dir, normalised(tmp_path / "own", TRAINED, golds),
                                        directories[kind], "own")
    swapped, swapped_predictions = run_evaluate(
        tmp_path, model_dir, normalised(tmp_path / "swapped", list(reversed(TRAINED)), golds), directories[kind],
        "swapped", dataset="reviews_swapped")
    assert own["score"] == 1.0 and own_predictions == golds
    assert swapped_predictions == own_predictions and swapped["score"] == own["score"] == 1.0
    assert swapped["macro_f1"] == own["macro_f1"] and swapped["confusion_matrix"] == own["confusion_matrix"]


@pytest.mark.parametrize("kind", ["adapter", "full"])
def test_a_dataset_with_other_classes_is_refused_naming_both_sets_and_the_dataset(kind, tmp_path, model_dir, trained):
    directories, _ = trained
    data = normalised(tmp_path / "other_data", ["negative", "neutral"], ["neutral"] * len(TEXTS))
    with pytest.raises(WorkflowError, match=r"dataset 'sentiment3' has the label set \['negative', 'neutral'\].*"
                                            r"trained on \['negative', 'positive'\]") as caught:
        run_evaluate(tmp_path, model_dir, data, directories[kind], "other", dataset="sentiment3")
    assert "datasets.sentiment3.labels" in str(caught.value) and str(directories[kind]) in str(caught.value)
    assert not (tmp_path / "other").joinpath("eval.json").exists() and not (tmp_path / "other" / "predictions.jsonl").exists()


def test_an_adapter_without_its_label_set_is_refused(tmp_path, model_dir, trained):
    """An adapter saved without config.json (before the label set was stored) cannot name its class ids."""
    import shutil

    directories, _ = trained
    bare = tmp_path / "bare"
    shutil.copytree(directories["adapter"], bare)
    (bare / "config.json").unlink()
    data = normalised(tmp_path / "data", TRAINED, ["negative"] * len(TEXTS))
    with pytest.raises(WorkflowError, match="no config.json, so the label set the classifier was trained on is unknown"):
        run_evaluate(tmp_path, model_dir, data, bare, "bare_out")
