"""FSDP2 (``fully_shard``) params through get_optimizer, Muon and AdaptiveMuon: parity with one process.

Two gloo ranks on CPU shard a tiny GPT (each transformer layer, then the root), and each feeds
its own half of one global batch, so FSDP's gradient reduce-scatter (an average) is part of what
is compared. The reference is one process stepping the same model on the whole batch with the
mean loss, whose gradient is that average. Each spawned run does several checks (a spawn costs
seconds), shared by the tests through module-scoped fixtures.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any, get_args

import pytest
import torch

from optzoo.optimizers.adaptive_muon import AdaptiveMuon, Moment2Method
from optzoo.optimizers.muon import Muon
from optzoo import OptimizerConfig, get_optimizer
from optzoo.distributed import preserve_param_attributes
from optzoo.models import GPT
from tests.conftest import tiny_gpt
from tests.distributed.harness import one_thread, run_ranks

pytestmark = pytest.mark.slow

WORLD_SIZE = 2
STEPS = 5
BATCH = 4  # global; rank r takes rows [r * BATCH / WORLD_SIZE, (r + 1) * BATCH / WORLD_SIZE)
BASE = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
CONFIGS: dict[str, OptimizerConfig] = {
    "adam": BASE.replace(optimizer="adam"),
    "muon": BASE.replace(optimizer="muon"),
    # normuon: its row/column second moment and Frobenius norms need the whole matrix.
    "adaptive_muon": BASE.replace(optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon"),
}
# FSDP sums the two ranks' gradients in another order than one backward over the whole batch:
# gradients and grad norms agree to ~2e-7 relative (float32 rounding; measured at most 2.2e-7),
# and after 5 steps of lr 1e-2 the parameters (which move by up to 0.2) differ by at most 7e-7.
PARAM_ATOL = 5e-6
NORM_RTOL = 1e-6


# ---- runs -------------------------------------------------------------------------------------


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(32, (BATCH, 9), generator=generator) for _ in range(STEPS)]


def _model() -> GPT:
    torch.manual_seed(0)
    return tiny_gpt()


def _fully_shard(model: GPT, mesh: Any) -> None:
    """``fully_shard`` each layer, then the root, keeping the parameters' routing attributes.

    FSDP2 registers new (DTensor) parameters and drops attributes set on the old ones
    (``is_embedding_or_output_parameter``, ``qkv_split_shapes``), which would change the routing;
    they are put back by name (:func:`optzoo.distributed.preserve_param_attributes`).
    """
    from torch.distributed.fsdp import fully_shard

    with preserve_param_attributes(model):
        for layer in model.decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)


Run = tuple[list[tuple[str, list[str]]], list[float | None], dict[str, torch.Tensor]]
"""Each group's (optimizer, param names), the grad norm of each step, the final (whole) params."""


def _train(model: GPT, config: OptimizerConfig, rows: slice) -> Run:
    from torch.distributed.tensor import DTensor

    opt = get_optimizer(config, model)
    norms = []
    for batch in _batches():
        opt.zero_grad()
        model.loss(batch[rows]).backward()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    params = {
        name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        for name, param in model.named_parameters()
    }
    return [(g["optimizer"], list(g["param_names"])) for g in opt.param_groups], norms, params


REFUSE_DTENSORS = ("soap", "rekls", "psgd_pro", "oblique_sgd", "oblique_adam")
"""Upstream classes that precondition or normalise the tensor they are given: a shard's factors or
norms are not the matrix's, so each refuses FSDP2's DTensor params by name."""


def _fsdp_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Every config trained under FSDP2 on this rank's share of each batch, and the refusals of ``REFUSE_DTENSORS``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    share = BATCH // world_size
    out: dict[str, Any] = {}
    for name, config in CONFIGS.items():
        model = _model()
        _fully_shard(model, mesh)
        out[name] = _train(model, config, slice(rank * share, (rank + 1) * share))
    for refusing in REFUSE_DTENSORS:
        model = _model()
        _fully_shard(model, mesh)
        try:
            get_optimizer(BASE.replace(optimizer=refusing), model)
        except ValueError as error:
            out[refusing] = str(error)
    return out


