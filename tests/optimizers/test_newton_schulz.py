"""The Newton–Schulz engine equals emerging-optimizers' own newton_schulz and the SVD polynomial.

Two independent references: upstream's ``muon_utils.newton_schulz`` (through the adapter), and a
float64 SVD one, ``U f(S / ‖x‖_F) Vᵀ`` with ``f`` the scalar composition of the step polynomials.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any, get_args

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import optzoo.optimizers.newton_schulz as ns
from optzoo.optimizers import _emerging
from optzoo.optimizers.newton_schulz import (
    COEFFICIENT_SETS,
    CoefficientType,
    coefficient_schedule,
    has_fast_bf16_matmul,
    newton_schulz,
    newton_schulz_flops,
)

SETS: tuple[CoefficientType, ...] = get_args(CoefficientType)
SHAPES = [(64, 64), (96, 48), (48, 96), (3, 32, 40), (33, 65), (65, 33), (5, 7)]
KEPT_VARIANTS = ["standard", "gram"]
# Ours against upstream, both float32 at 'highest'. Our max-abs prescale and bmm association round
# differently (~1e-7 relative); the iteration amplifies that by at most its slope at 0, the product
# of the a_k (~1e3 for polar_express). Measured worst over 5 seeds: 3.5e-5.
UPSTREAM_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(autouse=True)
def highest_precision() -> Iterator[None]:
    """Upstream reads torch's global setting: pin it, and check that we leave it as found."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    assert torch.get_float32_matmul_precision() == "highest"
    torch.set_float32_matmul_precision(previous)


@pytest.fixture(autouse=True, params=["dense", "symmetric-blocks"])
def symmetric_blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs twice: with dense ``m × m`` products, and with the symmetric-block ones
    forced on from 2 rows (by default they start at 1024, too big for most shapes here)."""
    monkeypatch.setattr(ns, "SYMMETRIC_BLOCKS_MIN_ROWS", 10**9 if request.param == "dense" else 2)
    return str(request.param)


def polynomial(s: torch.Tensor, coefficient_type: CoefficientType, steps: int) -> torch.Tensor:
    for a, b, c in coefficient_schedule(coefficient_type, steps):
        s = a * s + b * s**3 + c * s**5
    return s


def svd_reference(x: torch.Tensor, coefficient_type: CoefficientType, steps: int) -> torch.Tensor:
    """``U f(S / ‖x‖_F) Vᵀ`` in float64: what the iteration computes in exact arithmetic."""
    x = x.double()
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    s = s / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)[..., 0]
    return u @ torch.diag_embed(polynomial(s, coefficient_type, steps)) @ vh


def flops_of(**kwargs: Any) -> int:
    with FlopCounterMode(display=False) as counter:
        newton_schulz(**kwargs)
    return counter.get_total_flops()


# ---- coefficients and schedule --------------------------------------------------------------


def test_coefficient_sets_equal_upstream() -> None:
    assert dict(COEFFICIENT_SETS) == _emerging.newton_schulz_coefficient_sets()
    assert set(SETS) == set(_emerging.newton_schulz_coefficient_types())


def test_schedule_cycles_or_repeats_the_last_tuple() -> None:
    quintic, cans = COEFFICIENT_SETS["quintic"], COEFFICIENT_SETS["cans"]
    assert coefficient_schedule("quintic", 7) == quintic + quintic[:2]
    assert coefficient_schedule("cans", 7) == cans + (cans[-1],) * 2
    assert coefficient_schedule("aol", 2) == COEFFICIENT_SETS["aol"][:2]


# ---- parity with upstream -------------------------------------------------------------------


@pytest.mark.parametrize("variant", KEPT_VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("coefficient_type", SETS)
def test_equals_upstream(coefficient_type: CoefficientType, shape: tuple[int, ...], variant: str) -> None:
    x = torch.randn(shape)
    ours = newton_schulz(x, steps=5, coefficient_type=coefficient_type, variant=variant)  # type: ignore[arg-type]
    reference = _emerging.newton_schulz(x, steps=5, coefficient_type=coefficient_type)
    torch.testing.assert_close(ours, reference, **UPSTREAM_TOLERANCE)


@pytest.mark.parametrize("variant", KEPT_VARIANTS)
@pytest.mark.parametrize("coefficient_type", SETS)
def test_equals_upstream_for_one_step_and_past_the_end_of_the_set(coefficient_type: CoefficientType, variant: str) -> None:
    """Past the end, upstream cycles or repeats the last tuple: outputs differ a lot if we get it wrong."""
    x = torch.randn(33, 65)
    for steps in (1, len(COEFFICIENT_SETS[coefficient_type]) + 2):
        ours = newton_schulz(x, steps=steps, coefficient_type=coefficient_type, variant=variant)  # type: ignore[arg-type]
        reference = _emerging.newton_schulz(x, steps=steps, coefficient_type=coefficient_type)
        torch.testing.assert_close(ours, reference, **UPSTREAM_TOLERANCE, msg=f"steps={steps}")


@pytest.mark.parametrize("coefficient_type", SETS)
def test_bf16_path_equals_upstream_medium(coefficient_type: CoefficientType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 loop (taken on GPUs) runs here by declaring the CPU fast."""
    monkeypatch.setattr(ns, "has_fast_bf16_matmul", lambda device: True)
    x = torch.randn(3, 33, 65)
    ours = newton_schulz(x, coefficient_type=coefficient_type, matmul_precision="medium")
    torch.set_float32_matmul_precision("medium")
    reference = _emerging.newton_schulz(x, steps=5, coefficient_type=coefficient_type)
    torch.set_float32_matmul_precision("highest")
    # Mostly bitwise equal; where one bf16 rounding (2**-8 relative) of the normalised input differs
    # it is amplified by the step's slope (up to ~26 for cans near 1): measured worst 2.5e-2.
    torch.testing.assert_close(ours, reference, atol=5e-2, rtol=5e-2)


