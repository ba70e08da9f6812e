"""Assistant-only chat data through the trainer on gloo ranks: FSDP2 over 2 ranks with 2 micro-batches each gives
the loss of one process over the same 4 micro-batches (the exact mean over the trained tokens of the global
batch; the one-process loss itself is checked against a hand computation in tests/torch/ut/data/test_chat_sft.py)."""

from __future__ import annotations

ARGS = ["--module", "qwen3_5_moe", "--config", "qwen3_5_moe_sft_debug", "--debug.deterministic",
        "--training.steps", "1", "--checkpoint.no_enable", "--checkpoint.no_export_hf",
        "--data.max_tokens_per_microbatch", "128", "--data.global_batch_tokens", "512"]  # fmt: skip


def sft_step(dump: str, cache: str, extra: list[str]) -> dict:
    import torch.distributed as dist

    from hyper_parallel.config import ConfigManager

    rank = dist.get_rank()
    cfg = ConfigManager().parse_args([*ARGS, "--data.cache_dir", cache, "--dump_folder", f"{dump}/r{rank}", *extra])
    trainer = cfg.build()
    try:
        micro_batches = trainer.data.micro_batches_per_step
        stats = trainer.train_step()
    finally:
        trainer.close()
    return {"loss": stats["loss"], "aux": stats["extra"].get("aux_loss", 0.0),
            "trained": stats["extra"]["tokens/trained"], "micro_batches": micro_batches}  # fmt: skip


def test_fsdp2_two_micro_batches_equal_one_process(pool, tmp_path):
    cache = str(tmp_path / "cache")
    (one,) = pool.run(sft_step, 1, str(tmp_path / "one"), cache, [])
    two = pool.run(sft_step, 2, str(tmp_path / "two"), cache, ["--parallelism.data_parallel_shard_degree", "2"])
    assert one["micro_batches"] == 4 and all(r["micro_batches"] == 2 for r in two)
    print(f"one process {one['loss']:.7f}, FSDP2 x2 {two[0]['loss']:.7f}, trained share {one['trained']:.4f}")
    assert 0.05 < one["trained"] < 0.95  # assistant-only: a share of the tokens trains
    for r in two:
        assert abs(r["loss"] - one["loss"]) <= 1e-5 and abs(r["aux"] - one["aux"]) <= 1e-5
        assert r["trained"] == one["trained"]
