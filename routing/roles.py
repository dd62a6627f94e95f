"""Parameter roles: what each parameter of a model is, read from the model itself.

A role is one of :data:`optzoo._common.ROLES`: ``embedding`` (a lookup table), ``output`` (the
head), ``bias``, ``norm``, ``expert`` (a stack of per-expert matrices, or any parameter of an
experts container), ``router`` (an MoE router), ``conv`` (a convolution filter), and, when
nothing more is known, ``matrix`` (2-D and up) or ``vector`` (1-D and 0-D). One tensor may hold
several roles (a tied embedding is also the output head); each role keeps its source, which
``optzoo dump-param-groups --explain`` shows. Sources, in order:

1. explicit tags: a role attribute set by the user (``param.optzoo_role = "expert"``, a role or a
   tuple of roles, which replaces inference for that parameter); Megatron-Core's
   ``is_embedding_or_output_parameter`` (an ``embedding`` where an embedding module holds the
   tensor, else ``output``) and ``allreduce=False`` (``expert``);
2. the model's own API: ``get_input_embeddings()`` and ``get_output_embeddings()`` (Hugging Face
   models, and any model that defines them);
3. module types: ``nn.Embedding``/``EmbeddingBag`` (``embedding``); a Linear whose weight is an
   embedding's (``output``); norms (LayerNorm, RMSNorm, GroupNorm, BatchNorm, InstanceNorm, and
   any module class whose name ends in ``Norm``, such as ``LlamaRMSNorm``); ``Conv1d/2d/3d`` and
   their transposes (``conv``; a depthwise filter, one input channel per output channel, is also a
   ``vector``: its channels are independent); a module class named ``*Router*``, or a child
   called ``gate``, ``router`` or ``*_gate`` beside an ``experts`` child (``router``); a module called
   ``experts`` or a class named ``*Experts`` (``expert``);
4. names, last: ``bias`` as the last name part, or a last part ending in ``_bias`` (GPT-OSS's
   ``gate_up_proj_bias`` stack), whatever the rank; a Linear inside a module called ``lm_head``,
   ``classifier`` or ``score`` (the heads of Hugging Face's task models) is the ``output``.

A model that carries Megatron's ``is_embedding_or_output_parameter`` tags is taken at its word
about embeddings and the output layer, as Megatron-Core does: steps 2 and 3 then add neither
``embedding`` nor ``output``, so an untagged learned position embedding stays a ``matrix`` (the
role inference would have given is kept in :attr:`ParamRoles.ignored`, for the linter).

Everything here reads module types, attributes and shapes only: it works on the meta device,
across model chunks, through FSDP2's wrapping, and never changes the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._common import ROLES, Role

__all__ = ["ROLE_ATTRIBUTE", "ParamRoles", "infer_roles", "param_roles"]

ROLE_ATTRIBUTE = "optzoo_role"
"""The parameter attribute that states roles explicitly: a role name or a tuple of them."""

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase, nn.RMSNorm,
)  # fmt: skip
_CONV_TYPES: tuple[type[nn.Module], ...] = (nn.modules.conv._ConvNd,)
_EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (nn.Embedding, nn.EmbeddingBag)
_HEAD_NAMES = frozenset({"lm_head", "classifier", "score"})
"""Module names that hold a model's head in Hugging Face's task models (``*ForCausalLM``,
``*ForImageClassification``, ``*ForSequenceClassification``)."""


@dataclass(frozen=True)
class ParamRoles:
    """The roles of one parameter, each with where it came from.

    Example:
        >>> roles = ParamRoles(("embedding", "output"), ("nn.Embedding", "nn.Linear sharing an embedding's weight"))
        >>> "output" in roles, roles.describe()
        (True, "embedding (nn.Embedding); output (nn.Linear sharing an embedding's weight)")
    """

    roles: tuple[Role, ...]
    sources: tuple[str, ...]
    """Parallel to ``roles``: the tag, API, module type, name or shape each came from."""
    ignored: tuple[tuple[Role, str], ...] = ()
    """Roles inference found but did not give: ``(role, why)``, e.g. an untagged embedding in a
    model whose Megatron tags decide embeddings."""

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.roles)

    def __contains__(self, role: object) -> bool:
        return role in self.roles

    def source(self, role: Role) -> str:
        """Where ``role`` came from (``KeyError`` if the parameter does not have it)."""
        return self.sources[self.roles.index(role)]

    def describe(self) -> str:
        """``role (source); role (source)``, then ``not role (why)`` for each ignored one, as ``--explain`` prints it."""
        given = [f"{role} ({source})" for role, source in zip(self.roles, self.sources)]
        return "; ".join(given + [f"not {role} ({why})" for role, why in self.ignored])


class _Found:
    """Roles gathered for one tensor, in the order of their sources."""

    def __init__(self) -> None:
        self.roles: list[Role] = []
        self.sources: list[str] = []
        self.ignored: list[tuple[Role, str]] = []

    def add(self, role: Role, source: str) -> None:
        if role not in self.roles:
            self.roles.append(role)
            self.sources.append(source)

    def freeze(self, param: torch.Tensor) -> ParamRoles:
        if not self.roles:
            self.add("matrix" if param.dim() >= 2 else "vector", f"{param.dim()}-D")
        return ParamRoles(tuple(self.roles), tuple(self.sources), tuple(self.ignored))


def _explicit(param: torch.Tensor, name: str) -> ParamRoles | None:
    """The roles a user stated with :data:`ROLE_ATTRIBUTE`, or ``None``."""
    value = getattr(param, ROLE_ATTRIBUTE, None)
    if value is None:
        return None
    stated = (value,) if isinstance(value, str) else value
    if not isinstance(stated, tuple) or not stated or not all(r in ROLES for r in stated):
        raise ValueError(
            f"`{name}`: attribute {ROLE_ATTRIBUTE} names no known role; got {value!r}; "
            f"expected a role or a tuple of roles from {list(ROLES)}"
        )
    roles: tuple[Role, ...] = tuple(dict.fromkeys(stated))
    return ParamRoles(roles, tuple(f"tag {ROLE_ATTRIBUTE}" for _ in roles))


def _by_name(found: _Found, name: str) -> None:
    last = name.rsplit(".", 1)[-1]
    if last == "bias" or last.endswith("_bias"):
        found.add("bias", "name")


def param_roles(param: torch.Tensor, name: str) -> ParamRoles:
    """The roles of a parameter seen alone: explicit tags, its name and its shape (no modules).

    This is what ``ParamKey(role=...)`` matches when it is asked about a parameter outside a
    model (``key.matches(param, name)``); inside ``resolve_param_groups`` the model's roles from
    :func:`infer_roles` are used.

    Example:
        >>> param_roles(torch.zeros(4, 8), "experts.gate_up_proj_bias").describe()
        'bias (name)'
        >>> param_roles(torch.zeros(4, 8), "mlp.fc1.weight").describe()
        'matrix (2-D)'
    """
    explicit = _explicit(param, name)
    if explicit is not None:
        return explicit
    found = _Found()
    if getattr(param, "is_embedding_or_output_parameter", False):
        found.add("embedding" if "embed" in name.lower() else "output", "tag is_embedding_or_output_parameter")
    if getattr(param, "allreduce", True) is False:
        found.add("expert", "tag allreduce=False")
    _by_name(found, name)
    return found.freeze(param)


def _call(module: nn.Module, method: str) -> Any:
    """``module.method()``, or ``None`` when it is missing or raises (vision models' ``NotImplementedError``)."""
    function = getattr(module, method, None)
    if not callable(function):
        return None
    try:
        return function()
    except (NotImplementedError, AttributeError, TypeError):
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
        in_experts = in_experts or _is_experts(name, module)
        yield name, module, parent, in_experts
        children = list(module.named_children())
        for child_name, child in reversed(children):
            stack.append((f"{name}.{child_name}" if name else child_name, child, module, in_experts))


def infer_roles(model_chunks: Sequence[nn.Module] | nn.Module) -> dict[int, ParamRoles]:
    """The roles of every parameter of ``model_chunks``, keyed by ``id(param)``.

    Args:
        model_chunks: A module or a list of modules (several chunks, or the same tensor under
            several names, give one entry per tensor).

    Raises:
        ValueError: A parameter's ``optzoo_role`` attribute names no known role.

    Example:
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 10))
        >>> model[2].weight = model[0].weight  # tied head
        >>> roles = infer_roles(model)
        >>> [(name, roles[id(p)].describe()) for name, p in model.named_parameters()]
        [('0.weight', "embedding (nn.Embedding); output (nn.Linear sharing an embedding's weight)"), ('1.weight', 'norm (LayerNorm)'), ('1.bias', 'norm (LayerNorm); bias (name)'), ('2.bias', 'bias (name)')]
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    params: dict[int, tuple[torch.Tensor, str]] = {}
    for chunk in chunks:
        for param_name, param in chunk.named_parameters(remove_duplicate=False):
            params.setdefault(id(param), (param, param_name))
    tagged = any(getattr(param, "is_embedding_or_output_parameter", False) for param, _ in params.values())
    found = {key: _Found() for key in params}

    # 1. explicit Megatron tags (the user's role attribute replaces everything, below)
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

    # 2. the model's API
    embeddings: set[int] = set()
    api: tuple[tuple[str, Role], ...] = (("get_input_embeddings", "embedding"), ("get_output_embeddings", "output"))
    for chunk in chunks:
        for method, role in api:
            weight = getattr(_call(chunk, method), "weight", None)
            if isinstance(weight, torch.Tensor) and id(weight) in found:
                if tagged:
                    found[id(weight)].ignored.append((role, f"{method}(), untagged in a Megatron-tagged model"))
                else:
                    found[id(weight)].add(role, f"{method}()")
                    if role == "embedding":
                        embeddings.add(id(weight))

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
                    entry.add("expert", kind if _is_experts(module_name, module) else f"{kind} inside an experts module")
    if not tagged:
        linears = [(name, module) for chunk in chunks for name, module in chunk.named_modules() if isinstance(module, nn.Linear)]
        for _, module in linears:
            if id(module.weight) in embeddings:
                found[id(module.weight)].add("output", "nn.Linear sharing an embedding's weight")
        for name, module in linears:  # 4. names: a task model's head
            head = _HEAD_NAMES.intersection(name.split("."))
            if head and id(module.weight) in found:
                found[id(module.weight)].add("output", f"name ({sorted(head)[0]})")

    # 4. names; then the user's explicit roles replace all of the above
    roles: dict[int, ParamRoles] = {}
    for key, (tensor, tensor_name) in params.items():
        explicit = _explicit(tensor, tensor_name)
        if explicit is not None:
            roles[key] = explicit
            continue
        _by_name(found[key], tensor_name)
        roles[key] = found[key].freeze(tensor)
    return roles
