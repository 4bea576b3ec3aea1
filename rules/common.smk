# Helpers shared by the rules: configuration checks, the experiment matrix and the output layout.
import json
import shlex
import sys

# The Snakefile and every job import the workflow's own scripts, wherever the working directory is.
sys.path.insert(0, workflow.basedir)
# (Snakemake formats the prefix too, hence the doubled braces.)
shell.prefix(f"export PYTHONPATH={shlex.quote(workflow.basedir)}${{{{PYTHONPATH:+:$PYTHONPATH}}}}; ")

from workflow_scripts.core import experiment_config as xc
from workflow_scripts.data import source_files
from workflow_scripts.core.errors import ConfigError
from workflow_scripts.training import trackers

try:
    xc.check_config(config, "config")
    trackers.check_workflow_tracking(config["tracking"])
except ConfigError as error:
    raise WorkflowError(str(error)) from None


MODELS = xc.models(config)


wildcard_constraints:
    model="|".join(MODELS),
    dataset="|".join(config["datasets"]),
    variant="|".join(config["variants"]),
    seed=r"\d+",


MODEL_DIR = "resources/models/{model}"


def as_json(value):
    """Settings travel to scripts as one JSON argument; Snakemake reruns a job when they change."""
    return json.dumps(value, sort_keys=True)


def dataset_settings(wildcards):
    return as_json(config["datasets"][wildcards.dataset])


def variant_templates(wildcards):
    """A variant's format only (its task's keys): training overrides must not re-tokenise."""
    return as_json(xc.variant_settings(config["variants"][wildcards.variant]))


def dataset_task(wildcards):
    return config["datasets"][wildcards.dataset]["task"]


def training_settings(wildcards):
    return xc.resolved_training(config, wildcards.variant, wildcards.model)


def model_json(wildcards):
    """What prepare_model needs (not the model's training overrides: changing those must not rebuild it)."""
    settings = xc.model_settings(config, wildcards.model)
    return as_json({key: value for key, value in settings.items() if key != "training"})


def trust_remote_code(wildcards):
    return "--trust-remote-code" if MODELS[wildcards.model]["trust_remote_code"] else ""


def training_json(wildcards):
    return as_json(training_settings(wildcards))


class RuntimeOnly:
    """A job argument Snakemake neither stores in .snakemake/metadata nor treats as a rerun trigger (it
    records only params of built-in types): switching a tracker on must not retrain finished experiments."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


def tracking_json(wildcards):
    """train's --tracking: the config's tracking block with this experiment's run name filled in."""
    return RuntimeOnly(as_json(trackers.workflow_tracking(
        config["tracking"], wildcards.model, wildcards.dataset, wildcards.variant, int(wildcards.seed))))


def training_gpu_total(wildcards):
    """GPUs of the whole job (the SLURM plugin's --gpus): per node x nodes."""
    training = training_settings(wildcards)
    return training["gpus"] * training["nodes"]


def training_nodes(wildcards):
    return training_settings(wildcards)["nodes"]


# With several nodes the rule's own command starts one torchrun per node through srun (mpi), so
# the plugin must not wrap it in `srun -n1`; all variants then use this launch mode.
MULTI_NODE_LAUNCH = (
    {"mpi": "srun", "tasks": training_nodes}
    if any(xc.resolved_training(config, v, m)["nodes"] > 1 for v in config["variants"] for m in MODELS)
    else {}
)


def training_threads(wildcards):
    training = training_settings(wildcards)
    return max(training["gpus"], training["cpu_processes"], 1)


def local_source(wildcards):
    """A local dataset's split files are inputs, so editing one reruns its chain (a directory's
    mtime does not change when a file inside is edited in place)."""
    dataset = config["datasets"][wildcards.dataset]
    if dataset["source"]["type"] != "local":
        return []
    splits = dict.fromkeys(dataset["splits"].values())
    if dataset["format"] == "text":  # plain-text corpora: <split>.txt, or gzipped <split>.txt.gz
        paths = [os.path.join(dataset["source"]["path"], f"{split}.txt") for split in splits]
        return [path if os.path.exists(path) or not os.path.exists(f"{path}.gz") else f"{path}.gz" for path in paths]
    return [os.path.join(dataset["source"]["path"], f"{split}.{dataset['format']}") for split in splits]


def local_source_sha256(wildcards):
    """The local source files' content (sha256): a file copied in with an old mtime still reruns download."""
    return as_json(source_files.sha256_of_existing(local_source(wildcards)))


def tiny_model_corpus(wildcards):
    """A tiny model's tokenizer is trained on the normalised datasets it runs on (never on templates)."""
    if MODELS[wildcards.model]["source"] != "tiny":
        return []
    datasets = [d for d in config["datasets"] if wildcards.model in xc.dataset_models(config, d)]
    return expand("results/data/{dataset}/normalised", dataset=datasets)


def experiment_outputs(file_name):
    """One path per experiment: results/{model}/{dataset}/{variant}/seed{seed}/<file_name>."""
    return [f"results/{m}/{d}/{v}/seed{s}/{file_name}" for m, d, v, s in xc.experiments(config)]


def base_eval_outputs(file_name):
    """The untrained model's evaluation per model, dataset and variant (none when switched off)."""
    if not config["evaluation"]["evaluate_base_model"]:
        return []
    return [f"results/{m}/{d}/{v}/base/{file_name}" for m, d, v in xc.model_dataset_variants(config)]


def model_datasets():
    """(model, dataset) pairs of the matrix, one plot each."""
    return list(dict.fromkeys((m, d) for m, d, _ in xc.model_dataset_variants(config)))


def final_outputs():
    return [
        "results/comparison.md",
        "results/comparison.csv",
    ]
