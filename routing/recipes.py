"""Routing recipes: ``{ParamKey: override}`` as plain data (lists, strings, tables) and back.

One ``[[overrides]]`` entry (TOML, YAML or a dict) is one key with its override:

- include fields ``name`` (globs), ``attr`` (attributes) and ``predicate`` (registered
  predicate names, either kind): the entry selects a parameter when any of them matches;
- exclude fields ``exclude_name``, ``exclude_attr`` and ``exclude_predicate``: ... unless any of
  these matches it (they become the key's ``exclude`` key);
- ``with_name_predicate`` / ``exclude_with_name_predicate``: like ``predicate``, for
  :class:`ParamWithNamePredicate` only; :func:`key_to_entry` writes them to keep the round trip exact;
- ``set``: the override, a non-empty table of field -> value (not interpreted here).

Each field takes a string or a list of strings. A string becomes a single value and a list a
tuple, as in ``ParamKey(name="*.bias")`` and ``ParamKey(name=("*.bias",))``, so that
``key_from_entry(key_to_entry(key)) == key`` for every key whose predicates are registered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._common import did_you_mean
from .keys import INCLUDE_FIELDS, ParamKey, ParamWithNamePredicate
from .predicates import (
    Predicate,
    is_registered,
    predicate_spec,
    registered_predicates,
)

__all__ = [
    "ENTRY_FIELDS",
    "Entry",
    "KEY_FIELDS",
    "key_from_entry",
    "key_to_entry",
    "overrides_from_entries",
    "overrides_to_entries",
]

KEY_FIELDS: tuple[str, ...] = INCLUDE_FIELDS + tuple(f"exclude_{field}" for field in INCLUDE_FIELDS)
"""The fields of an entry that make its ``ParamKey``, in the order they are written."""
ENTRY_FIELDS: tuple[str, ...] = KEY_FIELDS + ("set",)
"""Every field an ``[[overrides]]`` entry may have."""

_EXAMPLES = {"name": "'*.bias'", "attr": "'is_embedding_or_output_parameter'", "role": "'expert'"}

Entry = dict[str, Any]
"""One ``[[overrides]]`` entry: key fields (str or list of str) and ``set``."""


# ---- ParamKey -> entry --------------------------------------------------------------------


def _predicate_name(key: ParamKey, predicate: Predicate) -> str:
    if is_registered(predicate):
        return predicate.name
    try:
        registered = predicate_spec(predicate.name).predicate
    except ValueError:
        problem, fix = "predicate is not registered", f"register_predicate({predicate.name!r}, fn) first"
    else:
        problem = "predicate is not the registered one (same name, another function or kind)"
        fix = f"the registered {type(registered).__name__}, get_predicate({predicate.name!r})"
    raise ValueError(
        f"`{key.describe()}`: {problem}, so a recipe cannot refer to it by name; got "
        f"{type(predicate).__name__}(name={predicate.name!r}); expected {fix}"
    )


def _key_fields(key: ParamKey, prefix: str, owner: ParamKey) -> Entry:
    """The include fields of ``key`` (``owner`` itself, or its exclude key) with ``prefix``."""
    entry: Entry = {}
    for field in INCLUDE_FIELDS:
        value = getattr(key, field)
        if isinstance(value, tuple):
            if value:
                entry[prefix + field] = [v if isinstance(v, str) else _predicate_name(owner, v) for v in value]
        else:
            entry[prefix + field] = value if isinstance(value, str) else _predicate_name(owner, value)
    return entry


def key_to_entry(key: ParamKey) -> Entry:
    """The key fields of ``key`` as an entry: a string per single value, a list per tuple.

    Raises:
        ValueError: A predicate of ``key`` is not registered (a recipe names predicates), or
            ``key`` has no include field (it matches nothing; a recipe entry needs one).

    Example:
        >>> from optzoo.routing.predicates import get_predicate
        >>> key_to_entry(ParamKey(name="*.weight", exclude=ParamKey(with_name_predicate=(get_predicate("is_norm"),))))
        {'name': '*.weight', 'exclude_with_name_predicate': ['is_norm']}
    """
    if not isinstance(key, ParamKey):
        raise TypeError(f"`config_overrides`: keys must be ParamKey; got {key!r}; expected ParamKey(...)")
    entry = _key_fields(key, "", key)
    if not entry:
        raise ValueError(
            f"`ParamKey`: selects no parameter (no include field), so a recipe cannot hold it; got "
            f"{key.describe()}; expected at least one of name, attr, predicate, with_name_predicate, role"
        )
    if key.exclude is not None:
        entry.update(_key_fields(key.exclude, "exclude_", key))
    return entry


def overrides_to_entries(config_overrides: Mapping[ParamKey, Mapping[str, Any]]) -> list[Entry]:
    """``{ParamKey: override}`` as ``[{key fields..., "set": override}]``, in order."""
    entries = []
    for index, (key, override) in enumerate(config_overrides.items()):
        if not isinstance(override, Mapping):
            raise TypeError(
                f"`config_overrides` rule #{index}: override must be a mapping; got {type(override).__name__}; "
                "expected a dict such as {'wd_mult': 0.0}"
            )
        entries.append({**key_to_entry(key), "set": dict(override)})
    return entries


# ---- entry -> ParamKey --------------------------------------------------------------------


def _strings(where: str, field: str, value: Any) -> tuple[list[str], bool]:
    """``(items, was_a_single_string)``; anything but a string or a list of strings is an error."""
    if isinstance(value, str):
        return [value], True
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value), False
    example = _EXAMPLES.get(field.removeprefix("exclude_"), "'is_1d'")
    raise ValueError(
        f"`{where}.{field}`: must be a string or a list of strings; got {value!r}; expected e.g. {example}"
    )


def _single_or_tuple[T](items: list[T], single: bool) -> T | tuple[T, ...]:
    return items[0] if single and len(items) == 1 else tuple(items)


def _key_from_fields(entry: Mapping[str, Any], where: str, prefix: str) -> dict[str, Any]:
    """ParamKey keyword arguments from the (prefixed) include fields of ``entry``."""
    kwargs: dict[str, Any] = {}
    for field in ("name", "attr", "role"):
        if prefix + field in entry:
            items, single = _strings(where, prefix + field, entry[prefix + field])
            kwargs[field] = _single_or_tuple(items, single)
    # `predicate` takes either kind and sends each name to the field of its kind;
    # `with_name_predicate` takes name predicates only.
    found: dict[str, list[tuple[list[Predicate], bool]]] = {"predicate": [], "with_name_predicate": []}
    for field in ("predicate", "with_name_predicate"):
        if prefix + field not in entry:
            continue
        names, single = _strings(where, prefix + field, entry[prefix + field])
        by_kind: dict[str, list[Predicate]] = {"predicate": [], "with_name_predicate": []}
        for name in names:
            try:
                predicate = predicate_spec(name).predicate
            except ValueError:
                raise ValueError(
                    f"`{where}.{prefix + field}`: unknown predicate; got {name!r}; expected one of "
                    f"{registered_predicates()} (register_predicate(name, fn) adds one){did_you_mean(name, registered_predicates())}"
                ) from None
            kind = "with_name_predicate" if isinstance(predicate, ParamWithNamePredicate) else "predicate"
            if field == "with_name_predicate" and kind == "predicate":
                raise ValueError(
                    f"`{where}.{prefix + field}`: {name!r} is a ParamPredicate (it tests the parameter only); "
                    f"got {name!r}; expected it under `{prefix}predicate`"
                )
            by_kind[kind].append(predicate)
        for kind, predicates in by_kind.items():
            if predicates:
                found[kind].append((predicates, single))
    for kind, sources in found.items():
        if len(sources) == 1:
            kwargs[kind] = _single_or_tuple(*sources[0])
        elif sources:
            kwargs[kind] = tuple(p for predicates, _ in sources for p in predicates)
    return {k: v for k, v in kwargs.items() if v != ()}


def key_from_entry(entry: Mapping[str, Any], where: str = "overrides[0]") -> ParamKey:
    """The ``ParamKey`` an entry describes (its ``set`` is ignored here).

    Args:
        entry: The entry; its keys must be among :data:`ENTRY_FIELDS`.
        where: How errors name the entry, e.g. ``overrides[3]``.

    Raises:
        ValueError: An unknown field, a value that is not a string or a list of strings, an
            unknown predicate name (the message lists the registered ones), or no include field.

    Example:
        >>> key_from_entry({"predicate": "is_2d_matrix", "exclude_predicate": ["is_embedding_or_output"]}).describe()
        "predicate='is_2d_matrix', exclude=(with_name_predicate='is_embedding_or_output')"
    """
    if not isinstance(entry, Mapping):
        raise ValueError(f"`{where}`: must be a table; got {entry!r}; expected keys {list(ENTRY_FIELDS)}")
    for field in entry:
        if field not in ENTRY_FIELDS:
            raise ValueError(f"`{where}.{field}`: unknown key; got {field!r}; expected one of {list(ENTRY_FIELDS)}{did_you_mean(field, ENTRY_FIELDS)}")
    include = _key_from_fields(entry, where, "")
    exclude = _key_from_fields(entry, where, "exclude_")
    if not include:
        raise ValueError(
            f"`{where}`: selects no parameter; got {sorted(k for k in entry if k != 'set') or 'no key field'}; "
            "expected at least one of name, attr, predicate, role (the exclude_* fields only take parameters out)"
        )
    return ParamKey(**include, exclude=ParamKey(**exclude) if exclude else None)


def overrides_from_entries(entries: Any, where: str = "overrides") -> dict[ParamKey, dict[str, Any]]:
    """``[{key fields..., "set": {...}}]`` as ``{ParamKey: override}``, in order.

    Raises:
        ValueError: Not a list of tables, a bad entry (:func:`key_from_entry`), a missing or
            empty ``set``, or the same key twice.

    Example:
        >>> overrides = overrides_from_entries([{"name": "*.bias", "predicate": "is_1d", "set": {"wd_mult": 0.0}}])
        >>> [(key.describe(), value) for key, value in overrides.items()]
        [("name='*.bias', predicate='is_1d'", {'wd_mult': 0.0})]
    """
    if not isinstance(entries, list):
        raise ValueError(f"`{where}`: must be a list of tables; got {entries!r}; expected [[{where}]] tables")
    overrides: dict[ParamKey, dict[str, Any]] = {}
    for index, entry in enumerate(entries):
        at = f"{where}[{index}]"
        key = key_from_entry(entry, at)
        values = entry.get("set")
        if not isinstance(values, Mapping) or not values:
            raise ValueError(
                f"`{at}.set`: must be a non-empty table of fields; got {values!r}; expected e.g. {{ wd_mult = 0.0 }}"
            )
        if key in overrides:
            raise ValueError(f"`{at}`: duplicate rule; got {key.describe()} twice; expected each rule once")
        overrides[key] = dict(values)
    return overrides
