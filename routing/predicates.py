"""The predicate registry: named parameter tests that a recipe file can refer to by name.

A recipe (``[[overrides]]`` in TOML or YAML) cannot hold Python code, so its ``predicate``
entries are names looked up here. Each name maps to one :class:`ParamPredicate` or
:class:`ParamWithNamePredicate` whose ``name`` is the registered name, so a key loaded twice is
equal and hashes the same (predicates compare by name). The built-in predicates are all
registered at the bottom of this module; :func:`register_predicate` adds your own.

This registry is the one piece of global state in ``routing/``: :func:`resolve_param_groups`
never reads it, only the conversion between recipes and ``ParamKey`` does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch

from .._common import did_you_mean
from .keys import ParamPredicate, ParamWithNamePredicate

__all__ = [
    "BUILTIN_PREDICATES",
    "Predicate",
    "PredicateFn",
    "PredicateSpec",
    "get_predicate",
    "is_registered",
    "predicate_spec",
    "register_predicate",
    "registered_predicates",
    "unregister_predicate",
]

Predicate = ParamPredicate | ParamWithNamePredicate
"""Either kind of named predicate."""
PredicateFn = Callable[[torch.Tensor], Any] | Callable[[torch.Tensor, str], Any]
"""What :func:`register_predicate` accepts: ``fn(param)`` or ``fn(param, name)``, truthy to match."""


@dataclass(frozen=True)
class PredicateSpec:
    """One registered predicate."""

    name: str
    """Registry name; also the predicate's ``name``, so keys compare equal across loads."""
    predicate: Predicate
    """The test, ready to put in a ``ParamKey``."""
    description: str
    """One line: exactly what it selects."""

    @property
    def takes_name(self) -> bool:
        """Whether it tests the parameter's name too (a ``ParamWithNamePredicate``)."""
        return isinstance(self.predicate, ParamWithNamePredicate)


_REGISTRY: dict[str, PredicateSpec] = {}


def _arity(fn: Callable[..., Any]) -> int | None:
    """Number of positional parameters ``fn`` takes, or ``None`` when that cannot be told."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return None
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


def _make(name: str, fn: PredicateFn | Predicate, takes_name: bool | None) -> Predicate:
    if isinstance(fn, (ParamPredicate, ParamWithNamePredicate)):
        if fn.name != name:
            raise ValueError(
                f"`register_predicate`: the predicate's own name differs from the registered name; got "
                f"{fn.name!r} registered as {name!r}; expected the same name (keys compare predicates by name)"
            )
        if takes_name is not None and takes_name != isinstance(fn, ParamWithNamePredicate):
            raise ValueError(
                f"`register_predicate({name!r})`: takes_name={takes_name} contradicts the predicate's kind; "
                f"got a {type(fn).__name__}; expected takes_name=None"
            )
        return fn
    if not callable(fn):
        raise TypeError(
            f"`register_predicate({name!r})`: fn must be callable; got {fn!r} ({type(fn).__name__}); "
            "expected fn(param) or fn(param, name)"
        )
    if takes_name is None:
        arity = _arity(fn)
        if arity not in (1, 2):
            raise TypeError(
                f"`register_predicate({name!r})`: cannot tell whether fn takes the name; got a callable with "
                f"{'an unknown number of' if arity is None else arity} required positional arguments; "
                "expected fn(param) or fn(param, name), or pass takes_name=True/False"
            )
        takes_name = arity == 2
    if takes_name:
        return ParamWithNamePredicate(name=name, fn=fn)  # type: ignore[arg-type]
    return ParamPredicate(name=name, fn=fn)  # type: ignore[arg-type]


@overload
def register_predicate(
    name: str, fn: PredicateFn | Predicate, *, description: str | None = None, takes_name: bool | None = None
) -> Predicate: ...
@overload
def register_predicate(
    name: str, fn: None = None, *, description: str | None = None, takes_name: bool | None = None
) -> Callable[[PredicateFn], Predicate]: ...
def register_predicate(
    name: str,
    fn: PredicateFn | Predicate | None = None,
    *,
    description: str | None = None,
    takes_name: bool | None = None,
) -> Predicate | Callable[[PredicateFn], Predicate]:
    """Register ``fn`` under ``name`` so recipes can use it; or, without ``fn``, a decorator.

    Args:
        name: The name recipes use (``predicate = "name"``); must be new.
        fn: ``fn(param)`` (becomes a :class:`ParamPredicate`) or ``fn(param, name)`` (a
            :class:`ParamWithNamePredicate`), told apart by its required positional arguments;
            or a ready predicate whose ``name`` is ``name``.
        description: One line for listings; default the first line of ``fn``'s docstring.
        takes_name: Force the kind when the signature cannot tell (default: inferred).

    Returns:
        The registered predicate, ready for ``ParamKey(predicate=...)`` or
        ``ParamKey(with_name_predicate=...)``; as a decorator, it replaces the function.

    Raises:
        ValueError: ``name`` is already registered, or is empty.
        TypeError: ``fn`` is not callable, or its kind cannot be inferred.

    Example:
        >>> @register_predicate("doc_example_is_expert")
        ... def is_expert(param, name):
        ...     "Parameters of MoE experts, by name."
        ...     return ".experts." in name
        >>> is_expert
        ParamWithNamePredicate(name='doc_example_is_expert')
        >>> get_predicate("doc_example_is_expert") is is_expert
        True
        >>> unregister_predicate("doc_example_is_expert")
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(
            f"`register_predicate`: invalid name; got {name!r}; expected a non-empty string without "
            "surrounding whitespace"
        )

    def add(function: PredicateFn | Predicate) -> Predicate:
        if name in _REGISTRY:
            raise ValueError(
                f"`register_predicate`: predicate already registered; got {name!r} a second time; "
                f"expected a new name (registered: {registered_predicates()})"
            )
        predicate = _make(name, function, takes_name)
        doc = inspect.getdoc(predicate.fn) if description is None else None
        line = description if description is not None else (doc.splitlines()[0] if doc else "")
        _REGISTRY[name] = PredicateSpec(name=name, predicate=predicate, description=line)
        return predicate

    if fn is None:
        return add
    return add(fn)


