"""PolarGrad, MOP, Scion, SPEL, Muon-Hyperball and Sinkhorn-Muon equal emerging-optimizers' classes.

The reference is each upstream class (``emerging_optimizers.registry.get_optimizer_cls(name)``,
0.3.0) stepped directly on float32 copies of the same params with the same gradients. Parity
comes in test_muon.py's two strengths:

* given upstream's Newton–Schulz swapped in for ours (:data:`GIVEN_ITS_NEWTON_SCHULZ`): bitwise,
  except where the arithmetic after it differs (MOP's nuclear norm; Muon-Hyperball's own-norm
  radius), each stated there;
* with our Newton–Schulz (:data:`END_TO_END`): to float32 rounding, per algorithm.

Then hand-written expectations from the papers (float64 where cheap), N-D stacks against per-matrix
2-D params, QKV blocks and matrix views, the new config fields and class arguments, the weight
projections' start (Sinkhorn's ``normalize_at_start``, the hyperball's radius and zero norm),
bf16, exact resume, and FSDP2 (one 2-rank spawn).
"""

from __future__ import annotations

import re
from typing import Any

import emerging_optimizers.orthogonalized_optimizers  # noqa: F401  (registers the classes)
import pytest
import torch
from emerging_optimizers.registry import get_optimizer_cls
from emerging_optimizers.utils.sinkhorn_mapper import SinkhornMapper

import optzoo.optimizers.muon as muon_module
from optzoo import OptimizerConfig, ParamKey, get_optimizer
from optzoo.optimizers import _emerging
from optzoo.optimizers._emerging import sinkhorn_map_
from optzoo.optimizers.muon import Muon
from optzoo.optimizers.orthogonalized import MOP, MuonHyperball, PolarGrad, Scion, SinkhornMuon, Spel
from tests.conftest import OddShapes, fill_grads, train_with_resumed_twin
from tests.distributed.harness import run_ranks
from tests.optimizers.reference.muon import copies, drive, matrices, upstream_newton_schulz
from tests.optimizers.test_muon import SHAPES, WIDE_SHAPES

NAMES = ("polargrad", "mop", "scion", "spel", "muon_hyperball", "sinkhorn_muon")
CLASSES: dict[str, type[Muon]] = {
    "polargrad": PolarGrad, "mop": MOP, "scion": Scion, "spel": Spel, "muon_hyperball": MuonHyperball,
    "sinkhorn_muon": SinkhornMuon,
}  # fmt: skip
COMMON: dict[str, Any] = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "fp32_matmul_prec": "highest"}
# Per case: the class, its settings beyond COMMON. Powers of two where a factor multiplies the
# orthogonal matrix: our one product by (s·ρ) then rounds as upstream's (O·s)·ρ.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "polargrad": ("polargrad", {"nesterov": True, "extra_scale_factor": 0.5, "coefficient_type": "polar_express"}),
    "mop": ("mop", {"nesterov": True, "extra_scale_factor": 0.5}),
    "mop-spectral": ("mop", {"scale_mode": "spectral", "extra_scale_factor": 0.5}),
    "scion": ("scion", {"spectral_radius": 0.5}),
    "spel": ("spel", {"nesterov": True}),
    "muon_hyperball": ("muon_hyperball", {"hyperball_radius": 2.0, "scale_mode": "unit_rms_norm"}),
    "muon_hyperball-own-norm": ("muon_hyperball", {}),
    "sinkhorn_muon": ("sinkhorn_muon", {"num_iters": 10, "eps": 1e-7}),
}
STEPS = 5
EXACT = {"atol": 0.0, "rtol": 0.0}
# Given upstream's Newton–Schulz. MOP: upstream sums the singular values, ours reads the nuclear
# norm as <UVᵀ, D> (PolarGrad's formula), equal to a few float32 ulps; with a Muon scale mode it
# is the same arithmetic (bitwise). Muon-Hyperball without a radius: upstream reads R = ‖W‖ as a
# Python float and divides R / ‖U‖, which torch computes as reciprocal(‖U‖)·R, one rounding more
# than our tensor division. Every other case is the same arithmetic in the same order: bitwise.
# Measured worst over 5 seeds, STEPS steps (atol = rtol = t convention): MOP 1.7e-7, hyperball
# 4.6e-7; the tolerances leave 4x or more.
GIVEN_ITS_NEWTON_SCHULZ: dict[str, dict[str, float]] = {
    "mop": {"atol": 1e-6, "rtol": 1e-6}, "mop-spectral": EXACT, "muon_hyperball-own-norm": {"atol": 2e-6, "rtol": 2e-6},
}  # fmt: skip
# With our Newton–Schulz: it differs from upstream's by ~1e-6 relative (test_newton_schulz.py), so
# the params drift by float32 rounding. Measured worst over 5 seeds, STEPS steps (atol = rtol = t,
# params of size ~0.02 to ~5): PolarGrad 1.7e-6 (the nuclear norm, ~10 here, multiplies the
# orthogonal matrix and its rounding), SPEL 1.8e-6 (the weights themselves are re-orthogonalised
# each step, so both engines' rounding lands in them), hyperball 3.9e-7, MOP 2.3e-7 (no
# Newton–Schulz: as above), Scion 1.1e-7, Sinkhorn 6e-8. Margins 5x or more.
END_TO_END: dict[str, dict[str, float]] = {
    "polargrad": {"atol": 1e-5, "rtol": 1e-5}, "spel": {"atol": 1e-5, "rtol": 1e-5},
}  # fmt: skip
DEFAULT_END_TO_END = {"atol": 2e-6, "rtol": 2e-6}


