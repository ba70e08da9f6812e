"""``VarlenAttention``: the parameter-free core ``softmax(Q K^T * scale + mask) V`` with packed documents.

It is its own child module (``inner_attention``) of every attention block, so context parallel (Ulysses
all-to-all over heads) can wrap or replace it without touching the projections around it.

Shapes: q ``[B, H, T, dqk]``, k ``[B, Hk, T, dqk]``, v ``[B, Hk, T, dv]`` (``H % Hk == 0``; ``dv`` may differ
from ``dqk``) -> out ``[B, T, H, dv]`` (token-major, ready for ``reshape(B, T, -1)`` and the output projection).

Packing: ``AttentionMeta.cu_seqlens`` (int32 ``[D+1]``) are document boundaries over the FLATTENED ``B*T``
token stream; every row boundary must also be a document boundary (documents never cross rows).
Attention is causal inside each document and zero across documents. ``AttentionMeta.cu_seqlens_host``
holds the same boundaries as Python ints (the collate computes them on the host), so no layer has to
copy ``cu_seqlens`` back from the device; without them the first layer does it once per forward.

Kernels (``Config.backend``):
- ``flash``: ``flash_attn_varlen_func`` / ``flash_attn_func`` from the ``flash_attn`` package (import
  guarded; never required). CUDA, fp16/bf16.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch's own flash varlen kernel, a custom op).
  CUDA, fp16/bf16. Unpacked rows go to SDPA, which picks the same flash kernel itself.
- ``sdpa``: ``F.scaled_dot_product_attention`` on 4-D ``[1, H, L, d]`` views, one causal call per
  document (``sum(L_i^2)`` work instead of ``T^2``, no mask memory). 4-D matters: SDPA's fused kernels
  (flash on CPU, flash/mem-efficient on CUDA) take 4-D inputs only, anything else runs the math kernel,
  which is 4x slower on CPU (fwd+bwd, H=4, L=2048, d=48: 0.057 s vs 0.243 s) and keeps ``[H, L, L]``
  scores for backward. One call with a block-diagonal ``[T, T]`` mask measured 2-10x slower.
- ``auto``: ``flash`` when importable and the inputs are CUDA fp16/bf16, else ``varlen`` when torch has
  it and the inputs are CUDA fp16/bf16, else ``sdpa``.

Determinism: under ``torch.use_deterministic_algorithms(True)`` the flash backward runs its
deterministic variant (``flash_attn``: ``deterministic=True``; torch's varlen/SDPA flash backward read the
same global flag themselves).

torch.compile: the per-document SDPA loop runs outside the graph (``torch.compiler.disable``): its
Python loop depends on the boundaries, which would otherwise be baked into the graph and recompile on
every new packing. The varlen kernels are custom ops (torch's ``varlen_attn``; ``flash_attn`` >= 2.6) and
stay in the graph; ``cu_seqlens`` and ``max_seqlen`` turn dynamic after their first change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from hyper_parallel.protocols.module import Module

try:  # optional GPU kernel; the package never requires it
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = flash_attn_varlen_func = None

try:  # recent torch only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch version
    varlen_attn = None

__all__ = ["AttentionMeta", "CPShard", "VarlenAttention", "check_boundaries"]


def _gpu_half(q: torch.Tensor) -> bool:
    """Whether the flash kernels can take ``q``: CUDA fp16/bf16."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


