"""The workflow's DAG through Snakemake itself: dry runs of the shipped configs, and a real run of the
data half whose reruns are exactly the jobs a config edit touches."""
import re
import subprocess
import sys

import pytest
import yaml

import snakemake_fork
from data_helpers import ROOT, default_config, without_idle_models


def snakemake(workdir, *args, timeout=600):
    """``snakemake --directory workdir *args`` -> (exit code, output), in a fork of this process (snakemake_fork)."""
    return snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--directory", str(workdir), *args], timeout=timeout)


def job_counts(output):
    """The 'Job stats' table of a (dry) run: rule -> count."""
    table = output.split("Job stats:", 1)[1]
    return {rule: int(count) for rule, count in re.findall(r"^(\w+)\s+(\d+)$", table, re.MULTILINE) if rule != "total"}


def nothing_to_do(output):
    return "Nothing to be done" in output or ("Job stats:" in output and not job_counts(output))


def config_file(tmp_path, config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def absolute_demo_config(datasets=None):
    config = default_config()
    for name in list(config["datasets"]):
        if datasets and name not in datasets:
            del config["datasets"][name]
        else:
            config["datasets"][name]["source"]["path"] = str(ROOT / config["datasets"][name]["source"]["path"])
    return without_idle_models(config)


def test_real_hub_config_builds_its_dag(tmp_path):
    code, output = snakemake(tmp_path, "-n", "-p", "--configfile", str(ROOT / "config" / "real_hub.yaml"),
                             "--replace-workflow-config", "--cores", "8", "--resources", "gpu=8")
    assert code == 0, output
    counts = job_counts(output)
    # one dataset x two variants x three seeds on Qwen2.5-7B
    assert {k: counts[k] for k in ("download", "normalise", "prepare_model", "pretokenise", "train")} == {
        "download": 1, "normalise": 1, "prepare_model": 1, "pretokenise": 2, "train": 6}
    assert "resources/models/qwen2_5-7b-instruct" in output
    assert "HuggingFaceM4/ChartQA" in output and "a09a35458c702b33eeacc393d103063234e8bc28" in output


def test_default_config_builds_its_dag(tmp_path):
    config = absolute_demo_config()
    code, output = snakemake(tmp_path, "-n", "--configfile", str(config_file(tmp_path, config)),
                             "--replace-workflow-config", "--cores", "2")
    assert code == 0, output
    counts = job_counts(output)
    # tiny-llama: 3 generation datasets x 2 generation variants, 1 classification dataset x 2 classification
    # variants; tiny-bert: 1 masked_lm dataset x 2 variants; tiny-llava: 1 vision_language dataset x 2 variants.
    pairs = 3 * 2 + 1 * 2 + 1 * 2 + 1 * 2
    assert counts["download"] == counts["normalise"] == 6 and counts["pretokenise"] == pairs
    assert counts["train"] == pairs * len(config["seeds"]) and counts["prepare_model"] == 3
    assert len(config["seeds"]) > 1 and counts["sanity"] == pairs  # one gate per experiment, not per seed


def test_a_bad_config_stops_snakemake_with_one_message(tmp_path):
    config = absolute_demo_config()
    config["datasets"]["chartqa_demo"]["source"] = {"type": "url", "url": "https://example.org/c.zip"}
    code, output = snakemake(tmp_path, "-n", "--configfile", str(config_file(tmp_path, config)),
                             "--replace-workflow-config", "--cores", "1")
    assert code != 0
    assert "config key 'datasets.chartqa_demo.source.sha256': required when source.type is 'url'" in output


# The data chain run once, its rerun and a template edit: test_workflow_e2e.py (the module's run,
# test_second_run_has_nothing_to_do, test_changed_template_reruns_only_that_variant,
# test_a_training_only_setting_retokenises_nothing).


def test_a_configfile_replaces_the_demo_config_instead_of_merging(tmp_path):
    """With the demo's config/config.yaml in the working directory, only the user's datasets run."""
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(absolute_demo_config(), sort_keys=False))
    path = config_file(tmp_path, absolute_demo_config(["amr_demo"]))
    code, output = snakemake(tmp_path, "-n", "--configfile", str(path), "--cores", "1")
    assert code == 0, output
    assert job_counts(output)["download"] == 1
    assert "dataset=amr_demo" in output and "chartqa_demo" not in output


