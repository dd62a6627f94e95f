"""torch's own Adafactor and Muon as optzoo names: through get_optimizer they equal the torch
classes stepped directly over the same groups, bit for bit (the same code runs on both sides)."""

from __future__ import annotations

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from optzoo.models import GPT, GPTConfig
from tests.conftest import fill_grads, twin

TORCH_KEYS = {
    "torch_muon": (torch.optim.Muon, ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn")),
    "adafactor": (torch.optim.Adafactor, ("lr", "weight_decay", "beta2_decay", "eps", "d")),
    "adam": (torch.optim.AdamW, ("lr", "weight_decay", "betas", "eps")),
}


def _references(groups: list[dict], by_name: dict[str, torch.Tensor]) -> list[torch.optim.Optimizer]:
    """torch's classes, built directly with the hyperparameters optzoo put in each group."""
    references = []
    for group in groups:
        cls, keys = TORCH_KEYS[group["optimizer"]]
        params = [by_name[name] for name in group["param_names"]]
        # optzoo takes torch's fused AdamW where supported (CPU too) and foreach Adafactor
        kernel = {"fused": True} if cls is torch.optim.AdamW else {"foreach": True} if cls is torch.optim.Adafactor else {}
        references.append(cls([{"params": params, **{key: group[key] for key in keys}}], **kernel))
    return references


def _gpt() -> GPT:
    return GPT(GPTConfig(hidden_size=32, num_layers=2, num_heads=2, vocab_size=64, max_seq_len=16))


@pytest.mark.parametrize(
    "config",
    [
        OptimizerConfig(optimizer="torch_muon", lr=0.02, muon_scalar_lr=1e-3, clip_grad=0.0),
        OptimizerConfig(
            optimizer="torch_muon", lr=0.02, clip_grad=0.0, torch_muon_nesterov=False, torch_muon_momentum=0.9,
            torch_muon_ns_steps=3, torch_muon_adjust_lr_fn="match_rms_adamw",
        ),
        OptimizerConfig(optimizer="adafactor", lr=1e-2, clip_grad=0.0, weight_decay=0.1),
        OptimizerConfig(
            optimizer="adafactor", lr=1e-2, clip_grad=0.0, adafactor_beta2_decay=-0.5, adafactor_eps1=1e-30,
            adafactor_eps2=1e-2, adafactor_d=2.0,
        ),
    ],
    ids=["torch_muon-defaults", "torch_muon-settings", "adafactor-defaults", "adafactor-settings"],
)  # fmt: skip
def test_equals_the_torch_class_stepped_directly(config: OptimizerConfig) -> None:
    model = _gpt()
    reference_model = twin(model)
    ours = get_optimizer(config, model)
    references = _references(ours.param_groups, dict(reference_model.named_parameters()))
    assert {g["optimizer"] for g in ours.param_groups} >= {config.optimizer}
    generator_a, generator_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(4):
        fill_grads(list(model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        ours.step()
        for reference in references:
            reference.step()
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        assert torch.equal(p, q), name


def test_torch_muon_takes_the_hidden_matrices_and_hands_the_rest_to_adam() -> None:
    # From optzoo.models.GPT's source: the fused QKV, the attention projection and the MLP's two
    # matrices per layer are hidden matrices; the token and position tables, the output layer, norms
    # and biases are not.
    model = _gpt()
    ours = get_optimizer(OptimizerConfig(optimizer="torch_muon", lr=0.02), model)
    taken = sorted(n for g in ours.param_groups if g["optimizer"] == "torch_muon" for n in g["param_names"])
    hidden = sorted(
        f"decoder.layers.{layer}.{matrix}.weight"
        for layer in range(2)
        for matrix in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    )
    assert taken == hidden
    assert all(g["optimizer"] == "adam" for g in ours.param_groups if g["optimizer"] != "torch_muon")


def test_adafactor_state_is_factored() -> None:
    # Shazeer & Stern (2018): a row and a column factor per matrix, a full second moment for vectors.
    model = torch.nn.Linear(12, 6)
    ours = get_optimizer(OptimizerConfig(optimizer="adafactor", lr=1e-2), model)
    fill_grads(list(model.parameters()), torch.Generator().manual_seed(0))
    ours.step()
    state = ours.state_dict()["state"]
    assert tuple(state["weight"]["row_var"].shape) == (6, 1) and tuple(state["weight"]["col_var"].shape) == (1, 12)
    assert tuple(state["bias"]["variance"].shape) == (6,)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("torch_muon_adjust_lr_fn", "spectral", "`OptimizerConfig.torch_muon_adjust_lr_fn`: unknown value; got 'spectral'; "
         "expected one of [None, 'original', 'match_rms_adamw', 'spectral_unclamped']; did you mean 'spectral_unclamped'?"),
        ("torch_muon_ns_steps", 0, "`OptimizerConfig.torch_muon_ns_steps`: must be a positive integer; got 0; expected an int >= 1"),
        ("torch_muon_momentum", 1.0, "`OptimizerConfig.torch_muon_momentum`: must lie in [0, 1); got 1.0; expected 0 <= torch_muon_momentum < 1"),
        ("adafactor_beta2_decay", 0.1, "`OptimizerConfig.adafactor_beta2_decay`: must not be positive; got 0.1; expected a float <= 0"),
        ("adafactor_eps1", -1.0, "`OptimizerConfig.adafactor_eps1`: must be non-negative; got -1.0; expected a float >= 0 or None"),
        ("adafactor_eps2", -1.0, "`OptimizerConfig.adafactor_eps2`: must be non-negative; got -1.0; expected a float >= 0"),
        ("adafactor_d", 0.5, "`OptimizerConfig.adafactor_d`: must be a finite number >= 1; got 0.5; expected a float >= 1"),
    ],
)  # fmt: skip
def test_bad_fields_are_refused_by_name(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        OptimizerConfig(lr=1e-3, **{field: value})
    assert str(raised.value) == message
