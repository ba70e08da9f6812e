"""``from_pretrained``: the model in an HF folder; the per-family ``from_pretrained`` / ``save_pretrained`` pair.

``hyper_parallel.from_pretrained(path)`` picks the family from the folder (``hf_spec.HF_MODEL_TYPES``);
``pretrained_io(spec)`` gives a family package its two functions (``glm_image_moe_v2.from_pretrained``), the same
generic code for every family: nothing here names one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hyper_parallel.hf.convert import read_hf_config
from hyper_parallel.hf.folder import check_mtp_tensors, config_from_folder, spec_for_hf, with_folder_form
from hyper_parallel.hf.load import build_from_hf
from hyper_parallel.hf.save import save_pretrained as _save_pretrained
from hyper_parallel.protocols.model_spec import ModelSpec, discover_model_spec

__all__ = ["build_pretrained", "from_pretrained", "pretrained_io"]


def build_pretrained(
    spec: ModelSpec,
    path: str | os.PathLike,
    *,
    mtp: bool | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config_overrides: Mapping[str, Any] | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """The model of ``spec``'s family in HF folder ``path`` (every key and shape checked; MTP as
    :func:`config_from_folder` says, its tensors required when the folder declares it)."""
    hf = read_hf_config(path)
    spec_for_hf(hf, where=str(path), spec_name=spec.name)
    config, from_folder = config_from_folder(spec, hf, mtp=mtp)
    config = with_folder_form(config, path)
    if from_folder:
        check_mtp_tensors(spec, hf, path, config)
    return build_from_hf(
        spec.model, path, config_from_hf=lambda _hf: config, spec=spec, dtype=dtype, device=device,
        config_overrides=dict(config_overrides or {}), **dict(load_kwargs or {}),
    )  # fmt: skip


def _split_load_options(spec: ModelSpec, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the family's loader options (``HFSpec.load_options``) out of ``kwargs``; the rest are config fields."""
    options = spec.hf.load_options if spec.hf is not None else ()
    load = {k: kwargs.pop(k) for k in options if kwargs.get(k) is not None}
    for k in options:
        kwargs.pop(k, None)
    return load


def pretrained_io(spec: ModelSpec, *, mtp_default: bool | None = False) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(from_pretrained, save_pretrained)`` of ``spec``'s family.

    ``from_pretrained(path, *, dtype=float32, device="cpu", mtp=mtp_default, **kwargs)``: ``kwargs`` named in
    ``spec.hf.load_options`` go to the weight loader, the rest replace top-level config fields.
    ``save_pretrained(model, path, *, max_shard_size="5GB", dtype=None, state_dict=None, **options)``: the generic
    export (``hf.save.save_pretrained``) with ``spec``.
    """

    def from_pretrained(
        path: str | os.PathLike,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        mtp: bool | None = mtp_default,
        **kwargs: Any,
    ) -> Any:
        load = _split_load_options(spec, kwargs)
        return build_pretrained(spec, path, mtp=mtp, dtype=dtype, device=device, config_overrides=kwargs, load_kwargs=load)

    def save_pretrained(model: Any, path: str | os.PathLike, **kwargs: Any) -> list[str]:
        return _save_pretrained(model, path, spec=spec, **kwargs)

    options = spec.hf.load_options if spec.hf is not None else ()
    from_pretrained.__doc__ = (
        f"A ``{spec.model.__name__}`` from an HF folder (every key and shape checked). ``mtp``: None follows the "
        "folder (its MTP block on when it ships one), True turns it on (its tensors required), False keeps its "
        "tensors as passthrough (written back unchanged). Other keywords replace top-level config fields"
        + (f" ({', '.join(options)}: options of the weight loader)." if options else ".")
    )
    save_pretrained.__doc__ = (
        f"Write a ``{spec.model.__name__}`` (or ``state_dict``, e.g. EMA weights) as an HF folder with config.json, "
        "in the form it was loaded from, kept passthrough tensors included (``hf.save.save_pretrained``)."
    )
    return from_pretrained, save_pretrained


def from_pretrained(
    path: str | os.PathLike,
    *,
    mtp: bool | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    module: str | None = None,
    **kwargs: Any,
) -> Any:
    """The model in HF folder ``path``, its family picked from ``config.json`` (``model_type``: the table
    ``HF_MODEL_TYPES``; ``module`` picks among the candidates, e.g. ``qwen3_vl_moe`` for the whole VL model of
    a Qwen3.5-MoE ConditionalGeneration folder). ``mtp=None``: its MTP block on when it ships one."""
    hf = read_hf_config(path)
    spec = discover_model_spec(spec_for_hf(hf, where=str(path), spec_name=module))
    if spec.hf is None:
        raise NotImplementedError(f"model spec {spec.name!r} has no from_pretrained")
    load = _split_load_options(spec, kwargs)
    return build_pretrained(spec, path, mtp=mtp, dtype=dtype, device=device, config_overrides=kwargs, load_kwargs=load)
