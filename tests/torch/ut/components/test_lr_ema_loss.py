"""LR schedule values and state, EMA math and state, cross-entropy normalisation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel.components import EMA, CrossEntropyLoss, LRSchedulersContainer, OptimizersContainer


def _lrs(cfg: LRSchedulersContainer.Config, total: int, peak: float = 1.0) -> list[float]:
    model = nn.Linear(2, 2)
    opt = OptimizersContainer.Config(lr=peak).build(model_parts=[model])
    sched = cfg.build(optimizers=opt, total_steps=total)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])  # the LR this optimizer step runs with
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_values() -> None:
    lrs = _lrs(LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine", min_lr_ratio=0.1), total=6)
    # warmup 1/2, 1; then 4 decay steps with progress 1/4 .. 4/4
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert lrs[-1] == pytest.approx(0.1)


def test_linear_constant_and_explicit_decay_steps() -> None:
    lin = _lrs(LRSchedulersContainer.Config(warmup_steps=0, decay_type="linear", min_lr_ratio=0.0), total=4, peak=2.0)
    assert lin == pytest.approx([1.5, 1.0, 0.5, 0.0])
    const = _lrs(LRSchedulersContainer.Config(warmup_steps=1, decay_type="constant"), total=3)
    assert const == pytest.approx([1.0, 1.0, 1.0])
    held = _lrs(
        LRSchedulersContainer.Config(warmup_steps=0, decay_type="linear", min_lr_ratio=0.5, decay_steps=2), total=4
    )
    assert held == pytest.approx([0.75, 0.5, 0.5, 0.5])  # stays at the minimum after decay_steps


def test_scheduler_state_round_trip() -> None:
    cfg = LRSchedulersContainer.Config(warmup_steps=3, decay_type="cosine", min_lr_ratio=0.0)
    model = nn.Linear(2, 2)
    opt = OptimizersContainer.Config(lr=1.0).build(model_parts=[model])
    sched = cfg.build(optimizers=opt, total_steps=10)
    for _ in range(5):
        opt.step()
        sched.step()
    state = copy.deepcopy(sched.state_dict())
    opt2 = OptimizersContainer.Config(lr=1.0).build(model_parts=[nn.Linear(2, 2)])
    sched2 = cfg.build(optimizers=opt2, total_steps=10)
    sched2.load_state_dict(state)
    for _ in range(3):
        assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"], abs=1e-15)
        for o, s in ((opt, sched), (opt2, sched2)):
            o.step()
            s.step()


def test_scheduler_clamps_warmup_to_a_short_run(caplog) -> None:
    """A 3-step smoke run of a recipe with warmup 10 warms up over the 3 steps, with a one-line warning."""
    with caplog.at_level("WARNING"):
        lrs = _lrs(LRSchedulersContainer.Config(warmup_steps=10), total=3)
    assert lrs == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert "warming up over all 3 steps" in caplog.text
    with pytest.raises(ValueError, match="decay_steps=0"):
        _lrs(LRSchedulersContainer.Config(warmup_steps=1, decay_steps=0), total=3)


def test_ema_math_update_every_and_state() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)  # frozen: not tracked
    ema = EMA.Config(decay=0.9, update_every=2).build(model=model)
    assert set(ema.shadow) == {"weight"}
    expected = model.weight.detach().clone()
    for call in range(1, 6):
        with torch.no_grad():
            model.weight.add_(torch.randn_like(model.weight))
        updated = ema.update(model)
        assert updated == (call % 2 == 0)
        if updated:
            expected = 0.9 * expected + 0.1 * model.weight.detach()
    torch.testing.assert_close(ema.shadow["weight"], expected, rtol=0, atol=1e-6)

    state = copy.deepcopy(ema.state_dict())
    other = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="missing \\['bias'\\]"):  # built for other parameters
        EMA.Config(decay=0.9).build(model=other).load_state_dict(copy.deepcopy(state))
    other.bias.requires_grad_(False)
    ema2 = EMA.Config(decay=0.9, update_every=2).build(model=other)
    ema2.load_state_dict(state)
    assert ema2.num_updates == 2 and ema2.num_calls == 5
    assert torch.equal(ema2.shadow["weight"], ema.shadow["weight"])

    training = model.weight.detach().clone()
    with ema.swap(model):
        assert torch.equal(model.weight, ema.shadow["weight"])
    assert torch.equal(model.weight, training)
    ema.copy_to(model)
    assert torch.equal(model.weight, ema.shadow["weight"])


def test_ema_off() -> None:
    model = nn.Linear(3, 2)
    ema = EMA.Config().build(model=model)
    assert not ema.enabled and ema.shadow == {} and ema.state_dict() == {}
    assert ema.update(model) is False
    with ema.swap(model) as m:
        assert m is model


def test_cross_entropy_global_token_mean_over_micro_batches() -> None:
    torch.manual_seed(0)
    vocab = 11
    logits = torch.randn(4, 9, vocab, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (4, 9))
    labels[0, :5] = -100
    labels[2, 3:] = -100
    loss_fn = CrossEntropyLoss.Config().build()
    big = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)
    assert loss_fn(logits, labels).dtype == torch.float32
    torch.testing.assert_close(loss_fn(logits, labels), big, rtol=0, atol=1e-6)
    n = int((labels != -100).sum())
    # uneven micro-batches: rows [0], [1, 2], [3]
    accumulated = sum(loss_fn(logits[s], labels[s], num_tokens=n) for s in (slice(0, 1), slice(1, 3), slice(3, 4)))
    assert abs(accumulated.item() - big.item()) <= 1e-6
    assert loss_fn(logits, torch.full_like(labels, -100), num_tokens=0).item() == 0.0
    with pytest.raises(ValueError, match="disagree"):
        loss_fn(logits, labels[:, :-1])


def _ce_case(dtype: torch.dtype, vocab: int = 37):
    torch.manual_seed(1)
    logits = (torch.randn(4, 9, vocab) * 3).to(dtype)
    labels = torch.randint(0, vocab, (4, 9))
    labels[0, :5] = -100
    labels[2, 3:] = -100
    return logits, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 5, 36, 1024])
def test_chunked_cross_entropy_equals_fp32_cross_entropy(dtype: torch.dtype, chunk: int) -> None:
    """Loss and gradient of the chunked fp32 CE vs ``F.cross_entropy(logits.float())`` (the unchunked path)."""
    logits, labels = _ce_case(dtype)
    ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = CrossEntropyLoss.Config(chunk_tokens=chunk).build()(ours, labels, num_tokens=17)
    expect = F.cross_entropy(ref.float().reshape(-1, 37), labels.reshape(-1), reduction="sum") / 17
    loss.backward()
    expect.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - expect.item()) <= 1e-6
    assert ours.grad.dtype == dtype and (ours.grad.float() - ref.grad.float()).abs().max().item() <= 1e-6
    assert torch.equal(ours.detach(), logits)  # the saved logits are not modified (fp32 .float() is a no-op)
    assert CrossEntropyLoss.Config(chunk_tokens=0).build()(logits, labels, num_tokens=17).item() == expect.item()


def test_chunked_cross_entropy_never_holds_fp32_logits() -> None:
    """No fp32 tensor as large as all the logits exists in forward or backward (bf16 logits, 36 x 37)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestFp32(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.numel = max(self.numel, t.numel())
            return out

    logits, labels = _ce_case(torch.bfloat16)
    logits.requires_grad_()
    with LargestFp32() as seen:
        CrossEntropyLoss.Config(chunk_tokens=8).build()(logits, labels).backward()
    assert 0 < seen.numel <= 8 * 37 < logits.numel()
