# Helpers shared by the rules: configuration checks, the experiment matrix and the output layout.
import functools
import json
import os
import shlex
from pathlib import Path
import sys

# The Snakefile and every job import the workflow's own scripts, wherever the working directory is.
sys.path.insert(0, workflow.basedir)
# Jobs run `python` from the interpreter's folder that runs Snakemake (`.venv/bin/snakemake` without the
# venv on PATH would otherwise run the system one); a conda/apptainer deployment brings its own python.
OWN_PYTHON = (
    ""
    if workflow.deployment_settings.deployment_method
    else f'export PATH={shlex.quote(os.path.dirname(sys.executable))}:"$PATH"; '
)
# (Snakemake formats the prefix too, hence the doubled braces.)
shell.prefix(f"{OWN_PYTHON}export PYTHONPATH={shlex.quote(workflow.basedir)}${{{{PYTHONPATH:+:$PYTHONPATH}}}}; ")

from workflow_scripts.core import config_reads
from workflow_scripts.core import experiment_config as xc
from workflow_scripts.core import config_files, experiment_set, final_check, recorded_params
from workflow_scripts.checks import scheduler
from workflow_scripts.checks.config import checked_sections
from workflow_scripts.data import source_files, split_layouts, split_names
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.model import model_files, task_fit

# The train rule's resources as Snakemake gives them (--default-resources, then set-resources): its warning signal.
TRAIN_RESOURCES = scheduler.with_default_resources(
    workflow.resource_settings.default_resources, workflow.resource_settings.overwrite_resources
)


def in_user_file(error):
    """A config fault as the one-line error Snakemake prints, named by the user's config file (or --config)
    that holds the key."""
    named = config_files.in_user_file(error, workflow.configfiles, workflow.config_settings.config)
    return WorkflowError(str(named))


try:
    # Every check of the config alone (the same list as python -m workflow_scripts.checks), and the typed
    # sections, read once; the rules hand each stage its part as JSON and the stage types it again.
    COMPARISON, EVALUATION, TRACKING = checked_sections(config, "config")
    # One entry of datasets, models and variants each, typed (core/entry_settings.py).
    DATASETS = xc.dataset_entries(config, "config")
    VARIANTS = xc.variant_entries(config, "config")
    split_names.check_local_splits(DATASETS, "config")
    task_fit.check_vision_language_models(config, "config")  # where the model's config is readable now
    task_fit.check_masked_lm_models(config, "config")
    scheduler.check_signal_timing(config, TRAIN_RESOURCES, "config")
    # Each (model, variant) whose model config is here, against the memory its config declares (a few
    # seconds of torch/transformers imports: once, not again in each job that re-reads the Snakefile).
    if workflow.is_main_process:
        from workflow_scripts.checks.lora_targets import check_lora_targets
        from workflow_scripts.checks.memory import check_declared_memory

        # Each LoRA target against the module names of a model known now (a BERT on a decoder's default
        # names), before the estimate counts the adapters on those names.
        check_lora_targets(config, "config")
        check_declared_memory(config)
except ConfigError as error:
    raise in_user_file(error) from None


MODELS = xc.model_entries(config)
MIXTURES = xc.mixtures(config)
# What a run trains on: a dataset or a mixture (results/{model}/{dataset}/... and tokenised data alike).
ENTRIES = [*DATASETS, *MIXTURES]


wildcard_constraints:
    model="|".join(MODELS),
    dataset="|".join(ENTRIES),
    trained="|".join(ENTRIES),
    variant="|".join(VARIANTS),
    seed=r"\d+",


MODEL_DIR = "resources/models/{model}"


def as_json(value):
    """Settings travel to scripts as one JSON argument; Snakemake reruns a job when they change."""
    return json.dumps(value, sort_keys=True)


def graph_metrics(names):
    """Which of a dataset's metrics read its answers as PENMAN graphs (normalise's gold-graph check)."""
    from workflow_scripts.tasks.metrics import GRAPH_METRICS

    return [name for name in names if name in GRAPH_METRICS]


