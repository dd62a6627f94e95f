#!/usr/bin/env python
"""Adversarial campaign against optzoo: many small trials, each classified pass or fail.

    .venv/bin/python scripts/campaign.py [--quick] [--only CATEGORY ...]

Categories: config, routing, step, faults, checkpoint, loads, scheduler, quirks, cli, distributed (each section below
starts with the rule it applies). CPU only, no network, nothing downloaded; tiny models are
built in code. The run is deterministic: every trial seeds torch from its own name, and
``--quick`` keeps the ~10% of trials whose name hashes to 0 mod 10 (the same ones every run).
The exit status is always 0: this is a report; the last line is ``FAILURES: N``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import io
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, get_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's optzoo (an editable install may point at another), here and in torchrun's ranks

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402

from optzoo import OptimizerConfig, OptimizerParamScheduler, ParamKey, get_optimizer  # noqa: E402
from optzoo.config_file import load_recipe, shipped_recipes  # noqa: E402
from optzoo.config import AdaptiveMuonMoment2Method, MuonCoefficientType, MuonFsdpOrthogonalize  # noqa: E402
from optzoo.config import MuonMatmulPrecision, MuonScaleMode, MuonTPMode  # noqa: E402
from optzoo.optimizers.registry import get_spec, registered_names  # noqa: E402
from optzoo.routing import ParamPredicate, ParamWithNamePredicate  # noqa: E402

OPTIMIZERS = tuple(registered_names())  # every name `optzoo list` shows, so one registered later is tried too
DTYPES = {"fp32": (torch.float32, {}), "bf16": (torch.bfloat16, {"bf16": True}),
          "fp16": (torch.float16, {"fp16": True, "initial_loss_scale": 1024.0})}  # fmt: skip
NAN, INF = float("nan"), float("inf")

Trial = tuple[str, Callable[[], str | None]]  # (name, run) -> None on pass, else the reason


def short(text: object, limit: int = 150) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def seed_from(name: str) -> int:
    return zlib.crc32(name.encode())


def expect_raise(fn: Callable[[], Any], names: tuple[str, ...], types: tuple[type, ...] = (ValueError, TypeError)) -> str | None:
    """Pass when ``fn`` raises one of ``types`` with a message naming one of ``names``."""
    try:
        fn()
    except types as error:
        if any(n in str(error) for n in names):
            return None
        return f"{type(error).__name__} does not name {names[0]!r}: {short(error)}"
    except Exception as error:  # noqa: BLE001 - the wrong type is the finding
        return f"wrong exception {type(error).__name__}: {short(error)}"
    return "accepted silently (no error)"


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two nested state structures differ (tensors bit for bit, NaN equal to NaN), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        bits = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)  # noqa: E731
        return None if torch.equal(bits(a), bits(b)) else f"{path}: values differ"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} on one side only"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{path}[{k!r}]"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} vs {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{path}[{i}]"))), None)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else f"{path}: {short(a, 40)} vs {short(b, 40)}"


# ---- tiny models -----------------------------------------------------------------------------


class Net(nn.Module):
    """Linear/LayerNorm/Linear (non-square, so transposes matter), optionally zero-size params."""

    def __init__(self, hidden: int = 16, empty: bool = False, prefix: str = "body") -> None:
        super().__init__()
        self.add_module(prefix, nn.Sequential(nn.Linear(8, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, 6)))
        if empty:
            self.empty_w = nn.Parameter(torch.zeros(0, 8))
            self.empty_b = nn.Parameter(torch.zeros(0))


def make(opt: str, dtype_key: str, seed: int, clip: float = 1.0, fold: bool = True, **net: Any) -> tuple[nn.Module, Any]:
    dtype, flags = DTYPES[dtype_key]
    torch.manual_seed(seed)
    model = Net(**net).to(dtype)
    config = OptimizerConfig(lr=1e-2, optimizer=opt, clip_grad=clip, fold_clip_and_scale=fold, **flags)
    return model, get_optimizer(config, model)


def set_grads(model: nn.Module, optimizer: Any, seed: int, skip: tuple[str, ...] = ()) -> None:
    """Deterministic random grads, times the loss scale (as a scaled backward would give)."""
    gen = torch.Generator().manual_seed(seed)
    scale = float(optimizer.get_loss_scale())
    for name, p in model.named_parameters():
        grad = torch.randn(p.shape, generator=gen) * scale
        p.grad = None if name in skip else grad.to(p.dtype)


def snapshot(model: nn.Module, optimizer: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())


def mains(optimizer: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]


def unchanged(model: nn.Module, optimizer: Any, before: tuple[list[torch.Tensor], dict[str, Any]], ignore: tuple[str, ...] = ()) -> str | None:
    params, state = before
    after = optimizer.state_dict()
    for key in ignore:  # the scaler is documented to move on a skipped step
        state, after = {k: v for k, v in state.items() if k != key}, {k: v for k, v in after.items() if k != key}
    if d := first_difference(params, [p.detach() for p in model.parameters()], "params"):
        return d
    return first_difference(state, after, "state_dict")


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel  # lazy: ~7 s to import

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


# ---- 1. config -------------------------------------------------------------------------------
# Rule per field kind (``expected_valid`` returns True, False, or None when either is fine):
#   bool: only True/False (0/1/None are wrong types); True is invalid for the unsupported flags,
#     which accept only their inert default, and for use_precision_aware_optimizer alone (its
#     store_param_remainders default needs bf16).
#   numbers (float, float | None): never bool, never non-finite (10**400 included); per-field
#     ranges as documented (betas in [0, 1), eps > 0, loss scales in fp32's normal range, ...);
#     loss_scale and decoupled_min_lr need another field set first, so any number is invalid alone.
#   int counts: int >= 1, no bool, no 1.5 (that would be a silent truncation).
#   str choices: one of the documented names; dtypes: torch.dtype, fp32 unless precision-aware.
# Construction that raises ValueError/TypeError naming the field always passes (strict is fine).

BAD_VALUES: tuple[tuple[str, Any], ...] = (
    ("nan", NAN), ("inf", INF), ("-inf", -INF), ("-1", -1), ("0", 0), ("10**400", 10**400), ("1.5", 1.5),
    ("True", True), ("'abc'", "abc"), ("None", None), ("[1]", [1]), ("{}", {}),
)  # fmt: skip
UNSUPPORTED = {
    "fp8_recipe", "reuse_grad_buf_for_mxfp8_param_ag", "overlap_param_gather", "overlap_param_gather_with_optimizer_step",
    "optimizer_cpu_offload", "optimizer_offload_fraction", "use_torch_optimizer_for_cpu_offload",
    "overlap_cpu_optimizer_d2h_h2d", "offload_optimizer_states", "optimizer_cuda_graph",
}  # fmt: skip
CHOICES = {
    "optimizer": registered_names(),
    "muon_scalar_optimizer": tuple(n for n in registered_names() if get_spec(n).scalar_fallback),
    "muon_scale_mode": get_args(MuonScaleMode), "muon_fp32_matmul_prec": get_args(MuonMatmulPrecision),
    "muon_coefficient_type": get_args(MuonCoefficientType), "muon_tp_mode": get_args(MuonTPMode),
    "adaptive_muon_moment2_method": get_args(AdaptiveMuonMoment2Method),
    "muon_fsdp_orthogonalize": get_args(MuonFsdpOrthogonalize),
    "torch_muon_adjust_lr_fn": (None, "original", "match_rms_adamw", "spectral_unclamped"),
    "mop_scale_mode": (*get_args(MuonScaleMode), "nuclear_norm"),
}  # fmt: skip
FP32_TINY, FP32_MAX = float(torch.finfo(torch.float32).tiny), float(torch.finfo(torch.float32).max)
RANGES: dict[str, Callable[[float], bool]] = {
    **{f: (lambda v: 0 <= v < 1) for f in ("adam_beta1", "adam_beta2", "sgd_momentum", "muon_momentum",
                                            "lion_beta1", "lion_beta2", "soap_shampoo_beta", "adaptive_muon_beta2",
                                            "laprop_beta1", "laprop_beta2", "rekls_beta1", "rekls_beta2", "rekls_shampoo_beta",
                                            "psgd_pro_momentum", "psgd_pro_beta_lip", "oblique_sgd_momentum",
                                            "oblique_adam_beta1", "oblique_adam_beta2")},
    **{f: (lambda v: v >= 0) for f in ("weight_decay", "clip_grad", "adaptive_muon_eps", "lr", "min_lr", "decoupled_lr", "muon_scalar_lr")},
    "adam_eps": lambda v: v > 0, "laprop_eps": lambda v: v > 0, "muon_extra_scale_factor": lambda v: v > 0,
    **{f: (lambda v: v > 0) for f in ("rekls_eps", "oblique_sgd_eps", "oblique_adam_eps", "psgd_pro_precond_lr", "psgd_pro_precond_init_scale")},
    **{f: (lambda v: v >= 0) for f in ("psgd_pro_min_precond_lr", "psgd_pro_damping_noise_scale", "psgd_pro_max_update_rms")},
    "psgd_pro_warmup_steps": lambda v: v >= 1,  # an int (checked by kind)
    **{f: (lambda v: v in (0, 1)) for f in ("oblique_sgd_dim", "oblique_adam_dim")},
    **{f: (lambda v: v > 0) for f in ("scion_spectral_radius", "muon_hyperball_eps", "muon_hyperball_radius",
                                       "sinkhorn_muon_eps", "sinkhorn_muon_doubly_stochastic_tolerance")},
    "grad_norm_skip_threshold": lambda v: v > 0,  # inf: never skip
    "initial_loss_scale": lambda v: max(FP32_TINY, 1.0) <= v <= FP32_MAX,  # and >= min_loss_scale (1.0)
    "min_loss_scale": lambda v: FP32_TINY <= v <= min(FP32_MAX, 2.0**32),  # and <= initial_loss_scale
    "loss_scale_window": lambda v: v >= 1 and float(v).is_integer(),
    "optimizer_offload_fraction": lambda v: v == 0,
    "loss_scale": lambda v: False, "decoupled_min_lr": lambda v: False,  # need fp16/bf16, decoupled_lr
    "torch_muon_momentum": lambda v: 0 <= v < 1, "adafactor_beta2_decay": lambda v: v <= 0,
    "adafactor_eps1": lambda v: v >= 0, "adafactor_eps2": lambda v: v >= 0, "adafactor_d": lambda v: v >= 1,
}  # fmt: skip


def is_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def expected_valid(field: dataclasses.Field[Any], value: Any) -> bool | None:
    kind = str(field.type)
    if kind == "bool":
        if not isinstance(value, bool):
            return False
        if field.name == "barrier_with_L1_time":
            return None  # inert without timers: accepting or refusing are both defensible
        return value == field.default or field.name not in UNSUPPORTED | {"use_precision_aware_optimizer"}
    if kind in ("float", "float | None"):
        if value is None:
            return kind == "float | None"
        return is_number(value) and RANGES[field.name](value)
    if kind == "int":  # counts (>= 1) unless RANGES says otherwise (a dim: 0 or 1)
        return isinstance(value, int) and not isinstance(value, bool) and RANGES.get(field.name, lambda v: v >= 1)(value)
    if kind in ("str", "str | None"):
        if field.name == "fp8_recipe":
            return value is None
        if field.name == "config_logger_dir":
            return isinstance(value, str)
        return value in CHOICES[field.name]
    if kind == "torch.dtype":
        if not isinstance(value, torch.dtype):
            return False
        return value.is_floating_point if field.name == "params_dtype" else value == torch.float32
    if field.name == "timers":
        return value is None or callable(value)
    raise AssertionError(f"campaign has no rule for field {field.name} of type {kind}")


RELATED = {"use_precision_aware_optimizer": ("store_param_remainders",)}
"""A value invalid only with another field's default may be reported under that field (as documented
in docs/mixed-precision.md: precision-aware alone fails on store_param_remainders's default)."""


def config_trial(field: dataclasses.Field[Any], value: Any) -> str | None:
    try:
        config = OptimizerConfig(**{field.name: value})
    except (ValueError, TypeError) as error:
        if any(name in str(error) for name in (field.name, *RELATED.get(field.name, ()))):
            return None
        return f"{type(error).__name__} does not name the field: {short(error)}"
    except Exception as error:  # noqa: BLE001
        return f"wrong exception {type(error).__name__}: {short(error)}"
    stored = getattr(config, field.name)
    if field.name in ("optimizer", "muon_scalar_optimizer") and isinstance(value, str) and stored == value.lower() in CHOICES[field.name]:
        return None  # optimizer names are read in any case and stored as registered (docs/optimizers.md)
    if type(stored) is not type(value) or (stored != value and stored is not value):
        return f"silently coerced {value!r} to {stored!r}"
    if expected_valid(field, value) is False:
        return f"accepted invalid value {short(repr(value), 40)}"
    return None