pytestmark = pytest.mark.usefixtures("highest_precision")  # tests/conftest.py


def upstream(name: str, params: Any, settings: dict[str, Any]) -> torch.optim.Optimizer:
    """Upstream's class for ``name`` with our settings under its argument names.

    Scion takes no ``weight_decay`` argument (it sets 1 in its defaults) but reads the param
    group's, as Megatron-Core passes it: given here as a group key."""
    cls: Any = get_optimizer_cls(name)
    kwargs = dict(settings)
    if name == "scion":
        weight_decay = kwargs.pop("weight_decay")
        kwargs.pop("nesterov", None)
        return cls([{"params": list(params), "weight_decay": weight_decay}], **kwargs)  # type: ignore[no-any-return]
    return cls(params, **kwargs)  # type: ignore[no-any-return]


def normalised(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Params Sinkhorn-normalised in place (upstream's Sinkhorn-Muon requires them so when built)."""
    with torch.no_grad():
        for p in params:
            SinkhornMapper(num_iters=20)(p.data, inplace=True)
    return params


def _pair(case: str, shapes: list[tuple[int, int]], seed: int = 0) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    name, extra = CASES[case]
    ours_params = matrices(shapes, seed=seed)
    if name == "sinkhorn_muon":
        normalised(ours_params)
    reference_params = copies(ours_params)
    ours = CLASSES[name](ours_params, **COMMON, **extra)
    reference = upstream(name, reference_params, {**COMMON, **extra})
    drive([(ours, ours_params), (reference, reference_params)], steps=STEPS, seed=seed + 1)
    for p, q in zip(ours_params, reference_params):
        # gradients do not depend on the params: the momentum is the same computation, bit for bit
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], **EXACT)
    return ours_params, reference_params


# ---- parity with upstream -------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_equals_upstream_given_its_newton_schulz(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The optimizer shell (momentum, batching, scale, the projections) against upstream's."""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    tolerance = GIVEN_ITS_NEWTON_SCHULZ.get(case, GIVEN_ITS_NEWTON_SCHULZ.get(CASES[case][0], EXACT))
    for p, q in zip(*_pair(case, WIDE_SHAPES)):
        torch.testing.assert_close(p, q, **tolerance)


@pytest.mark.parametrize("case", list(CASES))
def test_equals_upstream_end_to_end(case: str) -> None:
    """Our Newton–Schulz, tall matrices too (SHAPES)."""
    tolerance = END_TO_END.get(CASES[case][0], DEFAULT_END_TO_END)
    for p, q in zip(*_pair(case, SHAPES)):
        torch.testing.assert_close(p, q, **tolerance)


FIELDS: dict[str, dict[str, Any]] = {
    "polargrad": {"muon_extra_scale_factor": 0.5, "muon_nesterov": True},
    "mop": {"mop_scale_mode": "unit_rms_norm", "muon_extra_scale_factor": 0.5},
    "scion": {"scion_spectral_radius": 0.25},
    "spel": {"muon_coefficient_type": "polar_express"},
    "muon_hyperball": {"muon_hyperball_radius": 4.0, "muon_hyperball_eps": 1e-6},
    "sinkhorn_muon": {"sinkhorn_muon_num_iters": 7, "sinkhorn_muon_eps": 1e-6, "sinkhorn_muon_doubly_stochastic_tolerance": 0.2},
}
"""Per name, config fields whose effect the get_optimizer parity test sees (non-default values)."""
# the class's keyword for each field above, as upstream names it
UPSTREAM_KEYS = {
    "muon_extra_scale_factor": "extra_scale_factor", "muon_nesterov": "nesterov", "mop_scale_mode": "scale_mode",
    "scion_spectral_radius": "spectral_radius", "muon_coefficient_type": "coefficient_type",
    "muon_hyperball_radius": "hyperball_radius", "muon_hyperball_eps": "hyperball_eps",
    "sinkhorn_muon_num_iters": "num_iters", "sinkhorn_muon_eps": "eps",
    "sinkhorn_muon_doubly_stochastic_tolerance": "doubly_stochastic_tolerance",
}  # fmt: skip
ROUTED = ("layers.0.qkv.weight", "layers.0.proj.weight", "layers.1.qkv.weight", "layers.1.proj.weight")


def _routed_model(name: str, dtype: torch.dtype = torch.float32) -> OddShapes:
    torch.manual_seed(0)
    model = OddShapes().to(dtype)
    if name == "sinkhorn_muon":
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name in ROUTED:
                    sinkhorn_map_(param.data)
    return model


def _through_get_optimizer(
    name: str, model: torch.nn.Module, *, bf16: bool = False
) -> tuple[Any, torch.optim.Optimizer, dict[str, torch.nn.Parameter]]:
    """optzoo's optimizer over ``model`` (Adam by default, one override routing its four hidden
    matrices to ``name``), and upstream's class over float32 copies of those matrices, built with
    the group settings optzoo gave them and the config's fields under upstream's names."""
    config = OptimizerConfig(
        optimizer="adam", lr=0.02, weight_decay=0.1, clip_grad=0.0, muon_momentum=0.9,
        muon_fp32_matmul_prec="highest", bf16=bf16, **FIELDS[name],
    )  # fmt: skip
    ours = get_optimizer(config, model, {ParamKey(name="layers.*.weight"): {"optimizer": name}})
    (variant,) = [o for o in ours.optimizers if isinstance(o, CLASSES[name])]
    (group,) = variant.param_groups
    assert sorted(group["param_names"]) == sorted(ROUTED)
    settings = {"lr": group["lr"], "momentum": 0.9, "weight_decay": group["weight_decay"], "fp32_matmul_prec": "highest"}
    settings |= {UPSTREAM_KEYS[field]: value for field, value in FIELDS[name].items()}
    for key, value in settings.items():  # the fields reached the class's groups, under its argument names
        assert key not in group or group[key] == value, key
    masters = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in model.named_parameters() if n in ROUTED}
    return ours, upstream(name, [masters[n] for n in group["param_names"]], settings), masters


