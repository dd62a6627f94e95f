"""Property tests: every trainable parameter lands in exactly one group; key order is irrelevant.

Models are built from random layer kinds and shapes (with frozen parameters, tied weights and
Megatron-style attributes); keys are random combinations of name globs, attributes and
predicates. Overrides are conflict-free by construction: key #i sets its own field
``k<i>`` and, optionally, shared fields whose value is fixed per field, so any two keys agree.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from optzoo.routing import ParamKey, ParamPredicate, ParamWithNamePredicate, Routing, resolve_param_groups

SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,  # seeded: the same examples on every run
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # the autouse seed is harmless
)

# Layer kinds with their Megatron-style local names and a constructor from a width.
LAYER_KINDS: dict[str, Any] = {
    "input_layernorm": lambda d, bias: nn.LayerNorm(d, bias=bias),
    "self_attention.linear_qkv": lambda d, bias: nn.Linear(d, 3 * d, bias=bias),
    "self_attention.linear_proj": lambda d, bias: nn.Linear(d, d, bias=bias),
    "pre_mlp_layernorm": lambda d, bias: nn.LayerNorm(d, bias=bias),
    "mlp.linear_fc1": lambda d, bias: nn.Linear(d, 2 * d + 1, bias=bias),
    "mlp.linear_fc2": lambda d, bias: nn.Linear(2 * d + 1, d, bias=bias),
}

GLOBS = [
    "*.bias",
    "*.weight",
    "*layernorm*",
    "decoder.layers.0.*",
    "decoder.layers.1.*",
    "*.mlp.*",
    "*linear_fc?.weight",
    "embedding.*",
    "output_layer.weight",
    "*.bais",  # a typo: never matches
]
ATTRS = ["is_embedding_or_output_parameter", "sequence_parallel", "is_expert"]
PREDICATES = [
    ParamPredicate(name="is_1d", fn=lambda p: p.ndim == 1),
    ParamPredicate(name="is_2d", fn=lambda p: p.ndim == 2),
    ParamPredicate(name="numel_gt_20", fn=lambda p: p.numel() > 20),
]
NAME_PREDICATES = [
    ParamWithNamePredicate(name="1d_not_final", fn=lambda p, n: p.ndim == 1 and "final" not in n),
    ParamWithNamePredicate(name="in_attention", fn=lambda p, n: ".self_attention." in n),
]
# Shared fields take one fixed value each, so keys setting them never conflict.
SHARED_FIELDS = {"wd_mult": 0.0, "lr_mult": 0.5, "betas": (0.9, 0.95)}

layer_spec = st.tuples(
    st.sampled_from(sorted(LAYER_KINDS)),  # kind
    st.integers(1, 6),  # width
    st.booleans(),  # bias
    st.booleans(),  # frozen
    st.sampled_from([None, *ATTRS[1:]]),  # attribute set on the weight
)
model_spec = st.fixed_dictionaries(
    {
        "layers": st.lists(st.lists(layer_spec, min_size=1, max_size=4), min_size=1, max_size=3),
        "tie": st.booleans(),
        "freeze_embedding": st.booleans(),
    }
)


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """A GPT-like module: embedding, decoder.layers.N.<kind>, final norm, output layer."""
    width = 4
    model = nn.Module()
    model.embedding = nn.Module()
    model.embedding.word_embeddings = nn.Embedding(7, width)
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList()
    for layer_specs in spec["layers"]:
        layer = nn.Module()
        for kind, d, bias, frozen, attr in layer_specs:
            module = LAYER_KINDS[kind](d, bias)
            if frozen:
                module.requires_grad_(False)
            if attr is not None:
                setattr(module.weight, attr, True)
            parent = layer
            *path, leaf = kind.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, module)
        model.decoder.layers.append(layer)
    model.decoder.final_layernorm = nn.LayerNorm(width)
    model.output_layer = nn.Linear(width, 7, bias=False)
    if spec["tie"]:
        model.output_layer.weight = model.embedding.word_embeddings.weight
    if spec["freeze_embedding"]:
        model.embedding.requires_grad_(False)
    model.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
    model.output_layer.weight.is_embedding_or_output_parameter = True
    return model


def entries(pool: list[Any]) -> st.SearchStrategy[Any]:
    """Nothing, one entry, or a tuple of entries from ``pool``."""
    return st.one_of(
        st.just(()),
        st.sampled_from(pool),
        st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True).map(tuple),
    )


param_key = st.builds(
    ParamKey,
    name=entries(GLOBS),
    attr=entries(ATTRS),
    predicate=entries(PREDICATES),
    with_name_predicate=entries(NAME_PREDICATES),
)


@st.composite
def config_overrides(draw: st.DrawFn) -> dict[ParamKey, dict[str, Any]]:
    keys = draw(st.lists(param_key, min_size=1, max_size=8, unique=True))
    overrides = {}
    for index, key in enumerate(keys):
        shared = draw(st.lists(st.sampled_from(sorted(SHARED_FIELDS)), unique=True, max_size=2))
        override: dict[str, Any] = {field: SHARED_FIELDS[field] for field in shared}
        if draw(st.booleans()):
            override[f"k{index}"] = index
        overrides[key] = override
    return overrides


def resolve(model: nn.Module, overrides: Mapping[ParamKey, Any]) -> Routing:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # random keys may match nothing
        return resolve_param_groups(model, overrides)


def snapshot(routing: Routing) -> list[tuple[dict[str, Any], list[tuple[tuple[str, ...], frozenset[ParamKey]]]]]:
    """Groups in order: merged override and members (names, matching keys by identity)."""
    return [
        (
            dict(group.override),
            [(p.names, frozenset(routing.keys[i] for i in p.matched)) for p in group.params],
        )
        for group in routing.groups
    ]


@SETTINGS
@given(spec=model_spec, overrides=config_overrides())
def test_every_trainable_param_lands_in_exactly_one_group(
    spec: Mapping[str, Any], overrides: dict[ParamKey, dict[str, Any]]
) -> None:
    model = build_model(spec)
    routing = resolve(model, overrides)

    placed = Counter(id(p.param) for group in routing.groups for p in group.params)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(placed) == trainable
    assert set(placed.values()) <= {1}

    placed_names = Counter(name for group in routing.groups for p in group.params for name in p.names)
    trainable_names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    assert placed_names == Counter(trainable_names)

    # Each group's override is exactly the merge of the keys that match a member, by any name.
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for group in routing.groups:
        for routed in group.params:
            expected_keys = [
                k for k in overrides if any(k.matches(routed.param, n) for n in names_of[id(routed.param)])
            ]
            assert [routing.keys[i] for i in routed.matched] == expected_keys
            merged: dict[str, Any] = {}
            for key in expected_keys:
                merged.update(overrides[key])
            assert dict(group.override) == merged

    # Distinct groups have distinct overrides, and only the first may be empty.
    overrides_in_order = [dict(g.override) for g in routing.groups]
    assert all(overrides_in_order.count(o) == 1 for o in overrides_in_order)
    assert all(overrides_in_order[i] for i in range(1, len(overrides_in_order)))


@SETTINGS
@given(spec=model_spec, overrides=config_overrides(), data=st.data())
def test_conflict_free_merges_do_not_depend_on_key_order(
    spec: Mapping[str, Any], overrides: dict[ParamKey, dict[str, Any]], data: st.DataObject
) -> None:
    model = build_model(spec)
    permuted_keys = data.draw(st.permutations(list(overrides)), label="key order")
    permuted = {key: overrides[key] for key in permuted_keys}

    original, reordered = resolve(model, overrides), resolve(model, permuted)

    assert snapshot(reordered) == snapshot(original)
    assert {reordered.keys[i] for i in reordered.unmatched} == {original.keys[i] for i in original.unmatched}
    for mine, theirs in zip(original.groups, reordered.groups, strict=True):
        assert all(a.param is b.param for a, b in zip(mine.params, theirs.params, strict=True))