def mutated_trial(field: str, value: Any, optimizer: str = "adam") -> str | None:
    """A config mutated after validation (the dataclass is not frozen): get_optimizer must recheck."""
    config = OptimizerConfig(lr=1e-3, optimizer=optimizer)
    setattr(config, field, value)
    return expect_raise(lambda: get_optimizer(config, Net()), (field,))


def config_trials() -> Iterator[Trial]:
    for field in dataclasses.fields(OptimizerConfig):
        values = list(BAD_VALUES)
        if str(field.type) == "torch.dtype":
            values += [("torch.int64", torch.int64), ("torch.bfloat16", torch.bfloat16), ("'float32'", "float32")]
        if str(field.type) in ("str", "str | None"):
            values += [("''", ""), ("'ADAM'", "ADAM")]
        for label, value in values:
            if type(value) is type(field.default) and value == field.default:
                continue  # the default itself is not a bad value
            yield f"{field.name}={label}", lambda f=field, v=value: config_trial(f, v)
    cross = [  # (fields that may be named, kwargs): each combination is documented as invalid
        (("min_lr", "lr"), dict(lr=1e-3, min_lr=1e-2)),
        (("decoupled_min_lr", "decoupled_lr"), dict(lr=1e-3, decoupled_lr=1e-4, decoupled_min_lr=1e-3)),
        (("fp16", "bf16"), dict(fp16=True, bf16=True)),
        (("min_loss_scale", "initial_loss_scale"), dict(fp16=True, initial_loss_scale=4.0, min_loss_scale=8.0)),
        (("optimizer", "use_precision_aware_optimizer"), dict(optimizer="sgd", bf16=True, use_precision_aware_optimizer=True)),
        (("exp_avg_dtype",), dict(exp_avg_dtype=torch.bfloat16)),
        (("store_param_remainders",), dict(fp16=True, use_precision_aware_optimizer=True)),
        (("main_params_dtype",), dict(use_precision_aware_optimizer=True, store_param_remainders=False, main_params_dtype=torch.bfloat16)),
        (("main_grads_dtype",), dict(bf16=True, use_precision_aware_optimizer=True, main_grads_dtype=torch.float16)),
        (("loss_scale",), dict(bf16=True, loss_scale=0.0)),
    ]  # fmt: skip
    for names, kwargs in cross:
        yield "cross:" + ",".join(f"{k}={v}" for k, v in kwargs.items()), lambda n=names, k=kwargs: expect_raise(lambda: OptimizerConfig(**k), n)
    base = OptimizerConfig(lr=1e-3)
    for field, value in (("lr", NAN), ("adam_beta1", 1.5), ("hysteresis", 1.5), ("optimizer", "nope"), ("clip_grad", -INF)):
        yield f"replace:{field}={value}", lambda f=field, v=value: expect_raise(lambda: base.replace(**{f: v}), (f,))
    mutations = [("lr", NAN, "adam"), ("lr", -1.0, "adam"), ("lr", "abc", "adam"), ("weight_decay", INF, "adam"),
                 ("adam_beta1", 1.5, "adam"), ("adam_eps", 0.0, "adam"), ("clip_grad", NAN, "adam"),
                 ("optimizer", "nope", "adam"), ("sgd_momentum", -0.5, "sgd"), ("muon_num_ns_steps", 0, "muon"),
                 ("lion_beta1", NAN, "lion"), ("soap_precondition_frequency", 0, "soap")]  # fmt: skip
    for field, value, opt in mutations:
        yield f"mutated:{opt}.{field}={value!r}", lambda f=field, v=value, o=opt: mutated_trial(f, v, o)


# ---- 2. routing ------------------------------------------------------------------------------
# Pass: ValueError (or TypeError, which OptimizerConfig itself uses for wrong types) whose message
# names the offending rule (its "rule #k" / predicate name) or field; or, where the docs promise
# one, the documented warning. Fail: an exception that names neither (a bare TypeError, KeyError,
# AttributeError from deep inside), or nonsense accepted silently.

BIAS = ParamKey(name="*.bias")


def routed(overrides: Any, strict: bool = False, config: OptimizerConfig | None = None) -> Callable[[], Any]:
    return lambda: get_optimizer(config or OptimizerConfig(lr=1e-3, weight_decay=0.1), Net(), overrides, strict=strict)


def expect_warning(fn: Callable[[], Any], words: tuple[str, ...]) -> str | None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except Exception as error:  # noqa: BLE001
            return f"raised {type(error).__name__} instead of warning: {short(error)}"
    if any(all(w in str(c.message) for w in words) for c in caught):
        return None
    return f"no warning naming {words}; got {[short(c.message, 60) for c in caught]}"


def raising(p: torch.Tensor) -> bool:
    raise RuntimeError("predicate exploded")


def routing_trials() -> Iterator[Trial]:
    cases: list[tuple[str, Any, tuple[str, ...]]] = [("unknown-field", {BIAS: {"lrr": 1e-3}}, ("lrr",)),
                                                     ("model-wide-field", {BIAS: {"clip_grad": 0.5}}, ("clip_grad",))]
    base = OptimizerConfig(lr=1e-3, weight_decay=0.1)
    cases.append(("model-wide-via-config", {BIAS: base.replace(clip_grad=0.5)}, ("clip_grad",)))
    for field, values in {
        "wd_mult": ("abc", None, [1], True, NAN, INF, -1.0, 10**400),
        "lr": (NAN, INF, -1.0, "abc", None, True, [1], 10**400),
        "max_lr": (NAN, INF, -1.0, "abc", None, True),
        "min_lr": (NAN, -1.0, "abc"),
        "start_wd": (-1.0, NAN, "abc"),
        "end_wd": (NAN, INF, "abc"),
        "weight_decay": (-1.0, NAN, "abc"),
        "adam_beta1": (1.5, NAN),
        "optimizer": ("nope", None, 3),
    }.items():
        for value in values:
            cases.append((f"{field}={short(repr(value), 12)}", {BIAS: {field: value}}, (field,)))
    cases += [
        ("min_lr>lr", {BIAS: {"lr": 1e-3, "min_lr": 1e-2}}, ("min_lr",)),
        ("min_lr>max_lr", {BIAS: {"max_lr": 1e-3, "min_lr": 1e-2}}, ("min_lr",)),
        ("start_wd>end_wd", {BIAS: {"start_wd": 0.2, "end_wd": 0.1}}, ("start_wd", "end_wd")),
        ("lr!=max_lr", {BIAS: {"lr": 1e-3, "max_lr": 2e-3}}, ("max_lr",)),
        ("muon_num_ns_steps=1.5", {BIAS: {"optimizer": "muon", "muon_num_ns_steps": 1.5}}, ("muon_num_ns_steps",)),
        ("soap_precondition_frequency=0", {BIAS: {"optimizer": "soap", "soap_precondition_frequency": 0}}, ("soap_precondition_frequency",)),
        ("sgd_momentum=-0.1", {BIAS: {"optimizer": "sgd", "sgd_momentum": -0.1}}, ("sgd_momentum",)),
        ("predicate-raises", {ParamKey(predicate=ParamPredicate("boom", raising)): {"lr": 1e-4}}, ("boom",)),
        ("predicate-keyerror", {ParamKey(predicate=ParamPredicate("kerr", lambda p: {}["x"])): {"lr": 1e-4}}, ("kerr",)),
        ("predicate-tensor", {ParamKey(predicate=ParamPredicate("tens", lambda p: p > 0)): {"lr": 1e-4}}, ("tens",)),
        ("predicate-arity", {ParamKey(predicate=ParamPredicate("two", lambda p, n: True)): {"lr": 1e-4}}, ("two",)),
        ("name-predicate-arity", {ParamKey(with_name_predicate=ParamWithNamePredicate("one", lambda p: True)): {"lr": 1e-4}}, ("one",)),
        ("conflict-lr", {BIAS: {"lr": 1e-4}, ParamKey(name="body.0.*"): {"lr": 2e-4}}, ("rule #1",)),
        ("conflict-wd_mult", {ParamKey(name="body.*"): {"wd_mult": 0.0}, BIAS: {"wd_mult": 0.5}}, ("rule #1",)),
        ("conflict-optimizer", {ParamKey(name="*.weight"): {"optimizer": "sgd"}, ParamKey(name="body.2.*"): {"optimizer": "lion"}}, ("rule #1",)),
        ("key-not-ParamKey", {"*.bias": {"lr": 1e-4}}, ("rule #0", "ParamKey")),
        ("value-not-dict", {BIAS: 5}, ("rule #0",)),
        ("value-list-of-pairs", {BIAS: [("lr", 1e-4)]}, ("rule #0",)),
        ("overrides-is-list", [(BIAS, {"lr": 1e-4})], ("config_overrides",)),
        ("overrides-is-str", "*.bias", ("config_overrides",)),
    ]
    for name, overrides, names in cases:
        yield name, lambda o=overrides, n=names: expect_raise(routed(o), n)
    yield "strict-no-match", lambda: expect_raise(routed({ParamKey(name="decoder.*"): {"lr": 1e-4}}, strict=True), ("rule #0",))
    yield "precision-aware-group-sgd", lambda: expect_raise(
        lambda: get_optimizer(OptimizerConfig(lr=1e-3, bf16=True, use_precision_aware_optimizer=True), Net().bfloat16(),
                              {BIAS: {"optimizer": "sgd"}}), ("rule #0", "optimizer"))  # fmt: skip
    yield "ParamKey(name=5)", lambda: expect_raise(lambda: ParamKey(name=5), ("name",))  # type: ignore[arg-type]
    yield "ParamKey(role='nope')", lambda: expect_raise(lambda: ParamKey(role="nope"), ("role",))
    yield "ParamKey(exclude=ParamKey())", lambda: expect_raise(lambda: ParamKey(name="*", exclude=ParamKey()), ("exclude",))
    yield "ParamKey(predicate=lambda)", lambda: expect_raise(lambda: ParamKey(predicate=lambda p: True), ("predicate",))  # type: ignore[arg-type]
    # Documented warnings, not errors:
    yield "warn:no-match", lambda: expect_warning(routed({ParamKey(name="decoder.*"): {"lr": 1e-4}}), ("rule #0", "matched no parameter"))
    def same_name_predicates() -> Any:  # built inside the trial: the dict compares the keys (and warns)
        a, b = ParamPredicate("dup", lambda p: p.ndim == 1), ParamPredicate("dup", lambda p: p.ndim == 2)
        return routed({ParamKey(predicate=a): {"lr": 1e-4}, ParamKey(predicate=b): {"lr": 2e-4}})()

    yield "warn:same-name-predicates", lambda: expect_warning(same_name_predicates, ("dup",))
    yield "warn:decoupled_lr-unused", lambda: expect_warning(
        routed({BIAS: {"wd_mult": 0.0}}, config=OptimizerConfig(lr=1e-3, decoupled_lr=1e-4, standard_overrides=False)), ("decoupled_lr",))


# ---- 3. step faults --------------------------------------------------------------------------
# NaN/inf grads, and finite grads whose global norm overflows fp32 (documented as skipped too):
# step() == (False, None, None), params and state_dict (except the grad scaler, documented to
# move) bit-identical, and the next clean step works. One huge but finite element: stepped, and
# params and state stay finite. No grad on one param: that param and its state untouched
# (torch's rule, and optzoo's docs), the rest stepped; no grad at all: nothing changes. A sparse
# grad or a missing main_grad (params_have_main_grad=True): ValueError naming the param, nothing
# changed. Transposed (non-contiguous) grads: the same params as contiguous ones (<= 1e-6); a
# transposed-view weight, a module registered twice (tied params): the same fp32 main params as
# the plain model to rounding (<= 1e-5; see twin_trial for SOAP). 40 overflows in a row: all
# skipped, the loss scale stays in [min_loss_scale, inf). Zero-size params: build and step like
# any other, non-empty params change, nothing turns NaN. "unfolded-*": the same faults with
# fold_clip_and_scale=False; fold-vs-unfolded: both bitwise equal when nothing is clipped (docs).


