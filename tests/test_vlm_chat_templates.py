"""A vision-language variant with chat_template: true, rendered through real VLM chat templates.

These templates read a user turn's ``content`` as a list of typed parts and render a plain string as
nothing, so the text-only control (``images: false``) must send ``[{"type": "text", ...}]`` too; and the
gate (preflight_checks.check_chat_prompt) refuses any variant whose rendered prompt lacks its own text.
"""
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from data_helpers import typed_variant
from workflow_scripts.tasks import generation, vision_language
from workflow_scripts.training import preflight_checks
from workflow_scripts.training.preflight_checks import PreflightError

# SmolVLM's default chat template (the same for Idefics3), as in transformers'
# tests/models/smolvlm/test_processing_smolvlm.py and HuggingFaceTB/SmolVLM-Instruct.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# llava-hf/llava-1.5-7b-hf's chat template, as in transformers' tests/models/llava/test_processor_llava.py.
LLAVA_15_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
QUESTION = "What colour is the square?"
ROW = {"id": "r1", "question": QUESTION, "answers": ["red"], "images": [b"png bytes"]}
VISION = {"prompt": "Question: {question}\nAnswer:", "target": " {answer}", "chat_template": True}
# What each template gives for the text-only control and for one image: the question inside the user turn.
EXPECTED = {
    "smolvlm": (f"<|im_start|>User: Question: {QUESTION}\nAnswer:<end_of_utterance>\nAssistant:",
                f"<|im_start|>User:<image>Question: {QUESTION}\nAnswer:<end_of_utterance>\nAssistant:"),
    "llava-1.5": (f"USER: Question: {QUESTION}\nAnswer: ASSISTANT:",
                  f"USER: <image>\nQuestion: {QUESTION}\nAnswer: ASSISTANT:"),
}
TEMPLATES = {"smolvlm": SMOLVLM_TEMPLATE, "llava-1.5": LLAVA_15_TEMPLATE}


def tokenizer_with(chat_template: str) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    tokenizer.name_or_path = "test-vlm"
    return tokenizer


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_text_only_control_keeps_its_question_under_real_vlm_templates(family):
    tokenizer = tokenizer_with(TEMPLATES[family])
    control = vision_language.check_variant(typed_variant({**VISION, "images": False}, "vision_language"))
    assert vision_language.render_prompt(tokenizer, control, ROW) == EXPECTED[family][0]


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_image_variant_renders_the_image_then_the_question(family):
    tokenizer = tokenizer_with(TEMPLATES[family])
    vision = vision_language.check_variant(typed_variant(VISION, "vision_language"))
    assert vision_language.render_prompt(tokenizer, vision, ROW) == EXPECTED[family][1]


@pytest.mark.parametrize("family", sorted(TEMPLATES))
@pytest.mark.parametrize("images", [True, False])
def test_gate_passes_both_vision_variants_under_real_vlm_templates(family, images):
    detail = preflight_checks.check_chat_prompt(vision_language.TASK, tokenizer_with(TEMPLATES[family]),
                                                {**VISION, "images": images})
    assert "keeps the prompt's text" in detail


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_gate_refuses_a_variant_whose_template_drops_the_prompt(family):
    # generation sends the user's content as a string (text-model templates expect one): a VLM template
    # renders it as nothing, and the gate says so before any training.
    with pytest.raises(PreflightError, match=r"^chat_prompt: the chat template of test-vlm renders the variant's "
                       r"prompt 'Question: probe question text\\nAnswer:' as .*without the prompt's own text.*"
                       r"Fix: .*chat_template: false"):
        preflight_checks.check_chat_prompt(generation.TASK, tokenizer_with(TEMPLATES[family]), {**VISION})


def test_gate_has_nothing_to_check_without_a_chat_template():
    tokenizer = tokenizer_with(SMOLVLM_TEMPLATE)
    assert preflight_checks.check_chat_prompt(vision_language.TASK, tokenizer, {**VISION, "chat_template": False}) is None
    assert preflight_checks.check_chat_prompt(vision_language.TASK, tokenizer, None) is None


def test_the_gate_stage_refuses_a_chat_variant_whose_prompt_the_template_drops(tmp_path, tiny_model_dir,
                                                                              tiny_tokenised_dir, monkeypatch):
    """sanity runs the check with the variant recorded in tokenise_meta.json and the model's tokenizer."""
    import json
    import shutil

    from conftest import tiny_training_settings, training_json
    from workflow_scripts import sanity

    data = tmp_path / "tokenised"
    shutil.copytree(tiny_tokenised_dir, data)
    meta = json.loads((data / "tokenise_meta.json").read_text())
    meta["templates"] = generation.TASK.variant_record(typed_variant(VISION))  # as pretokenise records it
    (data / "tokenise_meta.json").write_text(json.dumps(meta))
    monkeypatch.setattr(sanity.LazyTokenizer, "_loaded", lambda self: tokenizer_with(LLAVA_15_TEMPLATE))
    settings = tiny_training_settings(sanity_batches=1)
    with pytest.raises(PreflightError, match=r"^chat_prompt: .* as 'USER: ASSISTANT:', without the prompt's own text"):
        sanity.main(["--model", str(tiny_model_dir), "--data", str(data), "--training", training_json(settings),
                     "--seed", "1", "--out", str(tmp_path / "sanity.json")])
    assert not (tmp_path / "sanity.json").exists()
