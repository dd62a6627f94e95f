"""torch's DCP state-dict API (``get_optimizer_state_dict``/``set_optimizer_state_dict``) on optzoo.

The answer comes from outside optzoo: torch's own API writes and reads the checkpoint, ``dcp.save``
and ``dcp.load`` reshard it, and the reference is the same training run left uninterrupted.
Resharding goes 2 FSDP2 ranks -> 1 plain process -> 2 FSDP2 ranks; the optimizer state after each
hop and the continued training must be bitwise those of the uninterrupted run.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)

from optzoo import OptimizerConfig, get_optimizer
from tests.conftest import tiny_gpt
from tests.distributed.harness import one_thread, run_ranks
from tests.distributed.test_fsdp2 import _batches, _fully_shard

CONFIG = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, optimizer="muon")  # Muon on matrices, Adam elsewhere
SAVED_AT = 2
STEPS = 4
WORLD_SIZE = 2


def _whole(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().clone()  # on a 1-rank mesh it is the live local tensor
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole params and optimizer state, keyed by names (optzoo's own state_dict, gathered)."""
    named = opt.state_dict()
    return {
        "params": {name: _whole(p) for name, p in model.named_parameters()},
        "state": {name: {k: _whole(v) for k, v in values.items()} for name, values in named["state"].items()},
        "lrs": [g["lr"] for g in named["param_groups"]],
    }


def _train(model: Any, opt: torch.optim.Optimizer, steps: range, rows: slice) -> None:
    batches = _batches()
    for step in steps:
        opt.zero_grad()
        model.loss(batches[step][rows]).backward()
        assert opt.step()[0]


