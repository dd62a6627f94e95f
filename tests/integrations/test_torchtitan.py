"""optzoo.torchtitan's ``OptimizersContainer`` driven by torchtitan 0.3.0 itself.

A tiny Hugging Face Llama (random init; torchtitan's own models need CUDA to train) is sharded
with FSDP2 on 2 gloo ranks. torchtitan's ``LRSchedulersContainer`` schedules the container and
torchtitan's ``CheckpointManager`` saves it through DCP at step 2 and loads it into a fresh model
and container; the resumed run must end bitwise where the uninterrupted one does (the reference
is torchtitan's training run, not optzoo's own numbers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
SAVED_AT = 2
STEPS = 4
CONFIGS = {
    "fp32": OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, optimizer="muon"),
    # 16-bit params: the fp32 main params must come back from the checkpoint, not from the bf16 weights
    "bf16": OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, optimizer="muon", bf16=True),
}


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(256, (4, 8), generator=generator) for _ in range(STEPS)]


def _parts(seed: int, bf16: bool, world_size: int) -> list[torch.nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from optzoo.distributed import preserve_param_attributes
    from optzoo.hf import build_hf_model

    torch.manual_seed(seed)
    model = build_hf_model("LlamaConfig")
    if bf16:
        model = model.to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world_size,))
    with preserve_param_attributes(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return [model]


def _stack(parts: list[torch.nn.Module], config: OptimizerConfig, folder: str) -> tuple[Any, Any, Any]:
    """torchtitan's trio as its trainer builds them: optimizers, lr schedulers, checkpointer."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    from optzoo.torchtitan import OptimizersContainer

    optimizers = OptimizersContainer.Config(optimizer=config).build(model_parts=parts)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    checkpointer = CheckpointManager(
        CheckpointManager.Config(enable=True, folder=folder, interval=SAVED_AT),
        dataloader=None, model_parts=parts, optimizers=optimizers, lr_schedulers=schedulers, states={}, sd_adapter=None,
    )  # fmt: skip
    return optimizers, schedulers, checkpointer


def _train(parts: list[torch.nn.Module], optimizers: Any, schedulers: Any, steps: range, rows: slice) -> None:
    batches = _batches()
    for step in steps:
        optimizers.zero_grad()
        tokens = batches[step][rows]
        parts[0](input_ids=tokens, labels=tokens).loss.backward()
        optimizers.step()
        schedulers.step()


def _whole(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().clone()  # on a 1-rank mesh it is the live local tensor
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _snapshot(parts: list[torch.nn.Module], optimizers: Any) -> dict[str, Any]:
    named = optimizers.optimizers[0].state_dict()
    return {
        "params": {n: _whole(p) for n, p in parts[0].named_parameters()},
        "state": {n: {k: _whole(v) for k, v in values.items()} for n, values in named["state"].items()},
        "mains": {n: _whole(v) for n, v in named["main_params"].items()},
        "lrs": [g["lr"] for g in named["param_groups"]],
    }


def _run(rank: int, world_size: int, name: str, folder: str) -> dict[str, Any]:
    config = CONFIGS[name]
    rows = slice(rank * 2, rank * 2 + 2)
    parts = _parts(0, config.bf16, world_size)
    optimizers, schedulers, checkpointer = _stack(parts, config, folder)
    assert len(optimizers) == 1 and list(optimizers) == optimizers.optimizers
    _train(parts, optimizers, schedulers, range(SAVED_AT), rows)
    assert checkpointer.save(curr_step=SAVED_AT)
    _train(parts, optimizers, schedulers, range(SAVED_AT, STEPS), rows)
    reference = _snapshot(parts, optimizers)
    checkpointer.close()

    parts = _parts(1, config.bf16, world_size)  # another init: everything must come from the checkpoint
    # the same config: torchtitan's schedulers recompute each lr from the optimizer's base lr
    optimizers, schedulers, checkpointer = _stack(parts, config, folder)
    assert checkpointer.load(step=SAVED_AT)
    _train(parts, optimizers, schedulers, range(SAVED_AT, STEPS), rows)
    resumed = _snapshot(parts, optimizers)
    checkpointer.close()
    return {"reference": reference, "resumed": resumed}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_torchtitan_checkpoint_resume_is_bitwise(name: str, tmp_path: Path) -> None:
    for result in run_ranks(WORLD_SIZE, _run, name, str(tmp_path / "checkpoint"), timeout=300):
        reference, resumed = result["reference"], result["resumed"]
        assert resumed["lrs"] == reference["lrs"]
        for key in ("params", "mains"):
            assert resumed[key].keys() == reference[key].keys()
            for param, value in reference[key].items():
                assert torch.equal(resumed[key][param], value), (key, param)
        assert resumed["state"].keys() == reference["state"].keys()
        for param, values in reference["state"].items():
            for state_key, value in values.items():
                assert torch.equal(torch.as_tensor(resumed["state"][param][state_key]), torch.as_tensor(value)), (param, state_key)
        if name == "bf16":
            assert reference["mains"] and all(v.dtype == torch.float32 for v in reference["mains"].values())


def test_container_protocol_on_one_process() -> None:
    """What torchtitan's trainer and LRSchedulersContainer use: len/iter, step hooks, zero_grad,
    one LambdaLR per optimizer writing the lr that optzoo's optimizer steps with."""
    from torchtitan.components.optimizer import LRSchedulersContainer

    from optzoo.torchtitan import OptimizersContainer

    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), torch.nn.Linear(2, 2)]
    optimizers = OptimizersContainer.Config(optimizer=OptimizerConfig(lr=1.0, optimizer="adam")).build(model_parts=parts)
    assert len(optimizers) == 2 and [type(o).__name__ for o in optimizers] == ["FP32Optimizer", "FP32Optimizer"]
    schedulers = LRSchedulersContainer.Config(warmup_steps=4).build(optimizers=optimizers, training_steps=10)
    calls: list[str] = []
    optimizers.register_step_pre_hook(lambda *args: calls.append("pre"))
    optimizers.register_step_post_hook(lambda *args: calls.append("post"))
    parts[1](parts[0](torch.randn(3, 4))).sum().backward()
    optimizers.step()
    assert calls == ["pre", "post"]
    # torchtitan's linear warmup (its lr_scheduler.py): lr * (step + 1) / warmup_steps, at step 1 after one step()
    schedulers.step()
    assert {g["lr"] for o in optimizers for g in o.param_groups} == {2 / 4}
    optimizers.zero_grad()
    assert all(p.grad is None for part in parts for p in part.parameters())
    with pytest.raises(TypeError, match=r"needs optzoo's config; got NoneType"):
        OptimizersContainer.Config().build(model_parts=parts)
    with pytest.raises(ValueError, match=r"^`OptimizersContainer.Config.implementation`: torchtitan's setting, which optzoo's routing replaces; got 'foreach'"):
        OptimizersContainer.Config(optimizer=OptimizerConfig(lr=1.0), implementation="foreach").build(model_parts=parts)