@pytest.fixture(scope="module")
def fsdp() -> list[dict[str, Any]]:
    return run_ranks(WORLD_SIZE, _fsdp_runs)


@pytest.fixture(scope="module")
def single() -> dict[str, Run]:
    with one_thread():
        return {name: _train(_model(), config, slice(None)) for name, config in CONFIGS.items()}


def _comparable(name: str, param: torch.Tensor) -> torch.Tensor:
    """The entries whose update is defined by the gradient: all but the key biases.

    Softmax ignores a per-query constant, so a key bias's gradient is 0 up to rounding (~5e-10
    here); Adam normalises that noise to ±lr a step, in either run's own direction.
    """
    if not name.endswith("linear_qkv.bias"):
        return param
    head_dim = 8  # tiny_gpt: hidden 16, 2 heads; per head its q, k and v rows in turn
    return param.view(-1, 3, head_dim)[:, [0, 2]]


def _prefixed(where: str) -> Callable[[str], str]:
    return lambda message: f"{where}: {message}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp2_matches_one_process(name: str, fsdp: list[dict[str, Any]], single: dict[str, Run]) -> None:
    groups, norms, params = single[name]
    for rank, result in enumerate(fsdp):
        got_groups, got_norms, got_params = result[name]
        assert got_groups == groups, f"rank {rank}: routing differs under FSDP2"
        torch.testing.assert_close(got_norms, norms, rtol=NORM_RTOL, atol=0.0, msg=_prefixed(f"rank {rank}"))
        for param_name, expected in params.items():
            torch.testing.assert_close(
                _comparable(param_name, got_params[param_name]), _comparable(param_name, expected),
                rtol=0.0, atol=PARAM_ATOL, msg=_prefixed(f"rank {rank}, `{param_name}`"),
            )  # fmt: skip


@pytest.mark.parametrize("name", REFUSE_DTENSORS)
def test_whole_matrix_preconditioners_refuse_dtensor_params(name: str, fsdp: list[dict[str, Any]]) -> None:
    expected = (
        rf"`decoder\.layers\.0\.self_attention\.linear_qkv\.weight`: {name} needs whole matrices .*; "
        r"got a DTensor of shape \(48, 16\) with placements \(Shard\(dim=0\),\); expected a plain tensor"
    )
    for result in fsdp:
        assert re.fullmatch(expected + ".*", result[name]), result.get(name)


# ---- the optimizers alone, on uneven shards ---------------------------------------------------

SHAPES = [(33, 65), (5, 7), (5, 7), (7, 5), (1, 3), (9, 4)]
"""Odd row counts shard unevenly over 2 ranks ((1, 3) leaves rank 1 an empty shard); the two
5 x 7 matrices share a Newton–Schulz batch; the 9 x 4 one is a fused QKV of 3 groups of [1, 1, 1]
rows, whose blocks cross the shard boundary."""
QKV_SPLIT = [1, 1, 1]


