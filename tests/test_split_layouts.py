"""Split layouts the hubs ship (``data/split_layouts.py``), through download and normalise:

- the Hugging Face image folder (``source.layout: imagefolder``): ``<split>/metadata.jsonl`` (or .csv) with a
  ``file_name`` column and the images beside it, in subfolders too; each planted defect (a missing image
  file, a corrupt image, a row without ``file_name``, a ``file_name`` climbing out of the split folder with
  ``..``) is rejected naming the user's metadata file, the line and the field;
- several files per split (``source.files``: a glob or a list), read in file-name order whatever the list
  order, and a held-out file in another folder; the masked-LM overlap check finds a held-out line planted
  in shard 2; a glob matching nothing is refused when the workflow is parsed, naming dataset and key.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from data_helpers import default_config, run_download, run_normalise, write_jsonl
from vlm_layouts import bar_chart_png, truncated
from workflow_scripts import normalise
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.checks.sections import validate_section
from workflow_scripts.core.entry_settings import DatasetSettings
from workflow_scripts.data.split_names import check_local_splits


def checked(name: str, settings: dict) -> dict:
    return validate_section(settings, "datasets", f"datasets.{name}")


def typed(name: str, settings: dict) -> dict:
    """``{name: the dataset's typed settings}``, as the Snakefile hands check_local_splits."""
    return {name: DatasetSettings.parse(settings, name)}


def rows_of(data: Path, split: str) -> list[dict]:
    from datasets import load_from_disk

    return load_from_disk(str(data))[split].to_list()


# --- the image folder ---
def write_imagefolder(root: Path, fmt: str = "jsonl", train_extra: list[dict] = ()) -> dict[str, bytes]:
    """train/ and test/ folders as datasets' imagefolder ships them; images in a subfolder. Returns name -> bytes."""
    images = {}
    for split, n in (("train", 4), ("validation", 2), ("test", 2)):
        folder = root / split
        (folder / "charts").mkdir(parents=True)
        rows = []
        for k in range(n):
            name = f"charts/{split}_{k}.png"
            images[f"{split}/{name}"] = bar_chart_png({"train": [k + 1, 2 * k + 3, 5], "validation": [7, 1, k + 2]}.get(split, [9, k + 1]))
            (folder / name).write_bytes(images[f"{split}/{name}"])
            rows.append({"file_name": name, "query": f"How tall is bar {k} in {split}?", "label": str(k)})
        if split == "train":
            rows += list(train_extra)
        if fmt == "jsonl":
            write_jsonl(folder / "metadata.jsonl", rows)
        else:
            import csv

            with open(folder / "metadata.csv", "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=["file_name", "query", "label"])
                writer.writeheader()
                writer.writerows(rows)
    return images


def imagefolder_settings(root: Path, fmt: str = "jsonl", **extra) -> dict:
    return {"task": "vision_language", "source": {"type": "local", "path": str(root), "layout": "imagefolder"},
            "format": fmt, "splits": {"train": "train", "test": "test"},
            "fields": {"question": "query", "answers": "label", "image": "file_name"}, "metric": "exact_match", **extra}


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_an_image_folder_is_copied_with_its_images_and_normalised_relative_to_its_split_folder(tmp_path, fmt):
    images = write_imagefolder(tmp_path / "charts", fmt)
    settings = checked("charts", imagefolder_settings(tmp_path / "charts", fmt))
    check_local_splits(typed("charts", settings))
    raw = run_download("charts", settings, tmp_path)
    assert (raw / "train" / f"metadata.{fmt}").is_file() and (raw / "train" / "charts" / "train_0.png").is_file()
    manifest = json.loads((tmp_path / "results" / "charts" / "download_manifest.json").read_text())
    assert manifest["rows"] == {"train": 4, "test": 2}
    data, report = run_normalise("charts", settings, raw, tmp_path)
    train = rows_of(data, "train")
    assert [row["question"] for row in train] == [f"How tall is bar {k} in train?" for k in range(4)]
    assert [row["images"][0] for row in train] == [images[f"train/charts/train_{k}.png"] for k in range(4)]
    assert rows_of(data, "test")[1]["images"][0] == images["test/charts/test_1.png"]
    assert json.loads(report.read_text())["splits"]["train"]["file"] == str(tmp_path / "charts" / "train" / f"metadata.{fmt}")


def test_each_defect_of_an_image_folder_row_is_rejected_naming_the_file_line_and_field(tmp_path):
    root = tmp_path / "charts"
    planted = [
        {"file_name": "charts/not_there.png", "query": "Missing?", "label": "1"},             # line 5
        {"file_name": "charts/broken.png", "query": "Corrupt?", "label": "2"},                # line 6
        {"query": "No file name?", "label": "3"},                                             # line 7
        {"file_name": "../test/charts/test_0.png", "query": "Out of the folder?", "label": "4"},  # line 8
    ]
    write_imagefolder(root, train_extra=planted)
    (root / "train" / "charts" / "broken.png").write_bytes(truncated(bar_chart_png([1, 2, 3])))
    settings = checked("charts", imagefolder_settings(root, max_rejected_fraction=0.6))
    data, report = run_normalise("charts", settings, run_download("charts", settings, tmp_path), tmp_path)
    reasons = json.loads(report.read_text())["reasons"]
    metadata = str(root / "train" / "metadata.jsonl")
    expected = {"missing_image": 5, "unreadable_image": 6, "missing_field": 7, "image_outside_dataset": 8}
    assert set(reasons) == set(expected)
    for reason, line in expected.items():
        [example] = reasons[reason]["examples"]
        assert (example["file"], example["line"], example["field"]) == (metadata, line, "file_name"), example
        assert "results/" not in example["detail"], example  # the user's files, never the raw copy
    assert len(rows_of(data, "train")) == 4


def test_an_image_folder_split_without_its_metadata_is_refused_when_the_workflow_is_parsed(tmp_path):
    write_imagefolder(tmp_path / "charts")
    (tmp_path / "charts" / "test" / "metadata.jsonl").rename(tmp_path / "charts" / "test" / "rows.jsonl")
    with pytest.raises(ConfigError, match=r"datasets\.charts\.splits\.test.*metadata\.jsonl is missing.*rows\.jsonl"):
        check_local_splits(typed("charts", checked("charts", imagefolder_settings(tmp_path / "charts"))))


# --- several files per split ---
def write_gz(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))
    return path


HELD_OUT = [f"held out sentence number {k} about rivers and hills" for k in range(5)]


def write_shards(root: Path, plant: bool = False) -> None:
    """corpus/shards/part-0000{1,2,3}.txt.gz and heldout/test.txt in another folder; ``plant``: shard 2's
    third line is a held-out line."""
    for shard in (1, 2, 3):
        lines = [f"shard {shard} training line {k} on cats and dogs" for k in range(40)]
        if plant and shard == 2:
            lines[2] = HELD_OUT[3]
        write_gz(root / "corpus" / "shards" / f"part-{shard:05d}.txt.gz", lines)
    (root / "heldout").mkdir()
    (root / "heldout" / "test.txt").write_text("".join(line + "\n" for line in HELD_OUT))


def corpus_settings(root: Path, train_files) -> dict:
    return {"task": "masked_lm", "format": "text", "metric": "masked_accuracy",
            "source": {"type": "local", "path": str(root / "corpus"),
                       "files": {"train": train_files, "test": "../heldout/test.txt"}},
            "splits": {"train": "train", "test": "test"}}


def test_a_sharded_corpus_reads_its_shards_in_name_order_beside_a_held_out_file_elsewhere(tmp_path):
    write_shards(tmp_path)
    by_glob = checked("corpus", corpus_settings(tmp_path, "shards/part-*.txt.gz"))
    check_local_splits(typed("corpus", by_glob))
    raw = run_download("corpus", by_glob, tmp_path / "a")
    data, report = run_normalise("corpus", by_glob, raw, tmp_path / "a")
    train = rows_of(data, "train")
    assert len(train) == 120 and [row["id"] for row in train[39:41]] == ["part-00001-40", "part-00002-1"]
    assert [row["text"] for row in rows_of(data, "test")] == HELD_OUT
    # A list in another order reads the same rows in the same order.
    listed = [f"shards/part-{shard:05d}.txt.gz" for shard in (3, 1, 2)]
    by_list = checked("corpus", corpus_settings(tmp_path, listed))
    data_b, _ = run_normalise("corpus", by_list, run_download("corpus", by_list, tmp_path / "b"), tmp_path / "b")
    assert rows_of(data_b, "train") == train
    files = json.loads(report.read_text())["splits"]["train"]["files"]
    assert list(files) == [str(tmp_path / "corpus" / "shards" / f"part-{k:05d}.txt.gz") for k in (1, 2, 3)]


def test_a_held_out_line_inside_shard_two_is_found_by_the_overlap_check(tmp_path):
    write_shards(tmp_path, plant=True)
    settings = checked("corpus", corpus_settings(tmp_path, "shards/part-*.txt.gz"))
    raw = run_download("corpus", settings, tmp_path)
    out, report = tmp_path / "normalised", tmp_path / "normalise_report.json"
    argv = ["--name", "corpus", "--dataset", json.dumps(settings), "--raw", str(raw), "--out", str(out),
            "--report", str(report)]
    with pytest.raises(WorkflowError) as caught:
        normalise.main(argv)
    print(caught.value)
    assert "test-4" in str(caught.value) and "part-00002-3" in str(caught.value), caught.value
    failed = json.loads(normalise.failure_report_path(report).read_text())
    assert failed["contamination"]["splits"]["test"]["examples"] == [{"id": "test-4", "train_id": "part-00002-3"}]
    assert not out.exists()


def test_jsonl_shards_name_the_shard_and_line_of_a_bad_row(tmp_path):
    root = tmp_path / "qa"
    for shard in (1, 2):
        write_jsonl(root / "parts" / f"train-{shard}.jsonl",
                    [{"q": f"Question {shard}.{k}?", "a": [f"{shard}{k}"]} for k in range(50)]
                    + (['{"q": "cut short'] if shard == 2 else []))
    write_jsonl(root / "test.jsonl", [{"q": "Held out?", "a": ["yes"]}])
    settings = checked("qa", {"source": {"type": "local", "path": str(root),
                                         "files": {"train": ["parts/train-2.jsonl", "parts/train-1.jsonl"]}},
                              "splits": {"train": "train", "test": "test"}, "fields": {"question": "q", "answers": "a"},
                              "metric": "exact_match"})
    check_local_splits(typed("qa", settings))
    data, report = run_normalise("qa", settings, run_download("qa", settings, tmp_path), tmp_path)
    train = rows_of(data, "train")
    assert [row["question"] for row in train[49:51]] == ["Question 1.49?", "Question 2.0?"]
    assert len({row["id"] for row in train}) == 100
    [example] = json.loads(report.read_text())["reasons"]["unparseable_record"]["examples"]
    assert (example["file"], example["line"]) == (str(root / "parts" / "train-2.jsonl"), 51)


@pytest.mark.parametrize("files, key, message", [
    ({"train": "shards/part-*.jsonl"}, "source.files.train", r"'shards/part-\*.jsonl' matches no file"),
    ({"train": ["train.jsonl", "nowhere/extra.jsonl"]}, "source.files.train", r"extra.jsonl is not a file"),
    ({"val": "train.jsonl"}, "source.files.val", r"'val' is not a split of the dataset"),
    ({"train": "notes.txt"}, "source.files.train", r"notes.txt is not a jsonl file"),
])
def test_listed_files_that_are_not_there_are_refused_when_the_workflow_is_parsed(tmp_path, files, key, message):
    write_jsonl(tmp_path / "qa" / "train.jsonl", [{"q": "Q?", "a": ["A"]}])
    write_jsonl(tmp_path / "qa" / "test.jsonl", [{"q": "Q?", "a": ["A"]}])
    (tmp_path / "qa" / "notes.txt").write_text("not a split\n")
    settings = checked("qa", {"source": {"type": "local", "path": str(tmp_path / "qa"), "files": files},
                              "splits": {"train": "train", "test": "test"}, "fields": {"question": "q", "answers": "a"},
                              "metric": "exact_match"})
    with pytest.raises(ConfigError, match=rf"datasets\.qa\.{key}.*{message}"):
        check_local_splits(typed("qa", settings))


# --- through snakemake -n: the refusals come when the workflow is parsed, before any job ---
def imagefolder_config(root: Path, models: list[str]) -> dict:
    """A config over one image-folder dataset, run on ``models`` (tiny-llava reads images, tiny-llama does not)."""
    from test_dag import absolute_demo_config

    config = absolute_demo_config(["shapes_demo"])
    config["datasets"] = {"charts": {**imagefolder_settings(root), "models": models,
                                     "splits": {"train": "train", "validation": "validation", "test": "test"}}}
    config["models"] = {name: spec for name, spec in default_config()["models"].items() if name in models}
    config["variants"] = {name: spec for name, spec in config["variants"].items() if spec.get("task") == "vision_language"}
    config["comparison"]["reference_variant"] = {"vision_language": "text_only"}
    return config


def test_snakemake_n_plans_an_image_folder_and_refuses_a_glob_matching_nothing_naming_dataset_and_key(tmp_path):
    from test_dag import config_file
    from test_dry_run_families import dry_run

    write_imagefolder(tmp_path / "charts")
    config = imagefolder_config(tmp_path / "charts", ["tiny-llava"])
    code, output = dry_run(tmp_path, "-n", "--configfile", str(config_file(tmp_path, config)), "--cores", "1")
    assert code == 0 and "download" in output, output[-3000:]
    # The rules themselves: download copies the folders with their images, normalise reads them.
    code, output = dry_run(tmp_path, "--configfile", str(config_file(tmp_path, config)), "--cores", "1",
                           "--until", "normalise")
    assert code == 0, output[-3000:]
    data = tmp_path / "results" / "data" / "charts"
    assert (data / "raw" / "validation" / "charts" / "validation_1.png").is_file()
    report = json.loads((data / "normalise_report.json").read_text())
    assert {split: entry["kept"] for split, entry in report["splits"].items()} == {"train": 4, "validation": 2, "test": 2}
    for split in ("validation", "test"):
        write_jsonl(tmp_path / "qa" / f"{split}.jsonl", [{"q": "Q?", "a": ["A"]}])
    config["datasets"]["qa"] = {"source": {"type": "local", "path": str(tmp_path / "qa"),
                                           "files": {"train": "shards/part-*.jsonl"}}, "fields": {"question": "q", "answers": "a"},
                                "metric": "exact_match", "models": ["tiny-llava"]}
    config["variants"]["baseline"] = {"prompt": "Question: {question}\nAnswer:", "target": " {answer}"}
    config["comparison"]["reference_variant"]["generation"] = "baseline"
    path = config_file(tmp_path, config)
    code, output = dry_run(tmp_path, "-n", "--configfile", str(path), "--cores", "1")
    assert code != 0 and "Job stats" not in output, output[-3000:]
    assert (f"{path}: config key 'datasets.qa.source.files.train': 'shards/part-*.jsonl' matches no file under "
            f"{tmp_path / 'qa'} (paths and globs are relative to source.path, or absolute)") in output


def test_snakemake_n_refuses_a_vision_language_dataset_on_a_text_only_model(tmp_path):
    from test_dag import config_file
    from test_dry_run_families import dry_run

    write_imagefolder(tmp_path / "charts")
    config = imagefolder_config(tmp_path / "charts", ["tiny-llava", "tiny-llama"])
    path = config_file(tmp_path, config)
    code, output = dry_run(tmp_path, "-n", "--configfile", str(path), "--cores", "1")
    assert code != 0 and "Job stats" not in output, output[-3000:]
    assert (f"{path}: config key 'datasets.charts.models': task vision_language needs a model with a vision part, but "
            "'tiny-llama' is a tiny 'llama' model (models.tiny-llama.tiny.architecture; the vision ones are "
            "['llava', 'idefics3', 'qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'gemma3', 'llava_onevision']), which reads text only; remove 'tiny-llama' from datasets.charts.models") in output
