"""What travels to a GPU machine (`make gpu-wheels`, benchmarks/gpu_requirements.txt) is enough there.

A GPU machine has no registry: what its image lacks comes as wheels, installed with --no-deps. A wheel
whose own requirement is neither another wheel nor in the image fails only there, at import, and costs
the lent minutes (Snakemake imports wrapt and tabulate at start; the list lacked both before the
workflow phase could run). Checked here against the installed packages' own metadata.
"""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "benchmarks" / "gpu_requirements.txt"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: Path = REQUIREMENTS) -> tuple[set[str], set[str], set[str]]:
    """(pinned wheels, the image's packages, the packages left out on purpose), canonical names."""
    pins, image, left_out = set(), set(), set()
    for line in path.read_text().splitlines():
        for label, names in (("# image:", image), ("# left out:", left_out)):
            if line.startswith(label):
                names.update(canonical(name) for name in line[len(label):].split())
        requirement = line.split("#")[0].strip()
        if requirement:
            pins.add(canonical(requirement.split("==")[0]))
    return pins, image, left_out


def needs(name: str) -> list[str]:
    """What the installed distribution ``name`` requires on this platform (no extras)."""
    required = []
    for text in metadata.distribution(name).requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            required.append(canonical(requirement.name))
    return required


def closure(names: set[str]) -> set[str]:
    """``names`` and everything they need, as installed here."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(needs(name))
        except metadata.PackageNotFoundError:
            continue
    return seen


def unmet(path: Path = REQUIREMENTS) -> dict[str, list[str]]:
    """Each pinned wheel's requirements that neither a wheel, the image nor the left-out list provides."""
    pins, image, left_out = read_requirements(path)
    provided = pins | closure(image) | left_out
    missing = {}
    for name in sorted(pins):
        try:
            lacking = sorted(set(needs(name)) - provided)
        except metadata.PackageNotFoundError:
            continue  # an optional extra not installed here (its version test skips it too)
        if lacking:
            missing[name] = lacking
    return missing


def test_every_gpu_wheel_gets_what_it_needs_from_the_wheels_or_the_image():
    pins, image, left_out = read_requirements()
    assert {"torch", "transformers", "peft", "accelerate"} <= image
    assert "pulp" in left_out and not (pins & image) and not (pins & left_out)
    assert unmet() == {}, "add these to benchmarks/gpu_requirements.txt (or, with the reason, to 'left out')"


def test_a_wheel_without_its_requirement_is_found(tmp_path):
    """The list as it was before the workflow phase ran: Snakemake without wrapt and tabulate."""
    planted = tmp_path / "gpu_requirements.txt"
    planted.write_text("\n".join(line for line in REQUIREMENTS.read_text().splitlines()
                                 if not line.startswith(("wrapt==", "tabulate=="))) + "\n")
    found = unmet(planted)
    if "snakemake" not in found and not _installed("snakemake"):
        pytest.skip("snakemake is not installed here")
    assert set(found.get("snakemake", [])) >= {"wrapt", "tabulate"}, found


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def test_the_environment_phase_names_the_version_of_a_package_without_dunder_version(tmp_path, monkeypatch):
    """liger-kernel has no __version__: it was reported 'unavailable' though it imports."""
    pytest.importorskip("liger_kernel", reason="liger-kernel (the gpu extra) is not installed here")
    from benchmarks import check_records, gpu_check

    monkeypatch.setenv(check_records.VARIABLE, str(tmp_path / "measurements.jsonl"))
    gpu_check.write_environment(tmp_path / "environment.txt")
    lines = (tmp_path / "environment.txt").read_text().splitlines()
    assert f"liger_kernel {metadata.version('liger-kernel')}" in lines, lines
