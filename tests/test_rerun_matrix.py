"""The rerun matrix (issue 35): every leaf key of config/schema.yaml, changed on a finished run's config, changes
the recorded params of exactly the stages core/config_reads.py declares for it, and what a stage receives
changes only for the keys it reads (or receives without a rerun: RUNTIME_READS).

The leaves are generated from the schema, so a key added to it is covered the day it is added (a key whose
generic change is not a valid config gets an entry in MUTATIONS; one that the base config cannot exercise, in
NOT_EXERCISED, with why). The params are those of the real rules: the Snakefile is parsed in this process by
Snakemake's API for each changed config and every job of the base run's plan has its params expanded by
Snakemake (as ``.snakemake/metadata`` records them: built-in values; ``RuntimeOnly`` ones are what a stage
receives without a rerun). Snakemake reruns a job whose recorded params changed, and then everything that
consumes its outputs (test_reruns.py and test_rerun_runs.py check that part on real plans and runs).
"""
from __future__ import annotations

import copy
import json
import functools
import io
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from data_helpers import ROOT
from test_dag import config_file
from test_dry_run_families import dry_run
from test_gate_once import planned
from test_mixtures import mixture_config
from workflow_scripts.core import config_reads
from workflow_scripts.core.config_files import validate_schema

SCHEMA = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())


# The schema's leaves ---------------------------------------------------------------------------------------
def _resolve(node: dict) -> dict:
    while "$ref" in node:
        extra = {key: value for key, value in node.items() if key != "$ref"}
        node = {**SCHEMA["$defs"][node["$ref"].split("/")[-1]], **extra}
    return node


def schema_leaves() -> dict[str, tuple[str | None, dict]]:
    """Every leaf of the schema: dotted path (``*`` for an entry of a user-named mapping) -> (the task whose
    branch holds it, None where every task has it; its schema). ``model.*`` is spelled ``models.*`` (the
    same keys); the free-form training overrides of a model or variant are leaves themselves."""
    leaves: dict[str, tuple[str | None, dict]] = {}

    def walk(node: dict, path: str, task: str | None) -> None:
        node = _resolve(node)
        properties = node.get("properties", {})
        for key, child in properties.items():
            walk(child, f"{path}.{key}" if path else key, task)
        if "if" in node:
            const = node["if"].get("properties", {}).get("task", {}).get("const")
            walk(node.get("then", {}), path, const)
            walk(node.get("else", {}), path, task)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and not properties:
            inner = _resolve(extra)
            if inner.get("properties") or "if" in inner:
                walk(inner, f"{path}.*", task)
                return
        if not properties and "if" not in node and path and path not in leaves:
            leaves[path] = (task, node)

    walk(SCHEMA, "", None)
    parents = {path.rsplit(".", 1)[0] for path in leaves if "." in path}
    return {path: spec for path, spec in leaves.items() if not path.startswith("model.") and path not in parents}


