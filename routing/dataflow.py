"""Observe one forward: what a model does with each of its parameters.

:func:`observe` runs a module once under a ``TorchDispatchMode``, on meta stand-ins for its
parameters and buffers (no arithmetic, no memory; the module is left exactly as it was), and
follows every parameter through views, copies, casts and reads by index to the ops that use it.
Each parameter gets one :class:`ParamUse` record:

* **as the weight of a matmul-like op** (mm, addmm, bmm, baddbmm, grouped mm, conv): which of its
  dims are contracted against activations, which index the product, and how the op's matrices
  cover it (:class:`~optzoo._common.MatrixView`: the blocks the forward splits it into, experts,
  heads or groups, and whether the data chose them);
* **read by index** (embedding, index, index_select, gather) and used as activations;
* **elementwise with activations**: added (a bias; a table when it varies along two or more
  dims), concatenated or substituted into them (a table), used as the data operand of a
  parametric matmul (a table: latent arrays, probes), or anything else (a gain: mul, exp then
  mul, a norm's weight), and whether it scales another parameter's weight (weight norm's ``g``);
* **where its product goes**: to a model output with no parametric matmul after it (a head), into
  a top-k (a router); and whether it is applied to the raw model input (an input layer).

Activations carry the set of parameters whose matmul product reached them with no parametric
matmul since (their *producers*). A model output that holds no table read or raw input since its
last matmul, and none of whose producers ever fed another matmul, makes its producers heads:
``logits = lm_head(norm(h))`` does, a residual stream returned as ``last_hidden_state`` does not.

Meta tensors hold no values, so ops whose result depends on them get stand-in answers
(:mod:`optzoo.routing._meta`): ``nonzero`` finds every element, so an MoE visits every expert;
code whose control flow needs real values fails, and the caller falls back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .._common import MatrixView
from ._meta import KnownValues, run_on_meta, to_meta, untouched, without_fsdp_hooks
from .layouts import (
    Cover, Layout, broadcast, cover_of, gathered_layout, is_matrix, merge_views, merged_in_stride_order, shadow, split_groups,
)  # fmt: skip

__all__ = ["ParamUse", "TraceError", "observe"]


_aten = torch.ops.aten


class TraceError(RuntimeError):
    """The forward could not be observed (the caller falls back to module types and names)."""


@dataclass
class ParamUse:
    """What one forward did with one parameter (every field empty or False: not used)."""

    weight_ops: set[str] = field(default_factory=set)
    """Matmul-like ops that used it as a weight (its values vary along the contracted dims)."""
    view: MatrixView | None = None
    """How the forward multiplies by it: the matrices all its weight uses cover, merged
    (:func:`merge_views`); ``None`` when a use could not be told or they disagree."""
    covers: list[Cover | None] = field(default_factory=list, repr=False)
    """How each weight use covered it (``None``: could not be told)."""
    conv_groups: set[int] = field(default_factory=set)
    """``groups`` of the convolutions that used it; ``in_channels == groups`` is depthwise."""
    conv_in_per_group: set[int] = field(default_factory=set)
    """Input channels per group of those convolutions (1: depthwise)."""
    blocks_by_data: bool = False
    """The forward chose which of its blocks to multiply by from the data (MoE experts)."""
    lookups: set[str] = field(default_factory=set)
    """Ops that read it by index, the result used as activations (a table)."""
    tables: set[str] = field(default_factory=set)
    """Ops that put its values into the activations: added along two or more dims,
    concatenated, substituted, or as the data operand of a parametric matmul."""
    biases: set[str] = field(default_factory=set)
    """Ops that added it to activations, varying along at most one dim."""
    gains: set[str] = field(default_factory=set)
    """Other elementwise ops with activations (mul, norms, where it is not substituted, ...)."""
    weight_gains: set[str] = field(default_factory=set)
    """Ops that used it to scale or shift another parameter's weight (weight norm's ``g``)."""
    normalizes: bool = False
    """It is the weight or bias of a normalisation op (layer, group, batch, RMS norm)."""
    returned: bool = False
    """Its values (not a product) are a model output."""
    input_layer: bool = False
    """It multiplied the raw float model input (through parameter-free ops at most)."""
    fed_matmul: bool = False
    """Its product reached the data operand of another parametric matmul."""
    head: bool = False
    """Its product is a model output with no parametric matmul after it (see the module docstring)."""
    router: bool = False
    """Its product went into a top-k or argmax (an MoE router)."""

    @property
    def used(self) -> bool:
        return bool(
            self.weight_ops or self.lookups or self.tables or self.biases or self.gains or self.weight_gains or self.returned
        )


@dataclass(frozen=True)
class _Source:
    """A parameter that a tensor is a function of, and where its elements sit in the parameter."""

    key: int
    layout: Layout | None
    gathered: bool = False  # passed through a read by index
    by_data: bool = False  # ... whose index came from the data
    via: str = ""  # the op that read it by index


@dataclass(frozen=True)
class _Flow:
    """What a traced tensor is: a function of parameters (``sources``), of the data, or both."""

    sources: tuple[_Source, ...] = ()
    data: bool = False
    producers: frozenset[int] = frozenset()
    stream: bool = False  # a table read or the raw input reached it with no parametric matmul since
    raw: bool = False  # the float model input, through parameter-free ops


_VALUE_FREE = {torch.bool: False}

_MATMULS = {
    _aten.mm.default: (0, 1), _aten.bmm.default: (0, 1), _aten.mv.default: (0, 1), _aten.dot.default: (0, 1),
    _aten.vdot.default: (0, 1), _aten.addmm.default: (1, 2), _aten.baddbmm.default: (1, 2), _aten.addmv.default: (1, 2),
    _aten._grouped_mm.default: (0, 1),
}  # fmt: skip
"""Matmul-like ops: the positions of their two factors (a bias or an accumulator comes first)."""
_CONVOLUTIONS = {_aten.convolution.default, _aten._convolution.default}
_LOOKUPS = {
    _aten.embedding.default, _aten.index.Tensor, _aten._unsafe_index.Tensor, _aten.index_select.default,
    _aten.gather.default, _aten.take.default, _aten._embedding_bag.default, _aten._embedding_bag_forward_only.default,
}  # fmt: skip
_NORMS = {
    _aten.native_layer_norm.default, _aten.native_group_norm.default, _aten.native_batch_norm.default,
    _aten._native_batch_norm_legit.default, _aten._native_batch_norm_legit.no_stats,
    _aten._native_batch_norm_legit_no_training.default, _aten._fused_rms_norm.default,
}  # fmt: skip
_ADDS = {"add", "add_", "sub", "sub_", "rsub", "_foreach_add"}
_SUBSTITUTES = {"where", "masked_fill", "masked_fill_", "index_put", "index_put_", "masked_scatter", "masked_scatter_",
                "cat", "stack", "scatter", "scatter_", "index_copy", "index_copy_", "copy_", "slice_scatter", "select_scatter"}  # fmt: skip
_ROUTING = {_aten.topk.default, _aten.argmax.default}
_ELEMENTWISE_OF_PARAMS = {_aten._weight_norm_interface.default}
_VIEW_COPIES = {_aten._unsafe_view.default, _aten.view_copy.default, _aten.permute_copy.default, _aten.t_copy.default}
"""Ops that copy but lay elements out as a view would (``reshape`` of a copy is ``_unsafe_view``)."""
"""Ops that are elementwise in their first result though not tagged so: weight norm's ``g * v / |v|``."""


