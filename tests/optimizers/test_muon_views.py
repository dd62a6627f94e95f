"""Muon and AdaptiveMuon step each block of a ``matrix_views`` param exactly as upstream steps
that block as its own ``(out, in)`` matrix.

A :class:`~optzoo._common.MatrixView` says how the forward multiplies by a param: experts stored
``[E, out, in]`` or ``[E, in, out]``, experts concatenated ``[E*ffn, in]``, a grouped projection or
conv, a per-head stack, interleaved rows. The reference is emerging-optimizers 0.3.0's own
``Muon`` and ``AdaptiveMuon`` (built through :mod:`optzoo.optimizers._emerging`, the adapter every
import of the package goes through, as in test_muon.py) on separate 2-D params, one per block,
cut out of the param by hand-written indexing (``w[e].T``, ``w[g*r:(g+1)*r]``, ``w[b::2]``), never
by optzoo's view code; the blocks are reassembled the same way to compare.

Parity comes in test_muon.py's two strengths: given upstream's Newton–Schulz swapped in for ours,
bitwise for Muon and AdaMuon (element-wise after Newton–Schulz) and to a few ulps for NorMuon and
NAMO (:data:`REDUCTIONS`); with our Newton–Schulz, to float32 rounding (:data:`END_TO_END`).
The suite ends with the view checks at construction, a state-dict round trip, and
``get_optimizer`` on a small MoE model whose forward reads its concatenated experts through
``w1.view(E, ffn, hidden)[e]``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import optzoo.optimizers.muon as muon_module
from optzoo import OptimizerConfig, get_optimizer
from optzoo._common import MatrixView
from optzoo.optimizers import _emerging
from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon, ScaleMode
from tests.optimizers.reference.muon import upstream_newton_schulz
from tests.optimizers.test_muon import END_TO_END, EXTRA, SETTINGS
pytestmark = pytest.mark.usefixtures("highest_precision")  # tests/conftest.py

SCALE_MODES: tuple[ScaleMode, ...] = get_args(ScaleMode)
STEPS = 4
EXACT = {"atol": 0.0, "rtol": 0.0}
# NorMuon's row (or column) means and the Frobenius norms of NorMuon and NAMO reduce over each
# block. Where a block is not a row-major slice of the param ([E, in, out], per-head, interleaved)
# ours reads it in the param's storage order, upstream in its own row-major order: the same sums,
# rounded in another order (a few ulps). Measured worst over 5 seeds, every case below, params and
# second moments: 1.9e-7 (atol=rtol=t convention); 1e-6 leaves a 5x margin.
REDUCTIONS = {"atol": 1e-6, "rtol": 1e-6}


@dataclass(frozen=True)
class Layout:
    """A param's shape, the view its forward implies, and block ``k`` as an ``(out, in)`` view, by hand."""

    shape: tuple[int, ...]
    view: MatrixView
    block: Callable[[torch.Tensor, int], torch.Tensor]


def _stack(split: tuple[int, ...], rows: int, cols: int) -> MatrixView:
    """Blocks over dim 0 of a 3-D stack, with the given rows and cols dims."""
    return MatrixView(split=split, origin=(0, 1, 2), blocks=(0,), rows=(rows,), cols=(cols,))