# The parts of the keys a stage reads partly (config_reads.NARROWED_READS), as its params record them: key ->
# (the part's name, its value). Both metric keys give the dataset's graph metrics, as a set: the gold-graph check
# rejects a gold graph any of them cannot read. None where a dataset has none, so its params stay as they were.
NARROWINGS = {
    key: ("graph_metrics", lambda dataset: sorted(graph_metrics([dataset.metric, *dataset.also_metrics])) or None)
    for key in ("datasets.*.metric", "datasets.*.also_metrics")
}


def dataset_reads(rule):
    """The keys of the job's dataset that ``rule`` reads (core/config_reads.py), from the resolved entry
    (core/recorded_params.py: a default written out records nothing new): its recorded params, so a key it does
    not read reruns nothing, and a narrowed read (normalise's graph metrics) records the part it reads."""
    return lambda wildcards: as_json(recorded_params.recorded_dataset(DATASETS[wildcards.dataset], rule, NARROWINGS))


def dataset_entry(rule):
    """download's and normalise's --dataset: the keys of the entry they declare (core/config_reads.py), whole,
    and the keys an entry cannot be without (config_reads.ENTRY_REQUIRED), typed again by the stage, which reads
    it through config_reads.Declared (an undeclared read fails). Not recorded (RuntimeOnly): their ``reads``
    param (dataset_reads) is the rerun trigger."""
    keys = (
        *config_reads.ENTRY_REQUIRED,
        *config_reads.READS[rule],
        *(key for stage, key in config_reads.NARROWED_READS if stage == rule),
    )
    declared = {rule: keys}

    def entry(wildcards):
        return RuntimeOnly(
            as_json(config_reads.pick(DATASETS[wildcards.dataset].to_dict(), rule, "datasets.*", declared))
        )

    return entry


def variant_templates(wildcards):
    """A variant's format only (its task's keys): training overrides must not re-tokenise; a key written at the
    code's default records nothing new (core/recorded_params.py)."""
    return as_json(recorded_params.recorded_variant(VARIANTS[wildcards.variant]))


def evaluated_variant(wildcards):
    """evaluate's and predict's --variant: the format keys they read (core/config_reads.py), not a training
    loss's class weights, so a class weight changed reruns no untrained model's evaluation."""
    return as_json(recorded_params.recorded_variant(VARIANTS[wildcards.variant], without=("class_weights",)))


def dataset_task(wildcards):
    return DATASETS[wildcards.dataset].task


def dataset_metric(wildcards):
    return DATASETS[wildcards.dataset].metric


def submission_json(wildcards):
    """predict's --submission: how the dataset's unlabelled splits are written."""
    return as_json(DATASETS[wildcards.dataset].submission.to_dict())


def evaluation_json(wildcards):
    """evaluate's --evaluation: the evaluation section with this dataset's split, and training's max_length
    (inputs are cut at evaluation as in training: a classifier's texts)."""
    evaluation = EVALUATION.replace(
        split=xc.evaluation_split(config, wildcards.dataset), max_length=training_settings(wildcards).max_length
    )
    # only the keys evaluate reads (core/config_reads.py): not evaluate_base_model, which decides no score, and
    # max_length only for the tasks that cut their inputs at it (a generation prompt is never cut)
    cut = [
        condition
        for condition in config_reads.conditions_of("evaluate", "training.max_length")
        if config_reads.condition_holds(condition, DATASETS[wildcards.dataset].task)
    ]
    return as_json(
        {
            **config_reads.pick(evaluation.to_dict(), "evaluate", "evaluation"),
            **({"max_length": evaluation.max_length} if cut else {}),
        }
    )


def untrained_base_argument(wildcards):
    """evaluate_base's loading: '' (the base as it is), or for a QLoRA variant under evaluation.qlora_base:
    quantised the bitsandbytes settings its adapters are scored on, so that 'gain over untrained' holds no
    quantisation effect."""
    record = training_settings(wildcards).quantization_record()
    if record is None or EVALUATION.qlora_base != "quantised":
        return ""
    # unrecorded: its compute dtype (training.precision when not set) is replaced by the evaluation's dtype
    # (model/quantization.evaluation_base); the rest is recorded by untrained_base_record
    return RuntimeOnly(f"--base-quantization {shlex.quote(as_json(record))}")


