# Power before training: from the untrained model's evaluation of each scored dataset, the minimum
# detectable effect of the planned comparison (workflow_scripts/power.py). A checkpoint: a gate that has not
# run yet waits for it (power_gate in rules/common.smk), so with comparison.min_detectable_effect set an
# underpowered design stops before any training; once the gate has passed, a rerun of the estimate (another
# evaluation setting) retrains nothing. Not an ancient() input: Snakemake skips the jobs after a rerun job
# with an ancient input, even those with reasons of their own (snakemake#4166).


checkpoint power:
    input:
        summaries=lambda w: [f"results/{w.model}/{w.dataset}/{v}/base/eval.json" for v in power_variants(w)],
        predictions=lambda w: [f"results/{w.model}/{w.dataset}/{v}/base/predictions.jsonl" for v in power_variants(w)],
    output:
        json="results/{model}/{dataset}/power.json",
        markdown="results/{model}/{dataset}/power.md",
    log:
        "logs/{model}/{dataset}/power.log",
    benchmark:
        "results/benchmarks/{model}/{dataset}/power.tsv"
    conda:
        "../envs/evaluation.yaml"
    threads: 1
    params:
        bases=lambda w: " ".join(
            f"--base {shlex.quote(f'{v}=results/{w.model}/{w.dataset}/{v}/base')}" for v in power_variants(w)
        ),
        # only the threshold: another bootstrap setting must not rerun the estimate
        comparison=as_json({"min_detectable_effect": COMPARISON.min_detectable_effect}),
    # The one-line estimate goes to the terminal as well as the log: it is read before training starts
    # (pipefail: the stage's refusal must fail the job, not tee's success; common.smk's prefix replaces
    # Snakemake's default strict-mode one).
    shell:
        "set -o pipefail; python -m workflow_scripts.power --model-name {wildcards.model:q} --dataset-name {wildcards.dataset:q}"
        " {params.bases} --comparison {params.comparison:q}"
        " --out-json {output.json:q} --out-markdown {output.markdown:q} 2>&1 | tee {log:q}"
