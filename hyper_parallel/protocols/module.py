"""``Module``: an ``nn.Module`` built from its nested Config, plus the container modules.

Children are stored under the name of the Config field that built them, so FQNs of the config tree
(``Config.traverse``) equal FQN prefixes of the module's parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import tyro
from torch import nn

from hyper_parallel.config.configurable import Configurable
from hyper_parallel.protocols.param_init import ParamInit
from hyper_parallel.protocols.sharding import ShardingConfig

__all__ = ["Module", "ModuleDict", "ModuleList", "Sequential", "unwrapped_name"]


def unwrapped_name(name: str) -> str:
    """A parameter or module name as the model itself spells it: activation-checkpoint and compile wrappers'
    name parts (``_checkpoint_wrapped_module.``, ``_orig_mod.``) dropped."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class Module(nn.Module, Configurable):
    """Base of every model part. ``Config.build(**dims)`` constructs it."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        param_init: ParamInit.Config | None = None
        """Initialiser of this module's own weights (biases are zeroed); None keeps the default."""
        sharding_config: Annotated[ShardingConfig | None, tyro.conf.Suppress] = None
        """Declared placements, filled by the model's sharding.py (not a CLI option)."""

    def __init__(self, config: Config, **runtime_objects: Any) -> None:
        nn.Module.__init__(self)
        del runtime_objects
        self.config = config

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise this module's own parameters, then every child's (recursively)."""
        self.init_own_weights()
        for child in self.children():
            _init_child(child)

    @torch.no_grad()
    def init_own_weights(self) -> None:
        """Apply ``config.param_init`` to direct parameters; zero direct biases."""
        init = self.config.param_init.build() if self.config.param_init is not None else None
        for name, param in self.named_parameters(recurse=False):
            if name == "bias" or name.endswith("_bias"):
                param.zero_()
            elif init is not None:
                init(param)


@torch.no_grad()
def _init_child(child: nn.Module) -> None:
    if isinstance(child, Module):
        child.init_weights()
        return
    reset = getattr(child, "reset_parameters", None)
    if callable(reset):
        reset()
    for grandchild in child.children():
        _init_child(grandchild)


class ModuleList(nn.ModuleList):
    """``nn.ModuleList`` of built Modules (``layers.0``, ``layers.1`` ...)."""

    def __init__(self, modules: Iterable[nn.Module] | None = None) -> None:
        super().__init__(modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return super().__iter__()


class ModuleDict(nn.ModuleDict):
    """``nn.ModuleDict`` of built Modules."""

    def __init__(self, modules: Mapping[str, nn.Module] | None = None) -> None:
        super().__init__(modules)


class Sequential(nn.Sequential):
    """``nn.Sequential`` of built Modules."""
