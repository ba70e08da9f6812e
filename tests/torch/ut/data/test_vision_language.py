"""The `vision_language` source: images + text shards, image-token expansion, M-RoPE positions.

Batches do not depend on the DP degree or the workers and resume on another layout; every record
comes once per epoch; each bad input is an error naming shard and key or a counted skip; the pixels
in a batch equal ImageProcessor's; M-RoPE positions equal HF's Qwen3-VL ``get_rope_index``.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from hyper_parallel.data import BadSampleError, PresetDataLoader, first_difference, global_batches
from hyper_parallel.data.bad_samples import BadSample
from hyper_parallel.data.source_config import TextOptions
from hyper_parallel.data.text import cached_toy_text
from hyper_parallel.data.tokenizer import HuggingFaceTokenizer
from hyper_parallel.data.vision_language import (
    ImageProcessor,
    ToyVisionLanguageSpec,
    VisionLanguageDataLoader,
    VisionLanguageWriter,
    check_shards,
    make_encoder,
    make_toy_samples,
    mrope_position_ids,
    read_samples,
)
from hyper_parallel.data.vision_language.cli import main as vl_cli
from hyper_parallel.data.vision_language.toy import COLOURS

IMG, VS, VE = 512, 513, 514
FACTS = dict(vocab_size=520, image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE, patch_size=16,
             temporal_patch_size=2, merge_size=2)  # fmt: skip
IMAGE = ImageProcessor.Config(min_pixels=32 * 32, max_pixels=128 * 128)
GENERIC = {"input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_host", "max_seqlen", "token_mask"}
FACT_FLAGS = ["--image-token-id", "512", "--vision-start-token-id", "513", "--vision-end-token-id", "514",
              "--vocab-size", "520", "--min-pixels", str(32 * 32), "--max-pixels", str(128 * 128)]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """A cache with the toy text tokenizer and the default toy VL corpus (written on first use)."""
    return str(tmp_path_factory.mktemp("vl_cache"))


@pytest.fixture(scope="module")
def tok(cache) -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer.from_folder(cached_toy_text(cache).tokenizer_dir)


@pytest.fixture(scope="module")
def encoder(cache):
    return make_encoder(cached_toy_text(cache).tokenizer_dir, IMAGE, FACTS)


def _png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _cfg(cache, path="", **kw) -> VisionLanguageDataLoader.Config:
    kw = {"max_tokens_per_microbatch": 256, "global_batch_tokens": 4 * 256, "shuffle_buffer": 64, "seed": 1,
          "image": IMAGE, **kw}  # fmt: skip
    tokenizer = cached_toy_text(cache).tokenizer_dir if path else ""
    return VisionLanguageDataLoader.Config(path=path, cache_dir=cache, tokenizer=tokenizer, **kw)


@pytest.fixture(scope="module")
def numbered(tmp_path_factory, cache) -> str:
    """40 records in 3 shards, record i says "item i"; 0, 1 or 2 random images of varied sizes."""
    out = str(tmp_path_factory.mktemp("vl_numbered"))
    with VisionLanguageWriter(out, samples_per_shard=16) as w:
        for i in range(40):
            n = i % 3
            images = [_png(20 + 7 * ((i + j) % 11), 30 + 5 * ((2 * i + j) % 13), seed=100 * i + j) for j in range(n)]
            if i % 4 == 3:
                w.write(images, messages=[{"role": "user", "content": "<image>" * n + f"Look: item {i} here."},
                                          {"role": "assistant", "content": "Nice."}])  # fmt: skip
            else:
                w.write(images, text="<image>" * n + f"This is item {i} here.")
    return out


def _documents(mb: dict) -> list[tuple[np.ndarray, slice]]:
    ids, cu = mb["input_ids"].view(-1).numpy(), mb["cu_seqlens"].tolist()
    return [(ids[a:b], slice(a, b)) for a, b in zip(cu[:-1], cu[1:])]


def _item(tok, ids: np.ndarray) -> int:
    text = tok.decode([int(t) for t in ids if t < tok.vocab_size])
    return int(re.search(r"item (\d+) ", text).group(1))


# -- order, resume, coverage ------------------------------------------------------------------------
def test_toy_batches_are_layout_independent_and_well_formed(cache):
    ref = global_batches(_cfg(cache), model_facts=FACTS, steps=3)
    for dp, workers in [(2, 0), (2, 2), (4, 0)]:
        got = global_batches(_cfg(cache, num_workers=workers), model_facts=FACTS, steps=3, dp_world_size=dp)
        assert first_difference(got, ref) is None, (dp, workers, first_difference(got, ref))
    later = global_batches(_cfg(cache), model_facts=FACTS, steps=1, first_step=2, dp_world_size=2)
    assert first_difference(later, ref[2:]) is None
    other = global_batches(_cfg(cache, seed=2), model_facts=FACTS, steps=1)
    assert first_difference(other, ref[:1]) is not None  # the comparison can see a difference
    n_images = 0
    for mb in (mb for step in ref for mb in step):
        assert set(mb) == GENERIC | {"pixel_values", "image_grid_thw"}
        T = mb["input_ids"].shape[1]
        assert T <= 256 and mb["position_ids"].shape == (3, 1, T) and mb["labels"].shape == (1, T)
        grid = mb["image_grid_thw"]
        assert grid.dtype == torch.int64 and grid.shape[1] == 3 and bool((grid[:, 0] == 1).all())
        assert mb["pixel_values"].dtype == torch.float32 and mb["pixel_values"].shape == (int(grid.prod(1).sum()), 1536)
        ids = mb["input_ids"].view(-1)
        assert int((ids == IMG).sum()) == int(grid.prod(1).sum()) // 4  # t*h*w / merge^2 tokens per image
        assert int((ids == VS).sum()) == int((ids == VE).sum()) == grid.shape[0]
        n_images += grid.shape[0]
    assert n_images > 0


@pytest.mark.parametrize("dp, workers", [(1, 2), (4, 0)])
def test_resume_on_another_layout(numbered, cache, dp, workers):
    cfg = _cfg(cache, numbered, max_tokens_per_microbatch=128, global_batch_tokens=4 * 128, shuffle_buffer=8)
    reference = global_batches(cfg, model_facts=FACTS, steps=5)
    ranks = [cfg.build(dp_rank=r, dp_world_size=2, model_facts=FACTS) for r in range(2)]
    first = [[mb for loader in ranks for mb in loader.next_step()] for _ in range(2)]
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    cfg2 = _cfg(cache, numbered, max_tokens_per_microbatch=128, global_batch_tokens=4 * 128, shuffle_buffer=8,
                num_workers=workers)  # fmt: skip
    resumed = [cfg2.build(dp_rank=r, dp_world_size=dp, model_facts=FACTS) for r in range(dp)]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [[mb for loader in resumed for mb in loader.next_step()] for _ in range(3)]
    for loader in resumed:
        loader.close()
    assert first_difference(first + rest, reference) is None


def test_every_record_once_per_epoch(numbered, cache, tok):
    # next-fit packing emits documents in planning order, so the first 40 documents are epoch 0
    cfg = _cfg(cache, numbered, max_tokens_per_microbatch=128, global_batch_tokens=2 * 128, shuffle_buffer=8,
               packing_bins=1)  # fmt: skip
    loaders = [cfg.build(dp_rank=r, dp_world_size=2, model_facts=FACTS) for r in range(2)]
    items: list[int] = []
    while len(items) < 40:
        for mb in [mb for loader in loaders for mb in loader.next_step()]:
            for ids, _ in _documents(mb):
                items.append(_item(tok, ids))
                assert int((ids == VS).sum()) == items[-1] % 3  # its own images came with it
    assert sorted(items[:40]) == list(range(40))
    assert items[:40] != list(range(40))  # shuffled


# -- tokens, labels, pixels, positions ---------------------------------------------------------------
def test_expansion_labels_and_index_lengths(numbered, encoder, tok):
    spec = encoder.index_spec()
    for rec in read_samples(numbered):
        key, files = rec["key"], rec["files"]
        doc = encoder.document(key, rec["shard"], files, loss_on="all")  # every text target (chats: see test_chat_data)
        assert spec.stats(key, files)["length"] == len(doc)  # the plan's length is the decoded length
        ids, labels = doc.input_ids, doc.labels
        grids = doc.image_grid_thw.tolist()
        starts, ends = np.flatnonzero(ids == VS), np.flatnonzero(ids == VE)
        assert [e - s - 1 for s, e in zip(starts, ends)] == [t * h * w // 4 for t, h, w in grids]
        assert all(bool((ids[s + 1 : e] == IMG).all()) for s, e in zip(starts, ends))
        assert int((ids == IMG).sum()) == sum(t * h * w // 4 for t, h, w in grids)
        expect = np.where(np.isin(ids[1:], [IMG, VS, VE]), -100, ids[1:])
        assert labels[:-1].tolist() == expect.tolist() and labels[-1] == -100
        text = json.loads(files["json"])
        rendered = text["text"] if "text" in text else tok.apply_chat_template(text["messages"])
        plain = tok.decode([int(t) for t in ids if t not in (IMG, VS, VE)])
        if "text" in text:  # bos + text + eos
            assert plain == "<s>" + rendered.replace("<image>", "") + "</s>"
        else:  # exactly the rendered chat
            assert plain == rendered.replace("<image>", "")


def test_pixels_in_batches_equal_image_processor(numbered, cache, tok):
    images = {}  # item number -> its encoded images in order
    for rec in read_samples(numbered):
        item = int(re.search(r"item (\d+) ", rec["files"]["json"].decode()).group(1))
        members = sorted((m for m in rec["files"] if m.endswith("png")), key=lambda m: m.split(".")[0])
        images[item] = [rec["files"][m] for m in members]
    processor = IMAGE.build(patch_size=16, temporal_patch_size=2, merge_size=2)
    cfg = _cfg(cache, numbered, max_tokens_per_microbatch=128, global_batch_tokens=128, shuffle_buffer=8)
    for mb in cfg.build(model_facts=FACTS).next_step() + cfg.build(model_facts=FACTS).next_step():
        blobs = [b for ids, _ in _documents(mb) for b in images[_item(tok, ids)]]
        ref = processor(blobs)
        assert torch.equal(mb["pixel_values"], ref.pixel_values)
        assert torch.equal(mb["image_grid_thw"], ref.image_grid_thw)


def _hf_rope_model():
    from transformers import Qwen3VLMoeConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

    cfg = Qwen3VLMoeConfig(
        text_config=dict(vocab_size=520, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, intermediate_size=16, num_experts=2,
                         num_experts_per_tok=1, moe_intermediate_size=8,
                         rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[2, 1, 1],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=16,
                           num_position_embeddings=16, deepstack_visual_indexes=[]),
        image_token_id=IMG, video_token_id=515, vision_start_token_id=VS, vision_end_token_id=VE,
    )  # fmt: skip
    return Qwen3VLMoeModel(cfg)


def _hf_positions(model, ids: np.ndarray, grids) -> np.ndarray:
    input_ids = torch.from_numpy(np.asarray(ids, dtype=np.int64)).view(1, -1)
    grid = torch.tensor(grids, dtype=torch.int64).view(-1, 3) if len(grids) else None
    pos, _ = model.get_rope_index(input_ids, (input_ids == IMG).int(), image_grid_thw=grid)
    return pos[:, 0].numpy()


def test_mrope_positions_equal_hf_get_rope_index(numbered, cache):
    model = _hf_rope_model()

    def doc(*parts):
        ids = []
        for p in parts:
            ids += [7, 8, 9][:p] if isinstance(p, int) else [VS] + [IMG] * (p[0] * p[1] * p[2] // 4) + [VE]
        return np.array(ids)

    cases = [
        (doc(3, 2), []),  # text only
        (doc(2, (1, 4, 6), 3), [(1, 4, 6)]),  # one wide image
        (doc(1, (1, 6, 2), 2, (1, 4, 4), 1), [(1, 6, 2), (1, 4, 4)]),  # two images of different grids
        (doc((1, 8, 2), (2, 2, 4), 3), [(1, 8, 2), (2, 2, 4)]),  # back to back, and two frames
    ]
    for ids, grids in cases:
        ours = mrope_position_ids(ids, np.array(grids).reshape(-1, 3), image_token_id=IMG, merge_size=2)
        np.testing.assert_array_equal(ours, _hf_positions(model, ids, grids))
    with pytest.raises(ValueError, match="does not match grid"):
        mrope_position_ids(doc(1, (1, 4, 4)), np.array([[1, 4, 6]]), image_token_id=IMG, merge_size=2)
    # Packed loader rows: every document's positions are HF's for that document alone.
    cfg = _cfg(cache, numbered, max_tokens_per_microbatch=128, global_batch_tokens=128, shuffle_buffer=8,
               pad_to_multiple_of=16)  # fmt: skip
    loader = cfg.build(model_facts=FACTS)
    checked = 0
    for mb in loader.next_step() + loader.next_step():
        pos, grid = mb["position_ids"][:, 0].numpy(), mb["image_grid_thw"].tolist()
        for ids, span in _documents(mb):
            n = int((ids == VS).sum())
            if int(mb["labels"].view(-1)[span].ne(-100).sum()) == 0 and not n:  # the padding run
                np.testing.assert_array_equal(pos[:, span], np.tile(np.arange(len(ids)), (3, 1)))
                continue
            np.testing.assert_array_equal(pos[:, span], _hf_positions(model, ids, grid[:n]))
            grid = grid[n:]
            checked += n > 0
    assert checked >= 2


# -- bad input ------------------------------------------------------------------------------------------
def _truncated_png() -> bytes:
    data = _png(40, 40, 3)
    return data[: len(data) // 2]


BAD = {
    "undecodable": ({"jpg": b"definitely not a jpeg"}, {"text": "<image>bad"}),
    "empty_image": ({"png": b""}, {"text": "<image>bad"}),
    "count_mismatch": ({"png": _png(30, 30, 1)}, {"text": "<image><image>bad"}),
    "too_many_pixels": ({"png": _png(120, 120, 2)}, {"text": "<image>bad"}),
    "missing_text": ({"png": _png(30, 30, 1)}, {"caption": "<image>bad"}),
    "bad_image_names": ({"0.png": _png(30, 30, 1), "2.png": _png(30, 30, 2)}, {"text": "<image><image>bad"}),
    "bad_metadata": ({}, {"messages": "not a list"}),
    "empty": ({}, {"text": "   "}),
    "too_long": ({"png": _png(30, 30, 4)}, {"text": "<image>" + "bad " * 200}),
}


def _corpus_with(tmp_path, images: dict, meta: dict) -> str:
    out = str(tmp_path / "shards")
    with VisionLanguageWriter(out, samples_per_shard=4, validate=False) as w:
        for i in range(3):
            w.write([_png(30, 30, 10 + i)], text=f"<image>good item {i} here.")
        w.write_files({"json": json.dumps(meta).encode(), **images}, key="badkey")
    return out


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_is_an_error_naming_shard_and_key_or_a_counted_skip(tmp_path, cache, kind):
    path = _corpus_with(tmp_path, *BAD[kind])
    kw = dict(image=ImageProcessor.Config(min_pixels=32 * 32, max_pixels=128 * 128, max_input_pixels=100 * 100),
              max_tokens_per_microbatch=128, global_batch_tokens=0)  # fmt: skip
    cfg = _cfg(cache, path, **kw)
    with pytest.raises(BadSampleError, match=rf"shard '.*train-000000\.tar', key 'badkey': .*\[{kind}\]"):
        cfg.build(model_facts=FACTS)
    loader = _cfg(cache, path, on_bad_sample="skip", **kw).build(model_facts=FACTS)
    loader.next_step()
    assert loader.bad_sample_counts == {kind: 1} and loader.metrics()["bad_samples_skipped"] == 1.0
    report = check_shards(path, make_encoder(cached_toy_text(cache).tokenizer_dir, kw["image"], FACTS),
                          max_tokens=kw["max_tokens_per_microbatch"])  # fmt: skip
    assert report["bad"] == {kind: 1} and report["samples"] == 3


def test_broken_image_body_stops_with_a_pointer_to_check(tmp_path, cache):
    path = _corpus_with(tmp_path, {"png": _truncated_png()}, {"text": "<image>bad"})
    loader = _cfg(cache, path, on_bad_sample="skip", global_batch_tokens=0, max_tokens_per_microbatch=512).build(
        model_facts=FACTS
    )  # the header is fine: the index cannot see it
    with pytest.raises(BadSampleError, match=r"key 'badkey': image 'badkey\.png' cannot be decoded.*check --path"):
        loader.next_step()
    assert vl_cli(["check", "--path", path, "--max-tokens", "512", "--tokenizer", cached_toy_text(cache).tokenizer_dir,
                   *FACT_FLAGS]) == 1  # fmt: skip


def test_reserved_ids_in_text_and_bad_model_facts(tmp_path, cache, tok):
    folder = cached_toy_text(cache).tokenizer_dir
    # ids inside the tokenizer's range must be its special tokens; then text that spells them is a bad sample
    enc = make_encoder(folder, IMAGE, {**FACTS, "image_token_id": 3, "vision_start_token_id": 4})
    files = {"json": json.dumps({"text": "hi <|im_start|> there"}).encode()}
    with pytest.raises(BadSample, match=r"tokenises to \[3\]") as e:
        enc.parse("k", files)
    assert e.value.kind == "reserved_token"
    with pytest.raises(ValueError, match=r"image_token_id=300 is an ordinary token"):
        make_encoder(folder, IMAGE, {**FACTS, "image_token_id": 300})
    with pytest.raises(ValueError, match="needs the model fact 'merge_size'"):
        _cfg(cache).build(model_facts={k: v for k, v in FACTS.items() if k != "merge_size"})
    with pytest.raises(ValueError, match="three different ids"):
        _cfg(cache).build(model_facts={**FACTS, "vision_end_token_id": VS})
    with pytest.raises(ValueError, match="produces ids up to 511"):
        _cfg(cache).build(model_facts={**FACTS, "vocab_size": 500})
    with pytest.raises(ValueError, match="set data.tokenizer"):
        VisionLanguageDataLoader.Config(path=str(tmp_path), cache_dir=cache).build(model_facts=FACTS)
    with pytest.raises(ValueError, match="split_long_documents is for text"):
        _cfg(cache, text=TextOptions(split_long_documents=True)).build(model_facts=FACTS)


# -- toy corpus, writer CLI, preset replay --------------------------------------------------------------
def test_toy_pictures_show_what_their_captions_say():
    samples = make_toy_samples(ToyVisionLanguageSpec(num_samples=40))
    counts = {n: sum(len(s["images"]) == n for s in samples) for n in (0, 1, 2)}
    assert counts[1] > 0 and counts[2] > 0 and any("messages" in s for s in samples)
    for s in samples:
        caption = s["text"] if "text" in s else s["messages"][-1]["content"]
        found = re.findall(r"an? (\w+) (circle|square|triangle|cross) on an? (\w+) background", caption, re.I)
        assert len(found) == max(1, len(s["images"]))
        for (fmt, image), (fg, _, bg) in zip(s["images"], found):
            assert 28 <= image.width <= 96 and 28 <= image.height <= 96
            assert {c for _, c in image.getcolors()} == {COLOURS[fg], COLOURS[bg]}  # exactly the two named colours


def test_cli_write_toy_index_check_and_preset_replay(tmp_path, cache):
    folder = cached_toy_text(cache).tokenizer_dir
    flags = ["--tokenizer", folder, *FACT_FLAGS]
    (tmp_path / "a.png").write_bytes(_png(50, 33, 1))
    (tmp_path / "b.png").write_bytes(_png(33, 70, 2))
    rows = [{"images": ["a.png"], "text": "<image>one item 0 here."},
            {"images": ["a.png", "b.png"], "messages": [{"role": "user", "content": "<image><image>item 1 here"}]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "written")
    assert vl_cli(["write", "--input", str(tmp_path / "in.jsonl"), "--output-dir", out, *flags]) == 0
    assert (tmp_path / "written" / "train-000000.tar.idx.npz").is_file()  # with the facts: the index side file
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text(json.dumps({"images": ["a.png"], "text": "no marker"}) + "\n")
    assert vl_cli(["write", "--input", str(bad_rows), "--output-dir", str(tmp_path / "bad"), *flags]) == 2
    toy = str(tmp_path / "toy")
    assert vl_cli(["toy", "--output-dir", toy, "--num-samples", "24"]) == 0
    assert not (tmp_path / "toy" / "toy-000000.tar.idx.npz").exists()  # no facts: no index
    assert vl_cli(["index", "--path", toy, *flags]) == 0
    assert vl_cli(["toy", "--output-dir", str(tmp_path / "toy2"), "--num-samples", "24", *flags]) == 0
    with np.load(tmp_path / "toy" / "toy-000000.tar.idx.npz") as a, np.load(tmp_path / "toy2" / "toy-000000.tar.idx.npz") as b:
        assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)  # toy + facts: the same index
    assert vl_cli(["check", "--path", toy, "--max-tokens", "256", *flags]) == 0
    fresh = str(tmp_path / "fresh_cache")
    loader = VisionLanguageDataLoader.Config(path=toy, tokenizer=folder, cache_dir=fresh, image=IMAGE,
                                             max_tokens_per_microbatch=256).build(model_facts=FACTS)  # fmt: skip
    assert not (tmp_path / "fresh_cache" / "shard_index").exists()  # the side files written by `index` were used
    batches = loader.next_step() + loader.next_step()
    torch.save(batches, tmp_path / "vl.pt")
    replay = PresetDataLoader.Config(source="preset_pt", path=str(tmp_path / "vl.pt")).build(model_facts=FACTS)
    assert first_difference([replay.next_step()], [batches[:1]]) is None
    broken = [dict(batches[0], image_grid_thw=batches[0]["image_grid_thw"] * 2)]
    torch.save(broken, tmp_path / "broken.pt")
    with pytest.raises(ValueError, match="pixel_values has .* rows but image_grid_thw covers"):
        PresetDataLoader.Config(source="preset_pt", path=str(tmp_path / "broken.pt")).build(model_facts=FACTS)
