"""``ModelSpec`` and the registry of model packages."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "HF_MODEL_TYPES",
    "HFMtp",
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
class HFMtp:
    """How a family's HF folders carry a multi-token-prediction block (Qwen3.5 ``mtp.*``, GLM's nextn layer)."""

    count_key: str
    """``config.json`` key (in ``text_config`` or at top level) holding the number of MTP layers."""
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    """The family's HF config reader with the folder's MTP block on (raises, naming ``count_key``, without one)."""
    tensor_prefixes: Callable[[Mapping[str, Any]], tuple[str, ...]]
    """``tensor_prefixes(hf_config)``: HF key prefixes of the MTP block's tensors in such a folder."""


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
    state_dict_adapter: type | None = None
    """``BaseStateDictAdapter`` subclass converting our state dict to and from the HF format."""
    flavor: str = ""
    """Default recipe of the package (``glm_image_moe_debug``)."""
    from_pretrained: Callable[..., Any] | None = None
    """``from_pretrained(path, *, dtype=, device=, mtp=, **overrides) -> model``: build a model from an HF folder
    (``hf_model.pretrained_io`` derives it from the fields below; ``mtp=None`` follows the folder)."""
    save_pretrained: Callable[..., Any] | None = None
    """``save_pretrained(model, path, *, state_dict=None, dtype=None)``: write the HF format (``state_dict``
    replaces the model's weights, e.g. EMA weights; with sharded DTensors every rank calls it and writes its
    own files); the trainer's ``--checkpoint.export_hf``."""
    load_hf_weights: Callable[[Any, str], Any] | None = None
    """``load_hf_weights(model, path, *, init_missing=None)``: load an HF folder into a whole or a parallelized
    model in place (each rank reads only its shards; ``init_missing()`` runs first when the folder does not fill
    every parameter), keeping keys it does not model for the export; the trainer's
    ``--checkpoint.initial_load_path``."""
    validate_layout: Callable[[Any, Any], None] | None = None
    """``validate_layout(model_config, parallel_dims)``: raise, naming the degree to change, when the layout
    does not fit the model; runs before anything is built."""
    data_sources: tuple[str, ...] = ("text", "preset_pt", "dummy")
    """Data source types (``--data.source``) whose batches this model takes."""
    data_facts: Callable[[Any], dict[str, Any]] = default_data_facts
    """``data_facts(model_config) -> dict``: model facts the data source checks samples against
    (vocabulary size; GlmImageMoe adds its codebook size and placeholder id)."""
    config_from_hf: Callable[[Mapping[str, Any]], Any] | None = None
    """``config_from_hf(hf_config_dict) -> model.Config``: the family's HF config reader (MTP off), the one
    ``from_pretrained`` uses; with it an HF folder given as ``--checkpoint.initial_load_path`` is the run's model."""
    hf_mtp: HFMtp | None = None
    """How the family's HF folders carry an MTP block (None: the family has none)."""
    fit_to_data: Callable[[Any, tuple[str, ...]], tuple[Any, str | None]] | None = None
    """``fit_to_data(model_config, data_source_types) -> (model_config, note)``: the model a run's data needs, after
    the folder/recipe resolution (GlmImageMoe grows its image path for image-token data); ``note``: a line the
    trainer logs when the model changed, else None."""
    fields_not_in_hf: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None
    """``fields_not_in_hf(hf_config_dict)``: top-level model fields such a folder does not set (a text-only GLM
    folder: the image path), which a run started from it takes from the recipe."""


HF_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    # Qwen3_5ForConditionalGeneration: its text part, or the whole VL model (Qwen3.5 dense VL, qwen3_vl_moe)
    "qwen3_5": ("qwen3_5", "qwen3_vl_moe"),
    "qwen3_5_text": ("qwen3_5",),  # Qwen3_5ForCausalLM
    # Qwen3_5MoeForConditionalGeneration: the text part, or the whole VL model (Qwen3.5-MoE VL, qwen3_vl_moe)
    "qwen3_5_moe": ("qwen3_5_moe", "qwen3_vl_moe"),
    "qwen3_5_moe_text": ("qwen3_5_moe",),  # Qwen3_5MoeForCausalLM
    "qwen3_vl_moe": ("qwen3_vl_moe",),  # Qwen3VLMoeForConditionalGeneration
    "qwen3_vl": ("qwen3_vl_moe",),  # Qwen3VLForConditionalGeneration (Qwen3-VL dense): the VL package's qwen3_vl family
    "glm4_moe_lite": ("glm_image_moe",),  # Glm4MoeLiteForCausalLM (GLM-4.7-Flash): the text part of GlmImageMoe
    "glm_image_moe": ("glm_image_moe",),
}
"""HF ``config.json`` ``model_type`` -> the registered specs that read such a folder, the default first (the
one table that maps a folder to a model package: ``--module`` and ``hyper_parallel.from_pretrained(path)``)."""


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
