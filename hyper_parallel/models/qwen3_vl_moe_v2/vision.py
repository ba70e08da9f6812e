"""``VisionTower``: the Qwen3-VL / Qwen3.5 vision encoder (HF ``Qwen3VLMoeVisionModel``, ``Qwen3_5MoeVisionModel``).

Legend: N patches of every image in the batch (concatenated, each image in merge-block order), P values per
patch (``in_channels * temporal_patch_size * patch_size**2``), C tower width, H heads, d = C / H head dim,
m spatial merge size, M = N / m**2 merged tokens, O output width (the text model's hidden size).

    x_NC      = patch_embed(pixel_values_NP) + bilinear(pos_embed, each grid)    # HF's Conv3d, as a Linear
    x_NC      = blocks(x_NC)             # pre-LN; attention bidirectional inside each frame, 2-D rotary
    deep[j]   = deepstack_merger_list[j](x_NC after block deepstack_visual_indexes[j])       # [M, O]
    merged_MO = merger(x_NC)                                                                 # [M, O]

Qwen3-VL(-MoE) has deepstack mergers (features the text model adds after its first layers); Qwen3.5 has
none: one ``VisionTower.Config`` covers both (``deepstack_visual_indexes=[]``).

Names and shapes equal HF's state dict (``patch_embed.proj``, ``pos_embed``, ``blocks.{i}.{norm1, attn.qkv,
attn.proj, norm2, mlp.linear_fc1, mlp.linear_fc2}``, ``merger.*``, ``deepstack_merger_list.{j}.*``) except
``patch_embed.proj.weight``: HF's Conv3d kernel ``[C, in, T, p, p]`` is ours ``[C, P]`` (a view; the
stride equals the kernel, so the convolution is exactly a Linear over flattened patches). A 2-D weight
is what a matrix optimiser (Muon) and FSDP expect. ``hf_to_ours_`` / ``ours_to_hf_`` convert it.

Geometry (HF ``vision_utils``): patch ``i`` of a frame of an image with grid ``(t, h, w)`` sits at row/col
``(r, c)`` decoded from merge-block order ``(h/m, w/m, m, m)``; the learned ``side x side`` position
table is resampled bilinearly with ``align_corners=True`` (edges map to edges) at ``(r, c)``; the rotary
angles are ``[r * inv_freq | c * inv_freq]`` twice over the head dim, applied in fp32.

No block reads the geometry back from the device: :class:`VisionPlan` (grids, frame boundaries, the SDPA
path's frame-length groups) is made on the host from Python ints, and its per-patch tables are copied to the
device once per micro-batch (:class:`VisionGrid`; the VL model's ``host_inputs`` makes both with the batch).
Under torch.compile the SDPA path runs as the custom op ``hyper_parallel::vision_frame_attention`` (host frame
boundaries as a host tensor), so a block compiles once for every image geometry.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.flops import attention_flops, matmul_flops
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.rope import apply_rotary_emb
from hyper_parallel.protocols.module import Module, ModuleList
from hyper_parallel.protocols.param_init import ConstantInit, ParamInit

try:  # optional GPU kernel; the package never requires it
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch version
    varlen_attn = None

__all__ = [
    "BidirectionalAttention",
    "LayerNorm",
    "PatchEmbed",
    "PatchMerger",
    "VisionAttention",
    "VisionBlock",
    "VisionGrid",
    "VisionMLP",
    "VisionPlan",
    "VisionRotaryEmbedding",
    "VisionTower",
    "frame_groups",
    "vision_tower_config",
    "vision_tower_config_from_hf",
    "vision_tower_config_to_hf",
]

Activation = Literal["gelu_pytorch_tanh", "gelu"]
"""HF ``hidden_act`` names: ``gelu_pytorch_tanh`` (tanh approximation) or ``gelu`` (exact erf)."""


def _activate(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if activation == "gelu_pytorch_tanh" else "none")


class LayerNorm(Module):
    """``nn.LayerNorm`` with weight and bias (HF vision blocks and mergers use eps 1e-6)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        eps: float = 1e-6
        """Added to the variance."""
        param_init: ParamInit.Config | None = field(default_factory=lambda: ConstantInit.Config(value=1.0))
        """Weight initialiser (ones; the bias is zeroed)."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.config.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.config.eps}"


class PatchEmbed(Module):
    """HF ``Conv3d(in, C, kernel=stride=(T, p, p))`` over one patch per row, computed as ``proj`` ``[C, P]``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        proj: Linear.Config = field(default_factory=lambda: Linear.Config(bias=True))
        """The patch projection ``[C, P]`` (HF ``patch_embed.proj``, Conv3d kernel flattened as (in, T, p, p))."""

    def __init__(self, config: Config, *, patch_dim: int, dim: int) -> None:
        super().__init__(config)
        self.proj = config.proj.build(in_features=patch_dim, out_features=dim)

    def forward(self, pixel_values_NP: torch.Tensor) -> torch.Tensor:
        # HF casts the pixels to the weight dtype before the convolution.
        return self.proj(pixel_values_NP.to(self.proj.weight.dtype))


