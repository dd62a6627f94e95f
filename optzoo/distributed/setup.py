"""Setting up the distributed optimizers: the data-parallel group, and checks that fail fast.

Everything here runs while ``get_optimizer`` builds, before any collective sized by the params:
which process group to shard over (``process_group``, Megatron's ``pg_collection``, or the FSDP2
mesh of DTensor params), a fingerprint exchange that stops ranks that resolved different
parameters, and :func:`preserve_param_attributes` for ``fully_shard``, which drops the attributes
routing reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optzoo._common import shorten
from optzoo.config import OptimizerConfig
from optzoo.groups import ResolvedGroup
from optzoo.routing import RoutedParam

__all__ = [
    "ExpertLayout",
    "check_same_model",
    "check_same_settings",
    "collective_settings",
    "data_parallel_group",
    "distributed_flag",
    "expert_data_parallel_group",
    "expert_layout",
    "MeshParam",
    "is_expert",
    "fsdp_process_group",
    "mesh_params",
    "mesh_process_group",
    "replicated_params",
    "preserve_param_attributes",
    "resolve_process_group",
    "resolved_settings",
]


@contextlib.contextmanager
def preserve_param_attributes(model: torch.nn.Module) -> Iterator[None]:
    """Put routing attributes back on params that the block replaces, matched by name.

    FSDP2's ``fully_shard`` registers new (DTensor) parameters and drops the attributes set on
    the old ones (``is_embedding_or_output_parameter``, ``qkv_split_shapes``, ``use_muon``), which
    would silently change the routing: embeddings would go to Muon, QKV would not be split.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> model.weight.use_muon = False
        >>> with preserve_param_attributes(model):
        ...     model.weight = torch.nn.Parameter(model.weight.detach().clone())  # as fully_shard does
        >>> model.weight.use_muon
        False
    """
    attributes = {name: dict(param.__dict__) for name, param in model.named_parameters()}
    yield
    for name, param in model.named_parameters():
        for key, value in attributes.get(name, {}).items():
            if not hasattr(param, key):
                setattr(param, key, value)


def resolve_process_group(process_group: dist.ProcessGroup | None, flag: str) -> dist.ProcessGroup:
    """The group to shard over (default: the world); a clear error when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"`{flag}`: needs torch.distributed; got no initialised process group; expected "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun), or the flag False"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    return group


def is_expert(routed: RoutedParam) -> bool:
    """An expert param: Megatron's ``allreduce=False`` tag, or the ``expert`` role read from the model."""
    return "expert" in routed.roles.roles


EXPERT_RANKS = "expert data-parallel group ranks"
"""The one entry of :func:`collective_settings` that legitimately differs between ranks: it is
checked as a partition of the data-parallel group, not for equality."""


def collective_settings(
    process_group: dist.ProcessGroup,
    *,
    param_sync: str,
    expert_process_group: dist.ProcessGroup | None,
    config: OptimizerConfig,
) -> dict[str, Any]:
    """What, besides the config (every field of which :func:`resolved_settings` holds), decides
    which collectives a rank of the distributed optimizers calls.

    ``param_sync`` (all-gather or one broadcast per rank after each step), the data-parallel
    group's ranks, the expert data-parallel group's size (``None``: no expert plan, so no expert
    exchanges) and ranks (:data:`EXPERT_RANKS`: each rank's own group, so these must partition
    the data-parallel group rather than be equal), and whether the step's timers call barriers
    (``timers`` set and ``barrier_with_L1_time``). A rank that differs in any of them would call
    other collectives than the others and hang until the collective timeout.
    """
    experts = None if expert_process_group is None else tuple(dist.get_process_group_ranks(expert_process_group))
    return {
        "param_sync": repr(param_sync),
        "data-parallel group ranks": repr(dist.get_process_group_ranks(process_group)),
        "expert data-parallel group size": repr(None if experts is None else len(experts)),
        EXPERT_RANKS: experts,
        "timer barriers (timers set and barrier_with_L1_time)": repr(config.timers is not None and config.barrier_with_L1_time),
    }


