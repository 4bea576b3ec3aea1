"""Generation's training loss (:class:`TargetTokenLoss`), apart from tasks/generation.py so that loading the
generation task for its data (normalise, compare) does not import torch; ``generation.TargetTokenLoss`` and
``GenerationTask.loss_module`` give this class."""
from __future__ import annotations

from typing import Any, Mapping

import torch.nn.functional as F
from torch import nn


class TargetTokenLoss(nn.Module):
    """Summed cross-entropy over target tokens only, with logits from the model's own forward.

    The model's forward computes the logits, so whatever it applies after its head (Granite's
    ``logits_scaling``, Cohere's ``logit_scale``, Gemma-2's soft-capping) is part of the training
    objective exactly as evaluation decodes with it. To keep the (tokens x vocabulary) logits to the
    target positions alone, a forward pre-hook hands the output layer only the hidden states of those
    positions: ``logits_to_keep`` cannot say this (it keeps the same positions in every row), and what
    models do after the head is elementwise, so it is unaffected by the gather (tests compare the loss
    with a plain forward for Llama, Qwen2, Granite and Cohere).

    The loss is a sum, not a mean: the caller divides by the target tokens of the whole global batch,
    so every token weighs the same whatever the micro-batch split or the number of processes.
    """

    def __init__(self, wrapped: nn.Module, fused_cross_entropy=None):
        super().__init__()
        self.wrapped = wrapped  # the PEFT model (parameter_names.unwrap finds it under this name)
        # training.fused_cross_entropy: fn(hidden [n, h], head weight [V, h], targets [n]) -> summed CE, which
        # never holds the (n x V) logits (training/kernels.py: Liger's fused linear cross-entropy).
        self.fused_cross_entropy = fused_cross_entropy

    def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Further inputs of the model's forward taken from the batch (a VLM's pixel values); none here."""
        return {}

    def forward(self, batch: Mapping[str, Any]):
        from workflow_scripts.data.packing import attention_mask_of

        input_ids, attention_mask = batch["input_ids"], attention_mask_of(batch)  # a flex batch: its BlockMask
        target_index, target_ids = batch["target_index"], batch["target_ids"]
        # A packed batch (data/packing.py) carries position_ids restarting per example, and its
        # attention_mask is the 4D block mask; a padded one has none and the model counts from 0.
        positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
        positions.update(self.model_inputs(batch))
        # A PEFT model's base, or the model itself under training.finetune: full (no PEFT wrap).
        head = getattr(self.wrapped, "get_base_model", lambda: self.wrapped)().get_output_embeddings()
        if head is None:  # no separate output layer (some remote-code models): slice the full logits
            logits = self.wrapped(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                  **positions).logits
            logits = logits[:, :-1].reshape(-1, logits.shape[-1]).index_select(0, target_index)
            return F.cross_entropy(logits.float(), target_ids, reduction="sum")

        if self.fused_cross_entropy is not None:  # the decoder's hidden states, the head fused into the loss
            base = self.wrapped.get_base_model() if hasattr(self.wrapped, "get_base_model") else self.wrapped
            hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                        **positions).last_hidden_state
            kept = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, target_index)
            return self.fused_cross_entropy(kept, head.weight, target_ids)

        def keep_target_positions(module, args, kwargs):
            hidden = args[0] if args else kwargs.pop("input")
            if hidden.shape[:2] != input_ids.shape:
                raise RuntimeError(f"the output layer got hidden states of shape {tuple(hidden.shape)} for input "
                                   f"ids {tuple(input_ids.shape)}; expected one per input position")
            # Position t predicts token t+1: the last position predicts nothing.
            kept = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, target_index)
            return (kept.unsqueeze(0), *args[1:]), kwargs

        handle = head.register_forward_pre_hook(keep_target_positions, with_kwargs=True)
        try:
            logits = self.wrapped(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                  **positions).logits
        finally:
            handle.remove()
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.shape[0] != target_ids.shape[0]:
            raise RuntimeError(f"the model returned {logits.shape[0]} logit rows for {target_ids.shape[0]} targets: "
                               "its forward changes the head's output shape, which this loss does not support")
        return F.cross_entropy(logits.float(), target_ids, reduction="sum")
