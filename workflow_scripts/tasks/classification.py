"""Task type ``classification``: one class label per text (or text pair), a sequence-classification head.

Canonical row: ``id`` (str), ``text`` (non-empty str), optional ``text_pair`` (non-empty str), ``label``
(str: the class NAME). The label set is the dataset's ``labels:`` list when declared, else the train split's
labels (:func:`label_set`); its order fixes the class ids. Integer labels (an int, or a CSV's ``"1"``) with
``labels:`` declared are class ids, mapped to the declared names by index as ``datasets.ClassLabel`` does (a
declared name is matched first; an id outside 0..K-1 is rejected, ``unknown_label``), the mapping said in the
report (``label_mapping``) and the log. Without ``labels:`` an integer label is its decimal string, and the log
prints the inferred label set with its counts, flagging a class seen in fewer than :data:`RARE_CLASS_ROWS`
train rows (a stray ``3`` among 0/1/2). A number that is not an integer (``1.0``, ``2.5``) is never a label:
rejected (``wrong_type``), as a JSON float is, rather than becoming a class of its own. A validation/test row whose label is outside the set is rejected
(``unknown_label``), never mapped to some id. A trained classifier keeps its label set as ``id2label`` in the
``config.json`` beside its weights; evaluated on another dataset, its head is built with that set, the
other dataset's labels mapped by name (:meth:`ClassificationTask.trained_task_meta`).

A variant is ``{input, class_weights}``: ``input`` is a template over the row's fields (``{text}``
by default); ``class_weights`` maps label -> weight in the loss. A row's ``text_pair`` is the
tokenizer's second segment unless the template itself refers to ``{text_pair}``.

The gate (sanity) adds three checks: ``classification_model`` (the head, ``score`` / ``classifier`` or
whatever lies outside the pretrained body, is a trainable ``modules_to_save`` copy that the adapter's
state dict holds, with ``num_labels`` outputs and ``id2label`` = the label set), ``classification_batch``
(class ids within the head's classes, naming the rows) and ``classification_gradients`` (the head got a
finite, non-zero gradient).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import types
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError
from workflow_scripts.data.rows import FieldsMapper, Rejected, present as _present, text as _text
from workflow_scripts.tasks import metrics, templates
from workflow_scripts.tasks.class_labels import (LabelReading, class_id, class_names_mismatch, column_reading, numbers_among,
                                                padded_number_problem, source_class_name)
from workflow_scripts.tasks.base import EvaluationResult, Predictions

if TYPE_CHECKING:
    from workflow_scripts.core.entry_settings import DatasetSettings, VariantSettings
    from torch import nn

    from workflow_scripts.core.settings import TrainingSettings
    from workflow_scripts.tasks.classification_loss import ClassificationLoss

DEFAULT_INPUT = "{text}"
RARE_CLASS_ROWS = 5  # a class with fewer train rows is flagged in the log and the report (rare_classes)
_INTEGER = re.compile(r"^[+-]?\d+$")
GOLD_FIELDS = ("label",)  # a template that shows the label would leak the answer


# --- normalise ---
def _name(value: Any, source: str, what: str = "label") -> str:
    """A class name: a string, or an integer's decimal string; a bool or float (``str(1.0)``) is refused, not coerced."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        name = _text(value, source)
        if what == "label" and _is_fraction(name):
            raise Rejected("wrong_type", source, f"label {name!r} is a number but not an integer class id (it would "
                           "become a class of its own); write integer ids (0, 1, 2...) or class names")
        if what == "label" and name.startswith("[") and name.endswith("]"):
            raise Rejected("wrong_type", source, f"label {name[:60]!r} is a list written as text (JSON in a CSV "
                           f"column?); column '{source}' must hold one class name or integer id per row")
        return name
    raise Rejected("wrong_type", source, f"a {what} must be a string or an integer, got {type(value).__name__} {value!r:.60}")


def _is_fraction(text: str) -> bool:
    """``1.0``, ``2.5``, ``1e3``: a number that is not an integer (nan and inf are words here)."""
    if _INTEGER.match(text):
        return False
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def declared_label(label: str, labels: Sequence[str], source: str = "label", by: str | None = None) -> tuple[str, bool]:
    """(the class name, whether it was an integer id mapped by index): a declared name as it is, an integer
    0..K-1 as the K declared names' one at that index (``datasets.ClassLabel``); else ``Rejected``. ``by``: the
    whole column's reading where the declared labels are numbers (``"name"`` or ``"index"``,
    ``class_labels.column_reading``), so no row is read one way and the next the other."""
    if label in labels and by != "index":
        return label, False
    if (padded := padded_number_problem(label, labels)) is not None:  # "01": neither a name nor an id (class_id)
        raise Rejected("unknown_label", source, padded)
    if by == "name":
        raise Rejected("unknown_label", source, f"label {label!r} is not in the label set {list(labels)} (the column's "
                       "numbers are read as the declared names)")
    index = class_id(label)
    if index is not None:
        if 0 <= index < len(labels):
            return labels[index], True
        raise Rejected("unknown_label", source, f"label {label} is neither a declared name nor a class id 0..{len(labels) - 1} "
                       f"of the declared labels {list(labels)} (integer labels are mapped by index)")
    raise Rejected("unknown_label", source, f"label {label!r} is not in the label set {list(labels)}")


def check_label(label: str, labels: Sequence[str], source: str = "label") -> str:
    """``label`` if it is in the label set, else ``Rejected("unknown_label")`` naming the label and the set."""
    if label not in labels:
        raise Rejected("unknown_label", source, f"label {label!r} is not in the label set {list(labels)}")
    return label


def _label_order(label: str) -> tuple:
    # Integer names sort numerically ("2" before "10"), so raw labels 0..K-1 keep their ids.
    digits = label.removeprefix("-")
    return (0, int(label), label) if digits.isascii() and digits.isdigit() else (1, 0, label)


