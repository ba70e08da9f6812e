"""HF safetensors folders read and written per rank: no rank ever holds the whole model.

Reading. ``HFFolder.open(path)`` checks the folder (the index, every file's header; errors name the file)
and offers each stored tensor as an :class:`HFTensor`: a lazy reference with a shape and a dtype. An
adapter converts them with the tensor operations its mapping needs (``stack``, ``cat``, ``permute_rows``
below, ``.transpose``, ``.reshape``): that builds a lazy expression of each of our tensors, nothing is
read. ``load_tensor_(dst, src)`` then reads only the box of ``src`` that ``dst``'s local shard covers (a
DTensor's box follows from its placements: FSDP rows, TP rows or columns, an expert-parallel rank's
experts), through safetensors' ``get_slice``, which reads those bytes only. Each read opens its file
and closes it right after: safetensors maps the file, and the mapped pages a read touches count in the
process's RSS for as long as the mapping lives. A block-FP8 release's weights are lazy tensors of the same kind
(``hf.quant.BlockDequantized``): a box reads its FP8 slice and the scale blocks covering it, and is computed in
the destination's dtype (``read(box, dtype=)``).

Writing. ``save_converted(sources, convert, path)`` writes sharded safetensors plus the index from our
(possibly sharded) tensors, converting one tensor at a time: it plans every file from shapes alone
(``convert`` on meta tensors), gives the files to the ranks round-robin, and sends each tensor to the rank(s)
writing its file(s) only (``shard_gather.gather_many``: each shard once, point to point). It goes in rounds in
which every rank assembles the next tensor of its own files, so the ranks receive and convert at the same time
while each holds one gathered tensor; the owner keeps the converted tensors it needs and writes the file as
soon as it is complete. One process (no DTensor) writes every file. Either way the files are the same bytes.
"""

from __future__ import annotations

import json
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.hf.shard_gather import gather_many

__all__ = [
    "SAFE_INDEX",
    "SAFE_SINGLE",
    "HFCheckpointError",
    "HFFolder",
    "HFTensor",
    "cat",
    "equal",
    "load_tensor_",
    "local_box",
    "pack_files",
    "permute_rows",
    "parse_size",
    "read_safetensors",
    "save_converted",
    "whole_model_view",
    "stack",
    "write_safetensors",
    "writes_once",
]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

Box = tuple[slice, ...]
"""One ``start:stop`` slice (step 1) per dimension."""

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class HFCheckpointError(ValueError):
    """A file of an HF folder is missing, truncated, not safetensors, or disagrees with its index."""


def _full_box(shape: Sequence[int]) -> Box:
    return tuple(slice(0, n) for n in shape)


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


# ---- lazy tensors ------------------------------------------------------------------------------


