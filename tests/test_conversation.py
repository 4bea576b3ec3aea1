"""Task type ``conversation``: the label mask through chat templates (the tiny model's, a ChatML one and
templates that must be refused), the normalise checks of malformed conversations and ShareGPT's key and
role names, the config layer, and a chain as the rules call it: normalise -> prepare_model (tiny) ->
pretokenise -> sanity -> train -> evaluate, the trained adapter beating the untrained model."""
from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import tiny_training_settings, training_json
from data_helpers import local_dataset, run_download, run_normalise, typed_variant
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.data.rows import Rejected
from workflow_scripts.model.tiny_model import CHAT_TEMPLATE, EOS_TOKEN, train_tokenizer
from workflow_scripts.tasks import conversation, task_named
from workflow_scripts.tasks.conversation import TASK, TemplateRefused


def typed(given):
    """A conversation variant as pretokenise and evaluate take it (typed, the task's checks)."""
    return TASK.check_variant(typed_variant(given, "conversation"))


SYSTEM = {"role": "system", "content": "Answer with one word."}
DIALOGUE = [SYSTEM, {"role": "user", "content": "colour of sky?"}, {"role": "assistant", "content": "blue"},
            {"role": "user", "content": "and grass?"}, {"role": "assistant", "content": "green"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same rendering, with the assistant's message and its end-of-turn token marked for return_assistant_tokens_mask.
CHATML_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(template: str | None = CHAT_TEMPLATE, texts=("colour of the sky and grass? blue green",),
                   extra_special=()):
    tokenizer = train_tokenizer(iter(list(texts) * 20), 300)
    if extra_special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(extra_special)})
    tokenizer.chat_template = template
    tokenizer.name_or_path = "models/tiny-test"
    return tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return make_tokenizer()


def labelled_pieces(tokenizer, item) -> list[str]:
    """The labelled tokens as text, one string per contiguous run."""
    runs, current = [], []
    for token, label in zip(item.input_ids, item.labels):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


# --- labels ------------------------------------------------------------------------------------------
def test_assistant_turns_and_their_end_of_turn_are_the_only_targets(tiny_tokenizer):
    [item] = conversation.label_conversations(tiny_tokenizer, [DIALOGUE], ["d0"])
    full = tiny_tokenizer.apply_chat_template(DIALOGUE, tokenize=False)
    assert tiny_tokenizer.decode(item.input_ids, skip_special_tokens=False) == full
    # The system message's eos, the user turns and the <|assistant|> headers are never targets.
    assert labelled_pieces(tiny_tokenizer, item) == [f"blue{EOS_TOKEN}", f"green{EOS_TOKEN}"]
    eos = tiny_tokenizer.eos_token_id
    assert item.input_ids.count(eos) == 3 and item.end_of_turn == [eos, eos]
    system_eos = item.input_ids.index(eos)
    assert item.labels[system_eos] == -100
    # The evaluation prompt: every turn before the last assistant turn, with the generation prompt.
    prompt = tiny_tokenizer.apply_chat_template(DIALOGUE[:-1], tokenize=False, add_generation_prompt=True)
    assert item.prompt_text == prompt and prompt.endswith("<|assistant|>\n")
    assert item.input_ids[:item.prompt_length] == tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    header = tiny_tokenizer("<|assistant|>\n", add_special_tokens=False)["input_ids"]
    assert item.input_ids[item.prompt_length - len(header):item.prompt_length] == header
    assert all(label == -100 for label in item.labels[item.prompt_length - len(header):item.prompt_length])


