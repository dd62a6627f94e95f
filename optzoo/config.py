"""``OptimizerConfig``: Megatron-Core's optimizer configuration, validated on construction.

Every field of Megatron-Core's ``core.optimizer.optimizer_config.OptimizerConfig`` is here with
the same default, so a Megatron config moves across unchanged. Fields that optzoo cannot honour
(yet) are accepted only at their inert default; any other value raises a ``ValueError`` saying
why, instead of being silently ignored (see ``docs/megatron.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import torch

from optzoo._common import INTERNAL_FILES, did_you_mean, finite_number, invalid, show_value
from optzoo.optimizers.adaptive_muon import Moment2Method
from optzoo.optimizers.muon import FsdpOrthogonalize, MuonScaleMode
from optzoo.optimizers.newton_schulz import CoefficientType, MatmulPrecision, NewtonSchulzWarning, schedule_problem
from optzoo.optimizers.newton_schulz_probe import check_kernel_setting
from optzoo.optimizers.owner_compute import DEFAULT_BUCKET_SIZE, TPMode
from optzoo.optimizers.registry import get_spec, registered_names

__all__ = [
    "AdamOptimizerConfig",
    "AdaptiveMuonMoment2Method",
    "FP32_MAX",
    "FP32_NORMAL_MIN",
    "GROUP_FIELDS",
    "LogMetrics",
    "MuonCoefficientType",
    "MuonFsdpOrthogonalize",
    "MuonMatmulPrecision",
    "MuonScaleMode",
    "MuonTPMode",
    "OptimizerConfig",
    "SCHEDULE_KEYS",
    "SGDOptimizerConfig",
    "FIELD_HABITS",
    "OPTIMIZER_ALIASES",
    "canonical_optimizer_name",
    "field_habit",
    "get_supported_coefficient_types",
    "validate_coefficient_type",
]

MuonCoefficientType = CoefficientType
MuonTPMode = TPMode
MuonMatmulPrecision = MatmulPrecision
AdaptiveMuonMoment2Method = Moment2Method
MuonFsdpOrthogonalize = FsdpOrthogonalize

LogMetrics = bool | Literal["per_param"]
"""``OptimizerConfig.log_metrics``: off, per group, or per group and per param."""

SCHEDULE_KEYS: tuple[str, ...] = ("max_lr", "min_lr", "wd_mult", "start_wd", "end_wd")
"""Override keys read by the scheduler (Megatron's ``ParamGroupOverride``), beside config fields."""

GROUP_FIELDS: tuple[str, ...] = (
    "lr", "min_lr", "weight_decay", "optimizer",
    "adam_beta1", "adam_beta2", "adam_eps", "decoupled_weight_decay",
    "sgd_momentum",
    "muon_momentum", "muon_split_qkv", "muon_nesterov", "muon_scale_mode", "muon_fp32_matmul_prec",
    "muon_coefficient_type", "muon_num_ns_steps", "muon_tp_mode", "muon_extra_scale_factor",
    "muon_scalar_optimizer", "muon_scalar_lr", "muon_flatten_conv", "muon_input_layers",
    "lion_beta1", "lion_beta2",
    "laprop_beta1", "laprop_beta2", "laprop_eps", "laprop_correct_bias",
    "rekls_beta1", "rekls_beta2", "rekls_eps", "rekls_shampoo_beta",
    "psgd_pro_momentum", "psgd_pro_beta_lip", "psgd_pro_precond_lr", "psgd_pro_min_precond_lr", "psgd_pro_precond_init_scale",
    "psgd_pro_damping_noise_scale", "psgd_pro_warmup_steps", "psgd_pro_max_update_rms",
    "oblique_sgd_momentum", "oblique_sgd_dim", "oblique_sgd_eps",
    "oblique_adam_beta1", "oblique_adam_beta2", "oblique_adam_dim", "oblique_adam_eps", "oblique_adam_correct_bias",
    "soap_shampoo_beta", "soap_precondition_frequency", "soap_use_kl_shampoo",
    "adaptive_muon_moment2_method", "adaptive_muon_beta2", "adaptive_muon_eps",
    "mop_scale_mode", "scion_spectral_radius", "muon_hyperball_eps", "muon_hyperball_radius",
    "sinkhorn_muon_num_iters", "sinkhorn_muon_eps", "sinkhorn_muon_doubly_stochastic_tolerance",
    "sinkhorn_muon_normalize_at_start",
    "torch_muon_momentum", "torch_muon_nesterov", "torch_muon_ns_steps", "torch_muon_adjust_lr_fn",
    "adafactor_beta2_decay", "adafactor_eps1", "adafactor_eps2", "adafactor_d",
)  # fmt: skip
"""Config fields an override may set per parameter group; every other field is model-wide."""

_FP32 = torch.float32


class _Shown(str):
    """A value already written out (``min_lr=1.0, lr=0.1``): shown as is, not quoted."""

    def __repr__(self) -> str:
        return str(self)


OPTIMIZER_ALIASES: dict[str, str] = {"adamw": "adam"}
"""Other libraries' names for a registered algorithm, lower case. optzoo's ``adam`` is
``torch.optim.AdamW`` while ``decoupled_weight_decay`` is True (the default, as in Megatron-Core)."""

FIELD_HABITS: dict[str, str] = {
    "betas": "adam_beta1 and adam_beta2 (torch's betas=(b1, b2); lion_beta1 and lion_beta2 for Lion)",
    "beta1": "adam_beta1 (lion_beta1 for Lion)",
    "beta2": "adam_beta2 (lion_beta2 for Lion, adaptive_muon_beta2 for Adaptive Muon)",
    "eps": "adam_eps (adaptive_muon_eps for Adaptive Muon)",
    "momentum": "sgd_momentum for SGD, muon_momentum for Muon (one config may run both)",
    "nesterov": "muon_nesterov (optzoo's SGD has no Nesterov option)",
    "adjust_lr_fn": "muon_scale_mode, which takes torch.optim.Muon's names ('original', 'match_rms_adamw', 'spectral_unclamped')",
    "ns_steps": "muon_num_ns_steps",
    "ns_coefficients": "muon_coefficient_type ('simple' is torch's and Keller Jordan's (3.4445, -4.7750, 2.0315))",
    "max_grad_norm": "clip_grad",
    "gradient_clipping": "clip_grad",
    "adamw_lr": "muon_scalar_lr (the lr of what Muon hands to muon_scalar_optimizer)",
    "fallback_lr_scale": "muon_scalar_lr = lr * fallback_lr_scale (the lr of what Muon hands to muon_scalar_optimizer)",
}
"""Keyword names other libraries use (torch.optim, timm, Hugging Face, DeepSpeed), and the optzoo
fields they mean. Each is refused with this pointer: one config may run several algorithms (Muon
and the AdamW it hands the rest to), so a family-less name such as ``betas`` or ``momentum`` has
no single meaning."""


def canonical_optimizer_name(name: str) -> str:
    """The registered name ``name`` means: itself if registered, else its lower case or alias.

    Example:
        >>> canonical_optimizer_name("AdamW"), canonical_optimizer_name("Muon"), canonical_optimizer_name("adamx")
        ('adam', 'muon', 'adamx')
    """
    names = registered_names()
    if name in names:
        return name
    lowered = name.lower()
    lowered = OPTIMIZER_ALIASES.get(lowered, lowered)
    return lowered if lowered in names else name


def field_habit(name: str) -> str | None:
    """The optzoo field another library's keyword ``name`` means, in words, or ``None``."""
    return FIELD_HABITS.get(name)


def get_supported_coefficient_types() -> tuple[str, ...]:
    """The Newton–Schulz coefficient sets ``muon_coefficient_type`` takes (Megatron-Core's function of this name)."""
    return get_args(MuonCoefficientType)


def validate_coefficient_type(coefficient_type: str) -> None:
    """Raise ``ValueError`` if ``coefficient_type`` is not a supported coefficient set, with
    Megatron-Core's message (``megatron.core.optimizer.emerging_optimizers.validate_coefficient_type``)."""
    supported = get_supported_coefficient_types()
    if coefficient_type not in supported:
        raise ValueError(
            f"`OptimizerConfig.muon_coefficient_type`: Unsupported muon coefficient type {coefficient_type!r}. "
            f"Supported types: {supported}; got {coefficient_type!r}; expected one of {list(supported)}"
        )


def _fail(field: str, problem: str, value: Any, expected: str) -> ValueError:
    return invalid(f"OptimizerConfig.{field}", problem, show_value(value), expected)


def _wrong_type(field: str, value: Any, expected: str) -> TypeError:
    return TypeError(
        f"`OptimizerConfig.{field}`: wrong type; got {value!r} ({type(value).__name__}); expected {expected}"
    )


@dataclass(kw_only=True)
class OptimizerConfig:
    """What to optimize with, field for field compatible with Megatron-Core.

    Example:
        >>> OptimizerConfig(lr=1e-3, optimizer="sgd").sgd_momentum
        0.9
        >>> OptimizerConfig(lr=1e-3, adam_beta1=1.5)
        Traceback (most recent call last):
        ...
        ValueError: `OptimizerConfig.adam_beta1`: must lie in [0, 1); got 1.5; expected 0 <= adam_beta1 < 1
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> OptimizerConfig:
        # Before the generated __init__'s bare "unexpected keyword argument": name the field meant.
        for name, value in kwargs.items():
            if (meant := field_habit(name)) is not None and name not in _FIELD_NAMES:
                raise TypeError(f"`OptimizerConfig.{name}`: not an optzoo field; got {name}={value!r}; expected {meant}")
        return super().__new__(cls)

    # ---- General ----------------------------------------------------------------------------
    lr: float | None = None
    """Peak learning rate. ``None`` (Megatron's default) must be set before ``get_optimizer``."""
    min_lr: float | None = None
    """Floor of the learning-rate schedule; read by the scheduler only."""
    decoupled_lr: float | None = None
    """Separate peak lr for parameters tagged ``is_embedding_or_output_parameter`` (standard
    overrides only; ``None`` = same lr as the rest)."""
    decoupled_min_lr: float | None = None
    """Schedule floor for the ``decoupled_lr`` parameters."""
    weight_decay: float = 0.01
    """Weight-decay coefficient; decoupled (AdamW-style) or L2, see ``decoupled_weight_decay``."""
    apply_wd_to_qk_layernorm: bool = False
    """Standard overrides still decay ``q_layernorm``/``k_layernorm`` parameters (Qwen3-Next)."""
    standard_overrides: bool = True
    """An optzoo extension: the standard overrides (:func:`optzoo.get_standard_config_overrides`:
    no weight decay on biases, norms and 1-D params; ``decoupled_lr``) lie under an explicit
    ``config_overrides``, whose rules win field by field. False: an explicit ``config_overrides``
    is used alone, Megatron-Core's meaning (``None`` = the standard overrides, ``{}`` = none),
    which :func:`optzoo.get_megatron_optimizer` always has. With ``config_overrides=None`` both
    give the standard overrides."""

    # ---- Precision --------------------------------------------------------------------------
    fp8_recipe: str | None = None
    """FP8 recipe of Transformer Engine; unsupported here (no Transformer Engine): must be None."""
    fp16: bool = False
    """fp16 model params with fp32 main params and a loss scaler (dynamic unless ``loss_scale``)."""
    bf16: bool = False
    """bf16 model params with fp32 main params; inf/NaN steps are skipped (no scaler needed)."""
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """MXFP8 parameter all-gather through Megatron's DDP grad buffer; unsupported: must be False."""
    params_dtype: torch.dtype = torch.float32
    """dtype the model was initialised in. Informational, as in Megatron-Core's optimizer: the
    optimizer works with whatever dtype the parameters have."""
    use_precision_aware_optimizer: bool = False
    """Adam keeps its master params and moments in the ``*_dtype`` fields below (computing in
    fp32); Megatron-Core does this with Transformer Engine's FusedAdam, optzoo with its own."""
    store_param_remainders: bool = True
    """With the precision-aware optimizer and bf16: keep only the low 16 bits of each fp32 master
    value (int16) beside the bf16 param (2 bytes instead of 4). Must be False where it cannot
    apply (fp16, fp32 params, non-fp32 main params)."""
    main_grads_dtype: torch.dtype = torch.float32
    """dtype of main grads; non-fp32 needs ``use_precision_aware_optimizer``."""
    main_params_dtype: torch.dtype = torch.float32
    """dtype of main params; non-fp32 needs ``use_precision_aware_optimizer``."""
    exp_avg_dtype: torch.dtype = torch.float32
    """dtype of Adam's ``exp_avg``; non-fp32 needs ``use_precision_aware_optimizer``."""
    exp_avg_sq_dtype: torch.dtype = torch.float32
    """dtype of Adam's ``exp_avg_sq``; non-fp32 needs ``use_precision_aware_optimizer``."""
    optimizer: str = "adam"
    """Algorithm name from the registry (``optzoo list``); may differ per parameter group. Names
    are matched without case where unambiguous, and ``adamw`` is ``adam`` (:data:`OPTIMIZER_ALIASES`),
    which is AdamW while ``decoupled_weight_decay`` is True; the config holds the registered name."""

    # ---- Loss scaling -----------------------------------------------------------------------
    loss_scale: float | None = None
    """Static loss scale (fp16/bf16 only); ``None`` means dynamic scaling under fp16, none under bf16."""
    initial_loss_scale: float = 2**32
    """Initial dynamic loss scale (Megatron's default 2**32)."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale."""
    loss_scale_window: float = 1000
    """Clean steps before the dynamic scale grows."""
    hysteresis: int = 2
    """Overflows tolerated (since the last growth) before the dynamic scale backs off."""

    # ---- Adam -------------------------------------------------------------------------------
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-08
    """Adam's denominator epsilon."""
    decoupled_weight_decay: bool = True
    """AdamW (decoupled decay) when true, Adam with L2 decay added to the gradient when false."""

    # ---- SGD --------------------------------------------------------------------------------
    sgd_momentum: float = 0.9
    """SGD momentum factor."""

    # ---- Emerging optimizers ----------------------------------------------------------------
    muon_momentum: float = 0.95
    """Momentum of Muon's inner SGD."""
    muon_split_qkv: bool = True
    """Orthogonalise fused QKV weights per Q/K/V block."""
    muon_nesterov: bool = False
    """Nesterov-style momentum in Muon."""
    muon_scale_mode: str = "spectral"
    """How Muon scales the orthogonalised update of an ``r × c`` matrix; one of :data:`MuonScaleMode`:
    ``spectral`` ``√max(r, c)`` (Megatron-Core's default: update RMS about ``lr``), ``unit_rms_norm``
    ``√(r/c)``, ``shape_scaling`` ``√max(1, r/c)``, or ``torch.optim.Muon``'s ``adjust_lr_fn`` names,
    which port its ``lr`` unchanged: ``original`` (= ``shape_scaling``), ``match_rms_adamw``
    (``0.2·√max(r, c)``, Moonlight) and ``spectral_unclamped`` (= ``unit_rms_norm``). Table of
    conventions: docs/optimizers.md#learning-rate-conventions."""
    muon_fp32_matmul_prec: str = "medium"
    """Matmul precision inside Newton-Schulz; one of :data:`MuonMatmulPrecision`."""
    muon_coefficient_type: str = "quintic"
    """Newton-Schulz coefficient set; one of :data:`MuonCoefficientType`."""
    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations."""
    muon_tp_mode: str = "auto"
    """Newton-Schulz of a matrix tensor parallelism shards; one of :data:`MuonTPMode`:
    ``duplicated`` (every TP rank class computes the whole matrix; Megatron-Core's default),
    ``distributed`` (the TP group together, on its shards, all-reducing Grams), ``blockwise``
    (each TP shard alone: the update depends on the TP size), ``layer_sharded`` (one rank of the
    whole mesh computes the whole matrix) or ``auto`` (per weight: ``distributed`` for a matrix
    costing more than an even share of the Newton–Schulz work where that cuts its busiest rank's FLOPs, else ``layer_sharded``; optzoo's
    default). Without tensor parallelism every mode gives the same result. See docs/distributed.md."""
    muon_extra_scale_factor: float = 1.0
    """Extra multiplier on Muon's update."""
    soap_shampoo_beta: float = 0.95
    """Decay of SOAP's Shampoo preconditioner statistics."""
    soap_precondition_frequency: int = 1
    """Steps between SOAP eigenbasis refreshes."""
    soap_use_kl_shampoo: bool = True
    """Use the KL-Shampoo preconditioner in SOAP."""
    adaptive_muon_moment2_method: str = "adamuon"
    """Second-moment method of Adaptive Muon; one of :data:`AdaptiveMuonMoment2Method`."""
    adaptive_muon_beta2: float = 0.95
    """Second-moment decay of Adaptive Muon."""
    adaptive_muon_eps: float = 1e-8
    """Denominator epsilon of Adaptive Muon."""
    mop_scale_mode: str = "nuclear_norm"
    """MOP's factor on the polar factor: the direction's nuclear norm (``nuclear_norm``, upstream's
    default) or one of Muon's scale modes (:data:`MuonScaleMode`)."""
    scion_spectral_radius: float = 1.0
    """Scion's radius of the spectral-norm ball: the factor on its unit-RMS-scaled LMO."""
    muon_hyperball_eps: float = 1e-8
    """Floor of the norms Muon-Hyperball divides by."""
    muon_hyperball_radius: float | None = None
    """Muon-Hyperball's fixed norm of each matrix (each is rescaled to it before its first update;
    upstream rescales when the optimizer is built); ``None``: each matrix keeps the norm it has."""
    sinkhorn_muon_num_iters: int = 20
    """Row and column normalisation rounds of Sinkhorn-Muon's Sinkhorn–Knopp map."""
    sinkhorn_muon_eps: float = 1e-8
    """Floor of the sums Sinkhorn-Muon's normalisations divide by."""
    sinkhorn_muon_doubly_stochastic_tolerance: float = 0.1
    """How far from Sinkhorn-normalised a param may be when Sinkhorn-Muon is built."""
    sinkhorn_muon_normalize_at_start: bool = True
    """Sinkhorn-Muon maps each matrix that is not Sinkhorn-normalised before its first update (an
    optzoo extension; upstream raises when built, as False does)."""
    muon_scalar_optimizer: str = "adam"
    """Optimizer for the parameters Muon does not take (embeddings, biases, norms)."""
    muon_scalar_lr: float | None = None
    """An optzoo extension: the peak lr of the parameters the Muon family (and SOAP) hands to
    ``muon_scalar_optimizer``, whose schedule floor scales with it (``min_lr · muon_scalar_lr / lr``);
    ``None`` = ``lr``. So ``torch.optim.Muon(lr=0.02)`` beside ``AdamW(lr=3e-4)`` is ``lr=0.02,
    muon_scalar_lr=3e-4``. An override's ``max_lr`` (``decoupled_lr`` on embeddings and the head)
    still wins for the parameters it matches."""
    muon_flatten_conv: bool = True
    """Conv filters go to the Muon family as one matrix, out channels by the rest (Keller Jordan's
    Muon), when True; to ``muon_scalar_optimizer`` when False. An optzoo extension (Megatron-Core
    has no conv layers); per group, so ``{ParamKey(role="conv"): {"muon_flatten_conv": False}}``
    switches it for some layers."""
    muon_input_layers: bool = True
    """Input layers (a matmul or conv applied to the raw model input: a ViT's patch embedding, an
    audio model's first conv, the first Linear on float features) go to the Muon family when True,
    as any hidden matrix does (Keller Jordan's Muon takes every conv); to ``muon_scalar_optimizer``
    when False (the Muon README's "the input embedding ... should be optimized using a standard
    method", read as covering them). Token embeddings are tables, not input layers: they go to
    ``muon_scalar_optimizer`` either way. An optzoo extension; per group (``ParamKey(role="input")``)."""
    muon_fsdp_orthogonalize: str = "auto"
    """Under FSDP2, who orthogonalises a sharded matrix: ``owner`` (one rank per matrix, the
    results sent back as shards), ``redundant`` (every rank, each matrix gathered whole) or
    ``auto`` (owner-computes when it cuts the busiest rank's Newton–Schulz FLOPs to at most 3/4
    of the total); one of :data:`MuonFsdpOrthogonalize`. The same result either way, bit for bit.
    An optzoo extension (Megatron-Core's Muon has no FSDP2 path)."""
    muon_bucket_size: int = DEFAULT_BUCKET_SIZE
    """Under FSDP2, the most bytes a rank holds for one bucket of Muon's owner-computes (pieces
    sent and received, whole matrices, Newton–Schulz's workspace, results); two buckets are in
    flight, so at most twice this per rank. A matrix that alone needs more is a bucket of its own.
    Default 1 GiB. An optzoo extension."""
    muon_ns_variant: str | None = None
    """Which Newton–Schulz kernel the Muon family runs: ``probe`` (time the kernels
    ``muon_fp32_matmul_prec`` allows on this machine's actual shapes, once per shape class, and run the
    fastest), ``auto`` (the FLOPs and device-type rule) or a pinned kernel such as ``gram/ieee`` or
    ``standard/bf16`` (``<standard|gram>/<ieee|tf32|bf16>[/per-matrix]``), which never probes.
    ``None`` (default): the ``OPTZOO_NS_VARIANT`` environment variable, else ``probe``. An optzoo
    extension; see docs/optimizers.md#the-newtonschulz-engine."""

    # ---- Lion -------------------------------------------------------------------------------
    lion_beta1: float = 0.95
    """Lion's interpolation beta for the sign update."""
    lion_beta2: float = 0.98
    """Lion's momentum decay."""

    # ---- LaProp -----------------------------------------------------------------------------
    laprop_beta1: float = 0.9
    """LaProp's momentum decay (of the normalised gradient); upstream's ``betas[0]``."""
    laprop_beta2: float = 0.999
    """LaProp's second-moment decay; upstream's ``betas[1]``."""
    laprop_eps: float = 1e-8
    """Added to the root of LaProp's second moment; 0 turns a zero gradient element into 0/0."""
    laprop_correct_bias: bool = True
    """Adam-style bias correction of both LaProp moments."""

    # ---- torch.optim.Muon (torch_muon) and Adafactor: torch's own, named Megatron's way ------
    torch_muon_momentum: float = 0.95
    """torch.optim.Muon's ``momentum``."""
    torch_muon_nesterov: bool = True
    """torch.optim.Muon's ``nesterov`` (torch's default, True; optzoo's ``muon_nesterov`` defaults to Megatron's False)."""
    torch_muon_ns_steps: int = 5
    """torch.optim.Muon's ``ns_steps``: Newton–Schulz iterations with its fixed quintic coefficients."""
    torch_muon_adjust_lr_fn: str | None = None
    """torch.optim.Muon's ``adjust_lr_fn``: ``None`` (= ``original``), ``original``,
    ``match_rms_adamw`` or ``spectral_unclamped`` (see ``muon_scale_mode`` for their factors)."""
    adafactor_beta2_decay: float = -0.8
    """Adafactor's ``beta2_decay`` (<= 0): the second moment's decay is ``1 − step^beta2_decay``."""
    adafactor_eps1: float | None = None
    """Adafactor's ``eps[0]``, the floor of the factored second moment; ``None``: the dtype's smallest normal."""
    adafactor_eps2: float = 1e-3
    """Adafactor's ``eps[1]``, the floor of the param RMS the step size scales with."""
    adafactor_d: float = 1.0
    """Adafactor's clipping threshold ``d`` (>= 1) on the update's RMS."""
    # ---- REKLS ------------------------------------------------------------------------------
    rekls_beta1: float = 0.9
    """REKLS's inner Adam momentum decay; upstream's ``betas[0]``."""
    rekls_beta2: float = 0.95
    """REKLS's inner Adam second-moment decay; upstream's ``betas[1]``."""
    rekls_eps: float = 1e-8
    """REKLS's inner Adam epsilon, also the floor of its KL-Shampoo eigenvalues; must be > 0."""
    rekls_shampoo_beta: float = 0.95
    """Decay of REKLS's Kronecker factors."""

    # ---- PSGD (PSGD-Kron-Whiten with a Procrustes step) ---------------------------------------
    psgd_pro_momentum: float = 0.9
    """Decay of PSGD's gradient moving average (the momentum it preconditions)."""
    psgd_pro_beta_lip: float = 0.9
    """Decay of PSGD's moving Lipschitz constants (one per Kronecker factor)."""
    psgd_pro_precond_lr: float = 0.1
    """PSGD's preconditioner learning rate, before its schedule."""
    psgd_pro_min_precond_lr: float = 0.01
    """Floor of PSGD's preconditioner learning rate schedule."""
    psgd_pro_precond_init_scale: float = 1.0
    """Scale of PSGD's initial Kronecker factors (identity times it)."""
    psgd_pro_damping_noise_scale: float = 0.1
    """Scale of the Gaussian noise PSGD adds to the momentum it fits its preconditioner on."""
    psgd_pro_warmup_steps: int = 10000
    """Steps of PSGD's preconditioner learning rate schedule ``precond_lr / sqrt(1 + step / warmup_steps)``."""
    psgd_pro_max_update_rms: float = 0.0
    """Clip PSGD's update RMS to this (0: no clipping)."""

    # ---- Oblique (unit-norm rows or columns) -------------------------------------------------
    oblique_sgd_momentum: float = 0.9
    """Oblique SGD's momentum (``buf = grad + momentum * buf``)."""
    oblique_sgd_dim: int = 0
    """The dimension Oblique SGD normalises over: 0 keeps each column at unit norm, 1 each row."""
    oblique_sgd_eps: float = 1e-8
    """Floor of the norm Oblique SGD divides by in its retraction; must be > 0."""
    oblique_adam_beta1: float = 0.9
    """Oblique Adam's first-moment decay; upstream's ``betas[0]``."""
    oblique_adam_beta2: float = 0.99
    """Oblique Adam's second-moment decay; upstream's ``betas[1]``."""
    oblique_adam_dim: int = 0
    """The dimension Oblique Adam normalises over: 0 keeps each column at unit norm, 1 each row."""
    oblique_adam_eps: float = 1e-8
    """Oblique Adam's denominator epsilon and retraction norm floor; must be > 0."""
    oblique_adam_correct_bias: bool = True
    """Adam-style bias correction of Oblique Adam's moments."""

    # ---- Distributed optimizer --------------------------------------------------------------
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1; :mod:`optzoo.distributed`)."""
    use_layer_wise_distributed_optimizer: bool = False
    """Each param owned by one data-parallel rank, balanced by cost (:mod:`optzoo.distributed`)."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with forward compute; needs Megatron's DDP buffers."""
    overlap_param_gather_with_optimizer_step: bool = False
    """Overlap the first bucket's all-gather with the step; needs the distributed optimizer."""

    # ---- Optimizer offload ------------------------------------------------------------------
    optimizer_cpu_offload: bool = False
    """Megatron's HybridDeviceOptimizer CPU offload; not implemented: must be False."""
    optimizer_offload_fraction: float = 0.0
    """Fraction of state offloaded to CPU; only with offload: must be 0.0."""
    use_torch_optimizer_for_cpu_offload: bool = False
    """Only with offload: must be False."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Only with offload: must be False."""
    pin_cpu_grads: bool = True
    """Only with offload (inert otherwise, as in Megatron-Core)."""
    pin_cpu_params: bool = True
    """Only with offload (inert otherwise, as in Megatron-Core)."""
    offload_optimizer_states: bool = False
    """Move optimizer state to CPU between steps; not implemented: must be False."""

    # ---- Miscellaneous ----------------------------------------------------------------------
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping (and the norm is not computed
    unless ``grad_norm_skip_threshold`` needs it)."""
    grad_norm_skip_threshold: float = math.inf
    """Skip the update when the global L2 norm of the unscaled gradients, before clipping, exceeds
    this: parameters and optimizer state stay unchanged and ``step`` returns ``(False, grad_norm,
    num_zeros)``, as Megatron-Core's ``ChainedOptimizer``; the loss scaler counts the step as clean
    (it saw no inf/NaN). ``inf`` (Megatron-Core's default) never skips; a finite value makes every
    step compute the norm, even with ``clip_grad=0``."""
    log_num_zeros_in_grad: bool = False
    """Count zero gradient elements at each step (returned by ``step``)."""
    log_metrics: LogMetrics = False
    """An optzoo extension: per-group telemetry of every step, read with ``optimizer.metrics()``
    (grad norm, update RMS, update RMS / param RMS; for the Muon family the count of params that got
    an orthogonalised update and the Newton–Schulz output's orthogonality error). ``"per_param"``
    adds the first three per param. Computed on the device, with no host read of its own, at the
    cost of one copy of the main params this rank steps (see ``docs/telemetry.md``). ``False``
    (default): nothing is computed."""
    log_metrics_interval: int = 1
    """An optzoo extension: with ``log_metrics``, measure every this-many steps that reach the
    inner optimizers (the first one included), as a logger that writes every N steps needs; the
    steps between cost nothing and ``metrics()`` keeps the last measured step's."""
    fold_clip_and_scale: bool = True
    """An optzoo extension: the clip coefficient and the loss scale reach each gradient as one
    factor, inside the fused kernels (torch's ``grad_scale``) or in one pass, after one norm pass
    that also detects inf/NaN. Each gradient element is then rounded once where Megatron's
    separate unscale and clip passes round it twice. False: those separate passes, bit for bit."""
    barrier_with_L1_time: bool = False
    """Pass ``barrier=True`` to level-1 ``timers`` (only with ``timers``)."""
    timers: Callable[..., Any] | None = None
    """Megatron-style timers: ``timers(name, log_level=1)`` returns an object with
    ``start(barrier=...)`` and ``stop()``; the step phases are timed with it."""
    config_logger_dir: str = ""
    """When non-empty, ``get_optimizer`` writes the resolved config there as JSON."""
    optimizer_cuda_graph: bool = False
    """Capture the step in a CUDA graph; not implemented: must be False."""

    def __post_init__(self) -> None:
        self._check_types()
        self._check_names()
        self._check_ranges()
        self._check_precision()
        self._check_paths()
        self._check_unsupported()
        if self.muon_ns_variant is not None:  # a pin coarser than a group's precision is refused when Muon is built
            check_kernel_setting(self.muon_ns_variant, "`OptimizerConfig.muon_ns_variant`")
        self._warn_about_newton_schulz()

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            allowed = _TYPE_CHECKS.get(str(f.type))
            if allowed is None:
                if callable(value) or value is None:
                    continue
                raise _wrong_type(f.name, value, "a callable or None")
            accepted, described = allowed
            if isinstance(value, torch.Tensor) and float in accepted:
                # torch.optim takes a one-element tensor lr (for compiled steps); a config holds the
                # number each group starts from, and the scheduler writes numbers.
                raise _fail(
                    f.name, "a tensor is not taken here", _Shown(f"a tensor of shape {tuple(value.shape)}"),
                    f"{described}, e.g. float(value)",
                )
            if isinstance(value, bool) and bool not in accepted:
                raise _wrong_type(f.name, value, described)
            if not isinstance(value, accepted):
                raise _wrong_type(f.name, value, described)
            if f.name in _INF_ALLOWED:
                continue  # a number, checked in _check_ranges
            if float in accepted and isinstance(value, (int, float)) and not finite_number(value):
                raise _fail(f.name, "must be finite", value, f"a finite number{' or None' if type(None) in accepted else ''}")

    def _check_names(self) -> None:
        names = registered_names()
        for field in ("optimizer", "muon_scalar_optimizer"):
            given = getattr(self, field)
            if OPTIMIZER_ALIASES.get(given.lower()) == "adam" and not self.decoupled_weight_decay:
                raise _fail(
                    field, f"{given!r} is Adam with decoupled weight decay, and decoupled_weight_decay=False asks for "
                    "L2 decay", given, "'adam' with decoupled_weight_decay=False (Adam + L2), or decoupled_weight_decay=True",
                )  # fmt: skip
            setattr(self, field, canonical_optimizer_name(given))
        if self.optimizer not in names:
            raise _fail("optimizer", "unknown optimizer", self.optimizer, f"one of {names}{did_you_mean(self.optimizer, names)}")
        # A matrix optimizer's fallback must take every shape: the registry says which do.
        scalar = tuple(name for name in names if get_spec(name).scalar_fallback)
        for field, allowed in (
            ("muon_scale_mode", get_args(MuonScaleMode)),
            ("muon_coefficient_type", get_args(MuonCoefficientType)),
            ("muon_tp_mode", get_args(MuonTPMode)),
            ("muon_scalar_optimizer", scalar),
            ("muon_fp32_matmul_prec", get_args(MuonMatmulPrecision)),
            ("adaptive_muon_moment2_method", get_args(AdaptiveMuonMoment2Method)),
            ("mop_scale_mode", (*get_args(MuonScaleMode), "nuclear_norm")),
            ("torch_muon_adjust_lr_fn", (None, "original", "match_rms_adamw", "spectral_unclamped")),
            ("muon_fsdp_orthogonalize", get_args(MuonFsdpOrthogonalize)),
            ("log_metrics", (False, True, "per_param")),
        ):
            value = getattr(self, field)
            if field == "muon_coefficient_type" and value not in allowed:
                validate_coefficient_type(value)
            if value not in allowed:
                raise _fail(field, "unknown value", value, f"one of {list(allowed)}{did_you_mean(value, allowed)}")

    def _check_ranges(self) -> None:
        for field in (
            "adam_beta1", "adam_beta2", "sgd_momentum", "muon_momentum", "torch_muon_momentum", "lion_beta1",
            "lion_beta2", "laprop_beta1", "laprop_beta2", "soap_shampoo_beta", "adaptive_muon_beta2",
            "rekls_beta1", "rekls_beta2", "rekls_shampoo_beta", "psgd_pro_momentum", "psgd_pro_beta_lip",
            "oblique_sgd_momentum", "oblique_adam_beta1", "oblique_adam_beta2",
        ):  # fmt: skip
            value = getattr(self, field)
            if not 0.0 <= value < 1.0:
                raise _fail(field, "must lie in [0, 1)", value, f"0 <= {field} < 1")
        for field in ("lr", "min_lr", "decoupled_lr", "decoupled_min_lr", "muon_scalar_lr"):
            value = getattr(self, field)
            if value is not None and not value >= 0.0:
                raise _fail(field, "must be non-negative", value, "a float >= 0 or None")
        for field in ("weight_decay", "clip_grad", "adaptive_muon_eps", "adafactor_eps1", "adafactor_eps2"):
            value = getattr(self, field)
            if value is not None and not value >= 0.0:  # only adafactor_eps1 may be None
                raise _fail(field, "must be non-negative", value, "a float >= 0" + (" or None" if field == "adafactor_eps1" else ""))
        threshold = self.grad_norm_skip_threshold
        if not (finite_number(threshold) or threshold == math.inf) or not threshold > 0.0:
            raise _fail("grad_norm_skip_threshold", "must be a finite number > 0, or inf", threshold, "a number > 0, or inf to never skip")
        for field in ("adam_eps", "laprop_eps", "rekls_eps", "oblique_sgd_eps", "oblique_adam_eps"):  # 0: 0/0 on a zero element or row
            if not getattr(self, field) > 0.0:
                raise _fail(field, "must be positive", getattr(self, field), "a float > 0")
        for field in (
            "scion_spectral_radius", "muon_hyperball_eps", "muon_hyperball_radius", "sinkhorn_muon_eps",
            "sinkhorn_muon_doubly_stochastic_tolerance",
        ):  # fmt: skip
            value = getattr(self, field)
            if value is not None and not (finite_number(value) and value > 0.0):
                raise _fail(field, "must be positive and finite", value, "a finite float > 0" + (" or None" if field == "muon_hyperball_radius" else ""))
        self._check_psgd_and_oblique_ranges()
        for low, high in (("min_lr", "lr"), ("decoupled_min_lr", "decoupled_lr")):
            floor, peak = getattr(self, low), getattr(self, high)
            if floor is not None and peak is not None and floor > peak:  # the schedule would anneal up
                raise _fail(low, f"must not exceed {high}", _Shown(f"{low}={floor!r}, {high}={peak!r}"), f"{low} <= {high}")
        if not self.adafactor_beta2_decay <= 0.0:
            raise _fail("adafactor_beta2_decay", "must not be positive", self.adafactor_beta2_decay, "a float <= 0")
        if not (finite_number(self.adafactor_d) and self.adafactor_d >= 1.0):
            raise _fail("adafactor_d", "must be a finite number >= 1", self.adafactor_d, "a float >= 1")
        for field in (
            "muon_num_ns_steps", "soap_precondition_frequency", "hysteresis", "sinkhorn_muon_num_iters", "torch_muon_ns_steps",
            "psgd_pro_warmup_steps", "muon_bucket_size", "log_metrics_interval",
        ):  # fmt: skip
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _fail(field, "must be a positive integer", value, "an int >= 1")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise _fail(
                "decoupled_min_lr", "has no effect without decoupled_lr", self.decoupled_min_lr,
                "decoupled_lr to be set too, or decoupled_min_lr=None",
            )
        if not self.muon_extra_scale_factor > 0.0:
            raise _fail("muon_extra_scale_factor", "must be positive", self.muon_extra_scale_factor, "a float > 0")
        for field in ("initial_loss_scale", "min_loss_scale", "loss_scale"):
            value = getattr(self, field)
            if value is not None and not FP32_NORMAL_MIN <= value <= FP32_MAX:
                raise _fail(
                    field, "must lie in float32's finite normal range", value,
                    f"a float in [{FP32_NORMAL_MIN:.4g}, {FP32_MAX:.4g}]" + (" or None" if field == "loss_scale" else ""),
                )  # fmt: skip
        if self.min_loss_scale > self.initial_loss_scale:
            raise _fail(
                "min_loss_scale", "must not exceed initial_loss_scale",
                _Shown(f"min_loss_scale={self.min_loss_scale!r}, initial_loss_scale={self.initial_loss_scale!r}"),
                "min_loss_scale <= initial_loss_scale",
            )  # fmt: skip
        if not (self.loss_scale_window >= 1 and float(self.loss_scale_window).is_integer()):
            raise _fail("loss_scale_window", "must be a whole number of steps, at least 1", self.loss_scale_window, "an integer >= 1")

    def _check_psgd_and_oblique_ranges(self) -> None:
        for field in ("psgd_pro_precond_lr", "psgd_pro_precond_init_scale"):  # 0 would freeze or zero the preconditioner
            if not getattr(self, field) > 0.0:
                raise _fail(field, "must be positive", getattr(self, field), "a float > 0")
        for field in ("psgd_pro_min_precond_lr", "psgd_pro_damping_noise_scale", "psgd_pro_max_update_rms"):
            if not getattr(self, field) >= 0.0:
                raise _fail(field, "must be non-negative", getattr(self, field), "a float >= 0")
        for field in ("oblique_sgd_dim", "oblique_adam_dim"):  # the oblique optimizers take 2-D params
            if getattr(self, field) not in (0, 1):
                raise _fail(field, "must be 0 or 1", getattr(self, field), "0 (unit-norm columns) or 1 (unit-norm rows)")

    def _check_paths(self) -> None:
        directory = self.config_logger_dir
        if directory and os.path.exists(directory) and not os.path.isdir(directory):
            raise _fail("config_logger_dir", "exists and is not a directory", directory, "a directory path (created if missing), or ''")
        if directory and not os.path.exists(directory):
            # get_optimizer creates it after building everything: find now what would stop it (a file
            # or an unwritable directory on the way), so the config, and a CLI check of it, fail first.
            parent = os.path.dirname(os.path.abspath(directory))
            while not os.path.exists(parent):
                parent = os.path.dirname(parent)
            if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
                why = "is not a directory" if not os.path.isdir(parent) else "is not writable"
                raise _fail(
                    "config_logger_dir", f"cannot be created: {parent!r} {why}", directory,
                    "a directory path that can be created (get_optimizer writes optimizer_config.json there), or ''",
                )  # fmt: skip

    def _check_precision(self) -> None:
        if self.fp16 and self.bf16:
            raise _fail("bf16", "fp16 and bf16 are both set", True, "at most one of fp16, bf16")
        if self.loss_scale is not None and not (self.fp16 or self.bf16):
            raise _fail("loss_scale", "a loss scale applies only with fp16 or bf16", self.loss_scale, "None, or fp16/bf16=True")
        if self.use_precision_aware_optimizer:
            self._check_precision_aware()
        if not self.params_dtype.is_floating_point:
            raise _fail("params_dtype", "must be a floating dtype", self.params_dtype, "e.g. torch.float32")
        for field in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            value = getattr(self, field)
            if value != _FP32 and not self.use_precision_aware_optimizer:
                raise _fail(
                    field, "low-precision state needs use_precision_aware_optimizer=True", value,
                    "torch.float32 (or set use_precision_aware_optimizer)",
                )

    def _check_precision_aware(self) -> None:
        """Megatron-Core's precision-aware optimizer is Adam with typed state (no TE needed here)."""
        supported = [name for name in registered_names() if get_spec(name).precision_aware]
        if self.optimizer not in supported:
            raise _fail(
                "optimizer", f"use_precision_aware_optimizer supports {' and '.join(supported)} only", self.optimizer,
                " or ".join(map(repr, supported)),
            )
        for field, allowed in _PRECISION_AWARE_DTYPES.items():
            value = getattr(self, field)
            if value not in allowed:
                raise _fail(field, "unsupported dtype", value, f"one of {[str(d) for d in allowed]}")
        if self.main_params_dtype != _FP32 and not (self.fp16 or self.bf16):
            raise _fail(
                "main_params_dtype", "low-precision main params need 16-bit model params", self.main_params_dtype,
                "torch.float32 (the fp32 model params are the main params), or fp16/bf16=True",
            )
        if self.store_param_remainders and not (self.bf16 and self.main_params_dtype == _FP32):
            raise _fail(
                "store_param_remainders", "needs bf16=True and main_params_dtype=torch.float32 (the bf16 "
                "param holds the high half of the fp32 master)", True, "store_param_remainders=False here",
            )

    def _warn_about_newton_schulz(self) -> None:
        if "muon_num_ns_steps" not in get_spec(self.optimizer).config_fields:
            return
        problem = schedule_problem(cast(CoefficientType, self.muon_coefficient_type), self.muon_num_ns_steps)  # checked above
        if problem is not None:
            warnings.warn(
                f"muon_coefficient_type={self.muon_coefficient_type!r} with muon_num_ns_steps={self.muon_num_ns_steps}: {problem}",
                NewtonSchulzWarning,
                skip_file_prefixes=INTERNAL_FILES,
            )

    def _check_unsupported(self) -> None:
        """Fields optzoo cannot honour yet: only their inert value is accepted."""
        for field, inert, why in _UNSUPPORTED:
            value = getattr(self, field)
            if value != inert:
                raise _fail(field, f"not supported: {why}", value, repr(inert))

    def replace(self, **changes: Any) -> OptimizerConfig:
        """A validated copy with ``changes`` applied (warning only about what the changes add)."""
        copy_warned = ("muon_coefficient_type", "muon_num_ns_steps", "optimizer")
        with warnings.catch_warnings():
            if all(changes.get(name, getattr(self, name)) == getattr(self, name) for name in copy_warned):
                warnings.simplefilter("ignore", NewtonSchulzWarning)  # this config warned already
            return dataclasses.replace(self, **changes)

    def diff(self, base: OptimizerConfig) -> dict[str, Any]:
        """The fields where this config differs from ``base`` (how an override config is read)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(base, f.name)
        }


_FIELD_NAMES: frozenset[str] = frozenset(f.name for f in dataclasses.fields(OptimizerConfig))


def _suggest_fields(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` refusing an unknown keyword as Python does, plus the close field name (``weight_decy``)."""
    names = sorted(_FIELD_NAMES)

    @functools.wraps(init)
    def checked(self: OptimizerConfig, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in _FIELD_NAMES:
                raise TypeError(
                    f"OptimizerConfig.__init__() got an unexpected keyword argument {key!r}{did_you_mean(key, names)}"
                )
        init(self, *args, **kwargs)

    return checked


setattr(OptimizerConfig, "__init__", _suggest_fields(OptimizerConfig.__init__))  # also reaches replace()


FP32_NORMAL_MIN = float(torch.finfo(torch.float32).tiny)
FP32_MAX = float(torch.finfo(torch.float32).max)
"""Loss scales must lie in float32's finite normal range: 0 or inf scales give NaN or skip every step."""


_PRECISION_AWARE_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "main_grads_dtype": (torch.float32, torch.bfloat16),
    "main_params_dtype": (torch.float32, torch.bfloat16, torch.float16),
    "exp_avg_dtype": (torch.float32, torch.bfloat16, torch.float16),
    "exp_avg_sq_dtype": (torch.float32, torch.bfloat16, torch.float16),
}
"""Dtypes the precision-aware Adam stores (it always computes in fp32)."""

_INF_ALLOWED: frozenset[str] = frozenset({"grad_norm_skip_threshold"})
"""Float fields where ``inf`` is a meaningful value (Megatron-Core's default: never skip)."""

_TYPE_CHECKS: dict[str, tuple[tuple[type, ...], str]] = {
    "float": ((int, float), "a number"),
    "float | None": ((int, float, type(None)), "a number or None"),
    "int": ((int,), "an int"),
    "bool": ((bool,), "True or False"),
    "str": ((str,), "a string"),
    "str | None": ((str, type(None)), "a string or None"),
    "torch.dtype": ((torch.dtype,), "a torch.dtype such as torch.float32"),
    "LogMetrics": ((bool, str), "True, False or 'per_param'"),
}
"""Accepted runtime types per field annotation (``bool`` is refused where a number is meant)."""

_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("fp8_recipe", None, "FP8 training needs Transformer Engine, which optzoo does not use"),
    ("reuse_grad_buf_for_mxfp8_param_ag", False, "needs Megatron's DDP grad buffers and MXFP8"),
    ("overlap_param_gather", False, "needs Megatron's DDP parameter buffers"),
    (
        "overlap_param_gather_with_optimizer_step", False,
        "needs Megatron's DDP parameter buffers to overlap the gather with the next forward; "
        "optzoo's distributed optimizer gathers params right after the step",
    ),
    ("optimizer_cpu_offload", False, "CPU offload (HybridDeviceOptimizer) is not implemented"),
    ("optimizer_offload_fraction", 0.0, "CPU offload is not implemented"),
    ("use_torch_optimizer_for_cpu_offload", False, "CPU offload is not implemented"),
    ("overlap_cpu_optimizer_d2h_h2d", False, "CPU offload is not implemented"),
    ("offload_optimizer_states", False, "optimizer-state offload is not implemented"),
    ("optimizer_cuda_graph", False, "CUDA-graph capture of the step is not implemented"),
)

AdamOptimizerConfig = OptimizerConfig
"""Megatron-Core's backward-compatible alias."""
SGDOptimizerConfig = OptimizerConfig
"""Megatron-Core's backward-compatible alias."""
