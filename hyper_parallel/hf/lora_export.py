"""LoRA adapters out to HF (issue 32): PEFT's adapter folder, vLLM's per-expert 2-D form, merged weights.

Three forms of one trained adapter set (``models/common/lora.py``: ``W + scale * B A``; experts ``[E', r, in]`` /
``[E', out, r]`` stacks, ``E' = 1`` with ``share_experts``):

- ``save_adapter(..., form="peft")``: a PEFT 0.21 LoRA folder, ``adapter_config.json`` + ``adapter_model.safetensors``,
  that ``peft.PeftModel.from_pretrained(<transformers model of the base folder>, dir)`` loads. Keys are PEFT's:
  ``base_model.model.<HF module>.lora_A.weight [r, in]`` / ``.lora_B.weight [out, r]``; a trained full module
  (``modules_to_save``) is ``base_model.model.<HF module>.<param>``. ``target_modules`` lists the exact HF module
  names (no suffix matching: a ``q_proj`` of the vision tower is not caught by a text ``q_proj``), except that in
  a MoE model a Linear named ``gate_proj`` / ``up_proj`` / ``down_proj`` (a dense MLP, a shared expert) is listed
  in ``target_parameters`` as ``<module>.weight`` instead: PEFT 0.21 on transformers 5 rewrites such
  ``target_modules`` of MoE model types it converts from v4 (``glm4_moe_lite``, DeepSeek, ...) into the fused
  experts (``_EXPERT_PROJ_NAMES``); a 2-D ``ParamWrapper`` has the same keys and the same delta.
  Routed experts use ``target_parameters`` on transformers' fused run-time parameters
  ``<...>.mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (peft/tuners/lora/layer.py
  ``ParamWrapper``): one adapter over the fused ``gate_up_proj`` (gate and up share ``A``, as ours), stored
  ``lora_A.weight [E*r, in]`` (expert-major rows: ``A.reshape(E, r, in)``) and ``lora_B.weight [out, r*E]``
  (expert-MINOR columns: ``B.reshape(out, r, E)``), ``delta_e = scale * B_e A_e``. Two parameters of one module
  nest: the one transformers registers first (``gate_up_proj``) is the inner wrapper, so its keys read
  ``<experts>.base_layer.lora_A.weight``, ``down_proj``'s ``<experts>.lora_A.weight`` (peft/tuners/tuners_utils.py
  ``_inject_parameters``; vLLM's loader reads the same names, vllm/lora/model_manager.py
  ``_stack_moe_lora_weights``: "experts.base_layer is the gate_up_proj and experts is the down_proj").
  PEFT refuses dropout on ``target_parameters`` (``ParamWrapper.__init__``/``update_layer``): ``lora_dropout``
  is written 0 whenever the folder has ``target_parameters``. Dropout is a training-time regulariser on the adapter's input and
  no part of the adapter: inference never applies it, so the written adapter computes what the model computes
  in eval mode.
  vLLM serves this form directly for models whose experts it holds fused (``is_3d_moe_weight = True``:
  vllm/model_executor/models/qwen3_5.py ``Qwen3_5MoeForConditionalGeneration``, qwen3_vl_moe.py
  ``Qwen3VLMoeForConditionalGeneration``).
- ``save_adapter(..., form="vllm")``: the per-expert 2-D form vLLM's fused-MoE LoRA loader reads for the other
  MoE models (DeepSeek-V2 style, GLM-4.7-Flash; or any with ``--enable-mixed-moe-lora-format``): every routed
  expert as three PEFT ``Linear`` adapters ``<experts>.{e}.{gate_proj,up_proj,down_proj}.lora_A.weight [r, in]``
  / ``.lora_B.weight [out, r]``, all experts present (vllm/lora/model_manager.py ``_create_merged_loras_inplace``
  packs ``experts.{e}.{w1,w2,w3}`` through ``PackedLoRALayerWeights.pack_moe``, vllm/lora/lora_weights.py;
  names from ``FusedMoE.make_expert_params_mapping``; key parsing ``parse_fine_tuned_lora_name`` in
  vllm/lora/utils.py; files and checks in vllm/lora/lora_model.py ``from_local_checkpoint``). gate_proj and
  up_proj get the same ``A`` (ours is one adapter over the fused weight) and the two row halves of ``B``: the
  same product exactly. No ``target_parameters``; ``target_modules`` is the set of leaf names. vLLM refuses
  ``modules_to_save`` (vllm/lora/peft_helper.py ``_validate_features``): this form takes none.
- ``save_merged``: the base with ``scale * B A`` folded into every adapted weight, written by the family's own
  export (``hf.save.save_pretrained``) in the base folder's form: what any server loads with no LoRA support.

An adapter shared by the routed experts (``share_experts``) is written as one copy per expert in both adapter
forms (PEFT and vLLM hold one adapter per expert). Adapters and trained modules keep their training dtype; the
merged export takes the export dtype. ``export_lora`` (``Trainer.export_hf`` of a LoRA run) writes
``<path>/adapter`` always, ``<path>/adapter_vllm`` with ``--lora.export_vllm`` and ``<path>/merged`` with
``--lora.export_merged``: the merged folder is a flag, off by default, because it is as large as the base model
and the adapter is what a LoRA run is for.

The HF name (and rows) of every adapter come from the family's own ours -> HF mapping, never from a table here:
``hf_rows`` exports a tiny integer "row trace" of each adapted base weight through the family export into
a scratch folder and reads back which rows landed under which HF key. So Gated DeltaNet's ``in_proj_qkv``
(our grouped rows -> HF's ``[Q | K | V]``) takes ``B``'s rows in the base's HF order, a VL folder's
``model.language_model.`` prefix, GLM's text-only Glm4MoeLite form (head rows ``[0, V)``), per-expert or fused
expert keys all follow. A conversion that is not a row selection (the vision patch embedding written as a
Conv3d) has no LoRA form here and is refused by name.

Sharded models (FSDP / TP / EP DTensors): the adapter is written through ``hf.storage.save_converted`` (each
source tensor gathered once, to the rank that writes it; rank 0 then joins the parts into the single file PEFT
reads); the merge folds ``B A`` into each rank's own shard of ``W`` (only the small ``A`` / ``B`` are gathered)
and writes through the family export like any sharded model. Every rank calls every function here.
Pipeline parallel (``stages``: the pp group): each stage's ranks write that stage's adapters, the
plan and ``adapter_config.json`` cover every stage (``whole_model_view``), and the merged folder is written
per stage like the base export.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.hf.convert import full_tensor
from hyper_parallel.hf.load import model_state_dict
from hyper_parallel.hf.save import save_pretrained
from hyper_parallel.hf.storage import HFFolder, save_converted, whole_model_view, writes_once
from hyper_parallel.protocols.module import unwrapped_name
from hyper_parallel.rank_log import warn_on_rank0

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "HFRows",
    "LoRATarget",
    "adapter_targets",
    "export_lora",
    "folder_form_options",
    "hf_rows",
    "merged_state_dict",
    "save_adapter",
    "save_merged",
    "trained_module_keys",
]

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT = "base_model.model."
_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # registration order in transformers' *Experts modules
_PER_EXPERT_RE = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT_PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")
"""Linear leaf names that PEFT 0.21 on transformers 5 reads, in ``target_modules`` of a MoE model type it converts
from v4 (``glm4_moe_lite``, ``deepseek_v3``, ...), as the pre-fusion expert projections and moves onto the fused
experts (peft/utils/transformers_weight_conversion.py ``_convert_peft_config_moe``): a dense MLP's or a shared
expert's ``gate_proj`` would lose its adapter. In a MoE model such a Linear is therefore written as a
``target_parameters`` entry on its ``.weight`` (a 2-D ``ParamWrapper``: the same ``lora_A [r, in]`` / ``lora_B
[out, r]`` keys, the same delta); vLLM reads the keys and is unaffected."""
_NOT_IN_HF = ("mtp.",)  # transformers builds no MTP block: PEFT / vLLM adapters cannot name it (merged keeps it)


@dataclass(frozen=True)
class LoRATarget:
    """One adapted base weight of our model."""

    base_key: str
    """Our state-dict key of the frozen weight (``layers.0.self_attn.q_proj.weight``; experts
    ``layers.1.mlp.experts.gate_up_proj``)."""
    a_key: str
    """Our key of ``A`` (``[r, in]``; experts ``[E', r, in]``)."""
    b_key: str
    """Our key of ``B`` (``[out, r]``; experts ``[E', out, r]``)."""
    lora: Any
    """The module's ``LoRA.Config`` (rank, alpha, rslora, share_experts; ``scale``)."""
    experts: bool
    """A fused routed-experts weight (3-D)."""


# ---- what is adapted ---------------------------------------------------------------------------------------


def adapter_targets(model_config: Any, keys: Iterable[str]) -> list[LoRATarget]:
    """The adapted weights of a model built from ``model_config`` with state-dict ``keys`` (sorted by base key).

    A module is adapted when its Config has a ``lora`` set (``apply_lora``); the config tree's FQNs are the
    parameter prefixes (the project's naming rule). Raises when a ``lora_*`` key belongs to no adapted module.
    """
    keys = set(keys)
    targets: list[LoRATarget] = []
    for fqn, cfg, _, _ in model_config.traverse():
        lora = getattr(cfg, "lora", None)
        if lora is None or not fqn:
            continue
        if f"{fqn}.lora_A" in keys:
            targets.append(LoRATarget(f"{fqn}.weight", f"{fqn}.lora_A", f"{fqn}.lora_B", lora, experts=False))
        for w in _EXPERT_WEIGHTS:
            if f"{fqn}.{w}_lora_A" in keys:
                targets.append(LoRATarget(f"{fqn}.{w}", f"{fqn}.{w}_lora_A", f"{fqn}.{w}_lora_B", lora, experts=True))
    covered = {k for t in targets for k in (t.a_key, t.b_key)}
    stray = sorted(k for k in keys - covered if _is_adapter_key(k))
    if stray:
        raise ValueError(f"adapter parameters without an adapted module in the model config: {', '.join(stray[:5])}")
    return sorted(targets, key=lambda t: t.base_key)


def _is_adapter_key(key: str) -> bool:
    return any(part.startswith("lora_") or "_lora_" in part for part in key.split("."))


def trained_module_keys(model: torch.nn.Module) -> list[str]:
    """Our keys of the parameters trained in full beside the adapters (``--lora.modules_to_save``): those that
    require grad and are no adapter's (every other base weight is frozen)."""
    names = {
        unwrapped_name(n)
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return sorted(n for n in names if not _is_adapter_key(n))


def folder_form_options(model: Any) -> dict[str, Any]:
    """``save_pretrained`` options that write the base folder's own form: none beyond the family's own defaults
    (a GlmImageMoe model read from a text-only Glm4MoeLite folder has no image path and exports in the
    ``Glm4MoeLiteForCausalLM`` form by default, so the adapter names that model's modules)."""
    return {}


# ---- ours -> HF rows, through the family's export ----------------------------------------------------------


@dataclass(frozen=True)
class HFRows:
    """Where (part of) one of our tensors lands in the family's HF export."""

    hf_key: str
    expert: int | None
    """The expert of a per-expert HF key (``...experts.{e}.gate_proj.weight``); None: every expert (a fused key)
    or a 2-D weight."""
    rows: torch.Tensor
    """Our rows (dim 0, or dim 1 of a fused 3-D weight) in the HF tensor's row order."""


class _ConfigOnly:
    """The model as the family writer sees it, with no kept passthrough tensors (the trace writes nothing else)."""

    hf_passthrough = None

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def hf_rows(spec: Any, model: Any, shapes: Mapping[str, torch.Size], **options: Any) -> dict[str, list[HFRows]]:
    """For each of our keys (-> global shape) the HF keys the family's export writes it to, and which rows.

    Each tensor is replaced by a unique integer per row (``[O, 1]``; ``[E, O, 1]`` for experts; ``[O]`` 1-D),
    written by the family export (``save_pretrained``; ``options``: the folder's form) into a scratch folder of this process,
    and read back. Raises, naming the key, when the export does something other than select rows.
    """
    trace: dict[str, torch.Tensor] = {}
    starts: list[tuple[int, str]] = []  # (first id, our key), ascending
    offset = 0
    for key in sorted(shapes):
        shape = tuple(shapes[key])
        n = shape[0] * (shape[1] if len(shape) == 3 else 1)  # rows (of every expert)
        ids = torch.arange(offset, offset + n, dtype=torch.int64)
        trace[key] = ids.reshape(*shape[: 2 if len(shape) == 3 else 1], *([1] if len(shape) > 1 else []))
        starts.append((offset, key))
        offset += n
    out: dict[str, list[HFRows]] = {k: [] for k in shapes}
    if not trace:
        return out
    with tempfile.TemporaryDirectory(prefix="hp_lora_trace_") as tmp:
        save_pretrained(_ConfigOnly(model), tmp, spec=spec, state_dict=trace, **options)
        written = {k: t.read() for k, t in HFFolder.open(tmp).tensors.items() if t.dtype == torch.int64}
    for hf_key, t in sorted(written.items()):
        first, key = starts[bisect.bisect_right(starts, (int(t.min()), "\uffff")) - 1]
        shape, ids = tuple(shapes[key]), t - first
        if len(shape) == 3 and ids.dim() == 3 and ids.shape[-2] == 1 and ids.shape[-1] != 1:
            ids = ids.transpose(1, 2)  # a fused expert weight written transposed (Qwen3-VL-MoE hub layout)
        n = shape[0] * (shape[1] if len(shape) == 3 else 1)
        if len(shape) == 1:
            rowwise = ids.dim() == 1
        else:  # [rows, 1]; a 3-D weight also as one expert's [rows, 1] (a per-expert key)
            rowwise = ids.dim() in ((2, 3) if len(shape) == 3 else (2,)) and ids.shape[-1] == 1
        if not rowwise or int(ids.max()) >= n:
            raise ValueError(
                f"{key}: the HF export writes {hf_key} as something other than a row selection "
                f"(shape {list(t.shape)} from {list(shape)}): an adapter or trained module here has no HF LoRA form"
            )
        if len(shape) < 3:
            out[key].append(HFRows(hf_key, None, ids.reshape(-1)))
            continue
        experts, rows = ids.reshape(*ids.shape[:-1]) // shape[1], ids.reshape(*ids.shape[:-1]) % shape[1]
        if ids.dim() == 2:  # one expert's rows: a per-expert HF key
            if not (experts == experts[0]).all():
                raise ValueError(f"{key}: {hf_key} mixes experts")
            out[key].append(HFRows(hf_key, int(experts[0]), rows))
        elif not torch.equal(experts[:, 0], torch.arange(shape[0])) or not (rows == rows[:1]).all():
            raise ValueError(f"{key}: {hf_key} does not hold every expert, in order, with the same rows")
        else:
            out[key].append(HFRows(hf_key, None, rows[0]))
    return out


# ---- PEFT / vLLM key layout ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ExpertsPlan:
    module: str
    """HF run-time module of the routed experts (``model.layers.1.mlp.experts``)."""
    num_experts: int
    inner: bool
    """PEFT's nesting: this weight's wrapper is the inner one (``<experts>.base_layer.lora_*``)."""


def _experts_module(target: LoRATarget, rows: list[HFRows], shape: torch.Size) -> str:
    """The HF experts module of a fused target, and a check that the family's keys are transformers' fused layout
    (``gate_up_proj`` = the gate rows then the up rows of each expert; ``down_proj`` as ours)."""
    modules = set()
    out_rows = shape[1]
    per_expert: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for r in rows:
        m = _PER_EXPERT_RE.match(r.hf_key) or _FUSED_RE.match(r.hf_key)
        if m is None:
            raise ValueError(f"{target.base_key}: its HF key {r.hf_key} is not a routed-experts weight")
        modules.add(m.group(1))
        if r.expert is None:
            if not torch.equal(r.rows, torch.arange(out_rows)):
                raise ValueError(f"{target.base_key}: {r.hf_key} reorders the fused rows")
        else:
            per_expert.setdefault(r.expert, []).append((m.group(3), r.rows))
    for e, parts in per_expert.items():
        order = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
        joined = torch.cat([rows for _, rows in sorted(parts, key=lambda p: order[p[0]])])
        if not torch.equal(joined, torch.arange(out_rows)):
            raise ValueError(f"{target.base_key}: expert {e}'s HF keys are not the halves of the fused weight")
    if len(modules) != 1:
        raise ValueError(f"{target.base_key}: HF keys under several modules: {sorted(modules)}")
    return modules.pop()


def _expand(t: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A shared adapter stack (``[1, ...]``) as one copy per expert (PEFT and vLLM hold one adapter per expert)."""
    return t.expand(num_experts, *t.shape[1:]) if t.shape[0] == 1 else t


def _peft_experts(which: str, t: torch.Tensor, plan: _ExpertsPlan) -> dict[str, torch.Tensor]:
    """One fused-experts factor (ours ``A [E', r, in]`` / ``B [E', out, r]``) in PEFT's ``ParamWrapper`` layout."""
    t = _expand(t, plan.num_experts)
    E = plan.num_experts
    name = f"{_PEFT}{plan.module}.{'base_layer.' if plan.inner else ''}lora_{which}.weight"
    if which == "A":  # [E*r, in], expert-major rows (``weight_A.reshape(E, r, in)``)
        return {name: t.reshape(E * t.shape[1], t.shape[2])}
    # [out, r*E] with column k*E + e = B_e[:, k] (``weight_B.reshape(out, r, E)``)
    return {name: t.permute(1, 2, 0).reshape(t.shape[1], t.shape[2] * E)}


def _vllm_experts(
    which: str, t: torch.Tensor, target: LoRATarget, module: str, num_experts: int
) -> dict[str, torch.Tensor]:
    """One fused-experts factor as vLLM's per-expert 2-D ``Linear`` adapters (gate/up: ``A`` shared, ``B`` halves)."""
    t = _expand(t, num_experts)
    out: dict[str, torch.Tensor] = {}
    gate_up = target.base_key.endswith("gate_up_proj")
    for e in range(num_experts):
        if not gate_up:
            out[f"{_PEFT}{module}.{e}.down_proj.lora_{which}.weight"] = t[e]
            continue
        half = t.shape[1] // 2
        gate, up = (t[e], t[e]) if which == "A" else (t[e, :half], t[e, half:])
        out[f"{_PEFT}{module}.{e}.gate_proj.lora_{which}.weight"] = gate
        out[f"{_PEFT}{module}.{e}.up_proj.lora_{which}.weight"] = up
    return out


def _linear_module(target_key: str, r: HFRows) -> str:
    if not r.hf_key.endswith(".weight") or r.expert is not None:
        raise ValueError(f"{target_key}: its HF key {r.hf_key} is not a Linear module's weight")
    return r.hf_key[: -len(".weight")]


# ---- the adapter folder ------------------------------------------------------------------------------------


def save_adapter(
    spec: Any,
    model: Any,
    path: str | os.PathLike,
    *,
    form: Literal["peft", "vllm"] = "peft",
    state_dict: Mapping[str, torch.Tensor] | None = None,
    modules_to_save: Iterable[str] | None = None,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    options: Mapping[str, Any] | None = None,
    stages: dist.ProcessGroup | None = None,
) -> list[str]:
    """Write the model's adapters as a PEFT LoRA folder (``form="peft"``) or vLLM's per-expert 2-D form.

    ``state_dict``: our keys (DTensors of a sharded model are gathered one at a time; every rank calls);
    default the model's. ``modules_to_save``: our keys of parameters trained in full (default: those that
    require grad, ``trained_module_keys``); the vLLM form refuses them. ``options``: the family export's form
    (default ``folder_form_options(model)``). Adapters of an MTP block (which transformers does not build) are
    left out with a warning; the merged export keeps them. ``stages``: the pipeline-parallel group (each rank hands
    in its own stages' tensors). Returns the written file names.
    """
    sd = dict(state_dict) if state_dict is not None else model_state_dict(model)
    # pipeline parallel: this rank holds its stages' keys only, but one folder (and its config) spans every stage
    view = whole_model_view(sd, stages=stages)
    options = dict(folder_form_options(model) if options is None else options)
    targets = [t for t in adapter_targets(model.config, view) if not t.base_key.startswith(_NOT_IN_HF)]
    left_out = sorted(t.base_key for t in adapter_targets(model.config, view) if t.base_key.startswith(_NOT_IN_HF))
    if left_out:
        warn_on_rank0(logger, "the LoRA adapter leaves out %d adapted MTP weight(s) (%s, ...): transformers and vLLM build "
                       "no MTP block for an adapter; the merged export (--lora.export_merged) folds them in",
                       len(left_out), left_out[0])  # fmt: skip
    if not targets:
        raise ValueError("the model has no LoRA adapters to export: set --lora.rank and --lora.targets")
    trained = sorted(trained_module_keys(model) if modules_to_save is None else modules_to_save)
    if form == "vllm" and trained:
        raise ValueError(
            f"vLLM serves no modules_to_save (vllm/lora/peft_helper.py); trained in full: {', '.join(trained[:4])}: "
            "serve the merged export, or train without --lora.modules_to_save"
        )
    shapes = {t.base_key: view[t.base_key].shape for t in targets} | {k: view[k].shape for k in trained}
    rows = hf_rows(spec, model, shapes, **options)
    for key, where in rows.items():
        if not where and key in trained:  # a tied head: the folder holds the embedding only (written under its name)
            warn_on_rank0(logger, "the LoRA adapter writes no %s: the HF export has no tensor of its own for it", key)
            trained.remove(key)
        elif not where:
            raise ValueError(f"{key}: the HF export ({options or 'default form'}) writes it nowhere: no adapter form")

    moe = any(".experts." in k for k in view)  # a model with routed experts (adapted or not)
    by_source: dict[str, tuple[str, Any]] = {}  # our key -> (role, plan)
    meta: dict[str, Any] = {"target_modules": set(), "target_parameters": [], "modules_to_save": set()}
    for t in targets:
        where = rows[t.base_key]
        if t.experts:
            E = view[t.base_key].shape[0]
            module = _experts_module(t, where, view[t.base_key].shape)
            both = all(f"{t.base_key.rsplit('.', 1)[0]}.{w}_lora_A" in view for w in _EXPERT_WEIGHTS)
            plan = _ExpertsPlan(module, E, inner=both and t.base_key.endswith(_EXPERT_WEIGHTS[0]))
            if form == "peft":
                meta["target_parameters"].append(f"{module}.{t.base_key.rsplit('.', 1)[1]}")
            else:
                gate_up = t.base_key.endswith("gate_up_proj")
                meta["target_modules"] |= {"gate_proj", "up_proj"} if gate_up else {"down_proj"}
            by_source[t.a_key] = ("experts_A", (t, plan))
            by_source[t.b_key] = ("experts_B", (t, plan))
        else:
            modules = [(_linear_module(t.base_key, r), r.rows) for r in where]
            for m, _ in modules:
                leaf = m.rsplit(".", 1)[-1]
                if form == "vllm":
                    meta["target_modules"].add(leaf)
                elif moe and leaf in _EXPERT_PROJ_NAMES:
                    meta["target_parameters"].append(f"{m}.weight")  # the same keys; see _EXPERT_PROJ_NAMES
                else:
                    meta["target_modules"].add(m)
            by_source[t.a_key] = ("linear_A", modules)
            by_source[t.b_key] = ("linear_B", modules)
    for key in trained:
        parts = [(r.hf_key, r.rows) for r in rows[key]]
        meta["modules_to_save"] |= {h.rsplit(".", 1)[0] for h, _ in parts}
        by_source[key] = ("full", parts)

    def convert(one: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # per source tensor (save_converted)
        (key, t), = one.items()
        role, plan = by_source[key]
        if role == "linear_A":
            out = {f"{_PEFT}{m}.lora_A.weight": t for m, _ in plan}
        elif role == "linear_B":
            out = {f"{_PEFT}{m}.lora_B.weight": t[rows] for m, rows in plan}
        elif role == "full":
            out = {_PEFT + h: t[rows] for h, rows in plan}
        else:
            target, experts = plan
            which = role[-1]
            if form == "peft":
                out = _peft_experts(which, t, experts)
            else:
                out = _vllm_experts(which, t, target, experts.module, experts.num_experts)
        if dtype is not None:
            out = {k: v.to(dtype) for k, v in out.items()}
        return out

    path = Path(path)
    sources = {k: sd[k] for k in by_source if k in sd}  # this rank's own (pipeline parallel: its stages')
    parts = path / ".adapter_parts"
    save_converted(sources, convert, parts, max_shard_size=1 << 62, stages=stages)
    once = writes_once(sources)
    if once:
        _join_parts(parts, path / ADAPTER_WEIGHTS)
        config = _adapter_config(targets, meta, form=form, base=base_model_name_or_path)
        (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not all(
        not isinstance(v, DTensor) for v in sources.values()
    ):
        dist.barrier()
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def _join_parts(parts: Path, out: Path) -> None:
    """One ``adapter_model.safetensors`` (PEFT and vLLM read a single file) from ``save_converted``'s parts."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(parts.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            tensors.update({k: g.get_tensor(k) for k in g.keys()})
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(tensors.items())), str(out), metadata={"format": "pt"})
    shutil.rmtree(parts)


def _adapter_config(targets: list[LoRATarget], meta: dict[str, Any], *, form: str, base: str | None) -> dict[str, Any]:
    """``adapter_config.json`` in PEFT 0.21's fields (peft/tuners/lora/config.py ``LoraConfig``)."""
    settings = {(t.lora.rank, float(t.lora.alpha), bool(t.lora.rslora)) for t in targets}
    if len(settings) != 1:
        raise ValueError(f"adapters with different (rank, alpha, rslora) {sorted(settings)}: PEFT's folder holds one")
    (rank, alpha, rslora), = settings
    dropout = max(float(t.lora.dropout) for t in targets)
    if meta["target_parameters"] and form == "peft":
        dropout = 0.0  # PEFT refuses lora_dropout on target_parameters; inference never applies it anyway
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        # absolute: the adapter folder moves (to a server, another working directory) while the base stays put
        "base_model_name_or_path": (
            os.path.abspath(os.path.expanduser(base)) if base and os.path.exists(os.path.expanduser(base)) else base
        ),
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "use_rslora": rslora,
        "lora_dropout": dropout,
        "target_modules": sorted(meta["target_modules"]),
        "target_parameters": sorted(meta["target_parameters"]) or None,
        "modules_to_save": sorted(meta["modules_to_save"]) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_dora": False,
        "lora_bias": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
        "exclude_modules": None,
        "revision": None,
        "peft_version": "0.21.0",
    }


# ---- merged --------------------------------------------------------------------------------------------------


def _local_index(t: DTensor, dim: int) -> torch.Tensor:
    """The global indices along ``dim`` of this rank's shard of ``t`` (any Shard / _StridedShard / Replicate mix):
    an index vector sharded as ``t`` is along ``dim``, no communication."""
    placements = []
    for p in t.placements:
        if isinstance(p, _StridedShard) and p.dim % t.ndim == dim:
            placements.append(_StridedShard(0, split_factor=p.split_factor))
        elif isinstance(p, Shard) and p.dim % t.ndim == dim:
            placements.append(Shard(0))
        else:
            placements.append(Replicate())
    idx = torch.arange(t.shape[dim], device=t.to_local().device)
    return distribute_tensor(idx, t.device_mesh, placements, src_data_rank=None).to_local()


@torch.no_grad()
def _merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, experts: bool) -> torch.Tensor:
    """``w + scale * B A`` (experts: per expert) with ``w``'s type and placements; a sharded ``w`` is merged shard by
    shard (``A`` and ``B`` gathered: they are small)."""
    a, b = full_tensor(a), full_tensor(b)
    if experts:
        a, b = _expand(a, w.shape[0]), _expand(b, w.shape[0])
    if not isinstance(w, DTensor):
        return (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    local = w.to_local()
    idx = [_local_index(w, d) for d in range(w.ndim)]
    if experts:
        delta = b[idx[0]][:, idx[1]].float() @ a[idx[0]][:, :, idx[2]].float()
    else:
        delta = b[idx[0]].float() @ a[:, idx[1]].float()
    merged = (local.float() + scale * delta.to(local.device)).to(local.dtype)
    return DTensor.from_local(merged, w.device_mesh, w.placements, shape=w.shape, stride=w.stride())


def merged_state_dict(model: Any, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Our state dict without adapter keys, every adapted weight replaced by ``W + scale * B A`` (every rank calls)."""
    sd = dict(state_dict) if state_dict is not None else model_state_dict(model)
    targets = adapter_targets(model.config, sd)
    out = {k: v for k, v in sd.items() if not _is_adapter_key(k)}
    for t in targets:
        out[t.base_key] = _merge(sd[t.base_key], sd[t.a_key], sd[t.b_key], t.lora.scale, t.experts)
    return out


def save_merged(
    spec: Any,
    model: Any,
    path: str | os.PathLike,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    options: Mapping[str, Any] | None = None,
    stages: dist.ProcessGroup | None = None,
) -> list[str]:
    """Write the base with the adapters folded in as an HF folder in the base folder's form (the family's own
    export, kept passthrough tensors included). Holds one extra copy of this rank's shards of the adapted
    weights while writing."""
    merged = merged_state_dict(model, state_dict)
    options = dict(folder_form_options(model) if options is None else options)
    return save_pretrained(model, path, spec=spec, state_dict=merged, dtype=dtype, stages=stages, **options)


# ---- the run's export ----------------------------------------------------------------------------------------


def export_lora(
    spec: Any,
    model: Any,
    path: str | os.PathLike,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    modules_to_save: Iterable[str] | None = None,
    base_model_name_or_path: str | None = None,
    vllm: bool = False,
    merged: bool = False,
    dtype: torch.dtype | None = None,
    stages: dist.ProcessGroup | None = None,
) -> list[Path]:
    """A LoRA run's export (``--checkpoint.export_hf``; every rank calls): ``path/adapter`` (the PEFT folder, the
    adapters in their training dtype), with ``vllm`` ``path/adapter_vllm`` (vLLM's per-expert 2-D form), with
    ``merged`` ``path/merged`` (the base with the adapters folded in, in ``dtype``, the base folder's form).
    ``stages``: the pipeline-parallel group (each rank hands in its own stages' tensors). Returns the folders
    written."""
    path = Path(path)
    sd = dict(state_dict) if state_dict is not None else model_state_dict(model)
    folders = [path / "adapter"]
    save_adapter(spec, model, folders[0], state_dict=sd, modules_to_save=modules_to_save,
                 base_model_name_or_path=base_model_name_or_path, stages=stages)  # fmt: skip
    if vllm:
        folders.append(path / "adapter_vllm")
        save_adapter(spec, model, folders[-1], form="vllm", state_dict=sd, modules_to_save=modules_to_save,
                     base_model_name_or_path=base_model_name_or_path, stages=stages)  # fmt: skip
    if merged:
        folders.append(path / "merged")
        save_merged(spec, model, folders[-1], state_dict=sd, dtype=dtype, stages=stages)
    return folders
