"""Task type ``classification`` on tiny random Llama / BERT classifiers and tokenizers built here (offline)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from workflow_scripts.core.section_settings import EvaluationSettings
from workflow_scripts.demo import make_classification
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.normalise import Rejected
from workflow_scripts.tasks import classification, classification_loss
from workflow_scripts.tasks.classification import TASK
from data_helpers import typed_variant


def typed(given):
    """A classification variant as pretokenise and evaluate take it (typed, the task's checks)."""
    return TASK.check_variant(typed_variant(given, "classification"))

LABELS = ["food", "sport", "weather"]
def dataset(**settings) -> DatasetSettings:
    """A classification dataset's typed settings (as normalise receives them)."""
    return DatasetSettings.parse({"task": "classification", "source": {"type": "local", "path": "topics"},
                                  "metric": "accuracy", **settings}, "topics")


SETTINGS = dataset(fields={"id": "id", "text": "sentence", "label": "topic"})
PLAIN = typed({"input": "{text}"})


def demo_rows(split: str = "train", count: int | None = None) -> list[dict]:
    """Clean canonical rows of the demo dataset (its malformed records left out)."""
    rows = []
    for record in make_classification.build(0)[split]:
        try:
            rows.append(TASK.normalise_fields(record, dataclasses.replace(SETTINGS, labels=tuple(LABELS))))
        except Rejected:
            pass
    return rows[:count]


@pytest.fixture(scope="module")
def llama_tokenizer():
    """Byte-level BPE with a BOS (Llama-like); pad = eos as model_loading.load_tokenizer sets it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(1)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([row["text"] for row in demo_rows()] * 3, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s>:1 $B:1",
                                                             special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.pad_token = fast.eos_token
    return fast


@pytest.fixture(scope="module")
def bert_tokenizer():
    """WordPiece with [CLS] a [SEP] b [SEP] and segment ids, as BERT's."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator([row["text"] for row in demo_rows()] + ["is it about food or sport?"],
                                  trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def tiny_llama(tokenizer, pad_token_id="tokenizer", seed: int = 0):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if pad_token_id == "tokenizer" else pad_token_id
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         pad_token_id=pad, **classification.model_kwargs(LABELS))
    return LlamaForSequenceClassification(config).eval()


def tiny_bert(tokenizer, seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        initializer_range=0.2,  # at BERT's 0.02 the random pooler passes ~0.1-sized features: slow to learn
                        **classification.model_kwargs(LABELS))
    return BertForSequenceClassification(config).eval()


def tokenise(tokenizer, rows, variant=PLAIN, max_length=64, labels=LABELS):
    batch = {key: [row.get(key) for row in rows] for key in rows[0]}
    columns = TASK.tokenise_batch(batch, tokenizer=tokenizer, variant=variant, max_length=max_length,
                                  task_meta={"labels": labels})
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def collate(tokenizer, rows, variant=PLAIN, max_length=64):
    meta = {"pad_token_id": tokenizer.pad_token_id, **TASK.tokenise_meta(variant, {"labels": LABELS})}
    return TASK.collator(meta, len(tokenizer))(tokenise(tokenizer, rows, variant, max_length))


# --- normalise ---
def test_fields_map_to_canonical_rows_and_integer_labels_become_names():
    settings = dataset(fields={"id": "n", "text": "a", "text_pair": "b", "label": "y"})
    assert TASK.normalise_fields({"n": 7, "a": " Hello ", "b": "there", "y": 2}, settings) == \
        {"id": "7", "text": "Hello", "text_pair": "there", "label": "2"}
    assert TASK.normalise_fields({"a": "x", "y": "pos"}, dataset(fields={"text": "a", "label": "y"})) == \
        {"text": "x", "label": "pos"}


