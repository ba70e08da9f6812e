"""Count the device-to-host syncs a CUDA run would meet, on CPU.

On CPU nothing stalls, so a ``.tolist()`` in a layer costs nothing here and drains the stream on a GPU. The
counter sees what a CUDA run would wait on:

- scalar reads of a device tensor: ``aten._local_scalar_dense`` (``item``, ``bool``, ``int``, ``float``,
  ``__index__``, ``if t:``, f-string formatting) — through a ``TorchDispatchMode``;
- host copies read by Python: ``Tensor.tolist`` / ``cpu`` / ``numpy`` / ``__array__`` of a device tensor. On CPU
  these lower to no aten op at all (``tolist`` reads the storage directly), so a ``TorchFunctionMode`` counts them;
- data-dependent output shapes on device tensors (the host must learn the size): ``nonzero`` (``torch.where(m)``,
  ``argwhere``), ``masked_select``, bool-mask ``index`` / ``index_put_``, ``repeat_interleave`` without
  ``output_size``, ``unique*``, ``bincount``, ``equal``, ``allclose``/``isclose`` reductions read as a bool are
  scalar reads already;
- host data turned into a device tensor while a ``hyper_parallel`` ``forward``/``backward`` is on the stack:
  ``aten.lift_fresh`` / ``lift_fresh_copy`` (``torch.tensor(data, device=...)``, ``x.new_tensor``, list indices)
  and ``host_tensor.to(device)`` / ``.cuda()``.

What is "device" on a CPU run: every tensor is device unless the counter knows it is host. Host tensors are the
ones made by a factory call without a ``device=`` argument (``torch.arange(n)``, ``torch.tensor(list)``), the
results of ``.cpu()`` / ``.numpy()``, ops whose tensor inputs are all host, and whatever the caller marks with
``mark_host`` (e.g. batch fields the trainer keeps on the host). A host tensor moved with ``.to(device)`` becomes
device. Tensors the counter never saw made (parameters, the batch, gradients made by autograd's C++ formulas)
count as device: that is where a CUDA run keeps them.

Usage::

    from tests.torch.sync_counter import SyncCounter

    with SyncCounter() as syncs:
        loss = model(**batch).logits.float().mean()
        loss.backward()
    assert syncs.total == 0, syncs.report()
    syncs.by_site   # {"hyper_parallel/models/common/attention.py:102": 1, ...}
    syncs.per_forward(n_micro_batches)

A site is "file:line" of the innermost ``hyper_parallel`` frame (paths relative to the repository root), else
"<outside hyper_parallel> file:line" of the innermost frame outside torch and this file.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import traceback
from collections import Counter
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["SyncCounter"]

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(_REPO, "hyper_parallel") + os.sep
_THIS = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

_aten = torch.ops.aten

# Ops whose output size depends on device data: the host waits for the device to learn it.
_DATA_DEPENDENT = {
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique.default: "unique",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.bincount.default: "bincount",
    _aten.equal.default: "equal",
    _aten.is_nonzero.default: "is_nonzero",
}
_SCALAR_READS = {_aten._local_scalar_dense.default: "scalar read"}
_LIFT = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
_BOOL_INDEX = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default}
_REPEAT_INTERLEAVE = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}

# Python-level reads that lower to no aten op on CPU (patched on torch.Tensor while a counter is active).
_HOST_READ_METHODS = {"tolist": "tolist", "numpy": "numpy", "__array__": "numpy", "cpu": "cpu"}
_READING = threading.local()
_READING.active = False
# Factory calls: host unless given a device (a CUDA run writes `device=x.device` for device tensors).
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.asarray, torch.arange, torch.range, torch.zeros, torch.ones, torch.empty,
    torch.full, torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.logspace, torch.eye,
    torch.empty_strided, torch.tril_indices, torch.triu_indices, torch.from_numpy,
}
# What the counters learnt is host: a property of the tensor, kept across counters (a tensor made on the host
# under one counter is read under the next one, e.g. the optimizer's step counts).
_HOST = WeakIdKeyDictionary()
_TO_DEVICE = {torch.Tensor.to, torch.Tensor.cuda}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _site() -> tuple[str, bool]:
    """("file:line" of the innermost hyper_parallel frame (or the innermost user frame), whether a
    hyper_parallel forward/backward is on the stack)."""
    frame = sys._getframe(2)
    site = fallback = None
    in_forward = False
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PKG):
            if site is None:
                site = f"{os.path.relpath(path, _REPO)}:{frame.f_lineno}"
            if frame.f_code.co_name in ("forward", "backward"):
                in_forward = True
                break
        elif fallback is None and path != _THIS and not path.startswith(_TORCH) and not path.startswith("<"):
            fallback = f"<outside hyper_parallel> {os.path.relpath(path, _REPO)}:{frame.f_lineno}"
        frame = frame.f_back
    return site or fallback or "<unknown>", in_forward


class _Function(TorchFunctionMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        inputs = _tensors((args, kwargs))
        if func in _FACTORIES:
            to_device = kwargs.get("device") is not None and not _names_host(kwargs["device"])
            if to_device:
                out = func(*args, **kwargs)
            else:
                with c._lifting_host():  # torch.tensor(list) made on the host is not a copy to the device
                    out = func(*args, **kwargs)
            c._mark(out, host=not to_device)
            return out
        if func is torch.Tensor.to and _to_host(args[1:], kwargs):  # `.to("cpu")`: the code means the host
            if c.is_device(args[0]):
                c._record("to cpu")
            out = func(*args, **kwargs)
            if out is args[0]:  # a no-op on CPU, a new host copy on a GPU
                out = out.clone()
            c._mark(out, host=True)
            return out
        if func is torch.Tensor.pin_memory:
            out = func(*args, **kwargs)
            c._mark(out, host=True)
            return out
        if func in _TO_DEVICE and inputs and not c.is_device(inputs[0]):
            out = func(*args, **kwargs)
            target = _to_target(func, args[1:], kwargs)
            if target:
                _, in_forward = _site()
                if in_forward:
                    c._record("host->device copy")
                c._mark(out, host=False)
            else:
                c._mark(out, host=True)
            return out
        if func is torch.Tensor.new_tensor and not c.is_device(args[0]) and kwargs.get("device") is None:
            with c._lifting_host():
                out = func(*args, **kwargs)
            c._mark(out, host=True)
            return out
        out = func(*args, **kwargs)
        if inputs and not any(c.is_device(t) for t in inputs):
            c._mark(out, host=True)
        return out


def _names_host(device: Any) -> bool:
    """A literal ``"cpu"`` names the host (``x.device`` is a ``torch.device``: the run's device, CPU here)."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _to_host(args: tuple, kwargs: dict) -> bool:
    return _names_host(kwargs.get("device")) or any(_names_host(a) for a in args)


def _to_target(func, args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)` / `.cuda()` call names a device (on CPU the run's device is the CPU: any device counts)."""
    if func is torch.Tensor.cuda:
        return True
    if kwargs.get("device") is not None:
        return True
    for a in args:
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            return True
        if isinstance(a, torch.Tensor):
            return True
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        kind = _SCALAR_READS.get(func) or _DATA_DEPENDENT.get(func)
        if kind is not None:
            if any(c.is_device(t) for t in _tensors(args)):
                c._record(kind)
        elif func in _BOOL_INDEX:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype == torch.bool and c.is_device(t) for t in idx):
                c._record("bool-mask " + func.__name__.split(".")[0])
        elif func in _REPEAT_INTERLEAVE:
            if kwargs.get("output_size") is None and c.is_device(args[0]):
                c._record("repeat_interleave without output_size")
        elif func in _LIFT and not c._host_lift:
            _, in_forward = _site()
            if in_forward:
                c._record("host->device tensor (lift_fresh)")
        return func(*args, **kwargs)


class _HostLift:
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def __enter__(self) -> None:
        self.prev = self.counter._host_lift
        self.counter._host_lift = True

    def __exit__(self, *exc) -> None:
        self.counter._host_lift = self.prev


class SyncCounter:
    """Context manager counting device-to-host syncs (see the module docstring)."""

    def __init__(self, *, host: Any = (), stacks: bool = False) -> None:
        self.events: list[tuple[str, str]] = []
        """(site, kind) per counted sync, in order."""
        self.stacks: list[str] | None = [] if stacks else None
        """With ``stacks=True``: the Python stack of every counted sync (to find where a site's read happens)."""
        self._host = _HOST
        self._host_lift = False
        self._modes: list[Any] = []
        self._patched: dict[str, Any] = {}
        self._methods: dict[str, Any] = {}
        self.mark_host(host)

    # -- marking -------------------------------------------------------------------------------------------
    def mark_host(self, tree: Any) -> None:
        """Mark tensors (any pytree of them, e.g. a batch dict) as host tensors: reading them is no sync."""
        self._mark(tree, host=True)

    def mark_device(self, tree: Any) -> None:
        self._mark(tree, host=False)

    def _mark(self, tree: Any, *, host: bool) -> None:
        for t in _tensors(tree):
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)

    def is_device(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter):
            return True
        return t not in self._host

    def _mark_mesh_tensors(self) -> None:
        """DeviceMesh rank tables are host tensors in every run."""
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except ImportError:  # pragma: no cover - torch without distributed
            return
        for obj in gc.get_objects():
            if type(obj) is DeviceMesh:  # no isinstance: some objects warn when asked
                for t in vars(obj).values():  # `.mesh` is computed from `_rank_map` on every call
                    if isinstance(t, torch.Tensor):
                        self._host[t] = True

    def _lifting_host(self) -> _HostLift:
        return _HostLift(self)

    def _record(self, kind: str) -> None:
        site, _ = _site()
        self.events.append((site, kind))
        if self.stacks is not None:
            self.stacks.append("".join(traceback.format_stack(limit=25)[:-3]))

    # -- context manager -----------------------------------------------------------------------------------
    def __enter__(self) -> SyncCounter:
        self._mark_mesh_tensors()
        # Host reads are patched on the Tensor class, not seen through the function mode: torch function modes are
        # not active while autograd runs a backward (an activation-checkpoint recompute, a custom Function's
        # backward), and a read there stalls a GPU just the same.
        self._methods = {name: torch.Tensor.__dict__.get(name) for name in _HOST_READ_METHODS}
        for name, kind in _HOST_READ_METHODS.items():
            setattr(torch.Tensor, name, self._host_read(getattr(torch.Tensor, name), kind))
        # torch.from_numpy / frombuffer bypass the function mode: wrap them so what they make is host
        self._patched = {name: getattr(torch, name) for name in ("from_numpy", "frombuffer")}
        for name, fn in self._patched.items():
            setattr(torch, name, self._host_factory(fn))
        self._modes = [_Function(self), _Dispatch(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []
        for name, fn in self._patched.items():
            setattr(torch, name, fn)
        for name, own in self._methods.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)

    def _host_read(self, method: Any, kind: str) -> Any:
        counter = self

        def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if getattr(_READING, "active", False):  # the function mode hands the call back here: counted once, outside
                return method(t, *args, **kwargs)
            if counter.is_device(t):
                counter._record(kind)
            _READING.active = True
            try:
                with counter._lifting_host():
                    out = method(t, *args, **kwargs)
            finally:
                _READING.active = False
            if out is t:  # `.cpu()` of a CPU tensor is itself; on a GPU it is a new host copy: make it one
                out = t.clone()
            counter._mark(out, host=True)
            return out

        return read

    def _host_factory(self, fn: Any) -> Any:
        def made_on_host(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = fn(*args, **kwargs)
            self._mark(out, host=True)
            return out

        return made_on_host

    # -- results -------------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return len(self.events)

    @property
    def by_site(self) -> dict[str, int]:
        return dict(Counter(site for site, _ in self.events))

    @property
    def by_kind(self) -> dict[str, int]:
        return dict(Counter(kind for _, kind in self.events))

    def per_forward(self, n_forwards: int) -> float:
        """Syncs per forward when the counted region ran ``n_forwards`` forwards."""
        return self.total / max(1, n_forwards)

    def report(self) -> str:
        """One line per site: count, site, kinds (for assertion messages)."""
        kinds: dict[str, Counter] = {}
        for site, kind in self.events:
            kinds.setdefault(site, Counter())[kind] += 1
        lines = [f"{self.total} syncs"]
        for site, n in sorted(self.by_site.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {n:4d}  {site}  ({', '.join(f'{k} x{v}' for k, v in kinds[site].items())})")
        return "\n".join(lines)
