"""A few layers of a released model at real width, trained through the Trainer: speed, MFU, memory, syncs, profile.

The GPU check's measurement of what users will ask (``benchmarks/gpu_check.sh`` runs it per model). A recipe's
model (``--config qwen3_5_moe_a3b``: hidden 2048, 256 experts top-8 + shared, DeltaNet 16/32 heads of 128,
gated attention 16/2 heads of 256, vocab 248k; ``glm_image_moe_a3b``: GLM-4.7-Flash's MLA, 64 experts top-4
+ shared) is cut to its first ``--layers`` layers, MTP off, and trained in bf16 with full activation
checkpointing on one device, on ``--tokens``-token packed micro-batches of a realistic document mix (log-normal
lengths, mean ``--doc_tokens``). It records, into the GPU check's JSON (``gpu_report.py``):

- ``<name>.mfu``: tokens/s over ``--steps`` timed steps after ``--warmup``, TFLOP/s from the trainer's FLOPs per
  token (causal attention over the step's documents, routed experts at top-k), MFU against 989 TFLOP/s (the
  H100/H200 dense bf16 figure) and against the matmul peak this script measures on the card;
- ``<name>.memory``: ``max_memory_allocated`` / ``reserved`` against the dry run of the same config on one
  device of ``--device_gib``;
- ``<name>.syncs``: device-to-host syncs of one steady step (CUDA: ``torch.cuda.set_sync_debug_mode("warn")``,
  counted per site);
- ``<name>.profile``: one ``torch.profiler`` step: time per module type (token mixers, MoE / MLP, loss,
  optimizer), GPU-busy fraction and kernel launches;
- ``<name>.compile`` (``--compile``): the same slice under ``--compile.enable`` (fullgraph where it holds):
  compile time, recompiles, speed-up over eager.

``--cpu`` runs the same code on the recipe's debug model at tiny width (CPU numbers, MFU n/a), so the suite can
keep the script from rotting.

    python benchmarks/gpu_slice.py --module qwen3_5_moe --config qwen3_5_moe_a3b --name qwen3_5_moe_a3b [--compile]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import record  # noqa: E402

H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 / H200 SXM (the H200 is the H100's compute)


def matmul_peak_tflops(device: torch.device) -> float:
    """Attainable dense matmul TFLOP/s on this device: bf16 8192^3 on a GPU, fp32 1024^3 on a CPU."""
    n, dtype, iters = (8192, torch.bfloat16, 10) if device.type == "cuda" else (1024, torch.float32, 5)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slice_config(args: argparse.Namespace, *, compile: bool, dump: str) -> Any:
    """The recipe's run, cut to ``args.layers`` layers, on one device, dummy packed data, no checkpoints."""
    from hyper_parallel.config.manager import resolve_recipe
    from hyper_parallel.data.dummy import DummyDataLoader

    cfg = resolve_recipe(args.module, args.config)()
    model = cfg.model
    layers = list(model.layers)[: args.layers]
    model = dataclasses.replace(model, layers=layers, mtp=None, use_mtp=None)
    cfg = dataclasses.replace(
        cfg,
        model=model,
        dump_folder=dump,
        lora=dataclasses.replace(cfg.lora, rank=0),
        training=dataclasses.replace(
            cfg.training, steps=10**6, mixed_precision_param="float32" if args.cpu else "bfloat16"
        ),
        parallelism=dataclasses.replace(
            cfg.parallelism, context_parallel_degree=1, expert_parallel_degree=1, data_parallel_shard_degree=-1,
            pipeline_parallel_degree=1,
        ),  # fmt: skip
        activation_checkpoint=dataclasses.replace(cfg.activation_checkpoint, mode="full"),
        compile=dataclasses.replace(cfg.compile, enable=compile, backend=args.backend, fullgraph=args.fullgraph),
        data=DummyDataLoader.Config(
            max_tokens_per_microbatch=args.tokens, global_batch_tokens=args.tokens, document_tokens=args.doc_tokens,
            seed=0,
        ),  # fmt: skip
        checkpoint=dataclasses.replace(cfg.checkpoint, enable=False, initial_load_path="", export_hf=False),
        validation=dataclasses.replace(cfg.validation, freq=0, at_start=False),
        metrics=dataclasses.replace(cfg.metrics, log_freq=10**6),
        explicit_model_fields=(),
    )
    return cfg


