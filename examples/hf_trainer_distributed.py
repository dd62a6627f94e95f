"""``transformers.Trainer`` + DDP + optzoo's layer-wise distributed optimizer: save, then resume.

Two CPU processes (gloo), nothing downloaded (a tiny random Llama, the bytes of the standard
library as data)::

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_distributed.py --max-steps 6

Trainer builds the optimizer itself from ``optimizer_cls_and_kwargs=trainer_optimizer(config)``
(``get_optimizer`` on the model it trains) and wraps the model in DDP. With
``use_layer_wise_distributed_optimizer`` each rank keeps the state of the params it owns, so the
optimizer's ``state_dict()`` gathers from every rank, while Trainer saves it on rank 0 alone:
``GatherOptimizerState`` gathers it on every rank when Trainer has decided to save, and rank 0's
save then needs no other rank.

The script trains ``--max-steps`` steps, saving a checkpoint every ``--max-steps // 2`` steps, then
starts a second Trainer from a fresh model with ``resume_from_checkpoint`` at the half-way
checkpoint, and checks that it ends with the first run's params and optimizer state, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from optzoo import OptimizerConfig
from optzoo.demo import stdlib_bytes
from optzoo.hf import build_hf_model
from optzoo.trainer import GatherOptimizerState, trainer_optimizer


class ByteWindows(Dataset[dict[str, torch.Tensor]]):
    """Non-overlapping windows of ``seq_len`` bytes as ``input_ids`` and ``labels`` (the model shifts them)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.windows = data[: len(data) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


class PrintLoss(TrainerCallback):
    """Rank 0 prints ``step N: loss X`` for every logged loss."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs and state.is_world_process_zero:
            print(f"step {state.global_step}: loss {logs['loss']:.4f}", flush=True)


def train(output_dir: str, max_steps: int, save_steps: int, resume: str | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One Trainer run; its final params and optimizer state dict (a collective: every rank calls it)."""
    torch.manual_seed(0 if resume is None else 1)  # a resumed run takes everything from its checkpoint
    model = build_hf_model("LlamaConfig")
    config = OptimizerConfig(
        optimizer="muon", lr=3e-3, decoupled_lr=1e-3, weight_decay=0.1, muon_fp32_matmul_prec="highest",
        use_layer_wise_distributed_optimizer=True,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, ddp_backend="gloo", report_to=[], max_steps=max_steps,
        per_device_train_batch_size=4, logging_steps=1, save_strategy="steps", save_steps=save_steps,
        max_grad_norm=0.0,  # optzoo clips (config.clip_grad)
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=ByteWindows(stdlib_bytes(100_000), 64),
        optimizer_cls_and_kwargs=trainer_optimizer(config), callbacks=[GatherOptimizerState(), PrintLoss()],
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=resume)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return params, trainer.optimizer.state_dict()


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two nested state dicts differ (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=6)
    args = parser.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        print("error: run under torchrun with 2 or more processes (see the docstring)", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    half = max(1, args.max_steps // 2)
    with tempfile.TemporaryDirectory() as local:
        shared = [local]
        dist.init_process_group("gloo")
        dist.broadcast_object_list(shared, src=0)  # one folder for every rank: rank 0 writes the checkpoint there
        root = shared[0]
        if dist.get_rank() == 0:
            print("-- training, saving a checkpoint every", half, "steps", flush=True)
        whole = train(os.path.join(root, "whole"), args.max_steps, half, None)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"-- resuming a fresh model from checkpoint-{half}", flush=True)
        resumed = train(os.path.join(root, "resumed"), args.max_steps, half, os.path.join(root, "whole", f"checkpoint-{half}"))
        dist.barrier()  # rank 0's folder outlives every rank's last read
    found = differences(whole[0], resumed[0]) + differences(whole[1], resumed[1])
    if found:
        print(f"error: rank {dist.get_rank()}: the resumed run differs from the uninterrupted one at {found[:5]}", file=sys.stderr)
        return 1
    if dist.get_rank() == 0:
        print("resumed run matches the uninterrupted run: params and optimizer state, bit for bit")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
