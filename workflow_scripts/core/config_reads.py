"""Which stage (Snakemake rule) reads which config key: the one declaration of what a change reruns.

A key is a schema leaf path in dotted form, ``*`` standing for an entry of a user-named mapping
(``datasets.*.metric``, ``variants.*.prompt``, ``models.*.tiny.hidden_size``); the single ``model:`` block is
spelled ``models.*`` here too. A stage's declared key also covers every key below it
(``datasets.*.contamination`` covers ``datasets.*.contamination.accept``).

Snakemake reruns a job when its recorded ``params`` change, and every job that consumes its outputs. So the
rules (rules/*.smk, through the helpers of rules/common.smk) give each stage, as recorded params, exactly the
keys declared here for it: a key read by a stage reruns that stage and what depends on its outputs; a key no
stage reads reruns nothing. ``tests/test_rerun_matrix.py`` changes every leaf of config/schema.yaml on a
finished run's config and checks that the rules whose params change are exactly ``stages_reading(key)``.

Four kinds of reads besides the plain ones:

- ``RUNTIME_READS``: a key a stage receives without recording it (Snakemake's params of a non-built-in type,
  ``RuntimeOnly`` in rules/common.smk): it reruns nothing (trackers; the gate's seed; the training keys that
  cannot change what is learned, ``RUNTIME_TRAINING_KEYS``). A runtime read below a plain one (``training``
  and ``training.mem_mb``) wins: the key is not recorded.
- ``CONDITIONAL_READS``: a key a stage reads only while a condition holds: ``key`` (that key is set, not null:
  train scores the task's metric during training only under ``training.validation.metric_examples``), or
  ``key=a|b`` (that key has one of the values: evaluate cuts its inputs at ``max_length`` only for the tasks
  that do, ``datasets.*.task=classification|masked_lm``).
- ``NARROWED_READS``: a key a stage reads a part of only (normalise's gold-graph check asks which of a dataset's
  metrics read PENMAN graphs): the stage records that part, so a change of the rest reruns nothing.
- ``PLAN_READS``: a key that decides which jobs exist (the experiment matrix): a change adds or drops jobs
  (a seed: its training, evaluation, and the comparison), and the comparison's experiment set reruns compare.
"""
from __future__ import annotations

import copy
from typing import Iterable, Mapping

# The dataset keys the data chain reads (download's are a subset): everything that shapes the normalised rows.
_NORMALISED_ROWS = (
    "datasets.*.task", "datasets.*.source", "datasets.*.format", "datasets.*.splits", "datasets.*.fields",
    "datasets.*.extra_fields", "datasets.*.flatten", "datasets.*.derived", "datasets.*.labels", "datasets.*.keys",
    "datasets.*.roles", "datasets.*.max_rejected_fraction", "datasets.*.on_invalid_text", "datasets.*.contamination",
    "datasets.*.unlabelled", "datasets.*.submission.id_type", "datasets.*.encoding", "datasets.*.duplicates",
)
# (download looks at fields.image alone, but a dataset entry needs its whole field mapping to be valid)
_DOWNLOADED = ("datasets.*.task", "datasets.*.source", "datasets.*.format", "datasets.*.splits", "datasets.*.fields",
               "datasets.*.encoding")
