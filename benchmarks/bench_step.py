"""Step time of get_optimizer's optimizers against the torch.optim baselines users would pick.

Run: ``.venv/bin/python -m benchmarks.bench_step`` (prints a table of ratios measured side by
side in one process), or through pytest-benchmark: ``make bench``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch
from tabulate import tabulate

from benchmarks._timing import round_robin_medians
from optzoo import (
    OptimizerConfig,
    ParamKey,
    get_optimizer,
    get_standard_config_overrides,
)
from optzoo.models import GPT, GPTConfig


def _model(hidden: int, layers: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=8, vocab_size=8192, max_seq_len=256))
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    return model


def _same_groups(opt: torch.optim.Optimizer, *keys: str) -> list[dict[str, object]]:
    """``opt``'s groups (params, lr, weight decay, ...) for a baseline built by hand."""
    return [{"params": g["params"], **{k: g[k] for k in ("lr", "weight_decay", *keys)}} for g in opt.param_groups]


def _candidates(model: GPT) -> dict[str, torch.optim.Optimizer]:
    """Ours and the baselines, with identical groups (standard routing: no decay on 1-D)."""
    config = OptimizerConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.0)
    adam = get_optimizer(config, model)
    sgd = get_optimizer(config.replace(optimizer="sgd"), model)
    return {
        "optzoo adam (fused)": adam,
        "torch AdamW foreach": torch.optim.AdamW(_same_groups(adam, "betas", "eps"), foreach=True),
        "torch AdamW fused": torch.optim.AdamW(_same_groups(adam, "betas", "eps"), fused=True),
        "optzoo sgd (fused)": sgd,
        "torch SGD foreach": torch.optim.SGD(_same_groups(sgd, "momentum"), foreach=True),
        "optzoo lion": get_optimizer(config.replace(optimizer="lion"), model),
        "optzoo adam+lion routing": get_optimizer(
            config, model, {**get_standard_config_overrides(config), ParamKey(name="*.mlp.linear_fc*.weight"): {"optimizer": "lion"}}
        ),
    }


def compare(hidden: int = 512, layers: int = 8, repeats: int = 10) -> list[list[object]]:
    """Median step time of every candidate on one model, round-robin in one process.

    Candidates take turns within each repeat, so machine-load drift hits them all alike.
    """
    model = _model(hidden, layers)
    candidates = _candidates(model)
    steps: dict[str, Callable[[], object]] = {name: opt.step for name, opt in candidates.items()}
    medians = round_robin_medians(steps, repeats)
    baseline = medians["torch AdamW foreach"]
    return [[name, seconds * 1e3, seconds / baseline] for name, seconds in medians.items()]


@pytest.mark.parametrize("name", ["optzoo adam (fused)", "torch AdamW foreach", "optzoo lion", "optzoo sgd (fused)"])
def test_step_time(benchmark: pytest.FixtureRequest, name: str) -> None:
    opt = _candidates(_model(256, 4))[name]
    opt.step()
    benchmark(opt.step)  # type: ignore[operator]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    model_size = sum(p.numel() for p in _model(args.hidden, args.layers).parameters())
    print(f"GPT hidden={args.hidden} layers={args.layers}: {model_size / 1e6:.1f}M parameters, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    rows = compare(args.hidden, args.layers, args.repeats)
    print(tabulate(rows, headers=["optimizer", "median step (ms)", "vs torch AdamW foreach"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
