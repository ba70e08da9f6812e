"""Model-level options (``Decoder.Config``: rope_theta, rms_norm_eps, router_aux_loss_coef, use_mtp,
mtp_loss_weight, freeze) and a ``--help`` a person can read (issue 31).

The eps oracle is transformers: its model, built from the family's HF config with ``rms_norm_eps`` set, says
which norms that field reaches (and which it does not: GLM's q_a/kv_a norms); every norm of ours must carry
the eps of HF's norm of the same name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import io
from functools import cache

import pytest
import torch

from hyper_parallel.config.manager import ConfigError, ConfigManager, apply_overrides, resolve_recipe
from hyper_parallel.models.common.decoder import MODEL_OPTIONS
from hyper_parallel.models.common.moe import MoE
from hyper_parallel.models.common.rope import RoPE
from tests.torch.helpers import build_on_meta

EPS = 1e-3  # no recipe uses it, and it differs from every fixed eps


@cache
def _parse(*args: str):
    module, recipe, *rest = args
    return ConfigManager().parse_args(["--module", module, "--config", recipe, *rest]).model


def _norm_eps(model) -> dict[str, float]:
    """Our text norms (any module whose config has an ``eps``; not the vision tower's) -> eps."""
    return {
        name: m.config.eps
        for name, m in model.named_modules()
        if hasattr(getattr(m, "config", None), "eps") and not name.startswith("visual.")
    }


def _hf_norm_eps(hf_model) -> dict[str, float]:
    """HF's RMSNorms of the text model -> eps, named like ours (``linear_attn`` is our ``self_attn``)."""
    out = {}
    for name, m in hf_model.named_modules():
        if "RMSNorm" not in type(m).__name__ or ".visual." in f".{name}.":
            continue
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
        for prefix in ("model.language_model.", "model."):
            name = name.removeprefix(prefix)
        out[name.replace(".linear_attn.", ".self_attn.")] = eps
    return out


def _hf_model(family: str, model_cfg):
    """transformers' model (meta device) built from the family's HF config of ``model_cfg`` with rms_norm_eps=EPS."""
    import transformers

    if family == "glm":
        from hyper_parallel.models.glm_image_moe_v2.hf_config import config_to_hf

        d = config_to_hf(model_cfg, text_only=True)
        d.pop("model_type", None)
        d["rms_norm_eps"] = EPS
        cls, config = transformers.Glm4MoeLiteForCausalLM, transformers.Glm4MoeLiteConfig(**d)
    elif family == "qwen3_5_moe":
        from hyper_parallel.models.qwen3_5_v2.hf_config import config_to_hf

        d = config_to_hf(model_cfg)
        d.pop("model_type", None)
        d["rms_norm_eps"] = EPS
        cls, config = transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(**d)
    else:
        from hyper_parallel.models.qwen3_vl_moe_v2.state_dict import config_to_hf

        d = config_to_hf(model_cfg)
        d.pop("model_type", None)
        d["text_config"]["rms_norm_eps"] = EPS
        cls, config = transformers.Qwen3VLMoeForConditionalGeneration, transformers.Qwen3VLMoeConfig(**d)
    with torch.device("meta"):
        return cls(config)


# ---- --help -------------------------------------------------------------------------------------------------


def _help(module: str, recipe: str, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        ConfigManager().parse_args(["--module", module, "--config", recipe, "--help"])
    return out.getvalue()


def test_a3b_recipe_help_fits_on_a_few_screens(monkeypatch):
    text = _help("qwen3_5_moe", "qwen3_5_moe_a3b", monkeypatch)
    lines = text.splitlines()
    # ~600 lines with the four --parallelism.pipeline_* flags (two lines each); the per-layer tree would add 10,000
    assert len(lines) < 640, f"--help of qwen3_5_moe_a3b is {len(lines)} lines (11,062 before the tree was suppressed)"
    for option in MODEL_OPTIONS:
        assert f"--model.{option}" in text, option
    assert "--model.layers." not in text and "--model.mtp." not in text  # the per-layer tree is off the CLI
    assert "[model.layers.3.mlp]" in text  # ... and the help says how to reach it (a run file)


def test_suppressed_tree_keeps_the_recipes_values():
    recipe = resolve_recipe("glm_image_moe", "glm_image_moe_mtp_debug")().model
    parsed = _parse("glm_image_moe", "glm_image_moe_mtp_debug")
    assert parsed.to_dict() == recipe.to_dict()
    assert parsed.option_values() == recipe.option_values()


# ---- rms_norm_eps: the norms HF's field reaches -------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "module", "recipe"),
    [
        ("glm", "glm_image_moe", "glm_image_moe_mtp_debug"),  # MLA's q_a/kv_a norms stay 1e-6; nextn layer
        ("qwen3_5_moe", "qwen3_5_moe", "qwen3_5_moe_debug"),  # q/k norms, the DeltaNet gated norm; MTP via use_mtp
        ("vl", "qwen3_vl_moe", "qwen3_vl_moe_debug"),  # GQA q/k norms; the vision tower's norms untouched
    ],
)
def test_rms_norm_eps_reaches_exactly_the_norms_hf_reaches(family, module, recipe):
    mtp = ("--model.use_mtp", "true") if family == "qwen3_5_moe" else ()
    base = _parse(module, recipe, *mtp)
    ours = _norm_eps(build_on_meta(_parse(module, recipe, *mtp, "--model.rms_norm_eps", str(EPS))))
    hf = _hf_norm_eps(_hf_model(family, dataclasses.replace(base, use_mtp=None, mtp=None)))
    trunk = {name: eps for name, eps in ours.items() if not name.startswith("mtp.")}
    assert trunk == hf  # same norms, each with HF's eps (EPS where rms_norm_eps reaches it, its fixed eps elsewhere)
    assert EPS in hf.values() and (family != "glm" or 1e-6 in hf.values())
    # HF does not build the MTP block: each of its norms is like HF's norm of the same kind
    mtp_norms = {name: eps for name, eps in ours.items() if name.startswith("mtp.")}
    assert bool(mtp_norms) == (family != "vl")  # Qwen3-VL-MoE has no MTP block
    for name, eps in mtp_norms.items():
        if name.startswith("mtp.layers.0."):
            kind = "layers.*." + name.removeprefix("mtp.layers.0.")
            like = {e for n, e in hf.items() if fnmatch.fnmatchcase(n, kind)}
        else:  # pre_fc_norm_embedding / pre_fc_norm_hidden / norm: rms_norm_eps in vLLM's drafters
            like = {hf["norm"]}
        assert like == {eps}, (name, eps, like)
    if family == "vl":  # the tower keeps its own eps
        assert {cfg.eps for _, cfg, *_ in base.visual.traverse() if hasattr(cfg, "eps")} == {1e-6}


# ---- rope_theta, router_aux_loss_coef, use_mtp, mtp_loss_weight -------------------------------------------


def test_rope_theta_reaches_every_rope_mtp_included():
    model = build_on_meta(_parse("glm_image_moe", "glm_image_moe_mtp_debug", "--model.rope_theta", "1234"))
    ropes = {name: m.config.theta for name, m in model.named_modules() if isinstance(m, RoPE)}
    assert len(ropes) == len(model.layers) + 1 and set(ropes.values()) == {1234.0}
    vl = _parse("qwen3_vl_moe", "qwen3_vl_moe_debug", "--model.rope_theta", "1234")
    assert {layer.self_attn.rope.theta for layer in vl.layers} == {1234.0}
    assert vl.visual.rotary_pos_emb.theta == 10000.0  # the tower's rotary is not the text RoPE


def test_router_aux_loss_coef_reaches_every_moe_mtp_included():
    cfg = _parse("qwen3_5_moe", "qwen3_5_moe_debug", "--model.use_mtp", "true", "--model.router_aux_loss_coef", "0.25")
    model = build_on_meta(cfg)
    moes = {name: m.config.router_aux_loss_coef for name, m in model.named_modules() if isinstance(m, MoE)}
    assert len(moes) == len(model.layers) + 1 and set(moes.values()) == {0.25}


def test_use_mtp_adds_and_removes_the_family_block():
    from hyper_parallel.models.glm_image_moe_v2.model import MTP_LOSS_WEIGHT as GLM_WEIGHT
    from hyper_parallel.models.qwen3_5_v2.model import MTP_LOSS_WEIGHT as QWEN_WEIGHT

    on = _parse("qwen3_5", "qwen3_5_debug", "--model.use_mtp", "true")
    assert on.mtp is not None and on.mtp.loss_weight == QWEN_WEIGHT and build_on_meta(on).mtp is not None
    assert type(on.mtp.layers[0].self_attn).__qualname__ == "GatedAttention.Config"  # Qwen3.5: a full-attention layer
    glm = _parse("glm_image_moe", "glm_image_moe_debug", "--model.use_mtp", "true", "--model.mtp_loss_weight", "0.5")
    assert glm.mtp.zero_embedding_at_document_start and glm.mtp.loss_weight == 0.5
    assert dataclasses.replace(glm, mtp_loss_weight=None).mtp.loss_weight == 0.5  # None: as the tree says
    assert resolve_recipe("glm_image_moe", "glm_image_moe_mtp_debug")().model.mtp.loss_weight == GLM_WEIGHT
    off = _parse("qwen3_5", "qwen3_5_mtp_debug", "--model.use_mtp", "false")
    assert off.mtp is None and build_on_meta(off).mtp is None and off.option_values()["use_mtp"] is False
    with pytest.raises(ConfigError, match="no multi-token-prediction block"):
        dataclasses.replace(resolve_recipe("qwen3_vl_moe", "qwen3_vl_moe_debug")().model, use_mtp=True)


def test_options_are_pushed_on_copies_and_read_back():
    recipe = resolve_recipe("qwen3_5_moe", "qwen3_5_moe_debug")().model
    before = recipe.to_dict()
    changed = dataclasses.replace(recipe, rms_norm_eps=1e-4, rope_theta=99.0, router_aux_loss_coef=0.5, use_mtp=True)
    assert recipe.to_dict() == before  # the recipe's child configs were not touched
    assert changed.option_values() == {
        "rope_theta": 99.0, "rms_norm_eps": 1e-4, "router_aux_loss_coef": 0.5, "use_mtp": True,
        "mtp_loss_weight": 0.1, "freeze": (),
    }  # fmt: skip
    assert recipe.option_values()["rms_norm_eps"] == 1e-6 and recipe.option_values()["use_mtp"] is False
    # a tree whose layers disagree reads as the distinct values
    mixed = dataclasses.replace(recipe, layers=[dataclasses.replace(recipe.layers[0], input_layernorm=type(
        recipe.layers[0].input_layernorm)(eps=1e-2)), *recipe.layers[1:]])  # fmt: skip
    values = mixed.option_values()["rms_norm_eps"]
    assert isinstance(values, tuple) and sorted(values) == [1e-6, 1e-2]


# ---- freeze ---------------------------------------------------------------------------------------------------


def test_freeze_freezes_exactly_the_matched_parameters():
    from hyper_parallel.components.optimizer import OptimizersContainer

    model = _parse("qwen3_5", "qwen3_5_debug", "--model.freeze", "embed_tokens.*", "layers.0.mlp.*").build()
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight"} | {f"layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    opt = OptimizersContainer.Config(name="adamw", lr=1e-3).build(model_parts=[model])
    in_opt = {id(p) for o in opt.optimizers for g in o.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in model.parameters() if p.requires_grad}
    with pytest.raises(ConfigError, match="matches no parameter"):
        build_on_meta(dataclasses.replace(model.config, freeze=("embed_tokns.*",)))


# ---- run files ------------------------------------------------------------------------------------------------


def test_run_file_null_section_is_an_error_naming_the_options(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text("[model.mtp]\nloss_weight = 0.1\n")
    with pytest.raises(ConfigError, match=r"'model.mtp' is null.*model.use_mtp / model.mtp_loss_weight"):
        ConfigManager().parse_args(["--module", "qwen3_5", "--config", "qwen3_5_debug", "--config-file", str(run)])


def test_run_file_model_options(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text("[model]\nmtp_loss_weight = 0.3\nrms_norm_eps = 1e-5\nfreeze = ['embed_tokens.*']\n")
    model = _parse("qwen3_5", "qwen3_5_mtp_debug", "--config-file", str(run))
    assert model.mtp.loss_weight == 0.3 and model.mtp.norm.eps == 1e-5 and model.freeze == ("embed_tokens.*",)
    # apply_overrides alone (no tyro pass) gives the same tree: the section is constructed again
    recipe = resolve_recipe("qwen3_5", "qwen3_5_debug")()
    direct = apply_overrides(recipe, {"model": {"use_mtp": True, "mtp_loss_weight": 0.3}})
    assert direct.model.mtp.loss_weight == 0.3
