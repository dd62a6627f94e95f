"""Newton–Schulz on tensor-parallel shards (Megatron-Core's ``muon_tp_mode="distributed"``).

Three outside references: emerging-optimizers' ``newton_schulz_tp(..., tp_mode="distributed")`` run
on the same ranks (bit for bit on dyadic inputs), one-process ``newton_schulz`` of the whole matrix,
and the float64 SVD polynomial ``U f(S / ‖x‖_F) Vᵀ``. Multi-rank cases run on gloo in spawned CPU
ranks, all cases of a world size in one spawn; the 4-rank spawn is marked slow.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

import optzoo.optimizers.newton_schulz as ns
from optzoo.optimizers.newton_schulz import (
    ShardedNewtonSchulzCost,
    coefficient_schedule,
    newton_schulz,
    newton_schulz_sharded,
    newton_schulz_sharded_cost,
)
from tests.distributed.harness import run_ranks

# ---- inputs and layout ---------------------------------------------------------------------


def dyadic(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Entries k/8 with |k| <= 8 and a 1 in each matrix: max-abs is 1 and every sum of squares is exact,
    so our max-abs-then-Frobenius normalisation and upstream's Frobenius one give the same bits."""
    x = torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)).float() / 8
    x.reshape(-1, *shape[-2:])[:, 0, 0] = 1.0
    return x