class HFTensor:
    """A tensor of an HF folder, or a conversion of such tensors, read only where asked.

    Offers what adapters use on tensors: ``shape``, ``dtype``, ``ndim``, ``transpose``, ``reshape``; the
    module functions ``stack``, ``cat`` and ``permute_rows`` combine them.
    """

    shape: torch.Size
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def location(self) -> str:
        """The file(s) the tensor is read from (for error messages)."""
        raise NotImplementedError

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        """Copy the ``box`` of this tensor into ``out`` (of the box's shape; any dtype: copy_ casts)."""
        raise NotImplementedError

    def read(self, box: Box | None = None, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``box`` (default: everything) as a new tensor of ``dtype`` (default: this tensor's dtype; a
        dequantized FP8 weight is computed in the dtype asked for, not rounded through its own first)."""
        box = _full_box(self.shape) if box is None else box
        out = torch.empty(_box_shape(box), dtype=self.dtype if dtype is None else dtype)
        if out.numel():
            self.read_into(out, box)
        return out

    def transpose(self, dim0: int, dim1: int) -> HFTensor:
        return _Transposed(self, dim0 % self.ndim, dim1 % self.ndim)

    def reshape(self, *shape: int | Sequence[int]) -> HFTensor:
        dims = list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else list(shape)
        if -1 in dims:
            known = 1
            for d in dims:
                known *= d if d != -1 else 1
            dims[dims.index(-1)] = self.numel() // max(known, 1)
        return _Reshaped(self, torch.Size(dims))

    view = reshape

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype}, from {self.location})"


class StoredTensor(HFTensor):
    """One tensor of one safetensors file."""

    def __init__(self, file: Path, key: str, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.file, self.key = file, key
        self.shape, self.dtype = torch.Size(shape), dtype

    @property
    def location(self) -> str:
        return str(self.file)

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        try:
            with safe_open(str(self.file), framework="pt") as f:
                if not self.shape:
                    out.copy_(f.get_tensor(self.key))
                else:
                    # a view of the mapped file: copied out at once, so the mapping dies with the handle
                    out.copy_(f.get_slice(self.key)[box])
        except Exception as e:  # safetensors' SafetensorError, an OSError (file gone), a short read
            raise HFCheckpointError(f"{self.file}: reading tensor {self.key!r} {list(self.shape)} failed: {e}") from e


class _InMemory(HFTensor):
    """A plain tensor among lazy ones (e.g. a stack of some read and some given tensors)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype = t, t.shape, t.dtype

    @property
    def location(self) -> str:
        return "memory"

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        out.copy_(self.t[box])


class _Transposed(HFTensor):
    def __init__(self, src: HFTensor, d0: int, d1: int) -> None:
        self.src, self.d0, self.d1 = src, d0, d1
        dims = list(src.shape)
        dims[d0], dims[d1] = dims[d1], dims[d0]
        self.shape, self.dtype = torch.Size(dims), src.dtype

    @property
    def location(self) -> str:
        return self.src.location

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        b = list(box)
        b[self.d0], b[self.d1] = b[self.d1], b[self.d0]
        self.src.read_into(out.transpose(self.d0, self.d1), tuple(b))


class _Reshaped(HFTensor):
    def __init__(self, src: HFTensor, shape: torch.Size) -> None:
        if shape.numel() != src.numel():
            raise ValueError(f"cannot reshape {list(src.shape)} ({src.location}) to {list(shape)}")
        self.src, self.shape, self.dtype = src, shape, src.dtype

    @property
    def location(self) -> str:
        return self.src.location

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        if self.shape and self.src.shape and self.shape[0] == self.src.shape[0]:
            # rows stay rows (a Conv3d kernel flattened per output channel): read only the box's rows
            rows = self.src.read((box[0], *_full_box(self.src.shape[1:])), dtype=out.dtype)
            out.copy_(rows.reshape(rows.shape[0], *self.shape[1:])[(slice(None), *box[1:])])
        else:
            out.copy_(self.src.read(dtype=out.dtype).reshape(self.shape)[box])


class _RowPermuted(HFTensor):
    """Our row ``i`` is the source's row ``rows[i]``."""

    def __init__(self, src: HFTensor, rows: torch.Tensor) -> None:
        self.src, self.rows, self.shape, self.dtype = src, rows, src.shape, src.dtype

    @property
    def location(self) -> str:
        return self.src.location

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        rows = self.rows[box[0]].tolist()
        i = 0
        while i < len(rows):  # one read per run of consecutive source rows
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            self.src.read_into(out[i:j], (slice(rows[i], rows[i] + j - i), *box[1:]))
            i = j


class _Stacked(HFTensor):
    def __init__(self, parts: Sequence[HFTensor]) -> None:
        self.parts = list(parts)
        self.shape, self.dtype = torch.Size([len(parts), *parts[0].shape]), parts[0].dtype

    @property
    def location(self) -> str:
        return _locations(self.parts)

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        for i, e in enumerate(range(box[0].start, box[0].stop)):
            self.parts[e].read_into(out[i], box[1:])


class _Concatenated(HFTensor):
    def __init__(self, parts: Sequence[HFTensor], dim: int) -> None:
        self.parts, self.dim = list(parts), dim
        dims = list(parts[0].shape)
        dims[dim] = sum(p.shape[dim] for p in parts)
        self.shape, self.dtype = torch.Size(dims), parts[0].dtype

    @property
    def location(self) -> str:
        return _locations(self.parts)

    def read_into(self, out: torch.Tensor, box: Box) -> None:
        d, lo, hi, offset = self.dim, box[self.dim].start, box[self.dim].stop, 0
        for part in self.parts:
            a, b = max(lo, offset), min(hi, offset + part.shape[d])
            if a < b:
                sub = list(box)
                sub[d] = slice(a - offset, b - offset)
                part.read_into(out.narrow(d, a - lo, b - a), tuple(sub))
            offset += part.shape[d]


def _locations(parts: Iterable[HFTensor]) -> str:
    files = sorted({p.location for p in parts})
    return files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} other file(s)"


