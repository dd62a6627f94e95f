"""Nothing lost under faults (issue #24): damaged state is refused by name before anything changes.

The layouts damaged here are the ones each optimizer really wrote (its own ``state_dict()``
after a step), not the loader's declared ones: a key that a step writes and the loader does not
expect, or the reverse, fails the round trip test below.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, OptimizerParamScheduler, get_optimizer
from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon
from optzoo.optimizers.precision_adam import PrecisionAwareAdam
from optzoo.wrapper.scalers import DynamicGradScaler


class Tiny(torch.nn.Module):
    """One matrix (Muon/SOAP take it) and one vector (their scalar optimizer takes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(5, 7))
        self.bias = torch.nn.Parameter(torch.randn(5))


CONFIGS: dict[str, tuple[dict[str, Any], torch.dtype]] = {
    "adam": ({}, torch.float32),
    "adam-amsgrad-free-bf16": ({"bf16": True}, torch.bfloat16),
    "adam-fp16": ({"fp16": True}, torch.float16),
    "adam-precision-aware": ({"bf16": True, "use_precision_aware_optimizer": True, "store_param_remainders": False}, torch.bfloat16),
    "adam-remainders": ({"bf16": True, "use_precision_aware_optimizer": True, "store_param_remainders": True}, torch.bfloat16),
    "sgd": ({"optimizer": "sgd"}, torch.float32),
    "lion": ({"optimizer": "lion"}, torch.float32),
    "soap": ({"optimizer": "soap"}, torch.float32),
    "muon": ({"optimizer": "muon"}, torch.float32),
    "muon-bf16": ({"optimizer": "muon", "bf16": True}, torch.bfloat16),
    "adaptive_muon-adamuon": ({"optimizer": "adaptive_muon", "adaptive_muon_moment2_method": "adamuon"}, torch.float32),
    "adaptive_muon-normuon": ({"optimizer": "adaptive_muon", "adaptive_muon_moment2_method": "normuon"}, torch.float32),
    "adaptive_muon-namo": ({"optimizer": "adaptive_muon", "adaptive_muon_moment2_method": "namo"}, torch.float32),
}


def build(name: str, seed: int = 0) -> tuple[Tiny, torch.optim.Optimizer]:
    fields, dtype = CONFIGS[name]
    torch.manual_seed(seed)
    model = Tiny().to(dtype)
    config = OptimizerConfig(lr=1e-2, **{"optimizer": "adam", **fields})
    return model, get_optimizer(config, model, config_overrides={}, trace=False, lint=False)


def trained_state(name: str) -> dict[str, Any]:
    model, opt = build(name)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    opt.step()
    return opt.state_dict()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    """Everything a load may change, copied: params, state, groups, the loss scale."""
    return copy.deepcopy(([p.detach() for p in model.parameters()], opt.state_dict()))


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def _reshaped(value: torch.Tensor) -> torch.Tensor:
    """The same elements in another shape (one row, or one column if it already is one row)."""
    row = value.reshape(1, -1)
    return (row if row.shape != value.shape else value.reshape(-1, 1)).clone()


def damages(state: dict[str, Any]) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """(description, param, key, damaged state dict) for every state key of every param."""
    for name, values in state["state"].items():
        for key, value in values.items():
            def damaged(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
                copied = copy.deepcopy(state)
                change(copied["state"][name])
                return copied

            yield "missing", name, key, damaged(lambda v: v.pop(key))
            yield "unknown", name, "bogus", damaged(lambda v: v.__setitem__("bogus", torch.zeros(1)))
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                yield "larger", name, key, damaged(lambda v: v.__setitem__(key, torch.zeros(*[n + 1 for n in value.shape], dtype=value.dtype)))
                yield "reshaped", name, key, damaged(lambda v: v.__setitem__(key, _reshaped(value)))
                kind = torch.float32 if value.dtype == torch.int16 else torch.int32
                yield "dtype kind", name, key, damaged(lambda v: v.__setitem__(key, value.to(kind)))
                yield "meta", name, key, damaged(lambda v: v.__setitem__(key, torch.empty_like(value, device="meta")))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_damaged_state_is_refused_by_name_before_anything_changes(config: str) -> None:
    saved = trained_state(config)
    for fresh in (True, False):
        model, opt = build(config, seed=1)
        if not fresh:  # an optimizer with state of its own: it must keep it
            opt.load_state_dict(trained_state(config))
        before = snapshot(model, opt)
        count = 0
        for what, name, key, damaged in damages(saved):
            with pytest.raises(ValueError, match=rf"{re.escape(name)}.*{re.escape(key)}"):
                opt.load_state_dict(damaged)
            count += 1
            assert_same(snapshot(model, opt), before), (what, name, key)
        assert count >= 12


@pytest.mark.parametrize("config", list(CONFIGS))
def test_undamaged_state_loads_into_a_fresh_optimizer_and_steps(config: str) -> None:
    saved = trained_state(config)
    model, opt = build(config, seed=1)
    opt.load_state_dict(copy.deepcopy(saved))
    assert_same({n: sorted(v) for n, v in opt.state_dict()["state"].items()}, {n: sorted(v) for n, v in saved["state"].items()})
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    opt.step()
    assert all(bool(torch.isfinite(p.float()).all()) for p in model.parameters())


def test_a_missing_second_moment_is_refused_up_front() -> None:
    saved = trained_state("adam")
    del saved["state"]["weight"]["exp_avg_sq"]
    model, opt = build("adam", seed=1)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"`weight`.*missing \['exp_avg_sq'\]"):
        opt.load_state_dict(saved)
    assert_same(snapshot(model, opt), before)


