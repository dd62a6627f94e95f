"""Resolve ``{ParamKey: override}`` over model chunks into parameter groups with provenance."""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from .._common import shorten
from .keys import ParamKey
from .inputs import ExampleInputs
from .roles import ParamRoles, infer_roles

__all__ = [
    "Override",
    "ParamGroupSpec",
    "RoutedParam",
    "Routing",
    "RoutingConflictError",
    "named_trainable_parameters",
    "resolve_param_groups",
]

Override = Mapping[str, Any]
"""What a key sets: field name -> value. routing/ never interprets the fields."""


class RoutingConflictError(ValueError):
    """Two keys that match one parameter set the same field to different values."""


@dataclass(frozen=True)
class RoutedParam:
    """One trainable tensor and how routing saw it."""

    param: torch.nn.Parameter = field(compare=False)
    """The tensor itself (compared by the fields below, never by value)."""
    names: tuple[str, ...]
    """Every chunk-local dotted name the tensor has (several when tied); the first is its id."""
    chunks: tuple[int, ...]
    """The model chunk of each name, parallel to ``names``."""
    matched: tuple[int, ...]
    """Indices (into the ``config_overrides`` order) of the keys that matched it."""
    roles: ParamRoles = field(default=ParamRoles(("matrix",), ("default",)))
    """What the tensor is, read from the model (:func:`optzoo.routing.roles.infer_roles`)."""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def chunk(self) -> int:
        """The chunk the tensor was first found in."""
        return self.chunks[0]


@dataclass(frozen=True)
class ParamGroupSpec:
    """Parameters that ended up with identical merged overrides."""

    override: Mapping[str, Any]
    """The merged override (read-only); empty for the no-override group."""
    params: tuple[RoutedParam, ...]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]


@dataclass(frozen=True)
class Routing:
    """The result of :func:`resolve_param_groups`."""

    groups: tuple[ParamGroupSpec, ...]
    keys: tuple[ParamKey, ...]
    """The keys in the order they were given; ``RoutedParam.matched`` indexes this."""
    unmatched: tuple[int, ...]
    """Indices of keys that matched no parameter (defaults left out: they need not apply)."""
    overrides: tuple[Override, ...] = ()
    """What each key sets, parallel to ``keys``."""
    defaults: tuple[int, ...] = ()
    """Indices of the keys given as ``defaults`` (layered under the others: a field another key
    sets for a parameter wins over theirs); they come after the others in ``keys``."""

    def explain(self) -> list[tuple[str, int, list[str]]]:
        """One ``(name, group index, [matched key descriptions])`` per name, in group order."""
        rows: list[tuple[str, int, list[str]]] = []
        for index, group in enumerate(self.groups):
            for routed in group.params:
                described = [f"#{k} {self.keys[k].describe()}" for k in routed.matched]
                rows.extend((name, index, described) for name in routed.names)
        return rows


def _same_value(a: Any, b: Any) -> bool:
    """Whether two rules agree: numbers by value (``0`` and ``0.0`` agree; a bool is not a
    number here), everything else as :func:`_freeze` sees it."""
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b or (a != a and b != b)  # NaN agrees with NaN
    return _freeze(a) == _freeze(b)


