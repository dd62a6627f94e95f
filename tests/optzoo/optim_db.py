"""optzoo's optimizers in a table of the shape of torch's OptimizerInfo database.

torch ships its optimizer test database in the wheel (``torch.testing._internal.common_optimizers``):
per optimizer, a constructor, an ``optim_inputs_func`` giving constructor kwargs to try, and an
``optim_error_inputs_func`` giving kwargs that must fail with a stated error. This is the same
table for optzoo, built from torch's own ``OptimizerInput`` and ``ErrorOptimizerInput`` records:

* every name ``optzoo list`` shows (``registered_names()``, so an algorithm registered later is
  in the table too), as ``get_optimizer`` returns it, through :func:`wrapper_adapter`: a
  ``params -> optimizer`` function, as torch's tests construct ``optim_cls(params, **kwargs)``;
* optzoo's own optimizer classes (``optimizers/``), constructed directly.

The generic tests over it are in ``test_torch_contract.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.testing._internal.common_optimizers import ErrorOptimizerInput, OptimizerInput

from optzoo import OptimizerConfig, get_optimizer
from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon
from optzoo.optimizers.precision_adam import PrecisionAwareAdam
from optzoo.optimizers.registry import get_spec, registered_names


class ParamsModule(torch.nn.Module):
    """A module owning exactly the given parameters (``p0``, ``p1``, ...), for ``get_optimizer``."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__()
        for index, param in enumerate(params):
            self.register_parameter(f"p{index}", param)


def wrapper_adapter(name: str) -> Callable[..., torch.optim.Optimizer]:
    """``params, **config fields -> get_optimizer(...)`` for optimizer ``name``: no overrides, so
    every param is in the groups ``name``'s record gives it (Muon's 1-D params go to its scalar
    optimizer); roles from names and shapes (there is no forward to trace)."""

    def build(params: Sequence[torch.nn.Parameter], **fields: Any) -> torch.optim.Optimizer:
        fields.setdefault("lr", 1e-2)
        config = OptimizerConfig(optimizer=name, **fields)
        return get_optimizer(config, ParamsModule(list(params)), config_overrides={}, trace=False, lint=False)

    build.__name__ = f"get_optimizer[{name}]"
    return build


@dataclass(frozen=True)
class OptzooOptimizerInfo:
    """One row: how to build the optimizer from a list of params, and what to try it with."""

    name: str
    build: Callable[..., torch.optim.Optimizer]
    optim_inputs: Callable[[], list[OptimizerInput]]
    error_inputs: Callable[[], list[ErrorOptimizerInput]] = list
    wrapper: bool = False
    """Built by ``get_optimizer``: Megatron's step result and optzoo's name-keyed state dicts."""
    algorithm: str | None = None
    """The registered name a wrapper row builds (its registry record holds the algorithm's facts)."""
    matrices_only: bool = False
    """Takes 2-D and larger params only (the Muon classes)."""
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    """Param dtypes the rows' inputs are tried with."""
    float_lr: float = 1e-2
    """The lr the tensor-lr test compares against (a float of this value)."""
    kernels: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    """Kernel kwargs (``fused``/``foreach``) the class takes, for the layout tests."""
    constrained: bool = False
    """It projects the weights after every update (its record's ``constraint``), so they move
    without a gradient, as weight decay moves them."""


def _inputs(*rows: tuple[str, dict[str, Any]]) -> Callable[[], list[OptimizerInput]]:
    return lambda: [OptimizerInput(params=None, kwargs=dict(kwargs), desc=desc) for desc, kwargs in rows]


def _errors(*rows: tuple[str, dict[str, Any], type[Exception], str]) -> Callable[[], list[ErrorOptimizerInput]]:
    return lambda: [
        ErrorOptimizerInput(OptimizerInput(params=None, kwargs=dict(kwargs), desc=desc), error_type=error, error_regex=regex)
        for desc, kwargs, error, regex in rows
    ]


