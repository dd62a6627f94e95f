"""``optzoo.estimate`` against what the optimizer really holds after its first step on CPU.

The answer comes from outside the estimate: the bytes of every storage the optimizer holds beside
the model after one real ``get_optimizer`` step (its state tensors, its main params, its gradient
buffers), each storage counted once by its data pointer, for every registered algorithm in fp32,
bf16 and under the precision-aware optimizer, on a tiny GPT, a tiny Llama and a tiny Qwen3-MoE.
Hand-derived numbers check a layer-wise and a ZeRO-1 plan; the multi-rank runs are in
``tests/distributed/test_estimate_ranks.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

from optzoo import OptimizerConfig, estimate, get_optimizer
from optzoo.models import GPT, GPTConfig
from optzoo.optimizers.newton_schulz import newton_schulz_flops
from optzoo.optimizers.registry import get_spec, registered_names
from tests.conftest import tiny_qwen3_moe
from tests.optimizers.test_muon_views import ConcatenatedMoE

TOLERANCE = 0.02
"""The issue's bound on the relative error of each component (measured: exact, see below)."""


def _gpt() -> torch.nn.Module:
    return GPT(GPTConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=64, max_seq_len=16))


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt": _gpt, "llama": _llama, "qwen3_moe": tiny_qwen3_moe}
PRECISIONS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"bf16": True},
    "precision_aware": {"bf16": True, "use_precision_aware_optimizer": True},
}


