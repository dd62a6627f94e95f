"""The one door to ``emerging-optimizers``: every import of it goes through here.

We build on release 0.3.0 (pinned in pyproject.toml); later releases moved and removed modules,
so keeping the imports in one place makes an upgrade one file's work. Imports are lazy so that
``import optimizers`` stays cheap and a missing package fails only where it is needed.
"""

from __future__ import annotations

from typing import Any

import torch

_MISSING = (
    "emerging-optimizers==0.3.0 is required for this optimizer; "
    "install optzoo with its dependencies (`pip install optzoo`) or `pip install emerging-optimizers==0.3.0`"
)


def lion(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``emerging_optimizers.scalar_optimizers.Lion`` (Chen et al., 2023) over complete groups.

    Weight decay is decoupled (``p *= 1 - lr * weight_decay``), upstream's default.
    """
    try:
        from emerging_optimizers.scalar_optimizers.lion import Lion
    except ImportError as error:  # pragma: no cover - a core dependency
        raise ImportError(_MISSING) from error
    optimizer: torch.optim.Optimizer = Lion(param_groups, weight_decay_method="decoupled")
    return optimizer


def newton_schulz_coefficient_types() -> tuple[str, ...]:
    """The named coefficient sets upstream offers (``custom`` needs explicit numbers: excluded)."""
    try:
        from emerging_optimizers.orthogonalized_optimizers import muon_utils
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    sets: dict[str, Any] = muon_utils._COEFFICIENT_SETS
    return tuple(sets)


def newton_schulz_coefficient_sets() -> dict[str, tuple[tuple[float, float, float], ...]]:
    """Upstream's named coefficient sets (``muon_utils._COEFFICIENT_SETS``), as tuples of ``(a, b, c)``."""
    try:
        from emerging_optimizers.orthogonalized_optimizers import muon_utils
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    sets: dict[str, Any] = muon_utils._COEFFICIENT_SETS
    return {name: tuple((float(a), float(b), float(c)) for a, b, c in values) for name, values in sets.items()}


def newton_schulz(x: torch.Tensor, *, steps: int, coefficient_type: str, eps: float = 1e-7) -> torch.Tensor:
    """Upstream's ``muon_utils.newton_schulz`` on a float32 2-D or 3-D tensor: the reference for ours.

    Like upstream, it reads torch's float32 matmul precision (``medium`` casts to bf16) instead of
    taking it as an argument.
    """
    try:
        from emerging_optimizers.orthogonalized_optimizers import muon_utils
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    result: torch.Tensor = muon_utils.newton_schulz(x, steps, coefficient_type, eps=eps)
    return result
