"""``RoPE``: rotary position embedding, computed once per forward and applied inside each attention.

Numerics follow HF exactly (bit parity in fp32): ``inv_freq`` is built in fp32 on the CPU,
``freqs = pos.float() * inv_freq``, ``emb = cat(freqs, freqs)``, ``cos/sin = emb.cos/sin() * attention_factor``
in fp32, then cast to the activation dtype before the rotation.

Layouts (the ``layout`` field; it must match the checkpoint):
- ``"interleaved"``: HF ``rope_interleave=True`` (DeepSeek/Glm4MoeLite). Pairs ``(x[2i], x[2i+1])`` are rotated
  by ``pos * inv_freq[i]`` and written de-interleaved (``[rotated evens | rotated odds]``), exactly as HF's
  ``apply_rotary_pos_emb_interleave``. Q and K get the same permutation, so scores are unchanged.
- ``"half"``: NeoX ``rotate_half`` over the two halves of the rotary slice (HF ``apply_rotary_pos_emb``).

Tensor layout: q/k are ``[B, H, T, d]``; cos/sin are ``[B, T, rotary_dim]``. Only the first ``rotary_dim``
(``= int(head_dim * partial_rotary_factor)``) channels rotate; the rest pass through.

Interleaved M-RoPE (Qwen3-VL / Qwen3.5, the ``mrope_section`` field): ``position_ids`` may be ``[3, B, T]``
(rows t, h, w). Frequency slot ``j`` of ``rotary_dim / 2`` takes its position from row h when
``j % 3 == 1 and j < 3 * section[1]``, from row w when ``j % 3 == 2 and j < 3 * section[2]``, else from
row t (HF ``recomposition_frequencies``; always interleaved). ``[B, T]`` positions are 1-D RoPE, which
equals M-RoPE with three equal rows (text-only input).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from hyper_parallel.protocols.module import Module

__all__ = ["RoPE", "RoPECosSin", "apply_rotary_emb"]

RoPELayout = Literal["interleaved", "half"]


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # cos/sin are cat(freqs, freqs): the first half holds the per-pair angle (HF's exact op order).
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def apply_rotary_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, layout: RoPELayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``cos.shape[-1]`` channels of q ``[B, H, T, d]`` and k ``[B, Hk, T, d]``.

    ``cos``/``sin`` are ``[B, T, rotary_dim]`` (broadcast over heads). Channels past ``rotary_dim`` pass through.
    """
    rotate = _rotate_interleaved if layout == "interleaved" else _rotate_half
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]

    def one(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == rot:
            return rotate(x, cos, sin)
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)

    return one(q), one(k)


