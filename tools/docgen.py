"""Doc tables generated from the code, so the docs cannot drift from it.

- ``docs/zh/config_system.md``: every field of the run config, walked from the ``Trainer.Config`` that
  the ``glm_image_moe_debug`` recipe returns (name, type, default, the recipe's value, docstring);
- ``docs/migrations/v2_migration.md``: the v1 -> new key mapping, from ``legacy.LEGACY_KEYS``.

Each table sits between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->``::

    python -m tools.docgen          # rewrite the generated parts of both docs
    python -m tools.docgen --check  # exit 1 naming every doc that is out of date
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DOCS",
    "config_field_tables",
    "field_info",
    "migration_table",
    "render",
    "stale_docs",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = ("glm_image_moe", "glm_image_moe_debug")


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """What the source says about one dataclass field."""

    annotation: str
    """The annotation as written, with ``Annotated[X, ...]`` reduced to ``X``."""
    doc: str
    """The attribute docstring (the string literal right below the field), on one line."""
    cli: bool
    """False for fields marked ``tyro.conf.Suppress`` (set by code, not on the command line)."""


class _StripAnnotated(ast.NodeTransformer):
    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        name = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
        if name == "Annotated" and isinstance(node.slice, ast.Tuple):
            return self.visit(node.slice.elts[0])
        return self.generic_visit(node)


@functools.cache
def _class_fields(cls: type) -> dict[str, FieldInfo]:
    """Fields declared in ``cls``'s own body (not inherited), parsed from its source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    out: dict[str, FieldInfo] = {}
    for node, after in zip(body, [*body[1:], None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        doc = ""
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            doc = " ".join(inspect.cleandoc(after.value.value).split())
        text = ast.unparse(node.annotation)
        annotation = ast.unparse(_StripAnnotated().visit(ast.parse(text, mode="eval")))
        out[node.target.id] = FieldInfo(annotation, doc, cli="Suppress" not in text)
    return out


def field_info(cls: type, name: str) -> tuple[type, FieldInfo]:
    """``(declaring class, FieldInfo)`` of field ``name`` of dataclass ``cls`` (the nearest redeclaration wins)."""
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            info = _class_fields(klass).get(name)
            if info is None:
                raise LookupError(f"{klass.__qualname__}.{name}: its source could not be read")
            return klass, info
    raise LookupError(f"{cls.__qualname__} has no field {name!r}")


# ---- the config field tables -----------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{_cell(text)}`"


def _name(cls: type) -> str:
    return cls.__qualname__


def _value(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _code(_name(type(value)))
    if isinstance(value, (list, tuple)) and value and all(dataclasses.is_dataclass(v) for v in value):
        kinds = sorted({_name(type(v)) for v in value})
        return _code(f"[{len(value)} x {' | '.join(kinds)}]")
    if isinstance(value, enum.Enum):
        return _code(repr(value.value))
    return _code(repr(value))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _value(f.default_factory())
    return "（必填）"


def _walk(
    node: Any, path: str, seen: dict[type, list[str]], instances: dict[type, list[Any]], defer: Sequence[str] = ()
) -> None:
    """Record every dataclass instance under ``node`` by class (first-seen order), and the paths it occurs at."""
    if isinstance(node, (list, tuple)):
        for item in node:
            _walk(item, f"{path}.{{i}}", seen, instances)
        return
    if not (dataclasses.is_dataclass(node) and not isinstance(node, type)):
        return
    cls = type(node)
    seen.setdefault(cls, [])
    if path not in seen[cls]:
        seen[cls].append(path)
    instances.setdefault(cls, []).append(node)
    names = [f.name for f in dataclasses.fields(node) if not f.name.startswith("_")]
    for name in [n for n in names if n not in defer] + [n for n in names if n in defer]:
        _walk(getattr(node, name), f"{path}.{name}" if path else name, seen, instances)


def _module_config() -> type:
    from hyper_parallel.protocols.module import Module

    return Module.Config


def _table(cls: type, instance: Any, *, with_value: bool, skip_owner: type | None) -> list[str]:
    head = "| 字段 | 类型 | 默认值 |" + (" glm_image_moe_debug |" if with_value else "") + " 说明 |"
    rule = "|---|---|---|" + ("---|" if with_value else "") + "---|"
    rows = [head, rule]
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        owner, info = field_info(cls, f.name)
        if skip_owner is not None and owner is skip_owner:
            continue
        doc = info.doc or "（无说明）"
        if not info.cli:
            doc += "（由代码填写，不是命令行选项）"
        cells = [_code(f.name), _code(info.annotation), _default(f)]
        if with_value:
            cells.append(_value(getattr(instance, f.name)))
        cells.append(_cell(doc))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def config_field_tables(config: Any | None = None) -> str:
    """Markdown tables of every config class in ``config``'s tree (default: the glm_image_moe_debug recipe)."""
    if config is None:
        from hyper_parallel.config.manager import resolve_recipe

        config = resolve_recipe(*RECIPE)()
    seen: dict[type, list[str]] = {}
    instances: dict[type, list[Any]] = {}
    _walk(config, "", seen, instances, defer=("model",))
    module_config = _module_config()
    lines: list[str] = [
        f"由 `python -m tools.docgen` 从配方 `{RECIPE[1]}` 的配置树生成，请勿手改。"
        "“glm_image_moe_debug” 列是该配方给出的值；同一个类在树中出现多次且取值不同（如各层的 `mlp`）时只列默认值。",
        "",
    ]
    for cls, paths in seen.items():
        first, *rest = instances[cls]
        uniform = all(other == first for other in rest)
        where = ", ".join(_code(p or "<根>") for p in paths[:4]) + (f" 等 {len(paths)} 处" if len(paths) > 4 else "")
        skip = module_config if issubclass(cls, module_config) and cls is not module_config else None
        lines += [f"### `{_name(cls)}`", "", f"位置：{where}", ""]
        lines += _table(cls, first, with_value=uniform, skip_owner=skip)
        lines.append("")
    lines += [
        f"### `{_name(module_config)}`（每个模型组件 Config 都有的字段）",
        "",
        "上面各模型组件表省略了这两个继承字段；它们存在于 `model` 树中的每个组件 Config 上。",
        "",
    ]
    lines += _table(module_config, None, with_value=False, skip_owner=None)
    return "\n".join(lines).rstrip() + "\n"


# ---- the v1 migration table ------------------------------------------------------------------------------


def migration_table() -> str:
    """Markdown table of every v1 key: new field(s) as CLI flags, and the conversion rule."""
    from hyper_parallel.config.legacy import LEGACY_KEYS

    rows = [
        "Generated from `hyper_parallel.config.legacy.LEGACY_KEYS` by `python -m tools.docgen`; "
        "do not edit by hand.",
        "",
        "| v1 key | new field (command line) | conversion |",
        "|---|---|---|",
    ]
    for key, entry in LEGACY_KEYS.items():
        targets = ", ".join(_code(f"--{t}") for t in entry.targets) or "—"
        rows.append(f"| {_code(key)} | {targets} | {_cell(entry.rule)} |")
    return "\n".join(rows) + "\n"


# ---- writing and checking the docs ----------------------------------------------------------------------

DOCS: dict[str, tuple[str, Callable[[], str]]] = {
    "config-fields": ("docs/zh/config_system.md", config_field_tables),
    "v1-mapping": ("docs/migrations/v2_migration.md", migration_table),
}
"""Generated block name -> (doc path relative to the repository root, generator)."""


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- BEGIN GENERATED: {name} -->", f"<!-- END GENERATED: {name} -->"


def render(text: str, name: str, table: str) -> str:
    """``text`` with the block between the ``name`` markers replaced by ``table``."""
    begin, end = _markers(name)
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), flags=re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no {begin} ... {end} block to fill")
    return pattern.sub(lambda _: f"{begin}\n{table}{end}", text, count=1)


def stale_docs(root: Path = REPO_ROOT, *, write: bool = False) -> list[str]:
    """Doc paths whose generated block differs from the code (rewritten in place with ``write``)."""
    stale = []
    for name, (rel, generate) in DOCS.items():
        path = root / rel
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (run from a source checkout)")
        text = path.read_text()
        new = render(text, name, generate())
        if new != text:
            stale.append(rel)
            if write:
                path.write_text(new)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docgen", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when a doc is out of date")
    args = parser.parse_args(argv)
    stale = stale_docs(write=not args.check)
    for rel in stale:
        print(f"{rel}: {'out of date; run python -m tools.docgen' if args.check else 'updated'}")
    if not stale:
        print("docs are up to date")
    return 1 if (stale and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