@pytest.mark.slow
def test_a_source_file_copied_in_with_its_old_time_still_reruns_download(tmp_path):
    """Reruns follow content: `cp -p` of other bytes keeps the old mtime, but the sha256 parameter changes.
    Only after a real run does Snakemake hold the recorded parameter that the changed bytes must contradict."""
    import os
    import shutil

    data = tmp_path / "amr"
    shutil.copytree(ROOT / "demo_data" / "amr", data)
    config = absolute_demo_config(["amr_demo"])
    config["datasets"]["amr_demo"]["source"]["path"] = str(data)
    base = ["--configfile", str(config_file(tmp_path, config)), "--replace-workflow-config", "--cores", "1"]
    code, output = snakemake(tmp_path, *base, "--until", "download")
    assert code == 0, output
    code, output = snakemake(tmp_path, *base, "-n", "--until", "download")
    assert code == 0 and nothing_to_do(output), output
    test_file = data / "test.jsonl"
    times = (test_file.stat().st_atime_ns, test_file.stat().st_mtime_ns)
    lines = test_file.read_text().splitlines()
    test_file.write_text("\n".join(lines[:-1]) + "\n")  # other bytes ...
    os.utime(test_file, ns=times)  # ... with the old modification time, as cp -p leaves it
    code, output = snakemake(tmp_path, *base, "-n", "--until", "download")
    assert code == 0 and job_counts(output).get("download") == 1, output


def test_an_image_replaced_by_other_bytes_reruns_download_and_a_touched_one_does_not(tmp_path):
    """Images are copied by download but are not inputs: their content fingerprint (a parameter) decides."""
    import os
    import shutil

    data = tmp_path / "shapes"
    shutil.copytree(ROOT / "demo_data" / "shapes", data)
    config = absolute_demo_config(["shapes_demo"])
    config["datasets"]["shapes_demo"]["source"]["path"] = str(data)
    base = ["--configfile", str(config_file(tmp_path, config)), "--replace-workflow-config", "--cores", "1"]
    code, output = snakemake(tmp_path, *base, "--until", "download")
    assert code == 0, output
    code, output = snakemake(tmp_path, *base, "-n", "--until", "download")
    assert code == 0 and nothing_to_do(output), output  # an unchanged tree plans nothing
    image = data / "images" / "test-0001.png"
    os.utime(image)  # touched: newer time, same bytes
    code, output = snakemake(tmp_path, *base, "-n", "--until", "download")
    assert code == 0 and nothing_to_do(output), output
    times = (image.stat().st_atime_ns, image.stat().st_mtime_ns)
    image.write_bytes((data / "images" / "test-0002.png").read_bytes())  # other bytes ...
    os.utime(image, ns=times)  # ... with the old time, as cp -p leaves it
    code, output = snakemake(tmp_path, *base, "-n", "--until", "download")
    assert code == 0 and job_counts(output).get("download") == 1, output


# A second experiment set in the same directory (small_chain_config is used by test_workflow_e2e.py) ---
def small_chain_config(dataset: str, model: str = "tiny-llama") -> dict:
    """One dataset, the baseline variant, one seed and two steps on a tiny model (named ``model``): the
    whole chain in about a minute."""
    config = absolute_demo_config([dataset])
    config["models"] = {model: config["models"]["tiny-llama"]}
    config["datasets"][dataset]["models"] = [model]
    config["variants"] = {"baseline": config["variants"]["baseline"]}
    config["comparison"]["reference_variant"] = "baseline"
    config["seeds"] = [1]
    config["training"].update(max_steps=2, warmup_steps=0, checkpoint_every=2, log_every=1, validation={})
    config["evaluation"] = {**config.get("evaluation", {}), "max_examples": 4, "max_new_tokens": 4,
                            "evaluate_base_model": False}
    return config


