"""The distributed optimizers on 1, 2 and 4 CPU ranks: step time, optimizer state and Newton–Schulz work per rank.

**NCCL cannot run here.** Every table runs on gloo, with CPU ranks spawned on this machine. The
code under test is the same ``torch.distributed`` calls NCCL would run (all-to-alls, all-reduces,
all-gathers on the mesh's process groups), but NCCL needs GPUs, which this machine lacks, so no
number below is an NCCL number. The mesh table has ``--backend nccl`` (a GPU per rank) for a
machine that has them; it is written for one and has not run on one.

Run: ``.venv/bin/python -m benchmarks.bench_distributed`` (prints three tables; ``--only ddp``,
``--only fsdp`` or ``--only mesh`` prints one, and ``--only hsdp-2x2,tp-duplicated`` runs the
mesh table with just those modes). Each world size is one set of spawned processes (gloo, a file
store), and each rank runs with ``torch.set_num_threads(1)``: 4 ranks on a 2-core machine share
the cores, so there the step times show the cost of oversubscription and communication, not a
speedup.

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
for Newton–Schulz are counted from the all-to-alls (both paths exchange through them).

The mesh table (:func:`measure_mesh`, issue 27): Muon alone on the GPT's Muon-family matrices (as
the Muon recipe routes them; the AdamW part is the same in every mode), as DTensors placed the
way ``fully_shard`` and ``parallelize_module`` place them (:mod:`optzoo.mesh_plan`: the same
placements ``optzoo dump-param-groups --mesh`` plans, the default tensor-parallel plan), one mode
per row (:data:`MESH_MODES`): 1-D FSDP owner-computes and redundant, bucketed owner-computes
(``bucket_size`` an eighth of the matrices' fp32 bytes), HSDP 2 x 2 (4 ranks), and TP 2 in each
``tp_mode`` (alone on 2 ranks, under FSDP 2 on 4), and HSDP with each replica computing its own
copy (``per_replica``, to measure against sharing the work). The modes take turns as above.
Over one extra step per mode, each per-rank column the largest over the ranks: Newton–Schulz
FLOPs (``FlopCounterMode``, and their share of one process's), bytes sent and received counted
from the all-to-alls (beside the plan's), bytes all-reduced (``distributed``'s Grams), the plan's
transient bytes (its largest bucket) beside the measured peak (the most bytes of tensors created
during the step and alive at once, from the first bucket's issue on; two buckets are in flight),
the buckets, and the collectives (``CommDebugMode``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

from benchmarks._memory import LiveBytes, MarkAtFirstBucket
from optzoo import OptimizerConfig, get_optimizer
from optzoo.models import GPT, GPTConfig
from optzoo.optimizers.owner_compute import DEFAULT_BUCKET_SIZE

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


def _entry(rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple[Any, ...], backend: str = "gloo") -> None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        if backend == "nccl":  # one GPU per rank (written for GPU machines; not run on this one)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))  # fmt: skip
        try:
            result = {"ok": fn(rank, world, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(tmp) / f"rank{rank}.pt")


def spawn(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 1200.0, backend: str = "gloo") -> list[Any]:
    """``[fn(rank, world, *args) for every rank]``, each rank a spawned process in one group (gloo; nccl: a GPU each)."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        processes = [context.Process(target=_entry, args=(r, world, tmp, fn, args, backend), daemon=True) for r in range(world)]
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
        nbytes = sum(received)  # both paths exchange through all-to-alls (redundant: every rank its own owner)
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
    # Owner-computes: two all-to-alls per bucket (pieces out, results back); redundant: one (every
    # rank gathers every matrix through it and keeps its own result).
    assert "2 alltoall_base_" in by[2, "owner"][5] and "1 alltoall_base_" in by[2, "redundant"][5]
    # Bytes received per rank, as fractions of all matrices' fp32 bytes: redundant (N-1)/N; owner
    # (N-1)/N² of its own matrices' pieces plus its pieces of the others' results: 2(N-1)/N², equal at N = 2.
    assert by[2, "owner"][6] == pytest.approx(by[2, "redundant"][6], rel=1e-9) and by[2, "owner"][6] > 0


# ---- Muon on device meshes: every owner-computes mode side by side (issue 27, item 5) ---------


