"""Telemetry on 2 gloo ranks reports what one process reports (``log_metrics="per_param"``).

FSDP2: a tiny GPT sharded per layer, each rank feeding half of one global batch (FSDP averages the
gradients); the reference is one process on the whole batch with the mean loss, so gradients agree
to float32 rounding (~2e-7 relative, tests/distributed/test_fsdp2.py). Owner-computes and the
redundant path are both run: under the first only one rank orthogonalises a group's sampled matrix.
The layer-wise and sharded (ZeRO-1) distributed optimizers (each rank stepping its own params, or
element ranges of Adam's) run on the whole batch on both ranks; their counts and sums add up over the ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer, metrics_to_floats
from optzoo.distributed import preserve_param_attributes
from optzoo.models import GPT
from tests.conftest import tiny_gpt
from tests.distributed.harness import one_thread, run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
STEPS = 2
BATCH = 4
BASE = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, optimizer="muon", log_metrics="per_param")
FSDP_CONFIGS = {
    "owner": BASE.replace(muon_fsdp_orthogonalize="owner"),
    "redundant": BASE.replace(muon_fsdp_orthogonalize="redundant"),
    "adam": BASE.replace(optimizer="adam"),
}
DISTRIBUTED = {
    "layer_wise": BASE.replace(use_layer_wise_distributed_optimizer=True),
    # ZeRO-1: Adam's params cut into element ranges across the ranks (a param's sums add its parts)
    "sharded": BASE.replace(use_distributed_optimizer=True),
}
# Sums of float32 gradients reduced in another order (~2e-7 relative) through 2 steps of Muon,
# whose Newton-Schulz amplifies input differences a little: measured below 3e-6 relative.
RTOL = 2e-5


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(32, (BATCH, 9), generator=generator) for _ in range(STEPS)]


def _model() -> GPT:
    """Without the attention's QKV bias: its key part's gradient is 0 up to rounding (softmax ignores
    a per-query constant), which Adam normalises to ±lr in either run's own direction."""
    torch.manual_seed(0)
    model = tiny_gpt()
    for layer in model.decoder.layers:
        layer.self_attention.linear_qkv.bias.requires_grad_(False)
    return model


def _train(model: GPT, config: OptimizerConfig, rows: slice) -> list[dict[str, float]]:
    opt = get_optimizer(config, model)
    seen = []
    for batch in _batches():
        opt.zero_grad()
        model.loss(batch[rows]).backward()
        ok, _, _ = opt.step()
        assert ok
        seen.append(metrics_to_floats(opt.metrics()))
    return seen


def _ranks(rank: int, world_size: int) -> dict[str, list[dict[str, float]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    share = BATCH // world_size
    out = {}
    for name, config in FSDP_CONFIGS.items():
        model = _model()
        with preserve_param_attributes(model):
            for layer in model.decoder.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        out[name] = _train(model, config, slice(rank * share, (rank + 1) * share))
    for name, config in DISTRIBUTED.items():
        out[name] = _train(_model(), config, slice(None))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, list[dict[str, float]]]]:
    return run_ranks(WORLD_SIZE, _ranks)


@pytest.fixture(scope="module")
def single() -> dict[str, list[dict[str, float]]]:
    with one_thread():
        out = {name: _train(_model(), config, slice(None)) for name, config in FSDP_CONFIGS.items()}
        reference = _train(_model(), BASE, slice(None))
    return {**out, **dict.fromkeys(DISTRIBUTED, reference)}


@pytest.mark.parametrize("name", [*FSDP_CONFIGS, *DISTRIBUTED])
def test_two_ranks_report_the_single_process_metrics(
    name: str, ranks: list[dict[str, list[dict[str, float]]]], single: dict[str, list[dict[str, float]]]
) -> None:
    for rank, got in enumerate(ranks):
        for step, (metrics, expected) in enumerate(zip(got[name], single[name], strict=True)):
            assert set(metrics) == set(expected), (rank, step)
            for key, value in expected.items():
                assert metrics[key] == pytest.approx(value, rel=RTOL, abs=1e-9, nan_ok=True), (rank, step, key)
    if name != "adam":
        assert single[name][0]["muon/0/orthogonalized"] == 8.0  # tiny GPT: 2 layers x (qkv, proj, fc1, fc2)
