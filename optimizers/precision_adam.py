"""Precision-aware Adam(W): fp32 math over master weights, bf16 remainders and low-precision moments.

Megatron-Core's ``use_precision_aware_optimizer`` hands these options to Transformer Engine's
``FusedAdam``. This module is our own device-agnostic torch version of that optimizer: the
storage policy (which dtype holds what) is TE's, the arithmetic is ``torch.optim.Adam(W)``'s:
by default torch's own fused (or foreach) kernel, one param at a time, or the plain per-tensor
:func:`adam_update_` (``fused=False, foreach=False``), a transcription of torch's single-tensor Adam.

The bf16 + remainder encoding (``store_param_remainders``) stores an fp32 master as the bf16
model param plus an int16 holding the master's low 16 bits. Cutting the fp32 bit pattern into
halves and rounding the high half up in magnitude whenever the low half is at least ``0x8000``
keeps every low half inside int16 and makes the round trip exact: 2 bytes of master state per
parameter instead of 4, for no loss in the master.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
import types
from collections.abc import Callable, Mapping
from typing import Any, override

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as torch_adam
from torch.optim.optimizer import ParamsT, StateDict

from .._common import PARAM_DTYPES, describe_param, has_fused_kernel
from ._checked import CheckedGroupsOptimizer, check_lr
from .bf16_remainder import join_bf16_remainder, split_fp32_into_
from .state_layout import COUNT, StateLayout, per_element

__all__ = [
    "COMPILED_DTYPES",
    "MASTER_DTYPES",
    "MOMENT_DTYPES",
    "PrecisionAwareAdam",
    "adam_update_",
]

MOMENT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes ``exp_avg`` and ``exp_avg_sq`` may be stored in (TE also offers fp8, which we lack)."""
MASTER_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes a full master copy may be stored in."""


def adam_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
) -> None:
    """One Adam(W) step in place on same-dtype tensors; ``grad`` is read, never written.

    The operations and their order are those of torch's ``_single_tensor_adam`` (non-capturable,
    torch 2.14), so float32 inputs give torch.optim.AdamW(foreach=False)'s bits.

    Args:
        param: the values to update (the master weights).
        grad: the gradient.
        exp_avg: first moment, updated.
        exp_avg_sq: second moment, updated.
        step: the step number after increment (1 on the first step).
        lr, beta1, beta2, eps, weight_decay: the group's hyperparameters.
        decoupled_weight_decay: AdamW's ``p *= 1 - lr * wd`` if True, else L2 (``g += wd * p``).
    """
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


logger = logging.getLogger(__name__)

COMPILED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
"""Gradient and moment dtypes the compiled remainder update takes (others take the eager kernels)."""

_HIGH_HALF = -65536  # 0xFFFF0000 as int32
_F32 = torch.float32


def _even_half(pairs: torch.Tensor) -> torch.Tensor:
    """The first 16-bit value of each int32 pair (little-endian) as the float it widens to."""
    return (pairs << 16).view(_F32)


def _odd_half(pairs: torch.Tensor) -> torch.Tensor:
    return (pairs & _HIGH_HALF).view(_F32)


def _bf16_in_high_half(x: torch.Tensor) -> torch.Tensor:
    """torch's fp32 -> bf16 rounding (nearest even; NaN -> 0xFFFF, as its vectorised ``.to`` gives),
    in the high 16 bits of an int32."""
    bits = x.view(torch.int32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) & _HIGH_HALF
    return torch.where(x != x, _HIGH_HALF, rounded)


def _pack(even_high: torch.Tensor, odd_high: torch.Tensor) -> torch.Tensor:
    """Two values held in high 16 bits, as one int32 pair (even first)."""
    return odd_high | ((even_high >> 16) & 0xFFFF)


def _load_pair(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(even, odd) fp32 values of bf16 int32 pairs, (n/2, 1), or of fp32 values, (n/2, 2)."""
    if stored.dtype == torch.int32:
        return _even_half(stored[:, 0]), _odd_half(stored[:, 0])
    return stored[:, 0], stored[:, 1]


def _store_pair(stored: torch.Tensor, even: torch.Tensor, odd: torch.Tensor) -> None:
    if stored.dtype == torch.int32:
        stored.copy_(_pack(_bf16_in_high_half(even), _bf16_in_high_half(odd)).unsqueeze(1))
    else:
        stored.copy_(torch.stack((even, odd), dim=1))