LAYOUTS: dict[str, Layout] = {
    "experts_out_in": Layout((3, 5, 7), _stack((3, 5, 7), 1, 2), lambda t, e: t[e]),
    "experts_out_in_tall": Layout((2, 65, 33), _stack((2, 65, 33), 1, 2), lambda t, e: t[e]),
    # transformers' is_transposed experts: x @ w[e]
    "experts_in_out": Layout((3, 7, 5), _stack((3, 7, 5), 2, 1), lambda t, e: t[e].T),
    "experts_in_out_33x65": Layout((2, 65, 33), _stack((2, 65, 33), 2, 1), lambda t, e: t[e].T),
    # DBRX-style: w.view(E, ffn, in)[e]
    "concatenated": Layout(
        (15, 7), MatrixView(split=(3, 5, 7), origin=(0, 0, 1), blocks=(0,), rows=(1,), cols=(2,)), lambda t, e: t[5 * e : 5 * e + 5]
    ),
    "grouped_projection": Layout(
        (66, 65), MatrixView(split=(2, 33, 65), origin=(0, 0, 1), blocks=(0,), rows=(1,), cols=(2,)), lambda t, g: t[33 * g : 33 * g + 33]
    ),
    # conv1d(in=9, out=15, kernel 3, groups=3): group g maps its 3 in channels x 3 taps to 5 out channels
    "grouped_conv": Layout(
        (15, 3, 3),
        MatrixView(split=(3, 5, 3, 3), origin=(0, 0, 1, 2), blocks=(0,), rows=(1,), cols=(2, 3)),
        lambda t, g: t[5 * g : 5 * g + 5].reshape(5, 9),
    ),
    # einsum('bhtd,hde->bhte', x, w): head h maps d_in=6 to d_out=9 (tall blocks)
    "per_head": Layout((4, 6, 9), _stack((4, 6, 9), 2, 1), lambda t, h: t[h].T),
    # row 2i + b belongs to block b
    "interleaved": Layout(
        (10, 7), MatrixView(split=(5, 2, 7), origin=(0, 0, 1), blocks=(1,), rows=(0,), cols=(2,)), lambda t, b: t[b::2]
    ),
}
CASES = [*LAYOUTS, "all"]
"""Each layout alone, then all in one group (their same-shape blocks share Newton–Schulz batches)."""

Factory = Callable[..., torch.optim.Optimizer]
ADAPTIVE = {"beta2": 0.9, "eps": 1e-8}  # a fast second moment: a wrong entry shows within STEPS
OURS: dict[str, Factory] = {
    "muon": Muon,
    **{m: functools.partial(AdaptiveMuon, moment2_method=m, **ADAPTIVE) for m in ("adamuon", "normuon", "namo")},
}
UPSTREAM: dict[str, Factory] = {
    "muon": _emerging.muon,
    **{m: functools.partial(_emerging.adaptive_muon, moment2_method=m, **ADAPTIVE) for m in ("adamuon", "normuon", "namo")},
}


def _layouts(case: str) -> list[Layout]:
    return list(LAYOUTS.values()) if case == "all" else [LAYOUTS[case]]


def _params(layouts: Sequence[Layout], seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(layout.shape, generator=generator)) for layout in layouts]


def _blocks(tensors: Sequence[torch.Tensor], layouts: Sequence[Layout]) -> list[torch.Tensor]:
    """Every block of every tensor, in order, as contiguous ``(out, in)`` copies."""
    return [
        layout.block(t.detach(), k).clone(memory_format=torch.contiguous_format)
        for t, layout in zip(tensors, layouts, strict=True)
        for k in range(layout.view.count)
    ]


def _assemble(blocks: Sequence[torch.Tensor], layouts: Sequence[Layout]) -> list[torch.Tensor]:
    """The inverse of :func:`_blocks`: param-shaped tensors (NaN where no block wrote)."""
    remaining, out = iter(blocks), []
    for layout in layouts:
        whole = torch.full(layout.shape, float("nan"))
        for k in range(layout.view.count):
            layout.block(whole, k).copy_(next(remaining))
        out.append(whole)
    assert next(remaining, None) is None
    return out


def _twins(params: Sequence[torch.Tensor], layouts: Sequence[Layout]) -> list[nn.Parameter]:
    return [nn.Parameter(b) for b in _blocks(params, layouts)]