def test_chatml_newline_after_end_of_turn_is_scaffolding_and_matches_the_generation_mask():
    tokenizer = make_tokenizer(CHATML, extra_special=("<|im_start|>", "<|im_end|>"))
    [item] = conversation.label_conversations(tokenizer, [DIALOGUE], ["d0"])
    assert labelled_pieces(tokenizer, item) == ["blue<|im_end|>", "green<|im_end|>"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert item.end_of_turn == [im_end, im_end]
    # A template whose {% generation %} block holds the message and <|im_end|> gives the same mask.
    tokenizer.chat_template = CHATML_GENERATION
    reference = tokenizer.apply_chat_template(DIALOGUE, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
    assert list(reference["input_ids"]) == item.input_ids
    assert [int(label != -100) for label in item.labels] == list(reference["assistant_masks"])


def test_a_template_that_re_renders_earlier_turns_is_refused_naming_the_tokenizer():
    counting = "{{ messages | length }} turns\n" + CHAT_TEMPLATE  # the header changes with every turn
    with pytest.raises(TemplateRefused, match=r"models/tiny-test .*renders the conversation .* incrementally"):
        conversation.label_conversations(make_tokenizer(counting), [DIALOGUE], ["d0"])


def test_a_template_whose_generation_prompt_lacks_the_header_is_refused():
    no_prompt = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                 "{% if m['role'] != 'user' %}" + EOS_TOKEN + "{% endif %}{% endfor %}")  # ignores add_generation_prompt
    with pytest.raises(TemplateRefused, match=r"writes '<\|assistant\|>' before assistant turn 2"):
        conversation.label_conversations(make_tokenizer(no_prompt), [DIALOGUE], ["d0"])


def test_a_template_without_an_end_of_turn_token_is_refused():
    plain = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}assistant:\n{% endif %}")
    with pytest.raises(TemplateRefused, match="puts no special end-of-turn token after assistant turn 2"):
        conversation.label_conversations(make_tokenizer(plain), [DIALOGUE], ["d0"])


def test_a_token_across_the_prompt_boundary_is_refused():
    # Like Llama-2's [/INST]: the user turn ends with the assistant's cue, the generation prompt adds nothing.
    glued = ("{% for m in messages %}{% if m['role'] == 'user' %}Q:{{ m['content'] }}A:{% else %}{{ m['content'] }}"
             + EOS_TOKEN + "{% endif %}{% endfor %}")
    dialogue = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "blue"}]
    # Trained on "A:blue", the tokenizer merges it across the prompt's end: the prompt alone ends with "A:".
    tokenizer = make_tokenizer(glued, texts=("A:blue A:blue Q:x",))
    with pytest.raises(TemplateRefused, match="tokenises the text before assistant turn 1 differently"):
        conversation.label_conversations(tokenizer, [dialogue], ["d0"])


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line():
    with pytest.raises(WorkflowError, match=r"^the tokenizer of models/tiny-test has no chat template.*chat_template"
                                            r"\.jinja\)$"):
        conversation.label_conversations(make_tokenizer(None), [DIALOGUE], ["d0"])


def test_the_gate_describes_the_labelling_or_refuses(tiny_tokenizer):
    from workflow_scripts.training.preflight_checks import PreflightError

    detail = TASK.check_tokenizer(tiny_tokenizer)
    assert "renders turns incrementally" in detail and EOS_TOKEN in detail
    with pytest.raises(PreflightError, match="conversation_tokenizer: the tokenizer of .* has no chat template"):
        TASK.check_tokenizer(make_tokenizer(None))


def test_truncation_cuts_from_the_end_and_drops_rows_without_an_assistant_token(tiny_tokenizer):
    rows = {"id": ["a"], "messages": [DIALOGUE]}
    whole = TASK.tokenise_batch(rows, tokenizer=tiny_tokenizer, variant=typed({}), max_length=512)
    length = whole["length"][0]
    assert not whole["truncated"][0] and not whole["dropped"][0]
    cut = TASK.tokenise_batch(rows, tokenizer=tiny_tokenizer, variant=typed({}), max_length=length - 2)
    assert cut["truncated"] == [True] and cut["dropped"] == [False]
    assert cut["input_ids"][0] == whole["input_ids"][0][:length - 2] and cut["labels"][0] == whole["labels"][0][:length - 2]
    [item] = conversation.label_conversations(tiny_tokenizer, [DIALOGUE], ["a"])
    first_target = next(i for i, label in enumerate(item.labels) if label != -100)
    dropped = TASK.tokenise_batch(rows, tokenizer=tiny_tokenizer, variant=typed({}), max_length=first_target)
    assert dropped["dropped"] == [True] and dropped["truncated"] == [True]


