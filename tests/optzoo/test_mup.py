"""get_mup_config_overrides: Megatron-Core's MuP rules, hand-computed on the tiny GPT, merged with
the standard overrides (and a recipe) through get_optimizer.

The widths are powers of two, so ``lr * (1 / m)`` is exact and the expected values are literals.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
from torch import nn

from optzoo.optimizers.registry import get_spec
from optzoo.routing import infer_roles
from optzoo import (
    OptimizerConfig,
    ParamKey,
    get_mup_config_overrides,
    get_optimizer,
    get_predicate,
    get_standard_config_overrides,
    load_recipe,
)
from optzoo.config_file import dump_recipe, parse_recipe, recipe_from_overrides
from tests.conftest import tiny_gpt

EMBED = "embedding.word_embeddings.weight"
POS = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
L = "decoder.layers.0."
MATRICES = [L + "self_attention.linear_qkv.weight", L + "self_attention.linear_proj.weight",
            L + "mlp.linear_fc1.weight", L + "mlp.linear_fc2.weight"]  # fmt: skip
VECTORS = [
    L + "input_layernorm.weight", L + "input_layernorm.bias", L + "self_attention.linear_qkv.bias",
    L + "self_attention.linear_proj.bias", L + "pre_mlp_layernorm.weight", L + "pre_mlp_layernorm.bias",
    L + "mlp.linear_fc1.bias", L + "mlp.linear_fc2.bias", "decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
]  # fmt: skip

DECOUPLED_WARNING = (
    "`get_mup_config_overrides`: decoupled_lr sets an absolute lr for the embedding and output params, which MuP "
    "leaves alone; got decoupled_lr={lr!r}; expected nothing else"
)
ADAM_EPS_NOTE = "; Adam eps scaling still applies to the hidden params, the output layer included"
SPECTRAL_WARNING = (
    "`get_mup_config_overrides`: Muon-managed matrices keep Muon's own shape scaling, not MuP's; got "
    "muon_scale_mode='spectral'; expected muon_scale_mode='unit_rms_norm' for MuP-consistent Muon updates"
)

HIDDEN = ParamKey(name="*", exclude=ParamKey(with_name_predicate=get_predicate("is_mup_vector_like")))  # type: ignore[arg-type]


@pytest.fixture
def model() -> nn.Module:
    return tiny_gpt(num_layers=1)


def groups(config: OptimizerConfig, model: nn.Module, overrides: Any) -> list[tuple[Any, ...]]:
    """(optimizer, lr, min_lr, eps or None, weight_decay, names) of every torch param group."""
    optimizer = get_optimizer(config, model, overrides, strict=True)
    return [
        (g["optimizer"], g["lr"], g["min_lr"], g.get("eps"), g["weight_decay"], g["param_names"])
        for g in optimizer.param_groups
    ]


def mup(config: OptimizerConfig, width: float, optimizer_type: str | None = None) -> dict[ParamKey, dict[str, Any]]:
    """The overrides, with the warnings they give checked by the caller when it cares."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_mup_config_overrides(config, width, optimizer_type)


# ---- Adam ---------------------------------------------------------------------------------


def test_adam_divides_hidden_lr_min_lr_and_eps_by_the_width(model: nn.Module) -> None:
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, adam_eps=1e-8, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no decoupled_lr, no Muon: nothing to warn about
        overrides = get_mup_config_overrides(config, 4.0)
    assert overrides == {HIDDEN: {"max_lr": 2.5e-4, "min_lr": 2.5e-5, "adam_eps": 2.5e-9}}
    assert groups(config, model, {**get_standard_config_overrides(config), **overrides}) == [
        ("adam", 1e-3, 1e-4, 1e-8, 0.1, [EMBED, POS]),
        ("adam", 1e-3, 1e-4, 1e-8, 0.0, VECTORS),
        ("adam", 2.5e-4, 2.5e-5, 2.5e-9, 0.1, [*MATRICES, OUTPUT]),
    ]


def test_adam_with_decoupled_lr_leaves_the_tagged_lr_alone_but_scales_the_output_eps(model: nn.Module) -> None:
    config = OptimizerConfig(lr=1e-3, min_lr=1e-4, decoupled_lr=5e-4, decoupled_min_lr=5e-5, adam_eps=1e-8, weight_decay=0.1)
    with pytest.warns(UserWarning) as caught:
        overrides = get_mup_config_overrides(config, 4.0)
    assert [str(w.message) for w in caught] == [DECOUPLED_WARNING.format(lr=5e-4) + ADAM_EPS_NOTE]
    tagged = ParamKey(name="*", exclude=ParamKey(
        attr="is_embedding_or_output_parameter", with_name_predicate=get_predicate("is_mup_vector_like"),  # type: ignore[arg-type]
        role=("embedding", "output"),
    ))  # fmt: skip
    assert overrides == {tagged: {"max_lr": 2.5e-4, "min_lr": 2.5e-5}, HIDDEN: {"adam_eps": 2.5e-9}}
    assert groups(config, model, {**get_standard_config_overrides(config), **overrides}) == [
        # decoupled, vector-like: no MuP change; the position table is an input table (read by
        # index), so decoupled_lr reaches it too (Megatron-Core: tagged params only)
        ("adam", 5e-4, 5e-5, 1e-8, 0.1, [EMBED, POS]),
        ("adam", 1e-3, 1e-4, 1e-8, 0.0, VECTORS),
        ("adam", 2.5e-4, 2.5e-5, 2.5e-9, 0.1, MATRICES),
        ("adam", 5e-4, 5e-5, 2.5e-9, 0.1, [OUTPUT]),  # decoupled lr, MuP eps
    ]


