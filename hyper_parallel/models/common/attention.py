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

torch.compile: the per-document SDPA loop is the custom op ``hyper_parallel::sdpa_packed`` (``packed_sdpa.py``),
fed the boundaries as a host int tensor (``AttentionMeta.cu_seqlens_cpu``): traced, its Python loop would bake
the boundaries into the graph and recompile on every new packing. The varlen kernels are custom ops (torch's ``varlen_attn``; ``flash_attn`` >= 2.6) and
stay in the graph; ``cu_seqlens`` and ``max_seqlen`` turn dynamic after their first change.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from hyper_parallel import torch_features
from hyper_parallel.models.common.packed_sdpa import sdpa_documents, sdpa_packed
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
    cu_seqlens_cpu: torch.Tensor | None = None
    """int32 host tensor of ``cu_seqlens_host`` (made from the host ints in ``__post_init__``, never copied from
    the device): what opaque ops take under ``torch.compile`` (``packed_sdpa.sdpa_packed``), so a compiled
    block's graph sees a dynamic length instead of guarding on a Python list (a recompile per packing)."""
    _checked: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    """``(B, T)`` the boundaries were last validated for (validation runs once per meta, not per layer)."""
    _cp_plan: dict | None = field(default=None, repr=False, compare=False)
    """Context-parallel K/V all-gather plans of this micro-batch (host blocks, device key index), made by the
    first layer and reused by the others (``allgather_attention``)."""

    def __post_init__(self) -> None:
        if self.cu_seqlens_cpu is None and self.cu_seqlens is not None and self.cu_seqlens_host is not None:
            self.cu_seqlens_cpu = torch.tensor(list(self.cu_seqlens_host), dtype=torch.int32)
            if "torch._dynamo" in sys.modules:  # something compiles: its length changes every step, never
                torch._dynamo.maybe_mark_dynamic(self.cu_seqlens_cpu, 0)  # specialise a graph on it
                torch._dynamo.maybe_mark_dynamic(self.cu_seqlens, 0)  # nor on the device copy (S1)

    def host_bounds(self) -> torch.Tensor:
        """``cu_seqlens_cpu``, or (a meta built without host boundaries) ``cu_seqlens`` copied to the host (a sync:
        the fallback of callers that did not pass ``cu_seqlens_host``)."""
        if self.cu_seqlens_cpu is not None:
            return self.cu_seqlens_cpu
        return self.cu_seqlens.to("cpu")

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
            return allgather_attention(q, k, v, scale=scale, meta=meta, cp=cp, kernel=kernel)
        # Only `cu_seqlens` is read here: under torch.compile this frame is traced, and reading the host
        # list would guard on its length (a recompile per document count). The kernels read it outside.
        packed = meta is not None and meta.cu_seqlens is not None
        if kernel != "sdpa":
            if packed and not torch.compiler.is_compiling():
                meta.boundaries(q.shape[0], q.shape[2])  # validated once per micro-batch, on the host
            return _varlen_kernel(kernel, q, k, v, scale, meta if packed else None)
        if not packed:
            return _sdpa(q, k, v, scale)
        if torch.compiler.is_compiling():  # an opaque op: the graph stays whole and unspecialised on the packing
            cu = meta.cu_seqlens_cpu if meta.cu_seqlens_cpu is not None else meta.cu_seqlens
            return sdpa_packed(q, k, v, cu, scale)
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
    return sdpa_documents(q, k, v, scale, meta.boundaries(q.shape[0], q.shape[2]))


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
        out = _torch_varlen_causal(q, k, v, cu, cu, max_seqlen, max_seqlen, scale)
    return out.view(B, T, H, dqk)[..., :dv]


def _torch_varlen_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """torch's ``varlen_attn`` over ``[N, heads, d]`` streams, causal aligned bottom-right (window ``(-1, 0)``, as
    flash's); grouped K/V heads go in as they are, or expanded where this torch has no ``enable_gqa`` (2.11)."""
    H = q.shape[1]
    gqa = k.shape[1] != H
    if gqa and not torch_features.has("varlen_attn.enable_gqa"):
        k, v = (x.repeat_interleave(H // x.shape[1], dim=1, output_size=H) for x in (k, v))
        gqa = False
    extra = {"enable_gqa": True} if gqa else {}
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), **extra)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    meta: AttentionMeta | None,
    cp: CPShard,
    kernel: Literal["flash", "varlen", "sdpa"] = "sdpa",
) -> torch.Tensor:
    """Context-parallel attention without splitting heads (Llama 3's all-gather form).

    q ``[B, H, t, dqk]``, k ``[B, Hk, t, dqk]``, v ``[B, Hk, t, dv]`` hold this rank's pieces of every row
    (``cp.ranges``); ``meta`` holds the GLOBAL document boundaries over the ``B * t * size`` stream. K and V
    (the small GQA tensors) are gathered whole; each local query piece attends to the keys of its own
    documents up to itself: a causal block aligned bottom-right (a piece that starts inside a document sees
    that document's earlier pieces in full). The gather's backward sums every rank's K/V gradient into
    the owner's (a reduce-scatter), so gradients are exact. Returns ``[B, t, H, dv]``.

    The blocks are planned on the host from the boundaries (Python ints, ``_cp_blocks``), and no ``[Lq, Lk]``
    tensor (mask or scores) exists on any kernel:

    - ``flash`` / ``varlen``: ONE varlen call over all blocks (queries and their key spans as streams with
      separate ``cu_seqlens_q`` / ``cu_seqlens_k``); flash's causal mask is aligned bottom-right when a block
      has more keys than queries, which is exactly the block's mask. The key index and boundaries are copied
      to the device once per micro-batch (kept on ``meta``), not per layer.
    - ``sdpa``: one call per block. A block starting a document is a square causal SDPA; one starting inside
      a document is split into its key prefix (every query sees it: no mask) and its diagonal square (causal),
      merged by their log-sum-exps (``_bottom_right_causal``, the ring-attention merge: on CPU through the
      fused flash kernel's ``(out, lse)`` and its backward; on CUDA through torch's lower-right
      ``CausalBias``, which runs the fused kernels without a mask).

    Flex attention would do the same with a block mask, but eager flex materialises the scores on CPU.
    """
    B, H, t, dqk = q.shape
    dv = v.shape[-1]
    T = t * cp.size
    kv = torch.cat([k, v], dim=-1)  # one collective for both
    gathered = cp.all_gather(kv)  # [size, B, Hk, t, dqk + dv], rank-major
    kv = _natural_order(gathered, cp, t)  # [B, Hk, T, dqk + dv]
    k_all, v_all = kv.split([dqk, dv], dim=-1)
    if kernel != "sdpa":
        return _allgather_varlen(kernel, q, k_all, v_all, scale, t, meta, cp)
    return _allgather_sdpa(q, k_all, v_all, scale, t, meta, cp)


