"""The rest of emerging-optimizers' orthogonalising family, on :class:`~optzoo.optimizers.muon.Muon`'s step loop.

Each variant supplies only the stages it changes (see :class:`~optzoo.optimizers.muon.Muon`'s
override points); batching, expert stacks, QKV blocks, precision, FSDP2 and state dicts are the
loop's:

=================  ==========================  ==============================  =========================
variant            orthogonalise               scale                           after the update
=================  ==========================  ==============================  =========================
:class:`PolarGrad` Newton–Schulz               nuclear norm ``⟨O, D⟩``         —
:class:`MOP`       polar factor by SVD         nuclear norm (or a Muon mode)   —
:class:`Scion`     Newton–Schulz               ``√(rows/cols)`` · radius       —
:class:`Spel`      Newton–Schulz               none                            ``W ← NS(W)``
:class:`MuonHyperball` Newton–Schulz           Muon's, then ``‖U‖ = ‖W‖``      ``‖W‖`` restored
:class:`SinkhornMuon`  Newton–Schulz           Muon's                          Sinkhorn–Knopp map of ``W``
=================  ==========================  ==============================  =========================

The weight projections (SPEL, hyperball, Sinkhorn) act per matrix the forward multiplies by, as
the orthogonalisation does: each block of a param the group's ``matrix_views`` give a view
(concatenated or transposed experts, heads), else a 2-D param whole (upstream's rule, QKV-fused or
not) and each matrix of an N-D stack on its own, as each expert would be as a 2-D param. They need whole matrices, so these three refuse FSDP2-sharded
(DTensor) params by name; the other three run every path Muon runs.

Reference implementations: emerging-optimizers 0.3.0,
https://github.com/NVIDIA-NeMo/Emerging-Optimizers/tree/v0.3.0/emerging_optimizers/orthogonalized_optimizers
(``polargrad.py``, ``mop.py``, ``scion.py``, ``spel.py``, ``muon_hyperball.py``, ``sinkhorn_muon.py``).
Parity with them: tests/optimizers/test_orthogonalized.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, get_args, override

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import ParamsT

from .._common import check_flag, describe_param
from ._emerging import sinkhorn_map_
from .muon import Muon, MuonScaleMode, _Block, _Prepared, as_matrices, compute_dtype, muon_scale_factor
from .newton_schulz import _float32_matmul_precision

__all__ = ["MOP", "MuonHyperball", "PolarGrad", "Scion", "SinkhornMuon", "Spel"]


def _nuclear_scale_(out: torch.Tensor, stack: torch.Tensor, extra: Sequence[float]) -> None:
    """``out[i] ← out[i] · ⟨out[i], stack[i]⟩ · extra[i]``: ``⟨UVᵀ, USVᵀ⟩ = Σσ``, the nuclear norm of
    the direction, read from the orthogonalised matrix as upstream's PolarGrad does."""
    out.mul_((out * stack).sum(dim=(-2, -1), keepdim=True))
    for slot, factor in zip(out, extra):
        if factor != 1.0:
            slot.mul_(factor)


class PolarGrad(Muon):
    r"""PolarGrad (arXiv:2505.21799): Muon whose orthogonalised update is scaled by the nuclear
    norm of the direction, :math:`\|D\|_* = \langle \mathrm{NS}(D), D\rangle`, times
    ``extra_scale_factor``, instead of a shape factor: steepest descent in the spectral norm.

    Args: :class:`~optzoo.optimizers.muon.Muon`'s (``scale_mode`` is not used).
    """

    @override
    def _scale_(self, out: torch.Tensor, stack: torch.Tensor, blocks: Sequence[_Block]) -> None:
        _nuclear_scale_(out, stack, [block.group["extra_scale_factor"] for block in blocks])