def check_same_model(
    groups: Sequence[ResolvedGroup],
    process_group: dist.ProcessGroup,
    *,
    experts: bool | None = None,
    collectives: Mapping[str, Any] | None = None,
) -> None:
    """Fail fast, on every rank, when ranks resolved different params or groups, or other collectives.

    Ranks exchange one fingerprint (names, shapes, dtypes, group configs) before any collective
    sized by the params, which would otherwise hang or corrupt memory. ``experts``: compare
    only the expert params (``True``) or only the others (``False``); expert-parallel ranks hold
    different experts, so those are compared within their expert data-parallel group.
    ``collectives`` (:func:`collective_settings`) are compared first: ranks that differ there
    may have compared different subsets of their params.
    """
    described = [
        (group.index, group.optimizer, name, tuple(routed.param.shape), str(routed.param.dtype))
        for group in groups
        for routed, name in zip(group.params, group.param_names)
        if experts is None or is_expert(routed) == experts
    ]
    settings = resolved_settings(groups)
    my_collectives = dict(collectives or {})
    digest = hashlib.sha256(repr((described, settings)).encode()).hexdigest()
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, (digest, described, settings, my_collectives), group=process_group)
    mine = dist.get_rank(process_group)
    _check_same_collectives([entry[3] for entry in everyone], dist.get_process_group_ranks(process_group), mine)
    for rank, (other_digest, other, other_settings, _) in enumerate(everyone):
        if other_digest == digest:
            continue
        if other == described:
            _raise_different_settings(settings, other_settings, rank, mine)
        ours, theirs = set(described), set(other)
        raise ValueError(
            f"distributed optimizer: rank {rank} resolved different parameters than rank {mine}; "
            f"got only on rank {rank}: [{shorten([repr(d) for d in sorted(theirs - ours)])}]; "
            f"expected also: [{shorten([repr(d) for d in sorted(ours - theirs)])}] (only on rank {mine}); "
            "every rank must build the same model and routing"
        )


def _check_same_collectives(everyone: list[dict[str, Any]], members: list[int], mine: int) -> None:
    """Every rank's :func:`collective_settings` equal, but for the expert groups, which must each be
    the same on all of its members (a partition): the same verdict on every rank, from the same list."""
    equal = [{key: value for key, value in entry.items() if key != EXPERT_RANKS} for entry in everyone]
    for rank, settings in enumerate(equal):
        if settings != equal[mine]:
            _raise_different_settings(equal[mine], settings, rank, mine)
    for rank, entry in enumerate(everyone):
        group = entry.get(EXPERT_RANKS)
        for member in group or ():
            other = members.index(member) if member in members else None
            if other is not None and everyone[other].get(EXPERT_RANKS) != group:
                # Raised on every rank (each sees the whole list): name the first inconsistent pair.
                theirs = {EXPERT_RANKS: list(everyone[other][EXPERT_RANKS] or [])}
                _raise_different_settings({EXPERT_RANKS: list(group or ())}, theirs, other, rank)


def resolved_settings(groups: Sequence[ResolvedGroup]) -> dict[str, str]:
    """Every group's effective hyperparameters and resolved config fields (precision flags, clip,
    loss scale, ...), as comparable strings; ``timers`` (an object) is left out."""
    settings: dict[str, str] = {}
    for group in groups:
        summary = group.summary()
        for key in ("optimizer", "lr", "min_lr", "weight_decay", "wd_mult", "override", "flatten"):
            settings[f"param group #{group.index} {key}"] = repr(summary.get(key))
        for key, value in summary["config"].items():
            if key != "timers":
                settings[f"param group #{group.index} {key}"] = repr(value)
    return settings


def _raise_different_settings(ours: Mapping[str, Any], theirs: Mapping[str, Any], rank: int, mine: int) -> None:
    differing = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
    shown = "; ".join(f"{key} = {theirs.get(key)} on rank {rank}, {ours.get(key)} on rank {mine}" for key in differing[:5])
    raise ValueError(
        f"distributed optimizer: rank {rank} resolved other settings than rank {mine}; got {shown}"
        f"{f' (+{len(differing) - 5} more)' if len(differing) > 5 else ''}; expected the same config, "
        "precision flags, overrides and get_optimizer arguments (param_sync, process groups) on every rank "
        "(one step would mix them, or a collective would abort or hang)"
    )