# ---- against the float64 SVD reference ------------------------------------------------------

# Singular values of the output, measured in float64 on 200 seeded Gaussian matrices
# (50 each of 64×256, 33×65, 48×96, 256×64), rounded outward by at least 0.005. Steps: 5
# (Megatron's default) and the set's own length. aol at 5 steps cycles back to its first tuple,
# which maps 1 to -0.585: the output is about -0.58 U Vᵀ, a sign flip (upstream behaviour,
# replicated). (Jordan's Muon post describes the simple
# set's output as S' ~ Uniform(0.5, 1.5); the measured band is narrower.)
BANDS: dict[tuple[CoefficientType, int], tuple[float, float]] = {
    ("simple", 5): (0.67, 1.14),  # measured [0.6818, 1.1344]
    ("quintic", 5): (0.97, 1.04),  # measured [0.9778, 1.0318]
    ("polar_express", 5): (0.86, 1.13),  # measured [0.8704, 1.1236]
    ("polar_express", 8): (0.99, 1.01),  # measured [1.0000, 1.0000]
    ("cans", 5): (0.87, 1.13),  # measured [0.8844, 1.1198]
    ("aol", 4): (0.98, 1.02),  # measured [0.9874, 1.0117]
    ("aol", 5): (-0.65, -0.51),  # measured [-0.6412, -0.5234]
    ("deepseekv4", 5): (0.67, 1.14),  # measured [0.6818, 1.1344]
    ("deepseekv4", 10): (0.99, 1.01),  # measured [1.0000, 1.0005]
}


