"""Muon and AdaptiveMuon on N-D params: a stack steps as its matrices would as 2-D params, and a
flattened N-D param as its ``(shape[0], prod(shape[1:]))`` matrix would, bit for bit.

Why bitwise holds: an N-D param's matrices and their 2-D twins meet Newton–Schulz in the same
batches, in the same order (the twins are listed where the matrices are), so the same batched
matmuls; weight decay, momentum and AdaMuon's second moment are the same operations per element;
NorMuon's row (or column) means and the per-matrix Frobenius norms reduce the same elements in
the same order (``dim=(-2, -1)`` of a contiguous stack is each matrix's full reduction).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from typing import Any, get_args

import pytest
import torch

from optzoo.optimizers.adaptive_muon import AdaptiveMuon, Moment2Method
from optzoo.optimizers.muon import Muon, ScaleMode, as_matrices, matrix_shape, muon_scale_factor
from optzoo.optimizers.newton_schulz import CoefficientType, newton_schulz
from tests.optimizers.reference.muon import drive
from tests.optimizers.test_muon import SETTINGS, _spy_batches
pytestmark = pytest.mark.usefixtures("highest_precision")  # tests/conftest.py

STACKS = [(5, 7), (3, 5, 7), (2, 16, 40), (2, 9, 4)]
"""A 2-D 5×7 first, so the odd 3×5×7 stack shares its batch (4 matrices); a wide stack; a tall
one (transposed inside Newton–Schulz)."""
CONVS = [(6, 3, 3, 3), (40, 2, 2, 2), (8, 4, 5)]
"""Flattened: wide 6×27, tall 40×8, and a conv1d's 8×20."""
METHODS: tuple[Moment2Method, ...] = get_args(Moment2Method)
STEPS = 4

Factory = Callable[..., torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "muon": Muon,
    **{
        method: (lambda params, method=method, **kw: AdaptiveMuon(params, moment2_method=method, beta2=0.9, **kw))
        for method in METHODS
    },
}
"""Muon and each AdaptiveMuon method (``beta2=0.9``: the second moment changes fast, so a wrong
entry shows within the few steps run here)."""


def _params(shapes: Sequence[tuple[int, ...]], *, seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]


def _matrices(tensor: torch.Tensor, flatten: bool) -> list[torch.Tensor]:
    """The matrices Muon orthogonalises a param-shaped tensor as, in order (views)."""
    matrices = as_matrices(tensor.detach(), flatten=flatten)
    return list(matrices.reshape(-1, *matrices.shape[-2:]))


def _twins(params: Sequence[torch.Tensor], flatten: bool) -> list[torch.nn.Parameter]:
    """Each param's matrices as independent 2-D params, listed in the params' order; a 2-D
    param's twin keeps its attributes (``qkv_split_shapes``)."""
    twins = []
    for p in params:
        for m in _matrices(p, flatten):
            twins.append(torch.nn.Parameter(m.clone()))
            if p.ndim == 2:
                twins[-1].__dict__.update(p.__dict__)
    return twins


def _drive_twins(
    runs: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    params: Sequence[torch.Tensor],
    twins: Sequence[torch.Tensor],
    *,
    flatten: bool,
    steps: int = STEPS,
    seed: int = 1,
) -> None:
    """Step both optimizers; each twin's gradient is its matrix of its N-D param's gradient."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        pieces = [m for p in params for m in _matrices(p.grad, flatten)]  # type: ignore[arg-type]
        for twin, piece in zip(twins, pieces, strict=True):
            twin.grad = piece.clone()
        for optimizer in runs:
            optimizer.step()


def _assert_equal_to_twins(
    runs: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
    params: Sequence[torch.Tensor],
    twins: Sequence[torch.Tensor],
    *,
    flatten: bool,
) -> None:
    """Params, and every state tensor (read per matrix), equal their twins' bit for bit."""
    optimizer, twin_optimizer = runs
    remaining = iter(twins)
    for p in params:
        state = optimizer.state[p]
        for index, matrix in enumerate(_matrices(p, flatten)):
            twin = next(remaining)
            torch.testing.assert_close(matrix, twin.detach(), atol=0, rtol=0)
            twin_state = twin_optimizer.state[twin]
            assert set(state) == set(twin_state)
            for key, value in state.items():
                per_matrix = value.reshape(len(_matrices(p, flatten)), -1)[index]
                torch.testing.assert_close(per_matrix, twin_state[key].reshape(-1), atol=0, rtol=0, msg=key)


