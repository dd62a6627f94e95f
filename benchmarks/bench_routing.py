"""Benchmark: resolve the parameter groups of a 10,000-parameter model against 50 keys.

The model is a deep, narrow GPT-like stack with Megatron-Core names
(``decoder.layers.N.self_attention.linear_qkv.weight``, ...): 833 layers of 12 parameters plus
the word embedding, the final layernorm and the output layer, 10,000 named parameters in all.
The 50 keys mix 25 name globs, 10 attributes, 10 predicates and 5 name predicates, and are
conflict-free, as a real recipe would be.

Run with pytest-benchmark (benchmarks are disabled by default in ``pyproject.toml``)::

    .venv/bin/python -m pytest benchmarks/bench_routing.py --benchmark-enable

or as a script, which prints the median wall time measured with :mod:`timeit`::

    .venv/bin/python -m benchmarks.bench_routing
"""

from __future__ import annotations

import statistics
import timeit
from typing import Any

import pytest
import torch
from torch import nn

from optzoo.routing import (
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    Routing,
    resolve_param_groups,
)

NUM_PARAMS = 10_000
NUM_KEYS = 50
NUM_LAYERS = 833  # 833 * 12 + 4 = 10,000
HIDDEN = 4  # narrow: routing cost depends on the number of tensors, not their size
MOE_GROUPS = 7


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.self_attention.linear_proj = nn.Linear(HIDDEN, HIDDEN)
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.mlp.linear_fc2 = nn.Linear(4 * HIDDEN, HIDDEN)


def build_model() -> nn.Module:
    """A GPT-shaped module with exactly ``NUM_PARAMS`` named parameters and Megatron attributes."""
    model = nn.Module()
    model.embedding = nn.Module()
    model.embedding.word_embeddings = nn.Embedding(64, HIDDEN)
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList(_Block() for _ in range(NUM_LAYERS))
    model.decoder.final_layernorm = nn.LayerNorm(HIDDEN)
    model.output_layer = nn.Linear(HIDDEN, 64, bias=False)

    model.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
    model.output_layer.weight.is_embedding_or_output_parameter = True
    for index, block in enumerate(model.decoder.layers):
        for norm in (block.input_layernorm, block.pre_mlp_layernorm):
            for param in norm.parameters():
                param.sequence_parallel = True
        for linear in (block.self_attention.linear_qkv, block.mlp.linear_fc1):
            linear.weight.tensor_model_parallel = True
        setattr(block.mlp.linear_fc1.weight, f"moe_group_{index % MOE_GROUPS}", True)

    count = sum(1 for _ in model.named_parameters())
    assert count == NUM_PARAMS, count
    return model


