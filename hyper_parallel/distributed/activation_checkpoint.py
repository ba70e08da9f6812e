"""Activation checkpointing per decoder layer: ``none``, ``full`` (every layer) or ``selective`` (every N-th).

A checkpointed layer's class becomes a subclass whose ``forward`` runs the original one inside
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (``checkpointed_class``; FSDP2 swaps classes
the same way). Why not a hook or a wrapper module:

- parameter FQNs stay the config tree's (a ``CheckpointWrapper`` module would add ``_checkpoint_wrapped_module``);
- dynamo traces ``checkpoint`` inside the layer's ``forward`` as one higher-order op, so a compiled layer
  stays ONE graph under ``fullgraph=True`` (torch's composable, hook-based ``checkpoint`` enters a
  ``@contextmanager`` in a hook, which dynamo cannot trace);
- the layer's own hooks (FSDP unshard/reshard, TP input layouts) run OUTSIDE the checkpointed region, as with
  torchtitan's wrapper inside FSDP: recomputation replays ``forward`` only, on the inputs those hooks produced,
  and FSDP's pre-backward hook has the parameters unsharded before the recompute runs. So the order of
  parallelisms no longer matters for activation checkpointing (``parallelize`` applies it right before
  compile, as torchtitan does: AC -> compile -> FSDP).

Hooks on the layer's children (CP on attention cores, TP on projections) are inside ``forward`` and are
recomputed with it, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.utils.checkpoint import checkpoint

from hyper_parallel.config.training import ActivationCheckpointConfig

__all__ = ["apply_activation_checkpointing", "checkpointed_class", "is_checkpointed", "layers_to_checkpoint"]

_CLASSES: dict[tuple[type, bool], type] = {}
"""(original class, preserve_rng_state) -> its checkpointed subclass (one per pair, so compiled layers of one
kind share their code object and guards)."""


def layers_to_checkpoint(num_layers: int, ac: ActivationCheckpointConfig) -> list[int]:
    """Indices of the layers ``ac`` checkpoints."""
    if ac.mode == "none":
        return []
    if ac.mode == "full":
        return list(range(num_layers))
    if ac.mode == "selective":
        n = ac.selective_every_n_layers
        if n < 1:
            raise ValueError(f"--activation_checkpoint.selective_every_n_layers is {n}; it must be >= 1")
        return [i for i in range(num_layers) if i % n == 0]
    raise ValueError(f"unknown activation checkpoint mode {ac.mode!r}: use none, full or selective")


def checkpointed_class(cls: type[nn.Module], *, preserve_rng_state: bool = False) -> type[nn.Module]:
    """The subclass of ``cls`` whose ``forward`` recomputes ``cls.forward`` in backward (cached per class)."""
    key = (cls, preserve_rng_state)
    sub = _CLASSES.get(key)
    if sub is not None:
        return sub

    def forward(self, *args, **kwargs):
        # non-reentrant: keyword arguments pass through, and dynamo traces it as one higher-order op
        return checkpoint(
            super(sub, self).forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
        )

    forward.__doc__ = f"``{cls.__name__}.forward`` under activation checkpointing (recomputed in backward)."
    # no Config of its own: Configurable keeps the parent's (as for FSDP's FSDP<Module> classes)
    sub = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})
    sub._hp_checkpointed = True
    _CLASSES[key] = sub
    return sub


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` runs under activation checkpointing (``apply_activation_checkpointing``)."""
    return getattr(type(module), "_hp_checkpointed", False)


def apply_activation_checkpointing(layers: Iterable[nn.Module], ac: ActivationCheckpointConfig) -> list[int]:
    """Checkpoint the selected decoder layers in place (their class is swapped, nothing else); return their indices.

    Call before ``fully_shard`` (FSDP swaps the class again, to a subclass of this one) and before or after
    hook-based parallelism: hooks on the layer stay outside the checkpointed region either way."""
    layers = list(layers)
    chosen = layers_to_checkpoint(len(layers), ac)
    for i in chosen:
        layer = layers[i]
        if is_checkpointed(layer):
            raise RuntimeError(f"layer {i} ({type(layer).__name__}) is already activation-checkpointed")
        if hasattr(layer, "_get_fsdp_state"):
            raise RuntimeError(
                f"layer {i} is already FSDP-sharded: apply activation checkpointing before fully_shard (its class "
                "swap would hide FSDP's)"
            )
        layer.__class__ = checkpointed_class(type(layer), preserve_rng_state=ac.preserve_rng_state)
    return chosen
