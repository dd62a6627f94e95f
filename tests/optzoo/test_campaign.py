"""Issue 15's adversarial campaign: each root cause it found, as a test that failed before the fix.

Sections follow the issue's items; each test names its item. Messages are matched by regex.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any
import re
import warnings

import pytest
import torch
from torch import nn

from optzoo import OptimizerConfig, get_optimizer


class TwoBranches(nn.Module):
    """Branch ``b`` is used only when asked: an unused branch, or an expert no token reached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def loss(self, use_b: bool) -> torch.Tensor:
        x = torch.randn(3, 4, dtype=self.a.weight.dtype)
        out = self.a(x) + (self.b(x) if use_b else 0)
        return out.float().square().mean()


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# ---- 1. stale main grads under bf16/fp16 ------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_item1_a_param_without_a_new_gradient_is_not_stepped_again(precision: str) -> None:
    """transformers.Trainer calls model.zero_grad(), not optimizer.zero_grad(): the fp32 main
    grads of the earlier step must not be stepped again for a branch with no new gradient."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model = TwoBranches().to(dtype)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, **{precision: True}, loss_scale=1.0 if precision == "fp16" else None), model)
    model.loss(use_b=True).backward()
    assert optimizer.step()[0]
    before = _snapshot(model.b)
    model.zero_grad()  # what the Trainer does
    model.loss(use_b=False).backward()
    assert optimizer.step()[0]
    after = _snapshot(model.b)
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_item1_a_skipped_nan_gradient_never_reaches_the_weights(precision: str) -> None:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model = TwoBranches().to(dtype)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, **{precision: True}, loss_scale=1.0 if precision == "fp16" else None), model)
    model.loss(use_b=True).backward()
    assert model.b.weight.grad is not None
    model.b.weight.grad[0, 0] = float("nan")
    before = _snapshot(model)
    assert not optimizer.step()[0]  # skipped
    assert not optimizer.step()[0] or all(torch.equal(before[n], p) for n, p in model.named_parameters())  # again, no backward
    model.zero_grad()
    model.loss(use_b=False).backward()
    assert optimizer.step()[0]
    assert torch.equal(before["b.weight"], model.b.weight.detach())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(before["a.weight"], model.a.weight.detach())


# ---- 2. state of other shapes at load ---------------------------------------------------------


@pytest.mark.parametrize("optimizer_name", ["adam", "sgd", "lion", "muon", "soap"])
def test_item2_a_checkpoint_of_another_hidden_size_is_refused_before_anything_changes(optimizer_name: str) -> None:
    """Same names, other shapes: fused CPU kernels would read the smaller state out of bounds."""
    config = OptimizerConfig(optimizer=optimizer_name, lr=0.01, sgd_momentum=0.9)

    def build(hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, hidden), nn.Linear(hidden, 8))
        optimizer = get_optimizer(config, model, lint=False)
        model(torch.randn(2, 8)).square().mean().backward()
        optimizer.step()
        return model, optimizer

    _, small = build(4)
    model, big = build(16)
    saved = copy.deepcopy(small.state_dict())
    before = copy.deepcopy(big.state_dict())
    with pytest.raises(ValueError, match=r"^`0\.weight`: shape differs from the checkpoint's; got \(4, 8\) in the checkpoint; expected \(16, 8\)"):
        big.load_state_dict(saved)
    after = big.state_dict()
    for name, values in before["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after["state"][name][key], value), (name, key)
    saved.pop("param_shapes")  # a checkpoint from before the shapes were saved: the live state's shapes still refuse it
    with pytest.raises(ValueError, match=r"^`0\.weight`: state `\w+` shape differs; got \(4, 8\) in the checkpoint; expected \(16, 8\)$"):
        big.load_state_dict(saved)


# ---- 4. gradients laid out otherwise than their params ----------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        OptimizerConfig(optimizer="adam", lr=1e-2),
        OptimizerConfig(optimizer="sgd", lr=1e-2, sgd_momentum=0.9),
        OptimizerConfig(optimizer="soap", lr=1e-2),
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_precision_aware_optimizer=True),
    ],
    ids=["adam", "sgd", "soap", "precision-aware-adam"],
)
@pytest.mark.parametrize("source", ["grad", "main_grad"])
def test_item4_a_transposed_gradient_gives_the_same_update_as_a_contiguous_one(config: OptimizerConfig, source: str) -> None:
    dtype = torch.bfloat16 if config.bf16 else torch.float32

    def run(transposed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Linear(6, 4, bias=False).to(dtype)
        optimizer = get_optimizer(config, model, lint=False, params_have_main_grad=source == "main_grad")
        for step in range(3):
            grad = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            if transposed:
                grad = grad.t().contiguous().t()  # the same values, column-major
            grad = grad.to(torch.float32 if source == "main_grad" else dtype)
            if source == "main_grad":
                model.weight.main_grad = grad  # type: ignore[attr-defined]
            else:
                model.weight.grad = grad
            assert optimizer.step()[0]
        return model.weight.detach().clone()

    assert torch.equal(run(transposed=True), run(transposed=False))


# ---- 5, 6, 11, 14, 18: values that are not finite, degenerate, or inconsistent -----------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr": float("inf")}, r"`OptimizerConfig.lr`: must be finite; got inf; expected a finite number or None$"),
        ({"weight_decay": float("inf")}, r"`OptimizerConfig.weight_decay`: must be finite; got inf"),
        ({"decoupled_lr": float("inf")}, r"`OptimizerConfig.decoupled_lr`: must be finite; got inf"),
        ({"min_lr": float("inf")}, r"`OptimizerConfig.min_lr`: must be finite; got inf"),
        ({"adam_eps": 0.0}, r"`OptimizerConfig.adam_eps`: must be positive; got 0.0; expected a float > 0$"),
        ({"bf16": True, "loss_scale": 0.0}, r"`OptimizerConfig.loss_scale`: must lie in float32's finite normal range; got 0.0"),
        ({"fp16": True, "loss_scale": 1e39}, r"`OptimizerConfig.loss_scale`: must be(?: finite| in)|must lie in float32's finite normal range; got 1e\+39"),
        ({"fp16": True, "initial_loss_scale": 1e39}, r"`OptimizerConfig.initial_loss_scale`: must lie in float32's finite normal range; got 1e\+39"),
        ({"min_lr": 1.0, "lr": 0.1}, r"^`OptimizerConfig.min_lr`: must not exceed lr; got min_lr=1.0, lr=0.1; expected min_lr <= lr$"),
        ({"decoupled_lr": 0.1, "decoupled_min_lr": 1.0}, r"`OptimizerConfig.decoupled_min_lr`: must not exceed decoupled_lr; got decoupled_min_lr=1.0, decoupled_lr=0.1"),
        ({"lr": 10**400}, r"^`OptimizerConfig.lr`: must be finite; got an int of 401 digits; expected a finite number or None$"),
        ({"clip_grad": 10**400}, r"`OptimizerConfig.clip_grad`: must be finite; got an int of 401 digits"),
        ({"initial_loss_scale": 10**400}, r"`OptimizerConfig.initial_loss_scale`: must be finite; got an int of 401 digits"),
        ({"loss_scale_window": float("inf")}, r"`OptimizerConfig.loss_scale_window`: must be finite; got inf"),
        ({"loss_scale_window": 1.5}, r"`OptimizerConfig.loss_scale_window`: must be a whole number of steps, at least 1; got 1.5"),
        ({"min_loss_scale": 2.0**40}, r"^`OptimizerConfig.min_loss_scale`: must not exceed initial_loss_scale; got min_loss_scale=1099511627776.0, initial_loss_scale=4294967296"),
    ],
)
def test_items_5_6_11_18_bad_config_values_name_the_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"max_lr": float("inf")}, r"`max_lr` must be a finite float >= 0; got inf"),
        ({"lr": float("inf")}, r"`OptimizerConfig.lr`: must be finite; got inf"),
        ({"wd_mult": float("inf")}, r"`wd_mult` must be a finite float >= 0; got inf"),
        ({"wd_mult": "abc"}, r"`wd_mult` must be a finite float >= 0; got 'abc'"),
        ({"wd_mult": None}, r"`wd_mult` must be a finite float >= 0; got None"),
        ({"wd_mult": [1]}, r"`wd_mult` must be a finite float >= 0; got \[1\]"),
        ({"wd_mult": True}, r"`wd_mult` must be a finite float >= 0; got True"),
        ({"min_lr": 1.0}, r"`OptimizerConfig.min_lr`: must not exceed lr; got min_lr=1.0, lr=0.1; expected min_lr <= lr"),
        ({"max_lr": 0.01, "min_lr": 0.05}, r"`min_lr` must not exceed the group's lr; got min_lr=0.05, lr=0.01; expected min_lr <= lr"),
        ({"start_wd": 0.2, "end_wd": 0.1}, r"`start_wd` must not exceed `end_wd` .*; got start_wd=0.2, end_wd=0.1"),
    ],
)
def test_items_5_6_14_18_bad_override_values_name_the_rule_and_key(override: dict[str, object], message: str) -> None:
    from optzoo import ParamKey

    with pytest.raises(ValueError, match=r"^`?param group #0 \(rules #0 name='\*'\)`?: " + message):
        get_optimizer(OptimizerConfig(lr=0.1), nn.Linear(2, 2), {ParamKey(name="*"): override}, lint=False)


# ---- 5 and 16: the scheduler's arguments ------------------------------------------------------

SCHEDULE = {
    "init_lr": 0.0, "max_lr": 1e-3, "min_lr": 1e-5, "lr_warmup_steps": 2, "lr_decay_steps": 10, "lr_decay_style": "cosine",
    "start_wd": 0.0, "end_wd": 0.1, "wd_incr_steps": 10, "wd_incr_style": "linear",
}  # fmt: skip


def _scheduler(**changes: object) -> object:
    from optzoo import OptimizerParamScheduler

    optimizer = get_optimizer(OptimizerConfig(lr=1e-3), nn.Linear(2, 2), lint=False)
    return OptimizerParamScheduler(optimizer, **{**SCHEDULE, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_lr": "1e-3"}, r"`OptimizerParamScheduler.max_lr`: must be a finite number; got '1e-3' \(str\); expected a finite float$"),
        ({"min_lr": None}, r"`OptimizerParamScheduler.min_lr`: must be a finite number; got None \(NoneType\)"),
        ({"init_lr": float("nan")}, r"`OptimizerParamScheduler.init_lr`: must be a finite number; got nan \(float\)"),
        ({"end_wd": float("inf")}, r"`OptimizerParamScheduler.end_wd`: must be a finite number; got inf \(float\)"),
        ({"start_wd": True}, r"`OptimizerParamScheduler.start_wd`: must be a finite number; got True \(bool\)"),
        ({"lr_decay_steps": None}, r"`OptimizerParamScheduler.lr_decay_steps`: must be a whole number of steps; got None \(NoneType\); expected an int$"),
        ({"lr_warmup_steps": 1.5}, r"`OptimizerParamScheduler.lr_warmup_steps`: must be a whole number of steps; got 1.5 \(float\)"),
        ({"wd_incr_steps": "10"}, r"`OptimizerParamScheduler.wd_incr_steps`: must be a whole number of steps; got '10' \(str\)"),
        ({"lr_decay_style": "WSD", "wsd_decay_steps": 2.5, "lr_wsd_decay_style": "linear"}, r"`OptimizerParamScheduler.wsd_decay_steps`: must be a whole number of steps; got 2.5"),
    ],
)
def test_items_5_16_scheduler_arguments_of_the_wrong_type_name_the_argument(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _scheduler(**changes)


@pytest.mark.parametrize("increment", [float("nan"), 1.5, "1", True, -1])
def test_items_5_16_18_scheduler_step_takes_whole_steps_only(increment: object) -> None:
    scheduler = _scheduler()
    before = scheduler.num_steps  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"^`OptimizerParamScheduler.step`: increment must be a whole number of steps >= 0; got "):
        scheduler.step(increment)  # type: ignore[attr-defined]
    assert scheduler.num_steps == before  # type: ignore[attr-defined]


@pytest.mark.parametrize("num_steps", [-1, "3", 1.5, None])
def test_item16_a_scheduler_checkpoint_with_a_bad_step_count_is_refused(num_steps: object) -> None:
    scheduler = _scheduler()
    saved = {**scheduler.state_dict(), "num_steps": num_steps}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"^`state_dict`: `num_steps` must be >= 0; got "):
        scheduler.load_state_dict(saved)  # type: ignore[attr-defined]


# ---- 5 and 9: the grad scaler's state, checked before anything changes ---------------------------


@pytest.mark.parametrize(
    ("scaler_state", "message"),
    [
        ({}, r"`grad_scaler` state: missing keys \['growth_tracker', 'hysteresis_tracker', 'scale'\]|missing keys \['scale', 'growth_tracker', 'hysteresis_tracker'\]"),
        (2.0, r"`grad_scaler` state: not a dict; got float"),
        ({"scale": float("nan"), "growth_tracker": 0, "hysteresis_tracker": 2}, r"`scale` must lie in float32's finite normal range; got nan"),
        ({"scale": torch.tensor(-4.0), "growth_tracker": 0, "hysteresis_tracker": 2}, r"`scale` must lie in float32's finite normal range; got tensor\(-4.\)"),
        ({"scale": torch.tensor(0.0), "growth_tracker": 0, "hysteresis_tracker": 2}, r"`scale` must lie in float32's finite normal range"),
        ({"scale": 8.0, "growth_tracker": -1, "hysteresis_tracker": 2}, r"`growth_tracker` must be an int >= 0; got -1"),
    ],
)
def test_items_5_9_a_bad_scaler_state_is_refused_and_nothing_changes(scaler_state: object, message: str) -> None:
    model = TwoBranches().half()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, fp16=True), model, lint=False)
    model.loss(use_b=True).backward()
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    for values in saved["state"].values():
        for key in values:
            if key == "exp_avg":
                values[key] = values[key] + 1.0  # differs from the live state
    saved["grad_scaler"] = scaler_state
    before = copy.deepcopy(optimizer.state_dict())
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(saved)
    after = optimizer.state_dict()
    for name, values in before["state"].items():
        for key, value in values.items():
            assert torch.equal(after["state"][name][key], value), (name, key)
    assert after["grad_scaler"]["scale"] == before["grad_scaler"]["scale"]


# ---- 8. finite gradients whose norm overflows float32 ------------------------------------------


@pytest.mark.parametrize("loss_scale", [None, 1.0], ids=["no-scaler", "constant-scale"])
def test_item8_a_norm_beyond_float32_skips_the_step_with_or_without_a_loss_scale(loss_scale: float | None) -> None:
    model = TwoBranches().to(torch.bfloat16)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, bf16=True, loss_scale=loss_scale, clip_grad=1.0), model, lint=False)
    model.loss(use_b=True).backward()
    optimizer.step()
    before = copy.deepcopy(optimizer.state_dict())
    params = _snapshot(model)
    for param in model.parameters():
        param.grad = torch.full_like(param, 3e38)  # each finite in bf16 and fp32; their norm is not
    assert optimizer.step() == (False, None, None)
    after = optimizer.state_dict()
    for name, values in before["state"].items():
        for key, value in values.items():
            assert torch.equal(after["state"][name][key], value), (name, key)
    assert all(torch.equal(params[n], p) for n, p in model.named_parameters())


# ---- 3. precision settings at load -------------------------------------------------------------


def _precision_aware(**changes: object) -> tuple[nn.Module, object]:
    model = TwoBranches().to(torch.bfloat16)
    config = OptimizerConfig(lr=0.01, bf16=True, use_precision_aware_optimizer=True, **changes)  # type: ignore[arg-type]
    optimizer = get_optimizer(config, model, lint=False)
    model.loss(use_b=True).backward()
    optimizer.step()
    return model, optimizer


def test_item3_int16_remainders_are_refused_by_an_optimizer_that_keeps_no_remainders() -> None:
    _, saved_by = _precision_aware(store_param_remainders=True)
    _, loading = _precision_aware(store_param_remainders=False)
    before = copy.deepcopy(loading.state_dict())  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"^`a\.weight`: `master_param`: saved master differs from this optimizer's \(master_weights=\w+, store_param_remainders=False\); got int16 remainders; expected "):
        loading.load_state_dict(saved_by.state_dict())  # type: ignore[attr-defined]
    after = loading.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(after["state"][n][k], v) for n, vs in before["state"].items() for k, v in vs.items())


def test_item3_a_precision_aware_checkpoint_is_refused_by_a_plain_optimizer() -> None:
    _, saved_by = _precision_aware(store_param_remainders=True)
    model = TwoBranches().to(torch.bfloat16)
    plain = get_optimizer(OptimizerConfig(lr=0.01, bf16=True), model, lint=False)
    with pytest.raises(ValueError, match=r"^`a\.weight`: the checkpoint holds a precision-aware master \(`master_param`\) that this 'adam' group does not keep"):
        plain.load_state_dict(saved_by.state_dict())  # type: ignore[attr-defined]


def test_item3_moment_dtypes_after_a_resume_are_the_configs() -> None:
    _, saved_by = _precision_aware(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    model, loading = _precision_aware()  # fp32 moments
    loading.load_state_dict(saved_by.state_dict())  # type: ignore[attr-defined]
    state = loading.state_dict()["state"]["a.weight"]  # type: ignore[attr-defined]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


# ---- 12. zero-size matrices --------------------------------------------------------------------


@pytest.mark.parametrize("optimizer_name", ["muon", "adaptive_muon", "soap"])
def test_item12_a_zero_size_matrix_goes_to_the_scalar_optimizer(optimizer_name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's init warns about a zero-element tensor
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(0, 4))  # the second weight is (4, 0)
    optimizer = get_optimizer(OptimizerConfig(optimizer=optimizer_name, lr=0.01), model, lint=False)
    group = next(g for g in optimizer.param_groups if "1.weight" in g["param_names"])
    assert group["optimizer"] == "adam"
    model[0](torch.randn(2, 4)).square().sum().backward()
    model[1].weight.grad = torch.zeros(4, 0)
    assert optimizer.step()[0]


@pytest.mark.parametrize("cls", ["Muon", "AdaptiveMuon"])
def test_item12_muon_built_directly_skips_a_zero_size_matrix(cls: str) -> None:
    import optzoo.optimizers as optimizers

    module = optimizers.muon if cls == "Muon" else optimizers.adaptive_muon  # type: ignore[attr-defined]
    empty, full = nn.Parameter(torch.zeros(4, 0)), nn.Parameter(torch.randn(4, 4))
    optimizer = getattr(module, cls)([empty, full], lr=0.1)
    empty.grad, full.grad = torch.zeros(4, 0), torch.randn(4, 4)
    before = full.detach().clone()
    optimizer.step()
    assert empty.shape == (4, 0) and not torch.equal(before, full.detach())


# ---- 10. an fp32 checkpoint resumed on a model cast to bf16 ------------------------------------


def test_item10_an_fp32_checkpoint_resumes_on_a_bf16_model_cast_as_torch_casts() -> None:
    model = TwoBranches()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), model, lint=False)
    model.loss(use_b=True).backward()
    optimizer.step()
    half = copy.deepcopy(model).to(torch.bfloat16)
    resumed = get_optimizer(OptimizerConfig(lr=0.1), half, lint=False)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert resumed.state_dict()["state"]["a.weight"]["exp_avg"].dtype == torch.bfloat16
    half.loss(use_b=True).backward()
    assert resumed.step()[0]


# ---- 15. damaged state dicts -------------------------------------------------------------------


def _damage(change: str) -> tuple[object, dict[str, object]]:
    model = TwoBranches()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), model, lint=False)
    model.loss(use_b=True).backward()
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    if change == "no state":
        del saved["state"]
    elif change == "state is a list":
        saved["state"] = []
    elif change == "group without names":
        del saved["param_groups"][0]["param_names"]
    elif change == "values not a dict":
        saved["state"]["a.weight"] = 3
    elif change == "nan moment":
        saved["state"]["a.weight"]["exp_avg"][0, 0] = float("nan")
    elif change == "negative step":
        saved["state"]["a.weight"]["step"] = torch.tensor(-1.0)
    elif change == "nan lr":
        saved["param_groups"][0]["lr"] = float("nan")
    elif change == "inf beta":
        saved["param_groups"][0]["betas"] = (0.9, float("inf"))
    return optimizer, saved


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("no state", r"damaged at `state`; got no `state`"),
        ("state is a list", r"damaged at `state`; got list"),
        ("group without names", r"damaged at `param_groups\[0\]\['param_names'\]`; got None"),
        ("values not a dict", r"damaged at `state\['a.weight'\]`; got int"),
        ("nan moment", r"damaged at `state\['a.weight'\]\['exp_avg'\]`; got NaN or inf values"),
        ("negative step", r"damaged at `state\['a.weight'\]\['step'\]`; got -1.0; expected a step count >= 0"),
        ("nan lr", r"damaged at `param_groups\[0\]\['lr'\]` \(a.weight, ...\); got nan; expected finite hyperparameters"),
        ("inf beta", r"damaged at `param_groups\[0\]\['betas'\]` \(a.weight, ...\); got \(0.9, inf\)"),
    ],
)
def test_item15_a_damaged_state_dict_is_a_value_error_naming_the_key(change: str, message: str) -> None:
    optimizer, saved = _damage(change)
    before = copy.deepcopy(optimizer.state_dict())  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"^`state_dict`: " + message):
        optimizer.load_state_dict(saved)  # type: ignore[attr-defined]
    after = optimizer.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(after["state"][n][k], v) for n, vs in before["state"].items() for k, v in vs.items())


def _set_group(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(saved: dict[str, Any]) -> None:
        saved["param_groups"][0][key] = value

    return mutate


def _set_state(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(saved: dict[str, Any]) -> None:
        old = saved["state"]["a.weight"][key]
        saved["state"]["a.weight"][key] = value(old) if callable(value) else value

    return mutate


def _nan_main(saved: dict[str, Any]) -> None:
    saved["main_params"]["a.weight"][0, 0] = float("nan")


GROUP = r"damaged at `param_groups` #0 \(a.weight, ...\) "


@pytest.mark.parametrize(
    ("optimizer", "fields", "mutate", "message"),
    [
        ("adam", {}, _set_group("lr", "abc"), GROUP + r"`lr`; got 'abc'; expected a number, as 0.1 here"),
        ("sgd", {}, _set_group("weight_decay", None), GROUP + r"`weight_decay`; got None; expected a number"),
        ("lion", {}, _set_group("weight_decay", -1.0), GROUP + r"`weight_decay`; got -1.0; expected weight_decay >= 0"),
        ("sgd", {}, _set_group("momentum", 1.5), GROUP + r"`momentum`; got 1.5; expected momentum in \[0, 1\)"),
        ("adam", {}, _set_group("betas", (1.5, 0.999)), GROUP + r"`betas`; got \(1.5, 0.999\); expected betas in \[0, 1\)"),
        ("adam", {}, _set_group("betas", 0.9), GROUP + r"`betas`; got 0.9; expected a pair of numbers"),
        ("adam", {}, _set_group("foreach", "yes"), None),  # a kernel choice: not restored, so not checked
        ("adam", {}, _set_state("exp_avg", lambda t: t.long()), r"damaged at `state\['a.weight'\]\['exp_avg'\]`; got a torch.int64 tensor"),
        ("adam", {}, _set_state("step", "abc"), r"damaged at `state\['a.weight'\]\['step'\]`; got 'abc'; expected a step count >= 0"),
        ("soap", {}, _set_state("step", -1), r"damaged at `state\['a.weight'\]\['step'\]`; got -1; expected a step count >= 0"),
        ("adam", {"bf16": True}, _nan_main, r"damaged at `main_params\['a.weight'\]`; got NaN or inf values"),
    ],
)
def test_item15_damaged_group_settings_state_and_main_params_are_refused_before_anything_changes(
    optimizer: str, fields: dict[str, Any], mutate: Callable[[dict[str, Any]], None], message: str | None
) -> None:
    model = TwoBranches()
    if fields.get("bf16"):
        model = model.to(torch.bfloat16)
    opt = get_optimizer(OptimizerConfig(optimizer=optimizer, lr=0.1, **fields), model, lint=False)
    model.loss(use_b=True).backward()
    assert opt.step()[0] is True
    saved = copy.deepcopy(opt.state_dict())
    mutate(saved)
    before = copy.deepcopy(opt.state_dict())
    if message is None:
        opt.load_state_dict(saved)
        return
    with pytest.raises(ValueError, match=r"^`state_dict`: " + message):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert [{k: v for k, v in g.items() if k != "params"} for g in after["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in before["param_groups"]
    ]
    for name, values in before["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(after["state"][name][key]), torch.as_tensor(value)), (name, key)


def test_item16_scheduler_flags_and_state_that_are_not_what_they_say_are_named() -> None:
    from optzoo import OptimizerParamScheduler

    optimizer = get_optimizer(OptimizerConfig(lr=0.1), TwoBranches(), lint=False)
    for flag, value in (("use_checkpoint_opt_param_scheduler", "abc"), ("override_opt_param_scheduler", None)):
        with pytest.raises(ValueError, match=rf"^`OptimizerParamScheduler.{flag}`: must be a bool; got {value!r} \(\w+\); expected True or False$"):
            OptimizerParamScheduler(optimizer, **SCHEDULE, **{flag: value})  # type: ignore[arg-type]
    scheduler = OptimizerParamScheduler(optimizer, **SCHEDULE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^`OptimizerParamScheduler.state_dict`: must be a dict; got None \(NoneType\)"):
        scheduler.load_state_dict(None)  # type: ignore[arg-type]


# ---- what a new user trips over: the canonical lr for logging -----------------------------------


def test_the_canonical_lr_is_the_first_default_config_groups_as_the_scheduler_sets_it() -> None:
    """Megatron-LM's scheduler tests log get_canonical_lr_for_logging(param_groups): the lr of the
    first group stepping with the base config (no override, not moved to a fallback)."""
    from optzoo import OptimizerParamScheduler, ParamKey, get_canonical_lr_for_logging

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    overrides = {ParamKey(name="1.*"): {"max_lr": 0.5}}
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, standard_overrides=False), model, overrides, lint=False)  # the rule alone
    assert [(g["param_names"], g["default_config"]) for g in optimizer.param_groups] == [
        (["0.weight", "0.bias"], True), (["1.weight", "1.bias"], False),
    ]  # fmt: skip
    scheduler = OptimizerParamScheduler(optimizer, **{**SCHEDULE, "max_lr": 0.1})  # type: ignore[arg-type]
    scheduler.step(5)
    assert get_canonical_lr_for_logging(optimizer.param_groups) == optimizer.param_groups[0]["lr"] != optimizer.param_groups[1]["lr"]
    standard = get_optimizer(OptimizerConfig(lr=0.1, optimizer="muon"), model, lint=False)  # standard overrides, Muon's fallback
    assert [g["default_config"] for g in standard.param_groups] == [g["optimizer"] == "muon" and g["wd_mult"] == 1.0 for g in standard.param_groups]
    assert get_canonical_lr_for_logging([{"lr": 0.1}]) is None


# ---- 17 and 18: main_grad buffers, complex params, float64 under fp16 ----------------------------


@pytest.mark.parametrize(
    ("main_grad", "got"),
    [(torch.zeros(3, 4), r"shape \(3, 4\), torch.float32"), (torch.zeros(4, 4, dtype=torch.int32), r"shape \(4, 4\), torch.int32"), ("grad", "str")],
)
def test_item17_a_main_grad_that_does_not_fit_is_named_and_nothing_changes(main_grad: object, got: str) -> None:
    model = nn.Linear(4, 4)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), model, params_have_main_grad=True, lint=False)
    model.weight.main_grad = main_grad  # type: ignore[attr-defined]
    model.bias.main_grad = torch.zeros(4)  # type: ignore[attr-defined]
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"^`weight`: main_grad does not fit the parameter; got " + got + r"; expected a floating tensor of shape \(4, 4\)$"):
        optimizer.step()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_item17_lion_refuses_complex_params_by_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "Complex modules are a new feature"
        model = nn.Linear(2, 2).to(torch.complex64)
    with pytest.raises(ValueError, match=r"^`weight`: lion takes real params \(its update is a sign\); got a torch.complex64 param"):
        get_optimizer(OptimizerConfig(optimizer="lion", lr=0.1), model, config_overrides={}, lint=False)


def test_item18_fp16_refuses_float64_params() -> None:
    with pytest.raises(ValueError, match=r"^`weight`: parameter dtype does not match the config; got torch.float64 with fp16=True; expected torch.float16 or torch.float32$"):
        get_optimizer(OptimizerConfig(lr=0.1, fp16=True), nn.Linear(2, 2).double(), lint=False)


# ---- 14. routing errors that name the rule, the param and the field ------------------------------


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (lambda: __import__("optzoo").ParamKey(predicate=__import__("optzoo").ParamPredicate(name="boom", fn=lambda p: 1 / 0)),
         r"predicate 'boom' \(ParamPredicate\): failed on `weight`; got ZeroDivisionError: division by zero; expected True or False for every parameter"),
        (lambda: __import__("optzoo").ParamKey(predicate=__import__("optzoo").ParamPredicate(name="tensor", fn=lambda p: p > 0)),
         r"predicate 'tensor' \(ParamPredicate\): answered a Tensor on `weight`; got a tensor of shape \(2, 2\); expected a bool"),
        (lambda: __import__("optzoo").ParamKey(predicate=__import__("optzoo").ParamPredicate(name="arity", fn=lambda p, n: True)),
         r"predicate 'arity' \(ParamPredicate\): failed on `weight`; got TypeError: .*missing 1 required positional argument"),
        (lambda: __import__("optzoo").ParamKey(with_name_predicate=__import__("optzoo").ParamWithNamePredicate(name="named", fn=lambda p: True)),
         r"predicate 'named' \(ParamWithNamePredicate\): failed on `weight`; got TypeError: "),
    ],
    ids=["raises", "tensor", "arity", "name-arity"],
)
def test_item14_a_predicate_that_fails_names_itself_and_the_param(key: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_optimizer(OptimizerConfig(lr=0.1), nn.Linear(2, 2), {key(): {"wd_mult": 0.0}}, lint=False)  # type: ignore[operator]


def test_item14_0_and_0_0_from_two_rules_do_not_conflict() -> None:
    from optzoo import ParamKey

    overrides = {ParamKey(name="bias"): {"wd_mult": 0}, ParamKey(name="b*"): {"wd_mult": 0.0}}
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.1), nn.Linear(2, 2), overrides, lint=False)
    assert {g["weight_decay"] for g in optimizer.param_groups if "bias" in g["param_names"]} == {0.0}


# ---- 11. values that failed later with no field named -------------------------------------------


def test_item11_a_config_logger_dir_that_is_a_file_is_named(tmp_path: object) -> None:
    import pathlib

    file = pathlib.Path(str(tmp_path)) / "not-a-dir"
    file.write_text("")
    with pytest.raises(ValueError, match=r"^`OptimizerConfig.config_logger_dir`: exists and is not a directory; got '.*not-a-dir'"):
        OptimizerConfig(lr=0.1, config_logger_dir=str(file))


@pytest.mark.parametrize("timers", [lambda: None, lambda name, log_level: None], ids=["wrong-arity", "no-timer-object"])
def test_item11_wrong_timers_are_named_before_anything_changes(timers: object) -> None:
    """Refused when the optimizer is built (issue #24), so no step can start with them."""
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"^`OptimizerConfig.timers`: not Megatron-style timers; got <lambda> \((calling it failed with TypeError|its timer NoneType has no start)"):
        get_optimizer(OptimizerConfig(lr=0.1, timers=timers), model, lint=False)  # type: ignore[arg-type]


