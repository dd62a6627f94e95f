"""``optzoo.estimate`` per rank against what 2 gloo ranks really hold after their first step.

Each rank builds the optimizer under the layer-wise optimizer, ZeRO-1 (``use_distributed_optimizer``)
or FSDP2 (``fully_shard`` over a 2-rank mesh), steps once, and counts the storages it holds beside the
model (state, main params, gradient and param-sync buffers; :func:`tests.optzoo.test_estimate.held_bytes`).
The estimate is made in the parent, from an unsharded model of the same architecture.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, estimate, get_optimizer
from optzoo.distributed import preserve_param_attributes
from tests.conftest import tiny_gpt
from tests.distributed.harness import run_ranks
from tests.optzoo.test_estimate import TOLERANCE, estimated, held_bytes, relative_errors

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
BASE = OptimizerConfig(lr=1e-3)
CONFIGS: dict[str, OptimizerConfig] = {
    "adam_fp32": BASE,
    "adam_bf16": BASE.replace(bf16=True),
    "adam_precision_aware": BASE.replace(bf16=True, use_precision_aware_optimizer=True),
    "muon_fp32": BASE.replace(optimizer="muon"),
    "muon_bf16": BASE.replace(optimizer="muon", bf16=True),
    # NorMuon's second moment is per row (or column) of each matrix: a fact of the shape each rank steps
    "normuon_fp32": BASE.replace(optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon"),
}
FLAGS = {"layer_wise": "use_layer_wise_distributed_optimizer", "sharded": "use_distributed_optimizer"}
FSDP2_CONFIGS = ("adam_fp32", "adam_bf16", "muon_fp32", "muon_bf16", "normuon_fp32")
CASES = [(mode, name) for mode in FLAGS for name in CONFIGS] + [("fsdp2", name) for name in FSDP2_CONFIGS]


def _model(config: OptimizerConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_gpt()
    return model.to(torch.bfloat16) if config.bf16 else model


def _held_after_one_step(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    tokens = torch.randint(32, (2, 9), generator=torch.Generator().manual_seed(7))
    held = {}
    for mode, name in CASES:
        config = CONFIGS[name]
        model = _model(config)
        if mode == "fsdp2":
            with preserve_param_attributes(model):
                for layer in model.decoder.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
        else:
            config = config.replace(**{FLAGS[mode]: True})
        optimizer = get_optimizer(config, model)
        model.loss(tokens).backward()  # the same batch on both ranks: the gradients agree, as after DDP
        success, _, _ = optimizer.step()
        assert success
        held[f"{mode}/{name}"] = held_bytes(optimizer, model)
    return held


@pytest.fixture(scope="module")
def measured() -> list[dict[str, dict[str, int]]]:
    return run_ranks(WORLD_SIZE, _held_after_one_step, timeout=300.0)


@pytest.mark.parametrize(("mode", "name"), CASES, ids=[f"{mode}-{name}" for mode, name in CASES])
def test_estimate_per_rank_is_what_each_rank_holds(mode: str, name: str, measured: list[dict[str, dict[str, int]]]) -> None:
    config = CONFIGS[name]
    with torch.device("meta"):
        model = _model(config)
    result = estimate(config, model, world_size=WORLD_SIZE, distributed=mode)  # type: ignore[arg-type]
    for rank in range(WORLD_SIZE):
        errors = relative_errors(estimated(result.ranks[rank]), measured[rank][f"{mode}/{name}"])
        assert max(errors.values()) <= TOLERANCE, (rank, errors, estimated(result.ranks[rank]), measured[rank][f"{mode}/{name}"])
    if mode == "layer_wise":  # each param's state is kept whole by one rank: the ranks' add up to one process's
        assert sum(r.state_bytes for r in result.ranks) == estimate(config, model).ranks[0].state_bytes
