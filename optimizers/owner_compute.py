"""Owner-computes under FSDP2: each sharded matrix is orthogonalised once, by one rank.

``fully_shard`` gives rank ``r`` the dim-0 chunk ``r`` of every param (``torch.chunk``
semantics: :func:`dim0_chunks`), so each rank holds a contiguous flat range of it, and every
matrix Muon orthogonalises (a 2-D param, one matrix of an expert stack, a flattened filter) is a
contiguous flat range too. Newton–Schulz needs whole matrices. Rather than every rank gathering
and orthogonalising every matrix, each matrix gets one owner (:func:`assign_owners`: a matrix
that one rank already holds whole stays there; the rest are balanced by Newton–Schulz cost with
the distributed optimizers' planner, :func:`optzoo._common.assign_least_loaded`). Per bucket of
same-shape matrices, one ``all_to_all_single`` brings every owner the pieces of its matrices
(:func:`to_owners`), the owner orthogonalises them, and one more sends the results back
(:func:`from_owners`): to each rank its own piece, or the whole matrix to every rank where the
update needs it whole (NorMuon's row statistics).

Everything here is computed from shapes alone, identically on every rank; the pieces a rank
sends and receives are what the plan says, so split sizes always match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from .._common import assign_least_loaded, local_shard
from .muon_ops import compute_dtype
from .newton_schulz import newton_schulz_flops

if TYPE_CHECKING:
    from .muon import Muon, _Block, _Prepared

__all__ = ["OWNER_COMPUTES_MAX_SHARE", "Unit", "assign_owners", "dim0_chunks", "from_owners", "orthogonalize_on_owners", "to_owners"]

OWNER_COMPUTES_MAX_SHARE = 0.75
"""``auto`` computes on owners when the busiest owner gets at most this share of the Newton–Schulz FLOPs."""

Range = tuple[int, int]


def dim0_chunks(shape: Sequence[int], world_size: int) -> list[Range]:
    """Each rank's flat element range of a param sharded on dim 0 as ``fully_shard`` does (``torch.chunk``).

    Example:
        >>> dim0_chunks((5, 2), 4)  # chunks of ceil(5 / 4) = 2 rows; the last rank holds none
        [(0, 4), (4, 8), (8, 10), (10, 10)]
    """
    _check_world_size(world_size)
    rows = shape[0] if shape else 1
    inner = 1
    for size in shape[1:]:
        inner *= size
    chunk = -(-rows // world_size)
    return [(min(r * chunk, rows) * inner, min((r + 1) * chunk, rows) * inner) for r in range(world_size)]


@dataclass(frozen=True, eq=False)
class Unit:
    """One matrix of a sharded param: its flat elements ``[start, stop)``, and who holds and who orthogonalises them."""

    key: Hashable  # what the caller knows the matrix by
    start: int
    stop: int
    holders: tuple[Range, ...]  # per rank, the flat range of the param that rank holds
    owner: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def piece(self, rank: int) -> Range:
        """The part of the matrix ``rank`` holds, as a flat range of the param (empty: ``start == stop``)."""
        low, high = self.holders[rank]
        start = min(max(self.start, low), self.stop)
        return start, max(start, min(self.stop, high))


def assign_owners(matrices: Sequence[tuple[Range, Sequence[Range], float]], world_size: int) -> tuple[list[int], list[float]]:
    """An owner rank for each matrix ``(flat range, holders' ranges, Newton–Schulz cost)``, and each rank's load.

    A matrix that one rank holds whole stays there (no communication; an expert of a stack
    sharded on the expert dim); the others go, largest cost first, to the least-loaded rank.

    Example:
        >>> two_experts = [(0, 4), (4, 8)]  # a [2, 2, 2] stack on 2 ranks: each holds one expert
        >>> assign_owners([((0, 4), two_experts, 1.0), ((4, 8), two_experts, 1.0)], 2)
        ([0, 1], [1.0, 1.0])
    """
    _check_world_size(world_size)
    owners = [-1] * len(matrices)
    loads = [0.0] * world_size
    for k, ((start, stop), holders, cost) in enumerate(matrices):
        for rank, (low, high) in enumerate(holders):
            if low <= start and stop <= high and start < stop:
                owners[k] = rank
                loads[rank] += cost
                break
    spread = [k for k, owner in enumerate(owners) if owner < 0]
    for k, rank in zip(spread, assign_least_loaded([matrices[k][2] for k in spread], loads)):
        owners[k] = rank
    return owners, loads


def _all_to_all(sends: list[list[torch.Tensor]], recv_sizes: list[int], group: dist.ProcessGroup, like: torch.Tensor) -> torch.Tensor:
    """One ``all_to_all_single``: ``sends[d]`` (pieces, concatenated) to rank ``d``; ``recv_sizes[s]`` elements from rank ``s``."""
    send_sizes = [sum(t.numel() for t in pieces) for pieces in sends]
    flat = [t.reshape(-1) for pieces in sends for t in pieces]
    send = torch.cat(flat) if flat else like.new_empty(0)
    received = like.new_empty(sum(recv_sizes))
    dist.all_to_all_single(received, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
    return received


def to_owners(
    units: Sequence[Unit], local: Callable[[Unit], torch.Tensor], *, rank: int, group: dist.ProcessGroup
) -> dict[Unit, torch.Tensor]:
    """Every rank's pieces of ``units`` to their owners: ``{unit: its whole flat matrix}`` for the units this rank owns.

    ``local(unit)`` is this rank's flat part of the unit's param (its ``holders[rank]`` range).
    """
    world_size = dist.get_world_size(group)
    like = local(units[0])
    sends: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for unit in units:
        start, stop = unit.piece(rank)
        if stop > start:
            offset = unit.holders[rank][0]
            sends[unit.owner].append(local(unit)[start - offset : stop - offset])
    mine = [unit for unit in units if unit.owner == rank]
    recv_sizes = [sum(_size(unit.piece(source)) for unit in mine) for source in range(world_size)]
    received = _all_to_all(sends, recv_sizes, group, like)
    matrices = {unit: like.new_empty(unit.numel) for unit in mine}
    position = 0
    for source in range(world_size):
        for unit in mine:
            start, stop = unit.piece(source)
            matrices[unit][start - unit.start : stop - unit.start] = received[position : position + stop - start]
            position += stop - start
    return matrices


def from_owners(
    units: Sequence[Unit], results: dict[Unit, torch.Tensor], whole: Callable[[Unit], bool], *, rank: int, group: dist.ProcessGroup,
    like: torch.Tensor,
) -> dict[Unit, torch.Tensor]:  # fmt: skip
    """The owners' flat results back: ``{unit: this rank's piece}``, or the whole result where ``whole(unit)``.

    ``results`` holds a flat tensor per unit this rank owns (in the layout the receivers expect).
    """
    world_size = dist.get_world_size(group)
    sends: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for unit in units:
        if unit.owner != rank:
            continue
        for dest in range(world_size):
            start, stop = (unit.start, unit.stop) if whole(unit) else unit.piece(dest)
            if stop > start:
                sends[dest].append(results[unit][start - unit.start : stop - unit.start])
    wanted = [unit for unit in units if whole(unit) or _size(unit.piece(rank))]
    recv_sizes = [
        sum(unit.numel if whole(unit) else _size(unit.piece(rank)) for unit in wanted if unit.owner == source)
        for source in range(world_size)
    ]
    received = _all_to_all(sends, recv_sizes, group, like)
    pieces: dict[Unit, torch.Tensor] = {}
    offsets = [sum(recv_sizes[:source]) for source in range(world_size)]
    for unit in wanted:
        size = unit.numel if whole(unit) else _size(unit.piece(rank))
        pieces[unit] = received[offsets[unit.owner] : offsets[unit.owner] + size]
        offsets[unit.owner] += size
    return pieces


def _check_world_size(world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size`: must be a positive int; got {world_size!r}; expected an int >= 1")


def _size(piece: Range) -> int:
    return piece[1] - piece[0]


# ---- the Muon family's step on owners (Muon._update calls it first) ----------------------------


def orthogonalize_on_owners(optimizer: Muon, blocks: Sequence[_Block]) -> set[torch.Tensor]:
    """Owner-computes for the step's dim-0-sharded DTensor params (see the module docstring),
    per process group; returns the params it stepped (the rest take the plain path)."""
    if optimizer.fsdp_orthogonalize == "redundant":
        return set()
    groups: dict[torch.Tensor, dist.ProcessGroup | None] = {}  # per param: its mesh's group, if owner-computed
    by_group: dict[dist.ProcessGroup, list[_Block]] = {}
    for block in blocks:
        if block.param not in groups:
            # owner-computes sends whole matrices as spans of the param: a forward's view is not one
            groups[block.param] = _owner_computed_group(block.param) if block.view is None else None
        group = groups[block.param]
        if group is not None:
            by_group.setdefault(group, []).append(block)
    stepped: set[torch.Tensor] = set()
    for group, group_blocks in by_group.items():
        units, blocks_of, loads = _owner_units(optimizer, group_blocks, dist.get_world_size(group))
        if optimizer.fsdp_orthogonalize == "auto" and max(loads) > OWNER_COMPUTES_MAX_SHARE * sum(loads):
            continue
        _owner_step(optimizer, group, units, blocks_of)
        stepped.update(block.param for block in group_blocks)
    return stepped


def _owner_units(
    optimizer: Muon, blocks: Sequence[_Block], world_size: int
) -> tuple[list[Unit], dict[Unit, list[_Block]], list[float]]:
    """One :class:`~optzoo.optimizers.owner_compute.Unit` per matrix, owners assigned; its
    blocks; and each rank's Newton–Schulz load."""
    matrices: dict[tuple[torch.Tensor, int], list[_Block]] = {}
    for block in blocks:
        matrices.setdefault((block.param, block.index), []).append(block)
    described = []
    for (param, index), its_blocks in matrices.items():
        _, rows, cols = its_blocks[0].layout
        cost = sum(_ns_cost(block) for block in its_blocks)
        described.append(((index * rows * cols, (index + 1) * rows * cols), dim0_chunks(param.shape, world_size), cost))
    owners, loads = assign_owners(described, world_size)
    units: list[Unit] = []
    blocks_of: dict[Unit, list[_Block]] = {}
    for (key, its_blocks), (span, holders, _), owner in zip(matrices.items(), described, owners):
        unit = Unit(key, span[0], span[1], tuple(holders), owner)
        units.append(unit)
        blocks_of[unit] = its_blocks
    return units, blocks_of, loads


