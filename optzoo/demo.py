"""The main job: route, then train the built-in GPT on the standard library's own source.

Run with ``make demo`` (or ``python -m optzoo.demo``). The data ships with Python: the bytes of
the ``.py`` files next to the ``os`` module, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from tabulate import tabulate

from optzoo.cli import GROUP_HEADERS, group_rows
from optzoo.config import OptimizerConfig
from optzoo.factory import get_optimizer
from optzoo.groups import get_standard_config_overrides, resolve_groups
from optzoo.models import GPT, GPTConfig
from routing import ParamKey


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


def run_demo(*, steps: int = 60, batch_size: int = 16, seq_len: int = 128, seed: int = 0) -> list[float]:
    """Print the parameter groups, train for ``steps`` and print loss per step range."""
    torch.manual_seed(seed)
    data = stdlib_bytes()
    split = int(0.9 * len(data))
    train, valid = data[:split], data[split:]
    model = GPT(GPTConfig(hidden_size=128, num_layers=2, num_heads=4, max_seq_len=seq_len))
    config = OptimizerConfig(lr=3e-3, decoupled_lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    overrides = demo_routing(config)

    groups, _ = resolve_groups(config, model, overrides)
    print(f"optzoo demo: GPT with {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(data):,} bytes of the standard library ({torch.get_num_threads()} threads)\n")
    print(tabulate(group_rows(groups), headers=GROUP_HEADERS, tablefmt="simple"))
    print()

    optimizer = get_optimizer(config, model, overrides)
    generator = torch.Generator().manual_seed(seed)

    def batch(source: torch.Tensor) -> torch.Tensor:
        starts = torch.randint(len(source) - seq_len - 1, (batch_size,), generator=generator)
        return torch.stack([source[s : s + seq_len + 1] for s in starts.tolist()])

    losses, norms = [], []
    started = time.perf_counter()
    for _ in range(steps):
        loss = model.loss(batch(train))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        _, grad_norm, _ = optimizer.step()
        losses.append(loss.item())
        norms.append(grad_norm or 0.0)
    elapsed = time.perf_counter() - started
    with torch.no_grad():
        valid_loss = sum(model.loss(batch(valid)).item() for _ in range(4)) / 4

    span = max(1, steps // 6)
    rows = [
        [f"{i + 1}-{min(i + span, steps)}", sum(losses[i : i + span]) / len(losses[i : i + span]),
         sum(norms[i : i + span]) / len(norms[i : i + span])]
        for i in range(0, steps, span)
    ]
    print(tabulate(rows, headers=["steps", "mean train loss (nats/byte)", "mean grad norm"], floatfmt=".3f"))
    print(f"\nvalidation loss after {steps} steps: {valid_loss:.3f} nats/byte "
          f"(uniform over bytes: {torch.log(torch.tensor(256.0)).item():.3f}); "
          f"{elapsed / steps * 1000:.0f} ms/step")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    run_demo(steps=parser.parse_args().steps)


if __name__ == "__main__":
    main()
