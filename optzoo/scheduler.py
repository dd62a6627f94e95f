"""``OptimizerParamScheduler``: Megatron-Core's learning-rate and weight-decay schedule.

A transcription of the semantics of Megatron-Core's ``megatron/core/optimizer_param_scheduler.py``
(https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/optimizer_param_scheduler.py):
the same constructor arguments, decay styles, per-group keys, float arithmetic (so values are
bit-identical) and state-dict keys, legacy keys included. The schedule itself lives in the pure
functions :func:`lr_at` and :func:`wd_at`; the class applies them to an optimizer's groups.

Deliberate differences (see ``docs/schedules.md``): constructor arguments after ``optimizer``
are keyword-only; Megatron's asserts are ``ValueError``s, and a few inputs it would only trip
over later (an unknown style, ``wd_incr_steps=0`` with a ramp, a negative ``increment``) are
rejected up front; ``load_state_dict`` checks every key before it changes anything, applies the
checkpoint's weight-decay values before it re-computes the groups (Megatron applies them one
step late), and restores ``num_steps`` instead of adding it to the current count.

optzoo additions, for torch-style callers (HF Trainer, Lightning): ``step()`` defaults to
``increment=1``, and ``get_last_lr()`` returns each group's lr as of the last step.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import torch

from optzoo._common import finite_number, invalid, show_value

__all__ = [
    "LrDecayStyle",
    "OptimizerParamScheduler",
    "STATE_KEYS",
    "WdIncrStyle",
    "WsdDecayStyle",
    "get_canonical_lr_for_logging",
    "lr_at",
    "wd_at",
]

logger = logging.getLogger(__name__)

LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WsdDecayStyle = Literal["exponential", "linear", "cosine", "minus_sqrt"]
WdIncrStyle = Literal["constant", "linear", "cosine"]

STATE_KEYS: tuple[str, ...] = (
    "max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps",
    "min_lr", "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps",
)  # fmt: skip
"""Megatron-Core's state-dict keys, in its order (it saves no WSD or ``init_lr`` key)."""

_LEGACY_KEYS: dict[str, tuple[str, ...]] = {
    "max_lr": ("start_lr", "max_lr"),
    "min_lr": ("min_lr",),
    "lr_warmup_steps": ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
    "lr_decay_steps": ("end_iter", "decay_steps", "lr_decay_steps"),
    "lr_decay_style": ("decay_style", "lr_decay_style"),
    "num_steps": ("num_iters", "num_steps"),
}
"""Where Megatron-Core reads each key from, first found wins (older checkpoints' names first)."""

_WD_KEYS: tuple[str, ...] = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")
"""Read only when the checkpoint has ``start_wd`` (older checkpoints have no wd schedule)."""


def _fail(name: str, problem: str, got: str, expected: str) -> ValueError:
    return invalid(f"OptimizerParamScheduler.{name}", problem, got, expected)