# A changed value per leaf ---------------------------------------------------------------------------------
# The entry a leaf of a user-named mapping is changed in, by the task of the schema branch that holds it.
ENTRIES = {
    "datasets": {None: "amr_demo", "classification": "topics_demo", "masked_lm": "corpus_demo"},
    "variants": {None: "baseline", "classification": "plain", "masked_lm": "mlm_tokens"},
    "models": {None: "tiny-llama"},
    "mixtures": {None: "qa_mix"},
}
# Leaves whose generic change (the next enum value, a boolean flipped, a number moved within its bounds, a
# string or list extended) is not a valid config of the same jobs: (entry or None, the value to set).
MUTATIONS: dict[str, tuple[str | None, Any]] = {
    "datasets.*.fields.image": ("shapes_demo", "picture"),
    "datasets.*.fields.question": ("amr_demo", "graph"),
    "datasets.*.fields.answers": ("chartqa_demo", "image"),  # (amr_demo's smatch needs graphs as answers)
    "datasets.*.extra_fields": ("amr_demo", {"sentence_again": "sentence"}),
    "datasets.*.metric": ("chartqa_demo", "exact_match"),
    "datasets.*.also_metrics": ("amr_demo", []),
    "datasets.*.derived.*.transform": ("chartqa_demo", "penman_skeleton"),
    "datasets.*.derived.*.field": ("amr_demo", "question"),
    "datasets.*.models": ("amr_demo", ["tiny-llama", "tiny-bert"]),
    "datasets.*.evaluation_split": ("amr_demo", "test"),
    "datasets.*.unlabelled": ("amr_demo", ["test"]),
    "datasets.*.train_alone": ("ocrvqa_demo", True),
    "datasets.*.labels": ("topics_demo", ["weather", "sport", "politics", "food"]),
    "datasets.*.splits.train": ("amr_demo", "test"),
    "datasets.*.splits.validation": ("amr_demo", "test"),
    "datasets.*.splits.test": ("amr_demo", "validation"),
    "datasets.*.source.path": ("amr_demo", lambda config: _copied_demo_data("amr")),
    "variants.*.prompt": ("baseline", "Q: {question}\nA:"),
    "variants.*.target": ("baseline", " A: {answer}"),
    "variants.*.extractor.type": ("mtup", "whole"),
    "variants.*.extractor.marker": ("mtup", "Task 2: "),
    "variants.*.input": ("plain", "Text: {text}"),
    "variants.*.class_weights": ("plain", {"sports": 2.0}),
    "variants.*.images": ("vision", False),  # (true, the generic change, is the code's default: records as absent)
    "variants.*.training": ("mtup", lambda config: _both_generation_variants(config, {"learning_rate": 1.0e-3})),
    "models.*.training": ("tiny-llama", {"learning_rate": 1.0e-3}),
    "mixtures.*.weights": ("qa_mix", lambda config: _weights_instead_of_temperature(config)),
    "mixtures.*.temperature": ("qa_mix", 3),
    "seeds": (None, [1, 2]),
    "training.lora.target_modules": (None, ["q_proj", "v_proj", "lm_head"]),
    "training.lora.modules_to_save": (None, ["lm_head"]),
    "training.max_length": (None, 96),
    "training.effective_batch": (None, 32),
    "training.micro_batch": (None, 8),
    "training.max_steps": (None, 200),
    "training.epochs": (None, lambda config: _epochs_instead_of_steps(config)),
    "training.lora.dropout": (None, 0.1),
    "datasets.*.contamination.max_fraction": ("amr_demo", 0.2),
    "datasets.*.duplicates.max_fraction": ("amr_demo", 0.5),
    "datasets.*.encoding": ("amr_demo", "utf-8-sig"),
    "datasets.*.on_invalid_text": ("amr_demo", "reject_row"),  # (stop, the first value, is the default)
    "training.validation.every_steps": (None, 25),
    "training.validation.early_stopping_patience": (None, 2),
    "training.validation.metric_examples": (None, 8),
    "training.cpu_processes": (None, lambda config: _two_processes(config)),
    "training.micro_batch_tokens": (None, 2048),
    "training.precision": (None, "bf16"),
    "training.warmup_steps": (None, 20),
    "evaluation.split": (None, "validation"),
    "evaluation.dtype": (None, "fp32"),
    "comparison.reference_variant": (None, {"generation": "mtup", "classification": "plain",
                                            "masked_lm": "mlm_tokens", "vision_language": "text_only"}),
    "comparison.intended_differences": (None, ["training.max_steps"]),
    "comparison.min_detectable_effect": (None, 0.9),
    "tracking.mlflow.tracking_uri": (None, "results/other-mlruns"),
}

