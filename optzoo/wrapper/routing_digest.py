"""The routing fingerprint of a checkpoint: what decides each param's optimizer state, and what changed.

Every optzoo checkpoint (``state_dict()``, and ``save_dcp``'s metadata) carries ``routing``: per
param its shape, group, algorithm, precision flags (dtype, where its gradient goes, whether an fp32
main copy is kept) and block layout (the matrices the forward multiplies it as, ``flatten``), and the
distributed plan's kind; and ``routing_digest``, a SHA-256 over that record as canonical JSON, the
same in every process and on every world size. A load compares the digests before it reads any
state; where they differ, :func:`routing_changes` names the params whose routing changed, and the
load is refused unless asked to start those params fresh (``allow_routing_change=True``), or to
carry over what has a meaning on both sides (``warm_start=True``, :func:`warm_start_state`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from optzoo._common import MatrixView
from optzoo.wrapper.param_map import ParamMap

__all__ = [
    "DIGEST_KEY",
    "OPTZOO_FRAMES",
    "ROUTING_KEY",
    "PlanKind",
    "RoutingChange",
    "RoutingChangeReport",
    "RoutingChangeWarning",
    "WARM_STARTS",
    "check_routing",
    "digest_of",
    "routing_changes",
    "routing_record",
    "warm_start_state",
]

ROUTING_KEY = "routing"
DIGEST_KEY = "routing_digest"
SHOWN = 5
"""How many changed params a refusal or a report names before it counts the rest."""
OPTZOO_FRAMES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
"""Warnings skip optzoo's own frames: they point at the caller's load, however deep the loader."""

WARM_STARTS = frozenset({("adam", "muon"), ("muon", "adam")})
"""``(old algorithm, new algorithm)`` pairs :func:`warm_start_state` converts."""

PlanKind = Literal["none", "layer_wise", "sharded", "fsdp2"]
"""How the optimizer is distributed: not at all (one process, or DDP), the layer-wise or sharded
(ZeRO-1) distributed optimizer, or FSDP2 params. The world size is not part of it: every kind
reshards."""


class RoutingChangeWarning(UserWarning):
    """A load started some params' state fresh, or read a checkpoint that carries no routing digest."""


@dataclass(frozen=True)
class RoutingChange:
    """One param whose routing differs from the checkpoint's."""

    name: str
    old_group: int
    new_group: int
    old_optimizer: str
    new_optimizer: str
    what: tuple[str, ...]
    """What differs: ``algorithm``, ``group`` (another group of the same algorithm), ``precision``, ``layout``."""

    def describe(self) -> str:
        """``name: group #0 muon -> group #2 adam``, plus what else differs."""
        extra = [w for w in self.what if w in ("precision", "layout")]
        return (
            f"{self.name}: group #{self.old_group} {self.old_optimizer} -> group #{self.new_group} {self.new_optimizer}"
            + (f" ({', '.join(extra)})" if extra else "")
        )


@dataclass(frozen=True)
class RoutingChangeReport:
    """What ``load_state_dict(..., allow_routing_change=True)`` did with params whose routing changed.

    Every param is in ``changed`` or loaded as saved. Of the changed ones, ``fresh`` start with no
    state (as a new optimizer's, made at their next step), ``converted`` were warm-started
    (:func:`warm_start_state`), and the rest (moved to another group of the same algorithm, with the
    same precision and layout) kept their saved state. Groups whose members changed keep this
    optimizer's hyperparameters; the others take the checkpoint's, as in any load.
    """

    changed: tuple[RoutingChange, ...]
    fresh: tuple[str, ...]
    converted: tuple[str, ...]


def _view_json(view: MatrixView | None) -> Any:
    return None if view is None else {f.name: list(getattr(view, f.name)) for f in dataclasses.fields(view)}