def label_set(train_labels: Sequence[str], declared: Sequence[str] | None) -> list[str]:
    """The class names in class-id order: the declared list as written, else the train split's labels sorted."""
    if declared is not None:
        if not isinstance(declared, (list, tuple)) or not all(isinstance(x, str) and x.strip() for x in declared):
            raise WorkflowError(f"labels: expected a list of non-empty strings, got {declared!r:.80}")
        if len(set(declared)) != len(declared):
            raise WorkflowError(f"labels: {list(declared)} lists a label twice")
        names = list(declared)
    else:
        names = sorted(set(train_labels), key=_label_order)
    if len(names) < 2:
        raise WorkflowError(f"labels {names}: a classifier needs at least two classes")
    return names


def class_balance(labels: Sequence[str]) -> dict[str, dict[str, float]]:
    """``{label: {count, share}}`` of one split, for the normalise report (sorted as :func:`label_set` sorts)."""
    counts = Counter(labels)
    total = sum(counts.values())
    return {name: {"count": counts[name], "share": counts[name] / total} for name in sorted(counts, key=_label_order)}


# --- metrics ---
def confusion_matrix(golds: Sequence[str], preds: Sequence[str], label_names: Sequence[str]) -> dict[str, dict[str, int]]:
    """``matrix[gold][predicted]`` = count, every label of the set on both axes (zeros included)."""
    matrix = {gold: {pred: 0 for pred in label_names} for gold in label_names}
    for gold, pred in zip(golds, preds, strict=True):
        matrix[gold][pred] += 1  # a label outside the set is a KeyError: evaluate checks golds first
    return matrix


def accuracy(golds: Sequence[str], preds: Sequence[str]) -> float:
    return sum(g == p for g, p in zip(golds, preds, strict=True)) / len(golds)


def macro_f1(golds: Sequence[str], preds: Sequence[str], label_names: Sequence[str]) -> float:
    """Unweighted mean of per-class F1 over the WHOLE label set.

    Reproduces scikit-learn's ``f1_score(golds, preds, labels=label_names, average="macro",
    zero_division=0)``: per class F1 = 2TP / (2TP + FP + FN), and 0 (the zero_division value) when
    the denominator is 0, i.e. the class is neither in the gold nor predicted. Such a class still counts
    in the mean: the score is over the label set, not over the classes that happen to occur (which is
    what ``f1_score`` without ``labels=`` would average over).
    """
    # From per-class counts summed over the examples, as compare's bootstrap recomputes it per resample.
    names = list(label_names)
    summed = [sum(column) for column in zip(*(metrics.class_counts(gold, pred, names)
                                               for gold, pred in zip(golds, preds, strict=True)))]
    return float(metrics.macro_f1_from_sums(summed or [0] * (3 * len(names))))


# --- the trained label set, at evaluation ---
def trained_label_set(trained_dir: str | Path) -> list[str]:
    """The class names, in class-id order, of the classifier trained into ``trained_dir`` (a LoRA adapter or a
    fully fine-tuned model): ``id2label`` of the ``config.json`` saved beside its weights, as transformers
    saves a model's (``model_loading.save_adapter`` writes one beside an adapter, ``save_full_model`` through
    ``save_pretrained``)."""
    config = Path(trained_dir, "config.json")
    retrain = "train it again with this version of the workflow, which saves the label set beside the weights"
    if not config.is_file():
        raise WorkflowError(f"{trained_dir}: no config.json, so the label set the classifier was trained on is "
                            f"unknown (its class ids cannot be named); {retrain}")
    try:
        # Absent: transformers' default, which save_pretrained leaves out of the file (PretrainedConfig.to_diff_dict).
        id2label = json.loads(config.read_text(encoding="utf-8")).get("id2label", {0: "LABEL_0", 1: "LABEL_1"})
        names = {int(i): name for i, name in id2label.items()}
    except (ValueError, UnicodeDecodeError, AttributeError, TypeError):
        raise WorkflowError(f"{config}: no id2label mapping of class ids to names (a JSON object); {retrain}") from None
    if sorted(names) != list(range(len(names))) or len(names) < 2 or not all(isinstance(n, str) for n in names.values()):
        raise WorkflowError(f"{config}: id2label {names} does not name classes 0..K-1 (K >= 2); {retrain}")
    return [names[i] for i in range(len(names))]


def labels_for_evaluation(trained: Sequence[str], evaluated: Sequence[str], dataset: str, trained_dir: str | Path) -> list[str]:
    """The label set to build the evaluated classifier with: always the TRAINED one, whose class ids the head's
    outputs mean. The evaluated dataset must hold the same classes: in another order they are mapped by name
    (predictions and golds are class names); another set is refused, naming both and the dataset."""
    trained, evaluated = list(trained), list(evaluated)
    if sorted(trained) != sorted(evaluated):
        raise WorkflowError(
            f"dataset '{dataset}' has the label set {evaluated} (datasets.{dataset}.labels, or its train split's "
            f"labels), but the classifier in {trained_dir} was trained on {trained}: its outputs cannot be named as "
            f"classes of '{dataset}'. Score a classifier only on datasets with the same class names (any order): "
            f"give '{dataset}' the class names {trained} in its raw data, or leave it out of this model's evaluation")
    return trained