@pytest.mark.parametrize(("chunks", "got"), [(None, "NoneType"), ([], r"a list of \[\]"), ([nn.Linear(2, 2), "x"], r"a list of \['Linear', 'str'\]")])
def test_item14_model_chunks_that_are_not_modules_are_named(chunks: object, got: str) -> None:
    with pytest.raises(ValueError, match=r"^`model_chunks`: not a module or a list of modules; got " + got):
        get_optimizer(OptimizerConfig(lr=0.1), chunks)  # type: ignore[arg-type]


def test_item14_a_py_config_whose_overrides_are_a_list_is_named(tmp_path: object) -> None:
    import pathlib

    from optzoo.config_file import load_config_file

    path = pathlib.Path(str(tmp_path)) / "bad.py"
    path.write_text("from optzoo import OptimizerConfig\nconfig = OptimizerConfig(lr=0.1)\nconfig_overrides = [1, 2]\n")
    with pytest.raises(ValueError, match=r"bad.py`: `config_overrides` must be a dict of ParamKey -> override; got list"):
        load_config_file(path)


# ---- new-user item: coefficient sets that go wrong at some step counts ------------------------

from optzoo.optimizers.muon import Muon  # noqa: E402
from optzoo.optimizers.newton_schulz import (  # noqa: E402
    COEFFICIENT_SETS,
    NewtonSchulzWarning,
    newton_schulz,
    schedule_problem,
)


