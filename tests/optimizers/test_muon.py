"""Muon equals emerging-optimizers' Muon; batching, the QKV split, settings and state behave.

Parity comes in two strengths. Given upstream's own Newton–Schulz (swapped in for ours), our
optimizer shell is *bitwise* upstream's. With our engine, params agree to float32 rounding
(:data:`END_TO_END`); the engine itself is tested against upstream and an SVD reference in
test_newton_schulz.py.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any, get_args

import pytest
import torch

import optzoo.optimizers.muon as muon_module
from optzoo.optimizers import _emerging
from optzoo.optimizers.muon import Muon, ScaleMode, momentum_direction_, muon_scale_factor, qkv_blocks
from optzoo.optimizers.newton_schulz import newton_schulz
from tests.optimizers.reference.muon import copies, drive, matrices, upstream_newton_schulz

SHAPES = [(5, 7), (33, 65), (64, 64), (64, 64), (128, 32), (65, 33)]
"""Odd shapes; the two 64×64, and 33×65 with 65×33 (batched transposed), share batches."""
WIDE_SHAPES = [(5, 7), (33, 65), (64, 64), (64, 64), (32, 128)]
"""For bitwise tests: upstream transposes tall matrices inside Newton–Schulz, we before stacking,
and a BLAS product of a transposed view rounds differently from the same product on a copy."""
SETTINGS: dict[str, Any] = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "fp32_matmul_prec": "highest"}
# 0.5: a power of two, so our one product by s·e rounds exactly as upstream's (O·s)·e.
EXTRA = 0.5
# Ours against upstream after 20 steps, our Newton–Schulz in both paths' places. Our engine's
# output differs from upstream's by ~1e-6 relative (its max-abs prescale and bmm association
# round differently; test_newton_schulz.py), each step moves a param by lr·s·e·O (~0.01 here),
# so 20 steps drift by ~1e-7 on params of size ~1-4. Measured worst over 5 seeds, every setting
# below: 5e-7 (atol=rtol=t convention). 2e-6 leaves a 4x margin.
END_TO_END = {"atol": 2e-6, "rtol": 2e-6}
# Batched against per-tensor: the same Newton–Schulz, but a bmm over 3 matrices rounds
# differently from 3 bmm over one (MKL blocks them differently). Measured worst 3e-7.
BATCHED = {"atol": 1e-6, "rtol": 1e-6}


pytestmark = pytest.mark.usefixtures("highest_precision")  # tests/conftest.py


def _upstream_pair(shapes: list[tuple[int, int]], **settings: Any) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    ours_params = matrices(shapes)
    reference_params = copies(ours_params)
    ours = Muon(ours_params, **SETTINGS, **settings)
    reference = _emerging.muon(reference_params, **SETTINGS, **settings)
    drive([(ours, ours_params), (reference, reference_params)], steps=20)
    for p, q in zip(ours_params, reference_params):
        # gradients do not depend on the params: the momentum is the same computation, bit for bit
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], atol=0, rtol=0)
    return ours_params, reference_params


# ---- parity with upstream -------------------------------------------------------------------


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("scale_mode", get_args(ScaleMode))
@pytest.mark.parametrize("coefficient_type", ["quintic", "polar_express", "cans"])
def test_equals_upstream_bitwise_given_its_newton_schulz(
    coefficient_type: str, scale_mode: str, nesterov: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    settings = {"coefficient_type": coefficient_type, "scale_mode": scale_mode, "nesterov": nesterov, "extra_scale_factor": EXTRA}
    for p, q in zip(*_upstream_pair(WIDE_SHAPES, **settings)):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("scale_mode", get_args(ScaleMode))
@pytest.mark.parametrize("coefficient_type", ["quintic", "polar_express"])
def test_equals_upstream_end_to_end(coefficient_type: str, scale_mode: str, nesterov: bool) -> None:
    settings = {"coefficient_type": coefficient_type, "scale_mode": scale_mode, "nesterov": nesterov, "extra_scale_factor": EXTRA}
    for p, q in zip(*_upstream_pair(SHAPES, **settings)):
        torch.testing.assert_close(p, q, **END_TO_END)


@pytest.mark.parametrize("mode", get_args(ScaleMode))
def test_scale_factor_equals_upstream(mode: ScaleMode) -> None:
    for rows, cols in [(5, 7), (7, 5), (64, 64), (1024, 4096), (4096, 1024)]:
        assert muon_scale_factor(rows, cols, mode) == _emerging.muon_scale_factor(rows, cols, mode)


def test_momentum_direction_is_the_lerp_form() -> None:
    grad, buffer = torch.randn(4, 6), torch.randn(4, 6)
    expected_buffer = 0.9 * buffer + 0.1 * grad
    nesterov = momentum_direction_(buffer.clone(), grad, momentum=0.9, nesterov=True)
    plain_buffer = buffer.clone()
    assert momentum_direction_(plain_buffer, grad, momentum=0.9, nesterov=False) is plain_buffer
    torch.testing.assert_close(plain_buffer, expected_buffer)
    torch.testing.assert_close(nesterov, 0.9 * expected_buffer + 0.1 * grad)


# ---- batching -------------------------------------------------------------------------------


def _spy_batches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the shape of every batch handed to Newton–Schulz."""
    shapes: list[tuple[int, ...]] = []

    def spy(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        shapes.append(tuple(x.shape))
        return newton_schulz(x, **kwargs)

    monkeypatch.setattr(muon_module, "newton_schulz", spy)
    return shapes


def test_same_shape_matrices_share_one_call_transposed_ones_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """(65, 33) is not stacked with (33, 65): that would cost a transposed copy each way."""
    calls = _spy_batches(monkeypatch)
    params = matrices(SHAPES)
    drive([(Muon(params, **SETTINGS), params)], steps=1)
    assert sorted(calls) == [(1, 5, 7), (1, 33, 65), (1, 65, 33), (1, 128, 32), (2, 64, 64)]


def test_batched_false_is_the_per_tensor_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_batches(monkeypatch)
    params = matrices(SHAPES)
    drive([(Muon(params, **SETTINGS, batched=False), params)], steps=1)
    assert calls == [(1, 5, 7), (1, 33, 65), (1, 64, 64), (1, 64, 64), (1, 128, 32), (1, 65, 33)]


@pytest.mark.parametrize("nesterov", [False, True])
def test_batched_equals_per_tensor(nesterov: bool) -> None:
    shapes = [*SHAPES, (64, 64)]
    batched_params = matrices(shapes)
    plain_params = copies(batched_params)
    batched = Muon(batched_params, **SETTINGS, nesterov=nesterov)
    plain = Muon(plain_params, **SETTINGS, nesterov=nesterov, batched=False)
    drive([(batched, batched_params), (plain, plain_params)], steps=20)
    for p, q in zip(batched_params, plain_params):
        torch.testing.assert_close(p, q, **BATCHED)


def test_batched_equals_per_tensor_bitwise_given_per_matrix_newton_schulz(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Newton–Schulz that handles each matrix alone, batching cannot change the rounding,
    so the batched bookkeeping (stacking, transposing, per-matrix scales, QKV blocks) is exact."""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    batched_params = matrices([*SHAPES, (32, 128)])
    batched_params[2].qkv_split_shapes = [8, 4, 4]  # type: ignore[attr-defined]  # 64 rows: 4 query groups
    plain_params = copies(batched_params)
    batched = Muon(
        [{"params": batched_params[:3], "scale_mode": "unit_rms_norm"}, {"params": batched_params[3:]}], **SETTINGS
    )
    plain = Muon(
        [{"params": plain_params[:3], "scale_mode": "unit_rms_norm"}, {"params": plain_params[3:]}], **SETTINGS, batched=False
    )
    drive([(batched, batched_params), (plain, plain_params)], steps=20)
    for p, q in zip(batched_params, plain_params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_groups_with_different_newton_schulz_settings_are_not_batched_together(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_batches(monkeypatch)
    a, b = matrices([(64, 64), (64, 64)])
    opt = Muon([{"params": [a]}, {"params": [b], "num_ns_steps": 3}], **SETTINGS)
    drive([(opt, [a, b])], steps=1)
    assert calls == [(1, 64, 64), (1, 64, 64)]


# ---- settings live in param groups ----------------------------------------------------------


def test_each_group_follows_its_own_settings() -> None:
    """Upstream applies the constructor's settings to every group; we read each group's."""
    group_settings: list[dict[str, Any]] = [
        {"coefficient_type": "polar_express", "scale_mode": "unit_rms_norm", "nesterov": True},
        {"coefficient_type": "quintic", "scale_mode": "shape_scaling", "num_ns_steps": 4, "momentum": 0.8},
    ]
    mixed_params = matrices(SHAPES)
    alone_params = copies(mixed_params)
    halves = [slice(0, 3), slice(3, None)]
    mixed = Muon([{"params": mixed_params[h], **s} for h, s in zip(halves, group_settings)], **SETTINGS)
    alone = [Muon(alone_params[h], **{**SETTINGS, **s}) for h, s in zip(halves, group_settings)]
    # the groups' Newton–Schulz settings differ, so they never share a batch: bitwise
    drive([(mixed, mixed_params), (_Both(alone), alone_params)], steps=5)
    for p, q in zip(mixed_params, alone_params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


class _Both:
    """Steps several optimizers as one (for :func:`drive`)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def test_settings_are_in_the_state_dict_and_changing_a_group_takes_effect() -> None:
    params = matrices([(8, 16)])
    opt = Muon(params, nesterov=False, coefficient_type="cans")
    group = opt.state_dict()["param_groups"][0]
    assert group["coefficient_type"] == "cans" and group["nesterov"] is False and group["fp32_matmul_prec"] == "medium"
    assert set(group) >= {"lr", "momentum", "weight_decay", "num_ns_steps", "scale_mode", "extra_scale_factor", "split_qkv", "batched"}
    twin_params = copies(params)
    twin_opt = Muon(twin_params, nesterov=False, coefficient_type="cans")
    twin_opt.param_groups[0]["nesterov"] = True
    drive([(opt, params), (twin_opt, twin_params)], steps=2)
    assert not torch.equal(params[0], twin_params[0])


# ---- QKV split ------------------------------------------------------------------------------


def _qkv_param(split: list[int], query_groups: int, cols: int) -> torch.nn.Parameter:
    (param,) = matrices([(query_groups * sum(split), cols)])
    param.qkv_split_shapes = split  # type: ignore[attr-defined]
    return param


def _one_step_update(opt: torch.optim.Optimizer, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    before = param.detach().clone()
    param.grad = grad
    opt.step()
    return before - param.detach()


@pytest.mark.parametrize(("split", "query_groups"), [([4, 2, 2], 3), ([4, 4, 2, 2], 2), ([6, 6, 6], 1)])
def test_qkv_split_orthogonalises_each_block_by_hand(split: list[int], query_groups: int) -> None:
    """Megatron's split: block k gathers rows [offset_k, offset_k + split_k) of every query group."""
    cols, lr = 24, 1.0
    param = _qkv_param(split, query_groups, cols)
    opt = Muon([param], lr=lr, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest")
    grad = torch.randn(param.shape)
    update = _one_step_update(opt, param, grad)

    expected = torch.empty_like(grad)
    group_rows, offset = sum(split), 0
    for size in split:
        rows = [g * group_rows + offset + r for g in range(query_groups) for r in range(size)]
        block = grad[rows]
        expected[rows] = newton_schulz(block, steps=5, coefficient_type="quintic") * muon_scale_factor(*block.shape, "spectral")
        offset += size
    # the optimizer runs each block inside a batch (K with V): bmm rounding only
    torch.testing.assert_close(update, expected * lr, atol=1e-6, rtol=1e-6)


def test_qkv_blocks_batch_together_and_with_same_shape_params(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_batches(monkeypatch)
    qkv = _qkv_param([4, 2, 2], 4, 16)  # Q: 16×16, K and V: 8×16
    other = matrices([(16, 16)])[0]
    drive([(Muon([qkv, other], **SETTINGS), [qkv, other])], steps=1)
    assert sorted(calls) == [(2, 8, 16), (2, 16, 16)]


def test_split_qkv_false_orthogonalises_the_whole_matrix() -> None:
    qkv = _qkv_param([4, 2, 2], 2, 24)
    plain = copies([qkv])[0]
    del plain.qkv_split_shapes  # type: ignore[attr-defined]
    grad = torch.randn(qkv.shape)
    split_off = _one_step_update(Muon([qkv], **SETTINGS, split_qkv=False), qkv, grad.clone())
    whole = _one_step_update(Muon([plain], **SETTINGS), plain, grad.clone())
    torch.testing.assert_close(split_off, whole, atol=0, rtol=0)


def test_a_split_that_does_not_divide_warns_once_and_uses_the_whole_matrix() -> None:
    (qkv,) = matrices([(10, 24)])
    qkv.qkv_split_shapes = [4, 2, 2]  # type: ignore[attr-defined]
    plain = copies([qkv])[0]
    del plain.qkv_split_shapes  # type: ignore[attr-defined]
    message = re.escape("`qkv_split_shapes` [4, 2, 2] (sum 8) do not divide the rows of shape (10, 24); orthogonalising the whole matrix")
    with pytest.warns(UserWarning, match=message):
        opt = Muon([qkv], **SETTINGS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drive([(opt, [qkv]), (Muon([plain], **SETTINGS), [plain])], steps=3)
    torch.testing.assert_close(qkv, plain, atol=0, rtol=0)


# ---- state dict and resume ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_bitwise(dtype: torch.dtype) -> None:
    params = matrices(SHAPES, dtype=dtype)
    params[0].qkv_split_shapes = [1, 2, 2]  # type: ignore[attr-defined]  # 5 rows: one group
    opt = Muon(params, **SETTINGS, nesterov=True)
    drive([(opt, params)], steps=3)
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = copies(params)
    resumed = Muon(resumed_params, lr=1.0)  # every setting comes from the state dict
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["nesterov"] is True and resumed.param_groups[0]["lr"] == SETTINGS["lr"]
    for p in resumed_params:
        assert resumed.state[p]["momentum_buffer"].dtype == torch.float32  # not cast to the param's bf16
    drive([(opt, params), (resumed, resumed_params)], steps=3, seed=7)
    for p, q in zip(params, resumed_params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], resumed.state[q]["momentum_buffer"], atol=0, rtol=0)


# ---- dtypes, tiny gradients, closure ---------------------------------------------------------


def test_bf16_params_compute_in_float32() -> None:
    """One bf16 step equals the float32 step from the same values, rounded once to bf16."""
    bf16 = matrices(SHAPES, dtype=torch.bfloat16)
    fp32 = copies(bf16, dtype=torch.float32)
    settings = {**SETTINGS, "weight_decay": 0.0}  # decay would round to bf16 in between
    ours, reference = Muon(bf16, **settings), Muon(fp32, **settings)
    for p, q in zip(bf16, fp32):
        p.grad = torch.randn(p.shape).to(torch.bfloat16)
        q.grad = p.grad.float()
    ours.step()
    reference.step()
    for p, q in zip(bf16, fp32):
        assert p.dtype == torch.bfloat16 and ours.state[p]["momentum_buffer"].dtype == torch.float32
        torch.testing.assert_close(p, q.to(torch.bfloat16), atol=0, rtol=0)


def test_float64_params_compute_in_float64() -> None:
    params = matrices([(5, 7)], dtype=torch.float64)
    opt = Muon(params, **SETTINGS)
    drive([(opt, params)], steps=2)
    assert params[0].dtype == torch.float64 and opt.state[params[0]]["momentum_buffer"].dtype == torch.float64


def test_a_tiny_gradient_still_gives_an_orthogonal_update() -> None:
    """Newton–Schulz is scale-free: a 1e-20 gradient gives the update of a unit one (upstream's
    eps-floored normalisation would return almost zero)."""
    grad = torch.randn(33, 65)
    updates = []
    for scale in (1.0, 1e-20):
        param = torch.nn.Parameter(torch.zeros(33, 65))  # so that the update is read back exactly
        updates.append(_one_step_update(Muon([param], **SETTINGS), param, grad * scale))
    # 1e-20 · g rounds each entry (2**-24 relative); Newton–Schulz amplifies that by at most its
    # slope at 0 (~1e2 for quintic). Updates reach 0.08; measured worst difference 8e-8.
    torch.testing.assert_close(updates[1], updates[0], atol=2e-7, rtol=1e-5)
    orthogonal = updates[1] / (SETTINGS["lr"] * muon_scale_factor(33, 65, "spectral"))
    singular_values = torch.linalg.svdvals(orthogonal)
    # quintic's 5 steps leave singular values in about [0.7, 1.2] (Jordan's "noisy values around 1")
    assert ((singular_values > 0.6) & (singular_values < 1.3)).all()


def test_params_without_grad_are_skipped_and_closure_returns_the_loss() -> None:
    used, unused = matrices([(4, 6), (4, 6)])
    opt = Muon([used, unused], **SETTINGS)
    before = unused.detach().clone()
    def closure() -> float:
        loss = used.square().sum()
        loss.backward()
        return loss.item()

    loss = opt.step(closure)
    assert isinstance(loss, float) and used.grad is not None
    assert torch.equal(unused, before) and unused not in opt.state


def test_qkv_blocks_are_views_of_each_row_group() -> None:
    matrix = torch.arange(2 * 8 * 3).reshape(16, 3)
    q, k, v = qkv_blocks(matrix, [4, 2, 2])
    assert torch.equal(k.reshape(-1, 3), matrix[[4, 5, 12, 13]]) and torch.equal(v.reshape(-1, 3), matrix[[6, 7, 14, 15]])
    assert q.data_ptr() == matrix.data_ptr()  # views, not copies


# ---- bad arguments --------------------------------------------------------------------------

BAD_SETTINGS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"lr": -1.0}, ValueError, r"`lr`: must be non-negative; got -1.0; expected lr >= 0"),
    ({"weight_decay": -0.1}, ValueError, r"`weight_decay`: must be non-negative; got -0.1"),
    ({"momentum": 1.0}, ValueError, r"`momentum`: must lie in \[0, 1\); got 1.0"),
    ({"extra_scale_factor": 0.0}, ValueError, r"`extra_scale_factor`: must be positive and finite; got 0.0"),
    ({"num_ns_steps": 0}, ValueError, r"`num_ns_steps`: must be a positive integer; got 0; expected an int >= 1"),
    ({"num_ns_steps": 2.5}, ValueError, r"`num_ns_steps`: must be a positive integer; got 2.5"),
    ({"coefficient_type": "custom"}, ValueError, r"`coefficient_type`: Unsupported muon coefficient type 'custom'; got 'custom'; expected one of \['simple', 'quintic'"),
    ({"fp32_matmul_prec": "low"}, ValueError, r"`fp32_matmul_prec`: unknown value; got 'low'; expected one of \['highest', 'high', 'medium'\]"),
    ({"scale_mode": "rms"}, ValueError, r"`scale_mode`: unknown value; got 'rms'; expected one of \['spectral', 'unit_rms_norm', 'shape_scaling', 'original', 'match_rms_adamw', 'spectral_unclamped'\]"),
    ({"nesterov": "yes"}, TypeError, r"`nesterov`: must be a bool; got 'yes'; expected True or False"),
    ({"split_qkv": 1}, TypeError, r"`split_qkv`: must be a bool; got 1"),
    ({"batched": None}, TypeError, r"`batched`: must be a bool; got None"),
]


@pytest.mark.parametrize(("settings", "error", "message"), BAD_SETTINGS, ids=lambda x: str(x)[:30])
def test_bad_settings_raise(settings: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=r"^param group #0: " + message):
        Muon(matrices([(4, 6)]), **settings)


def test_a_bad_group_added_later_raises_and_leaves_the_optimizer_unchanged() -> None:
    opt = Muon(matrices([(4, 6)]))
    with pytest.raises(ValueError, match=r"^param group #1: `lr`: must be non-negative"):
        opt.add_param_group({"params": matrices([(4, 6)]), "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_a_non_matrix_raises_naming_it_and_the_fix() -> None:
    params = [*matrices([(4, 6)]), torch.nn.Parameter(torch.zeros(5))]
    with pytest.raises(ValueError, match=(
        r"^param group #0, param #1: Muon takes matrices, stacks of matrices \(flatten=False\) or N-D weights flattened "
        r"to matrices \(flatten=True\); route it to the scalar optimizer; got shape \(5,\); expected 2 or more dims$"
    )):  # fmt: skip
        Muon(params)
    named = {"params": params, "param_names": ["layers.0.mlp.weight", "layers.0.norm.weight"]}
    with pytest.raises(ValueError, match=r"param #1 \(`layers.0.norm.weight`\): Muon takes matrices"):
        Muon([named])


@pytest.mark.parametrize(
    ("param", "error", "message"),
    [
        (torch.zeros(4, 6, dtype=torch.int64), TypeError, r"dtype not supported; got torch.int64; expected one of"),
        (torch.zeros(()), ValueError, r"takes matrices, .*; route it to the scalar optimizer; got shape \(\); expected 2 or more dims"),
    ],
)
def test_bad_params_raise(param: torch.Tensor, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Muon([param])


@pytest.mark.parametrize(
    ("split", "error", "message"),
    [
        ("qkv", TypeError, r"`qkv_split_shapes`: must be a list of ints; got 'qkv'; expected e.g. \[q, kv, kv\]"),
        ([4, 2.0, 2], TypeError, r"`qkv_split_shapes`: must be a list of ints; got \[4, 2.0, 2\]"),
        ([4, 0, 4], ValueError, r"`qkv_split_shapes`: must be positive; got \[4, 0, 4\]; expected every size >= 1"),
    ],
)
def test_bad_qkv_split_shapes_raise(split: object, error: type[Exception], message: str) -> None:
    (param,) = matrices([(16, 8)])
    param.qkv_split_shapes = split  # type: ignore[attr-defined]
    with pytest.raises(error, match=message):
        Muon([param])


def test_a_sparse_gradient_raises_during_step() -> None:
    (param,) = matrices([(4, 6)])
    opt = Muon([param])
    param.grad = torch.zeros(4, 6).to_sparse()
    with pytest.raises(ValueError, match=r"^param group #0, param #0: gradient is sparse, which Muon does not support; got torch.sparse_coo"):
        opt.step()
