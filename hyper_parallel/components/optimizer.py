"""Optimizers: the ``OptimizersContainer`` option group, the Muon/AdamW parameter split and
``get_hyper_optimizer``.

``name=adamw`` trains every parameter with ``torch.optim.AdamW``. ``name=muon`` builds one
:class:`~hyper_parallel.components.muon.MuonWithAuxAdamW`: hidden weight matrices (and every
expert's matrices) get Muon; embeddings, the output head, norms, the router (``gate.weight``),
biases and every 1-D parameter get AdamW. Frozen parameters (``requires_grad=False``) are in no group.

The container's ``state_dict`` goes through ``get_optimizer_state_dict`` with flattened FQN keys
(``state.layers.0.mlp.experts.down_proj.momentum_buffer``), so DCP saves sharded optimizer state and
reshards it on load.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from hyper_parallel.components.muon import MuonWithAuxAdamW
from hyper_parallel.config.configurable import Configurable
from hyper_parallel.models.common.embedding import Embedding

__all__ = [
    "DEFAULT_ADAMW_PARAM_PATTERNS",
    "DEFAULT_FUSED_ROW_BLOCKS",
    "OptimizersContainer",
    "get_hyper_optimizer",
    "split_muon_params",
]

DEFAULT_ADAMW_PARAM_PATTERNS: tuple[str, ...] = (
    r"(^|\.)embed",  # embed_tokens, embeddings
    r"(^|\.)(lm_head|output)\.",  # the output head
    r"(^|\.)gate\.weight$",  # the MoE router (not gate_proj)
    r"(^|\.)router\.",
)
"""Regexes (``re.search`` on the parameter FQN) of >= 2-D parameters that AdamW trains instead of Muon."""

DEFAULT_FUSED_ROW_BLOCKS: dict[str, int] = {"gate_up_proj": 2}
"""FQN suffix -> number of matrices stacked along the rows (``[gate | up]``), orthogonalised separately."""


def split_muon_params(
    model: nn.Module, *, adamw_param_patterns: Sequence[str] = DEFAULT_ADAMW_PARAM_PATTERNS
) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """Split the trainable parameters of ``model`` into ``(muon, adamw)`` dicts keyed by FQN.

    AdamW gets: every parameter with fewer than 2 dims (norms, biases, 1-D gains), every parameter of
    an embedding module, and every FQN matching one of ``adamw_param_patterns``. Muon gets the rest
    (2-D hidden weights, 3-D grouped-expert weights). Frozen parameters are in neither.
    """
    patterns = [re.compile(p) for p in adamw_param_patterns]
    embedding_params = {
        id(p) for m in model.modules() if isinstance(m, (nn.Embedding, Embedding)) for p in m.parameters()
    }
    muon: dict[str, nn.Parameter] = {}
    adamw: dict[str, nn.Parameter] = {}
    for fqn, p in model.named_parameters():
        if not p.requires_grad:
            continue
        to_adamw = p.ndim < 2 or id(p) in embedding_params or any(r.search(fqn) for r in patterns)
        (adamw if to_adamw else muon)[fqn] = p
    return muon, adamw


def _unique_trainable(params: Iterable[nn.Parameter] | Mapping[str, nn.Parameter]) -> list[nn.Parameter]:
    values = params.values() if isinstance(params, Mapping) else params
    seen: set[int] = set()
    out = []
    for p in values:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def get_hyper_optimizer(
    model: nn.Module,
    muon_params: Iterable[nn.Parameter] | Mapping[str, nn.Parameter],
    adamw_params: Iterable[nn.Parameter] | Mapping[str, nn.Parameter],
    muon_kwargs: dict[str, Any] | None = None,
    adamw_kwargs: dict[str, Any] | None = None,
    *,
    fused_row_blocks: Mapping[str, int] | None = None,
) -> MuonWithAuxAdamW:
    """One optimizer with a Muon group (plus one per fused row-block count) and an AdamW group.

    ``muon_kwargs``: ``lr, weight_decay, momentum, nesterov, ns_steps, ns_coefficients, eps,
    adjust_lr_fn, ns_dtype``. ``adamw_kwargs``: ``lr, betas, eps, weight_decay, foreach, fused``.
    ``fused_row_blocks`` maps an FQN suffix to the number of matrices stacked along its rows
    (default ``{"gate_up_proj": 2}``). Parameters must belong to ``model``; frozen ones are dropped.
    """
    fqn_of = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = _unique_trainable(muon_params), _unique_trainable(adamw_params)
    for p in muon + adamw:
        if id(p) not in fqn_of:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} passed to get_hyper_optimizer is not in the model")
    both = {id(p) for p in muon} & {id(p) for p in adamw}
    if both:
        raise ValueError(f"parameters in both the Muon and the AdamW list: {sorted(fqn_of[i] for i in both)}")
    blocks_rule = DEFAULT_FUSED_ROW_BLOCKS if fused_row_blocks is None else dict(fused_row_blocks)

    def row_blocks(p: nn.Parameter) -> int:
        fqn = fqn_of[id(p)]
        return next((n for suffix, n in blocks_rule.items() if fqn.endswith(suffix) or fqn.endswith(suffix + ".weight")), 1)

    by_blocks: dict[int, list[nn.Parameter]] = {}
    for p in muon:
        by_blocks.setdefault(row_blocks(p), []).append(p)
    groups: list[dict[str, Any]] = [
        {"params": ps, "use_muon": True, **(muon_kwargs or {}), "row_blocks": n} for n, ps in sorted(by_blocks.items())
    ]
    if adamw:
        groups.append({"params": adamw, "use_muon": False, **(adamw_kwargs or {})})
    if not groups:
        raise ValueError("get_hyper_optimizer: the model has no trainable parameters")
    return MuonWithAuxAdamW(groups)


def _flags(implementation: str, params: Sequence[torch.Tensor]) -> dict[str, bool | None]:
    if implementation == "auto":
        on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
        return {"fused": True, "foreach": None} if on_cuda else {"fused": None, "foreach": None}
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


class OptimizersContainer(Configurable):
    """One optimizer per model part, stepped together; a DCP ``Stateful`` (state_dict/load_state_dict).

    Build with ``OptimizersContainer.Config(...).build(model_parts=[model])``. ``param_groups`` lists
    every group of every part (what an LR scheduler needs); ``optimizers`` holds the torch optimizers.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        name: Literal["adamw", "muon"] = "adamw"
        """`adamw`: AdamW for every parameter. `muon`: Muon for hidden/expert matrices, AdamW for the rest."""
        lr: float = 3e-4
        """Peak learning rate of AdamW (and of Muon when muon_lr is None)."""
        weight_decay: float = 0.1
        """Decoupled weight decay (AdamW, and Muon when muon_weight_decay is None)."""
        betas: tuple[float, float] = (0.9, 0.95)
        """AdamW (beta1, beta2)."""
        eps: float = 1e-8
        """AdamW epsilon."""
        implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
        """AdamW kernel; `auto` = fused when every parameter is on CUDA, else torch's default."""
        muon_lr: float | None = None
        """Muon peak learning rate; None = lr (right with adjust_lr=match_rms_adamw)."""
        muon_weight_decay: float | None = None
        """Muon decoupled weight decay; None = weight_decay."""
        momentum: float = 0.95
        """Muon momentum."""
        nesterov: bool = True
        """Muon Nesterov momentum."""
        ns_steps: int = 5
        """Newton-Schulz iterations of the Muon orthogonalisation."""
        ns_dtype: Literal["float32", "bfloat16"] = "float32"
        """Dtype of the Newton-Schulz iteration (bfloat16 is faster on GPUs; coefficients are bf16-safe)."""
        adjust_lr: Literal["match_rms_adamw", "original", "none"] = "match_rms_adamw"
        """Muon per-matrix LR scale: 0.2*sqrt(max(m,n)) (match AdamW RMS), sqrt(max(1,m/n)), or none."""
        adamw_param_patterns: list[str] = field(default_factory=lambda: list(DEFAULT_ADAMW_PARAM_PATTERNS))
        """With name=muon: regexes of >= 2-D parameter FQNs trained by AdamW (embeddings/head/router)."""
        fused_row_blocks: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_FUSED_ROW_BLOCKS))
        """With name=muon: FQN suffix -> matrices stacked along the rows, orthogonalised separately."""

    def __init__(self, config: Config, *, model_parts: Sequence[nn.Module]) -> None:
        super().__init__(config)
        if isinstance(model_parts, nn.Module):
            model_parts = [model_parts]
        self.config: OptimizersContainer.Config = config
        self.model_parts = list(model_parts)
        self.optimizers: list[torch.optim.Optimizer] = [self._build_one(m) for m in self.model_parts]

    def _build_one(self, model: nn.Module) -> torch.optim.Optimizer:
        c = self.config
        if c.name == "adamw":
            params = _unique_trainable(model.parameters())
            if not params:
                raise ValueError("OptimizersContainer: a model part has no trainable parameters")
            return torch.optim.AdamW(
                params, lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay, **_flags(c.implementation, params)
            )
        if c.name != "muon":
            raise ValueError(f"optimizer.name={c.name!r}: use 'adamw' or 'muon'")
        muon, adamw = split_muon_params(model, adamw_param_patterns=c.adamw_param_patterns)
        muon_kwargs = {
            "lr": c.lr if c.muon_lr is None else c.muon_lr,
            "weight_decay": c.weight_decay if c.muon_weight_decay is None else c.muon_weight_decay,
            "momentum": c.momentum,
            "nesterov": c.nesterov,
            "ns_steps": c.ns_steps,
            "ns_dtype": c.ns_dtype,
            "adjust_lr_fn": c.adjust_lr,
        }
        adamw_kwargs = {
            "lr": c.lr,
            "betas": c.betas,
            "eps": c.eps,
            "weight_decay": c.weight_decay,
            **_flags(c.implementation, list(adamw.values())),
        }
        return get_hyper_optimizer(
            model, muon, adamw, muon_kwargs, adamw_kwargs, fused_row_blocks=c.fused_row_blocks
        )

    # -- the optimizer surface -------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    # -- Stateful (DCP) --------------------------------------------------------------------
    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        """Flattened FQN-keyed state of every part (sharded DTensors stay sharded)."""
        get = functools.partial(get_optimizer_state_dict, options=self._OPTIONS)
        return {k: v for sd in map(get, self.model_parts, self.optimizers) for k, v in sd.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for model, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, opt, optim_state_dict=state_dict, options=self._OPTIONS)
