"""Every registered algorithm on every single-process path: 16-bit params with fp32 main params,
the inf/NaN skip, and an exact resume through checkpoint bytes.

Parametrized over ``registered_names()``, never a list, so an algorithm registered later is
covered as soon as it is registered. Two models: the built-in tiny GPT (matrices, QKV, norms,
embeddings) and a tiny Hugging Face Qwen3-MoE, whose experts are 3-D stacks. Gradients are set
from a seeded stream rather than computed, so two runs see the same gradients whatever their
params: the answer for a 16-bit run is then the fp32 run of the same algorithm on fp32 copies of
the main params (issue 26: "every path works or refuses by name").
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from optzoo.optimizers.registry import registered_names
from tests.conftest import tiny_gpt, tiny_qwen3_moe

NAMES = registered_names()
STEPS = 4
LOSS_SCALE = 2.0**8  # fp16: a power of two, so scaling and unscaling a gradient is exact


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_gpt()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt": _gpt, "qwen3_moe": tiny_qwen3_moe}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def test_the_moe_model_has_3d_expert_stacks() -> None:
    assert any(p.dim() == 3 for p in tiny_qwen3_moe().parameters())


def _config(name: str, precision: str = "fp32", **changes: Any) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer=name, lr=1e-3, weight_decay=0.1, bf16=precision == "bf16", fp16=precision == "fp16",
        initial_loss_scale=LOSS_SCALE, **changes,
    )  # fmt: skip


def _grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s gradients by name, float32, the same for every model built alike."""
    generator = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(p.shape, generator=generator) * 1e-2 for name, p in sorted(model.named_parameters())}


def _set_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor], scale: float = 1.0) -> None:
    for name, param in model.named_parameters():
        param.grad = (grads[name] * scale).to(param.dtype)


def _step(optimizer: torch.optim.Optimizer, step: int) -> Any:
    """``optimizer.step()`` from a global RNG seeded by ``step``: an algorithm that draws random
    numbers in its step (psgd_pro's damping noise) draws the same ones in every run compared."""
    torch.manual_seed(10_000 + step)
    return optimizer.step()


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, str, torch.Tensor]]:
    for group in optimizer.param_groups:
        for name, param in zip(group["param_names"], group["params"]):
            for key, value in optimizer.state[param].items():
                if torch.is_tensor(value):
                    yield name, key, value


def _snapshot(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
    """Model params, main params and every per-param state entry, copied (non-tensors as they are)."""
    snap: dict[str, Any] = {f"model {n}": p.detach().clone() for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for name, param in zip(group["param_names"], group["params"]):
            snap[f"main {name}"] = param.detach().clone()
            for key, value in optimizer.state[param].items():
                snap[f"state {name} {key}"] = value.clone() if torch.is_tensor(value) else value
    return snap


def _assert_bitwise(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        elif isinstance(value, (list, tuple)) and any(torch.is_tensor(v) for v in value):  # PSGD's factor lists
            assert len(got[key]) == len(value), key
            for index, (a, b) in enumerate(zip(got[key], value)):
                assert a.dtype == b.dtype and torch.equal(a, b), f"{key}[{index}]"
        else:
            assert got[key] == value, key


# ---- 16-bit params with fp32 main params --------------------------------------------------------


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_16_bit_params_step_as_fp32_on_fp32_copies_of_the_main_params(name: str, precision: str, model_name: str) -> None:
    """The main params equal, bit for bit, the fp32 algorithm stepped on fp32 copies of them
    with the same gradients: mixed precision changes what the algorithm is fed (16-bit grads,
    unscaled exactly by a power of two) and where the result is rounded to (the 16-bit model
    param, which must equal its main param rounded), never the arithmetic. State stays float32."""
    dtype = DTYPES[precision]
    model = MODELS[model_name]().to(dtype)
    reference = MODELS[model_name]()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    optimizer = get_optimizer(_config(name, precision), model)
    reference_optimizer = get_optimizer(_config(name), reference)
    scale = LOSS_SCALE if precision == "fp16" else 1.0
    for step in range(STEPS):
        grads = _grads(model, step)
        _set_grads(model, grads, scale)
        # what the wrapper's main grads hold: the 16-bit grad, unscaled (exact: scale is 2**8)
        _set_grads(reference, {n: (g * scale).to(dtype).float() / scale for n, g in grads.items()})
        assert _step(optimizer, step)[0] and _step(reference_optimizer, step)[0], step
    expected = dict(reference.named_parameters())
    for entry in optimizer.param_map.local:  # type: ignore[attr-defined]
        assert entry.main is not None and entry.main.dtype == torch.float32, entry.name
        assert torch.equal(entry.main, expected[entry.name]), entry.name
        assert torch.equal(entry.model, entry.main.to(dtype)), entry.name
    state = list(_state_tensors(optimizer))
    assert state
    for param_name, key, value in state:
        assert value.dtype == torch.float32, (param_name, key, value.dtype)


# ---- the inf/NaN skip -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_a_step_with_a_non_finite_grad_leaves_params_and_state_bitwise_unchanged(
    name: str, precision: str, model_name: str, bad: str
) -> None:
    """After a good step (so that state exists), one inf or NaN in one gradient skips the step
    with model params, main params and every state entry unchanged, bit for bit."""
    dtype = DTYPES[precision]
    model = MODELS[model_name]().to(dtype)
    optimizer = get_optimizer(_config(name, precision), model)
    scale = LOSS_SCALE if precision == "fp16" else 1.0
    _set_grads(model, _grads(model, 0), scale)
    assert _step(optimizer, 0)[0]
    before = _snapshot(optimizer, model)
    _set_grads(model, _grads(model, 1), scale)
    poisoned = max(model.parameters(), key=lambda p: p.dim())  # a matrix or expert stack
    poisoned.grad.view(-1)[-1] = float(bad)  # type: ignore[union-attr]
    assert _step(optimizer, 1) == (False, None, None)
    _assert_bitwise(_snapshot(optimizer, model), before)


# ---- exact resume through checkpoint bytes -----------------------------------------------------------


def _through_bytes(state: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only, torch's default: a checkpoint holds no pickled objects


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_resume_from_saved_bytes_equals_the_uninterrupted_run_bitwise(name: str, precision: str, model_name: str) -> None:
    """STEPS steps straight equal k steps, a save (name-keyed state through ``torch.save`` bytes),
    a fresh model and optimizer, a load, and STEPS - k steps: params and state, bit for bit."""
    dtype = DTYPES[precision]
    config = _config(name, precision)
    straight = MODELS[model_name]().to(dtype)
    straight_optimizer = get_optimizer(config, straight)
    for step in range(STEPS):
        _set_grads(straight, _grads(straight, step))
        assert _step(straight_optimizer, step)[0]

    interrupted = MODELS[model_name]().to(dtype)
    optimizer = get_optimizer(config, interrupted)
    for step in range(STEPS // 2):
        _set_grads(interrupted, _grads(interrupted, step))
        assert _step(optimizer, step)[0]
    checkpoint = _through_bytes({"model": interrupted.state_dict(), "optimizer": optimizer.state_dict()})
    assert all(isinstance(key, str) for key in checkpoint["optimizer"]["state"]), "state is keyed by param names"
    del interrupted, optimizer

    resumed = MODELS[model_name]().to(dtype)
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = get_optimizer(config, resumed)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    for step in range(STEPS // 2, STEPS):
        _set_grads(resumed, _grads(resumed, step))
        assert _step(resumed_optimizer, step)[0]
    _assert_bitwise(_snapshot(resumed_optimizer, resumed), _snapshot(straight_optimizer, straight))
