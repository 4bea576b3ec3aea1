# The preflight gate and LoRA training. Both run through the same launcher (torchrun, one process
# per declared GPU, or gloo processes on CPU), so the gate sees exactly what training will.


rule sanity:
    input:
        data="results/data/{dataset}/tokenised/{variant}",
        model=MODEL_DIR,
    output:
        report(
            EXPERIMENT_DIR + "/sanity.json",
            caption="../report/sanity.rst",
            category="Sanity checks",
            subcategory="{dataset}",
        ),
    params:
        training=training_json,
        trust_remote_code="--trust-remote-code" if config["model"]["trust_remote_code"] else "",
    resources:
        gpu=training_gpus,
    log:
        EXPERIMENT_DIR.replace("results/", "logs/", 1) + "/sanity.log",
    benchmark:
        EXPERIMENT_DIR.replace("results/", "results/benchmarks/", 1) + "/sanity.tsv"
    conda:
        "../envs/training.yaml"
    threads: training_threads
    shell:
        "python -m workflow_scripts.sanity --model {input.model:q} --data {input.data:q}"
        " --training {params.training:q} --seed {wildcards.seed} {params.trust_remote_code}"
        " --out {output:q} > {log:q} 2>&1"


rule train:
    input:
        data="results/data/{dataset}/tokenised/{variant}",
        model=MODEL_DIR,
        sanity=EXPERIMENT_DIR + "/sanity.json",
    output:
        adapter=directory(EXPERIMENT_DIR + "/adapter"),
        train_log=EXPERIMENT_DIR + "/train_log.jsonl",
        manifest=EXPERIMENT_DIR + "/run_manifest.json",
    params:
        training=training_json,
        checkpoints=EXPERIMENT_DIR + "/checkpoints",
        trust_remote_code="--trust-remote-code" if config["model"]["trust_remote_code"] else "",
    resources:
        gpu=training_gpus,
    log:
        EXPERIMENT_DIR.replace("results/", "logs/", 1) + "/train.log",
    benchmark:
        EXPERIMENT_DIR.replace("results/", "results/benchmarks/", 1) + "/train.tsv"
    conda:
        "../envs/training.yaml"
    threads: training_threads
    shell:
        "python -m workflow_scripts.train --model {input.model:q} --data {input.data:q}"
        " --training {params.training:q} --seed {wildcards.seed} {params.trust_remote_code}"
        " --checkpoint-dir {params.checkpoints:q} --adapter-out {output.adapter:q}"
        " --log-out {output.train_log:q} --manifest-out {output.manifest:q} > {log:q} 2>&1"
