"""Independent references for ``optimizers.precision_adam``: no bit tricks, torch.optim for the math.

``round_half_away_to_bf16`` rounds by float64 arithmetic on the bf16 grid (no integer views), and
``MasterAdam`` is torch.optim.AdamW/Adam (with a chosen kernel: single-tensor, foreach or fused)
over master copies whose model view is a rounding of the masters, with moments optionally rounded
through a storage dtype after each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

BF16_MIN_EXPONENT = -133
"""log2 of the smallest bf16 subnormal: 2**-126 (smallest normal) / 2**7 (7 stored mantissa bits)."""


def round_half_away_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16, to nearest with ties away from zero, on the bf16 grid in float64.

    For |x| = m * 2**e with m in [0.5, 1) (``frexp``), bf16 holds 8 significant bits, so the
    grid spacing is 2**(e - 8), never below the subnormal spacing 2**-133. ``|x| / spacing`` and
    ``+ 0.5`` are exact in float64 (at most 24 significant bits), so ``floor`` rounds exactly.
    Results past the largest bf16 (only 2**128 is reachable) become infinite. Non-finite inputs
    pass through; NaN payloads are not modelled.
    """
    value = x.double()
    magnitude = value.abs()
    _, exponent = torch.frexp(magnitude)
    spacing = torch.ldexp(torch.ones_like(magnitude), (exponent - 8).clamp(min=BF16_MIN_EXPONENT))
    rounded = torch.floor(magnitude / spacing + 0.5) * spacing
    rounded = torch.where(rounded > torch.finfo(torch.bfloat16).max, torch.inf, rounded)
    rounded = torch.where(torch.isfinite(value), torch.copysign(rounded, value), value)
    return rounded.to(torch.bfloat16)  # every value here is a bf16 value: the cast is exact


Kernel = Literal["single", "foreach", "fused"]
"""Which of torch.optim's Adam implementations steps the masters."""
KERNEL_OPTIONS: dict[Kernel, dict[str, bool]] = {
    "single": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def round_nearest_even_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """torch's own fp32 to bf16 conversion (round to nearest, ties to even)."""
    return x.to(torch.bfloat16)


class MasterAdam:
    """torch.optim Adam(W) over master copies of the model params.

    Args:
        model: the params the optimizer under test updates (only their values are read).
        master_dtype: dtype of the masters torch.optim updates.
        to_model: how a master becomes the model's value (a rounding to the model dtype).
        exp_avg_dtype, exp_avg_sq_dtype: moments are rounded through these after every step,
            as storing them in that dtype would.
        decoupled: AdamW if True, Adam with L2 decay if False.
        kernel: torch's single-tensor (``foreach=False``, the default), foreach or fused Adam.
        hyperparameters: lr, betas, eps, weight_decay for torch.optim.
    """

    def __init__(
        self,
        model: Sequence[torch.Tensor],
        *,
        master_dtype: torch.dtype = torch.float32,
        to_model: Callable[[torch.Tensor], torch.Tensor] | None = None,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        decoupled: bool = True,
        kernel: Kernel = "single",
        **hyperparameters: object,
    ) -> None:
        self.masters = [p.detach().to(master_dtype, copy=True).requires_grad_() for p in model]
        self.model_dtypes = [p.dtype for p in model]
        self.to_model = to_model
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        self.optimizer = cls(self.masters, **KERNEL_OPTIONS[kernel], **hyperparameters)  # type: ignore[arg-type]

    def step(self, grads: Sequence[torch.Tensor]) -> None:
        for master, grad in zip(self.masters, grads):
            master.grad = grad.to(master.dtype)
        self.optimizer.step()
        for master in self.masters:
            for key, dtype in self.moment_dtypes.items():
                moment = self.optimizer.state[master][key]
                moment.copy_(moment.to(dtype))

    def model(self) -> list[torch.Tensor]:
        """The model's params as the optimizer under test should hold them."""
        if self.to_model is None:
            return [m.detach().to(dtype) for m, dtype in zip(self.masters, self.model_dtypes)]
        return [self.to_model(m.detach()) for m in self.masters]

    def moment(self, index: int, key: str) -> torch.Tensor:
        """A moment in its storage dtype."""
        value: torch.Tensor = self.optimizer.state[self.masters[index]][key]
        return value.to(self.moment_dtypes[key])