def lr_at(
    num_steps: int,
    *,
    init_lr: float,
    max_lr: float,
    min_lr: float,
    lr_warmup_steps: int,
    lr_decay_steps: int,
    lr_decay_style: LrDecayStyle,
    wsd_decay_steps: int | None = None,
    lr_wsd_decay_style: WsdDecayStyle | None = None,
) -> float:
    """The learning rate after ``num_steps`` steps (Megatron-Core's ``get_lr``, same float ops).

    Linear warmup from ``init_lr`` to ``max_lr`` while ``num_steps <= lr_warmup_steps`` (when
    ``lr_warmup_steps > 0``); then ``max_lr`` for ``constant``; ``min_lr`` once past
    ``lr_decay_steps``; otherwise ``min_lr + coeff * (max_lr - min_lr)`` with ``coeff`` from the
    style, over ``ratio = (num_steps - warmup) / (decay_steps - warmup)``: ``1 - ratio``
    (linear), ``(1 + cos(pi * ratio)) / 2`` (cosine), or for WSD 1 until the last
    ``wsd_decay_steps`` steps, then the WSD style over their own ratio ``r``: ``2 * 0.5**r - 1``
    (exponential), ``1 - r``, ``(1 + cos(pi * r)) / 2`` or ``1 - sqrt(r)`` (minus_sqrt).
    ``inverse-square-root`` is ``max(min_lr, max_lr * sqrt(max(warmup, 1) / max(num_steps, 1)))``.

    Example:
        >>> lr_at(6, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=4,
        ...       lr_decay_steps=8, lr_decay_style="linear")
        0.5
    """
    if lr_warmup_steps > 0 and num_steps <= lr_warmup_steps:
        return init_lr + ((max_lr - init_lr) * float(num_steps) / float(lr_warmup_steps))
    if lr_decay_style == "constant":
        return max_lr
    if num_steps > lr_decay_steps:
        return min_lr
    if lr_decay_style == "inverse-square-root":
        warmup_steps = max(lr_warmup_steps, 1)
        steps = max(num_steps, 1)
        lr: float = max_lr * warmup_steps**0.5 / (steps**0.5)
        return max(min_lr, lr)
    decay_ratio = float(num_steps - lr_warmup_steps) / float(lr_decay_steps - lr_warmup_steps)
    if lr_decay_style == "linear":
        coeff = 1.0 - decay_ratio
    elif lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    elif lr_decay_style == "WSD" and wsd_decay_steps is not None:
        anneal_start = lr_decay_steps - wsd_decay_steps
        if num_steps <= anneal_start:
            coeff = 1.0
        else:
            ratio = float(num_steps - anneal_start) / float(wsd_decay_steps)
            if lr_wsd_decay_style == "linear":
                coeff = 1.0 - ratio
            elif lr_wsd_decay_style == "cosine":
                coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
            elif lr_wsd_decay_style == "exponential":
                coeff = (2.0 * math.pow(0.5, ratio)) - 1.0
            elif lr_wsd_decay_style == "minus_sqrt":
                coeff = 1.0 - math.sqrt(ratio)
            else:
                raise _fail("lr_wsd_decay_style", "unknown WSD decay style", repr(lr_wsd_decay_style), f"one of {list(get_args(WsdDecayStyle))}")
    else:
        got = f"lr_decay_style={lr_decay_style!r}, wsd_decay_steps={wsd_decay_steps!r}"
        raise _fail("lr_decay_style", "unknown decay style, or WSD without wsd_decay_steps", got, f"one of {list(get_args(LrDecayStyle))}")
    return min_lr + coeff * (max_lr - min_lr)


def wd_at(num_steps: int, *, start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: WdIncrStyle) -> float:
    """The weight decay after ``num_steps`` steps (Megatron-Core's ``get_wd``, same float ops).

    ``end_wd`` once past ``wd_incr_steps`` and for ``constant``; otherwise
    ``start_wd + coeff * (end_wd - start_wd)`` with ``coeff = ratio`` (linear) or
    ``(1 + cos(pi * (1 - ratio))) / 2`` (cosine), ``ratio = num_steps / wd_incr_steps``.

    Example:
        >>> wd_at(2, start_wd=0.0, end_wd=0.5, wd_incr_steps=8, wd_incr_style="linear")
        0.125
    """
    if num_steps > wd_incr_steps or wd_incr_style == "constant":
        return end_wd
    incr_ratio = float(num_steps) / float(wd_incr_steps)
    if wd_incr_style == "linear":
        coeff = incr_ratio
    elif wd_incr_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
    else:
        raise _fail("wd_incr_style", "unknown weight-decay increment style", repr(wd_incr_style), f"one of {list(get_args(WdIncrStyle))}")
    return start_wd + coeff * (end_wd - start_wd)


def get_canonical_lr_for_logging(param_groups: Sequence[Mapping[str, Any]]) -> float | None:
    """The lr of the first group with ``default_config=True`` (stepping with the base config), or
    ``None`` when there is none: the one lr to log, as Megatron-Core's helper of the same name.

    Groups on a rank that holds none of their params still carry the lr the scheduler set.

    Example:
        >>> get_canonical_lr_for_logging([{"lr": 0.1, "default_config": False}, {"lr": 0.3, "default_config": True}])
        0.3
        >>> get_canonical_lr_for_logging([{"lr": 0.1}]) is None
        True
    """
    for group in param_groups:
        if group.get("default_config", False):
            lr: float | None = group.get("lr")
            return lr
    return None


def _check_number(name: str, value: Any) -> None:
    if not finite_number(value):
        raise _fail(name, "must be a finite number", _shown(value), "a finite float")