def _owner_step(optimizer: Muon, group: dist.ProcessGroup, units: Sequence[Unit], blocks_of: dict[Unit, list[_Block]]) -> None:
    """Prepare every param on its shard, then per bucket of same-shape matrices: to the owners,
    orthogonalise there, back to the ranks; then apply every param on its shard."""
    rank = dist.get_rank(group)
    prepared: dict[torch.Tensor, _Prepared] = {}
    for unit in units:
        param = blocks_of[unit][0].param
        if param not in prepared:
            group_settings = blocks_of[unit][0].group
            prepared[param] = optimizer._prepare(param, group_settings, gather="direction" in optimizer._whole_inputs(group_settings))
    whole_params = {param for param, p in prepared.items() if "orthogonal" in optimizer._whole_inputs(p.group)}
    buckets: dict[tuple[Any, ...], list[Unit]] = {}
    for unit in units:
        first = blocks_of[unit][0]
        buckets.setdefault((compute_dtype(first.param), *first.layout[1:]), []).append(unit)
    shards: dict[torch.Tensor, torch.Tensor] = {}  # per param: this rank's flat piece of the result
    wholes: dict[torch.Tensor, tuple[torch.Tensor, bool]] = {}  # per param needing it whole: the result, transposed?
    for bucket in buckets.values():
        matrices = to_owners(bucket, lambda u: prepared[blocks_of[u][0].param].direction.reshape(-1), rank=rank, group=group)
        results = _orthogonalize_owned(optimizer, matrices, blocks_of, whole_params)
        like = prepared[blocks_of[bucket[0]][0].param].direction
        received = from_owners(
            bucket, results, lambda u: blocks_of[u][0].param in whole_params, rank=rank, group=group, like=like
        )
        for unit, piece in received.items():
            first = blocks_of[unit][0]
            param = first.param
            if param in whole_params:
                if param not in wholes:
                    count, rows, cols = first.layout
                    transposed = _transposed(blocks_of[unit])  # the same for every matrix of a param
                    wholes[param] = (like.new_empty((count, cols, rows) if transposed else (count, rows, cols)), transposed)
                wholes[param][0][first.index].view(-1).copy_(piece)
            else:
                low = unit.holders[rank][0]
                if param not in shards:
                    shards[param] = like.new_empty(unit.holders[rank][1] - low)
                start, stop = unit.piece(rank)
                shards[param][start - low : stop - low] = piece
    for param, ready in prepared.items():
        if param in whole_params:
            stacked, transposed = wholes[param]
            optimizer._apply(ready, (stacked.mT if transposed else stacked).view(param.shape))
        else:
            local = local_shard(param)
            flat = shards[param] if param in shards else ready.direction.new_empty(0)
            optimizer._apply(ready, flat.view(local.shape), sharded=True)


