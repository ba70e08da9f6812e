"""GlmImageMoe: Glm4MoeLite decoder layers plus the DirectToken VQ image path (docs/design.md section 4).

    h            = embed_tokens(input_ids)                       # placeholders at image positions
    h[visual]    = vq_to_llm_proj(l2norm(codebook[vq_codes]))    # frozen codebook, trainable projection
    logits       = lm_head(norm(layers(h)))                      # rows [0, V) text, [V, V + C) image codes

The image path (codebook, projection, the head's image rows) is optional configuration: a config whose
``vq_codebook`` / ``vq_to_llm_proj`` are None is exactly a Glm4MoeLite (GLM-4.7-Flash) model, ``lm_head [V, D]``.
The model-level option ``image_path`` (``--model.image_path``) adds it to such a tree or removes it; a run whose
data holds image tokens (a DirectToken source) turns it on (``fit_to_data``).

One parameterised builder, ``glm_image_moe_config``, turns HF-style hyper-parameters into the config
tree; ``hf_config.py`` converts to and from the HF ``config.json``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
import tyro

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.models.common.block import TransformerBlock
from hyper_parallel.models.common.decoder import OFF_CLI, Decoder
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.flops import matmul_flops
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router
from hyper_parallel.models.common.mtp import MTP, mtp_config_like, with_mtp
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.protocols.model import ModelOutput
from hyper_parallel.protocols.param_init import NormalInit

__all__ = ["MTP_LOSS_WEIGHT", "GlmImageMoeModel", "glm_image_moe_config", "glm_with_mtp"]

MTP_LOSS_WEIGHT = 0.3
"""Default weight of the MTP (nextn) loss: Megatron-Bridge's GLM-4.7-Flash value,
``provider.mtp_loss_scaling_factor = 0.3`` in ``src/megatron/bridge/models/glm/glm47_flash_bridge.py``
(``GLM47FlashBridge.provider_bridge``), not Megatron-Core's generic default 0.1."""

MlpLayerType = Literal["dense", "sparse"]


