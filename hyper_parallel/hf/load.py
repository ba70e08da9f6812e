"""Load an HF folder into a whole or a parallelized model: the one generic loader every family uses.

The family's adapter (``ModelSpec.hf.adapter``) maps the keys; this module checks every key, shape and dtype
against the model, dequantizes a block-FP8 release on the way (``hf.quant``), lets each rank read only the
slices its own shards cover (``hf.storage``), keeps the keys the model does not represent for the export
(``model.hf_passthrough``) and runs the adapter's ``after_load`` hook (a partial head, the experts layout read).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hyper_parallel.hf.convert import HFLoadResult, raise_problems, read_hf_config
from hyper_parallel.hf.quant import dequantize_lazy, folder_quantization
from hyper_parallel.hf.storage import HFFolder, HFTensor, load_tensor_
from hyper_parallel.models.common.lora import is_lora_param
from hyper_parallel.protocols.hf_spec import HFSpec
from hyper_parallel.protocols.model_spec import ModelSpec, get_spec, list_specs
from hyper_parallel.protocols.module import unwrapped_name

__all__ = ["build_from_hf", "hf_spec_of", "load_hf_weights", "model_state_dict"]

M = TypeVar("M")


def hf_spec_of(model: Any, spec: ModelSpec | HFSpec | None = None) -> HFSpec:
    """The HF facts of ``model``'s family: ``spec`` (a ``ModelSpec`` or its ``HFSpec``), else the registered spec
    whose model class ``model`` is (a pipeline stage is an instance of its model's class)."""
    if isinstance(spec, HFSpec):
        return spec
    if spec is None:
        found = [get_spec(n) for n in list_specs() if isinstance(model, get_spec(n).model)]
        if not found:
            raise ValueError(f"no registered model spec builds a {type(model).__name__}: pass spec=")
        spec = max(found, key=lambda s: len(type.mro(s.model)))  # the most derived class
    if spec.hf is None:
        raise NotImplementedError(f"model spec {spec.name!r} reads no HF folders (ModelSpec.hf is None)")
    return spec.hf


def model_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under the model's own names (activation-checkpoint and compile wrappers
    dropped); a parallelized model's entries are its DTensors, whose local shards the load fills in place."""
    return {unwrapped_name(k): v for k, v in model.state_dict().items()}


def _where(t: Any) -> str:
    return f" (in {t.location})" if isinstance(t, HFTensor) else ""


def _dtype_problems(got: dict[str, Any], ours: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    for key in sorted(got.keys() & ours.keys()):
        have, want = got[key].dtype, ours[key].dtype
        if have.is_floating_point != want.is_floating_point or (have == torch.bool) != (want == torch.bool):
            problems.append(f"dtype: {key} is {have}{_where(got[key])}, the model holds {want}")
    return problems


def load_hf_weights(
    model: Any,
    path: str | os.PathLike,
    *,
    spec: ModelSpec | HFSpec | None = None,
    init_missing: Callable[[], None] | None = None,
    **options: Any,
) -> HFLoadResult:
    """Load an HF folder into ``model`` (whole, or parallelized: DTensor shards; a pipeline stage reads its own
    keys) in place; return what the family's adapter made of it.

    ``spec``: the family (default: the registered spec of ``model``'s class); ``options``: the family's
    ``HFSpec.load_options`` (``experts_layout=``). The adapter's conversion runs on the folder's lazy tensors and
    raises on any bad key or shape; dtypes are checked too, so nothing is copied from a checkpoint that does not
    fit. Each rank then reads only the slices its own shards cover. ``init_missing`` runs first when the
    checkpoint does not fill every key (the parts it lacks keep that initialisation). LoRA adapters
    (``is_lora_param``) are never expected from a base folder and never trigger ``init_missing``: the caller
    initialises them (``lora.init_adapters_``). The ``passthrough`` (HF keys the model does not represent) is kept
    on ``model.hf_passthrough`` as lazy references to the folder's files: the export reads them again.

    A block-FP8 release (``quantization_config``, ``hf.quant``) is dequantized on the way: the adapter sees each
    quantized weight as the dense tensor it stands for (its ``*_scale_inv`` consumed), and each rank reads only
    its shard's box of the FP8 weight and the scales covering it.
    """
    hf = hf_spec_of(model, spec)
    unknown = sorted(set(options) - set(hf.load_options))
    if unknown:
        raise TypeError(f"load_hf_weights: unexpected option(s) {unknown}; this family takes {list(hf.load_options)}")
    quant = folder_quantization(path)  # an unsupported quantization_config fails here, before any read
    adapter = hf.adapter.for_folder(model.config, path, **{k: v for k, v in options.items() if v is not None})
    folder = HFFolder.open(path)
    ours = model_state_dict(model)
    tensors = dequantize_lazy(folder.tensors, quant, where=str(folder.path))
    # LoRA adapters are never in a base folder (the caller initialises them): a folder that fills the base does not
    # need the whole-model random init first.
    expected = {k: v.shape for k, v in ours.items() if not is_lora_param(k)}
    # A pipeline stage checks the folder against the whole model (the other stages' keys are not unexpected),
    # then reads its own keys only.
    whole = getattr(model, "pipeline_full_shapes", None) or expected
    result = adapter.load_result(tensors, {k: v for k, v in whole.items() if not is_lora_param(k)})
    mine = {k: v for k, v in result.state_dict.items() if k in expected}
    raise_problems(_dtype_problems(mine, ours), f"checkpoint {folder.path}")
    if init_missing is not None and mine.keys() != expected.keys():
        init_missing()
        ours = model_state_dict(model)
    for key, src in mine.items():
        load_tensor_(ours[key], src)
    model.hf_passthrough = dict(result.passthrough)
    adapter.after_load(model, result)
    return result


def build_from_hf(
    model_cls: type[M],
    path: str | os.PathLike,
    *,
    config_from_hf: Callable[[dict[str, Any]], Any],
    spec: ModelSpec | HFSpec | None = None,
    dtype: torch.dtype,
    device: str | torch.device,
    config_overrides: dict[str, Any] | None = None,
    **load_kwargs: Any,
) -> M:
    """Build ``model_cls`` from an HF folder's ``config.json`` read by ``config_from_hf`` (``config_overrides``
    replace top-level fields), initialise it on ``device`` without a CPU copy, then ``load_hf_weights(model, path,
    spec=spec, **load_kwargs)`` (every key checked) and cast to ``dtype``."""
    config = config_from_hf(read_hf_config(path))
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    model.init_weights()  # parts the checkpoint lacks keep their seeded initialisation
    load_hf_weights(model, path, spec=spec, **load_kwargs)
    return model.to(dtype=dtype)