def test_rows_pad_and_pack_with_generations_collators_to_the_same_targets(tiny_tokenizer):
    shorter = DIALOGUE[1:3]
    columns = TASK.tokenise_batch({"id": ["a", "b"], "messages": [DIALOGUE, shorter]}, tokenizer=tiny_tokenizer,
                                  variant=typed({}), max_length=512)
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    meta = {"pad_token_id": tiny_tokenizer.pad_token_id}
    padded = TASK.collator(meta, len(tiny_tokenizer), seed=1)(rows)
    packed = TASK.collator(meta, len(tiny_tokenizer), (512, "sdpa"), seed=1)(rows)
    targets = sum(label != -100 for row in rows for label in row["labels"][1:])
    assert padded["target_tokens"] == packed["target_tokens"] == targets > 0
    assert packed["input_ids"].shape[0] == 1 and padded["input_ids"].shape[0] == 2
    assert sorted(padded["target_ids"].tolist()) == sorted(packed["target_ids"].tolist())


def test_the_variant_system_prompt_replaces_adds_or_removes_the_system_message(tiny_tokenizer):
    no_system = DIALOGUE[1:]
    assert conversation.with_system_prompt(DIALOGUE, None) == DIALOGUE
    assert conversation.with_system_prompt(DIALOGUE, "Be terse.")[0] == {"role": "system", "content": "Be terse."}
    assert conversation.with_system_prompt(no_system, "Be terse.") == [{"role": "system", "content": "Be terse."},
                                                                       *no_system]
    assert conversation.with_system_prompt(DIALOGUE, False) == no_system
    rows = {"id": ["a"], "messages": [DIALOGUE]}
    kept = TASK.tokenise_batch(rows, tokenizer=tiny_tokenizer, variant=typed({"system_prompt": None}), max_length=512)
    removed = TASK.tokenise_batch(rows, tokenizer=tiny_tokenizer, variant=typed({"system_prompt": False}), max_length=512)
    assert removed["length"][0] < kept["length"][0]
    assert TASK.variant_record(typed({})) == {"system_prompt": None}
    assert typed({"system_prompt": " Be terse. "}).system_prompt == "Be terse."
    for bad in ({"system_prompt": ""}, {"system_prompt": "   "}, {"system_prompt": True}, {"prompt": "{question}"}):
        with pytest.raises(WorkflowError):
            typed(bad)  # the schema's refusals, then the task's (a blank system prompt)


# --- normalise -------------------------------------------------------------------------------------
def dataset(**settings) -> DatasetSettings:
    """A conversation dataset's typed settings (as normalise receives them)."""
    return DatasetSettings.parse({"task": "conversation", "source": {"type": "local", "path": "chats"},
                                  "metric": "exact_match", **settings}, "chat")


SHAREGPT_SETTINGS = {"fields": {"messages": "conversations"}, "keys": {"role": "from", "content": "value"},
                     "roles": {"user": "human", "assistant": "gpt", "system": "system"}}
SETTINGS = dataset(fields={"id": "id", "messages": "messages"})
SHAREGPT = dataset(**SHAREGPT_SETTINGS)


def turns(*pairs):
    return [{"role": role, "content": content} for role, content in pairs]


@pytest.mark.parametrize("messages, reason, field, detail", [
    ("hello", "wrong_type", "messages", "expected a list of turns"),
    ([], "empty_value", "messages", "empty list"),
    (["hi"], "wrong_type", "messages[0]", "turn 0: expected an object"),
    ([{"content": "hi"}], "missing_field", "messages[0].role", "turn 0: 'role' is missing"),
    ([{"role": "user", "content": None}], "missing_field", "messages[0].content", "turn 0: 'content' is null"),
    (turns(("user", "hi"), ("bot", "yo")), "unknown_role", "messages[1].role", "turn 1: role 'bot'"),
    (turns(("user", "hi"), ("assistant", "  ")), "empty_value", "messages[1].content", "turn 1: the assistant message"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "wrong_type", "messages[0].content",
     "list of parts"),
    (turns(("user", "a"), ("system", "b"), ("assistant", "c")), "turn_order", "messages[1].role",
     "turn 1: a system message may only be the first turn"),
    (turns(("user", "a"), ("user", "b"), ("assistant", "c")), "turn_order", "messages[1].role",
     "turn 1: user after a user turn"),
    (turns(("system", "s"), ("assistant", "c")), "turn_order", "messages[1].role",
     "turn 1: assistant after a system turn"),
    (turns(("user", "a"), ("assistant", "b"), ("user", "c")), "turn_order", "messages[2].role",
     "turn 2: the conversation ends with a user turn"),
    (turns(("system", "s")), "turn_order", "messages[0].role", "ends with a system turn"),
])
def test_malformed_conversations_are_rejected_naming_the_turn(messages, reason, field, detail):
    with pytest.raises(Rejected) as caught:
        TASK.normalise_fields({"id": "r1", "messages": messages}, SETTINGS)
    assert (caught.value.reason, caught.value.field) == (reason, field)
    assert detail in caught.value.detail and "\n" not in caught.value.detail


