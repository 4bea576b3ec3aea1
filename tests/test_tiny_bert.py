"""The masked-LM demo: the generated corpus (``make_corpus``) and the tiny random BERT built from it
(``model/tiny_bert``), then the real stages in-process (download -> normalise -> pretokenise -> train
-> evaluate) showing that LoRA on it learns the corpus under both masking variants."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_training_settings, training_json
from data_helpers import run_download, run_normalise
from workflow_scripts import evaluate, pretokenise, sanity, train
from workflow_scripts.demo import make_corpus
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model import tiny_bert

# The demo's tiny-bert (config/config.yaml's models.tiny-bert.tiny).
TINY = {"architecture": "bert", "hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4,
        "vocab_size": 500, "seed": 0}
LORA = {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["query", "key", "value", "dense"],
        "modules_to_save": ["cls"]}  # a random base: its MLM head has to learn too
MAX_LENGTH = 64
# One line per row: a random frozen BERT has no attention pattern that keeps to a line inside a
# block, so in blocks of several unrelated lines it stays near the unigram guess for 300 steps.
VARIANTS = {"tokens": {"mask_rate": 0.15, "grouping": "lines"}, "whole_word": {"whole_word": True, "grouping": "lines"}}
EVALUATION = {"split": "test", "max_new_tokens": 1, "batch_size": 64, "max_examples": None, "gpus": 0,
              "max_length": MAX_LENGTH}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The generated corpus, downloaded and normalised as the rules do, and the tiny BERT built on it."""
    torch.set_num_threads(1)  # the test machines' cores are shared
    tmp = tmp_path_factory.mktemp("tiny_bert")
    assert make_corpus.main(["--out", str(tmp / "corpus")]) == 0
    settings = {"task": "masked_lm", "source": {"type": "local", "path": str(tmp / "corpus")}, "format": "text",
                "splits": {"train": "train", "validation": "validation", "test": "test"}, "metric": "masked_accuracy"}
    data, _ = run_normalise("corpus", settings, run_download("corpus", settings, tmp), tmp)
    facts = tiny_bert.build(TINY, [data], tmp / "model")
    return tmp, data, facts


def test_the_corpus_is_deterministic_and_its_test_lines_are_held_out(tmp_path):
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        assert make_corpus.main(["--out", str(tmp_path / name), "--seed", str(seed)]) == 0
    files = {name: {p.name: p.read_bytes() for p in (tmp_path / name).iterdir()} for name in "abc"}
    assert sorted(files["a"]) == ["test.txt", "train.txt", "validation.txt"]
    assert files["a"] == files["b"] and files["a"]["train.txt"] != files["c"]["train.txt"]
    lines = {name.removesuffix(".txt"): text.decode().splitlines() for name, text in files["a"].items()}
    assert {split: len(rows) for split, rows in lines.items()} == make_corpus.SPLIT_SIZES
    # normalise refuses validation/test lines that repeat train lines (contamination)
    assert not (set(lines["test"]) | set(lines["validation"])) & set(lines["train"])
    assert all(8 <= len(line.split()) <= 20 and line == line.strip().lower()
               for rows in lines.values() for line in rows)


def test_the_build_is_byte_identical_for_the_same_seed_and_corpus(corpus, tmp_path):
    tmp, data, facts = corpus
    again = tiny_bert.build(TINY, [data], tmp_path / "again")
    first = {p.name: p.read_bytes() for p in sorted((tmp / "model").iterdir())}
    assert first == {p.name: p.read_bytes() for p in sorted((tmp_path / "again").iterdir())}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(first)
    assert again == facts and facts["vocab_size"] == facts["requested_vocab_size"] == 500
    other = tiny_bert.build({**TINY, "seed": 1}, [data], tmp_path / "other")
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != first["model.safetensors"]
    # Only the weights are seeded; the tokenizer depends on the corpus alone.
    assert (tmp_path / "other" / "tokenizer.json").read_bytes() == first["tokenizer.json"]
    assert other["parameters"] == facts["parameters"]


def test_it_loads_offline_as_a_bert_masked_lm_with_its_special_tokens(corpus):
    from transformers import AutoModelForMaskedLM, AutoTokenizer, BertForMaskedLM

    from workflow_scripts.prepare_model import check_model_dir

    tmp, _, facts = corpus
    check_model_dir(tmp / "model", "tiny bert")
    tokenizer = AutoTokenizer.from_pretrained(str(tmp / "model"), local_files_only=True)
    model = AutoModelForMaskedLM.from_pretrained(str(tmp / "model"), local_files_only=True)
    assert isinstance(model, BertForMaskedLM) and tokenizer.is_fast
    assert model.config.vocab_size == len(tokenizer) == facts["vocab_size"]
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.num_attention_heads,
            model.config.intermediate_size) == (128, 2, 4, 256)
    assert model.config.max_position_embeddings >= 512 and tokenizer.model_max_length >= 512
    assert facts["parameters"] == sum(p.numel() for p in model.parameters())
    specials = [tokenizer.pad_token, tokenizer.unk_token, tokenizer.cls_token, tokenizer.sep_token, tokenizer.mask_token]
    assert specials == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and tokenizer.mask_token_id is not None
    assert model.config.pad_token_id == tokenizer.pad_token_id
    encoding = tokenizer("The CAT drinks milk")
    ids = encoding["input_ids"]
    assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id  # the post-processor's template
    assert tokenizer.convert_ids_to_tokens(ids[1:-1]) == tokenizer.tokenize("the cat drinks milk")  # uncased
    assert tokenizer.unk_token_id not in ids
    pair = tokenizer("the cat", "the dog")
    assert pair["input_ids"].count(tokenizer.sep_token_id) == 2
    assert pair["token_type_ids"][0] == 0 and pair["token_type_ids"][-1] == 1
    # WordPiece continuation pieces: what whole-word masking keeps together
    assert len(tokenizer.tokenize("133")) > 1 and tokenizer.tokenize("133")[1].startswith("##")
    with torch.no_grad():
        logits = model(**tokenizer(f"the cat drinks {tokenizer.mask_token}", return_tensors="pt")).logits
    assert logits.shape[-1] == len(tokenizer)


