"""Apply the ``ShardingConfig`` a module declares, on one mesh axis (TP, EP ...).

A model's ``sharding.py`` fills ``config.sharding_config`` of its modules; this file turns those
declarations into DTensor parameters and forward hooks, the way torch's ``ParallelStyle``s do
(``ColwiseParallel`` = weight ``Shard(0)``, input ``Replicate``, output ``Shard(-1)``;
``RowwiseParallel`` = weight ``Shard(1)``, input ``Shard(-1)``, output ``Partial`` -> ``Replicate``;
``SequenceParallel`` = weight ``Replicate``, input and output ``Shard(1)``), but from one generic
declaration instead of a hand-written plan per model.

Semantics, per module and per axis:

- ``params``: a module with at least one declared parameter computes on DTensors: every direct
  parameter becomes a DTensor on the axis' mesh (undeclared ones ``Replicate()``), and its declared
  inputs reach ``forward`` as DTensors, unless ``local_forward`` says the forward reads its parameters'
  local shards itself (then inputs arrive local). A module without declared parameters (a container
  such as an attention block or an MLP) receives plain local tensors.
- ``inputs[name]``: how to read the local tensor the caller hands in; ``desired_inputs[name]``: the
  placement the module needs (redistributed on entry: all-gather, slice ...).
- ``outputs``: how to read a local output (a DTensor output already knows); ``desired_outputs``: the
  placement the caller wants (redistributed on exit); ``use_local_output``: hand a plain tensor on.
- ``local_map.in_grad_placements[i]``: how the gradient of the i-th positional input comes back.
  ``Partial`` marks a region whose activation gradients are per-rank contributions (Megatron style):
  a column-wise projection then returns its input gradient unreduced, and the region's entry (an
  attention block, an MLP) reduces once, in the backward of its input redistribution. Replicated
  parameters used inside such a region get per-rank gradient contributions too; ``parallelize``
  FSDP-shards them over a mesh that includes ``tp`` so the SUM reduction completes them.

Names in ``inputs`` are ``forward``'s parameter names; they may be passed positionally or by keyword.
Gradients follow from DTensor autograd: e.g. the backward of an all-gather on entry is a
reduce-scatter of a ``Partial`` gradient.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.protocols.sharding import MeshAxisName, NamedPlacement, ShardingConfig

__all__ = ["apply_sharding_configs", "declared_sharding", "distribute_module_params"]


def _on_axis(named: NamedPlacement | None, axis: MeshAxisName) -> Placement | None:
    if not named:
        return None
    for key, placement in named.items():
        if str(key) == str(axis):
            return placement
    return None


def _normalize(placement: Placement, ndim: int) -> Placement:
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def declared_sharding(module: nn.Module) -> ShardingConfig | None:
    """The module's ``config.sharding_config`` (None for modules without one)."""
    config = getattr(module, "config", None)
    return getattr(config, "sharding_config", None)


def _mentions(sc: ShardingConfig, axis: MeshAxisName) -> bool:
    named = [*sc.params.values(), *sc.inputs.values(), *sc.desired_inputs.values(), sc.outputs, sc.desired_outputs]
    return any(_on_axis(n, axis) is not None for n in named)


def distribute_module_params(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: dict[str, Placement],
    *,
    default: Placement | None = Replicate(),
    shared: dict[int, nn.Parameter] | None = None,
) -> None:
    """Replace the direct parameters of ``module`` by DTensors on 1-D ``mesh``.

    ``placements`` maps parameter name -> placement; others get ``default`` (None leaves them plain).
    Works on meta tensors too (shard-before-materialise). ``shared`` (id of a plain parameter -> its
    DTensor parameter, filled here) keeps a parameter that several modules hold (tied embeddings) ONE
    parameter: the second module receives the DTensor made for the first.
    """
    for name, param in list(module.named_parameters(recurse=False)):
        placement = placements.get(name, default)
        if placement is None or isinstance(param, DTensor):
            continue
        placement = _normalize(placement, param.ndim)
        done = shared.get(id(param)) if shared is not None else None
        if done is not None:
            if tuple(done.placements) != (placement,):
                raise ValueError(
                    f"a parameter shared by several modules (tied weights) is declared {placement} in "
                    f"{type(module).__name__}.{name} but {tuple(done.placements)} elsewhere: declare one placement"
                )
            module.register_parameter(name, done)
            continue
        new = nn.Parameter(distribute_tensor(param.data, mesh, [placement]), requires_grad=param.requires_grad)
        if shared is not None:
            shared[id(param)] = new
        module.register_parameter(name, new)