def _steps_as_twins(
    factory: Factory, params: Sequence[torch.nn.Parameter], *, flatten: bool = False, **settings: Any
) -> torch.optim.Optimizer:
    """Step ``params`` (with ``flatten``) and their 2-D twins, each with ``factory(..., **settings)``
    and the same gradients, and assert that they stay equal bit for bit; returns the N-D optimizer."""
    twins = _twins(params, flatten)
    runs = (factory(params, **settings, flatten=flatten), factory(twins, **settings))
    _drive_twins(runs, params, twins, flatten=flatten)
    _assert_equal_to_twins(runs, params, twins, flatten=flatten)
    return runs[0]


# ---- a stack steps as its matrices ------------------------------------------------------------


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("scale_mode", get_args(ScaleMode))
@pytest.mark.filterwarnings("ignore::optzoo.optimizers.newton_schulz.NewtonSchulzWarning")  # every set, aol too
@pytest.mark.parametrize("coefficient_type", get_args(CoefficientType))
def test_muon_stack_equals_its_matrices_as_2d_params(
    coefficient_type: CoefficientType, scale_mode: ScaleMode, nesterov: bool, batched: bool
) -> None:
    _steps_as_twins(
        Muon, _params(STACKS), **SETTINGS, coefficient_type=coefficient_type, scale_mode=scale_mode, nesterov=nesterov, batched=batched
    )


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("scale_mode", get_args(ScaleMode))
@pytest.mark.parametrize("method", METHODS)
def test_adaptive_muon_stack_equals_its_matrices_as_2d_params(
    method: Moment2Method, scale_mode: ScaleMode, nesterov: bool, batched: bool
) -> None:
    """Params, ``momentum_buffer`` and ``exp_avg_sq``: the stack's, read per matrix, are its twins'."""
    _steps_as_twins(OPTIMIZERS[method], _params(STACKS), **SETTINGS, scale_mode=scale_mode, nesterov=nesterov, batched=batched)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_4d_param_without_flatten_is_a_stack_over_its_first_two_dims(name: str) -> None:
    params = _params([(2, 3, 5, 7), (5, 7)])
    assert [tuple(t.shape) for t in _twins(params, flatten=False)] == [(5, 7)] * 7
    _steps_as_twins(OPTIMIZERS[name], params, **SETTINGS)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bf16_stack_equals_its_matrices(name: str) -> None:
    """16-bit stacks compute in float32 as 2-D params do (state in float32, one rounding per step)."""
    params = _params(STACKS, dtype=torch.bfloat16)
    opt = _steps_as_twins(OPTIMIZERS[name], params, **SETTINGS)
    assert all(value.dtype == torch.float32 for value in opt.state[params[1]].values())


def test_a_stack_update_is_each_matrix_orthogonalised_and_scaled_by_its_shape() -> None:
    """By hand, one step without momentum or decay: ``lr · s(r, c) · NS(G_i)`` for each matrix."""
    param = torch.nn.Parameter(torch.zeros(3, 9, 4))  # so that the update is read back exactly
    lr, grad = 0.5, torch.randn(3, 9, 4)
    param.grad = grad
    Muon([param], lr=lr, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest", scale_mode="unit_rms_norm").step()
    # the same batch of 3 as the optimizer's, so the same rounding
    expected = newton_schulz(grad, steps=5, coefficient_type="quintic") * muon_scale_factor(9, 4, "unit_rms_norm")
    torch.testing.assert_close(-param.detach(), expected * lr, atol=0, rtol=0)


# ---- flatten ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_flattened_conv_weight_equals_its_matrix_as_a_2d_param(name: str) -> None:
    params = _params(CONVS)
    assert [tuple(t.shape) for t in _twins(params, flatten=True)] == [(6, 27), (40, 8), (8, 20)]
    opt = _steps_as_twins(OPTIMIZERS[name], params, flatten=True, **SETTINGS)
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for p in params)