def test_its_tokenizer_learns_the_text_but_not_the_row_ids(corpus):
    _, data, _ = corpus
    texts = list(tiny_bert.corpus_texts([data]))
    assert len(texts) == make_corpus.SPLIT_SIZES["train"] and not any(t.startswith("train-") for t in texts)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 100, "num_heads": 8}, "not divisible by model.tiny.num_heads"),
    ({"architecture": "llama"}, "built by tiny_model"),
])
def test_bad_settings_are_refused_by_key(corpus, tmp_path, change, message):
    _, data, _ = corpus
    with pytest.raises(WorkflowError, match=message):
        tiny_bert.build({**TINY, **change}, [data], tmp_path / "model")


def test_the_vocabulary_follows_the_counts_not_their_order():
    counts = {"low": 5, "lower": 2, "newest": 6, "widest": 3}
    vocab = tiny_bert.learn_vocabulary(counts, 20)
    assert vocab == tiny_bert.learn_vocabulary(dict(reversed(counts.items())), 20)
    alphabet = ["##d", "##e", "##i", "##o", "##r", "##s", "##t", "##w", "l", "n", "w"]
    # Most frequent pair first; "##e ##s" and "##s ##t" (9 each) tie, as do "##o ##w" and "l ##o" (7):
    # the pair whose text sorts first wins.
    assert vocab == [*tiny_bert.SPECIAL_TOKENS, *alphabet, "##es", "##est", "##ow", "low"]
    everything = tiny_bert.learn_vocabulary(counts, 100)
    assert len(everything) == 28 and {"lower", "newest", "widest"} <= set(everything)  # merges ran out


def test_no_corpus_is_refused(tmp_path):
    with pytest.raises(WorkflowError, match="needs --corpus"):
        tiny_bert.build(TINY, [], tmp_path / "model")


@pytest.fixture(scope="module")
def untrained(corpus):
    tmp, data, _ = corpus
    return run_evaluate(tmp, data, "base", VARIANTS["tokens"], None)


def run_evaluate(tmp, data, name: str, variant: dict, adapter) -> dict:
    out = tmp / "eval" / name
    argv = ["--model", str(tmp / "model"), "--data", str(data), "--task", "masked_lm", "--variant", json.dumps(variant),
            "--metric", "masked_accuracy", "--evaluation", json.dumps(EVALUATION), "--dataset-name", "corpus",
            "--variant-name", name, "--seed", "base" if adapter is None else "1",
            "--predictions-out", str(out / "predictions.jsonl"), "--summary-out", str(out / "eval.json")]
    assert evaluate.main(argv + (["--adapter", str(adapter)] if adapter else [])) == 0
    return json.loads((out / "eval.json").read_text())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_lora_learns_the_corpus_under_both_masking_variants(corpus, untrained, name):
    """The demo's numbers (300 steps at batch 16): untrained ~0.00, trained ~0.5 masked accuracy."""
    from datasets import load_from_disk

    tmp, data, _ = corpus
    variant = VARIANTS[name]
    tokenised = tmp / "tokenised" / name
    assert pretokenise.main(["--model", str(tmp / "model"), "--data", str(data), "--task", "masked_lm",
                             "--variant", json.dumps(variant), "--max-length", str(MAX_LENGTH), "--out", str(tokenised),
                             "--report", str(tmp / f"tokenise_report_{name}.json")]) == 0
    rows = load_from_disk(str(tokenised / "train"))[:200]
    # Some words are several pieces, so whole-word masking differs from token masking here.
    assert any(not start and not special for starts, specials in zip(rows["word_start"], rows["special_tokens_mask"])
               for start, special in zip(starts, specials))
    # The demo's settings but one micro-batch per step and no recomputation: the same steps, faster.
    settings = tiny_training_settings(max_steps=300, learning_rate=3e-3, effective_batch=16, micro_batch=16,
                                      warmup_steps=10, max_length=MAX_LENGTH, checkpoint_every=100, log_every=50,
                                      gradient_checkpointing=False, lora=LORA)
    run = tmp / "runs" / name
    assert sanity.main(["--model", str(tmp / "model"), "--data", str(tokenised), "--training", training_json(settings),
                        "--seed", "1", "--out", str(run / "sanity.json")]) == 0  # the gate, masked_lm checks included
    assert train.main(["--model", str(tmp / "model"), "--data", str(tokenised), "--training", training_json(settings),
                       "--seed", "1", "--checkpoint-dir", str(run / "checkpoints"),
                       "--adapter-out", str(run / "adapter"), "--log-out", str(run / "train_log.jsonl"),
                       "--manifest-out", str(run / "run_manifest.json")]) == 0
    trained = run_evaluate(tmp, data, name, variant, run / "adapter")
    assert trained["masked_tokens"] == untrained["masked_tokens"]  # the same fixed evaluation mask
    assert untrained["score"] < 0.02, untrained["score"]
    assert trained["score"] > untrained["score"] + 0.3, (trained["score"], untrained["score"])
    assert trained["scores"]["perplexity"] < untrained["scores"]["perplexity"] / 20
