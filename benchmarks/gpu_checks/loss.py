"""GPU check C.loss (benchmarks/gpu_check.sh): the chunked cross-entropy vs F.cross_entropy on fp32 logits, and its peak memory."""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_report import record  # noqa: E402

import torch.nn.functional as F
from hyper_parallel.components import CrossEntropyLoss
dev = torch.device(os.environ["DEV"])
cuda = dev.type == "cuda"
N, V = (8192, 171_000) if cuda else (2048, 32_000)
dtype = torch.bfloat16
gen = torch.Generator(device=dev).manual_seed(0)
logits = torch.randn(N, V, device=dev, dtype=dtype, generator=gen)
labels = torch.randint(0, V, (N,), device=dev, generator=gen)
labels[::7] = -100

def run(fn):
    x = logits.clone().requires_grad_()
    if cuda: torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    loss = fn(x)
    loss.backward()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    return loss.item(), x.grad, peak

chunked, g_chunked, peak_chunked = run(lambda x: CrossEntropyLoss.Config().build()(x, labels))
plain, g_plain, peak_plain = run(lambda x: F.cross_entropy(x.float(), labels, ignore_index=-100))
d_loss = abs(chunked - plain)
d_grad = (g_chunked.float() - g_plain.float()).abs().max().item()
ok = d_loss <= 1e-5 and d_grad <= 1e-2 * g_plain.float().abs().max().item() and (peak_chunked < peak_plain / 2 if cuda else True)
line = (f"{'PASS' if ok else 'FAIL'} chunked loss: {N} tokens x vocab {V} {dtype}: |dloss| {d_loss:.1e}, max |dgrad| {d_grad:.1e}, "
      f"peak extra memory {peak_chunked:.2f} GiB chunked vs {peak_plain:.2f} GiB F.cross_entropy(logits.float())")
print(line)
record('C.loss', 'PASS' if ok else 'FAIL', line.split(' ', 1)[1], d_loss=d_loss, d_grad=d_grad, peak_chunked_gib=peak_chunked, peak_plain_gib=peak_plain)
raise SystemExit(0 if ok else 1)
