"""torch.optim.lr_scheduler schedulers drive the returned optimizer's real groups."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as lrs

from optzoo import OptimizerConfig, ParamKey, get_optimizer
from tests.conftest import fill_grads, twin


def test_lambda_lr_scales_every_group_and_the_inner_optimizers_see_it(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(OptimizerConfig(lr=1e-3, decoupled_lr=1e-4), gpt, None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for _ in range(3):
        opt.step()
        scheduler.step()
    assert [g["lr"] for g in opt.param_groups] == [1e-3 * 0.125, 1e-4 * 0.125, 1e-3 * 0.125]
    assert [g["lr"] for inner in opt.optimizers for g in inner.param_groups] == [g["lr"] for g in opt.param_groups]


def test_cosine_annealing_matches_torch_adamw_under_the_same_schedule(odd_model: torch.nn.Module) -> None:
    config = OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0)
    reference_model = twin(odd_model)
    ours = get_optimizer(config, odd_model, {ParamKey(name="lm_head.weight"): {"lr": 5e-3}})
    by_name = dict(reference_model.named_parameters())
    reference = torch.optim.AdamW(
        [{"params": [by_name[n] for n in g["param_names"]], "lr": g["lr"], "weight_decay": 0.0} for g in ours.param_groups],
        fused=True,
    )
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=1e-4) for o in (ours, reference)]
    generator_a, generator_b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    for _ in range(10):
        fill_grads(list(odd_model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        ours.step()
        reference.step()
        for scheduler in schedulers:
            scheduler.step()
    expected = 1e-4 + (1e-2 - 1e-4) * (1 + math.cos(math.pi * 10 / 10)) / 2
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in reference.param_groups]
    assert math.isclose(ours.param_groups[0]["lr"], expected, rel_tol=1e-12)
    for p, q in zip(odd_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


# ---- every torch.optim.lr_scheduler class (issue #25 item 5) ----------------------------------------

TORCH_SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: lrs.LambdaLR(o, lambda step: 0.8**step),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda step: 0.9),
    "StepLR": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ConstantLR": lambda o: lrs.ConstantLR(o, factor=0.25, total_iters=3),
    "LinearLR": lambda o: lrs.LinearLR(o, start_factor=0.1, total_iters=4),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, gamma=0.7),
    "SequentialLR": lambda o: lrs.SequentialLR(
        o, [lrs.LinearLR(o, start_factor=0.2, total_iters=3), lrs.ExponentialLR(o, gamma=0.8)], milestones=[3]
    ),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler([lrs.ConstantLR(o, factor=0.5, total_iters=2), lrs.ExponentialLR(o, gamma=0.9)]),
    "ReduceLROnPlateau": lambda o: lrs.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "CyclicLR": lambda o: lrs.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=3),  # cycle_momentum=True: betas cycle
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=1e-4),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, max_lr=2e-2, total_steps=10),  # cycle_momentum=True: betas cycle
    "PolynomialLR": lambda o: lrs.PolynomialLR(o, total_iters=6, power=2.0),
}


def _torch_twin(ours: torch.optim.Optimizer, model: torch.nn.Module, torch_cls: type[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """``torch_cls`` over ``model``'s params with each of our groups' torch settings: the reference."""
    probe = torch.nn.Parameter(torch.zeros(1))
    keys = set(torch_cls([probe]).defaults)
    by_name = dict(model.named_parameters())
    return torch_cls([{"params": [by_name[n] for n in g["param_names"]], **{k: v for k, v in g.items() if k in keys}} for g in ours.param_groups])


def _drive(pairs: list[tuple[torch.optim.Optimizer, torch.nn.Module, Any]], steps: int = 10) -> list[float]:
    """Step every pair with the same gradients; returns the first optimizer's lr at each step."""
    generators = [torch.Generator().manual_seed(7) for _ in pairs]
    lrs_seen = []
    for _ in range(steps):
        lrs_seen.append(pairs[0][0].param_groups[0]["lr"])
        for (opt, model, scheduler), generator in zip(pairs, generators):
            fill_grads(list(model.parameters()), generator)
            opt.step()
            if isinstance(scheduler, lrs.ReduceLROnPlateau):
                scheduler.step(1.0)  # a loss that never improves: the lr halves every step
            else:
                scheduler.step()
    return lrs_seen


