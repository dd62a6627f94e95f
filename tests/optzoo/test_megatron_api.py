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

from optzoo import OptimizerConfig, ParamKey, get_megatron_optimizer, get_optimizer
from tests.conftest import twin as copy_model


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
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01), net, overrides)  # Megatron's meaning: these rules alone
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


# ---- helpers ---------------------------------------------------------------------------------

PRECISIONS = {
    "fp32": (torch.float32, {}),
    "bf16": (torch.bfloat16, {"bf16": True}),
    "fp16": (torch.float16, {"fp16": True, "initial_loss_scale": 2.0**10, "loss_scale_window": 2}),
}


def _tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _tensors(value, f"{prefix}.{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in _tensors(value, f"{prefix}[{i}]").items()}
    return {}


def _snapshot(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state dict (state, main params, scaler) and the model, copied."""
    tree = {"optimizer": optimizer.state_dict(), "model": model.state_dict()}
    return {k: v.detach().clone() for k, v in _tensors(tree).items()}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _set_grads(model: nn.Module, grads: list[torch.Tensor], scale: float) -> None:
    for param, grad in zip(model.parameters(), grads, strict=True):
        param.grad = (grad * scale).to(param.dtype)


def _line(dtype: torch.dtype = torch.float32) -> nn.Module:
    """``weight`` (1x2) and ``bias`` (1); gradients ``[[3, 4]]`` and ``[0]`` have norm 5 and one zero."""
    layer = nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.5, -0.25]]))
        layer.bias.fill_(0.125)
    return layer.to(dtype)


THREE_FOUR = [torch.tensor([[3.0, 4.0]]), torch.tensor([0.0])]


# ---- grad_norm_skip_threshold: the step ---------------------------------------------------------


def test_megatron_s_skipped_step_reports_the_norm_and_leaves_the_grads() -> None:
    """Megatron-Core's ``test_chained_optimizer_reports_unsuccessful_when_grad_norm_skipped``:
    clip_grad=0, threshold 1, a 2x2 gradient of ones (norm 2): ``(False, 2.0, None)``, the
    inner optimizer does not step and the gradient is left as it was."""
    model = nn.Linear(2, 2, bias=False)
    before = model.weight.detach().clone()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, clip_grad=0.0, grad_norm_skip_threshold=1.0), model, {}, lint=False)
    model.weight.grad = torch.ones_like(model.weight)
    assert optimizer.step() == (False, 2.0, None)
    assert torch.equal(model.weight, before) and optimizer.state_dict()["state"] == {}
    torch.testing.assert_close(model.weight.grad, torch.ones_like(model.weight), atol=0, rtol=0)


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("clip_grad", [0.0, 1.0])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_step_over_the_threshold_changes_nothing_bitwise(precision: str, clip_grad: float, fold: bool) -> None:
    dtype, fields = PRECISIONS[precision]
    model = _line(dtype)
    config = OptimizerConfig(lr=0.1, weight_decay=0.1, clip_grad=clip_grad, grad_norm_skip_threshold=4.5,
                             log_num_zeros_in_grad=True, fold_clip_and_scale=fold, **fields)  # type: ignore[arg-type]  # fmt: skip
    optimizer = get_optimizer(config, model, {}, lint=False)
    _set_grads(model, [g / 8 for g in THREE_FOUR], float(optimizer.get_loss_scale()))  # norm 5/8: steps
    assert optimizer.step() == (True, 0.625, 1)
    before = _snapshot(optimizer, model)
    _set_grads(model, THREE_FOUR, float(optimizer.get_loss_scale()))  # norm 5 > 4.5
    assert optimizer.step() == (False, 5.0, 1)
    after = _snapshot(optimizer, model)
    if precision == "fp16":  # the scaler saw no inf: two clean steps grow the scale (loss_scale_window=2)
        assert after.pop(".optimizer.grad_scaler.scale").item() == 2.0**11
        assert before.pop(".optimizer.grad_scaler.scale").item() == 2.0**10
    _assert_bitwise(before, after)


def test_a_norm_equal_to_the_threshold_steps_and_the_norm_is_reported_without_clipping() -> None:
    model = _line()
    config = OptimizerConfig(lr=0.1, weight_decay=0.0, clip_grad=0.0, grad_norm_skip_threshold=5.0)
    optimizer = get_optimizer(config, model, {}, lint=False)
    _set_grads(model, THREE_FOUR, 1.0)
    assert optimizer.step() == (True, 5.0, None)  # Megatron-Core skips only when norm > threshold
    # Adam's first step moves by lr * g / (|g| + eps): lr to float32 rounding (eps / |g| < 2**-24).
    torch.testing.assert_close(model.weight, torch.tensor([[0.5 - 0.1, -0.25 - 0.1]]), atol=2**-24, rtol=0)


@pytest.mark.parametrize("fields", [{}, {"fp16": True, "loss_scale": 1024.0}])
def test_step_on_device_skips_over_the_threshold_like_step(fields: dict[str, object]) -> None:
    dtype = torch.float16 if fields else torch.float32
    model = _line(dtype)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, clip_grad=0.0, grad_norm_skip_threshold=4.5, **fields), model, {}, lint=False)  # type: ignore[arg-type]
    _set_grads(model, [g / 8 for g in THREE_FOUR], float(optimizer.get_loss_scale()))  # norm 5/8: steps
    success, norm, _ = optimizer.step_on_device()  # type: ignore[attr-defined]
    assert bool(success) is True and norm is not None and float(norm) == 0.625
    before = _snapshot(optimizer, model)
    _set_grads(model, THREE_FOUR, float(optimizer.get_loss_scale()))
    success, norm, _ = optimizer.step_on_device()  # type: ignore[attr-defined]
    assert bool(success) is False and norm is not None and float(norm) == 5.0
    _assert_bitwise(before, _snapshot(optimizer, model))


# ---- step is prepare_grads + (clip, zeros) + step_with_ready_grads --------------------------------


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("clip_grad", [0.0, 0.3])
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("algorithm", ["adam", "lion"])  # lion: the factor applied in a foreach pass
def test_step_equals_megatron_s_halves_bitwise(precision: str, clip_grad: float, fold: bool, algorithm: str) -> None:
    """Megatron-Core's ``step`` is ``prepare_grads``; ``clip_grad_norm(clip_grad)``;
    ``count_zeros()``; ``step_with_ready_grads()``. A twin driven through those calls ends bit for
    bit where ``step()`` does: params, main params, optimizer and scaler state, reported values.
    fp16's scale grows every other step (loss_scale_window=2), and one step has an inf."""
    dtype, fields = PRECISIONS[precision]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3)).to(dtype)
    twin_model = copy_model(model)
    config = OptimizerConfig(optimizer=algorithm, lr=1e-2, weight_decay=0.1, clip_grad=clip_grad, log_num_zeros_in_grad=True,
                             fold_clip_and_scale=fold, **fields)  # type: ignore[arg-type]  # fmt: skip
    ours, halves = get_optimizer(config, model, lint=False), get_optimizer(config, twin_model, lint=False)
    generator = torch.Generator().manual_seed(3)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=generator) for p in model.parameters()]
        grads[1][0] = 0.0  # a zero to count
        if step == 2 and precision != "fp32":
            grads[0][0, 0] = float("inf")
        for m, opt in ((model, ours), (twin_model, halves)):
            _set_grads(m, grads, float(opt.get_loss_scale()))
        expected = ours.step()
        found_inf = halves.prepare_grads()
        if found_inf:
            got: tuple[bool, float | None, int | None] = (False, None, None)
        else:
            norm = halves.clip_grad_norm(clip_grad) if clip_grad > 0 else None
            zeros = halves.count_zeros()
            got = (halves.step_with_ready_grads(), norm, zeros)
        assert got == expected
        _assert_bitwise(_snapshot(ours, model), _snapshot(halves, twin_model))