class VisionRotaryEmbedding(Module):
    """Axial 2-D rotary tables: angles ``[row * inv_freq | col * inv_freq]``, repeated over the head dim.

    ``inv_freq = 1 / theta**(arange(0, d/2, 2) / (d/2))`` (d/4 frequencies per axis), HF's fp32 expression.
    Parameter-free: ``inv_freq`` is a non-persistent buffer (recomputed by ``init_weights`` after a meta build).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        theta: float = 10000.0
        """Base wavelength (HF vision ``rope_parameters["rope_theta"]``)."""

    def __init__(self, config: Config, *, head_dim: int) -> None:
        super().__init__(config)
        if head_dim % 4:
            raise ValueError(
                f"VisionRotaryEmbedding needs a head dim divisible by 4 (two axes x cos/sin halves), got {head_dim}: "
                "change the vision width or its number of heads"
            )
        self.head_dim = head_dim
        self.register_buffer("inv_freq", self._compute_inv_freq(), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        spatial = self.head_dim // 2
        return 1.0 / (self.config.theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    @torch.no_grad()
    def init_own_weights(self) -> None:
        super().init_own_weights()
        self.inv_freq.copy_(self._compute_inv_freq())

    def forward(self, rows_N: torch.Tensor, cols_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(cos, sin)`` ``[N, d]`` for patch coordinates ``rows_N``, ``cols_N``."""
        inv_freq = self.inv_freq.to(device=rows_N.device, dtype=torch.float)
        angles = torch.cat([rows_N[:, None].float() * inv_freq, cols_N[:, None].float() * inv_freq], dim=-1)
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos(), emb.sin()