def _lazy(ts: Sequence[Any]) -> bool:
    return any(isinstance(t, HFTensor) for t in ts)


def _as_lazy(t: Any) -> HFTensor:
    return t if isinstance(t, HFTensor) else _InMemory(t)


def stack(ts: Sequence[Any]) -> Any:
    """``torch.stack(ts)`` for tensors, a lazy stack when any of ``ts`` is an :class:`HFTensor`."""
    if not _lazy(ts):
        return torch.stack(list(ts))
    shapes = {tuple(t.shape) for t in ts}
    if len(shapes) != 1:
        raise ValueError(f"cannot stack tensors of shapes {sorted(shapes)} ({_locations(_as_lazy(t) for t in ts)})")
    return _Stacked([_as_lazy(t) for t in ts])


def cat(ts: Sequence[Any], dim: int = 0) -> Any:
    """``torch.cat(ts, dim)`` for tensors, a lazy concatenation when any of ``ts`` is an :class:`HFTensor`."""
    if not _lazy(ts):
        return torch.cat(list(ts), dim=dim)
    rest = {tuple(s for i, s in enumerate(t.shape) if i != dim % len(t.shape)) for t in ts}
    if len(rest) != 1:
        raise ValueError(f"cannot concatenate shapes {[list(t.shape) for t in ts]} on dim {dim}")
    return _Concatenated([_as_lazy(t) for t in ts], dim % len(ts[0].shape))


