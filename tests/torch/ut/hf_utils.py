"""Test helpers for parity against HF ``transformers`` Glm4MoeLite modules (test-only oracle).

Stable API (other test files import it):
- ``tiny_lite_config(**overrides) -> Glm4MoeLiteConfig``: the tiny fp32 config of the reference doc §4.
- ``randomize_(module, seed)``: random weights everywhere (norm weights ~ 1 + noise, biases nonzero),
  so a parity test can catch a wrong eps, a missing norm or a misplaced bias.
- ``rope_config_from_hf(cfg)``, ``mla_config_from_hf(cfg)``, ``mlp_config_from_hf(cfg, hidden_dim=None)``,
  ``moe_config_from_hf(cfg)``, ``block_config_from_hf(cfg, i, moe=moe_config_from_hf)``,
  ``decoder_config_from_hf(cfg, moe=moe_config_from_hf)``: our configs with HF's shapes (``moe`` maps an
  HF config to the ``MoE.Config`` of sparse layers).
- ``load_from_hf_(ours, hf_module, strip="")``: copy HF parameters/buffers into ours (same names).
- ``max_grad_diff(ours, hf_module, strip="")``: max abs diff over every parameter gradient.
- ``hf_row_order(ours, name, t)`` / ``our_row_order(ours, name, t)``: the one tensor whose layout differs
  under the same name (Gated DeltaNet's grouped ``in_proj_qkv``/``conv1d`` rows) in HF's / our order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Glm4MoeLiteConfig

from hyper_parallel.models.common.attention import VarlenAttention
from hyper_parallel.models.common.block import TransformerBlock
from hyper_parallel.models.common.decoder import Decoder
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.mla import MLAttention
from hyper_parallel.models.common.moe import GroupedExperts, MoE, Router
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.models.common.rope import RoPE

__all__ = [
    "assert_backward_parity",
    "block_config_from_hf",
    "decoder_config_from_hf",
    "load_from_hf_",
    "max_grad_diff",
    "mla_config_from_hf",
    "mlp_config_from_hf",
    "moe_config_from_hf",
    "randomize_",
    "rope_config_from_hf",
    "tiny_lite_config",
]


def tiny_lite_config(**overrides: Any) -> Glm4MoeLiteConfig:
    """The reference doc's tiny Glm4MoeLite (3 layers: dense, sparse, sparse), sdpa attention, fp32."""
    kwargs: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=1.8, norm_topk_prob=True,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True, rms_norm_eps=1e-5, pad_token_id=None,
    )  # fmt: skip
    kwargs.update(overrides)
    cfg = Glm4MoeLiteConfig(**kwargs)
    cfg._attn_implementation = "sdpa"
    return cfg


@torch.no_grad()
def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Random parameters and float buffers: norms ``1 + 0.2*N``, biases ``0.1*N``, other weights ``0.1*N``."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        if not p.is_floating_point() or "inv_freq" in name:
            continue
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if "norm" in owner.rsplit(".", 1)[-1] and name.endswith(".weight"):
            p.copy_(1.0 + 0.2 * noise)
        else:
            p.copy_(0.1 * noise)
    return module


def rope_config_from_hf(cfg: Glm4MoeLiteConfig) -> RoPE.Config:
    """RoPE config from ``rope_parameters`` + ``rope_interleave``."""
    rp = dict(cfg.rope_parameters)
    layout = "interleaved" if cfg.rope_interleave else "half"
    common = dict(theta=rp["rope_theta"], layout=layout, partial_rotary_factor=rp.get("partial_rotary_factor", 1.0))
    if rp["rope_type"] == "default":
        return RoPE.Config(**common)
    if rp["rope_type"] != "yarn":
        raise NotImplementedError(rp["rope_type"])
    return RoPE.Config(
        **common,
        scaling="yarn",
        factor=rp["factor"],
        original_max_position_embeddings=rp["original_max_position_embeddings"],
        beta_fast=rp.get("beta_fast") or 32.0,
        beta_slow=rp.get("beta_slow") or 1.0,
        mscale=rp.get("mscale") or 0.0,
        mscale_all_dim=rp.get("mscale_all_dim") or 0.0,
        attention_factor=rp.get("attention_factor"),
        truncate=rp.get("truncate", True),
    )


def mla_config_from_hf(cfg: Glm4MoeLiteConfig, backend: str = "sdpa") -> MLAttention.Config:
    """``Glm4MoeLiteAttention`` shapes; ``attention_bias`` on q_a_proj, kv_a_proj_with_mqa and o_proj only."""
    bias = cfg.attention_bias
    low_rank = cfg.q_lora_rank is not None
    return MLAttention.Config(
        n_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        q_proj=None if low_rank else Linear.Config(bias=False),
        q_a_proj=Linear.Config(bias=bias) if low_rank else None,
        kv_a_proj_with_mqa=Linear.Config(bias=bias),
        o_proj=Linear.Config(bias=bias),
        rope=rope_config_from_hf(cfg),
        inner_attention=VarlenAttention.Config(backend=backend),
    )


def mlp_config_from_hf(cfg: Glm4MoeLiteConfig, hidden_dim: int | None = None) -> FeedForward.Config:
    """Dense ``Glm4MoeLiteMLP`` (``intermediate_size`` unless ``hidden_dim``)."""
    return FeedForward.Config(hidden_dim=hidden_dim or cfg.intermediate_size)


