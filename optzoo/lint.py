"""The routing linter: routings that run, but send a parameter against what the forward does with it.

:func:`lint_routing` reads resolved groups, the rules that made them and each parameter's roles
(the same record routing reads: :mod:`optzoo.routing.roles`), and returns :class:`Finding`
records; ``get_optimizer`` warns once per finding (:class:`RoutingLintWarning`), and
``optzoo lint`` / ``optzoo dump-param-groups --lint`` print them. The findings:

* ``embedding-on-matrix-optimizer``: an input table or a head (or what module types call one,
  where no forward was observed) sent to a matrix optimizer by a user rule or ``use_muon=True``;
  they train better on the scalar optimizer (Keller Jordan's Muon, Moonlight, Megatron-Core);
* ``large-matrix-on-elementwise``: a large hidden matrix (at least :data:`LARGE_PARAM_ELEMENTS`
  elements, not a table, head, gain, bias or norm) that a user rule sends to an element-wise
  optimizer, or a conv filter that ``muon_flatten_conv=False`` keeps off it, while a matrix
  optimizer that can take it steps the model's other matrices;
* ``decayed-vector``: a bias, a norm, an elementwise parameter (a gain of any shape, an SSM
  parameter) or a 1-D parameter with weight decay; the message says whether the standard
  overrides apply, lie under the user's rules or are off (:func:`standard_overrides_note`);
* ``blocks-orthogonalised-whole``: a parameter the forward multiplies by as several matrices
  (experts, heads, groups) on a matrix optimizer that steps its stored shape as one;
* ``tied-names-disagree``: a rule that selects a tied tensor under some of its names but not others;
* ``shadowed-rule``: a rule that changes nothing, because earlier rules set every field it sets,
  to the same values, on every parameter it matches;
* ``unread-field``: an algorithm's field (``muon_momentum``, ``adam_beta2``, ...: one that some
  registry record lists in its ``config_fields``) set away from its default, by the config or by a
  rule, where no optimizer that steps the params it reaches reads it (``muon_num_ns_steps`` with
  ``torch_muon``, which reads ``torch_muon_ns_steps``); it would be silently ignored.

Each finding carries a :class:`Fix`: changes to ``config_overrides`` (narrow a rule, add one,
remove one) that remove it; :func:`apply_fixes` applies them. Each message names the parameters
(the first 10, and how many more), the rule, and the fix. Silence one with
``warnings.filterwarnings("ignore", category=RoutingLintWarning, message=...)``, or all with
``get_optimizer(..., lint=False)``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from optzoo._common import SCALAR_ROLES, MatrixView, did_you_mean, shorten
from optzoo.config import OptimizerConfig
from optzoo.groups import ResolvedGroup, get_standard_config_overrides, place
from optzoo.optimizers.registry import get_spec, registered_names
from optzoo.routing import ParamKey, RoutedParam, Routing

__all__ = [
    "LARGE_PARAM_ELEMENTS",
    "Finding",
    "Fix",
    "LintKind",
    "RoutingLintWarning",
    "apply_fixes",
    "findings_as_json",
    "lint_routing",
    "standard_overrides_note",
    "warn_findings",
]

LintKind = Literal[
    "embedding-on-matrix-optimizer", "large-matrix-on-elementwise", "decayed-vector", "blocks-orthogonalised-whole",
    "tied-names-disagree", "shadowed-rule", "unread-field",
]  # fmt: skip
LARGE_PARAM_ELEMENTS = 2**16
"""From this many elements an N-D parameter on an element-wise optimizer is worth a word, when a
matrix optimizer runs: a 256 x 256 matrix, a 3 x 3 conv of 96 to 96 channels, four 64 x 256 experts."""
_DECAY_FIELDS = ("weight_decay", "wd_mult")


class RoutingLintWarning(UserWarning):
    """A routing that runs but looks wrong (:func:`lint_routing`)."""


@dataclass(frozen=True)
class Fix:
    """Changes to ``config_overrides`` that remove a finding (:func:`apply_fixes`)."""

    narrow: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """``(rule index, names)``: the rule leaves these params out (their names join its ``exclude``)."""
    add: tuple[tuple[ParamKey, Mapping[str, Any]], ...] = ()
    """New rules, after the existing ones."""
    remove: tuple[int, ...] = ()
    """Rules to drop."""
    extend: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """``(rule index, names)``: the rule's ``name`` globs gain these names (and its ``exclude``, if it
    left one of them out, gains the others)."""

    def describe(self, routing: Routing) -> str:
        """The fix in words, with the rules it changes."""
        parts = [f"leave {_names(list(names))} out of {_rule(routing, k)} (exclude them)" for k, names in self.narrow]
        parts += [f"give {_rule(routing, k)} every name of the tensor ({_names(list(names))})" for k, names in self.extend]
        parts += [f"remove {_rule(routing, k)}" for k in self.remove]
        parts += [f"add {{ParamKey({_short(key)}): {dict(value)}}}" for key, value in self.add]
        return "; ".join(parts)


def _short(key: ParamKey) -> str:
    """A key's description, a long list of exact names shortened to the first three and a count."""
    names = _globs(key)
    if len(names) <= 3 or key.exclude is not None:
        return key.describe()
    return f"name=({', '.join(repr(n) for n in names[:3])}, ... (+{len(names) - 3} more))"