@pytest.mark.parametrize("record, reason, field", [
    ({"i": 1, "a": "x"}, "missing_field", "y"),
    ({"a": "x", "y": "pos"}, "missing_field", "i"),
    ({"i": "r1", "a": None, "y": "pos"}, "missing_field", "a"),
    ({"i": "r1", "a": "   ", "y": "pos"}, "empty_value", "a"),
    ({"i": "r1", "a": 42, "y": "pos"}, "wrong_type", "a"),
    ({"i": "r1", "a": "x", "y": 1.0}, "wrong_type", "y"),
    ({"i": "r1", "a": "x", "y": True}, "wrong_type", "y"),
    ({"i": "r1", "a": "x", "y": ""}, "empty_value", "y"),
    ({"i": "r1", "a": "x", "y": "maybe"}, "unknown_label", "y"),
    ({"i": 1.5, "a": "x", "y": "pos"}, "wrong_type", "i"),
    ({"i": "", "a": "x", "y": "pos"}, "empty_value", "i"),
])
def test_bad_fields_are_rejected_with_their_reason(record, reason, field):
    with pytest.raises(Rejected) as caught:
        TASK.normalise_fields(record, dataset(fields={"id": "i", "text": "a", "label": "y"}, labels=["neg", "pos"]))
    assert (caught.value.reason, caught.value.field) == (reason, field)


def test_label_set_from_train_is_sorted_and_integers_keep_their_order():
    assert classification.label_set(["b", "a", "c", "a"], None) == ["a", "b", "c"]
    assert classification.label_set(["10", "2", "0", "1"], None) == ["0", "1", "2", "10"]
    assert classification.label_set(["pos", "neg"], ["pos", "neg", "neutral"]) == ["pos", "neg", "neutral"]
    for train, declared in ((["a", "a"], None), ([], ["a", "a"]), ([], "ab"), ([], ["only"])):
        with pytest.raises(WorkflowError):
            classification.label_set(train, declared)


def test_unknown_test_label_is_rejected_naming_label_and_set():
    names = classification.label_set(["pos", "neg"], None)
    assert classification.check_label("pos", names) == "pos"
    with pytest.raises(Rejected) as caught:
        classification.check_label("neutral", names, "sentiment")
    assert caught.value.reason == "unknown_label" and caught.value.field == "sentiment"
    assert "'neutral'" in caught.value.detail and "['neg', 'pos']" in caught.value.detail


def test_class_balance():
    assert classification.class_balance(["b", "a", "b", "b"]) == \
        {"a": {"count": 1, "share": 0.25}, "b": {"count": 3, "share": 0.75}}


# --- variants ---
def test_check_variant_defaults_and_refusals():
    assert TASK.variant_record(typed({})) == {"input": "{text}", "class_weights": None}
    assert typed({"input": "Review: {text}", "class_weights": {"pos": 2}}).class_weights == {"pos": 2}
    assert typed({"class_weights": {0: 2.5}}).class_weights == {"0": 2.5}  # YAML int keys, like int labels
    for bad in ({"prompt": "{text}"}, {"input": "{text} {label}"}, {"input": "{text_pair}"}, {"input": "{text.upper}"},
                {"input": 3}, {"class_weights": {"pos": 0}}, {"class_weights": {"pos": True}}, {"class_weights": [1, 2]}):
        with pytest.raises(WorkflowError) as caught:
            typed(bad)  # the schema's refusals, then the task's (the template's fields)
        assert "\n" not in str(caught.value)
    assert classification.class_weight_vector(typed({"class_weights": {"weather": 3}}), LABELS) == [1.0, 1.0, 3.0]
    with pytest.raises(WorkflowError, match=r"not in the label set .*never class ids: fix variants\.<name>\.class_weights"):
        classification.class_weight_vector(typed({"class_weights": {"politics": 3}}), LABELS)