def clean_step_ok(model: nn.Module, opt: Any, seed: int, *, may_stall: bool = False) -> str | None:
    """``may_stall``: after a huge finite grad (clipping off), an adaptive update without momentum
    (Adafactor: ``g/√V``, ``V`` holding that grad squared) is below a param's ulp for a while, as
    the paper's rule says: unchanged params are then expected, not a fault."""
    before, main_before = [p.detach().clone() for p in model.parameters()], mains(opt)
    set_grads(model, opt, seed)
    result = opt.step()
    if not (isinstance(result, tuple) and len(result) == 3 and result[0] is True):
        return f"clean step returned {short(result, 60)}"
    if result[1] is not None and not math.isfinite(result[1]):
        return f"clean step grad_norm {result[1]}"
    main_after = mains(opt)
    stale = [i for i, (a, b) in enumerate(zip(main_before, main_after)) if a.numel() and torch.equal(a, b)]
    if stale and not may_stall:
        return f"clean step left main params #{stale} unchanged"
    if all(torch.equal(a, b) for a, b in zip(before, model.parameters())):
        return "clean step changed no model param"
    if any(not torch.isfinite(p).all() for p in model.parameters()):
        return "clean step produced non-finite params"
    return None


def poison(model: nn.Module, value: float, which: str) -> None:
    params = dict(model.named_parameters())
    params[which].grad.view(-1)[0] = value


def fault_trial(opt_name: str, dtype: str, fault: str) -> str | None:
    seed = seed_from(f"{opt_name}/{dtype}/{fault}")
    if fault in ("transposed", "noncontig-param", "tied"):
        return twin_trial(opt_name, dtype, fault, seed)
    if fault == "fold-vs-unfolded":
        return fold_trial(opt_name, dtype, seed)
    unfolded = fault.startswith("unfolded-")  # Megatron's separate unscale and clip passes
    fault = fault.removeprefix("unfolded-")
    model, opt = make(opt_name, dtype, seed, fold=not unfolded, empty=fault == "zerosize")
    if reason := clean_step_ok(model, opt, seed + 1):  # warm-up: state exists before the fault
        return f"warm-up: {reason}"
    opt.zero_grad()
    if fault in ("nan", "inf", "overflow-norm"):
        set_grads(model, opt, seed + 2)
        # NaN in a matrix (Muon/SOAP side), inf in a LayerNorm bias (the scalar optimizer's side)
        if fault == "overflow-norm":  # every element finite, the sum of squares is not
            dict(model.named_parameters())["body.2.weight"].grad.fill_(1e38)
        else:
            poison(model, NAN if fault == "nan" else INF, "body.0.weight" if fault == "nan" else "body.1.bias")
        before = snapshot(model, opt)
        result = opt.step()
        if result != (False, None, None):
            return f"{fault} step returned {short(result, 60)}"
        if reason := unchanged(model, opt, before, ignore=("grad_scaler",)):
            return f"{fault} step changed {reason}"
        opt.zero_grad()
        return (f"after {fault}: " + r) if (r := clean_step_ok(model, opt, seed + 3)) else None
    if fault == "inf-storm":  # 40 overflows in a row: the fp16 scale backs off, never below its floor
        before = snapshot(model, opt)
        for k in range(40):
            set_grads(model, opt, seed + 10 + k)
            poison(model, INF, "body.0.weight")
            if (r := opt.step()) != (False, None, None):
                return f"overflow #{k} returned {short(r, 60)}"
        scale = float(opt.get_loss_scale())
        if not 1.0 <= scale < INF:  # min_loss_scale defaults to 1.0
            return f"loss scale {scale} after 40 overflows"
        if reason := unchanged(model, opt, before, ignore=("grad_scaler",)):
            return f"overflows changed {reason}"
        opt.zero_grad()
        return (f"after the overflows: " + r) if (r := clean_step_ok(model, opt, seed + 3)) else None
    if fault == "huge":  # 1e30 in one element: finite norm, so the step runs (clipped)
        set_grads(model, opt, seed + 2)
        poison(model, 1e30, "body.0.weight")
        result = opt.step()
        state = [v for e in opt.state_dict()["state"].values() for v in e.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        bad = [p for p in [*model.parameters(), *mains(opt), *state] if not torch.isfinite(p).all()]
        return f"{len(bad)} params or state tensors non-finite after a huge finite grad (step {result[0]})" if bad else None
    if fault == "sparse":
        set_grads(model, opt, seed + 2)
        param = dict(model.named_parameters())["body.0.weight"]
        param.grad = param.grad.to_sparse()
        before = snapshot(model, opt)
        if reason := expect_raise(opt.step, ("body.0.weight",), (ValueError,)):
            return reason
        return (f"changed before raising: {r}") if (r := unchanged(model, opt, before)) else None
    if fault == "allnograd":  # nothing to step: whatever step() returns, nothing may change
        before = snapshot(model, opt)
        opt.step()
        return (f"step without grads changed {r}") if (r := unchanged(model, opt, before, ignore=("grad_scaler",))) else None
    if fault == "nograd":
        name = "body.2.weight"
        param = dict(model.named_parameters())[name]
        kept, kept_state = param.detach().clone(), copy.deepcopy(opt.state_dict()["state"].get(name))
        set_grads(model, opt, seed + 2, skip=(name,))
        result = opt.step()
        if not result[0]:
            return f"step returned {short(result, 60)}"
        if not torch.equal(kept, param.detach()):
            return f"param without grad `{name}` changed"
        if d := first_difference(kept_state, opt.state_dict()["state"].get(name), f"state[{name!r}]"):
            return f"state of param without grad changed: {d}"
        return None
    if fault == "zerosize":  # the warm-up above already stepped them; a NaN step must skip too
        shapes = [p.shape for p in model.parameters()]
        set_grads(model, opt, seed + 2)
        poison(model, NAN, "body.0.weight")
        before = snapshot(model, opt)
        if opt.step() != (False, None, None) or (r := unchanged(model, opt, before, ignore=("grad_scaler",))):
            return "NaN step with zero-size params not skipped cleanly"
        return None if shapes == [p.shape for p in model.parameters()] else "param shapes changed"
    raise AssertionError(fault)


def twin_trial(opt_name: str, dtype: str, fault: str, seed: int) -> str | None:
    """The same model stepped twice over, plainly and with one layout twist; params must agree.

    transposed: 2-D grads are transposed views; noncontig-param: a weight is itself a transposed
    view (its grad and fp32 copy follow its strides); tied: a module registered under two names
    (its params are one tensor with two names, and must be stepped once).
    """
    (m1, o1) = make(opt_name, dtype, seed)
    torch.manual_seed(seed)
    m2 = Net().to(DTYPES[dtype][0])
    if fault == "noncontig-param":
        m2.body[0].weight = nn.Parameter(m2.body[0].weight.detach().t().contiguous().t())
        assert not m2.body[0].weight.is_contiguous()
    if fault == "tied":
        m2.alias = m2.body[0]
    o2 = get_optimizer(OptimizerConfig(lr=1e-2, optimizer=opt_name, **DTYPES[dtype][1]), m2)
    for step in range(2):
        set_grads(m1, o1, seed + step)
        set_grads(m2, o2, seed + step)
        for p in m2.parameters():  # same values, transposed storage: p.grad.is_contiguous() is False
            if fault == "transposed" and p.grad is not None and p.grad.dim() == 2:
                p.grad = p.grad.t().contiguous().t()
                assert not p.grad.is_contiguous()
        r1, r2 = o1.step(), o2.step()
        if r1[0] is not True or r2[0] is not True:
            return f"step {step}: {r1} vs {r2}"
    if fault == "transposed":  # the grad is copied into the param's layout: the same arithmetic
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(m1.parameters(), m2.parameters()))
        return None if worst <= 1e-6 else f"params differ from the plain model's by {worst:.3g}"
    if opt_name == "soap" and fault == "noncontig-param":
        # Another layout means other matmul rounding, and SOAP's first steps amplify last-bit
        # differences to ~lr (measured: grads scaled by 1 + 1e-7 move params by 0.02-0.3, even in
        # float64), so only a finite, successful step can be asked of it here.
        return None if all(torch.isfinite(p).all() for p in m2.parameters()) else "non-finite params"
    # fp32 main params (a 16-bit model rounds them): rounding-level agreement, the layout differs
    worst = max(float((a - b).abs().max()) for a, b in zip(mains(o1), mains(o2)))
    return None if worst <= 1e-5 else f"main params differ from the plain model's by {worst:.3g}"


def fold_trial(opt_name: str, dtype: str, seed: int) -> str | None:
    """docs/megatron.md: fold_clip_and_scale is bitwise Megatron's separate passes when nothing is
    clipped and the scale is a power of two (fp16 here: 1024); clip_grad=1e9 computes the norm."""
    (m1, o1), (m2, o2) = make(opt_name, dtype, seed, clip=1e9), make(opt_name, dtype, seed, clip=1e9, fold=False)
    for k in range(3):
        for m, o in ((m1, o1), (m2, o2)):
            set_grads(m, o, seed + k)
            o.step()
    if d := first_difference(list(m1.parameters()), list(m2.parameters()), "params"):
        return f"folded vs unfolded: {d}"
    return first_difference(o1.state_dict(), o2.state_dict(), "state_dict")


def main_grad_trial(opt_name: str, dtype: str) -> str | None:
    """params_have_main_grad=True (Megatron's DDP fp32 buffers), then one buffer missing."""
    seed = seed_from(f"main_grad/{opt_name}/{dtype}")
    torch.manual_seed(seed)
    model = Net().to(DTYPES[dtype][0])
    opt = get_optimizer(OptimizerConfig(lr=1e-2, optimizer=opt_name, **DTYPES[dtype][1]), model, params_have_main_grad=True)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape, generator=gen) * float(opt.get_loss_scale())
    if (r := opt.step())[0] is not True:
        return f"step with main_grad buffers returned {short(r, 60)}"
    del model.body[2].weight.main_grad
    before = snapshot(model, opt)
    if reason := expect_raise(opt.step, ("body.2.weight",), (ValueError,)):
        return reason
    return (f"changed before raising: {r}") if (r := unchanged(model, opt, before)) else None


def hf_trial(opt_name: str, dtype: str, fault: str) -> str | None:
    seed = seed_from(f"hf/{opt_name}/{dtype}/{fault}")
    torch.manual_seed(seed)
    model = hf_gpt2().to(DTYPES[dtype][0])
    opt = get_optimizer(OptimizerConfig(lr=1e-2, optimizer=opt_name, **DTYPES[dtype][1]), model)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    before, main_before = [p.detach().clone() for p in model.parameters()], mains(opt)
    opt.scale_loss(model(tokens, labels=tokens).loss.float()).backward()
    if fault == "nan":
        model.transformer.h[0].attn.c_attn.weight.grad[0, 0] = NAN
        state = copy.deepcopy(opt.state_dict())
        if (r := opt.step()) != (False, None, None):
            return f"NaN step returned {short(r, 60)}"
        return unchanged(model, opt, (before, state), ignore=("grad_scaler",))
    if (r := opt.step())[0] is not True:
        return f"clean step returned {short(r, 60)}"
    stale = [i for i, (a, b) in enumerate(zip(main_before, mains(opt))) if torch.equal(a, b)]
    return f"main params #{stale} unchanged by a clean step" if stale else None


def step_trials() -> Iterator[Trial]:
    for opt in OPTIMIZERS:
        for dtype in DTYPES:
            faults = ["nan", "inf", "inf-storm", "nograd", "allnograd", "transposed", "noncontig-param", "tied", "zerosize", "sparse"]
            faults += ["huge", "overflow-norm"] if dtype != "fp16" else []  # fp16 grads cannot hold 1e30
            faults += ["fold-vs-unfolded", "unfolded-nan", "unfolded-inf", "unfolded-inf-storm"]
            for fault in faults:
                yield f"{opt}/{dtype}/{fault}", lambda o=opt, d=dtype, f=fault: fault_trial(o, d, f)
            yield f"{opt}/{dtype}/main_grad-missing", lambda o=opt, d=dtype: main_grad_trial(o, d)
            if dtype != "fp16":  # fp16 GPT-2 on CPU is not a configuration anyone runs
                for fault in ("clean", "nan"):
                    yield f"hf-gpt2/{opt}/{dtype}/{fault}", lambda o=opt, d=dtype, f=fault: hf_trial(o, d, f)


# ---- 3b. faults in the step (issue #24) ----------------------------------------------------------
# A step under the caller's torch.autocast (CPU bf16) is the step outside it, params and
# state_dict bit for bit. A param whose first gradient arrives at step 2 ends, with its state,
# where a twin ends that only ever saw that param's gradients (clip_grad=0: no global norm ties
# the two). A model cast or moved after get_optimizer (bf16, double, half, meta, .data of another
# dtype, a new Parameter object): ValueError naming the param, nothing changed. A NaN first step
# under step_on_device (every kernel it allows) leaves state that the next two clean steps use
# exactly as a twin that never saw it. Gradients of 1e16 with clipping off: either a successful
# step with finite params, main params and state, or (False, ...) with nothing changed; then a
# clean step works. zero_grad(set_to_none=False) between two steps: the second step moves the
# same main params in fp32, bf16 and fp16 (a zero gradient is a gradient, as in torch).