@dataclass(frozen=True)
class Finding:
    """One thing the linter found: its kind, the parameters it is about, the message and the fix."""

    kind: LintKind
    params: tuple[str, ...]
    message: str
    fix: Fix | None = None


def _names(names: Sequence[str]) -> str:
    return shorten([f"`{n}`" for n in names])


def _rule(routing: Routing, index: int) -> str:
    return f"rule #{index} {routing.keys[index].describe()}"


def _exact(names: Sequence[str]) -> ParamKey:
    """A key that selects exactly these names (globs escaped)."""
    escaped = tuple(glob.escape(name) for name in names)
    return ParamKey(name=escaped[0] if len(escaped) == 1 else escaped)


def _local_names(group: ResolvedGroup, routed: RoutedParam) -> tuple[str, ...]:
    return routed.names  # rules see chunk-local names


def _moved(group: ResolvedGroup, routing: Routing, members: Sequence[RoutedParam], fields: Sequence[str], new: Mapping[str, Any]) -> Fix:
    """Leave ``members`` out of every rule that set one of ``fields`` for them, keep what those
    rules set besides, and add ``new`` for them."""
    names = tuple(dict.fromkeys(name for routed in members for name in _local_names(group, routed)))
    # Defaults (the standard overrides under the user's rules) are not the user's to narrow: they
    # come back under any dict, and the rule added here wins over them.
    setters = sorted({
        k for routed in members for k in routed.matched if set(routing.overrides[k]) & set(fields) and k not in routing.defaults
    })  # fmt: skip
    kept = {k: v for k, v in group.override.items() if k not in fields}
    added = {**kept, **new}
    return Fix(narrow=tuple((k, names) for k in setters), add=((_exact(names), added),) if added else ())


def _matrix_optimizers(groups: Sequence[ResolvedGroup]) -> list[str]:
    return list(dict.fromkeys(g.optimizer for g in groups if g.params and not get_spec(g.optimizer).elementwise))


def _tables_or_heads(routed: RoutedParam) -> set[str]:
    ends = {"embedding", "output"} & routed.roles.names
    if routed.roles.guessed:  # what module types would have called it, set aside by Megatron's tags
        ends |= {role for role, _ in routed.roles.ignored if role in ("embedding", "output")}
    return ends