class MOP(Muon):
    r"""MOP, Momentum Orthogonalised by Polar decomposition: the exact polar factor
    :math:`UV^\top` of the direction's SVD instead of Newton–Schulz, scaled by the nuclear norm
    (``scale_mode="nuclear_norm"``, the default) or a Muon scale mode, times ``extra_scale_factor``.

    The nuclear norm is read as :math:`\langle UV^\top, D\rangle` (PolarGrad's formula; upstream sums
    the singular values: equal to float32 rounding). ``num_ns_steps`` and ``coefficient_type`` are
    not used. Singular directions below the rank tolerance (``σ <= σ_max·max(rows, cols)·eps``)
    are left out of :math:`UV^\top`, as Newton–Schulz leaves them: upstream keeps LAPACK's arbitrary
    completion of the null space, so under a Muon scale mode a zero direction moved the weights
    by a random orthogonal matrix; for full-rank directions the two are equal bit for bit.

    Args: :class:`~optzoo.optimizers.muon.Muon`'s, with ``scale_mode`` defaulting to ``nuclear_norm``.
    """

    _scale_modes = (*get_args(MuonScaleMode), "nuclear_norm")

    def __init__(self, params: ParamsT, *, scale_mode: str = "nuclear_norm", **muon: Any) -> None:
        super().__init__(params, scale_mode=scale_mode, **muon)  # type: ignore[arg-type]

    @override
    def _orthogonalize(self, stack: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        u, singular, vh = torch.linalg.svd(stack, full_matrices=False)
        # Directions of (numerically) zero singular value are the SVD's arbitrary completion of
        # the null space: dropped, as Newton–Schulz's limit drops them (sign(0) = 0). A full-rank
        # direction keeps every one (u times 1, exact); a zero one gives 0, not a random rotation.
        tolerance = singular.amax(dim=-1, keepdim=True) * max(stack.shape[-2:]) * torch.finfo(singular.dtype).eps
        u = u * (singular > tolerance).unsqueeze(-2)
        with _float32_matmul_precision(group["fp32_matmul_prec"]):
            polar: torch.Tensor = u @ vh
        return polar

    @override
    def _scale_(self, out: torch.Tensor, stack: torch.Tensor, blocks: Sequence[_Block]) -> None:
        if all(block.group["scale_mode"] == "nuclear_norm" for block in blocks):
            _nuclear_scale_(out, stack, [block.group["extra_scale_factor"] for block in blocks])
        else:  # the batch key does not hold scale_mode: scale slot by slot
            for index, block in enumerate(blocks):
                if block.group["scale_mode"] == "nuclear_norm":
                    _nuclear_scale_(out[index : index + 1], stack[index : index + 1], [block.group["extra_scale_factor"]])
                else:
                    out[index].mul_(self._orthogonal_scale(block.group, *block.shape))


class Scion(Muon):
    r"""Scion (arXiv:2502.07529): Muon's update as the spectral-norm LMO, scaled by
    :math:`\sqrt{rows/cols}` (unit RMS→RMS operator norm) times ``spectral_radius``; no Nesterov.

    Weight decay is the group's, decoupled: upstream's Scion defaults it to 1 (Frank–Wolfe,
    ``W ← (1 − η)W − η·ρ·LMO``) but reads the param group's ``weight_decay`` as Megatron-Core
    passes it; set ``weight_decay=1`` for the constrained form.

    Args:
        spectral_radius: :math:`\rho` > 0 (``scion_spectral_radius``). Default 1.
        **muon: :class:`~optzoo.optimizers.muon.Muon`'s (``nesterov`` must stay False;
            ``scale_mode`` and ``extra_scale_factor`` are not used).
    """

    def __init__(self, params: ParamsT, *, spectral_radius: float = 1.0, **muon: Any) -> None:
        self._variant_defaults = {"spectral_radius": spectral_radius}
        super().__init__(params, **muon)

    @override
    def _check_group(self, group: dict[str, Any], index: int) -> None:
        where = f"param group #{index}"
        if not 0 < group["spectral_radius"] < math.inf:
            raise ValueError(
                f"{where}: `spectral_radius`: must be positive and finite; got {group['spectral_radius']!r}; "
                "expected a float in (0, inf)"
            )
        if group["nesterov"] is True:
            raise ValueError(f"{where}: `nesterov`: Scion uses plain momentum; got True; expected False")
        super()._check_group(group, index)

    @override
    def _orthogonal_scale(self, group: dict[str, Any], rows: int, cols: int) -> float:
        radius: float = group["spectral_radius"]
        return muon_scale_factor(rows, cols, "unit_rms_norm") * radius


class _ProjectsWeights(Muon):
    """A variant that projects the weights after each update: whole matrices only (no FSDP2 shards)."""

    _projection = "its weight projection"

    @override
    def _check_param(self, param: torch.Tensor, group: dict[str, Any], where: str) -> None:
        if isinstance(param, DTensor):
            raise ValueError(
                f"{where}: {type(self).__name__} needs whole matrices for {self._projection} after each "
                f"update; got a DTensor of shape {tuple(param.shape)} with placements {tuple(param.placements)}; "
                "expected a plain tensor: route it to muon, or leave its module out of fully_shard"
            )
        super()._check_param(param, group, where)

    def _matrices(self, tensor: torch.Tensor, param: torch.Tensor, group: dict[str, Any], index: int | None = None) -> torch.Tensor:
        """A tensor shaped like ``param`` as the matrices the projection acts on, ``(count, rows,
        cols)``: those the forward multiplies by where the group's ``matrix_views`` give ``param``
        a view (``index``: its place in the group, else found by identity), else its stored
        matrices. A view of a contiguous ``tensor`` where the layout allows, else a copy (write it
        back with :meth:`_write_back`)."""
        view = self.matrix_view(param, group, index)
        if view is None:
            matrices = as_matrices(tensor, flatten=group["flatten"])  # contiguous: reductions round as for any layout
            stack: torch.Tensor = matrices.reshape(-1, *matrices.shape[-2:]).contiguous()
            return stack
        blocks = tensor.reshape(view.split).permute(view.order)
        return blocks.reshape(view.count, *view.shape).contiguous()

    def _write_back(self, tensor: torch.Tensor, matrices: torch.Tensor, param: torch.Tensor, group: dict[str, Any]) -> None:
        """Store ``matrices`` (from :meth:`_matrices`, changed in place) in ``tensor`` unless they are its view."""
        if matrices.data_ptr() == tensor.data_ptr() and tensor.is_contiguous():
            return  # a view of it: every layout whose matrices are contiguous runs of the param
        view = self.matrix_view(param, group)
        if view is None:
            tensor.copy_(matrices.view(tensor.shape))
            return
        whole = tensor if tensor.is_contiguous() else tensor.contiguous()
        whole.view(view.split).permute(view.order).copy_(matrices.view([view.split[i] for i in view.order]))
        if whole is not tensor:
            tensor.copy_(whole)


class Spel(_ProjectsWeights):
    r"""SPEL (arXiv:2601.21487): steepest descent on the Stiefel manifold,
    :math:`W \leftarrow \mathrm{NS}(W - \eta\,\mathrm{NS}(D))`: Muon's orthogonalised update without a
    scale factor, then the weights re-orthogonalised by the same Newton–Schulz.

    Args: :class:`~optzoo.optimizers.muon.Muon`'s (``scale_mode`` and ``extra_scale_factor`` are not used).
    """

    _projection = "re-orthogonalising the weights"

    @override
    def _orthogonal_scale(self, group: dict[str, Any], rows: int, cols: int) -> float:
        return 1.0

    @override
    def _after_update(self, prepared: _Prepared) -> None:
        weights, param, group = prepared.local, prepared.param, prepared.group
        matrices = self._matrices(weights, param, group)
        matrices.copy_(self._orthogonalize(matrices.to(compute_dtype(weights)), group))
        self._write_back(weights, matrices, param, group)


def _norms(matrices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The Frobenius norm of each matrix of a ``(count, rows, cols)`` stack, as ``(count, 1, 1)`` in ``dtype``."""
    norms: torch.Tensor = torch.linalg.vector_norm(matrices, dim=(-2, -1), keepdim=True, dtype=dtype)
    return norms


class MuonHyperball(_ProjectsWeights):
    r"""Muon on the sphere (hyperball): the update of each matrix is rescaled to the weights' norm
    :math:`R`, and the weights are scaled back to :math:`R` after it:
    :math:`W \leftarrow R \cdot \frac{W - \eta R\, U/\|U\|}{\|W - \eta R\, U/\|U\|\|}`.

    :math:`R` is ``hyperball_radius``, or each matrix's Frobenius norm before the step. With a
    radius, each matrix is rescaled to it before its first update (upstream: when the optimizer is
    built; optzoo waits for the first step, when a mixed-precision wrapper's main params are the
    ones stepped, and a resumed state skips it).

    Args:
        hyperball_eps: > 0, the floor of the norms divided by (``muon_hyperball_eps``). Default 1e-8.
        hyperball_radius: > 0, or ``None`` (default): each matrix keeps its own norm (``muon_hyperball_radius``).
        **muon: :class:`~optzoo.optimizers.muon.Muon`'s.

    Raises:
        ValueError: as Muon's, and for a matrix of zero norm (it has no direction to keep).
    """

    _projection = "its norm-preserving update"

    def __init__(self, params: ParamsT, *, hyperball_eps: float = 1e-8, hyperball_radius: float | None = None, **muon: Any) -> None:
        self._variant_defaults = {"hyperball_eps": hyperball_eps, "hyperball_radius": hyperball_radius}
        self._radii: dict[torch.Tensor, torch.Tensor] = {}
        super().__init__(params, **muon)

    @override
    def _check_group(self, group: dict[str, Any], index: int) -> None:
        where = f"param group #{index}"
        if not 0 < group["hyperball_eps"] < math.inf:
            raise ValueError(f"{where}: `hyperball_eps`: must be positive and finite; got {group['hyperball_eps']!r}; expected a float in (0, inf)")
        radius = group["hyperball_radius"]
        if radius is not None and not 0 < radius < math.inf:
            raise ValueError(f"{where}: `hyperball_radius`: must be positive and finite, or None; got {radius!r}; expected a float in (0, inf)")
        super()._check_group(group, index)
        for param_index, param in enumerate(group["params"]):
            if bool((torch.linalg.vector_norm(self._matrices(param.detach(), param, group, param_index), dim=(-2, -1)) == 0).any()):
                raise ValueError(
                    f"{describe_param(group, index, param_index)}: MuonHyperball keeps each matrix's norm; got a "
                    f"matrix of zero norm in shape {tuple(param.shape)}; expected non-zero weights (initialise them first)"
                )

    @override
    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        super()._init_state(param, state, group)
        radius = group["hyperball_radius"]
        if radius is not None:
            matrices = self._matrices(param.detach(), param, group)
            norms = _norms(matrices, compute_dtype(param))
            matrices.mul_(radius / norms.clamp_min(group["hyperball_eps"]))
            self._write_back(param.detach(), matrices, param, group)

    @override
    def _finish_update(
        self, orthogonal: torch.Tensor, *, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any],
        grad: torch.Tensor, direction: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        eps, radius = group["hyperball_eps"], group["hyperball_radius"]
        weights = self._matrices(param, param, group)
        dtype = compute_dtype(param)  # a bf16 param's radius in float32, not rounded to bf16
        radii = _norms(weights, dtype) if radius is None else torch.full((weights.shape[0], 1, 1), radius, dtype=dtype, device=weights.device)
        self._radii[param] = radii
        matrices = self._matrices(orthogonal.contiguous(), param, group)
        scaled = matrices * (radii / _norms(matrices, dtype).clamp_min(eps))
        update = torch.empty(param.shape, dtype=scaled.dtype, device=scaled.device)
        self._write_back(update, scaled, param, group)
        return update

    @override
    def _after_update(self, prepared: _Prepared) -> None:
        param, group = prepared.param, prepared.group
        weights = self._matrices(prepared.local, param, group)
        radii = self._radii.pop(param)
        weights.mul_(radii / _norms(weights, radii.dtype).clamp_min(group["hyperball_eps"]))  # in float32, rounded once
        self._write_back(prepared.local, weights, param, group)


class SinkhornMuon(_ProjectsWeights):
    r"""Sinkhorn-Muon: Muon, then each weight matrix mapped by Sinkhorn–Knopp (an ``exp``, then
    ``num_iters`` alternating row and column normalisations: rows sum to ``max(1, cols/rows)``,
    columns to ``max(1, rows/cols)``), as in DeepSeek's manifold-constrained hyper-connections
    (arXiv:2512.24880).

    The method needs Sinkhorn-normalised weights (non-negative, with those sums within
    ``doubly_stochastic_tolerance``). Upstream raises when a param is not when the optimizer is
    built, as ``normalize_at_start=False`` does; with it (the default), each matrix that is not is
    mapped (:func:`~optzoo.optimizers._emerging.sinkhorn_map_`) before its first update, and the
    others are left as they are: a freshly initialised model works, an initialised one is unchanged,
    and a resumed state skips it.

    Args:
        num_iters: >= 1 normalisation rounds (``sinkhorn_muon_num_iters``). Default 20.
        eps: > 0, added to the sums divided by (``sinkhorn_muon_eps``). Default 1e-8.
        doubly_stochastic_tolerance: > 0 (``sinkhorn_muon_doubly_stochastic_tolerance``). Default 0.1.
        normalize_at_start: map the matrices that are not normalised when built, instead of
            raising (``sinkhorn_muon_normalize_at_start``). Default True.
        **muon: :class:`~optzoo.optimizers.muon.Muon`'s.
    """

    _projection = "its Sinkhorn-Knopp map of the weights"

    def __init__(
        self, params: ParamsT, *, num_iters: int = 20, eps: float = 1e-8, doubly_stochastic_tolerance: float = 0.1,
        normalize_at_start: bool = True, **muon: Any,
    ) -> None:  # fmt: skip
        self._variant_defaults = {
            "num_iters": num_iters, "eps": eps, "doubly_stochastic_tolerance": doubly_stochastic_tolerance,
            "normalize_at_start": normalize_at_start,
        }  # fmt: skip
        super().__init__(params, **muon)

    @override
    def _check_group(self, group: dict[str, Any], index: int) -> None:
        where = f"param group #{index}"
        iters = group["num_iters"]
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(f"{where}: `num_iters`: must be a positive integer; got {iters!r}; expected an int >= 1")
        for key in ("eps", "doubly_stochastic_tolerance"):
            if not 0 < group[key] < math.inf:
                raise ValueError(f"{where}: `{key}`: must be positive and finite; got {group[key]!r}; expected a float in (0, inf)")
        check_flag(f"{where}: `normalize_at_start`", group["normalize_at_start"])
        super()._check_group(group, index)
        if group["normalize_at_start"]:
            return
        for param_index, param in enumerate(group["params"]):
            for matrix in self._matrices(param.detach(), param, group, param_index):
                problem = self._not_normalized(matrix, group["doubly_stochastic_tolerance"])
                if problem:
                    raise ValueError(
                        f"{describe_param(group, index, param_index)}: SinkhornMuon needs Sinkhorn-normalised weights; "
                        f"got {problem}: set normalize_at_start=True, or initialise with "
                        "optzoo.optimizers._emerging.sinkhorn_map_"
                    )

    @staticmethod
    def _not_normalized(matrix: torch.Tensor, tolerance: float) -> str:
        """What keeps ``matrix`` from being Sinkhorn-normalised within ``tolerance``, in words; empty if nothing."""
        rows, cols = matrix.shape
        row_target, col_target = (cols / rows, 1.0) if cols > rows else (1.0, rows / cols)
        row_off = (matrix.sum(dim=-1) - row_target).abs().max().item()
        col_off = (matrix.sum(dim=-2) - col_target).abs().max().item()
        if not (bool((matrix < 0).any()) or row_off > tolerance or col_off > tolerance):
            return ""
        return (
            f"min {matrix.min().item():.4g}, row sums off {row_target:g} by {row_off:.4g}, column sums off "
            f"{col_target:g} by {col_off:.4g}; expected non-negative entries within {tolerance:g}"
        )

    @override
    def _init_state(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        super()._init_state(param, state, group)
        if not group["normalize_at_start"]:
            return
        matrices = self._matrices(param.detach(), param, group)
        for matrix in matrices:
            if self._not_normalized(matrix, group["doubly_stochastic_tolerance"]):
                self._map_(matrix, group, compute_dtype(param))
        self._write_back(param.detach(), matrices, param, group)

    @override
    def _after_update(self, prepared: _Prepared) -> None:
        param, group = prepared.param, prepared.group
        matrices = self._matrices(prepared.local, param, group)
        for matrix in matrices:  # one by one: the map subtracts its input's maximum before exp
            self._map_(matrix, group, compute_dtype(param))
        self._write_back(prepared.local, matrices, param, group)

    @staticmethod
    def _map_(matrix: torch.Tensor, group: dict[str, Any], dtype: torch.dtype) -> None:
        """:func:`~optzoo.optimizers._emerging.sinkhorn_map_` of one matrix, in place, computed in
        ``dtype`` (float32 for 16-bit weights: rounded once, not at each sum)."""
        if matrix.dtype == dtype:
            sinkhorn_map_(matrix, num_iters=group["num_iters"], eps=group["eps"])
        else:
            matrix.copy_(sinkhorn_map_(matrix.to(dtype), num_iters=group["num_iters"], eps=group["eps"]))
