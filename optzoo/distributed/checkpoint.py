"""Consolidating the distributed optimizer's per-rank state into one name-keyed state dict.

Each rank holds the state of what it owns: whole params, or (sharded) an element range of some.
:func:`consolidate` lays every rank's pieces back into whole-param tensors, so the result has the
format one process saves (:mod:`optzoo.wrapper.state_dict`) and loads on any number of ranks.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from optzoo.wrapper.param_map import ParamMap, Part

__all__ = ["agree_on_error", "arrive_together", "consolidate", "per_element"]


def agree_on_error(error: Exception | None, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if any rank has an ``error``. A collective.

    A checkpoint refused on some ranks only (each checks the params it holds) would leave the
    others loaded, or waiting in their next collective; with this every rank refuses it, with
    the message of the lowest failing rank, before any rank changes anything.
    """
    everyone: list[Any] = [None] * dist.get_world_size(group)
    mine = None if error is None else (dist.get_rank(group), type(error).__name__, str(error))
    dist.all_gather_object(everyone, mine, group=group)
    failed = [report for report in everyone if report is not None]
    if not failed:
        return
    rank, kind, message = min(failed)
    shown = message if kind == "ValueError" else f"`{what}`: failed on rank {rank}; got {kind}: {message}; expected a checkpoint every rank loads"
    raise ValueError(shown) from error


def arrive_together(group: dist.ProcessGroup, key: str, what: str, timeout: datetime.timedelta) -> None:
    """Wait until every rank of ``group`` has called this with ``key``, through the default store.

    Run before a collective that one rank may call alone (a framework that saves on rank 0 only):
    the collective would hang forever, matched against whatever the other ranks do next. Each rank
    sets ``key/<its rank>`` and waits for the others' keys; the store answers without a collective,
    so the wait can end with a message instead.

    Raises:
        RuntimeError: Naming the ranks that did not call it within ``timeout``; this rank's
            arrival is taken back, so the same ``key`` can be tried again.
    """
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    mine = f"{key}/{dist.get_rank()}"
    store.set(mine, "1")
    keys = [f"{key}/{rank}" for rank in ranks]
    try:
        store.wait(keys, timeout)
    except RuntimeError as error:  # a TCPStore raises DistStoreError, a FileStore a RuntimeError
        absent = [rank for rank, one in zip(ranks, keys) if not store.check([one])]
        if not absent:  # they arrived just after the timeout
            return
        store.delete_key(mine)  # a later call under the same key must wait for this rank again
        raise RuntimeError(
            f"`{what}`: a collective, called by rank {dist.get_rank()} without the others; got no call from "
            f"ranks {absent} within {timeout.total_seconds():g} s; expected every rank of the data-parallel group "
            "to call it (a framework that saves on rank 0 only must gather on every rank first: "
            "optzoo.trainer.GatherOptimizerState for transformers.Trainer, or call gather_state_dict() on every "
            "rank; see docs/integrations.md)"
        ) from error


def per_element(value: Any, part: Part, full_shape: tuple[int, ...]) -> bool:
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
        if per_element(value, first_part, shape):
            merged[key] = _merge_tensor([(part, values[key]) for part, values in pieces], shape)
        else:
            merged[key] = value
    return merged


def consolidate(
    local: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]], param_map: ParamMap, *, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, Any]:
    """One state dict from every rank's pieces.

    Args:
        local: This rank's own state dict (its groups, loss scale and format are kept).
        ranks: Per rank, ``{"state": {name: values}, "main_params": {name: tensor},
            "parts": {name: element range}}`` for what that rank owns.
        param_map: The parameter map (every param's name and shape).
        shapes: Params that other ranks hold and this one does not (other expert-parallel
            ranks' experts), with their shapes; they follow the map's params.
    """
    pieces: dict[str, list[tuple[Part, dict[str, Any]]]] = {}
    main_pieces: dict[str, list[tuple[Part, torch.Tensor]]] = {}
    for other in ranks:
        for name, values in other["state"].items():
            pieces.setdefault(name, []).append((other["parts"][name], values))
        for name, tensor in other["main_params"].items():
            main_pieces.setdefault(name, []).append((other["parts"][name], tensor))
    state: dict[str, dict[str, Any]] = {}
    main_params: dict[str, torch.Tensor] = {}
    everything = [(entry.name, tuple(entry.model.shape)) for entry in param_map.entries] + list((shapes or {}).items())
    for name, shape in everything:
        if name in pieces:
            state[name] = _merge_state(pieces[name], shape)
        if name in main_pieces:
            main_params[name] = _merge_tensor(main_pieces[name], shape)
    return {**local, "state": state, "main_params": main_params}
