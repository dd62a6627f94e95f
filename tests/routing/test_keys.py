"""ParamKey, ParamPredicate and ParamWithNamePredicate: identity, matching truth table, errors."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

from optzoo.routing import ParamKey, ParamPredicate, ParamWithNamePredicate
from tests.conftest import tiny_gpt

QKV_W = "decoder.layers.0.self_attention.linear_qkv.weight"
QKV_B = "decoder.layers.0.self_attention.linear_qkv.bias"
NORM_B = "decoder.layers.0.input_layernorm.bias"
FINAL_NORM_W = "decoder.final_layernorm.weight"
EMBED_W = "embedding.word_embeddings.weight"
OUTPUT_W = "output_layer.weight"

IS_1D = ParamPredicate(name="is_1d", fn=lambda p: p.ndim == 1)
IS_2D = ParamPredicate(name="is_2d", fn=lambda p: p.ndim == 2)
NEVER = ParamPredicate(name="never", fn=lambda p: False)
IN_LAYER_0 = ParamWithNamePredicate(name="in_layer_0", fn=lambda p, n: ".layers.0." in n)
NEVER_N = ParamWithNamePredicate(name="never_n", fn=lambda p, n: False)


@pytest.fixture
def params() -> dict[str, nn.Parameter]:
    """The tiny GPT's parameters by name (word embedding and output weight carry the attr)."""
    return dict(tiny_gpt().named_parameters())


# --- predicates ---------------------------------------------------------------------------


def test_param_predicate_is_callable_and_returns_bool() -> None:
    count = ParamPredicate(name="numel", fn=lambda p: p.numel())  # truthy int, not a bool
    assert count(torch.empty(3)) is True
    assert count(torch.empty(0)) is False
    assert IS_1D(torch.empty(3)) is True
    assert IS_1D(torch.empty(3, 3)) is False


def test_param_with_name_predicate_receives_param_and_name() -> None:
    seen: list[tuple[tuple[int, ...], str]] = []
    pred = ParamWithNamePredicate(name="spy", fn=lambda p, n: seen.append((tuple(p.shape), n)) or True)
    assert pred(torch.empty(2, 5), QKV_W) is True
    assert seen == [((2, 5), QKV_W)]


@pytest.mark.parametrize("cls", [ParamPredicate, ParamWithNamePredicate])
def test_predicates_are_equal_and_hashed_by_name_only(cls: type) -> None:
    a = cls(name="rule", fn=lambda *args: True)
    b = cls(name="rule", fn=lambda *args: False)
    c = cls(name="other", fn=a.fn)
    with pytest.warns(UserWarning, match=rf"two {cls.__name__}s named 'rule' test with different functions"):
        assert a == b
    assert hash(a) == hash(b)
    assert a != c
    with pytest.warns(UserWarning, match="give them different names"):
        assert len({a, b, c}) == 2


SAME_NAME = "predicates are equal by name, so they are one rule"


@pytest.mark.parametrize("cls", [ParamPredicate, ParamWithNamePredicate])
def test_two_same_named_predicates_in_one_overrides_dict_warn_as_they_collapse(cls: type) -> None:
    first = cls(name="big", fn=lambda *args: args[0].numel() > 10)
    second = cls(name="big", fn=lambda *args: args[0].ndim == 1)
    field = "predicate" if cls is ParamPredicate else "with_name_predicate"
    with pytest.warns(UserWarning, match=rf"two {cls.__name__}s named 'big' .*{SAME_NAME}.*later override replaces"):
        overrides = {ParamKey(**{field: first}): {"lr": 1.0}, ParamKey(**{field: second}): {"lr": 2.0}}
    assert list(overrides.values()) == [{"lr": 2.0}]  # the collapse the warning reports


