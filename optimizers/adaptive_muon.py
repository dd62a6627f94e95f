"""Adaptive Muon: Muon with a second moment of the orthogonalised update (AdaMuon, NorMuon, NAMO).

The second-moment rules are the pure functions :func:`adamuon_`, :func:`normuon_` and
:func:`namo_`; :class:`AdaptiveMuon` plugs them into :class:`~optzoo.optimizers.muon.Muon`'s step loop
through its override points.

N-D params (:func:`~optzoo.optimizers.muon.matrix_shape`): the second moment follows the matrices
Muon orthogonalises. AdaMuon's is element-wise, param-shaped. NorMuon keeps one entry per row (or
column) of each matrix and NAMO one scalar per matrix, with per-matrix Frobenius norms: for a stack
``[E, rows, cols]`` of tall matrices, ``(E, rows, 1)`` and ``(E, 1, 1)``; for a flattened param,
those of the matrix ``(shape[0], prod(shape[1:]))``. A 2-D param's are ``(rows, 1)`` or
``(1, cols)``, and ``(1,)``, as upstream's.

FSDP2 (DTensor params): AdaMuon's second moment is element-wise, so it is sharded like the param
and updated on this rank's shard. NorMuon's (a row or column vector per matrix) and NAMO's (a
scalar per matrix) are small and are replicated: every rank updates its copy from the same whole
matrices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args, override

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import zeros as dtensor_zeros
from torch.optim.optimizer import ParamsT

from .._common import check_choice, local_shard
from .muon import (
    FinishInput, Muon, as_matrices, compute_dtype, from_matrices, matrix_shape, muon_scale_factor, take_shard,
)  # fmt: skip
from .state_layout import Slot, StateLayout

__all__ = [
    "AdaptiveMuon",
    "Moment2Method",
    "adamuon_",
    "namo_",
    "namo_scale_",
    "normuon_",
    "normuon_reduced_dim",
]

Moment2Method = Literal["adamuon", "normuon", "namo"]
"""Second-moment rule; upstream's ``Moment2MethodT``."""


def adamuon_(orthogonal: torch.Tensor, exp_avg_sq: torch.Tensor, *, beta2: float, eps: float) -> torch.Tensor:
    """AdaMuon (arXiv:2507.11005): elementwise ``v ← β₂v + (1−β₂)O²`` in place; returns ``O / (√v + ε)``."""
    exp_avg_sq.lerp_(orthogonal.square(), 1 - beta2)
    return orthogonal / (exp_avg_sq.sqrt() + eps)


def normuon_reduced_dim(rows: int, cols: int) -> int:
    """The dim NorMuon averages over: the shorter one (``-1``, the columns, when ``rows >= cols``),
    keeping one second-moment entry per row of a tall matrix, or per column of a wide one."""
    return -1 if rows >= cols else -2


def _matrix_norms(matrices: torch.Tensor) -> torch.Tensor:
    """The Frobenius norm of each matrix of ``(..., rows, cols)``, shaped ``(..., 1, 1)``."""
    norms: torch.Tensor = torch.linalg.vector_norm(matrices, dim=(-2, -1), keepdim=True)
    return norms


def normuon_(orthogonal: torch.Tensor, exp_avg_sq: torch.Tensor, *, beta2: float, eps: float) -> torch.Tensor:
    """NorMuon (arXiv:2510.05491): a per-row (or per-column) second moment; returns the
    normalised update rescaled to ``O``'s Frobenius norm.

    ``v ← β₂v + (1−β₂)·mean(O², shorter dim)`` in place; ``U = O / √max(v, ε)``; returns
    ``U · ‖O‖_F / max(‖U‖_F, ε)``. ``orthogonal`` may be a stack ``(..., rows, cols)``: each
    matrix has its own rows (or columns) in ``exp_avg_sq`` (``(..., rows, 1)`` or ``(..., 1, cols)``)
    and its own norms.
    """
    dim = normuon_reduced_dim(*orthogonal.shape[-2:])
    exp_avg_sq.lerp_(orthogonal.square().mean(dim=dim, keepdim=True), 1 - beta2)
    update = orthogonal * exp_avg_sq.clamp_min(eps).rsqrt_()
    scaled: torch.Tensor = update * (_matrix_norms(orthogonal) / _matrix_norms(update).clamp_min(eps))
    return scaled