def untrained_base_record(wildcards):
    """evaluate_base's recorded loading: the QLoRA base's bitsandbytes settings less the compute dtype, which
    evaluation replaces by its own; nothing (unrecorded) for a base loaded as it is."""
    record = training_settings(wildcards).quantization_record()
    if record is None or EVALUATION.qlora_base != "quantised":
        return RuntimeOnly("")
    return as_json({key: value for key, value in record.items() if key != "compute_dtype"})


def mixture_json(wildcards):
    """What mix reads of the mixture (not its models: another model list mixes nothing again)."""
    return as_json(config_reads.pick(MIXTURES[wildcards.dataset], "mix", "mixtures.*"))


def mixture_components(wildcards):
    """The components' tokenised data, in the mixture's order, for the mix rule."""
    return {
        name: f"results/data/{name}/tokenised/{wildcards.model}/{wildcards.variant}"
        for name in MIXTURES[wildcards.dataset]["datasets"]
    }


def component_arguments(wildcards, input):
    arguments = [shlex.quote(f"{name}={path}") for name, path in input.items()]
    return " ".join(f"--component {argument}" for argument in arguments)


# Every (model, variant)'s training settings, validated and typed once when the workflow is read.
TRAINING = {(model, variant): xc.training_settings(config, variant, model) for model in MODELS for variant in VARIANTS}


# The check across datasets (a mixture's components, evaluation-only datasets) -----------------------
def cross_contamination_report(wildcards):
    """sanity's extra input: the entry's check across datasets ([] for a run on one dataset alone)."""
    trained, checked = xc.cross_contamination_datasets(config, wildcards.dataset)
    return [f"results/data/{wildcards.dataset}/cross_contamination.json"] if checked else []


def cross_contamination_inputs(wildcards):
    trained, checked = xc.cross_contamination_datasets(config, wildcards.dataset)
    return {f"data_{name}": f"results/data/{name}/normalised" for name in dict.fromkeys(trained + checked)}


def cross_contamination_arguments(wildcards):
    trained, checked = xc.cross_contamination_datasets(config, wildcards.dataset)

    def argument(flag, name):
        return f"{flag} {shlex.quote(f'{name}=results/data/{name}/normalised')}"

    return " ".join(
        [*(argument("--train", name) for name in trained), *(argument("--checked", name) for name in checked)]
    )


def cross_contamination_settings(wildcards):
    trained, checked = xc.cross_contamination_datasets(config, wildcards.dataset)
    return as_json(
        {
            name: {
                "contamination": DATASETS[name].contamination.to_dict(),
                # the derived fields' names are what the stage reads; their whole mapping is recorded, so the
                # table (core/config_reads.py: datasets.*.derived) is exact
                "derived": DATASETS[name].to_dict().get("derived", {}),
            }
            for name in dict.fromkeys(trained + checked)
        }
    )


def training_settings(wildcards):
    return TRAINING[wildcards.model, wildcards.variant]


def model_json(wildcards):
    """What prepare_model needs (not the model's training overrides: changing those must not rebuild it; a key
    written at the code's default records nothing new)."""
    return as_json(recorded_params.recorded_model(MODELS[wildcards.model]))


def trust_remote_code(wildcards):
    return "--trust-remote-code" if MODELS[wildcards.model].trust_remote_code else ""


def training_json(wildcards):
    """train's and sanity's --training: the resolved settings as the user wrote them (the stage types them
    again); not the typed settings' full dict, so a new optional key reruns nothing that does not set it.
    Unrecorded (RuntimeOnly): training_record is the rerun trigger."""
    return RuntimeOnly(as_json(xc.resolved_training(config, wildcards.variant, wildcards.model)))


@functools.lru_cache(maxsize=None)
def _training_record(model, variant):
    return as_json(recorded_params.recorded_training(xc.resolved_training(config, variant, model)))


def training_record(wildcards):
    """sanity's and train's recorded training settings: the runtime-only keys (config_reads.RUNTIME_TRAINING_KEYS:
    wall time, memory, checkpoint cadence, workers...) at their schema defaults whatever they are set to, so
    changing one retrains nothing, and a key written at the code's default as if absent (core/recorded_params.py)."""
    return _training_record(wildcards.model, wildcards.variant)