# --- tokenising and collation ---
def test_tokenise_batch_encodes_text_and_maps_labels_to_ids(llama_tokenizer):
    from datasets import Dataset

    rows = demo_rows(count=6)
    out = tokenise(llama_tokenizer, rows, typed({"input": "Topic of: {text}"}))
    for row, tokenised in zip(rows, out):
        assert tokenised["input_ids"] == llama_tokenizer("Topic of: " + row["text"])["input_ids"]
        assert tokenised["label"] == LABELS.index(row["label"]) and tokenised["length"] == len(tokenised["input_ids"])
        assert (tokenised["truncated"], tokenised["dropped"], tokenised["pair_start"]) == (False, False, -1)
    short = tokenise(llama_tokenizer, rows, max_length=5)
    assert all(t["truncated"] and t["length"] == 5 for t in short)
    assert short[0]["input_ids"] == llama_tokenizer(rows[0]["text"])["input_ids"][:5]
    # The columns fit the declared features (as pretokenise's Dataset.map needs).
    data = Dataset.from_list(rows).map(TASK.tokenise_batch, batched=True, remove_columns=["text", "label"],
                                       features=TASK.tokenised_features(),
                                       fn_kwargs={"tokenizer": llama_tokenizer, "variant": PLAIN, "max_length": 64,
                                                  "task_meta": {"labels": LABELS}})
    assert data[0]["input_ids"] == tokenise(llama_tokenizer, rows)[0]["input_ids"] and data[0]["label"] == out[0]["label"]
    with pytest.raises(WorkflowError, match="'politics' is not in the label set"):
        tokenise(llama_tokenizer, [{"id": "x", "text": "a", "label": "politics"}])


def test_pairs_are_two_segments_unless_the_template_shows_the_pair(bert_tokenizer):
    rows = [{"id": "p0", "text": "the soup was cold", "text_pair": "is it about food or sport?", "label": "food"},
            {"id": "p1", "text": "tennis", "text_pair": "is it about food?", "label": "sport"}]
    out = tokenise(bert_tokenizer, rows)
    encoded = bert_tokenizer(rows[0]["text"], rows[0]["text_pair"], return_token_type_ids=True)
    assert out[0]["input_ids"] == encoded["input_ids"]
    assert out[0]["pair_start"] == encoded["token_type_ids"].index(1) == encoded["input_ids"].index(bert_tokenizer.sep_token_id) + 1
    cut = tokenise(bert_tokenizer, rows, max_length=9)
    assert cut[0]["truncated"] and not cut[1]["truncated"]
    assert cut[0]["input_ids"] == bert_tokenizer(rows[0]["text"], rows[0]["text_pair"], truncation=True, max_length=9)["input_ids"]
    inline = tokenise(bert_tokenizer, rows, typed({"input": "{text} / {text_pair}"}))
    assert inline[0]["pair_start"] == -1 and inline[0]["input_ids"] == bert_tokenizer("the soup was cold / is it about food or sport?")["input_ids"]
    assert TASK.dropped_reason and not any(t["dropped"] for t in out)
    # Nothing of the texts left, only [CLS] [SEP] [SEP]: dropped (pretokenise counts and removes it).
    assert [t["dropped"] for t in tokenise(bert_tokenizer, rows, max_length=3)] == [True, True]
    with pytest.raises(WorkflowError, match="max_length 1 leaves no room"):
        tokenise(bert_tokenizer, rows, max_length=1)
    with pytest.raises(WorkflowError, match="no text_pair"):
        tokenise(bert_tokenizer, [rows[0], {"id": "p2", "text": "rain", "text_pair": None, "label": "weather"}])


def test_collator_pads_right_and_counts_rows_as_targets(llama_tokenizer, bert_tokenizer):
    rows = demo_rows(count=3)
    batch = collate(llama_tokenizer, rows)
    lengths = [len(llama_tokenizer(r["text"])["input_ids"]) for r in rows]
    assert batch["input_ids"].shape == (3, max(lengths)) and "token_type_ids" not in batch
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for k, n in enumerate(lengths):
        assert (batch["input_ids"][k, n:] == llama_tokenizer.pad_token_id).all()
    assert batch["labels"].tolist() == [LABELS.index(r["label"]) for r in rows]
    assert (batch["target_tokens"], batch["real_tokens"], batch["padded_tokens"], batch["row_ids"]) == \
        (3, sum(lengths), 3 * max(lengths) - sum(lengths), [r["id"] for r in rows])
    pair = collate(bert_tokenizer, [{"id": "p", "text": "rain", "text_pair": "tennis", "label": "weather"}])
    assert pair["token_type_ids"].tolist() == [bert_tokenizer("rain", "tennis", return_token_type_ids=True)["token_type_ids"]]
    collator = classification.ClassificationCollator(0, 10, 3)
    with pytest.raises(WorkflowError, match="row 'b': class id 3"):
        collator([{"id": "a", "input_ids": [1], "label": 0}, {"id": "b", "input_ids": [1], "label": 3}])
    with pytest.raises(WorkflowError, match="row 'a': token id 10"):
        collator([{"id": "a", "input_ids": [1, 10], "label": 0}])
    with pytest.raises(WorkflowError, match="num_labels"):
        TASK.collator({"pad_token_id": 0}, 10)
    with pytest.raises(WorkflowError, match="2 class weights for 3 classes"):
        TASK.collator({"pad_token_id": 0, "num_labels": 3, "class_weights": [1.0, 2.0]}, 10)


