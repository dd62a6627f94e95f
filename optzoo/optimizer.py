"""The optimizer ``get_optimizer`` returns: one ``torch.optim.Optimizer`` over every algorithm.

Each algorithm keeps its own torch optimizer over its groups; the wrapper owns the very same
group dicts (in routing order) and one shared ``state`` mapping, so schedulers, ``zero_grad``
and checkpointing see a single optimizer. The inner optimizers step *main* parameters: the model
parameters themselves (:class:`FP32Optimizer`), or fp32 copies of fp16/bf16 model parameters
(:class:`Float16OptimizerWithFloat16Params`), as in Megatron-Core's ``MixedPrecisionOptimizer``.

One step: model grads -> main grads; unscale and detect inf/NaN in one foreach pass; the
scaler sees the result; on inf/NaN return ``(False, None, None)`` with parameters and state
untouched; else global-norm clip, zero count, inner steps, main params -> model params.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optzoo.config import OptimizerConfig
from optzoo.scalers import MegatronGradScaler

StepResult = tuple[bool, float | None, int | None]
"""``(update_successful, grad_norm, num_zeros_in_grad)``, as Megatron-Core's ``step``."""

STATE_DICT_FORMAT = "optzoo.chained.v1"


Part = tuple[int, int] | None
"""The flat element range ``[start, stop)`` of a model param a main param stands for (``None``:
all of it). Ranges appear only under the sharded optimizer (:mod:`optzoo.distributed`)."""


class _Pair(NamedTuple):
    name: str
    model: torch.Tensor  # the whole model parameter
    main: torch.Tensor  # what the inner optimizer steps
    part: Part
    aliased: bool  # ``main`` is the model's own storage (no copy to keep in sync)

    @property
    def model_part(self) -> torch.Tensor:
        return _part_of(self.model, self.part)


