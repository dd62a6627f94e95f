"""Shared fixtures: a fixed seed and tiny models with realistic (Megatron-style) names."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import transformers

from optzoo import OptimizerConfig, get_optimizer
from optzoo.models import GPT, GPTConfig


@pytest.fixture(autouse=True, scope="session")
def ns_kernel_rule() -> Iterator[None]:
    """Muon's Newton–Schulz kernel is pinned to the deterministic FLOPs and device-type rule, as a
    user pins it (``OPTZOO_NS_VARIANT``): the probe times kernels, and what it picks depends on the
    machine's load. Session-scoped, so module-scoped fixtures (multi-rank runs and their one-process
    references) see it too; subprocesses inherit it. The probe's tests unset it for themselves."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPTZOO_NS_VARIANT", "auto")
        patch.delenv("OPTZOO_NS_CACHE", raising=False)
        yield


@pytest.fixture(autouse=True)
def seed() -> Iterator[int]:
    """Every test starts from the same RNG state."""
    torch.manual_seed(1234)
    yield 1234


def tiny_qwen3_moe() -> torch.nn.Module:
    """Hugging Face's Qwen3-MoE, tiny, seeded, with its experts as 3-D stacks
    (``mlp.experts.gate_up_proj``: experts x out x in); random init, nothing downloaded."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def tiny_gpt(*, tie_embeddings: bool = False, qk_layernorm: bool = False, num_layers: int = 2) -> GPT:
    """A GPT small enough for unit tests, with the built-in model's real parameter names."""
    return GPT(
        GPTConfig(
            vocab_size=32, hidden_size=16, num_layers=num_layers, num_heads=2, max_seq_len=8,
            tie_embeddings=tie_embeddings, qk_layernorm=qk_layernorm,
        )
    )


@pytest.fixture
def gpt() -> GPT:
    return tiny_gpt()


@pytest.fixture
def tied_gpt() -> GPT:
    return tiny_gpt(tie_embeddings=True)


def tokens(batch: int = 4, seq: int = 8, vocab: int = 32) -> torch.Tensor:
    """Random token ids of shape (batch, seq + 1) for ``GPT.loss``."""
    return torch.randint(vocab, (batch, seq + 1))


class OddShapes(torch.nn.Module):
    """Odd-shaped parameters (5x7, 33x65, ...) under realistic names for numeric parity tests."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 65)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"qkv": torch.nn.Linear(65, 33), "proj": torch.nn.Linear(7, 5)})
            for _ in range(2)
        )
        self.norm = torch.nn.LayerNorm(5)
        self.lm_head = torch.nn.Linear(5, 7, bias=False)
        self.embed.weight.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]
        self.lm_head.weight.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]


@pytest.fixture
def odd_model() -> OddShapes:
    return OddShapes()


def fill_grads(params: list[torch.Tensor], generator: torch.Generator) -> None:
    """Give every parameter a fresh random gradient (same stream for twin models)."""
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype)


def twin[M: torch.nn.Module](model: M) -> M:
    """An independent copy with identical values and parameter attributes.

    ``copy.deepcopy`` alone drops attributes set on parameters (such as
    ``is_embedding_or_output_parameter``), which would silently change the routing.
    """
    clone = copy.deepcopy(model)
    for source, copied in zip(model.parameters(), clone.parameters()):
        copied.__dict__.update(source.__dict__)
    return clone


def train_with_resumed_twin(
    model: torch.nn.Module, config: OptimizerConfig, *, steps: int, resume_after: int, grad_scale: float = 1.0
) -> tuple[torch.optim.Optimizer, torch.nn.Module]:
    """Step ``model`` and a deep copy of it ``steps`` times with the same random gradients; after
    step ``resume_after`` the copy's optimizer is rebuilt from a copy of the first one's state
    dict. Returns the first optimizer and the copy, whose params a resume that loses nothing
    leaves equal to the model's, bit for bit."""
    twin_model = twin(model)
    optimizer, twin_optimizer = get_optimizer(config, model), get_optimizer(config, twin_model)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        for p, q in zip(model.parameters(), twin_model.parameters()):
            grad = torch.randn(p.shape, generator=generator) * grad_scale
            p.grad, q.grad = grad.clone(), grad.clone()
        optimizer.step()
        twin_optimizer.step()
        if step == resume_after:
            twin_optimizer = get_optimizer(config, twin_model)
            twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return optimizer, twin_model


@pytest.fixture
def highest_precision() -> Iterator[None]:
    """IEEE float32 matmuls for the test (parity with references), the global setting restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)
