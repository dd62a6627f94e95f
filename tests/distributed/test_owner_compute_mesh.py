"""Owner-computes on 2-D meshes (4 spawned gloo ranks): HSDP 2 x 2 and FSDP 2 x TP 2, every TP mode, buckets.

Params are DTensors with the placements ``fully_shard`` and ``parallelize_module`` give them:
HSDP ``(Replicate(), Shard(0))``; under FSDP x TP a column-parallel weight
``(_StridedShard(0, sf=2), Shard(0))`` and a row-parallel one ``(Shard(0), Shard(1))``, expert
stacks sharded on the expert dim by both. Every rank gets the same gradients as one process
stepping plain copies. The answers come from outside owner-computes: one process's Muon on the
whole params (``duplicated``, ``layer_sharded``, the redundant path: bit for bit), one process's
Muon on each TP block as a param of its own (``blockwise``: Megatron's per-shard Newton–Schulz),
and counts of the Newton–Schulz calls and FLOPs each rank makes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon
from tests.distributed.harness import one_thread, run_ranks
import optzoo.optimizers.owner_compute as owner_compute
from benchmarks._memory import LiveBytes, MarkAtFirstBucket
from tests.distributed.test_owner_compute import _recording

pytestmark = pytest.mark.slow

STEPS = 3
COL, ROW, STACK, HSDP = "col", "row", "stack", "hsdp"
MATRICES = [((24, 16), COL), ((16, 24), ROW), ((20, 12), COL), ((12, 20), ROW), ((4, 8, 6), STACK), ((3, 6, 8), STACK)]
"""Tall and wide, column- and row-parallel, rows that 4 ranks split unevenly; expert stacks
(4 experts: one per rank; 3 experts: ranks share)."""
GPT = [(shape, kind) for _ in range(4) for shape, kind in [((96, 32), COL), ((32, 32), ROW), ((128, 32), COL), ((32, 128), ROW)]]
"""The matrices of a 4-layer GPT of width 32 (QKV and MLP up column-parallel, their outputs row-parallel)."""
DEEP = [(shape, HSDP) for _ in range(24) for shape in [(48, 16), (16, 16), (64, 16), (16, 64)]]
"""A 24-layer GPT of width 16: enough matrices that an eighth of their bytes holds several whole ones."""


def _placements(kind: str, mesh_kind: str) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if mesh_kind == HSDP:
        return [Replicate(), Shard(0)]
    return {COL: [_StridedShard(0, split_factor=2), Shard(0)], ROW: [Shard(0), Shard(1)], STACK: [Shard(0), Shard(0)]}[kind]


def _data(specs: list[tuple[tuple[int, ...], str]]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape, _ in specs]
    return initial, [[torch.randn(shape, generator=generator) for shape, _ in specs] for _ in range(STEPS)]


def _optimizer(kind: str, params: list[torch.Tensor], **instance: Any) -> torch.optim.Optimizer:
    settings: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "fp32_matmul_prec": "highest", **instance}
    if kind == "muon":
        return Muon(params, nesterov=True, **settings)
    return AdaptiveMuon(params, moment2_method=kind, **settings)


def _run(kind: str, specs: list[tuple[tuple[int, ...], str]], mesh: Any = None, mesh_kind: str = "", **instance: Any) -> dict[str, Any]:
    """Params after ``STEPS`` steps (whole), the matrices orthogonalised, FLOPs, events and peak transient bytes."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    initial, grads = _data(specs)

    def place(t: torch.Tensor, spec_kind: str) -> torch.Tensor:
        return t.clone() if mesh is None else distribute_tensor(t.clone(), mesh, _placements(spec_kind, mesh_kind))

    params = [torch.nn.Parameter(place(w, k)) for w, (_, k) in zip(initial, specs)]
    optimizer = _optimizer(kind, params, **instance)
    probe = LiveBytes() if specs is DEEP else None
    trace = MarkAtFirstBucket(probe)
    if isinstance(optimizer, Muon):
        optimizer.owner_compute_trace = trace
    counter = FlopCounterMode(display=False)
    peaks = []
    sharded: list[tuple[int, ...]] = []  # each TP piece newton_schulz_sharded orthogonalises, as (rows, cols) of the piece
    original = owner_compute.newton_schulz_sharded

    def recording(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        sharded.extend([tuple(x.shape[-2:])] * x.shape[0])
        return original(x, **kwargs)

    owner_compute.newton_schulz_sharded = recording  # type: ignore[assignment]
    with _recording() as seen, counter:
        for step_grads in grads:
            for p, g, (_, k) in zip(params, step_grads, specs):
                p.grad = place(g, k)
            trace.clear()
            if probe is not None:
                with probe:
                    optimizer.step()
                peaks.append(probe.peak - probe.base)
            else:
                optimizer.step()
    owner_compute.newton_schulz_sharded = original  # type: ignore[assignment]
    final = [p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for p in params]
    return {
        "params": final, "seen": seen, "sharded": sharded, "flops": counter.get_total_flops(), "trace": list(trace),
        "peak": max(peaks, default=0),
    }  # fmt: skip


def _blockwise_reference(kind: str, specs: list[tuple[tuple[int, ...], str]]) -> list[torch.Tensor]:
    """One process's Muon on each TP block as a param of its own (torch.chunk along the TP-sharded dim), reassembled."""
    dims = {COL: 0, ROW: 1}
    initial, grads = _data(specs)
    pieces = [list(torch.chunk(w, 2, dim=dims[k])) if k in dims else [w] for w, (_, k) in zip(initial, specs)]
    params = [torch.nn.Parameter(p.clone()) for parts in pieces for p in parts]
    optimizer = _optimizer(kind, params)
    for step_grads in grads:
        chunks = [c for g, (_, k) in zip(step_grads, specs) for c in (torch.chunk(g, 2, dim=dims[k]) if k in dims else [g])]
        for p, g in zip(params, chunks):
            p.grad = g.clone()
        optimizer.step()
    out, position = [], 0
    for parts, (_, k) in zip(pieces, specs):
        out.append(torch.cat([params[position + i].detach() for i in range(len(parts))], dim=dims.get(k, 0)))
        position += len(parts)
    return out


def _matrix_bytes(specs: list[tuple[tuple[int, ...], str]]) -> int:
    return sum(4 * torch.Size(shape).numel() for shape, _ in specs)


def _straddling_qkv(mesh: Any) -> tuple[str, bool]:
    """A fused QKV of 3 groups of 8 rows, column-parallel over 2 TP ranks (12 rows each): under
    ``blockwise`` a group would straddle the TP blocks. The step refuses, before any param or state changes."""
    from torch.distributed.tensor import distribute_tensor

    initial, grads = _data([((24, 16), COL), ((16, 24), ROW)])
    params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, _placements(k, "tp"))) for w, k in zip(initial, (COL, ROW))]
    params[0].qkv_split_shapes = [4, 2, 2]  # type: ignore[attr-defined]
    optimizer = _optimizer("muon", params, fsdp_orthogonalize="owner", tp_mode="blockwise")
    for p, g, k in zip(params, grads[0], (COL, ROW)):
        p.grad = distribute_tensor(g.clone(), mesh, _placements(k, "tp"))
    before = [p.to_local().clone() for p in params]
    with pytest.raises(ValueError) as error:
        optimizer.step()
    unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, params)) and not optimizer.state
    return str(error.value), unchanged


