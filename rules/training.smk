# The preflight gate and LoRA training. Both run through the same launcher (torchrun, one process
# per declared GPU, or gloo processes on CPU), so the gate sees exactly what training will.
# train resumes by itself from params.checkpoints (not an output, so it survives a failed or
# preempted job); on SIGTERM/SIGUSR1 it checkpoints and exits 75 so a retry/requeue continues it.
# The gate runs once per experiment (model, dataset or mixture, variant), not per seed: it checks the
# configuration, and an experiment's seeds differ only in initialisation and data order.


rule sanity:
    input:
        data="results/data/{dataset}/tokenised/{model}/{variant}",
        model=MODEL_DIR,
        # a mixture's components, evaluation-only datasets: held-out rows against the other datasets' train
        cross_contamination=cross_contamination_report,
        # the minimum detectable effect, from the untrained model's scores (comparison.min_detectable_effect):
        # checked before the gate first runs, never an input afterwards (power_gate, rules/common.smk)
        power=power_gate,
    output:
        report(
            "results/{model}/{dataset}/{variant}/sanity.json",
            caption="../report/sanity.rst",
            category="Sanity checks",
            subcategory="{dataset}",
        ),
    log:
        "logs/{model}/{dataset}/{variant}/sanity.log",
    benchmark:
        "results/benchmarks/{model}/{dataset}/{variant}/sanity.tsv"
    conda:
        "../envs/training.yaml"
    threads: training_threads
    resources:
        **MULTI_NODE_LAUNCH,
        # gpu is the job's total (the SLURM plugin's --gpus); nodes > 1 hands the launch to the
        # rule's own srun (mpi), one torchrun per node (workflow_scripts/launch/launcher.py).
        gpu=training_gpu_total,
        nodes=training_nodes,
        runtime=lambda w: min(training_settings(w).runtime_minutes, 60),
        mem_mb=lambda w: training_settings(w).mem_mb,
    params:
        # recorded: the runtime-only keys at their defaults (training_record); the stage gets them as set
        training=training_record,
        given_training=training_json,
        # the first configured seed, not recorded: adding seeds, or one before the others, reruns no gate
        seed=gate_seed,
        trust_remote_code=trust_remote_code,
        # comparison.min_detectable_effect against the power reports, not recorded: checked whenever the gate runs
        power_check=gate_power_check,
    shell:
        "python -m workflow_scripts.sanity --model {input.model:q} --data {input.data:q}"
        " --training {params.given_training:q} --seed {params.seed} {params.trust_remote_code}"
        " {params.power_check} --out {output:q} > {log:q} 2>&1"


rule train:
    input:
        data="results/data/{dataset}/tokenised/{model}/{variant}",
        model=MODEL_DIR,
        # Not ancient(): Snakemake skips the jobs after a rerun job whose ancient input exists, even those
        # with reasons of their own (snakemake#4166), so a training setting change would rerun only the gate.
        # A new first seed reruns no gate (its seed is not a rerun trigger), so no training reruns for it.
        sanity="results/{model}/{dataset}/{variant}/sanity.json",
        # training.validation.metric_examples: the normalised data the task's metric is scored on
        validation_metric=validation_metric_data,
    output:
        adapter=directory("results/{model}/{dataset}/{variant}/seed{seed}/adapter"),
        train_log="results/{model}/{dataset}/{variant}/seed{seed}/train_log.jsonl",
        manifest="results/{model}/{dataset}/{variant}/seed{seed}/run_manifest.json",
    log:
        "logs/{model}/{dataset}/{variant}/seed{seed}/train.log",
    benchmark:
        "results/benchmarks/{model}/{dataset}/{variant}/seed{seed}/train.tsv"
    conda:
        "../envs/training.yaml"
    threads: training_threads
    resources:
        **MULTI_NODE_LAUNCH,
        gpu=training_gpu_total,
        nodes=training_nodes,
        runtime=lambda w: training_settings(w).runtime_minutes,
        mem_mb=lambda w: training_settings(w).mem_mb,
    params:
        training=training_record,
        given_training=training_json,
        checkpoints="results/{model}/{dataset}/{variant}/seed{seed}/checkpoints",
        tensorboard="results/{model}/{dataset}/{variant}/seed{seed}/tensorboard",
        tracking=tracking_json,
        trust_remote_code=trust_remote_code,
        validation_metric=validation_metric_argument,
    shell:
        "python -m workflow_scripts.train --model {input.model:q} --data {input.data:q}"
        " --training {params.given_training:q} --seed {wildcards.seed} {params.trust_remote_code}"
        " --checkpoint-dir {params.checkpoints:q} --adapter-out {output.adapter:q}"
        " --log-out {output.train_log:q} --manifest-out {output.manifest:q}"
        " --tensorboard-dir {params.tensorboard:q} --tracking {params.tracking:q} {params.validation_metric}"
        " > {log:q} 2>&1"
