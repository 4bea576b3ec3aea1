"""The masked_lm task on a tiny WordPiece tokenizer (built offline) and tiny random BERT / RoBERTa."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.tasks import masked_lm
from workflow_scripts.tasks.masked_lm import TASK

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
    return TASK.tokenise_batch(batch, tokenizer=tokenizer, variant=TASK.check_variant(variant or {}),
                               max_length=max_length)


def as_rows(columns) -> list[dict]:
    keep = [k for k, dropped in enumerate(columns["dropped"]) if not dropped]
    return [{key: columns[key][k] for key in ("id", "input_ids", "special_tokens_mask", "word_start")} for k in keep]


def make_collator(tokenizer, seed=0, **variant):
    meta = {"pad_token_id": tokenizer.pad_token_id, "mask_token_id": tokenizer.mask_token_id,
            "vocab_size": len(tokenizer), "templates": TASK.check_variant(variant)}
    return TASK.collator(meta, len(tokenizer), seed=seed)


# Variant, tokenising ------------------------------------------------------------------------------
def test_variant_defaults_and_refusals():
    assert TASK.check_variant({}) == {"mask_rate": 0.15, "whole_word": False, "grouping": "blocks"}
    assert TASK.variant_keys == {"mask_rate", "whole_word", "grouping"}
    for bad in ({"mask_rate": 0}, {"mask_rate": True}, {"whole_word": "yes"}, {"grouping": "docs"}, {"prompt": "x"}):
        with pytest.raises(WorkflowError):
            TASK.check_variant(bad)


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
    evaluation = {"max_length": 24, "batch_size": 8}
    model = tiny_bert(tokenizer, seed=1)
    before = TASK.evaluate(model, tokenizer, {}, test, "mlm_loss", evaluation, torch.device("cpu")).score
    loss_module = TASK.loss_module(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    collate = make_collator(tokenizer, seed=0)
    for step in range(40):
        batch = collate([rows[(step * 8 + k) % len(rows)] for k in range(8)])
        loss = loss_module(batch) / batch["target_tokens"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = TASK.evaluate(model, tokenizer, {}, test, "mlm_loss", evaluation, torch.device("cpu")).score
    assert after < before - 1.0, (before, after)  # nats per masked token; ln(90) = 4.5 at the start


# Evaluation ---------------------------------------------------------------------------------------
def test_evaluation_mask_is_fixed_and_scores_are_micro_averages(tokenizer):
    model = tiny_bert(tokenizer).eval()
    rows = [{"id": f"t-{k}", "text": line} for k, line in enumerate(toy_lines(20, seed=8))]
    evaluation = {"max_length": 12, "batch_size": 6}
    first = TASK.evaluate(model, tokenizer, {}, rows, "masked_accuracy", evaluation, torch.device("cpu"))
    torch.manual_seed(99)
    other_variant = TASK.evaluate(model, tokenizer, {"mask_rate": 0.4, "whole_word": True}, rows[::-1],
                                  "masked_accuracy", {"max_length": 12, "batch_size": 4}, torch.device("cpu"))
    by_id = {r["id"]: r for r in other_variant.records}
    for record in first.records:  # same positions (the same losses), whatever the variant, order, batching
        assert record["masked"] == by_id[record["id"]]["masked"]
        assert record["loss_sum"] == pytest.approx(by_id[record["id"]]["loss_sum"], rel=1e-5)
    masked = sum(r["masked"] for r in first.records)
    assert first.score == pytest.approx(sum(r["correct"] for r in first.records) / masked)
    assert all(r["counts"] == [r["correct"], r["masked"]] for r in first.records)
    assert first.details["scores"]["perplexity"] == pytest.approx(np.exp(first.details["scores"]["mlm_loss"]))
    assert first.details["truncated_lines"] == sum(len(tokenizer(r["text"])["input_ids"]) > 12 for r in rows) > 0
    perplexity = TASK.evaluate(model, tokenizer, {}, rows, "perplexity", evaluation, torch.device("cpu"))
    assert perplexity.score == pytest.approx(first.details["scores"]["perplexity"])
    with pytest.raises(ConfigError, match="evaluation.max_length"):
        TASK.evaluate(model, tokenizer, {}, rows, "perplexity", {"batch_size": 2}, torch.device("cpu"))


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
        functools.partial(TASK.tokenise_batch, tokenizer=tokenizer, variant=TASK.check_variant({}), max_length=64),
        batched=True, batch_size=100, remove_columns=train.column_names, features=TASK.tokenised_features(),
    )
    assert len(tokenised) != len(train) and sum(tokenised["dropped"]) == 3  # one short remainder per map batch
    kept = tokenised.filter(lambda row: not row["dropped"])
    assert set(kept["length"]) == {64}
    batch = make_collator(tokenizer, seed=0)(list(kept.select(range(8))))
    assert batch["input_ids"].shape == (8, 64) and batch["target_tokens"] > 0
    assert "masked tokens" in masked_lm.check_batch(batch, tokenizer)
