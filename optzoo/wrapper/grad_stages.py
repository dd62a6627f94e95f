"""The gradient stages of one step, each a function over the parameter map or its main grads.

In order (:meth:`optzoo.MixedPrecisionOptimizer.step` calls them as a list, the way optax chains
``clip_by_global_norm`` and ``apply_if_finite``):

1. :func:`model_params_to_working_copies`: the params whose memory has gaps into their dense
   working copies; :func:`model_grads_to_main_grads`: each model gradient to where its inner
   optimizer reads it;
2. :func:`norm_and_check`: one norm pass over the still scaled gradients, which detects inf/NaN
   and gives the clip coefficient (:func:`clip_coefficient`); :func:`factors_of`: coefficient and
   loss scale as one factor, applied by the inner optimizers (``fold_clip_and_scale``, the
   default). Megatron's
   separate passes instead: :func:`find_inf_and_unscale_` then :func:`clip_by_global_norm_`;
3. :func:`count_zeros`: zero gradient elements, for logging;
4. (the inner optimizers step) :func:`main_params_to_model_params`: updated fp32 main params back
   into the 16-bit model params, and working copies back into their params.

With a process group (the distributed optimizers, FSDP2) each rank holds its own share of the
gradients, and the inf flag, the norm and the zero count are reduced over the group, so every
rank takes the same decision and reports the single-process values.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optzoo._common import local_shard
from optzoo.wrapper.param_map import ParamEntry, ParamMap, part_of
from optzoo.wrapper.scalers import MegatronGradScaler

__all__ = [
    "clear_grads_",
    "clip_by_global_norm_",
    "clip_coefficient",
    "clip_needed",
    "count_zeros",
    "factors_of",
    "find_inf_and_unscale_",
    "global_grad_norm",
    "grad_factors",
    "grad_presence",
    "main_params_to_model_params",
    "model_grads_to_main_grads",
    "model_params_to_working_copies",
    "norm_and_check",
    "norm_under_scale",
    "unscaled_norm",
]


def _model_grad(entry: ParamEntry, param_map: ParamMap) -> torch.Tensor | None:
    if param_map.grad_source == "main_grad":
        grad = getattr(entry.model, "main_grad", None)
        if grad is None:
            raise ValueError(
                f"`{entry.name}`: params_have_main_grad=True but the parameter has no main_grad; "
                "got None; expected a main_grad buffer on every trainable parameter"
            )
        if not isinstance(grad, torch.Tensor) or tuple(grad.shape) != tuple(entry.model.shape) or not grad.is_floating_point():
            got = f"{type(grad).__name__}" if not isinstance(grad, torch.Tensor) else f"shape {tuple(grad.shape)}, {grad.dtype}"
            raise ValueError(
                f"`{entry.name}`: main_grad does not fit the parameter; got {got}; "
                f"expected a floating tensor of shape {tuple(entry.model.shape)}"
            )
        main = entry.main
        if entry.grad_target == "shared" and main is not None and grad.dtype != main.dtype:
            # "shared": the buffer becomes main.grad itself, which torch requires in main's dtype
            raise ValueError(
                f"`{entry.name}`: main_grad dtype does not match the parameter it is stepped on; got a {grad.dtype} "
                f"main_grad for a {main.dtype} parameter; expected {main.dtype} (torch steps a gradient in its "
                "parameter's dtype)"
            )
    else:
        grad = entry.model.grad
    if grad is not None and grad.is_sparse:
        raise ValueError(
            f"`{entry.name}`: sparse gradients are not supported; got a sparse {grad.layout} "
            "gradient; expected a dense gradient"
        )
    return grad


def _in_param_layout(grad: torch.Tensor, main: torch.Tensor) -> torch.Tensor:
    """``grad`` itself, or a copy laid out as ``main`` (the tensor the inner optimizer steps): fused
    kernels walk param and grad in memory order, so a grad laid out otherwise (a transposed view,
    a ``main_grad`` buffer, the grad of a param with gaps beside its working copy) would be
    applied to the wrong elements."""
    # Both contiguous: the same layout, told for a third of stride()'s cost on a Parameter.
    if isinstance(grad, DTensor) or (grad.is_contiguous() and main.is_contiguous()) or grad.stride() == main.stride():
        return grad
    return torch.empty_like(main, dtype=grad.dtype).copy_(grad)


def _reused(buffers: dict[int, torch.Tensor], position: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The caller's buffer for entry ``position``: ``like``'s shape and layout in ``dtype``, made
    once and kept between steps."""
    buffer = buffers.get(position)
    if buffer is None or buffer.dtype != dtype or buffer.shape != like.shape or buffer.stride() != like.stride() or buffer.device != like.device:
        buffer = buffers[position] = torch.empty_like(like, dtype=dtype)
    return buffer


