"""Roles read from one observed forward: what each parameter is, by what the forward does with it.

Every model here is a few lines of plain ``nn.Module``; each expectation is written by hand from
its ``forward`` (the comment says which line decides). Placement is checked through the Muon
routing with the standard overrides: hidden matrices on Muon with decay, input tables and heads
on AdamW, elementwise params (gains, biases, SSM parameters) on AdamW without decay. The same
forward must leave the model exactly as it was.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optzoo import GuessedRolesWarning, OptimizerConfig, infer_roles, resolve_group_configs

MUON = OptimizerConfig(optimizer="muon", lr=1e-3, weight_decay=0.1)
ON_MUON, TABLE_OR_HEAD, NO_DECAY = ("muon", 0.1), ("adam", 0.1), ("adam", 0.0)


def roles_of(model: nn.Module, **kwargs: object) -> dict[str, frozenset[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", GuessedRolesWarning)  # every model here must be observed
        roles = infer_roles(model, **kwargs)  # type: ignore[arg-type]
    return {name: roles[id(p)].names for name, p in model.named_parameters()}


def placement(model: nn.Module, **kwargs: object) -> dict[str, tuple[str, float]]:
    groups, _ = resolve_group_configs(MUON, model, **kwargs)  # type: ignore[arg-type]
    return {name: (g.optimizer, g.weight_decay) for g in groups for names in g.all_names for name in names}


def view_of(model: nn.Module, name: str) -> tuple[int, int, int] | None:
    """``(blocks, out, in)`` of the matrices the forward multiplies ``name`` by."""
    param = dict(model.named_parameters())[name]
    view = infer_roles(model)[id(param)].view
    return None if view is None else (view.count, *view.shape)


# ---- heads, wherever they live --------------------------------------------------------------


class SpanHead(nn.Module):
    """BERT-for-QA's shape: an encoder, then ``qa_outputs`` giving start and end logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layer = nn.Linear(16, 16)
        self.qa_outputs = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(ids)
        h = h + torch.tanh(self.layer(h))
        start, end = self.qa_outputs(h).split(1, dim=-1)  # their product is the output: a head
        return {"start_logits": start.squeeze(-1), "end_logits": end.squeeze(-1)}


class ClassificationHead(nn.Module):
    """RoBERTa's ``classification_head``: ``dense`` feeds ``out_proj``; ``out_proj`` gives the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.dense = nn.Linear(16, 16)
        self.out_proj = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)[:, 0]
        return self.out_proj(torch.tanh(self.dense(h)))


class Distilled(nn.Module):
    """DeiT's teacher head: two heads whose logits are averaged (and returned apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(12, 16)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 16))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, 16))
        self.block = nn.Linear(16, 16)
        self.cls_classifier = nn.Linear(16, 5)
        self.distillation_classifier = nn.Linear(16, 5)

    def forward(self, patches: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.patch(patches)  # the raw input's matmul: an input layer
        b = x.shape[0]
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.dist_token.expand(b, -1, -1), x], dim=1)  # tables
        x = x + self.block(x)
        cls, dist = self.cls_classifier(x[:, 0]), self.distillation_classifier(x[:, 1])
        return (cls + dist) / 2, cls, dist


def test_task_heads_are_heads_whatever_their_name() -> None:
    assert roles_of(SpanHead())["qa_outputs.weight"] == {"output"}
    assert placement(SpanHead())["qa_outputs.weight"] == TABLE_OR_HEAD
    assert placement(SpanHead())["layer.weight"] == ON_MUON  # its product goes on into qa_outputs

    head = roles_of(ClassificationHead())
    assert head["out_proj.weight"] == {"output"} and head["dense.weight"] == {"matrix"}
    assert placement(ClassificationHead())["dense.weight"] == ON_MUON

    distilled = roles_of(Distilled(), example_inputs=torch.zeros(2, 6, 12))
    assert distilled["cls_classifier.weight"] == distilled["distillation_classifier.weight"] == {"output"}
    assert distilled["cls_token"] == distilled["dist_token"] == {"embedding"}  # concatenated into the sequence
    assert distilled["patch.weight"] == {"matrix", "input"}
    assert distilled["block.weight"] == {"matrix"}


def test_a_residual_stream_returned_makes_no_heads() -> None:
    class Base(nn.Module):  # a base model: returns its last hidden state, a sum of every layer's writes
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            for layer in self.layers:
                h = h + layer(h)
            return h

    assert roles_of(Base()) == {"embed.weight": {"embedding"}, "layers.0.weight": {"matrix"}, "layers.0.bias": {"bias"},
                                "layers.1.weight": {"matrix"}, "layers.1.bias": {"bias"}}  # fmt: skip


# ---- tables that are bare parameters ---------------------------------------------------------


