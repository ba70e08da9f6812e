"""``--lora.*``: LoRA fine-tuning of a model config (``apply_lora``) and the names it trains (``lora_trainable_names``).

Targets are named as for HF models (PEFT's ``target_modules``): a target names a module by the last part(s) of
its path (``q_proj``, ``mlp.down_proj``, ``layers.0.self_attn.o_proj``), or a module that contains projections
(``shared_expert``, ``self_attn``, ``visual``, ``merger``, ``blocks``), which adapts every projection inside it.
What exists depends on the model:

- attention: ``q_proj`` ``k_proj`` ``v_proj`` ``o_proj``; MLA (GLM): ``q_a_proj`` ``q_b_proj`` (or ``q_proj``)
  ``kv_a_proj_with_mqa`` ``kv_b_proj`` ``o_proj``;
- Gated DeltaNet (Qwen3.5): ``in_proj_qkv`` ``in_proj_z`` ``in_proj_b`` ``in_proj_a`` ``out_proj``;
- MLPs: ``gate_proj`` ``up_proj`` ``down_proj`` (dense MLPs and the shared expert); ``shared_expert`` (Qwen's
  name) or ``shared_experts`` (GLM's, our field): every projection of the shared expert; ``shared_expert_gate``;
- ``experts``: the routed experts' fused ``gate_up_proj`` and ``down_proj``, one adapter per expert (one for all
  with ``--lora.share_experts``);
- vision tower (Qwen3-VL): ``qkv`` ``proj`` ``linear_fc1`` ``linear_fc2``, ``blocks``, ``merger``,
  ``deepstack_merger_list``, ``visual``; GlmImageMoe: ``vq_to_llm_proj``;
- ``all-linear``: every linear projection of the decoder layers (attention or DeltaNet, dense MLP, shared
  expert) and of the vision tower's blocks and mergers. Not the routed experts (fused weights, not linear
  layers, as in PEFT: add ``experts``), not ``shared_expert_gate`` (a scalar gate), ``vq_to_llm_proj`` or the
  vision patch embedding; and never the LM head, the embeddings, the router or the MTP block, which no target
  reaches (train them in full with ``--lora.modules_to_save``).

Everything that is not an adapter or in ``modules_to_save`` is frozen (no gradient, no optimizer state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.lora import LoRA, is_lora_param
from hyper_parallel.models.common.moe import GroupedExperts
from hyper_parallel.protocols.module import unwrapped_name

__all__ = ["ALL_LINEAR", "LoRAConfig", "apply_lora", "freeze_lora_base", "lora_targets", "lora_trainable_names"]

ALL_LINEAR = "all-linear"

_ALIASES = {"shared_expert": "shared_experts"}
"""HF names whose module is ours under another name (Qwen's ``mlp.shared_expert`` is our ``shared_experts``)."""

_NO_ADAPTER = ("lm_head", "mtp", "patch_embed")
"""Path parts under which no projection takes an adapter: the LM head, the MTP block (no HF model holds it, so no
PEFT adapter could), the vision patch embedding (an HF Conv3d)."""

_NOT_ALL_LINEAR = ("shared_expert_gate", "vq_to_llm_proj")
"""Projections adapted only when named: scalar gates and GlmImageMoe's codebook projection."""


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

    def adapter(self) -> LoRA.Config:
        """The per-module adapter settings."""
        return LoRA.Config(
            rank=self.rank, alpha=self.alpha, dropout=self.dropout, rslora=self.rslora, share_experts=self.share_experts
        )


def _parts(path: str) -> list[str]:
    return [_ALIASES.get(p, p) for p in path.split(".")] if path else []


def _names(pattern: str, path: str) -> bool:
    """Whether ``pattern`` (a module name, dotted or not) is a run of whole parts of ``path``: the module itself
    (PEFT's suffix rule) or a module that contains it."""
    want, have = _parts(pattern), _parts(path)
    n = len(want)
    return n > 0 and any(have[i : i + n] == want for i in range(len(have) - n + 1))


def _adaptable(model_config: Any) -> Iterator[tuple[str, Configurable.Config]]:
    """``(path, config)`` of every projection that can take an adapter (a ``Linear`` or fused experts)."""
    for path, cfg, _, _ in model_config.traverse((Linear.Config, GroupedExperts.Config)):
        if not any(part in _NO_ADAPTER for part in path.split(".")):
            yield path, cfg


def _in_all_linear(path: str, cfg: Any) -> bool:
    return isinstance(cfg, Linear.Config) and not any(part in _NOT_ALL_LINEAR for part in path.split("."))


def _module_paths(model_config: Any) -> list[str]:
    return [path for path, cfg, _, _ in model_config.traverse() if path and not isinstance(cfg, LoRA.Config)]


def _existing_names(adaptable: list[str]) -> list[str]:
    names: list[str] = []
    for path in adaptable:
        for part in path.split("."):
            if not part.isdigit() and part not in names and part != "layers":
                names.append(part)
    if any(".shared_experts." in f".{p}." for p in adaptable):
        names.append("shared_expert")
    return [ALL_LINEAR, *sorted(names)]


def lora_targets(model_config: Any, targets: Iterable[str]) -> list[str]:
    """Paths of the projections ``targets`` adapt in ``model_config`` (tree order); a target that names no
    projection of this model is a ``ConfigError`` naming it and the names that exist."""
    adaptable = list(_adaptable(model_config))
    paths = [p for p, _ in adaptable]
    hits: set[str] = set()
    for target in targets:
        if target == ALL_LINEAR:
            found = {p for p, cfg in adaptable if _in_all_linear(p, cfg)}
        else:
            found = {p for p in paths if _names(target, p)}
        if not found:
            where = type(model_config).__qualname__.removesuffix(".Config")
            other = [p for p in _module_paths(model_config) if _names(target, p)]
            why = (
                f"it names {other[0]}, which takes no adapter (the LM head, embeddings, router, norms, MTP block "
                "and vision patch embedding never do): train it in full with --lora.modules_to_save"
                if other
                else "no module of this model has that name"
            )
            raise ConfigError(
                f"--lora.targets {target!r} matches no projection of {where}: {why}. Targets that exist: "
                + ", ".join(_existing_names(paths))
                + " (or a dotted part of a module path, e.g. layers.0.self_attn)"
            )
        hits |= found
    return [p for p in paths if p in hits]


def _replaced(cfg: Any, prefix: str, hits: set[str], adapter: LoRA.Config) -> Any:
    """``cfg`` with ``lora=adapter`` on the configs at ``hits``: new dataclasses along each changed path (the
    input untouched, shared sub-configs included)."""
    changes: dict[str, Any] = {}
    for f in fields(cfg):
        if not f.init:
            continue
        value = getattr(cfg, f.name)
        path = f"{prefix}.{f.name}" if prefix else f.name
        if isinstance(value, Configurable.Config):
            new = _replaced(value, path, hits, adapter)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, Configurable.Config) for v in value):
            items = [
                _replaced(v, f"{path}.{i}", hits, adapter) if isinstance(v, Configurable.Config) else v
                for i, v in enumerate(value)
            ]
            new = type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
        elif isinstance(value, dict) and any(isinstance(v, Configurable.Config) for v in value.values()):
            items = {
                k: _replaced(v, f"{path}.{k}", hits, adapter) if isinstance(v, Configurable.Config) else v
                for k, v in value.items()
            }
            new = items if any(items[k] is not value[k] for k in value) else value
        else:
            continue
        if new is not value:
            changes[f.name] = new
    if prefix in hits:
        lora = adapter
        if isinstance(cfg, GroupedExperts.Config) and adapter.dropout:
            lora = dataclasses.replace(adapter, dropout=0.0)  # PEFT allows no dropout on fused experts
        changes["lora"] = lora
    return dataclasses.replace(cfg, **changes) if changes else cfg