def test_one_predicate_or_one_recipe_built_twice_does_not_warn() -> None:
    def by_size(limit: int) -> ParamPredicate:
        return ParamPredicate(name=f"over_{limit}", fn=lambda p: p.numel() > limit)

    pred = ParamPredicate(name="is_1d", fn=lambda p: p.ndim == 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pred == ParamPredicate(name="is_1d", fn=pred.fn)
        assert by_size(4) == by_size(4)
        assert len({ParamKey(predicate=by_size(4)), ParamKey(predicate=by_size(4))}) == 1
    # same code, other captured value, same name: a different rule under one name
    with pytest.warns(UserWarning, match=SAME_NAME):
        assert ParamPredicate(name="over", fn=by_size(4).fn) == ParamPredicate(name="over", fn=by_size(8).fn)


def test_predicates_of_different_kinds_with_one_name_differ() -> None:
    assert ParamPredicate(name="x", fn=lambda p: True) != ParamWithNamePredicate(
        name="x", fn=lambda p, n: True
    )


@pytest.mark.parametrize("cls", [ParamPredicate, ParamWithNamePredicate])
def test_predicates_are_frozen(cls: type) -> None:
    pred = cls(name="rule", fn=lambda *args: True)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'name'"):
        pred.name = "renamed"


# --- ParamKey identity --------------------------------------------------------------------


def test_param_key_is_frozen() -> None:
    key = ParamKey(name="*.bias")
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'name'"):
        key.name = "*.weight"  # type: ignore[misc]


def test_param_key_is_hashable_and_equal_by_value() -> None:
    a = ParamKey(name=("*.bias", "*norm*"), attr="is_expert", predicate=IS_1D)
    b = ParamKey(
        name=("*.bias", "*norm*"),
        attr="is_expert",
        predicate=ParamPredicate(name="is_1d", fn=IS_1D.fn),  # same rule
    )
    assert a == b and hash(a) == hash(b)
    overrides = {a: {"wd_mult": 0.0}}
    assert overrides[b] == {"wd_mult": 0.0}
    assert ParamKey(name="*.bias") != ParamKey(attr="*.bias")
    assert ParamKey(name="*.bias") != ParamKey(name="*.weight")


# --- matching truth table -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("*.bias", QKV_B, True),
        ("*.bias", QKV_W, False),
        ("*", QKV_W, True),
        # `*` crosses dots: the whole dotted path is matched, not one component.
        ("decoder.*.weight", QKV_W, True),
        ("decoder.*", FINAL_NORM_W, True),
        ("*layernorm*", NORM_B, True),
        ("*layernorm*", QKV_B, False),
        ("decoder.layers.?.self_attention.*", QKV_W, True),
        ("decoder.layers.[1-9].*", QKV_W, False),
        # Full-name match: a suffix or a middle component alone does not match.
        ("linear_qkv.weight", QKV_W, False),
        ("self_attention", QKV_W, False),
        ("decoder", QKV_W, False),
        (QKV_W, QKV_W, True),
        # Case-sensitive (fnmatchcase), so results do not depend on the OS.
        ("*.BIAS", QKV_B, False),
        # The classic typo matches nothing.
        ("*.bais", QKV_B, False),
    ],
)
def test_name_glob_matches_the_full_dotted_name(
    params: dict[str, nn.Parameter], pattern: str, name: str, expected: bool
) -> None:
    assert ParamKey(name=pattern).matches(params[name], name) is expected


def test_attr_matches_only_when_truthy(params: dict[str, nn.Parameter]) -> None:
    key = ParamKey(attr="is_embedding_or_output_parameter")
    assert key.matches(params[EMBED_W], EMBED_W)
    assert key.matches(params[OUTPUT_W], OUTPUT_W)
    # Missing attribute: no match (getattr default False), and no AttributeError.
    assert not key.matches(params[QKV_W], QKV_W)


@pytest.mark.parametrize("value", [False, 0, None, "", []])
def test_attr_with_falsy_value_does_not_match(value: object) -> None:
    param = nn.Parameter(torch.empty(3))
    param.is_expert = value  # type: ignore[attr-defined]
    assert not ParamKey(attr="is_expert").matches(param, "decoder.layers.0.mlp.experts.weight")


@pytest.mark.parametrize("value", [True, 1, "yes", [0]])
def test_attr_with_truthy_value_matches(value: object) -> None:
    param = nn.Parameter(torch.empty(3))
    param.is_expert = value  # type: ignore[attr-defined]
    assert ParamKey(attr="is_expert").matches(param, "decoder.layers.0.mlp.experts.weight")


def test_attr_is_not_matched_against_the_name(params: dict[str, nn.Parameter]) -> None:
    assert not ParamKey(attr="bias").matches(params[QKV_B], QKV_B)
    assert not ParamKey(attr="*.bias").matches(params[QKV_B], QKV_B)


def test_predicate_matches_on_the_param(params: dict[str, nn.Parameter]) -> None:
    key = ParamKey(predicate=IS_1D)
    assert key.matches(params[NORM_B], NORM_B)
    assert key.matches(params[FINAL_NORM_W], FINAL_NORM_W)
    assert not key.matches(params[QKV_W], QKV_W)


def test_with_name_predicate_matches_on_param_and_name(params: dict[str, nn.Parameter]) -> None:
    key = ParamKey(with_name_predicate=IN_LAYER_0)
    assert key.matches(params[QKV_W], QKV_W)
    assert not key.matches(params[FINAL_NORM_W], FINAL_NORM_W)
    # The name passed to matches() is the one the predicate sees, not one derived from the param.
    assert key.matches(params[FINAL_NORM_W], "decoder.layers.0.alias.weight")


def test_single_value_and_one_tuple_match_alike(params: dict[str, nn.Parameter]) -> None:
    pairs = [
        (ParamKey(name="*.bias"), ParamKey(name=("*.bias",))),
        (ParamKey(attr="is_embedding_or_output_parameter"), ParamKey(attr=("is_embedding_or_output_parameter",))),
        (ParamKey(predicate=IS_1D), ParamKey(predicate=(IS_1D,))),
        (ParamKey(with_name_predicate=IN_LAYER_0), ParamKey(with_name_predicate=(IN_LAYER_0,))),
    ]
    for single, one_tuple in pairs:
        got_single = {n for n, p in params.items() if single.matches(p, n)}
        got_tuple = {n for n, p in params.items() if one_tuple.matches(p, n)}
        assert got_single == got_tuple
        assert got_single  # each pair selects something, so the comparison is not vacuous


