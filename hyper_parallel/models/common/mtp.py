"""``MTP``: the multi-token-prediction block (Qwen3.5 ``mtp.*``, GLM-4.7-Flash / DeepSeek-V3 "nextn" layer).

Legend: B batch, T tokens, D hidden size.

At position ``t`` the block predicts token ``t + 2`` from the trunk's hidden state at ``t`` and the
embedding of token ``t + 1`` (the trunk itself predicts ``t + 1``):

    x_t    = fc(cat([pre_fc_norm_embedding(e_{t+1}), pre_fc_norm_hidden(h_t)]))   # embedding half FIRST
    y_t    = layers[0](x_t, positions of t)                                        # one decoder layer
    logits = lm_head(norm(y_t))                                                    # the trunk's own head

Pinned from the inference code that consumes these weights (read, then written here; nothing copied):

- vLLM ``vllm/model_executor/models/qwen3_5_mtp.py`` (``Qwen3_5MultiTokenPredictor.forward``):
  ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` are zero-centred ``Qwen3_5RMSNorm`` (``rms_norm_eps``),
  ``fc = Linear(2H -> H, bias=False)`` over ``cat([embeds, hidden])``, then ONE ``Qwen3_5DecoderLayer`` built
  with ``layer_type="full_attention"`` (gated attention; its MLP is the family's: dense SwiGLU for Qwen3.5,
  the MoE with shared expert for Qwen3.5-MoE), then ``mtp.norm``. There is no ``mtp.embed_tokens`` or
  ``mtp.lm_head``: ``Qwen3_5MTP.load_weights`` takes ``embed_tokens`` and ``lm_head`` from the target model
  (shared). For the VL model the draft's ``inputs_embeds`` are merged with the image features exactly like
  the target's (``Qwen3_5MTP.embed_input_ids`` -> ``_merge_multimodal_embeddings``).
- vLLM ``vllm/model_executor/models/glm4_moe_lite_mtp.py`` (``Glm4MoeLiteMultiTokenPredictorLayer``, the
  GLM-4.7-Flash drafter; ``deepseek_mtp.py`` is the same): ``enorm`` / ``hnorm`` (plain RMSNorm,
  ``rms_norm_eps``), ``eh_proj = Linear(2H -> H, bias=False)`` over ``cat([enorm(e), hnorm(h)])``,
  ``mtp_block`` = a ``Glm4MoeLiteDecoderLayer`` at layer index ``num_hidden_layers`` (MLA + MoE), then
  ``shared_head.norm`` and the head; the embedding at position 0 is zeroed before ``enorm``
  (``zero_embedding_at_document_start`` here: position 0 starts every packed document).
- The hidden state is the target model's forward output, i.e. AFTER the trunk's final norm: vLLM's
  ``Qwen3_5Model`` / ``Glm4MoeLiteModel`` return ``norm(h)`` and the proposer hands that on as
  ``hidden_states``. Positions are the trunk's (the draft at ``t`` is rotated by ``t``).

The family keeps its own names on disk (``mtp.fc`` vs ``model.layers.{L}.eh_proj`` ...); the adapters map
them. Depth 1 only: every released checkpoint ships one MTP layer (``mtp_num_hidden_layers: 1``,
``num_nextn_predict_layers: 1``).

Targets: the data side computes, per packed document on the host, ``mtp_input_ids[t] = input_ids[t + 1]``
and ``mtp_labels[t] = labels[t + 1]`` (``data.packing.add_mtp_targets``); the last position of every
document has no token ``t + 1``: its ``mtp_input_ids`` is negative (embedded as zeros) and its label ignored.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.common.block import TransformerBlock, combine_aux_losses
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.protocols.module import Module, ModuleList

__all__ = ["MTP", "mtp_config_like", "with_mtp"]


class MTP(Module):
    """One multi-token-prediction depth: two pre-norms, the ``fc`` fusion, one decoder layer, a final norm."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        layers: list[TransformerBlock.Config]
        """The decoder layer the block runs (``mtp.layers.0``): a full-attention layer of the trunk's kind."""
        pre_fc_norm_embedding: Module.Config = field(default_factory=RMSNorm.Config)
        """Norm of the next token's embedding (Qwen ``mtp.pre_fc_norm_embedding``, GLM ``enorm``)."""
        pre_fc_norm_hidden: Module.Config = field(default_factory=RMSNorm.Config)
        """Norm of the trunk's (already final-normed) hidden state (Qwen ``pre_fc_norm_hidden``, GLM ``hnorm``)."""
        fc: Linear.Config = field(default_factory=Linear.Config)
        """Fusion ``[dim, 2 * dim]`` over ``cat([embedding, hidden])`` (Qwen ``mtp.fc``, GLM ``eh_proj``)."""
        norm: Module.Config = field(default_factory=RMSNorm.Config)
        """Final norm before the shared head (Qwen ``mtp.norm``, GLM ``shared_head.norm``)."""
        zero_embedding_at_document_start: bool = False
        """Zero the embedding input at position 0 of every document (vLLM's GLM-4.x / DeepSeek drafters do)."""
        loss_weight: float = 0.1
        """Weight of the MTP cross entropy added to the main loss (Megatron's ``mtp_loss_scaling_factor``; 0
        trains nothing and leaves the run bit-identical to one without MTP). Each family's builder passes its
        reference value, ``MTP_LOSS_WEIGHT`` beside it (Qwen3.5 0.1, GLM-4.7-Flash 0.3); 0.1 here is
        Megatron-Core's ``TransformerConfig`` default. It weighs the cross entropy only: the MTP layer's router
        aux loss joins the model's aux loss with the full ``router_aux_loss_coef``, as Megatron's router does."""

        def __post_init__(self) -> None:
            if len(self.layers) != 1:
                raise NotImplementedError(
                    f"MTP.Config.layers has {len(self.layers)} layers: only depth 1 is implemented (every released "
                    "checkpoint has mtp_num_hidden_layers / num_nextn_predict_layers = 1)"
                )
            if self.loss_weight < 0:
                raise ValueError(f"mtp.loss_weight={self.loss_weight} must be >= 0")

    def __init__(self, config: Config, *, dim: int) -> None:
        super().__init__(config)
        self.pre_fc_norm_embedding = config.pre_fc_norm_embedding.build(dim=dim)
        self.pre_fc_norm_hidden = config.pre_fc_norm_hidden.build(dim=dim)
        self.fc = config.fc.build(in_features=2 * dim, out_features=dim)
        self.layers = ModuleList([layer.build(dim=dim) for layer in config.layers])
        self.norm = config.norm.build(dim=dim)

    def forward(
        self, h_BTD: torch.Tensor, e_BTD: torch.Tensor, *, position_ids: torch.Tensor, meta: AttentionMeta | None = None
    ) -> torch.Tensor:
        """``h_BTD``: the trunk's hidden states after its final norm; ``e_BTD``: the embeddings of the next
        tokens (zeros where a document has none). Returns the normed hidden states for the shared head."""
        x_BTD = self.fc(torch.cat([self.pre_fc_norm_embedding(e_BTD), self.pre_fc_norm_hidden(h_BTD)], dim=-1))
        for layer in self.layers:
            x_BTD = layer(x_BTD, position_ids=position_ids, meta=meta)
        return self.norm(x_BTD)

    def pop_aux_loss(self) -> torch.Tensor | None:
        """The MTP layers' own auxiliary loss (MoE load balancing, pooled over these layers only), cleared."""
        return combine_aux_losses(layer.pop_aux_loss() for layer in self.layers)


