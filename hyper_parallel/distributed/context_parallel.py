"""Ulysses context parallel: sequence-sharded everywhere except inside the attention core.

Each CP rank holds a contiguous chunk of every row of the batch (``split_batch_for_cp``). Around
the parameter-free ``inner_attention`` of every attention module, an all-to-all trades the
sequence split for a head split::

    q/k/v [B, H, T/cp, d]  --all-to-all-->  [B, H/cp, T, d]  --attention-->  [B, T, H/cp, dv]
                                                     --all-to-all-->  [B, T/cp, H, dv]

so attention sees whole sequences (every document of a packed row, with the GLOBAL ``cu_seqlens``
over the flattened ``B*T`` stream: varlen packing needs nothing special) for a subset of heads.
A linear-attention core (Gated DeltaNet's ``delta_rule``) declares ``cp_head_split_inputs`` and gets the
same trade on its token-major ``[B, T, H, ...]`` inputs (its recurrence needs whole sequences).
Projections, norms, MLPs and the loss run on the local chunk; RoPE uses the chunk's own
``position_ids``. Gradients of the all-to-all are all-to-alls the other way
(``all_to_all_single_autograd``), which gloo and NCCL both support.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_ulysses_cp", "seq_to_head_all_to_all", "head_to_seq_all_to_all", "split_batch_for_cp"]

# Generic batch keys laid out [..., B, T] that are split along T.
_SEQ_KEYS = ("input_ids", "labels", "position_ids", "source_ids")


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (chunk ``i`` goes to rank ``i``), differentiable."""
    out = all_to_all_single_autograd(x.contiguous(), None, None, group)
    return wait_tensor(out)  # differentiable wait (identity backward); yields a plain tensor