def test_a_flattened_update_is_the_matrix_orthogonalised_and_scaled_by_its_shape() -> None:
    param = torch.nn.Parameter(torch.zeros(6, 3, 3, 3))  # so that the update is read back exactly
    lr, grad = 0.5, torch.randn(6, 3, 3, 3)
    param.grad = grad
    Muon([param], lr=lr, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest", flatten=True).step()
    expected = newton_schulz(grad.reshape(1, 6, 27), steps=5, coefficient_type="quintic") * muon_scale_factor(6, 27, "spectral")
    torch.testing.assert_close(-param.detach(), expected.view(6, 3, 3, 3) * lr, atol=0, rtol=0)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_2d_params_ignore_flatten(name: str) -> None:
    """flatten=True against twins stepped with flatten=False, QKV split included."""
    params = _params([(5, 7), (33, 65), (9, 4)])
    params[1].qkv_split_shapes = [5, 3, 3]  # type: ignore[attr-defined]  # 33 rows: 3 query groups
    _steps_as_twins(OPTIMIZERS[name], params, flatten=True, **SETTINGS)


def test_matrix_shape() -> None:
    assert matrix_shape((5, 7), flatten=True) == (5, 7) and matrix_shape((5, 7), flatten=False) == (5, 7)
    assert matrix_shape((2, 3, 5, 7), flatten=False) == (2, 3, 5, 7)
    assert matrix_shape((8, 4, 3, 3), flatten=True) == (8, 36) and matrix_shape((8, 4, 5), flatten=True) == (8, 20)
    assert matrix_shape((4, 0, 3), flatten=True) == (4, 0)  # explicit sizes: a view with -1 fails on 0 elements


# ---- batching ----------------------------------------------------------------------------------


def test_stacks_join_the_batches_of_same_shape_matrices(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_batches(monkeypatch)
    (a, stack, b, tall_stack, conv) = _params([(5, 7), (3, 5, 7), (5, 7), (2, 7, 5), (4, 2, 3, 3)])
    groups: list[dict[str, Any]] = [{"params": [a, stack, b, tall_stack]}, {"params": [conv], "flatten": True}]
    opt = Muon(groups, **SETTINGS)
    for p in (a, stack, b, tall_stack, conv):
        p.grad = torch.randn(p.shape)
    opt.step()
    # two 5×7 params and the 3 matrices of the stack: one call of 5; 7×5 is not stacked with 5×7
    assert sorted(calls) == [(1, 4, 18), (2, 7, 5), (5, 5, 7)]


def test_batched_false_orthogonalises_each_matrix_of_a_stack_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_batches(monkeypatch)
    params = _params([(5, 7), (3, 5, 7)])
    opt = Muon(params, **SETTINGS, batched=False)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    assert calls == [(1, 5, 7)] * 4


# ---- state --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "shape", "flatten", "expected"),
    [
        ("adamuon", (3, 5, 7), False, (3, 5, 7)),
        ("normuon", (3, 9, 4), False, (3, 9, 1)),  # a stack of tall matrices: one entry per row of each
        ("normuon", (3, 5, 7), False, (3, 1, 7)),  # wide: per column of each
        ("normuon", (2, 3, 5, 7), False, (2, 3, 1, 7)),
        ("namo", (3, 5, 7), False, (3, 1, 1)),  # one scalar per matrix
        ("namo", (2, 3, 5, 7), False, (2, 3, 1, 1)),
        ("adamuon", (6, 3, 3, 3), True, (6, 3, 3, 3)),
        ("normuon", (6, 3, 3, 3), True, (1, 27)),  # the flattened 6×27 matrix's columns
        ("normuon", (40, 2, 2, 2), True, (40, 1)),
        ("namo", (6, 3, 3, 3), True, (1,)),  # one matrix: as a 2-D param's
    ],
)
def test_second_moment_follows_the_matrices(method: Moment2Method, shape: tuple[int, ...], flatten: bool, expected: tuple[int, ...]) -> None:
    params = _params([shape], dtype=torch.bfloat16)
    opt = AdaptiveMuon(params, moment2_method=method, flatten=flatten)
    params[0].grad = torch.randn(shape).to(torch.bfloat16)
    opt.step()
    state = opt.state[params[0]]
    assert tuple(state["exp_avg_sq"].shape) == expected and state["exp_avg_sq"].dtype == torch.float32
    assert state["momentum_buffer"].shape == shape


def _mixed_groups(params: Sequence[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """A stack and a 2-D param in one group; a conv weight, flattened, in another."""
    return [{"params": list(params[:2])}, {"params": [params[2]], "flatten": True}]


MIXED = [(3, 5, 7), (5, 7), (6, 3, 3, 3)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_round_trip_resumes_bitwise(name: str) -> None:
    params = _params(MIXED)
    opt = OPTIMIZERS[name](_mixed_groups(params), **SETTINGS, nesterov=True)
    drive([(opt, params)], steps=3)
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    # every setting comes from the state dict, `flatten` of the second group included
    resumed = OPTIMIZERS[name]([{"params": resumed_params[:2]}, {"params": resumed_params[2:]}], lr=1.0)
    resumed.load_state_dict(saved)
    assert [g["flatten"] for g in resumed.param_groups] == [False, True]
    drive([(opt, params), (resumed, resumed_params)], steps=3, seed=7)
    for p, q in zip(params, resumed_params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
        for key, value in opt.state[p].items():
            torch.testing.assert_close(value, resumed.state[q][key], atol=0, rtol=0)


def test_a_checkpoint_from_before_flatten_loads_with_the_default() -> None:
    """A saved group without ``flatten`` (older optzoo) gets the new optimizer's default, not a KeyError at step."""
    params = _params([(5, 7), (33, 65)])
    opt = Muon(params, **SETTINGS)
    drive([(opt, params)], steps=2)
    saved = copy.deepcopy(opt.state_dict())
    del saved["param_groups"][0]["flatten"]
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = Muon(resumed_params)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["flatten"] is False
    drive([(opt, params), (resumed, resumed_params)], steps=2, seed=7)
    for p, q in zip(params, resumed_params):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


# ---- bad arguments ------------------------------------------------------------------------------

NOT_A_MATRIX = (
    r"takes matrices, stacks of matrices \(flatten=False\) or N-D weights flattened to matrices \(flatten=True\); "
    r"route it to the scalar optimizer; got shape {}; expected 2 or more dims$"
)


@pytest.mark.parametrize(("shape", "shown"), [((5,), r"\(5,\)"), ((), r"\(\)")])
def test_a_vector_or_scalar_raises(shape: tuple[int, ...], shown: str) -> None:
    params = [*_params([(4, 6)]), torch.nn.Parameter(torch.zeros(shape))]
    with pytest.raises(ValueError, match=r"^param group #0, param #1: Muon " + NOT_A_MATRIX.format(shown)):
        Muon(params)
    with pytest.raises(ValueError, match=r"^param group #0, param #1: AdaptiveMuon " + NOT_A_MATRIX.format(shown)):
        AdaptiveMuon(params, flatten=True)


QKV_ON_A_STACK = (
    r"^param group #0, param #0 \(`layers.0.mlp.experts.gate_up_proj`\): `qkv_split_shapes`: only a 2-D fused QKV "
    r"matrix can be split; got \[4, 2, 2\] on shape \(2, 16, 8\); expected a 2-D param, or no qkv_split_shapes$"
)


@pytest.mark.parametrize("split_qkv", [True, False])
def test_qkv_split_shapes_on_a_stack_raises_naming_it(split_qkv: bool) -> None:
    (stack,) = _params([(2, 16, 8)])
    stack.qkv_split_shapes = [4, 2, 2]  # type: ignore[attr-defined]
    group = {"params": [stack], "param_names": ["layers.0.mlp.experts.gate_up_proj"]}
    with pytest.raises(ValueError, match=QKV_ON_A_STACK):
        Muon([group], split_qkv=split_qkv)


def test_qkv_split_shapes_set_on_a_stack_after_construction_raises_at_step_before_any_change() -> None:
    (matrix, stack) = _params([(4, 6), (2, 16, 8)])
    opt = Muon([{"params": [stack, matrix], "param_names": ["layers.0.mlp.experts.gate_up_proj", "w"]}])
    stack.qkv_split_shapes = [4, 2, 2]  # type: ignore[attr-defined]
    before = [p.detach().clone() for p in (stack, matrix)]
    stack.grad, matrix.grad = torch.randn(2, 16, 8), torch.randn(4, 6)
    with pytest.raises(ValueError, match=QKV_ON_A_STACK):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip((stack, matrix), before)) and not opt.state


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_non_bool_flatten_raises(value: object) -> None:
    message = rf"^param group #0: `flatten`: must be a bool; got {re.escape(repr(value))}; expected True or False$"
    with pytest.raises(TypeError, match=message):
        Muon(_params([(4, 6)]), flatten=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        AdaptiveMuon([{"params": _params([(4, 6)]), "flatten": value}])


# ---- FSDP2 --------------------------------------------------------------------------------------

FSDP_SHAPES = [(3, 5, 7), (2, 9, 4), (1, 4, 6), (5, 2, 3, 3)]
"""Over 2 ranks, Shard(0): 3 experts split 2 + 1, (1, 4, 6) leaves rank 1 an empty shard; the last
is a conv weight, flattened (5 rows split 3 + 2)."""


def _fsdp_train(
    factory: Factory, initial: Sequence[torch.Tensor], grads: Sequence[Sequence[torch.Tensor]], place: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """Whole params and state after stepping params ``place(initial)`` on gradients ``place(grads[k])``,
    with a state-dict round trip into a new optimizer after the first step."""
    from torch.distributed.tensor import DTensor

    params = [torch.nn.Parameter(place(w.clone())) for w in initial]

    def build() -> torch.optim.Optimizer:
        groups = [{"params": params[:3]}, {"params": params[3:], "flatten": True}]
        return factory(groups, lr=0.02, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest")

    opt = build()
    for step, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads):
            p.grad = place(g.clone())
        opt.step()
        if step == 0:
            saved = copy.deepcopy(opt.state_dict())
            opt = build()
            opt.load_state_dict(saved)
    tensors = [t for p in params for t in (p, *opt.state[p].values())]
    return [t.full_tensor() if isinstance(t, DTensor) else t.detach() for t in tensors]


def _fsdp_stack_runs(rank: int, world_size: int) -> dict[str, float]:
    """Per optimizer, the largest difference between Shard(0) DTensor params (and their state)
    and plain ones stepped on the same gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, float] = {}
    for name, factory in OPTIMIZERS.items():
        generator = torch.Generator().manual_seed(3)  # the same values on every rank
        initial = [torch.randn(shape, generator=generator) for shape in FSDP_SHAPES]
        grads = [[torch.randn(shape, generator=generator) for shape in FSDP_SHAPES] for _ in range(3)]
        plain = _fsdp_train(factory, initial, grads, lambda t: t)
        sharded = _fsdp_train(factory, initial, grads, lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        out[name] = max((s - p).abs().max().item() for s, p in zip(sharded, plain, strict=True))
    return out


@pytest.mark.slow
def test_fsdp2_sharded_stacks_and_flattened_weights_step_exactly_as_whole_ones() -> None:
    from tests.distributed.harness import run_ranks

    # Exact, as tests/distributed/test_fsdp2.py: the same gradients, element-wise steps on shards,
    # Newton–Schulz on the same gathered whole matrices in the same batches.
    for result in run_ranks(2, _fsdp_stack_runs):
        assert result == {name: 0.0 for name in OPTIMIZERS}
