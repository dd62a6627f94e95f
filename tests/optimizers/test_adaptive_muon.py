"""AdaptiveMuon equals emerging-optimizers' AdaptiveMuon for every second-moment method.

As for Muon (test_muon.py): bitwise given upstream's Newton–Schulz, and to float32 rounding
end to end with ours, except AdaMuon end to end, which is exact given the same Newton–Schulz
only. Its first step divides O by √(0.05·O²), i.e. sends every entry to ±4.47 by its sign; an
entry of O within rounding of zero (~1 in 10⁴ here) flips with any change of rounding, so no
elementwise tolerance below the update's own size holds between two Newton–Schulz engines.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import optzoo.optimizers.muon as muon_module
from optzoo.optimizers import _emerging
from optzoo.optimizers.adaptive_muon import AdaptiveMuon, Moment2Method, normuon_
from optzoo.optimizers.muon import muon_scale_factor
from optzoo.optimizers.newton_schulz import newton_schulz
from tests.optimizers.reference.muon import copies, drive, matrices, upstream_newton_schulz
from tests.optimizers.test_muon import END_TO_END, EXTRA, SETTINGS, SHAPES, WIDE_SHAPES

METHODS: tuple[Moment2Method, ...] = ("adamuon", "normuon", "namo")


pytestmark = pytest.mark.usefixtures("highest_precision")  # tests/conftest.py


def _upstream_pair(shapes: list[tuple[int, int]], **settings: Any) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    ours_params = matrices(shapes)
    reference_params = copies(ours_params)
    ours = AdaptiveMuon(ours_params, **SETTINGS, **settings)
    reference = _emerging.adaptive_muon(reference_params, **SETTINGS, **settings)
    drive([(ours, ours_params), (reference, reference_params)], steps=20)
    for p, q in zip(ours_params, reference_params):
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], atol=0, rtol=0)
        assert ours.state[p]["exp_avg_sq"].shape == reference.state[q]["moment2_buffer"].shape
    return ours_params, reference_params


@pytest.mark.parametrize("scale_mode", ["spectral", "unit_rms_norm"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_equals_upstream_bitwise_given_its_newton_schulz(
    method: str, nesterov: bool, scale_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    settings = {"moment2_method": method, "nesterov": nesterov, "scale_mode": scale_mode, "extra_scale_factor": EXTRA}
    ours_params, reference_params = _upstream_pair(WIDE_SHAPES, **settings, beta2=0.9, eps=1e-7)
    for p, q in zip(ours_params, reference_params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


@pytest.mark.parametrize("scale_mode", ["spectral", "unit_rms_norm", "shape_scaling"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("method", ["normuon", "namo"])
def test_equals_upstream_end_to_end(method: str, nesterov: bool, scale_mode: str) -> None:
    """Same tolerance as Muon's (measured worst 3.5e-7 over 5 seeds): NorMuon rescales to the
    orthogonalised update's norm and NAMO multiplies by one scalar, neither amplifies rounding."""
    settings = {"moment2_method": method, "nesterov": nesterov, "scale_mode": scale_mode, "extra_scale_factor": EXTRA}
    for p, q in zip(*_upstream_pair(SHAPES, **settings)):
        torch.testing.assert_close(p, q, **END_TO_END)


