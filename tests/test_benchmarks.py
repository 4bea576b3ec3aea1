"""Smoke tests of the benchmark harness (benchmarks/): record structure, ratios computed from the
measured samples, goals checked against them, failures and skips recorded. No timing is asserted."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench_gpu, bench_pretokenise, bench_training, records, run as bench_run, synthetic

REPO = Path(__file__).resolve().parent.parent
RECORD_KEYS = {"name", "title", "status", "message", "units", "ours", "reference", "ratio", "goals", "others",
               "repetitions", "hardware", "packages", "setup", "notes"}


def test_series_median_ratio_and_goal_come_from_the_samples():
    ours = records.Series("ours", [3.0, 1.0, 2.0], "x/s")
    reference = records.Series("ref", [1.0, 0.5, 4.0], "x/s")
    rec = records.record("demo", "Demo", ours, reference, higher_is_better=True,
                         goals=[records.Goal("ratio >= 5", ours.median / reference.median, 5.0, True, why="small")])
    assert rec["ours"]["median"] == 2.0 and rec["reference"]["median"] == 1.0
    assert rec["ratio"] == pytest.approx(2.0)
    assert rec["repetitions"] == 3
    goal = rec["goals"][0]
    assert goal["met"] is False and goal["why"] == "small" and "2.50x short" in goal["shortfall"]
    assert RECORD_KEYS <= set(rec)
    json.dumps(rec)  # numpy scalars must not leak into the JSON


def test_lower_is_better_goal_reports_how_far_over():
    goal = records.Goal("memory <= 1.1x", 1.32, 1.1, higher_is_better=False)
    assert not goal.met and "1.20x over" in goal.shortfall
    assert records.Goal("memory <= 1.1x", 1.05, 1.1, higher_is_better=False).met


def test_throughput_window_leaves_out_the_first_step():
    # step 1 took 10 s (start-up), steps 2 and 3 took 1 s each with 100 and 300 real tokens
    result = bench_training.window([10.0, 11.0, 12.0], [999, 100, 300], [0, 100, 100])
    assert result["tokens_per_second"] == pytest.approx(200.0)
    assert result["padding_share"] == pytest.approx(200 / 600)
    log = [{"elapsed_seconds": 10.0, "tokens_per_second": 99.9, "padding_share": 0.0},
           {"elapsed_seconds": 11.0, "tokens_per_second": 100.0, "padding_share": 0.5},
           {"elapsed_seconds": 12.0, "tokens_per_second": 300.0, "padding_share": 0.25}]
    from_log = bench_training.log_window(log)
    assert from_log["tokens_per_second"] == pytest.approx(200.0)
    assert from_log["padding_share"] == pytest.approx(200 / 600)


def test_padding_of_the_batch_plans_favours_grouping():
    # Half the rows short, half long, shuffled: random micro-batches mix them, grouped ones do not.
    lengths = np.array([16, 512] * 256)
    shares = bench_training.plan_padding(lengths, effective_batch=16, micro_batch=8, seed=0)
    assert shares["ours"] < 0.05
    assert shares["random"] > 0.3
    assert shares["grouped"] < shares["random"]


def test_long_tailed_lengths_stay_in_range_and_have_a_tail():
    lengths = synthetic.long_tailed_lengths(5000, 16, 512, 64, 0.9, seed=0)
    assert lengths.min() >= 16 and lengths.max() <= 512
    assert np.median(lengths) < 100 < np.percentile(lengths, 95)


def test_tokenised_table_masks_the_prompt_and_ends_with_eos():
    table = synthetic.tokenised_table(np.array([5, 9]), vocab_size=50, seed=0)
    ids, labels = table.column("input_ids").to_pylist(), table.column("labels").to_pylist()
    assert [len(x) for x in ids] == [5, 9] == table.column("length").to_pylist()
    for row_ids, row_labels in zip(ids, labels):
        assert row_ids[-1] == synthetic.EOS_ID
        assert row_labels[0] == -100 and row_labels[-1] == synthetic.EOS_ID


def test_gpu_model_flops_follow_the_stated_formula():
    config = bench_gpu.model_config(tiny=False)
    # Qwen2.5-0.5B with rank-16 adapters on all seven projections: 8,798,208 trainable parameters (PEFT's count).
    assert bench_gpu.lora_params(config) == 8_798_208
    lengths = np.full(10, 256)
    per_layer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864
    expected = 4 * 24 * per_layer + 4 * 896 * 151936 * 0.5 + 6 * 8_798_208 + 12 * 24 * 896 * 256
    assert bench_gpu.flops_per_token(config, lengths, target_share=0.5) == pytest.approx(expected)
    # H100 SXM and H200: one compute die, one dense bf16 peak (issue 28); 790 is the measured matmul ceiling.
    assert bench_gpu.peak_flops("NVIDIA H100 80GB HBM3") == bench_gpu.peak_flops("NVIDIA H200") == 989e12
    assert bench_gpu.peak_flops("Some CPU") is None


def test_gpu_benchmark_is_skipped_with_a_message_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rec = bench_gpu.run("tiny")
    assert rec["status"] == "skipped" and "CUDA" in rec["message"]
    assert rec["ours"] is None and rec["ratio"] is None and RECORD_KEYS <= set(rec)


def test_reference_loop_produces_the_same_tokens_as_the_stage(tmp_path):
    import torch

    torch.set_num_threads(1)
    model_dir, data_dir = bench_pretokenise.build_inputs(tmp_path, {"rows": 120, "vocab_size": 300})
    ours = bench_pretokenise.probe("ours", model_dir, data_dir, tmp_path / "ours", threads=1)
    loop = bench_pretokenise.probe("loop", model_dir, data_dir, tmp_path / "loop", threads=1)
    assert ours["rows"] == loop["rows"] == 120
    assert bench_pretokenise.same_tokens(tmp_path / "ours", tmp_path / "loop")
    costs = bench_pretokenise.probe("tokenizer", model_dir, data_dir, tmp_path / "unused", threads=1)
    assert costs["rows"] == 120 and costs["batched_us_per_row"] > 0 and costs["per_call_us_per_row"] > 0


@pytest.mark.bench
def test_run_writes_results_and_summary_at_tiny_size(tmp_path):
    code = bench_run.main(["--scale", "tiny", "--only", "worker_memory", "workflow_overhead", "gpu_lora_bf16",
                           "--out-dir", str(tmp_path), "--work-dir", str(tmp_path)])
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    by_name = {r["name"]: r for r in results["benchmarks"]}
    assert set(by_name) == {"worker_memory", "workflow_overhead", "gpu_lora_bf16"}
    for rec in by_name.values():
        assert RECORD_KEYS <= set(rec)
        assert rec["hardware"]["usable_cores"] >= 1 and rec["packages"]["torch"]
    memory = by_name["worker_memory"]
    assert memory["status"] == "measured"
    for side in ("ours", "reference"):
        assert memory[side]["median"] == pytest.approx(statistics.median(memory[side]["samples"]))
    assert memory["ratio"] == pytest.approx(memory["ours"]["median"] / memory["reference"]["median"])
    details = memory["ours"]["details"]
    assert details["rows_read"] == [details["epoch_rows"]] and details["epoch_rows"] > 0.9 * memory["setup"]["rows"]
    overhead = by_name["workflow_overhead"]
    assert overhead["setup"]["jobs"] > 0 and overhead["ours"]["samples"][0] > 0
    summary = (tmp_path / "RESULTS.md").read_text()
    for rec in by_name.values():
        assert rec["title"] in summary
    assert "skipped" in summary


def test_a_failing_benchmark_is_recorded_and_fails_the_run(tmp_path, monkeypatch):
    class Broken:
        NAME, TITLE, MIN_SECONDS = "worker_memory", "Broken benchmark", 0

        @staticmethod
        def run(scale, work_dir, log, deadline):
            raise RuntimeError("planted failure")

    monkeypatch.setitem(bench_run.BENCHMARKS, "worker_memory", Broken)
    code = bench_run.main(["--scale", "tiny", "--only", "worker_memory", "gpu_lora_bf16", "--out-dir", str(tmp_path)])
    assert code == 1
    results = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["benchmarks"]}
    assert results["worker_memory"]["status"] == "failed"
    assert "planted failure" in results["worker_memory"]["message"]
    assert results["gpu_lora_bf16"]["status"] in {"skipped", "measured"}
    assert "planted failure" in (tmp_path / "RESULTS.md").read_text()


def test_update_replaces_only_the_benchmarks_rerun(tmp_path, monkeypatch):
    class Measured:  # a benchmark measured at once: the point is run.py's --update, not what it measures
        NAME, TITLE, MIN_SECONDS = "workflow_overhead", "A quick benchmark", 0

        @staticmethod
        def run(scale, work_dir, log, deadline):
            return records.record(Measured.NAME, Measured.TITLE, records.Series("ours", [1.0, 2.0], "s"), None,
                                  higher_is_better=False)

    monkeypatch.setitem(bench_run.BENCHMARKS, "workflow_overhead", Measured)
    assert bench_run.main(["--scale", "tiny", "--only", "workflow_overhead", "gpu_lora_bf16",
                           "--out-dir", str(tmp_path)]) == 0
    before = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["benchmarks"]}
    assert bench_run.main(["--scale", "tiny", "--only", "gpu_lora_bf16", "--update", "--out-dir", str(tmp_path)]) == 0
    after = json.loads((tmp_path / "results.json").read_text())
    names = [r["name"] for r in after["benchmarks"]]
    assert names == ["workflow_overhead", "gpu_lora_bf16"]  # run order kept
    assert after["benchmarks"][0] == before["workflow_overhead"]
    assert after["run"]["updated"] == ["gpu_lora_bf16"]


def test_corpus_generator_is_deterministic_and_the_small_corpus_is_a_prefix(tmp_path):
    from benchmarks import bench_corpus

    generator = bench_corpus.CorpusGenerator()
    assert generator.chunk(3, 200) == bench_corpus.CorpusGenerator().chunk(3, 200)
    sizes = bench_corpus.write_corpora({300: tmp_path / "small", 1200: tmp_path / "large"}, generator)
    small = (tmp_path / "small" / "train.txt").read_text(encoding="utf-8").splitlines()
    large = (tmp_path / "large" / "train.txt").read_text(encoding="utf-8").splitlines()
    assert len(small) == 300 and len(large) == 1200 and large[:300] == small
    assert sizes[1200]["bytes"] == (tmp_path / "large" / "train.txt").stat().st_size
    latin = [line for line in large if line.endswith(".")]
    chinese = [line for line in large if line.endswith("。")]
    assert len(latin) + len(chinese) == len(large) and latin and chinese
    words = [len(line.split()) for line in latin]
    assert bench_corpus.WORDS_MIN <= min(words) and max(words) <= bench_corpus.WORDS_MAX
    assert all(line.isascii() for line in latin) and all(any("\u4e00" <= c <= "\u9fff" for c in line) for line in chinese)
    assert all(line == line.strip() for line in large)


@pytest.mark.bench
def test_corpus_benchmark_runs_at_tiny_size(tmp_path, monkeypatch):
    """The whole harness with the probes run in this process (fast); one probe as the benchmark starts it."""
    import os

    from benchmarks import bench_corpus

    for name in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM", bench_corpus.SIZES_VARIABLE):
        monkeypatch.delenv(name, raising=False)  # pretokenise sets the first two; restored afterwards
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setattr(bench_corpus, "run_probe", lambda kind, cores, **arguments: bench_corpus.PROBES[kind](**arguments))
    rec = bench_corpus.run("tiny", work_dir=tmp_path)
    json.dumps(rec)
    assert RECORD_KEYS <= set(rec) and rec["status"] == "measured"
    assert rec["ours"]["median"] == pytest.approx(statistics.median(rec["ours"]["samples"]))
    assert rec["ratio"] == pytest.approx(rec["ours"]["median"] / rec["reference"]["median"])
    small, large = bench_corpus.SCALES["tiny"]["sizes"]
    assert rec["setup"]["lines"] == [small, large]
    assert len(rec["goals"]) == 9 and all(isinstance(goal["met"], bool) for goal in rec["goals"])
    labels = " ".join(series["label"] for series in rec["others"])
    for wanted in ("map(tokenize", "peak RSS", "extra DataLoader worker", f"{large:,} lines"):
        assert wanted in labels
    assert not list(tmp_path.iterdir())  # the generated corpus and every output are gone

    # One probe as the benchmark runs it: a fresh, pinned interpreter, its result as JSON.
    monkeypatch.undo()
    raw = tmp_path / "raw"
    bench_corpus.write_corpora({500: raw}, bench_corpus.CorpusGenerator())
    result = bench_corpus.run_probe("normalise", 1, raw=raw, out=tmp_path / "normalised")
    assert result["lines"] == 500 and result["peak_rss"] >= result["baseline_rss"] > 0
    assert os.path.isdir(tmp_path / "normalised" / "train")


@pytest.mark.bench
def test_vision_batches_benchmark_runs_at_tiny_size(tmp_path, monkeypatch):
    """The whole benchmark at a tiny size: the workflow's stages build the data, the probes run in a
    fresh process as `make bench` starts them; no timing is asserted."""
    from benchmarks import bench_vision_batches

    monkeypatch.delenv(bench_vision_batches.SIZE_VARIABLE, raising=False)
    for name in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(name, raising=False)  # pretokenise sets them; restored afterwards
    rec = bench_vision_batches.run("tiny", work_dir=tmp_path, log=lambda message: None)
    json.dumps(rec)
    assert RECORD_KEYS <= set(rec) and rec["status"] == "measured"
    assert rec["ours"]["median"] == pytest.approx(statistics.median(rec["ours"]["samples"]))
    assert rec["ratio"] == pytest.approx(rec["ours"]["median"] / rec["reference"]["median"])
    settings = bench_vision_batches.SCALES["tiny"]
    labels = " ".join(series["label"] for series in rec["others"])
    for wanted in ("computed, 0 workers", "computed, 1 worker", "cached, 0 workers", "PIL decode", "image processor only",
                   "one-off build of the pixel cache", "one more worker adds", f"{2 * settings['examples']:,}-row set"):
        assert wanted in labels
    assert rec["ours"]["details"]["pixel_values_shape"][1:] == [3, settings["processor_size"], settings["processor_size"]]
    # Workers get paths and settings, never images; the cache holds exactly what the collator makes.
    assert max(rec["ours"]["details"]["pickled_bytes"].values()) < 4096
    assert rec["setup"]["cache_matches_collator"] is True
    assert rec["setup"]["cache_bytes"] >= settings["examples"] * 3 * settings["processor_size"] ** 2 * 4
    assert all(memory["samples"] > 0 for memory in rec["setup"]["memory_mib"].values())
    assert len(rec["goals"]) == 2 and all(isinstance(goal["met"], bool) for goal in rec["goals"])
    assert any(note.startswith("Decision:") for note in rec["notes"])
    assert not list(tmp_path.iterdir())  # the generated images, sets and cache are gone


# --- make gpu-check: its harness, checked where there is no GPU ---
def gpu_check(*args, cwd=REPO, env=None, **popen):
    import subprocess
    import sys

    command = [sys.executable, "-m", "benchmarks.gpu_check", *map(str, args)]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   **(env or {})}
    environment.pop("GPU_CHECK_REPORT", None)
    if popen:
        return subprocess.Popen(command, cwd=cwd, env=environment, **popen)
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)


def test_gpu_check_without_cuda_says_so_and_checks_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: make gpu-check runs the checks here")
    result = gpu_check("--out", tmp_path / "out")
    assert result.returncode == 2 and "no CUDA device visible" in result.stderr
    assert not (tmp_path / "out").exists()  # no half report that looks like a run
    result = gpu_check("--out", tmp_path / "out", "--python", "/bin/true-python-missing")
    assert result.returncode == 2 and "cannot import torch" in result.stderr


def test_gpu_check_plan_lists_the_phases_within_eight_minutes():
    """`make gpu-check PLAN=1` runs nothing and needs no GPU; the expected times sum to the budget or less."""
    import subprocess
    import sys

    from benchmarks import gpu_check as driver

    result = subprocess.run(["make", "-s", "gpu-check", "PLAN=1", f"GPU_PYTHON={sys.executable}"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for phase in driver.PHASES:
        assert phase.name in result.stdout
    assert [p.name for p in driver.PHASES][:2] == ["wheels", "environment"]  # installation counts in the budget
    total = driver.PREFLIGHT_SECONDS + driver.RESERVE_SECONDS + sum(p.expected_seconds for p in driver.PHASES)
    assert total <= 8 * 60 and f"total expected {total:.0f} s" in result.stdout
    # Issue 45: the 7B benchmark's sides, repeated, and the profile of the best side, about 6 minutes of it
    for side in ("A", "B", "C", "D", "trl", "trainer"):
        assert f"side {side} " in result.stdout
    assert "3 interleaved repetitions" in result.stdout and "profile" in result.stdout
    bench = next(p for p in driver.PHASES if p.name == "benchmark_7b")
    assert 5 * 60 <= bench.expected_seconds <= 8 * 60 - 60


def test_gpu_check_phases_run_in_order_skip_what_will_not_fit_and_stop_at_the_budget(tmp_path):
    """The budget: a phase expected to take longer than what is left is skipped with the reason; a phase
    that overruns is stopped (its whole process group) when the budget ends; each leaves a record, and
    a child's own records (through $GPU_CHECK_REPORT, from the repository's directory) land in OUT."""
    import sys

    from benchmarks import check_records, gpu_check as driver

    writes = ("from benchmarks import check_records; check_records.append({'check': 'child', 'value': 7})")
    phases = [
        driver.Phase("first", 1, "writes a record", False, lambda c: [sys.executable, "-c", writes]),
        driver.Phase("too_long", 600, "never fits", False, lambda c: [sys.executable, "-c", "raise SystemExit(9)"]),
        driver.Phase("fails", 1, "exits 3", False, lambda c: [sys.executable, "-c", "raise SystemExit(3)"]),
        driver.Phase("overruns", 1, "sleeps", False,
                     lambda c: ["bash", "-c", "sleep 120 & wait"]),  # a grandchild too: the group is stopped
    ]
    out = tmp_path / "out"
    out.mkdir()
    context = driver.Context(out=out, python=sys.executable, wheels=tmp_path, cpu=False,
                             env={check_records.VARIABLE: str(out / "measurements.jsonl"), "GPU_CHECK_SITE": str(tmp_path)})
    started = time.monotonic()
    status = driver.run_phases(context, phases, budget_seconds=driver.RESERVE_SECONDS + 12, log=lambda m: None)
    assert time.monotonic() - started < 40
    assert status == 1
    rows = check_records.read(out / "measurements.jsonl")
    assert {"check": "child", "value": 7} in rows
    phases_seen = {r["phase"]: r for r in rows if r.get("check") == "phase"}
    assert list(phases_seen) == ["first", "too_long", "fails", "overruns"]
    assert phases_seen["first"]["status"] == "passed"
    assert phases_seen["too_long"]["status"] == "skipped" and "would not fit: expected 600 s" in phases_seen["too_long"]["reason"]
    assert phases_seen["fails"]["status"] == "failed" and phases_seen["fails"]["exit_code"] == 3
    assert phases_seen["overruns"]["status"] == "cut_off" and "end of the budget" in phases_seen["overruns"]["reason"]
    summary = (out / "summary.md").read_text()
    assert "| too_long | skipped |" in summary and "| overruns | cut_off |" in summary
    log = (out / driver.LOG_NAME).read_text()  # one log, each phase under its header
    assert "===== gpu-check [fails]" in log and "===== gpu-check [too_long]" not in log


def test_a_phase_named_alone_comes_with_the_wheels(capsys):
    """The first H200 run: `--only benchmark_7b` left out the wheels phase, so every side of ours failed on an
    import the image lacks. A named phase now installs the wheels first (the plan shows it)."""
    from benchmarks import gpu_check as harness

    assert harness.main(["--plan", "--only", "benchmark_7b"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:] if line.startswith("  ")]
    assert "wheels" in names, names
    assert names.index("wheels") < names.index("benchmark_7b")


@pytest.mark.parametrize("relative", [True, False])
def test_gpu_check_writes_into_a_relative_or_absolute_out(tmp_path, relative):
    """Issue 24: with an absolute GPU_CHECK_OUT every record went to $PWD/$out. Both spellings work,
    from a directory other than the repository, and the children's records land there too."""
    from benchmarks import check_records

    target = tmp_path / "checks" / "out"
    result = gpu_check("--cpu", "--only", "environment", "--wheels", tmp_path / "no-wheels",
                       "--out", "checks/out" if relative else target, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = check_records.read(target / "measurements.jsonl")
    checks = [r["check"] for r in rows]
    assert checks[0] == "start" and "environment" in checks  # the environment record comes from a child process
    assert any(r.get("phase") == "environment" and r["status"] == "passed" for r in rows)
    assert (target / "environment.txt").read_text().startswith("") and "torch" in (target / "environment.txt").read_text()
    assert "| environment | passed |" in (target / "summary.md").read_text()


@pytest.mark.bench
def test_gpu_benchmark_harness_with_dataloader_workers_keeps_each_side(tmp_path, monkeypatch):
    """Issue 24: with DataLoader workers (as at full size) the Trainer reference counted zero tokens in
    the main process and failed with ZeroDivisionError, losing ours too. Tiny scale, workers on, on CPU:
    both sides measured, each appended as its own record the moment it ended."""
    from benchmarks import check_records

    report = tmp_path / "measurements.jsonl"
    monkeypatch.setenv(check_records.VARIABLE, str(report))
    assert bench_gpu.cpu_settings("tiny")["dataloader_workers"] >= 1
    rec = bench_gpu.run("tiny", work_dir=tmp_path, log=lambda m: None, on_cpu=True)
    json.dumps(rec)
    assert rec["status"] == "measured" and rec["message"] is None, rec["message"]
    assert rec["reference"] is not None and rec["reference"]["median"] > 0 and rec["ratio"] > 0
    sides = [r for r in check_records.read(report) if r.get("check") == bench_gpu.NAME]
    assert [(r["side"], r["status"]) for r in sides] == [("ours", "measured"), ("trainer", "measured")]
    trainer = sides[1]
    assert trainer["window_real_tokens"] > 0 and 0 <= trainer["padding_share"] < 1
    assert sides[0]["seconds_from_stage_start"] > 0  # the train stage's start-up, from its first log record


def test_a_failing_reference_keeps_ours(tmp_path, monkeypatch):
    from benchmarks import check_records

    report = tmp_path / "measurements.jsonl"
    monkeypatch.setenv(check_records.VARIABLE, str(report))
    ours = {"tokens_per_second": 1000.0, "padding_share": 0.1, "window_seconds": 1.0, "window_real_tokens": 1000.0,
            "all_real_tokens": 2000.0, "steps": 4, "seconds_from_stage_start": 3.0}
    monkeypatch.setattr(bench_training, "run_ours", lambda *args: dict(ours))

    def broken(*args):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(bench_training, "run_trainer", broken)
    rec = bench_gpu.run("tiny", work_dir=tmp_path, log=lambda m: None, on_cpu=True)
    assert rec["status"] == "measured" and rec["ours"]["median"] == 1000.0
    assert rec["reference"] is None and rec["ratio"] is None
    assert "trainer failed: ZeroDivisionError" in rec["message"]
    sides = [(r["side"], r["status"]) for r in check_records.read(report) if r.get("check") == bench_gpu.NAME]
    assert sides == [("ours", "measured"), ("trainer", "failed")]
    monkeypatch.setattr(bench_training, "run_ours", broken)
    with pytest.raises(RuntimeError, match="ours: ZeroDivisionError"):
        bench_gpu.run("tiny", work_dir=tmp_path, log=lambda m: None, on_cpu=True)


def test_a_killed_gpu_check_keeps_every_record_and_the_summary_is_rebuilt(tmp_path):
    """Kill the whole check (SIGKILL, its children too) right after the benchmark's first side is
    recorded; the record survives and --summary rebuilds the summary from it."""
    import signal
    import subprocess

    from benchmarks import check_records

    out = tmp_path / "out"
    process = gpu_check("--cpu", "--only", "benchmark", "--wheels", tmp_path / "no-wheels", "--out", out,
                        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if any(r.get("side") == "ours" for r in check_records.read(out / "measurements.jsonl")):
                break
            time.sleep(0.5)
    finally:
        # As a machine's end or a timeout ends a run: every process of the driver's session, at once.
        import psutil

        session = os.getsid(process.pid)
        for child in psutil.process_iter():
            try:
                if os.getsid(child.pid) == session:
                    child.kill()
            except (ProcessLookupError, psutil.Error):
                continue
        process.wait()
    rows = check_records.read(out / "measurements.jsonl")
    assert any(r.get("side") == "ours" and r["status"] == "measured" for r in rows), rows
    assert not any(r.get("check") == "phase" and r["phase"] == "benchmark" for r in rows)  # killed mid-phase
    (out / "summary.md").unlink(missing_ok=True)
    result = gpu_check("--summary", out)
    assert result.returncode == 0, result.stderr
    summary = (out / "summary.md").read_text()
    assert "| ours | 1 | measured |" in summary


def test_a_stopped_gpu_check_stops_its_phase_and_keeps_the_records(tmp_path):
    """SIGTERM to the driver (a timeout, a user's Ctrl-C): the running phase's process group is stopped,
    not left running on the GPU, and the records and summary so far are written."""
    import signal
    import subprocess

    import psutil

    from benchmarks import check_records

    out = tmp_path / "out"
    process = gpu_check("--cpu", "--only", "environment", "benchmark", "--wheels", tmp_path / "no-wheels", "--out", out,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(r.get("phase") == "environment"
                                                   for r in check_records.read(out / "measurements.jsonl")):
        time.sleep(0.5)
    time.sleep(2)  # the benchmark phase has started
    children = psutil.Process(process.pid).children(recursive=True)
    assert children, "the benchmark phase should be running"
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 1
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, alive
    rows = check_records.read(out / "measurements.jsonl")
    assert any(r.get("phase") == "environment" and r["status"] == "passed" for r in rows)
    assert rows[-1] == {"check": "stopped", "signal": "SIGTERM"}
    assert rows[-2]["phase"] == "benchmark" and rows[-2]["status"] == "stopped"
    assert "| environment | passed |" in (out / "summary.md").read_text()


def test_gpu_wheels_pin_the_versions_the_tests_run_here():
    """The GPU machine gets the packages it lacks at the versions CI tests with (installed here)."""
    from importlib import metadata

    pins = {}
    for line in (REPO / "benchmarks" / "gpu_requirements.txt").read_text().splitlines():
        requirement = line.split("#")[0].strip()
        if requirement:
            name, version = requirement.split("==")
            pins[name] = version
    assert {"datasets", "jsonschema", "smatch", "rapidfuzz"} <= set(pins)
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an optional extra not installed here (then its tests skip here too)
        assert installed == version, f"benchmarks/gpu_requirements.txt pins {name}=={version}, installed {installed}"


def test_the_gpu_upload_stays_within_60_mib():
    """The project (its tracked files) plus `make gpu-wheels` output, as it travels to the GPU machine."""
    import subprocess

    wheels = sorted((REPO / ".whl").glob("*.whl"))
    if not wheels:
        pytest.skip("no .whl/ here: run `make gpu-wheels` to measure the upload")
    pins = {line.split("#")[0].split("==")[0].strip().lower().replace("-", "_")
            for line in (REPO / "benchmarks" / "gpu_requirements.txt").read_text().splitlines() if line.split("#")[0].strip()}
    names = {wheel.name.split("-")[0].lower().replace("-", "_") for wheel in wheels}
    assert names <= pins, f"wheels in .whl/ that gpu_requirements.txt does not pin: {sorted(names - pins)}"
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout  # what travels: not-ignored files too
    project = sum((REPO / name).stat().st_size for name in tracked.split("\0") if name and (REPO / name).is_file())
    total = project + sum(wheel.stat().st_size for wheel in wheels)
    assert total <= 60 * 2**20, f"project {project / 2**20:.1f} MiB + wheels = {total / 2**20:.1f} MiB > 60 MiB"


def test_the_workflow_phase_collects_wall_time_start_up_and_the_comparison(tmp_path, monkeypatch):
    """What the workflow phase reads from what Snakemake left (the layout of rules/*.smk), planted here."""
    from benchmarks import check_records, gpu_check as driver

    run = tmp_path / "results" / "tiny-llama" / "amr_demo" / "mtup" / "seed1"
    run.mkdir(parents=True)
    (run / "train_log.jsonl").write_text(json.dumps({"step": 1, "loss": 7.0, "seconds_from_stage_start": 21.5}) + "\n"
                                         + json.dumps({"step": 2, "loss": 6.0}) + "\n")
    (run / "run_manifest.json").write_text(json.dumps({"final_loss": 6.0, "devices": ["cuda:0"], "peak_memory_bytes": 5}))
    (run / "eval.json").write_text(json.dumps({"score": 0.25, "device": "cuda:0", "dtype": "bfloat16", "n_examples": 72}))
    (tmp_path / "results" / "comparison.md").write_text("# comparison\n")
    (tmp_path / "results" / "benchmarks" / "train").mkdir(parents=True)
    (tmp_path / "results" / "benchmarks" / "train" / "mtup.tsv").write_text("s\th:m:s\tmax_rss\n31.25\t0:00:31\t100\n")
    monkeypatch.setattr(driver, "REPO", tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    context = driver.Context(out=out, python="python3", wheels=tmp_path, cpu=False)
    record = driver.collect_workflow(context, 0, 123.0)
    job = record["train_jobs"]["tiny-llama/amr_demo/mtup/seed1"]
    assert job["seconds_from_stage_start"] == 21.5 and job["steps_logged"] == 2 and job["devices"] == ["cuda:0"]
    assert record["evaluations"]["tiny-llama/amr_demo/mtup/seed1"]["device"] == "cuda:0"
    assert record["job_seconds"] == {"train/mtup": 31.25} and record["comparison"]
    assert (out / "comparison.md").read_text() == "# comparison\n"
    assert driver._workflow_reason(context) is not None  # a second run here would have nothing to do
    check_records.append({"check": "phase", "phase": "workflow", "status": "passed", "expected_seconds": 190,
                          "seconds": 123.0, "exit_code": 0, "log": "workflow.log", **record}, out / "measurements.jsonl")
    summary = driver.render_summary(check_records.read(out / "measurements.jsonl"))
    assert "123 s wall" in summary and "stage start -> first step 21.5 s" in summary and "train/mtup 31.2" in summary


# The 7B benchmark's harness on CPU: tests/test_gpu_bench_7b.py (issue 45).


def test_7b_flops_count_frozen_weights_without_weight_gradients():
    from benchmarks import bench_gpu_7b

    config = bench_gpu_7b.model_config(tiny=False)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size) == (
        3584, 18944, 28, 152064)
    lengths = np.full(4, 4096)
    frozen = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944)
    lora = bench_gpu_7b.lora_params(config, 16)
    assert lora == 28 * 16 * (2 * 7168 + 2 * 4096 + 3 * 22528)
    expected = 4 * frozen + 4 * 3584 * 152064 * 0.5 + 6 * lora + 12 * 28 * 3584 * 4096
    assert bench_gpu_7b.flops_per_token(config, lengths, 0.5, 16) == pytest.approx(expected)


def test_stage_startup_reruns_a_recorded_job_and_times_it(tmp_path):
    """benchmarks/stage_startup: a normalise job as Snakemake records it (.snakemake/metadata, the output path
    base64-encoded) is rerun in a copy of results/ under the probe; the original outputs are left alone."""
    import base64
    import shlex

    from benchmarks import stage_startup
    from data_helpers import demo_settings, run_download

    settings = demo_settings("amr_demo")
    raw = run_download("amr_demo", settings, tmp_path)
    report = "results/amr_demo/normalise_report.json"
    command = (f"python -m workflow_scripts.normalise --name amr_demo --dataset {shlex.quote(json.dumps(settings))} "
               f"--raw {raw.relative_to(tmp_path)} --out results/amr_demo/normalised --report {report} > logs/n.log 2>&1")
    metadata = tmp_path / ".snakemake" / "metadata"
    metadata.mkdir(parents=True)
    (metadata / base64.b64encode(report.encode()).decode().replace("/", "@")).write_text(
        json.dumps({"rule": "normalise", "shellcmd": command}))
    assert stage_startup.recorded_jobs(tmp_path) == {report: ("normalise", command.split(" > ")[0])}
    (row,) = stage_startup.measure(tmp_path, 1, log=lambda line: None, only={"normalise"})
    assert 0 < row["main"] < row["end"] and row["imports"] > 0 and "torch" not in row["loaded"]
    assert not (tmp_path / "results" / "amr_demo" / "normalised").exists()  # ran in the copy


def test_stage_startup_picks_the_gate_of_the_experiment_not_of_a_seed():
    """The gate runs once per experiment (issue 25): its recorded job is found under the experiment's path."""
    from benchmarks import stage_startup

    (piece,) = [piece for label, rule, piece in stage_startup.JOBS if rule == "sanity"]
    jobs = {f"results/tiny-llama/{dataset}/{variant}/sanity.json": ("sanity", f"gate {dataset} {variant}")
            for dataset in ("amr_demo", "chartqa_demo") for variant in ("baseline", "mtup")}
    assert stage_startup.pick(jobs, "sanity", piece) == "gate amr_demo baseline"


def test_import_seconds_sums_the_top_level_imports_and_names_the_heavy_ones():
    from benchmarks.stage_startup import import_seconds

    stderr = ("import time: self [us] | cumulative | imported package\n"
              "import time:       100 |     200000 |   torch._C\n"
              "import time:      1000 |    1500000 | torch\n"
              "import time:        10 |     500000 | workflow_scripts.core\n"
              "some other line\n")
    total, heavy = import_seconds(stderr)
    assert total == pytest.approx(2.0) and heavy == {"torch": pytest.approx(1.5)}


def test_demo_schedule_runs_independent_jobs_side_by_side_and_a_two_core_job_alone():
    from benchmarks.demo_schedule import schedule

    assert schedule({"a": (3.0, 1, []), "b": (5.0, 1, []), "c": (1.0, 1, ["a", "b"])}) == 6.0
    assert schedule({"a": (3.0, 2, []), "b": (5.0, 1, [])}) == 8.0  # a takes both cores
    assert schedule({"a": (3.0, 1, []), "b": (5.0, 1, ["a"])}, overhead=0.5) == 9.0


def test_demo_schedule_cuts_train_at_the_logged_step_repeats_the_seed_jobs_and_gates_once(tmp_path):
    from benchmarks.demo_schedule import Demo

    def bench(relative, seconds):
        path = tmp_path / "benchmarks" / f"{relative}.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"s\tcpu_time\n{seconds}\t0\n")

    run = "tiny-llama/amr_demo/baseline"
    for relative, seconds in [("download/amr_demo", 1), ("normalise/amr_demo", 1), ("prepare_model/tiny-llama", 2),
                              ("pretokenise/amr_demo/tiny-llama/baseline", 3), (f"{run}/base/evaluate", 4),
                              ("tiny-llama/amr_demo/power", 1), (f"{run}/seed1/sanity", 5), (f"{run}/seed1/train", 20),
                              (f"{run}/seed1/evaluate", 6), ("compare", 2)]:
        bench(relative, seconds)
    log = tmp_path / run / "seed1" / "train_log.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text("".join(json.dumps({"step": step, "elapsed_seconds": step / 30}) + "\n" for step in (1, 200, 300)))
    demo = Demo(tmp_path)
    jobs = demo.jobs(3, {300: 200}, peft_saving=1.0)
    assert jobs["train/tiny-llama/amr_demo/baseline/2"][0] == pytest.approx(20 - 10 + 200 / 30 - 1.0)
    assert sum(name.startswith("train/") for name in jobs) == sum(name.startswith("evaluate/") for name in jobs) == 3
    # one gate per experiment (issue 25), which every seed's training waits for
    assert [name for name in jobs if name.startswith("sanity/")] == [f"sanity/{run}"] and jobs[f"sanity/{run}"][0] == 4.0
    assert all(jobs[f"train/{run}/{seed}"][2] == [f"sanity/{run}"] for seed in (1, 2, 3))
    per_seed = demo.jobs(3, {}, peft_saving=1.0, gate_per_seed=True)  # the rules before issue 25
    assert [per_seed[f"sanity/{run}/{seed}"][0] for seed in (1, 2, 3)] == [4.0] * 3
    bench(f"{run}/sanity", 7)  # a run made since: the gate's benchmark has no seed
    assert demo.jobs(3, {})[f"sanity/{run}"][0] == 7.0
