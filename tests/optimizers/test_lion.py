"""Lion through get_optimizer equals emerging-optimizers' Lion, and the paper's update rule."""

from __future__ import annotations

import pytest
import torch
from emerging_optimizers.scalar_optimizers.lion import Lion

from optzoo import OptimizerConfig, get_optimizer
from tests.conftest import fill_grads, twin
from tests.optimizers.reference.lion import lion_step

CONFIG = OptimizerConfig(
    optimizer="lion", lr=1e-3, decoupled_lr=3e-4, weight_decay=0.1, lion_beta1=0.9, lion_beta2=0.99, clip_grad=0.0
)


def test_lion_equals_emerging_optimizers_lion_bitwise(odd_model: torch.nn.Module) -> None:
    reference_model = twin(odd_model)
    ours = get_optimizer(CONFIG, odd_model)
    by_name = dict(reference_model.named_parameters())
    reference = Lion(
        [
            {"params": [by_name[n] for n in g["param_names"]], "lr": g["lr"], "weight_decay": g["weight_decay"], "betas": g["betas"]}
            for g in ours.param_groups
        ]
    )
    generator_a, generator_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(20):
        fill_grads(list(odd_model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        ours.step()
        reference.step()
    for (name, p), q in zip(odd_model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
        torch.testing.assert_close(ours.state[p]["exp_avg"], reference.state[q]["exp_avg"], atol=0, rtol=0)


def test_lion_follows_the_paper_in_float64(odd_model: torch.nn.Module) -> None:
    ours = get_optimizer(CONFIG, odd_model)
    shadow = {n: p.detach().double().clone() for n, p in odd_model.named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in shadow.items()}
    group_of = {n: g for g in ours.param_groups for n in g["param_names"]}
    generator = torch.Generator().manual_seed(9)
    for _ in range(20):
        fill_grads(list(odd_model.parameters()), generator)
        for name, param in odd_model.named_parameters():
            group = group_of[name]
            lion_step(shadow[name], param.grad.double(), momentum[name], lr=group["lr"],
                      beta1=group["betas"][0], beta2=group["betas"][1], weight_decay=group["weight_decay"])
        ours.step()
    for name, param in odd_model.named_parameters():
        # Each fp32 step rounds p once (<= 2**-24 relative): 20 steps stay below 2e-6 relative.
        torch.testing.assert_close(param.double(), shadow[name], rtol=2e-6, atol=1e-7, msg=name)


def test_a_cpu_step_compiles_nothing(odd_model: torch.nn.Module) -> None:
    """Issue 25: upstream's update is ``torch.compile``d, and its first CPU step compiled for
    ~17 s; optzoo's Lion steps CPU params without dynamo seeing a frame."""
    from torch._dynamo.utils import counters

    optimizer = get_optimizer(CONFIG, odd_model)
    torch._dynamo.reset()  # no cached kernel: a compiled call would convert a frame now
    counters.clear()
    fill_grads(list(odd_model.parameters()), torch.Generator().manual_seed(1))
    optimizer.step()
    assert sum(counters["frames"].values()) == 0, dict(counters["frames"])


@pytest.mark.parametrize(
    ("dtype", "betas"),
    [(torch.float32, (0.9, 0.99)), (torch.float32, (0.3, 0.6)), (torch.bfloat16, (0.95, 0.98))],
    ids=["float32", "float32-weights-past-half", "bfloat16"],
)
def test_the_eager_update_equals_upstreams_compiled_kernel_bitwise(dtype: torch.dtype, betas: tuple[float, float]) -> None:
    """The eager update rounds as the compiled kernel does (torch's lerp decomposition in float32,
    rounded once), not as eager ``lerp``; ``1 - 0.6`` takes the ``|w| >= 0.5`` branch."""
    from emerging_optimizers.scalar_optimizers.update_functions import calculate_lion_update

    from optzoo.optimizers._emerging import lion_update_as_compiled

    generator = torch.Generator().manual_seed(3)
    grad = torch.randn(67, 33, generator=generator).to(dtype)
    exp_avg = torch.randn(67, 33, generator=generator).to(dtype)
    theirs, ours = exp_avg.clone(), exp_avg.clone()
    torch._dynamo.reset()  # a fresh compile for this dtype and these betas: not the recompile limit's eager fallback
    expected = calculate_lion_update(grad, theirs, betas=betas)
    got = lion_update_as_compiled(grad, ours, betas=betas)
    assert torch.equal(got, expected) and got.dtype == expected.dtype
    assert torch.equal(ours, theirs)
