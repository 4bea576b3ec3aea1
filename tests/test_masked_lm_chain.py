"""A plain-text corpus through the stages as the rules call them, task masked_lm: download -> normalise ->
pretokenise -> sanity -> train -> evaluate, then the comparison's reading and paired bootstrap of the
per-line records. A tiny random BERT with a WordPiece tokenizer trained on the corpus (built here,
saved as a model directory) stands in for a pretrained masked LM."""
from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest
import torch

from conftest import tiny_training_settings, training_json
from data_helpers import run_download, run_normalise
from workflow_scripts import compare, evaluate, pretokenise, sanity, train
from workflow_scripts.analysis import paired_bootstrap
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.tasks import task_named

# Learnable: each animal always comes with its own verb, food and place, so a masked word is
# predictable from the rest of its line.
FACTS = {"cat": ("drinks", "milk", "kitchen"), "dog": ("chews", "bones", "garden"),
         "cow": ("eats", "grass", "field"), "bird": ("pecks", "seeds", "tree"),
         "fish": ("nibbles", "algae", "pond"), "horse": ("munches", "hay", "stable")}
VARIANT = {"mask_rate": 0.15, "grouping": "blocks"}
MAX_LENGTH = 32
EVALUATION = {"split": "test", "max_new_tokens": 1, "batch_size": 32, "max_examples": None, "gpus": 0,
              "max_length": MAX_LENGTH}


