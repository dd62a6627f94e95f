"""Muon's learning-rate conventions across libraries, as optzoo settings, with measured update RMS.

Run: ``.venv/bin/python -m benchmarks.lr_conventions [--no-torch]``.
It prints the table of docs/optimizers.md#learning-rate-conventions: for each library's
convention, the optzoo settings that reproduce it, the factor ``s(r, c)`` on the orthogonalised
update of an ``r × c`` matrix (``W ← W − lr·s(r, c)·NS(M)``; the settings drop the ``muon_``
prefix of their field names), and the RMS of one update of a
``1024 × 1024``, ``1024 × 4096`` and ``4096 × 1024`` matrix at ``lr = 0.02`` (rows are fan-out).
Each is one step of ``get_optimizer``'s Muon from a fresh state, on a Gaussian gradient (seed 0),
weight decay off (so the update is the orthogonalised direction alone) and float32 Newton–Schulz
at ``highest``: deterministic for a seed, not a timing. The last table steps ``torch.optim.Muon``
itself (its Newton–Schulz in bf16) on the same gradients, for the three ``adjust_lr_fn`` names.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate

from optzoo import OptimizerConfig, ParamKey, get_optimizer

SHAPES: tuple[tuple[int, int], ...] = ((1024, 1024), (1024, 4096), (4096, 1024))
LR = 0.02
"""The lr every row is measured at: the issue's ``torch.optim.Muon(lr=0.02)``."""


@dataclass(frozen=True)
class Convention:
    """One library's Muon convention and the optzoo settings that reproduce it."""

    library: str
    theirs: str
    """The library's own setting (and its defaults that change the update)."""
    factor: str
    """``s(r, c)``, the factor on the orthogonalised update."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """``OptimizerConfig`` fields (``lr`` included) that give the same update at the same lr."""


_TORCH = {"lr": LR, "muon_coefficient_type": "simple", "muon_nesterov": True, "weight_decay": 0.1}
"""torch.optim.Muon's defaults besides the scale: Jordan's coefficients, Nesterov, decay 0.1."""

CONVENTIONS: tuple[Convention, ...] = (
    Convention("torch.optim.Muon (default)", 'adjust_lr_fn=None or "original"', "√max(1, r/c)",
               {**_TORCH, "muon_scale_mode": "original"}),
    Convention("torch.optim.Muon", 'adjust_lr_fn="match_rms_adamw"', "0.2·√max(r, c)",
               {**_TORCH, "muon_scale_mode": "match_rms_adamw"}),
    Convention("torch.optim.Muon", 'adjust_lr_fn="spectral_unclamped"', "√(r/c)",
               {**_TORCH, "muon_scale_mode": "spectral_unclamped"}),
    Convention("Keller Jordan's Muon", "max(1, r/c)**0.5, nesterov, weight_decay=0", "√max(1, r/c)",
               {**_TORCH, "muon_scale_mode": "shape_scaling", "weight_decay": 0.0}),
    Convention("Moonlight (arXiv:2502.16982)", "0.2·√max(A, B), nesterov, wd=0.1", "0.2·√max(r, c)",
               {**_TORCH, "muon_scale_mode": "match_rms_adamw"}),
    Convention("timm Muon (default)", 'adjust_lr_fn="match_rms_adamw", ns_coefficients="quintic"', "0.2·√max(r, c)",
               {"lr": LR, "muon_scale_mode": "match_rms_adamw", "weight_decay": 0.0}),
    Convention("timm Muon", 'adjust_lr_fn="rms_to_rms"', "√(r/c)",
               {"lr": LR, "muon_scale_mode": "unit_rms_norm", "weight_decay": 0.0}),
    Convention("Megatron-Core / emerging-optimizers (default)", 'muon_scale_mode="spectral"', "√max(r, c)",
               {"lr": LR, "muon_scale_mode": "spectral"}),
    Convention("Megatron-Core / emerging-optimizers", 'muon_scale_mode="spectral", muon_extra_scale_factor=0.2', "0.2·√max(r, c)",
               {"lr": LR, "muon_scale_mode": "spectral", "muon_extra_scale_factor": 0.2}),
    Convention("Megatron-Core / emerging-optimizers", 'muon_scale_mode="unit_rms_norm"', "√(r/c)",
               {"lr": LR, "muon_scale_mode": "unit_rms_norm"}),
    Convention("Megatron-Core / emerging-optimizers", 'muon_scale_mode="shape_scaling"', "√max(1, r/c)",
               {"lr": LR, "muon_scale_mode": "shape_scaling"}),
    Convention("optzoo muon-llm recipe (lr 3e-4 there)", "Moonlight's scale, quintic", "0.2·√max(r, c)",
               {"lr": LR, "muon_scale_mode": "match_rms_adamw", "weight_decay": 0.1}),
)  # fmt: skip


class _OneMatrix(torch.nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols))


def _gradient(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _rms(update: torch.Tensor) -> float:
    return float(update.pow(2).mean().sqrt())


def update_rms(settings: Mapping[str, Any], shape: tuple[int, int], *, seed: int = 0) -> float:
    """RMS of one update of a ``shape`` matrix by optzoo's Muon built from ``settings``.

    Example:
        >>> round(update_rms({"lr": 0.02, "muon_scale_mode": "original"}, (8, 8)) / update_rms({"lr": 0.02}, (8, 8)), 6)
        0.353553
    """
    model = _OneMatrix(*shape)
    config = OptimizerConfig(
        optimizer="muon", **{**settings, "weight_decay": 0.0}, muon_fp32_matmul_prec="highest", clip_grad=0.0
    )
    # A lone matrix may read as an output head, which Muon declines: the rule keeps it on Muon.
    optimizer = get_optimizer(config, model, {ParamKey(name="weight"): {"optimizer": "muon"}}, lint=False)
    model.weight.grad = _gradient(shape, seed)
    optimizer.step()
    return _rms(model.weight.detach())


def torch_update_rms(adjust_lr_fn: str | None, shape: tuple[int, int], *, seed: int = 0) -> float:
    """RMS of one update of a ``shape`` matrix by ``torch.optim.Muon(lr=LR, adjust_lr_fn=...)``."""
    weight = torch.nn.Parameter(torch.zeros(shape))
    optimizer = torch.optim.Muon([weight], lr=LR, weight_decay=0.0, adjust_lr_fn=adjust_lr_fn)
    weight.grad = _gradient(shape, seed)
    optimizer.step()
    return _rms(weight.detach())


def _shape_headers() -> list[str]:
    return [f"RMS {r}×{c}" for r, c in SHAPES]


def _settings_text(settings: Mapping[str, Any]) -> str:
    """The fields besides ``lr``, scale first, in the config's words (``muon_`` dropped to fit)."""
    order = sorted((k for k in settings if k != "lr"), key=lambda k: k != "muon_scale_mode")
    return ", ".join(f"{k.removeprefix('muon_')}={settings[k]!r}" for k in order)


