"""Model-agnostic pieces of HF checkpoint I/O that every model package shares.

A model package keeps its own key mapping (its ``StateDictAdapter``) and calls these for the rest:
reading ``config.json``, checking converted keys and shapes against the model (one error that lists
every problem), fusing / splitting per-expert weights, loading an HF folder into a whole or a sharded
model (``load_checked``: each rank reads only its shards, see ``hf_storage``), building a model from an HF
folder, and the ``save_pretrained`` plumbing (state dict or EMA weights, kept passthrough keys; written
one tensor at a time by ``save_converted``).

The adapters' HF -> ours mappings run on lazy tensors (``hf_storage.HFTensor``) as well as on real ones:
they combine tensors only with ``stack``, ``cat``, ``permute_rows`` (here) and ``.transpose`` /
``.reshape``, so a conversion is planned from the files' headers and each rank then reads its own slices.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from abc import abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from hyper_parallel.models.common.lora import is_lora_param
from hyper_parallel.protocols.hf_quant import dequantize_lazy, folder_quantization, quantization_of
from hyper_parallel.protocols.hf_storage import (
    HFCheckpointError,
    HFFolder,
    HFTensor,
    cat,
    load_tensor_,
    permute_rows,
    save_converted,
    stack,
    writes_once,
)
from hyper_parallel.protocols.module import unwrapped_name
from hyper_parallel.protocols.state_dict_adapter import BaseStateDictAdapter
from hyper_parallel.rank_log import warn_on_rank0

__all__ = [
    "CheckedStateDictAdapter",
    "CheckpointKeyError",
    "HFCheckpointError",
    "HFLoadResult",
    "HFTensor",
    "build_from_hf",
    "cat",
    "check_keys",
    "export_hf_config",
    "full_tensor",
    "fuse_experts",
    "load_checked",
    "load_tensor_",
    "model_state_dict",
    "permute_rows",
    "raise_problems",
    "read_hf_config",
    "save_converted",
    "save_with_model",
    "split_experts",
    "stack",
    "warn_dropped",
    "write_hf_config",
    "writes_once",
]

M = TypeVar("M")
logger = logging.getLogger(__name__)


class CheckpointKeyError(KeyError):
    """Missing, unexpected or wrongly shaped checkpoint keys; the message lists all of them."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass
class HFLoadResult:
    """What an adapter's ``from_hf_checked`` produced."""

    state_dict: dict[str, torch.Tensor]
    """Our keys -> tensors."""
    source_format: str
    """Which HF layout the folder held (model specific, e.g. ``causal_lm``)."""
    passthrough: dict[str, torch.Tensor] = field(default_factory=dict)
    """HF keys the model does not represent, to write back unchanged."""


