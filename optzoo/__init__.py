"""optzoo: a zoo of PyTorch optimizers with Megatron-Core-style parameter-group routing."""

from optzoo.optimizers.registry import OptimizerSpec, register, registered_names
from optzoo.config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig
from optzoo.config_file import dump_recipe, load_recipe, parse_recipe, recipe_from_overrides, shipped_recipes
from optzoo.factory import get_optimizer, make_grad_scaler
from optzoo.groups import ResolvedGroup, get_standard_config_overrides, resolve_groups
from optzoo.mup import get_mup_config_overrides
from optzoo.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MixedPrecisionOptimizer,
)
from optzoo.scalers import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from optzoo.scheduler import OptimizerParamScheduler
from optzoo.routing import (
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    RoutingConflictError,
    get_predicate,
    register_predicate,
    registered_predicates,
    resolve_param_groups,
    unregister_predicate,
)

__all__ = [
    "AdamOptimizerConfig",
    "ChainedOptimizer",
    "ConstantGradScaler",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MegatronGradScaler",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "OptimizerSpec",
    "ParamKey",
    "ParamPredicate",
    "ParamWithNamePredicate",
    "ResolvedGroup",
    "RoutingConflictError",
    "SGDOptimizerConfig",
    "dump_recipe",
    "get_mup_config_overrides",
    "get_optimizer",
    "get_predicate",
    "load_recipe",
    "make_grad_scaler",
    "get_standard_config_overrides",
    "parse_recipe",
    "recipe_from_overrides",
    "register",
    "register_predicate",
    "registered_names",
    "registered_predicates",
    "resolve_groups",
    "resolve_param_groups",
    "shipped_recipes",
    "unregister_predicate",
]
