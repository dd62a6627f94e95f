"""Routing recipes: the predicate registry, ParamKey.exclude, recipe round trips, shipped recipes.

Membership is asserted by name on the built-in GPT (Megatron's names); error tests match the
whole message.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from optzoo import OptimizerConfig, get_optimizer, get_standard_config_overrides
from optzoo.cli import main
from optzoo.config_file import (
    dump_recipe,
    load_config_file,
    load_recipe,
    parse_recipe,
    recipe_from_overrides,
    shipped_recipes,
)
from optzoo.groups import resolve_group_configs
from optzoo.optimizers.registry import get_spec
from optzoo.routing import (
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    get_predicate,
    key_from_entry,
    key_to_entry,
    overrides_from_entries,
    predicate_spec,
    register_predicate,
    registered_predicates,
    resolve_param_groups,
    standard_overrides,
    unregister_predicate,
)
from optzoo.routing import predicates as predicates_module
from tests.conftest import tiny_gpt

import yaml  # the test extra has PyYAML: a missing one fails here rather than skipping YAML tests

BUILTINS = [
    "is_1d", "is_2d_matrix", "is_bias", "is_norm", "is_qk_layernorm", "is_embedding_or_output",
    "is_1d_or_bias_not_qk_layernorm", "is_mup_vector_like", "is_muon_matrix",
]  # fmt: skip

# The one-layer GPT with q/k layernorms: every kind of parameter, under Megatron's names.
EMBED = "embedding.word_embeddings.weight"
POS = "embedding.position_embeddings.weight"
OUTPUT = "output_layer.weight"
L = "decoder.layers.0."
IN_NORM = [L + "input_layernorm.weight", L + "input_layernorm.bias"]
QKV = [L + "self_attention.linear_qkv.weight", L + "self_attention.linear_qkv.bias"]
PROJ = [L + "self_attention.linear_proj.weight", L + "self_attention.linear_proj.bias"]
QK_NORM = [
    L + "self_attention.q_layernorm.weight", L + "self_attention.q_layernorm.bias",
    L + "self_attention.k_layernorm.weight", L + "self_attention.k_layernorm.bias",
]  # fmt: skip
MLP_NORM = [L + "pre_mlp_layernorm.weight", L + "pre_mlp_layernorm.bias"]
FC1 = [L + "mlp.linear_fc1.weight", L + "mlp.linear_fc1.bias"]
FC2 = [L + "mlp.linear_fc2.weight", L + "mlp.linear_fc2.bias"]
FINAL_NORM = ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
ALL = [EMBED, POS, *IN_NORM, *QKV, *PROJ, *QK_NORM, *MLP_NORM, *FC1, *FC2, *FINAL_NORM, OUTPUT]
HIDDEN_MATRICES = [QKV[0], PROJ[0], FC1[0], FC2[0]]
BIASES = [QKV[1], PROJ[1], FC1[1], FC2[1]]
NORMS = [*IN_NORM, *QK_NORM, *MLP_NORM, *FINAL_NORM]


def ordered(names: list[str]) -> list[str]:
    """``names`` in model order."""
    return [n for n in ALL if n in names]


@pytest.fixture
def model() -> nn.Module:
    return tiny_gpt(qk_layernorm=True, num_layers=1)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Registrations made by a test are undone after it."""
    monkeypatch.setattr(predicates_module, "_REGISTRY", dict(predicates_module._REGISTRY))
    yield


def selected(key: ParamKey, model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if key.matches(param, name)]


# ---- the registry ------------------------------------------------------------------------


def test_builtin_predicates_are_registered_in_order_with_a_description() -> None:
    assert registered_predicates() == BUILTINS
    for name in BUILTINS:
        spec = predicate_spec(name)
        assert spec.name == spec.predicate.name == name
        assert spec.description


@pytest.mark.parametrize(
    ("name", "kind", "expected"),
    [
        ("is_1d", ParamPredicate, [*BIASES, *NORMS]),
        ("is_2d_matrix", ParamPredicate, [EMBED, POS, *HIDDEN_MATRICES, OUTPUT]),
        ("is_bias", ParamWithNamePredicate, [*BIASES, *(n for n in NORMS if n.endswith(".bias"))]),
        ("is_norm", ParamWithNamePredicate, NORMS),
        ("is_qk_layernorm", ParamWithNamePredicate, QK_NORM),
        ("is_embedding_or_output", ParamWithNamePredicate, [EMBED, POS, OUTPUT]),
        ("is_1d_or_bias_not_qk_layernorm", ParamWithNamePredicate, [*BIASES, *IN_NORM, *MLP_NORM, *FINAL_NORM]),
        ("is_mup_vector_like", ParamWithNamePredicate, [EMBED, POS, *BIASES, *NORMS]),
        ("is_muon_matrix", ParamPredicate, [POS, *HIDDEN_MATRICES]),
    ],
)
def test_each_builtin_predicate_selects_exactly_these_gpt_params(
    name: str, kind: type, expected: list[str], model: nn.Module
) -> None:
    predicate = get_predicate(name)
    assert type(predicate) is kind
    field = "predicate" if kind is ParamPredicate else "with_name_predicate"
    assert selected(ParamKey(**{field: predicate}), model) == ordered(expected)


