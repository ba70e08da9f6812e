"""A DCP checkpoint written under one layout resumes under another; the Trainer runs 8 ranks on DirectToken data."""

from __future__ import annotations

import math

import pytest

from hyper_parallel.data.direct_token.toy_corpus import ToyCorpusSpec, write_toy_corpus
from tests.torch.st.glm_jobs import Layout, dcp_load_job, dcp_save_job, reference_job, trainer_job

pytestmark = pytest.mark.slow


def test_dcp_checkpoint_moves_across_layouts(pool, tmp_path):
    """Save model + AdamW state after 3 steps under FSDP 4, load under TP 2 x FSDP 2 (meta init), continue."""
    ckpt = str(tmp_path / "ckpt")
    reference = pool.run(reference_job, 1, 5)[0]
    saved = pool.run(dcp_save_job, 4, Layout(world=4), 3, ckpt)[0]
    resumed = pool.run(dcp_load_job, 4, Layout(world=4, tp=2), 3, 2, ckpt)[0]
    print(f"\nsaved {saved['losses']}\nresumed {resumed['losses']}\nreference {reference['losses']}")
    assert max(abs(a - b) for a, b in zip(saved["losses"], reference["losses"][:3])) <= 1e-5
    # The next loss after loading (a forward with the loaded weights), then one more step (loaded AdamW state).
    assert abs(resumed["losses"][0] - reference["losses"][3]) <= 1e-5
    assert abs(resumed["losses"][1] - reference["losses"][4]) <= 1e-5


def test_trainer_eight_ranks_direct_token(pool, tmp_path):
    """The debug recipe through the Trainer on 8 gloo ranks (HSDP 2 x FSDP 2 x TP 2): finite, falling loss."""
    from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug

    model = glm_image_moe_debug().model
    spec = ToyCorpusSpec(
        lang_vocab_size=model.vocab_size,
        codebook_size=model.codebook_size,
        placeholder_token_id=model.placeholder_token_id,
        num_samples=512,
        samples_per_shard=64,
    )
    data = tmp_path / "shards"
    write_toy_corpus(str(data), spec)
    parallelism = dict(data_parallel_replicate_degree=2, data_parallel_shard_degree=2, tensor_parallel_degree=2)
    out = pool.run(trainer_job, 8, parallelism, 12, str(tmp_path / "run"), str(data))[0]
    losses = out["losses"]
    print(f"\n{out['parallel_dims']}: losses {[round(x, 3) for x in losses]}")
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1  # it learns
    assert out["codebook_is_plain"] and out["codebook_identical"]
