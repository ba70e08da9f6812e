"""Activation checkpointing per decoder layer: ``none``, ``full`` (every layer) or ``selective`` (every N-th).

Uses torch's composable ``checkpoint`` (hooks, not a wrapper module), so parameter FQNs stay equal to
the config tree's. The checkpoint hooks must be the FIRST forward hooks of a layer: recomputation
calls the layer again, which re-runs every other hook of the layer (FSDP unshard, TP input layouts)
on the arguments the checkpoint saved. Those must therefore be the original arguments, so
``parallelize`` applies activation checkpointing before any hook-based parallelism touches the
layers themselves (hooks on their children are unaffected).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed._composable import checkpoint

from hyper_parallel.config.training import ActivationCheckpointConfig

__all__ = ["apply_activation_checkpointing", "layers_to_checkpoint"]


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


def apply_activation_checkpointing(layers: Iterable[nn.Module], ac: ActivationCheckpointConfig) -> list[int]:
    """Checkpoint the selected decoder layers in place; return their indices."""
    layers = list(layers)
    chosen = layers_to_checkpoint(len(layers), ac)
    for i in chosen:
        layer = layers[i]
        if layer._forward_pre_hooks:
            raise RuntimeError(
                f"layer {i} already has forward pre-hooks: apply activation checkpointing before hook-based "
                "parallelism (TP/FSDP) on the layer, so recomputation replays the original inputs"
            )
        checkpoint(layer, preserve_rng_state=ac.preserve_rng_state)
    return chosen