class Tables(nn.Module):
    """A learned position table added, a latent array as queries, a mask token put in by ``where``,
    a relative-position bias table gathered by a buffer of indices."""

    def __init__(self) -> None:
        super().__init__()
        self.position_embeddings = nn.Parameter(torch.zeros(1, 8, 16))
        self.latents = nn.Parameter(torch.zeros(4, 16))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, 16))
        self.relative_bias_table = nn.Parameter(torch.zeros(15, 2))
        self.register_buffer("relative_index", torch.arange(8)[:, None] - torch.arange(8)[None, :] + 7)
        self.q = nn.Linear(16, 16)
        self.kv = nn.Linear(16, 32)
        self.out = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.where(mask[..., None], self.mask_token, x) + self.position_embeddings  # tables
        q = self.q(self.latents)  # the latent array is the data operand of q: a table
        k, v = self.kv(x).chunk(2, dim=-1)
        scores = q @ k.transpose(-1, -2) + self.relative_bias_table[self.relative_index[:4]].sum(-1)  # a lookup
        return self.out(scores.softmax(-1) @ v)


def test_tables_that_are_bare_parameters() -> None:
    inputs = (torch.zeros(2, 8, 16), torch.zeros(2, 8, dtype=torch.bool))
    roles = roles_of(Tables(), example_inputs=inputs)
    for name in ("position_embeddings", "latents", "mask_token", "relative_bias_table"):
        assert roles[name] == {"embedding"}, name
    assert roles["q.weight"] == roles["kv.weight"] == {"matrix"}
    assert roles["kv.weight"] == {"matrix"}
    where = placement(Tables(), example_inputs=inputs)
    assert {where[n] for n in ("position_embeddings", "latents", "mask_token", "relative_bias_table")} == {TABLE_OR_HEAD}


# ---- elementwise parameters of any shape -----------------------------------------------------


class Gains(nn.Module):
    """Mamba's SSM parameters, RWKV's time-mix, ConvNeXt-V2's GRN, CLIP's 0-D logit scale, weight norm's g."""

    def __init__(self) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(16, 4))  # 2-D, used as exp(A) * dt
        self.D = nn.Parameter(torch.ones(16))
        self.dt_bias = nn.Parameter(torch.zeros(16))
        self.time_mix = nn.Parameter(torch.ones(1, 1, 16))
        self.grn_gamma = nn.Parameter(torch.zeros(1, 1, 1, 16))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.proj = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16, bias=False))
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = torch.roll(x, 1, dims=1)
        x = torch.lerp(shifted, x, self.time_mix)  # RWKV's token shift
        dt = F.softplus(x + self.dt_bias)
        decay = torch.exp(-torch.exp(self.A_log)[None, None] * dt[..., None])
        x = decay.sum(-1) * x + x * self.D  # Mamba's skip: y + x * D
        x = x + self.grn_gamma[0] * x
        return self.head(self.proj(x)) * self.logit_scale.exp()


def test_gains_of_any_rank_are_elementwise_and_not_decayed() -> None:
    roles = roles_of(Gains())
    for name in ("A_log", "D", "time_mix", "grn_gamma", "logit_scale", "proj.parametrizations.weight.original0"):
        assert "elementwise" in roles[name] and "matrix" not in roles[name], (name, roles[name])
    assert roles["dt_bias"] == {"bias"}
    assert roles["proj.parametrizations.weight.original1"] == {"matrix"}  # weight norm's v: the matrix
    where = placement(Gains())
    assert {where[n] for n in ("A_log", "D", "dt_bias", "time_mix", "grn_gamma", "logit_scale")} == {NO_DECAY}
    assert where["proj.parametrizations.weight.original0"] == NO_DECAY
    assert where["proj.parametrizations.weight.original1"] == ON_MUON


# ---- blocks: several matrices in one tensor ---------------------------------------------------


