"""Owner-computes under FSDP2: each matrix orthogonalised once, on one rank, bit for bit the single process.

Spawned gloo ranks hold every param as a ``Shard(0)`` DTensor (what ``fully_shard`` makes) and
get the same gradients as a single process stepping plain copies; Muon and each Adaptive Muon
rule must give the same params, bit for bit, with ``fsdp_orthogonalize="owner"`` and
``"redundant"``, on 2 and 4 ranks. Newton–Schulz is wrapped to record every matrix each rank
orthogonalises, and ``FlopCounterMode`` counts each rank's FLOPs.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import optzoo.optimizers.muon as muon_module
from optzoo.optimizers.adaptive_muon import AdaptiveMuon
from optzoo.optimizers.muon import Muon
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from optzoo.optimizers.owner_compute import ShardLayout, Unit, assign_owners, box_numel, dim0_chunks, plan_owner_compute
from tests.distributed.harness import one_thread, run_ranks

SHAPES = [(16, 32), (48, 16), (7, 12), (3, 5, 6), (4, 8, 8), (6, 2, 3, 3), (24, 16), (1, 9), (33, 20), (20, 33)]
"""Wide, tall, rows not divisible by 2 or 4, a row fewer than the ranks, stacks (3 and 4 experts:
some ranks hold whole experts), a conv filter (flattened), a fused QKV (split [4, 2, 2])."""
QKV = 6
KINDS = ["muon", "adamuon", "normuon", "namo"]
STEPS = 3
GPT_SHAPES = [shape for _ in range(4) for shape in [(192, 64), (64, 64), (256, 64), (64, 256)]]
"""The matrices of a 4-layer GPT of width 64 (QKV, attention out, MLP up and down)."""


def _optimizer(kind: str, mode: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if len(params) == len(SHAPES):
        params[QKV].qkv_split_shapes = [4, 2, 2]  # type: ignore[attr-defined]
        groups: list[dict[str, Any]] = [
            {"params": params[:5]}, {"params": params[5:6], "flatten": True}, {"params": params[6:], "scale_mode": "unit_rms_norm"},
        ]  # fmt: skip
    else:
        groups = [{"params": params}]
    settings: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "fp32_matmul_prec": "highest", "fsdp_orthogonalize": mode}
    if kind == "muon":
        return Muon(groups, nesterov=True, **settings)
    return AdaptiveMuon(groups, moment2_method=kind, **settings)


def _data(shapes: list[tuple[int, ...]]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(STEPS)]
    return initial, grads


@contextlib.contextmanager
def _recording() -> Iterator[list[tuple[int, ...]]]:
    """Every matrix Newton–Schulz is called on, as ``(rows, cols)``, while inside."""
    seen: list[tuple[int, ...]] = []
    original = muon_module.newton_schulz

    def recording(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.extend([tuple(x.shape[-2:])] * (x.shape[0] if x.dim() == 3 else 1))
        return original(x, **kwargs)

    muon_module.newton_schulz = recording  # type: ignore[assignment]
    try:
        yield seen
    finally:
        muon_module.newton_schulz = original


def _run(kind: str, mode: str, shapes: list[tuple[int, ...]], mesh: Any = None) -> tuple[list[torch.Tensor], list[tuple[int, ...]], int]:
    """Params after ``STEPS`` steps (whole), the matrices orthogonalised, and the FLOPs counted."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if mesh is None else distribute_tensor(t.clone(), mesh, [Shard(0)])

    initial, grads = _data(shapes)
    params = [torch.nn.Parameter(place(w)) for w in initial]
    optimizer = _optimizer(kind, mode, params)
    counter = FlopCounterMode(display=False)
    with _recording() as seen, counter:
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = place(g)
            optimizer.step()
    final = [p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for p in params]
    return final, seen, counter.get_total_flops()


def _ranks(rank: int, world_size: int) -> dict[tuple[str, str, str], Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[tuple[str, str, str], Any] = {}
    for kind in KINDS:
        for mode in ("owner", "redundant"):
            out[("odd", kind, mode)] = _run(kind, mode, SHAPES, mesh)
    for mode in ("owner", "redundant", "auto"):
        out[("gpt", "muon", mode)] = _run("muon", mode, GPT_SHAPES, mesh)
    return out


@pytest.fixture(scope="module")
def single() -> dict[tuple[str, str], Any]:
    with one_thread():
        runs = {("odd", kind): _run(kind, "auto", SHAPES) for kind in KINDS}
        runs[("gpt", "muon")] = _run("muon", "auto", GPT_SHAPES)
    return runs


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[tuple[str, str, str], Any]]]:
    return request.param, run_ranks(request.param, _ranks, timeout=400)


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["owner", "redundant"])
def test_bitwise_equal_to_one_process(kind: str, mode: str, ranks: Any, single: Any) -> None:
    _, results = ranks
    reference = single[("odd", kind)][0]
    for result in results:
        final = result[("odd", kind, mode)][0]
        for shape, got, expected in zip(SHAPES, final, reference):
            assert torch.equal(got, expected), f"{kind} {mode} {shape}: off by {(got - expected).abs().max().item()}"


