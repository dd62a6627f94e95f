"""One battery over every registered optimizer: a new registration is covered automatically."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from optzoo.optimizers.registry import OptimizerSpec, get_spec, register, registered_names
from optzoo import OptimizerConfig, ParamKey, get_optimizer
from tests.conftest import fill_grads, train_with_resumed_twin

NAMES = registered_names()
LR = {
    "adam": 0.05, "sgd": 0.05, "lion": 0.03, "laprop": 0.05, "soap": 0.05, "muon": 0.02, "adaptive_muon": 0.02,
    "scion": 0.05, "spel": 0.05, "muon_hyperball": 0.05, "sinkhorn_muon": 0.05, "torch_muon": 0.05, "adafactor": 0.05,
    "rekls": 0.05, "psgd_pro": 0.02, "oblique_sgd": 0.05, "oblique_adam": 0.05,
}  # fmt: skip


def _on_the_set(name: str, weight: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A start and a target on a constrained algorithm's set, written from its paper (float64, not
    optzoo's code): orthogonal matrices (SPEL), the start's norm (hyperball), Sinkhorn-normalised
    matrices, rows summing to 7/5 and columns to 1 (Sinkhorn-Muon)."""
    if name == "spel":
        def polar(m: torch.Tensor) -> torch.Tensor:
            u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
            return (u @ vh).float()
        return polar(torch.randn_like(weight)), polar(target)
    if name == "muon_hyperball":
        start = torch.randn_like(weight)
        return start, target * (start.norm() / target.norm())
    if name == "sinkhorn_muon":
        def sinkhorn(m: torch.Tensor) -> torch.Tensor:
            m = m.double().exp()
            for _ in range(200):
                m = m / m.sum(dim=-2, keepdim=True)
                m = m / m.sum(dim=-1, keepdim=True) * (m.shape[-1] / m.shape[-2])
            return m.float()
        return sinkhorn(torch.randn_like(weight)), sinkhorn(target)
    raise AssertionError(f"{name}: a constrained algorithm needs its set written here")


class Quadratic(torch.nn.Module):
    """0.5 * ||A x - b||^2 over a 5x7 matrix and a bias: a convex problem every optimizer solves.

    With ``unit_dim`` the matrix's target has unit-norm slices along that dim: an optimizer that
    keeps its matrices there (the ``riemannian`` family: oblique SGD and Adam) can reach it."""

    def __init__(self, unit_dim: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(5, 7))
        self.bias = torch.nn.Parameter(torch.zeros(5))
        self.target_w = torch.randn(5, 7)
        if unit_dim is not None:
            self.target_w /= self.target_w.norm(dim=unit_dim, keepdim=True)
        self.target_b = torch.randn(5)

    def loss(self) -> torch.Tensor:
        return 0.5 * ((self.weight - self.target_w).square().sum() + (self.bias - self.target_b).square().sum())


def _config(name: str, **changes: object) -> OptimizerConfig:
    values: dict[str, object] = {"optimizer": name, "lr": LR.get(name, 0.01), "weight_decay": 0.0, "clip_grad": 0.0}
    return OptimizerConfig(**{**values, **changes})  # type: ignore[arg-type]


def test_every_name_has_a_spec_with_a_description_and_known_fields() -> None:
    config_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    for name in NAMES:
        spec = get_spec(name)
        assert spec.name == name and spec.description and spec.shapes
        assert set(spec.config_fields) <= config_fields and set(spec.instance_fields) <= set(spec.config_fields)


@pytest.mark.parametrize("name", NAMES)
def test_converges_on_a_quadratic(name: str) -> None:
    config = _config(name)
    unit_dim = getattr(config, f"{name}_dim") if get_spec(name).family == "riemannian" else None
    model = Quadratic(unit_dim)
    if get_spec(name).constraint:  # it reaches a target on its set, from a start on it
        start, model.target_w = _on_the_set(name, model.weight.detach(), model.target_w)
        model.weight.data.copy_(start)
    if name == "adafactor":  # its step is lr times RMS(param) (Shazeer & Stern, 2018): zero weights barely move
        model.weight.data.normal_()
    opt = get_optimizer(config, model, {})
    start = model.loss().item()
    for _ in range(200):
        opt.zero_grad()
        model.loss().backward()
        opt.step()
    if name == "sinkhorn_muon":
        # Its map takes exp(W) before normalising, so only its fixed points S(exp(T)) = T are reachable:
        # it gets closer, and the weights stay Sinkhorn-normalised (rows sum to 7/5, columns to 1).
        weight = model.weight.detach()
        assert model.loss().item() < 0.25 * start
        torch.testing.assert_close(weight.sum(dim=1), torch.full((5,), 7 / 5), rtol=0, atol=1e-4)
        torch.testing.assert_close(weight.sum(dim=0), torch.ones(7), rtol=0, atol=1e-2)
        assert bool((weight >= 0).all())
        return
    assert model.loss().item() < 0.01 * start, name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_steps_on_cpu_and_keeps_dtype(name: str, dtype: torch.dtype) -> None:
    model = torch.nn.Linear(7, 5).to(dtype)
    opt = get_optimizer(_config(name), model)
    generator = torch.Generator().manual_seed(0)
    before = [p.detach().clone() for p in model.parameters()]
    fill_grads(list(model.parameters()), generator)
    opt.step()
    for old, param in zip(before, model.parameters()):
        assert param.dtype == dtype and param.device.type == "cpu" and not torch.equal(old, param)
        assert all(v.dtype in (dtype, torch.float32) for v in opt.state[param].values() if torch.is_tensor(v))


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_continues_identically(name: str) -> None:
    model = torch.nn.Linear(7, 5)
    _, twin_model = train_with_resumed_twin(model, _config(name), steps=6, resume_after=2)
    for p, q in zip(model.parameters(), twin_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_bad_arguments_raise_with_the_field_named(name: str) -> None:
    model = torch.nn.Linear(7, 5)
    with pytest.raises(ValueError, match=r"`OptimizerConfig.lr`: must be non-negative; got -1.0"):
        get_optimizer(_config(name, lr=-1.0), model)
    for field in get_spec(name).config_fields:
        if "beta" in field or "momentum" in field:  # decay rates must lie in [0, 1)
            with pytest.raises(ValueError, match=rf"param group #0 \(rules #0 name='\*'\): `OptimizerConfig.{field}`: .*got 1.5"):
                get_optimizer(_config(name), model, {ParamKey(name="*"): {field: 1.5}})


def test_a_duplicate_registration_raises_listing_the_names() -> None:
    spec = get_spec("sgd")
    with pytest.raises(ValueError, match=r"`sgd`: optimizer already registered; got a second registration; expected a new name \(registered: \['adam', 'sgd', 'lion'"):
        register(OptimizerSpec(**{**spec.__dict__}))


def test_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"`optimizer`: unknown optimizer; got 'adamax'; expected one of \['adam', 'sgd', 'lion'"):
        get_spec("adamax")
