"""Per-group telemetry of each step (``OptimizerConfig.log_metrics``), computed on the device.

Per param group, named ``<algorithm>/<k>`` (the ``k``-th group of that algorithm in routing order,
so keys stay the same across runs of one routing: ``muon/0/grad_norm``, ``adam/1/update_rms``):

* ``grad_norm``: L2 norm of the group's unscaled gradients before clipping (the groups' norms
  make up the global norm ``step`` returns: the square root of the sum of their squares);
* ``update_rms``, ``param_rms`` and ``update_rms_to_param_rms``: RMS of the update (the main param
  after the inner step minus before it: weight decay included) and of the param before it, over
  the group's elements;
* Muon family (the registry's ``orthogonalized`` family): ``orthogonalized``, the count of params
  that got an orthogonalised update in the step; and, for optzoo's Muon and its variants,
  ``orthogonality_error``, :func:`~optzoo.optimizers.newton_schulz.orthogonality_error` of one
  Newton–Schulz output per group (its first matrix in the step's plan; NaN when no rank
  orthogonalised it whole, as under ``tp_mode='distributed'``).

``log_metrics="per_param"`` adds ``<group>/<param name>/grad_norm``, ``.../update_rms``,
``.../param_rms`` and ``.../update_rms_to_param_rms``.

Nothing is read back to the host: :meth:`~optzoo.MixedPrecisionOptimizer.metrics` returns 0-dim
tensors; :func:`metrics_to_floats` reads them all in one transfer when asked. Under a process group
every sum is reduced over it in one ``all_reduce`` (FSDP2 replicas counted once, as in the global
grad norm), so every rank reports the single process's values. The update is measured exactly, by
a copy of the main params this rank steps (kept between steps: one param-sized buffer) taken
before the inner optimizers run and subtracted after; with telemetry off nothing of this exists
and the step checks one attribute.

A Muon-routed param that got no orthogonalised update in the first step (no gradient, or stepped
by another path) is named in a :class:`NotOrthogonalizedWarning`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from optzoo._common import INTERNAL_FILES, local_shard, shorten
from optzoo.optimizers.muon import Muon, OrthogonalizationRecord
from optzoo.optimizers.registry import get_spec
from optzoo.wrapper.param_map import ParamEntry, ParamMap

if TYPE_CHECKING:
    from optzoo.wrapper.mixed_precision import MixedPrecisionOptimizer

__all__ = ["NotOrthogonalizedWarning", "Telemetry", "group_keys", "metrics_to_floats"]


class NotOrthogonalizedWarning(UserWarning):
    """A param routed to a Muon-family optimizer got no orthogonalised update in the first step."""


def metrics_to_floats(metrics: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """``metrics`` (from :meth:`~optzoo.MixedPrecisionOptimizer.metrics`) as Python floats, read
    from the device in one transfer: for loggers that want numbers (TensorBoard, W&B take either).

    Example:
        >>> metrics_to_floats({"adam/0/grad_norm": torch.tensor(2.0), "muon/0/orthogonalized": 3.0})
        {'adam/0/grad_norm': 2.0, 'muon/0/orthogonalized': 3.0}
    """
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    read: dict[str, float] = {}
    if tensors:
        values = torch.stack([v.detach().reshape(()).to(torch.float64) for v in tensors.values()]).tolist()
        read = dict(zip(tensors, values, strict=True))
    return {k: read[k] if k in read else float(v) for k, v in metrics.items()}


def group_keys(param_groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each group's metric prefix, ``<algorithm>/<k>``: the ``k``-th group of its algorithm in order.

    Example:
        >>> group_keys([{"optimizer": "muon"}, {"optimizer": "adam"}, {"optimizer": "adam"}])
        ['muon/0', 'adam/0', 'adam/1']
    """
    seen: dict[str, int] = {}
    keys = []
    for group in param_groups:
        algorithm = str(group.get("optimizer", "group"))
        keys.append(f"{algorithm}/{seen.get(algorithm, 0)}")
        seen[algorithm] = seen.get(algorithm, 0) + 1
    return keys


_GROUP_METRICS = ("grad_norm", "update_rms", "param_rms", "update_rms_to_param_rms")