def _flops_per_token(trainer: Any, stats: dict[str, Any]) -> float:
    """The step's FLOPs per token as the trainer logs it (from the step's documents when it reports them)."""
    for key in ("flops_per_token",):
        if key in stats:
            return float(stats[key])
        if key in stats.get("extra", {}):
            return float(stats["extra"][key])
    return float(trainer.flops_per_token)


def run_steps(trainer: Any, n: int, device: torch.device) -> tuple[float, list[dict[str, Any]]]:
    """``n`` optimizer steps; wall seconds (device-synchronised) and their stats."""
    _sync(device)
    t = time.perf_counter()
    out = []
    for _ in range(n):
        trainer.step += 1
        out.append(trainer.train_step())
    _sync(device)
    return time.perf_counter() - t, out


@contextmanager
def count_syncs(device: torch.device):
    """Device-to-host syncs per site: CUDA's sync debug mode as warnings; on CPU the suite's dispatch counter."""
    sites: Counter[str] = Counter()
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield sites
            finally:
                torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message):
                sites[f"{Path(w.filename).name}:{w.lineno}"] += 1
        return
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.torch.sync_counter import SyncCounter
    except ImportError:  # the CPU counter lives in the test tree; without it, say so
        sites["(no CPU sync counter: tests/torch/sync_counter.py missing)"] = 0
        yield sites
        return
    with SyncCounter() as counter:
        yield sites
    sites.update(counter.by_site)


# module types the profile reports, by class-name suffix (first match wins): every family's blocks
_PROFILE_TYPES = (
    ("GatedDeltaNet", "deltanet"), ("Attention", "attention"), ("MoE", "moe"), ("FeedForward", "mlp"),
    ("VisionTower", "vision"), ("Embedding", "embedding"),
)  # fmt: skip


