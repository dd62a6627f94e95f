"""torchtitan: an ``OptimizersContainer`` built by :func:`optzoo.get_optimizer`, one optimizer per model part.

torchtitan's trainer, ``LRSchedulersContainer`` and ``CheckpointManager`` take any
``OptimizersContainer``: they iterate its optimizers (one ``LambdaLR`` each), call ``step``,
``zero_grad`` and the step hooks on the container, and checkpoint it through DCP as a flat dict
keyed ``state.<fqn>.<key>`` and ``param_groups.<fqn>.<key>`` (so pipeline stages and other
meshes reshard it). :class:`OptimizersContainer` keeps that protocol with optzoo's optimizers
inside, so their routing, clipping and inf/NaN skip stay. Its flat dict also carries what
torchtitan's has no place for: fp32 main params of 16-bit params (``state.<fqn>.fp32_main_param``)
and the loss scaler (``grad_scaler.<part>``). Needs ``pip install torchtitan`` (0.3.0).

Example (the model parts are FSDP2-sharded as torchtitan shards them)::

    from optzoo import OptimizerConfig
    from optzoo.torchtitan import OptimizersContainer

    config = OptimizersContainer.Config(optimizer=OptimizerConfig(lr=3e-4, optimizer="muon"))
    optimizers = config.build(model_parts=model_parts)
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=10).build(optimizers=optimizers, training_steps=100)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

try:
    from torchtitan.components.optimizer import OptimizersContainer as _TitanContainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("optzoo.torchtitan needs torchtitan: pip install torchtitan (0.3.0)") from error

from optzoo.config import OptimizerConfig
from optzoo.factory import get_optimizer
from optzoo.wrapper.mixed_precision import MixedPrecisionOptimizer
from optzoo.wrapper.torch_state_dict import MAIN_PARAM_KEY

__all__ = ["OptimizersContainer"]


class OptimizersContainer(_TitanContainer):  # type: ignore[misc]  # torchtitan is untyped
    """torchtitan's ``OptimizersContainer`` protocol over one optzoo optimizer per model part.

    Args:
        config: ``optimizer`` (an :class:`~optzoo.OptimizerConfig`) and ``config_overrides``
            (``{ParamKey: override}``, as :func:`optzoo.get_optimizer` takes them).
        model_parts: The model parts (pipeline stages), each routed on its own.

    ``step()`` returns ``None`` as torchtitan's; each part's optimizer (``optimizers[i]``, or
    iterating the container) keeps what optzoo's ``step`` reports. torchtitan's trainer clips
    gradients itself (``training.max_norm``): set that or ``OptimizerConfig.clip_grad``, not both.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanContainer.Config):  # type: ignore[misc]
        optimizer: OptimizerConfig | None = None
        """optzoo's config for every model part (required)."""
        config_overrides: Mapping[Any, Any] | None = None
        """Routing overrides, as :func:`optzoo.get_optimizer` takes them (``None``: the standard ones)."""

    optimizers: list[MixedPrecisionOptimizer]

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        if not isinstance(config.optimizer, OptimizerConfig):
            raise TypeError(
                f"`OptimizersContainer.Config.optimizer`: needs optzoo's config; got {type(config.optimizer).__name__}; "
                "expected optzoo.OptimizerConfig(...)"
            )
        unused = {"param_groups": [], "implementation": "fused", "optimizer_factory_kwargs_by_name": {}}
        for field, default in unused.items():  # torchtitan's own routing and kernel choice: optzoo makes both
            if getattr(config, field) != default:
                raise ValueError(
                    f"`OptimizersContainer.Config.{field}`: torchtitan's setting, which optzoo's routing replaces; "
                    f"got {getattr(config, field)!r}; expected it unset ({default!r}): route with `config_overrides` "
                    "(optzoo picks the kernel for the device)"
                )
        self.model_parts = list(model_parts)
        self.optimizers = [get_optimizer(config.optimizer, part, config.config_overrides) for part in self.model_parts]
        params = [p for part in self.model_parts for p in part.parameters() if p.requires_grad]
        self._post_init(params)  # torchtitan's: torch's Optimizer init, for the step hooks

    def state_dict(self) -> dict[str, Any]:
        """Every part's state as one flat dict keyed by the model's names, ready for DCP.

        State is made first where there is none yet (one step of zero gradients at lr 0, which
        changes no param), as torchtitan's container does: DCP loads into the tensors this returns.
        """
        flat: dict[str, Any] = {}
        for index, (part, optim) in enumerate(zip(self.model_parts, self.optimizers, strict=True)):
            _init_state(part, optim)
            named = optim.state_dict()
            for name, values in named["state"].items():
                _flatten(values, f"state.{name}", flat)
            for name, main in named["main_params"].items():
                flat[f"state.{name}.{MAIN_PARAM_KEY}"] = main
            for group in named["param_groups"]:
                for name in group["param_names"]:
                    for key, value in group.items():
                        if key != "param_names":
                            flat[f"param_groups.{name}.{key}"] = value
            if named["grad_scaler"] is not None:
                flat[f"grad_scaler.{index}"] = named["grad_scaler"]
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every part from a flat dict of :meth:`state_dict`'s form (each part takes its
        own names; one part's failed checks leave it unchanged, as optzoo's ``load_state_dict``)."""
        for index, (part, optim) in enumerate(zip(self.model_parts, self.optimizers, strict=True)):
            _init_state(part, optim)
            optim.load_state_dict(_unflatten(optim.state_dict(), state_dict, index))


def _flatten(values: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, Mapping):
            _flatten(value, f"{prefix}.{key}", out)
        else:
            out[f"{prefix}.{key}"] = value


def _nested(flat: Mapping[str, Any], prefix: str, like: Any) -> Any:
    """The value saved at ``prefix`` (a nested mapping rebuilt from its dotted keys)."""
    if not isinstance(like, Mapping):
        if prefix not in flat:
            raise ValueError(f"`state_dict`: no `{prefix}` in the checkpoint; got [{', '.join(sorted(flat)[:5])}, ...]; expected the key")
        return flat[prefix]
    return {key: _nested(flat, f"{prefix}.{key}", value) for key, value in like.items()}


def _unflatten(template: Mapping[str, Any], flat: Mapping[str, Any], index: int) -> dict[str, Any]:
    """optzoo's name-keyed state dict of one part, read from the flat dict along its own (``template``)."""
    state = {name: _nested(flat, f"state.{name}", values) for name, values in template["state"].items()}
    mains = {name: _nested(flat, f"state.{name}.{MAIN_PARAM_KEY}", main) for name, main in template["main_params"].items()}
    groups = []
    for group in template["param_groups"]:
        first = group["param_names"][0]
        groups.append({**{k: _nested(flat, f"param_groups.{first}.{k}", v) for k, v in group.items() if k != "param_names"},
                       "param_names": group["param_names"]})  # fmt: skip
    scaler = _nested(flat, f"grad_scaler.{index}", template["grad_scaler"]) if template["grad_scaler"] is not None else None
    return {**template, "state": state, "main_params": mains, "param_groups": groups, "grad_scaler": scaler}


@torch.no_grad()
def _init_state(part: torch.nn.Module, optim: MixedPrecisionOptimizer) -> None:
    """Make the optimizer state (zero gradients, lr 0) where none exists, as torchtitan's
    ``init_optim_state``; over the model's params, whose gradients optzoo reads (its groups
    may hold fp32 copies)."""
    if optim.state:
        return
    params = [p for p in part.parameters() if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optim.param_groups]
    for group in optim.param_groups:
        group["lr"] = 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs, strict=True):
            group["lr"] = lr
        optim.zero_grad(set_to_none=True)