def gaussian(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def piece(x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s piece in torch.chunk's layout (chunks of ceil(n / world); the last ranks may get
    none: torch.chunk then returns fewer chunks, we return an empty piece)."""
    n = x.size(dim)
    size = -(-n // world)
    start = min(rank * size, n)
    return x.narrow(dim, start, max(0, min(size, n - start))).contiguous()


def polar_polynomial(x: torch.Tensor, coefficient_type: str = "quintic", steps: int = 5) -> torch.Tensor:
    """``U f(S / ‖x‖_F) Vᵀ`` in float64: what the iteration computes in exact arithmetic."""
    x = x.double()
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    s = s / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)[..., 0]
    for a, b, c in coefficient_schedule(coefficient_type, steps):  # type: ignore[arg-type]
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag_embed(s) @ vh


# (name, shape, shard_dim, kwargs, input, seed). Shapes cover square, wide, tall, batches, pieces that
# do not divide (33 over 2 and 4 ranks) and empty pieces (1 row over 2 ranks, 3 rows over 4).
UPSTREAM_CASES: list[tuple[str, tuple[int, ...], int, dict[str, Any]]] = [
    (f"{shape}-dim{dim}-{ct}", shape, dim, {"coefficient_type": ct, "steps": steps})
    for shape in [(32, 48), (48, 32), (40, 40), (33, 48), (48, 33), (1, 24), (24, 1), (3, 40), (1, 32, 48), (3, 32, 48), (3, 48, 33)]
    for dim in (-2, -1)
    for ct, steps in (("quintic", 5), ("polar_express", 8))
]
ONE_PROCESS_CASES: list[tuple[str, tuple[int, ...], int, dict[str, Any]]] = [
    (f"{shape}-dim{dim}-{variant}-{ct}", shape, dim, {"variant": variant, "coefficient_type": ct})
    for shape in [(33, 65), (65, 33), (48, 48), (2, 24, 80), (3, 40)]
    for dim in (-2, -1, 0, 1)
    for variant in ("standard", "gram")
    for ct in ("quintic", "cans")
]
# (name, shape, shard_dim, kwargs): all-reduces counted by wrapping dist.all_reduce.
COUNT_CASES: list[tuple[str, tuple[int, ...], int, dict[str, Any]]] = [
    ("standard-5", (2, 16, 40), -1, {"variant": "standard"}),
    ("standard-7-polar_express", (16, 40), -2, {"variant": "standard", "steps": 7, "coefficient_type": "polar_express"}),
    ("gram-5", (2, 16, 40), -1, {"variant": "gram"}),
    ("gram-7-polar_express", (40, 16), -2, {"variant": "gram", "steps": 7, "coefficient_type": "polar_express"}),
    ("auto-narrow-pieces", (32, 64), -1, {}),  # pieces 32 wide on 2 ranks: not > 1.5 × 32 rows
    ("auto-wide-pieces", (16, 256), -1, {}),  # pieces >= 64 wide: > 1.5 × 16 rows
    ("auto-short-side-split", (16, 256), -2, {}),  # Gram 256 × 256 over pieces of <= 8 rows
    ("float64", (2, 16, 40), -1, {"variant": "standard", "dtype": torch.float64}),
]


def matrix_dim(dim: int) -> int:
    """``shard_dim`` 0 and 1 are the matrix dims (Megatron's ``partition_dim``), even for a batch."""
    return dim - 2 if dim >= 0 else dim


def _sharded(x: torch.Tensor, dim: int, rank: int, world: int, **kwargs: Any) -> torch.Tensor:
    return newton_schulz_sharded(piece(x, matrix_dim(dim), rank, world), group=dist.group.WORLD, shard_dim=dim, **kwargs)  # type: ignore[arg-type]


def _upstream_batched(x_local: torch.Tensor, dim: int, coefficient_type: str, steps: int) -> torch.Tensor:
    """Upstream's distributed loop on a batch, normalising each matrix on its own. (Upstream's
    ``newton_schulz_tp`` on a batch divides by the Frobenius norm of the whole batch; one call per
    matrix instead would all-reduce each Gram alone, which sums in another order on 4 ranks.)"""
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    # Normalised before the transpose (elementwise, so the same values), to keep upstream's layout:
    # its x.mT is a transposed view, and the CPU matmul kernels round by layout.
    X = torch.stack([muon_utils.distributed_normalize_p2(m, 1e-7, dist.group.WORLD) for m in x_local])
    X = X.mT if dim == -2 else X
    sets = muon_utils._COEFFICIENT_SETS[coefficient_type]
    mode = "repeat_last" if coefficient_type in ("polar_express", "cans", "deepseekv4") else "cycle"
    for a, b, c in muon_utils.get_coefficient_iterator(steps, sets, mode=mode):
        X = muon_utils.batched_newton_schulz_step(X, a, b, c, tp_group=dist.group.WORLD)
    return X.mT if dim == -2 else X


def _upstream(x_local: torch.Tensor, dim: int, coefficient_type: str, steps: int, *, batched: bool = True) -> torch.Tensor:
    """Upstream's ``newton_schulz_tp(..., tp_mode="distributed")``. With ``batched``, a matrix goes in
    as a batch of one, so that upstream steps it with ``baddbmm`` as we do (given a 2-D input it uses
    ``addmm``, whose CPU kernel rounds differently when the Gram has 1 to 3 rows)."""
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    if x_local.ndim == 3 and x_local.size(0) > 1:
        return _upstream_batched(x_local, dim, coefficient_type, steps)
    partition_dim = {-2: 0, -1: 1}[dim]  # upstream's names for the matrix dims
    x = x_local.unsqueeze(0) if batched and x_local.ndim == 2 else x_local
    result: torch.Tensor = muon_utils.newton_schulz_tp(
        x, steps, coefficient_type, dist.group.WORLD, partition_dim=partition_dim, tp_mode="distributed"  # type: ignore[arg-type]
    )
    return result.reshape(x_local.shape)


def _counted(fn: Any) -> tuple[Any, list[tuple[str, int]]]:
    """Run ``fn()`` with dist.all_reduce wrapped: its result and each call's (op, bytes)."""
    calls: list[tuple[str, int]] = []
    original = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, **kwargs: Any) -> Any:
        calls.append((str(op).rsplit(".", 1)[-1], tensor.numel() * tensor.element_size()))
        return original(tensor, op=op, **kwargs)

    dist.all_reduce = all_reduce  # type: ignore[assignment]
    try:
        return fn(), calls
    finally:
        dist.all_reduce = original


def _battery(rank: int, world: int) -> dict[str, Any]:
    """Every multi-rank case of this file, on one rank."""
    torch.set_float32_matmul_precision("highest")
    results: dict[str, Any] = {"upstream": {}, "one_process": {}, "blocks": {}, "counts": {}}
    for name, shape, dim, kwargs in UPSTREAM_CASES:
        x = piece(dyadic(shape, seed=len(name)), dim, rank, world)
        ours = newton_schulz_sharded(x, group=dist.group.WORLD, shard_dim=dim, variant="standard", **kwargs)  # type: ignore[arg-type]
        reference = _upstream(x, dim, kwargs["coefficient_type"], kwargs["steps"])
        results["upstream"][name] = (ours, reference, _upstream(x, dim, kwargs["coefficient_type"], kwargs["steps"], batched=False))
    for name, shape, dim, kwargs in ONE_PROCESS_CASES:
        results["one_process"][name] = _sharded(gaussian(shape, seed=len(name)), dim, rank, world, **kwargs)
    # The symmetric-block loops (from 1024 rows by default) forced on from 2 rows.
    ns.SYMMETRIC_BLOCKS_MIN_ROWS = 2
    for variant in ("standard", "gram"):
        for dim in (-2, -1):
            x = gaussian((2, 24, 80) if dim == -1 else (2, 80, 24), seed=3)
            results["blocks"][f"{variant}{dim}"] = _counted(lambda: _sharded(x, dim, rank, world, variant=variant))  # noqa: B023
    ns.SYMMETRIC_BLOCKS_MIN_ROWS = 1024

    for name, shape, dim, kwargs in COUNT_CASES:
        options = dict(kwargs)
        x = gaussian(shape, seed=0, dtype=options.pop("dtype", torch.float32))
        with FlopCounterMode(display=False) as counter:
            out, calls = _counted(lambda: _sharded(x, dim, rank, world, **options))  # noqa: B023
        results["counts"][name] = (calls, counter.get_total_flops(), out)

    # zero matrices stay zero (one of a batch, and a whole call); bf16 in, bf16 out; float64.
    x = gaussian((3, 16, 24), seed=1)
    x[1] = 0
    results["zero"] = (_sharded(x, -1, rank, world), _sharded(torch.zeros(16, 24), -2, rank, world))
    results["bf16"] = _sharded(gaussian((33, 65), seed=2).bfloat16(), -1, rank, world)
    results["float64"] = _sharded(gaussian((2, 33, 65), seed=4, dtype=torch.float64), -2, rank, world)
    results["tiny"] = _sharded(gaussian((33, 65), seed=5) * 1e-30, -1, rank, world)

    # The bf16 loop (medium on a fast-bf16 device) runs here by declaring the CPU fast.
    fast = ns.has_fast_bf16_matmul
    ns.has_fast_bf16_matmul = lambda device: True  # type: ignore[assignment]
    x = piece(dyadic((32, 48), seed=6), -1, rank, world)
    ours = newton_schulz_sharded(x, group=dist.group.WORLD, shard_dim=-1, matmul_precision="medium")
    torch.set_float32_matmul_precision("medium")  # upstream reads the global setting
    reference = _upstream(x, -1, "quintic", 5)
    torch.set_float32_matmul_precision("highest")
    results["bf16_loop"] = (ours, reference)
    try:
        newton_schulz_sharded(x, group=dist.group.WORLD, shard_dim=-1, matmul_precision="medium", variant="gram")
    except ValueError as error:
        results["bf16_gram_error"] = str(error)
    ns.has_fast_bf16_matmul = fast  # type: ignore[assignment]

    # The global float32 matmul settings are left as found.
    before = (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision)  # type: ignore[attr-defined]
    _sharded(gaussian((16, 24), seed=7), -1, rank, world, matmul_precision="high")
    results["flags"] = (before, (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision))  # type: ignore[attr-defined]

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.randn(8, 6), init_device_mesh("cpu", (world,)), [Shard(1)])
    try:
        newton_schulz_sharded(sharded, group=dist.group.WORLD, shard_dim=-1)
    except TypeError as error:
        results["dtensor"] = str(error)

    # Pieces that disagree on the unsplit dim: every rank raises, nobody hangs.
    try:
        newton_schulz_sharded(torch.randn(16 + rank, 24), group=dist.group.WORLD, shard_dim=-1)
    except ValueError as error:
        results["disagree"] = str(error)
    return results


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda world: f"{world}ranks")
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_ranks(request.param, _battery, timeout=400)


