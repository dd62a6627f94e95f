"""A new algorithm is treated from its registry record alone: routing, the planner, MuP, the CLI.

The record under test is a dummy matrix optimizer (2-D only, not element-wise, the Muon family,
its own cost) that no module outside the registry has ever heard of.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, get_mup_config_overrides, get_optimizer, resolve_group_configs
from optzoo.distributed import param_cost, plan_shards
from optzoo.optimizers.registry import (
    ELEMENTWISE_FLOPS_PER_ELEMENT, OptimizerSpec, Placement, get_spec, per_element_state, register, unregister,
)
from optzoo.reporting import optimizer_rows
from tests.conftest import tiny_gpt

NAME = "dummy_matrix"


def _cost(shape: tuple[int, ...], fields: Mapping[str, Any]) -> float:
    return 7.0 * math.prod(shape)


def _place(param: torch.Tensor, roles: frozenset[str], fields: Mapping[str, Any], explicit: bool) -> Placement:
    if param.dim() != 2:
        return "cannot"
    return "decline" if {"embedding", "output"} & roles and not explicit else "take"


@pytest.fixture
def dummy_matrix() -> Iterator[OptimizerSpec]:
    spec = OptimizerSpec(
        name=NAME,
        description="a 2-D-only test optimizer (plain SGD underneath)",
        source="optzoo",
        family="orthogonalized",
        elementwise=False,
        update_cost=_cost,
        shapes="2-D only",
        state_bytes=per_element_state(0),  # plain SGD without momentum keeps no state
        config_fields=("muon_scalar_optimizer",),
        instance_fields=(),
        group_options=lambda values: {},
        build=lambda groups, _: torch.optim.SGD(groups),
        place=_place,
        fallback_field="muon_scalar_optimizer",
        declines_what="embeddings/output layers",
    )
    register(spec)
    yield spec
    unregister(NAME)


def test_routing_hands_what_the_record_does_not_take_to_its_fallback(dummy_matrix: OptimizerSpec) -> None:
    model = tiny_gpt()
    groups, _ = resolve_group_configs(OptimizerConfig(lr=1e-3, optimizer=NAME), model, {})
    by_optimizer = {g.optimizer: g for g in groups if g.auto_routed is None}
    assert set(by_optimizer[NAME].param_names) == {
        name for name, p in model.named_parameters()
        if p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False) and name != "embedding.position_embeddings.weight"
    }  # the tags name the word embedding and the output layer; the position table is read by index (GPT's _Embedding.forward)
    reasons = sorted(g.auto_routed for g in groups if g.auto_routed)
    assert reasons == [
        "auto: dummy_matrix leaves embeddings/output layers -> muon_scalar_optimizer='adam'",
        "auto: dummy_matrix takes 2-D only -> muon_scalar_optimizer='adam'",
    ]


def test_the_planner_costs_it_by_its_record_and_never_cuts_its_params(dummy_matrix: OptimizerSpec) -> None:
    groups, _ = resolve_group_configs(OptimizerConfig(lr=1e-3, optimizer=NAME), tiny_gpt(), {})
    plan = plan_shards(groups, 2, "sharded")
    for group in groups:
        for routed, name in zip(group.params, group.param_names):
            shards = [s for s in plan.shards if s.name == name]
            if group.optimizer == NAME:
                assert len(shards) == 1 and shards[0].whole, name  # not element-wise: owned whole
                assert shards[0].cost == param_cost(group, routed.param) == 7.0 * routed.param.numel()
            else:
                assert sum(s.cost for s in shards) == ELEMENTWISE_FLOPS_PER_ELEMENT * routed.param.numel()


def test_mup_treats_it_as_the_muon_family(dummy_matrix: OptimizerSpec) -> None:
    config = OptimizerConfig(lr=1e-3)
    with pytest.warns(UserWarning, match=r"Muon-managed matrices keep Muon's own shape scaling"):
        ours = get_mup_config_overrides(config, 4.0, optimizer_type=NAME)
    with pytest.warns(UserWarning, match=r"Muon-managed matrices keep Muon's own shape scaling"):
        muon = get_mup_config_overrides(config, 4.0, optimizer_type="muon")
    assert ours == muon
    assert get_spec("muon").family == dummy_matrix.family


def test_it_builds_steps_and_is_listed(dummy_matrix: OptimizerSpec) -> None:
    model = tiny_gpt()
    opt = get_optimizer(OptimizerConfig(lr=1e-2, optimizer=NAME, weight_decay=0.0, clip_grad=0.0), model, {})
    assert [type(inner).__name__ for inner in opt.optimizers] == ["SGD", "AdamW"]
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    before = model.decoder.layers[0].mlp.linear_fc1.weight.detach().clone()
    assert opt.step()[0]
    torch.testing.assert_close(model.decoder.layers[0].mlp.linear_fc1.weight, before - 1e-2, atol=0, rtol=0)
    assert [row["name"] for row in optimizer_rows()][-1] == NAME


def test_unregister_an_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"^`optimizer`: unknown optimizer; got 'adamax'; expected one of \['adam', 'sgd', 'lion'"):
        unregister("adamax")
