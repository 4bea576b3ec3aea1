# Evaluation of each adapter (and of the untrained base model), then the comparison over seeds.


rule evaluate:
    input:
        data="results/data/{dataset}/normalised",
        model=MODEL_DIR,
        adapter="results/{model}/{dataset}/{variant}/seed{seed}/adapter",
    output:
        predictions="results/{model}/{dataset}/{variant}/seed{seed}/predictions.jsonl",
        summary="results/{model}/{dataset}/{variant}/seed{seed}/eval.json",
    log:
        "logs/{model}/{dataset}/{variant}/seed{seed}/evaluate.log",
    benchmark:
        "results/benchmarks/{model}/{dataset}/{variant}/seed{seed}/evaluate.tsv"
    conda:
        "../envs/evaluation.yaml"
    threads: 1
    resources:
        gpu=EVALUATION.gpus,
    params:
        task=dataset_task,
        variant=evaluated_variant,
        metric=dataset_metric,
        also_metrics=also_metrics_argument,
        evaluation=evaluation_json,
        trust_remote_code=trust_remote_code,
        adapter=lambda wildcards, input: f"--adapter {shlex.quote(input.adapter)}",
        seed=lambda wildcards: wildcards.seed,
    shell:
        "python -m workflow_scripts.evaluate --model {input.model:q} {params.adapter}"
        " --data {input.data:q} --task {params.task} --variant {params.variant:q} --metric {params.metric}"
        " --evaluation {params.evaluation:q} {params.trust_remote_code} {params.also_metrics}"
        " --model-name {wildcards.model:q} --dataset-name {wildcards.dataset:q} --variant-name {wildcards.variant:q} --seed {params.seed}"
        " --predictions-out {output.predictions:q} --summary-out {output.summary:q} > {log:q} 2>&1"


# The untrained base model through the very same command: no adapter, seed "base".
use rule evaluate as evaluate_base with:
    input:
        data="results/data/{dataset}/normalised",
        model=MODEL_DIR,
    output:
        predictions="results/{model}/{dataset}/{variant}/base/predictions.jsonl",
        summary="results/{model}/{dataset}/{variant}/base/eval.json",
    log:
        "logs/{model}/{dataset}/{variant}/base/evaluate.log",
    benchmark:
        "results/benchmarks/{model}/{dataset}/{variant}/base/evaluate.tsv"
    params:
        task=dataset_task,
        variant=evaluated_variant,
        metric=dataset_metric,
        also_metrics=also_metrics_argument,
        evaluation=evaluation_json,
        trust_remote_code=trust_remote_code,
        # no adapter; a QLoRA variant's untrained model loads its base as the variant's adapters are scored
        adapter=untrained_base_argument,
        base_quantization=untrained_base_record,
        seed="base",


# An adapter scored on another dataset than the one it trained on: a mixture's components and the
# evaluation-only datasets of its task, under on_<dataset>/ of the training run.
use rule evaluate as evaluate_on with:
    input:
        data="results/data/{dataset}/normalised",
        model=MODEL_DIR,
        adapter="results/{model}/{trained}/{variant}/seed{seed}/adapter",
    output:
        predictions="results/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/predictions.jsonl",
        summary="results/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/eval.json",
    log:
        "logs/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/evaluate.log",
    benchmark:
        "results/benchmarks/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/evaluate.tsv"


rule compare:
    input:
        summaries=evaluation_outputs("eval.json"),
        predictions=evaluation_outputs("predictions.jsonl"),
        manifests=experiment_outputs("run_manifest.json"),
        train_logs=experiment_outputs("train_log.jsonl"),
        base_summaries=base_eval_outputs("eval.json"),
        base_predictions=base_eval_outputs("predictions.jsonl"),
        normalise_reports=sorted({f"results/data/{d}/normalise_report.json" for *_, d in xc.evaluations(config)}),
    output:
        csv=report("results/comparison.csv", caption="../report/comparison.rst", category="Comparison"),
        markdown=report("results/comparison.md", caption="../report/comparison.rst", category="Comparison"),
        experiment_set=experiment_set_stamp(),
        score_plots=[
            report(path, caption="../report/score_plot.rst", category="Comparison", subcategory="Scores")
            for path in [f"results/plots/{name}" for name in score_plots()]
        ],
        loss_plots=[
            report(path, caption="../report/loss_plot.rst", category="Comparison", subcategory="Training loss")
            for path in [f"results/plots/{name}" for name in loss_plots()]
        ],
    log:
        "logs/compare.log",
    benchmark:
        "results/benchmarks/compare.tsv"
    conda:
        "../envs/evaluation.yaml"
    threads: 1
    params:
        # what compare reads of the section (not the power threshold: core/config_reads.py)
        comparison=as_json(config_reads.pick(COMPARISON.to_dict(), "compare", "comparison")),
        experiments=as_json([list(e) for e in xc.evaluations(config)]),
        with_base="--with-base" if EVALUATION.evaluate_base_model else "",
    shell:
        "python -m workflow_scripts.compare --results-dir results --experiments {params.experiments:q}"
        " --comparison {params.comparison:q} {params.with_base} --normalise-reports {input.normalise_reports:q}"
        " --out-csv {output.csv:q} --out-markdown {output.markdown:q}"
        " --experiment-set-out {output.experiment_set:q} --plots-dir results/plots > {log:q} 2>&1"
