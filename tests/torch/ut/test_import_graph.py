"""The package's import graph: no cycles, floors that only import downward, and no tooling on the training
import path.

The graph counts every ``import`` in a module, function-level ones too: a lazy import only hides a
cycle from the interpreter, the two modules still depend on each other. A package's ``__init__`` is
not counted as imported by its own submodules (Python loads it first anyway).

The floors (docs/design.md section 2), lowest first; a module may import its own floor and the ones below:

    0  config/ (+ the leaf helpers rank_log, torch_features)   imports torch/tyro only
    1  protocols/                                              interfaces
    2  models/common/                                          building blocks (layers, MoE, attention, LoRA)
    3  distributed/, data/, hf/                                parallelisms, data, the HF checkpoint engine
    4  models/<family>/                                        the families (model, sharding, HF mapping)
    5  components/                                             training components (step runner, model builder)
    6  trainer, train, dry_run/, the package's __init__,       the entry points and what composes a whole run
       models/<family>/config_registry (the recipes)
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
    graph: dict[str, set[str]] = {m: set() for m in _module_files(root)}
    for mod, target, _ in package_imports(root):
        graph[mod].add(target)
    return graph


def package_imports(root: Path = PACKAGE) -> list[tuple[str, str, int]]:
    """``(module, imported package module, line)`` of every import in the package (anywhere in a body)."""
    mods = _module_files(root)
    top = root.name
    found: set[tuple[str, str, int]] = set()
    for mod, path in sorted(mods.items()):
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
                    found.add((mod, target, node.lineno))
    return sorted(found)


FLOORS: dict[str, int] = {
    "config": 0,
    "rank_log": 0,
    "torch_features": 0,
    "protocols": 1,
    "models": 2,  # the models package itself (its __init__ imports nothing); each family is FAMILY_FLOOR
    "models.common": 2,
    "distributed": 3,
    "data": 3,
    "hf": 3,
    "components": 5,
    "dry_run": 6,  # an entry point (python -m hyper_parallel.dry_run): it reads the run config, Trainer.Config
    "trainer": 6,
    "train": 6,
    "": 6,  # the package's __init__
}
"""Floor of each area of the package (a module path below the top package; the longest prefix wins)."""
FAMILY_FLOOR = 4
"""``models/<family>/``: every folder of ``models`` but ``common``."""
RECIPES = ("config_registry", "trainer_config")
"""A family's recipes build a whole run config (``Trainer.Config``): they sit with the entry points, and no family
module imports them (``ConfigManager`` finds them by name)."""
RECIPE_FLOOR = 6


def floor_of(module: str) -> int | None:
    """The floor of ``module`` (a dotted name under the top package); None: an area FLOORS does not name."""
    rel = module.partition(".")[2]
    parts = rel.split(".") if rel else []
    if len(parts) >= 2 and parts[0] == "models" and parts[1] != "common":
        return RECIPE_FLOOR if len(parts) > 2 and parts[2] in RECIPES else FAMILY_FLOOR
    for n in range(len(parts), -1, -1):
        area = ".".join(parts[:n])
        if area in FLOORS:
            return FLOORS[area] if n or not parts else None  # a new top-level module must be given a floor
    return None


def upward_imports(imports: list[tuple[str, str, int]]) -> list[str]:
    """Every import of a higher floor by a lower one, as ``module:line (floor a) imports target (floor b)``."""
    bad = []
    for mod, target, line in imports:
        a, b = floor_of(mod), floor_of(target)
        if a is not None and b is not None and b > a:
            bad.append(f"{mod}:{line} (floor {a}) imports {target} (floor {b})")
    return bad


def forbidden_imports(imports: list[tuple[str, str, int]], area: str, forbidden: tuple[str, ...]) -> list[str]:
    """Imports by modules of ``area`` (e.g. ``config``) of any module under ``forbidden`` areas."""
    top = PACKAGE.name

    def under(module: str, prefix: str) -> bool:
        full = f"{top}.{prefix}"
        return module == full or module.startswith(full + ".")

    return [
        f"{mod}:{line} imports {target}"
        for mod, target, line in imports
        if under(mod, area) and any(under(target, f) for f in forbidden)
    ]


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


def test_every_module_has_a_floor():
    missing = sorted(m for m in _module_files(PACKAGE) if floor_of(m) is None)
    assert not missing, f"modules in no floor: {missing}; give their area one in FLOORS (and docs/design.md section 2)"


def _listed(why: str, bad: list[str]) -> str:
    return why + ":\n  " + "\n  ".join(bad)


def test_no_floor_imports_a_higher_one():
    bad = upward_imports(package_imports())
    assert not bad, _listed("a lower floor imports a higher one (lazy imports count): move the concept down", bad)


def test_config_imports_nothing_above_it():
    areas = ("models", "protocols", "hf", "data", "distributed", "components")
    bad = forbidden_imports(package_imports(), "config", areas)
    assert not bad, _listed(f"config/ must import nothing from {', '.join(areas)}", bad)


def test_building_blocks_import_no_parallelism_data_or_hf():
    areas = ("distributed", "data", "hf", "components")
    bad = forbidden_imports(package_imports(), "models.common", areas)
    assert not bad, _listed(f"models/common/ (the building blocks) must import nothing from {', '.join(areas)}", bad)


def test_floor_check_sees_a_lazy_upward_import(tmp_path):
    # The check itself can fail: a function-level import of a higher floor is named with its line.
    top = PACKAGE.name
    pkg = tmp_path / top
    (pkg / "models" / "common").mkdir(parents=True)
    (pkg / "config").mkdir()
    for init in (pkg, pkg / "config", pkg / "models", pkg / "models" / "common"):
        (init / "__init__.py").write_text("")
    (pkg / "models" / "common" / "block.py").write_text("from ...config import opts\n")
    (pkg / "config" / "opts.py").write_text(f"def f():\n    from {top}.models.common import block\n    return block\n")
    imports = package_imports(pkg)
    assert upward_imports(imports) == [f"{top}.config.opts:2 (floor 0) imports {top}.models.common.block (floor 2)"]
    assert forbidden_imports(imports, "config", ("models",)) == [
        f"{top}.config.opts:2 imports {top}.models.common.block"
    ]


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