@dataclass(frozen=True, slots=True)
class RoPECosSin:
    """The per-forward rotary tables handed to every attention layer (computed once by the decoder)."""

    cos: torch.Tensor
    """``[B, T, rotary_dim]`` in the activation dtype."""
    sin: torch.Tensor
    """``[B, T, rotary_dim]`` in the activation dtype."""
    layout: RoPELayout
    """Rotation layout (see the module docstring)."""
    attention_scale: float = 1.0
    """Multiplier of the softmax scale the position encoding asks for (yarn ``mscale_all_dim``); 1 otherwise."""

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[B, H, T, d]`` and k ``[B, Hk, T, d]``."""
        return apply_rotary_emb(q, k, self.cos, self.sin, layout=self.layout)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RoPE(Module):
    """Rotary embedding tables; ``build(head_dim=...)`` with the dim of the slice that carries RoPE.

    Parameter-free: its only state is the non-persistent fp32 ``inv_freq`` buffer (recomputed by
    ``init_weights`` so a meta-device build works).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        theta: float = 10000.0
        """Base wavelength (HF ``rope_parameters["rope_theta"]``)."""
        layout: RoPELayout = "interleaved"
        """``interleaved`` = HF ``rope_interleave=True`` (Glm4MoeLite/DeepSeek); ``half`` = NeoX rotate_half."""
        partial_rotary_factor: float = 1.0
        """Fraction of ``head_dim`` that rotates (the first channels); the rest pass through."""
        scaling: Literal["default", "yarn"] = "default"
        """``default`` = plain RoPE; ``yarn`` = YaRN frequency interpolation (HF ``rope_type="yarn"``)."""
        factor: float = 1.0
        """yarn: context extension factor."""
        original_max_position_embeddings: int = 4096
        """yarn: context length of pre-training."""
        beta_fast: float = 32.0
        """yarn: high-rotation boundary of the linear ramp."""
        beta_slow: float = 1.0
        """yarn: low-rotation boundary of the linear ramp."""
        mscale: float = 0.0
        """yarn: ``mscale`` of the cos/sin attention factor (0 = unset, HF semantics)."""
        mscale_all_dim: float = 0.0
        """yarn: ``mscale_all_dim``; when set the softmax scale is multiplied by ``mscale(factor, it)**2``."""
        attention_factor: float | None = None
        """yarn: explicit cos/sin multiplier; None derives it from factor/mscale/mscale_all_dim as HF does."""
        truncate: bool = True
        """yarn: floor/ceil the correction range (HF default True)."""
        mrope_section: tuple[int, int, int] | None = None
        """Interleaved M-RoPE frequency slots of the t/h/w position rows (HF ``rope_parameters
        ["mrope_section"]``, Qwen3.5: ``(11, 11, 10)``); None = 1-D RoPE only (``[B, T]`` positions)."""

    def __init__(self, config: Config, *, head_dim: int) -> None:
        super().__init__(config)
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * config.partial_rotary_factor)
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(
                f"RoPE rotary dim int(head_dim={head_dim} * partial_rotary_factor={config.partial_rotary_factor})"
                f" = {self.rotary_dim} must be a positive even number: change partial_rotary_factor"
            )
        section = config.mrope_section
        if section is not None and (len(section) != 3 or min(section) < 0 or sum(section) != self.rotary_dim // 2):
            raise ValueError(
                f"RoPE.Config.mrope_section={section} must be 3 non-negative slot counts (t, h, w) summing to the "
                f"{self.rotary_dim // 2} frequency slots of rotary dim {self.rotary_dim}"
            )
        if config.scaling == "yarn" and config.factor <= 0:
            raise ValueError(f"RoPE.Config.factor must be > 0 for yarn, got {config.factor}")
        self.register_buffer("inv_freq", self._compute_inv_freq(), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        """fp32 inverse frequencies on the CPU, the exact expression HF uses."""
        cfg, dim = self.config, self.rotary_dim
        if cfg.scaling == "default":
            return 1.0 / (cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        pos_freqs = cfg.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (cfg.factor * pos_freqs)

        def correction_dim(num_rotations: float) -> float:
            return (dim * math.log(cfg.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
                2 * math.log(cfg.theta)
            )

        low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
        if cfg.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF: prevent a singular ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        return inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor

    def cos_sin_factor(self) -> float:
        """The multiplier HF applies to cos/sin (yarn ``attention_factor``; 1 for default RoPE)."""
        cfg = self.config
        if cfg.scaling == "default":
            return 1.0
        if cfg.attention_factor is not None:
            return cfg.attention_factor
        if cfg.mscale and cfg.mscale_all_dim:
            return float(_yarn_get_mscale(cfg.factor, cfg.mscale) / _yarn_get_mscale(cfg.factor, cfg.mscale_all_dim))
        return _yarn_get_mscale(cfg.factor)

    def attention_scale_factor(self) -> float:
        """Multiplier of the softmax scale (``mscale(factor, mscale_all_dim)**2`` for yarn; 1 otherwise)."""
        cfg = self.config
        if cfg.scaling == "default" or not cfg.mscale_all_dim:
            return 1.0
        m = _yarn_get_mscale(cfg.factor, cfg.mscale_all_dim)
        return m * m

    @torch.no_grad()
    def init_own_weights(self) -> None:
        super().init_own_weights()
        self.inv_freq.copy_(self._compute_inv_freq())

    def _mrope_freqs(self, freqs_3BTF: torch.Tensor) -> torch.Tensor:
        """``[B, T, rotary_dim / 2]``: each frequency slot's angle from its position row (HF's
        ``apply_interleaved_mrope``: row h on slots ``1::3`` below ``3 * section[1]``, row w on ``2::3`` below
        ``3 * section[2]``, row t elsewhere). Static strided slices: no index tensor, no data-dependent shape."""
        _, s_h, s_w = self.config.mrope_section
        out = freqs_3BTF[0].clone()
        out[..., 1 : 3 * s_h : 3] = freqs_3BTF[1, ..., 1 : 3 * s_h : 3]
        out[..., 2 : 3 * s_w : 3] = freqs_3BTF[2, ..., 2 : 3 * s_w : 3]
        return out

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, T, rotary_dim]`` from ``[B, T]`` (or M-RoPE ``[3, B, T]``) positions: computed in
        fp32, multiplied by the attention factor, cast."""
        inv_freq = self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv_freq
        if position_ids.dim() == 3:
            if self.config.mrope_section is None or position_ids.shape[0] != 3:
                raise ValueError(
                    f"position_ids of shape {list(position_ids.shape)}: [3, B, T] M-RoPE positions need "
                    "RoPE.Config.mrope_section; otherwise pass [B, T] positions"
                )
            freqs = self._mrope_freqs(freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = self.cos_sin_factor()
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[B, H, T, d]`` and k ``[B, Hk, T, d]`` with this RoPE's layout."""
        return apply_rotary_emb(q, k, cos, sin, layout=self.config.layout)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> RoPECosSin:
        """The tables of one forward from ``[B, T]`` (or M-RoPE ``[3, B, T]``) positions."""
        cos, sin = self.cos_sin(position_ids, dtype)
        return RoPECosSin(cos=cos, sin=sin, layout=self.config.layout, attention_scale=self.attention_scale_factor())

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={c.theta}, layout={c.layout}, "
            f"scaling={c.scaling}" + (f", mrope_section={c.mrope_section}" if c.mrope_section else "")
        )
