"""Task type ``conversation``: a causal LM learns the assistant's turns of multi-turn chats.

Data. A dataset in the ``messages`` layout (the one most SFT data ship in): ``fields: {messages: <source
field>, id: <optional>}``, each record's messages a list of turns ``{role, content}``. Sources that spell
them otherwise are mapped, never guessed: ``keys: {role: from, content: value}`` and ``roles: {user: human,
assistant: gpt, system: system}`` (canonical role -> the source's name) read ShareGPT. The canonical row
is ``{id, messages: [{role, content}, ...]}``, checked at normalise: roles in system/user/assistant, a
system message only as the first turn, then user and assistant alternating from a user turn, the last
turn an assistant turn, every content a non-empty string (stripped, as every other task's text is).
Each failure is a ``Rejected`` naming the turn (``wrong_type``, ``missing_field``, ``empty_value``, and
this task's :data:`REJECTION_REASONS` ``unknown_role`` and ``turn_order``). Keys of a turn beyond role
and content (ShareGPT's ``weight``, a ``name``) are not carried.

Labels. The conversation is rendered by the tokenizer's own chat template (``apply_chat_template``, as
the model will be prompted) and tokenised once, without the tokenizer's extra special tokens (the
template writes its BOS itself, as ``apply_chat_template(tokenize=True)`` does). An assistant turn's
tokens are located by rendering prefixes: the text before turn k is ``messages[:k]`` rendered WITH
the generation prompt (so the template's assistant header, e.g. ``<|im_start|>assistant\\n``, is
scaffolding, never a target), the text through turn k is ``messages[:k+1]``; both must be a prefix of
the whole rendering, as text and as tokens, or the pipeline refuses, naming the tokenizer: a template
that re-renders earlier turns (one dropping past reasoning, one printing the turn count) or a
tokenizer that merges across the boundary would otherwise mislabel, or evaluate on prompt tokens that
training never saw. Within the turn's span the labels run from its first token through the template's
end-of-turn token: the first special token after the assistant's text (``<|im_end|>``, ``<|eot_id|>``,
``</s>``, ``<end_of_turn>``), so the model learns to stop; what the template writes after it (a newline
before the next turn) is scaffolding. A span whose decoded text does not start with the assistant's
message (template text before it that the generation prompt lacks, or a template that rewrites the
message), or that holds no special token after the message, is refused. System and user turns and all
scaffolding are -100.

Why not ``return_assistant_tokens_mask``: it exists only for templates that mark ``{% generation %}``
blocks, which few models ship, and each template author decides what the block holds (with or without
the end-of-turn token, with or without the trailing newline), so two models would be trained on
different targets. The incremental rendering works for every template, gives every model the same
rule, and checks the property evaluation relies on (the prompt's tokens are exactly the tokens
training saw before the turn). ``tests/test_conversation.py`` shows it equals the mask of a template
whose generation block holds the message and its end-of-turn token.

Truncation cuts from the end; a row with no labelled token left is ``dropped``. Training is
generation's: its collators (padding or packing) and :class:`generation.TargetTokenLoss`.

Evaluation: the prompt is every turn before the last assistant turn, rendered with the generation
prompt (its tokens are those training saw, checked per row); greedy decoding with generation's fully
explicit config, stopping at the tokenizer's eos, the model's configured eos ids and the end-of-turn
token the template wrote after each test conversation's last turn (a chat model whose eos differs
from its end-of-turn token would otherwise run past the turn); the gold is the last assistant turn's
content, scored with generation's string metrics.

A variant is ``{system_prompt}``: absent/null keeps each conversation's own system message; a string
replaces it (or is added where a conversation has none); ``false`` removes it. It applies in training
and evaluation alike.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.data.rows import FieldsMapper, Rejected, present
from workflow_scripts.tasks import generation, metrics
from workflow_scripts.tasks.base import EvaluationResult
from workflow_scripts.tasks.templates import token_ids

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings, VariantSettings
    import torch
    from torch import nn

    from workflow_scripts.core.section_settings import EvaluationSettings
    from workflow_scripts.core.settings import LoraSettings, TrainingSettings

ROLES = ("system", "user", "assistant")
DEFAULT_KEYS = {"role": "role", "content": "content"}
# Roles of tool use (OpenAI's tool/function, Llama 3's ipython, ShareGPT exports' function_call/observation): a
# tool's call or output is neither a user's nor an assistant's message, so no ``roles:`` mapping fits it.
TOOL_ROLES = ("tool", "function", "ipython", "function_call", "observation", "tool_call", "tool_response")
VARIANT_KEYS = ("system_prompt",)
IGNORE_INDEX = -100
#: Reasons of this task's rejections, for the normalise report (beside normalise.REASONS).
REJECTION_REASONS = {
    "unknown_role": ("a turn's role is not one of the roles mapped to system/user/assistant (datasets.<name>.roles), "
                     "or is a tool turn (tool, function, ipython...), which no role fits"),
    "turn_order": "the turns are out of order: a system message only first, then user and assistant alternating "
                  "from a user turn, ending with an assistant turn",
}


# --- normalise -------------------------------------------------------------------------------------
def turn_mapping(settings: "DatasetSettings", key: str = "dataset") -> tuple[dict[str, str], dict[str, str]]:
    """``(keys, source role -> canonical role)`` from a dataset's ``keys`` and ``roles`` settings."""
    keys = {**DEFAULT_KEYS, **settings.keys}
    unknown = sorted(set(keys) - set(DEFAULT_KEYS))
    if unknown:
        raise ConfigError(f"{key}.keys", f"{unknown} are not turn keys; map 'role' and 'content' only")
    if keys["role"] == keys["content"]:
        raise ConfigError(f"{key}.keys", f"role and content are both read from {keys['role']!r}")
    roles = {role: role for role in ROLES}
    roles.update(settings.roles)
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ConfigError(f"{key}.roles", f"{unknown} are not roles; map {list(ROLES)} to the source's names")
    by_source: dict[str, str] = {}
    for canonical, source in roles.items():
        if source in by_source:
            raise ConfigError(f"{key}.roles", f"{by_source[source]!r} and {canonical!r} are both read from source "
                              f"role {source!r}; each role needs its own name")
        by_source[source] = canonical
    return keys, by_source


