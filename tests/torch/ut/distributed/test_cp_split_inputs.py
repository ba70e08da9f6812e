"""``split_batch_for_cp`` in both context-parallel orders for a model with its own inputs: GlmImageMoe's image
positions, VQ codes and multi-token-prediction image codes (``split_inputs_for_cp``) point at the same global
tokens as in the whole batch, for every rank and piece; the default split of ``cp_seq_keys`` follows the pieces.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from hyper_parallel.data.packing import add_mtp_targets
from hyper_parallel.distributed.context_parallel import split_batch_for_cp
from hyper_parallel.models.common.attention import CPShard
from hyper_parallel.models.glm_image_moe_v2 import GlmImageMoeModel
from hyper_parallel.protocols.model import BaseModel

P = 9  # placeholder id
IDS = torch.tensor([
    [5, 9, 9, 9, 1, 2, 9, 3, 9, 9, 4, 6, 9, 9, 9, 9],  # images straddle every boundary of 4-token pieces
    [4, 4, 9, 9, 9, 6, 7, 9, 9, 9, 9, 8, 9, 1, 2, 3],
])  # fmt: skip
CU = torch.tensor([0, 5, 12, 16, 20, 32], dtype=torch.int32)  # documents of the flat stream


def _batch() -> dict:
    flat = (IDS.reshape(-1) == P).nonzero().squeeze(-1)
    T = IDS.shape[1]
    return add_mtp_targets({
        "input_ids": IDS, "labels": IDS + 100, "position_ids": torch.arange(T).repeat(2, 1), "cu_seqlens": CU,
        "max_seqlen": 12, "visual_indices": flat, "vq_codes": torch.arange(flat.numel()) * 3 + 1,
    })  # fmt: skip


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("balanced", [False, True])
def test_glm_split_follows_the_pieces(cp, balanced):
    whole = _batch()
    B, T = IDS.shape
    code_at = {int(i): int(c) for i, c in zip(whole["visual_indices"], whole["vq_codes"])}
    n_mtp = n_at_ends = 0
    for rank in range(cp):
        part = split_batch_for_cp(whole, rank, cp, split_inputs=GlmImageMoeModel.split_inputs_for_cp,
                                  model_keys=GlmImageMoeModel.input_keys, balanced=balanced)  # fmt: skip
        shard = CPShard(rank=rank, size=cp, balanced=balanced)
        cols = torch.cat([torch.arange(lo, hi) for lo, hi in shard.ranges(T // cp)])  # global columns, local order
        t = cols.numel()
        glob = (torch.arange(B)[:, None] * T + cols[None]).reshape(-1)  # local flat position -> global flat
        assert torch.equal(whole["input_ids"].reshape(-1)[glob].view(B, t), part["input_ids"])
        # every image token of the pieces, in local order, with its own code
        local_images = (part["input_ids"].reshape(-1) == P).nonzero().squeeze(-1)
        assert torch.equal(part["visual_indices"], local_images)
        assert part["vq_codes"].tolist() == [code_at[int(glob[q])] for q in local_images]
        # MTP: every local position whose next token (same document) is an image gets that token's code
        want = [(q, code_at[int(glob[q]) + 1]) for q in range(B * t)
                if part["mtp_input_ids"].reshape(-1)[q] == P]  # fmt: skip
        got = [(int(q), int(c)) for q, c in zip(part["mtp_visual_indices"], part["mtp_vq_codes"])
               if part["mtp_input_ids"].reshape(-1)[q] >= 0]  # fmt: skip
        assert got == want
        n_mtp += len(want)
        piece = t // (2 if balanced else 1)
        n_at_ends += sum(1 for q, _ in want if (q + 1) % piece == 0)  # the next token opens the next piece
    assert n_mtp == int((whole["mtp_input_ids"] == P).sum())
    assert n_at_ends >= 2


class _SeqInputs(BaseModel):
    input_keys: ClassVar[tuple[str, ...]] = ("token_types", "extra")
    cp_seq_keys: ClassVar[tuple[str, ...]] = ("token_types",)


def test_default_split_slices_cp_seq_keys_per_piece():
    T = 16
    whole = {"input_ids": IDS, "labels": IDS, "position_ids": torch.arange(T).repeat(2, 1),
             "token_types": torch.arange(2 * T).view(2, T), "extra": torch.ones(3)}  # fmt: skip
    part = split_batch_for_cp(whole, 1, 2, split_inputs=_SeqInputs.split_inputs_for_cp,
                              model_keys=_SeqInputs.input_keys, balanced=True)  # fmt: skip
    cols = [4, 5, 6, 7, 8, 9, 10, 11]  # rank 1 of 2: pieces 1 and 2 of 4
    assert torch.equal(part["token_types"], whole["token_types"][:, cols])
    assert torch.equal(part["input_ids"], IDS[:, cols])
    assert part["extra"] is whole["extra"]
