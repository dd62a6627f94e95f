"""``get_optimizer``: routing + resolved configs -> one optimizer for the whole model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from optzoo._common import jsonable
from optzoo.config import OptimizerConfig
from optzoo.distributed.optimizer import DistributedOptimizer, ParamSync
from optzoo.distributed.plan import Mode, ShardingPlan, plan_shards
from optzoo.distributed.setup import (
    ExpertLayout,
    check_same_model,
    check_same_settings,
    collective_settings,
    data_parallel_group,
    distributed_flag,
    expert_data_parallel_group,
    expert_layout,
    is_expert,
    mesh_params,
    replicated_params,
)
from optzoo.groups import OverrideValue, ResolvedGroup, resolve_group_configs
from optzoo.lint import lint_routing, warn_findings
from optzoo.optimizers.registry import get_spec
from optzoo.reporting import param_group_map
from optzoo.routing import ExampleInputs, ParamKey, Routing, named_trainable_parameters
from optzoo.wrapper.mixed_precision import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MixedPrecisionOptimizer,
    StepOptions,
)
from optzoo.wrapper.added_groups import Rerouter, instance_key
from optzoo.wrapper.param_map import ParamMap, build_param_map, check_param_dtypes
from optzoo.wrapper.scalers import make_grad_scaler

__all__ = ["build_inner_optimizers", "get_megatron_optimizer", "get_optimizer", "torch_param_groups"]


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
    expert_process_group: dist.ProcessGroup | None = None,
    lint: bool = True,
    example_inputs: ExampleInputs | Sequence[ExampleInputs | None] | None = None,
    trace: bool = True,
) -> MixedPrecisionOptimizer:
    """Build one optimizer for every trainable parameter of ``model_chunks``.

    Args:
        config: The base configuration.
        model_chunks: A module or a list of modules.
        config_overrides: ``{ParamKey: override}``, laid over the standard overrides
            (:func:`get_standard_config_overrides`: no decay on biases, norms and 1-D params,
            ``decoupled_lr``): where one of your rules and a standard one set a field for a
            parameter, yours wins. ``None`` (default) applies the standard overrides alone. With
            ``config.standard_overrides=False`` a dict is used alone (``{}``: no overrides),
            Megatron-Core's meaning, which :func:`get_megatron_optimizer` always has. An override
            is a dict of per-group config fields and schedule keys (``max_lr``, ``min_lr``,
            ``wd_mult``, ``start_wd``, ``end_wd``), or an ``OptimizerConfig`` (its fields that
            differ from ``config``). ``optimizer`` may differ per group.
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
            or ``dp`` process group): its data-parallel group is used as ``process_group``, and
            its ``expt_dp`` group, if any, as ``expert_process_group``.
        expert_process_group: The expert data-parallel group: under the distributed-optimizer
            flags, expert params (Megatron's ``allreduce=False``, or the ``expert`` role) are owned
            or sharded over it, and the rest over the data-parallel group (Megatron-Core's
            separate expert optimizer). It must lie in the data-parallel group and divide it.
        lint: Run the routing linter (:mod:`optzoo.lint`) and warn once per finding.
        example_inputs: Inputs of one forward of the model, from which each parameter's role is
            read (:func:`optzoo.routing.infer_roles`): a tensor, a tuple of positional inputs or a
            dict of keyword inputs; only shapes and dtypes matter (the forward runs on the meta
            device). Default: made from the model (Hugging Face configs, or the first layer of a
            module taking one tensor); a list with one entry per chunk for several chunks.
        trace: Read roles from the forward (default); ``False`` guesses them from module types
            and names, as when the forward cannot run.

    Returns:
        A :class:`Float16OptimizerWithFloat16Params` when ``fp16``/``bf16`` (fp32 main copies of
        16-bit params), else an :class:`FP32Optimizer`; under ``use_distributed_optimizer`` or
        ``use_layer_wise_distributed_optimizer`` an :class:`optzoo.distributed.DistributedOptimizer`
        over this rank's shards. ``step()`` returns
        ``(success, grad_norm, num_zeros)`` and skips inf/NaN steps.

    Raises:
        ValueError: Conflicting overrides, bad override fields or values, ``lr`` unset, or a
            config flag optzoo cannot honour.

    Warns:
        RoutingLintWarning: A routing that looks wrong (:func:`optzoo.lint.lint_routing`), once per
            finding, naming the parameters and the fix.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> opt = get_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1), model)
        >>> [(g["optimizer"], g["weight_decay"], g["param_names"]) for g in opt.param_groups]
        [('adam', 0.1, ['0.weight']), ('adam', 0.0, ['0.bias', '1.weight', '1.bias'])]
    """
    chunks = _trainable_chunks(model_chunks)
    groups, routing = resolve_group_configs(
        config, chunks, config_overrides, strict=strict, example_inputs=example_inputs, trace=trace
    )
    if lint:
        warn_findings(lint_routing(groups, routing))
    group = data_parallel_group(config, groups, process_group=process_group, pg_collection=pg_collection)
    expert_group = expert_data_parallel_group(
        groups, expert_process_group=expert_process_group, pg_collection=pg_collection, data_parallel=group,
        flag=distributed_flag(config),
    )  # fmt: skip
    plans = _sharding_plans(config, groups, group, expert_group, param_sync)
    replicated: frozenset[int] = frozenset()
    if plans is None and group is not None:  # FSDP2: the params are the ranks' own shards; compare settings
        check_same_settings(groups, group)
        replicated = replicated_params(mesh_params(groups), group)
    check_param_dtypes(config, groups)  # after the exchange: a rank raising before it would leave the others waiting
    owned = None
    if plans is not None:
        assert group is not None  # a plan is made over a group
        owned = plans.plan.parts_owned_by(dist.get_rank(group))
        if plans.expert_plan is not None and plans.expert_layout is not None:
            owned |= plans.expert_plan.parts_owned_by(dist.get_rank(plans.expert_layout.group))
    param_map = build_param_map(config, groups, owned=owned, params_have_main_grad=params_have_main_grad, model_chunks=chunks)
    param_groups = torch_param_groups(groups, param_map)
    inner = build_inner_optimizers(groups, param_groups)
    optimizer = _wrap(config, inner, param_groups, param_map, group, plans, param_sync, device=groups[0].params[0].param.device)
    optimizer.config = config  # Megatron-Core's optimizer.config
    optimizer.replicated = replicated
    optimizer.expert_names = frozenset(name for name, _, expert in mesh_params(groups) if expert)
    optimizer._rerouter = Rerouter(config, chunks, config_overrides, strict, example_inputs, trace)
    optimizer._inner_keys = list(dict.fromkeys(instance_key(g) for g in groups))  # build_inner_optimizers' order
    routed = [(routed, group) for group in groups for routed in group.params]  # build_param_map's order
    optimizer._matrix_views = {
        entry.name: group.matrix_view_of(one.param) for entry, (one, group) in zip(param_map.entries, routed, strict=True)
    }
    optimizer.defaults.update(lr=config.lr, weight_decay=config.weight_decay)  # what torch's constructor arguments would be
    _write_dumps(config, groups, routing, dump_param_to_param_group_map)
    return optimizer


def get_megatron_optimizer(
    config: OptimizerConfig,
    model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    config_overrides: Mapping[ParamKey, OverrideValue] | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: str | os.PathLike[str] | None = None,
) -> MixedPrecisionOptimizer:
    """Megatron-Core's ``get_megatron_optimizer``, with its meaning of ``config_overrides``:
    ``None`` = the standard overrides, a dict (``{}`` included) = that dict alone.

    :func:`get_optimizer` with ``config.standard_overrides=False`` whenever ``config_overrides`` is
    given. ``use_gloo_process_groups`` is accepted either way: optzoo creates no process groups of
    its own (Megatron-Core makes gloo copies for its distributed checkpoints).

    Raises:
        TypeError: ``use_gloo_process_groups`` is not a bool.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1), model, {})
        >>> [(g["weight_decay"], g["param_names"]) for g in opt.param_groups]  # {}: no overrides at all
        [(0.1, ['0.weight', '0.bias', '1.weight', '1.bias'])]
    """
    if not isinstance(use_gloo_process_groups, bool):
        raise TypeError(
            f"`use_gloo_process_groups`: must be a bool; got {use_gloo_process_groups!r}; expected True or False"
        )
    if config_overrides is not None and config.standard_overrides:
        config = config.replace(standard_overrides=False)
    return get_optimizer(
        config, model_chunks, config_overrides, pg_collection=pg_collection, dump_param_to_param_group_map=dump_param_to_param_group_map,
    )  # fmt: skip


def _trainable_chunks(model_chunks: Sequence[torch.nn.Module] | torch.nn.Module) -> list[torch.nn.Module]:
    if isinstance(model_chunks, torch.nn.Module):
        chunks = [model_chunks]
    elif isinstance(model_chunks, (list, tuple)) and model_chunks and all(isinstance(c, torch.nn.Module) for c in model_chunks):
        chunks = list(model_chunks)
    else:
        got = type(model_chunks).__name__ if not isinstance(model_chunks, (list, tuple)) else (
            f"a {type(model_chunks).__name__} of {[type(c).__name__ for c in model_chunks][:5]}"
        )  # fmt: skip
        raise ValueError(f"`model_chunks`: not a module or a list of modules; got {got}; expected an nn.Module or a non-empty list of them")
    if not named_trainable_parameters(chunks):
        raise ValueError(
            "`model_chunks`: no trainable parameters; got "
            f"{sum(1 for c in chunks for _ in c.parameters())} parameters, none with requires_grad; "
            "expected at least one trainable parameter"
        )
    return chunks


@dataclass(frozen=True)
class _Plans:
    plan: ShardingPlan
    expert_plan: ShardingPlan | None = None
    expert_layout: ExpertLayout | None = None


def _sharding_plans(
    config: OptimizerConfig,
    groups: list[ResolvedGroup],
    group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None,
    param_sync: ParamSync,
) -> _Plans | None:
    """Who owns what under a distributed-optimizer flag (after checking every rank agrees), else ``None``:
    one plan, or with an expert data-parallel group, one for the dense params and one for the experts."""
    if not (config.use_distributed_optimizer or config.use_layer_wise_distributed_optimizer):
        return None
    assert group is not None  # data_parallel_group gives one under these flags
    mode: Mode = "layer_wise" if config.use_layer_wise_distributed_optimizer else "sharded"
    # The first exchange, over the data-parallel group every rank shares, also compares what decides
    # the later collectives: a rank that differs there would call others and hang.
    collectives = collective_settings(group, param_sync=param_sync, expert_process_group=expert_group, config=config)
    if expert_group is None:
        check_same_model(groups, group, collectives=collectives)
        return _Plans(plan_shards(groups, dist.get_world_size(group), mode))
    experts = {name for g in groups for routed, name in zip(g.params, g.param_names) if is_expert(routed)}
    dense = {name for g in groups for name in g.param_names} - experts
    check_same_model(groups, group, experts=False, collectives=collectives)
    check_same_model(groups, expert_group, experts=True)
    layout = expert_layout(groups, group, expert_group)
    return _Plans(
        plan_shards(groups, dist.get_world_size(group), mode, names=dense),
        plan_shards(groups, dist.get_world_size(expert_group), mode, names=experts),
        layout,
    )


def torch_param_groups(groups: Sequence[ResolvedGroup], param_map: ParamMap) -> list[dict[str, Any]]:
    """One torch param group per resolved group, over the main tensors this process steps."""
    return [
        group.torch_param_group([entry.main for entry in entries if entry.main is not None], [entry.name for entry in entries])
        for group, entries in zip(groups, param_map.local_by_group(), strict=True)
    ]


def build_inner_optimizers(groups: Sequence[ResolvedGroup], param_groups: list[dict[str, Any]]) -> list[torch.optim.Optimizer]:
    """One optimizer per algorithm and instance-level setting (the record's ``instance_fields``),
    over its torch groups, in order of first use."""
    instances: dict[tuple[Any, ...], list[int]] = {}
    for group in groups:
        instances.setdefault(instance_key(group), []).append(group.index)
    inner = []
    for (name, *_), indices in instances.items():
        spec = get_spec(name)
        instance = {f: getattr(groups[indices[0]].config, f) for f in spec.instance_fields}
        inner.append(spec.build([param_groups[i] for i in indices], instance))
    return inner


def _wrap(
    config: OptimizerConfig,
    inner: list[torch.optim.Optimizer],
    param_groups: list[dict[str, Any]],
    param_map: ParamMap,
    group: dist.ProcessGroup | None,
    plans: _Plans | None,
    param_sync: ParamSync,
    *,
    device: torch.device,
) -> MixedPrecisionOptimizer:
    options = StepOptions(
        clip_grad=config.clip_grad,
        grad_norm_skip_threshold=config.grad_norm_skip_threshold,
        log_num_zeros_in_grad=config.log_num_zeros_in_grad,
        fold_clip_and_scale=config.fold_clip_and_scale,
        timers=config.timers,
        barrier_with_L1_time=config.barrier_with_L1_time,
        log_metrics=config.log_metrics,
        log_metrics_interval=config.log_metrics_interval,
    )
    scaler = make_grad_scaler(config, device=device)
    if plans is not None:
        assert group is not None  # a plan is made over a group
        return DistributedOptimizer(
            inner, param_groups, param_map, options, plan=plans.plan, process_group=group, grad_scaler=scaler,
            param_sync=param_sync, device=device, expert_plan=plans.expert_plan, expert_layout=plans.expert_layout,
        )  # fmt: skip
    wrapper = Float16OptimizerWithFloat16Params if config.fp16 or config.bf16 else FP32Optimizer
    return wrapper(inner, param_groups, param_map, options, grad_scaler=scaler, process_group=group, device=device)


def _write_dumps(
    config: OptimizerConfig,
    groups: Sequence[ResolvedGroup],
    routing: Routing,
    dump_param_to_param_group_map: str | os.PathLike[str] | None,
) -> None:
    """The JSON files a caller asked for: the param-to-group map, and the config (``config_logger_dir``)."""
    if dump_param_to_param_group_map is not None:
        path = Path(dump_param_to_param_group_map)
        path.write_text(json.dumps(param_group_map(groups, routing), indent=2) + "\n")
    if config.config_logger_dir:
        directory = Path(config.config_logger_dir)
        directory.mkdir(parents=True, exist_ok=True)
        dumped = {k: jsonable(v) for k, v in vars(config).items()}
        (directory / "optimizer_config.json").write_text(json.dumps(dumped, indent=2) + "\n")
