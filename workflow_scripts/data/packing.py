"""Exact packing (``training.packing: true``): several examples per row, nothing crossing examples.

What is packed: the rows of ONE micro-batch of the existing :class:`~workflow_scripts.data.batching.
GlobalBatchPlan`, into as few rows as fit. The plan, the rank split and the step a resumed run restarts
at are untouched, so which examples a step trains on is the same packed or not, for 1 or N processes.
Packing across micro-batches would pack tighter; ``training.micro_batch_tokens`` does the part of that which
keeps DDP's lockstep and resume: the plan fills each micro-batch to a token budget (a step's count of
micro-batches then follows its lengths, the same on every rank; data/batching.py), and this collator packs it.

Exactness, per attention implementation (transformers 5.x, ``masking_utils``):

* sdpa / eager: a 4D ``attention_mask`` is returned unchanged by ``create_causal_mask`` (its early
  exit), so the block-diagonal causal mask built here is exactly what every layer sees. sdpa takes a
  bool mask (True = attend); eager ADDS the mask to the scores, so a bool mask there adds 0/1 and leaks
  silently: eager gets an additive float mask (0 / most negative float32) instead.
* transformers also infers packing from restarting ``position_ids``, but only when ``attention_mask``
  is None AND there is no cache (``use_cache=False``; a plain forward without gradient checkpointing
  makes one); with a 2D mask (as a padding collator sends) it builds a plain causal mask and leaks. We
  do not rely on that inference.
* flash_attention_2/3: kernels take no dense mask; transformers un-pads by a 2D mask, or derives
  ``cu_seqlens`` from restarting ``position_ids`` only when the batch has ONE row (``_is_packed_sequence``).
  Exact packing there means one [1, N] row of all examples (or ``cu_seq_lens_q/k`` + ``max_length_q/k``
  kwargs); not wired here, so :func:`supports_packing` refuses it.
* flex_attention (``training.flex_attention: true``): the collator sends no dense mask; the loss module
  builds a FlexAttention ``BlockMask`` from ``segment_ids`` on the device (:func:`document_block_mask`),
  which ``create_causal_mask`` returns unchanged (its 4D early exit takes a BlockMask too). The kernel skips
  the blocks the mask empties, so packing keeps a fused attention kernel; the dense 4D mask moves SDPA off
  its flash kernel.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data.batching import IGNORE_INDEX

MASK_FORMS = {"sdpa": "bool", "eager": "additive", "flex_attention": "block"}  # implementations that honour our mask


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` tokens; deterministic (ties keep
    the input order), so a micro-batch packs identically on every rank and after a resume."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """The packing of one micro-batch with the fewest token slots (rows x width).

    Packing up to ``max_length`` can lose to plain padding (lengths 100, 60, 60 at 160: two rows of 160
    against three of 100), so a few capacities are tried, from the longest example (never worse than
    padding: at most one row per example, none wider) doubling up to ``max_length``; ties go to the
    smaller capacity (shorter rows: less attention spent on masked-out blocks).
    """
    longest = max(lengths)
    if longest > max_length:
        raise WorkflowError(f"an example has {longest} tokens, more than training.max_length {max_length}; "
                            "re-run pretokenise with this max_length")
    capacities, capacity = [], longest
    while capacity < max_length:
        capacities.append(capacity)
        capacity *= 2
    capacities.append(max_length)

    def slots(bins):
        return len(bins) * max(sum(lengths[i] for i in b) for b in bins)

    return min((first_fit_decreasing(lengths, c) for c in capacities), key=slots)  # min keeps the first


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[rows, 1, L, L] bool, True where query q may attend key k: same segment and k <= q.

    Padding is segment -1 of its row, so a padding query still attends to itself: a query with no key
    at all gives NaN in sdpa, and 0 x NaN in the backward would reach real gradients.
    """
    width = segment_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal).unsqueeze(1)


def mask_for(mask: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """The block mask in the form ``attn_implementation`` reads (see the module docstring)."""
    form = MASK_FORMS.get(attn_implementation)
    if form is None:
        raise WorkflowError(f"packing: attention implementation '{attn_implementation}' cannot take a 4D mask; "
                            f"use one of {sorted(MASK_FORMS)} (see packing.supports_packing)")
    if form == "bool":
        return mask
    if form == "block":
        return None  # built on the device from segment_ids by document_block_mask (a BlockMask is no tensor)
    # float32 whatever the compute dtype: eager adds it to bf16/fp16 scores, which promotes to float32.
    return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, torch.finfo(torch.float32).min)


