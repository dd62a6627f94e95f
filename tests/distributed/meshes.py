"""Tiny models and the N-D meshes FSDP2 runs on, for multi-rank tests (gloo, CPU, 4 ranks).

Builders (seeded, random init, nothing downloaded): :func:`gpt` (optzoo's GPT, Megatron names),
:func:`llama` (Hugging Face Llama), :func:`qwen3_moe` (Hugging Face Qwen3-MoE, 3-D expert stacks).

Sharders, in place, each returning its root mesh; run them on every rank of the world:

- :func:`hsdp`: ``fully_shard`` over a (rep, shard) mesh: placements ``(Replicate(), Shard(0))``;
- :func:`fsdp_tp`: ``parallelize_module`` over ``mesh["tp"]`` with a TP plan (:data:`GPT_TP_PLAN`,
  :data:`LLAMA_TP_PLAN`), then ``fully_shard`` over ``mesh["dp"]``: TP'd weights land on the 2-D mesh
  (colwise ``(_StridedShard(0), Shard(0))``, rowwise ``(Shard(0), Shard(1))``), the rest on the 1-D
  sub-mesh ``("dp",)``, implicitly replicated over tp;
- :func:`ep_fsdp`: a MoE's 3-D expert stacks ``Shard(0)`` over ``mesh["ep"]`` (experts split across
  ranks), then ``fully_shard`` over ``mesh["edp"]``; the dense params over the flattened (edp, ep) mesh.

A TP forward needs head-local views the models do not have, so tests set gradients directly:
:func:`reference_grads` draws whole ones on a one-process twin, :func:`set_grads` gives each
(DTensor) param of the sharded model its own piece of them, with the param's own placements, and
:func:`full` reads a param back whole, so that optimizer results compare with one process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch.distributed.tensor import DTensor

from optzoo.distributed import preserve_param_attributes
from optzoo.models import GPT, GPTConfig

__all__ = [
    "GPT_TP_PLAN",
    "LLAMA_TP_PLAN",
    "ep_fsdp",
    "fsdp_tp",
    "full",
    "full_params",
    "gpt",
    "hsdp",
    "llama",
    "local_piece",
    "qwen3_moe",
    "reference_grads",
    "set_grads",
]


# ---- models -------------------------------------------------------------------------------------


def gpt(*, hidden: int = 16, heads: int = 2, num_layers: int = 2, seed: int = 0) -> GPT:
    """optzoo's GPT with Megatron names (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``).

    With 2 heads and TP 2, colwise ``linear_qkv`` gives each TP rank one head's q, k and v rows
    (the fused layout is per head), as Megatron splits it.
    """
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, hidden_size=hidden, num_layers=num_layers, num_heads=heads, max_seq_len=8))


def llama(*, seed: int = 0) -> torch.nn.Module:
    """Hugging Face Llama, 2 layers, hidden 16, 2 heads of 8 (q/k/v 16x16, MLP 32)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def qwen3_moe() -> torch.nn.Module:
    """Hugging Face Qwen3-MoE (tests/conftest.py's): 4 experts as 3-D stacks
    (``mlp.experts.gate_up_proj`` 4x24x16, ``mlp.experts.down_proj`` 4x16x12)."""
    from tests.conftest import tiny_qwen3_moe

    return tiny_qwen3_moe()


# ---- meshes -------------------------------------------------------------------------------------


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer layers, each its own FSDP unit (as torchtitan and accelerate wrap them)."""
    return [module for name, module in model.named_modules() if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) for module in module]


def _fully_shard(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def hsdp(model: torch.nn.Module, rep: int, shard: int) -> Any:
    """HSDP in place: ``fully_shard`` each layer, then the root, over a (rep, shard) mesh.

    Every param gets ``(Replicate(), Shard(0))``: ``rep`` replicas of a ``shard``-way FSDP.
    Routing attributes are kept (:func:`optzoo.distributed.preserve_param_attributes`).
    Returns the mesh, dims ``("rep", "shard")``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (rep, shard), mesh_dim_names=("rep", "shard"))
    with preserve_param_attributes(model):
        _fully_shard(model, mesh)
    return mesh


def _plan(spec: Mapping[str, str]) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {pattern: styles[style]() for pattern, style in spec.items()}


