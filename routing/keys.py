"""Parameter keys: which parameters an override applies to.

Compatible with Megatron-Core's ``core.optimizer.optimizer_config`` ``ParamKey``,
``ParamPredicate`` and ``ParamWithNamePredicate``.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._common import ROLES
from .roles import param_roles

__all__ = [
    "INCLUDE_FIELDS",
    "ParamKey",
    "ParamPredicate",
    "ParamWithNamePredicate",
]


def _same_function(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether two predicate functions are the same rule: one object, or one ``def``/``lambda``
    (same code) with equal defaults and captured values (a recipe built twice)."""
    if a is b:
        return True
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_a is not code_b:
        return False
    try:
        cells_a = tuple(cell.cell_contents for cell in (getattr(a, "__closure__", None) or ()))
        cells_b = tuple(cell.cell_contents for cell in (getattr(b, "__closure__", None) or ()))
        return bool(cells_a == cells_b and getattr(a, "__defaults__", None) == getattr(b, "__defaults__", None))
    except Exception:  # an empty cell or a capture whose == does not give a bool: not provably the same
        return False


class _EqualByName:
    """Equality and hashing by ``name`` (as Megatron-Core's predicates), with a warning when two
    predicates of one name hold different functions: they would collapse into one rule (in a
    ``config_overrides`` dict the later override replaces the earlier) without a word."""

    name: str
    fn: Callable[..., Any]

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _EqualByName)
        if self.name != other.name:
            return False
        if not _same_function(self.fn, other.fn):
            warnings.warn(
                f"two {type(self).__name__}s named {self.name!r} test with different functions; "
                "predicates are equal by name, so they are one rule (in a config_overrides dict the "
                "later override replaces the earlier): give them different names",
                UserWarning,
                stacklevel=3,
            )
        return True

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.name))


@dataclass(frozen=True, eq=False)
class ParamPredicate(_EqualByName):
    """A named test on a parameter, hashable so it can live inside a :class:`ParamKey`.

    Equality and hashing use ``name`` only: two predicates with the same name are the same rule,
    and comparing two of one name whose functions differ warns (``UserWarning``).

    Example:
        >>> is_1d = ParamPredicate(name="is_1d", fn=lambda p: p.ndim == 1)
        >>> is_1d(torch.empty(3))
        True
        >>> is_1d == ParamPredicate(name="is_1d", fn=is_1d.fn)
        True
    """

    name: str
    """Identity of the rule (shown in explanations and errors)."""
    fn: Callable[[torch.Tensor], bool] = field(compare=False, hash=False, repr=False)
    """The test; receives the parameter."""

    def __call__(self, param: torch.Tensor) -> bool:
        return bool(self.fn(param))


@dataclass(frozen=True, eq=False)
class ParamWithNamePredicate(_EqualByName):
    """A named test on a parameter and its full dotted name; equal and hashed by ``name`` only.

    Example:
        >>> not_qk_norm = ParamWithNamePredicate(
        ...     name="1d_not_qk_norm",
        ...     fn=lambda p, n: p.ndim == 1 and "q_layernorm." not in n,
        ... )
        >>> not_qk_norm(torch.empty(3), "layers.0.q_layernorm.weight")
        False
    """

    name: str
    """Identity of the rule (shown in explanations and errors)."""
    fn: Callable[[torch.Tensor, str], bool] = field(compare=False, hash=False, repr=False)
    """The test; receives the parameter and its full dotted name."""

    def __call__(self, param: torch.Tensor, name: str) -> bool:
        return bool(self.fn(param, name))


def _ask(predicate: ParamPredicate | ParamWithNamePredicate, param_name: str, *args: Any) -> bool:
    """A predicate's answer for one param, or a ``ValueError`` naming the rule and the param
    (a predicate that raises, has the wrong arity, or answers with something not a bool)."""
    try:
        answer = predicate.fn(*args)
    except Exception as error:  # user code: whatever it raised, name the rule and the param
        raise ValueError(
            f"predicate {predicate.name!r} ({type(predicate).__name__}): failed on `{param_name}`; "
            f"got {type(error).__name__}: {error}; expected True or False for every parameter"
        ) from error
    if isinstance(answer, torch.Tensor):  # ambiguous for several elements, and unreadable on meta
        raise ValueError(
            f"predicate {predicate.name!r} ({type(predicate).__name__}): answered a Tensor on `{param_name}`; "
            f"got a tensor of shape {tuple(answer.shape)}; expected a bool (test shapes or attributes, "
            "not values: routing also runs on the meta device)"
        )
    return bool(answer)  # truthiness, as Megatron-Core's `if predicate.fn(param)`


