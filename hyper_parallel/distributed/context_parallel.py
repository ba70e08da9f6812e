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

Beyond the head counts (``apply_context_parallel`` picks per core, and logs it):

- Attention whose (key/value) heads per tensor-parallel rank do not divide by the CP degree gathers K/V
  over the CP group and keeps its local queries (Llama 3's all-gather form, ``allgather_attention``).
- Gated DeltaNet whose key heads per tensor-parallel rank do not divide passes its recurrent state between
  sequence pieces (``gated_delta_state``): an all-gather of piece summaries ``(M, S_zero)`` and of the conv
  window's last ``K-1`` input rows.
- Either way the batch uses the balanced (zig-zag) order: rank ``r`` holds pieces ``r`` and ``2cp-1-r`` of
  every row (``CPShard``; a model's own inputs are split piece by piece, ``split_inputs_for_cp``), so causal
  attention work is equal on every rank. Ulysses cores then put the gathered sequence back into natural
  order around the core. The chosen order is ``model.cp_shard``; the batch
  must be split with it (``split_batch_for_cp(..., balanced=model.cp_shard.balanced)``).

Hybrid (``--parallelism.context_parallel_ulysses_degree u``, ``1 < u < cp``): ``cp = cp_outer x u``, the ``u``
neighbouring CP ranks ``o*u .. o*u+u-1`` form inner group ``o`` (one node: fast links), the ranks ``u`` apart an
outer group. A core whose heads per TP rank do not divide by ``cp`` (but by ``u``) runs Ulysses inside its inner
group (``[B, H, t, d] -> [B, H/u, u*t, d]``), then the K/V all-gather / state passing over its outer group on
the gathered pieces (``hybrid_allgather``, ``hybrid_state_passing``), then the inverse all-to-all. Cores whose
heads divide by ``cp`` keep plain Ulysses over the whole group.

Why the batch order needs no change, and the result is exact and balanced: cut a row into ``2 cp_outer`` big
pieces of ``u`` pieces each (big piece ``P`` = pieces ``P*u .. P*u+u-1``). In the zig-zag order rank ``o*u+j``
holds pieces ``o*u+j`` and ``2cp-1-o*u-j``, so inner group ``o`` holds pieces ``o*u .. o*u+u-1`` (big piece ``o``)
and ``(2cp_outer-1-o)*u .. (2cp_outer-1-o)*u+u-1`` (big piece ``2cp_outer-1-o``): exactly the zig-zag pieces of
outer rank ``o`` of ``cp_outer`` (contiguous order likewise: group ``o`` holds big piece ``o``). The all-to-all
returns them rank-major (member ``j``'s two pieces, then member ``j+1``'s), and one ``index_select``
(``CPShard.gather_index``) puts them in the outer rank's local order (big piece ``o`` in natural order, then
big piece ``2cp_outer-1-o``); the core then runs with ``CPShard(rank=o, size=cp_outer)`` over the outer group,
whose pieces, bottom-right causal blocks, document resets and piece-to-piece state are those of a plain
``cp_outer``-way run. Causal work stays balanced: each outer rank holds a zig-zag pair, and its ``u`` members
split that work by heads. The inner groups must be runs of consecutive CP ranks (``ParallelDims`` builds them
so; ``apply_context_parallel`` checks it): ranks ``u`` apart hold no big piece.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.models.common.attention import CPShard

__all__ = [
    "all_gather_cp",
    "apply_context_parallel",
    "apply_ulysses_cp",
    "head_to_seq_all_to_all",
    "plan_context_parallel",
    "seq_to_head_all_to_all",
    "split_batch_for_cp",
]

logger = logging.getLogger(__name__)

# Generic batch keys laid out [..., B, T] that are split along T.
_SEQ_KEYS = ("input_ids", "labels", "position_ids", "source_ids", "mtp_input_ids", "mtp_labels", "token_mask")


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


# recent torch renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """``x [*s] -> [size, *s]`` over ``group``; backward: each rank gets the SUM of every rank's gradient for its
    own slice (a reduce-scatter; on gloo, which has none, an all-to-all and a sum in rank order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: D102
        size = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty(size * x.shape[0], *x.shape[1:])  # gloo wants the gathered dim flat
        _all_gather_single(out, x, group=group)
        ctx.group = group
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        group = ctx.group
        grad = grad.contiguous()
        if dist.get_backend(group) == "gloo":
            recv = torch.empty_like(grad)
            dist.all_to_all_single(recv, grad, group=group)  # recv[i] = rank i's gradient of my slice
            return recv.sum(0), None
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(out, grad.flatten(0, 1), group=group)
        return out, None


def all_gather_cp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather along a new leading dim (rank order); backward is a reduce-scatter."""
    return _AllGather.apply(x, group)


class _Reorder:
    """Index tensors that put the rank-major output of a Ulysses all-to-all into the order its core wants
    (``index_fn(local_len, device)``) and back, cached per local length and device: natural order for a
    Ulysses core under the balanced order, the outer shard's local order for a hybrid core."""

    def __init__(self, index_fn: Callable[[int, torch.device], torch.Tensor]) -> None:
        self.index_fn, self.cache = index_fn, {}

    def __call__(self, local_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (local_len, str(device))
        if key not in self.cache:
            idx = self.index_fn(local_len, device)
            self.cache[key] = (idx, torch.argsort(idx))
        return self.cache[key]


def _pre_hook(group: dist.ProcessGroup, order: _Reorder | None, inject: CPShard | None = None):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        q, k, v, *rest = args
        t = q.shape[2]
        q, k, v = (seq_to_head_all_to_all(x, group) for x in (q, k, v))
        if order is not None:  # the all-to-all returns rank-major pieces
            nat, _ = order(t, q.device)
            q, k, v = (x.index_select(2, nat) for x in (q, k, v))
        if inject is not None:  # hybrid: the core gathers K/V over the outer group
            kwargs = {**kwargs, "cp": inject}
        return (q, k, v, *rest), kwargs

    return hook


def _post_hook(group: dist.ProcessGroup, order: _Reorder | None):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if order is not None:  # core order -> rank-major before the all-to-all back
            _, inv = order(output.shape[1] // dist.get_world_size(group), output.device)
            output = output.index_select(1, inv)
        return head_to_seq_all_to_all(output, group)

    return hook


def _token_major_seq_to_head(x_BtH: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[B, T/cp, H, *rest]`` -> ``[B, T, H/cp, *rest]`` (token-major layout of ``seq_to_head_all_to_all``)."""
    B, t, H = x_BtH.shape[:3]
    rest = x_BtH.shape[3:]
    x_BHtd = x_BtH.reshape(B, t, H, -1).transpose(1, 2).contiguous()
    y_BHTd = seq_to_head_all_to_all(x_BHtd, group)
    return y_BHTd.transpose(1, 2).reshape(B, y_BHTd.shape[2], y_BHTd.shape[1], *rest)


def _head_split_pre_hook(
    group: dist.ProcessGroup, n_inputs: int, order: _Reorder | None, inject: CPShard | None = None
):
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        local_kwargs = getattr(module, "cp_local_kwargs", None)
        if local_kwargs is not None:  # e.g. the rows of a per-channel weight that belong to this head chunk
            kwargs = local_kwargs(args, kwargs, rank=rank, world=world)
        t = args[0].shape[1]
        split = tuple(_token_major_seq_to_head(x, group) for x in args[:n_inputs])
        if order is not None:
            nat, _ = order(t, split[0].device)
            split = tuple(x.index_select(1, nat) for x in split)
        if inject is not None:  # hybrid: the core passes its state over the outer group
            kwargs = {**kwargs, "cp": inject}
        return (*split, *args[n_inputs:]), kwargs

    return hook


def _inject_shard_hook(shard: CPShard):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "cp": shard}

    return hook


def _attention_heads(parent: nn.Module) -> tuple[int, int]:
    """(query heads, key/value heads) of an attention block, from its config (MLA: one K/V per query head)."""
    cfg = parent.config
    n_heads = cfg.n_heads
    return n_heads, getattr(cfg, "n_kv_heads", n_heads)


_ULYSSES_FLAG = "--parallelism.context_parallel_ulysses_degree"


def plan_context_parallel(
    model: nn.Module, cp: int, *, tp: int = 1, ulysses: int = 1, attention_name: str = "inner_attention"
) -> dict[str, str]:
    """``{core FQN: form}`` for context parallel of degree ``cp`` (hybrid: Ulysses over groups of ``ulysses``
    ranks inside); raises naming the flag to change. Needs no process group (the dry run and tests call it).

    Forms, chosen per core from its heads per tensor-parallel rank (``tp``):
    - ``ulysses``: heads divide by ``cp``: all-to-all to whole sequences with a chunk of heads;
    - ``allgather``: attention whose query or K/V heads do not divide: K/V gathered, local queries kept;
    - ``state_passing``: a linear-attention core (``cp_head_split_inputs``) whose key heads do not divide
      and that accepts a ``cp`` keyword (``cp_state_passing``): recurrent state passed between pieces;
    - ``hybrid_allgather`` / ``hybrid_state_passing`` (``ulysses > 1``, instead of the two above): Ulysses
      over the ``ulysses`` neighbouring ranks, then the K/V all-gather / state passing across the ``cp /
      ulysses`` groups. The heads per tensor-parallel rank must divide by ``ulysses``.
    """
    if ulysses < 1 or cp % ulysses:
        raise ValueError(
            f"{_ULYSSES_FLAG} ({ulysses}) must be >= 1 and divide --parallelism.context_parallel_degree ({cp})"
        )
    plan: dict[str, str] = {}
    named = dict(model.named_modules())
    for fqn, module in named.items():
        parent = named[fqn.rsplit(".", 1)[0]] if "." in fqn else model
        if getattr(module, "cp_head_split_inputs", 0):
            heads = {"key heads": parent.config.num_k_heads // tp}
            beyond = "state_passing" if getattr(module, "cp_state_passing", False) else None
        elif fqn.rsplit(".", 1)[-1] == attention_name:
            heads = dict(zip(("query heads", "key/value heads"), (n // tp for n in _attention_heads(parent))))
            beyond = "allgather"
        else:
            continue
        if all(n % cp == 0 for n in heads.values()):
            plan[fqn] = "ulysses"
            continue
        what = " and ".join(f"{n} {name}" for name, n in heads.items())
        if ulysses > 1:
            if any(n % ulysses for n in heads.values()):
                raise ValueError(
                    f"{fqn}: hybrid context parallel splits the heads over {_ULYSSES_FLAG} {ulysses} ranks, but the "
                    f"core has {what} per tensor-parallel rank: set {_ULYSSES_FLAG} to a common divisor of them "
                    "(1 turns the hybrid off)"
                )
            if beyond is not None and ulysses < cp:
                plan[fqn] = f"hybrid_{beyond}"
                continue
        if beyond is None:
            raise ValueError(
                f"{fqn}: {what} per tensor-parallel rank do not divide into context_parallel_degree {cp} and the "
                "core cannot pass state: set --parallelism.context_parallel_degree to a divisor of "
                f"{heads['key heads']}"
            )
        plan[fqn] = beyond
    if not plan:
        raise ValueError(f"context parallel found no attention core named {attention_name!r} in the model")
    return plan


def _check_hybrid_meshes(cp_mesh: DeviceMesh, inner: DeviceMesh, outer: DeviceMesh) -> None:
    """The inner (Ulysses) groups must be runs of ``u`` consecutive CP ranks and the outer groups strided by
    ``u``: only then do an inner group's pieces form the outer shard's pieces (see the module docstring)."""
    cp_ranks = cp_mesh.mesh.flatten().tolist()
    me = cp_ranks.index(dist.get_rank())
    u = inner.size()
    o, i = divmod(me, u)
    want_inner, want_outer = cp_ranks[o * u : (o + 1) * u], cp_ranks[i::u]
    got_inner, got_outer = inner.mesh.flatten().tolist(), outer.mesh.flatten().tolist()
    if got_inner != want_inner or got_outer != want_outer:
        raise ValueError(
            f"hybrid context parallel needs Ulysses groups of {u} consecutive CP ranks ({want_inner}) and outer "
            f"groups strided by {u} ({want_outer}); got {got_inner} and {got_outer} (build them with ParallelDims)"
        )


def apply_context_parallel(
    model: nn.Module,
    cp_mesh: DeviceMesh,
    *,
    tp: int = 1,
    hybrid: tuple[DeviceMesh, DeviceMesh] | None = None,
    attention_name: str = "inner_attention",
    balanced: bool | None = None,
) -> dict[str, str]:
    """Context parallel on every sequence core of ``model``; return ``{core FQN: form}`` (also logged).

    Forms are chosen per core by ``plan_context_parallel``; ``hybrid = (inner mesh, outer mesh)`` (the
    ``cp_inner`` / ``cp_outer`` meshes of ``ParallelDims``) turns on the hybrid forms.
    The balanced (zig-zag) batch order is used when any core needs the whole-row K/V or state (every form but
    ``ulysses``) and ``balanced`` is not False (a model's own inputs are split piece by piece by its
    ``split_inputs_for_cp``). ``model.cp_shard`` holds the order the batch must be split with (the same for
    the hybrid forms), ``model.cp_plan`` the returned plan.
    """
    group = cp_mesh.get_group()
    cp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    ulysses = hybrid[0].size() if hybrid is not None else 1
    plan = plan_context_parallel(model, cp, tp=tp, ulysses=ulysses, attention_name=attention_name)
    needs_rows = any(form != "ulysses" for form in plan.values())
    if balanced is None:
        balanced = needs_rows
    shard = CPShard(rank=rank, size=cp, balanced=bool(balanced), all_gather=partial(all_gather_cp, group=group))
    order = _Reorder(shard.natural_index) if shard.balanced else None
    inner_group = outer_shard = hybrid_order = None
    if any(form.startswith("hybrid_") for form in plan.values()):
        inner, outer = hybrid
        _check_hybrid_meshes(cp_mesh, inner, outer)
        inner_group, outer_group = inner.get_group(), outer.get_group()
        o = rank // ulysses
        # Inner group o holds the pieces of outer piece(s) P (rank o of cp / ulysses): full pieces P*u .. P*u+u-1
        outer_shard = CPShard(
            rank=o, size=cp // ulysses, balanced=shard.balanced, all_gather=partial(all_gather_cp, group=outer_group)
        )
        members = [o * ulysses + j for j in range(ulysses)]
        pieces = [P * ulysses + j for P in outer_shard.pieces_of(o) for j in range(ulysses)]
        hybrid_order = _Reorder(lambda t, device: shard.gather_index(t, members, pieces, device))
    named = dict(model.named_modules())
    for fqn, form in plan.items():
        module = named[fqn]
        n_inputs = getattr(module, "cp_head_split_inputs", 0)
        if form == "ulysses" or form.startswith("hybrid_"):
            # hybrid: all-to-all inside the inner group, then the core runs on the outer shard
            plain = form == "ulysses"
            a2a, reorder, inject = (group, order, None) if plain else (inner_group, hybrid_order, outer_shard)
            pre = _head_split_pre_hook(a2a, n_inputs, reorder, inject) if n_inputs else _pre_hook(a2a, reorder, inject)
            module.register_forward_pre_hook(pre, with_kwargs=True)
            module.register_forward_hook(_post_hook(a2a, reorder))
        else:
            module.register_forward_pre_hook(_inject_shard_hook(shard), with_kwargs=True)
    model.cp_shard, model.cp_plan = shard, plan
    if rank == 0:
        counts: dict[str, int] = {}
        for form in plan.values():
            counts[form] = counts.get(form, 0) + 1
        forms = ", ".join(f"{n} x {form}" for form, n in sorted(counts.items()))
        levels = f" (hybrid: Ulysses over {ulysses} ranks x {cp // ulysses} groups)" if hybrid_order else ""
        logger.info(
            "context parallel %d%s: %s; batch order %s", cp, levels, forms,
            "balanced (zig-zag pieces r and 2cp-1-r)" if shard.balanced else "contiguous",
        )  # fmt: skip
    return plan


def apply_ulysses_cp(model: nn.Module, cp_mesh: DeviceMesh, *, attention_name: str = "inner_attention") -> int:
    """Ulysses everywhere (every core's heads must divide by the CP degree); return how many cores.

    - An attention core named ``attention_name`` takes ``(q [B, H, T, dqk], k [B, Hk, T, dqk], v [B, Hk, T,
      dv], ...)`` positionally with the global ``AttentionMeta`` as a keyword, and returns ``[B, T, H, dv]``.
    - Any other core declares how to split it (a linear-attention recurrence): ``cp_head_split_inputs`` (a
      class attribute), the number of leading positional inputs laid out token-major ``[B, T, H, ...]`` (each
      may have its own head count), and returns ``[B, T, H, ...]``. An optional method
      ``cp_local_kwargs(args, kwargs, *, rank, world) -> kwargs`` (called with the inputs before the
      all-to-all, all heads) adapts keyword inputs to head chunk ``rank`` of ``world``.

    Hooks, not a wrapper module, so parameter FQNs and the module tree stay unchanged. The batch order is
    contiguous. ``apply_context_parallel`` chooses the form per core instead.
    """
    group = cp_mesh.get_group()
    count = 0
    for fqn, module in model.named_modules():
        n_inputs = getattr(module, "cp_head_split_inputs", 0)
        if n_inputs:
            module.register_forward_pre_hook(_head_split_pre_hook(group, n_inputs, None), with_kwargs=True)
            module.register_forward_hook(_post_hook(group, None))
            count += 1
        elif fqn.rsplit(".", 1)[-1] == attention_name:
            module.register_forward_pre_hook(_pre_hook(group, None), with_kwargs=True)
            module.register_forward_hook(_post_hook(group, None))
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
    balanced: bool = False,
) -> dict[str, Any]:
    """This CP rank's part of a batch: a contiguous chunk of every row, or with ``balanced`` the pieces
    ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` (``CPShard``; use the model's
    ``cp_shard.balanced`` after ``apply_context_parallel``).

    The generic keys ``input_ids``, ``labels``, ``token_mask`` (``[B, T]``) and ``position_ids`` (``[B, T]`` or
    ``[3, B, T]``) are sliced along their last dim; ``cu_seqlens``/``max_seqlen`` stay GLOBAL (the sequence
    cores see or reach whole rows). The model's own inputs (``model_keys``) go through
    ``split_inputs(inputs, ranges=, seqlen=)`` (the model's ``split_inputs_for_cp``; ``ranges`` are this rank's
    pieces in local order); other keys pass through. ``position_ids`` must be in the batch: they cannot be
    rebuilt from a chunk.
    """
    if cp_size == 1:
        return dict(batch)
    if "position_ids" not in batch:
        raise ValueError("context parallel needs `position_ids` in the batch (positions of a chunk are not 0..n)")
    B, T = batch["input_ids"].shape
    multiple = 2 * cp_size if balanced else cp_size
    if T % multiple:
        raise ValueError(
            f"sequence length {T} is not divisible by {'2 x ' if balanced else ''}context_parallel_degree "
            f"{cp_size}: pad batches to a multiple of {multiple} in the packing collate (or change "
            "--parallelism.context_parallel_degree)"
        )
    t = T // cp_size
    shard = CPShard(rank=cp_rank, size=cp_size, balanced=balanced)
    ranges = shard.ranges(t)
    out = dict(batch)
    for key in _SEQ_KEYS:
        if key in batch and batch[key] is not None:
            out[key] = torch.cat([batch[key][..., lo:hi] for lo, hi in ranges], dim=-1)
    inputs = {k: batch[k] for k in model_keys if k in batch}
    if inputs and split_inputs is not None:
        out.update(split_inputs(inputs, ranges=ranges, seqlen=T))
    return out
