"""Typed training settings (core/settings.py): validated once, read by attribute everywhere below the stages."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.core.section_settings import (ComparisonSettings, EvaluationSettings, MixtureSettings,
                                                     TrackingSettings)
from workflow_scripts.core.settings import LoraSettings, QuantizationSettings, TrainingSettings, ValidationSettings

REPO = Path(__file__).resolve().parent.parent


def test_defaults_come_from_the_schema_and_round_trip():
    settings = TrainingSettings.parse({"max_steps": 5})
    assert settings.lora == LoraSettings() and settings.validation == ValidationSettings()
    assert settings.quantization is None and settings.precision == "bf16" and settings.effective_batch == 16
    assert (settings.world_size, settings.accumulation) == (1, 16)
    assert TrainingSettings.parse(settings.to_dict()) == settings
    assert settings.to_dict()["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]  # JSON lists
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.micro_batch = 2


def test_derived_values():
    settings = TrainingSettings.parse({"max_steps": 5, "effective_batch": 32, "micro_batch": 2, "gpus": 4, "nodes": 2})
    assert (settings.world_size, settings.accumulation) == (8, 2)
    cpu = TrainingSettings.parse({"epochs": 1.5, "effective_batch": 8, "micro_batch": 2, "cpu_processes": 2})
    assert (cpu.world_size, cpu.accumulation) == (2, 2)
    assert cpu.with_length(100).max_steps == 18 and cpu.with_length(60).max_steps == 11  # 12 or 7 a pass, x 1.5 rounded up
    assert TrainingSettings.parse({"max_steps": 5, "strategy": "fsdp"}).sharded
    assert TrainingSettings.parse({"max_steps": 5, "finetune": "full"}).full
    quantised = TrainingSettings.parse({"max_steps": 5, "quantization": {"bits": 8}})
    assert quantised.quantization == QuantizationSettings(bits=8, type="nf4", double_quant=True, compute_dtype=None)


@pytest.mark.parametrize("value, key, words", [
    ({"max_steps": 5, "micro_batch": 3}, "effective_batch", "not a multiple of micro_batch (3)"),
    ({}, "max_steps", "how long to train is not set"),
    ({"max_steps": 5, "epochs": 2}, "epochs", "keep one"),
    ({"max_steps": 5, "quantization": {"bits": 3}}, "quantization.bits", "not one of [4, 8]"),
    ({"max_steps": "five"}, "max_steps", "not of type"),
    ({"max_steps": 5, "lora": {"rank": 0}}, "lora.rank", "minimum"),
    ({"max_steps": 5, "learning_rte": 1e-4}, "training", "learning_rte"),
    ({"max_steps": 5, "warmup_steps": 5}, "warmup_steps", "would never leave warm-up"),
    ({"max_steps": 5, "validation": {"early_stopping_patience": 2}}, "validation.early_stopping_patience", "never stop early"),
    ({"max_steps": 5, "validation": {"keep": "best"}}, "validation.keep", "no best step to keep"),
    ({"max_steps": 5, "packing": True, "micro_batch": 1, "effective_batch": 4}, "packing", "would pack nothing"),
    ({"max_steps": 5, "max_length": 512, "micro_batch_tokens": 511}, "micro_batch_tokens",
     "below max_length (512), so an example of max_length tokens fits no micro-batch"),
    ({"max_steps": 5, "micro_batch_tokens": 4096, "effective_batch": 6, "cpu_processes": 4}, "effective_batch",
     "not a multiple of the 4 processes"),
    ({"max_steps": 5, "micro_batch_tokens": 0}, "micro_batch_tokens", "minimum"),
])
def test_each_refusal_names_the_key(value, key, words):
    with pytest.raises(ConfigError) as raised:
        TrainingSettings.parse(value, "variants.mtup.training", "config.yaml")
    message = str(raised.value)
    assert "variants.mtup.training" in message and key in message and words in message and "\n" not in message
    assert message.startswith("config.yaml")


def test_a_token_budget_replaces_micro_batch_in_the_batch_shape():
    """training.micro_batch_tokens: micro-batches are cut by tokens, so micro_batch need not divide the batch,
    packing needs no micro_batch above 1, and the accumulation is the plan's per step (None here)."""
    settings = TrainingSettings.parse({"max_steps": 5, "effective_batch": 6, "micro_batch": 4, "packing": True,
                                       "max_length": 256, "micro_batch_tokens": 256, "cpu_processes": 2})
    assert settings.micro_batch_tokens == 256 and settings.accumulation is None
    assert TrainingSettings.parse(settings.to_dict()) == settings
    assert TrainingSettings.parse({"max_steps": 5}).micro_batch_tokens is None  # default: micro_batch examples
    assert "micro_batch_tokens" not in schema_defaults()  # no schema default: configs without it rerun nothing