def namo_scale_(
    exp_avg_sq: torch.Tensor, *, grad: torch.Tensor, direction: torch.Tensor, beta2: float, eps: float
) -> torch.Tensor:
    """NAMO's second moment and factor, one per matrix of ``(..., rows, cols)``: ``v ← β₂v + (1−β₂)‖G‖²_F``
    in place; returns ``‖D‖_F / (√v + ε)``, shaped like ``exp_avg_sq`` (``(..., 1, 1)``, or ``(1,)``
    for one matrix)."""
    exp_avg_sq.lerp_(_matrix_norms(grad).square().view_as(exp_avg_sq), 1 - beta2)
    return _matrix_norms(direction).view_as(exp_avg_sq) / (exp_avg_sq.sqrt() + eps)


def namo_(
    orthogonal: torch.Tensor, exp_avg_sq: torch.Tensor, *, grad: torch.Tensor, direction: torch.Tensor, beta2: float, eps: float
) -> torch.Tensor:
    """NAMO (arXiv:2602.17080): one scalar per matrix.

    ``v ← β₂v + (1−β₂)‖G‖²_F`` in place (``G`` the raw gradient); returns
    ``O · ‖D‖_F / (√v + ε)`` with ``D`` the direction that was orthogonalised
    (:func:`namo_scale_`). For a stack ``(..., rows, cols)``, ``exp_avg_sq`` is ``(..., 1, 1)``.
    """
    return orthogonal * namo_scale_(exp_avg_sq, grad=grad, direction=direction, beta2=beta2, eps=eps)


