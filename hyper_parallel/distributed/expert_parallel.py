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

Under activation checkpointing the recompute routes the same tokens again: it reuses the forward's counts and
split sizes (kept on torch's checkpoint frame of that forward, freed with it) instead of exchanging and
reading them back a second time, so a checkpointed MoE layer syncs once per forward, not twice.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

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
        counts_recv_PL, send_splits, recv_splits = self._exchange_counts(counts_E, x_SD.shape[0])
        x_RD = wait_tensor(all_to_all_single_autograd(x_SD, recv_splits, send_splits, self.group))
        # Received rows are [source p][local expert l][rows]; the experts want [l][p][rows].
        regroup_idx_R = _regroup_index(counts_recv_PL, sum(recv_splits))
        x_RD = x_RD.index_select(0, regroup_idx_R)
        num_tokens_per_local_expert_L = counts_recv_PL.sum(dim=0)
        return x_RD, num_tokens_per_local_expert_L, ExpertParallelState(
            local_state, send_splits, recv_splits, regroup_idx_R
        )

    def _exchange_counts(self, counts_E: torch.Tensor, rows: int) -> tuple[torch.Tensor, list[int], list[int]]:
        """(counts_recv_PL, send_splits, recv_splits): ``counts_recv_PL[p, l]`` = rows source rank p sends to my local
        expert l. An activation-checkpoint recompute takes the ones its forward recorded (same tokens, same
        routing: no exchange, no sync); any other call exchanges and reads them back once."""
        phase, frame = _checkpoint_phase()
        if phase == "recompute":
            recorded = _RECORDED.get(frame, {}).get(id(self))
            if recorded and recorded[0][0] == rows:
                return recorded.pop(0)[1]
        P, L = self.ep, self.num_local_experts
        counts_recv_PL = torch.empty_like(counts_E)
        dist.all_to_all_single(counts_recv_PL, counts_E, group=self.group)
        counts_recv_PL = counts_recv_PL.view(P, L)
        # The one device->host copy: rows sent to and received from each rank.
        splits = torch.cat([counts_E.view(P, L).sum(dim=1), counts_recv_PL.sum(dim=1)]).tolist()
        out = (counts_recv_PL, splits[:P], splits[P:])
        if phase == "forward" and torch.is_grad_enabled():
            _RECORDED.setdefault(frame, {}).setdefault(id(self), []).append((rows, out))
        return out

    def combine(self, y_RD: torch.Tensor, state: ExpertParallelState) -> torch.Tensor:
        y_back_RD = y_RD.new_empty(y_RD.shape).index_copy(0, state.regroup_idx_R, y_RD)
        y_SD = wait_tensor(all_to_all_single_autograd(y_back_RD, state.send_splits, state.recv_splits, self.group))
        return super().combine(y_SD, state.local)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_experts={self.num_experts}, ep={self.ep})"


_RECORDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""torch checkpoint frame -> {id(dispatcher): [(rows, (counts_recv_PL, send_splits, recv_splits)), ...]}: what a
checkpointed forward exchanged, for its recompute. Keyed weakly by the frame: an entry lives as long as the
forward's autograd graph, so a forward whose backward never runs leaves nothing behind."""


def _checkpoint_phase() -> tuple[str | None, Any]:
    """("forward" | "recompute", torch's checkpoint frame) inside a non-reentrant ``torch.utils.checkpoint``
    region (its saved-tensor hooks are on top), else (None, None). Reads torch internals; anything unexpected
    means (None, None): the caller then just exchanges again."""
    if torch.compiler.is_compiling():
        return None, None
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, RuntimeError):  # pragma: no cover - another torch
        return None, None
    if not hooks:
        return None, None
    pack = hooks[0]
    name = getattr(pack, "__qualname__", "")
    phase = "forward" if name.startswith("_checkpoint_hook.") else None
    for _ in range(3):  # the recompute's pack hook is wrapped (torch._dynamo.disable)
        cells = dict(zip(pack.__code__.co_freevars, (c.cell_contents for c in pack.__closure__ or ())))
        if phase == "forward" and "frame" in cells:
            return phase, cells["frame"]
        if "target_frame_ref" in cells:
            frame = cells["target_frame_ref"]()
            return ("recompute", frame) if frame is not None else (None, None)
        pack = cells.get("fn")
        if pack is None or not hasattr(pack, "__code__"):
            break
    return None, None


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