@dataclass(slots=True)
class AttentionMeta:
    """Per-forward attention metadata shared by every layer (built once per micro-batch by the decoder)."""

    cu_seqlens: torch.Tensor | None = None
    """int32 ``[D+1]`` document boundaries over the flattened ``B*T`` stream; None = one causal document per row."""
    max_seqlen: int | None = None
    """Longest document (the varlen kernels need it; derived from the boundaries when None)."""
    cu_seqlens_host: Sequence[int] | None = None
    """The same boundaries as Python ints (the batch's ``cu_seqlens_host``), so no layer syncs with the
    device; when None they are copied from ``cu_seqlens`` once, on first use, and kept here. Only read
    together with ``cu_seqlens`` (which says whether the batch is packed)."""
    token_mask: torch.Tensor | None = None
    """bool ``[B, T]`` (this rank's tokens, as ``position_ids``): True at document tokens, False on the padding run
    (the batch's ``token_mask``). Attention needs none (the padding is its own segment); the decoder layers hand it
    to their MoE, whose router statistics leave padding out. None: every position counts."""
    _checked: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    """``(B, T)`` the boundaries were last validated for (validation runs once per meta, not per layer)."""

    @classmethod
    def from_position_ids(cls, position_ids_BT: torch.Tensor) -> AttentionMeta:
        """A new document starts at every row start and wherever a position is 0 (positions restart per document)."""
        B, T = position_ids_BT.shape
        starts = position_ids_BT == 0
        starts[:, 0] = True
        begin = starts.reshape(-1).nonzero().flatten()
        cu = torch.cat([begin, begin.new_tensor([B * T])]).to(torch.int32)
        host = cu.tolist()
        return cls(cu_seqlens=cu, max_seqlen=max(b - a for a, b in zip(host[:-1], host[1:])), cu_seqlens_host=host)

    def boundaries(self, batch: int, seqlen: int) -> list[int]:
        """The validated host boundaries for a ``[batch, seqlen]`` input (``[0, T, 2T, ...]`` without packing)."""
        if self.cu_seqlens is None:
            return list(range(0, batch * seqlen + 1, seqlen))
        if self.cu_seqlens_host is None:
            self.cu_seqlens_host = self.cu_seqlens.tolist()  # the one device->host copy of this forward
        cu = list(self.cu_seqlens_host)
        if self._checked != (batch, seqlen):
            check_boundaries(cu, batch, seqlen)
            if self.cu_seqlens.numel() != len(cu):
                raise ValueError(
                    f"cu_seqlens ({self.cu_seqlens.numel()} entries) and cu_seqlens_host ({len(cu)}) disagree: "
                    "build both from the same boundaries"
                )
            self._checked = (batch, seqlen)
        return cu

    def longest(self, batch: int, seqlen: int) -> int:
        """``max_seqlen``, or the longest document of the host boundaries when it was not given."""
        if self.max_seqlen is not None:
            return self.max_seqlen
        cu = self.boundaries(batch, seqlen)
        return max(b - a for a, b in zip(cu[:-1], cu[1:]))

    def position_ids(self, batch: int, seqlen: int, device: torch.device | None = None) -> torch.Tensor:
        """int64 ``[B, T]`` positions restarting at 0 for every document (``arange`` per row without packing)."""
        if self.cu_seqlens is None:
            return torch.arange(seqlen, device=device).unsqueeze(0).expand(batch, seqlen)
        cu = self.cu_seqlens.to(device=device, dtype=torch.long)
        if cu.numel() < 2:
            raise ValueError(f"cu_seqlens needs at least 2 entries [0, ..., B*T], got {cu.numel()}")
        idx = torch.arange(batch * seqlen, device=cu.device)
        doc = torch.searchsorted(cu[1:], idx, right=True).clamp_max(cu.numel() - 2)
        return (idx - cu[doc]).view(batch, seqlen)


