# Data stages: download (local rule), normalisation, model preparation (local rule), pre-tokenisation.


localrules:
    download,
    prepare_model,


rule download:
    input:
        local_source_stamp,  # the local source files' content (a stamp): a touch alone reruns nothing
    output:
        raw=directory("results/data/{dataset}/raw"),
        manifest="results/data/{dataset}/download_manifest.json",
    log:
        "logs/download/{dataset}.log",
    benchmark:
        "results/benchmarks/download/{dataset}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 1
    params:
        reads=dataset_reads("download"),  # the keys it reads (core/config_reads.py): its rerun trigger
        dataset=dataset_entry("download"),
        source_sha256=local_source_sha256,  # content, not clocks, decides a rerun
        images_sha256=local_images_sha256,  # images are copied, not inputs: their content decides too
    shell:
        "python -m workflow_scripts.download --name {wildcards.dataset:q} --dataset {params.dataset:q}"
        " --out {output.raw:q} --manifest {output.manifest:q} > {log:q} 2>&1"


rule normalise:
    input:
        raw="results/data/{dataset}/raw",
    output:
        data=directory("results/data/{dataset}/normalised"),
        report=report(
            "results/data/{dataset}/normalise_report.json",
            caption="../report/normalise.rst",
            category="Data",
        ),
    log:
        "logs/normalise/{dataset}.log",
    benchmark:
        "results/benchmarks/normalise/{dataset}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 1
    params:
        reads=dataset_reads("normalise"),
        dataset=dataset_entry("normalise"),
    shell:
        "python -m workflow_scripts.normalise --name {wildcards.dataset:q} --dataset {params.dataset:q}"
        " --raw {input.raw:q} --out {output.data:q} --report {output.report:q} > {log:q} 2>&1"


rule prepare_model:
    input:
        corpus=tiny_model_corpus,
        local=local_model_stamp,  # a local model folder's content: new weights copy it again
    output:
        directory(MODEL_DIR),
    log:
        "logs/prepare_model/{model}.log",
    benchmark:
        "results/benchmarks/prepare_model/{model}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 1
    params:
        model=model_json,
        local_sha256=local_model_sha256,  # a local model's content, not clocks, decides a rerun
    shell:
        "python -m workflow_scripts.prepare_model --model {params.model:q} --out {output:q}"
        " --corpus {input.corpus:q} > {log:q} 2>&1"


rule pretokenise:
    input:
        data="results/data/{dataset}/normalised",
        model=MODEL_DIR,
    output:
        data=directory("results/data/{dataset}/tokenised/{model}/{variant}"),
        report="results/data/{dataset}/tokenised/{model}/{variant}_report.json",
    log:
        "logs/pretokenise/{dataset}/{model}/{variant}.log",
    benchmark:
        "results/benchmarks/pretokenise/{dataset}/{model}/{variant}.tsv"
    wildcard_constraints:
        dataset="|".join(DATASETS),  # a mixture's tokenised data come from the mix rule
    conda:
        "../envs/data.yaml"
    threads: pretokenise_threads
    params:
        task=dataset_task,
        variant=variant_templates,
        max_length=lambda wildcards: training_settings(wildcards).max_length,
    shell:
        "python -m workflow_scripts.pretokenise --model {input.model:q} --data {input.data:q}"
        " --task {params.task} --variant {params.variant:q} --max-length {params.max_length} --threads {threads}"
        " --out {output.data:q} --report {output.report:q} > {log:q} 2>&1"


# A mixture's training data: its components' tokenised train (and validation) rows, drawn in the
# mixture's proportions (workflow_scripts/data/mixture.py).
rule mix:
    input:
        unpack(mixture_components),
    output:
        data=directory("results/data/{dataset}/tokenised/{model}/{variant}"),
        report="results/data/{dataset}/tokenised/{model}/{variant}_report.json",
    log:
        "logs/mix/{dataset}/{model}/{variant}.log",
    benchmark:
        "results/benchmarks/mix/{dataset}/{model}/{variant}.tsv"
    wildcard_constraints:
        dataset="|".join(MIXTURES) or "(?!)",  # no mixtures: the rule matches nothing
    conda:
        "../envs/data.yaml"
    threads: 1
    params:
        mixture=mixture_json,
        components=component_arguments,
    shell:
        "python -m workflow_scripts.mix --mixture {wildcards.dataset:q} --settings {params.mixture:q}"
        " {params.components} --out {output.data:q} --report {output.report:q} > {log:q} 2>&1"


# Held-out rows of one dataset against the train rows of the others a run trains on (a mixture's
# components; evaluation-only datasets against what was trained): checked before the run's gate.
rule cross_contamination:
    input:
        unpack(cross_contamination_inputs),
    output:
        "results/data/{dataset}/cross_contamination.json",
    log:
        "logs/cross_contamination/{dataset}.log",
    benchmark:
        "results/benchmarks/cross_contamination/{dataset}.tsv"
    conda:
        "../envs/data.yaml"
    threads: 1
    params:
        datasets=cross_contamination_arguments,
        settings=cross_contamination_settings,
    shell:
        "python -m workflow_scripts.cross_contamination {params.datasets} --settings {params.settings:q}"
        " --out {output:q} > {log:q} 2>&1"
