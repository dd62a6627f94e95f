"""Muon's default routing on the models people have: tiny Hugging Face models, a plain nanoGPT, a conv net.

Each model is built from its config class (random init, nothing downloaded, no tags) and routed
with ``OptimizerConfig(optimizer="muon")`` and the standard overrides, and every parameter's
placement is asserted by name: embeddings and heads (tied or not), norms, biases (GPT-OSS's 2-D
bias stacks too) and vectors on the scalar optimizer (biases, norms and vectors without weight
decay); attention and MLP matrices, routers and expert stacks on Muon; conv filters on Muon,
flattened. tests/integrations/test_hand_graded.py grades 59 more architectures, every parameter,
against categories written from their sources.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
import transformers  # noqa: E402 - in the test extra: missing, it fails here instead of skipping
from torch import nn

from benchmarks.routing_census import MODELS as CENSUS_MODELS
from optzoo import OptimizerConfig, ParamKey, get_optimizer, resolve_group_configs
from optzoo.hf import build_hf_model
from tests.conftest import train_with_resumed_twin
from tests.routing.test_roles import NanoGPT

MUON = OptimizerConfig(optimizer="muon", lr=1e-3, weight_decay=0.1)

MUON_DECAYED, ADAM_DECAYED, ADAM_NO_DECAY = ("muon", 0.1), ("adam", 0.1), ("adam", 0.0)


def placement(model: nn.Module, config: OptimizerConfig = MUON) -> dict[str, tuple[str, float]]:
    """``{name: (optimizer, weight decay)}`` for every name, tied ones included."""
    groups, _ = resolve_group_configs(config, model)
    return {name: (g.optimizer, g.weight_decay) for g in groups for names in g.all_names for name in names}


def expect(model: nn.Module, rules: list[tuple[str, tuple[str, float]]]) -> None:
    """Every name matches exactly one regex of ``rules``, whose placement it must have."""
    got = placement(model)
    for name, where in got.items():
        hits = [want for pattern, want in rules if re.fullmatch(pattern, name)]
        assert len(hits) == 1, (name, hits)
        assert where == hits[0], (name, where, hits[0])


ATTENTION = r"model\.layers\.\d\.self_attn\.[qkvo]_proj\.weight"
NORMS = r"model\.(layers\.\d\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)|norm)\.weight"
ENDS = r"model\.embed_tokens\.weight|lm_head\.weight"


@pytest.fixture(scope="module")
def hf() -> Callable[[str], nn.Module]:
    built: dict[str, nn.Module] = {}

    def get(spec: str) -> nn.Module:
        if spec not in built:
            torch.manual_seed(0)
            with torch.device("meta"):
                built[spec] = build_hf_model(spec)
        return built[spec]

    return get


def test_llama(hf: Callable[[str], nn.Module]) -> None:
    expect(hf("LlamaConfig"), [
        (ATTENTION, MUON_DECAYED), (r"model\.layers\.\d\.mlp\.(gate|up|down)_proj\.weight", MUON_DECAYED),
        (ENDS, ADAM_DECAYED), (NORMS, ADAM_NO_DECAY),
    ])  # fmt: skip


@pytest.mark.parametrize("spec", ["MixtralConfig", "Qwen3MoeConfig"])
def test_mixtral_and_qwen3_moe_experts_and_routers_on_muon(hf: Callable[[str], nn.Module], spec: str) -> None:
    model = hf(spec)
    expect(model, [
        (ATTENTION, MUON_DECAYED), (r"model\.layers\.\d\.mlp\.gate\.weight", MUON_DECAYED),
        (r"model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj", MUON_DECAYED), (ENDS, ADAM_DECAYED), (NORMS, ADAM_NO_DECAY),
    ])  # fmt: skip
    assert model.model.layers[0].mlp.experts.gate_up_proj.dim() == 3


def test_qwen2_moe_shared_expert_and_its_gate(hf: Callable[[str], nn.Module]) -> None:
    expect(hf("Qwen2MoeConfig"), [
        (ATTENTION, MUON_DECAYED), (r"model\.layers\.\d\.self_attn\.[qkv]_proj\.bias", ADAM_NO_DECAY),
        (r"model\.layers\.\d\.mlp\.(gate|shared_expert_gate)\.weight", MUON_DECAYED),
        (r"model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj", MUON_DECAYED),
        (r"model\.layers\.\d\.mlp\.shared_expert\.(gate|up|down)_proj\.weight", MUON_DECAYED),
        (ENDS, ADAM_DECAYED), (NORMS, ADAM_NO_DECAY),
    ])  # fmt: skip


def test_gpt_oss_bias_stacks_sinks_and_router_bias_are_not_muons(hf: Callable[[str], nn.Module]) -> None:
    model = hf("GptOssConfig")
    expect(model, [
        (ATTENTION, MUON_DECAYED), (r"model\.layers\.\d\.self_attn\.[qkvo]_proj\.bias", ADAM_NO_DECAY),
        (r"model\.layers\.\d\.self_attn\.sinks", ADAM_NO_DECAY),
        (r"model\.layers\.\d\.mlp\.router\.weight", MUON_DECAYED), (r"model\.layers\.\d\.mlp\.router\.bias", ADAM_NO_DECAY),
        (r"model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj", MUON_DECAYED),
        (r"model\.layers\.\d\.mlp\.experts\.(gate_up|down)_proj_bias", ADAM_NO_DECAY),
        (ENDS, ADAM_DECAYED), (NORMS, ADAM_NO_DECAY),
    ])  # fmt: skip
    assert model.model.layers[0].mlp.experts.gate_up_proj_bias.dim() == 2  # a 2-D stack of biases


@pytest.mark.parametrize("build", [lambda: build_hf_model("GPT2Config"), lambda: NanoGPT(vocab=32, hidden=8)])
def test_gpt2_and_nanogpt_tied_embedding_and_positions_are_not_muons(build: Callable[[], nn.Module]) -> None:
    with torch.device("meta"):
        model = build()
    got = placement(model)
    prefix = "transformer.h"
    for name, where in got.items():
        if name in ("transformer.wte.weight", "lm_head.weight", "transformer.wpe.weight"):
            assert where == ADAM_DECAYED, name
        elif re.fullmatch(rf"{prefix}\.\d\.(attn|mlp)\.c_\w+\.weight", name):
            assert where == MUON_DECAYED, name
        else:
            assert re.search(r"\.(ln_\w+|bias)", name) and where == ADAM_NO_DECAY, (name, where)
    assert got["lm_head.weight"] == got["transformer.wte.weight"]  # one tensor, two names


def test_a_conv_net_goes_to_muon_flattened_and_its_classifier_head_to_adam() -> None:
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = transformers.ResNetForImageClassification(config)
    groups, _ = resolve_group_configs(MUON, model)
    conv = [n for n, p in model.named_parameters() if p.dim() == 4]
    assert [(g.optimizer, list(g.param_names)) for g in groups if g.optimizer == "muon"] == [("muon", conv)]
    muon = next(g for g in groups if g.optimizer == "muon")
    # Each filter is the one matrix its convolution multiplies by: out channels by in channels x kernel.
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for name, routed in zip(muon.param_names, muon.params):
        out, inner, *kernel = shapes[name]
        view = muon.matrix_view_of(routed.param)
        assert view is not None and (view.count, *view.shape) == (1, out, inner * math.prod(kernel)), name
    where = placement(model)
    assert where["classifier.1.weight"] == ADAM_DECAYED
    assert {where[n] for n, p in model.named_parameters() if p.dim() == 1} == {ADAM_NO_DECAY}
    # muon_flatten_conv=False, for one group or all: the conv filters go to the scalar optimizer.
    off = placement(model, MUON.replace(muon_flatten_conv=False))
    assert {off[n] for n in conv} == {ADAM_DECAYED}


def test_conv_filters_switch_per_group_by_role() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8, 8))
    groups, _ = resolve_group_configs(MUON, model, {ParamKey(name="0.weight"): {"muon_flatten_conv": False}})
    assert [(g.optimizer, g.flatten, list(g.param_names)) for g in groups if g.params[0].param.dim() > 1] == [
        ("muon", False, ["3.weight"]),
        ("muon", True, ["1.weight"]),
        ("adam", False, ["0.weight"]),
    ]


@pytest.mark.parametrize("name", list(CENSUS_MODELS))
def test_every_census_model_steps_with_muon(name: str) -> None:
    torch.manual_seed(0)
    model = CENSUS_MODELS[name]()
    optimizer = get_optimizer(MUON, model)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ok, norm, _ = optimizer.step()
    assert ok and norm is not None and torch.isfinite(torch.tensor(norm))
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters()), name


def test_expert_stacks_are_costed_by_their_experts_and_owned_whole(hf: Callable[[str], nn.Module]) -> None:
    from optzoo.distributed import param_cost, plan_shards
    from optzoo.optimizers.newton_schulz import newton_schulz_flops

    groups, _ = resolve_group_configs(MUON, hf("Qwen3MoeConfig"))
    muon = next(g for g in groups if g.optimizer == "muon")
    stack = next(r.param for r in muon.params if r.param.dim() == 3)
    experts, rows, cols = stack.shape
    one = min(newton_schulz_flops(rows, cols, steps=5, variant=v) for v in ("standard", "gram"))
    assert param_cost(muon, stack) == experts * one
    for mode in ("layer_wise", "sharded"):
        plan = plan_shards(groups, 2, mode)  # type: ignore[arg-type]
        for name in muon.param_names:
            shards = [s for s in plan.shards if s.name == name]
            assert len(shards) == 1 and shards[0].whole, (mode, name)


def test_a_moe_checkpoint_round_trip_continues_bitwise() -> None:
    torch.manual_seed(0)
    model = build_hf_model("MixtralConfig")
    config = MUON.replace(muon_fp32_matmul_prec="highest")
    optimizer, twin = train_with_resumed_twin(model, config, steps=4, resume_after=1, grad_scale=1e-2)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
    state = optimizer.state_dict()["state"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert state["momentum_buffer"].shape == model.model.layers[0].mlp.experts.gate_up_proj.shape
