"""Issue 15, item 7: ranks built with other settings fail fast, with a ValueError on every rank.

Each rank builds the same model; one rank differs in lr, clip_grad or fp16. The setup exchange
compares the resolved group configs and precision flags before any collective sized by the
params, under the distributed-optimizer flags and under FSDP2.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from optzoo import OptimizerConfig, get_optimizer
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.slow

CASES: dict[str, tuple[dict[str, Any], str]] = {
    "lr": ({"lr": 0.2}, r"param group #0 lr = 0\.2 on rank 1, 0\.1 on rank 0|param group #0 lr = 0\.1 on rank 0, 0\.2 on rank 1"),
    "clip_grad": ({"clip_grad": 0.5}, r"param group #0 clip_grad = 0\.5 on rank 1, 1\.0 on rank 0|clip_grad = 1\.0 on rank 0, 0\.5 on rank 1"),
    "fp16": ({"fp16": True}, r"param group #0 fp16 = True on rank 1, False on rank 0|fp16 = False on rank 0, True on rank 1"),
}


def _differing(rank: int, world: int, setup: str) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    outcomes = {}
    for case, (changes, _) in CASES.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        config = OptimizerConfig(**{"lr": 0.1, **(changes if rank == 1 else {})})
        if setup == "fsdp2":
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        else:
            config = config.replace(use_layer_wise_distributed_optimizer=True)
        try:
            get_optimizer(config, model, lint=False)
            outcomes[case] = "built"
        except ValueError as error:
            outcomes[case] = str(error)
    return outcomes


@pytest.mark.parametrize("setup", ["layer_wise", "fsdp2"])
def test_ranks_with_other_settings_raise_on_every_rank(setup: str) -> None:
    for rank, outcomes in enumerate(run_ranks(2, _differing, setup)):
        for case, (_, message) in CASES.items():
            assert re.match(r"^distributed optimizer: rank \d resolved other settings than rank \d; got ", outcomes[case]), (rank, case, outcomes[case])
            assert re.search(message, outcomes[case]), (rank, case, outcomes[case])
