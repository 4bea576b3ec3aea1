"""The evaluate stage on a tiny random Llama, its own tokenizer and a LoRA adapter built here."""
from __future__ import annotations

import json

import pytest
import torch

from workflow_scripts import evaluate
from workflow_scripts.tasks import generation
from workflow_scripts.tasks import metrics
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.data.normalised_data import load_rows
from data_helpers import typed_variant

BASELINE = {"prompt": "Question: {question}\nAnswer:", "target": " {answer}", "extractor": {"type": "whole"},
            "chat_template": False}
MTUP = {"prompt": "Question: {question}\nSolve Task 1 then Task 2.\n", "target": "Task 1: {aux}\nTask 2: {answer}",
        "extractor": {"type": "section", "marker": "Task 2:"}, "chat_template": False}
TYPED_BASELINE, TYPED_MTUP = typed_variant(BASELINE), typed_variant(MTUP)  # as evaluate passes them to the task
EVALUATION = {"split": "test", "max_new_tokens": 6, "batch_size": 4, "max_examples": None, "gpus": 0,
              "evaluate_base_model": True}
QUESTIONS = [
    ("q0", "what is the total", ["12"]),
    ("q1", "which year had the highest value of all the years shown in the chart", ["2019"]),
    ("q2", "is it red", ["yes", "Yes"]),
    ("q3", "how many bars are there in this very long chart question", ["7"]),
    ("q4", "name", ["blue"]),
    ("q5", "what share is shown for the second group of bars", ["45%"]),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama with a byte-level BPE tokenizer trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(1)
    directory = tmp_path_factory.mktemp("tiny-model")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [f"Question: {q}\nAnswer: {a[0]}" for _, q, a in QUESTIONS] + ["Task 1: number\nTask 2: 42"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    """A LoRA adapter with non-zero B matrices, so it really changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"],
                                                  init_lora_weights=False, task_type="CAUSAL_LM"))
    directory = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def normalised(tmp_path_factory):
    from datasets import Dataset, DatasetDict

    def split(rows):
        return Dataset.from_dict({"id": [r[0] for r in rows], "question": [r[1] for r in rows],
                                  "answers": [r[2] for r in rows], "aux": ["number"] * len(rows)})

    directory = tmp_path_factory.mktemp("normalised") / "data"
    DatasetDict({"train": split(QUESTIONS[:2]), "test": split(QUESTIONS)}).save_to_disk(str(directory))
    (directory / "task_meta.json").write_text(json.dumps({"task": "generation"}))
    return directory


def run(tmp_path, model, data, adapter=None, variant=BASELINE, evaluation=EVALUATION, metric="exact_match",
        seed="1", name="out"):
    predictions, summary = tmp_path / name / "predictions.jsonl", tmp_path / name / "eval.json"
    argv = ["--model", str(model), "--data", str(data), "--task", "generation", "--variant", json.dumps(variant), "--metric", metric,
            "--evaluation", json.dumps(evaluation), "--dataset-name", "chart", "--variant-name", "baseline",
            "--seed", seed, "--predictions-out", str(predictions), "--summary-out", str(summary)]
    if adapter is not None:
        argv += ["--adapter", str(adapter)]
    assert evaluate.main(argv) == 0
    rows = [json.loads(line) for line in predictions.read_text().splitlines()]
    return rows, json.loads(summary.read_text())


def test_evaluate_writes_predictions_and_summary_deterministically(tmp_path, tiny_model, adapter, normalised):
    rows, summary = run(tmp_path, tiny_model, normalised, adapter, name="first")
    assert [row["id"] for row in rows] == [q[0] for q in QUESTIONS]
    assert set(rows[0]) == {"id", "prompt", "raw_output", "extracted", "auxiliary", "gold", "score", "parsed"}
    assert rows[2]["gold"] == ["yes", "Yes"]
    assert rows[0]["prompt"] == "Question: what is the total\nAnswer:"
    assert summary["dataset"] == "chart" and summary["variant"] == "baseline" and summary["seed"] == 1
    assert summary["n_examples"] == len(QUESTIONS) and summary["metric"] == "exact_match"
    assert summary["n_unparseable"] == sum(not row["parsed"] for row in rows)
    assert summary["score"] == pytest.approx(sum(row["score"] for row in rows) / len(rows))
    assert summary["adapter_dir"] == str(adapter) and summary["device"] == "cpu"
    again, _ = run(tmp_path, tiny_model, normalised, adapter, name="second")
    assert again == rows


def test_base_model_path_and_adapter_really_applied(tmp_path, tiny_model, adapter, normalised):
    base_rows, base_summary = run(tmp_path, tiny_model, normalised, None, seed="base", name="base")
    adapted_rows, _ = run(tmp_path, tiny_model, normalised, adapter, name="adapted")
    assert base_summary["seed"] == "base" and base_summary["adapter_dir"] is None
    assert [r["raw_output"] for r in base_rows] != [r["raw_output"] for r in adapted_rows]


def test_left_padded_batches_generate_what_single_prompts_do(tiny_model, adapter):
    """Right padding (or no attention mask) puts pad tokens between prompt and answer and changes outputs."""
    from workflow_scripts.model import model_loading

    tokenizer = model_loading.load_tokenizer(tiny_model)
    model = model_loading.load_with_adapter(tiny_model, adapter, torch.device("cpu"))
    prompts = [BASELINE["prompt"].format(question=q) for _, q, _ in QUESTIONS]
    one_by_one = generation.generate(model, tokenizer, TYPED_BASELINE, prompts, 1, 8, torch.device("cpu"))
    batched = generation.generate(model, tokenizer, TYPED_BASELINE, prompts, 4, 8, torch.device("cpu"))
    assert batched == one_by_one
    assert len(set(one_by_one)) > 1  # the check means something only if outputs vary


def test_greedy_ignores_sampling_defaults_of_the_model(tmp_path, tiny_model, adapter, normalised):
    """A model shipped with do_sample=True (Qwen-Instruct does) must still be decoded greedily."""
    import shutil

    from transformers import GenerationConfig

    sampling = tmp_path / "sampling-model"
    shutil.copytree(tiny_model, sampling)
    GenerationConfig(do_sample=True, temperature=5.0, top_k=0).save_pretrained(sampling)
    greedy_rows, _ = run(tmp_path, tiny_model, normalised, adapter, name="greedy")
    sampled_rows, _ = run(tmp_path, sampling, normalised, adapter, name="sampled")
    assert [r["raw_output"] for r in sampled_rows] == [r["raw_output"] for r in greedy_rows]


def argmax_loop(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy decoding written out by hand: the token with the highest logit, one at a time."""
    ids = torch.tensor([generation.templates.encode_prompts(tokenizer, TYPED_BASELINE, [prompt])[0]])
    new = []
    for _ in range(max_new_tokens):
        next_id = int(model(input_ids=ids).logits[0, -1].argmax())
        if next_id == tokenizer.eos_token_id:
            break
        new.append(next_id)
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_penalties_shipped_with_the_model_do_not_act(tmp_path, tiny_model, adapter):
    """Instruct models ship repetition_penalty / no_repeat_ngram_size; greedy means plain argmax all the same."""
    import shutil

    from transformers import GenerationConfig

    from workflow_scripts.model import model_loading

    penalised = tmp_path / "penalised-model"
    shutil.copytree(tiny_model, penalised)
    GenerationConfig(repetition_penalty=5.0, no_repeat_ngram_size=1, bad_words_ids=[[5]],
                     eos_token_id=2).save_pretrained(penalised)
    tokenizer = model_loading.load_tokenizer(penalised)
    model = model_loading.load_with_adapter(penalised, adapter, torch.device("cpu"))
    assert model.generation_config.repetition_penalty == 5.0  # the shipped config is really loaded
    prompts = [BASELINE["prompt"].format(question=q) for _, q, _ in QUESTIONS]
    generated = generation.generate(model, tokenizer, TYPED_BASELINE, prompts, 3, 12, torch.device("cpu"))
    assert generated == [argmax_loop(model, tokenizer, prompt, 12) for prompt in prompts]
    # The hand loop repeats tokens, so a repetition penalty or n-gram block would have changed the output.
    assert any(len(set(tokenizer.encode(text))) < len(tokenizer.encode(text)) for text in generated)
    assert model.generation_config.repetition_penalty == 5.0  # restored after generating


def test_eval_json_records_the_full_decoding_config(tmp_path, tiny_model, adapter, normalised):
    _, summary = run(tmp_path, tiny_model, normalised, adapter, name="recorded")
    decoding = summary["generation_config"]
    assert decoding["do_sample"] is False and decoding["num_beams"] == 1
    assert decoding["repetition_penalty"] == 1.0 and decoding["no_repeat_ngram_size"] == 0
    assert decoding["max_new_tokens"] == EVALUATION["max_new_tokens"]


def test_max_examples_and_generation_length_follow_the_config(tmp_path, tiny_model, normalised):
    from workflow_scripts.model import model_loading

    evaluation = {**EVALUATION, "max_examples": 3, "max_new_tokens": 2}
    rows, summary = run(tmp_path, tiny_model, normalised, evaluation=evaluation, seed="base")
    assert summary["n_examples"] == 3 and [r["id"] for r in rows] == ["q0", "q1", "q2"]
    tokenizer = model_loading.load_tokenizer(tiny_model)
    for row in rows:
        assert len(tokenizer(row["raw_output"], add_special_tokens=False)["input_ids"]) <= 2 + 1  # bpe re-merge slack


def test_mtup_extraction_scores_the_final_section_and_counts_unparseable():
    rows = [{"id": "a", "answers": ["42"]}, {"id": "b", "answers": ["7"]}, {"id": "c", "answers": ["yes"]}]
    outputs = ["Task 1: number\nTask 2: 43", "Task 1: number\nTask 2: 9", "Task 1: yes/no and no final task"]
    records, score, unparseable = generation.score_outputs(rows, ["p"] * 3, outputs, TYPED_MTUP, "relaxed_accuracy")
    assert [r["extracted"] for r in records] == ["43", "9", None]
    assert records[0]["auxiliary"] == "Task 1: number"
    assert [r["parsed"] for r in records] == [True, True, False]
    assert unparseable == 1
    assert [r["score"] for r in records] == [1.0, 0.0, 0.0]  # 43 is within 5% of 42; the auxiliary is not scored
    assert score == pytest.approx(1 / 3)


def test_smatch_records_counts_and_scores_micro():
    gold = "(w / want-01 :ARG0 (b / boy))"
    rows = [{"id": "a", "answers": [gold]}, {"id": "b", "answers": [gold]}]
    outputs = [gold, "(w / want-01 :ARG0 (b))"]  # "(b)" has no concept: smatch cannot parse it
    records, score, unparseable = generation.score_outputs(rows, ["p", "p"], outputs, TYPED_BASELINE, "smatch")
    assert [r["counts"] for r in records] == [[4, 4, 4], [0, 0, 4]]
    assert [r["parsed"] for r in records] == [True, False] and unparseable == 1  # counted, and scored 0 counts
    assert score == pytest.approx(metrics.f1_from_counts(4, 4, 8))


def test_cut_at_stop_drops_the_eos_and_everything_after():
    assert generation.cut_at_stop([5, 6, 2, 7, 2], [2]) == [5, 6]
    assert generation.cut_at_stop([2, 5], [2, 9]) == []
    assert generation.cut_at_stop([5, 6], [2]) == [5, 6]


def test_missing_split_fails_with_one_message_and_no_output(tmp_path, tiny_model, normalised):
    with pytest.raises(ConfigError, match=r"evaluation.split.*'validation'.*\['test', 'train'\]"):
        run(tmp_path, tiny_model, normalised, evaluation={**EVALUATION, "split": "validation"})
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_directory_without_adapter_is_refused(tmp_path, tiny_model, normalised):
    empty = tmp_path / "not-an-adapter"
    empty.mkdir()
    with pytest.raises(WorkflowError, match="adapter_config.json"):
        run(tmp_path, tiny_model, normalised, adapter=empty)
    assert not (tmp_path / "out" / "eval.json").exists()


@pytest.mark.parametrize(
    ("evaluation", "seed", "message"),
    [
        ({**EVALUATION, "max_new_tokens": "six"}, "1", "evaluation.max_new_tokens"),  # a missing key: the default
        ({**EVALUATION, "batch_size": 0}, "1", "evaluation.batch_size"),
        (EVALUATION, "first", "--seed"),
    ],
)
def test_bad_arguments_are_named(tmp_path, tiny_model, normalised, evaluation, seed, message):
    with pytest.raises(WorkflowError, match=message):
        run(tmp_path, tiny_model, normalised, evaluation=evaluation, seed=seed)


def test_duplicate_ids_are_refused(tmp_path):
    from datasets import Dataset, DatasetDict

    data = tmp_path / "dup"
    rows = {"id": ["x", "x"], "question": ["a", "b"], "answers": [["1"], ["2"]]}
    DatasetDict({"test": Dataset.from_dict(rows)}).save_to_disk(str(data))
    with pytest.raises(WorkflowError, match=r"row 1: duplicate id 'x'"):
        load_rows(str(data), "test", None)


def test_declared_gpus_lease_a_device_and_refuse_to_fall_back_to_cpu(tmp_path, tiny_model, normalised, monkeypatch):
    """gpus > 0 leases a GPU (CUDA_VISIBLE_DEVICES) and fails clearly where CUDA sees none, leaving no output."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the refusal is what a CPU-only machine shows")
    monkeypatch.setenv("LORA_WORKFLOW_GPU_IDS", "3")
    monkeypatch.setenv("LORA_WORKFLOW_LEASE_DIR", str(tmp_path / "leases"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(WorkflowError, match="evaluation.gpus is 1 but CUDA sees no device"):
        run(tmp_path, tiny_model, normalised, evaluation={**EVALUATION, "gpus": 1})
    assert evaluate.os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # the leased id, set before CUDA was touched
    assert not (tmp_path / "out" / "eval.json").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_declared_gpu_evaluates_on_cuda_in_bf16(tmp_path, tiny_model, adapter, normalised, monkeypatch):
    monkeypatch.setenv("LORA_WORKFLOW_LEASE_DIR", str(tmp_path / "leases"))
    rows, summary = run(tmp_path, tiny_model, normalised, adapter, evaluation={**EVALUATION, "gpus": 1})
    assert summary["device"] == "cuda:0" and summary["dtype"] in {"bfloat16", "float32"}
    assert len(rows) == len(QUESTIONS)
