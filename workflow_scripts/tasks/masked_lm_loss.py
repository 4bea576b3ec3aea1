"""The masked LM's training loss (:class:`MaskedTokenLoss`) and the masked positions' logits it and the
evaluation read (:func:`masked_logits`), apart from tasks/masked_lm.py so that loading the task for its data
(normalise, compare, pretokenise) does not import torch; ``masked_lm.MaskedTokenLoss`` and
``MaskedLMTask.loss_module`` give this class."""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn


def masked_logits(model: nn.Module, input_ids, attention_mask, target_index) -> torch.Tensor:
    """(targets x vocabulary) logits at the flattened positions ``target_index``, from the model's own
    forward; a pre-hook gives the output layer only those positions' hidden states (as generation's
    TargetTokenLoss), so the vocabulary-sized logits exist for ~15% of the tokens only."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = inner.get_output_embeddings()
    if head is None:  # no separate output layer: slice the full logits
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits.reshape(-1, logits.shape[-1]).index_select(0, target_index)

    def keep_targets(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("input")
        if hidden.shape[:2] != input_ids.shape:
            raise RuntimeError(f"the output layer got hidden states of shape {tuple(hidden.shape)} for input ids "
                               f"{tuple(input_ids.shape)}; expected one per input position")
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_index).unsqueeze(0), *args[1:]), kwargs

    handle = head.register_forward_pre_hook(keep_targets, with_kwargs=True)
    try:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    finally:
        handle.remove()
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.shape[0] != target_index.shape[0]:
        raise RuntimeError(f"the model returned {logits.shape[0]} logit rows for {target_index.shape[0]} masked tokens")
    return logits


class MaskedTokenLoss(nn.Module):
    """Cross-entropy SUMMED over the masked positions; the caller divides by the global batch's count."""

    def __init__(self, wrapped: nn.Module):
        super().__init__()
        self.wrapped = wrapped  # parameter_names.unwrap finds the model under this name

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        logits = masked_logits(self.wrapped, batch["input_ids"], batch["attention_mask"], batch["target_index"])
        return F.cross_entropy(logits.float(), batch["target_ids"], reduction="sum")
