"""Nothing lost under faults (issue #24), on several ranks: FSDP2 checkpoints of the other layout,
DCP checkpoints of another model, and checkpoints refused on some ranks only.

Each test spawns gloo ranks on CPU (see ``harness.py``); each spawned run makes several checks.
"""

from __future__ import annotations

import copy
import tempfile
import traceback
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2


class Tiny(torch.nn.Module):
    def __init__(self, rows: int = 6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(rows, 4))
        self.bias = torch.nn.Parameter(torch.randn(rows))


def _build(dtype: torch.dtype, *, mesh: Any = None, rows: int = 6, **fields: Any) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny(rows).to(dtype)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    config = OptimizerConfig(lr=1e-2, bf16=dtype == torch.bfloat16, standard_overrides=False, **fields)  # {}: no rules at all
    return model, get_optimizer(config, model, config_overrides={}, trace=False, lint=False)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, value: float = 1.0) -> None:
    for param in model.parameters():
        param.grad = torch.full_like(param, value)
    opt.step()


def _whole(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _error(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as error:
        return str(error)
    except Exception:  # noqa: BLE001 - reported as a failure of the test
        return "NOT A ValueError: " + traceback.format_exc()[-800:]
    return None


# ---- FSDP2 <-> one process ---------------------------------------------------------------------


def _fsdp_layouts(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for source, target in ((mesh, None), (None, mesh)):
            key = f"{dtype} {'fsdp' if source else 'plain'}->{'fsdp' if target else 'plain'}"
            try:
                model, opt = _build(dtype, mesh=source)
                _step(model, opt)
                saved = copy.deepcopy(opt.state_dict())
                expected = {n: {k: _whole(v).clone() for k, v in vals.items()} for n, vals in saved["state"].items()}
                model2, opt2 = _build(dtype, mesh=target)
                opt2.load_state_dict(saved)
                params = dict(model2.named_parameters())
                kinds_ok = all(
                    isinstance(value, DTensor) == isinstance(params[name], DTensor)
                    and (not isinstance(value, DTensor) or value.placements == params[name].placements)
                    for name, values in opt2.state_dict()["state"].items()
                    for key, value in values.items()
                    if key != "step"
                )
                loaded = {n: {k: _whole(v) for k, v in vals.items()} for n, vals in opt2.state_dict()["state"].items()}
                same = all(torch.equal(loaded[n][k].float(), expected[n][k].float()) for n in expected for k in expected[n])
                _step(model2, opt2)
                finite = all(bool(torch.isfinite(_whole(p).float()).all()) for p in model2.parameters())
                out[key] = (kinds_ok, same, finite)
            except Exception:  # noqa: BLE001
                out[key] = traceback.format_exc()[-1500:]
    # A damaged FSDP2 checkpoint is refused by name, and the FSDP2 optimizer keeps its state.
    model, opt = _build(torch.float32, mesh=mesh)
    _step(model, opt)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"]["weight"].pop("exp_avg_sq")
    before = copy.deepcopy({n: {k: _whole(v) for k, v in vals.items()} for n, vals in opt.state_dict()["state"].items()})
    out["damaged"] = _error(lambda: opt.load_state_dict(saved))
    after = {n: {k: _whole(v) for k, v in vals.items()} for n, vals in opt.state_dict()["state"].items()}
    out["unchanged"] = all(k in after.get(n, {}) and torch.equal(after[n][k], before[n][k]) for n in before for k in before[n])
    return out


def test_fsdp2_and_one_process_checkpoints_load_into_each_other_as_the_live_params() -> None:
    for result in run_ranks(WORLD_SIZE, _fsdp_layouts):
        for dtype in ("torch.float32", "torch.bfloat16"):
            for key in (f"{dtype} fsdp->plain", f"{dtype} plain->fsdp"):
                assert result[key] == (True, True, True), (key, result[key])
        assert result["damaged"] is not None and result["damaged"].startswith("`weight`: saved optimizer state has other keys"), result
        assert result["unchanged"]


# ---- DCP of another model; refusals on some ranks only -----------------------------------------


def _other_shapes(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    from optzoo.distributed import load_dcp, save_dcp

    out: dict[str, Any] = {}
    for flag in ("use_distributed_optimizer", "use_layer_wise_distributed_optimizer"):
        model, opt = _build(torch.float32, **{flag: True})
        _step(model, opt)
        path = f"{directory}/{flag}"
        save_dcp(opt, path)  # type: ignore[arg-type]
        smaller, smaller_opt = _build(torch.float32, rows=3, **{flag: True})
        before = copy.deepcopy(smaller_opt.state_dict())
        out[flag] = _error(lambda: load_dcp(smaller_opt, path))  # type: ignore[arg-type]  # noqa: B023
        out[f"{flag} unchanged"] = str(smaller_opt.state_dict()) == str(before)
    # A consolidated checkpoint damaged in one param: only its owner sees it, every rank refuses.
    model, opt = _build(torch.float32, use_layer_wise_distributed_optimizer=True)
    _step(model, opt)
    saved = opt.state_dict()
    owner = {n for g in opt.param_groups for n in g["param_names"]}  # this rank's params
    out["owns_weight"] = "weight" in owner
    damaged = copy.deepcopy(saved)
    damaged["state"]["weight"]["exp_avg"] = torch.zeros(4, 6)
    before = str(opt.state_dict())
    out["one owner"] = _error(lambda: opt.load_state_dict(damaged))
    out["one owner unchanged"] = str(opt.state_dict()) == before
    return out


def test_a_checkpoint_refused_on_some_ranks_is_refused_on_all_with_one_message() -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = run_ranks(WORLD_SIZE, _other_shapes, directory)
    for flag in ("use_distributed_optimizer", "use_layer_wise_distributed_optimizer"):
        messages = {result[flag] for result in results}
        assert len(messages) == 1, messages
        (message,) = messages
        assert message is not None and message.startswith("`weight`: shape differs from the checkpoint's; got (6, 4)"), message
        assert all(result[f"{flag} unchanged"] for result in results)
    assert sorted(result["owns_weight"] for result in results) == [False, True]  # one rank sees the damage
    assert {result["one owner"] for result in results} == {
        "`weight`: state `exp_avg` shape differs; got (4, 6) in the checkpoint; expected (6, 4)"
    }
    assert all(result["one owner unchanged"] for result in results)
