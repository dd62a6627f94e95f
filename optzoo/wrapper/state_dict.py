"""Optimizer state dicts keyed by parameter names: saving, and the one checked load.

The format (``optzoo.chained.v1``) is the same for one process and for the distributed
optimizers: ``state`` and ``main_params`` map a param's name to its whole-param tensors, and
``param_groups`` hold every group's hyperparameters with all its ``param_names``. A checkpoint
therefore survives reordering, resharding (N ranks to M) and tied weights saved under either
name. :func:`load_state_dict_` checks everything before it changes anything.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from optzoo._common import shorten
from optzoo.optimizers.state_layout import check_state, state_layout_of
from optzoo.wrapper._placement import as_kind_of, has_data
from optzoo.wrapper.param_map import ParamMap, Part
from optzoo.wrapper.routing_digest import (
    DIGEST_KEY,
    OPTZOO_FRAMES,
    ROUTING_KEY,
    RoutingChangeReport,
    WARM_STARTS,
    RoutingChangeWarning,
    check_routing,
    digest_of,
    warm_start_state,
)
from optzoo.wrapper.scalers import MegatronGradScaler

KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")
STRUCTURAL_KEYS = ("params", "param_names", "matrix_views")
"""Group keys the model decides, not the checkpoint: which params, their names, and how the forward
multiplies by them (:class:`~optzoo._common.MatrixView`, parallel to this process's params)."""
"""Group keys that choose how torch computes a step, not what: this process's choice (for its
device and its params) stands, whatever the saving process chose. Restoring another process's
``fused`` would change the rounding (torch's fused CPU Adam rounds differently from foreach) or
ask for a kernel this device lacks."""

__all__ = ["KERNEL_KEYS", "STATE_DICT_FORMAT", "check_param_shapes", "load_state_dict_", "slice_part", "state_dict_of"]

STATE_DICT_FORMAT = "optzoo.chained.v1"


def state_dict_of(
    *,
    param_groups: list[dict[str, Any]],
    state: Mapping[torch.Tensor, Any],
    param_map: ParamMap,
    grad_scaler: MegatronGradScaler | None,
    routing: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """This process's state, keyed by names; groups carry every name, owned here or not.

    Tensors are the live ones, as in torch; ``torch.save`` (or a deep copy) snapshots them.
    Under the sharded optimizer the tensors of a param split by elements cover this rank's
    range only (:mod:`optzoo.distributed.checkpoint` consolidates them). ``routing`` (the
    optimizer's :func:`~optzoo.wrapper.routing_digest.routing_record`) is saved with its digest.
    """
    group_names = param_map.group_names()
    groups = [
        {**{k: v for k, v in group.items() if k not in STRUCTURAL_KEYS}, "param_names": list(group_names[index])}
        for index, group in enumerate(param_groups)
    ]
    mains = {entry.name: entry.main for entry in param_map.local if entry.main is not None}
    return {
        "format": STATE_DICT_FORMAT,
        "state": {name: state[main] for name, main in mains.items() if state.get(main)},
        "param_groups": groups,
        "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
        # fp32 main copies of 16-bit params: the model's bf16/fp16 weights cannot restore them.
        "main_params": {entry.name: mains[entry.name] for entry in param_map.local if entry.master},
        # Checked at load: state of another shape would be read out of bounds by fused kernels.
        "param_shapes": {entry.name: list(entry.model.shape) for entry in param_map.entries},
        **({ROUTING_KEY: dict(routing), DIGEST_KEY: digest_of(routing)} if routing is not None else {}),
    }


def slice_part(value: Any, part: Part, numel: int) -> Any:
    """This rank's part of a whole-param state entry (entries without one value per element as is)."""
    if part is None or not isinstance(value, torch.Tensor) or value.numel() != numel or value.dim() == 0:
        return value
    return value.reshape(-1)[part[0] : part[1]].clone()


def load_state_dict_(
    state_dict: Mapping[str, Any],
    *,
    param_groups: list[dict[str, Any]],
    state: MutableMapping[torch.Tensor, Any],
    param_map: ParamMap,
    grad_scaler: MegatronGradScaler | None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    agree: Callable[[Exception | None], None] | None = None,
    routing: Mapping[str, Any] | None = None,
    allow_routing_change: bool = False,
    warm_start: bool = False,
) -> RoutingChangeReport | None:
    """Restore hyperparameters, state, fp32 main params and the loss scale, matching params by name.

    A param's state goes through its inner optimizer's ``restore_state(values, param, name)``
    where it has one (the precision-aware Adam: its masters and moments are checked against its
    settings and kept in its dtypes).

    Every param takes its own element range of the saved whole-param tensors, so one loader
    serves one process and every rank of the distributed optimizers (which pass the consolidated
    dict). Everything is checked before anything changes: a name that exists on one side only,
    a group whose members differ, a group that changed optimizer, main params or a loss scaler
    from another precision setting are each a ``ValueError`` naming both sides.

    ``agree`` (the distributed optimizer's) is called once every check has run on this rank,
    with this rank's error or ``None``: it raises on every rank if any rank failed, so that all
    ranks refuse a checkpoint together and none has changed anything.

    ``routing`` (this optimizer's :func:`~optzoo.wrapper.routing_digest.routing_record`) is compared
    with the checkpoint's first: a changed routing is refused naming the params, unless
    ``allow_routing_change``; then the params whose routing changed start fresh (``warm_start``:
    converted where :func:`~optzoo.wrapper.routing_digest.warm_start_state` can), a
    :class:`~optzoo.wrapper.routing_digest.RoutingChangeWarning` names them, and the
    :class:`~optzoo.wrapper.routing_digest.RoutingChangeReport` is returned (else ``None``).
    """
    if warm_start and not allow_routing_change:
        raise ValueError(
            "`warm_start`: converts the state of params whose routing changed; got warm_start=True with "
            "allow_routing_change=False; expected allow_routing_change=True with it"
        )
    try:
        apply, report = _prepare_load(
            state_dict, param_groups=param_groups, state=state, param_map=param_map, grad_scaler=grad_scaler, optimizers=optimizers,
            routing=routing, allow_routing_change=allow_routing_change, warm_start=warm_start,
        )  # fmt: skip
    except Exception as error:
        if agree is None:
            raise
        agree(error)  # raises, on every rank
        raise
    if agree is not None:
        agree(None)  # another rank's error is raised here, before this rank changes anything
    apply()
    if report is not None and report.fresh:
        warnings.warn(
            f"`load_state_dict`: started {len(report.fresh)} params with fresh optimizer state, their routing having "
            f"changed; got [{shorten(list(report.fresh))}]; expected nothing else to start fresh "
            "(the returned RoutingChangeReport lists them all)",
            RoutingChangeWarning,
            skip_file_prefixes=OPTZOO_FRAMES,
        )
    return report if allow_routing_change else None


def _prepare_load(
    state_dict: Mapping[str, Any],
    *,
    param_groups: list[dict[str, Any]],
    state: MutableMapping[torch.Tensor, Any],
    param_map: ParamMap,
    grad_scaler: MegatronGradScaler | None,
    optimizers: Sequence[torch.optim.Optimizer],
    routing: Mapping[str, Any] | None,
    allow_routing_change: bool,
    warm_start: bool,
) -> tuple[Callable[[], None], RoutingChangeReport | None]:
    """Every check of :func:`load_state_dict_`, and the loaded values; the returned function changes the optimizer."""
    if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_DICT_FORMAT:
        got = state_dict.get("format") if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(
            f"`state_dict`: not an optzoo optimizer state dict; got format {got!r}; "
            f"expected {STATE_DICT_FORMAT!r} (from get_optimizer(...).state_dict())"
        )

    _check_structure(state_dict)

    def canonical(name: str) -> str | None:
        entry = param_map.entry(name)
        return None if entry is None else entry.name

    saved_groups = state_dict["param_groups"]
    saved_names = [n for g in saved_groups for n in g["param_names"]]
    ours = {entry.name for entry in param_map.entries}
    missing = sorted(ours - {canonical(n) for n in saved_names})
    unknown = [n for n in saved_names if canonical(n) is None]
    if missing or unknown:
        raise ValueError(
            "`state_dict`: parameter names do not match this model; "
            f"got names only in the checkpoint: [{shorten(unknown)}]; "
            f"expected also: [{shorten(missing)}] (only in this model)"
        )
    check_param_shapes(state_dict, param_map)
    changes = check_routing(state_dict, routing, canonical, allow_routing_change=allow_routing_change) if routing is not None else []
    changed = {change.name: change for change in changes}
    # Rules of names alone, so every rank reports the same: a param moved to another group of the
    # same algorithm, precision and layout keeps its state; one warm-started converts it; the rest start fresh.
    converted = {c.name for c in changes if warm_start and c.what == ("algorithm",) and (c.old_optimizer, c.new_optimizer) in WARM_STARTS}
    fresh = {c.name for c in changes if c.what != ("group",) and c.name not in converted}
    report = RoutingChangeReport(tuple(changes), tuple(c.name for c in changes if c.name in fresh), tuple(c.name for c in changes if c.name in converted))
    group_names = param_map.group_names()
    matched: list[tuple[dict[str, Any], Mapping[str, Any]]] = []
    saved_of: dict[int, Mapping[str, Any]] = {}
    for saved in saved_groups:
        names = [canonical(n) for n in saved["param_names"]]
        first = param_map.entry(saved["param_names"][0])
        assert first is not None  # every saved name is known (checked above)
        index = first.group
        group = param_groups[index]
        if changed and (set(names) != set(group_names[index]) or saved.get("optimizer") != group["optimizer"]):
            continue  # its members changed (allowed): the group keeps this optimizer's settings
        if set(names) != set(group_names[index]):
            raise ValueError(
                f"`state_dict`: param group #{index} differs from the checkpoint's; got "
                f"[{shorten(saved['param_names'])}]; expected [{shorten(group_names[index])}] "
                "(was the routing changed?)"
            )
        if saved.get("optimizer") != group["optimizer"]:
            raise ValueError(
                f"`state_dict`: param group #{index} ({group_names[index][0]}, ...) uses "
                f"optimizer {group['optimizer']!r}; got {saved.get('optimizer')!r} in the "
                f"checkpoint; expected the same optimizer"
            )
        _check_group_values(saved, group, f"`param_groups` #{index} ({group_names[index][0]}, ...)")
        matched.append((group, saved))
        saved_of[index] = saved

    owners = {id(p): (opt, g) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    new_state: dict[torch.Tensor, dict[str, Any]] = {}
    for name, values in state_dict["state"].items():
        entry = param_map.entry(name)
        if entry is None:
            raise ValueError(
                f"`state_dict`: state for unknown parameter; got {name!r}; expected one of [{shorten(sorted(ours))}]"
            )
        if entry.main is None or entry.name in fresh:
            continue  # another rank steps it (and checks it), or it starts fresh
        if entry.name in converted:
            change = changed[entry.name]
            carried = warm_start_state(change.old_optimizer, change.new_optimizer, values)
            if carried is None:
                raise ValueError(
                    f"`{entry.name}`: warm start from {change.old_optimizer!r} to {change.new_optimizer!r} needs its saved state; "
                    f"got keys {sorted(values)}; expected those {change.old_optimizer!r} keeps"
                )
            values = carried
        group = param_groups[entry.group]
        owner, inner_group = owners.get(id(entry.main), (None, group))
        # The layout under the settings the group will have: the checkpoint's hyperparameters
        # (say, AdaptiveMuon's moment2_method) replace this group's, as applied below.
        saved_settings = saved_of.get(entry.group, {})
        loaded_group = {**inner_group, **{k: v for k, v in saved_settings.items() if k not in (*STRUCTURAL_KEYS, *KERNEL_KEYS)}}
        restore = getattr(owner, "restore_state", None)
        if restore is None and "master_param" in values:  # the precision setting, named before the layout
            raise ValueError(
                f"`{entry.name}`: the checkpoint holds a precision-aware master (`master_param`) that this "
                f"{group.get('optimizer', 'optimizer')!r} group does not keep; got a state saved with "
                "use_precision_aware_optimizer=True; expected the same precision settings as when it was saved"
            )
        check_master = getattr(owner, "check_master", None)
        if check_master is not None:  # precision-aware Adam: its master representation, naming its settings
            check_master(values, entry.name)
        layout = state_layout_of(owner, entry.main, loaded_group, tuple(entry.model.shape)) if owner is not None else None
        if layout is not None:
            check_state(values, layout, name=entry.name, complex_param=entry.model.is_complex())
        else:  # an optimizer class without a known layout: per-element state at least has the param's shape
            _check_unknown_layout(entry.name, values, tuple(entry.model.shape))
        numel = entry.model.numel()
        whole = {key: as_kind_of(entry.main, value) for key, value in values.items()}
        sliced = {key: slice_part(value, entry.part, numel) for key, value in whole.items()}
        if restore is not None:  # typed state (precision-aware Adam): its dtypes
            new_state[entry.main] = restore(sliced, entry.main, entry.name)
            continue
        new_state[entry.main] = {key: _load_value(entry.main, key, value, group) for key, value in sliced.items()}

    # A checkpoint with state for some params but none for one this optimizer has stepped would
    # silently restart that param's moments (a checkpoint without any state, never stepped, loads).
    dropped = [
        e.name for e in param_map.local if e.main is not None and state.get(e.main) and e.main not in new_state and e.name not in changed
    ]
    if state_dict["state"] and dropped:
        raise ValueError(
            f"`state_dict`: no optimizer state for params stepped here; got a checkpoint with state for "
            f"{len(state_dict['state'])} params but none for [{shorten(dropped, 5)}]; expected state for every "
            "param this optimizer has state for (or a checkpoint saved before any step, without state)"
        )

    # A distributed load (DCP) may carry only this rank's main params: each must be there, and
    # none may be for a param that has no fp32 copy here.
    with_main = {entry.name for entry in param_map.entries if entry.master}
    local_with_main = {entry.name for entry in param_map.local if entry.master}
    saved_mains = {canonical(n) or n: v for n, v in (state_dict.get("main_params") or {}).items()}
    if not local_with_main <= set(saved_mains) <= with_main:
        raise ValueError(
            "`state_dict`: fp32 main params do not match this optimizer's; got "
            f"[{shorten(sorted(saved_mains))}]; expected [{shorten(sorted(with_main))}] "
            "(was the checkpoint saved with another fp16/bf16 setting?)"
        )
    mains: list[tuple[torch.Tensor, torch.Tensor]] = []
    for entry in param_map.local:
        if not entry.master:
            continue
        saved_main = saved_mains[entry.name]
        if not isinstance(saved_main, torch.Tensor) or not saved_main.is_floating_point() or not has_data(saved_main):
            shown = f"a {saved_main.dtype} tensor on {saved_main.device.type}" if isinstance(saved_main, torch.Tensor) else type(saved_main).__name__
            raise _damaged(f"`main_params[{entry.name!r}]`", shown, "a floating-point tensor with values")
        if not bool(torch.isfinite(saved_main).all()):
            raise _damaged(f"`main_params[{entry.name!r}]`", "NaN or inf values", "finite fp32 main params (was it saved after a diverged step?)")
        if saved_main.shape != entry.model.shape:
            raise ValueError(
                f"`{entry.name}`: fp32 main param shape differs from the checkpoint's; got "
                f"{tuple(saved_main.shape)}; expected {tuple(entry.model.shape)}"
            )
        assert entry.main is not None  # local entries have one
        saved_main = slice_part(as_kind_of(entry.main, saved_main), entry.part, entry.model.numel())
        mains.append((entry.main, saved_main.to(device=entry.main.device, dtype=entry.main.dtype)))
    scaler_state = state_dict.get("grad_scaler")
    if (scaler_state is None) != (grad_scaler is None):
        raise ValueError(
            f"`state_dict`: grad scaler state is {'absent' if scaler_state is None else 'present'}; "
            f"got {scaler_state!r}; expected {'one' if grad_scaler is not None else 'none'} "
            "(was the checkpoint saved with another fp16/bf16/loss_scale setting?)"
        )
    if grad_scaler is not None:
        grad_scaler.check_state_dict(scaler_state)  # before anything changes

    def apply() -> None:
        for group, saved in matched:
            for key, value in saved.items():
                if key not in (*STRUCTURAL_KEYS, *KERNEL_KEYS):
                    group[key] = copy.deepcopy(value)
        state.clear()
        state.update(new_state)
        with torch.no_grad():
            for main, saved_main in mains:
                main.copy_(saved_main)
        if grad_scaler is not None and scaler_state is not None:
            grad_scaler.load_state_dict(scaler_state)
        for opt in optimizers:  # as torch's loader ends: each class brings older state into its format
            opt.__setstate__({"state": opt.state, "param_groups": opt.param_groups})  # (a number ``step`` becomes a tensor)

    return apply, report


def _damaged(where: str, got: str, expected: str) -> ValueError:
    return ValueError(f"`state_dict`: damaged at {where}; got {got}; expected {expected}")


def _check_structure(state_dict: Mapping[str, Any]) -> None:
    """The format's structure and values, before anything is read: a damaged checkpoint gets a
    ``ValueError`` naming the key (not a ``KeyError`` deep inside), and NaN moments, a negative
    ``step`` or a non-finite hyperparameter are refused rather than loaded into NaN weights."""
    for key, kind in (("state", Mapping), ("param_groups", list), ("main_params", (Mapping, type(None)))):
        if key not in state_dict or not isinstance(state_dict[key], kind):
            got = f"no `{key}`" if key not in state_dict else type(state_dict[key]).__name__
            raise _damaged(f"`{key}`", got, f"`{key}` as optzoo's state_dict() writes it")
    for index, group in enumerate(state_dict["param_groups"]):
        names = group.get("param_names") if isinstance(group, Mapping) else None
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise _damaged(f"`param_groups[{index}]['param_names']`", repr(names)[:80], "a non-empty list of parameter names")
        for key, value in group.items():
            numbers = value if isinstance(value, (tuple, list)) and key != "param_names" else [value]
            for number in numbers:
                if isinstance(number, float) and not math.isfinite(number):
                    raise _damaged(f"`param_groups[{index}]['{key}']` ({names[0]}, ...)", repr(value), "finite hyperparameters")
        if isinstance(group.get("lr"), (int, float)) and group["lr"] < 0:
            raise _damaged(f"`param_groups[{index}]['lr']` ({names[0]}, ...)", repr(group["lr"]), "lr >= 0")
    for name, values in state_dict["state"].items():
        if not isinstance(values, Mapping):
            raise _damaged(f"`state[{name!r}]`", type(values).__name__, "a dict of state tensors")
        for key, value in values.items():
            if key == "step" and not (
                (_is_number(value) and value >= 0) or (isinstance(value, torch.Tensor) and value.numel() == 1 and float(value) >= 0)
            ):
                shown = repr(float(value)) if isinstance(value, torch.Tensor) and value.numel() == 1 else repr(value)[:60]
                raise _damaged(f"`state[{name!r}]['step']`", shown, "a step count >= 0")
            if not isinstance(value, torch.Tensor):
                continue
            if not has_data(value):
                raise _damaged(f"`state[{name!r}][{key!r}]`", f"a {value.layout} tensor on {value.device.type}", "a dense tensor with values")
            if key not in ("step", "master_param") and not (value.is_floating_point() or value.is_complex()):
                raise _damaged(f"`state[{name!r}][{key!r}]`", f"a {value.dtype} tensor", "floating-point optimizer state")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise _damaged(f"`state[{name!r}][{key!r}]`", "NaN or inf values", "finite state (was it saved after a diverged step?)")


_NON_NEGATIVE = frozenset({"lr", "weight_decay", "eps", "max_lr", "min_lr", "wd_mult", "start_wd", "end_wd", "initial_lr"})
"""Group hyperparameters that must be >= 0 (as the optimizers and the scheduler require)."""
_UNIT_INTERVAL = frozenset({"momentum", "betas", "beta1", "beta2", "shampoo_beta", "dampening"})
"""Group hyperparameters (or each of their elements) that must lie in [0, 1)."""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_group_values(saved: Mapping[str, Any], group: Mapping[str, Any], where: str) -> None:
    """A saved group's settings have the kinds of this group's (a number where a number is, a
    bool where a bool is, a pair where a pair is) and lie in range: a damaged or hand-edited
    checkpoint is refused here, not by a ``TypeError`` at the next step or by silent divergence."""
    for key, mine in group.items():
        if key in (*STRUCTURAL_KEYS, *KERNEL_KEYS) or key not in saved:
            continue
        value = saved[key]
        if _is_number(mine) or (isinstance(mine, tuple) and all(_is_number(x) for x in mine)):
            numbers = list(value) if isinstance(value, (tuple, list)) else [value]
            kind_ok = (isinstance(value, (tuple, list)) and len(value) == len(mine)) if isinstance(mine, tuple) else _is_number(value)
            if not kind_ok or not all(_is_number(x) for x in numbers):
                raise _damaged(f"{where} `{key}`", repr(value)[:60], f"{'a pair of numbers' if isinstance(mine, tuple) else 'a number'}, as {mine!r} here")
            if key in _NON_NEGATIVE and not all(x >= 0 for x in numbers):
                raise _damaged(f"{where} `{key}`", repr(value), f"{key} >= 0")
            if key in _UNIT_INTERVAL and not all(0 <= x < 1 for x in numbers):
                raise _damaged(f"{where} `{key}`", repr(value), f"{key} in [0, 1)")
        elif isinstance(mine, bool) and not isinstance(value, bool):
            raise _damaged(f"{where} `{key}`", repr(value)[:60], f"a bool, as {mine!r} here")
        elif isinstance(mine, str) and not isinstance(value, str):
            raise _damaged(f"{where} `{key}`", repr(value)[:60], f"a string, as {mine!r} here")


def check_param_shapes(state_dict: Mapping[str, Any], param_map: ParamMap) -> None:
    """Refuse a checkpoint of params with other shapes (say, another hidden size) before anything changes.

    The checkpoint's ``param_shapes`` (absent from checkpoints saved before it was added: their
    state is still checked against each optimizer's layout, and their fp32 main params) must
    equal the model's.
    """
    for name, shape in (state_dict.get("param_shapes") or {}).items():
        entry = param_map.entry(name)
        if entry is not None and tuple(shape) != tuple(entry.model.shape):
            raise ValueError(
                f"`{entry.name}`: shape differs from the checkpoint's; got {tuple(shape)} in the checkpoint; "
                f"expected {tuple(entry.model.shape)} (was the model changed, e.g. its hidden size?)"
            )


def _check_unknown_layout(name: str, values: Mapping[str, Any], shape: tuple[int, ...]) -> None:
    """For an optimizer class whose layout is not known (see :mod:`optzoo.optimizers.state_layout`):
    every tensor of more than one element has the param's shape."""
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1 and tuple(value.shape) != shape:
            raise ValueError(f"`{name}`: state `{key}` shape differs; got {tuple(value.shape)} in the checkpoint; expected {shape}")


def _load_value(param: torch.Tensor, key: str, value: Any, group: Mapping[str, Any]) -> Any:
    """Copy one state entry onto ``param``'s device (``step`` placed as torch places it)."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device, copy=True)
        return value.clone()
    # Floating state takes the param's dtype, as torch.optim.Optimizer.load_state_dict casts it (an
    # fp32 checkpoint resumed on a model cast to bf16). Typed state (precision-aware Adam's bf16
    # moments and int16 remainders, Muon's fp32 momentum of 16-bit params) goes through the inner
    # optimizer's restore_state instead.
    dtype = param.dtype if value.is_floating_point() and param.is_floating_point() else value.dtype
    plain = not isinstance(param, DTensor) and not isinstance(value, DTensor)
    if plain and value.shape == param.shape and value.stride() != param.stride():
        # Laid out as the param: torch's fused kernels walk param and state in memory order, so a
        # moment saved from a param of another layout (contiguous, resumed on a transposed one)
        # would be paired with the wrong elements.
        return torch.empty_like(param, dtype=dtype).copy_(value)
    return value.to(device=param.device, dtype=dtype, copy=True)
