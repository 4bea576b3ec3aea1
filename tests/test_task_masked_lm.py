"""The masked_lm task on a tiny WordPiece tokenizer (built offline) and tiny random BERT / RoBERTa."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from workflow_scripts.core.section_settings import EvaluationSettings
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.tasks import masked_lm, stored_columns
from workflow_scripts.tasks.masked_lm import TASK
from data_helpers import typed_variant


def typed(given):
    """A masked LM variant as pretokenise, evaluate and training's checks take it (typed, the task's checks)."""
    return TASK.check_variant(typed_variant(given, "masked_lm"))

WORDS = ("the quick brown fox jumps over the lazy dog while unbelievable things happen to "
         "tokenisation and pretraining of language models on small corpora every day").split()


def toy_lines(count: int, seed: int = 0, low: int = 4, high: int = 14) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # A small vocabulary, so long words become several ## pieces (whole-word masking has work to do).
    backend.train_from_iterator(toy_lines(400), trainers.WordPieceTrainer(
        vocab_size=90, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def tiny_bert(tokenizer, seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)
    return BertForMaskedLM(config)


def tiny_roberta(tokenizer, seed: int = 0):
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(seed)
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=140, pad_token_id=tokenizer.pad_token_id)
    return RobertaForMaskedLM(config)


def tokenise(tokenizer, lines, variant=None, max_length=16, prefix="c"):
    batch = {"id": [f"{prefix}-{k + 1}" for k in range(len(lines))], "text": list(lines)}
    return TASK.tokenise_batch(batch, tokenizer=tokenizer, variant=typed(variant or {}),
                               max_length=max_length)


def as_rows(columns) -> list[dict]:
    keep = [k for k, dropped in enumerate(columns["dropped"]) if not dropped]
    return [{key: columns[key][k] for key in ("id", "input_ids", "special_tokens_mask", "word_start")} for k in keep]


def make_collator(tokenizer, seed=0, **variant):
    meta = {"pad_token_id": tokenizer.pad_token_id, "mask_token_id": tokenizer.mask_token_id,
            "vocab_size": len(tokenizer), "templates": TASK.variant_record(typed(variant))}
    return TASK.collator(meta, len(tokenizer), seed=seed)


# Variant, tokenising ------------------------------------------------------------------------------
def test_variant_defaults_and_refusals():
    assert TASK.variant_record(typed({})) == {"mask_rate": 0.15, "whole_word": False, "grouping": "blocks"}
    assert TASK.variant_keys == {"mask_rate", "whole_word", "grouping"}
    for bad in ({"mask_rate": 0}, {"mask_rate": True}, {"whole_word": "yes"}, {"grouping": "docs"}, {"prompt": "x"}):
        with pytest.raises(WorkflowError):
            typed(bad)


def test_blocks_have_exactly_max_length_tokens_and_the_remainder_is_dropped(tokenizer):
    lines = toy_lines(60, seed=1)
    out = tokenise(tokenizer, lines, {"grouping": "blocks"}, max_length=16)
    total = sum(len(tokenizer(line)["input_ids"]) for line in lines)
    assert sum(out["length"]) == total  # every token is in some row, nothing invented
    kept = [n for n, dropped in zip(out["length"], out["dropped"]) if not dropped]
    assert kept and set(kept) == {16} and len(kept) == total // 16
    assert out["dropped"] == [False] * len(kept) + ([True] if total % 16 else [])
    # Concatenating the rows gives back the lines, each framed by [CLS] ... [SEP] (run_mlm's group_texts).
    flat = [t for row in out["input_ids"] for t in row]
    assert flat == [t for line in lines for t in tokenizer(line)["input_ids"]]
    assert out["id"][0] == "c-1+0" and len(set(out["id"])) == len(out["id"])
    assert not any(out["truncated"])


def test_lines_grouping_truncates_keeping_special_tokens(tokenizer):
    out = tokenise(tokenizer, ["the quick brown fox " * 10, "lazy dog"], {"grouping": "lines"}, max_length=12)
    assert out["length"] == [12, len(out["input_ids"][1])] and out["truncated"] == [True, False]
    first = out["input_ids"][0]
    assert first[0] == tokenizer.cls_token_id and first[-1] == tokenizer.sep_token_id
    assert out["special_tokens_mask"][0] == [True] + [False] * 10 + [True]


def test_literal_special_token_in_text_is_marked_special(tokenizer):
    out = tokenise(tokenizer, ["the [MASK] fox"], {"grouping": "lines"})
    ids, special = out["input_ids"][0], out["special_tokens_mask"][0]
    assert special[ids.index(tokenizer.mask_token_id)] is True


def test_word_starts_follow_the_tokenizers_words(tokenizer):
    out = tokenise(tokenizer, ["unbelievable tokenisation"], {"grouping": "lines"})
    pieces = tokenizer.convert_ids_to_tokens(out["input_ids"][0])
    starts = out["word_start"][0]
    assert [p for p, s in zip(pieces, starts) if s] == [p for p in pieces if p[0] not in "#[" ]
    assert all(not s for p, s in zip(pieces, starts) if p.startswith("##") or p in ("[CLS]", "[SEP]"))


# Masking ------------------------------------------------------------------------------------------
def masked_statistics(input_ids, labels, special, mask_id):
    chosen = labels != -100
    return {
        "rate": chosen.sum() / (~special).sum(),
        "mask": (input_ids[chosen] == mask_id).mean(),
        "keep": (input_ids[chosen] == labels[chosen]).mean(),
        "random": ((input_ids[chosen] != mask_id) & (input_ids[chosen] != labels[chosen])).mean(),
    }


def test_masking_rates_match_huggingfaces_collator(tokenizer):
    from transformers import DataCollatorForLanguageModeling

    rng = np.random.default_rng(0)
    width, n_rows = 128, 400
    plain = [t for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids]
    rows = []
    for k in range(n_rows):
        ids = [tokenizer.cls_token_id] + rng.choice(plain, width - 2).tolist() + [tokenizer.sep_token_id]
        rows.append({"id": f"r-{k}", "input_ids": ids, "special_tokens_mask": [True] + [False] * (width - 2) + [True],
                     "word_start": [False] + [True] * (width - 2) + [False]})
    special = np.array([r["special_tokens_mask"] for r in rows])
    ours = make_collator(tokenizer, seed=3)
    batches = [ours(rows[k:k + 16]) for k in range(0, n_rows, 16)]
    mine = masked_statistics(np.concatenate([b["input_ids"].numpy() for b in batches]),
                             np.concatenate([b["labels"].numpy() for b in batches]), special, tokenizer.mask_token_id)
    hf = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15, seed=3)
    hf_batch = hf([{"input_ids": r["input_ids"], "special_tokens_mask": [int(s) for s in r["special_tokens_mask"]]}
                   for r in rows])
    theirs = masked_statistics(hf_batch["input_ids"].numpy(), hf_batch["labels"].numpy(), special, tokenizer.mask_token_id)
    # ~7,600 masked of ~50,000 tokens: binomial standard deviations 0.002 (rate), 0.005 (shares).
    for stats in (mine, theirs):
        assert stats["rate"] == pytest.approx(0.15, abs=0.01)
        assert stats["mask"] == pytest.approx(0.80, abs=0.025)
        assert stats["keep"] == pytest.approx(0.10 + 0.1 / len(tokenizer), abs=0.02)
        assert stats["random"] == pytest.approx(0.10 - 0.1 / len(tokenizer), abs=0.02)
    for key in mine:
        assert mine[key] == pytest.approx(theirs[key], abs=0.03)


def test_mask_depends_on_seed_and_rows_only_not_on_global_rng(tokenizer):
    rows = as_rows(tokenise(tokenizer, toy_lines(40, seed=2), max_length=24))
    collate = make_collator(tokenizer, seed=7)
    torch.manual_seed(0)
    np.random.seed(0)
    first = collate(rows[:8])
    torch.manual_seed(123)
    np.random.seed(123)
    torch.rand(100)
    collate(rows[8:16])  # batches made before must not matter either
    again = make_collator(tokenizer, seed=7)(rows[:8])
    for key in ("input_ids", "labels", "target_index"):
        assert torch.equal(first[key], again[key])
    other_seed = make_collator(tokenizer, seed=8)(rows[:8])
    assert not torch.equal(first["labels"], other_seed["labels"])


def test_mask_is_the_same_in_dataloader_workers(tokenizer):
    rows = as_rows(tokenise(tokenizer, toy_lines(40, seed=2), max_length=24))
    collate = make_collator(tokenizer, seed=5)
    batches = [list(range(k, k + 4)) for k in range(0, 16, 4)]
    loader = torch.utils.data.DataLoader(rows, batch_sampler=batches, collate_fn=collate, num_workers=2)
    for made_in_worker, indices in zip(loader, batches):
        assert torch.equal(made_in_worker["input_ids"], collate([rows[i] for i in indices])["input_ids"])


def saved_split(tokenizer, tmp_path, lines, variant=None, max_length=24):
    """The rows as pretokenise stores them (Arrow, save_to_disk), opened as training opens them."""
    from datasets import Dataset

    from workflow_scripts.data import batching

    columns = tokenise(tokenizer, lines, variant, max_length)
    rows = {key: [value for value, dropped in zip(columns[key], columns["dropped"]) if not dropped] for key in columns}
    Dataset.from_dict(rows, features=TASK.tokenised_features()).save_to_disk(str(tmp_path / "train"))
    return batching.TokenisedSplit(tmp_path, "train", stored_columns({"task": "masked_lm"}))


def masks_by_row_and_epoch(dataset, collate, micro_batch, world_size, start_step, max_steps, workers=0):
    """{(row id, epoch): (masked input ids, labels)} as the training loop's loaders deliver them."""
    from workflow_scripts.data import batching

    plan = batching.GlobalBatchPlan(dataset.lengths(), 4, seed=11)
    found = {}
    for rank in range(world_size):
        sampler = batching.RankBatchSampler(plan, micro_batch, rank, world_size, start_step, max_steps)
        # The loader walks the sampler's micro-batches: `accumulation` of them per step, in step order.
        epochs = [step // plan.batches_per_epoch for step in range(start_step, max_steps)
                  for _ in range(sampler.accumulation)]
        loader = batching.build_loader(dataset, sampler, collate, workers, False, seed=11)
        for epoch, batch in zip(epochs, loader, strict=True):
            for k, row_id in enumerate(batch["row_ids"]):
                real = batch["attention_mask"][k] == 1
                found[(row_id, epoch)] = (tuple(batch["input_ids"][k][real].tolist()),
                                          tuple(batch["labels"][k][real].tolist()))
    return found


