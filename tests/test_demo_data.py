"""The committed demo data is what make_data generates, and each set runs the rejection path
while staying under the configured threshold."""
import json

import pytest

from data_helpers import ROOT, default_config, demo_settings, run_download, run_normalise
from workflow_scripts.demo import make_data, make_images


def test_committed_demo_data_is_reproduced_byte_for_byte(tmp_path):
    assert make_data.main(["--out", str(tmp_path)]) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.jsonl"))
    committed = sorted(p.relative_to(ROOT / "demo_data") for p in (ROOT / "demo_data").rglob("*.jsonl")
                       if p.parent.name != "shapes")
    assert generated == committed and len(generated) == 12
    for path in generated:
        assert (tmp_path / path).read_bytes() == (ROOT / "demo_data" / path).read_bytes(), path
    assert sum((ROOT / "demo_data" / p).stat().st_size for p in committed) < 400_000
    for split in ("train", "validation", "test"):  # the masked-LM corpus (make_corpus), plain text
        path = f"corpus/{split}.txt"
        assert (tmp_path / path).read_bytes() == (ROOT / "demo_data" / path).read_bytes(), path


@pytest.mark.parametrize("name", [name for name, d in default_config()["datasets"].items() if d.get("task") != "masked_lm"])
def test_each_demo_set_has_rejections_below_its_threshold_and_enough_rows(tmp_path, name):
    settings = demo_settings(name)
    _, report_path = run_normalise(name, settings, run_download(name, settings, tmp_path), tmp_path)
    report = json.loads(report_path.read_text())
    assert sum(split["rejected"] for split in report["splits"].values()) >= 3
    assert all(split["rejected_fraction"] <= settings["max_rejected_fraction"] for split in report["splits"].values())
    assert 250 <= report["splits"]["train"]["kept"] <= 600 and 50 <= report["splits"]["test"]["kept"] <= 128


def test_committed_shapes_are_reproduced_byte_for_byte(tmp_path):
    """The image QA demo (make_images): records and PNGs as the generator writes them."""
    assert make_images.main(["--out", str(tmp_path / "shapes")]) == 0
    committed = ROOT / "demo_data" / "shapes"
    files = sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "shapes") for p in (tmp_path / "shapes").rglob("*") if p.is_file())
    assert all((committed / f).read_bytes() == (tmp_path / "shapes" / f).read_bytes() for f in files)


def test_the_corpus_is_read_line_by_line_with_held_out_test_lines(tmp_path):
    settings = demo_settings("corpus_demo")
    _, report_path = run_normalise("corpus_demo", settings, run_download("corpus_demo", settings, tmp_path), tmp_path)
    report = json.loads(report_path.read_text())
    assert report["splits"]["train"]["lines"] == 4000 and report["splits"]["test"]["lines"] == 400
    assert all(split["overlapping"] == 0 for split in report["contamination"]["splits"].values())


def test_chartqa_like_answers_include_numbers():
    rows = [json.loads(line) for line in (ROOT / "demo_data/chartqa/test.jsonl").read_text().splitlines()]
    numeric = [row for row in rows if row["label"] and row["label"][0].replace(".", "", 1).isdigit()]
    assert len(numeric) > len(rows) // 4