@pytest.mark.parametrize("name", sorted(TORCH_SCHEDULERS))
def test_every_torch_scheduler_drives_the_lr_the_inner_adamw_uses(name: str, odd_model: torch.nn.Module) -> None:
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    reference_model = twin(odd_model)
    ours = get_optimizer(config, odd_model, trace=False)
    reference = _torch_twin(ours, reference_model, torch.optim.AdamW)
    pairs = [(opt, model, TORCH_SCHEDULERS[name](opt)) for opt, model in ((ours, odd_model), (reference, reference_model))]
    seen = _drive(pairs)
    assert len(set(seen)) > 1  # the schedule moved the lr
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in reference.param_groups]
    assert [g["betas"] for g in ours.param_groups] == [g["betas"] for g in reference.param_groups]
    for p, q in zip(odd_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_defaults_hold_the_config_and_the_settings_every_group_shares(odd_model: torch.nn.Module) -> None:
    adam = get_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.05, adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6), odd_model, trace=False)
    assert {k: adam.defaults[k] for k in ("lr", "weight_decay", "betas", "eps")} == {"lr": 3e-3, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}
    sgd = get_optimizer(OptimizerConfig(lr=3e-3, optimizer="sgd", sgd_momentum=0.7), odd_model, trace=False)
    assert sgd.defaults["momentum"] == 0.7 and "betas" not in sgd.defaults
    # Muon with Adam on the rest: no key every group has, so OneCycleLR's cycle_momentum is refused by torch
    muon = get_optimizer(OptimizerConfig(lr=3e-3, optimizer="muon"), odd_model, trace=False)
    assert "betas" not in muon.defaults and "momentum" not in muon.defaults and muon.defaults["lr"] == 3e-3
    with pytest.raises(ValueError, match="optimizer must support momentum or beta1 with `cycle_momentum` option enabled"):
        lrs.OneCycleLR(muon, max_lr=1e-2, total_steps=4)
    lrs.OneCycleLR(muon, max_lr=1e-2, total_steps=4, cycle_momentum=False)


@pytest.mark.parametrize("name", ["CyclicLR", "OneCycleLR"])
def test_cycled_sgd_momentum_reaches_the_inner_sgd(name: str, odd_model: torch.nn.Module) -> None:
    config = OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0, optimizer="sgd", sgd_momentum=0.9)
    reference_model = twin(odd_model)
    ours = get_optimizer(config, odd_model, trace=False)
    reference = _torch_twin(ours, reference_model, torch.optim.SGD)
    pairs = [(opt, model, TORCH_SCHEDULERS[name](opt)) for opt, model in ((ours, odd_model), (reference, reference_model))]
    _drive(pairs)
    momenta = [g["momentum"] for g in ours.param_groups]
    assert momenta == [g["momentum"] for g in reference.param_groups] and momenta[0] != 0.9  # cycled
    for p, q in zip(odd_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_cycled_momentum_reaches_muon() -> None:
    """Muon over matrices only (every group has ``momentum``): OneCycleLR cycles it, and the momentum
    buffer follows the lerp form with each step's momentum, recomputed in float64."""
    model = torch.nn.Sequential(torch.nn.Linear(7, 5, bias=False), torch.nn.Linear(5, 3, bias=False))
    ours = get_optimizer(OptimizerConfig(lr=1e-2, optimizer="muon", clip_grad=0.0), model, trace=False)
    assert {g["optimizer"] for g in ours.param_groups} == {"muon"} and "momentum" in ours.defaults
    scheduler = lrs.OneCycleLR(ours, max_lr=2e-2, total_steps=8, base_momentum=0.5, max_momentum=0.9)
    generator = torch.Generator().manual_seed(3)
    params = list(model.parameters())
    buffers = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    seen = []
    for _ in range(6):
        fill_grads(params, generator)
        momentum = ours.param_groups[0]["momentum"]
        seen.append(momentum)
        buffers = [momentum * b + (1 - momentum) * p.grad.double() for b, p in zip(buffers, params)]
        ours.step()
        scheduler.step()
    assert len(set(seen)) > 3  # cycled
    for p, expected in zip(params, buffers):
        torch.testing.assert_close(ours.state[p]["momentum_buffer"].double(), expected, atol=1e-6, rtol=1e-6)