def routing_record(
    param_map: ParamMap, param_groups: Sequence[Mapping[str, Any]], views: Mapping[str, MatrixView | None], plan: PlanKind,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, Any]:
    """What decides every param's state, as plain JSON values (see the module docstring).

    ``views``: each param's :class:`~optzoo._common.MatrixView` by name (``None`` or absent: stepped as
    stored). Only whole-param facts are read (global shapes, never a rank's part), so every rank and
    every world size gives the same record. ``dtypes``: each param's dtype by name when the
    optimizer was built (default: the model's now).
    """
    params: dict[str, Any] = {}
    for entry in param_map.entries:
        group = param_groups[entry.group]
        params[entry.name] = {
            "shape": list(entry.model.shape),
            "group": entry.group,
            "optimizer": str(group.get("optimizer", type(group).__name__)),
            "precision": {
                "dtype": str((dtypes or {}).get(entry.name, entry.model.dtype)).removeprefix("torch."),
                "grad": entry.grad_target,
                "fp32_main": entry.master,
            },
            "layout": {"flatten": bool(group.get("flatten", False)), "view": _view_json(views.get(entry.name))},
        }
    return {"plan": plan, "params": params}


def digest_of(record: Mapping[str, Any]) -> str:
    """SHA-256 of ``record`` as canonical JSON (sorted keys, no spaces): the same in every process.

    Example:
        >>> digest_of({"plan": "none", "params": {}})[:12]
        'e3bf0fa2c42d'
    """
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _match_groups(saved: Sequence[tuple[str, set[str]]], ours: Sequence[tuple[str, set[str]]]) -> dict[int, int]:
    """Saved group index -> our group index: each pair of the same algorithm, largest overlap first
    (ties: lower indices), each group matched once. A group no longer there stays unmatched."""
    pairs = sorted(
        (-len(names & mine), i, j)
        for i, (algorithm, names) in enumerate(saved)
        for j, (our_algorithm, mine) in enumerate(ours)
        if algorithm == our_algorithm and names & mine
    )
    matched: dict[int, int] = {}
    taken: set[int] = set()
    for _, i, j in pairs:
        if i not in matched and j not in taken:
            matched[i] = j
            taken.add(j)
    return matched


def routing_changes(
    saved_groups: Sequence[Mapping[str, Any]],
    saved_params: Mapping[str, Any] | None,
    ours: Mapping[str, Any],
    canonical: Callable[[str], str | None],
) -> list[RoutingChange]:
    """The params whose routing differs from the checkpoint's, in our routing order.

    A saved group is the same group here if it has the same algorithm and holds the most of its
    params (so a renumbering moves nothing); a param changed if its algorithm changed, it is in
    another group than its saved group's match, or (when the checkpoint has a record) its block
    layout changed; a precision change is noted beside these. A precision change alone is left to
    the loader's precision checks (which name the setting, and let an fp32 checkpoint resume on a
    model cast to bf16), as are names on one side only and other shapes.
    """
    our_params = ours["params"]
    old_of: dict[str, tuple[int, str, str]] = {}  # our name -> (saved group, its optimizer, saved name)
    saved_sets: list[tuple[str, set[str]]] = []
    for index, group in enumerate(saved_groups):
        names = {n for n in (canonical(s) for s in group["param_names"]) if n is not None}
        algorithm = str(group.get("optimizer"))
        saved_sets.append((algorithm, names))
        for saved_name in group["param_names"]:
            name = canonical(saved_name)
            if name is not None:
                old_of[name] = (index, algorithm, saved_name)
    our_sets: dict[int, tuple[str, set[str]]] = {}
    for name, record in our_params.items():
        our_sets.setdefault(record["group"], (record["optimizer"], set()))[1].add(name)
    ordered = [our_sets.get(j, ("", set())) for j in range(max(our_sets, default=-1) + 1)]
    match = _match_groups(saved_sets, ordered)
    changes = []
    for name, record in our_params.items():
        if name not in old_of:
            continue
        old_group, old_algorithm, saved_name = old_of[name]
        saved_record = (saved_params or {}).get(saved_name)
        if isinstance(saved_record, Mapping) and saved_record.get("shape") != record["shape"]:
            continue  # another model, not another routing: the shape check names it
        what = []
        if old_algorithm != record["optimizer"]:
            what.append("algorithm")
        elif match.get(old_group) != record["group"]:
            what.append("group")
        if isinstance(saved_record, Mapping):  # (a new algorithm reads its own block layout)
            keys = ("precision",) if "algorithm" in what else ("precision", "layout")
            what += [key for key in keys if saved_record.get(key) != record[key]]
        if what and what != ["precision"]:  # precision alone: the loader's precision checks name the setting
            changes.append(RoutingChange(name, old_group, record["group"], old_algorithm, record["optimizer"], tuple(what)))
    return changes


