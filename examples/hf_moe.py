"""Route and train a tiny Hugging Face mixture-of-experts model with Muon + AdamW, no tags needed.

Runs on CPU in seconds; nothing is downloaded: the model is ``Qwen3MoeConfig`` (or any causal LM
config class, ``--config``) with optzoo's tiny sizes (4 experts of 32) and random init, the data is
the bytes of the standard library's source::

    .venv/bin/python examples/hf_moe.py --max-steps 20

optzoo reads each parameter's role from the model (``optzoo.infer_roles``): the expert stacks
(``mlp.experts.gate_up_proj``, ``[experts, rows, cols]``) and the routers go to Muon, which
orthogonalises every expert's matrix on its own; the embeddings, the head, the norms and the
biases go to AdamW (``muon_scalar_optimizer``). It prints the groups, the roles it read, then one
``step N: loss X`` line per step.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from tabulate import tabulate

from optzoo import OptimizerConfig, get_optimizer, infer_roles
from optzoo.demo import stdlib_bytes
from optzoo.hf import build_hf_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="Qwen3MoeConfig", help="a transformers config class (default: Qwen3MoeConfig)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = build_hf_model(args.config)
    config = OptimizerConfig(
        optimizer="muon", lr=2e-3, weight_decay=0.1, muon_extra_scale_factor=0.2, muon_fp32_matmul_prec="highest",
    )  # fmt: skip
    optimizer = get_optimizer(config, model)

    roles = infer_roles(model)
    by_role = collections.Counter(role for p in model.parameters() for role in roles[id(p)].roles)
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} params; roles: "
          + ", ".join(f"{role} {count}" for role, count in sorted(by_role.items())))  # fmt: skip
    for group in optimizer.param_groups:
        print(f"  {group['optimizer']} lr={group['lr']:g} wd={group['weight_decay']:g}: {len(group['params'])} params")
    experts = [name for name, p in model.named_parameters() if "expert" in roles[id(p)]]
    muon_names = {name for g in optimizer.param_groups if g["optimizer"] == "muon" for name in g["param_names"]}
    print(tabulate([[name, "x".join(map(str, dict(model.named_parameters())[name].shape)), name in muon_names] for name in experts[:4]],
                   headers=["expert parameter", "shape", "on Muon"]))  # fmt: skip

    data = stdlib_bytes(1_000_000)
    generator = torch.Generator().manual_seed(0)
    started, loss = time.perf_counter(), torch.tensor(float("nan"))
    for step in range(1, args.max_steps + 1):
        starts = torch.randint(len(data) - args.seq_len, (args.batch_size,), generator=generator)
        ids = torch.stack([data[s : s + args.seq_len] for s in starts.tolist()])
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        ok, grad_norm, _ = optimizer.step()
        print(f"step {step}: loss {loss.item():.4f} grad_norm {grad_norm:.3f}{'' if ok else ' (skipped)'}")
    print(f"took {time.perf_counter() - started:.1f} s")
    print(f"final loss {loss.item():.4f} after {args.max_steps} steps")


if __name__ == "__main__":
    main()
