"""Grad scalers: Megatron-Core's update rule, state-dict keys and argument checks."""

from __future__ import annotations

import pytest
import torch

from optzoo import ConstantGradScaler, DynamicGradScaler, OptimizerConfig, make_grad_scaler


def _scaler(**changes: float) -> DynamicGradScaler:
    arguments: dict[str, float] = dict(
        initial_scale=8.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2
    )
    arguments.update(changes)
    return DynamicGradScaler(**arguments)  # type: ignore[arg-type]


def _run(scaler: DynamicGradScaler, events: str) -> list[float]:
    """Apply ``events`` ('i' = inf, '.' = clean) and return the scale after each."""
    scales = []
    for event in events:
        scaler.update(found_inf=event == "i")
        scales.append(scaler.scale.item())
    return scales


def test_three_infs_back_off_after_hysteresis_then_three_clean_steps_grow() -> None:
    scaler = _scaler()
    assert _run(scaler, "iii") == [8.0, 4.0, 2.0]
    assert _run(scaler, "...") == [2.0, 2.0, 4.0]


def test_hysteresis_counts_infs_since_the_last_growth_not_consecutive_ones() -> None:
    assert _run(_scaler(), "i.i") == [8.0, 8.0, 4.0]


def test_growth_resets_the_hysteresis_tracker() -> None:
    scaler = _scaler()
    _run(scaler, "i...")  # one inf, then growth to 16 resets the tracker to 2
    assert scaler.state_dict()["hysteresis_tracker"] == 2
    assert _run(scaler, "ii") == [16.0, 8.0]


def test_the_scale_never_drops_below_min_scale() -> None:
    assert _run(_scaler(initial_scale=4.0, min_scale=1.0), "iiiiii") == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0]


def test_state_dict_uses_megatron_keys_and_round_trips() -> None:
    scaler = _scaler()
    _run(scaler, "ii.")
    state = scaler.state_dict()
    assert set(state) == {"scale", "growth_tracker", "hysteresis_tracker"}
    assert (state["scale"].item(), state["growth_tracker"], state["hysteresis_tracker"]) == (4.0, 1, 0)
    fresh = _scaler()
    fresh.load_state_dict(state)
    assert _run(fresh, "..i") == _run(scaler, "..i")


def test_a_megatron_checkpoint_state_loads() -> None:
    # What Megatron-Core's DynamicGradScaler.state_dict() holds (its scale lives on CUDA there).
    megatron_state = {"scale": torch.tensor([65536.0]), "growth_tracker": 7, "hysteresis_tracker": 1}
    scaler = _scaler()
    scaler.load_state_dict(megatron_state)
    assert scaler.scale.item() == 65536.0 and scaler.scale.dtype == torch.float32
    assert _run(scaler, "i") == [32768.0]
    with pytest.raises(ValueError, match=r"`grad_scaler` state: missing keys \['growth_tracker', 'hysteresis_tracker'\]; got \['scale'\]; expected scale, growth_tracker and hysteresis_tracker"):
        scaler.load_state_dict({"scale": torch.tensor([1.0])})


def test_inv_scale_is_computed_in_float64_then_cast() -> None:
    scaler = ConstantGradScaler(3.0)
    assert scaler.inv_scale.dtype == torch.float32 and scaler.scale.shape == (1,)
    assert scaler.inv_scale.item() == torch.tensor(1.0 / 3.0, dtype=torch.float64).float().item()


def test_constant_scaler_never_changes_and_has_empty_state() -> None:
    scaler = ConstantGradScaler(1024.0)
    for found_inf in (True, False, True):
        scaler.update(found_inf)
    assert scaler.scale.item() == 1024.0 and scaler.state_dict() == {}


def test_the_scale_lives_on_the_requested_device() -> None:
    scaler = _scaler().to("meta")
    assert scaler.scale.device.type == "meta" and scaler.min_scale.device.type == "meta"
    on_cpu = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, 3, 2, device="cpu")
    on_cpu.load_state_dict({"scale": torch.tensor([2.0], dtype=torch.float64), "growth_tracker": 0, "hysteresis_tracker": 2})
    assert on_cpu.scale.device.type == "cpu"


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"initial_scale": 0.0}, r"`initial_scale`: must be positive; got 0.0"),
        ({"min_scale": -1.0}, r"`min_scale`: must be positive; got -1.0"),
        ({"min_scale": 16.0}, r"`min_scale`: must not exceed initial_scale=8.0; got 16.0"),
        ({"growth_factor": 1.0}, r"`growth_factor`: must be greater than 1; got 1.0"),
        ({"backoff_factor": 1.0}, r"`backoff_factor`: must lie in \(0, 1\); got 1.0"),
        ({"backoff_factor": 0.0}, r"`backoff_factor`: must lie in \(0, 1\); got 0.0"),
        ({"growth_interval": 0}, r"`growth_interval`: must be at least 1; got 0"),
        ({"hysteresis": 0}, r"`hysteresis`: must be at least 1; got 0"),
    ],
)
def test_invalid_arguments_name_the_argument(changes: dict[str, float], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _scaler(**changes)


def test_scaler_choice_follows_megatron() -> None:
    constant = make_grad_scaler(OptimizerConfig(lr=1.0, fp16=True, loss_scale=256.0))
    assert isinstance(constant, ConstantGradScaler) and constant.scale.item() == 256.0
    dynamic = make_grad_scaler(OptimizerConfig(lr=1.0, fp16=True, initial_loss_scale=2.0**16, min_loss_scale=4.0, loss_scale_window=50, hysteresis=3))
    assert isinstance(dynamic, DynamicGradScaler)
    assert (dynamic.scale.item(), dynamic.min_scale.item(), dynamic.growth_factor.item(), dynamic.backoff_factor.item()) == (65536.0, 4.0, 2.0, 0.5)
    assert (dynamic.growth_interval, dynamic.hysteresis) == (50, 3)
    assert isinstance(make_grad_scaler(OptimizerConfig(lr=1.0, bf16=True, loss_scale=8.0)), ConstantGradScaler)
    assert make_grad_scaler(OptimizerConfig(lr=1.0, bf16=True)) is None
    assert make_grad_scaler(OptimizerConfig(lr=1.0)) is None