def test_prepare_grads_then_step_with_ready_grads_is_step_without_clipping() -> None:
    model = _line(torch.float16)
    twin_model = copy_model(model)
    config = OptimizerConfig(lr=0.1, clip_grad=0.0, fp16=True, initial_loss_scale=2.0**10, loss_scale_window=1)
    ours, halves = get_optimizer(config, model, {}, lint=False), get_optimizer(config, twin_model, {}, lint=False)
    for m, opt in ((model, ours), (twin_model, halves)):
        _set_grads(m, THREE_FOUR, float(opt.get_loss_scale()))
    assert ours.step() == (True, None, None)
    assert halves.prepare_grads() is False and halves.step_with_ready_grads() is True
    _assert_bitwise(_snapshot(ours, model), _snapshot(halves, twin_model))


@pytest.mark.parametrize("fold", [True, False])
def test_the_step_a_dynamic_scaler_grows_unscales_by_the_scale_the_grads_carry(fold: bool) -> None:
    """SGD, lr 0.5, an unscaled gradient of 1 scaled by 1024: the param moves by exactly -0.5,
    also on the step after which the scale grows to 2048 (every step here: loss_scale_window=1)."""
    model = _line(torch.float16)
    config = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=0.5, weight_decay=0.0, clip_grad=0.0, fp16=True,
                             initial_loss_scale=1024.0, loss_scale_window=1, fold_clip_and_scale=fold)  # fmt: skip
    optimizer = get_optimizer(config, model, {}, lint=False)
    _set_grads(model, [torch.ones(1, 2), torch.ones(1)], 1024.0)
    assert optimizer.step() == (True, None, None) and optimizer.get_loss_scale().item() == 2048.0
    assert torch.equal(model.weight, torch.tensor([[0.0, -0.75]], dtype=torch.float16))
    assert torch.equal(model.bias, torch.tensor([-0.375], dtype=torch.float16))