def _ranks(rank: int, world_size: int) -> dict[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    out: dict[Any, Any] = {}
    for kind in ("muon", "normuon"):
        out[(HSDP, kind, "owner")] = _run(kind, MATRICES, mesh, HSDP)
        out[(HSDP, kind, "redundant")] = _run(kind, MATRICES, mesh, HSDP, fsdp_orthogonalize="redundant")
        for tp_mode in ("layer_sharded", "duplicated", "blockwise", "distributed", "auto"):
            out[("tp", kind, tp_mode)] = _run(kind, MATRICES, mesh, "tp", fsdp_orthogonalize="owner", tp_mode=tp_mode)
    out[("gpt", HSDP)] = _run("muon", GPT, mesh, HSDP)
    for tp_mode in ("layer_sharded", "duplicated"):
        out[("gpt", tp_mode)] = _run("muon", GPT, mesh, "tp", tp_mode=tp_mode)
    out["straddle"] = _straddling_qkv(mesh)
    planned = []
    original = owner_compute.plan_owner_compute
    owner_compute.plan_owner_compute = lambda *a, **k: planned.append(1) or original(*a, **k)  # type: ignore[assignment]
    try:
        _run("muon", MATRICES, mesh, HSDP)
    finally:
        owner_compute.plan_owner_compute = original  # type: ignore[assignment]
    out["plans"] = len(planned)
    out[("deep", "unbucketed")] = _run("muon", DEEP, mesh, HSDP)
    out[("deep", "bucketed")] = _run("muon", DEEP, mesh, HSDP, bucket_size=_matrix_bytes(DEEP) // 8)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    return run_ranks(4, _ranks, timeout=600)


@pytest.fixture(scope="module")
def single() -> dict[Any, Any]:
    with one_thread():
        runs: dict[Any, Any] = {kind: _run(kind, MATRICES) for kind in ("muon", "normuon")}
        runs[("blockwise", "muon")] = _blockwise_reference("muon", MATRICES)
        runs["gpt"] = _run("muon", GPT)
    return runs


def _assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"{what}: param {index} {tuple(a.shape)} off by {(a - b).abs().max().item()}"


@pytest.mark.parametrize("kind", ["muon", "normuon"])
@pytest.mark.parametrize(
    "case", [(HSDP, "owner"), (HSDP, "redundant"), ("tp", "layer_sharded"), ("tp", "duplicated")]
)
def test_whole_matrix_modes_equal_one_process_bit_for_bit(kind: str, case: tuple[str, str], ranks: Any, single: Any) -> None:
    for rank, result in enumerate(ranks):
        _assert_equal(result[(*case[:1], kind, case[1])]["params"], single[kind]["params"], f"rank {rank} {case} {kind}")


@pytest.mark.parametrize("kind", ["muon", "normuon"])
@pytest.mark.parametrize("mode", ["distributed", "auto"])
def test_distributed_equals_one_process_to_rounding(kind: str, mode: str, ranks: Any, single: Any) -> None:
    """Newton–Schulz on TP shards with all-reduced Grams: one process's result up to the order of
    float32 sums (Newton–Schulz outputs measured within 2e-5 of one process's; times lr 0.05 and
    the spectral scale over 3 steps: 1e-5 on the params). ``auto`` takes it for the matrices
    whose cost exceeds an even share (here the two largest) and keeps the rest whole."""
    for rank, result in enumerate(ranks):
        for index, (a, b) in enumerate(zip(result[("tp", kind, mode)]["params"], single[kind]["params"], strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"rank {rank} {mode} param {index}")


def test_blockwise_equals_newton_schulz_per_tp_block(ranks: Any, single: Any) -> None:
    """Muon's update per TP block is Newton–Schulz and its scale of the block alone. (A variant's
    finishing step, NorMuon's row statistics, runs on the whole param in every mode: docs/distributed.md.)"""
    kind = "muon"
    reference = single[("blockwise", kind)]
    for result in ranks:
        got = result[("tp", kind, "blockwise")]["params"]
        for index, (a, b) in enumerate(zip(got, reference)):
            # one process batches the blocks differently; Newton–Schulz's float32 sums may round another way
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"param {index}")
        assert not torch.allclose(got[0], single[kind]["params"][0], atol=1e-4)  # per block is not per matrix


def test_each_matrix_is_orthogonalised_once_per_class(ranks: Any, single: Any) -> None:
    once = Counter(single["muon"]["seen"])
    assert sum(once.values()) == STEPS * (4 + 4 + 3)
    total = {key: sum((Counter(r[key]["seen"]) for r in ranks), Counter()) for key in ranks[0] if key[0] in (HSDP, "tp")}
    assert total[(HSDP, "muon", "owner")] == once
    assert total[("tp", "muon", "layer_sharded")] == once
    # redundant: every rank holding some of a matrix computes it: each 2-D matrix on all 4, each
    # expert on the 2 replicas of the shard that holds it
    assert total[(HSDP, "muon", "redundant")] == Counter({s: n * (2 if s in ((8, 6), (6, 8)) else 4) for s, n in once.items()})
    tp_sharded = {(24, 16), (16, 24), (20, 12), (12, 20)}  # twice each: once per TP rank class; the stacks once
    assert total[("tp", "muon", "duplicated")] == Counter({s: n * (2 if s in tp_sharded else 1) for s, n in once.items()})
    halves = Counter({(12, 16): 2, (16, 12): 2, (10, 12): 2, (12, 10): 2, (8, 6): 4, (6, 8): 3})  # stacks: whole experts
    assert total[("tp", "muon", "blockwise")] == Counter({shape: STEPS * n for shape, n in halves.items()})
    # distributed: each TP-sharded matrix by one TP group, its two halves together; the stacks whole, once
    pieces = sum((Counter(r[("tp", "muon", "distributed")]["sharded"]) for r in ranks), Counter())
    assert pieces == Counter({(12, 16): 6, (16, 12): 6, (10, 12): 6, (12, 10): 6})
    assert total[("tp", "muon", "distributed")] == Counter({(8, 6): 12, (6, 8): 9})
    auto_pieces = sum((Counter(r[("tp", "muon", "auto")]["sharded"]) for r in ranks), Counter())
    assert auto_pieces == Counter({(12, 16): 6, (16, 12): 6})  # the two largest: above an even share of the cost
    assert total[("tp", "muon", "auto")] == once - Counter({(24, 16): 3, (16, 24): 3})


def test_newton_schulz_flops_per_rank_on_two_dim_meshes(ranks: Any, single: Any) -> None:
    """The GPT's 16 matrices: HSDP 2 x 2 and FSDP 2 x TP 2 layer-sharded at most 0.3x one process's
    FLOPs per rank; duplicated computes each TP matrix on both TP classes (about 0.5x)."""
    one = single["gpt"]["flops"]
    for result in ranks:
        assert result[("gpt", HSDP)]["flops"] <= 0.3 * one
        assert result[("gpt", "layer_sharded")]["flops"] <= 0.3 * one
        assert result[("gpt", "duplicated")]["flops"] <= 0.55 * one
        for key in (("gpt", HSDP), ("gpt", "layer_sharded"), ("gpt", "duplicated")):
            _assert_equal(result[key]["params"], single["gpt"]["params"], str(key))


def test_buckets_hold_their_memory_and_overlap_the_next_transfer(ranks: Any) -> None:
    """A cap of an eighth of the matrix bytes: several buckets, bit for bit the unbucketed result
    (checked above), each rank's measured peak of transient bytes at most two caps, and the next
    bucket's pieces issued before this bucket's Newton–Schulz starts and waited for after it ends."""
    cap = _matrix_bytes(DEEP) // 8
    for result in ranks:
        bucketed = result[("deep", "bucketed")]
        _assert_equal(bucketed["params"], result[("deep", "unbucketed")]["params"], "bucketed")
        trace = bucketed["trace"]
        buckets = 1 + max(index for _, index, _ in trace)
        assert buckets >= 8
        assert bucketed["peak"] <= 2 * cap, f"peak {bucketed['peak']} > 2 x {cap}"
        for index in range(buckets - 1):
            assert trace.index(("to", index + 1, "issue")) < trace.index(("ns", index, "start"))
            assert trace.index(("ns", index, "end")) < trace.index(("to", index + 1, "wait"))
        assert result[("gpt", HSDP)]["trace"] == [("to", 0, "issue"), ("to", 0, "wait"), ("ns", 0, "start"), ("ns", 0, "end"),
                                                   ("back", 0, "issue"), ("back", 0, "wait")]  # fmt: skip


def test_a_qkv_split_that_straddles_tp_blocks_is_refused_before_anything_changes(ranks: Any) -> None:
    for message, unchanged in (result["straddle"] for result in ranks):
        assert message == (
            "`tp_mode`: 'blockwise' orthogonalises each tensor-parallel block of a matrix on its own rank, and a fused "
            "QKV's row groups must not straddle them; got a 12 x 16 block of a 24 x 16 matrix split in 3 groups of 8 "
            "rows; expected blocks of whole groups (split the heads evenly over the tensor-parallel ranks), or "
            "tp_mode='duplicated'"
        )
        assert unchanged


def test_the_plan_is_made_once_and_reused_while_shapes_and_settings_hold(ranks: Any) -> None:
    """3 steps, one exchange group: one plan (it is Python work over every matrix; a step must not redo it)."""
    assert [result["plans"] for result in ranks] == [1] * 4
