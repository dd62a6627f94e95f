"""The one door to ``emerging-optimizers``: every import of it goes through here.

We build on release 0.3.0 (pinned in pyproject.toml); later releases moved and removed modules,
so keeping the imports in one place makes an upgrade one file's work. Imports are lazy so that
``import optzoo.optimizers`` stays cheap and a missing package fails only where it is needed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._checked import KeepsSettingsOptimizer, autocast_disabled
from .newton_schulz import preserved_matmul_precision

_MISSING = (
    "the module `emerging_optimizers` (package emerging-optimizers==0.3.0) is required for this optimizer "
    "and could not be imported; install optzoo with its dependencies (`pip install optzoo`) or "
    "`pip install emerging-optimizers==0.3.0`"
)


def lion(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``emerging_optimizers.scalar_optimizers.Lion`` (Chen et al., 2023) over complete groups.

    Weight decay is decoupled (``p *= 1 - lr * weight_decay``), upstream's default. Upstream
    ``torch.compile``s its update: on CPU the first step compiled for ~17 s, to fuse three
    element-wise ops that cost microseconds, so CPU params take the same update computed
    eagerly, bitwise as the compiled one (:func:`lion_update_as_compiled`); other devices keep
    upstream's compiled kernel.
    """
    optimizer: torch.optim.Optimizer = _upstream_class("Lion")(param_groups, weight_decay_method="decoupled")
    return optimizer


