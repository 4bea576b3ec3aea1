"""The whole chain through Snakemake on a reduced demo config, and what reruns after a change.

One module-scoped run (the demo's amr_demo x 2 variants x 2 seeds, the demo's settings) backs every test here:
the comparison's content, a changed template rerunning only its variant, and ``--forcerun evaluate`` rerunning
evaluation and the comparison only. (It ran chartqa_demo too, until issue 25: chartqa_demo's whole chain runs
through SLURM in test_slurm.py, and beside ocrvqa_demo in test_mixtures.py's two-model mixture.)
"""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import yaml

import snakemake_fork

ROOT = Path(__file__).resolve().parent.parent
DATASETS = ("amr_demo",)  # the slowest to learn (Smatch, and Smatch++ beside it)
VARIANTS = ("baseline", "mtup")
SEEDS = (1, 2)

pytestmark = pytest.mark.slow


def write_config(directory: Path, **changes) -> Path:
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    config["datasets"] = {name: config["datasets"][name] for name in DATASETS}
    config["models"] = {"tiny-llama": config["models"]["tiny-llama"]}  # the models of these datasets only
    # Generation only: the demo's classification variants would have no dataset here.
    config["variants"] = {name: v for name, v in config["variants"].items() if v.get("task", "generation") == "generation"}
    config["comparison"]["reference_variant"] = "baseline"
    for dataset in config["datasets"].values():
        dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
    config["seeds"] = list(SEEDS)
    for key, value in changes.items():
        section, name = key.split("__")
        config[section][name] = value
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake(directory: Path, *arguments: str, timeout: int = 1200) -> str:
    """``snakemake`` run in ``directory`` on its config.yaml, in a fork of this process (snakemake_fork)."""
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--configfile", str(directory / "config.yaml"),
                                       "--cores", "2", *arguments], cwd=directory, timeout=timeout)
    assert code == 0, output[-6000:]
    return output


def planned_jobs(dry_run_output: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, wildcards) of every job a dry run would execute."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?(?:rule|checkpoint) \w+:)", dry_run_output):
        match = re.match(r"(?:local)?(?:rule|checkpoint) (\w+):", block)
        if not match:
            continue
        wildcards = re.search(r"wildcards: (.*)", block)
        pairs = dict(item.split("=", 1) for item in wildcards.group(1).split(", ")) if wildcards else {}
        jobs.append((match.group(1), pairs))
    return jobs


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("demo")
    write_config(directory)
    snakemake(directory)
    return directory


def test_comparison_covers_the_matrix_and_training_beats_the_untrained_model(finished_run):
    """Only the whole chain at the demo's settings shows training learn: trained beats untrained by 0.3, and the
    gain's interval stays above 0."""
    rows = list(csv.DictReader((finished_run / "results" / "comparison.csv").open()))
    assert {(row["dataset"], row["variant"]) for row in rows} == {(d, v) for d in DATASETS for v in VARIANTS}
    for row in rows:
        assert int(row["n_seeds"]) == len(SEEDS)
        trained, untrained = float(row["mean"]), float(row["base_score"])
        assert trained >= untrained + 0.3, f"{row['dataset']}/{row['variant']}: trained {trained} vs untrained {untrained}"
        assert float(row["gain_ci_low"]) > 0, f"{row['dataset']}/{row['variant']}: gain interval reaches 0"
    markdown = (finished_run / "results" / "comparison.md").read_text()
    assert "Δ vs baseline" in markdown and "mtup" in markdown
    for dataset in DATASETS:
        for variant in VARIANTS:
            for seed in SEEDS:
                experiment = finished_run / "results" / "tiny-llama" / dataset / variant / f"seed{seed}"
                assert (experiment / "adapter" / "adapter_model.safetensors").exists()
                assert (experiment / "run_manifest.json").exists()


def test_second_run_has_nothing_to_do(finished_run):
    """Only after a real run: every output, time and record as a run leaves them, and nothing left to do."""
    output = snakemake(finished_run, "--dry-run")
    assert "Nothing to be done" in output, output[-3000:]