def held_bytes(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the storages the optimizer holds beside the model's params and grads, by kind; each
    storage once (by data pointer), its whole allocation (``untyped_storage().nbytes()``)."""
    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    seen = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen |= {local(p.grad).untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}

    def count(value: object) -> int:
        if isinstance(value, (list, tuple)):
            return sum(count(item) for item in value)
        if not isinstance(value, torch.Tensor):
            return 0
        storage = local(value).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    mains = [p for group in optimizer.param_groups for p in group["params"]]
    wrapper: Any = optimizer
    held = {
        "state": sum(count(value) for state in optimizer.state.values() for value in state.values()),
        "main_params": sum(count(main) for main in mains),
        "grads": sum(count(main.grad) + count(getattr(main, "decoupled_grad", None)) for main in mains)
        + sum(count(buffer) for buffer in wrapper._grad_buffers.values()),
        "sync": sum(count(buffers) for *_, by_dtype in getattr(wrapper, "_syncs", []) for buffers in by_dtype.values()),
    }
    return held


def estimated(rank: Any) -> dict[str, int]:
    return {"state": rank.state_bytes, "main_params": rank.main_param_bytes, "grads": rank.grad_buffer_bytes, "sync": rank.param_sync_bytes}


def relative_errors(estimate_: dict[str, int], measured: dict[str, int]) -> dict[str, float]:
    """Per component and in total: |estimate - measured| / measured (0 where both are 0)."""
    pairs = {**{k: (estimate_[k], measured[k]) for k in measured}, "total": (sum(estimate_.values()), sum(measured.values()))}
    return {k: abs(e - m) / m if m else float(e != 0) for k, (e, m) in pairs.items()}


def _step_once(optimizer: Any, model: torch.nn.Module) -> None:
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    success, _, _ = optimizer.step()
    assert success


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", registered_names())
@pytest.mark.parametrize("model_name", list(MODELS))
def test_estimate_is_what_the_first_step_holds(model_name: str, name: str, precision: str) -> None:
    settings = PRECISIONS[precision]
    if precision == "precision_aware" and name != "adam":  # Megatron-Core's precision-aware optimizer is Adam
        with pytest.raises(ValueError, match=rf"`OptimizerConfig\.optimizer`: use_precision_aware_optimizer supports adam only; got '{name}'"):
            OptimizerConfig(optimizer=name, lr=1e-4, **settings)
        return
    config = OptimizerConfig(optimizer=name, lr=1e-4, **settings)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    if config.bf16:
        model = model.to(torch.bfloat16)
    result = estimate(config, model)
    optimizer = get_optimizer(config, model)
    _step_once(optimizer, model)
    errors = relative_errors(estimated(result.ranks[0]), held_bytes(optimizer, model))
    assert max(errors.values()) <= TOLERANCE, errors
    assert sum(g.state_bytes for g in result.groups) == result.ranks[0].state_bytes


ADAM_PRECISIONS: dict[str, dict[str, Any]] = {
    "fp16_loss_scaler": {"fp16": True},
    "bf16_static_scale": {"bf16": True, "loss_scale": 128.0},
    "pa_fp32_master": {"bf16": True, "use_precision_aware_optimizer": True, "store_param_remainders": False},
    "pa_bf16_moments_and_grads": {
        "bf16": True, "use_precision_aware_optimizer": True, "exp_avg_dtype": torch.bfloat16,
        "exp_avg_sq_dtype": torch.bfloat16, "main_grads_dtype": torch.bfloat16,
    },  # fmt: skip
    "pa_fp16": {"fp16": True, "use_precision_aware_optimizer": True, "store_param_remainders": False, "main_params_dtype": torch.float16},
    "pa_fp32_model": {"use_precision_aware_optimizer": True, "store_param_remainders": False},
}


@pytest.mark.parametrize("precision", list(ADAM_PRECISIONS))
def test_estimate_follows_every_precision_field(precision: str) -> None:
    """The precision-aware Adam's typed moments, master copies and decoupled grads, fp16 with its loss scaler."""
    config = OptimizerConfig(lr=1e-4, **ADAM_PRECISIONS[precision])
    torch.manual_seed(0)
    model = _gpt()
    if config.fp16 or config.bf16:
        model = model.to(torch.float16 if config.fp16 else torch.bfloat16)
    result = estimate(config, model)
    optimizer = get_optimizer(config, model)
    _step_once(optimizer, model)
    errors = relative_errors(estimated(result.ranks[0]), held_bytes(optimizer, model))
    assert max(errors.values()) <= TOLERANCE, errors


def test_estimate_of_a_model_with_fp32_params_beside_bf16_ones() -> None:
    """An fp32 norm in a bf16 model is its own main param, stepped on its own gradient."""
    config = OptimizerConfig(lr=1e-4, bf16=True)
    torch.manual_seed(0)
    model = _gpt().to(torch.bfloat16)
    model.decoder.final_layernorm.float()
    result = estimate(config, model)
    optimizer = get_optimizer(config, model)
    _step_once(optimizer, model)
    errors = relative_errors(estimated(result.ranks[0]), held_bytes(optimizer, model))
    assert max(errors.values()) <= TOLERANCE, errors


@pytest.mark.parametrize("model_name", ["gpt", "llama"])
def test_estimate_runs_on_the_meta_device_and_agrees_with_a_real_model(model_name: str) -> None:
    config = OptimizerConfig(optimizer="muon", lr=1e-4, bf16=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        on_meta = MODELS[model_name]().to(torch.bfloat16)
    assert all(p.is_meta for p in on_meta.parameters())
    real = MODELS[model_name]().to(torch.bfloat16)
    for world, mode in ((1, None), (2, "layer_wise"), (2, "sharded")):
        assert estimate(config, on_meta, world_size=world, distributed=mode) == estimate(config, real, world_size=world, distributed=mode)
    assert estimate(config, on_meta, mesh="2", tp=2).as_json() == estimate(config, real, mesh="2", tp=2).as_json()


# ---- per rank, by hand -----------------------------------------------------------------------


def _linear() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


def test_zero1_ranks_by_hand() -> None:
    """ZeRO-1 over 2 ranks of a 4x4 Linear: 20 elements cut at 10, so rank 0 steps weight[0:10] and
    rank 1 weight[10:16] and the bias; Adam keeps two fp32 moments per element and a 4-byte step per
    stepped tensor; each rank holds one all-gather buffer of max(10, 10) elements per rank."""
    result = estimate(OptimizerConfig(lr=1e-3, standard_overrides=False), _linear(), {}, world_size=2, distributed="sharded")
    assert [r.state_bytes for r in result.ranks] == [10 * 8 + 4, 6 * 8 + 4 + 4 * 8 + 4]
    assert [r.param_sync_bytes for r in result.ranks] == [2 * 10 * 4, 2 * 10 * 4]
    assert [(r.main_param_bytes, r.grad_buffer_bytes) for r in result.ranks] == [(0, 0), (0, 0)]
    bf16 = estimate(OptimizerConfig(lr=1e-3, bf16=True, standard_overrides=False), _linear().bfloat16(), {}, world_size=2, distributed="sharded")
    assert [(r.main_param_bytes, r.grad_buffer_bytes, r.param_sync_bytes) for r in bf16.ranks] == [(40, 40, 40), (40, 40, 40)]


def test_layer_wise_newton_schulz_flops_by_hand() -> None:
    """Muon on three 8x16 matrices over 2 ranks: each matrix is owned whole, the ranks' FLOPs sum to
    one process's, which is three times the cheaper Newton–Schulz variant's for 5 steps."""
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 8, bias=False) for _ in range(3)))
    config = OptimizerConfig(optimizer="muon", lr=1e-3)
    one = 3 * min(newton_schulz_flops(8, 16, steps=5, variant=v) for v in ("standard", "gram"))
    single = estimate(config, model, {}, trace=False)
    assert single.ranks[0].orthogonalize_flops == one
    ranks = estimate(config, model, {}, world_size=2, distributed="layer_wise", trace=False).ranks
    assert sorted(r.orthogonalize_flops for r in ranks) == [one / 3, 2 * one / 3]
    assert sorted(r.state_bytes for r in ranks) == [8 * 16 * 4, 2 * 8 * 16 * 4]  # Muon: one fp32 momentum


