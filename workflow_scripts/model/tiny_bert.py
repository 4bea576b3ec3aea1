"""The offline demo's masked LM: a small BERT config, random weights and a WordPiece tokenizer
trained on the normalised demo corpus (``model.tiny.architecture: bert``). Same contract as
``tiny_model.build``: same seed and corpus give byte-identical files.

The tokenizer is BERT's uncased pipeline (BERT normaliser with lowercasing, BertPreTokenizer,
WordPiece with ``##`` continuation pieces, ``[CLS] $A [SEP]`` post-processing), so the masked_lm
task's word ids (whole-word masking) and special-token masks behave as with a real BERT.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.model import tiny_model

ARCHITECTURES = ("bert",)  # the tiny architectures built here: the masked LMs (model/task_fit.py)
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_POSITIONS = 512  # BERT's own: longer inputs than any masked_lm max_length the demo uses


def corpus_texts(corpus_dirs: Sequence[str | Path]) -> Iterator[str]:
    """Every string field of every normalised train row but ``id`` (a masked_lm row's ``text``;
    classification's ``text``/``text_pair`` and label). Row ids like ``train-17`` are not language:
    learnt as words they would take vocabulary from the text."""
    from workflow_scripts.data.normalised_data import open_normalised

    for directory in corpus_dirs:
        train = open_normalised(directory)["train"]
        columns = [name for name in train.column_names if name != "id"]
        for batch in train.select_columns(columns).iter(batch_size=1000):  # streamed: Arrow stays on disk
            for values in batch.values():
                for value in values:
                    if isinstance(value, str):
                        yield value
                    elif isinstance(value, list):
                        yield from (item for item in value if isinstance(item, str))


def bert_backend(vocab: Mapping[str, int] | None = None):
    """BERT's uncased pipeline around a WordPiece model (empty until ``vocab`` is given)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    backend = Tokenizer(models.WordPiece(vocab=dict(vocab or {}), unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    return backend


def learn_vocabulary(word_counts: Mapping[str, int], vocab_size: int) -> list[str]:
    """WordPiece vocabulary by BPE merges over ``word_counts``, as tokenizers' ``WordPieceTrainer`` learns
    it: the special tokens, every character (``##c`` inside a word), then the most frequent adjacent
    pair merged until ``vocab_size``. Written here because that trainer is not reproducible: two runs
    on the same texts give different vocabularies (it numbers the ``##c`` pieces in hash-map order,
    and those numbers decide ties between equally frequent pairs). Here a tie goes to the pair whose
    text sorts first."""
    from collections import Counter, defaultdict

    words = [[word[0], *("##" + c for c in word[1:])] for word in sorted(word_counts)]
    counts = [word_counts[word] for word in sorted(word_counts)]
    vocab = list(SPECIAL_TOKENS) + sorted({piece for word in words for piece in word} - set(SPECIAL_TOKENS))
    known = set(vocab)
    pairs: Counter = Counter()
    holders: dict[tuple[str, str], set[int]] = defaultdict(set)  # pair -> words it occurs in (maybe no longer)
    for index, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pairs[pair] += counts[index]
            holders[pair].add(index)
    while len(vocab) < vocab_size and pairs:
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merged = best[0] + best[1][2:]  # the second piece is never word-initial: drop its "##"
        if merged not in known:
            vocab.append(merged)
            known.add(merged)
        for index in sorted(holders.pop(best)):
            word, count = words[index], counts[index]
            for pair in zip(word, word[1:]):
                pairs[pair] -= count
            rebuilt, k = [], 0
            while k < len(word):
                if k + 1 < len(word) and (word[k], word[k + 1]) == best:
                    rebuilt.append(merged)
                    k += 2
                else:
                    rebuilt.append(word[k])
                    k += 1
            words[index] = rebuilt
            for pair in zip(rebuilt, rebuilt[1:]):
                pairs[pair] += count
                holders[pair].add(index)
        pairs = +pairs  # drop the pairs no word holds any more
    return vocab


def train_tokenizer(texts: Iterator[str], vocab_size: int):
    """An uncased WordPiece tokenizer learnt from ``texts``, wrapped for transformers with BERT's
    special tokens and ``[CLS] $A [SEP]`` (``[CLS] $A [SEP] $B [SEP]``) post-processing."""
    from collections import Counter

    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    splitter = bert_backend()
    word_counts: Counter = Counter()
    for text in texts:
        words = splitter.pre_tokenizer.pre_tokenize_str(splitter.normalizer.normalize_str(text))
        word_counts.update(word for word, _ in words)
    if not word_counts:
        raise WorkflowError("model.source 'tiny': the --corpus datasets hold no text to train the tokenizer on")
    vocab = learn_vocabulary(word_counts, vocab_size)
    backend = bert_backend({token: index for index, token in enumerate(vocab)})
    backend.add_special_tokens(SPECIAL_TOKENS)
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=MAX_POSITIONS,
        # BERT's inputs: segment ids tell a pair's two texts apart (classification's text_pair).
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def build_model(tiny: Mapping[str, Any], tokenizer):
    """A randomly initialised ``BertForMaskedLM``, seeded by ``tiny.seed``."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    tiny_model.check_heads(tiny)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny["hidden_size"],
        intermediate_size=tiny["intermediate_size"],
        num_hidden_layers=tiny["num_layers"],
        num_attention_heads=tiny["num_heads"],
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        # 1/sqrt(hidden) rather than BERT's 0.02: the frozen random layers then carry a line's words into
        # every position strongly enough for LoRA to build on (demo corpus, hidden 64, 300 steps: masked
        # accuracy 0.48-0.49 against 0.40-0.45 with 0.02).
        initializer_range=tiny["hidden_size"] ** -0.5,
        # No dropout: a few hundred adapter steps do not overfit the corpus, and BERT's 0.1 slowed
        # learning (masked accuracy 0.50 against 0.55 after 300 steps).
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(tiny["seed"])
    return BertForMaskedLM(config).to(torch.float32)


def build(tiny: Mapping[str, Any], corpus_dirs: Sequence[str | Path], out: Path) -> dict[str, Any]:
    """Write config, safetensors weights and tokenizer into ``out``; return facts for the manifest."""
    if tiny["architecture"] not in ARCHITECTURES:
        raise WorkflowError(f"model.tiny.architecture '{tiny['architecture']}' is built by tiny_model, not tiny_bert")
    return tiny_model.save_built(tiny, corpus_dirs, out, train_tokenizer, build_model, corpus_texts)
