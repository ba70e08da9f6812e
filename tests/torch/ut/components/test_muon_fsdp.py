"""Components on sharded DTensors, 4 gloo processes on CPU (one spawn, several checks):

- Muon (+ AdamW groups) on an FSDP2 model (``Shard(0)``, experts ``Shard(1)``, uneven shards) matches
  one process after 3 steps; the loss is the exact global token mean (CrossEntropyLoss normalised by
  global token count / dp degree, FSDP's gradient average, uneven token counts per rank);
- Muon on a 2x2 mesh (expert ``Shard(0)`` x ``Shard(1)``, a 2-D weight sharded on both dims, and
  FSDP over a column-parallel TP weight, whose placements include ``_StridedShard``);
- EMA shadows keep the parameters' placements and match the unsharded EMA;
- loss parallel: vocab-sharded logits give the plain CE value and gradient;
- CheckpointManager saves the sharded model/optimizer/EMA/per-rank state and resumes exactly.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 4
V, D, E, I_MOE, H_DENSE = 30, 16, 4, 6, 10  # V=30 and H_DENSE=10 shard unevenly over 4 ranks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(D)
        self.gate = nn.Linear(D, E, bias=False)  # router: AdamW
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I_MOE, D) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(E, D, I_MOE) * 0.2)
        self.up = nn.Linear(D, H_DENSE, bias=True)
        self.down = nn.Linear(H_DENSE, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        w = torch.softmax(self.gate(h), dim=-1)
        gate, up = torch.einsum("btd,efd->ebtf", h, self.gate_up_proj).chunk(2, dim=-1)
        routed = torch.einsum("ebtf,edf,bte->btd", F.silu(gate) * up, self.down_proj, w)
        return x + routed + self.down(F.silu(self.up(h)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class RankCounter:
    """A per-rank Stateful standing in for the data loader."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.value = sd["value"]


def _shard(model: Tiny, mesh) -> Tiny:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else None)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (WORLD * 2, 7), generator=g)
    labels = torch.randint(0, V, (WORLD * 2, 7), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.3] = -100  # uneven token counts per rank
    return ids, labels


def _max_diff(sharded: nn.Module, ref: nn.Module) -> float:
    diffs = [
        (p.full_tensor() - r).abs().max().item()
        for (n, p), (_, r) in zip(sharded.named_parameters(), ref.named_parameters(), strict=True)
    ]
    return max(diffs)


def _fsdp_checks(rank: int, mesh, ckpt_dir: str) -> dict[str, float]:
    from hyper_parallel.components import EMA, CheckpointManager, CrossEntropyLoss, LRSchedulersContainer, OptimizersContainer

    torch.manual_seed(0)
    ref = Tiny()
    model = _shard(copy.deepcopy(ref), mesh)
    opt_cfg = OptimizersContainer.Config(name="muon", lr=2e-2, weight_decay=0.1)
    sched_cfg = LRSchedulersContainer.Config(warmup_steps=1, decay_type="cosine")
    ema_cfg = EMA.Config(decay=0.9)
    opt_ref, opt = opt_cfg.build(model_parts=[ref]), opt_cfg.build(model_parts=[model])
    sched_ref, sched = sched_cfg.build(optimizers=opt_ref, total_steps=6), sched_cfg.build(optimizers=opt, total_steps=6)
    ema_ref, ema = ema_cfg.build(model=ref), ema_cfg.build(model=model)
    loss_fn = CrossEntropyLoss.Config().build()
    out: dict[str, float] = {"loss_diff": 0.0}

    def train_step(step: int, m: nn.Module, o, s, e, sharded: bool) -> float:
        ids, labels = _batch(step)
        n = int((labels != -100).sum())
        if sharded:
            ids, labels = ids[2 * rank : 2 * rank + 2], labels[2 * rank : 2 * rank + 2]
        o.zero_grad()
        # FSDP averages gradients over the 4 ranks: normalise by global tokens / dp degree
        loss = loss_fn(m(ids), labels, num_tokens=n / WORLD if sharded else n)
        loss.backward()
        o.step()
        s.step()
        e.update(m)
        loss = loss.detach().clone()
        if sharded:
            dist.all_reduce(loss)
            loss /= WORLD
        return loss.item()

    for step in range(3):
        l_ref = train_step(step, ref, opt_ref, sched_ref, ema_ref, sharded=False)
        l_sh = train_step(step, model, opt, sched, ema, sharded=True)
        out["loss_diff"] = max(out["loss_diff"], abs(l_ref - l_sh))
    out["param_diff"] = _max_diff(model, ref)
    placements_kept = all(
        ema.shadow[n].placements == p.placements and ema.shadow[n].device_mesh == p.device_mesh
        for n, p in model.named_parameters()
    )
    assert placements_kept, "EMA shadows lost the parameters' placements"
    out["ema_diff"] = max((ema.shadow[n].full_tensor() - ema_ref.shadow[n]).abs().max().item() for n in ema_ref.shadow)

    # --- checkpoint: save sharded state at step 3, resume into a differently initialised model ----
    def manager(m, o, s, e, counter):
        return CheckpointManager.Config(enable=True, interval=3, keep_latest_k=1).build(
            dump_folder=ckpt_dir, model_parts=[m], optimizers=o, lr_schedulers=s, states={"ema": e},
            rank_states={"data": counter},
        )

    assert manager(model, opt, sched, ema, RankCounter(10 + rank)).save(3)
    torch.manual_seed(123)
    model2 = _shard(Tiny(), mesh)
    opt2 = opt_cfg.build(model_parts=[model2])
    sched2 = sched_cfg.build(optimizers=opt2, total_steps=6)
    ema2 = ema_cfg.build(model=model2)
    counter2 = RankCounter(-1)
    resumed = manager(model2, opt2, sched2, ema2, counter2).load_latest()
    assert resumed == 3 and counter2.value == 10 + rank, (resumed, counter2.value)
    out["resume_param_diff"] = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in zip(model.parameters(), model2.parameters())
    )
    for step in range(3, 5):
        train_step(step, model, opt, sched, ema, sharded=True)
        train_step(step, model2, opt2, sched2, ema2, sharded=True)
    out["resume_then_train_diff"] = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in zip(model.parameters(), model2.parameters())
    )
    out["resume_ema_diff"] = max(
        (ema.shadow[n].full_tensor() - ema2.shadow[n].full_tensor()).abs().max().item() for n in ema.shadow
    )
    return out