@pytest.mark.parametrize("name", NAMES)
def test_get_optimizer_routes_a_matrix_to_it_as_upstream_steps_it(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fields and group settings reach the class: equal to upstream built with them directly,
    bitwise given upstream's Newton–Schulz (the routed matrices are wide), MOP as above."""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    model = _routed_model(name)
    ours, reference, masters = _through_get_optimizer(name, model)
    generator = torch.Generator().manual_seed(5)
    for _ in range(5):
        fill_grads(list(model.parameters()), generator)
        for param_name, param in model.named_parameters():
            if param_name in masters:
                masters[param_name].grad = param.grad.clone()
        assert ours.step()[0]
        reference.step()
    tolerance = GIVEN_ITS_NEWTON_SCHULZ.get(name, EXACT)
    for param_name, param in model.named_parameters():
        if param_name in masters:
            torch.testing.assert_close(param.detach(), masters[param_name].detach(), **tolerance, msg=param_name)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_steps_fp32_main_params_as_upstream_steps_fp32_copies(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 params with fp32 main params (``bf16=True``): the main params equal upstream's class
    stepped on fp32 copies with the bf16 gradients widened, as in fp32; the model's params are
    the main params rounded to bf16."""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    model = _routed_model(name, torch.bfloat16)
    ours, reference, masters = _through_get_optimizer(name, model, bf16=True)
    generator = torch.Generator().manual_seed(7)
    for _ in range(4):
        fill_grads(list(model.parameters()), generator)
        for param_name, param in model.named_parameters():
            if param_name in masters:
                masters[param_name].grad = param.grad.float()
        assert ours.step()[0]
        reference.step()
    main = {entry.model: entry.main for entry in ours.param_map.local}
    tolerance = GIVEN_ITS_NEWTON_SCHULZ.get(name, EXACT)
    for param_name, param in model.named_parameters():
        if param_name in masters:
            assert main[param].dtype == torch.float32
            torch.testing.assert_close(main[param], masters[param_name].detach(), **tolerance, msg=param_name)
            assert torch.equal(param.detach(), main[param].to(torch.bfloat16)), param_name


@pytest.mark.parametrize("name", NAMES)
def test_bf16_params_keep_float32_state(name: str) -> None:
    """The class on bf16 params: the momentum is float32, and a step is the float32 step from the
    same values to bf16 rounding (the projections round the weights once more)."""
    bf16 = matrices([(8, 12), (12, 8)], dtype=torch.bfloat16)
    if name == "sinkhorn_muon":
        normalised(bf16)
    fp32 = copies(bf16, dtype=torch.float32)
    ours, reference = CLASSES[name](bf16, **COMMON), CLASSES[name](fp32, **COMMON)
    drive([(ours, bf16), (reference, fp32)], steps=1)
    for p, q in zip(bf16, fp32):
        assert ours.state[p]["momentum_buffer"].dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), q.detach(), atol=2e-2 * q.abs().max().item(), rtol=1e-2)


# ---- the papers' rules, by hand ----------------------------------------------------------------


def _one_step(cls: type[Muon], weight: torch.Tensor, grad: torch.Tensor, lr: float = 0.1, **settings: Any) -> torch.Tensor:
    param = torch.nn.Parameter(weight.clone())
    opt = cls([param], lr=lr, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest", **settings)
    param.grad = grad.clone()
    opt.step()
    return param.detach()


def _upstream_ns(matrix: torch.Tensor, **settings: Any) -> torch.Tensor:
    return upstream_newton_schulz(
        matrix[None], steps=settings.get("steps", 5), coefficient_type=settings.get("coefficient_type", "quintic"),
        matmul_precision="highest",
    )[0]  # fmt: skip


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_mop_update_is_the_nuclear_norm_times_the_polar_factor_in_float64(shape: tuple[int, int]) -> None:
    """MOP, one step with momentum 0: ``W − η·‖G‖_*·UVᵀ`` with ``G = USVᵀ`` (torch.linalg.svd in float64)."""
    generator = torch.Generator().manual_seed(2)
    weight, grad = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    u, s, vh = torch.linalg.svd(grad.double(), full_matrices=False)
    expected = weight.double() - 0.1 * s.sum() * (u @ vh)
    torch.testing.assert_close(_one_step(MOP, weight, grad).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale_mode", ["nuclear_norm", "spectral"])
def test_mop_polar_factor_of_a_rank_deficient_direction_spans_its_range_only(scale_mode: str) -> None:
    """The polar factor of ``D = U_r S_r V_rᵀ`` (rank r) is ``U_r V_rᵀ`` (Newton–Schulz's limit,
    sign(0) = 0), computed here in float64; a zero gradient is then a no-op under every scale mode.
    (Upstream's ``U @ Vh`` of the full thin SVD completed the null space arbitrarily: the rank-2
    gradient below gave a rank-6 update, and a zero one moved the weights by 0.24 under ``spectral``.)"""
    generator = torch.Generator().manual_seed(12)
    weight = torch.randn(6, 6, generator=generator)
    grad = torch.randn(6, 2, generator=generator) @ torch.randn(2, 6, generator=generator)
    u, s, vh = torch.linalg.svd(grad.double())
    polar = u[:, :2] @ vh[:2]
    scale = s.sum() if scale_mode == "nuclear_norm" else _emerging.muon_scale_factor(6, 6, "spectral")
    got = _one_step(MOP, weight, grad, scale_mode=scale_mode).double()
    torch.testing.assert_close(got, weight.double() - 0.1 * scale * polar, atol=1e-5, rtol=1e-5)
    assert torch.equal(_one_step(MOP, weight, torch.zeros(6, 6), scale_mode=scale_mode), weight)


def test_polargrad_update_is_its_nuclear_norm_estimate_times_the_orthogonal_factor() -> None:
    """PolarGrad, one step with momentum 0: ``W − η·⟨O, G⟩·O`` with ``O = NS(G)`` (upstream's
    Newton–Schulz), ``⟨O, G⟩`` in float64. With 5 quintic steps ``O`` is only near-orthogonal, so
    ``⟨O, G⟩`` is near ``‖G‖_*`` (checked to 15%), and it is the factor upstream applies."""
    generator = torch.Generator().manual_seed(3)
    weight, grad = torch.randn(8, 12, generator=generator), torch.randn(8, 12, generator=generator)
    orthogonal = _upstream_ns(grad).double()
    factor = (orthogonal * grad.double()).sum()
    nuclear = torch.linalg.svdvals(grad.double()).sum()
    assert abs(factor / nuclear - 1) < 0.15
    torch.testing.assert_close(_one_step(PolarGrad, weight, grad).double(), weight.double() - 0.1 * factor * orthogonal, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("shape", "radius"), [((32, 8), 1.0), ((8, 32), 3.0), ((16, 16), 0.7)])
def test_scion_factor_is_sqrt_rows_over_cols_times_the_radius(shape: tuple[int, int], radius: float) -> None:
    """Scion's LMO of the spectral ball, unit RMS→RMS: ``√(rows/cols)·ρ·NS(G)``, ρ the radius."""
    generator = torch.Generator().manual_seed(4)
    weight, grad = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    step = weight - _one_step(Scion, weight, grad, spectral_radius=radius)
    expected = 0.1 * (shape[0] / shape[1]) ** 0.5 * radius * _upstream_ns(grad)
    torch.testing.assert_close(step, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(8, 24), (24, 8), (16, 16)])
def test_spel_weights_are_near_orthogonal_after_a_step(shape: tuple[int, int]) -> None:
    """SPEL projects ``W`` onto the Stiefel manifold by Newton–Schulz: after one step from any
    weights, their singular values are those 5 quintic steps give (within [0.6, 1.25])."""
    generator = torch.Generator().manual_seed(5)
    weight, grad = 3 * torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    singular = torch.linalg.svdvals(_one_step(Spel, weight, grad).double())
    assert bool(((singular > 0.6) & (singular < 1.25)).all()), singular
    assert not bool(((torch.linalg.svdvals(weight) > 0.6) & (torch.linalg.svdvals(weight) < 1.25)).all())


def test_hyperball_keeps_each_matrix_norm_and_rescales_to_a_radius() -> None:
    """Without a radius, every matrix of a stack keeps its Frobenius norm (weight decay 0), to
    rounding, over several steps. With a radius R: ``W₁ = R·normalize(W₀' − η·R·U/‖U‖)`` where
    ``W₀' = R·W₀/‖W₀‖`` (rescaled before the first update) and ``U`` the spectral-scaled NS(G)."""
    stack = torch.nn.Parameter(torch.randn(3, 6, 10) * torch.tensor([0.5, 1.0, 4.0])[:, None, None])
    norms = torch.linalg.vector_norm(stack.detach().double(), dim=(-2, -1))
    opt = MuonHyperball([stack], lr=0.05, weight_decay=0.0, fp32_matmul_prec="highest")
    generator = torch.Generator().manual_seed(6)
    for _ in range(5):
        stack.grad = torch.randn(stack.shape, generator=generator)
        opt.step()
    torch.testing.assert_close(torch.linalg.vector_norm(stack.detach().double(), dim=(-2, -1)), norms, atol=0, rtol=1e-6)

    weight, grad, radius, lr = torch.randn(6, 10, generator=generator), torch.randn(6, 10, generator=generator), 2.0, 0.1
    w0 = radius * weight.double() / weight.double().norm()
    u = _upstream_ns(grad).double()  # the spectral scale cancels in U/‖U‖
    moved = w0 - lr * radius * u / u.norm()
    expected = radius * moved / moved.norm()
    got = _one_step(MuonHyperball, weight, grad, lr=lr, hyperball_radius=radius).double()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert abs(got.norm().item() - radius) < 1e-6


@pytest.mark.parametrize("radius", [0.7, 0.3])
def test_hyperball_holds_bf16_params_at_the_radius_in_float32(radius: float) -> None:
    """bf16 params compute in float32: the radius is not rounded to bf16 (0.7 would be 0.69921875,
    0.3 would be 0.30078125), so after 20 steps the bf16 weights' norm is the radius to what
    storing a rescaled matrix in bf16 allows (measured within 5e-4 over 4 seeds and 3 radii;
    rounding the radius to bf16 left it up to 4.4e-3 off)."""
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 64, generator=generator).bfloat16())
    opt = MuonHyperball([param], lr=0.05, weight_decay=0.0, hyperball_radius=radius)
    for _ in range(20):
        param.grad = torch.randn(64, 64, generator=generator).bfloat16()
        opt.step()
    assert abs(param.detach().double().norm().item() / radius - 1) < 1e-3