class CheckedStateDictAdapter(BaseStateDictAdapter):
    """An adapter whose HF -> ours conversion reports what it found (:class:`HFLoadResult`) and can check
    every key and shape against the model."""

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF keys -> our keys (any HF layout the adapter reads); see ``from_hf_checked``."""
        return self.from_hf_checked(hf_state_dict).state_dict

    @abstractmethod
    def from_hf_checked(
        self, hf_state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Size] | None = None
    ) -> HFLoadResult:
        """Convert, and with ``expected`` (our key -> shape) check every key and shape.

        Raises one ``CheckpointKeyError`` listing every missing, unexpected and mis-shaped key.
        """


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain full tensor (a DTensor is gathered)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of an HF folder, with an error naming the file when it is absent or broken, or when its
    ``quantization_config`` is one the loader cannot read (``hf_quant.quantization_of``: refused before any
    model is built or tensor read; a block-FP8 release passes and is dequantized on load)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist: an HF checkpoint folder needs its config.json")
    try:
        hf = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from e
    quantization_of(hf, where=str(f))
    return hf


def check_keys(
    got: dict[str, torch.Tensor],
    expected: dict[str, torch.Size],
    *,
    optional: Iterable[str] = (),
    shape_hint: Callable[[str], str] | None = None,
) -> list[str]:
    """Problems of converted keys ``got`` against the model's ``expected`` key -> shape: missing keys
    (except ``optional``), unexpected keys and shape mismatches (``shape_hint(key)`` appended)."""
    problems = [f"missing: {k}" for k in sorted(expected.keys() - got.keys() - set(optional))]
    problems += [f"unexpected: {k}" for k in sorted(got.keys() - expected.keys())]
    for key in sorted(got.keys() & expected.keys()):
        have, want = tuple(got[key].shape), tuple(expected[key])
        if have != want:
            hint = shape_hint(key) if shape_hint is not None else ""
            problems.append(f"shape: {key} is {list(have)}{_where(got[key])}, the model expects {list(want)}{hint}")
    return problems


def _where(t: Any) -> str:
    return f" (in {t.location})" if isinstance(t, HFTensor) else ""


def raise_problems(problems: list[str], what: str) -> None:
    """Raise one ``CheckpointKeyError`` listing ``problems`` (if any); ``what`` names the checkpoint."""
    if problems:
        raise CheckpointKeyError(
            f"{what} does not fit the model: {len(problems)} problem(s):\n  " + "\n  ".join(problems)
        )


def split_experts(key: str, t: torch.Tensor, prefix: str) -> dict[str, torch.Tensor] | None:
    """Fused ``...mlp.experts.gate_up_proj [E, 2I, H]`` / ``...down_proj [E, H, I]`` -> HF per-expert keys
    ``<prefix>...mlp.experts.{e}.{gate,up,down}_proj.weight``; ``None`` for any other key."""
    base = prefix + key.rsplit(".", 1)[0] + "."
    if key.endswith("mlp.experts.gate_up_proj"):
        half = t.shape[1] // 2
        out = {}
        for e in range(t.shape[0]):
            out[f"{base}{e}.gate_proj.weight"] = t[e, :half]
            out[f"{base}{e}.up_proj.weight"] = t[e, half:]
        return out
    if key.endswith("mlp.experts.down_proj"):
        return {f"{base}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    return None


def fuse_experts(
    experts: dict[tuple[int, str], dict[int, torch.Tensor]], out: dict[str, torch.Tensor], prefix: str
) -> list[str]:
    """Stack per-expert weights (``experts[(layer, proj)][e]``) into ``layers.{i}.mlp.experts.gate_up_proj
    [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]`` in ``out``; returns the missing HF keys."""
    missing: list[str] = []
    for layer in sorted({layer for layer, _ in experts}):
        parts = {proj: experts.get((layer, proj), {}) for proj in ("gate_proj", "up_proj", "down_proj")}
        n = max(max(p) + 1 if p else 0 for p in parts.values())
        gaps = [
            f"missing: {prefix}layers.{layer}.mlp.experts.{e}.{proj}.weight"
            for proj, per in parts.items()
            for e in range(n)
            if e not in per
        ]
        if gaps:
            missing += gaps
            continue
        # stack / cat: lazy when the parts are (an expert-parallel rank then reads only its experts)
        gate = stack([parts["gate_proj"][e] for e in range(n)])
        up = stack([parts["up_proj"][e] for e in range(n)])
        out[f"layers.{layer}.mlp.experts.gate_up_proj"] = cat([gate, up], dim=1)
        out[f"layers.{layer}.mlp.experts.down_proj"] = stack([parts["down_proj"][e] for e in range(n)])
    return missing


R = TypeVar("R", bound=HFLoadResult)


def model_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under the model's own names (activation-checkpoint and compile wrappers
    dropped); a parallelized model's entries are its DTensors, whose local shards the load fills in place."""
    return {
        unwrapped_name(k): v for k, v in model.state_dict().items()
    }