@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_per_tensor_bitwise_given_per_matrix_newton_schulz(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Newton–Schulz that handles each matrix alone, batching cannot change the rounding,
    so the batched bookkeeping (stacking, transposing, scattering back) must be exact.
    (test_muon.py compares the two paths with the real, batched engine.)"""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    batched_params = matrices([*SHAPES, (32, 128)])
    batched_params[2].qkv_split_shapes = [8, 4, 4]  # type: ignore[attr-defined]  # 64 rows: 4 query groups
    plain_params = copies(batched_params)
    batched = AdaptiveMuon(batched_params, **SETTINGS, moment2_method=method, nesterov=True, batched=True)
    plain = AdaptiveMuon(plain_params, **SETTINGS, moment2_method=method, nesterov=True, batched=False)
    drive([(batched, batched_params), (plain, plain_params)], steps=20)
    for p, q in zip(batched_params, plain_params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("method", "shape", "expected"),
    [
        ("adamuon", (5, 7), (5, 7)),
        ("normuon", (5, 7), (1, 7)),  # wide: one entry per column
        ("normuon", (7, 5), (7, 1)),  # tall: one per row
        ("normuon", (6, 6), (6, 1)),
        ("namo", (5, 7), (1,)),
    ],
)
def test_second_moment_shape_and_name(method: str, shape: tuple[int, int], expected: tuple[int, ...]) -> None:
    params = matrices([shape], dtype=torch.bfloat16)
    opt = AdaptiveMuon(params, moment2_method=method)
    drive([(opt, params)], steps=1)
    state = opt.state[params[0]]
    assert set(state) == {"momentum_buffer", "exp_avg_sq"}
    assert tuple(state["exp_avg_sq"].shape) == expected and state["exp_avg_sq"].dtype == torch.float32


def test_each_group_uses_its_own_method() -> None:
    params = matrices([(8, 16), (8, 16)])
    alone_params = copies(params)
    mixed = AdaptiveMuon([{"params": [params[0]], "moment2_method": "namo"}, {"params": [params[1]]}], **SETTINGS, moment2_method="normuon")
    alone = [AdaptiveMuon([p], **SETTINGS, moment2_method=m) for p, m in zip(alone_params, ("namo", "normuon"))]
    generator = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p, q in zip(params, alone_params):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        mixed.step()
        for opt in alone:
            opt.step()
    # the two 8×16 matrices share a batch in `mixed` (bmm over 2 against bmm over 1)
    for p, q in zip(params, alone_params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    assert mixed.state[params[0]]["exp_avg_sq"].shape == (1,) and mixed.state[params[1]]["exp_avg_sq"].shape == (1, 16)


def test_qkv_split_orthogonalises_blocks_then_adapts_the_whole_param() -> None:
    split, query_groups, cols, lr = [4, 2, 2], 2, 24, 1.0
    (param,) = matrices([(query_groups * sum(split), cols)])
    param.qkv_split_shapes = split  # type: ignore[attr-defined]
    opt = AdaptiveMuon([param], lr=lr, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest", moment2_method="normuon")
    grad = torch.randn(param.shape)
    before = param.detach().clone()
    param.grad = grad
    opt.step()

    orthogonal = torch.empty_like(grad)
    for offset, size in ((0, 4), (4, 2), (6, 2)):
        rows = [g * sum(split) + offset + r for g in range(query_groups) for r in range(size)]
        orthogonal[rows] = newton_schulz(grad[rows], steps=5, coefficient_type="quintic")  # unscaled
    expected = normuon_(orthogonal, torch.zeros(1, cols), beta2=0.95, eps=1e-8) * muon_scale_factor(*grad.shape, "spectral")
    torch.testing.assert_close(before - param.detach(), expected * lr, atol=1e-6, rtol=1e-6)


def test_state_dict_round_trip_resumes_bitwise() -> None:
    params = matrices(SHAPES, dtype=torch.bfloat16)
    opt = AdaptiveMuon(params, **SETTINGS, moment2_method="normuon", beta2=0.9)
    drive([(opt, params)], steps=3)
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = copies(params)
    resumed = AdaptiveMuon(resumed_params)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["moment2_method"] == "normuon" and resumed.param_groups[0]["beta2"] == 0.9
    drive([(opt, params), (resumed, resumed_params)], steps=3, seed=7)
    for p, q in zip(params, resumed_params):
        assert resumed.state[q]["exp_avg_sq"].dtype == torch.float32
        torch.testing.assert_close(p, q, atol=0, rtol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], resumed.state[q]["exp_avg_sq"], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"moment2_method": "adam"}, ValueError, r"`moment2_method`: unknown value; got 'adam'; expected one of \['adamuon', 'normuon', 'namo'\]"),
        ({"beta2": 1.0}, ValueError, r"`beta2`: must lie in \[0, 1\); got 1.0; expected 0 <= beta2 < 1"),
        ({"eps": -1e-8}, ValueError, r"`eps`: must be non-negative; got -1e-08; expected eps >= 0"),
        ({"scale_mode": "rms"}, ValueError, r"`scale_mode`: unknown value; got 'rms'"),
    ],
)
def test_bad_settings_raise(settings: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=r"^param group #0: " + message):
        AdaptiveMuon(matrices([(4, 6)]), **settings)


def test_a_non_matrix_raises_naming_the_class() -> None:
    with pytest.raises(ValueError, match=r"^param group #0, param #0: AdaptiveMuon takes matrices, stacks of matrices \(flatten=False\) or N-D weights flattened to matrices \(flatten=True\); route it to the scalar optimizer"):
        AdaptiveMuon([torch.nn.Parameter(torch.zeros(3))])