def test_fsdp2_ranks_hold_their_shards() -> None:
    """FSDP over 2 ranks shards dim 0: Adam's state of a 4x4 Linear's weight and bias split in halves."""
    result = estimate(OptimizerConfig(lr=1e-3, standard_overrides=False), _linear(), {}, mesh="2")
    assert result.distributed == "fsdp2" and result.world_size == 2
    assert [r.state_bytes for r in result.ranks] == [8 * 8 + 4 + 2 * 8 + 4] * 2


def test_bad_arguments_are_refused_by_name() -> None:
    config = OptimizerConfig(lr=1e-3)
    with pytest.raises(ValueError, match=r"`distributed`: unknown value; got 'zero3'"):
        estimate(config, _linear(), distributed="zero3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`mesh`: is FSDP2's device mesh; got a mesh with distributed='sharded'"):
        estimate(config, _linear(), mesh="2", distributed="sharded")
    with pytest.raises(ValueError, match=r"`world_size`: must be the mesh's size; got 3"):
        estimate(config, _linear(), mesh="2", world_size=3)
    with pytest.raises(ValueError, match=r"`world_size`: must be a positive integer; got 0"):
        estimate(config, _linear(), world_size=0)


def test_no_allocation_on_meta() -> None:
    """Nothing the size of the model is allocated: a 1-billion-element meta model is estimated at once."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(32768, 32768, bias=False))
    result = estimate(OptimizerConfig(lr=1e-3, bf16=True), model.bfloat16(), {}, trace=False)
    numel = 32768 * 32768
    assert result.ranks[0].state_bytes == 2 * 4 * numel + 4 and result.ranks[0].main_param_bytes == 4 * numel
    assert math.isclose(result.ranks[0].held_bytes / 2**30, 16.0, rel_tol=1e-6)


@pytest.mark.parametrize("method", ["normuon", "namo"])
def test_estimate_follows_the_matrices_the_forward_multiplies_by(method: str) -> None:
    """NorMuon's and NAMO's second moments are per row and per matrix of each block the forward
    multiplies by: a DBRX-style ``w1`` of 3 experts concatenated (15 x 7) is three 5 x 7 matrices."""
    config = OptimizerConfig(optimizer="adaptive_muon", lr=1e-4, adaptive_muon_moment2_method=method)
    torch.manual_seed(0)
    model = ConcatenatedMoE()
    result = estimate(config, model)
    optimizer = get_optimizer(config, model)
    _step_once(optimizer, model)
    # Exact: the blocks' 6 more NorMuon row moments are 24 of ~2300 bytes, inside the 2% bound.
    assert estimated(result.ranks[0]) == held_bytes(optimizer, model)


def test_newton_schulz_flops_of_the_forward_matrices_by_hand() -> None:
    """Muon on the concatenated MoE: the router (3 x 7), w1's three 5 x 7 experts and w2's three
    7 x 5 experts, each at the cheaper Newton–Schulz variant's FLOPs for 5 steps."""
    def ns(rows: int, cols: int) -> int:
        return min(newton_schulz_flops(rows, cols, steps=5, variant=v) for v in ("standard", "gram"))

    result = estimate(OptimizerConfig(optimizer="muon", lr=1e-4), ConcatenatedMoE())
    assert result.ranks[0].orthogonalize_flops == ns(3, 7) + 3 * ns(5, 7) + 3 * ns(7, 5)


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 8, bias=False)
        self.norm = torch.nn.LayerNorm(4)


