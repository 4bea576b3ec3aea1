"""The vision-language training loss (:class:`VisionTargetTokenLoss`), with the image inputs a model's forward
takes and the parameters only images reach, apart from tasks/vision_language.py so that loading the task for its data (normalise, compare, pretokenise) does not import torch;
``vision_language.VisionTargetTokenLoss`` and ``VisionLanguageTask.loss_module`` give this class."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from workflow_scripts.tasks.target_token_loss import TargetTokenLoss

# What the processor adds beside input_ids that the model's forward takes (by family).
# batch_num_images: LLaVA-OneVision tiles a row's only image but not the images of a row with several; without it the
# model tiles every image, and its features no longer match the tokens the processor wrote.
IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes", "batch_num_images")


def image_path_parameters(peft_model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters that only images reach: the projector's and the vision tower's."""
    from workflow_scripts.model import vision_language_model as vlm

    parts = vlm.components(peft_model)
    return [p for name, p in peft_model.named_parameters() if p.requires_grad
            and (vlm.under(name, parts["projector"]) or vlm.under(name, parts["vision_tower"]))]


class VisionTargetTokenLoss(TargetTokenLoss):
    """Generation's summed target-token loss, with the image inputs passed to the model's forward."""

    def forward(self, batch: Mapping[str, Any]):
        loss = super().forward(batch)
        if "pixel_values" not in batch and torch.is_grad_enabled():
            # A micro-batch without images leaves the trainable image path (the projector, tower
            # adapters) out of the graph: under DDP that rank would never reduce their gradients while
            # the others do (a collective mismatch). Zero-weighted into the loss, they get zero
            # gradients and every rank runs the same reductions.
            loss = loss + 0.0 * sum(p.sum() for p in image_path_parameters(self.wrapped))
        return loss

    def model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        from workflow_scripts.model import vision_language_model as vlm

        inputs = {name: batch[name] for name in IMAGE_INPUTS if name in batch}
        if "pixel_values" in inputs:  # M-RoPE families place the image tokens in 3-D from their token types
            inputs.update(vlm.token_type_inputs(self.wrapped, batch["input_ids"]))
        if "pixel_values" in inputs:  # in the tower's own precision (bf16 weights on GPUs)
            tower_dtype = next(self.wrapped.parameters()).dtype
            inputs["pixel_values"] = inputs["pixel_values"].to(tower_dtype)
        return inputs
