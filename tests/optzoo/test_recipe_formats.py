"""Recipes across projects: Megatron-LM's ``overrides_config`` read and written, torchtitan's
``param_groups`` exported, on the built-in GPT and tiny Llama and Qwen3-MoE.

Outside answers: a transcription of how Megatron-LM resolves a recipe (PR #5925,
``megatron/core/optimizer/__init__.py`` ``_get_param_groups``: the enabled glob matchers that
``fnmatch.fnmatch`` a name select one target, else the default), torchtitan's own
``OptimizersContainer._build_param_groups`` run on the exported groups, ``fnmatch.fnmatchcase``
for the regexes, and hand-written settings and messages.
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import random
import re
from typing import Any

import pytest
import torch
import transformers
import yaml

from optzoo import OptimizerConfig, ParamKey, resolve_group_configs
from optzoo.cli import main
from optzoo.config_file import load_recipe, shipped_recipes
from optzoo.recipe_formats import (
    dump_megatron_yaml,
    megatron_from_overrides,
    overrides_from_megatron,
    parse_megatron_yaml,
    torchtitan_param_groups,
)
from optzoo.routing import resolve_param_groups
from optzoo.routing.globs import glob_regex, globs_may_overlap
from tests.conftest import tiny_gpt, tiny_qwen3_moe

BASE = OptimizerConfig(lr=1e-3, weight_decay=0.1, standard_overrides=False)


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def matcher(pattern: str, optimizer: str, group: str) -> dict[str, Any]:
    return {"type": "glob", "pattern": pattern, "optimizer": optimizer, "param_group": group, "enabled": True}


# Three recipes in Megatron's shape, one per model, with their optzoo-native equivalents written by hand.
GPT_RECIPE: dict[str, Any] = {
    "optimizers": {
        "adam": {"type": "adam", "kwargs": {}, "param_groups": {"default": {}, "no_decay": {"wd_mult": 0.0}}},
        "muon": {"type": "muon", "param_groups": {"hidden": {"max_lr": 0.02}}},
    },
    "default": {"optimizer": "adam", "param_group": "default"},
    "matchers": {
        "qkv": matcher("*.linear_qkv.weight", "muon", "hidden"),
        "proj": matcher("*.linear_proj.weight", "muon", "hidden"),
        "bias": matcher("*.bias", "adam", "no_decay"),
        "fc": matcher("*.linear_fc?.weight", "muon", "hidden"),
        "norms": matcher("*layernorm.weight", "adam", "no_decay"),
    },
}
GPT_NATIVE = {
    ParamKey(name=("*.linear_qkv.weight", "*.linear_proj.weight")): {"optimizer": "muon", "max_lr": 0.02},
    ParamKey(name="*.bias"): {"wd_mult": 0.0},
    ParamKey(name="*.linear_fc?.weight"): {"optimizer": "muon", "max_lr": 0.02},
    ParamKey(name="*layernorm.weight"): {"wd_mult": 0.0},
}
LLAMA_RECIPE: dict[str, Any] = {
    "optimizers": {
        "muon_main": {"type": "muon", "param_groups": {"matrices": {}}},
        "adamw": {"type": "adam", "param_groups": {"norms": {"wd_mult": 0.0}, "embed": {"max_lr": 0.001, "min_lr": 0.0001}, "head": {"max_lr": 0.0005}}},
    },
    "default": {"optimizer": "muon_main", "param_group": "matrices"},
    "matchers": {
        "norms": matcher("*norm.weight", "adamw", "norms"),
        "embed": matcher("model.embed_tokens.weight", "adamw", "embed"),
        "head": matcher("lm_head.weight", "adamw", "head"),
    },
}
LLAMA_NATIVE = {
    ParamKey(name="*norm.weight"): {"optimizer": "adam", "wd_mult": 0.0},
    ParamKey(name="model.embed_tokens.weight"): {"optimizer": "adam", "max_lr": 0.001, "min_lr": 0.0001},
    ParamKey(name="lm_head.weight"): {"optimizer": "adam", "max_lr": 0.0005},
}
QWEN_RECIPE: dict[str, Any] = {
    "optimizers": {
        "adam": {"type": "adam", "param_groups": {"rest": {"wd_mult": 0.5}, "no_decay": {"wd_mult": 0.0}, "router": {"max_lr": 0.001}}},
        "muon": {"type": "muon", "param_groups": {"hidden": {}, "experts": {"max_lr": 0.01}}},
    },
    "default": {"optimizer": "adam", "param_group": "rest"},
    "matchers": {
        "attention": matcher("*.self_attn.*_proj.weight", "muon", "hidden"),
        "experts": matcher("*.mlp.experts.*_proj", "muon", "experts"),
        "router": matcher("*.mlp.gate.weight", "adam", "router"),
        "norms": matcher("*norm.weight", "adam", "no_decay"),
    },
}
QWEN_NATIVE = {
    ParamKey(name="*.self_attn.*_proj.weight"): {"optimizer": "muon"},
    ParamKey(name="*.mlp.experts.*_proj"): {"optimizer": "muon", "max_lr": 0.01},
    ParamKey(name="*.mlp.gate.weight"): {"max_lr": 0.001},
    ParamKey(name="*norm.weight"): {"wd_mult": 0.0},
    # the default group has fields: a last rule for every param no matcher selects
    ParamKey(name="*", exclude=ParamKey(name=("*.self_attn.*_proj.weight", "*.mlp.experts.*_proj", "*.mlp.gate.weight", "*norm.weight"))): {"wd_mult": 0.5},
}
CASES = [
    pytest.param(GPT_RECIPE, GPT_NATIVE, "adam", lambda: tiny_gpt(), id="gpt"),
    pytest.param(LLAMA_RECIPE, LLAMA_NATIVE, "muon", tiny_llama, id="llama"),
    pytest.param(QWEN_RECIPE, QWEN_NATIVE, "adam", tiny_qwen3_moe, id="qwen3-moe"),
]


def megatron_reference(recipe: dict[str, Any], model: torch.nn.Module) -> dict[tuple[str, str], list[str]]:
    """Each param's target as Megatron-LM resolves a recipe (PR #5925, ``_get_param_groups``):
    the targets of the enabled matchers ``fnmatch.fnmatch`` selects; two are refused; none: default."""
    matchers = [(m["pattern"], (m["optimizer"], m["param_group"])) for m in recipe.get("matchers", {}).values() if m.get("enabled", False)]
    default = (recipe["default"]["optimizer"], recipe["default"]["param_group"])
    groups: dict[tuple[str, str], list[str]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        targets = {target for pattern, target in matchers if fnmatch.fnmatch(name, pattern)}
        assert len(targets) <= 1, f"{name}: Megatron refuses a param with targets {targets}"
        groups.setdefault(next(iter(targets)) if targets else default, []).append(name)
    return groups


# ---- Megatron: round trips -------------------------------------------------------------------


@pytest.mark.parametrize(("recipe", "native", "base", "build"), CASES)
def test_megatron_recipe_to_optzoo_to_recipe_is_identity(recipe: dict[str, Any], native: Any, base: str, build: Any) -> None:
    read = overrides_from_megatron(copy.deepcopy(recipe), BASE)
    assert megatron_from_overrides(read.config, read.config_overrides, read.names) == recipe
    text = dump_megatron_yaml(megatron_from_overrides(read.config, read.config_overrides, read.names))
    assert yaml.safe_load(text) == recipe
    again = parse_megatron_yaml(text, BASE)
    assert megatron_from_overrides(again.config, again.config_overrides, again.names) == recipe


@pytest.mark.parametrize(("recipe", "native", "base", "build"), CASES)
def test_megatron_recipe_reads_as_the_hand_written_optzoo_rules(recipe: dict[str, Any], native: Any, base: str, build: Any) -> None:
    read = overrides_from_megatron(copy.deepcopy(recipe), BASE)
    assert read.config_overrides == native
    assert [repr(v) for v in read.config_overrides.values()] == [repr(v) for v in native.values()]
    assert (read.config.optimizer, read.config.standard_overrides, read.config.lr) == (base, False, 1e-3)


@pytest.mark.parametrize(("recipe", "native", "base", "build"), CASES)
def test_optzoo_rules_to_megatron_to_optzoo_is_identity(recipe: dict[str, Any], native: Any, base: str, build: Any) -> None:
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, standard_overrides=False, optimizer=base)
    written = megatron_from_overrides(config, native)
    read = overrides_from_megatron(yaml.safe_load(dump_megatron_yaml(written)), config)
    assert read.config_overrides == native and read.config == config
    assert megatron_from_overrides(read.config, read.config_overrides, read.names) == written


@pytest.mark.parametrize(("recipe", "native", "base", "build"), CASES)
def test_imported_recipe_groups_params_as_megatron_and_as_the_native_rules(recipe: dict[str, Any], native: Any, base: str, build: Any) -> None:
    model = build()
    read = overrides_from_megatron(copy.deepcopy(recipe), BASE)
    routing = resolve_param_groups(model, read.config_overrides)
    reference = megatron_reference(recipe, model)
    base_type = recipe["optimizers"][recipe["default"]["optimizer"]]["type"]
    # one optzoo group per Megatron target, with the same params and the target's settings
    got = {frozenset(group.names): dict(group.override) for group in routing.groups}
    expected = {}
    for (alias, group_name), names in reference.items():
        kind = recipe["optimizers"][alias]["type"]
        expected[frozenset(names)] = {**({} if kind == base_type else {"optimizer": kind}), **recipe["optimizers"][alias]["param_groups"][group_name]}
    assert got == expected
    # the resolved groups equal those of the hand-written native rules
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, standard_overrides=False, optimizer=base)
    imported, _ = resolve_group_configs(read.config, model, read.config_overrides)
    hand, _ = resolve_group_configs(config, model, native)
    summary = lambda groups: sorted((g.param_names, g.optimizer, g.lr, g.min_lr, g.weight_decay) for g in groups)  # noqa: E731
    assert summary(imported) == summary(hand)


def test_names_are_made_up_when_none_are_given() -> None:
    config = OptimizerConfig(lr=1e-3, standard_overrides=False)
    written = megatron_from_overrides(config, {ParamKey(name=("*.linear_fc1.weight", "*.linear_fc2.weight")): {"optimizer": "muon"}, ParamKey(name="*.bias"): {"wd_mult": 0.0}})
    assert written == {
        "optimizers": {
            "adam": {"type": "adam", "param_groups": {"default": {}, "group2": {"wd_mult": 0.0}}},
            "muon": {"type": "muon", "param_groups": {"group1": {}}},
        },
        "default": {"optimizer": "adam", "param_group": "default"},
        "matchers": {
            "group1_1": matcher("*.linear_fc1.weight", "muon", "group1"),
            "group1_2": matcher("*.linear_fc2.weight", "muon", "group1"),
            "group2_1": matcher("*.bias", "adam", "group2"),
        },
    }


# ---- Megatron: refused by name -------------------------------------------------------------


def with_change(path: str, value: Any) -> dict[str, Any]:
    recipe = copy.deepcopy(GPT_RECIPE)
    *parents, last = path.split(".")
    node = recipe
    for part in parents:
        node = node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return recipe


@pytest.mark.parametrize(("recipe", "message"), [
    (with_change("optimizers.muon.kwargs", {"momentum_beta": 0.9}),
     "`overrides_config.optimizers.muon.kwargs`: constructor kwargs go to the emerging-optimizers class by its own names, which optzoo does not build; got {'momentum_beta': 0.9}; expected {} (set optzoo config fields such as muon_momentum in the config)"),
    (with_change("optimizers.adam.param_groups.default", {"eps": 1e-12}),
     "`overrides_config.optimizers.adam.param_groups.default.eps`: a param-group key optzoo does not read the same way; got 'eps'; expected one of ['max_lr', 'min_lr', 'wd_mult', 'start_wd', 'end_wd'] (adam_eps (adaptive_muon_eps for Adaptive Muon) is optzoo's per-algorithm field, which Megatron's groups do not name)"),
    (with_change("optimizers.adam.param_groups.default", {"optimizer": "sgd"}),
     "`overrides_config.optimizers.adam.param_groups.default.optimizer`: a protected field Megatron refuses in a recipe group; got 'optimizer'; expected one of ['max_lr', 'min_lr', 'wd_mult', 'start_wd', 'end_wd'] (the instance's type is the group's optimizer)"),
    (with_change("matchers.bias.enabled", False),
     "`overrides_config.matchers.bias.enabled`: a disabled matcher (Megatron skips it) has no optzoo rule to become; got False; expected true, or the matcher removed"),
    (with_change("matchers.bias.enabled", None),
     "`overrides_config.matchers.bias.enabled`: a disabled matcher (Megatron skips it) has no optzoo rule to become; got '<missing: false>'; expected true, or the matcher removed"),
    (with_change("matchers.bias.type", "regex"),
     "`overrides_config.matchers.bias.type`: unsupported matcher type; got 'regex'; expected 'glob'"),
    (with_change("matchers.bias.priority", 1),
     "`overrides_config.matchers.bias`: unsupported field; got 'priority'; expected one of ['type', 'pattern', 'optimizer', 'param_group', 'enabled']"),
    (with_change("optimizers.second", {"type": "AdamW", "param_groups": {"x": {}}}),
     "`overrides_config.optimizers.second.type`: a second instance of 'adam' (first: 'adam'); optzoo runs one instance per algorithm; got 'AdamW'; expected one instance per type"),
    (with_change("optimizers.muon.type", "muonn"),
     "`overrides_config.optimizers.muon.type`: not an optzoo optimizer; got 'muonn'; expected one of ['adam', 'sgd', 'lion', 'soap', 'muon', 'adaptive_muon', 'polargrad', 'mop', 'scion', 'spel', 'muon_hyperball', 'sinkhorn_muon', 'laprop', 'adafactor', 'torch_muon', 'rekls', 'psgd_pro', 'oblique_sgd', 'oblique_adam']; did you mean 'muon'?"),
    (with_change("optimizers.adam.param_groups.spare", {"wd_mult": 0.5}),
     "`overrides_config.optimizers.adam.param_groups.spare`: selected by no matcher nor the default, so optzoo has no rule to keep it by; got 'spare'; expected a matcher or the default selecting it, or the group removed"),
    (with_change("optimizers.adam.param_groups.twin", {"wd_mult": 0.0}),
     "`overrides_config.optimizers.adam.param_groups.twin`: the same fields as group 'no_decay'; optzoo groups params by their settings, so both would be one group; got {'wd_mult': 0.0}; expected distinct fields per group"),
    (with_change("matchers.norms.pattern", "*.bias"),
     "`overrides_config.matchers.norms.pattern`: duplicates the pattern of matcher 'bias'; got '*.bias'; expected each pattern once"),
    (with_change("default", None),
     "`overrides_config`: missing the required 'default'; got ['matchers', 'optimizers']; expected default: {optimizer: <instance>, param_group: <group>}"),
    (with_change("default.param_group", "hidden"),
     "`overrides_config.default.param_group`: unknown param group of 'adam'; got 'hidden'; expected one of ['default', 'no_decay']"),
    (with_change("matchers.decoder", matcher("decoder.*", "adam", "default")),
     "`overrides_config.matchers`: matcher 'qkv' ('*.linear_qkv.weight', {'optimizer': 'muon', 'max_lr': 0.02}) and matcher 'decoder' ('decoder.*', {}) may match one param; Megatron refuses such a param (two targets) while optzoo would merge the settings; got globs that can overlap; expected globs no name matches both, or settings that conflict on a field"),
])  # fmt: skip
def test_megatron_recipe_optzoo_cannot_hold_is_refused_by_name(recipe: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        overrides_from_megatron(recipe, BASE)
    assert str(raised.value) == message


def test_matchers_that_conflict_on_a_field_are_kept_since_optzoo_refuses_the_param_too() -> None:
    # "*.bias" (max_lr 1e-3) and "*.linear_fc1.*" (max_lr 0.02) share fc1's bias: optzoo's merge
    # refuses it (max_lr conflicts), as Megatron refuses its two targets.
    recipe = {
        "optimizers": {"adam": {"type": "adam", "param_groups": {"default": {}, "fast": {"max_lr": 0.001}}},
                       "muon": {"type": "muon", "param_groups": {"hidden": {"max_lr": 0.02}}}},
        "default": {"optimizer": "adam", "param_group": "default"},
        "matchers": {"fc1": matcher("*.linear_fc1.*", "muon", "hidden"), "bias": matcher("*.bias", "adam", "fast")},
    }  # fmt: skip
    read = overrides_from_megatron(recipe, BASE)
    with pytest.raises(ValueError, match=r"^`decoder.layers.0.mlp.linear_fc1.bias`: conflicting values for field `max_lr`"):
        resolve_param_groups(tiny_gpt(), read.config_overrides)


@pytest.mark.parametrize(("overrides", "config", "message"), [
    (None, BASE,
     "`config_overrides`: None means optzoo's standard overrides (by predicate), which a Megatron recipe cannot name; got None; expected a dict of rules ({} for none)"),
    ({}, OptimizerConfig(lr=1e-3),
     "`config.standard_overrides`: True lays optzoo's standard overrides (no decay on 1-D params, by predicate) under the rules, which Megatron's recipe replaces; got True; expected False"),
    ({ParamKey(role="norm"): {"wd_mult": 0.0}}, BASE,
     "`config_overrides rule #0 role='norm'`: a Megatron matcher selects by one name glob; got role='norm'; expected name=... only"),
    ({ParamKey(attr="is_embedding_or_output_parameter"): {"max_lr": 1e-4}}, BASE,
     "`config_overrides rule #0 attr='is_embedding_or_output_parameter'`: a Megatron matcher selects by one name glob; got attr='is_embedding_or_output_parameter'; expected name=... only"),
    ({ParamKey(name="*.weight", exclude=ParamKey(name="*norm*")): {"optimizer": "muon"}}, BASE,
     "`config_overrides rule #0 name='*.weight', exclude=(name='*norm*')`: a Megatron matcher has no exclude; got exclude=(name='*norm*'); expected no exclude"),
    ({ParamKey(name="*.bias"): {"adam_eps": 1e-12}}, BASE,
     "`config_overrides rule #0 name='*.bias'`: a Megatron param group sets scheduler keys only; got 'adam_eps'; expected one of ['optimizer', 'max_lr', 'min_lr', 'wd_mult', 'start_wd', 'end_wd']"),
    ({ParamKey(name="decoder.*"): {"max_lr": 1e-4}, ParamKey(name="*.bias"): {"wd_mult": 0.0}}, BASE,
     "`config_overrides`: rule #0 name='decoder.*' ('decoder.*', {'max_lr': 0.0001}) and rule #1 name='*.bias' ('*.bias', {'wd_mult': 0.0}) may match one param; optzoo merges their settings while Megatron refuses a param with two targets; got globs that can overlap; expected globs no name matches both, or settings that conflict on a field"),
    ({ParamKey(name="*.bias"): {"wd_mult": 0.0}, ParamKey(name="*", exclude=ParamKey(name="*.bias")): {"optimizer": "muon"}}, BASE,
     "`config_overrides rule #1 name='*', exclude=(name='*.bias')`: the catch-all rule sets optimizer; got 'muon'; expected the default's algorithm in config.optimizer"),
    ({ParamKey(name="*", exclude=None): {"adam_beta2": 0.95}}, BASE,
     "`config_overrides rule #0 name='*'`: a Megatron param group sets scheduler keys only; got 'adam_beta2'; expected one of ['max_lr', 'min_lr', 'wd_mult', 'start_wd', 'end_wd']"),
])  # fmt: skip
def test_optzoo_rules_megatron_cannot_hold_are_refused_by_name(overrides: Any, config: OptimizerConfig, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        megatron_from_overrides(config, overrides)
    assert str(raised.value) == message


SHIPPED_REFUSALS = {
    "adamw-no-decay-norms": "`config_overrides rule #0 with_name_predicate=('is_bias', 'is_norm'), role=('bias', 'norm', 'elementwise')`: a Megatron matcher selects by one name glob; got with_name_predicate=('is_bias', 'is_norm'); expected name=... only",
    "lion-llm": "`config_overrides rule #0 predicate='is_1d', role=('bias', 'norm', 'elementwise')`: a Megatron matcher selects by one name glob; got predicate='is_1d'; expected name=... only",
    "muon-llm": "`config_overrides rule #0 with_name_predicate='is_embedding_or_output', role=('embedding', 'output')`: a Megatron matcher selects by one name glob; got with_name_predicate='is_embedding_or_output'; expected name=... only",
}


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_shipped_recipes_select_by_predicate_and_are_refused_by_name(name: str) -> None:
    config, overrides = load_recipe(name)
    with pytest.raises(ValueError, match=r"^`config\.standard_overrides`: True lays"):
        megatron_from_overrides(config, overrides)
    config = OptimizerConfig(**{**{f: getattr(config, f) for f in ("lr", "optimizer")}, "standard_overrides": False})
    with pytest.raises(ValueError) as raised:
        megatron_from_overrides(config, overrides)
    assert str(raised.value) == SHIPPED_REFUSALS[name]
    with pytest.raises(ValueError, match=r"a torchtitan pattern is a regex on the name; got (with_name_)?predicate="):
        torchtitan_param_groups(config, overrides, tiny_gpt())


# ---- torchtitan ------------------------------------------------------------------------------


def titan_groups(entries: list[dict[str, Any]], model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """``{param name: kwargs}`` as torchtitan's own OptimizersContainer groups ``entries``."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    groups, _ = OptimizersContainer._build_param_groups(model, [ParamGroupConfig(**entry) for entry in entries], {})
    found = {}
    for optimizer_name, param_groups in groups.items():
        for group in param_groups:
            kwargs = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            found.update({name: {"optimizer_name": optimizer_name, **kwargs} for name in group["param_names"]})
    return found


