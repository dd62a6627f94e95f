"""The fallback roles, guessed from the model when no forward is observed: each source, their order.

Sources, in order: explicit tags (``optzoo_role``, Megatron's ``is_embedding_or_output_parameter``
and ``allreduce=False``), the model's API (``get_input_embeddings``/``get_output_embeddings``),
module types, names. Roles hold on the meta device, across chunks, for tied weights, and through
``ParamKey(role=...)``; FSDP2 is covered in tests/distributed/test_fsdp2.py. Roles read from the
forward are tests/routing/test_dataflow.py's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optzoo._common import ROLES
from optzoo.models import GPT, GPTConfig
from optzoo.routing import ParamKey, ParamRoles, infer_roles, param_roles, resolve_param_groups


class NanoGPT(nn.Module):
    """nanoGPT's layout: ``transformer.wte`` tied to ``lm_head``, learned ``wpe``, LayerNorms, Linears."""

    def __init__(self, vocab: int = 32, hidden: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, hidden), "wpe": nn.Embedding(16, hidden),
            "h": nn.ModuleList(nn.ModuleDict({
                "ln_1": nn.LayerNorm(hidden), "attn": nn.ModuleDict({"c_attn": nn.Linear(hidden, 3 * hidden), "c_proj": nn.Linear(hidden, hidden)}),
                "ln_2": nn.LayerNorm(hidden, bias=False), "mlp": nn.ModuleDict({"c_fc": nn.Linear(hidden, 4 * hidden), "c_proj": nn.Linear(4 * hidden, hidden)}),
            }) for _ in range(layers)),
            "ln_f": nn.LayerNorm(hidden),
        })  # fmt: skip
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight


class Experts(nn.Module):
    def __init__(self, count: int = 4, hidden: int = 8, inner: int = 6) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(count, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.zeros(count, hidden, inner))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(count, 2 * inner))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = Experts()


def described(model: nn.Module) -> dict[str, str]:
    """Each param's roles as ``--explain`` shows them, guessed (``trace=False``): the fallback's rules."""
    roles = infer_roles(model, trace=False)
    return {name: roles[id(p)].describe().replace(", guessed)", ")") for name, p in model.named_parameters()}


def test_nanogpt_roles_come_from_module_types_the_tie_and_names() -> None:
    roles = described(NanoGPT(layers=1))
    assert roles == {
        "transformer.wte.weight": "embedding (nn.Embedding); output (nn.Linear sharing an embedding's weight)",
        "transformer.wpe.weight": "embedding (nn.Embedding)",
        "transformer.h.0.ln_1.weight": "norm (LayerNorm)",
        "transformer.h.0.ln_1.bias": "norm (LayerNorm); bias (name)",
        "transformer.h.0.attn.c_attn.weight": "matrix (2-D)",
        "transformer.h.0.attn.c_attn.bias": "bias (name)",
        "transformer.h.0.attn.c_proj.weight": "matrix (2-D)",
        "transformer.h.0.attn.c_proj.bias": "bias (name)",
        "transformer.h.0.ln_2.weight": "norm (LayerNorm)",
        "transformer.h.0.mlp.c_fc.weight": "matrix (2-D)",
        "transformer.h.0.mlp.c_fc.bias": "bias (name)",
        "transformer.h.0.mlp.c_proj.weight": "matrix (2-D)",
        "transformer.h.0.mlp.c_proj.bias": "bias (name)",
        "transformer.ln_f.weight": "norm (LayerNorm)",
        "transformer.ln_f.bias": "norm (LayerNorm); bias (name)",
    }


def test_experts_routers_and_bias_stacks() -> None:
    assert described(MoE()) == {
        "gate.weight": "router (Linear)",
        "experts.gate_up_proj": "expert (Experts)",
        "experts.down_proj": "expert (Experts)",
        "experts.gate_up_proj_bias": "expert (Experts); bias (name)",
    }


def test_a_module_list_of_experts_and_megatron_allreduce_tag_are_experts() -> None:
    model = nn.Module()
    model.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    model.shared = nn.Linear(4, 4)
    model.shared.weight.allreduce = False  # type: ignore[attr-defined]
    roles = described(model)
    assert roles["experts.0.weight"] == "expert (Linear inside an experts module)"
    assert roles["experts.1.bias"] == "expert (Linear inside an experts module); bias (name)"
    assert roles["shared.weight"] == "expert (tag allreduce=False)"


def test_norms_by_type_and_by_class_name() -> None:
    class LlamaRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    model = nn.ModuleDict({
        "ln": nn.LayerNorm(4), "rms": nn.RMSNorm(4), "group": nn.GroupNorm(2, 4), "batch": nn.BatchNorm1d(4),
        "instance": nn.InstanceNorm1d(4, affine=True), "custom": LlamaRMSNorm(),
    })  # fmt: skip
    roles = described(model)
    assert {name: role for name, role in roles.items() if name.endswith("weight")} == {
        "ln.weight": "norm (LayerNorm)", "rms.weight": "norm (RMSNorm)", "group.weight": "norm (GroupNorm)",
        "batch.weight": "norm (BatchNorm1d)", "instance.weight": "norm (InstanceNorm1d)", "custom.weight": "norm (LlamaRMSNorm)",
    }  # fmt: skip


def test_conv_filters_and_depthwise_filters() -> None:
    model = nn.ModuleDict({"conv": nn.Conv2d(3, 8, 3), "depthwise": nn.Conv1d(8, 8, 4, groups=8), "up": nn.ConvTranspose2d(8, 4, 2)})
    assert described(model) == {
        "conv.weight": "conv (Conv2d)",
        "conv.bias": "bias (name)",
        "depthwise.weight": "conv (Conv1d); vector (Conv1d, depthwise (groups == in_channels))",
        "depthwise.bias": "bias (name)",
        "up.weight": "conv (ConvTranspose2d)",
        "up.bias": "bias (name)",
    }


