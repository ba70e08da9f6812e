"""The parallel layout of a run."""

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class ParallelismConfig:
    """Degrees of each parallel dimension; their product must equal the world size."""

    data_parallel_replicate_degree: int = 1
    """HSDP replicate degree (whole-model replicas); 1 means plain FSDP."""
    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 takes whatever the other degrees leave of the world size."""
    context_parallel_degree: int = 1
    """Ulysses context parallel degree (all-to-all over attention heads)."""
    tensor_parallel_degree: int = 1
    """Tensor parallel degree (attention heads, MLP columns, head vocab)."""
    expert_parallel_degree: int = 1
    """Expert parallel degree, borrowed from dp_shard x cp; must divide the routed experts."""
    enable_sequence_parallel: bool = True
    """With TP: shard norms and residuals along the sequence (SP)."""
    enable_loss_parallel: bool = True
    """With TP: keep the head output vocab-sharded and compute the loss in parallel."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2 reshard policy; `default` reshards every module except the root."""