def _drive(
    ours: torch.optim.Optimizer, params: Sequence[torch.Tensor], reference: torch.optim.Optimizer,
    twins: Sequence[torch.Tensor], layouts: Sequence[Layout], *, steps: int = STEPS, seed: int = 1,
) -> None:  # fmt: skip
    """Step both; each twin's gradient is its block of its param's (Gaussian, param-independent) gradient."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        for twin, piece in zip(twins, _blocks([p.grad for p in params], layouts), strict=True):  # type: ignore[misc]
            twin.grad = piece
        ours.step()
        reference.step()


def _run(name: str, case: str, tolerance: dict[str, float], **settings: Any) -> None:
    """Step a view param (or all) with ours and its blocks with upstream's; compare params and state."""
    layouts = _layouts(case)
    params = _params(layouts)
    twins = _twins(params, layouts)
    settings = {**SETTINGS, "extra_scale_factor": EXTRA, **settings}
    ours = OURS[name]([{"params": params, "matrix_views": [layout.view for layout in layouts]}], **settings)
    reference = UPSTREAM[name](twins, weight_decay_method="decoupled", **settings)
    _drive(ours, params, reference, twins, layouts)
    expected = _assemble([t.detach() for t in twins], layouts)
    momentum = _assemble([reference.state[t]["momentum_buffer"] for t in twins], layouts)
    for p, want, buffer in zip(params, expected, momentum, strict=True):
        torch.testing.assert_close(p.detach(), want, **tolerance)
        # momentum is the same element-wise lerp of the same gradients: exact whatever Newton–Schulz does
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], buffer, atol=0, rtol=0)
    if name == "adamuon":  # element-wise: param-shaped, block by block
        second = _assemble([reference.state[t]["moment2_buffer"] for t in twins], layouts)
        for p, want in zip(params, second, strict=True):
            torch.testing.assert_close(ours.state[p]["exp_avg_sq"], want, **tolerance)
    elif name != "muon":  # one row or column vector (NorMuon), or one scalar (NAMO), per block
        upstream_second = iter(reference.state[t]["moment2_buffer"] for t in twins)
        for p, layout in zip(params, layouts, strict=True):
            ours_second = ours.state[p]["exp_avg_sq"].reshape(layout.view.count, -1)
            for k in range(layout.view.count):
                torch.testing.assert_close(ours_second[k], next(upstream_second).reshape(-1), **tolerance)


