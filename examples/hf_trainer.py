"""Train a tiny Hugging Face Llama with ``transformers.Trainer`` and optzoo's Muon + AdamW.

Runs on CPU in seconds; nothing is downloaded: the model is ``LlamaConfig`` with optzoo's tiny
sizes and random init (``optzoo.hf.build_hf_model``), the tokenizer is the identity on bytes
(vocabulary 256), and the data is the bytes of the standard library's source::

    .venv/bin/python examples/hf_trainer.py --max-steps 20

``get_optimizer`` routes the attention and MLP matrices to Muon and hands the embeddings,
``lm_head`` and norms to AdamW (``muon_scalar_optimizer``); ``Trainer(optimizers=(optimizer,
scheduler))`` then drives it like any torch optimizer. Two settings matter:

* ``max_grad_norm=0``: optzoo clips inside ``step()`` (``OptimizerConfig.clip_grad``, default
  1.0, Megatron's), after its inf/NaN check. Trainer's own clipping would clip the same grads a
  second time, first, so optzoo's clip (and its norm) would see grads Trainer had already cut.
* ``step()`` returns ``(update_successful, grad_norm, num_zeros)`` instead of ``None``:
  Trainer (through accelerate's optimizer wrapper) ignores the value, so that is harmless.
  A step optzoo skips for an inf/NaN gradient still advances Trainer's step and the scheduler.

The scheduler is a torch ``LambdaLR`` (linear warmup, cosine decay to 10%): it scales each group's
own initial lr, so the groups keep their ratios (Muon's lr and AdamW's ``decoupled_lr``).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from optzoo import OptimizerConfig, get_optimizer
from optzoo.demo import stdlib_bytes
from optzoo.hf import build_hf_model


class ByteWindows(Dataset[dict[str, torch.Tensor]]):
    """Non-overlapping windows of ``seq_len`` bytes, as ``input_ids`` and ``labels``.

    Hugging Face causal LMs shift the labels themselves, so ``labels`` is ``input_ids``.
    """

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.windows = data[: len(data) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window, "labels": window}


class PrintLoss(TrainerCallback):
    """Prints ``step N: loss X`` for every logged loss, and keeps the losses."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            print(f"step {state.global_step}: loss {logs['loss']:.4f} lr {logs.get('learning_rate', float('nan')):.2e}")


def warmup_cosine(warmup: int, total: int) -> Any:
    """The ``LambdaLR`` factor: linear warmup over ``warmup`` steps, then cosine down to 0.1."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = build_hf_model("LlamaConfig")  # tiny, random init; optzoo reads its roles, no tags
    config = OptimizerConfig(
        optimizer="muon", lr=3e-3, decoupled_lr=1e-3, weight_decay=0.1, muon_fp32_matmul_prec="highest"
    )
    optimizer = get_optimizer(config, model)  # standard overrides: no decay on norms and biases
    for group in optimizer.param_groups:
        print(f"{group['optimizer']:>5} lr={group['lr']:.0e} wd={group['weight_decay']}: {len(group['params'])} params")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(max(1, args.max_steps // 10), args.max_steps))

    printer = PrintLoss()
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            use_cpu=True,
            report_to=[],
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            logging_steps=1,
            save_strategy="no",
            max_grad_norm=0.0,  # optzoo clips (config.clip_grad); see the module docstring
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=args.seed,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=ByteWindows(stdlib_bytes(200_000), args.seq_len),
            optimizers=(optimizer, scheduler),
            callbacks=[printer],
        )
        trainer.remove_callback(PrinterCallback)  # our callback prints one line per step instead
        trainer.train()
    if not printer.losses or not all(math.isfinite(loss) for loss in printer.losses):
        print(f"error: expected finite losses; got {printer.losses}", file=sys.stderr)
        return 1
    print(f"final loss {printer.losses[-1]:.4f} after {len(printer.losses)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
