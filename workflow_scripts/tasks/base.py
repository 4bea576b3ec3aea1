"""The task interface: everything that differs by kind of experiment, in one object per task type.

Stages never branch on the task's name: they look the task up (``tasks.task_named``) and call it.
A task type is one module of this package defining a :class:`Task` and registered in
``tasks/__init__.py``; adding one touches no stage.

The contract, stage by stage (batches are dicts of tensors plus plain fields):

- normalise: ``record_mapper(settings, key)`` maps raw records to this task's canonical rows (or
  ``data.rows.Rejected`` reasons); the mapper hears when a split is done (train first) and returns
  ``task_meta`` (e.g. the label set), written as ``task_meta.json`` beside the normalised data and
  handed to ``tokenise_batch``, ``tokenise_meta``, ``model_kwargs`` and ``prepare_model``.
  A task whose raw data are not records (plain text, one example per line) sets
  ``normalise_source(raw_dir, settings, out_dir, *, extra_json) -> report extras`` instead: it writes
  the normalised data itself (with the ``extra_json`` files, e.g. ``task_meta.json``, inside, in the
  same atomic step) and returns its part of ``normalise_report.json``; record-based tasks set
  ``normalise_source = None`` and normalise uses ``record_mapper``.
- pretokenise: ``tokenise_batch(batch, tokenizer=, variant=, max_length=)`` is a batched map
  function over canonical rows returning the columns of ``tokenised_features()``: at least ``id``,
  ``input_ids``, ``length`` and the booleans ``truncated`` and ``dropped`` (rows that cannot teach
  anything, e.g. no target token left; counted in the report and removed), plus the task's own
  columns (``labels``, ``label``...). ``dropped_reason`` names what ``dropped`` means.
  ``tokenise_meta(variant, task_meta, *, tokenizer)`` adds what training needs beside the ids to
  ``tokenise_meta.json`` (class weights; a masked LM's ``mask_token_id``: train loads no tokenizer).
- training: ``auto_model_class`` / ``peft_task_type`` choose the model and the LoRA wrapping;
  ``model_kwargs(task_meta)`` adds ``from_pretrained`` arguments (a classifier's label count) and
  ``prepare_model(model, pad_token_id, task_meta)`` finishes the loaded model (labels, pad id);
  ``collator(meta, vocab_size, *, seed)`` turns rows into a micro-batch carrying ``target_tokens`` (the
  count the summed loss is divided by over the global batch), ``real_tokens``, ``padded_tokens`` and
  ``row_ids``; ``seed`` is the experiment seed, for collators that draw (a masked LM's masks are
  seeded from it and the batch's row ids, so they are the same in any process and after a resume);
  the others ignore it. ``loss_module(peft_model)`` returns an ``nn.Module`` whose ``forward(batch)``
  gives the loss SUMMED over the batch's targets.
- the gate (sanity): ``check_tokenizer(tokenizer)`` once, ``check_model(peft_model, task_meta, training)``
  once on the built model (before any step: what trains, what will be saved), ``check_batch(batch,
  tokenizer, model)`` per probe batch (``model``: the PEFT model) and ``check_gradients(peft_model,
  training)`` once after the first backward are
  the task's own checks beside ``training/preflight_checks``: a detail string for the report, None
  when the task has no such check, or ``PreflightError``. The ``chat_prompt`` check
  (``preflight_checks.check_chat_prompt``) calls an optional hook: ``render_prompt(tokenizer, variant,
  row)`` (generation, vision_language: a probe row's prompt must keep its text), or
  ``dropped_chat_turn(tokenizer, variant)`` (conversation: the turn a probe conversation's rendering lacks).
- LoRA (optional): ``lora_settings(model, lora) -> lora`` rewrites the ``training.lora`` settings for the
  loaded model before PEFT wraps it (a VLM: adapter targets inside the language model only, the
  projector saved whole when asked); a task without it uses the settings as given.
- evaluation: ``evaluate(model, tokenizer, variant, rows, metric, evaluation, device)`` returns an
  :class:`EvaluationResult`: per-example prediction records (each with ``id`` and ``score``; ``counts``
  where the corpus score is a ratio of sums, as smatch's), the corpus score, the number of outputs that
  could not be parsed, and what ``eval.json`` should record about how predictions were made.
  ``predict(...)`` (optional: generation, vision_language, classification) returns :class:`Predictions`,
  the same predictions without reading any gold: the ``predict`` stage writes them for an unlabelled split
  (a leaderboard's test set) in its submission format; evaluate scores the same records.
  ``score_predictions(rows, predictions, metric)`` (with ``predict``) is evaluate's scoring of them, in
  ``rows``' order: the validation metric scores on rank 0 the predictions every rank made for its share.
  ``trained_task_meta(task_meta, trained_dir, dataset)`` (optional: classification) returns the task meta a
  TRAINED model is loaded with at evaluate / predict (a classifier's head: the label set saved beside its
  weights, checked against the evaluated dataset's); without it the evaluated dataset's task meta is used.
- comparison (optional): ``comparison_note``, a line the comparison report prints under its table (a
  metric's convention).
- configuration: ``variant_keys`` are the keys a variant of this task may set (what the fairness
  guard lets differ between variants); ``metrics`` the metric names a dataset of this task may use.
  Every hook takes the variant typed (``VariantSettings``, through ``check_variant``) and reads it by
  attribute; ``variant_record(variant)`` is the mapping pretokenise's cache key and records hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

if TYPE_CHECKING:  # annotations only: loading a task for its data needs no torch
    import torch
    from torch import nn

    from workflow_scripts.core.entry_settings import VariantSettings
    from workflow_scripts.core.section_settings import EvaluationSettings
    from workflow_scripts.core.settings import TrainingSettings


@dataclass
class EvaluationResult:
    records: list[dict]
    score: float
    unparseable: int
    details: dict = field(default_factory=dict)  # merged into eval.json (e.g. the decoding config)

    def __iter__(self):  # records, score, unparseable = task.evaluate(...)
        return iter((self.records, self.score, self.unparseable))


@dataclass
class Predictions:
    """A task's predictions without scores (``predict``): what ``evaluate`` scores and ``predict`` submits."""
    records: list[dict]  # one per row, each with ``id`` and ``parsed``
    answer_field: str    # the record field holding the answer (None where the output could not be parsed)
    details: dict = field(default_factory=dict)  # how predictions were made (decoding), for eval.json / manifests

    @property
    def unparseable(self) -> int:
        return sum(not record["parsed"] for record in self.records)