# ---- get_grad_norm, clip_grad_norm, count_zeros -----------------------------------------------


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_norm_and_zeros_between_the_halves_are_those_of_the_unscaled_gradients(precision: str, fold: bool) -> None:
    dtype, fields = PRECISIONS[precision]
    model = _line(dtype)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, fold_clip_and_scale=fold, **fields), model, {}, lint=False)  # type: ignore[arg-type]
    _set_grads(model, THREE_FOUR, float(optimizer.get_loss_scale()))
    assert optimizer.prepare_grads() is False
    assert optimizer.get_grad_norm() == 5.0 and optimizer.count_zeros() == 1
    assert optimizer.clip_grad_norm(2.5) == 5.0  # the norm before clipping
    assert optimizer.get_grad_norm() == pytest.approx(2.5, rel=1e-6)  # after: 5 * 2.5 / (5 + 1e-6)
    assert optimizer.count_zeros() == 1
    assert optimizer.step_with_ready_grads() is True


def test_before_prepare_grads_the_methods_read_the_main_grads_as_they_are() -> None:
    model = _line()  # fp32: the main grads are the model's
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), model, {}, lint=False)
    assert optimizer.get_grad_norm() == 0.0 and optimizer.count_zeros() == 0
    _set_grads(model, [torch.tensor([[0.0, 0.0]]), torch.tensor([2.0])], 1.0)
    assert optimizer.get_grad_norm() == 2.0 and optimizer.count_zeros() == 2


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_clip_grad_norm_refuses_a_bad_max_norm(value: float) -> None:
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), _line(), {}, lint=False)
    with pytest.raises(ValueError, match=r"^`clip_grad_norm`: clip_grad must be a finite number >= 0; got .+; expected e.g. 1.0"):
        optimizer.clip_grad_norm(value)


# ---- scale_loss, get_loss_scale ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "dtype", "scale"),
    [({}, torch.float32, 1.0), ({"bf16": True}, torch.bfloat16, 1.0), ({"bf16": True, "loss_scale": 8.0}, torch.bfloat16, 8.0),
     ({"fp16": True}, torch.float16, 2.0**32)],
)  # fmt: skip
def test_scale_loss_is_megatron_s_loss_scale_times_loss(fields: dict[str, object], dtype: torch.dtype, scale: float) -> None:
    """Megatron-Core: ``get_loss_scale()`` is a 1-element float32 tensor (the scaler's scale, or
    1), and ``scale_loss(loss)`` is ``get_loss_scale() * loss``."""
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, **fields), _line(dtype), {}, lint=False)  # type: ignore[arg-type]
    loss_scale = optimizer.get_loss_scale()
    assert loss_scale.shape == (1,) and loss_scale.dtype == torch.float32 and loss_scale.item() == scale
    loss = torch.tensor(0.75)
    assert torch.equal(optimizer.scale_loss(loss), loss_scale * loss)