class RuntimeOnly:
    """A job argument Snakemake neither stores in .snakemake/metadata nor treats as a rerun trigger (it
    records only params of built-in types): switching a tracker on must not retrain finished experiments."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def tracking_json(wildcards):
    """train's --tracking: the config's tracking block with this experiment's run name filled in."""
    return RuntimeOnly(
        as_json(TRACKING.with_run(wildcards.model, wildcards.dataset, wildcards.variant, int(wildcards.seed)).to_dict())
    )


def gate_seed(wildcards):
    """sanity's --seed: the first of config seeds (as xc.experiments lists them), the one gate of all the
    experiment's seeds, which differ only in initialisation and data order. RuntimeOnly: a new first seed
    reruns no gate, and so retrains no finished seed."""
    return RuntimeOnly(str(config["seeds"][0]))


def training_gpu_total(wildcards):
    """GPUs of a one-node job (the SLURM plugin's --gpus, and what --resources gpu=N counts). A job on
    several nodes asks per node instead (training_gpus_per_node): --gpus=16 may come as 6 + 2 + 8."""
    training = training_settings(wildcards)
    return training.gpus if training.nodes == 1 else 0


def training_gpus_per_node(wildcards):
    """--gres=gpu:N, which SLURM counts per node: every node gets training.gpus (one torchrun each)."""
    training = training_settings(wildcards)
    return f"gpu:{training.gpus}" if training.nodes > 1 and training.gpus > 0 else ""


def check_gpu_requests():
    """Snakemake silently lowers a job's gpu resource to what --resources gpu=N allows, while the job
    still starts training.gpus processes: refuse such a request when the workflow is parsed instead."""
    limit = workflow.global_resources.get("gpu").value
    if limit is None:  # no --resources gpu (a cluster counts GPUs itself)
        return
    for model, variant in dict.fromkeys((m, v) for m, _, v, _ in xc.experiments(config)):
        training = TRAINING[model, variant]
        total = training.gpus * training.nodes
        if total > limit:
            raise WorkflowError(
                f"variant '{variant}' on model '{model}' asks for {total} GPUs (training.gpus {training.gpus} x "
                f"training.nodes {training.nodes}) but --resources gpu={limit}: Snakemake would silently count "
                f"the job as {limit} GPUs while it starts {total} processes; lower training.gpus (accumulation "
                "grows, the effective batch stays) or raise --resources gpu"
            )
    if EVALUATION.gpus > limit:
        raise WorkflowError(
            f"evaluation.gpus is {EVALUATION.gpus} but --resources gpu={limit}: Snakemake would "
            f"silently count each evaluation as {limit} GPUs; lower evaluation.gpus or raise --resources gpu"
        )


check_gpu_requests()


def published_tables_unedited(wildcards):
    """rule all's check that the published tables are as compare wrote them (core/final_check.check_published),
    an input function so that it runs when the plan is built: only then are the forced rules known, and
    --forcerun compare (or --forceall), the way out of a hand-edited table, writes it anew instead."""
    settings = workflow.dag_settings
    if not (settings.forceall or "compare" in settings.forcerun):
        final_check.check_published(experiment_set_stamp())
    return []


def check_launch_environment():
    """At the start of a real run (the Snakefile's onstart; the executor is known only then): a multi-node
    experiment run by the local executor outside a SLURM allocation, and a SLURM run without the settings
    training relies on (checks/scheduler.py), refused before the first job."""
    plugin = workflow.executor_plugin
    common = plugin.common_settings if plugin is not None else None
    local_run = bool(common and common.local_exec and not common.dryrun_exec and not common.touch_exec)
    try:
        scheduler.check_multi_node_allocation(config, local_run, os.environ, "config")
    except ConfigError as error:
        raise in_user_file(error) from None
    scheduler.check_slurm_submission(
        config,
        plugin.cli_prefix if plugin is not None else None,
        TRAIN_RESOURCES,
        # The retries Snakemake gives train: preemptible-retries where train is preemptible (None without it: a
        # TypeError at the first exit 75), else --retries.
        workflow.get_rule("train").restart_times,
        "config",
    )


def training_nodes(wildcards):
    return training_settings(wildcards).nodes


