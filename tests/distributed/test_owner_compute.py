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
from optzoo.optimizers.owner_compute import Unit, assign_owners, dim0_chunks
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


@pytest.mark.parametrize("kind", KINDS)
def test_each_matrix_orthogonalised_exactly_once_across_ranks(kind: str, ranks: Any, single: Any) -> None:
    world_size, results = ranks
    once = Counter(single[("odd", kind)][1])
    assert sum(once.values()) == STEPS * (1 + 1 + 1 + 3 + 4 + 1 + 3 + 1 + 1 + 1)  # QKV: 3 blocks; stacks: per expert
    owner = sum((Counter(result[("odd", kind, "owner")][1]) for result in results), Counter())
    assert owner == once
    redundant = sum((Counter(result[("odd", kind, "redundant")][1]) for result in results), Counter())
    assert redundant == Counter({shape: count * world_size for shape, count in once.items()})


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
    holders = dim0_chunks((4, 8, 8), 2)  # two experts per rank
    experts = [((k * 64, (k + 1) * 64), holders, 10.0) for k in range(4)]
    split = [((0, 64), dim0_chunks((8, 8), 2), 30.0), ((0, 64), dim0_chunks((8, 8), 2), 5.0)]
    owners, loads = assign_owners([*experts, *split], 2)
    assert owners == [0, 0, 1, 1, 0, 1]  # experts where they are; 30 to a tie (rank 0), 5 to the lighter
    assert loads == [50.0, 25.0]


def test_a_units_pieces_cover_it_once() -> None:
    holders = tuple(dim0_chunks((7, 3), 4))  # rows 2, 2, 2, 1
    unit = Unit("m", 0, 21, holders, owner=0)
    pieces = [unit.piece(rank) for rank in range(4)]
    assert pieces == [(0, 6), (6, 12), (12, 18), (18, 21)]
    expert = Unit("e", 6, 12, holders, owner=1)
    assert [expert.piece(rank) for rank in range(4)] == [(6, 6), (6, 12), (12, 12), (12, 12)]


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_the_plan_refuses_a_world_size_that_is_not_a_positive_int(world_size: object) -> None:
    message = rf"^`world_size`: must be a positive int; got {re.escape(repr(world_size))}; expected an int >= 1$"
    with pytest.raises(ValueError, match=message):
        dim0_chunks((4, 4), world_size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        assign_owners([], world_size)  # type: ignore[arg-type]