def schema_defaults() -> dict:
    """The training keys the schema fills in when a config leaves them out."""
    import yaml

    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    properties = schema["$defs"]["training_settings"]["properties"]
    return {key: spec["default"] for key, spec in properties.items() if "default" in spec}


def test_the_config_names_where_the_batch_shape_was_set():
    config = {"model": {"name": "m", "source": "tiny"}, "training": {"max_steps": 5, "effective_batch": 8},
              "variants": {"base": {"task": "generation"}, "big": {"task": "generation", "training": {"micro_batch": 3}},
                           "lr": {"task": "generation", "training": {"learning_rate": 1e-3, "max_steps": None}}}}
    assert xc.training_settings(config, "base").accumulation == 8
    with pytest.raises(ConfigError, match=r"'variants\.big\.training\.effective_batch'"):
        xc.training_settings(config, "big")
    with pytest.raises(ConfigError, match=r"'variants\.lr\.training\.max_steps'"):
        xc.training_settings(config, "lr")
    config["variants"]["budget"] = {"task": "generation", "training": {"micro_batch_tokens": 100}}
    with pytest.raises(ConfigError, match=r"'variants\.budget\.training\.micro_batch_tokens': 100 is below max_length"):
        xc.training_settings(config, "budget")


def test_nothing_below_the_config_reads_training_settings_as_a_dict():
    """One source of truth: the typed settings. A ``training["key"]`` or ``training.get(`` below the
    config layer would be a second reading of the settings with its own defaults."""
    dict_access = re.compile(r"\b(training|setup\.training)(\[\"|\[\'|\.get\()")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in sorted([*(REPO / "workflow_scripts").rglob("*.py"), *(REPO / "rules").glob("*.smk")])
             for number, line in enumerate(path.read_text().splitlines(), 1) if dict_access.search(line)]
    assert found == []


SECTION_DICT_ACCESS = re.compile(r"\b(evaluation|comparison|tracking|mlflow)(\[\"|\[\'|\.get\()")


def dict_reads_of_typed_sections(root: Path) -> list[str]:
    """Lines of the stages, the library and the rules that read a typed section (evaluation, comparison, tracking)
    as a mapping; the config layer reads ``config["evaluation"]`` once and parses it (core/section_settings.py)."""
    return [f"{path.relative_to(root)}:{number}: {line.strip()}"
            for path in sorted([*(root / "workflow_scripts").rglob("*.py"), *(root / "rules").glob("*.smk")])
            for number, line in enumerate(path.read_text().splitlines(), 1) if SECTION_DICT_ACCESS.search(line)]


def test_nothing_below_the_config_reads_the_evaluation_comparison_or_tracking_settings_as_a_dict():
    assert dict_reads_of_typed_sections(REPO) == []


MIXTURE_READERS = ("workflow_scripts/mix.py", "workflow_scripts/data/mixture.py")
MIXTURE_DICT_ACCESS = re.compile(r"\bsettings(\[\"|\[\'|\.get\()")


def test_the_mix_stage_reads_the_typed_mixture():
    """mix and data/mixture read ``MixtureSettings`` by attribute (their mixture is named ``settings``)."""
    found = [f"{relative}:{number}: {line.strip()}" for relative in MIXTURE_READERS
             for number, line in enumerate((REPO / relative).read_text().splitlines(), 1)
             if MIXTURE_DICT_ACCESS.search(line)]
    assert found == []
    assert MIXTURE_DICT_ACCESS.search('total = settings.get("rows") or sum(sizes.values())')


