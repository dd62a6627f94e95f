"""``ChainedOptimizer``: one ``torch.optim.Optimizer`` over every algorithm the routing chose.

Each algorithm keeps its own torch optimizer over its groups; this object owns the very same
group dicts (in routing order) and one shared ``state`` mapping, so schedulers, ``zero_grad``
and checkpointing see a single optimizer. The step clips by the global gradient norm first.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from optzoo.config import OptimizerConfig

StepResult = tuple[bool, float | None, int | None]
"""``(update_successful, grad_norm, num_zeros_in_grad)``, as Megatron-Core's ``step``."""

STATE_DICT_FORMAT = "optzoo.chained.v1"


def _shorten(items: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")


class ChainedOptimizer(torch.optim.Optimizer):
    """Several torch optimizers behind one ``torch.optim.Optimizer`` face.

    Built by :func:`optzoo.get_optimizer`; ``param_groups`` are the real groups (a scheduler
    that edits ``group["lr"]`` edits what the inner optimizer reads), ``state`` is shared, and
    ``state_dict`` is keyed by parameter names.

    Args:
        optimizers: The inner optimizers; their groups must together be ``param_groups``.
        param_groups: The same group dicts, in routing order; each has ``param_names``.
        config: The model-wide config (clipping, zero counting, timers).
        aliases: Extra names of tied parameters: ``{primary name: (all names)}``.
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        param_groups: list[dict[str, Any]],
        *,
        config: OptimizerConfig,
        aliases: Mapping[str, tuple[str, ...]] | None = None,
    ) -> None:
        inner_ids = sorted(id(g) for opt in optimizers for g in opt.param_groups)
        assert inner_ids == sorted(id(g) for g in param_groups), "groups must be the inner ones"
        self.optimizers = list(optimizers)
        self.config = config
        self.aliases = dict(aliases or {})
        self._building = True
        super().__init__(param_groups, defaults={})
        self._building = False
        for opt in self.optimizers:
            opt.state = self.state  # params are disjoint, so one mapping serves every optimizer

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise TypeError(
                "`ChainedOptimizer.add_param_group`: groups are fixed by routing; got a new group; "
                "expected get_optimizer(...) to be called again with the new parameters"
            )
        super().add_param_group(param_group)

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

    def _grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params, grads = [], []
        for group in self.param_groups:
            for name, param in zip(group["param_names"], group["params"]):
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError(
                        f"`{name}`: sparse gradients are not supported; got a sparse "
                        f"{param.grad.layout} gradient; expected a dense gradient"
                    )
                params.append(param)
                grads.append(param.grad)
        return params, grads

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> StepResult:  # type: ignore[override]
        """Clip by the global norm, then step every inner optimizer.

        Args:
            closure: Optional; re-evaluates the model (run with gradients enabled first).

        Returns:
            ``(True, grad_norm, num_zeros_in_grad)``: the norm is computed when
            ``clip_grad > 0`` (else ``None``), zeros are counted when ``log_num_zeros_in_grad``.

        Raises:
            ValueError: A gradient is sparse (checked before anything changes).
        """
        if closure is not None:
            with torch.enable_grad():
                closure()
        params, grads = self._grads()
        grad_norm: float | None = None
        if self.config.clip_grad > 0.0:
            with self._timed("optimizer-clip-main-grad"):
                # Same coefficient as Megatron-Core: clip_grad / (norm + 1e-6), applied when < 1.
                norm = torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad, foreach=True)
                grad_norm = float(norm)
        num_zeros: int | None = None
        if self.config.log_num_zeros_in_grad:
            with self._timed("optimizer-count-zeros"):
                num_zeros = int(sum(g.numel() for g in grads)) - int(
                    sum(torch.count_nonzero(g) for g in grads) if grads else 0
                )
        with self._timed("optimizer-inner-step"):
            for opt in self.optimizers:
                opt.step()
        return True, grad_norm, num_zeros

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
        return {"format": STATE_DICT_FORMAT, "state": state, "param_groups": groups}

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
                f"`state_dict`: not an optzoo ChainedOptimizer state dict; got format {got!r}; "
                f"expected {STATE_DICT_FORMAT!r} (from ChainedOptimizer.state_dict())"
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

        for group, saved in matched:
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = copy.deepcopy(value)
        self.state.clear()
        self.state.update(new_state)


def _load_value(param: torch.Tensor, key: str, value: Any, group: Mapping[str, Any]) -> Any:
    """Copy one state entry onto ``param``'s device, as torch's own ``load_state_dict`` casts."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device, copy=True)
        return value.clone()
    if value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device, copy=True)
    return value.to(device=param.device, copy=True)
