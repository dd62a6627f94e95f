"""Issue #24, "Nothing lost under faults": the step under faults that used to lose or corrupt state.

Each section names its item. Expectations come from torch.optim (the same update on a model that
never saw the fault), from the same step taken outside the fault's context, or from exact error
messages; "nothing changes" is checked bit for bit on params and state.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from optzoo import OptimizerConfig, get_optimizer
from optzoo.optimizers.registry import registered_names


class Two(nn.Module):
    """Two non-square layers with biases: matrices for Muon/SOAP, vectors for their fallback."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 4)
        self.to(dtype)


def _grads(model: nn.Module, seed: int, *, only: tuple[str, ...] | None = None, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Seeded gradients for every param (or those named in ``only``; the rest get none)."""
    generator = torch.Generator().manual_seed(seed)
    grads = {}
    for name, param in model.named_parameters():
        grad = torch.randn(param.shape, generator=generator) * scale
        if only is None or name in only:
            grads[name] = grad.to(param.dtype)
    return grads


def _set(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        param.grad = grads[name].clone() if name in grads else None


def _state(optimizer: Any) -> dict[str, Any]:
    return copy.deepcopy(optimizer.state_dict())


def _same(a: Any, b: Any) -> bool:
    """Nested structures equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ---- 1. a skipped first step on the device ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "reference"),
    [
        ({"optimizer": "sgd", "sgd_momentum": 0.9}, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True)),
        ({"optimizer": "adam"}, lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01, fused=True)),
        ({"optimizer": "adam", "decoupled_weight_decay": False}, lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.01, fused=True)),
        (
            {"optimizer": "adam", "use_precision_aware_optimizer": True, "store_param_remainders": False},
            lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01, fused=True),
        ),
    ],
    ids=["sgd-momentum", "adamw", "adam", "precision-aware-adamw"],
)
def test_item1_a_skipped_first_device_step_leaves_state_the_next_step_can_use(fields: dict[str, Any], reference: Any) -> None:
    """The next clean steps equal torch's fused optimizer that never saw the NaN step, bit for bit
    (before: SGD's uninitialised momentum buffers were applied, giving ~1e31 weights)."""
    model, twin = Two(), Two()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.01, clip_grad=0.0, standard_overrides=False, **fields), model, {}, lint=False)  # {} alone: wd on biases too
    torch_optimizer = reference(list(twin.parameters()))
    poisoned = _grads(model, 1)
    poisoned["a.weight"][0, 0] = float("nan")
    _set(model, poisoned)
    success, _, _ = optimizer.step_on_device()  # type: ignore[attr-defined]
    assert not bool(success)
    for seed in (2, 3):
        _set(model, _grads(model, seed))
        _set(twin, _grads(twin, seed))
        assert bool(optimizer.step_on_device()[0])  # type: ignore[attr-defined]
        torch_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


# ---- 3. a step inside the caller's autocast region -------------------------------------------


