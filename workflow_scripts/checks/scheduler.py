"""Training's time settings against the scheduler's warning signal, when the workflow is read; and, when a run
starts, what a SLURM run needs of its settings (:func:`check_slurm_submission`).

Under the SLURM profile (profiles/slurm) the train rule's ``slurm_extra`` asks ``--signal=USR1@300``: SLURM
signals the job 300 seconds before its time limit, and training checkpoints before it is killed. A
``signal_grace_seconds`` (torchrun's time for that checkpoint) at or above the warning, or a
``runtime_minutes`` (the job's time limit) no longer than it, leaves no time to checkpoint: SLURM kills the
step first. The workflow knows the figure from the resources Snakemake was given (``--profile`` and
``--set-resources`` alike end in ``workflow.resource_settings.overwrite_resources``), so the check names
what the run would really send; without one (a local run) there is nothing to check.
"""
from __future__ import annotations

import re
import signal
from typing import Any, Mapping

from workflow_scripts.checks.config import where_set
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.core.experiment_config import model_entry_variants, training_settings

# sbatch's --signal=[{R|B}:]<sig_num>[@sig_time]; without @sig_time SLURM signals 60 seconds before the limit.
_SIGNAL = re.compile(r"--signal[= ]['\"]?(?:(?P<flags>[RB]+):)?(?P<signal>\w+)(?:@(?P<seconds>\d+))?")
SLURM_DEFAULT_SIGNAL_SECONDS = 60
TRAIN_RULE = "train"


def with_default_resources(default_resources: Mapping[str, Any] | None,
                           overwrite_resources: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The train rule's resources as Snakemake gives them: ``--default-resources`` (every rule's), then
    ``--set-resources``/a profile's ``set-resources`` for train, in the shape the checks here read."""
    train = dict(default_resources or {})
    train.update((overwrite_resources or {}).get(TRAIN_RULE) or {})
    return {**(overwrite_resources or {}), TRAIN_RULE: train}


def signal_warning(overwrite_resources: Mapping[str, Mapping[str, Any]] | None) -> tuple[int, str] | None:
    """(seconds of warning, the setting as written) from the train rule's ``slurm_extra``, or None."""
    match = _signal_match(overwrite_resources)
    if match is None:
        return None
    seconds = int(match["seconds"]) if match["seconds"] else SLURM_DEFAULT_SIGNAL_SECONDS
    return seconds, match.group(0).strip("'\"")


def check_signal_timing(config: Mapping[str, Any], overwrite_resources: Mapping[str, Mapping[str, Any]] | None,
                        source: str | None = None) -> None:
    """Refuse a (model, variant) whose grace or time limit leaves no time to checkpoint after the warning."""
    warning = signal_warning(overwrite_resources)
    if warning is None:
        return
    seconds, written = warning
    figure = (f"the profile's {written} (set-resources: {TRAIN_RULE}: slurm_extra, profiles/slurm), which SLURM "
              f"sends {seconds} s before the job's time limit")
    for model, _, variant in model_entry_variants(config):
        training = training_settings(config, variant, model, source)
        if training.signal_grace_seconds >= seconds:
            raise ConfigError(where_set(config, model, variant, "signal_grace_seconds"),
                              f"is {training.signal_grace_seconds} s, not below {figure}: SLURM would kill the step "
                              f"before the checkpoint ends; set it below {seconds} (e.g. {seconds * 9 // 10}), or "
                              "raise the @seconds of --signal in the profile", source)
        if training.runtime_minutes * 60 <= seconds:
            raise ConfigError(where_set(config, model, variant, "runtime_minutes"),
                              f"is {training.runtime_minutes} min, no longer than {figure}: the warning would come "
                              f"before training starts, so no checkpoint is ever kept; set runtime_minutes above "
                              f"{-(-seconds // 60)} (the time a run needs, plus the warning)", source)


def check_multi_node_allocation(config: Mapping[str, Any], local_run: bool, environ: Mapping[str, str],
                                source: str | None = None) -> None:
    """Refuse, before the first job, a multi-node experiment that a local run outside SLURM starts.

    ``training.nodes > 1`` starts one torchrun per node through ``srun`` inside a SLURM allocation
    (launch/launcher.py); started by Snakemake's local executor outside one (no ``SLURM_JOB_ID``), train would
    refuse it only after the data stages and the gate had run. Called when a real run starts (Snakefile's
    ``onstart``): Snakemake names its executor only then, and a dry run's is ``dryrun`` whatever the profile.
    Inside an allocation (``salloc -N 2`` then ``snakemake --cores all``) the local executor is right."""
    if not local_run or environ.get("SLURM_JOB_ID"):
        return
    for model, _, variant in model_entry_variants(config):
        training = training_settings(config, variant, model, source)
        if training.nodes > 1:
            raise ConfigError(where_set(config, model, variant, "nodes"),
                              f"is {training.nodes}, but this run executes its jobs here, outside a SLURM allocation "
                              "(no SLURM_JOB_ID): one torchrun per node needs SLURM's srun; run with --profile "
                              "profiles/slurm, inside an allocation (salloc), or set training.nodes: 1", source)