def _faults_make(opt: str, dtype_key: str, seed: int, **fields: Any) -> tuple[nn.Module, Any]:
    dtype, flags = DTYPES[dtype_key]
    torch.manual_seed(seed)
    model = Net().to(dtype)
    config = OptimizerConfig(**{"lr": 1e-2, "optimizer": opt, "clip_grad": 0.0, **flags, **fields})
    return model, get_optimizer(config, model, lint=False)


def autocast_trial(opt_name: str, dtype: str) -> str | None:
    seed = seed_from(f"autocast/{opt_name}/{dtype}")
    runs = []
    for inside in (True, False):
        model, opt = _faults_make(opt_name, dtype, seed)
        for k in range(2):
            set_grads(model, opt, seed + k)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
                if (r := opt.step())[0] is not True:
                    return f"step {k} {'inside' if inside else 'outside'} autocast returned {short(r, 60)}"
        runs.append(([p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())))
    if d := first_difference(runs[0][0], runs[1][0], "params"):
        return f"inside vs outside autocast: {d}"
    return (f"inside vs outside autocast: {d}") if (d := first_difference(runs[0][1], runs[1][1], "state_dict")) else None


def late_grad_trial(opt_name: str, dtype: str) -> str | None:
    seed = seed_from(f"late/{opt_name}/{dtype}")
    late = ("body.2.weight", "body.2.bias")
    (model, opt), (twin, twin_opt) = _faults_make(opt_name, dtype, seed), _faults_make(opt_name, dtype, seed)
    set_grads(model, opt, seed, skip=late)
    if (r := opt.step())[0] is not True:
        return f"step without the late params returned {short(r, 60)}"
    early = [n for n, _ in model.named_parameters() if n not in late]
    for k in (1, 2):
        set_grads(model, opt, seed + k)
        set_grads(twin, twin_opt, seed + k, skip=tuple(early))
        for o in (opt, twin_opt):
            if (r := o.step())[0] is not True:
                return f"step {k} returned {short(r, 60)}"
    ours, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    for name in late:
        if d := first_difference(ours[name], theirs[name], name):
            return f"late param vs a twin that saw only its grads: {d}"
        if d := first_difference(opt.state_dict()["state"][name], twin_opt.state_dict()["state"][name], f"state[{name!r}]"):
            return f"late param's state vs the twin's: {d}"
    return None


CASTS: dict[str, Callable[[nn.Module], Any]] = {
    "to-bf16": lambda m: m.to(torch.bfloat16), "double": lambda m: m.double(), "half": lambda m: m.half(),
    "float": lambda m: m.float(), "meta": lambda m: m.to("meta"),
    "data-float64": lambda m: setattr(m.body[0].weight, "data", m.body[0].weight.data.double()),
    "new-parameter": lambda m: setattr(m.body[0], "weight", nn.Parameter(m.body[0].weight.detach().clone())),
}  # fmt: skip


def cast_trial(opt_name: str, dtype: str, cast: str) -> str | None:
    seed = seed_from(f"cast/{opt_name}/{dtype}/{cast}")
    model, opt = _faults_make(opt_name, dtype, seed)
    if reason := clean_step_ok(model, opt, seed):
        return f"warm-up: {reason}"
    if (cast, dtype) in (("float", "fp32"), ("to-bf16", "bf16"), ("half", "fp16")):
        return None  # the same dtype: no change, nothing to refuse
    state = copy.deepcopy(opt.state_dict())
    CASTS[cast](model)
    params = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    if reason := expect_raise(opt.step, ("body.0.weight",), (ValueError,)):
        return reason
    if cast != "meta" and (d := first_difference(params, [p.detach() for p in model.parameters()], "params")):
        return f"changed before raising: {d}"
    return (f"changed before raising: {d}") if (d := first_difference(state, opt.state_dict(), "state_dict")) else None


DEVICE_STEP_CONFIGS: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer": "sgd", "sgd_momentum": 0.9}, "adamw": {"optimizer": "adam"},
    "adam": {"optimizer": "adam", "decoupled_weight_decay": False},
    "precision-aware": {"optimizer": "adam", "use_precision_aware_optimizer": True},
}  # fmt: skip


def device_skip_trial(kind: str, dtype: str) -> str | None:
    seed = seed_from(f"device-skip/{kind}/{dtype}")
    fields = dict(DEVICE_STEP_CONFIGS[kind])
    if dtype == "fp16":
        fields["loss_scale"] = 1024.0  # step_on_device takes a constant scale only
    if kind == "precision-aware" and dtype != "bf16":
        fields["store_param_remainders"] = False  # remainders need bf16 params
    (model, opt), (twin, twin_opt) = _faults_make("adam", dtype, seed, **fields), _faults_make("adam", dtype, seed, **fields)
    set_grads(model, opt, seed)
    poison(model, NAN, "body.0.weight")
    if bool(opt.step_on_device()[0]):
        return "NaN first step reported success"
    for k in (1, 2):
        for m, o in ((model, opt), (twin, twin_opt)):
            set_grads(m, o, seed + k)
            if not bool(o.step_on_device()[0]):
                return f"clean step {k} reported a skip"
    if d := first_difference(list(model.parameters()), list(twin.parameters()), "params"):
        return f"after a skipped first step vs a twin that never saw it: {d}"
    if any(not torch.isfinite(p).all() for p in model.parameters()):
        return "non-finite params"
    return None