# With several nodes the rule's own command starts one torchrun per node through srun (mpi), so the
# plugin must not wrap it in `srun -n1`. The resources are per job: a one-node job beside them gets an
# empty mpi (the plugin then asks no task count of it, which it refuses as tasks=1 under mpi) and runs
# in the batch step too. Without multi-node variants the rules carry none of these keys.
MULTI_NODE_LAUNCH = (
    {
        "mpi": lambda w: "srun" if training_nodes(w) > 1 else "",
        "tasks": training_nodes,
        "gres": training_gpus_per_node,
    }
    if any(training.nodes > 1 for training in TRAINING.values())
    else {}
)


def training_threads(wildcards):
    """Cores per node (the plugin's --cpus-per-task; one task per node): each rank's main process and
    its DataLoader workers, i.e. processes per node x (training.dataloader_workers + 1)."""
    training = training_settings(wildcards)
    return max(training.gpus, training.cpu_processes, 1) * (training.dataloader_workers + 1)


# Below this much normalised data, tokenising takes well under a second: pretokenise gets one core
# instead of the tokenizer's pool, so that the other cores run other jobs meanwhile (the demo's 12
# pretokenise jobs, 50-490 KB each, held both of 2 cores for ~70 s, mostly for their start-up).
PRETOKENISE_ONE_CORE_BYTES = 4 * 2**20


def pretokenise_threads(wildcards, input):
    """The fast tokenizer's thread pool (and pretokenise's processes, workflow_scripts/pretokenise.py) for
    data worth it; Snakemake scales 8 down to --cores. Evaluated once the normalised data exist."""
    size = sum(
        os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(input.data) for name in names
    )
    return 1 if size < PRETOKENISE_ONE_CORE_BYTES else 8


def local_source(wildcards):
    """A local dataset's split files are inputs, so editing one reruns its chain (a directory's
    mtime does not change when a file inside is edited in place)."""
    dataset = DATASETS[wildcards.dataset]
    if dataset.source.type != "local":
        return []
    splits = dict.fromkeys(dataset.splits.values())
    # an image folder's metadata, listed files, or <split>.<format> (a line format's compressed .gz/.bz2 where that is there)
    return [str(path) for split in splits for path in split_layouts.local_files(dataset, split)]


def local_source_stamp(wildcards):
    """download's input for a local source: a small stamp of its files' content (data/source_files.content_stamp),
    rewritten only when a byte changes. Not the files themselves: Snakemake checksums only inputs under 1 MB,
    so a touched larger file reran the whole chain."""
    files = local_source(wildcards)
    return [source_files.content_stamp(f"dataset-{wildcards.dataset}", files)] if files else []


def local_model_stamp(wildcards):
    """prepare_model's input for a local model (``source: local``): the stamp of the content of the files it
    copies (model/model_files.py), so new weights at the same path copy the model again and rerun everything after
    (a folder's time does not change when a file inside is replaced), and a file it never reads reruns nothing."""
    model = MODELS[wildcards.model]
    if model.source != "local":
        return []
    return [source_files.content_stamp(f"model-{wildcards.model}", model_files.local_model_files(model.path))]


def local_model_sha256(wildcards):
    """prepare_model's parameter for a local model: its folder's content, so new weights copied in with old times
    copy it again too. Unrecorded (RuntimeOnly '') for any other source: their params stay as they were."""
    model = MODELS[wildcards.model]
    if model.source != "local":
        return RuntimeOnly("")
    folder = Path(model.path)
    return source_files.files_fingerprint([(folder, path) for path in model_files.local_model_files(folder)])


def local_source_sha256(wildcards):
    """The local source files' content (sha256): a file copied in with an old mtime still reruns download."""
    return as_json(source_files.sha256_of_existing(local_source(wildcards)))


def local_images_sha256(wildcards):
    """The content of the images download copies (images/, an image folder's splits): not inputs, so
    replacing an image's bytes reruns download through this parameter (per-file hashes cached)."""
    return source_files.tree_fingerprint(source_files.image_dirs(DATASETS[wildcards.dataset]))


def tiny_model_corpus(wildcards):
    """A tiny model's tokenizer is trained on the normalised datasets it runs on (never on templates)."""
    if MODELS[wildcards.model].source != "tiny":
        return []
    return expand("results/data/{dataset}/normalised", dataset=xc.trained_datasets(config, wildcards.model))


