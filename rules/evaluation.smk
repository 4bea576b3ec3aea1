# Evaluation of each adapter (and of the untrained base model), then the comparison over seeds.


rule evaluate:
    input:
        data="results/data/{dataset}/normalised",
        model=MODEL_DIR,
        adapter=EXPERIMENT_DIR + "/adapter",
    output:
        predictions=EXPERIMENT_DIR + "/predictions.jsonl",
        summary=EXPERIMENT_DIR + "/eval.json",
    params:
        variant=variant_templates,
        metric=lambda wildcards: config["datasets"][wildcards.dataset]["metric"],
        evaluation=as_json(config["evaluation"]),
        trust_remote_code="--trust-remote-code" if config["model"]["trust_remote_code"] else "",
    resources:
        gpu=config["evaluation"]["gpus"],
    log:
        EXPERIMENT_DIR.replace("results/", "logs/", 1) + "/evaluate.log",
    benchmark:
        EXPERIMENT_DIR.replace("results/", "results/benchmarks/", 1) + "/evaluate.tsv"
    conda:
        "../envs/evaluation.yaml"
    threads: 1
    shell:
        "python -m workflow_scripts.evaluate --model {input.model:q} --adapter {input.adapter:q}"
        " --data {input.data:q} --variant {params.variant:q} --metric {params.metric}"
        " --evaluation {params.evaluation:q} {params.trust_remote_code}"
        " --predictions-out {output.predictions:q} --summary-out {output.summary:q} > {log:q} 2>&1"


rule evaluate_base:
    input:
        data="results/data/{dataset}/normalised",
        model=MODEL_DIR,
    output:
        predictions=BASE_EVAL_DIR + "/predictions.jsonl",
        summary=BASE_EVAL_DIR + "/eval.json",
    params:
        variant=variant_templates,
        metric=lambda wildcards: config["datasets"][wildcards.dataset]["metric"],
        evaluation=as_json(config["evaluation"]),
        trust_remote_code="--trust-remote-code" if config["model"]["trust_remote_code"] else "",
    resources:
        gpu=config["evaluation"]["gpus"],
    log:
        "logs/{dataset}/{variant}/base/evaluate.log",
    benchmark:
        "results/benchmarks/{dataset}/{variant}/base/evaluate.tsv"
    conda:
        "../envs/evaluation.yaml"
    threads: 1
    shell:
        "python -m workflow_scripts.evaluate --model {input.model:q}"
        " --data {input.data:q} --variant {params.variant:q} --metric {params.metric}"
        " --evaluation {params.evaluation:q} {params.trust_remote_code}"
        " --predictions-out {output.predictions:q} --summary-out {output.summary:q} > {log:q} 2>&1"


rule compare:
    input:
        summaries=experiment_outputs(EXPERIMENT_DIR + "/eval.json"),
        predictions=experiment_outputs(EXPERIMENT_DIR + "/predictions.jsonl"),
        manifests=experiment_outputs(EXPERIMENT_DIR + "/run_manifest.json"),
        train_logs=experiment_outputs(EXPERIMENT_DIR + "/train_log.jsonl"),
        base_summaries=base_eval_outputs(BASE_EVAL_DIR + "/eval.json"),
    output:
        csv="results/comparison.csv",
        markdown="results/comparison.md",
    params:
        comparison=as_json(config["comparison"]),
        experiments=as_json([list(e) for e in xc.experiments(config)]),
    log:
        "logs/compare.log",
    benchmark:
        "results/benchmarks/compare.tsv"
    conda:
        "../envs/evaluation.yaml"
    threads: 1
    shell:
        "python -m workflow_scripts.compare --results-dir results --experiments {params.experiments:q}"
        " --comparison {params.comparison:q} --out-csv {output.csv:q} --out-markdown {output.markdown:q}"
        " > {log:q} 2>&1"