def test_torchtitan_export_groups_every_param_as_the_merged_rules_say() -> None:
    model = tiny_gpt()
    config = OptimizerConfig(lr=3e-4, weight_decay=0.1, adam_beta2=0.95, standard_overrides=False)
    rules = {
        ParamKey(name=("*.bias", "*layernorm.weight")): {"wd_mult": 0.0},
        ParamKey(name="embedding.*"): {"lr": 1e-3, "wd_mult": 0.0},
        ParamKey(name="decoder.layers.1.mlp.linear_fc?.weight", exclude=ParamKey(name="*fc2*")): {"max_lr": 1e-4, "adam_eps": 1e-12},
    }
    entries = torchtitan_param_groups(config, rules, model)
    assert [entry["pattern"] for entry in entries] == [
        glob_regex(["embedding.*"]),  # its override covers the no-decay rule's: it goes first
        glob_regex(["*.bias", "*layernorm.weight"]),
        glob_regex(["decoder.layers.1.mlp.linear_fc?.weight"], exclude=["*fc2*"]),
        ".*",
    ]

    def expected(name: str) -> dict[str, Any]:  # the rules merged by hand
        lr, eps, wd = 3e-4, 1e-8, 0.1
        if fnmatch.fnmatchcase(name, "*.bias") or fnmatch.fnmatchcase(name, "*layernorm.weight"):
            wd = 0.0
        if fnmatch.fnmatchcase(name, "embedding.*"):
            lr, wd = 1e-3, 0.0
        if name == "decoder.layers.1.mlp.linear_fc1.weight":
            lr, eps = 1e-4, 1e-12
        return {"optimizer_name": "AdamW", "lr": lr, "betas": [0.9, 0.95], "eps": eps, "weight_decay": wd}

    got = titan_groups(entries, model)
    assert got == {name: expected(name) for name, _ in model.named_parameters()}