@dataclass(frozen=True, eq=False)
class _Layout:
    """What the sums are laid out over, fixed while the param map and the groups are."""

    param_map: ParamMap
    keys: list[str]
    muon_family: list[bool]
    instrumented: list[bool]  # stepped by optzoo's Muon (or a variant), which samples its Newton-Schulz output
    group_ids: list[int]  # id of each param group dict (where Muon's record keys its samples)
    numel: list[int]  # each group's elements, whole params on every rank
    counted: list[ParamEntry]  # the local entries this rank counts (FSDP2 replicas left out), in group order
    sizes: list[int]  # how many of ``counted`` each group has
    positions: torch.Tensor  # each counted entry's position in ``param_map.entries`` (per-param sums)
    group_numel: torch.Tensor  # ``numel`` on the device, float64
    param_numel: torch.Tensor  # each entry's whole numel on the device, float64


def _main_grad(entry: ParamEntry) -> torch.Tensor | None:
    main = entry.main
    assert main is not None  # local entries have one
    grad: torch.Tensor | None = getattr(main, "decoupled_grad", None) if entry.grad_target == "decoupled" else main.grad
    return grad


def _has_grad(entry: ParamEntry, param_map: ParamMap) -> bool:
    """Whether the param has a gradient this step: its main grad where this rank steps it, else
    the model's (the distributed optimizers keep every rank's model gradients)."""
    if entry.main is not None:
        return _main_grad(entry) is not None
    source = getattr(entry.model, "main_grad", None) if param_map.grad_source == "main_grad" else entry.model.grad
    return source is not None


