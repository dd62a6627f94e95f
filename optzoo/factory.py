"""``get_optimizer``: routing + resolved configs -> one optimizer for the whole model."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optzoo.optimizers.registry import get_spec
from optzoo.config import OptimizerConfig
from optzoo.groups import OverrideValue, ResolvedGroup, _jsonable, qualified_names, resolve_groups
from optzoo.distributed import (
    DistributedOptimizer,
    Mode,
    ParamSync,
    ShardingPlan,
    check_same_model,
    plan_shards,
    resolve_process_group,
)
from optzoo.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer, MixedPrecisionOptimizer, Part
from optzoo.scalers import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from optzoo.routing import ParamKey, RoutedParam, Routing, named_trainable_parameters


def param_group_map(groups: Sequence[ResolvedGroup], routing: Routing, num_chunks: int) -> dict[str, Any]:
    """``{"param_to_group": {name: index}, "groups": [summary...]}`` for every name (tied too)."""
    mapping: dict[str, int] = {}
    provenance: dict[str, list[str]] = {}
    for group in groups:
        for routed in group.params:
            for name in qualified_names(routed, num_chunks):
                mapping[name] = group.index
                provenance[name] = [f"#{k} {routing.keys[k].describe()}" for k in routed.matched]
                if group.auto_routed:
                    provenance[name].append(group.auto_routed)
    return {
        "param_to_group": mapping,
        "matched_rules": provenance,
        "groups": [group.summary() for group in groups],
    }


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def make_grad_scaler(config: OptimizerConfig, *, device: torch.device | None = None) -> MegatronGradScaler | None:
    """Megatron-Core's choice: ``loss_scale`` -> constant; fp16 without it -> dynamic; else none.

    Example:
        >>> make_grad_scaler(OptimizerConfig(lr=1.0, fp16=True)).scale.item() == 2.0**32
        True
        >>> make_grad_scaler(OptimizerConfig(lr=1.0, bf16=True)) is None
        True
    """
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device=device)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=int(config.loss_scale_window),
            hysteresis=config.hysteresis,
            device=device,
        )
    return None


def _check_precision(config: OptimizerConfig, groups: list[ResolvedGroup]) -> None:
    """Parameter dtypes must fit fp16/bf16 (and bf16 remainders need bf16 params)."""
    expected = torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else None
    for group in groups:
        for routed, name in zip(group.params, group.param_names):
            dtype = routed.param.dtype
            if dtype in _LOW_PRECISION and expected is not None and dtype != expected:
                raise ValueError(
                    f"`{name}`: parameter dtype does not match the config; got {dtype} with "
                    f"{'fp16' if config.fp16 else 'bf16'}=True; expected {expected} or torch.float32"
                )
            if config.store_param_remainders and config.use_precision_aware_optimizer and dtype != torch.bfloat16:
                raise ValueError(
                    f"`{name}`: store_param_remainders needs bf16 parameters; got {dtype}; "
                    "expected torch.bfloat16 (or store_param_remainders=False)"
                )


def _main_params(
    config: OptimizerConfig,
    groups: list[ResolvedGroup],
    *,
    parts: Sequence[Sequence[Part]],
    local: Sequence[Sequence[tuple[int, RoutedParam]]],
) -> dict[tuple[int, int], torch.Tensor]:
    """The tensor the inner optimizer steps for each local param, by (group index, position).

    fp32 copies of fp16/bf16 params under ``fp16``/``bf16``; the model param itself otherwise,
    and under the precision-aware optimizer (which keeps its own master state). A param sharded
    by elements is stood for by a flat view of its range (sharing the model's storage), or an
    fp32 copy of that range.
    """
    copy_16bit = (config.fp16 or config.bf16) and not config.use_precision_aware_optimizer
    mains: dict[tuple[int, int], torch.Tensor] = {}
    for group, members, group_parts in zip(groups, local, parts):
        for (position, routed), part in zip(members, group_parts):
            param = routed.param
            if part is not None and not param.is_contiguous():
                raise ValueError(
                    f"`{group.param_names[position]}`: sharding by elements needs a contiguous parameter; "
                    f"got strides {param.stride()}; expected a contiguous tensor"
                )
            view = param.detach() if part is None else param.detach().view(-1)[part[0] : part[1]]
            if copy_16bit and param.dtype in _LOW_PRECISION:
                main = torch.nn.Parameter(view.to(torch.float32), requires_grad=False)
            elif part is None:
                main = param
            else:
                main = torch.nn.Parameter(view, requires_grad=False)  # shares the model's storage
            if main is not param:
                main.__dict__.update(param.__dict__)  # keep routing attributes visible to algorithms
            mains[(group.index, position)] = main
    return mains


def fsdp_process_group(groups: Sequence[ResolvedGroup]) -> dist.ProcessGroup | None:
    """The group over which FSDP2 (``fully_shard``) shards the params, or ``None`` without DTensors.

    Every DTensor param must live on the same 1-D device mesh (what ``fully_shard`` builds for
    plain data parallelism); HSDP's 2-D meshes and tensor parallelism are not supported.
    """
    meshes: dict[Any, str] = {}
    for group in groups:
        for routed, name in zip(group.params, group.param_names):
            if isinstance(routed.param, DTensor):
                meshes.setdefault(routed.param.device_mesh, name)
    if not meshes:
        return None
    if len(meshes) > 1 or next(iter(meshes)).ndim != 1:
        described = ", ".join(f"{mesh} (first: `{name}`)" for mesh, name in meshes.items())
        raise ValueError(
            f"`model_chunks`: DTensor params must share one 1-D device mesh (FSDP2 data parallelism); "
            f"got {described}; expected fully_shard over a single 1-D mesh"
        )
    group = next(iter(meshes)).get_group()
    assert isinstance(group, dist.ProcessGroup)
    return group


def get_optimizer(
    config: OptimizerConfig,
    model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    config_overrides: Mapping[ParamKey, OverrideValue] | None = None,
    *,
    dump_param_to_param_group_map: str | os.PathLike[str] | None = None,
    strict: bool = False,
    params_have_main_grad: bool = False,
    process_group: dist.ProcessGroup | None = None,
    param_sync: ParamSync = "all_gather",
    pg_collection: Any = None,
) -> MixedPrecisionOptimizer:
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
        params_have_main_grad: Gradients live in ``param.main_grad`` (a DDP-style fp32
            buffer) instead of ``param.grad``.
        process_group: The data-parallel group the distributed optimizers shard over (default:
            the world). Only with ``use_distributed_optimizer`` or
            ``use_layer_wise_distributed_optimizer``.
        param_sync: How updated params reach every rank under those flags: ``all_gather``
            (default) or ``broadcast``.
        pg_collection: Megatron-Core's ``ProcessGroupCollection`` (or any object with a ``dp_cp``
            or ``dp`` process group): its data-parallel group is used as ``process_group``.

    Returns:
        A :class:`Float16OptimizerWithFloat16Params` when ``fp16``/``bf16`` (fp32 main copies of
        16-bit params), else an :class:`FP32Optimizer`; under ``use_distributed_optimizer`` or
        ``use_layer_wise_distributed_optimizer`` an :class:`optzoo.distributed.DistributedOptimizer`
        over this rank's shards. ``step()`` returns
        ``(success, grad_norm, num_zeros)`` and skips inf/NaN steps.

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

    _check_precision(config, groups)
    if pg_collection is not None:
        if process_group is not None:
            raise ValueError(
                "`pg_collection`: gives the data-parallel group, and so does `process_group`; got both; "
                "expected only one of them"
            )
        process_group = getattr(pg_collection, "dp_cp", None) or getattr(pg_collection, "dp", None)
        if not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(
                f"`pg_collection`: has no data-parallel process group; got {type(pg_collection).__name__} "
                f"with dp_cp/dp = {process_group!r}; expected a torch.distributed.ProcessGroup in `dp_cp` or `dp`"
            )
    distributed = config.use_distributed_optimizer or config.use_layer_wise_distributed_optimizer
    if process_group is not None and not distributed:
        raise ValueError(
            "`process_group`: only used by the distributed optimizers; got a process group with "
            "use_distributed_optimizer=False and use_layer_wise_distributed_optimizer=False; "
            "expected one of them True, or process_group=None"
        )
    plan: ShardingPlan | None = None
    if distributed:
        flag = "use_layer_wise_distributed_optimizer" if config.use_layer_wise_distributed_optimizer else "use_distributed_optimizer"
        process_group = resolve_process_group(process_group, flag)
        if fsdp_process_group(groups) is not None:
            raise ValueError(
                f"`{flag}`: FSDP2 (fully_shard) already shards params and optimizer state; got DTensor "
                f"params with {flag}=True; expected {flag}=False with FSDP2"
            )
        check_same_model(groups, process_group)
        mode: Mode = "layer_wise" if config.use_layer_wise_distributed_optimizer else "sharded"
        plan = plan_shards(groups, dist.get_world_size(process_group), mode)
        owned = {(s.group, s.index): s for s in plan.owned(dist.get_rank(process_group))}
        local_params = [[(k, r) for k, r in enumerate(g.params) if (g.index, k) in owned] for g in groups]
        parts = [[owned[(g.index, k)].part for k, _ in local_params[g.index]] for g in groups]
    else:
        process_group = fsdp_process_group(groups)
        local_params = [list(enumerate(g.params)) for g in groups]
        parts = [[None] * len(g.params) for g in groups]
    mains = _main_params(config, groups, parts=[[p for p in part] for part in parts], local=local_params)
    torch_groups = []
    for group, members in zip(groups, local_params):
        torch_group = group.torch_param_group([mains[(group.index, k)] for k, _ in members])
        torch_group["param_names"] = [group.param_names[k] for k, _ in members]
        torch_groups.append(torch_group)
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
    wrapper = Float16OptimizerWithFloat16Params if config.fp16 or config.bf16 else FP32Optimizer
    precision_aware = config.use_precision_aware_optimizer
    device = groups[0].params[0].param.device
    common: dict[str, Any] = dict(
        model_params=[[r.param for _, r in members] for members in local_params],
        model_parts=parts,
        config=config,
        grad_scaler=make_grad_scaler(config, device=device),
        params_have_main_grad=params_have_main_grad,
        decoupled_grad_dtype=config.main_grads_dtype if precision_aware else None,
        aliases=aliases,
        process_group=process_group,
        device=device,
    )
    optimizer: MixedPrecisionOptimizer
    if plan is not None:
        optimizer = DistributedOptimizer(
            inner,
            torch_groups,
            plan=plan,
            full_param_names=[g.param_names for g in groups],
            all_params={name: r.param for g in groups for r, name in zip(g.params, g.param_names)},
            param_sync=param_sync,
            **common,
        )
    else:
        optimizer = wrapper(inner, torch_groups, **common)

    if dump_param_to_param_group_map is not None:
        path = Path(dump_param_to_param_group_map)
        path.write_text(json.dumps(param_group_map(groups, routing, len(chunks)), indent=2) + "\n")
    if config.config_logger_dir:
        directory = Path(config.config_logger_dir)
        directory.mkdir(parents=True, exist_ok=True)
        dumped = {k: _jsonable(v) for k, v in vars(config).items()}
        (directory / "optimizer_config.json").write_text(json.dumps(dumped, indent=2) + "\n")
    return optimizer
