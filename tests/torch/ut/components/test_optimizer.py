"""Optimizers: Muon/AdamW parameter split, Muon math against torch.optim.Muon, per-expert
orthogonalisation, AdamW groups against torch.optim.AdamW, training, state-dict round trip."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.components import (
    LRSchedulersContainer,
    MuonWithAuxAdamW,
    OptimizersContainer,
    get_hyper_optimizer,
    split_muon_params,
    zeropower_via_newtonschulz5,
)
from hyper_parallel.components.muon import orthogonalize
from hyper_parallel.models.common.embedding import Embedding
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.models.common.rmsnorm import RMSNorm
from hyper_parallel.protocols.module import Module

V, D, E, I_MOE, CODES = 32, 16, 4, 6, 8


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I_MOE, D) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, D, I_MOE) * 0.1)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("td,efd->etf", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("etf,edf->etd", F.silu(gate) * up, self.down_proj)
        return torch.einsum("etd,te->td", y, w)


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, D) * 0.1)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm.Config().build(dim=D)
        self.gate = Router()
        self.experts = Experts()
        self.shared_experts = FeedForward.Config(hidden_dim=10).build(dim=D)
        self.o_proj = Linear.Config(bias=True).build(in_features=D, out_features=D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        w = torch.softmax(F.linear(h, self.gate.weight), dim=-1)
        routed = self.experts(h.reshape(-1, D), w.reshape(-1, E)).reshape(h.shape)
        return x + self.o_proj(routed + self.shared_experts(h))


class TinyMoE(nn.Module):
    """Embedding, 2 MoE blocks (router, grouped experts, shared expert), norm, head, a frozen codebook."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = Embedding.Config().build(num_embeddings=V, embedding_dim=D)
        self.layers = nn.ModuleList([MoEBlock(), MoEBlock()])
        self.norm = RMSNorm.Config().build(dim=D)
        self.lm_head = Linear.Config().build(in_features=D, out_features=V)
        self.codebook = nn.Parameter(torch.randn(CODES, D), requires_grad=False)
        for m in self.modules():
            if isinstance(m, Module):
                m.init_own_weights()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _model(seed: int = 0) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE()


def test_split_puts_each_parameter_in_the_right_group() -> None:
    model = _model()
    muon, adamw = split_muon_params(model)
    expected_muon = {
        f"layers.{i}.{n}"
        for i in range(2)
        for n in (
            "experts.gate_up_proj",
            "experts.down_proj",
            "shared_experts.gate_proj.weight",
            "shared_experts.up_proj.weight",
            "shared_experts.down_proj.weight",
            "o_proj.weight",
        )
    }
    expected_adamw = {"embed_tokens.weight", "norm.weight", "lm_head.weight"} | {
        f"layers.{i}.{n}" for i in range(2) for n in ("input_layernorm.weight", "gate.weight", "o_proj.bias")
    }
    assert set(muon) == expected_muon
    assert set(adamw) == expected_adamw
    assert "codebook" not in muon and "codebook" not in adamw

    container = OptimizersContainer.Config(name="muon").build(model_parts=[model])
    grouped = [p for g in container.param_groups for p in g["params"]]
    assert len(grouped) == len({id(p) for p in grouped}) == len(expected_muon) + len(expected_adamw)
    assert all(p is not model.codebook for p in grouped)
    # gate_up_proj is orthogonalised as two matrices per expert, the other Muon params as one
    blocks = {id(p): g.get("row_blocks") for g in container.param_groups for p in g["params"]}
    assert blocks[id(model.layers[0].experts.gate_up_proj)] == 2
    assert blocks[id(model.layers[0].experts.down_proj)] == 1


def test_muon_2d_matches_torch_muon_bit_for_bit() -> None:
    """torch.optim.Muon (bf16 Newton-Schulz) is the oracle for one 2-D matrix."""
    torch.manual_seed(0)
    for shape in [(24, 10), (10, 24)]:
        ours = nn.Parameter(torch.randn(shape))
        ref = nn.Parameter(ours.detach().clone())
        opt_ref = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        opt = MuonWithAuxAdamW(
            [{"params": [ours], "use_muon": True, "lr": 0.02, "weight_decay": 0.1, "ns_dtype": "bfloat16"}]
        )
        for _ in range(3):
            g = torch.randn(shape)
            ours.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            opt_ref.step()
        assert torch.equal(ours, ref)
        assert torch.equal(opt.state[ours]["momentum_buffer"], opt_ref.state[ref]["momentum_buffer"])