def test_torchtitan_export_matches_optzoo_groups_on_llama() -> None:
    model = tiny_llama()
    config = OptimizerConfig(lr=3e-4, weight_decay=0.1, standard_overrides=False)
    rules = {ParamKey(name="*norm.weight"): {"wd_mult": 0.0}, ParamKey(name=("model.embed_tokens.weight", "lm_head.weight")): {"lr": 1e-4}}
    got = titan_groups(torchtitan_param_groups(config, rules, model), model)
    groups, _ = resolve_group_configs(config, model, rules)
    assert len(groups) == 3
    for group in groups:
        for name in group.param_names:
            assert got[name] == {"optimizer_name": "AdamW", "lr": group.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": group.weight_decay}


@pytest.mark.parametrize(("rules", "config", "message"), [
    ({ParamKey(name="*.weight"): {"optimizer": "muon"}}, BASE,
     "`config_overrides rule #0 name='*.weight'`: torchtitan builds Adam, AdamW and DistMuon (FlexShard only); got optimizer='muon'; expected 'adam'"),
    ({ParamKey(name="*.weight", exclude=ParamKey(role="embedding")): {"wd_mult": 0.5}}, BASE,
     "`config_overrides rule #0 name='*.weight', exclude=(role='embedding')`: a torchtitan pattern is a regex on the name; got exclude role='embedding'; expected name globs only (and exclude names)"),
    ({ParamKey(name="*.bias"): {"min_lr": 0.0}}, BASE,
     "`config_overrides rule #0 name='*.bias'`: a torchtitan param group holds AdamW's kwargs only; got 'min_lr'; expected one of ['optimizer', 'lr', 'max_lr', 'weight_decay', 'wd_mult', 'adam_beta1', 'adam_beta2', 'adam_eps', 'decoupled_weight_decay']"),
    ({ParamKey(name="*.mlp.*"): {"adam_beta2": 0.95}, ParamKey(name="*.bias"): {"wd_mult": 0.0}}, BASE,
     "`config_overrides`: rule #0 name='*.mlp.*' ({'adam_beta2': 0.95}) and rule #1 name='*.bias' ({'wd_mult': 0.0}) may match one param ('*.mlp.*' and '*.bias'); optzoo merges them, a first match takes one; got neither override covering the other; expected a rule for the shared params with both settings, or globs no name matches both"),
    ({ParamKey(name="*.bias"): {"wd_mult": 0.0}, ParamKey(name="decoder.*.bias"): {"wd_mult": 0.0}}, BASE,
     "`config_overrides rule #1 name='decoder.*.bias'`: takes no param of the model first (torchtitan refuses a pattern that matches none); got pattern '\\\\A(?:(?s:decoder\\\\..*\\\\.bias)\\\\Z)'; expected a rule that selects a param"),
    ({}, OptimizerConfig(lr=1e-3),
     "`config.standard_overrides`: optzoo's standard overrides select by predicate (1-D params), which a torchtitan regex cannot; got standard_overrides=True; expected standard_overrides=False and a dict of rules"),
])  # fmt: skip
def test_torchtitan_export_refuses_what_first_match_cannot_say(rules: Any, config: OptimizerConfig, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        torchtitan_param_groups(config, rules, tiny_gpt())
    assert str(raised.value) == message


def test_torchtitan_export_refuses_a_tied_param() -> None:
    with pytest.raises(ValueError) as raised:
        torchtitan_param_groups(BASE, {ParamKey(name="*.bias"): {"wd_mult": 0.0}}, tiny_gpt(tie_embeddings=True))
    assert str(raised.value) == (
        "`embedding.word_embeddings.weight`: a tied param; optzoo routes it under every name, torchtitan under its first only; "
        "got names ['embedding.word_embeddings.weight', 'output_layer.weight']; expected untied params"
    )


# ---- globs as regexes ------------------------------------------------------------------------

ALPHABET = "ab.["


def random_glob(rng: random.Random) -> str:
    pieces = ["a", "b", ".", "*", "?", "[ab]", "[!a]", "[a-b]", "["]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 5)))