# A model as prepare_model builds it (not its training overrides).
_MODEL_BUILD = (
    "models.*.source", "models.*.hub_id", "models.*.revision", "models.*.path", "models.*.gguf",
    "models.*.tiny", "models.*.initialise", "models.*.trust_remote_code",
)
# Training settings: the shared block, then the model's and the variant's overrides (merged per experiment).
_TRAINING = ("training", "models.*.training", "variants.*.training")
_MAX_LENGTH = ("training.max_length", "models.*.training.max_length", "variants.*.training.max_length")
# A variant's format: its task's keys (prompt, target, extractor, input, mask_rate, ...), not its training.
_VARIANT_FORMAT = (
    "variants.*.prompt", "variants.*.target", "variants.*.extractor", "variants.*.chat_template",
    "variants.*.images", "variants.*.input", "variants.*.class_weights", "variants.*.mask_rate",
    "variants.*.whole_word", "variants.*.grouping", "variants.*.system_prompt", "variants.*.max_pixels",
    "variants.*.min_pixels",
)
# What an evaluation's numbers depend on (not evaluate_base_model, which decides whether the base is scored).
_EVALUATION = (
    "evaluation.split", "evaluation.max_new_tokens", "evaluation.batch_size", "evaluation.max_examples",
    "evaluation.gpus", "evaluation.qlora_base", "evaluation.dtype", "datasets.*.evaluation_split",
)
_SCORING = ("datasets.*.task", "datasets.*.metric", "datasets.*.also_metrics")
# (not class_weights: a training loss's weights; evaluation scores argmax classes)
_EVALUATE = (*_SCORING, *(key for key in _VARIANT_FORMAT if key != "variants.*.class_weights"), *_EVALUATION,
             "models.*.trust_remote_code")
_EVALUATING = ("evaluate", "evaluate_base", "evaluate_on", "predict", "predict_on")
# Training keys that cannot change what is learned (the schema's "Runtime-only", the fairness guard's and the
# resume fingerprint's analysis.fairness.RUNTIME_ONLY_TRAINING_KEYS less the process counts and log cadence,
# which change the numbers or the log): given to sanity and train unrecorded, so raising runtime_minutes for a
# job that needs resubmits retrains nothing.
RUNTIME_TRAINING_KEYS = (
    "runtime_minutes", "mem_mb", "checkpoint_every", "signal_grace_seconds", "dataloader_workers",
    "sanity_batches", "strategy", "fsdp_mesh",
)
_RUNTIME_TRAINING = tuple(f"{block}.{key}" for block in _TRAINING for key in RUNTIME_TRAINING_KEYS)

READS: Mapping[str, tuple[str, ...]] = {
    "download": _DOWNLOADED,
    "normalise": _NORMALISED_ROWS,
    "prepare_model": _MODEL_BUILD,
    "pretokenise": ("datasets.*.task", *_VARIANT_FORMAT, *_MAX_LENGTH),
    "mix": ("mixtures.*.datasets", "mixtures.*.weights", "mixtures.*.temperature", "mixtures.*.rows",
            "mixtures.*.seed", "mixtures.*.max_passes"),
    "cross_contamination": ("datasets.*.contamination", "datasets.*.derived"),
    "power": ("comparison.min_detectable_effect",),
    "sanity": (*_TRAINING, "models.*.trust_remote_code"),
    "train": (*_TRAINING, "models.*.trust_remote_code"),
    "evaluate": _EVALUATE,
    "evaluate_base": _EVALUATE,
    "evaluate_on": _EVALUATE,
    "predict": (*_EVALUATE, "datasets.*.submission"),
    "predict_on": (*_EVALUATE, "datasets.*.submission"),
    "compare": ("comparison.reference_variant", "comparison.bootstrap_resamples", "comparison.bootstrap_seed",
                "comparison.bootstrap", "comparison.intended_differences", "evaluation.evaluate_base_model"),
}

# Read while the condition holds for the job: (stage, condition) -> keys. A condition is a key (set, not null)
# or ``key=value|value`` (the key has one of the values).
CONDITIONAL_READS: Mapping[tuple[str, str], tuple[str, ...]] = {
    ("train", "training.validation.metric_examples"): (
        "datasets.*.metric", "evaluation.max_new_tokens", "evaluation.batch_size", *_VARIANT_FORMAT,
    ),
    # inputs cut at training's max_length: a classifier's texts, masked LM's test blocks (never a generation
    # prompt, so a generation dataset's untrained evaluation does not rerun for it)
    **{(stage, "datasets.*.task=classification|masked_lm"): _MAX_LENGTH for stage in _EVALUATING},
}

