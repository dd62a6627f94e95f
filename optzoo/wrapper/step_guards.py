"""What a step checks and keeps so that a fault changes nothing (issue #24).

Checked when the optimizer is built: Megatron-style timers (:func:`check_timers`). Before the inner
steps: torch SGD's momentum buffers for params stepped without one (:func:`check_dampening` first,
then :func:`missing_momentum_buffers`, :func:`zero_momentum_buffers_`).
Around an inner optimizer whose finite gradients can still give a non-finite result (the registry's
``verified_step``: SOAP): its params and state kept (:func:`snapshot`), the result checked
(:func:`tensors_of`) and put back (:func:`restore_`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "LINALG_ERROR", "Snapshot", "check_dampening", "check_timers", "missing_momentum_buffers", "restore_", "snapshot", "tensors_of",
    "zero_momentum_buffers_",
]

LINALG_ERROR: type[Exception] = getattr(torch.linalg, "LinAlgError")  # untyped in torch's stubs
"""What a decomposition that did not converge raises (``torch.linalg.LinAlgError``)."""


def check_timers(timers: Callable[..., Any] | None) -> None:
    """Megatron-style timers, checked when the optimizer is built, not midway through a step:
    ``timers(name, log_level=1)`` (called once, as Megatron's ``Timers`` is, to get a timer) returns
    an object whose ``start`` takes ``barrier=`` and whose ``stop`` takes no argument."""
    if timers is None:
        return
    problem = None
    try:
        timer = timers("optimizer-copy-to-main-grad", log_level=1)
        for method, bind in (("start", {"barrier": False}), ("stop", {})):
            function = getattr(timer, method, None)
            if not callable(function):
                problem = f"its timer {type(timer).__name__} has no {method}()"
                break
            try:
                inspect.signature(function).bind(**bind)
            except ValueError:  # no signature to read (a builtin): accepted as it is
                continue
            except TypeError as error:
                problem = f"its timer's {method}({', '.join(f'{k}=...' for k in bind)}) fails: {error}"
                break
    except (TypeError, AttributeError) as error:
        problem = f"calling it failed with {type(error).__name__}: {error}"
    if problem is not None:
        raise ValueError(
            f"`OptimizerConfig.timers`: not Megatron-style timers; got {getattr(timers, '__name__', type(timers).__name__)} "
            f"({problem}); expected timers(name, log_level=1) returning an object with start(barrier=...) and stop()"
        )


def check_dampening(optimizers: Sequence[torch.optim.Optimizer], has_grad: Callable[[torch.Tensor], bool], *, on_device: bool) -> None:
    """Refuse torch's SGD with momentum and ``dampening != 0`` where a param is about to be stepped
    without a ``momentum_buffer`` while another param of its group has one (or, ``on_device``, at all).

    torch's first step sets ``buf = grad``; later steps ``buf = momentum * buf + (1 - dampening) *
    grad``. A zero buffer (:func:`zero_momentum_buffers_`) gives the first only when ``dampening``
    is 0, and torch's fused kernel cannot mix the two; a first step on the device must be a zero
    buffer, since a skipped one cannot be taken back. Called before anything of the step changes.

    Args:
        optimizers: The inner optimizers; only ``torch.optim.SGD`` ones are looked at.
        has_grad: Whether a main param gets a gradient this step (read from the model side).
        on_device: The step is ``step_on_device``.

    Raises:
        ValueError: Naming the first such param, the dampening and what is allowed.
    """
    for opt in optimizers:
        if not isinstance(opt, torch.optim.SGD):
            continue
        for index, group in enumerate(opt.param_groups):
            if group["momentum"] == 0 or group["dampening"] == 0:
                continue
            stepped = [p for p in group["params"] if has_grad(p)]
            without = [p for p in stepped if opt.state.get(p, {}).get("momentum_buffer") is None]
            if not without or (len(without) == len(stepped) and not on_device):
                continue  # nothing missing, or torch's own first step: every buffer starts as the gradient
            names = group.get("param_names") or []
            first = next(i for i, p in enumerate(group["params"]) if p is without[0])
            where = f"`{names[first]}`" if first < len(names) else f"param group #{index}"
            raise ValueError(
                f"{where}: SGD with dampening has no momentum buffer yet while "
                f"{'the step runs on the device' if on_device else 'other params of its group have one'}; "
                f"got dampening={group['dampening']!r}; expected dampening=0 (a zero buffer then equals torch's "
                "first step), or step() with every param of the group getting its first gradient together"
            )


def missing_momentum_buffers(optimizers: Sequence[torch.optim.Optimizer]) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
    """The params about to be stepped by torch's SGD with momentum (``dampening`` 0) that have no
    ``momentum_buffer`` (a param whose first gradient arrives late, or every param on the first
    step), each with its optimizer: :func:`zero_momentum_buffers_` gives them one. Changes nothing.

    torch's fused SGD takes a step as the first when *no* param has a buffer: it then creates them
    uninitialised and has its kernel copy the gradient in; it fails (``TypeError``) on a mix, and
    an update skipped by ``found_inf`` leaves the uninitialised buffers behind, applied by the next
    step. A zero buffer gives ``buf = momentum * 0 + grad = grad``, torch's first-step buffer bit for
    bit, in every kernel, skipped or not. Groups with ``dampening`` are left to torch (see
    :func:`check_dampening`, which refused the cases torch cannot take).
    """
    missing: list[tuple[torch.optim.Optimizer, torch.Tensor]] = []
    for opt in optimizers:
        if not isinstance(opt, torch.optim.SGD):
            continue
        for group in opt.param_groups:
            if group["momentum"] == 0 or group["dampening"] != 0:
                continue
            missing += [(opt, p) for p in group["params"] if p.grad is not None and opt.state.get(p, {}).get("momentum_buffer") is None]
    return missing


def zero_momentum_buffers_(missing: list[tuple[torch.optim.Optimizer, torch.Tensor]]) -> None:
    """A zero ``momentum_buffer`` for each param :func:`missing_momentum_buffers` found."""
    for opt, param in missing:
        assert param.grad is not None  # only params with a gradient are missing a buffer
        opt.state[param]["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)


Snapshot = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any] | None]]
"""Per param with a gradient: the param, copies of its value and gradient, and of its state (``None``:
it had none)."""


def snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> Snapshot:
    """Keep what a step of ``opt`` may change: each param with a gradient, its gradient (scaled in
    place before a step) and its state."""
    kept: Snapshot = []
    for p in params:
        if p.grad is None:
            continue
        state = opt.state.get(p)
        copied = None if state is None else {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}
        kept.append((p, p.detach().clone(), p.grad.clone(), copied))
    return kept


def tensors_of(opt: torch.optim.Optimizer, snapshot: Snapshot) -> list[torch.Tensor]:
    """The floating tensors a step wrote: the params in ``snapshot`` and their state, the tensors
    of state lists included (PSGD keeps its Kronecker factors in one)."""
    found = []
    for p, _, _, _ in snapshot:
        found.append(p.detach())
        for value in opt.state.get(p, {}).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            found += [v for v in items if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return found


def restore_(opt: torch.optim.Optimizer, snapshot: Snapshot) -> None:
    """Put back what :func:`snapshot` kept (state created since is dropped)."""
    for p, value, grad, state in snapshot:
        p.detach().copy_(value)
        if p.grad is not None:
            p.grad.copy_(grad)
        if state is None:
            opt.state.pop(p, None)
        else:
            opt.state[p] = state
