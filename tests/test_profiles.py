"""The execution profiles themselves, read as files: no cluster needed (moved out of test_slurm.py, whose
tests all need a real SLURM cluster and carry the `slurm` marker, so that `make test-fast` keeps these)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rules_declaring_gpus() -> set[str]:
    rules, derived = set(), []
    for smk in (ROOT / "rules").glob("*.smk"):
        text = smk.read_text()
        for block in re.split(r"\n(?=rule )", text):
            name = re.match(r"rule (\w+):", block)
            # the resources block: its lines indented below the directive (a **MULTI_NODE_LAUNCH, comments...)
            resources = re.search(r"\n    resources:\s*\n((?: {8}.*\n)+)", block)
            if name and resources and re.search(r"^\s+gpu=", resources.group(1), re.MULTILINE):
                rules.add(name.group(1))
        derived += re.findall(r"^use rule (\w+) as (\w+)", text, re.MULTILINE)
    # `use rule X as Y with:` keeps X's resources unless it overrides them (ours never drop gpu).
    rules |= {child for parent, child in derived if parent in rules}
    return rules


def test_slurm_profile_keeps_gpu_rules_to_one_task_and_gpus_out_of_slurm_extra():
    import yaml

    profile = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    gpu_rules = _rules_declaring_gpus()
    assert {"sanity", "train", "evaluate", "evaluate_base"} <= gpu_rules
    assert profile["executor"] == "slurm"
    for rule in gpu_rules:
        assert profile["set-resources"][rule]["tasks_per_gpu"] == 0, rule
    for rule, resources in profile["set-resources"].items():
        assert not re.search(r"--(gres|gpus)[=\s]", str(resources.get("slurm_extra", ""))), rule
    assert profile["preemptible-rules"] == ["train"] and profile["preemptible-retries"] >= 1
    assert {"runtime", "mem_mb"} <= set(profile["default-resources"])
    local_rules = re.search(r"localrules:\s*\n((?:\s+\w+,?\n)+)", (ROOT / "rules" / "data.smk").read_text()).group(1)
    assert {"download", "prepare_model"} <= {r.strip(" ,") for r in local_rules.split()}


def test_local_profile_runs_on_every_core_and_counts_gpus():
    import yaml

    profile = yaml.safe_load((ROOT / "profiles" / "local" / "config.yaml").read_text())
    assert profile["cores"] == "all" and profile["resources"]["gpu"] == 0
    assert profile["rerun-incomplete"] and profile["keep-going"]