def test_any_entry_of_a_tuple_is_enough(params: dict[str, nn.Parameter]) -> None:
    names = ParamKey(name=("*.bais", "output_layer.*"))
    assert names.matches(params[OUTPUT_W], OUTPUT_W)
    assert not names.matches(params[QKV_W], QKV_W)
    preds = ParamKey(predicate=(NEVER, IS_2D))
    assert preds.matches(params[QKV_W], QKV_W)
    assert not preds.matches(params[NORM_B], NORM_B)
    named = ParamKey(with_name_predicate=(NEVER_N, IN_LAYER_0))
    assert named.matches(params[NORM_B], NORM_B)
    attrs = ParamKey(attr=("is_expert", "is_embedding_or_output_parameter"))
    assert attrs.matches(params[EMBED_W], EMBED_W)
    assert not attrs.matches(params[QKV_W], QKV_W)


@pytest.mark.parametrize(
    "key",
    [
        ParamKey(name=QKV_W, attr="is_expert", predicate=NEVER, with_name_predicate=NEVER_N),
        ParamKey(name="*.bais", attr="sequence_parallel", predicate=IS_2D, with_name_predicate=NEVER_N),
        ParamKey(name="*.bais", attr="is_expert", predicate=NEVER, with_name_predicate=IN_LAYER_0),
    ],
    ids=["name-only-hits", "predicate-only-hits", "with-name-predicate-only-hits"],
)
def test_one_matching_field_is_enough(params: dict[str, nn.Parameter], key: ParamKey) -> None:
    assert key.matches(params[QKV_W], QKV_W)


def test_attr_alone_is_enough_across_fields(params: dict[str, nn.Parameter]) -> None:
    key = ParamKey(name="*.bais", attr="is_embedding_or_output_parameter", predicate=NEVER)
    assert key.matches(params[OUTPUT_W], OUTPUT_W)


def test_no_field_matching_is_no_match(params: dict[str, nn.Parameter]) -> None:
    key = ParamKey(name="*.bais", attr="is_expert", predicate=NEVER, with_name_predicate=NEVER_N)
    assert not any(key.matches(p, n) for n, p in params.items())


def test_empty_key_matches_nothing(params: dict[str, nn.Parameter]) -> None:
    assert not any(ParamKey().matches(p, n) for n, p in params.items())
    assert not any(
        ParamKey(name=(), attr=(), predicate=(), with_name_predicate=()).matches(p, n)
        for n, p in params.items()
    )


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"name": 3}, r"`ParamKey\.name`: entries must be str; got 3 \(int\)"),
        ({"name": ("*.bias", None)}, r"`ParamKey\.name`: entries must be str; got None \(NoneType\)"),
        ({"name": ["*.bias"]}, r"`ParamKey\.name`: entries must be str; got \['\*\.bias'\] \(list\)"),
        ({"attr": True}, r"`ParamKey\.attr`: entries must be str; got True \(bool\)"),
        ({"predicate": "is_1d"}, r"`ParamKey\.predicate`: entries must be ParamPredicate; got 'is_1d' \(str\)"),
        (
            {"predicate": IN_LAYER_0},
            r"`ParamKey\.predicate`: entries must be ParamPredicate; got .*\(ParamWithNamePredicate\)",
        ),
        (
            {"with_name_predicate": IS_1D},
            r"`ParamKey\.with_name_predicate`: entries must be ParamWithNamePredicate; "
            r"got .*\(ParamPredicate\)",
        ),
        (
            {"with_name_predicate": lambda p, n: True},
            r"`ParamKey\.with_name_predicate`: entries must be ParamWithNamePredicate; got .*\(function\)",
        ),
    ],
)
def test_wrong_entry_type_raises_type_error(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern + r".*; expected a \w+ or a tuple of them"):
        ParamKey(**kwargs)  # type: ignore[arg-type]


# --- describe -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (ParamKey(name="*.bias"), "name='*.bias'"),
        (ParamKey(name=("*.bias",)), "name='*.bias'"),
        (ParamKey(name=("*.bias", "*norm*")), "name=('*.bias', '*norm*')"),
        (ParamKey(attr="is_embedding_or_output_parameter"), "attr='is_embedding_or_output_parameter'"),
        (ParamKey(predicate=IS_1D), "predicate='is_1d'"),
        (ParamKey(predicate=(IS_1D, IS_2D)), "predicate=('is_1d', 'is_2d')"),
        (ParamKey(with_name_predicate=IN_LAYER_0), "with_name_predicate='in_layer_0'"),
        (
            ParamKey(with_name_predicate=IN_LAYER_0, predicate=IS_1D, attr="is_expert", name="*.bias"),
            "name='*.bias', attr='is_expert', predicate='is_1d', with_name_predicate='in_layer_0'",
        ),
        (ParamKey(), "<empty>"),
    ],
)
def test_describe_lists_set_fields_in_declaration_order(key: ParamKey, expected: str) -> None:
    assert key.describe() == expected
