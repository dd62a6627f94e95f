"""Every registered algorithm on the distributed paths, 2 gloo ranks on CPU, against one process.

Parametrized over ``registered_names()`` (an algorithm registered later is covered as soon as it
is registered), but each mode is one spawned run that loops over every name inside the ranks (a
spawn costs seconds; one per name would not scale to the zoo). Each name's outcome comes back on
its own: its params (and consolidated state and a mid-run checkpoint), or the ValueError that
refused it, so one name's failure names that name.

Every rank sets the same seeded gradients (no backward), so the ranks agree bit for bit and one
process stepping the same gradients is an exact reference (issue 26: "every path works or
refuses by name": layer-wise and ZeRO-1, checkpoints across world sizes, FSDP2).
"""

from __future__ import annotations

import io
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from optzoo.distributed import preserve_param_attributes
from optzoo.optimizers.registry import get_spec, registered_names
from tests.conftest import tiny_gpt, tiny_qwen3_moe
from tests.distributed.harness import one_thread, run_ranks

pytestmark = pytest.mark.slow

NAMES = registered_names()

STEPS = 2  # the second step uses the state the first made (and, resumed, loaded)
SAVE_AFTER = 1  # the world-size-2 checkpoint is taken after this many steps
FUSED_ADAM_ROUNDING = {"rtol": 2.0**-21, "atol": 1e-12}
"""torch's fused CPU Adam kernel rounds ``exp_avg_sq`` of a tensor's vectorised body and of its
tail differently, and a ZeRO-1 element range or an FSDP2 shard moves where the tail starts
(docs/distributed.md says so): an 8-element norm weight stepped whole and as two 4-element
shards differs by up to 1 ulp in ``exp_avg_sq`` (measured 5.7e-14 on 7.8e-7 after 4 steps;
foreach agrees bitwise), and an expert model's ZeRO-1 head weight by 1.5e-8 (1 ulp). 8 ulps
(2**-21 relative) leave room for that to grow over the steps; 1e-12 covers values at 0."""
MODES = {"layer_wise": {"use_layer_wise_distributed_optimizer": True}, "sharded": {"use_distributed_optimizer": True}}


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_gpt()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt": _gpt, "qwen3_moe": tiny_qwen3_moe}


def _config(name: str, **flags: bool) -> OptimizerConfig:
    return OptimizerConfig(optimizer=name, lr=1e-3, weight_decay=0.1, **flags)


def _grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s gradients by name, the same on every rank and in the reference."""
    generator = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(p.shape, generator=generator) * 1e-2 for name, p in sorted(model.named_parameters())}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _whole(p) for name, p in model.named_parameters()}


def _state(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The per-param state tensors of a (consolidated) optimizer state dict, by ``name/key``."""
    return {f"{n}/{k}": _whole(v) for n, s in state_dict["state"].items() for k, v in s.items() if torch.is_tensor(v)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def _to_bytes(state: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data))  # weights_only, torch's default


def _refusal(error: ValueError) -> dict[str, Any]:
    return {"refused": f"{type(error).__name__}: {error}"}


