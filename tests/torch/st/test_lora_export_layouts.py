"""The LoRA export of a sharded model (issue 32): under FSDP2, TP2 and EP2 (one 2-rank launch) ``Trainer.export_hf``
writes, from every rank, the same PEFT adapter folder (byte for byte the same tensors) and the same merged export
(within 1e-6: ``B A`` folded into each rank's own shard of ``W``) as one process with the same adapter values."""

from __future__ import annotations

import pytest

from tests.torch.st.lora_export_jobs import export_job, write_base

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exports(pool, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_export")
    folder = write_base(str(root / "base"))
    reference = pool.run(export_job, 1, ["one_process"], folder, str(root))[0]["one_process"]
    layouts = pool.run(export_job, 2, ["fsdp2", "tp2", "ep2"], folder, str(root), timeout=600.0)[0]
    return reference, layouts


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "ep2"])
def test_sharded_lora_export_equals_one_process(exports, layout):
    reference, layouts = exports
    got = layouts[layout]
    for form, tol in (("adapter", 0.0), ("merged", 1e-6)):
        want = reference[form]
        assert got[form].keys() == want.keys(), (form, sorted(got[form].keys() ^ want.keys())[:5])
        diff = max((got[form][k] - want[k]).abs().max().item() for k in want)
        print(f"{layout} {form}: {len(want)} tensors, max |diff| {diff:.2e}")
        assert diff <= tol, (layout, form, diff)
    assert any(k.endswith("experts.base_layer.lora_B.weight") for k in got["adapter"])
    assert "base_model.model.lm_head.weight" in got["adapter"]