def _check_steps(name: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, "must be a whole number of steps", _shown(value), "an int" + (" or None" if optional else ""))


def _shown(value: Any) -> str:
    return f"{show_value(value)} ({type(value).__name__})"


def _validate(values: Mapping[str, Any]) -> None:
    """Megatron-Core's constructor asserts, plus the inputs it would trip over later (wrong types
    and non-finite values among them, which would otherwise fail in a comparison or anneal to NaN)."""
    for name in ("use_checkpoint_opt_param_scheduler", "override_opt_param_scheduler"):
        if name in values and not isinstance(values[name], bool):
            raise _fail(name, "must be a bool", _shown(values[name]), "True or False")
    for name in ("init_lr", "max_lr", "min_lr", "start_wd", "end_wd"):
        _check_number(name, values[name])
    for name in ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps"):
        _check_steps(name, values[name])
    _check_steps("wsd_decay_steps", values.get("wsd_decay_steps"), optional=True)
    init_lr, max_lr, min_lr = values["init_lr"], values["max_lr"], values["min_lr"]
    if not min_lr >= 0.0:
        raise _fail("min_lr", "must be >= 0", repr(min_lr), "a float >= 0")
    if not max_lr >= min_lr:
        raise _fail("max_lr", "must be >= min_lr", f"max_lr={max_lr!r}, min_lr={min_lr!r}", "max_lr >= min_lr")
    if not 0.0 <= init_lr <= max_lr:
        raise _fail("init_lr", "must lie in [0, max_lr]", f"init_lr={init_lr!r}, max_lr={max_lr!r}", "0 <= init_lr <= max_lr")
    warmup, decay = values["lr_warmup_steps"], values["lr_decay_steps"]
    if not decay > 0:
        raise _fail("lr_decay_steps", "must be > 0", repr(decay), "an int > 0")
    if not 0 <= warmup < decay:
        raise _fail(
            "lr_warmup_steps", "must lie in [0, lr_decay_steps)",
            f"lr_warmup_steps={warmup!r}, lr_decay_steps={decay!r}", "0 <= lr_warmup_steps < lr_decay_steps",
        )  # fmt: skip
    style = values["lr_decay_style"]
    if style not in get_args(LrDecayStyle):
        raise _fail("lr_decay_style", "unknown decay style", repr(style), f"one of {list(get_args(LrDecayStyle))}")
    if style == "WSD":
        wsd_steps, wsd_style = values["wsd_decay_steps"], values["lr_wsd_decay_style"]
        if wsd_steps is None or not wsd_steps >= 0:
            raise _fail("wsd_decay_steps", "must be an int >= 0 with lr_decay_style='WSD'", repr(wsd_steps), "an int >= 0")
        # The anneal is the last wsd_decay_steps before lr_decay_steps: starting inside the warmup, it would
        # jump, when the warmup ends, to a partly annealed lr (Megatron-Core does not check this).
        if wsd_steps > decay - warmup:
            raise _fail(
                "wsd_decay_steps", "the anneal must fit in the decay window after the warmup",
                f"wsd_decay_steps={wsd_steps!r}, lr_decay_steps={decay!r}, lr_warmup_steps={warmup!r}",
                f"wsd_decay_steps <= lr_decay_steps - lr_warmup_steps = {decay - warmup}",
            )  # fmt: skip
        if wsd_style not in get_args(WsdDecayStyle):
            raise _fail(
                "lr_wsd_decay_style", "unknown WSD decay style (required with lr_decay_style='WSD')",
                repr(wsd_style), f"one of {list(get_args(WsdDecayStyle))}",
            )  # fmt: skip
    start_wd, end_wd = values["start_wd"], values["end_wd"]
    if not start_wd >= 0.0:
        raise _fail("start_wd", "must be >= 0", repr(start_wd), "a float >= 0")
    if not end_wd >= start_wd:
        raise _fail("end_wd", "must be >= start_wd", f"start_wd={start_wd!r}, end_wd={end_wd!r}", "end_wd >= start_wd")
    wd_style, wd_steps = values["wd_incr_style"], values["wd_incr_steps"]
    if wd_style not in get_args(WdIncrStyle):
        raise _fail("wd_incr_style", "unknown weight-decay increment style", repr(wd_style), f"one of {list(get_args(WdIncrStyle))}")
    # Megatron divides by wd_incr_steps at step 0 for a ramp: 0 would be a ZeroDivisionError.
    if not (wd_steps > 0 if wd_style != "constant" else wd_steps >= 0):
        bound = "> 0" if wd_style != "constant" else ">= 0"
        raise _fail("wd_incr_steps", f"must be {bound} with wd_incr_style={wd_style!r}", repr(wd_steps), f"an int {bound}")


