"""Host memory and wall time of the HF load (``--checkpoint.initial_load_path``) and export
(``--checkpoint.export_hf``) of a Qwen3.5-MoE, per rank, on 1, 2 and 4 gloo ranks (FSDP and FSDP x EP).

It generates a shrunk-but-not-tiny ``Qwen3_5MoeForCausalLM`` folder (about 1.7 GB of fp32 in several
safetensors files plus the index, per-expert keys as HF writes them), then for every layout launches
``world`` fresh processes that each build the model on the meta device, parallelize it, materialise their
shards and load the folder, then export it again. Per rank it reports:

- ``shard``: the bytes of the rank's own parameter shards; ``largest``: the largest single tensor;
- ``load peak``: peak RSS during the load (materialise + read) over the process baseline right before it
  (``/proc/self/clear_refs`` resets the high-water mark per phase), and the budget
  ``1.15 * (shard + largest)`` it must stay under;
- ``export peak``: the same for the export; wall times (the slowest rank).

``--impl rank0`` runs the path this project had before issue 27 (rank 0 builds the whole fp32 model, reads
the whole folder, converts it and broadcasts every tensor; the export gathers the whole model on rank 0,
which writes every file), reproduced here for comparison; ``--impl sharded`` (default) the current one
(each rank reads the slices of its own shards; the export sends one tensor at a time to the rank that writes
its file, each shard once, point to point, and every rank writes its own files). The sharded export is
checked tensor by tensor against the source folder. Timings on a shared machine are noisy: run it more than
once (an older build of the package can be measured with ``PYTHONPATH=<its copy>``).

    .venv/bin/python benchmarks/hf_io.py [--impl sharded|rank0] [--layouts fsdp1,fsdp2,fsdp4,ep2,ep4]
        [--folder /tmp/hf_io_bench] [--keep]

The folder (about 1.7 GB, plus an export of the same size) is deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = {  # name -> (world, dp_shard, ep)
    "fsdp1": (1, 1, 1),
    "fsdp2": (2, 2, 1),
    "fsdp4": (4, 4, 1),
    "ep2": (2, 2, 2),
    "ep4": (4, 4, 4),
}
MiB = 1 << 20


def model_config() -> Any:
    """About 420M parameters: 6 hybrid layers (DeltaNet x3 + gated attention ... ), 32 experts of 512 each."""
    from hyper_parallel.models.qwen3_5_moe_v2.model import qwen3_5_moe_config

    return qwen3_5_moe_config(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=(6, 5, 5),
    )  # fmt: skip


def generate(folder: Path, *, file_bytes: int = 400 * MiB) -> None:
    """Write the HF folder one tensor at a time (the adapter's per-key conversion; never the whole model)."""
    from safetensors.torch import save_file

    from hyper_parallel.models.qwen3_5_moe_v2.state_dict import Qwen3_5MoeStateDictAdapter

    config = model_config()
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in config.build().state_dict().items()}
    adapter = Qwen3_5MoeStateDictAdapter(config)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0

    def flush() -> None:
        nonlocal size
        if files[-1]:
            save_file(files[-1], str(folder / f"part-{len(files)}.safetensors"), metadata={"format": "pt"})
            files[-1] = {k: torch.empty(0) for k in files[-1]}  # keep the names for the index, drop the data
            files.append({})
            size = 0

    for key, shape in shapes.items():
        t = torch.randn(shape, generator=gen) * 0.02
        for hf_key, hf_t in adapter.to_hf({key: t}).items():
            if size + hf_t.numel() * 4 > file_bytes:
                flush()
            files[-1][hf_key] = hf_t.contiguous().clone()
            size += hf_t.numel() * 4
    flush()
    n = len(files) - 1
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (folder / f"part-{i + 1}.safetensors").rename(folder / name)
        weight_map.update({k: name for k in files[i]})
    total = sum(f.stat().st_size for f in folder.glob("model-*.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    from hyper_parallel.models.qwen3_5_v2.hf_config import config_to_hf

    hf_config = config_to_hf(config, text_only=True)
    hf_config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))


# ---- per-rank measurement -------------------------------------------------------------------


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _legacy_load(model: torch.nn.Module, config: Any, folder: Path) -> None:
    """The pre-issue-27 trainer path: rank 0 builds and initialises the whole fp32 model, reads every tensor of
    the folder, converts them and every rank receives its shards (``broadcast_from_rank0``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from hyper_parallel.models.qwen3_5_moe_v2.state_dict import Qwen3_5MoeStateDictAdapter
    from hyper_parallel.hf.storage import read_safetensors

    sd: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        full = config.build()
        full.init_weights()
        ours = full.state_dict()
        result = Qwen3_5MoeStateDictAdapter(config).from_hf_checked(
            read_safetensors(folder), {k: v.shape for k, v in ours.items()}
        )
        with torch.no_grad():
            for key, t in result.state_dict.items():
                ours[key].copy_(t)
        del result
        sd = full.state_dict()
    world = dist.get_world_size()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=world > 1, strict=world == 1)
    set_model_state_dict(model, sd, options=options)


def _legacy_export(model: torch.nn.Module, out: Path) -> None:
    """The pre-issue-27 export: the whole model gathered on rank 0 (``cpu_offload``), which writes every file."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hyper_parallel.models.qwen3_5_moe_v2 import save_pretrained

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_pretrained(model, out, state_dict=sd, dtype=torch.float32)