def _orthogonalize_owned(
    optimizer: Muon, matrices: Mapping[Unit, torch.Tensor], blocks_of: Mapping[Unit, list[_Block]], whole_params: set[torch.Tensor]
) -> dict[Unit, torch.Tensor]:
    """This rank's whole matrices orthogonalised, batched as the plain path batches them, each
    flattened for sending: row-major, or (sent whole) in the layout its receivers rebuild."""
    batches: dict[tuple[Any, ...], list[tuple[Unit, _Block]]] = {}
    for unit in matrices:
        for block in blocks_of[unit]:
            alone = dataclasses.replace(block, layout=(1, *block.layout[1:]), index=0)  # the block of the lone matrix
            batches.setdefault(optimizer._batch_key(alone, len(batches)), []).append((unit, alone))
    outputs: dict[Unit, torch.Tensor] = {}
    for batch in batches.values():
        _, rows, cols = batch[0][1].layout
        out = optimizer._orthogonalize_batch([b for _, b in batch], [matrices[u].view(1, rows, cols) for u, _ in batch])
        for slot, (unit, block) in zip(out, batch):
            if block.whole:
                outputs[unit] = slot
            else:
                if unit not in outputs:
                    outputs[unit] = slot.new_empty((rows, cols))  # split blocks are gathered row-major
                block.of(outputs[unit]).copy_(block.in_slot(slot))
    results: dict[Unit, torch.Tensor] = {}
    for unit, output in outputs.items():
        if blocks_of[unit][0].param in whole_params and _transposed(blocks_of[unit]):
            assert output.mT.is_contiguous()  # Newton–Schulz returns tall matrices transposed
            results[unit] = output.mT.reshape(-1)
        else:
            results[unit] = output.reshape(-1)
    return results


