"""Newton–Schulz orthogonalisation: a batched, device-agnostic engine for Muon-style optimizers.

For a matrix ``G`` (or a batch of same-shape matrices) with SVD ``G = U S Vᵀ``, the iteration
returns approximately ``U Vᵀ``: more exactly ``U f(S / ‖G‖_F) Vᵀ``, where ``f`` is the composition
of the odd quintics ``p_k(σ) = a_k σ + b_k σ³ + c_k σ⁵`` of the chosen coefficient set. With
``X₀ = G / ‖G‖_F`` (so every singular value is at most 1), each step is::

    A = X Xᵀ;   X ← a X + (b A + c A²) X

Tall matrices are transposed first so that ``X Xᵀ`` is the smaller Gram matrix. The coefficient
sets, their iteration modes and the step are those of emerging-optimizers 0.3.0
(``orthogonalized_optimizers/muon_utils.py``); :func:`newton_schulz` equals its ``newton_schulz``
within float32 rounding (tests/optimizers/test_newton_schulz.py).

Variants (same polynomial, different association of the products):

* ``standard``: the step above, ``steps · (4 m² n + 2 m³)`` matmul FLOPs for ``m ≤ n`` (dense).
* ``gram``: Gram Newton–Schulz (Zhang, Amsel, Chen, Dao 2026,
  https://dao-ailab.github.io/blog/2026/gram-newton-schulz/). ``X_k = Q_k X₀`` with ``Q_k`` a
  polynomial in ``R = X₀ X₀ᵀ``, so the loop can run on ``m × m`` matrices only:
  ``P = a I + b R + c R²;  Q ← Q P;  R ← P R P`` and finally ``X = Q X₀``. It pays off for wide
  matrices (``n > 1.5 m`` at 5 steps). Forming ``R`` squares the condition number, and spurious
  negative eigenvalues of ``R`` grow without bound over long loops: with no restart, 10 float32
  steps on ill-conditioned inputs gave errors of 1e12. We therefore restart (``X ← Q X``,
  ``R ← X Xᵀ``) every :data:`GRAM_RESTART_PERIOD` steps, and use the variant only for IEEE
  float32/float64 matmuls, never bf16 or TF32.
* ``auto`` (default): ``gram`` where it is allowed and needs fewer FLOPs
  (:func:`newton_schulz_flops`), else ``standard``.

Symmetric blocks (both variants, float32/float64, from :data:`SYMMETRIC_BLOCKS_MIN_ROWS` rows). Every ``m × m``
matrix the loops form (``X Xᵀ``, ``A²``, ``R``, ``P``, ``Q``) is symmetric, and any two of them
commute, so their products are symmetric too. torch exposes no SYRK, so we keep each as three
half-size blocks ``[[S₁₁, S₁₂], [S₁₂ᵀ, S₂₂]]``: a product then takes 6 of the 8 block products
and ``X Xᵀ`` 3 of 4, with no copies (the transposed block reaches the BLAS as a view). That is
3/4 of the ``m × m`` FLOPs. Measured on this project's 2-core CPU (float32, round-robin medians,
``benchmarks/bench_newton_schulz.py``): 0.86–0.92× the dense loop's time at 1024² and 2048²,
1.04–1.17× at 512² (hence the threshold); the result differs from the dense loop by rounding only.

Precision (``matmul_precision``, Megatron's ``muon_fp32_matmul_prec``). Upstream sets
``torch.set_float32_matmul_precision`` around the step and, under ``medium``, casts ``X`` to
bf16 for the whole loop. We apply the setting for the duration of the call, with one rule of
our own: **bf16 matmuls are used only on a device with fast low-precision matmul**
(:func:`has_fast_bf16_matmul`: CUDA compute capability ≥ 8.0, ROCm, XPU). Elsewhere, notably on
CPU, ``medium`` computes in IEEE float32 and logs that once per device type at DEBUG level
(``medium`` is Megatron's default, so this is the expected path of every CPU run, not a
problem to warn about). On CPU, bf16 buys
no speed and costs accuracy: a bf16 matmul ran at 0.6× float32 on an AVX512-BF16 Xeon (upstream's
bf16 loop 1.6× slower than its float32 one, benchmarks/bench_newton_schulz.py), and the issue
reports ~1 against ~150 GFLOP/s on other CPUs. ``high`` is passed to torch as is (TF32 on CUDA).

Deliberate deviations from upstream:

* Normalisation first divides by the max-abs entry, then by the Frobenius norm floored at
  ``eps``. Upstream divides by ``max(‖G‖_F, eps)`` in float32, so inputs with ``‖G‖_F < eps``
  (e.g. a gradient of 1e-20) come back unnormalised and near zero; ours are orthogonalised.
* Any float dtype is accepted (upstream: float32 only). float64 computes in float64; float16
  and bf16 compute in float32; the result has the input's dtype and shape. Any number of
  leading batch dimensions is accepted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from itertools import chain, cycle, islice, repeat
from typing import Any, Final, Literal, NamedTuple, get_args

import torch

from .._common import check_choice

__all__ = [
    "COEFFICIENT_SETS",
    "CoefficientType",
    "Coefficients",
    "GRAM_RESTART_PERIOD",
    "MatmulPrecision",
    "NewtonSchulzWarning",
    "REPEAT_LAST",
    "SYMMETRIC_BLOCKS_MIN_ROWS",
    "Variant",
    "coefficient_schedule",
    "has_fast_bf16_matmul",
    "schedule_problem",
    "newton_schulz",
    "newton_schulz_flops",
    "preserved_matmul_precision",
]

CoefficientType = Literal["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"]
"""Named coefficient sets; upstream's ``NSCoeffT`` without ``custom``."""
MatmulPrecision = Literal["highest", "high", "medium"]
"""Megatron's ``muon_fp32_matmul_prec``; upstream's ``FP32MatmulPrecT``."""
Variant = Literal["auto", "standard", "gram"]
"""Which association of the products to run; see the module docstring."""
Coefficients = tuple[float, float, float]