# Leaves the base config (the demo's, with a mixture and an evaluation-only dataset, on CPUs) cannot change into
# another valid config of the same jobs, and why. Their stages are declared in config_reads.READS all the same.
NOT_EXERCISED = {
    "datasets.*.task": "another task is another dataset (its fields, metric and variants change with it)",
    "datasets.*.source.type": "the demo's sources are local; hub and url sources download at run time",
    "datasets.*.format": "the demo's files are jsonl (text: the masked-LM corpus only)",
    "variants.*.task": "another task is another variant (its templates change with it)",
    "mixtures.*.datasets": "a mixture of other datasets is another mixture",
    "models.*.source": "a hub, gguf or local model needs its files (prepare_model reads every build key)",
    "models.*.gguf.package": "a GGUF model needs its package",
    "models.*.gguf.file": "a GGUF model needs its package",
    "models.*.gguf.tokenizer_id": "a GGUF model needs its package",
    "datasets.*.source.url": "a url source downloads at run time",
    "datasets.*.source.sha256": "a url source downloads at run time",
    "datasets.*.source.layout": "the image-folder layout is another vision_language dataset",
    "datasets.*.source.files": "several files per split: another layout of the source",
    "datasets.*.fields.messages": "the demo has no conversation dataset",
    "datasets.*.keys.role": "the demo has no conversation dataset",
    "datasets.*.keys.content": "the demo has no conversation dataset",
    "datasets.*.roles.system": "the demo has no conversation dataset",
    "datasets.*.roles.user": "the demo has no conversation dataset",
    "datasets.*.roles.assistant": "the demo has no conversation dataset",
    "variants.*.system_prompt": "the demo has no conversation dataset",
    "training.quantization.bits": "QLoRA: bitsandbytes on a GPU",
    "variants.*.max_pixels": "the demo's VLMs (LLaVA-1.5, Idefics3) have fixed-size processors, which refuse a budget",
    "variants.*.min_pixels": "the demo's VLMs (LLaVA-1.5, Idefics3) have fixed-size processors, which refuse a budget",
    "training.packing": "the demo's classification, masked-LM and vision-language experiments refuse packing",
    "training.strategy": "FSDP refuses the demo's vision-language experiments (core/settings.sharding_problem)",
    "evaluation.qlora_base": "QLoRA only: refused where no training block sets training.quantization",
    "training.quantization.type": "QLoRA: bitsandbytes on a GPU",
    "training.quantization.double_quant": "QLoRA: bitsandbytes on a GPU",
    "training.quantization.compute_dtype": "QLoRA: bitsandbytes on a GPU",
    "training.finetune": "the demo's vision_language experiments refuse full fine-tuning",
    "training.nodes": "several nodes: a cluster's GPUs",
    "training.fsdp_mesh": "FSDP's mesh: GPUs",
    "training.flex_attention": "CUDA only (and packing)",
    "training.fused_cross_entropy": "CUDA only",
    "training.liger_kernels": "CUDA only",
    "training.activation_offloading": "needs gradient checkpointing, which the demo turns off",
    "models.*.initialise": "random (pretrained, the generic change, is the code's default and records as absent) "
                           "needs training.finetune: full, a change of training too: "
                           "test_random_initialisation_rebuilds_the_model checks it",
    "training.validation.criterion": "metric (loss, the other value, is the code's default and records as absent) "
                                     "scores the metric in training, refused for the demo's mixture (its metrics "
                                     "have no common scale)",
}


def _copied_demo_data(name: str) -> str:
    """A copy of a demo dataset's files elsewhere (the same content under another source.path)."""
    import shutil

    target = Path(tempfile.gettempdir()) / f"rerun-matrix-{name}"
    if not target.exists():
        shutil.copytree(ROOT / "demo_data" / name, target)
    return str(target)


def _both_generation_variants(config: dict, overrides: dict) -> dict:
    """A variant's training override, set on the reference too (the fairness guard refuses it otherwise)."""
    config["variants"]["baseline"]["training"] = dict(overrides)
    return dict(overrides)


def _weights_instead_of_temperature(config: dict) -> dict:
    config["mixtures"]["qa_mix"].pop("temperature")
    return {"chartqa_demo": 2, "ocrvqa_demo": 1}


def _epochs_instead_of_steps(config: dict) -> float:
    """epochs for max_steps everywhere (the demo's models and variants override max_steps)."""
    for block in [*config["models"].values(), *config["variants"].values()]:
        if "max_steps" in block.get("training", {}):
            block["training"]["max_steps"] = None
    config["training"]["max_steps"] = None
    return 2


def _two_processes(config: dict) -> int:
    config["training"].update(micro_batch=8, effective_batch=32)  # tiny-bert's micro-batches of 16 too
    return 2


def base_config() -> dict:
    return copy.deepcopy(_base_config())


@functools.lru_cache(maxsize=1)
def _base_config() -> dict:
    """The demo config with a mixture and an evaluation-only dataset (test_mixtures), local paths absolute, one
    seed: every stage of the workflow has jobs, but predict (no unlabelled split)."""
    config = mixture_config()
    for dataset in config["datasets"].values():
        dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
    config["seeds"] = [1]
    # scored on validation, so that its test split may be unlabelled (datasets.*.unlabelled's change)
    config["datasets"]["amr_demo"]["evaluation_split"] = "validation"
    validate_schema(config)  # the schema's defaults filled, as Snakemake's validate() fills them
    # written only with a QLoRA training block (config_files.refuse_unused_qlora_base); Snakemake fills it again
    config["evaluation"].pop("qlora_base")
    return config