class GlmImageMoeModel(Decoder):
    """Text + VQ-image autoregressive LM over ``lang_vocab_size + codebook_size`` output rows."""

    input_keys: ClassVar[tuple[str, ...]] = (
        "visual_indices", "vq_codes", "mtp_visual_indices", "mtp_vq_codes", "image_inputs_checked",
    )  # fmt: skip

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        codebook_size: int
        """VQ codebook entries C (HF ``vq_config.num_embeddings``); image labels are ``code + vocab_size``. Read only
        with the image path on."""
        vq_embed_dim: int
        """Width of a codebook vector (HF ``vq_config.embed_dim``); read only with the image path on."""
        placeholder_token_id: int
        """Token id that marks every image position in ``input_ids`` (must be < vocab_size); read only with the
        image path on (a text-only model has no image positions)."""
        image_start_token_id: int | None = None
        """Token id opening an image (kept for the HF config; the model does not need it)."""
        image_end_token_id: int | None = None
        """Token id closing an image (kept for the HF config; the model does not need it)."""
        vq_l2_normalize: bool = True
        """L2-normalise codebook rows before the projection (the GlmImage quantizer's semantics)."""
        freeze_vq: bool = True
        """Keep the codebook frozen: no gradient, never updated, ignored by FSDP."""
        vq_codebook: Annotated[Embedding.Config | None, tyro.conf.Suppress, OFF_CLI] = field(
            default_factory=Embedding.Config
        )
        """The VQ codebook ``[codebook_size, vq_embed_dim]`` (HF ``model.vqmodel.quantize.embedding``); None (with
        ``vq_to_llm_proj``): no image path, a Glm4MoeLite model."""
        vq_to_llm_proj: Annotated[Linear.Config | None, tyro.conf.Suppress, OFF_CLI] = field(
            default_factory=Linear.Config
        )
        """Projection of codebook vectors into the hidden space ``[dim, vq_embed_dim]``; always trains. None (with
        ``vq_codebook``): no image path."""
        image_path: bool | None = None
        """The VQ image path (codebook, projection, ``codebook_size`` image rows in the head): True adds it to a
        text-only (Glm4MoeLite) tree, False removes it (a GLM-4.7-Flash model: head ``[vocab_size, dim]``, exported
        in the Glm4MoeLite form), None: as the tree says. A run with a DirectToken source turns it on."""
        max_position_embeddings: int = 202752
        """Longest position the checkpoint was trained for (kept for the HF config)."""
        hf_extra: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
        """Other HF text_config / vq_config fields, written back unchanged on export (not used here)."""

        fixed_eps_norms: ClassVar[tuple[str, ...]] = ("*.q_a_layernorm", "*.kv_a_layernorm")
        """HF Glm4MoeLite builds the MLA's low-rank norms with the RMSNorm default 1e-6, not ``rms_norm_eps``."""

        def __post_init__(self) -> None:
            Decoder.Config.__post_init__(self)  # the model-level options (slots dataclass: no zero-argument super)
            if self.image_path is not None and not isinstance(self.image_path, bool):
                raise ConfigError(f"model.image_path must be true or false, got {self.image_path!r}")
            if self.image_path is False:
                self.vq_codebook = self.vq_to_llm_proj = None
            elif self.image_path and self.vq_codebook is None:
                # grown with the head's initialiser (HF's initializer_range); the codebook stays frozen by default
                init = copy.deepcopy(self.lm_head.param_init) or NormalInit.Config(std=0.02)
                self.vq_codebook = Embedding.Config(param_init=init)
                self.vq_to_llm_proj = Linear.Config(bias=False, param_init=copy.deepcopy(init))
            if (self.vq_codebook is None) != (self.vq_to_llm_proj is None):
                raise ConfigError(
                    "model.vq_codebook and model.vq_to_llm_proj are the one image path: set both or neither "
                    "(--model.image_path true / false)"
                )
            if self.has_image_path and not 0 <= self.placeholder_token_id < self.vocab_size:
                raise ConfigError(
                    f"--model.placeholder_token_id {self.placeholder_token_id} must be a language token id in "
                    f"[0, vocab_size={self.vocab_size}): choose a reserved text token (the id your DirectToken "
                    "shards hold at image positions); a text-only run needs none (--model.image_path false)"
                )

        @property
        def has_image_path(self) -> bool:
            """Whether the model has the VQ image path (else it is a Glm4MoeLite model)."""
            return self.vq_codebook is not None

        def option_values(self) -> dict[str, Any]:
            """The Decoder's model-level options, and ``image_path``: whether the tree has the image path."""
            return {**Decoder.Config.option_values(self), "image_path": self.has_image_path}

        def mtp_block(self) -> MTP.Config:
            """``use_mtp=True``: the GLM-4.7-Flash nextn block (``glm_with_mtp``, its default loss weight)."""
            return glm_with_mtp(self.without_options()).mtp

        @property
        def output_size(self) -> int:
            """Rows of the head: ``vocab_size + codebook_size`` (the joint head), ``vocab_size`` without image path."""
            return self.vocab_size + (self.codebook_size if self.has_image_path else 0)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.vq_codebook: Embedding | None = None
        self.vq_to_llm_proj: Linear | None = None
        if config.has_image_path:
            self.vq_codebook = config.vq_codebook.build(
                num_embeddings=config.codebook_size, embedding_dim=config.vq_embed_dim
            )
            self.vq_to_llm_proj = config.vq_to_llm_proj.build(in_features=config.vq_embed_dim, out_features=config.dim)
            if config.freeze_vq:
                self.vq_codebook.weight.requires_grad_(False)
        self.hf_passthrough: dict[str, torch.Tensor] = {}
        """HF keys we do not model (other ``model.vqmodel.*``; with MTP off, the GLM-4.7-Flash nextn layer),
        written back unchanged by save_pretrained."""

    def lm_head_out_features(self) -> int:
        return self.config.output_size

    @classmethod
    def split_inputs_for_cp(
        cls, inputs: Mapping[str, Any], *, ranges: Sequence[tuple[int, int]], seqlen: int
    ) -> dict[str, Any]:
        """Keep the image positions in the pieces ``ranges`` of each row, renumbered into the local stream (the
        pieces concatenated); and, for multi-token prediction, the images one token AFTER each piece's positions
        (``mtp_visual_indices`` / ``mtp_vq_codes``: the next token of a piece's last position lives in the next
        piece, on another rank). Codes are computed from ids, so the MTP input needs no exchange."""
        out = dict(inputs)
        flat, codes = inputs.get("visual_indices"), inputs.get("vq_codes")
        if flat is not None:
            out["visual_indices"], keep = _local_positions(flat, ranges=ranges, seqlen=seqlen, shift=0)
            if codes is not None:
                out["vq_codes"] = codes[keep]
                out["mtp_visual_indices"], out["mtp_vq_codes"] = next_token_images(
                    flat, codes, ranges=ranges, seqlen=seqlen
                )
        return out

    def host_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The image-input checks of ``embed``, run here on the HOST batch (free: no device involved), so the
        forward reads nothing back (``image_inputs_checked``)."""
        if "input_ids" not in batch:
            return {}
        self.check_image_inputs(batch["input_ids"], visual_indices=batch.get("visual_indices"),
                                vq_codes=batch.get("vq_codes"))  # fmt: skip
        return {"image_inputs_checked": True}

    def check_image_inputs(
        self, input_ids: torch.Tensor, *, visual_indices: torch.Tensor | None, vq_codes: torch.Tensor | None
    ) -> None:
        """Raise ValueError unless there are as many codes as placeholders, every code lies inside the codebook,
        and ``visual_indices`` (when given) are exactly the placeholder positions, strictly increasing. Reads the
        statistics back once: call it on host tensors (``host_inputs``) where it costs no device sync."""
        c = self.config
        n_codes = 0 if vq_codes is None else vq_codes.numel()
        if not c.has_image_path:  # a Glm4MoeLite model: the placeholder id is an ordinary token
            if n_codes:
                raise ValueError(
                    f"the batch holds {n_codes} image codes (vq_codes) but the model has no image path: train image "
                    "data with --model.image_path true (a DirectToken source turns it on)"
                )
            return
        is_image = input_ids.reshape(-1) == c.placeholder_token_id
        if n_codes == 0:
            n_placeholders = int(is_image.sum())
            if n_placeholders:
                raise ValueError(
                    f"input_ids hold {n_placeholders} image placeholders (id {c.placeholder_token_id}) but 0 "
                    "vq_codes were given: every placeholder needs exactly one code"
                )
            return
        vq_codes = vq_codes.reshape(-1)
        if visual_indices is None:
            in_order = torch.ones((), dtype=torch.bool, device=is_image.device)
        else:
            N = is_image.numel()
            visual_indices = visual_indices.reshape(-1)
            in_bounds = (visual_indices >= 0) & (visual_indices < N)
            at_image = is_image[visual_indices.clamp(0, N - 1)] & in_bounds
            increasing = (visual_indices[1:] > visual_indices[:-1]).all()
            in_order = at_image.all() & increasing & (visual_indices.numel() == n_codes)
        stats = torch.stack([is_image.sum(), vq_codes.min(), vq_codes.max(), in_order.long()])
        n_placeholders, lo, hi, ordered = stats.tolist()  # the one read of all the checks
        if n_placeholders != n_codes:
            raise ValueError(
                f"input_ids hold {n_placeholders} image placeholders (id {c.placeholder_token_id}) but {n_codes} "
                "vq_codes were given: every placeholder needs exactly one code"
            )
        if lo < 0 or hi >= c.codebook_size:
            raise ValueError(f"vq_codes hold {lo if lo < 0 else hi}, outside the codebook [0, {c.codebook_size})")
        if not ordered:
            raise ValueError(
                f"visual_indices ({visual_indices.numel()}) must be the flat positions of the {n_codes} "
                "placeholder tokens, in increasing order, each once"
            )

    def embed(
        self,
        input_ids: torch.Tensor,
        *,
        visual_indices: torch.Tensor | None = None,
        vq_codes: torch.Tensor | None = None,
        checked: bool = False,
    ) -> torch.Tensor:
        """Token embeddings with image positions replaced by projected codebook vectors.

        Checks the inputs first (``check_image_inputs``: one host read for all the checks) unless ``checked``: the
        trainer's host prep (``host_inputs``) checked them on the host batch, so the forward syncs nothing.
        """
        if not checked:
            self.check_image_inputs(input_ids, visual_indices=visual_indices, vq_codes=vq_codes)
        h_BTD = self.embed_tokens(input_ids)
        c = self.config
        B, T, D = h_BTD.shape
        n_codes = 0 if vq_codes is None else vq_codes.numel()
        if not c.has_image_path or n_codes == 0:
            return h_BTD
        vq_codes = vq_codes.reshape(-1)
        if visual_indices is None:
            visual_indices = (input_ids.reshape(-1) == c.placeholder_token_id).nonzero().squeeze(-1)
        else:
            visual_indices = visual_indices.reshape(-1)
        img_ND = self.image_embeddings(vq_codes).to(h_BTD.dtype)
        return h_BTD.reshape(B * T, D).index_put((visual_indices,), img_ND).view(B, T, D)

    def image_embeddings(self, vq_codes: torch.Tensor) -> torch.Tensor:
        """``[N]`` codes -> ``[N, dim]``: ``vq_to_llm_proj`` of the (L2-normalised) frozen codebook rows."""
        c = self.config
        codebook = self.vq_codebook.weight
        if c.freeze_vq:
            codebook = codebook.detach()
        vec_ND = F.embedding(vq_codes, codebook)
        if c.vq_l2_normalize:
            vec_ND = F.normalize(vec_ND.float(), dim=-1).to(vec_ND.dtype)
        # the projection may compute in bf16 (FSDP mixed precision) while the frozen codebook stays fp32
        return self.vq_to_llm_proj(vec_ND.to(self.vq_to_llm_proj.weight.dtype))

    def embed_next_tokens_with_images(
        self,
        mtp_input_ids: torch.Tensor,
        *,
        input_ids: torch.Tensor,
        visual_indices: torch.Tensor | None,
        vq_codes: torch.Tensor | None,
        mtp_visual_indices: torch.Tensor | None,
        mtp_vq_codes: torch.Tensor | None,
    ) -> torch.Tensor:
        """MTP input: the embedding of every position's next token, an image code's projected codebook vector
        where the next token is an image token (exactly the vector the trunk embeds there), zeros where the
        document has no next token. ``mtp_visual_indices`` / ``mtp_vq_codes`` come from the context-parallel
        split; without it they are derived from this batch's own image positions."""
        e_BTD = self.embed_next_tokens(mtp_input_ids)
        if mtp_visual_indices is None:
            if vq_codes is None or vq_codes.numel() == 0:
                return e_BTD
            if visual_indices is None:
                visual_indices = (input_ids.reshape(-1) == self.config.placeholder_token_id).nonzero().squeeze(-1)
            T = input_ids.shape[-1]
            mtp_visual_indices, mtp_vq_codes = next_token_images(
                visual_indices.reshape(-1), vq_codes.reshape(-1), ranges=[(0, T)], seqlen=T
            )
        B, T, D = e_BTD.shape
        # an image token that starts a document is nobody's next token: that position holds no next id
        keep = mtp_input_ids.reshape(-1)[mtp_visual_indices] >= 0
        idx, codes = mtp_visual_indices[keep], mtp_vq_codes[keep]
        if idx.numel() == 0:
            return e_BTD
        return e_BTD.reshape(B * T, D).index_put((idx,), self.image_embeddings(codes).to(e_BTD.dtype)).view(B, T, D)

    def stage_inputs(
        self,
        input_ids: torch.Tensor,
        *,
        mtp_input_ids: torch.Tensor | None,
        visual_indices: torch.Tensor | None = None,
        vq_codes: torch.Tensor | None = None,
        mtp_visual_indices: torch.Tensor | None = None,
        mtp_vq_codes: torch.Tensor | None = None,
        image_inputs_checked: bool = False,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """The text + image embedding and (with MTP) the next tokens': ``forward``'s first step, and pipeline stage
        0's (``Decoder.forward_stage``)."""
        h = self.embed(input_ids, visual_indices=visual_indices, vq_codes=vq_codes, checked=image_inputs_checked)
        mtp_embeds = None
        if self.config.mtp is not None and mtp_input_ids is not None:
            mtp_embeds = self.embed_next_tokens_with_images(
                mtp_input_ids, input_ids=input_ids, visual_indices=visual_indices, vq_codes=vq_codes,
                mtp_visual_indices=mtp_visual_indices, mtp_vq_codes=mtp_vq_codes,
            )  # fmt: skip
        return h, mtp_embeds, None

    def forward(
        self,
        input_ids: torch.Tensor,
        *carry: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        visual_indices: torch.Tensor | None = None,
        vq_codes: torch.Tensor | None = None,
        mtp_input_ids: torch.Tensor | None = None,
        mtp_visual_indices: torch.Tensor | None = None,
        mtp_vq_codes: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        image_inputs_checked: bool = False,
    ) -> torch.Tensor | ModelOutput:
        """``[B, T]`` ids (+ image codes) -> logits ``[B, T, vocab_size + codebook_size]``. ``token_mask``: the
        batch's (False on padding, left out of the MoE router statistics; ``Decoder.forward``).
        ``image_inputs_checked``: the host prep validated the image inputs (``host_inputs``): no check here.

        With an MTP block and ``mtp_input_ids``: ``ModelOutput(logits, aux_loss, mtp_logits)``, the MTP head
        predicting token ``t + 2`` over the same joint text + image-code vocabulary (``Decoder``). A pipeline stage
        runs ``Decoder.forward_stage``.
        """
        if self.pipeline_stage is not None:
            return self.forward_stage(
                input_ids, *carry, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                cu_seqlens_host=cu_seqlens_host, mtp_input_ids=mtp_input_ids, token_mask=token_mask,
                visual_indices=visual_indices, vq_codes=vq_codes, mtp_visual_indices=mtp_visual_indices,
                mtp_vq_codes=mtp_vq_codes, image_inputs_checked=image_inputs_checked,
            )  # fmt: skip
        h, mtp_embeds, _ = self.stage_inputs(
            input_ids, mtp_input_ids=mtp_input_ids, visual_indices=visual_indices, vq_codes=vq_codes,
            mtp_visual_indices=mtp_visual_indices, mtp_vq_codes=mtp_vq_codes, image_inputs_checked=image_inputs_checked,
        )  # fmt: skip
        return self.forward_embedded(
            h,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            cu_seqlens_host=cu_seqlens_host,
            mtp_embeds=mtp_embeds,
            token_mask=token_mask,
        )

    def input_flops(self, batch: Mapping[str, Any]) -> float:
        """The image path: ``vq_to_llm_proj`` on every image code (once more for the MTP block's next-token images);
        the codebook lookup is free and its rows need no gradient (forward + weight gradient only). 0 without an
        image path (a Glm4MoeLite model)."""
        if self.vq_to_llm_proj is None:
            return 0.0
        codes = batch.get("vq_codes")
        n = 0 if codes is None else codes.numel()
        if self.mtp is not None:  # embed_next_tokens_with_images projects (nearly) the same codes again
            mtp_codes = batch.get("mtp_vq_codes")
            n += n if mtp_codes is None else mtp_codes.numel()
        return matmul_flops(self.vq_to_llm_proj, n, input_grad=False)

    def active_params(self) -> int:
        """Backbone + head parameters a token uses (the image-path codebook and projection excluded)."""
        image_path = sum(p.numel() for m in (self.vq_codebook, self.vq_to_llm_proj) if m is not None for p in m.parameters())
        return Decoder.active_params(self) - image_path


def nextn_reader(
    read: Callable[[Mapping[str, Any]], GlmImageMoeModel.Config],
) -> Callable[[Mapping[str, Any]], GlmImageMoeModel.Config]:
    """An HF config reader that also turns the MTP block on: the GLM-4.7-Flash nextn layer, with the
    checkpoint's ``num_nextn_predict_layers`` (``from_pretrained(path, mtp=True)``)."""

    def reader(hf: Mapping[str, Any]) -> GlmImageMoeModel.Config:
        count = (hf.get("text_config") or hf).get("num_nextn_predict_layers", 0)
        if not count:
            raise ValueError(
                "mtp=True but config.json has no num_nextn_predict_layers (the checkpoint ships no nextn layer): "
                "load without mtp, or start a fresh block with glm_with_mtp(config)"
            )
        if count != 1:
            raise NotImplementedError(f"config.json num_nextn_predict_layers={count}: only 1 is implemented")
        return glm_with_mtp(read(hf))

    return reader


def glm_with_mtp(config: GlmImageMoeModel.Config, *, loss_weight: float = MTP_LOSS_WEIGHT) -> GlmImageMoeModel.Config:
    """``config`` with the GLM-4.7-Flash nextn (MTP) block on, trained with weight ``loss_weight``."""
    # vLLM glm4_moe_lite_mtp.py: the nextn layer is an MoE layer like the last ones; position 0 zeroed
    return with_mtp(config, layer_index=-1, zero_embedding_at_document_start=True, loss_weight=loss_weight)


def _local_positions(
    flat: torch.Tensor, *, ranges: Sequence[tuple[int, int]], seqlen: int, shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local flat positions, which entries of flat)`` of the positions ``flat - shift`` (flat over a ``[B,
    seqlen]`` batch, ``shift`` within a row) that lie in the pieces ``ranges``, in the local stream: every row
    the pieces concatenated in the order given. Sorted, as ``flat`` is (pieces are in increasing order)."""
    row, col = flat // seqlen, flat % seqlen - shift
    local_len = sum(hi - lo for lo, hi in ranges)
    local = torch.full_like(flat, -1)
    offset = 0
    for lo, hi in ranges:
        inside = (col >= lo) & (col < hi)
        local = torch.where(inside, row * local_len + offset + (col - lo), local)
        offset += hi - lo
    keep = local >= 0
    local, keep_idx = local[keep], keep.nonzero().squeeze(-1)
    order = torch.argsort(local)  # a row's second balanced piece comes after its first in the local stream
    return local[order], keep_idx[order]


def next_token_images(
    visual_indices: torch.Tensor, vq_codes: torch.Tensor, *, ranges: Sequence[tuple[int, int]], seqlen: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the positions in the pieces ``ranges`` (global ``[lo, hi)`` columns) of every row of a ``[B,
    seqlen]`` batch: the local flat positions whose NEXT token is an image token (the pieces concatenated per
    row), and that token's code (``visual_indices`` are flat over the whole batch). A piece's last position
    takes the image token that opens the next piece."""
    local, keep = _local_positions(visual_indices, ranges=ranges, seqlen=seqlen, shift=1)
    return local, vq_codes[keep]


def glm_image_moe_config(
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    moe_intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    n_routed_experts: int,
    num_experts_per_tok: int,
    q_lora_rank: int | None,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    codebook_size: int,
    vq_embed_dim: int,
    placeholder_token_id: int,
    n_shared_experts: int = 1,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.8,
    norm_topk_prob: bool = True,
    mlp_layer_types: Sequence[MlpLayerType] | None = None,
    rope_theta: float = 10000.0,
    rope_interleave: bool = True,
    rms_norm_eps: float = 1e-5,
    attention_bias: bool = False,
    initializer_range: float = 0.02,
    pad_token_id: int | None = None,
    max_position_embeddings: int = 202752,
    image_start_token_id: int | None = None,
    image_end_token_id: int | None = None,
    vq_l2_normalize: bool = True,
    freeze_vq: bool = True,
    vq_proj_bias: bool = False,
    grouped_mm_impl: str = "auto",
    hf_extra: dict[str, Any] | None = None,
    num_nextn_predict_layers: int = 0,
    mtp_loss_weight: float = MTP_LOSS_WEIGHT,
    image_path: bool = True,
) -> GlmImageMoeModel.Config:
    """The one flavor builder: HF Glm4MoeLite/GlmImage hyper-parameters -> the config tree.

    ``mlp_layer_types`` decides dense vs MoE per layer (HF ignores ``first_k_dense_replace``);
    default ``["dense"] + ["sparse"] * (L - 1)``. ``num_nextn_predict_layers`` (GLM-4.7-Flash: 1; 0 = off)
    adds the MTP block: the nextn layer at index ``num_hidden_layers`` (MLA + MoE, vLLM
    ``glm4_moe_lite_mtp.py``), trained with weight ``mtp_loss_weight``. ``image_path=False``: no VQ image path
    (a Glm4MoeLite model; the ``codebook_size`` ... arguments are then only what ``--model.image_path true``
    would grow).
    """
    layer_types = list(mlp_layer_types) if mlp_layer_types is not None else ["dense"] + ["sparse"] * (num_hidden_layers - 1)
    if len(layer_types) != num_hidden_layers or set(layer_types) - {"dense", "sparse"}:
        raise ValueError(
            f"mlp_layer_types must list 'dense'/'sparse' for each of the {num_hidden_layers} layers, got {layer_types}"
        )

    def linear(bias: bool = False) -> Linear.Config:
        return Linear.Config(bias=bias, param_init=NormalInit.Config(std=initializer_range))

    def ffn(hidden: int) -> FeedForward.Config:
        return FeedForward.Config(hidden_dim=hidden, gate_proj=linear(), up_proj=linear(), down_proj=linear())

    def attention() -> MLAttention.Config:
        low_rank = q_lora_rank is not None
        return MLAttention.Config(
            n_heads=num_attention_heads,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            q_proj=None if low_rank else linear(),
            q_a_proj=linear(attention_bias) if low_rank else None,
            q_a_layernorm=RMSNorm.Config(eps=1e-6) if low_rank else None,
            q_b_proj=linear() if low_rank else None,
            kv_a_proj_with_mqa=linear(attention_bias),
            kv_a_layernorm=RMSNorm.Config(eps=1e-6),
            kv_b_proj=linear(),
            o_proj=linear(attention_bias),
            rope=RoPE.Config(theta=rope_theta, layout="interleaved" if rope_interleave else "half"),
        )

    def mlp(kind: MlpLayerType) -> FeedForward.Config | MoE.Config:
        if kind == "dense":
            return ffn(intermediate_size)
        return MoE.Config(
            num_experts=n_routed_experts,
            gate=Router.Config(
                top_k=num_experts_per_tok,
                score_func="sigmoid",
                n_group=n_group,
                topk_group=topk_group,
                norm_topk_prob=norm_topk_prob,
                route_scale=routed_scaling_factor,
                param_init=NormalInit.Config(std=initializer_range),
            ),
            experts=GroupedExperts.Config(
                hidden_dim=moe_intermediate_size,
                grouped_mm_impl=grouped_mm_impl,
                param_init=NormalInit.Config(std=initializer_range),
            ),
            shared_experts=ffn(moe_intermediate_size * n_shared_experts) if n_shared_experts > 0 else None,
        )

    layers = [
        TransformerBlock.Config(
            self_attn=attention(),
            mlp=mlp(kind),
            input_layernorm=RMSNorm.Config(eps=rms_norm_eps),
            post_attention_layernorm=RMSNorm.Config(eps=rms_norm_eps),
        )
        for kind in layer_types
    ]
    mtp = None
    if num_nextn_predict_layers:
        if num_nextn_predict_layers != 1:
            raise NotImplementedError(f"num_nextn_predict_layers={num_nextn_predict_layers}: only 1 is implemented")
        # vLLM builds the nextn layer as layer num_hidden_layers: sparse (past first_k_dense_replace)
        nextn = TransformerBlock.Config(
            self_attn=attention(),
            mlp=mlp("sparse" if "sparse" in layer_types else "dense"),
            input_layernorm=RMSNorm.Config(eps=rms_norm_eps),
            post_attention_layernorm=RMSNorm.Config(eps=rms_norm_eps),
        )
        mtp = mtp_config_like(
            nextn, norm=RMSNorm.Config(eps=rms_norm_eps), fc=linear(), zero_embedding_at_document_start=True,
            loss_weight=mtp_loss_weight,
        )  # fmt: skip
    return GlmImageMoeModel.Config(
        vocab_size=vocab_size,
        dim=hidden_size,
        layers=layers,
        mtp=mtp,
        embed_tokens=Embedding.Config(padding_idx=pad_token_id, param_init=NormalInit.Config(std=initializer_range)),
        norm=RMSNorm.Config(eps=rms_norm_eps),
        lm_head=linear(),
        codebook_size=codebook_size,
        vq_embed_dim=vq_embed_dim,
        placeholder_token_id=placeholder_token_id,
        image_start_token_id=image_start_token_id,
        image_end_token_id=image_end_token_id,
        vq_l2_normalize=vq_l2_normalize,
        freeze_vq=freeze_vq,
        vq_codebook=Embedding.Config(param_init=NormalInit.Config(std=initializer_range)) if image_path else None,
        vq_to_llm_proj=linear(vq_proj_bias) if image_path else None,
        max_position_embeddings=max_position_embeddings,
        hf_extra=dict(hf_extra or {}),
    )