def test_glob_regex_selects_exactly_what_fnmatchcase_does() -> None:
    rng = random.Random(0)
    names = ["".join(chars) for size in range(5) for chars in itertools.product(ALPHABET, repeat=size)]
    for _ in range(300):
        include = [random_glob(rng) for _ in range(rng.randint(1, 2))]
        exclude = [random_glob(rng) for _ in range(rng.randint(0, 2))]
        pattern = re.compile(glob_regex(include, exclude))
        for name in names:
            want = any(fnmatch.fnmatchcase(name, g) for g in include) and not any(fnmatch.fnmatchcase(name, g) for g in exclude)
            assert bool(pattern.search(name)) == want, (include, exclude, name)


def test_globs_may_overlap_is_never_wrong_when_it_says_no_and_exact_without_sets() -> None:
    rng = random.Random(1)
    names = ["".join(chars) for size in range(7) for chars in itertools.product("ab.", repeat=size)]
    for _ in range(400):
        a, b = random_glob(rng), random_glob(rng)
        shared = any(fnmatch.fnmatchcase(n, a) and fnmatch.fnmatchcase(n, b) for n in names)
        if shared:
            assert globs_may_overlap(a, b), (a, b)
        elif "[" not in a + b and len(a) + len(b) <= 6:  # short: a shared name would be among `names`
            assert not globs_may_overlap(a, b), (a, b)