# Copied from emerging-optimizers 0.3.0, orthogonalized_optimizers/muon_utils.py `_COEFFICIENT_SETS`
# (a test asserts equality with the installed package); the original sources are cited there.
COEFFICIENT_SETS: Final[dict[CoefficientType, tuple[Coefficients, ...]]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),  # Jordan, https://kellerjordan.github.io/posts/muon/
    "quintic": (  # https://leloykun.github.io/ponder/muon-opt-coeffs/ via modded-nanogpt
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (  # arXiv:2505.16932, Algorithm 1, including its 1.01 safety factor
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "cans": (  # arXiv:2506.10935 (Remez + adaptive interval)
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "aol": (  # https://github.com/thib-s/flash-newton-schulz/blob/main/newton_schulz_triton.py#L511
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,  # DeepSeek-V4 report
}
REPEAT_LAST: Final[frozenset[CoefficientType]] = frozenset({"polar_express", "cans", "deepseekv4"})
"""Sets that repeat their last tuple when ``steps`` exceeds their length; the others cycle from the
first tuple (upstream ``newton_schulz``'s ``repeat_last_types``). Cycling is replicated as is, though
it maps singular values near 1 to about 0.1 (``quintic``, 6 steps) or -0.6 (``aol`` at 5 steps,
Megatron's default: a sign flip of the update); :func:`schedule_problem` says so, and
``OptimizerConfig`` and ``Muon`` warn (:class:`NewtonSchulzWarning`)."""
GRAM_RESTART_PERIOD: Final = 3
"""Gram steps between restarts. Measured on 256×1024 float32 inputs (Gaussian, log-spaced
spectra down to 1e-8, rank-deficient), every set, 2 to 10 steps, spectral-norm error against
float64: period 2 or 3 stays within 0.006 (the standard loop's worst was 0.004); period 4 reached
0.02; one restart after step 2 (the blog's default for 5 steps) reached 2e4 at 10 steps."""
SYMMETRIC_BLOCKS_MIN_ROWS = 1024
"""From this many rows (after transposing tall inputs) the loops keep their symmetric matrices as
blocks (:class:`_Symmetric`); below it, the half-size products lose more in BLAS efficiency than
the quarter of the FLOPs they save."""
_BF16_DEVICE_TYPES: Final = frozenset({"xpu"})
"""Device types (besides CUDA, checked by capability) with fast bf16 matmul."""

_LOGGER = logging.getLogger(__name__)
_warned_device_types: set[str] = set()


def coefficient_schedule(coefficient_type: CoefficientType, steps: int) -> tuple[Coefficients, ...]:
    """The ``(a, b, c)`` of each of ``steps`` iterations, in order (cycled or last-repeated).

    Example:
        >>> coefficient_schedule("cans", 6)[-2:] == (COEFFICIENT_SETS["cans"][-1],) * 2
        True
    """
    check_choice("`coefficient_type`", coefficient_type, get_args(CoefficientType))
    _check_steps(steps)
    sets = COEFFICIENT_SETS[coefficient_type]
    endless = chain(sets, repeat(sets[-1])) if coefficient_type in REPEAT_LAST else cycle(sets)
    return tuple(islice(endless, steps))


class NewtonSchulzWarning(UserWarning):
    """A coefficient set and step count whose iteration does not approach the orthogonal factor
    (:func:`schedule_problem`)."""


_PROBE_STEPS_LIMIT = 12
"""Step counts listed as fine (or not) in a problem's message."""
_PROBE_STEPS_MAX = 100
"""Step counts above this are not probed (``schedule_problem`` says ``None``)."""


def schedule_problem(coefficient_type: CoefficientType, steps: int) -> str | None:
    """What goes wrong with ``steps`` iterations of ``coefficient_type``, or ``None``.

    The iteration acts on each singular value σ ∈ (0, 1] of the Frobenius-normalised input alone, so
    its scalar map over σ ∈ [1e-3, 1] shows the problems: a negative output is a sign flip of the
    update along that direction (``aol`` at every step count: σ ≥ 0.885 at 1–4 steps, a nearly
    rank-1 gradient, and most of (0, 1) at 5–8), and outputs below 0.7 for all σ ≥ 0.1 are a
    collapse (``quintic`` at 6 and 7 steps, cycling back to its first tuples). Step counts above
    100 are not probed.

    Example:
        >>> schedule_problem("quintic", 5) is None
        True
        >>> print(schedule_problem("quintic", 6))
        maps singular values in [0.1, 1] to [0.06, 0.16] instead of about 1 (quintic has 5 coefficient tuples and cycles past them); steps without this problem: 1-5, 8-10
    """
    check_choice("`coefficient_type`", coefficient_type, get_args(CoefficientType))  # before the cache hashes it
    _check_steps(steps)
    if steps > _PROBE_STEPS_MAX:  # probing costs a pass per step; nobody runs this many on purpose
        return None
    return _schedule_problem(coefficient_type, steps)


@functools.cache
def _schedule_problem(coefficient_type: CoefficientType, steps: int) -> str | None:
    description = _scalar_map_problem(coefficient_type, steps)
    if description is None:
        return None
    sets = COEFFICIENT_SETS[coefficient_type]
    if coefficient_type not in REPEAT_LAST and steps > len(sets):
        description += f" ({coefficient_type} has {len(sets)} coefficient tuples and cycles past them)"
    fine = [n for n in range(1, _PROBE_STEPS_LIMIT + 1) if _scalar_map_problem(coefficient_type, n) is None]
    if fine:
        return f"{description}; steps without this problem: {_ranges(fine)}"
    return f"{description}; no step count up to {_PROBE_STEPS_LIMIT} avoids it: use quintic, polar_express or cans"


@functools.cache
def _scalar_map_problem(coefficient_type: CoefficientType, steps: int) -> str | None:
    sigma = torch.logspace(-3, 0, 3001, dtype=torch.float64)
    out = sigma.clone()
    for a, b, c in coefficient_schedule(coefficient_type, steps):
        square = out * out
        out = out * (a + square * (b + c * square))
    flipped = sigma[out < 0]
    if flipped.numel():
        low, high = flipped.min().item(), flipped.max().item()
        which = "a nearly rank-1 input" if low >= 0.5 else "the Frobenius-normalised input"
        return f"flips the sign of the update along singular values in [{low:.3g}, {high:.3g}] (of {which})"
    band = out[sigma >= 0.1]
    if band.max().item() < 0.7:
        return f"maps singular values in [0.1, 1] to [{band.min().item():.2f}, {band.max().item():.2f}] instead of about 1"
    return None


def _ranges(values: list[int]) -> str:
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


@functools.cache
def has_fast_bf16_matmul(device: torch.device) -> bool:
    """Whether bf16 matmuls on ``device`` beat float32 ones: Ampere+ CUDA, ROCm and XPU.

    CPUs are excluded (see the module docstring). CPUs with AMX tiles might qualify, but torch
    offers no public check for them and none was at hand to measure.
    """
    if device.type == "cuda":
        return torch.version.hip is not None or torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type in _BF16_DEVICE_TYPES


def newton_schulz_flops(
    rows: int, cols: int, *, steps: int, variant: Literal["standard", "gram"], batch: int = 1, bf16: bool = False
) -> int:
    """Matmul FLOPs (``2·m·n·k`` per product) of one call; elementwise work is not counted.

    Args:
        rows, cols: the matrix shape; it is transposed first when ``rows > cols``.
        steps: Newton–Schulz iterations.
        variant: ``standard`` or ``gram`` (restarting every :data:`GRAM_RESTART_PERIOD` steps).
        batch: number of matrices.
        bf16: whether the loop runs in bf16 (``matmul_precision="medium"`` on a fast-bf16 device),
            which keeps its products dense.

    Example:
        >>> newton_schulz_flops(2, 4, steps=1, variant="standard")  # X Xᵀ, A·A, B·X
        80
    """
    m, n = min(rows, cols), max(rows, cols)
    if _uses_symmetric_blocks(m, torch.bfloat16 if bf16 else torch.float32):  # 3 of 4 blocks
        h, k = m // 2, m - m // 2
        gram = 2 * n * (h * h + h * k + k * k)
        square = 2 * (h**3 + 2 * h * h * k + 2 * h * k * k + k**3)
    else:
        gram, square = 2 * m * m * n, 2 * m**3
    times_x = 2 * m * m * n
    if variant == "standard":  # X Xᵀ, A·A, B·X
        return batch * steps * (gram + square + times_x)
    full, last = divmod(steps, GRAM_RESTART_PERIOD)
    segments = [GRAM_RESTART_PERIOD] * full + ([last] if last else [])
    # per segment: R = X Xᵀ and X = Q X, plus L squares, L-1 products Q·P and L-1 updates P R P
    return batch * sum(gram + times_x + (4 * length - 3) * square for length in segments)


def newton_schulz(
    x: torch.Tensor,
    *,
    steps: int = 5,
    coefficient_type: CoefficientType = "quintic",
    eps: float = 1e-7,
    matmul_precision: MatmulPrecision = "highest",
    variant: Variant = "auto",
) -> torch.Tensor:
    """Orthogonalise a matrix or a batch of same-shape matrices: ``G = U S Vᵀ ↦ ≈ U Vᵀ``.

    See the module docstring for the update rule, the variants and the precision rule.

    Args:
        x: ``(..., rows, cols)``, any float dtype; leading dimensions are a batch. Not modified.
        steps: iterations (default 5, Megatron's ``muon_num_ns_steps``); past the end of the
            set's coefficients the schedule cycles or repeats the last (:data:`REPEAT_LAST`).
        coefficient_type: which :data:`COEFFICIENT_SETS` entry (default ``quintic``, Megatron's).
        eps: floor of the Frobenius norm of ``x / max|x|``. That norm is at least 1 for any
            non-zero ``x``, so ``eps`` only keeps the zero matrix at zero (default 1e-7, upstream's).
        matmul_precision: ``highest`` (default: IEEE float32, torch's own default), ``high``
            (torch's ``high``: TF32 on CUDA) or ``medium`` (bf16 where :func:`has_fast_bf16_matmul`,
            else float32, logged once at DEBUG).
        variant: ``auto`` (default), ``standard`` or ``gram``.

    Returns:
        The orthogonalised tensor, with ``x``'s shape, dtype and device.

    Raises:
        TypeError: ``x`` is not a float tensor, or ``steps`` not an int.
        ValueError: ``x`` has fewer than 2 dimensions, an argument is out of range or unknown, or
            ``variant="gram"`` is asked for bf16 or TF32 matmuls.

    Example:
        >>> g = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(0))
        >>> s = torch.linalg.svdvals(newton_schulz(g, coefficient_type="quintic"))
        >>> bool(((s > 0.97) & (s < 1.04)).all())
        True
    """
    _check_tensor(x)
    schedule = coefficient_schedule(coefficient_type, steps)
    check_choice("`matmul_precision`", matmul_precision, get_args(MatmulPrecision))
    check_choice("`variant`", variant, get_args(Variant))
    if not eps > 0 or eps == float("inf"):
        raise ValueError(f"`eps`: must be positive and finite; got {eps!r}; expected a float in (0, inf)")

    compute_dtype, precision = _compute_dtype_and_precision(x, matmul_precision)
    rows, cols = x.shape[-2:]
    use_gram = _use_gram(variant, compute_dtype, precision, rows, cols, steps, x.device)
    if x.numel() == 0:
        return x.clone()

    X = x.reshape(-1, rows, cols)
    transpose = rows > cols
    if transpose:
        X = X.mT  # iterate on the smaller Gram matrix
    X = _normalize(X.to(torch.float64 if x.dtype == torch.float64 else torch.float32), eps).to(compute_dtype)
    with _float32_matmul_precision(precision):
        blocks = _uses_symmetric_blocks(X.size(-2), compute_dtype)
        X = _gram_loop(X, schedule, blocks) if use_gram else _standard_loop(X, schedule, blocks)
    if transpose:
        X = X.mT
    return X.to(x.dtype).reshape(x.shape)


def _normalize(X: torch.Tensor, eps: float) -> torch.Tensor:
    """``X / ‖X‖_F`` per matrix, safe from underflow: divide by the max-abs entry first."""
    amax: torch.Tensor = torch.linalg.vector_norm(X, ord=float("inf"), dim=(-2, -1), keepdim=True)
    Y = X / amax.masked_fill(amax == 0, 1.0)  # division, not a reciprocal: 1/amax may overflow
    norm: torch.Tensor = torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True)
    return Y.div_(norm.clamp_min(eps))


def _uses_symmetric_blocks(rows: int, compute_dtype: torch.dtype) -> bool:
    """Blocks round each block product to the loop's dtype before summing the next into it: one
    rounding more, harmless in float32 but not in bf16 (measured 0.15 off upstream's bf16 loop)."""
    return rows >= SYMMETRIC_BLOCKS_MIN_ROWS and compute_dtype != torch.bfloat16


def _standard_loop(X: torch.Tensor, schedule: tuple[Coefficients, ...], blocks: bool) -> torch.Tensor:
    """``A = X Xᵀ;  X ← a X + (b A + c A²) X`` for each ``(a, b, c)`` (upstream's step)."""
    if blocks:
        return _standard_loop_blocked(X, schedule)
    for a, b, c in schedule:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def _gram_loop(X: torch.Tensor, schedule: tuple[Coefficients, ...], blocks: bool) -> torch.Tensor:
    """Gram Newton–Schulz, restarted every :data:`GRAM_RESTART_PERIOD` steps."""
    segment = _gram_segment_blocked if blocks else _gram_segment
    for start in range(0, len(schedule), GRAM_RESTART_PERIOD):
        X = segment(X, schedule[start : start + GRAM_RESTART_PERIOD])
    return X


def _gram_segment(X: torch.Tensor, schedule: tuple[Coefficients, ...]) -> torch.Tensor:
    """``R = X Xᵀ;  P = a I + b R + c R²;  Q ← Q P;  R ← P R P;``  then ``Q X``.

    Every ``P`` and ``R`` is a polynomial in ``X Xᵀ``, so they commute and ``(Q X)(Q X)ᵀ = R``:
    the result equals ``len(schedule)`` standard steps.
    """
    R = X @ X.mT
    Q: torch.Tensor | None = None
    for index, (a, b, c) in enumerate(schedule):
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else Q @ P
        if index < len(schedule) - 1:
            R = P @ (R @ P)
    assert Q is not None  # schedule is never empty
    return Q @ X


class _Symmetric(NamedTuple):
    """A batch of symmetric matrices ``[[top_left, top_right], [top_rightᵀ, bottom_right]]``.

    Every ``m × m`` matrix of the loops is symmetric, and so is every product of two of them (they
    are polynomials in ``X Xᵀ`` and commute). Kept as three blocks, such a product needs 6 of the 8
    half-size block products and no copies: ``Xᵀ`` blocks reach the BLAS as transposed views.
    """

    top_left: torch.Tensor
    top_right: torch.Tensor
    bottom_right: torch.Tensor

    @staticmethod
    def gram(X: torch.Tensor) -> _Symmetric:
        """``X Xᵀ`` in 3 of its 4 blocks."""
        upper, lower = _row_halves(X)
        return _Symmetric(upper @ upper.mT, upper @ lower.mT, lower @ lower.mT)

    def __matmul__(self, other: _Symmetric) -> _Symmetric:
        """The product with a commuting symmetric matrix (so the product is symmetric too)."""
        a11, a12, a22 = self
        b11, b12, b22 = other
        return _Symmetric(
            _accumulate(a11 @ b11, a12, b12.mT),
            _accumulate(a11 @ b12, a12, b22),
            _accumulate(a22 @ b22, a12.mT, b12),
        )

    def polynomial(self, square: _Symmetric, a: float, b: float, c: float) -> _Symmetric:
        """``a I + b S + c S²`` given ``S² = square``; consumes ``square``'s storage."""
        p11, p12, p22 = (s2.mul_(c).add_(s, alpha=b) for s2, s in zip(square, self, strict=True))
        p11.diagonal(dim1=-2, dim2=-1).add_(a)
        p22.diagonal(dim1=-2, dim2=-1).add_(a)
        return _Symmetric(p11, p12, p22)

    def times(self, X: torch.Tensor, *, plus: float = 0.0) -> torch.Tensor:
        """``S X + plus · X`` for a dense ``X``."""
        s11, s12, s22 = self
        upper, lower = _row_halves(X)
        return torch.cat(
            [_accumulate(torch.baddbmm(upper, s11, upper, beta=plus), s12, lower),
             _accumulate(torch.baddbmm(lower, s22, lower, beta=plus), s12.mT, upper)],
            dim=-2,
        )  # fmt: skip


def _accumulate(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``total += left @ right`` in place (``out=`` rather than ``baddbmm_``, which torch's
    ``FlopCounterMode`` does not count and our tests and benchmarks count with it)."""
    return torch.baddbmm(total, left, right, out=total)


def _row_halves(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = X.size(-2) // 2
    return X[..., :half, :], X[..., half:, :]


def _standard_loop_blocked(X: torch.Tensor, schedule: tuple[Coefficients, ...]) -> torch.Tensor:
    """:func:`_standard_loop` with ``A`` and ``b A + c A²`` kept as :class:`_Symmetric` blocks."""
    for a, b, c in schedule:
        A = _Symmetric.gram(X)
        X = A.polynomial(A @ A, 0.0, b, c).times(X, plus=a)
    return X


def _gram_segment_blocked(X: torch.Tensor, schedule: tuple[Coefficients, ...]) -> torch.Tensor:
    """:func:`_gram_segment` with every ``m × m`` matrix kept as :class:`_Symmetric` blocks."""
    R = _Symmetric.gram(X)
    Q: _Symmetric | None = None
    for index, (a, b, c) in enumerate(schedule):
        P = R.polynomial(R @ R, a, b, c)
        Q = P if Q is None else Q @ P
        if index < len(schedule) - 1:
            R = P @ (R @ P)
    assert Q is not None  # schedule is never empty
    return Q.times(X)


def _compute_dtype_and_precision(x: torch.Tensor, requested: MatmulPrecision) -> tuple[torch.dtype, MatmulPrecision]:
    """The dtype the loop runs in and the float32 matmul precision it runs under."""
    if x.dtype == torch.float64:
        return torch.float64, requested
    if requested != "medium":
        return torch.float32, requested
    if has_fast_bf16_matmul(x.device):
        return torch.bfloat16, requested
    if x.device.type not in _warned_device_types:
        _warned_device_types.add(x.device.type)
        _LOGGER.debug(  # the default setting's expected path on CPU: nothing to warn about
            "newton_schulz: matmul_precision='medium' asks for bf16 matmuls, which gain no speed "
            "on device '%s'; computing in float32 at 'highest' instead (logged once per device type)",
            x.device.type,
        )
    return torch.float32, "highest"


def _use_gram(
    variant: Variant, dtype: torch.dtype, precision: MatmulPrecision, rows: int, cols: int, steps: int, device: torch.device
) -> bool:
    allowed = dtype == torch.float64 or (dtype == torch.float32 and precision == "highest")
    if variant == "gram" and not allowed:
        raise ValueError(
            f"`variant`: 'gram' squares the condition number and needs IEEE float32 matmuls; "
            f"got matmul_precision={precision!r} ({dtype}) on {device.type}; "
            f"expected variant='auto' or 'standard', or matmul_precision='highest'"
        )
    if variant != "auto":
        return variant == "gram"
    flops = {v: newton_schulz_flops(rows, cols, steps=steps, variant=v) for v in ("standard", "gram")}
    return allowed and flops["gram"] < flops["standard"]


PrecisionFlags = tuple[str, str | None, str | None]


def _precision_flags() -> PrecisionFlags:
    """torch's float32 matmul settings: the legacy precision and the per-backend flags it writes."""

    def flag(backend: Any) -> str | None:
        try:
            return str(backend.fp32_precision)
        except (AttributeError, RuntimeError):  # torch before the per-backend API
            return None

    return torch.get_float32_matmul_precision(), flag(torch.backends.cuda.matmul), flag(getattr(torch.backends.mkldnn, "matmul", None))


def _restore_precision_flags(saved: PrecisionFlags) -> None:
    legacy, cuda_matmul, mkldnn_matmul = saved
    if torch.get_float32_matmul_precision() != legacy:
        torch.set_float32_matmul_precision(legacy)
    # Setting the legacy value also writes the per-backend flags (an unset "none" comes back as
    # "ieee"), so those are put back one by one.
    now = _precision_flags()
    if cuda_matmul is not None and now[1] != cuda_matmul:
        torch.backends.cuda.matmul.fp32_precision = cuda_matmul
    if mkldnn_matmul is not None and now[2] != mkldnn_matmul:
        torch.backends.mkldnn.matmul.fp32_precision = mkldnn_matmul  # type: ignore[attr-defined]  # set at runtime


@contextlib.contextmanager
def preserved_matmul_precision() -> Iterator[None]:
    """Leave torch's float32 matmul settings exactly as found, whatever the block sets.

    Upstream's optimizers restore ``torch.set_float32_matmul_precision(previous)``, which turns
    unset per-backend flags (``torch.backends.cuda.matmul.fp32_precision == "none"``) into set ones;
    a step must leave global settings as it found them.
    """
    saved = _precision_flags()
    try:
        yield
    finally:
        _restore_precision_flags(saved)


@contextlib.contextmanager
def _float32_matmul_precision(precision: MatmulPrecision) -> Iterator[None]:
    """Set ``torch.set_float32_matmul_precision`` for the block, as upstream's optimizer does, and
    leave every float32 matmul setting as found afterwards (:func:`preserved_matmul_precision`).

    The setting is process-wide, so concurrent threads see it too (upstream shares this).
    """
    if torch.get_float32_matmul_precision() == precision:
        yield
        return
    with preserved_matmul_precision():
        torch.set_float32_matmul_precision(precision)
        yield


def _check_tensor(x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`x`: must be a tensor; got {type(x).__name__}; expected a float torch.Tensor")
    if not x.is_floating_point():
        raise TypeError(f"`x`: must be a float tensor; got dtype {x.dtype}; expected float32, float64, bfloat16 or float16")
    if x.ndim < 2:
        raise ValueError(
            f"`x`: needs a matrix or a batch of matrices; got shape {tuple(x.shape)}; expected (..., rows, cols)"
        )


def _check_steps(steps: object) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"`steps`: must be an int; got {steps!r}; expected an integer >= 1")
    if steps < 1:
        raise ValueError(f"`steps`: must be at least 1; got {steps}; expected an integer >= 1")
