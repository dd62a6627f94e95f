"""The optimizer ``get_optimizer`` returns: one ``torch.optim.Optimizer`` over every algorithm.

Each algorithm keeps its own torch optimizer over its groups; the wrapper owns the very same
group dicts (in routing order) and one shared ``state`` mapping, so schedulers, ``zero_grad``
and checkpointing see a single optimizer. The inner optimizers step *main* parameters: the model
parameters themselves (:class:`FP32Optimizer`), or fp32 copies of fp16/bf16 model parameters
(:class:`Float16OptimizerWithFloat16Params`), as in Megatron-Core's ``MixedPrecisionOptimizer``.
Which is which, and where each gradient goes, is the :class:`~optzoo.wrapper.param_map.ParamMap`.

One step is the list of :mod:`~optzoo.wrapper.grad_stages`: model grads to main grads (and params
whose memory has gaps to their dense working copies); one norm
pass that detects inf/NaN (the scaler sees the result; on inf/NaN return ``(False, None, None)``
with parameters and state untouched); the clip coefficient and loss scale as one factor; zero
count; inner steps, each applying the factor (in its kernel or one pass); main params to model
params. ``fold_clip_and_scale=False`` runs Megatron's separate unscale and clip passes instead.
As in Megatron-Core, the step is two public halves, :meth:`~MixedPrecisionOptimizer.prepare_grads`
and :meth:`~MixedPrecisionOptimizer.step_with_ready_grads`, with the clip, the zero count and
``grad_norm_skip_threshold`` between them (:mod:`~optzoo.wrapper.megatron_api`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optzoo._common import MatrixView, local_shard
from optzoo.optimizers._checked import KeepsSettingsOptimizer, autocast_disabled
from optzoo.optimizers.registry import get_spec

from optzoo.wrapper import grad_stages, step_guards
from optzoo.wrapper.added_groups import Rerouter, route_added_params, sync_siblings_
from optzoo.wrapper.framework_contract import ClipWatch, LastStep, torch_defaults
from optzoo.wrapper.megatron_api import MegatronMethods, ReadyGrads
from optzoo.wrapper.param_map import ParamMap, follow_repointed_params
from optzoo.wrapper.routing_digest import PlanKind, RoutingChangeReport, digest_of, routing_record
from optzoo.wrapper.scalers import MegatronGradScaler
from optzoo.wrapper.state_dict import load_state_dict_, state_dict_of
from optzoo.wrapper.telemetry import Telemetry
from optzoo.wrapper.torch_state_dict import called_by_torch_state_dict_api, from_torch_format, is_torch_format, to_torch_format

__all__ = [
    "FP32Optimizer",
    "Float16OptimizerWithFloat16Params",
    "MixedPrecisionOptimizer",
    "StepOptions",
    "StepResult",
]

StepResult = tuple[bool, float | None, int | None]
"""``(update_successful, grad_norm, num_zeros_in_grad)``, as Megatron-Core's ``step``."""


@dataclass(frozen=True, kw_only=True)
class StepOptions:
    """What one step does besides the update (``OptimizerConfig``'s model-wide step fields)."""

    clip_grad: float = 0.0
    """Clip gradients to this global L2 norm; 0 disables clipping (and the norm is not computed
    unless ``grad_norm_skip_threshold`` needs it)."""
    grad_norm_skip_threshold: float = math.inf
    """Skip the update when the global norm, before clipping, exceeds this (``inf``: never)."""
    log_num_zeros_in_grad: bool = False
    """Count zero gradient elements (returned by ``step``)."""
    fold_clip_and_scale: bool = True
    """One norm pass, then the clip coefficient and the loss scale as one factor inside the fused
    kernels (``OptimizerConfig.fold_clip_and_scale``); False: separate unscale and clip passes."""
    timers: Callable[..., Any] | None = None
    """Megatron-style timers: ``timers(name, log_level=1)`` gives an object with ``start(barrier=...)``
    and ``stop()``; the step's phases are timed with it. Checked when the optimizer is built (one
    call, and the timer's ``start``/``stop`` signatures), so a wrong one never fails midway through a step."""
    barrier_with_L1_time: bool = False
    """Pass ``barrier=True`` to those timers."""
    log_metrics: bool | str = False
    """Per-group telemetry of each step, read with ``metrics()`` (``OptimizerConfig.log_metrics``):
    ``True``, ``"per_param"`` (per param too) or ``False`` (nothing computed)."""
    log_metrics_interval: int = 1
    """Measure every this-many steps that reach the inner optimizers (``OptimizerConfig.log_metrics_interval``)."""


