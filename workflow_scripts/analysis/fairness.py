"""The fairness guard: variants compared on one dataset and seed may differ only in the prompt format.

The seeds compared a 7B baseline trained at 512 tokens against MTUP at 2048 and had to argue by hand
that the comparison was fair. Here the comparison refuses such runs unless the config says the
difference is intended (``comparison.intended_differences``).

What is compared, as dotted keys:
- ``training.<key>``: the resolved training settings each train job recorded in ``run_manifest.json``
  (``settings``), except runtime-only keys that cannot change what is learned;
- ``model.<field>``: the base model's identity recorded by the train job (directory, manifest hash);
- ``evaluation.<key>``: the decoding settings each evaluate job recorded (split, max_new_tokens,
  max_examples), plus the base model it loaded and how it ran (batch size, dtype, device, processes);
- ``evaluation.eval_mask.<key>``: a fixed evaluation mask a task recorded in eval.json (masked LM: the
  rule, the ``max_length`` lines were cut at, and a hash of the scored positions and tokens). Masked-LM
  lines are cut at each variant's training ``max_length``, so variants that differ there are scored on
  different tokens; listing ``training.max_length`` as intended does not cover that, the refusal names
  ``evaluation.eval_mask.*`` (``eval_mask_settings`` states the same at parse time).
An intended-difference entry covers its key and every key below it (``training.lora`` covers
``training.lora.rank``). Template-dependent facts (the tokenised data's cache key) are the prompt
format itself and are not compared.
"""
from __future__ import annotations

from pathlib import PurePath
from typing import Any, Mapping, Sequence

from workflow_scripts.core.errors import WorkflowError

RUNTIME_ONLY_TRAINING_KEYS = frozenset({
    "gpus", "cpu_processes", "nodes", "dataloader_workers", "checkpoint_every", "log_every",
    "runtime_minutes", "mem_mb", "sanity_batches", "memory_headroom", "signal_grace_seconds",
    "strategy",  # ddp and fsdp compute the same update (tests/test_fsdp.py); checkpoints resume under either
    "fsdp_mesh",  # flat or hybrid: the same update (tests/test_fsdp_hybrid.py)
})
MODEL_FIELDS = ("model_dir", "model_manifest_sha256")
EVALUATION_KEYS = ("split", "max_new_tokens", "max_examples")
# How each evaluation was batched and computed (eval.json): greedy bf16 outputs move with the batch size, the
# dtype, the device and the process count (Yuan et al. 2025), so variants must share them.
EVALUATION_RUN_FIELDS = ("batch_size", "dtype", "device", "device_name", "processes")
ABSENT = "<absent>"


def flatten(value: Any, prefix: str) -> dict[str, Any]:
    """Nested mappings as dotted keys; lists and scalars are leaves."""
    if isinstance(value, Mapping):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}"))
        return flat
    return {prefix: value}


