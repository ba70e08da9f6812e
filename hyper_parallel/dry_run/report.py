"""The dry run's result (``DryRunReport``) and its printed form (``format_report``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hyper_parallel.dry_run.hf_memory import HFIOMemory
from hyper_parallel.dry_run.layout import RankMemory
from hyper_parallel.dry_run.lora_memory import LoRAMemory, format_lora
from hyper_parallel.dry_run.pipeline import PipelinePlan, format_pipeline

__all__ = ["CommVolume", "DryRunReport", "format_hf_io", "format_report"]

GIB = float(1 << 30)

# Ring algorithms: bytes each rank sends, as a fraction of the collective's buffer, for a group of n.
_SENT_FRACTION = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
}


@dataclass(slots=True)
class CommVolume:
    """Collectives of one kind on one process group during one optimizer step of the simulated rank."""

    kind: str
    axis: str
    """Mesh axes of the group (``dp_shard_cp``, ``tp``, ``cp=ep`` when two axes share ranks)."""
    group_size: int
    calls: float
    nbytes: float
    """Summed buffer sizes (see ``CommRecord.nbytes``)."""

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank puts on the wire with ring algorithms (all-to-all: uniform splits)."""
        return self.nbytes * _SENT_FRACTION.get(self.kind, lambda n: 1.0)(self.group_size)


@dataclass(slots=True)
class DryRunReport:
    """Everything the dry run found; ``format_report`` prints it."""

    title: str
    layout: str
    world_size: int
    num_layers: int
    model_numel: int
    distinct_shard_numel: int
    replicated_numel: int
    ranks: list[RankMemory]
    micro_batches_per_step: int
    tokens_per_micro_batch: int
    settings: str
    """Compute/reduce dtypes, activation checkpointing, optimizer (one line)."""
    device_memory_gib: float
    simulated_rank: int | None = None
    peak: dict[str, float] = field(default_factory=dict)
    """Bytes by memory-tracker category at the simulated rank's peak (``Total`` included)."""
    depths: tuple[int, ...] = ()
    """Layer counts the step was simulated at (two: scaled to full depth)."""
    comm: list[CommVolume] = field(default_factory=list)
    lora: LoRAMemory | None = None
    """LoRA runs: adapters, modules_to_save and the frozen base (``lora_memory.py``)."""
    hf_io: list[HFIOMemory] = field(default_factory=list)
    """Host memory of the HF load and export per rank (``hf_memory.py``)."""
    pipeline: PipelinePlan | None = None
    """Pipeline parallel: stages, per-stage memory, bubble, p2p (``pipeline.py``)."""
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def simulated(self) -> RankMemory | None:
        return None if self.simulated_rank is None else self.ranks[self.simulated_rank]

    def estimated_peak(self, mem: RankMemory) -> float | None:
        """The simulated rank's peak, shifted by how much less (or more) static memory ``mem`` holds."""
        if self.pipeline is not None:  # each pp rank group has its own stages and peak
            group = self.pipeline.group_of(mem.rank)
            if group.peak is None or group.worst is None:
                return None
            return group.peak + mem.static - group.worst.static
        sim = self.simulated
        if sim is None or "Total" not in self.peak:
            return None
        return self.peak["Total"] + mem.static - sim.static

    @property
    def fits(self) -> bool | None:
        peaks = [self.estimated_peak(m) for m in self.ranks]
        if any(p is None for p in peaks):
            worst = max(m.static for m in self.ranks)
            return None if worst <= self.device_memory_gib * GIB else False
        return max(peaks) <= self.device_memory_gib * GIB


def _unit(largest: float) -> tuple[str, float]:
    """GiB, or MiB/KiB when every value is smaller (tiny models)."""
    for name, size in (("GiB", GIB), ("MiB", float(1 << 20))):
        if largest >= size:
            return name, size
    return "KiB", 1024.0


def _rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start, prev = [], ranks[0], ranks[0]
    for cur in ranks[1:] + [None]:
        if cur is None or cur != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
        prev = cur
    return ",".join(out)


def memory_rows(report: DryRunReport) -> list[tuple[str, RankMemory, float | None]]:
    """Ranks with identical numbers share a row: (rank ranges, memory of the first, estimated peak)."""
    groups: dict[tuple, list[int]] = {}
    for m in report.ranks:
        groups.setdefault((m.params, m.grads, m.optimizer), []).append(m.rank)
    rows = []
    for ranks in sorted(groups.values()):
        mem = report.ranks[ranks[0]]
        rows.append((_rank_ranges(ranks), mem, report.estimated_peak(mem)))
    return rows