@pytest.mark.parametrize("whole_word", [False, True])
def test_masks_change_every_epoch_with_one_row_per_micro_batch(tokenizer, tmp_path, whole_word):
    """Issue 22 point 4: micro_batch 1 used to give a row the same mask and corruption in every epoch
    (the generator was seeded by the seed and the row ids only). Now (seed, epoch, row ids): a row's
    masks differ between epochs, and stay the same for 1 or 2 processes, DataLoader workers and resume."""
    dataset = saved_split(tokenizer, tmp_path, toy_lines(8, seed=12, low=10, high=14),
                          {"grouping": "lines", "whole_word": whole_word})
    assert len(dataset) == 8
    collate = make_collator(tokenizer, seed=3, whole_word=whole_word)
    steps = 3 * 2  # effective batch 4 of 8 rows: 2 steps per epoch, 3 epochs
    once = masks_by_row_and_epoch(dataset, collate, 1, 1, 0, steps)
    assert len(once) == 8 * 3 and {epoch for _, epoch in once} == {0, 1, 2}
    distinct = 0
    for row_id in {row_id for row_id, _ in once}:
        per_epoch = {once[(row_id, epoch)] for epoch in range(3)}
        assert len(per_epoch) > 1, f"row {row_id}: the same mask and corruption in all three epochs"
        distinct += len(per_epoch)
    assert distinct >= 20  # of 24: a repeat only by chance (few whole words fit a short row's budget)
    assert masks_by_row_and_epoch(dataset, make_collator(tokenizer, seed=3, whole_word=whole_word), 1, 1, 0, steps) == once
    assert masks_by_row_and_epoch(dataset, collate, 1, 2, 0, steps) == once  # 2 processes: ranks 0 and 1
    resumed = masks_by_row_and_epoch(dataset, collate, 1, 1, 3, steps)  # resumed mid-epoch 1
    assert resumed == {key: value for key, value in once.items() if key in resumed} and len(resumed) == 3 * 4
    assert masks_by_row_and_epoch(dataset, collate, 1, 1, 0, steps, workers=2) == once
    other_seed = masks_by_row_and_epoch(dataset, make_collator(tokenizer, seed=4, whole_word=whole_word), 1, 1, 0, steps)
    assert other_seed.keys() == once.keys() and other_seed != once