def check_boundaries(cu: Sequence[int], batch: int, seqlen: int) -> None:
    """Raise unless ``cu`` (document boundaries over the flat ``B*T`` stream) rises strictly from 0 to
    ``B*T`` and includes every row boundary (documents never cross a row)."""
    n = batch * seqlen
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or any(b <= a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(
            f"cu_seqlens must increase strictly from 0 to B*T={n} (B={batch}, T={seqlen}); "
            f"got {list(cu[:4])}...{list(cu[-2:])}"
        )
    missing = sorted(set(range(0, n + 1, seqlen)) - set(cu))
    if missing:
        raise ValueError(
            f"documents must not cross a row: cu_seqlens lacks the row boundaries {missing[:4]} "
            f"(multiples of T={seqlen}); fix the packing collate"
        )


@dataclass(frozen=True, slots=True)
class CPShard:
    """Which tokens of every row this context-parallel rank holds, and how to gather over the CP group.

    A row of ``T`` tokens is cut into ``n_pieces`` equal pieces. Contiguous order: ``size`` pieces, rank ``r``
    holds piece ``r``. Balanced (zig-zag) order: ``2 * size`` pieces, rank ``r`` holds pieces ``r`` and
    ``2 * size - 1 - r`` (in that local order), so every rank holds the same causal work (a query piece near
    the start attends to few keys, its partner near the end to many). Every rank holds ``T / size`` tokens.

    The sequence cores that need more than their own tokens (attention K/V, the DeltaNet recurrent state and
    conv window) get this object as a keyword from the context-parallel hooks (``distributed.context_parallel``);
    ``all_gather`` is that layer's differentiable all-gather over the CP group (its backward sums the
    gradient of every rank's copy back to the owner: a reduce-scatter).
    """

    rank: int
    size: int
    balanced: bool
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    """``x [*s] -> [size, *s]`` (rank order), differentiable; None outside a CP group (tests of the pieces)."""

    @property
    def n_pieces(self) -> int:
        return 2 * self.size if self.balanced else self.size

    def pieces_of(self, rank: int) -> tuple[int, ...]:
        """Global piece indices held by ``rank``, in its local order."""
        return (rank, 2 * self.size - 1 - rank) if self.balanced else (rank,)

    def piece_len(self, local_len: int) -> int:
        n_local = 2 if self.balanced else 1
        if local_len % n_local:
            raise ValueError(
                f"the balanced context-parallel order cuts each rank's {local_len} tokens into 2 pieces: pad "
                f"batches to a multiple of 2 x context_parallel_degree = {2 * self.size}"
            )
        return local_len // n_local

    def ranges(self, local_len: int, rank: int | None = None) -> list[tuple[int, int]]:
        """Global ``[lo, hi)`` of every piece of ``rank`` (default: this one) in a row, in local order."""
        n = self.piece_len(local_len)
        return [(p * n, (p + 1) * n) for p in self.pieces_of(self.rank if rank is None else rank)]

    def natural_index(self, local_len: int, device: torch.device | None = None) -> torch.Tensor:
        """``[T]`` long: for each global position of a row, its index in the rank-major gathered order
        (rank 0's local tokens, then rank 1's, ...)."""
        return self.gather_index(local_len, range(self.size), range(self.n_pieces), device)

    def gather_index(
        self, local_len: int, ranks: Sequence[int], pieces: Sequence[int], device: torch.device | None = None
    ) -> torch.Tensor:
        """Long ``[len(pieces) * piece_len]``: for every token of the global ``pieces`` (in that order), its index
        in the concatenation of the local tokens of ``ranks`` (in that order): the ``index_select`` that puts
        an all-to-all's rank-major output into the order a core wants. Every piece must be held by ``ranks``."""
        n = self.piece_len(local_len)
        start, at = {}, 0
        for r in ranks:
            for p in self.pieces_of(r):
                start[p] = at
                at += n
        missing = [p for p in pieces if p not in start]
        if missing:
            raise ValueError(f"CP ranks {list(ranks)} do not hold the pieces {missing} of {self.n_pieces}")
        return torch.cat([torch.arange(start[p], start[p] + n) for p in pieces]).to(device)


class VarlenAttention(Module):
    """Causal (optionally block-diagonal) scaled-dot-product attention; no parameters."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        backend: Literal["auto", "sdpa", "flash", "varlen"] = "auto"
        """Kernel: `flash` (flash_attn package), `varlen` (torch.nn.attention.varlen), both CUDA fp16/bf16;
        `sdpa` (torch SDPA, one fused call per document); `auto` (flash, else varlen, else sdpa)."""

    def kernel(self, q: torch.Tensor) -> Literal["flash", "varlen", "sdpa"]:
        """The kernel ``forward`` runs for inputs like ``q`` (raises if the configured one cannot run)."""
        backend = self.config.backend
        if backend == "sdpa":
            return "sdpa"
        gpu_half = _gpu_half(q)
        flash_ok = flash_attn_varlen_func is not None and gpu_half
        varlen_ok = varlen_attn is not None and gpu_half
        if backend == "flash" and not flash_ok:
            raise RuntimeError(
                "VarlenAttention.Config.backend='flash' needs the flash_attn package and CUDA fp16/bf16 inputs "
                f"(flash_attn installed: {flash_attn_varlen_func is not None}, device: {q.device}, dtype: {q.dtype}); "
                "use backend='auto' or 'sdpa' (or 'varlen': torch's own flash kernel)"
            )
        if backend == "varlen" and not varlen_ok:
            raise RuntimeError(
                "VarlenAttention.Config.backend='varlen' needs torch.nn.attention.varlen (recent torch) and CUDA "
                f"fp16/bf16 inputs (available: {varlen_attn is not None}, device: {q.device}, dtype: {q.dtype}); "
                "use backend='auto' or 'sdpa'"
            )
        if backend == "flash" or (backend == "auto" and flash_ok):
            return "flash"
        if backend == "varlen" or (backend == "auto" and varlen_ok):
            return "varlen"
        if backend != "auto":
            raise ValueError(f"unknown VarlenAttention backend {backend!r}: use auto, sdpa, flash or varlen")
        return "sdpa"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        meta: AttentionMeta | None = None,
        cp: CPShard | None = None,
    ) -> torch.Tensor:
        """q ``[B, H, T, dqk]``, k ``[B, Hk, T, dqk]``, v ``[B, Hk, T, dv]`` -> ``[B, T, H, dv]``.

        ``cp`` (set by the context-parallel hooks, never by a caller): the inputs are this rank's pieces of
        every row; K/V are all-gathered over the CP group and the local queries attend to them
        (``allgather_attention``)."""
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
        kernel = self.kernel(q)
        if cp is not None:
            return allgather_attention(q, k, v, scale=scale, meta=meta, cp=cp, flash=kernel == "flash")
        # Only `cu_seqlens` is read here: under torch.compile this frame is traced, and reading the host
        # list would guard on its length (a recompile per document count). The kernels read it outside.
        packed = meta is not None and meta.cu_seqlens is not None
        if kernel != "sdpa":
            if packed and not torch.compiler.is_compiling():
                meta.boundaries(q.shape[0], q.shape[2])  # validated once per micro-batch, on the host
            return _varlen_kernel(kernel, q, k, v, scale, meta if packed else None)
        if not packed:
            return _sdpa(q, k, v, scale)
        return _sdpa_packed(q, k, v, scale, meta)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One causal SDPA call per row: ``[B, H, T, d]`` -> ``[B, T, H, dv]``."""
    dv, dqk = v.shape[-1], q.shape[-1]
    if dv < dqk:
        # SDPA's fused kernels need one head dim for q, k and v: with MLA's smaller v they fall back to
        # the math kernel. Zero-padding v and dropping the padded output channels is exact.
        v = F.pad(v, (0, dqk - dv))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)[..., :dv]


