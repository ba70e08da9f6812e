"""The image path's input checks: ``visual_indices`` must be exactly the placeholder positions, strictly
increasing (order and uniqueness enforced, as the error promises), and all checks cost one host sync."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.models.glm_image_moe_v2.config_registry import glm_image_moe_debug


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = glm_image_moe_debug().model.build()
    m.init_weights()
    return m


def _inputs(model):
    ids = torch.randint(0, 100, (2, 12))
    ids[0, 3:5] = model.config.placeholder_token_id
    ids[1, 7] = model.config.placeholder_token_id
    positions = (ids.reshape(-1) == model.config.placeholder_token_id).nonzero().squeeze(-1)
    codes = torch.tensor([3, 9, 4])
    return ids, positions, codes


def test_matching_visual_indices_equal_the_default(model):
    ids, positions, codes = _inputs(model)
    torch.testing.assert_close(model.embed(ids, visual_indices=positions, vq_codes=codes), model.embed(ids, vq_codes=codes))


@pytest.mark.parametrize(
    "bad",
    [
        lambda p: p.flip(0),  # every placeholder, wrong order
        lambda p: torch.stack([p[0], p[0], p[2]]),  # a repeated position
        lambda p: torch.stack([p[0], p[1], p[2] + 1]),  # a text position
        lambda p: torch.stack([p[0], p[1], torch.tensor(10_000)]),  # out of range
        lambda p: p[:2],  # too few
    ],
    ids=["reordered", "repeated", "text_position", "out_of_range", "too_few"],
)
def test_visual_indices_must_be_the_placeholders_in_order(model, bad):
    ids, positions, codes = _inputs(model)
    with pytest.raises(ValueError, match="visual_indices"):
        model.embed(ids, visual_indices=bad(positions), vq_codes=codes)


def test_image_path_checks_sync_with_the_host_once(model, monkeypatch):
    """Counts, code range and index order are read back together (one ``tolist``), not four syncs."""
    ids, positions, codes = _inputs(model)
    calls = {"tolist": 0, "item": 0, "int": 0, "bool": 0}

    def counting(name, fn):
        def wrapped(self, *args, **kwargs):
            calls[name] += 1
            return fn(self, *args, **kwargs)

        return wrapped

    for name, attr in (("tolist", "tolist"), ("item", "item"), ("int", "__int__"), ("bool", "__bool__")):
        monkeypatch.setattr(torch.Tensor, attr, counting(name, getattr(torch.Tensor, attr)))
    model.embed(ids, visual_indices=positions, vq_codes=codes)
    assert calls == {"tolist": 1, "item": 0, "int": 0, "bool": 0}, calls