def test_held_out_rows_get_the_same_mask_every_time_and_epochs_never_mix(tokenizer, tmp_path):
    dataset = saved_split(tokenizer, tmp_path, toy_lines(8, seed=12), {"grouping": "lines"})
    collate = make_collator(tokenizer, seed=3)
    held_out = dataset.__getitems__([0, 1, 2])  # as validation.held_out_loss fetches them: no epoch
    assert all("epoch" not in row for row in held_out)
    assert torch.equal(collate(held_out)["input_ids"], collate(held_out)["input_ids"])
    mixed = [{**held_out[0], "epoch": 0}, {**held_out[1], "epoch": 1}]
    with pytest.raises(WorkflowError, match="mixes epochs"):
        collate(mixed)


def test_special_tokens_never_masked_and_every_row_has_a_masked_token(tokenizer):
    rows = as_rows(tokenise(tokenizer, ["dog", "fox jumps"] + toy_lines(30, seed=4), {"grouping": "lines"}))
    for seed in range(20):
        batch = make_collator(tokenizer, seed=seed, mask_rate=0.05)(rows)
        labels = batch["labels"]
        assert ((labels != -100).sum(dim=1) >= 1).all()
        assert not torch.isin(labels[labels != -100], torch.tensor(tokenizer.all_special_ids)).any()
        assert ((labels == -100) | (batch["attention_mask"] == 1)).all()
        assert batch["target_tokens"] == int((labels != -100).sum()) == len(batch["target_ids"])
        assert batch["real_tokens"] + batch["padded_tokens"] == labels.numel()


