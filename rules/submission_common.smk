# Paths of the predictions of unlabelled splits (rules/submission.smk), for rule all.


def submission_outputs():
    """One submission per evaluation of a dataset with unlabelled splits, per unlabelled split:
    results/{model}/{trained}/{variant}/seed{seed}/[on_{dataset}/]submission_{split}.{format}."""
    return [
        os.path.join(
            f"results/{m}/{t}/{v}/seed{s}",
            xc.evaluation_subdirectory(t, d),
            f"submission_{split}.{DATASETS[d].submission.format}",
        )
        for m, t, v, s, d in xc.evaluations(config)
        for split in DATASETS[d].unlabelled
    ]