def _part_of(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    return tensor if part is None else tensor.view(-1)[part[0] : part[1]]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shorten(items: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Several torch optimizers over main parameters, behind one ``torch.optim.Optimizer`` face.

    Built by :func:`optzoo.get_optimizer`; ``param_groups`` are the inner optimizers' real
    groups (holding the main parameters), ``state`` is shared by all of them, and
    ``state_dict`` is keyed by parameter names.

    Args:
        optimizers: The inner optimizers; their groups must together be ``param_groups``.
        param_groups: The same group dicts, in routing order; each has ``param_names``.
        model_params: The model parameter behind each main parameter, group by group (the
            same tensor where the main parameter is the model parameter).
        config: The model-wide config (clipping, zero counting, timers).
        grad_scaler: The loss scaler shared by every inner optimizer, or ``None`` (scale 1).
        params_have_main_grad: Read gradients from ``param.main_grad`` (a DDP-style fp32
            buffer) instead of ``param.grad``.
        decoupled_grad_dtype: When set, main grads go to ``main_param.decoupled_grad`` in this
            dtype (the precision-aware optimizer reads them there) instead of ``.grad``.
        aliases: Extra names of tied parameters: ``{primary name: (all names)}``.
        model_parts: Per main param, the flat element range of its model param it stands for
            (``None``: the whole param; the default for every param).
        process_group: Reduce the inf/NaN flag, the grad norm and the zero count over this group
            (each rank holding different gradients); ``None``: this process alone.
        device: Where the scale and flags live when this rank holds no parameter.
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        param_groups: list[dict[str, Any]],
        *,
        model_params: Sequence[Sequence[torch.Tensor]],
        config: OptimizerConfig,
        grad_scaler: MegatronGradScaler | None = None,
        params_have_main_grad: bool = False,
        decoupled_grad_dtype: torch.dtype | None = None,
        aliases: Mapping[str, tuple[str, ...]] | None = None,
        model_parts: Sequence[Sequence[Part]] | None = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        inner_ids = sorted(id(g) for opt in optimizers for g in opt.param_groups)
        assert inner_ids == sorted(id(g) for g in param_groups), "groups must be the inner ones"
        self.process_group = process_group
        self.optimizers = list(optimizers)
        self.config = config
        self.grad_scaler = grad_scaler
        self.params_have_main_grad = params_have_main_grad
        self.decoupled_grad_dtype = decoupled_grad_dtype
        self.aliases = dict(aliases or {})
        self._building = True
        super().__init__(param_groups, defaults={})
        self._building = False
        self._model_params = [list(models) for models in model_params]
        parts = model_parts or [[None] * len(models) for models in self._model_params]
        self._pair_list: list[_Pair] = []
        for group, models, group_parts in zip(self.param_groups, self._model_params, parts, strict=True):
            assert len(group["params"]) == len(models) == len(group_parts), "one model param per main param"
            for name, model, main, part in zip(group["param_names"], models, group["params"], group_parts):
                aliased = main is model or (part is not None and main.data_ptr() == _part_of(model, part).data_ptr())
                self._pair_list.append(_Pair(name, model, main, part, aliased))
        for opt in self.optimizers:
            opt.state = self.state  # params are disjoint, so one mapping serves every optimizer
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device = first.device if first is not None else device or torch.device("cpu")
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise TypeError(
                f"`{type(self).__name__}.add_param_group`: groups are fixed by routing; got a new group; "
                "expected get_optimizer(...) to be called again with the new parameters"
            )
        super().add_param_group(param_group)

    # ---- loss scale ----------------------------------------------------------------------

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale (a 1-element float32 tensor; 1 without a scaler)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else self._one

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call ``.backward()`` on this under fp16."""
        return loss * self.get_loss_scale()

    def _pairs(self) -> Iterator[_Pair]:
        """Every (model param, main param) pair, group by group."""
        return iter(self._pair_list)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the main params from the model (after loading weights without the optimizer).

        Covers fp32 main copies here and master weights an inner optimizer keeps in its state
        (the precision-aware Adam's ``reload_master_weights_``).
        """
        for pair in self._pairs():
            if not pair.aliased:
                pair.main.copy_(pair.model_part)
        for opt in self.optimizers:
            reload = getattr(opt, "reload_master_weights_", None)
            if callable(reload):
                reload()

    # ---- step ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        timers = self.config.timers
        if timers is None:
            yield
            return
        timer = timers(name, log_level=1)
        timer.start(barrier=self.config.barrier_with_L1_time)
        try:
            yield
        finally:
            timer.stop()

    def _model_grad(self, name: str, model: torch.Tensor) -> torch.Tensor | None:
        if self.params_have_main_grad:
            grad = getattr(model, "main_grad", None)
            if grad is None:
                raise ValueError(
                    f"`{name}`: params_have_main_grad=True but the parameter has no main_grad; "
                    "got None; expected a main_grad buffer on every trainable parameter"
                )
        else:
            grad = model.grad
        if grad is not None and grad.is_sparse:
            raise ValueError(
                f"`{name}`: sparse gradients are not supported; got a sparse {grad.layout} "
                "gradient; expected a dense gradient"
            )
        return grad

    def _copy_model_grads_to_main_grads(self) -> list[torch.Tensor]:
        """Put each gradient where the inner optimizer reads it; returns the main grads.

        Checked for every parameter before any is touched, so a bad gradient changes nothing.
        """
        pairs = [(pair, self._model_grad(pair.name, pair.model)) for pair in self._pairs()]
        main_grads = []
        for pair, full_grad in pairs:
            model, main = pair.model, pair.main
            grad = None if full_grad is None else _part_of(full_grad, pair.part)
            if grad is None:
                if self.decoupled_grad_dtype is not None:
                    setattr(main, "decoupled_grad", None)
                continue
            if self.decoupled_grad_dtype is not None:
                decoupled = grad.to(self.decoupled_grad_dtype, copy=True)
                setattr(main, "decoupled_grad", decoupled)  # read by the precision-aware Adam
                main_grads.append(decoupled)
                model.grad = None
            elif pair.aliased:
                main.grad = grad  # fp32: in place (main_grad is aliased, as Megatron does)
                main_grads.append(grad)
            else:
                main.grad = grad.float()
                main_grads.append(main.grad)
                model.grad = None  # the low-precision copy is no longer needed
        return main_grads

    def _unscale_and_check(self, grads: list[torch.Tensor]) -> tuple[bool, torch.Tensor | None]:
        """Find inf/NaN; returns ``(found_inf, global norm or None)``.

        With a scaler: unscale by ``inv_scale`` and check in one foreach pass. Without one there
        is nothing to unscale, so one read pass computes the global norm (reused for clipping)
        and a non-finite norm means an inf/NaN gradient (or a norm beyond fp32's range).
        """
        if not grads and self.process_group is None:
            return False, None
        if self.grad_scaler is None:
            norm = self._grad_norm(grads)
            return not bool(torch.isfinite(norm).item()), norm
        self._found_inf.zero_()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(_local(grad))
        for same_dtype in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, self._found_inf, self.grad_scaler.inv_scale)
        self._all_reduce(self._found_inf, dist.ReduceOp.MAX)  # one rank's inf skips every rank
        return bool(self._found_inf.item() > 0), None

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        if self.process_group is not None:
            dist.all_reduce(tensor, op=op, group=self.process_group)

    def _grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm over every rank's gradients (each rank holding its own share)."""
        if self.process_group is None:
            return _global_norm(grads)
        local = [_local(g) for g in grads]
        squared = (_global_norm(local).double() ** 2) if local else torch.zeros((), dtype=torch.float64, device=self._one.device)
        self._all_reduce(squared, dist.ReduceOp.SUM)
        return squared.sqrt().float()

    def _clip(self, grads: list[torch.Tensor], norm: torch.Tensor | None) -> float:
        """Scale by ``clip_grad / (norm + 1e-6)`` where that is below 1 (Megatron's rule)."""
        total = norm if norm is not None else self._grad_norm(grads)
        coefficient = torch.clamp(self.config.clip_grad / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_([_local(g) for g in grads], coefficient)
        return float(total)

    @torch.no_grad()
    def _copy_main_params_to_model_params(self) -> None:
        for pair in self._pairs():
            if not pair.aliased:
                pair.model_part.copy_(pair.main)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:  # type: ignore[override]
        """One optimizer step; skipped (nothing changes) when a gradient is inf or NaN.

        Args:
            closure: Optional; re-evaluates the model (run with gradients enabled first).

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``: ``(False, None, None)`` on a
            skipped step; the norm is computed when ``clip_grad > 0`` (else ``None``), zeros are
            counted when ``log_num_zeros_in_grad`` (else ``None``).

        Raises:
            ValueError: A gradient is sparse, or missing ``main_grad`` (nothing changes).
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        with self._timed("optimizer-copy-to-main-grad"):
            grads = self._copy_model_grads_to_main_grads()
        with self._timed("optimizer-unscale-and-check-inf"):
            found_inf, norm = self._unscale_and_check(grads)
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf)
        if found_inf:
            return False, None, None
        grad_norm: float | None = None
        if self.config.clip_grad > 0.0 and (grads or self.process_group is not None):
            with self._timed("optimizer-clip-main-grad"):
                grad_norm = self._clip(grads, norm)
        num_zeros: int | None = None
        if self.config.log_num_zeros_in_grad:
            with self._timed("optimizer-count-zeros"):
                num_zeros = self._count_zeros(grads)
        with self._timed("optimizer-inner-step"):
            for opt in self.optimizers:
                opt.step()
        with self._timed("optimizer-copy-main-to-model-params"):
            self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros

    def _count_zeros(self, grads: list[torch.Tensor]) -> int:
        local = [_local(g) for g in grads]
        zeros = torch.tensor(
            [sum(g.numel() for g in local) - int(sum(torch.count_nonzero(g) for g in local) if local else 0)],
            dtype=torch.int64, device=self._one.device,
        )  # fmt: skip
        self._all_reduce(zeros, dist.ReduceOp.SUM)
        return int(zeros.item())

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear model grads and main grads (and ``main_grad`` buffers)."""
        super().zero_grad(set_to_none)
        for pair in self._pairs():
            model, main = pair.model, pair.main
            if not pair.aliased:
                model.grad = None if set_to_none else (model.grad.zero_() if model.grad is not None else None)
            main_grad = getattr(model, "main_grad", None) if self.params_have_main_grad else None
            if main_grad is not None:
                main_grad.zero_()
            if self.decoupled_grad_dtype is not None:
                setattr(main, "decoupled_grad", None)


    # ---- state dict ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Groups and per-parameter state, keyed by parameter names (not positions).

        Tensors are the live ones, as in torch; ``torch.save`` (or a deep copy) snapshots them.
        """
        groups, state = [], {}
        for group in self.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
            for name, param in zip(group["param_names"], group["params"]):
                if self.state.get(param):
                    state[name] = self.state[param]
        return {
            "format": STATE_DICT_FORMAT,
            "state": state,
            "param_groups": groups,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            # fp32 main copies of 16-bit params: the model's bf16/fp16 weights cannot restore them.
            "main_params": {pair.name: pair.main for pair in self._pairs() if not pair.aliased},
        }

    def _name_index(self) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, int]]:
        params: dict[str, torch.Tensor] = {}
        canonical: dict[str, str] = {}
        group_of: dict[str, int] = {}
        for index, group in enumerate(self.param_groups):
            for name, param in zip(group["param_names"], group["params"]):
                params[name] = param
                group_of[name] = index
                for alias in self.aliases.get(name, (name,)):
                    canonical[alias] = name
        return params, canonical, group_of

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore groups' hyperparameters and state, matching parameters by name.

        Everything is checked before anything changes: a name that exists on one side only,
        a group whose members differ, or a group that changed optimizer is a ``ValueError``
        naming both sides, and the optimizer is left as it was.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_DICT_FORMAT:
            got = state_dict.get("format") if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(
                f"`state_dict`: not an optzoo optimizer state dict; got format {got!r}; "
                f"expected {STATE_DICT_FORMAT!r} (from get_optimizer(...).state_dict())"
            )
        params, canonical, group_of = self._name_index()

        def resolve(name: str) -> str | None:
            return canonical.get(name)

        saved_groups = state_dict["param_groups"]
        saved_names = [n for g in saved_groups for n in g["param_names"]]
        missing = sorted(set(params) - {resolve(n) for n in saved_names})
        unknown = [n for n in saved_names if resolve(n) is None]
        if missing or unknown:
            raise ValueError(
                "`state_dict`: parameter names do not match this model; "
                f"got names only in the checkpoint: [{_shorten(unknown)}]; "
                f"expected also: [{_shorten(missing)}] (only in this model)"
            )
        matched: list[tuple[dict[str, Any], Mapping[str, Any]]] = []
        for saved in saved_groups:
            names = [resolve(n) for n in saved["param_names"]]
            index = group_of[names[0]]  # type: ignore[index]
            group = self.param_groups[index]
            if set(names) != set(group["param_names"]):
                raise ValueError(
                    f"`state_dict`: param group #{index} differs from the checkpoint's; got "
                    f"[{_shorten(saved['param_names'])}]; expected [{_shorten(group['param_names'])}] "
                    "(was the routing changed?)"
                )
            if saved.get("optimizer") != group["optimizer"]:
                raise ValueError(
                    f"`state_dict`: param group #{index} ({group['param_names'][0]}, ...) uses "
                    f"optimizer {group['optimizer']!r}; got {saved.get('optimizer')!r} in the "
                    f"checkpoint; expected the same optimizer"
                )
            matched.append((group, saved))

        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        for name, values in state_dict["state"].items():
            primary = resolve(name)
            if primary is None:
                raise ValueError(
                    f"`state_dict`: state for unknown parameter; got {name!r}; "
                    f"expected one of [{_shorten(sorted(params))}]"
                )
            param = params[primary]
            group = self.param_groups[group_of[primary]]
            new_state[param] = {key: _load_value(param, key, v, group) for key, v in values.items()}

        main_of = {pair.name: pair.main for pair in self._pairs() if not pair.aliased}
        saved_mains = {resolve(n) or n: v for n, v in (state_dict.get("main_params") or {}).items()}
        if set(saved_mains) != set(main_of):
            raise ValueError(
                "`state_dict`: fp32 main params do not match this optimizer's; got "
                f"[{_shorten(sorted(saved_mains))}]; expected [{_shorten(sorted(main_of))}] "
                "(was the checkpoint saved with another fp16/bf16 setting?)"
            )
        for name, main in main_of.items():
            if saved_mains[name].shape != main.shape:
                raise ValueError(
                    f"`{name}`: fp32 main param shape differs from the checkpoint's; got "
                    f"{tuple(saved_mains[name].shape)}; expected {tuple(main.shape)}"
                )
        scaler_state = state_dict.get("grad_scaler")
        if (scaler_state is None) != (self.grad_scaler is None):
            raise ValueError(
                f"`state_dict`: grad scaler state is {'absent' if scaler_state is None else 'present'}; "
                f"got {scaler_state!r}; expected {'one' if self.grad_scaler is not None else 'none'} "
                "(was the checkpoint saved with another fp16/bf16/loss_scale setting?)"
            )

        for group, saved in matched:
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = copy.deepcopy(value)
        self.state.clear()
        self.state.update(new_state)
        with torch.no_grad():
            for name, main in main_of.items():
                main.copy_(saved_mains[name])
        if self.grad_scaler is not None and scaler_state is not None:
            self.grad_scaler.load_state_dict(scaler_state)


class FP32Optimizer(MixedPrecisionOptimizer):
    """fp32 model: the main params are the model params (Megatron-Core's ``FP32Optimizer``).

    Unlike Megatron-Core, inf/NaN gradients are still detected and the step skipped.
    """


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """fp16 or bf16 model: the inner optimizers step fp32 main copies of the 16-bit params."""


ChainedOptimizer = MixedPrecisionOptimizer
"""What :func:`get_optimizer` returns, whatever the precision (the base of both wrappers)."""


def _global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over every gradient, accumulated in fp32 (fp64 for fp64 grads)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(torch.promote_types(grad.dtype, torch.float32), []).append(grad)
    norms = [
        norm.to(device=grads[0].device, dtype=torch.float64 if torch.float64 in by_dtype else torch.float32)
        for dtype, same in by_dtype.items()
        for norm in torch._foreach_norm(same, 2, dtype=dtype)
    ]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms))
    return total


def _load_value(param: torch.Tensor, key: str, value: Any, group: Mapping[str, Any]) -> Any:
    """Copy one state entry onto ``param``'s device (``step`` placed as torch places it)."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device, copy=True)
        return value.clone()
    # Kept in its saved dtype: precision-aware state (bf16 moments, int16 remainders) differs
    # from the parameter's dtype on purpose.
    return value.to(device=param.device, copy=True)
