"""Small helpers every layer shares: the error-message template and how messages name things.

This module is the bottom of the import graph: it imports only the standard library and torch,
so ``optzoo.routing``, ``optzoo.optimizers`` and the core may all use it (``tests/test_layering.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import heapq
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args


import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "INTERNAL_FILES",
    "MatrixView",
    "assign_least_loaded",
    "finite_number",
    "show_value",
    "PARAM_DTYPES",
    "ROLES",
    "SCALAR_ROLES",
    "Role",
    "check_choice",
    "check_flag",
    "dense_layout",
    "describe_param",
    "did_you_mean",
    "dtensor_runs",
    "fused_supported",
    "has_fused_kernel",
    "invalid",
    "jsonable",
    "local_shard",
    "shorten",
]

INTERNAL_FILES: tuple[str, ...] = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.abspath(torch.__file__)),
    os.path.splitext(os.path.abspath(dataclasses.__file__))[0],  # without ".py": see below
    "<string",  # a dataclass's generated __init__ ("<string>": CPython 3.12 matches prefixes against the name less its last char)
)
"""``warnings.warn(skip_file_prefixes=...)``: blame the first frame outside optzoo and torch."""

Role = Literal[
    "embedding", "output", "bias", "norm", "elementwise", "expert", "router", "conv", "input", "matrix", "vector",
]  # fmt: skip
"""What a parameter is, read from what the model's forward does with it (``optzoo.routing.roles``):
an input table (read by index, or put into the activations), the output head, a bias, a norm's
scale or shift, an elementwise parameter (a gain or scale of any shape, an SSM parameter), a stack
of per-expert matrices, an MoE router, a conv filter, an input layer (a matmul or conv on the raw
model input), and, when nothing more is known, a matrix (2-D and up) or a vector (1-D).
Routing and the optimizers' registry records share this vocabulary, so it lives in the bottom layer."""
ROLES: tuple[Role, ...] = get_args(Role)
SCALAR_ROLES: frozenset[Role] = frozenset({"embedding", "output", "bias", "norm", "elementwise", "vector"})
"""The roles the Muon family hands to its scalar optimizer (Keller Jordan's Muon, Megatron-Core)."""


@dataclass(frozen=True)
class MatrixView:
    """How a forward multiplies by a parameter: as ``count`` matrices of ``rows x cols`` (out x in).

    Reshaped to ``split`` (its shape, with each dim the forward cuts into blocks split in two or
    more; ``origin[i]`` is the parameter dim that ``split[i]`` comes from), then permuted to
    ``blocks + rows + cols``, the parameter is the stack ``(count, rows, cols)``: ``rows`` index
    the product's features, ``cols`` are contracted against the activations. An MoE stack
    ``[E, out, in]`` is 4 blocks over dim 0; ``[E, in, out]`` the same with rows and cols swapped;
    experts concatenated as ``[E*ffn, in]`` split dim 0 into ``E x ffn``; a conv filter of
    ``groups`` splits its output channels into ``groups`` blocks.

    Example:
        >>> view = MatrixView(split=(4, 3, 8), origin=(0, 0, 1), blocks=(0,), rows=(1,), cols=(2,))
        >>> view.count, view.shape, view.describe()
        (4, (3, 8), '4 blocks of 3 x 8 (dim 0: 4 blocks x 3 out, dim 1: in)')
        >>> MatrixView.default((6, 5, 7), flatten=False).describe()
        '6 blocks of 5 x 7'
        >>> MatrixView(split=(7, 5), origin=(0, 1), blocks=(), rows=(1,), cols=(0,)).describe()
        '5 x 7 (dim 0: in, dim 1: out)'
    """

    split: tuple[int, ...]
    origin: tuple[int, ...]
    blocks: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]

    def __post_init__(self) -> None:
        order = sorted(self.blocks + self.rows + self.cols)
        if order != list(range(len(self.split))) or len(self.origin) != len(self.split) or list(self.origin) != sorted(self.origin):
            raise ValueError(
                f"`MatrixView`: blocks, rows and cols must cover each split dim once, origin must be ordered; got "
                f"split={self.split}, origin={self.origin}, blocks={self.blocks}, rows={self.rows}, cols={self.cols}; "
                "expected a permutation of range(len(split))"
            )

    @property
    def count(self) -> int:
        """How many matrices (blocks)."""
        return math.prod(self.split[i] for i in self.blocks)

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of each matrix: output features by contracted features."""
        return math.prod(self.split[i] for i in self.rows), math.prod(self.split[i] for i in self.cols)

    @property
    def param_shape(self) -> tuple[int, ...]:
        """The shape of the parameter it views."""
        dims = max(self.origin, default=-1) + 1
        return tuple(math.prod(s for s, o in zip(self.split, self.origin) if o == d) for d in range(dims))

    @property
    def order(self) -> tuple[int, ...]:
        """The permutation of ``split`` dims into ``blocks + rows + cols``."""
        return self.blocks + self.rows + self.cols

    @classmethod
    def default(cls, shape: Sequence[int], *, flatten: bool) -> "MatrixView":
        """The view used when nothing says otherwise: a 2-D ``[out, in]`` matrix; an N-D stack of
        ``shape[-2:]`` matrices over its leading dims; or, ``flatten``, ``shape[0]`` by the rest."""
        n = len(shape)
        if n < 2:
            raise ValueError(f"`MatrixView.default`: needs 2 or more dims; got shape {tuple(shape)}; expected a matrix or a stack")
        if flatten or n == 2:
            return cls(tuple(shape), tuple(range(n)), (), (0,), tuple(range(1, n)))
        return cls(tuple(shape), tuple(range(n)), tuple(range(n - 2)), (n - 2,), (n - 1,))

    def describe(self) -> str:
        """``count blocks of rows x cols``, then what each parameter dim is."""
        rows, cols = self.shape
        head = f"{rows} x {cols}" if self.count == 1 and not self.blocks else f"{self.count} blocks of {rows} x {cols}"
        if len(self.param_shape) >= 2 and self == MatrixView.default(self.param_shape, flatten=False):
            return head  # the stored shape says it all: [out, in], or a stack of them
        kinds = {i: "blocks" for i in self.blocks} | {i: "out" for i in self.rows} | {i: "in" for i in self.cols}
        parts = []
        for dim in sorted(set(self.origin)):
            members = [i for i, o in enumerate(self.origin) if o == dim]
            if len(members) == 1:
                parts.append(f"dim {dim}: {kinds[members[0]]}")
            else:
                parts.append(f"dim {dim}: " + " x ".join(f"{self.split[i]} {kinds[i]}" for i in members))
        return f"{head} ({', '.join(parts)})"

PARAM_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Param dtypes the optimizers take: float64 computes in float64, the others in float32."""