def moe_config_from_hf(cfg: Glm4MoeLiteConfig) -> MoE.Config:
    """Sparse ``Glm4MoeLiteMoE``: sigmoid group-limited router, fused experts, one shared expert."""
    return MoE.Config(
        num_experts=cfg.n_routed_experts,
        gate=Router.Config(
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            norm_topk_prob=cfg.norm_topk_prob,
            route_scale=cfg.routed_scaling_factor,
        ),
        experts=GroupedExperts.Config(hidden_dim=cfg.moe_intermediate_size),
        shared_experts=FeedForward.Config(hidden_dim=cfg.moe_intermediate_size * cfg.n_shared_experts),
    )


def block_config_from_hf(
    cfg: Glm4MoeLiteConfig, layer_idx: int, moe: Callable[[Glm4MoeLiteConfig], Any] = moe_config_from_hf
) -> TransformerBlock.Config:
    """Layer ``layer_idx``: dense or sparse per ``mlp_layer_types`` (sparse: ``moe(cfg)``)."""
    if cfg.mlp_layer_types[layer_idx] == "sparse":
        mlp = moe(cfg)
    else:
        mlp = mlp_config_from_hf(cfg)
    return TransformerBlock.Config(
        input_layernorm=RMSNorm.Config(eps=cfg.rms_norm_eps),
        self_attn=mla_config_from_hf(cfg),
        post_attention_layernorm=RMSNorm.Config(eps=cfg.rms_norm_eps),
        mlp=mlp,
    )


def decoder_config_from_hf(
    cfg: Glm4MoeLiteConfig, moe: Callable[[Glm4MoeLiteConfig], Any] = moe_config_from_hf
) -> Decoder.Config:
    """``Glm4MoeLiteModel`` + ``lm_head`` (keys: HF's with the ``model.`` prefix stripped)."""
    return Decoder.Config(
        vocab_size=cfg.vocab_size,
        dim=cfg.hidden_size,
        embed_tokens=Embedding.Config(padding_idx=cfg.pad_token_id),
        layers=[block_config_from_hf(cfg, i, moe) for i in range(cfg.num_hidden_layers)],
        norm=RMSNorm.Config(eps=cfg.rms_norm_eps),
        lm_head=Linear.Config(),
    )


def _hf_state(hf: nn.Module, strip: str) -> dict[str, torch.Tensor]:
    return {k.removeprefix(strip): v for k, v in hf.state_dict().items()}


def _grouped_qkv_owner(ours: nn.Module, name: str) -> GatedDeltaNet | None:
    parts = name.split(".")
    if parts[-2:] not in (["in_proj_qkv", "weight"], ["conv1d", "weight"]):
        return None
    owner = ours.get_submodule(".".join(parts[:-2]))
    return owner if isinstance(owner, GatedDeltaNet) else None


def hf_row_order(ours: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` (ours' tensor ``name``, e.g. its gradient) in HF's row order (changes DeltaNet's q/k/v rows only)."""
    owner = _grouped_qkv_owner(ours, name)
    return GatedDeltaNet.qkv_rows_to_hf(owner.config, t) if owner is not None else t


def our_row_order(ours: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """HF's tensor for ours' ``name`` in our row order (the inverse of ``hf_row_order``)."""
    owner = _grouped_qkv_owner(ours, name)
    return GatedDeltaNet.qkv_rows_from_hf(owner.config, t) if owner is not None else t


@torch.no_grad()
def load_from_hf_(ours: nn.Module, hf: nn.Module, strip: str = "") -> nn.Module:
    """Copy HF's state dict into ours; names must match exactly after removing ``strip`` (strict)."""
    state = {k: our_row_order(ours, k, v) for k, v in _hf_state(hf, strip).items()}
    ours.load_state_dict(state, strict=True)
    return ours


def max_grad_diff(ours: nn.Module, hf: nn.Module, strip: str = "") -> float:
    """Max abs diff over all parameter gradients (every HF param with a grad must have one in ours)."""
    mine = dict(ours.named_parameters())
    worst = 0.0
    for name, p in hf.named_parameters():
        name = name.removeprefix(strip)
        if p.grad is None:
            assert mine[name].grad is None, f"{name}: ours has a gradient, HF has none"
            continue
        assert mine[name].grad is not None, f"{name}: HF has a gradient, ours has none"
        worst = max(worst, (hf_row_order(ours, name, mine[name].grad) - p.grad).abs().max().item())
    return worst


def assert_backward_parity(
    out: torch.Tensor, out_hf: torch.Tensor, ours: nn.Module, hf: nn.Module,
    x_ours: torch.Tensor, x_hf: torch.Tensor, tol: float,
) -> None:  # fmt: skip
    """Backpropagate one random output gradient through both; outputs, parameter and input grads agree."""
    grad_out = torch.randn_like(out)
    out_hf.backward(grad_out)
    out.backward(grad_out)
    assert (out - out_hf).abs().max().item() <= tol
    assert max_grad_diff(ours, hf) <= tol
    assert (x_ours.grad - x_hf.grad).abs().max().item() <= tol
