"""Muon's default routing graded against categories written by hand from each model's source.

``tests/integrations/hand_graded.py`` (40 model classes: encoders with task heads, encoder-decoders,
vision, audio, SSM and hybrid, MoE, multimodal) and ``hand_graded_llms.py`` (19 causal LMs, by
config class) hold the category of every trainable parameter, read from the ``transformers``
forwards (not from optzoo). Each model
is built tiny on the meta device and routed with ``OptimizerConfig(optimizer="muon")`` and the
standard overrides; a category fixes the placement:

* ``hidden``: Muon, decayed; ``head``: AdamW, decayed; ``elementwise``: AdamW, no decay;
* ``table``, ``depthwise``: AdamW (whether a table is decayed is a recipe's choice, not its use);
* ``unused``: the forward never reaches it, so its roles must say they are guessed.

``BLOCKS`` gives the matrices the forward multiplies a parameter by: Muon must step exactly those.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from optzoo import MatrixView, OptimizerConfig, resolve_group_configs
from optzoo.groups import ResolvedGroup
from optzoo.hf import build_hf_model
from optzoo.routing import RoutedParam
from tests.integrations import hand_graded, hand_graded_llms

EXPECTED = {**hand_graded.EXPECTED, **hand_graded_llms.EXPECTED}
BLOCKS = {**hand_graded.BLOCKS, **hand_graded_llms.BLOCKS}

MUON = OptimizerConfig(optimizer="muon", lr=1e-3, weight_decay=0.1)
PLACEMENT: dict[str, tuple[str, float | None]] = {
    "hidden": ("muon", 0.1), "head": ("adam", 0.1), "elementwise": ("adam", 0.0), "table": ("adam", None), "depthwise": ("adam", None),
}  # fmt: skip
"""Category -> (optimizer, weight decay; ``None``: either)."""


def _route(name: str) -> tuple[nn.Module, list[ResolvedGroup]]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notes on tiny configs
        with torch.device("meta"):
            model = build_hf_model(name)
        groups, _ = resolve_group_configs(MUON, model)
    return model, groups


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_parameter_is_placed_as_its_use_says(name: str) -> None:
    model, groups = _route(name)
    where: dict[str, tuple[ResolvedGroup, RoutedParam]] = {
        n: (g, routed) for g in groups for routed, names in zip(g.params, g.all_names) for n in names
    }
    wrong = []
    for param_name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            continue
        categories = [category for pattern, category in EXPECTED[name] if re.fullmatch(pattern, param_name)]
        assert len(categories) == 1, (param_name, categories)
        group, routed = where[param_name]
        if categories[0] == "unused":
            if not routed.roles.guessed:
                wrong.append((param_name, "unused, yet its roles are not marked guessed", routed.roles.describe()))
            continue
        optimizer, decay = PLACEMENT[categories[0]]
        if group.optimizer != optimizer or (decay is not None and group.weight_decay != decay):
            wrong.append((param_name, categories[0], (group.optimizer, group.weight_decay), routed.roles.describe()))
    assert wrong == [], wrong[:5]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BLOCKS))
def test_muon_steps_the_blocks_the_forward_multiplies_by(name: str) -> None:
    model, groups = _route(name)
    named = dict(model.named_parameters())
    for pattern, expected in BLOCKS[name]:
        matched = [n for n in named if re.fullmatch(pattern, n)]
        assert matched, pattern
        for param_name in matched:
            group = next(g for g in groups if param_name in g.param_names)
            assert group.optimizer == "muon", param_name
            param = named[param_name]
            view = group.matrix_view_of(param) or MatrixView.default(tuple(param.shape), flatten=group.flatten)
            assert (view.count, *view.shape) == expected, (param_name, view.describe())