# A part of a key read, and recorded, alone: (stage, key) -> which part.
NARROWED_READS: Mapping[tuple[str, str], str] = {
    ("normalise", key): "when the dataset's graph metrics (smatch, smatchpp) change: its gold-graph check"
    for key in ("datasets.*.metric", "datasets.*.also_metrics")
}

# Keys a dataset entry cannot be without (the schema's required keys beyond the declared ones): given to download
# and normalise so that their entry is valid, never readable by them unless declared (``Declared``).
ENTRY_REQUIRED: tuple[str, ...] = ("datasets.*.metric",)

# Received at run time, never a rerun trigger.
RUNTIME_READS: Mapping[str, tuple[str, ...]] = {
    # the gate runs with the first seed (a new first seed reruns no gate), and checks the power threshold
    # against the power reports whenever it runs (a threshold added later reruns no gate)
    "sanity": ("seeds", "comparison.min_detectable_effect", *_RUNTIME_TRAINING),
    "train": ("tracking", *_RUNTIME_TRAINING),
}

# Keys that decide which jobs exist (the matrix of experiments): a change adds or removes jobs, and reruns
# compare (its experiment set, core/experiment_set.py), not the finished jobs that stay.
PLAN_READS: tuple[str, ...] = (
    "seeds", "models.*.name", "datasets.*.models", "datasets.*.train_alone", "datasets.*.splits", "datasets.*.task",
    "datasets.*.unlabelled", "datasets.*.submission.format", "mixtures.*.datasets", "mixtures.*.models",
    "variants.*.task", "evaluation.evaluate_base_model",
)


# Which stages consume each stage's outputs (rules/*.smk): a rerun stage reruns these in turn, and so on. (sanity
# waits for power only before its first run: a rerun estimate reruns no gate, rules/power.smk.)
CONSUMERS: Mapping[str, tuple[str, ...]] = {
    "download": ("normalise",),
    "normalise": ("prepare_model", "pretokenise", "cross_contamination", "train", "evaluate", "evaluate_base",
                  "evaluate_on", "predict", "predict_on", "compare"),
    "prepare_model": ("pretokenise", "sanity", "train", "evaluate", "evaluate_base", "evaluate_on", "predict",
                      "predict_on"),
    "pretokenise": ("mix", "sanity", "train"),
    "mix": ("sanity", "train"),
    "cross_contamination": ("sanity",),
    "sanity": ("train",),
    "train": ("evaluate", "evaluate_on", "predict", "predict_on", "compare"),
    "evaluate": ("compare",),
    "evaluate_on": ("compare",),
    "evaluate_base": ("power", "compare"),
    "power": (),
    "predict": (),
    "predict_on": (),
    "compare": (),
}


def downstream(stages: Iterable[str]) -> tuple[str, ...]:
    """Every stage that consumes, directly or not, the outputs of ``stages`` (not ``stages`` themselves), in
    the workflow's order."""
    seen: dict[str, None] = {}
    queue = list(stages)
    while queue:
        for consumer in CONSUMERS.get(queue.pop(0), ()):
            if consumer not in seen:
                seen[consumer] = None
                queue.append(consumer)
    order = list(CONSUMERS)
    return tuple(sorted((s for s in seen if s not in stages), key=order.index))


def _parts(path: str) -> list[str]:
    parts = path.split(".")
    return ["models", "*", *parts[1:]] if parts[0] == "model" else parts


def covers(declared: str, path: str) -> bool:
    """Whether the declared key ``declared`` covers ``path``: one is the other or lies below it."""
    a, b = _parts(declared), _parts(path)
    return all(x == y or "*" in (x, y) for x, y in zip(a, b))


def _any_covers(declared: Iterable[str], path: str) -> bool:
    return any(covers(key, path) for key in declared)


