"""Setting up the distributed optimizers: the data-parallel group, and checks that fail fast.

Everything here runs while ``get_optimizer`` builds, before any collective sized by the params:
which process group to shard over (``process_group``, Megatron's ``pg_collection``, or the FSDP2
mesh of DTensor params), a fingerprint exchange that stops ranks that resolved different
parameters, and :func:`preserve_param_attributes` for ``fully_shard``, which drops the attributes
routing reads.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optzoo._common import shorten
from optzoo.config import OptimizerConfig
from optzoo.groups import ResolvedGroup

__all__ = [
    "check_same_model",
    "data_parallel_group",
    "distributed_flag",
    "fsdp_process_group",
    "preserve_param_attributes",
    "resolve_process_group",
]


@contextlib.contextmanager
def preserve_param_attributes(model: torch.nn.Module) -> Iterator[None]:
    """Put routing attributes back on params that the block replaces, matched by name.

    FSDP2's ``fully_shard`` registers new (DTensor) parameters and drops the attributes set on
    the old ones (``is_embedding_or_output_parameter``, ``qkv_split_shapes``, ``use_muon``), which
    would silently change the routing: embeddings would go to Muon, QKV would not be split.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> model.weight.use_muon = False
        >>> with preserve_param_attributes(model):
        ...     model.weight = torch.nn.Parameter(model.weight.detach().clone())  # as fully_shard does
        >>> model.weight.use_muon
        False
    """
    attributes = {name: dict(param.__dict__) for name, param in model.named_parameters()}
    yield
    for name, param in model.named_parameters():
        for key, value in attributes.get(name, {}).items():
            if not hasattr(param, key):
                setattr(param, key, value)


def resolve_process_group(process_group: dist.ProcessGroup | None, flag: str) -> dist.ProcessGroup:
    """The group to shard over (default: the world); a clear error when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"`{flag}`: needs torch.distributed; got no initialised process group; expected "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun), or the flag False"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    return group


def check_same_model(groups: Sequence[ResolvedGroup], process_group: dist.ProcessGroup) -> None:
    """Fail fast, on every rank, when ranks resolved different params or groups.

    Ranks exchange one fingerprint (names, shapes, dtypes, group configs) before any collective
    sized by the params, which would otherwise hang or corrupt memory.
    """
    described = [
        (group.index, group.optimizer, name, tuple(routed.param.shape), str(routed.param.dtype))
        for group in groups
        for routed, name in zip(group.params, group.param_names)
    ]
    digest = hashlib.sha256(repr(described).encode()).hexdigest()
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, (digest, described), group=process_group)
    mine = dist.get_rank(process_group)
    for rank, (other_digest, other) in enumerate(everyone):
        if other_digest == digest:
            continue
        ours, theirs = set(described), set(other)
        raise ValueError(
            f"distributed optimizer: rank {rank} resolved different parameters than rank {mine}; "
            f"got only on rank {rank}: [{shorten([repr(d) for d in sorted(theirs - ours)])}]; "
            f"expected also: [{shorten([repr(d) for d in sorted(ours - theirs)])}] (only on rank {mine}); "
            "every rank must build the same model and routing"
        )


def fsdp_process_group(groups: Sequence[ResolvedGroup]) -> dist.ProcessGroup | None:
    """The group over which FSDP2 (``fully_shard``) shards the params, or ``None`` without DTensors.

    Every DTensor param must live on the same 1-D device mesh (what ``fully_shard`` builds for
    plain data parallelism); HSDP's 2-D meshes and tensor parallelism are not supported.
    """
    meshes: dict[Any, str] = {}
    for group in groups:
        for routed, name in zip(group.params, group.param_names):
            if isinstance(routed.param, DTensor):
                meshes.setdefault(routed.param.device_mesh, name)
    if not meshes:
        return None
    if len(meshes) > 1 or next(iter(meshes)).ndim != 1:
        described = ", ".join(f"{mesh} (first: `{name}`)" for mesh, name in meshes.items())
        raise ValueError(
            f"`model_chunks`: DTensor params must share one 1-D device mesh (FSDP2 data parallelism); "
            f"got {described}; expected fully_shard over a single 1-D mesh"
        )
    group = next(iter(meshes)).get_group()
    assert isinstance(group, dist.ProcessGroup)
    return group


def distributed_flag(config: OptimizerConfig) -> str | None:
    """The distributed-optimizer flag the config sets (the layer-wise one wins), or ``None``."""
    if config.use_layer_wise_distributed_optimizer:
        return "use_layer_wise_distributed_optimizer"
    return "use_distributed_optimizer" if config.use_distributed_optimizer else None


def data_parallel_group(
    config: OptimizerConfig,
    groups: Sequence[ResolvedGroup],
    *,
    process_group: dist.ProcessGroup | None,
    pg_collection: Any,
) -> dist.ProcessGroup | None:
    """The group the step reduces over and the distributed optimizers shard over.

    ``process_group``, or ``pg_collection``'s ``dp_cp`` (else ``dp``) group, or the world, under a
    distributed-optimizer flag; without one, the FSDP2 mesh's group for DTensor params, else none.

    Raises:
        ValueError: Both ``process_group`` and ``pg_collection`` are given, ``pg_collection`` has
            no data-parallel group, a group is given without a distributed flag, a flag is set
            without an initialised process group, or a flag is set with FSDP2 params.
    """
    if pg_collection is not None:
        if process_group is not None:
            raise ValueError(
                "`pg_collection`: gives the data-parallel group, and so does `process_group`; got both; "
                "expected only one of them"
            )
        process_group = getattr(pg_collection, "dp_cp", None) or getattr(pg_collection, "dp", None)
        if not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(
                f"`pg_collection`: has no data-parallel process group; got {type(pg_collection).__name__} "
                f"with dp_cp/dp = {process_group!r}; expected a torch.distributed.ProcessGroup in `dp_cp` or `dp`"
            )
    flag = distributed_flag(config)
    if flag is None:
        if process_group is not None:
            raise ValueError(
                "`process_group`: only used by the distributed optimizers; got a process group with "
                "use_distributed_optimizer=False and use_layer_wise_distributed_optimizer=False; "
                "expected one of them True, or process_group=None"
            )
        return fsdp_process_group(groups)
    process_group = resolve_process_group(process_group, flag)
    if fsdp_process_group(groups) is not None:
        raise ValueError(
            f"`{flag}`: FSDP2 (fully_shard) already shards params and optimizer state; got DTensor "
            f"params with {flag}=True; expected {flag}=False with FSDP2"
        )
    return process_group