def test_the_model_api_names_the_ends() -> None:
    class WithApi(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Parameter(torch.zeros(10, 4))  # not an nn.Embedding: only the API says so
            self.proj = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10)

        def get_input_embeddings(self) -> nn.Module:
            holder = nn.Module()
            holder.weight = self.tokens
            return holder

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    roles = described(WithApi())
    assert roles["tokens"] == "embedding (get_input_embeddings())"
    assert roles["head.weight"] == "output (get_output_embeddings())"
    assert roles["proj.weight"] == "matrix (2-D)"


def test_an_api_that_raises_is_skipped() -> None:
    class Vision(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))

        def get_input_embeddings(self) -> nn.Module:
            raise NotImplementedError

    assert described(Vision())["classifier.1.weight"] == "output (name (classifier))"


def test_a_megatron_tagged_model_is_taken_at_its_word_about_embeddings() -> None:
    untied = GPT(GPTConfig(num_layers=1, hidden_size=8, num_heads=2, vocab_size=16, max_seq_len=4))
    assert described(untied)["output_layer.weight"] == "output (tag is_embedding_or_output_parameter)"
    model = GPT(GPTConfig(num_layers=1, hidden_size=8, num_heads=2, vocab_size=16, max_seq_len=4, tie_embeddings=True))
    tied = infer_roles(model, trace=False)
    word, position = model.embedding.word_embeddings.weight, model.embedding.position_embeddings.weight
    assert tied[id(word)].describe() == (
        "embedding (tag is_embedding_or_output_parameter, guessed); output (tag is_embedding_or_output_parameter, guessed)"
    )
    assert tied[id(position)] == ParamRoles(
        ("matrix",), ("2-D",), (("embedding", "Embedding, untagged in a Megatron-tagged model"),), guessed=True
    )
    assert len(tied) == len(list(model.parameters()))


def test_explicit_role_attribute_replaces_inference_and_is_checked() -> None:
    model = MoE()
    model.gate.weight.optzoo_role = ("expert", "matrix")  # type: ignore[attr-defined]
    model.experts.down_proj.optzoo_role = "vector"  # type: ignore[attr-defined]
    roles = described(model)
    assert roles["gate.weight"] == "expert (tag optzoo_role); matrix (tag optzoo_role)"
    assert roles["experts.down_proj"] == "vector (tag optzoo_role)"
    model.gate.weight.optzoo_role = "experts"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=(
        r"^`gate\.weight`: attribute optzoo_role names no known role; got 'experts'; expected a role or a tuple of roles "
        r"from \['embedding', 'output', 'bias', 'norm', 'elementwise', 'expert', 'router', 'conv', 'input', 'matrix', 'vector'\]$"
    )):  # fmt: skip
        infer_roles(model)


def test_roles_on_the_meta_device_and_across_chunks() -> None:
    with torch.device("meta"):
        first, second = NanoGPT(layers=1), NanoGPT(layers=1)
    second.lm_head.weight = first.transformer["wte"].weight  # tied across chunks
    roles = infer_roles([first, second], trace=False)
    shared = first.transformer["wte"].weight
    assert roles[id(shared)].describe() == "embedding (nn.Embedding, guessed); output (nn.Linear sharing an embedding's weight, guessed)"
    assert roles[id(second.transformer["wte"].weight)].describe() == "embedding (nn.Embedding, guessed)"  # untied in chunk 1
    assert {p.device.type for p in first.parameters()} == {"meta"}


def test_a_lone_parameter_has_the_roles_its_tags_name_and_shape_give() -> None:
    expert = torch.nn.Parameter(torch.zeros(2, 3, 4))
    expert.allreduce = False  # type: ignore[attr-defined]
    assert param_roles(expert, "layers.0.mlp.experts.weight").describe() == "expert (tag allreduce=False)"
    assert param_roles(torch.zeros(3), "x.scale").describe() == "vector (1-D)"
    assert param_roles(torch.zeros(()), "x.temperature").describe() == "elementwise (0-D)"  # a scalar can only scale


def test_param_key_matches_roles_from_the_model_or_from_the_param_alone() -> None:
    model = MoE()
    routing = resolve_param_groups(
        model, {ParamKey(role="expert"): {"optimizer": "muon"}, ParamKey(role="router"): {"lr": 0.1}}, trace=False
    )
    assert [(dict(g.override), g.names) for g in routing.groups] == [
        ({"lr": 0.1}, ["gate.weight"]),
        ({"optimizer": "muon"}, ["experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias"]),
    ]
    key = ParamKey(role=("bias", "norm"))
    assert key.matches(torch.zeros(4, 8), "experts.gate_up_proj_bias")  # no model: the name says bias
    assert not key.matches(torch.zeros(4), "norm.weight")  # no model: a norm is known by its module only
    assert key.describe() == "role=('bias', 'norm')"


def test_param_key_rejects_an_unknown_role() -> None:
    with pytest.raises(ValueError, match=rf"^`ParamKey\.role`: unknown role; got 'experts'; expected one of {list(ROLES)!r}$".replace("[", r"\[").replace("]", r"\]")):
        ParamKey(role="experts")
    with pytest.raises(TypeError, match=r"^`ParamKey\.role`: entries must be str; got 3 \(int\)"):
        ParamKey(role=3)  # type: ignore[arg-type]


def test_every_role_name_is_documented() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "roles.md").read_text()
    for role in ROLES:
        assert f"| `{role}` |" in page, role