@pytest.mark.parametrize(
    ("mesh", "per_rank"),
    [
        # FSDP x TP: q_proj is column-parallel (the default TP plan), then FSDP shards TP's rows again:
        # 8 x 4 over 4 ranks = 8 elements each; the norm, which TP leaves alone, is sharded over dp only.
        ("dp=2,tp=2", 8 * 8 + 4 + 2 * (2 * 8 + 4)),
        # HSDP, 2 replicas of a 2-way shard: q_proj 16 elements per rank, the norm's 2 + 2.
        ("2x2", 16 * 8 + 4 + 2 * (2 * 8 + 4)),
    ],
)
def test_fsdp2_meshes_by_hand(mesh: str, per_rank: int) -> None:
    """Adam's two fp32 moments per local element and a 4-byte step per param, on each of 4 ranks."""
    result = estimate(OptimizerConfig(lr=1e-3), _Attention(), {}, mesh=mesh, trace=False)
    assert result.world_size == 4
    assert [r.state_bytes for r in result.ranks] == [per_rank] * 4


# By hand, from each update: a preconditioner, factor or projection of the whole tensor (SOAP, REKLS and
# PSGD's Kronecker factors, the oblique retractions, Adafactor's row/column factors, torch.optim.Muon's
# Newton-Schulz of the tensor it is given, SPEL / hyperball / Sinkhorn's projections after each update).
NEEDS_WHOLE_PARAMS = {
    "soap", "rekls", "psgd_pro", "oblique_sgd", "oblique_adam", "adafactor", "torch_muon", "spel", "muon_hyperball", "sinkhorn_muon",
}  # fmt: skip


def test_an_algorithm_that_needs_whole_params_is_refused_on_a_mesh_by_name() -> None:
    assert {name for name in registered_names() if get_spec(name).whole_params} == NEEDS_WHOLE_PARAMS
    with pytest.raises(ValueError) as refused:
        estimate(OptimizerConfig(lr=1e-3, optimizer="soap"), GPT(GPTConfig(num_layers=1, hidden_size=16, num_heads=2, vocab_size=32, max_seq_len=8)), mesh="2")
    assert str(refused.value) == (
        "`decoder.layers.0.self_attention.linear_qkv.weight`: soap needs whole matrices (emerging-optimizers' class "
        "preconditions the tensor it is given and cannot gather FSDP2 shards); got param group #0 (4 params) on FSDP2's "
        "mesh shard=2 (2 ranks); expected it off the mesh: route it to muon or adam, or leave its module out of fully_shard"
    )
