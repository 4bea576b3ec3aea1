"""Nothing wrong passes silently: one table of planted mistakes, each of which must end in one clear message.

Every row of :func:`table` is one mistake::

    case(family, case_id, setup, stage, expected, gap=None)

- ``setup(w)`` plants the mistake in a fresh workspace ``w`` and returns the stage's argv
  (for ``config``: the config file's path);
- ``stage`` is the entry point called: ``config`` (``load_config``) or a stage module's ``main``;
- ``expected`` is the exact one-line message, or ``rx(...)`` a regex it must match in full. Both may name
  the workspace's paths as ``{config}``, ``{raw}``, ``{source}`` (the dataset's source.path), ``{out}``, ``{model}``... (see ``Workspace.paths``);
- ``gap`` is set where the stage does not give that message today: the case is then a strict xfail whose
  reason says what happens instead, so the table documents the gap and fails loudly once it is fixed.

Each case asserts that the stage raises WorkflowError (ConfigError is one) whose message is one line and
is ``expected`` (which names the file, key/field and row), and that nothing is left where its outputs go
(``w.out`` holds every --out/--report/--summary-out... path). A few cases also run as commands
(``python -m workflow_scripts.<stage>``): exit code 2 and ``error: <message>`` as the last line of stderr.
To add a case, add one line to the table.
"""
from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from conftest import tiny_training_settings
from data_helpers import ROOT, default_config, demo_settings, leftovers, single_model_config, write_jsonl
from test_compare import COMPARISON, EXPERIMENTS, TRAINING, correct, write_experiment
from workflow_scripts.core.errors import WorkflowError

BASELINE = {"prompt": "Question: {question}\nAnswer:", "target": " {answer}"}
EVALUATION = {"split": "test", "max_new_tokens": 4, "batch_size": 4, "max_examples": None, "gpus": 0}
DROP = object()  # as a value in an edit: remove the key / flag


