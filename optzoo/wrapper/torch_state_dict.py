"""torch.optim's state-dict contract, for torch's DCP state-dict API (``get_optimizer_state_dict``).

torch's ``torch.distributed.checkpoint.state_dict`` reads an optimizer as torch.optim writes it:
``state`` keyed by each param's position in ``param_groups`` and groups listing ``params`` by
position; it replaces the positions by the model's canonical names (found by identity among
``model.named_parameters()``), gathers or offloads DTensors, and hands the same shape back to
``load_state_dict`` keyed by those names. optzoo's own format is keyed by names already
(:mod:`optzoo.wrapper.state_dict`), so ``state_dict()`` answers torch's API in torch's format and
everyone else in optzoo's, and ``load_state_dict`` takes either. torch's API keeps only ``state``
and ``param_groups``: an fp32 main param travels in its param's state (:data:`MAIN_PARAM_KEY`),
and the loss scaler's state in every group (``grad_scaler``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from optzoo._common import shorten
from optzoo.wrapper.param_map import ParamMap
from optzoo.wrapper.routing_digest import DIGEST_KEY
from optzoo.wrapper.state_dict import STATE_DICT_FORMAT

__all__ = ["MAIN_PARAM_KEY", "called_by_torch_state_dict_api", "from_torch_format", "is_torch_format", "to_torch_format"]

MAIN_PARAM_KEY = "fp32_main_param"
"""The per-param state key that carries a 16-bit param's fp32 main param in torch's format."""

_TORCH_API = "torch.distributed.checkpoint.state_dict"
_FRAMES = 6
"""How far up the stack torch's API may sit: frameworks wrap the optimizer (accelerate's
``AcceleratedOptimizer.state_dict`` calls ours) between torch's call and this one."""


def called_by_torch_state_dict_api() -> bool:
    """Whether ``state_dict()`` was called by torch's DCP state-dict API (``get_optimizer_state_dict``,
    ``get_state_dict``, and ``set_optimizer_state_dict`` for its template), which reads positions.

    torch gives the optimizer no argument that says so; its module on the stack does.
    """
    frame = sys._getframe(2)
    for _ in range(_FRAMES):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _TORCH_API:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def to_torch_format(named: Mapping[str, Any], param_groups: list[dict[str, Any]], param_map: ParamMap) -> dict[str, Any]:
    """This process's name-keyed state dict in torch.optim's format: ``state`` by position in
    ``param_groups`` (the local params, group by group), each group's ``params`` by position and
    every other key of the live group (torch's flattened form restores the keys the live groups have).

    Raises:
        ValueError: A group's params are not the model's (fp32 main copies of 16-bit params,
            or dense working copies): torch's API finds a param's name by identity among the
            model's params, so it could not name them.
    """
    copies = [entry.name for entry in param_map.local if entry.main is not entry.model]
    if copies:
        raise ValueError(
            f"torch's get_optimizer_state_dict: this optimizer steps copies of [{shorten(copies)}], not the model's params "
            "(fp32 main params of 16-bit params, or dense copies of params with gaps), and torch's API finds a param's "
            "name by identity among model.named_parameters(); got such an optimizer; expected fp32 params stepped in place, "
            "or optimizer.state_dict() / optzoo.distributed.save_dcp, which keep the fp32 main params"
        )
    position = {entry.name: index for index, entry in enumerate(param_map.local)}
    state: dict[int, dict[str, Any]] = {}
    for entry in param_map.local:
        values = dict(named["state"].get(entry.name, {}))
        main = named["main_params"].get(entry.name)
        if main is not None:
            values[MAIN_PARAM_KEY] = main
        if values:
            state[position[entry.name]] = values
    groups = []
    for live, entries in zip(param_groups, param_map.local_by_group(), strict=True):
        # matrix_views (how the forward views each param) is the model's to say, not the
        # checkpoint's: kept as a key, since torch's flattened form restores the live keys, but empty
        group = {key: None if key == "matrix_views" else value for key, value in live.items() if key != "params"}
        group["params"] = [position[entry.name] for entry in entries]
        if named.get("grad_scaler") is not None:
            group["grad_scaler"] = named["grad_scaler"]
        groups.append(group)
    return {"state": state, "param_groups": groups}


def is_torch_format(state_dict: Any) -> bool:
    """Whether ``state_dict`` is in torch.optim's format (groups list ``params``), not optzoo's."""
    if not isinstance(state_dict, Mapping) or "format" in state_dict:
        return False
    groups = state_dict.get("param_groups")
    return isinstance(groups, list) and bool(groups) and all(isinstance(g, Mapping) and "params" in g for g in groups)


def from_torch_format(state_dict: Mapping[str, Any], param_map: ParamMap) -> dict[str, Any]:
    """A torch-format state dict as optzoo's name-keyed one, for the one checked loader.

    As torch.optim's ``load_state_dict``, the saved groups' ``params`` (positions, or the names
    torch's DCP API puts there) stand for this optimizer's params in order; ``state`` is keyed
    by the same keys.

    Raises:
        ValueError: The groups or their sizes differ from this optimizer's.
    """
    saved_groups = state_dict["param_groups"]
    local = param_map.local_by_group()
    if len(saved_groups) != len(local):
        raise ValueError(
            f"`state_dict`: a torch-format state dict with {len(saved_groups)} param groups; got "
            f"[{shorten([str(len(g['params'])) for g in saved_groups])}] params per group; expected {len(local)} groups "
            f"of [{shorten([str(len(entries)) for entries in local])}] params, as this optimizer's"
        )
    group_names = param_map.group_names()
    saved_state = state_dict.get("state", {})
    state: dict[str, Any] = {}
    mains: dict[str, Any] = {}
    groups = []
    scaler = None
    for index, (saved, entries) in enumerate(zip(saved_groups, local, strict=True)):
        keys = list(saved["params"])
        if len(keys) != len(entries):
            raise ValueError(
                f"`state_dict`: param group #{index} ({group_names[index][0]}, ...) has {len(entries)} params; got "
                f"{len(keys)} in the checkpoint ([{shorten([str(k) for k in keys])}]); expected the same params"
            )
        for key, entry in zip(keys, entries, strict=True):
            values = dict(saved_state.get(key, {}))
            main = values.pop(MAIN_PARAM_KEY, None)
            if main is not None:
                mains[entry.name] = main
            if values:
                state[entry.name] = values
        scaler = saved.get("grad_scaler", scaler)
        groups.append({**{k: v for k, v in saved.items() if k not in ("params", "grad_scaler")}, "param_names": group_names[index]})
    # torch's format keeps only state and groups by position: no routing digest to compare (its
    # groups' `optimizer` still show an algorithm change); None says so, so no old-checkpoint warning.
    return {
        "format": STATE_DICT_FORMAT, "state": state, "param_groups": groups, "grad_scaler": scaler, "main_params": mains, DIGEST_KEY: None,
    }  # fmt: skip