def test_sinkhorn_weights_have_the_targets_sums_after_a_step() -> None:
    """After each step every matrix is non-negative with row sums max(1, cols/rows) and column
    sums max(1, rows/cols) (Sinkhorn–Knopp ends on the rows, so they are exact to rounding)."""
    params = normalised(matrices([(4, 12), (12, 4), (3, 5, 10)]))
    opt = SinkhornMuon(params, lr=0.05, fp32_matmul_prec="highest")
    drive([(opt, params)], steps=3)
    for p in params:
        rows, cols = p.shape[-2:]
        assert bool((p >= 0).all())
        torch.testing.assert_close(p.detach().sum(-1), torch.full(p.shape[:-1], max(1.0, cols / rows)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(p.detach().sum(-2), torch.full((*p.shape[:-2], cols), max(1.0, rows / cols)), atol=1e-3, rtol=1e-3)


def test_sinkhorn_maps_bf16_params_in_float32() -> None:
    """bf16 params compute in float32: the map runs on a float32 copy, rounded to bf16 once, so
    the sums are the targets to the weights' own rounding (entries ~0.03 rounded to bf16: measured
    within 1.5e-3 over 3 seeds). Mapped in bf16 they were off by 8e-3 to 1.1e-2 (rows of 96
    entries) and 3.3e-3 (columns)."""
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(32, 96, generator=generator).bfloat16())
    opt = SinkhornMuon([param], lr=0.05)
    for _ in range(5):
        param.grad = torch.randn(32, 96, generator=generator).bfloat16()
        opt.step()
    weights = param.detach().double()
    assert (weights.sum(dim=1) - 3.0).abs().max().item() < 4e-3
    assert (weights.sum(dim=0) - 1.0).abs().max().item() < 2.5e-3


def _sinkhorn(matrix: torch.Tensor, num_iters: int = 20) -> torch.Tensor:
    return SinkhornMapper(num_iters=num_iters)(matrix.clone(), inplace=False)


def test_sinkhorn_normalize_at_start_maps_an_unnormalised_matrix_before_the_first_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """``W₁ = SK(SK(W₀) − η·s·NS(G))``: upstream's mapper and Newton–Schulz by hand; bitwise."""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    generator = torch.Generator().manual_seed(8)
    weight, grad = torch.randn(6, 10, generator=generator), torch.randn(6, 10, generator=generator)
    param = torch.nn.Parameter(weight.clone())
    opt = SinkhornMuon([param], lr=0.1, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest")
    assert torch.equal(param.detach(), weight)  # nothing happens when it is built
    param.grad = grad
    opt.step()
    scale = _emerging.muon_scale_factor(6, 10, "spectral")  # upstream's get_muon_scale_factor
    expected = _sinkhorn(torch.add(_sinkhorn(weight), _upstream_ns(grad) * scale, alpha=-0.1))  # upstream's p.add_
    torch.testing.assert_close(param.detach(), expected, **EXACT)


def test_sinkhorn_normalize_at_start_leaves_a_normalised_matrix_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    generator = torch.Generator().manual_seed(9)
    weight, grad = _sinkhorn(torch.randn(6, 10, generator=generator)), torch.randn(6, 10, generator=generator)
    expected = _sinkhorn(torch.add(weight, _upstream_ns(grad) * _emerging.muon_scale_factor(6, 10, "spectral"), alpha=-0.1))
    torch.testing.assert_close(_one_step(SinkhornMuon, weight, grad), expected, **EXACT)


def test_sinkhorn_without_normalize_at_start_refuses_an_unnormalised_param_by_name() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.Linear(6, 3))
    config = OptimizerConfig(optimizer="sinkhorn_muon", lr=0.01, sinkhorn_muon_normalize_at_start=False)
    with pytest.raises(ValueError, match=r"^param group #0, param #0 \(`0\.weight`\): SinkhornMuon needs Sinkhorn-normalised weights; got min -?[0-9.e-]+, row sums off "):
        get_optimizer(config, model)
    with pytest.raises(ValueError, match=r"^param group #0, param #1: SinkhornMuon needs Sinkhorn-normalised weights; .*set normalize_at_start=True"):
        SinkhornMuon([torch.nn.Parameter(_sinkhorn(torch.randn(4, 6))), torch.nn.Parameter(torch.rand(4, 6))], normalize_at_start=False)


def test_hyperball_refuses_a_zero_norm_matrix_by_name() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 6), torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    with torch.no_grad():
        model[1].weight.zero_()
    with pytest.raises(ValueError, match=r"^param group #0, param #1 \(`1\.weight`\): MuonHyperball keeps each matrix's norm; got a matrix of zero norm in shape \(5, 6\)"):
        get_optimizer(OptimizerConfig(optimizer="muon_hyperball", lr=0.01), model)
    stack = torch.randn(3, 4, 5)
    stack[1] = 0.0  # one expert of a stack
    with pytest.raises(ValueError, match=r"^param group #0, param #0: MuonHyperball keeps each matrix's norm; got a matrix of zero norm in shape \(3, 4, 5\)"):
        MuonHyperball([torch.nn.Parameter(stack)])