GPT_TP_PLAN: dict[str, str] = {
    "decoder.layers.*.self_attention.linear_qkv": "colwise",
    "decoder.layers.*.self_attention.linear_proj": "rowwise",
    "decoder.layers.*.mlp.linear_fc1": "colwise",
    "decoder.layers.*.mlp.linear_fc2": "rowwise",
}
"""Megatron's TP for the GPT: column-parallel QKV and fc1, row-parallel proj and fc2."""

LLAMA_TP_PLAN: dict[str, str] = {
    **{f"model.layers.*.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")},
    "model.layers.*.self_attn.o_proj": "rowwise",
    **{f"model.layers.*.mlp.{name}": "colwise" for name in ("gate_proj", "up_proj")},
    "model.layers.*.mlp.down_proj": "rowwise",
}
"""torchtitan's / HF's base TP plan for Llama: colwise q/k/v/gate/up, rowwise o/down."""


def fsdp_tp(model: torch.nn.Module, dp: int, tp: int, plan: Mapping[str, str]) -> Any:
    """FSDP x TP in place, as torchtitan does: ``parallelize_module(model, mesh["tp"], plan)``, then
    ``fully_shard`` each layer and the root over ``mesh["dp"]``.

    ``plan``: module-name pattern -> ``"colwise"`` or ``"rowwise"`` (:data:`GPT_TP_PLAN`,
    :data:`LLAMA_TP_PLAN`). Returns the mesh, dims ``("dp", "tp")``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    with preserve_param_attributes(model):
        parallelize_module(model, mesh["tp"], _plan(plan))
    with preserve_param_attributes(model):
        _fully_shard(model, mesh["dp"])
    return mesh


def ep_fsdp(model: torch.nn.Module, edp: int, ep: int) -> Any:
    """EP x FSDP in place, as torchtitan shards MoE models: each 3-D expert stack (a param whose
    module name ends in ``experts``) is ``Shard(0)`` over ``mesh["ep"]`` (rank r of ep holds experts
    ``[r * E / ep, (r + 1) * E / ep)``), then the experts modules ``fully_shard`` over ``mesh["edp"]``
    (on dim 1, the experts' rows) and everything else over the flattened (edp, ep) mesh.
    Returns the mesh, dims ``("edp", "ep")``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (edp, ep), mesh_dim_names=("edp", "ep"))
    experts = [module for name, module in model.named_modules() if name.endswith("experts")]
    with preserve_param_attributes(model):
        for module in experts:
            for name, param in list(module.named_parameters(recurse=False)):
                stacked = distribute_tensor(param.detach(), mesh["ep"], [Shard(0)])
                module.register_parameter(name, torch.nn.Parameter(stacked, requires_grad=param.requires_grad))
    with preserve_param_attributes(model):
        for module in experts:
            fully_shard(module, mesh=mesh["edp"], shard_placement_fn=lambda _: Shard(1))
        dense = mesh["edp", "ep"]._flatten("dp")
        _fully_shard(model, dense)
    return mesh


# ---- gradients and whole values -----------------------------------------------------------------


def reference_grads(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A random whole gradient per param of a one-process model, by name (reproducible from ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(param.shape, generator=generator, dtype=param.dtype) for name, param in model.named_parameters()}


def local_piece(whole: torch.Tensor, like: DTensor) -> DTensor:
    """``whole`` cut to this rank's piece of ``like`` (same mesh, placements, global shape).

    The piece is the box ``compute_local_shape_and_global_offset`` gives (it handles
    ``_StridedShard``, which ``distribute_tensor`` does not), wrapped without communication.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    piece = whole
    for dim, (start, length) in enumerate(zip(offset, shape)):
        piece = piece.narrow(dim, start, length)
    return DTensor.from_local(
        piece.clone().contiguous(), like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def set_grads(model: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    """Give each param of ``model`` (sharded or not) its piece of the whole gradient ``grads[name]``."""
    for name, param in model.named_parameters():
        whole = grads[name].to(param.dtype)
        param.grad = local_piece(whole, param) if isinstance(param, DTensor) else whole.clone()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a (DTensor) param, state or grad, detached (a collective for DTensors)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every param of ``model`` whole, by name (a collective per DTensor param: call on every rank)."""
    return {name: full(param) for name, param in model.named_parameters()}