def gathered(ranks: tuple[int, list[dict[str, Any]]], *keys: str, dim: int) -> torch.Tensor:
    """The full result: the ranks' pieces of ``results[keys...]`` joined along ``dim``."""
    pieces = []
    for result in ranks[1]:
        for key in keys:
            result = result[key]
        pieces.append(result)
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]


# ---- against upstream ----------------------------------------------------------------------


@pytest.mark.parametrize(("name", "shape", "dim", "kwargs"), UPSTREAM_CASES, ids=[case[0] for case in UPSTREAM_CASES])
def test_equals_upstream_newton_schulz_tp_bit_for_bit(
    ranks: tuple[int, list[dict[str, Any]]], name: str, shape: tuple[int, ...], dim: int, kwargs: dict[str, Any]
) -> None:
    """Dyadic inputs (exact normalisation), the standard loop: the same products in the same order,
    and the same all_reduce of the same Gram buffers, as upstream's distributed mode."""
    gram_rows = shape[-1] if dim == -2 else shape[-2]
    for rank, result in enumerate(ranks[1]):
        ours, reference, reference_2d = result["upstream"][name]
        assert ours.shape == reference.shape and ours.dtype == torch.float32
        assert torch.equal(ours, reference), (rank, (ours - reference).abs().max().item())
        if gram_rows > 3:  # upstream's 2-D path (addmm) too; below, its kernel rounds differently
            assert torch.equal(ours, reference_2d), (rank, (ours - reference_2d).abs().max().item())
        else:  # measured 4.8e-7: a few float32 ulps of the 2-D kernel's other summation order
            torch.testing.assert_close(ours, reference_2d, atol=2e-6, rtol=2e-6)


