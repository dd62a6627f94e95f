"""optzoo: a zoo of PyTorch optimizers with Megatron-Core-style parameter-group routing."""

from optimizers.registry import OptimizerSpec, register, registered_names
from optzoo.config import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig
from optzoo.factory import get_optimizer, make_grad_scaler
from optzoo.groups import ResolvedGroup, get_standard_config_overrides, resolve_groups
from optzoo.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MixedPrecisionOptimizer,
)
from optzoo.scalers import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from routing import (
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    RoutingConflictError,
    resolve_param_groups,
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
    "OptimizerSpec",
    "ParamKey",
    "ParamPredicate",
    "ParamWithNamePredicate",
    "ResolvedGroup",
    "RoutingConflictError",
    "SGDOptimizerConfig",
    "get_optimizer",
    "make_grad_scaler",
    "get_standard_config_overrides",
    "register",
    "registered_names",
    "resolve_groups",
    "resolve_param_groups",
]
