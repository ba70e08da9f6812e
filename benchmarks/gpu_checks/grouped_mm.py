"""GPU check B.grouped_mm (benchmarks/gpu_check.sh): bf16 experts through the grouped_mm kernel vs the per-expert loop."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_report import record  # noqa: E402

import warnings
from hyper_parallel.models.common import grouped_mm as G
dev = torch.device(os.environ["DEV"])
cuda = dev.type == "cuda"
E, S, I, O = (64, 16384, 2048, 1536) if cuda else (16, 4096, 256, 128)
gen = torch.Generator(device=dev).manual_seed(0)
counts = torch.distributions.Multinomial(S, torch.ones(E)).sample().to(dev, torch.int64)
x = torch.randn(S, I, device=dev, dtype=torch.bfloat16, generator=gen)
w = torch.randn(E, O, I, device=dev, dtype=torch.bfloat16, generator=gen) / I**0.5
gy = torch.randn(S, O, device=dev, dtype=torch.bfloat16, generator=gen)

def fwd_bwd(impl, xx, ww):
    xx, ww = xx.clone().requires_grad_(), ww.clone().requires_grad_()
    y = G.grouped_linear(xx, ww, counts, impl)
    y.backward(gy.to(y.dtype))
    return y.detach(), xx.grad, ww.grad

def timed(impl, n=5):
    fwd_bwd(impl, x, w)
    if cuda: torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fwd_bwd(impl, x, w)
    if cuda: torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

blocker = G.grouped_mm_blocker(x, w)
err = ms_grouped = float("nan")
if blocker is None:
    pairs = zip(fwd_bwd("grouped_mm", x, w), fwd_bwd("loop", x, w))
    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in pairs)
    ms_grouped = timed("grouped_mm")
ms_loop = timed("loop")
# fp32 on CUDA has no grouped kernel: auto must say so (once); on CPU float64 stands in
G._warned.clear()
wide = torch.float32 if cuda else torch.float64
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        G.grouped_linear(x[:64].to(wide), w.to(wide), torch.tensor([64] + [0] * (E - 1), device=dev))
warned = [str(c.message) for c in caught if "per-expert loop" in str(c.message)]
ok = blocker is None and err <= 1e-2 and len(warned) == 1
line = (f"{'PASS' if ok else 'FAIL'} grouped_mm: bf16 E={E} S={S} {I}->{O} kernel usable={blocker is None} ({blocker}), "
      f"rel err vs loop {err:.2e} (tol 1e-2), fwd+bwd {ms_grouped:.1f} ms grouped vs {ms_loop:.1f} ms loop; "
      f"{str(wide).removeprefix('torch.')} auto fallback warned {len(warned)}x (want 1)")
print(line)
record('B.grouped_mm', 'PASS' if ok else 'FAIL', line.split(' ', 1)[1], usable=blocker is None, err=err, ms_grouped=ms_grouped, ms_loop=ms_loop, fallback_warnings=len(warned))
raise SystemExit(0 if ok else 1)