@pytest.mark.parametrize(
    ("name", "param_name", "shape", "attrs", "expected"),
    [
        ("is_bias", "bias", (3,), {}, True),  # a top-level module's own bias
        ("is_bias", "layers.0.bias_proj.weight", (3,), {}, False),
        ("is_norm", "model.norm.weight", (3,), {}, True),  # Llama
        ("is_norm", "h.0.ln_1.weight", (3,), {}, True),  # GPT-2
        ("is_norm", "ln_f.bias", (3,), {}, True),
        ("is_norm", "encoder.LayerNorm.weight", (3,), {}, True),  # BERT
        ("is_norm", "layers.0.normal_proj.weight", (3, 3), {}, False),  # "norm" in a 2-D matrix's owner
        ("is_norm", "weight", (3,), {}, False),  # no owning module
        ("is_qk_layernorm", "attn.q_norm.weight", (3,), {"is_qk_layernorm": True}, True),  # Megatron-Bridge's tag
        ("is_qk_layernorm", "attn.q_norm.weight", (3,), {}, False),
        ("is_embedding_or_output", "lm_head.weight", (3, 3), {}, False),  # untagged: needs the attribute
        ("is_embedding_or_output", "lm_head.weight", (3, 3), {"is_embedding_or_output_parameter": True}, True),
        ("is_embedding_or_output", "embed_tokens.weight", (3, 3), {"shared_embedding": True}, True),
        ("is_embedding_or_output", "embedding.weight", (3, 3), {"is_embedding_parameter": False}, False),
        ("is_mup_vector_like", "scale", (), {}, True),  # 0-D
        ("is_muon_matrix", "w", (3, 3), {"use_muon": False}, False),
        ("is_muon_matrix", "w", (3, 3, 3), {}, False),
    ],
)
def test_builtin_predicate_edge_cases(
    name: str, param_name: str, shape: tuple[int, ...], attrs: dict[str, Any], expected: bool
) -> None:
    param = nn.Parameter(torch.empty(shape))
    for attr, value in attrs.items():
        setattr(param, attr, value)
    predicate = get_predicate(name)
    result = predicate(param, param_name) if isinstance(predicate, ParamWithNamePredicate) else predicate(param)
    assert result is expected


def test_register_predicate_infers_the_kind_from_the_signature(registry: None) -> None:
    plain = register_predicate("wide", lambda p: p.shape[-1] > 16, description="last dim > 16")
    named = register_predicate("in_mlp", lambda p, n: ".mlp." in n)
    assert type(plain) is ParamPredicate and plain.name == "wide"
    assert type(named) is ParamWithNamePredicate and named.name == "in_mlp"
    assert get_predicate("wide") is plain and get_predicate("in_mlp") is named
    assert registered_predicates() == [*BUILTINS, "wide", "in_mlp"]
    assert predicate_spec("wide").description == "last dim > 16"
    assert predicate_spec("in_mlp").description == ""


def test_register_predicate_as_a_decorator_takes_the_docstring_as_description(
    registry: None, model: nn.Module
) -> None:
    @register_predicate("is_fc1")
    def is_fc1(param: torch.Tensor, name: str) -> bool:
        """The first MLP matrix, by name."""
        return ".linear_fc1." in name

    assert isinstance(is_fc1, ParamWithNamePredicate)
    assert predicate_spec("is_fc1").description == "The first MLP matrix, by name."
    assert selected(ParamKey(with_name_predicate=is_fc1), model) == FC1


