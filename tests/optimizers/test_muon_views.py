"""Blocks the forward multiplies by, stepped by Muon, equal each block stepped as its own matrix.

A ``MatrixView`` (a param group's ``matrix_views``) says how a forward multiplies by a tensor: as
the blocks of an expert stack ``[E, out, in]`` or ``[E, in, out]``, experts concatenated in one
``[E*ffn, d]`` tensor, a grouped conv's groups, per-head matrices, interleaved rows. Muon and
Adaptive Muon must step each block exactly as emerging-optimizers' classes step a 2-D ``out x in``
parameter holding it: Newton–Schulz, the scale factor of the block's own shape (every scale
mode), momentum, weight decay and the second moment. The reference is upstream's class on the
blocks laid out as separate matrices; our Newton–Schulz replaces upstream's in its place, as in
test_muon.py, so the comparison measures the optimizer shell alone: bit for bit.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any, get_args

import pytest
import torch

from optzoo import MatrixView, OptimizerConfig, get_optimizer
from optzoo.optimizers import _emerging
from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon, ScaleMode

SETTINGS: dict[str, Any] = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "fp32_matmul_prec": "highest"}
STEPS = 4


@pytest.fixture(autouse=True)
def highest_precision() -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def _view(split: tuple[int, ...], origin: tuple[int, ...], blocks: tuple[int, ...], rows: tuple[int, ...], cols: tuple[int, ...]) -> MatrixView:
    return MatrixView(split=split, origin=origin, blocks=blocks, rows=rows, cols=cols)


LAYOUTS: dict[str, tuple[tuple[int, ...], MatrixView, Callable[[torch.Tensor], list[torch.Tensor]]]] = {
    # name: (param shape, view, the blocks as (out, in) matrices, written by hand for the layout)
    "experts [E, out, in]": ((3, 5, 7), _view((3, 5, 7), (0, 1, 2), (0,), (1,), (2,)), lambda w: [w[e] for e in range(3)]),
    "experts [E, in, out]": ((3, 7, 5), _view((3, 7, 5), (0, 1, 2), (0,), (2,), (1,)), lambda w: [w[e].T for e in range(3)]),
    "experts [E*ffn, d]": ((3 * 6, 9), _view((3, 6, 9), (0, 0, 1), (0,), (1,), (2,)), lambda w: [w[6 * e : 6 * e + 6] for e in range(3)]),
    "per-head [H, d_in, d_out]": ((2, 33, 65), _view((2, 33, 65), (0, 1, 2), (0,), (2,), (1,)), lambda w: [w[h].T for h in range(2)]),
    "conv, 2 groups [out, in/2, k]": ((8, 3, 5), _view((2, 4, 3, 5), (0, 0, 1, 2), (0,), (1,), (2, 3)),
                                      lambda w: [w[4 * g : 4 * g + 4].reshape(4, 15) for g in range(2)]),
    "interleaved rows [n, d]": ((10, 6), _view((5, 2, 6), (0, 0, 1), (1,), (0,), (2,)), lambda w: [w[b::2] for b in range(2)]),
}  # fmt: skip


def _pair(layout: str, cls: type[Muon], make_reference: Callable[..., torch.optim.Optimizer], **settings: Any) -> tuple[
    torch.nn.Parameter, list[torch.nn.Parameter], Muon, torch.optim.Optimizer
]:  # fmt: skip
    shape, view, blocks = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(shape, generator=generator))
    singles = [torch.nn.Parameter(block.detach().clone().contiguous()) for block in blocks(param.detach())]
    ours = cls([{"params": [param], "matrix_views": [view]}], **SETTINGS, **settings)
    reference = make_reference(singles, **SETTINGS, **settings)
    for _ in range(STEPS):
        grad = torch.randn(shape, generator=generator)
        param.grad = grad.clone()
        for single, block in zip(singles, blocks(grad)):
            single.grad = block.clone().contiguous()
        ours.step()
        reference.step()
    return param, singles, ours, reference


@pytest.fixture
def upstream_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's Newton–Schulz in our Muon's place: the comparison is of the optimizers' shells."""
    import optzoo.optimizers.muon as muon_module
    from tests.optimizers.reference.muon import upstream_newton_schulz

    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)


@pytest.mark.usefixtures("upstream_engine")
@pytest.mark.parametrize("scale_mode", get_args(ScaleMode))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_muon_steps_each_block_as_upstream_steps_it_alone(layout: str, scale_mode: str) -> None:
    param, singles, ours, reference = _pair(layout, Muon, _emerging.muon, scale_mode=scale_mode, nesterov=True)
    _, _, blocks = LAYOUTS[layout]
    for block, single in zip(blocks(param.detach()), singles):
        torch.testing.assert_close(block, single.detach(), atol=0, rtol=0)
    momentum = ours.state[param]["momentum_buffer"]
    for block, single in zip(blocks(momentum), singles):
        torch.testing.assert_close(block, reference.state[single]["momentum_buffer"], atol=0, rtol=0)


