"""``Decoder``: a decoder-only LM (HF ``Glm4MoeLiteModel`` + ``lm_head``) built from ``TransformerBlock``s.

The forward is split into overridable steps so a subclass replaces only what differs (GlmImageMoe
replaces ``embed`` with the text + VQ-image embedding):

    logits = head(forward_layers(embed(input_ids), position_ids=..., cu_seqlens=..., max_seqlen=...))

Each layer's token mixer owns its RoPE (if any); packed documents (``cu_seqlens`` over the flattened
``B*T`` stream) never attend to each other. When a layer's MLP has an auxiliary loss (MoE load
balancing), ``forward`` returns ``ModelOutput(logits, aux_loss)``: per-layer losses summed, MoE router
statistics pooled over all layers first (as HF). Each layer's is read right after its forward, so
recomputation under activation checkpointing cannot count it twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hyper_parallel.models.common.attention import AttentionMeta
from hyper_parallel.models.common.block import TransformerBlock, combine_aux_losses
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.protocols.model import BaseModel, ModelOutput
from hyper_parallel.protocols.module import Module, ModuleList

__all__ = ["Decoder"]


class Decoder(BaseModel):
    """Token embedding, a stack of blocks, final norm and the LM head (untied)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        vocab_size: int
        """Rows of the embedding table and of the LM head."""
        dim: int
        """Model (hidden) dimension, handed to every child at build time."""
        layers: list[TransformerBlock.Config]
        """One config per decoder layer (``layers.{i}``); layers may use different token mixers."""
        embed_tokens: Embedding.Config = field(default_factory=Embedding.Config)
        """Token embedding ``[vocab_size, dim]``."""
        norm: Module.Config = field(default_factory=RMSNorm.Config)
        """Final norm."""
        lm_head: Linear.Config = field(default_factory=Linear.Config)
        """Output projection ``[vocab_size, dim]``."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not config.layers:
            raise ValueError("Decoder.Config.layers is empty: give at least one TransformerBlock.Config")
        self.embed_tokens = config.embed_tokens.build(num_embeddings=config.vocab_size, embedding_dim=config.dim)
        self.layers = ModuleList([layer.build(dim=config.dim) for layer in config.layers])
        self.norm = config.norm.build(dim=config.dim)
        self.lm_head = config.lm_head.build(in_features=config.dim, out_features=self.lm_head_out_features())

    def lm_head_out_features(self) -> int:
        """Rows of the LM head; a multimodal subclass adds its output vocabulary here."""
        return self.config.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` token ids -> ``[B, T, dim]`` hidden states (the step multimodal subclasses replace)."""
        return self.embed_tokens(input_ids)

    def forward_layers(
        self,
        h_BTD: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run every block; return the hidden states and the summed auxiliary loss (None when no layer has one).

        ``position_ids`` default: ``arange`` per row, or restarting per document.
        """
        B, T, _ = h_BTD.shape
        meta = AttentionMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
        if position_ids is None:
            position_ids = meta.position_ids(B, T, device=h_BTD.device)
        auxes = []
        for layer in self.layers:
            h_BTD = layer(h_BTD, position_ids=position_ids, meta=meta)
            auxes.append(layer.pop_aux_loss())
        return h_BTD, combine_aux_losses(auxes)

    def head(self, h_BTD: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[B, T, dim]`` -> logits ``[B, T, vocab_size]``."""
        return self.lm_head(self.norm(h_BTD))

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
    ) -> torch.Tensor | ModelOutput:
        """``[B, T]`` ids -> logits ``[B, T, vocab_size]``; ``cu_seqlens`` (int32, flattened stream) packs documents.

        Returns ``ModelOutput(logits, aux_loss)`` instead when a layer produced an auxiliary loss.
        """
        h = self.embed(input_ids)
        return self.forward_embedded(
            h, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host
        )

    def forward_embedded(
        self,
        h_BTD: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
    ) -> torch.Tensor | ModelOutput:
        """Layers and head on embedded inputs: logits, or ``ModelOutput`` when there is an aux loss."""
        h, aux_loss = self.forward_layers(
            h_BTD, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host
        )
        logits = self.head(h)
        return logits if aux_loss is None else ModelOutput(logits, aux_loss)

    def get_nparams_and_flops(self, seq_len: int) -> tuple[int, float]:
        """``(total params, training FLOPs per token)``: ``6 * active non-embedding params + attention``.

        Active = every parameter except the embedding table, with each MoE layer's routed experts
        counted at ``top_k / num_experts`` (a token visits top_k of them). The attention term is
        torchtitan's ``12 * H * d * T`` per layer (no causal or packing discount).
        """
        total = sum(p.numel() for p in self.parameters())
        active = self.active_params() - self.embed_tokens.weight.numel()
        attention = sum(layer.self_attn.flops_per_token(seq_len) for layer in self.layers)
        return total, 6.0 * active + attention

    def active_params(self) -> int:
        """Parameters one token uses: all of them, routed experts counted at ``top_k / num_experts``."""
        active = float(sum(p.numel() for p in self.parameters()))
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                routed = sum(p.numel() for p in layer.mlp.experts.parameters())
                active -= routed * (1.0 - layer.mlp.config.gate.top_k / layer.mlp.config.num_experts)
        return int(active)