@dataclass(frozen=True)
class MeshMode:
    """One column of the mesh table: a device mesh per world size (``None``: it does not fit) and Muon's settings."""

    name: str
    mesh: Callable[[int], str | None]  # ``--mesh`` spec (:func:`optzoo.mesh_plan.parse_mesh`) on N ranks
    fsdp_orthogonalize: str = "owner"
    tp_mode: str = "auto"
    bucketed: bool = False  # bucket_size an eighth of the Muon matrices' fp32 bytes
    per_replica: bool = False  # HSDP: each replica computes its own copy instead of sharing the work


def _tp_mesh(world: int) -> str | None:
    return {2: "dp=1,tp=2", 4: "dp=2,tp=2"}.get(world)  # TP 2: alone on 2 ranks, under FSDP 2 on 4


MESH_MODES = {
    mode.name: mode
    for mode in [
        MeshMode("fsdp-owner", str),
        MeshMode("fsdp-redundant", str, fsdp_orthogonalize="redundant"),
        MeshMode("fsdp-bucketed", lambda w: str(w) if w > 1 else None, bucketed=True),
        MeshMode("hsdp-2x2", lambda w: "2x2" if w == 4 else None),
        MeshMode("hsdp-2x2-per-replica", lambda w: "2x2" if w == 4 else None, per_replica=True),
        MeshMode("tp-layer_sharded", _tp_mesh, tp_mode="layer_sharded"),
        MeshMode("tp-duplicated", _tp_mesh, tp_mode="duplicated"),
        MeshMode("tp-blockwise", _tp_mesh, tp_mode="blockwise"),
        MeshMode("tp-distributed", _tp_mesh, tp_mode="distributed"),
    ]
}
"""Every mode of the mesh table, by name (``--only NAME,...``)."""


def _muon_matrices(shape: GPTConfig) -> list[str]:
    """The GPT's params that the Muon recipe routes to the Muon family (the rest are AdamW's, the same in every mode)."""
    from optzoo.groups import resolve_group_configs
    from optzoo.mesh_plan import owner_computes_applies

    groups, _ = resolve_group_configs(MUON, [GPT(shape)])
    return [name for g in groups if owner_computes_applies(g) for name in g.param_names]


