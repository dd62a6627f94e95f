"""The distributed optimizers on 1, 2 and 4 CPU ranks: step time, optimizer state and Newton–Schulz work per rank.

Run: ``.venv/bin/python -m benchmarks.bench_distributed`` (prints two tables; ``--only ddp`` or
``--only fsdp`` prints one). Each world size is
one set of spawned processes (gloo, a file store), and each rank runs with
``torch.set_num_threads(1)``: 4 ranks on a 2-core machine share the cores, so there the step
times show the cost of oversubscription and communication, not a speedup.

Every rank builds the same GPT (bf16 params by default, so the optimizers keep fp32 main params)
and fills its gradients from the same seeded generator: no backward, and gradients agree across
ranks as they would after DDP. The candidates (1 rank: ``get_optimizer`` without flags as the
baseline; every world: sharded Adam, i.e. ``use_distributed_optimizer``, with ``param_sync``
all_gather and broadcast, layer-wise Adam and layer-wise Muon) each step their own copy of the
model; after warm-up they take turns within each repeat, every step starting behind a barrier.
A step's time is the slowest rank's; the table shows the median over repeats. State is measured
from the tensors each rank holds: optimizer state plus fp32 main params that are not the model's
own storage.

The FSDP2 table (:func:`measure_fsdp`): every rank ``fully_shard``s the GPT (each layer, then the
root) over a 1-D mesh and steps Muon with ``muon_fsdp_orthogonalize="owner"`` and
``"redundant"``, taking turns as above. ``torch.utils.flop_counter.FlopCounterMode`` counts each
rank's FLOPs over one extra step (they are all Newton–Schulz's: the rest of a step has no
matmuls), ``CommDebugMode`` counts the collectives of that step, and the bytes each rank receives
for Newton–Schulz are counted from the all-to-alls (owner) or computed from the shards
(redundant: every rank receives the other ranks' pieces of every matrix). NCCL is the same code
(``torch.distributed`` collectives) but needs GPUs; on this machine only gloo runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

from optzoo import OptimizerConfig, get_optimizer
from optzoo.models import GPT, GPTConfig

ADAM = OptimizerConfig(lr=1e-3, weight_decay=0.1)
# "highest": on CPU, bf16 matmuls gain nothing (Newton–Schulz would say so and use it anyway).
MUON = OptimizerConfig(optimizer="muon", lr=1e-3, weight_decay=0.1, muon_fp32_matmul_prec="highest")
SHARDED = {"use_distributed_optimizer": True}
LAYER_WISE = {"use_layer_wise_distributed_optimizer": True}
# name -> (config, get_optimizer's param_sync, the 1-rank baseline its state is compared with)
CANDIDATES: dict[str, tuple[OptimizerConfig, str, str]] = {
    "plain adam (no flags)": (ADAM, "all_gather", "plain adam (no flags)"),
    "plain muon (no flags)": (MUON, "all_gather", "plain muon (no flags)"),
    "sharded adam": (ADAM.replace(**SHARDED), "all_gather", "plain adam (no flags)"),
    "sharded adam, broadcast": (ADAM.replace(**SHARDED), "broadcast", "plain adam (no flags)"),
    "layer-wise adam": (ADAM.replace(**LAYER_WISE), "all_gather", "plain adam (no flags)"),
    "layer-wise muon": (MUON.replace(**LAYER_WISE), "all_gather", "plain muon (no flags)"),
}
BASELINES = ("plain adam (no flags)", "plain muon (no flags)")


# ---- spawning ranks --------------------------------------------------------------------------


def _entry(rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))  # fmt: skip
        try:
            result = {"ok": fn(rank, world, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(tmp) / f"rank{rank}.pt")


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 1200.0) -> list[Any]:
    """``[fn(rank, world, *args) for every rank]``, each rank a spawned process in one gloo group."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        processes = [context.Process(target=_entry, args=(r, world, tmp, fn, args), daemon=True) for r in range(world)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
        paths = [Path(tmp) / f"rank{r}.pt" for r in range(world)]
        results = [torch.load(p, weights_only=False) if p.exists() else {"error": "no result (killed or timed out)"} for p in paths]
    errors = [f"rank {r}: {result['error']}" for r, result in enumerate(results) if "error" in result]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [result["ok"] for result in results]