class MixedPrecisionOptimizer(MegatronMethods, KeepsSettingsOptimizer):
    """Several torch optimizers over main parameters, behind one ``torch.optim.Optimizer`` face.

    Built by :func:`optzoo.get_optimizer`; ``param_groups`` are the inner optimizers' real
    groups (holding the main parameters), ``state`` is shared by all of them, and
    ``state_dict`` is keyed by parameter names.

    Args:
        optimizers: The inner optimizers; their groups must together be ``param_groups``.
        param_groups: The same group dicts, in routing order; each has ``param_names``.
        param_map: Every param's model and main tensors; the local entries of group ``k`` are
            the params of ``param_groups[k]``, in order.
        options: Clipping, zero counting and timers.
        grad_scaler: The loss scaler shared by every inner optimizer, or ``None`` (scale 1).
        process_group: Reduce the inf/NaN flag, the grad norm and the zero count over this group
            (each rank holding different gradients); ``None``: this process alone.
        device: Where the scale and flags live when this rank holds no parameter.
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        param_groups: list[dict[str, Any]],
        param_map: ParamMap,
        options: StepOptions = StepOptions(),
        *,
        grad_scaler: MegatronGradScaler | None = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        inner_ids = sorted(id(g) for opt in optimizers for g in opt.param_groups)
        assert inner_ids == sorted(id(g) for g in param_groups), "groups must be the inner ones"
        for group, entries in zip(param_groups, param_map.local_by_group(), strict=True):
            assert [id(p) for p in group["params"]] == [id(e.main) for e in entries], "groups hold the map's mains"
        step_guards.check_timers(options.timers)
        self.optimizers = list(optimizers)
        self.param_map = param_map
        self.options = options
        self.grad_scaler = grad_scaler
        self.process_group = process_group
        self._building = True
        super().__init__(param_groups, defaults={})
        self._building = False
        # Set after the groups exist: torch's add_param_group would copy defaults into them.
        self.defaults = torch_defaults(param_groups)
        first = next((e.main for e in param_map.local), None)
        device = first.device if first is not None else device or torch.device("cpu")
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._grad_buffers: dict[int, torch.Tensor] = {}  # fp32 copies of 16-bit grads, reused every step
        self._rerouter: Rerouter | None = None  # set by get_optimizer: what add_param_group routes with
        self._inner_keys: list[tuple[Any, ...]] = []  # per inner optimizer: instance_key of its groups
        # Every param's matrix view by name, set by get_optimizer from the routing (a rank of the
        # distributed optimizer holds only its own params' views in its groups).
        self._matrix_views: dict[str, MatrixView | None] = {}
        self._siblings: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
        self._last_step: LastStep | None = None
        self._skipped_steps: int | torch.Tensor = 0
        self._telemetry = Telemetry(per_param=options.log_metrics == "per_param", interval=options.log_metrics_interval) if options.log_metrics else None
        self._clip_watch = ClipWatch([e.model for e in param_map.local]) if options.clip_grad > 0.0 and param_map.grad_source == "grad" else None
        self._index_inner_optimizers()

    def _index_inner_optimizers(self) -> None:
        """What each step needs to know about the inner optimizers (again after a group is added)."""
        for opt in self.optimizers:
            opt.state = self.state  # params are disjoint, so one mapping serves every optimizer
        # Which inner optimizers divide by a grad_scale tensor in their kernel (torch's protocol for
        # GradScaler: fused Adam, AdamW, SGD; the precision-aware Adam), and the params of the others.
        self._takes_grad_scale: list[bool] = []
        self._params_of: list[list[torch.Tensor]] = []
        self._read_inner_params()
        # torch SGD with momentum and dampening (set on the groups by hand): checked before each step
        self._sgds = [opt for opt in self.optimizers if isinstance(opt, torch.optim.SGD)]
        # Which inner optimizers are stepped as a transaction (the registry's ``verified_step``: finite
        # gradients can make their update non-finite or raise); the same on every rank.
        self._verified = [
            any(get_spec(g["optimizer"]).verified_step for g in opt.param_groups if "optimizer" in g) for opt in self.optimizers
        ]

    def _read_inner_params(self) -> None:
        """What the step needs to know about the inner optimizers' params (read again when they change)."""
        self._takes_grad_scale = [
            bool(getattr(opt, "_step_supports_amp_scaling", False))
            and not any(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
            for opt in self.optimizers
        ]
        self._params_of = [[p for g in opt.param_groups for p in g["params"]] for opt in self.optimizers]

    def _follow_repointed_params(self) -> bool:
        """Follow a framework's re-pointing of ``param_groups`` at new params (accelerate's FSDP2
        ``prepare``), by name: the map, the inner optimizers' params and, for FSDP2 params on any mesh,
        the group the norm and the inf/NaN flag are reduced over and the replicas left out of the norm
        (:func:`optzoo.distributed.mesh_process_group`, :func:`~optzoo.distributed.replicated_params`:
        a collective); returns whether there was one to follow.

        Raises:
            ValueError: It cannot be followed (see :func:`~optzoo.wrapper.param_map.follow_repointed_params`),
                or the new params lie where no group serves them (a ``Partial`` placement, unrelated meshes).
        """
        followed = follow_repointed_params(self.param_map, self.param_groups, self.state)
        if followed is None:
            return False
        # A collective when DTensors follow: every rank re-points at the same step (prepare runs on all).
        from optzoo.distributed.setup import mesh_process_group, replicated_params

        params = [(e.name, e.model, e.name in self.expert_names) for e in followed.entries]
        mesh_group = mesh_process_group(params)  # raises, naming the param, where no group can serve
        replicated = replicated_params(params, mesh_group) if mesh_group is not None else frozenset()
        self.param_map = followed
        for opt in self.optimizers:  # not every fused kernel has a DTensor rule (SGD's has none); foreach ones do
            for group in opt.param_groups:
                if group.get("fused") and any(isinstance(p, DTensor) for p in group["params"]):
                    group["fused"], group["foreach"] = False, True
        if mesh_group is not None:
            self.process_group, self.replicated = mesh_group, replicated
        self._read_inner_params()
        self._grad_buffers.clear()
        first = next((e.main for e in followed.local), None)
        if first is not None and first.device != self._one.device:  # prepare may move the model
            self._one, self._found_inf = self._one.to(first.device), self._found_inf.to(first.device)
        return True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add params that became trainable after :func:`~optzoo.get_optimizer` (a backbone unfrozen by
        Lightning's ``BackboneFinetuning``), routed by the rules that built this optimizer.

        Each param takes the group the routing gives it (its optimizer, Muon's scalar hand-off, weight
        decay, lr): it joins the existing group with exactly those settings, or gets a new group. Keys
        besides ``params`` (``lr``, ``weight_decay``, ``betas``, ...) are settings for these params and
        override the routing's: the params then get new groups, one per routed group, appended in
        routing order, and a key later changed on one of them only (``param_groups[-1]["lr"] = ...``)
        reaches the others at the next step. See :mod:`optzoo.wrapper.added_groups`.

        Raises:
            TypeError: ``param_group`` is not a dict with a list of tensors under ``params``; or this
                optimizer was not built by ``get_optimizer`` (or is a copy of one).
            ValueError: A param routing cannot place (named, with why), a key routing decides
                (``optimizer``) or one no routed group has, or an invalid value. Nothing changes.

        Warns:
            UserWarning: Params already stepped: they stay in their groups.
        """
        if self._building:
            super().add_param_group(param_group)
            return
        if self._rerouter is None:
            raise TypeError(
                f"`{type(self).__name__}.add_param_group`: no routing to place new params; got an optimizer not built "
                "by get_optimizer (or a copy of one); expected get_optimizer(...) to be called again with the new parameters"
            )
        group_keys = [self._inner_keys[i] for g in self.param_groups for i, opt in enumerate(self.optimizers) if any(h is g for h in opt.param_groups)]
        plan = route_added_params(
            param_group, rerouter=self._rerouter, param_map=self.param_map, param_groups=self.param_groups, group_keys=group_keys
        )
        if plan is None:
            return
        for group, mains, names, views in plan.joined:
            group["params"].extend(mains)
            group["param_names"].extend(names)
            if views is not None:
                group["matrix_views"] = list(group.get("matrix_views", [])) + views
        for group, key, resolved in plan.new_groups:
            if key in self._inner_keys:
                self.optimizers[self._inner_keys.index(key)].add_param_group(group)
            else:
                spec = get_spec(resolved.optimizer)
                self.optimizers.append(spec.build([group], {f: getattr(resolved.config, f) for f in spec.instance_fields}))
                self._inner_keys.append(key)
            self.param_groups.append(group)
        assert sorted(id(g) for opt in self.optimizers for g in opt.param_groups) == sorted(id(g) for g in self.param_groups)
        if plan.siblings is not None:
            self._siblings.append(plan.siblings)
        self.param_map = plan.param_map
        self._index_inner_optimizers()
        if self._clip_watch is not None and self._clip_watch.active:  # watch the new params too
            self._clip_watch.close()
            self._clip_watch = ClipWatch([e.model for e in self.param_map.local])

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_rerouter"] = None  # it holds the model: a copy of the optimizer does not copy the model
        return state

    @property
    def last_step(self) -> LastStep | None:
        """What the last :meth:`step` or :meth:`step_on_device` did, with the count of skipped steps
        (``None`` before the first): for frameworks that drop ``step()``'s return value. Read-only."""
        return self._last_step

    def _record_step(self, success: bool | torch.Tensor, grad_norm: float | torch.Tensor | None, num_zeros: int | None) -> None:
        if isinstance(success, torch.Tensor):  # on the device: counted there, without a read
            self._skipped_steps = (~success).to(torch.int64) + self._skipped_steps
        elif not success:
            self._skipped_steps = self._skipped_steps + 1
        self._last_step = LastStep(success, grad_norm, num_zeros, self._skipped_steps)

    @property
    def aliases(self) -> dict[str, tuple[str, ...]]:
        """Every name of each tied parameter: ``{first name: (all names)}``."""
        return self.param_map.aliases()

    # ---- loss scale ----------------------------------------------------------------------

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale (a 1-element float32 tensor; 1 without a scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call ``.backward()`` on this under fp16."""
        return loss * self.get_loss_scale()

    @torch.no_grad()
    def reload_model_params(self, state_dict: Mapping[str, Any] | None = None) -> None:
        """Refresh the main params from the model (after loading weights without the optimizer).

        Covers fp32 main copies here and master weights an inner optimizer keeps in its state
        (the precision-aware Adam's ``reload_master_weights_``).

        Args:
            state_dict: Megatron-Core's argument (its distributed optimizer's behaviour): a model
                state dict, flat or as ``{"model": ...}`` / ``{"model0": ..., "model1": ...}``,
                whose tensors, matched by parameter name, set the main params instead of the
                model params: more accurate when it holds 16-bit params' weights in fp32. An fp32
                param, its own main param, takes its tensor too. Default: the model params.

        Raises:
            ValueError: A param has no tensor in ``state_dict`` (or several, or one of another
                shape), or ``state_dict`` is given under the precision-aware optimizer or for
                FSDP2 params. Nothing changes.
        """
        if state_dict is not None:
            self._reload_from_(state_dict)
            return
        for entry in self.param_map.local:
            if not entry.aliased:
                assert entry.main is not None  # local entries have one
                entry.main.copy_(entry.model_part)
        for opt in self.optimizers:
            reload = getattr(opt, "reload_master_weights_", None)
            if callable(reload):
                reload()

    # ---- step ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        timers = self.options.timers
        if timers is None:
            yield
            return
        try:
            timer = timers(name, log_level=1)
            timer.start(barrier=self.options.barrier_with_L1_time)
        except (TypeError, AttributeError) as error:  # before any stage has changed anything
            raise ValueError(
                f"`OptimizerConfig.timers`: not Megatron-style timers; got {type(timers).__name__} failing with "
                f"{type(error).__name__}: {error}; expected timers(name, log_level=1) returning an object with "
                "start(barrier=...) and stop()"
            ) from error
        try:
            yield
        finally:
            timer.stop()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:  # type: ignore[override]
        """One optimizer step; skipped (nothing changes) when a gradient is inf or NaN, the
        global norm exceeds ``grad_norm_skip_threshold``, or an optimizer stepped as a transaction
        (SOAP, the registry's ``verified_step``) gives a non-finite result from finite gradients.

        The step computes as outside any ``torch.autocast`` region the caller is in (the closure
        still runs under it: it is the caller's forward).

        Megatron-Core's step: :meth:`prepare_grads`, then the global norm and the clip, the zero
        count, the threshold check, and :meth:`step_with_ready_grads`; the same numbers, bit for
        bit, as calling those (with :meth:`clip_grad_norm`) yourself.

        Args:
            closure: Optional; re-evaluates the model (run with gradients enabled first).

        With ``fold_clip_and_scale`` (the default) the step reads one value from the device: the
        global norm of the still scaled gradients, unscaled, which also says whether any is inf
        or NaN. The clip coefficient divided by the loss scale then reaches each gradient once,
        inside torch's fused Adam/AdamW/SGD and the precision-aware Adam (their ``grad_scale``),
        or in one foreach multiply for the other optimizers. ``log_num_zeros_in_grad`` adds one
        read. With ``fold_clip_and_scale=False``, a loss scaler's inf check is a second read.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``, Python values:
            ``(False, None, None)`` on an inf/NaN step; ``grad_norm``, the global norm of the
            unscaled gradients before clipping, when ``clip_grad > 0`` or
            ``grad_norm_skip_threshold`` is finite (else ``None``); the count of zero gradient
            elements when ``log_num_zeros_in_grad`` (else ``None``). A step skipped by the
            threshold returns ``(False, grad_norm, num_zeros_in_grad)``, as Megatron-Core's
            ``ChainedOptimizer``; so does a transaction that failed (the loss scaler has already
            counted the step as one without inf/NaN).

        Raises:
            ValueError: A gradient is sparse, missing ``main_grad``, or a ``main_grad`` of another
                dtype than the fp32 param it is stepped on; or the model was cast or moved after
                ``get_optimizer`` (nothing changes).
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        sync_siblings_(self._siblings)
        if self._clip_watch is not None and self._clip_watch.active:  # after the closure: Lightning clips in it
            self._clip_watch.check(self.options.clip_grad)
        with autocast_disabled():  # the step computes as outside the caller's autocast region
            result = self._step()
        self._record_step(*result)
        return result

    def _step(self) -> StepResult:
        if self.prepare_grads():
            return False, None, None
        ready = self._ready
        assert ready is not None  # prepare_grads leaves it
        clip_grad = self.options.clip_grad
        if clip_grad > 0.0 and ready.norm is not None:
            assert ready.norm_value is not None  # read with the norm
            with self._timed("optimizer-clip-main-grad"):
                self._clip_(ready, clip_grad, ready.norm, ready.norm_value)
        num_zeros: int | None = None
        if self.options.log_num_zeros_in_grad:  # zeros stay zeros under the positive factor
            with self._timed("optimizer-count-zeros"):
                num_zeros = self.count_zeros()
        grad_norm = ready.norm_value if self._needs_norm() else None
        if self._over_threshold(ready.norm_value):
            return False, grad_norm, num_zeros
        return self.step_with_ready_grads(), grad_norm, num_zeros

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Model grads to main grads, unscale, and check for inf/NaN on every rank; returns whether
        one was found (Megatron-Core's ``prepare_grads``). The loss scaler is updated here.

        Under ``fold_clip_and_scale`` (the default) the unscale is not applied to the gradients
        but carried, with any :meth:`clip_grad_norm`, into :meth:`step_with_ready_grads`, which
        applies it inside the inner optimizers' kernels; :meth:`get_grad_norm` and
        :meth:`count_zeros` account for it. ``False``: the gradients are unscaled in place, as
        in Megatron-Core.

        Raises:
            ValueError: A gradient is sparse, or missing ``main_grad`` (nothing changes).
        """
        with autocast_disabled():
            return self._prepare_grads()

    def _prepare_grads(self) -> bool:
        with self._timed("optimizer-copy-to-main-grad"):
            grads = self._to_mains()
        group, device = self.process_group, self._one.device  # after _to_mains: it may follow re-pointed params
        scale = self.grad_scaler.scale if self.grad_scaler is not None else None  # before the update
        deferred = self.options.fold_clip_and_scale
        with self._timed("optimizer-unscale-and-check-inf"):
            if deferred:
                found_inf, norm, norm_value = grad_stages.norm_and_check(grads, self.grad_scaler, group, device, self._uncounted())
            else:
                found_inf, norm, norm_value = grad_stages.find_inf_and_unscale_(
                    grads, self.grad_scaler, self._found_inf, group, with_norm=self._needs_norm(), uncounted=self._uncounted()
                )
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        if self._telemetry is not None and not found_inf:  # before any clip; unscaled in place unless deferred
            self._telemetry.grads_(self, scale if deferred else None)
        self._ready = ReadyGrads(grads, deferred, scale if deferred else None, norm, norm_value)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step every inner optimizer on the main grads, then copy main params to model params;
        returns ``True`` (Megatron-Core's ``step_with_ready_grads``), or ``False`` when an inner
        optimizer stepped as a transaction (the registry's ``verified_step``: SOAP) gave a
        non-finite result or failed to decompose, with every param, gradient and all state as
        before. What :meth:`prepare_grads` and :meth:`clip_grad_norm` left to apply (the unscale
        and the clip under ``fold_clip_and_scale``) is applied here; without them the gradients
        are stepped as they are."""
        ready, self._ready = self._ready, None
        factors = ready.factors() if ready is not None else None
        telemetry = self._telemetry
        if telemetry is None:
            return self._inner_steps(factors)
        telemetry.before_update_(self)
        stepped = self._inner_steps(factors)
        telemetry.after_update_(self, counts_here=self._counts_orthogonalized_here())
        return stepped

    def _inner_steps(self, factors: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        """:meth:`step_with_ready_grads` after the factors are known: the inner steps and the copy back."""
        with autocast_disabled(), self._timed("optimizer-inner-step"), _without_global_step_hooks():
            missing = step_guards.missing_momentum_buffers(self.optimizers)
            inner = list(zip(self.optimizers, self._takes_grad_scale, self._params_of, self._verified, strict=True))
            # The verified ones first, as one transaction: when one fails, nothing else has stepped.
            if any(self._verified) and not self._verified_steps(inner, factors):
                return False
            step_guards.zero_momentum_buffers_(missing)
            for opt, takes_grad_scale, params, verified in inner:
                if not verified:
                    self._inner_step(opt, takes_grad_scale, params, factors)
        with autocast_disabled(), self._timed("optimizer-copy-main-to-model-params"):
            grad_stages.main_params_to_model_params(self.param_map)
        return True

    def _verified_steps(
        self, inner: list[tuple[torch.optim.Optimizer, bool, list[torch.Tensor], bool]], factors: tuple[torch.Tensor, torch.Tensor] | None
    ) -> bool:
        """Step the inner optimizers whose finite gradients can still give a non-finite update or an
        error (SOAP: its float32 Kronecker factors G·Gᵀ and their eigendecompositions overflow for
        gradients around 1e16), keeping their params and state to put back: returns whether every
        result is finite (agreed over the process group); else everything is as it was."""
        kept = [(opt, step_guards.snapshot(opt, params)) for opt, _, params, verified in inner if verified]
        failed = False
        try:
            for opt, takes_grad_scale, params, verified in inner:
                if verified:
                    self._inner_step(opt, takes_grad_scale, params, factors)
        except step_guards.LINALG_ERROR:  # a decomposition that did not converge on overflowed factors
            failed = True
        except BaseException:  # anything else is not a numerical fault: raised, with nothing changed
            for opt, snapshot in kept:
                step_guards.restore_(opt, snapshot)
            raise
        flag = torch.tensor([1.0 if failed else 0.0], device=self._one.device)
        if not failed:
            results = [t for opt, snapshot in kept for t in step_guards.tensors_of(opt, snapshot)]
            if results:
                finite = torch.stack([torch.isfinite(t).all() for t in results]).all()
                flag = (~finite).float().reshape(1).to(self._one.device)
        if self.process_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        if bool(flag.item()):
            for opt, snapshot in kept:
                step_guards.restore_(opt, snapshot)
            return False
        return True

    _each_rank_steps_every_param = True
    """Under a process group (FSDP2), every rank steps its shard of every param (the distributed
    optimizers: each rank its own params): telemetry counts orthogonalised params on one rank only."""

    def _counts_orthogonalized_here(self) -> bool:
        group = self.process_group
        return group is None or not self._each_rank_steps_every_param or dist.get_rank(group) == 0

    def metrics(self) -> dict[str, torch.Tensor]:
        """The last step's telemetry (``OptimizerConfig.log_metrics``): ``{"<algorithm>/<k>/<metric>": 0-dim tensor}``,
        on the params' device, nothing read to the host (:func:`optzoo.metrics_to_floats` reads them
        in one transfer). Empty before the first step that reached the inner optimizers; a step
        skipped before them (inf/NaN, ``grad_norm_skip_threshold``) leaves the last one's. See
        :mod:`optzoo.wrapper.telemetry` for the metrics.

        Raises:
            ValueError: Telemetry is off (``log_metrics=False``).
        """
        if self._telemetry is None:
            raise ValueError(
                "`metrics`: telemetry is off; got OptimizerConfig.log_metrics=False; expected log_metrics=True "
                "(per group) or 'per_param' when get_optimizer builds the optimizer"
            )
        return dict(self._telemetry.last)

    def _needs_norm(self) -> bool:
        """Whether a step computes the global norm: to clip, or to compare with the threshold."""
        return self.options.clip_grad > 0.0 or math.isfinite(self.options.grad_norm_skip_threshold)

    @torch.no_grad()
    def step_on_device(self) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """One step that reads nothing back to the host: the skip decision stays on the device.

        The same update as :meth:`step`, bit for bit, but inf/NaN is handed to the kernels as
        torch's ``found_inf`` tensor, which skips the update inside them (the step counts they
        advanced are taken back), instead of being read to decide in Python; so is a norm over
        ``grad_norm_skip_threshold``. On a GPU the launch queue then never waits for the device.

        Returns:
            ``(update_successful, grad_norm, None)``: a 0-dim bool tensor; the 0-dim float32
            global norm of the unscaled gradients before clipping when ``clip_grad > 0`` or
            ``grad_norm_skip_threshold`` is finite (else ``None``; inf or NaN on an inf/NaN
            step), both on the params' device.

        Raises:
            ValueError: Something needs the host: an inner optimizer without a device-side skip
                (only torch's fused Adam/AdamW/SGD and the precision-aware Adam's fused groups
                have one, the latter not with ``compiled=True``), a dynamic loss scaler (its
                hysteresis is host logic), ``log_num_zeros_in_grad``, or
                ``fold_clip_and_scale=False``. Nothing changes.
        """
        self._check_step_on_device()
        sync_siblings_(self._siblings)
        if self._clip_watch is not None and self._clip_watch.active:
            self._clip_watch.check(self.options.clip_grad)
        with autocast_disabled():
            result = self._step_on_device()
        self._record_step(*result)
        return result

    def _step_on_device(self) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        with self._timed("optimizer-copy-to-main-grad"):
            grads = self._to_mains(on_device=True)
        group, device = self.process_group, self._one.device  # after _to_mains: it may follow re-pointed params
        clipping = self.options.clip_grad > 0.0
        if not grads and group is None:
            return torch.ones((), dtype=torch.bool, device=device), None, None
        with self._timed("optimizer-unscale-and-check-inf"):
            norm = grad_stages.unscaled_norm(grads, self.grad_scaler, group, device, self._uncounted())
            found_inf = self._skip_on_device(norm)
        with self._timed("optimizer-clip-main-grad") if clipping else contextlib.nullcontext():
            factors = grad_stages.grad_factors(norm, self.grad_scaler, self.options.clip_grad, clip=clipping)
            divisor = factors[1] if factors is not None else self._one.reshape(())
        telemetry = self._telemetry
        if telemetry is not None:
            telemetry.grads_(self, self.grad_scaler.scale if self.grad_scaler is not None else None)
            telemetry.before_update_(self)
        with self._timed("optimizer-inner-step"), _without_global_step_hooks():
            # zero buffers: a first step skipped in the kernel leaves them as a clean one would find them
            step_guards.zero_momentum_buffers_(step_guards.missing_momentum_buffers(self.optimizers))
            for opt in self.optimizers:
                with _amp_scaling(opt, divisor, found_inf):
                    opt.step()
        if telemetry is not None:
            telemetry.after_update_(self, counts_here=self._counts_orthogonalized_here())
        with self._timed("optimizer-copy-main-to-model-params"):
            grad_stages.main_params_to_model_params(self.param_map)  # a skipped step copies the same values
        return found_inf == 0, norm if self._needs_norm() else None, None

    def _check_step_on_device(self) -> None:
        from optzoo.wrapper.scalers import ConstantGradScaler

        needs_host = []
        for opt, takes in zip(self.optimizers, self._takes_grad_scale, strict=True):
            algorithms = ", ".join(sorted({g.get("optimizer", "?") for g in opt.param_groups}))
            if not takes or not all(g.get("fused") for g in opt.param_groups):
                needs_host.append(f"inner optimizer {type(opt).__name__} ({algorithms})")
            elif getattr(opt, "compiled", False) is True:
                needs_host.append(f"inner optimizer {type(opt).__name__} ({algorithms}) with compiled=True (it reads found_inf on the host)")
        if self.grad_scaler is not None and not isinstance(self.grad_scaler, ConstantGradScaler):
            needs_host.append(f"a {type(self.grad_scaler).__name__} (its hysteresis is host logic)")
        if self.options.log_num_zeros_in_grad:
            needs_host.append("log_num_zeros_in_grad=True")
        if not self.options.fold_clip_and_scale:
            needs_host.append("fold_clip_and_scale=False")
        if needs_host:
            raise ValueError(
                f"`step_on_device`: these need the host; got {'; '.join(needs_host)}; expected torch's fused "
                "Adam/AdamW/SGD or the precision-aware Adam with fused groups, no loss scaler or a constant "
                "loss_scale, log_num_zeros_in_grad=False and fold_clip_and_scale=True (or call step())"
            )

    def _to_mains(self, *, on_device: bool = False) -> list[torch.Tensor]:
        """The first stage of every step: working copies and gradients to where the inner
        optimizers read them; returns the main grads. What can refuse the step is checked first."""
        try:
            self.param_map.check_model_unchanged()
        except ValueError:
            if not self._follow_repointed_params():
                raise
            self.param_map.check_model_unchanged()
        if any(g["momentum"] != 0 and g["dampening"] != 0 for opt in self._sgds for g in opt.param_groups):
            has_grad = grad_stages.grad_presence(self.param_map)
            step_guards.check_dampening(self.optimizers, lambda main: has_grad.get(id(main), False), on_device=on_device)
        grad_stages.model_params_to_working_copies(self.param_map)
        return grad_stages.model_grads_to_main_grads(self.param_map, self._grad_buffers)

    @staticmethod
    def _inner_step(
        opt: torch.optim.Optimizer, takes_grad_scale: bool, params: list[torch.Tensor], factors: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        """Step one inner optimizer with its gradients times ``factors``' multiplier: divided by
        the divisor inside its kernel, or multiplied in one foreach pass first."""
        if factors is None:
            opt.step()
        elif takes_grad_scale:
            with _amp_scaling(opt, factors[1]):
                opt.step()
        else:
            grads = [local_shard(p.grad) for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factors[0])
            opt.step()

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model grads and main grads (and ``main_grad`` buffers)."""
        super().zero_grad(set_to_none)
        grad_stages.clear_grads_(self.param_map, set_to_none)
        self._ready = None

    # ---- state dict ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Groups and per-parameter state, keyed by parameter names (not positions).

        Tensors are the live ones, as in torch; ``torch.save`` (or a deep copy) snapshots them.
        Hooks registered with ``register_state_dict_pre_hook``/``_post_hook`` run as in torch.
        Called by torch's DCP state-dict API (``get_optimizer_state_dict``), it answers in
        torch.optim's format, which that API reads (:mod:`optzoo.wrapper.torch_state_dict`).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._torch_state_dict() if called_by_torch_state_dict_api() else self._state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _state_dict(self) -> dict[str, Any]:
        """Override point: the state dict, before the hooks."""
        return state_dict_of(
            param_groups=self.param_groups, state=self.state, param_map=self.param_map, grad_scaler=self.grad_scaler,
            routing=self.routing_record(),
        )  # fmt: skip

    def _plan_kind(self) -> PlanKind:
        """Override point: how this optimizer is distributed (see :data:`~optzoo.wrapper.routing_digest.PlanKind`)."""
        if self.process_group is not None and any(isinstance(entry.model, DTensor) for entry in self.param_map.entries):
            return "fsdp2"
        return "none"

    @property
    def param_map(self) -> ParamMap:
        """Every trainable param in group order, with how this process steps it."""
        return self._param_map

    @param_map.setter
    def param_map(self, value: ParamMap) -> None:
        self._param_map = value
        # the dtypes it was built for: a model cast later is refused by the next step, and must not
        # change what state_dict records
        self._built_dtypes = {entry.name: entry.model.dtype for entry in value.entries}

    def routing_record(self) -> dict[str, Any]:
        """What decides every param's optimizer state (shape, group, algorithm, precision flags, block
        layout) and the plan's kind, as :mod:`~optzoo.wrapper.routing_digest` records it in checkpoints."""
        views = dict(self._matrix_views)
        for group, entries in zip(self.param_groups, self.param_map.local_by_group(), strict=True):
            local_views = group.get("matrix_views") or []
            if len(local_views) == len(entries):  # (parallel to this process's params)
                for entry, view in zip(entries, local_views, strict=True):
                    views.setdefault(entry.name, view)
        return routing_record(self.param_map, self.param_groups, views, self._plan_kind(), self._built_dtypes)

    @property
    def routing_digest(self) -> str:
        """SHA-256 of :meth:`routing_record`: the ``routing_digest`` its checkpoints carry; the same in
        every process and on every world size of one plan kind."""
        return digest_of(self.routing_record())

    def _torch_state_dict(self) -> dict[str, Any]:
        """Override point: this process's state in torch.optim's format, for torch's DCP state-dict API."""
        return to_torch_format(MixedPrecisionOptimizer._state_dict(self), self.param_groups, self.param_map)

    # torch's returns None; so does ours unless asked for a report
    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], *, allow_routing_change: bool = False, warm_start: bool = False
    ) -> RoutingChangeReport | None:
        """Restore groups' hyperparameters and state, matching parameters by name.

        Also takes torch.optim's format (``params`` by position, or by the names torch's DCP
        ``set_optimizer_state_dict`` puts there), matched to this optimizer's params in order.

        Everything is checked before anything changes: a name that exists on one side only, or a
        param whose routing changed (another algorithm, group, precision or block layout: the
        checkpoint's ``routing_digest`` differs, see docs/distributed.md) is a ``ValueError``
        naming both sides, and the optimizer is left as it was. Hooks registered with
        ``register_load_state_dict_pre_hook``/``_post_hook`` run as in torch (a pre-hook may
        return the dict to load instead).

        Args:
            state_dict: What :meth:`state_dict` returned (or torch.optim's format).
            allow_routing_change: Load what still fits and start the params whose routing changed
                with fresh state (as a new optimizer's); a ``RoutingChangeWarning`` names them.
            warm_start: With ``allow_routing_change``: convert the state of a param moved between
                ``adam`` and ``muon`` instead (:func:`~optzoo.wrapper.routing_digest.warm_start_state`,
                an approximation).

        Returns:
            With ``allow_routing_change``, the :class:`~optzoo.wrapper.routing_digest.RoutingChangeReport`
            (every changed param, and exactly which started fresh or were converted); else ``None``.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)  # type: ignore[arg-type]  # torch types it dict; any mapping loads
            if result is not None:
                state_dict = result
        if is_torch_format(state_dict):
            state_dict = self._from_torch_format(state_dict)
        report = self._load_state_dict(state_dict, allow_routing_change=allow_routing_change, warm_start=warm_start)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
        return report

    def _from_torch_format(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Override point: a torch-format state dict as optzoo's name-keyed one."""
        return from_torch_format(state_dict, self.param_map)

    def _load_state_dict(
        self, state_dict: Mapping[str, Any], *, allow_routing_change: bool = False, warm_start: bool = False
    ) -> RoutingChangeReport | None:
        """Override point: the checked load, between the hooks."""
        return load_state_dict_(
            state_dict, param_groups=self.param_groups, state=self.state, param_map=self.param_map, grad_scaler=self.grad_scaler,
            optimizers=self.optimizers, agree=self._agree_on_load, routing=self.routing_record(),
            allow_routing_change=allow_routing_change, warm_start=warm_start,
        )  # fmt: skip

    def _agree_on_load(self, error: Exception | None) -> None:
        """Override point: called once a load's checks have run here, with their error or ``None``;
        raises to refuse the load (one process: its own error)."""
        if error is not None:
            raise error


@contextlib.contextmanager
def _without_global_step_hooks() -> Iterator[None]:
    """Hide torch's global step hooks (``register_optimizer_step_pre_hook``/``_post_hook``) from the
    inner optimizers: one ``step()`` of the wrapper runs each once, as for any torch optimizer."""
    from torch.optim import optimizer as torch_optimizer

    hooks: tuple[dict[int, Any], ...] = (torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks)
    if not any(hooks):
        yield
        return
    saved = [dict(h) for h in hooks]
    for h in hooks:
        h.clear()
    try:
        yield
    finally:
        for h, kept in zip(hooks, saved, strict=True):
            added = dict(h)  # a hook an inner step registered stays, after the ones it found
            h.clear()
            h.update(kept)
            h.update(added)


@contextlib.contextmanager
def _amp_scaling(opt: torch.optim.Optimizer, grad_scale: torch.Tensor, found_inf: torch.Tensor | None = None) -> Iterator[None]:
    """torch's GradScaler protocol for one step of ``opt``: its kernel divides every gradient by
    ``grad_scale`` and, with ``found_inf`` set to 1, skips the update."""
    opt.grad_scale = grad_scale  # type: ignore[attr-defined]
    if found_inf is not None:
        opt.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del opt.grad_scale  # type: ignore[attr-defined]
        if found_inf is not None:
            del opt.found_inf  # type: ignore[attr-defined]


class FP32Optimizer(MixedPrecisionOptimizer):
    """fp32 model: the main params are the model params (Megatron-Core's ``FP32Optimizer``).

    Unlike Megatron-Core, inf/NaN gradients are still detected and the step skipped.
    """


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp16 or bf16 model: the inner optimizers step fp32 main copies of the 16-bit params."""
