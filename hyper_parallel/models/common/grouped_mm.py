"""Grouped linear over experts: ``y[rows of e] = x[rows of e] @ w[e]^T`` in one call per projection.

Shape suffixes: S routed rows (sorted by expert), E experts, I input features, O output features.

Two implementations, the same math:

- ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on older torch), one kernel
  for all experts and no host sync. It needs fp32/bf16/fp16 on CPU and bf16 on CUDA (its CUDA kernel
  is bf16-only), every stride and the base address 16-byte aligned (fp32: feature dims divisible by 4;
  bf16: by 8). Its own backward rejects a stride-0 (expanded) output gradient, e.g. the one of
  ``y.sum()``, so the output passes through ``_ContiguousGrad``.
- ``"loop"``: one ``mm`` per expert over ``x.split(counts)``; any dtype/device/alignment, one host sync
  for the counts. Autograd of ``split``/``unbind`` concatenates/stacks the gradients once (slicing
  ``x[a:b]`` instead would allocate a full-size zero gradient per expert).

``"auto"`` picks ``grouped_mm`` whenever it can run and ``loop`` otherwise, with a warning (once per
reason) naming why: fp32 on CUDA, for one, silently cost a per-expert loop before. Forward+backward of the
expert MLP on CPU (2 cores, S=8192 slots, D=256, F=128, E=16, balanced / skewed loads) measured within
noise of each other: fp32 38/45 ms (grouped_mm) vs 41/42 ms (loop); bf16 25/36 vs 26/28 ms. Slicing
``x[a:b]`` per expert took 66 ms (fp32), a padded ``bmm`` 50 ms balanced and 486 ms skewed, so neither
is offered. ``grouped_mm`` wins the tie: no host sync, and it traces into one torch.compile graph.
Under torch.compile the kernel's fake-tensor rule accepts bf16 only, so fp32 runs the loop, outside the
graph (``torch.compiler.disable``).
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["GroupedMMImpl", "can_use_grouped_mm", "grouped_linear", "grouped_mm_blocker"]

GroupedMMImpl = Literal["auto", "grouped_mm", "loop"]

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_ALIGN_BYTES = 16


def grouped_mm_blocker(x_SI: torch.Tensor, w_EOI: torch.Tensor) -> str | None:
    """Why the ``grouped_mm`` kernel cannot take these operands (dtype, device, 16-byte alignment), or None."""
    if _grouped_mm is None:
        return "this torch has no grouped_mm kernel"
    if x_SI.dtype != w_EOI.dtype or x_SI.device != w_EOI.device:
        return f"tokens are {x_SI.dtype} on {x_SI.device} but the weights {w_EOI.dtype} on {w_EOI.device}"
    device = x_SI.device.type
    if device not in ("cpu", "cuda"):
        return f"grouped_mm has no {device} kernel"
    if torch.compiler.is_compiling():
        allowed, where = {torch.bfloat16}, "under torch.compile (its fake-tensor rule)"
    elif device == "cuda":
        allowed, where = {torch.bfloat16}, "on CUDA"
    else:
        allowed, where = {torch.float32, torch.bfloat16, torch.float16}, "on CPU"
    if x_SI.dtype not in allowed:
        names = "/".join(sorted(str(d).removeprefix("torch.") for d in allowed))
        return f"grouped_mm takes {names} only {where}, not {str(x_SI.dtype).removeprefix('torch.')}"
    size = x_SI.element_size()
    # Every non-unit stride of x [S, I] (made contiguous first), of w^T [E, I, O] and of the output
    # [S, O], and both base addresses, must be multiples of 16 bytes.
    strides = (x_SI.shape[-1], w_EOI.shape[1], w_EOI.stride(0), w_EOI.stride(1))
    if w_EOI.stride(-1) != 1 or any((s * size) % _ALIGN_BYTES for s in strides):
        return f"feature dims {x_SI.shape[-1]} -> {w_EOI.shape[1]} are not 16-byte aligned ({size}-byte elements)"
    if torch.compiler.is_compiling():
        return None  # fake tensors have no address; allocator memory is aligned
    if w_EOI.data_ptr() % _ALIGN_BYTES or (x_SI.is_contiguous() and x_SI.data_ptr() % _ALIGN_BYTES):
        return "an operand's base address is not 16-byte aligned"
    return None


def can_use_grouped_mm(x_SI: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    """Whether the ``grouped_mm`` kernel accepts these operands (dtype, device and 16-byte alignment)."""
    return grouped_mm_blocker(x_SI, w_EOI) is None


_warned: set[str] = set()


def _warn_loop_once(reason: str) -> None:
    """Say once per reason that ``auto`` fell back to the per-expert loop: on a GPU it is far slower."""
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(
        f"grouped_linear: {reason}, so the MoE experts run a per-expert loop (one matmul per expert and a "
        "device->host sync per call; on a GPU much slower than the grouped kernel). Compute in bfloat16 "
        "(--training.mixed_precision_param bfloat16) to use the kernel, or set the experts' "
        "grouped_mm_impl='loop' to choose the loop and silence this.",
        stacklevel=3,
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (for ``grouped_mm``'s backward)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: torch.Tensor) -> torch.Tensor:
        # An alias, not ``y`` itself: a custom Function that returns its input makes the output an autograd
        # VIEW of it, and the experts' output being a view makes FSDP2 warn "returned a view tensor" when the
        # experts are an FSDP unit of their own (expert parallel). ``detach`` shares storage and version
        # counter (an in-place op on the output is still seen), with no view and no copy.
        return y.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_y: torch.Tensor) -> torch.Tensor:
        return grad_y.contiguous()


def _grouped_mm_linear(x_SI: torch.Tensor, w_EOI: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    offs_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    y_SO = _grouped_mm(x_SI.contiguous(), w_EOI.transpose(-2, -1), offs=offs_E)
    return _ContiguousGrad.apply(y_SO)


# Outside the graph under torch.compile: traced, its host sync would break the graph and put every
# expert's token count into the guards of the code after it (a recompile whenever the routing changes).
@torch.compiler.disable
def _loop_linear(
    x_SI: torch.Tensor, w_EOI: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, fallback_reason: str | None = None
) -> torch.Tensor:
    if fallback_reason is not None:
        _warn_loop_once(fallback_reason)
    counts = num_tokens_per_expert_E.tolist()  # the one host sync of this path
    return torch.cat([x_e @ w_e.T for x_e, w_e in zip(x_SI.split(counts), w_EOI.unbind(0))])


def grouped_linear(
    x_SI: torch.Tensor,
    w_EOI: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
    impl: GroupedMMImpl = "auto",
) -> torch.Tensor:
    """``y_SO``: rows ``[off_e, off_e + n_e)`` of ``x_SI`` times ``w_EOI[e]^T`` (HF ``[out, in]`` layout).

    ``num_tokens_per_expert_E`` (integer ``[E]``) must sum to ``S``: every row belongs to an expert.
    """
    if w_EOI.dim() != 3 or x_SI.dim() != 2 or x_SI.shape[-1] != w_EOI.shape[-1]:
        raise ValueError(f"grouped_linear: want x [S, I] and w [E, O, I], got {tuple(x_SI.shape)} and {tuple(w_EOI.shape)}")
    if num_tokens_per_expert_E.numel() != w_EOI.shape[0]:
        raise ValueError(
            f"grouped_linear: {num_tokens_per_expert_E.numel()} token counts for {w_EOI.shape[0]} experts"
        )
    if impl == "auto":
        blocker = grouped_mm_blocker(x_SI, w_EOI)
        if blocker is None:
            return _grouped_mm_linear(x_SI, w_EOI, num_tokens_per_expert_E)
        return _loop_linear(x_SI, w_EOI, num_tokens_per_expert_E, fallback_reason=blocker)
    if impl == "grouped_mm":
        blocker = grouped_mm_blocker(x_SI, w_EOI)
        if blocker is not None:
            raise ValueError(
                f"grouped_mm cannot run on x {tuple(x_SI.shape)} / w {tuple(w_EOI.shape)}: {blocker} (it needs "
                "fp32/bf16/fp16 on CPU or bf16 on CUDA and 16-byte aligned feature dims); set the experts' "
                "`grouped_mm_impl` to 'auto' or 'loop'"
            )
        return _grouped_mm_linear(x_SI, w_EOI, num_tokens_per_expert_E)
    if impl == "loop":
        return _loop_linear(x_SI, w_EOI, num_tokens_per_expert_E)
    raise ValueError(f"unknown grouped_mm_impl {impl!r}: use 'auto', 'grouped_mm' or 'loop'")