@torch.compiler.disable
def _sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, meta: AttentionMeta) -> torch.Tensor:
    """One causal SDPA call per document on 4-D ``[1, H, L, d]`` views (the fused kernels' layout)."""
    B, H, T, dqk = q.shape
    cu = meta.boundaries(B, T)
    if len(cu) == B + 1:  # one document per row: plain batched causal attention
        # contiguous like the concatenation below: under torch.compile the code after this call is
        # specialised on the output's strides, so both branches return the same layout
        return _sdpa(q, k, v, scale).contiguous()
    dv = v.shape[-1]
    if dv < dqk:  # pad once for all documents (see _sdpa)
        v = F.pad(v, (0, dqk - dv))
    gqa = k.shape[1] != H
    outs = []
    for s, e in zip(cu[:-1], cu[1:]):
        b, lo = divmod(s, T)
        hi = e - b * T  # a document never crosses a row (checked), so [lo, hi) lies in row b
        out = F.scaled_dot_product_attention(
            q[b : b + 1, :, lo:hi], k[b : b + 1, :, lo:hi], v[b : b + 1, :, lo:hi],
            is_causal=True, scale=scale, enable_gqa=gqa,
        )  # fmt: skip
        outs.append(out.transpose(1, 2))  # [1, L, H, d]
    # Token-major concatenation [1, B*T, H, d] -> [B, T, H, d] (rows are consecutive in the stream): the
    # one copy, which the caller's reshape(B, T, H * dv) would have made anyway.
    out = torch.cat(outs, dim=1).view(B, T, H, dqk)
    return out if dv == dqk else out[..., :dv].contiguous()


