"""Where a parameter's elements sit in a tensor derived from it, and the matrices a matmul covers.

A tensor the forward derives from a parameter by views, copies, casts and reads by index has a
:data:`Layout`: ``(sizes, strides, offset)`` in the parameter's row-major index space (stride 0
where it does not vary: a broadcast, a row read by index). At a matmul, the weight's layout and
which of its dims are contracted, index the product, or are batched over give a :data:`Cover`
of the parameter, and the covers of all its matmuls give one :class:`~optzoo._common.MatrixView`
(:func:`merge_views`): the blocks it is split into (experts, heads, groups) and, in each, the
output and the contracted dims.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .._common import MatrixView

__all__ = [
    "Cover", "Layout", "broadcast", "cover_of", "gathered_layout", "is_matrix", "matrix_view_of", "merge_views",
    "merged_in_stride_order", "shadow", "split_groups",
]  # fmt: skip

Layout = tuple[tuple[int, ...], tuple[int, ...], int]
"""``(sizes, strides, offset)`` of a tensor in its parameter's row-major index space."""

_aten = torch.ops.aten


def _name(func: Any) -> str:
    name: str = func.overloadpacket.__name__
    return name


Cover = tuple[tuple[tuple[tuple[int, str], ...], int, int], ...]
"""How one matmul operand covers a parameter: per parameter dim, ``(factors, offset, extent)``:
the ``(count, role)`` factors it walks, outer first (roles ``out``, ``in``, ``block``), where it
starts along the dim, and how many indices its factors span."""



def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))



