"""Multi-token prediction for the Qwen3.5-MoE vision-language model (``qwen3_vl_moe_v2``, text family
``qwen3_5_moe``): forward parity with the reference of ``models/qwen3_5_v2/test_mtp.py`` (vLLM ``qwen3_5_mtp.py``) on a
batch with two images, weights from an HF ``Qwen3_5MoeForConditionalGeneration`` folder plus ``mtp.*`` keys.

At a position whose next token is an image token the MTP input embedding is that token's merged visual
feature: vLLM's ``Qwen3_5MTP.embed_input_ids`` merges the multimodal embeddings into the draft's
``inputs_embeds`` exactly like the target, so the reference takes HF's own ``inputs_embeds`` (text embeddings
with the image features scattered in) and shifts them by one. Qwen3-VL-MoE has no MTP.
"""

from __future__ import annotations

import torch

from hyper_parallel.data.packing import add_mtp_targets
from hyper_parallel.models.qwen3_5_v2.model import qwen3_5_with_mtp
from hyper_parallel.hf import load_hf_weights
from hyper_parallel.models.qwen3_vl_moe_v2.state_dict import config_from_hf
from hyper_parallel.hf import read_safetensors, write_safetensors
from tests.torch.ut.models.qwen3_5_v2.test_mtp import _HFMtp
from tests.torch.ut.models.qwen3_vl_moe_v2.test_model import IMG, _qwen3_5_moe_hf, _two_images

TOL = 1e-5


def test_vl_mtp_forward_matches_reference_with_images(tmp_path):
    hf = _qwen3_5_moe_hf().eval()
    ref = _HFMtp(hf.config.text_config, moe=True, seed=5).eval()
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    sd = read_safetensors(folder)
    sd.update(ref.hf_keys())
    write_safetensors(sd, folder)
    config = qwen3_5_with_mtp(config_from_hf(hf.config.to_dict()))
    ours = config.build()
    ours.init_weights()
    load_hf_weights(ours, folder)
    ours.eval()
    assert not any(k.startswith("mtp.") for k in getattr(ours, "hf_passthrough", {}))

    ids, pixels, grid = _two_images()
    seen = {}
    lm = hf.model.language_model
    hooks = [
        lm.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True),
        lm.register_forward_hook(lambda m, a, kw, out: seen.update(h=out.last_hidden_state), with_kwargs=True),
    ]
    with torch.no_grad():
        hf_logits = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMG).int(),
                       use_cache=False).logits  # fmt: skip
        for h in hooks:
            h.remove()
        emb, h_last, pos = seen["inputs_embeds"], seen["h"], seen["position_ids"]
        pos = pos[1:] if pos.shape[0] == 4 else pos  # row 0 = text positions (masks only)
        e = emb[:, 1:]
        x = ref.fc(torch.cat([ref.pre_fc_norm_embedding(e), ref.pre_fc_norm_hidden(h_last[:, :-1])], dim=-1))
        p = pos[..., :-1]
        y = ref.layers[0](x, position_embeddings=lm.rotary_emb(x, p), attention_mask=None, position_ids=p)
        y = y[0] if isinstance(y, tuple) else y
        want = hf.lm_head(ref.norm(y))

        b = add_mtp_targets({"input_ids": ids, "labels": ids})
        out = ours(ids, pixel_values=pixels, image_grid_thw=grid, mtp_input_ids=b["mtp_input_ids"])
    assert (out.logits - hf_logits).abs().max().item() <= TOL
    err = (out.mtp_logits[:, :-1] - want).abs().max().item()
    assert err <= TOL, err
    # the positions before image tokens carry the visual features, not the placeholder's text embedding
    before_image = (ids[0, 1:] == IMG).nonzero().squeeze(-1)
    text_emb = hf.model.language_model.embed_tokens(ids[:, 1:])
    assert (e[0, before_image] - text_emb[0, before_image]).abs().max() > 1e-3
