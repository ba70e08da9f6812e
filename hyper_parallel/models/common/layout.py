"""Layout facts of a decoder's MLPs, for ``ParallelDims.validate_model`` (model-agnostic)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.moe import MoE

__all__ = ["mlp_layout_facts"]


def mlp_layout_facts(config: Any, *, ffn_name: Callable[[int, bool], str]) -> dict[str, Any]:
    """``n_routed_experts``, ``tp_dims`` and ``efsdp_dims`` of ``validate_model`` for a decoder ``config``
    (its ``layers`` block configs and model ``dim``).

    TP shards the hidden size of every dense MLP and shared expert: ``ffn_name(layer_index, is_shared)``
    names the field a user sets (the first layer of each name is checked). With EP, FSDP shards the
    routed experts' weights on dim 1 (``2 x moe_intermediate_size`` and ``hidden_size``).
    """
    layers = config.layers
    moes = [layer.mlp for layer in layers if isinstance(layer.mlp, MoE.Config)]
    tp_dims: dict[str, int] = {}
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        ffn = mlp if isinstance(mlp, FeedForward.Config) else getattr(mlp, "shared_experts", None)
        if ffn is not None:
            tp_dims.setdefault(ffn_name(i, ffn is not mlp), ffn.hidden_dim)
    efsdp_dims: dict[str, int] = {}
    if moes:
        efsdp_dims = {"2 x moe_intermediate_size": 2 * moes[0].experts.hidden_dim, "hidden_size": config.dim}
    return {
        "n_routed_experts": moes[0].num_experts if moes else None,
        "tp_dims": tp_dims,
        "efsdp_dims": efsdp_dims,
    }
