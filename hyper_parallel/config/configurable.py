"""The Configurable protocol: every component is built from its own nested ``Config``.

A ``Configurable`` subclass declares ``@dataclass(kw_only=True, slots=True) class Config(Parent.Config)``
inside its body. ``Config.build(**runtime_objects)`` constructs the owner as
``Owner(config, **runtime_objects)``. Runtime objects (meshes, a tokenizer, dimensions a parent
derives) go in as build kwargs and never into the Config; a kwarg that collides with a Config field
is an error, so no value can live in two places.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

_C = TypeVar("_C")

__all__ = ["Configurable", "Function", "config_to_dict"]


def config_to_dict(value: Any) -> Any:
    """Convert a (nested) config value into plain JSON-able Python data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: config_to_dict(getattr(value, f.name))
            for f in fields(value)
            if not f.name.startswith("_")
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [config_to_dict(v) for v in value]
    if isinstance(value, dict):
        return {str(config_to_dict(k)): config_to_dict(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return repr(value)


class Configurable:
    """Base class of every configurable component (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Base of every nested Config; ``build`` constructs the class that declares it."""

        _owner: ClassVar[type | None] = None

        def build(self, **runtime_objects: Any) -> Any:
            """Construct the owning class from this config plus runtime objects."""
            owner = type(self)._owner
            if owner is None:
                raise TypeError(
                    f"{type(self).__qualname__} has no owner: declare it as the nested `Config` "
                    "of a Configurable subclass"
                )
            clash = sorted({f.name for f in fields(self)} & runtime_objects.keys())
            if clash:
                raise ValueError(
                    f"{owner.__name__}.Config.build() got {clash} as keyword arguments, but they are "
                    f"fields of {owner.__name__}.Config: put these values in the Config, not in build()"
                )
            return owner(self, **runtime_objects)

        def to_dict(self) -> dict[str, Any]:
            """Plain nested dict of every public field (enums by value, dtypes by repr)."""
            return config_to_dict(self)

        def traverse(
            self, config_cls: type[_C] | tuple[type, ...] | None = None, *, _prefix: str = ""
        ) -> Iterator[tuple[str, _C, Any, str | int | None]]:
            """Yield ``(fqn, cfg, parent, attr)`` for every nested Config (of ``config_cls``).

            ``fqn`` mirrors the FQN of the module the config builds (``layers.0.attention.q_a_proj``),
            because modules store each child under the name of its config field. ``parent`` and
            ``attr`` let a caller replace a config in place (``setattr`` or list item); both are
            ``None`` for the root.
            """
            want = config_cls or Configurable.Config
            if not _prefix and isinstance(self, want):
                yield "", self, None, None
            for f in fields(self):
                value = getattr(self, f.name)
                fqn = f"{_prefix}.{f.name}" if _prefix else f.name
                items: list[tuple[str, Any, Any, str | int]]
                if isinstance(value, (list, tuple)):
                    items = [(f"{fqn}.{i}", v, value, i) for i, v in enumerate(value)]
                elif isinstance(value, dict):
                    items = [(f"{fqn}.{k}", v, value, k) for k, v in value.items()]
                else:
                    items = [(fqn, value, self, f.name)]
                for item_fqn, item, parent, attr in items:
                    if not isinstance(item, Configurable.Config):
                        continue
                    if isinstance(item, want):
                        yield item_fqn, item, parent, attr
                    yield from item.traverse(config_cls, _prefix=item_fqn)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config_cls = cls.__dict__.get("Config")
        if config_cls is None:
            # A subclass without its own Config (e.g. FSDP's dynamic ``FSDP<Module>`` classes) keeps
            # the parent's Config, whose build() constructs the parent.
            return
        parent_config = next(
            (b.Config for b in cls.__mro__[1:] if issubclass(b, Configurable) and "Config" in b.__dict__),
            Configurable.Config,
        )
        if not (isinstance(config_cls, type) and issubclass(config_cls, parent_config)):
            raise TypeError(f"{cls.__qualname__}.Config must subclass {parent_config.__qualname__}")
        if not dataclasses.is_dataclass(config_cls) or "__dataclass_fields__" not in config_cls.__dict__:
            raise TypeError(f"{cls.__qualname__}.Config must be decorated with @dataclass(kw_only=True, slots=True)")
        if "__slots__" not in config_cls.__dict__:
            raise TypeError(f"{cls.__qualname__}.Config must use @dataclass(kw_only=True, slots=True): slots=True is missing")
        positional = [f.name for f in fields(config_cls) if f.init and not f.kw_only]
        if positional:
            raise TypeError(
                f"{cls.__qualname__}.Config fields {positional} are not keyword-only: "
                "use @dataclass(kw_only=True, slots=True)"
            )
        config_cls._owner = cls

    def __init__(self, config: Configurable.Config, **runtime_objects: Any) -> None:
        del runtime_objects
        self.config = config


class Function(Configurable):
    """A configurable callable (an init scheme, a loss, a schedule): ``Config.build()`` returns it."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement __call__")
