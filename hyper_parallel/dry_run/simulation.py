"""Run a training step of one rank without data, devices or peers: the dispatch mode behind the dry run.

The step runs under ``FakeTensorMode`` (every float tensor is a shape without storage) on a ``fake``
process group (collectives return at once, moving nothing). Two things need more than shapes, and
``SimulationMode`` (a ``TorchDispatchMode`` entered on top of the fake mode) supplies them:

- **Host data.** Integer bookkeeping that a model turns into Python numbers (``.item()``, ``.tolist()``:
  split sizes of a token all-to-all, image placeholder counts, document boundaries) is computed for
  real: an op whose tensor inputs are all real tensors runs for real, and factories of integers or of
  scalars (``arange``, ``zeros(dtype=int64)``, an optimizer's step counter) create real tensors.
  Float tensors stay fake.
- **Routing.** ``topk`` over fake scores returns fake values and real indices that spread the slots
  evenly (token t's k-th choice is ``(t*K + k) mod E``): the estimate assumes perfectly balanced experts.

Collectives on real (host-data) tensors are completed as if every peer held the same data as this
rank (true under balanced routing): an all-to-all hands this rank its own block from every peer, an
all-gather repeats the input. Every collective, fake or real, is logged with its process group and
size in a ``CommLog``. ``grouped_mm`` has a bf16-only fake kernel; fp32 calls take its shape rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CommLog", "CommRecord", "SimulationMode"]

aten = torch.ops.aten
c10d = torch.ops.c10d
_fn = torch.ops._c10d_functional
_fn_ag = torch.ops._c10d_functional_autograd

# op -> (kind, how to find its process group). ``int``: the positional argument holding a boxed
# ProcessGroup (c10d ops); ``str`` ops hold a group name at that position (functional collectives).
_C10D_OPS: dict[Any, tuple[str, int]] = {
    c10d.allgather_.default: ("all_gather", 2),
    c10d._allgather_base_.default: ("all_gather", 2),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 2),
    c10d.reduce_scatter_.default: ("reduce_scatter", 2),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 2),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 2),
    c10d.allreduce_.default: ("all_reduce", 1),
    c10d.alltoall_.default: ("all_to_all", 2),
    c10d.alltoall_base_.default: ("all_to_all", 2),
    c10d.broadcast_.default: ("broadcast", 1),
}
_FUNCTIONAL_OPS: dict[Any, tuple[str, int]] = {
    _fn.all_gather_into_tensor.default: ("all_gather", 2),
    _fn.all_gather_into_tensor_out.default: ("all_gather", 2),
    _fn_ag.all_gather_into_tensor.default: ("all_gather", 2),
    _fn.reduce_scatter_tensor.default: ("reduce_scatter", 3),
    _fn_ag.reduce_scatter_tensor.default: ("reduce_scatter", 3),
    _fn.all_reduce.default: ("all_reduce", 2),
    _fn.all_reduce_.default: ("all_reduce", 2),
    _fn.all_to_all_single.default: ("all_to_all", 3),
    _fn_ag.all_to_all_single.default: ("all_to_all", 3),
    torch.ops._dtensor.shard_dim_alltoall.default: ("all_to_all", 3),
}


@dataclass(slots=True)
class CommRecord:
    """One collective call."""

    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all`` or ``broadcast``."""
    group: str
    """Process-group name (``CommLog.labels`` maps it to mesh axes)."""
    group_size: int
    nbytes: int
    """Size of the collective's buffer: the gathered output of an all-gather, the unreduced input of a
    reduce-scatter, the tensor of an all-reduce or broadcast, the larger of send/receive of an all-to-all."""
    phase: str
    """Label of the step phase it ran in (``CommLog.phase``)."""


@dataclass
class CommLog:
    """Collectives seen by a ``SimulationMode``, tagged with the current ``phase``."""

    records: list[CommRecord] = field(default_factory=list)
    phase: str = ""

    def add(self, record: CommRecord) -> None:
        self.records.append(record)


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _is_real(t: torch.Tensor) -> bool:
    return not isinstance(t, FakeTensor) and t.device.type != "meta"


def _process_group(func: Any, args: tuple) -> ProcessGroup:
    if func in _C10D_OPS:
        return ProcessGroup.unbox(args[_C10D_OPS[func][1]])
    return _resolve_process_group(args[_FUNCTIONAL_OPS[func][1]])


def _is_integral(dtype: torch.dtype | None) -> bool:
    return dtype is not None and not dtype.is_floating_point and not dtype.is_complex


