"""What frameworks that treat the wrapper as a plain ``torch.optim.Optimizer`` read from it.

* :func:`torch_defaults`: ``optimizer.defaults`` as torch fills it (the settings every group
  shares), which ``OneCycleLR``/``CyclicLR`` (``cycle_momentum``), Lightning's
  ``LearningRateMonitor`` and Hugging Face's polynomial schedule read.
* :class:`LastStep`: what ``step()`` returned, kept on the optimizer, since Trainer, accelerate and
  Lightning drop ``step()``'s return value.
* :class:`ClipWatch`: sees a framework's ``torch.nn.utils.clip_grad_norm_`` (Trainer's
  ``max_grad_norm``, Lightning's ``gradient_clip_val``, ``accelerator.clip_grad_norm_``) run on the
  gradients before optzoo's own clip, and warns once: clipping twice is rarely meant.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from optzoo._common import local_shard

__all__ = ["WATCHED_STEPS", "ClipWatch", "DoubleClippingWarning", "LastStep", "torch_defaults"]

# Per-group bookkeeping (routing and optzoo's own scheduler), not torch settings.
_NOT_DEFAULTS = frozenset(
    {"params", "param_names", "matrix_views", "flatten", "optimizer", "max_lr", "min_lr", "wd_mult", "default_config",
     "start_wd", "end_wd", "initial_lr"}
)  # fmt: skip


def torch_defaults(param_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The settings every group has, valued as the base config's group (``default_config``, else the first).

    torch's ``defaults`` hold the constructor's settings, which every group has; a scheduler that
    finds a key there writes it into every group (``OneCycleLR`` writes ``betas`` or ``momentum``).
    So a key some groups lack (``betas`` when Muon groups hold ``momentum``) is left out.
    """
    if not param_groups:
        return {}
    base = next((g for g in param_groups if g.get("default_config")), param_groups[0])
    shared = set(base).intersection(*param_groups) - _NOT_DEFAULTS
    return {key: base[key] for key in base if key in shared}


@dataclass(frozen=True)
class LastStep:
    """What the last ``step()`` (or ``step_on_device()``) did: ``optimizer.last_step``.

    After ``step()`` the values are Python numbers, those ``step()`` returned. After
    ``step_on_device()`` ``success`` and ``grad_norm`` are 0-dim tensors on the params' device (reading
    them waits for the device), and ``skipped_steps`` becomes a device tensor from then on.
    """

    success: bool | torch.Tensor
    """Whether the update was applied (``False``: inf/NaN gradients, a norm over
    ``grad_norm_skip_threshold``, or a failed transaction; nothing changed)."""
    grad_norm: float | torch.Tensor | None
    """The global norm of the unscaled gradients before clipping (``None`` when not computed:
    ``clip_grad == 0`` and no ``grad_norm_skip_threshold``, or an inf/NaN step under ``step()``)."""
    num_zeros: int | None
    """Zero gradient elements (with ``log_num_zeros_in_grad``, else ``None``)."""
    skipped_steps: int | torch.Tensor
    """Steps skipped since this optimizer was built (this one included). A run statistic, not
    optimizer state: ``state_dict`` does not save it and ``load_state_dict`` leaves it as it is."""


class DoubleClippingWarning(UserWarning):
    """Gradients were clipped by the training framework and again by optzoo's ``clip_grad``."""


_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(torch.__file__))

WATCHED_STEPS = 100
"""Steps :class:`ClipWatch` looks at before it removes its hooks: frameworks clip from the first
step on, and gradients are largest early in training, so a clip that cuts shows up early."""