def huge_trial(opt_name: str, dtype: str, warm: int) -> str | None:
    seed = seed_from(f"huge/{opt_name}/{dtype}/{warm}")
    model, opt = _faults_make(opt_name, dtype, seed)
    for k in range(warm):
        set_grads(model, opt, seed + k)
        if (r := opt.step())[0] is not True:
            return f"warm-up returned {short(r, 60)}"
    set_grads(model, opt, seed + 10)
    for p in model.parameters():
        p.grad.mul_(1e16)
    before = snapshot(model, opt)
    result = opt.step()
    if result[0] is True:
        state = [v for e in opt.state_dict()["state"].values() for v in e.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        if any(not torch.isfinite(t).all() for t in [*model.parameters(), *mains(opt), *state]):
            return "reported success with non-finite params or state"
    elif reason := unchanged(model, opt, before, ignore=("grad_scaler",)):
        return f"skipped but changed {reason}"
    opt.zero_grad()
    stalls = opt_name == "adafactor"  # no momentum: g/√V with V ~ (1e16·g)² for a while
    return (f"after the huge step: " + r) if (r := clean_step_ok(model, opt, seed + 20, may_stall=stalls)) else None


def zero_grad_false_trial(opt_name: str) -> str | None:
    moved: dict[str, list[bool]] = {}
    for dtype in DTYPES:
        model, opt = _faults_make(opt_name, dtype, seed_from(f"zero_grad/{opt_name}"), weight_decay=0.1)
        set_grads(model, opt, 1)
        if (r := opt.step())[0] is not True:
            return f"{dtype}: first step returned {short(r, 60)}"
        opt.zero_grad(set_to_none=False)
        if any(p.grad is None or p.grad.any() for p in model.parameters()):
            return f"{dtype}: zero_grad(set_to_none=False) left a param without a zero grad"
        before = mains(opt)
        if (r := opt.step())[0] is not True:
            return f"{dtype}: step on zero grads returned {short(r, 60)}"
        moved[dtype] = [not torch.equal(a, b) for a, b in zip(before, mains(opt))]
    if len({tuple(v) for v in moved.values()}) != 1:
        return f"main params moved by a zero-grad step differ across precisions: {moved}"
    return None


def fault_attack_trials() -> Iterator[Trial]:
    for opt in OPTIMIZERS:
        for dtype in DTYPES:
            yield f"autocast/{opt}/{dtype}", lambda o=opt, d=dtype: autocast_trial(o, d)
            yield f"late-grad/{opt}/{dtype}", lambda o=opt, d=dtype: late_grad_trial(o, d)
            for cast in CASTS:
                yield f"cast/{opt}/{dtype}/{cast}", lambda o=opt, d=dtype, c=cast: cast_trial(o, d, c)
            if dtype != "fp16":  # fp16 grads cannot hold 1e16
                for warm in (0, 1):
                    yield f"huge/{opt}/{dtype}/warm{warm}", lambda o=opt, d=dtype, w=warm: huge_trial(o, d, w)
        yield f"zero_grad-set_to_none-false/{opt}", lambda o=opt: zero_grad_false_trial(o)
    for kind in DEVICE_STEP_CONFIGS:
        for dtype in DTYPES:
            yield f"device-skip-first/{kind}/{dtype}", lambda k=kind, d=dtype: device_skip_trial(k, d)


# ---- 4. checkpoints --------------------------------------------------------------------------
# Round trip through torch.save/torch.load(weights_only=True) into a fresh optimizer: bitwise
# equal state_dict, then one more step on both gives bitwise equal params. Every foreign or
# damaged checkpoint: ValueError naming the key (or the parameter), raised before anything
# changes (the target's params and state_dict compared bit for bit before and after).


def trained(opt_name: str, dtype: str, seed: int, **net: Any) -> tuple[nn.Module, Any]:
    model, opt = make(opt_name, dtype, seed, **net)
    for k in range(2):
        set_grads(model, opt, seed + k)
        assert opt.step()[0], "setup step failed"
        opt.zero_grad()
    return model, opt


def saved(opt: Any) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def roundtrip_trial(opt_name: str, dtype: str) -> str | None:
    seed = seed_from(f"roundtrip/{opt_name}/{dtype}")
    model_a, opt_a = trained(opt_name, dtype, seed)
    try:
        checkpoint = saved(opt_a)
    except Exception as error:  # noqa: BLE001
        return f"torch.load(weights_only=True) failed: {type(error).__name__}: {short(error)}"
    model_b, _ = make(opt_name, dtype, seed + 99)
    model_b.load_state_dict(model_a.state_dict())
    opt_b = get_optimizer(OptimizerConfig(lr=1e-2, optimizer=opt_name, **DTYPES[dtype][1]), model_b)
    opt_b.load_state_dict(checkpoint)
    if d := first_difference(opt_a.state_dict(), opt_b.state_dict(), "state_dict"):
        return f"after load: {d}"
    for m, o in ((model_a, opt_a), (model_b, opt_b)):
        set_grads(m, o, seed + 7)
        o.step()
    if d := first_difference(list(model_a.parameters()), list(model_b.parameters()), "params after step"):
        return d
    return first_difference(mains(opt_a), mains(opt_b), "main params after step")


def load_refused(opt_name: str, dtype: str, checkpoint: Any, names: tuple[str, ...]) -> str | None:
    target_model, target = trained(opt_name, dtype, seed_from(f"target/{opt_name}/{dtype}"))
    before = snapshot(target_model, target)
    if reason := expect_raise(lambda: target.load_state_dict(checkpoint), names, (ValueError,)):
        return reason
    return (f"changed before raising: {r}") if (r := unchanged(target_model, target, before)) else None


def damaged(opt_name: str, dtype: str, how: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A damaged copy of a fresh checkpoint, and the names its error should contain (any one)."""
    sd = copy.deepcopy(trained(opt_name, dtype, seed_from(f"source/{opt_name}/{dtype}"))[1].state_dict())
    first = next(iter(sd["state"]))
    entry, group = sd["state"][first], sd["param_groups"][0]
    moment = next(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim())
    beta = "betas" if "betas" in group else "momentum"  # whichever group 0's algorithm keeps
    poke = lambda t, v: t.view(-1).__setitem__(0, v)  # noqa: E731
    if how.startswith("del:"):
        del sd[how[4:]]
        return sd, (how[4:],)
    if how.startswith("group:"):  # a hyperparameter of group 0: "group:lr=nan"
        key, _, text = how[6:].partition("=")
        group[key] = {"nan": NAN, "-1": -1.0, "'abc'": "abc", "None": None, "'nope'": "nope"}[text]
        return sd, (key,)
    edits: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {  # how: (the damage, names)
        "format=v0": (lambda: sd.update(format="optzoo.chained.v0"), ("format",)),
        "state=list": (lambda: sd.update(state=[]), ("state",)),
        "param_groups=dict": (lambda: sd.update(param_groups={}), ("param_groups",)),
        "param_names=None": (lambda: group.update(param_names=None), ("param_names",)),
        "state-entry=5": (lambda: sd["state"].update({first: 5}), (first,)),
        "nan-moment": (lambda: poke(entry[moment], NAN), (moment,)),
        "inf-moment": (lambda: poke(entry[moment], INF), (moment,)),
        "moment-wrong-shape": (lambda: entry.update({moment: torch.zeros(3)}), (first, moment)),
        "moment-float64": (lambda: entry.update({moment: entry[moment].double()}), (moment,)),
        "moment-int64": (lambda: entry.update({moment: entry[moment].long()}), (moment,)),
        "momentum=1.5": (lambda: group.update({beta: (1.5, group[beta][1]) if beta == "betas" else 1.5}), (beta,)),
        "step='abc'": (lambda: entry.update(step="abc"), ("step",)),
        # in the type the optimizer keeps it: a tensor (torch), an int (SOAP)
        "negative-step": (lambda: entry.update(step=torch.tensor(-1.0) if torch.is_tensor(entry.get("step")) else -1), ("step",)),
        "unknown-param-state": (lambda: sd["state"].update({"ghost.weight": dict(entry)}), ("ghost.weight",)),
        "param_shapes-wrong": (lambda: sd["param_shapes"].update({first: [1]}), (first,)),
        "main_param-nan": (lambda: poke(sd["main_params"][first], NAN), (first, "main_params")),  # would load NaN weights
        "scaler-scale-nan": (lambda: sd["grad_scaler"].update(scale=torch.tensor([NAN])), ("scale",)),
        "scaler-missing-key": (lambda: sd["grad_scaler"].pop("growth_tracker"), ("growth_tracker",)),
    }  # fmt: skip
    damage, names = edits[how]
    damage()
    return sd, names


DAMAGES = ("del:state", "del:param_groups", "del:format", "del:main_params", "format=v0", "state=list",
           "param_groups=dict", "param_names=None", "state-entry=5", "nan-moment", "inf-moment", "moment-wrong-shape",
           "negative-step", "group:lr=nan", "group:lr=-1", "group:lr='abc'", "group:weight_decay=None",
           "group:weight_decay=nan", "group:weight_decay=-1", "group:optimizer='nope'", "momentum=1.5",
           "unknown-param-state", "param_shapes-wrong", "moment-float64", "moment-int64", "step='abc'")  # fmt: skip
DAMAGES_16 = ("main_param-nan",)  # bf16/fp16 only: fp32 models have no main copies
DAMAGES_FP16 = ("scaler-scale-nan", "scaler-missing-key")  # fp16 only: the dynamic scaler


def damaged_trial(opt_name: str, dtype: str, how: str) -> str | None:
    checkpoint, names = damaged(opt_name, dtype, how)
    if how == "moment-float64":  # torch's own load casts floating state to the param's dtype: fine too
        model, opt = trained(opt_name, dtype, seed_from(f"target/{opt_name}/{dtype}"))
        try:
            opt.load_state_dict(checkpoint)
        except ValueError as error:
            return None if names[0] in str(error) else f"ValueError does not name {names[0]!r}: {short(error)}"
        loaded = opt.state_dict()["state"]
        if any(v.dtype == torch.float64 for e in loaded.values() for v in e.values() if isinstance(v, torch.Tensor)):
            return "float64 state loaded as is (not cast, not refused)"
        set_grads(model, opt, 5)
        return None if opt.step()[0] else "step after loading float64 state failed"
    return load_refused(opt_name, dtype, checkpoint, names)


def foreign_trial(opt_name: str, dtype: str, kind: str) -> str | None:
    seed = seed_from(f"foreign/{kind}/{opt_name}/{dtype}")
    if kind == "shapes":
        source = trained(opt_name, dtype, seed, hidden=24)[1]
    elif kind == "names":
        source = trained(opt_name, dtype, seed, prefix="trunk")[1]
    elif kind == "dtype":
        other = {"fp32": "bf16", "bf16": "fp16", "fp16": "fp32"}[dtype]
        source = trained(opt_name, other, seed)[1]
    else:  # another optimizer
        source = trained(OPTIMIZERS[(OPTIMIZERS.index(opt_name) + 1) % len(OPTIMIZERS)], dtype, seed)[1]
    names = {"shapes": ("shape",), "names": ("names", "body."), "dtype": ("main params", "scaler", "fp16", "bf16"),
             "optimizer": ("optimizer", "param group")}[kind]  # fmt: skip
    return load_refused(opt_name, dtype, copy.deepcopy(source.state_dict()), names)


@functools.cache
def keeps_step(opt_name: str) -> bool:
    """Whether the optimizer keeps a `step` in its per-param state (the step damages need one)."""
    return "step" in next(iter(trained(opt_name, "fp32", 0)[1].state_dict()["state"].values()))


def checkpoint_trials() -> Iterator[Trial]:
    for opt in OPTIMIZERS:
        damages = [d for d in DAMAGES if keeps_step(opt) or d not in ("negative-step", "step='abc'")]
        for dtype in DTYPES:
            yield f"{opt}/{dtype}/roundtrip", lambda o=opt, d=dtype: roundtrip_trial(o, d)
            for kind in ("shapes", "names", "dtype", "optimizer"):
                yield f"{opt}/{dtype}/foreign-{kind}", lambda o=opt, d=dtype, k=kind: foreign_trial(o, d, k)
            for how in [*damages, *(DAMAGES_16 if dtype != "fp32" else ()), *(DAMAGES_FP16 if dtype == "fp16" else ())]:
                yield f"{opt}/{dtype}/{how}", lambda o=opt, d=dtype, h=how: damaged_trial(o, d, h)


# ---- 4b. loads into a fresh optimizer ----------------------------------------------------------
# A fresh optimizer (no state of its own to compare with) loading a checkpoint whose state was
# damaged: each key of each param moved to another shape, dropped, joined by a foreign key, given
# another dtype kind or no data (meta). ValueError naming the param and the key, and the fresh
# optimizer's params and state_dict unchanged bit for bit. Also: the dynamic loss scale after a
# resume with a smaller loss_scale_window grows once the restored tracker reaches the new window;
# a damaged scheduler state is refused, naming the key, with the schedule and the groups unchanged.

LOAD_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {  # name: (optimizer, dtype, extra config)
    **{f"{opt}/{dtype}": (opt, dtype, {}) for opt in OPTIMIZERS for dtype in DTYPES},
    "adam/bf16-precision-aware": ("adam", "bf16", {"use_precision_aware_optimizer": True, "store_param_remainders": False}),
    "adam/bf16-remainders": ("adam", "bf16", {"use_precision_aware_optimizer": True, "store_param_remainders": True}),
    **{f"adaptive_muon-{m}/fp32": ("adaptive_muon", "fp32", {"adaptive_muon_moment2_method": m}) for m in ("normuon", "namo")},
}


def fresh(config: str, seed: int) -> tuple[nn.Module, Any]:
    opt, dtype_key, extra = LOAD_CONFIGS[config]
    dtype, flags = DTYPES[dtype_key]
    torch.manual_seed(seed)
    model = Net().to(dtype)
    return model, get_optimizer(OptimizerConfig(lr=1e-2, optimizer=opt, **flags, **extra), model)


@functools.cache
def source_state(config: str) -> dict[str, Any]:
    model, opt = fresh(config, seed_from(f"loads/source/{config}"))
    for k in range(2):
        set_grads(model, opt, k)
        assert opt.step()[0], "setup step failed"
    return copy.deepcopy(opt.state_dict())


def load_damage(value: Any, how: str) -> Any:
    """``value`` damaged as ``how`` says (None: this damage does not apply to it)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    if how == "larger":
        return torch.zeros([n + 1 for n in value.shape], dtype=value.dtype)
    if how == "reshaped":
        row = value.reshape(1, -1)
        return (row if row.shape != value.shape else value.reshape(-1, 1)).clone()
    if how == "int-kind":
        return value.to(torch.float32 if value.dtype == torch.int16 else torch.int32)
    if how == "meta":
        return torch.empty_like(value, device="meta")
    raise AssertionError(how)


def fresh_load_trial(config: str, param: str, key: str, how: str) -> str | None:
    checkpoint = copy.deepcopy(source_state(config))
    values = checkpoint["state"][param]
    if how == "missing":
        del values[key]
    elif how == "unknown":
        values["bogus_moment"] = torch.zeros(3)
        key = "bogus_moment"
    else:
        values[key] = load_damage(values[key], how)
    model, opt = fresh(config, seed_from(f"loads/target/{config}"))
    before = snapshot(model, opt)
    try:
        opt.load_state_dict(checkpoint)
    except ValueError as error:
        if param not in str(error) or key not in str(error):
            return f"ValueError does not name both {param!r} and {key!r}: {short(error)}"
    else:
        return "damaged state loaded into a fresh optimizer"
    return f"changed before raising: {r}" if (r := unchanged(model, opt, before)) else None


def fresh_roundtrip_trial(config: str) -> str | None:
    model, opt = fresh(config, seed_from(f"loads/target/{config}"))
    opt.load_state_dict(copy.deepcopy(source_state(config)))
    if d := first_difference(source_state(config)["state"], opt.state_dict()["state"], "state"):
        return f"after load: {d}"
    set_grads(model, opt, 3)
    return None if opt.step()[0] else "step after an undamaged load failed"


def window_trial(saved_window: int, window: int, tracker: int) -> str | None:
    """fp16, dynamic scale: a tracker saved under another window, then clean steps. The scale must
    double at each step where the count of clean steps since the last growth reaches ``window``."""
    def build(w: int) -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = Net().half()
        config = OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=1024.0, loss_scale_window=w)
        return model, get_optimizer(config, model)

    _, source = build(saved_window)
    checkpoint = copy.deepcopy(source.state_dict())
    checkpoint["grad_scaler"]["growth_tracker"] = tracker
    model, opt = build(window)
    opt.load_state_dict(checkpoint)
    count, scale = tracker, 1024.0
    for step in range(2 * window + 1):
        set_grads(model, opt, step)
        if not opt.step()[0]:
            return f"clean step {step} skipped"
        count += 1
        if count >= window:  # by hand: grow, and count again from zero
            count, scale = 0, scale * 2
        if (got := float(opt.get_loss_scale())) != scale:
            return f"after clean step {step + 1} from tracker {tracker} with window {window}: scale {got}; expected {scale}"
    return None


SCHED_DAMAGES: dict[str, tuple[Any, ...]] = {
    "max_lr": ("abc", None, NAN, -1.0, True), "min_lr": ("abc", NAN, -1.0, 1.0), "lr_warmup_steps": (-1, 1.5, "2", 10, True),
    "lr_decay_steps": (0, -1, 1.5, None), "lr_decay_style": ("abc", None, 1, "Cosine"), "num_steps": (-1, 1.5, "3", None, True),
    "start_wd": (-1.0, NAN, "abc"), "end_wd": (-1.0, NAN, None), "wd_incr_style": ("abc", None, "Linear"),
    "wd_incr_steps": (-1, 1.5, 0, "10"),
}  # fmt: skip


def sched_load_trial(key: str, value: Any) -> str | None:
    sched = scheduler(use_checkpoint_opt_param_scheduler=True)  # the checkpoint's values are taken: each must be checked
    sched.step(3)
    checkpoint = {**sched.state_dict(), key: value}
    if value is None:
        del checkpoint[key]
    before = (copy.deepcopy({k: v for k, v in vars(sched).items() if k != "optimizer"}), [dict(g, params=None) for g in sched.optimizer.param_groups])
    if reason := expect_raise(lambda: sched.load_state_dict(checkpoint), (key,), (ValueError, TypeError, KeyError)):
        return reason
    after = ({k: v for k, v in vars(sched).items() if k != "optimizer"}, [dict(g, params=None) for g in sched.optimizer.param_groups])
    return None if repr(before) == repr(after) else "scheduler or groups changed before raising"


def sched_group_range_trial() -> str | None:
    """Settings valid alone that a group's own wd range refuses (constant wd, start_wd != end_wd)."""
    sched = scheduler(use_checkpoint_opt_param_scheduler=True, start_wd=0.1, end_wd=0.1)
    for group in sched.optimizer.param_groups:
        group.update(start_wd=0.0, end_wd=0.1)
    sched.step(3)
    checkpoint = {**sched.state_dict(), "wd_incr_style": "constant", "lr_decay_style": "linear"}
    before = repr(({k: v for k, v in vars(sched).items() if k != "optimizer"}, [dict(g, params=None) for g in sched.optimizer.param_groups]))
    if reason := expect_raise(lambda: sched.load_state_dict(checkpoint), ("wd_incr_style", "start_wd")):
        return reason
    after = repr(({k: v for k, v in vars(sched).items() if k != "optimizer"}, [dict(g, params=None) for g in sched.optimizer.param_groups]))
    return None if before == after else "scheduler or groups changed before raising"


def fresh_load_trials() -> Iterator[Trial]:
    for config in LOAD_CONFIGS:
        yield f"{config}/roundtrip", lambda c=config: fresh_roundtrip_trial(c)
        for param, values in source_state(config)["state"].items():
            for key, value in values.items():
                for how in ("missing", "larger", "reshaped", "int-kind", "meta"):
                    if how == "missing" or load_damage(value, how) is not None:
                        yield f"{config}/{param}/{key}/{how}", lambda c=config, p=param, k=key, h=how: fresh_load_trial(c, p, k, h)
            yield f"{config}/{param}/unknown-key", lambda c=config, p=param: fresh_load_trial(c, p, "", "unknown")
    for saved_window, window, tracker in ((8, 3, 5), (1000, 4, 500), (8, 8, 7), (3, 1, 2), (16, 5, 0)):
        yield f"scaler/window-{saved_window}-to-{window}/tracker-{tracker}", lambda s=saved_window, w=window, t=tracker: window_trial(s, w, t)
    for key, values in SCHED_DAMAGES.items():
        for value in values:
            yield f"scheduler/{key}={value!r}", lambda k=key, v=value: sched_load_trial(k, v)
    yield "scheduler/group-wd-range", sched_group_range_trial


# ---- 5. scheduler ----------------------------------------------------------------------------
# Wrong-typed or out-of-range arguments: ValueError/TypeError naming the argument, raised before
# anything changes (step(bad) leaves num_steps and every group's lr as they were).

SCHED = dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="cosine",
             start_wd=0.0, end_wd=0.1, wd_incr_steps=10, wd_incr_style="linear")  # fmt: skip
