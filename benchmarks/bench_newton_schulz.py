"""Newton–Schulz throughput: ours (each variant) and emerging-optimizers', against plain torch matmul.

Run: ``.venv/bin/python -m benchmarks.bench_newton_schulz``. All candidates for one shape run in
one process, round-robin, so their ratios hold even when the machine's speed drifts.

How FLOPs are counted: ``torch.utils.flop_counter.FlopCounterMode`` records one call of each
implementation, so every candidate is credited with the matmul FLOPs it really performs
(``2·m·n·k`` per product; normalisation and other elementwise work are not counted). ``gram``
performs fewer FLOPs for wide matrices, so its own-FLOPs rate understates its gain; the
``effective`` column divides the standard loop's FLOPs by each candidate's time instead.

The baseline ``mm`` runs the three products of one standard step (``X Xᵀ``, ``A·A``, ``A·X``, or
their batched ``bmm``) on the same shapes and dtype with plain ``torch.matmul``: the throughput
Newton–Schulz would reach if it were nothing but matmuls.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import pytest
import torch
from tabulate import tabulate
from torch.utils.flop_counter import FlopCounterMode

from benchmarks._timing import round_robin_medians
from optzoo.optimizers import _emerging
from optzoo.optimizers.newton_schulz import MatmulPrecision, newton_schulz, newton_schulz_flops

SHAPES: list[tuple[int, int, int]] = [(1, 512, 512), (1, 1024, 1024), (1, 2048, 2048), (1, 1024, 4096), (1, 4096, 1024), (8, 512, 512)]
"""(batch, rows, cols)."""
BF16_SHAPE = (1, 512, 512)
"""Where upstream's ``medium`` (bf16) path is also timed: on CPU it is ~100x slower, so only here."""


def _synced(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    if device.type != "cuda":
        return step
    return lambda: (step(), torch.cuda.synchronize(device))


def _upstream(x: torch.Tensor, steps: int, coefficient_type: str, precision: MatmulPrecision) -> Callable[[], object]:
    """Upstream under the precision setting, as its optimizer applies it."""

    def run() -> object:
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(precision)
        try:
            return _emerging.newton_schulz(x.squeeze(0), steps=steps, coefficient_type=coefficient_type)
        finally:
            torch.set_float32_matmul_precision(previous)

    return run


def _mm_step(x: torch.Tensor) -> tuple[Callable[[], object], int]:
    """The three products of one standard step, on a wide view, with their FLOPs."""
    wide = x if x.size(-2) <= x.size(-1) else x.mT
    m, n = wide.shape[-2:]
    a = torch.randn(*wide.shape[:-1], m, device=x.device, dtype=x.dtype)
    return (lambda: (wide @ wide.mT, a @ a, a @ wide)), x.size(0) * (4 * m * m * n + 2 * m**3)


def _candidates(x: torch.Tensor, steps: int, coefficient_type: str) -> dict[str, Callable[[], object]]:
    kwargs = {"steps": steps, "coefficient_type": coefficient_type}
    candidates: dict[str, Callable[[], object]] = {
        "ours standard": lambda: newton_schulz(x, variant="standard", **kwargs),  # type: ignore[arg-type]
        "ours gram": lambda: newton_schulz(x, variant="gram", **kwargs),  # type: ignore[arg-type]
        "upstream (highest)": _upstream(x, steps, coefficient_type, "highest"),
    }
    if tuple(x.shape) == BF16_SHAPE:
        candidates["ours medium"] = lambda: newton_schulz(x, matmul_precision="medium", **kwargs)  # type: ignore[arg-type]
        candidates["upstream medium"] = _upstream(x, steps, coefficient_type, "medium")
    return candidates


def _flops(step: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def compare(
    shapes: list[tuple[int, int, int]], *, steps: int = 5, coefficient_type: str = "quintic", repeats: int = 5, device: str = "cpu"
) -> list[list[object]]:
    """One row per (shape, candidate): time, GFLOP/s, fraction of mm, effective GFLOP/s, vs upstream."""
    rows: list[list[object]] = []
    dev = torch.device(device)
    for shape in shapes:
        torch.manual_seed(0)
        x = torch.randn(shape, device=dev)
        mm, mm_flops = _mm_step(x)
        candidates = _candidates(x, steps, coefficient_type)
        flops = {name: _flops(step) for name, step in candidates.items()}
        timed = {"mm": _synced(mm, dev)} | {name: _synced(step, dev) for name, step in candidates.items()}
        medians = round_robin_medians(timed, repeats)
        mm_rate = mm_flops / medians["mm"] / 1e9
        standard_flops = newton_schulz_flops(*shape[1:], steps=steps, variant="standard", batch=shape[0])
        auto = "gram" if _flops(functools.partial(newton_schulz, x, steps=steps)) == flops["ours gram"] else "standard"
        label = "×".join(map(str, shape if shape[0] > 1 else shape[1:]))
        rows.append([label, "torch.matmul (one step's products)", medians["mm"] * 1e3, mm_rate, 1.0, mm_rate, "", ""])
        for name in candidates:
            rate = flops[name] / medians[name] / 1e9
            rows.append([
                label, name + (" [auto]" if name == f"ours {auto}" else ""), medians[name] * 1e3, rate,
                rate / mm_rate, standard_flops / medians[name] / 1e9, medians[name] / medians["upstream (highest)"],
                f"{flops[name] / 1e9:.1f}",
            ])  # fmt: skip
    return rows


HEADERS = ["shape", "implementation", "median ms", "GFLOP/s", "of mm", "effective GFLOP/s", "time vs upstream", "GFLOP"]


@pytest.mark.parametrize("variant", ["standard", "gram"])
def test_newton_schulz_bench(benchmark: pytest.FixtureRequest, variant: str) -> None:
    x = torch.randn(32, 64)
    benchmark(lambda: newton_schulz(x, variant=variant))  # type: ignore[operator,arg-type]


def test_compare_runs() -> None:
    rows = compare([(2, 16, 32)], repeats=1)
    assert [row[1] for row in rows] == ["torch.matmul (one step's products)", "ours standard", "ours gram [auto]", "upstream (highest)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--coefficient-type", default="quintic")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"device {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}, float32, "
          f"{args.coefficient_type} x {args.steps} steps, median of {args.repeats} round-robin repeats")
    rows = compare(SHAPES, steps=args.steps, coefficient_type=args.coefficient_type, repeats=args.repeats, device=args.device)
    print(tabulate(rows, headers=HEADERS, floatfmt=".2f"))


if __name__ == "__main__":
    main()