# ---- stacks, QKV blocks, views ----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_stack_steps_bitwise_as_its_matrices_as_2d_params(name: str) -> None:
    """Experts ``[E, rows, cols]``, wide and tall: each matrix as a 2-D param of its own (the
    three same-shape 2-D params share one batch as the stack's matrices do)."""
    for shape in ((3, 6, 10), (3, 10, 6)):
        (stack,) = matrices([shape])
        if name == "sinkhorn_muon":
            normalised([stack])
        experts = [torch.nn.Parameter(m.clone()) for m in stack.detach()]
        opt_stack, opt_experts = CLASSES[name]([stack], **COMMON), CLASSES[name](experts, **COMMON)
        generator = torch.Generator().manual_seed(1)
        for _ in range(4):
            stack.grad = torch.randn(shape, generator=generator)
            for e, expert in enumerate(experts):
                expert.grad = stack.grad[e].clone()
            opt_stack.step()
            opt_experts.step()
        torch.testing.assert_close(stack.detach(), torch.stack([e.detach() for e in experts]), **EXACT)
        for e, expert in enumerate(experts):
            torch.testing.assert_close(opt_stack.state[stack]["momentum_buffer"][e], opt_experts.state[expert]["momentum_buffer"], **EXACT)


@pytest.mark.parametrize("name", ["polargrad", "mop", "scion"])
def test_qkv_blocks_step_as_separate_matrices_where_the_scale_is_per_matrix(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's split: a fused QKV of 2 query groups ``[q, k, v] = [4, 2, 2]`` orthogonalises
    (and scales: nuclear norm, √(rows/cols)) each block as a matrix of its own, gathered by hand
    from the rows; upstream's class steps those blocks as separate 2-D params."""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    split, groups, cols = [4, 2, 2], 2, 12
    (fused,) = matrices([(groups * sum(split), cols)])
    fused.qkv_split_shapes = split  # type: ignore[attr-defined]
    rows_of = [[g * sum(split) + sum(split[:k]) + r for g in range(groups) for r in range(size)] for k, size in enumerate(split)]
    blocks = [torch.nn.Parameter(fused.detach()[rows].clone()) for rows in rows_of]
    ours = CLASSES[name]([fused], **COMMON)
    reference = upstream(name, blocks, dict(COMMON))
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        fused.grad = torch.randn(fused.shape, generator=generator)
        for rows, block in zip(rows_of, blocks):
            block.grad = fused.grad[rows].clone()
        ours.step()
        reference.step()
    tolerance = GIVEN_ITS_NEWTON_SCHULZ.get(name, EXACT)
    for rows, block in zip(rows_of, blocks):
        torch.testing.assert_close(fused.detach()[rows], block.detach(), **tolerance)


def test_spel_orthogonalises_qkv_blocks_then_projects_the_whole_fused_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's split orthogonalises the update per Q/K/V block; the projection keeps upstream's
    rule for a 2-D param (the whole matrix): ``W₁ = NS(W₀ − η·[NS(D_q); NS(D_k); NS(D_v)])``, by hand
    with upstream's Newton–Schulz, the blocks gathered from the rows by hand."""
    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    split, groups, cols = [4, 2, 2], 2, 24
    generator = torch.Generator().manual_seed(13)
    weight, grad = torch.randn(groups * sum(split), cols, generator=generator), torch.randn(groups * sum(split), cols, generator=generator)
    fused = torch.nn.Parameter(weight.clone())
    fused.qkv_split_shapes = split  # type: ignore[attr-defined]
    opt = Spel([fused], lr=0.1, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest")
    fused.grad = grad
    opt.step()
    orthogonal = torch.empty_like(grad)
    for k, size in enumerate(split):
        rows = [g * sum(split) + sum(split[:k]) + r for g in range(groups) for r in range(size)]
        orthogonal[rows] = _upstream_ns(grad[rows])
    torch.testing.assert_close(fused.detach(), _upstream_ns(torch.add(weight, orthogonal, alpha=-0.1)), **EXACT)


@pytest.mark.parametrize("name", NAMES)
def test_get_optimizer_steps_concatenated_experts_as_separate_matrices(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The matrix view read from the forward (test_muon_views.py's model, ``w1`` read as
    ``w1.view(E, FFN, HIDDEN)[e]``): ``w1`` steps as its E experts would alone under upstream's
    class, the weight projections (SPEL's, the hyperball's norm, Sinkhorn's sums) included: they
    act on the matrices the forward multiplies by."""
    from tests.optimizers.test_muon_views import FFN, ConcatenatedMoE

    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    torch.manual_seed(0)
    model = ConcatenatedMoE()
    count = model.w1.shape[0] // FFN
    if name == "sinkhorn_muon":  # upstream needs each expert normalised; optzoo leaves them as they are
        with torch.no_grad():
            for e in range(count):
                sinkhorn_map_(model.w1.data[FFN * e : FFN * (e + 1)])
    config = OptimizerConfig(optimizer=name, lr=0.02, weight_decay=0.1, muon_fp32_matmul_prec="highest", clip_grad=0.0)
    optimizer = get_optimizer(config, model)
    group = next(g for g in optimizer.param_groups if any(p is model.w1 for p in g["params"]))
    assert group["matrix_views"][[p is model.w1 for p in group["params"]].index(True)] is not None
    experts = [torch.nn.Parameter(model.w1.detach()[FFN * e : FFN * (e + 1)].clone()) for e in range(count)]
    settings = {"lr": 0.02, "momentum": config.muon_momentum, "weight_decay": 0.1, "fp32_matmul_prec": "highest"}
    reference = upstream(name, experts, settings)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        for e, expert in enumerate(experts):
            expert.grad = model.w1.grad[FFN * e : FFN * (e + 1)].clone()  # type: ignore[index]
        assert optimizer.step()[0]
        reference.step()
    tolerance = GIVEN_ITS_NEWTON_SCHULZ.get(name, GIVEN_ITS_NEWTON_SCHULZ["muon_hyperball-own-norm"] if name == "muon_hyperball" else EXACT)
    torch.testing.assert_close(model.w1.detach(), torch.cat([e.detach() for e in experts]), **tolerance)


@pytest.mark.parametrize("name", NAMES)
def test_every_matrix_view_steps_its_blocks_as_upstream_steps_them_as_2d_params(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """test_muon_views.py's layouts in one group (experts [E, out, in] and [E, in, out], concatenated,
    grouped projection and conv, per-head, interleaved): each block, cut out by hand-written
    indexing, steps under upstream's class as its own ``(out, in)`` param, the projections
    included. Given upstream's Newton–Schulz; reductions over a block (PolarGrad's ⟨O, D⟩ on a
    tall block's transposed output, MOP's nuclear norm, the hyperball's norms, Sinkhorn's sums)
    round differently by a few ulps where the block is not read in upstream's row-major order
    (test_muon_views.py's REDUCTIONS: 1e-6; measured worst 3.5e-7)."""
    from tests.optimizers import test_muon_views as views

    monkeypatch.setattr(muon_module, "newton_schulz", upstream_newton_schulz)
    layouts = list(views.LAYOUTS.values())
    params = views._params(layouts)
    if name == "sinkhorn_muon":  # upstream needs every block normalised
        params = [torch.nn.Parameter(t) for t in views._assemble(normalised(views._twins(params, layouts)), layouts)]
    twins = views._twins(params, layouts)
    ours = CLASSES[name]([{"params": params, "matrix_views": [layout.view for layout in layouts]}], **COMMON)
    reference = upstream(name, twins, dict(COMMON))
    views._drive(ours, params, reference, twins, layouts, steps=2)
    tolerance = EXACT if name in ("scion", "spel") else views.REDUCTIONS
    for p, want in zip(params, views._assemble([t.detach() for t in twins], layouts), strict=True):
        torch.testing.assert_close(p.detach(), want, **tolerance)


# ---- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("mop_scale_mode", "nuc", ValueError, r"`OptimizerConfig.mop_scale_mode`: unknown value; got 'nuc'; expected one of \['spectral', 'unit_rms_norm', 'shape_scaling', 'original', 'match_rms_adamw', 'spectral_unclamped', 'nuclear_norm'\]"),
        ("scion_spectral_radius", 0.0, ValueError, r"`OptimizerConfig.scion_spectral_radius`: must be positive and finite; got 0.0; expected a finite float > 0$"),
        ("scion_spectral_radius", "1", TypeError, r"`OptimizerConfig.scion_spectral_radius`: wrong type; got '1' \(str\); expected a number"),
        ("muon_hyperball_eps", 0.0, ValueError, r"`OptimizerConfig.muon_hyperball_eps`: must be positive and finite; got 0.0; expected a finite float > 0$"),
        ("muon_hyperball_eps", float("inf"), ValueError, r"`OptimizerConfig.muon_hyperball_eps`: must be finite; got inf"),
        ("muon_hyperball_radius", -1.0, ValueError, r"`OptimizerConfig.muon_hyperball_radius`: must be positive and finite; got -1.0; expected a finite float > 0 or None"),
        ("sinkhorn_muon_num_iters", 0, ValueError, r"`OptimizerConfig.sinkhorn_muon_num_iters`: must be a positive integer; got 0; expected an int >= 1"),
        ("sinkhorn_muon_num_iters", True, TypeError, r"`OptimizerConfig.sinkhorn_muon_num_iters`: wrong type; got True"),
        ("sinkhorn_muon_eps", 0.0, ValueError, r"`OptimizerConfig.sinkhorn_muon_eps`: must be positive and finite; got 0.0"),
        ("sinkhorn_muon_doubly_stochastic_tolerance", float("nan"), ValueError, r"`OptimizerConfig.sinkhorn_muon_doubly_stochastic_tolerance`: must be finite; got nan"),
        ("sinkhorn_muon_doubly_stochastic_tolerance", -0.1, ValueError, r"`OptimizerConfig.sinkhorn_muon_doubly_stochastic_tolerance`: must be positive and finite; got -0.1"),
        ("sinkhorn_muon_normalize_at_start", 1, TypeError, r"`OptimizerConfig.sinkhorn_muon_normalize_at_start`: wrong type; got 1 \(int\); expected True or False"),
    ],
)
def test_config_fields_are_validated_by_name(field: str, value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match="^" + message):
        OptimizerConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "settings", "error", "message"),
    [
        ("mop", {"scale_mode": "nuc"}, ValueError, r"`scale_mode`: unknown value; got 'nuc'; expected one of \[.*'nuclear_norm'\]"),
        ("polargrad", {"scale_mode": "nuclear_norm"}, ValueError, r"`scale_mode`: unknown value; got 'nuclear_norm'"),
        ("scion", {"spectral_radius": 0.0}, ValueError, r"`spectral_radius`: must be positive and finite; got 0.0; expected a float in \(0, inf\)"),
        ("scion", {"spectral_radius": float("nan")}, ValueError, r"`spectral_radius`: must be positive and finite; got nan"),
        ("scion", {"nesterov": True}, ValueError, r"`nesterov`: Scion uses plain momentum; got True; expected False"),
        ("muon_hyperball", {"hyperball_eps": 0.0}, ValueError, r"`hyperball_eps`: must be positive and finite; got 0.0; expected a float in \(0, inf\)"),
        ("muon_hyperball", {"hyperball_radius": -2.0}, ValueError, r"`hyperball_radius`: must be positive and finite, or None; got -2.0"),
        ("muon_hyperball", {"hyperball_radius": float("inf")}, ValueError, r"`hyperball_radius`: must be positive and finite, or None; got inf"),
        ("sinkhorn_muon", {"num_iters": 0}, ValueError, r"`num_iters`: must be a positive integer; got 0; expected an int >= 1"),
        ("sinkhorn_muon", {"num_iters": True}, ValueError, r"`num_iters`: must be a positive integer; got True"),
        ("sinkhorn_muon", {"eps": 0.0}, ValueError, r"`eps`: must be positive and finite; got 0.0"),
        ("sinkhorn_muon", {"doubly_stochastic_tolerance": -1.0}, ValueError, r"`doubly_stochastic_tolerance`: must be positive and finite; got -1.0"),
        ("sinkhorn_muon", {"normalize_at_start": "yes"}, TypeError, r"`normalize_at_start`"),
        ("spel", {"momentum": 1.0}, ValueError, r"`momentum`: must lie in \[0, 1\); got 1.0"),
    ],
)
def test_class_arguments_are_validated_by_name(name: str, settings: dict[str, Any], error: type[Exception], message: str) -> None:
    weight = _sinkhorn(torch.randn(4, 6)) if name == "sinkhorn_muon" else torch.randn(4, 6)
    with pytest.raises(error, match=r"^param group #0: " + message):
        CLASSES[name]([torch.nn.Parameter(weight)], **settings)


