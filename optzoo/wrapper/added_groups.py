"""``add_param_group`` after ``get_optimizer``: new params routed by the rules that built the optimizer.

Lightning's fine-tuning callbacks (``BaseFinetuning.unfreeze_and_add_param_group``,
``BackboneFinetuning``) unfreeze a module mid-run and hand its params to ``add_param_group``. The
wrapper routes them as ``get_optimizer`` would have, had they been trainable then: the model is
routed again with the same config, overrides and role reading (:class:`Rerouter`), and each new
param takes the group its routing gives (optimizer, Muon's scalar hand-off, weight decay, lr).

* Without other keys, a new param joins the existing group whose settings are the same, or a new
  group is made for it.
* Keys the caller passes besides ``params`` (Lightning passes ``lr``) are settings for those params:
  they go into new groups, one per routed group (a backbone's matrices and its norms stay apart),
  appended in routing order. Such groups are *siblings*: a key the caller set and that later
  changes on one of them only (Lightning's ``BackboneFinetuning`` sets ``param_groups[-1]["lr"]``)
  reaches the others at the next step (:func:`sync_siblings_`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from optzoo._common import shorten
from optzoo.config import OptimizerConfig
from optzoo.groups import OverrideValue, ResolvedGroup, resolve_group_configs
from optzoo.optimizers.registry import get_spec
from optzoo.routing import ExampleInputs, ParamKey, RoutedParam
from optzoo.wrapper.param_map import ParamEntry, ParamMap, build_param_map, check_param_dtypes

__all__ = ["AddedGroups", "Rerouter", "instance_key", "route_added_params", "sync_siblings_"]

# Keys routing decides: a caller cannot set them through add_param_group.
_ROUTED_KEYS = ("optimizer", "matrix_views", "flatten", "default_config", "wd_mult")
# Keys that do not say how a group steps (compared when a new param could join a group).
_NOT_SETTINGS = ("params", "param_names", "matrix_views", "initial_lr")


def instance_key(group: ResolvedGroup) -> tuple[Any, ...]:
    """Which inner optimizer steps ``group``: its algorithm and the settings held per instance."""
    spec = get_spec(group.optimizer)
    return (spec.name, *(getattr(group.config, f) for f in spec.instance_fields))


@dataclass(frozen=True)
class Rerouter:
    """What ``get_optimizer`` routed with, to route params that became trainable later."""

    config: OptimizerConfig
    chunks: Sequence[torch.nn.Module]
    config_overrides: Mapping[ParamKey, OverrideValue] | None
    strict: bool
    example_inputs: ExampleInputs | Sequence[ExampleInputs | None] | None
    trace: bool

    def resolve(self) -> list[ResolvedGroup]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # get_optimizer already warned about these rules and roles
            groups, _ = resolve_group_configs(
                self.config, self.chunks, self.config_overrides, strict=self.strict, example_inputs=self.example_inputs, trace=self.trace
            )
        return groups


@dataclass
class AddedGroups:
    """What :func:`route_added_params` decided: the wrapper applies it."""

    param_map: ParamMap
    new_groups: list[tuple[dict[str, Any], tuple[Any, ...], ResolvedGroup]] = field(default_factory=list)
    """Each new torch group, the key of its inner optimizer, and its resolved group."""
    joined: list[tuple[dict[str, Any], list[torch.Tensor], list[str], list[Any] | None]] = field(default_factory=list)
    """Each existing group that new params join: their mains, names, and matrix views."""
    siblings: tuple[list[dict[str, Any]], dict[str, Any]] | None = None


def _describe(param: torch.Tensor, position: int) -> str:
    return f"params[{position}] ({tuple(param.shape)}, {str(param.dtype).removeprefix('torch.')})"


def _given_params(param_group: Mapping[str, Any]) -> list[torch.Tensor]:
    if not isinstance(param_group, Mapping) or "params" not in param_group:
        got = sorted(param_group) if isinstance(param_group, Mapping) else type(param_group).__name__
        raise TypeError(f"`add_param_group`: a group is a dict with 'params'; got {got}; expected {{'params': [...], ...}}")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, (set, frozenset)) or not isinstance(params, (list, tuple)) and not hasattr(params, "__iter__"):
        raise TypeError(
            f"`add_param_group`: 'params' must be an ordered collection of tensors; got {type(params).__name__}; "
            "expected a list or tuple of parameters (a set's order varies between runs)"
        )
    params = list(params)
    bad = [f"params[{i}] ({type(p).__name__})" for i, p in enumerate(params) if not isinstance(p, torch.Tensor)]
    if bad:
        raise TypeError(f"`add_param_group`: 'params' holds what is not a tensor; got {shorten(bad)}; expected parameters")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("`add_param_group`: a parameter appears more than once; got duplicates in 'params'; expected each once")
    return params


def route_added_params(
    param_group: Mapping[str, Any],
    *,
    rerouter: Rerouter,
    param_map: ParamMap,
    param_groups: Sequence[dict[str, Any]],
    group_keys: Sequence[tuple[Any, ...]],
) -> AddedGroups | None:
    """Route the params of ``param_group`` as ``get_optimizer`` would have; nothing changes yet.

    Returns ``None`` when every param is stepped already (each named in a warning, as Lightning's
    own ``filter_on_optimizer`` warns).

    Raises:
        TypeError: ``param_group`` is not a dict with a list of tensors under ``params``.
        ValueError: A param the routing cannot place (not a param of the model ``get_optimizer`` was
            given, or not trainable), a key routing decides (``optimizer``, ...) or one no routed
            group has, an invalid ``lr``/``weight_decay``, or ``param_names`` that are not the params'.
    """
    params = _given_params(param_group)
    param_map.check_model_unchanged()
    stepped = {id(t): entry for entry in param_map.entries for t in (entry.model, entry.main) if t is not None}
    already = [(p, stepped[id(p)]) for p in params if id(p) in stepped]
    resolved = rerouter.resolve()
    where: dict[int, tuple[ResolvedGroup, RoutedParam, str]] = {
        id(routed.param): (group, routed, name) for group in resolved for routed, name in zip(group.params, group.param_names)
    }
    unroutable = []
    for position, p in enumerate(params):
        if id(p) in stepped or id(p) in where:
            continue
        names = [f"{'' if len(rerouter.chunks) == 1 else f'{c}.'}{n}" for c, chunk in enumerate(rerouter.chunks) for n, q in chunk.named_parameters() if q is p]
        reason = "does not require grad" if names and not p.requires_grad else (
            "is not a parameter of the model get_optimizer was given" if not names else "is not routed"
        )  # fmt: skip
        unroutable.append(f"{names[0] if names else _describe(p, position)} {reason}")
    if unroutable:
        raise ValueError(
            f"`add_param_group`: params that routing cannot place; got {shorten(unroutable)}; expected trainable params "
            "of the model given to get_optimizer (call get_optimizer again for another model)"
        )
    if already:
        warnings.warn(
            f"`add_param_group`: params already stepped are kept in their groups; got {shorten([e.name for _, e in already])} "
            f"(in groups {sorted({e.group for _, e in already})}); expected only new params: the others are skipped",
            stacklevel=3,
        )
    new = [p for p in params if id(p) not in stepped]
    if not new:
        return None
    caller = {k: v for k, v in param_group.items() if k != "params"}
    new_names = [where[id(p)][2] for p in new]
    _check_caller_keys(caller, new_names, rerouter.config)
    # The routed groups the new params fall in, in routing order, each with only the new params.
    subsets: list[ResolvedGroup] = []
    for group in resolved:
        keep = [i for i, routed in enumerate(group.params) if any(routed.param is p for p in new)]
        if keep:
            subsets.append(
                dataclasses.replace(
                    group, params=tuple(group.params[i] for i in keep), param_names=tuple(group.param_names[i] for i in keep),
                    all_names=tuple(group.all_names[i] for i in keep),
                )
            )  # fmt: skip
    check_param_dtypes(rerouter.config, subsets)
    plan = AddedGroups(param_map=param_map)
    next_index = len(param_groups)
    placed: list[ResolvedGroup] = []
    for subset in subsets:
        target = None if caller else _same_settings(subset, param_groups, group_keys)
        if target is None:
            placed.append(dataclasses.replace(subset, index=next_index))
            next_index += 1
        else:
            placed.append(dataclasses.replace(subset, index=target))
    new_map = build_param_map(rerouter.config, placed, model_chunks=rerouter.chunks)
    by_group: dict[int, list[ParamEntry]] = {}
    for entry in new_map.entries:
        by_group.setdefault(entry.group, []).append(entry)
    for group in placed:
        entries = by_group[group.index]
        mains = [e.main for e in entries if e.main is not None]
        names = [e.name for e in entries]
        if group.index < len(param_groups):
            target_group = param_groups[group.index]
            views = group.matrix_views(names)
            if "matrix_views" in target_group:
                views = views or [None] * len(names)
            plan.joined.append((target_group, mains, names, views))
            continue
        torch_group = group.torch_param_group(mains, names)
        for key, value in caller.items():
            if key in torch_group and key != "param_names":  # a key goes to the groups that have it (betas: Adam's)
                torch_group[key] = value
        if "lr" in caller:
            torch_group["max_lr"] = caller["lr"]  # the peak optzoo's scheduler reads
        plan.new_groups.append((torch_group, instance_key(group), group))
    settable = {k for g, _, _ in plan.new_groups for k in g}
    missing = [k for k in caller if k != "param_names" and k not in settable]
    if missing:
        raise ValueError(
            f"`add_param_group`: keys no group of these params has; got {missing}; expected settings of the groups they "
            f"route to ({', '.join(sorted({g['optimizer'] for g, _, _ in plan.new_groups}))}): "
            f"{sorted(settable - {'params', 'param_names', *_ROUTED_KEYS})}"
        )
    if caller and len(plan.new_groups) > 1:
        plan.siblings = ([g for g, _, _ in plan.new_groups], {k: v for k, v in caller.items() if k != "param_names"})
    every = param_map.entries + new_map.entries
    order = sorted(range(len(every)), key=lambda i: every[i].group)  # stable: a joined group's new params come last
    holders = (param_map.holders or (None,) * len(param_map.entries)) + (new_map.holders or (None,) * len(new_map.entries))
    plan.param_map = dataclasses.replace(
        param_map, entries=tuple(every[i] for i in order), num_groups=next_index,
        holders=tuple(holders[i] for i in order) if param_map.holders else (),
    )  # fmt: skip
    return plan


def _check_caller_keys(caller: Mapping[str, Any], names: Sequence[str], config: OptimizerConfig) -> None:
    routed = [k for k in caller if k in _ROUTED_KEYS]
    if routed:
        raise ValueError(
            f"`add_param_group`: keys that routing decides; got {routed} for [{shorten(list(names))}]; expected settings "
            "such as lr or weight_decay (choose the optimizer with a config_overrides rule given to get_optimizer)"
        )
    if "param_names" in caller and list(caller["param_names"]) != list(names):
        raise ValueError(
            f"`add_param_group`: 'param_names' are not the params' names in the model; got {shorten(list(caller['param_names']))}; "
            f"expected {shorten(list(names))}"
        )
    checked = {k: caller[k] for k in ("lr", "weight_decay") if k in caller}
    if checked:
        try:
            config.replace(**checked)
        except (ValueError, TypeError) as error:
            raise ValueError(f"`add_param_group`: {error}") from None


def _same_settings(subset: ResolvedGroup, param_groups: Sequence[dict[str, Any]], group_keys: Sequence[tuple[Any, ...]]) -> int | None:
    """The index of an existing group that steps ``subset``'s params exactly as a group of their own would."""
    wanted = subset.torch_param_group([], [])
    views = subset.matrix_views(list(subset.param_names))
    for index, group in enumerate(param_groups):
        if any(k not in group or group[k] != v for k, v in wanted.items() if k not in _NOT_SETTINGS):
            continue
        if views is not None and "matrix_views" not in group:
            continue
        if group_keys[index] == instance_key(subset):
            return index
    return None


def sync_siblings_(siblings: Sequence[tuple[list[dict[str, Any]], dict[str, Any]]]) -> None:
    """Each key a caller set in one ``add_param_group`` call: a new value found on some of its groups
    (one value only) is set on all of them. Several new values were set apart on purpose: kept."""
    for groups, last in siblings:
        for key, before in last.items():
            holding = [g for g in groups if key in g]  # betas: the Adam groups, not Muon's
            changed = [g[key] for g in holding if g[key] != before]
            if not changed or any(v != changed[0] for v in changed):
                continue
            for g in holding:
                g[key] = changed[0]
            last[key] = changed[0]