def test_a_comparison_left_from_an_earlier_run_hides_no_experiment(tmp_path):
    """With only results/comparison.{md,csv} left, Snakemake used to answer 'Nothing to be done': the
    comparison was the only target, and a job is not rerun for inputs that are merely missing."""
    config = absolute_demo_config(["amr_demo"])
    (tmp_path / "results").mkdir()
    for name in ("comparison.md", "comparison.csv"):
        (tmp_path / "results" / name).write_text("from an earlier experiment\n")
    code, output = snakemake(tmp_path, "-n", "--configfile", str(config_file(tmp_path, config)),
                             "--replace-workflow-config", "--cores", "1")
    assert code == 0 and not nothing_to_do(output), output[-3000:]
    counts = job_counts(output)
    runs = 2 * len(config["seeds"])  # baseline and mtup
    assert counts["train"] == counts["evaluate"] == runs and counts["compare"] == 1, counts


# A second set run in the same directory: test_workflow_e2e.py::test_a_second_experiment_set_in_the_same_
# directory_runs_and_an_unchanged_one_does_nothing, whose first set is that module's run.


def test_gpu_smoke_config_builds_its_dag_for_one_gpu(tmp_path):
    """config/gpu_smoke.yaml, the workflow phase of `make gpu-check`, as that phase runs it (dry): one
    generation dataset, two variants, one GPU for training and evaluation, to results/comparison.md."""
    config = yaml.safe_load((ROOT / "config" / "gpu_smoke.yaml").read_text())
    assert config["training"]["gpus"] == 1 and config["training"]["precision"] == "bf16"
    assert config["evaluation"]["gpus"] == 1 and len(config["datasets"]) == 1 and len(config["variants"]) == 2
    for dataset in config["datasets"].values():  # this dry run runs outside the repository
        dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
    code, output = snakemake(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)),
                             "--profile", str(ROOT / "profiles" / "local"), "--cores", "all", "--resources", "gpu=1")
    assert code == 0, output
    counts = job_counts(output)
    assert {k: counts[k] for k in ("download", "normalise", "prepare_model", "pretokenise", "train", "compare")} == {
        "download": 1, "normalise": 1, "prepare_model": 1, "pretokenise": 2, "train": 2, "compare": 1}
    assert "results/comparison.md" in output
    assert re.search(r"--training '[^']*\"gpus\": 1", output) or '"gpus": 1' in output


@pytest.mark.slow  # a real Snakemake run (to download)
def test_without_pulp_snakemake_schedules_greedily(tmp_path):
    """`make gpu-wheels` leaves PuLP out (16 MiB of CBC binaries; the upload must stay under 60 MiB):
    Snakemake then falls back to its greedy scheduler and runs, as the GPU check's workflow phase will.
    Only a real run shows the jobs run under the greedy scheduler."""
    import os

    blocker = tmp_path / "no-pulp" / "pulp"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('pulp is not installed on the GPU machine')\n")
    config = yaml.safe_load((ROOT / "config" / "gpu_smoke.yaml").read_text())
    for dataset in config["datasets"].values():
        dataset["source"]["path"] = str(ROOT / dataset["source"]["path"])
    work = tmp_path / "work"
    work.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(work),
         "--configfile", str(config_file(tmp_path, config)), "--cores", "1", "--until", "download"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker.parent), str(ROOT), os.environ.get("PYTHONPATH", "")])})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Falling back to greedy scheduler" in output
    assert (work / "results" / "data" / "amr_demo").exists()
