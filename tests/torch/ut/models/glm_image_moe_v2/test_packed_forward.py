"""Packed forward of GlmImageMoe on a DirectToken micro-batch equals the per-document forward."""

import torch

from hyper_parallel.data import SampleSpec, ToyCorpusSpec, collate_direct_token, make_sample, make_toy_samples
from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug


def _model():
    torch.manual_seed(0)
    cfg = glm_image_moe_debug().model
    model = cfg.build()
    model.init_weights()
    return model.eval(), cfg


def _samples(cfg, n=4):
    corpus = make_toy_samples(
        ToyCorpusSpec(lang_vocab_size=cfg.vocab_size, codebook_size=cfg.codebook_size,
                      placeholder_token_id=cfg.placeholder_token_id, num_samples=n, two_image_fraction=0.5)
    )  # fmt: skip
    spec = SampleSpec(cfg.vocab_size, cfg.codebook_size, cfg.placeholder_token_id, 4096)
    return [
        make_sample(d["key"], "mem", d["tokens"], d["vq_codes"], {"image_grids": d["image_grids"]}, spec)
        for d in corpus
    ]


def _forward(model, batch):
    return model(
        batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"],
        max_seqlen=batch["max_seqlen"], visual_indices=batch["visual_indices"], vq_codes=batch["vq_codes"],
    )  # fmt: skip


@torch.no_grad()
def test_packed_forward_equals_per_document_forward():
    model, cfg = _model()
    samples = _samples(cfg)
    assert sum(len(s.vq_codes) > 0 for s in samples) >= 2  # the test exercises the image path
    packed = collate_direct_token(samples, pad_to_multiple_of=64)
    logits = _forward(model, packed)[0]
    offset, worst = 0, 0.0
    for s in samples:
        alone = collate_direct_token([s])
        ref = _forward(model, alone)[0]
        worst = max(worst, (logits[offset : offset + len(s)] - ref).abs().max().item())
        offset += len(s)
    assert worst <= 1e-5, worst
    # attention across documents would change the later documents: make sure the test can see it
    no_docs = model(packed["input_ids"], vq_codes=packed["vq_codes"], visual_indices=packed["visual_indices"])[0]
    assert (no_docs[: offset] - logits[: offset]).abs().max() > 1e-3


def test_packed_labels_train_image_rows():
    """Every labelled position predicts exactly the next token of its own document; the target of a
    position followed by an image token is that token's code + lang_vocab_size, never masked."""
    _, cfg = _model()
    samples = _samples(cfg)
    batch = collate_direct_token(samples)
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    code_at = torch.full_like(ids, -1)
    code_at[batch["visual_indices"]] = batch["vq_codes"]
    assert bool((ids[batch["visual_indices"]] == cfg.placeholder_token_id).all())
    n_image_targets = 0
    cu = batch["cu_seqlens"].tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        assert labels[end - 1] == -100  # the last position of a document predicts nothing
        for t in range(start, end - 1):
            nxt = ids[t + 1].item()
            expected = code_at[t + 1].item() + cfg.vocab_size if nxt == cfg.placeholder_token_id else nxt
            if nxt == cfg.placeholder_token_id:
                assert labels[t].item() == expected, (t, labels[t].item(), expected)
                n_image_targets += 1
            else:  # text targets may be masked (loss_on: image), never wrong
                assert labels[t].item() in (-100, expected), (t, labels[t].item(), expected)
    assert n_image_targets > 0