def _named(param_group: Mapping[str, Any]) -> str:
    names = param_group.get("param_names") or []
    return f"param group ({names[0]}, ...)" if names else "param group"


def _describe(param_group: Mapping[str, Any], index: int | None = None) -> str:
    """``param group #i (first, second, third, ...)``: its index and first param names, where known."""
    names = [str(name) for name in param_group.get("param_names") or []]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    label = "param group" if index is None else f"param group #{index}"
    return f"{label} ({shown})" if names else label


class OptimizerParamScheduler:
    """Anneals each param group's learning rate and weight decay, as Megatron-Core does.

    Every :meth:`step` sets, for each group of ``optimizer.param_groups``,
    ``lr = lr_at(num_steps, max_lr=group['max_lr'], min_lr=group['min_lr'], ...)`` and
    ``weight_decay = wd_at(num_steps, start_wd=group['start_wd'], end_wd=group['end_wd'], ...)
    * group['wd_mult']``. A key the group lacks (a plain torch optimizer), or holds as ``None``,
    means the scheduler's value (``wd_mult``: 1.0). ``init_lr`` and the step counts are shared.

    As in Megatron-Core, groups built by :func:`optzoo.get_optimizer` always carry ``max_lr``
    (the group's effective ``lr``), so the scheduler's ``max_lr`` is a fallback for them, while
    they carry ``start_wd``/``end_wd`` only where an override sets them (or sets the group's
    ``weight_decay``, which then stands for the one it leaves unset): the scheduler's
    ``start_wd``/``end_wd``, times ``wd_mult``, reach every other group.

    optzoo additions: :meth:`step` defaults to ``increment=1`` and :meth:`get_last_lr` returns
    each group's lr, as torch's ``LRScheduler`` does, for torch-style training loops.

    Args:
        optimizer: Any ``torch.optim.Optimizer``, e.g. the one ``get_optimizer`` returns (its
            ``param_groups`` are the inner optimizers' real groups).
        init_lr: lr at step 0, the start of the linear warmup.
        max_lr: Peak lr (end of warmup), for groups without ``max_lr``.
        min_lr: Floor of the decay, for groups without ``min_lr`` (or with ``None``).
        lr_warmup_steps: Warmup length in steps; 0 for none. Must be < ``lr_decay_steps``.
        lr_decay_steps: Step at which the decay reaches ``min_lr`` (counted from 0, warmup
            included); the lr is ``min_lr`` after it, except for ``constant``.
        lr_decay_style: ``constant``, ``linear``, ``cosine``, ``inverse-square-root`` or ``WSD``.
        start_wd: Weight decay at step 0, for groups without ``start_wd``.
        end_wd: Weight decay from step ``wd_incr_steps`` on, for groups without ``end_wd``.
        wd_incr_steps: Length of the weight-decay ramp in steps.
        wd_incr_style: ``constant`` (needs ``start_wd == end_wd``), ``linear`` or ``cosine``.
        use_checkpoint_opt_param_scheduler: On ``load_state_dict``, the checkpoint's values win.
        override_opt_param_scheduler: On ``load_state_dict``, this scheduler's values win.
            Megatron's default for the other flag is True, so pass it False with this one.
        wsd_decay_steps: WSD only: length of the final anneal, the last steps before
            ``lr_decay_steps``. Read only with ``lr_decay_style='WSD'``, as in Megatron.
        lr_wsd_decay_style: WSD only: ``exponential``, ``linear``, ``cosine`` or ``minus_sqrt``.

    Raises:
        ValueError: A value Megatron-Core asserts against (``min_lr < 0``, ``max_lr < min_lr``,
            ``init_lr > max_lr``, ``lr_decay_steps <= 0``, ``lr_warmup_steps >= lr_decay_steps``,
            WSD without ``wsd_decay_steps``, ``start_wd < 0``, ``end_wd < start_wd``, both
            checkpoint flags), an unknown style, a negative count, ``wd_incr_steps=0`` with a
            ramp, a WSD anneal longer than the decay window after the warmup
            (``wsd_decay_steps > lr_decay_steps - lr_warmup_steps``), ``constant`` wd with a
            group's ``start_wd != end_wd``, or a group whose own bounds and this scheduler's
            fallbacks mix into ``min_lr > max_lr``, ``init_lr > max_lr``, ``start_wd > end_wd``
            or an infinite weight decay (:meth:`check_group`).

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        >>> scheduler = OptimizerParamScheduler(
        ...     optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=2, lr_decay_steps=4,
        ...     lr_decay_style="linear", start_wd=0.1, end_wd=0.1, wd_incr_steps=4, wd_incr_style="constant")
        >>> lrs = []
        >>> for _ in range(5):
        ...     scheduler.step(1)
        ...     lrs.append(optimizer.param_groups[0]["lr"])
        >>> lrs
        [0.5, 1.0, 0.5, 0.0, 0.0]
        >>> scheduler.get_last_lr()
        [0.0]
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: LrDecayStyle,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: WdIncrStyle,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: WsdDecayStyle | None = None,
    ) -> None:
        values = dict(locals())  # every argument, to validate the same way load_state_dict does
        del values["self"], values["optimizer"]
        _validate(values)
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise _fail(
                "override_opt_param_scheduler", "cannot be combined with use_checkpoint_opt_param_scheduler",
                "both True", "at most one of them True (use_checkpoint_opt_param_scheduler defaults to True)",
            )  # fmt: skip
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style: LrDecayStyle = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style: WdIncrStyle = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self._last_lr: list[float] = []
        self.step(0)
        logger.info("> learning rate decay style: %s", self.lr_decay_style)

    def get_wd(self, param_group: Mapping[str, Any] | None = None) -> float:
        """Weight decay at the current step, before ``wd_mult``; a group's own range wins.

        Raises:
            ValueError: ``wd_incr_style='constant'`` with ``start_wd != end_wd`` (the group's,
                when it has them), checked while the ramp lasts, as in Megatron-Core.
        """
        group = param_group or {}
        start_wd, end_wd = self._bound(group, "start_wd"), self._bound(group, "end_wd")
        constant = self.wd_incr_style == "constant"
        if constant and self.num_steps <= self.wd_incr_steps and start_wd[0] != end_wd[0]:
            where = _named(group) if param_group is not None else "scheduler"
            raise _fail(
                "wd_incr_style", "'constant' needs start_wd == end_wd",
                f"start_wd={start_wd[0]!r}, end_wd={end_wd[0]!r} ({where})", "equal values, or wd_incr_style 'linear' or 'cosine'",
            )  # fmt: skip
        return wd_at(self.num_steps, start_wd=start_wd[0], end_wd=end_wd[0], wd_incr_steps=self.wd_incr_steps, wd_incr_style=self.wd_incr_style)

    def _bound(self, group: Mapping[str, Any], name: str) -> tuple[Any, str]:
        """A group's ``max_lr``/``min_lr``/``start_wd``/``end_wd`` and where it came from: its own key, or
        (absent or ``None``) the scheduler's argument, as Megatron-Core's ``get_lr``/``get_wd`` read them."""
        if group.get(name) is None:
            return getattr(self, name), f"the scheduler's {name}"
        return group[name], f"the group's {name}"

    def check_group(self, param_group: Mapping[str, Any], index: int | None = None) -> None:
        """Refuse a group whose own bounds and the scheduler's fallbacks, mixed, give a schedule that
        runs the wrong way: ``min_lr > max_lr`` (the decay would raise the lr up to ``min_lr``),
        ``init_lr > max_lr`` with a warmup (it would warm *down*), ``start_wd > end_wd`` with a
        ``linear`` or ``cosine`` ramp (weight decay would fall), or a weight decay times
        ``wd_mult`` that overflows to inf. Megatron-Core asserts the first three for its own
        arguments only; a group that sets ``min_lr`` alone (or ``max_lr`` alone) escapes them there.

        Called for every group before each :meth:`step` (the constructor's included) changes anything.

        Raises:
            ValueError: Naming the group (its index and first param names), both values and where
                each came from (the group's key or the scheduler's argument).
        """
        where = _describe(param_group, index)
        max_lr, min_lr = self._bound(param_group, "max_lr"), self._bound(param_group, "min_lr")
        start_wd, end_wd = self._bound(param_group, "start_wd"), self._bound(param_group, "end_wd")
        for name, (value, source) in (("max_lr", max_lr), ("min_lr", min_lr), ("start_wd", start_wd), ("end_wd", end_wd)):
            if not finite_number(value) or not value >= 0:
                raise _fail(name, f"must be a finite number >= 0 ({where})", f"{show_value(value)} ({source})", "a float >= 0")
        if not min_lr[0] <= max_lr[0]:
            raise _fail(
                "min_lr", f"must not exceed max_lr ({where}): the decay would raise the lr to min_lr",
                f"min_lr={min_lr[0]!r} ({min_lr[1]}), max_lr={max_lr[0]!r} ({max_lr[1]})",
                "min_lr <= max_lr: set both in the group's override, or change the scheduler's",
            )  # fmt: skip
        if self.lr_warmup_steps > 0 and not self.init_lr <= max_lr[0]:
            raise _fail(
                "init_lr", f"must not exceed max_lr ({where}): the warmup would lower the lr",
                f"init_lr={self.init_lr!r} (the scheduler's init_lr), max_lr={max_lr[0]!r} ({max_lr[1]})",
                "init_lr <= every group's max_lr (e.g. init_lr=0.0)",
            )  # fmt: skip
        if self.wd_incr_style != "constant" and not start_wd[0] <= end_wd[0]:
            raise _fail(
                "start_wd", f"must not exceed end_wd with wd_incr_style={self.wd_incr_style!r} ({where}): the weight decay would fall",
                f"start_wd={start_wd[0]!r} ({start_wd[1]}), end_wd={end_wd[0]!r} ({end_wd[1]})",
                "start_wd <= end_wd: set both in the group's override, or change the scheduler's",
            )  # fmt: skip
        wd_mult = param_group.get("wd_mult", 1.0)
        if not finite_number(wd_mult) or not wd_mult >= 0:
            raise _fail("wd_mult", f"must be a finite number >= 0 ({where})", show_value(wd_mult), "a float >= 0")
        for value, source in (start_wd, end_wd):
            if not math.isfinite(value * wd_mult):
                raise _fail(
                    "weight_decay", f"overflows: {source} times the group's wd_mult is inf ({where})",
                    f"{value!r} * wd_mult={wd_mult!r}", "a product below float max (1.8e308)",
                )  # fmt: skip


    def get_lr(self, param_group: Mapping[str, Any]) -> float:
        """Learning rate at the current step for ``param_group`` (its ``max_lr``/``min_lr`` win)."""
        return lr_at(
            self.num_steps,
            init_lr=self.init_lr,
            max_lr=self._bound(param_group, "max_lr")[0],
            min_lr=self._bound(param_group, "min_lr")[0],
            lr_warmup_steps=self.lr_warmup_steps,
            lr_decay_steps=self.lr_decay_steps,
            lr_decay_style=self.lr_decay_style,
            wsd_decay_steps=self.wsd_decay_steps,
            lr_wsd_decay_style=self.lr_wsd_decay_style,
        )

    def step(self, increment: int = 1) -> None:
        """Advance ``increment`` steps and set every group's ``lr`` and ``weight_decay``.

        Empty groups are updated too, as in Megatron-Core (a rank may hold empty groups).

        Args:
            increment: Steps to advance, >= 0. Megatron-Core requires it (its training loop passes
                1); the default of 1 is an optzoo addition, so that torch-style callers (HF
                Trainer, Lightning) can call ``scheduler.step()``.

        Raises:
            ValueError: ``increment < 0``, or a group that :meth:`check_group` refuses (nothing changes).
        """
        if isinstance(increment, bool) or not isinstance(increment, int) or increment < 0:
            raise _fail("step", "increment must be a whole number of steps >= 0", _shown(increment), "an int >= 0")
        self.num_steps += increment
        try:  # every group's values first: a refused group leaves every group and the count as they were
            values = []
            for index, param_group in enumerate(self.optimizer.param_groups):
                self.check_group(param_group, index)
                values.append((self.get_lr(param_group), self.get_wd(param_group) * param_group.get("wd_mult", 1.0)))
        except ValueError:
            self.num_steps -= increment
            raise
        for param_group, (lr, weight_decay) in zip(self.optimizer.param_groups, values):
            param_group["lr"] = lr
            param_group["weight_decay"] = weight_decay
        self._last_lr = [param_group["lr"] for param_group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """Each group's lr as set by the last :meth:`step` (or the constructor), in group order.

        An optzoo addition (Megatron-Core has none), with the meaning of torch's
        ``LRScheduler.get_last_lr``, for loggers and trainers that call it.
        """
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        """Megatron-Core's keys (:data:`STATE_KEYS`); ``init_lr`` and WSD settings are not saved."""
        return {key: getattr(self, key) for key in STATE_KEYS}

    def _check_and_set(self, cls_value: Any, sd_value: Any, name: str) -> Any:
        """The value to keep for ``name``: ours with override, the checkpoint's otherwise."""
        if self.override_opt_param_scheduler:
            logger.info(" > overriding %s value to %s", name, cls_value)
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise _fail(
                name, "the checkpoint and this scheduler disagree",
                f"{sd_value!r} in the checkpoint, {cls_value!r} in the scheduler",
                "equal values, or use_checkpoint_opt_param_scheduler=True (the checkpoint's win) "
                "or override_opt_param_scheduler=True (the scheduler's win)",
            )  # fmt: skip
        logger.info(" > using checkpoint value %s for %s", sd_value, name)
        return sd_value

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the step count and check or take the schedule's settings.

        Accepts Megatron-Core's keys and its legacy ones (``start_lr``, ``warmup_iter``,
        ``warmup_steps``, ``end_iter``, ``decay_steps``, ``decay_style``, ``num_iters``); the
        weight-decay keys are optional, as in older checkpoints. Everything is checked before
        anything changes; then the groups' ``lr`` and ``weight_decay`` are set for the restored step.

        Raises:
            KeyError: A required key is missing.
            ValueError: ``state_dict`` is not a dict.
            ValueError: A setting differs while neither flag allows it (the message names the
                key and both values), or the settings taken from the checkpoint are invalid.
        """
        if not isinstance(state_dict, Mapping):
            raise _fail("state_dict", "must be a dict", _shown(state_dict), "OptimizerParamScheduler.state_dict()")
        found: dict[str, Any] = {}
        for key, sources in _LEGACY_KEYS.items():
            source = next((s for s in sources if s in state_dict), None)
            if source is None:
                raise KeyError(
                    f"`state_dict`: missing scheduler key {key!r}; got keys {sorted(state_dict)}; "
                    f"expected one of {list(sources)} (from OptimizerParamScheduler.state_dict())"
                )
            found[key] = state_dict[source]
        if "start_wd" in state_dict:
            missing = [key for key in _WD_KEYS if key not in state_dict]
            if missing:
                raise KeyError(
                    f"`state_dict`: has start_wd but misses {missing}; got keys {sorted(state_dict)}; "
                    f"expected all of {list(_WD_KEYS)} or none"
                )
            found.update({key: state_dict[key] for key in _WD_KEYS})
        num_steps = found.pop("num_steps")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not num_steps >= 0:
            raise ValueError(f"`state_dict`: `num_steps` must be >= 0; got {num_steps!r}; expected an int >= 0")
        settings = {key: self._check_and_set(getattr(self, key), value, key) for key, value in found.items()}
        current = {key: getattr(self, key) for key in ("init_lr", "wsd_decay_steps", "lr_wsd_decay_style", *STATE_KEYS)}
        _validate({**current, **settings})
        # The schedule at the restored step is computed on a copy first: a group whose own range
        # the restored settings refuse (``get_lr``/``get_wd`` raise) leaves this scheduler and the
        # groups as they were.
        candidate = copy.copy(self)
        for key, value in settings.items():
            setattr(candidate, key, float(value) if key == "max_lr" else value)
        candidate.num_steps = num_steps
        for param_group in self.optimizer.param_groups:
            candidate.get_lr(param_group)
            candidate.get_wd(param_group)
        for key, value in settings.items():
            setattr(self, key, float(value) if key == "max_lr" else value)
        self.num_steps = 0
        self.step(num_steps)
