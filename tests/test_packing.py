"""Exact packing (workflow_scripts/data/packing.py): a packed example trains exactly as it would alone.

Tiny random Llama and Qwen2 (the shape of conftest.build_tiny_model), both attention paths that take a
4D mask (sdpa: bool, eager: additive). The reference for every example is the model's forward on that
example alone, with no mask and default positions.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_EOS, TINY_PAD, TINY_VOCAB, tiny_training_settings
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data import batching, packing

MAX_LENGTH = 48
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=TINY_VOCAB, max_position_embeddings=256, pad_token_id=TINY_PAD, bos_token_id=1,
              eos_token_id=TINY_EOS, tie_word_embeddings=False)


def tiny(family: str, attn_implementation: str = "sdpa", **extra):
    import transformers

    config_class, model_class, kv_heads = {"llama": ("LlamaConfig", "LlamaForCausalLM", 4),
                                           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 2)}[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, num_key_value_heads=kv_heads,
                                                 attn_implementation=attn_implementation, **extra)
    return getattr(transformers, model_class)(config).eval()


def example_rows(lengths=(5, 17, 9, 3, 12, 21, 7, 30), seed=0) -> list[dict]:
    """Prompt then target (+eos) of varied lengths; the first example has a target from its first token."""
    rng = np.random.default_rng(seed)
    rows = []
    for k, n in enumerate(lengths):
        ids = rng.integers(3, TINY_VOCAB, size=n).tolist()
        ids[-1] = TINY_EOS
        prompt = 0 if k == 0 else max(1, n // 2)
        rows.append({"id": f"ex-{k}", "input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def loss_alone(model, row) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
    return F.cross_entropy(logits.float(), torch.tensor(row["labels"][1:]), ignore_index=-100, reduction="sum")


def packed_logits(model, batch, attention_mask=None):
    # flex_attention: the collator sends no dense mask; the BlockMask is built from segment_ids (as the loss does)
    mask = packing.attention_mask_of(batch) if attention_mask is None else attention_mask
    return model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]).logits


def per_example_losses(logits, batch, rows) -> dict[str, torch.Tensor]:
    by_id = {r["id"]: r for r in rows}
    losses = {}
    for row_id, (r, start, n) in zip(batch["row_ids"], batch["example_spans"]):
        targets = torch.tensor(by_id[row_id]["labels"][1:])
        losses[row_id] = F.cross_entropy(logits[r, start:start + n - 1].float(), targets, ignore_index=-100,
                                         reduction="sum")
    return losses


# flex_attention (training.flex_attention) compiles its kernel with Inductor, also on CPU (about a minute there).
@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_packed_example_has_its_unpacked_loss(family, attn):
    torch.set_num_threads(1)
    model, rows = tiny(family, attn), example_rows()
    batch = packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH, attn)(rows)
    padding_alone = len(rows) * max(len(r["input_ids"]) for r in rows) - batch["real_tokens"]
    assert batch["input_ids"].shape[0] < len(rows) and batch["padded_tokens"] < padding_alone / 4
    assert any(start > 0 for _, start, _ in batch["example_spans"])  # examples really share rows
    with torch.no_grad():
        logits = packed_logits(model, batch)
        packed = per_example_losses(logits, batch, rows)
        for row in rows:
            assert float(packed[row["id"]]) == pytest.approx(float(loss_alone(model, row)), rel=1e-5), row["id"]
        # What the training loss gathers (target_index / target_ids) is exactly the sum of those losses.
        flat = logits[:, :-1].reshape(-1, logits.shape[-1]).index_select(0, batch["target_index"])
        total = F.cross_entropy(flat.float(), batch["target_ids"], reduction="sum")
    assert float(total) == pytest.approx(sum(float(v) for v in packed.values()), rel=1e-5)
    assert batch["target_tokens"] == sum(sum(t != -100 for t in r["labels"][1:]) for r in rows)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_plain_causal_mask_or_the_wrong_mask_form_leaks_and_is_caught(family):
    torch.set_num_threads(1)
    rows = example_rows()
    sdpa_batch = packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH, "sdpa")(rows)
    width = sdpa_batch["input_ids"].shape[1]
    plain = torch.ones(width, width, dtype=torch.bool).tril().expand(sdpa_batch["input_ids"].shape[0], 1, -1, -1)
    with torch.no_grad():
        sdpa = tiny(family, "sdpa")
        alone = {r["id"]: float(loss_alone(sdpa, r)) for r in rows}
        leaky = per_example_losses(packed_logits(sdpa, sdpa_batch, plain), sdpa_batch, rows)
        # eager adds its mask to the scores: the bool form (right for sdpa) adds 0/1 there and leaks
        wrong_form = per_example_losses(packed_logits(tiny(family, "eager"), sdpa_batch), sdpa_batch, rows)
        # transformers infers packing from position_ids only without a mask: a 2D padding mask leaks
        padding_mask = (sdpa_batch["segment_ids"] >= 0).long()
        with_2d = per_example_losses(packed_logits(sdpa, sdpa_batch, padding_mask), sdpa_batch, rows)
    for losses in (leaky, wrong_form, with_2d):
        later = [i for i, (_, start, _) in zip(sdpa_batch["row_ids"], sdpa_batch["example_spans"]) if start > 0]
        assert any(abs(float(losses[i]) - alone[i]) > 1e-3 * alone[i] for i in later)


def lora_with_nonzero_b(architecture: str, lora=None, seed: int | None = None):
    """A tiny model with LoRA (``lora``: settings, default the tiny training settings') whose B matrices are random
    (PEFT starts them at zero, where the adapters' gradients would not depend on the packing at all), drawn after
    ``torch.manual_seed(seed)`` where given, in eval mode (no dropout)."""
    from workflow_scripts.model import model_loading

    peft_model = model_loading.add_lora(tiny(architecture), lora or tiny_training_settings().lora,
                                        gradient_checkpointing=False)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    return peft_model.eval()


def test_gradients_of_a_packed_batch_equal_the_sum_over_examples():
    torch.set_num_threads(1)
    peft_model = lora_with_nonzero_b("llama")
    rows = example_rows()
    lora = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    sum(loss_alone(peft_model, r) for r in rows).backward()
    expected = {n: p.grad.clone() for n, p in lora.items()}
    peft_model.zero_grad()
    batch = packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH)(rows)
    logits = packed_logits(peft_model, batch)  # through PeftModel's forward: position_ids pass through
    sum(per_example_losses(logits, batch, rows).values()).backward()
    for name, parameter in lora.items():
        torch.testing.assert_close(parameter.grad, expected[name], rtol=1e-4, atol=1e-6)


def test_positions_restart_boundaries_are_masked_and_padding_is_a_segment_of_its_own():
    rows = example_rows()
    batch = packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH)(rows)
    by_id = {r["id"]: r for r in rows}
    assert sorted(batch["row_ids"]) == sorted(by_id)
    shifted = batch["labels"][:, 1:]
    mask = batch["attention_mask"][:, 0]
    for row_id, (r, start, n) in zip(batch["row_ids"], batch["example_spans"]):
        assert batch["position_ids"][r, start:start + n].tolist() == list(range(n))
        assert batch["input_ids"][r, start:start + n].tolist() == by_id[row_id]["input_ids"]
        assert batch["labels"][r, start] == -100  # never the target of the previous example's last token
        if start > 0:
            assert shifted[r, start - 1] == -100
            assert not mask[r, start:start + n, :start].any()  # no query of this example sees an earlier one
        block = mask[r, start:start + n, start:start + n]
        assert torch.equal(block, torch.ones(n, n, dtype=torch.bool).tril())
    width = batch["input_ids"].shape[1]
    for r in range(batch["input_ids"].shape[0]):
        real = int((batch["segment_ids"][r] >= 0).sum())
        assert (batch["segment_ids"][r, real:] == -1).all() and (batch["labels"][r, real:] == -100).all()
        assert mask[r].diagonal().all()  # every query attends to something: no NaN rows in sdpa
        assert not mask[r, real:, :real].any() and not mask[r, :real, real:].any()
    assert batch["real_tokens"] + batch["padded_tokens"] == batch["input_ids"].shape[0] * width
    eager = packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH, "eager")(rows)["attention_mask"]
    assert eager.dtype == torch.float32 and torch.equal(eager == 0, batch["attention_mask"])


def test_packing_is_deterministic_and_never_uses_more_slots_than_padding():
    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(1, 200, size=int(rng.integers(1, 12))).tolist()
        bins = packing.pack(lengths, 256)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
        assert len(bins) * max(sum(lengths[i] for i in b) for b in bins) <= len(lengths) * max(lengths)
        assert packing.pack(lengths, 256) == bins
    # Packing up to max_length alone would lose here: 2 rows of 160 against 3 rows of 100.
    assert packing.first_fit_decreasing([100, 60, 60], 160) == [[0, 1], [2]]
    assert packing.pack([100, 60, 60], 160) == [[0], [1], [2]]


def test_bad_rows_fail_naming_the_row():
    collator = packing.PackingCollator(TINY_PAD, TINY_VOCAB, 16)
    rows = example_rows((5, 6))
    with pytest.raises(WorkflowError, match="more than training.max_length 16"):
        collator(example_rows((5, 17)))
    rows[1]["input_ids"][2] = TINY_VOCAB + 3
    with pytest.raises(WorkflowError, match="row 'ex-1': token id 131 is outside"):
        collator(rows)
    with pytest.raises(WorkflowError, match="every label is masked"):
        collator([{"id": "x", "input_ids": [4, 5, 6], "labels": [-100, -100, -100]}])
    with pytest.raises(WorkflowError, match="cannot take a 4D mask"):
        packing.PackingCollator(TINY_PAD, TINY_VOCAB, 16, "flash_attention_2")


def test_supports_packing_accepts_mask_honouring_paths_and_refuses_the_others():
    from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

    for family in ("llama", "qwen2"):
        for attn in ("sdpa", "eager"):
            ok, reason = packing.supports_packing(tiny(family, attn))
            assert ok, reason
    ok, reason = packing.supports_packing(tiny("llama", "flex_attention"))  # training.flex_attention's BlockMask
    assert ok, reason
    flash = tiny("llama")
    flash.config._attn_implementation = "flash_attention_2"
    ok, reason = packing.supports_packing(flash)
    assert not ok and "flash" in reason
    windowed = tiny("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert not packing.supports_packing(windowed, max_length=64)[0]
    assert packing.supports_packing(windowed, max_length=16)[0]  # the window never bites
    # Mistral has no layer_types: its sliding_window applies to every layer
    mistral = MistralForCausalLM(MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=16))
    assert not packing.supports_packing(mistral, max_length=64)[0]
    assert packing.supports_packing(mistral, max_length=16)[0]

    class IgnoresMaskAndPositions(LlamaForCausalLM):  # what a forward that rebuilds its own mask amounts to
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            return super().forward(input_ids=input_ids, **kwargs)

    torch.manual_seed(0)
    ok, reason = packing.supports_packing(IgnoresMaskAndPositions(tiny("llama").config).eval())
    assert not ok and "does not honour" in reason


def test_the_plan_is_unchanged_packed_on_1_or_2_ranks(tiny_tokenised_dir):
    """Packing works inside a micro-batch: each rank sees the examples it sees unpacked, so 1 and 2
    processes (and a resumed run) cover the same examples per step."""
    dataset = batching.TokenisedSplit(tiny_tokenised_dir)
    plan = batching.GlobalBatchPlan(dataset.lengths(), effective_batch=8, seed=3)
    collator = packing.PackingCollator(TINY_PAD, TINY_VOCAB, 64)
    seen = {}
    for world in (1, 2):
        ids = []
        for rank in range(world):
            sampler = batching.RankBatchSampler(plan, 4, rank, world, start_step=2, max_steps=5)
            for indices in sampler:
                batch = collator(dataset.__getitems__(indices))
                assert sorted(batch["row_ids"]) == sorted(dataset.table[indices]["id"])
                ids.extend(batch["row_ids"])
        seen[world] = sorted(ids)
    assert seen[1] == seen[2] and len(seen[1]) == 3 * 8


def test_packing_cuts_padding_on_a_long_tailed_length_distribution():
    from benchmarks import synthetic

    lengths = synthetic.long_tailed_lengths(4096, 16, 512, 64, 0.9, seed=13)
    for grouped, most in ((True, 0.05), (False, 0.15)):
        plan = batching.GlobalBatchPlan(lengths, effective_batch=32, seed=1, group_by_length=grouped)
        padded = packed = real = 0
        for step in range(plan.batches_per_epoch):
            for micro in plan.micro_batches(step, 16):
                group = lengths[micro].tolist()
                bins = packing.pack(group, 512)
                real += sum(group)
                padded += len(group) * max(group)
                packed += len(bins) * max(sum(group[i] for i in b) for b in bins)
        padded_share, packed_share = 1 - real / padded, 1 - real / packed
        assert packed_share <= padded_share and packed_share < most, (grouped, packed_share, padded_share)
        if not grouped:  # random micro-batches: packing removes most of the padding
            assert packed_share < padded_share / 4


def generation_loss_class():
    """The generation task's loss (tasks/generation.py; training_setup.py before the task interface)."""
    try:
        from workflow_scripts.tasks.generation import TargetTokenLoss
    except ImportError:
        from workflow_scripts.training.training_setup import TargetTokenLoss
    return TargetTokenLoss


@pytest.mark.skipif("position_ids" not in inspect.getsource(generation_loss_class().forward),
                    reason="TargetTokenLoss does not pass position_ids to the model yet (wiring of training.packing)")
def test_target_token_loss_on_a_packed_batch_is_the_sum_of_unpacked_losses():
    from workflow_scripts.model import model_loading

    model = model_loading.add_lora(tiny("llama"), tiny_training_settings().lora, gradient_checkpointing=False)
    model.eval()
    rows = example_rows()
    batch = packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH)(rows)
    loss_module = generation_loss_class()(model)
    with torch.no_grad():
        if "batch" in inspect.signature(loss_module.forward).parameters:
            loss = loss_module(batch)
        else:
            loss = loss_module(batch["input_ids"], batch["attention_mask"], batch["target_index"],
                               batch["target_ids"], position_ids=batch["position_ids"])
        expected = sum(float(loss_alone(model, r)) for r in rows)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_the_packing_benchmark_runs_at_tiny_scale(tmp_path):
    """Harness only (no timing asserted): every side measured, the packed side pads least of our loop's."""
    from benchmarks import bench_packing

    torch.set_num_threads(1)
    rec = bench_packing.run("tiny", work_dir=tmp_path, log=lambda *_: None)
    assert rec["status"] == "measured" and rec["ours"]["samples"] and rec["reference"]["samples"]
    assert len(rec["others"]) == 5 and all(o["samples"] for o in rec["others"])
    # The token-budget side (micro_batch_tokens = micro_batch x max_length) runs fewer, fuller micro-steps.
    for label in ("ours: packed to a token budget", "ours: padded to a token budget"):
        budget = next(o for o in rec["others"] if o["label"].startswith(label))
        assert budget["details"]["micro_steps_per_step"] < rec["setup"]["effective_batch"] // rec["setup"]["micro_batch"]
    assert any(g["description"].startswith("packed to a token budget / Trainer group_by_length") for g in rec["goals"])
    plans = rec["setup"]["padding_share_of_batch_plans"]
    assert plans["packed_random"] < plans["padded_random"] and plans["packed_grouped"] <= plans["padded_grouped"]


# --- issue 45: no dense mask under FlexAttention, full padding-free rows ---
def test_no_dense_mask_is_built_under_flex_attention(monkeypatch):
    """Under FlexAttention the loss module builds a BlockMask from segment_ids on the device; the collator
    built the dense [rows, 1, W, W] mask anyway and threw it away (128 MiB of CPU work per 8 x 4,096 batch)."""
    rows = example_rows()
    sdpa = packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH, "sdpa")(rows)

    def refused(segment_ids):
        raise AssertionError("the dense block mask was built under flex_attention")

    monkeypatch.setattr(packing, "block_causal_mask", refused)
    flex = packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH, "flex_attention")(rows)
    assert flex["attention_mask"] is None
    for key in ("input_ids", "position_ids", "labels", "target_index", "target_ids", "segment_ids"):
        assert torch.equal(flex[key], sdpa[key]), key
    assert flex["example_spans"] == sdpa["example_spans"] and flex["row_ids"] == sdpa["row_ids"]