def _holders(shape: tuple[int, ...], world_size: int, *, flatten: bool) -> list[int]:
    """Per matrix of a param (torch.chunk on dim 0 over the ranks): how many ranks hold some of it."""
    rows = [len(chunk) for chunk in torch.arange(shape[0]).chunk(world_size)] + [0] * world_size
    starts = [sum(rows[:r]) for r in range(world_size)]
    if len(shape) == 2 or flatten:
        return [sum(1 for r in range(world_size) if rows[r])]
    experts = torch.Size(shape[:-2]).numel()
    per_row = experts // shape[0]  # matrices per index of dim 0
    return [sum(1 for r in range(world_size) if starts[r] <= m // per_row < starts[r] + rows[r]) for m in range(experts)]


@pytest.mark.parametrize("kind", KINDS)
def test_each_matrix_orthogonalised_exactly_once_across_ranks(kind: str, ranks: Any, single: Any) -> None:
    """Owner-computes: each matrix once. The redundant path: every rank that holds some of a matrix
    orthogonalises it whole; every rank, where the update needs the result whole (NorMuon)."""
    world_size, results = ranks
    once = Counter(single[("odd", kind)][1])
    assert sum(once.values()) == STEPS * (1 + 1 + 1 + 3 + 4 + 1 + 3 + 1 + 1 + 1)  # QKV: 3 blocks; stacks: per expert
    owner = sum((Counter(result[("odd", kind, "owner")][1]) for result in results), Counter())
    assert owner == once
    redundant = sum((Counter(result[("odd", kind, "redundant")][1]) for result in results), Counter())
    expected: Counter[tuple[int, ...]] = Counter()
    for index, shape in enumerate(SHAPES):
        flatten = index == 5
        matrix = (shape[0], torch.Size(shape[1:]).numel()) if flatten else shape[-2:]
        blocks = [(12, 16), (6, 16), (6, 16)] if index == QKV else [matrix]  # [4, 2, 2] rows in each of 3 groups
        for holders in _holders(shape, world_size, flatten=flatten):
            for block in blocks:
                expected[tuple(block)] += STEPS * (world_size if kind == "normuon" else holders)
    assert redundant == expected


def test_newton_schulz_flops_per_rank(ranks: Any, single: Any) -> None:
    """A GPT's 16 matrices: each rank's FLOPs (Newton–Schulz and all) at most 0.55× (2 ranks) or
    0.3× (4 ranks) of one process with owner-computes, and 1× with the redundant path."""
    world_size, results = ranks
    one = single[("gpt", "muon")][2]
    limit = {2: 0.55, 4: 0.3}[world_size]
    for result in results:
        assert result[("gpt", "muon", "owner")][2] <= limit * one
        assert result[("gpt", "muon", "auto")][2] == result[("gpt", "muon", "owner")][2]  # auto chose owner-computes
        assert result[("gpt", "muon", "redundant")][2] == one
        for mode in ("owner", "redundant", "auto"):
            for got, expected in zip(result[("gpt", "muon", mode)][0], single[("gpt", "muon")][0]):
                assert torch.equal(got, expected)


# ---- the plan, without processes -------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(1, 3), (5, 2), (8, 8), (7, 3, 2), (2, 4, 4), (0, 4)])
def test_dim0_chunks_are_torch_chunk(shape: tuple[int, ...], world_size: int) -> None:
    tensor = torch.arange(torch.Size(shape).numel()).view(shape)
    chunks = list(torch.chunk(tensor, world_size, dim=0)) if shape[0] else []
    expected = []
    position = 0
    for rank in range(world_size):
        numel = chunks[rank].numel() if rank < len(chunks) else 0
        expected.append((position, position + numel))
        position += numel
    assert dim0_chunks(shape, world_size) == expected


def test_matrices_held_whole_stay_and_the_rest_are_balanced() -> None:
    stack = ShardLayout.of((4, 8, 8), (2,), (Shard(0),))  # two experts per rank
    matrix = ShardLayout.of((8, 8), (2,), (Shard(0),))
    experts = [Unit(k, ((k, k + 1), (0, 8), (0, 8)), stack, 10.0, 4, (0, 0), rows=8, cols=8) for k in range(4)]
    split = [Unit(name, ((0, 8), (0, 8)), matrix, cost, 4, (0, 0), rows=8, cols=8) for name, cost in (("a", 30.0), ("b", 5.0))]
    loads = [0.0, 0.0]
    units = assign_owners([*experts, *split], loads)
    # largest first: "a" (30) to rank 0 (a tie), then the experts where they are, then "b" (5) to the lighter
    assert [unit.owners for unit in units] == [(0,), (0,), (1,), (1,), (0,), (1,)]
    assert loads == [50.0, 25.0]


def test_a_units_pieces_cover_it_once() -> None:
    layout = ShardLayout.of((7, 3), (4,), (Shard(0),))  # rows 2, 2, 2, 1
    unit = Unit("m", ((0, 7), (0, 3)), layout, 1.0, 4, (0,) * 4)
    assert [unit.piece(rank) for rank in range(4)] == [((0, 2), (0, 3)), ((2, 4), (0, 3)), ((4, 6), (0, 3)), ((6, 7), (0, 3))]
    stack = ShardLayout.of((3, 2, 2), (2,), (Shard(0),))  # experts 0-1 on rank 0, expert 2 on rank 1
    expert = Unit("e", ((1, 2), (0, 2), (0, 2)), stack, 1.0, 4, (0, 0))
    assert [expert.piece(rank) for rank in range(2)] == [((1, 2), (0, 2), (0, 2)), None]


def test_boxes_on_two_dim_meshes_are_torch_chunk_of_torch_chunk() -> None:
    """Each rank's box, written by hand from torch.chunk: FSDP 2 x TP 2 (row-parallel and column-parallel) and HSDP."""
    rowwise = ShardLayout.of((6, 8), (2, 2), (Shard(0), Shard(1)))
    assert rowwise.boxes == (((0, 3), (0, 4)), ((0, 3), (4, 8)), ((3, 6), (0, 4)), ((3, 6), (4, 8)))
    assert rowwise.tp_dims == (1,)
    colwise = ShardLayout.of((12, 8), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)))  # what fully_shard makes of TP's rows
    assert colwise.boxes == (((0, 3), (0, 8)), ((6, 9), (0, 8)), ((3, 6), (0, 8)), ((9, 12), (0, 8)))
    assert colwise.tp_dims == (1,)
    assert colwise.tp_block((1,)) == ((6, 12), (0, 8))
    hsdp = ShardLayout.of((5, 2), (2, 2), (Replicate(), Shard(0)))  # uneven: rows 3 and 2
    assert hsdp.boxes == (((0, 3), (0, 2)), ((3, 5), (0, 2)), ((0, 3), (0, 2)), ((3, 5), (0, 2)))
    assert hsdp.tp_dims == ()


