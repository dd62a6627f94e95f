"""Mixed-precision Adam: step time against fp32 AdamW, and bytes of state + master per parameter.

Run: ``.venv/bin/python -m benchmarks.bench_precision``. All candidates step the same GPT in one
process, round-robin, so the ratios hold even when the machine's speed drifts. The baseline is
plain fp32 ``torch.optim.AdamW`` with its fastest kernel on the device (``fused=True`` where torch
has it). Bytes are measured from the actual tensors: optimizer state plus fp32 main copies.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch
from tabulate import tabulate

from benchmarks._timing import round_robin_medians
from optzoo.optimizers.registry import fused_supported
from optzoo import OptimizerConfig, get_optimizer
from optzoo.models import GPT, GPTConfig


def _model(dtype: torch.dtype, hidden: int, layers: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=8, vocab_size=8192, max_seq_len=256)).to(dtype)
    for param in model.parameters():
        param.grad = (torch.randn(param.shape) * 1e-3).to(dtype)
    return model


def _bytes_per_param(opt: torch.optim.Optimizer, model: torch.nn.Module) -> float:
    """Optimizer state (all tensors but ``step``) plus main params that are not model params."""
    model_ids = {id(p) for p in model.parameters()}
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step")
    mains = sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"] if id(p) not in model_ids)
    return (state + mains) / sum(p.numel() for p in model.parameters())


def _candidates(hidden: int, layers: int) -> dict[str, tuple[torch.optim.Optimizer, torch.nn.Module]]:
    config = OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=0.0)
    fp32 = _model(torch.float32, hidden, layers)
    kernel = {"fused": True} if fused_supported(list(fp32.parameters())) else {"foreach": True}
    bf16_models = {name: _model(torch.bfloat16, hidden, layers) for name in ("mixed", "remainders", "moments")}
    return {
        f"torch AdamW fp32 ({next(iter(kernel))})": (torch.optim.AdamW(fp32.parameters(), lr=1e-4, weight_decay=0.1, **kernel), fp32),
        "optzoo adam bf16 (fp32 main params)": (get_optimizer(config.replace(bf16=True), bf16_models["mixed"], {}), bf16_models["mixed"]),
        "optzoo adam bf16 + remainders": (
            get_optimizer(config.replace(bf16=True, use_precision_aware_optimizer=True), bf16_models["remainders"], {}),
            bf16_models["remainders"],
        ),
        "optzoo adam bf16 + remainders + bf16 moments": (
            get_optimizer(
                config.replace(bf16=True, use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
                bf16_models["moments"], {},
            ),
            bf16_models["moments"],
        ),
    }  # fmt: skip


def _step(opt: torch.optim.Optimizer, model: torch.nn.Module) -> Callable[[], object]:
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    def run() -> object:
        for param, grad in zip(model.parameters(), grads):
            param.grad = grad  # the wrappers release model grads after copying them
        return opt.step()

    return run


def compare(hidden: int = 512, layers: int = 4, repeats: int = 5) -> list[list[object]]:
    candidates = _candidates(hidden, layers)
    steps = {name: _step(opt, model) for name, (opt, model) in candidates.items()}
    medians = round_robin_medians(steps, repeats)
    baseline = next(iter(medians.values()))
    return [
        [name, medians[name] * 1e3, medians[name] / baseline, _bytes_per_param(opt, model)]
        for name, (opt, model) in candidates.items()
    ]


@pytest.mark.parametrize("index", range(4))
def test_precision_step(benchmark: pytest.FixtureRequest, index: int) -> None:
    opt, model = list(_candidates(64, 1).values())[index]
    benchmark(_step(opt, model))  # type: ignore[operator]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size = sum(p.numel() for p in _model(torch.float32, args.hidden, args.layers).parameters())
    print(f"GPT hidden={args.hidden} layers={args.layers}: {size / 1e6:.1f}M parameters, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    rows = compare(args.hidden, args.layers, args.repeats)
    print(tabulate(rows, headers=["optimizer", "median step (ms)", "vs fp32 AdamW", "state + master bytes/param"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