def corpus(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        animal = rng.choice(sorted(FACTS))
        verb, food, place = FACTS[animal]
        lines.append(f"the {animal} {verb} {food} in the {place}")
    return lines


def save_tiny_bert(lines: list[str], out) -> None:
    """A WordPiece tokenizer trained on the corpus and a random 2-layer BERT, saved as prepare_model would."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.train_from_iterator(lines, trainers.WordPieceTrainer(
        vocab_size=120, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id)
    BertForMaskedLM(config).save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("mlm")
    source = tmp / "corpus"
    source.mkdir()
    train_lines, test_lines = corpus(400, seed=1), corpus(60, seed=2)
    # train: gzip, with two blank lines (counted, never examples); test: plain text.
    with gzip.open(source / "train.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write("\n".join(train_lines[:200] + ["", "   "] + train_lines[200:]) + "\n")
    (source / "test.txt").write_text("\n".join(test_lines) + "\n", encoding="utf-8")
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(source)}, "format": "text",
                "splits": {"train": "train", "test": "test"}, "metric": "masked_accuracy",
                # a handful of facts, repeated by design (learnable in seconds): the test lines are train's
                "contamination": {"accept": True}}
    raw = run_download("lines", settings, tmp)
    data, report = run_normalise("lines", settings, raw, tmp)
    save_tiny_bert(train_lines, tmp / "model")
    tokenised = tmp / "tokenised"
    assert pretokenise.main(["--model", str(tmp / "model"), "--data", str(data), "--task", "masked_lm",
                             "--variant", json.dumps(VARIANT), "--max-length", str(MAX_LENGTH), "--out", str(tokenised),
                             "--report", str(tmp / "tokenise_report.json")]) == 0
    return tmp, data, json.loads(report.read_text()), tokenised


def test_download_and_normalise_count_lines(chain):
    tmp, data, report, _ = chain
    manifest = json.loads((tmp / "results" / "lines" / "download_manifest.json").read_text())
    assert manifest["rows"] == {"train": 400, "test": 60} and "train.txt.gz" in manifest["files"]
    assert report["task"] == "masked_lm"
    assert {k: report["splits"]["train"][k] for k in ("lines", "kept", "blank")} == {"lines": 402, "kept": 400, "blank": 2}
    assert report["splits"]["test"]["kept"] == 60
    assert json.loads((data / "task_meta.json").read_text()) == {"task": "masked_lm"}
    from datasets import load_from_disk

    rows = load_from_disk(str(data))["train"]
    assert rows.column_names == ["id", "text"] and rows[200]["id"] == "train-203"  # line numbers skip the blanks


def test_pretokenise_makes_blocks_with_the_mask_token(chain):
    tmp, _, _, tokenised = chain
    meta = json.loads((tokenised / "tokenise_meta.json").read_text())
    assert meta["task"] == "masked_lm" and meta["mask_token_id"] == 4
    split = json.loads((tmp / "tokenise_report.json").read_text())["splits"]["train"]
    assert split["dropped"] == 1 and split["max_length_seen"] == MAX_LENGTH  # one short remainder, blocks exact
    from datasets import load_from_disk

    blocks = load_from_disk(str(tokenised / "train"))
    assert set(blocks["length"]) == {MAX_LENGTH} and "+" in blocks[0]["id"]


def test_the_gate_runs_the_task_checks_and_refuses_an_unmasked_batch(chain):
    tmp, _, _, tokenised = chain
    settings = tiny_training_settings(max_steps=2, max_length=MAX_LENGTH, lora={"target_modules": ["query", "value"]})
    out = tmp / "gate.json"
    assert sanity.main(["--model", str(tmp / "model"), "--data", str(tokenised), "--training", training_json(settings),
                        "--seed", "1", "--out", str(out)]) == 0
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert {"masked_lm_tokenizer", "masked_lm_batch", "gradients"} <= set(checks)
    # The same hook refuses a batch in which nothing is masked.
    from transformers import AutoTokenizer

    from workflow_scripts.training.preflight_checks import PreflightError

    tokenizer = AutoTokenizer.from_pretrained(str(tmp / "model"))
    ids = torch.tensor([[2, 10, 11, 3]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100),
             "target_index": torch.tensor([], dtype=torch.long), "row_ids": ["x"]}
    with pytest.raises(PreflightError, match="masked_lm_batch"):
        task_named("masked_lm").check_batch(batch, tokenizer, None)


def test_full_training_in_a_variant_points_to_the_training_setting():
    from workflow_scripts.core.entry_settings import VariantSettings

    with pytest.raises(WorkflowError, match="'variants.v.finetune': how the model trains is a training setting.*"
                                            "training.finetune: full"):
        VariantSettings.from_json('{"finetune": "full"}', "masked_lm", "v")  # as pretokenise's --variant


def test_train_evaluate_and_compare(chain):
    tmp, data, _, tokenised = chain
    settings = tiny_training_settings(max_steps=60, learning_rate=3e-2, effective_batch=8, micro_batch=4,
                                      max_length=MAX_LENGTH, checkpoint_every=20, warmup_steps=2,
                                      lora={"rank": 8, "alpha": 16, "target_modules": ["query", "key", "value", "dense"],
                                            # A random base: its tied output layer has to learn too.
                                            "modules_to_save": ["cls"]})
    common = ["--model", str(tmp / "model"), "--data", str(tokenised), "--training", training_json(settings), "--seed", "1"]
    out = tmp / "run"
    assert train.main([*common, "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
                       "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses

    def run_evaluate(name, adapter):
        argv = ["--model", str(tmp / "model"), "--data", str(data), "--task", "masked_lm",
                "--variant", json.dumps(VARIANT), "--metric", "masked_accuracy", "--evaluation", json.dumps(EVALUATION),
                "--dataset-name", "lines", "--variant-name", "mlm", "--seed", name,
                "--predictions-out", str(tmp / name / "predictions.jsonl"), "--summary-out", str(tmp / name / "eval.json")]
        assert evaluate.main(argv + (["--adapter", str(adapter)] if adapter else [])) == 0
        return json.loads((tmp / name / "eval.json").read_text())

    trained, untrained = run_evaluate("1", out / "adapter"), run_evaluate("base", None)
    assert trained["n_examples"] == 60 and trained["masked_tokens"] == untrained["masked_tokens"]  # the fixed mask
    assert trained["score"] > untrained["score"] + 0.2, (trained["score"], untrained["score"])
    assert trained["scores"]["perplexity"] < untrained["scores"]["perplexity"]

    # The comparison reads the per-line counts and resamples lines (ratio of sums, not a mean of ratios).
    values = {name: compare.read_predictions(tmp / name / "predictions.jsonl", "masked_accuracy") for name in ("1", "base")}
    ids = sorted(values["1"])
    arrays = {name: np.array([values[name][i] for i in ids]) for name in values}
    assert arrays["1"].shape == (60, 2)
    assert paired_bootstrap.seed_mean("masked_accuracy", [arrays["1"]]) == pytest.approx(trained["score"])
    difference = paired_bootstrap.paired_difference("masked_accuracy", [arrays["1"]], [arrays["base"]], 200, 0)
    assert difference.low > 0 and difference.difference == pytest.approx(trained["score"] - untrained["score"])
    # compare.load_run's consistency check recomputes eval.json's score from the records the same way.
    from workflow_scripts.tasks import metrics

    for name, summary in (("1", trained), ("base", untrained)):
        recomputed = metrics.corpus_score("masked_accuracy", [metrics.ExampleScore(0.0, tuple(v)) for v in values[name].values()])
        assert recomputed == pytest.approx(summary["score"], abs=1e-12)