def test_whole_word_masks_every_piece_of_a_chosen_word(tokenizer):
    rows = as_rows(tokenise(tokenizer, toy_lines(60, seed=5), {"grouping": "blocks", "whole_word": True}, 32))
    batch = make_collator(tokenizer, seed=1, whole_word=True)(rows)
    chosen = (batch["labels"] != -100).numpy()
    split_words = 0
    for k, row in enumerate(rows):
        starts = np.array(row["word_start"])
        special = np.array(row["special_tokens_mask"])
        word = np.cumsum(starts | special | (np.arange(len(starts)) == 0))
        for w in np.unique(word[chosen[k, :len(starts)]]):
            members = (word == w) & ~special
            split_words += members.sum() > 1
            assert chosen[k, :len(starts)][members].all(), f"row {row['id']}: part of word {w} left unmasked"
    assert split_words > 0  # the test exercised words of several pieces
    rate = chosen.sum() / sum((~np.array(r["special_tokens_mask"])).sum() for r in rows)
    assert 0.10 < rate <= 0.16


SENTENCEPIECE_STYLES = ("unigram_metaspace_no_split", "bpe_split_after_normaliser", "bpe_no_pre_tokenizer")


def sentencepiece_style(style: str):
    """Tokenizers whose pre-tokenizer never splits a line, as transformers' converters of sentencepiece
    models build them: Llama-style ``Metaspace(split=False)``, Gemma-style ``Split(" ")`` after a
    normaliser that turned spaces into "▁", and Llama-2-style no pre-tokenizer after a Prepend/Replace
    normaliser. Trained with a splitting Metaspace (as sentencepiece trains on words), then switched."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>", "<mask>"]
    prepend = "never" if style == "bpe_split_after_normaliser" else "always"
    if style == "unigram_metaspace_no_split":
        backend = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=70, special_tokens=specials, unk_token="<unk>")
    else:
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=70, special_tokens=specials)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend, split=True)
    backend.train_from_iterator(toy_lines(400), trainer)
    if style == "unigram_metaspace_no_split":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    elif style == "bpe_split_after_normaliser":
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    else:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        backend.pre_tokenizer = None
    bos, eos = backend.token_to_id("<s>"), backend.token_to_id("</s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", mask_token="<mask>")


@pytest.mark.parametrize("style", ("wordpiece",) + SENTENCEPIECE_STYLES)
def test_whole_word_masking_masks_words_not_lines(tokenizer, style):
    """Issue 22 point 3: with a pre-tokenizer that never splits, each line was one word and the "at least one
    word" fallback masked all of it (~97 %). Words now come from offsets and the ▁/Ġ prefix: the masked
    share stays within the budget, and every masked word (the text's own words, from the character
    offsets) is masked whole."""
    tok = tokenizer if style == "wordpiece" else sentencepiece_style(style)
    lines = toy_lines(40, seed=13, low=8, high=14)
    if style != "wordpiece":  # the point of these tokenizers: the pre-tokenizer sees each line as one word
        assert {w for w in tok(lines[0]).word_ids() if w is not None} == {0}
    rows = as_rows(tokenise(tok, lines, {"grouping": "lines", "whole_word": True}, max_length=96))
    assert len(rows) == len(lines)
    offsets = tok(lines, return_offsets_mapping=True)["offset_mapping"]
    several_pieces = 0
    for seed in range(4):
        batch = make_collator(tok, seed=seed, whole_word=True)(rows)
        chosen = (batch["labels"] != -100).numpy()
        maskable = [int((~np.array(r["special_tokens_mask"])).sum()) for r in rows]
        budget = sum(max(1, math.floor(n * 0.15 + 0.5)) for n in maskable)  # BERT's num_to_predict per row
        assert 0.8 * budget <= chosen.sum() <= budget, (style, seed, chosen.sum(), budget)
        assert 0.11 < chosen.sum() / sum(maskable) < 0.17
        for k, (line, row) in enumerate(zip(lines, rows)):
            special = np.array(row["special_tokens_mask"])
            word = np.array([line[:end].count(" ") for _, end in offsets[k]])  # the text's words
            mine = chosen[k, :len(word)]
            assert mine.sum() < (~special).sum() / 2, f"{style}: row {row['id']} masked as a whole line"
            for w in np.unique(word[mine]):
                members = (word == w) & ~special
                several_pieces += members.sum() > 1
                assert mine[members].all(), f"{style}: row {row['id']}: part of word {w} left unmasked"
        assert "masked tokens" in masked_lm.check_batch(batch, tok)
    assert several_pieces > 0  # words of several pieces were masked whole


def test_gate_refuses_a_masked_share_far_from_the_mask_rate(tokenizer):
    """Lines taken for words: nothing fits the budget (0 %), or an "at least one word" fallback masks the
    whole lines (issue 22: 96.8 %); the gate refuses both, naming the tokenizer and the share."""
    tok = sentencepiece_style("unigram_metaspace_no_split")
    rows = as_rows(tokenise(tok, toy_lines(16, seed=14, low=8, high=14), {"grouping": "lines", "whole_word": True}, 96))
    lines_as_words = [{**row, "word_start": [not s and (k == 0 or row["special_tokens_mask"][k - 1])
                                             for k, s in enumerate(row["special_tokens_mask"])]} for row in rows]
    nothing = make_collator(tok, seed=0, whole_word=True)(lines_as_words)
    assert int((nothing["labels"] != -100).sum()) == 0  # BERT's rule: a word larger than the budget is skipped
    with pytest.raises(WorkflowError, match=r"masked_lm_batch: no token is masked .*0\.0%.*tokenizer "
                                            r"'[^']+' \(.*pre_tokenizer Metaspace, model Unigram\)"):
        masked_lm.check_batch(nothing, tok)
    good = make_collator(tok, seed=0, whole_word=True)(rows)
    original = torch.where(good["labels"] != -100, good["labels"], good["input_ids"])
    plain = (good["attention_mask"] == 1) & ~torch.isin(original, torch.tensor(tok.all_special_ids))
    whole_lines = {**good, "labels": torch.where(plain, original, -100),
                   "input_ids": torch.where(plain, tok.mask_token_id, original)}
    whole_lines["target_index"] = (whole_lines["labels"] != -100).reshape(-1).nonzero().squeeze(1)
    share = float(plain.sum()) / float(plain.sum())
    with pytest.raises(WorkflowError, match=rf"masked_lm_batch: {int(plain.sum())} of {int(plain.sum())} maskable "
                                            rf"tokens are masked \({share:.1%}\) with tokenizer .*more than the budget"):
        masked_lm.check_batch(whole_lines, tok)
    assert "masked tokens" in masked_lm.check_batch(good, tok)


# Loss and training --------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [tiny_bert, tiny_roberta])
def test_loss_is_huggingfaces_mean_loss_times_masked_tokens(tokenizer, build):
    model = build(tokenizer).eval()
    rows = as_rows(tokenise(tokenizer, toy_lines(12, seed=6), {"grouping": "lines"}, max_length=20))
    batch = make_collator(tokenizer, seed=0)(rows)
    ours = TASK.loss_module(model)(batch)
    reference = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    assert torch.allclose(ours, reference * batch["target_tokens"], rtol=1e-5)


def test_loss_through_a_lora_wrapper(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = tiny_bert(tokenizer).eval()
    rows = as_rows(tokenise(tokenizer, toy_lines(6, seed=6), max_length=20))
    batch = make_collator(tokenizer)(rows)
    plain = TASK.loss_module(model)(batch)
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["query", "value"], task_type=TASK.peft_task_type))
    assert torch.allclose(TASK.loss_module(wrapped)(batch), plain, rtol=1e-5)  # fresh LoRA B = 0: same function


def test_a_few_steps_from_scratch_reduce_the_loss_on_a_repetitive_corpus(tokenizer):
    lines = ["the quick brown fox jumps over the lazy dog"] * 64
    rows = as_rows(tokenise(tokenizer, lines, {"grouping": "blocks"}, max_length=24))
    test = [{"id": f"t-{k}", "text": line} for k, line in enumerate(lines[:16])]
    evaluation = EvaluationSettings.parse({"max_length": 24, "batch_size": 8})
    model = tiny_bert(tokenizer, seed=1)
    before = TASK.evaluate(model, tokenizer, typed({}), test, "mlm_loss", evaluation, torch.device("cpu")).score
    loss_module = TASK.loss_module(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    collate = make_collator(tokenizer, seed=0)
    for step in range(40):
        batch = collate([rows[(step * 8 + k) % len(rows)] for k in range(8)])
        loss = loss_module(batch) / batch["target_tokens"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = TASK.evaluate(model, tokenizer, typed({}), test, "mlm_loss", evaluation, torch.device("cpu")).score
    assert after < before - 1.0, (before, after)  # nats per masked token; ln(90) = 4.5 at the start


# Evaluation ---------------------------------------------------------------------------------------
def test_evaluation_mask_is_fixed_and_scores_are_micro_averages(tokenizer):
    model = tiny_bert(tokenizer).eval()
    rows = [{"id": f"t-{k}", "text": line} for k, line in enumerate(toy_lines(20, seed=8))]
    evaluation = EvaluationSettings.parse({"max_length": 12, "batch_size": 6})
    first = TASK.evaluate(model, tokenizer, typed({}), rows, "masked_accuracy", evaluation, torch.device("cpu"))
    torch.manual_seed(99)
    other_variant = TASK.evaluate(model, tokenizer, typed({"mask_rate": 0.4, "whole_word": True}), rows[::-1],
                                  "masked_accuracy", evaluation.replace(batch_size=4), torch.device("cpu"))
    by_id = {r["id"]: r for r in other_variant.records}
    for record in first.records:  # same positions (the same losses), whatever the variant, order, batching
        assert record["masked"] == by_id[record["id"]]["masked"]
        assert record["loss_sum"] == pytest.approx(by_id[record["id"]]["loss_sum"], rel=1e-5)
    masked = sum(r["masked"] for r in first.records)
    assert first.score == pytest.approx(sum(r["correct"] for r in first.records) / masked)
    assert all(r["counts"] == [r["correct"], r["masked"]] for r in first.records)
    assert first.details["scores"]["perplexity"] == pytest.approx(np.exp(first.details["scores"]["mlm_loss"]))
    assert first.details["truncated_lines"] == sum(len(tokenizer(r["text"])["input_ids"]) > 12 for r in rows) > 0
    perplexity = TASK.evaluate(model, tokenizer, typed({}), rows, "perplexity", evaluation, torch.device("cpu"))
    assert perplexity.score == pytest.approx(first.details["scores"]["perplexity"])
    with pytest.raises(ConfigError, match="evaluation.max_length"):
        TASK.evaluate(model, tokenizer, typed({}), rows, "perplexity", EvaluationSettings.parse({"batch_size": 2}), torch.device("cpu"))


# Gate checks --------------------------------------------------------------------------------------
def test_gate_checks_refuse_planted_faults(tokenizer):
    from transformers import PreTrainedTokenizerFast

    rows = as_rows(tokenise(tokenizer, toy_lines(16, seed=9), max_length=24))
    good = make_collator(tokenizer, seed=0)(rows)
    assert "masked tokens" in masked_lm.check_batch(good, tokenizer)
    assert "[MASK]" in masked_lm.check_tokenizer(tokenizer)

    def planted(**changes):
        batch = {**good, **changes}
        labels = batch["labels"]
        batch["target_index"] = (labels != -100).reshape(-1).nonzero().squeeze(1)
        return batch

    nothing_masked = planted(labels=torch.full_like(good["labels"], -100))
    plain = (good["attention_mask"] == 1) & ~torch.isin(good["input_ids"], torch.tensor(tokenizer.all_special_ids))
    every_token_labelled = planted(labels=torch.where(plain, good["input_ids"], -100))  # a causal-LM style collator
    special_labelled = good["labels"].clone()
    special_labelled[:, 0] = tokenizer.cls_token_id
    for batch, message in ((nothing_masked, "no token is masked"), (every_token_labelled, "unmasked positions"),
                           (planted(labels=special_labelled), "special token")):
        with pytest.raises(WorkflowError, match=message):
            masked_lm.check_batch(batch, tokenizer)
    no_mask = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, pad_token="[PAD]")
    with pytest.raises(WorkflowError, match="masked_lm_tokenizer: the tokenizer has no mask token. Fix: "):
        masked_lm.check_tokenizer(no_mask)


def test_from_text_files_through_a_grouping_map_to_batches(tokenizer, tmp_path):
    """The stages' path at small scale: text files -> normalised Arrow -> batched map that changes the
    row count (allowed because the old columns are removed) -> collated batches."""
    import functools

    from datasets import load_from_disk

    from workflow_scripts.data.text_lines import write_normalised

    (tmp_path / "corpus.txt").write_text("\n".join(toy_lines(300, seed=10)) + "\n\n")
    write_normalised({"train": [tmp_path / "corpus.txt"]}, tmp_path / "normalised")
    train = load_from_disk(str(tmp_path / "normalised"))["train"]
    tokenised = train.map(
        functools.partial(TASK.tokenise_batch, tokenizer=tokenizer, variant=typed({}), max_length=64),
        batched=True, batch_size=100, remove_columns=train.column_names, features=TASK.tokenised_features(),
    )
    assert len(tokenised) != len(train) and sum(tokenised["dropped"]) == 3  # one short remainder per map batch
    kept = tokenised.filter(lambda row: not row["dropped"])
    assert set(kept["length"]) == {64}
    batch = make_collator(tokenizer, seed=0)(list(kept.select(range(8))))
    assert batch["input_ids"].shape == (8, 64) and batch["target_tokens"] > 0
    assert "masked tokens" in masked_lm.check_batch(batch, tokenizer)


def test_eval_mask_records_what_decides_the_scored_tokens(tokenizer):
    """The fairness guard compares eval.json's eval_mask: the same for every variant at one max_length,
    different when the lines are cut elsewhere (other tokens scored)."""
    model = tiny_bert(tokenizer).eval()
    rows = [{"id": f"t-{k}", "text": line} for k, line in enumerate(toy_lines(12, seed=8))]

    def eval_mask(variant, max_length):
        result = TASK.evaluate(model, tokenizer, typed(variant), rows, "mlm_loss",
                               EvaluationSettings.parse({"max_length": max_length, "batch_size": 4}),
                               torch.device("cpu"))
        return result.details["eval_mask"]

    short = eval_mask({}, 12)
    assert short["max_length"] == 12 and len(short["positions_sha256"]) == 64
    assert eval_mask({"mask_rate": 0.3, "whole_word": True}, 12) == short
    longer = eval_mask({}, 24)
    assert longer["max_length"] == 24 and longer["positions_sha256"] != short["positions_sha256"]
