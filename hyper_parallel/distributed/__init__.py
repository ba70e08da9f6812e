"""Parallelism on torch.distributed: ParallelDims and meshes, FSDP/HSDP, TP/SP, EP, Ulysses CP, AC, compile.

A model package's ``parallelize.py`` calls ``parallelize_decoder`` with its declared placements
(``sharding.py``); the trainer uses ``init_distributed``, ``ParallelDims``, ``split_batch_for_cp`` and
``clip_grad_norm_``. The same code runs on CUDA + NCCL and CPU + gloo, chosen at run time.
"""

from hyper_parallel.distributed.activation_checkpoint import apply_activation_checkpointing, layers_to_checkpoint
from hyper_parallel.distributed.compile import apply_compile
from hyper_parallel.distributed.context_parallel import (
    apply_ulysses_cp,
    head_to_seq_all_to_all,
    seq_to_head_all_to_all,
    split_batch_for_cp,
)
from hyper_parallel.distributed.env import (
    destroy_distributed,
    device_type,
    get_device,
    init_distributed,
    resolve_backend,
    set_determinism,
    set_pg_timeouts,
    world_info,
)
from hyper_parallel.distributed.expert_parallel import AllToAllTokenDispatcher, apply_expert_parallel_dispatch
from hyper_parallel.distributed.fsdp import mixed_precision_policy, reshard_policy, shard_module, sum_gradients
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.distributed.parallelize import declared_shardings, parallelize_decoder
from hyper_parallel.distributed.tensor_parallel import apply_sharding_configs, distribute_module_params
from hyper_parallel.distributed.utils import clip_grad_norm_, dist_max, dist_sum

__all__ = [
    "AllToAllTokenDispatcher",
    "ParallelDims",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_expert_parallel_dispatch",
    "apply_sharding_configs",
    "apply_ulysses_cp",
    "clip_grad_norm_",
    "declared_shardings",
    "destroy_distributed",
    "device_type",
    "dist_max",
    "dist_sum",
    "distribute_module_params",
    "get_device",
    "head_to_seq_all_to_all",
    "init_distributed",
    "layers_to_checkpoint",
    "mixed_precision_policy",
    "parallelize_decoder",
    "reshard_policy",
    "resolve_backend",
    "seq_to_head_all_to_all",
    "set_determinism",
    "set_pg_timeouts",
    "shard_module",
    "split_batch_for_cp",
    "sum_gradients",
    "world_info",
]
