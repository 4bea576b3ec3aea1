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

try:
    xc.check_config(config, "config")
except ConfigError as error:
    raise WorkflowError(str(error)) from None


wildcard_constraints:
    dataset="|".join(config["datasets"]),
    variant="|".join(config["variants"]),
    seed=r"\d+",


MODEL_DIR = f"resources/models/{config['model']['name']}"


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
    return xc.resolved_training(config, wildcards.variant)


def training_json(wildcards):
    return as_json(training_settings(wildcards))


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
    if any(xc.resolved_training(config, v)["nodes"] > 1 for v in config["variants"])
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
    """The demo's tiny tokenizer is trained on the normalised datasets (never on templates)."""
    if config["model"]["source"] != "tiny":
        return []
    return expand("results/data/{dataset}/normalised", dataset=config["datasets"])


def experiment_outputs(file_name):
    """One path per experiment: results/{dataset}/{variant}/seed{seed}/<file_name>."""
    return [f"results/{d}/{v}/seed{s}/{file_name}" for d, v, s in xc.experiments(config)]


def base_eval_outputs(file_name):
    """The untrained model's evaluation per dataset and variant (none when switched off)."""
    if not config["evaluation"]["evaluate_base_model"]:
        return []
    return [f"results/{d}/{v}/base/{file_name}" for d, v in xc.dataset_variants(config)]


def final_outputs():
    return [
        "results/comparison.md",
        "results/comparison.csv",
    ]