def _generic_change(schema: dict, current: Any) -> Any:
    types_ = schema.get("type", [])
    types_ = [types_] if isinstance(types_, str) else list(types_)
    if "enum" in schema:
        others = [value for value in schema["enum"] if value != current and value is not None]
        return others[0]
    if "boolean" in types_:
        return not current
    if "integer" in types_ or "number" in types_:
        low = schema.get("minimum", schema.get("exclusiveMinimum", 0))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        if current is None:
            return max(low, 1) + 1
        moved = current * 2 if current else (1 if "integer" in types_ else 0.1)
        if high is not None and moved >= high:
            moved = (current + low) / 2 if "number" in types_ else current - 1
        return moved
    if "array" in types_:
        return [*(current or []), "changed"] if schema.get("items", {}).get("type") == "string" else None
    if "string" in types_:
        return f"{current}x" if current else "changed"
    if "object" in types_:
        return {**(current or {}), "changed": "changed"}
    raise AssertionError(f"no generic change for a schema node {schema}")


def _place(config: dict, path: str, task: str | None) -> tuple[dict, list[str]]:
    """(the mapping that holds the leaf, the keys below it), with ``*`` resolved to the entry changed."""
    parts = path.split(".")
    entry = MUTATIONS.get(path, (None,))[0]
    holder: Any = config
    for index, part in enumerate(parts[:-1]):
        if part == "*":
            part = entry if index == 1 and entry else (
                ENTRIES[parts[0]][task] if index == 1 else next(iter(holder)))
        holder = holder.setdefault(part, {})
    return holder, [parts[-1]]


def changed_config(path: str) -> dict:
    """The base config with the leaf ``path`` changed to another valid value."""
    task, schema = schema_leaves()[path]
    config = copy.deepcopy(base_config())
    holder, (key,) = _place(config, path, task)
    if path in MUTATIONS:
        value = MUTATIONS[path][1]
        value = value(config) if callable(value) else value
    else:
        current = holder.get(key, schema.get("default"))
        value = _generic_change(schema, current)
    if value is None:
        holder.pop(key, None)
    else:
        holder[key] = value
    return config


# Snakemake's params of every job, in this process ----------------------------------------------------------
_YAML_LOAD = yaml.load


# libyaml's loaders where PyYAML has them: the same documents, ~10x faster (each changed config is read twice)
_FASTER = {yaml.SafeLoader: getattr(yaml, "CSafeLoader", yaml.SafeLoader),
           yaml.Loader: getattr(yaml, "CLoader", yaml.Loader),
           yaml.FullLoader: getattr(yaml, "CFullLoader", yaml.FullLoader)}  # (yte's, reading --configfile)


@functools.lru_cache(maxsize=None)
def _yaml_text(text: str, loader: type) -> Any:
    from workflow_scripts.core.config_files import StrictLoader

    if loader is StrictLoader:  # its duplicate-key check, on configs yaml.dump wrote here: libyaml's safe loader
        loader = yaml.SafeLoader
    return _YAML_LOAD(text, Loader=_FASTER.get(loader, loader))  # noqa: S506 (the loaders Snakemake passes)


def _cached_yaml_load(stream, Loader=None):  # noqa: N803 (yaml.load's own argument name)
    """yaml.load memoised by text: the Snakefile reads config/schema.yaml several times per parse (~1 s of
    pure-Python YAML), the same for every config here."""
    text = stream if isinstance(stream, str) else stream.read()
    text = text.decode() if isinstance(text, bytes) else text
    return copy.deepcopy(_yaml_text(text, Loader))


@functools.lru_cache(maxsize=1)
def base_jobs() -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """(rule, wildcards) of every job of the base config's plan (a dry run)."""
    workdir = Path(tempfile.mkdtemp(prefix="rerun-matrix-"))
    code, output = dry_run(workdir, "-n", "-p", "--configfile", str(config_file(workdir, base_config())),
                           "--replace-workflow-config", "--cores", "2")
    assert code == 0, output[-3000:]
    return tuple(dict.fromkeys((job["rule"], tuple(sorted(job["wildcards"].items())))
                               for job in planned(output) if job["rule"] != "all"))


