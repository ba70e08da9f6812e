"""Who owns the process groups of a run, and how they are destroyed.

A ``DeviceMesh`` creates one process group per axis of every view (``_unflatten``) and flattened axis
(``_flatten``), and its root mesh keeps them all in ``_pg_registry``. ``dist.destroy_process_group()``
does not free them: it only unregisters them and calls ``shutdown()`` (which on gloo stops nothing),
while a gloo group's threads (``gloo_tcp_loop``, two ``pt_gloo_runloop``, plus the store's
``pt_tcpstore_uv``) end only when the last Python reference to the group is dropped. And a mesh
lives on after its run: DTensor caches every mesh it has planned on in process-global caches
(``MeshTopoInfo.build_from_mesh`` is an unbounded ``lru_cache`` keyed by the mesh), and FSDP/DTensor
objects form reference cycles that only a full garbage collection frees. So every group a run's
meshes made survived ``destroy_process_group()`` and the run itself: ~28 threads per FSDP 2 x TP 2
layout on each rank, for as long as the process lived. On NCCL the same groups keep their
communicators (device memory) until the process exits.

The owner of a mesh (``ParallelDims``) therefore releases it explicitly: ``release_mesh`` destroys
every group the mesh made (NCCL frees its communicators now), drops the mesh's references to them,
and clears DTensor's mesh-keyed caches, so no cached mesh keeps a group (or a stale plan) alive.
``track_mesh`` records every root mesh built in this process (weakly), so ``release_tracked_meshes``
can release the meshes of a run whose owner never closed it (a crashed run, a test job).

What is out of reach here: FSDP's parameter groups (and the EP/CP modules) keep the groups they use as
attributes of the model. Those groups are destroyed too, but on gloo their threads run until the model is
freed (a garbage collection, as the model sits in reference cycles).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["clear_dtensor_mesh_caches", "destroy_group", "release_mesh", "release_tracked_meshes", "track_mesh"]

_TRACKED: dict[int, weakref.ref[DeviceMesh]] = {}
"""``id(root mesh) -> weakref``: the root meshes built in this process and not released yet."""


def track_mesh(mesh: DeviceMesh) -> None:
    """Record ``mesh``'s root so that ``release_tracked_meshes`` can release it (a weak reference)."""
    root = mesh._get_root_mesh()
    key = id(root)
    _TRACKED[key] = weakref.ref(root, lambda _ref, key=key: _TRACKED.pop(key, None))


def release_mesh(mesh: DeviceMesh) -> list[str]:
    """Destroy every process group ``mesh``'s root (and all its views) created; return their names.

    The default group is left alone (its creator destroys it), as are groups already destroyed (a
    ``destroy_process_group()`` of the whole world unregisters them; their references are dropped
    here all the same). Afterwards the mesh holds no group: using it again is an error. Every rank
    releases the same groups in the same (reverse creation) order, as NCCL's abort may need.
    """
    root = mesh._get_root_mesh()
    _TRACKED.pop(id(root), None)
    registry = root._pg_registry
    default = dist.distributed_c10d.GroupMember.WORLD if dist.is_initialized() else None
    destroyed: list[str] = []
    for name, group in reversed(list(registry.items())):
        if group is not default and destroy_group(group):
            destroyed.append(name)
    registry.clear()  # the only reference a mesh holds to its groups (get_group() resolves by name)
    clear_dtensor_mesh_caches()
    return destroyed


def release_tracked_meshes() -> list[str]:
    """``release_mesh`` on every root mesh built in this process that is still alive and not released."""
    destroyed: list[str] = []
    for ref in list(_TRACKED.values()):
        root = ref()
        if root is not None:
            destroyed += release_mesh(root)
    _TRACKED.clear()
    clear_dtensor_mesh_caches()
    return destroyed


def clear_dtensor_mesh_caches() -> None:
    """Empty DTensor's process-global caches that hold meshes (as keys or inside cached plans).

    Besides keeping released meshes alive, their entries would be reused by a later mesh of the same
    shape and names (meshes compare equal), handing it plans made on the old mesh. The caches are
    private to torch; one that a torch version lacks is skipped (there is nothing to clear).
    """
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor._api import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    caches = (
        getattr(propagator, "propagate_op_sharding", None),  # per-thread lru_cache of sharding decisions
        getattr(propagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),  # redistribute plans keyed by DTensorSpecs
        getattr(_collective_utils.MeshTopoInfo, "build_from_mesh", None),  # unbounded, keyed by the mesh
    )
    for cache in caches:
        clear = getattr(cache, "cache_clear", None)
        if clear is not None:
            clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)  # values hold the mesh
    if clear_planners is not None:
        clear_planners()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path
    if clear_native is not None:
        clear_native()


def destroy_group(group: dist.ProcessGroup) -> bool:
    """Destroy ``group`` unless it is already destroyed (e.g. by a whole-world destroy); True if it was live.

    On gloo the group's threads end only once its last reference is dropped: its owner drops its own.
    """
    if not (dist.is_initialized() and group in dist.distributed_c10d._world.pg_map):
        return False
    dist.destroy_process_group(group)
    return True
