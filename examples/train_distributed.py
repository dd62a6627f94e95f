"""Train the built-in GPT with Muon under the layer-wise distributed optimizer, in torch DDP.

Run on CPU (gloo) or GPUs (NCCL, one per process); nothing is downloaded, the data is the bytes of
the standard library's source::

    .venv/bin/torchrun --nproc-per-node 2 examples/train_distributed.py --steps 20

Every rank builds the same model from the same seed and draws the same global batch, then feeds
its own slice of it to DDP, which averages the gradients. ``get_optimizer`` with
``use_layer_wise_distributed_optimizer=True`` gives each parameter one owner rank (balanced by
Newton–Schulz cost): only the owner keeps its optimizer state and computes its update, and the
updated parameters reach every rank after each step. Rank 0 prints the loss of the global batch;
at the end, each rank's share of the optimizer. ``--save DIR`` writes one consolidated checkpoint,
loadable with any number of ranks (``docs/distributed.md``). Without torchrun it runs as one rank.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from optzoo import OptimizerConfig, get_optimizer
from optzoo.demo import stdlib_bytes
from optzoo.distributed import DistributedOptimizer
from optzoo.models import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (sequences), split across ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5, help="also logged: the first and the last step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, metavar="DIR", help="write DIR/checkpoint.pt (model and optimizer)")
    return parser.parse_args()


def setup() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (or a one-rank group); returns rank, world, device."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state tensors this rank holds (fp32 params: no separate main copies)."""
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def lm_loss(ddp: DistributedDataParallel, tokens: torch.Tensor) -> torch.Tensor:
    """``GPT.loss``, but through DDP's forward, whose backward hooks average gradients across ranks."""
    logits = ddp(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    if args.batch_size % world:
        raise ValueError(f"`--batch-size`: must split evenly over {world} ranks; got {args.batch_size}; expected a multiple of {world}")
    torch.manual_seed(args.seed)  # the same init on every rank (DDP also broadcasts rank 0's)
    model = GPT(GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=4, max_seq_len=args.seq_len)).to(device)
    # Muon for the hidden matrices; it hands embeddings, the output layer, biases and norms to AdamW.
    config = OptimizerConfig(
        optimizer="muon", lr=args.lr, decoupled_lr=args.lr / 3, weight_decay=0.1,
        use_layer_wise_distributed_optimizer=True, muon_fp32_matmul_prec="highest",
    )  # fmt: skip
    optimizer = get_optimizer(config, model)  # the plain model: names without DDP's "module." prefix
    assert isinstance(optimizer, DistributedOptimizer)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    data = stdlib_bytes()
    generator = torch.Generator().manual_seed(args.seed)  # every rank draws the same global batch
    local = args.batch_size // world
    if rank == 0:
        print(f"GPT with {sum(p.numel() for p in model.parameters()):,} parameters on {world} rank(s), "
              f"{dist.get_backend()} backend, {device.type}; global batch {args.batch_size} x {args.seq_len} bytes")  # fmt: skip
    for step in range(1, args.steps + 1):
        starts = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=generator)
        tokens = torch.stack([data[s : s + args.seq_len + 1] for s in starts[rank * local : (rank + 1) * local].tolist()])
        optimizer.zero_grad()
        loss = lm_loss(ddp, tokens.to(device))
        loss.backward()  # type: ignore[no-untyped-call]
        success, grad_norm, _ = optimizer.step()
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # every rank joins: the loss of the global batch
            value = mean.item() / world
            if rank == 0:
                print(f"step {step:4d}  loss {value:.4f}  grad norm {grad_norm:.3f}" + ("" if success else "  (skipped)"), flush=True)
            if not math.isfinite(value):  # every rank holds the same value, so all stop together
                raise FloatingPointError(f"loss: not finite at step {step}; got {value}; expected a finite loss")

    owned = optimizer.plan.owned(optimizer.rank)
    mine = (len(owned), sum(s.stop - s.start for s in owned), state_bytes(optimizer))
    everyone: list[tuple[int, int, int] | None] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for other, counts in enumerate(everyone):
            assert counts is not None
            print(f"rank {other}: owns {counts[0]} params ({counts[1]:,} elements), optimizer state {counts[2]:,} bytes")
    if args.save is not None:
        state = optimizer.state_dict()  # a collective: every rank calls it, each gets the whole dict
        if rank == 0:
            args.save.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": state, "step": args.steps}, args.save / "checkpoint.pt")
            print(f"saved {args.save / 'checkpoint.pt'}")
        dist.barrier()  # nobody exits while rank 0 still writes


def main() -> None:
    args = parse_args()
    rank, world, device = setup()
    try:
        train(args, rank, world, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
