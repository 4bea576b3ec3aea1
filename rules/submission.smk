# Unlabelled splits (datasets.<name>.unlabelled, e.g. a leaderboard's test set whose answers are withheld):
# each trained adapter predicts them in the dataset's submission format; nothing here is ever scored.
# Beside submission_<split>.<format>: <that>.predictions.jsonl (prompts, raw outputs) and <that>.manifest.json.
# (Every output of a rule holds the same wildcards, hence the format in all three names.)


# submission_outputs() (rule all's submissions) is in rules/submission_common.smk.


rule predict:
    input:
        data="results/data/{dataset}/normalised",
        model=MODEL_DIR,
        adapter="results/{model}/{dataset}/{variant}/seed{seed}/adapter",
    output:
        submission="results/{model}/{dataset}/{variant}/seed{seed}/submission_{split}.{fmt}",
        predictions="results/{model}/{dataset}/{variant}/seed{seed}/submission_{split}.{fmt}.predictions.jsonl",
        manifest="results/{model}/{dataset}/{variant}/seed{seed}/submission_{split}.{fmt}.manifest.json",
    log:
        "logs/{model}/{dataset}/{variant}/seed{seed}/predict_{split}_{fmt}.log",
    benchmark:
        "results/benchmarks/{model}/{dataset}/{variant}/seed{seed}/predict_{split}_{fmt}.tsv"
    wildcard_constraints:
        split="train|validation|test",
        fmt="json|jsonl",
    conda:
        "../envs/evaluation.yaml"
    threads: 1
    resources:
        gpu=EVALUATION.gpus,
    params:
        task=dataset_task,
        variant=evaluated_variant,
        metric=dataset_metric,
        evaluation=evaluation_json,
        # The dataset's submission settings (the stage fills in the defaults).
        submission=submission_json,
        trust_remote_code=trust_remote_code,
    shell:
        "python -m workflow_scripts.predict --model {input.model:q} --adapter {input.adapter:q}"
        " --data {input.data:q} --split {wildcards.split} --task {params.task} --variant {params.variant:q}"
        " --metric {params.metric} --evaluation {params.evaluation:q} --submission {params.submission:q}"
        " {params.trust_remote_code} --model-name {wildcards.model:q} --dataset-name {wildcards.dataset:q}"
        " --variant-name {wildcards.variant:q} --seed {wildcards.seed}"
        " --submission-out {output.submission:q} --predictions-out {output.predictions:q}"
        " --manifest-out {output.manifest:q} > {log:q} 2>&1"


# An adapter trained on a mixture (or on another dataset) predicting an evaluated dataset's unlabelled split,
# under on_<dataset>/ of the training run, as evaluate_on scores it.
use rule predict as predict_on with:
    input:
        data="results/data/{dataset}/normalised",
        model=MODEL_DIR,
        adapter="results/{model}/{trained}/{variant}/seed{seed}/adapter",
    output:
        submission="results/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/submission_{split}.{fmt}",
        predictions="results/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/submission_{split}.{fmt}.predictions.jsonl",
        manifest="results/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/submission_{split}.{fmt}.manifest.json",
    log:
        "logs/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/predict_{split}_{fmt}.log",
    benchmark:
        "results/benchmarks/{model}/{trained}/{variant}/seed{seed}/on_{dataset}/predict_{split}_{fmt}.tsv"