def _shared_params(model: nn.Module) -> list[list[str]]:
    """FQNs of every parameter registered under more than one name (tied weights), one list per parameter."""
    names: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    return [fqns for fqns in names.values() if len(fqns) > 1]


def _input_binder(module: nn.Module, names: list[str], fqn: str) -> dict[str, int | None]:
    """Input name -> positional index (None: keyword-only)."""
    params = list(inspect.signature(module.forward).parameters.values())
    where: dict[str, int | None] = {}
    for name in names:
        match = [i for i, p in enumerate(params) if p.name == name]
        if not match:
            valid = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            raise ValueError(
                f"sharding_config of {fqn or '<root>'} ({type(module).__name__}) names input {name!r}, but its "
                f"forward takes {valid}: fix the input name in the model's sharding.py"
            )
        p = params[match[0]]
        where[name] = None if p.kind == p.KEYWORD_ONLY else match[0]
    return where


def _convert(
    x: Any,
    mesh: DeviceMesh,
    src: Placement | None,
    dst: Placement | None,
    *,
    local: bool,
    what: Callable[[], str],
    grad: Placement | None = None,
) -> Any:
    """Read ``x`` as ``src``, redistribute to ``dst``; hand on a DTensor, or its local tensor when ``local``.

    ``what`` names the tensor for an error, built only then: under torch.compile a string made from the
    module's FQN on every call would be guarded, and every layer would recompile its block.

    ``grad`` is how the gradient of the handed-on tensor is to be read in backward (``Partial``: every rank
    holds its own contribution, reduced by the backward of the redistribution or by ``from_local``).
    """
    if not isinstance(x, torch.Tensor):
        return x
    if isinstance(x, DTensor):
        dt = x
    elif src is None:
        if dst is None:
            return x
        raise ValueError(f"{what()}: a local tensor arrived but no placement is declared to read it; declare it")
    else:
        src = _normalize(src, x.ndim)
        needs_redistribute = dst is not None and _normalize(dst, x.ndim) != src
        from_local_grad = [grad] if grad is not None and not local and not needs_redistribute else None
        dt = DTensor.from_local(x, mesh, [src], run_check=False, grad_placements=from_local_grad)
    if dst is not None:
        dst = _normalize(dst, dt.ndim)
        if tuple(dt.placements) != (dst,):
            dt = dt.redistribute(mesh, [dst])
    if local:
        return _NotAView.apply(dt.to_local(grad_placements=[grad] if grad is not None else None))
    return dt


class _NotAView(torch.autograd.Function):
    """Identity that hands on an alias of its input, not an autograd view of it.

    ``DTensor.to_local`` returns a view (``view_as``); when the module is an FSDP2 unit of its own (the
    embedding), FSDP2 then warns "returned a view tensor ... can cause wrong gradients" for every tensor
    parallel run. ``detach`` shares storage and version counter, with no view and no copy; the gradient
    passes through unchanged.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _input_grad(sc: ShardingConfig, pos: int | None, axis: MeshAxisName) -> Placement | None:
    """Declared gradient placement of positional input ``pos`` (``local_map.in_grad_placements``)."""
    grads = sc.local_map.in_grad_placements if sc.local_map is not None else None
    if grads is None or pos is None or pos >= len(grads):
        return None
    return _on_axis(grads[pos], axis)


_FQNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Module -> its FQN, for error messages only: a hook never reads its layer's FQN while it runs, since under
torch.compile a per-layer string read in a block's graph is guarded and every layer would recompile the block."""


