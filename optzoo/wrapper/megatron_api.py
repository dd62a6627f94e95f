"""Megatron-Core's ``MegatronOptimizer`` methods beyond ``step``, for the wrapper's one optimizer.

Megatron-Core splits a step into ``prepare_grads`` (model grads to main grads, unscale, inf/NaN
check, scaler update) and ``step_with_ready_grads`` (inner steps, main params to model params,
param sync), with ``clip_grad_norm``, ``get_grad_norm`` and ``count_zeros`` in between (NVIDIA/
Megatron-LM ``megatron/core/optimizer/optimizer.py``). The wrapper keeps those two halves in
:mod:`~optzoo.wrapper.mixed_precision`; this module holds what they hand each other,
:class:`ReadyGrads`, and the :class:`MegatronMethods` that read it: under
``fold_clip_and_scale`` the unscale and the clip are not applied to the gradients between the
halves but carried as one factor into the inner optimizers' kernels, so these methods report
the gradients as ``step_with_ready_grads`` will apply them.

Megatron-Core's ``get_megatron_optimizer`` returns a ``ChainedOptimizer`` of one optimizer per
model chunk or algorithm; optzoo returns one wrapper over all of them. For code that walks
``optimizer.chained_optimizers`` (or reads ``optimizer.optimizer``), :class:`ChainedOptimizerView`
shows each inner optimizer read-only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optzoo._common import finite_number, invalid, shorten, show_value
from optzoo.config import OptimizerConfig
from optzoo.wrapper import grad_stages
from optzoo.wrapper.param_map import ParamEntry, ParamMap
from optzoo.wrapper.scalers import MegatronGradScaler

if TYPE_CHECKING:
    from optzoo.wrapper.mixed_precision import StepOptions

__all__ = ["ChainedOptimizerView", "MegatronMethods", "ReadyGrads", "match_model_state"]


@dataclass(eq=False)
class ReadyGrads:
    """This rank's main gradients between ``prepare_grads`` and ``step_with_ready_grads``."""

    grads: list[torch.Tensor]
    """The main gradients the inner optimizers will read."""
    deferred: bool
    """``fold_clip_and_scale``: the unscale and the clip reach the gradients in the inner steps."""
    scale: torch.Tensor | None = None
    """The loss scale the gradients still carry (deferred only), read before the scaler updated."""
    norm: torch.Tensor | None = None
    """The global norm of the unscaled gradients, before clipping, when ``prepare_grads`` computed it."""
    norm_value: float | None = None
    """``norm`` read on the host."""
    coefficient: torch.Tensor | None = field(default=None)
    """A clip coefficient still to apply (deferred only)."""

    def factors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(multiplier, divisor)`` still to apply, or ``None`` (see :func:`grad_stages.factors_of`)."""
        return grad_stages.factors_of(self.scale, self.coefficient)


class MegatronMethods:
    """Megatron-Core's ``get_grad_norm``, ``clip_grad_norm``, ``count_zeros``, ``optimizer`` and
    ``chained_optimizers``, mixed into :class:`~optzoo.MixedPrecisionOptimizer`."""

    # Set by MixedPrecisionOptimizer.
    optimizers: list[torch.optim.Optimizer]
    param_map: ParamMap
    options: StepOptions
    grad_scaler: MegatronGradScaler | None
    process_group: dist.ProcessGroup | None
    _one: torch.Tensor

    config: OptimizerConfig | None = None
    """The config :func:`optzoo.get_optimizer` built this optimizer from (Megatron-Core's
    ``optimizer.config``); ``None`` for a wrapper built by hand."""
    _ready: ReadyGrads | None = None
    replicated: frozenset[int] = frozenset()
    """ids of the (DTensor) model params whose local piece a lower rank of ``process_group`` holds
    too (:func:`optzoo.distributed.replicated_params`): left out of the grad norm and the zero count."""
    expert_names: frozenset[str] = frozenset()
    """Names of the expert params (what :func:`optzoo.distributed.replicated_params` tells apart by mesh)."""

    _replica_entries: tuple[ParamMap, frozenset[int], list[ParamEntry]] | None = None

    def _uncounted(self) -> frozenset[int]:
        """ids of the main gradients of :attr:`replicated`'s params, as they are now."""
        if not self.replicated:
            return frozenset()
        cached = self._replica_entries
        if cached is None or cached[0] is not self.param_map or cached[1] is not self.replicated:
            entries = [e for e in self.param_map.local if id(e.model) in self.replicated and e.main is not None]
            cached = self._replica_entries = (self.param_map, self.replicated, entries)
        found = set()
        for entry in cached[2]:
            assert entry.main is not None  # kept above
            for grad in (entry.model.grad, entry.main.grad, getattr(entry.main, "decoupled_grad", None)):
                if grad is not None:
                    found.add(id(grad))
        return frozenset(found)

    def get_loss_scale(self) -> torch.Tensor:  # overridden by the wrapper
        raise NotImplementedError

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """The global L2 norm of the main gradients, over every rank of the group, as
        ``step_with_ready_grads`` will apply them: unscaled, and clipped by any
        :meth:`clip_grad_norm` since ``prepare_grads`` (Megatron-Core's ``get_grad_norm``).

        Before ``prepare_grads`` (or after ``step_with_ready_grads``) it reads the main gradients
        as they are, as Megatron-Core does. A collective under a process group.
        """
        norm = self._current_norm(self._ready_grads())
        return 0.0 if norm is None else float(norm)

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip the main gradients to the global L2 norm ``clip_grad``; returns the norm before
        clipping (Megatron-Core's ``clip_grad_norm``: coefficient ``clip_grad / (norm + 1e-6)``
        where that is below 1). ``0`` only computes the norm.

        Under ``fold_clip_and_scale`` the coefficient is kept for ``step_with_ready_grads``,
        which applies it with the loss scale as one factor, as ``step`` does.

        Raises:
            ValueError: ``clip_grad`` is not a finite number >= 0.
        """
        if not finite_number(clip_grad) or not clip_grad >= 0.0:
            raise invalid("clip_grad_norm", "clip_grad must be a finite number >= 0", show_value(clip_grad), "e.g. 1.0 (0: only the norm)")
        ready = self._ready = self._ready_grads()
        norm = self._current_norm(ready)
        if norm is None:
            return 0.0
        value = float(norm)
        if clip_grad > 0.0:
            self._clip_(ready, clip_grad, norm, value)
        return value

    @torch.no_grad()
    def count_zeros(self) -> int:
        """Zero elements of the main gradients over every rank of the group (Megatron-Core's
        ``count_zeros``; a positive factor still to apply changes no zero). A collective under a
        process group."""
        return grad_stages.count_zeros(self._ready_grads().grads, self.process_group, self._one.device, self._uncounted())

    @property
    def chained_optimizers(self) -> tuple[ChainedOptimizerView, ...]:
        """One read-only :class:`ChainedOptimizerView` per inner optimizer, in order of first use,
        for code written against Megatron-Core's ``ChainedOptimizer.chained_optimizers``."""
        return tuple(ChainedOptimizerView(self, opt) for opt in self.optimizers)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner torch optimizer when there is one (Megatron-Core's ``ChainedOptimizer.optimizer``).

        Raises:
            AttributeError: There are several (one per algorithm); so that ``hasattr`` and
                ``getattr(..., default)`` see none, as code that unwraps optimizers expects.
        """
        if len(self.optimizers) != 1:
            algorithms = [_algorithms(opt) for opt in self.optimizers]
            raise AttributeError(
                f"`optimizer`: this optimizer chains several inner optimizers; got {len(self.optimizers)} "
                f"({'; '.join(algorithms)}); expected one, or chained_optimizers[i].optimizer"
            )
        return self.optimizers[0]

    # ---- shared with the step -----------------------------------------------------------

    def _ready_grads(self) -> ReadyGrads:
        """What ``prepare_grads`` left, or the main gradients as they are."""
        if self._ready is not None:
            return self._ready
        return ReadyGrads(current_main_grads(self.param_map), deferred=self.options.fold_clip_and_scale)

    def _current_norm(self, ready: ReadyGrads) -> torch.Tensor | None:
        """The global norm of ``ready``'s gradients with what is still to apply to them; ``None``
        when no rank can hold one (no gradient, no group)."""
        if not ready.grads and self.process_group is None:
            return None
        norm = grad_stages.norm_under_scale(ready.grads, ready.scale, self.process_group, self._one.device, self._uncounted())
        return norm if ready.coefficient is None else norm * ready.coefficient

    def _clip_(self, ready: ReadyGrads, max_norm: float, norm: torch.Tensor, norm_value: float) -> None:
        """Clip ``ready``'s gradients by their global norm: now, or (deferred) as a coefficient."""
        if not ready.deferred:
            grad_stages.clip_by_global_norm_(ready.grads, max_norm, norm, norm_value)
        elif grad_stages.clip_needed(max_norm, norm_value):
            coefficient = grad_stages.clip_coefficient(norm, max_norm)
            ready.coefficient = coefficient if ready.coefficient is None else ready.coefficient * coefficient

    def _over_threshold(self, norm_value: float | None) -> bool:
        """Whether ``grad_norm_skip_threshold`` skips this update (Megatron-Core: ``norm > threshold``)."""
        threshold = self.options.grad_norm_skip_threshold
        return norm_value is not None and math.isfinite(threshold) and norm_value > threshold

    def _skip_on_device(self, norm: torch.Tensor) -> torch.Tensor:
        """``step_on_device``'s skip flag (float32, 1 = skip): an inf/NaN norm, or one over
        ``grad_norm_skip_threshold`` (compared in float64, as the host compares the norm's value)."""
        skip = torch.isfinite(norm).logical_not()
        threshold = self.options.grad_norm_skip_threshold
        if math.isfinite(threshold):
            skip = skip | (norm.double() > threshold)
        return skip.to(torch.float32)

    @torch.no_grad()
    def _reload_from_(self, state_dict: Mapping[str, Any]) -> None:
        """``reload_model_params(state_dict)``: main params from the state dict's tensors."""
        if any(entry.grad_target == "decoupled" for entry in self.param_map.entries):
            raise ValueError(
                "`reload_model_params`: a state_dict is not supported under use_precision_aware_optimizer; "
                "got a state_dict; expected state_dict=None (the precision-aware Adam reloads its masters "
                "from the model params: load the state dict into the model first)"
            )
        sharded = [entry.name for entry in self.param_map.entries if isinstance(entry.model, DTensor)]
        if sharded:
            raise ValueError(
                f"`reload_model_params`: a state_dict is not supported for FSDP2-sharded (DTensor) params; got "
                f"[{shorten(sharded)}]; expected state_dict=None (load the state dict into the model first)"
            )
        for entry, value in match_model_state(state_dict, self.param_map):
            value = value.detach()
            if entry.aliased:  # an fp32 param is its own main param: write it whole, on every rank alike
                entry.model.detach().copy_(value)
            elif entry.main is not None:
                entry.main.copy_(value if entry.part is None else value.reshape(-1)[entry.part[0] : entry.part[1]])


@dataclass(frozen=True, eq=False)
class ChainedOptimizerView:
    """One inner optimizer as Megatron-Core code reads a member of ``chained_optimizers``.

    It has ``optimizer`` (the torch optimizer; its groups are the wrapper's own, so setting a
    group's ``lr`` acts), ``config``, ``param_groups``, ``get_parameters()``, ``get_loss_scale()``,
    ``grad_scaler`` and ``is_stub_optimizer``. Stepping, zeroing and state dicts stay with the
    wrapper, which does them for every inner optimizer at once: the view has none of them.
    """

    wrapper: MegatronMethods
    optimizer: torch.optim.Optimizer

    @property
    def config(self) -> OptimizerConfig | None:
        return self.wrapper.config

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (a new list of the live group dicts)."""
        return list(self.optimizer.param_groups)

    @property
    def grad_scaler(self) -> MegatronGradScaler | None:
        return self.wrapper.grad_scaler

    @property
    def is_stub_optimizer(self) -> bool:
        """Whether this rank steps none of its params (Megatron-Core's name)."""
        return not self.get_parameters()

    def get_parameters(self) -> list[torch.Tensor]:
        """The (main) params it steps on this rank, group by group."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_loss_scale(self) -> torch.Tensor:
        return self.wrapper.get_loss_scale()

    def __getattr__(self, name: str) -> Any:
        # AttributeError (not ValueError) so that hasattr() and getattr(..., default) keep working.
        raise AttributeError(
            f"`chained_optimizers[i].{name}`: not on optzoo's read-only view; got a view of "
            f"{type(self.optimizer).__name__} ({_algorithms(self.optimizer)}); expected one of optimizer, "
            "config, param_groups, get_parameters(), get_loss_scale(), grad_scaler, is_stub_optimizer "
            "(step, zero_grad and state dicts act on the optimizer get_optimizer returned)"
        )


def _algorithms(opt: torch.optim.Optimizer) -> str:
    return ", ".join(sorted({str(g.get("optimizer", "?")) for g in opt.param_groups})) or "no groups"


def current_main_grads(param_map: ParamMap) -> list[torch.Tensor]:
    """The main gradients where the inner optimizers read them, as they are now."""
    grads = []
    for entry in param_map.local:
        assert entry.main is not None  # local entries have one
        grad = getattr(entry.main, "decoupled_grad", None) if entry.grad_target == "decoupled" else entry.main.grad
        if grad is not None:
            grads.append(grad)
    return grads


_CHUNK_KEY = re.compile(r"model_?(\d+)")
_CHUNK_PREFIX = re.compile(r"chunk\d+\.")


def _plain_name(name: str) -> str:
    """``name`` without DDP's ``module.`` prefixes (after a ``chunkN.`` prefix, if any), as
    Megatron-Core strips them before matching."""
    prefix = _CHUNK_PREFIX.match(name)
    head, rest = (prefix.group(0), name[prefix.end() :]) if prefix else ("", name)
    while rest.startswith("module."):
        rest = rest[len("module.") :]
    return head + rest


def _flat_model_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron-Core's layouts of a model state dict, flat and keyed like optzoo's param names:
    ``{"model0": ..., "model1": ...}`` (or ``model_0``; NeMo's) per chunk, ``{"model": ...}``
    for one chunk, or the flat dict itself."""
    chunks = {int(m.group(1)): v for k, v in state_dict.items() if (m := _CHUNK_KEY.fullmatch(str(k))) and isinstance(v, Mapping)}
    if chunks:
        if sorted(chunks) != list(range(len(chunks))):
            raise invalid("reload_model_params", "state_dict chunks must be numbered 0..N-1", str(sorted(chunks)), "model0, model1, ...")
        if len(chunks) == 1:
            return dict(chunks[0])
        return {f"chunk{i}.{k}": v for i, chunk in sorted(chunks.items()) for k, v in chunk.items()}
    model = state_dict.get("model")
    return dict(model) if isinstance(model, Mapping) else dict(state_dict)


def match_model_state(state_dict: Mapping[str, Any], param_map: ParamMap) -> list[tuple[ParamEntry, torch.Tensor]]:
    """Each param's tensor in a model state dict, matched by name; checks every param first.

    A param matches the key equal to one of its names, without DDP's ``module.`` prefixes; else
    the one key that ends with ``.`` and that name (Megatron-Core matches by suffix too, and
    asserts one match).

    Raises:
        ValueError: ``state_dict`` is not a mapping; a param has no tensor, or several, or one
            of another shape. Nothing has changed.
    """
    if not isinstance(state_dict, Mapping):
        raise invalid("reload_model_params", "state_dict must be a model state dict", type(state_dict).__name__, "a mapping of names to tensors, or None")
    flat = {_plain_name(str(k)): v for k, v in _flat_model_state(state_dict).items() if isinstance(v, torch.Tensor)}
    matched: list[tuple[ParamEntry, torch.Tensor]] = []
    missing, ambiguous, misshapen = [], [], []
    for entry in param_map.entries:
        names = [_plain_name(n) for n in entry.names]
        key = next((n for n in names if n in flat), None)
        if key is None:
            keys = sorted({k for n in names for k in flat if k.endswith("." + n)})
            if len(keys) > 1:
                ambiguous.append(f"{entry.name} ({', '.join(keys[:3])})")
                continue
            key = keys[0] if keys else None
        if key is None:
            missing.append(entry.name)
        elif tuple(flat[key].shape) != tuple(entry.model.shape):
            misshapen.append(f"{entry.name}: {tuple(flat[key].shape)} for {tuple(entry.model.shape)}")
        else:
            matched.append((entry, flat[key]))
    for problem, names in (("has no tensor for some params", missing), ("has several tensors for some params", ambiguous),
                           ("has tensors of another shape", misshapen)):  # fmt: skip
        if names:
            raise invalid(
                "reload_model_params", f"the state_dict {problem}", f"keys [{shorten(sorted(flat))}]",
                f"one tensor of the param's shape for each of [{shorten(names)}]",
            )  # fmt: skip
    return matched
