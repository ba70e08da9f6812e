"""Quantized HF releases: the one reader of ``quantization_config``, and FP8 block dequantization on load.

The form read here is the fine-grained (block) FP8 of DeepSeek-V3 and the Qwen3 / Qwen3.5 ``-FP8`` releases
(transformers' ``FineGrainedFP8Config`` and ``integrations/finegrained_fp8.py``; vLLM's ``Fp8Config`` with a
``weight_block_size``):

- ``config.json`` (top level, beside ``text_config`` in a ConditionalGeneration folder)::

      quantization_config: {quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic",
                            weight_block_size: [bi, bj], modules_to_not_convert: [...]}

- a quantized module stores ``<module>.weight`` as ``float8_e4m3fn`` ``[..., out, in]`` and
  ``<module>.weight_scale_inv`` (float32, some releases bf16) ``[..., ceil(out / bi), ceil(in / bj)]`` beside it
  (a fused parameter without ``.weight``: ``<param>_scale_inv``); the dense weight is
  ``weight[..., i, j] * scale_inv[..., i // bi, j // bj]``, the last block row / column covering the remainder;
- every other tensor (norms, embeddings, ``lm_head``, routers, ``modules_to_not_convert``: no scale beside it) is
  stored in the release's dtype and loads as it is.

``dequantize_lazy`` turns a folder's tensors into the dense tensors they stand for, lazily: each quantized weight
becomes a :class:`BlockDequantized` whose read of a box (a rank's shard) reads only that box of the FP8 weight and
the scale rows / columns that cover it, and multiplies in float32 straight into the destination (the model's
dtype). The ``*_scale_inv`` tensors are consumed, so the model and its export never see them. Any other
quantization (another ``quant_method``, per-tensor FP8 without ``weight_block_size``, static activation scales,
power-of-two ``ue8m0`` scales) is refused by :func:`quantization_of` before a tensor is read.

The family config readers drop the key with :func:`without_quantization`: a model trained here is dense, and its
export (in the training dtype) must not claim to be pre-quantized.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.hf.storage import Box, HFCheckpointError, HFTensor

__all__ = [
    "SCALE_SUFFIX",
    "BlockDequantized",
    "FP8BlockQuantization",
    "UnsupportedQuantizationError",
    "dequantize_lazy",
    "folder_quantization",
    "quantization_of",
    "without_quantization",
]

KEY = "quantization_config"
SCALE_SUFFIX = "_scale_inv"
"""``<module>.weight`` + this = its block scales (transformers' and vLLM's name: ``weight_scale_inv``)."""

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# a float32 temporary of at most this many elements per chunk of a dequantized read
_CHUNK_ELEMENTS = 1 << 24


class UnsupportedQuantizationError(ValueError):
    """A ``quantization_config`` this project cannot load (the message names the key and its value)."""


@dataclass(frozen=True)
class FP8BlockQuantization:
    """A release's block FP8 (``quantization_config`` with ``quant_method: fp8`` and ``weight_block_size``)."""

    block: tuple[int, int]
    """``weight_block_size``: rows x columns of the weight one scale covers."""
    modules_to_not_convert: tuple[str, ...] = ()
    """The modules the release keeps in its dtype (informative: a weight without a scale beside it loads as is)."""
    dtype: torch.dtype = torch.bfloat16
    """The release's declared dtype (``dtype`` / ``torch_dtype``): what a dequantized tensor is read as when the
    destination does not say (e.g. a kept passthrough tensor written back by an export)."""


def _refuse(where: str, field: str, value: Any, why: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"{where}: {KEY}.{field}={value!r}: {why}. This project loads block-quantized FP8 releases "
        f"({KEY}: {{quant_method: 'fp8', fmt: 'e4m3', activation_scheme: 'dynamic', weight_block_size: [128, 128]}}, "
        "dequantized on load) and unquantized ones; use the release's unquantized (bf16) checkpoint instead"
    )