def build_overrides() -> dict[ParamKey, dict[str, Any]]:
    """50 conflict-free keys: every field is set to one value by all keys that set it."""
    overrides: dict[ParamKey, dict[str, Any]] = {}
    # 25 name globs.
    overrides[ParamKey(name="*.bias")] = {"wd_mult": 0.0}
    overrides[ParamKey(name="*layernorm*")] = {"wd_mult": 0.0}
    overrides[ParamKey(name="decoder.final_layernorm.*")] = {"wd_mult": 0.0}
    overrides[ParamKey(name="embedding.*")] = {"lr_mult": 0.1}
    overrides[ParamKey(name="output_layer.weight")] = {"lr_mult": 0.1}
    overrides[ParamKey(name=("*.linear_proj.weight", "*.linear_fc2.weight"))] = {"scaled_init": True}
    overrides[ParamKey(name="*.self_attention.*")] = {"attention": True}
    for digit in range(1, 10):
        overrides[ParamKey(name=f"decoder.layers.{digit}*.mlp.*")] = {"mlp_lr_mult": 0.5}
    for digit in range(1, 10):
        overrides[ParamKey(name=f"decoder.layers.{digit}*.self_attention.linear_qkv.*")] = {"qkv_eps": 1e-8}
    # 10 attributes.
    overrides[ParamKey(attr="is_embedding_or_output_parameter")] = {"max_lr": 1e-3}
    overrides[ParamKey(attr="sequence_parallel")] = {"sequence_parallel": True}
    overrides[ParamKey(attr="tensor_model_parallel")] = {"tensor_parallel": True}
    for group in range(MOE_GROUPS):
        overrides[ParamKey(attr=f"moe_group_{group}")] = {"expert": True}
    # 10 predicates on the tensor.
    overrides[ParamKey(predicate=ParamPredicate(name="is_1d", fn=lambda p: p.ndim == 1))] = {"wd_mult": 0.0}
    overrides[ParamKey(predicate=ParamPredicate(name="is_2d", fn=lambda p: p.ndim == 2))] = {"matrix": True}
    overrides[ParamKey(predicate=ParamPredicate(name="square", fn=lambda p: p.ndim == 2 and p.shape[0] == p.shape[1]))] = {
        "square": True
    }
    overrides[ParamKey(predicate=ParamPredicate(name="tall", fn=lambda p: p.ndim == 2 and p.shape[0] > p.shape[1]))] = {
        "tall": True
    }
    overrides[ParamKey(predicate=ParamPredicate(name="wide", fn=lambda p: p.ndim == 2 and p.shape[0] < p.shape[1]))] = {
        "wide": True
    }
    for threshold in (4, 8, 16, 32, 48):
        pred = ParamPredicate(name=f"numel_ge_{threshold}", fn=lambda p, t=threshold: p.numel() >= t)
        overrides[ParamKey(predicate=pred)] = {f"numel_ge_{threshold}": True}
    # 5 predicates on the tensor and its name.
    named = [
        ("1d_not_qk_layernorm", lambda p, n: p.ndim == 1 and "q_layernorm." not in n and "k_layernorm." not in n),
        ("even_layer", lambda p, n: n.startswith("decoder.layers.") and int(n.split(".")[2]) % 2 == 0),
        ("last_100_layers", lambda p, n: n.startswith("decoder.layers.") and int(n.split(".")[2]) >= NUM_LAYERS - 100),
        ("fc1_weight", lambda p, n: n.endswith("linear_fc1.weight")),
        ("top_level", lambda p, n: n.count(".") == 1),
    ]
    fields = ["wd_mult", "even", "late", "fc1", "top_level"]
    values: list[Any] = [0.0, True, True, True, True]
    for (name, fn), field, value in zip(named, fields, values, strict=True):
        overrides[ParamKey(with_name_predicate=ParamWithNamePredicate(name=name, fn=fn))] = {field: value}

    assert len(overrides) == NUM_KEYS, len(overrides)
    return overrides


def resolve(model: nn.Module, overrides: dict[ParamKey, dict[str, Any]]) -> Routing:
    return resolve_param_groups([model], overrides, strict=True)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return build_model()


@pytest.fixture(scope="module")
def overrides() -> dict[ParamKey, dict[str, Any]]:
    return build_overrides()


def test_resolve_10k_params_50_keys(benchmark: Any, model: nn.Module, overrides: dict[ParamKey, Any]) -> None:
    routing = benchmark(resolve, model, overrides)
    assert sum(len(group.params) for group in routing.groups) == NUM_PARAMS
    assert routing.unmatched == ()


def main(repeat: int = 7) -> None:
    torch.manual_seed(0)
    model, overrides = build_model(), build_overrides()
    routing = resolve(model, overrides)  # warm-up, and a sanity check of the setup
    times = timeit.repeat(lambda: resolve(model, overrides), number=1, repeat=repeat)
    print(
        f"resolve_param_groups: {NUM_PARAMS} params x {NUM_KEYS} keys -> {len(routing.groups)} groups; "
        f"median {statistics.median(times) * 1e3:.1f} ms over {repeat} runs "
        f"(min {min(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