# --- model and loss ---
@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_loss_is_summed_cross_entropy_of_the_models_logits(kind, llama_tokenizer, bert_tokenizer):
    tokenizer = llama_tokenizer if kind == "llama" else bert_tokenizer
    model = tiny_llama(tokenizer) if kind == "llama" else tiny_bert(tokenizer)
    rows = demo_rows(count=5)
    batch = collate(tokenizer, rows)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(TASK.loss_module(model)(batch), F.cross_entropy(logits, batch["labels"], reduction="sum"), atol=1e-5)
    weights = [1.0, 2.0, 0.5]
    expected = F.cross_entropy(logits, batch["labels"], weight=torch.tensor(weights), reduction="sum")
    assert torch.allclose(TASK.loss_module(model, weights)(batch), expected, atol=1e-5)
    # The training path: the weights come from the variant through tokenise_meta.json and the collator.
    weighted = collate(tokenizer, rows, typed({"input": "{text}", "class_weights": dict(zip(LABELS, weights))}))
    assert weighted["class_weights"].tolist() == weights
    assert torch.allclose(TASK.loss_module(model)(weighted), expected, atol=1e-5)
    with pytest.raises(RuntimeError, match="given twice"):
        TASK.loss_module(model, weights)(weighted)
    # Right padding does not change a row's logits: each row is classified at its own last token.
    alone = model(**{k: batch[k][2:3, :int(batch["attention_mask"][2].sum())] for k in ("input_ids", "attention_mask")}).logits
    assert torch.allclose(alone, logits[2:3], atol=1e-5)


def test_class_weighted_step_loss_is_torchs_weighted_mean(llama_tokenizer):
    """With class weights, the step's loss (summed losses over the global batch's summed target_tokens, as train
    divides) is torch's CrossEntropyLoss(weight=w) mean: sum_i w[y_i] CE_i / sum_i w[y_i], not over the rows."""
    model = tiny_llama(llama_tokenizer)
    rows = demo_rows(count=7)
    weights = [1.0, 4.0, 0.25]
    variant = typed({"input": "{text}", "class_weights": dict(zip(LABELS, weights))})
    micro_batches = [collate(llama_tokenizer, rows[:3], variant), collate(llama_tokenizer, rows[3:], variant)]
    loss_module = TASK.loss_module(model)
    with torch.no_grad():
        step_loss = sum(loss_module(b) for b in micro_batches) / sum(b["target_tokens"] for b in micro_batches)
        logits = torch.cat([classification_loss.pooled_logits(model, b) for b in micro_batches])
    labels = torch.cat([b["labels"] for b in micro_batches])
    assert len(set(labels.tolist())) > 1  # else every weighting gives the same mean
    reference = F.cross_entropy(logits, labels, weight=torch.tensor(weights))  # reduction "mean"
    assert float(step_loss) == pytest.approx(float(reference), rel=1e-5)
    assert micro_batches[0]["target_tokens"] == pytest.approx(sum(weights[k] for k in micro_batches[0]["labels"].tolist()))
    assert collate(llama_tokenizer, rows[:3])["target_tokens"] == 3  # unweighted: the row count


@pytest.mark.parametrize("weights, label", [([0.1, 0.1, 0.1], None), ([0.02, 1.0, 1.0], "food")],
                         ids=["uniform-0.1", "down-weighted-majority"])
