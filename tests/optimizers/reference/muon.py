"""Helpers for the Muon-family parity tests: matching params, a shared gradient stream, and
emerging-optimizers' Newton–Schulz in the shape of ours (to test the optimizer shell alone)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from optzoo.optimizers import _emerging


def matrices(shapes: Sequence[tuple[int, int]], *, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """Gaussian params of the given shapes (same values for the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]


def copies(params: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.nn.Parameter]:
    """Independent params with the same values (and the same ``qkv_split_shapes``, if any)."""
    out = [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]
    for source, copied in zip(params, out):
        copied.__dict__.update(source.__dict__)
    return out


class Steppable(Protocol):
    def step(self) -> object: ...


def drive(runs: Sequence[tuple[Steppable, Sequence[torch.Tensor]]], *, steps: int, seed: int = 1) -> None:
    """Step every optimizer ``steps`` times, each param receiving the same Gaussian gradients.

    Gradients do not depend on the params, so implementations see identical inputs at every
    step whatever their rounding: differences in the params come from the updates alone.
    """
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=generator) for p in runs[0][1]]
        for optimizer, params in runs:
            for param, grad in zip(params, grads):
                param.grad = grad.to(param.dtype)
            optimizer.step()


def upstream_newton_schulz(x: torch.Tensor, *, steps: int, coefficient_type: str, matmul_precision: str, **_: object) -> torch.Tensor:
    """Upstream's ``newton_schulz`` on each matrix of a batch, as upstream's optimizer calls it
    (one 2-D call per matrix, under torch's float32 matmul precision ``matmul_precision``)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    try:
        return torch.stack([_emerging.newton_schulz(m, steps=steps, coefficient_type=coefficient_type) for m in x])
    finally:
        torch.set_float32_matmul_precision(previous)


def torch_newton_schulz_in_float64(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` (torch 2.14) line for line, in float64
    instead of its hard-wired bf16: swapped in for torch's, it leaves ``torch.optim.Muon``'s own
    momentum, weight decay and ``adjust_lr_fn`` to be compared with ours at float64 rounding."""
    a, b, c = ns_coefficients
    ortho_grad = grad.double()
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    ortho_grad = ortho_grad.div(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if grad.size(0) > grad.size(1):
        ortho_grad = ortho_grad.T
    return ortho_grad