def _make_pre_hook(
    mesh: DeviceMesh,
    sc: ShardingConfig,
    axis: MeshAxisName,
    binder: dict[str, int | None],
    dtensor_inputs: bool,
) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for name, pos in binder.items():
            src, dst = _on_axis(sc.inputs.get(name), axis), _on_axis(sc.desired_inputs.get(name), axis)
            kw = dict(local=not dtensor_inputs, what=lambda: f"{_FQNS.get(module)} input {name!r}",
                      grad=_input_grad(sc, pos, axis))
            if pos is not None and pos < len(args):
                args[pos] = _convert(args[pos], mesh, src, dst, **kw)
            elif name in kwargs:
                kwargs[name] = _convert(kwargs[name], mesh, src, dst, **kw)
        return tuple(args), kwargs

    return hook


def _make_post_hook(mesh: DeviceMesh, sc: ShardingConfig, axis: MeshAxisName) -> Callable[..., Any]:
    src, dst = _on_axis(sc.outputs, axis), _on_axis(sc.desired_outputs, axis)

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        def one(out: Any) -> Any:
            return _convert(out, mesh, src, dst, local=sc.use_local_output, what=lambda: f"{_FQNS.get(module)} output")

        if isinstance(output, (tuple, list)):
            return type(output)(one(o) for o in output)
        return one(output)

    return hook


def apply_sharding_configs(
    model: nn.Module,
    parallel_dims: ParallelDims,
    axis: MeshAxisName,
    declared: Mapping[str, ShardingConfig] | None = None,
) -> list[str]:
    """Apply the declared ``ShardingConfig`` of ``model``'s modules on ``axis``; return the FQNs touched.

    ``declared`` maps module FQN -> ShardingConfig (``sharding.py``'s result, by ``Config.traverse`` FQN);
    None reads each module's own ``config.sharding_config``. Does nothing when the axis has degree 1.
    Modules whose config does not mention ``axis`` are left alone. Of ``local_map`` only
    ``in_grad_placements`` is read: the gradient placement of each positional input.
    """
    mesh = parallel_dims.mesh(axis)
    if mesh is None:
        return []
    if declared is not None:
        modules = dict(model.named_modules())
        missing = sorted(set(declared) - set(modules))
        if missing:
            raise ValueError(f"sharding configs declared for {missing[:5]}, which are not modules of the model")
    done = []
    tied = _shared_params(model)
    shared: dict[int, nn.Parameter] = {}
    for fqn, module in model.named_modules():
        sc = declared_sharding(module) if declared is None else declared.get(fqn)
        if sc is None or not _mentions(sc, axis):
            continue
        if sc.local_map is not None and (sc.local_map.in_placements or sc.local_map.out_placements):
            raise NotImplementedError(
                f"{fqn}: only local_map.in_grad_placements is applied (use inputs/desired_inputs/outputs for the rest)"
            )
        own = dict(module.named_parameters(recurse=False))
        unknown = sorted(set(sc.params) - set(own))
        if unknown:
            raise ValueError(
                f"sharding_config of {fqn or '<root>'} ({type(module).__name__}) declares parameters {unknown}, "
                f"but the module's own parameters are {sorted(own)}: fix the model's sharding.py"
            )
        placements = {n: p for n, named in sc.params.items() if (p := _on_axis(named, axis)) is not None}
        if placements:
            distribute_module_params(module, mesh, placements, shared=shared)
        dtensor_inputs = bool(placements) and not sc.local_forward
        names = sorted({n for n, v in (*sc.inputs.items(), *sc.desired_inputs.items()) if _on_axis(v, axis)})
        if names:
            binder = _input_binder(module, names, fqn)
            module.register_forward_pre_hook(
                _make_pre_hook(mesh, sc, axis, binder, dtensor_inputs), with_kwargs=True
            )
        if _on_axis(sc.outputs, axis) is not None or _on_axis(sc.desired_outputs, axis) is not None or dtensor_inputs:
            module.register_forward_hook(_make_post_hook(mesh, sc, axis))
        _FQNS[module] = fqn
        done.append(fqn)
    params = dict(model.named_parameters(remove_duplicate=False))
    for fqns in tied:
        if len({id(params[f]) for f in fqns}) != 1:
            raise ValueError(
                f"tied parameters {fqns} got different placements on {axis}: declare the same placement for every "
                "module that holds the shared parameter (or none for all of them)"
            )
    return done
