"""Distributed optimizers on ``torch.distributed``: layer-wise ownership and sharded state.

Two of Megatron-Core's flags, one mechanism. Every rank resolves the same groups; a
:class:`ShardingPlan` then gives each parameter, or each flat element range of it, one owner rank
in the data-parallel group. A rank keeps optimizer state (and fp32 main params under bf16/fp16)
for what it owns, steps only that, and after the step the updated parameters reach every rank
through one all-gather of flattened buckets per dtype (or one broadcast per rank).

* ``use_layer_wise_distributed_optimizer``: whole parameters, balanced by estimated cost
  (:func:`param_cost`): Newton–Schulz FLOPs for Muon-family matrices, preconditioner FLOPs for
  SOAP, a per-element cost for element-wise optimizers.
* ``use_distributed_optimizer`` (ZeRO-1): the params of element-wise optimizers (Adam, SGD,
  Lion), taken in routing order as one flat sequence, are cut into ``world_size`` near-equal
  element ranges, so each rank holds about ``1/N`` of their state; stepping a slice of a param
  with an element-wise rule is the same arithmetic as stepping the whole. Matrix optimizers
  (Muon, Adaptive Muon, SOAP) need whole matrices, so their params are owned whole, as above.

Gradients must already agree across ranks (torch DDP, or your own all-reduce): the optimizer
reads the owned part of each gradient. The inf/NaN flag, the grad norm and the zero count are
reduced over the group, so every rank takes the same decision and reports the single-process
values. State dicts are consolidated (:meth:`DistributedOptimizer.state_dict` is a collective)
and keyed by parameter names, in the same format as a single process, so a checkpoint saved
with N ranks loads with M. :func:`save_dcp` / :func:`load_dcp` write and read per-rank shards
with ``torch.distributed.checkpoint`` instead.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import hashlib
import heapq
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from optzoo.optimizers.newton_schulz import newton_schulz_flops
from optzoo.optimizers.registry import get_spec
from optzoo.groups import ResolvedGroup
from optzoo.optimizer import STATE_DICT_FORMAT, MixedPrecisionOptimizer, Part, StepResult, _shorten

Mode = Literal["layer_wise", "sharded"]
ParamSync = Literal["all_gather", "broadcast"]
ELEMENTWISE_FLOPS_PER_ELEMENT = 10
"""Rough cost of one element of an element-wise update (Adam: ~10 flops), to weigh Adam-owned
params against Newton–Schulz FLOPs when ownership is balanced."""


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

    def owners(self) -> dict[str, list[int]]:
        """``{param name: [owner ranks]}`` (one rank unless the param is element-sharded)."""
        result: dict[str, list[int]] = {}
        for shard in self.shards:
            result.setdefault(shard.name, []).append(shard.rank)
        return result


def _elementwise(group: ResolvedGroup) -> bool:
    # The registry's element-wise optimizers are exactly those that take any shape.
    return get_spec(group.optimizer).shapes == "any"


def param_cost(group: ResolvedGroup, param: torch.Tensor) -> float:
    """Estimated FLOPs of one update of ``param`` under ``group``'s optimizer.

    Muon and Adaptive Muon: their Newton–Schulz FLOPs (:func:`newton_schulz_flops`, the cheaper
    variant). SOAP: one eigenbasis refresh of both Kronecker factors (``~10·(m³ + n³)``) plus the
    factor updates and rotations (``~4·m·n·(m + n)``). Element-wise optimizers:
    :data:`ELEMENTWISE_FLOPS_PER_ELEMENT` per element.
    """
    if _elementwise(group) or param.dim() != 2:
        return float(param.numel() * ELEMENTWISE_FLOPS_PER_ELEMENT)
    rows, cols = param.shape
    if group.optimizer == "soap":
        return float(10 * (rows**3 + cols**3) + 4 * rows * cols * (rows + cols))
    steps = group.config.muon_num_ns_steps
    return float(min(newton_schulz_flops(rows, cols, steps=steps, variant=v) for v in ("standard", "gram")))


def plan_shards(groups: Sequence[ResolvedGroup], world_size: int, mode: Mode) -> ShardingPlan:
    """Assign every param (layer-wise) or element range (sharded, element-wise optimizers) an owner.

    Whole params go to the least-loaded rank, largest cost first (ties: lowest rank, then routing
    order), so the plan is deterministic and identical on every rank.

    Example:
        >>> from optzoo import OptimizerConfig, resolve_groups
        >>> model = torch.nn.Linear(4, 4)
        >>> groups, _ = resolve_groups(OptimizerConfig(lr=1.0), [model], {})
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
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    for position in sorted(range(len(whole)), key=lambda k: -costs[k]):
        load, rank = heapq.heappop(heap)
        group, index, name, param = whole[position]
        shards.append(Shard(name, group.index, index, rank, 0, param.numel(), param.numel(), costs[position]))
        heapq.heappush(heap, (load + costs[position], rank))
    order = {(g.index, i): k for k, (g, i, _, _) in enumerate(entries)}
    shards.sort(key=lambda s: (order[(s.group, s.index)], s.start))
    return ShardingPlan(world_size, mode, tuple(shards))


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


