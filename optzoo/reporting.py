"""What routing decided, as table rows and JSON: used by the CLI, the demo and ``get_optimizer``'s dumps.

Nothing here changes anything; every function reads resolved groups (and a sharding plan) and
returns plain rows or dicts, so ``optzoo dump-param-groups`` and a script print the same facts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from optzoo._common import MatrixView, jsonable
from optzoo.config import OptimizerConfig
from optzoo.distributed.plan import Shard, ShardingPlan
from optzoo.groups import ResolvedGroup
from optzoo.optimizers.registry import get_spec, registered_names
from optzoo.routing import Routing

__all__ = [
    "EXPLAIN_HEADERS",
    "GROUP_HEADERS",
    "OPTIMIZER_HEADERS",
    "RANK_HEADERS",
    "explain_rows",
    "format_gflop",
    "group_rows",
    "optimizer_rows",
    "owner_shards",
    "owner_text",
    "param_group_map",
    "rank_rows",
]

GROUP_HEADERS = ["group", "optimizer", "lr", "weight_decay", "other overrides", "params", "elements"]
RANK_HEADERS = ["rank", "params owned", "state elements", "load (GFLOP/step)", "share (%)"]
OPTIMIZER_HEADERS = ["name", "source", "shapes", "config fields (defaults)", "description"]


def optimizer_rows() -> list[dict[str, Any]]:
    """One row per registered optimizer: name, source, shapes, its config fields with defaults, description."""
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    rows = []
    for name in registered_names():
        spec = get_spec(name)
        fields = ("lr", "weight_decay", *spec.config_fields)
        rows.append(
            {
                "name": name,
                "source": spec.source,
                "shapes": spec.shapes,
                "fields": {f: jsonable(defaults[f]) for f in fields},
                "description": spec.description,
            }
        )
    return rows


def _format_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def group_rows(groups: Sequence[ResolvedGroup]) -> list[list[Any]]:
    """One row per group (:data:`GROUP_HEADERS`): index, optimizer, lr, weight decay, other overrides, counts."""
    rows = []
    for group in groups:
        others = {k: v for k, v in group.override.items() if k not in ("optimizer", "lr", "max_lr", "weight_decay", "wd_mult")}
        rows.append(
            [
                group.index,
                group.optimizer,
                _format_value(group.lr),
                _format_value(group.weight_decay),
                ", ".join(f"{k}={_format_value(v)}" for k, v in others.items()) or "-",
                len(group.params),
                sum(p.param.numel() for p in group.params),
            ]
        )
    return rows


def _matched_rules(group: ResolvedGroup, matched: Sequence[int], routing: Routing) -> list[str]:
    # "(standard)": a standard override laid under the user's rules (theirs win field by field).
    reasons = [f"#{k} {routing.keys[k].describe()}{' (standard)' if k in routing.defaults else ''}" for k in matched]
    if group.auto_routed:
        reasons.append(group.auto_routed)
    return reasons


EXPLAIN_HEADERS = ["parameter", "group", "shape", "role", "matrices", "matched rules"]


def explain_rows(groups: Sequence[ResolvedGroup], routing: Routing) -> list[list[Any]]:
    """One row per parameter name (tied names included) (:data:`EXPLAIN_HEADERS`): name, group,
    shape, its roles with their sources, the matrices its optimizer steps it as (the blocks the
    forward multiplies by, out x in; ``-`` for element-wise optimizers), the rules that matched it."""
    rows: list[list[Any]] = []
    for group in groups:
        for routed, names in zip(group.params, group.all_names):
            reasons = "; ".join(_matched_rules(group, routed.matched, routing)) or "-"
            shape = "x".join(map(str, routed.param.shape)) or "scalar"
            matrices = _matrices(group, routed.param)
            rows.extend([name, group.index, shape, routed.roles.describe(), matrices, reasons] for name in names)
    return rows


def _matrices(group: ResolvedGroup, param: torch.Tensor) -> str:
    """The matrices a non-element-wise optimizer steps ``param`` as: the forward's view, else its default."""
    if get_spec(group.optimizer).elementwise or param.dim() < 2:
        return "-"
    view = group.matrix_view_of(param) or MatrixView.default(tuple(param.shape), flatten=group.flatten)
    return view.describe()


def param_group_map(groups: Sequence[ResolvedGroup], routing: Routing) -> dict[str, Any]:
    """``{"param_to_group": {name: index}, "matched_rules": {name: [rules]}, "roles": {name: {role:
    source}}, "groups": [summary...]}`` for every name (tied too): what ``dump_param_to_param_group_map``
    writes."""
    mapping: dict[str, int] = {}
    provenance: dict[str, list[str]] = {}
    roles: dict[str, dict[str, str]] = {}
    for group in groups:
        for routed, names in zip(group.params, group.all_names):
            for name in names:
                mapping[name] = group.index
                provenance[name] = _matched_rules(group, routed.matched, routing)
                roles[name] = dict(zip(routed.roles.roles, routed.roles.sources))
                if routed.roles.guessed:
                    roles[name]["guessed"] = "no forward use observed: module types, names and shapes"
    return {
        "param_to_group": mapping,
        "matched_rules": provenance,
        "roles": roles,
        "groups": [group.summary() for group in groups],
    }


def owner_text(shards: Sequence[Shard]) -> str:
    """``1`` for a param one rank owns whole; ``0[0:44] 1[44:64]`` for one split into ranges."""
    if len(shards) == 1 and shards[0].whole:
        return str(shards[0].rank)
    return " ".join(f"{s.rank}[{s.start}:{s.stop}]" for s in shards)


def owner_shards(groups: Sequence[ResolvedGroup], plan: ShardingPlan) -> dict[str, list[Shard]]:
    """``{name: shards}`` for every parameter name, tied names included (they share the shards)."""
    by_canonical: dict[str, list[Shard]] = {}
    for shard in plan.shards:
        by_canonical.setdefault(shard.name, []).append(shard)
    return {
        name: by_canonical.get(canonical, [])
        for group in groups
        for canonical, names in zip(group.param_names, group.all_names)
        for name in names
    }


def rank_rows(plan: ShardingPlan) -> list[dict[str, Any]]:
    """Per rank: params it holds (a split param counts on each of its ranks), state elements, load."""
    loads, elements = plan.loads(), plan.state_elements()
    total = sum(loads)
    counts = [len({(s.group, s.index) for s in plan.owned(rank)}) for rank in range(plan.world_size)]
    return [
        {"rank": rank, "params": counts[rank], "state_elements": elements[rank], "load_flops": loads[rank],
         "share": loads[rank] / total if total else 0.0}
        for rank in range(plan.world_size)
    ]  # fmt: skip


def format_gflop(flops: float) -> str:
    """GFLOP to 4 significant digits without an exponent (loads span 1e-3 to 1e4 GFLOP).

    Example:
        >>> format_gflop(1.234567e9), format_gflop(2.5e13), format_gflop(0.0)
        ('1.235', '25000', '0')
    """
    gflop = flops / 1e9
    return f"{gflop:.{max(0, 3 - math.floor(math.log10(gflop)))}f}" if gflop > 0 else "0"
