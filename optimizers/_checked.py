"""A torch optimizer base whose param groups are validated as they are added."""

from __future__ import annotations

from typing import Any, override

import torch


class CheckedGroupsOptimizer(torch.optim.Optimizer):
    """``add_param_group`` runs ``_check_group`` on the completed group; a bad group is not kept.

    torch fills a group's defaults inside ``add_param_group``, so the check sees every setting,
    whether it came from the constructor or from the group dict.
    """

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