def check_same_model(groups: Sequence[ResolvedGroup], process_group: dist.ProcessGroup) -> None:
    """Fail fast, on every rank, when ranks resolved different params or groups.

    Ranks exchange one fingerprint (names, shapes, dtypes, group configs) before any collective
    sized by the params, which would otherwise hang or corrupt memory.
    """
    described = [
        (group.index, group.optimizer, name, tuple(routed.param.shape), str(routed.param.dtype))
        for group in groups
        for routed, name in zip(group.params, group.param_names)
    ]
    digest = hashlib.sha256(repr(described).encode()).hexdigest()
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, (digest, described), group=process_group)
    mine = dist.get_rank(process_group)
    for rank, (other_digest, other) in enumerate(everyone):
        if other_digest == digest:
            continue
        ours, theirs = set(described), set(other)
        raise ValueError(
            f"distributed optimizer: rank {rank} resolved different parameters than rank {mine}; "
            f"got only on rank {rank}: [{_shorten([repr(d) for d in sorted(theirs - ours)])}]; "
            f"expected also: [{_shorten([repr(d) for d in sorted(ours - theirs)])}] (only on rank {mine}); "
            "every rank must build the same model and routing"
        )


class DistributedOptimizer(MixedPrecisionOptimizer):
    """A :class:`MixedPrecisionOptimizer` over this rank's shards, syncing params after each step.

    Built by :func:`optzoo.get_optimizer` when ``use_distributed_optimizer`` or
    ``use_layer_wise_distributed_optimizer`` is set. ``param_groups`` hold only this rank's
    shards (every group exists on every rank, possibly empty), so schedulers work unchanged.

    Args:
        plan: Who owns what.
        full_param_names: Every group's param names, owned or not.
        all_params: Every model param by name.
        param_sync: ``all_gather`` (default: one padded all-gather per dtype) or ``broadcast``
            (one broadcast per rank and dtype).
        kwargs: As :class:`MixedPrecisionOptimizer` (``process_group`` required).
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        param_groups: list[dict[str, Any]],
        *,
        plan: ShardingPlan,
        full_param_names: Sequence[Sequence[str]],
        all_params: Mapping[str, torch.Tensor],
        param_sync: ParamSync = "all_gather",
        **kwargs: Any,
    ) -> None:
        super().__init__(optimizers, param_groups, **kwargs)
        assert self.process_group is not None
        if param_sync not in ("all_gather", "broadcast"):
            raise ValueError(f"`param_sync`: unknown value; got {param_sync!r}; expected 'all_gather' or 'broadcast'")
        self.plan = plan
        self.param_sync = param_sync
        self.rank = dist.get_rank(self.process_group)
        self.full_param_names = [list(names) for names in full_param_names]
        self._all_params = dict(all_params)
        # Per dtype, per rank: the (param, start, stop) each rank broadcasts after the step.
        self._layout: dict[torch.dtype, list[list[tuple[torch.Tensor, int, int]]]] = {}
        for shard in plan.shards:
            param = self._all_params[shard.name]
            ranks = self._layout.setdefault(param.dtype, [[] for _ in range(plan.world_size)])
            ranks[shard.rank].append((param, shard.start, shard.stop))
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
                assert self.process_group is not None
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
        for param in self._all_params.values():
            if param.grad is not None:
                param.grad = None if set_to_none else param.grad.zero_()

    # ---- state dict ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, keyed by names, as one process would save it.

        A collective: every rank must call it; every rank gets the same dict.
        """
        local = super().state_dict()
        parts = {pair.name: pair.part for pair in self._pairs()}
        mine = {
            "state": {name: _to_cpu(values) for name, values in local["state"].items()},
            "main_params": {name: t.detach().cpu() for name, t in local["main_params"].items()},
            "parts": parts,
        }
        everyone: list[Any] = [None] * self.plan.world_size
        dist.all_gather_object(everyone, mine, group=self.process_group)
        shapes = {name: tuple(param.shape) for name, param in self._all_params.items()}
        state: dict[str, dict[str, Any]] = {}
        main_params: dict[str, torch.Tensor] = {}
        pieces: dict[str, list[tuple[Part, dict[str, Any]]]] = {}
        main_pieces: dict[str, list[tuple[Part, torch.Tensor]]] = {}
        for other in everyone:
            for name, values in other["state"].items():
                pieces.setdefault(name, []).append((other["parts"][name], values))
            for name, tensor in other["main_params"].items():
                main_pieces.setdefault(name, []).append((other["parts"][name], tensor))
        for name in (n for names in self.full_param_names for n in names):
            if name in pieces:
                state[name] = _merge_state(pieces[name], shapes[name])
            if name in main_pieces:
                main_params[name] = _merge_tensor(main_pieces[name], shapes[name])
        groups = [dict(saved, param_names=list(names)) for saved, names in zip(local["param_groups"], self.full_param_names)]
        return {
            "format": STATE_DICT_FORMAT,
            "state": state,
            "param_groups": groups,
            "grad_scaler": local["grad_scaler"],
            "main_params": main_params,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a whole (consolidated) state dict, from any number of ranks; not a collective."""
        self._check_names(state_dict)
        canonical = {alias: name for name, aliases in self.aliases.items() for alias in aliases}
        saved_state = {canonical.get(n, n): v for n, v in state_dict["state"].items()}
        saved_mains = {canonical.get(n, n): v for n, v in (state_dict.get("main_params") or {}).items()}
        state: dict[str, dict[str, Any]] = {}
        mains: dict[str, torch.Tensor] = {}
        for pair in self._pairs():
            numel = self._all_params[pair.name].numel()
            if pair.name in saved_state:
                state[pair.name] = {k: _slice(v, pair.part, numel) for k, v in saved_state[pair.name].items()}
            if pair.name in saved_mains:
                mains[pair.name] = _slice(saved_mains[pair.name], pair.part, numel)
        local_names = [set(group["param_names"]) for group in self.param_groups]
        groups, empty = [], []
        for saved in state_dict["param_groups"]:
            names = [canonical.get(n, n) for n in saved["param_names"]]
            index = next(i for i, full in enumerate(self.full_param_names) if names[0] in full)
            mine = [n for n in names if n in local_names[index]]
            if mine:
                groups.append(dict(saved, param_names=mine))
            else:  # nothing of it here: the base matches groups by their names, so restore it here
                empty.append((self.param_groups[index], saved))
        super().load_state_dict({**state_dict, "state": state, "main_params": mains, "param_groups": groups})
        for group, saved in empty:
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k not in ("params", "param_names")})

    def _check_names(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_DICT_FORMAT:
            super().load_state_dict(state_dict)  # raises the format error
        canonical = {alias: name for name, aliases in self.aliases.items() for alias in aliases}
        ours = {n for names in self.full_param_names for n in names}
        saved = [n for g in state_dict["param_groups"] for n in g["param_names"]]
        unknown = [n for n in saved if canonical.get(n, n) not in ours]
        missing = sorted(ours - {canonical.get(n, n) for n in saved})
        if unknown or missing:
            raise ValueError(
                "`state_dict`: parameter names do not match this model; "
                f"got names only in the checkpoint: [{_shorten(unknown)}]; "
                f"expected also: [{_shorten(missing)}] (only in this model)"
            )
        if len(state_dict["param_groups"]) != len(self.full_param_names):
            raise ValueError(
                f"`state_dict`: param groups differ from this optimizer's; got {len(state_dict['param_groups'])} "
                f"groups; expected {len(self.full_param_names)} (was the routing changed?)"
            )


def _pack(pieces: Sequence[tuple[torch.Tensor, int, int]], buffer: torch.Tensor) -> None:
    if pieces:
        torch.cat([param.detach().view(-1)[start:stop] for param, start, stop in pieces], out=buffer[: sum(b - a for _, a, b in pieces)])


def _unpack(pieces: Sequence[tuple[torch.Tensor, int, int]], buffer: torch.Tensor) -> None:
    if not pieces:
        return
    sizes = [stop - start for _, start, stop in pieces]
    sources = torch.split(buffer[: sum(sizes)], sizes)
    torch._foreach_copy_([param.detach().view(-1)[start:stop] for param, start, stop in pieces], list(sources))


def _to_cpu(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _per_element(value: Any, part: Part, full_shape: tuple[int, ...]) -> bool:
    """Whether a state entry holds one value per element of its shard (else it is shared, e.g. ``step``)."""
    if not isinstance(value, torch.Tensor):
        return False
    if part is None:
        return tuple(value.shape) == full_shape
    return value.dim() == 1 and value.numel() == part[1] - part[0]


def _merge_tensor(pieces: Sequence[tuple[Part, torch.Tensor]], shape: tuple[int, ...]) -> torch.Tensor:
    if len(pieces) == 1 and pieces[0][0] is None:
        return pieces[0][1]
    ordered = sorted(pieces, key=lambda p: p[0][0] if p[0] is not None else 0)
    return torch.cat([t.reshape(-1) for _, t in ordered]).view(shape)


def _merge_state(pieces: Sequence[tuple[Part, dict[str, Any]]], shape: tuple[int, ...]) -> dict[str, Any]:
    first_part, first = pieces[0]
    if len(pieces) == 1 and first_part is None:
        return dict(first)
    merged: dict[str, Any] = {}
    for key, value in first.items():
        if _per_element(value, first_part, shape):
            merged[key] = _merge_tensor([(part, values[key]) for part, values in pieces], shape)
        else:
            merged[key] = value
    return merged


def _slice(value: Any, part: Part, numel: int) -> Any:
    """This shard's part of a whole-param state entry (entries without one value per element as is)."""
    if part is None or not isinstance(value, torch.Tensor) or value.numel() != numel or value.dim() == 0:
        return value
    return value.reshape(-1)[part[0] : part[1]].clone()


# ---- torch.distributed.checkpoint ---------------------------------------------------------

_KEY = re.compile(r"^(?P<kind>state|main)/(?P<name>.+?)(?:/(?P<key>[^/@]+))?@(?P<start>\d+):(?P<stop>\d+)$")


def _dcp_items(optimizer: DistributedOptimizer) -> dict[str, Any]:
    local = MixedPrecisionOptimizer.state_dict(optimizer)
    items: dict[str, Any] = {}
    for pair in optimizer._pairs():
        numel = optimizer._all_params[pair.name].numel()
        start, stop = pair.part if pair.part is not None else (0, numel)
        for key, value in local["state"].get(pair.name, {}).items():
            items[f"state/{pair.name}/{key}@{start}:{stop}"] = value
        if pair.name in local["main_params"]:
            items[f"main/{pair.name}@{start}:{stop}"] = local["main_params"][pair.name]
    return items


def _check_distributed(optimizer: object, function: str) -> None:
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"`{function}`: needs a distributed optimizer; got {type(optimizer).__name__}; expected the "
            "DistributedOptimizer get_optimizer returns with use_distributed_optimizer or "
            "use_layer_wise_distributed_optimizer (a single process saves with state_dict())"
        )