def _rank_main(rank: int, world: int, port: int, layout: str, impl: str, folder: str, out: str, report: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from hyper_parallel.config import ActivationCheckpointConfig, CompileConfig, ParallelismConfig, TrainingConfig
    from hyper_parallel.distributed.parallel_dims import ParallelDims
    from hyper_parallel.hf import load_hf_weights
    from hyper_parallel.models.qwen3_5_moe_v2 import save_pretrained
    from hyper_parallel.models.qwen3_5_moe_v2.parallelize import parallelize_qwen3_5_moe

    _, dp_shard, ep = LAYOUTS[layout]
    config = model_config()
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp_shard, expert_parallel_degree=ep)
    with torch.device("meta"):
        model = config.build()
    pd = ParallelDims.from_config(parallelism, world)
    pd.build_mesh("cpu")
    parallelize_qwen3_5_moe(
        model, parallel_dims=pd, training=TrainingConfig(), parallelism=parallelism,
        ac_config=ActivationCheckpointConfig(), compile_config=CompileConfig(),
    )  # fmt: skip
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    shard = sum(p.numel() * 4 for p in local)
    largest = max(p.numel() * 4 for p in model.parameters())
    dist.barrier()

    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    model.to_empty(device="cpu")
    with torch.no_grad():
        if impl == "rank0":
            _legacy_load(model, config, Path(folder))
        else:
            load_hf_weights(model, folder)
    dist.barrier()
    load_wall, load_peak = time.perf_counter() - t0, _status("VmHWM") - base

    base_e = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if impl == "rank0":
        _legacy_export(model, Path(out))
    else:
        save_pretrained(model, out, state_dict=get_model_state_dict(model), dtype=torch.float32)
    dist.barrier()
    export_wall, export_peak = time.perf_counter() - t0, _status("VmHWM") - base_e
    row = dict(rank=rank, shard=shard, largest=largest, load_peak=load_peak, load_wall=load_wall,
               export_peak=export_peak, export_wall=export_wall)  # fmt: skip
    Path(report, f"rank{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def _launch(layout: str, impl: str, folder: Path, out: Path) -> list[dict[str, Any]]:
    import socket

    world = LAYOUTS[layout][0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as report:
        mp.start_processes(
            _rank_main, args=(world, port, layout, impl, str(folder), str(out), report), nprocs=world,
            start_method="spawn",
        )  # fmt: skip
        return [json.loads(Path(report, f"rank{r}.json").read_text()) for r in range(world)]


def check_export(src: Path, out: Path) -> int:
    """Every tensor of ``out`` equals the source folder's (read one tensor at a time); returns the count."""
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        return {k: folder / "model.safetensors" for k in safe_open(str(folder / "model.safetensors"), "pt").keys()}

    a, b = where(src), where(out)
    if a.keys() != b.keys():
        raise AssertionError(f"export keys differ: missing {sorted(a.keys() - b.keys())[:5]}, extra {sorted(b.keys() - a.keys())[:5]}")
    for key in sorted(a):
        with safe_open(str(a[key]), "pt") as fa, safe_open(str(b[key]), "pt") as fb:
            if not torch.equal(fa.get_tensor(key), fb.get_tensor(key)):
                raise AssertionError(f"export differs from the source at {key}")
    return len(a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=("sharded", "rank0"), default="sharded")
    p.add_argument("--layouts", default="fsdp1,fsdp2,fsdp4,ep2,ep4")
    p.add_argument("--folder", default="/tmp/hf_io_bench")
    p.add_argument("--keep", action="store_true", help="keep the generated folder for the next run")
    args = p.parse_args()
    folder = Path(args.folder)
    src, out = folder / "src", folder / "export"
    if not (src / "config.json").is_file():
        t = time.perf_counter()
        generate(src)
        print(f"generated {src} in {time.perf_counter() - t:.0f}s")
    files = sorted(src.glob("*.safetensors"))
    print(f"{src}: {sum(f.stat().st_size for f in files) / 1e9:.2f} GB in {len(files)} safetensors files ({args.impl})")
    print(f"{'layout':<7}{'rank':>5}{'shard MiB':>11}{'largest':>9}{'load peak':>11}{'budget':>8}{'ok':>4}"
          f"{'load s':>8}{'export peak':>13}{'export s':>10}")  # fmt: skip
    try:
        for layout in args.layouts.split(","):
            shutil.rmtree(out, ignore_errors=True)
            rows = _launch(layout, args.impl, src, out)
            for r in rows:
                budget = 1.15 * (r["shard"] + r["largest"])
                print(
                    f"{layout:<7}{r['rank']:>5}{r['shard'] / MiB:>11.0f}{r['largest'] / MiB:>9.0f}"
                    f"{r['load_peak'] / MiB:>11.0f}{budget / MiB:>8.0f}{'yes' if r['load_peak'] <= budget else 'NO':>4}"
                    f"{r['load_wall']:>8.1f}{r['export_peak'] / MiB:>13.0f}{r['export_wall']:>10.1f}"
                )
            if args.impl == "sharded" and layout == args.layouts.split(",")[-1]:
                print(f"export of {layout} equals the source folder: {check_export(src, out)} tensors")
    finally:
        shutil.rmtree(out, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