def _freeze(value: Any) -> Hashable:
    """A hashable stand-in for an override value, so equal overrides land in one group.

    Tagged with the type, so ``True``/``1``/``1.0`` and lists/tuples stay distinct (a group
    shows exactly what its rule said), and NaN equals NaN.
    """
    if isinstance(value, Mapping):
        return ("mapping", tuple(sorted((k, _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    if isinstance(value, (bool, int, float, complex)):
        return (type(value).__name__, value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.flatten().tolist()))
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return value  # type: ignore[no-any-return]


def named_trainable_parameters(
    model_chunks: Sequence[torch.nn.Module],
) -> list[tuple[torch.nn.Parameter, tuple[str, ...], tuple[int, ...]]]:
    """Every trainable tensor once, with all its names and their chunks, in model order.

    Names are local to their chunk (as in Megatron-Core); a tensor shared between names or
    chunks is listed once, at its first appearance, with every ``(name, chunk)`` it has.
    """
    found: dict[int, tuple[torch.nn.Parameter, list[tuple[str, int]]]] = {}
    for chunk_index, chunk in enumerate(model_chunks):
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(
                f"`model_chunks[{chunk_index}]`: must be a torch.nn.Module; "
                f"got {type(chunk).__name__}; expected a module or a list of modules"
            )
        for name, param in chunk.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                continue
            entry = found.setdefault(id(param), (param, []))
            if (name, chunk_index) not in entry[1]:
                entry[1].append((name, chunk_index))
    return [
        (param, tuple(n for n, _ in places), tuple(c for _, c in places))
        for param, places in found.values()
    ]


def _merge(
    name: str,
    matched: tuple[int, ...],
    items: Sequence[tuple[ParamKey, Override]],
    keys: Sequence[ParamKey],
    first_default: int | None = None,
    linked: Sequence[frozenset[str]] = (),
) -> dict[str, Any]:
    """Merge the overrides of the ``matched`` keys for parameter ``name``; refuse conflicts.

    Keys from ``first_default`` on are defaults: merged among themselves the same way, then under
    the others, which win field by field; a field of a ``linked`` set that the others set hides
    the defaults' whole set."""
    if first_default is not None:
        own = _merge(name, tuple(k for k in matched if k < first_default), items, keys)
        defaults = _merge(name, tuple(k for k in matched if k >= first_default), items, keys)
        hidden = set(own).union(*(fields for fields in linked if fields & own.keys()))
        return {**own, **{field: value for field, value in defaults.items() if field not in hidden}}
    merged: dict[str, Any] = {}
    setter: dict[str, int] = {}
    for index in matched:
        for field_name, value in items[index][1].items():
            if field_name in merged and not _same_value(merged[field_name], value):
                first = setter[field_name]
                raise RoutingConflictError(
                    f"`{name}`: conflicting values for field `{field_name}` from rule "
                    f"#{first} {keys[first].describe()} ({field_name}={merged[field_name]!r}) "
                    f"and rule #{index} {keys[index].describe()} ({field_name}={value!r}); "
                    "expected matching rules to agree: narrow one rule or make the values equal"
                )
            merged[field_name] = value
            setter.setdefault(field_name, index)
    return merged


def resolve_param_groups(
    model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    config_overrides: Mapping[ParamKey, Override] | None,
    *,
    strict: bool = False,
    warn_unmatched: bool = True,
    roles: Mapping[int, ParamRoles] | None = None,
    example_inputs: ExampleInputs | Sequence[ExampleInputs | None] | None = None,
    trace: bool = True,
    defaults: Mapping[ParamKey, Override] | None = None,
    linked_fields: Sequence[Collection[str]] = (),
) -> Routing:
    """Match every trainable parameter against every key and group identical merged overrides.

    Args:
        model_chunks: A module or a list of modules (Megatron's virtual-pipeline chunks).
        config_overrides: ``{ParamKey: override}``; an override maps field names to values.
            ``None`` and ``{}`` both mean "no overrides" here (the caller decides defaults).
        strict: Raise instead of warning when a key matches no parameter.
        warn_unmatched: Warn about keys that match nothing (off for built-in defaults, which
            need not apply to every model); ``strict`` still raises.
        roles: Every parameter's roles by ``id(param)``; default :func:`~optzoo.routing.roles.infer_roles`
            of ``model_chunks`` (with ``example_inputs`` and ``trace``). ``ParamKey(role=...)``
            matches against them.
        example_inputs: Inputs of one forward, to read roles from what it does with each
            parameter (see :func:`~optzoo.routing.roles.infer_roles`); default: made from the model.
        trace: Observe the forward for roles (default); ``False`` guesses them from module types and names.
        defaults: Keys layered under ``config_overrides`` (the caller's defaults, such as the
            standard overrides): where a key of ``config_overrides`` and a default both set a
            field for a parameter, the former's value stands, with no conflict. Defaults come after
            ``config_overrides`` in :attr:`Routing.keys`, and never warn when they match nothing.
        linked_fields: Sets of fields that say one thing together (an lr and its schedule's
            peak, a decay and its multiplier): a key of ``config_overrides`` that sets one field
            of a set hides every field of that set from the defaults, for the parameters it matches.

    Returns:
        A :class:`Routing`: the groups in the documented order, plus provenance.

    Raises:
        RoutingConflictError: Two keys matching one parameter set one field differently.
        ValueError: ``strict`` and a key matched nothing.
        TypeError: A key is not a :class:`ParamKey` or an override is not a mapping.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> routing = resolve_param_groups(model, {ParamKey(name="bias"): {"wd_mult": 0.0}})
        >>> [(dict(g.override), g.names) for g in routing.groups]
        [({}, ['weight']), ({'wd_mult': 0.0}, ['bias'])]
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    items = list((config_overrides or {}).items())
    first_default = len(items) if defaults else None
    linked = [frozenset(fields) for fields in linked_fields]
    items += list((defaults or {}).items())
    for index, (key, override) in enumerate(items):
        if not isinstance(key, ParamKey):
            raise TypeError(
                f"`config_overrides` key #{index}: must be a ParamKey; got {key!r}; "
                "expected ParamKey(name=..., attr=..., predicate=..., with_name_predicate=...)"
            )
        if not isinstance(override, Mapping):
            raise TypeError(
                f"`config_overrides[{key.describe()}]`: must be a mapping of field -> value; "
                f"got {type(override).__name__}; expected a dict such as {{'wd_mult': 0.0}}"
            )
    keys = tuple(key for key, _ in items)

    hits = [0] * len(items)
    group_index: dict[Hashable, int] = {}
    group_members: list[tuple[dict[str, Any], list[RoutedParam]]] = []
    # The merge depends only on which keys matched, so each match set is merged once.
    group_of_match: dict[tuple[int, ...], int] = {}
    indexed_keys = list(enumerate(keys))
    trainable = named_trainable_parameters(chunks)  # checks the chunks first
    roles = infer_roles(chunks, example_inputs=example_inputs, trace=trace) if roles is None else roles
    for param, names, name_chunks in trainable:
        param_roles = roles[id(param)]
        # A tied tensor is one parameter: included under any name, excluded under any name.
        matched = tuple(index for index, key in indexed_keys if key.matches_any(param, names, param_roles.names))
        for index in matched:
            hits[index] += 1
        if matched not in group_of_match:
            merged = _merge(names[0], matched, items, keys, first_default, linked)
            identity = _freeze(merged)
            if identity not in group_index:
                group_index[identity] = len(group_members)
                group_members.append((merged, []))
            group_of_match[matched] = group_index[identity]
        group_members[group_of_match[matched]][1].append(RoutedParam(param, names, name_chunks, matched, param_roles))

    # Documented order: the no-override group first, then by first appearance in the model.
    ordered = sorted(group_members, key=lambda member: bool(member[0]))
    groups = tuple(
        ParamGroupSpec(MappingProxyType(dict(override)), tuple(members))
        for override, members in ordered
    )

    unmatched = tuple(index for index, count in enumerate(hits) if count == 0)
    own_unmatched = tuple(index for index in unmatched if first_default is None or index < first_default)
    if own_unmatched and (strict or warn_unmatched):
        several = len(chunks) > 1
        all_names = [
            f"chunk{chunk}.{name}" if several else name
            for g in groups
            for p in g.params
            for name, chunk in zip(p.names, p.chunks)
        ]
        message = (
            "config_overrides: "
            + "; ".join(f"rule #{i} {keys[i].describe()} matched no parameter" for i in own_unmatched)
            + f"; parameters are: {shorten(all_names)}"
        )
        if strict:
            raise ValueError(message + "; expected every rule to match (strict=True)")
        warnings.warn(message, UserWarning, stacklevel=2)
    overrides = tuple(MappingProxyType(dict(override)) for _, override in items)
    default_indices = tuple(range(first_default, len(items))) if first_default is not None else ()
    return Routing(groups=groups, keys=keys, unmatched=own_unmatched, overrides=overrides, defaults=default_indices)

