"""LoRA above the adapter modules (``lora.py``): which projections ``--lora.*`` adapts (``apply_lora`` rewrites the
model config), which parameters train (``lora_trainable_names``, ``freeze_lora_base``), and ``LoRAPolicy``: the one
object the model builder, trainer, checkpointer, resume guard, HF export and dry run ask about LoRA.

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
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from torch import nn

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.lora import ALL_LINEAR, LoRAConfig
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.lora import LoRA, init_adapters_, is_lora_param
from hyper_parallel.models.common.moe import GroupedExperts
from hyper_parallel.protocols.module import unwrapped_name

__all__ = [
    "LoRAExport",
    "LoRAPolicy",
    "apply_lora",
    "check_modules_to_save",
    "freeze_lora_base",
    "lora_targets",
    "lora_trainable_names",
]

_ALIASES = {"shared_expert": "shared_experts"}
"""HF names whose module is ours under another name (Qwen's ``mlp.shared_expert`` is our ``shared_experts``)."""

_NO_ADAPTER = ("lm_head", "mtp", "patch_embed")
"""Path parts under which no projection takes an adapter: the LM head, the MTP block (no HF model holds it, so no
PEFT adapter could), the vision patch embedding (an HF Conv3d)."""

_NOT_ALL_LINEAR = ("shared_expert_gate", "vq_to_llm_proj")
"""Projections adapted only when named: scalar gates and GlmImageMoe's codebook projection."""


def _adapter(lora: LoRAConfig) -> LoRA.Config:
    """The per-module adapter settings of ``--lora.*``."""
    return LoRA.Config(
        rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, rslora=lora.rslora, share_experts=lora.share_experts
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
    return _replaced(model_config, "", hits, _adapter(lora))

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


@dataclass(frozen=True)
class LoRAExport:
    """What a LoRA run's HF export writes besides the PEFT adapter folder (``export_lora``'s options)."""

    vllm: bool
    """Also vLLM's per-expert 2-D adapter form (``--lora.export_vllm``)."""
    merged: bool
    """Also the base with the adapters merged in (``--lora.export_merged``)."""
    base_model_name_or_path: str | None
    """The HF folder the base came from (``--checkpoint.initial_load_path``), named in ``adapter_config.json``."""
    modules_to_save: list[str]
    """Parameters trained in full (``--lora.modules_to_save``), sorted."""


@dataclass(frozen=True)
class LoRAPolicy:
    """Every LoRA decision of a run, made in one place from ``--lora.*`` and the run's HF folder: which projections
    get adapters, which parameters train, whether checkpoints hold the frozen base, how a resume must start, what
    the export writes. Without LoRA (``rank == 0``) every answer is the plain run's: nothing adapted or frozen."""

    config: LoRAConfig
    """``--lora.*``."""
    base_folder: str | None = None
    """``--checkpoint.initial_load_path``: the HF folder the frozen base is read from; empty: a random base."""

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``--lora.rank > 0``)."""
        return self.config.enabled

    @property
    def adapter(self) -> LoRA.Config:
        """The per-module adapter settings (``adapter.scale``: the update's factor)."""
        return _adapter(self.config)

    @property
    def base_from_folder(self) -> bool:
        """A LoRA run whose frozen base comes from the HF folder: its checkpoints leave the base out (a resume reads
        it from the folder again, on any layout, before loading the checkpoint). Without a folder the base is the
        seeded random init, and it is saved: the checkpoint then does not depend on how (full copy, or in place for
        big models) a layout initialised it."""
        return self.enabled and bool(self.base_folder)

    @property
    def saves_frozen(self) -> bool:
        """Whether checkpoints hold the frozen parameters (``Checkpointer(save_frozen=)``): all runs but a LoRA run
        whose base is the HF folder's."""
        return not self.base_from_folder

    def targets(self, model_config: Any) -> list[str]:
        """Paths of the projections adapted in ``model_config`` (``lora_targets``)."""
        return lora_targets(model_config, self.config.targets)

    def apply(self, model_config: Any) -> Any:
        """``model_config`` with the adapters (``apply_lora``); ``model_config`` itself without LoRA."""
        return apply_lora(model_config, self.config)

    def trainable_names(self, model: nn.Module) -> frozenset[str]:
        """Names of the parameters the run trains (adapters + ``--lora.modules_to_save``), read off the whole model
        before pipeline stages are cut; empty without LoRA."""
        if not self.enabled:
            return frozenset()
        return frozenset(lora_trainable_names(model, self.config.modules_to_save))

    def freeze(self, model: nn.Module, trainable: Iterable[str]) -> None:
        """Freeze every parameter of ``model`` (whole, a pipeline stage, or parallelized) that ``trainable`` does not
        name; nothing without LoRA. Call it again after wrapping: no wrapper may bring a base back."""
        if self.enabled:
            freeze_lora_base(model, trainable)

    def init_adapters(self, model: nn.Module, seed: int) -> int:
        """After the base is read from the HF folder: PEFT's init of the adapters, the same on every layout
        (``init_adapters_``); returns how many tensors it set (0 without LoRA)."""
        return init_adapters_(model, seed) if self.enabled else 0

    def check_resume(self, source_json: Path, has_checkpoints: Callable[[], object]) -> None:
        """Refuse to resume, without its folder, a LoRA run that started from an HF folder (recorded in
        ``source_json``) but runs with a random base now: its checkpoints hold the adapters only. ``has_checkpoints``
        (a local listing, no collective) is called only when it matters."""
        if not self.enabled or self.base_from_folder or not source_json.is_file():
            return
        started = json.loads(source_json.read_text()).get("initial_load_path")
        if started and has_checkpoints():
            raise ValueError(
                f"this LoRA run started from the HF folder {started} ({source_json}): its checkpoints hold the adapters "
                f"only, not the frozen base; resume with --checkpoint.initial_load_path {started}"
            )

    def export_form(self, trainable: Iterable[str]) -> LoRAExport | None:
        """What the HF export writes for this run; None (no LoRA): the plain model folder."""
        if not self.enabled:
            return None
        return LoRAExport(
            vllm=self.config.export_vllm,
            merged=self.config.export_merged,
            base_model_name_or_path=self.base_folder,
            modules_to_save=sorted(n for n in trainable if not is_lora_param(n)),
        )

    def summary(self, model: nn.Module, base_config: Any, dtype: str) -> str:
        """The line a LoRA user checks first: what is adapted (``base_config``: the model config without adapters)
        and how much of ``model`` (built, its base frozen) trains."""
        lora = self.config
        params = {id(p): p for p in model.parameters()}.values()  # a tied parameter once
        total = sum(p.numel() for p in params)
        adapters = sum(p.numel() for n, p in model.named_parameters() if is_lora_param(n))
        trained = sum(p.numel() for p in params if p.requires_grad)
        return (
            f"LoRA rank {lora.rank} (scale {self.adapter.scale:g}) on {len(self.targets(base_config))} "
            f"projections ({' '.join(lora.targets)}): {adapters:,} adapter parameters"
            + (f" + {trained - adapters:,} trained in full ({' '.join(lora.modules_to_save)})" if trained > adapters else "")
            + f" = {trained / total:.2%} of {total:,}; the rest frozen, stored in {dtype}"
        )
