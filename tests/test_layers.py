"""The package's import layers, read from the source (docs/architecture.md, "Layers").

Every ``import`` of the project's own modules counts, at module level or inside a function (a lazy
import is still a dependency). Two rules:
- no import circle between modules;
- a module imports only its own layer or the layers below:
    3  entry modules: ``workflow_scripts/<stage>.py`` and ``workflow_scripts/demo/``
    2  ``tasks/``, ``training/``, ``analysis/``, ``checks/`` (the config's parse-time checks)
    1  ``model/``, ``data/``, ``launch/``
    0  ``core/``: imports nothing of the project's outside ``core/``.
``KNOWN_UPWARD`` lists the upward imports not yet moved, each with what it needs; the test fails on any
other, and on an entry there that the code no longer has (so the list only shrinks).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "workflow_scripts"
LAYERS = {"core": 0, "model": 1, "data": 1, "launch": 1, "tasks": 2, "training": 2, "analysis": 2, "checks": 2}
TOP = 3

# (importer, imported) -> why it is still there. Move the function to the layer that owns it, then drop the entry.
KNOWN_UPWARD = {
}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under ``root``."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (lazy imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = ".".join(filter(None, [base, node.module]))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in base
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports of a higher layer; ``core`` may import only ``core``."""
    return {(module, target) for module, targets in graph.items() for target in targets
            if layer(target) > layer(module)}


def test_no_import_circle():
    circles = import_circles(import_graph())
    assert not circles, "import circles (break each by moving a function down to the layer that owns it):\n" + \
        "\n".join(" <-> ".join(circle) for circle in circles)


def test_no_import_against_the_layer_order():
    upward = upward_imports(import_graph())
    new = sorted(upward - set(KNOWN_UPWARD))
    assert not new, "imports from a lower layer up to a higher one (see docs/architecture.md, Layers):\n" + \
        "\n".join(f"{a} -> {b}" for a, b in new)
    gone = sorted(set(KNOWN_UPWARD) - upward)
    assert not gone, f"no longer imported; drop from KNOWN_UPWARD: {gone}"


def test_core_imports_only_core():
    graph = import_graph()
    outside = {(m, t) for m, targets in graph.items() if layer(m) == 0 for t in targets if layer(t) != 0}
    assert not outside, sorted(outside)


def _write(root: Path, relative: str, text: str) -> None:
    path = root / PACKAGE / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_planted_circle_and_upward_import_are_caught(tmp_path, lazy):
    """A core module importing training (lazily or not), which imports it back, is both a circle and upward."""
    _write(tmp_path, "__init__.py", "")
    _write(tmp_path, "core/__init__.py", "")
    _write(tmp_path, "training/__init__.py", "")
    body = ("def f():\n    from workflow_scripts.training.setup import g\n" if lazy
            else "from workflow_scripts.training import setup\n")
    _write(tmp_path, "core/config.py", body)
    _write(tmp_path, "training/setup.py", "from ..core.config import f\n\ndef g():\n    pass\n")
    graph = import_graph(tmp_path)
    assert import_circles(graph) == [["workflow_scripts.core.config", "workflow_scripts.training.setup"]]
    assert upward_imports(graph) == {("workflow_scripts.core.config", "workflow_scripts.training.setup")}


def test_the_layer_order_is_written_in_the_architecture_doc():
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "## Layers" in text and "tests/test_layers.py" in text


def test_demo_generators_sit_apart_from_the_stage_modules():
    """A rule runs each top-level module; the demo's data generators, which no rule runs, live in demo/."""
    top = {path.stem for path in (ROOT / PACKAGE).glob("*.py")} - {"__init__"}
    assert not {name for name in top if name.startswith("make_")}, "demo generators belong in workflow_scripts/demo/"
    assert {path.stem for path in (ROOT / PACKAGE / "demo").glob("make_*.py")} == {
        "make_data", "make_images", "make_corpus", "make_classification"}


def test_every_module_the_docs_rules_and_tests_run_exists():
    import re

    modules = module_files(ROOT)
    places = [ROOT / "README.md", ROOT / "Snakefile", ROOT / "Makefile", *(ROOT / "docs").rglob("*.md"),
              *(ROOT / "rules").glob("*.smk"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    named = {(path.name, module) for path in places if path.exists()
             for module in re.findall(r"-m (workflow_scripts(?:\.\w+)+)", path.read_text())}
    named |= {(path.name, module) for path in places if path.exists()
              for module in re.findall(r'"-m", "(workflow_scripts(?:\.\w+)+)"', path.read_text())}
    missing = sorted((where, module) for where, module in named if module not in modules)
    assert named and not missing, missing