def model_grads_to_main_grads(param_map: ParamMap, buffers: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Put each local param's gradient where its inner optimizer reads it; returns the main grads.

    Every gradient is checked before any is moved, so a bad one changes nothing. A 16-bit model
    gradient that was copied is dropped (its fp32 copy replaces it). With ``buffers`` (kept by the
    caller between steps, keyed by entry position) the fp32 copies are written into the same
    tensors every step, in one foreach copy, instead of fresh allocations.

    Raises:
        ValueError: A gradient is sparse, or ``main_grad`` is missing where it is the source.
    """
    if param_map.plain_models is not None:
        return _plain_grads(param_map)
    local, plain = param_map.local, param_map.plain_local
    found = [entry.model.grad if is_plain else _model_grad(entry, param_map) for entry, is_plain in zip(local, plain)]
    if any(grad is not None and grad.is_sparse for grad in found):
        for entry in local:
            _model_grad(entry, param_map)  # raises, naming the first sparse one
    main_grads = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for position, (entry, full_grad, is_plain) in enumerate(zip(local, found, plain)):
        main = entry.main
        if is_plain:
            if full_grad is None:
                continue
            in_layout = _in_param_layout(full_grad, entry.model)
            if in_layout is not full_grad:
                entry.model.grad = in_layout
            main_grads.append(in_layout)
            continue
        assert main is not None  # local entries have one
        grad = None if full_grad is None else part_of(full_grad, entry.part)
        if grad is not None and entry.part is None:
            grad = _in_param_layout(grad, main)
        if entry.grad_target == "decoupled":
            decoupled_dtype = param_map.decoupled_grad_dtype
            assert decoupled_dtype is not None  # set wherever the decoupled target is
            if grad is None or buffers is None or isinstance(grad, DTensor):
                decoupled = None if grad is None else grad.to(decoupled_dtype, copy=True)
            else:
                decoupled = _reused(buffers, position, grad, decoupled_dtype)
                copies.append((decoupled, grad))
            setattr(main, "decoupled_grad", decoupled)  # read by the precision-aware Adam
            if decoupled is not None:
                main_grads.append(decoupled)
                entry.model.grad = None
        elif grad is None:
            if main is not entry.model:
                # No new gradient: the fp32 copy's old one (from an earlier step, or from a skipped
                # inf/NaN step) must not be stepped again. torch and fp32 skip such a param too.
                main.grad = None
            continue
        elif entry.grad_target == "shared":
            main.grad = grad  # fp32: in place (main_grad is aliased, as Megatron does)
            main_grads.append(grad)
        elif buffers is None or isinstance(grad, DTensor):
            main.grad = grad.float()
            main_grads.append(main.grad)
            entry.model.grad = None  # the low-precision copy is no longer needed
        else:
            buffer = _reused(buffers, position, main, torch.float32)
            copies.append((buffer, grad))
            main.grad = buffer
            main_grads.append(buffer)
            entry.model.grad = None
    if copies:
        destinations, sources = zip(*copies, strict=True)
        torch._foreach_copy_(list(destinations), list(sources))
    return main_grads


def _plain_grads(param_map: ParamMap) -> list[torch.Tensor]:
    """:func:`model_grads_to_main_grads` when every param is plain: ``.grad`` is the main grad.
    The same checks in one loop, at half the per-param cost (2,000 params: 1 ms instead of 2);
    relaid gradients are attached after the loop, so a sparse one changes nothing."""
    models = param_map.plain_models
    assert models is not None
    main_grads: list[torch.Tensor] = []
    relaid: list[tuple[torch.Tensor, torch.Tensor]] = []
    for model in models:
        grad = model.grad
        if grad is None:
            continue
        if grad.is_sparse:
            for entry in param_map.local:
                _model_grad(entry, param_map)  # raises, naming the first sparse one
        in_layout = _in_param_layout(grad, model)
        if in_layout is not grad:
            relaid.append((model, in_layout))
        main_grads.append(in_layout)
    for model, grad in relaid:
        model.grad = grad
    return main_grads


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _local_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over every gradient, accumulated in fp32 (fp64 for fp64 grads)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    total_dtype = torch.float64 if torch.float64 in by_dtype else torch.float32
    norms = [
        torch.stack(torch._foreach_norm(same, 2, dtype=torch.promote_types(dtype, torch.float32))).to(
            device=grads[0].device, dtype=total_dtype
        )
        for dtype, same in by_dtype.items()
    ]
    total: torch.Tensor = torch.linalg.vector_norm(torch.cat(norms))
    return total


def global_grad_norm(
    grads: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device, uncounted: Collection[int] = ()
) -> torch.Tensor:
    """The L2 norm over every rank's gradients (each rank holding its own share).

    Args:
        grads: This rank's gradients (DTensors count by their local shards).
        group: The group to sum squared norms over; ``None``: this process alone.
        device: Where the result lives when this rank holds no gradient.
        uncounted: ids of gradients in ``grads`` whose local shard a lower rank of ``group``
            counts (a replica: :func:`optzoo.distributed.replicated_params`), left out of the sum.
    """
    if group is None:
        return _local_norm(grads)
    local = [local_shard(g) for g in grads if id(g) not in uncounted]
    squared = (_local_norm(local).double() ** 2) if local else torch.zeros((), dtype=torch.float64, device=device)
    replicas = [local_shard(g) for g in grads if id(g) in uncounted]
    if replicas:  # adds 0, or NaN for an inf/NaN replica: it skips the step on every rank as its own would
        squared = squared + 0.0 * _local_norm(replicas).double()
    _all_reduce(squared, dist.ReduceOp.SUM, group)
    return squared.sqrt().float()


def find_inf_and_unscale_(
    grads: list[torch.Tensor],
    grad_scaler: MegatronGradScaler | None,
    found_inf: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    with_norm: bool = False,
    uncounted: Collection[int] = (),
) -> tuple[bool, torch.Tensor | None, float | None]:
    """Unscale and detect inf/NaN on every rank; returns ``(found_inf, global norm, its value)``.

    With a scaler: unscale by ``inv_scale`` and check in one foreach pass per dtype (the flag,
    ``found_inf``, is reduced with MAX: one rank's inf skips every rank); the norm is computed
    only ``with_norm`` (for clipping), else it is ``(None, None)``. Without a scaler there is
    nothing to unscale, so one read pass computes the global norm (reused for clipping). Either
    way a non-finite norm is an overflow: an inf/NaN gradient, or finite gradients whose norm is
    beyond float32 (they would be clipped by 0 and still step). One host read per check.
    """
    if not grads and group is None:
        return False, None, None
    if grad_scaler is not None:
        found_inf.zero_()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(local_shard(grad))
        for same_dtype in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, grad_scaler.inv_scale)
        _all_reduce(found_inf, dist.ReduceOp.MAX, group)
        overflow = bool(found_inf.item() > 0)
        if overflow or not with_norm:
            return overflow, None, None
    norm = global_grad_norm(grads, group, found_inf.device, uncounted)
    value = float(norm)
    return not math.isfinite(value), norm, value


def norm_and_check(
    grads: list[torch.Tensor],
    grad_scaler: MegatronGradScaler | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    uncounted: Collection[int] = (),
) -> tuple[bool, torch.Tensor | None, float | None]:
    """One read pass over the still scaled gradients; returns ``(found_inf, norm, its value)``.

    The global norm, unscaled by multiplying it by ``inv_scale``, is non-finite exactly when a
    gradient element is inf or NaN, or when finite gradients overflow float32 in their sum of
    squares (they would be clipped by 0 and still step): either way the step is skipped. Its
    value is the step's one host read. The unscaled norm equals the norm of the unscaled
    gradients bit for bit when the scale is a power of two (the dynamic scaler's always are).
    A replica's inf/NaN (``uncounted``) is also one on the rank that counts it.
    """
    if not grads and group is None:
        return False, None, None
    norm = unscaled_norm(grads, grad_scaler, group, device, uncounted)
    value = float(norm)
    return not math.isfinite(value), norm, value


def unscaled_norm(
    grads: list[torch.Tensor],
    grad_scaler: MegatronGradScaler | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    uncounted: Collection[int] = (),
) -> torch.Tensor:
    """The global norm of the still scaled gradients times ``inv_scale``: a 0-dim float32 tensor
    (float64 for float64 grads), left on the device."""
    return norm_under_scale(grads, grad_scaler.scale if grad_scaler is not None else None, group, device, uncounted)


def norm_under_scale(
    grads: list[torch.Tensor],
    scale: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    uncounted: Collection[int] = (),
) -> torch.Tensor:
    """The global norm of gradients that carry the loss scale ``scale`` (``None``: none), unscaled:
    :func:`unscaled_norm` for a scale already read off the scaler."""
    norm = global_grad_norm(grads, group, device, uncounted)
    return (norm * _inverse(scale)).reshape(()) if scale is not None else norm.reshape(())


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` computed in float64 and cast, as :attr:`MegatronGradScaler.inv_scale` is."""
    return scale.double().reciprocal().float()


def clip_needed(max_norm: float, norm_value: float | None) -> bool:
    """Whether Megatron's clip coefficient ``max_norm / (norm + 1e-6)`` is below 1 (``max_norm``
    0: clipping is off)."""
    return max_norm > 0.0 and norm_value is not None and max_norm / (norm_value + 1e-6) < 1.0


def grad_factors(
    norm: torch.Tensor | None, grad_scaler: MegatronGradScaler | None, max_norm: float, *, clip: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(multiplier, divisor)``, 0-dim float32 tensors, that bring every gradient to unscaled and
    clipped, or ``None`` when that factor is exactly 1 (no loss scale and ``clip`` False).

    :func:`factors_of` the scaler's current scale and, with ``clip``, Megatron's coefficient
    (:func:`clip_coefficient`; ``step_on_device``, which cannot ask :func:`clip_needed` first,
    always clips: a coefficient of exactly 1 changes no bit).
    """
    coefficient = None
    if clip:
        assert norm is not None
        coefficient = clip_coefficient(norm, max_norm)
    return factors_of(grad_scaler.scale if grad_scaler is not None else None, coefficient)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Megatron's clip coefficient ``clamp(max_norm / (norm + 1e-6), max=1)``, 0-dim, on the device."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0).reshape(())


def factors_of(scale: torch.Tensor | None, coefficient: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(multiplier, divisor)`` for gradients that carry the loss scale ``scale`` and are still to be
    clipped by ``coefficient`` (either ``None``: none), or ``None`` when the factor is exactly 1.

    ``multiplier = coefficient / scale`` for a pass over the gradients; ``divisor = scale /
    coefficient`` for torch's fused kernels, which divide by their ``grad_scale``. The scale is the
    one the gradients were scaled by, read before the scaler updates (a dynamic scaler may grow).
    """
    if coefficient is None:
        return None if scale is None else (_inverse(scale).reshape(()), scale.reshape(()))
    if scale is None:
        return coefficient, coefficient.double().reciprocal().float()
    return (_inverse(scale) * coefficient).reshape(()), (scale / coefficient).reshape(())


def clip_by_global_norm_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor, norm_value: float) -> float:
    """Scale by ``max_norm / (norm + 1e-6)`` where that is below 1 (Megatron's rule); returns the norm.

    ``norm`` and ``norm_value`` are the global norm as :func:`find_inf_and_unscale_` gives it
    (the tensor for the arithmetic, its value read once on the host).
    """
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_([local_shard(g) for g in grads], coefficient)
    return norm_value


def count_zeros(
    grads: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device, uncounted: Collection[int] = ()
) -> int:
    """Zero elements over every rank's gradients, each distinct piece once (``uncounted``: ids of
    replicas another rank counts, as in :func:`global_grad_norm`)."""
    local = [local_shard(g) for g in grads if id(g) not in uncounted]
    zeros = torch.tensor(
        [sum(g.numel() for g in local) - int(sum(torch.count_nonzero(g) for g in local) if local else 0)],
        dtype=torch.int64, device=device,
    )  # fmt: skip
    _all_reduce(zeros, dist.ReduceOp.SUM, group)
    return int(zeros.item())


def model_params_to_working_copies(param_map: ParamMap) -> None:
    """Refresh each working copy (the dense main of a param whose memory has gaps) from its
    param, in one foreach copy: the model stays the truth, whatever wrote it since the last step
    (a loaded checkpoint, an in-place edit)."""
    mains: list[torch.Tensor] = []
    for entry in param_map.working_local:
        assert entry.main is not None  # local entries have one
        mains.append(entry.main)
    if mains:
        torch._foreach_copy_(mains, [entry.model for entry in param_map.working_local])


def main_params_to_model_params(param_map: ParamMap) -> None:
    """Copy each updated main param that is a copy (fp32 of a 16-bit param, or a working copy)
    into its model param, in one foreach copy (DTensor parts one by one)."""
    models, mains = [], []
    for entry in param_map.local:
        if not entry.aliased:
            assert entry.main is not None  # local entries have one
            model_part = entry.model_part
            if isinstance(model_part, DTensor) or isinstance(entry.main, DTensor):
                model_part.copy_(entry.main)
            else:
                models.append(model_part)
                mains.append(entry.main)
    if models:
        torch._foreach_copy_(models, mains)


def grad_presence(param_map: ParamMap) -> dict[int, bool]:
    """``{id(main): whether its model param has a gradient now}`` for the local entries, read from
    where this step will read it (``.grad`` or ``main_grad``) before anything is moved."""
    source = param_map.grad_source
    return {
        id(entry.main): (getattr(entry.model, "main_grad", None) if source == "main_grad" else entry.model.grad) is not None
        for entry in param_map.local
    }


def _had_grad(entry: ParamEntry) -> bool:
    """Whether the last step copied a model gradient for this entry and released the model's."""
    main = entry.main
    if main is None:
        return False
    copied = getattr(main, "decoupled_grad", None) if entry.grad_target == "decoupled" else main.grad if main is not entry.model else None
    return copied is not None


def clear_grads_(param_map: ParamMap, set_to_none: bool) -> None:
    """Clear what the inner optimizers' ``zero_grad`` does not reach: 16-bit model grads, the
    ``main_grad`` buffers and the precision-aware Adam's ``decoupled_grad``."""
    for entry in param_map.local:
        model, main = entry.model, entry.main
        if not entry.aliased and model.grad is not None:
            model.grad = None if set_to_none else model.grad.zero_()
        elif not set_to_none and param_map.grad_source == "grad" and model.grad is None and _had_grad(entry):
            # The step released this model grad after copying it (fp32 copies, decoupled grads):
            # torch's zero_grad(set_to_none=False) leaves a zero gradient, which the next step
            # steps (weight decay, momentum) as fp32 params are stepped.
            model.grad = torch.zeros_like(model)
        main_grad = getattr(model, "main_grad", None) if param_map.grad_source == "main_grad" else None
        if main_grad is not None:
            main_grad.zero_()
        if entry.grad_target == "decoupled":
            setattr(main, "decoupled_grad", None)