@pytest.mark.parametrize("variant", KEPT_VARIANTS)
@pytest.mark.parametrize(("coefficient_type", "steps"), list(BANDS), ids=str)
def test_output_is_u_s_vt_with_s_in_the_band(coefficient_type: CoefficientType, steps: int, variant: str) -> None:
    for x in (torch.randn(4, 64, 256), torch.randn(4, 256, 64), torch.randn(33, 65)):
        out = newton_schulz(x, steps=steps, coefficient_type=coefficient_type, variant=variant).double()  # type: ignore[arg-type]
        u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
        s_out = (u.mT @ out @ vh.mT).diagonal(dim1=-2, dim2=-1)
        # Out lies in span(U, V) with U's and V's directions: float32 noise only (measured < 1e-5).
        residual = torch.linalg.matrix_norm(out - u @ torch.diag_embed(s_out) @ vh, ord=2)
        assert residual.max() < 1e-4
        low, high = BANDS[(coefficient_type, steps)]
        assert low <= s_out.min() and s_out.max() <= high, (s_out.min().item(), s_out.max().item())


def ill_conditioned(kind: str, rows: int, cols: int) -> torch.Tensor:
    u, _ = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, rows, dtype=torch.float64))
    if kind == "log-spaced":
        s = torch.logspace(0, -8, rows, dtype=torch.float64)
    else:  # rank-deficient: half the singular values are zero
        s = torch.cat([torch.rand(rows - rows // 2, dtype=torch.float64) + 0.5, torch.zeros(rows // 2, dtype=torch.float64)])
    return ((u * s) @ v.T).float()


@pytest.mark.parametrize("steps", [5, 10])
@pytest.mark.parametrize("coefficient_type", SETS)
def test_gram_stays_stable_on_ill_conditioned_inputs(coefficient_type: CoefficientType, steps: int) -> None:
    """Gram squares the condition number; restarts keep it as accurate as the standard loop."""
    for kind in ("log-spaced", "rank-deficient"):
        x = ill_conditioned(kind, 64, 256)
        reference = svd_reference(x, coefficient_type, steps)
        for variant in KEPT_VARIANTS:
            out = newton_schulz(x, steps=steps, coefficient_type=coefficient_type, variant=variant)  # type: ignore[arg-type]
            error = torch.linalg.matrix_norm(out.double() - reference, ord=2).item()
            # float32 resolves singular values down to ~1e-7 of the largest (standard) or ~2e-4
            # (gram, through X Xᵀ); the polynomial's slope at 0 (the product of the a_k, up to
            # ~1e3) lifts that noise. Measured worst: standard 5.0e-3, gram 3.9e-3 (at 10 steps);
            # gram without restarts reached 1e12.
            assert error < 1e-2, (kind, variant, error)


def test_float64_input_is_computed_in_float64() -> None:
    x = torch.randn(2, 33, 65, dtype=torch.float64)
    for variant in KEPT_VARIANTS:
        out = newton_schulz(x, variant=variant)  # type: ignore[arg-type]
        assert out.dtype == torch.float64
        # float64 rounding (1e-16) amplified by ~1e3 at most; float32 would miss this by 1e6.
        torch.testing.assert_close(out, svd_reference(x, "quintic", 5), atol=1e-11, rtol=1e-11)


def test_low_precision_input_keeps_its_dtype_and_is_computed_in_float32() -> None:
    x = torch.randn(33, 65).to(torch.bfloat16)
    out = newton_schulz(x)
    assert out.dtype == torch.bfloat16
    # The float32 result rounded once to bf16: exact.
    torch.testing.assert_close(out, newton_schulz(x.float()).to(torch.bfloat16), atol=0, rtol=0)


# ---- normalisation, batching, transposition -------------------------------------------------


@pytest.mark.parametrize("scale", [1e-20, 1e-30, 1e20])
def test_tiny_and_huge_inputs_are_orthogonalised(scale: float) -> None:
    x = torch.randn(3, 33, 65)
    for variant in KEPT_VARIANTS:
        # x * scale rounds each entry once (2**-24 relative); measured difference 6e-7.
        expected = newton_schulz(x, variant=variant)  # type: ignore[arg-type]
        torch.testing.assert_close(newton_schulz(x * scale, variant=variant), expected, atol=1e-5, rtol=1e-5)  # type: ignore[arg-type]


def test_upstream_leaves_tiny_inputs_unnormalised() -> None:
    """Why we differ: upstream divides by max(‖x‖_F, eps), so a 1e-20 gradient stays near zero."""
    out = _emerging.newton_schulz(torch.randn(33, 65) * 1e-20, steps=5, coefficient_type="quintic")
    assert out.abs().max() < 1e-6


@pytest.mark.parametrize("variant", KEPT_VARIANTS)
def test_batched_equals_per_matrix(variant: str) -> None:
    x = torch.randn(2, 3, 33, 65)
    out = newton_schulz(x, variant=variant)  # type: ignore[arg-type]
    per_matrix = torch.stack([newton_schulz(m, variant=variant) for m in x.reshape(-1, 33, 65)])  # type: ignore[arg-type]
    # The same products per matrix; a BLAS may still block a batch differently: 1 ulp-level slack.
    torch.testing.assert_close(out, per_matrix.reshape(x.shape), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", KEPT_VARIANTS)
def test_tall_matrices_are_transposed(variant: str) -> None:
    wide = torch.randn(3, 33, 65)
    # A tall view of the same storage runs exactly the wide computation, then transposes back.
    expected = newton_schulz(wide, variant=variant).mT  # type: ignore[arg-type]
    torch.testing.assert_close(newton_schulz(wide.mT, variant=variant), expected, atol=0, rtol=0)  # type: ignore[arg-type]
    # and it costs the FLOPs of iterating on the 33×33 Gram matrix, not the 65×65 one.
    tall = wide.mT.contiguous()
    assert flops_of(x=tall, variant=variant) == newton_schulz_flops(65, 33, steps=5, variant=variant, batch=3)  # type: ignore[arg-type]
    assert newton_schulz_flops(65, 33, steps=5, variant="standard") < 5 * (4 * 65 * 65 * 33 + 2 * 65**3)


@pytest.mark.parametrize("variant", KEPT_VARIANTS)
@pytest.mark.parametrize("matmul_precision", ["highest", "medium"])
def test_zero_matrix_gives_zeros(variant: str, matmul_precision: str) -> None:
    x = torch.randn(3, 16, 24)
    x[1] = 0
    out = newton_schulz(x, variant=variant, matmul_precision=matmul_precision)  # type: ignore[arg-type]
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros(16, 24))
    torch.testing.assert_close(out[0], newton_schulz(x[0], variant=variant), atol=1e-6, rtol=1e-6)  # type: ignore[arg-type]


def test_input_is_not_modified_and_empty_input_is_returned() -> None:
    x = torch.randn(33, 65)
    before = x.clone()
    newton_schulz(x)
    assert torch.equal(x, before)
    assert newton_schulz(torch.empty(0, 4, 6)).shape == (0, 4, 6)


# ---- variants and FLOPs ---------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (3, 20, 20)], ids=str)
def test_flop_count_matches_torch_flop_counter(shape: tuple[int, ...], steps: int) -> None:
    batch = shape[0] if len(shape) == 3 else 1
    for variant in KEPT_VARIANTS:
        counted = flops_of(x=torch.randn(shape), steps=steps, variant=variant)
        assert counted == newton_schulz_flops(*shape[-2:], steps=steps, variant=variant, batch=batch)  # type: ignore[arg-type]


def test_auto_picks_gram_only_for_wide_float32_matrices() -> None:
    def picked(shape: tuple[int, int], **kwargs: Any) -> str:
        counted = flops_of(x=torch.randn(shape), **kwargs)
        by_variant = {v: newton_schulz_flops(*shape, steps=5, variant=v) for v in ("standard", "gram")}  # type: ignore[arg-type]
        assert by_variant["standard"] != by_variant["gram"]
        return next(v for v, f in by_variant.items() if f == counted)

    assert picked((16, 64)) == "gram"  # 4:1 — fewer FLOPs
    assert picked((64, 16)) == "gram"
    assert picked((32, 32)) == "standard"  # square — gram costs more
    assert picked((16, 64), matmul_precision="high") == "standard"  # TF32 is too coarse for X Xᵀ
    assert picked((16, 64), matmul_precision="medium") == "gram"  # on CPU: float32 at 'highest'


def test_symmetric_blocks_at_their_default_threshold_equal_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the default threshold, not the fixture's
    assert ns.SYMMETRIC_BLOCKS_MIN_ROWS == 1024
    x = torch.randn(1100, 1024, generator=torch.Generator().manual_seed(0))
    expected = _emerging.newton_schulz(x, steps=5, coefficient_type="quintic")
    for variant in KEPT_VARIANTS:
        assert flops_of(x=x, variant=variant) == newton_schulz_flops(1100, 1024, steps=5, variant=variant)  # type: ignore[arg-type]
        assert newton_schulz_flops(1100, 1024, steps=5, variant=variant) < 0.9 * ns_flops_dense(1100, 1024, variant)
        torch.testing.assert_close(newton_schulz(x, variant=variant), expected, **UPSTREAM_TOLERANCE)  # type: ignore[arg-type]


def ns_flops_dense(rows: int, cols: int, variant: str) -> int:
    m, n = min(rows, cols), max(rows, cols)
    if variant == "standard":
        return 5 * (4 * m * m * n + 2 * m**3)
    return (4 * m * m * n + 9 * 2 * m**3) + (4 * m * m * n + 5 * 2 * m**3)  # segments of 3 and 2 steps


# ---- precision rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "fast_bf16", "expected_dtype", "expected_precision"),
    [
        ("highest", False, torch.float32, "highest"),
        ("high", False, torch.float32, "high"),
        ("medium", False, torch.float32, "highest"),  # CPU: no bf16 path
        ("highest", True, torch.float32, "highest"),
        ("high", True, torch.float32, "high"),
        ("medium", True, torch.bfloat16, "medium"),  # upstream's explicit bf16 cast
    ],
)
def test_matmul_precision_rule(
    requested: str,
    fast_bf16: bool,
    expected_dtype: torch.dtype,
    expected_precision: str,
    monkeypatch: pytest.MonkeyPatch,
    symmetric_blocks: str,
) -> None:
    seen: list[tuple[torch.dtype, str, bool]] = []
    standard_loop = ns._standard_loop

    def spy(X: torch.Tensor, schedule: Any, blocks: bool) -> torch.Tensor:
        seen.append((X.dtype, torch.get_float32_matmul_precision(), blocks))
        return standard_loop(X, schedule, blocks)

    monkeypatch.setattr(ns, "_standard_loop", spy)
    monkeypatch.setattr(ns, "has_fast_bf16_matmul", lambda device: fast_bf16)
    out = newton_schulz(torch.randn(8, 8), matmul_precision=requested, variant="standard")  # type: ignore[arg-type]
    # blocks round once more per product: never in bf16
    expected_blocks = symmetric_blocks == "symmetric-blocks" and expected_dtype != torch.bfloat16
    assert seen == [(expected_dtype, expected_precision, expected_blocks)]
    assert out.dtype == torch.float32
    assert torch.get_float32_matmul_precision() == "highest"  # restored


def test_medium_on_cpu_logs_once_at_debug_naming_device_and_setting(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25: ``medium`` is the default, so its float32 fallback on CPU is logged at DEBUG, not WARNING."""
    monkeypatch.setattr(ns, "_warned_device_types", set())
    x = torch.randn(16, 24)
    with caplog.at_level(logging.DEBUG, logger=ns._LOGGER.name):
        out = newton_schulz(x, matmul_precision="medium")
        newton_schulz(x, matmul_precision="medium")
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert re.search(r"matmul_precision='medium'.*device 'cpu'.*float32", caplog.records[0].getMessage())
    torch.testing.assert_close(out, newton_schulz(x, matmul_precision="highest"), atol=0, rtol=0)


def test_fast_bf16_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    has_fast_bf16_matmul.cache_clear()
    assert not has_fast_bf16_matmul(torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, fast in [((9, 0), True), ((8, 0), True), ((7, 5), False)]:
        has_fast_bf16_matmul.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert has_fast_bf16_matmul(torch.device("cuda", 0)) is fast
    has_fast_bf16_matmul.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU; the CPU tests above cover every path")
def test_cuda_matches_cpu() -> None:
    x = torch.randn(3, 64, 256)
    torch.testing.assert_close(newton_schulz(x.cuda()).cpu(), newton_schulz(x), **UPSTREAM_TOLERANCE)


# ---- bad arguments --------------------------------------------------------------------------

ALLOWED_SETS = r"\['simple', 'quintic', 'polar_express', 'cans', 'aol', 'deepseekv4'\]"


@pytest.mark.parametrize(
    ("x", "kwargs", "error", "message"),
    [
        ([[1.0]], {}, TypeError, r"^`x`: must be a tensor; got list; expected a float torch.Tensor$"),
        (torch.ones(2, 2, dtype=torch.int64), {}, TypeError, r"^`x`: must be a float tensor; got dtype torch.int64; expected float32"),
        (torch.ones(5), {}, ValueError, r"^`x`: needs a matrix or a batch of matrices; got shape \(5,\); expected \(\.\.\., rows, cols\)$"),
        (torch.ones(2, 2), {"steps": 0}, ValueError, r"^`steps`: must be at least 1; got 0; expected an integer >= 1$"),
        (torch.ones(2, 2), {"steps": 2.0}, TypeError, r"^`steps`: must be an int; got 2.0; expected an integer >= 1$"),
        (torch.ones(2, 2), {"steps": True}, TypeError, r"^`steps`: must be an int; got True"),
        (torch.ones(2, 2), {"coefficient_type": "custom"}, ValueError,
         rf"^`coefficient_type`: unknown value; got 'custom'; expected one of {ALLOWED_SETS}$"),
        (torch.ones(2, 2), {"matmul_precision": "low"}, ValueError,
         r"^`matmul_precision`: unknown value; got 'low'; expected one of \['highest', 'high', 'medium'\]$"),
        (torch.ones(2, 2), {"variant": "fast"}, ValueError, r"^`variant`: unknown value; got 'fast'; expected one of \['auto', 'standard', 'gram'\]$"),
        (torch.ones(2, 2), {"eps": 0.0}, ValueError, r"^`eps`: must be positive and finite; got 0.0; expected a float in \(0, inf\)$"),
        (torch.ones(2, 2), {"eps": float("nan")}, ValueError, r"^`eps`: must be positive and finite; got nan"),
        (torch.ones(2, 2), {"eps": float("inf")}, ValueError, r"^`eps`: must be positive and finite; got inf"),
        (torch.ones(2, 2), {"variant": "gram", "matmul_precision": "high"}, ValueError,
         (r"^`variant`: 'gram' squares the condition number .*; got matmul_precision='high' \(torch.float32\) on cpu; "
          r"expected variant='auto' or 'standard', or matmul_precision='highest'$")),
    ],
)  # fmt: skip
def test_bad_arguments_raise(x: Any, kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        newton_schulz(x, **kwargs)


def test_a_default_muon_run_on_cpu_logs_and_warns_nothing(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25: every CPU run logged the ``medium`` precision fallback at WARNING; the default
    config's run is now silent at INFO and above, and raises no Python warning."""
    import warnings

    from optzoo import OptimizerConfig, get_optimizer
    from optzoo.models import GPT, GPTConfig

    monkeypatch.setattr(ns, "_warned_device_types", set())  # as in a fresh process
    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=1, hidden_size=16, num_heads=2, vocab_size=32, max_seq_len=8))
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = get_optimizer(OptimizerConfig(optimizer="muon", lr=0.02), [model])
        model.loss(torch.randint(0, 32, (2, 9))).backward()
        optimizer.step()
    assert OptimizerConfig().muon_fp32_matmul_prec == "medium"  # the default this run took
    assert [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO] == []
    assert [str(w.message) for w in caught] == []
