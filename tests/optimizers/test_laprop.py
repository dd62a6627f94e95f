"""LaProp through get_optimizer equals emerging-optimizers' LaProp, bit for bit, and the paper's rule."""

from __future__ import annotations

import pytest
import torch
from emerging_optimizers.scalar_optimizers.laprop import LaProp

from optzoo import OptimizerConfig, get_optimizer
from tests.conftest import fill_grads, twin

CONFIG = OptimizerConfig(
    optimizer="laprop", lr=1e-3, decoupled_lr=3e-4, weight_decay=0.1, laprop_beta1=0.8, laprop_beta2=0.95,
    laprop_eps=1e-6, clip_grad=0.0,
)  # fmt: skip


def _step_uncompiled(optimizer: torch.optim.Optimizer) -> None:
    """Upstream's step with its ``torch.compile``d update run as plain torch ops (dynamo off)."""
    with torch._dynamo.config.patch(disable=True):
        optimizer.step()


def _upstream_over(groups: list[dict], by_name: dict[str, torch.Tensor]) -> LaProp:
    """Upstream's class, built directly with the hyperparameters optzoo put in each group."""
    keys = ("lr", "weight_decay", "betas", "eps", "correct_bias")
    return LaProp([{"params": [by_name[n] for n in g["param_names"]], **{k: g[k] for k in keys}} for g in groups])


@pytest.mark.parametrize("compiled", [False, True], ids=["upstream-uncompiled-bitwise", "upstream-compiled-1ulp"])
@pytest.mark.parametrize("correct_bias", [True, False])
def test_laprop_equals_emerging_optimizers_laprop(odd_model: torch.nn.Module, correct_bias: bool, compiled: bool) -> None:
    """Bitwise against upstream's class with its update uncompiled (CPU params take that path);
    against upstream's compiled kernel, within the ulp its fused division rounds differently by."""
    reference_model = twin(odd_model)
    ours = get_optimizer(CONFIG.replace(laprop_correct_bias=correct_bias), odd_model)
    assert {g["betas"] for g in ours.param_groups} == {(0.8, 0.95)} and {g["eps"] for g in ours.param_groups} == {1e-6}
    assert {g["correct_bias"] for g in ours.param_groups} == {correct_bias}
    reference = _upstream_over(ours.param_groups, dict(reference_model.named_parameters()))
    generator_a, generator_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(6):
        fill_grads(list(odd_model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        ours.step()
        reference.step() if compiled else _step_uncompiled(reference)
    # Compiled: one fp32 rounding apart per step in m (measured <= 2.4e-7 absolute), 6 steps.
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if compiled else {"atol": 0, "rtol": 0}
    for (name, p), q in zip(odd_model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, **tolerance, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][key], reference.state[q][key], **tolerance, msg=f"{name} {key}")


def test_bf16_steps_fp32_main_params_as_upstream_steps_fp32_masters() -> None:
    """bf16 params with fp32 main params: the main params equal upstream's LaProp stepped on fp32
    copies with the bf16 gradients widened, and the model params are those rounded to bf16."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in model.named_parameters()}
    ours = get_optimizer(CONFIG.replace(bf16=True), model)
    reference = _upstream_over(ours.param_groups, masters)
    generator = torch.Generator().manual_seed(7)
    for _ in range(5):
        fill_grads(list(model.parameters()), generator)
        for name, p in model.named_parameters():
            masters[name].grad = p.grad.float()
        assert ours.step()[0]
        _step_uncompiled(reference)
    main = {entry.model: entry.main for entry in ours.param_map.local}
    for name, p in model.named_parameters():
        torch.testing.assert_close(main[p], masters[name].detach(), atol=0, rtol=0, msg=name)
        assert torch.equal(p, masters[name].detach().to(torch.bfloat16)), name


def test_laprop_follows_the_paper_in_float64() -> None:
    """Ziyin et al. (2020), Algorithm 1 with bias correction and decoupled decay, transcribed here."""
    model = torch.nn.Linear(7, 4)
    config = CONFIG.replace(decoupled_lr=None)
    ours = get_optimizer(config, model)
    lr, wd, (b1, b2), eps = config.lr, config.weight_decay, (0.8, 0.95), 1e-6
    decay = {n: g["weight_decay"] for g in ours.param_groups for n in g["param_names"]}
    shadow = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    m = {n: torch.zeros_like(p) for n, p in shadow.items()}
    v = {n: torch.zeros_like(p) for n, p in shadow.items()}
    generator = torch.Generator().manual_seed(9)
    for t in range(1, 11):
        fill_grads(list(model.parameters()), generator)
        for name, param in model.named_parameters():
            g = param.grad.double()
            v[name] = b2 * v[name] + (1 - b2) * g * g
            m[name] = b1 * m[name] + (1 - b1) * g / ((v[name] / (1 - b2**t)).sqrt() + eps)
            shadow[name] = shadow[name] * (1 - lr * decay[name]) - lr * m[name] / (1 - b1**t)
        ours.step()
    assert wd == 0.1 and set(decay.values()) == {0.1, 0.0}  # the bias keeps no decay (standard overrides)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.double(), shadow[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_cpu_step_compiles_nothing(odd_model: torch.nn.Module) -> None:
    """Upstream's update is ``torch.compile``d: its first CPU step compiled for seconds, and past
    dynamo's recompile limit later shapes ran eagerly, rounding differently. CPU params step eagerly."""
    from torch._dynamo.utils import counters

    optimizer = get_optimizer(CONFIG, odd_model)
    torch._dynamo.reset()
    counters.clear()
    fill_grads(list(odd_model.parameters()), torch.Generator().manual_seed(1))
    optimizer.step()
    assert sum(counters["frames"].values()) == 0, dict(counters["frames"])


def test_laprop_refuses_complex_params_by_name() -> None:
    model = torch.nn.Module()
    model.z = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^`z`: laprop takes real params \(its second moment squares the gradient"):
        get_optimizer(CONFIG, model)


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("laprop_beta1", 1.0, ValueError, r"^`OptimizerConfig.laprop_beta1`: must lie in \[0, 1\); got 1.0"),
        ("laprop_beta2", -0.1, ValueError, r"^`OptimizerConfig.laprop_beta2`: must lie in \[0, 1\); got -0.1"),
        ("laprop_eps", 0.0, ValueError, r"^`OptimizerConfig.laprop_eps`: must be positive; got 0.0"),
        ("laprop_eps", float("nan"), ValueError, r"^`OptimizerConfig.laprop_eps`: must be finite"),
        ("laprop_correct_bias", 1, TypeError, r"^`OptimizerConfig.laprop_correct_bias`: wrong type; got 1 \(int\)"),
        ("laprop_beta1", "0.9", TypeError, r"^`OptimizerConfig.laprop_beta1`: wrong type"),
    ],
)
def test_laprop_fields_are_validated_by_name(field: str, value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        OptimizerConfig(optimizer="laprop", **{field: value})  # type: ignore[arg-type]


def test_laprop_may_be_the_scalar_optimizer_of_muon() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    optimizer = get_optimizer(OptimizerConfig(lr=1e-3, optimizer="muon", muon_scalar_optimizer="laprop"), model)
    assert sorted(type(o).__name__ for o in optimizer.optimizers) == ["LaProp", "Muon"]