WSD = dict(lr_decay_style="WSD", wsd_decay_steps=4, lr_wsd_decay_style="linear")


def scheduler(**changes: Any) -> OptimizerParamScheduler:
    model = Net()
    return OptimizerParamScheduler(get_optimizer(OptimizerConfig(lr=1e-3), model), **{**SCHED, **changes})


def step_refused(increment: Any) -> str | None:
    sched = scheduler()
    sched.step(3)
    lrs = [g["lr"] for g in sched.optimizer.param_groups]
    if reason := expect_raise(lambda: sched.step(increment), ("increment", "step")):
        return reason
    if sched.num_steps != 3 or lrs != [g["lr"] for g in sched.optimizer.param_groups]:
        return "changed num_steps or lr before raising"
    return None


def scheduler_trials() -> Iterator[Trial]:
    floats = ("abc", None, NAN, INF, -INF, -1.0, True, [1], 10**400)
    steps = ("abc", None, NAN, INF, -1, 1.5, True, [1], "5")
    styles = ("abc", None, 1, "Cosine")
    flags = ("abc", None, 1.5)
    table = {**{k: floats for k in ("init_lr", "max_lr", "min_lr", "start_wd", "end_wd")},
             **{k: steps for k in ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")},
             "lr_decay_style": styles, "wd_incr_style": styles,
             "use_checkpoint_opt_param_scheduler": flags, "override_opt_param_scheduler": flags}  # fmt: skip
    for arg, values in table.items():
        for value in values:
            yield f"{arg}={short(repr(value), 12)}", lambda a=arg, v=value: expect_raise(lambda: scheduler(**{a: v}), (a,))
    for arg, values in (("wsd_decay_steps", ("abc", NAN, -1, 1.5, True)), ("lr_wsd_decay_style", styles)):
        for value in values:
            yield f"WSD:{arg}={short(repr(value), 12)}", lambda a=arg, v=value: expect_raise(lambda: scheduler(**{**WSD, a: v}), (a,))
    for value in ("1", NAN, -1, 1.5, True, None, INF, [1]):
        yield f"step({short(repr(value), 12)})", lambda v=value: step_refused(v)
    for key, value in (("num_steps", -1), ("num_steps", "abc"), ("num_steps", 1.5), ("max_lr", NAN), ("lr_decay_style", "abc"),
                       ("lr_decay_steps", -5), ("min_lr", "abc"), ("wd_incr_style", None)):  # fmt: skip
        def load(k: str = key, v: Any = value) -> str | None:
            sched = scheduler(use_checkpoint_opt_param_scheduler=True)
            state = {**sched.state_dict(), k: v}
            return expect_raise(lambda: scheduler(use_checkpoint_opt_param_scheduler=True).load_state_dict(state), (k,))
        yield f"load_state_dict:{key}={value!r}", load
    yield "load_state_dict:missing-num_steps", lambda: expect_raise(
        lambda: scheduler().load_state_dict({k: v for k, v in scheduler().state_dict().items() if k != "num_steps"}),
        ("num_steps",), (KeyError, ValueError))  # KeyError for a missing key is documented
    yield "load_state_dict:None", lambda: expect_raise(lambda: scheduler().load_state_dict(None), ("state_dict",))  # type: ignore[arg-type]


# ---- 5b. quirks ------------------------------------------------------------------------------
# Input that parses and would train on something nobody meant (issue 24). Each is refused with a
# ValueError naming what decides (the key and line, the depth limit, the group's bounds and where
# each came from, both WSD values, the weight decay and wd_mult), or, for the controls, accepted
# with the value the spec gives (YAML 1.2 core: 0o17 = 15, 0x10 = 16; Megatron's cosine).


def recipe(text: str, fmt: str = "yaml") -> Any:
    from optzoo.config_file import parse_recipe

    return parse_recipe(text, fmt, where=f"quirk.{fmt}")  # type: ignore[arg-type]


def accepted(fn: Callable[[], Any], check: Callable[[Any], bool], what: str) -> str | None:
    try:
        value = fn()
    except Exception as error:  # noqa: BLE001 - a refused control is the finding
        return f"refused a valid input: {type(error).__name__}: {short(error)}"
    return None if check(value) else f"read {short(value, 80)}; expected {what}"


def plain_sgd(*groups: dict[str, Any]) -> torch.optim.SGD:
    return torch.optim.SGD(
        [{"params": [nn.Parameter(torch.zeros(2))], "param_names": [f"p{i}"], **g} for i, g in enumerate(groups)], lr=0.5
    )


def late_group_refused() -> str | None:
    optimizer = plain_sgd({})
    sched = OptimizerParamScheduler(optimizer, **SCHED)
    sched.step(3)
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "param_names": ["late"], "min_lr": 1.0})
    before = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups[:1]]
    if reason := expect_raise(lambda: sched.step(1), ("min_lr",)):
        return reason
    if sched.num_steps != 3 or before != [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups[:1]]:
        return "changed num_steps or a group before raising"
    return None


def quirk_trials() -> Iterator[Trial]:
    duplicates = {
        "config-lr": "config:\n  lr: 1e-3\n  weight_decay: 0.1\n  lr: 5.0\n",
        "top-level": "config:\n  lr: 1e-3\nconfig:\n  lr: 5.0\n",
        "set": "config: {lr: 1e-3}\noverrides:\n  - name: '*.bias'\n    set: {wd_mult: 0.0, wd_mult: 1.0}\n",
        "entry": "config: {lr: 1e-3}\noverrides:\n  - name: '*.bias'\n    name: '*.weight'\n    set: {wd_mult: 0.0}\n",
    }
    for name, text in duplicates.items():
        yield f"yaml-duplicate/{name}", lambda t=text: expect_raise(lambda: recipe(t), ("duplicate key",))
    yield "toml-duplicate/config-lr", lambda: expect_raise(lambda: recipe("[config]\nlr = 1e-3\nlr = 5.0\n", "toml"), ("invalid TOML",))
    for scalar in ("0755", "010", "1:30", "1:30.5", "1_000", "0b101", "yes", "no", "on", "off", "Yes", "OFF", "2024-01-01"):
        for field in ("lr", "loss_scale_window", "bf16"):
            text = f"config:\n  lr: 1e-3\n  {field}: {scalar}\n" if field != "lr" else f"config:\n  lr: {scalar}\n"
            yield f"yaml-1.1/{field}={scalar}", lambda t=text: expect_raise(lambda: recipe(t), ("ambiguous plain scalar",))
    yield "yaml-1.1/name=on", lambda: expect_raise(lambda: recipe("overrides:\n  - name: on\n    set: {wd_mult: 0.0}\n"), ("ambiguous",))
    controls: dict[str, tuple[str, Callable[[Any], bool], str]] = {
        "0o17": ("config:\n  lr: 1e-3\n  loss_scale_window: 0o17\n", lambda r: r[0].loss_scale_window == 15, "15"),
        "0x10": ("config:\n  lr: 1e-3\n  hysteresis: 0x10\n", lambda r: r[0].hysteresis == 16, "16"),
        "3e-4": ("config:\n  lr: 3e-4\n", lambda r: r[0].lr == 3e-4, "0.0003"),
        "true": ("config:\n  lr: 1e-3\n  bf16: true\n", lambda r: r[0].bf16 is True, "True"),
        "007": ("config:\n  lr: 1e-3\n  hysteresis: 007\n", lambda r: r[0].hysteresis == 7, "7 (1.1 and 1.2 agree)"),
        "quoted-on": ("overrides:\n  - name: 'on'\n    set: {wd_mult: 0.0}\n", lambda r: len(r[1]) == 1, "one rule"),
        "merge-key": ("config: {lr: 1e-3}\noverrides:\n  - &r {name: '*.bias', set: {wd_mult: 0.0}}\n  - <<: *r\n    name: '*.weight'\n",
                      lambda r: len(r[1]) == 2, "two rules"),
        "null": ("config:\n  lr: 1e-3\n  loss_scale: ~\n", lambda r: r[0].loss_scale is None, "None"),
    }  # fmt: skip
    for name, (text, check, what) in controls.items():
        yield f"yaml-1.2-control/{name}", lambda t=text, c=check, w=what: accepted(lambda: recipe(t), c, w)
    for levels in (33, 40, 1000, 100_000):
        toml = "[config]\nlr = 1e-3\n[[overrides]]\nname = " + "[" * levels + "]" * levels + "\n"
        yaml_text = "config: {lr: 1e-3}\noverrides:\n  - name: " + "[" * levels + "]" * levels + "\n"
        inline = "[[overrides]]\nname = '*'\nset = " + "{a = " * levels + "1" + "}" * levels + "\n"
        for fmt, text in (("toml", toml), ("yaml", yaml_text), ("toml-inline-tables", inline)):
            yield f"nested/{fmt}/{levels}", lambda t=text, f=fmt: expect_raise(
                lambda: recipe(t, f.split("-")[0]), ("nested too deeply",)
            )
    yield "nested/control-shipped-recipes", lambda: accepted(
        lambda: [load_recipe(name) for name in shipped_recipes()], lambda r: len(r) >= 3, "every shipped recipe"
    )
    # A group's own bounds against the scheduler's fallbacks (SCHED: max_lr 1e-3, min_lr 1e-4, wd 0 -> 0.1 linear).
    mixes: dict[str, tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]] = {
        "group-max_lr-below-sched-min_lr": ({"max_lr": 1e-5}, {}, ("min_lr",)),
        "group-min_lr-above-sched-max_lr": ({"min_lr": 1e-2}, {}, ("min_lr",)),
        "group-start_wd-above-sched-end_wd": ({"start_wd": 0.5}, {}, ("start_wd",)),
        "sched-start_wd-above-group-end_wd": ({"end_wd": 0.0}, {"start_wd": 0.05}, ("start_wd",)),
        "group-start_wd-above-end_wd-cosine": ({"start_wd": 0.5}, {"wd_incr_style": "cosine"}, ("start_wd",)),
        "init_lr-above-group-max_lr": ({"max_lr": 1e-5, "min_lr": 0.0}, {"init_lr": 1e-4}, ("init_lr",)),
        "constant-wd-group-start-differs": ({"start_wd": 0.5}, {"wd_incr_style": "constant", "start_wd": 0.1}, ("start_wd",)),
        "group-min_lr-nan": ({"min_lr": NAN}, {}, ("min_lr",)),
        "group-max_lr-negative": ({"max_lr": -1.0}, {}, ("max_lr",)),
        "group-end_wd-inf": ({"end_wd": INF}, {}, ("end_wd",)),
        "group-wd_mult-overflow": ({"wd_mult": 1e10}, {"end_wd": 1e300}, ("wd_mult",)),
        "group-wd_mult-nan": ({"wd_mult": NAN}, {}, ("wd_mult",)),
    }
    for name, (group, changes, names) in mixes.items():
        yield f"scheduler-mix/{name}", lambda g=group, c=changes, n=names: expect_raise(
            lambda: OptimizerParamScheduler(plain_sgd({}, g), **{**SCHED, **c}), n
        )
    yield "scheduler-mix/get_optimizer-max_lr-below-sched-min_lr", lambda: expect_raise(
        lambda: OptimizerParamScheduler(get_optimizer(OptimizerConfig(lr=1e-3), Net(), {ParamKey(name="*.bias"): {"max_lr": 1e-5}}), **SCHED),
        ("min_lr",),
    )
    yield "scheduler-mix/group-added-later", late_group_refused

    def cosine_mix() -> str | None:
        optimizer = plain_sgd({"min_lr": 2e-4})
        sched = OptimizerParamScheduler(optimizer, **{**SCHED, "lr_warmup_steps": 0})
        sched.step(5)  # Megatron's cosine: min + (1 + cos(pi * 5/10)) / 2 * (max - min)
        want = 2e-4 + 0.5 * (1e-3 - 2e-4)
        return None if math.isclose(optimizer.param_groups[0]["lr"], want, rel_tol=1e-15) else f"lr {optimizer.param_groups[0]['lr']} != {want}"

    yield "scheduler-mix/control-consistent-mix", cosine_mix
    for warmup, decay, wsd in ((2, 10, 9), (2, 10, 11), (0, 10, 11), (5, 10, 6), (2, 10, 10**6)):
        yield f"wsd/warmup={warmup}-decay={decay}-anneal={wsd}", lambda w=warmup, d=decay, a=wsd: expect_raise(
            lambda: scheduler(**{**WSD, "lr_warmup_steps": w, "lr_decay_steps": d, "wsd_decay_steps": a}), ("wsd_decay_steps=",), (ValueError,)
        )
    yield "wsd/control-anneal=window", lambda: accepted(
        lambda: scheduler(**{**WSD, "lr_warmup_steps": 2, "lr_decay_steps": 10, "wsd_decay_steps": 8}), lambda s: s.wsd_decay_steps == 8, "accepted"
    )
    for wd, override in ((1e308, {"wd_mult": 10.0}), (1e308, {"wd_mult": 2.0}), (1e200, {"wd_mult": 1e200}),
                         (0.1, {"start_wd": 1e308, "end_wd": 1e308, "wd_mult": 2.0})):  # fmt: skip
        yield f"wd-overflow/wd={wd}-{short(override, 40)}", lambda w=wd, o=override: expect_raise(
            lambda: get_optimizer(OptimizerConfig(lr=1e-3, weight_decay=w), Net(), {BIAS: o}), ("wd_mult",)
        )
    yield "wd-overflow/control-1e300x10", lambda: accepted(
        lambda: get_optimizer(OptimizerConfig(lr=1e-3, weight_decay=1e300), Net(), {BIAS: {"wd_mult": 10.0}}),
        lambda o: max(g["weight_decay"] for g in o.param_groups) == 1e301, "weight decay 1e301",
    )


