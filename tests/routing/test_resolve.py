"""resolve_param_groups: the three routing rules (order, merge, conflict), provenance, errors.

Tests named ``test_rule_order_*``, ``test_rule_merge_*`` and ``test_rule_conflict_*`` pin the
three sentences of the ``routing`` package docstring.
"""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from optzoo.models import GPT
from optzoo.routing import (
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    RoutedParam,
    Routing,
    RoutingConflictError,
    named_trainable_parameters,
    resolve_param_groups,
    standard_overrides,
)
from tests.conftest import tiny_gpt

EMBED_W = "embedding.word_embeddings.weight"
POS_W = "embedding.position_embeddings.weight"
OUTPUT_W = "output_layer.weight"
L0_NORM_W = "decoder.layers.0.input_layernorm.weight"
L0_NORM_B = "decoder.layers.0.input_layernorm.bias"
L0_QKV_W = "decoder.layers.0.self_attention.linear_qkv.weight"
L0_QKV_B = "decoder.layers.0.self_attention.linear_qkv.bias"
L1_QKV_W = "decoder.layers.1.self_attention.linear_qkv.weight"
L1_QKV_B = "decoder.layers.1.self_attention.linear_qkv.bias"
FINAL_NORM_W = "decoder.final_layernorm.weight"
FINAL_NORM_B = "decoder.final_layernorm.bias"

IS_1D = ParamPredicate(name="is_1d", fn=lambda p: p.ndim == 1)
BIAS = ParamKey(name="*.bias")
EMBED = ParamKey(name="embedding.*")
OUTPUT = ParamKey(name="output_layer.weight")


def table(routing: Routing) -> list[tuple[dict[str, Any], list[str]]]:
    """Each group as (override, first names), in group order."""
    return [(dict(group.override), group.names) for group in routing.groups]


def override_of(routing: Routing, name: str) -> dict[str, Any]:
    """The merged override of the group holding ``name`` (under any of its tied names)."""
    found = [dict(g.override) for g in routing.groups for p in g.params if name in p.names]
    assert len(found) == 1, f"{name} is in {len(found)} groups"
    return found[0]


def routed(routing: Routing, name: str) -> RoutedParam:
    found = [p for g in routing.groups for p in g.params if name in p.names]
    assert len(found) == 1, f"{name} is in {len(found)} groups"
    return found[0]