def _varlen_kernel(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, meta: AttentionMeta | None
) -> torch.Tensor:
    """``flash_attn`` or torch ``varlen_attn`` over the flattened ``[B*T, heads, d]`` stream."""
    if kernel == "varlen" and meta is None:
        # unpacked rows: SDPA runs torch's own flash kernel on 4-D CUDA fp16/bf16 inputs (and its backward
        # reads the deterministic flag itself)
        return _sdpa(q, k, v, scale)
    B, H, T, dqk = q.shape
    dv = v.shape[-1]
    if dv < dqk:  # the flash kernels want one head dim for q, k and v: pad v, drop the padding after
        v = F.pad(v, (0, dqk - dv))
    elif dv > dqk:
        raise ValueError(f"{kernel} backend needs v head dim ({dv}) <= qk head dim ({dqk}); use backend='sdpa'")
    # flash_attn's backward is non-deterministic (atomic adds) unless asked; torch's varlen backward
    # reads torch.are_deterministic_algorithms_enabled() itself
    deterministic = torch.are_deterministic_algorithms_enabled()
    if meta is None:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, heads, d]
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, deterministic=deterministic)
        return out[..., :dv]
    cu = meta.cu_seqlens.to(device=q.device, dtype=torch.int32)
    max_seqlen = meta.longest(B, T)
    q, k, v = (x.transpose(1, 2).reshape(B * T, x.shape[1], dqk) for x in (q, k, v))
    if kernel == "flash":
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
            softmax_scale=scale, causal=True, deterministic=deterministic,
        )  # fmt: skip
    else:
        out = varlen_attn(
            q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0), enable_gqa=k.shape[1] != H
        )
    return out.view(B, T, H, dqk)[..., :dv]


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    meta: AttentionMeta | None,
    cp: CPShard,
    flash: bool = False,
) -> torch.Tensor:
    """Context-parallel attention without splitting heads (Llama 3's all-gather form).

    q ``[B, H, t, dqk]``, k ``[B, Hk, t, dqk]``, v ``[B, Hk, t, dv]`` hold this rank's pieces of every row
    (``cp.ranges``); ``meta`` holds the GLOBAL document boundaries over the ``B * t * size`` stream. K and V
    (the small GQA tensors) are gathered whole; each local query piece attends to the keys of its own
    documents up to itself: a causal block aligned bottom-right (a piece that starts inside a document sees
    that document's earlier pieces in full). The gather's backward sums every rank's K/V gradient into
    the owner's (a reduce-scatter), so gradients are exact. Returns ``[B, t, H, dv]``.
    """
    B, H, t, dqk = q.shape
    dv = v.shape[-1]
    T = t * cp.size
    kv = torch.cat([k, v], dim=-1)  # one collective for both
    gathered = cp.all_gather(kv)  # [size, B, Hk, t, dqk + dv], rank-major
    kv = gathered.permute(1, 2, 0, 3, 4).reshape(B, k.shape[1], T, dqk + dv)
    kv = kv.index_select(2, cp.natural_index(t, q.device))  # natural order
    k_all, v_all = kv.split([dqk, dv], dim=-1)
    cu = meta.boundaries(B, T) if meta is not None and meta.cu_seqlens is not None else list(range(0, B * T + 1, T))
    # per (row, local piece): the documents it meets, as (query [lo, hi), key start) in row coordinates
    blocks: list[tuple[int, int, int, int, int]] = []  # (row, local query offset, q_lo, q_hi, k_lo)
    at = 0
    for plo, phi in cp.ranges(t):
        for b in range(B):
            row = b * T  # documents never cross a row (checked by meta.boundaries)
            docs = [(s - row, e - row) for s, e in zip(cu[:-1], cu[1:]) if e > row + plo and s < row + phi]
            for ds, de in docs:
                lo, hi = max(ds, plo), min(de, phi)
                blocks.append((b, at + lo - plo, lo, hi, ds))
        at += phi - plo
    if flash:
        return _allgather_flash(q, k_all, v_all, scale, blocks, t)
    gqa = k_all.shape[1] != H
    outs = []
    for b, off, lo, hi, ds in blocks:
        qb = q[b : b + 1, :, off : off + hi - lo]
        kb, vb = k_all[b : b + 1, :, ds:hi], v_all[b : b + 1, :, ds:hi]
        if lo == ds:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        else:  # queries start inside the document: causal aligned bottom-right
            mask = torch.ones(hi - lo, hi - ds, dtype=torch.bool, device=q.device).tril(lo - ds)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append((b, off, o[0].transpose(0, 1)))  # [L, H, dv]
    return _place(outs, B, t, H, dv)