def format_report(report: DryRunReport) -> str:
    """The report as printed by ``python -m hyper_parallel.dry_run``."""
    r = report
    budget = r.device_memory_gib * GIB
    lines = [
        f"dry run: {r.title} on {r.world_size} simulated ranks",
        f"layout: {r.layout}",
        f"step: {r.micro_batches_per_step} micro-batch(es) of {r.tokens_per_micro_batch} tokens per data-parallel "
        f"rank; {r.settings}",
        f"parameters: {r.model_numel:,} in {r.num_layers} layers; distinct shards over all ranks: "
        f"{r.distinct_shard_numel:,} ({'== model' if r.distinct_shard_numel == r.model_numel else 'MISMATCH'}); "
        f"local shards summed over ranks: {r.replicated_numel:,} (x{r.replicated_numel / max(r.model_numel, 1):.2f}: "
        "replicas under HSDP/TP/EP-replicated weights count once per rank)",
        "",
    ]
    rows = memory_rows(r)
    unit, size = _unit(max([m.static for _, m, _ in rows] + [p or 0.0 for _, _, p in rows]))
    lines.append(f"memory per rank ({unit}; device {r.device_memory_gib:g} GiB)")
    lines.append(f"  {'ranks':<14}{'params':>10}{'grads':>10}{'optim':>10}{'static':>10}{'peak':>10}  fits")
    for ranks, mem, peak in rows:
        total = peak if peak is not None else mem.static
        fits = "yes" if total <= budget else "NO"
        peak_s = f"{peak / size:.2f}" if peak is not None else "-"
        cells = "".join(f"{v / size:>10.2f}" for v in (mem.params, mem.grads, mem.optimizer, mem.static))
        lines.append(f"  {ranks:<14}{cells}{peak_s:>10}  {fits}")
    lines.append("  exact bytes (params / grads / optimizer): " + "; ".join(
        f"ranks {ranks}: {m.params:,} / {m.grads:,} / {m.optimizer:,}" for ranks, m, _ in rows
    ))
    if r.pipeline is not None:
        lines += ["", *format_pipeline(r.pipeline, (unit, size), budget)]
    if r.lora is not None:
        lines += ["", *format_lora(r.lora, max(r.ranks, key=lambda m: (m.static, -m.rank)), (unit, size))]
    if r.peak:
        how = (
            f"simulated at {r.depths[0]} and {r.depths[1]} of {r.num_layers} layers and scaled per layer"
            if len(r.depths) == 2
            else f"all {r.num_layers} layers simulated"
        )
        if r.pipeline is not None:
            how = f"its pipeline stages' {r.depths[0]} layers simulated (pipeline table above)"
        lines += [
            "",
            f"peak of rank {r.simulated_rank} (one fake forward+backward per micro-batch and the optimizer step under "
            f"FakeTensorMode with FSDPMemTracker; {how}; routing assumed balanced), {unit}:",
        ]
        parts = sorted(((k, v) for k, v in r.peak.items() if k != "Total" and v > 0), key=lambda kv: -kv[1])
        breakdown = ", ".join(f"{k} {v / size:.2f}" for k, v in parts)
        lines.append(f"  {breakdown}; total {r.peak['Total'] / size:.2f}")
        lines.append("  other ranks: this peak shifted by their difference in static memory")
    if r.comm:
        cunit, csize = _unit(max(c.nbytes for c in r.comm))
        lines += [
            "",
            f"collectives per optimizer step of rank {r.simulated_rank} ({cunit}; buffer: gathered/unreduced size; "
            "sent: ring bytes leaving the rank)",
            f"  {'collective':<16}{'axis':<20}{'ranks':>6}{'calls':>8}{'buffer':>12}{'sent':>12}",
        ]
        for c in sorted(r.comm, key=lambda c: (c.kind, c.axis)):
            lines.append(
                f"  {c.kind:<16}{c.axis:<20}{c.group_size:>6}{c.calls:>8.0f}{c.nbytes / csize:>12.3f}"
                f"{c.sent_bytes / csize:>12.3f}"
            )
    if r.hf_io:
        lines += ["", *format_hf_io(r.hf_io)]
    verdict = r.fits
    lines.append("")
    if verdict is None:
        lines.append(f"fits {r.device_memory_gib:g} GiB: static memory does (activations not simulated)")
    else:
        lines.append(f"fits {r.device_memory_gib:g} GiB: {'yes' if verdict else 'NO'}")
    lines += [f"  {a}" for a in r.advice]
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def format_hf_io(rows: list[HFIOMemory]) -> list[str]:
    """The HF load/export host-memory table (ranks with equal numbers share a row)."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for m in rows:
        groups.setdefault((m.read, m.load_host, m.export_host), []).append(m.rank)
    unit, size = _unit(max(max(k) for k in groups))
    lines = [
        f"HF checkpoint I/O, host memory per rank ({unit}): the load reads only the rank's shards (CPU runs: straight "
        "into them; accelerators: through one staging buffer); the export gathers one parameter at a time and each "
        "rank writes its own files",
        f"  {'ranks':<14}{'load reads':>12}{'load host':>12}{'export host':>13}",
    ]
    for (read, load, export), ranks in sorted(groups.items(), key=lambda kv: kv[1]):
        lines.append(f"  {_rank_ranges(ranks):<14}{read / size:>12.2f}{load / size:>12.2f}{export / size:>13.2f}")
    return lines