# ---- 6. CLI ----------------------------------------------------------------------------------
# Every bad invocation: exit status 2, no traceback, and stderr's last line starts with
# "optzoo: error:" (docs/cli.md, "Output streams and exit codes"). Run as `python -m optzoo.cli`
# (pyproject's entry point is optzoo.cli:main), two at a time.

CLI_MODULES = {  # --model package.module:callable targets, on PYTHONPATH
    "raising.py": "def build():\n    raise RuntimeError('model boom')\n",
    "syntaxerr.py": "def build(:\n    pass\n",
    "importraise.py": "raise RuntimeError('boom at import')\n",
    "exits.py": "import sys\ndef build():\n    sys.exit(3)\n",
    "recursive.py": "def build():\n    return build()\n",
    "frozen.py": "import torch\ndef build():\n    return torch.nn.Linear(2, 2).requires_grad_(False)\n",
    "notmodule.py": "def build():\n    return 42\n",
    "badjson/config.json": "{not json",
}
CLI_CONFIGS = {  # --config files, each bad in its own way
    "bad.toml": "[config\nlr = ",
    "strlr.toml": '[config]\nlr = "3e-4"\n',
    "nanlr.toml": "[config]\nlr = nan\n",
    "unknownfield.toml": "[config]\nlrr = 1e-3\n",
    "unknowntop.toml": "[confg]\nlr = 1e-3\n",
    "emptyset.toml": '[config]\nlr = 1e-3\n[[overrides]]\nname = "*.bias"\nset = {}\n',
    "badwdmult.toml": '[config]\nlr = 1e-3\n[[overrides]]\nname = "*.bias"\nset = { wd_mult = "abc" }\n',
    "conflict.toml": '[config]\nlr = 1e-3\n[[overrides]]\nname = "*.bias"\nset = { lr = 1e-4 }\n'
                     '[[overrides]]\nname = "decoder.*"\nset = { lr = 2e-4 }\n',
    "namenotstr.toml": '[config]\nlr = 1e-3\n[[overrides]]\nname = 5\nset = { wd_mult = 0.0 }\n',
    "badpredicate.toml": '[config]\nlr = 1e-3\n[[overrides]]\npredicate = "nope"\nset = { wd_mult = 0.0 }\n',
    "bad.yaml": "config: [unclosed\n",
    "nanlr.yaml": "config:\n  lr: .nan\n",
    "binary.toml": b"\xff\xfe\x00\x81lr",
    "raise.py": "raise RuntimeError('config boom')\n",
    "syntax.py": "config = (\n",
    "noconfig.py": "x = 1\n",
    "exit.py": "import sys\nsys.exit(0)\n",
    # issue 24: read without complaint before, each meaning something nobody meant (or a traceback)
    "dup.yaml": "config:\n  lr: 1e-3\n  lr: 5.0\n",
    "octal.yaml": "config:\n  lr: 1e-3\n  loss_scale_window: 0755\n",
    "sexagesimal.yaml": "config:\n  lr: 1e-3\n  hysteresis: 1:30\n",
    "yesbool.yaml": "config:\n  lr: 1e-3\n  bf16: yes\n",
    "deep.toml": "[config]\nlr = 1e-3\n[[overrides]]\nname = " + "[" * 100_000 + "]" * 100_000 + "\n",
    "deep40.toml": "[config]\nlr = 1e-3\n[[overrides]]\nname = " + "[" * 40 + "]" * 40 + "\n",
    "deep.yaml": "config:\n  lr: 1e-3\noverrides:\n  - name: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "loggerdir.toml": '[config]\nlr = 1e-3\nconfig_logger_dir = "bad.toml/logs"\n',  # bad.toml is a file (cwd: tmp)
    "wdoverflow.toml": '[config]\nlr = 1e-3\nweight_decay = 1e308\n[[overrides]]\nname = "*.bias"\nset = { wd_mult = 10.0 }\n',
}  # fmt: skip
CLI_EXPECT = {  # words the error line must hold besides the "optzoo: error:" prefix
    "config:dup.yaml": ("dup.yaml", "line 3", "duplicate key 'lr'"),
    "config:octal.yaml": ("octal.yaml", "'0755'", "493"),
    "config:sexagesimal.yaml": ("sexagesimal.yaml", "'1:30'"),
    "config:yesbool.yaml": ("yesbool.yaml", "'yes'"),
    "config:deep.toml": ("deep.toml", "nested too deeply", "32"),
    "config:deep40.toml": ("deep40.toml", "nested too deeply", "32"),
    "config:deep.yaml": ("deep.yaml", "nested too deeply", "32"),
    "config:loggerdir.toml": ("config_logger_dir", "bad.toml"),
    "config:wdoverflow.toml": ("weight_decay", "wd_mult", "1e+308"),
    "model:hf-bad-json": ("config.json", "line 1 column 2"),
}


def cli_cases(tmp: str) -> list[tuple[str, list[str]]]:
    dump = ["dump-param-groups", "--model", "gpt"]
    cases = [(f"config:{name}", [*dump, "--config", os.path.join(tmp, name)]) for name in CLI_CONFIGS]
    cases += [
        ("config:missing", [*dump, "--config", "/nonexistent/cfg.toml"]),
        ("config:directory", [*dump, "--config", tmp]),
        ("config:under-a-file", [*dump, "--config", os.path.join(tmp, "bad.toml", "x.toml")]),
        ("config:over-long-path", [*dump, "--config", "x" * 5000 + ".toml"]),
        ("config:unknown-recipe", [*dump, "--config", "muon-llmx"]),
        ("model:raises", ["dump-param-groups", "--model", "raising:build"]),
        ("model:syntax-error", ["dump-param-groups", "--model", "syntaxerr:build"]),
        ("model:raises-at-import", ["lint", "--model", "importraise:build"]),
        ("model:sys.exit", ["dump-param-groups", "--model", "exits:build"]),
        ("model:recursion", ["dump-param-groups", "--model", "recursive:build"]),
        ("model:no-trainable-params", ["dump-param-groups", "--model", "frozen:build"]),
        ("model:returns-int", ["dump-param-groups", "--model", "notmodule:build"]),
        ("model:missing-module", ["dump-param-groups", "--model", "no_such_module_xyz:build"]),
        ("model:missing-attr", ["dump-param-groups", "--model", "raising:nope"]),
        ("model:not-callable", ["dump-param-groups", "--model", "os:sep"]),
        ("model:hf-unknown-class", ["dump-param-groups", "--model", "hf:NoSuchConfigXyz"]),
        ("model:hf-bad-json", ["dump-param-groups", "--model", f"hf:{os.path.join(tmp, 'badjson', 'config.json')}"]),
        ("world-size:10**30", [*dump, "--world-size", str(10**30)]),
        ("world-size:0", [*dump, "--world-size", "0"]),
        ("distributed-mode-alone", [*dump, "--distributed-mode", "sharded"]),
        ("expert-world-size:3of4", [*dump, "--world-size", "4", "--expert-world-size", "3"]),
        ("demo:steps=-1", ["demo", "--steps", "-1"]),
        ("unknown-subcommand", ["frobnicate"]),
    ]
    return cases