# --- tokenising and batches ---
def model_kwargs(label_names: Sequence[str]) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments sizing the head for this label set (the head is built at load)."""
    return {"num_labels": len(label_names), "id2label": dict(enumerate(label_names)),
            "label2id": {name: i for i, name in enumerate(label_names)}}


def class_weight_vector(variant: "VariantSettings", label_names: Sequence[str]) -> list[float] | None:
    """The variant's class weights by class id; an unlisted class weighs 1.0 (as scikit-learn's ``class_weight``)."""
    weights = variant.class_weights
    if weights is None:
        return None
    unknown = sorted(set(weights) - set(label_names))
    if unknown:
        raise WorkflowError(f"variant class_weights: {unknown} not in the label set {list(label_names)}; the keys are "
                            "label names as the data spells them, never class ids: fix variants.<name>.class_weights "
                            "(or declare datasets.<name>.labels, so snakemake -n checks them)")
    return [float(weights.get(name, 1.0)) for name in label_names]


def encode(tokenizer, variant: "VariantSettings", rows: Sequence[Mapping[str, Any]], max_length: int) -> list[dict]:
    """Per row: ``input_ids``, ``pair_start`` (first token of the second segment, -1 if none), ``truncated``, ``dropped``.

    Rows are encoded whole first and only the over-long ones again with truncation, so ``truncated``
    is exact (``longest_first`` for pairs: the longer segment loses tokens first). ``dropped``: nothing
    of the row's text is left, only special tokens.
    """
    if not rows:
        return []
    template = variant.input or DEFAULT_INPUT
    texts = [templates._render(template, row, "input") for row in rows]
    pairs = None
    if "text_pair" not in templates.template_fields(template):
        present = [row.get("text_pair") is not None for row in rows]
        if any(present) and not all(present):
            raise WorkflowError(f"rows {[r['id'] for r, p in zip(rows, present) if not p][:5]} have no text_pair "
                                "while others of the batch do; normalise maps text_pair for every row or none")
        pairs = [row["text_pair"] for row in rows] if all(present) else None

    def call(indices: list[int], truncation: bool):
        return tokenizer([texts[i] for i in indices], [pairs[i] for i in indices] if pairs else None,
                         truncation=truncation, max_length=max_length if truncation else None,
                         return_special_tokens_mask=True, return_token_type_ids=True, return_attention_mask=False)

    encoded = call(list(range(len(rows))), False)
    columns = {key: list(encoded[key]) for key in ("input_ids", "special_tokens_mask", "token_type_ids")}
    long = [i for i, ids in enumerate(columns["input_ids"]) if len(ids) > max_length]
    if long:
        cut = call(long, True)
        for key in columns:
            for i, value in zip(long, cut[key]):
                columns[key][i] = value
    over = [rows[i]["id"] for i in long if len(columns["input_ids"][i]) > max_length]
    if over:  # the tokenizer only warns when its special tokens alone exceed max_length
        raise WorkflowError(f"rows {over[:5]}: max_length {max_length} leaves no room beside the tokenizer's special tokens")
    out = []
    for i, ids in enumerate(columns["input_ids"]):
        types = columns["token_type_ids"][i]
        out.append({"input_ids": list(ids), "pair_start": types.index(1) if 1 in types else -1,
                    "truncated": i in long, "dropped": all(columns["special_tokens_mask"][i])})
    return out


class ClassificationCollator:
    """Right-pads a micro-batch; checks token and class ids, naming the row. A class, so workers can pickle it.

    ``class_weights`` (by class id, from ``tokenise_meta.json``) ride along in every batch, so the loss
    uses the weights of the data it trains on (both come from one pretokenise run, one cache key).
    ``target_tokens`` (what the summed loss is divided by over the global batch) is the row count, or
    with class weights the summed weight of the rows' classes, so the step's loss is torch's weighted
    mean (:class:`ClassificationLoss`).
    """

    def __init__(self, pad_token_id: int, vocab_size: int, num_labels: int,
                 class_weights: Sequence[float] | None = None):
        import torch

        self.pad_token_id, self.vocab_size, self.num_labels = pad_token_id, vocab_size, num_labels
        if class_weights is not None and len(class_weights) != num_labels:
            raise WorkflowError(f"{len(class_weights)} class weights for {num_labels} classes; re-run pretokenise")
        self.class_weights = None if class_weights is None else torch.tensor(list(class_weights), dtype=torch.float32)

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        if not rows:
            raise WorkflowError("empty batch: the sampler produced a micro-batch without rows")
        width = max(len(r["input_ids"]) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        token_type_ids = torch.zeros((len(rows), width), dtype=torch.long)
        for k, row in enumerate(rows):
            n = len(row["input_ids"])
            if n == 0:
                raise WorkflowError(f"row '{row['id']}': no tokens")
            input_ids[k, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            attention_mask[k, :n] = 1
            if row.get("pair_start", -1) >= 0:
                token_type_ids[k, row["pair_start"]:n] = 1  # BERT-style segment B (its final [SEP] included)
            if not 0 <= row["label"] < self.num_labels:
                raise WorkflowError(f"row '{row['id']}': class id {row['label']} is outside the {self.num_labels} "
                                    "classes of the model; re-run pretokenise for this label set")
        bad = (input_ids >= self.vocab_size) | (input_ids < 0)
        if bad.any():
            k = int(bad.any(dim=1).nonzero()[0])
            raise WorkflowError(f"row '{rows[k]['id']}': token id {int(input_ids[k][bad[k]][0])} is outside the "
                                f"model's vocabulary (size {self.vocab_size}); re-tokenise with this model's tokenizer")
        real_tokens = int(attention_mask.sum())
        labels = torch.as_tensor([r["label"] for r in rows], dtype=torch.long)
        # The weighted mean's denominator, sum_i w[y_i] (torch's CrossEntropyLoss(weight=...)); the row count unweighted.
        targets = len(rows) if self.class_weights is None else float(self.class_weights[labels].sum())
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                 "target_tokens": targets, "real_tokens": real_tokens,
                 "padded_tokens": input_ids.numel() - real_tokens, "row_ids": [r["id"] for r in rows]}
        if token_type_ids.any():
            batch["token_type_ids"] = token_type_ids
        if self.class_weights is not None:
            batch["class_weights"] = self.class_weights.clone()  # a fresh tensor: pinning/moving must not alias
        return batch


def head_module_names(model: nn.Module) -> list[str]:
    """The top-level modules outside the pretrained body (``base_model_prefix``): the new classification head.

    peft's SEQ_CLS adds modules named ``classifier`` or ``score`` to ``modules_to_save`` on its own;
    other architectures name theirs differently (``classification_head``, ``logits_proj`` plus
    ``sequence_summary``, DeBERTa's ``pooler``), so pass these to ``LoraConfig(modules_to_save=...)``.
    """
    return [name for name, child in model.named_children()
            if name != model.base_model_prefix and any(True for _ in child.parameters())]


def prepare_model(model: nn.Module, pad_token_id: int | None, label_names: Sequence[str]) -> nn.Module:
    """Label names on the config, and the pad id a decoder head needs to find each row's last token."""
    config = model.config
    if config.num_labels != len(label_names):
        raise WorkflowError(f"the model's head has {config.num_labels} classes but the label set has {len(label_names)} "
                            "(load it with from_pretrained(..., **classification.model_kwargs(labels)))")
    kwargs = model_kwargs(label_names)
    config.id2label, config.label2id = kwargs["id2label"], kwargs["label2id"]
    pad = pad_token_id
    if pad is None:
        raise WorkflowError("the tokenizer has no pad token (nor an eos to use as one); batched classification needs one")
    for part in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if getattr(part, "pad_token_id", None) is None:
            part.pad_token_id = pad  # decoder heads pool the rightmost token that is not pad_token_id
        elif part.pad_token_id != pad:
            raise WorkflowError(f"the model's pad_token_id {part.pad_token_id} differs from the tokenizer's {pad}; "
                                "the head would pool a padding position")
    return model


# --- the gate's checks (sanity, through ClassificationTask.check_model / check_batch / check_gradients) ---
def _refuse(check: str, cause: str, fix: str):
    from workflow_scripts.core.errors import PreflightError

    raise PreflightError(check, cause, fix)


def _inner(model: nn.Module) -> nn.Module:
    """The PEFT model, also when handed the DDP-wrapped loss module."""
    from workflow_scripts.model.parameter_names import unwrap

    return unwrap(model)


def _adapter_name(peft_model: nn.Module) -> str:
    name = getattr(peft_model, "active_adapter", "default")
    return name if isinstance(name, str) else name[0]


def classification_heads(peft_model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of each head module (:func:`head_module_names` of the base model), as PEFT left
    it: a ``ModulesToSaveWrapper`` when it is in ``modules_to_save``, else the plain module."""
    model = _inner(peft_model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [(name, getattr(base, name)) for name in head_module_names(base)]


def _trained_copy(module: nn.Module, adapter: str) -> nn.Module | None:
    """The copy of a head that PEFT trains and saves (``modules_to_save[adapter]``), None if it is not wrapped."""
    from peft.utils import ModulesToSaveWrapper

    if isinstance(module, ModulesToSaveWrapper) and adapter in module.modules_to_save:
        return module.modules_to_save[adapter]
    return None


def _output_size(head: nn.Module) -> int | None:
    """The class count a head produces: its last linear layer's outputs (None if it has no nn.Linear)."""
    from torch import nn

    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else None


def head_classes(peft_model: nn.Module) -> int:
    """The class count the (last) head module outputs; ``config.num_labels`` for a head without nn.Linear."""
    model = _inner(peft_model)
    heads = classification_heads(model)
    if heads:
        module = heads[-1][1]
        copy = _trained_copy(module, _adapter_name(model))
        size = _output_size(module if copy is None else copy)
        if size is not None:
            return size
    return model.config.num_labels


def check_model(peft_model: nn.Module, task_meta: Mapping[str, Any]) -> int:
    """Refuses a head that will not train or not be saved with the adapter, or is not the label set's;
    returns the head's class count."""
    from peft import get_peft_model_state_dict

    labels = task_meta.get("labels")
    if not labels:
        _refuse("classification_model", "tokenise_meta.json's task_meta has no label set",
                "rerun pretokenise on the normalised data (its task_meta.json holds the labels)")
    model = _inner(peft_model)
    adapter = _adapter_name(model)
    heads = classification_heads(model)
    if not heads:
        _refuse("classification_model", f"{type(model).__name__} has no module with parameters outside its "
                "pretrained body: no classification head was found",
                "load the model with AutoModelForSequenceClassification (the task's auto_model_class)")
    full = not hasattr(model, "peft_config")  # training.finetune: full: the whole model, head included, trains and is saved
    saved = ({p.data_ptr() for p in model.parameters()} if full else {tensor.data_ptr() for tensor in
             get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False).values()})
    for name, module in heads:
        copy = module if full else _trained_copy(module, adapter)
        if copy is None:
            config = getattr(model, "peft_config", {}).get(adapter)
            task_type = getattr(getattr(config, "task_type", None), "value", getattr(config, "task_type", None))
            _refuse("classification_model", f"the classification head '{name}' is not in the adapter's modules_to_save, "
                    "so it is neither trained nor saved with the adapter (a head new at load stays random, and "
                    "another is drawn when the adapter is loaded)",
                    f"list '{name}' in training.lora.modules_to_save" + (
                        " (LoRA task type SEQ_CLS adds only modules named 'classifier' and 'score')"
                        if task_type == "SEQ_CLS" else f", or wrap with LoRA task type SEQ_CLS (not {task_type})"))
        parameters = dict(copy.named_parameters())
        frozen = sorted(n for n, p in parameters.items() if not p.requires_grad)
        if frozen:
            _refuse("classification_model", f"the classification head '{name}' is frozen (requires_grad=False on "
                    f"{', '.join(f'{name}.{n}' for n in frozen)})",
                    "never freeze parameters after PEFT wraps the model: it makes the modules_to_save copies trainable")
        unsaved = sorted(n for n, p in parameters.items() if p.data_ptr() not in saved)
        if unsaved:
            _refuse("classification_model", f"the adapter's state dict leaves out the head's "
                    f"{', '.join(f'{name}.{n}' for n in unsaved)}: the trained head would not be saved",
                    f"list '{name}' in training.lora.modules_to_save and keep adapter '{adapter}' active")
    config, size = model.config, head_classes(model)
    if size != len(labels) or config.num_labels != len(labels):
        _refuse("classification_model", f"the head '{heads[-1][0]}' outputs {size} classes (config num_labels "
                f"{config.num_labels}) but the label set has {len(labels)}: {list(labels)}",
                "load the model with num_labels = the label set's size (classification.model_kwargs, as "
                "training_setup.build does), or rerun pretokenise so tokenise_meta.json holds this dataset's label set")
    names = {int(i): name for i, name in (config.id2label or {}).items()}
    if names != dict(enumerate(labels)) or dict(config.label2id or {}) != {n: i for i, n in enumerate(labels)}:
        _refuse("classification_model", f"model.config.id2label {names} does not match the label set "
                f"{list(labels)} (class id = position in the set)",
                "set id2label/label2id from the label set (the task's prepare_model does) and do not change them after")
    return len(labels)


def check_batch(batch: Mapping[str, Any], num_labels: int) -> str:
    """Refuses class ids outside ``[0, num_labels)`` (a CUDA cross-entropy would fail with a device-side
    assert, and -100 would be silently ignored), naming the ids and the rows holding them."""
    labels = batch["labels"]
    if labels.dim() != 1 or labels.dtype.is_floating_point:
        _refuse("classification_batch", f"labels of shape {tuple(labels.shape)} and dtype {labels.dtype}: expected one "
                "integer class id per row", "build batches with the classification task's collator")
    import torch

    values = labels.cpu()
    outside = (values < 0) | (values >= num_labels)
    if outside.any():
        rows = batch.get("row_ids")
        where = f" in rows {[rows[k] for k in outside.nonzero().squeeze(1).tolist()][:5]}" if rows else ""
        _refuse("classification_batch", f"class ids {sorted(set(values[outside].tolist()))} are outside the model's "
                f"{num_labels} classes (0..{num_labels - 1}){where}",
                "rerun pretokenise so the class ids come from this dataset's label set, and train the model built for it")
    counts = torch.bincount(values, minlength=num_labels).tolist()
    return f"{len(values)} rows, class ids within 0..{num_labels - 1} (per class {counts})"


def check_gradients(peft_model: nn.Module) -> str:
    """After the first backward: every head parameter has a finite, non-zero gradient."""
    import torch

    model = _inner(peft_model)
    adapter = _adapter_name(model)
    norms = []
    for name, module in classification_heads(model):
        copy = module if not hasattr(model, "peft_config") else _trained_copy(module, adapter)  # full: the head itself
        if copy is None:  # check_model refuses this first
            _refuse("classification_gradients", f"the classification head '{name}' is not trained (not in "
                    "modules_to_save)", f"list '{name}' in training.lora.modules_to_save")
        for n, parameter in copy.named_parameters():
            grad = parameter.grad
            if grad is None or not grad.any():
                _refuse("classification_gradients", f"the classification head's {name}.{n} got "
                        f"{'no' if grad is None else 'an all-zero'} gradient after backward",
                        "the loss must come from the head's logits (the task's loss module) and the head must stay "
                        "trainable; check nothing detaches or replaces the logits before the loss")
            if not torch.isfinite(grad).all():
                _refuse("classification_gradients", f"NaN/Inf gradient in the classification head's {name}.{n}",
                        "lower training.learning_rate or check the data")
            norms.append(float(grad.float().pow(2).sum()))
    return f"the classification head's {len(norms)} tensors have finite, non-zero gradients (norm {math.sqrt(sum(norms)):.4g})"


class ClassificationTask:
    name = "classification"
    auto_model_class = "AutoModelForSequenceClassification"
    peft_task_type = "SEQ_CLS"
    variant_keys = frozenset({"input", "class_weights"})
    metrics = ("accuracy", "macro_f1")
    canonical_columns = ("id", "text", "text_pair", "label")
    dropped_reason = "truncation left none of the row's text, only special tokens"
    normalise_source = None  # raw records go through record_mapper
    # Under the comparison's table: the convention of the macro-F1 that eval.json reports (tasks/classification.macro_f1).
    comparison_note = (
        "macro-F1 (classification, in eval.json): the unweighted mean of per-class F1 over the whole label set "
        "(datasets.<name>.labels, else the train split's labels), a class neither in the gold nor predicted counting 0, "
        "as scikit-learn's f1_score(labels=<label set>, average='macro', zero_division=0). scikit-learn's default "
        "(no labels=) and Hugging Face evaluate's f1 average over the classes present in gold or predictions instead, "
        "which is higher when a class is neither.")

    def check_variant(self, variant: "VariantSettings") -> "VariantSettings":
        """The typed variant with its input template's fields checked, the default template filled and the
        class weights' labels as strings."""
        template = variant.input if variant.input is not None else DEFAULT_INPUT
        try:
            fields = templates.template_fields(template)
        except ValueError as error:
            raise WorkflowError(f"variant input template {template!r}: {error}") from None
        if "text" not in fields or set(fields) & set(GOLD_FIELDS):
            raise WorkflowError(f"variant input template {template!r} must show {{text}} and never {{label}} (the gold)")
        weights = variant.class_weights
        if weights is not None and not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0 for w in weights.values()):
            raise WorkflowError(f"variant class_weights: expected a mapping label -> positive number, got {dict(weights)!r:.80}")
        # Keys as strings, as labels are (YAML reads ``0: 2.0`` with an int key; the JSON argument would not).
        return dataclasses.replace(variant, input=template, class_weights=None if weights is None else
                                   types.MappingProxyType({str(k): w for k, w in weights.items()}))

    def variant_record(self, variant: "VariantSettings") -> dict[str, Any]:
        """The variant as pretokenise's cache key, its ``templates`` record and the manifests hold it (the input
        template, and the class weights or None), as they have always been written."""
        checked = self.check_variant(variant)
        weights = checked.class_weights
        return {"input": checked.input, "class_weights": None if weights is None else dict(weights)}

    gold_field = "label"  # an unlabelled split's rows carry label None (normalise checks the source holds none)

    def normalise_fields(self, record: Mapping[str, Any], settings: "DatasetSettings",
                         labelled: bool = True, reading: LabelReading | None = None) -> dict[str, Any]:
        """The canonical row (``id`` only when mapped; the stage numbers the others); raises ``Rejected``.
        ``labelled=False`` (an unlabelled split): the label is not read and is None. ``reading``: how the split's
        label column names classes (its ClassLabel names, the column's by-name/by-index decision), from
        normalise's :class:`LabelSetState`; None: each value read alone."""
        fields = settings.fields
        row = {}
        if fields.get("id"):
            value = _present(record, fields["id"])
            row["id"] = _name(value, fields["id"], "id")
        row["text"] = _text(_present(record, fields["text"]), fields["text"])
        if fields.get("text_pair"):
            row["text_pair"] = _text(_present(record, fields["text_pair"]), fields["text_pair"])
        if not labelled:
            row["label"] = None
            return row
        row["label"] = _name(_present(record, fields["label"]), fields["label"])
        reading = reading or LabelReading()
        if reading.class_names is not None:  # the source's own names for its ids, as datasets decodes them
            raw, row["label"] = row["label"], source_class_name(row["label"], reading.class_names, fields["label"])
            if settings.labels is not None:  # then matched by name: a declared list in another order swaps nothing
                mismatch = class_names_mismatch(raw, row["label"], reading.class_names, settings.labels)
                if mismatch is not None:  # ['01', '02'] named, labels: ['1', '2'] declared: both lists and the fix
                    raise Rejected("unknown_label", fields["label"], mismatch)
                row["label"] = check_label(row["label"], settings.labels, fields["label"])
        elif settings.labels is not None:  # declared: every split, train included, must keep to it (ids mapped by index)
            row["label"], _ = declared_label(row["label"], settings.labels, fields["label"], reading.by)
        return row

    def tokenised_features(self):
        from datasets import Features, Sequence as ListOf, Value

        return Features({"id": Value("string"), "input_ids": ListOf(Value("int32")), "pair_start": Value("int32"),
                         "label": Value("int32"), "length": Value("int32"), "truncated": Value("bool"),
                         "dropped": Value("bool")})

    def tokenise_batch(self, batch: Mapping[str, list], *, tokenizer, variant: "VariantSettings", max_length: int,
                       task_meta: Mapping[str, Any]) -> dict[str, list]:
        """Columns of :meth:`tokenised_features`; ``task_meta["labels"]`` is the label set (class id = its index)."""
        labels = task_meta["labels"]
        variant = self.check_variant(variant)
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        ids = {name: i for i, name in enumerate(labels)}
        for row in rows:
            if row["label"] not in ids:
                raise WorkflowError(f"row id {row['id']!r}: label {row['label']!r} is not in the label set {list(labels)}")
        encoded = encode(tokenizer, variant, rows, max_length)
        return {"id": [r["id"] for r in rows], "input_ids": [e["input_ids"] for e in encoded],
                "pair_start": [e["pair_start"] for e in encoded], "label": [ids[r["label"]] for r in rows],
                "length": [len(e["input_ids"]) for e in encoded], "truncated": [e["truncated"] for e in encoded],
                "dropped": [e["dropped"] for e in encoded]}

    def tokenise_meta(self, variant: "VariantSettings", task_meta: Mapping[str, Any], *, tokenizer=None) -> dict[str, Any]:
        """What train needs beside the token ids (for ``tokenise_meta.json``): classes and class weights."""
        labels = task_meta["labels"]
        return {"label_names": list(labels), "num_labels": len(labels),
                "class_weights": class_weight_vector(self.check_variant(variant), labels)}

    def check_config_variant(self, name: str, variant: "VariantSettings", datasets: Mapping[str, "DatasetSettings"]) -> None:
        """At parse time: the variant's keys and template, and its fields in every classification dataset."""
        from workflow_scripts.core.errors import ConfigError

        checked = self.check_variant(variant)
        fields = set(templates.template_fields(checked.input))
        for ds_name, dataset in datasets.items():
            available = {"id", "text"} | ({"text_pair"} if dataset.fields.get("text_pair") else set()) \
                | set(dataset.extra_fields)
            if fields - available:
                raise ConfigError(f"variants.{name}.input", f"refers to {sorted(fields - available)}, which dataset "
                                  f"'{ds_name}' does not provide (it has {sorted(available)})")
            # The keys are label names; with labels: declared the set is known now (else pretokenise checks them
            # against the train split's labels). An integer key is not a class id here, as a data label would be.
            for key in checked.class_weights or ():
                if dataset.labels is not None and key not in dataset.labels:
                    index = f" (class id {key} is {dataset.labels[int(key)]!r})" if _INTEGER.match(key) and \
                        0 <= int(key) < len(dataset.labels) else ""
                    raise ConfigError(f"variants.{name}.class_weights.{key}", f"is not a label of dataset '{ds_name}' "
                                      f"(datasets.{ds_name}.labels: {list(dataset.labels)}){index}; class_weights "
                                      "keys are label names, not class ids: write the label's name")

    def record_mapper(self, settings: "DatasetSettings", key: str) -> FieldsMapper:
        return FieldsMapper(self, settings, key)

    def normalise_state(self, settings: "DatasetSettings") -> "LabelSetState":
        return LabelSetState(settings)

    def model_kwargs(self, task_meta: Mapping[str, Any]) -> dict[str, Any]:
        """The head is sized when the model loads: num_labels and the label names go to from_pretrained."""
        return model_kwargs(task_meta["labels"])

    def prepare_model(self, model: nn.Module, pad_token_id: int | None, task_meta: Mapping[str, Any]) -> None:
        prepare_model(model, pad_token_id, task_meta["labels"])

    def trained_task_meta(self, task_meta: Mapping[str, Any], trained_dir: str | Path, dataset: str) -> dict[str, Any]:
        """At evaluation of a trained classifier: the head is built with the label set it was trained on
        (:func:`trained_label_set`), not the evaluated dataset's, which must hold the same classes."""
        labels = labels_for_evaluation(trained_label_set(trained_dir), task_meta["labels"], dataset, trained_dir)
        return {**task_meta, "labels": labels}

    def collator(self, meta: Mapping[str, Any], vocab_size: int, *, seed: int | None = None) -> ClassificationCollator:
        # seed is ignored: classification batches draw nothing at random.
        if meta.get("pad_token_id") is None or not meta.get("num_labels"):
            raise WorkflowError("tokenise_meta.json lacks pad_token_id or num_labels; re-run pretokenise")
        return ClassificationCollator(meta["pad_token_id"], vocab_size, meta["num_labels"], meta.get("class_weights"))

    def loss_module(self, peft_model: nn.Module, class_weights: Sequence[float] | None = None) -> ClassificationLoss:
        from workflow_scripts.tasks.classification_loss import ClassificationLoss

        return ClassificationLoss(peft_model, class_weights)

    # The gate's task-specific checks (sanity calls them beside preflight_checks'): detail string or PreflightError.
    def check_tokenizer(self, tokenizer) -> str | None:
        return None  # train reads no tokenizer: the ids and the pad id come from tokenise_meta.json

    def check_model(self, peft_model: nn.Module, task_meta: Mapping[str, Any], training: TrainingSettings) -> str | None:
        """The head trains, is saved with the adapter, and is sized and named for the label set."""
        classes = check_model(peft_model, task_meta)
        return (f"head {', '.join(repr(name) for name, _ in classification_heads(peft_model))} trainable and saved "
                f"with the adapter; {classes} classes, id2label = the label set {list(task_meta['labels'])}")

    def check_batch(self, batch: Mapping[str, Any], tokenizer, model: nn.Module) -> str | None:
        """Class ids against the model's head."""
        return check_batch(batch, head_classes(model))

    def check_gradients(self, peft_model: nn.Module, training: TrainingSettings) -> str | None:
        return check_gradients(peft_model)

    def predict(self, model, tokenizer, variant, rows, metric, evaluation, device) -> Predictions:
        """Argmax class per row, no label read; ``evaluation.max_length`` must be training's, so texts are
        cut the same way."""
        import torch

        from workflow_scripts.tasks.classification_loss import pooled_logits

        if metric not in self.metrics:
            raise WorkflowError(f"metric {metric!r} is not a classification metric (known: {list(self.metrics)})")
        if evaluation.max_length is None:
            raise WorkflowError("evaluation max_length is missing: classification truncates test texts as training did")
        variant = self.check_variant(variant)
        names = [model.config.id2label[i] for i in range(model.config.num_labels)]
        if not rows:
            raise WorkflowError("no rows to evaluate")
        collate = ClassificationCollator(tokenizer.pad_token_id, model.get_input_embeddings().num_embeddings, len(names))
        predicted = []
        model.eval()
        with torch.no_grad():
            for start in range(0, len(rows), evaluation.batch_size):
                chunk = rows[start:start + evaluation.batch_size]
                encoded = encode(tokenizer, variant, chunk, evaluation.max_length)
                batch = collate([{**e, "id": r["id"], "label": 0} for e, r in zip(encoded, chunk)])  # label unused
                tensors = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
                predicted += [names[i] for i in pooled_logits(model, tensors).float().argmax(-1).tolist()]
        records = []
        for row, pred in zip(rows, predicted):  # text: the rendered input, as the model saw it
            pair = {"text_pair": row["text_pair"]} if row.get("text_pair") is not None else {}
            records.append({"id": row["id"], "text": templates._render(variant.input, row, "input"), **pair,
                            "predicted": pred, "parsed": True})
        return Predictions(records, "predicted", {"labels": names})

    def evaluate(self, model, tokenizer, variant, rows, metric, evaluation, device):
        """The predictions (:meth:`predict`) scored against each row's label."""
        _check_labels(rows, [model.config.id2label[i] for i in range(model.config.num_labels)])  # before predicting
        return self.score_predictions(rows, self.predict(model, tokenizer, variant, rows, metric, evaluation, device),
                                      metric)

    def score_predictions(self, rows, result: Predictions, metric: str) -> EvaluationResult:
        """``predict``'s records (in ``rows``' order, the label set in their details) scored against each
        row's label: evaluate's scoring."""
        names = list(result.details["labels"])
        _check_labels(rows, names)
        records = [{**{k: v for k, v in record.items() if k != "parsed"}, "gold": row["label"],
                    "score": int(record["predicted"] == row["label"]), "parsed": True}
                   for row, record in zip(rows, result.records, strict=True)]
        predicted = [record["predicted"] for record in records]
        golds = [row["label"] for row in rows]
        scores = {"accuracy": accuracy(golds, predicted), "macro_f1": macro_f1(golds, predicted, names)}
        return EvaluationResult(records, scores[metric], 0, {
            **scores, "labels": names, "confusion_matrix": confusion_matrix(golds, predicted, names)})


