"""Prompt variants are data: a prompt template, a target template and an answer extractor.

A variant is its typed settings (``core.entry_settings.VariantSettings``: ``prompt``, ``target``,
``extractor.type``/``.marker``, ``chat_template``), read by attribute.
Training (pretokenise) and evaluation both go through these functions, so the prompt a model is
scored on is byte for byte the prompt it was trained on.
"""
from __future__ import annotations

import re
import string
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import VariantSettings

#: The fields that hold the gold answers: a prompt must never show them (or anything derived from them).
TARGET_FIELDS = ("answer", "answers")
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_LITERAL_BRACES = "write {{ and }} for literal braces"


@lru_cache(maxsize=256)
def parse_template(template: str) -> tuple[tuple[str, str | None], ...]:
    """``(literal text, field name or None)`` pieces of a template; ValueError (one line) if it is not plain data.

    Only ``{name}`` with a plain field name is allowed: no attribute access or indexing
    (``{question.upper}`` would render a bound method's address), no ``!conversion``, no ``:format spec``,
    no positional ``{}``.
    """
    try:
        pieces = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ValueError(f"unbalanced braces ({error}); a field is written {{name}}, {_LITERAL_BRACES}") from None
    parsed = []
    for literal, name, spec, conversion in pieces:
        if name is None:
            parsed.append((literal, None))
            continue
        written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if not _FIELD_NAME.match(name):
            if re.match(r"[A-Za-z_][A-Za-z0-9_]*[.\[]", name):
                problem = "uses attribute access or indexing"
            else:
                problem = "is not a field name"
            raise ValueError(f"{written} {problem}; a field is a plain name such as {{question}}, {_LITERAL_BRACES}")
        if conversion or spec:
            raise ValueError(f"{written} uses a conversion or format spec; a field is a plain name such as "
                             f"{{question}}, {_LITERAL_BRACES}")
        parsed.append((literal, name))
    return tuple(parsed)


def template_fields(template: str) -> list[str]:
    """The field names a template refers to, in order of first use (ValueError as :func:`parse_template`)."""
    return list(dict.fromkeys(name for _, name in parse_template(template) if name is not None))


def template_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """The fields a template sees: the normalised row plus ``answer`` = the first gold answer."""
    fields = dict(row)
    answers = fields.get("answers")
    if answers:
        fields["answer"] = answers[0]
    return fields


def _render(template: str, row: Mapping[str, Any], part: str) -> str:
    """The template filled from the row (``format(value, "")`` per field, as ``str.format`` would)."""
    try:
        pieces = parse_template(template)
    except ValueError as error:
        raise WorkflowError(f"the {part} template {template!r}: {error}") from None
    fields = template_row(row)
    out = []
    for literal, name in pieces:
        out.append(literal)
        if name is None:
            continue
        if name not in fields:
            raise WorkflowError(
                f"row id {row.get('id', '?')!r}: the {part} template refers to field {name!r}, "
                f"which the row does not have (it has {sorted(fields)})"
            )
        out.append(format(fields[name], ""))
    text = "".join(out)
    if not text.strip():
        raise WorkflowError(
            f"row id {row.get('id', '?')!r}: the {part} renders empty from template {template!r}; "
            f"every row needs a non-empty {part}: fill the row's fields or change the template"
        )
    return text


def require_chat_template(tokenizer) -> None:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise WorkflowError(
            "variant sets chat_template: true but the tokenizer has no chat template; "
            "set chat_template: false or use a model whose tokenizer defines one"
        )


def render_prompt(variant: "VariantSettings", row: Mapping[str, Any], tokenizer=None) -> str:
    """The prompt text; with ``chat_template`` it is wrapped as one user turn plus the generation prompt."""
    text = _render(variant.prompt, row, "prompt")
    if not variant.chat_template:
        return text
    require_chat_template(tokenizer)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def probe_row(variant: "VariantSettings") -> dict[str, Any]:
    """A row for checking how a variant's prompt renders: each field its prompt names holds a distinct text,
    and one image (for vision_language; other tasks never read it)."""
    return {"id": "gate-probe", "images": [b"probe image"],
            **{name: f"probe {name} text" for name in template_fields(variant.prompt)}}


def missing_prompt_text(render: Callable[[Any, Mapping[str, Any], Mapping[str, Any]], str], tokenizer,
                        variant: "VariantSettings") -> tuple[str, str] | None:
    """``(prompt text, rendered prompt)`` when the chat-templated prompt does not contain the prompt's own text
    (spacing ignored: templates may trim), else None. ``render(tokenizer, variant, row)`` is the task's."""
    row = probe_row(variant)
    text = _render(variant.prompt, row, "prompt")
    rendered = render(tokenizer, variant, row)
    if " ".join(text.split()) in " ".join(rendered.split()):
        return None
    return text, rendered