def job_params(config: dict, workdir: Path) -> dict[tuple, tuple[tuple, tuple]]:
    """(rule, wildcards) -> (recorded params, everything the stage receives) for every base job, under
    ``config``, from the Snakefile parsed by Snakemake's API (a job whose wildcards no longer fit: absent)."""
    from snakemake.api import SnakemakeApi
    from snakemake.iocontainers import Wildcards
    from snakemake.settings.types import ConfigSettings, OutputSettings, Quietness, ResourceSettings

    path = config_file(workdir, config)
    found = {}
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        workflow_api = api.workflow(resource_settings=ResourceSettings(cores=2),
                                    config_settings=ConfigSettings(configfiles=[path], replace_workflow_config=True),
                                    snakefile=ROOT / "Snakefile", workdir=workdir)
        rules = {rule.name: rule for rule in workflow_api._workflow.rules}
        for name, items in base_jobs():
            rule = rules[name]
            wildcards = Wildcards(fromdict=dict(items))
            try:
                output, _ = rule.expand_output(wildcards)
                input_, *_ = rule.expand_input(wildcards)
                params, _ = rule.expand_params(wildcards, input_, output, job=None)
            except Exception:  # noqa: BLE001 (the job does not exist under this config)
                continue
            values = dict(params.items())
            recorded = tuple(sorted((key, repr(value)) for key, value in values.items()
                                    if isinstance(value, (int, float, bool, str, list, tuple, dict)) or value is None))
            received = tuple(sorted((key, str(value)) for key, value in values.items() if key != "reads"))
            found[name, items] = (recorded, received)
    return found


_PARSED: dict = {}


def _cached_parse(original):
    """Snakemake's parser (the .smk files to Python) memoised by file, content and rule count: the same rule files
    are compiled to the same code for every changed config (issue 42: the matrix's time was mostly parsing)."""
    def parse(path, workflow, linemap, overwrite_shellcmd=None, rulecount=0):
        name = str(getattr(path, "get_path_or_uri", lambda **_: path)(secret_free=True))
        key = (name, Path(name).read_text() if Path(name).is_file() else None, rulecount, overwrite_shellcmd)
        if key[1] is None:
            return original(path, workflow, linemap, overwrite_shellcmd=overwrite_shellcmd, rulecount=rulecount)
        if key not in _PARSED:
            lines: dict = {}
            code, count = original(path, workflow, lines, overwrite_shellcmd=overwrite_shellcmd, rulecount=rulecount)
            _PARSED[key] = (code, count, lines)
        code, count, lines = _PARSED[key]
        linemap.update(lines)
        return code, count
    return parse


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, request) -> dict:
    import snakemake.api  # noqa: F401 (first: snakemake.workflow alone is a circular import)
    import snakemake.workflow

    mp = pytest.MonkeyPatch()
    request.addfinalizer(mp.undo)
    mp.setattr(yaml, "load", _cached_yaml_load)
    mp.setattr(snakemake.workflow, "parse", _cached_parse(snakemake.workflow.parse))
    workdir = tmp_path_factory.mktemp("matrix")
    base = job_params(base_config(), workdir)
    return {"base": base, "workdir": workdir}


def changed_stages(base: dict, changed: dict) -> tuple[set[str], set[str]]:
    """(rules with a job whose recorded params changed, rules with a job whose received arguments changed)."""
    recorded, received = set(), set()
    for job, (base_recorded, base_received) in base.items():
        if job not in changed:
            continue
        now_recorded, now_received = changed[job]
        if now_recorded != base_recorded:
            recorded.add(job[0])
        if now_received != base_received:
            received.add(job[0])
    return recorded, received


def _changed_entry(path: str) -> str | None:
    """The entry of a user-named mapping a leaf's change is made in (None: a global key)."""
    parts = path.split(".")
    if len(parts) < 2 or parts[1] != "*":
        return None
    task = schema_leaves()[path][0]
    return MUTATIONS.get(path, (None,))[0] or ENTRIES[parts[0]][task]


def _involves(rule: str, wildcards: dict, section: str, entry: str, config: dict) -> bool:
    """Whether a job reads the entry ``entry`` of ``section``: a dataset's keys are read by the jobs of that
    dataset (the one evaluated, not the one trained on), and by the checks across datasets that hold it."""
    from workflow_scripts.core import experiment_config as xc

    if section == "datasets":
        if rule == "cross_contamination":
            return entry in sum(xc.cross_contamination_datasets(config, wildcards["dataset"]), [])
        return wildcards.get("dataset") == entry
    return entry in wildcards.values()