def mtp_config_like(
    layer: TransformerBlock.Config,
    *,
    norm: Module.Config,
    fc: Linear.Config,
    zero_embedding_at_document_start: bool = False,
    loss_weight: float = 0.1,
) -> MTP.Config:
    """An ``MTP.Config`` whose decoder layer is a copy of the trunk layer config ``layer`` and whose three
    norms are copies of ``norm`` (no config object is shared with the trunk)."""
    return MTP.Config(
        layers=[copy.deepcopy(layer)],
        pre_fc_norm_embedding=copy.deepcopy(norm),
        pre_fc_norm_hidden=copy.deepcopy(norm),
        fc=copy.deepcopy(fc),
        norm=copy.deepcopy(norm),
        zero_embedding_at_document_start=zero_embedding_at_document_start,
        loss_weight=loss_weight,
    )


def with_mtp(
    config: Any,
    *,
    layer_index: int,
    zero_embedding_at_document_start: bool = False,
    loss_weight: float = 0.1,
) -> Any:
    """A new ``Decoder`` config equal to ``config`` plus an MTP block: its layer a copy of trunk layer
    ``layer_index`` (the kind the checkpoints' MTP layer is), its norms copies of the final norm, ``fc``
    initialised like the head. For turning MTP on in a config read from an HF folder."""
    fc = Linear.Config(bias=False, param_init=copy.deepcopy(config.lm_head.param_init))
    mtp = mtp_config_like(
        config.layers[layer_index],
        norm=config.norm,
        fc=fc,
        zero_embedding_at_document_start=zero_embedding_at_document_start,
        loss_weight=loss_weight,
    )
    return dataclasses.replace(config, mtp=mtp)