# Config kwargs to try per registered algorithm: torch's kinds (default, lr, weight decay, the
# algorithm's own flags), plus the wrapper's (16-bit params with fp32 mains, clipping).
_WRAPPER_INPUTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "adam": [
        ("non-default lr", {"lr": 3e-3}),
        ("nonzero weight_decay (AdamW)", {"weight_decay": 0.1}),
        ("L2 weight decay (Adam)", {"weight_decay": 0.1, "decoupled_weight_decay": False}),
        ("betas and eps", {"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_eps": 1e-6}),
        ("precision-aware", {"use_precision_aware_optimizer": True, "store_param_remainders": False, "weight_decay": 0.1}),
        ("precision-aware, bf16 params and remainders", {"use_precision_aware_optimizer": True, "bf16": True}),
        (
            "precision-aware, bf16 moments",
            {"use_precision_aware_optimizer": True, "bf16": True, "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
        ),
        ("clip_grad", {"clip_grad": 0.5}),
        ("fold_clip_and_scale=False", {"clip_grad": 0.5, "fold_clip_and_scale": False}),
    ],
    "sgd": [
        ("non-default lr", {"lr": 3e-3}),
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("no momentum", {"sgd_momentum": 0.0}),
        ("clip_grad", {"clip_grad": 0.5}),
    ],
    "lion": [("nonzero weight_decay", {"weight_decay": 0.1}), ("betas", {"lion_beta1": 0.8, "lion_beta2": 0.9})],
    "laprop": [
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("betas and eps", {"laprop_beta1": 0.8, "laprop_beta2": 0.95, "laprop_eps": 1e-6}),
        ("no bias correction", {"laprop_correct_bias": False}),
    ],
    "soap": [("nonzero weight_decay", {"weight_decay": 0.1}), ("kl-shampoo", {"soap_use_kl_shampoo": True})],
    "rekls": [
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("betas, eps and shampoo beta", {"rekls_beta1": 0.8, "rekls_beta2": 0.9, "rekls_eps": 1e-6, "rekls_shampoo_beta": 0.9}),
    ],
    "psgd_pro": [
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("clipped update rms", {"psgd_pro_max_update_rms": 0.5}),
        (
            "preconditioner settings",
            {"psgd_pro_precond_lr": 0.2, "psgd_pro_precond_init_scale": 0.5, "psgd_pro_damping_noise_scale": 0.01, "psgd_pro_beta_lip": 0.5},
        ),
    ],
    "oblique_sgd": [
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("unit rows", {"oblique_sgd_dim": 1}),
        ("no momentum", {"oblique_sgd_momentum": 0.0}),
    ],
    "oblique_adam": [
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("unit rows, no bias correction", {"oblique_adam_dim": 1, "oblique_adam_correct_bias": False}),
        ("betas and eps", {"oblique_adam_beta1": 0.8, "oblique_adam_beta2": 0.95, "oblique_adam_eps": 1e-6}),
    ],
    "muon": [
        ("nonzero weight_decay", {"weight_decay": 0.1}),
        ("nesterov", {"muon_nesterov": True, "muon_momentum": 0.9}),
        ("unit_rms_norm", {"muon_scale_mode": "unit_rms_norm"}),
        ("lion for the rest", {"muon_scalar_optimizer": "lion"}),
        ("laprop for the rest", {"muon_scalar_optimizer": "laprop"}),
    ],
    "adaptive_muon": [
        ("normuon", {"adaptive_muon_moment2_method": "normuon"}),
        ("namo", {"adaptive_muon_moment2_method": "namo", "weight_decay": 0.1}),
    ],
}

_CONFIG_ERRORS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("negative lr", {"lr": -1e-2}, ValueError, r"`OptimizerConfig.lr`: must be non-negative; got -0.01"),
    ("negative weight_decay", {"weight_decay": -1.0}, ValueError, r"`OptimizerConfig.weight_decay`: must be non-negative; got -1.0"),
    ("multi-element tensor lr", {"lr": torch.tensor([1e-3, 1e-3])}, ValueError, r"`OptimizerConfig.lr`: a tensor is not taken here"),
    ("one-element tensor lr", {"lr": torch.tensor(1e-3)}, ValueError, r"`OptimizerConfig.lr`: a tensor is not taken here"),
    ("unknown field", {"amsgrad": True}, TypeError, r"unexpected keyword argument 'amsgrad'"),
]
_ALGORITHM_ERRORS: dict[str, list[tuple[str, dict[str, Any], type[Exception], str]]] = {
    "adam": [("beta1 of 1", {"adam_beta1": 1.0}, ValueError, r"`OptimizerConfig.adam_beta1`: must lie in \[0, 1\); got 1.0")],
    "sgd": [("momentum of 1", {"sgd_momentum": 1.0}, ValueError, r"`OptimizerConfig.sgd_momentum`: must lie in \[0, 1\); got 1.0")],
    "laprop": [("eps of 0", {"laprop_eps": 0.0}, ValueError, r"`OptimizerConfig.laprop_eps`: must be positive; got 0.0")],
    "rekls": [("eps of 0", {"rekls_eps": 0.0}, ValueError, r"`OptimizerConfig.rekls_eps`: must be positive; got 0.0")],
    "psgd_pro": [
        ("warmup of 0", {"psgd_pro_warmup_steps": 0}, ValueError, r"`OptimizerConfig.psgd_pro_warmup_steps`: must be a positive integer; got 0"),
    ],
    "oblique_sgd": [("dim of 2", {"oblique_sgd_dim": 2}, ValueError, r"`OptimizerConfig.oblique_sgd_dim`: must be 0 or 1; got 2")],
    "oblique_adam": [("beta2 of 1", {"oblique_adam_beta2": 1.0}, ValueError, r"`OptimizerConfig.oblique_adam_beta2`: must lie in \[0, 1\); got 1.0")],
    "muon": [
        ("momentum of 1", {"muon_momentum": 1.0}, ValueError, r"`OptimizerConfig.muon_momentum`: must lie in \[0, 1\); got 1.0"),
        ("bad coefficients", {"muon_coefficient_type": "cubic"}, ValueError, r"Unsupported muon coefficient type 'cubic'"),
    ],
}