def test_changed_template_reruns_only_that_variant(finished_run):
    """A changed template plans only its variant's chain.
    The module's run is a real one: the plan follows Snakemake's own records of it (test_reruns.py plants them).
    """
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    original = config["variants"]["mtup"]["prompt"]
    config["variants"]["mtup"]["prompt"] = "Q: {question}\nSolve Task 1 then Task 2.\n"
    (finished_run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        jobs = planned_jobs(snakemake(finished_run, "--dry-run"))
    finally:
        config["variants"]["mtup"]["prompt"] = original
        (finished_run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    rules = {rule for rule, _ in jobs}
    assert {"pretokenise", "sanity", "train", "evaluate", "compare"} <= rules, jobs
    # power: the dataset's minimum detectable effect, from the untrained model's scores (evaluate_base of mtup)
    assert rules <= {"pretokenise", "sanity", "train", "evaluate", "evaluate_base", "power", "compare", "all"}, jobs
    for rule, wildcards in jobs:
        if "variant" in wildcards:
            assert wildcards["variant"] == "mtup", (rule, wildcards)


def test_forcerun_evaluate_reruns_evaluation_and_comparison_only(finished_run):
    """``--forcerun evaluate`` plans every evaluation and the comparison, nothing upstream.
    The module's run is a real one: the plan follows Snakemake's own records of it (test_reruns.py plants them).
    """
    jobs = planned_jobs(snakemake(finished_run, "--dry-run", "--forcerun", "evaluate"))
    rules = [rule for rule, _ in jobs]
    assert set(rules) <= {"evaluate", "compare", "all"}, rules
    assert rules.count("evaluate") == len(DATASETS) * len(VARIANTS) * len(SEEDS)
    assert "compare" in rules


def test_a_training_only_setting_retokenises_nothing(finished_run):
    """A training-only setting plans no data stage. (Was test_dag's data-chain run; its first run and template
    edit are the tests above.)
    The module's run is a real one: the plan follows Snakemake's own records of it (test_reruns.py plants them).
    """
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    original = config["training"]["learning_rate"]
    config["training"]["learning_rate"] = original * 0.5
    (finished_run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    try:
        jobs = planned_jobs(snakemake(finished_run, "--dry-run"))
    finally:
        config["training"]["learning_rate"] = original
        (finished_run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    rules = {rule for rule, _ in jobs}
    assert "train" in rules and not rules & {"download", "normalise", "prepare_model", "pretokenise"}, jobs


def test_a_hand_edited_comparison_is_refused_and_the_edit_kept(finished_run):
    """Issue 44: an edited results/comparison.md survived every rerun ("Nothing to be done"). The finished run's
    set records the table's sha256; an edit stops the next run with the check's one message, leaving the edit."""
    table = finished_run / "results" / "comparison.md"
    written = table.read_text()
    table.write_text(written + "\nOur variant wins.\n")
    try:
        code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--configfile", str(finished_run / "config.yaml"),
                                           "--cores", "2", "-n"], cwd=finished_run, timeout=600)
        assert code != 0 and "results/comparison.md changed since compare wrote it" in output, output[-3000:]
        assert table.read_text().endswith("Our variant wins.\n")
    finally:
        table.write_text(written)
    assert "Nothing to be done" in snakemake(finished_run, "-n")


# Last in this module: it runs a second experiment set in the module's directory and then restores the first.
def test_a_second_experiment_set_in_the_same_directory_runs_and_an_unchanged_one_does_nothing(finished_run):
    """The module's run is the first set; the second is another model and dataset with their whole chain.
    (Was in test_dag.py with a first set of its own: one whole chain fewer.) Only real runs show the second set's
    chain run beside the first's results, and the first set's comparison restored from them."""
    from test_dag import job_counts, nothing_to_do, small_chain_config

    second = finished_run / "second.yaml"
    second.write_text(yaml.safe_dump(small_chain_config("ocrvqa_demo", model="tiny-llama-b"), sort_keys=False))

    def run_second(*args):
        code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--configfile", str(second),
                                           "--replace-workflow-config", "--cores", "2", *args], cwd=finished_run)
        assert code == 0, output[-6000:]
        return output

    assert nothing_to_do(snakemake(finished_run, "-n"))  # the first set, unchanged: nothing to do
    planned = job_counts(run_second("-n"))  # another model and dataset: its whole chain
    assert {rule: planned.get(rule) for rule in ("download", "prepare_model", "train", "evaluate", "compare")} == {
        "download": 1, "prepare_model": 1, "train": 1, "evaluate": 1, "compare": 1}, planned
    run_second()
    assert (finished_run / "results/tiny-llama-b/ocrvqa_demo/baseline/seed1/eval.json").exists()
    assert "ocrvqa_demo" in (finished_run / "results/comparison.md").read_text()
    assert nothing_to_do(run_second("-n"))
    # Back to the first set: its runs are all here, only its comparison is redone.
    assert {rule: n for rule, n in job_counts(snakemake(finished_run, "-n")).items() if rule != "all"} == {"compare": 1}
    snakemake(finished_run)
    comparison = (finished_run / "results/comparison.md").read_text()
    assert "amr_demo" in comparison and "ocrvqa_demo" not in comparison
    assert len(list((finished_run / "results/experiment_sets").glob("*.json"))) == 1
    assert nothing_to_do(snakemake(finished_run, "-n"))