def _crash_reported(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``, or the traceback of what it raised, so that the other names still run (an error
    raised on every rank alike leaves no collective waiting)."""
    try:
        return run()
    except ValueError:  # a refusal: the caller reports it
        raise
    except Exception:  # noqa: BLE001 - reported per name by the test
        return {"crashed": traceback.format_exc()}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range, save_after: int | None = None) -> dict[str, Any]:
    """Step ``optimizer`` through ``steps``, saving its state dict (a collective) after ``save_after``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out: dict[str, Any] = {}
    for step in steps:
        grads = _grads(model, step)
        for name, param in model.named_parameters():
            grad = grads[name]
            param.grad = distribute_tensor(grad, param.device_mesh, param.placements) if isinstance(param, DTensor) else grad
        torch.manual_seed(10_000 + step)  # an algorithm that draws random numbers draws the same ones everywhere
        ok, _, _ = optimizer.step()  # type: ignore[misc]
        assert ok, step
        if step + 1 == save_after:
            out["checkpoint"] = _to_bytes(optimizer.state_dict())
            out["params_at_checkpoint"] = _params(model)
    out["params"] = _params(model)
    out["state"] = _state(optimizer.state_dict())
    return out


def _single(model_name: str, name: str) -> dict[str, Any]:
    """The reference: one process, one thread (as each rank has), the same gradients."""
    with one_thread():
        model = MODELS[model_name]()
        return _train(model, get_optimizer(_config(name), model), range(STEPS), save_after=SAVE_AFTER)


# ---- layer-wise and ZeRO-1 ----------------------------------------------------------------------


def _layer_wise_and_sharded(rank: int, world_size: int) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Every (mode, model, name) on this rank: its params, state and mid-run checkpoint, or its refusal."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for mode, flags in MODES.items():
        for model_name, build in MODELS.items():
            for name in NAMES:
                model = build()
                config = _config(name, **flags)
                try:  # a refusal at construction or at the first step, with nothing changed
                    out[mode, model_name, name] = _crash_reported(
                        lambda: _train(model, get_optimizer(config, model), range(STEPS), save_after=SAVE_AFTER)
                    )
                except ValueError as error:
                    out[mode, model_name, name] = {**_refusal(error), "unchanged": _same(_params(model), _params(build()))}
    return out


@pytest.fixture(scope="module")
def distributed_runs() -> list[dict[tuple[str, str, str], dict[str, Any]]]:
    return run_ranks(2, _layer_wise_and_sharded, timeout=600.0)


@pytest.fixture(scope="module")
def single_runs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(model_name, name): _single(model_name, name) for model_name in MODELS for name in NAMES}


def _assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str, **tolerance: float) -> None:
    assert got.keys() == expected.keys(), where
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, f"{where}: `{key}` is {got[key].dtype}, expected {value.dtype}"
        if tolerance:
            torch.testing.assert_close(got[key], value, **tolerance, msg=lambda m, key=key: f"{where}: `{key}`: {m}")
        else:
            assert torch.equal(got[key], value), f"{where}: `{key}` differs"


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_on_2_ranks_equals_one_process(
    name: str, mode: str, model_name: str, distributed_runs: list[Any], single_runs: dict[tuple[str, str], Any]
) -> None:
    """Params and consolidated state after STEPS steps equal the one-process run, bit for bit, on
    both ranks: each param (or element range, for an element-wise algorithm under ZeRO-1) is
    stepped by one rank with the one-process arithmetic (the matrix algorithms step whole
    matrices, batched with the same shapes); ZeRO-1 to :data:`FUSED_ADAM_ROUNDING`. Or the mode refuses the name with a ValueError that
    names both, before any param changed."""
    expected = single_runs[model_name, name]
    for rank, runs in enumerate(distributed_runs):
        run = runs[mode, model_name, name]
        assert "crashed" not in run, f"{name} {mode} rank {rank}:\n{run.get('crashed')}"
        if "refused" in run:  # naming the algorithm and the flag that chose the mode
            (flag,) = MODES[mode]
            assert f"{name}" in run["refused"] and flag in run["refused"] and run["unchanged"], run["refused"]
            continue
        tolerance = FUSED_ADAM_ROUNDING if mode == "sharded" else {}
        _assert_equal(run["params"], expected["params"], f"{name} {mode} rank {rank} params", **tolerance)
        _assert_equal(run["state"], expected["state"], f"{name} {mode} rank {rank} state", **tolerance)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_saved_on_2_ranks_continues_on_1_as_the_uninterrupted_run(
    name: str, mode: str, model_name: str, distributed_runs: list[Any], single_runs: dict[tuple[str, str], Any]
) -> None:
    """The consolidated state dict saved after SAVE_AFTER steps on 2 ranks (through ``torch.save``
    bytes) loads into one process, which steps on to STEPS and ends where one process stepping
    all the way does: bit for bit, ZeRO-1 to :data:`FUSED_ADAM_ROUNDING`. (A mode that refuses a
    name, by name, leaves no checkpoint; with today's 19 names none does.)"""
    run = distributed_runs[0][mode, model_name, name]
    assert "crashed" not in run, f"{name} {mode}:\n{run['crashed']}"
    if "refused" in run:  # a mode that refuses the name by name saves no checkpoint to continue from
        (flag,) = MODES[mode]
        assert name in run["refused"] and flag in run["refused"] and "checkpoint" not in run, run["refused"]
        return
    with one_thread():
        model = MODELS[model_name]()
        # the params after SAVE_AFTER steps: one process's (equal to the ranks', the test above)
        model.load_state_dict(single_runs[model_name, name]["params_at_checkpoint"])
        optimizer = get_optimizer(_config(name), model)
        optimizer.load_state_dict(_from_bytes(run["checkpoint"]))
        resumed = _train(model, optimizer, range(SAVE_AFTER, STEPS))
    expected = single_runs[model_name, name]
    tolerance = FUSED_ADAM_ROUNDING if mode == "sharded" else {}  # its saved moments may differ by that
    _assert_equal(resumed["params"], expected["params"], f"{name} {mode} 2 -> 1 params", **tolerance)
    _assert_equal(resumed["state"], expected["state"], f"{name} {mode} 2 -> 1 state", **tolerance)