def _at_or_below(declared: str, path: str) -> bool:
    """Whether ``path`` is ``declared`` or lies below it (not above it)."""
    return len(_parts(path)) >= len(_parts(declared)) and covers(declared, path)


def _runtime_only(stage: str, path: str) -> bool:
    """A key the stage receives unrecorded although a broader key of its plain reads covers it."""
    return any(_at_or_below(key, path) for key in RUNTIME_READS.get(stage, ()))


def _reads(stage: str, keys: Iterable[str], path: str) -> bool:
    return _any_covers(keys, path) and not _runtime_only(stage, path)


def stages_reading(path: str) -> tuple[str, ...]:
    """The rules whose recorded params depend on the schema leaf ``path`` (dotted, ``*`` for an entry of a
    user-named mapping: ``datasets.*.fields``, ``training.lora.rank``, ``seeds``); empty: a change reruns
    nothing of its own (a key that only decides which jobs exist adds or removes jobs: ``plan_key``). Conditional
    and narrowed reads included (``conditions_of``, ``narrowing_of`` say when and what)."""
    found = [stage for stage, keys in READS.items() if _reads(stage, keys, path)]
    found += [stage for (stage, _), keys in CONDITIONAL_READS.items() if _reads(stage, keys, path)]
    found += [stage for (stage, key) in NARROWED_READS if _reads(stage, (key,), path)]
    return tuple(dict.fromkeys(found))


def unconditional_stages_reading(path: str) -> tuple[str, ...]:
    """``stages_reading`` without the conditional and narrowed reads (what a config that leaves the conditions
    unset reruns, whatever part of the key changes)."""
    return tuple(stage for stage, keys in READS.items() if _reads(stage, keys, path))


def conditions_of(stage: str, path: str) -> tuple[str, ...]:
    """The conditions under which ``stage`` reads ``path`` (empty: it reads it always, or never): a key that must
    be set, or ``key=a|b``, a key that must have one of the values."""
    return tuple(condition for (name, condition), keys in CONDITIONAL_READS.items()
                 if name == stage and _reads(stage, keys, path))


def condition_holds(condition: str, entry_value) -> bool:
    """Whether a condition of CONDITIONAL_READS holds for the job, given the condition key's value there."""
    if "=" in condition:
        return entry_value in condition.split("=", 1)[1].split("|")
    return entry_value is not None


def narrowing_of(stage: str, path: str) -> str | None:
    """What part of ``path`` ``stage`` reads (NARROWED_READS), or None (all of it, or nothing)."""
    for (name, key), part in NARROWED_READS.items():
        if name == stage and _reads(stage, (key,), path):
            return part
    return None


def runtime_stages_reading(path: str) -> tuple[str, ...]:
    return tuple(stage for stage, keys in RUNTIME_READS.items() if _any_covers(keys, path))


def plan_key(path: str) -> bool:
    """Whether ``path`` decides which jobs exist (a change adds or removes jobs and reruns compare)."""
    return _any_covers(PLAN_READS, path)


def _dig(mapping, parts: list[str]):
    for part in parts:
        if not isinstance(mapping, Mapping) or part not in mapping:
            return None
        mapping = mapping[part]
    return mapping


def pick(entry: Mapping, stage: str, prefix: str, reads: Mapping[str, tuple[str, ...]] | None = None) -> dict:
    """The keys of one entry (a dataset's mapping under ``prefix`` ``datasets.*``, a mixture's, a section)
    that ``stage`` reads (``reads``: READS, or RUNTIME_READS), nested as in the entry: what the rule records as
    the stage's params."""
    picked: dict = {}
    depth = len(_parts(prefix))
    for declared in (READS if reads is None else reads).get(stage, ()):
        parts = _parts(declared)
        if len(parts) <= depth or not covers(prefix, declared):
            continue
        inner = parts[depth:]
        value = _dig(entry, inner)
        if value is None:
            continue
        target = picked
        for part in inner[:-1]:
            target = target.setdefault(part, {})
        target[inner[-1]] = copy.deepcopy(value)
    if reads is None:  # a runtime read below a plain one is not recorded (training.mem_mb below training)
        for declared in RUNTIME_READS.get(stage, ()):
            parts = _parts(declared)
            if len(parts) > depth and covers(prefix, declared):
                *above, last = parts[depth:]
                holder = _dig(picked, above)
                if isinstance(holder, dict):
                    holder.pop(last, None)
    return picked