# ---- reload_model_params -------------------------------------------------------------------------


def test_reload_model_params_without_a_state_dict_copies_the_16_bit_params() -> None:
    model = _line(torch.bfloat16)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, bf16=True), model, {}, lint=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.5, 2.5]]))
    optimizer.reload_model_params()
    assert torch.equal(optimizer.state_dict()["main_params"]["weight"], torch.tensor([[1.5, 2.5]]))


FINE = {"weight": torch.tensor([[1.0 + 2**-12, -3.0]]), "bias": torch.tensor([0.1])}
"""fp32 values that bf16 rounds: 1 + 2**-12 -> 1, 0.1 -> 0.10009765625."""


@pytest.mark.parametrize(
    "layout",
    [
        FINE,
        {"model": FINE},
        {"model0": FINE},
        {"module.weight": FINE["weight"], "module.bias": FINE["bias"], "_extra_state": None},
        {"model": {"decoder.weight": FINE["weight"], "decoder.bias": FINE["bias"]}},
    ],
    ids=["flat", "model", "model0", "ddp-prefixed", "by-suffix"],
)
def test_reload_model_params_from_a_state_dict_sets_the_main_params_to_its_values(layout: dict[str, object]) -> None:
    """Megatron-Core's distributed optimizer: the state dict's tensors (matched by name) set the
    main params instead of the lower-precision model params; the model params are left alone."""
    model = _line(torch.bfloat16)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, bf16=True), model, {}, lint=False)
    model_before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer.reload_model_params(layout)
    mains = optimizer.state_dict()["main_params"]
    assert torch.equal(mains["weight"], FINE["weight"]) and torch.equal(mains["bias"], FINE["bias"])
    _assert_bitwise(model_before, dict(model.state_dict()))


def test_reload_model_params_with_chunks_matches_model0_model1() -> None:
    chunks = [_line(torch.bfloat16), _line(torch.bfloat16)]
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, bf16=True), chunks, {}, lint=False)
    second = {"weight": torch.tensor([[7.0, 8.0]]), "bias": torch.tensor([9.0])}
    optimizer.reload_model_params({"model0": FINE, "model1": second})
    mains = optimizer.state_dict()["main_params"]
    assert torch.equal(mains["chunk0.weight"], FINE["weight"]) and torch.equal(mains["chunk1.bias"], second["bias"])


def test_reload_model_params_from_a_state_dict_writes_fp32_params_which_are_their_own_mains() -> None:
    model = _line()
    optimizer = get_optimizer(OptimizerConfig(lr=0.1), model, {}, lint=False)
    optimizer.reload_model_params(FINE)
    assert torch.equal(model.weight, FINE["weight"]) and torch.equal(model.bias, FINE["bias"])


@pytest.mark.parametrize(
    ("state_dict", "message"),
    [
        ({"weight": FINE["weight"]}, r"the state_dict has no tensor for some params; got keys \[weight\]; expected one tensor of the param's shape for each of \[bias\]"),
        ({**FINE, "bias": torch.zeros(2)}, r"the state_dict has tensors of another shape; got keys \[bias, weight\]; expected .*\[bias: \(2,\) for \(1,\)\]"),
        ({"a.weight": FINE["weight"], "b.weight": FINE["weight"], "bias": FINE["bias"]}, r"the state_dict has several tensors for some params; .*\[weight \(a.weight, b.weight\)\]"),
        ([1, 2], r"state_dict must be a model state dict; got list"),
    ],
)
def test_reload_model_params_refuses_a_state_dict_that_does_not_fit_and_changes_nothing(state_dict: object, message: str) -> None:
    model = _line(torch.bfloat16)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, bf16=True), model, {}, lint=False)
    before = _snapshot(optimizer, model)
    with pytest.raises(ValueError, match=r"^`reload_model_params`: " + message):
        optimizer.reload_model_params(state_dict)  # type: ignore[arg-type]
    _assert_bitwise(before, _snapshot(optimizer, model))