def experiment_outputs(file_name):
    """One path per training run: results/{model}/{dataset or mixture}/{variant}/seed{seed}/<file_name>."""
    return [f"results/{m}/{d}/{v}/seed{s}/{file_name}" for m, d, v, s in xc.experiments(config)]


def evaluation_outputs(file_name):
    """One path per evaluation: the run's own directory, or its on_<dataset>/ for another dataset."""
    return [
        os.path.join(f"results/{m}/{t}/{v}/seed{s}", xc.evaluation_subdirectory(t, d), file_name)
        for m, t, v, s, d in xc.evaluations(config)
    ]


def base_eval_outputs(file_name):
    """The untrained model's evaluation per model, dataset and variant (none when switched off)."""
    if not EVALUATION.evaluate_base_model:
        return []
    return [f"results/{m}/{d}/{v}/base/{file_name}" for m, d, v in xc.model_dataset_variants(config)]


def score_plots():
    """One score plot per (model, trained on, evaluated dataset)."""
    return list(dict.fromkeys(xc.plot_names(m, t, d)[0] for m, t, _, _, d in xc.evaluations(config)))


def loss_plots():
    """One loss plot per (model, trained on)."""
    return list(dict.fromkeys(xc.plot_names(m, t, t)[1] for m, t, _, _ in xc.experiments(config)))


def experiment_set_stamp():
    """compare's stamp, named by a hash of what it compares (core/experiment_set.py): a config whose set
    differs from the one the comparison holds reruns compare, and every missing job before it."""
    evaluated = dict.fromkeys(d for *_, d in xc.evaluations(config))
    return experiment_set.stamp_path(
        {
            "experiments": [list(e) for e in xc.evaluations(config)],
            # what compare reads of the section (not the power threshold: power's alone)
            "comparison": config_reads.pick(COMPARISON.to_dict(), "compare", "comparison"),
            "with_base": EVALUATION.evaluate_base_model,
            # what else decides the table (issue 35): the seeds, each dataset's metrics and evaluation settings
            "seeds": list(config["seeds"]),
            "metrics": {d: [DATASETS[d].metric, *DATASETS[d].also_metrics] for d in evaluated},
            "evaluation": {
                d: {
                    **config_reads.pick(EVALUATION.to_dict(), "evaluate", "evaluation"),
                    "split": xc.evaluation_split(config, d),
                }
                for d in evaluated
            },
        }
    )


def final_outputs():
    """The comparison, its set's stamp, and every run's own evaluation: Snakemake does not rerun a job whose
    outputs exist for inputs that are merely missing, so a new experiment must be a target itself."""
    return [
        "results/comparison.md",
        "results/comparison.csv",
        experiment_set_stamp(),
        *evaluation_outputs("eval.json"),
        *base_eval_outputs("eval.json"),
        *power_reports(),
    ]


def also_metrics_argument(wildcards):
    """evaluate's --also-metrics (datasets.<name>.also_metrics); empty when none, so params stay as they were."""
    names = list(DATASETS[wildcards.dataset].also_metrics)
    return f"--also-metrics {shlex.quote(as_json(names))}" if names else ""


# The task's metric during training (training.validation.metric_examples) ---------------------------
def validation_metric_datasets(wildcards):
    """The datasets train scores the metric on (a mixture's components), none when the metric is off."""
    if training_settings(wildcards).validation.metric_examples is None:
        return []
    entry = wildcards.dataset
    return list(MIXTURES[entry]["datasets"]) if entry in MIXTURES else [entry]


def validation_metric_data(wildcards):
    """train's extra inputs: each scored dataset's normalised data ([] when off: existing runs keep theirs)."""
    return [f"results/data/{name}/normalised" for name in validation_metric_datasets(wildcards)]


