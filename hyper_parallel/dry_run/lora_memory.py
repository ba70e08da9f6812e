"""The LoRA line of the dry run: what trains (adapters, ``--lora.modules_to_save``) and what is the frozen base.

The parallelize path stores a frozen base in the compute dtype (``fsdp.store_frozen_in_param_dtype``: bf16 under
``--training.mixed_precision_param bfloat16``, routers and FSDP-ignored parameters in their own dtype), sharded as
the layout says, with no gradient, no optimizer state and no fp32 master copy; the adapters and modules_to_save are
ordinary trainable parameters (fp32 master, fp32 gradient shards, AdamW's two moments). ``layout.rank_memory``
already counts each parameter once in the dtype it is stored in; this module only splits the totals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hyper_parallel.config.lora import LoRAConfig
from hyper_parallel.dry_run.layout import ParamLayout, RankMemory
from hyper_parallel.models.common.lora import is_lora_param

__all__ = ["LoRAMemory", "format_lora", "lora_memory"]

_DTYPE_NAMES = {torch.tensor([], dtype=d).element_size(): str(d).removeprefix("torch.")
                for d in (torch.bfloat16, torch.float32, torch.float64)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class LoRAMemory:
    """Global counts of a LoRA run's parameters (per-rank bytes are in ``RankMemory``)."""

    rank: int
    alpha: float
    adapter_numel: int
    """Elements of every adapter (``lora_A`` / ``lora_B``, the experts' stacks included)."""
    adapter_bytes: int
    """Bytes of the adapters in their stored dtype (fp32)."""
    saved_numel: int
    """Elements of the ``--lora.modules_to_save`` parameters (trained in full)."""
    saved_bytes: int
    frozen_numel: int
    """Elements of the frozen base."""
    frozen_bytes: int
    """Bytes of the frozen base in the dtypes it is stored in (each parameter once)."""
    frozen_dtypes: tuple[tuple[str, int], ...]
    """(dtype name, elements) of the frozen base, largest first."""


def lora_memory(layouts: Sequence[ParamLayout], lora: LoRAConfig) -> LoRAMemory:
    """Split the parameters of a LoRA run into adapters, modules_to_save and the frozen base."""
    adapters = [p for p in layouts if p.trainable and is_lora_param(p.fqn)]
    saved = [p for p in layouts if p.trainable and not is_lora_param(p.fqn)]
    frozen = [p for p in layouts if not p.trainable]
    by_dtype: dict[str, int] = {}
    for p in frozen:
        name = _DTYPE_NAMES.get(p.itemsize, f"{p.itemsize}-byte")
        by_dtype[name] = by_dtype.get(name, 0) + p.numel
    return LoRAMemory(
        rank=lora.rank,
        alpha=lora.alpha,
        adapter_numel=sum(p.numel for p in adapters),
        adapter_bytes=sum(p.numel * p.itemsize for p in adapters),
        saved_numel=sum(p.numel for p in saved),
        saved_bytes=sum(p.numel * p.itemsize for p in saved),
        frozen_numel=sum(p.numel for p in frozen),
        frozen_bytes=sum(p.numel * p.itemsize for p in frozen),
        frozen_dtypes=tuple(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
    )


def _size(nbytes: float) -> str:
    for name, size in (("GiB", float(1 << 30)), ("MiB", float(1 << 20))):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {name}"
    return f"{nbytes / 1024:.2f} KiB"


def format_lora(lora: LoRAMemory, fullest: RankMemory, unit: tuple[str, float]) -> list[str]:
    """The report's LoRA lines: global counts, then the fullest rank's split of its static memory."""
    name, size = unit
    dtypes = ", ".join(f"{n:,} {d}" for d, n in lora.frozen_dtypes)
    saved = (
        f" + {lora.saved_numel:,} in modules_to_save ({_size(lora.saved_bytes)})" if lora.saved_numel else ""
    )
    trainable = fullest.params - fullest.frozen_params
    return [
        f"LoRA rank {lora.rank} (alpha {lora.alpha:g}): trains {lora.adapter_numel:,} adapter parameters "
        f"({_size(lora.adapter_bytes)}){saved}; frozen base {lora.frozen_numel:,} parameters "
        f"({_size(lora.frozen_bytes)}: {dtypes}), stored once, no gradients or optimizer state",
        f"  rank {fullest.rank} ({name}): frozen base {fullest.frozen_params / size:.2f} + trained parameters "
        f"{trainable / size:.2f} + their gradients {fullest.grads / size:.2f} + optimizer state "
        f"{fullest.optimizer / size:.2f}",
    ]
