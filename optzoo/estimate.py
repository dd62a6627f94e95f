"""What an optimizer will hold, per rank, before anything is allocated: ``optzoo estimate``.

:func:`estimate` routes a model (it may live on the meta device) and adds up, from shapes alone,
what ``get_optimizer`` and its first step allocate beside the model:

- **optimizer state**, per group and per algorithm, from each registry record's ``state_bytes``
  (the per-element facts ``tests/optimizers/test_state_bytes.py`` measures), at the dtype the
  algorithm steps: float32 main params under ``bf16``/``fp16``, the param's own dtype otherwise
  (the precision-aware Adam's typed moments and master copy or int16 remainder are in its record);
- **main params**: the float32 copies of 16-bit params under ``bf16``/``fp16`` (none for fp32
  params, none under the precision-aware optimizer, whose master lives in its state), and the
  dense working copy of a param whose memory has gaps (:func:`~optzoo.wrapper.param_map.build_param_map`);
- **gradient buffers**: the float32 copies of 16-bit gradients, or the precision-aware Adam's
  ``decoupled_grad`` in ``main_grads_dtype`` for every param; an fp32 param is stepped on the
  model's own gradient (counted apart, as ``model grads``: backward's, in the param's dtype);
- **per rank** under ``world_size`` > 1: what each rank owns by the layer-wise or ZeRO-1 plan
  (:func:`~optzoo.distributed.plan.plan_shards`), with the distributed optimizer's param-sync
  buffers; under FSDP2 on a mesh (``--mesh``), each rank's local shard as ``fully_shard`` and the
  TP plan place it (:mod:`optzoo.mesh_plan`), and the transient bytes of each Newton–Schulz bucket
  of Muon's owner-computes plan (:func:`~optzoo.mesh_plan.plan_mesh`);
- **orthogonalisation FLOPs** per step per rank: the registry record's ``update_cost`` of each
  Muon-family matrix a rank orthogonalises (Newton–Schulz; MOP's is its SVD).

Not counted: the loss scaler's and the step's few scalars, activations, and the model's params.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from optzoo._common import dense_layout
from optzoo.config import OptimizerConfig
from optzoo.distributed.plan import plan_shards
from optzoo.groups import OverrideValue, ResolvedGroup, resolve_group_configs
from optzoo.mesh_plan import (
    DEFAULT_TP_PLAN,
    MeshPlan,
    MeshSpec,
    TensorPlan,
    mesh_placements,
    model_tp_plan,
    param_mesh,
    parse_mesh,
    parse_tp_plan,
    plan_mesh,
    tp_style,
)
from optzoo.optimizers.owner_compute import ShardLayout, TPMode, box_shape
from optzoo.optimizers.registry import get_spec
from optzoo.routing import ExampleInputs, ParamKey, named_trainable_parameters
from optzoo.wrapper.param_map import LOW_PRECISION, check_param_dtypes

__all__ = ["Distributed", "GroupEstimate", "MemoryEstimate", "RankEstimate", "estimate", "estimate_groups"]

Distributed = Literal["none", "layer_wise", "sharded", "fsdp2"]
"""How the optimizer is spread over ranks: ``none`` (every rank steps everything, as under DDP),
``layer_wise`` (``use_layer_wise_distributed_optimizer``), ``sharded`` (``use_distributed_optimizer``,
ZeRO-1) or ``fsdp2`` (``fully_shard``'s DTensor params on a device mesh)."""

ParamSync = Literal["all_gather", "broadcast"]


@dataclass(frozen=True)
class GroupEstimate:
    """One param group over the whole model."""

    index: int
    optimizer: str
    params: int
    elements: int
    state_bytes: int


@dataclass(frozen=True)
class RankEstimate:
    """What one rank holds besides the model, in bytes, and the orthogonalisation it computes."""

    rank: int
    state_bytes: int
    main_param_bytes: int
    grad_buffer_bytes: int
    param_sync_bytes: int
    """The distributed optimizer's buffers for sending updated params (layer-wise, ZeRO-1)."""
    transient_bytes: tuple[int, ...]
    """Per Newton–Schulz bucket of Muon's FSDP2 owner-computes plan (freed after the bucket; two in flight)."""
    model_grad_bytes: int
    """Backward's gradients in the model (param dtype; this rank's shards under FSDP2): not the optimizer's."""
    orthogonalize_flops: float

    @property
    def held_bytes(self) -> int:
        """What the optimizer keeps between steps: state, main params, gradient and sync buffers."""
        return self.state_bytes + self.main_param_bytes + self.grad_buffer_bytes + self.param_sync_bytes

    @property
    def peak_bytes(self) -> int:
        """``held_bytes`` plus the two largest Newton–Schulz buckets (two are in flight)."""
        return self.held_bytes + sum(sorted(self.transient_bytes)[-2:])


@dataclass(frozen=True)
class MemoryEstimate:
    """:func:`estimate`'s answer."""

    precision: str
    distributed: Distributed
    world_size: int
    groups: tuple[GroupEstimate, ...]
    ranks: tuple[RankEstimate, ...]
    mesh: MeshSpec | None = None
    mesh_plans: tuple[MeshPlan, ...] = field(default_factory=tuple)

    def algorithms(self) -> dict[str, int]:
        """Optimizer state bytes per algorithm over the whole model, in routing order."""
        totals: dict[str, int] = {}
        for group in self.groups:
            totals[group.optimizer] = totals.get(group.optimizer, 0) + group.state_bytes
        return totals

    def as_json(self) -> dict[str, Any]:
        """A JSON-friendly form (``optzoo estimate --format json``): bytes and FLOPs as numbers."""
        return {
            "precision": self.precision,
            "distributed": self.distributed,
            "world_size": self.world_size,
            "mesh": dict(self.mesh.dims) if self.mesh is not None else None,
            "groups": [vars(group) for group in self.groups],
            "algorithms": self.algorithms(),
            "ranks": [
                {**vars(rank), "transient_bytes": list(rank.transient_bytes), "held_bytes": rank.held_bytes, "peak_bytes": rank.peak_bytes}
                for rank in self.ranks
            ],
        }


@dataclass(frozen=True)
class _Param:
    name: str
    group: ResolvedGroup
    param: torch.Tensor  # the routed param: its group knows the forward's view of it by identity
    shape: tuple[int, ...]
    dtype: torch.dtype
    main_dtype: torch.dtype
    copied: bool
    working: bool

    def state_bytes(self, shape: tuple[int, ...]) -> int:
        spec = get_spec(self.group.optimizer)
        fields: dict[str, Any] = {name: getattr(self.group.config, name) for name in spec.config_fields}
        fields.update(flatten=self.group.flatten, matrix_view=self.group.matrix_view_of(self.param))
        return spec.state_bytes(shape, fields, self.main_dtype)

    def update_cost(self) -> float:
        spec = get_spec(self.group.optimizer)
        if spec.family != "orthogonalized" or len(self.shape) < 2:
            return 0.0
        fields: dict[str, Any] = {name: getattr(self.group.config, name) for name in spec.config_fields}
        fields.update(flatten=self.group.flatten, matrix_view=self.group.matrix_view_of(self.param))
        return spec.update_cost(self.shape, fields)


def _precision(config: OptimizerConfig) -> str:
    name = "fp16" if config.fp16 else "bf16" if config.bf16 else "fp32"
    return f"{name}, precision-aware" if config.use_precision_aware_optimizer else name


def _params(config: OptimizerConfig, groups: Sequence[ResolvedGroup]) -> list[_Param]:
    """Each param's main tensor as :func:`~optzoo.wrapper.param_map.build_param_map` decides it."""
    copy_16bit = (config.fp16 or config.bf16) and not config.use_precision_aware_optimizer
    found = []
    for group in groups:
        for routed, name in zip(group.params, group.param_names):
            param = routed.param
            copied = copy_16bit and param.dtype in LOW_PRECISION
            working = not copied and not dense_layout(param)
            main_dtype = torch.float32 if copied else param.dtype
            found.append(_Param(name, group, param, tuple(param.shape), param.dtype, main_dtype, copied, working))
    return found


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _buffers(config: OptimizerConfig, param: _Param, numel: int, *, whole: bool) -> tuple[int, int]:
    """``(main param bytes, gradient buffer bytes)`` for ``numel`` elements of ``param`` a rank steps."""
    main = numel * 4 if param.copied else numel * _itemsize(param.dtype) if param.working and whole else 0
    if config.use_precision_aware_optimizer:
        grad = numel * _itemsize(config.main_grads_dtype)
    else:
        grad = numel * 4 if param.copied else 0
    return main, grad


def estimate(
    config: OptimizerConfig,
    model: torch.nn.Module | Sequence[torch.nn.Module],
    overrides: Mapping[ParamKey, OverrideValue] | None = None,
    *,
    world_size: int = 1,
    distributed: Distributed | None = None,
    mesh: MeshSpec | str | None = None,
    tp: int | None = None,
    tp_plan: TensorPlan | str | None = None,
    tp_mode: TPMode | None = None,
    bucket_size: int | None = None,
    fsdp_orthogonalize: str | None = None,
    param_sync: ParamSync = "all_gather",
    example_inputs: ExampleInputs | Sequence[ExampleInputs | None] | None = None,
    trace: bool = True,
    strict: bool = False,
) -> MemoryEstimate:
    """Bytes the optimizer ``get_optimizer(config, model, overrides)`` holds after its first step,
    per group, per algorithm and per rank, and its orthogonalisation FLOPs per step per rank; from
    shapes alone (``model`` may be on the meta device), nothing allocated.

    Args:
        config, model, overrides: As :func:`~optzoo.get_optimizer` takes them.
        world_size: Ranks of the data-parallel group (with ``mesh``: its size, or 1 for the mesh's).
        distributed: ``layer_wise``, ``sharded``, ``fsdp2`` or ``none`` (every rank steps
            everything); default: ``fsdp2`` with ``mesh``, else the config's
            ``use_layer_wise_distributed_optimizer`` / ``use_distributed_optimizer``, else ``none``.
        mesh: FSDP2's device mesh (a :class:`~optzoo.mesh_plan.MeshSpec` or ``--mesh``'s text:
            ``N``, ``RxS``, ``dp=2,tp=2``); ``tp`` adds a tensor-parallel dim; default with
            ``distributed="fsdp2"``: FSDP over ``world_size`` ranks.
        tp_plan: Which params TP shards (``GLOB=STYLE`` rules or their parsed form); default the
            model's ``base_model_tp_plan``, else :data:`~optzoo.mesh_plan.DEFAULT_TP_PLAN`.
        tp_mode, bucket_size, fsdp_orthogonalize: Override the config's ``muon_tp_mode``,
            ``muon_bucket_size`` and ``muon_fsdp_orthogonalize`` (as ``dump-param-groups --mesh``).
        param_sync: The distributed optimizer's ``param_sync`` (its buffers differ).
        example_inputs, trace, strict: As :func:`~optzoo.resolve_group_configs`.

    Raises:
        ValueError: What ``get_optimizer`` would refuse in routing or dtypes; an unknown
            ``distributed``; a mesh with another ``distributed``, or whose size is not ``world_size``.

    Example:
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(64, 32)
        >>> result = estimate(OptimizerConfig(lr=1e-3), model)
        >>> result.algorithms(), result.ranks[0].state_bytes  # Adam: two fp32 moments and a step each
        ({'adam': 16648}, 16648)
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    if not named_trainable_parameters(chunks):
        raise ValueError("`model`: no trainable parameters; got a model without any; expected at least one")
    groups, _ = resolve_group_configs(config, chunks, overrides, strict=strict, example_inputs=example_inputs, trace=trace)
    check_param_dtypes(config, groups)
    if isinstance(tp_plan, str):
        tp_plan = parse_tp_plan(tp_plan)
    return estimate_groups(
        config, groups, world_size=world_size, distributed=distributed, mesh=mesh, tp=tp,
        tp_plan=tp_plan if tp_plan is not None else model_tp_plan(chunks) or DEFAULT_TP_PLAN, tp_mode=tp_mode,
        bucket_size=bucket_size, fsdp_orthogonalize=fsdp_orthogonalize, param_sync=param_sync,
    )  # fmt: skip


def estimate_groups(
    config: OptimizerConfig,
    groups: Sequence[ResolvedGroup],
    *,
    world_size: int = 1,
    distributed: Distributed | None = None,
    mesh: MeshSpec | str | None = None,
    tp: int | None = None,
    tp_plan: TensorPlan = DEFAULT_TP_PLAN,
    tp_mode: TPMode | None = None,
    bucket_size: int | None = None,
    fsdp_orthogonalize: str | None = None,
    param_sync: ParamSync = "all_gather",
) -> MemoryEstimate:
    """:func:`estimate` over groups already resolved (``optzoo estimate`` routes once for all its output)."""
    if isinstance(mesh, str) or (mesh is None and tp is not None):
        mesh = parse_mesh(mesh if isinstance(mesh, str) else str(world_size), tp)
    if distributed is None:
        distributed = (
            "fsdp2" if mesh is not None
            else "layer_wise" if config.use_layer_wise_distributed_optimizer
            else "sharded" if config.use_distributed_optimizer
            else "none"
        )  # fmt: skip
    if distributed not in get_args(Distributed):
        raise ValueError(f"`distributed`: unknown value; got {distributed!r}; expected one of {list(get_args(Distributed))}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size`: must be a positive integer; got {world_size!r}; expected an integer >= 1")
    if mesh is not None and distributed != "fsdp2":
        raise ValueError(
            f"`mesh`: is FSDP2's device mesh; got a mesh with distributed={distributed!r}; expected distributed='fsdp2' "
            "(the layer-wise and ZeRO-1 optimizers refuse FSDP2 params)"
        )
    if distributed == "fsdp2":
        mesh = mesh if mesh is not None else parse_mesh(str(world_size))
        if world_size not in (1, mesh.world_size):
            raise ValueError(
                f"`world_size`: must be the mesh's size; got {world_size} with a mesh of {mesh.describe()}; "
                f"expected {mesh.world_size} (or leave it at 1)"
            )
        world_size = mesh.world_size
    if param_sync not in get_args(ParamSync):
        raise ValueError(f"`param_sync`: unknown value; got {param_sync!r}; expected 'all_gather' or 'broadcast'")
    params = _params(config, groups)
    whole = tuple(
        GroupEstimate(
            group.index, group.optimizer, len(group.params), sum(p.param.numel() for p in group.params),
            sum(p.state_bytes(p.shape) for p in params if p.group is group),
        )
        for group in groups
    )  # fmt: skip
    if distributed == "fsdp2":
        assert isinstance(mesh, MeshSpec)
        plans = plan_mesh(groups, mesh, tp_plan=tp_plan, tp_mode=tp_mode, bucket_size=bucket_size, fsdp_orthogonalize=fsdp_orthogonalize)
        layouts = _fsdp2_layouts(params, mesh, tp_plan)
        ranks = tuple(_fsdp2_rank(config, layouts, mesh, plans, rank) for rank in range(world_size))
        return MemoryEstimate(_precision(config), distributed, world_size, whole, ranks, mesh, tuple(plans))
    if distributed == "none":  # every rank steps everything: one rank's numbers, for each
        one = _rank_of(config, [(p, p.shape, True) for p in params], 0, 0, params)
        ranks = tuple(dataclasses.replace(one, rank=rank) for rank in range(world_size))
        return MemoryEstimate(_precision(config), distributed, world_size, whole, ranks)
    plan = plan_shards(groups, world_size, distributed)
    by_name = {p.name: p for p in params}
    owned: list[list[tuple[_Param, tuple[int, ...], bool]]] = [[] for _ in range(world_size)]
    sizes: dict[torch.dtype, list[int]] = {}
    for shard in plan.shards:
        param = by_name[shard.name]
        owned[shard.rank].append((param, param.shape if shard.whole else (shard.stop - shard.start,), shard.whole))
        sizes.setdefault(param.dtype, [0] * world_size)[shard.rank] += shard.stop - shard.start
    # DistributedOptimizer's buffers: per model dtype, one per rank of the group (all-gather pads them)
    sync = sum(
        (max(per_rank) * world_size if param_sync == "all_gather" else sum(per_rank)) * _itemsize(dtype)
        for dtype, per_rank in sizes.items()
    )  # fmt: skip
    ranks = tuple(_rank_of(config, owned[rank], sync, rank, params) for rank in range(world_size))
    return MemoryEstimate(_precision(config), distributed, world_size, whole, ranks)


def _rank_of(
    config: OptimizerConfig, owned: Sequence[tuple[_Param, tuple[int, ...], bool]], sync: int, rank: int, params: Sequence[_Param]
) -> RankEstimate:
    """One rank that steps ``owned`` (each param with the shape it steps, and whether whole), under
    DDP or a layer-wise / ZeRO-1 plan; every rank keeps the whole model's gradients."""
    state = main = grad = 0
    flops = 0.0
    for param, shape, whole in owned:
        state += param.state_bytes(shape)
        more_main, more_grad = _buffers(config, param, math.prod(shape), whole=whole)
        main, grad = main + more_main, grad + more_grad
        flops += param.update_cost() if whole else 0.0
    model_grads = sum(math.prod(p.shape) * _itemsize(p.dtype) for p in params)
    return RankEstimate(rank, state, main, grad, sync, (), model_grads, flops)


def _coordinate(mesh: MeshSpec, rank: int) -> dict[str, int]:
    coordinate: dict[str, int] = {}
    for name, size in reversed(mesh.dims):
        rank, coordinate[name] = divmod(rank, size)
    return coordinate


def _rank_on(home: MeshSpec, coordinate: Mapping[str, int]) -> int:
    """The rank, on the mesh a param lives on, of the rank at ``coordinate`` of the whole mesh."""
    rank = 0
    for name, size in home.dims:
        rank = rank * size + coordinate[name]
    return rank


def _fsdp2_layouts(params: Sequence[_Param], mesh: MeshSpec, tp_plan: TensorPlan) -> list[tuple[_Param, MeshSpec, ShardLayout]]:
    """Each param, the mesh it lives on and where ``fully_shard`` (after the TP plan) puts its elements."""
    found = []
    for param in params:
        style = tp_style(param.name, tp_plan)[0] if "tp" in dict(mesh.dims) else "replicate"
        home = param_mesh(style, mesh)
        found.append((param, home, ShardLayout.of(param.shape, home.shape, mesh_placements(param.shape, style, mesh))))
    return found


def _fsdp2_rank(
    config: OptimizerConfig, layouts: Sequence[tuple[_Param, MeshSpec, ShardLayout]], mesh: MeshSpec, plans: Sequence[MeshPlan], rank: int
) -> RankEstimate:
    """One rank under FSDP2: its local shard of every param, and its share of the owner-computes plans."""
    coordinate = _coordinate(mesh, rank)
    state = main = grad = model_grads = 0
    flops = 0.0
    planned = {name for plan in plans for name in plan.shapes}
    for param, home, layout in layouts:
        box = layout.boxes[_rank_on(home, coordinate)]
        local = box_shape(box) if box is not None else (0,) * len(param.shape)
        numel = math.prod(local)
        state += param.state_bytes(local)
        more_main, more_grad = _buffers(config, param, numel, whole=True)
        main, grad = main + more_main, grad + more_grad
        model_grads += numel * _itemsize(param.dtype)
        if param.name not in planned:  # gathered whole on every rank (a forward's view, or no owner-computes)
            flops += param.update_cost()
    transient: list[int] = []
    for plan in plans:
        home_rank = _rank_on(plan.mesh, coordinate)
        flops += plan.plan.loads[home_rank]
        transient += [bucket.transient[home_rank] for bucket in plan.plan.buckets]
    return RankEstimate(rank, state, main, grad, 0, tuple(transient), model_grads, flops)
