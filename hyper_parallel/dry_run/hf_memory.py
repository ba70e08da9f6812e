"""Host memory of the HF load (``--checkpoint.initial_load_path``) and export (``--checkpoint.export_hf``) per rank.

What ``hf/storage.py`` does, sized from every rank's shards:

- **load**: a rank reads only the slices its own shards cover (``read``: their bytes in the parameters'
  dtype; a bf16 folder read into fp32 parameters reads half). With the parameters on the host (CPU runs)
  the slices are copied straight into them: nothing beyond the shards. On an accelerator each slice passes
  through one host buffer first: at most the rank's largest shard of one parameter.
- **export**: one parameter at a time is gathered (on the device) and converted; the ranks that own the
  files its tensors go to copy them to the host and hold each file until it is complete. Files are at most
  ``min(max_shard_size, export size / world)``, and files complete in key order, so a rank holds at most
  two files in progress plus one converted parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.dry_run.layout import ShardCensus

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "HFIOMemory", "hf_io_memory"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""``save_pretrained``'s default ``max_shard_size`` (5GB)."""


@dataclass(frozen=True, slots=True)
class HFIOMemory:
    """Host bytes of one rank's HF load and export."""

    rank: int
    read: int
    """Bytes of the HF folder this rank reads (its shards, in the parameters' dtype)."""
    load_host: int
    """Host memory the load adds on an accelerator: one staging buffer (CPU runs: nothing beyond the shards)."""
    export_host: int
    """Upper bound of the export's host memory: two files in progress plus one converted parameter."""


def hf_io_memory(
    census: ShardCensus,
    *,
    world_size: int,
    export_itemsize: int,
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[HFIOMemory]:
    """Per-rank host memory of the HF load and export of the model ``census`` describes."""
    export_total = census.model_numel * export_itemsize
    file_limit = min(max_shard_size, -(-export_total // max(world_size, 1))) if world_size > 1 else max_shard_size
    file_bytes = min(file_limit, export_total)
    largest_export = census.largest_numel * export_itemsize
    owns_files = min(world_size, max(1, -(-export_total // max(file_limit, 1))))
    out = []
    for mem in census.ranks:
        writes = mem.rank < owns_files  # files go to the ranks round-robin
        in_progress = min(2 * file_bytes, export_total) if writes else 0
        out.append(
            HFIOMemory(
                rank=mem.rank,
                read=mem.local_bytes,
                load_host=mem.largest_local,
                export_host=in_progress + (largest_export if writes else 0),
            )
        )
    return out
