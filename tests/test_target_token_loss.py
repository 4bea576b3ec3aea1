"""The training loss is the model's own objective: logits come from its forward, scaling included.

Granite divides its logits by ``logits_scaling`` and Cohere multiplies them by ``logit_scale`` inside
``forward``; a loss computed as ``lm_head(decoder(...))`` would train those models on another objective
than evaluation decodes with. Each family's tiny random model is compared with a plain forward.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_training_settings
from workflow_scripts.data import batching
from workflow_scripts.model import model_loading
from workflow_scripts.tasks import generation

ROWS = [
    {"id": "a", "input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, -100, -100, 8, 9, 10]},
    {"id": "b", "input_ids": [11, 12, 13], "labels": [-100, 12, 13]},
]
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, pad_token_id=0)


def tiny(family: str):
    import transformers

    config_class, model_class, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        # Scales far from 1 make a missed scaling visible in the loss.
        "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
        "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}),
    }[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, **extra)
    return getattr(transformers, model_class)(config)


def reference_loss_sum(model, batch) -> float:
    """Cross-entropy summed over target tokens from the model's full forward logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    labels = batch["labels"][:, 1:].reshape(-1)
    return float(F.cross_entropy(shifted.float(), labels, ignore_index=-100, reduction="sum"))


@pytest.mark.parametrize("family", ["llama", "qwen2", "granite", "cohere"])
def test_target_token_loss_equals_the_models_forward(family):
    torch.set_num_threads(1)
    lora = tiny_training_settings().lora
    peft_model = model_loading.add_lora(tiny(family), lora, gradient_checkpointing=False)
    with torch.no_grad():  # non-zero adapters, so the LoRA path is covered too
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    peft_model.eval()
    batch = batching.PaddingCollator(pad_token_id=0, vocab_size=64)(ROWS)
    loss = generation.TargetTokenLoss(peft_model)(batch)
    assert float(loss) == pytest.approx(reference_loss_sum(peft_model, batch), rel=1e-5)
    # Gradients reach the adapters through the hooked head.
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in peft_model.named_parameters() if "lora_" in n)