def invalid(subject: str, problem: str, got: str, expected: str) -> ValueError:
    """The house message, "`subject`: problem; got ...; expected ...", as a ``ValueError``.

    Example:
        >>> str(invalid("OptimizerConfig.lr", "must be non-negative", "-1.0", "a float >= 0"))
        '`OptimizerConfig.lr`: must be non-negative; got -1.0; expected a float >= 0'
    """
    return ValueError(f"`{subject}`: {problem}; got {got}; expected {expected}")


def shorten(items: Sequence[str], limit: int = 10) -> str:
    """The first ``limit`` items, comma-separated, and how many more there are.

    Example:
        >>> shorten([str(i) for i in range(12)], limit=3)
        '0, 1, 2, ... (+9 more)'
    """
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")


def describe_param(group: Mapping[str, Any], group_index: int, param_index: int) -> str:
    """``param group #g, param #i``, plus the param's name where the group carries ``param_names``.

    Example:
        >>> describe_param({"param_names": ["w", "b"]}, 0, 1)
        'param group #0, param #1 (`b`)'
    """
    names = group.get("param_names")
    named = f" (`{names[param_index]}`)" if names else ""
    return f"param group #{group_index}, param #{param_index}{named}"


def check_choice(subject: str, value: object, allowed: Iterable[str]) -> None:
    """Raise unless ``value`` is one of ``allowed``; ``subject`` names the setting (with its place).

    Example:
        >>> check_choice("param group #0: `scale_mode`", "wide", ("spectral", "unit_rms_norm"))
        Traceback (most recent call last):
        ...
        ValueError: param group #0: `scale_mode`: unknown value; got 'wide'; expected one of ['spectral', 'unit_rms_norm']
    """
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{subject}: unknown value; got {value!r}; expected one of {allowed}{did_you_mean(value, allowed)}")


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """``"; did you mean 'muon'?"`` for the closest of ``choices`` to a misspelt ``word``, else ``""``.

    Appended to an "unknown ..." message, after its ``expected`` part. Equally close choices are
    all named; a word only differing in case gets its spelling.

    Example:
        >>> did_you_mean("muom", ["adam", "muon", "lion"]), did_you_mean("zzz", ["adam"])
        ("; did you mean 'muon'?", '')
        >>> did_you_mean("exclude", ["name", "exclude_name", "exclude_attr"])
        "; did you mean 'exclude_name' or 'exclude_attr'?"
    """
    if not isinstance(word, str):
        return ""
    choices = [c for c in choices if isinstance(c, str)]
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered and lowered[word.lower()] != word:  # only the case differs
        return f"; did you mean {lowered[word.lower()]!r}?"
    close = difflib.get_close_matches(word.lower(), list(lowered), n=4, cutoff=0.6)
    if not close:
        return ""
    ratio = {c: difflib.SequenceMatcher(None, word.lower(), c).ratio() for c in close}
    best = [repr(lowered[c]) for c in close if ratio[c] == ratio[close[0]]]  # a tie: name them all
    return f"; did you mean {best[0] if len(best) == 1 else ', '.join(best[:-1]) + ' or ' + best[-1]}?"


