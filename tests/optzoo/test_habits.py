"""Issue 25 item 8: habits from other libraries are understood or pointed to, and the scalar
optimizer has an lr of its own (``muon_scalar_lr``), checked against torch.optim.

``adamw`` (any case) is ``adam``, which is ``torch.optim.AdamW``; ``betas=``, ``momentum=``,
``eps=`` and the like name no single optzoo field (one config may run Muon and AdamW at once), so
they are refused with the fields they mean.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.optim._muon as torch_muon
from torch import nn

from optzoo import OptimizerConfig, ParamKey, get_optimizer, parse_recipe
from tests.optimizers.reference.muon import drive, torch_newton_schulz_in_float64


@pytest.mark.parametrize("name", ["adamw", "AdamW", "ADAMW", "Adam"])
def test_adamw_in_any_case_is_adam(name: str) -> None:
    assert OptimizerConfig(lr=1e-3, optimizer=name).optimizer == "adam"
    assert OptimizerConfig(lr=1e-3, optimizer="muon", muon_scalar_optimizer=name).muon_scalar_optimizer == "adam"
    assert OptimizerConfig(lr=1e-3, optimizer="Muon").optimizer == "muon"


def test_adamw_steps_as_torch_adamw() -> None:
    model = nn.Linear(6, 5, bias=False).double()
    reference_param = nn.Parameter(model.weight.detach().clone())
    config = OptimizerConfig(lr=1e-2, optimizer="AdamW", weight_decay=0.1, adam_beta2=0.95, clip_grad=0.0)
    optimizer = get_optimizer(config, model, lint=False)
    reference = torch.optim.AdamW([reference_param], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    drive([(optimizer, [model.weight]), (reference, [reference_param])], steps=5)
    # float64 on both sides; fused/foreach kernels against torch's per-tensor loop round differently.
    torch.testing.assert_close(model.weight, reference_param, atol=1e-13, rtol=1e-13)


def test_adamw_with_l2_decay_is_a_contradiction() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`OptimizerConfig.optimizer`: 'adamw' is Adam with decoupled weight decay, and decoupled_weight_decay=False "
            "asks for L2 decay; got 'adamw'; expected 'adam' with decoupled_weight_decay=False (Adam + L2), or "
            "decoupled_weight_decay=True"
        ),
    ):
        OptimizerConfig(lr=1e-3, optimizer="adamw", decoupled_weight_decay=False)


def test_an_override_may_say_adamw_and_agrees_with_adam() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    overrides = {ParamKey(name="1.*"): {"optimizer": "AdamW"}, ParamKey(name="1.weight"): {"optimizer": "adam"}}
    optimizer = get_optimizer(OptimizerConfig(lr=1e-3, optimizer="sgd"), model, overrides, lint=False)
    assert {g["optimizer"] for g in optimizer.param_groups if "1.weight" in g["param_names"]} == {"adam"}


@pytest.mark.parametrize(
    ("keyword", "value", "meant"),
    [
        ("betas", (0.9, 0.95), "adam_beta1 and adam_beta2 (torch's betas=(b1, b2); lion_beta1 and lion_beta2 for Lion)"),
        ("momentum", 0.9, "sgd_momentum for SGD, muon_momentum for Muon (one config may run both)"),
        ("eps", 1e-6, "adam_eps (adaptive_muon_eps for Adaptive Muon)"),
        ("nesterov", True, "muon_nesterov (optzoo's SGD has no Nesterov option)"),
        ("adjust_lr_fn", "original", "muon_scale_mode, which takes torch.optim.Muon's names ('original', 'match_rms_adamw', 'spectral_unclamped')"),
        ("max_grad_norm", 1.0, "clip_grad"),
        ("fallback_lr_scale", 0.1, "muon_scalar_lr = lr * fallback_lr_scale (the lr of what Muon hands to muon_scalar_optimizer)"),
    ],
)
def test_other_libraries_keywords_point_to_the_field(keyword: str, value: Any, meant: str) -> None:
    expected = f"`OptimizerConfig.{keyword}`: not an optzoo field; got {keyword}={value!r}; expected {meant}"
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        OptimizerConfig(lr=1e-3, **{keyword: value})
    with pytest.raises(ValueError, match=re.escape(f"`config.{keyword}`: not an optzoo field; got {keyword!r}; expected {meant}")):
        parse_recipe(f"[config]\nlr = 1e-3\n{keyword} = {value!r}\n".replace("(", "[").replace(")", "]").replace("True", "true"))
    with pytest.raises(ValueError, match=re.escape(f"not an optzoo field; got {keyword!r}; expected {meant}")):
        get_optimizer(OptimizerConfig(lr=1e-3), nn.Linear(2, 2), {ParamKey(name="*"): {keyword: value}})


def test_an_unknown_keyword_keeps_pythons_message() -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'betaz'"):
        OptimizerConfig(lr=1e-3, betaz=1)  # type: ignore[call-arg]


# ---- muon_scalar_lr: torch.optim.Muon(lr=0.02) beside torch.optim.AdamW(lr=3e-4) ----------------


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_muon_scalar_lr_ports_torch_muon_beside_adamw(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two-optimizer torch setup of torch.optim.Muon's docstring, with AdamW at its own lr."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", torch_newton_schulz_in_float64)
    model = MLP().double()
    named = dict(model.named_parameters())
    matrices, head, biases = ["fc1.weight", "fc2.weight"], ["head.weight"], ["fc1.bias", "fc2.bias", "head.bias"]
    copies = {name: nn.Parameter(p.detach().clone()) for name, p in named.items()}
    muon = torch.optim.Muon([copies[n] for n in matrices], lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(
        [{"params": [copies[n] for n in head]}, {"params": [copies[n] for n in biases], "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
    )  # fmt: skip
    config = OptimizerConfig(
        optimizer="muon", lr=0.02, muon_scalar_lr=3e-4, weight_decay=0.1, adam_beta2=0.95, muon_scale_mode="original",
        muon_coefficient_type="simple", muon_nesterov=True, clip_grad=0.0,
    )  # fmt: skip
    optimizer = get_optimizer(config, model)
    assert [(g["optimizer"], g["lr"], g["param_names"]) for g in optimizer.param_groups] == [
        ("muon", 0.02, matrices), ("adam", 3e-4, head), ("adam", 3e-4, biases),
    ]  # fmt: skip

    class Both:
        def step(self) -> None:
            muon.step()
            adamw.step()

    order = [*matrices, *head, *biases]
    drive([(optimizer, [named[n] for n in order]), (Both(), [copies[n] for n in order])], steps=5)
    for name in order:
        torch.testing.assert_close(named[name], copies[name], atol=1e-12, rtol=1e-12, msg=name)


def test_muon_scalar_lr_scales_the_schedule_floor_and_yields_to_decoupled_lr() -> None:
    config = OptimizerConfig(optimizer="muon", lr=0.02, min_lr=2e-3, muon_scalar_lr=3e-4, decoupled_lr=1e-4, decoupled_min_lr=1e-5)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    optimizer = get_optimizer(config, model)
    schedule = {name: (g["max_lr"], g["min_lr"]) for g in optimizer.param_groups for name in g["param_names"]}
    assert schedule["1.weight"] == (0.02, 2e-3)
    assert schedule["2.weight"] == pytest.approx((3e-4, 3e-5))  # 2e-3 x 3e-4 / 0.02, the base floor scaled
    assert schedule["0.weight"] == (1e-4, 1e-5) and schedule["3.weight"] == (1e-4, 1e-5)  # decoupled_lr wins


def test_muon_scalar_lr_per_group_and_refused_when_negative() -> None:
    model = MLP()
    overrides = {ParamKey(name="fc2.*"): {"muon_scalar_lr": 1e-5}}
    optimizer = get_optimizer(OptimizerConfig(optimizer="muon", lr=0.02, muon_scalar_lr=3e-4), model, overrides)
    lrs = {name: g["lr"] for g in optimizer.param_groups for name in g["param_names"]}
    assert (lrs["fc2.weight"], lrs["fc2.bias"], lrs["fc1.bias"], lrs["head.weight"]) == (0.02, 1e-5, 3e-4, 3e-4)
    with pytest.raises(ValueError, match=r"`OptimizerConfig.muon_scalar_lr`: must be non-negative; got -1.0; expected a float >= 0 or None"):
        OptimizerConfig(lr=0.02, muon_scalar_lr=-1.0)