def conventions_table(*, fmt: str = "github") -> str:
    """The table of :data:`CONVENTIONS`, each row measured on :data:`SHAPES`."""
    rows = [
        [c.library, c.theirs, _settings_text(c.settings), c.factor, *(f"{update_rms(c.settings, s):.2e}" for s in SHAPES)]
        for c in CONVENTIONS
    ]
    return tabulate(rows, headers=["convention", "its setting", "optzoo settings", "s(r, c)", *_shape_headers()], tablefmt=fmt, disable_numparse=True)


def torch_table(*, fmt: str = "github") -> str:
    """torch.optim.Muon as shipped, one row per ``adjust_lr_fn``."""
    rows = [
        [f"torch.optim.Muon(adjust_lr_fn={name!r})", *(f"{torch_update_rms(name, s):.2e}" for s in SHAPES)]
        for name in ("original", "match_rms_adamw", "spectral_unclamped")
    ]
    return tabulate(rows, headers=["measured with torch itself (bf16 Newton–Schulz)", *_shape_headers()], tablefmt=fmt, disable_numparse=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-torch", action="store_true", help="skip the rows measured with torch.optim.Muon")
    parser.add_argument("--format", default="github", help="tabulate table format (default: github, as in the docs)")
    args = parser.parse_args(argv)
    print(conventions_table(fmt=args.format))
    if not args.no_torch:
        print()
        print(torch_table(fmt=args.format))


if __name__ == "__main__":
    main()
