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

Precision (``matmul_precision``, Megatron's ``muon_fp32_matmul_prec``) is a ceiling: the loop
precisions it allows are :data:`LOOP_PRECISIONS` (``highest``: IEEE; ``high``: also TF32; ``medium``:
also a bf16 loop). ``loop_precision`` picks one; each call sets torch's float32 matmul precision for
its duration and leaves every flag as found. Muon passes the kernel its probe measured fastest on
this machine (:mod:`optzoo.optimizers.newton_schulz_probe`): whether bf16 pays off depends on the
machine (a bf16 matmul ran at 0.6× float32 on an AVX512-BF16 Xeon and 2.1× on an AMD EPYC with
``avx512_bf16``). ``loop_precision=None`` keeps the old rule, **bf16 only on a device with fast
low-precision matmul** (:func:`has_fast_bf16_matmul`: CUDA compute capability ≥ 8.0, ROCm, XPU);
elsewhere ``medium`` computes in IEEE float32 and logs that once per device type at DEBUG level.
``high`` is passed to torch as is (TF32 on CUDA).

On tensor-parallel shards, :func:`newton_schulz_sharded` runs the same loop with all-reduced Grams
(Megatron-Core's ``muon_tp_mode="distributed"``, upstream's ``newton_schulz_tp``), and
:func:`newton_schulz_sharded_cost` gives its FLOPs and all-reduced bytes per rank.

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
import math
from collections.abc import Callable, Iterator, Sequence
from itertools import chain, cycle, islice, repeat
from typing import Any, Final, Literal, NamedTuple, get_args

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._common import check_choice

__all__ = [
    "COEFFICIENT_SETS",
    "CoefficientType",
    "Coefficients",
    "GRAM_RESTART_PERIOD",
    "LOOP_PRECISIONS",
    "LoopPrecision",
    "MatmulPrecision",
    "NewtonSchulzWarning",
    "REPEAT_LAST",
    "SYMMETRIC_BLOCKS_MIN_ROWS",
    "ShardDim",
    "ShardedNewtonSchulzCost",
    "Variant",
    "coefficient_schedule",
    "has_fast_bf16_matmul",
    "schedule_problem",
    "newton_schulz",
    "newton_schulz_flops",
    "newton_schulz_sharded",
    "newton_schulz_sharded_cost",
    "orthogonality_error",
    "preserved_matmul_precision",
]

CoefficientType = Literal["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4"]
"""Named coefficient sets; upstream's ``NSCoeffT`` without ``custom``."""
MatmulPrecision = Literal["highest", "high", "medium"]
"""Megatron's ``muon_fp32_matmul_prec``; upstream's ``FP32MatmulPrecT``."""
LoopPrecision = Literal["ieee", "tf32", "bf16"]
"""What the loop's matmuls actually run at: IEEE float32 (float64 for float64 inputs), torch's
``high`` float32 precision (TF32 on CUDA), or a bf16 loop (upstream's ``medium``)."""
LOOP_PRECISIONS: Final[dict[str, tuple[LoopPrecision, ...]]] = {
    "highest": ("ieee",),
    "high": ("ieee", "tf32"),
    "medium": ("ieee", "tf32", "bf16"),
}
"""The loop precisions each ``matmul_precision`` (Megatron's ``muon_fp32_matmul_prec``) allows: the
setting is a ceiling on how coarse the matmuls may be, never a demand for the coarse ones."""
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
    return batch * _loop_flops(m, n, steps, variant, _uses_symmetric_blocks(m, torch.bfloat16 if bf16 else torch.float32))


def _loop_flops(m: int, n: int, steps: int, variant: Literal["standard", "gram"], blocks: bool) -> int:
    """Matmul FLOPs of one matrix's loop on ``X`` of shape ``m × n`` (its Gram ``X Xᵀ`` is ``m × m``)."""
    if blocks:  # 3 of 4 blocks
        h, k = m // 2, m - m // 2
        gram = 2 * n * (h * h + h * k + k * k)
        square = 2 * (h**3 + 2 * h * h * k + 2 * h * k * k + k**3)
    else:
        gram, square = 2 * m * m * n, 2 * m**3
    times_x = 2 * m * m * n
    if variant == "standard":  # X Xᵀ, A·A, B·X
        return steps * (gram + square + times_x)
    # per segment: R = X Xᵀ and X = Q X, plus L squares, L-1 products Q·P and L-1 updates P R P
    return sum(gram + times_x + (4 * length - 3) * square for length in _gram_segments(steps))


def _gram_segments(steps: int) -> list[int]:
    """The steps of each restart segment of the Gram loop."""
    full, last = divmod(steps, GRAM_RESTART_PERIOD)
    return [GRAM_RESTART_PERIOD] * full + ([last] if last else [])


def newton_schulz(
    x: torch.Tensor,
    *,
    steps: int = 5,
    coefficient_type: CoefficientType = "quintic",
    eps: float = 1e-7,
    matmul_precision: MatmulPrecision = "highest",
    variant: Variant = "auto",
    loop_precision: LoopPrecision | None = None,
    symmetric_blocks: bool | None = None,
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
        loop_precision: what the matmuls run at (:data:`LoopPrecision`), one of
            ``LOOP_PRECISIONS[matmul_precision]``; ``None`` (default): the device-type rule above.
            float64 inputs compute in float64 whatever it says. Muon passes the probe's choice
            (:mod:`optzoo.optimizers.newton_schulz_probe`).
        symmetric_blocks: keep the ``m × m`` matrices as symmetric blocks (``True``) or dense
            (``False``); ``None`` (default): from :data:`SYMMETRIC_BLOCKS_MIN_ROWS` rows. Never in
            a bf16 loop.

    Returns:
        The orthogonalised tensor, with ``x``'s shape, dtype and device.

    Raises:
        TypeError: ``x`` is not a float tensor, or ``steps`` not an int.
        ValueError: ``x`` has fewer than 2 dimensions, an argument is out of range or unknown,
            ``loop_precision`` is coarser than ``matmul_precision`` allows, or ``variant="gram"``
            is asked for bf16 or TF32 matmuls.

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
    _check_eps(eps)

    compute_dtype, precision = _compute_dtype_and_precision(x, matmul_precision, loop_precision)
    if symmetric_blocks and compute_dtype == torch.bfloat16:
        raise ValueError(
            "`symmetric_blocks`: blocks round each block product once more, too coarse in bf16; got True with a bf16 "
            "loop; expected None or False, or loop_precision='ieee' or 'tf32'"
        )
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
        blocks = _uses_symmetric_blocks(X.size(-2), compute_dtype) if symmetric_blocks is None else symmetric_blocks
        X = _gram_loop(X, schedule, blocks) if use_gram else _standard_loop(X, schedule, blocks)
    if transpose:
        X = X.mT
    return X.to(x.dtype).reshape(x.shape)


ShardDim = Literal[-2, -1, 0, 1]
"""Which matrix dim a TP shard splits: ``-2``/``0`` the rows, ``-1``/``1`` the columns (``0`` and
``1`` are Megatron's ``partition_dim`` of a 2-D weight; they name the matrix dims even for a batch)."""


class ShardedNewtonSchulzCost(NamedTuple):
    """What one call of :func:`newton_schulz_sharded` costs one rank."""

    flops: int
    """Matmul FLOPs on this rank (``2·m·n·k`` per product; elementwise work not counted)."""
    all_reduce_calls: int
    """``all_reduce`` calls: 2 for the normalisation, then one per Gram."""
    all_reduce_bytes: int
    """Bytes of the buffers this rank all-reduces, summed over the calls (a ring all-reduce sends and
    receives ``2·(p−1)/p`` of that per rank)."""


def newton_schulz_sharded(
    x_local: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    shard_dim: ShardDim,
    steps: int = 5,
    coefficient_type: CoefficientType = "quintic",
    eps: float = 1e-7,
    matmul_precision: MatmulPrecision = "highest",
    variant: Variant = "auto",
) -> torch.Tensor:
    """This rank's shard of :func:`newton_schulz` of a matrix split over ``group``, without gathering it.

    Megatron-Core's ``muon_tp_mode="distributed"`` (emerging-optimizers' ``newton_schulz_tp(...,
    tp_mode="distributed")``). The loop runs on the Gram matrix that contracts over the split dim,
    so each Gram is the sum of the ranks' local Grams: one ``all_reduce`` (SUM) of the whole batch's
    Grams per Gram, and every other product is local. Which Gram follows the split, as upstream's
    ``partition_dim`` rule does (``0``: transposed, Gram ``cols × cols``; ``1``: Gram ``rows × rows``),
    not the shape: when the *shorter* dim is split, the loop runs on the larger Gram (for a
    ``1024 × 4096`` matrix split along its rows, a ``4096 × 4096`` Gram instead of ``1024 × 1024``:
    the same result, with 64× the ``m³`` products and 16× the all-reduced bytes).

    Same math as :func:`newton_schulz`: max-abs then Frobenius normalisation with the ``eps`` floor
    (an ``all_reduce`` MAX, which also checks that the ranks agree on the unsplit dim, and one SUM
    of the squares), the same coefficient schedule, precision rule and symmetric blocks (their three blocks
    are all-reduced in one packed buffer, 3/4 of the Gram's bytes). The result equals
    :func:`newton_schulz` of the full matrix up to float rounding (the sums run in another order).
    ``variant="auto"`` takes ``gram`` where it is allowed and needs fewer FLOPs on the rank with
    the largest piece (each rank repeats the ``m³`` products), so it may pick ``standard`` where
    one process picks ``gram``; ``gram`` all-reduces one Gram per restart segment instead of one
    per step. Under ``medium`` on a fast-bf16 device the Grams are all-reduced in bf16, as upstream.

    All-reduces: ``2 + steps`` (``standard``) or ``2 + ⌈steps / 3⌉`` (``gram``), with one host
    sync after the first (the variant choice and the shape check read it); cost per rank:
    :func:`newton_schulz_sharded_cost`.

    Args:
        x_local: this rank's piece ``(..., rows_local, cols)`` or ``(..., rows, cols_local)`` of a
            batch of matrices; every rank of ``group`` holds one contiguous piece, in rank order
            (``torch.chunk``'s layout: uneven pieces and empty ones allowed). Not modified.
        group: the process group the matrices are split over (the TP group); every rank of it must
            make the same call. ``dist.group.WORLD`` for all ranks.
        shard_dim: the split dim: ``-2`` or ``0`` the rows, ``-1`` or ``1`` the columns.
        steps, coefficient_type, eps, matmul_precision, variant: as :func:`newton_schulz`.

    Returns:
        This rank's piece of the orthogonalised matrices, with ``x_local``'s shape, dtype and device.

    Raises:
        TypeError: ``x_local`` is not a float tensor (or is a DTensor: pass its ``to_local()``), or
            ``steps`` not an int.
        ValueError: ``group`` is ``None`` or not initialised, ``shard_dim`` is not a matrix dim, an
            argument is out of range (as :func:`newton_schulz`), or the ranks' pieces disagree on the
            unsplit dim (raised on every rank). Pieces with different batch shapes fail inside the
            first ``all_reduce`` (its buffer length differs), as any mismatched collective does.
    """
    _check_tensor(x_local, "x_local")
    if isinstance(x_local, DTensor):
        raise TypeError("`x_local`: must be this rank's local tensor; got a DTensor; expected x.to_local()")
    split = _check_shard_dim(shard_dim)
    schedule = coefficient_schedule(coefficient_type, steps)
    check_choice("`matmul_precision`", matmul_precision, get_args(MatmulPrecision))
    check_choice("`variant`", variant, get_args(Variant))
    _check_eps(eps)
    compute_dtype, precision = _compute_dtype_and_precision(x_local, matmul_precision)
    allowed = _gram_allowed(variant, compute_dtype, precision, x_local.device)
    _check_group(group)  # last: every other argument can be checked without a process group

    rows, cols = x_local.shape[-2:]
    batch = math.prod(x_local.shape[:-2])
    X = x_local.reshape(batch, rows, cols)  # not reshape(-1, ...): an empty piece has no elements
    if split == -2:
        X = X.mT  # the Gram that contracts over the split rows (upstream: partition_dim 0 transposes)
    m, n_local = X.shape[-2:]
    if batch == 0 or m == 0:  # every rank holds nothing: the unsplit dims are the same everywhere
        return x_local.clone()
    work_dtype = torch.float64 if x_local.dtype == torch.float64 else torch.float32
    X, n_max = _normalize_sharded(X.to(work_dtype), eps, group, "`x_local`")
    blocks = _uses_symmetric_blocks(m, compute_dtype)
    use_gram = _sharded_uses_gram(variant, allowed, m, n_max, steps, blocks)
    reduce = functools.partial(_all_reduce_packed, group=group)
    X = X.to(compute_dtype)
    with _float32_matmul_precision(precision):
        X = _gram_loop(X, schedule, blocks, reduce) if use_gram else _standard_loop(X, schedule, blocks, reduce)
    if split == -2:
        X = X.mT
    return X.to(x_local.dtype).reshape(x_local.shape)


def newton_schulz_sharded_cost(
    rows: int,
    cols: int,
    *,
    shard_dim: ShardDim,
    world_size: int,
    steps: int,
    variant: Variant = "auto",
    batch: int = 1,
    compute_dtype: torch.dtype = torch.float32,
    rank: int | None = None,
) -> ShardedNewtonSchulzCost:
    """FLOPs and all-reduced bytes of one :func:`newton_schulz_sharded` call, on one rank.

    With ``m`` the unsplit dim (the Gram's side) and ``n_r`` rank ``r``'s piece of the split dim, a
    ``standard`` step costs ``4·m²·n_r + 2·m³`` FLOPs (one process: ``4·m²·n + 2·m³``; the ``m³``
    square is repeated on every rank) and all-reduces ``m²`` elements per matrix in the loop's dtype
    (3/4 of that with symmetric blocks). The normalisation adds a float64 MAX of ``batch + 3`` and
    a SUM of ``batch`` values.

    Args:
        rows, cols: the full matrix shape.
        shard_dim: the split dim, as :func:`newton_schulz_sharded`.
        world_size: ranks in the group; pieces follow ``torch.chunk``.
        steps: Newton–Schulz iterations.
        variant: ``standard``, ``gram``, or ``auto`` (the kernel's choice for IEEE matmuls; pass
            ``standard`` for a TF32 run).
        batch: matrices per call.
        compute_dtype: the loop's dtype: float32, bfloat16 (``medium`` on a fast-bf16 device) or float64.
        rank: whose piece; ``None`` for the largest (rank 0's, the one the step waits for).

    Example:
        >>> newton_schulz_sharded_cost(64, 256, shard_dim=-1, world_size=4, steps=5, variant="standard")
        ShardedNewtonSchulzCost(flops=7864320, all_reduce_calls=7, all_reduce_bytes=81956)
    """
    split = _check_shard_dim(shard_dim)
    _check_steps(steps)
    check_choice("`variant`", variant, get_args(Variant))
    if compute_dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise ValueError(f"`compute_dtype`: not a loop dtype; got {compute_dtype}; expected torch.float32, torch.bfloat16 or torch.float64")
    if world_size < 1:
        raise ValueError(f"`world_size`: must be at least 1; got {world_size}; expected an integer >= 1")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"`rank`: out of range; got {rank}; expected None or 0 <= rank < {world_size}")
    m, n = (cols, rows) if split == -2 else (rows, cols)
    chunk = -(-n // world_size)
    n_max = min(n, chunk)
    n_local = n_max if rank is None else max(0, min(chunk, n - rank * chunk))
    blocks = _uses_symmetric_blocks(m, compute_dtype)
    allowed = compute_dtype in (torch.float32, torch.float64)
    use_gram = _sharded_uses_gram(variant, allowed, m, n_max, steps, blocks)
    grams = len(_gram_segments(steps)) if use_gram else steps
    h, k = m // 2, m - m // 2
    gram_elements = h * h + h * k + k * k if blocks else m * m
    work_size = 8 if compute_dtype == torch.float64 else 4
    nbytes = 8 * (batch + len(_SHAPE_FACTS)) + work_size * batch + grams * batch * gram_elements * compute_dtype.itemsize
    flops = batch * _loop_flops(m, n_local, steps, "gram" if use_gram else "standard", blocks)
    return ShardedNewtonSchulzCost(flops=flops, all_reduce_calls=2 + grams, all_reduce_bytes=nbytes)


_SHAPE_FACTS: Final = ("m", "-m", "n_local")
"""Appended to the normalisation's MAX all-reduce: the ranks' min and max of the unsplit matrix dim
(it must agree), and the largest piece (the variant choice must be the same on every rank). The
batch cannot be checked this way: it sets the buffer's length, so a mismatch fails in the collective."""


def _normalize_sharded(X: torch.Tensor, eps: float, group: dist.ProcessGroup, name: str) -> tuple[torch.Tensor, int]:
    """:func:`_normalize` of the matrices whose column pieces the ranks hold, and the largest piece."""
    batch, m, n_local = X.shape
    amax = torch.linalg.vector_norm(X, ord=float("inf"), dim=(-2, -1)) if n_local else X.new_zeros(batch)
    facts = torch.tensor([m, -m, n_local], dtype=torch.float64, device=X.device)
    buffer = torch.cat([amax.to(torch.float64), facts])  # float64 holds float32 amaxes and sizes exactly
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=group)
    m_max, m_min, n_max = buffer[batch:].tolist()
    if (m_max, -m_min) != (m, m):
        raise ValueError(
            f"{name}: the ranks' pieces disagree on the unsplit matrix dim; got {m} here, from {-m_min:.0f} to "
            f"{m_max:.0f} across `group`; expected every rank to hold the same matrices, split along `shard_dim` only"
        )
    amax = buffer[:batch].to(X.dtype).view(batch, 1, 1)
    Y = X / amax.masked_fill(amax == 0, 1.0)  # division, not a reciprocal: 1/amax may overflow
    squares = (Y * Y).sum(dim=(-2, -1))
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    return Y.div_(squares.sqrt().clamp_min(eps).view(batch, 1, 1)), int(n_max)


def _sharded_uses_gram(variant: Variant, allowed: bool, m: int, n_max: int, steps: int, blocks: bool) -> bool:
    if variant != "auto":
        return variant == "gram"
    return allowed and _loop_flops(m, n_max, steps, "gram", blocks) < _loop_flops(m, n_max, steps, "standard", blocks)


def _all_reduce_packed(tensors: Sequence[torch.Tensor], *, group: dist.ProcessGroup) -> None:
    """Sum ``tensors`` over ``group`` in place, in one ``all_reduce``."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        dist.all_reduce(tensors[0], op=dist.ReduceOp.SUM, group=group)
        return
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for tensor, piece in zip(tensors, torch.split(flat, [tensor.numel() for tensor in tensors]), strict=True):
        tensor.copy_(piece.view_as(tensor))


def _check_group(group: object) -> None:
    if group is None:
        raise ValueError(
            "`group`: a process group is required; got None; expected the group the matrices are split over "
            "(dist.group.WORLD for all ranks)"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"`group`: must be a torch.distributed.ProcessGroup; got {type(group).__name__}")
    if not dist.is_initialized():
        raise ValueError("`group`: torch.distributed is not initialised; got a group; expected dist.init_process_group() first")


def _check_shard_dim(shard_dim: object) -> Literal[-2, -1]:
    if isinstance(shard_dim, bool) or shard_dim not in (-2, -1, 0, 1):
        raise ValueError(
            f"`shard_dim`: not a matrix dim; got {shard_dim!r}; expected -2 or 0 (rows split) or -1 or 1 (columns split)"
        )
    return -2 if shard_dim in (-2, 0) else -1


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


_Reduce = Callable[[Sequence[torch.Tensor]], None]
"""Sums, in place and over the ranks holding the shards of ``X``, the pieces of a Gram ``X Xᵀ``
(:func:`newton_schulz_sharded`); ``None`` on one process."""


def _standard_loop(X: torch.Tensor, schedule: tuple[Coefficients, ...], blocks: bool, reduce: _Reduce | None = None) -> torch.Tensor:
    """``A = X Xᵀ;  X ← a X + (b A + c A²) X`` for each ``(a, b, c)`` (upstream's step)."""
    if blocks:
        return _standard_loop_blocked(X, schedule, reduce)
    for a, b, c in schedule:
        A = X @ X.mT
        if reduce is not None:
            reduce([A])
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def _gram_loop(X: torch.Tensor, schedule: tuple[Coefficients, ...], blocks: bool, reduce: _Reduce | None = None) -> torch.Tensor:
    """Gram Newton–Schulz, restarted every :data:`GRAM_RESTART_PERIOD` steps."""
    segment = _gram_segment_blocked if blocks else _gram_segment
    for start in range(0, len(schedule), GRAM_RESTART_PERIOD):
        X = segment(X, schedule[start : start + GRAM_RESTART_PERIOD], reduce)
    return X


def _gram_segment(X: torch.Tensor, schedule: tuple[Coefficients, ...], reduce: _Reduce | None = None) -> torch.Tensor:
    """``R = X Xᵀ;  P = a I + b R + c R²;  Q ← Q P;  R ← P R P;``  then ``Q X``.

    Every ``P`` and ``R`` is a polynomial in ``X Xᵀ``, so they commute and ``(Q X)(Q X)ᵀ = R``:
    the result equals ``len(schedule)`` standard steps.
    """
    R = X @ X.mT
    if reduce is not None:
        reduce([R])
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


def _standard_loop_blocked(X: torch.Tensor, schedule: tuple[Coefficients, ...], reduce: _Reduce | None = None) -> torch.Tensor:
    """:func:`_standard_loop` with ``A`` and ``b A + c A²`` kept as :class:`_Symmetric` blocks."""
    for a, b, c in schedule:
        A = _Symmetric.gram(X)
        if reduce is not None:
            reduce(A)
        X = A.polynomial(A @ A, 0.0, b, c).times(X, plus=a)
    return X


def _gram_segment_blocked(X: torch.Tensor, schedule: tuple[Coefficients, ...], reduce: _Reduce | None = None) -> torch.Tensor:
    """:func:`_gram_segment` with every ``m × m`` matrix kept as :class:`_Symmetric` blocks."""
    R = _Symmetric.gram(X)
    if reduce is not None:
        reduce(R)
    Q: _Symmetric | None = None
    for index, (a, b, c) in enumerate(schedule):
        P = R.polynomial(R @ R, a, b, c)
        Q = P if Q is None else Q @ P
        if index < len(schedule) - 1:
            R = P @ (R @ P)
    assert Q is not None  # schedule is never empty
    return Q.times(X)


_LOOP_SETTINGS: Final[dict[LoopPrecision, tuple[torch.dtype, MatmulPrecision]]] = {
    "ieee": (torch.float32, "highest"),
    "tf32": (torch.float32, "high"),
    "bf16": (torch.bfloat16, "medium"),
}


def _compute_dtype_and_precision(
    x: torch.Tensor, requested: MatmulPrecision, loop: LoopPrecision | None = None
) -> tuple[torch.dtype, MatmulPrecision]:
    """The dtype the loop runs in and the float32 matmul precision it runs under."""
    if loop is not None:
        allowed = LOOP_PRECISIONS[requested]
        if loop not in allowed:
            check_choice("`loop_precision`", loop, get_args(LoopPrecision))
            raise ValueError(
                f"`loop_precision`: coarser than matmul_precision={requested!r} allows; got {loop!r}; expected one of {list(allowed)}"
            )
        if x.dtype == torch.float64:
            return torch.float64, "highest"
        return _LOOP_SETTINGS[loop]
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
    allowed = _gram_allowed(variant, dtype, precision, device)
    if variant != "auto":
        return variant == "gram"
    flops = {v: newton_schulz_flops(rows, cols, steps=steps, variant=v) for v in ("standard", "gram")}
    return allowed and flops["gram"] < flops["standard"]


def _gram_allowed(variant: Variant, dtype: torch.dtype, precision: MatmulPrecision, device: torch.device) -> bool:
    """Whether the Gram variant may run (IEEE float32 or float64 matmuls); raises if asked for anyway."""
    allowed = dtype == torch.float64 or (dtype == torch.float32 and precision == "highest")
    if variant == "gram" and not allowed:
        raise ValueError(
            f"`variant`: 'gram' squares the condition number and needs IEEE float32 matmuls; "
            f"got matmul_precision={precision!r} ({dtype}) on {device.type}; "
            f"expected variant='auto' or 'standard', or matmul_precision='highest'"
        )
    return allowed


PrecisionFlags = tuple[str | None, str | None, str | None]


def _legacy_precision() -> str | None:
    """``torch.get_float32_matmul_precision()``, or ``None`` where torch raises: after a mix of its
    legacy and per-backend APIs (``set_float32_matmul_precision("medium")``, then
    ``torch.backends.cuda.matmul.allow_tf32 = False``), the two backends' flags disagree."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def _precision_flags() -> PrecisionFlags:
    """torch's float32 matmul settings: the legacy precision and the per-backend flags it writes."""

    def flag(backend: Any) -> str | None:
        try:
            return str(backend.fp32_precision)
        except (AttributeError, RuntimeError):  # torch before the per-backend API
            return None

    return _legacy_precision(), flag(torch.backends.cuda.matmul), flag(getattr(torch.backends.mkldnn, "matmul", None))


def _restore_precision_flags(saved: PrecisionFlags) -> None:
    legacy = saved[0]
    if legacy is not None:
        if _legacy_precision() != legacy:
            torch.set_float32_matmul_precision(legacy)
        _restore_backend_flags(saved)
        return
    # A mixed state: torch's legacy value disagrees with a backend flag, and cannot be read. Put back
    # a legacy value with which the saved flags disagree again (the flags' setters leave it alone).
    for candidate in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(candidate)
        _restore_backend_flags(saved)
        if _legacy_precision() is None:
            return


def _restore_backend_flags(saved: PrecisionFlags) -> None:
    _, cuda_matmul, mkldnn_matmul = saved
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
    a step must leave global settings as it found them. Where the legacy and per-backend APIs were
    mixed (torch's ``get_float32_matmul_precision`` raises, and upstream's steps read it), the block
    runs at ``highest`` and the mixed flags come back afterwards.
    """
    saved = _precision_flags()
    try:
        if saved[0] is None:
            torch.set_float32_matmul_precision("highest")
        yield
    finally:
        _restore_precision_flags(saved)


@contextlib.contextmanager
def _float32_matmul_precision(precision: MatmulPrecision) -> Iterator[None]:
    """Set ``torch.set_float32_matmul_precision`` for the block, as upstream's optimizer does, and
    leave every float32 matmul setting as found afterwards (:func:`preserved_matmul_precision`).

    The setting is process-wide, so concurrent threads see it too (upstream shares this).
    """
    if _legacy_precision() == precision:
        yield
        return
    with preserved_matmul_precision():
        torch.set_float32_matmul_precision(precision)
        yield


def _check_tensor(x: object, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}`: must be a tensor; got {type(x).__name__}; expected a float torch.Tensor")
    if not x.is_floating_point():
        raise TypeError(f"`{name}`: must be a float tensor; got dtype {x.dtype}; expected float32, float64, bfloat16 or float16")
    if x.ndim < 2:
        raise ValueError(
            f"`{name}`: needs a matrix or a batch of matrices; got shape {tuple(x.shape)}; expected (..., rows, cols)"
        )


def _check_eps(eps: float) -> None:
    if not eps > 0 or eps == float("inf"):
        raise ValueError(f"`eps`: must be positive and finite; got {eps!r}; expected a float in (0, inf)")


def _check_steps(steps: object) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"`steps`: must be an int; got {steps!r}; expected an integer >= 1")
    if steps < 1:
        raise ValueError(f"`steps`: must be at least 1; got {steps}; expected an integer >= 1")


def orthogonality_error(x: torch.Tensor) -> torch.Tensor:
    """How far a ``rows × cols`` matrix is from orthogonal: ``‖G − I‖_F / √k``, ``G`` its Gram
    matrix on the short side (``X Xᵀ`` for a wide matrix, ``Xᵀ X`` for a tall one), ``k = min(rows, cols)``.

    That is the RMS of ``σᵢ² − 1`` over the matrix's ``k`` singular values: 0 for an orthogonal
    matrix whatever its shape (the long-side Gram ``XᵀX`` of a wide matrix has rank ``k`` and is
    never ``I``), comparable across shapes. One ``k × k`` Gram product, in float32 (float64 for
    float64), at torch's current matmul precision: a fraction of one Newton–Schulz iteration.

    Example:
        >>> q = torch.linalg.qr(torch.randn(8, 5, dtype=torch.float64)).Q  # orthonormal columns
        >>> float(orthogonality_error(q)) < 1e-12, round(float(orthogonality_error(2 * q)), 12)  # σ² − 1 = 3
        (True, 3.0)
    """
    if x.ndim != 2:
        raise ValueError(f"`x`: must be one matrix; got shape {tuple(x.shape)}; expected (rows, cols)")
    x = x if x.dtype == torch.float64 else x.float()
    rows, cols = x.shape
    gram = x @ x.T if rows <= cols else x.T @ x
    k = min(rows, cols)
    gram.diagonal().sub_(1.0)
    error: torch.Tensor = torch.linalg.matrix_norm(gram) / math.sqrt(k)
    return error