def test_hsdp_plan_computes_each_matrix_once_and_sends_both_replicas_their_half() -> None:
    """Four 4 x 4 matrices on HSDP 2 x 2 (each rank holds 2 rows of each): one per rank; each owner
    receives the 2 rows it lacks (from its own replica) and sends 2 rows to each of the 3 others."""
    layout = ShardLayout.of((4, 4), (2, 2), (Replicate(), Shard(0)))
    plan = plan_owner_compute([(k, (4, 4), layout, (1, 4, 4), 0, 4) for k in range(4)])
    assert len(plan.buckets) == 1
    (bucket,) = plan.buckets
    assert sorted(unit.owners for unit in bucket.units) == [(0,), (1,), (2,), (3,)]
    for unit in bucket.units:
        (owner,) = unit.owners
        incoming = [t for t in bucket.to_owners if t.unit is unit and t.source != owner]
        assert [(t.source // 2, box_numel(t.box)) for t in incoming] == [(owner // 2, 8)]  # from its own replica
        back = [t for t in bucket.from_owners if t.unit is unit and t.source != t.dest]
        assert sorted(t.dest for t in back) == sorted(set(range(4)) - {owner}) and all(box_numel(t.box) == 8 for t in back)
    assert bucket.sent == [4 * (8 + 3 * 8)] * 4 and bucket.received == bucket.sent  # float32: 4 bytes per element


def test_duplicated_tp_computes_a_matrix_once_per_tp_class_and_blockwise_per_tp_block() -> None:
    layout = ShardLayout.of((8, 8), (2, 2), (Shard(0), Shard(1)))  # FSDP 2 x TP 2, row-parallel
    matrices = [("w", (8, 8), layout, (1, 8, 8), 0, 4)]
    duplicated = plan_owner_compute(matrices, tp_mode="duplicated").buckets[0].units
    assert [unit.classes for unit in duplicated] == [(0, 1, 0, 1)] and len(set(duplicated[0].owners)) == 2
    assert {duplicated[0].owners[c] % 2 for c in (0, 1)} == {0, 1}  # each class's owner is of that class
    blockwise = plan_owner_compute(matrices, tp_mode="blockwise").buckets[0].units
    assert sorted(unit.box for unit in blockwise) == [((0, 8), (0, 4)), ((0, 8), (4, 8))]
    assert [(unit.rows, unit.cols) for unit in blockwise] == [(8, 4), (8, 4)]
    assert plan_owner_compute(matrices, tp_mode="layer_sharded").buckets[0].units[0].box == ((0, 8), (0, 8))


def test_buckets_keep_every_ranks_transient_bytes_under_the_cap_and_carry_the_load() -> None:
    layout = ShardLayout.of((16, 16), (4,), (Shard(0),))
    matrices = [(k, (16, 16), layout, (1, 16, 16), 0, 4) for k in range(16)]
    unbucketed = plan_owner_compute(matrices)
    assert len(unbucketed.buckets) == 1
    cap = max(unbucketed.buckets[0].transient) // 4
    plan = plan_owner_compute(matrices, bucket_size=cap)
    assert len(plan.buckets) > 1 and all(max(bucket.transient) <= cap for bucket in plan.buckets)
    assert sorted(plan.loads) == sorted(unbucketed.loads)  # 4 equal matrices per rank either way
    assert len({unit.owners for bucket in plan.buckets for unit in bucket.units}) == 4


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_the_plan_refuses_a_world_size_that_is_not_a_positive_int(world_size: object) -> None:
    message = rf"^`world_size`: must be a positive int; got {re.escape(repr(world_size))}; expected an int >= 1$"
    with pytest.raises(ValueError, match=message):
        dim0_chunks((4, 4), world_size)  # type: ignore[arg-type]


def test_hsdp_per_replica_keeps_every_transfer_inside_its_replica() -> None:
    """The alternative HSDP plan (measured against the default in the benchmark): each replica
    computes its own copy, so no piece crosses the replicate dim (ranks 0-1 are replica 0, 2-3 replica 1)."""
    layout = ShardLayout.of((4, 4), (2, 2), (Replicate(), Shard(0)))
    plan = plan_owner_compute([(k, (4, 4), layout, (1, 4, 4), 0, 4) for k in range(4)], per_replica=True)
    (bucket,) = plan.buckets
    assert all(len(unit.owners) == 2 and unit.owners[0] // 2 == 0 and unit.owners[1] // 2 == 1 for unit in bucket.units)
    assert all(t.source // 2 == t.dest // 2 for t in (*bucket.to_owners, *bucket.from_owners))
    assert sorted(plan.loads) == [2 * bucket.units[0].cost] * 4  # twice the work of the shared plan, spread evenly


@pytest.mark.parametrize("name", ["MOP", "PolarGrad"])
def test_distributed_tp_mode_is_refused_where_the_update_reads_the_whole_matrix(name: str) -> None:
    """MOP's SVD and PolarGrad's nuclear norm need the whole matrix; Muon and Scion (scale by shape) take it."""
    from optzoo.optimizers import orthogonalized

    param = torch.nn.Parameter(torch.randn(4, 4))
    message = (
        f"`tp_mode`: 'distributed' runs Newton-Schulz on tensor-parallel shards, and {name} orthogonalises or scales "
        "from the whole matrix; got tp_mode='distributed'; expected one of 'auto', 'duplicated', 'layer_sharded', 'blockwise'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        getattr(orthogonalized, name)([param], tp_mode="distributed")
    assert orthogonalized.Scion([param], tp_mode="distributed").tp_mode == "distributed"
    assert Muon([param], tp_mode="distributed").tp_mode == "distributed"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_mode": "rowwise"}, "`tp_mode`: "),
        ({"bucket_size": 0}, "`bucket_size`: must be a positive int (bytes); got 0; expected e.g. 1073741824"),
        ({"bucket_size": True}, "`bucket_size`: must be a positive int (bytes); got True; expected e.g. 1073741824"),
    ],
)
def test_the_plan_and_muon_refuse_bad_settings_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        plan_owner_compute([], **kwargs)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        Muon([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)