# ---- FSDP2 --------------------------------------------------------------------------------------


def _fully_shard(model: torch.nn.Module, mesh: Any) -> None:
    """``fully_shard`` each decoder layer, then the root, keeping the params' routing attributes."""
    from torch.distributed.fsdp import fully_shard

    layers = model.decoder.layers if hasattr(model, "decoder") else model.model.layers
    with preserve_param_attributes(model):
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)


def _fsdp2(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Every (model, name) on FSDP2 params (Shard(0) DTensors): its params and state, or its refusal."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for model_name, build in MODELS.items():
        for name in NAMES:
            model = build()
            _fully_shard(model, mesh)
            try:  # a refusal at construction or at the first step, with nothing changed
                out[model_name, name] = _crash_reported(lambda: _train(model, get_optimizer(_config(name), model), range(STEPS)))
            except ValueError as error:
                out[model_name, name] = {**_refusal(error), "unchanged": _same(_params(model), _params(build()))}
    return out



@pytest.fixture(scope="module")
def fsdp2_runs() -> list[dict[tuple[str, str], dict[str, Any]]]:
    return run_ranks(2, _fsdp2, timeout=600.0)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_equals_one_process_or_refuses_by_name_with_params_unchanged(
    name: str, model_name: str, fsdp2_runs: list[Any], single_runs: dict[tuple[str, str], Any]
) -> None:
    """On FSDP2 shards an algorithm steps as on whole params, to the rounding of torch's fused
    kernels (:data:`FUSED_ADAM_ROUNDING`; element-wise ones per element, the Muon family gathering each
    matrix to the rank that orthogonalises it), or it
    refuses by name, saying it needs whole matrices, before any param changed."""
    expected = single_runs[model_name, name]
    outcomes = {run[model_name, name].get("refused") for run in fsdp2_runs}
    assert len(outcomes) == 1, f"{name}: ranks disagree: {outcomes}"
    for rank, runs in enumerate(fsdp2_runs):
        run = runs[model_name, name]
        assert "crashed" not in run, f"{name} FSDP2 rank {rank}:\n{run.get('crashed')}"
        if "refused" in run:
            assert run["refused"].startswith("ValueError: `") and name in run["refused"], run["refused"]
            assert "DTensor" in run["refused"] and run["unchanged"], run["refused"]
            assert not get_spec(name).elementwise, f"{name} is element-wise: it has no reason to refuse shards"
            assert get_spec(name).whole_params, f"{name} refused shards, but its record says it steps them"
            continue
        assert not get_spec(name).whole_params, f"{name} stepped shards, but its record says it needs whole params"
        _assert_equal(run["params"], expected["params"], f"{name} FSDP2 rank {rank} params", **FUSED_ADAM_ROUNDING)
        _assert_equal(run["state"], expected["state"], f"{name} FSDP2 rank {rank} state", **FUSED_ADAM_ROUNDING)
