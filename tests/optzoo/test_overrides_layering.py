"""Issue 25 item 7: a user's ``config_overrides`` lie on top of the standard overrides.

By default (``OptimizerConfig.standard_overrides=True``) the standard overrides (no decay on
biases, norms and 1-D params; ``decoupled_lr`` on embeddings and the head) apply under an
explicit dict, whose rules win field by field. ``standard_overrides=False`` and
``get_megatron_optimizer`` keep Megatron-Core's meaning: an explicit dict alone (``None`` =
standard, ``{}`` = none). Expectations are written by hand from the built-in GPT's names.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from optzoo import (
    OptimizerConfig,
    ParamKey,
    get_megatron_optimizer,
    get_optimizer,
    get_standard_config_overrides,
    lint_routing,
    parse_recipe,
    resolve_group_configs,
)
from tests.conftest import tiny_gpt

BASE = OptimizerConfig(lr=1e-3, weight_decay=0.1)
MATRIX = "decoder.layers.0.mlp.linear_fc1.weight"
BIAS = "decoder.layers.0.mlp.linear_fc1.bias"
NORM = "decoder.layers.0.input_layernorm.weight"
HEAD = "output_layer.weight"
EMBED = "embedding.word_embeddings.weight"


def _decay(optimizer: torch.optim.Optimizer, name: str) -> float:
    return float(next(g for g in optimizer.param_groups if name in g["param_names"])["weight_decay"])


def _lr(optimizer: torch.optim.Optimizer, name: str) -> float:
    return float(next(g for g in optimizer.param_groups if name in g["param_names"])["lr"])


def test_a_users_rule_keeps_the_standard_no_decay_rule() -> None:
    optimizer = get_optimizer(BASE, tiny_gpt(), {ParamKey(name=HEAD): {"lr": 5e-4}})
    assert (_decay(optimizer, BIAS), _decay(optimizer, NORM), _decay(optimizer, MATRIX)) == (0.0, 0.0, 0.1)
    assert (_lr(optimizer, HEAD), _lr(optimizer, MATRIX)) == (5e-4, 1e-3)


def test_empty_dict_is_the_standard_overrides_by_default() -> None:
    def groups(overrides: object) -> list[tuple[float, list[str]]]:
        optimizer = get_optimizer(BASE, tiny_gpt(), overrides)  # type: ignore[arg-type]
        return [(g["weight_decay"], g["param_names"]) for g in optimizer.param_groups]

    assert groups({}) == groups(None)
    assert len(groups({})) == 2


def test_a_users_field_wins_over_the_standard_one_without_conflict() -> None:
    optimizer = get_optimizer(BASE, tiny_gpt(), {ParamKey(name="*.bias"): {"wd_mult": 1.0}})
    assert (_decay(optimizer, BIAS), _decay(optimizer, NORM)) == (0.1, 0.0)


def test_a_users_weight_decay_replaces_the_standard_multiplier() -> None:
    """``weight_decay`` and ``wd_mult`` say one thing: the user's decay is not zeroed by the
    standard ``wd_mult = 0`` (issue 25: user rules on top)."""
    optimizer = get_optimizer(BASE, tiny_gpt(), {ParamKey(name="*layernorm.weight"): {"weight_decay": 0.2}})
    assert (_decay(optimizer, NORM), _decay(optimizer, BIAS)) == (0.2, 0.0)


def test_a_users_lr_replaces_decoupled_lr_for_its_params_only() -> None:
    config = BASE.replace(decoupled_lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "decoupled_lr has no effect": it acts
        optimizer = get_optimizer(config, tiny_gpt(), {ParamKey(name=HEAD): {"lr": 5e-4}}, lint=False)
    assert (_lr(optimizer, HEAD), _lr(optimizer, EMBED), _lr(optimizer, MATRIX)) == (5e-4, 1e-4, 1e-3)


def test_the_old_idiom_gives_the_same_groups() -> None:
    mine = {ParamKey(name=HEAD): {"lr": 5e-4}}
    layered = get_optimizer(BASE, tiny_gpt(), mine)
    merged = get_optimizer(BASE, tiny_gpt(), {**get_standard_config_overrides(BASE), **mine})
    assert [(g["lr"], g["weight_decay"], g["param_names"]) for g in layered.param_groups] == [
        (g["lr"], g["weight_decay"], g["param_names"]) for g in merged.param_groups
    ]


def test_two_user_rules_still_conflict() -> None:
    overrides = {ParamKey(name="*.bias"): {"wd_mult": 1.0}, ParamKey(name="decoder.*"): {"wd_mult": 0.5}}
    with pytest.raises(ValueError, match=r"conflicting values for field `wd_mult` from rule #0 name='\*\.bias' \(wd_mult=1\.0\) and rule #1"):
        get_optimizer(BASE, tiny_gpt(), overrides)


def test_standard_overrides_false_is_megatrons_meaning() -> None:
    alone = BASE.replace(standard_overrides=False)
    optimizer = get_optimizer(alone, tiny_gpt(), {ParamKey(name=HEAD): {"lr": 5e-4}}, lint=False)
    assert (_decay(optimizer, BIAS), _decay(optimizer, NORM)) == (0.1, 0.1)
    assert len(get_optimizer(alone, tiny_gpt(), {}, lint=False).param_groups) == 1
    assert _decay(get_optimizer(alone, tiny_gpt(), None), BIAS) == 0.0  # None: the standard overrides


@pytest.mark.parametrize("standard_overrides", [True, False])
def test_get_megatron_optimizer_keeps_megatrons_meaning_whatever_the_config(standard_overrides: bool) -> None:
    config = BASE.replace(standard_overrides=standard_overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the linter says the biases are decayed: that is the point
        alone = get_megatron_optimizer(config, tiny_gpt(), {ParamKey(name=HEAD): {"lr": 5e-4}})
        nothing = get_megatron_optimizer(config, tiny_gpt(), {})
    assert (_decay(alone, BIAS), _decay(alone, NORM), _lr(alone, HEAD)) == (0.1, 0.1, 5e-4)
    assert len(nothing.param_groups) == 1
    standard = get_megatron_optimizer(config, tiny_gpt())
    assert (_decay(standard, BIAS), _decay(standard, NORM), _decay(standard, MATRIX)) == (0.0, 0.0, 0.1)


def test_get_megatron_optimizer_refuses_a_non_bool_gloo_flag() -> None:
    with pytest.raises(TypeError, match=r"`use_gloo_process_groups`: must be a bool; got 'yes'; expected True or False"):
        get_megatron_optimizer(BASE, tiny_gpt(), None, "yes")  # type: ignore[arg-type]


def test_the_linter_says_which_applies() -> None:
    mine = {ParamKey(name="*.bias"): {"wd_mult": 1.0}}
    layered = lint_routing(*resolve_group_configs(BASE, tiny_gpt(), mine))
    assert [f.kind for f in layered] == ["decayed-vector"]
    assert "the standard overrides lie under your rules, which win field by field (standard_overrides=True)" in layered[0].message
    alone = lint_routing(*resolve_group_configs(BASE.replace(standard_overrides=False), tiny_gpt(), {}))
    assert [f.kind for f in alone] == ["decayed-vector"]
    assert (
        "the standard overrides are off: config_overrides is used alone (standard_overrides=False, Megatron-Core's "
        "meaning); standard_overrides=True lays them under your rules" in alone[0].message
    )
    # Its fix, applied, holds under the same meaning.
    assert lint_routing(*resolve_group_configs(BASE, tiny_gpt(), {})) == []


def test_a_recipe_can_ask_for_megatrons_meaning() -> None:
    config, overrides = parse_recipe(
        '[config]\nlr = 1e-3\nweight_decay = 0.1\nstandard_overrides = false\n'
        '[[overrides]]\nname = "output_layer.weight"\nset = { lr = 5e-4 }\n'
    )
    optimizer = get_optimizer(config, tiny_gpt(), overrides, lint=False)
    assert (_decay(optimizer, BIAS), _lr(optimizer, HEAD)) == (0.1, 5e-4)