def comparable_settings(manifest: Mapping[str, Any], summary: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings that must agree between variants, from a train manifest and (optionally) an eval.json."""
    settings = manifest.get("settings")
    if not isinstance(settings, Mapping):
        raise WorkflowError("run manifest has no 'settings' mapping (the resolved training settings)")
    flat = {}
    for key, value in settings.items():
        if key not in RUNTIME_ONLY_TRAINING_KEYS:
            flat.update(flatten(value, f"training.{key}"))
    for field in MODEL_FIELDS:
        if field in manifest:
            flat[f"model.{field.removeprefix('model_')}"] = manifest[field]
    if summary is not None:
        recorded = summary.get("manifest", {}).get("settings", {}).get("evaluation", {})  # eval.json's record
        for key in EVALUATION_KEYS:
            if key in recorded:
                flat[f"evaluation.{key}"] = recorded[key]
        for field in (*MODEL_FIELDS, *EVALUATION_RUN_FIELDS):
            if field in summary:
                flat[f"evaluation.{field}"] = summary[field]
        if isinstance(summary.get("eval_mask"), Mapping):
            flat.update(flatten(summary["eval_mask"], "evaluation.eval_mask"))
    return flat


def eval_mask_settings(task: Any, training: Mapping[str, Any]) -> dict[str, Any]:
    """At parse time, the ``evaluation.eval_mask.<key>`` entries a task's evaluation takes from the training
    settings (its ``evaluation_training_keys``: masked LM's ``max_length``), so the config-time guard
    refuses what compare would refuse after training."""
    return {f"evaluation.eval_mask.{key}": training[key]
            for key in getattr(task, "evaluation_training_keys", ()) if key in training}


def is_intended(key: str, intended: Sequence[str]) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in intended)


def differences(settings_by_variant: Mapping[str, Mapping[str, Any]], intended: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Keys whose values are not the same for every variant (and not intended): key -> {variant: value}."""
    keys = sorted(set().union(*settings_by_variant.values()))
    found = {}
    for key in keys:
        values = {variant: settings.get(key, ABSENT) for variant, settings in settings_by_variant.items()}
        if len({repr(value) for value in values.values()}) > 1 and not is_intended(key, intended):
            found[key] = values
    return found


def check_fair(dataset: str, seed: int, settings_by_variant: Mapping[str, Mapping[str, Any]],
               sources: Mapping[str, str], intended: Sequence[str]) -> None:
    """Raise one WorkflowError (one line) listing every unintended difference between the variants' runs."""
    found = differences(settings_by_variant, intended)
    if not found:
        return
    shown = "; ".join(
        f"{key}: " + ", ".join(f"{variant}={value!r}" for variant, value in values.items())
        for key, values in found.items()
    )
    keys = ", ".join(sorted(found))
    raise WorkflowError(
        f"unfair comparison on {dataset}, seed {seed}: the variants differ in more than the prompt "
        f"format: {shown} (from {brief_paths(sources)}). Fix: make these settings equal (remove the "
        "variants.<name>.training overrides) and rerun, or, if the difference is intended, list it under "
        f"comparison.intended_differences: [{keys}]"
    )


# What decides an evaluation's numbers among the user's choices (config_reads' evaluation keys): eval.json's
# record of the evaluation settings, and the run fields it writes for batch size and dtype. A run's device is
# not a setting (the fairness guard above compares it between variants).
EVALUATION_SETTING_FIELDS = ("batch_size", "dtype_setting")


def evaluation_settings(summary: Mapping[str, Any]) -> dict[str, Any]:
    """One eval.json's evaluation settings: ``evaluation.<key>`` -> value (absent keys left out)."""
    recorded = summary.get("manifest", {}).get("settings", {}).get("evaluation", {})
    settings = {f"evaluation.{key}": recorded[key] for key in EVALUATION_KEYS if key in recorded}
    settings.update({f"evaluation.{field.removesuffix('_setting')}": summary[field]
                     for field in EVALUATION_SETTING_FIELDS if field in summary})
    return settings


def check_same_evaluation(where: str, settings_by_run: Mapping[str, Mapping[str, Any]],
                          sources: Mapping[str, str]) -> None:
    """Every evaluation of one (model, dataset), trained and untrained, every variant and seed, must have been
    made under the same evaluation settings: a table that mixes them (an untrained score decoded with 64 new
    tokens beside trained ones with 96) compares nothing. One WorkflowError naming the settings and the runs."""
    found = differences(settings_by_run, ())
    if not found:
        return
    shown = "; ".join(f"{key}: " + ", ".join(f"{run}={value!r}" for run, value in values.items())
                      for key, values in found.items())
    raise WorkflowError(
        f"mixed evaluation settings on {where}: {shown} (from {'; '.join(f'{run}: {path}' for run, path in sources.items())}). "
        "The comparison needs every evaluation made under the same settings: run snakemake again (a change of "
        "evaluation settings reruns evaluate and evaluate_base), or delete the stale eval.json files"
    )


def brief_paths(sources: Mapping[str, str]) -> str:
    """The variants' files in one short phrase: '<root>/{baseline,mtup}/seed1/run_manifest.json' when the
    paths differ only in one folder named for the variant, else 'baseline: <path>; mtup: <path>'."""
    parts = {variant: PurePath(path).parts for variant, path in sources.items()}
    lengths = {len(p) for p in parts.values()}
    if len(parts) > 1 and len(lengths) == 1:
        differing = [i for i in range(lengths.pop()) if len({p[i] for p in parts.values()}) > 1]
        if len(differing) == 1 and all(p[differing[0]] == variant for variant, p in parts.items()):
            first = next(iter(parts.values()))
            at = differing[0]
            return str(PurePath(*first[:at], "{" + ",".join(parts) + "}", *first[at + 1:]))
    return "; ".join(f"{variant}: {path}" for variant, path in sources.items())


def evaluation_note(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One line under the comparison: the dtype, device, batch size and processes the evaluations ran with
    (each distinct setting once; an eval.json from before these were recorded says so)."""
    settings = []
    for summary in summaries:
        if "batch_size" not in summary:
            setting = "settings not recorded (eval.json written before batch size and dtype were recorded)"
        else:
            setting = (f"{summary.get('dtype', '?')} on {summary.get('device_name') or summary.get('device', '?')}, "
                       f"batch size {summary['batch_size']}, {summary.get('processes', 1)} process(es)")
        settings.append(setting)
    return f"Evaluation (greedy): {'; '.join(dict.fromkeys(settings))}.\n" if settings else ""
