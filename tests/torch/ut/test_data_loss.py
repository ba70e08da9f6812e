"""dyn_bsz: accumulating micro-batch losses (global token mean) == one big batch, also across DP ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from hyper_parallel.data import DataConfig, ToyCorpusSpec, global_token_count, global_token_mean_ce, make_toy_samples, write_shards

V, C, P, D = 512, 256, 511, 16
FACTS = dict(lang_vocab_size=V, codebook_size=C, placeholder_token_id=P)


class TinyLM(nn.Module):
    """Embedding + linear head; image positions take the codebook embedding of their code."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, D)
        self.codebook = nn.Embedding(C, D)
        self.head = nn.Linear(D, V + C)

    def forward(self, mb: dict) -> torch.Tensor:
        h = self.embed(mb["input_ids"].reshape(-1))
        h = h.index_copy(0, mb["visual_indices"], self.codebook(mb["vq_codes"]))
        return self.head(torch.tanh(h)).view(*mb["input_ids"].shape, V + C)


def _concat(micro_batches: list[dict]) -> dict:
    """All micro-batches as one big [1, sum T] batch."""
    offsets, total = [], 0
    for mb in micro_batches:
        offsets.append(total)
        total += mb["input_ids"].numel()
    return {
        "input_ids": torch.cat([mb["input_ids"].view(-1) for mb in micro_batches]).view(1, -1),
        "labels": torch.cat([mb["labels"].view(-1) for mb in micro_batches]).view(1, -1),
        "visual_indices": torch.cat([mb["visual_indices"] + o for mb, o in zip(micro_batches, offsets)]),
        "vq_codes": torch.cat([mb["vq_codes"] for mb in micro_batches]),
    }


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _big_batch_grads(micro_batches: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = TinyLM()
    big = _concat(micro_batches)
    loss = F.cross_entropy(model(big).view(-1, V + C), big["labels"].view(-1), ignore_index=-100)  # plain token mean
    loss.backward()
    return loss.detach(), _grads(model)


def _accumulated_grads(micro_batches: list[dict], count) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = TinyLM()
    total = torch.zeros(())
    for mb in micro_batches:
        loss = global_token_mean_ce(model(mb), mb["labels"], count)
        loss.backward()
        total += loss.detach()
    return total, _grads(model)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("loss_corpus")
    write_shards(str(out), make_toy_samples(ToyCorpusSpec(**FACTS, num_samples=128)), placeholder_token_id=P,
                 samples_per_shard=16)
    return str(out)


def _steps(corpus: str, dp_world_size: int) -> list[list[dict]]:
    cfg = DataConfig(path=corpus, max_tokens_per_microbatch=128, global_batch_tokens=3 * 128 * dp_world_size,
                     pad_to_multiple_of=16)
    return [cfg.build(**FACTS, dp_rank=r, dp_world_size=dp_world_size).next_step() for r in range(dp_world_size)]


@pytest.mark.parametrize("dp_world_size", [1, 2])
def test_accumulated_gradient_equals_big_batch(corpus, dp_world_size):
    per_rank = _steps(corpus, dp_world_size)
    every = [mb for step in per_rank for mb in step]
    assert len(every) == 3 * dp_world_size
    count = global_token_count(every)  # what the all-reduce over ranks computes
    ref_loss, ref = _big_batch_grads(every)
    loss, acc = 0.0, None
    for step in per_rank:  # each "rank" accumulates its own micro-batches; DP reduction sums
        rank_loss, g = _accumulated_grads(step, count)
        loss = loss + rank_loss
        acc = g if acc is None else {k: acc[k] + g[k] for k in acc}
    assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item()  # fp32 sums: relative
    assert _max_diff(acc, ref) <= 1e-6
    # An unequal split really matters: a per-micro-batch mean would not match.
    model = TinyLM()
    for mb in every:
        (F.cross_entropy(model(mb).view(-1, V + C), mb["labels"].view(-1)) / len(every)).backward()
    assert _max_diff(_grads(model), ref) > 1e-5


def test_step_without_targets_is_zero_not_nan():
    mb = {"labels": torch.full((1, 4), -100)}
    count = global_token_count([mb])
    assert count.item() == 0
    logits = torch.randn(1, 4, 8, requires_grad=True)
    loss = global_token_mean_ce(logits, mb["labels"], count)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0


def _dp_worker(rank: int, world: int, corpus: str, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        per_rank = _steps(corpus, world)  # every rank builds all ranks' data for the reference
        mine = per_rank[rank]
        count = global_token_count(mine)  # one all-reduce
        assert count.item() == sum(int((mb["labels"] != -100).sum()) for step in per_rank for mb in step)
        loss, grads = _accumulated_grads(mine, count)
        for g in grads.values():
            dist.all_reduce(g)  # DP gradient reduction: SUM
        dist.all_reduce(loss)
        ref_loss, ref = _big_batch_grads([mb for step in per_rank for mb in step])
        assert abs(loss.item() - ref_loss.item()) <= 1e-6 * ref_loss.item(), (loss.item(), ref_loss.item())
        assert _max_diff(grads, ref) <= 1e-6, _max_diff(grads, ref)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_big_batch(corpus, tmp_path):
    init_file = str(tmp_path / "pg_init")
    mp.spawn(_dp_worker, args=(2, corpus, init_file), nprocs=2, join=True)