def _runs(size: int, stride: int, shape: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """``(param dim, count, step)`` runs, outer first, that one tensor dim of ``size`` elements at
    ``stride`` walks in a parameter of ``shape`` (row-major); ``None`` when it does not tile them."""
    if size <= 1 or stride == 0:
        return []
    strides = _contiguous_strides(shape)
    dim = next((d for d in range(len(shape)) if strides[d] <= stride and stride % strides[d] == 0 and shape[d] > 1), None)
    if dim is None:
        return None
    step = stride // strides[dim]
    runs: list[tuple[int, int, int]] = []
    while size > 1:
        if dim < 0:
            return None
        inner = -(-shape[dim] // step)  # indices along dim reachable with this step
        if size <= inner:
            runs.append((dim, size, step))
            break
        if inner * step != shape[dim] or size % inner:
            return None
        runs.append((dim, inner, step))
        size //= inner
        dim, step = dim - 1, 1
        while dim >= 0 and shape[dim] == 1:
            dim -= 1
    return list(reversed(runs))



def cover_of(layout: Layout, roles: Sequence[str], shape: Sequence[int]) -> Cover | None:
    """How an operand laid out as ``layout``, whose dims are ``roles``, covers a parameter of ``shape``."""
    sizes, strides, offset = layout
    by_dim: dict[int, list[tuple[int, int, str]]] = {}  # param dim -> [(count, step, role)]
    for size, stride, role in zip(sizes, strides, roles):
        runs = _runs(size, stride, shape)
        if runs is None:
            return None
        for dim, count, step in runs:
            by_dim.setdefault(dim, []).append((count, step, role))
    coordinates, rest = [], offset
    for stride in _contiguous_strides(shape):
        coordinate, rest = divmod(rest, stride)
        coordinates.append(coordinate)
    cover = []
    for dim in range(len(shape)):
        factors: list[tuple[int, str]] = []
        span = 1
        for count, step, role in sorted(by_dim.get(dim, []), key=lambda run: run[1]):  # innermost first
            if step != span:
                if span != 1 or step % span:
                    return None
                factors.append((step, "block"))  # interleaved: every step-th index
                span = step
            factors.append((count, role))
            span *= count
        cover.append((tuple(reversed(factors)), coordinates[dim], span))
    return tuple(cover)



def merge_views(shape: Sequence[int], covers: Sequence[Cover]) -> MatrixView | None:
    """One :class:`MatrixView` of a parameter from how each of its matmul uses covered it.

    A dim every use walks alike keeps that pattern, the rest of it in blocks; a dim that uses
    cover in contiguous pieces of one role (packed q, k and v multiplied separately) is split
    into blocks of the pieces' greatest common size. ``None`` when the uses disagree otherwise.
    """
    if not covers:
        return None
    split: list[int] = []
    kinds: list[str] = []
    origin: list[int] = []
    for dim, size in enumerate(shape):
        entries = [cover[dim] for cover in covers]
        patterns = {factors for factors, _, _ in entries}
        extent = entries[0][2]
        if len(patterns) == 1 and all(size % span == 0 and start % span == 0 for _, start, span in entries):
            factors = list(entries[0][0])
            if size // extent > 1 or not factors:
                factors.insert(0, (size // extent, "block"))  # the rest of the dim: blocks the op does not walk
        else:
            roles = {f[0][1] for f, _, _ in entries if len(f) == 1}
            if len(roles) != 1 or any(len(f) != 1 for f, _, _ in entries) or "block" in roles:
                return None
            block = math.gcd(size, *(span for _, _, span in entries), *(start for _, start, _ in entries))
            factors = [(size // block, "block"), (block, roles.pop())] if block < size else [(size, roles.pop())]
        for count, role in factors:
            split.append(count)
            kinds.append(role)
            origin.append(dim)
    return MatrixView(
        split=tuple(split),
        origin=tuple(origin),
        blocks=tuple(i for i, kind in enumerate(kinds) if kind == "block"),
        rows=tuple(i for i, kind in enumerate(kinds) if kind == "out"),
        cols=tuple(i for i, kind in enumerate(kinds) if kind == "in"),
    )



def matrix_view_of(layout: Layout, roles: Sequence[str], shape: Sequence[int]) -> MatrixView | None:
    """How one operand of a matmul covers its parameter of ``shape``, as a :class:`MatrixView`.

    ``layout`` places the operand in the parameter; ``roles`` gives, per operand dim, ``"out"``
    (indexes the product's features), ``"in"`` (contracted) or ``"block"`` (batched over). A
    parameter dim the operand does not walk, or walks only part of, is split into blocks.
    ``None`` when the operand does not tile the parameter that way (a gather, a strided copy).

    Example:
        >>> matrix_view_of(((6, 4), (1, 6), 0), ("in", "out"), (4, 6)).describe()  # x @ w.t(), w (4, 6)
        '4 x 6'
        >>> matrix_view_of(((4, 6), (6, 1), 0), ("in", "out"), (4, 6)).describe()  # x @ w, w (in, out)
        '6 x 4 (dim 0: in, dim 1: out)'
        >>> matrix_view_of(((3, 8), (8, 1), 48), ("out", "in"), (24, 8)).describe()  # rows 6:9 of (24, 8)
        '8 blocks of 3 x 8 (dim 0: 8 blocks x 3 out, dim 1: in)'
    """
    cover = cover_of(layout, roles, shape)
    return None if cover is None else merge_views(shape, [cover])



def is_matrix(layout: Layout, roles: Sequence[str]) -> bool:
    """Whether the parameter varies along the operand's contracted and its output dims (of size > 1)
    alike: a matrix; a gain on the weight varies along one of them only (weight norm's ``g``)."""
    sizes, strides, _ = layout

    def varies(role: str) -> bool:
        dims = [stride for size, stride, r in zip(sizes, strides, roles) if r == role and size > 1]
        return not dims or any(stride != 0 for stride in dims)

    return varies("in") and varies("out")



def split_groups(layout: Layout, roles: tuple[str, ...], groups: int, *, transposed: bool) -> tuple[Layout, tuple[str, ...]]:
    """A grouped conv's weight seen as ``groups`` blocks: its output-channel dim (its input-channel
    dim when transposed) split into ``(groups, channels // groups)``."""
    sizes, strides, offset = layout
    dim = 0
    if sizes[dim] % groups:
        return layout, roles
    inner = sizes[dim] // groups
    new_sizes = (groups, inner, *sizes[1:])
    new_strides = (strides[dim] * inner, strides[dim], *strides[1:])
    return (new_sizes, new_strides, offset), ("block", *roles)



def gathered_layout(func: Any, args: Any, layout: Layout | None, out: torch.Tensor) -> Layout | None:
    """The layout of a read by index: the indexed dims become dims the parameter does not vary along."""
    if layout is None:
        return None
    sizes, strides, offset = layout
    name = _name(func)
    if name == "embedding":
        index = args[1]
        return (tuple(out.shape), (0,) * index.dim() + tuple(strides[1:]), offset)
    if name == "index_select":
        dim = args[1] % len(sizes)
        return (tuple(out.shape), tuple(0 if d == dim else s for d, s in enumerate(strides)), offset)
    if name in ("index", "_unsafe_index"):
        indices = list(args[1])
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return None
        indexed = [d for d, index in enumerate(indices) if index is not None]
        kept = [d for d in range(len(sizes)) if d not in indexed]
        index_dims = out.dim() - len(kept)
        if not indexed:
            return None
        adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
        before = [d for d in kept if d < indexed[0]] if adjacent else []
        after = [d for d in kept if d not in before]
        new_strides = [strides[d] for d in before] + [0] * index_dims + [strides[d] for d in after]
        if len(new_strides) != out.dim():
            return None
        return (tuple(out.shape), tuple(new_strides), offset)
    return None



def broadcast(layout: Layout | None, tensor: torch.Tensor, out: torch.Tensor) -> Layout | None:
    """``layout`` of ``tensor`` broadcast to ``out``'s shape (an elementwise op's operand)."""
    if layout is None or out.dim() < tensor.dim():
        return None
    sizes, strides, offset = layout
    pad = out.dim() - len(sizes)
    new_strides = [0] * pad + [s if size == o else 0 for size, s, o in zip(sizes, strides, out.shape[pad:])]
    return (tuple(out.shape), tuple(new_strides), offset)



_RESHAPES = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}



def merged_in_stride_order(func: Any, layout: Layout, like: torch.Tensor, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A reshape that merges dims the parameter does not walk in that order (einsum's
    ``hnd -> (d n) h``), replayed with each merged run of dims put in the parameter's order.

    The merged dim then lists the same elements in another order: a permutation of a matrix's
    rows, columns or blocks, which leaves the matrices (and their orthogonalisation) as they are.
    """
    if func not in _RESHAPES:
        return None
    sizes, strides, offset = layout
    target = [int(s) for s in args[1]]
    if -1 in target:
        known = math.prod(s for s in target if s != -1)
        target[target.index(-1)] = math.prod(sizes) // max(known, 1)
    order: list[int] = []
    source = 0
    for size in target:  # each target dim takes a run of source dims whose sizes multiply to it
        run, product = [], 1
        while source < len(sizes) and (product < size or (sizes[source] == 1 and product == size and size != 1)):
            run.append(source)
            product *= sizes[source]
            source += 1
        if product != size and not (size == 1 and not run):
            return None
        order += sorted(run, key=lambda d: -strides[d]) if product == size and len(run) > 1 else run
    order += list(range(source, len(sizes)))
    permuted = (tuple(sizes[d] for d in order), tuple(strides[d] for d in order), offset)
    try:
        return func(shadow(permuted, like), *args[1:], **kwargs)  # type: ignore[no-any-return]
    except Exception:  # not a plain merge either
        return None



def shadow(layout: Layout, like: torch.Tensor) -> torch.Tensor:
    """A meta tensor laid out as ``layout`` says, to replay a view on."""
    sizes, strides, offset = layout
    span = 1 + offset + sum((size - 1) * stride for size, stride in zip(sizes, strides) if size > 0)
    base = torch.empty(max(span, 1), dtype=like.dtype, device="meta")
    return base.as_strided(sizes, strides, offset)