def _owner_computed_group(param: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group of a param whose matrices owner-computes can step: a DTensor sharded
    on dim 0 over a 1-D mesh of 2 or more ranks, with ``torch.chunk``'s layout; else ``None``."""
    if not (isinstance(param, DTensor) and param.device_mesh.ndim == 1 and tuple(param.placements) == (Shard(0),)):
        return None
    group = param.device_mesh.get_group()
    world_size = dist.get_world_size(group)
    start, stop = dim0_chunks(param.shape, world_size)[dist.get_rank(group)]
    return group if world_size > 1 and stop - start == param.to_local().numel() else None


def _ns_cost(block: _Block) -> float:
    """Newton–Schulz FLOPs of one block, the cheaper variant (as the registry's ``update_cost``)."""
    rows, cols = block.shape
    steps = block.group["num_ns_steps"]
    return float(min(newton_schulz_flops(rows, cols, steps=steps, variant=v) for v in ("standard", "gram")))


def _transposed(blocks: Sequence[_Block]) -> bool:
    """Whether a matrix's orthogonalised output comes back transposed: a lone tall block
    (Newton–Schulz iterates on the transpose of tall matrices); split blocks are gathered row-major."""
    block = blocks[0]
    return len(blocks) == 1 and block.groups == 1 and block.rows == block.layout[1] and block.shape[0] > block.shape[1]
