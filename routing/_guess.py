"""Roles guessed from module types, the model's API and names: the fallback when no forward is observed.

Sources, in order:

1. Megatron's tags: ``is_embedding_or_output_parameter`` (an ``embedding`` where an embedding
   module holds the tensor, else ``output``) and ``allreduce=False`` (``expert``);
2. the model's API: ``get_input_embeddings()`` and ``get_output_embeddings()``, on the model
   underneath DDP-style, ``torch.compile`` and PEFT wrappers;
3. module types: ``nn.Embedding``/``EmbeddingBag`` (``embedding``); a Linear whose weight is an
   embedding's (``output``); norms (LayerNorm, RMSNorm, GroupNorm, BatchNorm, InstanceNorm, and any
   module class whose name ends in ``Norm``); ``Conv1d/2d/3d`` and their transposes (``conv``; a
   depthwise filter is also a ``vector``); a module class named ``*Router*``, or a child called
   ``gate``, ``router`` or ``*_gate`` beside an ``experts`` child (``router``); a module called
   ``experts`` or a class named ``*Experts`` (``expert``);
4. names: ``bias`` as the last name part, or a last part ending in ``_bias``; a Linear inside a
   module called ``lm_head``, ``classifier`` or ``score`` is the ``output``.

A model that carries Megatron's ``is_embedding_or_output_parameter`` tags is taken at its word
about embeddings and the output layer here, as Megatron-Core does (the role inference would have
given is kept as ignored). Everything reads module types, attributes and shapes only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._common import Role

__all__ = ["Found", "by_name", "guess_roles"]

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase, nn.RMSNorm,
)  # fmt: skip
_CONV_TYPES: tuple[type[nn.Module], ...] = (nn.modules.conv._ConvNd,)
_EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)
_HEAD_NAMES = frozenset({"lm_head", "classifier", "score"})
"""Module names that hold a model's head in Hugging Face's task models."""


class Found:
    """Roles gathered for one tensor, in the order of their sources, and those set aside."""

    def __init__(self) -> None:
        self.roles: list[Role] = []
        self.sources: list[str] = []
        self.ignored: list[tuple[Role, str]] = []

    def add(self, role: Role, source: str) -> None:
        if role not in self.roles:
            self.roles.append(role)
            self.sources.append(source)

    def add_shape_default(self, param: torch.Tensor) -> None:
        """``matrix`` (2-D and up), ``vector`` (1-D) or ``elementwise`` (0-D: a scalar can only scale
        or shift, such as a logit scale) when nothing else was found."""
        if not self.roles:
            self.add("matrix" if param.dim() >= 2 else "vector" if param.dim() == 1 else "elementwise", f"{param.dim()}-D")


def by_name(found: Found, name: str) -> None:
    last = name.rsplit(".", 1)[-1]
    if last == "bias" or last.endswith("_bias"):
        found.add("bias", "name")


def _call(module: nn.Module, method: str) -> Any:
    """``module.method()``, or ``None`` when it is missing or raises (vision models' ``NotImplementedError``)."""
    function = getattr(module, method, None)
    if not callable(function):
        return None
    try:
        return function()
    except Exception:  # the model's own method: NotImplementedError in vision models, anything elsewhere
        return None


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


def _is_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    if "Router" in type(module).__name__:
        return True
    last = name.rsplit(".", 1)[-1]
    gate = last in ("gate", "router") or last.endswith("_gate")  # Qwen2-MoE's shared_expert_gate too
    return parent is not None and gate and isinstance(getattr(parent, "experts", None), nn.Module)


def _is_experts(name: str, module: nn.Module) -> bool:
    return name.rsplit(".", 1)[-1] == "experts" or type(module).__name__.endswith("Experts")


def _modules_with_parents(chunk: nn.Module) -> Iterable[tuple[str, nn.Module, nn.Module | None, bool]]:
    """``(name, module, parent, inside an experts container)`` for every module, parents first."""
    stack: list[tuple[str, nn.Module, nn.Module | None, bool]] = [("", chunk, None, False)]
    seen: set[int] = set()
    while stack:
        name, module, parent, in_experts = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        in_experts = in_experts or (parent is not None and _is_experts(name, module))  # the model itself is no container
        yield name, module, parent, in_experts
        children = list(module.named_children())
        for child_name, child in reversed(children):
            stack.append((f"{name}.{child_name}" if name else child_name, child, module, in_experts))


def _model_api_holders(chunk: nn.Module) -> list[nn.Module]:
    """The chunk and the models it wraps (DDP's ``.module``, ``._orig_mod``, PEFT's base model)."""
    holders = [chunk]
    for _ in range(4):
        current = holders[-1]
        inner = getattr(current, "module", None) or getattr(current, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            base = getattr(current, "get_base_model", None)
            inner = _call(current, "get_base_model") if callable(base) else None
        if not isinstance(inner, nn.Module) or inner is current:
            break
        holders.append(inner)
    return holders


def guess_roles(chunks: Sequence[nn.Module], params: dict[int, tuple[torch.Tensor, str]]) -> dict[int, Found]:
    """Roles of every tensor in ``params`` (``id -> (tensor, first name)``) from tags, API, types and names."""
    tagged = any(getattr(param, "is_embedding_or_output_parameter", False) for param, _ in params.values())
    found = {key: Found() for key in params}

    # 1. Megatron's tags
    owners: dict[int, list[nn.Module]] = {key: [] for key in params}
    for chunk in chunks:
        for module in chunk.modules():
            for owned in module.parameters(recurse=False):
                owners.setdefault(id(owned), []).append(module)
    for key, (tensor, tensor_name) in params.items():
        if getattr(tensor, "is_embedding_or_output_parameter", False):
            source = "tag is_embedding_or_output_parameter"
            kinds = {isinstance(owner, _EMBEDDING_TYPES) for owner in owners[key]} or {"embed" in tensor_name.lower()}
            for is_embedding in sorted(kinds, reverse=True):
                found[key].add("embedding" if is_embedding else "output", source)
        if getattr(tensor, "allreduce", True) is False:
            found[key].add("expert", "tag allreduce=False")

    # 2. the model's API, through wrappers
    embeddings: set[int] = set()
    api: tuple[tuple[str, Role], ...] = (("get_input_embeddings", "embedding"), ("get_output_embeddings", "output"))
    for chunk in chunks:
        for method, role in api:
            for holder in _model_api_holders(chunk):
                weight = getattr(_call(holder, method), "weight", None)
                if isinstance(weight, torch.Tensor) and id(weight) in found:
                    if tagged:
                        found[id(weight)].ignored.append((role, f"{method}(), untagged in a Megatron-tagged model"))
                    else:
                        found[id(weight)].add(role, f"{method}()")
                        if role == "embedding":
                            embeddings.add(id(weight))
                    break

    # 3. module types
    for chunk in chunks:
        for module_name, module, parent, in_experts in _modules_with_parents(chunk):
            kind = type(module).__name__
            for param_name, param in module.named_parameters(recurse=False):
                entry = found.get(id(param))
                if entry is None:
                    continue
                if isinstance(module, _EMBEDDING_TYPES) and param_name == "weight":
                    if tagged:
                        if "embedding" not in entry.roles:
                            entry.ignored.append(("embedding", f"{kind}, untagged in a Megatron-tagged model"))
                    else:
                        entry.add("embedding", f"nn.{kind}" if type(module) in _EMBEDDING_TYPES else kind)
                        embeddings.add(id(param))
                if _is_norm(module):
                    entry.add("norm", kind)
                if isinstance(module, _CONV_TYPES) and param_name == "weight":
                    entry.add("conv", kind)
                    groups, in_channels = getattr(module, "groups", 1), getattr(module, "in_channels", 0)
                    if isinstance(groups, int) and groups > 1 and groups == in_channels:
                        entry.add("vector", f"{kind}, depthwise (groups == in_channels)")
                if _is_router(module_name, module, parent):
                    entry.add("router", kind)
                if in_experts:
                    container = parent is not None and _is_experts(module_name, module)
                    entry.add("expert", kind if container else f"{kind} inside an experts module")
    if not tagged:
        linears = [(name, module) for chunk in chunks for name, module in chunk.named_modules() if isinstance(module, nn.Linear)]
        for _, module in linears:
            if id(module.weight) in embeddings:
                found[id(module.weight)].add("output", "nn.Linear sharing an embedding's weight")
        for name, module in linears:  # 4. names: a task model's head
            head = _HEAD_NAMES.intersection(name.split("."))
            if head and id(module.weight) in found:
                found[id(module.weight)].add("output", f"name ({sorted(head)[0]})")

    # 4. names
    for key, (tensor, tensor_name) in params.items():
        by_name(found[key], tensor_name)
    return found