def permute_rows(t: Any, reorder: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``reorder(t)`` where ``reorder`` only moves whole rows (dim 0) of a tensor; for an :class:`HFTensor`
    the row order is learnt by reordering row numbers, so a shard reads only its own rows."""
    if not isinstance(t, HFTensor):
        return reorder(t)
    n = t.shape[0]
    rows = reorder(torch.arange(n).reshape(n, *([1] * (t.ndim - 1)))).reshape(-1)
    return _RowPermuted(t, rows)


def equal(a: Any, b: Any, *, block_bytes: int = 64 << 20) -> bool:
    """``torch.equal`` for tensors and :class:`HFTensor` alike; lazy ones are compared a block of rows at a
    time (never two whole tensors in memory)."""
    if not _lazy((a, b)):
        return torch.equal(a, b)
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    if not a.shape:
        return torch.equal(_as_lazy(a).read(), _as_lazy(b).read())
    a, b = _as_lazy(a), _as_lazy(b)
    row = max(1, a.numel() // max(a.shape[0], 1) * a.dtype.itemsize)
    step = max(1, block_bytes // row)
    rest = _full_box(a.shape[1:])
    for r in range(0, a.shape[0], step):
        box = (slice(r, min(r + step, a.shape[0])), *rest)
        if not torch.equal(a.read(box), b.read(box)):
            return False
    return True


# ---- a folder ------------------------------------------------------------------------------------


def _safetensors_error(file: Path, e: Exception) -> HFCheckpointError:
    size = file.stat().st_size if file.exists() else 0
    hint = "re-download or re-export it"
    if "incomplete metadata" in str(e) or "not fully covered" in str(e):
        hint = f"the file ({size} bytes) is shorter than its header says: it is truncated; {hint}"
    elif "header too large" in str(e) or "invalid" in str(e).lower() or size < 8:
        hint = f"its header is not a safetensors header (garbage or another format); {hint}"
    return HFCheckpointError(f"{file}: not a readable safetensors file ({e}): {hint}")


def _scan(file: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file, from its header only."""
    out: dict[str, StoredTensor] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                name = sl.get_dtype()
                if name not in _DTYPES:
                    raise HFCheckpointError(f"{file}: tensor {key!r} has dtype {name}, which torch cannot load")
                out[key] = StoredTensor(file, key, sl.get_shape(), _DTYPES[name])
    except HFCheckpointError:
        raise
    except Exception as e:  # safetensors raises SafetensorError (not an OSError) for a broken header
        raise _safetensors_error(file, e) from e
    return out


class HFFolder:
    """The tensors of an HF checkpoint folder (sharded with its index, one ``model.safetensors``, or any
    ``*.safetensors``), read lazily. Opening checks the folder; every error names the file."""

    def __init__(self, path: Path, tensors: dict[str, StoredTensor]) -> None:
        self.path = path
        self.tensors = tensors
        """HF key -> lazy tensor."""

    @classmethod
    def open(cls, path: str | os.PathLike) -> HFFolder:
        path = Path(path)
        if path.is_file():
            return cls(path.parent, _scan(path))
        index = path / SAFE_INDEX
        if index.is_file():
            return cls(path, _from_index(index))
        if (path / SAFE_SINGLE).is_file():
            return cls(path, _scan(path / SAFE_SINGLE))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no {SAFE_INDEX}, {SAFE_SINGLE} or *.safetensors file")
        tensors: dict[str, StoredTensor] = {}
        for f in files:
            for key, t in _scan(f).items():
                if key in tensors:
                    raise HFCheckpointError(f"tensor {key!r} appears in both {tensors[key].file} and {f}")
                tensors[key] = t
        return cls(path, tensors)


def _from_index(index: Path) -> dict[str, StoredTensor]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{index}: not valid JSON ({e}): re-download or re-export the folder") from e
    except (KeyError, TypeError) as e:
        raise HFCheckpointError(f"{index}: no 'weight_map' in the index") from e
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        by_file.setdefault(name, []).append(key)
    missing = sorted(name for name in by_file if not (index.parent / name).is_file())
    if missing:
        raise HFCheckpointError(
            f"{index} names shard file(s) that do not exist: "
            + ", ".join(f"{index.parent / m} (holds e.g. {by_file[m][0]!r})" for m in missing)
        )
    out: dict[str, StoredTensor] = {}
    for name, keys in sorted(by_file.items()):
        stored = _scan(index.parent / name)
        absent = [k for k in keys if k not in stored]
        if absent:
            raise HFCheckpointError(
                f"{index.parent / name}: the index puts {len(absent)} tensor(s) there that the file lacks "
                f"(e.g. {absent[0]!r}): the file and the index do not belong together"
            )
        out.update({k: stored[k] for k in keys})
    return out


# ---- loading into (sharded) tensors -----------------------------------------------------------


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, Box] | None:
    """``(local tensor, its box in the global tensor)``; ``None`` when the placements are not plain
    ``Shard``/``Replicate`` (the caller then shards a full read the way DTensor does)."""
    if not isinstance(t, DTensor):
        return t, _full_box(t.shape)
    if any(type(p) not in (Shard, Replicate) for p in t.placements):  # _StridedShard: the general path
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        return None  # padded or otherwise unusual storage: take the general path
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_tensor_(dst: torch.Tensor, src: Any, *, offset: Sequence[int] | None = None) -> None:
    """Fill ``dst`` (a tensor, or a DTensor's local shard) from ``src`` (an :class:`HFTensor` or a tensor)
    in place, reading only what the local shard covers. ``offset``: ``src`` fills the block of ``dst``
    starting there (default: ``src`` has ``dst``'s shape)."""
    lazy = _as_lazy(src)
    if offset is None and tuple(lazy.shape) != tuple(dst.shape):
        raise ValueError(f"shape {list(lazy.shape)} ({lazy.location}) does not fit {list(dst.shape)}")
    offset = tuple(offset) if offset is not None else (0,) * dst.ndim
    if len(offset) != dst.ndim or any(o + n > d for o, n, d in zip(offset, lazy.shape, dst.shape)):
        raise ValueError(f"shape {list(lazy.shape)} at {list(offset)} ({lazy.location}) does not fit {list(dst.shape)}")
    found = local_box(dst)
    if found is None:  # e.g. _StridedShard: read the whole tensor, keep this rank's part (no communication)
        from torch.distributed.tensor import distribute_tensor

        full = torch.empty(dst.shape, dtype=dst.dtype)
        load_tensor_(full, src, offset=offset)
        local = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
        dst.to_local().copy_(local)
        return
    local, box = found
    # the part of the local box that src covers, in dst's and in src's coordinates
    inter = [slice(max(b.start, o), min(b.stop, o + n)) for b, o, n in zip(box, offset, lazy.shape)]
    if any(s.start >= s.stop for s in inter):
        return
    out = local[tuple(slice(s.start - b.start, s.stop - b.start) for s, b in zip(inter, box))]
    src_box = tuple(slice(s.start - o, s.stop - o) for s, o in zip(inter, offset))
    if out.is_contiguous() and out.device.type == "cpu":
        lazy.read_into(out, src_box)
    else:  # read on the host (in dst's dtype), then one copy to the device (or into a strided view)
        out.copy_(lazy.read(src_box, dtype=out.dtype))


