"""ConfigManager: recipe lookup (``--module/--config``), run files and tyro CLI overrides.

Precedence, lowest first: the recipe function's return value, then a run file
(``--config-file run.toml|run.yaml``), then command-line overrides such as ``--training.steps 20``.

Run ``python -m hyper_parallel.config.manager --module glm_image_moe --config glm_image_moe_debug``
to print the resolved config, or add ``--help`` to list every field with its docstring.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import json
import pkgutil
import sys
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tyro

from hyper_parallel.config.errors import ConfigError

__all__ = ["ConfigManager", "ConfigError", "apply_overrides", "load_run_file"]

_MODELS_PACKAGE = "hyper_parallel.models"


def _pop_option(args: list[str], name: str) -> str | None:
    """Remove ``--name value`` or ``--name=value`` from ``args`` and return the value."""
    for i, arg in enumerate(args):
        if arg == name:
            if i + 1 >= len(args):
                raise ConfigError(f"{name} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(name + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def _field_value(config: Any, path: str) -> Any:
    """The value at dotted ``path`` in a config (list items by index); a sentinel when there is none."""
    node = config
    for part in path.split("."):
        if isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif dataclasses.is_dataclass(node) and hasattr(node, part):
            node = getattr(node, part)
        else:
            return _MISSING
    return node


_MISSING = object()


def bool_values_to_flags(argv: list[str], config: Any) -> list[str]:
    """Booleans are flags (``--debug.deterministic``, ``--debug.no_deterministic``); an explicit value
    (``--debug.deterministic False``, the v1 habit) is rewritten to the flag so both spellings work."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            path, value, width = arg[2:].split("=", 1)[0], arg.split("=", 1)[1].lower(), 1
        else:
            path, width = arg[2:], 2
            value = argv[i + 1].lower() if i + 1 < len(argv) else None
        if arg.startswith("--") and value in _BOOL_WORDS and _is_optional_bool(config, path):
            # `bool | None` (e.g. --model.use_mtp) is a choice of True / False / None: accept true/false/1/0 too.
            # Checked first: a recipe may hold a bool there (--model.image_path), which is no plain flag
            out += [arg.split("=", 1)[0], str(_BOOL_WORDS[value])]
            i += width
            continue
        if arg.startswith("--") and value in _BOOL_WORDS and isinstance(_field_value(config, path), bool):
            *parents, leaf = path.split(".")
            out.append("--" + ".".join([*parents, leaf if _BOOL_WORDS[value] else f"no_{leaf}"]))
            i += width
            continue
        out.append(arg)
        i += 1
    return out


def _is_optional_bool(config: Any, path: str) -> bool:
    """Whether the field at dotted ``path`` is annotated ``bool | None``."""
    *parents, leaf = path.split(".")
    node = _field_value(config, ".".join(parents)) if parents else config
    if not dataclasses.is_dataclass(node):
        return False
    try:
        hint = typing.get_type_hints(type(node)).get(leaf)
    except Exception:  # noqa: BLE001 - unresolvable annotations
        return False
    return set(typing.get_args(hint)) == {bool, type(None)}


def available_modules() -> list[str]:
    """Model packages under ``hyper_parallel.models`` that have a ``config_registry``."""
    pkg = importlib.import_module(_MODELS_PACKAGE)
    names = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.ispkg and (Path(pkg.__path__[0]) / info.name / "config_registry.py").exists():
            names.append(info.name)
            if info.name.endswith("_v2"):
                names.append(info.name[: -len("_v2")])
    return sorted(set(names))


def _import_registry(module: str) -> Any:
    candidates = [
        f"{_MODELS_PACKAGE}.{module}.config_registry",
        f"{_MODELS_PACKAGE}.{module}_v2.config_registry",
        f"{module}.config_registry",
        module,
    ]
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Only swallow "this candidate does not exist"; a broken import inside it must surface.
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise
    raise ConfigError(
        f"--module {module!r} is not a model package or an importable module; "
        f"available modules: {', '.join(available_modules())}"
    )


def available_recipes(registry: Any) -> list[str]:
    """Public functions defined in a config_registry module (the recipes)."""
    return sorted(
        name
        for name, obj in vars(registry).items()
        if callable(obj)
        and not name.startswith("_")
        and getattr(obj, "__module__", None) == registry.__name__
        and not isinstance(obj, type)
    )


