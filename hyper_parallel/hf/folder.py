"""An HF folder is a model.

- which registered spec reads a folder: ``spec_for_hf`` over the one table ``hf_spec.HF_MODEL_TYPES``; the run's
  entry point opens the folder and checks its family once (``folder_family``);
- the model config a folder holds, read by its family's own reader (``HFSpec.config_from_hf``), its MTP
  block on when the folder ships one (``config_from_folder``; ``HFSpec.mtp``);
- the model of a run started from a folder: ``resolve_run_model`` (the folder's config, the recipe's
  training-only options on top, an error for an explicit model field that contradicts the folder, and on
  resume the model the run was started with);
- (``hf.pretrained``: ``from_pretrained``, which picks the family from the folder.)

Nothing here names a model family: the families' knowledge is in their specs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.hf.convert import CheckpointKeyError, read_hf_config
from hyper_parallel.hf.storage import HFFolder
from hyper_parallel.protocols.hf_spec import HF_MODEL_TYPES
from hyper_parallel.protocols.model_spec import ModelSpec, discover_model_spec

__all__ = [
    "TRAINING_ONLY_OPTIONS",
    "RunModel",
    "check_mtp_tensors",
    "config_from_folder",
    "folder_mtp_layers",
    "folder_family",
    "is_hf_folder",
    "resolve_run_model",
    "resumed_folder_config",
    "spec_for_hf",
    "with_folder_form",
]

logger = logging.getLogger("hyper_parallel")

TRAINING_ONLY_OPTIONS = ("mtp_loss_weight", "router_aux_loss_coef", "freeze", "use_mtp")
"""Model-level options (``Decoder.Config``) that describe the training, not the model: they may differ from a
folder's and apply on top of its config."""

_RUN_LEAVES = ("backend", "param_init")
"""Config fields that choose how the model is computed or initialised, not what it computes: an explicit value
applies on top of a folder's config (``--model.layers.0.self_attn.inner_attention.backend``)."""

MODEL_COPY = "initial_model"
"""Folder under the dump folder holding the ``config.json`` of the folder a run started from (resume reads it)."""