def test_mixture_settings_keep_the_fingerprinted_mapping():
    """mix fingerprints ``to_dict()``: for what the rule passes (the entry with its defaults) it is that mapping."""
    passed = {"datasets": ["a", "b"], "weights": {"a": 2, "b": 1}, "rows": None, "seed": 0}
    settings = MixtureSettings.parse(passed)
    assert settings.to_dict() == passed and settings.temperature is None and settings.max_passes is None
    assert MixtureSettings.parse({"datasets": ["a", "b"]}).to_dict() == {"datasets": ["a", "b"], "rows": None, "seed": 0}
    with pytest.raises(ConfigError, match=r"^--settings: config key 'mixtures.both.datasets': \['a'\] is too short"):
        MixtureSettings.from_json('{"datasets": ["a"]}', "both")


def test_the_section_guard_catches_a_planted_dict_read(tmp_path):
    for relative, line in (("workflow_scripts/compare.py", 'seed = comparison["bootstrap_seed"]'),
                           ("workflow_scripts/tasks/generation.py", 'size = evaluation["batch_size"]'),
                           ("workflow_scripts/training/trackers.py", 'uri = tracking.get("mlflow")'),
                           ("rules/common.smk", 'name = mlflow["run_name"]')):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(f"{line}\nok = comparison.bootstrap_seed\n")
    assert len(dict_reads_of_typed_sections(tmp_path)) == 4


def test_comparison_and_tracking_settings_are_typed_with_the_schemas_defaults_and_round_trip():
    comparison = ComparisonSettings.parse({"reference_variant": {"generation": "baseline"}})
    assert (comparison.bootstrap, comparison.bootstrap_resamples, comparison.intended_differences) == ("auto", 1000, ())
    assert comparison.reference_for("generation") == "baseline" and comparison.reference_for("masked_lm") is None
    assert ComparisonSettings.parse(comparison.to_dict()) == comparison
    assert list(comparison.to_dict()) == sorted(comparison.to_dict())  # as the rules pass it (as_json sorts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        comparison.bootstrap_seed = 1
    with pytest.raises(TypeError):
        comparison.reference_variant["generation"] = "other"  # read-only, as the rest
    tracking = TrackingSettings.parse({})
    assert tracking.mlflow.enabled is False and tracking.mlflow.experiment == "lora-experiments"
    assert TrackingSettings.parse(tracking.with_run("m", "d", "v", 1).to_dict()).run == {
        "model": "m", "dataset": "d", "variant": "v", "seed": 1}


def test_evaluation_settings_keep_the_record_the_rule_passes():
    """The manifests record ``to_dict()``: for what the rule passes (the section with its defaults, the split and
    max_length; dtype only when set) it is that mapping, so eval.json's record is as before."""
    passed = {"split": "validation", "max_new_tokens": 96, "batch_size": 32, "max_examples": None, "gpus": 0,
              "evaluate_base_model": True, "qlora_base": "quantised", "max_length": 64}
    evaluation = EvaluationSettings.parse(passed)
    assert evaluation.to_dict() == passed and list(evaluation.to_dict()) == sorted(passed)
    assert evaluation.compute_dtype == "auto" and EvaluationSettings.parse({**passed, "dtype": "fp32"}).compute_dtype == "fp32"
    assert EvaluationSettings.parse({"batch_size": 2}).max_length is None  # a task that needs it says so


@pytest.mark.parametrize("parse, value, key", [
    (EvaluationSettings.parse, {"split": "dev"}, "evaluation.split"),
    (EvaluationSettings.parse, {"max_length": 0}, "evaluation.max_length"),
    (ComparisonSettings.parse, {"bootstrap_resamples": 10}, "comparison.bootstrap_resamples"),
    (ComparisonSettings.parse, {"bootstrap": "seeds"}, "comparison.bootstrap"),
    (ComparisonSettings.parse, {"min_detectable_effect": 0}, "comparison.min_detectable_effect"),
    (TrackingSettings.parse, {"mlflow": {"enabled": "yes"}}, "tracking.mlflow.enabled"),
    (TrackingSettings.parse, {"mlflow": {"experiment": ""}}, "tracking.mlflow.experiment"),
])
def test_section_refusals_name_the_key(parse, value, key):
    with pytest.raises(ConfigError) as raised:
        parse(value, source="config.yaml")
    assert str(raised.value).startswith(f"config.yaml: config key '{key}'") and "\n" not in str(raised.value)