def _resource(overwrite_resources: Mapping[str, Mapping[str, Any]] | None, rule: str, name: str) -> Any:
    value = ((overwrite_resources or {}).get(rule) or {}).get(name)
    return getattr(value, "raw", value)  # Snakemake's Resource keeps the expression as given


def _signal_match(overwrite_resources: Mapping[str, Mapping[str, Any]] | None) -> re.Match | None:
    """The ``--signal`` in the train rule's ``slurm_extra``, or None."""
    extra = _resource(overwrite_resources, TRAIN_RULE, "slurm_extra")
    return _SIGNAL.search(str(extra)) if extra else None


def _unheard_warning(overwrite_resources: Mapping[str, Mapping[str, Any]] | None) -> list[str]:
    """What is wrong with train's warning signal, if training never receives it (docs/cluster.md, Signals)."""
    match = _signal_match(overwrite_resources)
    written = match.group(0).strip("'\"")
    if "B" in (match["flags"] or ""):
        return [f"train's {written} signals only the batch shell, the plugin's --wrap script, which has no trap: it "
                "dies and ends the job before training checkpoints (set-resources: train: slurm_extra: "
                "\"'--signal=USR1@300'\", without B:)"]
    name = match["signal"].upper().removeprefix("SIG")
    if name not in ("USR1", str(int(signal.SIGUSR1))):
        return [f"train's {written} sends SIG{name}, but the job's Snakemake ignores SIGUSR1 alone: it dies of "
                f"SIG{name} and the step ends before training checkpoints (set-resources: train: slurm_extra: "
                "\"'--signal=USR1@300'\")"]
    return []


def check_slurm_submission(config: Mapping[str, Any], executor: str | None,
                           overwrite_resources: Mapping[str, Mapping[str, Any]] | None, train_retries: int | None,
                           source: str | None = None) -> None:
    """Refuse, when a run starts, a run that submits to SLURM without the settings training relies on.

    ``snakemake --executor slurm`` without ``--profile profiles/slurm`` (or a profile of one's own that lacks
    them) runs, but: train gets no warning signal before its time limit, so a job that reaches
    ``training.runtime_minutes`` is killed without a checkpoint; a train job that does checkpoint (exit 75) is not
    resubmitted unless Snakemake gives train retries (``train_retries``, the rule's ``restart_times``: a
    preemptible rule's preemptible-retries, None when that is unset, else ``--retries``); and a multi-node job's
    ``tasks`` (one per node) would be read by the plugin as tasks per GPU unless ``tasks_per_gpu: 0``. Each is
    silent until hours are lost, so all of them are named at once, with the profile's line that sets each."""
    if executor != "slurm":
        return
    missing = []
    if signal_warning(overwrite_resources) is None:
        missing.append(f"train gets no warning before its time limit, so a job that reaches training.runtime_minutes "
                       f"is killed without a checkpoint (set-resources: {TRAIN_RULE}: slurm_extra: "
                       "\"'--signal=USR1@300'\")")
    else:
        missing.extend(_unheard_warning(overwrite_resources))
    if not train_retries:
        missing.append("a train job that checkpoints at the warning exits 75 and is not resubmitted to resume "
                       f"(preemptible-rules: [{TRAIN_RULE}], preemptible-retries: 3)")
    multi_node = any(training_settings(config, variant, model, source).nodes > 1
                     for model, _, variant in model_entry_variants(config))
    if multi_node and _resource(overwrite_resources, TRAIN_RULE, "tasks_per_gpu") != 0:
        missing.append("a multi-node train job's one task per node would be read as tasks per GPU "
                       f"(set-resources: {TRAIN_RULE}: tasks_per_gpu: 0)")
    if missing:
        raise WorkflowError("this run submits its jobs to SLURM (--executor slurm) without settings of "
                            "profiles/slurm that training relies on: " + "; ".join(missing)
                            + ". Run with --profile profiles/slurm, or add these lines to your own profile "
                            "(docs/cluster.md)")