def _natural_order(gathered: torch.Tensor, cp: CPShard, t: int) -> torch.Tensor:
    """``[size, B, Hk, t, d]`` (every rank's local pieces, rank-major) -> ``[B, Hk, T, d]`` in row order: one
    concatenation of piece slices whose places are host ints (no index tensor to copy to the device)."""
    n = cp.piece_len(t)
    where = {p: (r, j) for r in range(cp.size) for j, p in enumerate(cp.pieces_of(r))}
    pieces = [gathered[where[p][0], :, :, where[p][1] * n : (where[p][1] + 1) * n] for p in range(cp.n_pieces)]
    return torch.cat(pieces, dim=2)


_Block = tuple[int, int, int, int, int]
"""``(row, local query offset, q_lo, q_hi, k_lo)``: queries ``[q_lo, q_hi)`` of a row (row coordinates), at
``local query offset`` in this rank's tokens of the row, attend to keys ``[k_lo, q_hi)`` of their document."""


def _cp_blocks(meta: AttentionMeta | None, cp: CPShard, B: int, t: int) -> tuple[_Block, ...]:
    """Every (row, local piece, document) block of this rank, in local token order (host ints only)."""
    T = t * cp.size
    key = ("blocks", cp.rank, cp.size, cp.balanced, B, t)
    cached = _meta_cache(meta, key)
    if cached is not None:
        return cached
    packed = meta is not None and meta.cu_seqlens is not None
    cu = meta.boundaries(B, T) if packed else list(range(0, B * T + 1, T))
    blocks: list[_Block] = []
    at = 0
    for plo, phi in cp.ranges(t):
        for b in range(B):
            row = b * T  # documents never cross a row (checked by meta.boundaries)
            for s, e in zip(cu[:-1], cu[1:]):
                if e > row + plo and s < row + phi:
                    ds, de = s - row, e - row
                    lo, hi = max(ds, plo), min(de, phi)
                    blocks.append((b, at + lo - plo, lo, hi, ds))
        at += phi - plo
    blocks.sort(key=lambda x: (x[0], x[1]))  # local token order: block outputs concatenate into [B, t]
    covered = sum(hi - lo for _, _, lo, hi, _ in blocks)
    if covered != B * t:
        raise RuntimeError(f"context-parallel attention blocks cover {covered} of {B * t} local tokens")
    out = tuple(blocks)
    _meta_store(meta, key, out)
    return out