def test_warm_up_as_long_as_the_epochs_is_refused_once_the_rows_are_known():
    settings = TrainingSettings.parse({"epochs": 1, "warmup_steps": 4, "effective_batch": 8, "micro_batch": 2})
    assert settings.with_length(64).max_steps == 8  # 8 steps: warm-up ends
    with pytest.raises(ConfigError, match=r"config key 'training.warmup_steps': 4 is not below the 4 optimizer steps "
                                          r"that epochs \(1\) makes of 32 training rows"):
        settings.with_length(32)
    valid = TrainingSettings.parse({"max_steps": 5, "warmup_steps": 4, "packing": True, "micro_batch": 2,
                                    "effective_batch": 4, "validation": {"every_steps": 2, "keep": "best",
                                                                        "early_stopping_patience": 1}})
    assert valid.validation.keep == "best"


# --- one entry of datasets, models and variants (core/entry_settings.py) ---
ENTRY_DICT_ACCESS = re.compile(r"\b(dataset|model|model_spec|src|source|submission|contamination|limits|gguf)"
                               r"(\[\"|\[\'|\.get\()|config\[[\"'](datasets|variants|models?)[\"']\]\[")
# Modules whose dataset or model settings are named ``settings`` (the dataset stages and their data helpers).
ENTRY_SETTINGS_READERS = ("workflow_scripts/download.py", "workflow_scripts/normalise.py",
                          "workflow_scripts/prepare_model.py", "workflow_scripts/data/split_layouts.py",
                          "workflow_scripts/data/split_names.py", "workflow_scripts/data/source_files.py",
                          "workflow_scripts/data/source_paths.py", "workflow_scripts/data/rows.py")
SETTINGS_DICT_ACCESS = re.compile(r"\bsettings(\[\"|\[\'|\.get\()")
# A variant below the config layer: the stages type ``--variant`` once (VariantSettings, the task's
# check_variant) and the tasks, templates and gate checks read it by attribute (issue 27).
VARIANT_DICT_ACCESS = re.compile(r"\bvariant(\[\"|\[\'|\.get\()")
# The config layer reads the config's mappings once and types them: the matrix, the file reading, the
# parse-time checks and the typed settings themselves.
CONFIG_LAYER = ("workflow_scripts/core/experiment_config.py", "workflow_scripts/core/config_files.py",
                "workflow_scripts/core/entry_settings.py", "workflow_scripts/checks/", "workflow_scripts/demo/")


def dict_reads_of_typed_entries(root: Path) -> list[str]:
    """Lines of the stages, the library (the tasks, templates and training's gate checks among them) and the rules
    that read a dataset's, model's or variant's settings as a mapping rather than their typed settings
    (core/entry_settings.py) by attribute."""
    found = []
    for path in sorted([*(root / "workflow_scripts").rglob("*.py"), *(root / "rules").glob("*.smk")]):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(CONFIG_LAYER):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if (ENTRY_DICT_ACCESS.search(line) or VARIANT_DICT_ACCESS.search(line)
                    or (relative in ENTRY_SETTINGS_READERS and SETTINGS_DICT_ACCESS.search(line))):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_nothing_below_the_config_reads_a_dataset_model_or_variant_entry_as_a_dict():
    assert dict_reads_of_typed_entries(REPO) == []


def test_the_entry_guard_catches_a_planted_dict_read(tmp_path):
    planted = (("workflow_scripts/normalise.py", 'fields = settings["fields"]'),
               ("workflow_scripts/data/rows.py", 'flatten = settings.get("flatten")'),
               ("workflow_scripts/tasks/generation.py", 'fields = dataset["fields"]'),
               ("workflow_scripts/prepare_model.py", 'revision = model["revision"]'),
               ("workflow_scripts/data/source_paths.py", 'kind = source["type"]'),
               ("rules/common.smk", 'task = config["datasets"][wildcards.dataset]["task"]'),
               ("rules/evaluation.smk", 'variant = config["variants"][wildcards.variant]'),
               ("workflow_scripts/tasks/templates.py", 'prompt = variant["prompt"]'),
               ("workflow_scripts/tasks/classification.py", 'template = variant.get("input", DEFAULT_INPUT)'),
               ("workflow_scripts/training/preflight_checks.py", "chat = variant['chat_template']"),
               ("workflow_scripts/pretokenise.py", 'grouping = variant.get("grouping")'))
    for relative, line in planted:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        with open(tmp_path / relative, "a") as handle:
            handle.write(f"{line}\nok = settings.fields, dataset.task, model.revision, variant.prompt, meta['variant']\n")
    (tmp_path / "workflow_scripts/checks").mkdir()
    (tmp_path / "workflow_scripts/checks/config.py").write_text('task = config["datasets"][name]["task"]\n')  # the config layer
    assert len(dict_reads_of_typed_entries(tmp_path)) == len(planted)


