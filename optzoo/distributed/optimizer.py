"""The distributed optimizer: this rank steps what it owns, then every rank gets the params.

Two of Megatron-Core's flags, one mechanism. Every rank resolves the same groups; the
:class:`~optzoo.distributed.plan.ShardingPlan` gives each parameter, or each flat element range
of it, one owner rank in the data-parallel group. A rank keeps optimizer state (and fp32 main
params under bf16/fp16) for what it owns, steps only that, and after the step the updated
parameters reach every rank through one all-gather of flattened buckets per dtype (or one
broadcast per rank).

Gradients must already agree across ranks (torch DDP, or your own all-reduce): the optimizer
reads the owned part of each gradient. The inf/NaN flag, the grad norm and the zero count are
reduced over the group, so every rank takes the same decision and reports the single-process
values. :meth:`DistributedOptimizer.state_dict` is a collective returning the consolidated,
name-keyed dict one process would save, so a checkpoint saved with N ranks loads with M.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from optzoo.distributed.checkpoint import consolidate
from optzoo.distributed.plan import ShardingPlan
from optzoo.wrapper.mixed_precision import MixedPrecisionOptimizer, StepOptions, StepResult
from optzoo.wrapper.param_map import ParamMap
from optzoo.wrapper.scalers import MegatronGradScaler

__all__ = ["DistributedOptimizer", "ParamSync"]

ParamSync = Literal["all_gather", "broadcast"]
"""How updated params reach every rank: one padded all-gather per dtype, or one broadcast per rank."""

Piece = tuple[torch.Tensor, int, int]
"""A model param and the flat element range ``[start, stop)`` of it that one rank sends."""


class DistributedOptimizer(MixedPrecisionOptimizer):
    """A :class:`~optzoo.MixedPrecisionOptimizer` over this rank's shards, syncing params after each step.

    Built by :func:`optzoo.get_optimizer` when ``use_distributed_optimizer`` or
    ``use_layer_wise_distributed_optimizer`` is set. ``param_groups`` hold only this rank's
    shards (every group exists on every rank, possibly empty), so schedulers work unchanged.

    Args:
        optimizers, param_groups, param_map, options, grad_scaler, device: As
            :class:`~optzoo.MixedPrecisionOptimizer`; ``param_map`` covers every param, and its
            local entries are this rank's shards.
        plan: Who owns what.
        process_group: The data-parallel group (required).
        param_sync: ``all_gather`` (default: one padded all-gather per dtype) or ``broadcast``
            (one broadcast per rank and dtype).
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        param_groups: list[dict[str, Any]],
        param_map: ParamMap,
        options: StepOptions = StepOptions(),
        *,
        plan: ShardingPlan,
        process_group: dist.ProcessGroup,
        grad_scaler: MegatronGradScaler | None = None,
        param_sync: ParamSync = "all_gather",
        device: torch.device | None = None,
    ) -> None:
        if param_sync not in ("all_gather", "broadcast"):
            raise ValueError(f"`param_sync`: unknown value; got {param_sync!r}; expected 'all_gather' or 'broadcast'")
        super().__init__(
            optimizers, param_groups, param_map, options, grad_scaler=grad_scaler, process_group=process_group, device=device
        )
        self.plan = plan
        self.param_sync = param_sync
        self.rank = dist.get_rank(process_group)
        # Per dtype, per rank: the pieces each rank sends after the step.
        self._layout: dict[torch.dtype, list[list[Piece]]] = {}
        for shard in plan.shards:
            entry = param_map.entry(shard.name)
            assert entry is not None  # the plan was made from the same groups
            ranks = self._layout.setdefault(entry.model.dtype, [[] for _ in range(plan.world_size)])
            ranks[shard.rank].append((entry.model, shard.start, shard.stop))
        # The plan fixes every bucket's size: allocate them once, not every step.
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        for dtype, ranks in self._layout.items():
            sizes = [sum(stop - start for _, start, stop in pieces) for pieces in ranks]
            lengths = [max(sizes)] * len(sizes) if param_sync == "all_gather" else sizes
            self._buffers[dtype] = [torch.empty(n, dtype=dtype, device=self._one.device) for n in lengths]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:  # type: ignore[override]
        """:meth:`MixedPrecisionOptimizer.step` on the owned shards, then every rank gets the params."""
        result = super().step(closure)
        if result[0]:
            self._sync_params()
        return result

    @torch.no_grad()
    def _sync_params(self) -> None:
        if self.plan.world_size == 1:
            return  # the only rank already holds every update
        for dtype, ranks in self._layout.items():
            buffers = self._buffers[dtype]
            if self.param_sync == "all_gather":
                _pack(ranks[self.rank], buffers[self.rank])
                dist.all_gather(buffers, buffers[self.rank], group=self.process_group)
                for rank, pieces in enumerate(ranks):
                    if rank != self.rank:
                        _unpack(pieces, buffers[rank])
            else:
                assert self.process_group is not None  # required by __init__
                for rank, pieces in enumerate(ranks):
                    if rank == self.rank:
                        _pack(pieces, buffers[rank])
                    dist.broadcast(buffers[rank], src=dist.get_global_rank(self.process_group, rank), group=self.process_group)
                    if rank != self.rank:
                        _unpack(pieces, buffers[rank])

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every model param's grad, owned or not."""
        super().zero_grad(set_to_none)
        for entry in self.param_map.entries:
            if entry.model.grad is not None:
                entry.model.grad = None if set_to_none else entry.model.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, keyed by names, as one process would save it.

        A collective: every rank must call it; every rank gets the same dict.
        """
        local = super().state_dict()
        mine = {
            "state": {name: _to_cpu(values) for name, values in local["state"].items()},
            "main_params": {name: t.detach().cpu() for name, t in local["main_params"].items()},
            "parts": {entry.name: entry.part for entry in self.param_map.local},
        }
        everyone: list[Any] = [None] * self.plan.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        return consolidate(local, everyone, self.param_map)


def _to_cpu(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _pack(pieces: Sequence[Piece], buffer: torch.Tensor) -> None:
    if pieces:
        torch.cat([param.detach().view(-1)[start:stop] for param, start, stop in pieces], out=buffer[: sum(b - a for _, a, b in pieces)])


def _unpack(pieces: Sequence[Piece], buffer: torch.Tensor) -> None:
    if not pieces:
        return
    sizes = [stop - start for _, start, stop in pieces]
    sources = torch.split(buffer[: sum(sizes)], sizes)
    torch._foreach_copy_([param.detach().view(-1)[start:stop] for param, start, stop in pieces], list(sources))
