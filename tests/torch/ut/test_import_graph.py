"""The package's import graph: no cycles, and no tooling on the training import path.

The graph counts every ``import`` in a module, function-level ones too: a lazy import only hides a
cycle from the interpreter, the two modules still depend on each other. A package's ``__init__`` is
not counted as imported by its own submodules (Python loads it first anyway).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "hyper_parallel"


def _module_files(root: Path) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its body)."""
    mods = _module_files(root)
    top = root.name
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # `from pkg import sub` imports the submodule pkg.sub when there is one
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
            for name in targets:
                if not name.startswith(top):
                    continue
                target = _resolve(name, mods)
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_package_has_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "modules that import each other (directly or around a circle): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_cycle_finder_sees_a_lazy_mutual_import(tmp_path):
    # The check itself can fail: a function-level import back to the importer is a cycle.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import g\n")
    (pkg / "b.py").write_text("def g():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert find_cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


@pytest.mark.parametrize("entry", ["hyper_parallel.train", "hyper_parallel.trainer"])
def test_training_import_path_has_no_tooling(entry):
    code = (
        f"import sys, {entry}\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('hyper_parallel', 'tools'))\n"
        "             and m.rsplit('.', 1)[-1] in ('docgen', 'legacy'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"`import {entry}` loads tooling modules: {out.stdout.strip()}"


def test_no_docgen_inside_the_runtime_package():
    assert not list(PACKAGE.rglob("docgen.py")), "docs tooling belongs in tools/, outside hyper_parallel/"
