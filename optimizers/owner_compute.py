"""Owner-computes under FSDP2 on any device mesh: each matrix orthogonalised once, in buckets that hold their memory.

A DTensor param on a mesh of any number of dims (FSDP's shard dim, HSDP's replicate dim, tensor
parallel dims) gives every rank of the mesh one *box* of the param: a contiguous range per tensor
dim (:class:`ShardLayout`, from torch's own placement arithmetic), empty on some ranks, the same
on replicas. Newton–Schulz needs whole matrices. Each matrix (a 2-D param, one matrix of an expert
stack, a flattened filter; under ``tp_mode="blockwise"`` each tensor-parallel block of one) is a
:class:`Unit` with an owner rank: a rank that already holds it whole keeps it, the rest go,
largest Newton–Schulz cost first, to the least-loaded rank, the load carried across buckets.
Under ``tp_mode="duplicated"`` every tensor-parallel rank class gets an owner of its own, as
Megatron-Core's duplicated mode computes the whole matrix on every tensor-parallel rank; the
redundant path gives every rank its own class.

Units are packed into buckets whose transient bytes per rank (pieces sent and received, the whole
matrices, Newton–Schulz's workspace, the results) stay under ``bucket_size``. Per bucket, one
``all_to_all_single`` brings each owner the pieces of its matrices, the owner orthogonalises them
batched, and one more sends every rank its piece of the results (or the whole result where the
update needs it whole). Two buckets are in flight: the next bucket's pieces travel while this
bucket's Newton–Schulz runs (:func:`orthogonalize_on_owners`).

Everything but the step itself is computed from shapes, placements and the mesh alone, identically
on every rank, so split sizes always match; :func:`plan_owner_compute` is the same plan without
processes (``optzoo dump-param-groups --mesh``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .._common import check_choice, local_shard
from .muon_ops import compute_dtype, matrix_shape
from .newton_schulz import newton_schulz_flops, newton_schulz_sharded, newton_schulz_sharded_cost

if TYPE_CHECKING:
    from .muon import Muon, _Block, _Prepared

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "OWNER_COMPUTES_MAX_SHARE",
    "Bucket",
    "OwnerPlan",
    "ShardLayout",
    "TPMode",
    "Transfer",
    "Unit",
    "assign_owners",
    "dim0_chunks",
    "orthogonalize_on_owners",
    "plan_owner_compute",
]

OWNER_COMPUTES_MAX_SHARE = 0.75
"""``auto`` computes on owners when the busiest owner gets at most this share of the Newton–Schulz FLOPs."""

DEFAULT_BUCKET_SIZE = 1 << 30
"""Default cap on each rank's transient bytes per bucket (1 GiB): with two buckets in flight, at
most 2 GiB per rank beyond the optimizer's state, whatever the model's size; a matrix that alone
needs more is a bucket of its own."""

TPMode = Literal["auto", "duplicated", "distributed", "blockwise", "layer_sharded"]
"""How a matrix sharded by tensor parallelism is orthogonalised (Megatron-Core's ``muon_tp_mode``,
plus ``layer_sharded`` of Megatron-LM #6683): see :class:`~optzoo.optimizers.muon.Muon`."""

Range = tuple[int, int]
Box = tuple[Range, ...]
"""A block of a tensor: ``[start, stop)`` per dim."""


def dim0_chunks(shape: Sequence[int], world_size: int) -> list[Range]:
    """Each rank's flat element range of a param sharded on dim 0 as ``fully_shard`` does (``torch.chunk``).

    Example:
        >>> dim0_chunks((5, 2), 4)  # chunks of ceil(5 / 4) = 2 rows; the last rank holds none
        [(0, 4), (4, 8), (8, 10), (10, 10)]
    """
    _check_world_size(world_size)
    rows = shape[0] if shape else 1
    inner = math.prod(shape[1:])
    chunk = -(-rows // world_size)
    return [(min(r * chunk, rows) * inner, min((r + 1) * chunk, rows) * inner) for r in range(world_size)]


# ---- geometry -----------------------------------------------------------------------------------


def intersect(a: Box, b: Box) -> Box | None:
    """The common block of ``a`` and ``b``, or ``None`` if they share no element."""
    box = tuple((max(lo, low), min(hi, high)) for (lo, hi), (low, high) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def _within(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` as slices of a tensor holding ``origin`` (which contains it)."""
    return tuple(slice(lo - start, hi - start) for (lo, hi), (start, _) in zip(box, origin))


def _shard_dim(placement: Placement) -> int | None:
    """The tensor dim a placement shards (``Shard`` or FSDP-over-TP's ``_StridedShard``), else ``None``."""
    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


@dataclass(frozen=True)
class ShardLayout:
    """Where a DTensor param's elements live: the box each rank of its mesh holds, from shapes alone.

    Ranks are the exchange group's ranks, in the mesh's row-major order. ``tp_dims`` are the mesh
    dims tensor parallelism shards the param over: ``fully_shard`` puts its data-parallel dims
    first (HSDP's replicate dim, then its dim-0 shard dim) and ``parallelize_module``'s dims
    after them, so they are the sharding dims after the first dim-0 shard (every sharding dim
    where no dim-0 shard precedes them: a param tensor parallelism alone shards on dim 1).

    Example:
        >>> layout = ShardLayout.of((4, 6), (2, 2), (Replicate(), Shard(0)))  # HSDP 2 x 2
        >>> layout.boxes
        (((0, 2), (0, 6)), ((2, 4), (0, 6)), ((0, 2), (0, 6)), ((2, 4), (0, 6)))
        >>> ShardLayout.of((4, 6), (2, 2), (Shard(0), Shard(1))).tp_dims  # FSDP 2 x TP 2, row-parallel
        (1,)
    """

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    boxes: tuple[Box | None, ...]
    tp_dims: tuple[int, ...]

    @classmethod
    def of(cls, shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> ShardLayout:
        shape, mesh_shape = tuple(shape), tuple(mesh_shape)
        boxes: list[Box | None] = []
        for coordinate in itertools.product(*(range(size) for size in mesh_shape)):
            local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), list(placements))
            box = tuple((start, start + size) for start, size in zip(offset, local))
            boxes.append(box if all(size > 0 for size in local) else None)
        dims = [_shard_dim(p) for p in placements]
        first = next((d for d, tensor_dim in enumerate(dims) if tensor_dim == 0), None)
        strided = first is not None and isinstance(placements[first], _StridedShard)  # FSDP over TP's dim-0 shards
        tp = tuple(
            d for d, tensor_dim in enumerate(dims)
            if tensor_dim is not None and (first is None or d > first and (tensor_dim != 0 or strided))
        )  # fmt: skip
        return cls(shape, mesh_shape, tuple(placements), tuple(boxes), tp)

    @property
    def world_size(self) -> int:
        return len(self.boxes)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        coordinate = []
        for size in reversed(self.mesh_shape):
            rank, rest = divmod(rank, size)
            coordinate.append(rest)
        return tuple(reversed(coordinate))

    def tp_class(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinate on the tensor-parallel dims: ranks of one class hold the same TP block."""
        coordinate = self.coordinate(rank)
        return tuple(coordinate[d] for d in self.tp_dims)

    def tp_block(self, tp_class: tuple[int, ...]) -> Box | None:
        """The block of the param the ranks of a tensor-parallel class hold together (their boxes' span)."""
        boxes = [box for rank, box in enumerate(self.boxes) if box is not None and self.tp_class(rank) == tp_class]
        if not boxes:
            return None
        return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(self.shape)))


# ---- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Unit:
    """One matrix to orthogonalise whole: a box of a param, who holds its pieces, and who computes it.

    ``owners`` has one rank per class; ``classes[rank]`` is the class whose owner serves ``rank``
    (one class: computed once across the mesh).
    """

    key: Hashable  # what the caller knows the matrix by
    box: Box
    layout: ShardLayout
    cost: float  # Newton–Schulz FLOPs
    itemsize: int
    classes: tuple[int, ...]
    owners: tuple[int, ...] = ()
    whole: bool = False  # every rank gets the whole result back (the update needs it whole)
    rows: int = 0  # the matrix it is orthogonalised as
    cols: int = 0
    parts: tuple[Box, ...] | None = None  # ``distributed``: per class, the TP block its owner holds of the matrix
    tp_dim: int | None = None  # ``distributed``: the mesh dim of the TP group that orthogonalises the parts together
    split: Literal[-2, -1] | None = None  # ``distributed``: the matrix dim the parts split (rows, cols)
    steps: int = 5  # Newton–Schulz iterations

    @property
    def numel(self) -> int:
        return box_numel(self.box)

    def piece(self, rank: int) -> Box | None:
        """The part of the matrix ``rank`` holds (``None``: none)."""
        held = self.layout.boxes[rank]
        return None if held is None else intersect(self.box, held)

    def part(self, cls: int) -> Box:
        """What the owner of class ``cls`` orthogonalises: the matrix, or (``distributed``) its TP block of it."""
        return self.box if self.parts is None else self.parts[cls]

    def cost_per_owner(self) -> float:
        """Newton–Schulz FLOPs on each owner: the whole cost, or (``distributed``) the busiest TP
        rank's share of the sharded loop, which repeats the Gram's square on every rank."""
        if self.parts is None or self.split is None:
            return self.cost
        return float(newton_schulz_sharded_cost(
            self.rows, self.cols, shard_dim=self.split, world_size=len(self.parts), steps=self.steps,
            compute_dtype=torch.float64 if self.itemsize == 8 else torch.float32,
        ).flops)  # fmt: skip


@dataclass(frozen=True)
class Transfer:
    """A block of a unit sent from ``source`` to ``dest`` (a local copy where they are the same rank)."""

    unit: Unit
    box: Box
    source: int
    dest: int


@dataclass
class Bucket:
    """Units exchanged together, their transfers both ways, and each rank's bytes and FLOPs for it."""

    units: list[Unit] = field(default_factory=list)
    to_owners: list[Transfer] = field(default_factory=list)
    from_owners: list[Transfer] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # bytes per rank, both exchanges
    received: list[int] = field(default_factory=list)
    transient: list[int] = field(default_factory=list)  # bytes per rank held for the bucket (estimate)
    flops: list[float] = field(default_factory=list)


@dataclass
class OwnerPlan:
    """The buckets of one exchange group's step, in order, and each rank's total Newton–Schulz FLOPs."""

    world_size: int
    buckets: list[Bucket]
    loads: list[float]

    @property
    def busiest_share(self) -> float:
        total = sum(self.loads)
        return max(self.loads) / total if total else 0.0


def _transfers(unit: Unit) -> tuple[list[Transfer], list[Transfer]]:
    """The unit's pieces to each owner (one sender per distinct piece, the nearest holder on the
    mesh), and the results back to every rank from the owner of its class."""
    world = unit.layout.world_size
    pieces: dict[Box, list[int]] = {}
    for rank in range(world):
        piece = unit.piece(rank)
        if piece is not None:
            pieces.setdefault(piece, []).append(rank)
    to: list[Transfer] = []
    for cls, owner in enumerate(unit.owners):
        here = unit.layout.coordinate(owner)
        for piece, holders in pieces.items():
            wanted = intersect(piece, unit.part(cls))
            if wanted is None:
                continue
            # the nearest holder: the owner itself, else one differing in inner mesh dims only
            # (HSDP's replicate dim is outer: across nodes), the lowest rank on a tie
            source = min(holders, key=lambda h: (tuple(a != b for a, b in zip(here, unit.layout.coordinate(h))), h))
            to.append(Transfer(unit, wanted, source, owner))
    back: list[Transfer] = []
    for rank in range(world):
        if unit.whole and unit.parts is not None:  # every part from its owner
            back.extend(Transfer(unit, part, owner, rank) for part, owner in zip(unit.parts, unit.owners))
            continue
        wanted = unit.box if unit.whole else unit.piece(rank)
        if wanted is not None:
            back.append(Transfer(unit, wanted, unit.owners[unit.classes[rank]], rank))
    return to, back


def newton_schulz_workspace(rows: int, cols: int) -> int:
    """Elements Newton–Schulz holds for one ``rows × cols`` matrix beyond its input, an upper bound
    (the normalised copy, an iterate and its successor, the small Gram and its polynomial, the output)."""
    small = min(rows, cols)
    return 4 * rows * cols + 3 * small * small


def _unit_bytes(unit: Unit, to: Sequence[Transfer], back: Sequence[Transfer], world: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """What one unit adds to each rank's bytes sent, received and held (transient), and FLOPs (a bucket's are their sums)."""
    sent, received, transient, flops = [0] * world, [0] * world, [0] * world, [0.0] * world
    for transfer in (*to, *back):
        size = box_numel(transfer.box) * unit.itemsize
        if transfer.source != transfer.dest:
            sent[transfer.source] += size
            received[transfer.dest] += size
            transient[transfer.source] += size
            transient[transfer.dest] += size
    for transfer in back:  # the result pieces a rank keeps until its params are applied
        transient[transfer.dest] += box_numel(transfer.box) * unit.itemsize
    for cls, owner in enumerate(unit.owners):
        # the matrix (its part), Newton–Schulz's workspace and the result, on its owner
        numel = box_numel(unit.part(cls))
        workspace = newton_schulz_workspace(unit.rows, unit.cols) * numel / unit.numel if unit.parts is None else (
            4 * numel + 3 * max(unit.rows, unit.cols) ** 2
        )  # a part's loop keeps a whole Gram of the dim the split contracts over
        transient[owner] += int((2 * numel + workspace) * unit.itemsize)
        flops[owner] += unit.cost_per_owner()
    return sent, received, transient, flops


def assign_owners(units: Sequence[Unit], loads: list[float]) -> list[Unit]:
    """Each unit with an owner per class: a rank of the class that holds it whole (the least
    loaded such), else the least-loaded rank of the class; largest cost first, ``loads`` updated.

    Example:
        >>> layout = ShardLayout.of((2, 2, 2), (2,), (Shard(0),))  # a 2-expert stack: one expert per rank
        >>> experts = [Unit(e, ((e, e + 1), (0, 2), (0, 2)), layout, 1.0, 4, (0, 0), rows=2, cols=2) for e in range(2)]
        >>> [unit.owners for unit in assign_owners(experts, [0.0, 0.0])]
        [(0,), (1,)]
    """
    assigned: dict[int, Unit] = {}
    for index in sorted(range(len(units)), key=lambda k: -units[k].cost):
        unit = units[index]
        if unit.parts is not None:
            assigned[index] = dataclasses.replace(unit, owners=_team(unit, loads))
            continue
        owners = []
        for cls in range(max(unit.classes) + 1):
            members = [r for r, c in enumerate(unit.classes) if c == cls]
            holding = [r for r in members if unit.piece(r) == unit.box]
            owner = holding[0] if len(holding) == 1 else _least_loaded(holding or members, loads)
            loads[owner] += unit.cost
            owners.append(owner)
        assigned[index] = dataclasses.replace(unit, owners=tuple(owners))
    return [assigned[k] for k in range(len(units))]


def _team(unit: Unit, loads: list[float]) -> tuple[int, ...]:
    """``distributed``: the ranks of the least-loaded TP group, one per TP class (the class's part)."""
    assert unit.tp_dim is not None
    layout = unit.layout
    teams: dict[tuple[int, ...], list[int]] = {}
    for rank in range(layout.world_size):
        coordinate = layout.coordinate(rank)
        teams.setdefault(coordinate[: unit.tp_dim] + coordinate[unit.tp_dim + 1 :], []).append(rank)  # in TP order
    team = min(teams.values(), key=lambda ranks: (max(loads[r] for r in ranks), ranks[0]))
    for rank in team:
        loads[rank] += unit.cost_per_owner()
    return tuple(team)


def _least_loaded(candidates: Sequence[int], loads: Sequence[float]) -> int:
    return min(candidates, key=lambda r: (loads[r], r))


def pack_buckets(units: Sequence[Unit], world: int, bucket_size: int) -> OwnerPlan:
    """Owners for ``units`` (largest cost first, the load carried from bucket to bucket) and the
    buckets they travel in: a bucket closes when adding a unit would take a rank's transient
    bytes past ``bucket_size`` (a unit that alone exceeds it is a bucket of its own)."""
    loads = [0.0] * world
    buckets: list[Bucket] = []
    current = _empty_bucket(world)
    for index in sorted(range(len(units)), key=lambda k: -units[k].cost):
        (unit,) = assign_owners([units[index]], loads)  # the same owners in whichever bucket it lands
        to, back = _transfers(unit)
        sent, received, transient, flops = _unit_bytes(unit, to, back, world)
        if current.units and max(held + more for held, more in zip(current.transient, transient)) > bucket_size:
            buckets.append(current)
            current = _empty_bucket(world)
        current.units.append(unit)
        current.to_owners.extend(to)
        current.from_owners.extend(back)
        for total, more in ((current.sent, sent), (current.received, received), (current.transient, transient)):
            for rank in range(world):
                total[rank] += more[rank]
        for rank in range(world):
            current.flops[rank] += flops[rank]
    if current.units:
        buckets.append(current)
    return OwnerPlan(world, buckets, loads)


def _empty_bucket(world: int) -> Bucket:
    return Bucket(sent=[0] * world, received=[0] * world, transient=[0] * world, flops=[0.0] * world)


def plan_owner_compute(
    matrices: Sequence[tuple[Hashable, Sequence[int], ShardLayout, tuple[int, int, int], int, int]],
    *,
    tp_mode: TPMode = "auto",
    redundant: bool = False,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    num_ns_steps: int | Callable[[Hashable], int] = 5,
    whole: Callable[[Hashable], bool] = lambda key: False,
    distributable: bool = True,
    per_replica: bool = False,
) -> OwnerPlan:
    """The owner-computes plan of one exchange group, from shapes alone.

    ``tp_mode="auto"`` chooses per weight: a tensor-parallel matrix whose Newton–Schulz costs
    more than an even share of the group's (``total / world_size``) would make its one owner the
    slowest rank, so it goes ``distributed`` (its TP group orthogonalises it together) where that
    costs the busiest TP rank fewer FLOPs than the whole matrix; every other matrix is
    ``layer_sharded`` (computed whole, once, by one owner).

    Args:
        matrices: per matrix ``(key, param shape, its layout, the param as (count, rows, cols)
            matrices, this matrix's index in that stack, element size in bytes)``.
        tp_mode: see :data:`TPMode`; ``blockwise`` cuts tensor-parallel params into their TP
            blocks, ``duplicated`` computes a tensor-parallel matrix once per TP rank class,
            ``distributed`` orthogonalises each TP block on a rank of one TP group, together.
        redundant: every rank computes every unit (its own class).
        bucket_size: the cap on each rank's transient bytes per bucket.
        num_ns_steps: Newton–Schulz iterations (for the cost), or a function of the matrix's key giving them.
        whole: whether a matrix's result goes whole to every rank.
        distributable: whether the optimizer's update can run ``distributed`` (Newton–Schulz, and a
            scale that depends on the shape alone); ``auto`` keeps every matrix whole if not.
        per_replica: HSDP's replicas each compute their own copy (owners per replicate
            coordinate), keeping results inside a replica, instead of sharing the work across
            them (the default); for measuring the two (``benchmarks/bench_distributed.py``).
    """
    check_choice("`tp_mode`", tp_mode, get_args(TPMode))
    check_bucket_size(bucket_size)
    units: list[Unit] = []
    for key, shape, layout, matrix, index, itemsize in matrices:
        steps = num_ns_steps(key) if callable(num_ns_steps) else num_ns_steps
        mode: TPMode = "layer_sharded" if tp_mode == "auto" else tp_mode
        units.extend(matrix_units(key, tuple(shape), layout, matrix, index, itemsize, tp_mode=mode, redundant=redundant,
                                  num_ns_steps=steps, whole=whole(key), per_replica=per_replica))  # fmt: skip
    if not units:
        return OwnerPlan(1, [], [0.0])
    world = units[0].layout.world_size
    if tp_mode == "auto" and distributable and not redundant:
        even = sum(unit.cost for unit in units) / world
        units = [_cheaper_distributed(unit) if unit.cost > even else unit for unit in units]
    return pack_buckets(units, world, bucket_size)


def matrix_units(
    key: Hashable, shape: tuple[int, ...], layout: ShardLayout, matrix: tuple[int, int, int], index: int, itemsize: int, *,
    tp_mode: TPMode, redundant: bool, num_ns_steps: int, whole: bool, per_replica: bool = False,
) -> list[Unit]:  # fmt: skip
    """The units one matrix of a param is orthogonalised in, owners not yet assigned: the matrix, or
    (``blockwise``, tensor-parallel params) each of its TP blocks, keyed ``(key, block)``."""
    count, rows, cols = matrix
    world = layout.world_size
    if redundant:
        classes = tuple(range(world))
    elif tp_mode in ("duplicated", "distributed") and layout.tp_dims:
        tp_classes = sorted({layout.tp_class(rank) for rank in range(world)})
        classes = tuple(tp_classes.index(layout.tp_class(rank)) for rank in range(world))
    else:
        classes = (0,) * world
    if per_replica and not redundant:  # one class per (replicate coordinate, class above)
        replicated = [d for d, p in enumerate(layout.placements) if isinstance(p, Replicate)]
        keys = [(tuple(layout.coordinate(r)[d] for d in replicated), classes[r]) for r in range(world)]
        classes = tuple(sorted(set(keys)).index(k) for k in keys)
    box = matrix_box(shape, count, index)
    cost = float(min(newton_schulz_flops(rows, cols, steps=num_ns_steps, variant=v) for v in ("standard", "gram")))
    one = Unit(key, box, layout, cost, itemsize, classes, whole=whole, rows=rows, cols=cols, steps=num_ns_steps)
    if tp_mode == "distributed" and not redundant and layout.tp_dims:
        distributed = _distributed(one)
        if distributed is not None:
            return [distributed]
        # not split along one matrix dim by one TP dim (or a TP block holds none of it): as duplicated
    if not whole:  # a class none of whose ranks holds a piece has no one to compute it for
        held = [(cls, layout.boxes[rank]) for rank, cls in enumerate(classes)]
        holding = sorted({cls for cls, b in held if b is not None and intersect(box, b) is not None})
        if holding and len(holding) < len(set(classes)):
            one = dataclasses.replace(one, classes=tuple(holding.index(cls) if cls in holding else 0 for cls in classes))
    if tp_mode != "blockwise" or not layout.tp_dims:
        return [one]
    units: list[Unit] = []
    for tp_class in sorted({layout.tp_class(rank) for rank in range(world)}):
        block = layout.tp_block(tp_class)
        part = intersect(box, block) if block is not None else None
        if part is None or any(part == unit.box for unit in units):
            continue
        part_shape = box_shape(part)
        r, c = (part_shape[-2], part_shape[-1]) if count > 1 or len(shape) == 2 else (part_shape[0], box_numel(part) // part_shape[0])
        cost = float(min(newton_schulz_flops(r, c, steps=num_ns_steps, variant=v) for v in ("standard", "gram")))
        units.append(dataclasses.replace(one, key=(key, part), box=part, cost=cost, rows=r, cols=c))
    return units


def _cheaper_distributed(unit: Unit) -> Unit:
    """``auto``: the unit ``distributed`` where that costs its busiest rank fewer FLOPs than the
    whole matrix costs one owner (not when the split is on the Gram's side: each rank would
    repeat a larger Gram), else as it is."""
    distributed = _distributed(unit)
    return distributed if distributed is not None and distributed.cost_per_owner() < unit.cost else unit


def _distributed(unit: Unit) -> Unit | None:
    """``unit`` as a ``distributed`` one: its TP blocks orthogonalised together by one TP group;
    ``None`` unless one TP dim splits it along one matrix dim into non-empty blocks."""
    layout = unit.layout
    if len(layout.tp_dims) != 1:
        return None
    tp_classes = sorted({layout.tp_class(rank) for rank in range(layout.world_size)})
    parts = []
    for tp_class in tp_classes:
        block = layout.tp_block(tp_class)
        part = intersect(unit.box, block) if block is not None else None
        if part is None:
            return None
        parts.append(part)
    split = {d for part in parts for d, (ours, whole) in enumerate(zip(part, unit.box)) if ours != whole}
    if len(split) != 1:
        return None
    (dim,) = split
    ndim = len(layout.shape)
    flattened = box_shape(unit.box)[-2:] != (unit.rows, unit.cols)  # an N-D param as one matrix: its dims 0 and 1
    matrix_dim: dict[int, Literal[-2, -1]] = {0: -2, 1: -1} if flattened else {ndim - 2: -2, ndim - 1: -1}
    if dim not in matrix_dim:
        return None
    classes = tuple(tp_classes.index(layout.tp_class(rank)) for rank in range(layout.world_size))
    return dataclasses.replace(unit, classes=classes, parts=tuple(parts), tp_dim=layout.tp_dims[0], split=matrix_dim[dim])


def matrix_box(shape: tuple[int, ...], count: int, index: int) -> Box:
    """The box of matrix ``index`` of a param seen as ``count`` matrices: one matrix (a 2-D param, a
    flattened filter) is the whole param; a stack's matrix is one position of its leading dims."""
    if count == 1:
        return tuple((0, size) for size in shape)
    lead: list[Range] = []
    for size in reversed(shape[:-2]):
        index, position = divmod(index, size)
        lead.append((position, position + 1))
    return (*reversed(lead), (0, shape[-2]), (0, shape[-1]))


# ---- the step on owners (Muon._update calls it first) -------------------------------------------


def orthogonalize_on_owners(optimizer: Muon, blocks: Sequence[_Block]) -> set[torch.Tensor]:
    """Owner-computes for the step's DTensor params, per exchange group (see the module
    docstring); returns the params it stepped (the rest take the plain path)."""
    by_group: dict[tuple[dist.ProcessGroup, torch.dtype], list[_Block]] = {}  # one buffer dtype per exchange
    layouts: dict[torch.Tensor, ShardLayout] = {}
    groups: dict[torch.Tensor, dist.ProcessGroup | None] = {}
    for block in blocks:
        param = block.param
        if param not in groups:
            # a forward's view (heads, experts of a fused weight) is no box of the param: the plain path takes it
            exchange = _exchange_group(param) if isinstance(param, DTensor) and block.view is None else None
            groups[param] = None if exchange is None else exchange[0]
            if exchange is not None:
                layouts[param] = exchange[1]
        group = groups[param]
        if group is not None:
            by_group.setdefault((group, compute_dtype(param)), []).append(block)
    plans = []  # every group's plan before any param changes: a plan that raises leaves them all as they were
    mode = optimizer.fsdp_orthogonalize
    for (group, _), group_blocks in by_group.items():
        plan, blocks_of = _plan(optimizer, group_blocks, layouts, redundant=mode == "redundant")
        if mode == "auto" and plan.busiest_share > OWNER_COMPUTES_MAX_SHARE:
            plan, blocks_of = _plan(optimizer, group_blocks, layouts, redundant=True)
        plans.append((group, plan, blocks_of))
    for group, plan, blocks_of in plans:
        _run(optimizer, group, plan, blocks_of, layouts)
    return {block.param for group_blocks in by_group.values() for block in group_blocks}


def _exchange_group(param: DTensor) -> tuple[dist.ProcessGroup, ShardLayout] | None:
    """The group spanning the param's mesh (its ranks in the mesh's row-major order) and its
    layout; ``None`` for a one-rank mesh or a mesh whose ranks are not in that order."""
    # A param on a slice of a larger mesh (a norm on mesh["dp"] under FSDP x TP) is planned on its
    # slice: each copy of the slice computes its own. torch does not say that the copies hold the
    # same values (under EP x FSDP, mesh["edp"]'s copies hold other experts), so none is skipped.
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.size() < 2 or any(p.is_partial() for p in placements):
        return None
    group = _mesh_group(mesh)
    if dist.get_process_group_ranks(group) != mesh.mesh.flatten().tolist():
        return None
    return group, _layout(tuple(param.shape), tuple(mesh.mesh.shape), placements)


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _mesh_group(mesh: Any) -> dist.ProcessGroup:
    """A process group of every rank of ``mesh``: its own (1-D), the world's, its flattened
    mesh's, or one made once for its ranks (only they take part in making it)."""
    ranks = tuple(mesh.mesh.flatten().tolist())
    if mesh.ndim == 1:
        return mesh.get_group()  # type: ignore[no-any-return]
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD  # type: ignore[return-value]
    if mesh.mesh_dim_names:
        return mesh._flatten().get_group()  # type: ignore[no-any-return]
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(sorted(ranks), use_local_synchronization=True)  # type: ignore[assignment]
    return _GROUPS[ranks]


_LAYOUTS: dict[tuple[Any, ...], ShardLayout] = {}


def _layout(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> ShardLayout:
    key = (shape, mesh_shape, placements)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = ShardLayout.of(shape, mesh_shape, placements)
    return _LAYOUTS[key]


def _plan(
    optimizer: Muon, blocks: Sequence[_Block], layouts: Mapping[torch.Tensor, ShardLayout], *, redundant: bool
) -> tuple[OwnerPlan, dict[Hashable, list[_Block]]]:
    """The plan of one exchange group's matrices, and the blocks of each matrix, keyed as its units are."""
    matrices: dict[tuple[torch.Tensor, int], list[_Block]] = {}
    for block in blocks:
        matrices.setdefault((block.param, block.index), []).append(block)
    whole_params = {
        block.param for block in blocks if "orthogonal" in optimizer._whole_inputs(block.group)
    }  # fmt: skip
    entries = [
        (key, tuple(param.shape), layouts[param], its[0].layout, key[1], compute_dtype(param).itemsize)
        for key, its in matrices.items()
        for param in [key[0]]
    ]
    # The plan depends on shapes and settings alone: made once, reused every step while they hold
    key = (
        redundant, optimizer.tp_mode, optimizer.bucket_size, optimizer._per_replica,
        tuple((id(k[0]), k[1], layouts[k[0]], its[0].layout, its[0].group["num_ns_steps"], k[0] in whole_params,
               tuple((b.start, b.rows, b.groups) for b in its))
              for k, its in matrices.items()),
    )  # fmt: skip
    cached = optimizer._owner_plans.get(key)
    if cached is not None:
        return cached, _blocks_of(optimizer, cached, matrices)
    if len(optimizer._owner_plans) >= 8:  # parameters came and went: keep the cache small
        optimizer._owner_plans.clear()
    plan = optimizer._owner_plans[key] = plan_owner_compute(
        entries, tp_mode=optimizer.tp_mode, redundant=redundant, bucket_size=optimizer.bucket_size,
        num_ns_steps=lambda key: matrices[key][0].group["num_ns_steps"],  # type: ignore[index]
        whole=lambda key: key[0] in whole_params,  # type: ignore[index]
        distributable=optimizer.tp_distributable, per_replica=optimizer._per_replica,
    )  # fmt: skip
    return plan, _blocks_of(optimizer, plan, matrices)


def _blocks_of(optimizer: Muon, plan: OwnerPlan, matrices: Mapping[tuple[torch.Tensor, int], list[_Block]]) -> dict[Hashable, list[_Block]]:
    """This step's blocks of each unit's matrix (they carry its group's settings), checked: a QKV
    split that a unit's TP block would cut raises here, before anything changes."""
    blocks_of: dict[Hashable, list[_Block]] = {}
    for bucket in plan.buckets:
        for unit in bucket.units:
            its = matrices[unit.key if unit.key in matrices else unit.key[0]]  # type: ignore[index]
            blocks_of[unit.key] = its
            for cls in range(len(unit.owners)):
                _unit_blocks(its, *_matrix_of(unit, unit.part(cls)), optimizer.tp_mode)
    return blocks_of


def _matrix_of(unit: Unit, part: Box) -> tuple[int, int]:
    """The ``rows × cols`` matrix a part of a unit is (the unit's own, with the split dim cut)."""
    if unit.split == -2:
        return box_numel(part) // unit.cols, unit.cols
    if unit.split == -1:
        return unit.rows, box_numel(part) // unit.rows
    return unit.rows, unit.cols


def _unit_blocks(blocks: Sequence[_Block], rows: int, cols: int, tp_mode: str) -> list[_Block]:
    """The blocks of a matrix as blocks of the lone ``rows × cols`` matrix an owner assembles: the
    matrix, or a TP block of it (``blockwise``, ``distributed``: a fused QKV's row groups must
    not straddle TP blocks)."""
    first = blocks[0]
    _, whole_rows, whole_cols = first.layout
    if (rows, cols) == (whole_rows, whole_cols):
        return [dataclasses.replace(block, layout=(1, rows, cols), index=0) for block in blocks]
    if len(blocks) == 1 and first.groups == 1 and first.rows == whole_rows:
        return [dataclasses.replace(first, layout=(1, rows, cols), index=0, rows=rows)]
    per_group = whole_rows // first.groups
    if rows % per_group or cols != whole_cols:
        raise ValueError(
            f"`tp_mode`: {tp_mode!r} orthogonalises each tensor-parallel block of a matrix on its own rank, and a "
            f"fused QKV's row groups must not straddle them; got a {rows} x {cols} block of a {whole_rows} x "
            f"{whole_cols} matrix split in {first.groups} groups of {per_group} rows; expected blocks of whole groups "
            "(split the heads evenly over the tensor-parallel ranks), or tp_mode='duplicated'"
        )
    return [dataclasses.replace(block, layout=(1, rows, cols), index=0, groups=rows // per_group) for block in blocks]


class _Exchange:
    """One bucket's pieces in flight, one way: one ``all_to_all_single``, issued asynchronously;
    a piece a rank sends itself is read when the exchange is waited for."""

    def __init__(
        self, transfers: Sequence[Transfer], read: Callable[[Transfer], torch.Tensor], *, rank: int, group: dist.ProcessGroup,
        like: torch.Tensor,
    ) -> None:  # fmt: skip
        world = dist.get_world_size(group)
        self.read = read
        self.own = [t for t in transfers if t.source == rank == t.dest]
        outgoing: list[list[Transfer]] = [[] for _ in range(world)]
        self.incoming: list[list[Transfer]] = [[] for _ in range(world)]
        for t in transfers:
            if t.source != t.dest:
                if t.source == rank:
                    outgoing[t.dest].append(t)
                if t.dest == rank:
                    self.incoming[t.source].append(t)
        self.work: Any = None
        if any(t.source != t.dest for t in transfers):  # the same verdict on every rank: the plan is shared
            pieces = [read(t).reshape(-1) for dest in outgoing for t in dest]
            self.send = torch.cat(pieces) if pieces else like.new_empty(0)
            send_sizes = [sum(box_numel(t.box) for t in dest) for dest in outgoing]
            recv_sizes = [sum(box_numel(t.box) for t in source) for source in self.incoming]
            self.received = like.new_empty(sum(recv_sizes))
            self.work = dist.all_to_all_single(
                self.received, self.send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group, async_op=True
            )

    def wait(self) -> list[tuple[Transfer, torch.Tensor]]:
        """Every piece sent to this rank, as ``(transfer, flat tensor)``."""
        arrived = [(t, self.read(t).reshape(-1)) for t in self.own]
        if self.work is not None:
            self.work.wait()
            del self.send
            position = 0
            for source in self.incoming:
                for t in source:
                    size = box_numel(t.box)
                    arrived.append((t, self.received[position : position + size]))
                    position += size
        return arrived


def _run(
    optimizer: Muon, group: dist.ProcessGroup, plan: OwnerPlan, blocks_of: Mapping[Hashable, list[_Block]],
    layouts: Mapping[torch.Tensor, ShardLayout],
) -> None:  # fmt: skip
    """Prepare every param on its shard; then bucket by bucket, two in flight: the pieces to their
    owners, Newton–Schulz there, the results back; each param applied once its last unit is back."""
    rank = dist.get_rank(group)
    trace = optimizer.owner_compute_trace
    prepared: dict[torch.Tensor, _Prepared] = {}
    remaining: dict[torch.Tensor, int] = {}
    for bucket in plan.buckets:
        for unit in bucket.units:
            param = blocks_of[unit.key][0].param
            if param not in prepared:
                settings = blocks_of[unit.key][0].group
                prepared[param] = optimizer._prepare(param, settings, gather="direction" in optimizer._whole_inputs(settings))
                remaining[param] = 0
            remaining[param] += 1
    if not prepared:
        return
    like = next(iter(prepared.values())).direction
    results_of: dict[torch.Tensor, torch.Tensor] = {}  # per param: this rank's box of the result, or the whole one

    def read_direction(t: Transfer) -> torch.Tensor:
        param = blocks_of[t.unit.key][0].param
        held = layouts[param].boxes[rank]
        assert held is not None  # a source holds its piece
        return prepared[param].direction[_within(t.box, held)]

    def place(arrived: list[tuple[Transfer, torch.Tensor]]) -> None:
        for t, flat in arrived:
            param = blocks_of[t.unit.key][0].param
            if param not in results_of:
                results_of[param] = _result_buffer(param, layouts[param], rank, blocks_of[t.unit.key], whole=t.unit.whole, like=like)
            origin = tuple((0, size) for size in param.shape) if t.unit.whole else layouts[param].boxes[rank]
            assert origin is not None
            results_of[param].view(param.shape if t.unit.whole else results_of[param].shape)[_within(t.box, origin)].copy_(
                flat.view(box_shape(t.box))
            )

    def finish(bucket: Bucket, back: _Exchange, index: int) -> None:
        place(back.wait())
        _event(trace, "back", index, "wait")
        for unit in bucket.units:
            param = blocks_of[unit.key][0].param
            remaining[param] -= 1
            if remaining[param] == 0:
                ready = prepared.pop(param)
                result = results_of.pop(param, None)
                if unit.whole:
                    assert result is not None
                    optimizer._apply(ready, result.view(param.shape))
                else:  # no result: this rank holds none of the param
                    shape = local_shard(param).shape
                    optimizer._apply(ready, (like.new_empty(0) if result is None else result).view(shape), sharded=True)

    buckets = plan.buckets
    pending = _Exchange(buckets[0].to_owners, read_direction, rank=rank, group=group, like=like)
    _event(trace, "to", 0, "issue")
    previous: tuple[Bucket, _Exchange, int] | None = None
    for index, bucket in enumerate(buckets):
        arrived = pending.wait()
        _event(trace, "to", index, "wait")
        if previous is not None:
            finish(*previous)  # frees its slot before the next bucket takes one
        if index + 1 < len(buckets):
            pending = _Exchange(buckets[index + 1].to_owners, read_direction, rank=rank, group=group, like=like)
            _event(trace, "to", index + 1, "issue")
        matrices: dict[Unit, tuple[torch.Tensor, Box]] = {}  # each unit this rank owns: its part, assembled
        for t, flat in arrived:
            if t.unit not in matrices:
                part = t.unit.part(t.unit.owners.index(rank))
                matrices[t.unit] = (like.new_empty(box_shape(part)), part)
            matrix, part = matrices[t.unit]
            matrix[_within(t.box, part)] = flat.view(box_shape(t.box))
        del arrived
        _event(trace, "ns", index, "start")
        results = _orthogonalize_owned(optimizer, matrices, blocks_of, rank)
        _event(trace, "ns", index, "end")
        del matrices
        back = _Exchange(bucket.from_owners, functools.partial(_read_result, results), rank=rank, group=group, like=like)
        _event(trace, "back", index, "issue")
        previous = (bucket, back, index)
    assert previous is not None
    finish(*previous)


def _read_result(results: Mapping[Unit, tuple[torch.Tensor, Box]], t: Transfer) -> torch.Tensor:
    result, part = results[t.unit]
    return result[_within(t.box, part)]


def _event(trace: list[tuple[str, int, str]] | None, what: str, bucket: int, how: str) -> None:
    if trace is not None:
        trace.append((what, bucket, how))


def _result_buffer(
    param: torch.Tensor, layout: ShardLayout, rank: int, blocks: Sequence[_Block], *, whole: bool, like: torch.Tensor
) -> torch.Tensor:
    """Where a param's result pieces land: this rank's box of it, or the whole result in the
    memory layout one process gives it (tall lone matrices come back from Newton–Schulz
    transposed; reductions over them in ``_finish_update`` then round as in one process)."""
    if not whole:
        held = layout.boxes[rank]
        return like.new_empty(box_shape(held) if held is not None else (0,))
    first = blocks[0]
    *stacked, rows, cols = matrix_shape(param.shape, flatten=first.group["flatten"])
    count = math.prod(stacked)
    transposed = len(blocks) == 1 and first.groups == 1 and first.layout[1:] == (rows, cols) and rows > cols
    if transposed:
        return like.new_empty((count, cols, rows)).mT
    return like.new_empty((count, rows, cols))


def _orthogonalize_owned(
    optimizer: Muon, matrices: dict[Unit, tuple[torch.Tensor, Box]], blocks_of: Mapping[Hashable, list[_Block]], rank: int
) -> dict[Unit, tuple[torch.Tensor, Box]]:
    """This rank's matrices (or, ``distributed``, TP blocks) orthogonalised, batched as the plain
    path batches them, each in its part's box shape. ``matrices`` is emptied: once copied into
    their batches' stacks, the assembled matrices are freed before Newton–Schulz runs."""
    batches: dict[tuple[Any, ...], list[tuple[Unit, _Block, _Block]]] = {}
    for unit, (_, part) in matrices.items():
        originals = blocks_of[unit.key]
        for original, block in zip(originals, _unit_blocks(originals, *_matrix_of(unit, part), optimizer.tp_mode)):
            # a distributed batch is keyed by the whole block, the same on every rank of the TP group
            key = optimizer._batch_key(original if unit.parts else block, len(batches))
            batches.setdefault((*key, unit.split, unit.tp_dim), []).append((unit, original, block))
    parts = {unit: part for unit, (_, part) in matrices.items()}
    stacks = [
        optimizer._stack([b for _, _, b in batch], [matrices[u][0].view(1, *_matrix_of(u, parts[u])) for u, _, _ in batch])
        for batch in batches.values()
    ]
    matrices.clear()
    results: dict[Unit, tuple[torch.Tensor, Box]] = {}
    for batch in batches.values():
        stack = stacks.pop(0)
        if batch[0][0].parts is None:
            out = optimizer._orthogonalize_stack(stack, [b for _, _, b in batch], [original for _, original, _ in batch])
        else:
            out = _orthogonalize_split_stack(optimizer, batch, stack, rank)
        del stack
        for slot, (u, _, block) in zip(out, batch):
            part = parts[u]
            if block.whole:
                results[u] = (slot.reshape(box_shape(part)), part)
            else:
                if u not in results:
                    results[u] = (slot.new_empty(box_shape(part)), part)  # split blocks are gathered row-major
                block.of(results[u][0].view(1, *_matrix_of(u, part))).copy_(block.in_slot(slot))
    return results


def _orthogonalize_split_stack(optimizer: Muon, batch: Sequence[tuple[Unit, _Block, _Block]], stack: torch.Tensor, rank: int) -> torch.Tensor:
    """``distributed``: this rank's TP blocks of a batch (stacked), orthogonalised together with the
    rest of its TP group (:func:`~optzoo.optimizers.newton_schulz.newton_schulz_sharded`), each
    scaled as its whole block is."""
    unit, original, _ = batch[0]
    assert unit.tp_dim is not None and unit.split is not None
    tp_group = original.param.device_mesh.get_group(unit.tp_dim)  # type: ignore[attr-defined]
    if dist.get_rank(tp_group) != unit.owners.index(rank):
        raise RuntimeError(
            f"tp_mode='distributed': the TP group's ranks are not in mesh order; got group rank {dist.get_rank(tp_group)} "
            f"for TP block {unit.owners.index(rank)}; expected a mesh whose TP dim lists ranks in order, or tp_mode='layer_sharded'"
        )
    settings = original.group
    out = newton_schulz_sharded(
        stack, group=tp_group, shard_dim=unit.split, steps=settings["num_ns_steps"],
        coefficient_type=settings["coefficient_type"], matmul_precision=settings["fp32_matmul_prec"],
    )  # fmt: skip
    optimizer._scale_(out, stack, [original for _, original, _ in batch])  # the whole block's shape
    return out


def check_bucket_size(bucket_size: object) -> None:
    """``bucket_size`` must be a positive int of bytes (a bool is not one)."""
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"`bucket_size`: must be a positive int (bytes); got {bucket_size!r}; expected e.g. {DEFAULT_BUCKET_SIZE}")


def _check_world_size(world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size`: must be a positive int; got {world_size!r}; expected an int >= 1")