def apply_lora(model_config: Any, lora: LoRAConfig) -> Any:
    """A new model config with adapters on ``lora.targets`` (the input is not changed); ``lora.rank == 0``
    returns ``model_config`` itself. Unknown or non-matching targets and ``modules_to_save`` entries are a
    ``ConfigError`` naming them."""
    if not lora.enabled:
        return model_config
    hits = set(lora_targets(model_config, lora.targets))
    check_modules_to_save(model_config, lora.modules_to_save)
    return _replaced(model_config, "", hits, lora.adapter())


def check_modules_to_save(model_config: Any, modules_to_save: Iterable[str]) -> None:
    """Every ``modules_to_save`` entry must name a module of the model (a ``ConfigError`` otherwise)."""
    paths = _module_paths(model_config)
    for name in modules_to_save:
        if not any(_names(name, p) for p in paths):
            tops = sorted({p.split(".")[0] for p in paths})
            raise ConfigError(
                f"--lora.modules_to_save {name!r} names no module of the model; modules such as: {', '.join(tops)} "
                "(or a dotted part of a module path, e.g. lm_head, embed_tokens, layers.0.mlp.gate)"
            )



def lora_trainable_names(model: nn.Module, modules_to_save: Iterable[str] = ()) -> set[str]:
    """Names of the parameters a LoRA run trains: every adapter (``is_lora_param``) and every parameter of a
    module ``modules_to_save`` names; all other parameters stay frozen. Names are the model's own (AC and
    compile wrappers dropped); a tied parameter is listed under each of its names."""
    keep = tuple(modules_to_save)
    out: set[str] = set()
    for raw, _ in model.named_parameters(remove_duplicate=False):
        name = unwrapped_name(raw)
        module = name.rsplit(".", 1)[0] if "." in name else ""
        if is_lora_param(name) or any(_names(m, module) for m in keep):
            out.add(name)
    return out


def freeze_lora_base(model: nn.Module, trainable: Iterable[str]) -> None:
    """``requires_grad_(False)`` on every parameter not named in ``trainable`` (``lora_trainable_names``; AC and
    compile wrapper parts of the names are ignored), so the optimizer, EMA and gradient clipping skip it. A trainable
    parameter keeps its flag (``model.freeze`` still wins); a tied parameter is trained when any of its names is."""
    keep = set(trainable)
    named = [(unwrapped_name(name), p) for name, p in model.named_parameters(remove_duplicate=False)]
    trained = {id(p) for name, p in named if name in keep}
    for _, p in named:
        if id(p) not in trained:
            p.requires_grad_(False)
