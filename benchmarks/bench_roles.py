"""What reading roles from one forward costs: ``get_optimizer`` with and without the trace.

Run: ``.venv/bin/python -m benchmarks.bench_roles``. Two models, as the issue asks:

* GPT-2 small (124M parameters, ``transformers.GPT2Config()`` defaults) built on the CPU;
* Llama 2 7B's shape (``transformers.LlamaConfig()`` defaults, 6.7B parameters) on the meta device,
  as ``optzoo dump-param-groups`` builds models.

For each it times, in turns (median of ``--rounds``), ``get_optimizer(muon config, model)`` with
``trace=True`` (one forward observed on meta stand-ins) and ``trace=False`` (roles guessed from
module types and names), and ``infer_roles`` alone. On the meta model ``get_optimizer`` cannot
build optimizer state, so its routing, ``resolve_group_configs``, is what is timed there.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from tabulate import tabulate
from torch import nn

from optzoo import OptimizerConfig, get_optimizer, infer_roles, resolve_group_configs

CONFIG = OptimizerConfig(optimizer="muon", lr=1e-3, weight_decay=0.1)


def _gpt2_small() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    return model


def _llama_7b_meta() -> nn.Module:
    import transformers

    with torch.device("meta"):
        model: nn.Module = transformers.LlamaForCausalLM(transformers.LlamaConfig())
    return model


def _timed(function: Callable[[], object], rounds: int) -> float:
    """Median seconds of ``rounds`` calls."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model: nn.Module, *, meta: bool, rounds: int) -> list[float]:
    """``[with trace, without trace, infer_roles alone]`` seconds, measured in turns."""

    def build(trace: bool) -> object:
        if meta:
            return resolve_group_configs(CONFIG, model, trace=trace)
        return get_optimizer(CONFIG, model, trace=trace, lint=False)

    build(True)  # warm up: imports, first dispatch
    with_trace, without, alone = [], [], []
    for _ in range(rounds):
        with_trace.append(_timed(lambda: build(True), 1))
        without.append(_timed(lambda: build(False), 1))
        alone.append(_timed(lambda: infer_roles(model), 1))
    return [statistics.median(with_trace), statistics.median(without), statistics.median(alone)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for label, build, meta in (("GPT-2 small, CPU", _gpt2_small, False), ("Llama 7B shape, meta", _llama_7b_meta, True)):
        model = build()
        params = sum(p.numel() for p in model.parameters())
        with_trace, without, alone = measure(model, meta=meta, rounds=args.rounds)
        timed = "resolve_group_configs" if meta else "get_optimizer"
        rows.append([label, f"{params / 1e6:,.0f}M", timed, with_trace, without, with_trace - without, alone])
    headers = ["model", "params", "timed", "with trace (s)", "without (s)", "trace adds (s)", "infer_roles alone (s)"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} rounds in turns")
    print(tabulate(rows, headers=headers, floatfmt=".3f"))


if __name__ == "__main__":
    main()