def validation_metric_argument(wildcards):
    """train's --validation-metric; when off, an empty argument Snakemake does not record, so turning the
    feature on elsewhere reruns nothing that does not use it."""
    names = validation_metric_datasets(wildcards)
    if not names:
        return RuntimeOnly("")
    spec = {
        "task": xc.entry_task(config, wildcards.dataset),
        "variant": VARIANTS[wildcards.variant].to_dict(),
        "evaluation": {
            "max_new_tokens": EVALUATION.max_new_tokens,
            "batch_size": EVALUATION.batch_size,
            "max_length": training_settings(wildcards).max_length,
        },
        "datasets": [
            {"name": name, "data": f"results/data/{name}/normalised", "metric": DATASETS[name].metric} for name in names
        ],
    }
    return f"--validation-metric {shlex.quote(as_json(spec))}"


# Power before training (rules/power.smk) -------------------------------------------------------------
def power_variants(wildcards):
    """The variants whose prompts the untrained model is scored with on this (model, dataset)."""
    return [v for m, d, v in xc.model_dataset_variants(config) if (m, d) == (wildcards.model, wildcards.dataset)]


def power_gate(wildcards):
    """sanity's extra input, always none: a gate that has not passed yet (no sanity.json) waits until the power
    checkpoint of every dataset the entry is scored on has run (checkpoints.power.get raises until then, and
    Snakemake re-evaluates this afterwards), so an underpowered design stops before any training. Once the gate
    has passed, a rerun estimate (another evaluation setting) does not rerun it, so nothing is retrained. The
    recorded input list is the same either way (empty), so it is no rerun trigger. Not ancient(): see
    rules/power.smk. Without the untrained model's evaluation there is no estimate (and checks.config refuses
    comparison.min_detectable_effect then)."""
    if not EVALUATION.evaluate_base_model:
        return []
    gate = f"results/{wildcards.model}/{wildcards.dataset}/{wildcards.variant}/sanity.json"
    if os.path.exists(gate):
        return []
    keep_gate_under_until(gate)
    for name in xc.evaluated_datasets(config, wildcards.dataset, wildcards.model):
        checkpoints.power.get(model=wildcards.model, dataset=name)
    return []


def keep_gate_under_until(gate):
    """``snakemake --until sanity``: name a gate that waits for the power checkpoint a target file, as ``snakemake
    <gate>`` does, or Snakemake drops it (9.27, snakemake/dag.py). Once the checkpoint's output exists,
    update_checkpoint_dependencies replaces the waiting gate with a new job (replace_job), whose reason
    update_needrun computes afresh as a target job: for a rule with wildcards it asks only for the outputs its
    dependants need or the target files, and --until has already removed the dependants (set_until_jobs, then
    cleanup), so the new gate needs nothing (unless a job making its own inputs is still to run) and the run ends at
    exit 0 without it. The power check cannot be a plain input instead: a gate would then rerun, and retrain every
    seed, whenever the estimate reruns or a threshold is added (docs/reruns.md). Only the target-file set changes,
    and only under --until sanity."""
    dag = workflow.dag
    if dag is not None and "sanity" in dag.untilrules:
        dag.targetfiles.add(gate)


def gate_power_check(wildcards):
    """sanity's --min-detectable-effect and --power-report of each dataset the entry is scored on: the gate checks
    the threshold itself whenever it runs, as power_gate holds it back only until it first passes (a threshold
    added later, with the gate rerun as a target, was never checked). RuntimeOnly: a new threshold reruns no
    gate (the power reports, targets of the workflow, are rechecked by the power rule)."""
    threshold = COMPARISON.min_detectable_effect
    if threshold is None or not EVALUATION.evaluate_base_model:
        return RuntimeOnly("")
    reports = [
        f"results/{wildcards.model}/{name}/power.json"
        for name in xc.evaluated_datasets(config, wildcards.dataset, wildcards.model)
    ]
    return RuntimeOnly(
        " ".join(
            [f"--min-detectable-effect {threshold!r}"] + [f"--power-report {shlex.quote(report)}" for report in reports]
        )
    )


def power_reports():
    """Every (model, evaluated dataset)'s power report: targets of the workflow, so an estimate whose inputs
    changed is rerun (and, above comparison.min_detectable_effect, fails the run) after training too."""
    if not EVALUATION.evaluate_base_model:
        return []
    return sorted(
        {
            f"results/{m}/{d}/power.json"
            for m, t, _, _ in xc.experiments(config)
            for d in xc.evaluated_datasets(config, t, m)
        }
    )
