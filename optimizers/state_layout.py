"""What state an optimizer keeps for one param: its keys, and each one's shape and dtype kind.

A loader checks a checkpoint's state against this before it loads anything
(:func:`check_state`), so a moment of another shape, a key of another algorithm or a missing
moment is refused by name instead of being read out of bounds by a fused kernel at the next step.
A param that has never been stepped has no state; once stepped, it has every key of its layout.

Our optimizers answer ``state_layout(param, group, shape)`` themselves; the layouts of the
torch and emerging-optimizers classes are transcribed here from their ``_init_group`` /
``step`` (torch 2.x ``Adam``/``AdamW``/``SGD``/``Adafactor``/``Muon``, emerging-optimizers 0.3.0
``Lion``/``LaProp``/``SOAP`` (and REKLS)/``ObliqueSGD``/``ObliqueAdam``; PSGD's list-valued factors are not checked).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

__all__ = ["COUNT", "Slot", "StateLayout", "check_state", "per_element", "state_layout_of"]

Kind = Literal["float", "int16", "count"]
"""``float``: a floating (complex for a complex param) tensor, cast on load to the optimizer's
dtype; ``int16``: bf16 master remainders; ``count``: ``step``, a number >= 0 or a one-element tensor."""


@dataclass(frozen=True)
class Slot:
    """One state key's expected value."""

    shape: tuple[int, ...] | None
    """The whole param's shape for per-element state, a square factor's for SOAP, ``None`` for a count."""
    kind: Kind


COUNT = Slot(None, "count")
StateLayout = dict[str, Slot]
LayoutFn = Callable[[torch.optim.Optimizer, torch.Tensor, Mapping[str, Any], tuple[int, ...]], StateLayout]


def per_element(shape: tuple[int, ...], kind: Kind = "float") -> Slot:
    """State with one value per element of the (whole) param."""
    return Slot(tuple(shape), kind)


def _torch_adam(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout:
    layout = {"step": COUNT, "exp_avg": per_element(shape), "exp_avg_sq": per_element(shape)}
    if group.get("amsgrad"):
        layout["max_exp_avg_sq"] = per_element(shape)
    return layout


def _torch_sgd(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout:
    return {"momentum_buffer": per_element(shape)} if group.get("momentum", 0) != 0 else {}  # momentum 0 keeps none


def _lion(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout:
    return {"exp_avg": per_element(shape)}


def _torch_adafactor(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout:
    if len(shape) < 2:  # vectors and scalars keep a full second moment
        return {"step": COUNT, "variance": per_element(shape)}
    *stacked, rows, cols = shape  # a row and a column factor per matrix of the last two dims
    return {"step": COUNT, "row_var": Slot((*stacked, rows, 1), "float"), "col_var": Slot((*stacked, 1, cols), "float")}


def _soap(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout:
    rows, cols = shape  # SOAP takes 2-D params only (the registry's ``place``)
    factors = {"L": (rows, rows), "R": (cols, cols), "Q_L": (rows, rows), "Q_R": (cols, cols)}
    return {"step": COUNT, "exp_avg": per_element(shape), "exp_avg_sq": per_element(shape)} | {
        key: Slot(factor, "float") for key, factor in factors.items()
    }


def state_layout_of(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout | None:
    """The layout of ``param``'s state in ``optimizer`` (``shape``: the whole param's, which a
    sharded or flattened ``param`` may not show), or ``None`` for a class this module does not know."""
    own = getattr(optimizer, "state_layout", None)
    if own is not None:
        layout: StateLayout = own(param, group, shape)
        return layout
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is a subclass
        return _torch_adam(optimizer, param, group, shape)
    if isinstance(optimizer, torch.optim.SGD):
        return _torch_sgd(optimizer, param, group, shape)
    if isinstance(optimizer, torch.optim.Adafactor):
        return _torch_adafactor(optimizer, param, group, shape)
    if isinstance(optimizer, torch.optim.Muon):
        return {"momentum_buffer": per_element(shape)}
    upstream = type(optimizer).__mro__
    names = {(cls.__module__.split(".")[0], cls.__name__) for cls in upstream}
    if ("emerging_optimizers", "Lion") in names:
        return _lion(optimizer, param, group, shape)
    if names & {("emerging_optimizers", "LaProp"), ("emerging_optimizers", "ObliqueAdam")}:
        return {"step": COUNT, "exp_avg": per_element(shape), "exp_avg_sq": per_element(shape)}
    if ("emerging_optimizers", "ObliqueSGD") in names:
        return {"momentum_buffer": per_element(shape)}
    if ("emerging_optimizers", "SOAP") in names:
        return _soap(optimizer, param, group, shape)
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        kind = "a DTensor" if isinstance(value, DTensor) else "a tensor"
        return f"{kind} of shape {tuple(value.shape)}, {value.dtype}, on {value.device.type}"
    return f"{type(value).__name__} {value!r}"[:80]


def check_state(values: Mapping[str, Any], layout: Mapping[str, Slot], *, name: str, complex_param: bool = False) -> None:
    """Raise ``ValueError`` unless ``values`` (one param's saved state) holds exactly ``layout``'s keys
    each of its shape (a DTensor's global one), dtype kind and on a device
    with data (not ``meta``), as a strided tensor. The message names the param and the key.

    A param that was never stepped has no entry at all; an empty entry is refused as a lost one
    (unless the layout is empty too, as SGD's without momentum)."""
    missing = [key for key in layout if key not in values]
    unknown = [key for key in values if key not in layout]
    if missing or unknown:
        raise ValueError(
            f"`{name}`: saved optimizer state has other keys than this optimizer keeps; got {sorted(values)} "
            f"(missing {missing}, unknown {unknown}); expected {sorted(layout)} (was it saved with another "
            "optimizer or other settings?)"
        )
    for key, slot in layout.items():
        value = values[key]
        where = f"`{name}`: state `{key}`"
        if slot.kind == "count":
            if isinstance(value, bool) or not (
                isinstance(value, (int, float))
                or (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.device.type != "meta")
            ):
                raise ValueError(f"{where}: not a step count; got {_describe(value)}; expected a number >= 0 or a one-element tensor")
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: not a tensor; got {_describe(value)}; expected a tensor of shape {slot.shape}")
        if value.device.type == "meta" or value.layout != torch.strided:
            raise ValueError(f"{where}: holds no loadable data; got {_describe(value)} ({value.layout}); expected a dense tensor with values")
        if tuple(value.shape) != slot.shape:
            raise ValueError(f"`{name}`: state `{key}` shape differs; got {tuple(value.shape)} in the checkpoint; expected {slot.shape}")
        if slot.kind == "int16":
            ok, wanted = value.dtype == torch.int16, "torch.int16 (bf16 master remainders)"
        elif complex_param:
            ok, wanted = value.is_complex(), "a complex dtype, as the param's"
        else:
            ok, wanted = value.is_floating_point(), "a floating-point dtype"
        if not ok:
            raise ValueError(f"{where}: dtype kind differs; got {value.dtype}; expected {wanted}")