def _dtype_problems(got: dict[str, Any], ours: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    for key in sorted(got.keys() & ours.keys()):
        have, want = got[key].dtype, ours[key].dtype
        if have.is_floating_point != want.is_floating_point or (have == torch.bool) != (want == torch.bool):
            problems.append(f"dtype: {key} is {have}{_where(got[key])}, the model holds {want}")
    return problems


def load_checked(
    model: Any,
    path: str | os.PathLike,
    convert: Callable[[dict[str, Any], dict[str, torch.Size]], R],
    *,
    init_missing: Callable[[], None] | None = None,
) -> R:
    """Load an HF folder into ``model`` (whole, or parallelized: DTensor shards) in place; return what
    ``convert`` made of it.

    ``convert(hf_state_dict, expected)`` (an adapter's ``from_hf_checked``; ``expected``: our key -> global
    shape) runs on the folder's lazy tensors and raises on any bad key or shape; dtypes are checked too, so
    nothing is copied from a checkpoint that does not fit. Each rank then reads only the slices its own
    shards cover. ``init_missing`` runs first when the checkpoint does not fill every key (the parts it
    lacks keep that initialisation). LoRA adapters (``is_lora_param``) are never expected from a base folder and
    never trigger ``init_missing``: the caller initialises them (``lora.init_adapters_``). The ``passthrough`` (HF
    keys the model does not represent) is kept on ``model.hf_passthrough`` as lazy references to the folder's
    files: the export reads them again.

    A block-FP8 release (``quantization_config``, ``hf_quant``) is dequantized on the way: ``convert`` sees each
    quantized weight as the dense tensor it stands for (its ``*_scale_inv`` consumed), and each rank reads only
    its shard's box of the FP8 weight and the scales covering it.
    """
    quant = folder_quantization(path)  # an unsupported quantization_config fails here, before any read
    folder = HFFolder.open(path)
    ours = model_state_dict(model)
    tensors = dequantize_lazy(folder.tensors, quant, where=str(folder.path))
    # LoRA adapters are never in a base folder (the caller initialises them): a folder that fills the base does not
    # need the whole-model random init first.
    expected = {k: v.shape for k, v in ours.items() if not is_lora_param(k)}
    # A pipeline stage checks the folder against the whole model (the other stages' keys are not unexpected),
    # then reads its own keys only.
    whole = getattr(model, "pipeline_full_shapes", None) or expected
    result = convert(tensors, {k: v for k, v in whole.items() if not is_lora_param(k)})
    mine = {k: v for k, v in result.state_dict.items() if k in expected}
    raise_problems(_dtype_problems(mine, ours), f"checkpoint {folder.path}")
    if init_missing is not None and mine.keys() != expected.keys():
        init_missing()
        ours = model_state_dict(model)
    for key, src in mine.items():
        load_tensor_(ours[key], src)
    model.hf_passthrough = dict(result.passthrough)
    return result


def build_from_hf(
    model_cls: type[M],
    path: str | os.PathLike,
    *,
    config_from_hf: Callable[[dict[str, Any]], Any],
    load_weights: Callable[..., Any],
    dtype: torch.dtype,
    device: str | torch.device,
    config_overrides: dict[str, Any] | None = None,
    **load_kwargs: Any,
) -> M:
    """Build ``model_cls`` from an HF folder's ``config.json`` read by the family's ``config_from_hf``
    (``config_overrides`` replace top-level fields), initialise it on ``device`` without a CPU copy, then
    ``load_weights(model, path, **load_kwargs)`` (every key checked) and cast to ``dtype``."""
    config = config_from_hf(read_hf_config(path))
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    model.init_weights()  # parts the checkpoint lacks keep their seeded initialisation
    load_weights(model, path, **load_kwargs)
    return model.to(dtype=dtype)


def warn_dropped(keys: Iterable[str], why: str) -> None:
    """Log (once per export) that the HF ``keys`` the folder had are not written, and ``why``."""
    keys = sorted(keys)
    if keys:
        shown = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
        warn_on_rank0(logger, "the HF export leaves out %d tensor(s) the loaded folder had (%s): %s", len(keys), shown, why)


def export_hf_config(hf_config: dict[str, Any], *, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` dict an export writes, from a family writer's ``hf_config`` (the folder's form).

    ``dtype`` says what was written: the top-level ``dtype`` always, and every ``dtype`` / legacy ``torch_dtype``
    key the folder had, at any level (``text_config``, ...). ``quantization_config`` is dropped at every level:
    an export holds dense tensors in ``dtype``, and a server must not read it as pre-quantized.
    """
    name = str(dtype).removeprefix("torch.")

    def clean(level: dict[str, Any], top: bool) -> dict[str, Any]:
        out = {}
        for key, value in level.items():
            if key == "quantization_config":
                continue
            if key in ("dtype", "torch_dtype"):
                value = name
            elif isinstance(value, dict):
                value = clean(value, False)
            out[key] = value
        if top:
            out["dtype"] = name
        return out

    return clean(hf_config, True)


def write_hf_config(
    path: str | os.PathLike, hf_config: dict[str, Any], *, dtype: torch.dtype, sources: dict[str, Any]
) -> str:
    """Write ``export_hf_config(hf_config, dtype=)`` as ``path/config.json`` from the one process that writes a
    folder's single files (``writes_once(sources)``); returns the file name."""
    if writes_once(sources):
        out = export_hf_config(hf_config, dtype=dtype)
        (Path(path) / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True))
    return "config.json"


def save_with_model(
    save_state_dict: Callable[..., list[str]],
    model: Any,
    path: str | os.PathLike,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
    **kwargs: Any,
) -> list[str]:
    """``save_state_dict(model.config, state_dict or model's own, path, passthrough=kept keys, **kwargs)``:
    the body every package's ``save_pretrained`` shares."""
    return save_state_dict(
        model.config,
        state_dict if state_dict is not None else model.state_dict(),
        path,
        passthrough=getattr(model, "hf_passthrough", None),
        **kwargs,
    )