def frame_groups(cu_seqlens: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(frame length, frames)`` per distinct frame length of the boundaries ``cu_seqlens``, in order of first
    appearance: the SDPA path runs one batched call per entry, over the patches ``VisionGrid.order`` lists for it."""
    counts: dict[int, int] = {}
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        counts[b - a] = counts.get(b - a, 0) + 1
    return tuple(counts.items())


@dataclass(frozen=True, slots=True, eq=False)
class VisionPlan:
    """The host facts of one micro-batch's images (and video frames): Python ints and host tensors, made once on
    the host (``Qwen3VlMoeModel.host_inputs``, or :meth:`VisionGrid.from_grid_thw` for a direct call), so no layer
    reads the geometry back from the device. The per-patch tables are :meth:`tables`; plans compare by identity."""

    grids: tuple[tuple[int, int, int], ...]
    """``(t, h, w)`` per image (images first, then videos), in patches."""
    merge_size: int
    """m: the spatial merge size the grids were validated for."""
    cu_seqlens: tuple[int, ...]
    """Frame boundaries over the N patches (one attention segment per frame)."""
    max_seqlen: int
    """Patches of the largest frame."""
    groups: tuple[tuple[int, int], ...]
    """``frame_groups(cu_seqlens)``: ``(frame length, frames)`` per distinct length, in the patch ``order``."""
    cu_seqlens_cpu: torch.Tensor
    """int32 ``[F+1]``: ``cu_seqlens`` as a HOST tensor, the compiled SDPA path's custom op reads it (FSDP moves no
    tensor held by a dataclass, so it stays on the host)."""

    @classmethod
    def from_grids(cls, grid_thw: torch.Tensor | Sequence[Sequence[int]], merge_size: int) -> VisionPlan:
        """Validate the grids (positive, ``h`` and ``w`` multiples of ``merge_size``). ``grid_thw`` on the host (a
        device tensor is read back here: one sync, the direct-call path only)."""
        rows_in = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else [list(g) for g in grid_thw]
        grids: list[tuple[int, int, int]] = []
        for i, g in enumerate(rows_in):
            if len(g) != 3:
                raise ValueError(f"grid_thw[{i}] = {g}: each image grid is (t, h, w) in patches")
            t, h, w = (int(v) for v in g)
            if t <= 0 or h <= 0 or w <= 0 or h % merge_size or w % merge_size:
                raise ValueError(
                    f"grid_thw[{i}] = {(t, h, w)}: t, h, w must be positive and h, w multiples of the spatial "
                    f"merge size {merge_size} (the image processor's smart resize guarantees this)"
                )
            grids.append((t, h, w))
        if not grids:
            raise ValueError("grid_thw is empty: give at least one image grid")
        cu = [0]
        for t, h, w in grids:
            base = cu[-1]
            cu.extend(base + h * w * (k + 1) for k in range(t))
        return cls(
            grids=tuple(grids),
            merge_size=merge_size,
            cu_seqlens=tuple(cu),
            max_seqlen=max(h * w for _, h, w in grids),
            groups=frame_groups(cu),
            cu_seqlens_cpu=torch.as_tensor(np.asarray(cu, dtype=np.int32)),
        )

    @property
    def num_patches(self) -> int:
        return self.cu_seqlens[-1]

    def tables(self) -> torch.Tensor:
        """int64 ``[5, N]`` on the host: every patch's row and column inside its frame (decoded from merge-block
        order ``(h/m, w/m, m, m)``), its image's grid height and width, and the patch ``order`` of the SDPA path
        (the patches of the frames of ``groups[0]``'s length, then ``groups[1]``'s, ...)."""
        m = self.merge_size
        parts = []
        for t, h, w in self.grids:
            block, inner = np.divmod(np.arange(h * w), m * m)
            rows = (block // (w // m)) * m + inner // m
            cols = (block % (w // m)) * m + inner % m
            frame = np.stack([rows, cols, np.full(h * w, h), np.full(h * w, w)])
            parts.append(np.tile(frame, (1, t)))  # the frames of one image repeat the same layout
        cu = self.cu_seqlens
        starts: dict[int, list[int]] = {}
        for a, b in zip(cu[:-1], cu[1:]):
            starts.setdefault(b - a, []).append(a)
        order = np.concatenate([np.arange(a, a + n) for n, s in starts.items() for a in s])
        geometry = np.concatenate(parts, axis=1)
        return torch.as_tensor(np.concatenate([geometry, order[None]], axis=0).astype(np.int64))


@dataclass(frozen=True, slots=True)
class VisionGrid:
    """Per-forward geometry of a batch of images on the compute device, shared by every block: the host ``plan``
    and the device tensors made from its tables once per micro-batch (copied from the host, never read back)."""

    plan: VisionPlan
    """The host facts (grids, frame boundaries, SDPA groups)."""
    rows: torch.Tensor
    """int64 ``[N]``: patch row inside its frame."""
    cols: torch.Tensor
    """int64 ``[N]``: patch column inside its frame."""
    heights: torch.Tensor
    """int64 ``[N]``: grid height ``h`` of the patch's image."""
    widths: torch.Tensor
    """int64 ``[N]``: grid width ``w`` of the patch's image."""
    order: torch.Tensor
    """int64 ``[N]``: the patches grouped by frame length (``plan.groups``), for the SDPA path."""
    cu_seqlens: torch.Tensor
    """int32 ``[F+1]`` frame boundaries on the device (the varlen kernels' argument)."""

    @classmethod
    def from_plan(
        cls, plan: VisionPlan, tables: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> VisionGrid:  # fmt: skip
        """The device geometry of ``plan``: ``tables`` (``plan.tables()``) and ``cu_seqlens`` as already copied to
        the device with the batch, else copied here from the host (``non_blocking``, once per micro-batch)."""
        if tables is None:
            tables = plan.tables()
        if cu_seqlens is None:
            cu_seqlens = plan.cu_seqlens_cpu
        if device is not None:
            tables, cu_seqlens = (x.to(device, non_blocking=True) for x in (tables, cu_seqlens))
        rows, cols, heights, widths, order = tables.unbind(0)
        return cls(plan, rows, cols, heights, widths, order, cu_seqlens)

    @classmethod
    def from_grid_thw(cls, grid_thw: torch.Tensor | Sequence[Sequence[int]], merge_size: int,
                      device: torch.device | None = None) -> VisionGrid:  # fmt: skip
        """Validate the grids and decode every patch (see :class:`VisionPlan`), tables on ``device``."""
        return cls.from_plan(VisionPlan.from_grids(grid_thw, merge_size), device=device)

    @property
    def grids(self) -> tuple[tuple[int, int, int], ...]:
        return self.plan.grids

    @property
    def cu_seqlens_host(self) -> tuple[int, ...]:
        return self.plan.cu_seqlens

    @property
    def max_seqlen(self) -> int:
        return self.plan.max_seqlen

    @property
    def num_patches(self) -> int:
        return self.plan.num_patches

    def bilinear_taps(self, side: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices ``[N, 4]`` into a flattened ``side x side`` table and fp32 weights ``[N, 4]``.

        ``F.interpolate(mode="bilinear", align_corners=True)`` from ``side x side`` to each ``h x w``:
        source coordinate ``r * (side - 1) / (h - 1)``, taps clamped at the border.
        """

        def axis(pos: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            src = pos.float() * (side - 1) / (size - 1).clamp(min=1)
            lo = src.floor()
            frac = src - lo
            lo = lo.long().clamp(0, side - 1)
            return lo, (lo + 1).clamp(max=side - 1), frac

        r0, r1, fr = axis(self.rows, self.heights)
        c0, c1, fc = axis(self.cols, self.widths)
        idx = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], dim=-1)
        weights = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], dim=-1)
        return idx, weights


# ---- the SDPA path: one batched SDPA call per distinct frame length -------------------------------------------
# Eager runs `_frame_sdpa` (autograd through SDPA). Under torch.compile the same grouping runs inside the custom op
# `hyper_parallel::vision_frame_attention` (opaque to dynamo): its Python loop depends on the frame lengths, which
# would otherwise be baked into the graph and recompile for every new image geometry. The op takes the host
# boundaries as a host tensor (no sync) and the patch order as a device tensor (made once per micro-batch); its
# backward calls SDPA's own backward kernel with the saved log-sum-exp (CPU: the flash kernel eager SDPA picks too,
# so eager and compiled runs agree bit for bit).


def _frame_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[tuple[int, int]],
                order: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """q, k, v ``[H, N, d]`` -> ``[N, H, d]``: SDPA within each frame, one 4-D call per frame length."""
    H, N, d = q.shape
    if len(groups) == 1:  # every frame has the same size: a view, no gather
        L, S = groups[0]

        def frames(x: torch.Tensor) -> torch.Tensor:
            return x.view(H, S, L, d).transpose(0, 1)

        o = F.scaled_dot_product_attention(frames(q), frames(k), frames(v), scale=scale)  # [S, H, L, d]
        return o.permute(0, 2, 1, 3).reshape(N, H, d)
    out = q.new_empty(N, H, d)
    offset = 0
    for L, S in groups:
        # [S, L] patches of the S frames of this length (host-made order: no index built here)
        idx = order[offset : offset + S * L]
        offset += S * L

        def gather(x: torch.Tensor) -> torch.Tensor:
            return x[:, idx].view(H, S, L, d).transpose(0, 1)

        o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), scale=scale)  # [S, H, L, d]
        out[idx] = o.permute(0, 2, 1, 3).reshape(S * L, H, d)
    return out


def _group_slices(cu_seqlens_cpu: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(frame length L, frames S, offset into order)`` per group, from the HOST boundaries."""
    out, offset = [], 0
    for L, S in frame_groups(cu_seqlens_cpu.tolist()):  # a host tensor: no device sync
        out.append((L, S, offset))
        offset += L * S
    return out


@torch.library.custom_op("hyper_parallel::vision_frame_attention", mutates_args=())
def _frame_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_cpu: torch.Tensor,
                        order: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(out [N, H, d], logsumexp [N, H] fp32)`` of q, k, v ``[H, N, d]`` (the compiled SDPA path)."""
    H, N, d = q.shape
    out = q.new_empty(N, H, d)
    lse = q.new_empty(N, H, dtype=torch.float32)
    for L, S, offset in _group_slices(cu_seqlens_cpu):
        idx = order[offset : offset + S * L]

        def gather(x: torch.Tensor) -> torch.Tensor:
            return x[:, idx].view(H, S, L, d).transpose(0, 1)

        if q.device.type == "cpu":  # the kernel eager SDPA runs on 4-D CPU inputs; it returns the log-sum-exp
            o, m = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                gather(q), gather(k), gather(v), 0.0, False, scale=scale
            )
            lse[idx] = m.permute(0, 2, 1).reshape(S * L, H).float()
        else:  # forward only (see the backward)
            o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), scale=scale)
        out[idx] = o.permute(0, 2, 1, 3).reshape(S * L, H, d)
    return out, lse


@_frame_attention_op.register_fake
def _(q, k, v, cu_seqlens_cpu, order, scale):  # noqa: ANN001, ANN202
    H, N, d = q.shape
    return q.new_empty(N, H, d), q.new_empty(N, H, dtype=torch.float32)


@torch.library.custom_op("hyper_parallel::vision_frame_attention_backward", mutates_args=())
def _frame_attention_backward_op(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor, order: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` ``[H, N, d]``: SDPA's backward kernel per frame length, from the saved output and lse."""
    if q.device.type != "cpu":
        raise NotImplementedError(
            f"the compiled SDPA path of the vision tower trains on CPU only (inputs on {q.device}, {q.dtype}); on a "
            "GPU run the tower in fp16/bf16 (the flash/varlen kernels), or without --compile.fullgraph"
        )
    H, N, d = q.shape
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
    for L, S, offset in _group_slices(cu_seqlens_cpu):
        idx = order[offset : offset + S * L]

        def gather(x: torch.Tensor) -> torch.Tensor:
            return x[:, idx].view(H, S, L, d).transpose(0, 1)

        def rows(x: torch.Tensor) -> torch.Tensor:  # [N, H, ...] patch-major -> [S, H, L, ...]
            return x[idx].view(S, L, H, *x.shape[2:]).transpose(1, 2)

        d_qkv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            rows(grad_out), gather(q), gather(k), gather(v), rows(out), rows(lse).to(torch.float32), 0.0, False,
            scale=scale,
        )  # fmt: skip
        for g, dx in zip(grads, d_qkv):
            g[:, idx] = dx.transpose(0, 1).reshape(H, S * L, d)
    return tuple(grads)


@_frame_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_cpu, order, scale):  # noqa: ANN001, ANN202
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _frame_attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, cu_seqlens_cpu, order, scale = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens_cpu, order)
    ctx.scale = scale
    ctx.mark_non_differentiable(output[1])