def check_routing(
    state_dict: Mapping[str, Any],
    ours: Mapping[str, Any],
    canonical: Callable[[str], str | None],
    *,
    allow_routing_change: bool,
    warn_without_digest: bool = True,
) -> list[RoutingChange]:
    """Compare a checkpoint's routing with ours before anything is read; return what changed.

    Raises:
        ValueError: The routing changed and ``allow_routing_change`` is False: names the first
            :data:`SHOWN` params with their old and new group and algorithm, and counts the rest.

    Warns:
        RoutingChangeWarning: Once, when the checkpoint carries no digest (saved before it was
            added): its routing is then compared by group membership and algorithm only.
    """
    digest = state_dict.get(DIGEST_KEY)
    if digest == digest_of(ours):
        return []
    saved_record = state_dict.get(ROUTING_KEY)
    if DIGEST_KEY not in state_dict and warn_without_digest:  # (torch's format says None: it has no place for one)
        warnings.warn(
            "`state_dict`: no routing digest; got a checkpoint saved before optzoo recorded one; expected "
            f"`{DIGEST_KEY}`: its routing is compared by group membership and algorithm only (save it again to record one)",
            RoutingChangeWarning,
            skip_file_prefixes=OPTZOO_FRAMES,
        )
    saved_params = saved_record.get("params") if isinstance(saved_record, Mapping) else None
    changes = routing_changes(state_dict["param_groups"], saved_params, ours, canonical)
    if changes and not allow_routing_change:
        shown = "; ".join(change.describe() for change in changes[:SHOWN])
        more = f"; ... (+{len(changes) - SHOWN} more)" if len(changes) > SHOWN else ""
        raise ValueError(
            f"`state_dict`: the routing (param group and optimizer) of {len(changes)} params differs from the checkpoint's; got {shown}{more}; "
            "expected the routing it was saved with (or load_state_dict(..., allow_routing_change=True) to load "
            "what still fits and start these params fresh)"
        )
    return changes


def warm_start_state(old_optimizer: str, new_optimizer: str, values: Mapping[str, Any]) -> dict[str, Any] | None:
    """One param's saved state carried from ``old_optimizer`` to ``new_optimizer``, or ``None`` when
    the two keep nothing with a meaning on both sides. An approximation: the state is what the other
    algorithm would have accumulated only where both keep the same quantity.

    * ``adam`` -> ``muon``: Muon's ``momentum_buffer`` is Adam's ``exp_avg`` (the same tensor values:
      both are an exponential average of gradients, ``lerp(grad, 1 - beta)``); Adam's ``step`` and
      ``exp_avg_sq`` are dropped (Muon keeps neither).
    * ``muon`` -> ``adam``: ``exp_avg`` is Muon's ``momentum_buffer`` (the same values),
      ``exp_avg_sq`` its element-wise square and ``step`` 0. With ``step`` 0 Adam's bias correction
      divides both moments again at its next step; the squared momentum keeps that first update
      within about ``lr`` per element, as Adam's own first step is (zeros would make it about
      ``beta1 / (1 - beta1)`` times too large).

    Example:
        >>> m = torch.tensor([0.5, -2.0])
        >>> warm_start_state("adam", "muon", {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": m * m})["momentum_buffer"] is m
        True
    """
    if (old_optimizer, new_optimizer) == ("adam", "muon") and isinstance(values.get("exp_avg"), torch.Tensor):
        return {"momentum_buffer": values["exp_avg"]}
    if (old_optimizer, new_optimizer) == ("muon", "adam") and isinstance(values.get("momentum_buffer"), torch.Tensor):
        momentum = values["momentum_buffer"]
        return {"step": torch.tensor(0.0), "exp_avg": momentum, "exp_avg_sq": momentum * momentum}
    return None