def expected_stages(path: str, config: dict) -> set[str]:
    """The rules whose recorded params a change of ``path`` must change, among the base plan's jobs: the stages
    reading it (a model's or variant's training override: those reading the training keys it sets), each
    where it has a job of the changed entry."""
    if path in ("models.*.training", "variants.*.training"):
        overrides = changed_config(path)[path.split(".")[0]][_changed_entry(path)]["training"]
        keys = [f"training.{key}" for key in overrides]
    else:
        keys = [path]
    declared = {stage for key in keys for stage in config_reads.unconditional_stages_reading(key)}
    entry = _changed_entry(path)
    rules = set()
    for rule, items in base_jobs():
        if entry is not None and not _involves(rule, dict(items), path.split(".")[0], entry, config):
            continue
        if rule in declared or any(_condition_holds(condition, dict(items), config)
                                   for key in keys for condition in config_reads.conditions_of(rule, key)):
            rules.add(rule)
    return rules


def _condition_holds(condition: str, wildcards: dict, config: dict) -> bool:
    """Whether a condition of config_reads.CONDITIONAL_READS holds for a job: ``datasets.*.<key>=...`` on the
    job's dataset, or a global key set."""
    key = condition.split("=", 1)[0]
    parts = key.split(".")
    if parts[:2] == ["datasets", "*"]:
        dataset = config["datasets"].get(wildcards.get("dataset"))
        if dataset is None:
            return False
        value = dataset
        parts = parts[2:]
    else:
        value = config
    for part in parts:
        value = value.get(part) if isinstance(value, dict) else None
    return config_reads.condition_holds(condition, value)


def _partly_read(path: str) -> set[str]:
    """Stages that read a part of ``path`` (config_reads.NARROWED_READS): their params may change with it, and
    they receive it."""
    return {stage for stage in config_reads.stages_reading(path) if config_reads.narrowing_of(stage, path)}


def _given_unread(path: str) -> set[str]:
    """Stages given ``path`` only because an entry is not valid without it (config_reads.ENTRY_REQUIRED)."""
    if any(config_reads.covers(key, path) for key in config_reads.ENTRY_REQUIRED):
        return {"download", "normalise"}
    return set()


EXERCISED = sorted(set(schema_leaves()) - set(NOT_EXERCISED))


def observe(matrix: dict, path: str) -> tuple[set[str], set[str]]:
    """(rules whose recorded params change, rules whose received arguments change) when ``path`` changes."""
    return changed_stages(matrix["base"], job_params(changed_config(path), matrix["workdir"]))


def check_leaf(matrix: dict, path: str, observed: tuple[set[str], set[str]] | None = None) -> list[str]:
    """The faults of one leaf's change: rules whose recorded params changed but that do not read it, rules that
    read it whose params (or what they receive) did not change, rules that receive it without reading it."""
    config = changed_config(path)
    recorded, received = observed or observe(matrix, path)
    expected = expected_stages(path, base_config())
    allowed = expected | ({"compare"} if config_reads.plan_key(path) else set()) | _partly_read(path)
    faults = []
    if not expected <= recorded:
        faults.append(f"{path}: {sorted(expected - recorded)} read it (config_reads.READS), but their params do not "
                      "change with it")
    if not recorded <= allowed:
        faults.append(f"{path}: the params of {sorted(recorded - allowed)} change with it, but config_reads.READS "
                      "does not say they read it")
    runtime = set(config_reads.runtime_stages_reading(path)) | _given_unread(path)
    if not received <= allowed | runtime:
        faults.append(f"{path}: {sorted(received - allowed - runtime)} receive it, but neither read it nor receive "
                      "it at run time only (config_reads.READS, RUNTIME_READS)")
    if not expected <= received:
        faults.append(f"{path}: {sorted(expected - received)} read it, but their arguments do not carry it")
    return faults


def test_every_leaf_of_the_schema_is_exercised_or_says_why_not():
    leaves = set(schema_leaves())
    assert len(leaves) > 150 and {"training.lora.rank", "datasets.*.also_metrics", "seeds"} <= leaves
    assert set(NOT_EXERCISED) <= leaves, sorted(set(NOT_EXERCISED) - leaves)
    assert set(MUTATIONS) <= leaves, sorted(set(MUTATIONS) - leaves)


def test_every_leaf_change_reruns_exactly_the_stages_that_read_it(matrix):
    faults = [fault for path in EXERCISED for fault in check_leaf(matrix, path)]
    assert not faults, "\n".join(faults)


