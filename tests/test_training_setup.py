"""The target-token loss agrees with Hugging Face's own causal-LM loss, and padding does not change it."""
import pytest
import torch

from conftest import tiny_training_settings
from workflow_scripts.data import batching
from workflow_scripts.training import training_setup
from workflow_scripts.training.distributed import DistributedContext

CPU = DistributedContext(0, 0, 1, 1, torch.device("cpu"), None)
ROWS = [
    {"id": "a", "input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, -100, -100, 8, 9, 10]},
    {"id": "b", "input_ids": [11, 12, 13], "labels": [-100, 13 - 1, 13]},
]


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    built = training_setup.build(tiny_model_dir, tiny_training_settings(), CPU)
    with torch.no_grad():  # non-zero adapters, so the check covers the LoRA path too
        for name, p in built.peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return built


def test_loss_matches_hugging_face_mean_over_target_tokens(setup):
    batch = batching.PaddingCollator(pad_token_id=0, vocab_size=128)(ROWS)
    ours = setup.model(batch)
    theirs = setup.peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              labels=batch["labels"]).loss
    assert float(ours) / batch["target_tokens"] == pytest.approx(float(theirs), rel=1e-5)


def test_padding_does_not_change_a_rows_loss(setup):
    collate = batching.PaddingCollator(pad_token_id=0, vocab_size=128)
    alone = collate([ROWS[1]])
    padded = collate(ROWS)
    only_b = setup.model(alone)
    both = setup.model(padded)
    first = collate([ROWS[0]])
    only_a = setup.model(first)
    assert float(both) == pytest.approx(float(only_a) + float(only_b), rel=1e-5)


def test_the_base_model_loads_straight_onto_its_one_device(monkeypatch, tiny_model_dir):
    # transformers 5 ignores low_cpu_mem_usage: without a device map every rank first builds the whole model in
    # host memory (8 ranks x 16 GB for an 8B model), then copies it to its GPU (issue 23, point 3).
    import transformers

    from workflow_scripts.model import model_loading

    seen = {}
    original = transformers.AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    model = model_loading.load_base_model(tiny_model_dir, torch.device("cpu"))
    assert seen["device_map"] == {"": "cpu"}  # one device for the whole model: never "auto", never offload
    assert {p.device.type for p in model.parameters()} == {"cpu"}