def _check_labels(rows, names: list[str]) -> None:
    for row in rows:
        if row["label"] not in names:
            raise WorkflowError(f"row id {row['id']!r}: label {row['label']!r} is not one of the model's classes {names}")


class LabelSetState:
    """Normalise's memory across splits: the label set (declared, else train's) checks later splits."""

    def __init__(self, settings: "DatasetSettings"):
        self.settings = settings
        self.declared = settings.labels
        self.source = settings.fields["label"]
        self.labels: list[str] | None = list(self.declared) if self.declared is not None else None
        self.unlabelled = frozenset(settings.unlabelled)
        self.mapped_rows = 0  # rows whose integer label was mapped to a declared name by index
        self.train_counts: Counter = Counter()
        self.class_names: dict[str, tuple[str, ...]] = {}  # canonical split -> its source's ClassLabel names
        self.by: str | None = None  # the label column's one reading against numeric declared labels
        self.current = LabelReading()  # the reading of the split being mapped

    def prepare(self, raw_dir: Path, key: str) -> None:
        """Before any row: each split's ClassLabel names, and where the declared labels are numbers, the column's
        one reading (by name or by index) from its values in every labelled split; raises WorkflowError naming
        ``key``'s labels where the column does not decide."""
        from workflow_scripts.data import raw_records

        splits = {canonical: source for canonical, source in self.settings.splits.items()}
        for canonical, source_split in splits.items():
            names = raw_records.class_label_names(raw_dir, source_split, self.settings.format).get(self.source)
            if names is not None:
                self.class_names[canonical] = tuple(names)
        if numbers_among(self.declared):
            labelled = [source for canonical, source in splits.items()
                        if canonical not in self.unlabelled and canonical not in self.class_names]
            self.by = column_reading(self._column_values(raw_dir, labelled), self.declared, key, self.source)

    def _column_values(self, raw_dir: Path, source_splits: Sequence[str]) -> set[str]:
        """The label column's distinct values as class names would be read (an unreadable row or file is left to
        normalise's own read, which names it)."""
        from workflow_scripts.data import raw_records

        values: set[str] = set()
        for split in source_splits:
            try:
                for _, record in raw_records.iter_placed_records(raw_dir, split, self.settings.format, "reject_row",
                                                                 self.settings.encoding):
                    if isinstance(record, Mapping) and record.get(self.source) is not None:
                        try:
                            values.add(_name(record[self.source], self.source))
                        except Rejected:
                            pass
            except WorkflowError:
                pass
        return values

    def reading(self, split: str) -> LabelReading:
        """How the rows of ``split`` read their labels (normalise's mapper passes it to ``normalise_fields``)."""
        self.current = LabelReading(self.class_names.get(split), self.by)
        return self.current

    def check(self, row: Mapping[str, Any], split: str) -> None:
        if split != "train" and self.labels is not None and row["label"] is not None:  # None: an unlabelled split
            check_label(row["label"], self.labels, self.source)

    def note_record(self, record: Mapping[str, Any], row: Mapping[str, Any]) -> None:
        """Count a row whose raw label was an integer id mapped to a declared name by index."""
        raw = record.get(self.source) if isinstance(record, Mapping) else None
        if self.current.class_names is not None:  # named by the source's ClassLabel, not by the declared list's index
            return
        if self.declared is not None and row.get("label") is not None and str(raw).strip() != row["label"]:
            self.mapped_rows += 1

    def split_done(self, split: str, rows: list[dict]) -> None:
        if split == "train":
            self.train_counts = Counter(row["label"] for row in rows if row["label"] is not None)
            named = self.class_names.get("train")  # without labels: the source's ClassLabel names, in their order
            self.labels = label_set([row["label"] for row in rows],
                                    self.declared if self.declared is not None or named is None else list(named))

    def task_meta(self) -> dict[str, Any]:
        return {"labels": self.labels}

    def rare_classes(self) -> dict[str, int]:
        return {name: count for name, count in self.train_counts.items() if count < RARE_CLASS_ROWS}

    def notes(self) -> list[str]:
        """The log's lines on the label set: the index mapping used, or the inferred set with counts and rare classes."""
        lines = []
        if self.class_names:
            names = self.class_names.get("train") or next(iter(self.class_names.values()))
            matched = (f"; matched by name to the declared labels {list(self.declared)}" if self.declared is not None
                       else "; they are the label set")
            lines.append(f"labels: the source's ClassLabel names {list(names)} name its class ids, as datasets reads "
                         f"them{matched}")
        elif self.declared is not None:
            mapping = ", ".join(f"{index} -> {name}" for index, name in enumerate(self.declared))
            how = (f"{self.mapped_rows} rows gave integer class ids, mapped to the declared labels by index "
                   f"({mapping}), as datasets' ClassLabel does" if self.mapped_rows else "every row gave a declared name")
            lines.append(f"labels: declared {list(self.declared)}; {how}")
        elif self.labels is not None:
            counts = ", ".join(f"{name}: {self.train_counts[name]}" for name in self.labels)
            lines.append(f"labels: not declared, so inferred from the train split: {counts} (declare labels: to fix "
                         "the set and its order)")
        if self.declared is None and not self.class_names and self.labels and all(_INTEGER.match(name) for name in self.labels) \
                and sorted(int(name) for name in self.labels) != list(range(len(self.labels))):
            lines.append(f"warning: the integer labels {self.labels} are not the class ids 0..{len(self.labels) - 1}: "
                         "each is taken as a class name; if they are ids into a list of names, declare labels:")
        rare = self.rare_classes()
        if rare:
            lines.append(f"warning: labels {sorted(rare, key=_label_order)} occur in fewer than {RARE_CLASS_ROWS} train "
                         f"rows ({rare}); a stray value (a typo, an id out of range) becomes a class of its own: check "
                         "them, or declare labels:")
        return lines

    def report(self, rows_by_split: Mapping[str, list[dict]]) -> dict[str, Any]:
        mapping = ({"label_mapping": {"by_index": dict(enumerate(self.declared)), "rows": self.mapped_rows,
                                      **({"read_as": self.by} if self.by else {})}}
                   if self.declared is not None else {})
        named = {"class_names": {split: list(names) for split, names in self.class_names.items()}} if self.class_names else {}
        return {"labels": self.labels, **mapping, **named, "rare_classes": self.rare_classes(),
                "class_balance": {split: class_balance([r["label"] for r in rows]) for split, rows in rows_by_split.items()
                                  if split not in self.unlabelled}}


TASK = ClassificationTask()


def __getattr__(name: str):
    """``classification.ClassificationLoss`` without torch at import: normalise and compare load this module for
    its task object's data (row mapping, label set) and must not pay for torch (tests/test_stage_imports.py)."""
    if name == "ClassificationLoss":
        from workflow_scripts.tasks.classification_loss import ClassificationLoss

        return ClassificationLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
