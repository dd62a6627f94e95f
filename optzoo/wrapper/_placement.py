"""Loaded state as the kind of tensor its live param is: FSDP2's DTensor or a plain tensor.

A checkpoint saved under FSDP2 holds DTensors, one saved by one process plain whole tensors; the
state dict loader (:mod:`optzoo.wrapper.state_dict`) converts each loaded tensor here, before it
changes anything, so either loads into the other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from optzoo.optimizers.muon_ops import take_shard

__all__ = ["as_kind_of", "has_data"]


def as_kind_of(param: torch.Tensor, value: Any) -> Any:
    """``value`` as the kind of tensor ``param`` is: a DTensor placed as ``param`` (FSDP2), or a
    plain whole tensor, whichever layout the checkpoint was saved from (no dtype or device change).

    A whole tensor of the param's shape is sharded as the param (locally: every rank holds it);
    another (SOAP's factors, AdaptiveMuon's row moments) is replicated, as the optimizers create
    them; a DTensor is gathered for a plain param (a collective: every rank loads the same dict).
    """
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor) and not isinstance(param, DTensor):
        return value.full_tensor()
    if not isinstance(param, DTensor) or value.dim() == 0:
        return value
    mesh = param.device_mesh
    if isinstance(value, DTensor):
        if value.device_mesh == mesh and (value.placements == param.placements or value.shape != param.shape):
            return value
        value = value.full_tensor()
    local = value.to(param.device)
    if value.shape == param.shape:
        return DTensor.from_local(take_shard(local, param), mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
    return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)


def has_data(value: torch.Tensor) -> bool:
    """Whether ``value`` holds values a load can copy: a dense tensor, not on ``meta``."""
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.device.type != "meta" and local.layout == torch.strided
