"""Issue 38's families through Snakemake in ONE run: the demo's shapes data (small) normalised, pre-tokenised,
gated, trained a few steps and evaluated on a tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dynamic resolution, M-RoPE),
Gemma 3 (pooled image tokens attending both ways within their image) and LLaVA-OneVision (any-resolution tiles),
all models of one dataset, each with the vision variant and the text-only control, then compared. The gate checks
each family's tower frozen and its placeholders against its image features; the adapters hold nothing of a tower.
Learnability is not asked here: one step on a handful of images, the least that shows each family's rules and
stages fit together (the time goes to starting the jobs, about fifty). The vision variant has no pixel budget:
Gemma 3's fixed-size processor refuses one, and a variant applies to every model of its task.
tests/test_vision_language_families.py has each family's details, the budget included (resizing, its record in
tokenise_meta.json, LLaVA-OneVision's grids)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

import snakemake_fork
from workflow_scripts.demo import make_images

ROOT = Path(__file__).resolve().parent.parent
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FAMILIES = (*QWEN, "gemma3", "llava_onevision")
VARIANTS = ("vision", "text_only")
# The demo's images are 32 x 32: Qwen keeps them (8 x 8 patches of 4 px, merged 2 x 2: 16 image tokens), Gemma 3
# pools its 4 x 4 patches of 8 px 2 x 2 (4 tokens), LLaVA-OneVision tiles them on its 32 x 32 grid (the image
# whole, as one tile, a newline per row: 36 tokens). Qwen's and Gemma 3's token types reach the forward.
GATE_DETAIL = {**{family: "16 image tokens each; M-RoPE positions from mm_token_type_ids" for family in QWEN},
               "gemma3": "4 image tokens each; image tokens attend within their image (token_type_ids)",
               "llava_onevision": "36 image tokens each"}
TOWER = {**{family: "base_model.model.model.visual." for family in QWEN},
         "gemma3": "base_model.model.model.vision_tower.", "llava_onevision": "base_model.model.model.vision_tower."}
STEPS = 1
TEST_ROWS = 4

pytestmark = pytest.mark.slow


def workflow_config(shapes: Path) -> dict:
    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    dataset = {**config["datasets"]["shapes_demo"], "models": [f"tiny-{family}" for family in FAMILIES],
               "source": {"type": "local", "path": str(shapes)}, "max_rejected_fraction": 0.5}
    config["datasets"] = {"shapes_demo": dataset}
    config["models"] = {f"tiny-{family}": {"source": "tiny", "tiny": {
        "architecture": family, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
        "vocab_size": 512}} for family in FAMILIES}
    config["variants"] = {variant: config["variants"][variant] for variant in VARIANTS}
    config["seeds"] = [1]
    config["training"].update(max_steps=STEPS, warmup_steps=0, effective_batch=4, micro_batch=4, max_length=64,
                              checkpoint_every=100, log_every=1)
    config["training"].pop("validation", None)
    config["evaluation"].update(batch_size=TEST_ROWS, max_new_tokens=2, evaluate_base_model=False)
    config["comparison"]["reference_variant"] = {"vision_language": "text_only"}
    return config


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vlm_workflow")
    assert make_images.main(["--out", str(directory / "shapes"), "--train", "8", "--validation", "2",
                             "--test", str(TEST_ROWS)]) == 0
    (directory / "config.yaml").write_text(yaml.safe_dump(workflow_config(directory / "shapes"), sort_keys=False))
    code, output = snakemake_fork.run(["-s", str(ROOT / "Snakefile"), "--configfile", str(directory / "config.yaml"),
                                       "--cores", "2"], cwd=directory, timeout=1500)
    assert code == 0, output[-6000:]
    return directory


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_and_evaluates_through_snakemake_with_the_text_only_control(finished_run, family):
    """Only a Snakemake run shows the rules carry each family through (the stages' arguments, what one stage
    hands the next, the comparison of both variants); tests/test_vision_language_families.py runs the same
    stages in-process."""
    results = finished_run / "results"
    rows = list(csv.DictReader((results / "comparison.csv").open()))
    assert {(row["model"], row["variant"]) for row in rows} >= {(f"tiny-{family}", v) for v in VARIANTS}
    for variant in VARIANTS:
        experiment = results / f"tiny-{family}" / "shapes_demo" / variant / "seed1"
        with safe_open(str(experiment / "adapter" / "adapter_model.safetensors"), "pt") as saved:
            names = list(saved.keys())
        assert names and not [name for name in names if name.startswith(TOWER[family])]  # nothing of the tower
        summary = json.loads((experiment / "eval.json").read_text())
        assert summary["images"] is (variant == "vision") and summary["n_examples"] == TEST_ROWS
    gate = json.loads((results / f"tiny-{family}" / "shapes_demo" / "vision" / "sanity.json").read_text())
    checks = {check["name"]: check for check in gate["checks"]}
    assert gate["passed"] and "vision tower frozen" in checks["vision_language_model"]["detail"]
    assert GATE_DETAIL[family] in checks["vision_language_batch"]["detail"]
