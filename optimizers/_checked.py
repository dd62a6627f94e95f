"""A torch optimizer base: groups validated as they are added, and the closure handled once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload, override

import torch


class CheckedGroupsOptimizer(torch.optim.Optimizer):
    """``add_param_group`` runs ``_check_group`` on the completed group (a bad group is not
    kept); ``step`` evaluates the closure with gradients on, then runs ``_update`` without.

    torch fills a group's defaults inside ``add_param_group``, so the check sees every setting,
    whether it came from the constructor or from the group dict.
    """

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @override
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every param that has a gradient; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._update()
        return loss

    def _update(self) -> None:
        """Override point: update every param that has a gradient (gradients are off here)."""
        raise NotImplementedError

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any], index: int) -> None:
        """Override point: raise ``ValueError``/``TypeError`` naming the group and the setting."""