class ClipWatch:
    """Sees a clip of the gradients between the end of ``backward()`` and ``step()``.

    torch's ``clip_grad_norm_``, which every framework's clipping calls, multiplies every gradient in
    place by ``min(1, max_norm / norm)``: each gradient tensor's version counter moves, and, when it
    cuts, the norm drops. Hugging Face's Trainer also calls it with ``max_norm=inf`` only to read
    the norm (a multiply by 1): the versions move but the norm does not, and that is no clip. So a
    hook after each gradient's accumulation queues one callback for the end of that ``backward()``,
    run after every other end-of-backward callback (DDP copies its reduced buckets into ``.grad``
    there), which records the versions and the norm; :meth:`check` at the step compares both. It
    watches the first :data:`WATCHED_STEPS` steps that follow a ``backward()``, then removes its
    hooks: while watching, each step costs two norm passes and one read.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = [p for p in params if p.requires_grad and p.is_leaf]
        self._versions: dict[int, tuple[int, int]] = {}  # param index -> (id of its grad, grad version)
        self._norm: torch.Tensor | None = None
        self._queued = False
        self._checked = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self._params]  # type: ignore[no-untyped-call]

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def _accumulated(self, _: torch.Tensor) -> None:
        if self._queued:
            return
        self._queued = True
        engine = torch.autograd.Variable._execution_engine

        def last() -> None:  # queued from a callback: runs after every callback queued during backward
            self._queued = False
            self._record()

        engine.queue_callback(lambda: engine.queue_callback(last))

    def _grads(self) -> list[tuple[int, torch.Tensor]]:
        return [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]

    @staticmethod
    def _norm_of(grads: Sequence[torch.Tensor]) -> torch.Tensor:
        norms = torch._foreach_norm([local_shard(g) for g in grads])
        total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.float().to(norms[0].device) for n in norms]))
        return total

    def _record(self) -> None:
        grads = self._grads()
        self._versions = {i: (id(g), g._version) for i, g in grads}
        self._norm = self._norm_of([g for _, g in grads]) if grads else None

    def _changed_in_place(self) -> bool:
        """Whether every gradient recorded at the end of the last backward was changed in place since."""
        for i, (grad_id, version) in self._versions.items():
            grad = self._params[i].grad
            if grad is None or id(grad) != grad_id or grad._version == version:
                return False
        return True

    def check(self, clip_grad: float) -> None:
        """At a step: warn once when the gradients were clipped before optzoo clips them to ``clip_grad``."""
        self._queued = False  # a backward that raised midway never ran its callback
        if self._norm is None:
            return  # no backward since the last step (grads set by hand): nothing to compare
        before, self._norm = self._norm, None
        cut = self._changed_in_place() and bool(self._norm_of([self._params[i].grad for i in self._versions]) < before)  # type: ignore[misc]
        self._checked += 1
        if cut:
            warnings.warn(
                f"gradients clipped twice: by the training framework ({_framework_setting()}) and by optzoo "
                f"(OptimizerConfig.clip_grad={clip_grad}); got torch.nn.utils.clip_grad_norm_ cutting every gradient "
                "between backward() and step(); expected one clip: set OptimizerConfig(clip_grad=0.0) to keep the "
                "framework's, or turn the framework's off to keep optzoo's (its norm is last_step.grad_norm)",
                DoubleClippingWarning,
                skip_file_prefixes=_INTERNAL,  # points at the framework's (or the user's) call of step()
            )
        if cut or self._checked >= WATCHED_STEPS:
            self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._versions = {}
        self._norm = None

    def __getstate__(self) -> dict[str, Any]:  # a copy of the optimizer steps copies of the params: no watch
        return {"_params": [], "_versions": {}, "_norm": None, "_queued": False, "_checked": 0, "_handles": []}


def _framework_setting() -> str:
    """The clipping setting of the framework calling this step, found on the call stack."""
    settings = {
        "transformers": "Trainer's TrainingArguments(max_grad_norm=...); max_grad_norm=0 turns it off",
        "lightning": "Lightning's Trainer(gradient_clip_val=...); gradient_clip_val=None turns it off",
        "pytorch_lightning": "Lightning's Trainer(gradient_clip_val=...); gradient_clip_val=None turns it off",
        "accelerate": "accelerator.clip_grad_norm_(...): leave the call out to turn it off",
    }
    packages = set()
    frame = sys._getframe(1)
    while frame is not None:
        packages.add(str(frame.f_globals.get("__name__", "")).split(".")[0])
        frame = frame.f_back  # type: ignore[assignment]
    for package in ("transformers", "lightning", "pytorch_lightning", "accelerate"):  # the outermost framework first
        if package in packages:
            return settings[package]
    return "torch.nn.utils.clip_grad_norm_"