def check_same_settings(groups: Sequence[ResolvedGroup], process_group: dist.ProcessGroup) -> None:
    """Fail fast, on every rank, when ranks resolved other settings (FSDP2, where each rank holds
    its own shards of the same params: only the settings are compared)."""
    settings = resolved_settings(groups)
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, settings, group=process_group)
    mine = dist.get_rank(process_group)
    for rank, other in enumerate(everyone):
        if other != settings:
            _raise_different_settings(settings, other, rank, mine)


MeshParam = tuple[str, torch.Tensor, bool]
"""A param as the mesh checks see it: its name, the tensor (a DTensor under FSDP2 or TP) and
whether it is an expert param (:func:`is_expert`)."""


def mesh_params(groups: Sequence[ResolvedGroup]) -> list[MeshParam]:
    """Every routed param of ``groups`` as a :data:`MeshParam`."""
    return [(name, routed.param, is_expert(routed)) for group in groups for routed, name in zip(group.params, group.param_names)]


def fsdp_process_group(groups: Sequence[ResolvedGroup]) -> dist.ProcessGroup | None:
    """The group the step reduces the grad norm, the inf flag and the zero count over when params
    are DTensors (FSDP2's ``fully_shard``, tensor parallelism), or ``None`` without DTensors.

    :func:`mesh_process_group` of ``groups``' params.
    """
    return mesh_process_group(mesh_params(groups))


def _root(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (``mesh["dp"]`` of a (dp, tp) mesh: the (dp, tp) mesh), or itself."""
    getter = getattr(mesh, "_get_root_mesh", None)
    root = getter() if getter is not None else None
    return root if root is not None else mesh


def _describe(name: str, param: DTensor) -> str:
    mesh = param.device_mesh
    return f"`{name}` with placements {tuple(param.placements)} on mesh {mesh.mesh_dim_names or ()} {mesh.mesh.tolist()}"


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
"""Groups :func:`mesh_process_group` created, by ranks: one per rank set for the whole process."""


def mesh_process_group(params: Sequence[MeshParam]) -> dist.ProcessGroup | None:
    """One group spanning every rank that holds any of the DTensor ``params``, or ``None`` without DTensors.

    Params may live on any meshes ``fully_shard`` and ``parallelize_module`` produce: N-D meshes
    (HSDP's (replicate, shard), FSDP x TP's (dp, tp)), 1-D sub-meshes of one root mesh (FSDP x
    TP's ``mesh["dp"]`` for the params TP leaves whole, a flattened (edp, ep) mesh), and meshes of
    other roots whose ranks lie within one root's (the expert data-parallel mesh of
    ``init_device_mesh(...)["edp"]``). The group has the ranks of the largest root mesh: the world's
    group, a mesh's own group when one has exactly those ranks, else a new group (created once,
    by those ranks only: no other rank takes part). A rank counts each distinct piece of a param
    once in the sums over it (:func:`replicated_params`).

    Raises:
        ValueError: A param has a placement other than ``Shard``, ``_StridedShard`` or ``Replicate``
            (``Partial``: a pending sum the step cannot read as a gradient), or the params lie on
            meshes whose root meshes' ranks are not all within one of them (unrelated meshes: no
            group spans them on every rank the same way). The param and its placements are named.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    tensors = [(name, param) for name, param, _ in params if isinstance(param, DTensor)]
    if not tensors:
        return None
    for name, param in tensors:
        odd = [p for p in param.placements if not isinstance(p, (Shard, _StridedShard, Replicate))]
        if odd:
            raise ValueError(
                f"`model_chunks`: a DTensor param has a placement the optimizer cannot step; got {_describe(name, param)}; "
                "expected Shard, _StridedShard or Replicate on each mesh dim (what fully_shard and parallelize_module "
                "give; Partial is a pending reduction: reduce the gradients before the step)"
            )
    roots: dict[tuple[int, ...], tuple[str, DTensor]] = {}
    for name, param in tensors:
        roots.setdefault(tuple(sorted(_root(param.device_mesh).mesh.flatten().tolist())), (name, param))
    widest = max(roots, key=len)
    unrelated = [ranks for ranks in roots if not set(ranks) <= set(widest)]
    if unrelated:
        shown = "; ".join(f"ranks {list(ranks)} (first: {_describe(*first)})" for ranks, first in roots.items())
        raise ValueError(
            f"`model_chunks`: DTensor params lie on unrelated device meshes; got root meshes over {shown}; expected "
            "every mesh sliced from one root mesh (init_device_mesh once, then mesh[\"dp\"], mesh[\"tp\"], ...), or "
            "expert meshes whose ranks lie within it"
        )
    return _group_of(widest, [param.device_mesh for _, param in tensors])