def _place(outs: list, B: int, t: int, H: int, dv: int) -> torch.Tensor:
    """Blocks ``(row, offset, [L, H, dv])`` covering every local token -> ``[B, t, H, dv]`` (one cat)."""
    order = sorted(range(len(outs)), key=lambda i: (outs[i][0], outs[i][1]))
    flat = torch.cat([outs[i][2] for i in order], dim=0)
    if flat.shape[0] != B * t:
        raise RuntimeError(f"context-parallel attention covered {flat.shape[0]} of {B * t} local tokens")
    return flat.view(B, t, H, dv)


def _allgather_flash(
    q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, scale: float, blocks: list, t: int
) -> torch.Tensor:
    """The blocks of ``allgather_attention`` as ONE ``flash_attn_varlen_func`` call: queries and their key
    spans packed as varlen streams; the kernel's causal mask is aligned bottom-right when a block has more
    keys than queries (flash-attn >= 2.1), which is exactly the block's mask."""
    B, H, _, dqk = q.shape
    dv = v_all.shape[-1]
    order = sorted(blocks, key=lambda x: (x[0], x[1]))
    T = k_all.shape[2]
    dev = q.device
    q_idx = torch.cat([torch.arange(b * t + off, b * t + off + hi - lo, device=dev) for b, off, lo, hi, ds in order])
    k_idx = torch.cat([torch.arange(b * T + ds, b * T + hi, device=dev) for b, off, lo, hi, ds in order])
    cu_q = torch.tensor([0] + [hi - lo for _, _, lo, hi, _ in order], device=dev).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [hi - ds for _, _, lo, hi, ds in order], device=dev).cumsum(0).to(torch.int32)
    qf = q.transpose(1, 2).reshape(B * t, H, dqk).index_select(0, q_idx)
    kf = k_all.transpose(1, 2).reshape(B * T, -1, dqk).index_select(0, k_idx)
    vf = v_all.transpose(1, 2).reshape(B * T, -1, dv).index_select(0, k_idx)
    if dv < dqk:
        vf = F.pad(vf, (0, dqk - dv))
    out = flash_attn_varlen_func(
        qf, kf, vf, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max(hi - lo for _, _, lo, hi, _ in order), max_seqlen_k=max(hi - ds for _, _, _, hi, ds in order),
        softmax_scale=scale, causal=True, deterministic=torch.are_deterministic_algorithms_enabled(),
    )  # fmt: skip
    return out[..., :dv].reshape(B, t, H, dv)
