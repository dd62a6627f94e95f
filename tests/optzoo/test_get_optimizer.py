"""get_optimizer: overrides become real torch param groups, per-group optimizers, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from optzoo import MixedPrecisionOptimizer, OptimizerConfig, ParamKey, RoutingConflictError, get_optimizer
from tests.conftest import tiny_gpt

BASE = OptimizerConfig(lr=1e-3, weight_decay=0.1)


def _group_of(opt: torch.optim.Optimizer, name: str) -> dict[str, object]:
    return next(g for g in opt.param_groups if name in g["param_names"])


def test_returns_a_real_torch_optimizer_whose_groups_are_the_inner_groups(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(BASE, gpt, {ParamKey(name="*.linear_fc1.weight"): {"optimizer": "lion"}})
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, MixedPrecisionOptimizer)
    inner_groups = [g for inner in opt.optimizers for g in inner.param_groups]
    assert sorted(map(id, inner_groups)) == sorted(map(id, opt.param_groups))
    assert all(inner.state is opt.state for inner in opt.optimizers)
    assert [type(inner).__name__ for inner in opt.optimizers] == ["AdamW", "Lion"]


def test_none_means_standard_overrides_and_empty_means_none(gpt: torch.nn.Module) -> None:
    """Megatron-Core's meaning, kept under ``standard_overrides=False`` (issue 25: by default the
    standard overrides lie under a dict too; tests/optzoo/test_overrides_layering.py)."""
    megatron = BASE.replace(standard_overrides=False)
    standard = get_optimizer(megatron, gpt, None)
    assert _group_of(standard, "decoder.layers.0.input_layernorm.weight")["weight_decay"] == 0.0
    assert _group_of(standard, "decoder.layers.0.mlp.linear_fc1.bias")["weight_decay"] == 0.0
    assert _group_of(standard, "decoder.layers.0.mlp.linear_fc1.weight")["weight_decay"] == 0.1
    nothing = get_optimizer(megatron, gpt, {})
    assert len(nothing.param_groups) == 1 and nothing.param_groups[0]["weight_decay"] == 0.1


def test_decoupled_lr_applies_to_embedding_and_output_at_once(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(BASE.replace(decoupled_lr=5e-4, decoupled_min_lr=5e-5), gpt)
    group = _group_of(opt, "embedding.word_embeddings.weight")
    # the tagged word embedding and output layer, and the position table (read by index in the forward)
    assert group["param_names"] == ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight"]
    assert (group["lr"], group["max_lr"], group["min_lr"]) == (5e-4, 5e-4, 5e-5)
    assert _group_of(opt, "decoder.layers.1.self_attention.linear_qkv.weight")["lr"] == 1e-3


def test_qk_layernorm_keeps_decay_with_apply_wd_to_qk_layernorm() -> None:
    model = tiny_gpt(qk_layernorm=True)
    opt = get_optimizer(BASE.replace(apply_wd_to_qk_layernorm=True), model)
    assert _group_of(opt, "decoder.layers.0.self_attention.q_layernorm.weight")["weight_decay"] == 0.1
    assert _group_of(opt, "decoder.layers.0.self_attention.k_layernorm.bias")["weight_decay"] == 0.1
    assert _group_of(opt, "decoder.layers.0.input_layernorm.weight")["weight_decay"] == 0.0


def test_override_fields_set_hyperparameters_immediately(gpt: torch.nn.Module) -> None:
    overrides = {
        ParamKey(name="*.linear_qkv.weight"): {"lr": 2e-3, "adam_beta2": 0.95, "adam_eps": 1e-6, "wd_mult": 0.5},
        ParamKey(name="output_layer.weight"): {"optimizer": "sgd", "sgd_momentum": 0.5, "weight_decay": 0.0},
    }
    opt = get_optimizer(BASE, gpt, overrides)
    qkv = _group_of(opt, "decoder.layers.0.self_attention.linear_qkv.weight")
    assert (qkv["lr"], qkv["betas"], qkv["eps"], qkv["weight_decay"]) == (2e-3, (0.9, 0.95), 1e-6, 0.05)
    out = _group_of(opt, "output_layer.weight")
    assert (out["optimizer"], out["momentum"], out["weight_decay"]) == ("sgd", 0.5, 0.0)
    assert isinstance(opt.optimizers[1], torch.optim.SGD)


def test_an_optimizer_config_as_override_means_its_differing_fields(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(BASE, gpt, {ParamKey(name="output_layer.weight"): BASE.replace(lr=7e-4, lion_beta1=0.9, optimizer="lion")})
    out = _group_of(opt, "output_layer.weight")
    assert (out["optimizer"], out["lr"], out["betas"]) == ("lion", 7e-4, (0.9, 0.98))


def test_groups_that_differ_in_decoupled_weight_decay_get_separate_instances(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(BASE, gpt, {ParamKey(name="output_layer.weight"): {"decoupled_weight_decay": False}})
    assert [type(inner) for inner in opt.optimizers] == [torch.optim.AdamW, torch.optim.Adam]


def test_group_order_matches_routing_order_even_across_optimizers(gpt: torch.nn.Module) -> None:
    overrides = {
        ParamKey(name="embedding.*"): {"optimizer": "lion"},
        ParamKey(name="output_layer.weight"): {"lr": 5e-4},
    }
    opt = get_optimizer(BASE.replace(standard_overrides=False), gpt, overrides)  # these rules alone
    assert [g["optimizer"] for g in opt.param_groups] == ["adam", "lion", "adam"]
    assert opt.param_groups[0]["param_names"][0] == "decoder.layers.0.input_layernorm.weight"


@pytest.mark.parametrize(
    ("overrides", "error", "pattern"),
    [
        ({ParamKey(name="*.bias"): {"lr_mult": 2.0}}, ValueError,
         r"`config_overrides rule #0 name='\*.bias'`: unknown override field; got 'lr_mult'; expected one of \['lr', 'min_lr', 'weight_decay', 'optimizer'"),
        ({ParamKey(name="*.bias"): {"clip_grad": 2.0}}, ValueError,
         r"`config_overrides rule #0 name='\*.bias'`: field is model-wide and cannot differ per group; got 'clip_grad'"),
        ({ParamKey(name="*.bias"): {"adam_beta1": 1.5}}, ValueError,
         r"param group #1 \(rules #0 name='\*.bias'\): `OptimizerConfig.adam_beta1`: must lie in \[0, 1\); got 1.5"),
        ({ParamKey(name="*.bias"): {"optimizer": "adamax"}}, ValueError,
         r"`OptimizerConfig.optimizer`: unknown optimizer; got 'adamax'; expected one of \['adam', 'sgd', 'lion'"),
        ({ParamKey(name="*.bias"): {"lr": 1e-3, "max_lr": 2e-3}}, ValueError, r"`lr` and `max_lr` disagree; got lr=0.001, max_lr=0.002"),
        ({ParamKey(name="*.bias"): {"wd_mult": -1.0}}, ValueError, r"`wd_mult` must be a finite float >= 0; got -1.0"),
        ({ParamKey(name="*.bias"): 0.1}, TypeError, r"override must be a dict or an OptimizerConfig; got float"),
        ({ParamKey(name="*.bias"): {"lr": 1e-3}, ParamKey(attr="is_embedding_or_output_parameter"): {"lr": 1e-4},
          ParamKey(name="output_layer.*"): {"lr": 2e-4}}, RoutingConflictError,
         r"`output_layer.weight`: conflicting values for field `lr` from rule #1 attr='is_embedding_or_output_parameter' \(lr=0.0001\) and rule #2 name='output_layer.\*' \(lr=0.0002\)"),
    ],
)
def test_bad_overrides_raise_naming_rule_field_and_value(
    gpt: torch.nn.Module, overrides: dict[ParamKey, object], error: type[Exception], pattern: str
) -> None:
    before = [p.clone() for p in gpt.parameters()]
    with pytest.raises(error, match=pattern):
        get_optimizer(BASE.replace(standard_overrides=False), gpt, overrides)  # type: ignore[arg-type]  # the rules alone: their numbers
    assert all(torch.equal(a, b) for a, b in zip(before, gpt.parameters()))


def test_lr_must_be_set(gpt: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match=r"`OptimizerConfig.lr`: required to build an optimizer; got None"):
        get_optimizer(OptimizerConfig(), gpt)
    # ... unless every group gets max_lr from an override
    opt = get_optimizer(OptimizerConfig(), gpt, {ParamKey(name="*"): {"max_lr": 1e-3}})
    assert opt.param_groups[0]["lr"] == 1e-3


def test_unmatched_rule_warns_and_strict_raises(gpt: torch.nn.Module) -> None:
    typo = {ParamKey(name="*.bais"): {"wd_mult": 0.0}}
    with pytest.warns(UserWarning, match=r"rule #0 name='\*.bais' matched no parameter"):
        get_optimizer(BASE, gpt, typo)
    with pytest.raises(ValueError, match=r"rule #0 name='\*.bais' matched no parameter"):
        get_optimizer(BASE, gpt, typo, strict=True)


def test_frozen_parameters_are_left_out(gpt: torch.nn.Module) -> None:
    gpt.embedding.requires_grad_(False)
    opt = get_optimizer(BASE, gpt)
    names = [n for g in opt.param_groups for n in g["param_names"]]
    assert "embedding.word_embeddings.weight" not in names and "output_layer.weight" in names


def test_no_trainable_parameters_is_an_error(gpt: torch.nn.Module) -> None:
    gpt.requires_grad_(False)
    with pytest.raises(ValueError, match=r"`model_chunks`: no trainable parameters; got \d+ parameters"):
        get_optimizer(BASE, gpt)


def test_tied_weights_are_one_parameter_with_both_names(tied_gpt: torch.nn.Module, tmp_path: Path) -> None:
    path = tmp_path / "map.json"
    opt = get_optimizer(BASE, tied_gpt, dump_param_to_param_group_map=path)
    names = [n for g in opt.param_groups for n in g["param_names"]]
    assert "embedding.word_embeddings.weight" in names and "output_layer.weight" not in names
    assert opt.aliases == {"embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", "output_layer.weight")}
    mapping = json.loads(path.read_text())["param_to_group"]
    assert mapping["output_layer.weight"] == mapping["embedding.word_embeddings.weight"]


def test_several_chunks_get_chunk_qualified_names() -> None:
    chunks = [tiny_gpt(num_layers=1), tiny_gpt(num_layers=1)]
    opt = get_optimizer(BASE, chunks, {})
    names = opt.param_groups[0]["param_names"]
    assert names[0] == "chunk0.embedding.word_embeddings.weight" and "chunk1.output_layer.weight" in names


def test_dump_param_to_param_group_map(gpt: torch.nn.Module, tmp_path: Path) -> None:
    path = tmp_path / "groups.json"
    opt = get_optimizer(BASE.replace(decoupled_lr=1e-4), gpt, dump_param_to_param_group_map=path)
    dumped = json.loads(path.read_text())
    assert set(dumped["param_to_group"]) == {n for n, _ in gpt.named_parameters()}
    for index, group in enumerate(opt.param_groups):
        assert all(dumped["param_to_group"][n] == index for n in group["param_names"])
        assert dumped["groups"][index]["lr"] == group["lr"]
        assert dumped["groups"][index]["config"]["lr"] == 1e-3
    assert dumped["groups"][1]["override"] == {"max_lr": 1e-4}


def test_config_logger_dir_writes_the_config(gpt: torch.nn.Module, tmp_path: Path) -> None:
    get_optimizer(BASE.replace(config_logger_dir=str(tmp_path / "logs")), gpt)
    dumped = json.loads((tmp_path / "logs" / "optimizer_config.json").read_text())
    assert dumped["lr"] == 1e-3 and dumped["params_dtype"] == "float32"


def test_add_param_group_refuses_a_param_outside_the_model(gpt: torch.nn.Module) -> None:
    # new params of the model are routed (issue #25; tests/optzoo/test_added_groups.py); others cannot be
    opt = get_optimizer(BASE, gpt)
    with pytest.raises(ValueError, match=r"`add_param_group`: params that routing cannot place; got params\[0\] \(\(2,\), float32\) is not a parameter"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_decoupled_lr_with_explicit_overrides_warns_unless_merged_in(gpt: torch.nn.Module) -> None:
    # Only where the standard overrides are off (Megatron-Core's meaning): by default they lie
    # under the dict and decoupled_lr acts (tests/optzoo/test_overrides_layering.py).
    config = BASE.replace(decoupled_lr=5e-4, standard_overrides=False)
    with pytest.warns(UserWarning, match=r"`OptimizerConfig.decoupled_lr`: has no effect with explicit config_overrides; got 0.0005"):
        get_optimizer(config, gpt, {ParamKey(name="*.bias"): {"wd_mult": 0.0}})
    import warnings

    from optzoo import get_standard_config_overrides

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = get_optimizer(config, gpt, {**get_standard_config_overrides(config), ParamKey(name="output_layer.weight"): {"lr": 5e-4}})
    assert _group_of(opt, "embedding.word_embeddings.weight")["lr"] == 5e-4


def test_standard_rules_that_match_nothing_stay_quiet() -> None:
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False))  # no 1-D parameter, no embedding
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = get_optimizer(BASE.replace(decoupled_lr=1e-4), model)
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    ("old", "new", "why"),
    [
        ("ChainedOptimizer", "MixedPrecisionOptimizer", r"it was an alias of MixedPrecisionOptimizer, while Megatron-Core's ChainedOptimizer chains several optimizers"),
        ("resolve_groups", "resolve_group_configs", r"renamed: it resolves each group's config, beside routing's resolve_param_groups"),
    ],
)
def test_retired_names_still_work_with_a_deprecation_warning(old: str, new: str, why: str) -> None:
    import optzoo

    with pytest.warns(DeprecationWarning, match=rf"^`optzoo\.{old}`: deprecated \({why}\); use `optzoo\.{new}`$"):
        value = getattr(optzoo, old)
    assert value is getattr(optzoo, new)
    assert old not in optzoo.__all__


def test_unknown_attribute_of_optzoo_is_an_attribute_error() -> None:
    import optzoo

    with pytest.raises(AttributeError, match=r"^module 'optzoo' has no attribute 'no_such_name'$"):
        optzoo.no_such_name  # noqa: B018
