"""The GLM-4.7-Flash nextn layer kept as passthrough (MTP off) under a sharded export (issue 26): a GlmImageMoe
folder with a nextn layer (several safetensors files) loaded into FSDP2 on 2 gloo ranks keeps the layer's keys
as lazy references on every rank, and the export from both ranks equals the one-process export file by file,
bit for bit: the nextn keys are in it, byte-identical to the folder's."""

from __future__ import annotations

import pytest
import torch

from tests.torch.st.glm_jobs import Layout
from tests.torch.st.glm_nextn_jobs import nextn_passthrough_export_job

pytestmark = pytest.mark.slow


def test_fsdp_export_writes_the_kept_nextn_layer(pool, tmp_path):
    from hyper_parallel.models.glm_image_moe_v2 import from_pretrained, save_pretrained
    from hyper_parallel.hf.storage import read_safetensors, write_safetensors
    from tests.torch.ut.models.glm_image_moe_v2.test_mtp_passthrough import IMAGE_PART, _nextn_folder

    flash, nextn = _nextn_folder(tmp_path)
    torch.manual_seed(0)
    src = tmp_path / "src"  # GlmImageMoe format, the nextn layer under model.language_model., several files
    save_pretrained(from_pretrained(flash, **IMAGE_PART), src)
    write_safetensors(read_safetensors(src), src, max_shard_size="100KB")
    assert len(list(src.glob("*.safetensors"))) > 2
    reference = tmp_path / "reference_export"
    save_pretrained(from_pretrained(src), reference, max_shard_size="60KB")
    want = sorted("model.language_model." + k[len("model.") :] for k in nextn)
    disk = read_safetensors(reference)
    for key in want:  # the one-process export holds the folder's nextn layer unchanged
        assert torch.equal(disk[key], nextn["model." + key[len("model.language_model.") :]]), key

    layout = Layout(world=2)
    results = pool.run(nextn_passthrough_export_job, 2, str(src), str(reference), str(tmp_path / "out"), layout)
    for rank, r in enumerate(results):
        assert r["kept"] == want and r["lazy"], (rank, r["kept"][:3])
    assert results[0]["files"] and results[0]["files_differ"] == [], results[0]["files_differ"]