class AdaptiveMuon(Muon):
    r"""Muon with an adaptive second moment between Newton–Schulz and Muon's scale factor.

    With :class:`~optzoo.optimizers.muon.Muon`'s notation and :math:`O = \mathrm{NS}(D)` (not yet
    scaled), the update is :math:`W \leftarrow W - \eta \, s(r, c) \, e \, A(O)` where :math:`A`
    is ``moment2_method``'s rule: :func:`adamuon_` (elementwise, like Adam), :func:`normuon_`
    (per row or column of each matrix) or :func:`namo_` (one scalar per matrix), each with decay
    ``beta2`` and ``eps``. For an N-D param, the matrices are those Muon orthogonalises
    (:func:`~optzoo.optimizers.muon.matrix_shape`) and :math:`s(r, c)` is of their shape.
    The idea goes back to Carlson et al., *Preconditioned spectral descent for deep learning*
    (NeurIPS 2015).

    Reference implementation: emerging-optimizers 0.3.0,
    https://github.com/NVIDIA-NeMo/Emerging-Optimizers/blob/v0.3.0/emerging_optimizers/orthogonalized_optimizers/adaptive_muon.py
    Parity with upstream: tests/optimizers/test_adaptive_muon.py.

    Deviations from upstream: those of :class:`~optzoo.optimizers.muon.Muon`, and
        * the second moment is ``state["exp_avg_sq"]`` (torch's name; upstream ``moment2_buffer``),
          kept in float32 for 16-bit params;
        * ``moment2_method`` is a param-group key like every setting (upstream: instance-wide);
        * a QKV-split param is orthogonalised per block, then the second moment and the scale
          factor apply to the whole param (its shape), as upstream does for any param;
        * N-D params (upstream: 2-D only) get the second moment of each of their matrices (see the
          module docstring) and the scale factor of the matrices' shape, so a stack of experts
          steps as its experts would as 2-D params: bit for bit for ``[E, out, in]`` stacks, to
          float32 rounding for other views (NorMuon's and NAMO's reductions read a block in
          storage order, not the 2-D param's).

    Args:
        params: params of 2 or more dims, or param groups; a group may set any argument below
            except ``params``.
        moment2_method: ``adamuon`` (default), ``normuon`` or ``namo``
            (Megatron's ``adaptive_muon_moment2_method``).
        beta2: second-moment decay in [0, 1) (``adaptive_muon_beta2``). Default 0.95, upstream's.
        eps: >= 0 (``adaptive_muon_eps``). Default 1e-8, upstream's.
        **others: :class:`~optzoo.optimizers.muon.Muon`'s arguments, with its defaults.

    Raises:
        TypeError, ValueError: as :class:`~optzoo.optimizers.muon.Muon`, and for an unknown
            ``moment2_method`` or ``beta2``/``eps`` out of range.

    Example:
        >>> w = torch.nn.Parameter(torch.randn(4, 8))
        >>> opt = AdaptiveMuon([w], lr=0.1, moment2_method="normuon", fp32_matmul_prec="highest")
        >>> w.grad = torch.randn(4, 8)
        >>> opt.step()
        >>> tuple(opt.state[w]["exp_avg_sq"].shape)  # one entry per column of the wide matrix
        (1, 8)
    """

    def __init__(
        self, params: ParamsT, *, moment2_method: Moment2Method = "adamuon", beta2: float = 0.95, eps: float = 1e-8, **muon: Any
    ) -> None:
        self._variant_defaults = {"moment2_method": moment2_method, "beta2": beta2, "eps": eps}
        super().__init__(params, **muon)

    @override
    def _check_group(self, group: dict[str, Any], index: int) -> None:
        where = f"param group #{index}"
        check_choice(f"{where}: `moment2_method`", group["moment2_method"], get_args(Moment2Method))
        if not 0 <= group["beta2"] < 1:
            raise ValueError(f"{where}: `beta2`: must lie in [0, 1); got {group['beta2']!r}; expected 0 <= beta2 < 1")
        if not group["eps"] >= 0:
            raise ValueError(f"{where}: `eps`: must be non-negative; got {group['eps']!r}; expected eps >= 0")
        super()._check_group(group, index)

    @override
    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        super()._init_state(param, state, group)
        shape = self._moment2_shape(param, group, tuple(param.shape))
        dtype = compute_dtype(param)
        if not isinstance(param, DTensor):
            state["exp_avg_sq"] = torch.zeros(shape, dtype=dtype, device=param.device)
        elif group["moment2_method"] == "adamuon":
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)  # sharded like the param
        else:
            mesh = param.device_mesh
            state["exp_avg_sq"] = dtensor_zeros(shape, dtype=dtype, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)

    def _moment2_shape(self, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> tuple[int, ...]:
        """The second moment's shape for a param of (whole) ``shape``."""
        matrices = list(matrix_shape(shape, flatten=group["flatten"], view=self.matrix_view(param, dict(group))))
        if group["moment2_method"] == "normuon":  # per row (or column) of each matrix
            matrices[normuon_reduced_dim(*matrices[-2:])] = 1
            return tuple(matrices)
        if group["moment2_method"] == "namo":  # per matrix; (1,) for one, as upstream's
            return (*matrices[:-2], 1, 1) if len(matrices) > 2 else (1,)
        return shape  # adamuon: elementwise

    @override
    def state_layout(self, param: torch.Tensor, group: Mapping[str, Any], shape: tuple[int, ...]) -> StateLayout:
        return super().state_layout(param, group, shape) | {"exp_avg_sq": Slot(self._moment2_shape(param, group, shape), "float")}

    @override
    def _whole_inputs(self, group: dict[str, Any]) -> frozenset[FinishInput]:
        if group["moment2_method"] == "normuon":
            return frozenset({"orthogonal"})  # row/column means and Frobenius norms span the matrix
        if group["moment2_method"] == "namo":
            return frozenset({"grad", "direction"})  # their Frobenius norms; O only gets a factor per matrix
        return frozenset()  # adamuon: element-wise

    @override
    def _orthogonal_scale(self, group: dict[str, Any], rows: int, cols: int) -> float:
        return 1.0  # Muon's scale comes after the second moment, in _finish_update

    @override
    def _finish_update(
        self, orthogonal: torch.Tensor, *, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
        grad: torch.Tensor, direction: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        method, v, flatten = group["moment2_method"], local_shard(state["exp_avg_sq"]), group["flatten"]
        view = self.matrix_view(param, group)
        beta2, eps = group["beta2"], group["eps"]
        if method == "adamuon":
            update = adamuon_(orthogonal, v, beta2=beta2, eps=eps)
        elif method == "normuon":  # `orthogonal` is whole (_whole_inputs)
            matrices = as_matrices(orthogonal, flatten=flatten, view=view)
            update = from_matrices(normuon_(matrices, v, beta2=beta2, eps=eps), orthogonal.shape, flatten=flatten, view=view)
        else:  # `grad` and `direction` are whole (_whole_inputs); `orthogonal` only gets a factor per matrix
            grad, direction = as_matrices(grad, flatten=flatten, view=view), as_matrices(direction, flatten=flatten, view=view)
            factor = namo_scale_(v, grad=grad, direction=direction, beta2=beta2, eps=eps)
            if view is not None and factor.numel() > 1:  # one factor per block: back in the param's layout
                factor = from_matrices(factor, param.shape, flatten=flatten, view=view)
            if isinstance(param, DTensor) and factor.numel() > 1:
                # a stack: this rank's shard holds some of its matrices (any of its dims may be the sharded one)
                factor = take_shard(factor.expand(param.shape).contiguous(), param)
            update = orthogonal * factor  # a stack's (..., 1, 1) factors broadcast over the param-shaped tensor
        rows, cols = matrix_shape(param.shape, flatten=flatten, view=view)[-2:]
        extra: float = group["extra_scale_factor"]
        return update * muon_scale_factor(rows, cols, group["scale_mode"]) * extra  # upstream's two products, in order
