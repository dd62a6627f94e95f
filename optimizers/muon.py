"""Muon: momentum SGD whose update is orthogonalised by Newton–Schulz, batched across matrices.

The math lives in pure functions (:mod:`optzoo.optimizers.muon_ops`: :func:`muon_scale_factor`,
:func:`decoupled_weight_decay_`, :func:`momentum_direction_`, :func:`qkv_blocks`, the matrix views)
and in :func:`optzoo.optimizers.newton_schulz.newton_schulz`; :class:`Muon` is the ``torch.optim`` shell, and its
step loop is shared with :class:`optzoo.optimizers.adaptive_muon.AdaptiveMuon` through named override
points (see :class:`Muon`).

A step is planned, then runs in three named stages, as dion's ``muon.py`` has them
(``muon_update_pre_orthogonalize``, Newton–Schulz, ``muon_update_post_orthogonalize``):

* plan (from shapes and settings alone, before any arithmetic): every matrix the step will
  orthogonalise (a whole param, one Q/K/V block of a split param, one matrix of a stack, or a
  flattened N-D param; see :func:`matrix_shape`) joins the batch of those
  with the same shape (``4096 × 1024`` and ``1024 × 4096`` are two batches: stacking them together
  would cost a strided transposed copy each way), dtype, device and Newton–Schulz settings;
* prepare, per param: decoupled weight decay and momentum give the direction to orthogonalise;
* orthogonalise, per batch: the matrices stacked, one batched
  :func:`~optzoo.optimizers.newton_schulz.newton_schulz` call, each scaled by ``_orthogonal_scale``;
* apply, per param: ``_finish_update``, then ``W ← W − lr · update``.

N-D params (``ndim >= 3``): with ``flatten=False`` (the default) a param is a stack of matrices
over its leading dims, such as a mixture-of-experts ``[experts, rows, cols]`` weight; each matrix
is orthogonalised and scaled as a 2-D param of its shape would be, and batched with every other
matrix of that shape. With ``flatten=True`` it is the one matrix ``(shape[0], prod(shape[1:]))``,
as Muon treats conv filters. Either way, momentum and weight decay stay param-shaped.

Batches run in order of first appearance. A param is prepared when the first batch holding one of
its matrices is reached and applied as soon as its last one is orthogonalised, so only the params
of batches in flight hold a direction (under FSDP2, a gathered whole matrix). With
``batched=False`` in a param group, each of its matrices is a batch of one: the plain per-tensor
path, tested equal to the batched one.

FSDP2 (``fully_shard``): a DTensor param's element-wise steps (weight decay, momentum, the final
update) run on this rank's shard, and its state is sharded like it. Newton–Schulz needs whole
matrices. With owner-computes (``fsdp_orthogonalize``; the default where it saves work), each
matrix of a dim-0-sharded param has one owner rank: per bucket of same-shape matrices, one
all-to-all brings the owners the directions' pieces, each owner orthogonalises its matrices,
batched, and one more all-to-all sends each rank its piece of the result
(:mod:`optzoo.optimizers.owner_compute`). The redundant path all-gathers each param's direction
(one all-gather per param and step), every rank orthogonalises every matrix, and keeps its shard.
Both give the single process's result, bit for bit.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, get_args, override

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import ParamsT, StateDict

from .._common import INTERNAL_FILES, MatrixView, check_choice, check_flag, describe_param
from .._common import PARAM_DTYPES as PARAM_DTYPES, local_shard as local_shard  # re-exported: callers import them from here
from ._checked import CheckedGroupsOptimizer, check_lr, lr_value
from .muon_ops import (  # re-exported: callers import them from here
    MuonScaleMode as MuonScaleMode,
    ScaleMode as ScaleMode,
    TorchAdjustLr as TorchAdjustLr,
    as_matrices as as_matrices,
    compute_dtype as compute_dtype,
    decoupled_weight_decay_ as decoupled_weight_decay_,
    from_matrices as from_matrices,
    gather_whole as gather_whole,
    matrix_shape as matrix_shape,
    momentum_direction_ as momentum_direction_,
    muon_scale_factor as muon_scale_factor,
    qkv_blocks as qkv_blocks,
    take_shard as take_shard,
)
from .newton_schulz import (
    LOOP_PRECISIONS,
    CoefficientType,
    MatmulPrecision,
    NewtonSchulzWarning,
    newton_schulz,
    orthogonality_error,
    schedule_problem,
)
from .newton_schulz_probe import ENV_SUBJECT, VARIANT_ENV, Kernel, KernelSetting, check_kernel_setting, choose_kernel, run_kernel
from .owner_compute import DEFAULT_BUCKET_SIZE, TPMode, check_bucket_size, orthogonalize_on_owners
from .owner_compute import OWNER_COMPUTES_MAX_SHARE as OWNER_COMPUTES_MAX_SHARE
from .state_layout import StateLayout, per_element

__all__ = [
    "FinishInput",
    "FsdpOrthogonalize",
    "OWNER_COMPUTES_MAX_SHARE",
    "Muon",
    "MuonScaleMode",
    "OrthogonalizationRecord",
    "PARAM_DTYPES",
    "ScaleMode",
    "TorchAdjustLr",
    "as_matrices",
    "compute_dtype",
    "decoupled_weight_decay_",
    "from_matrices",
    "gather_whole",
    "local_shard",
    "matrix_shape",
    "momentum_direction_",
    "muon_scale_factor",
    "qkv_blocks",
    "take_shard",
]

FsdpOrthogonalize = Literal["auto", "owner", "redundant"]
"""Who orthogonalises a matrix of an FSDP2-sharded param: its one owner rank, or every rank.

