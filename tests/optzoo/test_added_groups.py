"""``add_param_group`` after ``get_optimizer``: new params routed by the same rules (issue #25 item 5).

Lightning's ``BackboneFinetuning`` through the real Trainer is in
tests/integrations/test_framework_contract.py; here the rules, the errors and the precisions."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from tests.conftest import twin

BACKBONE_DECAY = ["backbone.0.weight", "backbone.2.weight"]
BACKBONE_NO_DECAY = ["backbone.0.bias", "backbone.1.weight", "backbone.1.bias", "backbone.2.bias"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))  # type: ignore[no-any-return]


def _model(frozen: bool = True) -> torch.nn.Module:
    model = Net()
    for p in model.backbone.parameters():
        p.requires_grad_(not frozen)
    return model


def _unfreeze(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    for p in model.backbone.parameters():
        p.requires_grad_(True)
    return list(model.backbone.parameters())


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    opt.zero_grad()
    model(torch.randn(4, 6, generator=generator).to(dtype)).square().mean().backward()
    opt.step()


def _by_names(model: torch.nn.Module, group: dict[str, object]) -> list[torch.nn.Parameter]:
    params = dict(model.named_parameters())
    return [params[n] for n in group["param_names"]]  # type: ignore[attr-defined]


def _summary(opt: torch.optim.Optimizer) -> list[tuple[str, float, float, list[str]]]:
    return [(g["optimizer"], g["lr"], g["weight_decay"], list(g["param_names"])) for g in opt.param_groups]


def test_without_keys_new_params_join_the_groups_routing_gives_and_step_as_torch_adamw() -> None:
    model = _model()
    reference = twin(model)
    opt = get_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0), model, trace=False)
    _step(model, opt, 0)
    opt.add_param_group({"params": _unfreeze(model)})
    assert _summary(opt) == [("adam", 1e-2, 0.1, ["head.weight", *BACKBONE_DECAY]), ("adam", 1e-2, 0.0, ["head.bias", *BACKBONE_NO_DECAY])]
    by_name = dict(reference.named_parameters())
    flags = {k: v for k, v in opt.param_groups[0].items() if k in ("betas", "eps", "fused")}
    adamw = torch.optim.AdamW(
        [{"params": [by_name["head.weight"]], "weight_decay": 0.1}, {"params": [by_name["head.bias"]], "weight_decay": 0.0}], lr=1e-2, **flags
    )
    _step(reference, adamw, 0)
    _unfreeze(reference)
    adamw.param_groups[0]["params"] += [by_name[n] for n in BACKBONE_DECAY]
    adamw.param_groups[1]["params"] += [by_name[n] for n in BACKBONE_NO_DECAY]
    for seed in (1, 2, 3):
        _step(model, opt, seed)
        _step(reference, adamw, seed)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, by_name[name], atol=0, rtol=0, msg=name)


def test_explicit_keys_make_sibling_groups_that_a_later_edit_of_one_reaches() -> None:
    model = _model()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, optimizer="muon"), model, trace=False)
    opt.add_param_group({"params": _unfreeze(model), "lr": 1e-3, "betas": (0.8, 0.9)})
    added = opt.param_groups[-2:]
    assert [(g["optimizer"], g["lr"], g["weight_decay"], g["param_names"]) for g in added] == [
        ("muon", 1e-3, 0.1, BACKBONE_DECAY), ("adam", 1e-3, 0.0, BACKBONE_NO_DECAY)
    ]  # fmt: skip
    assert "betas" not in added[0] and added[1]["betas"] == (0.8, 0.9)  # a key goes to the groups that have it
    opt.param_groups[-1]["lr"] = 5e-4  # as BackboneFinetuning does
    _step(model, opt, 0)
    assert [g["lr"] for g in added] == [5e-4, 5e-4]
    added[0]["lr"], added[1]["lr"] = 1e-4, 2e-4  # set apart on purpose: kept
    _step(model, opt, 1)
    assert [g["lr"] for g in added] == [1e-4, 2e-4]


def test_bf16_params_get_fp32_main_copies_and_the_state_round_trips() -> None:
    model = _model().to(torch.bfloat16)
    opt = get_optimizer(OptimizerConfig(lr=1e-2, bf16=True), model, trace=False)
    new = _unfreeze(model)
    opt.add_param_group({"params": new, "lr": 0.1})  # a step larger than bf16's spacing
    mains = [p for g in opt.param_groups[-2:] for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in mains) and not any(m is p for m in mains for p in new)
    before = [p.detach().clone() for p in new]
    _step(model, opt, 0)
    assert all(not torch.equal(b, p) for b, p in zip(before, new))  # the bf16 model params got the update
    assert all(torch.equal(m.to(torch.bfloat16), p) for m, p in zip(mains, [p for g in opt.param_groups[-2:] for p in _by_names(model, g)]))
    saved = copy.deepcopy(opt.state_dict())
    assert set(saved["main_params"]) >= set(BACKBONE_DECAY + BACKBONE_NO_DECAY)
    opt.load_state_dict(saved)


def test_params_already_stepped_are_kept_where_they_are_with_a_warning() -> None:
    model = _model(frozen=False)
    opt = get_optimizer(OptimizerConfig(lr=1e-2), model, trace=False)
    groups = _summary(opt)
    with pytest.warns(UserWarning, match=re.escape("`add_param_group`: params already stepped are kept in their groups; got backbone.0.weight")):
        opt.add_param_group({"params": [model.backbone[0].weight], "lr": 1.0})
    assert _summary(opt) == groups


@pytest.mark.parametrize(
    ("group", "error", "pattern"),
    [
        (lambda m: {"params": [torch.nn.Parameter(torch.zeros(3))]}, ValueError,
         r"params that routing cannot place; got params\[0\] \(\(3,\), float32\) is not a parameter of the model get_optimizer was given"),
        (lambda m: {"params": [m.backbone[0].weight]}, ValueError, r"got backbone.0.weight does not require grad"),
        (lambda m: {"params": _unfreeze(m), "optimizer": "sgd"}, ValueError, r"keys that routing decides; got \['optimizer'\]"),
        (lambda m: {"params": _unfreeze(m), "momentum": 0.9}, ValueError, r"keys no group of these params has; got \['momentum'\]"),
        (lambda m: {"params": _unfreeze(m), "lr": -1.0}, ValueError, r"`add_param_group`: .*lr"),
        (lambda m: {"params": set(_unfreeze(m))}, TypeError, r"'params' must be an ordered collection of tensors; got set"),
        (lambda m: {"params": _unfreeze(m), "param_names": ["a"]}, ValueError, r"'param_names' are not the params' names in the model"),
        (lambda m: {"lr": 1.0}, TypeError, r"a group is a dict with 'params'; got \['lr'\]"),
    ],
)
def test_what_cannot_be_routed_is_refused_and_nothing_changes(group: object, error: type[Exception], pattern: str) -> None:
    model = _model()
    opt = get_optimizer(OptimizerConfig(lr=1e-2), model, trace=False)
    before = copy.deepcopy(_summary(opt)), len(opt.optimizers), len(opt.param_map.entries)
    with pytest.raises(error, match=pattern):
        opt.add_param_group(group(model))  # type: ignore[operator]
    assert (_summary(opt), len(opt.optimizers), len(opt.param_map.entries)) == before


def test_a_copy_of_the_optimizer_refuses_new_params() -> None:
    model = _model()
    opt = copy.deepcopy(get_optimizer(OptimizerConfig(lr=1e-2), model, trace=False))
    with pytest.raises(TypeError, match="no routing to place new params; got an optimizer not built by get_optimizer \\(or a copy of one\\)"):
        opt.add_param_group({"params": _unfreeze(model)})


def _add_under_layer_wise(rank: int, world_size: int) -> str:
    model = _model()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, use_layer_wise_distributed_optimizer=True), model, trace=False)
    groups = _summary(opt)
    try:
        opt.add_param_group({"params": _unfreeze(model)})
    except TypeError as error:
        assert _summary(opt) == groups
        return str(error)
    return "added"


@pytest.mark.slow
def test_the_distributed_optimizers_refuse_new_params_with_the_reason() -> None:
    from tests.distributed.harness import run_ranks

    for message in run_ranks(2, _add_under_layer_wise):
        assert re.search(r"`DistributedOptimizer.add_param_group`: the distributed optimizer's sharding plan is fixed when it is built", message)
