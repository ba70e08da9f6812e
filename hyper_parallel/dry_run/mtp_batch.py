"""The dry run's micro-batch when multi-token prediction is on: one document WITH image positions where the model
takes images, so the MTP block's image path (the next token's image embedding) runs in the simulated step and
its activations count, and the MTP targets of the trainer (``add_mtp_targets``, per document, before the CP
split).

The images are the ones the model's data source delivers, built from the model's data facts
(``ModelSpec.data_facts``), so no model is named here:

- VQ image tokens (DirectToken contract, facts ``placeholder_token_id`` and ``codebook_size``): placeholders in
  ``input_ids``, their flat positions ``visual_indices`` and codes ``vq_codes``;
- pixel images (vision-language contract, facts ``image_token_id``, ``patch_size``, ``temporal_patch_size``,
  ``merge_size``): runs of ``image_token_id``, ``pixel_values`` (RGB patches: fake floats) and
  ``image_grid_thw``.

One image sits in the middle of every context-parallel piece of the row (``2 x cp`` pieces in the balanced
order), so every CP rank holds as many image tokens as its peers: the simulated collectives complete as if
every peer held this rank's data. The batch is then split exactly like the trainer's (``split_batch_for_cp``
with the model's ``split_inputs_for_cp``). Integer tensors are real (``SimulationMode``), pixels fake.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hyper_parallel.data.packing import add_mtp_targets
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.distributed.parallel_dims import ParallelDims

__all__ = ["mtp_micro_batch"]

MAX_IMAGE_TOKENS = 256
"""Merged visual tokens of one synthetic pixel image (a 16 x 16 grid after merging: a typical image, whose vision
tower attention stays the size real data gives)."""


def mtp_micro_batch(
    seqlen: int, pd: ParallelDims, model: Any, facts: dict[str, Any], *, ignore_index: int = -100
) -> dict[str, Any]:
    """This rank's part of a one-document ``seqlen``-token micro-batch with MTP targets and, where ``facts``
    describe an image contract, one image per context-parallel piece; the extra keys the model takes
    (``model_inputs``) are the model's declared ``input_keys`` found in it plus ``mtp_input_ids``."""
    shard = getattr(model, "cp_shard", None)  # the batch order context parallel chose (the trainer's rule)
    balanced = shard is not None and shard.balanced
    n_pieces = pd.cp * (2 if balanced and pd.cp > 1 else 1)
    piece = seqlen // n_pieces
    ids = torch.zeros(1, seqlen, dtype=torch.int64)
    batch: dict[str, Any] = {
        "input_ids": ids,
        "labels": torch.zeros(1, seqlen, dtype=torch.int64),
        "position_ids": torch.arange(seqlen, dtype=torch.int64).unsqueeze(0),
        "cu_seqlens": torch.tensor([0, seqlen], dtype=torch.int32),
        "max_seqlen": seqlen,
    }
    if piece >= 4 and "placeholder_token_id" in facts:  # VQ codes: half of every piece
        n = piece // 2
        starts = [p * piece + piece // 4 for p in range(n_pieces)]
        flat = torch.cat([torch.arange(s, s + n, dtype=torch.int64) for s in starts])
        ids[0, flat] = int(facts["placeholder_token_id"])
        batch["visual_indices"] = flat
        batch["vq_codes"] = torch.arange(flat.numel(), dtype=torch.int64) % int(facts["codebook_size"])
    elif piece >= 4 and "image_token_id" in facts:  # pixel images: an r x r merged grid per piece
        m, p, tp = int(facts["merge_size"]), int(facts["patch_size"]), int(facts["temporal_patch_size"])
        r = max(1, math.isqrt(min(piece // 2, MAX_IMAGE_TOKENS)))
        for k in range(n_pieces):
            start = k * piece + (piece - r * r) // 2
            ids[0, start : start + r * r] = int(facts["image_token_id"])
        batch["image_grid_thw"] = torch.tensor([[1, m * r, m * r]] * n_pieces, dtype=torch.int64)
        batch["pixel_values"] = torch.zeros(n_pieces * (m * r) ** 2, 3 * tp * p * p)
    batch = add_mtp_targets(batch, ignore_index=ignore_index)
    batch.update(model.host_inputs(batch))  # the model's host facts, before the split (as the trainer)
    cls = type(model)
    out = split_batch_for_cp(
        batch, pd.mesh_coordinate("cp") if pd.cp > 1 else 0, pd.cp,
        split_inputs=cls.split_inputs_for_cp, model_keys=cls.input_keys, balanced=balanced,
    )  # fmt: skip
    out["model_inputs"] = {k: out[k] for k in (*cls.input_keys, "mtp_input_ids") if k in out}
    return out
