"""``get_optimizer``: routing + resolved configs -> one optimizer for the whole model."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from optimizers.registry import get_spec
from optzoo.config import OptimizerConfig
from optzoo.groups import OverrideValue, ResolvedGroup, _jsonable, qualified_names, resolve_groups
from optzoo.optimizer import ChainedOptimizer
from routing import ParamKey, Routing, named_trainable_parameters


def param_group_map(groups: Sequence[ResolvedGroup], routing: Routing, num_chunks: int) -> dict[str, Any]:
    """``{"param_to_group": {name: index}, "groups": [summary...]}`` for every name (tied too)."""
    mapping: dict[str, int] = {}
    provenance: dict[str, list[str]] = {}
    for group in groups:
        for routed in group.params:
            for name in qualified_names(routed, num_chunks):
                mapping[name] = group.index
                provenance[name] = [f"#{k} {routing.keys[k].describe()}" for k in routed.matched]
    return {
        "param_to_group": mapping,
        "matched_rules": provenance,
        "groups": [group.summary() for group in groups],
    }


def get_optimizer(
    config: OptimizerConfig,
    model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    config_overrides: Mapping[ParamKey, OverrideValue] | None = None,
    *,
    dump_param_to_param_group_map: str | os.PathLike[str] | None = None,
    strict: bool = False,
) -> ChainedOptimizer:
    """Build one optimizer for every trainable parameter of ``model_chunks``.

    Args:
        config: The base configuration.
        model_chunks: A module or a list of modules.
        config_overrides: ``{ParamKey: override}``; ``None`` (default) applies
            :func:`get_standard_config_overrides`, ``{}`` applies nothing. An override is a dict
            of per-group config fields and schedule keys (``max_lr``, ``min_lr``, ``wd_mult``,
            ``start_wd``, ``end_wd``), or an ``OptimizerConfig`` (its fields that differ from
            ``config``). ``optimizer`` may differ per group.
        dump_param_to_param_group_map: Write ``{name: group index}`` and each group's resolved
            config to this JSON file.
        strict: A key that matches no parameter is an error instead of a warning.

    Returns:
        A :class:`ChainedOptimizer`; ``step()`` returns ``(success, grad_norm, num_zeros)``.

    Raises:
        ValueError: Conflicting overrides, bad override fields or values, ``lr`` unset, or a
            config flag optzoo cannot honour.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> opt = get_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1), model)
        >>> [(g["optimizer"], g["weight_decay"], g["param_names"]) for g in opt.param_groups]
        [('adam', 0.1, ['0.weight']), ('adam', 0.0, ['0.bias', '1.weight', '1.bias'])]
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not named_trainable_parameters(chunks):
        raise ValueError(
            "`model_chunks`: no trainable parameters; got "
            f"{sum(1 for c in chunks for _ in c.parameters())} parameters, none with requires_grad; "
            "expected at least one trainable parameter"
        )
    groups, routing = resolve_groups(config, chunks, config_overrides, strict=strict)

    torch_groups = [group.torch_param_group() for group in groups]
    # One inner optimizer per algorithm and instance-level setting, in order of first use.
    instances: dict[tuple[Any, ...], list[int]] = {}
    for group in groups:
        spec = get_spec(group.optimizer)
        identity = (spec.name, *(getattr(group.config, f) for f in spec.instance_fields))
        instances.setdefault(identity, []).append(group.index)
    inner = []
    for (name, *_), indices in instances.items():
        spec = get_spec(name)
        instance = {f: getattr(groups[indices[0]].config, f) for f in spec.instance_fields}
        inner.append(spec.build([torch_groups[i] for i in indices], instance))

    aliases = {
        names[0]: names
        for group in groups
        for routed in group.params
        if len(names := qualified_names(routed, len(chunks))) > 1
    }
    optimizer = ChainedOptimizer(inner, torch_groups, config=config, aliases=aliases)

    if dump_param_to_param_group_map is not None:
        path = Path(dump_param_to_param_group_map)
        path.write_text(json.dumps(param_group_map(groups, routing, len(chunks)), indent=2) + "\n")
    if config.config_logger_dir:
        directory = Path(config.config_logger_dir)
        directory.mkdir(parents=True, exist_ok=True)
        dumped = {k: _jsonable(v) for k, v in vars(config).items()}
        (directory / "optimizer_config.json").write_text(json.dumps(dumped, indent=2) + "\n")
    return optimizer
