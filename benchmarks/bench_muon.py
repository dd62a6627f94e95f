"""Muon and AdaptiveMuon step time: ours (batched, and per-tensor) against emerging-optimizers'.

Run: ``.venv/bin/python -m benchmarks.bench_muon``. The params are the 2-D weights of a GPT-style
model, built directly as tensors with gradients: per layer a fused QKV (3·hidden × hidden), the
attention output (hidden × hidden) and the MLP (ffn × hidden, hidden × ffn); the defaults
(hidden 1024, ffn 4096, 2 layers) give 25.2M params. Every candidate steps its own copy, all at
``fp32_matmul_prec="highest"`` (IEEE float32 matmuls), without a QKV split (upstream's Muon has
none). Candidates take turns within each repeat (:func:`benchmarks._timing.round_robin_medians`),
after one untimed step each (lazy state; nothing here is compiled), so their ratios hold even if
the machine's speed drifts.

Where ours gains: the Gram variant of Newton–Schulz on wide float32 matrices (0.66x the
standard loop's FLOPs at 1024 × 4096, 0.74x at 1024 × 3072), symmetric products kept as blocks
from 1024 rows (3/4 of the ``m × m`` FLOPs), and one batched call per exact shape.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch
from tabulate import tabulate

from benchmarks._timing import round_robin_medians
from optzoo.optimizers import _emerging
from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon

SETTINGS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "fp32_matmul_prec": "highest"}


def gpt_matrices(hidden: int, ffn: int, layers: int, device: torch.device) -> list[torch.Tensor]:
    """The 2-D weights of ``layers`` transformer layers, with random gradients."""
    generator = torch.Generator(device).manual_seed(0)
    shapes = [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn)] * layers
    params = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape, generator=generator, device=device) * 0.02)
        param.grad = torch.randn(shape, generator=generator, device=device) * 1e-3
        params.append(param)
    return params


def _copy(params: list[torch.Tensor]) -> list[torch.Tensor]:
    copies = []
    for param in params:
        copied = torch.nn.Parameter(param.detach().clone())
        copied.grad = param.grad.clone() if param.grad is not None else None
        copies.append(copied)
    return copies


def _synced(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    if device.type != "cuda":
        return step
    return lambda: (step(), torch.cuda.synchronize(device))


def candidates(params: list[torch.Tensor], moment2_method: str) -> dict[str, torch.optim.Optimizer]:
    """Ours (batched, per-tensor) and upstream, for Muon and AdaptiveMuon, each on its own copy."""
    adaptive = {**SETTINGS, "moment2_method": moment2_method}
    return {
        "ours Muon": Muon(_copy(params), **SETTINGS),  # type: ignore[arg-type]
        "ours Muon per-tensor": Muon(_copy(params), **SETTINGS, batched=False),  # type: ignore[arg-type]
        "upstream Muon": _emerging.muon(_copy(params), **SETTINGS),
        "ours AdaptiveMuon": AdaptiveMuon(_copy(params), **adaptive),  # type: ignore[arg-type]
        "upstream AdaptiveMuon": _emerging.adaptive_muon(_copy(params), **adaptive),
    }


def compare(
    *, hidden: int = 1024, ffn: int = 4096, layers: int = 2, moment2_method: str = "adamuon", repeats: int = 5, device: str = "cpu"
) -> tuple[int, list[list[object]]]:
    """Median step time per candidate, and its ratio to upstream's same algorithm."""
    dev = torch.device(device)
    params = gpt_matrices(hidden, ffn, layers, dev)
    optimizers = candidates(params, moment2_method)
    medians = round_robin_medians({name: _synced(opt.step, dev) for name, opt in optimizers.items()}, repeats)
    rows: list[list[object]] = []
    for name, seconds in medians.items():
        baseline = "upstream AdaptiveMuon" if "Adaptive" in name else "upstream Muon"
        rows.append([name, seconds * 1e3, seconds / medians[baseline]])
    return sum(p.numel() for p in params), rows


HEADERS = ["optimizer", "median step ms", "time vs upstream"]


@pytest.mark.parametrize("batched", [True, False])
def test_muon_step_bench(benchmark: pytest.FixtureRequest, batched: bool) -> None:
    params = gpt_matrices(32, 128, 2, torch.device("cpu"))
    opt = Muon(params, **SETTINGS, batched=batched)  # type: ignore[arg-type]
    benchmark(opt.step)  # type: ignore[operator]


def test_compare_runs() -> None:
    count, rows = compare(hidden=16, ffn=64, layers=2, repeats=1)
    assert count == 2 * (3 * 16 * 16 + 16 * 16 + 2 * 64 * 16)
    assert [row[0] for row in rows] == [
        "ours Muon", "ours Muon per-tensor", "upstream Muon", "ours AdaptiveMuon", "upstream AdaptiveMuon",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--moment2-method", default="adamuon", choices=["adamuon", "normuon", "namo"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    count, rows = compare(
        hidden=args.hidden, ffn=args.ffn, layers=args.layers, moment2_method=args.moment2_method,
        repeats=args.repeats, device=args.device,
    )  # fmt: skip
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else f"cpu, {torch.get_num_threads()} threads"
    print(
        f"{where}, torch {torch.__version__}; {count / 1e6:.1f}M params in {args.layers} layers "
        f"(hidden {args.hidden}, ffn {args.ffn}); fp32_matmul_prec=highest, quintic x 5, "
        f"AdaptiveMuon {args.moment2_method}; median of {args.repeats} round-robin repeats"
    )
    print(tabulate(rows, headers=HEADERS, floatfmt=".2f"))


if __name__ == "__main__":
    main()