def _frame_attention_backward(ctx: Any, grad_out: torch.Tensor, _grad_lse: torch.Tensor) -> tuple[Any, ...]:
    q, k, v, out, lse, cu_seqlens_cpu, order = ctx.saved_tensors
    dq, dk, dv = _frame_attention_backward_op(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens_cpu, order,
                                              ctx.scale)  # fmt: skip
    return dq, dk, dv, None, None, None


_frame_attention_op.register_autograd(_frame_attention_backward, setup_context=_frame_attention_setup)


class BidirectionalAttention(Module):
    """Non-causal ``softmax(q k^T * scale) v`` inside each segment (an image frame), zero across segments.

    Parameter-free. Kernels (``Config.backend``), as ``VarlenAttention``'s but without the causal mask:
    - ``flash``: ``flash_attn_varlen_func(causal=False)`` (CUDA fp16/bf16; import guarded).
    - ``varlen``: torch's ``varlen_attn`` with ``window_size=(-1, -1)`` (no mask; CUDA fp16/bf16, torch >= 2.10).
    - ``sdpa``: one batched 4-D SDPA call per distinct segment length (frames of equal size share a call;
      SDPA's fused kernels take 4-D inputs only); under torch.compile inside a custom op, so a new image
      geometry does not recompile.
    - ``auto``: flash, else varlen, when the inputs are CUDA fp16/bf16; else sdpa.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        backend: Literal["auto", "sdpa", "flash", "varlen"] = "auto"
        """Kernel: ``flash`` (flash_attn), ``varlen`` (torch), ``sdpa``, ``auto`` (the first usable of these)."""

    def _kernel(self, q: torch.Tensor) -> str:
        backend = self.config.backend
        gpu_half = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        usable = {
            "flash": flash_attn_varlen_func is not None and gpu_half,
            "varlen": varlen_attn is not None and gpu_half,
        }
        if backend in usable and not usable[backend]:
            raise RuntimeError(
                f"BidirectionalAttention.Config.backend={backend!r} needs CUDA fp16/bf16 inputs and "
                f"{'the flash_attn package' if backend == 'flash' else 'torch.nn.attention.varlen (torch >= 2.10)'} "
                f"(device: {q.device}, dtype: {q.dtype}); use backend='auto' or 'sdpa'"
            )
        if backend == "auto":
            return next((k for k in ("flash", "varlen") if usable[k]), "sdpa")
        return backend

    def forward(self, q_HNd: torch.Tensor, k_HNd: torch.Tensor, v_HNd: torch.Tensor, *, scale: float,
                grid: VisionGrid) -> torch.Tensor:  # fmt: skip
        """q, k, v ``[H, N, d]`` -> ``[N, H, d]``."""
        kernel = self._kernel(q_HNd)
        if kernel == "sdpa":
            if torch.compiler.is_compiling():  # one graph for every image geometry (see _frame_attention_op)
                return _frame_attention_op(q_HNd, k_HNd, v_HNd, grid.plan.cu_seqlens_cpu, grid.order, scale)[0]
            return _frame_sdpa(q_HNd, k_HNd, v_HNd, grid.plan.groups, grid.order, scale)
        q, k, v = (x.transpose(0, 1).contiguous() for x in (q_HNd, k_HNd, v_HNd))  # [N, H, d]
        cu, longest = grid.cu_seqlens, grid.max_seqlen  # on the device already (made once per micro-batch)
        if kernel == "flash":
            return flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                softmax_scale=scale, causal=False, deterministic=torch.are_deterministic_algorithms_enabled(),
            )  # fmt: skip
        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, -1))


class VisionAttention(Module):
    """Fused-qkv multi-head attention with 2-D rotary, bidirectional per frame (HF ``...VisionAttention``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        n_heads: int
        """Number of heads (HF vision ``num_heads``); the head dim is ``dim / n_heads``."""
        qkv: Linear.Config = field(default_factory=lambda: Linear.Config(bias=True))
        """Fused projection ``[3C, C]``, rows ``[q | k | v]``, each head-major."""
        proj: Linear.Config = field(default_factory=lambda: Linear.Config(bias=True))
        """Output projection ``[C, C]``."""
        attention_core: BidirectionalAttention.Config = field(default_factory=BidirectionalAttention.Config)
        """The softmax core. Not named ``inner_attention``: Ulysses context parallel wraps the text cores by that
        name, while the tower runs whole (all images) on every CP rank."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        if dim % config.n_heads:
            raise ValueError(f"VisionAttention.Config.n_heads={config.n_heads} must divide the vision width {dim}")
        self.head_dim = dim // config.n_heads
        self.qkv = config.qkv.build(in_features=dim, out_features=3 * dim)
        self.proj = config.proj.build(in_features=dim, out_features=dim)
        self.attention_core = config.attention_core.build()

    def forward(self, x_NC: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, grid: VisionGrid) -> torch.Tensor:
        N = x_NC.shape[0]
        q, k, v = self.qkv(x_NC).view(N, 3, -1, self.head_dim).permute(1, 2, 0, 3).unbind(0)  # [H, N, d] each
        # HF rotates in fp32 and casts back (apply_rotary_pos_emb_vision).
        q_rot, k_rot = apply_rotary_emb(q.float()[None], k.float()[None], cos[None], sin[None], layout="half")
        q, k = q_rot[0].to(v.dtype), k_rot[0].to(v.dtype)
        out_NHd = self.attention_core(q, k, v, scale=self.head_dim**-0.5, grid=grid)
        return self.proj(out_NHd.reshape(N, -1))


class VisionMLP(Module):
    """``linear_fc2(act(linear_fc1(x)))`` with biases (HF ``...VisionMLP``; act is tanh GELU)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        hidden_dim: int
        """Intermediate size (HF vision ``intermediate_size``)."""
        activation: Activation = "gelu_pytorch_tanh"
        """HF vision ``hidden_act``."""
        linear_fc1: Linear.Config = field(default_factory=lambda: Linear.Config(bias=True))
        """``[hidden_dim, C]``."""
        linear_fc2: Linear.Config = field(default_factory=lambda: Linear.Config(bias=True))
        """``[C, hidden_dim]``."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        self.linear_fc1 = config.linear_fc1.build(in_features=dim, out_features=config.hidden_dim)
        self.linear_fc2 = config.linear_fc2.build(in_features=config.hidden_dim, out_features=dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(_activate(self.linear_fc1(x), self.config.activation))


class VisionBlock(Module):
    """Pre-LN block: ``x + attn(norm1(x))``, then ``+ mlp(norm2(x))``. The unit of FSDP and checkpointing."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        attn: VisionAttention.Config
        """Attention (heads, projections, kernel)."""
        mlp: VisionMLP.Config
        """MLP (intermediate size, activation)."""
        norm1: LayerNorm.Config = field(default_factory=LayerNorm.Config)
        """Norm before the attention (eps 1e-6)."""
        norm2: LayerNorm.Config = field(default_factory=LayerNorm.Config)
        """Norm before the MLP (eps 1e-6)."""

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        self.norm1 = config.norm1.build(dim=dim)
        self.attn = config.attn.build(dim=dim)
        self.norm2 = config.norm2.build(dim=dim)
        self.mlp = config.mlp.build(dim=dim)

    def forward(self, x_NC: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, grid: VisionGrid) -> torch.Tensor:
        x_NC = x_NC + self.attn(self.norm1(x_NC), cos=cos, sin=sin, grid=grid)
        return x_NC + self.mlp(self.norm2(x_NC))


class PatchMerger(Module):
    """Merge each ``m x m`` block of patches into one token: ``fc2(gelu(fc1(...)))`` ``[M, m*m*C] -> [M, O]``.

    ``postshuffle_norm=False`` (the final merger): ``LayerNorm(C)`` per patch, then concatenate the block.
    ``postshuffle_norm=True`` (deepstack mergers): concatenate, then ``LayerNorm(m*m*C)``. The block's
    ``m*m`` patches are consecutive rows (merge-block order), concatenated in row-major order.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        postshuffle_norm: bool = False
        """Normalise after concatenating the block (deepstack) instead of per patch (final merger)."""
        activation: Activation = "gelu"
        """Activation between the two projections (HF: exact-erf ``nn.GELU()``)."""
        norm: LayerNorm.Config = field(default_factory=LayerNorm.Config)
        """LayerNorm over C (or m*m*C with ``postshuffle_norm``), eps 1e-6."""
        linear_fc1: Linear.Config = field(default_factory=lambda: Linear.Config(bias=True))
        """``[m*m*C, m*m*C]``."""
        linear_fc2: Linear.Config = field(default_factory=lambda: Linear.Config(bias=True))
        """``[O, m*m*C]``."""

    def __init__(self, config: Config, *, dim: int, merge_size: int, out_dim: int) -> None:
        super().__init__(config)
        self.merged_dim = dim * merge_size * merge_size
        self.norm = config.norm.build(dim=self.merged_dim if config.postshuffle_norm else dim)
        self.linear_fc1 = config.linear_fc1.build(in_features=self.merged_dim, out_features=self.merged_dim)
        self.linear_fc2 = config.linear_fc2.build(in_features=self.merged_dim, out_features=out_dim)

    def forward(self, x_NC: torch.Tensor) -> torch.Tensor:
        if self.config.postshuffle_norm:
            x = self.norm(x_NC.reshape(-1, self.merged_dim))
        else:
            x = self.norm(x_NC).reshape(-1, self.merged_dim)
        return self.linear_fc2(_activate(self.linear_fc1(x), self.config.activation))


class VisionTower(Module):
    """Pixels of a batch of images -> merged visual tokens ``[M, O]`` and the deepstack features (see module doc).

    ``build(out_dim=)``: the output width is the text model's hidden size, which the parent knows.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        """Tower width C (HF vision ``hidden_size``)."""
        blocks: list[VisionBlock.Config]
        """One config per block (``blocks.{i}``; HF ``depth`` of them)."""
        patch_size: int = 16
        """Spatial patch size p in pixels (must equal the image processor's)."""
        temporal_patch_size: int = 2
        """Frames per patch T (a still image is repeated T times by the processor)."""
        in_channels: int = 3
        """Image channels."""
        spatial_merge_size: int = 2
        """m: each ``m x m`` block of patches becomes one token."""
        num_position_embeddings: int = 2304
        """Rows of the learned position table, a square ``side x side`` grid (48 x 48)."""
        deepstack_visual_indexes: list[int] = field(default_factory=list)
        """Blocks (0-based) whose output feeds ``deepstack_merger_list[j]`` (Qwen3-VL ``[8, 16, 24]``; Qwen3.5 none)."""
        patch_embed: PatchEmbed.Config = field(default_factory=PatchEmbed.Config)
        """Patch projection ``[C, in * T * p * p]``."""
        pos_embed: Embedding.Config = field(default_factory=Embedding.Config)
        """Learned position table ``[num_position_embeddings, C]``."""
        rotary_pos_emb: VisionRotaryEmbedding.Config = field(default_factory=VisionRotaryEmbedding.Config)
        """2-D rotary over the head dim."""
        merger: PatchMerger.Config = field(default_factory=PatchMerger.Config)
        """Final merger (per-patch LayerNorm)."""
        deepstack_merger_list: list[PatchMerger.Config] = field(default_factory=list)
        """One post-shuffle merger per ``deepstack_visual_indexes`` entry."""

    def __init__(self, config: Config, *, out_dim: int) -> None:
        super().__init__(config)
        c = config
        if not c.blocks:
            raise ValueError("VisionTower.Config.blocks is empty: give at least one VisionBlock.Config")
        self.side = math.isqrt(c.num_position_embeddings)
        if self.side * self.side != c.num_position_embeddings:
            raise ValueError(
                f"VisionTower.Config.num_position_embeddings={c.num_position_embeddings} must be a square "
                "(the learned table is a side x side grid)"
            )
        indexes = list(c.deepstack_visual_indexes)
        if len(indexes) != len(c.deepstack_merger_list):
            raise ValueError(
                f"VisionTower.Config: {len(indexes)} deepstack_visual_indexes but {len(c.deepstack_merger_list)} "
                "deepstack_merger_list entries: give one merger per index"
            )
        if len(set(indexes)) != len(indexes) or any(not 0 <= i < len(c.blocks) for i in indexes):
            raise ValueError(
                f"VisionTower.Config.deepstack_visual_indexes={indexes} must be distinct block indices in "
                f"[0, {len(c.blocks)})"
            )
        self.out_dim = out_dim
        self.patch_dim = c.in_channels * c.temporal_patch_size * c.patch_size * c.patch_size
        self.patch_embed = c.patch_embed.build(patch_dim=self.patch_dim, dim=c.dim)
        self.pos_embed = c.pos_embed.build(num_embeddings=c.num_position_embeddings, embedding_dim=c.dim)
        blocks = [block.build(dim=c.dim) for block in c.blocks]
        head_dims = {block.attn.head_dim for block in blocks}
        if len(head_dims) != 1:
            raise ValueError(f"VisionTower.Config.blocks disagree on the head dim ({sorted(head_dims)}); use one")
        self.rotary_pos_emb = c.rotary_pos_emb.build(head_dim=head_dims.pop())
        self.blocks = ModuleList(blocks)
        merge = dict(dim=c.dim, merge_size=c.spatial_merge_size, out_dim=out_dim)
        self.merger = c.merger.build(**merge)
        self.deepstack_merger_list = ModuleList([m.build(**merge) for m in c.deepstack_merger_list])
        # Block index -> its deepstack merger; features come out in block order (as HF appends them).
        self._deepstack_at = {layer: j for j, layer in enumerate(indexes)}

    def flops(self, grids: Sequence[Sequence[int]]) -> float:
        """Training FLOPs of the tower on images of these ``(t, h, w)`` patch grids (``models/common/flops.py``): the
        patch projection (pixels need no gradient), every block on every patch with attention bidirectional inside
        each frame (``h * w`` patches), the mergers on the merged tokens. Forward only when the tower is frozen."""
        frames = [int(h) * int(w) for t, h, w in grids for _ in range(int(t))]
        n, m = sum(frames), sum(frames) // self.config.spatial_merge_size**2
        backward = any(p.requires_grad for p in self.parameters())
        total = matmul_flops(self.patch_embed, n, input_grad=False, backward=backward)
        for block in self.blocks:
            total += matmul_flops(block, n, backward=backward)
            attn = block.attn
            pairs = attention_flops(frames, heads=attn.config.n_heads, qk_dim=attn.head_dim, v_dim=attn.head_dim,
                                    causal=False)  # fmt: skip
            total += pairs if backward else pairs / 3.0
        for merger in (self.merger, *self.deepstack_merger_list):
            total += matmul_flops(merger, m, backward=backward)
        return total

    def grid(self, grid_thw: torch.Tensor | Sequence[Sequence[int]] | VisionPlan,
             device: torch.device | None = None) -> VisionGrid:  # fmt: skip
        """The per-forward geometry of ``grid_thw`` (``[n_images, 3]``, ``(t, h, w)`` in patches, or a host
        :class:`VisionPlan`), its tables copied to ``device``."""
        if isinstance(grid_thw, VisionPlan):
            return VisionGrid.from_plan(grid_thw, device=device)
        return VisionGrid.from_grid_thw(grid_thw, self.config.spatial_merge_size, device=device)

    def position_embedding(self, grid: VisionGrid, dtype: torch.dtype) -> torch.Tensor:
        """The learned table resampled bilinearly to every grid, in merge-block order: ``[N, C]``.

        At least fp32 math (HF multiplies the gathered rows by fp32 weights), cast to ``dtype`` at the end.
        ``embedding_bag`` sums the 4 weighted taps without materialising ``[N, 4, C]``.
        """
        idx, weights = grid.bilinear_taps(self.side)
        table = self.pos_embed.weight
        math_dtype = torch.promote_types(table.dtype, torch.float32)
        pos = F.embedding_bag(idx, table.to(math_dtype), per_sample_weights=weights.to(math_dtype), mode="sum")
        return pos.to(dtype)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]] | VisionPlan | VisionGrid
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``pixel_values [N, P]``, ``grid_thw [n_images, 3]`` -> ``(merged [N/m^2, O], deepstack features)``.

        ``grid_thw`` may be a prebuilt :class:`VisionGrid` (built once per micro-batch by the parent from its host
        :class:`VisionPlan`: no sync) or a plan; a tensor is read back to the host here (one sync per forward).
        """
        grid = grid_thw if isinstance(grid_thw, VisionGrid) else self.grid(grid_thw, device=pixel_values.device)
        if pixel_values.ndim != 2 or pixel_values.shape != (grid.num_patches, self.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)} but the grids {list(grid.grids)} need "
                f"[{grid.num_patches}, {self.patch_dim}] (sum of t*h*w patches, in_channels*T*p*p values each)"
            )
        x_NC = self.patch_embed(pixel_values)
        x_NC = x_NC + self.position_embedding(grid, x_NC.dtype)
        cos, sin = self.rotary_pos_emb(grid.rows, grid.cols)
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x_NC = block(x_NC, cos=cos, sin=sin, grid=grid)
            j = self._deepstack_at.get(i)
            if j is not None:
                deepstack.append(self.deepstack_merger_list[j](x_NC))
        return self.merger(x_NC), deepstack

    # --- HF state dict (the only difference is the patch projection's shape) ----------------------------

    def hf_patch_kernel_shape(self) -> tuple[int, int, int, int, int]:
        """HF's Conv3d kernel shape ``[C, in, T, p, p]`` of ``patch_embed.proj.weight``."""
        c = self.config
        return (c.dim, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)

    def hf_to_ours_(self, state: MutableMapping[str, Any], prefix: str = "") -> MutableMapping[str, Any]:
        """In place: reshape HF's ``{prefix}patch_embed.proj.weight`` Conv3d kernel to our ``[C, P]``."""
        key = f"{prefix}patch_embed.proj.weight"
        if key in state:
            w = state[key]
            if tuple(w.shape) != self.hf_patch_kernel_shape():
                raise ValueError(f"{key}: HF Conv3d kernel shape {tuple(w.shape)} != {self.hf_patch_kernel_shape()}")
            state[key] = w.reshape(w.shape[0], -1)
        return state

    def ours_to_hf_(self, state: MutableMapping[str, Any], prefix: str = "") -> MutableMapping[str, Any]:
        """In place: reshape our ``{prefix}patch_embed.proj.weight`` ``[C, P]`` to HF's Conv3d kernel."""
        key = f"{prefix}patch_embed.proj.weight"
        if key in state:
            state[key] = state[key].reshape(self.hf_patch_kernel_shape())
        return state


