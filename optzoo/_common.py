"""Small helpers every layer shares: the error-message template and how messages name things.

This module is the bottom of the import graph: it imports only the standard library and torch,
so ``optzoo.routing``, ``optzoo.optimizers`` and the core may all use it (``tests/test_layering.py``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, get_args


import torch
from torch.distributed.tensor import DTensor

__all__ = [
    "INTERNAL_FILES",
    "assign_least_loaded",
    "finite_number",
    "show_value",
    "PARAM_DTYPES",
    "ROLES",
    "SCALAR_ROLES",
    "Role",
    "check_choice",
    "check_flag",
    "describe_param",
    "fused_supported",
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

Role = Literal["embedding", "output", "bias", "norm", "expert", "router", "conv", "matrix", "vector"]
"""What a parameter is, read from the model (``optzoo.routing.roles``): a lookup table, the output
head, a bias, a norm's scale or shift, a stack of per-expert matrices, an MoE router, a conv
filter, and, when nothing more is known, a matrix (2-D and up) or a vector (1-D and 0-D). Routing
and the optimizers' registry records share this vocabulary, so it lives in the bottom layer."""
ROLES: tuple[Role, ...] = get_args(Role)
SCALAR_ROLES: frozenset[Role] = frozenset({"embedding", "output", "bias", "norm", "vector"})
"""The roles the Muon family hands to its scalar optimizer (Keller Jordan's Muon, Megatron-Core)."""

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
        raise ValueError(f"{subject}: unknown value; got {value!r}; expected one of {allowed}")


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


def fused_supported(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused kernels take these params (same check torch makes when fused=True)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return bool(params) and all(p.device.type in devices and torch.is_floating_point(p) for p in params)


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
