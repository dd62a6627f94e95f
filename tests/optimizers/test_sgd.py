"""SGD through get_optimizer equals torch.optim.SGD built by hand with the same groups."""

from __future__ import annotations

import torch

from optzoo import OptimizerConfig, get_optimizer
from tests.conftest import fill_grads, twin


import pytest


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_sgd_equals_torch_sgd(odd_model: torch.nn.Module, kernel: str) -> None:
    config = OptimizerConfig(optimizer="sgd", lr=0.05, decoupled_lr=0.01, weight_decay=0.01, sgd_momentum=0.8, clip_grad=0.0)
    reference_model = twin(odd_model)
    ours = get_optimizer(config, odd_model)
    by_name = dict(reference_model.named_parameters())
    reference = torch.optim.SGD(
        [
            {"params": [by_name[n] for n in g["param_names"]], "lr": g["lr"], "weight_decay": g["weight_decay"], "momentum": g["momentum"]}
            for g in ours.param_groups
        ],
        **{kernel: True},
    )
    assert ours.param_groups[0]["fused"] is True
    assert {g["momentum"] for g in ours.param_groups} == {0.8}
    generator_a, generator_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(20):
        fill_grads(list(odd_model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        ours.step()
        reference.step()
    # Same kernel: bitwise. fused vs foreach may fuse multiply-adds differently: ~1 ulp per step.
    tolerance = {"atol": 0.0, "rtol": 0.0} if kernel == "fused" else {"atol": 1e-6, "rtol": 1e-6}
    for (name, p), q in zip(odd_model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, **tolerance, msg=name)
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], **tolerance)
