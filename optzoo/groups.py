"""Turn routed parameter groups into resolved per-group configs and torch param groups."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from optzoo._common import MatrixView, did_you_mean, finite_number, jsonable, show_value
from optzoo.config import GROUP_FIELDS, SCHEDULE_KEYS, OptimizerConfig, canonical_optimizer_name, field_habit
from optzoo.optimizers.registry import OptimizerSpec, Placement, get_spec
from optzoo.routing import ExampleInputs, ParamKey, RoutedParam, Routing, resolve_param_groups, standard_overrides

__all__ = [
    "ALLOWED_OVERRIDE_KEYS",
    "LINKED_FIELDS",
    "OverrideValue",
    "ResolvedGroup",
    "get_standard_config_overrides",
    "normalize_overrides",
    "qualified_names",
    "resolve_group_configs",
]

OverrideValue = Mapping[str, Any] | OptimizerConfig
"""An override: a dict of field names, or an ``OptimizerConfig`` meaning its differing fields."""

ALLOWED_OVERRIDE_KEYS: tuple[str, ...] = tuple(dict.fromkeys(GROUP_FIELDS + SCHEDULE_KEYS))

LINKED_FIELDS: tuple[tuple[str, ...], ...] = (("lr", "max_lr", "min_lr"), ("weight_decay", "wd_mult", "start_wd", "end_wd"))
"""Override fields that say one thing together: a user rule that sets one of a set replaces the
standard overrides' whole set for its params (its ``lr`` beats ``decoupled_lr``'s ``max_lr``, its
``weight_decay`` the no-decay rule's ``wd_mult = 0``)."""


def get_standard_config_overrides(config: OptimizerConfig) -> dict[ParamKey, dict[str, Any]]:
    """The standard overrides (Megatron-Core's defaults): what ``config_overrides=None`` applies,
    and what lies under an explicit ``config_overrides`` unless ``config.standard_overrides`` is False.

    No weight decay on biases and 1-D parameters (``q_layernorm``/``k_layernorm`` keep it with
    ``apply_wd_to_qk_layernorm``), and ``decoupled_lr``/``decoupled_min_lr`` on parameters
    tagged ``is_embedding_or_output_parameter``.

    Example:
        >>> overrides = get_standard_config_overrides(OptimizerConfig(lr=1e-3, decoupled_lr=1e-4))
        >>> list(overrides.values())
        [{'wd_mult': 0.0}, {'max_lr': 0.0001}]
    """
    return standard_overrides(
        decoupled_lr=config.decoupled_lr,
        decoupled_min_lr=config.decoupled_min_lr,
        apply_wd_to_qk_layernorm=config.apply_wd_to_qk_layernorm,
    )


def normalize_overrides(
    config: OptimizerConfig, config_overrides: Mapping[ParamKey, OverrideValue] | None
) -> dict[ParamKey, dict[str, Any]]:
    """Check override field names and turn ``OptimizerConfig`` values into dicts.

    ``None`` means the standard overrides; a dict is itself here (``{}``: none), and
    :func:`resolve_group_configs` lays the standard overrides under it unless
    ``config.standard_overrides`` is False (Megatron-Core's meaning, pinned by a test).
    """
    if config_overrides is None:
        return get_standard_config_overrides(config)
    if not isinstance(config_overrides, Mapping):
        raise TypeError(
            f"`config_overrides`: must be a dict of ParamKey -> override; "
            f"got {type(config_overrides).__name__}; expected a dict, {{}} or None"
        )
    normalized: dict[ParamKey, dict[str, Any]] = {}
    for index, (key, value) in enumerate(config_overrides.items()):
        described = key.describe() if isinstance(key, ParamKey) else repr(key)
        subject = f"config_overrides rule #{index} {described}"
        if isinstance(value, OptimizerConfig):
            fields = value.diff(config)
        elif isinstance(value, Mapping):
            fields = dict(value)
        else:
            raise TypeError(
                f"`{subject}`: override must be a dict or an OptimizerConfig; "
                f"got {type(value).__name__}; expected e.g. {{'wd_mult': 0.0}}"
            )
        for field in fields:
            if field not in ALLOWED_OVERRIDE_KEYS:
                model_wide = field in {f.name for f in dataclasses.fields(OptimizerConfig)}
                if not model_wide and (meant := field_habit(field)) is not None:
                    raise ValueError(f"`{subject}`: not an optzoo field; got {field!r}; expected {meant}")
                problem = (
                    "field is model-wide and cannot differ per group"
                    if model_wide
                    else "unknown override field"
                )
                raise ValueError(
                    f"`{subject}`: {problem}; got {field!r}; "
                    f"expected one of {list(ALLOWED_OVERRIDE_KEYS)}{'' if model_wide else did_you_mean(field, ALLOWED_OVERRIDE_KEYS)}"
                )
        for field in ("optimizer", "muon_scalar_optimizer"):  # "AdamW" and "adam" agree, not conflict
            if isinstance(fields.get(field), str):
                fields[field] = canonical_optimizer_name(fields[field])
        normalized[key] = fields
    return normalized


