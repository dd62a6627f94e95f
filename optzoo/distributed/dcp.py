"""Saving and loading the distributed optimizer with ``torch.distributed.checkpoint`` (DCP).

Each rank writes only the shards it owns, under keys such as ``state/<name>/<key>@start:stop``
(the element range of the flattened param); on load each rank reads only the saved shards that
overlap its own, so a checkpoint saved on N ranks loads on M. Under FSDP2 (DTensor params, no
distributed-optimizer flag) the state is DTensors already: each is saved under
``fsdp/state/<name>/<key>`` (fp32 main params under ``fsdp/main/<name>``) and DCP reshards it.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from optzoo.distributed.checkpoint import agree_on_error, per_element
from optzoo.distributed.optimizer import DistributedOptimizer
from optzoo.wrapper.mixed_precision import MixedPrecisionOptimizer
from optzoo.wrapper.param_map import Part
from optzoo.wrapper.routing_digest import ROUTING_KEY, RoutingChangeReport, check_routing
from optzoo.wrapper.state_dict import check_param_shapes

__all__ = ["load_dcp", "save_dcp"]

_FSDP = "fsdp"
_KEY = re.compile(r"^(?P<kind>state|main)/(?P<name>.+?)(?:/(?P<key>[^/@]+))?@(?P<start>\d+):(?P<stop>\d+)$")


def _dcp_items(optimizer: DistributedOptimizer) -> dict[str, Any]:
    local = MixedPrecisionOptimizer.state_dict(optimizer)
    items: dict[str, Any] = {}
    for entry in optimizer.param_map.local:
        start, stop = entry.part if entry.part is not None else (0, entry.model.numel())
        for key, value in local["state"].get(entry.name, {}).items():
            items[f"state/{entry.name}/{key}@{start}:{stop}"] = value
        if entry.name in local["main_params"]:
            items[f"main/{entry.name}@{start}:{stop}"] = local["main_params"][entry.name]
    return items


def _is_fsdp2(optimizer: object) -> bool:
    """An optimizer over FSDP2 (``fully_shard``) params: DTensor model params, reduced over a process group."""
    return (
        isinstance(optimizer, MixedPrecisionOptimizer)
        and not isinstance(optimizer, DistributedOptimizer)
        and optimizer.process_group is not None
        and any(isinstance(entry.model, DTensor) for entry in optimizer.param_map.entries)
    )


def _check_distributed(optimizer: object, function: str) -> None:
    if _is_fsdp2(optimizer):
        return
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            f"`{function}`: needs a distributed optimizer; got {type(optimizer).__name__}; expected the "
            "DistributedOptimizer get_optimizer returns with use_distributed_optimizer or "
            "use_layer_wise_distributed_optimizer, or one over FSDP2 (fully_shard) params "
            "(a single process saves with state_dict())"
        )
    if optimizer.expert_layout is not None:
        raise ValueError(
            f"`{function}`: does not support a separate expert data-parallel group yet (expert-parallel ranks "
            "would write their experts under one key); got an optimizer built with expert_process_group; "
            "expected optimizer.state_dict(), which consolidates dense and expert params"
        )


def save_dcp(optimizer: MixedPrecisionOptimizer, checkpoint_id: str) -> None:
    """Save with ``torch.distributed.checkpoint``: each rank writes the shards it owns.

    A collective. Loads with any number of ranks (:func:`load_dcp`). Takes the distributed
    optimizers and, under FSDP2 (``fully_shard``), the optimizer over its DTensor params, whose
    state DCP reshards as it is (fp32 main params of 16-bit params included).
    """
    _check_distributed(optimizer, "save_dcp")
    if _is_fsdp2(optimizer):
        named = MixedPrecisionOptimizer.state_dict(optimizer)
        fsdp: dict[str, Any] = {f"{_FSDP}/state/{n}/{k}": v for n, values in named["state"].items() for k, v in values.items()}
        fsdp |= {f"{_FSDP}/main/{n}": main for n, main in named["main_params"].items()}
        fsdp["meta"] = pickle.dumps({k: v for k, v in named.items() if k not in ("state", "main_params")})
        dcp_save(fsdp, checkpoint_id=checkpoint_id)
        return
    assert isinstance(optimizer, DistributedOptimizer)  # _check_distributed refused the rest
    items = _dcp_items(optimizer)
    full = {k: v for k, v in MixedPrecisionOptimizer.state_dict(optimizer).items() if k not in ("state", "main_params")}
    items["meta"] = pickle.dumps(full)  # one opaque entry, not flattened by dcp
    dcp_save(items, checkpoint_id=checkpoint_id)


def load_dcp(
    optimizer: MixedPrecisionOptimizer, checkpoint_id: str, *, allow_routing_change: bool = False, warm_start: bool = False
) -> RoutingChangeReport | None:
    """Load a :func:`save_dcp` checkpoint saved with any number of ranks. A collective.

    A checkpoint of another model (other param shapes) is refused with the same ``ValueError``
    on every rank, before any rank changes anything. So is one of another routing or plan kind
    (its ``routing_digest``, :mod:`optzoo.wrapper.routing_digest`), read and compared before any
    state: ``allow_routing_change`` and ``warm_start`` are as for
    :meth:`~optzoo.wrapper.MixedPrecisionOptimizer.load_state_dict`, whose report is returned.

    Warning:
        Loading unpickles: torch's DCP stores non-tensor entries with pickle, and the optimizer's
        groups and loss scale are one such entry. As with ``torch.load(weights_only=False)``, a
        checkpoint from an untrusted source can run arbitrary code: load only checkpoints you trust.
    """
    _check_distributed(optimizer, "load_dcp")
    metadata = FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    options = {"allow_routing_change": allow_routing_change, "warm_start": warm_start}
    _check_routing_first(optimizer, checkpoint_id, allow_routing_change)
    if _is_fsdp2(optimizer):
        return _load_fsdp2(optimizer, checkpoint_id, metadata, **options)
    assert isinstance(optimizer, DistributedOptimizer)  # _check_distributed refused the rest
    saved: dict[tuple[str, str, str | None], list[tuple[int, int, str]]] = {}
    for key in metadata:
        match = _KEY.match(key)
        if match:
            saved_key = (match["kind"], match["name"], match["key"])
            saved.setdefault(saved_key, []).append((int(match["start"]), int(match["stop"]), key))
    wanted: dict[str, Any] = {"meta": b""}
    for key in _needed_keys(optimizer, saved):
        properties = metadata[key]
        size = getattr(properties, "size", None)
        if size is None:
            wanted[key] = b""  # a non-tensor entry: replaced by dcp.load
        else:
            wanted[key] = torch.empty(size, dtype=properties.properties.dtype)  # type: ignore[union-attr]
    dcp_load(wanted, checkpoint_id=checkpoint_id)
    # Every rank reads the shards it needs, so a checkpoint of another model could fail on some
    # ranks only: all refuse it together, with one message, before any rank loads anything.
    try:
        loaded = _loaded_state(optimizer, wanted, saved)
    except Exception as error:
        agree_on_error(error, optimizer.process_group, "load_dcp")
        raise
    agree_on_error(None, optimizer.process_group, "load_dcp")
    return optimizer.load_state_dict(loaded, **options)


def _check_routing_first(optimizer: MixedPrecisionOptimizer, checkpoint_id: str, allow_routing_change: bool) -> None:
    """Read the checkpoint's groups and routing alone and refuse, on every rank, a plan kind whose
    keys this loader cannot read or a changed routing (unless allowed), before any state is read."""
    meta_only: dict[str, Any] = {"meta": b""}
    dcp_load(meta_only, checkpoint_id=checkpoint_id)
    meta = pickle.loads(meta_only["meta"])  # noqa: S301 - unpickles, as torch.load does: load only trusted checkpoints
    try:
        check_param_shapes(meta, optimizer.param_map)  # another model first: its message names the shape
        ours = optimizer.routing_record()
        saved_plan = (meta.get(ROUTING_KEY) or {}).get("plan")
        if saved_plan is not None and (saved_plan == "fsdp2") != (ours["plan"] == "fsdp2"):
            raise ValueError(
                f"`load_dcp`: the checkpoint was saved under plan {saved_plan!r}; got an optimizer under plan {ours['plan']!r}; "
                "expected the same kind (FSDP2 and the distributed optimizers write different keys: go through a "
                "consolidated state_dict(), which loads under any plan)"
            )

        def canonical(name: str) -> str | None:
            entry = optimizer.param_map.entry(name)
            return None if entry is None else entry.name

        check_routing(meta, ours, canonical, allow_routing_change=allow_routing_change, warn_without_digest=False)
    except Exception as error:
        agree_on_error(error, optimizer.process_group, "load_dcp")
        raise
    agree_on_error(None, optimizer.process_group, "load_dcp")


def _fsdp_key(key: str) -> tuple[str, str, str | None] | None:
    """``(kind, param name, state key)`` of a key :func:`save_dcp` writes under FSDP2, else ``None``."""
    if key.startswith(f"{_FSDP}/main/"):
        return "main", key[len(f"{_FSDP}/main/") :], None
    if key.startswith(f"{_FSDP}/state/"):
        name, _, state_key = key[len(f"{_FSDP}/state/") :].rpartition("/")
        return "state", name, state_key
    return None


def _load_fsdp2(
    optimizer: MixedPrecisionOptimizer, checkpoint_id: str, metadata: Mapping[str, Any], **options: bool
) -> RoutingChangeReport | None:
    """Load a checkpoint :func:`save_dcp` wrote under FSDP2, on any number of ranks: each whole-param
    entry is read into a DTensor sharded as its param now is, anything else whole."""
    wanted: dict[str, Any] = {"meta": b""}
    for key, properties in metadata.items():
        parsed = _fsdp_key(key)
        entry = optimizer.param_map.entry(parsed[1]) if parsed else None
        if entry is None or entry.main is None:
            continue  # another model's param: the loader names it, from the saved groups
        size = getattr(properties, "size", None)
        if size is None:
            wanted[key] = b""  # a non-tensor entry: replaced by dcp.load
        elif tuple(size) == tuple(entry.model.shape) and isinstance(entry.main, DTensor):
            wanted[key] = torch.empty_like(entry.main, dtype=properties.properties.dtype)
        else:
            wanted[key] = torch.empty(size, dtype=properties.properties.dtype)
    dcp_load(wanted, checkpoint_id=checkpoint_id)
    meta = pickle.loads(wanted.pop("meta"))  # noqa: S301 - unpickles, as torch.load does: load only trusted checkpoints
    state: dict[str, dict[str, Any]] = {}
    mains: dict[str, Any] = {}
    for key, value in wanted.items():
        parsed = _fsdp_key(key)
        assert parsed is not None  # only such keys were asked for
        kind, name, state_key = parsed
        if kind == "main":
            mains[name] = value
        else:
            assert state_key is not None  # state keys always name their entry
            state.setdefault(name, {})[state_key] = value
    return optimizer.load_state_dict({**meta, "state": state, "main_params": mains}, **options)


def _loaded_state(
    optimizer: DistributedOptimizer, wanted: Mapping[str, Any], saved: Mapping[tuple[str, str, str | None], list[tuple[int, int, str]]]
) -> dict[str, Any]:
    """The name-keyed state dict of what this rank read, once the saved shapes are checked against the model's."""
    meta = pickle.loads(wanted["meta"])  # noqa: S301 - unpickles, as torch.load does: load only trusted checkpoints
    check_param_shapes(meta, optimizer.param_map)
    for (_, name, state_key), ranges in saved.items():
        entry = optimizer.param_map.entry(name)
        stop = max(b for _, b, _ in ranges)
        if entry is not None and stop > entry.model.numel():
            where = f"state `{state_key}`" if state_key else "fp32 main param"
            raise ValueError(
                f"`{entry.name}`: {where} in the checkpoint covers elements up to {stop}; got a param of "
                f"{entry.model.numel()} elements (shape {tuple(entry.model.shape)}); expected the checkpoint's param shape"
            )
    full_state: dict[str, dict[str, Any]] = {}
    mains: dict[str, torch.Tensor] = {}
    for (kind, name, state_key), ranges in saved.items():
        entry = optimizer.param_map.entry(name)
        if entry is None:
            continue
        param = entry.model
        pieces = [(None if (a, b) == (0, param.numel()) else (a, b), wanted[key]) for a, b, key in ranges if key in wanted]
        if not pieces:
            continue
        if kind == "main":
            mains[name] = _assemble(pieces, param)
        else:
            assert state_key is not None  # state keys always name their entry
            full_state.setdefault(name, {})[state_key] = _assemble(pieces, param)
    return {**meta, "state": full_state, "main_params": mains}


def _needed_keys(optimizer: DistributedOptimizer, saved: Mapping[tuple[str, str, str | None], list[tuple[int, int, str]]]) -> list[str]:
    """The saved keys overlapping this rank's shards (one suffices for entries like ``step``)."""
    needed = []
    for (_, name, _), ranges in saved.items():
        entry = optimizer.param_map.entry(name)
        if entry is None or not entry.local:
            continue
        start, stop = entry.part if entry.part is not None else (0, entry.model.numel())
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
    if not per_element(value, part, tuple(param.shape)):
        return value
    if len(pieces) == 1 and part is None:
        return value
    out = torch.zeros(param.numel(), dtype=value.dtype)
    for piece_part, piece in pieces:
        start, stop = piece_part if piece_part is not None else (0, param.numel())
        out[start:stop] = piece.reshape(-1)
    return out.view(param.shape)