# ---- parity with upstream, block by block ---------------------------------------------------


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("name", list(OURS))
@pytest.mark.parametrize("case", CASES)
def test_blocks_step_as_upstream_given_its_newton_schulz(
    case: str, name: str, scale_mode: str, nesterov: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream's Newton–Schulz, one 2-D call per block, in place of ours: every block meets it as
    a contiguous ``(out, in)`` matrix, as upstream's own param does, so the view bookkeeping
    (cutting blocks out, scaling each by its own shape, scattering back) is exact; only NorMuon's
    and NAMO's reductions over a block may round differently (:data:`REDUCTIONS`)."""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    _run(name, case, EXACT if name in ("muon", "adamuon") else REDUCTIONS, scale_mode=scale_mode, nesterov=nesterov)


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("name", ["muon", "normuon", "namo"])
@pytest.mark.parametrize("case", CASES)
def test_blocks_step_as_upstream_end_to_end(case: str, name: str, scale_mode: str) -> None:
    """With our (batched) Newton–Schulz: test_muon.py's END_TO_END (2e-6, measured worst 5e-7 over
    20 steps against upstream; these runs are 4 steps, so drift less). AdaMuon is left to the
    bitwise test, as in test_adaptive_muon.py: its first step sends every entry of O to ±4.47 by
    its sign, and entries of O within rounding of zero flip between two engines."""
    _run(name, case, END_TO_END, scale_mode=scale_mode)


# ---- bad views raise at construction --------------------------------------------------------

EXPERTS = LAYOUTS["experts_in_out"]
COUNT = r"^param group #0: `matrix_views`: must give one view \(or None\) per param; got "
FIT = r"^param group #0, param #0: `matrix_views`: does not view this param; got MatrixView\(split="
SHAPE = r"; expected a MatrixView of shape \(3, 7, 5\), or None$"


@pytest.mark.parametrize("optimizer", [Muon, AdaptiveMuon])
@pytest.mark.parametrize(
    ("views", "message"),
    [
        ([EXPERTS.view, None], COUNT + r"list of 2 for 1 params; expected a list parallel to `params`$"),
        ([], COUNT + r"list of 0 for 1 params; expected a list parallel to `params`$"),
        (EXPERTS.view, COUNT + r"MatrixView for 1 params; expected a list parallel to `params`$"),
        ([LAYOUTS["experts_out_in"].view], FIT + r"\(3, 5, 7\), origin=\(0, 1, 2\).*\)" + SHAPE),
        ([LAYOUTS["concatenated"].view], FIT + r"\(3, 5, 7\), origin=\(0, 0, 1\).*\)" + SHAPE),
    ],
    ids=["too_many", "empty", "not_a_list", "other_shape", "other_ndim"],
)
def test_a_bad_matrix_views_entry_raises_at_construction(optimizer: Factory, views: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        optimizer([{"params": _params([EXPERTS]), "matrix_views": views}])


# ---- state dict -----------------------------------------------------------------------------


def test_state_dict_round_trip_resumes_bitwise_and_keeps_the_groups_own_views() -> None:
    layouts = list(LAYOUTS.values())
    views = [layout.view for layout in layouts]
    params = _params(layouts)
    opt = Muon([{"params": params, "matrix_views": views}], **SETTINGS, nesterov=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["matrix_views"] = [None] * len(views)  # a checkpoint's views must not win
    resumed_params = [nn.Parameter(p.detach().clone()) for p in params]
    own = list(views)
    resumed = Muon([{"params": resumed_params, "matrix_views": own}], lr=1.0)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["matrix_views"] is own and resumed.param_groups[0]["nesterov"] is True
    for _ in range(3):  # the rest of the stream: the uninterrupted run and the resumed one
        for p, q in zip(params, resumed_params):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        opt.step()
        resumed.step()
    for p, q in zip(params, resumed_params):
        torch.testing.assert_close(q, p, atol=0, rtol=0)
        torch.testing.assert_close(resumed.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"], atol=0, rtol=0)


# ---- end to end: get_optimizer reads the view from the forward -------------------------------

E, FFN, HIDDEN, VOCAB = 3, 5, 7, 11


class ConcatenatedMoE(nn.Module):
    """Embeddings, a router, experts concatenated in one 2-D ``w1`` (DBRX-style), a norm, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.router = nn.Linear(HIDDEN, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E * FFN, HIDDEN) / HIDDEN**0.5)
        self.w2 = nn.Parameter(torch.randn(E, HIDDEN, FFN) / FFN**0.5)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        gates = self.router(x).softmax(-1)
        experts = torch.zeros_like(x)
        for e in range(E):
            hidden = F.silu(F.linear(x, self.w1.view(E, FFN, HIDDEN)[e]))
            experts = experts + gates[..., e : e + 1] * F.linear(hidden, self.w2[e])
        return self.head(self.norm(x + experts))


@pytest.mark.parametrize("engine", ["upstream", "ours"])
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
def test_get_optimizer_steps_concatenated_experts_as_separate_matrices(
    scale_mode: str, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """optzoo reads the view from one traced forward; w1 then steps as its E experts would alone."""
    if engine == "upstream":
        monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    torch.manual_seed(0)
    model = ConcatenatedMoE()
    config = OptimizerConfig(
        optimizer="muon", lr=0.02, weight_decay=0.1, muon_fp32_matmul_prec="highest", muon_scale_mode=scale_mode, clip_grad=0.0
    )
    optimizer = get_optimizer(config, model)
    group = next(g for g in optimizer.param_groups if any(p is model.w1 for p in g["params"]))
    view = group["matrix_views"][[p is model.w1 for p in group["params"]].index(True)]
    assert view == LAYOUTS["concatenated"].view  # E x FFN blocks of dim 0, each FFN out x HIDDEN in
    assert group["weight_decay"] == 0.1 and group["lr"] == 0.02
    experts = [nn.Parameter(model.w1.detach()[FFN * e : FFN * (e + 1)].clone()) for e in range(E)]
    reference = _emerging.muon(
        experts, lr=0.02, momentum=config.muon_momentum, weight_decay=0.1, weight_decay_method="decoupled",
        fp32_matmul_prec="highest", scale_mode=scale_mode,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        for e, expert in enumerate(experts):
            expert.grad = model.w1.grad[FFN * e : FFN * (e + 1)].clone()  # type: ignore[index]
        assert optimizer.step()[0]
        reference.step()
    # the same Newton–Schulz: the wrapper and the view bookkeeping are exact; ours (the 3 experts
    # in one batch) against upstream's: test_muon.py's END_TO_END
    tolerance = EXACT if engine == "upstream" else END_TO_END
    torch.testing.assert_close(model.w1.detach(), torch.cat([expert.detach() for expert in experts]), **tolerance)
