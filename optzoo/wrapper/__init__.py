"""The wrapper every optimizer of ``get_optimizer`` is: the parameter map, the gradient stages of a
step, mixed precision (fp32 main params), loss scalers and name-keyed state dicts."""

from optzoo.wrapper.framework_contract import DoubleClippingWarning, LastStep
from optzoo.wrapper.mixed_precision import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MixedPrecisionOptimizer,
    StepOptions,
    StepResult,
)
from optzoo.wrapper.param_map import ParamEntry, ParamMap, Part, build_param_map
from optzoo.wrapper.routing_digest import RoutingChange, RoutingChangeReport, RoutingChangeWarning
from optzoo.wrapper.scalers import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler, make_grad_scaler
from optzoo.wrapper.state_dict import STATE_DICT_FORMAT
from optzoo.wrapper.telemetry import NotOrthogonalizedWarning, metrics_to_floats

__all__ = [
    "ConstantGradScaler",
    "DoubleClippingWarning",
    "DynamicGradScaler",
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "LastStep",
    "MegatronGradScaler",
    "MixedPrecisionOptimizer",
    "NotOrthogonalizedWarning",
    "ParamEntry",
    "ParamMap",
    "Part",
    "RoutingChange",
    "RoutingChangeReport",
    "RoutingChangeWarning",
    "STATE_DICT_FORMAT",
    "StepOptions",
    "StepResult",
    "build_param_map",
    "make_grad_scaler",
    "metrics_to_floats",
]
