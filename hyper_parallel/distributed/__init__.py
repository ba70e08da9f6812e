"""Parallelism on torch.distributed: ParallelDims and meshes, FSDP/HSDP, TP/SP, EP, Ulysses CP, AC, compile."""
