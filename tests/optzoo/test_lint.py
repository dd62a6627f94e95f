"""The routing linter: each finding's exact message, and how get_optimizer reports them.

Models: the nanoGPT-style module of tests/routing/test_roles.py (tied ``wte``/``lm_head``, learned
``wpe``, LayerNorms with and without bias), and a conv net for the large-matrix finding.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from optzoo import (
    OptimizerConfig,
    ParamKey,
    RoutingLintWarning,
    apply_fixes,
    get_optimizer,
    get_predicate,
    get_standard_config_overrides,
    lint_routing,
    resolve_group_configs,
)
from optzoo.lint import LARGE_PARAM_ELEMENTS
from optzoo.models import GPT, GPTConfig
from tests.routing.test_roles import NanoGPT

MUON = OptimizerConfig(lr=1e-3, weight_decay=0.1, optimizer="muon")
ADAMW = OptimizerConfig(lr=1e-3, weight_decay=0.1)
BIASES = [f"transformer.h.0.{n}.bias" for n in ("ln_1", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def nanogpt() -> nn.Module:
    torch.manual_seed(0)
    return NanoGPT(vocab=32, hidden=8, layers=1)


def findings(config: OptimizerConfig, model: nn.Module, overrides: object = None) -> list[tuple[str, tuple[str, ...], str]]:
    groups, routing = resolve_group_configs(config, model, overrides)  # type: ignore[arg-type]
    return [(f.kind, f.params, f.message) for f in lint_routing(groups, routing)]


def test_the_standard_routing_of_real_models_has_no_findings() -> None:
    assert findings(MUON, nanogpt()) == []
    assert findings(ADAMW, nanogpt()) == []
    assert findings(MUON, GPT(GPTConfig(num_layers=1, hidden_size=16, num_heads=2, vocab_size=32, max_seq_len=8))) == []


def test_an_embedding_or_head_sent_to_muon_by_a_rule() -> None:
    rule = ParamKey(name=("transformer.wte.weight", "lm_head.weight", "transformer.wpe.weight"))
    assert findings(MUON, nanogpt(), {**get_standard_config_overrides(MUON), rule: {"optimizer": "muon"}}) == [(
        "embedding-on-matrix-optimizer", ("transformer.wte.weight", "lm_head.weight", "transformer.wpe.weight"),
        "`transformer.wte.weight`, `lm_head.weight`, `transformer.wpe.weight`: input table or head routed to muon by "
        "rule #1 name=('transformer.wte.weight', 'lm_head.weight', 'transformer.wpe.weight'); got param group #1 (muon); "
        "expected them on the scalar optimizer (adam), where tables and heads train better: leave "
        "`transformer.wte.weight`, `lm_head.weight`, `transformer.wpe.weight` out of rule #1 name=('transformer.wte.weight', "
        "'lm_head.weight', 'transformer.wpe.weight') (exclude them)",
    )]  # fmt: skip


def test_decayed_biases_norms_and_vectors() -> None:
    # {} alone (standard_overrides=False, Megatron-Core's meaning): nothing keeps decay off them.
    assert findings(ADAMW.replace(standard_overrides=False), nanogpt(), {}) == [(
        "decayed-vector",
        ("transformer.h.0.ln_1.weight", *BIASES[:1], *BIASES[1:3], "transformer.h.0.ln_2.weight", *BIASES[3:],
         "transformer.ln_f.weight", "transformer.ln_f.bias"),
        "`transformer.h.0.ln_1.weight`, `transformer.h.0.ln_1.bias`, `transformer.h.0.attn.c_attn.bias`, "
        "`transformer.h.0.attn.c_proj.bias`, `transformer.h.0.ln_2.weight`, `transformer.h.0.mlp.c_fc.bias`, "
        "`transformer.h.0.mlp.c_proj.bias`, `transformer.ln_f.weight`, `transformer.ln_f.bias`: biases, norms, "
        "elementwise or 1-D params with weight decay; got weight_decay=0.1 in param group #0 (rules: none; the standard "
        "overrides are off: config_overrides is used alone (standard_overrides=False, Megatron-Core's meaning); "
        "standard_overrides=True lays them under your rules); expected no decay on them: add "
        "{ParamKey(name=('transformer.h.0.ln_1.weight', 'transformer.h.0.ln_1.bias', 'transformer.h.0.attn.c_attn.bias', "
        "... (+6 more))): {'wd_mult': 0.0}}",
    )]  # fmt: skip
    assert findings(ADAMW.replace(weight_decay=0.0, standard_overrides=False), nanogpt(), {}) == []
    assert findings(ADAMW, nanogpt(), {}) == []  # issue 25: the standard overrides lie under {}


def test_a_2d_bias_stack_is_decayed_by_megatrons_rule_but_not_by_ours() -> None:
    model = nn.Module()
    model.experts = nn.Module()
    model.experts.down_proj_bias = nn.Parameter(torch.zeros(4, 8))  # GPT-OSS's stack of expert biases
    megatron = {ParamKey(name="*.bias", predicate=get_predicate("is_1d")): {"wd_mult": 0.0}}  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match=r"matched no parameter"):  # Megatron's rule alone: standard_overrides=False
        assert [(kind, params) for kind, params, _ in findings(ADAMW.replace(standard_overrides=False), model, megatron)] == [
            ("decayed-vector", ("experts.down_proj_bias",)),
        ]
    assert findings(ADAMW, model) == []  # the standard overrides' role=('bias', 'norm', 'elementwise') takes it


def test_a_large_conv_on_the_scalar_optimizer_while_muon_runs() -> None:
    model = nn.Sequential(nn.Conv2d(32, 32, 8), nn.Flatten(), nn.Linear(64, 64))  # no input fits: roles guessed
    assert model[0].weight.numel() >= LARGE_PARAM_ELEMENTS
    assert findings(MUON.replace(muon_flatten_conv=False), model) == [(
        "large-matrix-on-elementwise", ("0.weight",),
        "`0.weight` (32x32x8x8, conv (Conv2d, guessed)): a large matrix on an element-wise optimizer while muon steps "
        "the other matrices; got adam (param group #1, auto: muon leaves embeddings, heads, biases, norms, elementwise "
        "params, vectors, use_muon=False -> muon_scalar_optimizer='adam'); expected muon: add "
        "{ParamKey(name='0.weight'): {'muon_flatten_conv': True}}",
    )]  # fmt: skip
    routed_away = {**get_standard_config_overrides(MUON), ParamKey(name="0.weight"): {"optimizer": "adam"}}
    assert findings(MUON, model, routed_away) == [(
        "large-matrix-on-elementwise", ("0.weight",),
        "`0.weight` (32x32x8x8, conv (Conv2d, guessed)): a large matrix on an element-wise optimizer while muon steps "
        "the other matrices; got adam (param group #1); expected muon: leave `0.weight` out of rule #1 name='0.weight' "
        "(exclude them); add {ParamKey(name='0.weight'): {'optimizer': 'muon'}}",
    )]  # fmt: skip
    assert findings(ADAMW, model) == []  # no matrix optimizer: nothing to compare with


def test_a_rule_that_selects_a_tied_tensor_under_one_name() -> None:
    rule = ParamKey(name="lm_head.weight")
    assert findings(ADAMW, nanogpt(), {**get_standard_config_overrides(ADAMW), rule: {"lr": 1e-4}}) == [(
        "tied-names-disagree", ("transformer.wte.weight", "lm_head.weight"),
        "`transformer.wte.weight`, `lm_head.weight`: one tied tensor; rule #1 name='lm_head.weight' selects "
        "`lm_head.weight` but not `transformer.wte.weight`, so its ['lr'] reach every name; got different answers for "
        "one tensor; expected a rule that selects all its names or none: give rule #1 name='lm_head.weight' every name "
        "of the tensor (`transformer.wte.weight`, `lm_head.weight`)",
    )]  # fmt: skip
    excluded = ParamKey(role="embedding", exclude=ParamKey(name="lm_head.weight"))
    kinds = findings(ADAMW, nanogpt(), {**get_standard_config_overrides(ADAMW), excluded: {"lr": 1e-4}})
    assert [(kind, message.split("; got")[0]) for kind, _, message in kinds if kind == "tied-names-disagree"] == [(
        "tied-names-disagree",
        "`transformer.wte.weight`, `lm_head.weight`: one tied tensor; rule #1 role='embedding', "
        "exclude=(name='lm_head.weight') selects `transformer.wte.weight` but not `lm_head.weight`, so it sets nothing "
        "on the tensor (another name is excluded)",
    )]  # fmt: skip


def test_a_rule_wholly_shadowed_by_earlier_ones() -> None:
    overrides = {**get_standard_config_overrides(ADAMW), ParamKey(name="*.bias"): {"wd_mult": 0.0}}
    assert findings(ADAMW, nanogpt(), overrides) == [(
        "shadowed-rule", (*BIASES, "transformer.ln_f.bias"),
        "rule #1 name='*.bias': changes nothing; got {'wd_mult': 0.0} on `transformer.h.0.ln_1.bias`, "
        "`transformer.h.0.attn.c_attn.bias`, `transformer.h.0.attn.c_proj.bias`, `transformer.h.0.mlp.c_fc.bias`, "
        "`transformer.h.0.mlp.c_proj.bias`, `transformer.ln_f.bias`, all of it set already by rule #0 name='*.bias', "
        "predicate='is_1d', role=('bias', 'norm', 'elementwise'); expected it removed, or narrowed to the params it is meant for",
    )]  # fmt: skip
    partly = {**get_standard_config_overrides(ADAMW), ParamKey(name="*.bias"): {"wd_mult": 0.0, "lr": 1e-4}}
    assert findings(ADAMW, nanogpt(), partly) == []  # its lr is its own


MUON_FAMILY = "muon, adaptive_muon, polargrad, mop, scion, spel, muon_hyperball, sinkhorn_muon"


def test_a_field_no_optimizer_of_the_routing_reads() -> None:
    linear = nn.Linear(8, 8)
    assert findings(ADAMW.replace(muon_momentum=0.5), linear) == [(
        "unread-field", ("weight", "bias"),
        "`muon_momentum`=0.5, set by the config, is read by no optimizer that steps the params it reaches; got adam on "
        f"`weight`, `bias`, which ignore it; expected it removed, or `optimizer` set to one that reads it ({MUON_FAMILY})",
    )]  # fmt: skip
    # torch.optim.Muon has its own field for the Newton-Schulz steps: named as the likely meaning
    torch_muon = OptimizerConfig(lr=1e-3, optimizer="torch_muon", muon_num_ns_steps=3)
    [(kind, params, message)] = findings(torch_muon, nanogpt())
    assert kind == "unread-field" and "transformer.h.0.mlp.c_fc.weight" in params and "transformer.ln_f.bias" in params
    assert re.fullmatch(
        r"`muon_num_ns_steps`=3, set by the config, is read by no optimizer that steps the params it reaches; got "
        r"torch_muon, adam on `.*, which ignore it; expected it removed, or `optimizer` set to one that reads it "
        rf"\({MUON_FAMILY}\); did you mean 'torch_muon_ns_steps'\?", message,
    ), message
    hyperball = MUON.replace(muon_hyperball_radius=2.0)  # only muon_hyperball reads it
    assert [(kind, "got muon, adam on" in message) for kind, _, message in findings(hyperball, nanogpt())] == [("unread-field", True)]


def test_a_rule_setting_a_field_its_params_optimizer_ignores() -> None:
    rule = ParamKey(name="transformer.h.0.mlp.*.weight")
    assert findings(MUON, nanogpt(), {**get_standard_config_overrides(MUON), rule: {"soap_shampoo_beta": 0.9}}) == [(
        "unread-field", ("transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"),
        "`soap_shampoo_beta`=0.9, set by rule #1 name='transformer.h.0.mlp.*.weight', is read by no optimizer that steps "
        "the params it reaches; got muon on `transformer.h.0.mlp.c_fc.weight`, `transformer.h.0.mlp.c_proj.weight`, "
        "which ignore it; expected it removed, or `optimizer` set to one that reads it (soap)",
    )]  # fmt: skip


def test_fields_some_optimizer_of_the_routing_reads_are_not_findings() -> None:
    # Muon's scalar optimizer is Adam: its betas are read on the biases, norms and tables
    assert findings(MUON.replace(adam_beta2=0.95, muon_momentum=0.9), nanogpt()) == []
    on_soap = {**get_standard_config_overrides(MUON), ParamKey(name="transformer.h.0.mlp.*.weight"): {"optimizer": "soap", "soap_shampoo_beta": 0.9}}
    assert findings(MUON, nanogpt(), on_soap) == []


def test_get_optimizer_warns_once_per_finding_and_lint_false_is_quiet() -> None:
    overrides = {ParamKey(name="lm_head.weight"): {"lr": 1e-4}}  # no standard overrides: decayed norms too
    alone = ADAMW.replace(standard_overrides=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_optimizer(alone, nanogpt(), overrides)
    lint = [w for w in caught if issubclass(w.category, RoutingLintWarning)]
    assert [re.match(r"lint: ([\w-]+): ", str(w.message)).group(1) for w in lint] == [  # type: ignore[union-attr]
        "decayed-vector", "tied-names-disagree",
    ]
    assert {w.filename for w in lint} == {__file__}  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error", RoutingLintWarning)
        get_optimizer(alone, nanogpt(), overrides, lint=False)


# ---- every fix the linter suggests removes its finding ------------------------------------------


class _Blocks(nn.Module):
    """Hidden matrices large enough to lint, experts concatenated in one 2-D tensor (DBRX's layout,
    ``w.view(E, ffn, hidden)[e]``), an RWKV-style ``[1, 1, C]`` gain and a ``[1, N, C]`` position table."""

    def __init__(self, hidden: int = 256, experts: int = 2, ffn: int = 128, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.zeros(1, 16, hidden))
        self.mix = nn.Parameter(torch.ones(1, 1, hidden))
        self.proj = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts * ffn, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(experts * ffn, hidden) / ffn**0.5)
        self.head = nn.Linear(hidden, vocab)
        self.experts, self.ffn = experts, ffn

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = (self.embed(tokens) + self.pos[:, : tokens.shape[1]]) * self.mix
        x = x + self.proj(self.norm(x))
        gates = self.router(x).softmax(-1)
        w1, w2 = self.w1.view(self.experts, self.ffn, -1), self.w2.view(self.experts, self.ffn, -1)
        mixed = sum(gates[..., e : e + 1] * (torch.relu(x @ w1[e].T) @ w2[e]) for e in range(self.experts))
        return self.head(x + mixed)


def _tied_gpt2() -> nn.Module:
    from optzoo.hf import build_hf_model

    torch.manual_seed(0)
    with torch.device("meta"):
        return build_hf_model("GPT2Config")


FIXABLE = [
    ("tables on muon", MUON, _tied_gpt2, lambda: {ParamKey(role=("embedding", "output")): {"optimizer": "muon", "lr": 1e-4}}),
    ("a tag use_muon=True", MUON, lambda: _tagged(_tied_gpt2()), lambda: None),
    ("matrices on adam", MUON, _Blocks, lambda: {ParamKey(name="proj.weight"): {"optimizer": "adam"}, ParamKey(name="w*"): {"optimizer": "adam"}}),
    ("conv kept off muon", MUON.replace(muon_flatten_conv=False), lambda: nn.Sequential(
        nn.Conv2d(64, 64, 5), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10),
    ), lambda: None),
    ("decayed gains", ADAMW, _Blocks, lambda: {ParamKey(name="norm.*"): {"weight_decay": 0.2, "lr": 1e-4}}),
    ("blocks stepped whole", OptimizerConfig(lr=1e-3, optimizer="soap"), _Blocks, lambda: None),
    ("a tied tensor under one name", ADAMW, _tied_gpt2, lambda: {ParamKey(name="lm_head.weight"): {"lr": 1e-4}}),
    ("a tied tensor excluded under one name", ADAMW, _tied_gpt2,
     lambda: {ParamKey(role="embedding", exclude=ParamKey(name="lm_head.weight")): {"lr": 1e-4}}),
    ("a shadowed rule", ADAMW, _Blocks, lambda: {**get_standard_config_overrides(ADAMW), ParamKey(name="*.bias"): {"wd_mult": 0.0}}),
    ("a field the rule's params ignore", MUON, _Blocks, lambda: {ParamKey(name="proj.weight"): {"lion_beta1": 0.8}}),
]  # fmt: skip


def _tagged(model: nn.Module) -> nn.Module:
    model.transformer.wpe.weight.use_muon = True  # type: ignore[union-attr]
    return model


@pytest.mark.parametrize(("case", "config", "build", "overrides"), FIXABLE, ids=[case[0] for case in FIXABLE])
def test_applying_every_suggested_fix_removes_every_finding(case: str, config: OptimizerConfig, build: Any, overrides: Any) -> None:
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups, routing = resolve_group_configs(config, model, overrides())
        found = lint_routing(groups, routing)
        assert found and all(f.fix is not None for f in found), case
        fixed = apply_fixes(routing, [f.fix for f in found if f.fix is not None])
        groups, routing = resolve_group_configs(config, model, fixed)
    assert [(f.kind, f.params) for f in lint_routing(groups, routing)] == [], case
