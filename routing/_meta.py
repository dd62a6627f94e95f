"""Running a forward on the meta device: shapes without values, stand-ins where values decide, and the module left as it was.

Meta tensors hold no values, so an op whose result depends on them gets a stand-in answer:
``nonzero`` (and a boolean mask used as an index) finds every element, ``unique`` finds one value,
``.item()`` is ``1`` or ``1.0``, and a condition is ``False`` (or, on a second try, ``True``: a
check such as ``assert x.isnan().sum() == 0`` needs it). Small integer tensors whose values are known (what
``arange`` and the stand-in ``nonzero`` make, and what is computed from them alone) keep real
values beside their meta tensor (:class:`KnownValues`), so a loop over the experts a ``nonzero``
found visits each of them, by its own index (``self[f"expert_{i}"]`` and ``int(i)`` included).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["KnownValues", "run_on_meta", "to_meta", "untouched", "without_fsdp_hooks"]

_aten = torch.ops.aten

KNOWN_VALUES_LIMIT = 1 << 16
"""The most elements a tensor whose values are kept may have (index tensors are small)."""


def to_meta(value: Any) -> Any:
    """A tensor the model holds outside its parameters and buffers (a constant made in ``__init__``), on meta."""
    if isinstance(value, torch.Tensor) and value.device.type != "meta" and not isinstance(value, nn.Parameter):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


class KnownValues:
    """Real values kept beside small integer meta tensors made from values the trace knows."""

    def __init__(self, *, truth: bool = False) -> None:
        self.values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, its values)
        self.truth = truth  # the stand-in answer of a condition whose value is not known

    def get(self, tensor: Any) -> torch.Tensor | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        entry = self.values.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def keep(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        if values.numel() <= KNOWN_VALUES_LIMIT and tuple(values.shape) == tuple(tensor.shape):
            self.values[id(tensor)] = (tensor, values)

    def compute(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Keep the values of ``out`` when every tensor ``func`` read has known values."""
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if func in _MAKES_VALUES:
            if not isinstance(out, torch.Tensor) or out.numel() > KNOWN_VALUES_LIMIT:
                return
            self.keep(out, func(*args, **{**kwargs, "device": "cpu"}))
            return
        if not tensors or any(self.get(x) is None for x in tensors):
            return
        replaced_args, replaced_kwargs = tree_map(lambda x: self.get(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        if "device" in replaced_kwargs:
            replaced_kwargs["device"] = "cpu"
        try:
            real = func(*replaced_args, **replaced_kwargs)
        except Exception:  # an op the values do not allow: they stay unknown
            return
        for meta_out, real_out in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(meta_out, torch.Tensor) and isinstance(real_out, torch.Tensor):
                self.keep(meta_out, real_out)

    def nonzero(self, tensor: torch.Tensor) -> torch.Tensor:
        """The stand-in ``nonzero``: every element's coordinates, row-major, with their values kept."""
        out = torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device="meta")
        if tensor.numel() <= KNOWN_VALUES_LIMIT:
            grids = torch.meshgrid(*[torch.arange(size) for size in tensor.shape], indexing="ij") if tensor.dim() else []
            self.keep(out, torch.stack([g.reshape(-1) for g in grids], dim=-1) if grids else torch.zeros(1, 0, dtype=torch.long))
        return out

    @contextmanager
    def readable(self) -> Iterator[None]:
        """``format``, ``tolist`` and ``__index__`` read a meta tensor's known values (Python calls
        them without dispatching an op): ``f"expert_{i}"`` then names the expert it is."""
        cls = torch.Tensor
        original_format, original_tolist = cls.__format__, cls.tolist

        def fmt(tensor: torch.Tensor, spec: str) -> str:
            values = self.get(tensor) if tensor.device.type == "meta" else None
            if values is not None and values.dim() == 0:
                with _disable_current_modes():  # read the real values, not through the trace
                    return format(values.item(), spec)
            return original_format(tensor, spec)  # type: ignore[no-any-return, no-untyped-call]

        def tolist(tensor: torch.Tensor) -> Any:
            values = self.get(tensor) if tensor.device.type == "meta" else None
            if values is None:
                return original_tolist(tensor)
            with _disable_current_modes():
                return values.tolist()

        cls.__format__ = fmt  # type: ignore[method-assign]
        cls.tolist = tolist  # type: ignore[method-assign, assignment]
        try:
            yield
        finally:
            cls.__format__ = original_format  # type: ignore[method-assign]
            cls.tolist = original_tolist  # type: ignore[method-assign]


_MAKES_VALUES = {_aten.arange.default, _aten.arange.start, _aten.arange.start_step}


def _item_stand_in(tensor: torch.Tensor, truth: bool) -> bool | int | float:
    if tensor.dtype == torch.bool:
        return truth
    return 1 if not tensor.is_floating_point() and not tensor.is_complex() else 1.0


def _index_without_masks(indices: list[Any], known: KnownValues) -> list[Any]:
    """Indices with each boolean mask replaced by the coordinates of every element (the stand-in ``nonzero``)."""
    replaced: list[Any] = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            coordinates = known.nonzero(index)
            replaced.extend(coordinates.unbind(-1) if index.dim() else [coordinates.new_zeros(0)])
        else:
            replaced.append(index)
    return replaced


def run_on_meta(func: Any, args: Any, kwargs: dict[str, Any], known: KnownValues) -> Any:
    """Run ``func`` on meta tensors, with stand-in answers where the answer needs values."""
    if func is _aten._local_scalar_dense.default:
        values = known.get(args[0])
        return values.item() if values is not None else _item_stand_in(args[0], known.truth)
    if func is _aten.is_nonzero.default:
        values = known.get(args[0])
        return bool(values.item()) if values is not None else known.truth
    if func is _aten.nonzero.default:
        return known.nonzero(args[0])
    if func in (_aten.index.Tensor, _aten._unsafe_index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        indices = list(args[1])
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return func(args[0], _index_without_masks(indices, known), *args[2:], **kwargs)
    if func is _aten.masked_select.default:
        shape = torch.broadcast_shapes(args[0].shape, args[1].shape)  # type: ignore[no-untyped-call]
        return torch.empty(math.prod(shape), dtype=args[0].dtype, device="meta")
    if func in (_aten._assert_async.default, _aten._assert_async.msg, _aten._assert_scalar.default):
        return None
    if func is _aten.equal.default:
        return args[0].shape == args[1].shape
    if func is _aten._grouped_mm.default:
        return _grouped_mm_meta(*args, **kwargs)
    if func is _aten.bincount.default:
        minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
        return torch.empty(max(int(minlength), 1), dtype=torch.long, device="meta")
    if func is _aten.repeat_interleave.Tensor:
        return torch.empty(args[0].numel(), dtype=args[0].dtype, device="meta")
    if func in (_aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default):
        tensor = args[0]  # one distinct value: "every sequence has as many eos tokens" holds
        return (
            torch.empty(1, dtype=tensor.dtype, device="meta"),
            torch.empty(tensor.shape, dtype=torch.long, device="meta"),
            torch.empty(1, dtype=torch.long, device="meta"),
        )
    return func(*args, **kwargs)


def _grouped_mm_meta(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: Any = None, out_dtype: Any = None) -> torch.Tensor:
    """``torch._grouped_mm``'s result shape (its meta kernel checks dtypes the trace does not care about)."""
    dtype = out_dtype or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape: tuple[int, ...] = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 2:
        shape = (a.shape[-2], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    else:
        groups = offs.shape[0] if offs is not None else 1
        shape = (groups, a.shape[0], b.shape[-1])
    return torch.empty(shape, dtype=dtype, device="meta")


# ---- leaving the module as it was ------------------------------------------------------------


@contextmanager
def untouched(module: nn.Module) -> Iterator[None]:
    """Leave every submodule's attributes, hooks and training flags as they were (caches a forward sets too)."""
    saved: list[tuple[nn.Module, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]] = [
        (m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in module.modules()
    ]
    rng = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(rng)
        for mod, attributes, parameters, buffers, modules in saved:
            for name in [n for n in mod.__dict__ if n not in attributes]:
                del mod.__dict__[name]
            for name, value in attributes.items():
                if mod.__dict__.get(name, _MISSING) is not value:
                    mod.__dict__[name] = value
            pairs: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
                (mod._parameters, parameters), (mod._buffers, buffers), (mod._modules, modules),
            )  # fmt: skip
            for current, kept in pairs:
                # by identity: == on tensors compares values (and a meta stand-in cannot be compared)
                if list(current) != list(kept) or any(current[k] is not v for k, v in kept.items()):
                    current.clear()
                    current.update(kept)



_MISSING = object()



@contextmanager
def without_fsdp_hooks(module: nn.Module) -> Iterator[None]:
    """FSDP2's pre-forward would all-gather the real shards over our stand-ins: step around its hooks."""
    removed: list[tuple[dict[int, Any], int, Any]] = []
    for mod in module.modules():
        for hooks in (mod._forward_pre_hooks, mod._forward_hooks):
            for handle_id, hook in list(hooks.items()):
                owner = getattr(hook, "__self__", None) or getattr(getattr(hook, "func", None), "__self__", None)
                if owner is not None and type(owner).__name__ in ("FSDPState", "FSDPParamGroup"):
                    removed.append((hooks, handle_id, hook))
                    del hooks[handle_id]
    try:
        yield
    finally:
        for hooks, handle_id, hook in removed:
            hooks[handle_id] = hook
