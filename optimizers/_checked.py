"""Torch optimizer bases: settings that survive a copy, groups validated as they are added, and the
closure handled once."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, overload, override

import torch
from torch.optim.optimizer import StateDict

from .state_layout import check_state


_HOOK_DICTS = frozenset(
    {
        "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
    }
)  # fmt: skip


# Every device type torch's autocast has a switch for (torch.amp.autocast_mode: is_autocast_available
# answers for these names), and the custom backend's own name.
_AUTOCAST_DEVICE_TYPES = tuple(
    dict.fromkeys(("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia", torch._C._get_privateuse1_backend_name()))
)


@contextlib.contextmanager
def autocast_disabled() -> Iterator[None]:
    """Turn off ``torch.autocast`` for every device type while an optimizer steps.

    An optimizer's arithmetic is its own: a step called inside the caller's autocast region (a
    training loop that wraps forward, backward and step in one ``with``) would otherwise run its
    matmuls (Newton-Schulz, SOAP's rotations) in bf16/fp16 and its linspace/eigh in other dtypes.
    The thread-local flags are switched directly (``torch.autocast(..., enabled=False)`` asserts
    for a custom backend that registered no AMP module), and only where they are on, so the
    common case costs ten flag reads.
    """
    active = [device for device in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(device)]
    for device in active:
        torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        for device in active:
            torch.set_autocast_enabled(device, True)


class KeepsSettingsOptimizer(torch.optim.Optimizer):
    """An optimizer whose settings live on the instance, and survive ``copy.deepcopy`` and pickle.

    torch's ``__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``, so a copy of
    an optimizer holding anything else cannot step. This keeps every attribute but the hooks
    (which torch drops too: they are often lambdas). torch's ``load_state_dict`` also calls
    ``__setstate__``, with only ``state`` and ``param_groups``: the rest is then left as it is.
    """

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key not in _HOOK_DICTS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        defaults = state.get("defaults", getattr(self, "defaults", None))
        kept = dict(defaults) if defaults is not None else None
        super().__setstate__(state)
        if kept is not None:  # torch adds ``differentiable`` to the defaults, which our groups never read
            self.defaults = kept


class CheckedGroupsOptimizer(KeepsSettingsOptimizer):
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
        with torch.no_grad(), autocast_disabled():  # the update computes as outside any autocast region
            self._update()
        return loss

    def _update(self) -> None:
        """Override point: update every param that has a gradient (gradients are off here)."""
        raise NotImplementedError

    @override
    def load_state_dict(self, state_dict: StateDict) -> None:
        """torch's ``load_state_dict``, with the load pre-hooks run before :meth:`_load_state_dict`
        reads the dict (so a hook's returned dict is the one loaded), and the post-hooks after."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._check_loaded_state(state_dict)
        hooks, self._optimizer_load_state_dict_pre_hooks = self._optimizer_load_state_dict_pre_hooks, OrderedDict()
        try:
            self._load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks

    def _check_loaded_state(self, state_dict: StateDict) -> None:
        """Each param's saved state against this optimizer's ``state_layout`` (where it has one), before
        anything changes: torch's own loader takes a moment of any shape (see :mod:`.state_layout`)."""
        layout_of = getattr(self, "state_layout", None)
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if layout_of is None or not isinstance(groups, list) or not isinstance(state, Mapping):
            return  # torch's loader raises for a malformed dict
        for saved_group, group in zip(groups, self.param_groups):
            for saved_id, param in zip(saved_group.get("params", ()), group["params"]):
                values = state.get(saved_id)
                if isinstance(values, Mapping):  # under the saved settings, which torch's load brings in
                    loaded = {**group, **{k: v for k, v in saved_group.items() if k not in ("params", "matrix_views")}}
                    layout = layout_of(param, loaded, tuple(param.shape))
                    check_state(values, layout, name=f"state_dict['state'][{saved_id!r}]", complex_param=param.is_complex())

    def _load_state_dict(self, state_dict: StateDict) -> None:
        """Override point: load ``state_dict`` (the hooks' result); :meth:`_torch_load_state_dict` is torch's loader."""
        self._torch_load_state_dict(state_dict)

    def _torch_load_state_dict(self, state_dict: StateDict) -> None:
        torch.optim.Optimizer.load_state_dict(self, state_dict)  # runs the post-hooks

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


def check_lr(group: dict[str, Any], where: str) -> None:
    """``lr`` is a number >= 0, or a one-element tensor holding one (torch's contract: a tensor
    ``lr`` is accepted if it has one element, and read as a number at each step)."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(
                f"{where}: `lr`: Tensor lr must be 1-element; got a tensor of shape {tuple(lr.shape)}; "
                "expected a float or a one-element tensor"
            )
        if lr.is_complex() or not bool(lr >= 0):
            raise ValueError(f"{where}: `lr`: must be non-negative; got {lr!r}; expected lr >= 0")
        return
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(f"{where}: `lr`: must be a number; got {type(lr).__name__} {lr!r}; expected a float >= 0 or a one-element tensor")
    if not lr >= 0:
        raise ValueError(f"{where}: `lr`: must be non-negative; got {lr!r}; expected lr >= 0")


def lr_value(group: dict[str, Any]) -> float:
    """The group's ``lr`` as a Python float (a one-element tensor lr is read here, once per step)."""
    lr = group["lr"]
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