def test_entries_are_typed_with_the_schemas_defaults_and_give_back_what_the_rules_pass():
    from workflow_scripts.checks.config import load_config
    from workflow_scripts.core.entry_settings import DatasetSettings, ModelSettings, VariantSettings

    config = load_config(REPO / "config" / "config.yaml")
    datasets, variants, models = xc.dataset_entries(config), xc.variant_entries(config), xc.model_entries(config)
    for name, dataset in datasets.items():
        assert dataset.to_dict() == config["datasets"][name]  # the rules' --dataset JSON: unchanged
        assert DatasetSettings.parse(dataset.to_dict(), name) == dataset
    for name, variant in variants.items():
        assert variant.to_dict() == xc.variant_settings(config["variants"][name])  # the rules' --variant JSON
    for name, model in models.items():
        given = xc.model_settings(config, name)
        assert model.building_settings() == {key: value for key, value in given.items() if key != "training"}
        assert ModelSettings.parse(model.building_settings()) == dataclasses.replace(model, training={},
                                                                                     given=model.given | {"training": {}})
    amr, corpus, topics = datasets["amr_demo"], datasets["corpus_demo"], datasets["topics_demo"]
    assert amr.also_metrics == ("smatchpp",) and amr.derived["aux"].transform == "penman_skeleton"
    assert amr.on_invalid_text == "stop" and amr.contamination.max_fraction == 0.01 and not amr.flatten
    assert corpus.format == "text" and corpus.derived == {} and corpus.labels is None and corpus.fields == {}
    assert topics.task == "classification" and topics.submission.id_key == "questionId" and topics.train_alone
    assert variants["mtup"].extractor.marker == "Task 2:" and variants["baseline"].extractor.type == "whole"
    assert variants["mlm_whole_word"].whole_word and variants["mlm_whole_word"].mask_rate == 0.15
    assert variants["text_only"].images is False and variants["vision"].images is True
    assert models["tiny-bert"].tiny.architecture == "bert" and models["tiny-llava"].training["max_length"] == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        amr.metric = "smatchpp"
    with pytest.raises(TypeError):
        amr.splits["train"] = "other"  # read-only, as the rest
    with pytest.raises(ConfigError, match=r"^--dataset: config key 'datasets.d.source.type': 'ftp' is not one of"):
        DatasetSettings.from_json('{"source": {"type": "ftp"}, "fields": {"question": "q", "answers": "a"}, '
                                  '"metric": "exact_match"}', "d")
    with pytest.raises(ConfigError, match=r"'variants.v'.*'input' was unexpected"):
        VariantSettings.parse({"prompt": "{question}", "target": "{answer}", "input": "{text}"}, "generation", "v")


