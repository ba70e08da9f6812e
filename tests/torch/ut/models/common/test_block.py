"""FeedForward, TransformerBlock and Decoder vs HF Glm4MoeLite (transformers 5.24.0) in fp32, plus config/FQN checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
    Glm4MoeLiteDecoderLayer,
    Glm4MoeLiteForCausalLM,
    Glm4MoeLiteMLP,
    Glm4MoeLiteRotaryEmbedding,
)

from hyper_parallel.models.common.block import TransformerBlock
from hyper_parallel.models.common.decoder import Decoder
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.models.common.gqa import GQAttention
from hyper_parallel.models.common.rope import RoPE
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.protocols.module import Module
from tests.torch.ut.hf_utils import (
    assert_backward_parity,
    block_config_from_hf,
    decoder_config_from_hf,
    load_from_hf_,
    max_grad_diff,
    mlp_config_from_hf,
    randomize_,
    tiny_lite_config,
)

TOL = 1e-5


def _x(B: int = 2, T: int = 10, D: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def test_dense_mlp_matches_hf():
    cfg = tiny_lite_config()
    hf = randomize_(Glm4MoeLiteMLP(cfg), seed=2)
    ours = load_from_hf_(mlp_config_from_hf(cfg).build(dim=cfg.hidden_size), hf)
    x_hf, x_ours = _x().requires_grad_(), _x().requires_grad_()
    out_hf, out = hf(x_hf), ours(x_ours)
    assert_backward_parity(out, out_hf, ours, hf, x_ours, x_hf, TOL)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["dense", "sparse"])
def test_decoder_layer_matches_hf(layer_idx):
    cfg = tiny_lite_config()
    torch.manual_seed(0)
    hf = randomize_(Glm4MoeLiteDecoderLayer(cfg, layer_idx), seed=4)
    ours = load_from_hf_(block_config_from_hf(cfg, layer_idx).build(dim=cfg.hidden_size), hf)
    assert isinstance(ours.mlp, MoE) == (cfg.mlp_layer_types[layer_idx] == "sparse")

    x = _x(T=12)
    pos = torch.arange(12).expand(2, 12)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf = hf(x_hf, attention_mask=None, position_embeddings=Glm4MoeLiteRotaryEmbedding(cfg)(x, pos))
    out = ours(x_ours, position_ids=pos)
    assert_backward_parity(out, out_hf, ours, hf, x_ours, x_hf, TOL)


def _hf_and_ours(**overrides) -> tuple[Glm4MoeLiteForCausalLM, Decoder]:
    cfg = tiny_lite_config(**overrides)
    torch.manual_seed(0)
    hf = randomize_(Glm4MoeLiteForCausalLM(cfg), seed=6)
    ours = load_from_hf_(decoder_config_from_hf(cfg).build(), hf, strip="model.")
    return hf, ours


def test_decoder_logits_and_grads_match_hf():
    hf, ours = _hf_and_ours()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    logits_hf = hf(input_ids=ids, use_cache=False).logits
    logits = ours(ids)
    assert logits.shape == (2, 12, 256)
    assert (logits - logits_hf).abs().max().item() <= TOL
    # Gradients of the training loss (token-mean cross entropy), as a training step sees them.
    labels = ids.roll(-1, dims=1)
    F.cross_entropy(logits_hf.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    assert max_grad_diff(ours, hf, strip="model.") <= TOL


def test_decoder_config_fqns_equal_module_fqns():
    cfg = tiny_lite_config()
    dcfg = decoder_config_from_hf(cfg)
    with torch.device("meta"):
        model = dcfg.build()
    config_fqns = {fqn for fqn, *_ in dcfg.traverse(Module.Config) if fqn}
    module_fqns = {name for name, m in model.named_modules() if name and isinstance(m, Module)}
    assert config_fqns == module_fqns
    # every parameter lives under a configured module
    for name, _ in model.named_parameters():
        assert name.rsplit(".", 1)[0] in config_fqns, name
    assert {k.removeprefix("model.") for k in Glm4MoeLiteForCausalLM(cfg).state_dict()} == set(model.state_dict())


def test_decoder_meta_build_then_init_weights():
    cfg = tiny_lite_config()
    dcfg = decoder_config_from_hf(cfg)
    with torch.device("meta"):
        model = dcfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    rope = dcfg.layers[0].self_attn.rope
    assert torch.equal(model.layers[0].self_attn.rope.inv_freq, rope.build(head_dim=8).inv_freq)
    assert torch.all(model.norm.weight == 1) and torch.all(model.layers[0].self_attn.kv_a_layernorm.weight == 1)
    assert model.layers[0].self_attn.q_a_proj.weight.std().item() == pytest.approx(0.02, rel=0.2)
    assert model(torch.zeros(1, 4, dtype=torch.long)).isfinite().all()


def test_decoder_nparams_and_flops():
    cfg = tiny_lite_config()
    with torch.device("meta"):
        model = decoder_config_from_hf(cfg).build()
    total, flops = model.get_nparams_and_flops(seq_len=128)
    assert total == sum(p.numel() for p in Glm4MoeLiteForCausalLM(cfg).parameters())
    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    experts = sum(p.numel() for moe in moes for p in moe.experts.parameters())
    active = total - 256 * 64 - experts * (1 - 2 / 4)  # top-2 of 4 experts
    attention = 3 * 6 * 4 * (24 + 16) * (128 + 1) / 2  # 3 layers, causal: 6 (d_qk + d_v) per pair, L(L+1)/2 pairs
    assert flops == pytest.approx(6 * active + attention)


def test_decoder_layers_may_use_different_mixers_and_rope_dims():
    """RoPE is per mixer: an MLA layer with another rotary dim and a GQA layer sit in one decoder."""
    cfg = tiny_lite_config()
    dcfg = decoder_config_from_hf(cfg)
    dcfg.layers.append(block_config_from_hf(tiny_lite_config(qk_rope_head_dim=4), 0))
    gqa = GQAttention.Config(n_heads=4, n_kv_heads=2, head_dim=16, rope=RoPE.Config(theta=1e6, layout="half"))
    dcfg.layers.append(TransformerBlock.Config(self_attn=gqa, mlp=FeedForward.Config(hidden_dim=32)))
    torch.manual_seed(0)
    model = dcfg.build()
    model.init_weights()
    assert model.layers[-2].self_attn.rope.inv_freq.numel() == 2 and model.layers[-1].self_attn.rope.inv_freq.numel() == 8
    x = torch.randn(1, 6, cfg.hidden_size)
    h, aux = model.forward_layers(x)
    assert aux is None and h.isfinite().all()
    # each mixer rotates with its own table: the GQA layer's theta changes its output
    pos = torch.arange(6)[None]
    other_cfg = GQAttention.Config(n_heads=4, n_kv_heads=2, head_dim=16, rope=RoPE.Config(theta=1e4, layout="half"))
    other = other_cfg.build(dim=cfg.hidden_size)
    other.load_state_dict(model.layers[-1].self_attn.state_dict())
    y = model.layers[-1].self_attn(x, position_ids=pos)
    assert not torch.allclose(y, other(x, position_ids=pos))



def test_decoder_layer_fields_are_off_the_cli_but_a_run_file_reaches_them():
    """The per-layer tree is not on the command line (tyro neither lists nor walks it, and keeps the recipe's tree
    as it is); a run file (``apply_overrides``) reaches every layer field, with the recipe's concrete classes."""
    import warnings

    import tyro

    from hyper_parallel.config.manager import apply_overrides

    dcfg = decoder_config_from_hf(tiny_lite_config())

    def cli(*args: str) -> Decoder.Config:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tyro.cli(Decoder.Config, default=dcfg, args=list(args), use_underscores=True,
                            config=(tyro.conf.FlagConversionOff, tyro.conf.AvoidSubcommands))  # fmt: skip

    assert cli("--rope_theta", "5e5").to_dict() != dcfg.to_dict() and cli().to_dict() == dcfg.to_dict()
    with pytest.raises(SystemExit):
        cli("--layers.0.self_attn.rope.theta", "5e5")
    layers = {"0": {"self_attn": {"rope": {"theta": 5e5}}}, "2": {"mlp": {"gate": {"top_k": 1}}}}
    out = apply_overrides(dcfg, {"layers": layers})
    assert out.layers[0].self_attn.rope.theta == 5e5 and out.layers[1].self_attn.rope.theta != 5e5
    assert out.layers[2].mlp.gate.top_k == 1 and out.layers[2].self_attn == dcfg.layers[2].self_attn
    assert dcfg.layers[0].self_attn.rope.theta != 5e5  # a copy
    with torch.device("meta"):
        model = out.build()
    assert model.layers[2].mlp.gate.config.top_k == 1