def _fused_adam_math(
    w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: torch.Tensor, grad_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's CPU fused Adam(W) on fp32 values, rounding as its vectorised loop does: lerp as an
    explicit FMA; ``v * beta2 + (c2 * g) * g`` and L2's ``g + w * wd`` with their last product
    contracted into an FMA by the compiler that built torch; a correctly rounded sqrt (eager
    ``torch.sqrt`` on fp32 is not); no other FMAs. Found by comparing bits, pinned by tests.

    ``s`` holds the kernel's scalars (see :meth:`PrecisionAwareAdam._compiled_scalars`); its
    branches are selects on flags in ``s``, so one graph serves every setting.
    """
    fma = torch.ops.prims.fma
    g = g / grad_scale
    w = w * s[0]  # AdamW's 1 - lr * wd; 1, which is exact, otherwise
    g = torch.where(s[9] != 0, fma(w, s[1], g), g)  # L2 decay, contracted by the compiler too
    m = fma(s[2], g - m, torch.where(s[8] != 0, m, g))  # lerp: weight, or weight - 1 from g
    v = fma(s[4] * g, g, v * s[3])
    w = w + s[7] * m / (torch.sqrt(v) / s[5] + s[6])
    return w, m, v


def _remainder_adam_update(
    params: torch.Tensor, remainders: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor, scalars: torch.Tensor, grad_scale: torch.Tensor,
) -> None:
    """One Adam(W) step of bf16 params with int16 remainders, two elements per int32 lane.

    16-bit tensors arrive as int32 pairs and fp32 ones as (n/2, 2) (see :func:`_pairs`). The fp32
    master of each element is joined, updated and split in registers: 18 bytes move per element
    instead of the eager path's ~80.
    """
    params, remainders = params[:, 0], remainders[:, 0]
    masters = []
    for half in (0, 1):
        high = params << 16 if half == 0 else params & _HIGH_HALF
        low = (remainders << 16) >> 16 if half == 0 else remainders >> 16
        masters.append((high + low).view(_F32))
    grads, ms, vs = _load_pair(grad), _load_pair(exp_avg), _load_pair(exp_avg_sq)
    updated = [_fused_adam_math(masters[h], grads[h], ms[h], vs[h], scalars, grad_scale) for h in (0, 1)]
    _store_pair(exp_avg, updated[0][1], updated[1][1])
    _store_pair(exp_avg_sq, updated[0][2], updated[1][2])
    even, odd = (u[0].view(torch.int32) for u in updated)
    carried_even, carried_odd = ((even >> 15) + 1) >> 1, ((odd >> 15) + 1) >> 1
    params.copy_((carried_odd << 16) | (carried_even & 0xFFFF))  # views: these write the inputs
    remainders.copy_((odd << 16) | (even & 0xFFFF))


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of a multiple of 16 elements, one element pair per lane: 16-bit values
    as int32 (n/2, 1) (inductor vectorises int32, not int16; strided bf16 loads are gathers, 2x
    slower), fp32 as (n/2, 2)."""
    flat = t.view(-1)
    return flat.view(torch.int32).view(-1, 1) if flat.element_size() == 2 else flat.view(-1, 2)


_VARIANTS: dict[tuple[str, ...], Callable[..., None]] = {}
"""One compiled function per (device type, grad, exp_avg, exp_avg_sq dtype), shared by every
optimizer. Each is built on its own copy of the code object, so each has its own dynamo cache:
one cache for all would recompile per dtype combination and reach dynamo's limit of 8."""


def _compiled_variant(args: tuple[torch.Tensor, ...]) -> Callable[..., None]:
    key = (args[0].device.type, *(str(t.dtype) for t in args[2:5]))
    fn = _VARIANTS.get(key)
    if fn is None:
        importlib.import_module("torch._inductor.inductor_prims")  # registers torch.ops.prims.fma
        original = _remainder_adam_update
        code = original.__code__.replace(co_name=f"{original.__name__}_{len(_VARIANTS)}")
        copy = types.FunctionType(code, original.__globals__, code.co_name, original.__defaults__)
        # dynamic_threads: a parallel loop whatever size the first call had (inductor sizes its
        # threading from that call's shapes; a 1024-element first call left 1M-element params serial)
        fn = _VARIANTS[key] = torch.compile(copy, dynamic=True, fullgraph=True, options={"cpp.dynamic_threads": True})
    return fn


class _CompiledUpdate:
    """Calls the compiled :func:`_remainder_adam_update`. If compiling fails (no C++ compiler, no
    Triton), it logs one line and returns False from then on: the caller steps eagerly."""

    def __init__(self) -> None:
        self.failed: str | None = None
        self.compile_seconds: float | None = None

    def __call__(self, *args: torch.Tensor) -> bool:
        if self.failed is not None:
            return False
        started = time.perf_counter()
        try:
            _compiled_variant(args)(*args)
        except Exception as error:
            # Compile errors and dynamo's recompile limit surface before the kernel runs: nothing is written.
            if not isinstance(error, (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit)):
                raise
            self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            logger.warning("PrecisionAwareAdam: torch.compile is unavailable (%s); using the eager kernels", self.failed)
            return False
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - started
        return True


def _check_dtype(name: str, dtype: object, allowed: tuple[torch.dtype, ...]) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"`{name}`: must be a torch.dtype; got {dtype!r}; expected one of {allowed}")
    if dtype not in allowed:
        raise ValueError(f"`{name}`: unsupported dtype; got {dtype}; expected one of {allowed}")


