"""The one door to ``emerging-optimizers``: every import of it goes through here.

We build on release 0.3.0 (pinned in pyproject.toml); later releases moved and removed modules,
so keeping the imports in one place makes an upgrade one file's work. Imports are lazy so that
``import optzoo.optimizers`` stays cheap and a missing package fails only where it is needed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import zlib
from collections.abc import Callable, Iterator
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


def rekls(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``emerging_optimizers.soap.REKLS`` over complete groups: SOAP with the KL-Shampoo factors,
    each step's gradient in them before a full ``eigh`` refreshes the eigenbasis.

    Groups carry ``lr``, ``weight_decay``, ``betas``, ``eps`` and ``shampoo_beta``; weight decay
    is decoupled (upstream's default). Like SOAP it takes 2-D params only, and its Adam update is
    upstream's ``torch.compile``d function on every device (as SOAP's: one ulp of rounding moves
    SOAP-family weights by about ``lr`` in their first steps, so an eager path is not the same result).
    """
    first = param_groups[0]
    optimizer: torch.optim.Optimizer = _upstream_class("REKLS")(param_groups, lr=first["lr"], weight_decay_method="decoupled")
    return optimizer


def psgd_pro(
    param_groups: list[dict[str, Any]], *, precond_init_scale: float, damping_noise_scale: float, warmup_steps: int, max_update_rms: float
) -> torch.optim.Optimizer:
    """``emerging_optimizers.psgd.PSGDPro`` (PSGD-Kron-Whiten with a Procrustes step) over complete groups.

    Groups carry ``lr``, ``weight_decay``, ``momentum``, ``beta_lip``, ``precond_lr`` and
    ``min_precond_lr``; the rest are upstream's instance arguments. The step is upstream's loop
    (:func:`_psgd_seeded`, which lists what differs): chiefly, its noise is drawn from a generator
    seeded per param and step (so a resumed, copied or re-sharded run draws the same noise), and
    CPU params run upstream's ``torch.compile``d functions eagerly.
    """
    first = param_groups[0]
    optimizer: torch.optim.Optimizer = _upstream_class("PSGDPro")(
        param_groups, lr=first["lr"], weight_decay_method="decoupled", precond_init_scale=precond_init_scale,
        damping_noise_scale=damping_noise_scale, warmup_steps=warmup_steps, max_update_rms=max_update_rms,
    )  # fmt: skip
    return optimizer


def oblique_sgd(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``emerging_optimizers.riemannian_optimizers.ObliqueSGD`` over complete groups (``lr``,
    ``weight_decay``, ``momentum``, ``dim``, ``eps``): Riemannian SGD keeping each slice along
    ``dim`` of a 2-D param at unit norm (retracted after every step); decay decoupled."""
    optimizer: torch.optim.Optimizer = _upstream_class("ObliqueSGD")(param_groups, weight_decay_method="decoupled")
    return optimizer


def oblique_adam(param_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``emerging_optimizers.riemannian_optimizers.ObliqueAdam`` over complete groups (``lr``,
    ``weight_decay``, ``betas``, ``dim``, ``eps``, ``correct_bias``): Adam's normalised moment
    projected onto the unit sphere of each slice along ``dim``, then retracted; decay decoupled."""
    optimizer: torch.optim.Optimizer = _upstream_class("ObliqueAdam")(param_groups, weight_decay_method="decoupled")
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


def psgd_noise_seed(name: str, noise_step: int) -> int:
    """The seed of PSGD's noise for param ``name`` at its ``noise_step``-th step (from 0):
    ``crc32("<name>:<noise_step>")``, a function of the param and step alone, so every rank, a
    resumed run and a copy draw the same noise (upstream draws from the global generator)."""
    return zlib.crc32(f"{name}:{noise_step}".encode())


@contextlib.contextmanager
def _seeded_noise(seed: int, device: torch.device) -> Iterator[None]:
    """Draws on ``device`` (and the CPU) from generators seeded with ``seed``; the caller's
    generator states are put back afterwards."""
    accelerator = device.type != "cpu"
    devices = [device.index if device.index is not None else torch.get_device_module(device.type).current_device()] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else "cuda"):
        torch.default_generator.manual_seed(seed)
        if accelerator:
            module = torch.get_device_module(device.type)
            with module.device(devices[0]):
                module.manual_seed(seed)
        yield


