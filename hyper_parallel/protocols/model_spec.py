"""``ModelSpec`` and the registry of model packages."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyper_parallel.protocols.hf_spec import HFSpec

__all__ = [
    "ModelSpec",
    "default_data_facts",
    "discover_model_spec",
    "get_spec",
    "lazy_function",
    "list_specs",
    "register_spec",
]


def lazy_function(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported on first call: a spec can name its ``parallelize_fn`` / ``validate_layout``
    without importing the distributed stack when its model package is imported."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}`` (imported on first call)."
    return call


def default_data_facts(model_config: Any) -> dict[str, Any]:
    """What a text data source needs from a model: its vocabulary size."""
    return {"vocab_size": model_config.vocab_size}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Everything the model-agnostic trainer needs to know about one model package (typed, all optional
    beyond the first three)."""

    name: str
    """Registered name (``glm_image_moe``)."""
    model: type
    """The ``BaseModel`` subclass; ``model.Config`` is its config type."""
    parallelize_fn: Callable[..., Any]
    """``parallelize_<name>(model, *, parallel_dims, training, parallelism, ac_config, compile_config)``."""
    flavor: str = ""
    """Default recipe of the package (``glm_image_moe_debug``)."""
    hf: HFSpec | None = None
    """The family's HF checkpoint facts (key mapping, config reader, MTP block); None: no HF folders. The engine
    that uses them is ``hyper_parallel.hf`` (``load_hf_weights``, ``save_pretrained``, ``from_pretrained``)."""
    validate_layout: Callable[[Any, Any], None] | None = None
    """``validate_layout(model_config, parallel_dims)``: raise, naming the degree to change, when the layout
    does not fit the model; runs before anything is built."""
    data_sources: tuple[str, ...] = ("text", "preset_pt", "dummy")
    """Data source types (``--data.source``) whose batches this model takes."""
    data_facts: Callable[[Any], dict[str, Any]] = default_data_facts
    """``data_facts(model_config) -> dict``: model facts the data source checks samples against
    (vocabulary size; GlmImageMoe adds its codebook size and placeholder id)."""
    fit_to_data: Callable[[Any, tuple[str, ...]], tuple[Any, str | None]] | None = None
    """``fit_to_data(model_config, data_source_types) -> (model_config, note)``: the model a run's data needs, after
    the folder/recipe resolution (GlmImageMoe grows its image path for image-token data); ``note``: a line the
    trainer logs when the model changed, else None."""


_REGISTRY: dict[str, ModelSpec] = {}


def register_spec(name: str, spec: ModelSpec, *, aliases: tuple[str, ...] = ()) -> None:
    """Register ``spec`` under ``name`` (and aliases); re-registering the same spec is a no-op."""
    for key in (name, *aliases):
        old = _REGISTRY.get(key)
        if old is not None and old is not spec and old.model is not spec.model:
            raise ValueError(f"model spec {key!r} is already registered by {old.model.__module__}")
        _REGISTRY[key] = spec


def get_spec(name: str) -> ModelSpec:
    """The registered spec ``name``; the error lists the registered names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no model spec {name!r}; registered: {', '.join(sorted(_REGISTRY)) or '(none)'}") from None


def list_specs() -> list[str]:
    """Names of every registered spec."""
    return sorted(_REGISTRY)


def discover_model_spec(name: str) -> ModelSpec:
    """Import ``hyper_parallel.models.<name>`` (or ``<name>_v2``) on demand and return its spec."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    for candidate in (f"hyper_parallel.models.{name}", f"hyper_parallel.models.{name}_v2"):
        try:
            importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            if e.name is None or not (candidate == e.name or candidate.startswith(e.name + ".")):
                raise
            continue
        if name in _REGISTRY:
            return _REGISTRY[name]
    return get_spec(name)
