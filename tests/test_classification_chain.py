"""A classification dataset through the stages as the rules call them: normalise -> pretokenise ->
sanity -> train -> evaluate, on the demo's topics data and a tiny Llama with a sequence-classification head."""
import json

import pytest
import torch

from conftest import tiny_training_settings, training_json
from data_helpers import demo_settings, run_download, run_normalise
from workflow_scripts import evaluate, prepare_model, pretokenise, sanity, train

VARIANT = {"input": "Which topic: {text}"}
EVALUATION = {"split": "test", "max_new_tokens": 8, "batch_size": 16, "max_examples": None, "gpus": 0,
              "evaluate_base_model": True, "max_length": 48}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("topics")
    settings = demo_settings("topics_demo")
    data, report = run_normalise("topics_demo", settings, run_download("topics_demo", settings, tmp), tmp)
    tiny = {"name": "tiny", "source": "tiny", "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                                                      "num_heads": 4, "vocab_size": 300, "seed": 0}}
    assert prepare_model.main(["--model", json.dumps(tiny), "--out", str(tmp / "model"), "--corpus", str(data)]) == 0
    tokenised = tmp / "tokenised"
    assert pretokenise.main(["--model", str(tmp / "model"), "--data", str(data), "--task", "classification",
                             "--variant", json.dumps(VARIANT), "--max-length", "48", "--out", str(tokenised),
                             "--report", str(tmp / "tokenise_report.json")]) == 0
    return tmp, data, report, tokenised


def test_normalise_reports_labels_class_balance_and_unknown_test_labels(chain):
    _, data, report, _ = chain
    report = json.loads(report.read_text())
    assert report["labels"] == ["food", "sport", "weather"]
    assert set(report["class_balance"]["train"]) == {"food", "sport", "weather"}
    assert report["splits"]["test"]["reasons"].get("unknown_label") == 1  # the demo's planted 'politics'
    assert json.loads((data / "task_meta.json").read_text()) == {"task": "classification",
                                                                 "labels": ["food", "sport", "weather"]}


def test_gate_train_and_evaluate_a_classifier(chain):
    tmp, data, _, tokenised = chain
    meta = json.loads((tokenised / "tokenise_meta.json").read_text())
    assert meta["task"] == "classification" and meta["num_labels"] == 3
    settings = tiny_training_settings(max_steps=80, learning_rate=1e-2, effective_batch=16, micro_batch=8,
                                      max_length=48, lora={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "gate_proj", "up_proj", "down_proj"]})
    common = ["--model", str(tmp / "model"), "--data", str(tokenised), "--training", training_json(settings), "--seed", "1"]
    assert sanity.main([*common, "--out", str(tmp / "sanity.json")]) == 0
    gate = json.loads((tmp / "sanity.json").read_text())
    assert gate["passed"] and {c["name"] for c in gate["checks"]} >= {"trainable_parameters", "gradients", "data_scan"}
    out = tmp / "run"
    assert train.main([*common, "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
                       "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")]) == 0
    from safetensors.torch import load_file

    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert any("score" in name for name in saved)  # the new head is trained and saved with the adapter
    # ... and its label set beside it, as transformers saves a model's (evaluate builds the head with it)
    assert json.loads((out / "adapter" / "config.json").read_text())["id2label"] == {"0": "food", "1": "sport", "2": "weather"}

    def run_evaluate(name, adapter):
        argv = ["--model", str(tmp / "model"), "--data", str(data), "--task", "classification",
                "--variant", json.dumps(VARIANT), "--metric", "accuracy", "--evaluation", json.dumps(EVALUATION),
                "--dataset-name", "topics_demo", "--variant-name", "framed", "--seed", name,
                "--predictions-out", str(tmp / name / "predictions.jsonl"), "--summary-out", str(tmp / name / "eval.json")]
        assert evaluate.main(argv + (["--adapter", str(adapter)] if adapter else [])) == 0
        return json.loads((tmp / name / "eval.json").read_text())

    trained, untrained = run_evaluate("1", out / "adapter"), run_evaluate("base", None)
    assert trained["task"] == "classification" and set(trained["confusion_matrix"]) == {"food", "sport", "weather"}
    assert trained["score"] > untrained["score"] + 0.2 and trained["score"] > 0.6, (trained["score"], untrained["score"])