def _signed_singular_values(coefficient_type: str, steps: int, g: torch.Tensor) -> torch.Tensor:
    """diag(Uᵀ · NS(G) · V): the iteration's output along each of G's singular directions."""
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    out = newton_schulz(g, steps=steps, coefficient_type=coefficient_type).double()  # type: ignore[arg-type]
    return (u.T @ out @ vh.T).diagonal()


@pytest.mark.parametrize("coefficient_type", sorted(COEFFICIENT_SETS))
def test_new_user_schedule_problem_agrees_with_real_matrices(coefficient_type: str) -> None:
    """Every flagged step count misbehaves on a real matrix, and every unflagged one does not."""
    torch.manual_seed(0)
    full_rank = torch.randn(48, 96)
    rank_one = torch.randn(48, 1) @ torch.randn(1, 96)
    for steps in range(1, 11):
        problem = schedule_problem(coefficient_type, steps)  # type: ignore[arg-type]
        worst = {name: _signed_singular_values(coefficient_type, steps, g) for name, g in (("full", full_rank), ("rank1", rank_one))}
        flipped = worst["full"].min() < 0 or worst["rank1"][0] < 0
        collapsed = worst["full"].max() < 0.7
        if problem is None:
            assert not flipped and not collapsed, (coefficient_type, steps, worst["full"].aminmax())
        elif problem.startswith("flips the sign"):
            assert flipped, (coefficient_type, steps)
        else:
            assert problem.startswith("maps singular values") and collapsed, (coefficient_type, steps)


