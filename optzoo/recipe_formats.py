"""Routing recipes in other projects' shapes: Megatron-LM's ``overrides_config`` (read and
written) and torchtitan's ordered regex ``param_groups`` (written), exactly or refused by name.

Megatron-LM's recipe shape, ``overrides_config``, read into optzoo's rules and written from them,
exactly or refused by name.

**Megatron-LM** (``OptimizerConfig.overrides_config``, NVIDIA/Megatron-LM PR #5925 for issue #5685;
read in ``megatron/core/optimizer/__init__.py``: ``get_optimizer_overrides_from_config`` parses it,
``_get_param_groups`` resolves it; the PR is open and not on Megatron-LM's main branch as of
d98e8a6, 2026-08-22: this follows the PR's code as published)::

    optimizers:                  # named instances: one algorithm each
      adam: {type: adam, kwargs: {}, param_groups: {default: {}, no_decay: {wd_mult: 0.0}}}
      muon: {type: muon, param_groups: {hidden: {max_lr: 0.02}}}
    default: {optimizer: adam, param_group: default}      # every param no matcher selects
    matchers:                    # enabled glob matchers, each selecting one (instance, group)
      fc: {type: glob, pattern: "*.linear_fc*.weight", optimizer: muon, param_group: hidden, enabled: true}

A param goes to the one target its enabled matchers select (two different targets: Megatron
refuses the param), else to ``default``; the recipe replaces Megatron's standard overrides. In
optzoo the default's algorithm is ``config.optimizer`` (with ``standard_overrides=False``), each
run of matchers with one target is a ``ParamKey(name=...)`` whose override is the target's
group fields (plus ``optimizer`` when it is not the default's), and a default group with fields
is a last rule ``ParamKey(name="*", exclude=ParamKey(name=<every pattern>))``. What optzoo
cannot hold is refused by name: constructor ``kwargs``, group fields other than Megatron's
scheduler keys, two instances of one algorithm, disabled matchers, unused groups, and matchers
that may select one param for two targets without optzoo refusing it too (optzoo merges rules).

torchtitan's ordered regex ``param_groups`` written from optzoo's rules, exactly or refused by name.

**torchtitan** (``OptimizersContainer.Config.param_groups``, torchtitan 0.3.0 and main at b5bcd76,
2026-08-21, ``torchtitan/components/optimizer/optimizer.py``: ``ParamGroupConfig`` and
``OptimizersContainer._build_param_groups``): a list of ``{pattern, optimizer_name,
optimizer_kwargs}``; a param goes to the first entry whose regex ``re.search`` finds in its name,
every entry must take a param, and each entry's kwargs are complete (``lr``, ``betas``, ``eps``,
``weight_decay``). optzoo's rules merge instead, so the export orders them (a rule whose override
covers another's comes first), refuses two rules that may share a param when neither covers the
other, and checks the result against optzoo's own routing on the model.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from optzoo._common import conflicting_field, did_you_mean, key_field_shown, override_covers
from optzoo.config import SCHEDULE_KEYS, OptimizerConfig, canonical_optimizer_name, field_habit
from optzoo.config_file import _yaml_dump, _yaml_load
from optzoo.groups import OverrideValue, ResolvedGroup, normalize_overrides, resolve_group_configs
from optzoo.optimizers.registry import registered_names
from optzoo.routing import ParamKey
from optzoo.routing.globs import glob_regex, globs_may_overlap

__all__ = [
    "MEGATRON_GROUP_FIELDS",
    "MegatronNames",
    "MegatronRecipe",
    "TORCHTITAN_OVERRIDE_FIELDS",
    "dump_megatron_yaml",
    "megatron_from_overrides",
    "overrides_from_megatron",
    "parse_megatron_yaml",
    "torchtitan_param_groups",
]

MEGATRON_GROUP_FIELDS: tuple[str, ...] = SCHEDULE_KEYS
"""Fields a Megatron recipe's param group may set that optzoo reads the same way: Megatron's
``ParamGroupOverride`` (``megatron/core/optimizer_param_scheduler.py``) without ``optimizer``,
which a recipe group may not set (the instance's ``type`` says it)."""

_TOP = ("optimizers", "default", "matchers")
_INSTANCE = ("type", "kwargs", "param_groups")
_MATCHER = ("type", "pattern", "optimizer", "param_group", "enabled")
# Megatron refuses these in a recipe group (get_optimizer_overrides_from_config's protected fields).
_PROTECTED = ("params", "optimizer", "optimizer_instance", "optimizer_kwargs", "param_group",
              "param_group_kwargs", "default_config", "is_expert_parallel")  # fmt: skip





@dataclass(frozen=True)
class MegatronNames:
    """The names a Megatron recipe gives what optzoo keeps unnamed, so writing back what was read
    gives the same document. :func:`megatron_from_overrides` makes names up without one."""

    instances: tuple[tuple[str, str, bool], ...]
    """``(alias, type as written, whether it had a kwargs key)`` per instance, in order."""
    groups: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...]
    """``(alias, group name, fields)`` per param group, in order."""
    matchers: tuple[tuple[str, str], ...]
    """``(pattern, matcher name)`` per matcher, in order."""
    has_matchers: bool = True
    """Whether the document had a ``matchers`` key (an absent one reads as no matchers)."""


