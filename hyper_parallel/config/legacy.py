"""The v1 run-file layout (``model:`` / ``data:`` / ``train:``), translated into the new run config.

The previous trainer read one YAML file with three sections::

    model: {name, model_path, ...}
    data:  {train_path, max_seq_len, global_batch_size_tokens, ...}
    train: {max_steps, lr, ..., accelerator: {fsdp_size, tp_size, ...}, optimizer: {...}, checkpoint: {...}}

``--config-file old.yaml`` still accepts such a file: :func:`translate_legacy` maps every key through
:data:`LEGACY_KEYS` (the one mapping table; ``docs/migrations/v2_migration.md`` is generated from it)
into nested overrides of ``Trainer.Config`` and warns (``DeprecationWarning``) with the equivalent
new command line. A key without an equivalent is an error; one error lists all of them.
"""

from __future__ import annotations

import difflib
import shlex
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hyper_parallel.config.errors import ConfigError

__all__ = [
    "LEGACY_KEYS",
    "LEGACY_SECTIONS",
    "LegacyConfigWarning",
    "LegacyKey",
    "cli_args",
    "is_legacy_layout",
    "translate_legacy",
]

LEGACY_SECTIONS = ("model", "data", "train")
"""Top-level sections of a v1 run file."""

_NEW_SECTIONS = (
    "model_spec", "model", "training", "parallelism", "activation_checkpoint", "compile", "comm", "debug",
    "data", "optimizer", "lr_scheduler", "loss", "ema", "lora", "checkpoint", "validation", "metrics", "profiling",
    "dump_folder", "explicit_model_fields",
)  # fmt: skip
MIGRATION_DOC = "docs/migrations/v2_migration.md"


class LegacyConfigWarning(DeprecationWarning):
    """A run file in the deprecated v1 layout was translated; the message holds the new command line."""


# DeprecationWarning is hidden by default outside __main__, but this one is meant for whoever runs the
# CLI: show it once per location unless the user chose warning filters (-W / PYTHONWARNINGS) themselves.
if not sys.warnoptions:
    warnings.filterwarnings("default", category=LegacyConfigWarning)


class _Unconvertible(Exception):
    """A v1 key or value that cannot be translated (collected, then reported together)."""


@dataclass(frozen=True)
class LegacyKey:
    """How one v1 key maps into the new config."""

    targets: tuple[str, ...]
    """New dotted fields it sets (``training.steps``); empty when it has no equivalent."""
    rule: str
    """How the value converts, or (no targets) why there is no equivalent and what to do instead."""
    convert: Callable[[Any, Mapping[str, Any]], dict[str, Any]]
    """``(value, all v1 keys flat) -> {new dotted field: value}``; raises ``_Unconvertible``."""


# ---- converters ---------------------------------------------------------------------------------------


def _cli_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)  # tyro spells booleans True/False
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _typed(value: Any, kind: type) -> Any:
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        want = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(kind, kind.__name__)
        raise _Unconvertible(f"expected {want}, got {value!r}")
    return value


