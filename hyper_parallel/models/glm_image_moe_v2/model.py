"""GlmImageMoe: Glm4MoeLite decoder layers plus the DirectToken VQ image path (docs/design.md section 4).

    h            = embed_tokens(input_ids)                       # placeholders at image positions
    h[visual]    = vq_to_llm_proj(l2norm(codebook[vq_codes]))    # frozen codebook, trainable projection
    logits       = lm_head(norm(layers(h)))                      # rows [0, V) text, [V, V + C) image codes

One parameterised builder, ``glm_image_moe_config``, turns HF-style hyper-parameters into the config
tree; ``GlmImageMoeModel.Config.from_hf`` / ``to_hf`` convert to and from the HF ``config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
import tyro

from hyper_parallel.models.common.block import TransformerBlock
from hyper_parallel.models.common.decoder import Decoder
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.protocols.param_init import NormalInit

__all__ = ["GlmImageMoeModel", "glm_image_moe_config"]

MlpLayerType = Literal["dense", "sparse"]


class GlmImageMoeModel(Decoder):
    """Text + VQ-image autoregressive LM over ``lang_vocab_size + codebook_size`` output rows."""

    input_keys: ClassVar[tuple[str, ...]] = ("visual_indices", "vq_codes")

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        codebook_size: int
        """VQ codebook entries C (HF ``vq_config.num_embeddings``); image labels are ``code + vocab_size``."""
        vq_embed_dim: int
        """Width of a codebook vector (HF ``vq_config.embed_dim``)."""
        placeholder_token_id: int
        """Token id that marks every image position in ``input_ids`` (must be < vocab_size)."""
        image_start_token_id: int | None = None
        """Token id opening an image (kept for the HF config; the model does not need it)."""
        image_end_token_id: int | None = None
        """Token id closing an image (kept for the HF config; the model does not need it)."""
        vq_l2_normalize: bool = True
        """L2-normalise codebook rows before the projection (the GlmImage quantizer's semantics)."""
        freeze_vq: bool = True
        """Keep the codebook frozen: no gradient, never updated, ignored by FSDP."""
        vq_codebook: Embedding.Config = field(default_factory=Embedding.Config)
        """The VQ codebook ``[codebook_size, vq_embed_dim]`` (HF ``model.vqmodel.quantize.embedding``)."""
        vq_to_llm_proj: Linear.Config = field(default_factory=Linear.Config)
        """Projection of codebook vectors into the hidden space ``[dim, vq_embed_dim]``; always trains."""
        max_position_embeddings: int = 202752
        """Longest position the checkpoint was trained for (kept for the HF config)."""
        hf_extra: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
        """Other HF text_config / vq_config fields, written back unchanged on export (not used here)."""

        def __post_init__(self) -> None:
            if not 0 <= self.placeholder_token_id < self.vocab_size:
                raise ValueError(
                    f"placeholder_token_id={self.placeholder_token_id} must be a language token id in "
                    f"[0, vocab_size={self.vocab_size}): choose a reserved text token"
                )

        @classmethod
        def from_hf(cls, hf: dict[str, Any]) -> GlmImageMoeModel.Config:
            """From an HF ``config.json`` dict: GlmImageMoe (``text_config`` + ``vq_config``) or plain Glm4MoeLite."""
            return _config_from_hf(hf)

        def to_hf(self, *, text_only: bool = False) -> dict[str, Any]:
            """The HF ``config.json`` dict (GlmImageMoe, or plain Glm4MoeLite with ``text_only``)."""
            return _config_to_hf(self, text_only=text_only)

        @property
        def output_size(self) -> int:
            """Rows of the joint head: ``vocab_size + codebook_size``."""
            return self.vocab_size + self.codebook_size

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.vq_codebook = config.vq_codebook.build(num_embeddings=config.codebook_size, embedding_dim=config.vq_embed_dim)
        self.vq_to_llm_proj = config.vq_to_llm_proj.build(in_features=config.vq_embed_dim, out_features=config.dim)
        if config.freeze_vq:
            self.vq_codebook.weight.requires_grad_(False)
        self.hf_passthrough: dict[str, torch.Tensor] = {}
        """HF keys we do not model (other ``model.vqmodel.*``), written back unchanged by save_pretrained."""

    def lm_head_out_features(self) -> int:
        return self.config.output_size

    @classmethod
    def split_inputs_for_cp(cls, inputs: Mapping[str, Any], *, lo: int, hi: int, seqlen: int) -> dict[str, Any]:
        """Keep the image positions in tokens ``[lo, hi)`` of each row, renumbered into the local stream."""
        out = dict(inputs)
        flat = inputs.get("visual_indices")
        if flat is not None:
            row, col = flat // seqlen, flat % seqlen
            keep = (col >= lo) & (col < hi)
            out["visual_indices"] = row[keep] * (hi - lo) + (col[keep] - lo)
            if inputs.get("vq_codes") is not None:
                out["vq_codes"] = inputs["vq_codes"][keep]
        return out

    def embed(
        self,
        input_ids: torch.Tensor,
        *,
        visual_indices: torch.Tensor | None = None,
        vq_codes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with image positions replaced by projected codebook vectors.

        Checks (one host sync for all of them): as many codes as placeholders, every code inside the
        codebook, and ``visual_indices`` exactly the placeholder positions, strictly increasing.
        """
        h_BTD = self.embed_tokens(input_ids)
        c = self.config
        B, T, D = h_BTD.shape
        is_image = input_ids.reshape(-1) == c.placeholder_token_id
        n_codes = 0 if vq_codes is None else vq_codes.numel()
        if n_codes == 0:
            n_placeholders = int(is_image.sum())
            if n_placeholders:
                raise ValueError(
                    f"input_ids hold {n_placeholders} image placeholders (id {c.placeholder_token_id}) but 0 "
                    "vq_codes were given: every placeholder needs exactly one code"
                )
            return h_BTD
        vq_codes = vq_codes.reshape(-1)
        if visual_indices is None:
            visual_indices = is_image.nonzero().squeeze(-1)
            in_order = torch.ones((), dtype=torch.bool, device=is_image.device)
        else:
            visual_indices = visual_indices.reshape(-1)
            in_bounds = (visual_indices >= 0) & (visual_indices < B * T)
            at_image = is_image[visual_indices.clamp(0, B * T - 1)] & in_bounds
            increasing = (visual_indices[1:] > visual_indices[:-1]).all()
            in_order = at_image.all() & increasing & (visual_indices.numel() == n_codes)
        stats = torch.stack([is_image.sum(), vq_codes.min(), vq_codes.max(), in_order.long()])
        n_placeholders, lo, hi, ordered = stats.tolist()  # the one host sync of the image path
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
        codebook = self.vq_codebook.weight
        if c.freeze_vq:
            codebook = codebook.detach()
        vec_ND = F.embedding(vq_codes, codebook)
        if c.vq_l2_normalize:
            vec_ND = F.normalize(vec_ND.float(), dim=-1).to(vec_ND.dtype)
        # the projection may compute in bf16 (FSDP mixed precision) while the frozen codebook stays fp32
        img_ND = self.vq_to_llm_proj(vec_ND.to(self.vq_to_llm_proj.weight.dtype)).to(h_BTD.dtype)
        return h_BTD.reshape(B * T, D).index_put((visual_indices,), img_ND).view(B, T, D)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        visual_indices: torch.Tensor | None = None,
        vq_codes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[B, T]`` ids (+ image codes) -> logits ``[B, T, vocab_size + codebook_size]``."""
        h = self.embed(input_ids, visual_indices=visual_indices, vq_codes=vq_codes)
        return self.forward_embedded(
            h, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_host=cu_seqlens_host
        )

    def get_nparams_and_flops(self, seq_len: int) -> tuple[int, float]:
        """Decoder's count; the frozen codebook is not trained, so it adds no training FLOPs."""
        total, flops = Decoder.get_nparams_and_flops(self, seq_len)
        return total, flops - 6.0 * self.vq_codebook.weight.numel()

    def active_params(self) -> int:
        """Backbone + head parameters a token uses (the image-path codebook and projection excluded)."""
        image_path = self.vq_codebook.weight.numel() + sum(p.numel() for p in self.vq_to_llm_proj.parameters())
        return Decoder.active_params(self) - image_path


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
) -> GlmImageMoeModel.Config:
    """The one flavor builder: HF Glm4MoeLite/GlmImage hyper-parameters -> the config tree.

    ``mlp_layer_types`` decides dense vs MoE per layer (HF ignores ``first_k_dense_replace``);
    default ``["dense"] + ["sparse"] * (L - 1)``.
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
    return GlmImageMoeModel.Config(
        vocab_size=vocab_size,
        dim=hidden_size,
        layers=layers,
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
        vq_codebook=Embedding.Config(param_init=NormalInit.Config(std=initializer_range)),
        vq_to_llm_proj=linear(vq_proj_bias),
        max_position_embeddings=max_position_embeddings,
        hf_extra=dict(hf_extra or {}),
    )


# ---- HF config.json <-> Config ---------------------------------------------------------------

_LITE_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_shared_experts", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "mlp_layer_types", "rms_norm_eps", "attention_bias",
    "initializer_range", "pad_token_id", "max_position_embeddings", "rope_interleave",
)  # fmt: skip


def _rope_theta(text: dict[str, Any]) -> float:
    params = text.get("rope_parameters") or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise NotImplementedError(
            f"rope_parameters.rope_type={rope_type!r} is not wired into glm_image_moe_config yet; "
            "only 'default' RoPE checkpoints load"
        )
    return float(params.get("rope_theta", text.get("rope_theta", 10000.0)))


def _config_from_hf(hf: dict[str, Any]) -> GlmImageMoeModel.Config:
    model_type = hf.get("model_type")
    if model_type == "glm_image_moe":
        text, vq = dict(hf["text_config"]), dict(hf["vq_config"])
        lang_vocab = int(hf.get("lang_vocab_size", text["vocab_size"]))
        extras = {
            "placeholder_token_id": hf["placeholder_token_id"],
            "image_start_token_id": hf.get("image_start_token_id"),
            "image_end_token_id": hf.get("image_end_token_id"),
            "codebook_size": vq["num_embeddings"],
            "vq_embed_dim": vq["embed_dim"],
            "vq_l2_normalize": hf.get("vq_l2_normalize", True),
            "freeze_vq": hf.get("freeze_vq", True),
            "vq_proj_bias": hf.get("vq_to_llm_proj_bias", False),
        }
        hf_extra = {"text_config": _rest(text), "vq_config": _rest(vq, keep=("num_embeddings", "embed_dim"))}
    elif model_type == "glm4_moe_lite":
        text, lang_vocab = dict(hf), int(hf["vocab_size"])
        # A text-only checkpoint has no image part: take GlmImage's defaults; override in the recipe.
        extras = {
            "placeholder_token_id": hf.get("placeholder_token_id", lang_vocab - 1),
            "codebook_size": 16384,
            "vq_embed_dim": 2048,
        }
        hf_extra = {"text_config": _rest(text)}
    else:
        raise ValueError(f"config.json model_type={model_type!r}: expected 'glm_image_moe' or 'glm4_moe_lite'")
    kwargs = {k: text[k] for k in _LITE_KEYS if k in text}
    kwargs["vocab_size"] = lang_vocab
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in kwargs]
    if missing:
        raise ValueError(f"config.json is missing {missing} (in text_config for glm_image_moe)")
    return glm_image_moe_config(**_lite_defaults(kwargs), rope_theta=_rope_theta(text), **extras, hf_extra=hf_extra)


def _lite_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    # HF Glm4MoeLiteConfig defaults for fields a config.json may omit.
    defaults = dict(
        intermediate_size=10240, moe_intermediate_size=1536, n_routed_experts=64, num_experts_per_tok=4,
        q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    )  # fmt: skip
    return {**defaults, **kwargs}


def _rest(d: dict[str, Any], keep: Sequence[str] = ()) -> dict[str, Any]:
    skip = set(_LITE_KEYS) | {"rope_parameters", "rope_theta", "model_type", "architectures"} | set(keep)
    return {k: v for k, v in d.items() if k not in skip and not k.startswith("_")}


def _config_to_hf(cfg: GlmImageMoeModel.Config, *, text_only: bool) -> dict[str, Any]:
    first = cfg.layers[0].self_attn
    moe = next((layer.mlp for layer in cfg.layers if isinstance(layer.mlp, MoE.Config)), None)
    dense = next((layer.mlp for layer in cfg.layers if isinstance(layer.mlp, FeedForward.Config)), None)
    shared = moe.shared_experts if moe is not None else None
    moe_hidden = moe.experts.hidden_dim if moe is not None else 0
    text = {
        **cfg.hf_extra.get("text_config", {}),
        "model_type": "glm4_moe_lite",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": dense.hidden_dim if dense is not None else 4 * cfg.dim,
        "moe_intermediate_size": moe_hidden,
        "num_hidden_layers": len(cfg.layers),
        "num_attention_heads": first.n_heads,
        "num_key_value_heads": first.n_heads,
        "q_lora_rank": first.q_lora_rank,
        "kv_lora_rank": first.kv_lora_rank,
        "qk_nope_head_dim": first.qk_nope_head_dim,
        "qk_rope_head_dim": first.qk_rope_head_dim,
        "v_head_dim": first.v_head_dim,
        "n_routed_experts": moe.num_experts if moe is not None else 0,
        "n_shared_experts": (shared.hidden_dim // moe_hidden) if shared is not None and moe_hidden else 0,
        "num_experts_per_tok": moe.gate.top_k if moe is not None else 0,
        "n_group": moe.gate.n_group if moe is not None else 1,
        "topk_group": moe.gate.topk_group if moe is not None else 1,
        "routed_scaling_factor": moe.gate.route_scale if moe is not None else 1.0,
        "norm_topk_prob": moe.gate.norm_topk_prob if moe is not None else True,
        "mlp_layer_types": ["sparse" if isinstance(layer.mlp, MoE.Config) else "dense" for layer in cfg.layers],
        "rms_norm_eps": cfg.norm.eps,
        "attention_bias": bool(first.kv_a_proj_with_mqa.bias),
        "rope_parameters": {"rope_type": "default", "rope_theta": first.rope.theta},
        "rope_interleave": first.rope.layout == "interleaved",
        "pad_token_id": cfg.embed_tokens.padding_idx,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
    }
    if text_only:
        return {**text, "architectures": ["Glm4MoeLiteForCausalLM"]}
    return {
        "model_type": "glm_image_moe",
        "architectures": ["GlmImageMoeForConditionalGeneration"],
        "text_config": text,
        "vq_config": {
            **cfg.hf_extra.get("vq_config", {}),
            "model_type": "glm_image_vqmodel",
            "num_embeddings": cfg.codebook_size,
            "embed_dim": cfg.vq_embed_dim,
        },
        "lang_vocab_size": cfg.vocab_size,
        "placeholder_token_id": cfg.placeholder_token_id,
        "image_start_token_id": cfg.image_start_token_id,
        "image_end_token_id": cfg.image_end_token_id,
        "vq_l2_normalize": cfg.vq_l2_normalize,
        "freeze_vq": cfg.freeze_vq,
        "vq_to_llm_proj_bias": cfg.vq_to_llm_proj.bias,
        "tie_word_embeddings": False,
    }
