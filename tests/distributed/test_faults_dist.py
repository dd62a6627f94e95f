"""Issue 24 ("Nothing lost under faults"), distributed items, on 2 real gloo ranks.

Item 9: a layer-wise owner steps a non-contiguous param (transposed, or with gaps), then every
rank must get it: the params equal one process's bit for bit (Adam is element-wise; each element
is stepped by one rank with the same arithmetic as the single process).
Item 11: ranks built with other get_optimizer arguments that change the collectives (param_sync,
the expert data-parallel group) raise a ValueError on every rank naming the setting and both
ranks' values, instead of hanging until the collective timeout.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optzoo import OptimizerConfig, get_optimizer
from tests.distributed.harness import one_thread, run_ranks

pytestmark = pytest.mark.slow

LAYER_WISE = {"optimizer": "adam", "lr": 1e-2, "weight_decay": 0.1, "use_layer_wise_distributed_optimizer": True}


class OddLayouts(nn.Module):
    """Params whose memory ``view(-1)`` cannot flatten: a transpose, and a column slice with gaps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transposed = nn.Parameter(torch.randn(5, 7).t())  # (7, 5), strides (1, 7)
        self.gapped = nn.Parameter(torch.randn(6, 8)[:, ::2])  # (6, 4), strides (8, 2)
        self.dense = nn.Parameter(torch.randn(4, 3))


def odd_steps(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Two steps on the same grads on every rank (``world == 0``: one process, no flag)."""
    model = OddLayouts()
    assert not model.transposed.is_contiguous() and not model.gapped.is_contiguous()
    config = OptimizerConfig(**{**LAYER_WISE, "use_layer_wise_distributed_optimizer": world > 0, "standard_overrides": False})  # {}: no rules
    optimizer = get_optimizer(config, model, {}, lint=False, trace=False)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    assert model.transposed.stride() == (1, 7) and model.gapped.stride() == (8, 2)  # the layouts are kept
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def test_layer_wise_syncs_transposed_and_gapped_params_as_one_process() -> None:
    with one_thread():
        expected = odd_steps(0, 0)
    for got in run_ranks(2, odd_steps):
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


def differing(rank: int, world: int, case: str) -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    kwargs: dict[str, Any] = {}
    if case == "param_sync":
        kwargs["param_sync"] = "broadcast" if rank == 1 else "all_gather"
    elif case == "expert_group":
        model[1].weight.allreduce = False  # type: ignore[union-attr]  # Megatron's expert tag
        singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
        kwargs["expert_process_group"] = singles[rank] if rank == 0 else None
    try:
        get_optimizer(OptimizerConfig(**LAYER_WISE), model, lint=False, **kwargs)
    except ValueError as error:
        return str(error)
    return "built"


@pytest.mark.parametrize(
    ("case", "setting"),
    [
        ("param_sync", r"param_sync = '(broadcast|all_gather)' on rank \d, '(all_gather|broadcast)' on rank \d"),
        ("expert_group", r"expert data-parallel group size = (None|1) on rank \d, (1|None) on rank \d"),
    ],
)
def test_ranks_with_other_collective_arguments_raise_on_every_rank(case: str, setting: str) -> None:
    messages = run_ranks(2, differing, case, timeout=120)
    for rank, message in enumerate(messages):
        other = 1 - rank
        assert message.startswith(f"distributed optimizer: rank {other} resolved other settings than rank {rank}; got "), message
        assert re.search(setting, message), message


def overlapping_expert_groups(rank: int, world: int) -> str:
    """Ranks 0 and 1 share the expert group [0, 1]; rank 2 takes [2, 3] but rank 3 takes [0, 3]."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight.allreduce = False  # type: ignore[union-attr]
    groups = {members: dist.new_group(list(members)) for members in ((0, 1), (2, 3), (0, 3))}  # every rank makes each
    mine = groups[((0, 1), (0, 1), (2, 3), (0, 3))[rank]]
    try:
        get_optimizer(OptimizerConfig(**LAYER_WISE), model, lint=False, expert_process_group=mine)
    except ValueError as error:
        return str(error)
    return "built"


def test_expert_groups_that_do_not_partition_the_ranks_raise_on_every_rank() -> None:
    expected = (
        "distributed optimizer: rank 3 resolved other settings than rank 2; got expert data-parallel group ranks = "
        "[0, 3] on rank 3, [2, 3] on rank 2; expected the same config"
    )
    for message in run_ranks(4, overlapping_expert_groups, timeout=150):
        assert message.startswith(expected), message
