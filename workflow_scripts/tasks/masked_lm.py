"""The ``masked_lm`` task: BERT-style (continued) pretraining on plain text, one example per line.

Data: the normalised rows are ``{id, text}`` (``data/text_lines.write_normalised``). Variant keys:
``mask_rate`` (default 0.15), ``whole_word`` (default false) and ``grouping``:
- ``blocks`` (default): every line is encoded with the tokenizer's own special tokens
  (``[CLS] line [SEP]`` for BERT, ``<s> line </s>`` for RoBERTa), the lines of one map batch are
  concatenated and cut into blocks of exactly ``max_length`` tokens, special tokens included;
  the remainder of each map batch is one row marked ``dropped``. This is ``group_texts`` of
  transformers' ``examples/pytorch/language-modeling/run_mlm.py`` (which also drops the remainder
  per map batch). A grouping map changes the row count, which ``datasets.map(batched=True)``
  allows because the stage sets ``remove_columns`` (the old columns would no longer line up).
  Block ids are ``<id of the line holding its first token>+<token offset in that line>``.
- ``lines``: one line per row, cut to ``max_length`` by the tokenizer (its special tokens kept).

Masking happens when batches are made (dynamic masking, as RoBERTa), but never from a global RNG:
each micro-batch's generator is seeded from (experiment seed, epoch, the batch's row ids), so a batch
gets the same mask in any process, DataLoader worker or resumed run, and a new one every epoch, even
when a micro-batch holds one row (the epoch travels with the row indices, ``batching.
PlannedMicroBatch``, as dropout is seeded from the step in ``training_setup.seed_micro_batch``).
``transformers.DataCollatorForLanguageModeling`` is not used for that reason: it draws from torch's
global RNG, or with ``seed=`` from one generator per worker (``seed + worker id``) that advances with
every batch, so a batch's mask depends on which process and worker made it and how many batches came
before. (Consequence here: a different ``micro_batch`` regroups rows and so changes the masks.)

Which positions: google-research/bert ``create_pretraining_data.py`` (``create_masked_lm_predictions``):
per row a budget of ``max(1, round(candidates x mask_rate))`` positions among non-special tokens, chosen
uniformly; with ``whole_word``, whole words in random order while they fit, a word that would exceed
the budget skipped (so a row whose words are all longer than its budget masks nothing, as in BERT;
the budget is never exceeded). Each chosen position becomes [MASK] 80%, a uniformly random token 10%
(from the tokenizer's vocabulary, as both BERT and the HF collator do), itself 10%. Word starts
(``_flat_columns``), stored at tokenise time as ``word_start``: after a special token, where the
character offsets leave a gap, at a ``▁``/``Ġ`` prefix, or where the pre-tokenizer's ``word_ids``
change (WordPiece ``##`` pieces continue a word; BERT's punctuation is a word). The offsets and
special-token rules are transformers' whole-word collator's; the prefix rule finds words when the
pre-tokenizer never splits a line (sentencepiece-style converters), where word ids alone would make
each line one word. Special tokens are the encoding's ``special_tokens_mask`` OR any id in
``all_special_ids`` (a literal "[MASK]" in the text is not in the encoding's mask; [UNK] is thereby
never a target either, as in the HF collator's fallback ``get_special_tokens_mask``: predicting it
teaches nothing). The gate refuses a batch whose masked share is far from ``mask_rate``
(``check_masked_share``).

Model: ``AutoModelForMaskedLM``, trained with LoRA (continued pretraining of a pretrained masked LM) or,
with ``training.finetune: full``, whole (pretraining from scratch with ``model.initialise: random``); a
variant naming those keys is pointed to the training settings (``VariantSettings.parse``). The PEFT task type is None: PEFT has no
masked-LM task type, and TOKEN_CLS would wrap a token-classification forward and mark a
``classifier`` to save. A plain ``PeftModel`` forwards to the model unchanged; the MLM head is
pretrained (its decoder tied to the input embeddings), so it is not in ``modules_to_save`` unless
the config lists it.

Stages: normalise calls :meth:`MaskedLMTask.normalise_source` (text files -> ``{id, text}`` rows,
streamed by ``data/text_lines``) instead of a record mapper; pretokenise records ``mask_token_id``
through :meth:`MaskedLMTask.tokenise_meta`; sanity runs :meth:`check_tokenizer` and
:meth:`check_batch` through the task's gate hooks; train and sanity pass the experiment seed to
:meth:`MaskedLMTask.collator`.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.tasks.base import EvaluationResult

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings, VariantSettings
    import torch
    from torch import nn

    from workflow_scripts.core.section_settings import EvaluationSettings
    from workflow_scripts.core.settings import TrainingSettings

IGNORE_INDEX = -100
VARIANT_DEFAULTS = {"mask_rate": 0.15, "whole_word": False, "grouping": "blocks"}
GROUPINGS = ("blocks", "lines")
MASK_SHARE, RANDOM_SHARE = 0.8, 0.1  # of the chosen positions; the remaining 10% keep their token
METRICS = ("masked_accuracy", "perplexity", "mlm_loss")
# Evaluation masks every variant the same way (token level, 15%, all [MASK]), seeded from each
# line's id and this constant only: never from the experiment seed or the variant.
EVAL_MASK_RATE = 0.15
EVAL_MASK_SEED = 1515


def check_variant(variant: "VariantSettings") -> "VariantSettings":
    """The typed variant: the schema has checked ``mask_rate`` (0 < rate < 1), ``whole_word`` and ``grouping``
    and refused any other key (how the model trains, e.g. ``finetune``, is a training setting): nothing is left
    to check here."""
    return variant


def variant_record(variant: "VariantSettings") -> dict[str, Any]:
    """The variant as pretokenise's cache key, its ``templates`` record (read back by :meth:`MaskedLMTask.collator`)
    and the manifests hold it: every key with its default, as they have always been written."""
    return {**VARIANT_DEFAULTS, **variant.to_dict(), "mask_rate": float(variant.mask_rate)}


# Tokenising ---------------------------------------------------------------------------------------
def _encode(tokenizer, texts: Sequence[str], max_length: int | None):
    """Fast-tokenizer encodings with special tokens; truncation only when ``max_length`` is given."""
    options = {"truncation": True, "max_length": max_length} if max_length else {"truncation": False}
    return tokenizer(list(texts), add_special_tokens=True, return_attention_mask=False,
                     return_token_type_ids=False, verbose=False, **options).encodings


# A token opening with one of these marks the space before a word: sentencepiece's Metaspace "▁" (Llama,
# Gemma, T5, XLM-R converters) and byte-level BPE's "Ġ" (GPT-2, RoBERTa).
WORD_PREFIXES = ("\u2581", "\u0120")


def _flat_columns(encodings, special_ids: np.ndarray):
    """Concatenated ids, special flags and word starts of ``encodings``, plus each line's start offset.

    A non-special token starts a word when (1) it is a line's first token or follows a special token,
    or (2) its start offset lies beyond the previous token's end (the whitespace a tokenizer dropped) —
    these two are transformers' rule (5.23, ``data/data_collator.py``,
    ``DataCollatorForLanguageModeling._calc_word_ids_and_prob_mask``, which ``DataCollatorForWholeWordMask``
    uses) — or (3) it opens with a ``WORD_PREFIXES`` mark, or (4) the pre-tokenizer put it in another word
    than the previous token (``word_ids``: BERT's punctuation, as before). Rule (3) is what finds words
    when the pre-tokenizer never splits a line (``Metaspace(split=False)``, none at all, or ``Split(" ")``
    after a normaliser that turned spaces into "▁"): there ``word_ids`` make each line one word and the
    offsets of "▁word" include the space, so they touch the previous token's end and rule (2) sees no
    gap. Unlike transformers (``!=``), a token starting before the previous one's end (byte-level pieces
    of one character share its offsets) continues the word.
    """
    lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
    total = int(lengths.sum())
    ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=total)
    special = np.fromiter((s for e in encodings for s in e.special_tokens_mask), dtype=bool, count=total)
    special |= np.isin(ids, special_ids)
    words = np.fromiter((-1 if w is None else w for e in encodings for w in e.word_ids), dtype=np.int64, count=total)
    words[special] = -1
    offsets = np.fromiter((x for e in encodings for pair in e.offsets for x in pair), dtype=np.int64,
                          count=2 * total).reshape(total, 2)
    prefixed = np.fromiter((t.startswith(WORD_PREFIXES) for e in encodings for t in e.tokens), dtype=bool, count=total)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    previous = np.roll(words, 1)
    previous[starts[lengths > 0]] = -2  # a line's first token never continues the previous line's word
    previous_end = np.roll(offsets[:, 1], 1)
    gap = offsets[:, 0] > previous_end
    word_start = ~special & ((words != previous) | gap | prefixed)
    return ids, special, word_start, starts, lengths


def tokenise_batch(batch: Mapping[str, list], *, tokenizer, variant: "VariantSettings", max_length: int) -> dict[str, list]:
    """Batched map function over ``{id, text}`` rows (see the module docstring for the groupings)."""
    check_tokenizer(tokenizer)
    variant = check_variant(variant)
    specials = tokenizer.num_special_tokens_to_add()
    if max_length <= specials:
        raise WorkflowError(f"max_length {max_length} leaves no room beside the tokenizer's {specials} special tokens")
    line_ids, texts = list(batch["id"]), list(batch["text"])
    encodings = _encode(tokenizer, texts, None)
    truncated = [len(e.ids) > max_length for e in encodings]
    if variant.grouping == "lines" and any(truncated):  # rare: re-encode only the long lines, cut
        long = [k for k, cut in enumerate(truncated) if cut]
        for k, encoding in zip(long, _encode(tokenizer, [texts[k] for k in long], max_length)):
            encodings[k] = encoding
    ids, special, word_start, starts, lengths = _flat_columns(encodings, np.asarray(tokenizer.all_special_ids))
    if variant.grouping == "lines":
        spans = [(int(s), int(s + n), line_ids[k], truncated[k]) for k, (s, n) in enumerate(zip(starts, lengths))]
    elif specials == 0:
        raise WorkflowError("grouping 'blocks' separates lines by the tokenizer's special tokens, but it adds none; "
                            "use grouping 'lines'")
    else:
        lines = np.searchsorted(starts, np.arange(0, len(ids), max_length), side="right") - 1
        spans = [(b, min(b + max_length, len(ids)), f"{line_ids[k]}+{b - starts[k]}", False)
                 for b, k in zip(range(0, len(ids), max_length), lines.tolist())]
    out: dict[str, list] = {key: [] for key in ("id", "input_ids", "special_tokens_mask", "word_start",
                                                 "length", "truncated", "dropped")}
    for begin, end, row_id, was_cut in spans:
        out["id"].append(row_id)
        out["input_ids"].append(ids[begin:end].tolist())
        out["special_tokens_mask"].append(special[begin:end].tolist())
        out["word_start"].append(word_start[begin:end].tolist())
        out["length"].append(end - begin)
        out["truncated"].append(was_cut)
        # Nothing to mask, or a block's short remainder (blocks are exactly max_length, as group_texts).
        out["dropped"].append(bool(special[begin:end].all())
                              or (variant.grouping == "blocks" and end - begin < max_length))
    return out


# Masking ------------------------------------------------------------------------------------------
def batch_generator(seed: int, row_ids: Sequence[str], epoch: int | None = None) -> np.random.Generator:
    """A generator that depends only on (seed, epoch, the row ids in order): same batch, same mask, in any
    process, DataLoader worker or resumed run, and a new mask each epoch (RoBERTa's dynamic masking) even
    when a micro-batch holds one row. ``epoch`` None (held-out rows, which the plan does not draw): the
    same mask at every validation, so validation losses compare."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise WorkflowError(f"masking seed must be a non-negative integer, got {seed!r}")
    digest = np.frombuffer(hashlib.sha256(json.dumps(list(row_ids)).encode()).digest(), dtype=np.uint32).tolist()
    when = [0] if epoch is None else [1, epoch]
    return np.random.default_rng(np.random.SeedSequence([seed, *when, *digest]))


def micro_batch_epoch(rows: Sequence[Mapping[str, Any]]) -> int | None:
    """The epoch the plan drew these rows in (``batching.PlannedMicroBatch``), or None for held-out rows."""
    epochs = {row.get("epoch") for row in rows}
    if len(epochs) != 1:
        raise WorkflowError(f"rows {[r['id'] for r in rows][:5]}: one micro-batch mixes epochs {sorted(map(str, epochs))}; "
                            "build batches with batching.RankBatchSampler")
    epoch = epochs.pop()
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
        raise WorkflowError(f"rows {[r['id'] for r in rows][:5]}: epoch {epoch!r} is not a non-negative integer")
    return epoch


def masking_budget(candidates: int, rate: float) -> int:
    """BERT's ``num_to_predict``: ``max(1, round(candidates x rate))``, rounding half up as Python 2 did."""
    return max(1, math.floor(candidates * rate + 0.5))


def choose_positions(special: np.ndarray, word_start: np.ndarray | None, rate: float,
                     rng: np.random.Generator, row_id: str) -> np.ndarray:
    """Sorted positions to predict, at most ``masking_budget`` of the row's non-special tokens; token by
    token exactly that many; with ``word_start``, whole words in random order, a word that would exceed
    the budget skipped (``create_masked_lm_predictions``: "If adding a whole-word mask would exceed the
    maximum number of predictions, then just skip this candidate"), so a row whose every word is longer
    than its budget masks nothing, as in BERT."""
    candidates = np.flatnonzero(~special)
    if len(candidates) == 0:
        raise WorkflowError(f"row '{row_id}': only special tokens, so no token can be masked; rerun pretokenise "
                            "(it drops such rows)")
    budget = masking_budget(len(candidates), rate)
    if word_start is None:
        return np.sort(rng.choice(candidates, size=budget, replace=False))
    # A candidate opens a word at a word start or after a special token (a block may begin mid-word).
    opens = word_start[candidates] | np.r_[True, np.diff(candidates) != 1]
    word = np.cumsum(opens) - 1
    sizes = np.bincount(word)
    chosen, covered = [], 0
    for w in rng.permutation(len(sizes)):
        if covered >= budget:
            break
        if covered + sizes[w] <= budget:
            chosen.append(w)
            covered += sizes[w]
    return candidates[np.isin(word, chosen)]


class MaskingCollator:
    """Pads rows and masks them; the batch carries what the loss, the gate and the log need."""

    def __init__(self, *, pad_token_id: int, mask_token_id: int, vocab_size: int, tokenizer_vocab_size: int,
                 mask_rate: float, whole_word: bool, seed: int):
        if tokenizer_vocab_size > vocab_size:
            raise WorkflowError(f"the tokenizer has {tokenizer_vocab_size} tokens but the model only {vocab_size}")
        self.pad_token_id, self.mask_token_id = pad_token_id, mask_token_id
        self.vocab_size, self.tokenizer_vocab_size = vocab_size, tokenizer_vocab_size
        self.mask_rate, self.whole_word, self.seed = mask_rate, whole_word, seed

    def __call__(self, rows: list[dict]) -> dict:
        if not rows:
            raise WorkflowError("empty batch: the sampler produced a micro-batch without rows")
        row_ids = [r["id"] for r in rows]
        rng = batch_generator(self.seed, row_ids, micro_batch_epoch(rows))
        width = max(len(r["input_ids"]) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        attention_mask = np.zeros((len(rows), width), dtype=np.int64)
        for k, row in enumerate(rows):
            ids = np.asarray(row["input_ids"], dtype=np.int64)
            special = np.asarray(row["special_tokens_mask"], dtype=bool)
            starts = np.asarray(row["word_start"], dtype=bool) if self.whole_word else None
            if len(special) != len(ids) or (starts is not None and len(starts) != len(ids)):
                raise WorkflowError(f"row '{row['id']}': input_ids, special_tokens_mask and word_start differ in length")
            bad = (ids < 0) | (ids >= self.vocab_size)
            if bad.any():
                raise WorkflowError(f"row '{row['id']}': token id {int(ids[bad][0])} is outside the model's vocabulary "
                                    f"(size {self.vocab_size}); re-tokenise with this model's tokenizer")
            input_ids[k, :len(ids)] = ids
            attention_mask[k, :len(ids)] = 1
            positions = choose_positions(special, starts, self.mask_rate, rng, row["id"])
            labels[k, positions] = ids[positions]
        chosen = labels != IGNORE_INDEX
        draw = rng.random(int(chosen.sum()))
        random_ids = rng.integers(0, self.tokenizer_vocab_size, size=len(draw))
        original = input_ids[chosen]
        input_ids[chosen] = np.where(draw < MASK_SHARE, self.mask_token_id,
                                     np.where(draw < MASK_SHARE + RANDOM_SHARE, random_ids, original))
        import torch

        labels_t = torch.from_numpy(labels)
        target_index = torch.from_numpy(np.flatnonzero(chosen.reshape(-1)))
        real_tokens = int(attention_mask.sum())
        return {
            "input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
            "labels": labels_t, "target_index": target_index, "target_ids": labels_t.reshape(-1)[target_index],
            "target_tokens": len(target_index), "real_tokens": real_tokens,
            "padded_tokens": input_ids.size - real_tokens, "row_ids": row_ids, "mask_rate": self.mask_rate,
        }


# Loss ---------------------------------------------------------------------------------------------
# Evaluation ---------------------------------------------------------------------------------------
def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise WorkflowError(f"unknown masked_lm metric '{metric}'; known: {', '.join(METRICS)}")


def ratio_score(metric: str, correct_or_loss: float, masked: float) -> float:
    """A score from summed counts: masked_accuracy = correct / masked, mlm_loss = loss / masked,
    perplexity = exp(mlm_loss). Corpus scores are micro (sums over lines, then the ratio)."""
    check_metric(metric)
    if masked <= 0:
        raise WorkflowError("no masked token to score")
    ratio = correct_or_loss / masked
    return math.exp(ratio) if metric == "perplexity" else ratio


def eval_positions(row_id: str, special: np.ndarray) -> np.ndarray:
    """The fixed evaluation mask of one line: from its id only, so every model and variant is scored
    on the same positions (given the same tokenizer)."""
    digest = hashlib.sha256(row_id.encode()).digest()
    rng = np.random.default_rng(np.random.SeedSequence([EVAL_MASK_SEED, *np.frombuffer(digest, np.uint32).tolist()]))
    return choose_positions(special, None, EVAL_MASK_RATE, rng, row_id)


def evaluate(model, tokenizer, variant: Mapping[str, Any], rows: Sequence[dict], metric: str,
             evaluation: "EvaluationSettings", device: torch.device) -> EvaluationResult:
    """Score every test line with its fixed mask (all chosen positions [MASK]), in batches sorted by
    length. Records: ``{id, masked, correct, loss_sum, score, counts}``; ``counts`` is
    ``[correct, masked]`` for masked_accuracy and ``[loss_sum, masked]`` otherwise."""
    import torch
    import torch.nn.functional as F

    from workflow_scripts.tasks.masked_lm_loss import masked_logits

    check_metric(metric)
    check_tokenizer(tokenizer)
    if evaluation.max_length is None:
        raise ConfigError("evaluation.max_length", "masked LM evaluation needs the tokens per test line")
    max_length, batch_size = evaluation.max_length, evaluation.batch_size
    missing = [k for k, row in enumerate(rows) if "text" not in row]
    if missing:
        raise WorkflowError(f"test row {missing[0]}: no 'text' field; is this text_lines normalise output?")
    encodings = _encode(tokenizer, [row["text"] for row in rows], max_length)
    ids, special, _, starts, lengths = _flat_columns(encodings, np.asarray(tokenizer.all_special_ids))
    for row, s, n in zip(rows, starts, lengths):
        if special[s:s + n].all():
            raise WorkflowError(f"test line '{row['id']}': the tokenizer turns it into special tokens only, so no "
                                "token can be masked; remove the line from the test files")
    lines = [(ids[s:s + n], eval_positions(row["id"], special[s:s + n])) for row, s, n in zip(rows, starts, lengths)]
    # Which tokens are scored, as one hash: the fairness guard compares it between the variants.
    scored = [[row["id"], positions.tolist(), line[positions].tolist()] for row, (line, positions) in zip(rows, lines)]
    positions_sha256 = hashlib.sha256(json.dumps(scored).encode()).hexdigest()
    totals = np.zeros((len(rows), 3))  # masked, correct, loss_sum
    model.eval()
    order = sorted(range(len(rows)), key=lambda k: -len(lines[k][0]))
    for begin in range(0, len(order), batch_size):
        chunk = order[begin:begin + batch_size]
        width = max(len(lines[k][0]) for k in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        flat, targets, owner = [], [], []
        for j, k in enumerate(chunk):
            line, positions = lines[k]
            input_ids[j, :len(line)] = torch.from_numpy(line)
            attention_mask[j, :len(line)] = 1
            input_ids[j, positions] = tokenizer.mask_token_id
            flat.extend((j * width + positions).tolist())
            targets.extend(line[positions].tolist())
            owner.extend([k] * len(positions))
        target_ids = torch.tensor(targets, device=device)
        with torch.no_grad():
            logits = masked_logits(model, input_ids.to(device), attention_mask.to(device),
                                   torch.tensor(flat, device=device)).float()
        losses = F.cross_entropy(logits, target_ids, reduction="none").double().cpu().numpy()
        hits = (logits.argmax(-1) == target_ids).cpu().numpy()
        np.add.at(totals, (owner, 0), 1)
        np.add.at(totals, (owner, 1), hits)
        np.add.at(totals, (owner, 2), losses)
    records = []
    for row, (masked, correct, loss_sum) in zip(rows, totals):
        numerator = correct if metric == "masked_accuracy" else loss_sum
        records.append({"id": row["id"], "masked": int(masked), "correct": int(correct), "loss_sum": float(loss_sum),
                        "score": ratio_score(metric, numerator, masked),
                        "counts": [int(correct) if metric == "masked_accuracy" else float(loss_sum), int(masked)]})
    sums = totals.sum(axis=0)
    scores = {name: ratio_score(name, sums[1] if name == "masked_accuracy" else sums[2], sums[0]) for name in METRICS}
    details = {"scores": scores, "masked_tokens": int(sums[0]), "max_length": max_length,
               "truncated_lines": int(sum(len(e.overflowing) > 0 for e in encodings)),
               "eval_mask": {"rate": EVAL_MASK_RATE, "unit": "token", "replacement": "all [MASK]",
                             "seed": EVAL_MASK_SEED, "from": "each line's id", "max_length": max_length,
                             "positions_sha256": positions_sha256}}
    return EvaluationResult(records, scores[metric], 0, details)


# Gate checks --------------------------------------------------------------------------------------
def _refuse(check: str, cause: str, fix: str):
    from workflow_scripts.core.errors import PreflightError

    raise PreflightError(check, cause, fix)


def check_tokenizer(tokenizer) -> str:
    if tokenizer.mask_token_id is None:
        _refuse("masked_lm_tokenizer", "the tokenizer has no mask token",
                "use a model pretrained with masked LM (BERT, RoBERTa...), or add a mask token in prepare_model")
    if tokenizer.pad_token_id is None:
        _refuse("masked_lm_tokenizer", "the tokenizer has no pad token", "set the model's pad token in prepare_model")
    if not getattr(tokenizer, "is_fast", False):
        _refuse("masked_lm_tokenizer", "the tokenizer is not a fast tokenizer (word ids are needed)",
                "save the model with its tokenizer.json (a fast tokenizer)")
    return f"mask token {tokenizer.mask_token!r} (id {tokenizer.mask_token_id})"


def describe_tokenizer(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [f"{name} {type(getattr(backend, name)).__name__}" for name in ("normalizer", "pre_tokenizer", "model")
             if backend is not None and getattr(backend, name, None) is not None]
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return f"tokenizer '{name}'" + (f" ({', '.join(parts)})" if parts else "")


# The realised masked share must lie in [half the budget minus MASKED_SHARE_SLACK tokens, the budget]:
# the budget is never exceeded (BERT's rule), token-level masking meets it exactly, and whole-word
# masking falls short only by words that did not fit, a few per cent on text whose words are a few
# tokens long. The slack keeps a micro-batch of a few short lines (budget 1 or 2, words of 2 pieces:
# nothing fits) from being refused. Lines taken for words (a pre-tokenizer that never splits, no word
# starts) give 0 % or, with an "at least one word" fallback, about 97 % (issue 22): far outside both.
MASKED_SHARE_SLACK = 2


def check_masked_share(batch: Mapping[str, Any], tokenizer, labelled: torch.Tensor) -> tuple[int, int, int]:
    """(masked, maskable, budget) of the batch; refuses a masked count outside the bounds above."""
    import torch

    if "mask_rate" not in batch:
        _refuse("masked_lm_batch", "the batch does not say its mask_rate", "build batches with the task's collator")
    rate = batch["mask_rate"]
    input_ids, attention = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
    # Unlabelled positions hold their own token, so their special flag is exact; labelled ones are never special.
    maskable = labelled | (attention & ~labelled & ~torch.isin(input_ids, torch.tensor(tokenizer.all_special_ids)))
    per_row = maskable.sum(dim=1).tolist()
    budget = sum(masking_budget(n, rate) for n in per_row if n > 0)
    masked, total = int(labelled.sum()), int(sum(per_row))
    if masked > budget or masked < budget / 2 - MASKED_SHARE_SLACK:
        share = masked / total if total else 0.0
        if masked == 0:
            _refuse("masked_lm_batch", f"no token is masked in the batch (0 of {total} maskable tokens, 0.0%, where "
                    f"mask_rate {rate:.0%} allows {budget}) with {describe_tokenizer(tokenizer)} (rows "
                    f"{list(batch.get('row_ids') or [])[:5]})", "use the masked_lm task's collator; with whole_word: "
                    "true, a tokenizer whose tokens mark word starts (or whole_word: false), and rerun pretokenise")
        why = ("more than the budget: labels on whole lines or on every token" if masked > budget else
               "whole-word masking fits few words in the budget, so its words are far too long (whole lines?): "
               "the tokenizer's word starts (offsets, a ▁/Ġ prefix, its pre-tokenizer's words) do not mark words")
        _refuse("masked_lm_batch", f"{masked} of {total} maskable tokens are masked ({share:.1%}) with {describe_tokenizer(tokenizer)}, "
                f"where mask_rate {rate:.0%} allows {budget} ({budget / total:.1%}) and at least about half of that is "
                f"expected; {why} (rows {list(batch.get('row_ids') or [])[:5]})",
                "use whole_word: false for this tokenizer, or a tokenizer whose tokens mark word starts, and rerun "
                "pretokenise")
    return masked, total, budget


def check_batch(batch: Mapping[str, Any], tokenizer) -> str:
    """Refuses a batch without a masked token, with labels on special or padding tokens, with far more
    unchanged labelled tokens than the 10% "keep" share allows (labels on unmasked positions), or whose
    masked share is far from mask_rate (``check_masked_share``)."""
    import torch

    labels, input_ids, attention = batch["labels"].cpu(), batch["input_ids"].cpu(), batch["attention_mask"].cpu()
    labelled = labels != IGNORE_INDEX
    n = int(labelled.sum())
    if (labelled & (attention == 0)).any():
        _refuse("masked_lm_batch", "padding positions carry labels", "labels must be -100 wherever attention_mask is 0")
    special = torch.isin(labels[labelled], torch.tensor(tokenizer.all_special_ids))
    if special.any():
        _refuse("masked_lm_batch", f"special token id {int(labels[labelled][special][0])} is masked",
                "rerun pretokenise so special_tokens_mask marks every special token")
    if not torch.equal(batch["target_index"].cpu(), labelled.reshape(-1).nonzero().squeeze(1)):
        _refuse("masked_lm_batch", "target_index does not list the labelled positions",
                "build batches with the task's collator")
    # Unchanged tokens among the labelled ones ~ Binomial(n, q); 6 standard deviations (+3 for tiny n)
    # is never reached by chance, but labels on every token (a causal collator) exceed it at once.
    q = 1 - MASK_SHARE - RANDOM_SHARE + RANDOM_SHARE / len(tokenizer)
    unchanged = int((labelled & (input_ids == labels)).sum())
    if unchanged > n * q + 6 * math.sqrt(n * q * (1 - q)) + 3:
        _refuse("masked_lm_batch", f"{unchanged} of {n} labelled tokens are unchanged in the input (expected about "
                f"{q:.0%}): labels sit on unmasked positions", "labels must be -100 except on the masked positions")
    masked, total, budget = check_masked_share(batch, tokenizer, labelled)
    return (f"{n} masked tokens of {total} maskable ({n / max(total, 1):.1%}, budget {budget} at mask_rate "
            f"{batch['mask_rate']:.0%}), none special or padding")


class MaskedLMTask:
    name = "masked_lm"
    auto_model_class = "AutoModelForMaskedLM"
    peft_task_type = None  # see the module docstring: PEFT has no masked-LM task type
    variant_keys = frozenset(VARIANT_DEFAULTS)
    metrics = METRICS
    # Training settings that decide which tokens evaluation scores (lines are cut at the training
    # max_length): the fairness guard compares them as evaluation.eval_mask.<key> (analysis/fairness.py).
    evaluation_training_keys = ("max_length",)
    dropped_reason = "only special tokens, or the short remainder of a map batch in 'blocks' grouping"

    def check_variant(self, variant: "VariantSettings") -> "VariantSettings":
        return check_variant(variant)

    def variant_record(self, variant: "VariantSettings") -> dict[str, Any]:
        return variant_record(variant)

    def tokenised_features(self):
        from datasets import Features, List, Value

        return Features({
            "id": Value("string"), "input_ids": List(Value("int32")), "special_tokens_mask": List(Value("bool")),
            "word_start": List(Value("bool")), "length": Value("int32"), "truncated": Value("bool"),
            "dropped": Value("bool"),
        })

    def tokenise_batch(self, batch, *, tokenizer, variant, max_length, task_meta=None):
        # task_meta (normalise's findings) holds nothing masked LM needs: lines carry no labels.
        return tokenise_batch(batch, tokenizer=tokenizer, variant=variant, max_length=max_length)

    def tokenise_meta(self, variant: "VariantSettings", task_meta: Mapping[str, Any], *, tokenizer=None) -> dict[str, Any]:
        """The mask token's id for the collator (tokenise_meta.json): train never loads the tokenizer."""
        if tokenizer is None:
            raise WorkflowError("masked_lm needs the tokenizer to record its mask token; pretokenise passes it")
        check_tokenizer(tokenizer)
        return {"mask_token_id": tokenizer.mask_token_id}

    def check_config_variant(self, name: str, variant: "VariantSettings", datasets: Mapping[str, "DatasetSettings"]) -> None:
        """At parse time: the variant's keys and values (a masked LM variant names no data field)."""
        self.check_variant(variant)

    # Normalise: plain text has no records to map; the task writes the rows itself (normalise_source).
    def record_mapper(self, settings: "DatasetSettings", key: str):
        raise WorkflowError(f"{key}: masked_lm reads plain text through normalise_source, not a record mapper")

    def normalise_source(self, raw_dir, settings: "DatasetSettings", out_dir, *,
                         extra_json: Mapping[str, Any]) -> dict[str, Any]:
        """``raw_dir``'s ``<split>.txt[.gz]`` files -> ``{id, text}`` rows at ``out_dir`` (with ``extra_json``
        files inside, atomically); returns the report's ``splits`` (lines, kept, blank per split and file)
        and ``ignored_source_splits``."""
        from workflow_scripts.data import text_lines

        splits = dict(settings.splits)
        files = {canonical: text_lines.split_files(raw_dir, source) for canonical, source in splits.items()}
        counts = text_lines.write_normalised(files, out_dir, extra_json=extra_json,
                                             on_invalid_text=settings.on_invalid_text, encoding=settings.encoding)
        return {
            "splits": {canonical: {"source_split": splits[canonical], **counts[canonical],
                                   "file": str(files[canonical][0] if len(files[canonical]) == 1
                                               else Path(raw_dir, splits[canonical]))}
                       for canonical in files},
            "ignored_source_splits": sorted(set(text_lines.available_splits(raw_dir)) - set(splits.values())),
        }

    def model_kwargs(self, task_meta: Mapping[str, Any]) -> dict[str, Any]:
        return {}  # the pretrained MLM head is used as it is

    def prepare_model(self, model: nn.Module, pad_token_id: int | None, task_meta: Mapping[str, Any]) -> None:
        return None  # nothing to size or add: the collator pads and masks with the tokenizer's own ids

    def collator(self, meta: Mapping[str, Any], vocab_size: int, *, seed: int) -> MaskingCollator:
        from workflow_scripts.core.entry_settings import VariantSettings

        recorded = meta["variant"] if "variant" in meta else meta["templates"]  # pretokenise's variant_record
        variant = check_variant(VariantSettings.from_record(recorded, self.name))
        if meta.get("mask_token_id") is None:
            raise WorkflowError("tokenise_meta.json has no mask_token_id; rerun pretokenise for the masked_lm task")
        return MaskingCollator(pad_token_id=meta["pad_token_id"], mask_token_id=meta["mask_token_id"],
                               vocab_size=vocab_size, tokenizer_vocab_size=meta["vocab_size"],
                               mask_rate=variant.mask_rate, whole_word=variant.whole_word, seed=seed)

    def loss_module(self, peft_model: nn.Module) -> nn.Module:
        from workflow_scripts.tasks.masked_lm_loss import MaskedTokenLoss

        return MaskedTokenLoss(peft_model)

    def evaluate(self, model, tokenizer, variant, rows, metric, evaluation, device) -> EvaluationResult:
        return evaluate(model, tokenizer, variant, rows, metric, evaluation, device)

    # The gate's task-specific checks (sanity calls them beside preflight_checks'): detail string or PreflightError.
    def check_tokenizer(self, tokenizer) -> str | None:
        return check_tokenizer(tokenizer)

    def check_batch(self, batch: Mapping[str, Any], tokenizer, model: nn.Module) -> str | None:
        return check_batch(batch, tokenizer)

    def check_model(self, peft_model: nn.Module, task_meta: Mapping[str, Any], training: TrainingSettings) -> str | None:
        return None

    def check_gradients(self, peft_model: nn.Module, training: TrainingSettings) -> str | None:
        return None


TASK = MaskedLMTask()


def __getattr__(name: str):
    """``masked_lm.MaskedTokenLoss`` without torch at import: normalise and compare load this module for its
    task object's data and must not pay for torch (tests/test_stage_imports.py)."""
    if name == "MaskedTokenLoss":
        from workflow_scripts.tasks.masked_lm_loss import MaskedTokenLoss

        return MaskedTokenLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