def _step_once(optimizer_name: str, autocast: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = Two()
    config = OptimizerConfig(optimizer=optimizer_name, lr=0.01, sgd_momentum=0.9)
    optimizer = get_optimizer(config, model, lint=False)
    for seed in (1, 2):
        _set(model, _grads(model, seed))
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert optimizer.step()[0] is True
        else:
            assert optimizer.step()[0] is True
    return _params(model), _state(optimizer)


@pytest.mark.parametrize("optimizer_name", registered_names())
def test_item3_a_step_inside_autocast_is_the_step_outside_bit_for_bit(optimizer_name: str) -> None:
    """Before: Muon 8.6e-4 off, AdaptiveMuon 1.43 off, SOAP raised inside emerging-optimizers."""
    inside, inside_state = _step_once(optimizer_name, autocast=True)
    outside, outside_state = _step_once(optimizer_name, autocast=False)
    assert _same(inside, outside)
    assert _same(inside_state, outside_state)


@pytest.mark.parametrize("optimizer_name", ["muon", "adaptive_muon", "soap", "lion", "rekls", "psgd_pro", "oblique_sgd", "oblique_adam"])
def test_item3_the_algorithm_classes_alone_step_as_outside_autocast(optimizer_name: str) -> None:
    """The optimizers/ classes keep the rule on their own (used without the wrapper)."""
    from optzoo.optimizers import _emerging
    from optzoo.optimizers.adaptive_muon import AdaptiveMuon
    from optzoo.optimizers.muon import Muon

    build = {
        "muon": lambda ps: Muon(ps, lr=0.01),
        "adaptive_muon": lambda ps: AdaptiveMuon(ps, lr=0.01),
        "soap": lambda ps: _emerging.soap([{"params": ps, "lr": 0.01, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8, "shampoo_beta": 0.95}], use_kl_shampoo=False),
        "lion": lambda ps: _emerging.lion([{"params": ps, "lr": 0.01, "weight_decay": 0.0}]),
        "rekls": lambda ps: _emerging.rekls([{"params": ps, "lr": 0.01, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8, "shampoo_beta": 0.95}]),
        "psgd_pro": lambda ps: _emerging.psgd_pro(
            [{"params": ps, "lr": 0.01, "weight_decay": 0.0}], precond_init_scale=1.0, damping_noise_scale=0.1, warmup_steps=10, max_update_rms=0.0
        ),
        "oblique_sgd": lambda ps: _emerging.oblique_sgd([{"params": ps, "lr": 0.01, "weight_decay": 0.0}]),
        "oblique_adam": lambda ps: _emerging.oblique_adam([{"params": ps, "lr": 0.01, "weight_decay": 0.0}]),
    }[optimizer_name]
    results = []
    for autocast in (True, False):
        torch.manual_seed(0)
        weight = nn.Parameter(torch.randn(6, 8))
        optimizer = build([weight])
        weight.grad = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                optimizer.step()
        else:
            optimizer.step()
        results.append(weight.detach().clone())
    assert torch.equal(results[0], results[1])


def test_item3_the_closure_still_runs_under_the_callers_autocast() -> None:
    """Only the update leaves autocast: the closure is the caller's forward, as in torch."""
    model = Two()
    optimizer = get_optimizer(OptimizerConfig(optimizer="soap", lr=0.01), model, lint=False)
    seen = []

    def closure() -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        loss = model.b(model.a(torch.randn(3, 8))).float().square().mean()
        loss.backward()
        return loss

    with torch.autocast("cpu", dtype=torch.bfloat16):
        optimizer.step(closure)
    assert seen == [True]


# ---- 5. SOAP with huge finite gradients and no clipping --------------------------------------


@pytest.mark.parametrize("warm_up_steps", [0, 1])
def test_item5_soap_with_huge_finite_grads_skips_with_nothing_changed_and_steps_on_after(warm_up_steps: int) -> None:
    """Gradients of 1e16 (norm ~1e17, finite in float32) overflow SOAP's Kronecker factors G·Gᵀ in
    its eigendecompositions. Before: a first step raised LinAlgError after creating state; a later
    one reported success with NaN weights. Now the step is skipped with params and state as they
    were, and the next clean step equals a twin's that never saw the huge one."""
    config = OptimizerConfig(optimizer="soap", lr=0.01, clip_grad=0.0)
    model, twin = Two(), Two()
    optimizer, twin_optimizer = get_optimizer(config, model, lint=False), get_optimizer(config, twin, lint=False)
    for seed in range(warm_up_steps):
        for m, o in ((model, optimizer), (twin, twin_optimizer)):
            _set(m, _grads(m, 10 + seed))
            assert o.step()[0] is True
    before, before_state = _params(model), _state(optimizer)
    huge = _grads(model, 20, scale=1e16)
    _set(model, huge)
    success, norm, _ = optimizer.step()
    assert success is False and norm is None  # clip_grad=0: no norm asked for
    assert _same(_params(model), before)
    assert _same({name: p.grad for name, p in model.named_parameters()}, huge)
    assert _same(_state(optimizer), before_state)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        _set(m, _grads(m, 30))
        assert o.step()[0] is True
    assert _same(_params(model), _params(twin))
    assert _same(_state(optimizer), _state(twin_optimizer))


def test_item5_a_skipped_soap_step_is_reported_with_its_norm_like_the_threshold() -> None:
    model = Two()
    optimizer = get_optimizer(OptimizerConfig(optimizer="soap", lr=0.01, clip_grad=1e30), model, lint=False)
    _set(model, _grads(model, 20, scale=1e16))
    success, norm, _ = optimizer.step()
    assert success is False and norm is not None and 1e16 < norm < 1e18


# ---- 7. a param whose first gradient arrives late ---------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_item7_fused_sgd_steps_a_late_param_as_torch_sgd_that_saw_only_its_grads(precision: str) -> None:
    """Before: TypeError from torch's fused SGD (a momentum buffer list mixing tensors and None)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = Two(dtype)
    reference_weights = {name: p.detach().float().clone().requires_grad_() for name, p in model.named_parameters()}
    optimizer = get_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.5, weight_decay=0.25, clip_grad=0.0, bf16=precision == "bf16", standard_overrides=False),
        model, {}, lint=False,
    )
    reference = torch.optim.SGD(list(reference_weights.values()), lr=0.5, momentum=0.5, weight_decay=0.25, foreach=False)
    schedule = [("a.weight", "a.bias"), None, None]  # b.* get their first gradient at step 2
    for seed, only in enumerate(schedule):
        grads = _grads(model, seed, only=only)
        _set(model, grads)
        for name, weight in reference_weights.items():
            weight.grad = grads[name].float() if name in grads else None
        assert optimizer.step()[0] is True
        reference.step()
    for name, p in model.named_parameters():
        main = optimizer.param_map.entry(name).main  # type: ignore[attr-defined]
        # fp32 arithmetic on the same fp32 values: torch's fused and for-loop kernels agree to 1 ulp
        torch.testing.assert_close(main, reference_weights[name].detach(), atol=0, rtol=2**-23, msg=name)


@pytest.mark.parametrize("optimizer_name", registered_names())
def test_item7_every_optimizer_steps_a_late_param_as_if_its_first_gradient_were_its_first_step(optimizer_name: str) -> None:
    """The late layer ends where a twin ends whose only gradients were the late layer's own."""
    config = OptimizerConfig(optimizer=optimizer_name, lr=0.01, sgd_momentum=0.9, clip_grad=0.0)  # no global norm: the twin's differs
    model, twin = Two(), Two()
    optimizer, twin_optimizer = get_optimizer(config, model, lint=False), get_optimizer(config, twin, lint=False)
    late = ("b.weight", "b.bias")
    _set(model, _grads(model, 0, only=("a.weight", "a.bias")))
    assert optimizer.step()[0] is True
    for seed in (1, 2):
        _set(model, _grads(model, seed))
        _set(twin, _grads(twin, seed, only=late))
        assert optimizer.step()[0] is True
        assert twin_optimizer.step()[0] is True
    for name in late:
        assert torch.equal(dict(model.named_parameters())[name], dict(twin.named_parameters())[name]), name
        assert _same(_state(optimizer)["state"][name], _state(twin_optimizer)["state"][name]), name


@pytest.mark.parametrize("on_device", [False, True])
def test_item7_sgd_with_dampening_and_a_late_param_is_refused_before_anything_changes(on_device: bool) -> None:
    """torch's first-step buffer (the gradient) is not a zero buffer's ((1 - dampening) * grad):
    refused by name, with params, gradients, state and the loss scale as they were."""
    model = Two(torch.bfloat16)
    config = OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.9, bf16=True, loss_scale=8.0, clip_grad=0.0)
    optimizer = get_optimizer(config, model, lint=False)
    for group in optimizer.param_groups:
        group["dampening"] = 0.5  # not an OptimizerConfig field: set on the groups by hand
    if not on_device:
        _set(model, _grads(model, 0, only=("a.weight", "a.bias")))
        assert optimizer.step()[0] is True
    grads = _grads(model, 1)
    _set(model, grads)
    before, before_state, scale = _params(model), _state(optimizer), optimizer.get_loss_scale().clone()
    where = "the step runs on the device" if on_device else "other params of its group have one"
    first = "a.weight" if on_device else "b.weight"
    with pytest.raises(ValueError, match=rf"^`{first}`: SGD with dampening has no momentum buffer yet while {where}; got dampening=0.5; expected dampening=0"):
        optimizer.step_on_device() if on_device else optimizer.step()  # type: ignore[attr-defined]
    assert _same(_params(model), before) and _same(_state(optimizer), before_state)
    assert _same({name: p.grad for name, p in model.named_parameters()}, grads)
    assert torch.equal(optimizer.get_loss_scale(), scale)