def _muon(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return Muon(params, lr=0.02, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest")


def _adaptive(method: Moment2Method) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    def build(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return AdaptiveMuon(params, lr=0.02, weight_decay=0.1, moment2_method=method, fp32_matmul_prec="highest")

    return build


OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "muon": _muon,
    **{f"adaptive_muon_{method}": _adaptive(method) for method in get_args(Moment2Method)},
}
DIRECT_STEPS = 3


def step_sharded_beside_plain(
    build: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], shapes: list[tuple[int, ...]], qkv_split: list[int],
    steps: int, mesh: Any,
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], torch.optim.Optimizer, torch.optim.Optimizer]:
    """``build`` over plain params and over ``Shard(0)`` DTensor copies of them, stepped ``steps``
    times with the same gradients (the last param a fused QKV split by ``qkv_split``); the sharded
    optimizer's state dict makes a round trip into a new optimizer after the first step.
    Returns ``(plain, sharded, plain's optimizer, sharded's optimizer)``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    generator = torch.Generator().manual_seed(3)  # the same values on every rank
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    plain = [torch.nn.Parameter(w.clone()) for w in initial]
    sharded = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in initial]
    for p in (plain[-1], sharded[-1]):
        p.qkv_split_shapes = qkv_split  # type: ignore[attr-defined]
    reference, opt = build(plain), build(sharded)
    for step in range(steps):
        grads = [torch.randn(shape, generator=generator) for shape in shapes]
        for p, q, g in zip(plain, sharded, grads):
            p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
        reference.step()
        opt.step()
        if step == 0:
            saved = copy.deepcopy(opt.state_dict())
            opt = build(sharded)
            opt.load_state_dict(saved)
    return plain, sharded, reference, opt


def _direct_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Each optimizer on Shard(0) DTensors and on plain copies with the same gradients.

    The state dict makes a round trip into a new optimizer after the first step. Returns, per
    optimizer, the largest difference of whole params and state, and the state's placements.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {}
    for name, build in OPTIMIZERS.items():
        plain, sharded, reference, opt = step_sharded_beside_plain(build, SHAPES, QKV_SPLIT, DIRECT_STEPS, mesh)
        diffs = [(q.full_tensor() - p).abs().max().item() for p, q in zip(plain, sharded)]  # type: ignore[attr-defined]
        for p, q in zip(plain, sharded):
            for key, value in opt.state[q].items():
                diffs.append((value.full_tensor() - reference.state[p][key]).abs().max().item())
        placements = {
            key: tuple(repr(pl) for pl in value.placements) if isinstance(value, DTensor) else type(value).__name__
            for key, value in opt.state[sharded[0]].items()
        }
        out[name] = (max(diffs), placements)
    return out


@pytest.fixture(scope="module")
def direct() -> list[dict[str, Any]]:
    return run_ranks(WORLD_SIZE, _direct_runs)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_params_step_exactly_as_whole_ones(name: str, direct: list[dict[str, Any]]) -> None:
    # Exact (atol = rtol = 0): both sides get the same gradients, the element-wise steps are the
    # same operations per element, and Newton–Schulz sees the same whole matrices in the same batches.
    for result in direct:
        assert result[name][0] == 0.0


def test_state_is_sharded_like_the_param_where_element_wise(direct: list[dict[str, Any]]) -> None:
    shard, replicate = ("Shard(dim=0)",), ("Replicate()",)
    for result in direct:
        assert result["muon"][1] == {"momentum_buffer": shard}
        assert result["adaptive_muon_adamuon"][1] == {"momentum_buffer": shard, "exp_avg_sq": shard}
        assert result["adaptive_muon_normuon"][1] == {"momentum_buffer": shard, "exp_avg_sq": replicate}
        assert result["adaptive_muon_namo"][1] == {"momentum_buffer": shard, "exp_avg_sq": replicate}


# ---- roles through fully_shard --------------------------------------------------------------


def _roles_and_placement(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    from optzoo import infer_roles, resolve_group_configs

    roles = infer_roles(model)
    groups, _ = resolve_group_configs(BASE.replace(optimizer="muon"), model)
    return (
        {name: roles[id(p)].describe() for name, p in model.named_parameters()},
        {name: g.optimizer for g in groups for name in g.param_names},
    )


def _hf_moe_roles_under_fsdp(rank: int, world_size: int) -> tuple[dict[str, str], dict[str, str], bool]:
    """A tiny Qwen3-MoE, untagged, sharded layer by layer and at the root: its roles and Muon's placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from optzoo.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("Qwen3MoeConfig")
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)  # no preserve_param_attributes: roles need no attributes
    fully_shard(model, mesh=mesh)
    roles, placement = _roles_and_placement(model)
    return roles, placement, all(isinstance(p, DTensor) for p in model.parameters())


def test_roles_and_muon_routing_survive_fully_shard() -> None:
    from optzoo.hf import build_hf_model

    torch.manual_seed(0)
    expected = _roles_and_placement(build_hf_model("Qwen3MoeConfig"))
    for roles, placement, sharded in run_ranks(WORLD_SIZE, _hf_moe_roles_under_fsdp):
        assert sharded
        assert (roles, placement) == expected
    assert expected[0]["model.layers.0.mlp.experts.gate_up_proj"] == (
        "matrix (forward: _grouped_mm weight); expert (forward: blocks chosen by the data)"
    )
    assert expected[1]["model.layers.0.mlp.experts.gate_up_proj"] == "muon"
    assert expected[1]["model.embed_tokens.weight"] == "adam"
