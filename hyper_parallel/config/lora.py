"""``--lora.*``: the LoRA option group (``LoRAConfig``). What it does to the model (the target names, the config
rewrite, the frozen base, checkpoints and export) is ``models/common/lora_policy.py``'s ``LoRAPolicy``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.config.errors import ConfigError

__all__ = ["ALL_LINEAR", "LoRAConfig"]

ALL_LINEAR = "all-linear"
"""The target that adapts every linear projection of the decoder layers and the vision tower (PEFT's name)."""


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """LoRA fine-tuning: low-rank adapters on the target projections, the rest of the model frozen."""

    rank: int = 0
    """Adapter rank r; 0: no LoRA."""
    alpha: float = 16.0
    """The update is alpha / rank * B A."""
    dropout: float = 0.0
    """Adapter input dropout (not on routed experts)."""
    rslora: bool = False
    """rsLoRA scaling alpha / sqrt(rank)."""
    targets: tuple[str, ...] = (ALL_LINEAR,)
    """HF module names to adapt (q_proj, experts, ...; README)."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full (e.g. lm_head, vq_to_llm_proj)."""
    share_experts: bool = False
    """One adapter shared by all routed experts."""
    export_vllm: bool = False
    """Also export vLLM's per-expert 2-D adapter form."""
    export_merged: bool = False
    """Also export the base with the adapters merged in."""

    def __post_init__(self) -> None:
        if isinstance(self.targets, str):
            self.targets = (self.targets,)
        if isinstance(self.modules_to_save, str):
            self.modules_to_save = (self.modules_to_save,)
        self.targets, self.modules_to_save = tuple(self.targets), tuple(self.modules_to_save)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"lora.rank={self.rank!r} must be an integer >= 0 (0: no LoRA)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        if self.enabled and not self.targets:
            raise ConfigError("lora.rank > 0 needs --lora.targets (e.g. all-linear, or q_proj v_proj experts)")
        if self.export_vllm and self.modules_to_save:
            raise ConfigError(
                f"lora.export_vllm with lora.modules_to_save={list(self.modules_to_save)}: vLLM serves no modules_to_save "
                "(vllm/lora/peft_helper.py); drop one of them, or serve --lora.export_merged"
            )

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``rank > 0``)."""
        return self.rank > 0
