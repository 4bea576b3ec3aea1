# LoRA fine-tuning experiments: datasets x prompt variants x seeds, from raw data to a fair comparison.
# Run: snakemake --cores all [--resources gpu=8]  |  snakemake --profile profiles/slurm
from snakemake.utils import min_version, validate

from workflow_scripts.core import config_files, final_check
from workflow_scripts.launch import launcher

min_version("9.0")

# In a SLURM job step this Snakemake and the rule's shell must outlive the SIGUSR1 of --signal=USR1@300
# that the training answers with a checkpoint (docs/cluster.md, Signals).
launcher.ignore_scheduler_warning_in_job()


# A --configfile replaces the demo config rather than merging into it (otherwise the demo's
# datasets would silently join a real experiment); --config key=value still overrides the demo.
if not workflow.overwrite_configfiles:
    # Snakemake's own reading names neither file nor line of a YAML syntax error: read it strictly first.
    # (A --configfile is read by Snakemake before this file runs, so its syntax errors stay Snakemake's.)
    config_files.read_config_file("config/config.yaml")

    configfile: "config/config.yaml"


# Snakemake's YAML reading keeps the last of two equal keys and dumps the whole config on a schema
# fault: refuse duplicates and report schema faults in one line (never echoing a secret) first.
config_files.check_workflow_config(workflow.configfiles, config)
validate(config, "config/schema.yaml")


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/power.smk"
include: "rules/training.smk"
include: "rules/evaluation.smk"
include: "rules/submission_common.smk"
include: "rules/submission.smk"


rule all:
    default_target: True
    input:
        # A published table edited since compare wrote it is refused (core/final_check.py) when the plan is built,
        # as well as on success (a run with "Nothing to be done" ends before onsuccess).
        published_tables_unedited,
        final_outputs(),
        submission_outputs(),


# Before the first job: what the executor makes impossible (a multi-node experiment run here, outside SLURM).
onstart:
    check_launch_environment()


# After a successful run: nothing planned is left out of date (exit non-zero naming it otherwise; core/final_check.py).
onsuccess:
    final_check.check_up_to_date(workflow)
    final_check.check_published(experiment_set_stamp())