def _release_dtype(hf: Mapping[str, Any]) -> torch.dtype:
    text = hf.get("text_config") if isinstance(hf.get("text_config"), Mapping) else {}
    for d in (hf, text):
        for key in ("dtype", "torch_dtype"):
            name = str(d.get(key) or "").removeprefix("torch.")
            if name in _DTYPES:
                return _DTYPES[name]
    return torch.bfloat16


def quantization_of(hf: Mapping[str, Any], *, where: str = "config.json") -> FP8BlockQuantization | None:
    """The block FP8 a config dict declares (``None`` when unquantized); any other quantization raises
    :class:`UnsupportedQuantizationError` naming the key, its value and ``where`` (the file)."""
    qc = hf.get(KEY)
    text = hf.get("text_config")
    if qc is None and isinstance(text, Mapping):
        qc, where = text.get(KEY), f"{where} (text_config)"
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise UnsupportedQuantizationError(f"{where}: {KEY} must be a JSON object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise _refuse(where, "quant_method", method, "only 'fp8' (block-wise) is supported")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(where, "fmt", fmt, "only e4m3 (float8_e4m3fn weights) is supported")
    block = qc.get("weight_block_size")
    if block is None:
        why = "per-tensor FP8 (weight_scale) is not supported, only block-wise"
        raise _refuse(where, "weight_block_size", block, why)
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise _refuse(where, "weight_block_size", block, "it must be two positive integers")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise _refuse(where, "activation_scheme", scheme, "block-wise FP8 comes with dynamic activation scales only")
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in ("float", None):
        raise _refuse(where, "scale_fmt", scale_fmt, "only float scales are supported (not power-of-two ue8m0)")
    expert_dtype = qc.get("expert_dtype", "fp8")
    if expert_dtype not in ("fp8", None):
        raise _refuse(where, "expert_dtype", expert_dtype, "only FP8 experts are supported")
    skip = qc.get("modules_to_not_convert", qc.get("ignored_layers")) or []
    if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
        raise UnsupportedQuantizationError(
            f"{where}: {KEY}.modules_to_not_convert must be a list of names, got {skip!r}"
        )
    return FP8BlockQuantization(
        block=(block[0], block[1]), modules_to_not_convert=tuple(skip), dtype=_release_dtype(hf)
    )


def without_quantization(hf: Mapping[str, Any], *, where: str = "config.json") -> dict[str, Any]:
    """``hf`` without ``quantization_config`` (top level and in ``text_config``), after checking that it is one
    the loader reads: what every family's config reader starts from, so no model config keeps the key and no
    dense export claims to be quantized."""
    quantization_of(hf, where=where)
    out = {k: v for k, v in hf.items() if k != KEY}
    if isinstance(out.get("text_config"), Mapping) and KEY in out["text_config"]:
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != KEY}
    return out


def folder_quantization(path: str | os.PathLike) -> FP8BlockQuantization | None:
    """The block FP8 of an HF folder (or of the folder of one safetensors file) from its ``config.json``;
    ``None`` without one (a bare safetensors folder) or when unquantized. Reads nothing else."""
    path = Path(path)
    config = (path.parent if path.is_file() else path) / "config.json"
    if not config.is_file():
        return None
    try:
        hf = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config} is not valid JSON: {e}") from e
    return quantization_of(hf, where=str(config))