def save_dcp(optimizer: DistributedOptimizer, checkpoint_id: str) -> None:
    """Save with ``torch.distributed.checkpoint``: each rank writes the shards it owns.

    A collective. Loads with any number of ranks (:func:`load_dcp`).
    """
    _check_distributed(optimizer, "save_dcp")
    items = _dcp_items(optimizer)
    full = {k: v for k, v in MixedPrecisionOptimizer.state_dict(optimizer).items() if k not in ("state", "main_params")}
    groups = [dict(g, param_names=list(names)) for g, names in zip(full["param_groups"], optimizer.full_param_names)]
    items["meta"] = pickle.dumps({**full, "param_groups": groups})  # one opaque entry, not flattened by dcp
    dcp_save(items, checkpoint_id=checkpoint_id)


def load_dcp(optimizer: DistributedOptimizer, checkpoint_id: str) -> None:
    """Load a :func:`save_dcp` checkpoint saved with any number of ranks. A collective."""
    _check_distributed(optimizer, "load_dcp")
    metadata = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    saved: dict[tuple[str, str, str | None], list[tuple[int, int, str]]] = {}
    for key in metadata:
        match = _KEY.match(key)
        if match:
            entry = (match["kind"], match["name"], match["key"])
            saved.setdefault(entry, []).append((int(match["start"]), int(match["stop"]), key))
    wanted: dict[str, Any] = {"meta": b""}
    needed = _needed_keys(optimizer, saved)
    for key in needed:
        properties = metadata[key]
        size = getattr(properties, "size", None)
        if size is None:
            wanted[key] = b""  # a non-tensor entry: replaced by dcp.load
        else:
            wanted[key] = torch.empty(size, dtype=properties.properties.dtype)  # type: ignore[union-attr]
    dcp_load(wanted, checkpoint_id=checkpoint_id)
    meta = pickle.loads(wanted["meta"])  # noqa: S301 - our own checkpoint, as torch.load does
    full_state: dict[str, dict[str, Any]] = {}
    mains: dict[str, torch.Tensor] = {}
    for (kind, name, state_key), ranges in saved.items():
        if name not in optimizer._all_params:
            continue
        param = optimizer._all_params[name]
        pieces = [(None if (a, b) == (0, param.numel()) else (a, b), wanted[key]) for a, b, key in ranges if key in wanted]
        if not pieces:
            continue
        if kind == "main":
            mains[name] = _assemble(pieces, param)
        else:
            assert state_key is not None
            full_state.setdefault(name, {})[state_key] = _assemble(pieces, param)
    optimizer.load_state_dict({**meta, "state": full_state, "main_params": mains})


