"""Gradient accumulation through the trainer on gloo ranks: dyn_bsz over data-parallel ranks equals one
process, and FSDP keeps gradients sharded between micro-batches (reduce-scatter after each one) with the
same losses and gradients as deferring the reduction to the last micro-batch."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.torch.ut.trainer.test_accumulation import toy_micro_batches

ARGS = ["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--debug.deterministic",
        "--lr_scheduler.warmup_steps", "1", "--training.max_norm", "0", "--training.steps", "1",
        "--checkpoint.no_enable", "--checkpoint.no_export_hf", "--data.source", "preset_pt",
        "--data.max_tokens_per_microbatch", "128"]  # fmt: skip


def one_step(preset: str, dump: str, extra: list[str]) -> dict:
    """Build the trainer from the CLI, run one step; report loss, full gradients and, before each
    micro-batch after the first, which share of the parameters already holds a (sharded) gradient and
    how many reduce-scatters / all-reduces ran so far."""
    import torch.distributed as dist

    from hyper_parallel.config import ConfigManager

    rank = dist.get_rank()
    cfg = ConfigManager().parse_args([*ARGS, "--data.path", preset, "--dump_folder", f"{dump}/r{rank}", *extra])
    trainer = cfg.build()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    seen: list[dict] = []

    def before_forward(module, args, kwargs):
        grads = [p.grad for p in params]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
        with_grad = [p for p, g in zip(params, grads) if g is not None]
        seen.append({
            "with_grads": len(with_grad) / len(params),
            "sharded": bool(local) and sum(g.numel() for g in local) < sum(p.numel() for p in with_grad),
            **counts,
        })  # fmt: skip

    counts = {"reduce_scatter": 0, "all_reduce": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    # FSDP2 reduces through these two module-level functions (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
    originals = {"reduce_scatter_single": dist.reduce_scatter_single, "all_reduce": dist.all_reduce}
    dist.reduce_scatter_single = counting("reduce_scatter", originals["reduce_scatter_single"])
    dist.all_reduce = counting("all_reduce", originals["all_reduce"])
    handle = trainer.model.register_forward_pre_hook(before_forward, with_kwargs=True)
    try:
        stats = trainer.train_step()
        handle.remove()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in trainer.model.named_parameters() if p.grad is not None}  # fmt: skip
    finally:
        dist.reduce_scatter_single, dist.all_reduce = originals["reduce_scatter_single"], originals["all_reduce"]
        trainer.close()
    return {"loss": stats["loss"], "grads": grads if rank == 0 else None, "seen": seen[1:]}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and len(a) > 10
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _preset(tmp_path: Path) -> str:
    """16 packed micro-batches of 128 tokens (global micro-batch i = batch i of the file)."""
    path = tmp_path / "preset.pt"
    torch.save(toy_micro_batches(tmp_path / "cache", 16), path)
    return str(path)


def test_fsdp_two_ranks_two_micro_batches_equal_one_process_four(pool, tmp_path):
    preset = _preset(tmp_path)
    (ref,) = pool.run(one_step, 1, preset, str(tmp_path / "one"), ["--data.global_batch_tokens", "512"])
    got = pool.run(one_step, 2, preset, str(tmp_path / "two"),
                   ["--data.global_batch_tokens", "512", "--parallelism.data_parallel_shard_degree", "2"])  # fmt: skip
    assert abs(got[0]["loss"] - ref["loss"]) <= 1e-6
    assert _max_diff(got[0]["grads"], ref["grads"]) <= 1e-6


def test_gradients_stay_sharded_between_micro_batches(pool, tmp_path):
    """4 micro-batches per rank on FSDP 2 and on HSDP 2x2: by default every micro-batch's backward
    reduce-scatters (FSDP: the sharded gradients are in place before micro-batches 2-4; HSDP: only the
    all-reduce over replicas waits for the last micro-batch); deferral reduces nothing until the last
    micro-batch; both give the same step."""
    preset = _preset(tmp_path)
    fsdp = ["--data.global_batch_tokens", "1024", "--parallelism.data_parallel_shard_degree", "2"]
    hsdp = ["--data.global_batch_tokens", "2048", "--parallelism.data_parallel_replicate_degree", "2",
            "--parallelism.data_parallel_shard_degree", "2"]  # fmt: skip
    for world, layout in ((2, fsdp), (4, hsdp)):
        eager = pool.run(one_step, world, preset, str(tmp_path / f"eager{world}"), layout)
        deferred = pool.run(one_step, world, preset, str(tmp_path / f"defer{world}"),
                            [*layout, "--training.defer_grad_reduce"])  # fmt: skip
        for rank in eager:
            seen = rank["seen"]
            assert len(seen) == 3
            scatters = [s["reduce_scatter"] for s in seen]
            assert 0 < scatters[0] < scatters[1] < scatters[2], seen  # one round per micro-batch
            if world == 2:  # plain FSDP: the reduced, sharded gradients are the parameters' .grad
                assert all(s["with_grads"] == 1.0 and s["sharded"] for s in seen), seen
            else:  # HSDP: the replica all-reduce has not run yet (the step's own token-count all-reduce aside)
                assert len({s["all_reduce"] for s in seen}) == 1, seen
        for rank in deferred:
            assert all(s["with_grads"] == 0.0 and s["reduce_scatter"] == 0 for s in rank["seen"]), rank["seen"]
        assert abs(eager[0]["loss"] - deferred[0]["loss"]) <= 1e-6
        assert _max_diff(eager[0]["grads"], deferred[0]["grads"]) <= 1e-6


def load_hf_recording_timeouts(hf_dir: str, dump: str) -> list[int]:
    """Build a 2-rank trainer from an HF folder; return the process-group timeouts it set, in order."""
    import torch.distributed as dist

    import hyper_parallel.components.model_builder as builder_module
    from hyper_parallel.config import ConfigManager

    seen: list[int] = []
    original = builder_module.set_pg_timeouts

    def recording(seconds, mesh=None):
        seen.append(seconds)
        return original(seconds, mesh)

    builder_module.set_pg_timeouts = recording
    try:
        cfg = ConfigManager().parse_args([
            "--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--checkpoint.no_enable",
            "--checkpoint.initial_load_path", hf_dir, "--comm.hf_load_timeout_seconds", "1234",
            "--dump_folder", f"{dump}/r{dist.get_rank()}", "--parallelism.data_parallel_shard_degree", "2",
        ])  # fmt: skip
        trainer = cfg.build()
        trainer.close()
    finally:
        builder_module.set_pg_timeouts = original
    return seen


def test_the_hf_load_phase_runs_under_its_own_timeout(pool, tmp_path):
    """Rank 0 alone reads the HF folder while the others wait: that phase gets --comm.hf_load_timeout_seconds,
    then the init timeout comes back."""
    from tests.torch.ut.trainer.test_export import write_hf_folder_with_passthrough

    write_hf_folder_with_passthrough(tmp_path / "src", tmp_path / "hf")
    for seen in pool.run(load_hf_recording_timeouts, 2, str(tmp_path / "hf"), str(tmp_path / "run")):
        assert seen == [1234, 300], seen
