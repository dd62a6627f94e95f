"""Step time of get_optimizer's optimizers against the torch.optim baselines users would pick.

Run: ``.venv/bin/python -m benchmarks.bench_step`` (prints a table of ratios measured side by
side in one process), or through pytest-benchmark: ``make bench``.

``--telemetry``: what ``log_metrics`` costs on the benchmark GPT, off against on, side by side in
one run: a whole training step (forward, backward, ``step``) and ``step`` alone, for Adam and Muon.
Two optimizers with telemetry off are timed as two candidates, so their ratio shows the noise floor.
"""

from __future__ import annotations

import argparse
import copy
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


TELEMETRY_MODES: dict[str, bool | str] = {"off": False, "off (again)": False, "on": True, "per_param": "per_param"}
"""``log_metrics`` per candidate; the second "off" measures the noise floor of the ratios."""


def _synced(step: Callable[[], object], device: torch.device) -> Callable[[], object]:
    if device.type != "cuda":
        return step
    return lambda: (step(), torch.cuda.synchronize(device))


def telemetry_overhead(
    hidden: int = 512, layers: int = 8, repeats: int = 10, *, batch: int = 8, seq: int = 128,
    device: torch.device = torch.device("cpu"), optimizers: tuple[str, ...] = ("adam", "muon"),
) -> list[list[object]]:  # fmt: skip
    """Median time of a training step and of ``step`` alone with ``log_metrics`` off and on, each
    candidate on its own copy of one model, round-robin; ratios against the first "off"."""
    base = _model(hidden, layers).to(device)
    tokens = torch.randint(base.config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    rows: list[list[object]] = []
    for algorithm in optimizers:
        train: dict[str, Callable[[], object]] = {}
        step: dict[str, Callable[[], object]] = {}
        for mode, log_metrics in TELEMETRY_MODES.items():
            model = copy.deepcopy(base)
            opt = get_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, optimizer=algorithm, log_metrics=log_metrics), model)

            def train_step(model: GPT = model, opt: torch.optim.Optimizer = opt) -> object:
                opt.zero_grad()
                model.loss(tokens).backward()
                return opt.step()

            train[mode] = _synced(train_step, device)
            step[mode] = _synced(opt.step, device)  # the gradients of the last training step, stepped again
        train_medians = round_robin_medians(train, repeats)
        step_medians = round_robin_medians(step, repeats)
        for mode in TELEMETRY_MODES:
            rows.append([
                algorithm, mode, train_medians[mode] * 1e3, train_medians[mode] / train_medians["off"],
                step_medians[mode] * 1e3, step_medians[mode] / step_medians["off"],
            ])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--telemetry", action="store_true", help="log_metrics off against on (training step and step alone)")
    parser.add_argument("--batch", type=int, default=8, help="--telemetry: sequences per training step")
    parser.add_argument("--seq", type=int, default=128, help="--telemetry: tokens per sequence")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    model_size = sum(p.numel() for p in _model(args.hidden, args.layers).parameters())
    print(f"GPT hidden={args.hidden} layers={args.layers}: {model_size / 1e6:.1f}M parameters, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.telemetry:
        rows = telemetry_overhead(args.hidden, args.layers, args.repeats, batch=args.batch, seq=args.seq, device=torch.device(args.device))
        headers = ["optimizer", "log_metrics", "train step (ms)", "vs off", "step alone (ms)", "vs off"]
        print(f"batch {args.batch} x {args.seq} tokens on {args.device}")
        print(tabulate(rows, headers=headers, floatfmt=".3f"))
        return
    rows = compare(args.hidden, args.layers, args.repeats)
    print(tabulate(rows, headers=["optimizer", "median step (ms)", "vs torch AdamW foreach"], floatfmt=".2f"))


if __name__ == "__main__":
    main()