def declared_fields(stage: str, prefix: str) -> frozenset[str]:
    """The top-level keys of one entry (``prefix`` ``datasets.*``) that ``stage`` may read: its plain, conditional,
    narrowed and run-time reads there."""
    depth = len(_parts(prefix))
    keys = [*READS.get(stage, ()), *RUNTIME_READS.get(stage, ()), *(key for (name, key) in NARROWED_READS if name == stage),
            *(key for (name, _), group in CONDITIONAL_READS.items() if name == stage for key in group)]
    return frozenset(_parts(key)[depth] for key in keys if len(_parts(key)) > depth and covers(prefix, key))


class UndeclaredRead(LookupError):
    """A stage read a config key that core/config_reads.py does not declare for it: its params would not carry
    the key, so changing it would rerun nothing (a programming error, never a user's)."""


class Declared:
    """A typed entry (one dataset's settings) seen through what ``stage`` declares (``declared_fields``): an
    undeclared attribute raises UndeclaredRead, so a stage cannot read a key its params do not carry."""

    def __init__(self, settings, stage: str, prefix: str, always: Iterable[str] = ("name",)):
        object.__setattr__(self, "_settings", settings)
        object.__setattr__(self, "_where", (stage, prefix))
        object.__setattr__(self, "_allowed", declared_fields(stage, prefix) | frozenset(always))

    def __getattr__(self, name: str):
        if name.startswith("__") or name in self._allowed:
            return getattr(self._settings, name)
        stage, prefix = self._where
        raise UndeclaredRead(
            f"{stage} read {prefix.replace('*', '<name>')}.{name}, which workflow_scripts/core/config_reads.py does "
            f"not declare for it (READS, CONDITIONAL_READS, NARROWED_READS, RUNTIME_READS): declare it there, so "
            "that its change reruns the stage")

    def to_dict(self) -> dict:
        """The declared keys of the entry (a manifest's record of what the stage read)."""
        return {key: value for key, value in self._settings.to_dict().items() if key in self._allowed}

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self._settings).__name__} is read-only")


