"""LoRA (low-rank adaptation, Hu et al. 2021) as PEFT defines it, for ``Linear`` and the fused ``GroupedExperts``.

A frozen weight ``W [out, in]`` gets two trainable factors, ``A [r, in]`` and ``B [out, r]``:

    y = x W^T (+ b) + scale * (dropout(x) A^T) B^T         i.e. the weight  W + scale * B A

with ``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA, Kalajdzievic 2023). ``A`` starts
kaiming-uniform with ``a = sqrt(5)`` (bound ``1 / sqrt(in)``, PEFT's ``reset_lora_parameters``) and ``B`` at
zero, so a fresh adapter leaves the model's output unchanged. The product ``B A`` is never formed: the
adapter runs as two thin matmuls beside the base one, and the frozen ``W`` gets no gradient.

Routed experts (``GroupedExperts``): one ``A``/``B`` per expert, stacked ``[E, r, in]`` / ``[E, out, r]`` and
applied through the experts' own grouped matmul; with ``share_experts`` a single ``[1, r, in]`` / ``[1, out, r]``
pair serves every expert (then a plain matmul over all routed rows). Gate and up share one ``A`` over the fused
``gate_up_proj`` (PEFT's ``target_parameters`` form; vLLM's 2-D form is the same adapter with ``lora_B`` split in
rows). PEFT refuses dropout on ``target_parameters``, so the experts' adapters have none.

Adapter parameters are named ``lora_A`` / ``lora_B`` (``<weight>_lora_A`` / ``<weight>_lora_B`` on the experts):
``is_lora_param`` tells them from the base. Which modules get adapters and everything else a LoRA run decides
(frozen base, checkpoints, resume, export) is ``lora_policy.py``.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.protocols.module import unwrapped_name

__all__ = ["LoRA", "init_adapters_", "init_lora_A_", "is_lora_param"]


class LoRA(Configurable):
    """The adapter settings of one module (built by ``apply_lora``; the module owns the parameters)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        rank: int
        """Rank r of the adapter (rows of A, columns of B)."""
        alpha: float
        """Scaling numerator: the update is ``alpha / r * B A`` (``alpha / sqrt(r)`` with ``rslora``)."""
        dropout: float = 0.0
        """Dropout on the adapter's input (dense linears only; PEFT allows none on fused experts)."""
        rslora: bool = False
        """rsLoRA scaling ``alpha / sqrt(r)`` instead of ``alpha / r``."""
        share_experts: bool = False
        """Fused experts: one adapter shared by every expert (stacks of 1) instead of one per expert."""

        def __post_init__(self) -> None:
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
                raise ConfigError(f"lora.rank={self.rank!r} must be an integer >= 1 on an adapted module")
            if not 0.0 <= self.dropout < 1.0:
                raise ConfigError(f"lora.dropout={self.dropout!r} must be in [0, 1)")

        @property
        def scale(self) -> float:
            """``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA)."""
            return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.config: LoRA.Config = config


def is_lora_param(name: str) -> bool:
    """Whether a parameter (or state-dict key) name is a LoRA adapter's (``...lora_A`` / ``...lora_B``, any
    prefix: ``q_proj.lora_A``, ``experts.gate_up_proj_lora_B``, HF ``...q_proj.lora_A.weight``)."""
    return any(part.startswith("lora_") or "_lora_" in part for part in name.split("."))


@torch.no_grad()
def init_lora_A_(a: torch.Tensor) -> torch.Tensor:
    """PEFT's init of ``A`` (``kaiming_uniform_(a=sqrt(5))`` on ``[r, in]``): uniform in ``+-1/sqrt(in)``.

    The bound is taken from the last dim for a 2-D ``[r, in]`` and a stacked ``[E, r, in]`` alike
    (``nn.init`` would count ``r * in`` as the fan-in of a 3-D tensor)."""
    bound = 1.0 / math.sqrt(a.shape[-1])
    return a.uniform_(-bound, bound)


def _is_lora_B(name: str) -> bool:
    return name.endswith("lora_B")


@torch.no_grad()
def init_adapters_(model: nn.Module, seed: int) -> int:
    """Initialise every adapter of ``model`` (whole or parallelized) as PEFT does, the same on every layout; returns
    how many tensors it set.

    Each adapter's full value is drawn from its own generator (``seed`` and the parameter's name, wrappers' name
    parts dropped) and each rank keeps its shard of it, so the values depend neither on the layout nor on the
    order of the parameters. An HF-folder LoRA run uses this instead of a whole-model random init: the base
    comes from the folder, only the small adapters need values. B is zero (a fresh adapter changes nothing).
    """
    count = 0
    for raw, p in model.named_parameters():
        name = unwrapped_name(raw)
        if not is_lora_param(name):
            continue
        full = torch.zeros(tuple(p.shape), dtype=torch.float32)
        if not _is_lora_B(name):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            bound = 1.0 / math.sqrt(full.shape[-1])
            full.uniform_(-bound, bound, generator=gen)
        if isinstance(p, DTensor):  # every rank slices its own shard: no communication
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)
        count += 1
    return count
