"""OptimizerConfig: Megatron-Core's fields and defaults, and validation that names the field."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from optzoo.optimizers import _emerging
from optzoo import AdamOptimizerConfig, OptimizerConfig, SGDOptimizerConfig
from optzoo.config import (
    AdaptiveMuonMoment2Method,
    MuonCoefficientType,
    MuonScaleMode,
)

# Megatron-Core core/optimizer/optimizer_config.py defaults, transcribed field by field.
MEGATRON_DEFAULTS = {
    "lr": None, "min_lr": None, "decoupled_lr": None, "decoupled_min_lr": None, "weight_decay": 0.01,
    "apply_wd_to_qk_layernorm": False, "fp8_recipe": None, "fp16": False, "bf16": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False, "params_dtype": torch.float32,
    "use_precision_aware_optimizer": False, "store_param_remainders": True,
    "main_grads_dtype": torch.float32, "main_params_dtype": torch.float32,
    "exp_avg_dtype": torch.float32, "exp_avg_sq_dtype": torch.float32, "optimizer": "adam",
    "loss_scale": None, "initial_loss_scale": 2**32, "min_loss_scale": 1.0, "loss_scale_window": 1000,
    "hysteresis": 2, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-08,
    "decoupled_weight_decay": True, "sgd_momentum": 0.9, "muon_momentum": 0.95, "muon_split_qkv": True,
    "muon_nesterov": False, "muon_scale_mode": "spectral", "muon_fp32_matmul_prec": "medium",
    "muon_coefficient_type": "quintic", "muon_num_ns_steps": 5, "muon_tp_mode": "duplicated",
    "muon_extra_scale_factor": 1.0, "soap_shampoo_beta": 0.95, "soap_precondition_frequency": 1,
    "soap_use_kl_shampoo": True, "adaptive_muon_moment2_method": "adamuon", "adaptive_muon_beta2": 0.95,
    "adaptive_muon_eps": 1e-8, "muon_scalar_optimizer": "adam", "lion_beta1": 0.95, "lion_beta2": 0.98,
    "use_distributed_optimizer": False, "use_layer_wise_distributed_optimizer": False,
    "overlap_param_gather": False, "overlap_param_gather_with_optimizer_step": False,
    "optimizer_cpu_offload": False, "optimizer_offload_fraction": 0.0,
    "use_torch_optimizer_for_cpu_offload": False, "overlap_cpu_optimizer_d2h_h2d": False,
    "pin_cpu_grads": True, "pin_cpu_params": True, "offload_optimizer_states": False, "clip_grad": 1.0,
    "grad_norm_skip_threshold": float("inf"),
    "log_num_zeros_in_grad": False, "barrier_with_L1_time": False, "timers": None,
    "config_logger_dir": "", "optimizer_cuda_graph": False,
}  # fmt: skip


OPTZOO_EXTENSIONS = {
    "muon_flatten_conv": True, "muon_input_layers": True, "muon_fsdp_orthogonalize": "auto", "fold_clip_and_scale": True,
    "muon_bucket_size": 1 << 30,  # issue 27: owner-computes' cap on a rank's bytes per bucket
    "muon_ns_variant": None,  # issue 29: the Newton-Schulz kernel (None: OPTZOO_NS_VARIANT, else probe)
    "standard_overrides": True,  # issue 25: the standard overrides lie under an explicit dict
    "muon_scalar_lr": None,  # issue 25: the scalar optimizer's own lr
    # issue 26: LaProp's fields, named Megatron's way (<name>_<kwarg>); defaults are upstream's
    "laprop_beta1": 0.9, "laprop_beta2": 0.999, "laprop_eps": 1e-8, "laprop_correct_bias": True,
    # issue 26: the orthogonalising family's own kwargs, upstream's defaults (shared ones are muon_*)
    "mop_scale_mode": "nuclear_norm", "scion_spectral_radius": 1.0, "muon_hyperball_eps": 1e-8,
    "muon_hyperball_radius": None, "sinkhorn_muon_num_iters": 20, "sinkhorn_muon_eps": 1e-8,
    "sinkhorn_muon_doubly_stochastic_tolerance": 0.1,
    "sinkhorn_muon_normalize_at_start": True,  # an optzoo extension: upstream raises (False)
    # torch's own Muon and Adafactor, named the same way, torch's defaults
    "torch_muon_momentum": 0.95, "torch_muon_nesterov": True, "torch_muon_ns_steps": 5, "torch_muon_adjust_lr_fn": None,
    "adafactor_beta2_decay": -0.8, "adafactor_eps1": None, "adafactor_eps2": 1e-3, "adafactor_d": 1.0,
    # issue 26: REKLS, PSGD-Pro and the oblique optimizers; defaults are upstream 0.3.0's signatures'
    "rekls_beta1": 0.9, "rekls_beta2": 0.95, "rekls_eps": 1e-8, "rekls_shampoo_beta": 0.95,
    "psgd_pro_momentum": 0.9, "psgd_pro_beta_lip": 0.9, "psgd_pro_precond_lr": 0.1, "psgd_pro_min_precond_lr": 0.01,
    "psgd_pro_precond_init_scale": 1.0, "psgd_pro_damping_noise_scale": 0.1, "psgd_pro_warmup_steps": 10000,
    "psgd_pro_max_update_rms": 0.0,
    "oblique_sgd_momentum": 0.9, "oblique_sgd_dim": 0, "oblique_sgd_eps": 1e-8,
    "oblique_adam_beta1": 0.9, "oblique_adam_beta2": 0.99, "oblique_adam_dim": 0, "oblique_adam_eps": 1e-8,
    "oblique_adam_correct_bias": True,
    "log_metrics": False,  # issue 28: per-group telemetry, opt-in
    "log_metrics_interval": 1,  # issue 28: ... measured every step unless asked otherwise
}  # fmt: skip
"""Fields Megatron-Core does not have (it has no conv layers), with their defaults."""
DELIBERATE_DEFAULTS = {"muon_tp_mode": "auto"}
"""Megatron fields whose optzoo default differs, on purpose: ``auto`` picks per weight among modes
that all give Megatron's ``duplicated`` result (up to float rounding), with less work per rank
(issue 27)."""


def test_every_megatron_field_with_megatron_default() -> None:
    config = OptimizerConfig()
    names = [f.name for f in dataclasses.fields(config)]
    assert [name for name in names if name not in OPTZOO_EXTENSIONS] == list(MEGATRON_DEFAULTS)
    assert {name: getattr(config, name) for name in MEGATRON_DEFAULTS} == MEGATRON_DEFAULTS | DELIBERATE_DEFAULTS
    assert {name: getattr(config, name) for name in OPTZOO_EXTENSIONS} == OPTZOO_EXTENSIONS
    assert set(names) == set(MEGATRON_DEFAULTS) | set(OPTZOO_EXTENSIONS)


def test_aliases_are_the_same_class() -> None:
    assert AdamOptimizerConfig is OptimizerConfig and SGDOptimizerConfig is OptimizerConfig


def test_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError, match="positional"):
        OptimizerConfig(1e-3)  # type: ignore[misc]


def test_choice_aliases_match_emerging_optimizers() -> None:
    from emerging_optimizers.orthogonalized_optimizers.adaptive_muon import Moment2MethodT
    from emerging_optimizers.orthogonalized_optimizers.muon import MuonScaleT

    assert set(typing.get_args(MuonCoefficientType)) == set(_emerging.newton_schulz_coefficient_types())
    # Upstream's modes, plus torch.optim.Muon's adjust_lr_fn names (tests/optzoo/test_lr_conventions.py).
    torch_names = {"original", "match_rms_adamw", "spectral_unclamped"}
    assert set(typing.get_args(MuonScaleMode)) == set(typing.get_args(MuonScaleT)) | torch_names
    assert set(typing.get_args(AdaptiveMuonMoment2Method)) == set(typing.get_args(Moment2MethodT))


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"optimizer": "adamax"}, r"`OptimizerConfig.optimizer`: unknown optimizer; got 'adamax'; expected one of \['adam', 'sgd', 'lion'"),
        ({"adam_beta1": 1.0}, r"`OptimizerConfig.adam_beta1`: must lie in \[0, 1\); got 1.0; expected 0 <= adam_beta1 < 1"),
        ({"adam_beta2": -0.1}, r"`OptimizerConfig.adam_beta2`: must lie in \[0, 1\); got -0.1"),
        ({"sgd_momentum": 1.5}, r"`OptimizerConfig.sgd_momentum`: must lie in \[0, 1\)"),
        ({"lion_beta1": 1.0}, r"`OptimizerConfig.lion_beta1`: must lie in \[0, 1\)"),
        ({"muon_momentum": 2.0}, r"`OptimizerConfig.muon_momentum`: must lie in \[0, 1\)"),
        ({"lr": -1.0}, r"`OptimizerConfig.lr`: must be non-negative; got -1.0; expected a float >= 0 or None"),
        ({"weight_decay": -0.1}, r"`OptimizerConfig.weight_decay`: must be non-negative; got -0.1"),
        ({"clip_grad": float("nan")}, r"`OptimizerConfig.clip_grad`: must be finite; got nan; expected a finite number$"),
        ({"muon_scale_mode": "rms"}, r"`OptimizerConfig.muon_scale_mode`: unknown value; got 'rms'; expected one of \['spectral', 'unit_rms_norm', 'shape_scaling', 'original', 'match_rms_adamw', 'spectral_unclamped'\]"),
        ({"muon_coefficient_type": "cubic"}, r"`OptimizerConfig.muon_coefficient_type`: Unsupported muon coefficient type 'cubic'\. Supported types: \('simple', 'quintic', .*; got 'cubic'; expected one of \['simple', 'quintic', 'polar_express'"),
        ({"muon_tp_mode": "x"}, r"`OptimizerConfig.muon_tp_mode`: unknown value; got 'x'; expected one of \['auto', 'duplicated', 'distributed', 'blockwise', 'layer_sharded'\]"),
        ({"muon_scalar_optimizer": "sgd"}, r"`OptimizerConfig.muon_scalar_optimizer`: unknown value; got 'sgd'; expected one of \['adam', 'lion', 'laprop', 'adafactor'\]"),
        ({"adaptive_muon_moment2_method": "x"}, r"`OptimizerConfig.adaptive_muon_moment2_method`: unknown value; got 'x'; expected one of \['adamuon', 'normuon', 'namo'\]"),
        ({"muon_fp32_matmul_prec": "low"}, r"`OptimizerConfig.muon_fp32_matmul_prec`: unknown value; got 'low'; expected one of \['highest', 'high', 'medium'\]"),
        ({"muon_num_ns_steps": 0}, r"`OptimizerConfig.muon_num_ns_steps`: must be a positive integer; got 0; expected an int >= 1"),
        ({"soap_precondition_frequency": 0}, r"`OptimizerConfig.soap_precondition_frequency`: must be a positive integer; got 0"),
        ({"decoupled_min_lr": 1e-5}, r"`OptimizerConfig.decoupled_min_lr`: has no effect without decoupled_lr; got 1e-05; expected decoupled_lr to be set too, or decoupled_min_lr=None"),
        ({"fp16": True, "bf16": True}, r"`OptimizerConfig.bf16`: fp16 and bf16 are both set; got True; expected at most one of fp16, bf16"),
        ({"exp_avg_dtype": torch.bfloat16}, r"`OptimizerConfig.exp_avg_dtype`: low-precision state needs use_precision_aware_optimizer=True; got torch.bfloat16"),
        ({"main_params_dtype": torch.float16}, r"`OptimizerConfig.main_params_dtype`: low-precision state needs use_precision_aware_optimizer=True"),
        ({"params_dtype": torch.int32}, r"`OptimizerConfig.params_dtype`: must be a floating dtype; got torch.int32"),
        ({"initial_loss_scale": 0.0}, r"`OptimizerConfig.initial_loss_scale`: must lie in float32.s finite normal range; got 0.0; expected a float in \[1.175e-38, 3.403e\+38\]$"),
        ({"loss_scale": 128.0}, r"`OptimizerConfig.loss_scale`: a loss scale applies only with fp16 or bf16; got 128.0; expected None, or fp16/bf16=True"),
        ({"use_precision_aware_optimizer": True, "optimizer": "sgd"}, r"`OptimizerConfig.optimizer`: use_precision_aware_optimizer supports adam only; got 'sgd'; expected 'adam'"),
        ({"use_precision_aware_optimizer": True, "bf16": True, "exp_avg_dtype": torch.float64}, r"`OptimizerConfig.exp_avg_dtype`: unsupported dtype; got torch.float64; expected one of \['torch.float32', 'torch.bfloat16', 'torch.float16'\]"),
        ({"use_precision_aware_optimizer": True, "bf16": True, "main_grads_dtype": torch.float16}, r"`OptimizerConfig.main_grads_dtype`: unsupported dtype; got torch.float16"),
        ({"use_precision_aware_optimizer": True, "store_param_remainders": False, "main_params_dtype": torch.bfloat16}, r"`OptimizerConfig.main_params_dtype`: low-precision main params need 16-bit model params"),
        ({"use_precision_aware_optimizer": True, "fp16": True}, r"`OptimizerConfig.store_param_remainders`: needs bf16=True and main_params_dtype=torch.float32 .*; got True; expected store_param_remainders=False here"),
        ({"use_precision_aware_optimizer": True}, r"`OptimizerConfig.store_param_remainders`: needs bf16=True"),
        ({"use_precision_aware_optimizer": True, "bf16": True, "main_params_dtype": torch.bfloat16}, r"`OptimizerConfig.store_param_remainders`: needs bf16=True and main_params_dtype=torch.float32"),
    ],
)
def test_bad_values_name_the_field_the_value_and_the_allowed(changes: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        OptimizerConfig(**{"lr": 1e-3, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("fp8_recipe", "delayed", "needs Transformer Engine"),
        ("reuse_grad_buf_for_mxfp8_param_ag", True, "DDP grad buffers"),
        ("overlap_param_gather", True, "DDP parameter buffers"),
        ("overlap_param_gather_with_optimizer_step", True, "gathers params right after the step"),
        ("optimizer_cpu_offload", True, "CPU offload"),
        ("optimizer_offload_fraction", 0.5, "CPU offload"),
        ("use_torch_optimizer_for_cpu_offload", True, "CPU offload"),
        ("overlap_cpu_optimizer_d2h_h2d", True, "CPU offload"),
        ("offload_optimizer_states", True, "offload"),
        ("optimizer_cuda_graph", True, "CUDA-graph"),
    ],
)
def test_flags_optzoo_cannot_honour_raise_instead_of_being_ignored(field: str, value: object, why: str) -> None:
    with pytest.raises(ValueError, match=rf"`OptimizerConfig.{field}`: not supported: .*{why}.*; got {value!r}"):
        OptimizerConfig(lr=1e-3, **{field: value})  # type: ignore[arg-type]


def test_replace_validates_and_diff_lists_changed_fields() -> None:
    base = OptimizerConfig(lr=1e-3)
    changed = base.replace(lr=2e-3, adam_beta1=0.8)
    assert changed.diff(base) == {"lr": 2e-3, "adam_beta1": 0.8}
    with pytest.raises(ValueError, match="adam_beta1"):
        base.replace(adam_beta1=1.2)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"lr": "3e-4"}, r"`OptimizerConfig.lr`: wrong type; got '3e-4' \(str\); expected a number or None"),
        ({"fp16": 1}, r"`OptimizerConfig.fp16`: wrong type; got 1 \(int\); expected True or False"),
        ({"adam_beta1": True}, r"`OptimizerConfig.adam_beta1`: wrong type; got True \(bool\); expected a number"),
        ({"hysteresis": 2.0}, r"`OptimizerConfig.hysteresis`: wrong type; got 2.0 \(float\); expected an int"),
        ({"params_dtype": "bf16"}, r"`OptimizerConfig.params_dtype`: wrong type; got 'bf16' \(str\); expected a torch.dtype"),
        ({"timers": 3}, r"`OptimizerConfig.timers`: wrong type; got 3 \(int\); expected a callable or None"),
        ({"optimizer": None}, r"`OptimizerConfig.optimizer`: wrong type; got None \(NoneType\); expected a string"),
    ],
)
def test_wrong_types_are_type_errors_naming_the_field(changes: dict[str, object], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        OptimizerConfig(**changes)  # type: ignore[arg-type]
