"""Forward+backward time of our Qwen3.5 blocks vs HF's torch fallback, side by side in one run.

1. The DeltaNet sequence core, i.e. what HF's torch fallback replaces the CUDA kernels with: ours
   ``GatedDeltaRule`` (causal conv + SiLU + chunked gated delta rule, packing-exact) vs HF's fallbacks
   ``causal_conv1d_fn`` + ``torch_chunk_gated_delta_rule``, fwd + bwd, same pre-conv q/k/v, g, beta, conv weight.
2. One Gated DeltaNet layer (ours ``GatedDeltaNet`` vs HF ``Qwen3_5MoeGatedDeltaNet`` with those fallbacks),
   fwd + bwd: the core plus the five projection GEMMs (identical ``nn.Linear`` calls in both), gates and norm.
3. One whole training step (fwd + bwd of a token-mean cross entropy) of a small ``qwen3_5_moe`` model vs
   HF ``Qwen3_5MoeForCausalLM``.

Same weights (ours loads HF's ``save_pretrained`` output or state dict), same batch, fp32, 2 threads.
Prints medians (HF and ours timed alternately, so both see the same machine load) and ratios
(HF time / our time: > 1 means we are faster).

    .venv/bin/python benchmarks/qwen3_5_step.py [--seq 2048] [--iters 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F


def time_interleaved(fns: list, iters: int) -> list[list[float]]:
    """Seconds of every call of each function, all run in turn in every iteration (after one warm-up call each), so
    they see the same machine load, threads and warm caches: ``out[j][i]`` is function ``j`` in iteration ``i``."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, out in zip(fns, times):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return times


def time_pair(fn_hf, fn_ours, iters: int) -> tuple[float, float]:
    """Median seconds of each, measured alternately (HF, ours, HF, ...) so both see the same machine load."""
    t_hf, t_ours = time_interleaved([fn_hf, fn_ours], iters)
    return statistics.median(t_hf), statistics.median(t_ours)


def rest_after(layer_s: list[float], part_s: list[float]) -> float | None:
    """Median over iterations of ``layer - part`` timed in the same iteration (so the difference compares like with
    like); None when it is not above timing noise (a difference of two noisy timings is no time of its own)."""
    rest = statistics.median(a - b for a, b in zip(layer_s, part_s))
    return rest if rest > 0 else None