def _squared_norms(tensors: Sequence[torch.Tensor | None], zero: torch.Tensor, positions: dict[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of each tensor (``None``: 0), in float64, as one vector: one foreach
    norm per dtype, accumulated in at least float32 (as the global grad norm is), stacked once per
    dtype (never a kernel per tensor). ``positions`` caches the index tensors of mixed cases on the device."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor is not None:
            by_dtype.setdefault(tensor.dtype, []).append(index)
    stacked = {
        dtype: torch.stack(torch._foreach_norm([local_shard(tensors[i]) for i in indices], 2, dtype=torch.promote_types(dtype, torch.float32)))  # type: ignore[arg-type]  # not None above
        for dtype, indices in by_dtype.items()
    }
    if len(by_dtype) == 1 and len(next(iter(by_dtype.values()))) == len(tensors):  # the usual case: one dtype, every tensor
        return next(iter(stacked.values())).to(torch.float64) ** 2
    out = zero.new_zeros(len(tensors), dtype=torch.float64)
    for dtype, indices in by_dtype.items():
        key = tuple(indices)
        if key not in positions:  # made once per pattern of missing gradients and dtypes
            positions[key] = _to_device(indices, torch.int64, zero.device)
        out.index_copy_(0, positions[key], stacked[dtype].to(torch.float64))
    return out**2


class Telemetry:
    """The sums of one step and the metrics made from them; owned by the wrapper while ``log_metrics`` is on."""

    def __init__(self, *, per_param: bool, interval: int = 1) -> None:
        self.per_param = per_param
        self.interval = interval
        self._steps = 0  # steps that reached the inner optimizers; measured when a multiple of ``interval``
        self.last: dict[str, torch.Tensor] = {}
        self.record = OrthogonalizationRecord()
        self._layout: _Layout | None = None
        self._before: list[torch.Tensor] = []  # the main params before the inner step, then minus after
        self._grad_squares: torch.Tensor | None = None
        self._param_squares: torch.Tensor | None = None
        self._other_orthogonalized: set[int] = set()
        self._checked_first_step = False
        self._positions: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def due(self) -> bool:
        """Whether this step is measured (``log_metrics_interval``)."""
        return self._steps % self.interval == 0

    # ---- layout -------------------------------------------------------------------------------

    def _layout_of(self, optimizer: MixedPrecisionOptimizer, device: torch.device) -> _Layout:
        groups, param_map = optimizer.param_groups, optimizer.param_map
        layout = self._layout
        if layout is not None and layout.param_map is param_map and len(layout.keys) == len(groups):
            return layout
        for opt in optimizer.optimizers:  # also after add_param_group, which may add an inner optimizer
            if isinstance(opt, Muon):
                opt.orthogonalization_record = self.record
        uncounted = optimizer.replicated
        counted = [e for e in param_map.local if id(e.model) not in uncounted]
        numel = [0] * len(groups)
        for entry in param_map.entries:
            numel[entry.group] += entry.model.numel()
        index = {id(e): i for i, e in enumerate(param_map.entries)}
        stepped_by_muon = {id(g) for opt in optimizer.optimizers if isinstance(opt, Muon) for g in opt.param_groups}
        layout = self._layout = _Layout(
            param_map=param_map,
            keys=group_keys(groups),
            muon_family=[get_spec(g["optimizer"]).family == "orthogonalized" if "optimizer" in g else False for g in groups],
            instrumented=[id(g) in stepped_by_muon for g in groups],
            group_ids=[id(g) for g in groups],
            numel=numel,
            counted=counted,
            sizes=[sum(1 for e in counted if e.group == g) for g in range(len(groups))],
            positions=_to_device([index[id(e)] for e in counted], torch.int64, device),
            group_numel=_to_device(numel, torch.float64, device),
            param_numel=_to_device([e.model.numel() for e in param_map.entries], torch.float64, device),
        )
        self._before = []
        self._positions.clear()
        return layout

    # ---- the step -----------------------------------------------------------------------------

    def grads_(self, optimizer: MixedPrecisionOptimizer, scale: torch.Tensor | None) -> None:
        """Record the gradients' squared norms, unscaled by ``scale`` (the loss scale they still carry)."""
        if not self.due:
            return
        device = optimizer._one.device
        layout = self._layout_of(optimizer, device)
        squares = _squared_norms([_main_grad(e) for e in layout.counted], optimizer._one.new_zeros(()), self._positions)
        if scale is not None:
            squares = squares / scale.double().reshape(()) ** 2
        self._grad_squares = squares

    def before_update_(self, optimizer: MixedPrecisionOptimizer) -> None:
        """Before the inner steps: the params' squared norms, and a copy of them."""
        if not self.due:
            return
        device = optimizer._one.device
        layout = self._layout_of(optimizer, device)
        if self._grad_squares is None:  # step_with_ready_grads without prepare_grads: the grads as they are
            self.grads_(optimizer, None)
        mains = [local_shard(e.main) for e in layout.counted]  # type: ignore[arg-type]  # local entries have one
        if len(self._before) != len(mains) or any(b.shape != m.shape or b.dtype != m.dtype for b, m in zip(self._before, mains)):
            self._before = [torch.empty_like(m) for m in mains]
        self._param_squares = _squared_norms(mains, optimizer._one.new_zeros(()), self._positions)
        if mains:
            torch._foreach_copy_(self._before, mains)
        self.record.start_step()  # a step that orthogonalises nothing leaves nothing behind
        # The sample of each Muon group: the first matrix of its first param with a gradient on any
        # rank, whichever rank steps it (one process samples the same one).
        sampled: dict[int, int] = {}
        for entry in layout.param_map.entries:
            group_id = layout.group_ids[entry.group]
            if layout.instrumented[entry.group] and group_id not in sampled and _has_grad(entry, layout.param_map):
                sampled[group_id] = id(entry.main) if entry.main is not None else 0  # 0: another rank's
        self.record.sampled_params = sampled
        self._other_orthogonalized = {
            id(p) for opt in optimizer.optimizers if not isinstance(opt, Muon)
            for g in opt.param_groups if g.get("optimizer") is not None and get_spec(g["optimizer"]).family == "orthogonalized"
            for p in g["params"] if p.grad is not None
        }  # fmt: skip  # e.g. torch.optim.Muon: it orthogonalises every param with a gradient

    def after_update_(self, optimizer: MixedPrecisionOptimizer, *, counts_here: bool) -> None:
        """After the inner steps: the update's sums, one reduction over the process group, the metrics.

        ``counts_here``: this rank adds its params' orthogonalised counts (under FSDP2 every rank steps
        every param, and only the group's first rank counts them)."""
        due, self._steps = self.due, self._steps + 1
        if not due:
            return
        layout = self._layout_of(optimizer, optimizer._one.device)
        grad_squares, param_squares = self._grad_squares, self._param_squares
        assert grad_squares is not None and param_squares is not None  # before_update_ ran
        self._grad_squares = self._param_squares = None
        mains = [local_shard(e.main) for e in layout.counted]  # type: ignore[arg-type]
        if mains:
            torch._foreach_sub_(self._before, mains)  # before - after: the update, negated
        zero = optimizer._one.new_zeros((), dtype=torch.float64)
        update_squares = _squared_norms(self._before, zero, self._positions)
        applied = self.record.applied | self._other_orthogonalized
        orthogonalized = [0.0] * len(layout.keys)
        for entry in layout.counted:
            if id(entry.main) in applied:
                orthogonalized[entry.group] += 1.0
        errors = [self.record.errors.get(group_id) for group_id in layout.group_ids]
        host = [1.0 if error is not None else 0.0 for error in errors] + (orthogonalized if counts_here else [0.0] * len(errors))
        per_group = [
            torch.stack([chunk.sum() for chunk in torch.split(squares, layout.sizes)]) if layout.keys else zero.new_zeros(0)
            for squares in (grad_squares, update_squares, param_squares)
        ]
        sums = [*per_group, torch.stack([zero if e is None else e.to(torch.float64).reshape(()) for e in errors]) if errors else zero.new_zeros(0)]
        sums.append(_to_device(host, torch.float64, zero.device))
        if self.per_param:
            count = len(layout.param_map.entries)
            for squares in (grad_squares, update_squares, param_squares):
                sums.append(zero.new_zeros(count).index_add_(0, layout.positions, squares))
        vector = torch.cat(sums)
        if optimizer.process_group is not None:
            dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=optimizer.process_group)
        self.last = self._metrics(layout, vector)
        if not self._checked_first_step:
            self._checked_first_step = True
            self._warn_not_orthogonalized(layout, applied)

    def _metrics(self, layout: _Layout, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        groups = len(layout.keys)
        grad, update, param, error, samples, orthogonalized = vector[: 6 * groups].view(6, groups)
        values = _rms_metrics(grad, update, param, layout.group_numel)
        error = error / samples  # NaN where no sample: 0 / 0
        table = torch.cat([values, orthogonalized[None], error[None]]).unbind(0)
        metrics: dict[str, torch.Tensor] = {}
        names = (*_GROUP_METRICS, "orthogonalized", "orthogonality_error")
        by_metric = [row.unbind(0) for row in table]
        for g, key in enumerate(layout.keys):
            for m, name in enumerate(_GROUP_METRICS):
                metrics[f"{key}/{name}"] = by_metric[m][g]
            if layout.muon_family[g]:
                metrics[f"{key}/{names[4]}"] = by_metric[4][g]
                if layout.instrumented[g]:
                    metrics[f"{key}/{names[5]}"] = by_metric[5][g]
        if self.per_param:
            entries = layout.param_map.entries
            count = len(entries)
            rest = vector[6 * groups :].view(3, count)
            per_param = _rms_metrics(rest[0], rest[1], rest[2], layout.param_numel).unbind(1)
            for entry, values_of in zip(entries, per_param):
                for name, value in zip(_GROUP_METRICS, values_of.unbind(0)):
                    metrics[f"{layout.keys[entry.group]}/{entry.name}/{name}"] = value
        return metrics

    def _warn_not_orthogonalized(self, layout: _Layout, applied: set[int]) -> None:
        for g, key in enumerate(layout.keys):
            if not layout.muon_family[g]:
                continue
            missed = [e.name for e in layout.param_map.local if e.group == g and id(e.main) not in applied]
            if missed:
                algorithm = key.rsplit("/", 1)[0]
                warnings.warn(
                    f"`{key}`: {len(missed)} param(s) routed to {algorithm} got no orthogonalised update in the first step; "
                    f"got {shorten(missed)}; expected every param of the group to be orthogonalised (a param without a "
                    "gradient, or one stepped by another path, is not): check requires_grad, the forward and the routing",
                    NotOrthogonalizedWarning,
                    skip_file_prefixes=INTERNAL_FILES,
                )


def _rms_metrics(grad: torch.Tensor, update: torch.Tensor, param: torch.Tensor, numel: torch.Tensor) -> torch.Tensor:
    """``(4, n)``: grad norm, update RMS, param RMS and their ratio from the sums of squares."""
    update_rms = (update / numel).sqrt()
    param_rms = (param / numel).sqrt()
    return torch.stack([grad.sqrt(), update_rms, param_rms, update_rms / param_rms])


def _to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host numbers as a vector on ``device`` without waiting for it: a pinned, non-blocking copy on
    CUDA (a pageable one would synchronise the stream)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
