"""The LM head of a tied model in HF checkpoints (``tie_word_embeddings=True``).

transformers writes no ``lm_head.weight`` for a tied model and reads the head from the embedding; a folder
may still carry the key (older writers). These helpers keep every adapter's handling the same:
on export the head key is dropped, on import it is rebuilt from the embedding (or checked against it), and
an untied model whose folder lacks the head gets an error that says where the flag is read.
"""

from __future__ import annotations

import torch

from hyper_parallel.hf.storage import equal

__all__ = ["HEAD_KEY", "tied_head_from_hf", "untied_head_hint"]

HEAD_KEY = "lm_head.weight"
_EMBED_KEY = "embed_tokens.weight"


def tied_head_from_hf(ours: dict[str, torch.Tensor], *, embed_hf_key: str) -> list[str]:
    """Give a tied model's converted state dict ``ours`` its head: the embedding tensor itself.

    A head the folder does carry must equal the embedding (else one problem naming both keys is returned).
    """
    embed = ours.get(_EMBED_KEY)
    if embed is None:
        return []  # the missing embedding is reported by the key check
    head = ours.get(HEAD_KEY)
    # hf.storage.equal: also for the lazy tensors of a sharded load (compared a block of rows at a time)
    if head is not None and (head.shape != embed.shape or not equal(head, embed)):
        return [
            f"tied: config.json says tie_word_embeddings=true but the folder's {HEAD_KEY} differs from "
            f"{embed_hf_key}; set tie_word_embeddings=false to load an untied head"
        ]
    ours[HEAD_KEY] = embed
    return []


def untied_head_hint(problems: list[str], *, where: str) -> list[str]:
    """``problems`` with the 'missing: lm_head.weight' line of an untied model explained."""
    return [
        f"{p} (the model is untied: {where} has no tie_word_embeddings=true; a folder without {HEAD_KEY} is a "
        "tied checkpoint, so check that flag)"
        if p == f"missing: {HEAD_KEY}"
        else p
        for p in problems
    ]
