"""Gated DeltaNet context parallel by state passing: compute cost per rank and bytes sent, vs the alternatives.

1. Time (fwd + bwd, fp32, this machine): the single-rank core (``GatedDeltaRule``) on a whole row of ``--seq``
   tokens, and ONE context-parallel rank's share of the state-passing core (``gated_delta_rule_cp`` on
   ``seq / cp`` tokens, balanced order, the rank that holds the middle pieces: every piece carries state in
   and out, the most work). The gather is local (each rank's tensor stands for every rank's: same shapes,
   so the same work); the ideal is ``single / cp``. Timed alternately, medians.
2. Bytes one rank sends per DeltaNet layer and micro-batch row (forward; the backward sends the same again),
   for the Qwen3.5-35B-A3B DeltaNet (Hk 16, Hv 32, Dk = Dv = 128, conv 4, bf16 activations) at ``--seq`` and
   the CP degree: state passing (all-gathers of the fp32 piece summaries ``(M, S_zero)`` and of the conv
   window's last K-1 input rows, ring bytes ``(cp - 1) x local``) vs Ulysses (all-to-alls of q/k/v, g, beta to
   whole sequences and of the output back, ``(cp - 1) / cp`` of each).

    .venv/bin/python benchmarks/cp_deltanet.py [--seq 8192] [--cp 4] [--iters 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hyper_parallel.models.common.attention import AttentionMeta, CPShard
from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule


def _local_gather(size: int):
    def gather(x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0).expand(size, *x.shape)

    return gather


def time_cores(seq: int, cp: int, iters: int, Hk: int, Hv: int, Dk: int, Dv: int) -> tuple[float, float]:
    torch.manual_seed(0)
    G = 2 * Dk + Hv // Hk * Dv
    core = GatedDeltaRule.Config(backend="torch").build(head_k_dim=Dk, head_v_dim=Dv)
    w = (torch.randn(Hk * G, 4) * 0.5).requires_grad_()
    meta = AttentionMeta(cu_seqlens=torch.tensor([0, seq], dtype=torch.int32), cu_seqlens_host=[0, seq])

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        qkv = torch.randn(1, n, Hk, G, requires_grad=True)
        g = (-torch.rand(1, n, Hv) * 0.05).requires_grad_()
        beta = torch.rand(1, n, Hv, requires_grad=True)
        return qkv, g, beta

    full, local = inputs(seq), inputs(seq // cp)
    shard = CPShard(rank=cp // 2, size=cp, balanced=True, all_gather=_local_gather(cp))

    def single() -> None:
        core(*full, conv_weight=w, meta=meta).sum().backward()

    def one_rank() -> None:
        core(*local, conv_weight=w, meta=meta, cp=shard).sum().backward()

    single(), one_rank()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(iters):
        for fn, out in ((single, times[0]), (one_rank, times[1])):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def bytes_sent(seq: int, cp: int, *, Hk=16, Hv=32, Dk=128, Dv=128, K=4, act_bytes=2) -> dict[str, float]:
    """Bytes one rank sends per DeltaNet layer and row, forward (see the module docstring)."""
    t = seq // cp
    pieces = 2  # balanced order
    summary = pieces * Hv * Dk * (Dk + Dv) * 4  # fp32 (M, S_zero) per piece
    tails = pieces * (K - 1) * (2 * Hk * Dk + Hv * Dv) * act_bytes
    state = (cp - 1) * (summary + tails)  # ring all-gather
    qkv_in = t * (2 * Hk * Dk + Hv * Dv) * act_bytes
    gates = t * Hv * (4 + act_bytes)  # g fp32, beta in the model dtype
    out = t * Hv * Dv * act_bytes
    ulysses = (cp - 1) / cp * (qkv_in + gates + out)
    return {"state_passing": state, "ulysses": ulysses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, nargs=4, default=(2, 4, 64, 64), metavar=("HK", "HV", "DK", "DV"),
                    help="DeltaNet dims of the timed cores (small by default: a CPU)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    Hk, Hv, Dk, Dv = args.heads
    single, rank = time_cores(args.seq, args.cp, args.iters, Hk, Hv, Dk, Dv)
    print(f"DeltaNet core fwd+bwd, seq {args.seq}, Hk {Hk} Hv {Hv} Dk {Dk} Dv {Dv}, fp32, {args.threads} threads")
    print(f"  single rank, whole row:          {single * 1e3:8.1f} ms")
    print(f"  state passing, one of {args.cp} ranks:  {rank * 1e3:8.1f} ms  (ideal single / cp = "
          f"{single / args.cp * 1e3:.1f} ms; overhead x{rank / (single / args.cp):.2f})")  # fmt: skip
    print("bytes sent per rank, DeltaNet layer and row, forward (Qwen3.5-35B-A3B dims, bf16 activations):")
    for seq in sorted({args.seq, 32768, 131072}):
        for cp in sorted({args.cp, 8, 16}):
            b = bytes_sent(seq, cp)
            print(f"  seq {seq:>6} cp {cp:>2}: state passing {b['state_passing'] / 2**20:8.2f} MiB, Ulysses "
                  f"{b['ulysses'] / 2**20:8.2f} MiB (x{b['ulysses'] / b['state_passing']:.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
