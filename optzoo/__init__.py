"""optzoo: a zoo of PyTorch optimizers with Megatron-Core-style parameter-group routing."""

import warnings as _warnings
from typing import Any as _Any

from optzoo._common import MatrixView
from optzoo.config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig
from optzoo.estimate import MemoryEstimate, estimate
from optzoo.config_file import dump_recipe, load_recipe, parse_recipe, recipe_from_overrides, shipped_recipes
from optzoo.factory import get_megatron_optimizer, get_optimizer
from optzoo.groups import ResolvedGroup, get_standard_config_overrides, resolve_group_configs
from optzoo.lint import Finding, Fix, RoutingLintWarning, apply_fixes, lint_routing
from optzoo.mup import get_mup_config_overrides
from optzoo.optimizers.registry import OptimizerSpec, register, registered_names
from optzoo.recipe_formats import (
    dump_megatron_yaml,
    megatron_from_overrides,
    overrides_from_megatron,
    parse_megatron_yaml,
    torchtitan_param_groups,
)
from optzoo.routing import (
    GuessedRolesWarning,
    ParamKey,
    ParamPredicate,
    ParamRoles,
    ParamWithNamePredicate,
    RoutingConflictError,
    get_predicate,
    infer_roles,
    register_predicate,
    registered_predicates,
    resolve_param_groups,
    unregister_predicate,
)
from optzoo.scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging
from optzoo.wrapper import (
    ConstantGradScaler,
    DoubleClippingWarning,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    LastStep,
    MegatronGradScaler,
    MixedPrecisionOptimizer,
    NotOrthogonalizedWarning,
    RoutingChange,
    RoutingChangeReport,
    RoutingChangeWarning,
    make_grad_scaler,
    metrics_to_floats,
)

__all__ = [
    "AdamOptimizerConfig",
    "ConstantGradScaler",
    "DoubleClippingWarning",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Finding",
    "Fix",
    "Float16OptimizerWithFloat16Params",
    "GuessedRolesWarning",
    "LastStep",
    "MatrixView",
    "MegatronGradScaler",
    "MemoryEstimate",
    "MixedPrecisionOptimizer",
    "NotOrthogonalizedWarning",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "OptimizerSpec",
    "ParamKey",
    "ParamPredicate",
    "ParamRoles",
    "ParamWithNamePredicate",
    "ResolvedGroup",
    "RoutingChange",
    "RoutingChangeReport",
    "RoutingChangeWarning",
    "RoutingConflictError",
    "RoutingLintWarning",
    "SGDOptimizerConfig",
    "apply_fixes",
    "dump_megatron_yaml",
    "dump_recipe",
    "estimate",
    "get_canonical_lr_for_logging",
    "get_megatron_optimizer",
    "get_mup_config_overrides",
    "get_optimizer",
    "get_predicate",
    "get_standard_config_overrides",
    "infer_roles",
    "lint_routing",
    "load_recipe",
    "make_grad_scaler",
    "megatron_from_overrides",
    "metrics_to_floats",
    "overrides_from_megatron",
    "parse_megatron_yaml",
    "parse_recipe",
    "recipe_from_overrides",
    "register",
    "register_predicate",
    "registered_names",
    "registered_predicates",
    "resolve_group_configs",
    "resolve_param_groups",
    "shipped_recipes",
    "torchtitan_param_groups",
    "unregister_predicate",
]

_DEPRECATED = {
    "ChainedOptimizer": (
        "MixedPrecisionOptimizer",
        "it was an alias of MixedPrecisionOptimizer, while Megatron-Core's ChainedOptimizer chains several optimizers",
    ),
    "resolve_groups": ("resolve_group_configs", "renamed: it resolves each group's config, beside routing's resolve_param_groups"),
}


def __getattr__(name: str) -> _Any:
    """Old names that still work, with a ``DeprecationWarning`` naming the new one."""
    if name in _DEPRECATED:
        new, why = _DEPRECATED[name]
        _warnings.warn(f"`optzoo.{name}`: deprecated ({why}); use `optzoo.{new}`", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module 'optzoo' has no attribute {name!r}")