def check_flag(subject: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{subject}: must be a bool; got {value!r}; expected True or False")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), else the tensor itself; in-place ops on it update the DTensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: dtypes by name (``"bfloat16"``), sequences as lists, others by ``repr``.

    Example:
        >>> jsonable((torch.bfloat16, 0.1, None))
        ['bfloat16', 0.1, None]
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


def dense_layout(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill one block of memory, each once, in some order of its dims
    (torch's "non-overlapping and dense": contiguous, transposed, channels-last, empty).

    A kernel that walks memory from ``data_ptr()`` for ``numel()`` elements, as torch's fused
    optimizers do, meets exactly the tensor's elements only then; a view with gaps
    (``x[..., 0]``, ``x[:, ::2]``) would have its update written into the gaps.

    Example:
        >>> x = torch.zeros(4, 6, 2)
        >>> dense_layout(x.transpose(0, 1)), dense_layout(x[..., 0]), dense_layout(x[:, :0])
        (True, False, True)
    """
    if tensor.is_contiguous() or tensor.numel() == 0:  # the common case, told cheaply
        return True
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def has_fused_kernel(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch has fused optimizer kernels for these params' devices and dtypes (the check
    torch makes for ``fused=True``)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return bool(params) and all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def dtensor_runs(op: str) -> bool:
    """Whether DTensor (FSDP2's params) has a sharding rule for the aten op ``op`` (e.g.
    ``"_fused_adam_"``): torch registers them for its fused Adam and AdamW kernels, not for
    fused SGD, which raises ``NotImplementedError`` mid-step on DTensor params. Read from torch's
    own table of rules; where that private table moves, nothing has a rule (foreach runs on DTensors)."""
    overloads = getattr(torch.ops.aten, op, None)
    if overloads is None:
        return False
    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = [getattr(propagator, table, {}) for table in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")]
    return any(getattr(overloads, overload) in table for overload in overloads.overloads() for table in tables)


def fused_supported(params: Sequence[torch.Tensor], op: str | None = None) -> bool:
    """Whether torch's fused optimizer kernel (the aten op ``op``, e.g. ``"_fused_sgd_"``) takes these
    params as they are: :func:`has_fused_kernel`, every layout without gaps (:func:`dense_layout`),
    which torch does not check and its CPU kernels need, and, for DTensor params, a DTensor rule for
    ``op`` (:func:`dtensor_runs`; without ``op``, DTensor params are not taken). optzoo's wrapper
    steps a param with gaps through a dense working copy, so there this holds; elsewhere such a
    param moves its optimizer to the foreach kernel."""
    if not (has_fused_kernel(params) and all(dense_layout(p) for p in params)):
        return False
    return not any(isinstance(p, DTensor) for p in params) or (op is not None and dtensor_runs(op))


def assign_least_loaded(costs: Sequence[float], loads: list[float]) -> list[int]:
    """Give each cost an owner: largest first, to the least-loaded rank (greedy longest-processing-time).

    ``loads`` holds each rank's load so far and is updated. Ties go to the earlier cost, then the
    lower rank, so every rank computes the same owners. The distributed optimizers' planner and
    Muon's owner-computes under FSDP2 both balance with it.

    Example:
        >>> loads = [0.0, 0.0]
        >>> assign_least_loaded([1.0, 3.0, 2.0, 2.0], loads), loads
        ([0, 0, 1, 1], [4.0, 4.0])
    """
    owners = [0] * len(costs)
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    for position in sorted(range(len(costs)), key=lambda k: -costs[k]):
        load, rank = heapq.heappop(heap)
        owners[position] = rank
        loads[rank] = load + costs[position]
        heapq.heappush(heap, (loads[rank], rank))
    return owners


def finite_number(value: object) -> bool:
    """Whether ``value`` is a number (not a bool) that a float holds finitely (``10**400`` is not).

    Example:
        >>> finite_number(1), finite_number(float("inf")), finite_number(10**400), finite_number(True)
        (True, False, False, False)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def show_value(value: object) -> str:
    """``repr(value)`` for a message, except an int too long to read (``10**400`` fills a screen).

    Example:
        >>> show_value(0.5), show_value(10**400)
        ('0.5', 'an int of 401 digits')
    """
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an int of {len(str(abs(value)))} digits"
    return repr(value)


# ---- overrides as merging sees them (recipes in other shapes order or refuse by these) -------


def same_override_value(a: Any, b: Any) -> bool:
    """Two override values agree as optzoo's merge sees them (``0`` and ``0.0`` agree; bools do not)."""
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b or (a != a and b != b)
    return type(a) is type(b) and bool(a == b)


def override_covers(big: Mapping[str, Any], small: Mapping[str, Any]) -> bool:
    """Merging ``small`` into ``big`` changes nothing: every field of ``small`` is in ``big``, equal."""
    return all(field in big and same_override_value(big[field], value) for field, value in small.items())


def conflicting_field(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """A field both overrides set to different values (optzoo refuses a param both match), or ``None``."""
    return next((field for field in a if field in b and not same_override_value(a[field], b[field])), None)


def key_field_shown(key: Any, field: str) -> str:
    """``field=value`` of a ``ParamKey`` as its ``describe()`` shows it (predicates by name)."""
    value = getattr(key, field)
    entries = [e if isinstance(e, str) else e.name for e in (value if isinstance(value, tuple) else (value,))]
    return f"{field}={entries[0]!r}" if len(entries) == 1 else f"{field}={tuple(entries)!r}"
