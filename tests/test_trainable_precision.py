"""Every trainable tensor is fp32, modules_to_save included, even when the base model is bf16."""
import torch

from conftest import tiny_training_settings
from workflow_scripts.model import model_loading


def test_modules_to_save_and_adapters_are_fp32_on_a_bf16_base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16)
    lora = tiny_training_settings(lora={"modules_to_save": ["lm_head"]}).lora
    model = model_loading.add_lora(base, lora, gradient_checkpointing=False)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any("lm_head" in n for n in trainable) and any("lora_A" in n for n in trainable)
    assert {n: p.dtype for n, p in trainable.items() if p.dtype != torch.float32} == {}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if not p.requires_grad)  # frozen base stays bf16

    # An update of a typical size lands in fp32; in bf16 it would round to nothing.
    head = next(p for n, p in trainable.items() if "lm_head" in n)
    before = head.detach().clone()
    with torch.no_grad():
        head.add_(1e-5 * torch.sign(head))
    assert (head != before).float().mean() > 0.99
    assert (before.bfloat16() + 1e-5 * torch.sign(before).bfloat16() == before.bfloat16()).float().mean() > 0.5