def _fsdp_model(world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = tiny_gpt()
    _fully_shard(model, init_device_mesh("cpu", (world_size,)))
    return model


def _rows(rank: int, world_size: int) -> slice:
    share = 4 // world_size  # test_fsdp2's global batch of 4
    return slice(rank * share, (rank + 1) * share)


def _save_then_continue(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    """2 FSDP2 ranks: train, save with torch's API through dcp.save, train on (the reference)."""
    import torch.distributed.checkpoint as dcp

    model = _fsdp_model(world_size)
    opt = get_optimizer(CONFIG, model)
    _train(model, opt, range(SAVED_AT), _rows(rank, world_size))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    at_save = _snapshot(model, opt)
    # live tensors where nothing was gathered (``step``), as torch's state_dict: copied to keep this moment
    full = copy.deepcopy(get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    _train(model, opt, range(SAVED_AT, STEPS), _rows(rank, world_size))
    return {"at_save": at_save, "end": _snapshot(model, opt), "full": full if rank == 0 else None}


def _one_process(source: str, target: str) -> dict[str, Any]:
    """1 plain process: load the 2-rank checkpoint with torch's API, then save it again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = tiny_gpt()
    opt = get_optimizer(CONFIG, model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=source)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = _snapshot(model, opt)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=target)
    return loaded


def _load_then_continue(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    """2 FSDP2 ranks again: load the 1-process checkpoint, train on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model = _fsdp_model(world_size)
    opt = get_optimizer(CONFIG.replace(lr=0.5), model)  # the checkpoint's lr must win
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _snapshot(model, opt)
    _train(model, opt, range(SAVED_AT, STEPS), _rows(rank, world_size))
    return {"loaded": loaded, "end": _snapshot(model, opt)}


def _full_state_dict_load(rank: int, world_size: int, full: dict[str, Any]) -> dict[str, Any]:
    """A full (gathered, CPU) state dict set back into fresh FSDP2 ranks with full_state_dict=True."""
    model = _fsdp_model(world_size)
    opt = get_optimizer(CONFIG, model)
    set_optimizer_state_dict(model, opt, copy.deepcopy(full), options=StateDictOptions(full_state_dict=True))
    return _snapshot(model, opt)


def _assert_bitwise(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert got["state"].keys() == expected["state"].keys(), what
    for name, values in expected["state"].items():
        assert got["state"][name].keys() == values.keys(), f"{what}: {name}"
        for key, value in values.items():
            mine = got["state"][name][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine.float(), value.float()) and mine.dtype == value.dtype, f"{what}: {name}/{key}"
            else:
                assert mine == value, f"{what}: {name}/{key}"
    assert got["lrs"] == expected["lrs"], what


@pytest.mark.slow
def test_resharding_2_to_1_to_2_is_bitwise(tmp_path: Path) -> None:
    first, second = str(tmp_path / "two_ranks"), str(tmp_path / "one_process")
    reference = run_ranks(WORLD_SIZE, _save_then_continue, first)
    with one_thread():
        single = _one_process(first, second)
    _assert_bitwise(single, reference[0]["at_save"], "2 ranks -> 1 process")
    for name, param in reference[0]["at_save"]["params"].items():
        assert torch.equal(single["params"][name], param), name
    resumed = run_ranks(WORLD_SIZE, _load_then_continue, second)
    for rank in range(WORLD_SIZE):
        _assert_bitwise(resumed[rank]["loaded"], reference[rank]["at_save"], "1 process -> 2 ranks")
        _assert_bitwise(resumed[rank]["end"], reference[rank]["end"], "continued training")
        for name, param in reference[rank]["end"]["params"].items():
            assert torch.equal(resumed[rank]["end"]["params"][name], param), name
    # full_state_dict + cpu_offload: rank 0 holds whole CPU tensors keyed by the model's names ...
    full = reference[0]["full"]
    assert {g["lr"] for g in full["param_groups"]} == {CONFIG.lr}
    for name, values in reference[0]["at_save"]["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert full["state"][name][key].device.type == "cpu" and torch.equal(full["state"][name][key], value), name
    # ... which loads back into fresh FSDP2 ranks with full_state_dict=True
    for got in run_ranks(WORLD_SIZE, _full_state_dict_load, full):
        _assert_bitwise(got, reference[0]["at_save"], "full state dict -> 2 ranks")


def test_one_process_round_trip_flattened_and_nested() -> None:
    """torch's API in both of its shapes (nested, and flattened as torchtitan asks), each restoring
    every state tensor bitwise into a fresh optimizer."""
    torch.manual_seed(0)
    model = tiny_gpt()
    opt = get_optimizer(CONFIG, model)
    _train(model, opt, range(SAVED_AT), slice(None))
    expected = _snapshot(model, opt)
    for flatten in (False, True):
        options = StateDictOptions(flatten_optimizer_state_dict=flatten)
        saved = get_optimizer_state_dict(model, opt, options=options)
        assert ("state.decoder.final_layernorm.weight.exp_avg" in saved) == flatten
        other = copy.deepcopy(model)
        fresh = get_optimizer(CONFIG.replace(lr=0.5), other)
        set_optimizer_state_dict(other, fresh, copy.deepcopy(saved), options=options)
        _assert_bitwise(_snapshot(other, fresh), expected, f"flatten={flatten}")
    # optzoo's own name-keyed format is unchanged for everyone else
    assert opt.state_dict()["format"] == "optzoo.chained.v1"


def test_copied_main_params_refused_by_name() -> None:
    """16-bit params with fp32 main copies: torch's API cannot name the copies; a clear error, not a KeyError."""
    torch.manual_seed(0)
    model = tiny_gpt().to(torch.bfloat16)
    opt = get_optimizer(CONFIG.replace(bf16=True), model)
    with pytest.raises(ValueError, match=re.escape("torch's get_optimizer_state_dict: this optimizer steps copies of [")):
        get_optimizer_state_dict(model, opt)


# ---- optzoo.distributed.save_dcp/load_dcp under FSDP2 ---------------------------------------------

BF16 = CONFIG.replace(bf16=True)  # bf16 params, fp32 main params: these must come back from the checkpoint


def _bf16_fsdp_model(world_size: int, seed: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)
    model = tiny_gpt().to(torch.bfloat16)
    _fully_shard(model, init_device_mesh("cpu", (world_size,)))
    return model


def _snapshot_with_mains(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {**_snapshot(model, opt), "mains": {n: _whole(v) for n, v in opt.state_dict()["main_params"].items()}}


def _save_dcp_then_continue(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    from optzoo.distributed import save_dcp

    model = _bf16_fsdp_model(world_size, 0)
    opt = get_optimizer(BF16, model)
    _train(model, opt, range(SAVED_AT), _rows(rank, world_size))
    save_dcp(opt, checkpoint)
    torch.save({n: _whole(p) for n, p in model.state_dict().items()}, f"{checkpoint}/model{rank}.pt")
    at_save = _snapshot_with_mains(model, opt)
    _train(model, opt, range(SAVED_AT, STEPS), _rows(rank, world_size))
    return {"at_save": at_save, "end": _snapshot_with_mains(model, opt)}


def _load_dcp_then_continue(rank: int, world_size: int, checkpoint: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from optzoo.distributed import load_dcp

    model = _bf16_fsdp_model(world_size, 1)
    set_model_state_dict(model, torch.load(f"{checkpoint}/model0.pt"), options=StateDictOptions(full_state_dict=True))
    opt = get_optimizer(BF16, model)
    load_dcp(opt, checkpoint)
    loaded = _snapshot_with_mains(model, opt)
    _train(model, opt, range(SAVED_AT, STEPS), _rows(rank, world_size))
    return {"loaded": loaded, "end": _snapshot_with_mains(model, opt)}


@pytest.mark.slow
def test_save_dcp_under_fsdp2_reshards_with_fp32_main_params(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "fsdp2")
    reference = run_ranks(WORLD_SIZE, _save_dcp_then_continue, checkpoint)
    assert reference[0]["at_save"]["mains"] and all(v.dtype == torch.float32 for v in reference[0]["at_save"]["mains"].values())
    (one,) = run_ranks(1, _load_dcp_then_continue, checkpoint)  # 2 ranks -> 1
    _assert_bitwise(one["loaded"], reference[0]["at_save"], "save_dcp 2 ranks -> 1")
    resumed = run_ranks(WORLD_SIZE, _load_dcp_then_continue, checkpoint)  # 2 ranks -> 2, continued
    for rank in range(WORLD_SIZE):
        for key in ("at_save", "end"):
            got = resumed[rank]["loaded" if key == "at_save" else "end"]
            _assert_bitwise(got, reference[rank][key], f"save_dcp 2 ranks -> 2 ({key})")
            for name, main in reference[rank][key]["mains"].items():
                assert torch.equal(got["mains"][name], main), (key, name)
        for name, param in reference[rank]["end"]["params"].items():
            assert torch.equal(resumed[rank]["end"]["params"][name], param), name


class _Delegating(torch.optim.Optimizer):
    """A framework's wrapper between torch's API and optzoo, shaped as accelerate's
    ``AcceleratedOptimizer`` (its ``state_dict`` calls the wrapped optimizer's)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: D107 - no torch init, as accelerate's
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def test_a_framework_wrapper_in_between_still_gets_torchs_format() -> None:
    torch.manual_seed(0)
    model = tiny_gpt()
    inner = get_optimizer(CONFIG, model)
    _train(model, inner, range(SAVED_AT), slice(None))
    expected = _snapshot(model, inner)
    saved = get_optimizer_state_dict(model, _Delegating(inner))
    assert "decoder.final_layernorm.weight" in saved["state"]
    fresh = get_optimizer(CONFIG, model)
    set_optimizer_state_dict(model, _Delegating(fresh), copy.deepcopy(saved))
    _assert_bitwise(_snapshot(model, fresh), expected, "through a wrapper")