# ---- 8. a model cast or moved after get_optimizer ----------------------------------------------


@pytest.mark.parametrize(
    ("change", "got"),
    [
        (lambda m: m.to(torch.bfloat16), "torch.bfloat16 on cpu, shape \\(6, 8\\)"),
        (lambda m: m.double(), "torch.float64 on cpu, shape \\(6, 8\\)"),
        (lambda m: m.half(), "torch.float16 on cpu, shape \\(6, 8\\)"),
        (lambda m: setattr(m.a.weight, "data", m.a.weight.data.double()), "torch.float64 on cpu, shape \\(6, 8\\)"),
        (lambda m: setattr(m.a.weight, "data", torch.zeros(3, 8)), "torch.float32 on cpu, shape \\(3, 8\\)"),
    ],
    ids=["to-bf16", "double", "half", "data-float64", "data-other-shape"],
)
@pytest.mark.parametrize("optimizer_name", ["adam", "sgd", "muon"])
def test_item8_a_model_cast_after_get_optimizer_is_refused_by_name_before_anything_changes(optimizer_name: str, change: Any, got: str) -> None:
    model = Two()
    optimizer = get_optimizer(OptimizerConfig(optimizer=optimizer_name, lr=0.1, sgd_momentum=0.9), model, lint=False)
    _set(model, _grads(model, 0))
    assert optimizer.step()[0] is True
    change(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before, before_state = _params(model), _state(optimizer)
    with pytest.raises(
        ValueError,
        match=rf"^`a.weight`: the model param changed after get_optimizer( \(and \d+ more params\))?; got {got}; "
        r"expected torch.float32 on cpu, shape \(6, 8\), as the optimizer was built for: cast or move the model before get_optimizer",
    ):
        optimizer.step()
    assert _same(_params(model), before) and _same(_state(optimizer), before_state)


def test_item8_a_bf16_model_cast_to_fp32_after_get_optimizer_is_refused_too() -> None:
    model = Two(torch.bfloat16)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, bf16=True), model, lint=False)
    model.float()
    _set(model, _grads(model, 0))
    with pytest.raises(ValueError, match=r"^`a.weight`: the model param changed after get_optimizer \(and 3 more params\); got torch.float32 on cpu"):
        optimizer.step()