@pytest.mark.parametrize("role", ["tool", "function", "ipython", "observation"])
def test_a_tool_turn_is_named_as_one_not_sent_to_map_its_role(role):
    messages = [*turns(("user", "weather?")), {"role": "assistant", "content": "calling"}, {"role": role, "content": "12 C"},
                *turns(("assistant", "It is 12 C."))]
    with pytest.raises(Rejected) as caught:
        TASK.normalise_fields({"id": "r1", "messages": messages}, SETTINGS)
    assert (caught.value.reason, caught.value.field) == ("unknown_role", "messages[2].role")
    assert caught.value.detail == (f"turn 2: role {role!r} is a tool call or its result, which this task does not "
                                   "train on (conversations of system, user and assistant turns only, rendered without "
                                   "tools); leave conversations with tool turns out of the dataset")


def test_a_clean_conversation_is_stripped_and_kept():
    row = TASK.normalise_fields({"id": 7, "messages": turns(("user", " hi "), ("assistant", "yo\n"))}, SETTINGS)
    assert row == {"id": "7", "messages": turns(("user", "hi"), ("assistant", "yo"))}


def test_sharegpt_keys_and_roles_are_mapped():
    record = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
                                {"from": "gpt", "value": "hello", "weight": 1}]}
    row = TASK.normalise_fields(record, SHAREGPT)
    assert row == {"messages": turns(("system", "Be brief."), ("user", "hi"), ("assistant", "hello"))}
    with pytest.raises(Rejected) as caught:
        TASK.normalise_fields({"conversations": [{"from": "user", "value": "hi"}]}, SHAREGPT)
    assert caught.value.reason == "unknown_role" and caught.value.field == "conversations[0].from"
    with pytest.raises(Rejected) as caught:
        TASK.normalise_fields({"conversations": [{"role": "human", "value": "hi"}]}, SHAREGPT)
    assert caught.value.reason == "missing_field" and caught.value.field == "conversations[0].from"


def test_an_ambiguous_mapping_is_a_config_error():
    with pytest.raises(ConfigError, match=r"datasets\.chat\.roles.*'user' and 'assistant' are both read from"):
        TASK.record_mapper(dataset(**{**SHAREGPT_SETTINGS, "roles": {"user": "x", "assistant": "x"}}), "datasets.chat")
    with pytest.raises(ConfigError, match=r"datasets\.chat\.keys"):
        TASK.record_mapper(dataset(**{**SHAREGPT_SETTINGS, "keys": {"role": "v", "content": "v"}}), "datasets.chat")


def sharegpt_files():
    good = [{"id": f"c{k}", "conversations": [{"from": "human", "value": f"hi {k}"}, {"from": "gpt", "value": "yo"}]}
            for k in range(40)]
    return {"train": good + [{"id": "empty", "conversations": [{"from": "human", "value": "hi"},
                                                                {"from": "gpt", "value": ""}]}],
            "test": [{"id": f"t{k}", "conversations": [{"from": "human", "value": f"bye {k}"},
                                                       {"from": "gpt", "value": "ciao"}]} for k in range(5)]}


