"""``benchmarks/gpu_check.sh --cpu``: the whole GPU check at tiny width, so the script a lent GPU runs cannot rot.

A session lent a GPU gets one short window and must not spend it on a script that no longer starts. This
runs every check of the script on CPU (CPU numbers, MFU n/a) and reads the one JSON it writes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]

# every check the issue asks of the prepared run, by JSON entry
EXPECTED = (
    "boot", "A.attention", "B.grouped_mm", "C.loss", "G.deltanet", "F.deterministic", "D.bf16_step",
    "E.async_checkpoint", "N.not_checkable",
    *(f"M.{m}.{part}" for m in ("qwen3_5_moe", "glm_image_moe") for part in ("mfu", "memory", "syncs", "profile")),
    "M.qwen3_5_moe.compile",
)  # fmt: skip


def test_gpu_check_cpu_mode(tmp_path):
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "GPU_CHECK_BUDGET": "900"}
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = doc["checks"]
    table = "\n".join(f"{k}: {v['status']} {v['summary']}" for k, v in checks.items())
    assert proc.returncode == 0, f"exit {proc.returncode}\n{table}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert set(EXPECTED) <= set(checks), f"missing {sorted(set(EXPECTED) - set(checks))}\n{table}"
    assert all(c["status"] in ("PASS", "INFO") for c in checks.values()), table
    mfu = checks["M.qwen3_5_moe.mfu"]["values"]
    assert mfu["tokens_per_s"] > 0 and mfu["flops_per_token"] > 0 and mfu["tflops"] > 0
    assert mfu["mfu_vs_989"] is None and mfu["mfu_vs_measured"] is None, "a CPU run must not print an MFU"
    assert checks["M.qwen3_5_moe.memory"]["values"]["dry_run_gib"] > 0
    assert checks["M.qwen3_5_moe.compile"]["values"]["recompiles"] <= 4
    assert sum(checks["M.glm_image_moe.profile"]["values"]["ms_by_module_type"].values()) > 0
    tail = proc.stdout.rstrip().splitlines()
    assert any(line.startswith("== GPU check (cpu)") for line in tail[-len(checks) - 3 :]), "the table must come last"
