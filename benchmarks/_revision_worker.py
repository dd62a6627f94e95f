"""One side of :mod:`benchmarks.bench_revisions`: builds the candidates with whatever ``optzoo`` is
importable (the revision's checkout comes first on ``PYTHONPATH``), then times one step per request.

Protocol, one line each way: the driver writes a candidate's name; the worker restores that
candidate's gradients (untimed), times one ``step()`` and answers the seconds (or ``ready`` once,
after building and one untimed step of every candidate). Only the public API is used, plus the
Muon classes, whose module moved (``optimizers.muon`` before the one-namespace layout).
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import optzoo
from optzoo import OptimizerConfig, ParamKey, get_optimizer, get_standard_config_overrides
from optzoo.models import GPT, GPTConfig

# Revisions before optzoo installed as one namespace keep the algorithms in a top-level package.
_ALGORITHMS = "optzoo.optimizers" if (Path(optzoo.__file__).parent / "optimizers").exists() else "optimizers"
Muon = importlib.import_module(f"{_ALGORITHMS}.muon").Muon
AdaptiveMuon = importlib.import_module(f"{_ALGORITHMS}.adaptive_muon").AdaptiveMuon

MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "fp32_matmul_prec": "highest"}


def _with_grads(params: list[torch.Tensor]) -> Callable[[], None]:
    """Give every param a seeded gradient; returns a function that restores them (steps may clear or clip them)."""
    generator = torch.Generator().manual_seed(1)
    saved = [(torch.randn(p.shape, generator=generator) * 1e-3).to(p.dtype) for p in params]

    def restore() -> None:
        for param, grad in zip(params, saved):
            param.grad = grad.clone()

    restore()
    return restore


def _gpt(hidden: int, layers: int, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=8, vocab_size=8192, max_seq_len=256)
    return GPT(config).to(dtype)


def _matrices(hidden: int, ffn: int, layers: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden), (hidden, ffn)] * layers
    return [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for shape in shapes]


def candidates(hidden: int, layers: int, muon_hidden: int, muon_ffn: int, muon_layers: int) -> dict[str, tuple[Callable[[], object], Callable[[], None]]]:
    """``{name: (step, restore gradients)}``: bench_step's optimizers, the default clipped and bf16
    paths, and bench_muon's Muon classes."""
    fp32, bf16 = _gpt(hidden, layers, torch.float32), _gpt(hidden, layers, torch.bfloat16)
    restore_fp32, restore_bf16 = _with_grads(list(fp32.parameters())), _with_grads(list(bf16.parameters()))
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.0)
    routed = {**get_standard_config_overrides(config), ParamKey(name="*.mlp.linear_fc*.weight"): {"optimizer": "lion"}}
    steps: dict[str, tuple[Callable[[], object], Callable[[], None]]] = {
        "adam (bench_step)": (get_optimizer(config, fp32).step, restore_fp32),
        "sgd (bench_step)": (get_optimizer(config.replace(optimizer="sgd"), fp32).step, restore_fp32),
        "lion (bench_step)": (get_optimizer(config.replace(optimizer="lion"), fp32).step, restore_fp32),
        "adam+lion routing (bench_step)": (get_optimizer(config, fp32, routed).step, restore_fp32),
        "adam, clip_grad=1 (default)": (get_optimizer(config.replace(clip_grad=1.0), fp32).step, restore_fp32),
        "adam bf16, clip_grad=1": (get_optimizer(config.replace(clip_grad=1.0, bf16=True), bf16).step, restore_bf16),
    }
    for name, cls, extra in (
        ("Muon (bench_muon)", Muon, {}),
        ("Muon per-tensor (bench_muon)", Muon, {"batched": False}),
        ("AdaptiveMuon (bench_muon)", AdaptiveMuon, {"moment2_method": "adamuon"}),
    ):
        params = _matrices(muon_hidden, muon_ffn, muon_layers)
        steps[name] = (cls(params, **MUON, **extra).step, _with_grads(params))
    return steps


def main() -> None:
    hidden, layers, muon_hidden, muon_ffn, muon_layers = map(int, sys.argv[1:6])
    steps = candidates(hidden, layers, muon_hidden, muon_ffn, muon_layers)
    for step, restore in steps.values():  # lazy state, first-call costs
        restore()
        step()
    print("ready " + "|".join(steps), flush=True)
    for line in sys.stdin:
        step, restore = steps[line.strip()]
        restore()
        started = time.perf_counter()
        step()
        print(time.perf_counter() - started, flush=True)


if __name__ == "__main__":
    main()