class Task(Protocol):
    name: str
    auto_model_class: str          # a transformers Auto class, e.g. "AutoModelForCausalLM"
    peft_task_type: str            # a peft TaskType name, e.g. "CAUSAL_LM"
    variant_keys: frozenset[str]
    metrics: tuple[str, ...]

    # The variant typed once by the stage (core.entry_settings.VariantSettings), with the task's own checks
    # (and its defaults filled), read by attribute below.
    def check_variant(self, variant: VariantSettings) -> VariantSettings: ...

    # The variant as pretokenise's cache key, its ``templates`` record and the manifests have always held it.
    def variant_record(self, variant: VariantSettings) -> dict[str, Any]: ...

    dropped_reason: str

    def tokenised_features(self): ...  # datasets.Features of tokenise_batch's columns

    def tokenise_batch(self, batch: Mapping[str, list], *, tokenizer, variant: VariantSettings,
                       max_length: int, task_meta: Mapping[str, Any]) -> dict[str, list]: ...

    def record_mapper(self, settings: Mapping[str, Any], key: str): ...  # data.rows.RecordMapper / FieldsMapper

    def tokenise_meta(self, variant: VariantSettings, task_meta: Mapping[str, Any], *,
                      tokenizer=None) -> dict[str, Any]: ...

    # None, or the task's own normalisation of a raw directory (see the module docstring).
    normalise_source: Callable[..., dict[str, Any]] | None

    def model_kwargs(self, task_meta: Mapping[str, Any]) -> dict[str, Any]: ...  # extra from_pretrained kwargs

    def prepare_model(self, model: nn.Module, pad_token_id: int | None, task_meta: Mapping[str, Any]) -> None: ...

    def collator(self, meta: Mapping[str, Any], vocab_size: int, *, seed: int) -> Callable[[list[dict]], dict]: ...

    def check_tokenizer(self, tokenizer) -> str | None: ...  # the gate's task check (None: none)

    def check_batch(self, batch: Mapping[str, Any], tokenizer, model: nn.Module) -> str | None: ...  # per probe batch

    def check_model(self, peft_model: nn.Module, task_meta: Mapping[str, Any],
                    training: TrainingSettings) -> str | None: ...  # the built model, before any step

    def check_gradients(self, peft_model: nn.Module, training: TrainingSettings) -> str | None: ...  # first backward

    def loss_module(self, peft_model: nn.Module) -> nn.Module: ...

    def evaluate(self, model, tokenizer, variant: VariantSettings, rows: Sequence[dict], metric: str,
                 evaluation: "EvaluationSettings", device: torch.device) -> EvaluationResult: ...

    # Optional: tasks that can predict a split without gold (the ``predict`` stage, unlabelled splits) set it.
    # def predict(self, model, tokenizer, variant, rows, metric, evaluation, device) -> Predictions: ...
