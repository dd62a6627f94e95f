"""The matrix algorithms (Muon, Adaptive Muon, SOAP, REKLS, PSGD-Pro, the oblique ones) inside the precision wrapper, and the inf/NaN skip around them."""

from __future__ import annotations

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from tests.conftest import tiny_gpt, tokens

NAMES = ["muon", "adaptive_muon", "soap", "rekls", "psgd_pro", "oblique_sgd", "oblique_adam"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_trains_with_16_bit_params_and_fp32_main_params(name: str, precision: str) -> None:
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    model = tiny_gpt().to(dtype)
    config = OptimizerConfig(optimizer=name, lr=1e-2, bf16=precision == "bf16", fp16=precision == "fp16", initial_loss_scale=2.0**8)
    opt = get_optimizer(config, model)
    matrices = [p for g in opt.param_groups if g["optimizer"] == name for p in g["params"]]
    assert matrices and all(p.dtype == torch.float32 and p.dim() == 2 for p in matrices)
    batch = tokens()
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = model.loss(batch)
        opt.scale_loss(loss).backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for entry in opt.param_map.local:
        assert torch.equal(entry.model, entry.main.to(dtype))


@pytest.mark.parametrize("name", NAMES)
def test_nan_gradients_are_skipped_before_they_reach_the_weights(name: str) -> None:
    model = tiny_gpt()
    opt = get_optimizer(OptimizerConfig(optimizer=name, lr=1e-2), model)
    opt.zero_grad()
    model.loss(tokens()).backward()
    opt.step()
    opt.zero_grad()
    model.loss(tokens()).backward()
    model.decoder.layers[0].mlp.linear_fc1.weight.grad[0, 0] = float("nan")
    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    assert opt.step() == (False, None, None)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(state, [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]))
