"""Variants are data: rendering prompts and targets, encoding them, extracting answers."""
import dataclasses

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from workflow_scripts.core.entry_settings import ExtractorSettings, VariantSettings
from workflow_scripts.core.errors import WorkflowError
from data_helpers import typed_variant
from workflow_scripts.tasks.templates import (encode_prompts, encode_targets, extract_answer, render_prompt,
                                        render_target, template_row)

ROW = {"id": "r1", "question": "What is 2+2?", "answers": ["4", "four"], "aux": "number"}
BASELINE = typed_variant({"prompt": "Question: {question}\nAnswer:", "target": " {answer}", "extractor": {"type": "whole"}})
MTUP = typed_variant({"prompt": "Question: {question}\n", "target": "Task 1: {aux}\nTask 2: {answer}",
                      "extractor": {"type": "section", "marker": "Task 2:"}})


def bos_tokenizer(chat_template=None):
    """A word-level tokenizer whose post-processor adds a BOS, like Llama's."""
    vocab = {word: i for i, word in enumerate(["<s>", "</s>", "<unk>", "Question:", "What", "is", "2+2?", "Answer:", "4", "<|user|>", "<|assistant|>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


def test_template_row_adds_the_first_gold_answer():
    assert template_row(ROW)["answer"] == "4"


def test_render_baseline_and_mtup():
    assert render_prompt(BASELINE, ROW) == "Question: What is 2+2?\nAnswer:"
    assert render_target(BASELINE, ROW) == " 4"
    assert render_target(MTUP, ROW) == "Task 1: number\nTask 2: 4"


def test_a_field_the_row_lacks_is_an_error_naming_it_and_the_row():
    with pytest.raises(WorkflowError, match=r"'r1'.*field 'title'"):
        render_prompt(typed_variant({"prompt": "{title}: {question}", "target": "{answer}"}), ROW)


def test_chat_template_wraps_the_prompt_and_needs_a_tokenizer_that_has_one():
    chat = dataclasses.replace(BASELINE, chat_template=True)
    template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    assert render_prompt(chat, ROW, bos_tokenizer(template)) == "<|user|> Question: What is 2+2?\nAnswer: <|assistant|>"
    with pytest.raises(WorkflowError, match="chat template"):
        render_prompt(chat, ROW, bos_tokenizer(None))
    with pytest.raises(WorkflowError, match="chat template"):
        render_prompt(chat, ROW)


def test_encode_prompts_adds_bos_once():
    tokenizer = bos_tokenizer()
    plain = encode_prompts(tokenizer, BASELINE, ["Question: What is 2+2?"])[0]
    assert plain[0] == tokenizer.bos_token_id and plain.count(tokenizer.bos_token_id) == 1
    # a chat-templated prompt already carries its special tokens: none are added again
    chat = encode_prompts(tokenizer, dataclasses.replace(BASELINE, chat_template=True), ["<s> Question: What"])[0]
    assert chat.count(tokenizer.bos_token_id) == 1


def test_encode_targets_appends_eos_and_adds_no_bos():
    tokenizer = bos_tokenizer()
    ids = encode_targets(tokenizer, ["4"])[0]
    assert ids == [tokenizer.convert_tokens_to_ids("4"), tokenizer.eos_token_id]


@pytest.mark.parametrize("text, expected", [
    (" 4 ", ("4", None)), ("", (None, None)), ("   \n", (None, None)),
])
def test_extract_whole(text, expected):
    assert extract_answer(BASELINE, text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Task 1: number\nTask 2: 4", ("4", "Task 1: number")),
    # the last marker wins (a model that repeats the header)
    ("Task 1: x Task 2: 3\nTask 2: 4", ("4", "Task 1: x Task 2: 3")),
    ("Task 1: number\n4", (None, None)),      # marker missing: unparseable, not the whole text
    ("Task 1: number\nTask 2:   ", (None, "Task 1: number")),
])
def test_extract_section_takes_the_part_after_the_last_marker(text, expected):
    assert extract_answer(MTUP, text) == expected


def test_extract_rejects_unknown_extractors():
    with pytest.raises(WorkflowError, match="unknown extractor"):
        extract_answer(VariantSettings("v", "generation", extractor=ExtractorSettings("regex")), "x")
    with pytest.raises(WorkflowError, match="marker"):
        extract_answer(VariantSettings("v", "generation", extractor=ExtractorSettings("section")), "x")


HINT = "a field is a plain name such as {question}, write {{ and }} for literal braces"


@pytest.mark.parametrize("template, problem", [
    # str.format would render "<built-in method upper of str object at 0x...>" into the prompt
    ("Q: {question.upper}", "{question.upper} uses attribute access or indexing; " + HINT),
    ("Q: {question[0]}", "{question[0]} uses attribute access or indexing; " + HINT),
    ("Q: {question!r}", "{question!r} uses a conversion or format spec; " + HINT),
    ("Q: {question:>40}", "{question:>40} uses a conversion or format spec; " + HINT),
    ("Q: {}", "{} is not a field name; " + HINT),
    ('Reply as {"answer": ...}', '{"answer": ...} is not a field name; ' + HINT),
    ("Q: {question", "unbalanced braces (expected '}' before end of string); a field is written {name}, "
                     "write {{ and }} for literal braces"),
    ("Q: question}", "unbalanced braces (Single '}' encountered in format string); a field is written {name}, "
                     "write {{ and }} for literal braces"),
])
def test_a_template_takes_plain_field_names_only(template, problem):
    with pytest.raises(WorkflowError) as caught:
        render_prompt(typed_variant({"prompt": template, "target": " {answer}"}), ROW)
    assert str(caught.value) == f"the prompt template {template!r}: {problem}"
    with pytest.raises(WorkflowError) as caught:
        render_target(typed_variant({"prompt": "{question}", "target": template}), ROW)
    assert str(caught.value) == f"the target template {template!r}: {problem}"


def test_doubled_braces_are_literal_and_values_render_as_str_format_would():
    row = {**ROW, "count": 3, "score": 0.5}
    template = 'Reply as {{"answer": ...}}. {question} ({count}, {score}) {answer}'
    assert render_prompt(typed_variant({"prompt": template, "target": ""}), row) == template.format_map({**row, "answer": "4"})
    assert render_prompt(typed_variant({"prompt": template, "target": ""}), row) == 'Reply as {"answer": ...}. What is 2+2? (3, 0.5) 4'


def test_a_prompt_or_target_that_renders_empty_names_the_part_and_the_row():
    row = {**ROW, "title": "  \n", "aux": ""}
    with pytest.raises(WorkflowError) as caught:
        render_prompt(typed_variant({"prompt": "{title}", "target": " {answer}"}), row)
    assert str(caught.value) == ("row id 'r1': the prompt renders empty from template '{title}'; "
                                 "every row needs a non-empty prompt: fill the row's fields or change the template")
    with pytest.raises(WorkflowError) as caught:
        render_target(typed_variant({"prompt": "{question}", "target": " {aux}"}), row)
    assert str(caught.value) == ("row id 'r1': the target renders empty from template ' {aux}'; "
                                 "every row needs a non-empty target: fill the row's fields or change the template")


def test_a_tokenizer_without_eos_is_named_with_what_to_do():
    """Issue 44: 'the tokenizer has no eos token; ...' named a data row (pretokenise's row 0) and no fix; it now
    names the model and what to do, at pretokenise (tests/test_bad_inputs.py) and at evaluation."""
    from types import SimpleNamespace

    import pytest
    from workflow_scripts.tasks import generation, templates

    tokenizer = SimpleNamespace(eos_token_id=None, name_or_path="resources/models/m")
    with pytest.raises(templates.NoEosToken) as caught:
        templates.encode_targets(tokenizer, ["x"])
    assert str(caught.value).startswith("resources/models/m: the tokenizer has no EOS token")
    with pytest.raises(templates.NoEosToken) as caught:
        generation.stop_token_ids(tokenizer, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)))
    assert str(caught.value) == ("resources/models/m: the tokenizer has no EOS token and the model's generation_config "
                                 "names none, so generation could not stop; " + templates.no_eos_fix())
    # the model's generation config alone is enough to stop at
    assert generation.stop_token_ids(tokenizer, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2]))) == [2]
