"""Megatron-Core's optimizer API that users call, on one process (issue #23 items 6 and 10).

Expectations come from Megatron-Core's sources and unit tests (NVIDIA/Megatron-LM
``megatron/core/optimizer/optimizer.py``, ``optimizer_config.py``, ``tests/unit_tests/test_optimizer.py``)
and from hand counts, never from the code under test. The distributed side is in
``tests/distributed/test_megatron_api.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from optzoo import OptimizerConfig, ParamKey, get_optimizer


class Net(nn.Module):
    """Megatron-Core's ``tests/unit_tests/test_optimizer.py::Net``: the parameters its
    ``_get_param_groups`` tests route (conv1, conv2, fc1..fc3)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


# ---- item 6: a group's min_lr is checked against its own max_lr -----------------------------


def test_megatron_overlapping_matches_give_conv1_its_own_schedule_above_the_base_lr() -> None:
    """The behaviour of Megatron-Core's ``test_get_param_groups_overlapping_matches``: over
    ``lr=0.01``, ``*conv*`` gets ``wd_mult=0`` and ``*conv1*`` additionally ``min_lr=10,
    max_lr=20``; three groups result, and conv1's schedule runs from 20 down to 10."""
    torch.manual_seed(0)
    net = Net()
    overrides = {ParamKey(name="*conv*"): {"wd_mult": 0.0}, ParamKey(name="*conv1*"): {"min_lr": 10, "max_lr": 20}}
    optimizer = get_optimizer(OptimizerConfig(optimizer="adam", lr=0.01), net, overrides, lint=False)
    groups = {tuple(g["param_names"]): g for g in optimizer.param_groups}
    assert set(groups) == {
        ("conv1.weight", "conv1.bias"), ("conv2.weight", "conv2.bias"),
        ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"),
    }  # fmt: skip
    conv1, conv2 = groups["conv1.weight", "conv1.bias"], groups["conv2.weight", "conv2.bias"]
    rest = groups["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
    assert (conv1["wd_mult"], conv1["min_lr"], conv1["max_lr"]) == (0.0, 10, 20)
    assert (conv2["wd_mult"], conv2["min_lr"], conv2["max_lr"]) == (0.0, None, 0.01)
    assert (rest["wd_mult"], rest["min_lr"], rest["max_lr"]) == (1.0, None, 0.01)
    assert conv1["lr"] == 20  # optzoo applies max_lr without a scheduler


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"min_lr": 0.05}, r"`OptimizerConfig.min_lr`: must not exceed lr; got min_lr=0.05, lr=0.01; expected min_lr <= lr"),
        ({"min_lr": 30, "max_lr": 20}, r"`min_lr` must not exceed the group's lr; got min_lr=30, lr=20; expected min_lr <= lr"),
    ],
)
def test_min_lr_above_the_group_s_own_peak_is_still_refused(override: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=r"^`?param group #0 \(rules #0 name='\*'\)`?: " + message):
        get_optimizer(OptimizerConfig(lr=0.01), nn.Linear(2, 2), {ParamKey(name="*"): override}, lint=False)


def test_a_base_min_lr_above_an_override_s_max_lr_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`min_lr` must not exceed the group's lr; got min_lr=0.005, lr=0.001"):
        get_optimizer(OptimizerConfig(lr=0.01, min_lr=0.005), nn.Linear(2, 2), {ParamKey(name="*"): {"max_lr": 0.001}}, lint=False)


# ---- grad_norm_skip_threshold: the field ------------------------------------------------------


def test_grad_norm_skip_threshold_defaults_to_inf_as_megatron() -> None:
    # Megatron-Core tests/unit_tests/optimizer/test_clip_grads.py::test_grad_norm_skip_threshold_config
    assert OptimizerConfig().grad_norm_skip_threshold == float("inf")
    assert OptimizerConfig(grad_norm_skip_threshold=2).grad_norm_skip_threshold == 2


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), -math.inf, pytest.param(10**400, id="10**400")])
def test_grad_norm_skip_threshold_must_be_positive(value: float) -> None:
    with pytest.raises(
        ValueError,
        match=r"^`OptimizerConfig.grad_norm_skip_threshold`: must be a finite number > 0, or inf; got .+; expected a number > 0, or inf to never skip$",
    ):
        OptimizerConfig(grad_norm_skip_threshold=value)


@pytest.mark.parametrize("value", [True, "1.0", None])
def test_grad_norm_skip_threshold_must_be_a_number(value: object) -> None:
    with pytest.raises(TypeError, match=r"^`OptimizerConfig.grad_norm_skip_threshold`: wrong type; got .+; expected a number$"):
        OptimizerConfig(grad_norm_skip_threshold=value)  # type: ignore[arg-type]


def test_grad_norm_skip_threshold_is_model_wide() -> None:
    with pytest.raises(ValueError, match=r"field is model-wide and cannot differ per group; got 'grad_norm_skip_threshold'"):
        get_optimizer(OptimizerConfig(lr=0.01), nn.Linear(2, 2), {ParamKey(name="*"): {"grad_norm_skip_threshold": 1.0}}, lint=False)