def _mesh_rank(rank: int, world: int, shape: GPTConfig, modes: list[str], warmup: int, repeats: int, device: str = "cpu") -> dict[str, Any]:
    """Per mode: step times; FLOPs, collectives, all-to-all bytes and peak transient bytes of one more step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils.flop_counter import FlopCounterMode

    from optzoo.mesh_plan import DEFAULT_TP_PLAN, mesh_placements, param_mesh, parse_mesh, tp_style
    from optzoo.optimizers.muon import Muon

    names = _muon_matrices(shape)
    torch.manual_seed(0)
    weights = dict(GPT(shape).named_parameters())
    generator = torch.Generator().manual_seed(1)
    grads = {name: (torch.randn(weights[name].shape, generator=generator) * 1e-3).to(device) for name in names}
    matrix_bytes = sum(4 * weights[name].numel() for name in names)
    optimizers: dict[str, Muon] = {}
    for name in modes:
        mode = MESH_MODES[name]
        spec = parse_mesh(mode.mesh(world) or "")
        device_mesh = init_device_mesh(device, spec.shape, mesh_dim_names=tuple(dim for dim, _ in spec.dims))
        params = []
        for param_name in names:
            style = tp_style(param_name, DEFAULT_TP_PLAN)[0] if "tp" in dict(spec.dims) else "replicate"
            home = tuple(dim for dim, _ in param_mesh(style, spec).dims)
            submesh = device_mesh if len(home) == len(spec.dims) else device_mesh[home]
            placements = mesh_placements(weights[param_name].shape, style, spec)
            param = torch.nn.Parameter(distribute_tensor(weights[param_name].detach().to(device), submesh, placements))
            param.grad = distribute_tensor(grads[param_name].clone(), submesh, placements)
            params.append(param)
        optimizers[name] = Muon(
            params, lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest", fsdp_orthogonalize=mode.fsdp_orthogonalize,  # type: ignore[arg-type]
            tp_mode=mode.tp_mode, bucket_size=max(1, matrix_bytes // 8) if mode.bucketed else DEFAULT_BUCKET_SIZE,  # type: ignore[arg-type]
        )  # fmt: skip
        optimizers[name]._per_replica = mode.per_replica
    times: dict[str, list[float]] = {name: [] for name in modes}
    for repeat in range(warmup + repeats):
        for name in modes:  # taking turns: load drift hits every mode alike
            dist.barrier()
            started = time.perf_counter()
            optimizers[name].step()
            if device == "cuda":
                torch.cuda.synchronize()
            if repeat >= warmup:
                times[name].append(time.perf_counter() - started)
    sent: list[int] = []
    received: list[int] = []
    original = dist.all_to_all_single

    def counting(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                 *args: Any, group: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        me = dist.get_rank(group)
        sent.append((sum(input_split_sizes) - input_split_sizes[me]) * input.element_size())
        received.append((sum(output_split_sizes) - output_split_sizes[me]) * output.element_size())
        return original(output, input, output_split_sizes, input_split_sizes, *args, group=group, **kwargs)

    reduced: list[int] = []
    original_reduce = dist.all_reduce

    def counting_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reduced.append(tensor.numel() * tensor.element_size())
        return original_reduce(tensor, *args, **kwargs)

    out: dict[str, Any] = {}
    for name in modes:
        sent.clear()
        received.clear()
        reduced.clear()
        probe, flops, comms = LiveBytes(), FlopCounterMode(display=False), CommDebugMode()
        optimizer = optimizers[name]
        optimizer.owner_compute_trace = MarkAtFirstBucket(probe)
        dist.all_to_all_single = counting  # type: ignore[assignment]
        dist.all_reduce = counting_reduce  # type: ignore[assignment]
        try:
            with flops, comms, probe:
                optimizer.step()
        finally:
            dist.all_to_all_single, dist.all_reduce = original, original_reduce
        trace = list(optimizer.owner_compute_trace)
        counts = {str(k).rsplit(".", 1)[-1]: v for k, v in comms.get_comm_counts().items()}
        out[name] = {
            "times": times[name], "flops": flops.get_total_flops(), "collectives": counts, "sent": sum(sent),
            "received": sum(received), "reduced": sum(reduced), "peak": probe.peak - probe.base if trace else None,
            "buckets": sum(1 for event in trace if event[0] == "to" and event[2] == "issue"),
            "bucket_size": optimizer.bucket_size,
        }  # fmt: skip
        assert all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
    return out


def _plan_estimates(shape: GPTConfig, mode: MeshMode, world: int, bucket_size: int) -> tuple[int, int, float]:
    """The plan's largest bucket's transient bytes on the busiest rank, its bytes sent, and one process's Newton–Schulz FLOPs."""
    from optzoo.groups import resolve_group_configs
    from optzoo.mesh_plan import parse_mesh, plan_mesh

    groups, _ = resolve_group_configs(MUON, [GPT(shape)])
    plans = plan_mesh(groups, parse_mesh(mode.mesh(world) or ""), tp_mode=mode.tp_mode, bucket_size=bucket_size,  # type: ignore[arg-type]
                      fsdp_orthogonalize=mode.fsdp_orthogonalize, per_replica=mode.per_replica)  # fmt: skip
    totals = [plan.rank_totals() for plan in plans]
    transient = max((t["transient_max"] for ranks in totals for t in ranks), default=0)
    sent = max((sum(ranks[r]["sent"] for ranks in totals if r < len(ranks)) for r in range(world)), default=0)
    return transient, sent, sum(plan.one_process_flops for plan in plans)