def test_a_moment_of_another_shape_is_refused_with_correct_param_shapes() -> None:
    saved = trained_state("adam")
    assert saved["param_shapes"]["weight"] == [5, 7]
    saved["state"]["weight"]["exp_avg"] = torch.zeros(7, 5)
    _, opt = build("adam", seed=1)
    with pytest.raises(ValueError, match=r"`weight`: state `exp_avg` shape differs; got \(7, 5\) in the checkpoint; expected \(5, 7\)"):
        opt.load_state_dict(saved)
    assert not opt.state


# ---- the dynamic loss scale after a resume with a smaller loss_scale_window --------------------


def test_loss_scale_grows_after_resuming_with_a_smaller_window() -> None:
    saved = DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, growth_interval=1000, hysteresis=2)
    for _ in range(500):
        saved.update(found_inf=False)
    resumed = DynamicGradScaler(2.0**16, 1.0, 2.0, 0.5, growth_interval=100, hysteresis=2)
    resumed.load_state_dict(saved.state_dict())
    resumed.update(found_inf=False)  # 501 clean steps, over the new window of 100: grow now
    assert resumed.scale.item() == 2.0**17
    for _ in range(100):
        resumed.update(found_inf=False)
    assert resumed.scale.item() == 2.0**18  # and again after each window


def test_fp16_optimizer_scale_grows_after_resume_with_a_smaller_window() -> None:
    def fp16(window: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Tiny().half()
        config = OptimizerConfig(lr=1e-3, fp16=True, initial_loss_scale=2.0**10, loss_scale_window=window)
        return model, get_optimizer(config, model, config_overrides={}, trace=False, lint=False)

    model, opt = fp16(8)
    for _ in range(5):
        for param in model.parameters():
            param.grad = torch.full_like(param, 1e-3)
        opt.step()
    state = opt.state_dict()
    assert state["grad_scaler"]["growth_tracker"] == 5
    model, opt = fp16(3)
    opt.load_state_dict(state)
    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-3)
    opt.step()
    assert opt.get_loss_scale().item() == 2.0**11


# ---- the scheduler -----------------------------------------------------------------------------


def test_scheduler_load_that_fails_changes_nothing() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [param], "start_wd": 0.0, "end_wd": 0.1}], lr=1.0)
    sched = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="linear",
        start_wd=0.1, end_wd=0.1, wd_incr_steps=8, wd_incr_style="linear", use_checkpoint_opt_param_scheduler=True,
    )  # fmt: skip
    sched.step(3)
    saved = {**sched.state_dict(), "wd_incr_style": "constant", "lr_decay_style": "cosine", "num_steps": 5}
    before = (copy.deepcopy(vars(sched)), copy.deepcopy(optimizer.param_groups[0]["lr"]), optimizer.param_groups[0]["weight_decay"])
    with pytest.raises(ValueError, match=r"wd_incr_style.*'constant' needs start_wd == end_wd.*start_wd=0.0, end_wd=0.1"):
        sched.load_state_dict(saved)
    after = (vars(sched), optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"])
    assert {k: v for k, v in before[0].items() if k != "optimizer"} == {k: v for k, v in after[0].items() if k != "optimizer"}
    assert before[1:] == after[1:]
    assert sched.lr_decay_style == "linear" and sched.num_steps == 3


# ---- optzoo's optimizer classes, loaded as torch loads (positional state dicts) ----------------


@pytest.mark.parametrize(
    "cls, kwargs",
    [(Muon, {}), (AdaptiveMuon, {"moment2_method": "normuon"}), (AdaptiveMuon, {"moment2_method": "namo"}), (PrecisionAwareAdam, {})],
    ids=["Muon", "AdaptiveMuon-normuon", "AdaptiveMuon-namo", "PrecisionAwareAdam"],
)
def test_optzoo_classes_refuse_damaged_positional_state_before_anything_changes(cls: type, kwargs: dict[str, Any]) -> None:
    def stepped() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(5, 7))
        opt = cls([weight], lr=1e-2, **kwargs)
        weight.grad = torch.randn_like(weight)
        opt.step()
        return weight, opt

    _, source = stepped()
    saved = source.state_dict()
    weight, target = stepped()
    before = copy.deepcopy(target.state_dict())
    for key, value in saved["state"][0].items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        for damaged_value in (torch.zeros([n + 1 for n in value.shape]), _reshaped(value)):
            damaged = copy.deepcopy(saved)
            damaged["state"][0][key] = damaged_value
            with pytest.raises(ValueError, match=rf"`state_dict\['state'\]\[0\]`: state `{key}` shape differs"):
                target.load_state_dict(damaged)
            assert_same(target.state_dict(), before)
        missing = copy.deepcopy(saved)
        del missing["state"][0][key]
        with pytest.raises(ValueError, match=rf"`state_dict\['state'\]\[0\]`: .*missing \['{key}'\]"):
            target.load_state_dict(missing)
        assert_same(target.state_dict(), before)


def test_state_is_checked_under_the_settings_the_checkpoint_brings() -> None:
    """The loaded groups take the checkpoint's hyperparameters (as torch's load does): a normuon
    checkpoint's per-column second moment is right for the group once it says normuon again."""
    saved = trained_state("adaptive_muon-normuon")
    assert tuple(saved["state"]["weight"]["exp_avg_sq"].shape) == (1, 7)  # one per column of the wide 5x7
    model, opt = build("adaptive_muon-adamuon", seed=1)
    opt.load_state_dict(saved)
    group = next(g for g in opt.param_groups if "weight" in g["param_names"])
    assert group["moment2_method"] == "normuon"
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    opt.step()
    assert tuple(opt.state_dict()["state"]["weight"]["exp_avg_sq"].shape) == (1, 7)