def _name(func: Any) -> str:
    name: str = func.overloadpacket.__name__
    return name


class _Observer(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Propagates :class:`_Flow` through every op of the forward and fills the :class:`ParamUse` records."""

    def __init__(self, params: Sequence[torch.Tensor], *, truth: bool = False) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.shapes = [tuple(param.shape) for param in params]
        self.uses = [ParamUse() for _ in params]
        self.flows: dict[int, tuple[_Flow, torch.Tensor]] = {}
        self.roots: dict[int, torch.Tensor] = {}  # a view's base, so an in-place write reaches it
        self.known = KnownValues(truth=truth)

    # ---- bookkeeping ------------------------------------------------------------------------

    def flow(self, tensor: Any) -> _Flow | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        entry = self.flows.get(id(tensor))
        return entry[0] if entry is not None and entry[1] is tensor else None

    def set_flow(self, tensor: torch.Tensor, flow: _Flow) -> None:
        self.flows[id(tensor)] = (flow, tensor)

    def mark(self, tensor: torch.Tensor, flow: _Flow) -> None:
        """Give a leaf (a parameter stand-in or a model input) its flow."""
        self.set_flow(tensor, flow)

    # ---- the dispatch -----------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        args, kwargs = tree_map(to_meta, (args, kwargs))
        out = run_on_meta(func, args, kwargs, self.known)
        self.known.compute(func, args, kwargs, out)
        flat_in = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        flows = [self.flow(x) for x in flat_in]
        if any(flows):
            self.propagate(func, args, kwargs, out, flat_in, flows)
        return out

    def propagate(
        self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, flat_in: list[torch.Tensor], flows: list[_Flow | None]
    ) -> None:
        outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if func in _ROUTING:
            for flow in flows:
                for key in flow.producers if flow else ():
                    self.uses[key].router = True
        if (getattr(func, "is_view", False) or func in _VIEW_COPIES) and isinstance(args[0], torch.Tensor):
            self.view(func, args, kwargs, outputs)
            return
        if func in (_aten.clone.default, _aten._to_copy.default, _aten.lift_fresh_copy.default, _aten.contiguous.default):
            flow = self.flow(args[0])
            if flow is not None and outputs:
                self.set_flow(outputs[0], flow)
            return
        if func in _MATMULS or func in _CONVOLUTIONS:
            flow = self.matmul(func, args, outputs[0])
        elif func in _LOOKUPS and self.flow(args[0]) is not None and self.flow(args[0]).sources:  # type: ignore[union-attr]
            flow = self.lookup(func, args, outputs[0])
        else:
            flow = self.combine(func, args, flat_in, flows, outputs)
        if flow is None:
            return
        mutated = self.mutated(func, args, kwargs)
        targets = outputs if mutated is None else [mutated]
        for target in targets:
            if mutated is not None:
                flow = _merge(flow, self.flow(target))
                root = self.roots.get(id(target))
                if root is not None:
                    self.set_flow(root, _merge(flow, self.flow(root)))
            self.set_flow(target, flow)

    @staticmethod
    def mutated(func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
        if "out" in kwargs and isinstance(kwargs["out"], torch.Tensor):
            out: torch.Tensor = kwargs["out"]
            return out
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            first: torch.Tensor = args[0]
            return first
        return None

    def view(self, func: Any, args: Any, kwargs: dict[str, Any], outputs: list[torch.Tensor]) -> None:
        """A view: same flow; each source's layout is the op replayed on a stand-in laid out as it."""
        base = args[0]
        flow = self.flow(base)
        root = self.roots.get(id(base), base)
        for tensor in outputs:
            self.roots[id(tensor)] = root
        if flow is None:
            return
        replayed: list[list[Layout | None]] = [[None] * len(outputs) for _ in flow.sources]
        for index, source in enumerate(flow.sources):
            if source.layout is None or tuple(source.layout[0]) != tuple(base.shape):
                continue
            shadow_view = shadow(source.layout, base)
            try:
                result = func(shadow_view, *args[1:], **kwargs)
            except Exception:  # a view the copy's layout does not allow
                result = merged_in_stride_order(func, source.layout, base, args, kwargs)
                if result is None:
                    continue  # the layout is lost
            results = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
            replayed[index] = [(tuple(r.shape), tuple(r.stride()), int(r.storage_offset())) for r in results]
        for position, tensor in enumerate(outputs):
            sources = tuple(
                _Source(s.key, replayed[i][position] if position < len(replayed[i]) else None, s.gathered, s.by_data, s.via)
                for i, s in enumerate(flow.sources)
            )
            self.set_flow(tensor, _Flow(sources, flow.data, flow.producers, flow.stream, flow.raw))

    def lookup(self, func: Any, args: Any, out: torch.Tensor) -> _Flow:
        """A read by index of a parameter: a table lookup, or a choice of blocks.

        Rows picked by an index that a parameter's product decided (a router's top-k) are a choice
        of blocks (experts), as are rows picked by a scalar index; rows picked by the model's
        input ids or positions are a table lookup, whatever op does the reading.
        """
        table = self.flow(args[0])
        assert table is not None
        indices = [x for x in tree_flatten(args[1:])[0] if isinstance(x, torch.Tensor)]
        index_flows = [self.flow(x) for x in indices]
        by_data = any(f is not None and f.data for f in index_flows)
        routed = any(f is not None and f.producers for f in index_flows)
        scalar = bool(indices) and all(x.dim() == 0 for x in indices)
        gathered = not (routed or scalar)
        sources = tuple(
            _Source(
                s.key, gathered_layout(func, args, s.layout, out), s.gathered or gathered,
                s.by_data or (by_data and not gathered), s.via or (_name(func) if gathered else ""),
            )  # fmt: skip
            for s in table.sources
        )
        producers = table.producers.union(*(f.producers for f in index_flows if f is not None))
        return _Flow(sources, table.data or by_data, producers, table.stream, table.raw)

    def matmul(self, func: Any, args: Any, out: torch.Tensor) -> _Flow | None:
        """A matmul-like op: find the weight (the factor made of parameters) and the data factor."""
        first, second = (0, 1) if func in _CONVOLUTIONS else _MATMULS[func]
        a, b = args[first], args[second]
        fa, fb = self.flow(a), self.flow(b)
        if func in _CONVOLUTIONS:
            weight_at, data_at = 1, 0  # convolution(input, weight, ...)
        elif fb is not None and fb.sources and not (fa is not None and fa.sources and fa.data is False and fb.data):
            weight_at, data_at = 1, 0  # x @ W, F.linear's x @ W.t(), and a parameter product's right factor
        elif fa is not None and fa.sources:
            weight_at, data_at = 0, 1  # W @ x
        else:
            weight_at = data_at = -1
        extra = [self.flow(args[0])] if func in (_aten.addmm.default, _aten.baddbmm.default, _aten.addmv.default) else []
        if func in _CONVOLUTIONS and len(args) > 2 and isinstance(args[2], torch.Tensor):
            extra.append(self.flow(args[2]))
            self.uses_of(self.flow(args[2]), "biases", func, operand=args[2])
        elif extra:
            self.uses_of(extra[0], "biases", func, operand=args[0])
        factors = [(a, fa), (b, fb)] if func not in _CONVOLUTIONS else [(args[0], self.flow(args[0])), (args[1], self.flow(args[1]))]
        if weight_at < 0:  # activations times activations (attention scores): no parameter's matmul
            return _merge_all([f for _, f in factors] + extra)
        weight, wflow = factors[weight_at]
        data, dflow = factors[data_at]
        assert wflow is not None
        # A constant factor (sinusoidal positions projected by XLNet's r) still makes the parameter a
        # matrix; its product is a constant that carries the parameter as its producer.
        dflow = dflow or _Flow()
        if dflow.sources:
            self.uses_of(dflow, "tables", func, operand=data)  # latent arrays, probes; a read row
        for key in dflow.producers:
            self.uses[key].fed_matmul = True
        products: set[int] = set()
        roles = _weight_dim_roles(func, args, weight)
        groups = int(args[8]) if func in _CONVOLUTIONS and len(args) > 8 else 1
        for source in wflow.sources:
            use = self.uses[source.key]
            layout, dim_roles = source.layout, roles
            if layout is not None and roles is not None and groups > 1:
                layout, dim_roles = split_groups(layout, roles, groups, transposed=bool(args[6]))
            cover = None if layout is None or dim_roles is None else cover_of(layout, dim_roles, self.shapes[source.key])
            if source.layout is not None and roles is not None and not is_matrix(source.layout, roles):
                use.weight_gains.add(_name(func))  # g of weight norm: a scale of the weight, not a matrix
                continue
            use.weight_ops.add(_name(func))
            use.covers.append(cover)
            use.blocks_by_data |= source.by_data
            if func in _CONVOLUTIONS:
                use.conv_groups.add(groups)
                use.conv_in_per_group.add(int(weight.shape[0 if args[6] else 1]) if weight.dim() > 1 else 1)
            if dflow.raw:
                use.input_layer = True
            products.add(source.key)
        if func is _aten._grouped_mm.default and len(args) > 2 and self.flow(args[2]) is not None:
            for key in products:
                self.uses[key].blocks_by_data |= bool(self.flow(args[2]).data)  # type: ignore[union-attr]
        extras = _merge_all([f for f in extra if f is not None])
        return _Flow(
            (), dflow.data or wflow.data, frozenset(products) | (extras.producers if extras else frozenset()),
            bool(extras and extras.stream), False,
        )  # fmt: skip

    def combine(
        self, func: Any, args: Any, flat_in: list[torch.Tensor], flows: list[_Flow | None], outputs: list[torch.Tensor]
    ) -> _Flow | None:
        """Any other op: parameters that meet the data here are used elementwise (or as a table)."""
        present = [(x, f) for x, f in zip(flat_in, flows) if f is not None]
        if func in _NORMS:  # a norm's weight and bias are its gains, whatever it normalises
            for tensor, flow in present:
                if tensor is not args[0] and flow.sources:
                    self.uses_of(flow, "gains", func, operand=tensor)
                    for source in flow.sources:
                        self.uses[source.key].normalizes = True
            present = [(x, f) for x, f in present if x is args[0]]
            if not present:
                return None
        data = any(f.data for _, f in present)
        producers = frozenset().union(*(f.producers for _, f in present))
        if not data:
            if not outputs:
                return None
            out = outputs[0]
            pointwise = torch.Tag.pointwise in func.tags or func in _ELEMENTWISE_OF_PARAMS
            sources = _dedupe(
                _Source(s.key, broadcast(s.layout, x, out) if pointwise else None, s.gathered, s.by_data, s.via)
                for x, f in present
                for s in f.sources
            )
            return _Flow(sources, False, producers, any(f.stream for _, f in present), any(f.raw for _, f in present))
        name = _name(func)
        table = False
        for tensor, flow in present:
            if not flow.sources:
                continue
            if any(source.gathered for source in flow.sources):
                self.uses_of(flow, "lookups", func, operand=tensor)
                table = True
            elif name in _SUBSTITUTES and not _is_selector(func, args, tensor):
                self.uses_of(flow, "tables", func, operand=tensor)
                table = True
            elif name in _ADDS:
                kind = "tables" if _varying_dims(flow, tensor) >= 2 else "biases"
                self.uses_of(flow, kind, func, operand=tensor)
                table |= kind == "tables"
            else:
                self.uses_of(flow, "gains", func, operand=tensor)
        stream = table or any(f.stream or f.raw for _, f in present if f.data)
        # Still the raw input: parameter-free ops (a norm's too) on nothing but the raw input.
        raw = (func in _NORMS or not any(f.sources for _, f in present)) and all(f.raw for _, f in present if f.data)
        return _Flow((), True, producers, stream, raw)

    def uses_of(self, flow: _Flow | None, kind: str, func: Any, *, operand: torch.Tensor) -> None:
        """Record ``kind`` for every parameter ``flow`` is a function of (lookups for rows read by index)."""
        if flow is None:
            return
        for source in flow.sources:
            use = self.uses[source.key]
            if source.gathered and kind != "gains":
                use.lookups.add(source.via or _name(func))
            else:
                getattr(use, kind).add(_name(func))
            use.blocks_by_data |= source.by_data


def _dedupe(sources: Iterable[_Source]) -> tuple[_Source, ...]:
    """One source per parameter, the first with a layout (``v / v.norm()`` keeps ``v``'s layout)."""
    kept: dict[int, _Source] = {}
    for source in sources:
        if source.key not in kept or (kept[source.key].layout is None and source.layout is not None):
            kept[source.key] = source
    return tuple(kept.values())


def _merge(a: _Flow, b: _Flow | None) -> _Flow:
    if b is None:
        return a
    return _Flow(
        a.sources + tuple(s for s in b.sources if s not in a.sources), a.data or b.data, a.producers | b.producers,
        a.stream or b.stream, a.raw or b.raw,
    )  # fmt: skip


def _merge_all(flows: Sequence[_Flow | None]) -> _Flow | None:
    present = [f for f in flows if f is not None]
    if not present:
        return None
    merged = present[0]
    for flow in present[1:]:
        merged = _merge(merged, flow)
    return _Flow((), merged.data, merged.producers, merged.stream, False) if merged.data else merged


_SELECTOR_ARGS = {"where": 0, "masked_fill": 1, "masked_fill_": 1, "masked_scatter": 1, "masked_scatter_": 1,
                  "index_put": 1, "index_put_": 1, "scatter": 2, "scatter_": 2, "index_copy": 2, "index_copy_": 2}  # fmt: skip
"""Where a substituting op takes what decides (a condition, a mask, indices), not what is put in."""


def _is_selector(func: Any, args: Any, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is what decides in a substituting op (``where``'s condition, a fill mask)."""
    position = _SELECTOR_ARGS.get(_name(func))
    if position is None or position >= len(args):
        return False
    chosen = args[position]
    return chosen is tensor or (isinstance(chosen, (list, tuple)) and any(x is tensor for x in chosen))


def _varying_dims(flow: _Flow, tensor: torch.Tensor) -> int:
    """How many dims of ``tensor`` its parameters vary along (a bias: at most one)."""
    best = 0
    for source in flow.sources:
        if source.layout is None:
            best = max(best, sum(1 for size in tensor.shape if size > 1))
        else:
            sizes, strides, _ = source.layout
            best = max(best, sum(1 for size, stride in zip(sizes, strides) if size > 1 and stride != 0))
    return best


def _weight_dim_roles(func: Any, args: Any, weight: torch.Tensor) -> tuple[str, ...] | None:
    """Per dim of the weight factor: ``out``, ``in`` or ``block`` (batched over)."""
    ndim = weight.dim()
    if func in _CONVOLUTIONS:
        transposed = bool(args[6])
        return ("in", "out", *["in"] * (ndim - 2)) if transposed else ("out", *["in"] * (ndim - 1))
    position = 1 if args[_MATMULS[func][1]] is weight else 0
    if ndim == 1:
        return ("in",)
    if ndim == 2 and func is _aten._grouped_mm.default and position == 0:
        return ("out", "in")
    if ndim == 2 and func is _aten._grouped_mm.default:
        return ("in", "out")
    matrix = ("in", "out") if position == 1 else ("out", "in")
    return ("block",) * (ndim - 2) + matrix


# ---- running the forward ------------------------------------------------------------------------


def _unique_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters())  # remove_duplicate: one name per tensor (functional_call ties the rest)




def observe(
    module: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    call: Callable[..., Any] | None = None,
    truth: bool = False,
) -> dict[int, ParamUse]:
    """What one forward of ``module`` on ``(args, kwargs)`` does with each parameter, by ``id(param)``.

    The parameters and buffers are swapped for meta stand-ins for the call (as
    ``torch.func.functional_call`` does), the inputs are copied to meta, and the module's attributes,
    hooks, training flag and the RNG state are left as they were. Tied parameters are one tensor.

    Args:
        module: The module to run.
        args, kwargs: Its inputs (tensors on any device: only their shapes and dtypes are used).
        call: Calls the module (default ``module(*args, **kwargs)``), e.g. to run a wrapper's inner module.
        truth: The stand-in answer of a condition on values the meta device does not have.

    Raises:
        TraceError: The forward raised (the message says what), or used no parameter.
    """
    named = _unique_params(module)
    params = [param for _, param in named]
    observer = _Observer(params, truth=truth)
    stand_ins: dict[str, torch.Tensor] = {}
    for key, (name, param) in enumerate(named):
        stand_in = torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")
        stand_ins[name] = stand_in
        layout = (tuple(stand_in.shape), tuple(stand_in.stride()), 0)
        observer.mark(stand_in, _Flow((_Source(key, layout),)))
    for name, buffer in module.named_buffers():
        stand_ins[name] = torch.empty_strided(tuple(buffer.shape), tuple(buffer.stride()), dtype=buffer.dtype, device="meta")
    meta_args, meta_kwargs = tree_map(_input_to_meta, (list(args), dict(kwargs)))
    for tensor in tree_flatten((meta_args, meta_kwargs))[0]:
        if isinstance(tensor, torch.Tensor):
            observer.mark(tensor, _Flow(data=True, raw=tensor.is_floating_point()))
    try:
        with untouched(module), without_fsdp_hooks(module), torch.no_grad(), torch.device("meta"), observer.known.readable(), observer:
            if call is None:
                output = torch.func.functional_call(module, stand_ins, tuple(meta_args), meta_kwargs, strict=False)
            else:
                with torch.nn.utils.stateless._reparametrize_module(module, stand_ins):
                    output = call(*meta_args, **meta_kwargs)
    except Exception as error:  # the model's own code: any failure means "could not observe"
        raise TraceError(f"{type(error).__name__}: {_first_line(error)}") from error
    _outputs(observer, output)
    for use, shape in zip(observer.uses, observer.shapes):
        if use.covers and all(cover is not None for cover in use.covers):
            use.view = merge_views(shape, [cover for cover in use.covers if cover is not None])
    uses = {id(param): use for param, use in zip(params, observer.uses)}
    if not any(use.used for use in uses.values()):
        raise TraceError("the forward used none of the parameters")
    return uses


def _input_to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


def _outputs(observer: _Observer, output: Any) -> None:
    """Heads, and parameters returned as they are, from the model's outputs."""
    leaves = [x for x in tree_flatten(_plain(output))[0] if isinstance(x, torch.Tensor)]
    for tensor in leaves:
        flow = observer.flow(tensor)
        if flow is None:
            continue
        for source in flow.sources:
            use = observer.uses[source.key]
            if source.gathered:
                use.lookups.add(source.via or "output")
            else:
                use.returned = True
        if flow.stream or flow.sources or not flow.producers:
            continue
        if any(observer.uses[key].fed_matmul for key in flow.producers):
            continue  # a residual stream: its writers' products went on into later layers
        for key in flow.producers:
            observer.uses[key].head = True


def _plain(output: Any) -> Any:
    """Model outputs as plain containers: a Hugging Face ``ModelOutput`` is a dict; caches are dropped."""
    if isinstance(output, Mapping):
        return {k: _plain(v) for k, v in output.items() if k not in ("past_key_values", "loss")}
    if isinstance(output, (list, tuple)):
        return [_plain(v) for v in output]
    return output
