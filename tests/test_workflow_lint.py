"""The workflow passes `snakemake --lint` (log/benchmark/conda on every rule, no path composition...)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_snakemake_lint_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint", "--cores", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Congratulations" in output, output