class Blocks(nn.Module):
    """Experts concatenated ``[E*ffn, H]`` (DBRX), stacks ``[E, in, out]`` used as ``x @ w[e]``, a
    grouped projection ``[G*r, d]`` (block-diagonal), per-head matrices ``[H, d, d]``, and a grouped conv."""

    E, FFN, H, G, R, HEADS = 3, 6, 8, 2, 5, 2

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(self.H, self.E, bias=False)
        self.w1 = nn.Parameter(torch.randn(self.E * self.FFN, self.H))
        self.w2 = nn.Parameter(torch.randn(self.E, self.FFN, self.H))  # [E, in, out]
        self.grouped = nn.Parameter(torch.randn(self.G * self.R, self.H // self.G))
        self.per_head = nn.Parameter(torch.randn(self.HEADS, self.H // self.HEADS, self.H // self.HEADS))
        self.conv = nn.Conv1d(self.H, self.H, 3, padding=1, groups=2)
        self.out = nn.Linear(self.G * self.R + self.H, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)  # a router
        w1 = self.w1.view(self.E, self.FFN, self.H)
        mixed = torch.zeros_like(x)
        for e in range(self.E):
            mask = (chosen == e).any(-1, keepdim=True)
            mixed = mixed + mask * (F.gelu(x @ w1[e].T) @ self.w2[e])
        x = x + mixed
        b, t, _ = x.shape
        groups = x.view(b, t, self.G, self.H // self.G)
        grouped = torch.einsum("btgd,grd->btgr", groups, self.grouped.view(self.G, self.R, -1)).reshape(b, t, -1)
        heads = x.view(b, t, self.HEADS, -1)
        x = x + torch.einsum("bthd,hde->bthe", heads, self.per_head).reshape(b, t, -1)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.out(torch.cat([grouped, x], dim=-1))


def test_blocks_come_from_how_the_forward_splits_a_tensor() -> None:
    model = Blocks()
    inputs = torch.zeros(2, 5, Blocks.H)
    roles = roles_of(model, example_inputs=inputs)
    assert roles["router.weight"] == {"matrix", "router", "input"}  # x is the raw model input
    assert roles["w1"] == {"matrix", "input"} and roles["w2"] == {"matrix"}  # every expert runs (masked): not chosen by index
    assert roles["conv.weight"] == {"matrix", "conv"}
    e, ffn, h, g, r, heads = Blocks.E, Blocks.FFN, Blocks.H, Blocks.G, Blocks.R, Blocks.HEADS
    infer = lambda name: view_of_with(model, name, inputs)  # noqa: E731
    assert infer("w1") == (e, ffn, h)  # x @ w1[e].T: out = ffn, in = hidden
    assert infer("w2") == (e, h, ffn)  # h @ w2[e], w2 [E, in, out]: out = hidden, in = ffn
    assert infer("grouped") == (g, r, h // g)
    assert infer("per_head") == (heads, h // heads, h // heads)
    assert infer("conv.weight") == (2, h // 2, h // 2 * 3)  # groups=2: out/2 x (in/2 x kernel)
    assert infer("router.weight") == (1, e, h)


def view_of_with(model: nn.Module, name: str, inputs: torch.Tensor) -> tuple[int, int, int] | None:
    param = dict(model.named_parameters())[name]
    view = infer_roles(model, example_inputs=inputs)[id(param)].view
    return None if view is None else (view.count, *view.shape)


class RoutedExperts(nn.Module):
    """Experts chosen per token by a router's top-1, each expert's matrix picked by its index."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 12, 8))  # [E, out, in]
        self.expert_bias = nn.Parameter(torch.zeros(4, 12))
        self.down = nn.Linear(12, 8)
        self.lm_head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        chosen = self.gate(x).argmax(-1)  # the data chooses each token's expert
        up = torch.einsum("bti,btoi->bto", x, self.experts[chosen]) + self.expert_bias[chosen]
        return self.lm_head(x + self.down(F.relu(up)))


def test_blocks_the_data_chooses_are_experts() -> None:
    roles = roles_of(RoutedExperts())
    assert roles["experts"] == {"matrix", "expert"}
    assert roles["expert_bias"] == {"bias", "expert"}  # rows picked by the router, then added
    assert roles["gate.weight"] == {"matrix", "router"}
    assert roles["embed.weight"] == {"embedding"} and roles["lm_head.weight"] == {"output"}
    assert view_of(RoutedExperts(), "experts") == (4, 12, 8)
    where = placement(RoutedExperts())
    assert where["experts"] == ON_MUON and where["expert_bias"] == NO_DECAY


def test_a_depthwise_conv_goes_to_the_scalar_optimizer() -> None:
    model = nn.Sequential(nn.Conv1d(8, 8, 4, groups=8, padding=3), nn.Conv1d(8, 16, 1), nn.Flatten(), nn.LazyLinear(3))
    model(torch.zeros(1, 8, 32))  # materialise the lazy layer
    roles = roles_of(model, example_inputs=torch.zeros(1, 8, 32))
    assert roles["0.weight"] == {"conv", "vector", "input"}
    assert roles["1.weight"] == {"matrix", "conv"}
    assert placement(model, example_inputs=torch.zeros(1, 8, 32))["0.weight"][0] == "adam"


def test_input_layers_stay_on_muon_unless_the_setting_moves_them() -> None:
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2))
    roles = roles_of(model)  # a Sequential of Linears: its input is made from the first one
    assert roles["0.weight"] == {"matrix", "input"} and roles["2.weight"] == {"matrix"} and roles["4.weight"] == {"output"}
    assert placement(model)["0.weight"] == ON_MUON
    groups, _ = resolve_group_configs(MUON.replace(muon_input_layers=False), model)
    assert {n: g.optimizer for g in groups for n in g.param_names}["0.weight"] == "adam"


# ---- wrappers, tags, inputs ------------------------------------------------------------------


class Wrapper(nn.Module):
    """A DDP-style wrapper: the model under ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)


def test_wrappers_are_looked_through() -> None:
    inner = SpanHead()
    unwrapped = roles_of(inner)
    assert {name.removeprefix("module."): roles for name, roles in roles_of(Wrapper(inner)).items()} == unwrapped
    compiled = torch.compile(inner)  # not compiled until called: the trace calls the module underneath
    assert {name.removeprefix("_orig_mod."): roles for name, roles in roles_of(compiled).items()} == unwrapped


class WithPositions(SpanHead):
    """SpanHead with a learned position table; its word embedding carries Megatron's tag, the position table none."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, 16)
        self.embed.weight.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))  # both read by index
        start, end = self.qa_outputs(h + torch.tanh(self.layer(h))).split(1, dim=-1)
        return {"start_logits": start, "end_logits": end}


def test_a_partly_tagged_model_keeps_its_untagged_tables_off_muon() -> None:
    roles = roles_of(WithPositions())
    assert roles["embed.weight"] == roles["pos.weight"] == {"embedding"}  # Megatron-Core would leave pos a matrix
    assert placement(WithPositions())["pos.weight"] == TABLE_OR_HEAD


def test_example_inputs_for_a_forward_that_needs_two_and_a_warning_without() -> None:
    model = Tables()
    with pytest.warns(GuessedRolesWarning, match=re.escape(
        "`Tables`: roles guessed from module types and names; could not observe its forward: Tables.forward takes 2 "
        "positional inputs; expected inputs for one forward: pass example_inputs= to get_optimizer or "
        "resolve_param_groups (a tensor, a tuple of inputs or a dict of keyword inputs; only shapes and dtypes "
        "matter), or --example-inputs to the optzoo command"
    )):  # fmt: skip
        guessed = infer_roles(model)
    assert all(guessed[id(p)].guessed for p in model.parameters())
    observed = infer_roles(model, example_inputs={"x": torch.zeros(1, 8, 16), "mask": torch.zeros(1, 8, dtype=torch.bool)})
    assert not any(observed[id(p)].guessed for p in model.parameters())
    assert infer_roles(model, trace=False)[id(model.latents)].describe() == "matrix (2-D, guessed)"


# ---- the forward leaves the model as it was --------------------------------------------------


class Stateful(nn.Module):
    """BatchNorm statistics, dropout (RNG), a cache attribute the forward sets, hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = x.shape  # a forward that caches
        return self.head(self.drop(self.bn(self.fc(x))))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_observing_the_forward_changes_nothing(device: str) -> None:
    torch.manual_seed(0)
    with torch.device(device):
        model = Stateful()
    model.train()
    calls: list[str] = []
    handle = model.fc.register_forward_hook(lambda *_: calls.append("hook"))
    if device == "cpu":
        model.fc.weight.grad = torch.ones(8, 8)
    params = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in params.items()} if device == "cpu" else {}
    buffers = {n: (b, b.clone() if device == "cpu" else None) for n, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    attributes = {id(m): dict(m.__dict__) for m in model.modules()}

    roles = infer_roles(model, example_inputs=torch.zeros(4, 8))
    assert roles[id(model.head.weight)].names == {"output"}

    assert dict(model.named_parameters()) == params  # the same tensors
    assert all(p.device.type == device for p in model.parameters())
    for name, value in values.items():
        assert torch.equal(params[name], value), name
    for name, (buffer, value) in buffers.items():
        assert dict(model.named_buffers())[name] is buffer
        if value is not None:
            assert torch.equal(buffer, value), name  # running stats untouched
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert model.training and all(m.training for m in model.modules())
    assert {id(m): dict(m.__dict__) for m in model.modules()} == attributes  # no cache left behind, same hooks
    assert not hasattr(model, "cache")
    if device == "cpu":
        assert torch.equal(model.fc.weight.grad, torch.ones(8, 8)) and model.fc.bias.grad is None
    handle.remove()


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        self.alias = self.body[0]  # the same module under two names: its params are tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def test_a_module_registered_twice_is_restored() -> None:
    model = Twice()
    before = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    roles = roles_of(model)
    assert roles["body.0.weight"] == {"matrix", "input"} and roles["body.2.weight"] == {"output"}
    assert dict(model.named_parameters(remove_duplicate=False)) == before
    assert {p.device.type for p in model.parameters()} == {"cpu"}