def _master_kind(master: torch.Tensor | None) -> str:
    """How a saved ``master_param`` represents the master: none, int16 remainders or a float copy."""
    if master is None:
        return "none"
    return "int16 remainders" if master.dtype == torch.int16 else "a float copy"


def _laid_out_as_state(saved: torch.Tensor, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A saved state tensor in ``dtype``, laid out as :meth:`PrecisionAwareAdam._init_state` lays
    out ``param``'s (a checkpoint from a param of another layout would otherwise cost the fused
    kernel a copy of the master every step)."""
    if saved.shape == param.shape and not isinstance(saved, DTensor) and not isinstance(param, DTensor):
        return torch.empty_like(param, dtype=dtype).copy_(saved)
    return saved.to(device=param.device, dtype=dtype, copy=True)


def _store(destination: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into ``destination`` (rounding to nearest even) unless it already is it."""
    if value is not destination:
        destination.copy_(value)


class PrecisionAwareAdam(CheckedGroupsOptimizer):
    r"""Adam(W) with Transformer Engine ``FusedAdam``'s storage options, computed in fp32.

    Update, per element, with the step's master weight :math:`w` (fp32) and gradient :math:`g`:

    .. math::
        w &\leftarrow w (1 - \eta \lambda) \quad\text{(decoupled) or}\quad g \leftarrow g + \lambda w \quad\text{(L2)} \\
        m &\leftarrow \beta_1 m + (1 - \beta_1) g, \qquad v \leftarrow \beta_2 v + (1 - \beta_2) g^2 \\
        w &\leftarrow w - \frac{\eta}{1 - \beta_1^t} \frac{m}{\sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon}

    (Kingma & Ba, 2015; Loshchilov & Hutter, 2019). Each step reads the gradient (``p.grad``, or
    ``p.decoupled_grad`` with ``use_decoupled_grad``: any float dtype), upcasts it and the moments
    to fp32, rebuilds the fp32 master (the param itself, ``state["master_param"]``, or the bf16
    param joined with its int16 remainder), updates, and writes everything back to its storage
    dtype: moments and masters with round-to-nearest-even, the model param with
    round-to-nearest-even from the master, or with remainders as
    :func:`optzoo.optimizers.bf16_remainder.split_fp32`'s high half.

    The arithmetic runs in one of three kernels, chosen per param group at construction: torch's
    fused Adam (via :func:`torch.optim.adam.adam`, ``fused=True``; the default where the
    device has it, bitwise ``torch.optim.AdamW(fused=True)`` on the master), torch's foreach Adam
    (the default elsewhere; bitwise ``foreach=True``), or the plain per-tensor
    :func:`adam_update_` (``fused=False, foreach=False``; bitwise ``foreach=False``). The fused
    kernel does the update in one pass, but rounds differently from the plain one (its own
    operation order), so the paths agree to fp32 rounding, not bitwise. Every kernel is called on
    one param at a time, so at most one fp32 master is rebuilt at once. The fused kernel walks
    memory in order, so it gets master, gradient and moments laid out alike and without gaps:
    a param whose memory has gaps (``x[..., 0]``) is stepped as a dense copy, written back.

    Reference implementation: TE ``FusedAdam``,
    https://github.com/NVIDIA/TransformerEngine/blob/04912bf024514826f31cc02485d396974af68516/transformer_engine/pytorch/optimizers/fused_adam.py
    and its remainder kernel,
    https://github.com/NVIDIA/TransformerEngine/blob/c250752ab27c9d84da0334022b05717792b4d730/transformer_engine/common/multi_tensor/adam.cu

    Deviations from TE:
        * Arithmetic is torch's Adam (same bits as ``torch.optim.AdamW`` with the same kernel), not
          TE's kernel, which divides ``m`` and ``v`` by their bias corrections first.
        * fp16 moments and masters are stored with a plain cast: TE keeps a per-tensor fp32 scale
          for them. A plain fp16 ``exp_avg_sq`` (about g**2) overflows once |g| stays above ~256
          and loses bits below 6.1e-5 (zero below 3e-8); prefer bf16 moments. fp8 (``torch.uint8``)
          state is not offered.
        * ``master_weight_dtype`` may be bfloat16 (TE: fp32 or fp16), and must hold every param
          value exactly: a 16-bit master only for params of that dtype, no fp32 master for fp64
          params (TE scales fp16 masters of bf16 params; we would overflow past 65504).
        * Options that cannot take effect raise instead of being ignored (TE silently drops
          ``store_param_remainders`` without fp32 masters or for non-bf16 params).
        * ``step`` is counted per parameter, as in torch, not per group.
        * float64 params are computed in float64 (TE rejects them).
        * ``state_dict()`` keeps the stored dtypes (TE upcasts to fp32); ``load_state_dict``
          casts moments to this optimizer's dtypes and requires the same master representation.

    Args:
        params: params or param groups, as for any torch optimizer.
        lr: learning rate :math:`\eta`. Default 1e-3, torch's.
        betas: :math:`(\beta_1, \beta_2)`, each in [0, 1). Default (0.9, 0.999), torch's.
        eps: :math:`\epsilon`, added to the bias-corrected :math:`\sqrt{v}`. Default 1e-8.
        weight_decay: :math:`\lambda` >= 0. Default 0.
        decoupled_weight_decay: AdamW (True, the default, as in Megatron) or L2 (False).
        master_weights: keep a master copy in ``state["master_param"]``. Default False.
        master_weight_dtype: that copy's dtype: float32 (default), bfloat16 or float16; it must hold
            the param's values exactly (``torch.promote_types(param.dtype, it) == it``).
        store_param_remainders: with bf16 params and fp32 masters, store only the master's
            low 16 bits (int16); the bf16 param holds the rounded high half. Default False.
        exp_avg_dtype: storage dtype of ``exp_avg``: float32 (default), bfloat16 or float16.
        exp_avg_sq_dtype: storage dtype of ``exp_avg_sq``, same choices.
        use_decoupled_grad: read ``p.decoupled_grad`` instead of ``p.grad`` (Megatron sets it when
            the grad dtype differs from the param's). Default False.
        fused: torch's fused kernel. None (default): where every param of the group is on a device
            with one (``torch.utils._foreach_utils._get_fused_kernels_supported_devices()``) and
            ``foreach`` is not True; True: required (else ValueError); False: not used. Unlike
            ``torch.optim.Adam``, whose fused default is off, this defaults to on: it is the
            fastest kernel here, and ``step`` then lives on the param's device as float32.
        foreach: torch's foreach kernel, used when the fused one is not: None (default) and True
            use it, False selects the plain per-tensor path (with ``fused`` not True).
        compiled: in fused groups with ``store_param_remainders``, replace the fused kernel and its
            eight conversion passes by one ``torch.compile``\ d pass that joins, updates and splits
            the master in registers (18 bytes moved per element instead of about 80), bit for bit
            what torch's CPU fused kernel gives (same roundings, FMAs included). It takes params
            whose count is a multiple of 16, contiguous, with bf16 or fp32 grads and moments;
            others use the fused kernel. The first call compiles (3-10 s, then cached on disk by
            inductor); if compiling fails, one warning is logged and the eager kernels run. Default
            False: on this project's 2-core CPUs it is no faster than the eager kernels (inductor
            turns each int32/fp32 reinterpretation into a scalar loop; docs/benchmarks.md), and
            on CUDA it is unmeasured and rounds as torch's CPU kernel does, not as its CUDA one.
            It reads ``step`` and ``found_inf`` on the host.

    Raises:
        TypeError: a dtype argument is not a ``torch.dtype``, a param's dtype is unsupported, or
            ``compiled`` is not a bool.
        ValueError: a hyperparameter is out of range, an option cannot take effect (``fused=True``
            with ``foreach=True`` or on a device without the kernel, ``compiled=True`` without
            remainders), a param cannot be held by the master dtype or the remainders, or (during
            ``step``) a gradient is sparse or misshapen.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
        >>> opt = PrecisionAwareAdam([w], lr=0.1, master_weights=True, store_param_remainders=True)
        >>> w.grad = torch.ones_like(w)
        >>> opt.step()
        >>> w.tolist(), opt.state[w]["master_param"].dtype
        ([0.8984375, 0.8984375, 0.8984375], torch.int16)
    """

    def __init__(
        self,
        params: ParamsT,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = True,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = False,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        fused: bool | None = None,
        foreach: bool | None = None,
        compiled: bool = False,
    ) -> None:
        _check_dtype("exp_avg_dtype", exp_avg_dtype, MOMENT_DTYPES)
        _check_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype, MOMENT_DTYPES)
        _check_dtype("master_weight_dtype", master_weight_dtype, MASTER_DTYPES)
        if not master_weights and master_weight_dtype != torch.float32:
            raise ValueError(
                f"`master_weight_dtype`: takes effect only with master_weights=True; got {master_weight_dtype} "
                "with master_weights=False; expected torch.float32 (the default) or master_weights=True"
            )
        if store_param_remainders and not master_weights:
            raise ValueError(
                "`store_param_remainders`: remainders complete an fp32 master, so they need master weights; "
                "got master_weights=False; expected master_weights=True or store_param_remainders=False"
            )
        if store_param_remainders and master_weight_dtype != torch.float32:
            raise ValueError(
                "`store_param_remainders`: bf16 param + int16 remainder rebuild an fp32 master only; "
                f"got master_weight_dtype={master_weight_dtype}; expected torch.float32"
            )
        # Set before super().__init__, which calls add_param_group (and so _check_group).
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.store_param_remainders = store_param_remainders
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.use_decoupled_grad = use_decoupled_grad
        defaults = {
            "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay, "fused": fused, "foreach": foreach,
        }
        super().__init__(params, defaults)
        # torch's GradScaler protocol: ``step`` divides each gradient by ``self.grad_scale`` (a
        # 1-element tensor) when it is set, in the fused kernel or as it upcasts the gradient,
        # and skips the update where ``self.found_inf`` is set to 1.
        self._step_supports_amp_scaling = True
        self._scratch: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.compiled = compiled  # checked by the setter, also when set later
        self._compiled_update = _CompiledUpdate()
        self._skipping: bool | None = None  # found_inf, read once per step where a kernel needs it

    def _check_group(self, group: dict[str, Any], index: int) -> None:
        where = f"param group #{index}"
        check_lr(group, where)
        for name in ("eps", "weight_decay"):
            if not group[name] >= 0:
                raise ValueError(f"{where}: `{name}`: must be non-negative; got {group[name]}; expected {name} >= 0")
        betas = group["betas"]
        if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"{where}: `betas`: each must lie in [0, 1); got {betas}; expected (beta1, beta2) in [0, 1)")
        for i, param in enumerate(group["params"]):
            self._check_param(param, describe_param(group, index, i))
        self._choose_kernel(group, where)

    @staticmethod
    def _choose_kernel(group: dict[str, Any], where: str) -> None:
        """Resolve the group's ``fused`` / ``foreach`` to bools: fused, else foreach, else plain."""
        fused, foreach = group["fused"], group["foreach"]
        for name, value in (("fused", fused), ("foreach", foreach)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{where}: `{name}`: must be a bool or None; got {value!r}; expected True, False or None")
        if fused and foreach:
            raise ValueError(f"{where}: `fused`, `foreach`: pick one kernel; got fused=True, foreach=True; expected at most one True")
        params = group["params"]
        # The devices decide, not the layouts: _step_param steps a param with gaps as a dense copy.
        if fused is None:
            fused = foreach is not True and has_fused_kernel(params)
        elif fused and not has_fused_kernel(params):
            devices = sorted({p.device.type for p in params if not has_fused_kernel([p])})
            raise ValueError(
                f"{where}: `fused`: torch has no fused Adam kernel for these params; got devices {devices}; "
                "expected devices in torch.utils._foreach_utils._get_fused_kernels_supported_devices(), or fused=None"
            )
        group["fused"], group["foreach"] = fused, foreach is not False and not fused

    def _check_param(self, param: torch.Tensor, where: str) -> None:
        """The param's dtype suits the storage options (at construction, and at each step in case
        the model was cast since)."""
        if param.dtype not in PARAM_DTYPES:
            raise TypeError(f"{where}: dtype not supported; got {param.dtype}; expected one of {PARAM_DTYPES}")
        if self.store_param_remainders and param.dtype != torch.bfloat16:
            raise ValueError(
                f"{where}: `store_param_remainders` needs bf16 params (they hold the master's high half); "
                f"got {param.dtype}; expected torch.bfloat16"
            )
        master = self.master_weight_dtype
        if self.master_weights and torch.promote_types(param.dtype, master) != master:
            # TE keeps a per-tensor scale for fp16 masters; unscaled, an fp16 master of bf16 params
            # overflows past 65504 and keeps fewer bits than bf16 below 6.1e-5.
            held = [d for d in PARAM_DTYPES if torch.promote_types(d, master) == master]
            raise ValueError(
                f"{where}: `master_weight_dtype` {master} cannot hold every value of the param (masters are "
                f"stored unscaled); got a {param.dtype} param; expected a param dtype in {held}"
            )

    @override
    def _update(self) -> None:
        """One update of every param that has a gradient. torch's fused kernel skips itself on a
        set ``found_inf``; the other kernels are skipped here, after one read of it per step."""
        self._skipping = None
        for group_index, group in enumerate(self.param_groups):
            for param_index, param in enumerate(group["params"]):
                self._step_param(param, group, group_index, param_index)

    def _skip_step(self) -> bool:
        """Whether torch's GradScaler set ``found_inf`` (read from the device once per step)."""
        if self._skipping is None:
            found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
            self._skipping = found_inf is not None and bool(found_inf.item())
        return self._skipping

    def _step_param(self, param: torch.Tensor, group: dict[str, Any], group_index: int, param_index: int) -> None:
        grad: torch.Tensor | None = getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad
        if grad is None:
            return
        self._check_step_inputs(param, grad, describe_param(group, group_index, param_index))
        state = self.state[param]
        if not state:
            self._init_state(param, state, group)
        if self._compiles(param, grad, state, group):
            if self._skip_step() or self._step_compiled(param, grad, state, group):
                return
        elif not group["fused"] and self._skip_step():
            return
        # float64 params keep float64 math; everything else is computed in float32, as in TE.
        compute = torch.float64 if param.dtype == torch.float64 else torch.float32
        master = self._read_master(param, state, compute)
        exp_avg = self._upcast(state["exp_avg"], compute, "exp_avg")
        exp_avg_sq = self._upcast(state["exp_avg_sq"], compute, "exp_avg_sq")
        beta1, beta2 = group["betas"]
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        # torch's fused kernel walks its tensors in memory order, so all four must be laid out
        # alike, without gaps. The moments are (zeros_like lays out a param with gaps densely);
        # the master of such a param (the param itself, with no master copy) is stepped as a
        # dense copy that _write_master writes back, and a gradient laid out otherwise (a
        # transposed one: torch.optim.AdamW(fused=True) misapplies it) is copied.
        # (Both contiguous, the common case, is told without stride(), which costs more on a Parameter.)
        if group["fused"] and not (master.is_contiguous() and exp_avg.is_contiguous()) and master.stride() != exp_avg.stride():
            master = torch.empty_like(exp_avg).copy_(master)
        if group["fused"] and grad.stride() != master.stride():
            compute_grad = torch.empty_like(master).copy_(grad)
        else:
            compute_grad = self._upcast(grad, compute, "grad")  # 16-bit: a fresh fp32 copy per param page-faults
        if grad_scale is not None and not group["fused"]:
            compute_grad = torch.div(compute_grad, grad_scale.to(compute_grad.device))
        if group["fused"] or group["foreach"]:
            if group["fused"] and state["step"].device != param.device:  # saved by a non-fused group
                state["step"] = state["step"].to(param.device)
            # One-element lists: torch's kernel, the transient fp32 master of one param at a time.
            # It adds 1 to ``step`` itself; grads are read, never written (maximize=False).
            torch_adam(
                [master], [compute_grad], [exp_avg], [exp_avg_sq], [], [state["step"]],
                foreach=group["foreach"], fused=group["fused"], decoupled_weight_decay=group["decoupled_weight_decay"],
                grad_scale=grad_scale if group["fused"] else None,
                found_inf=getattr(self, "found_inf", None) if group["fused"] else None,
                amsgrad=False, beta1=beta1, beta2=beta2, lr=float(group["lr"]), weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False,
            )
        else:
            state["step"] += 1
            adam_update_(
                master, compute_grad, exp_avg, exp_avg_sq, step=state["step"].item(), lr=float(group["lr"]),
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
        _store(state["exp_avg"], exp_avg)
        _store(state["exp_avg_sq"], exp_avg_sq)
        self._write_master(param, state, master)

    def _compiles(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> bool:
        """Whether this param takes the compiled remainder update, which stands in for the fused
        kernel bit for bit: remainders, bf16 or fp32 grads and moments, contiguous, a multiple of 16 elements."""
        if not self.compiled or not group["fused"]:
            return False
        tensors = (param, grad, state["master_param"], state["exp_avg"], state["exp_avg_sq"])
        return (
            # torch's kernel takes its last numel % 8 (AVX2; 16 with AVX512) elements through a scalar
            # loop that rounds differently; whole vectors only keep the parity simple
            param.numel() % 16 == 0
            and grad.dtype in COMPILED_DTYPES
            and state["exp_avg"].dtype in COMPILED_DTYPES
            and state["exp_avg_sq"].dtype in COMPILED_DTYPES
            and all(t.is_contiguous() and t.device == param.device for t in tensors)
        )

    def _step_compiled(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> bool:
        """The step through the compiled update; False (nothing changed) if it could not compile."""
        scalars = self._compiled_scalars(group, float(state["step"].item()) + 1, param.device)
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        # One shape and dtype whatever the caller set: each variant is a recompile, and dynamo allows 8.
        scale = torch.ones(1, device=param.device) if grad_scale is None else grad_scale.reshape(1).to(param.device, torch.float32)
        done = self._compiled_update(
            _pairs(param.data), _pairs(state["master_param"]), _pairs(grad), _pairs(state["exp_avg"]),
            _pairs(state["exp_avg_sq"]), scalars, scale,
        )
        if done:
            state["step"] += 1
        return done

    @staticmethod
    def _compiled_scalars(group: dict[str, Any], step: float, device: torch.device) -> torch.Tensor:
        """The fused kernel's scalars for ``step`` (float32 read as double, as the kernel reads it),
        each computed in double and rounded once to fp32, as the kernel does, plus the branch flags."""
        beta1, beta2 = group["betas"]
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
        decoupled = bool(group["decoupled_weight_decay"]) and weight_decay != 0
        l2 = not group["decoupled_weight_decay"] and weight_decay != 0
        weight = torch.tensor(1 - beta1, dtype=torch.float32)  # the kernel's lerp weight, in fp32
        small_lerp = bool(weight.abs() < 0.5)
        return torch.tensor(
            [
                1 - lr * weight_decay if decoupled else 1.0, weight_decay,
                float(weight if small_lerp else weight - 1),
                beta2, 1 - beta2, math.sqrt(1 - beta2**step), group["eps"], -(lr / (1 - beta1**step)),
                float(small_lerp), float(l2),
            ],
            dtype=torch.float32, device=device,
        )

    def _check_step_inputs(self, param: torch.Tensor, grad: torch.Tensor, where: str) -> None:
        source = "decoupled_grad" if self.use_decoupled_grad else "grad"
        if grad.is_sparse:
            raise ValueError(f"{where}: `{source}` is sparse, which Adam does not support; got {grad.layout}; expected torch.strided")
        if not torch.is_floating_point(grad):
            raise TypeError(f"{where}: `{source}` must be floating point; got {grad.dtype}; expected a float dtype")
        if grad.shape != param.shape:
            raise ValueError(f"{where}: `{source}` shape differs from the param's; got {tuple(grad.shape)}; expected {tuple(param.shape)}")
        self._check_param(param, where)  # the model may have been cast since construction

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        # A float32 scalar where torch's Adam keeps it: on the param's device for the fused kernel
        # (which reads it there), else on the CPU.
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=param.device if group["fused"] else "cpu")
        state["exp_avg"] = torch.zeros_like(param, dtype=self.exp_avg_dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.exp_avg_sq_dtype, memory_format=torch.preserve_format)
        if self.store_param_remainders:  # zero remainders: the master starts equal to the bf16 param
            state["master_param"] = torch.zeros_like(param, dtype=torch.int16, memory_format=torch.preserve_format)
        elif self.master_weights:
            state["master_param"] = param.detach().to(self.master_weight_dtype, copy=True)

    def _upcast(self, value: torch.Tensor, compute: torch.dtype, slot: str) -> torch.Tensor:
        """``value`` (a moment or a gradient) in ``compute`` dtype: itself when it already is, else
        a copy in scratch ``slot``. Fresh tensors for every param cost allocator churn and page
        faults that doubled the step."""
        if value.dtype == compute:
            return value
        if not value.is_contiguous():  # keep its layout (the param's, for the moments)
            return value.to(compute)
        return self._scratch_like(slot, compute, value).copy_(value)

    def _scratch_like(self, slot: str, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        """A contiguous ``dtype`` tensor of ``like``'s shape from buffer ``slot``, which is kept
        between params and steps and sized to the largest param seen."""
        key = (slot, dtype, like.device)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < like.numel():
            scratch = self._scratch[key] = torch.empty(like.numel(), dtype=dtype, device=like.device)
        return scratch[: like.numel()].view(like.shape)

    def _read_master(self, param: torch.Tensor, state: dict[str, Any], compute: torch.dtype) -> torch.Tensor:
        if self.store_param_remainders:
            remainder = state["master_param"]
            out = self._scratch_like("master", torch.int32, param) if param.is_contiguous() else None
            return join_bf16_remainder(param, remainder, out=out)
        source: torch.Tensor = state["master_param"] if self.master_weights else param
        return source.to(compute)

    def _write_master(self, param: torch.Tensor, state: dict[str, Any], master: torch.Tensor) -> None:
        if self.store_param_remainders:
            split_fp32_into_(master, param.data, state["master_param"])
            return
        if self.master_weights:
            _store(state["master_param"], master)
        _store(param, master)  # from the computed master, as TE writes the model param

    @property
    def compiled(self) -> bool:
        """Whether eligible params take the compiled remainder update (see the class's Args)."""
        return self._compiled

    @compiled.setter
    def compiled(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"`compiled`: must be a bool; got {value!r}; expected True or False")
        if value and not self.store_param_remainders:
            raise ValueError(
                "`compiled`: the compiled update is written for bf16 params with int16 remainders; got "
                "store_param_remainders=False; expected store_param_remainders=True, or compiled=False"
            )
        self._compiled = value

    @property
    def compile_seconds(self) -> float | None:
        """Seconds the first call of the compiled update took, compiling included (None before it,
        or where it never ran)."""
        return self._compiled_update.compile_seconds

    @property
    def compile_failure(self) -> str | None:
        """Why ``torch.compile`` failed (the eager kernels then run), or None."""
        return self._compiled_update.failed

    @torch.no_grad()
    def reload_master_weights_(self) -> None:
        """Make every master equal its param again (after weights were loaded into the model).

        A full master copy takes the param's value; a remainder becomes zero, so the fp32 master
        is exactly the bf16 param.
        """
        for group in self.param_groups:
            for param in group["params"]:
                master = self.state.get(param, {}).get("master_param")
                if master is None:
                    continue
                if self.store_param_remainders:
                    master.zero_()
                else:
                    master.copy_(param)

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; with ``use_decoupled_grad`` also clears ``p.decoupled_grad``."""
        super().zero_grad(set_to_none)
        if not self.use_decoupled_grad:
            return
        for group in self.param_groups:
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None)
                if grad is None:
                    continue
                if set_to_none:
                    setattr(param, "decoupled_grad", None)
                else:
                    grad.zero_()

    @override
    def _load_state_dict(self, state_dict: StateDict) -> None:
        """torch's ``load_state_dict``, keeping state in this optimizer's dtypes.

        torch casts every floating state tensor to its param's dtype (bf16 moments of an fp32
        param would come back fp32; int16 remainders would be cast to bf16 values), so the
        moments, masters and ``step`` are re-read from ``state_dict`` after torch loads it. As in
        torch, the groups' ``fused`` / ``foreach`` come from the state dict (a state dict saved
        before they existed keeps this optimizer's), and ``step`` is placed for that kernel. The
        checks are made first, so a rejected state dict leaves this optimizer unchanged.

        Raises:
            ValueError: a param's saved master does not match this optimizer's master
                representation (none, a float copy, or int16 remainders), or a saved group
                asks for the fused kernel on a device without one.
        """
        kernels: list[dict[str, Any]] = []
        restored: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for index, (saved_group, group) in enumerate(zip(state_dict["param_groups"], self.param_groups)):
            kernel = {"params": group["params"]} | {k: saved_group.get(k, group[k]) for k in ("fused", "foreach")}
            self._choose_kernel(kernel, f"`state_dict['param_groups'][{index}]`")
            kernels.append(kernel)
            for saved_id, param in zip(saved_group["params"], group["params"]):  # unequal counts: torch raises below
                saved = state_dict["state"].get(saved_id)
                if saved is not None:
                    restored[param] = self._restore(saved, param, saved_id, fused=kernel["fused"])
        self._torch_load_state_dict(state_dict)
        for group, kernel in zip(self.param_groups, kernels):
            group["fused"], group["foreach"] = kernel["fused"], kernel["foreach"]
        for param, values in restored.items():
            self.state[param].update(values)

    def state_layout(self, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout:
        """The state :meth:`_init_state` gives ``param`` (of whole shape ``shape``), for checking a checkpoint."""
        layout = {"step": COUNT, "exp_avg": per_element(shape), "exp_avg_sq": per_element(shape)}
        if self.store_param_remainders:
            layout["master_param"] = per_element(shape, "int16")
        elif self.master_weights:
            layout["master_param"] = per_element(shape)
        return layout

    def restore_state(self, saved: dict[str, Any], param: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        """One param's saved state, checked against this optimizer's master representation and
        kept in its dtypes (what ``optzoo``'s name-keyed loader calls); raises ``ValueError``."""
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        return self._restore(saved, param, name, fused=bool(group["fused"]))

    @override
    def _check_loaded_state(self, state_dict: StateDict) -> None:
        """The saved masters' representation first (its message names the settings), then the layout."""
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if isinstance(groups, list) and isinstance(state, Mapping):
            for saved_group in groups:
                for saved_id in saved_group.get("params", ()):
                    saved = state.get(saved_id)
                    if isinstance(saved, Mapping) and (saved.get("master_param") is None or isinstance(saved["master_param"], torch.Tensor)):
                        self.check_master(saved, saved_id)
        super()._check_loaded_state(state_dict)

    def check_master(self, saved: Mapping[str, Any], saved_id: int | str) -> None:
        """Raise ``ValueError`` unless a saved ``master_param`` is this optimizer's representation of the
        master (none, a float copy, or int16 remainders), naming the settings that decide it."""
        master = saved.get("master_param")
        found = _master_kind(master)
        wanted = "int16 remainders" if self.store_param_remainders else ("a float copy" if self.master_weights else "none")
        if found != wanted:
            shown = f"a {master.dtype} copy" if found == "a float copy" and master is not None else found
            where = f"`{saved_id}`: `master_param`" if isinstance(saved_id, str) else f"`state_dict['state'][{saved_id}]['master_param']`"
            raise ValueError(
                f"{where}: saved master differs from this optimizer's "
                f"(master_weights={self.master_weights}, store_param_remainders={self.store_param_remainders}); "
                f"got {shown}; expected {wanted}"
            )

    def _restore(self, saved: dict[str, Any], param: torch.Tensor, saved_id: int | str, *, fused: bool) -> dict[str, torch.Tensor]:
        self.check_master(saved, saved_id)
        master = saved.get("master_param")
        values: dict[str, torch.Tensor] = {}
        if "step" in saved:
            device = param.device if fused else torch.device("cpu")  # where _init_state puts it
            values["step"] = torch.as_tensor(saved["step"]).to(device=device, dtype=torch.float32, copy=True)
        for key, dtype in (("exp_avg", self.exp_avg_dtype), ("exp_avg_sq", self.exp_avg_sq_dtype)):
            if key in saved:
                values[key] = _laid_out_as_state(saved[key], param, dtype)
        if master is not None:
            dtype = torch.int16 if self.store_param_remainders else self.master_weight_dtype
            values["master_param"] = _laid_out_as_state(master, param, dtype)
        return values
