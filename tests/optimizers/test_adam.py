"""Adam(W) through get_optimizer equals torch.optim.Adam/AdamW built by hand with the same groups."""

from __future__ import annotations

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from tests.conftest import fill_grads, twin

STEPS = 20


def _hand_groups(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[dict[str, object]]:
    """The same groups as ``opt``'s, built from ``model``'s own parameters by name."""
    by_name = dict(model.named_parameters())
    return [
        {
            "params": [by_name[name] for name in group["param_names"]],
            "lr": group["lr"],
            "weight_decay": group["weight_decay"],
            "betas": group["betas"],
            "eps": group["eps"],
        }
        for group in opt.param_groups
    ]


def _run(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    for _ in range(STEPS):
        fill_grads(params, generator)
        opt.step()


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_equals_torch_with_same_kernel_bitwise(odd_model: torch.nn.Module, decoupled: bool) -> None:
    config = OptimizerConfig(
        lr=1e-2, decoupled_lr=3e-3, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6,
        decoupled_weight_decay=decoupled, clip_grad=0.0,
    )
    reference_model = twin(odd_model)
    ours = get_optimizer(config, odd_model)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference = cls(_hand_groups(reference_model, ours), fused=True)
    assert type(ours.optimizers[0]) is cls and ours.param_groups[0]["fused"] is True

    _run(odd_model, ours, seed=7)
    _run(reference_model, reference, seed=7)

    for (name, p), q in zip(odd_model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][key], reference.state[q][key], atol=0, rtol=0)


def test_adamw_equals_torch_foreach_within_1e6(odd_model: torch.nn.Module) -> None:
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    reference_model = twin(odd_model)
    ours = get_optimizer(config, odd_model)
    reference = torch.optim.AdamW(_hand_groups(reference_model, ours), foreach=True)
    _run(odd_model, ours, seed=3)
    _run(reference_model, reference, seed=3)
    # fused and foreach kernels round differently (fma, op order): fp32 agrees to ~1e-6 relative.
    for p, q in zip(odd_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_adam_groups_carry_the_resolved_hyperparameters(odd_model: torch.nn.Module) -> None:
    config = OptimizerConfig(lr=1e-2, decoupled_lr=3e-3, weight_decay=0.1, adam_beta1=0.8, adam_eps=1e-6)
    opt = get_optimizer(config, odd_model)
    by_names = {tuple(g["param_names"]): g for g in opt.param_groups}
    matrices = by_names[("layers.0.qkv.weight", "layers.0.proj.weight", "layers.1.qkv.weight", "layers.1.proj.weight")]
    assert (matrices["lr"], matrices["weight_decay"], matrices["betas"], matrices["eps"]) == (1e-2, 0.1, (0.8, 0.999), 1e-6)
    embeddings = by_names[("embed.weight", "lm_head.weight")]
    assert (embeddings["lr"], embeddings["max_lr"], embeddings["weight_decay"]) == (3e-3, 3e-3, 0.1)
    no_decay = [g for g in opt.param_groups if "norm.weight" in g["param_names"]][0]
    assert no_decay["weight_decay"] == 0.0 and no_decay["wd_mult"] == 0.0
