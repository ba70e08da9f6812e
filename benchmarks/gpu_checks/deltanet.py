"""GPU check G (benchmarks/gpu_check.sh): Gated DeltaNet on fla's Triton kernels vs our torch path.

Packed documents at 8k and 32k tokens with Qwen3.5-35B-A3B's DeltaNet heads (16 key / 32 value heads of 128,
conv 4): the bf16 kernel path (fla's ``chunk_gated_delta_rule`` and its Triton causal conv, or causal-conv1d
when installed) against our torch path in fp32 on the same inputs, forward and backward, and the fwd+bwd time of
both. SKIP without fla or a GPU; on CPU (``--cpu``) a tiny torch-path run keeps the script honest.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_report import record  # noqa: E402

from hyper_parallel.models.common import gated_delta_rule as gdr  # noqa: E402
from hyper_parallel.models.common.attention import AttentionMeta  # noqa: E402

dev = torch.device(os.environ["DEV"])
cuda = dev.type == "cuda"
fla = gdr.fla_chunk_gated_delta_rule is not None
if cuda and not fla:
    record("G.deltanet", "SKIP", "fla not installed (bash benchmarks/gpu_wheels.sh .whl, then carry .whl)")
    raise SystemExit(0)
Hk, Hv, D, K = (16, 32, 128, 4) if cuda else (2, 4, 16, 4)
base = [3000, 2000, 1500, 1200, 492] if cuda else [300, 200, 150, 120, 42]
sizes = {"8k": base, "32k": base * 4} if cuda else {"tiny": base}
G = 2 * D + Hv // Hk * D


def run(backend, dtype, lengths, inputs):
    qkv, logdecay, beta, w, grad = inputs
    rule = gdr.GatedDeltaRule.Config(backend=backend).build(head_k_dim=D, head_v_dim=D)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    meta = AttentionMeta(cu_seqlens=cu.to(dev), cu_seqlens_host=cu.tolist(), max_seqlen=max(lengths))
    xs = [qkv.to(dtype, copy=True).requires_grad_(), logdecay.clone().requires_grad_(),
          beta.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()]  # fmt: skip
    out = rule(xs[0], xs[1], xs[2], conv_weight=xs[3], meta=meta)
    out.backward(grad.to(out.dtype))
    return out.float(), [x.grad.float() for x in xs], rule.kernel(xs[0])


def timed(backend, dtype, lengths, inputs, n=3):
    run(backend, dtype, lengths, inputs)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        run(backend, dtype, lengths, inputs)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
results, ok = {}, True
for label, lengths in sizes.items():
    T = sum(lengths)
    g = torch.Generator(device=dev).manual_seed(0)
    inputs = (
        torch.randn(1, T, Hk, G, device=dev, generator=g), -torch.rand(1, T, Hv, device=dev, generator=g),
        torch.rand(1, T, Hv, device=dev, generator=g), torch.randn(Hk * G, K, device=dev, generator=g) * 0.3,
        torch.randn(1, T, Hv, D, device=dev, generator=g) / T,
    )  # fmt: skip
    fast = ("auto", torch.bfloat16) if cuda else ("torch", torch.float32)
    out, grads, kernel = run(*fast, lengths, inputs)
    ref, ref_grads, _ = run("torch", torch.float32, lengths, inputs)
    err_out, err_grad = rel(out, ref), max(rel(a, b) for a, b in zip(grads, ref_grads))
    ms_fast, ms_torch = timed(*fast, lengths, inputs), timed("torch", torch.float32, lengths, inputs)
    good = (kernel == "cuda_kernels" if cuda else True) and err_out <= 3e-2 and err_grad <= 6e-2
    ok &= good
    results[label] = {"tokens": T, "kernel": kernel, "err_out": err_out, "err_grad": err_grad,
                      "ms_kernel_bf16": ms_fast if cuda else None, "ms_torch_fp32": ms_torch}  # fmt: skip
summary = "; ".join(
    f"{k} ({r['tokens']} tok, {r['kernel']}): rel err out {r['err_out']:.1e} grads {r['err_grad']:.1e}, fwd+bwd "
    + (f"{r['ms_kernel_bf16']:.1f} ms kernels bf16 vs " if cuda else "")
    + f"{r['ms_torch_fp32']:.1f} ms torch fp32"
    for k, r in results.items()
)
print(f"{'PASS' if ok else 'FAIL'} deltanet: Hk={Hk} Hv={Hv} D={D}: {summary}")
record("G.deltanet", "PASS" if ok else "FAIL", f"Hk={Hk} Hv={Hv} D={D}: {summary}", **results)
raise SystemExit(0 if ok else 1)