@dataclass(frozen=True)
class ResolvedGroup:
    """One parameter group with its fully resolved configuration."""

    index: int
    config: OptimizerConfig
    """The base config with this group's override applied (validated)."""
    override: Mapping[str, Any]
    """The merged override, as given (config fields and schedule keys)."""
    lr: float
    """Effective learning rate: ``max_lr`` when overridden, else the group's ``lr``."""
    min_lr: float | None
    weight_decay: float
    """Effective weight decay: the group's ``weight_decay`` times ``wd_mult``."""
    wd_mult: float
    params: tuple[RoutedParam, ...]
    param_names: tuple[str, ...]
    """Unique names (chunk-qualified when there are several chunks), parallel to ``params``."""
    all_names: tuple[tuple[str, ...], ...]
    """Every name of each param, parallel to ``params``: a tied weight has several, the first
    being its ``param_names`` entry."""
    start_wd: float | None = None
    """Start of a scheduler's weight-decay ramp for this group: the override's ``start_wd``, else
    its ``weight_decay`` when it sets one; ``None`` (no such override, as in Megatron-Core): the
    scheduler's own ``start_wd`` applies."""
    end_wd: float | None = None
    """End of the ramp, as ``start_wd``: the override's ``end_wd``, else its ``weight_decay``."""
    auto_routed: str | None = None
    """Why these params were moved to a fallback optimizer (e.g. Muon's scalar optimizer)."""
    flatten: bool = False
    """Its N-D params are each one matrix, first dim by the rest (conv filters for the Muon
    family: the torch group's ``flatten``), not stacks of matrices (expert stacks)."""
    default_config: bool = False
    """No override applies and nothing moved it: the group steps with the base config
    (Megatron-Core's ``default_config`` group key, read by :func:`get_canonical_lr_for_logging`)."""

    @property
    def optimizer(self) -> str:
        return self.config.optimizer

    def torch_param_group(self, params: list[torch.Tensor] | None = None, names: Sequence[str] | None = None) -> dict[str, Any]:
        """The dict handed to the torch optimizer: hyperparameters plus schedule metadata.

        Args:
            params: The tensors to step (main params); default the model params themselves.
            names: Their names, parallel to ``params``; default ``self.param_names``.
        """
        spec = get_spec(self.optimizer)
        values = {name: getattr(self.config, name) for name in spec.config_fields}
        group = {
            "params": params if params is not None else [routed.param for routed in self.params],
            "param_names": list(names if names is not None else self.param_names),
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            **spec.group_options(values),
            "optimizer": self.optimizer,
            "max_lr": self.lr,
            "min_lr": self.min_lr,
            "wd_mult": self.wd_mult,
            "default_config": self.default_config,
        }
        if self.flatten:
            group["flatten"] = True
        views = self.matrix_views(group["param_names"])
        if views is not None:
            group["matrix_views"] = views
        # As in Megatron-Core, only a group whose override sets them carries start_wd/end_wd, so a
        # scheduler's own range (e.g. a ramp 0.0 -> 0.1) reaches every other group.
        for name in ("start_wd", "end_wd"):
            if getattr(self, name) is not None:
                group[name] = getattr(self, name)
        return group

    def matrix_views(self, names: Sequence[str]) -> list[MatrixView | None] | None:
        """The forward's :class:`~optzoo._common.MatrixView` of each named param, for optimizers that
        step params as those matrices (the record's ``matrix_views``); ``None`` when none has one."""
        if not get_spec(self.optimizer).matrix_views:
            return None
        by_name = {name: routed.roles.view for routed, name in zip(self.params, self.param_names)}
        views = [by_name.get(name) for name in names]
        return views if any(view is not None for view in views) else None

    def matrix_view_of(self, param: torch.Tensor) -> MatrixView | None:
        """The view ``param`` is stepped as (:meth:`matrix_views`), or ``None``."""
        if not get_spec(self.optimizer).matrix_views:
            return None
        return next((routed.roles.view for routed in self.params if routed.param is param), None)

    def summary(self) -> dict[str, Any]:
        """JSON-friendly description: effective hyperparameters and the full resolved config."""
        return {
            "index": self.index,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "min_lr": self.min_lr,
            "weight_decay": self.weight_decay,
            "wd_mult": self.wd_mult,
            "override": {k: jsonable(v) for k, v in self.override.items()},
            "auto_routed": self.auto_routed,
            **({"flatten": True} if self.flatten else {}),
            "num_params": len(self.params),
            "num_elements": sum(routed.param.numel() for routed in self.params),
            "config": {
                f.name: jsonable(getattr(self.config, f.name))
                for f in dataclasses.fields(self.config)
            },
        }