class PackingCollator:
    """Packs a micro-batch and precomputes what the loss needs; same keys as ``PaddingCollator``.

    ``attention_mask`` is the 4D block-diagonal causal mask, ``position_ids`` restart at 0 for every
    example. The first label of every example is masked: alone, position 0 is never a target (nothing
    precedes it); packed, it would be the target of the previous example's last token. Extra keys:
    ``segment_ids`` [rows, L] (index of the example in the micro-batch, -1 on padding) and
    ``example_spans`` ((row, start, length) per entry of ``row_ids``).
    """

    def __init__(self, pad_token_id: int, vocab_size: int, max_length: int, attn_implementation: str = "sdpa",
                 one_row: bool = False, width_multiple: int = 1):
        mask_for(torch.ones(1, 1, 1, 1, dtype=torch.bool), attn_implementation)  # refuse unknown forms now
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.attn_implementation = attn_implementation
        # one_row: every example of the micro-batch in ONE row (padding-free, as TRL's padding_free): its width is
        # the examples' sum rounded up to width_multiple (FlexAttention's 128-token blocks: fewer shapes to compile),
        # so padding is below width_multiple tokens per micro-batch. The caller bounds the sum (a token budget).
        self.one_row = one_row
        self.width_multiple = max(1, int(width_multiple))

    def __call__(self, rows: list[dict]) -> dict:
        if not rows:
            raise WorkflowError("empty batch: the sampler produced a micro-batch without rows")
        lengths = []
        for row in rows:
            n = len(row["input_ids"])
            if n == 0 or len(row["labels"]) != n:
                raise WorkflowError(f"row '{row['id']}': input_ids has {n} tokens and labels {len(row['labels'])}; "
                                    "both must be equal and non-zero")
            lengths.append(n)
        if self.one_row:
            longest = max(lengths)
            if longest > self.max_length:
                raise WorkflowError(f"an example has {longest} tokens, more than training.max_length {self.max_length}; "
                                    "re-run pretokenise with this max_length")
            bins = [list(range(len(lengths)))]
            width = -(-sum(lengths) // self.width_multiple) * self.width_multiple
        else:
            bins = pack(lengths, self.max_length)
            width = max(sum(lengths[i] for i in b) for b in bins)
        shape = (len(bins), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        segment_ids = torch.full(shape, -1, dtype=torch.long)
        spans, row_ids = [], []
        for r, members in enumerate(bins):
            start = 0
            for i in members:
                n, end = lengths[i], start + lengths[i]
                input_ids[r, start:end] = torch.as_tensor(rows[i]["input_ids"], dtype=torch.long)
                labels[r, start:end] = torch.as_tensor(rows[i]["labels"], dtype=torch.long)
                labels[r, start] = IGNORE_INDEX
                position_ids[r, start:end] = torch.arange(n)
                segment_ids[r, start:end] = i
                spans.append((r, start, n))
                row_ids.append(rows[i]["id"])
                start = end
            position_ids[r, start:] = torch.arange(width - start)  # padding: a segment of its own
        bad = (input_ids >= self.vocab_size) | (input_ids < 0)
        if bad.any():
            r, t = (int(x) for x in bad.nonzero()[0])
            owner = row_ids[next(k for k, (sr, s, n) in enumerate(spans) if sr == r and s <= t < s + n)]
            raise WorkflowError(f"row '{owner}': token id {int(input_ids[r, t])} is outside the model's vocabulary "
                                f"(size {self.vocab_size}); re-tokenise with this model's tokenizer")
        shifted = labels[:, 1:]  # position t predicts token t+1
        target_mask = shifted != IGNORE_INDEX
        target_tokens = int(target_mask.sum())
        if target_tokens == 0:
            raise WorkflowError(f"rows {row_ids}: every label is masked (-100), so the batch teaches nothing; "
                                "check the variant's target template and max_length truncation")
        real_tokens = sum(lengths)
        return {
            "input_ids": input_ids,
            # Under FlexAttention no dense [rows, 1, L, L] mask is built (the loss module builds the BlockMask on the
            # device from segment_ids): at 8 x 4,096 tokens the dense one is 128 MiB of CPU work per micro-batch.
            "attention_mask": (None if MASK_FORMS[self.attn_implementation] == "block"
                               else mask_for(block_causal_mask(segment_ids), self.attn_implementation)),
            "position_ids": position_ids,
            "labels": labels,
            "target_index": target_mask.reshape(-1).nonzero().squeeze(1),
            "target_ids": shifted[target_mask],
            "target_tokens": target_tokens,
            "real_tokens": real_tokens,
            "padded_tokens": input_ids.numel() - real_tokens,
            "row_ids": row_ids,
            "segment_ids": segment_ids,
            "example_spans": spans,
        }


def full_row_cuts(lengths: Sequence[int], token_budget: int) -> list[tuple[int, int]]:
    """(start, end) of consecutive runs of ``lengths`` (in their order) whose SUM fits ``token_budget``: the
    micro-batches of one-row packing (``PackingCollator(one_row=True)``), each filled up to the budget."""
    cuts, start, used = [], 0, 0
    for k, n in enumerate(lengths):
        if n > token_budget:
            raise WorkflowError(f"an example has {n} tokens, more than the token budget {token_budget}")
        if used + n > token_budget:
            cuts.append((start, k))
            start, used = k, 0
        used += n
    if start < len(lengths):
        cuts.append((start, len(lengths)))
    return cuts


def document_block_mask(segment_ids: torch.Tensor):
    """FlexAttention's BlockMask for a packed batch: query q attends key k in the same segment, k <= q.

    The same predicate as :func:`block_causal_mask` (padding is segment -1 of its row and attends to
    itself), built on ``segment_ids``' device; heads share it (H=None)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, width = segment_ids.shape

    def same_document_causal(b, h, q, k):
        return (segment_ids[b, q] == segment_ids[b, k]) & (k <= q)

    return create_block_mask(same_document_causal, rows, None, width, width, device=segment_ids.device)


def attention_mask_of(batch) -> object:
    """The mask a packed or padded batch hands the model: its own, or the BlockMask of a flex batch."""
    mask = batch["attention_mask"]
    if mask is None and "segment_ids" in batch:
        return document_block_mask(batch["segment_ids"])
    return mask


def supports_packing(model: torch.nn.Module, max_length: int | None = None) -> tuple[bool, str]:
    """Whether exact packing works for this loaded (optionally PEFT-wrapped) model, and why (not).

    Static checks name the usual causes; then a probe runs the model (no grad, eval mode, restored) on
    two short examples and compares the second one packed behind the first with it alone. Exact
    packing must match far more closely than a plain causal mask over the same row does: a forward
    that ignores the 4D mask or ``position_ids`` (or rebuilds its own mask) fails whatever its family.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASK_FORMS:
        return False, (f"attention implementation '{implementation}' ignores a dense 4D mask (flash: varlen needs one "
                       "[1, N] row or cu_seqlens); load the model with attn_implementation='sdpa', or set "
                       "training.flex_attention: true")
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return False, f"{type(base).__name__}.forward takes no position_ids"
    # A 4D mask replaces every layer's mask, windowed ones included. Without layer_types (Mistral) a set
    # sliding_window applies to every layer.
    layer_types = set(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    windows = layer_types - {"full_attention"} if layer_types else {"sliding_attention"} if window else set()
    if windows and not (window and max_length and max_length <= window):
        return False, (f"layers of type {sorted(windows)} (window {window}) would get the full block mask in place of "
                       f"their windowed one; allowed only when training.max_length <= the window")
    device = base.get_input_embeddings().weight.device
    vocab = base.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(min(3, vocab - 1), vocab, (n,), generator=generator) for n in (6, 5))
    rows = [{"id": "probe-a", "input_ids": first.tolist(), "labels": first.tolist()},
            {"id": "probe-b", "input_ids": second.tolist(), "labels": second.tolist()}]
    batch = PackingCollator(0, vocab, len(first) + len(second), implementation)(rows)
    row, start, n = batch["example_spans"][batch["row_ids"].index("probe-b")]
    if start == 0:
        return False, "the probe's two examples were not packed into one row"
    modes = {module: module.training for module in base.modules()}  # restored exactly afterwards
    base.eval()
    try:
        with torch.no_grad():
            def logits(**inputs):
                return base(**{k: v.to(device) for k, v in inputs.items()}, use_cache=False).logits.float()
            alone = logits(input_ids=second[None])[0]
            ids = batch["input_ids"][row:row + 1]
            mask = attention_mask_of({**batch, "segment_ids": batch["segment_ids"][row:row + 1].to(device)})
            packed = logits(input_ids=ids, attention_mask=mask if mask is None or implementation == "flex_attention"
                            else mask[row:row + 1],
                            position_ids=batch["position_ids"][row:row + 1])[0, start:start + n]
            leaky = logits(input_ids=ids)[0, start:start + n]
    except Exception as error:  # a forward that cannot take these inputs at all is a refusal, with its cause
        return False, f"{type(base).__name__}'s forward fails on a packed probe: {type(error).__name__}: {error}"
    finally:
        for module, training in modes.items():
            module.training = training
    error, leak = float((packed - alone).abs().max()), float((leaky - alone).abs().max())
    if not error < 0.1 * leak:
        return False, (f"{type(base).__name__} does not honour a custom 4D mask and position_ids: a packed example's "
                       f"logits differ from its own by {error:.3g} (a plain causal mask: {leak:.3g})")
    return True, f"{implementation}: block mask honoured (probe difference {error:.2g} against leak {leak:.2g})"
