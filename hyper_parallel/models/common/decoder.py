"""``Decoder``: a decoder-only LM (HF ``Glm4MoeLiteModel`` + ``lm_head``) built from ``TransformerBlock``s.

The forward is split into overridable steps so a subclass replaces only what differs (GlmImageMoe
replaces ``embed`` with the text + VQ-image embedding):

    logits = head(forward_layers(embed(input_ids), position_ids=..., cu_seqlens=..., max_seqlen=...))

Each layer's token mixer owns its RoPE (if any); packed documents (``cu_seqlens`` over the flattened
``B*T`` stream) never attend to each other. When a layer's MLP has an auxiliary loss (MoE load
balancing), ``forward`` returns ``ModelOutput(logits, aux_loss)``: per-layer losses summed, MoE router
statistics pooled over all layers first (as HF). Each layer's is read right after its forward, so
recomputation under activation checkpointing cannot count it twice.

Tied embeddings (``tie_word_embeddings``, HF's flag of the same name): ``lm_head.weight`` IS
``embed_tokens.weight``, one ``nn.Parameter`` registered under both names, so the optimizer, FSDP (the
embedding and the head form one FSDP unit), tensor parallel (both are ``Shard(0)`` over the vocabulary)
and DCP see a single tensor. The table is initialised once, by the embedding (its padding row stays zero).

Multi-token prediction (``Config.mtp``, off by default; ``models/common/mtp.py``): given
``mtp_input_ids`` (the next token of every position, per document, from the data side), ``forward``
also runs the MTP block on the final-normed hidden states and the shared ``lm_head`` and returns
``ModelOutput(logits, aux_loss, mtp_logits)``. Without ``mtp_input_ids`` the model computes exactly
what it computes without an MTP block.
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
from hyper_parallel.models.common.mtp import MTP
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.protocols.model import BaseModel, ModelOutput
from hyper_parallel.protocols.module import Module, ModuleList, _init_child

__all__ = ["Decoder"]


class Decoder(BaseModel):
    """Token embedding, a stack of blocks, final norm and the LM head (tied to the embedding or not)."""

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
        tie_word_embeddings: bool = False
        """Share one weight between ``embed_tokens`` and ``lm_head`` (HF ``tie_word_embeddings``)."""
        mtp: MTP.Config | None = None
        """Multi-token prediction block (``mtp.*``), None = off; it shares ``embed_tokens`` and ``lm_head``."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not config.layers:
            raise ValueError("Decoder.Config.layers is empty: give at least one TransformerBlock.Config")
        self.embed_tokens = config.embed_tokens.build(num_embeddings=config.vocab_size, embedding_dim=config.dim)
        self.layers = ModuleList([layer.build(dim=config.dim) for layer in config.layers])
        self.norm = config.norm.build(dim=config.dim)
        self.lm_head = config.lm_head.build(in_features=config.dim, out_features=self.lm_head_out_features())
        if config.tie_word_embeddings:
            self._tie_lm_head()
        self.mtp = config.mtp.build(dim=config.dim) if config.mtp is not None else None

    def _tie_lm_head(self) -> None:
        """Make ``lm_head.weight`` the embedding's parameter (one tensor under two names)."""
        head, table = self.lm_head, self.embed_tokens
        if head.weight.shape != table.weight.shape or head.bias is not None:
            raise ValueError(
                f"tie_word_embeddings=True needs an LM head of the embedding's shape {list(table.weight.shape)} and "
                f"no bias, but {type(self).__name__}'s head is {list(head.weight.shape)}"
                f"{' with a bias' if head.bias is not None else ''}: set tie_word_embeddings=False"
            )
        head.weight = table.weight

    @property
    def tied_word_embeddings(self) -> bool:
        """Whether the head's weight is the embedding's (the same parameter)."""
        return self.lm_head.weight is self.embed_tokens.weight

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # nn.Module._apply gives every module a NEW Parameter when a conversion cannot happen in place (meta ->
        # cpu in to_empty): the head would keep its own copy of the table. Share the embedding's again.
        out = super()._apply(fn, recurse)
        if self.config.tie_word_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight
        return out

    @torch.no_grad()
    def init_weights(self) -> None:
        self.init_own_weights()
        for name, child in self.named_children():
            if name != "mtp":  # initialised last: switching MTP on leaves the rest's seeded init unchanged
                _init_child(child)
        if self.config.tie_word_embeddings:  # the head's init ran last on the shared table: the embedding's holds
            self.embed_tokens.init_own_weights()
        if self.mtp is not None:
            self.mtp.init_weights()

    def lm_head_out_features(self) -> int:
        """Rows of the LM head; a multimodal subclass adds its output vocabulary here."""
        return self.config.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` token ids -> ``[B, T, dim]`` hidden states (the step multimodal subclasses replace)."""
        return self.embed_tokens(input_ids)

    def embed_next_tokens(self, mtp_input_ids: torch.Tensor) -> torch.Tensor:
        """MTP input: embeddings of ``mtp_input_ids`` (the next token of every position); zeros where it is
        negative (the last position of a document has no next token). Multimodal subclasses add their
        features at the positions whose next token is an image token."""
        has_next = mtp_input_ids >= 0
        e_BTD = self.embed_tokens(mtp_input_ids.clamp(min=0))
        return torch.where(has_next.unsqueeze(-1), e_BTD, torch.zeros((), dtype=e_BTD.dtype, device=e_BTD.device))

    def mtp_active(self, mtp_input_ids: torch.Tensor | None) -> bool:
        """Whether this forward runs the MTP block (the model has one and was given its inputs)."""
        return self.mtp is not None and mtp_input_ids is not None

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
        mtp_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | ModelOutput:
        """``[B, T]`` ids -> logits ``[B, T, vocab_size]``; ``cu_seqlens`` (int32, flattened stream) packs documents.

        Returns ``ModelOutput(logits, aux_loss)`` instead when a layer produced an auxiliary loss, and
        ``ModelOutput(logits, aux_loss, mtp_logits)`` when the model has an MTP block and ``mtp_input_ids``
        (``[B, T]``, the next token per position, negative where a document has none) are given.
        """
        h = self.embed(input_ids)
        mtp_embeds = self.embed_next_tokens(mtp_input_ids) if self.mtp_active(mtp_input_ids) else None
        return self.forward_embedded(
            h,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            cu_seqlens_host=cu_seqlens_host,
            mtp_embeds=mtp_embeds,
        )

    def forward_embedded(
        self,
        h_BTD: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        mtp_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | ModelOutput:
        """Layers and head on embedded inputs: logits, or ``ModelOutput`` when there is an aux loss or
        ``mtp_embeds`` (``embed_next_tokens``) are given to an MTP model."""
        if mtp_embeds is not None and position_ids is None:  # the MTP layer needs the trunk's positions
            meta = AttentionMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
            position_ids = meta.position_ids(h_BTD.shape[0], h_BTD.shape[1], device=h_BTD.device)
        h, aux_loss = self.forward_layers(
            h_BTD, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host
        )
        if mtp_embeds is None or self.mtp is None:
            logits = self.head(h)
            return logits if aux_loss is None else ModelOutput(logits, aux_loss)
        meta = AttentionMeta(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host)
        return self.head_with_mtp(h, aux_loss, mtp_embeds, position_ids=position_ids, meta=meta)

    def head_with_mtp(
        self,
        h_BTD: torch.Tensor,
        aux_loss: torch.Tensor | None,
        mtp_embeds: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        meta: AttentionMeta,
    ) -> ModelOutput:
        """``head`` plus the MTP block on the final-normed hidden states (vLLM's drafters take the target's
        normed output) and the shared ``lm_head``. The MTP layers' own aux loss joins ``aux_loss`` scaled by
        ``mtp.loss_weight`` (pooled apart from the trunk's layers)."""
        mtp_cfg = self.config.mtp
        hn_BTD = self.norm(h_BTD)
        logits = self.lm_head(hn_BTD)
        if mtp_cfg.zero_embedding_at_document_start:  # vLLM glm4_moe_lite_mtp.py: inputs_embeds[positions == 0] = 0
            pos = position_ids if position_ids.ndim == 2 else position_ids[0]
            zero = torch.zeros((), dtype=mtp_embeds.dtype, device=mtp_embeds.device)
            mtp_embeds = torch.where((pos == 0).unsqueeze(-1), zero, mtp_embeds)
        y_BTD = self.mtp(hn_BTD, mtp_embeds, position_ids=position_ids, meta=meta)
        mtp_aux = self.mtp.pop_aux_loss()
        if mtp_aux is not None:
            mtp_aux = mtp_cfg.loss_weight * mtp_aux
            aux_loss = mtp_aux if aux_loss is None else aux_loss + mtp_aux
        return ModelOutput(logits, aux_loss, self.lm_head(y_BTD))

    def get_nparams_and_flops(self, seq_len: int) -> tuple[int, float]:
        """``(total params, training FLOPs per token)``: ``6 * active non-embedding params + attention``.

        Active = every parameter except the embedding table, with each MoE layer's routed experts
        counted at ``top_k / num_experts`` (a token visits top_k of them). The attention term is
        torchtitan's ``12 * H * d * T`` per layer (no causal or packing discount).
        """
        total = sum(p.numel() for p in self.parameters())  # a tied table counts once
        # The lookup is free, the head's matmul is not: a tied table still costs its head FLOPs.
        active = self.active_params() - (0 if self.config.tie_word_embeddings else self.embed_tokens.weight.numel())
        attention = sum(layer.self_attn.flops_per_token(seq_len) for layer in self.all_layers())
        if self.mtp is not None:  # the shared head runs a second time, on the MTP block's output
            active += self.lm_head.weight.numel()
        return total, 6.0 * active + attention

    def all_layers(self) -> list[TransformerBlock]:
        """The decoder layers and the MTP block's layers (every FSDP / activation-checkpointing unit)."""
        return [*self.layers, *(self.mtp.layers if self.mtp is not None else ())]

    def active_params(self) -> int:
        """Parameters one token uses: all of them, routed experts counted at ``top_k / num_experts``."""
        active = float(sum(p.numel() for p in self.parameters()))
        for layer in self.all_layers():
            if isinstance(layer.mlp, MoE):
                routed = sum(p.numel() for p in layer.mlp.experts.parameters())
                active -= routed * (1.0 - layer.mlp.config.gate.top_k / layer.mlp.config.num_experts)
        return int(active)