def bench_core(args) -> tuple[float, float]:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_mod

    from hyper_parallel.models.common.gated_delta_rule import GatedDeltaRule
    from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet

    Hk, Hv, D, T = args.k_heads, args.v_heads, args.head_dim, args.seq
    cfg = GatedDeltaNet.Config(num_k_heads=Hk, num_v_heads=Hv, head_k_dim=D, head_v_dim=D)
    rule = GatedDeltaRule.Config().build(head_k_dim=D, head_v_dim=D)
    C = 2 * Hk * D + Hv * D
    gen = torch.Generator().manual_seed(0)
    qkv_hf = torch.randn(1, T, C, generator=gen)
    w_hf = torch.randn(C, 4, generator=gen) * 0.3
    g = -F.softplus(torch.randn(1, T, Hv, generator=gen))  # log decay <= 0, as the layer makes it
    beta = torch.rand(1, T, Hv, generator=gen)
    qkv_ours = GatedDeltaNet.qkv_rows_from_hf(cfg, qkv_hf[0].t()).t().reshape(1, T, Hk, -1)
    w_ours = GatedDeltaNet.qkv_rows_from_hf(cfg, w_hf)
    grad = torch.randn(1, T, Hv, D, generator=gen) / T

    def hf_core(qkv, w, g, beta):
        mixed = hf_mod.causal_conv1d_fn(qkv.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
        q, k, v = mixed.split([Hk * D, Hk * D, Hv * D], dim=-1)
        return hf_mod.torch_chunk_gated_delta_rule(
            q.reshape(1, T, Hk, D), k.reshape(1, T, Hk, D), v.reshape(1, T, Hv, D), g=g, beta=beta,
            initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
        )[0]  # fmt: skip

    def ours_core(qkv, w, g, beta):
        return rule(qkv, g, beta, conv_weight=w)

    def step(fn, qkv, w):
        def run():
            inputs = [t.clone().requires_grad_() for t in (qkv, w, g, beta)]
            fn(*inputs).backward(grad)

        return run

    with torch.no_grad():
        diff = (hf_core(qkv_hf, w_hf, g, beta) - ours_core(qkv_ours, w_ours, g, beta)).abs().max().item()
    t_hf, t_ours = time_pair(step(hf_core, qkv_hf, w_hf), step(ours_core, qkv_ours, w_ours), args.iters)
    print(
        f"DeltaNet core fwd+bwd (conv + SiLU + gated delta rule) Hk={Hk} Hv={Hv} D={D} T={T}: "
        f"HF torch fallback {t_hf * 1e3:8.1f} ms   ours {t_ours * 1e3:8.1f} ms   ratio {t_hf / t_ours:5.2f}x   "
        f"(max |out diff| {diff:.1e})"
    )
    return t_hf, t_ours


def bench_deltanet(args) -> tuple[float, float]:
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    from hyper_parallel.models.common.gated_deltanet import GatedDeltaNet

    H, Hk, Hv, D = args.hidden, args.k_heads, args.v_heads, args.head_dim
    cfg = Qwen3_5MoeTextConfig(
        hidden_size=H, num_hidden_layers=1, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
        linear_key_head_dim=D, linear_value_head_dim=D, layer_types=["linear_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3_5MoeGatedDeltaNet(cfg, 0)
    ours = GatedDeltaNet.Config(num_k_heads=Hk, num_v_heads=Hv, head_k_dim=D, head_v_dim=D).build(dim=H)
    state = hf.state_dict()
    for key in ("in_proj_qkv.weight", "conv1d.weight"):  # HF's [Q | K | V] rows -> our grouped order
        state[key] = GatedDeltaNet.qkv_rows_from_hf(ours.config, state[key])
    ours.load_state_dict(state)
    x = torch.randn(1, args.seq, H)
    grad = torch.randn(1, args.seq, H) / args.seq

    def step(module):
        def run():
            xi = x.clone().requires_grad_()
            module(xi).backward(grad)
            module.zero_grad(set_to_none=True)

        return run

    def projections_only():  # the five GEMMs both implementations share (same shapes, same BLAS)
        xi = x.clone().requires_grad_()
        outs = [m(xi) for m in (hf.in_proj_qkv, hf.in_proj_z, hf.in_proj_b, hf.in_proj_a)]
        o = hf.out_proj(outs[1])
        (sum(t.sum() for t in outs) + (o * grad).sum()).backward()
        hf.zero_grad(set_to_none=True)

    with torch.no_grad():
        diff = (hf(x) - ours(x)).abs().max().item()
    # The projections are timed in the same iterations as the layers (the rest is a per-iteration difference):
    # timed in a separate loop they once took longer than our whole layer under a changed machine load, and the
    # rest printed -410 ms.
    hf_s, ours_s, proj_s = time_interleaved([step(hf), step(ours), projections_only], args.iters)
    t_hf, t_ours, t_proj = (statistics.median(t) for t in (hf_s, ours_s, proj_s))
    rest_hf, rest_ours = rest_after(hf_s, proj_s), rest_after(ours_s, proj_s)

    def ms(t: float | None) -> str:
        return "below timing noise" if t is None else f"{t * 1e3:.1f} ms"

    ratio = f"{rest_hf / rest_ours:5.2f}x" if rest_hf is not None and rest_ours is not None else "n/a"
    print(
        f"DeltaNet layer fwd+bwd  H={H} Hk={Hk} Hv={Hv} D={D} T={args.seq}: HF {t_hf * 1e3:8.1f} ms   "
        f"ours {t_ours * 1e3:8.1f} ms   ratio {t_hf / t_ours:5.2f}x   (max |out diff| {diff:.1e})\n"
        f"  of which the shared projection GEMMs {t_proj * 1e3:.1f} ms; the rest (conv, recurrence, gates, norm): "
        f"HF {ms(rest_hf)}, ours {ms(rest_ours)}, ratio {ratio}"
    )
    return t_hf, t_ours


def bench_model_step(args) -> tuple[float, float]:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from hyper_parallel.models.qwen3_5_moe_v2 import from_pretrained

    vocab = 4096
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, tie_word_embeddings=False, use_cache=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[4, 2, 2]),
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = from_pretrained(d)
    ids = torch.randint(0, vocab, (1, args.seq))

    def loss(logits):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    def hf_step():
        loss(hf(input_ids=ids, use_cache=False).logits).backward()
        hf.zero_grad(set_to_none=True)

    def logits_of(out):  # ours returns ModelOutput(logits, aux_loss) when the MoE has an aux loss
        return getattr(out, "logits", out)

    def our_step():
        loss(logits_of(ours(ids))).backward()
        ours.zero_grad(set_to_none=True)

    with torch.no_grad():
        diff = (hf(input_ids=ids, use_cache=False).logits - logits_of(ours(ids))).abs().max().item()
    t_hf, t_ours = time_pair(hf_step, our_step, args.iters)
    n = args.seq
    print(
        f"qwen3_5_moe step fwd+bwd (4 layers, H=256, 16 experts top-4) T={n}: HF {t_hf * 1e3:8.1f} ms "
        f"({n / t_hf:7.0f} tok/s)   ours {t_ours * 1e3:8.1f} ms ({n / t_ours:7.0f} tok/s)   ratio {t_hf / t_ours:5.2f}x   "
        f"(max |logit diff| {diff:.1e})"
    )
    return t_hf, t_ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024, help="DeltaNet benchmark hidden size")
    parser.add_argument("--k-heads", type=int, default=8)
    parser.add_argument("--v-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    print(f"fp32, {args.threads} threads, median of {args.iters}")
    bench_core(args)
    bench_deltanet(args)
    bench_model_step(args)


if __name__ == "__main__":
    main()