def rerun_table() -> list[tuple[str, str, str]]:
    """(kind of change, the stages it reruns itself, the stages that rerun after them): docs/reruns.md's rows."""
    kinds = (
        ("a seed added or removed (`seeds`)", "seeds"),
        ("a dataset's field mapping (`datasets.<name>.fields`)", "datasets.*.fields"),
        ("a prompt template (`variants.<name>.prompt`, `target`, ...)", "variants.*.prompt"),
        ("a training setting (`training.*`, a model's or variant's `training:`)", "training.learning_rate"),
        ("the maximum length (`training.max_length`)", "training.max_length"),
        ("an evaluation setting (`evaluation.max_new_tokens`, `batch_size`, `max_examples`, `split`, ...)",
         "evaluation.max_new_tokens"),
        ("a dataset's metric (`datasets.<name>.metric`)", "datasets.*.metric"),
        ("a further metric (`datasets.<name>.also_metrics`)", "datasets.*.also_metrics"),
        ("a comparison setting (`comparison.reference_variant`, `bootstrap*`, `intended_differences`)",
         "comparison.bootstrap_resamples"),
        ("the power threshold (`comparison.min_detectable_effect`)", "comparison.min_detectable_effect"),
        ("whether the untrained model is scored (`evaluation.evaluate_base_model`)", "evaluation.evaluate_base_model"),
        ("a model's build (`models.<name>.tiny`, `hub_id`, `revision`, ...)", "models.*.revision"),
        ("tracking (`tracking.*`)", "tracking.mlflow.enabled"),
        ("a runtime-only training key (`runtime_minutes`, `mem_mb`, `checkpoint_every`, `signal_grace_seconds`, "
         "`dataloader_workers`, ...)", "training.runtime_minutes"),
    )

    def names(stages: Iterable[str]) -> str:
        return ", ".join(f"`{stage}`" for stage in stages)

    rows = []
    for kind, key in kinds:
        stages = stages_reading(key)
        plain = [stage for stage in stages if not conditions_of(stage, key) and stage in unconditional_stages_reading(key)]
        itself = [names(plain)] if plain else []
        by_condition: dict[str, list[str]] = {}
        for stage in stages:
            if stage not in plain:
                for condition in conditions_of(stage, key):
                    by_condition.setdefault(f"only with {condition_text(condition)}", []).append(stage)
                if narrowing_of(stage, key):
                    by_condition.setdefault(f"only {narrowing_of(stage, key)}, and then all it feeds", []).append(stage)
        itself += [f"{names(group)} ({when})" for when, group in by_condition.items()]
        if plan_key(key):
            itself.append("the jobs it adds (removes)" + ("" if "compare" in plain else ", and `compare`"))
        if not itself:
            runtime = runtime_stages_reading(key)
            read = "reads" if len(runtime) == 1 else "read"
            itself.append("nothing" + (f" (`{'`, `'.join(runtime)}` {read} it at run time only)" if runtime else ""))
        after = downstream(plain)
        rows.append((kind, "; ".join(itself), names(after) if after else "-"))
    # What no config key changes: files' content (core/recorded_params.py, data/source_files.py, model/model_files.py)
    rows += [
        ("a default written out (`encoding: utf-8`, `evaluation.dtype: auto`, a variant's `images: true`, "
         "`initialise: pretrained`, ...)", "nothing: the recorded parameters are built from the resolved values", "-"),
        ("a local data file's content (a row edited; touched or copied with the same bytes: nothing)", "`download`",
         names(downstream(["download"]))),
        ("a local model's files (`source: local`: new weights at the same path; a file `prepare_model` does not copy, "
         "such as `.cache/` or `.git/`: nothing)", "`prepare_model`", names(downstream(["prepare_model"]))),
    ]
    return rows


def condition_text(condition: str) -> str:
    """A condition of CONDITIONAL_READS in words: "`key` set", or "`key` one of a, b"."""
    if "=" in condition:
        key, values = condition.split("=", 1)
        return f"`{key.replace('*', '<name>')}` " + " or ".join(values.split("|"))
    return f"`{condition}` set"


TABLE_START = "<!-- rerun-table:start -->"
TABLE_END = "<!-- rerun-table:end -->"


def rerun_table_markdown() -> str:
    """The generated block of docs/reruns.md (and the README): each kind of change, the stages it reruns by
    itself, and those that rerun after them because they consume their outputs."""
    lines = [TABLE_START, "| change | reruns | and then, through their outputs |", "|---|---|---|"]
    lines += [f"| {kind} | {itself} | {after} |" for kind, itself, after in rerun_table()]
    return "\n".join([*lines, TABLE_END])


def replace_table_block(text: str) -> str:
    """``text`` with its generated block (between TABLE_START and TABLE_END) rewritten."""
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    return text[:start] + rerun_table_markdown() + text[end:]


def write_table_block(path: str) -> None:
    """Rewrite the generated block of the Markdown file at ``path`` (docs/reruns.md, the README)."""
    from pathlib import Path

    file = Path(path)
    file.write_text(replace_table_block(file.read_text()))


if __name__ == "__main__":  # python -m workflow_scripts.core.config_reads docs/reruns.md [README.md ...]
    import sys

    for argument in sys.argv[1:]:
        write_table_block(argument)
