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
   whole sequences and of the output back, ``(cp - 1) / cp`` of each), and the hybrid of
   ``--parallelism.context_parallel_ulysses_degree u`` (Ulysses all-to-alls over the ``u`` ranks of a node on the
   local tokens, then state passing across the ``cp / u`` groups with ``1/u`` of the heads: ``(cp/u - 1)`` x the
   summaries and tails of ``Hv/u`` heads), split into the bytes inside the Ulysses group and across groups.
3. ``--measure``: the formulas of 2 against the bytes the real hooks send (forward collectives counted by a
   dispatch mode on a gloo group of up to 4 processes, small fp32 DeltaNet): Ulysses at cp 2, state passing at
   cp 4, hybrid 2 x 2. Exits non-zero if any differs.

    .venv/bin/python benchmarks/cp_deltanet.py [--seq 8192] [--cp 4] [--iters 3] [--threads 2] [--measure]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from hyper_parallel.config import ParallelismConfig
from hyper_parallel.distributed.context_parallel import apply_context_parallel
from hyper_parallel.distributed.parallel_dims import ParallelDims
from hyper_parallel.models.common.attention import AttentionMeta, CPShard
from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule
from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet


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


def bytes_sent(
    seq: int, cp: int, ulysses: int = 1, *, Hk=16, Hv=32, Dk=128, Dv=128, K=4, act_bytes=2
) -> dict[str, float]:
    """Bytes one rank sends per DeltaNet layer and row, forward (see the module docstring): pure state passing,
    pure Ulysses, and the hybrid with ``ulysses`` ranks inside (``hybrid_inner`` + ``hybrid_outer``)."""
    t = seq // cp
    pieces = 2  # balanced order

    def state(group: int, heads_div: int) -> float:  # ring all-gathers of summaries and conv tails
        summary = pieces * Hv // heads_div * Dk * (Dk + Dv) * 4  # fp32 (M, S_zero) per piece
        tails = pieces * (K - 1) * (2 * Hk * Dk + Hv * Dv) // heads_div * act_bytes
        return (group - 1) * (summary + tails)

    def a2a(group: int) -> float:  # all-to-alls of the local tokens' q/k/v, g, beta and of the output
        qkv_in = t * (2 * Hk * Dk + Hv * Dv) * act_bytes
        gates = t * Hv * (4 + act_bytes)  # g fp32, beta in the model dtype
        out = t * Hv * Dv * act_bytes
        return (group - 1) / group * (qkv_in + gates + out)

    inner, outer = a2a(ulysses), state(cp // ulysses, ulysses)
    return {"state_passing": state(cp, 1), "ulysses": a2a(cp), "hybrid_inner": inner, "hybrid_outer": outer,
            "hybrid": inner + outer}  # fmt: skip


class _CountSent(TorchDispatchMode):
    """Bytes this rank sends in the collectives it runs: ``(g - 1) / g`` of an all-to-all's input, ``(g - 1)`` x
    an all-gather's input (ring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        name = str(func)
        if "all_to_all_single" in name and "_c10d_functional_autograd" not in name:
            g = dist.distributed_c10d._resolve_process_group(args[3]).size()
            self.sent += (g - 1) / g * args[0].numel() * args[0].element_size()
        elif "allgather" in name and "c10d." in name:
            out, inp = args[0], args[1]
            g = out.numel() // inp.numel()
            self.sent += (g - 1) * inp.numel() * inp.element_size()
        return func(*args, **(kwargs or {}))


_SMALL = dict(Hk=2, Hv=4, Dk=16, Dv=16, K=4)


def _measure_rank(rank: int, world: int, port: int, ulysses: int, seq: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    pd = ParallelDims.from_config(
        ParallelismConfig(context_parallel_degree=world, context_parallel_ulysses_degree=ulysses), world
    )
    pd.build_mesh("cpu")
    try:
        s = _SMALL
        torch.manual_seed(0)
        layer = GatedDeltaNet.Config(num_k_heads=s["Hk"], num_v_heads=s["Hv"], head_k_dim=s["Dk"], head_v_dim=s["Dv"])
        mixer = layer.build(dim=32)
        mixer.init_weights()
        model = torch.nn.ModuleDict({"mixer": mixer})  # the core's parent holds the head counts
        plan = apply_context_parallel(model, pd.mesh("cp"), hybrid=pd.cp_hybrid_meshes(), balanced=True)
        meta = AttentionMeta(cu_seqlens=torch.tensor([0, seq], dtype=torch.int32), cu_seqlens_host=[0, seq])
        x = torch.randn(1, seq // world, 32)
        with torch.no_grad(), _CountSent() as counter:
            model["mixer"](x, meta=meta)
        if rank == 0:
            out["form"], out["sent"] = next(iter(plan.values())), counter.sent
    finally:
        pd.close()
        dist.destroy_process_group()


def measure(seq: int = 512) -> bool:
    """Formula vs counted forward bytes on three small layouts; True when all agree."""
    ok = True
    print(f"measured vs formula, forward bytes per rank, DeltaNet Hk 2 Hv 4 Dk = Dv = 16, fp32, seq {seq}:")
    for world, ulysses, key in ((2, 1, "ulysses"), (4, 1, "state_passing"), (4, 2, "hybrid")):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        manager = mp.Manager()
        out = manager.dict()
        mp.spawn(_measure_rank, args=(world, port, ulysses, seq, out), nprocs=world, join=True)
        want = bytes_sent(seq, world, ulysses, act_bytes=4, **_SMALL)[key]
        good = abs(out["sent"] - want) < 1e-6 * want
        ok &= good
        print(f"  cp {world} u {ulysses} ({out['form']}): measured {out['sent']:,.0f} B, formula {want:,.0f} B "
              f"{'ok' if good else 'MISMATCH'}")  # fmt: skip
        manager.shutdown()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, nargs=4, default=(2, 4, 64, 64), metavar=("HK", "HV", "DK", "DV"),
                    help="DeltaNet dims of the timed cores (small by default: a CPU)")  # fmt: skip
    ap.add_argument("--measure", action="store_true", help="check the byte formulas against counted collectives")
    ap.add_argument("--bytes_only", action="store_true", help="skip the timing")
    args = ap.parse_args()
    if args.measure and not measure():
        sys.exit(1)
    print_bytes_table(args.seq, args.cp)
    if args.bytes_only:
        return
    torch.set_num_threads(args.threads)
    Hk, Hv, Dk, Dv = args.heads
    single, rank = time_cores(args.seq, args.cp, args.iters, Hk, Hv, Dk, Dv)
    print(f"DeltaNet core fwd+bwd, seq {args.seq}, Hk {Hk} Hv {Hv} Dk {Dk} Dv {Dv}, fp32, {args.threads} threads")
    print(f"  single rank, whole row:          {single * 1e3:8.1f} ms")
    print(f"  state passing, one of {args.cp} ranks:  {rank * 1e3:8.1f} ms  (ideal single / cp = "
          f"{single / args.cp * 1e3:.1f} ms; overhead x{rank / (single / args.cp):.2f})")  # fmt: skip


def print_bytes_table(seq_arg: int, cp_arg: int) -> None:
    print("bytes sent per rank, DeltaNet layer and row, forward (Qwen3.5-35B-A3B dims, bf16 activations), MiB:")
    print("  hybrid u: Ulysses over u ranks (inside a node) + state passing across cp/u groups")
    for seq in sorted({seq_arg, 32768, 131072}):
        for cp in sorted({cp_arg, 8, 16}):
            b = bytes_sent(seq, cp)
            line = (f"  seq {seq:>6} cp {cp:>2}: state passing {b['state_passing'] / 2**20:8.2f}, Ulysses "
                    f"{b['ulysses'] / 2**20:8.2f}")  # fmt: skip
            for u in (2, 4, 8):
                if u < cp and cp % u == 0:
                    h = bytes_sent(seq, cp, u)
                    line += f", hybrid u{u} {h['hybrid_inner'] / 2**20:.2f} + {h['hybrid_outer'] / 2**20:.2f}"
            print(line)


if __name__ == "__main__":
    main()