def _mesh2d_checks() -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hyper_parallel.components import MuonWithAuxAdamW

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "fsdp"))
    g = torch.Generator().manual_seed(7)
    cases = {
        "experts_ep_fsdp": ((5, 12, 9), (Shard(0), Shard(1)), 2),  # uneven experts and rows
        "matrix_both_dims": ((11, 7), (Shard(0), Shard(1)), 1),
    }
    out = {}
    for name, (shape, placements, row_blocks) in cases.items():
        full = torch.randn(shape, generator=g)
        grads = [torch.randn(shape, generator=g) for _ in range(3)]
        ref = nn.Parameter(full.clone())
        sharded = nn.Parameter(distribute_tensor(full.clone(), mesh, placements))
        group = {"use_muon": True, "lr": 0.05, "weight_decay": 0.1, "row_blocks": row_blocks}
        opt_ref = MuonWithAuxAdamW([{"params": [ref], **group}])
        opt = MuonWithAuxAdamW([{"params": [sharded], **group}])
        for grad in grads:
            ref.grad = grad.clone()
            sharded.grad = distribute_tensor(grad.clone(), mesh, placements)
            opt_ref.step()
            opt.step()
        assert sharded.placements == placements
        out[name] = (sharded.full_tensor() - ref).abs().max().item()

    # FSDP over TP: FSDP shards a column-parallel weight with _StridedShard (not a Shard subclass)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 8, bias=False))
    ref = nn.Parameter(model[0].weight.detach().clone())
    parallelize_module(model, dp_tp["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=dp_tp["dp"])
    weight = model[0].weight
    opt_ref = MuonWithAuxAdamW([{"params": [ref], "use_muon": True, "lr": 0.05}])
    opt = MuonWithAuxAdamW([{"params": [weight], "use_muon": True, "lr": 0.05}])
    for _ in range(2):
        grad = torch.randn(8, 6, generator=g)
        ref.grad = grad.clone()
        weight.grad = distribute_tensor(grad.clone(), dp_tp, weight.placements)
        opt_ref.step()
        opt.step()
    out["fsdp_tp_strided"] = (weight.full_tensor() - ref).abs().max().item()
    return out


def _loss_parallel_checks(rank: int, mesh) -> dict[str, float]:
    from torch.distributed.tensor import DTensor, Shard

    from hyper_parallel.components import CrossEntropyLoss

    vocab = 32
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 5, vocab, generator=g)
    labels = torch.randint(0, vocab, (2, 5), generator=g)
    labels[0, :2] = -100
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum") / 17.0
    ref.backward()
    width = vocab // WORLD
    local = full[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    logits = DTensor.from_local(local, mesh, [Shard(2)])
    loss_fn = CrossEntropyLoss.Config().build()
    try:
        loss_fn(logits, labels, num_tokens=17)
        raise AssertionError("vocab-sharded logits outside loss_parallel must raise")
    except RuntimeError as e:
        assert "parallel_context" in str(e)
    with CrossEntropyLoss.parallel_context(enabled=True):
        with CrossEntropyLoss.parallel_context(enabled=True):  # nesting is harmless
            loss = loss_fn(logits, labels, num_tokens=17)
        loss.backward()
    grad_ref = ref_logits.grad[..., rank * width : (rank + 1) * width]
    return {"lp_loss_diff": abs(loss.item() - ref.item()), "lp_grad_diff": (local.grad - grad_ref).abs().max().item()}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        results = _fsdp_checks(rank, mesh, os.path.join(out_dir, "dump"))
        results.update(_mesh2d_checks())
        results.update(_loss_parallel_checks(rank, mesh))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results() -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_muon_fsdp_matches_one_process(results: list[dict[str, float]]) -> None:
    for r in results:
        assert r["param_diff"] <= 1e-5, r
        assert r["loss_diff"] <= 1e-5, r


def test_muon_on_2d_mesh_matches_one_process(results: list[dict[str, float]]) -> None:
    for r in results:
        assert r["experts_ep_fsdp"] <= 1e-6 and r["matrix_both_dims"] <= 1e-6, r
        assert r["fsdp_tp_strided"] <= 1e-6, r


def test_ema_on_dtensors_matches_one_process(results: list[dict[str, float]]) -> None:
    for r in results:
        assert r["ema_diff"] <= 1e-6, r


def test_loss_parallel_matches_plain_cross_entropy(results: list[dict[str, float]]) -> None:
    for r in results:
        assert r["lp_loss_diff"] <= 1e-6 and r["lp_grad_diff"] <= 1e-7, r


def test_sharded_checkpoint_resumes_exactly(results: list[dict[str, float]]) -> None:
    for r in results:
        assert r["resume_param_diff"] == 0.0, r
        assert r["resume_then_train_diff"] == 0.0, r
        assert r["resume_ema_diff"] == 0.0, r