def _meta_cache(meta: AttentionMeta | None, key: tuple):
    """A value planned for this micro-batch by an earlier layer (the meta lives for one forward), or None."""
    if meta is None or meta._cp_plan is None:
        return None
    return meta._cp_plan.get(key)


def _meta_store(meta: AttentionMeta | None, key: tuple, value) -> None:
    if meta is not None:
        if meta._cp_plan is None:
            meta._cp_plan = {}
        meta._cp_plan[key] = value


@torch.compiler.disable
def _allgather_sdpa(
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    scale: float,
    t: int,
    meta: AttentionMeta | None,
    cp: CPShard,
) -> torch.Tensor:
    """One fused SDPA call per block on 4-D ``[1, H, L, d]`` views (outside torch.compile: the loop follows
    the boundaries, which would recompile on every packing)."""
    B, H, _, dqk = q.shape
    blocks = _cp_blocks(meta, cp, B, t)
    dv = v_all.shape[-1]
    d = max(dqk, dv)
    # the fused kernels take one head dim for q, k and v: zero-pad the smaller (exact: zero channels add
    # nothing to the scores, and padded output channels are dropped)
    if dqk < d:
        q, k_all = F.pad(q, (0, d - dqk)), F.pad(k_all, (0, d - dqk))
    if dv < d:
        v_all = F.pad(v_all, (0, d - dv))
    gqa = k_all.shape[1] != H
    outs = []
    for b, off, lo, hi, ds in blocks:
        qb = q[b : b + 1, :, off : off + hi - lo]
        kb, vb = k_all[b : b + 1, :, ds:hi], v_all[b : b + 1, :, ds:hi]
        if lo == ds:  # the block starts its document: a square causal block
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = _bottom_right_causal(qb, kb, vb, scale)
        outs.append(o[0].transpose(0, 1))  # [L, H, d]
    out = torch.cat(outs, dim=0).view(B, t, H, d)  # blocks are in local token order
    return out if dv == d else out[..., :dv]