@pytest.mark.parametrize("name", NAMES)
def test_a_non_matrix_raises_naming_the_class(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^param group #0, param #0: {CLASSES[name].__name__} takes matrices"):
        CLASSES[name]([torch.nn.Parameter(torch.ones(3))])


# ---- resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_resumes_bitwise(name: str) -> None:
    """Through get_optimizer on the odd model (Adam takes the rest); the resumed optimizer skips
    the projections' start (the hyperball's radius, Sinkhorn's map): it would have run already."""
    model = OddShapes()
    config = OptimizerConfig(
        optimizer=name, lr=0.02, weight_decay=0.1, clip_grad=0.0, muon_fp32_matmul_prec="highest",
        muon_hyperball_radius=3.0 if name == "muon_hyperball" else None,
    )  # fmt: skip
    optimizer, resumed_model = train_with_resumed_twin(model, config, steps=5, resume_after=1)
    for (param_name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        torch.testing.assert_close(q, p, **EXACT, msg=param_name)


# ---- FSDP2 (one 2-rank spawn) -----------------------------------------------------------------

FSDP_SHAPES = [(33, 65), (5, 7), (5, 7), (7, 5), (9, 4)]
"""Odd row counts shard unevenly over 2 ranks; the two 5 x 7 share a batch; 9 x 4 is a fused QKV
of 3 groups of [1, 1, 1] rows whose blocks cross the shard boundary."""
FSDP_STEPS = 3


def _fsdp_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Per whole-matrix algorithm and FSDP2 path, the largest difference between Shard(0) DTensor
    params and plain copies in this process (same gradients; a state-dict round trip after step 1);
    per projecting one, the error get_optimizer raises on a fully_shard-ed tiny GPT."""
    from torch.distributed.device_mesh import init_device_mesh

    from optzoo.distributed import preserve_param_attributes
    from tests.conftest import tiny_gpt
    from tests.distributed.test_fsdp2 import step_sharded_beside_plain
    from torch.distributed.fsdp import fully_shard

    torch.set_float32_matmul_precision("highest")
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for name in ("polargrad", "mop", "scion"):
        for path in ("owner", "redundant"):
            def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
                return CLASSES[name](params, **COMMON, fsdp_orthogonalize=path)

            plain, sharded, reference, opt = step_sharded_beside_plain(build, FSDP_SHAPES, [1, 1, 1], FSDP_STEPS, mesh)
            diffs = [(q.full_tensor() - p).abs().max().item() for p, q in zip(plain, sharded)]  # type: ignore[attr-defined]
            diffs += [(opt.state[q]["momentum_buffer"].full_tensor() - reference.state[p]["momentum_buffer"]).abs().max().item() for p, q in zip(plain, sharded)]
            out[f"{name}-{path}"] = max(diffs)
    for name in ("spel", "muon_hyperball", "sinkhorn_muon"):
        torch.manual_seed(0)
        model = tiny_gpt()
        with preserve_param_attributes(model):
            for layer in model.decoder.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        try:
            get_optimizer(OptimizerConfig(optimizer=name, lr=0.01), model)
        except ValueError as error:
            out[name] = str(error)
    return out


@pytest.fixture(scope="module")
def fsdp() -> list[dict[str, Any]]:
    return run_ranks(2, _fsdp_runs)


@pytest.mark.slow
def test_fsdp2_whole_matrix_algorithms_equal_one_process_and_projections_refuse_by_name(fsdp: list[dict[str, Any]]) -> None:
    """PolarGrad, MOP, Scion: owner-computes and redundant orthogonalise the same whole matrices in
    the same batches, and the element-wise steps are the same per element: exact. SPEL, the
    hyperball and Sinkhorn project whole weight matrices after each update: refused by name."""
    for rank, result in enumerate(fsdp):
        for name in ("polargrad", "mop", "scion"):
            for path in ("owner", "redundant"):
                assert result[f"{name}-{path}"] == 0.0, (rank, name, path, result[f"{name}-{path}"])
        for name in ("spel", "muon_hyperball", "sinkhorn_muon"):  # the record refuses before the class is built
            expected = (
                rf"`decoder\.layers\.0\.self_attention\.linear_qkv\.weight`: {name} needs whole matrices \(it keeps the weights on .* "
                r"after each update\); got a DTensor of shape \(48, 16\) with placements \(Shard\(dim=0\),\); expected a plain "
                r"tensor: route it to muon or adam, or leave its module out of fully_shard"
            )
            assert re.fullmatch(expected, result.get(name, "")), (rank, name, result.get(name))