def _as_tuple[T](value: T | tuple[T, ...]) -> tuple[T, ...]:
    return value if isinstance(value, tuple) else (value,)


@dataclass(frozen=True)
class ParamKey:
    """Selects parameters by name glob, attribute, or predicate; any single hit is a match.

    Each field takes one value or a tuple. A parameter matches when ANY entry of ANY field
    matches (OR everywhere), as in Megatron-Core; ``ParamKey()`` matches nothing.

    ``role`` (an optzoo extension, default ``()``) matches parameters by what they are
    (:mod:`optzoo.routing.roles`): ``ParamKey(role="expert")``. Inside ``resolve_param_groups`` the
    roles come from the model; asked about a lone parameter, a key reads its tags, name and shape.

    ``exclude`` (an optzoo extension, default ``None``: Megatron-Core's behaviour) is a second
    key whose matches are taken out: a parameter matches when it matches ANY include field and
    the ``exclude`` key does not match it. A tensor with several names (tied) is included when
    any of its names is, and excluded when any of its names is (:meth:`matches_any`).

    Example:
        >>> key = ParamKey(name="*.bias", attr="is_embedding_or_output_parameter")
        >>> key.matches(torch.nn.Parameter(torch.empty(3)), "decoder.layers.0.mlp.linear_fc1.bias")
        True
        >>> key.matches(torch.nn.Parameter(torch.empty(3, 3)), "decoder.layers.0.mlp.linear_fc1.weight")
        False
        >>> key.describe()
        "name='*.bias', attr='is_embedding_or_output_parameter'"
        >>> hidden = ParamKey(name="*.weight", exclude=ParamKey(attr="is_embedding_or_output_parameter"))
        >>> output = torch.nn.Parameter(torch.empty(3, 3))
        >>> output.is_embedding_or_output_parameter = True
        >>> hidden.matches(output, "output_layer.weight")
        False
        >>> hidden.describe()
        "name='*.weight', exclude=(attr='is_embedding_or_output_parameter')"
    """

    name: str | tuple[str, ...] = ()
    """Glob(s) on the full dotted name, by :func:`fnmatch.fnmatchcase` (``*`` crosses dots)."""
    attr: str | tuple[str, ...] = ()
    """Attribute(s) of the parameter; matches when ``getattr(param, attr, False)`` is truthy."""
    predicate: ParamPredicate | tuple[ParamPredicate, ...] = ()
    """Predicate(s) on the parameter."""
    with_name_predicate: ParamWithNamePredicate | tuple[ParamWithNamePredicate, ...] = ()
    """Predicate(s) on the parameter and its name."""
    exclude: ParamKey | None = None
    """Parameters this key leaves out even when an include field matches them; ``None``: none.
    Itself a key with at least one field set and no ``exclude`` of its own."""
    role: str | tuple[str, ...] = ()
    """Role(s) the parameter holds (:data:`optzoo._common.ROLES`): ``embedding``, ``output``,
    ``bias``, ``norm``, ``expert``, ``router``, ``conv``, ``matrix``, ``vector``."""

    def __post_init__(self) -> None:
        for field_name, expected in (
            ("name", str),
            ("attr", str),
            ("predicate", ParamPredicate),
            ("with_name_predicate", ParamWithNamePredicate),
            ("role", str),
        ):
            for entry in _as_tuple(getattr(self, field_name)):
                if not isinstance(entry, expected):
                    raise TypeError(
                        f"`ParamKey.{field_name}`: entries must be {expected.__name__}; "
                        f"got {entry!r} ({type(entry).__name__}); "
                        f"expected a {expected.__name__} or a tuple of them"
                    )
        unknown = [r for r in _as_tuple(self.role) if r not in ROLES]
        if unknown:
            raise ValueError(f"`ParamKey.role`: unknown role; got {unknown[0]!r}; expected one of {list(ROLES)}")
        if self.exclude is not None:
            if not isinstance(self.exclude, ParamKey):
                raise TypeError(
                    f"`ParamKey.exclude`: must be a ParamKey or None; got {self.exclude!r} "
                    f"({type(self.exclude).__name__}); expected e.g. ParamKey(attr='is_embedding_or_output_parameter')"
                )
            if self.exclude.exclude is not None:
                raise ValueError(
                    f"`ParamKey.exclude`: must not have an exclude of its own; got {self.exclude.describe()}; "
                    "expected a key with name, attr, predicate, with_name_predicate or role only"
                )
            if not self.exclude._has_include():
                raise ValueError(
                    "`ParamKey.exclude`: excludes nothing; got ParamKey(); "
                    "expected a key with at least one field set, or exclude=None"
                )
        # Matching runs (parameters x keys) times: normalise once, and fold all globs into
        # one regex (the same translation fnmatch uses) instead of one fnmatch call per glob.
        names = _as_tuple(self.name)
        pattern = re.compile("|".join(fnmatch.translate(n) for n in names)) if names else None
        object.__setattr__(self, "_name_pattern", pattern)
        object.__setattr__(self, "_attrs", _as_tuple(self.attr))
        object.__setattr__(self, "_predicates", _as_tuple(self.predicate))
        object.__setattr__(self, "_name_predicates", _as_tuple(self.with_name_predicate))
        object.__setattr__(self, "_roles", frozenset(_as_tuple(self.role)))

    def _has_include(self) -> bool:
        return any(_as_tuple(getattr(self, f)) for f in INCLUDE_FIELDS)

    def matches(self, param: torch.Tensor, param_name: str, roles: Collection[str] | None = None) -> bool:
        """Whether ``param``, known as ``param_name``, is selected by this key.

        ``roles``: the parameter's roles, as the model gives them (``resolve_param_groups``
        passes them); ``None`` reads them from the parameter alone (tags, name, shape).
        """
        if not self._includes(param, param_name, roles):
            return False
        return self.exclude is None or not self.exclude._includes(param, param_name, roles)

    def matches_any(self, param: torch.Tensor, param_names: Sequence[str], roles: Collection[str] | None = None) -> bool:
        """Whether a tensor known by several names (tied) is selected: some name is included
        and no name is excluded. With one name this is :meth:`matches`."""
        if not any(self._includes(param, name, roles) for name in param_names):
            return False
        return self.exclude is None or not any(self.exclude._includes(param, name, roles) for name in param_names)

    def _includes(self, param: torch.Tensor, param_name: str, roles: Collection[str] | None) -> bool:
        """The include fields alone (OR over every entry), ignoring ``exclude``."""
        pattern: re.Pattern[str] | None = self._name_pattern  # type: ignore[attr-defined]
        if pattern is not None and pattern.match(param_name):
            return True
        for attr in self._attrs:  # type: ignore[attr-defined]
            if getattr(param, attr, False):
                return True
        for predicate in self._predicates:  # type: ignore[attr-defined]
            if _ask(predicate, param_name, param):
                return True
        for name_predicate in self._name_predicates:  # type: ignore[attr-defined]
            if _ask(name_predicate, param_name, param, param_name):
                return True
        wanted: frozenset[str] = self._roles  # type: ignore[attr-defined]
        if wanted:
            held = roles if roles is not None else param_roles(param, param_name).names
            return not wanted.isdisjoint(held)
        return False

    def describe(self) -> str:
        """A short, stable description listing only the fields that are set."""
        parts = []
        for field_name in INCLUDE_FIELDS:
            entries = _as_tuple(getattr(self, field_name))
            if not entries:
                continue
            shown = [e if isinstance(e, str) else e.name for e in entries]
            value = repr(shown[0]) if len(shown) == 1 else repr(tuple(shown))
            parts.append(f"{field_name}={value}")
        if self.exclude is not None:
            parts.append(f"exclude=({self.exclude.describe()})")
        return ", ".join(parts) if parts else "<empty>"


INCLUDE_FIELDS: tuple[str, ...] = ("name", "attr", "predicate", "with_name_predicate", "role")
"""The fields of a ``ParamKey`` that select params (``exclude`` takes them back out)."""
"""The ``ParamKey`` fields that select parameters (everything but ``exclude``)."""