def vision_tower_config(
    *,
    depth: int,
    dim: int,
    n_heads: int,
    intermediate_size: int,
    patch_size: int = 16,
    temporal_patch_size: int = 2,
    in_channels: int = 3,
    spatial_merge_size: int = 2,
    num_position_embeddings: int = 2304,
    deepstack_visual_indexes: Sequence[int] = (),
    hidden_act: Activation = "gelu_pytorch_tanh",
    rope_theta: float = 10000.0,
    backend: Literal["auto", "sdpa", "flash", "varlen"] = "auto",
) -> VisionTower.Config:
    """The config tree of a Qwen3-VL / Qwen3.5 vision tower from HF-style hyper-parameters."""
    block = VisionBlock.Config(
        attn=VisionAttention.Config(n_heads=n_heads, attention_core=BidirectionalAttention.Config(backend=backend)),
        mlp=VisionMLP.Config(hidden_dim=intermediate_size, activation=hidden_act),
    )
    return VisionTower.Config(
        dim=dim,
        blocks=[copy.deepcopy(block) for _ in range(depth)],
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        in_channels=in_channels,
        spatial_merge_size=spatial_merge_size,
        num_position_embeddings=num_position_embeddings,
        deepstack_visual_indexes=list(deepstack_visual_indexes),
        rotary_pos_emb=VisionRotaryEmbedding.Config(theta=rope_theta),
        merger=PatchMerger.Config(postshuffle_norm=False),
        deepstack_merger_list=[PatchMerger.Config(postshuffle_norm=True) for _ in deepstack_visual_indexes],
    )


