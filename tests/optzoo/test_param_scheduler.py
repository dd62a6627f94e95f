"""OptimizerParamScheduler: Megatron-Core's schedules against closed forms written out by hand.

Every expected value below is a number or a formula typed into this file (never the scheduler's
own helpers). Dyadic settings (max_lr=1, min_lr=0.125, warmup 4, decay 12) make most of them
exact; the ones with cos, sqrt or pow are compared with ``close``.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, OptimizerParamScheduler, ParamKey, get_optimizer, get_standard_config_overrides
from tests.conftest import fill_grads, tiny_gpt, twin

# warmup [0, 4], decay over steps 4..12 (8 steps), lr from 0 up to 1, then down to 0.125.
BASE: dict[str, Any] = dict(
    init_lr=0.0, max_lr=1.0, min_lr=0.125, lr_warmup_steps=4, lr_decay_steps=12, lr_decay_style="linear",
    start_wd=0.25, end_wd=0.25, wd_incr_steps=8, wd_incr_style="constant",
)  # fmt: skip
WSD = dict(lr_decay_style="WSD", wsd_decay_steps=4)  # anneal over the last 4 steps: 8 -> 12
ISR_LONG = dict(lr_decay_style="inverse-square-root", lr_decay_steps=1000)
pi, cos, sqrt = math.pi, math.cos, math.sqrt


def close(got: float, want: float) -> bool:
    # The closed forms here order their float operations differently from the scheduler:
    # a few ulps at values <= 1 apart, so 1e-15 relative (plus 1e-16 absolute near 0).
    return math.isclose(got, want, rel_tol=1e-15, abs_tol=1e-16)


def sgd(*groups: dict[str, Any]) -> torch.optim.SGD:
    """A plain torch optimizer; each group dict adds a group around a fresh parameter."""
    specs = groups or ({},)
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], **g} for g in specs], lr=0.5)


def scheduler(optimizer: torch.optim.Optimizer | None = None, **changes: Any) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer if optimizer is not None else sgd(), **{**BASE, **changes})


def run_to(sched: OptimizerParamScheduler, step: int) -> None:
    """Advance one step at a time, as a training loop does."""
    for _ in range(step - sched.num_steps):
        sched.step(1)


WARMUP = [(0, 0.0), (1, 0.25), (2, 0.5), (4, 1.0)]  # every style: linear from init_lr to max_lr
LR_CASES: list[tuple[str, dict[str, Any], int, float]] = [
    *[("linear", {}, s, v) for s, v in WARMUP],
    ("linear", {}, 6, 0.125 + 0.875 * (1 - 2 / 8)),  # 0.78125
    ("linear", {}, 8, 0.5625),
    ("linear", {}, 12, 0.125),
    ("linear", {}, 13, 0.125),
    ("linear", {}, 100, 0.125),
    *[("cosine", {"lr_decay_style": "cosine"}, s, v) for s, v in WARMUP],
    ("cosine", {"lr_decay_style": "cosine"}, 6, 0.125 + 0.5 * 0.875 * (1 + cos(pi * 2 / 8))),
    ("cosine", {"lr_decay_style": "cosine"}, 8, 0.125 + 0.5 * 0.875 * (1 + cos(pi / 2))),  # ~0.5625
    ("cosine", {"lr_decay_style": "cosine"}, 12, 0.125),
    ("cosine", {"lr_decay_style": "cosine"}, 13, 0.125),
    *[("constant", {"lr_decay_style": "constant"}, s, v) for s, v in WARMUP],
    ("constant", {"lr_decay_style": "constant"}, 8, 1.0),
    ("constant", {"lr_decay_style": "constant"}, 12, 1.0),
    ("constant", {"lr_decay_style": "constant"}, 100, 1.0),  # no floor past the end
    *[("isr", {"lr_decay_style": "inverse-square-root"}, s, v) for s, v in WARMUP],
    ("isr", {"lr_decay_style": "inverse-square-root"}, 9, 2 / 3),  # max * sqrt(4) / sqrt(9)
    ("isr", {"lr_decay_style": "inverse-square-root"}, 12, 2 / sqrt(12)),
    ("isr", {"lr_decay_style": "inverse-square-root"}, 13, 0.125),  # past lr_decay_steps: min_lr
    ("isr-long", ISR_LONG, 16, 0.5),
    ("isr-long", ISR_LONG, 64, 0.25),
    ("isr-long", ISR_LONG, 400, 0.125),  # 2 / sqrt(400) = 0.1 is under the floor
    ("isr-long", ISR_LONG, 1001, 0.125),
    ("isr-no-warmup", {**ISR_LONG, "lr_warmup_steps": 0}, 0, 1.0),  # max(steps, 1) = max(warmup, 1)
    ("isr-no-warmup", {**ISR_LONG, "lr_warmup_steps": 0}, 4, 0.5),
    ("linear-no-warmup", {"lr_warmup_steps": 0}, 0, 1.0),
    ("linear-no-warmup", {"lr_warmup_steps": 0}, 6, 0.125 + 0.875 * 0.5),
]
for sub, at_9, at_10 in [
    ("linear", 0.125 + 0.875 * 0.75, 0.5625),
    ("cosine", 0.125 + 0.875 * 0.5 * (1 + cos(pi * 0.25)), 0.125 + 0.875 * 0.5 * (1 + cos(pi * 0.5))),
    ("exponential", 0.125 + 0.875 * (2 * 0.5**0.25 - 1), 0.125 + 0.875 * (2 * 0.5**0.5 - 1)),
    ("minus_sqrt", 0.125 + 0.875 * 0.5, 0.125 + 0.875 * (1 - sqrt(0.5))),  # 1 - sqrt(1/4) = 1/2
]:
    wsd = {**WSD, "lr_wsd_decay_style": sub}
    LR_CASES += [(f"WSD-{sub}", wsd, s, v) for s, v in WARMUP]
    LR_CASES += [(f"WSD-{sub}", wsd, s, v) for s, v in [(6, 1.0), (8, 1.0), (9, at_9), (10, at_10), (12, 0.125), (13, 0.125)]]


@pytest.mark.parametrize(("style", "changes", "step", "want"), [pytest.param(*c, id=f"{c[0]}@{c[2]}") for c in LR_CASES])
def test_lr_at_chosen_steps_matches_the_closed_form(style: str, changes: dict[str, Any], step: int, want: float) -> None:
    optimizer = sgd()
    sched = scheduler(optimizer, **changes)
    run_to(sched, step)
    assert close(optimizer.param_groups[0]["lr"], want), (optimizer.param_groups[0]["lr"], want)
    assert sched.get_lr({}) == optimizer.param_groups[0]["lr"]


RAMP = dict(start_wd=0.125, end_wd=0.625, wd_incr_steps=8)  # delta 0.5 over 8 steps
WD_CASES: list[tuple[str, dict[str, Any], int, float]] = [
    ("constant", {}, 0, 0.25),
    ("constant", {}, 4, 0.25),
    ("constant", {}, 9, 0.25),
    ("linear", {**RAMP, "wd_incr_style": "linear"}, 0, 0.125),
    ("linear", {**RAMP, "wd_incr_style": "linear"}, 2, 0.25),
    ("linear", {**RAMP, "wd_incr_style": "linear"}, 4, 0.375),
    ("linear", {**RAMP, "wd_incr_style": "linear"}, 8, 0.625),
    ("linear", {**RAMP, "wd_incr_style": "linear"}, 9, 0.625),
    ("linear", {**RAMP, "wd_incr_style": "linear"}, 100, 0.625),
    ("cosine", {**RAMP, "wd_incr_style": "cosine"}, 0, 0.125),  # cos(pi) = -1
    ("cosine", {**RAMP, "wd_incr_style": "cosine"}, 2, 0.125 + 0.5 * 0.5 * (1 + cos(pi * 0.75))),
    ("cosine", {**RAMP, "wd_incr_style": "cosine"}, 4, 0.125 + 0.5 * 0.5 * (1 + cos(pi * 0.5))),
    ("cosine", {**RAMP, "wd_incr_style": "cosine"}, 8, 0.625),
    ("cosine", {**RAMP, "wd_incr_style": "cosine"}, 9, 0.625),
]


@pytest.mark.parametrize(("style", "changes", "step", "want"), [pytest.param(*c, id=f"{c[0]}@{c[2]}") for c in WD_CASES])
def test_wd_at_chosen_steps_matches_the_closed_form(style: str, changes: dict[str, Any], step: int, want: float) -> None:
    optimizer = sgd()
    sched = scheduler(optimizer, **changes)
    run_to(sched, step)
    assert close(optimizer.param_groups[0]["weight_decay"], want)
    assert sched.get_wd() == optimizer.param_groups[0]["weight_decay"]


def test_a_group_s_own_max_lr_min_lr_wd_mult_and_wd_range_win_and_none_means_the_scheduler_s() -> None:
    optimizer = sgd(
        {},
        {"max_lr": 2.0, "min_lr": None, "wd_mult": 0.5},
        {"max_lr": None, "min_lr": 0.5, "start_wd": 0.0, "end_wd": 1.0},
    )
    sched = scheduler(optimizer, wd_incr_style="linear", start_wd=0.25, end_wd=0.25, wd_incr_steps=8)
    run_to(sched, 2)  # warmup from the shared init_lr (0) towards each group's max_lr; wd ramp 1/4
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 1.0, 0.5]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.25, 0.125, 0.25]
    run_to(sched, 8)  # linear decay halfway: min + 0.5 * (max - min); wd ramp at its end
    assert [g["lr"] for g in optimizer.param_groups] == [0.5625, 0.125 + 0.5 * 1.875, 0.5 + 0.5 * 0.5]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.25, 0.125, 1.0]


def test_on_get_optimizer_each_group_follows_its_own_max_lr_min_lr_wd_mult_and_wd_range() -> None:
    config = OptimizerConfig(lr=0.5, min_lr=0.0625, decoupled_lr=0.25, decoupled_min_lr=0.03125, weight_decay=0.125)
    ramp = ParamKey(name="decoder.layers.*.mlp.linear_fc*.weight")
    overrides = {**get_standard_config_overrides(config), ramp: {"start_wd": 0.0, "end_wd": 0.5}}
    model = tiny_gpt()
    optimizer = get_optimizer(config, model, overrides)
    sched = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=0.5, min_lr=0.0625, lr_warmup_steps=2, lr_decay_steps=10,
        lr_decay_style="linear", start_wd=0.125, end_wd=0.25, wd_incr_steps=8, wd_incr_style="linear",
    )  # fmt: skip
    first = {name: index for index, g in enumerate(optimizer.param_groups) for name in g["param_names"]}
    default = first["decoder.layers.0.self_attention.linear_qkv.weight"]
    decoupled = first["output_layer.weight"]
    assert first["embedding.word_embeddings.weight"] == decoupled
    biases = first["decoder.layers.0.self_attention.linear_qkv.bias"]
    ramped = first["decoder.layers.0.mlp.linear_fc1.weight"]
    # step: (default lr, decoupled lr, scheduler's wd, ramped group's wd): warmup 0 -> 2, linear
    # decay 2 -> 10; the scheduler's wd ramp 0.125 -> 0.25 and the ramped group's 0 -> 0.5 over 8.
    expected = {
        0: (0.0, 0.0, 0.125, 0.0),
        1: (0.25, 0.125, 0.140625, 0.0625),
        2: (0.5, 0.25, 0.15625, 0.125),
        6: (0.0625 + 0.5 * 0.4375, 0.03125 + 0.5 * 0.21875, 0.21875, 0.375),
        10: (0.0625, 0.03125, 0.25, 0.5),
        11: (0.0625, 0.03125, 0.25, 0.5),
    }
    generator = torch.Generator().manual_seed(0)
    for step in range(12):
        if step in expected:
            lr, decoupled_lr, wd, ramped_wd = expected[step]
            groups = optimizer.param_groups
            assert [groups[i]["lr"] for i in (default, decoupled, biases, ramped)] == [lr, decoupled_lr, lr, lr]
            # biases: the scheduler's ramp times their wd_mult of 0
            assert [groups[i]["weight_decay"] for i in (default, decoupled, biases, ramped)] == [wd, wd, 0.0, ramped_wd]
            inner = [g for opt in optimizer.optimizers for g in opt.param_groups]
            assert sorted(map(id, inner)) == sorted(map(id, groups))  # the inner optimizers' own dicts
        fill_grads(list(model.parameters()), generator)
        optimizer.step()
        sched.step(1)


def train(model: torch.nn.Module, optimizer: Any, sched: OptimizerParamScheduler, steps: int, generator: torch.Generator) -> list[list[tuple[float, float]]]:
    """``steps`` training steps; the (lr, weight_decay) of every group after each."""
    seen = []
    for _ in range(steps):
        fill_grads(list(model.parameters()), generator)
        optimizer.step()
        sched.step(1)
        seen.append([(g["lr"], g["weight_decay"]) for g in optimizer.param_groups])
    return seen


def build(model: torch.nn.Module) -> tuple[Any, OptimizerParamScheduler]:
    config = OptimizerConfig(lr=1e-2, min_lr=1e-3, decoupled_lr=3e-3, weight_decay=0.1)
    optimizer = get_optimizer(config, model)  # the standard overrides; the scheduler's wd ramp
    sched = OptimizerParamScheduler(
        optimizer, init_lr=1e-4, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=3, lr_decay_steps=15,
        lr_decay_style="cosine", start_wd=0.0, end_wd=0.1, wd_incr_steps=12, wd_incr_style="cosine",
    )  # fmt: skip
    return optimizer, sched


def test_resume_from_step_10_equals_an_uninterrupted_20_step_run_exactly() -> None:
    straight = tiny_gpt()
    resumed = twin(straight)
    optimizer, sched = build(straight)
    expected = train(straight, optimizer, sched, 20, torch.Generator().manual_seed(7))

    generator = torch.Generator().manual_seed(7)
    optimizer, sched = build(resumed)
    seen = train(resumed, optimizer, sched, 10, generator)
    checkpoint = copy.deepcopy({"model": resumed.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": sched.state_dict()})
    del optimizer, sched
    resumed = tiny_gpt()
    resumed.load_state_dict(checkpoint["model"])
    optimizer, sched = build(resumed)
    optimizer.load_state_dict(checkpoint["optimizer"])
    sched.load_state_dict(checkpoint["scheduler"])
    assert sched.num_steps == 10
    seen += train(resumed, optimizer, sched, 10, generator)

    assert seen == expected
    for p, q in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_state_dict_has_exactly_megatron_s_keys() -> None:
    sched = scheduler(**WSD, lr_wsd_decay_style="linear")
    sched.step(3)
    assert sched.state_dict() == {
        "max_lr": 1.0, "lr_warmup_steps": 4, "num_steps": 3, "lr_decay_style": "WSD", "lr_decay_steps": 12,
        "min_lr": 0.125, "start_wd": 0.25, "end_wd": 0.25, "wd_incr_style": "constant", "wd_incr_steps": 8,
    }  # fmt: skip


def saved(steps: int = 8, **changes: Any) -> dict[str, Any]:
    sched = scheduler(**changes)
    sched.step(steps)
    return sched.state_dict()


def mismatch(key: str, checkpoint: object, ours: object) -> str:
    return re.escape(
        f"`OptimizerParamScheduler.{key}`: the checkpoint and this scheduler disagree; got {checkpoint!r} in "
        f"the checkpoint, {ours!r} in the scheduler; expected equal values, or use_checkpoint_opt_param_scheduler=True "
        "(the checkpoint's win) or override_opt_param_scheduler=True (the scheduler's win)"
    )


@pytest.mark.parametrize(
    ("changes", "key", "checkpoint", "ours"),
    [
        ({"max_lr": 0.5}, "max_lr", 1.0, 0.5),
        ({"min_lr": 0.0}, "min_lr", 0.125, 0.0),
        ({"lr_warmup_steps": 2}, "lr_warmup_steps", 4, 2),
        ({"lr_decay_steps": 16}, "lr_decay_steps", 12, 16),
        ({"lr_decay_style": "cosine"}, "lr_decay_style", "linear", "cosine"),
        ({"start_wd": 0.0, "wd_incr_style": "linear"}, "start_wd", 0.25, 0.0),
        ({"end_wd": 0.5, "wd_incr_style": "linear"}, "end_wd", 0.25, 0.5),
        ({"wd_incr_steps": 4}, "wd_incr_steps", 8, 4),
        ({"wd_incr_style": "linear"}, "wd_incr_style", "constant", "linear"),
    ],
)
def test_a_mismatch_without_either_flag_is_a_value_error_and_changes_nothing(
    changes: dict[str, Any], key: str, checkpoint: object, ours: object
) -> None:
    optimizer = sgd()
    sched = scheduler(optimizer, use_checkpoint_opt_param_scheduler=False, **changes)
    before = (sched.state_dict(), optimizer.param_groups[0]["lr"])
    with pytest.raises(ValueError, match=f"^{mismatch(key, checkpoint, ours)}$"):
        sched.load_state_dict(saved())
    assert (sched.state_dict(), optimizer.param_groups[0]["lr"]) == before


def test_equal_values_without_either_flag_load() -> None:
    sched = scheduler(use_checkpoint_opt_param_scheduler=False)
    sched.load_state_dict(saved(8))
    assert (sched.num_steps, sched.optimizer.param_groups[0]["lr"]) == (8, 0.5625)


def test_use_checkpoint_takes_the_checkpoint_s_values_and_applies_them_at_once() -> None:
    optimizer = sgd()
    sched = scheduler(optimizer, max_lr=0.5, lr_decay_style="cosine", wd_incr_style="linear", start_wd=0.0, end_wd=1.0)
    sched.load_state_dict(saved(8, wd_incr_style="linear", start_wd=0.125, end_wd=0.625))
    assert (sched.max_lr, sched.lr_decay_style, sched.start_wd, sched.end_wd) == (1.0, "linear", 0.125, 0.625)
    # linear decay halfway from 1.0; the checkpoint's wd ramp at its end (not ours, not a step late)
    assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]) == (0.5625, 0.625)


def test_override_keeps_the_scheduler_s_values_and_restores_the_step() -> None:
    optimizer = sgd()
    sched = scheduler(
        optimizer, max_lr=0.5, min_lr=0.0, override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False
    )
    sched.load_state_dict(saved(8))
    assert (sched.num_steps, sched.max_lr, sched.min_lr) == (8, 0.5, 0.0)
    assert optimizer.param_groups[0]["lr"] == 0.25  # 0.5 * (1 - 4/8)


def test_load_restores_the_step_count_rather_than_adding_to_it() -> None:
    sched = scheduler()
    sched.step(5)
    sched.load_state_dict(saved(8))
    assert sched.num_steps == 8


def test_megatron_legacy_keys_load_and_wd_keys_are_optional() -> None:
    optimizer = sgd()
    sched = scheduler(optimizer, max_lr=0.5, lr_decay_steps=20)
    legacy = {"start_lr": 1.0, "min_lr": 0.125, "warmup_iter": 4, "end_iter": 12, "decay_style": "linear", "num_iters": 8}
    sched.load_state_dict(legacy)
    assert (sched.max_lr, sched.lr_decay_steps, sched.num_steps, sched.start_wd) == (1.0, 12, 8, 0.25)
    assert optimizer.param_groups[0]["lr"] == 0.5625
    sched.load_state_dict({"max_lr": 1.0, "min_lr": 0.125, "warmup_steps": 2, "decay_steps": 10, "lr_decay_style": "linear", "num_steps": 6})
    assert (sched.lr_warmup_steps, sched.lr_decay_steps) == (2, 10)
    assert optimizer.param_groups[0]["lr"] == 0.5625  # halfway through 2 -> 10


def test_a_missing_key_is_a_key_error() -> None:
    state = saved()
    del state["lr_decay_steps"]
    expected = f"`state_dict`: missing scheduler key 'lr_decay_steps'; got keys {sorted(state)}; expected one of ['end_iter', 'decay_steps', 'lr_decay_steps'] (from OptimizerParamScheduler.state_dict())"
    with pytest.raises(KeyError, match=re.escape(expected)):
        scheduler().load_state_dict(state)


def test_invalid_values_taken_from_a_checkpoint_are_a_value_error() -> None:
    state = {**saved(), "lr_warmup_steps": 12}
    with pytest.raises(ValueError, match=r"^`OptimizerParamScheduler.lr_warmup_steps`: must lie in \[0, lr_decay_steps\)"):
        scheduler().load_state_dict(state)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"min_lr": -0.5}, "`OptimizerParamScheduler.min_lr`: must be >= 0; got -0.5; expected a float >= 0"),
    ({"max_lr": 0.1}, "`OptimizerParamScheduler.max_lr`: must be >= min_lr; got max_lr=0.1, min_lr=0.125; expected max_lr >= min_lr"),
    ({"init_lr": 2.0}, "`OptimizerParamScheduler.init_lr`: must lie in [0, max_lr]; got init_lr=2.0, max_lr=1.0; expected 0 <= init_lr <= max_lr"),
    ({"lr_decay_steps": 0, "lr_warmup_steps": 0}, "`OptimizerParamScheduler.lr_decay_steps`: must be > 0; got 0; expected an int > 0"),
    ({"lr_warmup_steps": 12}, "`OptimizerParamScheduler.lr_warmup_steps`: must lie in [0, lr_decay_steps); got lr_warmup_steps=12, lr_decay_steps=12; expected 0 <= lr_warmup_steps < lr_decay_steps"),
    ({"lr_decay_style": "exponential"}, "`OptimizerParamScheduler.lr_decay_style`: unknown decay style; got 'exponential'; expected one of ['constant', 'linear', 'cosine', 'inverse-square-root', 'WSD']"),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_style": "linear"}, "`OptimizerParamScheduler.wsd_decay_steps`: must be an int >= 0 with lr_decay_style='WSD'; got None; expected an int >= 0"),
    ({**WSD, "lr_wsd_decay_style": None}, "`OptimizerParamScheduler.lr_wsd_decay_style`: unknown WSD decay style (required with lr_decay_style='WSD'); got None; expected one of ['exponential', 'linear', 'cosine', 'minus_sqrt']"),
    ({**WSD, "lr_wsd_decay_style": "sqrt"}, "`OptimizerParamScheduler.lr_wsd_decay_style`: unknown WSD decay style (required with lr_decay_style='WSD'); got 'sqrt'; expected one of ['exponential', 'linear', 'cosine', 'minus_sqrt']"),
    ({"start_wd": -0.1, "end_wd": 0.0, "wd_incr_style": "linear"}, "`OptimizerParamScheduler.start_wd`: must be >= 0; got -0.1; expected a float >= 0"),
    ({"start_wd": 0.5, "end_wd": 0.25, "wd_incr_style": "linear"}, "`OptimizerParamScheduler.end_wd`: must be >= start_wd; got start_wd=0.5, end_wd=0.25; expected end_wd >= start_wd"),
    ({"wd_incr_style": "step"}, "`OptimizerParamScheduler.wd_incr_style`: unknown weight-decay increment style; got 'step'; expected one of ['constant', 'linear', 'cosine']"),
    ({"wd_incr_style": "linear", "wd_incr_steps": 0}, "`OptimizerParamScheduler.wd_incr_steps`: must be > 0 with wd_incr_style='linear'; got 0; expected an int > 0"),
    ({"wd_incr_steps": -1}, "`OptimizerParamScheduler.wd_incr_steps`: must be >= 0 with wd_incr_style='constant'; got -1; expected an int >= 0"),
    ({"override_opt_param_scheduler": True}, "`OptimizerParamScheduler.override_opt_param_scheduler`: cannot be combined with use_checkpoint_opt_param_scheduler; got both True; expected at most one of them True (use_checkpoint_opt_param_scheduler defaults to True)"),
    ({"end_wd": 0.5}, "`OptimizerParamScheduler.wd_incr_style`: 'constant' needs start_wd == end_wd; got start_wd=0.25, end_wd=0.5 (param group); expected equal values, or wd_incr_style 'linear' or 'cosine'"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "message"), BAD, ids=[m.split("`")[1] for _, m in BAD])
def test_bad_arguments_raise_with_the_exact_message(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        scheduler(**changes)


def test_a_constant_wd_group_whose_range_differs_names_the_group() -> None:
    config = OptimizerConfig(lr=1.0)
    optimizer = get_optimizer(config, tiny_gpt(), {ParamKey(name="output_layer.weight"): {"end_wd": 0.5}})
    with pytest.raises(ValueError, match=re.escape("start_wd=0.01, end_wd=0.5 (param group (output_layer.weight, ...))")):
        scheduler(optimizer, start_wd=0.01, end_wd=0.01)


def test_a_negative_increment_is_a_value_error() -> None:
    message = "`OptimizerParamScheduler.step`: increment must be a whole number of steps >= 0; got -1 (int); expected an int >= 0"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        scheduler().step(-1)


def test_wsd_settings_are_ignored_by_other_styles_as_in_megatron() -> None:
    sched = scheduler(wsd_decay_steps=None, lr_wsd_decay_style="exponential")  # Megatron's CLI always passes them
    sched.step(8)
    assert sched.optimizer.param_groups[0]["lr"] == 0.5625


def test_groups_carry_start_wd_and_end_wd_only_where_an_override_sets_them() -> None:
    config = OptimizerConfig(lr=1.0, weight_decay=0.1)
    overrides = {
        **get_standard_config_overrides(config),
        ParamKey(name="*.linear_qkv.weight"): {"start_wd": 0.0, "end_wd": 0.5},
        ParamKey(name="*.linear_proj.weight"): {"end_wd": 0.5},
        ParamKey(name="*.linear_fc1.weight"): {"weight_decay": 0.25},
        ParamKey(name="*.linear_fc2.weight"): {"weight_decay": 0.25, "end_wd": 0.5},
    }
    optimizer = get_optimizer(config, tiny_gpt(), overrides)
    ranges = {
        g["param_names"][0].split(".")[-2]: (g.get("start_wd", "-"), g.get("end_wd", "-"))
        for g in optimizer.param_groups
        if g["param_names"][0].startswith("decoder.layers.0.")
    }
    assert ranges == {
        "linear_qkv": (0.0, 0.5),
        "linear_proj": ("-", 0.5),
        "linear_fc1": (0.25, 0.25),  # the override's weight_decay stands for both
        "linear_fc2": (0.25, 0.5),
        "input_layernorm": ("-", "-"),  # the first 1-D param: the standard no-wd group
    }


def test_a_negative_start_wd_or_end_wd_override_is_a_value_error() -> None:
    for name in ("start_wd", "end_wd"):
        with pytest.raises(ValueError, match=rf"^`param group #1 \(rules #0 name='\*.bias'\)`: `{name}` must be a finite float >= 0; got -0.1; expected e.g. 0.0$"):
            get_optimizer(OptimizerConfig(lr=1.0, standard_overrides=False), tiny_gpt(), {ParamKey(name="*.bias"): {name: -0.1}})  # the rule alone


def test_the_scheduler_s_wd_ramp_reaches_groups_without_an_override_times_wd_mult() -> None:
    config = OptimizerConfig(lr=1.0, weight_decay=0.1)
    overrides = {**get_standard_config_overrides(config), ParamKey(name="output_layer.weight"): {"weight_decay": 0.25}}
    optimizer = get_optimizer(config, tiny_gpt(), overrides)
    assert not any("start_wd" in g or "end_wd" in g for g in optimizer.param_groups[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the scheduler's range is used
        sched = scheduler(optimizer, start_wd=0.0, end_wd=0.5, wd_incr_style="linear")
    # groups: default (wd_mult 1), no-wd 1-D params (wd_mult 0), output layer (its own 0.25)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.0, 0.25]
    sched.step(2)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.125, 0.0, 0.25]
    sched.step(6)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0, 0.25]


def test_step_defaults_to_one_and_get_last_lr_returns_each_group_s_lr() -> None:
    optimizer = sgd({}, {"max_lr": 2.0})
    sched = scheduler(optimizer)
    assert sched.get_last_lr() == [0.0, 0.0]
    sched.step()
    sched.step()
    assert sched.num_steps == 2
    assert sched.get_last_lr() == [0.5, 1.0] == [g["lr"] for g in optimizer.param_groups]
    sched.get_last_lr().append(9.0)  # a copy: the caller cannot change the scheduler's record
    optimizer.param_groups[0]["lr"] = 7.0  # as torch's: the values the scheduler set
    assert sched.get_last_lr() == [0.5, 1.0]
    sched.load_state_dict(saved(8))
    assert sched.get_last_lr() == [0.5625, 0.125 + 0.5 * 1.875]
