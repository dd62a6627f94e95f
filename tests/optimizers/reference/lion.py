"""Lion transcribed from the paper (Chen et al., 2023, Algorithm 2), in float64.

Independent of emerging-optimizers: used to check that the registered `lion` follows the paper.
"""

from __future__ import annotations

import torch


def lion_step(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float, beta1: float,
    beta2: float, weight_decay: float,
) -> None:
    """One step in place: decoupled decay, sign of interpolation, then the momentum update."""
    update = torch.sign(beta1 * exp_avg + (1 - beta1) * grad)
    param.mul_(1 - lr * weight_decay).sub_(lr * update)
    exp_avg.mul_(beta2).add_((1 - beta2) * grad)