def _same(target: str, kind: type, rule: str = "same value") -> LegacyKey:
    def convert(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
        return {target: _typed(value, kind)}

    return LegacyKey((target,), rule, convert)


def _choice(target: str, mapping: dict[Any, Any]) -> LegacyKey:
    def convert(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(value, bool) or value not in mapping:
            raise _Unconvertible(f"{value!r} has no equivalent; use one of {', '.join(map(repr, mapping))}")
        return {target: mapping[value]}

    identity = all(k == v for k, v in mapping.items())
    rule = "one of " + ", ".join(f"`{k}`" for k in mapping) if identity else "; ".join(
        f"`{_yaml(k)}` -> `{_yaml(v)}`" for k, v in mapping.items()
    )
    return LegacyKey((target,), rule, convert)


def _switch(on: dict[str, Any], off: dict[str, Any]) -> LegacyKey:
    def convert(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
        return dict(on if _typed(value, bool) else off)

    def show(d: dict[str, Any]) -> str:
        return ", ".join(f"`{k}={_cli_value(v)}`" for k, v in d.items()) or "nothing"

    return LegacyKey(tuple(dict.fromkeys([*on, *off])), f"`true` -> {show(on)}; `false` -> {show(off)}", convert)


def _none(reason: str) -> LegacyKey:
    def convert(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
        raise _Unconvertible(f"no equivalent: {reason}")

    return LegacyKey((), f"error: {reason}", convert)


def _max_steps(flat: Mapping[str, Any], key: str) -> int:
    steps = flat.get("train.max_steps")
    if steps is None:
        raise _Unconvertible(
            f"a ratio of the run length needs train.max_steps in the same file (the recipe's steps may still be "
            f"overridden); add train.max_steps, or replace {key} by a step count"
        )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise _Unconvertible(f"train.max_steps={steps!r} must be a positive integer to convert {key}")
    return steps


def _warmup_ratio(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
    ratio = _typed(value, float)
    if not 0.0 <= ratio <= 1.0:
        raise _Unconvertible(f"{ratio!r} must lie in [0, 1]")
    steps = _max_steps(flat, "train.lr_warmup_ratio")
    # round, not int(): 0.29 * 100 is 28.999999999999996 in floating point
    return {"lr_scheduler.warmup_steps": int(round(ratio * steps))}


def _lr_min(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
    lr_min = _typed(value, float)
    lr = flat.get("train.optimizer.lr", flat.get("train.lr"))
    if lr is None:
        raise _Unconvertible(
            "the new schedule takes a ratio of the peak LR: give train.lr in the same file, or use "
            "train.lr_min_ratio instead"
        )
    lr = _typed(lr, float)
    if lr <= 0 or not 0.0 <= lr_min <= lr:
        raise _Unconvertible(f"{lr_min!r} must lie in [0, train.lr={lr!r}]")
    # 12 significant digits drop float noise (2e-6 / 2e-5 = 0.09999999999999999) and nothing else
    return {"lr_scheduler.min_lr_ratio": float(f"{lr_min / lr:.12g}")}


def _save_steps(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
    steps = _typed(value, int)
    if steps < 0:
        raise _Unconvertible(f"{steps} must be >= 0 (0 disables checkpoints)")
    return {"checkpoint.enable": True, "checkpoint.interval": steps} if steps else {"checkpoint.enable": False}


def _betas(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _Unconvertible(f"expected a list of two numbers, got {value!r}")
    return {"optimizer.betas": tuple(_typed(v, float) for v in value)}


def _config_path(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
    if value == flat.get("model.model_path"):
        return {}  # the usual v1 habit: config_path repeats model_path; the weights folder is enough
    raise _Unconvertible(
        "no equivalent: the architecture comes from the recipe (--config), not from a config.json; write a "
        "recipe whose model is glm_image_moe_v2.config_from_hf(read_hf_config(path)), or drop the key when it "
        "repeats model.model_path"
    )


def _dyn_bsz(value: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
    if _typed(value, bool):
        return {}
    raise _Unconvertible(
        "no equivalent: fixed sample-count batches are gone, every micro-batch is packed to a token budget; "
        "remove data.dyn_bsz and size batches with data.max_seq_len / data.global_batch_size_tokens"
    )


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}  # fmt: skip
_MIXED = {"training.mixed_precision_param": "bfloat16", "training.mixed_precision_reduce": "float32"}
_FULL = {"training.mixed_precision_param": "float32", "training.mixed_precision_reduce": "float32"}

LEGACY_KEYS: dict[str, LegacyKey] = {
    # ---- model: ------------------------------------------------------------------------------------------
    "model.name": _same("model_spec", str),
    "model.model_path": _same("checkpoint.initial_load_path", str),
    "model.config_path": LegacyKey(
        (), "ignored when equal to `model.model_path`, else an error: the architecture comes from the recipe "
        "(`--config`)", _config_path,
    ),
    "model.tokenizer_path": _none("DirectToken shards are already tokenized and the trainer reads no tokenizer; remove it"),
    "model.attn_implementation": _none("attention is always the packed (varlen) SDPA core; remove it"),
    "model.moe_implementation": _none(
        "the grouped-matmul kernel is a model field: glm_image_moe_config(grouped_mm_impl=...) in the recipe"
    ),
    # ---- data: -------------------------------------------------------------------------------------------
    "data.train_path": _same("data.path", str),
    "data.data_type": _choice("data.source", {"direct_token": "direct_token", "webdataset": "direct_token",
                                              "preset_pt": "preset_pt"}),
    "data.max_seq_len": _same("data.max_tokens_per_microbatch", int, "same value (with rmpad/dyn_bsz it was the token "
                              "budget of one packed micro-batch)"),
    "data.max_tokens": _same("data.max_tokens_per_microbatch", int),
    "data.global_batch_size_tokens": _same("data.global_batch_tokens", int),
    "data.dyn_bsz": LegacyKey((), "`true` -> nothing (always on); `false` is an error (token budgets only)", _dyn_bsz),
    "data.num_workers": _same("data.num_workers", int),
    "data.seed": _same("data.seed", int),
    "data.shuffle_buffer_size": _same("data.shuffle_buffer", int),
    "data.pad_to_multiple_of": _same("data.pad_to_multiple_of", int),
    "data.pad_token_id": _same("data.pad_token_id", int),
    "data.skip_bad_samples": _switch({"data.on_bad_sample": "skip"}, {"data.on_bad_sample": "error"}),
    "data.cache_dir": _same("data.cache_dir", str),
    "data.drop_last": _none("the sample stream never ends (epochs repeat) and every step is full; remove it"),
    "data.text_keys": _none("DirectToken shards hold token arrays, not text; remove it"),
    # ---- train: loop, optimizer, schedule ----------------------------------------------------------------
    "train.max_steps": _same("training.steps", int),
    "train.num_train_epochs": _none("runs are step-based: give train.max_steps (--training.steps)"),
    "train.micro_batch_size": _none("micro-batches are token budgets, not sample counts: use data.max_seq_len"),
    "train.global_batch_size": _none("steps are token budgets, not sample counts: use data.global_batch_size_tokens"),
    "train.lr": _same("optimizer.lr", float),
    "train.weight_decay": _same("optimizer.weight_decay", float),
    "train.optimizer": _choice("optimizer.name", {"adamw": "adamw", "muon": "muon"}),
    "train.optimizer.name": _choice("optimizer.name", {"adamw": "adamw", "muon": "muon"}),
    "train.optimizer.lr": _same("optimizer.lr", float),
    "train.optimizer.weight_decay": _same("optimizer.weight_decay", float),
    "train.optimizer.betas": LegacyKey(("optimizer.betas",), "a list of two numbers -> a pair", _betas),
    "train.optimizer.eps": _same("optimizer.eps", float),
    "train.optimizer.momentum": _same("optimizer.momentum", float),
    "train.optimizer.nesterov": _same("optimizer.nesterov", bool),
    "train.optimizer.ns_steps": _same("optimizer.ns_steps", int),
    "train.optimizer.muon_lr": _same("optimizer.muon_lr", float),
    "train.optimizer.muon_weight_decay": _same("optimizer.muon_weight_decay", float),
    "train.lr_warmup_ratio": LegacyKey(("lr_scheduler.warmup_steps",), "`round(ratio x train.max_steps)`; needs "
                                       "`train.max_steps` in the same file", _warmup_ratio),
    "train.lr_warmup_steps": _same("lr_scheduler.warmup_steps", int),
    "train.lr_decay_style": _choice("lr_scheduler.decay_type", {"cosine": "cosine", "linear": "linear",
                                                                "constant": "constant"}),
    "train.lr_min": LegacyKey(("lr_scheduler.min_lr_ratio",), "`lr_min / train.lr`; needs `train.lr` (or "
                              "`train.optimizer.lr`) in the same file", _lr_min),
    "train.lr_min_ratio": _same("lr_scheduler.min_lr_ratio", float),
    "train.lr_decay_steps": _same("lr_scheduler.decay_steps", int),
    "train.max_grad_norm": _same("training.max_norm", float),
    "train.seed": _same("debug.seed", int),
    "train.deterministic": _same("debug.deterministic", bool),
    # ---- train: precision, memory, compile, EMA, logging -------------------------------------------------
    "train.enable_mixed_precision": _switch(_MIXED, _FULL),
    "train.bf16": _switch(_MIXED, _FULL),
    "train.enable_gradient_checkpointing": _switch({"activation_checkpoint.mode": "full"},
                                                   {"activation_checkpoint.mode": "none"}),
    "train.enable_full_shard": _switch({"parallelism.fsdp_reshard_after_forward": "default"},
                                       {"parallelism.fsdp_reshard_after_forward": "never"}),
    "train.enable_compile": _same("compile.enable", bool),
    "train.ema_decay": _same("ema.decay", float),
    "train.ema_update_every": _same("ema.update_every", int),
    "train.log_steps": _same("metrics.log_freq", int),
    "train.use_tensorboard": _same("metrics.enable_tensorboard", bool),
    "train.use_wandb": _same("metrics.wandb", bool, "same value (project, run name and entity: --metrics.wandb_project, "
                             "--metrics.wandb_run_name, --metrics.wandb_entity)"),
    "train.init_device": _none("the model is always built on the meta device and materialised after sharding; remove it"),
    "train.output_dir": _same("dump_folder", str),
    "train.save_steps": LegacyKey(("checkpoint.enable", "checkpoint.interval"), "`N > 0` -> `checkpoint.enable=True, "
                                  "checkpoint.interval=N`; `0` -> `checkpoint.enable=False`", _save_steps),
    # ---- train.accelerator: ------------------------------------------------------------------------------
    "train.accelerator.fsdp_size": _same("parallelism.data_parallel_shard_degree", int),
    "train.accelerator.replicate_size": _same("parallelism.data_parallel_replicate_degree", int),
    "train.accelerator.tp_size": _same("parallelism.tensor_parallel_degree", int),
    "train.accelerator.ep_size": _same("parallelism.expert_parallel_degree", int),
    "train.accelerator.cp_size": _same("parallelism.context_parallel_degree", int),
    "train.accelerator.ulysses_size": _same("parallelism.context_parallel_degree", int),
    "train.accelerator.sequence_parallel": _same("parallelism.enable_sequence_parallel", bool),
    "train.accelerator.loss_parallel": _same("parallelism.enable_loss_parallel", bool),
    "train.accelerator.backend": _choice("comm.backend", {"auto": "auto", "nccl": "nccl", "gloo": "gloo"}),
    "train.accelerator.dp_size": _none("give fsdp_size and replicate_size (data parallel = replicate x shard)"),
    # ---- train.checkpoint: -------------------------------------------------------------------------------
    "train.checkpoint.enable": _same("checkpoint.enable", bool),
    "train.checkpoint.save_steps": LegacyKey(("checkpoint.enable", "checkpoint.interval"), "as `train.save_steps`",
                                             _save_steps),
    "train.checkpoint.dir": _same("checkpoint.folder", str, "same value (relative to the dump folder; an absolute path "
                                  "stays absolute)"),
    "train.checkpoint.keep_last": _same("checkpoint.keep_latest_k", int),
    "train.checkpoint.async_save": _switch({"checkpoint.async_mode": "async"}, {"checkpoint.async_mode": "disabled"}),
    "train.checkpoint.save_hf_weights": _same("checkpoint.export_hf", bool),
    "train.checkpoint.hf_dtype": _choice("checkpoint.export_dtype", _DTYPES),
    "train.checkpoint.load_path": _none(
        "resume is automatic from the newest complete checkpoint in <dump_folder>/<checkpoint.folder>: point "
        "train.output_dir there; to start from HF weights use model.model_path"
    ),
}
"""Every v1 key, in the order of the migration guide's table."""


# ---- translation ----------------------------------------------------------------------------------------


def _legacy_only(key: str) -> bool:
    entry = LEGACY_KEYS.get(key)
    return entry is not None and entry.targets != (key,)


def is_legacy_layout(data: dict[str, Any]) -> bool:
    """Whether a run file uses the v1 layout: a ``train:`` section, or v1-only keys under ``model:``/``data:``.

    Keys that exist with the same meaning in both layouts (``data.num_workers``) decide nothing.
    """
    if not isinstance(data, dict):
        return False
    if "train" in data:
        return True
    for section in ("model", "data"):
        body = data.get(section)
        if isinstance(body, dict) and any(_legacy_only(f"{section}.{key}") for key in body):
            return True
    return False


def _flatten(data: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """v1 nested dict -> ``{dotted v1 key: value}`` for keys of the table; unknown keys go to ``problems``."""
    flat: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and any(k.startswith(path + ".") for k in LEGACY_KEYS):
                walk(value, path + ".")
            elif path in LEGACY_KEYS:
                flat[path] = value
            else:
                siblings = [k for k in LEGACY_KEYS if k.rsplit(".", 1)[0] == prefix.rstrip(".")]
                close = difflib.get_close_matches(path, siblings, n=1, cutoff=0.75)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append(f"{path}: unknown v1 key{hint}")

    for section, body in data.items():
        if section not in LEGACY_SECTIONS:
            mixed = " (a section of the new layout: do not mix layouts in one file)" if section in _NEW_SECTIONS else ""
            problems.append(f"{section}: not a v1 section; a v1 file has only model:, data: and train:{mixed}")
        elif body is None:
            continue  # an empty `section:` in YAML
        elif not isinstance(body, dict):
            problems.append(f"{section}: a v1 section must be a mapping, got {body!r}")
        else:
            walk(body, section + ".")
    return flat


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def cli_args(overrides: dict[str, Any]) -> list[str]:
    """Flat ``{dotted field: value}`` -> the equivalent command-line arguments (``--training.steps 100``)."""
    args: list[str] = []
    for key, value in overrides.items():
        if isinstance(value, bool):  # booleans are flags: --a.b / --a.no_b
            *parents, leaf = key.split(".")
            args.append("--" + ".".join([*parents, leaf if value else f"no_{leaf}"]))
            continue
        args.append(f"--{key}")
        if isinstance(value, (list, tuple)):
            args.extend(_cli_value(v) for v in value)
        else:
            args.append(_cli_value(value))
    return args


def translate_legacy(data: dict[str, Any], *, source: str) -> dict[str, Any]:
    """Translate a v1 run file (nested dict) into nested overrides of ``Trainer.Config``.

    Warns with :class:`LegacyConfigWarning` (a ``DeprecationWarning``) whose message holds the
    equivalent new command line. Raises ``ConfigError`` listing every key without an equivalent,
    every value that cannot convert, and every pair of keys that set one field to different values.
    """
    problems: list[str] = []
    flat = _flatten(data, problems)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in flat.items():
        if value is None:
            continue  # v1 wrote `key: null` (or `key:`) for "unset": keep the recipe's value
        try:
            converted = LEGACY_KEYS[key].convert(value, flat)
        except _Unconvertible as e:
            problems.append(f"{key}: {e}")
            continue
        for new_key, new_value in converted.items():
            if new_key in out and out[new_key] != new_value:
                problems.append(
                    f"{key}: sets {new_key}={new_value!r}, but {origin[new_key]} already set it to {out[new_key]!r}; "
                    "keep one of the two keys"
                )
                continue
            out[new_key] = new_value
            origin.setdefault(new_key, key)
    if problems:
        raise ConfigError(
            f"{source} uses the v1 layout (model:/data:/train:); {len(problems)} of its keys cannot be translated "
            "into the new config:\n  " + "\n  ".join(problems) + f"\nRemove or replace them; {MIGRATION_DOC} maps "
            "every v1 key."
        )
    cli = shlex.join(cli_args(out))
    warnings.warn(
        f"{source} uses the deprecated v1 layout (model:/data:/train:). It was translated into the new config; "
        f"the equivalent command-line overrides are:\n  {cli}\nPass these instead (or write a run file with the "
        f"new sections); see {MIGRATION_DOC}.",
        LegacyConfigWarning,
        stacklevel=3,
    )
    return _nest(out)


def _check_table() -> None:
    # Import-time sanity: every target lives in a known section, every rule is written down.
    for key, entry in LEGACY_KEYS.items():
        if key.split(".", 1)[0] not in LEGACY_SECTIONS:
            raise AssertionError(f"LEGACY_KEYS[{key!r}] is outside the v1 sections")
        for target in entry.targets:
            if target.split(".", 1)[0] not in _NEW_SECTIONS:
                raise AssertionError(f"LEGACY_KEYS[{key!r}] targets {target!r}, outside Trainer.Config")
        if not entry.rule:
            raise AssertionError(f"LEGACY_KEYS[{key!r}] has no rule text")


_check_table()
