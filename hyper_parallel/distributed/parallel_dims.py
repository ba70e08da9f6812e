"""``ParallelDims``: the degrees of a run, checked against the world size and the model, and its mesh.

Mesh axes are ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first). Pipeline parallel (``pp``) is the
outermost: every view below lives inside one pipeline rank group (its axes get ``pp`` in front when it is
on), so FSDP, TP, EP and CP apply inside each stage exactly as without it; ``mesh("pp")`` links the stages.

Expert parallel borrows its
degree from ``dp_shard x cp``: the ranks that hold different sequence/data shards of the dense model
hold different experts. Routed experts see only the tokens of their rank (under TP the MoE runs on
the rank's sequence shard), so every rank of ``dp_shard x cp x tp`` routes different tokens, and
routed-expert weights are FSDP-sharded over ``efsdp = dp_shard x cp x tp / ep`` (``= dp_shard x cp /
ep`` without TP; EP and TP together are not supported yet).

Every view of the world is an ``_unflatten`` of the same 1-D world mesh, so all of them share one
root and DTensors/FSDP on different views compose:

============  ================================================  ==================================
view          axes                                              used by
============  ================================================  ==================================
layout        dp_replicate, dp_shard, cp, tp                    CP, TP
batch         dp, cp, tp                                        data loading (``dp`` ranks differ)
loss          dp_cp, tp                                         token counts and loss sums (ranks with different tokens)
dense         dp_replicate, dp_shard_cp, tp                     FSDP/HSDP of every dense parameter
sparse        dp_replicate, efsdp, ep                           EP and FSDP of routed experts/router
cp_hybrid     dp_replicate, dp_shard, cp_outer, cp_inner, tp    hybrid CP (only when 1 < cp_inner < cp)
============  ================================================  ==================================

Hybrid context parallel (``--parallelism.context_parallel_ulysses_degree`` = ``cp_inner``) splits the cp axis
into ``cp_outer x cp_inner``, inner fastest: an inner group is ``cp_inner`` consecutive CP ranks (neighbours on
the ranks' order, so inside a node), an outer group the ranks ``cp_inner`` apart. The groups of this view
live in the world mesh's registry like every other, so ``close()`` frees them too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hyper_parallel.config.errors import ConfigError
from hyper_parallel.config.parallelism import ParallelismConfig
from hyper_parallel.distributed.pipeline_plan import schedule_rules
from hyper_parallel.distributed.teardown import release_mesh, track_mesh
from hyper_parallel.protocols.sharding import MeshAxisName

__all__ = ["ParallelDims"]

_P = "--parallelism."
_VIEWS: dict[str, tuple[str, ...]] = {
    "layout": ("dp_replicate", "dp_shard", "cp", "tp"),
    "batch": ("dp", "cp", "tp"),
    "loss": ("dp_cp", "tp"),
    "dense": ("dp_replicate", "dp_shard_cp", "tp"),
    "sparse": ("dp_replicate", "efsdp", "ep"),
    "cp_hybrid": ("dp_replicate", "dp_shard", "cp_outer", "cp_inner", "tp"),
}
# Axes that get a (possibly size-1) process group even at degree 1: FSDP always has a mesh, so the
# same code path (and gradient reduction) serves every layout, including TP-only and EP-only ones.
_ALWAYS_BUILT = ("dp_shard_cp", "efsdp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Validated degrees of every parallel dimension, and (after ``build_mesh``) the device mesh.

    Build it with ``ParallelDims.from_config(parallelism, world_size)``; that validates the degree
    arithmetic before any model exists. ``validate_model(...)`` then checks model facts (heads,
    experts, dimensions) against the degrees. Both raise ``ConfigError`` naming what to change.
    ``build_mesh`` creates the process groups of every view; this object owns them and ``close()``
    destroys them.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world_size: int
    pp: int = 1
    """Pipeline parallel degree (``pipeline_parallel_degree``): rank groups that hold different layers."""
    pp_stages_per_rank: int = 1
    """Pipeline stages per pp rank (``pipeline_stages_per_rank``): ``pp x this`` stages in all."""
    cp_inner: int = 1
    """Hybrid context parallel: Ulysses degree inside the CP group (``context_parallel_ulysses_degree``)."""
    enable_sequence_parallel: bool = True
    enable_loss_parallel: bool = True
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction and checks
    @classmethod
    def from_config(cls, parallelism: ParallelismConfig, world_size: int) -> ParallelDims:
        """Resolve ``data_parallel_shard_degree=-1`` and validate the degrees against ``world_size``."""
        p = parallelism
        named = {
            "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
            "context_parallel_degree": p.context_parallel_degree,
            "tensor_parallel_degree": p.tensor_parallel_degree,
            "expert_parallel_degree": p.expert_parallel_degree,
        }
        for name, value in named.items():
            if value < 1:
                raise ConfigError(f"{_P}{name} is {value}; it must be >= 1")
        dp_shard = p.data_parallel_shard_degree
        if dp_shard == 0 or dp_shard < -1:
            raise ConfigError(f"{_P}data_parallel_shard_degree is {dp_shard}; use -1 (the rest of the world) or >= 1")
        pp, spr = p.pipeline_parallel_degree, p.pipeline_stages_per_rank
        if pp < 1:
            raise ConfigError(f"{_P}pipeline_parallel_degree is {pp}; it must be >= 1")
        cls._check_schedule(p.pipeline_schedule, spr, pp)
        if pp > 1 and schedule_rules(p.pipeline_schedule).splits_weight_grad and p.fsdp_reshard_after_forward == "always":
            raise ConfigError(
                f"{_P}pipeline_schedule {p.pipeline_schedule} computes weight gradients apart from input gradients, against "
                f"the parameters the forward used, which {_P}fsdp_reshard_after_forward always frees: set it to "
                "default (never under pipeline parallel) or never"
            )
        others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree * pp
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"pipeline_parallel_degree ({pp}) x data_parallel_replicate_degree "
                    f"({p.data_parallel_replicate_degree}) x context_parallel_degree ({p.context_parallel_degree}) x "
                    f"tensor_parallel_degree ({p.tensor_parallel_degree}) = {others} does not divide the world size "
                    f"{world_size}: change these degrees so their product divides {world_size} "
                    "(data_parallel_shard_degree=-1 takes the rest)"
                )
            dp_shard = world_size // others
        total = others * dp_shard
        if total != world_size:
            raise ConfigError(
                f"pipeline_parallel_degree ({pp}) x data_parallel_replicate_degree ({p.data_parallel_replicate_degree}) "
                f"x data_parallel_shard_degree ({dp_shard}) x context_parallel_degree ({p.context_parallel_degree}) x "
                f"tensor_parallel_degree ({p.tensor_parallel_degree}) = {total}, but the world size is {world_size}: "
                f"change the degrees (or set {_P}data_parallel_shard_degree -1 to take the rest)"
            )
        u, cp = p.context_parallel_ulysses_degree, p.context_parallel_degree
        if u < 1 or cp % u:
            raise ConfigError(
                f"{_P}context_parallel_ulysses_degree is {u}; it must be >= 1 and divide {_P}context_parallel_degree "
                f"({cp}): the hybrid runs Ulysses inside groups of that many CP ranks (1 turns it off)"
            )
        ep = p.expert_parallel_degree
        if ep > 1 and (dp_shard * p.context_parallel_degree) % ep:
            raise ConfigError(
                f"{_P}expert_parallel_degree ({ep}) must divide data_parallel_shard_degree x context_parallel_degree "
                f"({dp_shard} x {p.context_parallel_degree} = {dp_shard * p.context_parallel_degree}): expert parallel "
                "borrows its ranks from those axes; change expert_parallel_degree or data_parallel_shard_degree"
            )
        if ep > 1 and p.tensor_parallel_degree > 1:
            raise ConfigError(
                f"{_P}expert_parallel_degree ({ep}) > 1 together with {_P}tensor_parallel_degree "
                f"({p.tensor_parallel_degree}) > 1 is not supported: routed experts are either expert-parallel or "
                "tensor-parallel; set one of the two degrees to 1"
            )
        return cls(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=dp_shard,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            ep=ep,
            world_size=world_size,
            pp=pp,
            pp_stages_per_rank=spr,
            cp_inner=u,
            enable_sequence_parallel=p.enable_sequence_parallel,
            enable_loss_parallel=p.enable_loss_parallel,
        )

    @staticmethod
    def _check_schedule(schedule: str, stages_per_rank: int, pp: int) -> None:
        """The schedule's stages per rank (``pipeline_plan.SCHEDULES``): 1F1B/GPipe one, Interleaved1F1B several,
        ZBVZeroBubble and DualPipeV two (a V)."""
        least, most = schedule_rules(schedule).stages_per_rank
        if pp > 1 and not (least <= stages_per_rank and (most is None or stages_per_rank <= most)):
            want = f"{least}" if least == most else f">= {least}"
            raise ConfigError(
                f"{_P}pipeline_schedule {schedule} runs {want} stage(s) per rank, but "
                f"{_P}pipeline_stages_per_rank is {stages_per_rank}: set it to {least}" + (" or more" if most is None else "")
            )
        if pp == 1 and stages_per_rank != 1:
            raise ConfigError(
                f"{_P}pipeline_stages_per_rank is {stages_per_rank} without pipeline parallel: set "
                f"{_P}pipeline_parallel_degree > 1, or pipeline_stages_per_rank 1"
            )

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: ``pp x pp_stages_per_rank`` (1 without pipeline parallel)."""
        return self.pp * self.pp_stages_per_rank

    def validate_model(
        self,
        *,
        n_heads: int,
        n_kv_heads: int | None = None,
        n_routed_experts: int | None = None,
        tp_dims: Mapping[str, int] | None = None,
        efsdp_dims: Mapping[str, int] | None = None,
    ) -> None:
        """Check model facts against the degrees; raise ``ConfigError`` naming what to change.

        ``tp_dims`` maps a model field name to a dimension TP shards (an intermediate size ...);
        ``efsdp_dims`` maps a field name to an expert-weight dimension FSDP shards on dim 1 when EP
        is on (FSDP2 requires even sharding off dim 0).
        """
        heads = {"n_heads": n_heads} | ({"n_kv_heads": n_kv_heads} if n_kv_heads is not None else {})
        for name, value in heads.items():
            if value % self.tp:
                raise ConfigError(
                    f"tensor_parallel_degree ({self.tp}) does not divide the model's {name} ({value}): "
                    f"set {_P}tensor_parallel_degree to a divisor of {value}"
                )
            # context parallel needs no other head check: beyond the heads per tp rank it gathers K/V instead
            # of splitting heads (``context_parallel.apply_context_parallel``), unless the hybrid splits them
            self.check_cp_heads(name, value)
        for name, value in (tp_dims or {}).items():
            if value % self.tp:
                raise ConfigError(
                    f"tensor_parallel_degree ({self.tp}) does not divide the model's {name} ({value}): "
                    f"change {_P}tensor_parallel_degree or {name}"
                )
        if self.ep > 1:
            if n_routed_experts is None:
                raise ConfigError(
                    f"{_P}expert_parallel_degree is {self.ep} but the model has no routed experts: set it to 1"
                )
            if n_routed_experts % self.ep:
                raise ConfigError(
                    f"expert_parallel_degree ({self.ep}) does not divide the routed experts ({n_routed_experts}): "
                    f"set {_P}expert_parallel_degree to a divisor of {n_routed_experts}"
                )
            for name, value in (efsdp_dims or {}).items():
                if value % self.efsdp:
                    raise ConfigError(
                        f"with expert parallel, FSDP shards expert weights on dim 1 over efsdp = data_parallel_shard "
                        f"x context_parallel / expert_parallel = {self.efsdp} ranks, which does not divide {name} "
                        f"({value}): change {_P}expert_parallel_degree or {_P}data_parallel_shard_degree"
                    )

    def check_cp_heads(self, name: str, value: int) -> None:
        """Hybrid context parallel splits the heads per TP rank of every core they do not put on Ulysses over
        the whole CP group (``value / tp`` not divisible by ``cp``) over ``cp_inner`` ranks: raise unless they
        divide. ``name`` is the model field of ``value`` (a sequence core's heads, e.g. ``n_kv_heads``)."""
        per_tp = value // self.tp
        if self.cp_inner > 1 and per_tp % self.cp and per_tp % self.cp_inner:  # cp_inner == cp: Ulysses only
            raise ConfigError(
                f"hybrid context parallel splits the heads of every core over {_P}context_parallel_ulysses_degree "
                f"({self.cp_inner}) ranks, but the model has {per_tp} {name} per tensor-parallel rank: set it to a "
                f"divisor of {per_tp} (1 turns the hybrid off)"
            )

    # ------------------------------------------------------------------ derived degrees
    @property
    def dp(self) -> int:
        """Ranks that read different data: ``dp_replicate x dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        """FSDP shard degree of dense parameters: ``dp_shard x cp``."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP shard degree of routed experts: ``dp_shard x cp x tp / ep``."""
        return self.dp_shard_cp * self.tp // self.ep

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_cp > 1 or self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def cp_outer(self) -> int:
        """Hybrid context parallel: the groups of ``cp_inner`` ranks the K/V all-gather / state passing spans."""
        return self.cp // self.cp_inner

    @property
    def hybrid_cp(self) -> bool:
        """Hybrid context parallel has two levels (``1 < cp_inner < cp``)."""
        return 1 < self.cp_inner < self.cp

    def cp_hybrid_meshes(self) -> tuple[DeviceMesh, DeviceMesh] | None:
        """``(inner, outer)`` meshes of hybrid context parallel (``apply_context_parallel(hybrid=)``), or None."""
        return (self.mesh("cp_inner"), self.mesh("cp_outer")) if self.hybrid_cp else None

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def sp_enabled(self) -> bool:
        """Sequence parallel (norms and residuals sharded along the sequence) is on."""
        return self.tp_enabled and self.enable_sequence_parallel

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.enable_loss_parallel

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one data shard: ``cp x tp``."""
        return self.cp * self.tp

    def degree(self, axis: str | MeshAxisName) -> int:
        """Degree of a mesh axis or flattened view by name."""
        name = str(axis)
        sizes = {
            "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp,
            "ep": self.ep, "dp": self.dp, "dp_shard_cp": self.dp_shard_cp, "efsdp": self.efsdp,
            "dp_cp": self.dp * self.cp, "pp": self.pp,
            "cp_inner": self.cp_inner if self.hybrid_cp else 1, "cp_outer": self.cp_outer if self.hybrid_cp else 1,
            "world": self.world_size,
        }  # fmt: skip
        if name not in sizes:
            raise KeyError(f"unknown mesh axis {name!r}; known: {', '.join(sizes)}")
        return sizes[name]

    # ------------------------------------------------------------------ meshes
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh and its views (see the module docstring); returns the world mesh.

        Needs an initialised default process group of ``world_size`` ranks. Only axes of degree > 1
        (and the FSDP axes ``dp_shard_cp``/``efsdp``) get process groups: on gloo every group costs a
        rendezvous. ``mesh()`` never returns a degree-1 axis. The groups are this object's: ``close()``
        destroys them (building again first releases the previous mesh's groups, if any are still live).
        """
        self.close()
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        track_mesh(world)  # released by close(), or by release_tracked_meshes() if nobody closes this
        self._meshes["world"] = world
        for view, names in _VIEWS.items():
            if view == "sparse" and self.ep == 1 and self.tp == 1:
                continue  # routed experts then share the dense FSDP mesh: no extra groups
            if view == "cp_hybrid" and not self.hybrid_cp:
                continue
            # pp outermost in every view: each view's groups lie inside one pipeline rank group
            kept = (("pp",) if self.pp > 1 else ()) + tuple(
                n for n in names if self.degree(n) > 1 or n in _ALWAYS_BUILT
            )
            if kept:
                self._meshes[view] = world._unflatten(0, tuple(self.degree(n) for n in kept), kept)
        return world

    def close(self) -> None:
        """Destroy every process group the mesh made (views, flattened axes) and forget the meshes.

        Idempotent. The default process group is not this object's and stays; DTensors and FSDP modules
        on these meshes can no longer communicate. See ``teardown.py`` for why ``destroy_process_group()``
        alone left every group (and its threads / NCCL communicators) alive.
        """
        if self._meshes:
            release_mesh(self._meshes["world"])
            self._meshes.clear()

    @property
    def world_mesh(self) -> DeviceMesh:
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_mesh(device_type) has not been called")
        return self._meshes["world"]

    def mesh(self, *axes: str | MeshAxisName) -> DeviceMesh | None:
        """The sub-mesh over ``axes`` (given outermost first), leaving out axes of degree 1.

        Returns ``None`` when every requested axis has degree 1. All axes must live in one view
        (e.g. ``"dp_replicate", "dp_shard_cp"``; see the module docstring).
        """
        requested = [str(a) for a in axes]
        for name in requested:
            self.degree(name)  # unknown names fail here
        names = [n for n in requested if self.degree(n) > 1]
        if not names:
            return None
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_mesh(device_type) has not been called")
        if names == ["world"]:
            return self._meshes["world"]
        if "sparse" not in self._meshes:  # no EP, no TP: efsdp is dp_shard_cp
            names = ["dp_shard_cp" if n == "efsdp" else n for n in names]
        for view, view_names in _VIEWS.items():
            view_names = ("pp", *view_names)
            if view in self._meshes and all(n in view_names for n in names):
                if sorted(names, key=view_names.index) != names:
                    raise ValueError(f"mesh axes {requested} must be given outermost first: {view_names}")
                return self._meshes[view][tuple(names)]
        raise ValueError(f"mesh axes {requested} do not live in one view of the mesh: {_VIEWS}")

    def fsdp_mesh(self) -> DeviceMesh:
        """FSDP mesh of dense parameters: ``dp_shard_cp`` (1-D), or ``(dp_replicate, dp_shard_cp)`` for HSDP.

        Never None: with degree 1 it is a one-rank mesh, so FSDP still owns the gradient reduction.
        """
        names = ("dp_replicate", "dp_shard_cp") if self.dp_replicate > 1 else ("dp_shard_cp",)
        return self._meshes["dense"][names]

    def efsdp_mesh(self) -> DeviceMesh:
        """FSDP mesh of routed experts (and routers): ``efsdp``, with ``dp_replicate`` first for HSDP."""
        if "sparse" not in self._meshes:  # no EP, no TP: efsdp == dp_shard_cp
            return self.fsdp_mesh()
        names = ("dp_replicate", "efsdp") if self.dp_replicate > 1 else ("efsdp",)
        return self._meshes["sparse"][names]

    def fsdp_mesh_with_tp(self) -> DeviceMesh:
        """FSDP mesh over ``dp_shard x cp x tp`` (HSDP: with ``dp_replicate`` first), for replicated parameters
        whose gradients differ across tp ranks (routers/experts on sequence shards, latent projections in a
        TP block): FSDP's SUM over tp completes them. Equals ``fsdp_mesh()`` without TP.
        """
        if self.tp == 1:
            return self.fsdp_mesh()
        if self.ep > 1:  # from_config rejects EP x TP; the sparse view would not span tp then
            raise RuntimeError("fsdp_mesh_with_tp() needs expert_parallel_degree 1 when tensor_parallel_degree > 1")
        return self.efsdp_mesh()

    def mesh_coordinate(self, axis: str | MeshAxisName) -> int:
        """This rank's index along ``axis`` (0 when the axis has degree 1)."""
        mesh = self.mesh(axis)
        return 0 if mesh is None else mesh.get_local_rank()

    def __str__(self) -> str:
        parts = [f"{n}={self.degree(n)}" for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")][self.pp == 1 :]
        if self.hybrid_cp:
            parts.insert(3, f"cp_inner={self.cp_inner}")
        return f"ParallelDims({', '.join(parts)}, world={self.world_size})"
