"""The main job: route, then train the built-in GPT on the standard library's own source.

Run with ``make demo`` (or ``python -m optzoo.demo``). The data ships with Python: the bytes of
the ``.py`` files next to the ``os`` module, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from optzoo.config import OptimizerConfig
from optzoo.factory import get_optimizer
from optzoo.groups import get_standard_config_overrides, resolve_group_configs
from optzoo.models import GPT, GPTConfig
from optzoo.reporting import GROUP_HEADERS, fit_table, group_rows, output_width
from optzoo.routing import ParamKey

__all__ = ["RUNS", "demo_routing", "muon_routing", "run_demo", "stdlib_bytes"]


def stdlib_bytes(limit: int = 4_000_000) -> torch.Tensor:
    """Up to ``limit`` bytes of the standard library's source, in sorted file order."""
    root = Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def demo_routing(config: OptimizerConfig) -> dict[ParamKey, dict[str, object]]:
    """The demo's realistic routing: the standard overrides plus Lion on the MLP matrices.

    Standard overrides: no weight decay on biases and norms, ``decoupled_lr`` on the
    embedding and output layer. On top: Lion (with its usual ~10x smaller lr) for the MLP
    weight matrices; AdamW for the rest.
    """
    overrides: dict[ParamKey, dict[str, object]] = dict(get_standard_config_overrides(config))
    overrides[ParamKey(name="decoder.layers.*.mlp.linear_fc*.weight")] = {"optimizer": "lion", "lr": 3e-4}
    return overrides


def muon_routing(config: OptimizerConfig) -> dict[ParamKey, dict[str, object]]:
    """Muon for the hidden matrices: the standard overrides are enough, since Muon hands
    embeddings, the output layer, biases and norms to ``muon_scalar_optimizer`` (AdamW) itself.
    With ``muon_scale_mode="spectral"`` (x sqrt(max(rows, cols))) Muon takes AdamW's lr."""
    return dict(get_standard_config_overrides(config))


RUNS: dict[str, tuple[OptimizerConfig, Callable[[OptimizerConfig], dict[ParamKey, dict[str, object]]]]] = {
    "AdamW + Lion (routed)": (OptimizerConfig(lr=3e-3, decoupled_lr=1e-3, weight_decay=0.1), demo_routing),
    "AdamW": (OptimizerConfig(lr=3e-3, decoupled_lr=1e-3, weight_decay=0.1), get_standard_config_overrides),
    "Muon + AdamW": (
        OptimizerConfig(optimizer="muon", lr=3e-3, decoupled_lr=1e-3, weight_decay=0.1, muon_fp32_matmul_prec="highest"),
        muon_routing,
    ),
}
"""The demo's runs: same model init, same batches; only the optimizer routing differs."""


def _train(
    name: str, steps: int, seed: int, seq_len: int, batch_size: int, train: torch.Tensor, valid: torch.Tensor
) -> tuple[list[float], float, float, float]:
    """Train a fresh model with run ``name``; returns train losses, validation loss, ms per step
    after the first, and ms of the first step (with any one-off compilation)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(hidden_size=128, num_layers=2, num_heads=4, max_seq_len=seq_len))
    config, routing = RUNS[name]
    optimizer = get_optimizer(config, model, routing(config))
    generator = torch.Generator().manual_seed(seed)

    def batch(source: torch.Tensor) -> torch.Tensor:
        starts = torch.randint(len(source) - seq_len - 1, (batch_size,), generator=generator)
        return torch.stack([source[s : s + seq_len + 1] for s in starts.tolist()])

    losses, times = [], []
    for _ in tqdm(range(steps), desc=name, leave=False):
        started = time.perf_counter()
        loss = model.loss(batch(train))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - started)
    with torch.no_grad():
        valid_loss = sum(model.loss(batch(valid)).item() for _ in range(4)) / 4
    # The first step holds one-off work (state allocation; on a GPU, emerging-optimizers' compile of
    # Lion's update), so it is reported apart from the steady state.
    steady = times[1:] or times
    return losses, valid_loss, sum(steady) / len(steady) * 1000, times[0] * 1000


def run_demo(*, steps: int = 120, batch_size: int = 16, seq_len: int = 128, seed: int = 0) -> dict[str, list[float]]:
    """Print the parameter groups of two routings, train every run, print loss per step range."""
    # torch warns "No CUDA runtime is found, using CUDA_HOME=..." when emerging-optimizers compiles
    # on a CPU machine that has a CUDA toolkit: true, and of no use to someone running the demo.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    data = stdlib_bytes()
    split = int(0.9 * len(data))
    train, valid = data[:split], data[split:]
    model = GPT(GPTConfig(hidden_size=128, num_layers=2, num_heads=4, max_seq_len=seq_len))
    print(f"optzoo demo: GPT with {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(data):,} bytes of the standard library ({torch.get_num_threads()} threads)")
    for name in ("AdamW + Lion (routed)", "Muon + AdamW"):
        config, routing = RUNS[name]
        groups, _ = resolve_group_configs(config, model, routing(config))
        print(f"\nparameter groups, {name}:")
        print(fit_table(group_rows(groups), GROUP_HEADERS, output_width(), details=[GROUP_HEADERS.index("other overrides")]))

    results = {name: _train(name, steps, seed, seq_len, batch_size, train, valid) for name in RUNS}
    span = max(1, steps // 6)
    rows = [
        [f"{i + 1}-{min(i + span, steps)}", *(sum(r[0][i : i + span]) / len(r[0][i : i + span]) for r in results.values())]
        for i in range(0, steps, span)
    ]
    rows.append(["validation", *(r[1] for r in results.values())])
    rows.append(["ms/step (after the first)", *(r[2] for r in results.values())])
    rows.append(["first step ms", *(r[3] for r in results.values())])
    print(f"\nmean train loss per step range (nats/byte; uniform over bytes: {torch.log(torch.tensor(256.0)).item():.3f})")
    print(fit_table(rows, ["steps", *results], output_width(), wrap=[0], floatfmt=".3f"))
    return {name: r[0] for name, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=120)
    run_demo(steps=parser.parse_args().steps)


if __name__ == "__main__":
    main()
