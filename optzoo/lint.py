"""The routing linter: routings that run, but look wrong.

:func:`lint_routing` reads resolved groups (and the rules that made them) and returns
:class:`Finding` records; ``get_optimizer`` warns once per finding (:class:`RoutingLintWarning`),
and ``optzoo lint`` / ``optzoo dump-param-groups --lint`` print them. The findings:

* ``embedding-on-matrix-optimizer``: an embedding or the output head sent to a matrix optimizer
  (Muon, SOAP) by a user rule; they train better on the scalar optimizer (Keller Jordan's Muon,
  Moonlight, Megatron-Core all keep them there);
* ``decayed-vector``: a bias, a norm or a 1-D parameter that is weight-decayed;
* ``large-matrix-on-elementwise``: a large N-D parameter (at least :data:`LARGE_PARAM_ELEMENTS`
  elements, not an embedding, head, bias, norm or vector) on an element-wise optimizer while a
  matrix optimizer steps the model's other matrices;
* ``tied-names-disagree``: a rule that selects a tied tensor under some of its names but not
  others: its settings reach every name (or, excluded under one name, none);
* ``shadowed-rule``: a rule that changes nothing, because earlier rules set every field it sets,
  to the same values, on every parameter it matches.

Each message names the parameters (the first 10, and how many more), the rule, and the fix.
Silence one with ``warnings.filterwarnings("ignore", category=RoutingLintWarning, message=...)``,
or all with ``get_optimizer(..., lint=False)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from optzoo._common import SCALAR_ROLES, shorten
from optzoo.groups import ResolvedGroup
from optzoo.optimizers.registry import get_spec
from optzoo.routing import Routing

__all__ = [
    "LARGE_PARAM_ELEMENTS",
    "Finding",
    "LintKind",
    "RoutingLintWarning",
    "findings_as_json",
    "lint_routing",
    "warn_findings",
]

LintKind = Literal[
    "embedding-on-matrix-optimizer", "decayed-vector", "large-matrix-on-elementwise", "tied-names-disagree", "shadowed-rule",
]  # fmt: skip
LARGE_PARAM_ELEMENTS = 2**16
"""From this many elements an N-D parameter on an element-wise optimizer is worth a word, when a
matrix optimizer runs: a 256 x 256 matrix, a 3 x 3 conv of 96 to 96 channels, four 64 x 256 experts."""


class RoutingLintWarning(UserWarning):
    """A routing that runs but looks wrong (:func:`lint_routing`)."""


@dataclass(frozen=True)
class Finding:
    """One thing the linter found: its kind, the parameters it is about, and the message."""

    kind: LintKind
    params: tuple[str, ...]
    message: str


def _names(names: Sequence[str]) -> str:
    return shorten([f"`{n}`" for n in names])


def _rule(routing: Routing, index: int) -> str:
    return f"rule #{index} {routing.keys[index].describe()}"


def _matrix_optimizers(groups: Sequence[ResolvedGroup]) -> list[str]:
    return list(dict.fromkeys(g.optimizer for g in groups if g.params and not get_spec(g.optimizer).elementwise))


def _embeddings_on_matrix_optimizers(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    found: list[Finding] = []
    for group in groups:
        if get_spec(group.optimizer).elementwise:
            continue
        ends = [(routed, names) for routed, names in zip(group.params, group.all_names) if {"embedding", "output"} & routed.roles.names]
        by_rule: dict[tuple[int, ...], list[str]] = {}
        for routed, names in ends:
            setters = tuple(k for k in routed.matched if "optimizer" in routing.overrides[k])
            by_rule.setdefault(setters, []).extend(names)
        for setters, selected in by_rule.items():
            why = " and ".join(_rule(routing, k) for k in setters) or "tag use_muon=True"
            fix = "narrow the rule, e.g. exclude=ParamKey(role=('embedding', 'output'))" if setters else "drop the tag"
            found.append(Finding(
                "embedding-on-matrix-optimizer", tuple(selected),
                f"{_names(selected)}: embedding or output head routed to {group.optimizer} by {why}; got param group "
                f"#{group.index} ({group.optimizer}); expected them on the scalar optimizer (muon_scalar_optimizer), where "
                f"embeddings and heads train better: {fix}",
            ))  # fmt: skip
    return found


def _decayed_vectors(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    found: list[Finding] = []
    for group in groups:
        if group.weight_decay <= 0:
            continue
        names = [
            name
            for routed, all_names in zip(group.params, group.all_names)
            if {"bias", "norm"} & routed.roles.names or routed.param.dim() <= 1
            for name in all_names
        ]
        if names:
            rules = sorted({k for routed in group.params for k in routed.matched})
            found.append(Finding(
                "decayed-vector", tuple(names),
                f"{_names(names)}: biases, norms or 1-D params with weight decay; got weight_decay="
                f"{group.weight_decay:g} in param group #{group.index} (rules: {', '.join(f'#{k}' for k in rules) or 'none'}); "
                "expected no decay on them: merge the standard overrides, "
                "{**get_standard_config_overrides(config), **yours}, or set wd_mult=0.0 on ParamKey(role=('bias', 'norm'), "
                "predicate=get_predicate('is_1d'))",
            ))  # fmt: skip
    return found


def _large_matrices_on_elementwise(groups: Sequence[ResolvedGroup]) -> list[Finding]:
    matrix_optimizers = _matrix_optimizers(groups)
    if not matrix_optimizers:
        return []
    found: list[Finding] = []
    for group in groups:
        if not get_spec(group.optimizer).elementwise:
            continue
        for routed, names in zip(group.params, group.all_names):
            param = routed.param
            if param.dim() < 2 or param.numel() < LARGE_PARAM_ELEMENTS or not SCALAR_ROLES.isdisjoint(routed.roles.names):
                continue
            conv = "conv" in routed.roles.names
            fix = "set muon_flatten_conv=True for it" if conv and not group.config.muon_flatten_conv else (
                f"route it there ({{ParamKey(name={names[0]!r}): {{'optimizer': {matrix_optimizers[0]!r}}}}})"
            )  # fmt: skip
            found.append(Finding(
                "large-matrix-on-elementwise", names,
                f"{_names(names)} ({'x'.join(map(str, param.shape))}, {routed.roles.describe()}): a large matrix on an "
                f"element-wise optimizer while {' and '.join(matrix_optimizers)} steps the other matrices; got "
                f"{group.optimizer} (param group #{group.index}{', ' + group.auto_routed if group.auto_routed else ''}); "
                f"expected {matrix_optimizers[0]}: {fix}",
            ))  # fmt: skip
    return found


def _tied_names_disagree(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    found: list[Finding] = []
    for group in groups:
        for routed, names in zip(group.params, group.all_names):
            local = routed.names  # chunk-local names, as the keys see them
            if len(local) < 2:
                continue
            for index, key in enumerate(routing.keys):
                alone = [key.matches(routed.param, name, routed.roles.names) for name in local]
                if len(set(alone)) == 1:
                    continue
                selected = [name for name, hit in zip(names, alone) if hit]
                outcome = (
                    f"its {sorted(routing.overrides[index])} reach every name" if index in routed.matched
                    else "it sets nothing on the tensor (another name is excluded)"
                )  # fmt: skip
                found.append(Finding(
                    "tied-names-disagree", names,
                    f"{_names(names)}: one tied tensor; {_rule(routing, index)} selects {_names(selected)} but not "
                    f"{_names([n for n in names if n not in selected])}, so {outcome}; got different answers for one "
                    "tensor; expected a rule that selects all its names or none",
                ))  # fmt: skip
    return found


def _shadowed_rules(routing: Routing) -> list[Finding]:
    setters: dict[int, list[tuple[int, tuple[str, ...]]]] = {}  # key index -> [(param id, names)]
    matched_by: dict[int, tuple[int, ...]] = {}
    for spec in routing.groups:
        for routed in spec.params:
            matched_by[id(routed.param)] = routed.matched
            for k in routed.matched:
                setters.setdefault(k, []).append((id(routed.param), routed.names))
    found: list[Finding] = []
    for k, members in setters.items():
        fields = routing.overrides[k]
        if not fields:
            continue
        shadows: set[int] = set()
        for param_id, _ in members:
            earlier = [j for j in matched_by[param_id] if j < k]
            for field, value in fields.items():
                same = [j for j in earlier if field in routing.overrides[j] and routing.overrides[j][field] == value]
                if not same:
                    break
                shadows.update(same)
            else:
                continue
            break
        else:
            names = [name for _, names in members for name in names]
            found.append(Finding(
                "shadowed-rule", tuple(names),
                f"{_rule(routing, k)}: changes nothing; got {dict(fields)} on {_names(names)}, all of it set already by "
                f"{', '.join(_rule(routing, j) for j in sorted(shadows))}; expected it removed, or narrowed to the "
                "params it is meant for",
            ))  # fmt: skip
    return found


def lint_routing(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    """Every finding on a resolved routing, in the order of the kinds above.

    Example:
        >>> import torch
        >>> from optzoo import OptimizerConfig, resolve_group_configs
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> groups, routing = resolve_group_configs(OptimizerConfig(lr=1e-3, weight_decay=0.1), model, {})
        >>> [(f.kind, f.params) for f in lint_routing(groups, routing)]
        [('decayed-vector', ('0.bias', '1.weight', '1.bias'))]
    """
    return [
        *_embeddings_on_matrix_optimizers(groups, routing),
        *_decayed_vectors(groups, routing),
        *_large_matrices_on_elementwise(groups),
        *_tied_names_disagree(groups, routing),
        *_shadowed_rules(routing),
    ]


def warn_findings(findings: Sequence[Finding], *, stacklevel: int = 2) -> None:
    """One :class:`RoutingLintWarning` per finding, ``lint: <kind>: <message>``."""
    for finding in findings:
        warnings.warn(f"lint: {finding.kind}: {finding.message}", RoutingLintWarning, stacklevel=stacklevel + 1)


def findings_as_json(findings: Sequence[Finding]) -> list[Mapping[str, Any]]:
    """The findings as plain dicts (``kind``, ``params``, ``message``), for ``--format json``."""
    return [{"kind": f.kind, "params": list(f.params), "message": f.message} for f in findings]