def test_reload_model_params_with_a_state_dict_is_refused_under_the_precision_aware_optimizer() -> None:
    model = _line(torch.bfloat16)
    optimizer = get_optimizer(OptimizerConfig(lr=0.1, bf16=True, use_precision_aware_optimizer=True), model, {}, lint=False)
    with pytest.raises(ValueError, match=r"^`reload_model_params`: a state_dict is not supported under use_precision_aware_optimizer"):
        optimizer.reload_model_params(FINE)
    optimizer.reload_model_params()  # without one it works


# ---- chained_optimizers and optimizer ------------------------------------------------------------


def _two_algorithms() -> tuple[torch.optim.Optimizer, nn.Module]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    overrides = {ParamKey(name="1.*"): {"optimizer": "sgd"}}
    config = OptimizerConfig(lr=0.1, loss_scale=4.0, bf16=True, standard_overrides=False)  # two groups: these rules alone
    return get_optimizer(config, model.to(torch.bfloat16), overrides, lint=False), model


def test_chained_optimizers_show_each_inner_optimizer_as_megatron_code_reads_it() -> None:
    optimizer, _ = _two_algorithms()
    views = optimizer.chained_optimizers  # type: ignore[attr-defined]
    assert [type(v.optimizer).__name__ for v in views] == ["AdamW", "SGD"]
    assert [g["param_names"] for v in views for g in v.param_groups] == [g["param_names"] for g in optimizer.param_groups]
    assert all(v.config is optimizer.config and v.config.loss_scale == 4.0 for v in views)  # type: ignore[attr-defined]
    assert all(v.get_loss_scale() is optimizer.get_loss_scale() and v.grad_scaler is optimizer.grad_scaler for v in views)  # type: ignore[attr-defined]
    assert [len(v.get_parameters()) for v in views] == [2, 2] and not any(v.is_stub_optimizer for v in views)
    assert all(p.dtype == torch.float32 for v in views for p in v.get_parameters())  # the fp32 main params
    # Megatron-Core code probes for its own internals with hasattr: they are absent, not errors.
    assert not hasattr(views[0], "shard_fp32_from_float16_groups") and not hasattr(views[0], "model_chunks")
    with pytest.raises(AttributeError, match=r"^`chained_optimizers\[i\].step`: not on optzoo's read-only view; got a view of AdamW \(adam\)"):
        views[0].step()
    with pytest.raises(AttributeError):
        optimizer.chained_optimizers = []  # type: ignore[attr-defined, misc]
    with pytest.raises(AttributeError):
        views[0].optimizer = None


def test_megatron_s_checkpoint_loop_over_chained_optimizers_reaches_every_group() -> None:
    """Megatron-LM ``megatron/training/checkpointing.py`` zeroes the lr of every group this way
    before it builds a state dict for a converted checkpoint."""
    optimizer, _ = _two_algorithms()
    pending, zeroed = [optimizer], []
    while pending:
        pending_optimizer = pending.pop()
        if hasattr(pending_optimizer, "chained_optimizers"):
            pending.extend(pending_optimizer.chained_optimizers)
            continue
        inner_optimizer = getattr(pending_optimizer, "optimizer", None)
        if inner_optimizer is None:
            continue
        for param_group in inner_optimizer.param_groups:
            zeroed.append(param_group.get("lr"))
            param_group["lr"] = 0.0
    assert zeroed == [0.1, 0.1] and [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]


def test_optimizer_is_the_one_inner_optimizer_or_absent_when_there_are_several() -> None:
    single = get_optimizer(OptimizerConfig(lr=0.1), _line(), {}, lint=False)
    assert single.optimizer is single.chained_optimizers[0].optimizer  # type: ignore[attr-defined]
    assert single.optimizer.param_groups == single.param_groups  # type: ignore[attr-defined]
    several, _ = _two_algorithms()
    assert getattr(several, "optimizer", None) is None  # Megatron-Core asserts one; unwrapping code sees none
    with pytest.raises(AttributeError, match=r"^`optimizer`: this optimizer chains several inner optimizers; got 2 \(adam; sgd\); expected one, or chained_optimizers\[i\].optimizer$"):
        several.optimizer  # type: ignore[attr-defined]  # noqa: B018