# ---- 17. zero_grad(set_to_none=False) in every precision ----------------------------------------


def _after_zero_grad_false(dtype: torch.dtype, fields: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Two SGD steps with a zero_grad(set_to_none=False) between; returns the fp32 main params.
    Params and grads are dyadic (k/8 and 1): every fp32 operation is exact."""
    model = Two()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((p * 8).round() / 8)
    model.to(dtype)
    config = OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.5, weight_decay=0.5, clip_grad=0.0, **fields)
    optimizer = get_optimizer(config.replace(standard_overrides=False), model, {}, lint=False)  # {}: weight decay on biases too, as the reference
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert optimizer.step()[0] is True
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # torch: zeros, not None
    assert optimizer.step()[0] is True
    return {name: optimizer.param_map.entry(name).main.detach().clone() for name, _ in model.named_parameters()}  # type: ignore[attr-defined]


def test_item17_a_zero_gradient_after_zero_grad_set_to_none_false_is_stepped_in_every_precision() -> None:
    """torch's rule: a zero gradient is a gradient (weight decay and momentum apply). Before: fp32
    stepped it, bf16/fp16 did not (their model grads had been released, so zero_grad found None)."""
    twin = Two()
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_((p * 8).round() / 8)
    reference = torch.optim.SGD(twin.parameters(), lr=0.5, momentum=0.5, weight_decay=0.5, foreach=False)
    for p in twin.parameters():
        p.grad = torch.ones_like(p)
    reference.step()
    reference.zero_grad(set_to_none=False)
    reference.step()
    expected = _params(twin)
    for dtype, fields in (
        (torch.float32, {}), (torch.bfloat16, {"bf16": True}), (torch.float16, {"fp16": True, "loss_scale": 1.0}),
    ):  # fmt: skip
        got = _after_zero_grad_false(dtype, fields)
        for name in expected:
            assert torch.equal(got[name], expected[name]), (dtype, name)


# ---- old open checks: timers, float64 main_grad ------------------------------------------------


class _NoBarrier:
    def start(self) -> None: ...

    def stop(self) -> None: ...


class _StopTakesArgument:
    def start(self, barrier: bool = False) -> None: ...

    def stop(self, what: str) -> None: ...


@pytest.mark.parametrize(
    ("timers", "problem"),
    [
        (lambda name, log_level: _NoBarrier(), r"its timer's start\(barrier=...\) fails: got an unexpected keyword argument 'barrier'"),
        (lambda name, log_level: _StopTakesArgument(), r"its timer's stop\(\) fails: missing a required argument: 'what'"),
        (lambda name, log_level: object(), r"its timer object has no start\(\)"),
        (lambda: None, r"calling it failed with TypeError: "),
    ],
    ids=["start-without-barrier", "stop-with-argument", "no-start", "wrong-arity"],
)
def test_timers_that_would_fail_mid_step_are_refused_at_get_optimizer(timers: Any, problem: str) -> None:
    """Before: a timer whose stop() failed raised after the first stage had moved the gradients."""
    with pytest.raises(ValueError, match=r"^`OptimizerConfig.timers`: not Megatron-style timers; got <lambda> \(" + problem):
        get_optimizer(OptimizerConfig(lr=0.1, timers=timers), Two(), lint=False)


def test_megatron_style_timers_are_accepted_and_time_every_phase() -> None:
    names = []

    class Timer:
        def start(self, barrier: bool = False) -> None: ...

        def stop(self) -> None: ...

    def timers(name: str, log_level: int = 0) -> Timer:
        names.append(name)
        return Timer()

    model = Two()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, timers=timers), model, lint=False)
    _set(model, _grads(model, 0))
    assert optimizer.step()[0] is True
    assert "optimizer-inner-step" in names


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_main_grad_of_another_dtype_on_an_fp32_param_is_named_before_anything_changes(dtype: torch.dtype) -> None:
    """Before: torch's own grad-dtype check raised from deep inside the step."""
    model = Two()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), model, params_have_main_grad=True, lint=False)
    for p in model.parameters():
        p.main_grad = torch.ones_like(p)  # type: ignore[attr-defined]
    model.b.weight.main_grad = torch.ones_like(model.b.weight, dtype=dtype)  # type: ignore[attr-defined]
    before, before_state = _params(model), _state(optimizer)
    with pytest.raises(
        ValueError,
        match=rf"^`b.weight`: main_grad dtype does not match the parameter it is stepped on; got a {dtype} main_grad "
        r"for a torch.float32 parameter; expected torch.float32",
    ):
        optimizer.step()
    assert _same(_params(model), before) and _same(_state(optimizer), before_state)


