"""Loss scalers with Megatron-Core's semantics and state-dict keys.

A Megatron checkpoint's ``grad_scaler`` state (``scale``, ``growth_tracker``,
``hysteresis_tracker``) loads into :class:`DynamicGradScaler` unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from optzoo.config import FP32_MAX, FP32_NORMAL_MIN, OptimizerConfig

__all__ = ["ConstantGradScaler", "DynamicGradScaler", "MegatronGradScaler", "make_grad_scaler"]


def _scale_tensor(value: float, device: torch.device | str | None) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=device)


class MegatronGradScaler(ABC):
    """A loss scale: ``scale`` multiplies the loss, ``inv_scale`` unscales the gradients.

    Both are 1-element float32 tensors on the parameters' device; ``inv_scale`` is computed in
    float64 and cast, so ``scale * inv_scale`` is as close to 1 as float32 allows.
    """

    def __init__(self, initial_scale: float, *, device: torch.device | str | None = None) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"`initial_scale`: must be positive; got {initial_scale!r}; expected a float > 0")
        self._scale = _scale_tensor(initial_scale, device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    def to(self, device: torch.device | str) -> MegatronGradScaler:
        """Move the scale to ``device`` (the parameters' device); returns ``self``."""
        self._scale = self._scale.to(device)
        return self

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step that did (or did not) see inf/NaN gradients."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ``ValueError`` for a state this scaler cannot load, changing nothing (the
        optimizer's loader checks it before it replaces any param state)."""
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"`grad_scaler` state: not a dict; got {type(state_dict).__name__}; expected {type(self).__name__}.state_dict()")


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale (Megatron's ``loss_scale``); its state dict is empty.

    Example:
        >>> scaler = ConstantGradScaler(128.0)
        >>> scaler.update(found_inf=True)
        >>> scaler.scale.item(), scaler.state_dict()
        (128.0, {})
    """

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_state_dict(state_dict)


class DynamicGradScaler(MegatronGradScaler):
    """Megatron-Core's dynamic loss scale with hysteresis.

    On inf/NaN: the growth tracker goes to 0 and the hysteresis tracker drops by one; once it
    is at or below 0, every inf multiplies the scale by ``backoff_factor`` (never below
    ``min_scale``). On a clean step the growth tracker counts up; at ``growth_interval`` it
    resets, the hysteresis tracker is reset to ``hysteresis`` and the scale grows by
    ``growth_factor``. So hysteresis counts infs since the last growth, not consecutive infs.

    Example:
        >>> scaler = DynamicGradScaler(8.0, 1.0, 2.0, 0.5, growth_interval=3, hysteresis=2)
        >>> for found_inf in (True, True, True):
        ...     scaler.update(found_inf)
        >>> scaler.scale.item()
        2.0
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(initial_scale, device=device)
        if not min_scale > 0.0:
            raise ValueError(f"`min_scale`: must be positive; got {min_scale!r}; expected a float > 0")
        if min_scale > initial_scale:
            raise ValueError(
                f"`min_scale`: must not exceed initial_scale={initial_scale!r}; got {min_scale!r}; "
                f"expected 0 < min_scale <= {initial_scale!r}"
            )
        if not growth_factor > 1.0:
            raise ValueError(f"`growth_factor`: must be greater than 1; got {growth_factor!r}; expected a float > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"`backoff_factor`: must lie in (0, 1); got {backoff_factor!r}; expected 0 < backoff_factor < 1")
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if not value >= 1:
                raise ValueError(f"`{name}`: must be at least 1; got {value!r}; expected an int >= 1")
        self.min_scale = _scale_tensor(min_scale, device)
        self.growth_factor = _scale_tensor(growth_factor, device)
        self.backoff_factor = _scale_tensor(backoff_factor, device)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def to(self, device: torch.device | str) -> DynamicGradScaler:
        super().to(device)
        self.min_scale = self.min_scale.to(device)
        self.growth_factor = self.growth_factor.to(device)
        self.backoff_factor = self.backoff_factor.to(device)
        return self

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            # ``>=``, not Megatron-Core's ``==``: a tracker restored from a run with a longer
            # ``loss_scale_window`` may already exceed this one, and would otherwise never grow again.
            if self._growth_tracker >= self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def check_state_dict(self, state_dict: Any) -> None:
        super().check_state_dict(state_dict)
        missing = [k for k in ("scale", "growth_tracker", "hysteresis_tracker") if k not in state_dict]
        if missing:
            raise ValueError(
                f"`grad_scaler` state: missing keys {missing}; got {sorted(state_dict)}; "
                "expected scale, growth_tracker and hysteresis_tracker (a dynamic scaler's state; "
                "was the checkpoint saved with a constant loss_scale?)"
            )
        scale = state_dict["scale"]
        number = scale.item() if isinstance(scale, torch.Tensor) and scale.numel() == 1 else scale
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not FP32_NORMAL_MIN <= number <= FP32_MAX:
            raise ValueError(
                f"`grad_scaler` state: `scale` must lie in float32's finite normal range; got {scale!r}; "
                f"expected a number in [{FP32_NORMAL_MIN:.4g}, {FP32_MAX:.4g}]"
            )
        for key in ("growth_tracker", "hysteresis_tracker"):
            value = state_dict[key]
            if isinstance(value, bool) or not isinstance(value, int) or (key == "growth_tracker" and value < 0):
                raise ValueError(f"`grad_scaler` state: `{key}` must be an int{' >= 0' if key == 'growth_tracker' else ''}; got {value!r}; expected an int")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.check_state_dict(state_dict)
        self._scale = torch.as_tensor(state_dict["scale"]).to(device=self._scale.device, dtype=torch.float32, copy=True)
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def make_grad_scaler(config: OptimizerConfig, *, device: torch.device | None = None) -> MegatronGradScaler | None:
    """Megatron-Core's choice: ``loss_scale`` -> constant; fp16 without it -> dynamic; else none.

    Example:
        >>> make_grad_scaler(OptimizerConfig(lr=1.0, fp16=True)).scale.item() == 2.0**32
        True
        >>> make_grad_scaler(OptimizerConfig(lr=1.0, bf16=True)) is None
        True
    """
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device=device)
    if config.fp16:
        return DynamicGradScaler(
            initial_scale=config.initial_loss_scale,
            min_scale=config.min_loss_scale,
            growth_factor=2.0,
            backoff_factor=0.5,
            growth_interval=int(config.loss_scale_window),
            hysteresis=config.hysteresis,
            device=device,
        )
    return None