def _group_of(ranks: tuple[int, ...], meshes: Sequence[Any]) -> dist.ProcessGroup:
    """A group over ``ranks``: a 1-D mesh's own (as for plain FSDP), the world's, or one created once."""
    for mesh in [_root(mesh) for mesh in meshes] + list(meshes):
        if mesh.ndim == 1 and tuple(sorted(mesh.mesh.tolist())) == ranks:
            found = mesh.get_group()
            assert isinstance(found, dist.ProcessGroup)
            return found
    if ranks == tuple(sorted(dist.get_process_group_ranks(dist.group.WORLD))):
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        return group
    cached = _GROUPS.get(ranks)
    if cached is not None:
        try:
            dist.get_process_group_ranks(cached)
            return cached
        except (KeyError, RuntimeError, ValueError):  # destroyed with its world (a new init_process_group)
            pass
    created = dist.new_group(list(ranks), use_local_synchronization=True)  # only its members call this
    assert isinstance(created, dist.ProcessGroup)
    _GROUPS[ranks] = created
    return created


Piece = tuple[str, tuple[int, ...] | None, tuple[int, ...], tuple[int, ...]]
"""A distinct piece of a param: its name, its expert mesh's ranks (``None`` for other params),
the global offset and the local shape of a rank's shard."""


