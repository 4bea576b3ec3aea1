"""Generated inputs shared by the benchmarks: lengths that vary as real ones do, pre-tokenised sets in
the workflow's format (docs/architecture.md), question/answer text, a tokenizer and a tiny model.

Everything is seeded, so two runs of `make bench` see the same data.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

PAD_ID, EOS_ID = 0, 1


def long_tailed_lengths(rows: int, low: int, high: int, median: float, sigma: float, seed: int) -> np.ndarray:
    """Log-normal lengths clipped to [low, high]: most rows short, a long tail up to ``high``,
    which is how instruction and QA sets look (and what makes padding to the longest expensive)."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(median), sigma=sigma, size=rows)
    return np.clip(np.rint(lengths), low, high).astype(np.int32)


def length_summary(lengths: np.ndarray) -> dict[str, float]:
    q = np.percentile(lengths, [10, 50, 90, 99])
    return {"rows": int(lengths.size), "min": int(lengths.min()), "p10": float(q[0]), "median": float(q[1]),
            "p90": float(q[2]), "p99": float(q[3]), "max": int(lengths.max()), "mean": float(lengths.mean())}


def tokenised_table(lengths: np.ndarray, vocab_size: int, seed: int, prompt_share: float = 0.6):
    """A pyarrow table in the pre-tokenised format: id, input_ids, labels (-100 on the prompt), length.

    Built column-wise from flat numpy arrays, so two million rows take seconds, not minutes.
    """
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lengths = lengths.astype(np.int64)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = rng.integers(2, vocab_size, size=int(offsets[-1]), dtype=np.int32)
    ids[offsets[1:] - 1] = EOS_ID
    labels = ids.copy()
    # The first `prompt_share` of every row (at least one token, never the whole row) is prompt.
    prompt = np.clip((lengths * prompt_share).astype(np.int64), 1, lengths - 1)
    position = np.arange(ids.size, dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    labels[position < np.repeat(prompt, lengths)] = -100
    arrow_offsets = pa.array(offsets.astype(np.int32) if offsets[-1] < 2**31 else offsets)
    list_type = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
    return pa.table({
        "id": pa.array([f"row-{i}" for i in range(lengths.size)], pa.string()),
        "input_ids": list_type.from_arrays(arrow_offsets, pa.array(ids, pa.int32())),
        "labels": list_type.from_arrays(arrow_offsets, pa.array(labels, pa.int32())),
        "length": pa.array(lengths.astype(np.int32), pa.int32()),
    })


def save_tokenised(table, out: Path, vocab_size: int, max_length: int, model_dir: Path | None = None) -> Path:
    """Save ``table`` as the train split of a pre-tokenised set (save_to_disk) with its meta file; with
    ``model_dir``, recorded as tokenised by that model's tokenizer (sanity and train check the fingerprint)."""
    from datasets import Dataset, DatasetDict

    from workflow_scripts.data.fingerprints import tokenizer_fingerprint

    out = Path(out)
    DatasetDict({"train": Dataset(table)}).save_to_disk(str(out))
    fingerprint = tokenizer_fingerprint(Path(model_dir)) if model_dir is not None else "benchmark"
    meta = {"cache_key": "benchmark", "task": "generation", "tokenizer_fingerprint": fingerprint, "templates": {},
            "max_length": max_length, "input_fingerprint": "benchmark", "vocab_size": vocab_size,
            "pad_token_id": PAD_ID, "eos_token_id": EOS_ID}
    (out / "tokenise_meta.json").write_text(json.dumps(meta, indent=2))
    return out


def arrow_bytes(directory: Path) -> int:
    """Bytes of the Arrow data files under a save_to_disk directory (what memory-mapping maps)."""
    return sum(p.stat().st_size for p in Path(directory).rglob("*.arrow"))


_SYLLABLES = ["ka", "lo", "mi", "ten", "ra", "su", "vel", "dor", "pi", "an", "qu", "est", "ol", "bri", "zen", "ta"]


def word_list(words: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    vocabulary = set()
    while len(vocabulary) < words:
        vocabulary.add("".join(rng.choice(_SYLLABLES, size=rng.integers(1, 4))))
    return sorted(vocabulary)


def qa_rows(rows: int, seed: int, question_median: float = 24, answer_median: float = 6) -> dict[str, list]:
    """Columns of a normalised QA split (id, question, answers) with long-tailed word counts and
    Zipf-distributed words, so tokenisation cost varies per row as it does on real data."""
    rng = np.random.default_rng(seed)
    words = np.array(word_list(3000, seed))
    weights = 1.0 / np.arange(1, words.size + 1)
    weights /= weights.sum()
    q_len = long_tailed_lengths(rows, 3, 300, question_median, 0.8, seed + 1)
    a_len = long_tailed_lengths(rows, 1, 60, answer_median, 0.8, seed + 2)
    stream = rng.choice(words, size=int(q_len.sum() + a_len.sum()), p=weights)
    questions, answers, position = [], [], 0
    for q, a in zip(q_len.tolist(), a_len.tolist()):
        questions.append(" ".join(stream[position:position + q]) + "?")
        position += q
        answers.append([" ".join(stream[position:position + a])])
        position += a
    return {"id": [f"train-{i}" for i in range(rows)], "question": questions, "answers": answers}


def train_tokenizer(corpus: list[str], vocab_size: int, out: Path):
    """A byte-level BPE fast tokenizer trained on ``corpus``, saved with eos/pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return fast


def tiny_model_config(vocab_size: int, hidden_size: int, layers: int, heads: int, intermediate_size: int,
                      max_positions: int = 1024) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=max_positions, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                       bos_token_id=None, tie_word_embeddings=False)


def save_model_dir(config, out: Path, tokenizer_corpus: list[str] | None = None, seed: int = 0) -> Path:
    """A model directory in the layout prepare_model produces: random weights (safetensors),
    config, a fast tokenizer and a model manifest."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out), safe_serialization=True)
    corpus = tokenizer_corpus or [" ".join(word_list(2000, seed))]
    train_tokenizer(corpus, config.vocab_size, out)
    manifest = {"source": "benchmark", "config": config.to_dict(), "seed": seed}
    (out / "model_manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    return out