def _needed_keys(optimizer: DistributedOptimizer, saved: Mapping[tuple[str, str, str | None], list[tuple[int, int, str]]]) -> list[str]:
    """The saved keys overlapping this rank's shards (one suffices for entries like ``step``)."""
    mine = {pair.name: pair.part for pair in optimizer._pairs()}
    needed = []
    for (_, name, _), ranges in saved.items():
        if name not in mine:
            continue
        numel = optimizer._all_params[name].numel()
        start, stop = mine[name] if mine[name] is not None else (0, numel)  # type: ignore[misc]
        needed += [key for a, b, key in ranges if a < stop and start < b]
    return needed


def _assemble(pieces: Iterable[tuple[Part, Any]], param: torch.Tensor) -> Any:
    """A whole-param state entry from saved shards (only the overlapping ones need be present).

    Entries that are not one value per element (``step``) are taken from any shard; the others
    are laid out in a whole-param tensor, whose uncovered elements are never read (the caller
    slices out its own range, which the loaded shards cover).
    """
    pieces = list(pieces)
    part, value = pieces[0]
    if not _per_element(value, part, tuple(param.shape)):
        return value
    if len(pieces) == 1 and part is None:
        return value
    out = torch.zeros(param.numel(), dtype=value.dtype)
    for piece_part, piece in pieces:
        start, stop = piece_part if piece_part is not None else (0, param.numel())
        out[start:stop] = piece.reshape(-1)
    return out.view(param.shape)
