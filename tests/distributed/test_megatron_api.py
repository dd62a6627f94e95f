"""Megatron-Core's optimizer API on the distributed optimizers, on 1 and 2 gloo ranks, against one
process: the step's halves (``prepare_grads``, ``clip_grad_norm``, ``count_zeros``,
``step_with_ready_grads``), ``grad_norm_skip_threshold``, ``allgather_params`` /
``broadcast_params`` and ``reload_model_params(state_dict)``.

Every rank feeds the whole batch, so gradients agree across ranks (see test_distributed.py):
element-wise Adam without clipping equals one process bit for bit; a norm is all-reduced in
another order, so norms (and what clipping makes of them) agree to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from optzoo import OptimizerConfig, get_optimizer
from tests.distributed.harness import one_thread, run_ranks
from tests.distributed.test_distributed import ADAM, LAYER_WISE, NOISE_TOLERANT, ROUNDING, SHARDED, assert_params_equal, batch, build, lm_loss

pytestmark = pytest.mark.slow

FLAGS = {"layer_wise": LAYER_WISE, "sharded": SHARDED}


def _fp32_state() -> dict[str, torch.Tensor]:
    """The seeded model's weights in fp32, a little off bf16's grid (so bf16 would round them)."""
    return {name: (p.detach().float() + 2**-12).clone() for name, p in build().named_parameters()}


def _corrupt_what_others_own_(optimizer: Any) -> None:
    """Zero every element of the model params that this rank does not step."""
    with torch.no_grad():
        for entry in optimizer.param_map.entries:
            flat = entry.model.detach().view(-1)
            if entry.main is None:
                flat.zero_()
            elif entry.part is not None:
                flat[: entry.part[0]].zero_()
                flat[entry.part[1] :].zero_()


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """Train per ``spec``, on one process or on this rank: ``drive`` says how a step is taken."""
    model = build()
    if spec.get("bf16"):
        model = model.to(torch.bfloat16)
    config = OptimizerConfig(**spec["config"], bf16=bool(spec.get("bf16")))
    optimizer: Any = get_optimizer(config, model)
    out: dict[str, Any] = {"results": [], "norms": []}
    if spec.get("reload"):
        optimizer.reload_model_params({"model": _fp32_state()})
        out["main_params"] = {k: v.clone() for k, v in optimizer.state_dict()["main_params"].items()}
    for step in range(spec["steps"]):
        optimizer.zero_grad()
        lm_loss(model, batch(step)).backward()
        if spec.get("drive") == "halves":
            if optimizer.prepare_grads():
                out["results"].append((False, None, None))
                continue
            out["norms"].append(optimizer.get_grad_norm())
            norm = optimizer.clip_grad_norm(config.clip_grad)
            zeros = optimizer.count_zeros()
            out["results"].append((optimizer.step_with_ready_grads(), norm, zeros))
        else:
            out["results"].append(optimizer.step())
        if spec.get("drive") == "resync" and hasattr(optimizer, "allgather_params"):  # the reference has nothing to sync
            _corrupt_what_others_own_(optimizer)
            (optimizer.allgather_params if step % 2 else optimizer.broadcast_params)()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def scenarios(rank: int, world: int, specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every spec, under both distributed flags, in one spawned run."""
    return {f"{name} {mode}": train({**spec, "config": {**spec["config"], **flags}}) for name, spec in specs.items() for mode, flags in FLAGS.items()}


CLIPPED = {**ADAM, **NOISE_TOLERANT, "clip_grad": 0.05, "log_num_zeros_in_grad": True}
SPECS: dict[str, dict[str, Any]] = {
    "step": {"config": CLIPPED, "steps": 3},
    "halves": {"config": CLIPPED, "steps": 3, "drive": "halves"},
    "resync": {"config": ADAM, "steps": 3, "drive": "resync"},
    "reload": {"config": ADAM, "steps": 2, "bf16": True, "reload": True},
}


def _threshold() -> float:
    """Just below the first step's norm: step 0 is skipped, later ones are not (checked below)."""
    with one_thread():
        first = train({"config": {**ADAM, "clip_grad": 1e6}, "steps": 1})["results"][0][1]
    return float(first) * (1 - 1e-3)


@pytest.mark.parametrize("world", [1, 2])
def test_megatron_api_on_ranks_equals_one_process(world: int) -> None:
    threshold = _threshold()
    skipping = {"config": {**ADAM, "clip_grad": 0.0, "grad_norm_skip_threshold": threshold}, "steps": 3}
    specs = {**SPECS, "skip": skipping}
    with one_thread():
        expected = {name: train(spec) for name, spec in specs.items()}
    runs = run_ranks(world, scenarios, specs)
    for run in runs:
        for mode in FLAGS:
            # step() on ranks is its halves called one by one, bit for bit
            step, halves = run[f"step {mode}"], run[f"halves {mode}"]
            assert halves["results"] == step["results"]
            assert_params_equal(halves["params"], step["params"])
            # and equals one process to rounding (the norm is all-reduced)
            assert_params_equal(step["params"], expected["step"]["params"], **ROUNDING)
            for (ok, norm, zeros), (want_ok, want_norm, want_zeros) in zip(step["results"], expected["step"]["results"], strict=True):
                assert ok is want_ok is True and norm == pytest.approx(want_norm, rel=1e-6)
            assert step["results"][0][2] == expected["step"]["results"][0][2] > 0  # exact zeros on the first step
            assert halves["norms"] == pytest.approx(expected["halves"]["norms"], rel=1e-6)
            # grad_norm_skip_threshold skips the same steps everywhere; Adam without clipping is bitwise
            skip = run[f"skip {mode}"]
            assert [ok for ok, _, _ in skip["results"]] == [ok for ok, _, _ in expected["skip"]["results"]]
            assert skip["results"][0][0] is False and any(ok for ok, _, _ in skip["results"][1:])
            assert [n for _, n, _ in skip["results"]] == pytest.approx([n for _, n, _ in expected["skip"]["results"]], rel=1e-6)
            assert_params_equal(skip["params"], expected["skip"]["params"])
            # allgather_params / broadcast_params bring back what every other rank owns
            assert_params_equal(run[f"resync {mode}"]["params"], expected["resync"]["params"])
            # reload_model_params(state_dict): fp32 mains from the state dict on every rank, then bitwise training
            reload = run[f"reload {mode}"]
            assert_params_equal(reload["main_params"], _fp32_state())
            assert_params_equal(reload["params"], expected["reload"]["params"])