def _wrapper_row(name: str) -> OptzooOptimizerInfo:
    rows = [("default", {})] + _WRAPPER_INPUTS.get(name, [])
    if name not in _WRAPPER_INPUTS:  # registered later: its record says what it reads, the defaults are tried
        rows.append(("nonzero weight_decay", {"weight_decay": 0.1}))
    return OptzooOptimizerInfo(
        name=f"get_optimizer[{name}]",
        build=wrapper_adapter(name),
        optim_inputs=_inputs(*rows, ("bf16 params, fp32 mains", {"bf16": True})),
        error_inputs=_errors(*_CONFIG_ERRORS, *_ALGORITHM_ERRORS.get(name, [])),
        wrapper=True,
        algorithm=name,
        dtypes=(torch.float32,),
        constrained=bool(get_spec(name).constraint),
    )


def _class_errors(extra: Sequence[tuple[str, dict[str, Any], type[Exception], str]] = ()) -> Callable[[], list[ErrorOptimizerInput]]:
    return _errors(
        ("negative lr", {"lr": -1e-2}, ValueError, r"param group #0: `lr`: must be non-negative; got -0.01"),
        ("multi-element tensor lr", {"lr": torch.tensor([1e-3, 1e-3])}, ValueError, r"param group #0: `lr`: Tensor lr must be 1-element"),
        ("negative weight_decay", {"weight_decay": -1.0}, ValueError, r"param group #0: `weight_decay`: must be non-negative; got -1.0"),
        *extra,
    )


def _class_rows() -> list[OptzooOptimizerInfo]:
    muon_inputs = (
        ("default", {}),
        ("non-default lr", {"lr": 1e-2}),
        ("nonzero weight_decay", {"weight_decay": 0.1, "lr": 1e-2}),
        ("nesterov", {"nesterov": True, "lr": 1e-2}),
        ("unit_rms_norm, highest", {"scale_mode": "unit_rms_norm", "fp32_matmul_prec": "highest", "lr": 1e-2}),
        ("high matmul precision", {"fp32_matmul_prec": "high", "lr": 1e-2}),
        ("not batched", {"batched": False, "lr": 1e-2}),
    )
    muon_errors = (
        ("momentum of 1", {"momentum": 1.0}, ValueError, r"param group #0: `momentum`: must lie in \[0, 1\); got 1.0"),
        ("bad coefficients", {"coefficient_type": "cubic"}, ValueError, r"param group #0: `coefficient_type`: Unsupported muon coefficient type 'cubic'"),
    )
    return [
        OptzooOptimizerInfo(
            name="Muon", build=Muon, optim_inputs=_inputs(*muon_inputs), error_inputs=_class_errors(muon_errors),
            matrices_only=True, dtypes=(torch.float32, torch.float64, torch.bfloat16),
        ),  # fmt: skip
        OptzooOptimizerInfo(
            name="AdaptiveMuon",
            build=AdaptiveMuon,
            optim_inputs=_inputs(
                *muon_inputs,
                ("normuon", {"moment2_method": "normuon", "lr": 1e-2}),
                ("namo", {"moment2_method": "namo", "lr": 1e-2, "weight_decay": 0.1}),
            ),
            error_inputs=_class_errors(
                (*muon_errors, ("beta2 of 1", {"beta2": 1.0}, ValueError, r"param group #0: `beta2`: must lie in \[0, 1\); got 1.0"))
            ),
            matrices_only=True,
            dtypes=(torch.float32, torch.float64, torch.bfloat16),
        ),
        OptzooOptimizerInfo(
            name="PrecisionAwareAdam",
            build=PrecisionAwareAdam,
            optim_inputs=_inputs(
                ("default", {}),
                ("non-default lr", {"lr": 1e-2}),
                ("nonzero weight_decay (AdamW)", {"weight_decay": 0.1, "lr": 1e-2}),
                ("L2 weight decay", {"weight_decay": 0.1, "decoupled_weight_decay": False, "lr": 1e-2}),
                ("bf16 moments", {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16, "lr": 1e-2}),
                ("plain kernel", {"fused": False, "foreach": False, "lr": 1e-2}),
            ),
            error_inputs=_class_errors(
                (("beta1 of 1", {"betas": (1.0, 0.999)}, ValueError, r"param group #0: `betas`: each must lie in \[0, 1\); got \(1.0, 0.999\)"),)
            ),
            dtypes=(torch.float32, torch.float64),
            kernels=({"fused": True}, {"fused": False, "foreach": True}, {"fused": False, "foreach": False}),
        ),
    ]


def optim_db() -> list[OptzooOptimizerInfo]:
    """Every row: one per registered algorithm (through ``get_optimizer``), then optzoo's classes."""
    return [_wrapper_row(name) for name in registered_names()] + _class_rows()