def _pieces(params: Sequence[MeshParam]) -> list[tuple[Piece, int, tuple[int, ...], str]]:
    """This rank's :data:`Piece` of each DTensor param with elements, with its id, global shape and description."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    pieces = []
    for name, param, expert in params:
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
        if math.prod(shape) == 0:
            continue
        # Expert params of different expert-parallel ranks may share a (local) name and a place,
        # yet be other experts: they are told apart by their mesh.
        where = tuple(mesh.mesh.flatten().tolist()) if expert else None
        pieces.append(((name, where, tuple(offset), tuple(shape)), id(param), tuple(param.shape), _describe(name, param)))
    return pieces


def replicated_params(params: Sequence[MeshParam], group: dist.ProcessGroup) -> frozenset[int]:
    """The ids of this rank's DTensor params whose local piece a lower rank of ``group`` holds too:
    the step leaves them out of the grad norm and the zero count, so that each distinct piece of
    each param counts exactly once across the mesh (replicas over HSDP's replicate dim, over TP's
    ``Replicate``, and the implicit ones of a param on a sub-mesh, such as ``mesh["dp"]``'s
    LayerNorms under FSDP x TP, which every tp rank holds). A collective over ``group``, at
    setup: the step then sums as before, with no collective added.

    Raises:
        ValueError: A param's distinct pieces over the group do not tile it (overlapping shards,
            or elements no rank holds), on every rank, naming the param and its placements.
    """
    mine = _pieces(params)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, [(piece, shape, described) for piece, _, shape, described in mine], group=group)
    first_holder: dict[Piece, int] = {}
    covered: dict[tuple[str, tuple[int, ...] | None], list[Any]] = {}
    for rank, pieces in enumerate(everyone):
        for piece, shape, described in pieces:
            if piece not in first_holder:
                first_holder[piece] = rank
                entry = covered.setdefault(piece[:2], [0, shape, described])
                entry[0] += math.prod(piece[3])
    for (name, _), (elements, shape, described) in sorted(covered.items(), key=lambda item: repr(item[0])):
        if elements != math.prod(shape):
            raise ValueError(
                f"`model_chunks`: the ranks' shards of a DTensor param do not tile it; got {elements} distinct elements "
                f"over the ranks for {math.prod(shape)} in {described} (e.g.); expected every element in exactly one "
                "distinct shard (the layouts fully_shard and parallelize_module give)"
            )
    me = dist.get_rank(group)
    return frozenset(ident for piece, ident, _, _ in mine if first_holder[piece] != me)


def distributed_flag(config: OptimizerConfig) -> str | None:
    """The distributed-optimizer flag the config sets (the layer-wise one wins), or ``None``."""
    if config.use_layer_wise_distributed_optimizer:
        return "use_layer_wise_distributed_optimizer"
    return "use_distributed_optimizer" if config.use_distributed_optimizer else None


def data_parallel_group(
    config: OptimizerConfig,
    groups: Sequence[ResolvedGroup],
    *,
    process_group: dist.ProcessGroup | None,
    pg_collection: Any,
) -> dist.ProcessGroup | None:
    """The group the step reduces over and the distributed optimizers shard over.

    ``process_group``, or ``pg_collection``'s ``dp_cp`` (else ``dp``) group, or the world, under a
    distributed-optimizer flag; without one, the FSDP2 mesh's group for DTensor params, else none.

    Raises:
        ValueError: Both ``process_group`` and ``pg_collection`` are given, ``pg_collection`` has
            no data-parallel group, a group is given without a distributed flag, a flag is set
            without an initialised process group, or a flag is set with FSDP2 params.
    """
    if pg_collection is not None:
        if process_group is not None:
            raise ValueError(
                "`pg_collection`: gives the data-parallel group, and so does `process_group`; got both; "
                "expected only one of them"
            )
        process_group = getattr(pg_collection, "dp_cp", None) or getattr(pg_collection, "dp", None)
        if not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(
                f"`pg_collection`: has no data-parallel process group; got {type(pg_collection).__name__} "
                f"with dp_cp/dp = {process_group!r}; expected a torch.distributed.ProcessGroup in `dp_cp` or `dp`"
            )
    flag = distributed_flag(config)
    if flag is None:
        if process_group is not None:
            raise ValueError(
                "`process_group`: only used by the distributed optimizers; got a process group with "
                "use_distributed_optimizer=False and use_layer_wise_distributed_optimizer=False; "
                "expected one of them True, or process_group=None"
            )
        return fsdp_process_group(groups)
    process_group = resolve_process_group(process_group, flag)
    if fsdp_process_group(groups) is not None:
        raise ValueError(
            f"`{flag}`: FSDP2 (fully_shard) already shards params and optimizer state; got DTensor "
            f"params with {flag}=True; expected {flag}=False with FSDP2"
        )
    return process_group


def _check_expert_group_within(expert: dist.ProcessGroup, data_parallel: dist.ProcessGroup, subject: str) -> None:
    """The expert data-parallel group must lie in the data-parallel group and divide it (expert-parallel ×
    expert-data-parallel = data-parallel), so that a sum over the data-parallel group counts each
    expert element once: the grad norm and the inf flag are reduced over that group alone."""
    experts, everyone = dist.get_process_group_ranks(expert), dist.get_process_group_ranks(data_parallel)
    if not set(experts) <= set(everyone) or len(everyone) % len(experts):
        raise ValueError(
            f"{subject}: must be a subgroup of the data-parallel group whose size divides it "
            f"(expert-parallel x expert-data-parallel = data-parallel); got ranks {experts} against {everyone}; "
            "expected e.g. pg_collection.expt_dp with pg_collection.dp_cp"
        )


def expert_data_parallel_group(
    groups: Sequence[ResolvedGroup],
    *,
    expert_process_group: dist.ProcessGroup | None,
    pg_collection: Any,
    data_parallel: dist.ProcessGroup | None,
    flag: str | None,
) -> dist.ProcessGroup | None:
    """The group expert params are owned or sharded over by the distributed optimizers (Megatron-Core's
    ``expt_dp``), or ``None`` when it is the data-parallel group (no expert parallelism).

    Raises:
        ValueError: Both ``expert_process_group`` and ``pg_collection.expt_dp`` are given, it is not
            a process group, it is given without a distributed-optimizer flag (FSDP2's expert mesh
            says it instead), or it does not lie in and divide the data-parallel group.
    """
    collected = getattr(pg_collection, "expt_dp", None) if pg_collection is not None else None
    if collected is not None:
        if expert_process_group is not None:
            raise ValueError(
                "`expert_process_group`: given, and pg_collection.expt_dp gives it too; got both; expected only one of them"
            )
        if not isinstance(collected, dist.ProcessGroup):
            raise ValueError(
                f"`pg_collection`: its expert data-parallel group is not a process group; got expt_dp = {collected!r}; "
                "expected a torch.distributed.ProcessGroup, or None"
            )
        expert_process_group = collected
    if expert_process_group is None:
        return None
    if not isinstance(expert_process_group, dist.ProcessGroup):
        raise ValueError(
            f"`expert_process_group`: not a process group; got {type(expert_process_group).__name__}; "
            "expected a torch.distributed.ProcessGroup (e.g. from dist.new_group), or None"
        )
    if flag is None:
        raise ValueError(
            "`expert_process_group`: only used by the distributed optimizers (under FSDP2 the expert params' "
            "mesh gives it); got a process group with use_distributed_optimizer=False and "
            "use_layer_wise_distributed_optimizer=False; expected one of them True, or expert_process_group=None"
        )
    assert data_parallel is not None  # a flag gives a data-parallel group
    _check_expert_group_within(expert_process_group, data_parallel, "`expert_process_group`")
    if dist.get_process_group_ranks(expert_process_group) == dist.get_process_group_ranks(data_parallel):
        return None  # no expert parallelism: one plan over the one group
    return expert_process_group


@dataclass(frozen=True)
class ExpertLayout:
    """Where the expert params of the other expert-parallel ranks are, for consolidated checkpoints.

    With global expert names (an expert keeps its name whatever rank holds it, e.g.
    ``experts.5.w1`` on the rank that holds experts 4–7), the consolidated state dict holds every
    expert: ``elsewhere`` maps each expert param that other expert-parallel ranks hold to its
    group index and shape. With local names (Megatron's ``local_experts.0`` on every rank), names
    repeat across expert-parallel ranks, the consolidated dict holds this rank's experts only
    (one checkpoint per expert-parallel rank, as Megatron-Core saves them), and ``elsewhere`` is
    empty.
    """

    group: dist.ProcessGroup
    global_names: bool
    elsewhere: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    peers: tuple[int, ...] = ()
    """Ranks of the data-parallel group in this rank's expert data-parallel group (group ranks)."""


def expert_layout(groups: Sequence[ResolvedGroup], data_parallel: dist.ProcessGroup, expert: dist.ProcessGroup) -> ExpertLayout:
    """A collective over the data-parallel group: every rank's expert names, to tell global naming from local.

    Raises:
        ValueError: Expert names overlap between expert-parallel ranks without being the same set.
    """
    mine = {
        name: (group.index, tuple(routed.param.shape))
        for group in groups
        for routed, name in zip(group.params, group.param_names)
        if is_expert(routed)
    }
    members = tuple(dist.get_process_group_ranks(expert))
    everyone: list[Any] = [None] * dist.get_world_size(data_parallel)
    dist.all_gather_object(everyone, (members, mine), group=data_parallel)
    dp_ranks = dist.get_process_group_ranks(data_parallel)
    peers = tuple(k for k, global_rank in enumerate(dp_ranks) if global_rank in members)
    others: dict[str, tuple[int, tuple[int, ...]]] = {}
    for other_members, names in everyone:
        if other_members != members:
            others.update(names)
    if not others or set(others) == set(mine):
        return ExpertLayout(expert, global_names=False, peers=peers)
    if set(others) & set(mine):
        raise ValueError(
            "expert parallelism: expert param names overlap between expert-parallel ranks without being the same; "
            f"got [{shorten(sorted(set(others) & set(mine)))}] on several; expected every expert-parallel rank's "
            "experts under their own (global) names, or the same (local) names on every rank"
        )
    return ExpertLayout(expert, global_names=True, elsewhere=others, peers=peers)
