"""accelerate with FSDP2: ``accelerator.prepare(model, optimizer)`` on an optzoo optimizer.

Two CPU processes (gloo), nothing downloaded (a tiny random Llama, the bytes of the standard
library as data)::

    torchrun --standalone --nproc-per-node 2 examples/accelerate_fsdp2.py --max-steps 6 --inf-at-step 3

``prepare`` shards the model (``fully_shard`` registers a new DTensor param under each name) and
re-points the optimizer's ``param_groups`` at the new params. optzoo follows that re-pointing by
name at the next step, so its global grad norm, its clipping (``clip_grad``) and its inf/NaN skip
keep working on the sharded params; ``--inf-at-step`` writes an inf into one gradient on rank 0 to
show the skip (every rank skips; params and state are left as they were).

accelerate selects FSDP only on accelerator devices; on CPU this script sets
``AcceleratorState.distributed_type`` to FSDP by hand (as ``tests/distributed/test_accelerate_fsdp2.py``
does), after which ``prepare`` runs accelerate's own FSDP2 code. With GPUs, launch with
``accelerate launch --use_fsdp --fsdp_version 2`` (or pass an ``fsdp_plugin``) and drop that step.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType

from optzoo import OptimizerConfig, get_optimizer
from optzoo.demo import stdlib_bytes
from optzoo.hf import build_hf_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--inf-at-step", type=int, default=0, help="write an inf into a gradient at this step (0: never)")
    parser.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    args = parser.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        print("error: run under torchrun with 2 or more processes (see the docstring)", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    model = build_hf_model("LlamaConfig")
    # fp32 params: accelerate's mixed precision computes in bf16 on them (keep optzoo's bf16=False)
    optimizer = get_optimizer(OptimizerConfig(optimizer="muon", lr=3e-3, weight_decay=0.1, clip_grad=1.0, muon_fp32_matmul_prec="highest"), model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision)
    if accelerator.distributed_type != DistributedType.FSDP:  # CPU: accelerate does not pick FSDP itself
        if args.mixed_precision != "no":
            plugin.set_mixed_precision(args.mixed_precision)
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    model, prepared = accelerator.prepare(model, optimizer)

    data = stdlib_bytes(50_000)
    rank = accelerator.process_index
    for step in range(1, args.max_steps + 1):
        start = (step * accelerator.num_processes + rank) * 4 * 64
        batch = data[start : start + 4 * 64].view(4, 64)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        if step == args.inf_at_step and rank == 0:
            next(p for p in model.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = math.inf
        success, grad_norm, _ = optimizer.step()  # optzoo's own step (accelerate's wrapper drops its value)
        prepared.zero_grad()
        total = accelerator.reduce(loss.detach(), reduction="mean")
        if accelerator.is_main_process:
            shown = "skipped (inf/NaN gradient)" if not success else f"grad_norm {grad_norm:.4f}"
            print(f"step {step}: loss {total.item():.4f} {shown}", flush=True)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    exit_code = main()
    # torch 2.14 + gloo: the process group outlives destroy_process_group here (DTensor's sharding
    # caches keep the FSDP2 mesh, and so the group, alive), so its worker threads are still running
    # at interpreter exit. One of them dropping the last reference to a tensor from a finished
    # collective then needs the interpreter lock during finalization, and the process aborts
    # ("terminate called without an active exception"). Training and end_training are done; leave
    # without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
