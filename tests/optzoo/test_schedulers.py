"""torch.optim.lr_scheduler schedulers drive the returned optimizer's real groups."""

from __future__ import annotations

import math

import torch

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
