"""accelerate's FSDP2 ``prepare(model, optimizer)`` after ``get_optimizer``: clip, norm and skip survive.

``Accelerator.prepare`` shards the model (``fsdp2_prepare_model``: ``fully_shard`` registers new
DTensor params) and re-points ``optimizer.param_groups[i]["params"]`` at the new param of each
name (``fsdp2_switch_optimizer_parameters``), accelerate 1.x ``Accelerator._prepare_fsdp2``.
accelerate selects FSDP only on accelerator devices (``PartialState`` keeps ``MULTI_CPU`` for CPU
ranks), so each rank builds an ``Accelerator(cpu=True)`` on the gloo group and then sets
``AcceleratorState.distributed_type = DistributedType.FSDP`` with an FSDP2 plugin by hand; the
rest is accelerate's own ``prepare`` code path, unchanged, on 2 gloo ranks, with
``mixed_precision="no"`` and ``"bf16"`` (accelerate's ``MixedPrecisionPolicy``: bf16 compute on
fp32 sharded params).

Expectations come from outside optzoo: an inf gradient leaves every param and state tensor bit for
bit as it was; the reported grad norm is the float64 norm of the whole (gathered) gradients; the
SGD update is torch's momentum rule applied to the gradients times Megatron's clip coefficient
``clip / (norm + 1e-6)`` (megatron/core/optimizer/clip_grads.py), recomputed in float64.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
LR, MOMENTUM, CLIP = 0.1, 0.9, 0.05
CONFIG = OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=MOMENTUM, weight_decay=0.0, clip_grad=CLIP)


def _prepared(mixed_precision: str) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    from optzoo.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("LlamaConfig")
    optimizer = get_optimizer(CONFIG, model)  # before prepare, as accelerate's docs show
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator.state.distributed_type = DistributedType.FSDP  # the one thing accelerate does not do on CPU
    accelerator.state.fsdp_plugin = plugin
    model, prepared = accelerator.prepare(model, optimizer)
    return accelerator, model, prepared


def _backward(accelerator: Any, model: Any, rank: int, step: int) -> None:
    ids = torch.randint(256, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)


def _local(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.to_local().detach().clone() for name, t in tensors.items()}


def _skip_clip_and_norm(rank: int, world_size: int, mixed_precision: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    accelerator, model, prepared = _prepared(mixed_precision)
    optimizer = prepared.optimizer  # accelerate's AcceleratedOptimizer wraps optzoo's
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    # routing by name is kept: each group's names hold the model's new param of that name
    by_id = {id(p): name for name, p in params.items()}
    assert [[by_id[id(p)] for p in g["params"]] for g in optimizer.param_groups] == [g["param_names"] for g in optimizer.param_groups]

    # step 1: an ordinary step through accelerate's wrapper (it drops step()'s value), so that momentum buffers exist
    _backward(accelerator, model, rank, 1)
    prepared.step()
    first = sorted(by_id[id(p)] for p in optimizer.state) == sorted(params)
    prepared.zero_grad()

    # steps 2 and 3 call optzoo's step itself, for its (success, grad_norm, num_zeros)
    # step 2: an inf in rank 0's shard of one gradient; both ranks skip
    _backward(accelerator, model, rank, 2)
    if rank == 0:
        params["model.layers.0.mlp.down_proj.weight"].grad.to_local()[0, 0] = float("inf")
    before = _local(params)
    state_before = {by_id[id(p)]: s["momentum_buffer"].to_local().clone() for p, s in optimizer.state.items()}
    skipped = optimizer.step()
    unchanged = all(torch.equal(before[n], p.to_local()) for n, p in params.items()) and all(
        torch.equal(state_before[by_id[id(p)]], s["momentum_buffer"].to_local()) for p, s in optimizer.state.items()
    )
    prepared.zero_grad()

    # step 3: clipped; the norm and the update against float64
    _backward(accelerator, model, rank, 3)
    grads = {n: p.grad.full_tensor().double() for n, p in params.items() if p.grad is not None}
    norm64 = torch.sqrt(sum((g**2).sum() for g in grads.values())).item()
    before_full = {n: p.full_tensor().double() for n, p in params.items()}
    buffers = {by_id[id(p)]: s["momentum_buffer"].full_tensor().double() for p, s in optimizer.state.items()}
    clipped = optimizer.step()
    coefficient = min(1.0, CLIP / (norm64 + 1e-6))
    errors = []
    for name, grad in grads.items():
        expected = before_full[name] - LR * (MOMENTUM * buffers[name] + coefficient * grad)
        errors.append(((params[name].full_tensor().double() - expected).abs().max() / expected.abs().max()).item())
    return {"first": first, "skipped": skipped, "unchanged": unchanged, "clipped": clipped, "norm64": norm64, "error": max(errors)}


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_fsdp2_prepare_keeps_the_inf_skip_clipping_and_grad_norm(mixed_precision: str) -> None:
    for rank, run in enumerate(run_ranks(WORLD_SIZE, _skip_clip_and_norm, mixed_precision, timeout=300)):
        assert run["first"], (rank, run)  # every param stepped: has its momentum buffer
        assert run["skipped"] == (False, None, None), (rank, run)  # reported as a skip
        assert run["unchanged"], rank  # params and momentum buffers bit for bit
        success, norm, _ = run["clipped"]
        assert success is True and norm is not None
        assert norm == pytest.approx(run["norm64"], rel=1e-6)  # float32 sums of squares vs float64
        assert CLIP / norm < 1.0, "the step did clip"
        # float32 update vs float64: params ~1e-2, steps ~1e-3; 1e-5 of the largest param is float32 rounding
        assert run["error"] < 1e-5, (rank, run["error"])


# ---- re-pointing that cannot be followed: one process, by hand, as fsdp2_switch_optimizer_parameters does ----


def _repointed_after_a_step(config: OptimizerConfig) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = get_optimizer(config, model)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    for module in model:
        module.weight = torch.nn.Parameter(module.weight.detach().clone())
    new = {id(module.weight) for module in model}
    fresh = {name: p for name, p in model.named_parameters()}
    for group in optimizer.param_groups:  # accelerate's switch: the same slots, the new params by name
        group["params"] = [fresh[name] for name in group["param_names"]]
    assert sum(id(p) in new for g in optimizer.param_groups for p in g["params"]) == 2
    model(torch.randn(3, 4)).sum().backward()
    return model, optimizer


def test_repointing_after_a_step_is_refused_naming_what_to_do() -> None:
    model, optimizer = _repointed_after_a_step(OptimizerConfig(optimizer="adam", lr=1e-3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=re.escape(
        "`0.weight`: the optimizer's param_groups were re-pointed at new tensors (as accelerate's FSDP2 prepare does); "
        "got optimizer state for the old param (a step was taken before); expected each slot re-pointed at the model's "
        "new param of that name, before any step, for a param stepped in place: call accelerator.prepare(model, "
        "optimizer) before training, with OptimizerConfig(bf16=False) and accelerate's mixed_precision (or, without "
        "accelerate, build the optimizer after fully_shard)"
    )):  # fmt: skip
        optimizer.step()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def _repointed_distributed_optimizer(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = get_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_layer_wise_distributed_optimizer=True), model)
    for module in model:
        module.weight = torch.nn.Parameter(module.weight.detach().clone())
        module.bias = torch.nn.Parameter(module.bias.detach().clone())
    fresh = dict(model.named_parameters())
    for group, entries in zip(optimizer.param_groups, optimizer.param_map.local_by_group()):  # this rank's own params
        group["params"] = [fresh[entry.name] for entry in entries]
    assert any(g["params"] for g in optimizer.param_groups), "each rank owns some of the 4 params"
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError) as raised:
        optimizer.step()
    return str(raised.value)


def test_a_distributed_optimizer_refuses_repointed_params() -> None:
    for message in run_ranks(WORLD_SIZE, _repointed_distributed_optimizer, timeout=120):
        assert message.startswith(
            "`param_groups`: re-pointed at new tensors (as accelerate's FSDP2 prepare does); got a DistributedOptimizer "
            "(use_distributed_optimizer or use_layer_wise_distributed_optimizer)"
        ), message