def vision_tower_config_from_hf(vision_config: Mapping[str, Any], **overrides: Any) -> tuple[VisionTower.Config, int]:
    """``(config, out_hidden_size)`` from an HF ``vision_config`` dict (Qwen3-VL(-MoE) or Qwen3.5(-MoE))."""
    v = dict(vision_config)
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}: only 'axial' is supported")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"vision_config.hidden_act={act!r}: supported are 'gelu_pytorch_tanh' and 'gelu'")
    kwargs: dict[str, Any] = dict(
        depth=v["depth"],
        dim=v["hidden_size"],
        n_heads=v["num_heads"],
        intermediate_size=v["intermediate_size"],
        patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        in_channels=v.get("in_channels", 3),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        num_position_embeddings=v.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes") or ()),
        hidden_act=act,
        rope_theta=rope.get("rope_theta", v.get("rope_theta", 10000.0)),
    )
    kwargs.update(overrides)
    return vision_tower_config(**kwargs), int(v["out_hidden_size"])


def vision_tower_config_to_hf(config: VisionTower.Config, out_hidden_size: int) -> dict[str, Any]:
    """The HF ``vision_config`` dict of ``config`` (the inverse of :func:`vision_tower_config_from_hf`).

    HF describes every block with one set of hyper-parameters: the blocks must agree.
    """
    shapes = {(b.attn.n_heads, b.mlp.hidden_dim, b.mlp.activation) for b in config.blocks}
    if len(shapes) != 1:
        raise ValueError(f"VisionTower.Config.blocks differ in (n_heads, hidden_dim, activation): {sorted(shapes)}")
    n_heads, hidden_dim, activation = shapes.pop()
    out: dict[str, Any] = dict(
        depth=len(config.blocks),
        hidden_size=config.dim,
        hidden_act=activation,
        intermediate_size=hidden_dim,
        num_heads=n_heads,
        in_channels=config.in_channels,
        patch_size=config.patch_size,
        spatial_merge_size=config.spatial_merge_size,
        temporal_patch_size=config.temporal_patch_size,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=config.num_position_embeddings,
        rope_parameters={"rope_theta": config.rotary_pos_emb.theta, "rope_type": "axial"},
    )
    if config.deepstack_visual_indexes:  # Qwen3.5 vision configs have no such key
        out["deepstack_visual_indexes"] = list(config.deepstack_visual_indexes)
    return out
