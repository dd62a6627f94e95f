"""Every registry record's ``state_bytes`` against the state its optimizer really allocates.

The answer comes from outside the record: the bytes of the tensors in each param's optimizer
state after one real step through ``get_optimizer`` (on a tiny GPT and on a tiny Hugging Face
MoE model with 3-D expert stacks), for every registered name, so an algorithm registered later
is measured too.
"""

from __future__ import annotations

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer, resolve_group_configs
from optzoo.models import GPT, GPTConfig
from optzoo.optimizers.registry import get_spec, registered_names
from tests.conftest import tiny_qwen3_moe


def _gpt() -> torch.nn.Module:
    return GPT(GPTConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=64, max_seq_len=16))


def _measured(state: dict[str, object]) -> int:
    """The bytes of every tensor in one param's state, those in lists included (PSGD keeps a list
    of Kronecker factors per param)."""

    def nbytes(value: object) -> int:
        if isinstance(value, torch.Tensor):
            return value.nbytes
        if isinstance(value, (list, tuple)):
            return sum(nbytes(item) for item in value)
        return 0

    return sum(nbytes(value) for value in state.values())


@pytest.mark.parametrize("model_factory", [_gpt, tiny_qwen3_moe], ids=["gpt", "qwen3_moe"])
@pytest.mark.parametrize("name", registered_names())
def test_state_bytes_is_what_the_first_step_allocates(name: str, model_factory: object) -> None:
    torch.manual_seed(0)
    model = model_factory()  # type: ignore[operator]
    config = OptimizerConfig(optimizer=name, lr=1e-4)
    optimizer = get_optimizer(config, model)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()
    state = optimizer.state_dict()["state"]
    groups, _ = resolve_group_configs(config, model)
    checked = 0
    for group in groups:
        spec = get_spec(group.config.optimizer)
        fields = {field: getattr(group.config, field) for field in spec.config_fields}
        for param_name, routed in zip(group.param_names, group.params):
            expected = spec.state_bytes(tuple(routed.param.shape), fields, torch.float32)
            assert _measured(state[param_name]) == expected, (param_name, spec.name, tuple(routed.param.shape))
            checked += 1
    assert checked == len(list(model.parameters()))