@pytest.mark.parametrize("fault", ["a key added to a stage that does not read it",
                                   "a key dropped from a stage that reads it"])
def test_a_table_that_disagrees_with_the_params_fails_the_matrix(matrix, monkeypatch, fault):
    """The planted faults: the table (core/config_reads.py) changed while the rules' params are not."""
    reads = dict(config_reads.READS)
    if fault.startswith("a key added"):
        reads["normalise"] = (*reads["normalise"], "datasets.*.evaluation_split")
        path, message = "datasets.*.evaluation_split", "['normalise'] read it (config_reads.READS), but their params"
    else:
        reads["evaluate"] = tuple(key for key in reads["evaluate"] if key != "evaluation.max_new_tokens")
        path, message = "evaluation.max_new_tokens", "the params of ['evaluate'] change with it, but"
    observed = observe(matrix, path)  # the rules' params as the code builds them
    monkeypatch.setattr(config_reads, "READS", reads)
    faults = check_leaf(matrix, path, observed)
    assert any(message in fault for fault in faults), faults


def test_a_param_that_bypasses_the_table_fails_the_matrix(matrix, monkeypatch):
    """The planted fault in the rules: normalise given the dataset's evaluation split as a recorded param (a key
    it does not declare; its undeclared reads fail in the stage itself:
    test_a_stage_reading_a_key_the_table_does_not_give_it_fails)."""
    from snakemake.rules import Rule

    original = Rule.expand_params

    def with_metric(self, wildcards, input, output, job, omit_callable=False):
        params, derived = original(self, wildcards, input, output, job, omit_callable)
        if self.name == "normalise":
            params.append(self.workflow.config["datasets"][wildcards["dataset"]].get("evaluation_split"))
            params._add_name("planted")
        return params, derived

    monkeypatch.setattr(Rule, "expand_params", with_metric)
    faults = check_leaf(matrix, "datasets.*.evaluation_split")
    assert any("the params of ['normalise'] change with it" in fault for fault in faults), faults


# A stage reads only what the table gives it (issue 44) -------------------------------------------------------
def test_normalise_reads_the_metrics_its_params_record():
    """normalise's gold-graph check reads the dataset's metric and also_metrics: declared (narrowed to its graph
    metrics), and recorded so: switching smatch off reruns it, another non-graph metric does not."""
    assert "normalise" in config_reads.stages_reading("datasets.*.metric")
    assert "normalise" in config_reads.stages_reading("datasets.*.also_metrics")
    assert "normalise" not in config_reads.unconditional_stages_reading("datasets.*.metric")
    assert config_reads.narrowing_of("normalise", "datasets.*.metric")


@pytest.mark.parametrize("table", ["declared", "planted: normalise's metric reads left out"])
def test_a_stage_reading_a_key_the_table_does_not_give_it_fails(tmp_path, monkeypatch, table):
    """The planted fault: the table omits normalise's read of the metric (as it did before issue 44), while its
    gold-graph check reads it. The stage receives its settings through config_reads.Declared, built from the
    declared keys alone: the undeclared read fails, naming the key, instead of going unrecorded."""
    from data_helpers import demo_settings, run_download, run_normalise
    from workflow_scripts import normalise

    settings = demo_settings("amr_demo")
    raw = run_download("amr", settings, tmp_path)
    if table == "declared":
        run_normalise("amr", settings, raw, tmp_path)
        return
    monkeypatch.setattr(config_reads, "NARROWED_READS", {})
    out = tmp_path / "results" / "amr" / "normalised"
    with pytest.raises(config_reads.UndeclaredRead, match=r"normalise read datasets\.<name>\.metric"):
        normalise.main(["--name", "amr", "--dataset", json.dumps(settings), "--raw", str(raw), "--out", str(out),
                        "--report", str(tmp_path / "report.json")])


def test_what_a_dataset_stage_receives_is_what_it_declares(matrix):
    """download's and normalise's --dataset carry the keys they declare and the keys an entry cannot be without,
    nothing else (what they may read: config_reads.declared_fields)."""
    for (rule, items), (_, received) in matrix["base"].items():
        if rule not in ("download", "normalise"):
            continue
        given = set(json.loads(dict(received)["dataset"]))
        allowed = config_reads.declared_fields(rule, "datasets.*") | {"metric"}
        assert given <= allowed, (rule, items, sorted(given - allowed))