def test_bf16_loop_equals_upstream_medium_bit_for_bit(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    """Under ``medium`` on a fast-bf16 device both loops run in bf16 and all-reduce bf16 Grams."""
    for result in ranks[1]:
        ours, reference = result["bf16_loop"]
        assert ours.dtype == torch.float32
        assert torch.equal(ours, reference), (ours - reference).abs().max().item()
        assert result["bf16_gram_error"].startswith("`variant`: 'gram' squares the condition number and needs IEEE float32")


# ---- against one process and the float64 polynomial ----------------------------------------

# The sums of the Grams and of the squares run in another order than one process's (and the
# split rows iterate on the transposed matrix): ~1e-7 relative, amplified by the iteration's slope
# at 0 (the product of the a_k: ~5e2 for quintic, ~1e3 for cans), and squared conditioning for gram.
# Measured worst, 5 seeds, shapes of ONE_PROCESS_CASES, quintic/cans/polar_express/aol, 2 and 4
# ranks, dense and symmetric blocks: standard 1.6e-5, gram 8.1e-5.
ONE_PROCESS_TOLERANCE = {"standard": {"atol": 5e-5, "rtol": 5e-5}, "gram": {"atol": 2e-4, "rtol": 2e-4}}


@pytest.mark.parametrize(("name", "shape", "dim", "kwargs"), ONE_PROCESS_CASES, ids=[case[0] for case in ONE_PROCESS_CASES])
def test_equals_one_process_newton_schulz(
    ranks: tuple[int, list[dict[str, Any]]], name: str, shape: tuple[int, ...], dim: int, kwargs: dict[str, Any]
) -> None:
    x = gaussian(shape, seed=len(name))
    ours = gathered(ranks, "one_process", name, dim=matrix_dim(dim))
    torch.testing.assert_close(ours, newton_schulz(x, **kwargs), **ONE_PROCESS_TOLERANCE[kwargs["variant"]])
    # and, as newton_schulz is, close to the float64 polynomial of the SVD: float32 noise amplified
    # by the slope at 0 (newton_schulz's own worst against it: 5e-3 in spectral norm).
    assert torch.linalg.matrix_norm(ours.double() - polar_polynomial(x, kwargs["coefficient_type"]), ord=2).max() < 1e-2


@pytest.mark.parametrize("variant", ["standard", "gram"])
@pytest.mark.parametrize("dim", [-2, -1])
def test_symmetric_blocks_equal_one_process(
    ranks: tuple[int, list[dict[str, Any]]], variant: str, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The three Gram blocks are all-reduced in one packed buffer: 3/4 of the Gram's bytes."""
    world = ranks[0]
    x = gaussian((2, 24, 80) if dim == -1 else (2, 80, 24), seed=3)
    ours = torch.cat([result["blocks"][f"{variant}{dim}"][0] for result in ranks[1]], dim=dim)
    torch.testing.assert_close(ours, newton_schulz(x, variant=variant), **ONE_PROCESS_TOLERANCE[variant])  # type: ignore[arg-type]
    calls = ranks[1][0]["blocks"][f"{variant}{dim}"][1]
    grams = 5 if variant == "standard" else 2
    assert len(calls) == 2 + grams
    assert [size for _, size in calls[2:]] == [2 * (12 * 12 * 3) * 4] * grams  # 3 blocks of 12 × 12, float32
    # the cost helper agrees with what was all-reduced (with the ranks' lowered threshold)
    monkeypatch.setattr(ns, "SYMMETRIC_BLOCKS_MIN_ROWS", 2)
    cost = newton_schulz_sharded_cost(*x.shape[-2:], shard_dim=dim, world_size=world, steps=5, variant=variant, batch=2)  # type: ignore[arg-type]
    assert (cost.all_reduce_calls, cost.all_reduce_bytes) == (len(calls), sum(size for _, size in calls))


def test_zero_matrix_stays_zero(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    batch = torch.cat([r["zero"][0] for r in ranks[1]], dim=-1)
    whole = torch.cat([r["zero"][1] for r in ranks[1]], dim=-2)
    assert torch.equal(batch[1], torch.zeros(16, 24)) and torch.equal(whole, torch.zeros(16, 24))
    x = gaussian((3, 16, 24), seed=1)
    torch.testing.assert_close(batch[0], newton_schulz(x[0]), **ONE_PROCESS_TOLERANCE["standard"])


def test_low_precision_and_float64_inputs(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    bf16 = torch.cat([r["bf16"] for r in ranks[1]], dim=-1)
    assert bf16.dtype == torch.bfloat16
    # computed in float32 and rounded once to bf16: at most one bf16 rounding step (2**-8) apart.
    expected = newton_schulz(gaussian((33, 65), seed=2).bfloat16())
    torch.testing.assert_close(bf16.float(), expected.float(), atol=2**-8, rtol=2**-8)
    float64 = torch.cat([r["float64"] for r in ranks[1]], dim=-2)
    assert float64.dtype == torch.float64
    # float64 rounding amplified by ~1e3 at most; a float32 loop would miss by 1e6.
    torch.testing.assert_close(float64, polar_polynomial(gaussian((2, 33, 65), seed=4, dtype=torch.float64)), atol=1e-11, rtol=1e-11)


def test_tiny_input_is_orthogonalised(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    """Max-abs first: a 1e-30 gradient's squares would underflow to 0 in float32."""
    tiny = torch.cat([r["tiny"] for r in ranks[1]], dim=-1)
    torch.testing.assert_close(tiny, newton_schulz(gaussian((33, 65), seed=5)), atol=1e-5, rtol=1e-5)


# ---- collectives and cost --------------------------------------------------------------------


def test_all_reduce_calls_bytes_and_flops(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world = ranks[0]
    for name, shape, dim, kwargs in COUNT_CASES:
        steps = kwargs.get("steps", 5)
        rows, cols = shape[-2:]
        batch = math.prod(shape[:-2])
        m, n = (cols, rows) if dim == -2 else (rows, cols)  # m: the Gram's side, the unsplit dim
        n_max = -(-n // world)
        # auto: gram when its FLOPs are lower on the widest piece: 4m²n + 2m³ per standard step
        # against 8m²n + 28m³ for 5 gram steps (segments of 3 and 2), so when n > 1.5 m.
        gram = kwargs.get("variant") == "gram" or ("variant" not in kwargs and n_max > 1.5 * m)
        grams = -(-steps // 3) if gram else steps
        element = 8 if kwargs.get("dtype") == torch.float64 else 4
        for rank, result in enumerate(ranks[1]):
            calls, flops, _ = result["counts"][name]
            assert [op for op, _ in calls] == ["MAX", "SUM"] + ["SUM"] * grams, name
            assert [size for _, size in calls] == [8 * (batch + 3), element * batch] + [element * batch * m * m] * grams, name
            n_local = max(0, min(n_max, n - rank * n_max))
            if not gram:
                assert flops == batch * steps * (4 * m * m * n_local + 2 * m**3), name
            cost = newton_schulz_sharded_cost(
                rows, cols, shard_dim=dim, world_size=world, steps=steps, variant=kwargs.get("variant", "auto"),  # type: ignore[arg-type]
                batch=batch, compute_dtype=kwargs.get("dtype", torch.float32), rank=rank,
            )  # fmt: skip
            assert cost == ShardedNewtonSchulzCost(flops, 2 + grams, sum(size for _, size in calls)), name
    assert len(ranks[1][0]["counts"]["auto-wide-pieces"][0]) == 2 + 2  # gram: one Gram per restart
    assert len(ranks[1][0]["counts"]["auto-narrow-pieces"][0]) == 2 + 5
    assert len(ranks[1][0]["counts"]["auto-short-side-split"][0]) == 2 + 5  # never gram on the long Gram


def test_counted_results_equal_one_process(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    for name, shape, dim, kwargs in COUNT_CASES:
        options = {key: value for key, value in kwargs.items() if key != "dtype"}
        x = gaussian(shape, seed=0, dtype=kwargs.get("dtype", torch.float32))
        ours = torch.cat([r["counts"][name][2] for r in ranks[1]], dim=dim)
        torch.testing.assert_close(ours, newton_schulz(x, **options), atol=2e-4, rtol=2e-4, msg=name)


def test_global_matmul_settings_are_left_as_found(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    for result in ranks[1]:
        before, after = result["flags"]
        assert before == after and before[0] == "highest"


def test_pieces_that_disagree_raise_on_every_rank(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    world = ranks[0]
    for rank, result in enumerate(ranks[1]):
        assert result["disagree"] == (
            f"`x_local`: the ranks' pieces disagree on the unsplit matrix dim; got {16 + rank} here, from 16 to {16 + world - 1} "
            "across `group`; expected every rank to hold the same matrices, split along `shard_dim` only"
        )


def test_cost_by_hand() -> None:
    # 64 × 256 split along its columns over 4 ranks: pieces 64 wide, Gram 64 × 64.
    standard = newton_schulz_sharded_cost(64, 256, shard_dim=1, world_size=4, steps=5, variant="standard")
    assert standard == ShardedNewtonSchulzCost(5 * (4 * 64 * 64 * 64 + 2 * 64**3), 2 + 5, 8 * 4 + 4 + 5 * 64 * 64 * 4)
    # split along the short side: Megatron's rule iterates on the 256 × 256 Gram
    long_gram = newton_schulz_sharded_cost(64, 256, shard_dim=0, world_size=4, steps=5, variant="standard")
    assert long_gram.flops == 5 * (4 * 256 * 256 * 16 + 2 * 256**3)
    assert long_gram.all_reduce_bytes == 8 * 4 + 4 + 5 * 256 * 256 * 4
    # 5 rows over 4 ranks: pieces 2, 2, 1 and an empty one
    pieces = [newton_schulz_sharded_cost(5, 8, shard_dim=-2, world_size=4, steps=1, variant="standard", rank=r).flops for r in range(4)]
    assert pieces == [4 * 64 * 2 + 2 * 512, 4 * 64 * 2 + 2 * 512, 4 * 64 + 2 * 512, 2 * 512]
    bf16 = newton_schulz_sharded_cost(64, 256, shard_dim=1, world_size=4, steps=5, compute_dtype=torch.bfloat16)
    assert bf16.all_reduce_bytes == 8 * 4 + 4 + 5 * 64 * 64 * 2  # bf16 Grams; never gram in bf16


# ---- bad arguments (no process group needed: they are checked before it) ---------------------


@pytest.mark.parametrize(
    ("x", "kwargs", "error", "message"),
    [
        (torch.randn(4, 6), {"shard_dim": 2}, ValueError, r"^`shard_dim`: not a matrix dim; got 2; expected -2 or 0 \(rows split\) or -1 or 1"),
        (torch.randn(4, 6), {"shard_dim": True}, ValueError, r"^`shard_dim`: not a matrix dim; got True"),
        (torch.randn(4, 6), {"shard_dim": -1, "group": None}, ValueError, r"^`group`: a process group is required; got None"),
        (torch.randn(4, 6), {"shard_dim": -1, "group": "tp"}, TypeError, r"^`group`: must be a torch.distributed.ProcessGroup; got str"),
        (torch.randn(4), {"shard_dim": -1}, ValueError, r"^`x_local`: needs a matrix or a batch of matrices; got shape \(4,\)"),
        (torch.ones(4, 6, dtype=torch.int64), {"shard_dim": -1}, TypeError, r"^`x_local`: must be a float tensor; got dtype torch.int64"),
        (torch.randn(4, 6), {"shard_dim": -1, "steps": 0}, ValueError, r"^`steps`: must be at least 1; got 0"),
        (torch.randn(4, 6), {"shard_dim": -1, "eps": 0.0}, ValueError, r"^`eps`: must be positive and finite; got 0.0"),
        (torch.randn(4, 6), {"shard_dim": -1, "variant": "fast"}, ValueError, r"^`variant`: unknown value; got 'fast'"),
        (torch.randn(4, 6), {"shard_dim": -1, "coefficient_type": "custom"}, ValueError, r"^`coefficient_type`: unknown value; got 'custom'"),
        (torch.randn(4, 6), {"shard_dim": -1, "matmul_precision": "low"}, ValueError, r"^`matmul_precision`: unknown value; got 'low'"),
        (torch.randn(4, 6), {"shard_dim": -1, "matmul_precision": "high", "variant": "gram"}, ValueError, r"^`variant`: 'gram' squares"),
    ],
)
def test_bad_arguments_raise(x: torch.Tensor, kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    kwargs = {"group": object(), **kwargs}  # a non-group reaches the group check only when all else is fine
    with pytest.raises(error, match=message):
        newton_schulz_sharded(x, **kwargs)


def test_dtensor_is_refused_by_name(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    for result in ranks[1]:
        assert result["dtensor"] == "`x_local`: must be this rank's local tensor; got a DTensor; expected x.to_local()"


def test_uninitialised_group_raises() -> None:
    assert not dist.is_initialized()
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a group object, with no default group behind it
    with pytest.raises(ValueError, match=r"^`group`: torch.distributed is not initialised"):
        newton_schulz_sharded(torch.randn(4, 6), group=group, shard_dim=-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shard_dim": 3}, r"^`shard_dim`: not a matrix dim; got 3"),
        ({"world_size": 0}, r"^`world_size`: must be at least 1; got 0"),
        ({"rank": 4}, r"^`rank`: out of range; got 4; expected None or 0 <= rank < 4"),
        ({"variant": "fast"}, r"^`variant`: unknown value; got 'fast'"),
        ({"compute_dtype": torch.float16}, r"^`compute_dtype`: not a loop dtype; got torch.float16"),
    ],
)
def test_cost_bad_arguments_raise(kwargs: dict[str, Any], message: str) -> None:
    options: dict[str, Any] = {"shard_dim": -1, "world_size": 4, "steps": 5, **kwargs}
    with pytest.raises(ValueError, match=message):
        newton_schulz_sharded_cost(8, 8, **options)


@pytest.fixture(autouse=True)
def _precision_left_as_found() -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    yield
    assert torch.get_float32_matmul_precision() == previous