# ---- command line ----------------------------------------------------------------------------


def test_cli_converts_a_megatron_recipe_to_optzoo_and_back(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "overrides.yaml"
    source.write_text(yaml.safe_dump(GPT_RECIPE, sort_keys=False))
    assert main(["recipes", "--config", str(source), "--from", "megatron-yaml"]) == 0
    toml = capsys.readouterr().out
    assert toml == (
        "[config]\nstandard_overrides = false\n\n"
        '[[overrides]]\nname = ["*.linear_qkv.weight", "*.linear_proj.weight"]\nset = { optimizer = "muon", max_lr = 0.02 }\n\n'
        '[[overrides]]\nname = "*.bias"\nset = { wd_mult = 0.0 }\n\n'
        '[[overrides]]\nname = "*.linear_fc?.weight"\nset = { optimizer = "muon", max_lr = 0.02 }\n\n'
        '[[overrides]]\nname = "*layernorm.weight"\nset = { wd_mult = 0.0 }\n'
    )
    assert main(["recipes", "--config", str(source), "--from", "megatron-yaml", "--to", "megatron-yaml"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == GPT_RECIPE
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(toml.replace("[config]\n", "[config]\nlr = 0.001\n"))
    assert main(["recipes", "--config", str(recipe), "--to", "torchtitan", "--model", "gpt"]) == 2
    assert "torchtitan builds Adam, AdamW and DistMuon" in capsys.readouterr().err


def test_cli_refuses_a_shipped_recipe_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes", "--config", "muon-llm", "--to", "megatron-yaml"]) == 2
    assert capsys.readouterr().err.startswith("optzoo: error: `config.standard_overrides`: True lays optzoo's standard overrides")
    assert main(["recipes", "--to", "torchtitan"]) == 2
    assert capsys.readouterr().err.startswith("optzoo: error: `--config`: the recipe to convert is missing")


def test_rules_added_after_reading_get_names_that_take_none_already_given() -> None:
    read = overrides_from_megatron(copy.deepcopy(GPT_RECIPE), BASE)
    recipe = {"optimizers": {"adam": {"type": "adam", "param_groups": {"default": {}, "group1": {"max_lr": 0.5}}}},
              "default": {"optimizer": "adam", "param_group": "default"},
              "matchers": {"group2_1": matcher("*.linear_proj.weight", "adam", "group1")}}  # fmt: skip
    clashing = overrides_from_megatron(recipe, BASE)
    rules = {**clashing.config_overrides, ParamKey(name="output_layer.weight"): {"max_lr": 1e-4}}
    written = megatron_from_overrides(clashing.config, rules, clashing.names)
    assert written["optimizers"]["adam"]["param_groups"] == {"default": {}, "group1": {"max_lr": 0.5}, "group2": {"max_lr": 0.0001}}
    assert written["matchers"] == {
        "group2_1": matcher("*.linear_proj.weight", "adam", "group1"),
        "group2_2": matcher("output_layer.weight", "adam", "group2"),  # "group2_1" was taken
    }
    assert overrides_from_megatron(written, BASE).config_overrides == rules
    assert megatron_from_overrides(read.config, read.config_overrides, read.names) == GPT_RECIPE


def test_a_glob_in_two_rules_is_refused_as_megatron_refuses_a_duplicate_pattern() -> None:
    with pytest.raises(ValueError) as raised:
        megatron_from_overrides(BASE, {ParamKey(name="*.bias"): {"wd_mult": 0.0}, ParamKey(name=("*norm*", "*.bias")): {"wd_mult": 0.0}})
    assert str(raised.value) == (
        "`config_overrides rule #1 name=('*norm*', '*.bias')`: a glob Megatron would see twice (it refuses a duplicate "
        "enabled pattern); got '*.bias' also in rule #0 name='*.bias'; expected each glob in one rule, once"
    )


# ---- random recipes: exact or refused, never different ----------------------------------------

POOL = ["*.bias", "*layernorm.weight", "*.linear_qkv.weight", "*.linear_fc?.weight", "embedding.*", "output_layer.weight",
        "decoder.layers.0.*", "*.linear_proj.*", "*.weight", "decoder.layers.[01].mlp.*"]  # fmt: skip
VALUES = [0.0, 0.5, 1e-3]


def random_recipe(rng: random.Random) -> dict[str, Any]:
    targets: list[tuple[str, str, dict[str, Any]]] = []
    for kind in rng.sample(["adam", "muon", "lion"], rng.randint(1, 3)):
        seen: list[dict[str, Any]] = []
        for index in range(rng.randint(1, 3)):
            fields = {f: rng.choice(VALUES) for f in rng.sample(["max_lr", "min_lr", "wd_mult"], rng.randint(0, 2))}
            if fields not in seen:
                seen.append(fields)
                targets.append((kind, f"g{index}", fields))
    default = rng.choice(targets)
    matchers = {f"m{i}": matcher(pattern, *rng.choice(targets)[:2]) for i, pattern in enumerate(rng.sample(POOL, rng.randint(0, 5)))}
    used = {(default[0], default[1])} | {(m["optimizer"], m["param_group"]) for m in matchers.values()}
    optimizers: dict[str, Any] = {}
    for kind, group, fields in targets:
        if (kind, group) in used:
            optimizers.setdefault(kind, {"type": kind, "param_groups": {}})["param_groups"][group] = fields
    return {"optimizers": optimizers, "default": {"optimizer": default[0], "param_group": default[1]}, "matchers": matchers}


@pytest.mark.filterwarnings("ignore:config_overrides.*matched no parameter")  # random rules: some select nothing
def test_random_megatron_recipes_read_exactly_or_are_refused() -> None:
    rng, model, kept = random.Random(7), tiny_gpt(), 0
    for _ in range(150):
        recipe = random_recipe(rng)
        try:
            read = overrides_from_megatron(copy.deepcopy(recipe), BASE)
        except ValueError:
            continue
        kept += 1
        assert megatron_from_overrides(read.config, read.config_overrides, read.names) == recipe
        try:
            reference = megatron_reference(recipe, model)
        except AssertionError:  # Megatron refuses a param with two targets: optzoo must refuse it too
            with pytest.raises(ValueError, match="conflicting values"):
                resolve_param_groups(model, read.config_overrides)
            continue
        routing = resolve_param_groups(model, read.config_overrides)
        base_type = recipe["optimizers"][recipe["default"]["optimizer"]]["type"]
        expected = {
            frozenset(names): {**({} if alias == base_type else {"optimizer": alias}), **recipe["optimizers"][alias]["param_groups"][group]}
            for (alias, group), names in reference.items()
        }
        assert {frozenset(g.names): dict(g.override) for g in routing.groups} == expected
    assert kept >= 30  # enough recipes got through for the check to mean something


@pytest.mark.filterwarnings("ignore:config_overrides.*matched no parameter")
def test_random_optzoo_rules_write_exactly_or_are_refused() -> None:
    rng, model, kept = random.Random(8), tiny_gpt(), 0
    for _ in range(150):
        rules: dict[ParamKey, dict[str, Any]] = {}
        for globs in (rng.sample(POOL, rng.randint(1, 2)) for _ in range(rng.randint(0, 4))):
            override = {f: rng.choice(VALUES) for f in rng.sample(["max_lr", "min_lr", "wd_mult"], rng.randint(0, 2))}
            if rng.random() < 0.4:
                override["optimizer"] = rng.choice(["muon", "lion"])
            if override:
                rules[ParamKey(name=globs[0] if len(globs) == 1 else tuple(globs))] = override
        try:
            written = megatron_from_overrides(BASE, rules)
        except ValueError:
            continue
        kept += 1
        read = overrides_from_megatron(yaml.safe_load(dump_megatron_yaml(written)), BASE)
        try:
            reference = megatron_reference(written, model)
        except AssertionError:
            with pytest.raises(ValueError, match="conflicting values"):
                resolve_param_groups(model, rules)
            continue
        # the same params together as optzoo's own rules put them, and as Megatron would
        assert {frozenset(g.names) for g in resolve_param_groups(model, rules).groups} == {frozenset(n) for n in reference.values()}
        if list(read.config_overrides) == list(rules):  # no two adjacent rules with one target (those read back as one)
            assert read.config_overrides == rules
    assert kept >= 30


@pytest.mark.filterwarnings("ignore:config_overrides.*matched no parameter")
def test_random_rules_export_to_torchtitan_exactly_or_are_refused() -> None:
    rng, model, kept = random.Random(9), tiny_gpt(), 0
    config = OptimizerConfig(lr=3e-4, weight_decay=0.1, standard_overrides=False)
    for _ in range(120):
        rules: dict[ParamKey, dict[str, Any]] = {}
        for globs in (rng.sample(POOL, rng.randint(1, 2)) for _ in range(rng.randint(0, 4))):
            fields = rng.sample(["lr", "wd_mult", "adam_eps", "adam_beta2"], rng.randint(1, 2))
            excluded = rng.sample(POOL, 1) if rng.random() < 0.3 else []
            key = ParamKey(name=globs[0] if len(globs) == 1 else tuple(globs), exclude=ParamKey(name=excluded[0]) if excluded else None)
            rules[key] = {f: rng.choice([0.0, 0.5]) if f != "adam_eps" else 1e-6 for f in fields}
        try:
            entries = torchtitan_param_groups(config, rules, model)
        except ValueError:
            continue
        kept += 1
        got = titan_groups(entries, model)  # torchtitan's own first-match grouping
        groups, _ = resolve_group_configs(config, model, rules)
        for group in groups:
            for name in group.param_names:
                c = group.config
                assert got[name] == {"optimizer_name": "AdamW", "lr": group.lr, "betas": [c.adam_beta1, c.adam_beta2],
                                     "eps": c.adam_eps, "weight_decay": group.weight_decay}, name  # fmt: skip
    assert kept >= 30