def test_register_predicate_takes_a_ready_predicate_and_an_explicit_kind(registry: None) -> None:
    ready = ParamPredicate(name="ready", fn=lambda p: True)
    assert register_predicate("ready", ready) is ready
    forced = register_predicate("forced", lambda *args: True, takes_name=True)
    assert isinstance(forced, ParamWithNamePredicate)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: register_predicate("is_1d", lambda p: True), ValueError,
         (f"`register_predicate`: predicate already registered; got 'is_1d' a second time; "
         f"expected a new name (registered: {BUILTINS})")),
        (lambda: register_predicate("", lambda p: True), ValueError,
         "`register_predicate`: invalid name; got ''; expected a non-empty string without surrounding whitespace"),
        (lambda: register_predicate("x", ParamPredicate(name="y", fn=lambda p: True)), ValueError,
         ("`register_predicate`: the predicate's own name differs from the registered name; got 'y' registered "
         "as 'x'; expected the same name (keys compare predicates by name)")),
        (lambda: register_predicate("x", ParamPredicate(name="x", fn=lambda p: True), takes_name=True), ValueError,
         ("`register_predicate('x')`: takes_name=True contradicts the predicate's kind; got a ParamPredicate; "
         "expected takes_name=None")),
        (lambda: register_predicate("x", lambda *args: True), TypeError,
         ("`register_predicate('x')`: cannot tell whether fn takes the name; got a callable with an unknown "
         "number of required positional arguments; expected fn(param) or fn(param, name), or pass takes_name=True/False")),
        (lambda: register_predicate("x", lambda a, b, c: True), TypeError,
         ("`register_predicate('x')`: cannot tell whether fn takes the name; got a callable with 3 required "
         "positional arguments; expected fn(param) or fn(param, name), or pass takes_name=True/False")),
        (lambda: register_predicate("x", 3), TypeError,  # type: ignore[call-overload]
         "`register_predicate('x')`: fn must be callable; got 3 (int); expected fn(param) or fn(param, name)"),
        (lambda: get_predicate("is_1D"), ValueError,
         (f"`predicate`: unknown predicate; got 'is_1D'; expected one of {BUILTINS} "
         "(register_predicate(name, fn) adds one); did you mean 'is_1d'?")),  # issue 25: the close match
        (lambda: unregister_predicate("is_1d"), ValueError,
         (f"`unregister_predicate`: built-in predicates cannot be removed; got 'is_1d'; expected one you "
         f"registered (built-in: {BUILTINS})")),
        (lambda: unregister_predicate("nope"), ValueError,
         f"`predicate`: unknown predicate; got 'nope'; expected one of {BUILTINS} (register_predicate(name, fn) adds one)"),
    ],
)  # fmt: skip
def test_registry_errors(registry: None, call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        call()


def test_unregister_predicate_frees_the_name(registry: None) -> None:
    register_predicate("tmp", lambda p: True)
    unregister_predicate("tmp")
    assert "tmp" not in registered_predicates()
    register_predicate("tmp", lambda p, n: True)


# ---- ParamKey.exclude --------------------------------------------------------------------


def test_exclude_takes_matches_out_and_keeps_the_rest(model: nn.Module) -> None:
    hidden = ParamKey(
        predicate=get_predicate("is_2d_matrix"),  # type: ignore[arg-type]
        exclude=ParamKey(with_name_predicate=get_predicate("is_embedding_or_output")),  # type: ignore[arg-type]
    )
    assert selected(hidden, model) == HIDDEN_MATRICES
    # Any include field AND no exclude field: an exclude of several fields is an OR too.
    key = ParamKey(name="*.bias", attr="is_embedding_or_output_parameter", exclude=ParamKey(name="*.mlp.*", attr="no_such"))
    assert selected(key, model) == ordered([EMBED, *IN_NORM[1:], QKV[1], PROJ[1], *QK_NORM[1::2], MLP_NORM[1], FINAL_NORM[1], OUTPUT])


def test_a_key_with_only_an_exclude_matches_nothing(model: nn.Module) -> None:
    assert selected(ParamKey(exclude=ParamKey(name="*.bias")), model) == []


def test_exclude_is_part_of_equality_hash_and_description() -> None:
    a = ParamKey(name="*", exclude=ParamKey(name="*.bias"))
    assert a == ParamKey(name="*", exclude=ParamKey(name="*.bias"))
    assert hash(a) == hash(ParamKey(name="*", exclude=ParamKey(name="*.bias")))
    assert a != ParamKey(name="*") and a != ParamKey(name="*", exclude=ParamKey(name="*.weight"))
    assert a.describe() == "name='*', exclude=(name='*.bias')"
    assert ParamKey(name="*").exclude is None


def test_a_tied_tensor_is_excluded_when_any_of_its_names_is() -> None:
    tied = tiny_gpt(tie_embeddings=True)
    routing = resolve_param_groups(tied, {ParamKey(name="*.weight", exclude=ParamKey(name="output_layer.*")): {"lr": 1.0}})
    marked = [name for g in routing.groups if g.override for p in g.params for name in p.names]
    assert EMBED not in marked and OUTPUT not in marked
    # Included under any name: the tensor's second name alone selects it.
    routing = resolve_param_groups(tied, {ParamKey(name="output_layer.*"): {"lr": 1.0}})
    assert [g.names for g in routing.groups if g.override] == [[EMBED]]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"exclude": "*.bias"}, TypeError,
         ("`ParamKey.exclude`: must be a ParamKey or None; got '*.bias' (str); "
         "expected e.g. ParamKey(attr='is_embedding_or_output_parameter')")),
        ({"exclude": ParamKey(name="a", exclude=ParamKey(name="b"))}, ValueError,
         ("`ParamKey.exclude`: must not have an exclude of its own; got name='a', exclude=(name='b'); "
         "expected a key with name, attr, predicate, with_name_predicate or role only")),
        ({"exclude": ParamKey()}, ValueError,
         "`ParamKey.exclude`: excludes nothing; got ParamKey(); expected a key with at least one field set, or exclude=None"),
    ],
)  # fmt: skip
def test_bad_exclude(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ParamKey(name="*", **kwargs)


def _field_values(options: list[Any]) -> st.SearchStrategy[Any]:
    """Nothing, one value, or a tuple of values: every shape a ParamKey field takes."""
    return st.one_of(st.just(()), st.sampled_from(options), st.lists(st.sampled_from(options), max_size=3).map(tuple))


_PLAIN = [get_predicate(n) for n in BUILTINS if isinstance(get_predicate(n), ParamPredicate)]
_NAMED = [get_predicate(n) for n in BUILTINS if isinstance(get_predicate(n), ParamWithNamePredicate)]
key_fields = st.fixed_dictionaries({
    "name": _field_values(["*.bias", "*layernorm*", "decoder.layers.0.*", "*.mlp.*", "output_layer.weight", "nothing"]),
    "attr": _field_values(["is_embedding_or_output_parameter", "no_such_attr"]),
    "predicate": _field_values(_PLAIN),
    "with_name_predicate": _field_values(_NAMED),
}).map(lambda fields: {k: v for k, v in fields.items() if v != ()})  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(include=key_fields, exclude=key_fields)
def test_property_exclude_is_include_and_not_exclude_and_every_key_round_trips(
    include: dict[str, Any], exclude: dict[str, Any]
) -> None:
    model = tiny_gpt(qk_layernorm=True, num_layers=1)
    key = ParamKey(**include, exclude=ParamKey(**exclude) if exclude else None)
    for name, param in model.named_parameters():
        expected = ParamKey(**include).matches(param, name) and not (exclude and ParamKey(**exclude).matches(param, name))
        assert key.matches(param, name) == expected, name
    if include:
        assert key_from_entry(key_to_entry(key)) == key
        assert parse_recipe(dump_recipe(recipe_from_overrides({key: {"lr": 0.5}})))[1] == {key: {"lr": 0.5}}


# ---- round trips -------------------------------------------------------------------------

IS_1D = get_predicate("is_1d")
IS_2D = get_predicate("is_2d_matrix")
IS_BIAS = get_predicate("is_bias")
IS_NORM = get_predicate("is_norm")
IS_EMB = get_predicate("is_embedding_or_output")

ROUND_TRIP_KEYS = {
    "name-str": ParamKey(name="*.bias"),
    "name-tuple": ParamKey(name=("*.bias", "*layernorm*")),
    "name-tuple-of-one": ParamKey(name=("*.bias",)),
    "attr-str": ParamKey(attr="is_embedding_or_output_parameter"),
    "attr-tuple": ParamKey(attr=("is_embedding_or_output_parameter", "shared_embedding")),
    "predicate-single": ParamKey(predicate=IS_1D),  # type: ignore[arg-type]
    "predicate-tuple": ParamKey(predicate=(IS_1D, IS_2D)),  # type: ignore[arg-type]
    "with-name-single": ParamKey(with_name_predicate=IS_BIAS),  # type: ignore[arg-type]
    "with-name-tuple": ParamKey(with_name_predicate=(IS_BIAS, IS_NORM)),  # type: ignore[arg-type]
    "both-predicate-kinds-single": ParamKey(predicate=IS_1D, with_name_predicate=IS_BIAS),  # type: ignore[arg-type]
    "every-field": ParamKey(name="*", attr=("a", "b"), predicate=(IS_2D,), with_name_predicate=IS_NORM),  # type: ignore[arg-type]
    "exclude-name": ParamKey(name="*", exclude=ParamKey(name="*.bias")),
    "exclude-every-field": ParamKey(
        predicate=IS_2D,  # type: ignore[arg-type]
        exclude=ParamKey(name=("a", "b"), attr="c", predicate=(IS_1D,), with_name_predicate=(IS_EMB, IS_NORM)),  # type: ignore[arg-type]
    ),
    "standard": next(iter(standard_overrides())),
    "standard-qk": next(iter(standard_overrides(apply_wd_to_qk_layernorm=True))),
}


@pytest.mark.parametrize("key", list(ROUND_TRIP_KEYS.values()), ids=list(ROUND_TRIP_KEYS))
def test_every_kind_of_key_round_trips_through_an_entry_toml_and_yaml(key: ParamKey) -> None:
    assert key_from_entry(key_to_entry(key)) == key
    overrides = {key: {"wd_mult": 0.0}, ParamKey(name="output_layer.weight"): {"max_lr": 1e-4, "optimizer": "sgd"}}
    recipe = recipe_from_overrides(overrides)
    config, back = parse_recipe(dump_recipe(recipe))
    assert back == overrides and list(back) == list(overrides)
    assert config == OptimizerConfig()
    assert parse_recipe(dump_recipe(recipe, "yaml"), "yaml")[1] == overrides


def test_a_recipe_keeps_the_config_and_the_none_versus_empty_distinction() -> None:
    config = OptimizerConfig(lr=3e-4, weight_decay=0.1, params_dtype=torch.bfloat16, optimizer="muon", muon_num_ns_steps=8)
    assert recipe_from_overrides(None, config) == {
        "config": {"lr": 3e-4, "weight_decay": 0.1, "params_dtype": "bfloat16", "optimizer": "muon", "muon_num_ns_steps": 8}
    }
    assert parse_recipe(dump_recipe(recipe_from_overrides(None, config))) == (config, None)
    text = dump_recipe(recipe_from_overrides({}, config))
    assert text.startswith("overrides = []\n\n[config]\n")
    assert parse_recipe(text) == (config, {})


def test_the_standard_overrides_and_an_optimizer_config_override_round_trip() -> None:
    config = OptimizerConfig(lr=1e-3, decoupled_lr=1e-4, decoupled_min_lr=1e-5)
    overrides: dict[ParamKey, Any] = dict(get_standard_config_overrides(config))
    overrides[ParamKey(name="*.mlp.*")] = config.replace(optimizer="sgd", sgd_momentum=0.5)
    back_config, back = parse_recipe(dump_recipe(recipe_from_overrides(overrides, config)))
    assert back_config == config
    assert back == {**get_standard_config_overrides(config), ParamKey(name="*.mlp.*"): {"optimizer": "sgd", "sgd_momentum": 0.5}}


def test_dump_recipe_writes_this_exact_toml() -> None:
    overrides = {
        ParamKey(predicate=IS_2D, exclude=ParamKey(with_name_predicate=IS_EMB)): {"optimizer": "muon"},  # type: ignore[arg-type]
        ParamKey(name=("*.bias", 'odd "name"')): {"wd_mult": 0.0, "decoupled_weight_decay": False},
    }
    assert dump_recipe(recipe_from_overrides(overrides, OptimizerConfig(lr=1e-3, adam_eps=1e-15))) == (
        "[config]\n"
        "lr = 0.001\n"
        "adam_eps = 1e-15\n"
        "\n"
        "[[overrides]]\n"
        'predicate = "is_2d_matrix"\n'
        'exclude_with_name_predicate = "is_embedding_or_output"\n'
        'set = { optimizer = "muon" }\n'
        "\n"
        "[[overrides]]\n"
        'name = ["*.bias", "odd \\"name\\""]\n'
        "set = { wd_mult = 0.0, decoupled_weight_decay = false }\n"
    )


def test_the_predicate_field_takes_either_kind(model: nn.Module) -> None:
    overrides = overrides_from_entries([{"predicate": ["is_1d", "is_bias"], "set": {"wd_mult": 0.0}}])
    assert list(overrides) == [ParamKey(predicate=(IS_1D,), with_name_predicate=(IS_BIAS,))]  # type: ignore[arg-type]
    single = overrides_from_entries([{"predicate": "is_norm", "exclude_predicate": "is_qk_layernorm", "set": {"lr": 1.0}}])
    key = next(iter(single))
    assert key == ParamKey(with_name_predicate=IS_NORM, exclude=ParamKey(with_name_predicate=get_predicate("is_qk_layernorm")))  # type: ignore[arg-type]
    assert selected(key, model) == ordered([*IN_NORM, *MLP_NORM, *FINAL_NORM])


def test_a_registered_predicate_loads_from_a_recipe(registry: None, model: nn.Module) -> None:
    register_predicate("is_fc", lambda p, n: ".linear_fc" in n)
    _, overrides = parse_recipe('[[overrides]]\npredicate = "is_fc"\nexclude_predicate = "is_1d"\nset = { lr = 0.1 }\n')
    assert overrides is not None
    assert selected(next(iter(overrides)), model) == [FC1[0], FC2[0]]


def test_keys_holding_an_unregistered_predicate_cannot_be_written(registry: None) -> None:
    mine = ParamPredicate(name="mine", fn=lambda p: True)
    with pytest.raises(ValueError, match="^" + re.escape(
        "`predicate='mine'`: predicate is not registered, so a recipe cannot refer to it by name; got "
        "ParamPredicate(name='mine'); expected register_predicate('mine', fn) first"
    ) + "$"):  # fmt: skip
        recipe_from_overrides({ParamKey(predicate=mine): {"lr": 1.0}})
    impostor = ParamPredicate(name="is_1d", fn=lambda p: p.ndim == 1)  # equal by name, another function
    with pytest.raises(ValueError, match="^" + re.escape(
        "`name='*', exclude=(predicate='is_1d')`: predicate is not the registered one (same name, another "
        "function or kind), so a recipe cannot refer to it by name; got ParamPredicate(name='is_1d'); "
        "expected the registered ParamPredicate, get_predicate('is_1d')"
    ) + "$"):  # fmt: skip
        recipe_from_overrides({ParamKey(name="*", exclude=ParamKey(predicate=impostor)): {"lr": 1.0}})


@pytest.mark.parametrize(
    ("overrides", "config", "message"),
    [
        ({ParamKey(name="*"): OptimizerConfig(lr=1.0)}, None,
         ("`config_overrides`: an OptimizerConfig override means its fields that differ from the config; got one "
         "without config; expected recipe_from_overrides(config_overrides, config)")),
        ({ParamKey(name="*"): {"lr": None}}, None,
         "`overrides[0].set.lr`: TOML cannot hold this value; got None (NoneType); expected a bool, number, string, list or table"),
        (None, OptimizerConfig(timers=print), "`config.timers`: cannot be written to a recipe; got <built-in function print>; expected None"),
        ({ParamKey(exclude=ParamKey(name="*.bias")): {"lr": 1.0}}, None,
         "`ParamKey`: selects no parameter (no include field), so a recipe cannot hold it; got "
         "exclude=(name='*.bias'); expected at least one of name, attr, predicate, with_name_predicate, role"),
    ],
)  # fmt: skip
def test_values_a_recipe_cannot_hold(overrides: Any, config: OptimizerConfig | None, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dump_recipe(recipe_from_overrides(overrides, config))


# ---- bad recipes -------------------------------------------------------------------------

ENTRY_FIELDS = [
    "name", "attr", "predicate", "with_name_predicate", "role", "exclude_name", "exclude_attr", "exclude_predicate",
    "exclude_with_name_predicate", "exclude_role", "set",
]  # fmt: skip

BAD_RECIPES = [
    pytest.param('[[overrides]]\npredicate = "is_1D"\nset = { wd_mult = 0.0 }\n',
                 f"`overrides[0].predicate`: unknown predicate; got 'is_1D'; expected one of {BUILTINS} "
                 "(register_predicate(name, fn) adds one); did you mean 'is_1d'?", id="unknown-predicate"),
    pytest.param('[[overrides]]\nname = "*"\nexclude_predicate = ["is_1d", "nope"]\nset = { wd_mult = 0.0 }\n',
                 f"`overrides[0].exclude_predicate`: unknown predicate; got 'nope'; expected one of {BUILTINS} "
                 "(register_predicate(name, fn) adds one)", id="unknown-exclude-predicate"),
    pytest.param('[[overrides]]\nwith_name_predicate = "is_1d"\nset = { wd_mult = 0.0 }\n',
                 "`overrides[0].with_name_predicate`: 'is_1d' is a ParamPredicate (it tests the parameter only); "
                 "got 'is_1d'; expected it under `predicate`", id="plain-predicate-as-name-predicate"),
    pytest.param('[[overrides]]\nexclude_name = "*.bias"\nset = { wd_mult = 0.0 }\n',
                 "`overrides[0]`: selects no parameter; got ['exclude_name']; expected at least one of name, attr, "
                 "predicate, role (the exclude_* fields only take parameters out)", id="only-an-exclude"),
    pytest.param('[[overrides]]\nset = { wd_mult = 0.0 }\n',
                 "`overrides[0]`: selects no parameter; got no key field; expected at least one of name, attr, "
                 "predicate, role (the exclude_* fields only take parameters out)", id="no-key-field"),
    pytest.param('[[overrides]]\nname = []\nset = { wd_mult = 0.0 }\n',
                 "`overrides[0]`: selects no parameter; got ['name']; expected at least one of name, attr, "
                 "predicate, role (the exclude_* fields only take parameters out)", id="empty-list"),
    pytest.param('[[overrides]]\nname = "*"\nexclude = "*.bias"\nset = { wd_mult = 0.0 }\n',
                 f"`overrides[0].exclude`: unknown key; got 'exclude'; expected one of {ENTRY_FIELDS}; "
                 "did you mean 'exclude_role', 'exclude_name' or 'exclude_attr'?", id="unknown-key"),
    pytest.param('[[overrides]]\nname = "*"\nexclude_attr = 3\nset = { wd_mult = 0.0 }\n',
                 "`overrides[0].exclude_attr`: must be a string or a list of strings; got 3; "
                 "expected e.g. 'is_embedding_or_output_parameter'", id="not-a-string"),
    pytest.param('[[overrides]]\npredicate = [1]\nset = { wd_mult = 0.0 }\n',
                 "`overrides[0].predicate`: must be a string or a list of strings; got [1]; expected e.g. 'is_1d'",
                 id="not-a-list-of-strings"),
    pytest.param('[[overrides]]\npredicate = "is_1d"\n',
                 "`overrides[0].set`: must be a non-empty table of fields; got None; expected e.g. { wd_mult = 0.0 }",
                 id="no-set"),
    pytest.param('[[overrides]]\npredicate = "is_1d"\nset = { lr = 1.0 }\n[[overrides]]\npredicate = ["is_1d"]\n'
                 'set = { lr = 1.0 }\n[[overrides]]\npredicate = "is_1d"\nset = { lr = 2.0 }\n',
                 "`overrides[2]`: duplicate rule; got predicate='is_1d' twice; expected each rule once", id="duplicate"),
    pytest.param("overrides = 3\n", "`overrides`: must be a list of tables; got 3; expected [[overrides]] tables",
                 id="overrides-not-a-list"),
    pytest.param("overrides = [3]\n",
                 f"`overrides[0]`: must be a table; got 3; expected keys {ENTRY_FIELDS}", id="entry-not-a-table"),
    pytest.param("config = 3\n",
                 "`config`: must be a table of OptimizerConfig fields; got 3; expected e.g. { lr = 3e-4 }",
                 id="config-not-a-table"),
    pytest.param("[recipe]\nname = 'x'\n",
                 "`recipe`: unknown top-level key; got 'recipe'; expected 'config' and 'overrides'", id="top-level"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), BAD_RECIPES)
def test_bad_recipes_raise_one_exact_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_recipe(text)


@pytest.mark.parametrize(("text", "message"), BAD_RECIPES)
def test_bad_recipes_in_yaml_raise_the_same_error(text: str, message: str) -> None:
    import tomllib

    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        parse_recipe(yaml.safe_dump(tomllib.loads(text)), "yaml")


def test_invalid_yaml_and_a_yaml_document_that_is_not_a_mapping() -> None:
    with pytest.raises(ValueError, match=r"^`recipe`: invalid YAML; got while parsing a flow sequence .*line 1, column 10.*; expected a YAML mapping$"):
        parse_recipe("[unclosed", "yaml")
    with pytest.raises(ValueError, match=re.escape(
        "`recipe`: must be a table with keys 'config' and 'overrides'; got list; expected config: {...} and overrides: [...]"
    )):  # fmt: skip
        parse_recipe("- 1\n", "yaml")


# ---- YAML --------------------------------------------------------------------------------


def test_a_yaml_file_loads_like_the_same_toml(tmp_path: Path) -> None:
    (tmp_path / "r.yaml").write_text(
        "config:\n  lr: 3e-4\n  params_dtype: bfloat16\noverrides:\n"
        "  - predicate: is_muon_matrix\n    exclude_predicate: [is_embedding_or_output]\n    set: {optimizer: muon}\n"
        "  - predicate: is_1d\n    set: {wd_mult: 0.0}\n"
    )
    (tmp_path / "r.toml").write_text(
        '[config]\nlr = 3e-4\nparams_dtype = "bfloat16"\n'
        '[[overrides]]\npredicate = "is_muon_matrix"\nexclude_predicate = ["is_embedding_or_output"]\nset = { optimizer = "muon" }\n'
        '[[overrides]]\npredicate = "is_1d"\nset = { wd_mult = 0.0 }\n'
    )
    from_yaml = load_config_file(tmp_path / "r.yaml")
    assert from_yaml == load_config_file(tmp_path / "r.toml")
    assert from_yaml[0].lr == 3e-4  # YAML 1.2 float, not the string '3e-4'
    (tmp_path / "r.yml").write_text((tmp_path / "r.yaml").read_text())
    assert load_config_file(tmp_path / "r.yml") == from_yaml


def test_yaml_without_pyyaml_names_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # makes `import yaml` raise ImportError
    path = tmp_path / "r.yaml"
    path.write_text("config: {lr: 0.1}\n")
    with pytest.raises(ImportError, match="^" + re.escape(
        f"`{path}`: YAML needs PyYAML; got no module named 'yaml'; expected `pip install pyyaml`, or a TOML file"
    ) + "$"):  # fmt: skip
        load_config_file(path)
    assert load_config_file("muon-llm")[0].lr == 3e-4  # TOML needs nothing optional


# ---- shipped recipes ---------------------------------------------------------------------


def test_shipped_recipes_are_listed_with_a_description() -> None:
    recipes = shipped_recipes()
    assert list(recipes) == ["adamw-no-decay-norms", "lion-llm", "muon-llm"]
    assert recipes["muon-llm"] == (
        "Muon for the hidden matrices, routers and expert stacks; AdamW for embeddings, the output head, "
        "norms and biases; no weight decay on biases, norms or 1-D params"
    )
    assert all(recipes.values())


def groups_of(optimizer: Any) -> list[tuple[str, float, float, list[str]]]:
    return [(g["optimizer"], g["lr"], g["weight_decay"], g["param_names"]) for g in optimizer.param_groups]


def test_muon_llm_routes_hidden_matrices_to_muon_and_the_rest_to_adamw(model: nn.Module) -> None:
    config, overrides = load_recipe("muon-llm")
    optimizer = get_optimizer(config, model, overrides, strict=True)
    assert groups_of(optimizer) == [
        ("muon", 3e-4, 0.1, HIDDEN_MATRICES),
        ("adam", 3e-4, 0.1, [EMBED, POS, OUTPUT]),
        ("adam", 3e-4, 0.0, ordered([*BIASES, *NORMS])),
    ]
    assert [type(inner).__name__ for inner in optimizer.optimizers] == ["Muon", "AdamW"]
    muon = optimizer.param_groups[0]
    # Moonlight's scale under torch's name (it was spectral with an extra 0.2: the same factor).
    assert (muon["momentum"], muon["scale_mode"], muon["extra_scale_factor"]) == (0.95, "match_rms_adamw", 1.0)
    assert optimizer.param_groups[1]["betas"] == (0.9, 0.95)


def test_muon_llm_on_a_tied_model_keeps_the_shared_embedding_on_adamw() -> None:
    config, overrides = load_recipe("muon-llm")
    groups, _ = resolve_group_configs(config, tiny_gpt(tie_embeddings=True), overrides, strict=True)
    assert [(g.optimizer, g.weight_decay, g.param_names[:2]) for g in groups] == [
        ("muon", 0.1, ("decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_proj.weight")),
        ("adam", 0.1, (EMBED, POS)),
        ("adam", 0.0, ("decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.bias")),
    ]
    assert len(groups[1].params) == 2


def test_muon_llm_respects_use_muon_false(model: nn.Module) -> None:
    config, overrides = load_recipe("muon-llm")
    model.decoder.layers[0].mlp.linear_fc2.weight.use_muon = False  # type: ignore[index, union-attr]
    groups, _ = resolve_group_configs(config, model, overrides, strict=True)
    assert [(g.optimizer, list(g.param_names), g.auto_routed) for g in groups if g.weight_decay] == [
        ("muon", [QKV[0], PROJ[0], FC1[0]], None),
        ("adam", [FC2[0]], f"auto: muon leaves {get_spec('muon').declines_what} -> muon_scalar_optimizer='adam'"),
        ("adam", [EMBED, POS, OUTPUT], None),
    ]


def test_adamw_no_decay_norms_routes_as_documented(model: nn.Module) -> None:
    config, overrides = load_recipe("adamw-no-decay-norms")
    assert groups_of(get_optimizer(config, model, overrides, strict=True)) == [
        ("adam", 3e-4, 0.1, [EMBED, POS, *HIDDEN_MATRICES, OUTPUT]),
        ("adam", 3e-4, 0.0, ordered([*BIASES, *NORMS])),
    ]


def test_lion_llm_routes_as_documented(model: nn.Module) -> None:
    config, overrides = load_recipe("lion-llm")
    optimizer = get_optimizer(config, model, overrides, strict=True)
    assert groups_of(optimizer) == [
        ("lion", 3e-5, 1.0, [EMBED, POS, *HIDDEN_MATRICES, OUTPUT]),
        ("lion", 3e-5, 0.0, ordered([*BIASES, *NORMS])),
    ]
    assert optimizer.param_groups[0]["betas"] == (0.95, 0.98)


@pytest.mark.parametrize("name", ["adamw-no-decay-norms", "lion-llm", "muon-llm"])
def test_each_shipped_recipe_round_trips_and_loads_as_a_config_name(name: str) -> None:
    config, overrides = load_recipe(name)
    assert parse_recipe(dump_recipe(recipe_from_overrides(overrides, config))) == (config, overrides)
    assert load_config_file(name) == (config, overrides)


def test_unknown_recipe_names(tmp_path: Path) -> None:
    names = ["adamw-no-decay-norms", "lion-llm", "muon-llm"]
    with pytest.raises(ValueError, match=f"^{re.escape(f'`recipe`: unknown recipe; got {chr(39)}muon{chr(39)}; expected one of {names}')}; did you mean 'muon-llm'\\?$"):
        load_recipe("muon")
    with pytest.raises(FileNotFoundError, match="^" + re.escape(
        f"`--config`: no such file or shipped recipe; got 'muon-lm'; expected a .toml, .yaml or .py file, or one of {names}"
        "; did you mean 'muon-llm'?"
    ) + "$"):  # fmt: skip
        load_config_file("muon-lm")
    missing = str(tmp_path / "muon-llm.toml")
    with pytest.raises(FileNotFoundError, match="^" + re.escape(
        f"`--config`: no such file; got {missing!r}; expected a .toml or .py file"
    ) + "$"):  # fmt: skip
        load_config_file(missing)


def test_a_file_wins_over_a_shipped_recipe_of_the_same_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "muon-llm").write_text("[config]\nlr = 0.5\n")
    assert load_config_file("muon-llm") == (OptimizerConfig(lr=0.5), None)


def test_dump_param_groups_takes_a_shipped_recipe_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-param-groups", "--model", "gpt", "--config", "muon-llm", "--strict", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    import json

    groups = json.loads(out)["groups"]
    assert [(g["optimizer"], g["weight_decay"], g["num_params"]) for g in groups] == [
        ("muon", 0.1, 8), ("adam", 0.1, 3), ("adam", 0.0, 18),
    ]  # fmt: skip