def test_item8_a_model_moved_to_another_device_after_get_optimizer_is_refused_by_name() -> None:
    """``.to(device)`` on any machine: the meta device stands for the other device."""
    model = Two()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), model, lint=False)
    _set(model, _grads(model, 0))
    assert optimizer.step()[0] is True
    before_state = _state(optimizer)
    model.to("meta")
    with pytest.raises(ValueError, match=r"^`a.weight`: the model param was replaced by a new object after get_optimizer \(and 3 more params\) \(as \.to\(.meta.\), to_empty\(\) or assigning the attribute do\); got torch.float32 on meta, shape \(6, 8\); expected the param the optimizer was built for"):
        optimizer.step()
    assert _same(_state(optimizer), before_state)


def test_item8_a_param_replaced_by_assignment_after_get_optimizer_is_refused_by_name() -> None:
    """Before: the step stepped the old Parameter object, which the model no longer holds."""
    model = Two()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), model, lint=False)
    model.b.bias = nn.Parameter(torch.zeros(4))
    _set(model, _grads(model, 0))
    before = _params(model)
    with pytest.raises(ValueError, match=r"^`b.bias`: the model param was replaced by a new object after get_optimizer \(as .*got torch.float32 on cpu, shape \(4,\)"):
        optimizer.step()
    assert _same(_params(model), before) and not optimizer.state


@pytest.mark.parametrize("device_type", ["cuda", "xpu", "mps", "hpu", "privateuseone"])
def test_item3_autocast_is_off_during_the_step_for_every_device_type_and_back_after(device_type: str) -> None:
    """Device-agnostic: the flag of a device type this machine lacks is switched like the CPU's."""
    from optzoo.optimizers._checked import autocast_disabled

    torch.set_autocast_enabled(device_type, True)
    try:
        with autocast_disabled():
            inside = torch.is_autocast_enabled(device_type)
        assert inside is False and torch.is_autocast_enabled(device_type) is True
    finally:
        torch.set_autocast_enabled(device_type, False)