def order_problem(roles: Sequence[str]) -> tuple[int, str] | None:
    """``(turn index, what is wrong)`` when the roles are not [system] user assistant (user assistant)*."""
    if not roles:
        return 0, "the conversation has no turns"
    for index, role in enumerate(roles):
        if role == "system":
            if index:
                return index, f"turn {index}: a system message may only be the first turn"
            continue
        previous = roles[index - 1] if index else None
        expected = "assistant" if previous == "user" else "user"
        if role != expected:
            after = f"after a {previous} turn" if previous else "as the first turn"
            return index, (f"turn {index}: {role} {after}; after an optional system message the conversation "
                           "starts with a user turn and user and assistant turns alternate")
    if roles[-1] != "assistant":
        return len(roles) - 1, (f"turn {len(roles) - 1}: the conversation ends with a {roles[-1]} turn; it must "
                                "end with an assistant turn (the turn evaluation scores)")
    return None


def normalise_messages(value: Any, source: str, keys: Mapping[str, str],
                       role_of: Mapping[str, str]) -> list[dict[str, str]]:
    """The canonical turns of one record's messages; raises ``Rejected`` naming the turn."""
    if not isinstance(value, list):
        raise Rejected("wrong_type", source, f"expected a list of turns, got {type(value).__name__} {value!r:.60}")
    if not value:
        raise Rejected("empty_value", source, "is an empty list of turns")
    turns = []
    for index, turn in enumerate(value):
        where = f"{source}[{index}]"
        if not isinstance(turn, Mapping):
            raise Rejected("wrong_type", where, f"turn {index}: expected an object with {keys['role']!r} and "
                           f"{keys['content']!r}, got {type(turn).__name__} {turn!r:.60}")
        role_field, content_field = f"{where}.{keys['role']}", f"{where}.{keys['content']}"
        for name, field in ((keys["role"], role_field), (keys["content"], content_field)):
            if turn.get(name) is None:
                raise Rejected("missing_field", field, f"turn {index}: {name!r} is "
                               f"{'missing' if name not in turn else 'null'} (the turn has {sorted(turn)})")
        role = turn[keys["role"]]
        if not isinstance(role, str):
            raise Rejected("wrong_type", role_field, f"turn {index}: a role must be a string, got "
                           f"{type(role).__name__} {role!r:.60}")
        if role not in role_of and role.lower() in TOOL_ROLES:  # no canonical role fits it: mapping it would lie
            raise Rejected("unknown_role", role_field, f"turn {index}: role {role!r} is a tool call or its result, "
                           "which this task does not train on (conversations of system, user and assistant turns "
                           "only, rendered without tools); leave conversations with tool turns out of the dataset")
        if role not in role_of:
            raise Rejected("unknown_role", role_field, f"turn {index}: role {role!r} is not one of {sorted(role_of)}; "
                           "map the source's role names with datasets.<name>.roles")
        content = turn[keys["content"]]
        if not isinstance(content, str):
            parts = " (content given as a list of parts is not supported: text only)" if isinstance(content, list) else ""
            raise Rejected("wrong_type", content_field, f"turn {index}: content must be a string, got "
                           f"{type(content).__name__} {content!r:.60}{parts}")
        if not content.strip():
            raise Rejected("empty_value", content_field, f"turn {index}: the {role_of[role]} message is empty")
        turns.append({"role": role_of[role], "content": content.strip()})
    problem = order_problem([turn["role"] for turn in turns])
    if problem is not None:
        index, detail = problem
        raise Rejected("turn_order", f"{source}[{index}].{keys['role']}", detail)
    return turns