def laprop(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``emerging_optimizers.scalar_optimizers.LaProp`` (Ziyin et al., 2020) over complete groups.

    Groups carry ``lr``, ``weight_decay``, ``betas``, ``eps`` and ``correct_bias``; weight decay is
    decoupled and ``frob_normalize`` off (upstream's defaults; optzoo does not offer it: it makes the
    update depend on the whole param). Upstream ``torch.compile``s its update; CPU params take
    upstream's same function uncompiled (:func:`_laprop_eager_on_cpu`), other devices the compiled one.
    """
    optimizer: torch.optim.Optimizer = _upstream_class("LaProp")(param_groups, weight_decay_method="decoupled")
    return optimizer


def soap(param_groups: list[dict[str, Any]], *, use_kl_shampoo: bool) -> torch.optim.Optimizer:
    """``emerging_optimizers.soap.SOAP`` (Vyas et al., 2024) over complete groups.

    Groups carry ``lr``, ``weight_decay``, ``betas``, ``eps`` and ``shampoo_beta``; the
    instance-level ``use_kl_shampoo`` is its own argument (upstream keeps it on the instance).
    Upstream 0.3.0 refreshes its preconditioner every step and takes 2-D params only.
    """
    first = param_groups[0]
    optimizer: torch.optim.Optimizer = _upstream_class("SOAP")(
        param_groups, lr=first["lr"], weight_decay_method="decoupled", use_kl_shampoo=use_kl_shampoo
    )
    return optimizer


def _keeping_contract(upstream: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``upstream`` made to keep torch's contract, under its own name in this module (where pickle
    finds it, through :func:`__getattr__`): a copy or pickle keeps its instance settings
    (:class:`KeepsSettingsOptimizer`; upstream keeps e.g. ``weight_decay_method`` there), and a step
    leaves torch's float32 matmul settings as found (:func:`preserved_matmul_precision`; SOAP sets
    the precision and restores it in a way that changes the per-backend flags), and a step computes
    as outside any autocast region (:func:`autocast_disabled`)."""

    class Keeping(KeepsSettingsOptimizer, upstream):  # type: ignore[valid-type, misc]  # untyped upstream
        __doc__ = upstream.__doc__

        def step(self, closure: Any = None) -> Any:
            loss = None
            if closure is not None:  # the closure's forward runs under the caller's autocast, as in torch
                with torch.enable_grad():
                    loss = closure()
            with preserved_matmul_precision(), autocast_disabled():  # upstream's linspace/eigh fail under autocast
                super().step(None)
            return loss

    Keeping.__name__ = Keeping.__qualname__ = upstream.__name__
    Keeping.__module__ = __name__
    return Keeping


def _lerp_as_compiled(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """``start.lerp(end, weight)`` as ``torch.compile`` computes it: torch's decomposition
    (``torch._refs.lerp``: ``(w - 1) (end - start) + end`` for ``|w| >= 0.5``, else
    ``w (end - start) + start``), in float32 or wider with the weight a constant of that dtype,
    rounded to the input's dtype once. Eager ``lerp`` rounds differently (a fused multiply-add)."""
    compute = torch.promote_types(start.dtype, torch.float32)
    w = torch.tensor(weight, dtype=compute)
    s, e = start.to(compute), end.to(compute)
    return (w - 1) * (e - s) + e if abs(float(w)) >= 0.5 else w * (e - s) + s


def lion_update_as_compiled(grad: torch.Tensor, exp_avg: torch.Tensor, *, betas: tuple[float, float]) -> torch.Tensor:
    """Upstream's ``calculate_lion_update`` (``sign(lerp(m, g, 1 - β1))``, then ``m.lerp_(g, 1 - β2)``)
    without compiling it, equal bit for bit to its compiled kernel on CPU."""
    beta1, beta2 = betas
    update = torch.sign(_lerp_as_compiled(exp_avg, grad, 1 - beta1))
    exp_avg.copy_(_lerp_as_compiled(exp_avg, grad, 1 - beta2))
    return update.to(exp_avg.dtype)


def _stepping_cpu_params_eagerly(upstream: Any, update: Callable[[torch.Tensor, dict[str, Any], dict[str, Any]], torch.Tensor]) -> Any:
    """Upstream's element-wise optimizer whose step takes each param's update from ``update(param,
    state, group)``: the loop is upstream 0.3.0's ``step`` (state init, decoupled weight decay,
    ``p -= lr * update``); only the update function changes, and only where compiling does not pay."""

    class Stepper(upstream):  # type: ignore[misc]  # untyped upstream
        __doc__ = upstream.__doc__

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            if closure is not None:
                raise ValueError("closure is not supported")  # upstream's message; _keeping_contract runs closures
            for group in self.param_groups:
                self._init_group(group)
                lr, weight_decay = group["lr"], group["weight_decay"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    self._apply_weight_decay_inplace(p.data, p.grad, lr, weight_decay)
                    p.data.add_(update(p, self.state[p], group), alpha=-lr)

    Stepper.__name__ = Stepper.__qualname__ = upstream.__name__
    Stepper.__module__ = upstream.__module__
    return Stepper


def _eager_on_cpu(upstream: Any) -> Any:
    """Upstream's Lion computing the update of CPU params with :func:`lion_update_as_compiled`, not
    upstream's compiled function (bit for bit the same, without the first step's compile)."""
    from emerging_optimizers.scalar_optimizers.update_functions import lion as functions

    compiled = functions.calculate_lion_update

    def update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        function: Callable[..., torch.Tensor] = lion_update_as_compiled if p.device.type == "cpu" else compiled
        return function(p.grad, state["exp_avg"], betas=group["betas"])

    return _stepping_cpu_params_eagerly(upstream, update)


def _laprop_eager_on_cpu(upstream: Any) -> Any:
    """Upstream's LaProp running upstream's ``calculate_laprop_update`` uncompiled for CPU params
    (without ``frob_normalize``).

    Compiled, a CPU process paid seconds for its first step, and once dynamo's recompile limit was
    reached (a few dtypes, ranks and layouts) later calls ran eagerly: the result then depended on
    which shapes came first (the kernel and eager division differ by an ulp). Eager is the same
    arithmetic every time.
    """
    from emerging_optimizers.scalar_optimizers.update_functions import laprop as functions

    compiled = functions.calculate_laprop_update
    eager = compiled._torchdynamo_orig_callable

    def update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        state["step"] += 1  # before the update, as upstream (weight decay does not read it)
        function = eager if p.device.type == "cpu" else compiled
        return function(  # type: ignore[no-any-return]
            p.grad, state["exp_avg"], state["exp_avg_sq"], betas=group["betas"], eps=group["eps"],
            correct_bias=group["correct_bias"], step=state["step"],
        )  # fmt: skip

    return _stepping_cpu_params_eagerly(upstream, update)


@functools.cache
def _upstream_class(name: str) -> Any:  # an untyped upstream class
    try:
        if name == "Lion":
            from emerging_optimizers.scalar_optimizers.lion import Lion

            upstream = _eager_on_cpu(Lion)
        elif name == "LaProp":
            from emerging_optimizers.scalar_optimizers.laprop import LaProp

            upstream = _laprop_eager_on_cpu(LaProp)
        else:
            from emerging_optimizers.soap.soap import SOAP

            upstream = SOAP
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    return _keeping_contract(upstream)


def __getattr__(name: str) -> Any:
    if name in ("Lion", "LaProp", "SOAP"):  # built on first use: upstream is imported lazily
        return _upstream_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def upstream_registered_class(name: str) -> type[torch.optim.Optimizer] | None:
    """The class upstream's own registry holds under ``name`` (its 15 algorithms in 0.3.0), as
    upstream ships it: no optzoo subclass, compiled steps and all; ``None`` if upstream has no such
    name. For "before/after" comparisons (``benchmarks.compare``), never for building optimizers."""
    import importlib

    try:
        from emerging_optimizers import registry

        for package in ("orthogonalized_optimizers", "scalar_optimizers", "soap", "psgd", "riemannian_optimizers"):
            importlib.import_module(f"emerging_optimizers.{package}")  # registration happens on import
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    if name.lower() not in registry.get_optimizer_name_list():
        return None
    cls: type[torch.optim.Optimizer] = registry.get_optimizer_cls(name)
    return cls


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


def muon(params: Any, **options: Any) -> torch.optim.Optimizer:
    """``emerging_optimizers.orthogonalized_optimizers.Muon`` with upstream's own argument names:
    the reference for :class:`optzoo.optimizers.muon.Muon` (tests and benchmarks only).

    Its settings are instance-wide (group keys other than ``lr``, ``momentum`` and
    ``weight_decay`` are ignored), it takes float32 2-D params only, and it sets torch's float32
    matmul precision to ``fp32_matmul_prec`` (default ``medium``) around each orthogonalisation.
    """
    try:
        from emerging_optimizers.orthogonalized_optimizers import muon as upstream
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    optimizer: torch.optim.Optimizer = upstream.Muon(params, **options)
    return optimizer


def adaptive_muon(params: Any, **options: Any) -> torch.optim.Optimizer:
    """``emerging_optimizers.orthogonalized_optimizers.AdaptiveMuon`` (its second moment is
    ``state["moment2_buffer"]``): the reference for :class:`optzoo.optimizers.adaptive_muon.AdaptiveMuon`.

    Upstream requires ``lr``, ``momentum`` and ``weight_decay``; the rest is as :func:`muon`.
    """
    try:
        from emerging_optimizers.orthogonalized_optimizers import AdaptiveMuon
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    optimizer: torch.optim.Optimizer = AdaptiveMuon(params, **options)
    return optimizer


def muon_scale_factor(rows: int, cols: int, mode: str) -> float:
    """Upstream's ``get_muon_scale_factor(size_out=rows, size_in=cols, mode=mode)``."""
    try:
        from emerging_optimizers.orthogonalized_optimizers import muon as upstream
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    return float(upstream.get_muon_scale_factor(rows, cols, mode=mode))