def test_experts_are_orthogonalised_per_expert() -> None:
    torch.manual_seed(0)
    # float64 so that the batched (bmm) and the single-matrix (mm) paths agree to rounding
    u = torch.randn(E, 2 * I_MOE, D, dtype=torch.float64)
    out = orthogonalize(u, row_blocks=2, dtype=torch.float64)
    for e in range(E):
        for rows in (slice(0, I_MOE), slice(I_MOE, 2 * I_MOE)):
            alone = zeropower_via_newtonschulz5(u[e, rows], dtype=torch.float64)
            torch.testing.assert_close(out[e, rows], alone, rtol=0, atol=1e-12)
            # NS5 leaves singular values in roughly [0.5, 1.5]: each block is (near-)orthogonal
            s = torch.linalg.svdvals(out[e, rows])
            assert s.min() > 0.5 and s.max() < 1.5
    # without row blocks each expert is one [2I, D] matrix
    whole = orthogonalize(u, dtype=torch.float64)
    torch.testing.assert_close(whole[1], zeropower_via_newtonschulz5(u[1], dtype=torch.float64), rtol=0, atol=1e-12)
    assert not torch.allclose(whole, out, atol=1e-3)


def test_adamw_groups_match_torch_adamw_exactly() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(5))]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt = MuonWithAuxAdamW([{"params": params, "use_muon": False, **kw}])
    opt_ref = torch.optim.AdamW(ref, **kw)
    for _ in range(4):
        for p, r in zip(params, ref):
            g = torch.randn_like(p)
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        opt_ref.step()
    for p, r in zip(params, ref):
        assert torch.equal(p, r)
        assert opt.state[p].keys() == opt_ref.state[r].keys()


def _train(name: str, steps: int = 40, *, muon_only: bool = False) -> list[float]:
    model = _model()
    if muon_only:  # freeze everything AdamW would train: the loss can only fall through Muon updates
        for p in split_muon_params(model)[1].values():
            p.requires_grad_(False)
        with torch.no_grad():  # a frozen head of std 0.02 would cap the logits; give it room
            model.lm_head.weight.normal_(std=0.3)
            model.embed_tokens.weight.normal_(std=1.0)
    lr = 5e-2 if muon_only else 1e-2
    opt = OptimizersContainer.Config(name=name, lr=lr, weight_decay=0.0).build(model_parts=[model])
    if muon_only:
        assert all(g["use_muon"] for g in opt.param_groups)
    torch.manual_seed(1)
    ids = torch.randint(0, V, (4, 12))
    labels = torch.randint(0, V, (4, 12))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).reshape(-1, V), labels.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("name", "muon_only"), [("adamw", False), ("muon", False), ("muon", True)])
def test_optimizer_trains(name: str, muon_only: bool) -> None:
    losses = _train(name, muon_only=muon_only)
    assert losses[-1] < 0.6 * losses[0], losses


def _step(model: nn.Module, opt: OptimizersContainer, seed: int) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, V, (2, 8))
    opt.zero_grad()
    model(ids).float().pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_state_dict_round_trip_is_exact(name: str) -> None:
    model = _model()
    cfg = OptimizersContainer.Config(name=name, lr=1e-2)
    opt = cfg.build(model_parts=[model])
    for s in range(3):
        _step(model, opt, s)
    saved = copy.deepcopy(opt.state_dict())
    assert any(k.startswith("state.layers.0.experts.gate_up_proj.") for k in saved)

    clone = copy.deepcopy(model)
    opt2 = cfg.build(model_parts=[clone])
    opt2.load_state_dict(copy.deepcopy(saved))
    reloaded = opt2.state_dict()
    assert reloaded.keys() == saved.keys()
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, reloaded[k]), k
        else:
            assert v == reloaded[k], k
    for s in range(3, 5):
        _step(model, opt, s)
        _step(clone, opt2, s)
    for (n, a), b in zip(model.named_parameters(), clone.parameters()):
        assert torch.equal(a, b), n


def test_lr_scheduler_drives_muon_and_adamw_groups() -> None:
    model = _model()
    opt = OptimizersContainer.Config(name="muon", lr=1e-2, muon_lr=2e-2).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=2, decay_type="constant").build(optimizers=opt, total_steps=5)
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs == {True: pytest.approx(1e-2), False: pytest.approx(5e-3)}  # factor 1/2 at step 0
    opt.step()
    sched.step()
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs == {True: pytest.approx(2e-2), False: pytest.approx(1e-2)}


def test_get_hyper_optimizer_errors_name_the_problem() -> None:
    model = _model()
    muon, adamw = split_muon_params(model)
    with pytest.raises(ValueError, match="both the Muon and the AdamW"):
        get_hyper_optimizer(model, muon, {**adamw, **muon})
    with pytest.raises(ValueError, match="not in the model"):
        get_hyper_optimizer(model, [nn.Parameter(torch.zeros(3, 3))], adamw)
    with pytest.raises(ValueError, match="1-D parameter"):
        get_hyper_optimizer(model, {**muon, "norm.weight": model.norm.weight}, {})
    opt = get_hyper_optimizer(model, muon, adamw, {"lr": 0.05}, {"lr": 1e-3})
    assert {g["use_muon"]: g["lr"] for g in opt.param_groups} == {True: 0.05, False: 1e-3}
