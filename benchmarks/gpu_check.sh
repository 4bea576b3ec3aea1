#!/usr/bin/env bash
# make gpu-check: every check that needs a CUDA GPU, in one call (the GPU machine is lent for minutes).
# Runs with the machine's own python (PyTorch, transformers, peft there); the packages it lacks come
# from .whl (make gpu-wheels, run where pip reaches a registry). Writes into $1 (default
# benchmarks/gpu_check): environment.txt, pytest.log, measurements.jsonl, and the GPU benchmark's
# results.json/RESULTS.md; exits non-zero when a check fails or no CUDA device is visible.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/gpu_check}"
python="${GPU_PYTHON:-python3}"
mkdir -p "$out"
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "gpu-check: $python cannot import torch; name the python that has it: make gpu-check GPU_PYTHON=..." >&2
  exit 2
fi
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: no CUDA device visible to $python; nothing was checked" >&2
  exit 2
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  site="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")"  # removed at exit
  trap 'rm -rf "$site"' EXIT
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 GPU_CHECK_REPORT="$PWD/$out/measurements.jsonl"
rm -f "$GPU_CHECK_REPORT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$python" - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("transformers", "peft", "accelerate", "datasets", "bitsandbytes"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # a missing package is reported, and its checks skip with the reason
        print(name, "unavailable:", type(error).__name__, str(error).splitlines()[0][:120])
PY
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt"
status=0
# The CUDA-marked tests, then the GPU benchmark. Files are named: collecting every test module would
# import what the GPU machine lacks (snakemake) for tests that do not run there anyway.
"$python" -m pytest -q -rs -m cuda -p no:cacheprovider ${GPU_TEST_FILES:-tests/test_gpu.py tests/test_evaluate.py tests/test_batch_invariance.py} 2>&1 | tee "$out/pytest.log" || status=1
"$python" -m benchmarks.run --only gpu_lora_bf16 --out-dir "$out" 2>&1 | tee "$out/benchmark.log" || status=1
# What was measured, one line per check: the gate's verdicts, losses, step time, peak vs estimate.
"$python" - "$GPU_CHECK_REPORT" <<'PY' | tee "$out/summary.md"
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
print("| check | loss first -> last | median step s | peak / estimate (MiB) | other |")
print("|---|---|---|---|---|")
mib = lambda b: f"{b / 2**20:,.0f}" if isinstance(b, (int, float)) else "-"
for r in rows:
    other = {k: v for k, v in r.items() if k not in {"test", "device", "first_loss", "last_loss", "median_step_seconds",
             "peak_memory_bytes", "estimated_bytes", "devices", "peak_memory_kind", "steps"}}
    loss = f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}" if "first_loss" in r else "-"
    step = f"{r['median_step_seconds']:.4f}" if r.get("median_step_seconds") else "-"
    print(f"| {r['test']} | {loss} | {step} | {mib(r.get('peak_memory_bytes'))} / {mib(r.get('estimated_bytes'))} | {json.dumps(other)} |")
PY
echo "gpu-check: wrote $out (exit $status)"
exit $status
