"""Forward+backward time of one VL training step: ours vs HF, side by side in one run.

A small ``Qwen3VLMoeForConditionalGeneration`` (tower with deepstack + MoE text decoder) and, with
``--family qwen3_5_moe``, a small ``Qwen3_5MoeForConditionalGeneration``. Same weights (ours loads HF's
``save_pretrained`` output), same batch (a row of text with ``--images`` images of 16 x 16 patches), fp32.
Prints medians (HF and ours timed alternately, so both see the same machine load) and the ratio
(HF time / our time: > 1 means we are faster). The image preprocessing throughput is ``benchmarks/vl_preprocess.py``.

    .venv/bin/python benchmarks/qwen3_vl_step.py [--family qwen3_vl_moe] [--images 4] [--text 512] [--iters 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

IMG, VS, VE = 4000, 4001, 4002


def time_pair(fn_hf, fn_ours, iters: int) -> tuple[float, float]:
    """Median seconds of each, measured alternately (HF, ours, HF, ...)."""
    fn_hf(), fn_ours()  # warm-up
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(iters):
        for fn, out in ((fn_hf, times[0]), (fn_ours, times[1])):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def hf_model(family: str):
    import transformers

    vision = dict(depth=4, hidden_size=128, num_heads=4, intermediate_size=512, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=256, num_position_embeddings=256)  # fmt: skip
    ids = dict(image_token_id=IMG, video_token_id=4003, vision_start_token_id=VS, vision_end_token_id=VE)
    if family == "qwen3_vl_moe":
        cfg = transformers.Qwen3VLMoeConfig(
            text_config=dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, intermediate_size=512, num_experts=16,
                             num_experts_per_tok=4, moe_intermediate_size=256,
                             rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[16, 8, 8])),
            vision_config={**vision, "deepstack_visual_indexes": [1, 2]}, **ids,
        )  # fmt: skip
        cls = transformers.Qwen3VLMoeForConditionalGeneration
    else:
        cfg = transformers.Qwen3_5MoeConfig(
            text_config=dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4,
                             moe_intermediate_size=256, shared_expert_intermediate_size=256,
                             rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                                  mrope_section=[4, 2, 2])),
            vision_config=vision, **ids,
        )  # fmt: skip
        cls = transformers.Qwen3_5MoeForConditionalGeneration
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["qwen3_vl_moe", "qwen3_5_moe"], default="qwen3_vl_moe")
    parser.add_argument("--images", type=int, default=4, help="images of 16 x 16 patches (64 tokens each)")
    parser.add_argument("--text", type=int, default=512, help="text tokens in the row")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    from hyper_parallel.models.qwen3_vl_moe_v2 import from_pretrained

    hf = hf_model(args.family)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = from_pretrained(d)
    grid = torch.tensor([[1, 16, 16]] * args.images)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 16 * 16)
    per_image = [VS] + [IMG] * 64 + [VE]
    ids = torch.randint(0, 4000, (args.text,)).tolist()
    step = max(1, args.text // (args.images + 1))
    row = []
    for i in range(args.images):
        row += ids[i * step : (i + 1) * step] + per_image
    row += ids[args.images * step :]
    input_ids = torch.tensor([row])
    mm = (input_ids == IMG).int()

    def loss(logits):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())

    def hf_step():
        loss(hf(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm,
                use_cache=False).logits).backward()  # fmt: skip
        hf.zero_grad(set_to_none=True)

    def our_step():
        out = ours(input_ids, pixel_values=pixels, image_grid_thw=grid)
        loss(out.logits if hasattr(out, "logits") else out).backward()
        ours.zero_grad(set_to_none=True)

    with torch.no_grad():
        a = hf(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm, use_cache=False).logits
        b = ours(input_ids, pixel_values=pixels, image_grid_thw=grid)
        diff = (a - (b.logits if hasattr(b, "logits") else b)).abs().max().item()
    t_hf, t_ours = time_pair(hf_step, our_step, args.iters)
    n = input_ids.shape[1]
    print(
        f"{args.family} VL step fwd+bwd ({args.images} images x 256 patches, T={n}): HF {t_hf * 1e3:8.1f} ms "
        f"({n / t_hf:7.0f} tok/s)   ours {t_ours * 1e3:8.1f} ms ({n / t_ours:7.0f} tok/s)   "
        f"ratio {t_hf / t_ours:5.2f}x   (max |logit diff| {diff:.1e})"
    )


if __name__ == "__main__":
    main()