def render_target(variant: "VariantSettings", row: Mapping[str, Any]) -> str:
    """The training target (without eos; pretokenise appends the tokenizer's eos token)."""
    return _render(variant.target, row, "target")


def token_ids(tokenizer, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    """The ids ``tokenizer(texts)["input_ids"]`` gives, without its per-text Python conversions.

    When the Rust tokenizer is set up as ``tokenizer(...)`` would set it (no truncation, no padding,
    the same special-token splitting), its ``encode_batch_fast`` (no character offsets, which only
    ids never need) gives the same ids in about a quarter less time (66 -> 49 us per prompt measured);
    otherwise the ordinary call is used.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and hasattr(backend, "encode_batch_fast") and backend.truncation is None
            and backend.padding is None and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)):
        return [encoding.ids for encoding in backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)]
    return tokenizer(list(texts), add_special_tokens=add_special_tokens, return_attention_mask=False,
                     return_token_type_ids=False)["input_ids"]


def encode_prompts(tokenizer, variant: "VariantSettings", prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of rendered prompts, exactly as training saw them.

    Plain prompts get the tokenizer's own special tokens (e.g. a BOS); chat-templated prompts
    already contain them, so adding them again would double the BOS.
    """
    add_special = not variant.chat_template
    return token_ids(tokenizer, prompts, add_special)


class NoEosToken(WorkflowError):
    """The model's tokenizer sets no EOS token: a fault of the model, not of a data row (pretokenise does not
    name the row it met it on)."""


def no_eos_fix() -> str:
    return ("set eos_token in the model's tokenizer_config.json (a token of its vocabulary, such as '</s>'), or run "
            "the dataset on a model whose tokenizer has one")


def encode_targets(tokenizer, targets: Sequence[str]) -> list[list[int]]:
    """Token ids of rendered targets followed by eos (the model learns to stop)."""
    if tokenizer.eos_token_id is None:
        raise NoEosToken(f"{tokenizer.name_or_path}: the tokenizer has no EOS token, and every generation target "
                         "ends with one so that the model learns to stop (and decoding stops there); "
                         + no_eos_fix())
    eos = [tokenizer.eos_token_id]  # looked up once: the attribute is a vocabulary lookup per access
    ids = token_ids(tokenizer, targets, False)
    return [list(target) + eos for target in ids]


def extract_answer(variant: "VariantSettings", text: str) -> tuple[str | None, str | None]:
    """(final answer, auxiliary section) from a model's output.

    ``whole``: the whole output, stripped; ``section``: the text after the last ``marker``, with the
    text before it as the auxiliary section. The answer is None (unparseable) when the marker is
    missing or the answer is empty.
    """
    kind = variant.extractor.type
    if kind == "whole":
        answer = text.strip()
        return (answer or None), None
    if kind == "section":
        marker = variant.extractor.marker
        if not marker:
            raise WorkflowError("extractor type 'section' needs a marker (e.g. 'Task 2:')")
        before, found, after = text.rpartition(marker)
        if not found:
            return None, None
        answer = after.strip()
        return (answer or None), (before.strip() or None)
    raise WorkflowError(f"unknown extractor type {kind!r}; known: whole, section")



# The variant keys that are templates filled from each scored row (generation and vision_language:
# prompt; classification: input). The target template is not rendered at evaluation.
ROW_TEMPLATE_KEYS = ("prompt", "input")


def check_row_templates(variant: "VariantSettings", rows: Sequence[dict], data_dir: str, split: str) -> None:
    """Every field the variant's row templates name must be in every row, checked before the model loads
    (evaluate, predict, training's validation metric); the message names the data, split and row as
    pretokenise's does."""
    for key in ROW_TEMPLATE_KEYS:
        template = getattr(variant, key)
        if not isinstance(template, str):
            continue
        names = template_fields(template)  # the task's check_variant already refused bad syntax
        for index, row in enumerate(rows):
            fields = template_row(row)
            missing = [name for name in names if name not in fields]
            if missing:
                raise WorkflowError(
                    f"{data_dir} split '{split}' row {index}: row id {row.get('id', '?')!r}: the {key} template "
                    f"refers to field {missing[0]!r}, which the row does not have (it has {sorted(fields)})")
