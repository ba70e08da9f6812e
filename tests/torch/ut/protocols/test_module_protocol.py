"""The Configurable/Module protocol: enforcement, build kwargs, traverse FQNs, registry, safetensors IO."""

from dataclasses import dataclass, field

import pytest
import torch

from hyper_parallel.config import Configurable
from hyper_parallel.models.common.feed_forward import FeedForward
from hyper_parallel.hf import read_safetensors, write_safetensors
from hyper_parallel.models.common.linear import Linear
from hyper_parallel.protocols import (
    BaseModel,
    ModelSpec,
    Module,
    ModuleList,
    NormalInit,
    discover_model_spec,
    get_spec,
    register_spec,
)


def test_config_without_slots_fails_at_class_creation():
    with pytest.raises(TypeError, match="slots"):

        class Bad(Configurable):
            @dataclass(kw_only=True)
            class Config(Configurable.Config):
                x: int = 1


def test_config_without_kw_only_fails_at_class_creation():
    with pytest.raises(TypeError, match="keyword-only"):

        class Bad(Configurable):
            @dataclass(slots=True)
            class Config(Configurable.Config):
                x: int = 1


def test_subclass_without_config_inherits_parent_config():
    class Wrapped(Linear):  # like FSDP's dynamic FSDPLinear class
        pass

    assert Wrapped.Config is Linear.Config and Linear.Config._owner is Linear


def test_config_must_subclass_parent_config():
    with pytest.raises(TypeError, match="must subclass Module.Config"):

        class Bad(Module):
            @dataclass(kw_only=True, slots=True)
            class Config(Configurable.Config):
                pass


def test_build_kwarg_collision_is_value_error():
    cfg = FeedForward.Config(hidden_dim=4)
    with pytest.raises(ValueError, match="put these values in the Config"):
        cfg.build(dim=4, hidden_dim=8)


def test_build_constructs_owner_and_to_dict():
    cfg = Linear.Config(bias=True, param_init=NormalInit.Config(std=0.5))
    lin = cfg.build(in_features=3, out_features=2)
    assert isinstance(lin, Linear) and lin.config is cfg
    assert lin.bias is not None and lin.weight.shape == (2, 3)
    d = cfg.to_dict()
    assert d["bias"] is True and d["param_init"] == {"mean": 0.0, "std": 0.5}


class _Stack(BaseModel):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        dim: int = 4
        layers: list[FeedForward.Config] = field(default_factory=list)
        head: Linear.Config = field(default_factory=Linear.Config)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.layers = ModuleList(c.build(dim=config.dim) for c in config.layers)
        self.head = config.head.build(in_features=config.dim, out_features=3)


def test_traverse_fqns_mirror_parameter_prefixes():
    cfg = _Stack.Config(layers=[FeedForward.Config(hidden_dim=8), FeedForward.Config(hidden_dim=6)])
    model = cfg.build()
    linear_fqns = {fqn for fqn, *_ in cfg.traverse(Linear.Config)}
    param_prefixes = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
    assert linear_fqns == param_prefixes
    # parent/attr allow in-place replacement of a sub-config
    for fqn, sub, parent, attr in cfg.traverse(FeedForward.Config):
        assert parent[attr] is sub and fqn.startswith("layers.")


def test_init_weights_applies_param_init_and_zeroes_bias():
    torch.manual_seed(0)
    lin = Linear.Config(bias=True, param_init=NormalInit.Config(std=1e-3)).build(in_features=64, out_features=64)
    lin.init_weights()
    assert lin.weight.std().item() == pytest.approx(1e-3, rel=0.1)
    assert torch.count_nonzero(lin.bias) == 0


def test_model_spec_registry_and_discovery():
    spec = ModelSpec(name="toy_stack_for_test", model=_Stack, parallelize_fn=lambda m, **_: m)
    register_spec("toy_stack_for_test", spec, aliases=("toy_stack_alias",))
    assert get_spec("toy_stack_alias") is spec
    assert discover_model_spec("toy_stack_for_test") is spec
    with pytest.raises(KeyError, match="registered"):
        get_spec("no_such_model")
    with pytest.raises(ValueError, match="already registered"):
        register_spec("toy_stack_for_test", ModelSpec(name="x", model=Linear, parallelize_fn=lambda m: m))


def test_count_params_on_meta():
    with torch.device("meta"):
        model = _Stack.Config(layers=[FeedForward.Config(hidden_dim=8)]).build()
    n, flops = model.get_nparams_and_flops(seq_len=16)
    assert n == 3 * 4 * 8 + 4 * 3 and flops == 6 * n


@pytest.mark.parametrize("max_shard_size", ["5GB", 200])
def test_safetensors_roundtrip_single_and_sharded(tmp_path, max_shard_size):
    sd = {f"w{i}": torch.randn(5, 7) for i in range(4)}
    sd["shared_view"] = sd["w0"][:2]  # a view sharing storage must still be written
    files = write_safetensors(sd, tmp_path, max_shard_size=max_shard_size)
    if max_shard_size == 200:
        assert "model.safetensors.index.json" in files and len(files) > 2
    back = read_safetensors(tmp_path)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k])