def measure_mesh(
    worlds: tuple[int, ...] = (1, 2, 4), modes: list[str] | None = None, *, hidden: int = 512, layers: int = 6,
    vocab: int = 6144, warmup: int = 1, repeats: int = 5, backend: str = "gloo",
) -> tuple[int, list[list[Any]]]:
    """(Muon matrix elements, rows of :data:`MESH_HEADERS`): every mode on every world size its mesh
    fits; ``backend="nccl"`` puts each rank on a GPU of its own (written for GPU machines, not run on this one)."""
    modes = modes if modes is not None else list(MESH_MODES)
    unknown = [m for m in modes if m not in MESH_MODES]
    if unknown:
        raise ValueError(f"`modes`: unknown mesh mode; got {unknown}; expected some of {list(MESH_MODES)}")
    shape = GPTConfig(hidden_size=hidden, num_layers=layers, num_heads=max(1, hidden // 64), vocab_size=vocab, max_seq_len=256)
    weights = dict(GPT(shape).named_parameters())
    elements = sum(weights[name].numel() for name in _muon_matrices(shape))
    rows: list[list[Any]] = []
    single: float | None = None
    for world in sorted(worlds):
        fitting = [m for m in modes if MESH_MODES[m].mesh(world) is not None]
        if not fitting:
            continue
        device = "cuda" if backend == "nccl" else "cpu"
        ranks = spawn(world, _mesh_rank, shape, fitting, warmup, repeats, device, backend=backend)
        for name in fitting:
            mode = MESH_MODES[name]
            slowest = [max(steps) for steps in zip(*(r[name]["times"] for r in ranks))]
            flops = max(r[name]["flops"] for r in ranks)
            if world == 1 and single is None:
                single = flops
            transient, planned_sent, one_process = _plan_estimates(shape, mode, world, ranks[0][name]["bucket_size"])
            peaks = [r[name]["peak"] for r in ranks if r[name]["peak"] is not None]
            planned = bool(ranks[0][name]["buckets"])  # else Muon's plain path (one rank): no plan runs
            collectives = ", ".join(f"{n} {c}" for c, n in sorted(ranks[0][name]["collectives"].items()))
            rows.append([
                world, name, mode.mesh(world), sorted(slowest)[len(slowest) // 2] * 1e3, flops / 1e9,
                flops / (single or one_process), max(r[name]["sent"] for r in ranks) / 2**20,
                planned_sent / 2**20 if planned else None, max(r[name]["received"] for r in ranks) / 2**20,
                max(r[name]["reduced"] for r in ranks) / 2**20, transient / 2**20 if planned else None,
                max(peaks) / 2**20 if peaks else None, ranks[0][name]["buckets"], collectives or "none",
            ])  # fmt: skip
    return elements, rows


MESH_HEADERS = [
    "ranks", "mode", "mesh", "step ms (median)", "NS GFLOP/rank", "vs 1 process", "sent MiB/rank", "planned",
    "recv MiB/rank", "all-reduced MiB/rank", "transient MiB/rank (plan, largest bucket)", "peak MiB/rank (measured)",
    "buckets", "collectives per step",
]  # fmt: skip


def test_mesh_modes_on_1_and_2_ranks() -> None:
    """Runs once in the suite: a tiny GPT, one repeat, every mode that fits 1 and 2 ranks (TP 2 alone on 2)."""
    modes = list(MESH_MODES)
    _, rows = measure_mesh((1, 2), modes, hidden=64, layers=2, vocab=64, warmup=0, repeats=1)
    by = {(r[0], r[1]): r for r in rows}
    assert set(by) == {(1, "fsdp-owner"), (1, "fsdp-redundant")} | {(2, m) for m in modes if not m.startswith("hsdp")}
    one = by[1, "fsdp-owner"][4]
    assert by[1, "fsdp-redundant"][4] == one  # one rank: the plain path either way
    # Each matrix once across the ranks (owner, layer_sharded) or once per rank (redundant, duplicated on TP 2 alone)
    assert by[2, "fsdp-redundant"][5] == 1.0 and by[2, "tp-duplicated"][5] == 1.0
    assert by[2, "fsdp-owner"][5] <= 0.55 and by[2, "tp-layer_sharded"][5] <= 0.55
    assert by[2, "tp-distributed"][5] <= 0.75  # TP 2 alone: each rank its block of every matrix
    for name in ("fsdp-owner", "fsdp-bucketed", "tp-layer_sharded"):  # the bytes counted are the plan's
        assert by[2, name][6] == by[2, name][7] > 0, name
    # distributed on TP 2 alone: each rank already holds its block; only the Grams are all-reduced
    assert by[2, "tp-distributed"][6] == by[2, "tp-distributed"][7] == 0 and by[2, "tp-distributed"][9] > 0
    assert by[2, "fsdp-bucketed"][12] > 1 and by[2, "fsdp-owner"][12] == 1
    assert by[2, "fsdp-bucketed"][11] <= 2 * by[2, "fsdp-bucketed"][10] + 1e-9  # two slots, each under the plan's estimate
    assert by[2, "fsdp-bucketed"][5] == by[2, "fsdp-owner"][5]  # the same work, in more buckets
    assert all(r[3] > 0 for r in rows)


@pytest.mark.slow
def test_mesh_modes_on_4_ranks() -> None:
    """The 2-D meshes in reduced form: a tiny GPT, one repeat, HSDP 2 x 2 and FSDP 2 x TP 2."""
    modes = ["hsdp-2x2", "hsdp-2x2-per-replica", "tp-layer_sharded", "tp-duplicated", "tp-blockwise", "tp-distributed"]
    _, rows = measure_mesh((4,), modes, hidden=64, layers=4, vocab=64, warmup=0, repeats=1)
    by = {r[1]: r for r in rows}
    assert [r[2] for r in rows] == ["2x2", "2x2", *["dp=2,tp=2"] * 4]
    assert by["hsdp-2x2-per-replica"][5] <= 0.55  # each replica its own copy: half each
    # 16 matrices over 4 ranks, each computed once: a quarter each, to within one matrix's imbalance
    assert by["hsdp-2x2"][5] <= 0.3 and by["tp-layer_sharded"][5] <= 0.3
    assert 0.5 <= by["tp-duplicated"][5] <= 0.55  # once per TP rank class: twice over the mesh
    for row in rows:
        assert row[6] == row[7], row[1]  # bytes counted in the all-to-alls are the plan's
        assert row[11] <= row[10], row[1]  # measured peak within the plan's estimate of one bucket


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


TABLES = ("ddp", "fsdp", "mesh")


def _only(text: str) -> tuple[set[str], list[str] | None]:
    """``--only``: comma-separated tables (ddp, fsdp, mesh) and mesh modes; returns (tables, mesh modes or None: the default)."""
    tables: set[str] = set()
    modes: list[str] = []
    for token in (t.strip() for t in text.split(",")):
        if token in TABLES:
            tables.add(token)
        elif token in MESH_MODES:
            tables.add("mesh")
            modes.append(token)
        else:
            raise argparse.ArgumentTypeError(f"unknown table or mesh mode {token!r}; expected some of {[*TABLES, *MESH_MODES]}")
    return tables, modes or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes; must include 1")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--only", type=_only, default=(set(TABLES), None), metavar="TABLES",
        help=f"comma-separated tables ({', '.join(TABLES)}) and mesh modes ({', '.join(MESH_MODES)}); "
        "a mode alone runs the mesh table with just those modes",
    )  # fmt: skip
    parser.add_argument("--fsdp-hidden", type=int, default=512, help="FSDP2 and mesh tables: GPT width (512, 6 layers: ~25M)")
    parser.add_argument("--fsdp-layers", type=int, default=6)
    parser.add_argument("--fsdp-vocab", type=int, default=6144)
    parser.add_argument("--fsdp-repeats", type=int, default=5)
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], default="gloo",
        help="mesh table: gloo on CPU ranks, or nccl with a GPU per rank (written, but not run on this machine, which has no GPU)",
    )
    args = parser.parse_args()
    tables, modes = args.only
    where = f"1 thread per rank (torch.set_num_threads(1)) on {os.cpu_count()} cores; gloo; torch {torch.__version__}"
    if "ddp" in tables:
        dtype = getattr(torch, args.dtype)
        size, rows = measure(tuple(args.ranks), hidden=args.hidden, layers=args.layers, vocab=args.vocab,
                             dtype=dtype, warmup=args.warmup, repeats=args.repeats)  # fmt: skip
        print(f"GPT hidden={args.hidden} layers={args.layers} vocab={args.vocab}: {size / 1e6:.2f}M {args.dtype} parameters; {where}")
        table = [[*row[:3], row[3] / 2**20, row[4] / 2**20, row[5]] for row in rows]
        print(tabulate(table, headers=HEADERS, floatfmt=("g", "", ".1f", ".2f", ".2f", ".3f")))
    if "fsdp" in tables:
        size, rows = measure_fsdp(tuple(args.ranks), hidden=args.fsdp_hidden, layers=args.fsdp_layers, vocab=args.fsdp_vocab,
                                  repeats=args.fsdp_repeats)  # fmt: skip
        print(f"\nFSDP2 Muon: GPT hidden={args.fsdp_hidden} layers={args.fsdp_layers} vocab={args.fsdp_vocab}: "
              f"{size / 1e6:.2f}M float32 parameters; {where}")  # fmt: skip
        print(tabulate(rows, headers=FSDP_HEADERS, floatfmt=("g", "", ".0f", ".2f", ".3f", "", ".2f", ".2f")))
    if "mesh" in tables:
        elements, rows = measure_mesh(tuple(args.ranks), modes, hidden=args.fsdp_hidden, layers=args.fsdp_layers,
                                      vocab=args.fsdp_vocab, repeats=args.fsdp_repeats, backend=args.backend)  # fmt: skip
        if args.backend == "nccl":
            where = f"nccl, a GPU per rank; torch {torch.__version__}"
        print(f"\nMuon on device meshes: GPT hidden={args.fsdp_hidden} layers={args.fsdp_layers} vocab={args.fsdp_vocab}: "
              f"{elements / 1e6:.2f}M float32 elements in Muon's matrices; {where}")  # fmt: skip
        print(tabulate(rows, headers=MESH_HEADERS, floatfmt=("g", "", "", ".0f", ".3f", ".3f", ".3f", ".3f", ".3f", ".3f", ".3f", ".3f", "g", "")))


if __name__ == "__main__":
    main()