def test_a_step_whose_class_weights_sum_below_one_is_torchs_weighted_mean(llama_tokenizer, tmp_path, weights, label):
    """Issue 36: train and sanity clamped the step's denominator at 1, so a class-weighted step whose summed
    weight is below 1 (uniform 0.1; an all-majority step of a down-weighted class) was scaled down against
    torch's CrossEntropyLoss(weight=w). training_setup.step_loss_scale divides by the sum (1 only for exactly 0),
    on one process and on two gloo ranks, each with half of the step."""
    import ranks
    from workflow_scripts.training import distributed, training_setup

    model = tiny_llama(llama_tokenizer).eval()
    rows = [row for row in demo_rows() if label is None or row["label"] == label][:6]
    variant = typed({"input": "{text}", "class_weights": dict(zip(LABELS, weights))})
    micro_batches = [collate(llama_tokenizer, rows[:3], variant), collate(llama_tokenizer, rows[3:], variant)]
    summed = sum(b["target_tokens"] for b in micro_batches)
    assert 0 < summed < 1
    loss_module = TASK.loss_module(model)
    with torch.no_grad():
        logits = torch.cat([classification_loss.pooled_logits(model, b) for b in micro_batches])
        reference = float(F.cross_entropy(logits, torch.cat([b["labels"] for b in micro_batches]),
                                          weight=torch.tensor(weights)))
        one_process = distributed.DistributedContext(0, 0, 1, 1, torch.device("cpu"), None)
        scale = training_setup.step_loss_scale(summed, one_process)
        assert float(sum(loss_module(b) for b in micro_batches) * scale) == pytest.approx(reference, rel=1e-5)
    assert training_setup.step_loss_scale(0, one_process) == 1.0  # nothing to score: a zero loss, not a NaN

    def rank_half():  # micro_step's share of the step on each rank, summed as train's log sums it
        context = distributed.setup(use_cuda=False)
        try:
            batch = micro_batches[context.rank]
            with torch.no_grad():
                share = loss_module(batch) * training_setup.step_loss_scale(batch["target_tokens"], context)
                total = distributed.all_reduce_sum((share / context.world_size).reshape(1), context)
            (tmp_path / f"rank{context.rank}").write_text(repr(float(total)))
        finally:
            distributed.teardown(context)

    ranks.assert_succeeded(ranks.run(rank_half, timeout=120))
    for rank in (0, 1):
        assert float((tmp_path / f"rank{rank}").read_text()) == pytest.approx(reference, rel=1e-5)