def test_new_user_schedule_problem_names_the_bad_step_counts() -> None:
    assert schedule_problem("quintic", 5) is None
    assert all(schedule_problem(kind, steps) is None for kind in ("polar_express", "cans") for steps in range(5, 13))
    assert schedule_problem("quintic", 6) == (
        "maps singular values in [0.1, 1] to [0.06, 0.16] instead of about 1 (quintic has 5 coefficient tuples "
        "and cycles past them); steps without this problem: 1-5, 8-10"
    )
    assert re.fullmatch(
        r"flips the sign of the update along singular values in \[0\.0103, 0\.891\] \(of the Frobenius-normalised "
        r"input\) \(aol has 4 coefficient tuples and cycles past them\); no step count up to 12 avoids it: .*",
        schedule_problem("aol", 5) or "",
    )
    assert "(of a nearly rank-1 input)" in (schedule_problem("aol", 4) or "")


def test_new_user_config_warns_once_about_a_bad_schedule_and_builds() -> None:
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    with pytest.warns(NewtonSchulzWarning) as caught:
        config = OptimizerConfig(optimizer="muon", lr=0.01, muon_coefficient_type="aol", muon_num_ns_steps=5)
    assert [str(w.message) for w in caught] == [
        f"muon_coefficient_type='aol' with muon_num_ns_steps=5: {schedule_problem('aol', 5)}"
    ]
    assert caught[0].filename == __file__  # blamed on the line that built the config
    with warnings.catch_warnings():
        warnings.simplefilter("error", NewtonSchulzWarning)
        get_optimizer(config, model)  # the config warned; its groups and the Muon do not repeat it
        OptimizerConfig(optimizer="adam", lr=0.01, muon_num_ns_steps=6)  # Muon's fields unused: no warning
        OptimizerConfig(optimizer="muon", lr=0.01, muon_coefficient_type="polar_express", muon_num_ns_steps=8)