def test_the_lr_is_scaled_by_the_reciprocal_as_megatron_computes_it() -> None:
    config = OptimizerConfig(lr=1e-3, adam_eps=1e-8)
    assert mup(config, 3.0)[HIDDEN] == {"max_lr": 1e-3 * (1.0 / 3.0), "adam_eps": 1e-8 * (1.0 / 3.0)}


def test_an_unset_lr_leaves_only_the_eps_override() -> None:
    assert mup(OptimizerConfig(adam_eps=1e-8), 2.0) == {HIDDEN: {"adam_eps": 5e-9}}
    assert mup(OptimizerConfig(optimizer="lion"), 2.0) == {}
    assert mup(OptimizerConfig(optimizer="sgd"), 2.0) == {}


# ---- SGD and other optimizers -------------------------------------------------------------


def test_sgd_multiplies_the_vector_like_lr_by_the_width(model: nn.Module) -> None:
    config = OptimizerConfig(optimizer="sgd", lr=1e-2, min_lr=1e-3, weight_decay=0.0)
    overrides = mup(config, 4.0)
    vector_like = ParamKey(with_name_predicate=get_predicate("is_mup_vector_like"))  # type: ignore[arg-type]
    assert overrides == {vector_like: {"max_lr": 4e-2, "min_lr": 4e-3}}
    assert groups(config, model, {**get_standard_config_overrides(config), **overrides}) == [
        ("sgd", 1e-2, 1e-3, None, 0.0, [*MATRICES, OUTPUT]),
        ("sgd", 4e-2, 4e-3, None, 0.0, [EMBED, POS]),
        ("sgd", 4e-2, 4e-3, None, 0.0, VECTORS),  # its own group: wd_mult=0 from the standard overrides
    ]


def test_sgd_with_decoupled_lr_leaves_the_tagged_params_alone(model: nn.Module) -> None:
    config = OptimizerConfig(optimizer="sgd", lr=1e-2, decoupled_lr=5e-3, weight_decay=0.0)
    with pytest.warns(UserWarning) as caught:
        overrides = get_mup_config_overrides(config, 4.0)
    assert [str(w.message) for w in caught] == [DECOUPLED_WARNING.format(lr=5e-3)]
    assert groups(config, model, {**get_standard_config_overrides(config), **overrides}) == [
        ("sgd", 1e-2, None, None, 0.0, MATRICES),
        ("sgd", 5e-3, None, None, 0.0, [EMBED, POS, OUTPUT]),  # decoupled: every input table and head
        ("sgd", 4e-2, None, None, 0.0, VECTORS),
    ]


def test_lion_scales_the_hidden_lr_without_an_eps(model: nn.Module) -> None:
    config = OptimizerConfig(optimizer="lion", lr=1e-4, weight_decay=0.0)
    assert mup(config, 2.0) == {HIDDEN: {"max_lr": 5e-5}}
    assert [g[:2] + g[-1:] for g in groups(config, model, {**get_standard_config_overrides(config), **mup(config, 2.0)})] == [
        ("lion", 1e-4, [EMBED, POS]),
        ("lion", 1e-4, VECTORS),
        ("lion", 5e-5, [*MATRICES, OUTPUT]),
    ]


# ---- Muon ---------------------------------------------------------------------------------


def test_muon_leaves_the_matrices_it_manages_alone(model: nn.Module) -> None:
    config = OptimizerConfig(optimizer="muon", lr=2e-2, weight_decay=0.0, muon_scale_mode="unit_rms_norm")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unit_rms_norm: no spectral warning
        overrides = get_mup_config_overrides(config, 2.0)
    managed = ParamKey(name="*", exclude=ParamKey(
        predicate=get_predicate("is_muon_matrix"), with_name_predicate=get_predicate("is_mup_vector_like"),  # type: ignore[arg-type]
    ))  # fmt: skip
    assert overrides == {managed: {"max_lr": 1e-2}}  # no eps: Megatron scales eps for Adam only
    assert groups(config, model, {**get_standard_config_overrides(config), **overrides}) == [
        ("muon", 2e-2, None, None, 0.0, MATRICES),
        # auto: Muon leaves input tables to Adam, the untagged position table too (the forward
        # reads it by index); vector-like to MuP: base lr
        ("adam", 2e-2, None, 1e-8, 0.0, [EMBED, POS]),
        ("adam", 2e-2, None, 1e-8, 0.0, VECTORS),
        ("adam", 1e-2, None, 1e-8, 0.0, [OUTPUT]),  # hidden, not Muon's: lr / 2
    ]