def seq_to_head_all_to_all(x_BHtd: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, H, T/cp, d]`` (sequence chunk, all heads) -> ``[B, H/cp, T, d]`` (whole sequence, head chunk)."""
    cp = dist.get_world_size(group)
    B, H, t, d = x_BHtd.shape
    if H % cp:
        raise ValueError(f"Ulysses CP splits heads: {H} heads are not divisible by context_parallel_degree {cp}")
    # [cp (head chunk = destination), B, H/cp, t, d]
    send = x_BHtd.view(B, cp, H // cp, t, d).permute(1, 0, 2, 3, 4)
    recv = _all_to_all(send, group)  # [cp (source = sequence chunk), B, H/cp, t, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * t, d)


def head_to_seq_all_to_all(x_BTHd: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, T, H/cp, d]`` (whole sequence, head chunk) -> ``[B, T/cp, H, d]`` (sequence chunk, all heads)."""
    cp = dist.get_world_size(group)
    B, T, h, d = x_BTHd.shape
    # [cp (sequence chunk = destination), B, T/cp, H/cp, d]
    send = x_BTHd.view(B, cp, T // cp, h, d).permute(1, 0, 2, 3, 4)
    recv = _all_to_all(send, group)  # [cp (source = head chunk), B, T/cp, H/cp, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, T // cp, cp * h, d)


def _pre_hook(group: dist.ProcessGroup):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        q, k, v, *rest = args
        q, k, v = (seq_to_head_all_to_all(t, group) for t in (q, k, v))
        return (q, k, v, *rest), kwargs

    return hook


def _post_hook(group: dist.ProcessGroup):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return head_to_seq_all_to_all(output, group)

    return hook


def _token_major_seq_to_head(x_BtH: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, T/cp, H, *rest]`` -> ``[B, T, H/cp, *rest]`` (token-major layout of ``seq_to_head_all_to_all``)."""
    B, t, H = x_BtH.shape[:3]
    rest = x_BtH.shape[3:]
    x_BHtd = x_BtH.reshape(B, t, H, -1).transpose(1, 2).contiguous()
    y_BHTd = seq_to_head_all_to_all(x_BHtd, group)
    return y_BHTd.transpose(1, 2).reshape(B, y_BHTd.shape[2], y_BHTd.shape[1], *rest)


def _head_split_pre_hook(group: dist.ProcessGroup, n_inputs: int):
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        local_kwargs = getattr(module, "cp_local_kwargs", None)
        if local_kwargs is not None:  # e.g. the rows of a per-channel weight that belong to this head chunk
            kwargs = local_kwargs(args, kwargs, rank=rank, world=world)
        split = tuple(_token_major_seq_to_head(t, group) for t in args[:n_inputs])
        return (*split, *args[n_inputs:]), kwargs

    return hook


def apply_ulysses_cp(model: nn.Module, cp_mesh: DeviceMesh, *, attention_name: str = "inner_attention") -> int:
    """Wrap every sequence core with the Ulysses all-to-alls; return how many.

    - An attention core named ``attention_name`` takes ``(q [B, H, T, dqk], k [B, Hk, T, dqk], v [B, Hk, T,
      dv], ...)`` positionally with the global ``AttentionMeta`` as a keyword, and returns ``[B, T, H, dv]``.
    - Any other core declares how to split it (a linear-attention recurrence): ``cp_head_split_inputs`` (a
      class attribute), the number of leading positional inputs laid out token-major ``[B, T, H, ...]`` (each
      may have its own head count), and returns ``[B, T, H, ...]``. An optional method
      ``cp_local_kwargs(args, kwargs, *, rank, world) -> kwargs`` (called with the inputs before the
      all-to-all, all heads) adapts keyword inputs to head chunk ``rank`` of ``world``.

    Hooks, not a wrapper module, so parameter FQNs and the module tree stay unchanged.
    """
    group = cp_mesh.get_group()
    count = 0
    for fqn, module in model.named_modules():
        n_inputs = getattr(module, "cp_head_split_inputs", 0)
        if n_inputs:
            module.register_forward_pre_hook(_head_split_pre_hook(group, n_inputs), with_kwargs=True)
            module.register_forward_hook(_post_hook(group))
            count += 1
        elif fqn.rsplit(".", 1)[-1] == attention_name:
            module.register_forward_pre_hook(_pre_hook(group), with_kwargs=True)
            module.register_forward_hook(_post_hook(group))
            count += 1
    if count == 0:
        raise ValueError(f"context parallel found no attention core named {attention_name!r} in the model")
    return count


def split_batch_for_cp(
    batch: Mapping[str, Any],
    cp_rank: int,
    cp_size: int,
    *,
    split_inputs: Callable[..., dict[str, Any]] | None = None,
    model_keys: tuple[str, ...] = (),
) -> dict[str, Any]:
    """This CP rank's part of a batch: a contiguous chunk of every row.

    The generic keys ``input_ids``, ``labels`` (``[B, T]``) and ``position_ids`` (``[B, T]`` or
    ``[3, B, T]``) are sliced along their last dim; ``cu_seqlens``/``max_seqlen`` stay GLOBAL (attention
    runs on whole sequences after the all-to-all). The model's own inputs (``model_keys``) go through
    ``split_inputs(inputs, lo=, hi=, seqlen=)`` (the model's ``split_inputs_for_cp``); other keys pass
    through. ``position_ids`` must be in the batch: they cannot be rebuilt from a chunk.
    """
    if cp_size == 1:
        return dict(batch)
    if "position_ids" not in batch:
        raise ValueError("context parallel needs `position_ids` in the batch (positions of a chunk are not 0..n)")
    B, T = batch["input_ids"].shape
    if T % cp_size:
        raise ValueError(
            f"sequence length {T} is not divisible by context_parallel_degree {cp_size}: pad batches to a "
            f"multiple of {cp_size} in the packing collate (or change --parallelism.context_parallel_degree)"
        )
    t = T // cp_size
    lo, hi = cp_rank * t, (cp_rank + 1) * t
    out = dict(batch)
    for key in _SEQ_KEYS:
        if key in batch and batch[key] is not None:
            out[key] = batch[key][..., lo:hi]
    inputs = {k: batch[k] for k in model_keys if k in batch}
    if inputs and split_inputs is not None:
        out.update(split_inputs(inputs, lo=lo, hi=hi, seqlen=T))
    return out
