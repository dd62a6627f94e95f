"""Train optzoo's built-in GPT with PyTorch Lightning, the optimizer from ``optzoo.get_optimizer``.

Runs on CPU in seconds; nothing is downloaded (the data is the bytes of the standard library's
source)::

    .venv/bin/python examples/lightning_example.py --max-steps 20

``configure_optimizers`` returns optzoo's optimizer (Muon for the hidden matrices, AdamW for the
rest) and a per-step ``LambdaLR``, and Lightning's *automatic* optimization drives it:

* Lightning calls ``optimizer.step(closure)``, where the closure runs ``training_step``, zeroes
  the grads and runs backward. optzoo's ``step`` runs the closure first (with grad enabled),
  then checks, clips and updates, so the closure's loss is the loss of the params before this
  update, as with any torch optimizer.
* ``step`` returns ``(update_successful, grad_norm, num_zeros)`` rather than the closure's loss:
  Lightning reads the loss from its closure, not from ``step``'s return value, so it does not mind.
* Leave ``gradient_clip_val`` unset: optzoo clips inside ``step`` (``OptimizerConfig.clip_grad``,
  default 1.0). Lightning's clipping would run first, inside the closure, on the same grads.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from optzoo import MixedPrecisionOptimizer, OptimizerConfig, get_optimizer
from optzoo.demo import stdlib_bytes
from optzoo.models import GPT, GPTConfig


class ByteWindows(Dataset[torch.Tensor]):
    """Non-overlapping windows of ``seq_len + 1`` bytes: ``GPT.loss`` predicts bytes 1..n from 0..n-1."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        size = seq_len + 1
        self.windows = data[: len(data) // size * size].view(-1, size)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]


class GPTModule(L.LightningModule):
    """The built-in GPT as a LightningModule; the optimizer comes from optzoo's routing."""

    def __init__(self, *, max_steps: int, seq_len: int) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(hidden_size=64, num_layers=2, num_heads=4, max_seq_len=seq_len))
        # The learned positions are untagged (as in Megatron), but the forward reads them by index:
        # optzoo routes them to AdamW as the table they are, with no tag needed.
        self.max_steps = max_steps
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        return self.model.loss(batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_index: int) -> None:
        loss = float(outputs["loss"])
        self.losses.append(loss)
        print(f"step {self.global_step}: loss {loss:.4f} lr {self.lr_schedulers().get_last_lr()[0]:.2e}")  # type: ignore[union-attr]

    def configure_optimizers(self) -> dict[str, Any]:
        config = OptimizerConfig(
            optimizer="muon", lr=3e-3, decoupled_lr=1e-3, weight_decay=0.1, muon_fp32_matmul_prec="highest"
        )
        optimizer: MixedPrecisionOptimizer = get_optimizer(config, self.model)
        for group in optimizer.param_groups:
            print(f"{group['optimizer']:>5} lr={group['lr']:.0e} wd={group['weight_decay']}: {len(group['params'])} params")
        warmup = max(1, self.max_steps // 10)

        def factor(step: int) -> float:  # linear warmup, then cosine down to 10%
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, self.max_steps - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore", message=".*does not have many workers.*")  # a 0-worker CPU demo
    L.seed_everything(args.seed, verbose=False)
    module = GPTModule(max_steps=args.max_steps, seq_len=args.seq_len)
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(
        ByteWindows(stdlib_bytes(200_000), args.seq_len), batch_size=args.batch_size, shuffle=True, generator=generator
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    if not module.losses or not all(math.isfinite(loss) for loss in module.losses):
        print(f"error: expected finite losses; got {module.losses}", file=sys.stderr)
        return 1
    print(f"final loss {module.losses[-1]:.4f} after {len(module.losses)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
