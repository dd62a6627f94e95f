"""Who owns what under the distributed optimizers: a pure plan from the resolved groups.

:func:`plan_shards` gives each parameter, or each flat element range of it, one owner rank in the
data-parallel group; it reads only shapes and the registry's algorithm facts, so every rank (and
``optzoo dump-param-groups --world-size N`` on the meta device) computes the same plan.

* ``layer_wise`` (``use_layer_wise_distributed_optimizer``): whole parameters, balanced by the
  estimated cost of one update (the registry record's ``update_cost``: Newton–Schulz FLOPs for the
  Muon family, preconditioner FLOPs for SOAP, a per-element cost for element-wise optimizers).
* ``sharded`` (``use_distributed_optimizer``, ZeRO-1): the params of element-wise optimizers, in
  routing order as one flat sequence, are cut into ``world_size`` near-equal element ranges;
  stepping a slice of a param with an element-wise rule is the same arithmetic as stepping the
  whole. The params of the other optimizers need whole matrices and are owned whole, as above.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from optzoo._common import assign_least_loaded
from optzoo.groups import ResolvedGroup
from optzoo.optimizers.registry import ELEMENTWISE_FLOPS_PER_ELEMENT, get_spec
from optzoo.wrapper.param_map import Part

__all__ = ["Mode", "Shard", "ShardingPlan", "param_cost", "plan_shards"]

Mode = Literal["layer_wise", "sharded"]


@dataclass(frozen=True)
class Shard:
    """Elements ``[start, stop)`` of the flattened param ``name`` (group ``group``), owned by ``rank``."""

    name: str
    group: int
    index: int  # position in the group
    rank: int
    start: int
    stop: int
    numel: int
    cost: float

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.numel

    @property
    def part(self) -> Part:
        return None if self.whole else (self.start, self.stop)


@dataclass(frozen=True)
class ShardingPlan:
    """Who owns what: every param's shards, in group order."""

    world_size: int
    mode: Mode
    shards: tuple[Shard, ...]

    def owned(self, rank: int) -> list[Shard]:
        return [shard for shard in self.shards if shard.rank == rank]

    def loads(self) -> list[float]:
        """Estimated cost per rank (see :func:`param_cost`)."""
        loads = [0.0] * self.world_size
        for shard in self.shards:
            loads[shard.rank] += shard.cost
        return loads

    def state_elements(self) -> list[int]:
        """Param elements whose state each rank keeps."""
        counts = [0] * self.world_size
        for shard in self.shards:
            counts[shard.rank] += shard.stop - shard.start
        return counts

    def parts_owned_by(self, rank: int) -> dict[tuple[int, int], Part]:
        """``{(group index, position in group): element range}`` of what ``rank`` steps."""
        return {(shard.group, shard.index): shard.part for shard in self.owned(rank)}

    def owners(self) -> dict[str, list[int]]:
        """``{param name: [owner ranks]}`` (one rank unless the param is element-sharded)."""
        result: dict[str, list[int]] = {}
        for shard in self.shards:
            result.setdefault(shard.name, []).append(shard.rank)
        return result


def _elementwise(group: ResolvedGroup) -> bool:
    return get_spec(group.optimizer).elementwise


def param_cost(group: ResolvedGroup, param: torch.Tensor) -> float:
    """Estimated FLOPs of one update of ``param`` under ``group``'s optimizer: its registry
    record's ``update_cost`` (Newton–Schulz FLOPs for the Muon family, preconditioner FLOPs for
    SOAP, ``ELEMENTWISE_FLOPS_PER_ELEMENT`` per element for element-wise optimizers)."""
    spec = get_spec(group.optimizer)
    fields = {name: getattr(group.config, name) for name in spec.config_fields}
    return spec.update_cost(tuple(param.shape), {**fields, "flatten": group.flatten, "matrix_view": group.matrix_view_of(param)})


def plan_shards(groups: Sequence[ResolvedGroup], world_size: int, mode: Mode, *, names: Collection[str] | None = None) -> ShardingPlan:
    """Assign every param (layer-wise) or element range (sharded, element-wise optimizers) an owner.

    ``names``: plan only these params (default: all); the distributed optimizers plan expert
    params over the expert data-parallel group and the rest over the data-parallel group.

    Whole params go to the least-loaded rank, largest cost first (ties: lowest rank, then routing
    order), so the plan is deterministic and identical on every rank.

    Example:
        >>> from optzoo import OptimizerConfig, resolve_group_configs
        >>> model = torch.nn.Linear(4, 4)
        >>> groups, _ = resolve_group_configs(OptimizerConfig(lr=1.0), [model], {})
        >>> plan = plan_shards(groups, 2, "sharded")
        >>> [(s.name, s.rank, s.start, s.stop) for s in plan.shards]
        [('weight', 0, 0, 10), ('weight', 1, 10, 16), ('bias', 1, 0, 4)]
        >>> [(s.name, s.rank) for s in plan_shards(groups, 2, "layer_wise").shards]
        [('weight', 0), ('bias', 1)]
    """
    if world_size < 1:
        raise ValueError(f"`world_size`: must be at least 1; got {world_size}; expected an integer >= 1")
    if mode not in ("layer_wise", "sharded"):
        raise ValueError(f"`mode`: unknown value; got {mode!r}; expected 'layer_wise' or 'sharded'")
    entries = [
        (group, index, name, routed.param)
        for group in groups
        for index, (routed, name) in enumerate(zip(group.params, group.param_names))
        if names is None or name in names
    ]
    shards: list[Shard] = []
    loads = [0.0] * world_size
    if mode == "sharded":
        flat = [(g, i, n, p) for g, i, n, p in entries if _elementwise(g)]
        total = sum(p.numel() for *_, p in flat)
        bounds = [total * r // world_size for r in range(world_size + 1)]
        offset = 0
        for group, index, name, param in flat:
            numel = param.numel()
            first = max(0, bisect.bisect_right(bounds, offset) - 1)  # ranks overlapping this param only
            last = min(world_size, bisect.bisect_left(bounds, offset + numel))
            for rank in range(first, last):
                start, stop = max(bounds[rank], offset), min(bounds[rank + 1], offset + numel)
                if start < stop:
                    cost = (stop - start) * ELEMENTWISE_FLOPS_PER_ELEMENT
                    shards.append(Shard(name, group.index, index, rank, start - offset, stop - offset, numel, cost))
                    loads[rank] += cost
            offset += numel
        whole = [(g, i, n, p) for g, i, n, p in entries if not _elementwise(g)]
    else:
        whole = entries
    costs = [param_cost(group, param) for group, _, _, param in whole]
    for (group, index, name, param), rank, whole_cost in zip(whole, assign_least_loaded(costs, loads), costs):
        shards.append(Shard(name, group.index, index, rank, 0, param.numel(), param.numel(), whole_cost))
    order = {(g.index, i): k for k, (g, i, _, _) in enumerate(entries)}
    shards.sort(key=lambda s: (order[(s.group, s.index)], s.start))
    return ShardingPlan(world_size, mode, tuple(shards))


