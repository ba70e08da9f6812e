"""Token dispatch for MoE: route each (token, k) slot to its expert and bring the results back.

Shape suffixes: T tokens, K experts per token (top-k), S = T*K routed slots, D model dim, E experts.
A *slot* ``s = t*K + k`` is the k-th expert choice of token t.

``LocalTokenDispatcher`` serves every expert on this rank. An expert-parallel dispatcher subclasses it
and exchanges rows between the two halves of the local work::

    dispatch: x_SD, counts_E, state = super().dispatch(...)   # rows sorted by global expert id
              -> all_to_all rows to the ranks owning the experts -> regroup by local expert
    combine:  undo the regrouping -> reverse all_to_all -> super().combine(y_SD, state)

Sorting by global expert id also groups the rows by destination rank (each rank owns a contiguous
block of experts), and ``counts_E`` gives the all-to-all split sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DispatchState",
    "LocalTokenDispatcher",
    "count_tokens_per_expert",
    "permute",
    "sort_slots_by_expert",
    "unpermute",
    "weighted_sum_topk",
]


def count_tokens_per_expert(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[E]``: how many slots chose each expert.

    ``scatter_add_`` into a fixed-size buffer rather than ``bincount``: no host sync on CUDA (bincount
    sizes its output from the max id) and integer adds are exact in any order.
    """
    idx_S = topk_idx_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_S.device)
    return counts_E.scatter_add_(0, idx_S, torch.ones_like(idx_S))


def sort_slots_by_expert(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sort_idx_S, num_tokens_per_expert_E)``: the slots in expert order and the count of each expert.

    The sort is stable, so within an expert the slots keep token order (deterministic layouts).
    """
    sort_idx_S = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
    return sort_idx_S, count_tokens_per_expert(topk_idx_TK, num_experts)


def permute(x_TD: torch.Tensor, sort_idx_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """Rows of ``x_TD`` in slot order ``sort_idx_S`` (each token repeated once per chosen expert)."""
    return x_TD.index_select(0, torch.div(sort_idx_S, top_k, rounding_mode="floor"))


def unpermute(y_SD: torch.Tensor, sort_idx_S: torch.Tensor) -> torch.Tensor:
    """Inverse of the sort: row ``i`` of ``y_SD`` goes back to slot ``sort_idx_S[i]``."""
    return y_SD.new_empty(y_SD.shape).index_copy(0, sort_idx_S, y_SD)


def weighted_sum_topk(y_TKD: torch.Tensor, topk_w_TK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_k w[t, k] * y[t, k]`` accumulated in fp32, then cast to ``dtype`` (HF grouped_mm numerics)."""
    return (y_TKD.float() * topk_w_TK.float().unsqueeze(-1)).sum(dim=1).to(dtype)


@dataclass(slots=True)
class DispatchState:
    """What ``combine`` needs to undo ``dispatch``."""

    sort_idx_S: torch.Tensor
    """Slot index (``t*K + k``) of each expert-sorted row."""
    topk_w_TK: torch.Tensor
    """Routing weights (fp32), applied in ``combine``."""
    dtype: torch.dtype
    """Dtype of the dispatched tokens, and of the combined output."""


class LocalTokenDispatcher:
    """Dispatch to experts that all live on this rank (no communication).

    A plain object, not a module: it holds no parameters, and parallelize code swaps it for an
    expert-parallel subclass (``moe.dispatcher = AllToAllTokenDispatcher(...)``).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        """``(x_SD sorted by expert, num_tokens_per_expert_E, state)``."""
        sort_idx_S, num_tokens_per_expert_E = sort_slots_by_expert(topk_idx_TK, self.num_experts)
        x_SD = permute(x_TD, sort_idx_S, topk_idx_TK.shape[-1])
        return x_SD, num_tokens_per_expert_E, DispatchState(sort_idx_S, topk_w_TK, x_TD.dtype)

    def combine(self, y_SD: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """``out_TD``: the expert outputs back in token order, weighted and summed over the K choices."""
        num_tokens, top_k = state.topk_w_TK.shape
        y_TKD = unpermute(y_SD, state.sort_idx_S).view(num_tokens, top_k, y_SD.shape[-1])
        return weighted_sum_topk(y_TKD, state.topk_w_TK, state.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_experts={self.num_experts})"
