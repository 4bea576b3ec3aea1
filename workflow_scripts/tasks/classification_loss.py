"""Classification's training loss (:class:`ClassificationLoss`) and the model's pooled logits it and the
predictions read (:func:`pooled_logits`), apart from tasks/classification.py so that loading the task for its
data (normalise, compare, pretokenise) does not import torch; ``classification.ClassificationLoss`` and
``ClassificationTask.loss_module`` give this class."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@functools.lru_cache(maxsize=None)
def _parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def _accepts(model: nn.Module, name: str) -> bool:
    return name in _parameters(type(model.get_base_model() if hasattr(model, "get_base_model") else model))


def pooled_logits(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """Pooled logits (rows x classes); segment ids only for models that take them (BERT does, Llama does not)."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if "token_type_ids" in batch and _accepts(model, "token_type_ids"):
        inputs["token_type_ids"] = batch["token_type_ids"]
    if _accepts(model, "use_cache"):
        inputs["use_cache"] = False
    return model(**inputs).logits


class ClassificationLoss(nn.Module):
    """Cross-entropy SUMMED over the rows; the caller divides by the global batch's ``target_tokens``.

    With class weights the sum is ``sum_i w[y_i] * CE_i`` (``F.cross_entropy(weight=, reduction="sum")``)
    and the collator's ``target_tokens`` is ``sum_i w[y_i]``, so the step's loss is the weighted mean of
    torch's ``CrossEntropyLoss(weight=w)`` (reduction ``mean``: "the sum of the weighted losses divided
    by the sum of the weights", https://pytorch.org/docs/stable/generated/torch.nn.CrossEntropyLoss.html;
    a transformers Trainer given ``CrossEntropyLoss(weight=w)`` computes the same per batch), here over the
    whole global batch (every micro-batch and process). Without weights it is the mean over rows.
    The weights come from the batch (the collator's, from the variant) or, for direct use, from
    ``class_weights`` here (then divide by the summed weights yourself); never both.
    """

    def __init__(self, wrapped: nn.Module, class_weights: Sequence[float] | None = None):
        super().__init__()
        self.wrapped = wrapped  # the PEFT model (parameter_names.unwrap finds it under this name)
        device = next(wrapped.parameters()).device
        weights = None if class_weights is None else torch.tensor(list(class_weights), dtype=torch.float32, device=device)
        self.register_buffer("class_weights", weights)

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        weights = batch.get("class_weights")
        if weights is not None and self.class_weights is not None:
            raise RuntimeError("class weights given twice: by the batch (tokenise_meta.json) and by the loss module")
        logits = pooled_logits(self.wrapped, batch)
        weights = self.class_weights if weights is None else weights
        return F.cross_entropy(logits.float(), batch["labels"], weight=weights, reduction="sum")