def is_hf_folder(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is an HF checkpoint folder (it holds a ``config.json``)."""
    return bool(path) and (Path(path) / "config.json").is_file()


def folder_family(
    folder: str | os.PathLike | None,
    *,
    where: str | None = None,
    spec_name: str | None = None,
    has_recipe: Callable[[str], bool] | None = None,
) -> str | None:
    """The registered spec that reads HF folder ``folder`` (:func:`spec_for_hf` on its ``config.json``), None when
    ``folder`` is no HF folder: the run's entry point opens the folder and checks its family here, once
    (``ConfigManager(folder_family=folder_family)``)."""
    if not is_hf_folder(folder):
        return None
    return spec_for_hf(read_hf_config(folder), where=where or str(folder), spec_name=spec_name, has_recipe=has_recipe)


def _describe(hf: Mapping[str, Any]) -> str:
    arch = hf.get("architectures")
    return f"model_type={hf.get('model_type')!r}" + (f", architectures={list(arch)}" if arch else "")


def spec_for_hf(
    hf: Mapping[str, Any],
    *,
    where: str,
    spec_name: str | None = None,
    has_recipe: Callable[[str], bool] | None = None,
) -> str:
    """The registered spec that reads an HF config (``HF_MODEL_TYPES``): ``spec_name`` when it is one of the
    folder's candidates (else an error naming both families), else the first candidate for which
    ``has_recipe(candidate)`` holds (the package has the recipe), else the default candidate."""
    candidates = HF_MODEL_TYPES.get(str(hf.get("model_type")))
    if candidates is None:
        raise ConfigError(
            f"{where}: {_describe(hf)} is no model family this package reads; known model_type values: "
            f"{', '.join(sorted(HF_MODEL_TYPES))}"
        )
    if spec_name is not None:
        name = discover_model_spec(spec_name).name
        if name not in candidates:
            raise ConfigError(
                f"{where} holds a {_describe(hf)} checkpoint, a model of {' / '.join(candidates)}, not of "
                f"{name!r}: use --module {candidates[0]} (or drop --module: the folder names its family)"
            )
        return name
    if has_recipe is not None:
        fits = [c for c in candidates if has_recipe(c)]
        if not fits:
            raise ConfigError(
                f"{where} holds a {_describe(hf)} checkpoint (model package {' / '.join(candidates)}), and the "
                f"recipe is in none of them: give a recipe of {candidates[0]} or --module"
            )
        return fits[0]
    return candidates[0]


def folder_mtp_layers(spec: ModelSpec, hf: Mapping[str, Any]) -> int:
    """How many MTP layers an HF config declares (``text_config`` or top level; 0 when the family has none)."""
    if spec.hf is None or spec.hf.mtp is None:
        return 0
    key = spec.hf.mtp.count_key
    text = hf.get("text_config") or {}
    return int(text.get(key, hf.get(key, 0)) or 0)


def config_from_folder(spec: ModelSpec, hf: Mapping[str, Any], *, mtp: bool | None = None) -> tuple[Any, bool]:
    """``(model config, whether its MTP block is the folder's)`` read by the family's reader.

    ``mtp=None``: the MTP block on iff the folder declares one; ``True``: on (an error names the key when the
    folder declares none); ``False``: off (a folder's MTP tensors then pass through)."""
    if spec.hf is None:
        raise NotImplementedError(f"model spec {spec.name!r} has no HF config reader (ModelSpec.hf)")
    count = folder_mtp_layers(spec, hf)
    on = count > 0 if mtp is None else mtp
    if on and spec.hf.mtp is not None:  # without a count the MTP reader raises, naming its key
        return spec.hf.mtp.config_from_hf(hf), True
    if on:
        raise ValueError(f"mtp=True, but model spec {spec.name!r} has no MTP block in its HF folders")
    return spec.hf.config_from_hf(hf), False


def check_mtp_tensors(spec: ModelSpec, hf: Mapping[str, Any], path: str | os.PathLike, model_config: Any) -> None:
    """A folder whose config declares an MTP block must hold its tensors (else training would start the block
    from a random initialisation in silence): an error names the missing keys."""
    if spec.hf is None or spec.hf.mtp is None:
        return
    prefixes = spec.hf.mtp.tensor_prefixes(hf)
    names = HFFolder.open(path).tensors
    if any(k.startswith(prefixes) for k in names):
        return
    with torch.device("meta"):
        ours = sorted(k for k in model_config.build().state_dict() if k.startswith("mtp."))
    shown = ", ".join(ours[:6]) + (f" ... ({len(ours)} in all)" if len(ours) > 6 else "")
    raise CheckpointKeyError(
        f"{path}/config.json says {spec.hf.mtp.count_key}={folder_mtp_layers(spec, hf)}, but the folder holds no "
        f"MTP tensors ({' / '.join(p + '*' for p in prefixes)}); missing: {shown}. Load the release's full "
        "weights, or turn MTP off (--model.use_mtp false; from_pretrained(path, mtp=False))"
    )


FUSED_EXPERT_KEYS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
"""HF keys of routed experts stored fused (``[E, 2I, H]`` / ``[E, H, I]``), as the Qwen3.5-MoE releases store them."""


def with_folder_form(config: Any, folder: str | os.PathLike | None) -> Any:
    """``config`` with what the folder's tensor names say about its form, in ``hf_extra`` (the export writes the
    folder's form): ``experts_form: "fused"`` when its routed experts are stored fused (else per expert, the
    default). A config without ``hf_extra``, or a folder without safetensors, is returned unchanged."""
    extra = getattr(config, "hf_extra", None)
    if not isinstance(extra, dict) or not folder or not any(Path(folder).glob("*.safetensors")):
        return config
    names = HFFolder.open(folder).tensors
    if not any(k.endswith(FUSED_EXPERT_KEYS) for k in names):
        return config
    return dataclasses.replace(config, hf_extra={**extra, "experts_form": "fused"})


# ---- the model of a run -----------------------------------------------------------------------


@dataclass
class RunModel:
    """The model config a run builds and where it came from."""

    config: Any
    """The model config (the folder's when the run starts from an HF folder, else the recipe's)."""
    folder: str | None = None
    """The HF folder the model config was read from (None: the recipe's model)."""
    hf_config: dict[str, Any] | None = None
    """The ``config.json`` it was read from (the run's copy on resume)."""
    differences: list[str] = field(default_factory=list)
    """What the folder sets that differs from the recipe (``"dim 128 (recipe 64)"``)."""
    folder_changed: bool = False
    """On resume: the folder's ``config.json`` is no longer the one the run started with (its weights are not
    read again; the run's checkpoint holds the model)."""
    mtp_from_folder: bool = False
    """The MTP block is the folder's (its tensors must be there)."""


def _option_values(config: Any) -> dict[str, Any]:
    get = getattr(config, "option_values", None)
    return dict(get()) if callable(get) else {}


def _has_field(config: Any, name: str) -> bool:
    return dataclasses.is_dataclass(config) and any(f.name == name for f in dataclasses.fields(config))


_ABSENT = object()


def _at(config: Any, path: str) -> Any:
    node = config
    for part in path.split("."):
        if isinstance(node, (list, tuple)) and part.isdigit():
            if int(part) >= len(node):
                return _ABSENT
            node = node[int(part)]
        elif dataclasses.is_dataclass(node) and _has_field(node, part):
            node = getattr(node, part)
        else:
            return _ABSENT
    return node


def _replace_at(config: Any, parts: Sequence[str], value: Any) -> Any:
    """A copy of ``config`` with the value at ``parts`` replaced (copies along the path, the rest shared)."""
    if not parts:
        return value
    head, rest = parts[0], parts[1:]
    if isinstance(config, (list, tuple)):
        items = list(config)
        items[int(head)] = _replace_at(items[int(head)], rest, value)
        return type(config)(items)
    return dataclasses.replace(config, **{head: _replace_at(getattr(config, head), rest, value)})


def _summary(config: Any) -> dict[str, Any]:
    """The top-level facts of a model config compared with the recipe's (and the option values)."""
    mtp = getattr(config, "mtp", None)
    facts = {
        "vocab_size": getattr(config, "vocab_size", None),
        "dim": getattr(config, "dim", None),
        "layers": len(getattr(config, "layers", []) or []),
        "tie_word_embeddings": getattr(config, "tie_word_embeddings", None),
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "mtp layers": len(mtp.layers) if mtp is not None else 0,
    }
    for key, value in _option_values(config).items():
        facts.setdefault(key, value)
    return facts


_NOT_COMPARED = ("param_init", "sharding_config", "hf_extra", "lora")
"""Config fields that are no model fact a folder sets (how a random init draws, placements, kept HF keys)."""


def _leaf_values(config: Any, prefix: str = "", out: dict[str, list[Any]] | None = None) -> dict[str, list[Any]]:
    """Every leaf of a config tree by its path with list indices as ``*`` (``layers.*.mlp.num_experts``): the
    values of all the layers at that path, in order."""
    out = {} if out is None else out
    if dataclasses.is_dataclass(config):
        for f in dataclasses.fields(config):
            if not f.name.startswith("_") and f.name not in _NOT_COMPARED:
                _leaf_values(getattr(config, f.name), f"{prefix}{f.name}.", out)
    elif isinstance(config, (list, tuple)) and config and all(dataclasses.is_dataclass(c) for c in config):
        for c in config:
            _leaf_values(c, f"{prefix}*.", out)
    else:
        out.setdefault(prefix[:-1], []).append(config)
    return out


def _shown(values: list[Any]) -> str:
    """One value, or the distinct values of a path that differs between layers."""
    distinct = list(dict.fromkeys(repr(v) for v in values))
    return distinct[0] if len(distinct) == 1 else "{" + ", ".join(distinct[:4]) + (", ..." if len(distinct) > 4 else "") + "}"


def _differences(recipe: Any, ours: Any) -> list[str]:
    """Every field the folder sets that differs from the recipe: the top-level facts and model options, then each
    leaf of the config tree (one entry per path, all layers together)."""
    a, b = _summary(recipe), _summary(ours)
    # an option the recipe leaves unset (None: "as the layer tree says") is no difference of its own
    said = [k for k in b if k in a and a[k] != b[k] and a[k] is not None]
    out = [f"{k} {b[k]!r} (recipe {a[k]!r})" for k in said]
    la, lb = _leaf_values(recipe), _leaf_values(ours)
    for path, values in lb.items():
        if path.split(".")[-1] in said or path in said:
            continue  # the option already listed (rms_norm_eps, router_aux_loss_coef ...)
        theirs = la.get(path)  # None: a part the recipe's model has not (the MTP block: "mtp layers" says so)
        if theirs is not None and any(v is not None for v in theirs) and _shown(values) != _shown(theirs):
            out.append(f"{path} {_shown(values)} (recipe {_shown(theirs)})")
    return out


def _explicit_value(config: Any, path: str) -> Any:
    head = path.split(".")[0]
    opts = _option_values(config)
    return opts[head] if path == head and head in opts else _at(config, path)


def _apply_run_options(folder_cfg: Any, recipe: Any, explicit: Sequence[str], *, where: str) -> Any:
    """The folder's config with the recipe's training-only options and explicit run fields on top; an explicit
    model field that contradicts the folder is an error naming both values."""
    recipe_opts = _option_values(recipe)
    updates = {}
    for k in ("mtp_loss_weight", "router_aux_loss_coef", "freeze"):
        if k == "router_aux_loss_coef" and k not in explicit:
            continue  # the release's load-balancing coefficient trains unless --model.router_aux_loss_coef is given
        # the option as set (it may reach nothing in the recipe's tree: a weight for the folder's MTP block), else
        # the value the recipe's tree holds
        value = getattr(recipe, k, None) if _has_field(recipe, k) else None
        value = recipe_opts.get(k) if value is None else value
        if value is not None and _has_field(folder_cfg, k):
            updates[k] = value
    if "mtp_loss_weight" not in updates and getattr(recipe, "mtp", None) is not None and folder_cfg.mtp is not None:
        # without the model-level option: the recipe's MTP loss weight on the folder's block
        updates["mtp"] = dataclasses.replace(folder_cfg.mtp, loss_weight=recipe.mtp.loss_weight)
    if updates:
        folder_cfg = dataclasses.replace(folder_cfg, **updates)
    problems = []
    for path in sorted(explicit):
        parts = path.split(".")
        if parts[0] in TRAINING_ONLY_OPTIONS or path == "mtp.loss_weight":
            continue
        want = _explicit_value(recipe, path)
        if any(p in _RUN_LEAVES for p in parts):
            if _at(folder_cfg, path) is not _ABSENT:
                folder_cfg = _replace_at(folder_cfg, parts, want)
            continue
        have = _explicit_value(folder_cfg, path)
        if have is _ABSENT:
            problems.append(f"--model.{path}={want!r} is set, but the folder's model has no such field")
        elif have != want:
            problems.append(f"--model.{path}={want!r} contradicts the folder: its config.json gives {have!r}")
    if problems:
        raise ConfigError(
            f"{where}: " + "; ".join(problems) + ". The folder is the model: drop the flag (or the run-file key), "
            "or edit the folder's config.json"
        )
    return folder_cfg


def _with_release_aux_coef(config: Any, hf: Mapping[str, Any]) -> Any:
    """A training run from a release trains the MoE load-balancing loss with the release's ``router_aux_loss_coef``
    (``text_config`` or top level). The family readers (``from_pretrained``: inference) follow transformers, which
    adds the loss only with ``output_router_logits``, an inference switch the releases ship false; a run's
    ``--model.router_aux_loss_coef`` still wins (``_apply_run_options``)."""
    text = hf.get("text_config") or {}
    coef = text.get("router_aux_loss_coef", hf.get("router_aux_loss_coef"))
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or not _has_field(config, "router_aux_loss_coef"):
        return config
    if _option_values(config).get("router_aux_loss_coef") is None:
        return config  # no MoE layer the option reaches (a dense model)
    return dataclasses.replace(config, router_aux_loss_coef=float(coef))


def has_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a complete DCP checkpoint (``step-N/.metadata``) a run resumes from."""
    return folder.is_dir() and any(p.is_file() for p in folder.glob("step-*/.metadata"))


def resolve_run_model(
    spec: ModelSpec,
    recipe_model: Any,
    *,
    folder: str | os.PathLike | None,
    explicit: Sequence[str] = (),
    dump_folder: str | os.PathLike | None = None,
    resuming: bool = False,
    write_copy: bool = False,
) -> RunModel:
    """The model config of a run: without an HF folder the recipe's; with one, the folder's ``config.json``
    read by the family's reader, its MTP block on when it ships one (``--model.use_mtp false``: off),
    the recipe's training-only options (``TRAINING_ONLY_OPTIONS``) on top.

    An explicit model field (``explicit``: dotted paths under ``model`` the user set on the command line or in
    a run file) that contradicts the folder is an error naming both values. With ``dump_folder``, the folder's
    ``config.json`` is copied to ``<dump_folder>/initial_model/`` (``write_copy``: the caller is rank 0), and a
    resumed run (``resuming``) reads that copy: it rebuilds the model it started with even if the folder changed.
    """
    copy = Path(dump_folder) / MODEL_COPY / "config.json" if dump_folder is not None else None
    resume_copy = bool(folder) and resuming and copy is not None and copy.is_file()
    if not (is_hf_folder(folder) or resume_copy) or spec.hf is None:
        return RunModel(config=recipe_model)
    folder = str(folder)
    # resumed: the model the run started with, even if the folder changed or is gone (the checkpoint holds it)
    current = read_hf_config(folder) if is_hf_folder(folder) else None
    hf, changed = current, False
    if resume_copy:
        hf = json.loads(copy.read_text())
        changed = hf != current
    spec_for_hf(hf, where=folder, spec_name=spec.name)
    use_mtp = None
    if "use_mtp" in explicit:
        use_mtp = _option_values(recipe_model).get("use_mtp", getattr(recipe_model, "use_mtp", None))
    count = folder_mtp_layers(spec, hf)
    if use_mtp and not count:  # a fresh MTP block on a folder without one (the family's builder, H2's option)
        config, from_folder = spec.hf.config_from_hf(hf), False
        if not _has_field(config, "use_mtp"):
            raise ConfigError(f"{folder} ships no MTP block and this model has no use_mtp option to start one")
        config = dataclasses.replace(config, use_mtp=True)
    else:
        config, from_folder = config_from_folder(spec, hf, mtp=use_mtp)
    if spec.hf.fields_not_in_hf is not None:  # what the folder cannot say (a text-only folder's image path)
        config = dataclasses.replace(config, **{k: getattr(recipe_model, k) for k in spec.hf.fields_not_in_hf(hf)})
    config = _with_release_aux_coef(config, hf)
    config = _apply_run_options(config, recipe_model, explicit, where=f"--checkpoint.initial_load_path {folder}")
    if current is not None:
        config = with_folder_form(config, folder)
    if write_copy and copy is not None and not (resuming and copy.is_file()):
        copy.parent.mkdir(parents=True, exist_ok=True)
        tmp = copy.with_suffix(".tmp")
        tmp.write_text(json.dumps(hf, indent=2))
        tmp.replace(copy)
        (copy.parent / "source.json").write_text(
            json.dumps({"initial_load_path": folder, "explicit_model_fields": list(explicit)}, indent=2)
        )
    return RunModel(
        config=config, folder=folder, hf_config=dict(hf), differences=_differences(recipe_model, config),
        folder_changed=changed, mtp_from_folder=from_folder,
    )  # fmt: skip


def resumed_folder_config(config: Any) -> Any:
    """``config`` with ``checkpoint.initial_load_path`` set to the HF folder its run started from, when the command
    leaves the path out and the dump folder holds a checkpoint of a run started from a folder
    (``<dump_folder>/initial_model/source.json``): rerunning a run's command without the path resumes the folder's
    model (``<dump_folder>/initial_model/config.json``), not the recipe's. Otherwise ``config`` unchanged."""
    ck = getattr(config, "checkpoint", None)
    if ck is None or ck.initial_load_path or not ck.enable:
        return config
    dump = Path(config.dump_folder)
    source = dump / MODEL_COPY / "source.json"
    if not source.is_file() or not has_checkpoint(dump / ck.folder):
        return config
    started = json.loads(source.read_text()).get("initial_load_path")
    if not started:
        return config
    logger.info(
        "resuming a run that started from the HF folder %s (%s): its model, not the recipe's", started, source
    )
    return dataclasses.replace(config, checkpoint=dataclasses.replace(ck, initial_load_path=started))