# ---- one rank --------------------------------------------------------------------------------


def _model(shape: GPTConfig, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)  # the same weights on every rank
    model = GPT(shape).to(dtype)
    generator = torch.Generator().manual_seed(1)  # the same gradients on every rank, as after DDP
    for param in model.parameters():
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(dtype)
    return model


def state_bytes(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> int:
    """Optimizer state tensors plus main params that are not the model's own storage, as held."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tensors = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tensors += [p for g in optimizer.param_groups for p in g["params"] if p.untyped_storage().data_ptr() not in own]
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(unique.values())


def _rank_main(rank: int, world: int, shape: GPTConfig, dtype: torch.dtype, warmup: int, repeats: int) -> dict[str, Any]:
    """Every candidate's step times (seconds) and state bytes on this rank."""
    names = [n for n in CANDIDATES if world == 1 or n not in BASELINES]
    models, optimizers = {}, {}
    for name in names:
        config, param_sync, _ = CANDIDATES[name]
        models[name] = _model(shape, dtype)
        config = config.replace(bf16=dtype == torch.bfloat16)
        distributed = config.use_distributed_optimizer or config.use_layer_wise_distributed_optimizer
        kwargs: dict[str, Any] = {"param_sync": param_sync} if distributed else {}
        optimizers[name] = get_optimizer(config, models[name], **kwargs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(warmup + repeats):
        for name in names:  # taking turns: load drift hits every candidate alike
            dist.barrier()
            started = time.perf_counter()
            optimizers[name].step()
            if repeat >= warmup:
                times[name].append(time.perf_counter() - started)
    return {name: {"times": times[name], "state_bytes": state_bytes(optimizers[name], models[name])} for name in names}


# ---- the table -------------------------------------------------------------------------------


def measure(
    worlds: tuple[int, ...] = (1, 2, 4), *, hidden: int = 256, layers: int = 4, vocab: int = 4096,
    dtype: torch.dtype = torch.bfloat16, warmup: int = 2, repeats: int = 10,
) -> tuple[int, list[list[Any]]]:
    """(model size, rows of ranks, setup, median step ms, state bytes min/max per rank, max vs 1 rank)."""
    shape = GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=4, vocab_size=vocab, max_seq_len=256)
    size = sum(p.numel() for p in GPT(shape).parameters())
    if 1 not in worlds:
        raise ValueError(f"`worlds`: must include 1 (the baseline); got {worlds}; expected e.g. (1, 2, 4)")
    rows: list[list[Any]] = []
    baseline: dict[str, int] = {}
    for world in sorted(worlds):
        ranks = spawn(world, _rank_main, shape, dtype, warmup, repeats)
        for name in ranks[0]:
            slowest = [max(steps) for steps in zip(*(r[name]["times"] for r in ranks))]
            median = sorted(slowest)[len(slowest) // 2]
            held = [r[name]["state_bytes"] for r in ranks]
            if world == 1 and name in BASELINES:
                baseline[name] = held[0]
            ratio = max(held) / baseline[CANDIDATES[name][2]]
            rows.append([world, name, median * 1e3, min(held), max(held), ratio])
    return size, rows


# ---- FSDP2 Muon: owner-computes against redundant ---------------------------------------------

FSDP_MODES = ("owner", "redundant")


def _fsdp_rank(rank: int, world: int, shape: GPTConfig, warmup: int, repeats: int) -> dict[str, Any]:
    """Per mode: step times, FLOPs and collectives of one step, Newton–Schulz bytes received."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils.flop_counter import FlopCounterMode

    from optzoo.distributed import preserve_param_attributes

    mesh = init_device_mesh("cpu", (world,))
    models, optimizers = {}, {}
    for mode in FSDP_MODES:
        torch.manual_seed(0)
        model = GPT(shape)
        with preserve_param_attributes(model):
            for layer in model.decoder.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        generator = torch.Generator().manual_seed(1)
        for param in model.parameters():
            assert isinstance(param, DTensor)
            param.grad = distribute_tensor(torch.randn(param.shape, generator=generator) * 1e-3, mesh, param.placements)
        models[mode] = model
        optimizers[mode] = get_optimizer(MUON.replace(muon_fsdp_orthogonalize=mode), model, lint=False)
    times: dict[str, list[float]] = {mode: [] for mode in FSDP_MODES}
    for repeat in range(warmup + repeats):
        for mode in FSDP_MODES:
            dist.barrier()
            started = time.perf_counter()
            optimizers[mode].step()
            if repeat >= warmup:
                times[mode].append(time.perf_counter() - started)
    out: dict[str, Any] = {}
    received: list[int] = []
    original = dist.all_to_all_single

    def counting(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], *args: Any, **kwargs: Any) -> Any:
        received.append((sum(output_split_sizes) - output_split_sizes[rank]) * output.element_size())
        return original(output, input, output_split_sizes, *args, **kwargs)

    for mode in FSDP_MODES:
        received.clear()
        flops, comms = FlopCounterMode(display=False), CommDebugMode()
        dist.all_to_all_single = counting  # type: ignore[assignment]
        try:
            with flops, comms:
                optimizers[mode].step()
        finally:
            dist.all_to_all_single = original
        matrices = [p for g in optimizers[mode].param_groups if g["optimizer"] == "muon" for p in g["params"]]
        if mode == "redundant":  # each matrix's direction (fp32), gathered: the other ranks' pieces
            nbytes = sum((p.numel() - p.to_local().numel()) * 4 for p in matrices)
        else:
            nbytes = sum(received)
        counts = {str(k).rsplit(".", 1)[-1]: v for k, v in comms.get_comm_counts().items()}
        out[mode] = {"times": times[mode], "flops": flops.get_total_flops(), "collectives": counts, "bytes": nbytes}
    return out


def measure_fsdp(
    worlds: tuple[int, ...] = (1, 2, 4), *, hidden: int = 512, layers: int = 6, vocab: int = 6144, warmup: int = 1,
    repeats: int = 5,
) -> tuple[int, list[list[Any]]]:
    """(model size, rows of ranks, mode, median step ms, GFLOPs per rank (max), vs 1 process,
    collectives per step, MB received per rank for Newton–Schulz (max), owner / redundant step time)."""
    shape = GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64), vocab_size=vocab, max_seq_len=256)
    size = sum(p.numel() for p in GPT(shape).parameters())
    rows: list[list[Any]] = []
    single: float | None = None
    for world in sorted(worlds):
        ranks = spawn(world, _fsdp_rank, shape, warmup, repeats)
        medians = {}
        for mode in FSDP_MODES:
            slowest = [max(steps) for steps in zip(*(r[mode]["times"] for r in ranks))]
            medians[mode] = sorted(slowest)[len(slowest) // 2]
        for mode in FSDP_MODES:
            flops = max(r[mode]["flops"] for r in ranks)
            if world == 1 and mode == "redundant":
                single = flops
            collectives = ", ".join(f"{n} {name}" for name, n in sorted(ranks[0][mode]["collectives"].items()))
            rows.append([
                world, mode, medians[mode] * 1e3, flops / 1e9, flops / single if single else None, collectives or "none",
                max(r[mode]["bytes"] for r in ranks) / 2**20, medians[mode] / medians["redundant"],
            ])  # fmt: skip
    return size, rows


FSDP_HEADERS = [
    "ranks", "Newton–Schulz on", "median step (ms)", "GFLOPs/rank (max)", "vs 1 process", "collectives per step",
    "NS MB received/rank", "step vs redundant",
]  # fmt: skip


def test_fsdp_owner_computes_on_1_and_2_ranks() -> None:
    """Runs once in the suite: a tiny GPT, one repeat; the FLOPs split as owner-computes says."""
    _, rows = measure_fsdp((1, 2), hidden=64, layers=2, vocab=64, warmup=0, repeats=1)
    by = {(r[0], r[1]): r for r in rows}
    assert by[1, "owner"][3] == by[1, "redundant"][3]  # one rank: nothing to share
    assert by[2, "redundant"][4] == 1.0  # every rank does everything
    assert by[2, "owner"][4] <= 0.55
    assert "alltoall_base_" in by[2, "owner"][5] and "all_gather_into_tensor" in by[2, "redundant"][5]
    # Bytes received per rank, as fractions of all matrices' fp32 bytes: redundant (N-1)/N; owner
    # (N-1)/N² of its own matrices' pieces plus its pieces of the others' results: 2(N-1)/N², equal at N = 2.
    assert by[2, "owner"][6] == pytest.approx(by[2, "redundant"][6], rel=1e-9) and by[2, "owner"][6] > 0


HEADERS = ["ranks", "setup", "median step (ms)", "state MB/rank min", "state MB/rank max", "max state vs 1 rank"]


def test_measure_on_1_and_2_ranks() -> None:
    """Runs once in the suite: a tiny model, one repeat; state splits as the plans say."""
    _, rows = measure((1, 2), hidden=32, layers=2, vocab=64, warmup=0, repeats=1)
    assert [(r[0], r[1]) for r in rows] == [(1, n) for n in CANDIDATES] + [(2, n) for n in CANDIDATES if n not in BASELINES]
    by = {(r[0], r[1]): r for r in rows}
    for name in CANDIDATES:
        assert by[1, name][5] == 1.0  # one rank holds everything, as without flags
    # Two ranks: every element's state and fp32 main param is held once. Sharded Adam cuts one
    # param in two, whose 4-byte `step` both pieces keep, and halves the elements to within one;
    # layer-wise ownership moves whole params, so its halves may differ more.
    adam = by[1, "plain adam (no flags)"][4]
    for name in ("sharded adam", "sharded adam, broadcast"):
        low, high = by[2, name][3], by[2, name][4]
        assert low + high == adam + 4, (name, low, high, adam)
        assert by[2, name][5] < 0.5 + 1e-3
    assert by[2, "layer-wise adam"][3] + by[2, "layer-wise adam"][4] == adam
    assert by[2, "layer-wise muon"][3] + by[2, "layer-wise muon"][4] == by[1, "plain muon (no flags)"][4]
    assert all(r[2] > 0 for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes; must include 1")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", choices=["ddp", "fsdp"], help="print one table: the DDP-style optimizers, or FSDP2 Muon")
    parser.add_argument("--fsdp-hidden", type=int, default=512, help="FSDP2 table: GPT width (512, 6 layers: ~25M)")
    parser.add_argument("--fsdp-layers", type=int, default=6)
    parser.add_argument("--fsdp-vocab", type=int, default=6144)
    parser.add_argument("--fsdp-repeats", type=int, default=5)
    args = parser.parse_args()
    where = f"1 thread per rank (torch.set_num_threads(1)) on {os.cpu_count()} cores; gloo; torch {torch.__version__}"
    if args.only != "fsdp":
        dtype = getattr(torch, args.dtype)
        size, rows = measure(tuple(args.ranks), hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                             dtype=dtype, warmup=args.warmup, repeats=args.repeats)  # fmt: skip
        print(f"GPT hidden={args.hidden} layers={args.layers} vocab={args.vocab}: {size / 1e6:.2f}M {args.dtype} parameters; {where}")
        table = [[*row[:3], row[3] / 2**20, row[4] / 2**20, row[5]] for row in rows]
        print(tabulate(table, headers=HEADERS, floatfmt=("g", "", ".1f", ".2f", ".2f", ".3f")))
    if args.only != "ddp":
        size, rows = measure_fsdp(tuple(args.ranks), hidden=args.fsdp_hidden, layers=args.fsdp_layers, vocab=args.fsdp_vocab,
                                  repeats=args.fsdp_repeats)  # fmt: skip
        print(f"\nFSDP2 Muon: GPT hidden={args.fsdp_hidden} layers={args.fsdp_layers} vocab={args.fsdp_vocab}: "
              f"{size / 1e6:.2f}M float32 parameters; {where}")  # fmt: skip
        print(tabulate(rows, headers=FSDP_HEADERS, floatfmt=("g", "", ".0f", ".2f", ".3f", "", ".2f", ".2f")))


if __name__ == "__main__":
    main()