class MegatronRecipe(NamedTuple):
    """What :func:`overrides_from_megatron` reads: optzoo's config, rules and the recipe's names."""

    config: OptimizerConfig
    config_overrides: dict[ParamKey, dict[str, Any]]
    names: MegatronNames


def _path_error(path: str, problem: str, got: Any, expected: str) -> ValueError:
    return ValueError(f"`{path}`: {problem}; got {got!r}; expected {expected}")


def _mapping(value: Any, path: str, expected: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _path_error(path, "must be a mapping", value, expected)
    for key in value:
        if not isinstance(key, str) or not key:
            raise _path_error(path, "keys must be non-empty strings", key, "names such as 'adam'")
    return value


def _known_fields(value: Mapping[str, Any], path: str, allowed: Sequence[str]) -> None:
    for field in value:
        if field not in allowed:
            raise _path_error(path, "unsupported field", field, f"one of {list(allowed)}{did_you_mean(field, allowed)}")


def _group_fields(group: Mapping[str, Any], path: str) -> dict[str, Any]:
    for field, value in group.items():
        if field in _PROTECTED:
            raise _path_error(f"{path}.{field}", "a protected field Megatron refuses in a recipe group", field,
                              f"one of {list(MEGATRON_GROUP_FIELDS)} (the instance's type is the group's optimizer)")  # fmt: skip
        if field not in MEGATRON_GROUP_FIELDS:
            hint = f" ({field_habit(field)} is optzoo's per-algorithm field, which Megatron's groups do not name)" if field_habit(field) else ""
            raise _path_error(f"{path}.{field}", "a param-group key optzoo does not read the same way", field,
                              f"one of {list(MEGATRON_GROUP_FIELDS)}{hint}")  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _path_error(f"{path}.{field}", "must be a finite number", value, "e.g. 0.0")
    return dict(group)


def overrides_from_megatron(document: Any, config: OptimizerConfig | None = None) -> MegatronRecipe:
    """optzoo's ``(config, config_overrides)`` for a Megatron ``overrides_config`` mapping.

    Args:
        document: The parsed YAML (``optimizers``, ``default``, ``matchers``).
        config: The base config to keep (lr, betas, ...); default ``OptimizerConfig()``. Its
            ``optimizer`` becomes the default target's type and ``standard_overrides`` False, as
            a recipe replaces Megatron's standard overrides.

    Raises:
        ValueError: What Megatron refuses (unknown field, missing ``default``, unknown target,
            duplicate pattern, ...) and what optzoo cannot hold exactly; each message names the
            entry (``overrides_config.matchers.fc1.enabled``), the field and the allowed values.

    Example:
        >>> recipe = overrides_from_megatron({
        ...     "optimizers": {"adam": {"type": "adam", "param_groups": {"default": {}, "no_decay": {"wd_mult": 0.0}}}},
        ...     "default": {"optimizer": "adam", "param_group": "default"},
        ...     "matchers": {"bias": {"type": "glob", "pattern": "*.bias", "optimizer": "adam",
        ...                           "param_group": "no_decay", "enabled": True}}})
        >>> [(key.describe(), override) for key, override in recipe.config_overrides.items()]
        [("name='*.bias'", {'wd_mult': 0.0})]
    """
    root = "overrides_config"
    recipe = _mapping(document, root, "a mapping with keys 'optimizers', 'default' and 'matchers'")
    _known_fields(recipe, root, _TOP)
    optimizers = _mapping(recipe.get("optimizers", {}), f"{root}.optimizers", "named optimizer instances")
    if not optimizers:
        raise _path_error(f"{root}.optimizers", "must not be empty", dict(optimizers), "at least one instance, e.g. {adam: {type: adam, param_groups: {default: {}}}}")
    instances: list[tuple[str, str, bool]] = []
    groups: list[tuple[str, str, tuple[tuple[str, Any], ...]]] = []
    type_of: dict[str, str] = {}
    fields_of: dict[tuple[str, str], dict[str, Any]] = {}
    alias_of_type: dict[str, str] = {}
    for alias, raw in optimizers.items():
        path = f"{root}.optimizers.{alias}"
        instance = _mapping(raw, path, "a mapping with keys 'type', 'kwargs' and 'param_groups'")
        _known_fields(instance, path, _INSTANCE)
        kind = instance.get("type")
        if not isinstance(kind, str) or not kind:
            raise _path_error(f"{path}.type", "must be a non-empty string", kind, "an optimizer name such as 'adam' or 'muon'")
        canonical = canonical_optimizer_name(kind)
        if canonical not in registered_names():
            raise _path_error(f"{path}.type", "not an optzoo optimizer", kind, f"one of {registered_names()}{did_you_mean(kind, registered_names())}")
        if canonical in alias_of_type:
            raise _path_error(f"{path}.type", f"a second instance of {canonical!r} (first: {alias_of_type[canonical]!r}); "
                              "optzoo runs one instance per algorithm", kind, "one instance per type")  # fmt: skip
        alias_of_type[canonical] = alias
        kwargs = _mapping(instance.get("kwargs", {}), f"{path}.kwargs", "{}")
        if kwargs:
            raise _path_error(f"{path}.kwargs", "constructor kwargs go to the emerging-optimizers class by its own names, "
                              "which optzoo does not build", dict(kwargs), "{} (set optzoo config fields such as muon_momentum in the config)")  # fmt: skip
        param_groups = _mapping(instance.get("param_groups", {}), f"{path}.param_groups", "named param groups")
        if not param_groups:
            raise _path_error(f"{path}.param_groups", "must not be empty", dict(param_groups), "at least one group, e.g. {default: {}}")
        seen: dict[tuple[tuple[str, Any], ...], str] = {}
        for name, raw_group in param_groups.items():
            group_path = f"{path}.param_groups.{name}"
            fields = _group_fields(_mapping(raw_group, group_path, "a mapping of fields such as {wd_mult: 0.0}"), group_path)
            frozen = tuple(sorted(fields.items()))
            if frozen in seen:
                raise _path_error(group_path, f"the same fields as group {seen[frozen]!r}; optzoo groups params by their "
                                  "settings, so both would be one group", fields, "distinct fields per group")  # fmt: skip
            seen[frozen] = name
            fields_of[(alias, name)] = fields
            groups.append((alias, name, tuple(fields.items())))
        type_of[alias] = canonical
        instances.append((alias, kind, "kwargs" in instance))

    def target(raw: Any, path: str) -> tuple[str, str]:
        selected = _mapping(raw, path, "{optimizer: <instance>, param_group: <group>}")
        _known_fields(selected, path, ("optimizer", "param_group"))
        alias, group = selected.get("optimizer"), selected.get("param_group")
        if alias not in type_of:
            raise _path_error(f"{path}.optimizer", "unknown optimizer instance", alias, f"one of {list(type_of)}")
        if (alias, group) not in fields_of:
            known = [g for a, g in fields_of if a == alias]
            raise _path_error(f"{path}.param_group", f"unknown param group of {alias!r}", group, f"one of {known}")
        return alias, str(group)

    if "default" not in recipe:
        raise _path_error(root, "missing the required 'default'", sorted(recipe), "default: {optimizer: <instance>, param_group: <group>}")
    default = target(recipe["default"], f"{root}.default")
    matchers = _mapping(recipe.get("matchers", {}), f"{root}.matchers", "named matchers")
    runs: list[tuple[tuple[str, str], list[str], str]] = []  # (target, patterns, first matcher's name)
    named: list[tuple[str, str]] = []
    for name, raw in matchers.items():
        path = f"{root}.matchers.{name}"
        matcher = _mapping(raw, path, "a mapping with keys " + str(list(_MATCHER)))
        _known_fields(matcher, path, _MATCHER)
        if matcher.get("enabled", False) is not True:
            raise _path_error(f"{path}.enabled", "a disabled matcher (Megatron skips it) has no optzoo rule to become",
                              matcher.get("enabled", "<missing: false>"), "true, or the matcher removed")  # fmt: skip
        if matcher.get("type") != "glob":
            raise _path_error(f"{path}.type", "unsupported matcher type", matcher.get("type"), "'glob'")
        pattern = matcher.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise _path_error(f"{path}.pattern", "must be a non-empty string", pattern, "a glob such as '*.linear_fc1.weight'")
        if any(pattern == p for p, _ in named):
            first = next(n for p, n in named if p == pattern)
            raise _path_error(f"{path}.pattern", f"duplicates the pattern of matcher {first!r}", pattern, "each pattern once")
        selected = target({"optimizer": matcher.get("optimizer"), "param_group": matcher.get("param_group")}, path)
        named.append((pattern, name))
        if runs and runs[-1][0] == selected:
            runs[-1][1].append(pattern)
        else:
            runs.append((selected, [pattern], name))
    used = {default} | {selected for selected, _, _ in runs}
    for alias, group, _ in groups:
        if (alias, group) not in used:
            raise _path_error(f"{root}.optimizers.{alias}.param_groups.{group}", "selected by no matcher nor the default, "
                              "so optzoo has no rule to keep it by", group, "a matcher or the default selecting it, or the group removed")  # fmt: skip

    base_type = type_of[default[0]]

    def override(selected: tuple[str, str]) -> dict[str, Any]:
        kind = type_of[selected[0]]
        return {**({} if kind == base_type else {"optimizer": kind}), **fields_of[selected]}

    _check_single_target(
        [(f"matcher {run_name!r}", patterns, override(selected)) for selected, patterns, run_name in runs],
        f"{root}.matchers", "Megatron refuses such a param (two targets) while optzoo would merge the settings",
    )
    overrides: dict[ParamKey, dict[str, Any]] = {}
    for selected, patterns, _ in runs:
        overrides[ParamKey(name=patterns[0] if len(patterns) == 1 else tuple(patterns))] = override(selected)
    if fields_of[default]:
        every = tuple(pattern for pattern, _ in named)
        exclude = ParamKey(name=every[0] if len(every) == 1 else every) if every else None
        overrides[ParamKey(name="*", exclude=exclude)] = dict(fields_of[default])
    base = dataclasses.replace(config or OptimizerConfig(), optimizer=base_type, standard_overrides=False)
    names = MegatronNames(tuple(instances), tuple(groups), tuple(named), "matchers" in recipe)
    return MegatronRecipe(base, overrides, names)


def parse_megatron_yaml(text: str, config: OptimizerConfig | None = None, *, where: str = "overrides_config") -> MegatronRecipe:
    """:func:`overrides_from_megatron` of YAML text (read as YAML 1.2, duplicate keys refused)."""
    return overrides_from_megatron(_yaml_load(text, where), config)


def dump_megatron_yaml(document: Mapping[str, Any]) -> str:
    """A Megatron ``overrides_config`` mapping (:func:`megatron_from_overrides`) as YAML text."""
    return _yaml_dump(dict(document))


def _check_single_target(rules: Sequence[tuple[str, Sequence[str], Mapping[str, Any]]], where: str, why: str) -> None:
    """Refuse two rules with different settings whose globs may share a name when optzoo's merge
    would not refuse that name itself (no field they both set differently)."""
    for i, (name_a, globs_a, override_a) in enumerate(rules):
        for name_b, globs_b, override_b in rules[i + 1 :]:
            if override_covers(override_a, override_b) and override_covers(override_b, override_a):
                continue
            if conflicting_field(override_a, override_b) is not None:
                continue  # optzoo refuses a param both match, as the other side does
            pair = next(((a, b) for a in globs_a for b in globs_b if globs_may_overlap(a, b)), None)
            if pair is not None:
                raise ValueError(
                    f"`{where}`: {name_a} ({pair[0]!r}, {dict(override_a)}) and {name_b} ({pair[1]!r}, "
                    f"{dict(override_b)}) may match one param; {why}; got globs that can overlap; "
                    "expected globs no name matches both, or settings that conflict on a field"
                )


def megatron_from_overrides(
    config: OptimizerConfig,
    config_overrides: Mapping[ParamKey, OverrideValue] | None,
    names: MegatronNames | None = None,
) -> dict[str, Any]:
    """A Megatron ``overrides_config`` mapping for optzoo's ``(config, config_overrides)``.

    Each rule becomes one matcher per glob, selecting the group of its settings under the
    instance of its algorithm; ``config.optimizer`` with no fields is the default (or the last
    rule ``name="*"`` excluding every other glob, as :func:`overrides_from_megatron` writes it).

    Args:
        config: Gives the default's algorithm; must have ``standard_overrides=False`` (a recipe
            replaces Megatron's standard overrides, which optzoo would lay under the rules).
        config_overrides: Rules selecting by name globs only, setting ``optimizer`` and
            Megatron's scheduler keys (:data:`MEGATRON_GROUP_FIELDS`).
        names: The names read with :func:`overrides_from_megatron`, to write the same document;
            default: instances named by their type, groups ``default``, ``group1``, ...

    Raises:
        ValueError: Anything the recipe cannot say, naming the rule, the field and what is allowed.
    """
    where = "config_overrides"
    if config_overrides is None:
        raise ValueError(f"`{where}`: None means optzoo's standard overrides (by predicate), which a Megatron recipe "
                         "cannot name; got None; expected a dict of rules ({} for none)")  # fmt: skip
    if config.standard_overrides:
        raise ValueError("`config.standard_overrides`: True lays optzoo's standard overrides (no decay on 1-D params, by "
                         "predicate) under the rules, which Megatron's recipe replaces; got True; expected False")  # fmt: skip
    rules = normalize_overrides(config, config_overrides)
    base_type = config.optimizer
    items = list(rules.items())
    default_fields: dict[str, Any] = {}
    if items and _is_catch_all(items[-1][0], [key for key, _ in items[:-1]]):
        key, default_fields = items.pop()
        subject = f"{where} rule #{len(items)} {key.describe()}"
        if "optimizer" in default_fields:
            raise ValueError(f"`{subject}`: the catch-all rule sets optimizer; got {default_fields['optimizer']!r}; "
                             "expected the default's algorithm in config.optimizer")  # fmt: skip
        for field in default_fields:
            if field not in MEGATRON_GROUP_FIELDS:
                raise ValueError(f"`{subject}`: a Megatron param group sets scheduler keys only; got {field!r}; "
                                 f"expected one of {list(MEGATRON_GROUP_FIELDS)}")  # fmt: skip
    checked: list[tuple[str, Sequence[str], Mapping[str, Any]]] = []
    for index, (key, override) in enumerate(items):
        subject = f"{where} rule #{index} {key.describe()}"
        _name_globs_only(subject, key, [(key, "")], "a Megatron matcher selects by one name glob", "name=... only")
        if key.exclude is not None:
            raise ValueError(f"`{subject}`: a Megatron matcher has no exclude; got exclude=({key.exclude.describe()}); expected no exclude")
        for field in override:
            if field != "optimizer" and field not in MEGATRON_GROUP_FIELDS:
                raise ValueError(f"`{subject}`: a Megatron param group sets scheduler keys only; got {field!r}; "
                                 f"expected one of {['optimizer', *MEGATRON_GROUP_FIELDS]}")  # fmt: skip
        for glob in _names(key.name):
            earlier = next((label for label, globs, _ in checked if glob in globs), None)
            if earlier is not None or _names(key.name).count(glob) > 1:
                raise ValueError(f"`{subject}`: a glob Megatron would see twice (it refuses a duplicate enabled pattern); "
                                 f"got {glob!r} also in {earlier or 'this rule'}; expected each glob in one rule, once")  # fmt: skip
        checked.append((f"rule #{index} {key.describe()}", _names(key.name), override))
    _check_single_target(checked, where, "optzoo merges their settings while Megatron refuses a param with two targets")

    def target_of(override: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, Any], ...]]:
        fields = {k: v for k, v in override.items() if k != "optimizer"}
        return override.get("optimizer", base_type), tuple(sorted(fields.items()))

    default_target = (base_type, tuple(sorted(default_fields.items())))
    targets = [target_of(override) for _, override in items]
    order = list(dict.fromkeys([default_target, *targets]))
    kinds = list(dict.fromkeys(kind for kind, _ in order))
    known = names or MegatronNames((), (), (), True)
    written = {canonical_optimizer_name(kind): (alias, kind, has_kwargs) for alias, kind, has_kwargs in known.instances}
    kind_of = {alias: canonical_optimizer_name(kind) for alias, kind, _ in known.instances}
    recorded_group = {(kind_of[a], tuple(sorted(f))): (i, g) for i, (a, g, f) in enumerate(known.groups) if a in kind_of}
    recorded_matcher = dict(known.matchers)

    # Recorded names first, then fresh ones that take no name already given.
    instance_order = [kind for kind in written if kind in kinds] + [kind for kind in kinds if kind not in written]
    alias: dict[str, str] = {}
    for kind in instance_order:
        alias[kind] = written[kind][0] if kind in written else _fresh(kind, set(alias.values()))
    group_name: dict[tuple[str, tuple[tuple[str, Any], ...]], str] = {}
    number = {t: i for i, t in enumerate((t for t in order if t != default_target), start=1)}  # by first appearance
    optimizers: dict[str, Any] = {}
    for kind in instance_order:
        wanted = sorted((t for t in order if t[0] == kind), key=lambda t: recorded_group.get(t, (len(recorded_group), ""))[0])
        taken: set[str] = set()
        for selected in sorted(wanted, key=lambda t: t not in recorded_group):
            if selected in recorded_group:
                group_name[selected] = recorded_group[selected][1]
            else:
                fresh = "default" if selected == default_target else f"group{number[selected]}"
                group_name[selected] = _fresh(fresh, taken | {recorded_group[t][1] for t in wanted if t in recorded_group})
            taken.add(group_name[selected])
        instance: dict[str, Any] = {"type": written[kind][1] if kind in written else kind}
        if kind in written and written[kind][2]:
            instance["kwargs"] = {}
        instance["param_groups"] = {group_name[selected]: dict(selected[1]) for selected in wanted}
        optimizers[alias[kind]] = instance
    document: dict[str, Any] = {
        "optimizers": optimizers,
        "default": {"optimizer": alias[base_type], "param_group": group_name[default_target]},
    }
    matchers: dict[str, Any] = {}
    for (key, _), selected in zip(items, targets):
        for pattern in _names(key.name):
            name = recorded_matcher.get(pattern)
            if name is None or name in matchers:
                name = _fresh(f"{group_name[selected]}_1", set(matchers) | set(recorded_matcher.values()))
            matchers[name] = {"type": "glob", "pattern": pattern, "optimizer": alias[selected[0]],
                              "param_group": group_name[selected], "enabled": True}  # fmt: skip
    if matchers or names is None or names.has_matchers:
        document["matchers"] = matchers
    return document


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name`` with the first free number: a written recipe never names two things alike."""
    stem, number = (name[: -len("_1")], 1) if name.endswith("_1") else (name, 1)
    while name in taken:
        number += 1
        name = f"{stem}_{number}"
    return name


def _is_catch_all(key: ParamKey, others: Sequence[ParamKey]) -> bool:
    """``key`` is the default rule :func:`overrides_from_megatron` writes: ``name="*"`` excluding
    exactly every glob of the rules before it, in order."""
    globs = tuple(glob for other in others for glob in _names(other.name))
    if key.name != "*" or any(_names(getattr(key, f)) for f in ("attr", "predicate", "with_name_predicate", "role")):
        return False
    if key.exclude is None:
        return not globs
    exclude = key.exclude
    plain = not any(_names(getattr(exclude, f)) for f in ("attr", "predicate", "with_name_predicate", "role"))
    return plain and _names(exclude.name) == globs


def _names(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return value if isinstance(value, tuple) else (value,)


def _name_globs_only(subject: str, key: ParamKey, selectors: Sequence[tuple[ParamKey, str]], why: str, expected: str) -> None:
    """Refuse a key that selects by anything but name globs (attributes, predicates, roles), or by none."""
    for owner, prefix in selectors:
        for field in ("attr", "predicate", "with_name_predicate", "role"):
            if _names(getattr(owner, field)):
                raise ValueError(f"`{subject}`: {why}; got {prefix}{key_field_shown(owner, field)}; expected {expected}")
    if not _names(key.name):
        raise ValueError(f"`{subject}`: selects by no name glob; got {key.describe()}; expected name=...")


# ---- torchtitan ----------------------------------------------------------------------------


TORCHTITAN_OVERRIDE_FIELDS: tuple[str, ...] = (
    "optimizer", "lr", "max_lr", "weight_decay", "wd_mult", "adam_beta1", "adam_beta2", "adam_eps", "decoupled_weight_decay",
)  # fmt: skip
"""Override fields a torchtitan param group can carry exactly: its AdamW/Adam kwargs."""


def _adam_kwargs(group: ResolvedGroup) -> tuple[str, dict[str, Any]]:
    config = group.config
    name = "AdamW" if config.decoupled_weight_decay else "Adam"
    return name, {"lr": group.lr, "betas": [config.adam_beta1, config.adam_beta2], "eps": config.adam_eps,
                  "weight_decay": group.weight_decay}  # fmt: skip


def torchtitan_param_groups(
    config: OptimizerConfig,
    config_overrides: Mapping[ParamKey, OverrideValue] | None,
    model: torch.nn.Module,
) -> list[dict[str, Any]]:
    """torchtitan's ``param_groups`` (``ParamGroupConfig`` fields) for optzoo's routing of ``model``.

    Each rule's globs become one regex (:func:`~optzoo.routing.globs.glob_regex`); rules are
    ordered so that first-match-wins gives every param what optzoo's merge gives it, and a last
    ``.*`` entry takes the params no rule selects (when there are any). The result is checked on
    ``model``: each entry takes a param, and every param lands with optzoo's lr, betas, eps and
    weight decay.

    Raises:
        ValueError: A rule torchtitan cannot express (a non-name field, an algorithm other than
            AdamW/Adam, a field outside :data:`TORCHTITAN_OVERRIDE_FIELDS`), two rules that may
            share a param when neither's override covers the other's, a rule that takes no param
            first, standard overrides laid under the rules, or a tied param named two ways.
    """
    where = "config_overrides"
    if config_overrides is None or config.standard_overrides:
        got = "config_overrides=None" if config_overrides is None else "standard_overrides=True"
        raise ValueError(f"`config.standard_overrides`: optzoo's standard overrides select by predicate (1-D params), "
                         f"which a torchtitan regex cannot; got {got}; expected standard_overrides=False and a dict of rules")  # fmt: skip
    rules = list(normalize_overrides(config, config_overrides).items())
    entries: list[tuple[int, ParamKey, dict[str, Any], str]] = []
    for index, (key, override) in enumerate(rules):
        subject = f"{where} rule #{index} {key.describe()}"
        selectors = [(key, "")] + ([(key.exclude, "exclude ")] if key.exclude is not None else [])
        _name_globs_only(subject, key, selectors, "a torchtitan pattern is a regex on the name", "name globs only (and exclude names)")
        for field in override:
            if field not in TORCHTITAN_OVERRIDE_FIELDS:
                raise ValueError(f"`{subject}`: a torchtitan param group holds AdamW's kwargs only; got {field!r}; "
                                 f"expected one of {list(TORCHTITAN_OVERRIDE_FIELDS)}")  # fmt: skip
        algorithm = override.get("optimizer", config.optimizer)
        if algorithm != "adam":
            raise ValueError(f"`{subject}`: torchtitan builds Adam, AdamW and DistMuon (FlexShard only); got optimizer="
                             f"{algorithm!r}; expected 'adam'")  # fmt: skip
        exclude = _names(key.exclude.name) if key.exclude is not None else ()
        entries.append((index, key, override, glob_regex(_names(key.name), exclude)))
    if config.optimizer != "adam":
        raise ValueError(f"`config.optimizer`: torchtitan's catch-all group would need {config.optimizer!r}; got "
                         f"{config.optimizer!r}; expected 'adam'")  # fmt: skip
    ordered = _first_match_order(entries, where)

    groups, _ = resolve_group_configs(config, model, config_overrides)
    group_of = {name: group for group in groups for name in group.param_names}
    tied = [names for group in groups for names in group.all_names if len(names) > 1]
    if tied:
        raise ValueError(f"`{tied[0][0]}`: a tied param; optzoo routes it under every name, torchtitan under its "
                         f"first only; got names {list(tied[0])}; expected untied params")  # fmt: skip
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    claimed: set[str] = set()
    result: list[dict[str, Any]] = []
    pending = [(f"rule #{index} {key.describe()}", pattern) for index, key, _, pattern in ordered] + [("the catch-all", ".*")]
    for label, pattern in pending:
        compiled = re.compile(pattern)
        taken = [name for name in names if name not in claimed and compiled.search(name)]
        if not taken:
            if label == "the catch-all":
                continue
            raise ValueError(f"`{where} {label}`: takes no param of the model first (torchtitan refuses a pattern that "
                             f"matches none); got pattern {pattern!r}; expected a rule that selects a param")  # fmt: skip
        claimed.update(taken)
        first = group_of[taken[0]]
        for name in taken:
            if group_of[name] is not first:
                raise ValueError(f"`{name}`: torchtitan's first match ({label}) puts it with `{taken[0]}`, optzoo's routing "
                                 f"does not; got groups #{group_of[name].index} and #{first.index}; expected one group")  # fmt: skip
        optimizer_name, kwargs = _adam_kwargs(first)
        result.append({"pattern": pattern, "optimizer_name": optimizer_name, "optimizer_kwargs": kwargs})
    return result


def _first_match_order(
    entries: list[tuple[int, ParamKey, dict[str, Any], str]], where: str
) -> list[tuple[int, ParamKey, dict[str, Any], str]]:
    """The rules in an order where first-match-wins equals optzoo's merge: a rule whose override
    covers another's goes first when their globs may share a name; neither covering is refused."""
    before: dict[int, set[int]] = {index: set() for index, *_ in entries}  # rule -> rules that must precede it
    for i, (index_a, key_a, override_a, _) in enumerate(entries):
        for index_b, key_b, override_b, _ in entries[i + 1 :]:
            pair = next((
                (a, b) for a in _names(key_a.name) for b in _names(key_b.name) if globs_may_overlap(a, b)
            ), None)  # fmt: skip
            if pair is None:
                continue
            a_covers, b_covers = override_covers(override_a, override_b), override_covers(override_b, override_a)
            if a_covers and not b_covers:
                before[index_b].add(index_a)
            elif b_covers and not a_covers:
                before[index_a].add(index_b)
            elif not a_covers:
                raise ValueError(
                    f"`{where}`: rule #{index_a} {key_a.describe()} ({override_a}) and rule #{index_b} {key_b.describe()} "
                    f"({override_b}) may match one param ({pair[0]!r} and {pair[1]!r}); optzoo merges them, a first "
                    "match takes one; got neither override covering the other; expected a rule for the shared params "
                    "with both settings, or globs no name matches both"
                )
    ordered: list[tuple[int, ParamKey, dict[str, Any], str]] = []
    remaining = list(entries)
    while remaining:  # stable: the first rule whose predecessors are placed
        placed = {index for index, *_ in ordered}
        entry = next(e for e in remaining if before[e[0]] <= placed)
        ordered.append(entry)
        remaining.remove(entry)
    return ordered

