"""Expert parallel: routed experts sharded ``Shard(0)`` over the ``ep`` axis, tokens moved by all-to-all.

Shape suffixes: T tokens on this rank, K top-k, S = T*K routed slots sent, R slots received, D model
dim, E global experts, L = E/ep local experts, P = ep ranks.

``AllToAllTokenDispatcher`` subclasses the local dispatcher: the local sort by global expert id also
groups the rows by destination rank (rank ``p`` owns experts ``[p*L, (p+1)*L)``), so::

    dispatch: sort locally -> exchange counts [P, L] -> all_to_all rows -> regroup by local expert
    combine:  undo the regrouping -> reverse all_to_all -> un-sort, weight and sum over K locally

Rows are variable-sized per rank, so the split sizes are host ints: ONE device->host copy per dispatch
(the sent and received counts together; the regroup index is then built on the device from host
sizes, without a sync of its own). The row all-to-alls are differentiable
(``all_to_all_single_autograd``, supported by gloo and NCCL); the count exchange carries no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.models.common.token_dispatcher import DispatchState, LocalTokenDispatcher

__all__ = ["AllToAllTokenDispatcher", "ExpertParallelState", "apply_expert_parallel_dispatch"]


@dataclass(slots=True)
class ExpertParallelState:
    """What ``combine`` needs to undo an expert-parallel ``dispatch``."""

    local: DispatchState
    """State of the local sort (undone last)."""
    send_splits: list[int]
    """Rows sent to each ep rank."""
    recv_splits: list[int]
    """Rows received from each ep rank."""
    regroup_idx_R: torch.Tensor
    """Received row order -> local-expert-major order (rows of local expert 0 from every source first)."""


class AllToAllTokenDispatcher(LocalTokenDispatcher):
    """Dispatch to experts spread over the ranks of ``ep_mesh`` (1-D), ``num_experts / ep`` per rank."""

    def __init__(self, num_experts: int, ep_mesh: DeviceMesh) -> None:
        super().__init__(num_experts)
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        if num_experts % self.ep:
            raise ValueError(f"{num_experts} routed experts are not divisible by expert_parallel_degree {self.ep}")
        self.num_local_experts = num_experts // self.ep

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExpertParallelState]:
        x_SD, counts_E, local_state = super().dispatch(x_TD, topk_idx_TK, topk_w_TK)
        P, L = self.ep, self.num_local_experts
        # counts_recv_PL[p, l]: rows source rank p sends to my local expert l.
        counts_recv_PL = torch.empty_like(counts_E)
        dist.all_to_all_single(counts_recv_PL, counts_E, group=self.group)
        counts_recv_PL = counts_recv_PL.view(P, L)
        # The one device->host copy: rows sent to and received from each rank.
        splits = torch.cat([counts_E.view(P, L).sum(dim=1), counts_recv_PL.sum(dim=1)]).tolist()
        send_splits, recv_splits = splits[:P], splits[P:]
        x_RD = wait_tensor(all_to_all_single_autograd(x_SD, recv_splits, send_splits, self.group))
        # Received rows are [source p][local expert l][rows]; the experts want [l][p][rows].
        regroup_idx_R = _regroup_index(counts_recv_PL, sum(recv_splits))
        x_RD = x_RD.index_select(0, regroup_idx_R)
        num_tokens_per_local_expert_L = counts_recv_PL.sum(dim=0)
        return x_RD, num_tokens_per_local_expert_L, ExpertParallelState(
            local_state, send_splits, recv_splits, regroup_idx_R
        )

    def combine(self, y_RD: torch.Tensor, state: ExpertParallelState) -> torch.Tensor:
        y_back_RD = y_RD.new_empty(y_RD.shape).index_copy(0, state.regroup_idx_R, y_RD)
        y_SD = wait_tensor(all_to_all_single_autograd(y_back_RD, state.send_splits, state.recv_splits, self.group))
        return super().combine(y_SD, state.local)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep})"


def _regroup_index(counts_PL: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Row indices that reorder a ``[p][l]``-blocked buffer of ``total`` rows into ``[l][p]`` blocks.

    Pass ``total`` (= ``counts_PL.sum()``) from the host: building the index then syncs nothing.
    """
    flat = counts_PL.reshape(-1)
    if total is None:
        total = int(flat.sum())
    starts_LP = (torch.cumsum(flat, 0) - flat).view(counts_PL.shape).t().reshape(-1)
    counts_LP = counts_PL.t().reshape(-1)
    # Position of each output row inside its block, plus the block's start in the received buffer.
    block_start_out = torch.repeat_interleave(torch.cumsum(counts_LP, 0) - counts_LP, counts_LP, output_size=total)
    offset_in_block = torch.arange(total, device=flat.device) - block_start_out
    return torch.repeat_interleave(starts_LP, counts_LP, output_size=total) + offset_in_block


def apply_expert_parallel_dispatch(model: nn.Module, ep_mesh: DeviceMesh, *, moe_type: type | None = None) -> int:
    """Give every MoE module (a module with ``experts`` and a ``dispatcher``) an all-to-all dispatcher.

    The experts' parameters must already be sharded ``Shard(0)`` on ``ep_mesh`` (their declared
    ``ShardingConfig``). Returns the number of MoE modules changed.
    """
    count = 0
    for module in model.modules():
        if moe_type is not None and not isinstance(module, moe_type):
            continue
        dispatcher = getattr(module, "dispatcher", None)
        if isinstance(dispatcher, LocalTokenDispatcher) and hasattr(module, "experts"):
            module.dispatcher = AllToAllTokenDispatcher(dispatcher.num_experts, ep_mesh)
            count += 1
    return count