def _profile_kind(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    for suffix, kind in _PROFILE_TYPES:
        if suffix in name:
            return kind
    return None


def profile_step(trainer: Any, device: torch.device) -> dict[str, Any]:
    """One profiled step: ms per module type (forward + recompute ranges), loss, optimizer, GPU-busy, launches."""
    from torch.profiler import ProfilerActivity, profile

    handles, hooks = {}, []

    def pre(mod, _args, kind):
        handles[id(mod)] = torch.ops.profiler._record_function_enter_new(f"slice::{kind}", None)

    def post(mod, _args, _out):
        h = handles.pop(id(mod), None)
        if h is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(h)

    outer: list[str] = []  # profiled module names: a module inside one (MoE's shared expert) is not counted twice
    for i, part in enumerate(trainer.model_parts):
        for name, mod in part.named_modules(prefix=str(i)):
            kind = _profile_kind(mod)
            if kind is None or any(name.startswith(o + ".") for o in outer):
                continue
            outer.append(name)
            hooks.append(mod.register_forward_pre_hook(lambda m, a, k=kind: pre(m, a, k)))
            hooks.append(mod.register_forward_hook(post))
    loss_fn = trainer.loss_fn  # a callable, not a module: ranged by a wrapper for this step

    def ranged_loss(*a, **kw):
        with torch.profiler.record_function("slice::loss"):
            return loss_fn(*a, **kw)

    trainer.loss_fn = ranged_loss
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        _sync(device)
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            trainer.step += 1
            trainer.train_step()
            _sync(device)
            wall = time.perf_counter() - t
    finally:
        trainer.loss_fn = loss_fn
        for h in hooks:
            h.remove()
    cuda = device.type == "cuda"
    per_kind: Counter[str] = Counter()
    kernels = busy_us = 0.0
    for evt in prof.events():
        on_gpu = getattr(evt, "device_type", None) is not None and evt.device_type.name == "CUDA"
        if on_gpu and getattr(evt, "is_user_annotation", False):  # a range's GPU-side copy: counted on the CPU side
            continue
        dev_us = evt.device_time_total if cuda else 0.0
        if evt.name.startswith("slice::"):
            per_kind[evt.name.removeprefix("slice::")] += (dev_us if cuda else evt.cpu_time_total) / 1e3
        elif "Optimizer.step" in evt.name:
            per_kind["optimizer"] += (dev_us if cuda else evt.cpu_time_total) / 1e3
        if on_gpu:
            kernels += 1
            busy_us += evt.device_time
    launches = sum(1 for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    return {
        "step_ms": wall * 1e3,
        "ms_by_module_type": {k: round(v, 2) for k, v in sorted(per_kind.items())},
        "gpu_busy_fraction": round(min(1.0, busy_us / 1e6 / wall), 3) if cuda else None,
        "kernels": int(kernels) if cuda else None,
        "kernel_launches": launches if cuda else None,
        "note": "module and loss times are forward ranges (AC recompute included); backward kernels count in busy and launches",
    }


class _RecompileCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.recompiles = 0

    def emit(self, rec: logging.LogRecord) -> None:
        if "Recompiling function" in rec.getMessage():
            self.recompiles += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--module", required=True)
    p.add_argument("--config", required=True, help="recipe whose model is cut (debug recipe with --cpu)")
    p.add_argument("--name", required=True, help="prefix of the JSON entries")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--doc_tokens", type=int, default=1500, help="mean document length of the packed mix")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device_gib", type=float, default=139.0)
    p.add_argument("--compile", action="store_true", help="also run the slice compiled")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cpu", action="store_true", help="tiny width on CPU (tests the script)")
    args = p.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    logging.basicConfig(level=logging.WARNING)
    peak = matmul_peak_tflops(device)
    with tempfile.TemporaryDirectory() as dump:
        cfg = slice_config(args, compile=False, dump=dump)
        eager = measure(args, cfg, device, peak, label="eager")
        if args.compile:
            measure_compile(args, slice_config(args, compile=True, dump=dump + "/c"), device, eager)


def measure(args: argparse.Namespace, cfg: Any, device: torch.device, peak: float, *, label: str) -> dict[str, Any]:
    """Build, warm up, time, then memory / syncs / profile of the eager slice; records four entries."""
    from hyper_parallel.dry_run import dry_run

    name = args.name
    report = dry_run(cfg, world_size=1, device_memory_gib=args.device_gib, title=name)  # before the real group
    est = report.estimated_peak(report.ranks[0])
    est_gib = est / 2**30 if est is not None else None
    trainer = cfg.build()
    try:
        run_steps(trainer, args.warmup, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        secs, stats = run_steps(trainer, args.steps, device)
        tokens = args.tokens * args.steps
        fpt = _flops_per_token(trainer, stats[-1])
        tps = tokens / secs
        tflops = fpt * tps / 1e12
        cuda = device.type == "cuda"
        mfu = (
            {"mfu_vs_989": round(tflops / H100_BF16_TFLOPS, 4), "mfu_vs_measured": round(tflops / peak, 4)} if cuda
            else {"mfu_vs_989": None, "mfu_vs_measured": None, "mfu_note": "CPU: no known peak, no MFU"}
        )
        loss = [round(float(s["loss"]), 4) for s in stats]
        record(
            f"{name}.mfu", "PASS" if all(map(_finite, loss)) else "FAIL",
            f"{tps:,.0f} tok/s, {tflops:.1f} TFLOP/s"
            + (f", MFU {mfu['mfu_vs_989']:.1%} of 989 / {mfu['mfu_vs_measured']:.1%} of measured {peak:.0f}" if cuda
               else " (CPU: MFU n/a)"),
            tokens_per_s=tps, tflops=tflops, flops_per_token=fpt, matmul_peak_tflops=peak, step_ms=secs / args.steps * 1e3,
            layers=args.layers, tokens_per_microbatch=args.tokens, losses=loss, device=str(device), **mfu,
            peer="Megatron-Bridge Qwen3.6-35B-A3B card: 135.6 TFLOP/s per H100, 13.7% MFU (real routing, full model)",
        )  # fmt: skip
        if cuda:
            alloc, reserved = (f(device) / 2**30 for f in (torch.cuda.max_memory_allocated, torch.cuda.max_memory_reserved))
            ratio = alloc / est_gib if est_gib else None
            status = "PASS" if ratio is not None and 0.8 <= ratio <= 1.15 else "FAIL"
            summary = f"peak allocated {alloc:.2f} GiB, reserved {reserved:.2f} GiB, dry run {est_gib:.2f} GiB"
            summary += f" (measured/dry {ratio:.2f})" if ratio else ""
        else:
            alloc = reserved = ratio = None
            status, summary = "INFO", f"dry run {est_gib:.3f} GiB (CPU: no device allocator to compare)"
        record(f"{name}.memory", status, summary, allocated_gib=alloc, reserved_gib=reserved, dry_run_gib=est_gib,
               measured_over_dry=ratio)  # fmt: skip
        with count_syncs(device) as sites:
            run_steps(trainer, 1, device)
        total = sum(sites.values())
        top = ", ".join(f"{k} x{v}" for k, v in sites.most_common(6))
        record(f"{name}.syncs", "INFO", f"{total} syncs in one steady step" + (f": {top}" if top else ""),
               total=total, by_site=dict(sites))  # fmt: skip
        prof = profile_step(trainer, device)
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in prof["ms_by_module_type"].items())
        busy = f", GPU busy {prof['gpu_busy_fraction']:.0%}, {prof['kernel_launches']} launches" if cuda else ""
        record(f"{name}.profile", "INFO", f"step {prof['step_ms']:.0f} ms; ms by type: {kinds}{busy}", **prof)
        return {"tokens_per_s": tps, "step_s": secs / args.steps}
    finally:
        trainer.close()


def measure_compile(args: argparse.Namespace, cfg: Any, device: torch.device, eager: dict[str, Any]) -> None:
    """The slice under ``--compile.enable``: compile time (first steps minus steady), recompiles, speed-up."""
    import torch._dynamo

    torch._dynamo.reset()
    counter = _RecompileCounter()
    torch._logging.set_logs(recompiles=True)
    recompiles_log = logging.getLogger("torch._dynamo.guards.__recompiles")  # dynamo's "Recompiling function" lines
    recompiles_log.addHandler(counter)
    recompiles_log.propagate = False  # counted here, not printed
    name, fullgraph = args.name, cfg.compile.fullgraph
    try:
        try:
            trainer = cfg.build()
            first, _ = run_steps(trainer, 1, device)
        except Exception as e:  # noqa: BLE001  fullgraph refused: say where, retry with graph breaks allowed
            if not fullgraph:
                raise
            note = f"fullgraph failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); retried without"
            torch._dynamo.reset()
            cfg = dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, fullgraph=False))
            fullgraph = False
            trainer = cfg.build()
            first, _ = run_steps(trainer, 1, device)
        else:
            note = "fullgraph"
        try:
            warm, _ = run_steps(trainer, max(args.warmup - 1, 1), device)
            secs, stats = run_steps(trainer, args.steps, device)
        finally:
            trainer.close()
    finally:
        recompiles_log.removeHandler(counter)
        torch._logging.set_logs()
        recompiles_log.propagate = True
    step = secs / args.steps
    speedup = eager["step_s"] / step
    frames = torch._dynamo.utils.counters["frames"]
    record(
        f"{name}.compile", "PASS" if counter.recompiles <= 4 else "FAIL",
        f"{note}: compile {first - step:.1f} s, {counter.recompiles} recompiles over {args.warmup + args.steps} "
        f"packings, step {step * 1e3:.0f} ms vs eager {eager['step_s'] * 1e3:.0f} ms ({speedup:.2f}x)",
        fullgraph=fullgraph, compile_s=first - step, recompiles=counter.recompiles, speedup=speedup,
        frames_ok=int(frames.get("ok", 0)), frames_total=int(frames.get("total", 0)), backend=cfg.compile.backend,
        losses=[round(float(s["loss"]), 4) for s in stats],
    )  # fmt: skip


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


if __name__ == "__main__":
    main()