def qualified_names(routed: RoutedParam, num_chunks: int) -> tuple[str, ...]:
    """A parameter's unique names: chunk-local names, prefixed ``chunkN.`` when there are chunks."""
    if num_chunks == 1:
        return routed.names
    return tuple(f"chunk{chunk}.{name}" for name, chunk in zip(routed.names, routed.chunks))


def _warn_if_decoupled_lr_is_unused(config: OptimizerConfig, overrides: Mapping[ParamKey, Mapping[str, Any]]) -> None:
    """``decoupled_lr`` acts only through the standard overrides (as in Megatron-Core): say so."""
    if config.decoupled_lr is None:
        return
    if any(value.get("max_lr") == config.decoupled_lr for value in overrides.values()):
        return
    warnings.warn(
        f"`OptimizerConfig.decoupled_lr`: has no effect with explicit config_overrides; got "
        f"{config.decoupled_lr!r} but no override sets max_lr to it; expected the standard overrides under your "
        "dict, which standard_overrides=False leaves out: standard_overrides=True, or "
        "{**get_standard_config_overrides(config), **your_overrides}",
        UserWarning,
        stacklevel=3,
    )


def resolve_group_configs(
    config: OptimizerConfig,
    model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    config_overrides: Mapping[ParamKey, OverrideValue] | None = None,
    *,
    strict: bool = False,
    example_inputs: ExampleInputs | Sequence[ExampleInputs | None] | None = None,
    trace: bool = True,
) -> tuple[list[ResolvedGroup], Routing]:
    """Route the parameters and resolve each group's config; nothing is built yet.

    ``example_inputs`` and ``trace`` say how roles are read: see
    :func:`optzoo.routing.infer_roles` (default: one forward on inputs made from the model).

    Raises:
        ValueError: Conflicting overrides, an unknown or model-wide override field, an invalid
            value for a group (the message names the group's rules), or ``lr`` unset.
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    overrides = normalize_overrides(config, config_overrides)
    layered = config_overrides is not None and config.standard_overrides
    if config_overrides is not None and not layered:
        _warn_if_decoupled_lr_is_unused(config, overrides)
    # The standard rules are ours, not the user's: one that matches nothing is not a typo. Under an
    # explicit dict they are defaults, which its rules override field by field.
    routing = resolve_param_groups(
        chunks, overrides, strict=strict, warn_unmatched=config_overrides is not None, example_inputs=example_inputs,
        trace=trace, defaults=get_standard_config_overrides(config) if layered else None, linked_fields=LINKED_FIELDS,
    )  # fmt: skip
    resolved: list[ResolvedGroup] = []
    for index, group in enumerate(routing.groups):
        rules = _deciding_rules(group.params, routing)
        subject = f"param group #{index} (rules {', '.join(_described(routing, k) for k in rules) or 'none'})"
        override = dict(group.override)
        config_fields = {k: v for k, v in override.items() if k in GROUP_FIELDS}
        if _override_max_lr(override, config, subject) is not None:
            # max_lr gives the group its own schedule, read from its keys (max_lr, min_lr) as Megatron-Core's
            # scheduler reads them; its config keeps the base lr, so it keeps the base min_lr too (a min_lr
            # above the base lr is valid under a higher max_lr).
            config_fields.pop("min_lr", None)
        try:
            group_config = config.replace(**config_fields)
        except ValueError as error:
            raise ValueError(f"{subject}: {error}") from None
        for part in _hand_off_to_fallback(group_config, group.params, override, routing, len(chunks)):
            one = _resolve_one(len(resolved), part, override, subject, len(chunks))
            resolved.append(dataclasses.replace(one, default_config=not override and part.config == config))
    return resolved, routing


def _deciding_rules(params: Sequence[RoutedParam], routing: Routing) -> list[int]:
    """The rules behind a group's override: every user rule that matched, and each standard one
    laid under them that still sets a field (one whose fields the user's rules all replaced is left out)."""
    matched = sorted({k for routed in params for k in routed.matched})
    own = {field for k in matched if k not in routing.defaults for field in routing.overrides[k]}
    hidden = own.union(*(set(fields) for fields in LINKED_FIELDS if own & set(fields)))
    return [k for k in matched if k not in routing.defaults or set(routing.overrides[k]) - hidden]


def _described(routing: Routing, index: int) -> str:
    return f"#{index} {routing.keys[index].describe()}{' (standard)' if index in routing.defaults else ''}"


class _Part(NamedTuple):
    """Some params of a routed group, as one resolved group."""

    config: OptimizerConfig
    params: tuple[RoutedParam, ...]
    auto_routed: str | None = None
    flatten: bool = False


def _hand_off_to_fallback(
    config: OptimizerConfig,
    params: tuple[RoutedParam, ...],
    override: Mapping[str, Any],
    routing: Routing,
    num_chunks: int,
) -> list[_Part]:
    """Hand the params an algorithm does not take to its fallback, by the record's ``place``.

    A param goes to the optimizer named by the spec's ``fallback_field`` (e.g.
    ``muon_scalar_optimizer``) when the algorithm cannot take it (Muon: a 1-D param), or declines
    it by default (Muon: an embedding, the head, a bias, a norm, ``use_muon=False``), unless a
    user rule set ``optimizer`` for it: a rule may route an embedding to Muon, but routing a
    param there that it cannot take is an error. Flattened conv filters get their own group.
    """
    spec = get_spec(config.optimizer)
    if spec.place is None or spec.fallback_field is None:
        return [_Part(config, params)]
    fallback = getattr(config, spec.fallback_field)
    explicit = "optimizer" in override
    fields = {name: getattr(config, name) for name in spec.config_fields}
    kept: list[RoutedParam] = []
    flattened: list[RoutedParam] = []
    moved: list[RoutedParam] = []
    declined: list[RoutedParam] = []
    for routed in params:
        placement = place(spec, routed.param, routed.roles.names, fields, explicit, routed.roles.view)
        if placement == "cannot":
            if explicit:
                rules = [f"#{k} {routing.keys[k].describe()}" for k in routed.matched if "optimizer" in routing.overrides[k]]
                raise ValueError(
                    f"`{qualified_names(routed, num_chunks)[0]}` ({routed.param.dim()}-D, shape "
                    f"{tuple(routed.param.shape)}, {routed.roles.describe()}): routed to {spec.name} by rule "
                    f"{' '.join(rules)}; got a param {spec.name} does not take ({spec.shapes}); expected it "
                    f"routed to another optimizer, e.g. {fallback!r}"
                )
            moved.append(routed)
        elif placement == "decline":
            declined.append(routed)
        else:
            (flattened if placement == "take_flattened" else kept).append(routed)
    parts = [_Part(config, tuple(members), flatten=flat) for members, flat in ((kept, False), (flattened, True)) if members]
    # One group per reason, so each moved param carries the reason that applies to it.
    for moved_params, why in ((declined, f"leaves {spec.declines_what}"), (moved, f"takes {spec.shapes}")):
        if moved_params:
            reason = f"auto: {spec.name} {why} -> {spec.fallback_field}={fallback!r}"
            parts.append(_Part(config.replace(optimizer=fallback, **_scalar_lr(config, override)), tuple(moved_params), reason))
    return parts


def _scalar_lr(config: OptimizerConfig, override: Mapping[str, Any]) -> dict[str, Any]:
    """The lr fields of the params handed to ``muon_scalar_optimizer``: ``muon_scalar_lr``, and the
    schedule floor scaled with it, so their schedule is the base one times ``muon_scalar_lr / lr``.
    A rule's own ``lr`` or ``max_lr`` (``decoupled_lr``) for them wins, and its ``min_lr`` stays."""
    scalar_lr, lr, min_lr = config.muon_scalar_lr, config.lr, config.min_lr
    if scalar_lr is None or scalar_lr == lr or "lr" in override or "max_lr" in override:
        return {}
    if min_lr is not None and lr and "min_lr" not in override:
        min_lr = min_lr * (scalar_lr / lr)
    return {"lr": scalar_lr, "min_lr": min_lr}


def place(spec: OptimizerSpec, param: torch.Tensor, roles: frozenset[str], fields: Mapping[str, Any], explicit: bool, view: MatrixView | None) -> Placement:
    """``spec.place`` of ``param``; a ``place`` registered before views existed takes four arguments."""
    function: Callable[..., Placement] | None = spec.place
    assert function is not None
    if _takes_view(function):
        return function(param, roles, fields, explicit, view)
    return function(param, roles, fields, explicit)


@functools.cache
def _takes_view(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 5 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _override_max_lr(override: Mapping[str, Any], config: OptimizerConfig, subject: str) -> Any | None:
    """The override's ``max_lr`` (``None`` when it sets none), checked with the group's ``min_lr``.

    A group's schedule runs from its ``max_lr`` down to its ``min_lr`` (Megatron-Core's
    ``OptimizerParamScheduler`` reads both per group), so ``min_lr`` may exceed the base ``lr``
    when the group's ``max_lr`` does too (``{min_lr: 10, max_lr: 20}`` over ``lr=0.01``).
    """
    if "max_lr" not in override:
        return None
    peak = override["max_lr"]
    if not finite_number(peak) or not peak >= 0:
        raise ValueError(f"`{subject}`: `max_lr` must be a finite float >= 0; got {show_value(peak)}; expected e.g. 0.0")
    min_lr = override.get("min_lr", config.min_lr)
    if finite_number(min_lr) and min_lr > peak:  # the schedule would anneal the lr up to min_lr
        raise ValueError(f"`{subject}`: `min_lr` must not exceed the group's lr; got min_lr={min_lr!r}, lr={peak!r}; expected min_lr <= lr")
    return peak


def _resolve_one(index: int, part: _Part, override: dict[str, Any], subject: str, num_chunks: int) -> ResolvedGroup:
    """Effective lr and weight decay, and the schedule keys, of one group."""
    group_config, params = part.config, part.params
    if "lr" in override and "max_lr" in override and override["lr"] != override["max_lr"]:
        raise ValueError(
            f"`{subject}`: `lr` and `max_lr` disagree; got lr={override['lr']!r}, "
            f"max_lr={override['max_lr']!r}; expected one of them, or equal values"
        )
    lr = override.get("max_lr", group_config.lr)
    if lr is None:
        raise ValueError(
            f"`OptimizerConfig.lr`: required to build an optimizer; got None for {subject}; "
            "expected a float >= 0 (set config.lr, or max_lr in an override)"
        )
    for name in ("max_lr", "lr", "min_lr", "wd_mult", "start_wd", "end_wd"):
        if name not in override or (override[name] is None and name not in ("wd_mult", "max_lr")):
            continue
        value = override[name]
        if not finite_number(value) or not value >= 0:
            raise ValueError(f"`{subject}`: `{name}` must be a finite float >= 0; got {show_value(value)}; expected e.g. 0.0")
    wd_mult = float(override.get("wd_mult", 1.0))
    # Each finite, the product can still overflow: an inf weight decay would turn every param into NaN.
    for name, value in (("weight_decay", group_config.weight_decay), ("start_wd", override.get("start_wd")), ("end_wd", override.get("end_wd"))):
        if value is not None and not math.isfinite(value * wd_mult):
            raise ValueError(
                f"`{subject}`: `{name}` times `wd_mult` overflows to inf; got {name}={value!r}, wd_mult={wd_mult!r}; "
                "expected a product below float max (1.8e308)"
            )
    min_lr = override.get("min_lr", group_config.min_lr)
    if min_lr is not None and min_lr > lr:  # the schedule would anneal the lr up to min_lr
        raise ValueError(f"`{subject}`: `min_lr` must not exceed the group's lr; got min_lr={min_lr!r}, lr={lr!r}; expected min_lr <= lr")
    start_wd, end_wd = override.get("start_wd"), override.get("end_wd")
    if start_wd is not None and end_wd is not None and start_wd > end_wd:
        raise ValueError(
            f"`{subject}`: `start_wd` must not exceed `end_wd` (as Megatron-Core's scheduler asserts); "
            f"got start_wd={start_wd!r}, end_wd={end_wd!r}; expected start_wd <= end_wd"
        )
    return ResolvedGroup(
        index=index,
        config=group_config,
        override=override,
        lr=float(lr),
        min_lr=min_lr,
        weight_decay=group_config.weight_decay * wd_mult,
        wd_mult=wd_mult,
        params=params,
        param_names=tuple(qualified_names(p, num_chunks)[0] for p in params),
        all_names=tuple(qualified_names(p, num_chunks) for p in params),
        start_wd=_wd_bound(override, "start_wd"),
        end_wd=_wd_bound(override, "end_wd"),
        auto_routed=part.auto_routed,
        flatten=part.flatten,
    )


def _wd_bound(override: Mapping[str, Any], name: str) -> float | None:
    """``start_wd``/``end_wd`` for the torch group: set by the override, or ``None`` for the scheduler's.

    An override's ``weight_decay`` (an optzoo extension; Megatron-Core's overrides have none) fills
    a bound it leaves unset, so a scheduler does not silently replace that group's weight decay.
    """
    value = override.get(name)
    if value is None:
        value = override.get("weight_decay")
    return None if value is None else float(value)
