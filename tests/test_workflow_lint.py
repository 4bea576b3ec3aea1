"""The workflow passes `snakemake --lint` (log/benchmark/conda on every rule, no path composition...) and
`snakefmt --check`."""
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


def test_snakefmt_check_is_clean():
    """The Snakefile and rules/*.smk are as snakefmt (the workflow catalog's formatter, in the test extra)
    writes them, with pyproject.toml's [tool.snakefmt] settings."""
    snakefmt = Path(sys.executable).with_name("snakefmt")
    result = subprocess.run(
        [str(snakefmt) if snakefmt.exists() else "snakefmt", "--check", "Snakefile", "rules/"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "would be changed" not in output, output
