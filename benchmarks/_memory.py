"""Transient memory measured, not inferred: the bytes of the tensors a step allocates, live at each moment."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveBytes", "MarkAtFirstBucket"]


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors created inside, live at each moment: each new storage counted once,
    until the last tensor seen on it is freed; ``peak`` is the most since :meth:`mark`. DTensors
    count through their local tensors (created inside too)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[Any]] = {}
        self.current = self.base = self.peak = 0

    def mark(self) -> None:
        self.base = self.peak = self.current

    def _release(self, key: int, size: int) -> None:
        refs = self.live.get(key)
        if refs is not None and all(ref() is None for ref in refs):
            del self.live[key]
            self.current -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if type(tensor) is torch.Tensor and tensor.untyped_storage().nbytes():
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if key not in self.live:
                    self.live[key] = []
                    self.current += size
                    self.peak = max(self.peak, self.current)
                self.live[key].append(weakref.ref(tensor))
                weakref.finalize(tensor, self._release, key, size)
        return out


class MarkAtFirstBucket(list):  # type: ignore[type-arg]
    """Muon's owner-computes trace (``optimizer.owner_compute_trace``), marking the memory probe
    when the step's first bucket is issued: what is allocated from then on is the buckets'."""

    def __init__(self, probe: LiveBytes | None) -> None:
        super().__init__()
        self.probe = probe

    def append(self, event: Any) -> None:
        if self.probe is not None and event == ("to", 0, "issue") and not self:
            self.probe.mark()
        super().append(event)