# The records the tasks wrote before the variant was typed (task.check_variant's mapping), pinned: pretokenise's
# cache key and its ``templates`` record, and evaluate's and predict's manifests, must not change, or every
# finished demo would re-tokenise and rerun (cache keys over tokenizer "tokenizer-fp", input "input-fp", 64 tokens).
PINNED_RECORDS = {
    "baseline": ('{"extractor": {"type": "whole"}, "chat_template": false, "prompt": "Question: {question}\\nAnswer:", '
                 '"target": " {answer}"}', "65ab730853d7845c966f95c5db8beaae6c097901a8bd3c4beddd5ceafee71dd1"),
    "mtup": ('{"extractor": {"type": "section", "marker": "Task 2:"}, "chat_template": false, "prompt": "Question: '
             '{question}\\nSolve Task 1 then Task 2.\\n", "target": "Task 1: {aux}\\nTask 2: {answer}"}',
             "32222d8ebab116afa66f590bcfd1b8f602fa7eba6fb0ce405a8a6e6c74ea311f"),
    "plain": ('{"input": "{text}", "class_weights": null}',
              "63bd5376f1cab4564792f0b78ae1f61ae9957c8498e3fd033f6db5c6184117c1"),
    "framed": ('{"input": "Which topic is this about: {text}", "class_weights": null}',
               "b5da607642e5e3a4b4fba24b49916e87f6fee2e6b9e795a1a9505f6306de21ef"),
    "mlm_tokens": ('{"mask_rate": 0.15, "whole_word": false, "grouping": "lines"}',
                   "2013ebe5b28767e85cae34e120f6243043fc2a82030df6ceb1e2699bb065eaff"),
    "mlm_whole_word": ('{"mask_rate": 0.15, "whole_word": true, "grouping": "lines"}',
                       "0525ab9525835f7599c775650af04c4f81477ab34d38067c05b6333063ad2829"),
    "vision": ('{"extractor": {"type": "whole"}, "chat_template": false, "prompt": "Question: {question}\\nAnswer:", '
               '"target": " {answer}", "images": true}', "24c6c56aebdcb311abdbd568b1fc9af4bd5c321a8e10cee7710df3cb179b6c2d"),
    "text_only": ('{"extractor": {"type": "whole"}, "chat_template": false, "prompt": "Question: {question}\\nAnswer:", '
                  '"target": " {answer}", "images": false}', "7a7b74e43330fffbdd52c43701ab7be4b62bdd45fa6b01ff31536c905837481d"),
}


def test_each_demo_variants_record_and_cache_key_are_what_they_were_before_typing():
    import json

    from workflow_scripts.checks.config import load_config
    from workflow_scripts.core.entry_settings import VariantSettings
    from workflow_scripts.pretokenise import cache_key
    from workflow_scripts.tasks import task_named

    config = load_config(REPO / "config" / "config.yaml")
    assert set(config["variants"]) == set(PINNED_RECORDS)
    for name, settings in xc.variant_entries(config).items():
        task = task_named(settings.task)
        # As pretokenise, evaluate and predict parse --variant (the rules' JSON): typed once, the task's checks.
        variant = task.check_variant(VariantSettings.from_json(json.dumps(settings.to_dict()), settings.task, name))
        record = task.variant_record(variant)
        assert (json.dumps(record), cache_key("tokenizer-fp", record, 64, "input-fp", settings.task)) == PINNED_RECORDS[name]
        # sanity and train type the recorded variant again (tokenise_meta.json templates): the same settings
        assert task.check_variant(VariantSettings.from_record(record, settings.task)).to_dict().items() >= {
            key: value for key, value in variant.to_dict().items() if key != "class_weights"}.items()


@pytest.mark.parametrize("task, given, record", [
    ("classification", {"class_weights": {"b": 2, "a": 0.5}, "input": "{text} || {text_pair}"},
     '{"input": "{text} || {text_pair}", "class_weights": {"b": 2, "a": 0.5}}'),
    ("masked_lm", {}, '{"mask_rate": 0.15, "whole_word": false, "grouping": "blocks"}'),
    ("conversation", {"system_prompt": "  Be brief.  "}, '{"system_prompt": "Be brief."}'),
    ("conversation", {"system_prompt": False}, '{"system_prompt": false}'),
    ("vision_language", {"images": True, "prompt": "{question}", "target": " {answer}", "chat_template": True},
     '{"extractor": {"type": "whole"}, "chat_template": true, "prompt": "{question}", "target": " {answer}", "images": true}'),
])
def test_a_variants_record_keeps_the_tasks_defaults_and_order(task, given, record):
    """Pinned to the old check_variant's output for these variants (the task's defaults first, images last,
    the system prompt stripped, class weights as given)."""
    import json

    from workflow_scripts.core.entry_settings import VariantSettings
    from workflow_scripts.tasks import task_named

    checked = task_named(task).check_variant(VariantSettings.from_json(json.dumps(given), task, "v"))
    assert json.dumps(task_named(task).variant_record(checked)) == record
