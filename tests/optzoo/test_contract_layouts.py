"""Layouts on every row of ``optim_db``: a param stored transposed, with gaps or channels-last steps
as its contiguous copy does (bit for bit, or to rounding where the update sums over the param),
and keeps its strides. ``test_layouts.py`` runs every kernel path and zero-size params."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerInput

from optzoo.optimizers.registry import get_spec
from tests.optzoo.optim_db import OptzooOptimizerInfo
from tests.optzoo.test_torch_contract import CASES, assert_bitwise, build, params_for, targets_for, train, values


# ---- layouts --------------------------------------------------------------------------------------


def _laid_out(values: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to ``values`` stored with ``layout``'s strides."""
    if layout == "contiguous":
        return values.clone()
    if layout == "transposed":
        return values.t().contiguous().t() if values.dim() == 2 else values.clone()
    if layout == "gaps":  # every other element of a wider buffer
        wide = torch.zeros((*values.shape, 2), dtype=values.dtype)
        wide[..., 0] = values
        return wide[..., 0]
    if layout == "channels_last":
        return values.reshape(*values.shape[:1], -1, 1, 1).contiguous(memory_format=torch.channels_last)
    raise AssertionError(layout)


LAYOUTS = ["transposed", "gaps", "channels_last"]


def _layout_params(row: OptzooOptimizerInfo, inp: OptimizerInput, layout: str) -> list[torch.nn.Parameter]:
    base = params_for(row, inp, seed=3)
    if layout == "channels_last":
        return [torch.nn.Parameter(_laid_out(p.detach(), layout)) for p in base if p.dim() == 2]
    return [torch.nn.Parameter(_laid_out(p.detach(), layout)) for p in base]


def _reduces_over_params(row: OptzooOptimizerInfo, inp: OptimizerInput) -> bool:
    """Whether the update sums over a param's elements (a clip norm, SOAP's factors, NorMuon's and
    NAMO's norms, torch's Adafactor's RMS and factors, PSGD's Kronecker contractions, the oblique
    optimizers' per-slice norms): such sums run in storage order, so another layout rounds them differently."""
    kwargs = inp.kwargs
    method = kwargs.get("moment2_method", kwargs.get("adaptive_muon_moment2_method"))
    spec = get_spec(row.algorithm) if row.algorithm is not None else None
    matrix_preconditioner = spec is not None and not spec.elementwise and spec.family in ("preconditioned", "riemannian")
    return bool(kwargs.get("clip_grad")) or method in ("normuon", "namo") or matrix_preconditioner or row.algorithm == "adafactor"


def _permuted_layout_comparable(row: OptzooOptimizerInfo) -> bool:
    """SOAP's first steps are Adam in the gradient's singular basis, where the off-diagonal entries
    are rounding noise whose sign decides a ±lr update: any change of rounding (a transposed
    matmul) moves the weights by ~lr, on contiguous params too; REKLS is SOAP with another factor
    update. Params with gaps are still compared: they are stepped through a dense copy, bit for bit."""
    return row.algorithm not in ("soap", "rekls") and "soap" not in row.name


LAYOUT_CASES = [
    (row, inp, layout)
    for row, inp in CASES
    for layout in LAYOUTS
    # The Muon classes take 4-D params as stacks (tests/optimizers/test_muon_nd.py); SOAP: see above.
    if not (row.matrices_only and layout == "channels_last") and (layout == "gaps" or _permuted_layout_comparable(row))
]


@pytest.mark.parametrize(("row", "inp", "layout"), LAYOUT_CASES, ids=[f"{r.name}-{i.desc}-{lay}" for r, i, lay in LAYOUT_CASES])
def test_any_layout_steps_as_its_contiguous_copy(row: OptzooOptimizerInfo, inp: OptimizerInput, layout: str) -> None:
    laid_out = _layout_params(row, inp, layout)
    strides = [p.stride() for p in laid_out]
    dense = [torch.nn.Parameter(p.detach().clone(memory_format=torch.contiguous_format)) for p in laid_out]  # never aliases
    targets = [t.reshape(p.shape) for t, p in zip(targets_for(dense), dense, strict=True)]
    # The wrapper clips at 1 by default (Megatron's clip_grad): the inputs that clip are tried as such.
    extra = {"clip_grad": 0.0} if row.wrapper and "clip_grad" not in inp.kwargs else {}
    for params in (laid_out, dense):
        train(build(row, params, inp, **extra), params, targets, 3)
    assert [p.stride() for p in laid_out] == strides
    got, expected = [p.detach().contiguous() for p in laid_out], values(dense)
    if _reduces_over_params(row, inp):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert_bitwise(got, expected)




def test_soap_moves_by_about_lr_when_only_rounding_changes() -> None:
    # Why SOAP's transposed rows are not compared: one ulp on a contiguous gradient does this too.
    from optzoo.optimizers import _emerging

    generator = torch.Generator().manual_seed(0)
    base, grad = torch.randn(5, 5, generator=generator), torch.randn(5, 5, generator=generator)
    results = []
    for nudged in (False, True):
        param = torch.nn.Parameter(base.clone())
        opt = _emerging.soap(
            [{"params": [param], "lr": 0.01, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8, "shampoo_beta": 0.95}],
            use_kl_shampoo=False,
        )
        param.grad = torch.nextafter(grad, grad + 1) if nudged else grad.clone()
        opt.step()
        results.append(param.detach().clone())
    assert (results[0] - results[1]).abs().max() > 1e-3  # ~lr, from 1 ulp