def _embeddings_on_matrix_optimizers(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    found: list[Finding] = []
    for group in groups:
        spec = get_spec(group.optimizer)
        if spec.elementwise:
            continue
        by_cause: dict[tuple[int, ...], list[RoutedParam]] = {}
        for routed in group.params:
            if _tables_or_heads(routed):
                by_cause.setdefault(tuple(k for k in routed.matched if "optimizer" in routing.overrides[k]), []).append(routed)
        for setters, members in by_cause.items():
            names = [n for routed in members for n in group.all_names[group.params.index(routed)]]
            why = " and ".join(_rule(routing, k) for k in setters) or "tag use_muon=True"
            fallback = getattr(group.config, spec.fallback_field) if spec.fallback_field else "adam"
            fix = _moved(group, routing, members, ("optimizer",), {} if setters else {"optimizer": fallback})
            how = fix.describe(routing) if setters else f"drop the tag, or {fix.describe(routing)}"
            found.append(Finding(
                "embedding-on-matrix-optimizer", tuple(names),
                f"{_names(names)}: input table or head routed to {group.optimizer} by {why}; got param group "
                f"#{group.index} ({group.optimizer}); expected them on the scalar optimizer ({fallback}), where tables "
                f"and heads train better: {how}",
                fix,
            ))  # fmt: skip
    return found


def _takes(optimizer: str, routed: RoutedParam, group: ResolvedGroup) -> bool:
    """Whether ``optimizer`` could take ``routed`` if a rule sent it there."""
    spec = get_spec(optimizer)
    if spec.place is None:
        return True
    fields = {name: getattr(group.config, name) for name in spec.config_fields if hasattr(group.config, name)}
    return place(spec, routed.param, routed.roles.names, {**fields, "muon_flatten_conv": True}, True, routed.roles.view) != "cannot"


def _large_matrices_on_elementwise(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    matrix_optimizers = _matrix_optimizers(groups)
    if not matrix_optimizers:
        return []
    target = matrix_optimizers[0]
    found: list[Finding] = []
    for group in groups:
        if not get_spec(group.optimizer).elementwise:
            continue
        for routed, names in zip(group.params, group.all_names):
            param = routed.param
            if param.dim() < 2 or param.numel() < LARGE_PARAM_ELEMENTS or not SCALAR_ROLES.isdisjoint(routed.roles.names):
                continue
            setters = [k for k in routed.matched if "optimizer" in routing.overrides[k]]
            conv_off = "conv" in routed.roles.names and not group.config.muon_flatten_conv
            if not (setters or conv_off) or not _takes(target, routed, group):
                continue  # routed there by the base config, or by a placement the record decides
            if conv_off and not setters:
                fix = _moved(group, routing, [routed], ("muon_flatten_conv",), {"muon_flatten_conv": True})
            else:
                fix = _moved(group, routing, [routed], ("optimizer",), {"optimizer": target})
            found.append(Finding(
                "large-matrix-on-elementwise", names,
                f"{_names(names)} ({'x'.join(map(str, param.shape))}, {routed.roles.describe()}): a large matrix on an "
                f"element-wise optimizer while {' and '.join(matrix_optimizers)} steps the other matrices; got "
                f"{group.optimizer} (param group #{group.index}{', ' + group.auto_routed if group.auto_routed else ''}); "
                f"expected {target}: {fix.describe(routing)}",
                fix,
            ))  # fmt: skip
    return found


def _decayed_vectors(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    found: list[Finding] = []
    for group in groups:
        if group.weight_decay <= 0:
            continue
        members = [r for r in group.params if {"bias", "norm", "elementwise"} & r.roles.names or r.param.dim() <= 1]
        if not members:
            continue
        names = [n for routed in members for n in group.all_names[group.params.index(routed)]]
        rules = sorted({k for routed in group.params for k in routed.matched})
        fix = _moved(group, routing, members, _DECAY_FIELDS, {"wd_mult": 0.0})
        found.append(Finding(
            "decayed-vector", tuple(names),
            f"{_names(names)}: biases, norms, elementwise or 1-D params with weight decay; got weight_decay="
            f"{group.weight_decay:g} in param group #{group.index} (rules: {', '.join(f'#{k}' for k in rules) or 'none'}; "
            f"{standard_overrides_note(groups, routing)}); expected no decay on them: {fix.describe(routing)}",
            fix,
        ))  # fmt: skip
    return found


def standard_overrides_note(groups: Sequence[ResolvedGroup], routing: Routing) -> str:
    """Which standard overrides apply to ``routing``, in words (the decay findings say it)."""
    if routing.defaults:
        return "the standard overrides lie under your rules, which win field by field (standard_overrides=True)"
    config = groups[0].config if groups else None
    if config is not None and set(get_standard_config_overrides(config)) <= set(routing.keys):
        return "the standard overrides apply"
    return (
        "the standard overrides are off: config_overrides is used alone (standard_overrides=False, Megatron-Core's "
        "meaning); standard_overrides=True lays them under your rules"
    )


def _blocks_orthogonalised_whole(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    viewing = [name for name in registered_names() if get_spec(name).matrix_views]
    found: list[Finding] = []
    for group in groups:
        spec = get_spec(group.optimizer)
        if spec.elementwise or spec.matrix_views:
            continue
        for routed, names in zip(group.params, group.all_names):
            view: MatrixView | None = routed.roles.view
            if view is None or view.count < 2:
                continue
            target = next((name for name in viewing if _takes(name, routed, group)), None)
            if target is None:
                continue
            fix = _moved(group, routing, [routed], ("optimizer",), {"optimizer": target})
            found.append(Finding(
                "blocks-orthogonalised-whole", names,
                f"{_names(names)} ({'x'.join(map(str, routed.param.shape))}): the forward multiplies by it as "
                f"{view.describe()}; got {group.optimizer} (param group #{group.index}), which steps its stored shape as "
                f"one matrix; expected each block stepped on its own, as {target} does: {fix.describe(routing)}",
                fix,
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
                fix = Fix(extend=((index, tuple(local)),))
                found.append(Finding(
                    "tied-names-disagree", names,
                    f"{_names(names)}: one tied tensor; {_rule(routing, index)} selects {_names(selected)} but not "
                    f"{_names([n for n in names if n not in selected])}, so {outcome}; got different answers for one "
                    f"tensor; expected a rule that selects all its names or none: {fix.describe(routing)}",
                    fix,
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
        if not fields or k in routing.defaults:  # a default under the user's rules is meant to be overridden
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
                Fix(remove=(k,)),
            ))  # fmt: skip
    return found


def _field_readers() -> dict[str, list[str]]:
    """Each algorithm's field -> the registered algorithms that read it (their records say so)."""
    readers: dict[str, list[str]] = {}
    for name in registered_names():
        spec = get_spec(name)
        for field in (*spec.config_fields, *spec.instance_fields, *((spec.fallback_field,) if spec.fallback_field else ())):
            readers.setdefault(field, []).append(name)
    return readers


def _unread_fields(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    readers = _field_readers()
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig) if f.default is not dataclasses.MISSING}
    found: list[Finding] = []
    for field, algorithms in readers.items():
        if field not in defaults:
            continue
        # who set it: each rule that sets it, else the config (params no such rule reaches)
        by_source: dict[int | None, list[tuple[ResolvedGroup, RoutedParam]]] = {}
        for group in groups:
            if getattr(group.config, field) == defaults[field]:
                continue
            for routed in group.params:
                setters = [k for k in routed.matched if field in routing.overrides[k] and k not in routing.defaults]
                by_source.setdefault(setters[-1] if setters else None, []).append((group, routed))
        for source, members in by_source.items():
            stepping = list(dict.fromkeys(group.optimizer for group, _ in members))
            if any(name in algorithms for name in stepping):
                continue
            value = getattr(members[0][0].config, field)
            names = [n for group, routed in members for n in group.all_names[group.params.index(routed)]]
            read_here = [f for name in stepping for f in (*get_spec(name).config_fields, *get_spec(name).instance_fields)]
            hint = did_you_mean(field, read_here).removeprefix("; ")
            who = _rule(routing, source) if source is not None else "the config"
            found.append(Finding(
                "unread-field", tuple(names),
                f"`{field}`={value!r}, set by {who}, is read by no optimizer that steps the params it reaches; got "
                f"{', '.join(stepping)} on {_names(names)}, which ignore it; expected it removed, or `optimizer` set to "
                f"one that reads it ({', '.join(algorithms)}){'; ' + hint if hint else ''}",
                Fix(remove=(source,)) if source is not None and set(routing.overrides[source]) == {field} else None,
            ))  # fmt: skip
    return found


def lint_routing(groups: Sequence[ResolvedGroup], routing: Routing) -> list[Finding]:
    """Every finding on a resolved routing, in the order of the kinds above.

    Example:
        >>> import torch
        >>> from optzoo import OptimizerConfig, resolve_group_configs
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> alone = OptimizerConfig(lr=1e-3, weight_decay=0.1, standard_overrides=False)  # {} means no rules
        >>> groups, routing = resolve_group_configs(alone, model, {})
        >>> [(f.kind, f.params) for f in lint_routing(groups, routing)]
        [('decayed-vector', ('0.bias', '1.weight', '1.bias'))]
        >>> fixed = apply_fixes(routing, [f.fix for f in lint_routing(groups, routing) if f.fix])
        >>> lint_routing(*resolve_group_configs(alone, model, fixed))
        []
        >>> lint_routing(*resolve_group_configs(alone.replace(standard_overrides=True), model, {}))  # laid under {}
        []
    """
    return [
        *_embeddings_on_matrix_optimizers(groups, routing),
        *_large_matrices_on_elementwise(groups, routing),
        *_decayed_vectors(groups, routing),
        *_blocks_orthogonalised_whole(groups, routing),
        *_tied_names_disagree(groups, routing),
        *_shadowed_rules(routing),
        *_unread_fields(groups, routing),
    ]


def apply_fixes(routing: Routing, fixes: Sequence[Fix]) -> dict[ParamKey, dict[str, Any]]:
    """``config_overrides`` with ``fixes`` applied to the rules ``routing`` was resolved from.

    The result is explicit: pass it as ``config_overrides`` (with ``None``, the standard
    overrides, ``routing`` holds them as its rules and so does the result).
    """
    keys = list(routing.keys)
    excluded: dict[int, list[str]] = {}
    extended: dict[int, list[str]] = {}
    removed: set[int] = set()
    added: dict[ParamKey, dict[str, Any]] = {}
    for fix in fixes:
        for index, names in fix.narrow:
            excluded.setdefault(index, []).extend(names)
        for index, names in fix.extend:
            extended.setdefault(index, []).extend(names)
        removed.update(fix.remove)
        for key, value in fix.add:
            added.setdefault(key, {}).update(value)
    result: dict[ParamKey, dict[str, Any]] = {}
    for index, (key, override) in enumerate(zip(keys, routing.overrides)):
        if index in removed or index in routing.defaults:  # defaults come back under any dict
            continue
        if index in excluded:
            key = _with_excluded(key, excluded[index])
        if index in extended:
            key = _with_names(key, extended[index])
        result[key] = {**result.get(key, {}), **dict(override)}
    for key, value in added.items():
        result[key] = {**result.get(key, {}), **value}
    return result


def _globs(key: ParamKey | None) -> tuple[str, ...]:
    if key is None:
        return ()
    return (key.name,) if isinstance(key.name, str) else tuple(key.name)


def _with_excluded(key: ParamKey, names: Sequence[str]) -> ParamKey:
    extra = tuple(glob.escape(name) for name in dict.fromkeys(names))
    exclude = key.exclude
    if exclude is None:
        return dataclasses.replace(key, exclude=ParamKey(name=extra))
    return dataclasses.replace(key, exclude=dataclasses.replace(exclude, name=tuple(dict.fromkeys(_globs(exclude) + extra))))


def _with_names(key: ParamKey, names: Sequence[str]) -> ParamKey:
    """``key`` selecting all of ``names`` (one tensor's): included under each, or excluded under each."""
    escaped = tuple(glob.escape(name) for name in dict.fromkeys(names))
    if key.exclude is not None and any(_selects_by_name(key.exclude, name) for name in names):
        return _with_excluded(key, names)  # left out under one name: left out under all
    return dataclasses.replace(key, name=tuple(dict.fromkeys(_globs(key) + escaped)))


def _selects_by_name(key: ParamKey, name: str) -> bool:
    """Whether ``key``'s name globs select ``name`` (other fields aside)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in _globs(key))


def warn_findings(findings: Sequence[Finding], *, stacklevel: int = 2) -> None:
    """One :class:`RoutingLintWarning` per finding, ``lint: <kind>: <message>``."""
    for finding in findings:
        warnings.warn(f"lint: {finding.kind}: {finding.message}", RoutingLintWarning, stacklevel=stacklevel + 1)


def findings_as_json(findings: Sequence[Finding]) -> list[Mapping[str, Any]]:
    """The findings as plain dicts (``kind``, ``params``, ``message``), for ``--format json``."""
    return [{"kind": f.kind, "params": list(f.params), "message": f.message} for f in findings]
