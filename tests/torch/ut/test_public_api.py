"""The public API: every exported name resolves, every module imports, ``import hyper_parallel`` stays light,
and the RFC's M8.3 list is exported as far as the project has those things."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import hyper_parallel
import hyper_parallel.models.common as common

PACKAGE_DIR = Path(hyper_parallel.__file__).parent

# The RFC's M8.3 public API list (seeds/001, section 3), by the package the RFC imports them from.
RFC_M83 = {
    "protocols": ["Configurable", "Module", "ModuleList", "ModuleDict", "Sequential", "BaseModel", "ModelSpec",
                  "ShardingConfig", "NamedPlacement", "LocalMapConfig", "MeshAxisName", "BaseStateDictAdapter"],
    "config": ["ConfigManager", "Function", "TORCH_DTYPE_MAP", "TrainingConfig", "ParallelismConfig",
               "ActivationCheckpointConfig", "CompileConfig", "CommConfig", "DebugConfig"],
    "components": ["OptimizersContainer", "LRSchedulersContainer", "BaseLoss", "CrossEntropyLoss", "BaseTokenizer",
                   "HuggingFaceTokenizer", "BaseDataLoader", "HuggingFaceTextDataLoader", "DummyDataLoader",
                   "CheckpointManager", "Profiler", "MetricsProcessor"],
    "models.common": ["Linear", "Embedding", "RMSNorm", "Qwen3_5RMSNorm", "RoPE", "GQAttention", "FeedForward", "MoE",
                      "TransformerBlock", "Decoder", "set_decoder_sharding_config", "set_gqa_attention_sharding",
                      "set_dense_ffn_sharding", "set_qkv_linear_sharding", "colwise_config", "rowwise_config",
                      "norm_config"],
}  # fmt: skip

# Names of that list the project does not have (empty: every one exists now). If one of them is removed
# from the code, this test fails until it is dropped from RFC_M83 with a reason.
NOT_IN_PROJECT: set[str] = set()

COMMON_BLOCKS = [
    "Linear", "Embedding", "RMSNorm", "Qwen3_5RMSNorm", "GatedRMSNorm", "RoPE", "RoPECosSin", "AttentionMeta",
    "VarlenAttention", "TokenMixer", "MLAttention", "GQAttention", "GatedAttention", "GatedDeltaNet",
    "GatedDeltaRule", "CausalConv1d", "FeedForward", "Router", "GroupedExperts", "MoE", "load_balancing_loss",
    "TransformerBlock", "Decoder", "LocalTokenDispatcher", "colwise_config", "rowwise_config", "norm_config",
    "region_config", "embedding_config", "lm_head_config", "set_decoder_sharding_config",
    "set_gqa_attention_sharding", "set_mla_attention_sharding", "set_dense_ffn_sharding", "set_moe_sharding",
    "set_qkv_linear_sharding", "without_sharding",
]  # fmt: skip


def _all_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(hyper_parallel.__path__, "hyper_parallel.")]
    # __main__ modules run a CLI when imported
    return [n for n in names if not n.endswith(".__main__")]


def test_every_exported_name_resolves():
    assert hyper_parallel.__version__
    for name in hyper_parallel.__all__:
        assert getattr(hyper_parallel, name) is not None, name
    namespace: dict = {}
    exec("from hyper_parallel import *", namespace)
    assert set(hyper_parallel.__all__) <= set(namespace)
    assert set(hyper_parallel.__all__) <= set(dir(hyper_parallel))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        hyper_parallel.NoSuchThing  # noqa: B018


def test_exports_are_the_defining_objects():
    from hyper_parallel.config.manager import ConfigManager
    from hyper_parallel.models.common.moe import MoE
    from hyper_parallel.protocols.module import Module

    assert hyper_parallel.ConfigManager is ConfigManager
    assert hyper_parallel.Module is Module and hyper_parallel.MoE is MoE


def test_rfc_m83_list_is_exported_as_far_as_it_exists():
    listed = [name for names in RFC_M83.values() for name in names]
    for name in listed:
        if name not in NOT_IN_PROJECT:
            assert name in hyper_parallel.__all__, f"RFC M8.3 name {name} exists but is not exported"
    # set_*_sharding_config: the one every model package provides
    assert callable(hyper_parallel.set_glm_image_moe_sharding_config)
    # the names we leave out really are absent: none is defined anywhere in the package
    defined = set()
    for module_name in _all_modules():
        module = importlib.import_module(module_name)
        defined |= {n for n, obj in vars(module).items() if getattr(obj, "__module__", None) == module_name}
    assert not (NOT_IN_PROJECT & defined), f"now defined, export them: {sorted(NOT_IN_PROJECT & defined)}"


def test_common_blocks_exported():
    assert sorted(common.__all__) == sorted(COMMON_BLOCKS)
    for name in COMMON_BLOCKS:
        obj = getattr(common, name)
        assert obj.__module__.startswith("hyper_parallel.models.common."), name
        assert getattr(hyper_parallel, name) is obj


def test_every_module_imports():
    modules = _all_modules()
    assert "hyper_parallel.models.glm_image_moe_v2.parallelize" in modules
    for name in modules:
        importlib.import_module(name)


def test_every_source_folder_is_a_regular_package():
    # A folder without __init__.py is a namespace package: pkgutil.walk_packages (and therefore the test
    # above) skips it, and setuptools' find_packages leaves it out of a built wheel.
    missing = sorted(
        str(folder.relative_to(PACKAGE_DIR.parent))
        for folder in [PACKAGE_DIR, *PACKAGE_DIR.rglob("*")]
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py"))
        and not (folder / "__init__.py").is_file()
    )  # fmt: skip
    assert not missing, f"add an __init__.py to: {missing}"
    on_disk = {
        ".".join(p.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        for p in PACKAGE_DIR.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    assert on_disk <= set(_all_modules())


def test_subpackages_as_attributes():
    for name in ("config", "protocols", "models", "data", "components", "distributed"):
        assert inspect.ismodule(getattr(hyper_parallel, name))


def test_import_is_light():
    # Names resolve lazily: importing the package must not pull in torch (nor tyro, nor the CLI module).
    code = "import sys, hyper_parallel; print(sorted(m for m in ('torch', 'tyro', 'hyper_parallel.config.manager') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE_DIR.parent)
    assert out.stdout.strip() == "[]"