def test_muon_llm_recipe_with_mup_as_muon(model: nn.Module) -> None:
    config, recipe = load_recipe("muon-llm")
    assert recipe is not None
    with pytest.warns(UserWarning) as caught:
        overrides = get_mup_config_overrides(config, 2.0, "muon")
    # The recipe's Moonlight scale is spectral's times 0.2: the same warning, naming it.
    assert [str(w.message) for w in caught] == [SPECTRAL_WARNING.replace("'spectral'", "'match_rms_adamw'")]
    assert [g[:2] + g[-1:] for g in groups(config, model, {**recipe, **overrides})] == [
        ("muon", 3e-4, MATRICES),  # Muon's own: no MuP lr
        ("adam", 3e-4, [EMBED, POS]),  # vector-like: base lr
        ("adam", 3e-4, VECTORS),
        ("adam", 1.5e-4, [OUTPUT]),  # hidden: lr / 2
    ]


def test_is_muon_matrix_agrees_with_the_muon_registry_record() -> None:
    """MuP's test of Muon's matrices (Megatron-Core's: tags and shape) is the registry's placement,
    except on the input tables and heads that only the forward finds (Megatron's untagged
    position table): the predicate sees a parameter alone, and MuP leaves those alone anyway
    (vector-like by name)."""
    model = tiny_gpt(qk_layernorm=True)
    model.decoder.layers[1].mlp.linear_fc1.weight.use_muon = False  # type: ignore[index, union-attr]
    spec, predicate = get_spec("muon"), get_predicate("is_muon_matrix")
    assert spec.place is not None
    fields = {name: getattr(OptimizerConfig(), name) for name in spec.config_fields}
    roles = infer_roles(model)
    differ = []
    for name, param in model.named_parameters():
        taken = spec.place(param, roles[id(param)].names, fields, False, roles[id(param)].view) == "take"
        if predicate(param) != taken:  # type: ignore[call-arg]
            differ.append(name)
    assert differ == [POS]
    assert get_predicate("is_mup_vector_like")(model.embedding.position_embeddings.weight, POS)  # type: ignore[call-arg]


# ---- keys, width 1 and errors --------------------------------------------------------------


def test_width_one_changes_nothing() -> None:
    assert get_mup_config_overrides(OptimizerConfig(lr=1e-3), 1.0) == {}
    assert get_mup_config_overrides(OptimizerConfig(lr=1e-3, optimizer="sgd"), 1) == {}


def test_the_keys_are_equal_across_calls_and_can_be_written_to_a_recipe() -> None:
    config = OptimizerConfig(lr=1e-3, decoupled_lr=1e-4)
    overrides = {**get_standard_config_overrides(config), **mup(config, 8.0)}
    assert mup(config, 8.0) == mup(config, 8.0)
    assert parse_recipe(dump_recipe(recipe_from_overrides(overrides, config))) == (config, overrides)


def test_optimizer_type_defaults_to_the_config_and_overrides_it() -> None:
    sgd = OptimizerConfig(optimizer="sgd", lr=1.0)
    assert mup(sgd, 2.0) == mup(sgd.replace(optimizer="adam"), 2.0, "sgd")
    assert mup(sgd, 2.0, "adam") == {HIDDEN: {"max_lr": 0.5, "adam_eps": 5e-9}}


@pytest.mark.parametrize(
    ("width", "optimizer_type", "message"),
    [
        (0.0, None, "`mup_width_mult`: must be a finite number > 0; got 0.0; expected hidden_size / base_hidden_size, e.g. 4.0"),
        (-2.0, None, "`mup_width_mult`: must be a finite number > 0; got -2.0; expected hidden_size / base_hidden_size, e.g. 4.0"),
        (float("inf"), None, "`mup_width_mult`: must be a finite number > 0; got inf; expected hidden_size / base_hidden_size, e.g. 4.0"),
        (True, None, "`mup_width_mult`: must be a finite number > 0; got True; expected hidden_size / base_hidden_size, e.g. 4.0"),
        (2.0, "adamw", ("`optimizer_type`: unknown optimizer; got 'adamw'; expected one of ['adam', 'sgd', 'lion', 'soap', "
                       "'muon', 'adaptive_muon', 'laprop', 'rekls', 'psgd_pro', 'oblique_sgd', 'oblique_adam']")),
    ],
)  # fmt: skip
def test_bad_arguments(width: Any, optimizer_type: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        get_mup_config_overrides(OptimizerConfig(lr=1e-3), width, optimizer_type)
