"""Dry run: the host memory of the HF load and export per rank (``dry_run/hf_memory.py``) equals hand-computed
values on the tiny GlmImageMoe (FSDP 4 and TP 2 x FSDP 2): a rank's load reads exactly its shards, its staging
buffer is its largest shard of one parameter, and the export bound is two files of at most the export
size / world plus one converted parameter; the CLI prints the table."""

from __future__ import annotations

import pytest

from hyper_parallel.dry_run import dry_run, main
from tests.torch.ut.dry_run.test_bytes_and_collectives import FP32, _divisor, _params, _tiny


@pytest.mark.parametrize("layout, kw", [("fsdp4", {}), ("tp2_fsdp2", {"tp": 2})])
def test_hf_io_host_memory_equals_analytic_values(layout, kw):
    cfg = _tiny(**kw)
    report = dry_run(cfg, world_size=4, simulate=False)
    numels = _params(cfg)
    local = {n: numels[n] // _divisor(n, layout) for n in numels}
    export_itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.checkpoint.export_dtype]
    total = sum(numels.values()) * export_itemsize
    file_bytes = -(-total // 4)  # a sharded export makes files of at most export size / world
    assert [m.rank for m in report.hf_io] == [0, 1, 2, 3]
    for m in report.hf_io:
        assert m.read == sum(local.values()) * FP32, (layout, m)
        assert m.load_host == max(local.values()) * FP32, (layout, m)
        assert m.export_host == 2 * file_bytes + max(numels.values()) * export_itemsize, (layout, m)


def test_cli_prints_the_hf_io_table(capsys):
    main(["--module", "glm_image_moe", "--config", "glm_image_moe_debug", "--world_size", "4", "--no_step"])
    out = capsys.readouterr().out
    assert "HF checkpoint I/O, host memory per rank" in out and "load reads" in out, out
