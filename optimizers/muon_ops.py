"""Muon's pure operations: the update's arithmetic, the matrix views of a param, FSDP2 shards.

:class:`~optzoo.optimizers.muon.Muon` (and :class:`~optzoo.optimizers.adaptive_muon.AdaptiveMuon`)
compose these; each is tested on its own. Newton–Schulz itself is
:func:`optzoo.optimizers.newton_schulz.newton_schulz`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch.distributed.tensor import DTensor, Replicate

from .._common import MatrixView, check_choice

__all__ = [
    "MuonScaleMode",
    "ScaleMode",
    "TorchAdjustLr",
    "as_matrices",
    "from_matrices",
    "compute_dtype",
    "decoupled_weight_decay_",
    "gather_whole",
    "matrix_shape",
    "momentum_direction_",
    "muon_scale_factor",
    "qkv_blocks",
    "take_shard",
]

ScaleMode = Literal["spectral", "unit_rms_norm", "shape_scaling"]
"""How the orthogonalised update is scaled: emerging-optimizers' ``MuonScaleT`` (Megatron-Core's
``muon_scale_mode``)."""

TorchAdjustLr = Literal["original", "match_rms_adamw", "spectral_unclamped"]
"""``torch.optim.Muon``'s ``adjust_lr_fn`` names (``torch/optim/_muon.py``
``_adjust_lr``, torch 2.14), taken as scale modes so that ``torch.optim.Muon(lr=x, adjust_lr_fn=y)`` ports
to ``muon_scale_mode=y`` with the same ``lr``."""

MuonScaleMode = Literal[ScaleMode, TorchAdjustLr]
"""Every scale mode Muon takes: upstream's and torch's names."""


def muon_scale_factor(rows: int, cols: int, mode: MuonScaleMode) -> float:
    """The factor on the orthogonalised update of a ``rows × cols`` matrix: upstream's
    ``get_muon_scale_factor(size_out=rows, size_in=cols, mode)``, or torch's ``_adjust_lr`` ratio.

    * ``spectral``: ``√max(rows, cols)`` (Jordan; Kimi, arXiv:2502.16982), lr transfer from AdamW.
    * ``unit_rms_norm``: ``√(rows / cols)`` (Scion, arXiv:2502.07529): unit RMS→RMS operator norm.
    * ``shape_scaling``: ``√max(1, rows / cols)`` (https://kellerjordan.github.io/posts/muon/).
    * torch's ``original`` is ``shape_scaling``, ``spectral_unclamped`` is ``unit_rms_norm``, and
      ``match_rms_adamw`` is ``0.2·√max(rows, cols)`` (Moonlight): ``spectral`` times 0.2.

    Example:
        >>> muon_scale_factor(1024, 4096, "spectral"), muon_scale_factor(4096, 1024, "shape_scaling")
        (64.0, 2.0)
        >>> muon_scale_factor(1024, 4096, "match_rms_adamw")
        12.8
    """
    check_choice("`scale_mode`", mode, get_args(MuonScaleMode))
    # Each family's own expression, so each factor rounds as its source's does.
    if mode == "original":
        return math.sqrt(max(1, rows / cols))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "spectral_unclamped":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return float(max(1.0, rows / cols) ** 0.5)
    if mode == "spectral":
        return float(max(rows, cols) ** 0.5)
    return float((rows / cols) ** 0.5)  # unit_rms_norm


def decoupled_weight_decay_(param: torch.Tensor, *, lr: float, weight_decay: float) -> None:
    """``W ← W − lr·λ·W`` in place: upstream's ``decoupled`` method, with the same operation."""
    if weight_decay != 0.0:
        param.add_(param, alpha=-weight_decay * lr)


def momentum_direction_(momentum_buffer: torch.Tensor, grad: torch.Tensor, *, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the EMA momentum in place and return the direction to orthogonalise.

    ``M ← M + (1 − μ)(G − M)``, then ``M`` or, with Nesterov, ``G + μ(M − G)``: upstream's
    ``lerp`` forms, bit for bit. Without Nesterov the returned tensor *is* the buffer.
    """
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def qkv_blocks(matrix: torch.Tensor, split: Sequence[int]) -> list[torch.Tensor]:
    """Views of a fused QKV matrix's blocks, each ``(query_groups, split[k], cols)``.

    The rows hold ``query_groups`` repeats of ``sum(split)`` rows (e.g. ``[q, kv, kv]``); block
    ``k`` gathers the ``split[k]`` rows at the same offset of every group. Orthogonalised, block
    ``k`` is the ``(query_groups · split[k]) × cols`` matrix ``view.reshape(-1, cols)``, as in
    Megatron-Core's ``TensorParallelMuon.orthogonalize``.

    Example:
        >>> [tuple(b.shape) for b in qkv_blocks(torch.zeros(2 * (4 + 2 + 2), 16), [4, 2, 2])]
        [(2, 4, 16), (2, 2, 16), (2, 2, 16)]
    """
    rows, cols = matrix.shape
    grouped = matrix.view(rows // sum(split), sum(split), cols)
    return list(torch.split(grouped, list(split), dim=1))


def matrix_shape(shape: Sequence[int], *, flatten: bool, view: MatrixView | None = None) -> tuple[int, ...]:
    """The shape under which a param of ``shape`` is orthogonalised: ``(..., rows, cols)``.

    With a ``view`` (how the forward multiplies by it: :class:`~optzoo._common.MatrixView`), the
    stack ``(count, rows, cols)`` of its blocks, or ``(rows, cols)`` when it has none. Otherwise a
    2-D param is one matrix whatever ``flatten`` says; an N-D one is a stack of ``shape[-2:]``
    matrices over its leading dims (``flatten=False``; e.g. MoE experts), or the one matrix
    ``(shape[0], prod(shape[1:]))`` (``flatten=True``; e.g. conv filters). Without a view, a
    param-shaped contiguous tensor views as this shape with no copy (:func:`as_matrices`).

    Example:
        >>> matrix_shape((8, 4, 16), flatten=False), matrix_shape((8, 4, 3, 3), flatten=True)
        ((8, 4, 16), (8, 36))
        >>> transposed = MatrixView(split=(4, 8, 16), origin=(0, 1, 2), blocks=(0,), rows=(2,), cols=(1,))
        >>> matrix_shape((4, 8, 16), flatten=False, view=transposed)  # [E, in, out]: each expert is 16 x 8
        (4, 16, 8)
    """
    if view is not None:
        return (view.count, *view.shape) if view.blocks else view.shape
    if flatten and len(shape) > 2:
        return (shape[0], math.prod(shape[1:]))
    return tuple(shape)


def as_matrices(tensor: torch.Tensor, *, flatten: bool, view: MatrixView | None = None) -> torch.Tensor:
    """A param-shaped tensor as the matrices it is orthogonalised as (:func:`matrix_shape`): a
    view where its layout allows (always for a contiguous tensor without a ``view``), else a copy."""
    shape = matrix_shape(tensor.shape, flatten=flatten, view=view)
    if view is None:
        return tensor.reshape(shape)
    return tensor.reshape(view.split).permute(view.order).reshape(shape)


def from_matrices(matrices: torch.Tensor, shape: Sequence[int], *, flatten: bool, view: MatrixView | None = None) -> torch.Tensor:
    """The inverse of :func:`as_matrices`: matrices (or anything broadcast to them) back in the param's ``shape``.

    Example:
        >>> view = MatrixView(split=(2, 3, 5), origin=(0, 1, 2), blocks=(0,), rows=(2,), cols=(1,))
        >>> x = torch.randn(2, 3, 5)
        >>> torch.equal(from_matrices(as_matrices(x, flatten=False, view=view), x.shape, flatten=False, view=view), x)
        True
    """
    if view is None:
        return matrices.reshape(tuple(shape))
    stacked = matrices.expand(matrix_shape(shape, flatten=flatten, view=view))
    permuted = stacked.reshape(tuple(view.split[i] for i in view.order))
    inverse = sorted(range(len(view.order)), key=lambda k: view.order[k])
    return permuted.permute(inverse).reshape(tuple(shape))


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype a param's step (and its state) is computed in: float32 for 16-bit params."""
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


def gather_whole(shard: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The whole tensor whose pieces are every rank's ``shard``, laid out as ``like``'s (an all-gather).

    ``like`` gives the mesh, placements and global shape, so uneven shards (rows not divisible
    by the world size) come back unpadded.
    """
    spread = DTensor.from_local(shard, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())
    return spread.full_tensor()


def take_shard(whole: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's shard of ``whole`` (a tensor every rank holds), laid out as ``like``'s local shard.

    Redistributing from ``Replicate`` to ``like``'s placements slices locally: no communication.
    """
    mesh = like.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()