def run_cli(argv: list[str], tmp: str, words: tuple[str, ...] = ()) -> str | None:
    path = os.pathsep.join(p for p in (tmp, ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run([sys.executable, "-m", "optzoo.cli", *argv], capture_output=True, text=True, env=env,
                              timeout=90, cwd=tmp, errors="replace")  # fmt: skip
    except subprocess.TimeoutExpired:
        return "timed out after 90 s"
    lines = proc.stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    if "Traceback" in proc.stderr:
        return f"exit {proc.returncode} with a traceback ending: {short(last, 100)}"
    if proc.returncode != 2:
        return f"exit {proc.returncode} (expected 2); stderr: {short(last, 100)}"
    if not last.startswith("optzoo: error:"):
        return f"last stderr line: {short(last, 100)}"
    missing = [word for word in words if word not in last]
    return f"error line lacks {missing}: {short(last, 160)}" if missing else None


# ---- 7. distributed ---------------------------------------------------------------------------
# Two gloo ranks on CPU (torchrun --standalone), one launch for all trials; each rank writes its
# verdicts and a trial fails when either rank's does. Per mode x optimizer x dtype:
#   match: two unclipped steps give the params of a single-process optimizer on the same grads
#     (<= 1e-6). Not clipped: the clip norm is a float32 sum in another order (documented ~1e-7
#     relative), which SOAP's first steps amplify to ~1e-2 in the params, distributed or not;
#   norm: the returned grad_norm is the single-process one to 1e-6 (relative);
#   nan-all / nan-one-rank: NaN grads on every rank, or on rank 1 only, skip the step on every
#     rank and change nothing (docs: the inf/NaN flag is MAX-reduced);
#   roundtrip: the consolidated state_dict through torch.save/load(weights_only=True) into a
#     fresh distributed optimizer: bitwise, and one more step bitwise;
#   foreign: a checkpoint of other shapes: ValueError on every rank, nothing changed.
# Every rank makes the same collective calls in the same order (no early return between them).

DIST_FLAGS = {"layer_wise": {"use_layer_wise_distributed_optimizer": True}, "sharded": {"use_distributed_optimizer": True}}


def dist_make(opt_name: str, dtype: str, mode: str, seed: int, clip: float = 1.0, **net: Any) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = Net(**net).to(DTYPES[dtype][0])
    config = OptimizerConfig(lr=1e-2, optimizer=opt_name, clip_grad=clip, **DTYPES[dtype][1], **DIST_FLAGS[mode])
    return model, get_optimizer(config, model)


def dist_check(opt_name: str, dtype: str, mode: str, check: str) -> str | None:
    import torch.distributed as dist

    seed = seed_from(f"dist/{opt_name}/{dtype}/{mode}/{check}")
    if check in ("match", "norm"):  # "match" without clipping: its norm is a float32 sum in another order
        clip = 0.0 if check == "match" else 1.0
        (model, opt), (ref_model, ref) = dist_make(opt_name, dtype, mode, seed, clip), make(opt_name, dtype, seed, clip)
        norms = []
        for k in range(2):
            for m, o in ((model, opt), (ref_model, ref)):
                set_grads(m, o, seed + k)
                norms.append(o.step()[1])
        if check == "norm":
            worst = max(abs(a - b) / b for a, b in zip(norms[::2], norms[1::2]))
            return None if worst <= 1e-6 else f"grad_norm differs from one process's by {worst:.3g} (relative)"
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(model.parameters(), ref_model.parameters()))
        return None if worst <= 1e-6 else f"params differ from one process's by {worst:.3g}"
    model, opt = dist_make(opt_name, dtype, mode, seed)
    set_grads(model, opt, seed + 1)
    warm = opt.step()
    opt.zero_grad()
    if check in ("nan-all", "nan-one-rank"):
        set_grads(model, opt, seed + 2)
        if check == "nan-all" or dist.get_rank() == 1:
            for p in model.parameters():  # every param, so whichever rank owns it sees one
                p.grad.view(-1)[0] = NAN
        before = snapshot(model, opt)
        result = opt.step()
        changed = unchanged(model, opt, before, ignore=("grad_scaler",))
        return (f"warm-up {warm}" if not warm[0] else f"NaN step returned {result}" if result != (False, None, None)
                else f"NaN step changed {changed}" if changed else None)  # fmt: skip
    if check == "roundtrip":
        checkpoint = saved(opt)
        model_b, opt_b = dist_make(opt_name, dtype, mode, seed + 99)
        model_b.load_state_dict(model.state_dict())
        opt_b.load_state_dict(checkpoint)
        loaded = first_difference(opt.state_dict(), opt_b.state_dict(), "state_dict")
        for m, o in ((model, opt), (model_b, opt_b)):
            set_grads(m, o, seed + 7)
            o.step()
        stepped = first_difference(list(model.parameters()), list(model_b.parameters()), "params after step")
        return f"after load: {loaded}" if loaded else stepped
    if check == "foreign":
        checkpoint = copy.deepcopy(dist_make(opt_name, dtype, mode, seed, hidden=24)[1].state_dict())
        before = snapshot(model, opt)
        refused = expect_raise(lambda: opt.load_state_dict(checkpoint), ("shape",), (ValueError,))
        changed = unchanged(model, opt, before)
        return refused or (f"changed before raising: {changed}" if changed else None)
    raise AssertionError(check)


# Issue 24: ranks that disagree on something that changes the collectives (a get_optimizer
# argument or a config field) raise a ValueError on every rank naming it, at build time, instead
# of hanging at the first step; and a layer-wise owner's non-contiguous params (transposed, with
# gaps) reach every rank: two steps give one process's params (<= 1e-6; bitwise for element-wise).


class _Timers:
    """Megatron-style timers: ``timers(name, log_level=1)`` with ``start(barrier=...)``/``stop()``."""

    def __call__(self, name: str, log_level: int = 1) -> "_Timers":
        return self

    def start(self, barrier: bool = False) -> None:
        if barrier:
            import torch.distributed as dist

            dist.barrier()

    def stop(self, barrier: bool = False) -> None:
        pass


DISAGREE: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {  # rank 1's config changes, its kwargs, the key named
    "param_sync": ({}, {"param_sync": "broadcast"}, "param_sync = "),
    "lr": ({"lr": 2e-2}, {}, "#0 lr = "),
    "clip_grad": ({"clip_grad": 0.5}, {}, "clip_grad = "),
    "fold_clip_and_scale": ({"fold_clip_and_scale": False}, {}, "fold_clip_and_scale = "),
    "log_num_zeros_in_grad": ({"log_num_zeros_in_grad": True}, {}, "log_num_zeros_in_grad = "),
    "grad_norm_skip_threshold": ({"grad_norm_skip_threshold": 10.0}, {}, "grad_norm_skip_threshold = "),
    "fp16": ({"fp16": True}, {}, "fp16 = "),
    "bf16": ({"bf16": True}, {}, "bf16 = "),
    "barrier_with_L1_time": ({"barrier_with_L1_time": True}, {}, "barrier_with_L1_time = "),
    "timers-with-barrier": ({"timers": _Timers()}, {}, "timer barriers (timers set and barrier_with_L1_time) = "),
    "other-flag": ({}, {}, "use_distributed_optimizer = "),
    "expert_group": ({}, {}, "expert data-parallel group size = "),
}


def disagree_trial(mode: str, setting: str) -> str | None:
    import torch.distributed as dist

    rank = dist.get_rank()
    changes, kwargs, key = DISAGREE[setting]
    model = Net()
    barrier = {"barrier_with_L1_time": True} if setting == "timers-with-barrier" else {}
    config = OptimizerConfig(lr=1e-2, **DIST_FLAGS[mode], **barrier)
    if setting == "other-flag" and rank == 1:
        config = OptimizerConfig(lr=1e-2, **DIST_FLAGS["sharded" if mode == "layer_wise" else "layer_wise"])
    elif rank == 1:
        config = config.replace(**changes)
    kwargs = kwargs if rank == 1 else {}
    if setting == "expert_group":
        model.body[2].weight.allreduce = False  # type: ignore[union-attr]  # Megatron's expert tag
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
        kwargs = {"expert_process_group": singles[0]} if rank == 0 else {}
    try:
        get_optimizer(config, model, lint=False, **kwargs)
    except ValueError as error:
        message, other = str(error), 1 - rank
        expected = f"distributed optimizer: rank {other} resolved other settings than rank {rank}; got "
        if not message.startswith(expected) or key not in message:
            return f"does not name {key.strip()!r} (rank {other} against {rank}): {short(message)}"
        return None
    except Exception as error:  # noqa: BLE001 - the wrong type is the finding
        return f"wrong exception {type(error).__name__}: {short(error)}"
    return "built: the ranks' disagreement went unnoticed"


class OddLayouts(nn.Module):
    """Params ``view(-1)`` cannot flatten: a transpose and a column slice with gaps, beside a dense one."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.transposed = nn.Parameter(torch.randn(5, 7).t())
        self.gapped = nn.Parameter(torch.randn(6, 8)[:, ::2])
        self.dense = nn.Parameter(torch.randn(4, 3))


def noncontig_trial(opt_name: str) -> str | None:
    seed = seed_from(f"noncontig/{opt_name}")
    runs = []
    for flags in (DIST_FLAGS["layer_wise"], {}):
        model = OddLayouts(seed)
        optimizer = get_optimizer(OptimizerConfig(lr=1e-2, optimizer=opt_name, clip_grad=0.0, standard_overrides=False, **flags), model, {}, lint=False, trace=False)
        for step in range(2):
            generator = torch.Generator().manual_seed(seed + step)
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator)
            optimizer.step()
        if model.transposed.stride() != (1, 7) or model.gapped.stride() != (8, 2):
            return f"layouts changed: {model.transposed.stride()}, {model.gapped.stride()}"
        runs.append(list(model.parameters()))
    worst = max(float((a - b).abs().max()) for a, b in zip(*runs))
    return None if worst <= 1e-6 else f"params differ from one process's by {worst:.3g}"


def dist_trials() -> Iterator[Trial]:
    for mode in DIST_FLAGS:
        for opt in OPTIMIZERS:
            for dtype in DTYPES:
                for check in ("match", "norm", "nan-all", "nan-one-rank", "roundtrip", "foreign"):
                    yield f"{mode}/{opt}/{dtype}/{check}", lambda o=opt, d=dtype, m=mode, c=check: dist_check(o, d, m, c)
        for setting in DISAGREE:
            yield f"{mode}/disagree/{setting}", lambda m=mode, s=setting: disagree_trial(m, s)
    for opt in OPTIMIZERS:
        yield f"layer_wise/noncontig/{opt}", lambda o=opt: noncontig_trial(o)


def dist_worker(out: str, quick: bool) -> int:
    """One rank of the distributed category (started by torchrun): writes rank<N>.json to ``out``."""
    import datetime
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a desync fails, not hangs
    verdicts = [(name, run_trial(run, seed_from(name))) for name, run in dist_trials() if selected("distributed", name, quick)]
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(verdicts, f)
    dist.destroy_process_group()
    return 0


def dist_results(quick: bool) -> list[tuple[str, str | None]]:
    import json

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   os.path.abspath(__file__), "--dist-worker", out, *(["--quick"] if quick else [])]  # fmt: skip
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=400, errors="replace")
        except subprocess.TimeoutExpired:
            return [("launch", "2-rank launch timed out after 400 s")]
        ranks = []
        for rank in range(2):
            path = os.path.join(out, f"rank{rank}.json")
            if not os.path.exists(path):
                return [("launch", f"rank {rank} wrote no results (exit {proc.returncode}): {short(proc.stderr[-300:])}")]
            with open(path) as f:
                ranks.append(dict(json.load(f)))
    return [(name, next((f"rank {r}: {v[name]}" for r, v in enumerate(ranks) if v.get(name)), None)) for name in ranks[0]]


# ---- driver ----------------------------------------------------------------------------------

CATEGORIES: dict[str, Callable[[], Iterator[Trial]]] = {
    "config": config_trials, "routing": routing_trials, "step": step_trials, "faults": fault_attack_trials,
    "checkpoint": checkpoint_trials, "loads": fresh_load_trials, "scheduler": scheduler_trials, "quirks": quirk_trials,
}  # fmt: skip


def selected(category: str, name: str, quick: bool) -> bool:
    return not quick or seed_from(f"{category}/{name}") % 10 == 0


def run_trial(run: Callable[[], str | None], seed: int) -> str | None:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # routing lint, Newton-Schulz, transformers: noise here
        try:
            return run()
        except Exception as error:  # noqa: BLE001 - an exception escaping a trial is a finding
            return f"unexpected {type(error).__name__}: {short(error)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="run the ~10%% of trials whose name hashes to 0 mod 10")
    parser.add_argument("--only", nargs="+", choices=[*CATEGORIES, "cli", "distributed"], help="run these categories only")
    parser.add_argument("--dist-worker", metavar="DIR", help=argparse.SUPPRESS)  # internal: one torchrun rank
    args = parser.parse_args()
    logging.disable(logging.ERROR)  # optzoo, torch (dynamo) and transformers log notices we do not grade
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.dist_worker:
        return dist_worker(args.dist_worker, args.quick)
    results: list[tuple[str, str, str | None]] = []
    timings: dict[str, float] = {}
    for category, generate in CATEGORIES.items():
        if args.only and category not in args.only:
            continue
        start = time.perf_counter()
        for name, run in generate():
            if selected(category, name, args.quick):
                results.append((category, name, run_trial(run, seed_from(f"{category}/{name}"))))
        timings[category] = time.perf_counter() - start
    if not args.only or "cli" in args.only:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            for name, content in {**CLI_MODULES, **CLI_CONFIGS}.items():
                path = os.path.join(tmp, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(content if isinstance(content, bytes) else content.encode())
            cases = [(n, a) for n, a in cli_cases(tmp) if selected("cli", n, args.quick)]
            with ThreadPoolExecutor(max_workers=2) as pool:  # subprocesses: two at a time on 2 cores
                outcomes = list(pool.map(lambda case: run_cli(case[1], tmp, CLI_EXPECT.get(case[0], ())), cases))
            results += [("cli", name, outcome) for (name, _), outcome in zip(cases, outcomes)]
        timings["cli"] = time.perf_counter() - start
    if not args.only or "distributed" in args.only:
        start = time.perf_counter()
        results += [("distributed", name, reason) for name, reason in dist_results(args.quick)]
        timings["distributed"] = time.perf_counter() - start

    rows = []
    for category in timings:
        mine = [r for r in results if r[0] == category]
        failed = sum(r[2] is not None for r in mine)
        rows.append([category, len(mine), len(mine) - failed, failed, f"{timings[category]:.1f}"])
    failures = [r for r in results if r[2] is not None]
    rows.append(["TOTAL", len(results), len(results) - len(failures), len(failures), f"{sum(timings.values()):.1f}"])
    print(f"optzoo campaign ({'quick, ' if args.quick else ''}torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(tabulate(rows, headers=["category", "trials", "pass", "fail", "seconds"], tablefmt="github"))
    if failures:
        print("\nfailing trials:")
        for category, name, reason in failures:
            print(f"  {category}/{name}: {reason}")
    print(f"\nFAILURES: {len(failures)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