def test_normalise_stage_reads_sharegpt_and_reports_conversations(tmp_path):
    settings = local_dataset(tmp_path / "src", sharegpt_files(), task="conversation", metric="exact_match",
                             fields={"id": "id", "messages": "conversations"}, keys=SHAREGPT_SETTINGS["keys"],
                             roles=SHAREGPT_SETTINGS["roles"], max_rejected_fraction=0.1)
    data, report = run_normalise("chat", settings, run_download("chat", settings, tmp_path), tmp_path)
    report = json.loads(report.read_text())
    assert report["splits"]["train"]["reasons"] == {"empty_value": 1}
    assert report["reasons"]["empty_value"]["examples"][0]["field"] == "conversations[1].value"
    assert report["conversations"]["train"] == {"conversations": 40, "assistant_turns": 40, "with_system_message": 0,
                                                "mean_turns": 2.0, "max_turns": 2}
    from datasets import load_from_disk

    assert load_from_disk(str(data))["test"][0] == {"id": "t0", "messages": turns(("user", "bye 0"), ("assistant", "ciao"))}


def test_normalise_stage_reports_the_tasks_own_reasons(tmp_path):
    files = sharegpt_files()
    files["train"].append({"id": "bot", "conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]})
    settings = local_dataset(tmp_path / "src", files, task="conversation", metric="exact_match",
                             fields={"id": "id", "messages": "conversations"}, keys=SHAREGPT_SETTINGS["keys"],
                             roles=SHAREGPT_SETTINGS["roles"], max_rejected_fraction=0.1)
    _, report = run_normalise("chat", settings, run_download("chat", settings, tmp_path), tmp_path)
    assert json.loads(report.read_text())["splits"]["train"]["reasons"]["unknown_role"] == 1


# --- configuration ----------------------------------------------------------------------------------
def test_the_config_layer_accepts_conversation_datasets_and_variants():
    from workflow_scripts.checks.config import check_config
    from workflow_scripts.core.config_files import validate_schema

    dataset = {"task": "conversation", "source": {"type": "local", "path": "data/chat"},
               "fields": {"messages": "conversations"}, "keys": SHAREGPT_SETTINGS["keys"], "roles": SHAREGPT_SETTINGS["roles"],
               "metric": "token_f1"}
    config = {"model": {"name": "tiny", "source": "tiny"}, "datasets": {"chat": dataset}, "training": {"max_steps": 10},
              "variants": {"baseline": {"task": "conversation"},
                           "terse": {"task": "conversation", "system_prompt": "Answer in one word."},
                           "no_system": {"task": "conversation", "system_prompt": False}}}
    check_config(validate_schema(config))
    assert task_named("conversation") is TASK and TASK.variant_keys == {"system_prompt"}
    for bad_variant in ({"task": "conversation", "prompt": "{question}"}, {"task": "conversation", "system_prompt": ""}):
        with pytest.raises(ConfigError):
            validate_schema({**config, "variants": {"baseline": bad_variant}})
    with pytest.raises(ConfigError, match="fields"):
        validate_schema({**config, "datasets": {"chat": {**dataset, "fields": {"question": "q", "answers": "a"}}}})
    with pytest.raises(ConfigError, match=r"datasets\.chat\.roles"):
        check_config(validate_schema({**config, "datasets": {"chat": {**dataset, "roles": {"user": "a", "assistant": "a"}}}}))


# --- the chain -----------------------------------------------------------------------------------------
COLOURS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "sun": "yellow",
           "plum": "purple", "carrot": "orange"}
MAX_LENGTH = 160
EVALUATION = {"split": "test", "max_new_tokens": 6, "batch_size": 32, "max_examples": None, "gpus": 0,
              "evaluate_base_model": True}


GREETINGS = ("hi", "hey", "hello", "so", "ok", "well", "now", "yes")


def dialogues() -> dict[str, list[dict]]:
    """Two exchanges each; the assistant names the colour of the thing the user asks about (the rule).
    Train and test conversations are distinct (no test row repeats a train row)."""
    rng = random.Random(0)
    things = sorted(COLOURS)
    combos = [(s, g1, t1, g2, t2) for s in (0, 1) for g1 in GREETINGS for t1 in things for g2 in GREETINGS
              for t2 in things]
    records = []
    for k, (system, g1, t1, g2, t2) in enumerate(rng.sample(combos, 320 + 48)):
        messages = ([{"role": "system", "content": "One word."}] if system else []) + [
            {"role": "user", "content": f"{g1}, colour of {t1}?"}, {"role": "assistant", "content": COLOURS[t1]},
            {"role": "user", "content": f"{g2}, and {t2}?"}, {"role": "assistant", "content": COLOURS[t2]}]
        records.append({"id": f"d{k}", "messages": messages})
    return {"train": records[:320], "test": records[320:]}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("conversation")
    settings = local_dataset(tmp / "src", dialogues(),
                             task="conversation", fields={"id": "id", "messages": "messages"}, metric="exact_match")
    data, report = run_normalise("colours", settings, run_download("colours", settings, tmp), tmp)
    tiny = {"name": "tiny", "source": "tiny", "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                                                      "num_heads": 4, "vocab_size": 320, "seed": 0}}
    from workflow_scripts import prepare_model, pretokenise

    assert prepare_model.main(["--model", json.dumps(tiny), "--out", str(tmp / "model"), "--corpus", str(data)]) == 0
    tokenised = tmp / "tokenised"
    assert pretokenise.main(["--model", str(tmp / "model"), "--data", str(data), "--task", "conversation",
                             "--variant", "{}", "--max-length", str(MAX_LENGTH), "--out", str(tokenised),
                             "--report", str(tmp / "tokenise_report.json")]) == 0
    return tmp, data, tokenised


def test_chain_pretokenises_with_the_tiny_models_chat_template(chain):
    tmp, data, tokenised = chain
    from transformers import AutoTokenizer
    from datasets import load_from_disk

    tokenizer = AutoTokenizer.from_pretrained(str(tmp / "model"))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    report = json.loads((tmp / "tokenise_report.json").read_text())["splits"]["train"]
    assert report["kept"] == 320 and report["dropped"] == 0 and report["truncated"] == 0, report
    row = load_from_disk(str(tokenised))["train"][1]
    pieces = [tokenizer.decode([t for t, l in zip(row["input_ids"], row["labels"]) if l != -100],
                               skip_special_tokens=False)]
    assert pieces[0].count(EOS_TOKEN) == 2 and "<|assistant|>" not in pieces[0] and "One word" not in pieces[0]


def test_chain_gate_train_and_evaluate(chain):
    tmp, data, tokenised = chain
    from workflow_scripts import evaluate, sanity, train

    settings = tiny_training_settings(max_steps=100, learning_rate=1e-2, effective_batch=16, micro_batch=8,
                                      max_length=MAX_LENGTH, warmup_steps=5, checkpoint_every=1000,
                                      lora={"rank": 8, "alpha": 16, "target_modules": [
                                          "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})
    common = ["--model", str(tmp / "model"), "--data", str(tokenised), "--training", training_json(settings), "--seed", "1"]
    assert sanity.main([*common, "--out", str(tmp / "sanity.json")]) == 0
    gate = json.loads((tmp / "sanity.json").read_text())
    checks = {check["name"]: check for check in gate["checks"]}
    assert gate["passed"] and EOS_TOKEN in checks["conversation_tokenizer"]["detail"]
    assert "renders every turn" in checks["chat_prompt"]["detail"]
    out = tmp / "run"
    assert train.main([*common, "--checkpoint-dir", str(out / "checkpoints"), "--adapter-out", str(out / "adapter"),
                       "--log-out", str(out / "train_log.jsonl"), "--manifest-out", str(out / "run_manifest.json")]) == 0

    def run_evaluate(name, adapter):
        argv = ["--model", str(tmp / "model"), "--data", str(data), "--task", "conversation", "--variant", "{}",
                "--metric", "exact_match", "--evaluation", json.dumps(EVALUATION), "--dataset-name", "colours",
                "--variant-name", "baseline", "--seed", name, "--predictions-out", str(tmp / name / "predictions.jsonl"),
                "--summary-out", str(tmp / name / "eval.json")]
        assert evaluate.main(argv + (["--adapter", str(adapter)] if adapter else [])) == 0
        records = [json.loads(line) for line in (tmp / name / "predictions.jsonl").read_text().splitlines()]
        return json.loads((tmp / name / "eval.json").read_text()), records

    (trained, records), (untrained, _) = run_evaluate("1", out / "adapter"), run_evaluate("base", None)
    assert trained["task"] == "conversation" and trained["n_examples"] == 48
    first = records[0]
    assert first["prompt"].endswith("<|assistant|>\n") and first["gold"] == [dialogues()["test"][0]["messages"][-1]["content"]]
    assert EOS_TOKEN in trained["end_of_turn_tokens"]
    assert trained["score"] > untrained["score"] + 0.3 and trained["score"] >= 0.4, (trained["score"], untrained["score"])


# --- the gate's chat_prompt check (preflight_checks.check_chat_prompt) ---------------------------------------
# Templates that pass the labelling checks (turns render incrementally, each assistant turn ends with EOS)
# yet drop content: the system message, or every turn but the last of each role pair.
DROPS_SYSTEM = ("{% for message in messages %}{% if message['role'] != 'system' %}<|{{ message['role'] }}|>\n"
                "{{ message['content'] }}{% if message['role'] != 'user' %}" + EOS_TOKEN + "{% endif %}\n{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LAST_MESSAGE_ONLY = ("{{ messages[-1]['content'] }}{% if messages[-1]['role'] == 'assistant' %}" + EOS_TOKEN
                     + "{% endif %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_the_chat_prompt_check_refuses_a_template_that_drops_the_variants_system_prompt():
    from workflow_scripts.training.preflight_checks import PreflightError, check_chat_prompt

    tokenizer = make_tokenizer(DROPS_SYSTEM)
    assert "renders turns incrementally" in TASK.check_tokenizer(tokenizer)  # the labelling checks pass it
    with pytest.raises(PreflightError, match=r"^chat_prompt: the chat template of models/tiny-test renders the probe "
                       r"conversation of variant \{'system_prompt': 'Answer in one word\.'\} as .*, without the system "
                       r"prompt 'Answer in one word\.' the variant sets"):
        check_chat_prompt(TASK, tokenizer, {"system_prompt": " Answer in one word. "})
    # Without a system turn nothing is dropped.
    assert "renders every turn" in check_chat_prompt(TASK, tokenizer, {"system_prompt": False})


def test_the_chat_prompt_check_refuses_a_template_that_renders_only_the_last_message():
    from workflow_scripts.training.preflight_checks import PreflightError, check_chat_prompt

    with pytest.raises(PreflightError, match=r"^chat_prompt: .* as 'probe second answer<\|endoftext\|>', without turn 0 \(user\) "
                       r"'probe first question'"):
        check_chat_prompt(TASK, make_tokenizer(LAST_MESSAGE_ONLY), {})


@pytest.mark.parametrize("variant", [{}, {"system_prompt": "Answer in one word."}, {"system_prompt": False}])
def test_the_chat_prompt_check_passes_the_tiny_models_template(tiny_tokenizer, variant):
    from workflow_scripts.training.preflight_checks import check_chat_prompt

    assert check_chat_prompt(TASK, tiny_tokenizer, variant).startswith(
        "the chat template of models/tiny-test renders every turn (conversation")


def test_the_gate_refuses_a_model_whose_template_drops_the_variants_system_prompt(chain, tmp_path):
    """Through the stages: pretokenise labels such a template without complaint; sanity stops at chat_prompt."""
    import shutil

    from transformers import AutoTokenizer

    from workflow_scripts import pretokenise, sanity
    from workflow_scripts.training.preflight_checks import PreflightError

    tmp, data, _ = chain
    model = tmp_path / "model"
    shutil.copytree(tmp / "model", model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.chat_template = DROPS_SYSTEM
    tokenizer.save_pretrained(str(model))
    variant = {"system_prompt": "Answer in one word."}
    assert pretokenise.main(["--model", str(model), "--data", str(data), "--task", "conversation", "--variant",
                             json.dumps(variant), "--max-length", str(MAX_LENGTH), "--out", str(tmp_path / "tokenised"),
                             "--report", str(tmp_path / "tokenise_report.json")]) == 0
    settings = tiny_training_settings(max_steps=2, effective_batch=8, micro_batch=8, max_length=MAX_LENGTH)
    with pytest.raises(PreflightError, match=r"^chat_prompt: .* variant \{'system_prompt': 'Answer in one word\.'\} "
                       r"as .*, without the system prompt 'Answer in one word\.' the variant sets"):
        sanity.main(["--model", str(model), "--data", str(tmp_path / "tokenised"), "--training",
                     training_json(settings), "--seed", "1", "--out", str(tmp_path / "sanity.json")])
    assert not (tmp_path / "sanity.json").exists()
