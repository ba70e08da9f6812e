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
    """Context parallel degree: every row is split over this many ranks. Per sequence core, Ulysses (all-to-all
    over heads) where its heads per TP rank divide by it, else K/V all-gather (attention) or recurrent state
    passing (Gated DeltaNet), or the hybrid of `context_parallel_ulysses_degree`."""
    context_parallel_ulysses_degree: int = 1
    """Hybrid context parallel: Ulysses over groups of this many neighbouring CP ranks (inside a node), and
    the K/V all-gather / DeltaNet state passing across the context_parallel_degree / this groups, for every
    core whose heads per TP rank do not divide by context_parallel_degree. Must divide
    context_parallel_degree and the heads per TP rank of those cores; 1 = no hybrid (those cores gather or
    pass state over the whole CP group)."""
    tensor_parallel_degree: int = 1
    """Tensor parallel degree (attention heads, MLP columns, head vocab)."""
    expert_parallel_degree: int = 1
    """Expert parallel degree, borrowed from dp_shard x cp; must divide the routed experts."""
    enable_sequence_parallel: bool = True
    """With TP: shard norms and residuals along the sequence (SP)."""
    enable_loss_parallel: bool = True
    """With TP: keep the head output vocab-sharded and compute the loss in parallel."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages' rank groups (mesh axis pp, outermost)."""
    pipeline_schedule: Literal["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "GPipe"] = "1F1B"
    """torch.distributed.pipelining schedule."""
    pipeline_stages_per_rank: int = 1
    """Stages per pipeline rank (Interleaved1F1B >= 2, ZBVZeroBubble and DualPipeV 2)."""
    pipeline_split: tuple[int, ...] = ()
    """First layer of each later stage; empty: by layer cost."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2 reshard policy; `default` reshards every module except the root."""