def _psgd_seeded(upstream: Any) -> Any:
    """Upstream 0.3.0's ``PSGDPro.step``, param by param, with its noise seeded per param and step
    (:func:`psgd_noise_seed`, counted in ``state["noise_step"]``: upstream's own ``state["step"]``
    stays 0, as upstream leaves it, so its preconditioner lr schedule is upstream's), its
    ``torch.compile``d functions run eagerly for CPU params (compiling them took the first CPU
    step ~36 s on two 64 × 64 matrices; eager gives the same params bit for bit on CPU),
    float64 params keeping float64 factors (upstream's float32 ``torch.eye`` factors fail to
    contract with them), and a contiguous momentum (upstream's takes the gradient's strides, so
    a transposed param drew its noise in another order). Upstream's arithmetic is unchanged."""
    from emerging_optimizers.psgd import psgd as module

    class Stepper(upstream):  # type: ignore[misc]  # untyped upstream
        __doc__ = upstream.__doc__

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            if closure is not None:
                raise ValueError("closure is not supported")  # upstream's message; _keeping_contract runs closures
            for group_index, group in enumerate(self.param_groups):
                names = group.get("param_names")
                for index, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    noise_step = state.get("noise_step", 0)
                    key = names[index] if names and index < len(names) else f"{group_index}.{index}"  # the class alone: by place
                    seed = psgd_noise_seed(key, noise_step)
                    eager = torch.compiler.set_stance("force_eager") if p.device.type == "cpu" else contextlib.nullcontext()
                    with _seeded_noise(seed, p.device), eager:
                        self._step_param(p, group, state)
                    state["noise_step"] = noise_step + 1

        def _step_param(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
            grad = p.grad
            assert grad is not None
            if "step" not in state:
                state["step"] = 0
            if "exp_avg" not in state:  # contiguous: randn_like(exp_avg) then draws in the param's logical order, whatever its layout
                state["exp_avg"] = torch.zeros_like(grad, memory_format=torch.contiguous_format)
            if "Q" not in state or "L" not in state:
                q_list, lip_list = module._init_psgd_kron_states(grad, precond_init_scale=self.precond_init_scale)
                if grad.dtype == torch.float64:
                    q_list, lip_list = [q.double() for q in q_list], [lip.double() for lip in lip_list]
                state["Q"], state["L"] = q_list, lip_list
            self._apply_weight_decay_inplace(p, grad, group["lr"], group["weight_decay"])
            exp_avg = state["exp_avg"]
            exp_avg.lerp_(grad, 1 - group["momentum"])
            precond_lr = module._get_precond_lr(group["precond_lr"], state["step"], group["min_precond_lr"], self.warmup_steps)
            state["Q"], state["L"] = module._update_precond_procrustes(
                state["Q"], state["L"], exp_avg, self.damping_noise_scale, precond_lr, group["beta_lip"]
            )
            module.psgd_utils.uniformize_q_in_place(state["Q"])
            update = module.psgd_kron_contractions.apply_preconditioner(state["Q"], exp_avg)
            module._clip_update_rms_in_place(update, self.max_update_rms)
            p.add_(update, alpha=-group["lr"])

    Stepper.__name__ = Stepper.__qualname__ = upstream.__name__
    Stepper.__module__ = upstream.__module__
    return Stepper


_UPSTREAM: dict[str, tuple[str, str]] = {
    "Lion": ("emerging_optimizers.scalar_optimizers.lion", "lion"),
    "LaProp": ("emerging_optimizers.scalar_optimizers.laprop", "laprop"),
    "SOAP": ("emerging_optimizers.soap.soap", "soap"),
    "REKLS": ("emerging_optimizers.soap.rekls", "rekls"),
    "PSGDPro": ("emerging_optimizers.psgd.psgd", "psgd_pro"),
    "ObliqueSGD": ("emerging_optimizers.riemannian_optimizers.normalized_optimizer", "oblique_sgd"),
    "ObliqueAdam": ("emerging_optimizers.riemannian_optimizers.normalized_optimizer", "oblique_adam"),
}
"""Upstream class name -> (the module whose import registers it, its name in upstream's registry)."""

def _compiled_parts_eager_on_cpu(upstream: Any) -> Any:
    """Upstream's step with its ``torch.compile``d parts run eagerly when every param is on the CPU
    (SOAP, REKLS). Their Adam-in-the-eigenbasis turns one ulp into a ±lr move (docs/optimizers.md),
    so compiled-or-eager must not depend on the process (dynamo's recompile limit, a fresh worker):
    on CPU it is always eager, with no first-step compile; other devices keep the compiled kernels."""

    class Stepper(upstream):  # type: ignore[misc]  # untyped upstream
        __doc__ = upstream.__doc__

        def step(self, closure: Any = None) -> Any:
            on_cpu = all(p.device.type == "cpu" for group in self.param_groups for p in group["params"])
            with torch.compiler.set_stance("force_eager") if on_cpu else contextlib.nullcontext():
                return super().step(closure)

    Stepper.__name__ = Stepper.__qualname__ = upstream.__name__
    return Stepper


_ADAPTED: dict[str, Callable[[Any], Any]] = {
    "Lion": _eager_on_cpu, "LaProp": _laprop_eager_on_cpu, "PSGDPro": _psgd_seeded,
    "SOAP": _compiled_parts_eager_on_cpu, "REKLS": _compiled_parts_eager_on_cpu,
}  # fmt: skip
"""The classes whose step optzoo changes (each function says how), over upstream's class."""


@functools.cache
def _upstream_class(name: str) -> Any:  # an untyped upstream class
    """Upstream's class ``name``, from upstream's registry (``registry.get_optimizer_cls``), adapted
    where :data:`_ADAPTED` says and made to keep torch's contract (:func:`_keeping_contract`)."""
    module, registered = _UPSTREAM[name]
    try:
        importlib.import_module(module)  # registers the class
        from emerging_optimizers import registry
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    upstream = registry.get_optimizer_cls(registered)
    adapt = _ADAPTED.get(name)
    return _keeping_contract(adapt(upstream) if adapt is not None else upstream)


def __getattr__(name: str) -> Any:
    if name in _UPSTREAM:  # built on first use: upstream is imported lazily
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


def sinkhorn_map_(matrix: torch.Tensor, *, num_iters: int = 20, eps: float = 1e-8) -> torch.Tensor:
    """emerging-optimizers' Sinkhorn–Knopp map of ``matrix`` (``(..., rows, cols)``), in place:
    ``exp(x − max x)``, then ``num_iters`` column and row normalisations to sums
    ``max(1, rows/cols)`` and ``max(1, cols/rows)``. Initialises a param for Sinkhorn-Muon.

    Example:
        >>> w = sinkhorn_map_(torch.randn(4, 8))
        >>> bool(torch.allclose(w.sum(dim=-1), torch.full((4,), 2.0), atol=1e-3))
        True
    """
    try:
        from emerging_optimizers.utils.sinkhorn_mapper import SinkhornMapper
    except ImportError as error:  # pragma: no cover
        raise ImportError(_MISSING) from error
    mapped: torch.Tensor = SinkhornMapper(num_iters=num_iters, eps=eps)(matrix, inplace=True)
    return mapped