class BlockDequantized(HFTensor):
    """``weight * scale_inv`` per ``block`` of the last two dims (leading dims, e.g. fused experts, one to one),
    read only where asked: a box reads that box of the FP8 weight and the scale rows / columns covering it."""

    def __init__(self, weight: HFTensor, scale: HFTensor, block: tuple[int, int], dtype: torch.dtype) -> None:
        self.weight, self.scale, self.block = weight, scale, block
        self.shape, self.dtype = weight.shape, dtype

    @property
    def location(self) -> str:
        return self.weight.location

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        *lead, rows, cols = box
        bi, bj = self.block
        s_rows = slice(rows.start // bi, -(-rows.stop // bi))
        s_cols = slice(cols.start // bj, -(-cols.stop // bj))
        scale = self.scale.read((*lead, s_rows, s_cols), dtype=torch.float32)
        # each column of the box gets its scale column (the box may start inside its first block)
        first = cols.start - s_cols.start * bj
        col_scale = scale.repeat_interleave(bj, dim=-1)[..., first : first + cols.stop - cols.start]
        n_cols = max(cols.stop - cols.start, 1)
        lead_n = out[..., :1, :1].numel() if out.ndim > 2 else 1
        step = max(bi, _CHUNK_ELEMENTS // (n_cols * lead_n) // bi * bi)
        start = rows.start
        while start < rows.stop:
            # chunks end on block-row boundaries, so each holds whole scale rows (the first and last may be partial)
            stop = min(rows.stop, (start // bi) * bi + step)
            w = self.weight.read((*lead, slice(start, stop), cols), dtype=torch.float32)
            i = torch.arange(start, stop) // bi - s_rows.start  # each row's scale row
            w.mul_(col_scale[..., i, :])
            out[..., start - rows.start : stop - rows.start, :].copy_(w)
            start = stop


def _check_pair(key: str, weight: HFTensor, scale: HFTensor, block: tuple[int, int], where: str) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise HFCheckpointError(
            f"{where}: {key} is {weight.dtype} ({weight.location}) beside {key}{SCALE_SUFFIX}: block FP8 "
            f"(quantization_config.fmt e4m3) stores its weights as float8_e4m3fn"
        )
    want = [*weight.shape[:-2], *(-(-n // b) for n, b in zip(weight.shape[-2:], block))]
    if weight.ndim < 2 or list(scale.shape) != want or not scale.dtype.is_floating_point:
        raise HFCheckpointError(
            f"{where}: {key}{SCALE_SUFFIX} is {scale.dtype} {list(scale.shape)} ({scale.location}); for the weight "
            f"{list(weight.shape)} and quantization_config.weight_block_size {list(block)} it must be a float "
            f"tensor of shape {want} (ceil of each dim / block)"
        )


def dequantize_lazy(
    tensors: Mapping[str, HFTensor], quant: FP8BlockQuantization | None, *, where: str
) -> dict[str, HFTensor]:
    """A folder's tensors as the dense tensors they stand for: with ``quant``, each FP8 weight with a
    ``<key>_scale_inv`` beside it becomes a :class:`BlockDequantized` and the scales are consumed; the others
    are kept as they are. Without ``quant``, a folder holding FP8 weights or scales is an error naming
    ``quantization_config`` (``where``: the folder, for messages)."""
    scales = {k for k in tensors if k.endswith(SCALE_SUFFIX)}
    fp8 = sorted(k for k, t in tensors.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))
    if quant is None:
        if scales or fp8:
            example = fp8[0] if fp8 else sorted(scales)[0]
            raise HFCheckpointError(
                f"{where}: the folder holds FP8 block-quantized tensors ({len(fp8)} float8 weights, {len(scales)} "
                f"*{SCALE_SUFFIX} scales, e.g. {example!r}) but its config.json has no {KEY}: an FP8 release declares "
                f"{KEY}: {{quant_method: 'fp8', fmt: 'e4m3', weight_block_size: [128, 128]}}; restore the release's "
                "config.json (its tensors are then dequantized on load)"
            )
        return dict(tensors)
    out = {k: t for k, t in tensors.items() if k not in scales}
    for s in sorted(scales):
        key = s[: -len(SCALE_SUFFIX)]
        if key not in tensors:
            raise HFCheckpointError(f"{where}: {s} ({tensors[s].location}) has no weight {key!r} beside it")
        _check_pair(key, tensors[key], tensors[s], quant.block, where)
        out[key] = BlockDequantized(tensors[key], tensors[s], quant.block, quant.dtype)
    unscaled = [k for k in fp8 if k + SCALE_SUFFIX not in scales]
    if unscaled:
        raise HFCheckpointError(
            f"{where}: {len(unscaled)} float8 tensor(s) without a {SCALE_SUFFIX} beside them (e.g. {unscaled[0]!r}, "
            f"{tensors[unscaled[0]].location}): block FP8 stores one scale per {list(quant.block)} block of each "
            "quantized weight; the folder is incomplete"
        )
    return out