def row_id(value: Any, source: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise Rejected("wrong_type", source, f"an id must be a string or an integer, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise Rejected("empty_value", source, "is empty")
    return text


class ConversationStatistics:
    """Normalise's memory of the kept rows, for the report: turns per conversation and system prompts."""

    def check(self, row: Mapping[str, Any], split: str) -> None:
        """Every split is checked alike (nothing learned from train)."""

    def split_done(self, split: str, rows: list[dict]) -> None:
        """Nothing to remember: the report reads the rows."""

    def task_meta(self) -> dict[str, Any]:
        return {}

    def report(self, rows_by_split: Mapping[str, list[dict]]) -> dict[str, Any]:
        def split(rows: list[dict]) -> dict[str, Any]:
            turns = [len(row["messages"]) for row in rows]
            return {"conversations": len(rows),
                    "assistant_turns": sum(t["role"] == "assistant" for row in rows for t in row["messages"]),
                    "with_system_message": sum(row["messages"][0]["role"] == "system" for row in rows),
                    "mean_turns": sum(turns) / len(turns) if turns else None, "max_turns": max(turns, default=None)}

        return {"conversations": {name: split(rows) for name, rows in rows_by_split.items()}}


# --- rendering and labels ----------------------------------------------------------------------------
def tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise WorkflowError(
            f"the tokenizer of {tokenizer_name(tokenizer)} has no chat template, so conversations cannot be "
            "rendered as the model expects them; use a chat (instruct) model whose tokenizer defines one, or "
            "put the model's chat template into its directory (chat_template.jinja)")


def special_ids(tokenizer) -> frozenset[int]:
    """The ids the tokenizer treats as special (its named special tokens and added special tokens)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(index for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special)
    return frozenset(ids)


def render(tokenizer, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
    """The chat template's text for ``messages`` (the template's errors become one line naming the tokenizer)."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError) as error:
        roles = [m["role"] for m in messages]
        hint = "; a template without a system role needs variant system_prompt: false" if "system" in roles else ""
        raise WorkflowError(f"the chat template of {tokenizer_name(tokenizer)} fails on a conversation with roles "
                            f"{roles}: {' '.join(str(error).split())}{hint}") from None


def with_system_prompt(messages: Sequence[Mapping[str, str]], system_prompt: str | bool | None) -> list[dict]:
    """The conversation as the variant shows it: own system message kept (None), replaced or added (a
    string) or removed (False)."""
    turns = [{"role": m["role"], "content": m["content"]} for m in messages]
    if system_prompt is None:
        return turns
    rest = turns[1:] if turns and turns[0]["role"] == "system" else turns
    if system_prompt is False:
        return rest
    return [{"role": "system", "content": system_prompt}, *rest]


@dataclass
class Labelled:
    input_ids: list[int]
    labels: list[int]
    prompt_length: int    # tokens before the last assistant turn: evaluation's prompt
    prompt_text: str      # that prompt as text
    end_of_turn: list[int]  # per assistant turn, the end-of-turn token labelled after it


class TemplateRefused(WorkflowError):
    """The chat template cannot be labelled exactly (the message names the tokenizer and the fix)."""


def _refuse(tokenizer, row: str, detail: str, fix: str) -> TemplateRefused:
    return TemplateRefused(f"row id {row!r}: the chat template of {tokenizer_name(tokenizer)} {detail}, so the "
                           f"assistant's tokens cannot be labelled exactly; {fix}")


def _comparable(text: str) -> str:
    return " ".join(text.split())


def end_of_turn(tokenizer, span: Sequence[int], content: str, specials: frozenset[int], row: str,
                turn: int) -> int:
    """Position in ``span`` (one assistant turn's tokens) of the end-of-turn token: the first special token
    after the assistant's message. Refuses template text before the message and a turn without one."""
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    wanted = {_comparable(content), _comparable(decode(token_ids(tokenizer, [content], False)[0]))}
    positions = [position for position, token in enumerate(span) if token in specials]
    for position in positions:
        before = _comparable(decode(span[:position]))
        found = [text for text in wanted if text in before]
        if not found:
            continue  # a special token inside the message, or before it
        if not any(before.startswith(text) for text in found):
            extra = before[:before.find(found[0])].strip()
            raise _refuse(tokenizer, row, f"writes {extra!r} before assistant turn {turn} that its generation prompt "
                          "does not end with (the model would be taught to generate template text)",
                          "use a model whose template's add_generation_prompt writes the whole assistant header")
        return position
    if not positions:
        raise _refuse(tokenizer, row, f"puts no special end-of-turn token after assistant turn {turn}",
                      "the model could not learn to stop: use a chat model whose template ends each assistant "
                      "message with a special token (e.g. <|im_end|>, <|eot_id|>, </s>)")
    raise _refuse(tokenizer, row, f"does not render assistant turn {turn}'s message as it is (the tokens after the "
                  "generation prompt do not start with it)", "use a model whose template keeps messages unchanged")


def label_conversations(tokenizer, conversations: Sequence[Sequence[Mapping[str, str]]],
                        row_ids: Sequence[str]) -> list[Labelled]:
    """Token ids, labels (assistant turns through their end-of-turn token; -100 elsewhere) and the
    evaluation prompt of each conversation, from prefix renderings (see the module docstring)."""
    check_chat_template(tokenizer)
    specials = special_ids(tokenizer)
    plans, texts = [], []  # texts: per conversation the whole rendering, then (before, through) per assistant turn
    for messages, row in zip(conversations, row_ids, strict=True):
        problem = order_problem([m["role"] for m in messages])
        if problem is not None:
            raise WorkflowError(f"row id {row!r}: {problem[1]}; re-run normalise")
        full = render(tokenizer, messages, False)
        plan = {"row": row, "messages": messages, "at": len(texts), "turns": []}
        texts.append(full)
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render(tokenizer, messages[:index], True)
            through = full if index == len(messages) - 1 else render(tokenizer, messages[:index + 1], False)
            for text, what in ((before, "with the generation prompt, before"), (through, "through")):
                if not full.startswith(text):
                    raise _refuse(tokenizer, row, f"renders the conversation {what} assistant turn {index} as text "
                                  "that is not the start of the whole conversation's rendering (it re-renders "
                                  "earlier turns)", "use a model whose chat template renders turns incrementally")
            plan["turns"].append((index, len(texts), before))
            texts += [before, through]
        plans.append(plan)
    encoded = token_ids(tokenizer, texts, False) if texts else []
    out = []
    for plan in plans:
        row, messages, ids = plan["row"], plan["messages"], list(encoded[plan["at"]])
        labels = [IGNORE_INDEX] * len(ids)
        ends, prompt_length, prompt_text = [], 0, ""
        for index, at, before_text in plan["turns"]:
            before, through = encoded[at], encoded[at + 1]
            for part, what in ((before, "before"), (through, "through")):
                if ids[:len(part)] != list(part):
                    raise _refuse(tokenizer, row, f"tokenises the text {what} assistant turn {index} differently "
                                  "alone than within the whole conversation (a token spans the boundary), so the "
                                  "evaluation prompt would not be the tokens training saw",
                                  "use a model whose tokenizer and chat template keep turn boundaries")
            span = ids[len(before):len(through)]
            if not span:
                raise _refuse(tokenizer, row, f"renders assistant turn {index} as no tokens",
                              "check the chat template renders assistant messages")
            end = end_of_turn(tokenizer, span, messages[index]["content"], specials, row, index)
            labels[len(before):len(before) + end + 1] = span[:end + 1]
            ends.append(span[end])
            prompt_length, prompt_text = len(before), before_text  # the last assistant turn's, in the end
        out.append(Labelled(ids, labels, prompt_length, prompt_text, ends))
    return out


def row_conversation(row: Mapping[str, Any], variant: "VariantSettings") -> list[dict]:
    if not row.get("messages"):
        raise WorkflowError(f"row id {row.get('id')!r}: no messages; re-run normalise for task conversation")
    return with_system_prompt(row["messages"], variant.system_prompt)


def tokenise_batch(batch: Mapping[str, list], *, tokenizer, variant: "VariantSettings",
                   max_length: int) -> dict[str, list]:
    """Batched map function: label the assistant turns, cut from the end, drop rows with no target left."""
    variant = check_variant(variant)
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    labelled = label_conversations(tokenizer, [row_conversation(row, variant) for row in rows],
                                   [row["id"] for row in rows])
    columns: dict[str, list] = {"id": [row["id"] for row in rows], "input_ids": [], "labels": [], "length": [],
                                "truncated": [], "dropped": []}
    for item in labelled:
        ids, labels = item.input_ids[:max_length], item.labels[:max_length]
        columns["input_ids"].append(ids)
        columns["labels"].append(labels)
        columns["length"].append(len(ids))
        columns["truncated"].append(len(item.input_ids) > max_length)
        # Position 0 predicts nothing (the loss shifts by one), so a label there teaches nothing either.
        columns["dropped"].append(all(label == IGNORE_INDEX for label in labels[1:]))
    return columns


# --- evaluation ----------------------------------------------------------------------------------------
def generate_from_ids(model, tokenizer, prompts: Sequence[Sequence[int]], stop_ids: Sequence[int], batch_size: int,
                      max_new_tokens: int, device: torch.device) -> list[str]:
    """Greedy continuations of token-id prompts (generation.generate's batching, stops given)."""
    import torch

    tokenizer.padding_side = "left"
    config = generation.greedy_generation_config(max_new_tokens, stop_ids, tokenizer.pad_token_id)
    order = sorted(range(len(prompts)), key=lambda index: -len(prompts[index]))
    outputs: list[str | None] = [None] * len(prompts)
    with torch.no_grad(), generation.decoding_with(model, config):
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            padded = tokenizer.pad({"input_ids": [list(prompts[i]) for i in batch]}, padding=True, return_tensors="pt")
            input_ids = padded["input_ids"].to(device)
            generated = model.generate(input_ids=input_ids, attention_mask=padded["attention_mask"].to(device),
                                       generation_config=config)
            for row, index in enumerate(batch):
                new_ids = generation.cut_at_stop(generated[row, input_ids.shape[1]:].tolist(), stop_ids)
                outputs[index] = tokenizer.decode(new_ids, skip_special_tokens=True)
            print(f"generated {min(start + batch_size, len(order))}/{len(order)}", flush=True)
    return outputs


def evaluate(model, tokenizer, variant: "VariantSettings", rows: Sequence[dict], metric: str,
             evaluation: "EvaluationSettings", device: torch.device) -> EvaluationResult:
    if metric not in metrics.STRING_METRICS:
        raise WorkflowError(f"metric {metric!r} is not a conversation metric (known: {list(metrics.STRING_METRICS)})")
    if not rows:
        raise WorkflowError("no rows to evaluate")
    variant = check_variant(variant)
    labelled = label_conversations(tokenizer, [row_conversation(row, variant) for row in rows],
                                   [row["id"] for row in rows])
    prompts = [item.input_ids[:item.prompt_length] for item in labelled]
    end_of_turn_ids = sorted({item.end_of_turn[-1] for item in labelled})
    stop_ids = sorted(set(generation.stop_token_ids(tokenizer, model)) | set(end_of_turn_ids))
    outputs = generate_from_ids(model, tokenizer, prompts, stop_ids, evaluation.batch_size,
                                evaluation.max_new_tokens, device)
    golds = [{"id": row["id"], "answers": [row["messages"][-1]["content"]]} for row in rows]
    from workflow_scripts.core.entry_settings import ExtractorSettings, VariantSettings

    whole_message = VariantSettings("whole_message", "generation", extractor=ExtractorSettings("whole"))  # the gold
    records, score, unparseable = generation.score_outputs(golds, [item.prompt_text for item in labelled], outputs,
                                                           whole_message, metric)
    config = generation.greedy_generation_config(evaluation.max_new_tokens, stop_ids, tokenizer.pad_token_id)
    return EvaluationResult(records, score, unparseable, {
        "decoding": "greedy", "generation_config": generation.recorded_decoding(config),
        "end_of_turn_token_ids": end_of_turn_ids,
        "end_of_turn_tokens": tokenizer.convert_ids_to_tokens(end_of_turn_ids)})


# --- the task --------------------------------------------------------------------------------------------
def check_variant(variant: "VariantSettings") -> "VariantSettings":
    """The typed variant with its system prompt stripped (``system_prompt``: None keeps each conversation's
    own); a blank one is refused."""
    system_prompt = variant.system_prompt
    if not (system_prompt is None or system_prompt is False or (isinstance(system_prompt, str) and system_prompt.strip())):
        raise WorkflowError(f"variant system_prompt: expected a non-empty string (replace or add the system message), "
                            f"false (remove it) or null (keep each conversation's own), got {system_prompt!r:.60}")
    return dataclasses.replace(variant, system_prompt=system_prompt.strip() if isinstance(system_prompt, str)
                               else system_prompt)


def variant_record(variant: "VariantSettings") -> dict[str, Any]:
    """The variant as pretokenise's cache key, its ``templates`` record and the manifests hold it."""
    return {"system_prompt": check_variant(variant).system_prompt}


def probe_tokenizer(tokenizer) -> str:
    """The labelling on a two-exchange probe conversation, described (raises as :func:`label_conversations`)."""
    probe = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"},
             {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four"}]
    [item] = label_conversations(tokenizer, [probe], ["probe"])
    ends = tokenizer.convert_ids_to_tokens(sorted(set(item.end_of_turn)))
    labelled = sum(label != IGNORE_INDEX for label in item.labels)
    return (f"chat template renders turns incrementally; on a probe conversation {labelled} of {len(item.labels)} "
            f"tokens are assistant targets, each turn ending with {ends}")


PROBE_TURNS = (("user", "probe first question"), ("assistant", "probe first answer"),
               ("user", "probe second question"), ("assistant", "probe second answer"))


def dropped_turn(tokenizer, variant: "VariantSettings") -> tuple[str, str] | None:
    """``(the turn the chat template drops, the rendering)`` for a probe conversation as the variant shows it
    (its ``system_prompt`` added or removed), else None; spacing ignored, as templates may trim.

    The labelling checks (:func:`probe_tokenizer`) see only that turns render incrementally; a template that
    ignores system messages passes them, and the variant's system prompt would silently never reach the model.
    With ``system_prompt`` null the probe has no system turn (each conversation's own is kept, unseen here).
    """
    probe = with_system_prompt([{"role": role, "content": text} for role, text in PROBE_TURNS],
                               check_variant(variant).system_prompt)
    rendered = render(tokenizer, probe, False)
    flat = " ".join(rendered.split())
    for index, turn in enumerate(probe):
        if " ".join(turn["content"].split()) not in flat:
            what = (f"the system prompt {turn['content']!r} the variant sets" if turn["role"] == "system"
                    else f"turn {index} ({turn['role']}) {turn['content']!r}")
            return what, rendered
    return None


class ConversationTask:
    name = "conversation"
    packs = True  # rows are (input_ids, labels) as generation's: data/packing.PackingCollator applies
    fuses_output_head = True  # generation's TargetTokenLoss: training.fused_cross_entropy applies
    auto_model_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    variant_keys = frozenset(VARIANT_KEYS)
    metrics = tuple(metrics.STRING_METRICS)
    rejection_reasons = REJECTION_REASONS
    canonical_columns = ("id", "messages")
    dropped_reason = "no assistant token left after truncation to max_length"
    normalise_source = None  # raw records go through record_mapper

    def check_variant(self, variant: "VariantSettings") -> "VariantSettings":
        return check_variant(variant)

    def variant_record(self, variant: "VariantSettings") -> dict[str, Any]:
        return variant_record(variant)

    def check_config_variant(self, name: str, variant: "VariantSettings", datasets: Mapping[str, "DatasetSettings"]) -> None:
        """At parse time: the variant's value, and each conversation dataset's role and key mapping."""
        try:
            check_variant(variant)
        except WorkflowError as error:
            raise ConfigError(f"variants.{name}", str(error).removeprefix("argument --variant: ")) from None
        for ds_name, dataset in datasets.items():
            turn_mapping(dataset, f"datasets.{ds_name}")

    def normalise_fields(self, record: Mapping[str, Any], settings: "DatasetSettings") -> dict[str, Any]:
        """The canonical row (``id`` only when mapped; the stage numbers the others); raises ``Rejected``."""
        fields = settings.fields
        keys, role_of = turn_mapping(settings)
        row = {}
        if fields.get("id"):
            row["id"] = row_id(present(record, fields["id"]), fields["id"])
        row["messages"] = normalise_messages(present(record, fields["messages"]), fields["messages"], keys, role_of)
        return row

    def record_mapper(self, settings: "DatasetSettings", key: str) -> FieldsMapper:
        turn_mapping(settings, key)  # a bad mapping fails once, naming the key, before any record is read
        return FieldsMapper(self, settings, key)

    def normalise_state(self, settings: "DatasetSettings") -> ConversationStatistics:
        return ConversationStatistics()

    def tokenised_features(self):
        return generation.TASK.tokenised_features()

    def tokenise_batch(self, batch, *, tokenizer, variant, max_length, task_meta=None):
        return tokenise_batch(batch, tokenizer=tokenizer, variant=variant, max_length=max_length)

    def tokenise_meta(self, variant, task_meta, *, tokenizer=None) -> dict[str, Any]:
        return {}

    def model_kwargs(self, task_meta) -> dict[str, Any]:
        return {}

    def prepare_model(self, model, pad_token_id, task_meta) -> None:
        """A causal LM needs nothing beyond loading."""

    def collator(self, meta: Mapping[str, Any], vocab_size: int, packing_for: tuple[int, str] | None = None, *,
                 seed: int | None = None):
        return generation.TASK.collator(meta, vocab_size, packing_for, seed=seed)

    def loss_module(self, peft_model: nn.Module) -> nn.Module:
        return generation.TargetTokenLoss(peft_model)

    def lora_settings(self, model: nn.Module, lora: LoraSettings) -> LoraSettings:
        return generation.refuse_vision_keys(lora)

    def check_tokenizer(self, tokenizer) -> str | None:
        """The gate: a chat template that renders turns incrementally, with an end-of-turn token to learn."""
        from workflow_scripts.core.errors import PreflightError

        try:
            return probe_tokenizer(tokenizer)
        except WorkflowError as error:
            raise PreflightError("conversation_tokenizer", str(error), "see the message; the task's labels depend "
                                 "on the chat template (tasks/conversation.py)") from None

    def dropped_chat_turn(self, tokenizer, variant: "VariantSettings") -> tuple[str, str] | None:
        """The gate's chat_prompt check (preflight_checks.check_chat_prompt): every turn is rendered."""
        return dropped_turn(tokenizer, variant)

    def check_batch(self, batch: Mapping[str, Any], tokenizer, model: nn.Module) -> str | None:
        return None  # preflight_checks covers (input_ids, labels) batches

    def check_model(self, peft_model: nn.Module, task_meta: Mapping[str, Any], training: TrainingSettings) -> str | None:
        return None

    def check_gradients(self, peft_model: nn.Module, training: TrainingSettings) -> str | None:
        return None

    def evaluate(self, model, tokenizer, variant, rows, metric, evaluation, device) -> EvaluationResult:
        return evaluate(model, tokenizer, variant, rows, metric, evaluation, device)


TASK = ConversationTask()