def unregister_predicate(name: str) -> None:
    """Remove a predicate you registered (e.g. to redefine it in a notebook, or after a test).

    Raises:
        ValueError: ``name`` is a built-in predicate or is not registered.
    """
    if name in BUILTIN_PREDICATES:
        raise ValueError(
            f"`unregister_predicate`: built-in predicates cannot be removed; got {name!r}; "
            f"expected one you registered (built-in: {list(BUILTIN_PREDICATES)})"
        )
    predicate_spec(name)
    del _REGISTRY[name]


def registered_predicates() -> list[str]:
    """Registered predicate names, in registration order (the built-ins first)."""
    return list(_REGISTRY)


def predicate_spec(name: str) -> PredicateSpec:
    """The record registered under ``name``.

    Raises:
        ValueError: Unknown name; the message lists the registered names.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"`predicate`: unknown predicate; got {name!r}; expected one of {registered_predicates()} "
            f"(register_predicate(name, fn) adds one){did_you_mean(name, registered_predicates())}"
        ) from None


def get_predicate(name: str) -> Predicate:
    """The predicate registered under ``name`` (see :func:`predicate_spec` for errors)."""
    return predicate_spec(name).predicate


def is_registered(predicate: Predicate) -> bool:
    """Whether ``predicate`` is the very one registered under its name (not just equal by name)."""
    spec = _REGISTRY.get(predicate.name)
    return spec is not None and type(spec.predicate) is type(predicate) and spec.predicate.fn is predicate.fn


# ---- The built-in predicates --------------------------------------------------------------
# Each definition below is the documented one (docs/routing.md, "Recipes"); change both together.


def _owner(name: str) -> str:
    """The name of the module that holds the parameter: ``a.b.norm.weight`` -> ``norm``."""
    parts = name.split(".")
    return parts[-2] if len(parts) > 1 else ""


def _is_embedding(param: torch.Tensor, name: str) -> bool:
    """Megatron-Core's MuP test for an embedding (``get_mup_config_overrides``): the
    ``shared_embedding`` attribute, else the ``is_embedding_parameter`` attribute when present,
    else ``"embedding"`` in the lower-cased name."""
    if getattr(param, "shared_embedding", False):
        return True
    if hasattr(param, "is_embedding_parameter"):
        return bool(param.is_embedding_parameter)
    return "embedding" in name.lower()


def _is_1d(param: torch.Tensor) -> bool:
    return param.ndim == 1


def _is_2d_matrix(param: torch.Tensor) -> bool:
    return param.ndim == 2


def _is_bias(param: torch.Tensor, name: str) -> bool:
    return name.rsplit(".", 1)[-1] == "bias"


def _is_norm(param: torch.Tensor, name: str) -> bool:
    owner = _owner(name).lower()
    return param.ndim == 1 and ("norm" in owner or owner == "ln" or owner.startswith("ln_"))


def _is_qk_layernorm(param: torch.Tensor, name: str) -> bool:
    # The attribute is Megatron-Bridge's tag (_mark_qk_layernorm_params); the name test is
    # Megatron-Core's get_standard_config_overrides (and optzoo.routing.standard), character for character.
    return bool(getattr(param, "is_qk_layernorm", False)) or "q_layernorm." in name or "k_layernorm." in name


def _is_embedding_or_output(param: torch.Tensor, name: str) -> bool:
    return bool(getattr(param, "is_embedding_or_output_parameter", False)) or _is_embedding(param, name)


def _is_1d_or_bias_not_qk_layernorm(param: torch.Tensor, name: str) -> bool:
    return (param.ndim == 1 or name.endswith(".bias")) and not ("q_layernorm." in name or "k_layernorm." in name)


def _is_mup_vector_like(param: torch.Tensor, name: str) -> bool:
    return _is_embedding(param, name) or param.ndim <= 1


def _is_muon_matrix(param: torch.Tensor) -> bool:
    return (
        param.ndim == 2
        and not getattr(param, "is_embedding_or_output_parameter", False)
        and getattr(param, "use_muon", True) is not False
    )


register_predicate("is_1d", _is_1d, description="1-D tensors: param.ndim == 1 (biases, norm weights)")
register_predicate(
    "is_2d_matrix", _is_2d_matrix,
    description="2-D tensors: param.ndim == 2 (linear weights, embeddings, the output layer)",
)  # fmt: skip
register_predicate("is_bias", _is_bias, description="the last component of the name is 'bias'")
register_predicate(
    "is_norm", _is_norm,
    description="1-D, and the owning module's name (the component before the last), lower-cased, contains "
    "'norm' or is 'ln' or starts with 'ln_'",
)  # fmt: skip
register_predicate(
    "is_qk_layernorm", _is_qk_layernorm,
    description="attribute is_qk_layernorm is truthy, or the name contains 'q_layernorm.' or 'k_layernorm.'",
)  # fmt: skip
register_predicate(
    "is_embedding_or_output", _is_embedding_or_output,
    description="attribute is_embedding_or_output_parameter or shared_embedding is truthy; else attribute "
    "is_embedding_parameter when present; else 'embedding' is in the lower-cased name",
)  # fmt: skip
register_predicate(
    "is_1d_or_bias_not_qk_layernorm", _is_1d_or_bias_not_qk_layernorm,
    description="1-D or named '*.bias', and the name contains neither 'q_layernorm.' nor 'k_layernorm.' "
    "(the standard no-decay rule with apply_wd_to_qk_layernorm)",
)  # fmt: skip
register_predicate(
    "is_mup_vector_like", _is_mup_vector_like,
    description="MuP's vector-like params (Megatron-Core): param.ndim <= 1; or attribute shared_embedding is "
    "truthy; else attribute is_embedding_parameter when present; else 'embedding' is in the lower-cased name",
)  # fmt: skip
register_predicate(
    "is_muon_matrix", _is_muon_matrix,
    description="the matrices Muon takes by default: 2-D, attribute is_embedding_or_output_parameter not truthy, "
    "attribute use_muon not False (Megatron-Core's is_managed_by_layer_wise_optimizer)",
)  # fmt: skip
BUILTIN_PREDICATES: tuple[str, ...] = tuple(_REGISTRY)
"""The names registered above; they cannot be unregistered (shipped recipes use them)."""