def test_one_row_packing_gives_the_same_loss_and_gradients_as_packed_rows():
    """``one_row``: every example of the micro-batch in one padding-free row (the benchmark's full rows). Each
    example keeps its own loss, and the LoRA gradients equal those of the multi-row packing. Tolerance: fp32,
    the same per-example sums over a different row layout, so only the order of additions differs (attention
    softmax over at most W keys, the row's matmuls): rounding of about sqrt(W) x eps per reduction, W = 128
    here, times the few reductions in a 2-layer model: 8 x sqrt(128) x eps = 1.1e-5 relative."""
    torch.set_num_threads(1)
    tolerance = 8 * 128 ** 0.5 * torch.finfo(torch.float32).eps
    peft_model = lora_with_nonzero_b("qwen2")
    rows = example_rows()
    lora = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    results = []
    for collator in (packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH),
                     packing.PackingCollator(TINY_PAD, TINY_VOCAB, MAX_LENGTH, one_row=True, width_multiple=16)):
        batch = collator(rows)
        losses = per_example_losses(packed_logits(peft_model, batch), batch, rows)
        sum(losses.values()).backward()
        results.append((batch, {k: float(v.detach()) for k, v in losses.items()}, {n: p.grad.clone() for n, p in lora.items()}))
        peft_model.zero_grad()
    (packed, packed_losses, packed_grads), (one, one_losses, one_grads) = results
    total = sum(len(r["input_ids"]) for r in rows)
    assert one["input_ids"].shape == (1, -(-total // 16) * 16) and one["padded_tokens"] < 16
    assert packed["input_ids"].shape[0] > 1  # the plain path really has several rows
    for row_id, loss in packed_losses.items():
        assert one_losses[row_id] == pytest.approx(loss, rel=tolerance), row_id
    for name, grad in packed_grads.items():
        torch.testing.assert_close(one_grads[name], grad, rtol=tolerance, atol=tolerance * float(grad.abs().max()))


def test_full_rows_pad_under_5_percent_on_the_benchmarks_lengths():
    """The 7B benchmark's rows (64..4,096 tokens, median 600): each step cut into full rows of its token budget
    (16,384) pads under 5 %; packing each micro-batch of 8 into rows of max_length (today's side A) pads
    more (the audit: 19 %)."""
    from benchmarks import bench_gpu_7b

    settings = bench_gpu_7b.SCALES["7b"]
    e, steps = settings["effective_batch"], settings["warmup_steps"] + settings["timed_steps"]
    lengths = [int(n) for n in bench_gpu_7b.synthetic.long_tailed_lengths(
        steps * e, **{k: settings["length"][k] for k in ("low", "high", "median", "sigma")}, seed=41)]

    def padding(micro_batches, **options):
        # flex_attention: no dense [rows, 1, W, W] mask to build; the layout (and so the padding) is the same
        collator = packing.PackingCollator(TINY_PAD, 10, settings["max_length"], "flex_attention", **options)
        batches = [collator([{"id": f"r{k}", "input_ids": [5] * n, "labels": [5] * n} for k, n in enumerate(m)])
                   for m in micro_batches]
        return sum(b["padded_tokens"] for b in batches) / sum(b["input_ids"].numel() for b in batches)

    full, today = [], []
    for k in range(steps):
        step = lengths[k * e:(k + 1) * e]
        full += [step[a:b] for a, b in packing.full_row_cuts(step, settings["row_tokens"])]
        today += [step[a:a + settings["micro_batch"]] for a in range(0, e, settings["micro_batch"])]
    assert all(sum(m) <= settings["row_tokens"] for m in full)
    assert padding(full, one_row=True, width_multiple=settings["width_multiple"]) < 0.05
    assert padding(today) > 0.05