def test_new_user_an_override_that_adds_a_bad_schedule_warns() -> None:
    from optzoo.routing import ParamKey

    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    with pytest.warns(NewtonSchulzWarning, match=r"^muon_coefficient_type='quintic' with muon_num_ns_steps=7: maps singular values") as caught:
        get_optimizer(OptimizerConfig(optimizer="muon", lr=0.01), model, config_overrides={ParamKey(name="0.weight"): {"muon_num_ns_steps": 7}})
    assert {w.filename for w in caught} == {__file__}


def test_new_user_muon_built_directly_warns_per_group() -> None:
    weight = nn.Parameter(torch.randn(8, 8))
    with pytest.warns(NewtonSchulzWarning, match=r"^param group #0: coefficient_type='quintic' with num_ns_steps=6: maps singular") as caught:
        Muon([weight], num_ns_steps=6)
    assert caught[0].filename == __file__


@pytest.mark.slow
def test_the_campaign_script_finds_nothing_in_its_quick_sample() -> None:
    """scripts/campaign.py (2,154 trials; --quick samples ~10%) reports every trial that errs
    unclearly, accepts nonsense or loses state: none may remain."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "campaign.py"), "--quick"], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.rstrip().endswith("FAILURES: 0"), run.stdout[-4000:]


def test_new_user_schedule_problem_names_bad_input_and_does_not_probe_absurd_step_counts() -> None:
    with pytest.raises(ValueError, match=r"^`coefficient_type`: unknown value; got \['quintic'\]; expected one of \['simple', "):
        schedule_problem(["quintic"], 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^`steps`: must be an int; got 2.5; expected an integer >= 1$"):
        schedule_problem("quintic", 2.5)  # type: ignore[arg-type]
    assert schedule_problem("aol", 10**400) is None  # not probed: a pass per step
    OptimizerConfig(optimizer="muon", lr=1e-3, muon_num_ns_steps=10**400)  # builds at once