def all_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def resolve_quietly(model: Any, overrides: Mapping[ParamKey, Any] | None, **kwargs: Any) -> Routing:
    """Resolve and fail on any warning: these tests expect every key to match."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return resolve_param_groups(model, overrides, **kwargs)


# --- rule 1: order ------------------------------------------------------------------------


def test_rule_order_every_trainable_param_is_tested_against_every_key(gpt: GPT) -> None:
    gpt.embedding.position_embeddings.weight.requires_grad_(False)
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def spy(tag: str) -> ParamWithNamePredicate:
        return ParamWithNamePredicate(name=tag, fn=lambda p, n: seen[tag].append(n) and False)

    keys = {ParamKey(with_name_predicate=spy("a")): {"x": 1}, ParamKey(with_name_predicate=spy("b")): {"y": 1}}
    with pytest.warns(UserWarning, match="matched no parameter"):
        resolve_param_groups(gpt, keys)
    trainable = [n for n, p in gpt.named_parameters() if p.requires_grad]
    assert POS_W not in trainable
    assert seen["a"] == trainable
    assert seen["b"] == trainable


def test_rule_order_no_override_group_first_then_by_first_appearance(gpt: GPT) -> None:
    # Keys inserted in the opposite of model order: group order must follow the model.
    routing = resolve_quietly(
        gpt, {OUTPUT: {"lr_mult": 2.0}, BIAS: {"wd_mult": 0.0}, EMBED: {"lr_mult": 0.5}}
    )
    overrides = [dict(g.override) for g in routing.groups]
    firsts = [g.names[0] for g in routing.groups]
    # The no-override group's first parameter (a layernorm weight) comes after the embeddings
    # in the model, yet its group is first.
    assert overrides == [{}, {"lr_mult": 0.5}, {"wd_mult": 0.0}, {"lr_mult": 2.0}]
    assert firsts == [L0_NORM_W, EMBED_W, L0_NORM_B, OUTPUT_W]


def test_rule_order_params_within_a_group_keep_model_order(gpt: GPT) -> None:
    routing = resolve_quietly(gpt, {BIAS: {"wd_mult": 0.0}})
    model_order = all_names(gpt)
    for group in routing.groups:
        assert group.names == [n for n in model_order if n in set(group.names)]
    assert routing.groups[1].names == [n for n in model_order if n.endswith(".bias")]


def test_rule_order_does_not_depend_on_key_insertion_order(gpt: GPT) -> None:
    items = [(OUTPUT, {"lr_mult": 2.0}), (BIAS, {"wd_mult": 0.0}), (EMBED, {"lr_mult": 0.5})]
    expected = table(resolve_quietly(gpt, dict(items)))
    for perm in itertools.permutations(items):
        assert table(resolve_quietly(gpt, dict(perm))) == expected


def test_rule_order_no_override_group_absent_when_every_param_is_overridden(gpt: GPT) -> None:
    routing = resolve_quietly(gpt, {ParamKey(name="*"): {"wd_mult": 1.0}, BIAS: {"wd_mult": 1.0}})
    assert table(routing) == [({"wd_mult": 1.0}, all_names(gpt))]


def test_rule_order_frozen_params_are_skipped(gpt: GPT) -> None:
    gpt.embedding.requires_grad_(False)
    gpt.decoder.final_layernorm.bias.requires_grad_(False)
    routing = resolve_quietly(gpt, {BIAS: {"wd_mult": 0.0}})
    placed = {name for group in routing.groups for name in group.names}
    assert placed == {n for n, p in gpt.named_parameters() if p.requires_grad}
    assert {EMBED_W, POS_W, FINAL_NORM_B}.isdisjoint(placed)
    assert {L0_NORM_B, FINAL_NORM_W, OUTPUT_W} <= placed


def test_rule_order_key_matching_only_frozen_params_is_unmatched(gpt: GPT) -> None:
    gpt.embedding.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"rule #0 name='embedding\.\*' matched no parameter"):
        routing = resolve_param_groups(gpt, {EMBED: {"lr_mult": 0.5}})
    assert routing.unmatched == (0,)


# --- rule 2: merge ------------------------------------------------------------------------


def test_rule_merge_keys_setting_different_fields_combine(gpt: GPT) -> None:
    routing = resolve_quietly(
        gpt, {BIAS: {"wd_mult": 0.0}, ParamKey(name="decoder.layers.0.*"): {"lr_mult": 0.5}}
    )
    assert override_of(routing, L0_QKV_B) == {"wd_mult": 0.0, "lr_mult": 0.5}
    assert override_of(routing, L0_QKV_W) == {"lr_mult": 0.5}
    assert override_of(routing, L1_QKV_B) == {"wd_mult": 0.0}
    assert override_of(routing, L1_QKV_W) == {}
    assert [dict(g.override) for g in routing.groups] == [
        {},
        {"lr_mult": 0.5},
        {"wd_mult": 0.0, "lr_mult": 0.5},
        {"wd_mult": 0.0},
    ]


def test_rule_merge_same_field_same_value_is_not_a_conflict(gpt: GPT) -> None:
    routing = resolve_quietly(gpt, {BIAS: {"wd_mult": 0.0}, ParamKey(predicate=IS_1D): {"wd_mult": 0.0}})
    assert override_of(routing, L0_QKV_B) == {"wd_mult": 0.0}
    assert routed(routing, L0_QKV_B).matched == (0, 1)
    assert routed(routing, L0_NORM_W).matched == (1,)


def test_rule_merge_identical_merged_overrides_share_one_group(gpt: GPT) -> None:
    # Different keys, same override: layernorm weights (second key only) and linear biases
    # (first key only) end up in one group.
    routing = resolve_quietly(gpt, {BIAS: {"wd_mult": 0.0}, ParamKey(name="*layernorm*"): {"wd_mult": 0.0}})
    assert len(routing.groups) == 2
    no_decay = routing.groups[1].names
    assert {L0_NORM_W, L0_NORM_B, L0_QKV_B, FINAL_NORM_W} <= set(no_decay)
    assert routed(routing, L0_QKV_B).matched == (0,)
    assert routed(routing, L0_NORM_W).matched == (1,)
    assert routed(routing, L0_NORM_B).matched == (0, 1)


def test_rule_merge_nested_values_compare_by_value(gpt: GPT) -> None:
    routing = resolve_quietly(
        gpt,
        {
            BIAS: {"betas": (0.9, 0.95), "extra": {"eps": 1e-8}},
            ParamKey(predicate=IS_1D): {"betas": (0.9, 0.95), "extra": {"eps": 1e-8}},
        },
    )
    assert table(routing)[1][0] == {"betas": (0.9, 0.95), "extra": {"eps": 1e-8}}
    assert len(routing.groups) == 2


def test_rule_merge_values_do_not_depend_on_key_order(gpt: GPT) -> None:
    items = [
        (BIAS, {"wd_mult": 0.0}),
        (ParamKey(predicate=IS_1D), {"wd_mult": 0.0, "eps": 1e-6}),
        (ParamKey(name="decoder.layers.1.*"), {"lr_mult": 0.1}),
    ]
    expected = {n: override_of(resolve_quietly(gpt, dict(items)), n) for n in all_names(gpt)}
    assert expected[L1_QKV_B] == {"wd_mult": 0.0, "eps": 1e-6, "lr_mult": 0.1}
    for perm in itertools.permutations(items):
        routing = resolve_quietly(gpt, dict(perm))
        assert {n: override_of(routing, n) for n in all_names(gpt)} == expected


def test_rule_merge_empty_override_joins_no_override_group(gpt: GPT) -> None:
    routing = resolve_quietly(gpt, {OUTPUT: {}})
    assert len(routing.groups) == 1
    assert routing.groups[0].override == {}
    assert routed(routing, OUTPUT_W).matched == (0,)


def test_rule_merge_group_override_is_a_read_only_copy(gpt: GPT) -> None:
    user_override = {"wd_mult": 0.0}
    routing = resolve_quietly(gpt, {BIAS: user_override})
    user_override["wd_mult"] = 1.0
    assert dict(routing.groups[1].override) == {"wd_mult": 0.0}
    with pytest.raises(TypeError, match="does not support item assignment"):
        routing.groups[1].override["wd_mult"] = 2.0  # type: ignore[index]


def test_rule_merge_tied_tensor_is_placed_once_with_both_names(tied_gpt: GPT) -> None:
    assert tied_gpt.output_layer.weight is tied_gpt.embedding.word_embeddings.weight
    routing = resolve_quietly(tied_gpt, {BIAS: {"wd_mult": 0.0}})
    tensors = [p.param for g in routing.groups for p in g.params]
    assert sum(t is tied_gpt.output_layer.weight for t in tensors) == 1
    assert len(tensors) == len(list(tied_gpt.parameters()))
    tied = routed(routing, OUTPUT_W)
    assert tied.names == (EMBED_W, OUTPUT_W)
    assert tied.name == EMBED_W
    assert tied.param is tied_gpt.output_layer.weight


def test_rule_merge_key_matching_only_the_tied_alias_applies(tied_gpt: GPT) -> None:
    routing = resolve_quietly(tied_gpt, {OUTPUT: {"lr_mult": 2.0}})
    assert table(routing)[1] == ({"lr_mult": 2.0}, [EMBED_W])
    assert routed(routing, EMBED_W).matched == (0,)


# --- rule 3: conflict ---------------------------------------------------------------------


def test_rule_conflict_same_field_different_values_names_everything(gpt: GPT) -> None:
    overrides = {BIAS: {"wd_mult": 0.0}, ParamKey(predicate=IS_1D): {"wd_mult": 1.0}}
    # The first parameter both keys match, in model order, is the input layernorm's bias.
    expected = (
        r"^`decoder\.layers\.0\.input_layernorm\.bias`: conflicting values for field `wd_mult` "
        r"from rule #0 name='\*\.bias' \(wd_mult=0\.0\) "
        r"and rule #1 predicate='is_1d' \(wd_mult=1\.0\); expected .*"
    )
    with pytest.raises(RoutingConflictError, match=expected) as info:
        resolve_param_groups(gpt, overrides)
    assert isinstance(info.value, ValueError)


def test_rule_conflict_error_is_a_value_error(gpt: GPT) -> None:
    with pytest.raises(ValueError, match=r"conflicting values for field `lr_mult`"):
        resolve_param_groups(gpt, {OUTPUT: {"lr_mult": 2.0}, ParamKey(name="output_*"): {"lr_mult": 3.0}})


def test_rule_conflict_between_keys_matching_different_tied_names(tied_gpt: GPT) -> None:
    overrides = {ParamKey(name=EMBED_W): {"lr_mult": 0.5}, OUTPUT: {"lr_mult": 2.0}}
    with pytest.raises(
        RoutingConflictError,
        match=r"^`embedding\.word_embeddings\.weight`: .*`lr_mult`.*"
        r"rule #0 name='embedding\.word_embeddings\.weight' \(lr_mult=0\.5\).*"
        r"rule #1 name='output_layer\.weight' \(lr_mult=2\.0\)",
    ):
        resolve_param_groups(tied_gpt, overrides)


def test_rule_conflict_is_raised_whatever_the_key_order(gpt: GPT) -> None:
    items = [(BIAS, {"wd_mult": 0.0}), (ParamKey(predicate=IS_1D), {"wd_mult": 1.0})]
    for perm in itertools.permutations(items):
        (first, first_value), (second, second_value) = perm
        expected = (
            rf"`wd_mult` from rule #0 {re.escape(first.describe())} \(wd_mult={first_value['wd_mult']}\) "
            rf"and rule #1 {re.escape(second.describe())} \(wd_mult={second_value['wd_mult']}\)"
        )
        with pytest.raises(RoutingConflictError, match=expected):
            resolve_param_groups(gpt, dict(perm))


def test_rule_conflict_unmatched_key_is_a_warning_naming_it(gpt: GPT) -> None:
    overrides = {ParamKey(predicate=IS_1D): {"wd_mult": 0.0}, ParamKey(name="*.bais"): {"wd_mult": 0.0}}
    with pytest.warns(UserWarning, match=r"rule #1 name='\*\.bais' matched no parameter") as record:
        routing = resolve_param_groups(gpt, overrides)
    assert len(record) == 1
    message = str(record[0].message)
    # Both sides of the mismatch: the existing names, cut to the first 10 plus a count.
    total = len(all_names(gpt))
    assert re.search(rf"parameters are: {re.escape(EMBED_W)}, .*\(\+{total - 10} more\)$", message)
    assert record[0].filename == __file__  # points at the caller, not at routing/
    assert routing.unmatched == (1,)
    assert override_of(routing, L0_NORM_W) == {"wd_mult": 0.0}


def test_rule_conflict_unmatched_key_with_strict_is_an_error(gpt: GPT) -> None:
    with pytest.raises(ValueError, match=r"rule #0 name='\*\.bais' matched no parameter.*strict=True"):
        resolve_param_groups(gpt, {ParamKey(name="*.bais"): {"wd_mult": 0.0}}, strict=True)


def test_rule_conflict_every_unmatched_key_is_named(gpt: GPT) -> None:
    overrides = {
        ParamKey(name="*.bais"): {"wd_mult": 0.0},
        BIAS: {"wd_mult": 0.0},
        ParamKey(attr="is_expert"): {"lr_mult": 0.1},
    }
    with pytest.warns(
        UserWarning,
        match=r"rule #0 name='\*\.bais' matched no parameter; rule #2 attr='is_expert' matched no parameter",
    ):
        routing = resolve_param_groups(gpt, overrides)
    assert routing.unmatched == (0, 2)


def test_rule_conflict_no_warning_when_every_key_matches(gpt: GPT) -> None:
    routing = resolve_quietly(gpt, {BIAS: {"wd_mult": 0.0}}, strict=True)
    assert routing.unmatched == ()


# --- provenance ---------------------------------------------------------------------------


def test_matched_lists_the_indices_of_matching_keys(gpt: GPT) -> None:
    overrides = {
        BIAS: {"wd_mult": 0.0},
        ParamKey(attr="is_embedding_or_output_parameter"): {"lr_mult": 0.5},
        ParamKey(predicate=IS_1D): {"wd_mult": 0.0},
        ParamKey(name="decoder.layers.0.*"): {"eps": 1e-6},
    }
    routing = resolve_quietly(gpt, overrides)
    assert routing.keys == tuple(overrides)
    assert routed(routing, L0_QKV_B).matched == (0, 2, 3)
    assert routed(routing, L0_QKV_W).matched == (3,)
    assert routed(routing, EMBED_W).matched == (1,)
    assert routed(routing, OUTPUT_W).matched == (1,)
    assert routed(routing, FINAL_NORM_W).matched == (2,)
    assert routed(routing, POS_W).matched == ()


def test_explain_gives_one_row_per_name_in_group_order(tied_gpt: GPT) -> None:
    overrides = {BIAS: {"wd_mult": 0.0}, OUTPUT: {"lr_mult": 2.0}}
    routing = resolve_quietly(tied_gpt, overrides)
    rows = routing.explain()
    assert [row[0] for row in rows] == [n for g in routing.groups for p in g.params for n in p.names]
    assert len(rows) == len(list(tied_gpt.named_parameters(remove_duplicate=False)))
    by_name = {name: (group, keys) for name, group, keys in rows}
    assert by_name[L0_QKV_W] == (0, [])
    assert by_name[EMBED_W] == (1, ["#1 name='output_layer.weight'"])
    assert by_name[OUTPUT_W] == (1, ["#1 name='output_layer.weight'"])
    assert by_name[L0_QKV_B] == (2, ["#0 name='*.bias'"])
    assert [group for _, group, _ in rows] == sorted(group for _, group, _ in rows)


# --- model chunks -------------------------------------------------------------------------


def test_multiple_chunks_route_each_chunk_with_local_names() -> None:
    chunks = [tiny_gpt(num_layers=1), tiny_gpt(num_layers=1)]
    routing = resolve_quietly(chunks, {ParamKey(name="decoder.layers.0.mlp.*"): {"lr_mult": 0.5}})
    mlp = routing.groups[1]
    assert dict(mlp.override) == {"lr_mult": 0.5}
    local = [n for n in all_names(chunks[0]) if n.startswith("decoder.layers.0.mlp.")]
    assert mlp.names == local + local
    assert [p.chunk for p in mlp.params] == [0] * len(local) + [1] * len(local)
    assert [p.param for p in mlp.params][len(local) :][0] is chunks[1].decoder.layers[0].mlp.linear_fc1.weight
    placed = [p.param for g in routing.groups for p in g.params]
    assert len(placed) == 2 * len(list(chunks[0].parameters()))


def test_tensor_shared_across_chunks_is_placed_once() -> None:
    first, last = tiny_gpt(num_layers=1), tiny_gpt(num_layers=1)
    last.output_layer.weight = first.embedding.word_embeddings.weight
    routing = resolve_quietly([first, last], {OUTPUT: {"lr_mult": 2.0}})
    by_tensor = {id(p.param): (dict(g.override), p) for g in routing.groups for p in g.params}
    assert len(by_tensor) == sum(1 for g in routing.groups for _ in g.params)
    override, shared = by_tensor[id(first.embedding.word_embeddings.weight)]
    assert shared.names == (EMBED_W, OUTPUT_W)  # chunk 0's name, then chunk 1's alias
    assert shared.chunk == 0
    # The key matched the shared tensor only through its chunk-1 alias.
    assert override == {"lr_mult": 2.0}
    assert by_tensor[id(last.embedding.word_embeddings.weight)][0] == {}


def test_single_module_is_one_chunk(gpt: GPT) -> None:
    overrides = {BIAS: {"wd_mult": 0.0}}
    assert table(resolve_quietly(gpt, overrides)) == table(resolve_quietly([gpt], overrides))


def test_named_trainable_parameters_lists_each_tensor_once(tied_gpt: GPT) -> None:
    tied_gpt.embedding.position_embeddings.weight.requires_grad_(False)
    listed = named_trainable_parameters([tied_gpt])
    assert [names for _, names, _ in listed][0] == (EMBED_W, OUTPUT_W)
    assert POS_W not in {n for _, names, _ in listed for n in names}
    assert len(listed) == len([p for p in tied_gpt.parameters() if p.requires_grad])


# --- bad inputs ---------------------------------------------------------------------------


def test_non_module_chunk_raises_type_error(gpt: GPT) -> None:
    with pytest.raises(TypeError, match=r"`model_chunks\[1\]`: must be a torch\.nn\.Module; got dict"):
        resolve_param_groups([gpt, {"decoder.final_layernorm.weight": torch.ones(3)}], None)


def test_non_param_key_raises_type_error(gpt: GPT) -> None:
    with pytest.raises(TypeError, match=r"`config_overrides` key #1: must be a ParamKey; got '\*\.bias'; expected ParamKey\("):
        resolve_param_groups(gpt, {OUTPUT: {"lr_mult": 2.0}, "*.bias": {"wd_mult": 0.0}})  # type: ignore[dict-item]


@pytest.mark.parametrize(("override", "type_name"), [(0.0, "float"), ([("wd_mult", 0.0)], "list"), (None, "NoneType")])
def test_non_mapping_override_raises_type_error(gpt: GPT, override: object, type_name: str) -> None:
    with pytest.raises(
        TypeError,
        match=rf"`config_overrides\[name='\*\.bias'\]`: must be a mapping of field -> value; got {type_name}; "
        r"expected a dict",
    ):
        resolve_param_groups(gpt, {BIAS: override})  # type: ignore[dict-item]


@pytest.mark.parametrize("overrides", [None, {}])
def test_no_overrides_give_one_no_override_group(gpt: GPT, overrides: dict[ParamKey, Any] | None) -> None:
    routing = resolve_quietly(gpt, overrides, strict=True)
    assert table(routing) == [({}, all_names(gpt))]
    assert routing.keys == () and routing.unmatched == ()


# --- standard_overrides -------------------------------------------------------------------


def no_decay_names(routing: Routing) -> set[str]:
    return {n for g in routing.groups if g.override.get("wd_mult") == 0.0 for p in g.params for n in p.names}


def test_standard_overrides_exempt_1d_params_and_biases_from_decay(gpt: GPT) -> None:
    routing = resolve_quietly(gpt, standard_overrides())
    assert no_decay_names(routing) == {n for n, p in gpt.named_parameters() if p.ndim == 1}
    assert {L0_NORM_W, L0_NORM_B, L0_QKV_B, FINAL_NORM_W, FINAL_NORM_B} <= no_decay_names(routing)
    assert table(routing)[0] == ({}, [n for n, p in gpt.named_parameters() if p.ndim != 1])


@pytest.mark.parametrize("apply_wd_to_qk_layernorm", [False, True])
def test_standard_overrides_exempt_a_2d_bias(apply_wd_to_qk_layernorm: bool) -> None:
    # A 2-D tensor named `*.bias` is exempt by name alone (not by the 1-D test).
    model = nn.Module()
    model.router = nn.Module()
    model.router.weight = nn.Parameter(torch.ones(4, 3))
    model.router.bias = nn.Parameter(torch.ones(4, 3))
    routing = resolve_quietly(model, standard_overrides(apply_wd_to_qk_layernorm=apply_wd_to_qk_layernorm))
    assert table(routing) == [({}, ["router.weight"]), ({"wd_mult": 0.0}, ["router.bias"])]


def test_standard_overrides_decay_qk_layernorm_when_asked() -> None:
    model = tiny_gpt(qk_layernorm=True)
    qk = {n for n in all_names(model) if ".q_layernorm." in n or ".k_layernorm." in n}
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in qk
    assert "decoder.layers.1.self_attention.k_layernorm.bias" in qk
    assert len(qk) == 8

    default = no_decay_names(resolve_quietly(model, standard_overrides()))
    assert qk <= default

    recipe = resolve_quietly(model, standard_overrides(apply_wd_to_qk_layernorm=True))
    assert no_decay_names(recipe) == default - qk
    assert qk <= set(recipe.groups[0].names)
    assert {L0_NORM_W, L0_NORM_B, L0_QKV_B, FINAL_NORM_W, FINAL_NORM_B} <= no_decay_names(recipe)


def test_standard_overrides_decoupled_lr_sets_max_lr_on_embedding_and_output(gpt: GPT) -> None:
    routing = resolve_quietly(gpt, standard_overrides(decoupled_lr=1e-3))
    assert override_of(routing, EMBED_W) == {"max_lr": 1e-3}
    assert override_of(routing, OUTPUT_W) == {"max_lr": 1e-3}
    # The learned position table is an input table (the forward reads it by index): decoupled_lr
    # reaches it too, though Megatron's tag leaves it out (docs/megatron.md).
    assert override_of(routing, POS_W) == {"max_lr": 1e-3}
    assert override_of(routing, L0_QKV_W) == {}
    assert override_of(routing, L0_QKV_B) == {"wd_mult": 0.0}


def test_standard_overrides_decoupled_min_lr_is_added_when_given(tied_gpt: GPT) -> None:
    routing = resolve_quietly(tied_gpt, standard_overrides(decoupled_lr=1e-3, decoupled_min_lr=1e-5))
    assert table(routing)[1] == ({"max_lr": 1e-3, "min_lr": 1e-5}, [EMBED_W, POS_W])
    assert routed(routing, OUTPUT_W).names == (EMBED_W, OUTPUT_W)


def test_standard_overrides_without_decoupled_lr_has_only_the_no_decay_key() -> None:
    assert [k.describe() for k in standard_overrides()] == ["name='*.bias', predicate='is_1d', role=('bias', 'norm', 'elementwise')"]
    assert list(standard_overrides().values()) == [{"wd_mult": 0.0}]


def test_routings_compare_without_comparing_tensor_values() -> None:
    # `==` on results must answer, not raise: tensors are compared by identity, never by value
    # (a dataclass comparing tensors elementwise raises "Boolean value of Tensor ... ambiguous").
    first, second = tiny_gpt(), tiny_gpt()
    overrides = {BIAS: {"wd_mult": 0.0}}
    assert resolve_quietly(first, overrides) == resolve_quietly(first, overrides)
    assert isinstance(resolve_quietly(first, overrides) == resolve_quietly(second, overrides), bool)


# ---- defaults: keys laid under config_overrides (issue 25, the standard overrides) ---------------


def test_rule_merge_defaults_lie_under_the_keys_which_win_field_by_field(gpt: GPT) -> None:
    defaults = {BIAS: {"wd_mult": 0.0, "lr_mult": 2.0}}
    routing = resolve_param_groups(gpt, {ParamKey(name="decoder.layers.0.*"): {"wd_mult": 1.0}}, defaults=defaults)
    assert override_of(routing, L0_QKV_B) == {"wd_mult": 1.0, "lr_mult": 2.0}  # the key's wd_mult, the default's lr_mult
    assert override_of(routing, L1_QKV_B) == {"wd_mult": 0.0, "lr_mult": 2.0}
    assert override_of(routing, L0_QKV_W) == {"wd_mult": 1.0}
    assert routing.keys == (ParamKey(name="decoder.layers.0.*"), BIAS) and routing.defaults == (1,)


def test_rule_merge_a_key_hides_the_defaults_linked_fields(gpt: GPT) -> None:
    defaults = {BIAS: {"wd_mult": 0.0}}
    linked = [("weight_decay", "wd_mult")]
    routing = resolve_param_groups(gpt, {ParamKey(name="*.bias"): {"weight_decay": 0.2}}, defaults=defaults, linked_fields=linked)
    assert override_of(routing, L0_QKV_B) == {"weight_decay": 0.2}


def test_rule_conflict_between_defaults_still_raises_and_unmatched_defaults_stay_quiet(gpt: GPT) -> None:
    with pytest.raises(RoutingConflictError, match=r"conflicting values for field `wd_mult` from rule #0 .* and rule #1 "):
        resolve_param_groups(gpt, {}, defaults={BIAS: {"wd_mult": 0.0}, ParamKey(name="*"): {"wd_mult": 1.0}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        routing = resolve_param_groups(gpt, {BIAS: {"lr_mult": 2.0}}, defaults={ParamKey(name="nothing.*"): {"wd_mult": 0.0}})
    assert routing.unmatched == ()
