"""The strategies benchmark through the `make bench` harness at its tiny size: three train stage runs (DDP,
FSDP, QLoRA; two gloo processes each) and a record whose figures come from what was measured. No timing
or memory size is asserted, only the record's structure and how its figures relate."""
from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import bench_strategies, run as bench_run

RECORD_KEYS = {"name", "title", "status", "message", "units", "ours", "reference", "ratio", "goals", "others",
               "repetitions", "hardware", "packages", "setup", "notes"}
MiB = 2**20


@pytest.mark.bench
def test_strategies_benchmark_at_tiny_size_through_the_harness(tmp_path):
    code = bench_run.main(["--scale", "tiny", "--only", "strategies", "--out-dir", str(tmp_path),
                           "--work-dir", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    [rec] = results["benchmarks"]
    assert RECORD_KEYS <= set(rec) and rec["name"] == "strategies" and rec["status"] == "measured"
    strategies = list(rec["setup"]["strategies"])
    qlora = bench_strategies.qlora_available() is None
    assert strategies == (["ddp", "fsdp", "qlora"] if qlora else ["ddp", "fsdp"])
    assert rec["ours"]["label"].startswith("fsdp:") and rec["reference"]["label"].startswith("ddp:")
    for side in ("ours", "reference"):
        assert rec[side]["median"] == pytest.approx(statistics.median(rec[side]["samples"]))
        details = rec[side]["details"]
        assert details["world_size"] == bench_strategies.PROCESSES
        assert all(len(ranks) == bench_strategies.PROCESSES and min(ranks) > 0 for ranks in details["by_rank"])
        # The gate's estimate beside the measurement, its parts adding up to its total.
        estimate = details["estimate_mib"]
        assert estimate["total"] == pytest.approx(sum(v for k, v in estimate.items() if k != "total"))
    assert rec["ratio"] == pytest.approx(rec["ours"]["median"] / rec["reference"]["median"])
    # FSDP's estimate counts half of the weights DDP's counts, plus the gathered units.
    fsdp, ddp = rec["ours"]["details"]["estimate_mib"], rec["reference"]["details"]["estimate_mib"]
    assert fsdp["weights"] == pytest.approx(ddp["weights"] / 2) and ddp["gathered_weights"] == 0 < fsdp["gathered_weights"]
    labels = [series["label"] for series in rec["others"]]
    for strategy in strategies:
        assert f"{strategy}: tokens/s over both ranks" in labels
        assert f"{strategy}: peak RSS per rank, whole process, loading included" in labels
        assert rec["setup"]["ratios_vs_ddp"][strategy]["memory"] == pytest.approx(
            rec["setup"]["loop_peak_mib"][strategy] / rec["setup"]["loop_peak_mib"]["ddp"])
    whole = {s["label"].split(":")[0]: s for s in rec["others"] if "whole process" in s["label"]}
    loop = {"fsdp": rec["ours"], "ddp": rec["reference"]}
    for strategy, series in loop.items():  # the loop is part of the whole process
        assert series["median"] <= whole[strategy]["median"] + 1e-9
    assert rec["setup"]["baseline_rss_mib"] > 0
    assert all(isinstance(goal["met"], bool) for goal in rec["goals"]) and len(rec["goals"]) == 2 + qlora
    assert rec["title"] in (tmp_path / "RESULTS.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bench-strategies-")]  # work files removed
