"""``BaseModel``: the root Module of a model: its inputs, its output, parameter and FLOP counting.

What the model-agnostic trainer needs from a model, and nothing else:

- **Inputs.** Every model takes the generic batch contract ``model(input_ids, position_ids=,
  cu_seqlens=, max_seqlen=)``. Batch keys beyond it are declared in ``input_keys`` and passed by name
  (``model(..., **{k: batch[k] for k in input_keys})``): GlmImageMoe declares its VQ keys, a VLM its
  pixels. How context parallel splits each declared key is the model's too
  (``split_inputs_for_cp``), so ``distributed/`` knows no key names.
- **Output.** Logits ``[B, T, V]``, or a :class:`ModelOutput` when the model also has an auxiliary
  loss (MoE load balancing), which the trainer adds to the token loss and logs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from hyper_parallel.protocols.module import Module

__all__ = ["BaseModel", "ModelOutput", "split_output"]


class ModelOutput(NamedTuple):
    """Logits plus the auxiliary loss to add to the training loss (already weighted by its coefficient)."""

    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None
    mtp_logits: torch.Tensor | None = None
    """Multi-token prediction: logits ``[B, T, V]`` of token ``t + 2`` at position ``t`` (trained against the
    batch's ``mtp_labels``), when the model has an MTP block and was given ``mtp_input_ids``."""

    def as_stage_output(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three fields as tensors only (a pipeline stage's outputs must be), an absent one as an empty tensor;
        ``from_stage_output`` reads them back."""
        empty = self.logits.new_empty(0)
        return (self.logits, empty if self.aux_loss is None else self.aux_loss,
                empty if self.mtp_logits is None else self.mtp_logits)  # fmt: skip

    @classmethod
    def from_stage_output(cls, out: tuple[torch.Tensor, ...]) -> ModelOutput:
        """The ``ModelOutput`` a last pipeline stage returned as ``as_stage_output``."""
        logits, aux, mtp = out
        return cls(logits, None if aux.numel() == 0 else aux, None if mtp.numel() == 0 else mtp)


def split_output(out: torch.Tensor | ModelOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logits, aux_loss or None)`` from whatever a model's forward returned."""
    if isinstance(out, ModelOutput):
        return out.logits, out.aux_loss
    return out, None


class BaseModel(Module):
    """A whole model. Subclasses refine ``training_flops`` for their architecture."""

    input_keys: ClassVar[tuple[str, ...]] = ()
    """Batch keys beyond ``input_ids, position_ids, cu_seqlens, max_seqlen`` that ``forward`` takes by name."""
    cp_seq_keys: ClassVar[tuple[str, ...]] = ()
    """Of ``input_keys``, those laid out ``[..., B, T]`` that context parallel slices along T like ``input_ids``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def host_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Host facts the forward reads, made once per micro-batch on the HOST from the host batch (before the
        context-parallel split and the device copy), so no layer reads metadata back from the device: keys to
        add to the batch, each declared in ``input_keys`` (tensors are copied to the device with the batch; other
        values stay Python objects). Default: none."""
        del batch
        return {}

    @classmethod
    def split_inputs_for_cp(
        cls, inputs: Mapping[str, Any], *, ranges: Sequence[tuple[int, int]], seqlen: int
    ) -> dict[str, Any]:
        """This context-parallel rank's part of the declared inputs. The rank keeps the pieces ``ranges`` (global
        ``[lo, hi)`` column ranges of every ``seqlen``-token row; one contiguous chunk, or two pieces in the
        balanced order) and its local row is their concatenation, in that order.

        Default: ``cp_seq_keys`` are sliced along their last dim, other keys are kept whole (replicated).
        A model whose inputs index into the flat token stream (e.g. GlmImageMoe's ``visual_indices``)
        overrides this to renumber them.
        """
        del seqlen

        def local(v: torch.Tensor) -> torch.Tensor:
            return torch.cat([v[..., lo:hi] for lo, hi in ranges], dim=-1)

        return {k: (local(v) if k in cls.cp_seq_keys and v is not None else v) for k, v in inputs.items()}

    def count_params(self, *, exclude_embeddings: bool = False) -> int:
        """Total parameter count (works on the meta device)."""
        skip = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        return sum(p.numel() for p in self.parameters() if not (exclude_embeddings and id(p) in skip))

    def training_flops(self, batch: Mapping[str, Any]) -> float:
        """Training FLOPs (forward + backward, no recompute) of one micro-batch in the batch contract (host tensors:
        ``input_ids``, ``cu_seqlens_host`` / ``cu_seqlens``, the model's own inputs), from its real documents:
        attention causal within each packed document, routed experts at top-k, the input side (vision tower, image
        projection) for the batch's images. ``models/common/flops.py`` holds the convention; the trainer logs
        ``flops_per_token`` and TFLOP/s from this every step.

        Generic: ``6 x`` non-embedding parameters per token; models refine it (``Decoder``).
        """
        return 6.0 * self.count_params(exclude_embeddings=True) * batch["input_ids"].numel()

    def get_nparams_and_flops(self, seq_len: int) -> tuple[int, float]:
        """``(total params, training FLOPs per token)`` of a micro-batch that is ONE text document of ``seq_len``
        tokens (``training_flops`` of it / ``seq_len``): the upper bound of packed text micro-batches of that size.
        Works on the meta device."""
        batch = {"input_ids": torch.empty(1, seq_len, dtype=torch.int64, device="meta")}
        return self.count_params(), self.training_flops(batch) / max(seq_len, 1)
