"""Learning-rate conventions: ``torch.optim.Muon``'s ``adjust_lr_fn`` ports to ``muon_scale_mode``
with the same ``lr``, through ``get_optimizer``, and the table in docs/optimizers.md is measured.

The reference is ``torch.optim.Muon`` itself. Its Newton–Schulz is hard-wired to bf16, so the
tight test swaps in a float64 line-for-line copy of it (tests/optimizers/reference/muon.py) and
steps float64 params: what remains is torch's own momentum, weight decay and ``adjust_lr_fn``
against ours. A second test runs torch as shipped (bf16) against our float32 engine.
"""

from __future__ import annotations

from typing import Any, get_args

import pytest
import torch
import torch.optim._muon as torch_muon

from benchmarks.lr_conventions import CONVENTIONS, update_rms
from optzoo import OptimizerConfig, ParamKey, get_optimizer
from optzoo.optimizers.muon import TorchAdjustLr, muon_scale_factor
from tests.optimizers.reference.muon import drive, torch_newton_schulz_in_float64

SQUARE, WIDE, TALL = (32, 32), (32, 96), (96, 32)
"""A 2-D param of each kind torch's ``adjust_lr_fn`` treats differently (rows = fan-out)."""
TORCH_NAMES: tuple[TorchAdjustLr, ...] = get_args(TorchAdjustLr)


class ThreeMatrices(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 96, bias=False)  # TALL
        self.down = torch.nn.Linear(96, 32, bias=False)  # WIDE
        self.mix = torch.nn.Linear(32, 32, bias=False)  # SQUARE

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.down(self.up(x)))


def _ported(mode: str, nesterov: bool, dtype: torch.dtype, **changes: Any) -> tuple[list[torch.nn.Parameter], Any, list[torch.nn.Parameter], Any]:
    """``torch.optim.Muon(lr=0.02, adjust_lr_fn=mode, ...)`` and optzoo built from the settings
    docs/optimizers.md gives for it, over equal params."""
    model = ThreeMatrices().to(dtype)
    ours = list(model.parameters())
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    reference = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=mode)
    config = OptimizerConfig(
        optimizer="muon", lr=0.02, weight_decay=0.1, muon_momentum=0.95, muon_nesterov=nesterov, muon_scale_mode=mode,
        muon_coefficient_type="simple", muon_num_ns_steps=5, clip_grad=0.0, **changes,
    )  # fmt: skip
    # The rule sends the output layer to Muon too, as torch.optim.Muon takes whatever it is given.
    optimizer = get_optimizer(config, model, {ParamKey(name="*"): {"optimizer": "muon"}}, lint=False)
    return ours, optimizer, theirs, reference


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("mode", TORCH_NAMES)
def test_torch_adjust_lr_fn_ports_with_the_same_lr(mode: str, nesterov: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", torch_newton_schulz_in_float64)
    ours, optimizer, theirs, reference = _ported(mode, nesterov, torch.float64)
    assert [tuple(p.shape) for p in ours] == [TALL, WIDE, SQUARE]
    drive([(optimizer, ours), (reference, theirs)], steps=10)
    for p, q in zip(ours, theirs, strict=True):
        # float64 on both sides; our Newton–Schulz prescales by max|x| and batches with bmm, so the
        # two round differently: measured worst 1.1e-15 relative after 5 steps; 1e-12 is a wide margin.
        torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(
            optimizer.optimizers[0].state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], atol=1e-12, rtol=1e-12
        )


@pytest.mark.parametrize("mode", TORCH_NAMES)
def test_torch_muon_as_shipped_within_bf16(mode: str) -> None:
    """torch's Newton–Schulz runs in bf16 on every device; ours in float32 on CPU (``medium``
    computes float32 where bf16 matmul is not fast). The updates then agree to bf16's accuracy."""
    ours, optimizer, theirs, reference = _ported(mode, True, torch.float32, muon_fp32_matmul_prec="highest")
    start = [p.detach().clone() for p in ours]
    drive([(optimizer, ours), (reference, theirs)], steps=5)
    for p, q, p0 in zip(ours, theirs, start, strict=True):
        ours_update, torch_update = p.detach() - p0, q.detach() - p0
        # bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3); 5 products per iteration and
        # 5 iterations leave torch's update about 1% off the exact polynomial (measured worst
        # 0.6% relative in Frobenius norm over these shapes and modes). 2% is the bar.
        error = torch.linalg.matrix_norm(ours_update - torch_update) / torch.linalg.matrix_norm(torch_update)
        assert error < 2e-2, (mode, tuple(p.shape), float(error))


@pytest.mark.parametrize("mode", TORCH_NAMES)
def test_scale_factor_is_torchs_adjusted_lr(mode: str) -> None:
    for rows, cols in [SQUARE, WIDE, TALL, (1024, 4096), (4096, 1024), (5, 7)]:
        assert 0.02 * muon_scale_factor(rows, cols, mode) == torch_muon._adjust_lr(0.02, mode, torch.Size([rows, cols]))  # type: ignore[arg-type]


def test_torch_takes_exactly_these_names() -> None:
    """The names come from torch: each is accepted by ``torch.optim.Muon`` and by the config."""
    param = torch.nn.Parameter(torch.zeros(2, 2))
    for name in TORCH_NAMES:
        torch.optim.Muon([param], adjust_lr_fn=name)
        assert OptimizerConfig(lr=0.02, optimizer="muon", muon_scale_mode=name).muon_scale_mode == name
    with pytest.raises(ValueError, match="Adjust learning rate function rms_to_rms is not supported"):
        torch.optim.Muon([param], adjust_lr_fn="rms_to_rms")


def test_issue_example_spectral_is_32x_torchs_default_on_a_square_matrix() -> None:
    """The issue's numbers: at lr 0.02 on a square matrix, Megatron's ``spectral`` moves
    ``√1024 = 32`` times as far as torch's default (``original``); ``original`` moves as torch does."""
    assert muon_scale_factor(1024, 1024, "spectral") / muon_scale_factor(1024, 1024, "original") == 32.0
    assert torch_muon._adjust_lr(0.02, None, torch.Size([1024, 1024])) == 0.02 * muon_scale_factor(1024, 1024, "original")  # type: ignore[arg-type]


def test_conventions_table_rows_build_and_measure() -> None:
    """Every row of the docs' table builds through get_optimizer and gives the RMS its scale says:
    RMS(update) = lr · s(r, c) · RMS(NS(G)), with RMS(NS(G)) the same for every row of one
    coefficient set (checked on a small shape; the docs' shapes run in the script)."""
    for row in CONVENTIONS:
        rms = update_rms(row.settings, (48, 96), seed=0)
        unscaled = {**row.settings, "muon_scale_mode": "original", "muon_extra_scale_factor": 1.0}  # s(48, 96) = 1
        ns_rms = update_rms(unscaled, (48, 96), seed=0) / row.settings["lr"]
        expected = row.settings["lr"] * muon_scale_factor(48, 96, row.settings["muon_scale_mode"]) * row.settings.get(
            "muon_extra_scale_factor", 1.0
        ) * ns_rms
        assert rms == pytest.approx(expected, rel=1e-5), row.library