``auto`` takes ``owner`` when the owners' plan brings the busiest rank's Newton–Schulz FLOPs to
at most :data:`OWNER_COMPUTES_MAX_SHARE` of the total (so enough matrices to share out), and
``redundant`` otherwise (one matrix, or one dominant one: no compute to save, and owner-computes
adds a second round of communication)."""


FinishInput = Literal["orthogonal", "grad", "direction"]
"""An input of ``_finish_update`` that a variant may need whole under FSDP2 (``_whole_inputs``)."""


@dataclass(frozen=True, eq=False)
class _Block:
    """One matrix to orthogonalise: rows ``[start, start + rows)`` of each of ``groups`` row groups
    of matrix ``index`` of ``param``, seen as ``layout = (count, rows, cols)`` (:func:`matrix_shape`);
    or, with a ``view`` (how the forward multiplies by the param), its block ``index``."""

    param: torch.Tensor  # a DTensor under FSDP2 (its shape is the whole param's)
    group: dict[str, Any]
    layout: tuple[int, int, int]  # the param as a stack of matrices: (count, rows, cols)
    index: int  # which matrix of the stack; 0 for a 2-D or flattened param
    start: int
    rows: int
    groups: int
    view: MatrixView | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.groups * self.rows, self.layout[2]

    @property
    def whole(self) -> bool:
        """Whether the block is the whole param, so its output can serve as the param's (a view, no copy)."""
        return self.view is None and self.layout[0] == 1 and self.groups == 1 and self.rows == self.layout[1]

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This block of a param-shaped tensor (contiguous, or from :meth:`empty_output`), as a
        ``(groups, rows, cols)`` view; with a ``view``, its ``(out dims..., in dims...)`` view."""
        if self.view is not None:
            view = self.view
            blocks = full.reshape(view.split).permute(view.order)
            index = self.index
            position: list[int] = []
            for size in reversed([view.split[i] for i in view.blocks]):
                index, rest = divmod(index, size)
                position.append(rest)
            return blocks[tuple(reversed(position))]
        _, rows, cols = self.layout
        matrix = full.view(self.layout)[self.index]
        return matrix.view(self.groups, rows // self.groups, cols)[:, self.start : self.start + self.rows]

    def in_slot(self, slot: torch.Tensor) -> torch.Tensor:
        """A batch slot (stored in the block's own orientation) as a ``(groups, rows, cols)`` view,
        or, with a ``view``, shaped as :meth:`of` gives the block."""
        if self.view is not None:
            return slot.view([self.view.split[i] for i in self.view.rows + self.view.cols])
        return slot.view(self.groups, self.rows, self.layout[2])

    def empty_output(self, slot: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """An empty tensor shaped like ``like`` (the param's whole direction) to gather its blocks' outputs in.

        A stack's matrices take their slot's layout (Newton–Schulz returns tall matrices
        transposed), as a 2-D param's output is its slot: reductions over a matrix in
        ``_finish_update`` then round the same for both. QKV blocks are gathered row-major, and
        the blocks of a ``view`` in the param's own layout.
        """
        count, rows, cols = self.layout
        if self.view is not None:
            return torch.empty(like.shape, dtype=like.dtype, device=like.device)
        transposed = self.groups == 1 and slot.stride(-2) < slot.stride(-1)
        empty = torch.empty((count, cols, rows) if transposed else self.layout, dtype=like.dtype, device=like.device)
        return (empty.mT if transposed else empty).view(like.shape)


@dataclass(eq=False)
class OrthogonalizationRecord:
    """What the last step of a Muon-family optimizer orthogonalised, for telemetry.

    Kept only while ``optimizer.orthogonalization_record`` is set (``None``, the default, records
    nothing and costs one check per stage). The sample is one matrix per param group and step: the
    first matrix (or QKV block) of the group's first param with a gradient (or of ``sampled_params``'),
    the same on every rank, measured by
    whichever rank orthogonalises it, before the shape scale, with
    :func:`~optzoo.optimizers.newton_schulz.orthogonality_error` (one Gram product of that matrix).
    """

    applied: set[int] = field(default_factory=set)
    """ids of the params that got an orthogonalised update in the last step."""
    errors: dict[int, torch.Tensor] = field(default_factory=dict)
    """id of a param group -> the orthogonality error of its sampled matrix (0-dim, on the device),
    for the groups whose sample this rank orthogonalised."""
    targets: dict[int, tuple[int, int, int, tuple[int, int]]] = field(default_factory=dict)
    """id of a param group -> which block is its sample: ``(id(param), index, start, shape)``."""
    sampled_params: dict[int, int] | None = None
    """id of a param group -> id of the param to sample (set before the step by whoever knows every
    rank's params: the distributed optimizers step a share of them); ``None``: the first with a gradient."""

    def start_step(self) -> None:
        """Forget the last step."""
        self.applied.clear()
        self.errors.clear()
        self.targets.clear()

    def planned(self, block: _Block) -> None:
        """``block`` is next in the step's plan: its group's sample if the group has none yet."""
        wanted = self.sampled_params
        if wanted is None or wanted.get(id(block.group)) == id(block.param):
            self.targets.setdefault(id(block.group), _sample_key(block))

    def sample(self, orthogonal: torch.Tensor, planned: Sequence[_Block]) -> None:
        """Measure the slots of ``orthogonal`` (unscaled Newton–Schulz outputs of the ``planned``
        blocks) that are their group's sample."""
        for slot, block in zip(orthogonal, planned):
            key = id(block.group)
            if key not in self.errors and self.targets.get(key) == _sample_key(block) and slot.shape == block.shape:
                self.errors[key] = orthogonality_error(slot)


def _check_pinned_kernel(setting: str | None, group: dict[str, Any], subject: str) -> None:
    """Raise if ``setting`` pins a kernel coarser than the group's ``fp32_matmul_prec`` allows."""
    if setting is None or setting in ("probe", "auto"):
        return
    loop, allowed = Kernel.parse(setting, subject).loop, LOOP_PRECISIONS[group["fp32_matmul_prec"]]
    if loop not in allowed:
        raise ValueError(
            f"{subject}: runs {loop} matmuls, coarser than fp32_matmul_prec={group['fp32_matmul_prec']!r} allows; "
            f"got {setting!r}; expected a kernel with loop precision in {list(allowed)}, or 'probe' or 'auto'"
        )


def _sample_key(block: _Block) -> tuple[int, int, int, tuple[int, int]]:
    return id(block.param), block.index, block.start, block.shape


@dataclass(frozen=True, eq=False)
class _Prepared:
    """A param after the prepare stage: what orthogonalising its blocks and applying its update read."""

    param: torch.Tensor  # a DTensor under FSDP2
    local: torch.Tensor  # what the element-wise steps update: the param, or this rank's shard of it
    group: dict[str, Any]
    state: dict[str, Any]
    grad: torch.Tensor  # contiguous, in the compute dtype; this rank's shard under FSDP2
    direction: torch.Tensor  # the momentum (or Nesterov) direction, local like ``grad``
    matrix: torch.Tensor  # the whole direction to orthogonalise: ``direction``, or its all-gather under FSDP2


class Muon(CheckedGroupsOptimizer):
    r"""Muon (MomentUm Orthogonalized by Newton–Schulz) for matrices and stacks of them, batched across matrices.

    Per param :math:`W` with gradient :math:`G`, momentum :math:`\mu`, lr :math:`\eta`, weight
    decay :math:`\lambda`:

    .. math::
        W &\leftarrow W - \eta \lambda W \\
        M &\leftarrow M + (1 - \mu)(G - M), \qquad D = G + \mu (M - G) \text{ (Nesterov) or } M \\
        W &\leftarrow W - \eta \, s(r, c) \, e \, \mathrm{NS}(D)

    where :math:`\mathrm{NS}` is Newton–Schulz (:mod:`optzoo.optimizers.newton_schulz`), :math:`s` is
    :func:`muon_scale_factor` of the orthogonalised matrix's shape and :math:`e` is
    ``extra_scale_factor``. A param with a ``qkv_split_shapes`` attribute (say ``[q, kv, kv]``)
    in a group with ``split_qkv`` is orthogonalised (and scaled) per block (:func:`qkv_blocks`).

    An N-D param (``ndim >= 3``) is orthogonalised as :func:`matrix_shape` says. With
    ``flatten=False`` it is a stack of ``prod(shape[:-2])`` matrices of shape ``shape[-2:]`` (MoE
    experts ``[E, rows, cols]``): :math:`\mathrm{NS}` and :math:`s(r, c)` apply to each matrix
    :math:`D_i` on its own, exactly as to a 2-D param holding :math:`D_i`, and its matrices join the
    batches of every same-shape matrix of the step. With ``flatten=True`` it is the one matrix
    ``(shape[0], prod(shape[1:]))`` (conv filters ``[out, in, k...]``), scaled by :math:`s` of
    that shape. Weight decay and momentum are element-wise, so the N-D param and its
    ``momentum_buffer`` keep their shape.

    Paper: Jordan, *Muon*, https://kellerjordan.github.io/posts/muon/. Reference implementation:
    emerging-optimizers 0.3.0, https://github.com/NVIDIA-NeMo/Emerging-Optimizers/blob/v0.3.0/emerging_optimizers/orthogonalized_optimizers/muon.py
    (with ``orthogonalized_optimizer.py``, whose ``step`` it follows); the QKV split is
    Megatron-Core's ``TensorParallelMuon.orthogonalize``,
    https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/optimizer/emerging_optimizers.py.
    The N-D rules and the ``flatten`` option are dion's Muon,
    https://github.com/microsoft/dion/blob/0c205499e505dbf3da1a7a7d233f37a615021786/dion/muon.py
    (``muon_update_newton_schulz``, ``adjust_lr_spectral_norm``). Parity with upstream:
    tests/optimizers/test_muon.py; N-D params against per-matrix 2-D ones: tests/optimizers/test_muon_nd.py.

    Deviations from upstream:
        * Every setting is a param-group key (upstream keeps them on the instance and ignores
          group keys), so groups may differ, and ``state_dict()["param_groups"]`` records them.
        * Newton–Schulz is :func:`~optzoo.optimizers.newton_schulz.newton_schulz`, batched over the
          step's matrices: upstream's within float32 rounding, with safe normalisation (a 1e-20
          gradient still gives an orthogonal update), the Gram variant on wide float32 matrices
          at ``highest``, and a kernel (variant, loop precision, stacked or per matrix) chosen by
          timing those ``fp32_matmul_prec`` allows on this machine (:attr:`ns_variant`), where upstream
          runs bf16 under ``medium`` and fp32 otherwise.
        * Weight decay is decoupled only, with upstream's lr use (``W ← W − ηλW``); upstream's
          ``independent``, ``l2`` and ``palm`` methods and ``use_syrk`` are not offered.
        * Any float param dtype: float64 computes in float64; bf16 and fp16 params compute in
          float32 and keep ``momentum_buffer`` in float32 (upstream: float32 only).
        * N-D params are taken (upstream raises at ``step`` for any non-2-D param), as dion's Muon
          takes them; 1-D and 0-D params raise at construction. A flattened conv filter is scaled
          by :math:`s` of its flattened shape, as dion does (Keller Jordan's Muon uses the last two
          dims of the 4-D gradient). ``closure`` is supported.

    The step plans its batches (:meth:`_plan`), then runs them in order, in three stages (see the
    module docstring): :meth:`_prepare` each param the batch reaches first (weight decay, momentum,
    the FSDP2 all-gather), :meth:`_orthogonalize_batch` (stack, Newton–Schulz, scale), and
    :meth:`_apply` each param whose last block it held (``_finish_update``, then ``W ← W − η·update``).

    Override points, the named stages a variant changes and nothing else (as emerging-optimizers'
    ``OrthogonalizedOptimizer`` takes an ``orthogonalize`` function, and optax chains transforms;
    :class:`~optzoo.optimizers.adaptive_muon.AdaptiveMuon` and :mod:`optzoo.optimizers.orthogonalized`
    are the variants): :meth:`_check_group` (validate a group), :meth:`_init_state` (lazy state),
    :meth:`_orthogonalize` (a stack of directions to orthogonal matrices), :meth:`_scale_` and
    :meth:`_orthogonal_scale` (the factor on each orthogonalised matrix), :meth:`_finish_update`
    (from the param's orthogonalised update to the one applied with ``-lr``), :meth:`_after_update`
    (a projection of the weights after it) and :meth:`_whole_inputs` (which inputs of
    :meth:`_finish_update` it needs whole for FSDP2-sharded params). Batching, expert and QKV
    blocks, FSDP2 owner-computes, precision and state dicts are the loop's, shared by every variant.

    Args:
        params: params of 2 or more dims, or param groups; a group may set any argument below
            except ``params``.
        lr: learning rate :math:`\eta` >= 0. Default 3e-4, upstream's.
        momentum: :math:`\mu` in [0, 1) (Megatron's ``muon_momentum``). Default 0.95.
        weight_decay: :math:`\lambda` >= 0, decoupled. Default 0.01, upstream's.
        nesterov: Nesterov direction (``muon_nesterov``). Default False.
        fp32_matmul_prec: ``highest``, ``high`` or ``medium``: Newton–Schulz's ``matmul_precision``
            (``muon_fp32_matmul_prec``). Default ``medium``, upstream's and Megatron's.
        coefficient_type: Newton–Schulz coefficient set (``muon_coefficient_type``). Default ``quintic``.
        num_ns_steps: Newton–Schulz iterations >= 1 (``muon_num_ns_steps``). Default 5.
        scale_mode: ``spectral`` (default), ``unit_rms_norm`` or ``shape_scaling`` (``muon_scale_mode``),
            or torch's ``adjust_lr_fn`` names ``original``, ``match_rms_adamw``, ``spectral_unclamped``
            (:data:`TorchAdjustLr`; see :func:`muon_scale_factor`).
        extra_scale_factor: :math:`e` > 0 (``muon_extra_scale_factor``); 0.2 with ``spectral``
            roughly matches AdamW's update RMS (arXiv:2502.16982). Default 1.
        split_qkv: orthogonalise params carrying ``qkv_split_shapes`` per block
            (``muon_split_qkv``). Default True, Megatron's; params without the attribute are whole.
        batched: orthogonalise same-shape matrices in one batched call. Default True; False is
            the plain per-matrix path (same result; more, smaller matmuls).
        flatten: orthogonalise an N-D param as the one matrix ``(shape[0], prod(shape[1:]))``
            (conv filters) instead of as a stack of ``shape[-2:]`` matrices (dion's ``flatten``).
            Default False: the stack, right for MoE expert weights. 2-D params ignore it.
        fsdp_orthogonalize: who orthogonalises the matrices of FSDP2-sharded (DTensor) params:
            ``owner`` (each matrix once, on one rank; :mod:`optzoo.optimizers.owner_compute`),
            ``redundant`` (every rank gathers and orthogonalises every matrix) or ``auto``
            (default; see :data:`FsdpOrthogonalize`). The same result either way, bit for bit.
            An instance setting, not a group one.
        ns_variant: which Newton–Schulz kernel runs (:mod:`optzoo.optimizers.newton_schulz_probe`):
            ``probe`` (time the kernels ``fp32_matmul_prec`` allows on the actual shapes, once per
            device, dtype and shape class, and run the fastest), ``auto`` (the FLOPs and
            device-type rule) or a pinned kernel such as ``gram/ieee`` or ``standard/bf16``
            (never probes). Default ``None``: the ``OPTZOO_NS_VARIANT`` environment variable, else
            ``probe``. An instance setting, not a group one.

    Raises:
        TypeError: a flag is not a bool, a param's dtype is not in :data:`PARAM_DTYPES`, or
            ``qkv_split_shapes`` is not a sequence of ints.
        ValueError: a setting is out of range or unknown, a param has fewer than 2 dims, a param
            that is not 2-D has ``qkv_split_shapes``, or (during ``step``) a gradient is sparse.

    Warns:
        UserWarning: once per param, when its ``qkv_split_shapes`` do not divide its rows; the
            whole matrix is orthogonalised instead.

    Example:
        >>> w = torch.nn.Parameter(torch.randn(4, 8))
        >>> opt = Muon([w], lr=0.1, weight_decay=0.0, momentum=0.0, fp32_matmul_prec="highest")
        >>> before = w.detach().clone()
        >>> w.grad = torch.randn(4, 8)
        >>> opt.step()
        >>> step = (before - w.detach()) / (0.1 * muon_scale_factor(4, 8, "spectral"))
        >>> s = torch.linalg.svdvals(step)  # singular values near 1: an orthogonal update
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """

    _variant_defaults: Mapping[str, Any] = MappingProxyType({})
    """Group defaults a variant adds (set on the instance before ``Muon.__init__``)."""
    _scale_modes: tuple[str, ...] = get_args(MuonScaleMode)
    """The ``scale_mode`` values a group may take (MOP adds ``nuclear_norm``)."""

    def __init__(
        self,
        params: ParamsT,
        *,
        lr: float = 3e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.01,
        nesterov: bool = False,
        fp32_matmul_prec: MatmulPrecision = "medium",
        coefficient_type: CoefficientType = "quintic",
        num_ns_steps: int = 5,
        scale_mode: MuonScaleMode = "spectral",
        extra_scale_factor: float = 1.0,
        split_qkv: bool = True,
        batched: bool = True,
        flatten: bool = False,
        fsdp_orthogonalize: FsdpOrthogonalize = "auto",
        tp_mode: TPMode = "auto",
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        ns_variant: KernelSetting | None = None,
    ) -> None:
        if ns_variant is not None:
            check_kernel_setting(ns_variant)
        self.ns_variant = ns_variant
        """The Newton–Schulz kernel setting (``None``: the environment's, else ``probe``)."""
        check_choice("`fsdp_orthogonalize`", fsdp_orthogonalize, get_args(FsdpOrthogonalize))
        check_choice("`tp_mode`", tp_mode, get_args(TPMode))
        check_bucket_size(bucket_size)
        if tp_mode == "distributed" and not self.tp_distributable:
            raise ValueError(
                f"`tp_mode`: 'distributed' runs Newton-Schulz on tensor-parallel shards, and {type(self).__name__} "
                f"orthogonalises or scales from the whole matrix; got tp_mode='distributed'; expected one of "
                "'auto', 'duplicated', 'layer_sharded', 'blockwise'"
            )
        self.fsdp_orthogonalize = fsdp_orthogonalize
        self.tp_mode = tp_mode
        self.bucket_size = bucket_size
        self._owner_plans: dict[tuple[Any, ...], Any] = {}  # owner-computes' plans, by the shapes and settings they came from
        self._per_replica = False  # HSDP: each replica computes its own copy (measured in benchmarks/bench_distributed.py)
        self.owner_compute_trace: list[tuple[str, int, str]] | None = None
        """Set to a list to record owner-computes' events in order: ``(exchange, bucket, what)``."""
        self.orthogonalization_record: OrthogonalizationRecord | None = None
        """Set to record what each step orthogonalised (telemetry: ``OptimizerConfig.log_metrics``)."""
        self._warned_qkv: set[int] = set()  # before super().__init__, which calls add_param_group
        defaults = {
            "lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov,
            "fp32_matmul_prec": fp32_matmul_prec, "coefficient_type": coefficient_type,
            "num_ns_steps": num_ns_steps, "scale_mode": scale_mode, "extra_scale_factor": extra_scale_factor,
            "split_qkv": split_qkv, "batched": batched, "flatten": flatten, **self._variant_defaults,
        }  # fmt: skip
        super().__init__(params, defaults)

    @property
    def tp_distributable(self) -> bool:
        """Whether ``tp_mode="distributed"`` can run this optimizer: its update is Newton–Schulz, scaled by shape alone."""
        cls = type(self)
        return cls._orthogonalize is Muon._orthogonalize and cls._scale_ is Muon._scale_

    # ---- validation ---------------------------------------------------------------------------

    def _check_group(self, group: dict[str, Any], index: int) -> None:
        """Override point: validate a completed group (settings, then each param)."""
        where = f"param group #{index}"
        check_lr(group, where)
        if not group["weight_decay"] >= 0:
            raise ValueError(f"{where}: `weight_decay`: must be non-negative; got {group['weight_decay']!r}; expected weight_decay >= 0")
        if not 0 <= group["momentum"] < 1:
            raise ValueError(f"{where}: `momentum`: must lie in [0, 1); got {group['momentum']!r}; expected 0 <= momentum < 1")
        if not 0 < group["extra_scale_factor"] < math.inf:
            raise ValueError(
                f"{where}: `extra_scale_factor`: must be positive and finite; got {group['extra_scale_factor']!r}; "
                "expected a float in (0, inf)"
            )
        steps = group["num_ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"{where}: `num_ns_steps`: must be a positive integer; got {steps!r}; expected an int >= 1")
        if group["coefficient_type"] not in get_args(CoefficientType):  # Megatron-Core's wording, and ours
            raise ValueError(
                f"{where}: `coefficient_type`: Unsupported muon coefficient type {group['coefficient_type']!r}; "
                f"got {group['coefficient_type']!r}; expected one of {list(get_args(CoefficientType))}"
            )
        if (problem := schedule_problem(group["coefficient_type"], steps)) is not None:
            warnings.warn(
                f"{where}: coefficient_type={group['coefficient_type']!r} with num_ns_steps={steps}: {problem}",
                NewtonSchulzWarning,
                skip_file_prefixes=INTERNAL_FILES,
            )
        check_choice(f"{where}: `fp32_matmul_prec`", group["fp32_matmul_prec"], get_args(MatmulPrecision))
        _check_pinned_kernel(getattr(self, "ns_variant", None), group, f"{where}: `ns_variant`")
        check_choice(f"{where}: `scale_mode`", group["scale_mode"], self._scale_modes)
        for key in ("nesterov", "split_qkv", "batched", "flatten"):
            check_flag(f"{where}: `{key}`", group[key])
        views = group.get("matrix_views")
        if views is not None and (not isinstance(views, (list, tuple)) or len(views) != len(group["params"])):
            raise ValueError(
                f"{where}: `matrix_views`: must give one view (or None) per param; got {type(views).__name__}"
                f"{f' of {len(views)}' if isinstance(views, (list, tuple)) else ''} for {len(group['params'])} params; "
                "expected a list parallel to `params`"
            )
        for param_index, param in enumerate(group["params"]):
            self._check_param(param, group, describe_param(group, index, param_index))
            view = views[param_index] if views is not None else None
            if view is not None and (not isinstance(view, MatrixView) or view.param_shape != tuple(param.shape)):
                raise ValueError(
                    f"{describe_param(group, index, param_index)}: `matrix_views`: does not view this param; got "
                    f"{view!r}; expected a MatrixView of shape {tuple(param.shape)}, or None"
                )

    def _check_param(self, param: torch.Tensor, group: dict[str, Any], where: str) -> None:
        name = type(self).__name__
        if param.ndim < 2:
            raise ValueError(
                f"{where}: {name} takes matrices, stacks of matrices (flatten=False) or N-D weights "
                f"flattened to matrices (flatten=True); route it to the scalar optimizer; "
                f"got shape {tuple(param.shape)}; expected 2 or more dims"
            )
        if param.dtype not in PARAM_DTYPES:
            raise TypeError(f"{where}: dtype not supported; got {param.dtype}; expected one of {PARAM_DTYPES}")
        split = getattr(param, "qkv_split_shapes", None)
        if split is not None:
            if isinstance(split, (str, bytes)) or not isinstance(split, Sequence) or not split or not all(
                isinstance(s, int) and not isinstance(s, bool) for s in split
            ):
                raise TypeError(f"{where}: `qkv_split_shapes`: must be a list of ints; got {split!r}; expected e.g. [q, kv, kv]")
            if min(split) < 1:
                raise ValueError(f"{where}: `qkv_split_shapes`: must be positive; got {list(split)}; expected every size >= 1")
        self._qkv_split(param, group, where)

    def _qkv_split(self, param: torch.Tensor, group: dict[str, Any], where: str) -> list[int] | None:
        """The block sizes to split ``param`` into, or None; warns once if they do not divide it."""
        split: Sequence[int] | None = getattr(param, "qkv_split_shapes", None)
        if split is None:
            return None
        if param.ndim != 2:  # also checked here, at step, for an attribute set after construction
            raise ValueError(
                f"{where}: `qkv_split_shapes`: only a 2-D fused QKV matrix can be split; got {list(split)} "
                f"on shape {tuple(param.shape)}; expected a 2-D param, or no qkv_split_shapes"
            )
        if not group["split_qkv"]:
            return None
        if param.shape[0] % sum(split) == 0:
            return list(split)
        if id(param) not in self._warned_qkv:
            self._warned_qkv.add(id(param))
            warnings.warn(
                f"{where}: `qkv_split_shapes` {list(split)} (sum {sum(split)}) do not divide the rows of shape "
                f"{tuple(param.shape)}; orthogonalising the whole matrix instead",
                UserWarning,
                stacklevel=2,
            )
        return None

    # ---- override points ----------------------------------------------------------------------

    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Override point: lazy state of a param, in its compute dtype (a DTensor sharded like the param under FSDP2)."""
        if isinstance(param, DTensor):
            state["momentum_buffer"] = torch.zeros_like(param, dtype=compute_dtype(param))
        else:
            state["momentum_buffer"] = torch.zeros(param.shape, dtype=compute_dtype(param), device=param.device)

    def _orthogonalize(self, stack: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Stage: a ``(batch, rows, cols)`` stack of directions orthogonalised, not in place
        (Newton–Schulz; MOP: the SVD's polar factor). ``group`` holds the batch's common settings.

        The kernel is :attr:`ns_variant`'s: pinned, or probed once per shape class
        (:func:`~optzoo.optimizers.newton_schulz_probe.choose_kernel`)."""
        settings = {"steps": group["num_ns_steps"], "coefficient_type": group["coefficient_type"], "matmul_precision": group["fp32_matmul_prec"]}
        kernel = choose_kernel(stack, setting=self.ns_variant, **settings)
        if kernel is None:  # the rule: this module's newton_schulz, which tests swap for upstream's
            return newton_schulz(stack, **settings)
        return run_kernel(stack, kernel, **settings)

    def _scale_(self, out: torch.Tensor, stack: torch.Tensor, blocks: Sequence[_Block]) -> None:
        """Stage: scale each orthogonalised matrix ``out[i]`` (of direction ``stack[i]``, block
        ``blocks[i]``) in place, by :meth:`_orthogonal_scale` of its shape. Variants whose factor
        depends on the matrix (PolarGrad, MOP: its nuclear norm) read ``stack``."""
        scales = [self._orthogonal_scale(block.group, *block.shape) for block in blocks]
        if len(set(scales)) == 1:
            if scales[0] != 1.0:
                out.mul_(scales[0])
        else:
            for slot, scale in zip(out, scales):
                slot.mul_(scale)

    def _orthogonal_scale(self, group: dict[str, Any], rows: int, cols: int) -> float:
        """Override point: the factor on a ``rows × cols`` orthogonalised matrix (1: none)."""
        extra: float = group["extra_scale_factor"]
        return muon_scale_factor(rows, cols, group["scale_mode"]) * extra

    def _finish_update(
        self, orthogonal: torch.Tensor, *, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
        grad: torch.Tensor, direction: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Override point: the update applied as ``W ← W − lr · update``, from the param's
        orthogonalised (and :meth:`_orthogonal_scale`-d) direction. Muon applies it as is.

        For a DTensor (FSDP2) param, each input is this rank's shard unless :meth:`_whole_inputs`
        names it, state tensors are read through :func:`local_shard`, and the update returned
        covers what ``orthogonal`` covers."""
        return orthogonal

    def _whole_inputs(self, group: dict[str, Any]) -> frozenset[FinishInput]:
        """Override point: the :meth:`_finish_update` inputs it needs whole for a DTensor param.

        With ``orthogonal`` whole, the update is computed whole on every rank and then sharded.
        Muon's is element-wise (none): gathering costs communication, so name only what is needed.
        """
        return frozenset()

    # ---- the step: plan, then prepare, orthogonalise and apply ----------------------------------

    @override
    def _update(self) -> None:
        """One update of every param that has a gradient, one batch of same-shape matrices at a time."""
        if self.orthogonalization_record is not None:
            self.orthogonalization_record.start_step()
        if self.ns_variant is None and os.environ.get(VARIANT_ENV):  # a pin from the environment: checked before any param changes
            for group in self.param_groups:
                _check_pinned_kernel(check_kernel_setting(os.environ[VARIANT_ENV], ENV_SUBJECT), group, ENV_SUBJECT)
        batches = self._plan()
        on_owners = orthogonalize_on_owners(self, [block for blocks in batches for block in blocks])
        batches = [kept for blocks in batches if (kept := [b for b in blocks if b.param not in on_owners])]
        remaining = Counter(block.param for blocks in batches for block in blocks)
        prepared: dict[torch.Tensor, _Prepared] = {}
        orthogonal: dict[torch.Tensor, torch.Tensor] = {}  # per param; a split one's or a stack's fills in block by block
        for blocks in batches:
            for block in blocks:
                if block.param not in prepared:  # its first batch: prepare now, not before (memory)
                    prepared[block.param] = self._prepare(block.param, block.group)
            out = self._orthogonalize_batch(blocks, [prepared[block.param].matrix for block in blocks])
            for slot, block in zip(out, blocks):
                param = block.param
                if block.whole:
                    orthogonal[param] = slot.view(param.shape)  # a view, no copy
                else:
                    if param not in orthogonal:
                        orthogonal[param] = block.empty_output(slot, prepared[param].matrix)
                    block.of(orthogonal[param]).copy_(block.in_slot(slot))
                remaining[param] -= 1
                if remaining[param] == 0:  # its last block: apply now, and let its tensors go
                    self._apply(prepared.pop(param), orthogonal.pop(param))

    def _plan(self) -> list[list[_Block]]:
        """The batches of the step's matrices, from shapes and settings alone (so a sparse gradient
        raises before any param changes), in order of first appearance."""
        batches: dict[tuple[Any, ...], list[_Block]] = {}
        for group_index, group in enumerate(self.param_groups):
            for param_index, param in enumerate(group["params"]):
                if param.grad is None or param.numel() == 0:  # a (4, 0) weight: nothing to update
                    continue
                where = describe_param(group, group_index, param_index)
                if param.grad.is_sparse:
                    raise ValueError(
                        f"{where}: gradient is sparse, which {type(self).__name__} does not support; "
                        f"got {param.grad.layout}; expected torch.strided"
                    )
                for block in self._blocks(param, group, where, self.matrix_view(param, group, param_index)):
                    batches.setdefault(self._batch_key(block, len(batches)), []).append(block)
                    if self.orthogonalization_record is not None:
                        self.orthogonalization_record.planned(block)
        return list(batches.values())

    def matrix_view(self, param: torch.Tensor, group: dict[str, Any], index: int | None = None) -> MatrixView | None:
        """The :class:`~optzoo._common.MatrixView` the group's ``matrix_views`` gives ``param`` (at
        ``index`` in the group, else found by identity), or ``None`` where it is the default one
        (:meth:`MatrixView.default` under the group's ``flatten``): the stack the plain path takes."""
        views = group.get("matrix_views")
        if not views:
            return None
        if index is None:
            index = next((i for i, p in enumerate(group["params"]) if p is param), None)
            if index is None:
                return None
        view: MatrixView | None = views[index]
        if view is None or view == MatrixView.default(tuple(param.shape), flatten=group["flatten"]):
            return None
        return view

    def _blocks(self, param: torch.Tensor, group: dict[str, Any], where: str, view: MatrixView | None = None) -> list[_Block]:
        if view is not None:  # the blocks the forward multiplies by (experts, heads, groups), each out x in
            rows, cols = view.shape
            return [_Block(param, group, (view.count, rows, cols), index, 0, rows, 1, view) for index in range(view.count)]
        *stacked, rows, cols = matrix_shape(param.shape, flatten=group["flatten"])
        layout = (math.prod(stacked), rows, cols)
        split = self._qkv_split(param, group, where)  # only for 2-D params: one matrix
        if split is None:
            return [_Block(param, group, layout, index, start=0, rows=rows, groups=1) for index in range(layout[0])]
        return [
            _Block(param, group, layout, 0, start=sum(split[:k]), rows=size, groups=rows // sum(split))
            for k, size in enumerate(split)
        ]

    @staticmethod
    def _batch_key(block: _Block, unique: int) -> tuple[Any, ...]:
        """Blocks with equal keys are orthogonalised in one call; ``batched=False`` keys are unique."""
        # Exact shapes, not shapes up to transposition: stacking a tall matrix with wide ones costs
        # a strided transposed copy in and out, which on CPU outweighed the larger batch.
        group = block.group
        key: tuple[Any, ...] = (block.param.device, compute_dtype(block.param), *block.shape)
        key += (group["num_ns_steps"], group["coefficient_type"], group["fp32_matmul_prec"])
        return key if group["batched"] else (*key, unique)

    def _prepare(self, param: torch.Tensor, group: dict[str, Any], *, gather: bool = True) -> _Prepared:
        """Stage 1, per param: decoupled weight decay, momentum, and under FSDP2 (unless not ``gather``) the gathered direction."""
        state = self.state[param]
        if not state:
            self._init_state(param, state, group)
        assert param.grad is not None  # _plan keeps only params with a gradient
        grad = local_shard(param.grad).to(dtype=compute_dtype(param), memory_format=torch.contiguous_format)
        local = local_shard(param)
        decoupled_weight_decay_(local, lr=lr_value(group), weight_decay=group["weight_decay"])
        direction = momentum_direction_(
            local_shard(state["momentum_buffer"]), grad, momentum=group["momentum"], nesterov=group["nesterov"]
        )
        # FSDP2: Newton–Schulz needs the whole matrix; every rank gathers (and orthogonalises) it.
        matrix = gather_whole(direction, param) if isinstance(param, DTensor) and gather else direction
        return _Prepared(param, local, group, state, grad, direction, matrix)

    def _orthogonalize_batch(self, blocks: Sequence[_Block], matrices: Sequence[torch.Tensor]) -> torch.Tensor:
        """Stage 2, per batch: ``blocks`` (of ``matrices``, their params' prepared matrices)
        stacked, one batched Newton–Schulz call, each output times :meth:`_orthogonal_scale`.

        Returns:
            ``(len(blocks), rows, cols)``: slot ``i`` is block ``i``'s output, in its own orientation.
        """
        return self._orthogonalize_stack(self._stack(blocks, matrices), blocks)

    @staticmethod
    def _stack(blocks: Sequence[_Block], matrices: Sequence[torch.Tensor]) -> torch.Tensor:
        """``blocks`` (of ``matrices``) copied into one ``(len(blocks), rows, cols)`` stack."""
        first = blocks[0]
        stack = torch.empty((len(blocks), *first.shape), dtype=matrices[0].dtype, device=matrices[0].device)
        for slot, block, matrix in zip(stack, blocks, matrices):
            block.in_slot(slot).copy_(block.of(matrix))
        return stack

    def _orthogonalize_stack(self, stack: torch.Tensor, blocks: Sequence[_Block], planned: Sequence[_Block] | None = None) -> torch.Tensor:
        """A stack of ``blocks`` orthogonalised (one batched call) and scaled. ``planned``: the
        blocks as the step planned them, where ``blocks`` are an owner's pieces of them (telemetry's sample)."""
        out = self._orthogonalize(stack, blocks[0].group)  # the batch key makes its settings common to the batch
        if self.orthogonalization_record is not None:  # before the scale: the Newton-Schulz output itself
            self.orthogonalization_record.sample(out, blocks if planned is None else planned)
        self._scale_(out, stack, blocks)
        return out

    def _apply(self, prepared: _Prepared, orthogonal: torch.Tensor, *, sharded: bool = False) -> None:
        """Stage 3, per param, once all its blocks are orthogonalised: ``W ← W − lr · _finish_update(...)``.

        ``orthogonal`` is the whole param's, or (``sharded``, from the owners) already this rank's shard."""
        param, group = prepared.param, prepared.group
        grad, direction = prepared.grad, prepared.direction
        whole: frozenset[FinishInput] = frozenset()
        if isinstance(param, DTensor):
            whole = self._whole_inputs(group)
            if "orthogonal" not in whole and not sharded:
                orthogonal = take_shard(orthogonal, param)
            direction = prepared.matrix if "direction" in whole else direction
            grad = gather_whole(grad, param) if "grad" in whole else grad
        update = self._finish_update(orthogonal, param=param, state=prepared.state, group=group, grad=grad, direction=direction)
        if isinstance(param, DTensor) and "orthogonal" in whole:
            update = take_shard(update, param)
        prepared.local.add_(update, alpha=-lr_value(group))
        self._after_update(prepared)
        if self.orthogonalization_record is not None:
            self.orthogonalization_record.applied.add(id(param))

    def _after_update(self, prepared: _Prepared) -> None:
        """Stage, per param after ``W ← W − lr · update``: a projection of the weights (SPEL's
        re-orthogonalisation, a hyperball's or Sinkhorn's normalisation). Muon has none."""

    # ---- state dict ---------------------------------------------------------------------------

    def state_layout(self, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout:
        """The state :meth:`_init_state` gives ``param`` (of whole shape ``shape``), for checking a checkpoint."""
        return {"momentum_buffer": per_element(shape)}

    def restore_state(self, saved: Mapping[str, Any], param: torch.Tensor, name: str) -> dict[str, Any]:
        """One param's saved state for ``optzoo``'s name-keyed loader: floating tensors in the
        param's compute dtype (float32 for 16-bit params), on its device."""
        dtype = compute_dtype(param)
        return {
            key: value.to(device=param.device, dtype=dtype if value.is_floating_point() else value.dtype, copy=True)
            if isinstance(value, torch.Tensor) else value
            for key, value in saved.items()
        }  # fmt: skip

    @override
    def _load_state_dict(self, state_dict: StateDict) -> None:
        """torch's ``load_state_dict``, keeping the float32 state of 16-bit params in float32.

        torch casts every floating state tensor to its param's dtype, which would round a bf16
        param's float32 ``momentum_buffer`` to bf16; such tensors are re-read from ``state_dict``.
        A saved group that lacks a setting (a checkpoint from before the setting existed, such as
        ``flatten``) gets this optimizer's default for it, as ``add_param_group`` would give.
        """
        restored: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for saved_id, param in zip(saved_group["params"], group["params"]):
                saved = state_dict["state"].get(saved_id)
                dtype = compute_dtype(param)
                if saved is not None and dtype != param.dtype:
                    restored[param] = {
                        key: value.to(device=param.device, dtype=dtype, copy=True)
                        for key, value in saved.items()
                        if torch.is_tensor(value) and value.is_floating_point()
                    }
        views = [group.get("matrix_views") for group in self.param_groups]  # the model's, not the checkpoint's
        self._torch_load_state_dict(state_dict)
        for group, kept in zip(self.param_groups, views):
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            group.pop("matrix_views", None)
            if kept is not None:
                group["matrix_views"] = kept
        for param, values in restored.items():
            self.state[param].update(values)