# The untrained model's evaluation depends on what it reads only (issue 44) ------------------------------------
def test_max_length_reruns_no_untrained_evaluation_of_a_generation_dataset(matrix):
    """A generation prompt is never cut at max_length; a classifier's text and masked LM's blocks are."""
    changed = job_params(changed_config("training.max_length"), matrix["workdir"])
    moved = {dict(items)["dataset"] for (rule, items), (recorded, _) in matrix["base"].items()
             if rule == "evaluate_base" and changed[rule, items][0] != recorded}
    tasks = {name: entry.get("task", "generation") for name, entry in base_config()["datasets"].items()}
    evaluated = {dict(items)["dataset"] for rule, items in base_jobs() if rule == "evaluate_base"}
    assert moved == {name for name in evaluated if tasks[name] in ("classification", "masked_lm")}, moved
    assert any(tasks[name] == "generation" for name in evaluated)


def test_class_weights_rerun_tokenisation_and_no_evaluation(matrix):
    """A training loss's class weights: re-tokenised (and so retrained), never read by an evaluation."""
    recorded, received = observe(matrix, "variants.*.class_weights")
    assert recorded == {"pretokenise"} and not received & {"evaluate", "evaluate_base"}, (recorded, received)


def test_a_qlora_variants_precision_reruns_no_untrained_evaluation(matrix):
    """A QLoRA variant's untrained model is loaded quantised as its adapters are, computing in the evaluation's
    own dtype (model/quantization.evaluation_base replaces the record's compute dtype): training.precision, the
    compute dtype when none is set, changes training only (issue 44: every untrained evaluation reran)."""
    def qlora(precision: str) -> dict:
        config = base_config()
        config["training"].update(quantization={"bits": 4}, gpus=1, precision=precision)
        config["evaluation"]["qlora_base"] = "quantised"
        return config

    before, after = (job_params(qlora(precision), matrix["workdir"]) for precision in ("bf16", "fp32"))
    moved = {job[0] for job, (recorded, _) in before.items() if job in after and after[job][0] != recorded}
    assert "train" in moved and "evaluate_base" not in moved, moved
    assert any(rule == "evaluate_base" and "--base-quantization" in dict(received)["adapter"]
               for (rule, _), (_, received) in after.items())


# A default written out records nothing new (issue 44) -------------------------------------------------------------
def _set(*path_and_value):
    *path, key, value = path_and_value

    def change(config: dict) -> None:
        holder = config
        for part in path:
            holder = holder.setdefault(part, {})
        holder[key] = value
    return change


WRITTEN_DEFAULTS = {
    "a dataset's encoding and on_invalid_text": [_set("datasets", "amr_demo", "encoding", "UTF-8"),
                                                 _set("datasets", "amr_demo", "on_invalid_text", "stop")],
    "a dataset's duplicates at its default": [_set("datasets", "amr_demo", "duplicates", {"max_fraction": 1.0})],
    "a dataset's duplicates empty": [_set("datasets", "amr_demo", "duplicates", {})],
    "evaluation.dtype auto": [_set("evaluation", "dtype", "auto")],
    "a vision variant's images: true": [_set("variants", "vision", "images", True)],
    "a model's initialise: pretrained": [_set("models", "tiny-llama", "initialise", "pretrained")],
    "a variant's training.validation.criterion loss": [_set("variants", "mtup", "training", "validation",
                                                            "criterion", "loss")],
}


@pytest.mark.parametrize("written", list(WRITTEN_DEFAULTS))
def test_a_default_written_out_changes_no_recorded_params(matrix, written):
    """A key written at the value its absence means (a default only the code knows) must rerun nothing: each
    of these reran from its stage on (evaluation.dtype: auto every evaluation; duplicates: {max_fraction: 1.0}
    the whole chain from normalise; initialise: pretrained the model and every training)."""
    config = base_config()
    for change in WRITTEN_DEFAULTS[written]:
        change(config)
    recorded, _ = changed_stages(matrix["base"], job_params(config, matrix["workdir"]))
    assert recorded == set(), recorded


def test_random_initialisation_rebuilds_the_model(matrix):
    """models.*.initialise, which the generic change cannot exercise alone: random rebuilds the model."""
    config = base_config()
    config["models"]["tiny-llama"].update(initialise="random", training={"finetune": "full"})
    recorded, received = changed_stages(matrix["base"], job_params(config, matrix["workdir"]))
    assert "prepare_model" in recorded and "prepare_model" in received, (recorded, received)