def resolve_recipe(module: str, config: str) -> Callable[[], Any]:
    """Find recipe function ``config`` of model package (or dotted module) ``module``."""
    registry = _import_registry(module)
    fn = getattr(registry, config, None)
    recipes = available_recipes(registry)
    if fn is None or not callable(fn) or isinstance(fn, type):
        close = difflib.get_close_matches(config, recipes, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"--config {config!r} is not a recipe in {registry.__name__}.{hint} "
            f"Available recipes: {', '.join(recipes) or '(none)'}"
        )
    return fn


def load_run_file(path: str | Path) -> dict[str, Any]:
    """Read a ``.toml``, ``.yaml``/``.yml`` or ``.json`` run file into a nested dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config-file {str(path)!r} does not exist")
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"--config-file {str(path)!r}: use a .toml, .yaml, .yml or .json file")
    except ConfigError:
        raise
    except Exception as e:  # parser errors name line and column
        raise ConfigError(f"--config-file {str(path)!r} could not be parsed: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {str(path)!r} must hold a mapping of sections at top level")
    return data


def _check_value(where: str, old: Any, new: Any) -> Any:
    if isinstance(old, bool) and not isinstance(new, bool):
        raise ConfigError(f"{where}: expected true/false, got {new!r}")
    if isinstance(old, int) and not isinstance(old, bool) and not (isinstance(new, int) and not isinstance(new, bool)):
        raise ConfigError(f"{where}: expected an integer, got {new!r}")
    if isinstance(old, float) and not isinstance(new, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {new!r}")
    if isinstance(old, float):
        return float(new)
    if isinstance(old, str) and not isinstance(new, str):
        raise ConfigError(f"{where}: expected a string, got {new!r}")
    if isinstance(old, tuple) and isinstance(new, list):
        if len(new) != len(old):
            raise ConfigError(f"{where}: expected {len(old)} values, got {new!r}")
        return tuple(_check_value(where, o, n) for o, n in zip(old, new))
    return new


def apply_overrides(config: Any, overrides: dict[str, Any], *, source: str = "overrides") -> Any:
    """Return a copy of ``config`` with a nested dict of overrides applied.

    Unknown keys are errors naming the full key and the closest existing field.
    """
    config = copy.deepcopy(config)
    _apply(config, overrides, prefix="", source=source)
    return config


def _apply(node: Any, overrides: dict[str, Any], *, prefix: str, source: str) -> None:
    names = [f.name for f in dataclasses.fields(node) if not f.name.startswith("_")]
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; fields here: {', '.join(names)}"
            raise ConfigError(f"{source}: unknown key {full!r}{hint}")
        current = getattr(node, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {full!r} is a section; give it a mapping, not {value!r}")
            _apply(current, value, prefix=full + ".", source=source)
            setattr(node, key, _reconstructed(current, where=f"{source}: {full!r}"))
        elif current is None and isinstance(value, dict) and _section_class(node, key) is not None:
            # e.g. `[model.mtp]` on a recipe without an MTP block: there is no section to set fields of
            options = [n for n in names if key in n and n != key]
            hint = f"; use {' / '.join(prefix + n for n in options)} instead" if options else ""
            raise ConfigError(
                f"{source}: {full!r} is null in this config, so its fields cannot be set one by one{hint}"
            )
        elif isinstance(current, list) and not current and isinstance(value, list) and _item_class(node, key):
            # an empty list of sub-configs (`data.sources`): the run file gives the items
            item_cls = _item_class(node, key)
            from_mapping = getattr(item_cls, "from_mapping", None)  # an item class that reads its own tables
            items = []
            for i, sub in enumerate(value):
                if not isinstance(sub, dict):
                    raise ConfigError(f"{source}: {full}.{i} must be a mapping of {item_cls.__name__} fields, not {sub!r}")
                if from_mapping is not None:
                    try:
                        items.append(from_mapping(sub, where=f"{full}[{i}]"))
                    except (TypeError, ValueError) as e:
                        raise ConfigError(f"{source}: {e}") from None
                    continue
                items.append(item_cls())
                _apply(items[-1], sub, prefix=f"{full}.{i}.", source=source)
            setattr(node, key, items)
        elif isinstance(current, list) and current and dataclasses.is_dataclass(current[0]):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for idx, sub in items:
                i = int(idx)
                if not 0 <= i < len(current):
                    raise ConfigError(f"{source}: {full}.{idx} is out of range (length {len(current)})")
                _apply(current[i], sub, prefix=f"{full}.{i}.", source=source)
        else:
            setattr(node, key, _check_value(f"{source}: {full!r}", current, value))


def _reconstructed(section: Any, *, where: str) -> Any:
    """``section`` constructed again from its (overridden) fields when its class derives values in
    ``__post_init__`` (the model's options are pushed into its layers there), so a run file gives what the
    same flags on the command line give."""
    if not hasattr(type(section), "__post_init__"):
        return section
    try:
        return dataclasses.replace(section)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


def _section_class(node: Any, key: str) -> type | None:
    """The dataclass ``X`` of a field annotated ``X | None`` (None otherwise)."""
    try:
        hint = typing.get_type_hints(type(node)).get(key)
    except Exception:  # noqa: BLE001 - unresolvable annotations: not a sub-config
        return None
    classes = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
    return classes[0] if classes else None


def _item_class(node: Any, key: str) -> type | None:
    """The dataclass ``X`` of a field annotated ``list[X]`` (None otherwise)."""
    try:
        hint = typing.get_type_hints(type(node)).get(key)
    except Exception:  # noqa: BLE001 - unresolvable annotations: not a list of sub-configs
        return None
    args = typing.get_args(hint) if typing.get_origin(hint) is list else ()
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _initial_load_path(argv: Sequence[str], data: dict[str, Any] | None) -> str | None:
    """``--checkpoint.initial_load_path`` of the command line (else of the run file), without consuming it."""
    name = "--checkpoint.initial_load_path"
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    section = (data or {}).get("checkpoint")
    return section.get("initial_load_path") if isinstance(section, dict) else None


def _has_recipe(module: str, recipe: str) -> bool:
    try:
        registry = _import_registry(module)
    except ConfigError:
        return False
    return callable(getattr(registry, recipe, None))


def _module_of_recipe(recipe: str) -> str | None:
    """The one model package with a recipe named ``recipe`` (None when no package or several have one)."""
    names = [m for m in available_modules() if not m.endswith("_v2")]
    found = [m for m in names if _has_recipe(m, recipe)]
    return found[0] if len(found) == 1 else None


def _cli_model_fields(argv: Sequence[str]) -> set[str]:
    """Dotted paths under ``model`` that command-line flags set (``--model.x.y v``, ``--model.no_flag``)."""
    out = set()
    for arg in argv:
        if arg.startswith("--model."):
            *parents, leaf = arg[len("--model.") :].split("=", 1)[0].split(".")
            out.add(".".join([*parents, leaf.removeprefix("no_")]))
    return out


def _run_file_model_fields(data: dict[str, Any], path: str) -> set[str]:
    """Dotted paths under ``model`` that a run file sets (``data``: already in the new layout)."""
    out: set[str] = set()

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
        if items is None or (isinstance(node, list) and not all(isinstance(v, dict) for v in node)):
            out.add(prefix)
            return
        for key, value in items:
            walk(value, f"{prefix}.{key}" if prefix else str(key))

    if isinstance(data.get("model"), dict):
        walk(data["model"], "")
    return out


FolderFamily = Callable[..., "str | None"]
"""``folder_family(folder, *, where=None, spec_name=None, has_recipe=None) -> str | None``: the model package that
reads HF folder ``folder`` (None: ``folder`` is no HF folder); ``spec_name``: the run's package, an error (a
``ConfigError`` naming both families) when the folder is of another; ``has_recipe(name)``: pick the candidate package
that has the run's recipe. The run's entry point passes ``hyper_parallel.hf.folder.folder_family``."""


class ConfigManager:
    """Parses ``--module M --config C [--config-file F] [overrides]`` into a run config.

    ``folder_family`` (given by the entry point: this floor reads no HF folder) opens an HF
    ``--checkpoint.initial_load_path`` once: it names the model package when ``--module`` is left out, and checks
    that the folder is of the run's family. Without it the module comes from the recipe alone, and the trainer
    checks the folder's family when it reads the folder."""

    def __init__(self, *, folder_family: FolderFamily | None = None) -> None:
        self.folder_family = folder_family
        self.config: Any = None
        self.module: str | None = None
        self.recipe: str | None = None

    def parse_args(self, args: Sequence[str] | None = None) -> Any:
        """Resolve the recipe, apply the run file, then tyro CLI overrides; return the run config."""
        argv = list(sys.argv[1:] if args is None else args)
        module = _pop_option(argv, "--module")
        recipe = _pop_option(argv, "--config")
        run_file = _pop_option(argv, "--config-file")
        data = load_run_file(run_file) if run_file is not None else None
        folder = _initial_load_path(argv, data)
        if folder and not Path(folder).expanduser().exists():
            raise ConfigError(
                f"--checkpoint.initial_load_path {folder}: the folder {str(Path(folder).expanduser())!r} does not "
                "exist; give the HF folder that holds the model's config.json and safetensors"
            )
        family = None  # the folder's package, when --module is left out (the folder is opened once, here)
        if module is None and recipe is not None and folder and self.folder_family is not None:
            family = self.folder_family(folder, has_recipe=lambda name: _has_recipe(name, recipe))
        if module is None and recipe is not None:
            module = family or _module_of_recipe(recipe)
        if module is None or recipe is None:
            raise ConfigError(
                "both --module and --config are required (--module may be left out when "
                "--checkpoint.initial_load_path is an HF folder or one model package has the recipe), e.g. "
                "--module glm_image_moe --config glm_image_moe_debug; "
                f"available modules: {', '.join(available_modules())}"
            )
        config = resolve_recipe(module, recipe)()
        if not dataclasses.is_dataclass(config):
            raise ConfigError(f"recipe {module}.{recipe} must return a config dataclass, got {type(config).__name__}")
        explicit: set[str] = set()
        if data is not None:
            data = self._translated(data, run_file)  # once: the v1 translation warns
            config = apply_overrides(config, data, source=f"--config-file {run_file}")
            explicit |= _run_file_model_fields(data, run_file)
        argv = bool_values_to_flags(argv, config)
        explicit |= _cli_model_fields(argv)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tyro warns about subclass defaults it handles fine
            config = tyro.cli(
                type(config),
                default=config,
                args=argv,
                prog=f"--module {module} --config {recipe}",
                description=(
                    f"Run config of recipe {module}.{recipe}; every field listed can be overridden. With "
                    "--checkpoint.initial_load_path DIR (an HF folder) the model is DIR's config.json: the model "
                    "values listed are the recipe's, which the folder replaces (only the training-only options "
                    "--model.use_mtp / mtp_loss_weight / router_aux_loss_coef / freeze apply on top). The model's "
                    "per-layer tree (model.layers, model.mtp, ...) is not on the command line: the model-level "
                    "options set every layer (--model.rms_norm_eps ...); one layer's field is set from a run "
                    "file (--config-file run.toml with [model.layers.3.mlp] num_experts = 8)."
                ),
                config=(tyro.conf.AvoidSubcommands,),
                use_underscores=True,
            )
        if any(f.name == "explicit_model_fields" for f in dataclasses.fields(config)):
            config = dataclasses.replace(config, explicit_model_fields=tuple(sorted(explicit)))
        self._check_folder_family(config, checked=(folder, family) if family is not None else None)
        validate = getattr(config, "validate", None)
        if callable(validate):
            validate()
        self.config, self.module, self.recipe = config, module, recipe
        return config

    def _check_folder_family(self, config: Any, *, checked: tuple[str, str] | None = None) -> None:
        """A run whose ``checkpoint.initial_load_path`` is an HF folder of another family than its model: an error
        (``checked``: ``(folder, package)`` the module was read from, not opened again)."""
        folder = getattr(getattr(config, "checkpoint", None), "initial_load_path", None)
        spec = getattr(config, "model_spec", None)
        if checked is not None and checked == (folder, spec):
            return
        if spec and folder and self.folder_family is not None:
            self.folder_family(folder, where=f"--checkpoint.initial_load_path {folder}", spec_name=spec)

    @staticmethod
    def _translated(data: dict[str, Any], path: str) -> dict[str, Any]:
        """A run file's data in the new layout (a v1 three-section YAML translated, with its warning)."""
        # Imported only for a run file: the v1-YAML translation is a feature off the training import path.
        from hyper_parallel.config import legacy

        return legacy.translate_legacy(data, source=f"--config-file {path}") if legacy.is_legacy_layout(data) else data


def main(argv: Sequence[str] | None = None) -> None:
    """Print the resolved run config as JSON."""
    config = ConfigManager().parse_args(argv)
    to_dict = getattr(config, "to_dict", None)
    data = to_dict() if callable(to_dict) else dataclasses.asdict(config)
    print(json.dumps(data, indent=2, default=str))


TRACEBACK_ENV = "HYPER_PARALLEL_TRACEBACK"
"""Set (``=1``) to get the Python traceback of a user error instead of its one line."""


def run_cli(entry: Callable[[], Any], *, user_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Run a command-line entry point; a ConfigError (or one of ``user_errors``: a problem of the user's input,
    whose message says what to change) becomes one ``error:`` line and exit code 2, no traceback
    (``HYPER_PARALLEL_TRACEBACK=1`` shows it)."""
    import os

    try:
        entry()
    except (ConfigError, *user_errors) as e:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        message = e.args[0] if isinstance(e, KeyError) and len(e.args) == 1 else e  # KeyError repr()s its message
        print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    run_cli(main)