class SimulationMode(TorchDispatchMode):
    """Enter after ``FakeTensorMode(allow_non_fake_inputs=True)`` (and below any memory tracker)."""

    def __init__(self, comm_log: CommLog | None = None) -> None:
        super().__init__()
        self.comm_log = comm_log if comm_log is not None else CommLog()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's signature
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower to local ops, which come back through this mode
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        any_fake = any(isinstance(t, FakeTensor) for t in tensors)
        if func in _C10D_OPS or func in _FUNCTIONAL_OPS:
            return self._collective(func, args, kwargs, tensors)
        if func is aten.topk.default and any_fake:
            return _balanced_topk(func, args, kwargs)
        if func is aten._grouped_mm.default and any_fake and args[0].dtype != torch.bfloat16:
            # The fake kernel accepts bf16 only; the output shape and dtype rule is the same for fp32.
            a, b, *rest = args
            return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **kwargs).to(a.dtype)
        if tensors and all(_is_real(t) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not tensors and isinstance(out, FakeTensor) and (_is_integral(out.dtype) or out.numel() <= 1):
            # a factory of host bookkeeping (integers, scalars such as an optimizer's step counter): make it real
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return out

    def _collective(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        kind = (_C10D_OPS.get(func) or _FUNCTIONAL_OPS[func])[0]
        group = _process_group(func, args)
        real = bool(tensors) and all(_is_real(t) for t in tensors)
        if real:
            with unset_fake_temporarily():
                out = func(*args, **kwargs)  # the fake backend moves nothing: fill in what peers would send
                _complete_symmetric(func, args, out, group)
        else:
            out = func(*args, **kwargs)
        if func in _C10D_OPS:
            # in-place c10d ops: argument 0 holds the outputs (or the in/out tensors), argument 1 the inputs
            moves = kind in ("all_gather", "reduce_scatter", "all_to_all")
            size = max(_nbytes(args[0]), _nbytes(args[1]) if moves else 0)
        else:
            size = max(_nbytes(args[0]), _nbytes(out if not isinstance(out, (tuple, list)) else out[0]))
        self.comm_log.add(CommRecord(kind, group.group_name, group.size(), size, self.comm_log.phase))
        return out


def _balanced_topk(func: Any, args: tuple, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake ``values``; real ``indices`` that give every choice the same share of the rows."""
    values, _ = func(*args, **kwargs)
    x, k = args[0], args[1]
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", -1)) % x.ndim
    with unset_fake_temporarily():
        n = x.shape[dim]
        shape = [s for i, s in enumerate(values.shape) if i != dim] + [k]
        rows = 1
        for s in shape[:-1]:
            rows *= s
        idx = (torch.arange(rows * k, dtype=torch.int64) % n).view(shape).movedim(-1, dim).contiguous()
    return values, idx


def _rows_from_every_peer(x: torch.Tensor, me: int, n: int, splits: list[int] | None) -> torch.Tensor:
    """What an all-to-all delivers to rank ``me`` when every peer sends what this rank sends."""
    if not splits:
        block = x.chunk(n)[me]
    else:
        start = sum(splits[:me])
        block = x[start : start + splits[me]]
    return torch.cat([block] * n)


def _complete_symmetric(func: Any, args: tuple, out: Any, group: ProcessGroup) -> None:
    """Write the outputs of a host-data collective as if every peer held this rank's data."""
    me, n = dist.get_rank(group), group.size()
    handlers: dict[Any, Callable[[], None]] = {
        c10d.alltoall_base_.default: lambda: args[0].copy_(_rows_from_every_peer(args[1], me, n, list(args[4]))),
        c10d._allgather_base_.default: lambda: args[0].copy_(torch.cat([args[1].reshape(-1)] * n).view_as(args[0])),
        _fn.all_to_all_single.default: lambda: out.copy_(_rows_from_every_peer(args[0], me, n, list(args[2]))),
        _fn_ag.all_to_all_single.default: lambda: out.copy_(_rows_from_every_peer(args[0], me, n, list(args[2]))),
        _fn.all_gather_into_tensor.default: lambda: out.copy_(torch.cat([args[0]] * n)),
        _fn.all_reduce.default: lambda: out.copy_(args[0] * n if args[1] == "sum" else args[0]),
    }
    handler = handlers.get(func)
    if handler is None:
        raise NotImplementedError(
            f"the dry run cannot complete {func} on host data (real tensors); it simulates all-to-all, all-gather "
            "and functional all-reduce of integer bookkeeping only"
        )
    handler()