def table() -> list:  # called at collection, after the helpers below are defined
    return [
        # --- config: the schema (types, missing and unknown keys, enums, ranges, seeds) ---
        case("config", "wrong-type", cfg("training.max_steps", "many"), "config", "{config}: config key 'training.max_steps': 'many' is not of type 'integer', 'null'"),
        case("config", "bool-for-integer", cfg("training.max_steps", True), "config", "{config}: config key 'training.max_steps': True is not of type 'integer', 'null'"),
        case("config", "string-for-list", cfg("training.lora.target_modules", "q_proj"), "config", "{config}: config key 'training.lora.target_modules': 'q_proj' is not of type 'array'"),
        case("config", "missing-key", cfg("model.name", DROP), "config", "{config}: config key 'model.name': required, but missing (model has keys ['source', 'tiny', 'training', 'trust_remote_code'])"),
        case("config", "missing-metric", cfg("datasets.amr_demo.metric", DROP), "config", rx(r"\{config\}: config key 'datasets\.amr_demo\.metric': required, but missing \(datasets\.amr_demo has keys \['also_metrics', 'contamination', 'derived', .*'source', 'splits', .*'task'.*\]\)")),  # the schema's defaults come and go
        case("config", "classification-variant-without-task", cfg("variants.head_only", {"training": {"learning_rate": 0.001}}), "config", "{config}: config key 'variants.head_only.prompt': required, but missing (variants.head_only has keys ['chat_template', 'extractor', 'task', 'training']); a variant without task: is a generation variant (prompt and target); for another task's datasets set variants.head_only.task (e.g. task: classification)"),
        case("config", "split-name-with-a-folder", cfg("datasets.amr_demo.splits", {"train": "train/metadata", "test": "test"}), "config", "{config}: config key 'datasets.amr_demo.splits.train': 'train/metadata' cannot be a split name: a split is one file <split>.<format> in the source directory (or a hub split), so it holds no folder, no '/' and does not start with '.'; rename train/metadata.jsonl to train/train.jsonl (metadata.jsonl is an image folder's metadata) and write splits: {train: train, test: test} and, under source:, files: {train: train/train.jsonl}"),
        case("config", "split-name-with-a-folder-of-shards", cfg("datasets.amr_demo.splits", {"train": "parts/train-0", "test": "test"}), "config", "{config}: config key 'datasets.amr_demo.splits.train': 'parts/train-0' cannot be a split name: a split is one file <split>.<format> in the source directory (or a hub split), so it holds no folder, no '/' and does not start with '.'; to read parts/train-0.jsonl (under source.path) as the train split, write splits: {train: train, test: test} and, under source:, files: {train: parts/train-0.jsonl} (a glob or a list of files works too)"),
        case("config", "split-name-of-an-image-folder", cfg("datasets.shapes_demo.splits", {"train": "train/metadata", "test": "test"}, base=absolute_demo_config), "config", "{config}: config key 'datasets.shapes_demo.splits.train': 'train/metadata' cannot be a split name: a split is one file <split>.<format> in the source directory (or a hub split), so it holds no folder, no '/' and does not start with '.'; for a Hugging Face image folder (train/metadata.jsonl beside its images), write splits: {train: train, test: test} and, under source:, layout: imagefolder"),
        case("config", "missing-target", cfg("variants.baseline.target", DROP), "config", "{config}: config key 'variants.baseline.target': required, but missing (variants.baseline has keys ['chat_template', 'extractor', 'prompt', 'task', 'training'])"),
        case("config", "unknown-top-level-key", cfg("trainig", {"max_steps": 5}), "config", "{config}: config key '<top level>': Additional properties are not allowed ('trainig' was unexpected)"),
        case("config", "unknown-training-key", cfg("training.learning_rat", 1e-4), "config", "{config}: config key 'training': Additional properties are not allowed ('learning_rat' was unexpected)"),
        case("config", "unknown-dataset-key", cfg("datasets.amr_demo.feilds", {"question": "q"}), "config", "{config}: config key 'datasets.amr_demo': Additional properties are not allowed ('feilds' was unexpected)"),
        case("config", "unknown-variant-training-key", cfg("variants.mtup.training", {"max_lenght": 256}), "config", "{config}: config key 'variants.mtup.training': unknown training keys ['max_lenght']"),
        case("config", "enum-precision", cfg("training.precision", "fp64"), "config", "{config}: config key 'training.precision': 'fp64' is not one of ['fp32', 'bf16', 'fp16']"),
        case("config", "enum-metric", cfg("datasets.amr_demo.metric", "accuracy"), "config", "{config}: config key 'datasets.amr_demo.metric': 'accuracy' is not one of ['exact_match', 'exact_match_squad', 'token_f1', 'relaxed_accuracy', 'relaxed_accuracy_lenient', 'anls', 'smatch', 'smatchpp']"),
        case("config", "enum-split", cfg("evaluation.split", "dev"), "config", "{config}: config key 'evaluation.split': 'dev' is not one of ['validation', 'test']"),
        case("config", "enum-source-type", cfg("datasets.amr_demo.source.type", "s3"), "config", "{config}: config key 'datasets.amr_demo.source.type': 's3' is not one of ['hub', 'url', 'local']"),
        case("config", "negative-learning-rate", cfg("training.learning_rate", -1e-4), "config", "{config}: config key 'training.learning_rate': -0.0001 is less than or equal to the minimum of 0"),
        case("config", "negative-warmup", cfg("training.warmup_steps", -5), "config", "{config}: config key 'training.warmup_steps': -5 is less than the minimum of 0"),
        case("config", "zero-lora-rank", cfg("training.lora.rank", 0), "config", "{config}: config key 'training.lora.rank': 0 is less than the minimum of 1"),
        case("config", "zero-max-new-tokens", cfg("evaluation.max_new_tokens", 0), "config", "{config}: config key 'evaluation.max_new_tokens': 0 is less than the minimum of 1"),
        case("config", "dropout-above-one", cfg("training.lora.dropout", 1.5), "config", "{config}: config key 'training.lora.dropout': 1.5 is greater than the maximum of 1"),
        case("config", "seed-negative", cfg("seeds", [1, -1]), "config", "{config}: config key 'seeds.1': -1 is less than the minimum of 0"),
        case("config", "seed-too-large", cfg("seeds", [2 ** 32]), "config", "{config}: config key 'seeds.0': 4294967296 is greater than the maximum of 4294967295"),
        case("config", "seed-twice", cfg("seeds", [1, 1]), "config", "{config}: config key 'seeds': [1, 1] has non-unique elements"),
        case("config", "seeds-empty", cfg("seeds", []), "config", "{config}: config key 'seeds': [] should be non-empty"),
        case("config", "seed-as-string", cfg("seeds", ["1"]), "config", "{config}: config key 'seeds.0': '1' is not of type 'integer'"),
        case("config", "seed-as-float", cfg("seeds", [1.5]), "config", "{config}: config key 'seeds.0': 1.5 is not of type 'integer'"),
        case("config", "dataset-name-with-space", cfg("datasets", {"amr demo": default_config()["datasets"]["amr_demo"]}), "config", "{config}: config key 'datasets': 'amr demo' does not match '^[A-Za-z][A-Za-z0-9_-]*$'"),
        case("config", "effective-batch-not-multiple", cfg("training.micro_batch", 5), "config", "{config}: config key 'training.effective_batch': 16 is not a multiple of micro_batch (5) x processes (1); choose an effective batch divisible by 5 or change micro_batch"),
        case("config", "too-few-resamples", cfg("comparison.bootstrap_resamples", 10), "config", "{config}: config key 'comparison.bootstrap_resamples': 10 is less than the minimum of 1000"),
        case("config", "local-model-without-path", cfg("model", {"name": "m", "source": "local"}), "config", "{config}: config key 'model.path': required when model.source is 'local'"),
        case("config", "model-revision-is-a-branch", cfg("model", {"name": "m", "source": "hub", "hub_id": "Qwen/Qwen2.5-0.5B", "revision": "main"}), "config", "{config}: config key 'model.revision': 'main' is a branch, not a pinned revision; use a commit hash or a tag"),
        case("config", "secret-never-echoed", cfg("datasets.amr_demo.extra_fields", {"api_key": 8675309}), "config", "{config}: config key 'datasets.amr_demo.extra_fields.api_key': <redacted> is not of type 'string'"),
        case("config", "hf-token-never-echoed", cfg("datasets.amr_demo.extra_fields", {"HF_TOKEN": 8675309}), "config", "{config}: config key 'datasets.amr_demo.extra_fields.HF_TOKEN': <redacted> is not of type 'string'"),
        # --- config: templates ---
        case("config", "template-attribute-access", cfg("variants.baseline.prompt", "Q: {question.upper}"), "config", "{config}: config key 'variants.baseline.prompt': {question.upper} uses attribute access or indexing; " + HINT),
        case("config", "template-indexing", cfg("variants.baseline.prompt", "Q: {question[0]}"), "config", "{config}: config key 'variants.baseline.prompt': {question[0]} uses attribute access or indexing; " + HINT),
        case("config", "template-conversion", cfg("variants.baseline.target", " {answer!r}"), "config", "{config}: config key 'variants.baseline.target': {answer!r} uses a conversion or format spec; " + HINT),
        case("config", "template-positional-field", cfg("variants.baseline.prompt", "Q: {}"), "config", "{config}: config key 'variants.baseline.prompt': {} is not a field name; " + HINT),
        case("config", "template-unclosed-brace", cfg("variants.baseline.prompt", "Q: {question"), "config", "{config}: config key 'variants.baseline.prompt': unbalanced braces (expected '}' before end of string); a field is written {name}, write {{ and }} for literal braces"),
        case("config", "template-stray-closing-brace", cfg("variants.baseline.target", " {answer}}"), "config", "{config}: config key 'variants.baseline.target': unbalanced braces (Single '}' encountered in format string); a field is written {name}, write {{ and }} for literal braces"),
        case("config", "template-empty-prompt", cfg("variants.baseline.prompt", "  \n"), "config", "{config}: config key 'variants.baseline.prompt': the prompt is empty for every row; write a template such as 'Question: {question}'"),
        case("config", "template-empty-target", cfg("variants.baseline.target", ""), "config", "{config}: config key 'variants.baseline.target': the target is empty for every row; write a template such as ' {answer}'"),
        case("config", "template-unknown-field", cfg("variants.baseline.prompt", "Title: {title}\n{question}"), "config", "{config}: config key 'variants.baseline.prompt': refers to ['title'], which dataset 'amr_demo' does not provide (it has ['answer', 'answers', 'aux', 'id', 'question']); add them under datasets.amr_demo.extra_fields or derived"),
        case("config", "template-gold-answer-in-prompt", cfg("variants.baseline.prompt", "Q: {question} ({answer})"), "config", "{config}: config key 'variants.baseline.prompt': shows field 'answer', which in dataset 'amr_demo' is the first gold answer, " + LEAK % "answer"),
        case("config", "template-derived-gold-in-prompt", cfg("variants.mtup.prompt", "Q: {question} hint: {aux}"), "config", "{config}: config key 'variants.mtup.prompt': shows field 'aux', which in dataset 'amr_demo' is derived from the gold answer (aux = penman_skeleton(answer)), " + LEAK % "aux"),
        case("config", "section-extractor-without-marker", cfg("variants.mtup.extractor", {"type": "section"}), "config", "{config}: config key 'variants.mtup.extractor.marker': a section extractor needs the final task's marker"),
        # --- config: settings that would be silently ignored or never take effect ---
        case("config", "warmup-not-below-max-steps", cfg("training.warmup_steps", 300), "config", "{config}: config key 'training.warmup_steps': 300 is not below max_steps (300), so the learning rate would never leave warm-up; lower warmup_steps (e.g. to a tenth of the steps) or train longer"),
        case("config", "early-stopping-without-validation", cfg("training.validation", {"early_stopping_patience": 2}), "config", "{config}: config key 'training.validation.early_stopping_patience': is 2 but validation.every_steps is not set, so no validation loss is computed and training would never stop early; set training.validation.every_steps or drop validation.early_stopping_patience"),
        case("config", "keep-best-without-validation", cfg("training.validation", {"keep": "best"}), "config", "{config}: config key 'training.validation.keep': is 'best' but validation.every_steps is not set, so no validation loss is computed and there would be no best step to keep; set training.validation.every_steps or drop validation.keep"),
        case("config", "packing-with-micro-batch-1", cfg("model.training", {"packing": True, "micro_batch": 1}), "config", "{config}: config key 'training.packing': is true but micro_batch is 1: packing joins the examples of one micro-batch, so it would pack nothing; raise micro_batch (accumulation shrinks, the effective batch stays) or set packing: false"),
        case("config", "model-no-dataset-runs-on", cfg("models.tiny-extra", {"source": "tiny", "tiny": {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 1024}}, base=default_config), "config", "{config}: config key 'models.tiny-extra': no dataset or mixture trains on 'tiny-extra' (their models: lists leave it out), so it would silently drop out of the matrix; add 'tiny-extra' to the models: list of a dataset or mixture, or remove it"),
        # --- config: duplicate keys, YAML syntax, unreadable files ---
        case("config", "dataset-twice", cfg_text(SMALL % ("  amr_demo:\n    source: {type: local, path: elsewhere}", "", "")), "config", "{config}: config key 'datasets.amr_demo': line 7: key 'amr_demo' is given twice (first at line 3); " + TWICE),
        case("config", "variant-twice", cfg_text(SMALL % ("", "  baseline: {prompt: 'Q: {question}', target: '{answer}'}", "")), "config", "{config}: config key 'variants.baseline': line 10: key 'baseline' is given twice (first at line 9); " + TWICE),
        case("config", "key-twice-in-flow-mapping", cfg_text(SMALL % ("", "", ", max_length: 64")), "config", "{config}: config key 'training.max_length': line 11: key 'max_length' is given twice (first at line 11); " + TWICE),
        case("config", "yaml-unclosed-list", cfg_text("model: [unclosed"), "config", "{config}: config key '<file>': not valid YAML at line 1, column 17: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence at line 1, column 8); the [ list opened at line 1, column 8 needs its closing ] and a comma between items: close it, add the missing comma, or quote an item that holds ':' or a bracket"),
        case("config", "yaml-bad-indentation", cfg_text("model:\n  name: x\n   source: tiny\n"), "config", "{config}: config key '<file>': not valid YAML at line 3, column 10: mapping values are not allowed here"),
        case("config", "yaml-tab-indentation", cfg_text("model:\n\tname: x\n"), "config", rx(r"\{config\}: config key '<file>': not valid YAML at line 2, column 1: found character '\\t' that cannot start any token.*")),
        case("config", "yaml-top-level-list", cfg_text("- a\n- b\n"), "config", "{config}: config key '<top level>': the config must be a mapping"),
        case("config", "yaml-empty-file", cfg_text(""), "config", "{config}: config key '<top level>': the config must be a mapping"),
        case("config", "config-file-missing", lambda w: [str(w.config)], "config", "{config}: config key '<file>': config file not found (a relative path is read from the directory you run in)"),
        case("config", "config-not-utf8", cfg_bytes(b"model:\n  name: caf\xe9\n"), "config", "{config}: config key '<file>': not UTF-8 text (byte 19)"),
        # --- config: a variant's training overrides must keep the comparison fair ---
        case("config", "variant-overrides-max-length", cfg("variants.mtup.training", {"max_length": 256}), "config", "{config}: config key 'variants.mtup.training.max_length': " + UNFAIR.format(key="training.max_length", new=256, old=128)),
        case("config", "variant-overrides-lora-rank", cfg("variants.mtup.training", {"lora": {"rank": 8}}), "config", "{config}: config key 'variants.mtup.training.lora.rank': " + UNFAIR.format(key="training.lora.rank", new=8, old=16)),
        case("config", "reference-variant-missing", cfg("comparison.reference_variant", "plain"), "config", "{config}: config key 'comparison.reference_variant': 'plain' is not one of the generation variants ['baseline', 'mtup']; with variants of several tasks give a mapping, e.g. {generation: baseline, classification: plain}"),

        # --- data files read by normalise: one bad row in ten is more than max_rejected_fraction 0.01 ---
        case("data", "missing-field", rows({"a": "x"}), "normalise", rejected("missing_field", "q", "is missing")),
        case("data", "null-value", rows({"q": None, "a": "x"}), "normalise", rejected("missing_field", "q", "is null")),
        case("data", "empty-question", rows({"q": "  ", "a": "x"}), "normalise", rejected("empty_value", "q", "is empty")),
        case("data", "empty-answer-list", rows({"q": "ok?", "a": []}), "normalise", rejected("empty_value", "a", "is an empty list")),
        case("data", "empty-answer-in-list", rows({"q": "ok?", "a": ["x", ""]}), "normalise", rejected("empty_value", "a[1]", "is empty")),
        case("data", "number-for-question", rows({"q": 42, "a": "x"}), "normalise", rejected("wrong_type", "q", "expected a string, got int 42")),
        case("data", "object-for-answers", rows({"q": "ok?", "a": {"text": "x"}}), "normalise", rejected("wrong_type", "a", "expected a string or a list of strings, got dict")),
        case("data", "row-is-a-list", rows(["q", "a"]), "normalise", rejected("wrong_type", None, "the row is a list, not an object with fields")),
        case("data", "submission-integer-ids-not-integers", unlabelled_ids(["7", "q-1"]), "normalise", "config key 'datasets.d.submission.id_type': is integer, but split 'test' of {source}/test.jsonl has id 'q-1' (its kept row 1), which is not an integer; set datasets.d.submission.id_type: string, or give integer ids"),
        case("data", "unparseable-jsonl-line", rows('{"q": "ok?", "a": }'), "normalise", rejected("unparseable_record", None, "not valid JSON: line 6 column 19: Expecting value")),
        case("data", "unparseable-jsonl-line-cut-short", rows('{"q": "broken'), "normalise", rejected("unparseable_record", None, "not valid JSON: line 6 column 7: Unterminated string starting here")),
        case("data", "jsonl-line-with-a-raw-tab", rows('{"q": "tab\there", "a": "x"}'), "normalise", rejected("unparseable_record", None, "not valid JSON: line 6 column 11: Invalid control character here")),
        case("data", "duplicate-id", rows({"id": "r2", "q": "again?", "a": "x"}, ids=True), "normalise", rejected("duplicate_id", "id", "id 'r2' occurs earlier in the split")),
        case("data", "extra-field-changes-type", rows({"q": "ok?", "a": "x", "img": 7}, extra=True), "normalise", rejected("wrong_type", "img", "is a number where earlier rows hold a string")),
        case("data", "flattened-length-mismatch", rows({"id": "r", "q": ["a?", "b?"], "a": ["1"]}, flat=True), "normalise", rejected("length_mismatch", "q/a", "2 questions but 1 answers; pairs cannot be matched")),
        case("data", "question-list-without-flatten", rows({"q": ["a?", "b?"], "a": ["1", "2"]}), "normalise", rejected("wrong_type", "q", "expected a string, got list ['a?', 'b?']; a record holding several questions, with a parallel list of answers, needs the dataset's flatten: true")),
        case("data", "flatten-needs-a-list", rows({"id": "r", "q": "a?", "a": ["1"]}, flat=True), "normalise", rejected("wrong_type", "q", "flatten needs a list, got str")),
        case("data", "field-absent-from-every-row", rows(settings={"fields": {"question": "query", "answers": "a"}}), "normalise", "2 problems, all listed in {out}/normalise_report.failed.json: (1) {source}/train.jsonl: field 'query' (datasets.d.fields.question) is absent from every row of split 'train'; the rows have fields ['a', 'q'] (2) {source}/test.jsonl: field 'query' (datasets.d.fields.question) is absent from every row of split 'test'; the rows have fields ['a', 'q']"),  # every split's problem in one run
        case("data", "too-many-rejections", rows({"q": "", "a": "x"}, copies=3, good=97), "normalise", "{source}/train.jsonl: 3 of 100 rows of split 'train' rejected (3.0%), more than datasets.d.max_rejected_fraction = 0.01; reasons: empty_value 3; for example {source}/train.jsonl line 6: field 'q': is empty; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "every-row-rejected", rows({"q": "", "a": "x"}, good=0, settings={"max_rejected_fraction": 1.0}), "normalise", "{source}/train.jsonl: 1 of 1 rows of split 'train' rejected (100.0%), so no row is left; reasons: empty_value 1; for example {source}/train.jsonl line 1: field 'q': is empty; fix the rows (or the field mapping, if every row fails alike)"),
        case("data", "empty-split-file", rows(good=0), "normalise", "{source}/train.jsonl: split 'train' has no rows"),
        case("data", "missing-split-file", rows(settings={"splits": {"train": "train", "validation": "dev", "test": "test"}}), "normalise", "{source}: no split 'dev' (found ['test', 'train']); check the dataset's splits mapping in the config"),
        case("data", "split-file-under-another-name", source_files("train.jsonl", "val.jsonl", "test.jsonl"), "download", "split 'validation': {tmp}/source/validation.jsonl is missing (the directory holds ['test.jsonl', 'train.jsonl', 'val.jsonl']); if val.jsonl is the validation split, map it: splits: {train: train, validation: val, test: test}"),
        case("data", "split-file-absent", source_files("train.jsonl", "test.jsonl"), "download", "split 'validation': {tmp}/source/validation.jsonl is missing (the directory holds ['test.jsonl', 'train.jsonl']); add validation.jsonl, or leave validation out: splits: {train: train, test: test}"),
        case("data", "masked-lm-corpus-given-as-jsonl", source_files("train.jsonl", "validation.jsonl", "test.jsonl", settings={"task": "masked_lm", "format": "text", "fields": {}, "metric": "masked_accuracy"}), "download", "split 'train': {source}/train.txt is missing (the directory holds ['test.jsonl', 'train.jsonl', 'validation.jsonl']); train.jsonl is there, but task masked_lm reads plain text only: write its examples one per line to train.txt (or train.txt.gz)"),
        case("cli", "normalise-out-under-a-file", output_under_a_file(rows(), "--out", "{tmp}/afile/normalised"), "normalise", "{tmp}/afile/normalised: cannot be written here ({tmp}/afile is a file, not a folder); choose another output path or make its folder writable"),
        case("cli", "normalise-report-under-a-file", output_under_a_file(rows(), "--report", "{tmp}/afile/normalise_report.json"), "normalise", "{tmp}/afile/normalise_report.json: cannot be written here ({tmp}/afile is a file, not a folder); choose another output path or make its folder writable"),
        case("cli", "download-out-under-a-file", output_under_a_file(source_files("train.jsonl", "validation.jsonl", "test.jsonl"), "--out", "{tmp}/afile/raw"), "download", "{tmp}/afile/raw: cannot be written here ({tmp}/afile is a file, not a folder); choose another output path or make its folder writable"),
        case("model", "generation-dataset-on-a-bert", pretok({"--model": "{model_copy}"}, plant=copy_model(replace={"config.json": BERT_CONFIG})), "pretokenise", "{model_copy}: task 'generation' needs a model that AutoModelForCausalLM loads, but this is a 'bert' model: this model cannot generate (it has no causal language-model head, e.g. an encoder such as BERT); run the dataset on another model (the dataset's models: list)"),
        case("model", "vision-language-dataset-on-a-text-only-model", pretok({"--task": "vision_language", "--variant": {"prompt": "<image>Question: {question}\nAnswer:", "target": " {answer}"}}), "pretokenise", "{model}: task 'vision_language' needs a model that AutoModelForImageTextToText loads, but this is a 'llama' model: this model has no vision part (it reads text only); run the dataset on another model (the dataset's models: list)"),
        case("model", "model-needing-remote-code", prepare_local(extra={"config.json": json.dumps({"model_type": "my_custom_lm", "auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomLM"}}).encode()}), "prepare_model", "model.path {tmp}/source_model: config.json needs model_type 'my_custom_lm', which this transformers does not know, so loading it would run Python code shipped with the model; set model.trust_remote_code: true if you trust that code (or models.<name>.trust_remote_code), else choose a model that transformers supports"),
        case("data", "split-file-in-another-format", source_files("train.json", "validation.json", "test.json"), "download", "split 'train': {tmp}/source/train.jsonl is missing (the directory holds ['test.json', 'train.json', 'validation.json']); train.json is there: set format: json"),
        case("data", "raw-directory-missing", normalise_args({"--raw": "{tmp}/nowhere"}), "normalise", "{tmp}/nowhere: raw data directory not found; run the download rule first"),
        case("data", "not-utf8", raw_file("train.jsonl", b'{"q": "caf\xe9?", "a": "x"}\n'), "normalise", "{source}/train.jsonl line 1: " + NOT_UTF8_ROWS % 10),
        case("data", "not-utf8-far-into-the-file", raw_file("train.jsonl", b'{"q": "ok?", "a": "x"}\n' * 3000 + b'{"q": "caf\xe9?", "a": "x"}\n'), "normalise", "{source}/train.jsonl line 3001: " + NOT_UTF8_ROWS % 69010),
        case("data", "csv-not-utf8", raw_file("train.csv", b"q,a\nok?,x\ncaf\xe9?,y\n", fmt="csv"), "normalise", "{source}/train.csv line 3: " + NOT_UTF8_ROWS % 13),
        case("data", "json-not-utf8", raw_file("train.json", b'[{"q": "ok?",\n  "a": "caf\xe9"}]', fmt="json"), "normalise", "{source}/train.json line 2: " + NOT_UTF8 % 25),
        case("data", "csv-empty-cell", csv_rows("ok?,"), "normalise", rejected("empty_value", "a", "is empty", line=7, fmt="csv")),
        case("data", "csv-missing-column", csv_rows(header="question,a"), "normalise", "{source}/train.csv: field 'q' (datasets.d.fields.question) is absent from every row of split 'train'; the rows have fields ['a', 'question']"),
        case("data", "csv-short-row", csv_rows("ok?"), "normalise", rejected("unparseable_record", None, "not valid CSV: line 7 has 1 field where the header (line 1) has 2; every line needs one value per column (an empty value is still separated by a comma)", line=7, fmt="csv")),
        case("data", "csv-unquoted-comma", csv_rows("how many?,1,000"), "normalise", rejected("unparseable_record", None, "not valid CSV: line 7 has 3 fields where the header (line 1) has 2; a value that holds a comma must be in double quotes", line=7, fmt="csv")),
        case("data", "csv-stray-quote", csv_rows('"how" many?,1'), "normalise", rejected("unparseable_record", None, "not valid CSV: line 7: ',' expected after '\"'", line=7, fmt="csv")),
        case("data", "csv-header-names-a-column-twice", csv_rows(header="q,a,a"), "normalise", "{source}/train.csv line 1: the header names column ['a'] more than once, so one column's values would be lost; rename the columns apart"),
        case("data", "json-file-not-a-list", raw_file("train.json", b'{"q": "x?", "a": "1"}', fmt="json"), "normalise", "{source}/train.json: a json split file must hold a list of records, not a dict"),
        case("data", "json-file-invalid", raw_file("train.json", b'[{"q": "x?", "a": "1"},]', fmt="json"), "normalise", "{source}/train.json: not valid JSON (line 1 column 24): Expecting value"),
        # --- split layouts: the HF image folder and a split's several files (data/split_layouts.py) ---
        case("config", "files-glob-matches-nothing", cfg("datasets.amr_demo.source.files", {"train": "shards/part-*.jsonl"}, base=absolute_single_model_config), "parse", rx(r"\{config\}: config key 'datasets\.amr_demo\.source\.files\.train': 'shards/part-\*\.jsonl' matches no file under /.*/demo_data/amr \(paths and globs are relative to source\.path, or absolute\)")),
        case("config", "vision-language-dataset-on-a-text-only-model-at-parse", cfg("datasets.shapes_demo.models", ["tiny-llava", "tiny-llama"], base=absolute_demo_config), "parse", "{config}: config key 'datasets.shapes_demo.models': task vision_language needs a model with a vision part, but 'tiny-llama' is a tiny 'llama' model (models.tiny-llama.tiny.architecture; the vision ones are ['llava', 'idefics3', 'qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'gemma3', 'llava_onevision']), which reads text only; remove 'tiny-llama' from datasets.shapes_demo.models"),
        case("data", "files-glob-matches-nothing", laid_out({"test.jsonl": ROW}, source={"files": {"train": "shards/part-*.jsonl"}}), "download", "--dataset: config key 'datasets.d.source.files.train': 'shards/part-*.jsonl' matches no file under {source} (paths and globs are relative to source.path, or absolute)"),
        case("data", "files-key-not-a-split", laid_out({"train.jsonl": ROW, "test.jsonl": ROW}, source={"files": {"val": "train.jsonl"}}), "download", "--dataset: config key 'datasets.d.source.files.val': 'val' is not a split of the dataset (its splits mapping names ['test', 'train']); key files by the source split name"),
        case("data", "files-another-format", laid_out({"parts/a.json": b"[]", "test.jsonl": ROW}, source={"files": {"train": "parts/*"}}), "download", "--dataset: config key 'datasets.d.source.files.train': {source}/parts/a.json is not a jsonl file (a jsonl split file ends in .jsonl, .jsonl.gz, .jsonl.bz2, .jsonl.zst)"),
        case("data", "files-same-name-twice", laid_out({"a/part-1.jsonl": ROW, "b/part-1.jsonl": ROW, "test.jsonl": ROW}, source={"files": {"train": "*/part-1.jsonl"}}), "download", "--dataset: config key 'datasets.d.source.files.train': {source}/a/part-1.jsonl and {source}/b/part-1.jsonl have the same file name; a split's files are read in file-name order, so rename one of them"),
        case("data", "files-named-metadata", laid_out({"parts/metadata.jsonl": ROW, "test.jsonl": ROW}, source={"files": {"train": "parts/*.jsonl"}}), "download", "--dataset: config key 'datasets.d.source.files.train': {source}/parts/metadata.jsonl: a split's file may not be named metadata.jsonl (the image-folder metadata name); rename it"),
        case("data", "files-with-imagefolder", laid_out({"train/metadata.jsonl": ROW, "test/metadata.jsonl": ROW}, **IMAGEFOLDER, source={"layout": "imagefolder", "files": {"train": "train/metadata.jsonl"}}), "download", "--dataset: config key 'datasets.d.source.files': an image folder's split is its folder; give layout: imagefolder or files, not both"),
        case("data", "imagefolder-on-a-text-task", laid_out({"train/metadata.jsonl": ROW, "test/metadata.jsonl": ROW}, source={"layout": "imagefolder"}), "download", "--dataset: config key 'datasets.d.source.layout': imagefolder holds images: it is read by task vision_language, not generation"),
        case("data", "imagefolder-format-json", laid_out({"train/metadata.json": b"[]", "test/metadata.json": b"[]"}, **IMAGEFOLDER, format="json", source={"layout": "imagefolder"}), "download", "--dataset: config key 'datasets.d.format': an image folder's metadata is metadata.jsonl, metadata.csv or metadata.parquet: set format to jsonl, csv or parquet, not json"),
        case("data", "imagefolder-without-metadata", laid_out({"train/metadata.jsonl": ROW, "test/rows.jsonl": ROW}, **IMAGEFOLDER, source={"layout": "imagefolder"}), "download", "--dataset: config key 'datasets.d.splits.test': {source}/test/metadata.jsonl is missing (the folder holds ['rows.jsonl']); an image folder's split is a folder <source.path>/<split>/ with metadata.jsonl and its images"),
        case("data", "imagefolder-missing-image", image_folder({"file_name": "charts/gone.png", "query": "Q?", "label": "1"}), "normalise", "{source}/train/metadata.jsonl: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: missing_image 1; for example {source}/train/metadata.jsonl line 6: field 'file_name': image file 'charts/gone.png' not found under {source}/train; add the file or fix the path in the record; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "imagefolder-corrupt-image", image_folder({"file_name": "charts/bad.png", "query": "Q?", "label": "1"}, bad_file=("charts/bad.png", b"\x89PNG\r\n\x1a\n cut")), "normalise", "{source}/train/metadata.jsonl: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unreadable_image 1; for example {source}/train/metadata.jsonl line 6: field 'file_name': image file {source}/train/charts/bad.png is not an image PIL can identify (unknown format, corrupt header or a zero width/height); re-export it as PNG or JPEG; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "imagefolder-row-without-file-name", image_folder({"query": "Q?", "label": "1"}), "normalise", "{source}/train/metadata.jsonl: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: missing_field 1; for example {source}/train/metadata.jsonl line 6: field 'file_name': is missing; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "imagefolder-file-name-escapes", image_folder({"file_name": "../test/charts/0.png", "query": "Q?", "label": "1"}), "normalise", "{source}/train/metadata.jsonl: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: image_outside_dataset 1; for example {source}/train/metadata.jsonl line 6: field 'file_name': image path '../test/charts/0.png' leads outside the dataset's files ({source}/train); give a path relative to the dataset without '..'; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "files-shard-bad-row", downloaded(lambda w: [write_jsonl(w.tmp / "source" / "parts" / f"{k}.jsonl", [{"q": f"q{k}.{i}?", "a": "1"} for i in range(20)] + (['{"q": "cut'] if k == 2 else [])) for k in (1, 2)] + [write_jsonl(w.tmp / "source" / "test.jsonl", [{"q": "x?", "a": "1"}])], {"source": {"files": {"train": "parts/*.jsonl"}}}), "normalise", "the files of split 'train' (parts/*.jsonl): 1 of 41 rows of split 'train' rejected (2.4%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unparseable_record 1; for example {source}/parts/2.jsonl line 21: not valid JSON: line 21 column 7: Unterminated string starting here; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "parquet-file-corrupt", raw_file("train.parquet", b"PAR1 not really parquet", fmt="parquet"), "normalise", "{source}/train.parquet: " + NOT_PARQUET % "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file."),
        case("data", "parquet-file-cut-short", raw_file("train.parquet", lambda: parquet_bytes()[:-100], fmt="parquet"), "normalise", "{source}/train.parquet: " + NOT_PARQUET % "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file."),
        case("data", "parquet-file-empty", raw_file("train.parquet", b"", fmt="parquet"), "normalise", "{source}/train.parquet: " + NOT_PARQUET % "Parquet file size is 0 bytes"),
        case("data", "dataset-argument-bad-json", normalise_args({"--dataset": "{source: local}"}), "normalise", "argument --dataset: not valid JSON at character 1: Expecting property name enclosed in double quotes"),
        case("data", "dataset-argument-bad-metric", rows(settings={"metric": "accuracy"}), "normalise", rx(r"--dataset: config key 'datasets\.d\.metric': 'accuracy' is not one of \[.*\]")),
        case("data", "derived-from-unknown-field", rows(settings={"derived": {"aux": {"transform": "answer_kind", "field": "label"}}}), "normalise", "config key 'datasets.d.derived.aux.field': 'label' is not a field of the normalised row (choose from ['answer', 'id', 'question'])"),
        case("data", "test-row-copied-from-train", raw_file("train.jsonl", b'{"q": "ok?", "a": "0"}\n{"q": " X? ", "a": "1"}\n'), "normalise", "{source}/test.jsonl: 1 of 1 rows of split 'test' (100.0%) repeat a row of split 'train' (same question, ignoring case, spacing and Unicode form; 1 with the same answers too), more than datasets.d.contamination.max_fraction = 0.01; overlapping ids (test = train): 'test-0' = 'train-1'; set datasets.d.contamination.accept: true to run anyway, or deduplicate the splits"),
        case("data", "contamination-max-fraction-above-one", rows(settings={"contamination": {"max_fraction": 2}}), "normalise", "--dataset: config key 'datasets.d.contamination.max_fraction': 2 is greater than the maximum of 1"),

        # --- stage command lines: pretokenise ---
        case("cli", "pretokenise-variant-bad-json", pretok({"--variant": "{'prompt': 1}"}), "pretokenise", "argument --variant: not valid JSON at character 1: Expecting property name enclosed in double quotes"),
        case("cli", "pretokenise-variant-without-target", pretok({"--variant": {"prompt": "{question}"}}), "pretokenise", "--variant: config key 'variants.<name>.target': required, but missing (variants.<name> has keys ['chat_template', 'extractor', 'prompt', 'task', 'training'])"),
        case("cli", "pretokenise-variant-unknown-key", pretok({"--variant": {**BASELINE, "colour": 1}}), "pretokenise", "--variant: config key 'variants.<name>': Additional properties are not allowed ('colour' was unexpected)"),
        case("cli", "pretokenise-unknown-task", pretok({"--task": "translation"}), "pretokenise", rx(r"argument --task: unknown task 'translation'; known: \[.*'generation'.*\]")),
        case("cli", "pretokenise-template-field-missing", pretok({"--variant": {"prompt": "{title}", "target": " {answer}"}}), "pretokenise", "{data} split 'train' row 0: row id 'r0': the prompt template refers to field 'title', which the row does not have (it has ['answer', 'answers', 'id', 'question'])"),
        case("cli", "pretokenise-template-syntax", pretok({"--variant": {"prompt": "{question.upper}", "target": " {answer}"}}), "pretokenise", "{data} split 'train' row 0: the prompt template '{question.upper}': {question.upper} uses attribute access or indexing; " + HINT),
        case("cli", "pretokenise-max-length-1", pretok({"--max-length": "1"}), "pretokenise", "argument --max-length: 1 leaves no room for a prompt and a target"),
        case("cli", "pretokenise-threads-0", pretok({"--threads": "0"}), "pretokenise", "argument --threads: 0 must be at least 1"),
        case("cli", "pretokenise-every-prompt-too-long", pretok({"--max-length": "3"}), "pretokenise", "{data} split 'train': every prompt is at least --max-length 3 tokens, so no row keeps a target token; raise training.max_length or shorten the prompt template"),
        case("cli", "pretokenise-data-missing", pretok({"--data": "{tmp}/nowhere"}), "pretokenise", rx(r"\{tmp\}/nowhere: not a normalised dataset \(.*\); run normalise first")),
        case("cli", "pretokenise-data-without-train", pretok({"--data": "{test_only}"}), "pretokenise", "{test_only}: has no 'train' split (it has ['test'])"),
        case("cli", "pretokenise-data-is-tokenised", pretok({"--data": "{tok}"}), "pretokenise", "{tok}: no task_meta.json, so this is not normalise output (or an older version's); run the normalise rule"),
        # --- stage command lines: evaluate ---
        case("cli", "evaluate-evaluation-bad-json", evaluate_({"--evaluation": "{split: test}"}), "evaluate", "argument --evaluation: not valid JSON at character 1: Expecting property name enclosed in double quotes"),
        case("cli", "evaluate-evaluation-not-an-object", evaluate_({"--evaluation": ["test"]}), "evaluate", "argument --evaluation: expected a JSON object, got list"),
        case("cli", "evaluate-max-new-tokens-as-text", evaluate_({"--evaluation": {**EVALUATION, "max_new_tokens": "four"}}), "evaluate", "--evaluation: config key 'evaluation.max_new_tokens': 'four' is not of type 'integer'"),
        case("cli", "evaluate-batch-size-0", evaluate_({"--evaluation": {**EVALUATION, "batch_size": 0}}), "evaluate", "--evaluation: config key 'evaluation.batch_size': 0 is less than the minimum of 1"),
        case("cli", "evaluate-max-examples-not-a-number", evaluate_({"--evaluation": {**EVALUATION, "max_examples": "all"}}), "evaluate", "--evaluation: config key 'evaluation.max_examples': 'all' is not of type 'integer', 'null'"),
        case("cli", "evaluate-max-examples-0", evaluate_({"--evaluation": {**EVALUATION, "max_examples": 0}}), "evaluate", "--evaluation: config key 'evaluation.max_examples': 0 is less than the minimum of 1"),
        case("cli", "evaluate-split-missing", evaluate_({"--evaluation": {**EVALUATION, "split": "validation"}, "--data": "{test_only}"}), "evaluate", "config key 'evaluation.split': 'validation' is not a split of {test_only} (it has ['test'])"),
        case("cli", "evaluate-seed-not-a-number", evaluate_({"--seed": "first"}), "evaluate", "argument --seed: expected an integer or 'base', got 'first'"),
        case("cli", "evaluate-unknown-metric", evaluate_({"--metric": "accuracy"}), "evaluate", "argument --metric: 'accuracy' is not a metric of task 'generation' (choose from ['exact_match', 'exact_match_squad', 'token_f1', 'relaxed_accuracy', 'relaxed_accuracy_lenient', 'anls', 'smatch', 'smatchpp'])"),
        case("cli", "evaluate-unknown-task", evaluate_({"--task": "translation"}), "evaluate", rx(r"argument --task: unknown task 'translation'; known: \[.*'generation'.*\]")),
        case("cli", "evaluate-data-missing", evaluate_({"--data": "{tmp}/nowhere"}), "evaluate", rx(r"\{tmp\}/nowhere: not a normalised dataset \(.*\); run normalise first")),
        case("cli", "evaluate-duplicate-test-id", evaluate_({"--data": "{duplicate_ids}"}), "evaluate", "{duplicate_ids} split 'test' row 1: duplicate id 'x'"),
        case("cli", "evaluate-template-field-missing", evaluate_({"--variant": {"prompt": "{title}", "target": " {answer}"}}), "evaluate", "{data} split 'test' row 0: row id 'r8': the prompt template refers to field 'title', which the row does not have (it has ['answer', 'answers', 'id', 'question'])"),
        # --- stage command lines: sanity and train (every case fails before a step is taken) ---
        case("cli", "sanity-training-bad-json", gate({"--training": "{max_steps: 5}"}), "sanity", "config key '--training': not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        case("cli", "sanity-training-not-an-object", gate({"--training": [1]}), "sanity", "config key '--training': must be a JSON object of training settings"),
        case("cli", "sanity-training-wrong-type", gate({"--training": training(micro_batch="four")}), "sanity", "--training: config key 'training.micro_batch': 'four' is not of type 'integer'"),
        case("cli", "sanity-training-unknown-key", gate({"--training": training(learning_rat=1e-3)}), "sanity", "--training: config key 'training': Additional properties are not allowed ('learning_rat' was unexpected)"),
        case("cli", "sanity-training-bad-enum", gate({"--training": training(precision="fp64")}), "sanity", "--training: config key 'training.precision': 'fp64' is not one of ['fp32', 'bf16', 'fp16']"),
        case("cli", "sanity-effective-batch-not-multiple", gate({"--training": training(micro_batch=3)}), "sanity", "--training: config key 'training.effective_batch': 8 is not a multiple of micro_batch (3) x processes (1); choose an effective batch divisible by 3 or change micro_batch"),
        case("cli", "sanity-seed-not-a-number", gate({"--seed": "one"}), "sanity", "argument --seed: invalid int value: 'one'"),
        case("cli", "sanity-flag-missing", gate({"--out": DROP}), "sanity", "the following arguments are required: --out"),
        case("cli", "sanity-data-missing", gate({"--data": "{tmp}/nowhere"}), "sanity", "{tmp}/nowhere/tokenise_meta.json: missing; run the pretokenise rule first"),
        case("cli", "sanity-data-not-tokenised", gate({"--data": "{data}"}), "sanity", "{data}/tokenise_meta.json: missing; run the pretokenise rule first"),
        case("cli", "sanity-meta-bad-json", gate({"--data": "{tok_copy}"}, plant=put("tok_copy/tokenise_meta.json", "{not json")), "sanity", "{tok_copy}/tokenise_meta.json: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        case("cli", "sanity-meta-without-task", gate({"--data": "{tok_copy}"}, plant=edit_meta(task=DROP)), "sanity", "{tok_copy}/tokenise_meta.json: no 'task' recorded (tokenised by an older version); re-run the pretokenise rule"),
        case("cli", "sanity-split-column-missing", gate({"--data": "{tok_copy}"}, plant=drop_column("labels")), "sanity", "{tok_copy}/train: missing columns ['labels']"),
        case("cli", "sanity-data-for-another-model", gate({"--model": "{tiny_model}"}), "sanity", rx(r"data: row \d+ \(id 'r\d+'\) has token id \d+ outside the model's vocabulary of 128\. Fix: re-tokenise the data with this model's tokenizer \(rerun pretokenise\)")),
        case("cli", "sanity-data-for-another-tokenizer", gate({"--data": "{tiny_tok}"}), "sanity", rx(OTHER_TOKENIZER % r"\{tiny_tok\}")),
        case("cli", "train-data-for-another-tokenizer", train_({"--data": "{tiny_tok}"}), "train", rx(OTHER_TOKENIZER % r"\{tiny_tok\}")),
        case("cli", "train-seed-not-a-number", train_({"--seed": "1.5"}), "train", "argument --seed: invalid int value: '1.5'"),
        case("cli", "train-training-bad-json", train_({"--training": "{max_steps: 5}"}), "train", "config key '--training': not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        case("cli", "train-negative-learning-rate", train_({"--training": training(learning_rate=-0.1)}), "train", "--training: config key 'training.learning_rate': -0.1 is less than or equal to the minimum of 0"),
        case("cli", "train-data-not-tokenised", train_({"--data": "{data}"}), "train", "{data}/tokenise_meta.json: missing; run the pretokenise rule first"),
        case("cli", "train-data-for-another-model", train_({"--model": "{tiny_model}"}), "train", "{tok}/tokenise_meta.json: vocab_size 294 exceeds the model's 128; the data was tokenised for another model"),
        # --- stage command lines: compare ---
        case("cli", "compare-experiments-bad-json", compare_({"--experiments": "[[chart, baseline, 1]]"}), "compare", "argument --experiments: not valid JSON at character 2: Expecting value"),
        case("cli", "compare-experiments-empty", compare_({"--experiments": []}), "compare", "argument --experiments: expected a non-empty JSON list of [model, dataset, variant, seed]"),
        case("cli", "compare-experiment-seed-as-string", compare_({"--experiments": [["tiny", "chart", "baseline", "1"]]}), "compare", "argument --experiments item 0: expected [model, dataset, variant, seed] or [model, trained on, variant, seed, evaluated dataset], got ['tiny', 'chart', 'baseline', '1']"),
        case("cli", "compare-experiment-twice", compare_({"--experiments": EXPERIMENTS + [["tiny", "chart", "mtup", 2]]}), "compare", "argument --experiments item 4: ['tiny', 'chart', 'mtup', 2] is listed twice"),
        case("cli", "compare-comparison-seed-as-text", compare_({"--comparison": {**COMPARISON, "bootstrap_seed": "one"}}), "compare", "--comparison: config key 'comparison.bootstrap_seed': 'one' is not of type 'integer'"),
        case("cli", "compare-too-few-resamples", compare_({"--comparison": {**COMPARISON, "bootstrap_resamples": 999}}), "compare", "--comparison: config key 'comparison.bootstrap_resamples': 999 is less than the minimum of 1000"),
        case("cli", "compare-bad-bootstrap-mode", compare_({"--comparison": {**COMPARISON, "bootstrap": "seeds"}}), "compare", "--comparison: config key 'comparison.bootstrap': 'seeds' is not one of ['auto', 'examples', 'seeds_and_examples']"),
        case("cli", "compare-reference-not-compared", compare_({"--comparison": {**COMPARISON, "reference_variant": "plain"}}), "compare", "config key 'comparison.reference_variant': 'plain' has no runs for dataset 'chart' (variants: ['baseline', 'mtup'])"),
        case("cli", "compare-results-missing", compare_({"--results-dir": "{tmp}/nowhere"}), "compare", "{tmp}/nowhere/tiny/chart/baseline/seed1/eval.json: not found; run the stage that writes it first"),
        case("cli", "compare-eval-json-invalid", compare_(plant=put("results/tiny/chart/mtup/seed1/eval.json", '{"score": 0.5,')), "compare", "{results}/tiny/chart/mtup/seed1/eval.json: not valid JSON at line 1: Expecting property name enclosed in double quotes"),
        case("cli", "compare-eval-json-for-another-seed", compare_(plant=patch_json("tiny/chart/mtup/seed1/eval.json", seed=2)), "compare", "{results}/tiny/chart/mtup/seed1/eval.json: field 'seed' is 2, but the path is for seed 1"),
        case("cli", "compare-eval-json-unknown-metric", compare_(plant=patch_json("tiny/chart/mtup/seed1/eval.json", metric="bleu")), "compare", rx(r"\{results\}/tiny/chart/mtup/seed1/eval\.json: field 'metric' is 'bleu'; the comparison resamples .*")),
        case("cli", "compare-stale-eval-json", compare_(plant=patch_json("tiny/chart/mtup/seed1/eval.json", score=0.99)), "compare", "{results}/tiny/chart/mtup/seed1: eval.json score 0.99 does not match its predictions.jsonl (0.8); the two files come from different runs: rerun evaluate"),
        case("cli", "compare-prediction-score-not-a-number", compare_(plant=patch_line("tiny/chart/mtup/seed1/predictions.jsonl", 3, score="high")), "compare", "{results}/tiny/chart/mtup/seed1/predictions.jsonl line 4: field 'score' is missing or not a finite number"),
        case("cli", "compare-prediction-line-invalid", compare_(plant=append("tiny/chart/mtup/seed1/predictions.jsonl", "{oops\n")), "compare", "{results}/tiny/chart/mtup/seed1/predictions.jsonl line 21: not valid JSON: Expecting property name enclosed in double quotes"),
        case("cli", "compare-prediction-id-twice", compare_(plant=patch_line("tiny/chart/mtup/seed1/predictions.jsonl", 3, id="ex000")), "compare", "{results}/tiny/chart/mtup/seed1/predictions.jsonl line 4: duplicate id 'ex000'"),
        case("cli", "compare-different-test-sets", compare_(plant=rerun("mtup", 2, scores=correct(18)[:-1])), "compare", "{results}/tiny/chart/mtup/seed2/predictions.jsonl: not the same test examples as {results}/tiny/chart/baseline/seed1/predictions.jsonl (missing ids ['ex019'], extra ids []); paired comparison needs identical test sets: rerun evaluate with the same evaluation settings"),
        case("cli", "compare-train-log-row-bad", compare_(plant=append("tiny/chart/baseline/seed2/train_log.jsonl", '{"step": 11}\n')), "compare", "{results}/tiny/chart/baseline/seed2/train_log.jsonl line 11: fields 'step' (integer) and 'loss' (finite number) are required"),
        case("cli", "compare-run-manifest-missing", compare_(plant=delete("tiny/chart/mtup/seed2/run_manifest.json")), "compare", "{results}/tiny/chart/mtup/seed2/run_manifest.json: not found; run the stage that writes it first"),
        case("cli", "compare-base-eval-missing", compare_(plant=delete("tiny/chart/mtup/base/eval.json")), "compare", "{results}/tiny/chart/mtup/base/eval.json: not found; run the stage that writes it first"),
        case("cli", "compare-seeds-differ", compare_({"--experiments": EXPERIMENTS[:3]}), "compare", "dataset 'chart': variant 'mtup' has seeds [1], the reference 'baseline' has [1, 2]; pairing by seed needs the same seeds"),
        case("cli", "compare-unfair-runs", compare_(plant=rerun("mtup", 1, training_change={"max_length": 2048})), "compare", "unfair comparison on model 'tiny', dataset 'chart', seed 1: the variants differ in more than the prompt format: training.max_length: baseline=512, mtup=2048 (from {results}/tiny/chart/{baseline,mtup}/seed1/run_manifest.json). Fix: make these settings equal (remove the variants.<name>.training overrides) and rerun, or, if the difference is intended, list it under comparison.intended_differences: [training.max_length]"),

        # --- models ---
        case("model", "local-model-without-config", prepare_local(without=("config.json",)), "prepare_model", "model.path {tmp}/source_model: no config.json"),
        case("model", "local-model-only-pickle-weights", prepare_local(without=("model.safetensors",), extra={"pytorch_model.bin": b"pickle"}), "prepare_model", "model.path {tmp}/source_model: only pickle weights ['pytorch_model.bin'], which can run code when loaded; convert them to safetensors first"),
        case("model", "local-model-without-tokenizer", prepare_local(without=("tokenizer.json",)), "prepare_model", "model.path {tmp}/source_model: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)"),
        case("model", "local-model-path-missing", prepare_({"--model": {"name": "m", "source": "local", "path": "{tmp}/nowhere"}}), "prepare_model", "model.path {tmp}/nowhere: not a model directory (missing or empty)"),
        case("model", "model-source-unknown", prepare_({"--model": {"name": "m", "source": "s3"}}), "prepare_model", "--model: config key 'model.source': 's3' is not one of ['tiny', 'hub', 'gguf', 'local']"),
        case("model", "hub-model-without-revision", prepare_({"--model": {"name": "m", "source": "hub", "hub_id": "Qwen/Qwen2.5-0.5B"}}), "prepare_model", "--model: config key 'model.revision': required when model.source is 'hub'"),
        case("model", "corpus-for-a-non-tiny-model", prepare_({"--model": {"name": "m", "source": "local", "path": "{model}"}, "--corpus": "{data}"}), "prepare_model", "--corpus is only used by model.source 'tiny', not 'local'"),
        case("model", "pretokenise-model-missing", pretok({"--model": "{tmp}/nowhere"}), "pretokenise", "{tmp}/nowhere: not a model directory (no config.json); run prepare_model first"),
        case("model", "pretokenise-model-without-tokenizer", pretok({"--model": "{tiny_model}"}), "pretokenise", "{tiny_model}: no tokenizer files (tokenizer.json, tokenizer.model, vocab.json or vocab.txt); " + REPREPARE + ", from a source that ships its tokenizer"),
        case("model", "evaluate-model-without-config", evaluate_({"--model": "{model_copy}"}, plant=copy_model(without=("config.json",))), "evaluate", "{model_copy}: no config.json; run the prepare_model rule first"),
        case("model", "evaluate-model-without-weights", evaluate_({"--model": "{model_copy}"}, plant=copy_model(without=("model.safetensors",))), "evaluate", "{model_copy}: no model weights (no *.safetensors file); " + REPREPARE),
        case("model", "evaluate-model-weight-shard-missing", evaluate_({"--model": "{model_copy}"}, plant=copy_model(without=("model.safetensors",), replace={"model.safetensors.index.json": b'{"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}'})), "evaluate", "{model_copy}: weight shards ['model-00001-of-00002.safetensors'] named in model.safetensors.index.json are missing; " + REPREPARE),
        case("model", "evaluate-model-tokenizer-corrupt", evaluate_({"--model": "{model_copy}"}, plant=copy_model(replace={"tokenizer.json": b"{not json"})), "evaluate", "{model_copy}: the tokenizer cannot be loaded (JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); " + REPREPARE),
        case("model", "evaluate-adapter-not-peft", evaluate_({"--adapter": "{tmp}/empty"}, plant=mkdir("empty")), "evaluate", "{tmp}/empty: no adapter_config.json; is this a PEFT adapter directory?"),
        case("model", "evaluate-adapter-missing", evaluate_({"--adapter": "{tmp}/nowhere"}), "evaluate", "{tmp}/nowhere: no adapter_config.json; is this a PEFT adapter directory?"),
        case("model", "evaluate-adapter-of-another-model", evaluate_({"--adapter": "{other_adapter}"}), "evaluate", "{other_adapter}: made for another base model: 4 of its 8 tensors fit no module of {model} (e.g. base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight); evaluate it with the base model it was trained on ('{tiny_model}', per adapter_config.json), or train an adapter for {model}"),
        case("model", "evaluate-classifier-on-other-classes", evaluate_({"--task": "classification", "--variant": {"input": "{text}"}, "--metric": "accuracy", "--evaluation": {**EVALUATION, "max_length": 32}, "--data": "{tmp}/three_classes", "--adapter": "{tmp}/classifier", "--dataset-name": "sentiment3"}, plant=classifier_and_data(["negative", "neutral", "positive"])), "evaluate", "dataset 'sentiment3' has the label set ['negative', 'neutral', 'positive'] (datasets.sentiment3.labels, or its train split's labels), but the classifier in {tmp}/classifier was trained on ['negative', 'positive']: its outputs cannot be named as classes of 'sentiment3'. Score a classifier only on datasets with the same class names (any order): give 'sentiment3' the class names ['negative', 'positive'] in its raw data, or leave it out of this model's evaluation"),
        case("model", "sanity-lora-target-matches-nothing", gate({"--training": training(lora={"target_modules": ["qkv_proj"]})}), "sanity", "training.lora.target_modules: 'qkv_proj' matches no module of this model (closest: ['v_proj', 'q_proj', 'k_proj']); fix the name or remove it"),
        case("model", "train-lora-target-matches-nothing", train_({"--training": training(lora={"target_modules": ["qkv_proj"]})}), "train", "training.lora.target_modules: 'qkv_proj' matches no module of this model (closest: ['v_proj', 'q_proj', 'k_proj']); fix the name or remove it"),
        case("model", "sanity-lora-target-one-typo-among-good", gate({"--training": training(lora={"target_modules": ["q_proj", "v_prj"]})}), "sanity", "training.lora.target_modules: 'v_prj' matches no module of this model (closest: ['v_proj', 'q_proj', 'o_proj']); fix the name or remove it"),
        case("model", "sanity-modules-to-save-matches-nothing", gate({"--training": training(lora={"modules_to_save": ["lm_haed"]})}), "sanity", "training.lora.modules_to_save: 'lm_haed' matches no module of this model (closest: ['lm_head']); fix the name or remove it"),
        case("model", "sanity-model-missing", gate({"--model": "{tmp}/nowhere"}), "sanity", "{tmp}/nowhere: no config.json; run the prepare_model rule first"),
        case("model", "sanity-model-config-not-json", gate({"--model": "{model_copy}"}, plant=copy_model(replace={"config.json": b"{not json"})), "sanity", "{model_copy}/config.json: not valid JSON at line 1, column 2: Expecting property name enclosed in double quotes; " + REPREPARE),
        # --- formats (issue 37) ---
        case("data", "penman-unbalanced-graph", penman_blocks("# ::id a5\n# ::snt The boy sleeps.\n(s / sleep-01\n   :ARG0 (b / boy)"), "normalise", penman_rejected("unparseable_record", None, "not valid PENMAN: block 6 (line 28): Unexpected end of input at line 31")),
        case("data", "penman-block-without-snt", penman_blocks("# ::id a5\n(s / sleep-01\n   :ARG0 (b / boy))"), "normalise", penman_rejected("missing_field", "snt", "is missing")),
        case("data", "penman-duplicate-id", penman_blocks("# ::id a1\n# ::snt Again.\n(s / sleep-01\n   :ARG0 (d / dog))"), "normalise", penman_rejected("duplicate_id", "id", "id 'a1' occurs earlier in the split")),
        case("config", "format-text-for-amr-records", cfg("datasets.amr_demo.format", "text", base=absolute_single_model_config), "parse", "{config}: config key 'datasets.amr_demo.format': format text (one example per line, no fields) is read by task masked_lm only, not generation; for AMR graphs in PENMAN text (# ::id, # ::snt and a graph per block) set format: penman; other records belong in jsonl, json, csv or parquet files"),
        case("data", "gzipped-jsonl-bad-line", raw_file("train.jsonl.gz", lambda: gzip_bytes(b'{"q": "ok?", "a": "x"}\n' * 30 + b'{"q": "cut\n')), "normalise", "{source}/train.jsonl.gz: 1 of 31 rows of split 'train' rejected (3.2%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unparseable_record 1; for example {source}/train.jsonl.gz line 31: not valid JSON: line 31 column 7: Unterminated string starting here; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "gold-graph-unbalanced", graph_rows("(s / sleep-01 :ARG0 (b / boy)"), "normalise", rejected("unreadable_gold", "a", "gold graph '(s / sleep-01 :ARG0 (b / boy)' is not one PENMAN graph (Unexpected end of input), so metric smatch would score it as read by guesswork; fix the graph")),
        case("config", "smatchpp-on-a-dataset-without-graphs", cfg("datasets.chartqa_demo.also_metrics", ["smatchpp"], base=absolute_demo_config), "config", rx(r"\{config\}: config key 'datasets\.chartqa_demo\.also_metrics': is smatchpp, which scores AMR graphs in PENMAN notation, but the gold answers of split 'train' are no graphs: .*/demo_data/chartqa/train\.jsonl line 1, field 'label': '64' \(and the first 5 alike\); score the dataset with a metric for its answers \(exact_match, token_f1, relaxed_accuracy\.\.\.\)")),
        case("data", "integer-label-out-of-range", labels_csv(["0", "1", "2"] * 3 + ["3"], ["neg", "neu", "pos"]), "normalise", "{source}/train.csv: 1 of 10 rows of split 'train' rejected (10.0%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unknown_label 1; for example {source}/train.csv line 11: field 'label': label 3 is neither a declared name nor a class id 0..2 of the declared labels ['neg', 'neu', 'pos'] (integer labels are mapped by index); fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "fractional-label-among-integers", labels_csv(["0", "1", "2"] * 3 + ["1.0"], None), "normalise", "{source}/train.csv: 1 of 10 rows of split 'train' rejected (10.0%), more than datasets.d.max_rejected_fraction = 0.01; reasons: wrong_type 1; for example {source}/train.csv line 11: field 'label': label '1.0' is a number but not an integer class id (it would become a class of its own); write integer ids (0, 1, 2...) or class names; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("config", "encoding-unknown", cfg("datasets.amr_demo.encoding", "utf-17"), "config", "{config}: config key 'datasets.amr_demo.encoding': 'utf-17' is not a text encoding Python knows (e.g. utf-8, utf-16, utf-16-le, cp1252, latin-1)"),
        case("data", "utf16-corpus", utf16_corpus(), "normalise", "2 files of the dataset are not UTF-8 text but utf-16 (a byte-order mark or NUL bytes between the characters): {source}/train.txt (utf-16), {source}/test.txt (utf-16); set datasets.d.encoding: utf-16 (decoded with Python's codecs), or re-save them as UTF-8"),
        case("data", "duplicates-within-a-split", rows({"q": "question 2?", "a": "answer 2"}, settings={"duplicates": {"max_fraction": 0.05}}), "normalise", "{source}/train.jsonl: 1 of 10 kept rows of split 'train' (10.0%) repeat an earlier row of the split (same input and gold), more than datasets.d.duplicates.max_fraction = 0.05; duplicates: 'train-5' = 'train-2'; deduplicate the split or raise datasets.d.duplicates.max_fraction"),
        case("data", "overlap-in-validation-and-test", overlapping_splits(), "normalise", rx(r"2 problems, all listed in \{out\}/normalise_report\.failed\.json: \(1\) \{source\}/validation\.jsonl: 1 of 1 rows of split 'validation' .* \(2\) \{source\}/test\.jsonl: 1 of 1 rows of split 'test' \(100\.0%\) repeat a row of split 'train' .*")),
        case("data", "file-level-stop-in-two-splits", text_corpus(b"good line\nbad \xff line\n", b"bad \xfe too\n"), "normalise", "2 problems, all listed in {out}/normalise_report.failed.json: (1) {source}/train.txt line 2: invalid UTF-8 at byte 4 of the line (invalid start byte); fix or remove that line, or set the dataset's on_invalid_text: reject_row to reject and count such lines (2) {source}/test.txt line 1: invalid UTF-8 at byte 4 of the line (invalid start byte); fix or remove that line, or set the dataset's on_invalid_text: reject_row to reject and count such lines"),
        case("data", "unreadable-train-and-test", two_files(b'{"q": "ok?", "a": "x"}\n{"q": "caf\xe9?", "a": "x"}\n', b'{"q": "na\xefve?", "a": "x"}\n'), "normalise", "2 problems, all listed in {out}/normalise_report.failed.json: (1) {source}/train.jsonl line 2: " + NOT_UTF8_ROWS % 33 + " (2) {source}/test.jsonl line 1: " + (NOT_UTF8_ROWS % 9).replace("0xe9", "0xef")),
        case("data", "imagefolder-empty-image-relative-raw", relative_raw(image_folder({"file_name": "charts/empty.png", "query": "Q?", "label": "1"}, bad_file=("charts/empty.png", b""))), "normalise", "{source}/train/metadata.jsonl: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: empty_image 1; for example {source}/train/metadata.jsonl line 6: field 'file_name': image file {source}/train/charts/empty.png is empty (0 bytes); re-export or re-download the image; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "imagefolder-two-metadata-files", laid_out({"train/metadata.jsonl": ROW, "train/metadata.csv": b"q,a\nx?,2\n", "test/metadata.jsonl": ROW}, **IMAGEFOLDER, source={"layout": "imagefolder"}), "download", "--dataset: config key 'datasets.d.splits.train': {source}/train holds 2 metadata files ['metadata.csv', 'metadata.jsonl']; an image folder's split has one (format jsonl reads metadata.jsonl): merge them into one and remove the others"),
        case("data", "csv-answer-json-text-broken", csv_rows('x?,"[""7"" ""seven""]"'), "normalise", rejected("wrong_type", "a", "holds '[\"7\" \"seven\"]', a list written as text that is not valid JSON (Expecting ',' delimiter); write the list as JSON, e.g. [\"a\", \"b\"], or one value without brackets", line=7, fmt="csv")),
        # --- numbers (issue 36) ---
        case("config", "two-level-bootstrap-with-one-seed", cfg("comparison.bootstrap", "seeds_and_examples", base=lambda: {**single_model_config(), "seeds": [1]}), "config", "{config}: config key 'comparison.bootstrap': 'seeds_and_examples' resamples seeds, which needs at least 2, but seeds is [1]; add seeds, or use 'examples' (or 'auto', which resamples seeds from 3 on)"),
        # --- refusals (issue 37) ---
        case("config", "min-detectable-effect-in-points", cfg("comparison.min_detectable_effect", 5), "config", "{config}: config key 'comparison.min_detectable_effect': is 5, but dataset 'amr_demo' is scored by smatch, in [0, 1], where no difference between two variants reaches 1, so the threshold would never stop a run; give it as a fraction of the metric's range (e.g. 0.05 for 5 points)"),
        case("config", "activation-offloading-on-cpu", cfg("model.training", {"activation_offloading": True, "gradient_checkpointing": True}), "config", "{config}: config key 'model.training.activation_offloading': is true but training.gpus is 0: offloading moves the checkpointed activations from GPU memory to host memory, where a CPU run keeps them already, so it would do nothing; set activation_offloading: false, or train on GPUs (training.gpus > 0)"),
        case("config", "qlora-base-without-qlora", cfg("evaluation.qlora_base", "unquantised"), "config", "{config}: config key 'evaluation.qlora_base': is 'unquantised', but no training block sets training.quantization (QLoRA), so there is no QLoRA adapter to score and it would change nothing; remove evaluation.qlora_base, or set training.quantization (e.g. {bits: 4}) to train QLoRA"),
        case("config", "qlora-base-default-written-without-qlora", cfg("evaluation.qlora_base", "quantised"), "config", "{config}: config key 'evaluation.qlora_base': is 'quantised', but no training block sets training.quantization (QLoRA), so there is no QLoRA adapter to score and it would change nothing; remove evaluation.qlora_base, or set training.quantization (e.g. {bits: 4}) to train QLoRA"),
        case("config", "target-renders-the-answer-list", cfg("variants.baseline.target", " {answers}"), "config", "{config}: config key 'variants.baseline.target': {answers} is the list of gold answers, which renders as its Python text (['64'], brackets and quotes included), so the model would learn to write that; use {answer} (the first gold answer)"),
        case("config", "section-marker-not-in-target", cfg("variants.mtup.extractor", {"type": "section", "marker": "Task 3:"}), "config", "{config}: config key 'variants.mtup.extractor.marker': 'Task 3:' never occurs in the target 'Task 1: {aux}\\nTask 2: {answer}', so the model is never taught to write it and every prediction would be unparseable; use the text the target puts before {answer} as the marker (e.g. 'Task 2:'), or add it to the target"),
        case("config", "qlora-with-fsdp", cfg("model.training", {"quantization": {"bits": 4}, "strategy": "fsdp", "gpus": 2, "micro_batch": 8, "precision": "bf16"}), "config", "{config}: config key 'model.training.quantization': training.strategy: fsdp cannot shard quantised base weights (bitsandbytes 4/8-bit tensors are not DTensors); set training.quantization: null, or set training.strategy: ddp (model 'tiny-llama', variant 'baseline')"),
        case("config", "variant-token-budget-below-max-length", cfg("variants.mtup.training", {"micro_batch_tokens": 64}), "config", "{config}: config key 'variants.mtup.training.micro_batch_tokens': 64 is below max_length (128), so an example of max_length tokens fits no micro-batch; set micro_batch_tokens to at least 128 (e.g. micro_batch x max_length keeps today's memory bound) or lower max_length"),
        case("model", "evaluate-masked-lm-on-a-causal-model", evaluate_({"--task": "masked_lm", "--variant": {"mask_rate": 0.15, "grouping": "lines"}, "--metric": "masked_accuracy", "--data": "{tmp}/corpus"}, plant=masked_lm_corpus), "evaluate", "{model}: task 'masked_lm' needs a model that AutoModelForMaskedLM loads, but this is a 'llama' model: this model has no masked language-model head; run the dataset on another model (the dataset's models: list)"),
        case("config", "masked-lm-dataset-on-a-causal-model", cfg("datasets.corpus_demo.models", ["tiny-bert", "tiny-llama"], base=absolute_demo_config), "parse", "{config}: config key 'datasets.corpus_demo.models': task masked_lm needs a masked language model (an encoder such as BERT, with a [MASK] token and a head that predicts it), but 'tiny-llama' is a tiny 'llama' model (models.tiny-llama.tiny.architecture; the masked LMs are ['bert']), which predicts the next token only; remove 'tiny-llama' from datasets.corpus_demo.models"),
        # --- vlm (issue 38) ---
        case("config", "vlm-max-pixels-zero", cfg("variants.vision.max_pixels", 0, base=absolute_demo_config), "config", "{config}: config key 'variants.vision.max_pixels': 0 is less than the minimum of 1"),
        case("config", "vlm-max-pixels-on-a-generation-variant", cfg("variants.baseline.max_pixels", 1024), "config", "{config}: config key 'variants.baseline.max_pixels': a pixel budget is a vision_language setting; a generation variant has no images. Set variants.baseline.task: vision_language, or remove it"),
        # --- reruns (issue 35) ---
        case("config", "power-threshold-without-the-base-evaluation", cfg("comparison.min_detectable_effect", 0.001, base=without_base_evaluation), "config", "{config}: config key 'comparison.min_detectable_effect': is 0.001, but evaluation.evaluate_base_model is false, and the power check estimates from the untrained model's scores: set evaluation.evaluate_base_model: true, or remove the threshold"),
        # --- issue 43: text formats, encodings, compression ---
        case("data", "utf8-file-declared-latin-1", text_files({"train.jsonl": b'{"q": "ok?", "a": "1"}\n' + '{"q": "\u00bfQu\u00e9 valor?", "a": "7"}\n'.encode()}, encoding="latin-1"), "normalise", "{source}/train.jsonl line 2: the dataset declares encoding: latin-1, but the file is valid UTF-8 with multi-byte characters: read as latin-1 the line is '{\"q\": \"\u00c2\u00bfQu\u00c3\u00a9 valor?\", \"a\": \"7\"}', read as UTF-8 it is '{\"q\": \"\u00bfQu\u00e9 valor?\", \"a\": \"7\"}'; remove datasets.d.encoding (UTF-8 is the default) if the UTF-8 reading is right"),
        case("config", "encoding-on-parquet", cfg("datasets.amr_demo.encoding", "latin-1", base=parquet_amr_config), "config", "{config}: config key 'datasets.amr_demo.encoding': format parquet is binary (its text is UTF-8 inside the file, as Parquet stores it), so encoding: latin-1 would do nothing; remove datasets.amr_demo.encoding"),
        case("config", "encoding-on-a-hub-source", cfg("datasets.amr_demo.encoding", "cp1252", base=hub_amr_config), "config", "{config}: config key 'datasets.amr_demo.encoding': a hub dataset is read by datasets.load_dataset, which decodes its files itself, so encoding: cp1252 would do nothing; remove datasets.amr_demo.encoding"),
        case("data", "cp1252-undefined-byte", text_files({"train.jsonl": b'{"q": "caf\xe9?", "a": "1"}\n' * 3 + b'{"q": "bad \x81?", "a": "1"}\n'}, encoding="cp1252"), "normalise", "{source}/train.jsonl line 4: not cp1252 text (byte 0x81, which cp1252 does not define, at byte 11 of the line), the dataset's encoding; fix that line or set the dataset's encoding to the file's, or set the dataset's on_invalid_text: reject_row to reject and count such rows"),
        case("data", "gzip-cut-short-at-download", laid_out({"train.jsonl.gz": cut_stream("gzip"), "test.jsonl": ROW}), "download", rx(r"\{source\}/train\.jsonl\.gz: the gzip stream is damaged or cut short after line (\d{3,}), the last line read whole \(Compressed file ended before the end-of-stream marker was reached\); download or compress the file again")),
        case("data", "zstd-cut-short-at-download", laid_out({"train.jsonl.zst": cut_stream("zstd"), "test.jsonl": ROW}), "download", rx(r"\{source\}/train\.jsonl\.zst: the zstd stream is damaged or cut short after line (\d{3,}), the last line read whole \(the input ends inside a zstd frame\); download or compress the file again")),
        case("data", "tsv-embedded-tab", text_files({"train.tsv": b"q\ta\n" + b"".join(b"question %d?\tanswer %d\n" % (i, i) for i in range(9)) + b"a\ttab inside?\t1\n"}, fmt="tsv"), "normalise", "{source}/train.tsv: 1 of 10 rows of split 'train' rejected (10.0%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unparseable_record 1; for example {source}/train.tsv line 11: not valid TSV: line 11 has 3 fields where the header (line 1) has 2; a value holding a tab splits into two fields (TSV has no quoting): replace the tab inside the value; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "tsv-file-under-format-csv", laid_out({"train.tsv": b"q\ta\nx?\t1\n", "test.tsv": b"q\ta\ny?\t1\n"}, format="csv"), "download", "split 'train': {source}/train.csv is missing (the directory holds ['test.tsv', 'train.tsv']); train.tsv is there: set format: tsv"),
        # --- issue 42: docs (class_weights keys, a BERT's LoRA targets, a single model's own key) ---
        case("config", "class-weights-class-id-as-key", cfg("variants.plain.class_weights", {0: 2.0}, base=declared_topics), "config", "{config}: config key 'variants.plain.class_weights.0': is not a label of dataset 'topics_demo' (datasets.topics_demo.labels: ['food', 'sport', 'weather']) (class id 0 is 'food'); class_weights keys are label names, not class ids: write the label's name"),
        case("config", "class-weights-misspelt-label", cfg("variants.plain.class_weights", {"sports": 2.0}, base=declared_topics), "config", "{config}: config key 'variants.plain.class_weights.sports': is not a label of dataset 'topics_demo' (datasets.topics_demo.labels: ['food', 'sport', 'weather']); class_weights keys are label names, not class ids: write the label's name"),
        case("config", "bert-classifier-on-decoder-lora-targets", cfg("model.training", {"micro_batch": 16}, base=bert_classifier), "parse", "{config}: config key 'training.lora.target_modules': 'q_proj' matches no module of model 'tiny-bert' (tiny.architecture: bert, whose projection layers are named ['dense', 'key', 'query', 'value']); set target_modules to names the model has (a BERT-style encoder: [query, key, value, dense]; a decoder: [q_proj, k_proj, v_proj, o_proj]), e.g. under model.training.lora"),
        case("config", "single-model-unknown-training-key", cfg("model.training", {"learning_rat": 1e-4}), "config", "{config}: config key 'model.training': unknown training keys ['learning_rat']"),
        case("config", "single-model-masked-lm-on-a-causal-model", cfg("model.name", "tiny-llama", base=causal_single_model_with_corpus), "parse", "{config}: config key 'datasets.corpus_demo.models': task masked_lm needs a masked language model (an encoder such as BERT, with a [MASK] token and a head that predicts it), but 'tiny-llama' is a tiny 'llama' model (model.tiny.architecture; the masked LMs are ['bert']), which predicts the next token only; run it on a masked language model (e.g. a tiny one with tiny.architecture: bert)"),
        # --- issue 43: AMR/PENMAN and labels ---
        case("data", "penman-top-node-closed-early", penman_blocks("# ::id a5\n# ::snt The girl does not sleep.\n(s / sleep-01\n   :ARG0 (g / girl))\n   :polarity -"), "normalise", penman_rejected("unparseable_record", None, "not valid PENMAN: block 6 (line 28): text after the graph's last bracket at line 32: ':polarity -' (a graph ends with its top node's bracket: is the top node closed early?)")),
        case("data", "penman-second-graph-in-a-block", penman_blocks("# ::id a5\n# ::snt Two.\n(s / sleep-01)\n(g / girl)"), "normalise", penman_rejected("unparseable_record", None, "not valid PENMAN: block 6 (line 28): text after the graph's last bracket at line 31: '(g / girl)' (a second graph: a block holds one graph, and blocks are separated by a blank line)")),
        case("data", "gold-graph-top-node-closed-early", graph_rows("(s / sleep-01 :ARG0 (g / girl)) :polarity -"), "normalise", rejected("unreadable_gold", "a", "gold graph '(s / sleep-01 :ARG0 (g / girl)) :polarity -' is not one PENMAN graph (text after the graph's last bracket at line 1: ':polarity -' (a graph ends with its top node's bracket: is the top node closed early?)), so metric smatch would score it as read by guesswork; fix the graph")),
        case("data", "gold-graph-closing-bracket-too-many", graph_rows("(s / sleep-01 :ARG0 (b / boy)))"), "normalise", rejected("unreadable_gold", "a", "gold graph '(s / sleep-01 :ARG0 (b / boy)))' is not one PENMAN graph (text after the graph's last bracket at line 1: ')' (a closing bracket more than the opening ones)), so metric smatch would score it as read by guesswork; fix the graph")),
        case("data", "penman-graph-4000-levels-deep", penman_blocks("# ::id a5\n# ::snt Deep.\n" + "".join(f"(n{i} / thing :mod " for i in range(4000)) + "(z / zero)" + ")" * 4000), "normalise", penman_rejected("unparseable_record", None, "not valid PENMAN: block 6 (line 28): the graph nests 4001 levels deep, more than the 200 this reader (and penman's writer) can follow; an AMR graph nests a few dozen: check the block")),
        case("data", "penman-file-of-json-lines", penman_file(b'{"id": "a0", "snt": "x", "graph": "(a / b)"}\n{"id": "a1", "snt": "y", "graph": "(a / b)"}\n'), "normalise", "{source}/train.txt: 1 of 1 rows of split 'train' rejected (100.0%), so no row is left; reasons: unparseable_record 1; for example {source}/train.txt block 1 (line 1): not valid PENMAN: block 1 (line 1) does not start with a graph but with '{\"id\": \"a0\", \"snt\": \"x\", \"graph\": \"(a / b)\"}' (a graph starts with '('; a file of JSON lines is format: jsonl); fix the rows (or the field mapping, if every row fails alike)"),
        case("data", "penman-file-of-comments-only", penman_file(b"# AMR release (demo)\n\n# no graphs here\n"), "normalise", "{source}/train.txt: holds no PENMAN graph: its 2 blocks are comments only (format: penman reads blank-line separated blocks of '# ::' metadata lines and a graph); check that this is the file of graphs"),
        case("data", "numeric-labels-read-both-ways", labels_csv(["1", "2", "3", "4"] * 3, ["1", "2", "3", "4", "5"]), "normalise", "datasets.d.labels: the declared labels ['1', '2', '3', '4', '5'] are numbers, and column 'label' holds ['1', '2', '3', '4'], each both a declared name and a class id 0..4, so the rows cannot say which they are: by name 1 -> 1, 2 -> 2, 3 -> 3, 4 -> 4, or by index 1 -> 2, 2 -> 3, 3 -> 4, 4 -> 5; give the rows the ids 0..4 or name every class at least once, or declare labels that are not numbers"),
        case("data", "numeric-labels-mixing-names-and-ids", labels_csv(["0", "1", "2", "3", "4", "5"] * 2, ["1", "2", "3", "4", "5"]), "normalise", "datasets.d.labels: the declared labels ['1', '2', '3', '4', '5'] are numbers, and column 'label' holds ['0', '1', '2', '3', '4', '5']: ['0'] only a class id, ['5'] only a declared name, so no one reading fits the column (row by row: 0 -> 1, 1 -> 1, 2 -> 2, 3 -> 3, 4 -> 4, 5 -> 5, two values onto one class); give the rows the ids 0..4 or the declared names, not both"),
        case("data", "numeric-labels-read-by-name-one-out-of-set", labels_csv(["1", "2", "3", "4", "5"] * 2 + ["6"], ["1", "2", "3", "4", "5"]), "normalise", "{source}/train.csv: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unknown_label 1; for example {source}/train.csv line 12: field 'label': label '6' is not in the label set ['1', '2', '3', '4', '5'] (the column's numbers are read as the declared names); fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "float-labels-in-every-row", float_labels(), "normalise", "{source}/train.jsonl: 4 of 4 rows of split 'train' rejected (100.0%), so no row is left; reasons: wrong_type 4; for example {source}/train.jsonl line 1: field 'label': a label must be a string or an integer, got float 0.0; fix the rows (or the field mapping, if every row fails alike)"),
        case("data", "classlabel-id-outside-its-names", classlabel_parquet([0, 1, 0, 1, 0, 1, 0, 1, 0, 2]), "normalise", "{source}/train.parquet: 1 of 10 rows of split 'train' rejected (10.0%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unknown_label 1; for example {source}/train.parquet row index 9: field 'label': label 2 is not a class id 0..1 of the source's ClassLabel names ['neg', 'pos'] (the file's datasets features); fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "conversation-tool-turn", tool_turn_conversation(), "normalise", "{source}/train.jsonl: 1 of 10 rows of split 'train' rejected (10.0%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unknown_role 1; for example {source}/train.jsonl line 6: field 'messages[2].role': turn 2: role 'tool' is a tool call or its result, which this task does not train on (conversations of system, user and assistant turns only, rendered without tools); leave conversations with tool turns out of the dataset; fix the rows or raise datasets.d.max_rejected_fraction"),
        # --- issue 43: images and vision-language inputs ---
        case("data", "imagefolder-image-above-200-to-1", image_folder({"file_name": "charts/strip.png", "query": "Q?", "label": "1"}, bad_file=("charts/strip.png", strip_png(402, 2))), "normalise", "{source}/train/metadata.jsonl: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: image_aspect_ratio 1; for example {source}/train/metadata.jsonl line 6: field 'file_name': image file {source}/train/charts/strip.png is 402x2 pixels, 201:1, above 200:1 (the vision-language processors refuse it); crop or pad the image; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("data", "imagefolder-32-bit-image-outside-0-255", image_folder({"file_name": "charts/depth.tif", "query": "Q?", "label": "1"}, bad_file=("charts/depth.tif", depth_tiff())), "normalise", "{source}/train/metadata.jsonl: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: image_value_range 1; for example {source}/train/metadata.jsonl line 6: field 'file_name': image file {source}/train/charts/depth.tif is a mode I image with values 0..57000, outside 0..255, and its mode gives no range to scale them by (RGB would clip them); re-export it as an 8- or 16-bit PNG; fix the rows or raise datasets.d.max_rejected_fraction"),
        case("config", "vlm-min-pixels-above-max-pixels", cfg("variants.vision.max_pixels", 1024, base=with_min_pixels), "config", "{config}: config key 'variants.vision.max_pixels': 1024 is below min_pixels 4096: no image size lies within the budget; raise max_pixels or lower min_pixels"),
        case("config", "vlm-budget-on-a-fixed-size-family", cfg("variants.vision.max_pixels", 4096, base=absolute_demo_config), "parse", "{config}: config key 'variants.vision.max_pixels': model 'tiny-llava': a 'llava' model (models.tiny-llava.tiny.architecture) resizes every image to one fixed size, so a pixel budget changes nothing; remove max_pixels and min_pixels from the variant, or run it on a dynamic-resolution or tiling model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision)"),
        case("model", "qwen-vl-folder-without-its-processor-file", prepare_(plant=copy_model((), {"config.json": b'{"model_type": "qwen2_vl"}'}, name="source_model")), "prepare_model", "model.path {tmp}/source_model: {tmp}/source_model holds no preprocessor_config.json (nor processor_config.json): a qwen2_vl model's image processor settings (patch size, merge size, pixel budget) come from it; copy it from the model's release beside config.json"),
        # --- issue 44: numbers and refusals ---
        case("model", "generation-on-a-tokenizer-without-eos", pretok({"--model": "{model_copy}"}, plant=model_without_eos), "pretokenise", "{model_copy}: the tokenizer has no EOS token, and every generation target ends with one so that the model learns to stop (and decoding stops there); set eos_token in the model's tokenizer_config.json (a token of its vocabulary, such as '</s>'), or run the dataset on a model whose tokenizer has one"),
        case("cli", "sanity-rerun-below-the-power-threshold", gate({"--min-detectable-effect": "0.05", "--power-report": "{tmp}/power.json"}, plant=power_report_of_72_examples), "sanity", "dataset 'chartqa_demo' (model 'tiny-llama'): with 72 test examples the minimum detectable effect is ±0.165, above comparison.min_detectable_effect 0.05. Fix: use at least 785 test examples (under the assumption in the power report; more seeds are no substitute: the examples' difficulty is shared across seeds), or raise comparison.min_detectable_effect"),
        case("cli", "sanity-rerun-without-its-power-report", gate({"--min-detectable-effect": "0.05", "--power-report": "{tmp}/power.json"}), "sanity", "{tmp}/power.json: not found; run snakemake {tmp}/power.json first, which estimates it"),
        case("config", "min-detectable-effect-beyond-an-unbounded-metrics-reach", power_on_untrained_loss(50), "power", "config key 'comparison.min_detectable_effect': is 50, but dataset 'corpus' is scored by mlm_loss, [0, ∞), lower is better, and the untrained model 'tiny-bert' scores 6.75: variants that train below that differ by less than 6.75, so the threshold would never stop a run; give it in the metric's own units, well below 6.75 (e.g. 0.068)"),
        case("config", "variant-sets-a-key-the-reference-leaves-unset", cfg("variants.mtup.training", {"micro_batch_tokens": 512}), "config", "{config}: config key 'variants.mtup.training.micro_batch_tokens': sets 512 where the reference variant 'baseline' leaves it unset, so the comparison would not be fair; make them equal, or list it under comparison.intended_differences: [training.micro_batch_tokens] if the difference is the point"),
        # --- issue 43 follow-up: reader edge cases (breaker) ---
        case("data", "ascii-tsv-with-a-utf8-bom-declared-latin-1", text_files({"train.tsv": b"\xef\xbb\xbfq\ta\n" + b"".join(b"question %d?\t%d\n" % (i, i) for i in range(9))}, fmt="tsv", encoding="latin-1"), "normalise", "{source}/train.tsv line 1: the dataset declares encoding: latin-1, but the file is valid UTF-8 with multi-byte characters: read as latin-1 the line is '\u00ef\u00bb\u00bfq\\ta', read as UTF-8 it is 'q\\ta'; remove datasets.d.encoding (UTF-8 is the default) if the UTF-8 reading is right"),
        case("data", "imagefolder-float-image-scaled-to-0-1", image_folder({"file_name": "charts/unit.tif", "query": "Q?", "label": "1"}, bad_file=("charts/unit.tif", unit_float_tiff())), "normalise", "{source}/train/metadata.jsonl: 1 of 11 rows of split 'train' rejected (9.1%), more than datasets.d.max_rejected_fraction = 0.01; reasons: image_value_range 1; for example {source}/train/metadata.jsonl line 6: field 'file_name': image file {source}/train/charts/unit.tif is a mode F (float) image with values 0..0.95, all within 0..1, which RGB conversion reads as 0..255 (the image would be black); multiply by 255 and re-export it as an 8- or 16-bit PNG; fix the rows or raise datasets.d.max_rejected_fraction"),        # --- issue 43: readers against their references, round 2 ---
        case("data", "zero-padded-labels-read-as-class-ids", labels_csv(["01", "02"] * 5, ["neg", "neu", "pos"]), "normalise", "{source}/train.csv: 10 of 10 rows of split 'train' rejected (100.0%), so no row is left; reasons: unknown_label 10; for example {source}/train.csv line 2: field 'label': " + PADDED % ("'01'", "id 1, 'neu'", "'01'", 2) + "; fix the rows (or the field mapping, if every row fails alike)"),
        case("data", "zero-padded-labels-beside-numeric-names", labels_csv(["01", "02", "03"] * 4, ["1", "2", "3"], test_label="3"), "normalise", "{source}/train.csv: 12 of 12 rows of split 'train' rejected (100.0%), so no row is left; reasons: unknown_label 12; for example {source}/train.csv line 2: field 'label': " + PADDED % ("'01'", "id 1, '2'", "'01'", 2) + "; fix the rows (or the field mapping, if every row fails alike)"),
        case("data", "jsonl-with-cr-line-ends-one-record-cut", text_files({"train.jsonl": b"".join(b'{"q": "question %d?", "a": "%d"}\r' % (i, i) for i in range(5)) + b'{"q": "cut\r' + b"".join(b'{"q": "question %d?", "a": "%d"}\r' % (i, i) for i in range(6, 10))}), "normalise", "{source}/train.jsonl: 1 of 10 rows of split 'train' rejected (10.0%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unparseable_record 1; for example {source}/train.jsonl line 6: not valid JSON: line 6 column 7: Unterminated string starting here (the file ends its lines with a bare carriage return (\\r, old Mac line ends), each read as a line end as datasets' json reader reads them); fix the rows or raise datasets.d.max_rejected_fraction"),
        # --- issue 44 follow-up: readers broken on purpose, round 2 (breaker2) ---
        case("data", "declared-zero-padded-labels-rows-without-zeros", labels_csv(["1", "2"] * 5, ["01", "02", "03"]), "normalise", "datasets.d.labels: the declared labels ['01', '02', '03'] are numbers written otherwise than column 'label' writes them (['1', '2']), each a declared name by its number and a class id 0..2: by number 1 -> 01, 2 -> 02, or by index 1 -> 02, 2 -> 03; write the rows' labels as declared, or give the rows the ids 0..2 with 0 among them"),
        case("data", "jsonl-raw-carriage-returns-inside-a-string", text_files({"train.jsonl": b"".join(b'{"q": "question %d?", "a": "%d"}\n' % (i, i) for i in range(9)) + b'{"q": "Hello\r42\rworld", "a": "9"}\n'}), "normalise", "{source}/train.jsonl: 1 of 10 rows of split 'train' rejected (10.0%), more than datasets.d.max_rejected_fraction = 0.01; reasons: unparseable_record 1; for example {source}/train.jsonl line 10: not valid JSON: line 10 column 13: Invalid control character here; fix the rows or raise datasets.d.max_rejected_fraction"),
        # --- issue 43 follow-up: readers, round 3 (readers3) ---
        case("data", "tsv-header-line-blank", text_files({"train.tsv": b" \t \n" + b"".join(b"question %d?\t%d\n" % (i, i) for i in range(9))}, fmt="tsv"), "normalise", "{source}/train.tsv line 1: the header line is blank (spaces and tabs only), so the columns have no names; write the column names on line 1, separated by tabs (e.g. sentence<TAB>label), or remove the line if the next one is the header"),
        # --- issue 44: a published table edited by hand ---
        case("cli", "comparison-table-edited-by-hand", edited_comparison_table, "published", "{results}/comparison.md changed since compare wrote it (the sha256 recorded in {results}/experiment_set.json no longer matches), so it is not the comparison the workflow computed, and no rerun would notice; keep your edits in another file, then delete {results}/comparison.md and run snakemake again (or run it with --forcerun compare): compare writes it anew"),
        case("data", "classlabel-names-padded-labels-plain", classlabel_parquet([0, 1, 2] * 4, names=("01", "02", "03"), declared=["1", "2", "3"]), "normalise", "2 problems, all listed in {out}/normalise_report.failed.json: (1) {source}/train.parquet: 12 of 12 rows of split 'train' rejected (100.0%), so no row is left; reasons: unknown_label 12; for example {source}/train.parquet row index 0: field 'label': " + CLASSLABEL_NAMES % ("'01'", 0) + "; fix the rows (or the field mapping, if every row fails alike) (2) {source}/test.parquet: 1 of 1 rows of split 'test' rejected (100.0%), so no row is left; reasons: unknown_label 1; for example {source}/test.parquet row index 0: field 'label': " + CLASSLABEL_NAMES % ("'02'", 1) + "; fix the rows (or the field mapping, if every row fails alike)"),
        # --- issue 44: non-finite numbers in the config ---
        case("config", "learning-rate-infinite", cfg("training.learning_rate", float("inf")), "config", "{config}: config key 'training.learning_rate': is inf, not a finite number (YAML reads .inf and .nan as numbers); give a finite value"),
        case("config", "learning-rate-nan-in-a-variant", cfg("variants.mtup.training", {"learning_rate": float("nan")}), "config", "{config}: config key 'variants.mtup.training.learning_rate': is nan, not a finite number (YAML reads .inf and .nan as numbers); give a finite value"),
    ]


def declared_topics() -> dict:
    """The one-model demo config whose classifier declares its labels (the label set is known at config time)."""
    config = single_model_config()
    config["datasets"]["topics_demo"]["labels"] = ["food", "sport", "weather"]
    return config


def causal_single_model_with_corpus() -> dict:
    """The tiny Llama as the one model: (``model:``) with the demo's masked-LM corpus and its variants."""
    config = absolute_single_model_config()
    demo = default_config()
    config["datasets"]["corpus_demo"] = demo_settings("corpus_demo")
    del config["datasets"]["corpus_demo"]["models"]
    config["variants"].update({name: v for name, v in demo["variants"].items() if v.get("task") == "masked_lm"})
    config["comparison"]["reference_variant"]["masked_lm"] = "mlm_tokens"
    return config


def bert_classifier() -> dict:
    """The demo's topic classifier on the tiny BERT as the one model, with the default LoRA targets (a decoder's)."""
    config = single_model_config("tiny-bert")
    config["datasets"] = {"topics_demo": demo_settings("topics_demo")}
    del config["datasets"]["topics_demo"]["models"]
    config["variants"] = {name: {k: v for k, v in variant.items() if k != "training"}
                          for name, variant in default_config()["variants"].items() if variant.get("task") == "classification"}
    config["comparison"]["reference_variant"] = "plain"
    return config


def strip_png(width: int, height: int) -> bytes:
    """A valid PNG of ``width`` x ``height`` pixels (issue 43: a strip past 200:1)."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (20, 40, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


def unit_float_tiff() -> bytes:
    """A valid 32-bit float (mode F) TIFF holding 0..1, as scientific pipelines save images (a reviewer's find)."""
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray((np.arange(20, dtype=np.float32) * 0.05).reshape(4, 5)).save(buffer, format="TIFF")
    return buffer.getvalue()


def depth_tiff() -> bytes:
    """A valid 32-bit integer (mode I) TIFF whose values run past 255, as depth maps ship (issue 43)."""
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray((np.arange(20, dtype=np.int32) * 3000).reshape(4, 5), "I").save(buffer, format="TIFF")
    return buffer.getvalue()


def with_min_pixels() -> dict:
    """The demo config whose vision variant sets min_pixels 4096 (issue 43: a budget floor above its ceiling)."""
    config = absolute_demo_config()
    config["variants"]["vision"]["min_pixels"] = 4096
    return config


def without_base_evaluation() -> dict:
    """The one-model demo config without the untrained model's evaluation (issue 35's silent threshold)."""
    config = single_model_config()
    config["evaluation"]["evaluate_base_model"] = False
    return config


# --- the parts of the messages that many rows share ---
REPREPARE = "run the prepare_model rule again (snakemake --forcerun prepare_model)"
OTHER_TOKENIZER = (r"%s/tokenise_meta\.json: tokenised with tokenizer fingerprint tiny, but the tokenizer of \{model\} has "
                   r"fingerprint [0-9a-f]{12}; the data was tokenised for another model: re-run the pretokenise rule for "
                   r"this model \(snakemake --forcerun pretokenise\)")
HINT = "a field is a plain name such as {question}, write {{ and }} for literal braces"
LEAK = ("so evaluation would put the gold answer into every test prompt; remove {%s} from the prompt "
        "(a field computed from the answer belongs in the target, as MTUP's aux does)")
TWICE = "YAML would silently keep only the last, so remove or rename one"
NOT_UTF8 = "not UTF-8 text (byte 0xe9 at byte offset %d of the file); re-save the file as UTF-8"
NOT_UTF8_ROWS = NOT_UTF8 + ", or set the dataset's on_invalid_text: reject_row to reject and count such rows"
NOT_PARQUET = "not a readable Parquet file (%s); it is truncated or corrupt: download or export it again"
UNFAIR = ("sets {new!r} where the reference variant 'baseline' uses {old!r}, so the comparison would not be fair; "
          "make them equal, or list it under comparison.intended_differences: [{key}] if the difference is the point")
SMALL = """\
model: {name: tiny-llama, source: tiny}
datasets:
  amr_demo:
    source: {type: local, path: demo_data/amr}
    fields: {id: id, question: sentence, answers: graph}
    metric: smatch
%s
variants:
  baseline: {prompt: "Q: {question}", target: " {answer}"}
%s
training: {max_length: 128%s}
"""


def rejected(reason: str, field: str | None, detail: str, line: int = 6, fmt: str = "jsonl") -> str:
    """normalise's message for one bad row among ten, named by the ``line`` of the file it is on.

    :func:`rows` puts the bad record at row index 5, which is line 6 of train.jsonl; :func:`csv_rows`
    puts it on line 7 of train.csv (the header is line 1).
    """
    where = f"{{source}}/train.{fmt} line {line}: " + (f"field '{field}': " if field else "")
    return (f"{{source}}/train.{fmt}: 1 of 10 rows of split 'train' rejected (10.0%), more than "
            f"datasets.d.max_rejected_fraction = 0.01; reasons: {reason} 1; for example {where}{detail}; "
            "fix the rows or raise datasets.d.max_rejected_fraction")


# --- the test ---
@dataclass(frozen=True)
class Regex:
    pattern: str


def rx(pattern: str) -> Regex:
    """An expected message given as a regex (matched in full); write workspace paths as \\{name\\}."""
    return Regex(pattern)


def case(family: str, case_id: str, setup: Callable, stage: str, expected: str | Regex, gap: str | None = None):
    marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
    return pytest.param(setup, stage, expected, id=f"{family}-{case_id}", marks=marks)


OUTPUT_FLAGS = ("--out", "--report", "--summary-out", "--predictions-out", "--adapter-out", "--log-out",
                "--manifest-out", "--out-csv", "--out-markdown", "--plots-dir")


def declared_outputs(argv: list[str]) -> list[Path]:
    return [Path(value) for flag, value in zip(argv, argv[1:]) if flag in OUTPUT_FLAGS]


def call(stage: str, argv: list[str]):
    """The entry point: ``load_config(path)`` for ``config``, else ``workflow_scripts.<stage>.main(argv)``."""
    from workflow_scripts.checks.config import load_config

    if stage == "config":
        return load_config(argv[0])
    if stage == "published":  # the check of the published tables each time the workflow is read (core/final_check.py)
        from workflow_scripts.core.final_check import check_published

        return check_published(argv[0])
    if stage == "parse":  # the checks rules/common.smk adds when snakemake reads the workflow (-n)
        from workflow_scripts.core.experiment_config import dataset_entries
        from workflow_scripts.data.split_names import check_local_splits
        from workflow_scripts.model.task_fit import check_masked_lm_models, check_vision_language_models

        config = load_config(argv[0])
        check_local_splits(dataset_entries(config), argv[0])
        check_masked_lm_models(config, argv[0])
        check_vision_language_models(config, argv[0])
        from workflow_scripts.checks.lora_targets import check_lora_targets

        return check_lora_targets(config, argv[0])
    return importlib.import_module(f"workflow_scripts.{stage}").main(argv)


# --- fixtures: one set of tiny inputs for the module, a fresh workspace per case ---
@dataclass
class Shared:
    model: Path          # prepared tiny model with a tokenizer (vocabulary 294)
    data: Path           # normalised data: train (8 rows), validation, test (4 rows)
    tok: Path            # data pre-tokenised for ``model``
    test_only: Path      # normalised data with a test split only
    duplicate_ids: Path  # normalised data whose test split repeats an id
    tiny_model: Path     # conftest's tiny Llama: vocabulary 128, no tokenizer
    tiny_tok: Path       # conftest's tiny token data (vocabulary 128, another "tokenizer")
    other_adapter: Path  # a LoRA adapter made for ``tiny_model``, not for ``model``


@pytest.fixture(scope="module")
def shared(tmp_path_factory, tiny_model_dir, tiny_tokenised_dir) -> Shared:
    import torch
    from datasets import Dataset, DatasetDict

    from workflow_scripts import prepare_model, pretokenise

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("bad_inputs")
    rows = [{"id": f"r{i}", "question": f"what is {i} plus {i}?", "answers": [str(2 * i)]} for i in range(12)]
    DatasetDict({"train": Dataset.from_list(rows[:8]), "validation": Dataset.from_list(rows[8:10]),
                 "test": Dataset.from_list(rows[8:])}).save_to_disk(str(root / "data"))
    DatasetDict({"test": Dataset.from_list(rows[8:])}).save_to_disk(str(root / "test_only"))
    DatasetDict({"test": Dataset.from_list([{**rows[0], "id": "x"}, {**rows[1], "id": "x"}])}).save_to_disk(
        str(root / "duplicate_ids"))
    for name in ("data", "test_only", "duplicate_ids"):  # what normalise writes beside the rows
        (root / name / "task_meta.json").write_text(json.dumps({"task": "generation"}))
    tiny = {"name": "tiny", "source": "tiny", "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                                                      "num_heads": 2, "vocab_size": 300, "seed": 0}}
    assert prepare_model.main(["--model", json.dumps(tiny), "--out", str(root / "model"),
                               "--corpus", str(root / "data")]) == 0
    assert pretokenise.main(["--model", str(root / "model"), "--data", str(root / "data"), "--task", "generation",
                             "--variant", json.dumps(BASELINE), "--max-length", "64", "--out", str(root / "tok"),
                             "--report", str(root / "tok_report.json")]) == 0
    return Shared(root / "model", root / "data", root / "tok", root / "test_only", root / "duplicate_ids",
                  tiny_model_dir, tiny_tokenised_dir, build_adapter(tiny_model_dir, root / "other_adapter"))


def build_adapter(model_dir: Path, directory: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(directory)
    return directory


@dataclass
class Workspace:
    tmp: Path
    shared: Shared

    @property
    def out(self) -> Path:  # every output of the stage goes below here
        return self.tmp / "out"

    @property
    def raw(self) -> Path:
        return self.tmp / "raw"

    @property
    def config(self) -> Path:
        return self.tmp / "config.yaml"

    @property
    def results(self) -> Path:
        return self.tmp / "results"

    def paths(self) -> dict[str, str]:
        s = self.shared
        return {"tmp": self.tmp, "out": self.out, "raw": self.raw, "source": self.tmp / "source", "config": self.config, "results": self.results,
                "model": s.model, "data": s.data, "tok": s.tok, "test_only": s.test_only,
                "duplicate_ids": s.duplicate_ids, "tiny_model": s.tiny_model, "tiny_tok": s.tiny_tok,
                "other_adapter": s.other_adapter, "tok_copy": self.tmp / "tok_copy",
                "model_copy": self.tmp / "model_copy"}

    def substitute(self, text: str, regex: bool = False) -> str:
        """``{name}`` of a workspace path -> the path (other braces are left alone)."""
        for name, path in self.paths().items():
            placeholder = re.escape("{" + name + "}") if regex else "{" + name + "}"
            text = text.replace(placeholder, re.escape(str(path)) if regex else str(path))
        return text


@pytest.fixture
def workspace(tmp_path, shared) -> Workspace:
    return Workspace(tmp_path, shared)


# --- setups: each returns ``setup(w) -> argv`` ---
def argument(w: Workspace, value: Any) -> str:
    """A command-line value: text (workspace paths substituted), or JSON for anything else."""
    if callable(value):
        value = value(w)
    if isinstance(value, (str, Path)):
        return w.substitute(str(value))
    return w.substitute(json.dumps(without_dropped(value)))


def without_dropped(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_dropped(v) for k, v in value.items() if v is not DROP}
    return value


def command(defaults: Callable[[Workspace], dict], changes: dict | None, plant: Callable | None):
    def setup(w: Workspace) -> list[str]:
        if plant is not None:
            plant(w)
        flags = {**defaults(w), **(changes or {})}
        argv = []
        for flag, value in flags.items():
            if value is DROP:
                continue
            argv += [flag] if value is True else [flag, argument(w, value)]
        return argv
    return setup


# config
def cfg(dotted: str, value: Any, base: Callable[[], dict] = single_model_config):
    """The demo config (one model's, or ``base()``) with ``value`` at ``dotted`` (DROP deletes the key), written
    to {config}."""
    def setup(w: Workspace) -> list[str]:
        config = base()
        *parents, last = dotted.split(".")
        node = config
        for part in parents:
            node = node[part]
        if value is DROP:
            del node[last]
        else:
            node[last] = copy.deepcopy(value)
        w.config.write_text(yaml.safe_dump(config))
        return [str(w.config)]
    return setup


def cfg_text(text: str):
    return cfg_bytes(text.encode())


def cfg_bytes(data: bytes):
    def setup(w: Workspace) -> list[str]:
        w.config.write_bytes(data)
        return [str(w.config)]
    return setup


# data files for normalise


def dataset_settings(w: Workspace, fmt: str = "jsonl", **changes) -> dict:
    return {"source": {"type": "local", "path": str(w.tmp / "source")}, "format": fmt,
            "splits": {"train": "train", "test": "test"}, "fields": {"question": "q", "answers": "a"},
            "metric": "exact_match", **changes}


def normalise_args(changes: dict | None = None, fmt: str = "jsonl", settings: dict | None = None,
                   plant: Callable | None = None):
    return command(lambda w: {"--name": "d", "--dataset": dataset_settings(w, fmt, **(settings or {})),
                              "--raw": str(w.raw), "--out": str(w.out / "normalised"),
                              "--report": str(w.out / "normalise_report.json")}, changes, plant)


def source_files(*names: str, settings: dict | None = None):
    """download from a local source holding ``names`` (one good row each), the default splits expected."""
    def plant(w: Workspace) -> None:
        for name in names:
            write_jsonl(w.tmp / "source" / name, [{"q": "x?", "a": "1"}])
    return command(lambda w: {"--name": "d", "--dataset": {**dataset_settings(w), "splits": {"train": "train", "validation": "validation", "test": "test"}, **(settings or {})},
                              "--out": "{out}/raw", "--manifest": "{out}/download_manifest.json"}, None, plant)


def rows(bad: Any = None, copies: int = 1, good: int = 9, ids: bool = False, extra: bool = False,
         flat: bool = False, settings: dict | None = None):
    """train.jsonl: ``good`` good rows with ``copies`` of ``bad`` from row 5 on (or last, with fewer good rows)."""
    def row(i: int) -> dict:
        if flat:
            return {"id": f"r{i}", "q": [f"question {i}?"], "a": [f"answer {i}"]}
        value = {"q": f"question {i}?", "a": f"answer {i}"}
        if ids:
            value["id"] = f"r{i}"
        if extra:
            value["img"] = f"p{i}.png"
        return value

    good_rows = [row(i) for i in range(good)]
    train = good_rows[:5] + ([bad] * copies if bad is not None else []) + good_rows[5:]
    test = [row(100)]
    changes = dict(settings or {})
    if ids or flat:
        changes["fields"] = {"id": "id", "question": "q", "answers": "a"}
    if extra:
        changes["extra_fields"] = {"image": "img"}
    if flat:
        changes["flatten"] = True

    def plant(w: Workspace) -> None:
        write_jsonl(w.raw / "train.jsonl", train)
        write_jsonl(w.raw / "test.jsonl", test)
    return normalise_args(settings=changes, plant=plant)


BERT_CONFIG = json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 300, "hidden_size": 32,
                          "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}).encode()


def output_under_a_file(setup: Callable, flag: str, value: str):
    """``setup``'s argv with ``flag`` set to ``value``, a path under {tmp}/afile, which is a plain file."""
    def wrapped(w: Workspace) -> list[str]:
        argv = setup(w)
        (w.tmp / "afile").write_text("not a folder\n")
        argv[argv.index(flag) + 1] = w.substitute(value)
        return argv
    return wrapped


def unlabelled_ids(test_ids: list[str]):
    """An unlabelled test split (no answers) with ``test_ids``, submitted with submission.id_type: integer."""
    settings = {"fields": {"id": "id", "question": "q", "answers": "a"}, "unlabelled": ["test"],
                "splits": {"train": "train", "test": "test"}, "submission": {"id_type": "integer"}}

    def plant(w: Workspace) -> None:
        write_jsonl(w.raw / "train.jsonl", [{"id": f"r{i}", "q": f"question {i}?", "a": f"answer {i}"} for i in range(9)])
        write_jsonl(w.raw / "test.jsonl", [{"id": row_id, "q": "which?"} for row_id in test_ids])
    return normalise_args(settings=settings, plant=plant)


def csv_rows(bad_line: str | None = None, header: str = "q,a"):
    """train.csv: a header and nine good lines, with ``bad_line`` as row 5."""
    lines = [f"question {i}?,answer {i}" for i in range(9)]
    lines[5:5] = [bad_line] if bad_line is not None else []

    def plant(w: Workspace) -> None:
        w.raw.mkdir(parents=True, exist_ok=True)
        (w.raw / "train.csv").write_text("\n".join([header, *lines]) + "\n")
        (w.raw / "test.csv").write_text("q,a\nx?,1\n")
    return normalise_args(fmt="csv", plant=plant)


def raw_file(name: str, data: bytes | Callable[[], bytes], fmt: str = "jsonl"):
    """``name`` holding ``data`` (or what ``data()`` returns) in the raw directory, beside a good test split."""
    def plant(w: Workspace) -> None:
        w.raw.mkdir(parents=True, exist_ok=True)
        (w.raw / name).write_bytes(data() if callable(data) else data)
        test = {"jsonl": b'{"q": "x?", "a": "1"}\n', "json": b'[{"q": "x?", "a": "1"}]', "csv": b"q,a\nx?,1\n"}.get(fmt)
        if test is not None:
            (w.raw / f"test.{fmt}").write_bytes(test)
        else:  # parquet
            import pandas as pd

            pd.DataFrame({"q": ["x?"], "a": ["1"]}).to_parquet(w.raw / "test.parquet")
    return normalise_args(fmt=fmt, plant=plant)


# split layouts (data/split_layouts.py): an image folder, a split's several files
IMAGEFOLDER = {"task": "vision_language", "fields": {"question": "query", "answers": "label", "image": "file_name"}}


def image_folder(bad_row: dict | None = None, bad_file: tuple[str, bytes] | None = None, **changes):
    """{source}/train and {source}/test as datasets' imagefolder ships them (metadata.jsonl, images in charts/),
    ``bad_row`` as train's line 6 (``bad_file``: a file planted beside the images). Returns normalise's argv
    over what download copied: the raw copy exactly as the rule leaves it."""
    from vlm_layouts import bar_chart_png

    def plant(w: Workspace) -> None:
        for split, n in (("train", 10), ("test", 2)):
            (w.tmp / "source" / split / "charts").mkdir(parents=True)
            rows = []
            for k in range(n):
                (w.tmp / "source" / split / "charts" / f"{k}.png").write_bytes(bar_chart_png([k + 1, 3, len(split)]))
                rows.append({"file_name": f"charts/{k}.png", "query": f"How tall is bar {k} of {split}?", "label": str(k)})
            if split == "train" and bad_row is not None:
                rows.insert(5, bad_row)
            write_jsonl(w.tmp / "source" / split / "metadata.jsonl", rows)
        if bad_file is not None:
            (w.tmp / "source" / "train" / bad_file[0]).write_bytes(bad_file[1])
    settings = {**IMAGEFOLDER, **changes}
    settings["source"] = {"layout": "imagefolder", **changes.get("source", {})}
    return downloaded(plant, settings)


def downloaded(plant: Callable, changes: dict):
    """download of a local source at {source} planted by ``plant``, then normalise's argv over its raw copy."""
    def setup(w: Workspace) -> list[str]:
        from workflow_scripts import download

        plant(w)
        settings = dataset_settings(w, **{k: v for k, v in changes.items() if k != "source"})
        settings["source"] = {**settings["source"], **changes.get("source", {})}
        assert download.main(["--name", "d", "--dataset", json.dumps(settings), "--out", str(w.raw),
                              "--manifest", str(w.tmp / "download_manifest.json")]) == 0
        return normalise_args(settings={k: v for k, v in settings.items()})(w)
    return setup


def laid_out(files: dict[str, bytes], **changes):
    """download of a local source holding ``files`` (path under {source} -> bytes), with ``changes`` to its settings
    (``source`` merged into the source's)."""
    def plant(w: Workspace) -> None:
        for name, data in files.items():
            (w.tmp / "source" / name).parent.mkdir(parents=True, exist_ok=True)
            (w.tmp / "source" / name).write_bytes(data)

    def settings(w: Workspace) -> dict:
        base = dataset_settings(w, **{k: v for k, v in changes.items() if k != "source"})
        return {**base, "source": {**base["source"], **changes.get("source", {})}}
    return command(lambda w: {"--name": "d", "--dataset": settings(w), "--out": "{out}/raw",
                              "--manifest": "{out}/download_manifest.json"}, None, plant)


ROW = b'{"q": "x?", "a": "1"}\n'


def absolute_single_model_config() -> dict:
    """single_model_config with absolute source paths (the parse-time checks read the source folders)."""
    config = single_model_config()
    for dataset in config["datasets"].values():
        if dataset["source"]["type"] == "local":
            dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
    return config


def absolute_demo_config() -> dict:
    from test_dag import absolute_demo_config as demo

    return demo()


def parquet_bytes(n: int = 100) -> bytes:
    """A good Parquet file of ``n`` rows, as bytes."""
    import io

    import pandas as pd

    buffer = io.BytesIO()
    pd.DataFrame({"q": [f"question {i}?" for i in range(n)], "a": [f"answer {i}" for i in range(n)]}).to_parquet(buffer)
    return buffer.getvalue()


# pretokenise, evaluate, sanity, train, prepare_model
def pretok(changes: dict | None = None, plant: Callable | None = None):
    return command(lambda w: {"--model": "{model}", "--data": "{data}", "--task": "generation", "--variant": BASELINE,
                              "--max-length": "64", "--out": "{out}/tokenised", "--report": "{out}/tokenise_report.json"},
                   changes, plant)


def evaluate_(changes: dict | None = None, plant: Callable | None = None):
    return command(lambda w: {"--model": "{model}", "--data": "{data}", "--task": "generation", "--variant": BASELINE,
                              "--metric": "exact_match", "--evaluation": EVALUATION, "--dataset-name": "d",
                              "--variant-name": "baseline", "--seed": "1", "--predictions-out": "{out}/predictions.jsonl",
                              "--summary-out": "{out}/eval.json"}, changes, plant)


def training(**changes) -> dict:
    """Valid tiny training settings (schema defaults filled) with ``changes`` merged in, unchecked."""
    settings = tiny_training_settings().to_dict()
    for key, value in changes.items():
        settings[key] = {**settings[key], **value} if isinstance(value, dict) else value
    return settings


def gate(changes: dict | None = None, plant: Callable | None = None):
    return command(lambda w: {"--model": "{model}", "--data": "{tok}", "--training": training(), "--seed": "1",
                              "--out": "{out}/sanity.json"}, changes, plant)


def train_(changes: dict | None = None, plant: Callable | None = None):
    return command(lambda w: {"--model": "{model}", "--data": "{tok}", "--training": training(), "--seed": "1",
                              "--checkpoint-dir": "{tmp}/checkpoints", "--adapter-out": "{out}/adapter",
                              "--log-out": "{out}/train_log.jsonl", "--manifest-out": "{out}/run_manifest.json"},
                   changes, plant)


def prepare_(changes: dict | None = None, plant: Callable | None = None):
    return command(lambda w: {"--model": {"name": "m", "source": "local", "path": "{tmp}/source_model"},
                              "--out": "{out}/model"}, changes, plant)


def prepare_local(without: tuple[str, ...] = (), extra: dict[str, bytes] | None = None):
    """prepare_model from a local copy of the tiny model lacking ``without`` (plus ``extra`` files)."""
    return prepare_(plant=copy_model(without, extra or {}, name="source_model"))


def copy_model(without: tuple[str, ...] = (), replace: dict[str, bytes] | None = None, name: str = "model_copy"):
    def plant(w: Workspace) -> None:
        target = w.tmp / name
        shutil.copytree(w.shared.model, target, ignore=shutil.ignore_patterns(*without, "model_manifest.json"))
        for file, data in (replace or {}).items():
            (target / file).write_bytes(data)
    return plant


def classifier_and_data(labels: list[str]):
    """A LoRA classifier of ``model`` trained on [negative, positive] (``tmp/classifier``, saved as train saves
    it) and normalised classification data declaring ``labels`` (``tmp/three_classes``)."""
    def plant(w: Workspace) -> None:
        import torch
        from datasets import Dataset, DatasetDict
        from peft import LoraConfig, get_peft_model

        from workflow_scripts.model import model_loading
        from workflow_scripts.tasks.classification import TASK

        trained = {"labels": ["negative", "positive"]}
        base = model_loading.load_base_model(w.shared.model, torch.device("cpu"), auto_class=TASK.auto_model_class,
                                             model_kwargs=TASK.model_kwargs(trained))
        TASK.prepare_model(base, model_loading.load_tokenizer(w.shared.model).pad_token_id, trained)
        model_loading.save_adapter(get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["score"],
                                                                   task_type=TASK.peft_task_type)), w.tmp / "classifier")
        rows = [{"id": f"r{i}", "text": f"review {i}", "label": labels[i % len(labels)]} for i in range(6)]
        DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows)}).save_to_disk(str(w.tmp / "three_classes"))
        (w.tmp / "three_classes" / "task_meta.json").write_text(json.dumps({"task": "classification", "labels": labels}))
    return plant


def masked_lm_corpus(w: Workspace) -> None:
    """{tmp}/corpus: normalised masked-LM lines (train and test), as normalise writes them."""
    from datasets import Dataset, DatasetDict

    lines = [{"id": f"line-{i}", "text": f"the cat sat on mat number {i}"} for i in range(6)]
    DatasetDict({"train": Dataset.from_list(lines), "test": Dataset.from_list(lines)}).save_to_disk(str(w.tmp / "corpus"))
    (w.tmp / "corpus" / "task_meta.json").write_text(json.dumps({"task": "masked_lm"}))


def mkdir(name: str):
    return lambda w: (w.tmp / name).mkdir(parents=True)


def put(relative: str, text: str):
    """Write ``text`` to tmp/relative; a ``tok_copy/...`` path first copies the token data there."""
    def plant(w: Workspace) -> None:
        path = w.tmp / relative
        if relative.startswith("tok_copy/"):
            shutil.copytree(w.shared.tok, w.tmp / "tok_copy")
        if relative.startswith("results/"):
            build_results(w)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return plant


def edit_meta(**changes):
    def plant(w: Workspace) -> None:
        shutil.copytree(w.shared.tok, w.tmp / "tok_copy")
        path = w.tmp / "tok_copy" / "tokenise_meta.json"
        meta = json.loads(path.read_text())
        meta = without_dropped({**meta, **changes})
        path.write_text(json.dumps(meta))
    return plant


def drop_column(column: str):
    def plant(w: Workspace) -> None:
        from datasets import load_from_disk

        shutil.copytree(w.shared.tok, w.tmp / "tok_copy", ignore=shutil.ignore_patterns("train"))
        load_from_disk(str(w.shared.tok / "train")).remove_columns(column).save_to_disk(str(w.tmp / "tok_copy" / "train"))
    return plant


# compare: the synthetic results of tests/test_compare.py (2 seeds x baseline/mtup, plus base runs)

SCORES = {("baseline", 1): 10, ("mtup", 1): 16, ("baseline", 2): 12, ("mtup", 2): 18}


def build_results(w: Workspace) -> Path:
    if not w.results.exists():
        for (variant, seed), k in SCORES.items():
            write_experiment(w.results, "chart", variant, seed, correct(k))
        write_experiment(w.results, "chart", "baseline", "base", correct(2))
        write_experiment(w.results, "chart", "mtup", "base", correct(1))
    return w.results


def compare_(changes: dict | None = None, plant: Callable | None = None):
    def results_then_plant(w: Workspace) -> None:
        build_results(w)
        if plant is not None:
            plant(w)
    return command(lambda w: {"--results-dir": "{results}", "--experiments": EXPERIMENTS, "--comparison": COMPARISON,
                              "--with-base": True, "--out-csv": "{out}/comparison.csv",
                              "--out-markdown": "{out}/comparison.md", "--plots-dir": "{out}/plots"},
                   changes, results_then_plant)


def patch_json(relative: str, **fields):
    def plant(w: Workspace) -> None:
        path = w.results / relative
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return plant


def patch_line(relative: str, index: int, **fields):
    def plant(w: Workspace) -> None:
        path = w.results / relative
        lines = path.read_text().splitlines()
        lines[index] = json.dumps({**json.loads(lines[index]), **fields})
        path.write_text("\n".join(lines) + "\n")
    return plant


def append(relative: str, text: str):
    def plant(w: Workspace) -> None:
        with open(w.results / relative, "a") as handle:
            handle.write(text)
    return plant


def delete(relative: str):
    return lambda w: (w.results / relative).unlink()


def rerun(variant: str, seed: int, scores: list | None = None, training_change: dict | None = None):
    """Rewrite one experiment's outputs (other scores, or training settings that differ)."""
    def plant(w: Workspace) -> None:
        write_experiment(w.results, "chart", variant, seed, scores or correct(SCORES[variant, seed]),
                         training={**TRAINING, **(training_change or {})})
    return plant


# --- formats (issue 37): setups ---
def gzip_bytes(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


def penman_blocks(bad_block: str):
    """train.txt in PENMAN text: a header comment, nine good blocks (ids a0..a8, 4 lines each), ``bad_block`` as the
    6th graph (block 6)."""
    blocks = [f"# ::id a{k}\n# ::snt Sentence {k}.\n(s / sleep-01\n   :ARG0 (b / boy{k}))" for k in range(9)]
    blocks.insert(5, bad_block)

    def plant(w: Workspace) -> None:
        w.raw.mkdir(parents=True, exist_ok=True)
        (w.raw / "train.txt").write_text("# AMR release (demo)\n\n" + "\n\n".join(blocks) + "\n")
        (w.raw / "test.txt").write_text("# ::id t1\n# ::snt A test.\n(t / test-01)\n")
    return normalise_args(fmt="penman", settings={"fields": {"id": "id", "question": "snt", "answers": "graph"},
                                                  "metric": "smatch"}, plant=plant)


def penman_file(train: bytes):
    """train.txt holding ``train`` (a good test.txt beside it), read as format: penman."""
    def plant(w: Workspace) -> None:
        w.raw.mkdir(parents=True, exist_ok=True)
        (w.raw / "train.txt").write_bytes(train)
        (w.raw / "test.txt").write_text("# ::id t1\n# ::snt A test.\n(t / test-01)\n")
    return normalise_args(fmt="penman", settings={"fields": {"id": "id", "question": "snt", "answers": "graph"},
                                                  "metric": "smatch"}, plant=plant)


def graph_rows(bad_graph: str):
    """train.jsonl of sentences and AMR graphs (metric smatch, no derived field), ``bad_graph`` as row 5 (line 6)."""
    def plant(w: Workspace) -> None:
        rows = [{"q": f"The boy {i} sleeps.", "a": f"(s / sleep-01 :ARG0 (b / boy{i}))"} for i in range(9)]
        rows.insert(5, {"q": "The boy sleeps.", "a": bad_graph})
        write_jsonl(w.raw / "train.jsonl", rows)
        write_jsonl(w.raw / "test.jsonl", [{"q": "A dog runs.", "a": "(r / run-02 :ARG0 (d / dog))"}])
    return normalise_args(settings={"metric": "smatch"}, plant=plant)


def penman_rejected(reason: str, field: str | None, detail: str) -> str:
    """normalise's message for one bad block among ten: the 6th graph, block 6 of train.txt (its header comment is no
    graph), starts on line 28."""
    where = "{source}/train.txt block 6 (line 28): " + (f"field '{field}': " if field else "")
    return ("{source}/train.txt: 1 of 10 rows of split 'train' rejected (10.0%), more than "
            f"datasets.d.max_rejected_fraction = 0.01; reasons: {reason} 1; for example {where}{detail}; "
            "fix the rows or raise datasets.d.max_rejected_fraction")


def labels_csv(labels: list[str], declared: list[str] | None, test_label: str = "1"):
    """A classification train.csv with ``labels`` (line k + 2 holds labels[k]) and ``labels:`` ``declared``; its
    test.csv's one row is labelled ``test_label``."""
    def plant(w: Workspace) -> None:
        w.raw.mkdir(parents=True, exist_ok=True)
        (w.raw / "train.csv").write_text("text,label\n" + "".join(f"sentence {i},{label}\n" for i, label in enumerate(labels)))
        (w.raw / "test.csv").write_text(f"text,label\na test,{test_label}\n")
    settings = {"task": "classification", "fields": {"text": "text", "label": "label"}, "metric": "accuracy",
                **({"labels": declared} if declared else {})}
    return normalise_args(fmt="csv", settings=settings, plant=plant)


def float_labels():
    """A classification train.jsonl whose every label is a float (0.0, 1.0)."""
    def plant(w: Workspace) -> None:
        write_jsonl(w.raw / "train.jsonl", [{"text": f"sentence {i}", "label": float(i % 2)} for i in range(4)])
        write_jsonl(w.raw / "test.jsonl", [{"text": "a test", "label": 1}])
    return normalise_args(settings={"task": "classification", "fields": {"text": "text", "label": "label"},
                                    "metric": "accuracy"}, plant=plant)


def classlabel_parquet(ids: list[int], names: tuple[str, ...] = ("neg", "pos"), declared: list[str] | None = None):
    """train.parquet as datasets exports a ClassLabel column (``names``, default neg, pos: the schema's
    ``huggingface`` metadata), holding ``ids`` (written with pyarrow: datasets itself refuses an id outside the
    names); ``labels:`` ``declared`` when given."""
    def plant(w: Workspace) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        w.raw.mkdir(parents=True, exist_ok=True)
        features = {"text": {"dtype": "string", "_type": "Value"}, "label": {"names": list(names), "_type": "ClassLabel"}}
        for split, values in (("train", ids), ("test", [1])):
            table = pa.table({"text": [f"{split} sentence {i}" for i in range(len(values))],
                              "label": pa.array(values, pa.int64())})
            pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}),
                           w.raw / f"{split}.parquet")
    return normalise_args(fmt="parquet", settings={"task": "classification", "metric": "accuracy",
                                                   "fields": {"text": "text", "label": "label"},
                                                   **({"labels": declared} if declared else {})}, plant=plant)


def tool_turn_conversation():
    """A conversation train.jsonl whose row 5 holds a tool turn (role tool) after the assistant's call."""
    def chat(i: int, tool: bool = False) -> dict:
        middle = [{"role": "assistant", "content": "calling"}, {"role": "tool", "content": "12 C"}] if tool else []
        return {"messages": [{"role": "user", "content": f"question {i}?"}, *middle,
                             {"role": "assistant", "content": f"answer {i}"}]}

    def plant(w: Workspace) -> None:
        write_jsonl(w.raw / "train.jsonl", [chat(i, tool=i == 5) for i in range(10)])
        write_jsonl(w.raw / "test.jsonl", [chat(100)])
    return normalise_args(settings={"task": "conversation", "fields": {"messages": "messages"}}, plant=plant)


def text_corpus(train: bytes, test: bytes, **settings):
    """A masked-LM corpus: train.txt and test.txt holding these bytes."""
    def plant(w: Workspace) -> None:
        w.raw.mkdir(parents=True, exist_ok=True)
        (w.raw / "train.txt").write_bytes(train)
        (w.raw / "test.txt").write_bytes(test)
    return normalise_args(fmt="text", settings={"task": "masked_lm", "fields": {}, "metric": "masked_accuracy",
                                                **settings}, plant=plant)


def two_files(train: bytes, test: bytes, fmt: str = "jsonl"):
    """train.<fmt> and test.<fmt> holding these bytes."""
    def plant(w: Workspace) -> None:
        w.raw.mkdir(parents=True, exist_ok=True)
        (w.raw / f"train.{fmt}").write_bytes(train)
        (w.raw / f"test.{fmt}").write_bytes(test)
    return normalise_args(fmt=fmt, plant=plant)


def utf16_corpus():
    """Both splits UTF-16 with a byte-order mark; following the old advice (reject_row) must not keep them."""
    lines = "\n".join(f"line {i} on the mat" for i in range(50)).encode("utf-16")
    return text_corpus(lines, lines, on_invalid_text="reject_row")


def overlapping_splits():
    """Validation and test each repeat a train row."""
    def plant(w: Workspace) -> None:
        write_jsonl(w.raw / "train.jsonl", [{"q": f"question {i}?", "a": "1"} for i in range(10)])
        write_jsonl(w.raw / "validation.jsonl", [{"q": "question 1?", "a": "1"}])
        write_jsonl(w.raw / "test.jsonl", [{"q": "question 2?", "a": "1"}])
    return normalise_args(settings={"splits": {"train": "train", "validation": "validation", "test": "test"}}, plant=plant)


def relative_raw(setup: Callable):
    """``setup``'s argv with --raw relative to the working directory, as the rules give it (results/data/<ds>/raw)."""
    import os

    def wrapped(w: Workspace) -> list[str]:
        argv = setup(w)
        index = argv.index("--raw") + 1
        argv[index] = os.path.relpath(argv[index])
        return argv
    return wrapped


# --- issue 43: text formats, encodings, compression: setups ---
TEST_SPLITS = {"jsonl": b'{"q": "held out?", "a": "1"}\n', "tsv": b"q\ta\nheld out?\t1\n", "csv": b"q,a\nheld out?,1\n"}


def text_files(files: dict[str, bytes], fmt: str = "jsonl", **settings):
    """normalise over raw files ``files`` (name -> bytes) and a good test split, with ``settings`` changed."""
    def plant(w: Workspace) -> None:
        w.raw.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (w.raw / name).write_bytes(data)
        (w.raw / f"test.{fmt}").write_bytes(TEST_SPLITS[fmt])
    return normalise_args(fmt=fmt, settings=settings, plant=plant)


def parquet_amr_config() -> dict:
    config = single_model_config()
    config["datasets"]["amr_demo"]["format"] = "parquet"
    return config


def hub_amr_config() -> dict:
    config = single_model_config()
    config["datasets"]["amr_demo"]["source"] = {"type": "hub", "id": "org/amr", "revision": "0" * 40}
    return config


def cut_stream(kind: str) -> bytes:
    """4000 JSON lines of incompressible text (several zstd blocks), compressed and cut at two thirds."""
    import gzip
    import random

    import zstandard

    rng = random.Random(0)
    data = b"".join(b'{"q": "%x?", "a": "%d"}\n' % (rng.getrandbits(128), i) for i in range(4000))
    packed = gzip.compress(data) if kind == "gzip" else zstandard.ZstdCompressor().compress(data)
    return packed[: len(packed) * 2 // 3]


# --- issue 43: readers against their references, round 2: setups ---
PADDED = ("label %s is not a declared name, and a number written with a leading zero or a sign is not read as a class id "
          "(datasets' ClassLabel would read it as %s: a numbering from 01 read one class off); to read the values by "
          "name declare them as the rows write them (labels: [%s, ...]), or write the class ids 0..%d without leading zeros")


# --- issue 43 follow-up: readers, round 3 (readers3): setups ---
CLASSLABEL_NAMES = ("label %s (class id %d of the source's ClassLabel names ['01', '02', '03']) is not a declared label: "
                    "labels: ['1', '2', '3'] writes the same numbers otherwise (01 -> 1, 02 -> 2, 03 -> 3), and a "
                    "ClassLabel's names are matched as written; declare labels: exactly as the ClassLabel names them "
                    "(['01', '02', '03']), or drop labels: to use the ClassLabel's names")


# --- issue 44: setups ---
def edited_comparison_table(w: Workspace) -> list[str]:
    """results/comparison.md as compare wrote it (its sha256 in the experiment set's stamp), then edited by hand."""
    import hashlib

    table = w.results / "comparison.md"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text("| variant | score |\n|---|---|\n| mtup | 0.41 |\n")
    stamp = w.results / "experiment_set.json"
    stamp.write_text(json.dumps({"published": {str(table): hashlib.sha256(table.read_bytes()).hexdigest()}}))
    table.write_text("| variant | score |\n|---|---|\n| mtup (best) | 0.41 |\n")
    return [str(stamp)]


def power_on_untrained_loss(threshold: float):
    """The power stage on an untrained masked LM whose mean loss is 6.75 nats on each of 10 test lines."""
    def plant(w: Workspace) -> None:
        base = w.tmp / "base"
        base.mkdir()
        (base / "eval.json").write_text(json.dumps({"metric": "mlm_loss", "n_examples": 10, "score": 6.75}))
        (base / "predictions.jsonl").write_text("".join(json.dumps({"id": f"l{i}", "counts": [13.5, 2]}) + "\n"
                                                        for i in range(10)))
    return command(lambda w: {"--model-name": "tiny-bert", "--dataset-name": "corpus", "--base": "mlm={tmp}/base",
                              "--comparison": {"min_detectable_effect": threshold},
                              "--out-json": "{out}/power.json", "--out-markdown": "{out}/power.md"}, None, plant)


def model_without_eos(w: Workspace) -> None:
    """{model_copy}: the tiny model whose tokenizer sets no EOS token."""
    copy_model()(w)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = w.tmp / "model_copy" / name
        if path.exists():
            settings = json.loads(path.read_text())
            settings.pop("eos_token", None)
            path.write_text(json.dumps(settings))


def power_report_of_72_examples(w: Workspace) -> None:
    """{tmp}/power.json as the power rule writes it: 72 test examples the untrained model gets all wrong."""
    from workflow_scripts.analysis import power

    estimate = power.estimate("chartqa_demo", "tiny-llama", "exact_match", {"baseline": [{"score": 0.0}] * 72})
    (w.tmp / "power.json").write_text(json.dumps({**estimate.to_dict(), "min_detectable_effect": None}))


# --- the tests (last: the table needs the helpers above) ---
@pytest.mark.parametrize("setup, stage, expected", table())
def test_bad_input_ends_in_one_message_naming_it_and_leaves_no_output(workspace, setup, stage, expected):
    argv = setup(workspace)
    with pytest.raises(WorkflowError) as caught:
        call(stage, argv)
    message = str(caught.value)
    assert "\n" not in message, f"message spans {message.count(chr(10)) + 1} lines: {message!r}"
    if isinstance(expected, Regex):
        pattern = workspace.substitute(expected.pattern, regex=True)
        assert re.fullmatch(pattern, message), f"GOT: {message}"
    else:
        assert message == workspace.substitute(expected), f"GOT: {message}"
    assert not [path for path in declared_outputs(argv) if path.exists()], "a failed stage left an output behind"
    assert leftovers(workspace.out) == [], "a failed stage left something (a '.partial' too) where its outputs go"


# One row per stage module, run as the rules run it: exit code 2 and the message as the last line of stderr.
AS_COMMANDS = ["data-missing-field", "cli-pretokenise-variant-bad-json", "cli-compare-eval-json-for-another-seed",
               "model-local-model-without-config", "cli-train-data-not-tokenised", "cli-sanity-seed-not-a-number"]


@pytest.mark.parametrize("setup, stage, expected", [row for row in table() if row.id in AS_COMMANDS])
def test_as_a_command_it_exits_2_with_the_message_as_the_last_line(workspace, setup, stage, expected):
    argv = setup(workspace)
    done = subprocess.run([sys.executable, "-m", f"workflow_scripts.{stage}", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == "error: " + workspace.substitute(expected)
    assert leftovers(workspace.out) == []


def test_the_table_has_unique_ids_and_covers_every_family():
    ids = [row.id for row in table()]
    assert len(ids) == len(set(ids)) and len(ids) >= 60
    assert {i.split("-")[0] for i in ids} == {"config", "data", "cli", "model"}