# ---- writing -----------------------------------------------------------------------------------


def pack_files(sizes: Mapping[str, int], limit: int) -> list[list[str]]:
    """HF keys in sorted order packed greedily into files of at most ``limit`` bytes (a larger tensor gets
    a file of its own); the one packing every writer here uses."""
    files: list[list[str]] = [[]]
    size = 0
    for key in sorted(sizes):
        if files[-1] and size + sizes[key] > limit:
            files.append([])
            size = 0
        files[-1].append(key)
        size += sizes[key]
    return files


def _meta(t: Any) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def whole_model_view(state: Mapping[str, Any], *, stages: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """``state`` (this rank's tensors), and with ``stages`` (the pipeline-parallel group: one rank per stage) a meta
    tensor (global shape and dtype) for every key only other stages hold: what a writer plans the whole folder from
    (every stage's keys) while it hands ``save_converted`` this rank's own tensors. Every rank of the stage group
    calls it together."""
    if stages is None or not (dist.is_available() and dist.is_initialized()):
        return dict(state)
    held = _held_per_stage(state, stages)
    others = {k: torch.empty(shape, dtype=dtype, device="meta") for keys in held for k, (shape, dtype) in keys.items()}
    return others | dict(state)


def _held_per_stage(
    state: Mapping[str, Any], group: dist.ProcessGroup
) -> list[dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """``key -> (global shape, dtype)`` of what every pp index of the stage ``group`` holds (one gather)."""
    held: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, {k: (tuple(_meta(t).shape), _meta(t).dtype) for k, t in state.items()}, group=group)
    return held


def _stage_plan(
    sources: Mapping[str, Any], world: int, stages: dist.ProcessGroup
) -> tuple[dict[str, int], list[list[int]], dict[str, torch.Tensor]]:
    """``(key -> the pp index writing it, global ranks of every pp index, meta tensors of every stage's keys)`` of a
    pipeline-parallel save. A key several stages hold (a passthrough reference every rank keeps) goes to the first
    of them."""
    held = _held_per_stage(sources, stages)
    index: list[Any] = [None] * world
    dist.all_gather_object(index, dist.get_rank(stages))
    ranks = [[r for r in range(world) if index[r] == p] for p in range(len(held))]
    holder: dict[str, int] = {}
    metas: dict[str, torch.Tensor] = {}
    for p, keys in enumerate(held):
        for k, (shape, dtype) in sorted(keys.items()):
            if k not in holder:
                holder[k] = p
                metas[k] = torch.empty(shape, dtype=dtype, device="meta")
    return holder, ranks, metas


def _in_folder(t: Any, path: Path) -> bool:
    try:
        return isinstance(t, StoredTensor) and path.exists() and os.path.samefile(t.file.parent, path)
    except OSError:
        return False


def _rounds(order: Sequence[str], dests: Mapping[str, tuple[int, ...]]) -> list[list[str]]:
    """Group the keys into exchanges in which each rank receives at most one tensor: each rank's keys keep
    their order (its files fill and are written in turn), and the ranks' next keys go together, so they all
    assemble and convert at the same time. A key for several ranks (its outputs span files of different
    owners) goes alone, once it is next for each of them."""
    pos = {k: i for i, k in enumerate(order)}
    queues: dict[int, deque[str]] = {}
    multi: deque[str] = deque()
    for k in order:
        if len(dests[k]) > 1:
            multi.append(k)
        else:
            queues.setdefault(dests[k][0], deque()).append(k)
    rounds: list[list[str]] = []
    def reached(r: int) -> bool:  # rank r has nothing left before the next multi-rank key
        return not queues.get(r) or pos[queues[r][0]] > pos[multi[0]]

    while multi or any(queues.values()):
        if multi and all(reached(r) for r in dests[multi[0]]):
            rounds.append([multi.popleft()])
            continue
        waiting = set(dests[multi[0]]) if multi else set()
        rounds.append([q.popleft() for r, q in sorted(queues.items()) if q and not (r in waiting and reached(r))])
    return rounds


def save_converted(
    sources: Mapping[str, Any],
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    path: str | os.PathLike,
    *,
    max_shard_size: int,
    metadata: Mapping[str, str] | None = None,
    stages: dist.ProcessGroup | None = None,
) -> list[str]:
    """Write ``convert(sources)`` as sharded safetensors (+ index), one source tensor at a time.

    ``sources``: full tensors, DTensors (sharded: every rank must call, with the same keys) or
    :class:`HFTensor` (read when written, e.g. kept passthrough keys). ``convert({key: full tensor})`` must
    map each source key on its own (it is also called on meta tensors to plan the files). A sharded save
    makes files of at most ``total / world`` bytes (every rank writes some); with the same file limit a
    sharded and a one-process save write the same bytes. Returns the written file names (the same list on
    every rank). ``stages``: the pipeline-parallel group (one rank per stage) of a pipeline-parallel model, whose
ranks hold different keys: each rank passes its own stages' sources, each stage's keys go to files of their own,
written by that stage's ranks (no rank receives another stage's tensors), and rank 0 writes the one index.
    """
    path = Path(path)
    collective = (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        and any(isinstance(t, DTensor) for t in sources.values())
    )  # fmt: skip
    rank, world = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)

    # plan from shapes alone: which HF keys each source makes, their sizes, the files
    staged = collective and stages is not None
    holder, stage_ranks, metas = _stage_plan(sources, world, stages) if staged else ({}, [list(range(world))], {})
    if staged:  # this rank writes its own stage's keys only
        me = dist.get_rank(stages)
        sources = {k: t for k, t in sources.items() if holder[k] == me}
    metas = metas or {k: _meta(t) for k, t in sources.items()}
    outputs: dict[str, dict[str, torch.Tensor]] = {}
    for key in sorted(metas):
        outputs[key] = convert({key: metas[key]})
    sizes = {h: m.numel() * m.element_size() for outs in outputs.values() for h, m in outs.items()}
    if len(sizes) != sum(len(o) for o in outputs.values()):
        raise ValueError("two source tensors convert to the same HF key: the conversion is not one-to-one")
    files: list[list[str]] = []
    owner: dict[int, int] = {}
    for p, ranks in enumerate(stage_ranks):  # one stage (or the whole model) after the other
        part = {h: n for k, outs in outputs.items() if holder.get(k, 0) == p for h in outs for n in [sizes[h]]}
        limit = max_shard_size
        if collective:  # at least one file per rank, so that every rank writes (and holds) only a part of the model
            limit = min(limit, max(1, -(-sum(part.values()) // len(ranks))))
        for j, keys in enumerate(pack_files(part, limit) if part else []):
            owner[len(files)] = ranks[j % len(ranks)]
            files.append(keys)
    if not files:
        files, owner = [[]], {0: 0}
    names = (
        [SAFE_SINGLE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    file_of = {h: i for i, keys in enumerate(files) for h in keys}

    # sources read from this very folder are read before the stale files are removed
    sources = {k: (t.read() if _in_folder(t, path) else t) for k, t in sources.items()}
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        for stale in [*path.glob("model*.safetensors"), path / SAFE_INDEX]:
            if stale.exists():
                stale.unlink()
    if collective:
        dist.barrier()

    meta = {"format": "pt", **(metadata or {})}
    left = {i: len(keys) for i, keys in enumerate(files) if owner[i] == rank}
    buffers: dict[int, dict[str, torch.Tensor]] = {i: {} for i in left}
    order = sorted(sources, key=lambda k: (min((file_of[h] for h in outputs[k]), default=-1), k))
    # a tensor written as nothing (a tied head) needs no gather; the plan is the same on every rank
    dests = {k: tuple(sorted({owner[file_of[h]] for h in outputs[k]})) for k in order if outputs.get(k)}
    for round_keys in _rounds([k for k in order if k in dests], dests):
        # every rank of the round assembles its own tensor at once (one exchange), then converts it
        sharded = [k for k in round_keys if isinstance(sources[k], DTensor)]
        gathered = dict(zip(sharded, gather_many([(sources[k], dests[k]) for k in sharded]), strict=True))
        for key in round_keys:
            mine = [h for h in outputs[key] if owner[file_of[h]] == rank]
            if not mine:
                continue
            t = sources[key]
            full = gathered[key] if key in gathered else t.read() if isinstance(t, HFTensor) else t
            converted = convert({key: full})
            for h in mine:
                # clone: safetensors refuses views and shared storage; and the gathered tensor can go
                buffers[file_of[h]][h] = converted[h].detach().to("cpu").contiguous().clone()
                left[file_of[h]] -= 1
            del converted, full
            for i in sorted({file_of[h] for h in mine}):
                if left[i] == 0:
                    shard = buffers.pop(i)
                    save_file({h: shard[h] for h in sorted(shard)}, str(path / names[i]), metadata=meta)
                    del shard
        del gathered
    if rank == 0 and len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": {h: names[file_of[h]] for h in sizes}}
        (path / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    if collective:
        dist.barrier()
    return names + ([SAFE_INDEX] if len(files) > 1 else [])


def writes_once(sources: Mapping[str, Any]) -> bool:
    """Whether this process writes the files a folder has once (``config.json``) for a ``save_converted`` of
    ``sources``: rank 0 of a sharded save, or the one process that saves full tensors."""
    sharded = any(isinstance(t, DTensor) for t in sources.values())
    return not (sharded and dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


# ---- whole folders of full tensors ---------------------------------------------------------------


def parse_size(size: int | str) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"100KiB"`` / ``1024`` -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", size, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: use bytes or a size like '5GB' / '500MB'")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base**power)


def write_safetensors(
    state_dict: dict[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Write ``state_dict`` as HF safetensors: one file, or shards plus ``model.safetensors.index.json``.

    Returns the written file names. Tensors must be full (not sharded DTensors); to write a sharded model
    from every rank, see ``hf.storage.save_converted``.
    """
    for key, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            raise TypeError(f"{key}: write_safetensors needs full plain tensors, got {type(t).__name__}")
    return save_converted(
        state_dict, lambda sd: sd, path, max_shard_size=parse_size(max_shard_size), metadata=metadata
    )


def read_safetensors(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read every tensor of an HF checkpoint folder (sharded with index, or single file) or one file.

    A broken folder raises ``HFCheckpointError`` naming the file (truncated, not safetensors, a shard the
    index names that is missing or lacks its tensors).
    """
    return {key: t.read().to(device) for key, t in HFFolder.open(path).tensors.items()}
