"""Issue 28, item 2 on several ranks: a DCP checkpoint of another routing is refused on every rank
from its metadata alone, before any state is read, on the world size it was saved with and on
another; the routing digest is the same on every rank and world size; ``allow_routing_change``
reports the same fresh params on every rank.
"""

from __future__ import annotations

import tempfile
import traceback
from typing import Any

import pytest
import torch

from tests.conftest import tiny_gpt, twin
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

GPT_MLP_WEIGHTS = [f"decoder.layers.{i}.mlp.linear_fc{j}.weight" for i in (0, 1) for j in (1, 2)]
GPT_MLP_BIASES = [f"decoder.layers.{i}.mlp.linear_fc{j}.bias" for i in (0, 1) for j in (1, 2)]
MOVED = [f"{n}: group #0 muon -> group #3 adam" for n in GPT_MLP_WEIGHTS] + [f"{GPT_MLP_BIASES[0]}: group #2 adam -> group #4 adam"]
REFUSAL = (
    f"`state_dict`: the routing (param group and optimizer) of 8 params differs from the checkpoint's; got {'; '.join(MOVED)}; ... (+3 more); "
    "expected the routing it was saved with (or load_state_dict(..., allow_routing_change=True) to load what still "
    "fits and start these params fresh)"
)


def _optimizer(model: torch.nn.Module, mlp_to_adam: bool, flag: str) -> Any:
    from optzoo import OptimizerConfig, ParamKey, get_optimizer

    config = OptimizerConfig(lr=1e-2, optimizer="muon", **{flag: True})
    overrides = {ParamKey(name="*.mlp.*"): {"optimizer": "adam"}} if mlp_to_adam else None
    return get_optimizer(config, model, overrides, lint=False)


def _step(model: torch.nn.Module, opt: Any) -> None:
    torch.manual_seed(1)  # the same batch on every rank: a replicated model
    opt.zero_grad()
    model.loss(torch.randint(32, (4, 9))).backward()  # type: ignore[operator]
    opt.step()


def _local_state(opt: Any) -> dict[str, dict[str, torch.Tensor]]:
    return {
        e.name: {k: v.clone() for k, v in opt.state[e.main].items()} for e in opt.param_map.local if opt.state.get(e.main)
    }


def _same_state(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


def _resume(rank: int, world_size: int, path: str, flag: str, save: bool) -> dict[str, Any]:
    import optzoo.distributed.dcp as dcp_module
    from optzoo.distributed import load_dcp, save_dcp

    torch.manual_seed(0)
    model = tiny_gpt()
    out: dict[str, Any] = {}
    if save:
        opt = _optimizer(model, False, flag)
        _step(model, opt)
        save_dcp(opt, path)
    out["digest"] = _optimizer(twin(model), False, flag).routing_digest
    resumed = twin(model)
    other = _optimizer(resumed, True, flag)
    _step(resumed, other)  # state of its own, which the refusal must keep
    params = {n: p.detach().clone() for n, p in resumed.named_parameters()}
    state = _local_state(other)
    reads: list[list[str]] = []
    original = dcp_module.dcp_load

    def spy(state_dict: dict[str, Any], **kwargs: Any) -> Any:
        reads.append(sorted(state_dict))
        return original(state_dict, **kwargs)

    dcp_module.dcp_load = spy  # type: ignore[assignment]
    try:
        load_dcp(other, path)
    except ValueError as error:
        out["refusal"] = str(error)
    except Exception:  # noqa: BLE001 - reported as a failure of the test
        out["refusal"] = "NOT A ValueError: " + traceback.format_exc()[-800:]
    finally:
        dcp_module.dcp_load = original  # type: ignore[assignment]
    out["reads"] = reads
    out["params unchanged"] = all(torch.equal(p, params[n]) for n, p in resumed.named_parameters())
    out["state unchanged"] = _same_state(_local_state(other), state)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = load_dcp(other, path, allow_routing_change=True)
    out["fresh"] = list(report.fresh) if report is not None else None
    out["warnings"] = [str(w.message) for w in caught]
    out["fresh state"] = sorted(n for n in GPT_MLP_WEIGHTS if n in _local_state(other))
    return out


@pytest.mark.parametrize("flag", ["use_layer_wise_distributed_optimizer", "use_distributed_optimizer"])
def test_a_dcp_checkpoint_of_another_routing_is_refused_before_any_state_is_read(flag: str) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/ckpt"
        saved_on_two = run_ranks(2, _resume, path, flag, True)
        loaded_on_one = run_ranks(1, _resume, path, flag, False)  # another world size: the same protection
    for result in saved_on_two + loaded_on_one:
        assert result["refusal"] == REFUSAL
        assert result["reads"] == [["meta"]]  # the metadata alone was read
        assert result["params unchanged"] and result["state unchanged"]
        assert result["fresh"] == GPT_MLP_WEIGHTS
        assert result["warnings"] == [
            f"`load_state_dict`: started 4 params with fresh optimizer state, their routing having changed; got "
            f"[{', '.join(GPT_MLP_WEIGHTS)}]; expected nothing else to start fresh (the returned RoutingChangeReport lists them all)"
        ]
        assert result["fresh state"] == []  # no state until their next step, as a new optimizer's
    assert len({result["digest"] for result in saved_on_two + loaded_on_one}) == 1  # one digest on 2 ranks and on 1


def _other_plan(rank: int, world_size: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from optzoo import OptimizerConfig, get_optimizer
    from optzoo.distributed import load_dcp, save_dcp

    torch.manual_seed(0)
    model = tiny_gpt()
    sharded = twin(model)
    opt = _optimizer(model, False, "use_layer_wise_distributed_optimizer")
    _step(model, opt)
    save_dcp(opt, path)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (world_size,)))
    fsdp = get_optimizer(OptimizerConfig(lr=1e-2, optimizer="muon"), sharded, lint=False)
    out: dict[str, Any] = {"refusal": None}
    try:
        load_dcp(fsdp, path)
    except ValueError as error:
        out["refusal"] = str(error)
    out["state"] = len(fsdp.state)
    out["plan"] = fsdp.routing_record()["plan"]
    return out


def test_a_dcp_checkpoint_of_the_distributed_optimizer_is_refused_by_fsdp2_naming_the_plans() -> None:
    with tempfile.TemporaryDirectory() as directory:
        (result,) = run_ranks(1, _other_plan, f"{directory}/ckpt")
    assert result["refusal"] == (
        "`load_dcp`: the checkpoint was saved under plan 'layer_wise'; got an optimizer under plan 'fsdp2'; expected the "
        "same kind (FSDP2 and the distributed optimizers write different keys: go through a consolidated state_dict(), "
        "which loads under any plan)"
    )
    assert result["state"] == 0  # nothing loaded
    assert result["plan"] == "fsdp2"
