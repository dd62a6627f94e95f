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
name-keyed dict one process would save, so a checkpoint saved with N ranks loads with M. A
framework that saves on rank 0 alone (``transformers.Trainer``) calls
:meth:`~DistributedOptimizer.gather_state_dict` on every rank first (:mod:`optzoo.trainer` does it
for Trainer); a call on one rank alone raises after ``state_dict_timeout`` instead of hanging.

Expert params (Megatron's ``allreduce=False``, or the ``expert`` role) have their own plan over
the expert data-parallel group when one is given (``expert_process_group``, or
``pg_collection.expt_dp``), as Megatron-Core builds a separate optimizer for them; the rest are
planned over the data-parallel group. Each plan's params are synced within its own group. The
data-parallel group spans expert-parallel × expert-data-parallel, so one reduction over it
counts every element once, dense or expert: one grad norm and one inf flag for both.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from optzoo.distributed.checkpoint import agree_on_error, arrive_together, consolidate
from optzoo._common import shorten
from optzoo.distributed.plan import ShardingPlan
from optzoo.distributed.setup import ExpertLayout
from optzoo.wrapper.mixed_precision import MixedPrecisionOptimizer, StepOptions
from optzoo.wrapper.param_map import ParamMap
from optzoo.wrapper.scalers import MegatronGradScaler
from optzoo.wrapper.routing_digest import PlanKind, RoutingChangeReport
from optzoo.wrapper.state_dict import STRUCTURAL_KEYS

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
        plan: Who owns what (of the expert params too, unless ``expert_plan`` is given).
        process_group: The data-parallel group (required).
        expert_plan, expert_layout: The plan of the expert params over the expert data-parallel
            group, and where the other expert-parallel ranks' experts are (both or neither).
        param_sync: ``all_gather`` (default: one padded all-gather per dtype) or ``broadcast``
            (one broadcast per rank and dtype).

    Attributes:
        state_dict_timeout: How long :meth:`state_dict` waits for the other ranks to call it too
            before raising (10 minutes, NCCL's default collective timeout): one rank calling a
            collective alone would otherwise hang forever.
    """

    state_dict_timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    _each_rank_steps_every_param = False

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
        expert_plan: ShardingPlan | None = None,
        expert_layout: ExpertLayout | None = None,
    ) -> None:
        if (expert_plan is None) != (expert_layout is None):
            raise ValueError("`expert_plan`: comes with `expert_layout`; got one of them; expected both or neither")
        if param_sync not in ("all_gather", "broadcast"):
            raise ValueError(f"`param_sync`: unknown value; got {param_sync!r}; expected 'all_gather' or 'broadcast'")
        super().__init__(
            optimizers, param_groups, param_map, options, grad_scaler=grad_scaler, process_group=process_group, device=device
        )
        self.plan = plan
        self.expert_plan = expert_plan
        self.expert_layout = expert_layout
        self.param_sync = param_sync
        self.rank = dist.get_rank(process_group)
        # Per plan: its group, and per dtype, per rank of that group, the pieces each rank sends after the step.
        self._syncs: list[tuple[dist.ProcessGroup, int, dict[torch.dtype, list[list[Piece]]], dict[torch.dtype, list[torch.Tensor]]]] = []
        plans = [(plan, process_group)] + ([] if expert_layout is None else [(expert_plan, expert_layout.group)])
        for one_plan, group in plans:
            assert one_plan is not None
            layout: dict[torch.dtype, list[list[Piece]]] = {}
            for shard in one_plan.shards:
                entry = param_map.entry(shard.name)
                assert entry is not None  # the plan was made from the same groups
                ranks = layout.setdefault(entry.model.dtype, [[] for _ in range(one_plan.world_size)])
                ranks[shard.rank].append((entry.model, shard.start, shard.stop))
            # The plan fixes every bucket's size: allocate them once, not every step.
            buffers: dict[torch.dtype, list[torch.Tensor]] = {}
            for dtype, ranks in layout.items():
                sizes = [sum(stop - start for _, start, stop in pieces) for pieces in ranks]
                lengths = [max(sizes)] * len(sizes) if param_sync == "all_gather" else sizes
                buffers[dtype] = [torch.empty(n, dtype=dtype, device=self._one.device) for n in lengths]
            self._syncs.append((group, one_plan.world_size, layout, buffers))
        # Store keys for state_dict's arrival check: every rank builds its optimizers over a group
        # in the same order, so the count of them on this rank names this one on every rank.
        members = "-".join(map(str, dist.get_process_group_ranks(process_group)))
        count = dist.distributed_c10d._get_default_store().add(f"optzoo/optimizers/{members}/{dist.get_rank()}", 1)
        self._state_dict_key = f"optzoo/state_dict/{members}/{count}"
        self._state_dict_calls = 0
        self._gathered: dict[str, Any] | None = None  # gather_state_dict's result, until a step or load

    def _follow_repointed_params(self) -> bool:
        """Refuse re-pointed ``param_groups`` (accelerate's FSDP2 ``prepare``): the sharding plan and
        the param sync were made for the params this optimizer was built for."""
        if all(p is e.main for g, es in zip(self.param_groups, self.param_map.local_by_group()) for p, e in zip(g["params"], es)):
            return False
        raise ValueError(
            f"`param_groups`: re-pointed at new tensors (as accelerate's FSDP2 prepare does); got a {type(self).__name__} "
            "(use_distributed_optimizer or use_layer_wise_distributed_optimizer), whose sharding plan and param sync "
            "belong to the params it was built for; expected those params: FSDP2 shards the optimizer state itself, so "
            "drop the distributed-optimizer flag under FSDP2"
        )

    @torch.no_grad()
    def reload_model_params(self, state_dict: Mapping[str, Any] | None = None) -> None:
        """:meth:`MixedPrecisionOptimizer.reload_model_params`; a gathered state dict is dropped."""
        self._gathered = None
        super().reload_model_params(state_dict)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """:meth:`MixedPrecisionOptimizer.prepare_grads`; a gathered state dict is dropped (the
        loss scale and then the state change)."""
        self._gathered = None
        return super().prepare_grads()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: the sharding plan (who owns and syncs what) is agreed by every rank
        when the optimizer is built, and a new param would need a new plan on all of them at once."""
        if self._building:
            super().add_param_group(param_group)
            return
        raise TypeError(
            f"`{type(self).__name__}.add_param_group`: the distributed optimizer's sharding plan is fixed when it is built; "
            "got new params mid-run; expected get_optimizer(...) to be called again (on every rank) with the params trainable, "
            "or a one-process optimizer (FSDP2 or DDP without use_distributed_optimizer/use_layer_wise_distributed_optimizer)"
        )

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """:meth:`MixedPrecisionOptimizer.step_with_ready_grads` on the owned shards, then every
        rank gets the params (``param_sync``), as Megatron-Core's distributed optimizers sync
        after their ``step_with_ready_grads``. A collective."""
        success = super().step_with_ready_grads()
        self._sync_params()
        return success

    @torch.no_grad()
    def allgather_params(self) -> None:
        """Every rank gets the params their owners hold, by one all-gather of flattened buckets
        per dtype (Megatron-Core's ``LayerWiseDistributedOptimizer.allgather_params``): the
        sync a step does with ``param_sync="all_gather"``. A collective."""
        self._sync_params("all_gather")

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Every rank gets the params their owners hold, by one broadcast per owner rank and
        dtype (Megatron-Core's ``LayerWiseDistributedOptimizer.broadcast_params``): the sync a
        step does with ``param_sync="broadcast"``. A collective."""
        self._sync_params("broadcast")

    @torch.no_grad()
    def step_on_device(self) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """:meth:`MixedPrecisionOptimizer.step_on_device` on the owned shards, then every rank gets
        the params (unconditionally: a skipped step sends the unchanged values)."""
        self._gathered = None
        result = super().step_on_device()
        self._sync_params()
        return result

    @torch.no_grad()
    def _sync_params(self, how: ParamSync | None = None) -> None:
        """Send each owner's params to every rank, as ``how`` (default ``param_sync``) says."""
        how = how or self.param_sync
        for group, world_size, layout, all_buffers in self._syncs:
            if world_size == 1:
                continue  # the only rank already holds every update
            rank = dist.get_rank(group)
            for dtype, ranks in layout.items():
                buffers = all_buffers[dtype]
                if how == "all_gather":
                    if len({b.numel() for b in buffers}) > 1:  # broadcast's buffers are unpadded: pad once
                        buffers = all_buffers[dtype] = _padded(buffers)
                    _pack(ranks[rank], buffers[rank])
                    dist.all_gather(buffers, buffers[rank], group=group)
                    for other, pieces in enumerate(ranks):
                        if other != rank:
                            _unpack(pieces, buffers[other])
                else:
                    for other, pieces in enumerate(ranks):
                        if other == rank:
                            _pack(pieces, buffers[other])
                        dist.broadcast(buffers[other], src=dist.get_global_rank(group, other), group=group)
                        if other != rank:
                            _unpack(pieces, buffers[other])

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every model param's grad, owned or not."""
        super().zero_grad(set_to_none)
        for entry in self.param_map.entries:
            if entry.model.grad is not None:
                entry.model.grad = None if set_to_none else entry.model.grad.zero_()

    def gather_state_dict(self) -> None:
        """Gather the consolidated state dict now, on every rank (a collective), so that
        :meth:`state_dict` returns it without a collective, on any rank, until the state changes.

        For frameworks that save the optimizer on rank 0 alone (``transformers.Trainer``): call it
        on every rank before their save (:class:`optzoo.trainer.GatherOptimizerState` does, for
        Trainer). The gathered state is dropped on every rank together, by the next step, load or
        :meth:`reload_model_params`; until then every rank's :meth:`state_dict` returns it, so the
        ranks never disagree on whether a call is a collective. The groups' hyperparameters (a
        scheduler's lr) are read when :meth:`state_dict` is called.
        """
        self._gathered = None
        self._gathered = self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, keyed by names, as one process would save it.

        A collective: every rank must call it (or :meth:`gather_state_dict` before); every rank
        gets the same dict. A rank that calls it while another does not for ``state_dict_timeout``
        raises ``RuntimeError`` naming the absent ranks, before entering any collective. Under
        expert parallelism it holds every expert when expert names are global, else this rank's
        experts (see :class:`~optzoo.distributed.setup.ExpertLayout`).
        """
        gathered = self._gathered
        if gathered is not None:  # the groups as they are now: a scheduler may have moved the lr since
            live = super()._state_dict()["param_groups"]
            groups = [
                {**{k: v for k, v in now.items() if k not in STRUCTURAL_KEYS}, "param_names": saved["param_names"]}
                for now, saved in zip(live, gathered["param_groups"], strict=True)
            ]
            return {**gathered, "param_groups": groups}
        self._state_dict_calls += 1
        assert self.process_group is not None  # required by __init__
        try:
            arrive_together(
                self.process_group, f"{self._state_dict_key}/{self._state_dict_calls}", f"{type(self).__name__}.state_dict",
                self.state_dict_timeout,
            )  # fmt: skip
        except RuntimeError:
            self._state_dict_calls -= 1  # not a call the other ranks made: the next one is this one again
            raise
        local = super()._state_dict()
        mine = {
            "state": {name: _to_cpu(values) for name, values in local["state"].items()},
            "main_params": {name: t.detach().cpu() for name, t in local["main_params"].items()},
            "parts": {entry.name: entry.part for entry in self.param_map.local},
        }
        everyone: list[Any] = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(everyone, mine, group=self.process_group)
        layout = self.expert_layout
        if layout is None:
            return consolidate(local, everyone, self.param_map)
        if not layout.global_names:  # the same names hold other experts elsewhere: keep this rank's
            experts = {entry.name for entry in self.param_map.entries if entry.name in self._expert_names}
            everyone = [other if rank in layout.peers else _without(other, experts) for rank, other in enumerate(everyone)]
            return consolidate(local, everyone, self.param_map)
        shapes = {name: shape for name, (_, shape) in layout.elsewhere.items()}
        merged = consolidate(local, everyone, self.param_map, shapes=shapes)
        groups = [dict(group, param_names=list(group["param_names"])) for group in merged["param_groups"]]
        for name, (index, _) in layout.elsewhere.items():
            groups[index]["param_names"].append(name)
        param_shapes = {**merged["param_shapes"], **{name: list(shape) for name, (_, shape) in layout.elsewhere.items()}}
        return {**merged, "param_groups": groups, "param_shapes": param_shapes}

    def _torch_state_dict(self) -> dict[str, Any]:
        raise _torch_api_refused("get_optimizer_state_dict")

    def _from_torch_format(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        raise _torch_api_refused("a torch-format state dict")

    def _plan_kind(self) -> PlanKind:
        return self.plan.mode

    def _load_state_dict(
        self, state_dict: Mapping[str, Any], *, allow_routing_change: bool = False, warm_start: bool = False
    ) -> RoutingChangeReport | None:
        """As :meth:`MixedPrecisionOptimizer.load_state_dict`; under expert parallelism with global
        expert names, the experts other ranks hold are skipped (and must be in the checkpoint)."""
        self._gathered = None
        layout = self.expert_layout
        options = {"allow_routing_change": allow_routing_change, "warm_start": warm_start}
        if layout is None or not layout.global_names or not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
            return super()._load_state_dict(state_dict, **options)
        saved = {n for g in state_dict["param_groups"] for n in g.get("param_names", ())}
        absent = sorted(set(layout.elsewhere) - saved)
        if absent:
            self._agree_on_load(ValueError(
                "`state_dict`: lacks experts that other expert-parallel ranks hold; "
                f"got a checkpoint without [{shorten(absent)}]; expected every expert (a checkpoint saved "
                "with global expert names)"
            ))
        elsewhere = set(layout.elsewhere)
        groups = [
            {**group, "param_names": [n for n in group["param_names"] if n not in elsewhere]} for group in state_dict["param_groups"]
        ]
        return super()._load_state_dict({**_without(state_dict, elsewhere), "param_groups": groups}, **options)

    def _agree_on_load(self, error: Exception | None) -> None:
        """Every rank checks the state of what it owns: all refuse together, before any changes (a collective)."""
        agree_on_error(error, self.process_group, "load_state_dict")

    @property
    def _expert_names(self) -> set[str]:
        assert self.expert_plan is not None
        return {shard.name for shard in self.expert_plan.shards}


def _torch_api_refused(what: str) -> ValueError:
    # torch's format is per process and keyed by position: each rank here holds other params (or
    # element ranges of them) of a model replicated on every rank, which DCP would save as one.
    return ValueError(
        f"torch's DCP state-dict API ({what}): not supported by the distributed optimizer, whose ranks each step "
        "their own params or element ranges of a replicated model; got a DistributedOptimizer; expected "
        "optzoo.distributed.save_dcp/load_dcp (each rank writes its shards) or optimizer.state_dict() "
        "(consolidated), or FSDP2 (fully_shard) without a distributed-optimizer flag"
    )


def _without(saved: Mapping[str, Any], names: set[str]) -> dict[str, Any]:
    """``saved`` without the state and main params of ``names``."""
    return {
        **saved,
        "state": {n: v for n, v in saved["state"].items() if n not in names},
        "main_params": {n: v for n, v in saved["main_params"].items() if n not in names},
        "param_shapes": {n: v for n, v in (saved.get("param_shapes") or {}).items() if n not in names},
    }


def _to_cpu(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _padded(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers of the longest one's length (all-gather needs equal sizes; broadcast reads a prefix)."""
    length = max(b.numel() for b in buffers)
    return [torch.empty(length, dtype=b.dtype, device=b.device) for b in buffers]


def _pack(pieces: Sequence[Piece], buffer: torch.Tensor) -> None:
    """Copy each piece's elements, in the param's logical (row-major) order, into ``buffer``.

    ``reshape`` views a contiguous param and copies any other layout (a transposed or gapped
    param, whose memory ``view(-1)`` cannot flatten), so every layout sends the same elements.
    """
    if pieces:
        torch.cat([param.detach().reshape(-1)[start:stop] for param, start, stop in pieces], out=buffer[: sum(b - a for _, a, b in pieces)])


def _unpack(pieces: Sequence[Piece], buffer: torch.Tensor) -> None:
    """Write ``buffer`` back into the pieces, in the order :func:`_pack` read them, whatever their layout."""
    if not pieces:
        return
    sizes = [stop - start for _, start, stop in pieces]
    sources = torch.split(buffer[: sum(sizes)], sizes)
    dense = [(param, start, stop, source) for (param, start, stop), source in zip(pieces, sources) if param.is_contiguous()]
    if dense:
        torch._foreach_copy_([param.detach().view(-1)[start:stop] for param, start, stop, _ in dense], [source for *_, source in dense])
    for (param, start, stop), source in zip(pieces, sources):
        if param.is_contiguous():
            continue
        target = param.detach()
        if start == 0 and stop == param.numel():  # the whole param (layer-wise): one strided copy
            target.copy_(source.view(param.shape))
        else:  # a range of it: the rest keeps this rank's current values
            whole = target.reshape(-1).clone()
            whole[start:stop] = source
            target.copy_(whole.view(param.shape))
