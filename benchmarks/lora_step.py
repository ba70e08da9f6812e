"""LoRA training step vs full fine-tuning (ours) and vs PEFT LoRA on transformers' model, side by side in one run.

One HF Glm4MoeLite folder (hidden 256, 4 layers: one dense then MoE with 16 experts top-4 and a shared expert,
MLA with q-LoRA), fp32, 1 thread, one row of ``--seq`` tokens, and three training steps (forward, backward,
AdamW over the trainable parameters):

- **ours, LoRA**: ``apply_lora`` of the folder's model (``--lora.*`` as ``LoRAConfig``), the base frozen, rank-16
  adapters on every MLA projection, the dense and shared MLPs and the routed experts (per expert, through the
  experts' grouped matmul);
- **ours, full**: the same model without adapters, every weight trained;
- **PEFT**: ``peft.PeftModel.from_pretrained`` of our exported adapter folder (``hf.lora_export.save_adapter``, what
  ``--checkpoint.export_hf`` writes) onto transformers' ``Glm4MoeLiteForCausalLM`` of the same folder
  (``target_parameters`` for the fused experts).

The adapters start with a random ``B`` (not PEFT's zeros) so the adapter path is not a no-op, and the logits of
ours and PEFT are compared before timing. The three steps are timed in turn each iteration (medians and best),
so machine noise hits them alike. Peak memory is what torch's ``MemTracker`` sees alive during one steady-state
step (parameters, gradients, optimizer state, activations, temporaries): the tensor bytes, not the process's RSS.

    .venv/bin/python benchmarks/lora_step.py [--seq 1024] [--rank 16] [--iters 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model_step import VOCAB, glm_bench_config  # a sibling script: benchmarks/ is on sys.path when run

# HF module names (what a user writes for --lora.targets); the same names select PEFT's modules
TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "experts")  # fmt: skip


def peak_bytes(step: Callable[[], None], model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """Largest total of live tensor bytes during one call of ``step`` (``MemTracker``, all categories)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        # MemTracker hooks every parameter's gradient to label it, which a frozen parameter refuses; unlabelled,
        # a gradient still counts in the total (as a temporary)
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    tracker = Tracker()
    warnings.filterwarnings("ignore", message="Module is None. Skipping")  # ModTracker on modules freed meanwhile
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    return max(float(dev.get("Total", 0)) for dev in peak.values())


def randomize_lora_B_(model: nn.Module, std: float = 0.02) -> None:
    """A trained-looking adapter: B ~ N(0, std) instead of PEFT's zeros (which make the adapter a no-op)."""
    from hyper_parallel.models.common.lora import is_lora_param

    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_lora_param(name) and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="1: the trainer's default on a 2-CPU machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from peft import PeftModel
    from transformers import Glm4MoeLiteForCausalLM

    from hyper_parallel.components import CrossEntropyLoss
    from hyper_parallel.config.lora import LoRAConfig
    from hyper_parallel.models.common.lora_policy import apply_lora, lora_trainable_names
    from hyper_parallel.models.glm_image_moe_v2 import from_pretrained
    from hyper_parallel.models.common.lora import is_lora_param
    from hyper_parallel.hf.lora_export import save_adapter
    from hyper_parallel.protocols.model_spec import discover_model_spec

    vocab = VOCAB
    hf_cfg = glm_bench_config()  # the same model as model_step.py
    torch.manual_seed(0)
    hf = Glm4MoeLiteForCausalLM(hf_cfg)
    hf.config._attn_implementation = "sdpa"
    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank, targets=TARGETS)
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as adapter_dir:
        hf.save_pretrained(d)
        # GlmImageMoe's head also scores the VQ codebook: a small one keeps its head within 1% of HF's
        full = from_pretrained(d, codebook_size=32, vq_embed_dim=64)
        torch.manual_seed(1)
        ours = apply_lora(full.config, lora).build()
        ours.init_weights()  # the adapters as PEFT initialises them (A kaiming-uniform); then the folder's base
        missing, unexpected = ours.load_state_dict(full.state_dict(), strict=False)
        assert not unexpected and all(is_lora_param(k) for k in missing), (missing, unexpected)
        randomize_lora_B_(ours)
        trainable = lora_trainable_names(ours)
        for name, p in ours.named_parameters():
            p.requires_grad_(name in trainable)
        save_adapter(discover_model_spec("glm_image_moe"), ours, adapter_dir, base_model_name_or_path=d)
        peft_model = PeftModel.from_pretrained(Glm4MoeLiteForCausalLM.from_pretrained(d), adapter_dir, is_trainable=True)
    peft_model.base_model.model.config._attn_implementation = "sdpa"
    for m in (full, ours, peft_model):
        m.train()
    loss_fn = CrossEntropyLoss.Config().build()
    seq = args.seq
    ids = torch.randint(0, vocab - 1, (1, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        ours_logits = getattr(ours(ids), "logits", ours(ids))
        peft_logits = peft_model(input_ids=ids, use_cache=False).logits
    logit_diff = (ours_logits[..., :vocab] - peft_logits).abs().max().item()

    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)

    def ours_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            out = model(ids)
            loss_fn(getattr(out, "logits", out), labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def peft_step(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def step() -> None:
            logits = peft_model(input_ids=ids, use_cache=False).logits
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    opts = {name: adamw(m) for name, m in (("lora", ours), ("full", full), ("peft", peft_model))}
    runs = {
        "ours  LoRA (frozen base, adapters + experts' grouped adapters)": (ours_step(ours, opts["lora"]), ours),
        "ours  full fine-tune (every weight)                          ": (ours_step(full, opts["full"]), full),
        "PEFT  LoRA on transformers' Glm4MoeLiteForCausalLM           ": (peft_step(opts["peft"]), peft_model),
    }
    keys = dict(zip(runs, ("lora", "full", "peft")))
    for fn, _ in runs.values():
        fn()  # warm-up; creates the optimizer state, so the measured steps are steady-state ones
    peaks = {name: peak_bytes(fn, model, opts[keys[name]]) for name, (fn, model) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.iters):  # in turn, so machine noise hits every path alike
        for name, (fn, _) in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}
    counts = {
        name: (sum(p.numel() for p in m.parameters() if p.requires_grad), sum(p.numel() for p in m.parameters()))
        for name, (_, m) in runs.items()
    }
    print(f"config: hidden 256, 4 layers, 16 experts top-4, seq {seq}, LoRA rank {args.rank} alpha {2 * args.rank} on "
          f"{', '.join(TARGETS)}; fp32, AdamW, {args.threads} threads, median of {args.iters}")  # fmt: skip
    print(f"logits, ours LoRA vs PEFT (same weights): max abs diff {logit_diff:.2e}")
    for name in runs:
        trained, total = counts[name]
        print(f"{name}: {med[name] * 1e3:6.0f} ms/step (best {best[name] * 1e3:5.0f})  peak {peaks[name] / 2**20:7.1f} MiB"
              f"  trains {trained:,} of {total:,} parameters")  # fmt: skip
    lora, full_name, peft = runs
    print(f"ours LoRA vs ours full: time {med[lora] / med[full_name]:.2f}x (best {best[lora] / best[full_name]:.2f}x), "
          f"peak memory {peaks[lora] / peaks[full_name]:.2f}x")  # fmt: skip
    print(f"ours LoRA vs PEFT:      time {med[lora] / med[peft]:.2f}x (best {best[lora] / best[peft]:.2f}x; speed-up "
          f"{med[peft] / med[lora]:.2f}x), peak memory {peaks[lora] / peaks[peft]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
