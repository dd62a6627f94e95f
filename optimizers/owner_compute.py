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

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._common import assign_least_loaded

__all__ = ["Unit", "assign_owners", "dim0_chunks", "from_owners", "to_owners"]

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
