"""HF load and export without one rank holding the model (issue 27): a Qwen3.5-MoE ConditionalGeneration
folder written by transformers (DeltaNet q/k/v rows, per-expert keys, ``model.visual.*`` and ``mtp.*``
passthrough keys, several safetensors files) loaded into FSDP2, FSDP2 x EP2 and TP2 on gloo gives exactly
the parameters of the one-process ``from_pretrained``, with each rank reading well under the whole folder;
the export from every rank equals the one-process export bit for bit, file by file (passthrough included).
FSDP 2 x TP 2 (dim 0 sharded twice) runs in a 4-rank launch of its own."""

from __future__ import annotations

import pytest
import torch

from tests.torch.st.glm_jobs import Layout
from tests.torch.st.hf_io_jobs import sharded_load_export_job
from tests.torch.st.shard_gather_jobs import gather_job

pytestmark = pytest.mark.slow

LAYOUTS = [Layout(world=2), Layout(world=2, ep=2), Layout(world=2, tp=2)]
# the fraction of the folder's bytes a rank may read: FSDP/EP shard every tensor; TP 2 replicates norms,
# router, the small DeltaNet vectors (and FSDP is off)
READ_LIMIT = {"w2-fsdp": 0.6, "w2-ep2": 0.6, "w2-tp2": 0.8}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hyper_parallel.models.qwen3_5_moe_v2 import from_pretrained, save_pretrained
    from hyper_parallel.hf.storage import read_safetensors, write_safetensors
    from tests.torch.ut.models.qwen3_5_moe_v2.test_model import _hf_vl_model

    root = tmp_path_factory.mktemp("hf_sharded")
    src = root / "src"
    _hf_vl_model().save_pretrained(src)
    sd = read_safetensors(src)
    g = torch.Generator().manual_seed(3)
    sd["mtp.fc.weight"] = torch.randn(32, 64, generator=g)  # not modelled: passthrough
    sd["mtp.layers.0.input_layernorm.weight"] = torch.randn(32, generator=g)
    write_safetensors(sd, src, max_shard_size="100KB")
    assert len(list(src.glob("*.safetensors"))) > 2
    reference = root / "reference_export"
    save_pretrained(from_pretrained(src), reference, max_shard_size="60KB")
    folder_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    return src, reference, root / "out", folder_bytes


def test_fsdp_x_tp_load_and_export(pool, folders):
    """FSDP 2 x TP 2: FSDP shards the TP shards again (dim 0 twice)."""
    src, reference, out, folder_bytes = folders
    results = pool.run(sharded_load_export_job, 4, str(src), str(reference), str(out), [Layout(world=4, dp_shard=2, tp=2)])
    for rank, per_layout in enumerate(results):
        r = per_layout["w4-tp2"]
        assert r["differ"] == [], (rank, r["differ"][:5])
        assert r["read_bytes"] <= 0.5 * folder_bytes, (rank, r["read_bytes"], folder_bytes)
    assert results[0]["w4-tp2"]["files"] and results[0]["w4-tp2"]["files_differ"] == []


def test_sharded_load_and_export_equal_the_one_process_path(pool, folders):
    src, reference, out, folder_bytes = folders
    results = pool.run(sharded_load_export_job, 2, str(src), str(reference), str(out), LAYOUTS)
    for rank, per_layout in enumerate(results):
        for name, r in per_layout.items():
            assert r["differ"] == [], (rank, name, r["differ"][:5])
            assert r["passthrough_lazy"], (rank, name)
            assert r["read_bytes"] <= READ_LIMIT[name] * folder_bytes, (rank, name, r["read_bytes"], folder_bytes)
    by_name = results[0]
    assert any("experts.gate_up_proj" in k for k in by_name["w2-ep2"]["sharded"])
    assert any("in_proj_qkv" in k for k in by_name["w2-tp2"]["sharded"])  # DeltaNet rows split over TP
    for name, r in by_name.items():
        assert r["files"], name
        assert r["files_differ"] == [], (name, r["files_differ"])


def test_gather_to_reaches_the_destinations_only(pool):
    """The export's per-tensor gather (4 ranks): uneven, empty, replicated, 2-D (EP x FSDP), strided (FSDP over
    TP) and multi-stretch shards all arrive exactly on the destination ranks, each part received once at
    most; the other ranks get nothing and receive nothing."""
    results = pool.run(gather_job, 4)
    for rank, per_case in enumerate(results):
        bad = [case for case, ok in per_case.items() if not ok]
        assert not bad, (rank, bad)
    assert len(results[0]) == 8 * 3 + 3 * 3 + 1  # every case x destination set, the sub-mesh cases, the exchange