@pytest.mark.usefixtures("upstream_engine")
@pytest.mark.parametrize("method", ["adamuon", "normuon", "namo"])
@pytest.mark.parametrize("scale_mode", ["spectral", "unit_rms_norm"])
@pytest.mark.parametrize("layout", ["experts [E, in, out]", "experts [E*ffn, d]", "per-head [H, d_in, d_out]"])
def test_adaptive_muon_steps_each_block_as_upstream_steps_it_alone(layout: str, scale_mode: str, method: str) -> None:
    param, singles, ours, reference = _pair(
        layout, AdaptiveMuon, _emerging.adaptive_muon, scale_mode=scale_mode, moment2_method=method, beta2=0.9, eps=1e-7
    )
    _, view, blocks = LAYOUTS[layout]
    # The second moment and Frobenius norms reduce over each block: the same sums in another
    # layout round in another order. Measured worst over these cases 4e-7; 2e-6 leaves a margin.
    for block, single in zip(blocks(param.detach()), singles):
        torch.testing.assert_close(block, single.detach(), atol=2e-6, rtol=2e-6)
    moment = ours.state[param]["exp_avg_sq"]
    if method == "adamuon":  # element-wise: param-shaped
        moments = blocks(moment)
    else:  # one per row (or column) of each block, or one per block: (count, ...) in block order
        moments = list(moment.reshape(view.count, *moment.shape[1:]) if moment.dim() > 1 else moment)
    for ours_moment, single in zip(moments, singles):
        theirs = reference.state[single]["moment2_buffer"]
        torch.testing.assert_close(ours_moment.reshape(theirs.shape), theirs, atol=2e-6, rtol=2e-6)


def test_views_that_do_not_fit_are_refused_at_construction() -> None:
    param = torch.nn.Parameter(torch.zeros(3, 5, 7))
    view = LAYOUTS["experts [E, out, in]"][1]
    with pytest.raises(ValueError, match=re.escape(
        "param group #0: `matrix_views`: must give one view (or None) per param; got list of 2 for 1 params; "
        "expected a list parallel to `params`"
    )):  # fmt: skip
        Muon([{"params": [param], "matrix_views": [view, None]}])
    other = LAYOUTS["experts [E, in, out]"][1]
    with pytest.raises(ValueError, match=r"^param group #0, param #0: `matrix_views`: does not view this param; got "
                       r"MatrixView\(split=\(3, 7, 5\).*; expected a MatrixView of shape \(3, 5, 7\), or None$"):  # fmt: skip
        Muon([{"params": [param], "matrix_views": [other]}])


def test_a_checkpoint_keeps_the_groups_own_views_and_resumes_bit_for_bit() -> None:
    shape, view, _ = LAYOUTS["experts [E*ffn, d]"]
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=generator) for _ in range(4)]
    param = torch.nn.Parameter(torch.randn(shape, generator=generator))
    twin = torch.nn.Parameter(param.detach().clone())
    ours = Muon([{"params": [param], "matrix_views": [view]}], **SETTINGS)
    uninterrupted = Muon([{"params": [twin], "matrix_views": [view]}], **SETTINGS)
    for step, grad in enumerate(grads):
        if step == 2:  # resume from a checkpoint into a fresh optimizer
            saved = copy.deepcopy(ours.state_dict())
            saved["param_groups"][0]["matrix_views"] = [None]  # a checkpoint's views are not the model's
            ours = Muon([{"params": [param], "matrix_views": [view]}], **SETTINGS)
            ours.load_state_dict(saved)
            assert ours.param_groups[0]["matrix_views"] == [view]
        param.grad, twin.grad = grad.clone(), grad.clone()
        ours.step()
        uninterrupted.step()
    torch.testing.assert_close(param, twin, atol=0, rtol=0)


class ConcatenatedExperts(torch.nn.Module):
    """DBRX's layout: the experts' matrices concatenated in one 2-D parameter, split in the forward."""

    def __init__(self, experts: int = 3, ffn: int = 6, hidden: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts * ffn, hidden) / hidden**0.5)
        self.head = torch.nn.Linear(hidden, vocab)
        self.experts, self.ffn = experts, ffn

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        gates = self.router(x).softmax(-1)
        w1 = self.w1.view(self.experts, self.ffn, -1)
        out = sum(gates[..., e : e + 1] * torch.relu(x @ w1[e].T).sum(-1, keepdim=True) for e in range(self.experts))
        return self.head(x + out)


@pytest.mark.usefixtures("upstream_engine")
@pytest.mark.parametrize("scale_mode", get_args(ScaleMode))
def test_get_optimizer_steps_concatenated_experts_one_by_one(scale_mode: str) -> None:
    torch.manual_seed(0)
    model = ConcatenatedExperts()
    config = OptimizerConfig(
        optimizer="muon", lr=0.02, weight_decay=0.1, muon_momentum=0.9, muon_scale_mode=scale_mode,
        muon_fp32_matmul_prec="highest", clip_grad=0.0,
    )  # fmt: skip
    optimizer = get_optimizer(config, model, lint=False)
    group = next(g for g in optimizer.param_groups if any(p is model.w1 for p in g["params"]))
    view = group["matrix_views"][[p is model.w1 for p in group["params"]].index(True)]
    assert (view.count, *view.shape) == (3, 6, 8)
    singles = [torch.nn.Parameter(block.detach().clone()) for block in model.w1.detach().split(6)]
    reference = _emerging.muon(
        singles, lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest", scale_mode=scale_mode, nesterov=False
    )
    for _ in range(STEPS):
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        for single, block in zip(singles, model.w1.grad.split(6)):
            single.grad = block.clone()
        optimizer.step()
        reference.step()
    torch.testing.assert_close(model.w1.detach(), torch.cat([s.detach() for s in singles]), atol=0, rtol=0)
