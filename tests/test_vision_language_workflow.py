"""Issue 38's families through Snakemake in ONE run: the demo's shapes data (small) normalised, pre-tokenised
under a pixel budget, gated, trained a few steps and evaluated on a tiny Qwen2.5-VL (dynamic resolution, M-RoPE)
and LLaVA-OneVision (any-resolution tiles, whose model must take the budget's tiling grids), each with the vision
variant and the text-only control, then compared. Learnability is not asked here (a handful of steps);
tests/test_vision_language_families.py has each family's details (Qwen2-VL, Qwen3-VL and Gemma 3 too)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

import snakemake_fork
from workflow_scripts.demo import make_images

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen2_5_vl", "llava_onevision")
VARIANTS = ("vision", "text_only")
# The demo's images are 32 x 32: Qwen keeps them (16 image tokens), LLaVA-OneVision tiles on its 32 x 32 grid only
# (36 image tokens: the image whole, as one tile, a newline per row) where its own grids go up to 96 x 96.
MAX_PIXELS = 32 * 32
IMAGE_TOKENS = {"qwen2_5_vl": "16 image tokens each; M-RoPE", "llava_onevision": "36 image tokens each"}

pytestmark = pytest.mark.slow


def workflow_config(directory: Path, shapes: Path) -> dict:
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    dataset = {**config["datasets"]["shapes_demo"], "models": [f"tiny-{family}" for family in FAMILIES],
               "source": {"type": "local", "path": str(shapes)}, "max_rejected_fraction": 0.5}
    config["datasets"] = {"shapes_demo": dataset}
    config["models"] = {f"tiny-{family}": {"source": "tiny", "tiny": {
        "architecture": family, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
        "vocab_size": 512}} for family in FAMILIES}
    config["variants"] = {"vision": {**config["variants"]["vision"], "max_pixels": MAX_PIXELS},
                          "text_only": config["variants"]["text_only"]}
    config["seeds"] = [1]
    config["training"].update(max_steps=3, warmup_steps=1, effective_batch=8, micro_batch=4, max_length=64,
                              checkpoint_every=100, log_every=1)
    config["training"].pop("validation", None)
    config["evaluation"].update(batch_size=8, max_new_tokens=4, evaluate_base_model=False)
    config["comparison"]["reference_variant"] = {"vision_language": "text_only"}
    return config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vlm_workflow")
    assert make_images.main(["--out", str(directory / "shapes"), "--train", "16", "--validation", "8",
                             "--test", "8"]) == 0
    (directory / "config.yaml").write_text(yaml.safe_dump(workflow_config(directory, directory / "shapes"),
                                                          sort_keys=False))
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--configfile", str(directory / "config.yaml"),
                                       "--cores", "2"], cwd=directory, timeout=1500)
    assert code == 0, output[-6000:]
    return directory


def test_each_family_trains_and_evaluates_through_snakemake_with_the_text_only_control(finished_run):
    results = finished_run / "results"
    rows = list(csv.DictReader((results / "comparison.csv").open()))
    assert {(row["model"], row["variant"]) for row in rows} >= {(f"tiny-{f}", v) for f in FAMILIES for v in VARIANTS}
    for family in FAMILIES:
        for variant in VARIANTS:
            experiment = results / f"tiny-{family}" / "shapes_demo" / variant / "seed1"
            assert (experiment / "adapter" / "adapter_model.safetensors").exists()
            summary = json.loads((experiment / "eval.json").read_text())
            assert summary["images"] is (variant == "vision") and summary["n_examples"] > 0
        gate = results / f"tiny-{family}" / "shapes_demo" / "vision" / "sanity.json"
        checks = {check["name"]: check for check in json.loads(gate.read_text())["checks"]}
        assert "vision tower frozen" in checks["vision_language_model"]["detail"]
        assert IMAGE_TOKENS[family] in checks["vision_language_batch"]["detail"]
        meta = json.loads((results / "data" / "shapes_demo" / "tokenised" / f"tiny-{family}" / "vision"
                           / "tokenise_meta.json").read_text())
        assert meta["templates"]["max_pixels"] == MAX_PIXELS  # the budget travels to training with the data
        if family == "llava_onevision":
            assert meta["image_processor"]["image_grid_pinpoints"] == [[32, 32]]