def test_loss_module_works_under_ddp(llama_tokenizer):
    import socket

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = tiny_llama(llama_tokenizer).train()
        batch = collate(llama_tokenizer, demo_rows(count=4))
        wrapped = torch.nn.parallel.DistributedDataParallel(TASK.loss_module(model, [1.0, 1.0, 2.0]))
        assert wrapped.module.wrapped is model  # parameter_names.unwrap finds the model under ``wrapped``
        loss = wrapped(batch)
        loss.backward()
        assert torch.isfinite(loss) and model.score.weight.grad is not None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_lora_training_learns_and_the_head_is_saved_with_the_adapter(kind, tmp_path, llama_tokenizer, bert_tokenizer):
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors import safe_open

    tokenizer = llama_tokenizer if kind == "llama" else bert_tokenizer
    build = (lambda: tiny_llama(tokenizer)) if kind == "llama" else (lambda: tiny_bert(tokenizer))
    base = classification.prepare_model(build(), tokenizer.pad_token_id, LABELS)
    heads = classification.head_module_names(base)
    assert heads == (["score"] if kind == "llama" else ["classifier"])
    targets = ["q_proj", "v_proj"] if kind == "llama" else ["query", "value"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=heads, task_type=TASK.peft_task_type)
    peft_model = get_peft_model(base, config)
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert any(f"{heads[0]}.modules_to_save" in name for name in trainable)
    assert all("lora_" in name or f"{heads[0]}.modules_to_save" in name for name in trainable)
    batch = collate(tokenizer, demo_rows(count=24))
    loss_module = TASK.loss_module(peft_model)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=3e-2)
    peft_model.train()
    losses = []
    for _ in range(15):
        loss = loss_module(batch) / batch["target_tokens"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    peft_model.eval()
    peft_model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as saved:
        keys = list(saved.keys())
    assert f"base_model.model.{heads[0]}.weight" in keys and any("lora_A" in key for key in keys)
    reloaded = PeftModel.from_pretrained(classification.prepare_model(build(), tokenizer.pad_token_id, LABELS), str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.allclose(classification_loss.pooled_logits(reloaded, batch), classification_loss.pooled_logits(peft_model, batch), atol=1e-5)
    records, score, _ = TASK.evaluate(reloaded, tokenizer, PLAIN, demo_rows(count=24), "accuracy",
                                      EvaluationSettings.parse({"batch_size": 8, "max_length": 64}), torch.device("cpu"))
    assert score > 0.5 and all(r["gold"] in LABELS and r["predicted"] in LABELS for r in records)


def test_decoder_without_pad_id_gets_the_tokenizers(llama_tokenizer):
    model = tiny_llama(llama_tokenizer, pad_token_id=None)
    assert model.config.pad_token_id is None
    classification.prepare_model(model, llama_tokenizer.pad_token_id, LABELS)
    assert model.config.pad_token_id == llama_tokenizer.pad_token_id
    assert model.config.id2label == {0: "food", 1: "sport", 2: "weather"} and model.config.label2id["weather"] == 2
    batch = collate(llama_tokenizer, demo_rows(count=3))
    assert TASK.loss_module(model)(batch).isfinite()  # without a pad id, batches > 1 raise in transformers
    no_pad = llama_tokenizer.__class__(tokenizer_object=llama_tokenizer.backend_tokenizer, unk_token="<unk>")
    with pytest.raises(WorkflowError, match="no pad token"):
        classification.prepare_model(tiny_llama(llama_tokenizer, pad_token_id=None), no_pad.pad_token_id, LABELS)
    with pytest.raises(WorkflowError, match="differs from the tokenizer"):
        classification.prepare_model(tiny_llama(llama_tokenizer, pad_token_id=0), llama_tokenizer.pad_token_id, LABELS)
    with pytest.raises(WorkflowError, match="head has 3 classes but the label set has 2"):
        classification.prepare_model(tiny_llama(llama_tokenizer), llama_tokenizer.pad_token_id, ["food", "sport"])


# --- evaluation and metrics ---
def test_metrics_match_hand_worked_values():
    golds = ["a", "a", "a", "b", "b", "c"]
    preds = ["a", "a", "b", "b", "c", "c"]
    assert classification.accuracy(golds, preds) == pytest.approx(4 / 6)
    # a: TP 2, FP 0, FN 1 -> 4/5;  b: TP 1, FP 1, FN 1 -> 2/4;  c: TP 1, FP 1, FN 0 -> 2/3
    assert classification.macro_f1(golds, preds, ["a", "b", "c"]) == pytest.approx((4 / 5 + 1 / 2 + 2 / 3) / 3)
    # d is in the label set but neither gold nor predicted: F1 0 (zero_division=0), and it still counts.
    assert classification.macro_f1(golds, preds, ["a", "b", "c", "d"]) == pytest.approx((4 / 5 + 1 / 2 + 2 / 3) / 4)
    # A class predicted but never gold: TP 0 -> F1 0.
    assert classification.macro_f1(["a", "a"], ["a", "b"], ["a", "b"]) == pytest.approx((2 / 3 + 0) / 2)
    assert classification.confusion_matrix(golds, preds, ["a", "b", "c"]) == \
        {"a": {"a": 2, "b": 1, "c": 0}, "b": {"a": 0, "b": 1, "c": 1}, "c": {"a": 0, "b": 0, "c": 1}}


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_evaluate_records_and_scores_independent_of_batch_size(kind, llama_tokenizer, bert_tokenizer):
    tokenizer = llama_tokenizer if kind == "llama" else bert_tokenizer
    model = classification.prepare_model(tiny_llama(tokenizer) if kind == "llama" else tiny_bert(tokenizer),
                                         tokenizer.pad_token_id, LABELS)
    rows = demo_rows("test", 10)
    evaluation = EvaluationSettings.parse({"batch_size": 4, "max_length": 64})
    records, score, unparseable = TASK.evaluate(model, tokenizer, PLAIN, rows, "accuracy", evaluation, torch.device("cpu"))
    one_by_one, _, _ = TASK.evaluate(model, tokenizer, PLAIN, rows, "accuracy", evaluation.replace(batch_size=1),
                                     torch.device("cpu"))
    assert [r["predicted"] for r in records] == [r["predicted"] for r in one_by_one]
    assert set(records[0]) == {"id", "text", "predicted", "gold", "score", "parsed"} and unparseable == 0
    assert score == pytest.approx(sum(r["score"] for r in records) / len(records))
    _, f1, _ = TASK.evaluate(model, tokenizer, PLAIN, rows, "macro_f1", evaluation, torch.device("cpu"))
    assert f1 == pytest.approx(classification.macro_f1([r["gold"] for r in records], [r["predicted"] for r in records], LABELS))
    for bad_metric, bad_evaluation, message in (("exact_match", evaluation, "not a classification metric"),
                                                ("accuracy", evaluation.replace(max_length=None), "max_length")):
        with pytest.raises(WorkflowError, match=message):
            TASK.evaluate(model, tokenizer, PLAIN, rows, bad_metric, bad_evaluation, torch.device("cpu"))


def test_predictions_split_over_ranks_score_as_one_evaluate(llama_tokenizer):
    """The validation metric over 2 ranks: each predicts its block, rank 0 scores the merged predictions with
    score_predictions; macro-F1 (not a mean of per-rank figures) equals one evaluate over all rows."""
    from workflow_scripts.training import validation_metric

    model = classification.prepare_model(tiny_llama(llama_tokenizer), llama_tokenizer.pad_token_id, LABELS)
    rows, evaluation, cpu = demo_rows("test", 9), EvaluationSettings.parse({"batch_size": 4, "max_length": 64}), torch.device("cpu")
    whole = TASK.evaluate(model, llama_tokenizer, PLAIN, rows, "macro_f1", evaluation, cpu)
    parts = [TASK.predict(model, llama_tokenizer, PLAIN, rows[validation_metric.rank_block(len(rows), rank, 2)],
                          "macro_f1", evaluation, cpu) for rank in range(2)]
    merged = validation_metric._merged(validation_metric.MetricSource("demo", "macro_f1", rows), parts)
    split = TASK.score_predictions(rows, merged, "macro_f1")
    assert split.score == whole.score and split.records == whole.records and split.details == whole.details
    with pytest.raises(WorkflowError, match="do not cover its 9 rows once each in order"):
        validation_metric._merged(validation_metric.MetricSource("demo", "macro_f1", rows), parts[::-1])


# --- demo data ---
def test_demo_dataset_is_deterministic_learnable_and_exercises_rejections(tmp_path):
    assert make_classification.main(["--out", str(tmp_path / "a")]) == 0
    make_classification.main(["--out", str(tmp_path / "b")])
    for split, size in (("train", 300), ("validation", 60), ("test", 60)):
        text = (tmp_path / "a" / f"{split}.jsonl").read_text()
        assert text == (tmp_path / "b" / f"{split}.jsonl").read_text() and len(text.splitlines()) == size
    reasons = []
    train = [json.loads(line) for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines()]
    for record in train:
        try:
            row = TASK.normalise_fields(record, SETTINGS)
        except Rejected as rejected:
            reasons.append(rejected.reason)
            continue
        # One keyword decides the label: exactly one topic's keywords occur in the sentence.
        found = [topic for topic, words in make_classification.KEYWORDS.items() if any(w in row["text"] for w in words)]
        assert found == [row["label"]]
    assert sorted(reasons) == ["empty_value", "missing_field", "wrong_type"]
    names = classification.label_set([TASK.normalise_fields(r, SETTINGS)["label"] for r in train if r.get("topic") and
                                      isinstance(r["sentence"], str) and r["sentence"].strip()], None)
    assert names == LABELS
    test = [json.loads(line) for line in (tmp_path / "a" / "test.jsonl").read_text().splitlines()]
    with pytest.raises(Rejected, match="'politics' is not in the label set"):
        for record in test:
            classification.check_label(TASK.normalise_fields(record, SETTINGS)["label"], names)