def _bottom_right_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [1, H, L, d]`` against ``k``/``v`` ``[1, Hk, P + L, d]`` with the causal mask aligned bottom-right
    (query ``i`` sees keys ``0 .. P + i``) -> ``[1, H, L, d]``, without materialising the mask."""
    if q.device.type == "cpu":
        return _BottomRightCausalCPU.apply(q, k, v, scale)
    from torch.nn.attention.bias import causal_lower_right

    if k.shape[1] != q.shape[1]:  # the lower-right bias dispatch takes equal head counts
        rep = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(rep, dim=1, output_size=q.shape[1]) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)


class _BottomRightCausalCPU(torch.autograd.Function):
    """Bottom-right causal attention as two fused CPU flash calls merged by log-sum-exp.

    The key prefix ``[0, P)`` (seen by every query: no mask) and the diagonal square ``[P, P + L)`` (causal,
    top-left = bottom-right for a square) each return ``(out_i, lse_i)``; the merged ``lse`` is their
    ``logaddexp`` and ``out`` their ``exp(lse_i - lse)``-weighted sum. The backward runs the fused backward of
    each part with the MERGED ``out`` and ``lse`` (its softmax probabilities ``exp(s - lse)`` and row term
    ``sum(dout * out)`` are those of the whole block), which is exact, as in ring attention.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: D102
        P = k.shape[2] - q.shape[2]
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = fwd(q, k[:, :, :P], v[:, :, :P], 0.0, False, scale=scale)
        o2, l2 = fwd(q, k[:, :, P:], v[:, :, P:], 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)  # fp32 [1, H, L]
        out = (o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # noqa: D102
        q, k, v, out, lse = ctx.saved_tensors
        P = k.shape[2] - q.shape[2]
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dout = dout.contiguous()
        dq1, dk1, dv1 = bwd(dout, q, k[:, :, :P], v[:, :, :P], out, lse, 0.0, False, scale=ctx.scale)
        dq2, dk2, dv2 = bwd(dout, q, k[:, :, P:], v[:, :, P:], out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2), None


@torch.compiler.disable
def _varlen_plan(
    B: int, t: int, T: int, device: torch.device, meta: AttentionMeta | None, cp: CPShard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(key index [sum of key spans], cu_q, cu_k, max_q, max_k)`` of the blocks' varlen streams, made on the
    host and copied to the device once per micro-batch (the meta keeps it for the later layers)."""
    key = ("varlen", cp.rank, cp.size, cp.balanced, B, t, str(device))
    cached = _meta_cache(meta, key)
    if cached is not None:
        return cached
    blocks = _cp_blocks(meta, cp, B, t)
    q_lens = [hi - lo for _, _, lo, hi, _ in blocks]
    k_lens = [hi - ds for _, _, _, hi, ds in blocks]
    k_idx = torch.cat([torch.arange(b * T + ds, b * T + hi) for b, _, _, hi, ds in blocks])
    cu = torch.zeros(2, len(blocks) + 1, dtype=torch.int64)
    cu[0, 1:] = torch.tensor(q_lens).cumsum(0)
    cu[1, 1:] = torch.tensor(k_lens).cumsum(0)
    host = torch.cat([k_idx, cu.flatten()])
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)  # the one host->device copy of this micro-batch's plan
    n = k_idx.numel()
    cu_dev = dev[n:].view(2, -1).to(torch.int32)
    plan = (dev[:n], cu_dev[0], cu_dev[1], max(q_lens), max(k_lens))
    _meta_store(meta, key, plan)
    return plan


def _allgather_varlen(
    kernel: str,
    q: torch.Tensor,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    scale: float,
    t: int,
    meta: AttentionMeta | None,
    cp: CPShard,
) -> torch.Tensor:
    """The blocks of ``allgather_attention`` as ONE ``flash_attn_varlen_func`` / ``varlen_attn`` call."""
    B, H, _, dqk = q.shape
    dv = v_all.shape[-1]
    T = k_all.shape[2]
    if dv > dqk:
        raise ValueError(f"{kernel} backend needs v head dim ({dv}) <= qk head dim ({dqk}); use backend='sdpa'")
    k_idx, cu_q, cu_k, max_q, max_k = _varlen_plan(B, t, T, q.device, meta, cp)
    # blocks are in local token order, so the query stream is the local tokens as they are
    qf = q.transpose(1, 2).reshape(B * t, H, dqk)
    kf = k_all.transpose(1, 2).reshape(B * T, -1, dqk).index_select(0, k_idx)
    vf = v_all.transpose(1, 2).reshape(B * T, -1, dv).index_select(0, k_idx)
    if dv < dqk:
        vf = F.pad(vf, (0, dqk - dv))
    if kernel == "flash":
        out = flash_attn_varlen_func(
            qf, kf, vf, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            softmax_scale=scale, causal=True, deterministic=torch.are_deterministic_algorithms_enabled(),
        )  # fmt: skip
    else:
        out = _torch_varlen_causal(qf, kf, vf, cu_q, cu_k, max_q, max_k, scale)
    return out[..., :dv].reshape(B, t, H, dv)
