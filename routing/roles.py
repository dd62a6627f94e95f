"""Parameter roles: what each parameter of a model is, read from what its forward does with it.

A role is one of :data:`optzoo._common.ROLES`, defined by use (docs/roles.md):

* ``embedding``: an input table: read by index, or its values put into the activations (added
  along two or more dims, concatenated, substituted, or the data operand of a parametric matmul);
* ``output``: a head: the weight of a matmul whose product is a model output, with no parametric
  matmul after it;
* ``matrix``: a hidden matrix: the weight of a matmul contracted against activations, its product
  fed on; with ``input`` when that matmul takes the raw model input, ``router`` when its product
  goes into a top-k, ``conv`` for a convolution, ``expert`` when the data chooses its blocks;
* ``bias``: added to activations (varying along at most one dim); ``elementwise``: any other
  elementwise use (gains and scales of any shape, SSM parameters, weight norm's ``g``); ``norm``:
  the weight or bias of a normalisation; ``vector``: a depthwise conv filter (and the fallback for
  0-D and 1-D tensors).

How the forward multiplies by a parameter (its blocks: experts, heads, groups, and which dim is
its input) is its :attr:`ParamRoles.view`. Sources, in order:

1. explicit tags: ``param.optzoo_role`` (a role or a tuple of roles) replaces everything else;
   Megatron's ``is_embedding_or_output_parameter`` and ``allreduce=False`` add their roles;
2. the forward, observed once on meta stand-ins (:mod:`optzoo.routing.dataflow`) with
   ``example_inputs`` or inputs made from the model (:mod:`optzoo.routing.inputs`);
3. module types, the model's API and names (:mod:`optzoo.routing._guess`): for parameters the
   forward did not use, or every parameter when it could not run; those roles are ``guessed``
   (and a warning says how to pass an input). Where the forward ran, they only add roles its use
   allows (``norm`` to a gain, ``expert`` to a parameter of an experts module) and the others are
   kept as :attr:`ParamRoles.ignored`.

Nothing here changes the model: it works on the meta device, across chunks, through FSDP2, DDP,
``torch.compile`` and PEFT wrappers.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._common import ROLES, MatrixView, Role
from ._guess import Found, by_name, guess_roles
from .dataflow import ParamUse
from .inputs import ExampleInputs, has_forward, trace_uses

__all__ = ["ROLE_ATTRIBUTE", "GuessedRolesWarning", "ParamRoles", "infer_roles", "param_roles"]

ROLE_ATTRIBUTE = "optzoo_role"
"""The parameter attribute that states roles explicitly: a role name or a tuple of them."""


class GuessedRolesWarning(UserWarning):
    """A model's forward could not be observed: its roles are guessed from module types and names."""


@dataclass(frozen=True)
class ParamRoles:
    """The roles of one parameter, each with where it came from, and how the forward multiplies by it.

    Example:
        >>> roles = ParamRoles(("embedding", "output"), ("forward: read by index (embedding)", "forward: a head (mm)"))
        >>> "output" in roles, roles.describe()
        (True, 'embedding (forward: read by index (embedding)); output (forward: a head (mm))')
        >>> ParamRoles(("matrix",), ("2-D",), guessed=True).describe()
        'matrix (2-D, guessed)'
    """

    roles: tuple[Role, ...]
    sources: tuple[str, ...]
    """Parallel to ``roles``: the tag, use, API, module type, name or shape each came from."""
    ignored: tuple[tuple[Role, str], ...] = ()
    """Roles a fallback source suggested but the forward's use (or Megatron's tags) overruled: ``(role, why)``."""
    view: MatrixView | None = None
    """How the forward multiplies by it (blocks and orientation), when it is a matmul's weight."""
    guessed: bool = False
    """No forward use backs these roles: module types, names and shapes gave them."""

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
        mark = ", guessed" if self.guessed else ""
        given = [f"{role} ({source}{mark})" for role, source in zip(self.roles, self.sources)]
        return "; ".join(given + [f"not {role} ({why})" for role, why in self.ignored])


def _explicit(param: torch.Tensor, name: str) -> tuple[Role, ...] | None:
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
    return tuple(dict.fromkeys(stated))


def param_roles(param: torch.Tensor, name: str) -> ParamRoles:
    """The roles of a parameter seen alone: explicit tags, its name and its shape (no modules, no forward).

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
        return ParamRoles(explicit, tuple(f"tag {ROLE_ATTRIBUTE}" for _ in explicit))
    found = Found()
    if getattr(param, "is_embedding_or_output_parameter", False):
        found.add("embedding" if "embed" in name.lower() else "output", "tag is_embedding_or_output_parameter")
    if getattr(param, "allreduce", True) is False:
        found.add("expert", "tag allreduce=False")
    by_name(found, name)
    found.add_shape_default(param)
    return ParamRoles(tuple(found.roles), tuple(found.sources), tuple(found.ignored))


def _ops(names: set[str]) -> str:
    return ", ".join(sorted(names))


def _from_use(param: torch.Tensor, use: ParamUse) -> tuple[Found, MatrixView | None]:
    """The roles one forward's use gives (module docstring), and the parameter's matrix view."""
    found = Found()
    view: MatrixView | None = None
    if use.weight_ops:
        depthwise = bool(use.conv_groups) and use.conv_in_per_group == {1} and max(use.conv_groups) > 1
        if use.head:
            found.add("output", f"forward: {_ops(use.weight_ops)} weight, its product an output")
        elif not depthwise:
            found.add("matrix", f"forward: {_ops(use.weight_ops)} weight")
        if use.conv_groups:
            found.add("conv", f"forward: convolution, groups {_ops({str(g) for g in use.conv_groups})}")
        if depthwise:
            found.add("vector", "forward: depthwise convolution")
        if use.router:
            found.add("router", "forward: its product into a top-k")
        if use.input_layer:
            found.add("input", "forward: on the raw model input")
        view = use.view
    if use.blocks_by_data:
        found.add("expert", "forward: blocks chosen by the data")
    if use.lookups:
        found.add("embedding", f"forward: read by index ({_ops(use.lookups)})")
    if use.tables:
        found.add("embedding", f"forward: put into the activations ({_ops(use.tables)})")
    if use.biases:
        found.add("bias", f"forward: added to activations ({_ops(use.biases)})")
    if use.normalizes:
        found.add("norm", "forward: a normalisation's weight or bias")
    if use.gains or use.weight_gains or use.returned:
        how = (
            [_ops(use.gains)] * bool(use.gains)
            + [f"scales a weight ({_ops(use.weight_gains)})"] * bool(use.weight_gains)
            + ["returned"] * use.returned
        )  # fmt: skip
        found.add("elementwise", "forward: " + "; ".join(how))
    return found, view


_FALLBACK_NEEDS: dict[str, frozenset[str]] = {
    "norm": frozenset({"elementwise", "bias", "norm"}),
    "bias": frozenset({"elementwise", "bias", "embedding"}),
    "router": frozenset({"matrix", "bias", "router"}),
    "conv": frozenset({"conv"}),
    "vector": frozenset({"vector"}),
    "embedding": frozenset({"embedding"}),
    "output": frozenset({"output"}),
}
"""The roles a fallback role needs the forward to have given, to be kept beside them."""


def _add_fallback(found: Found, guessed: Found) -> None:
    """Keep the fallback's roles that the forward's use allows; set the others aside, saying why."""
    traced = set(found.roles)
    described = ", ".join(found.roles)
    for role, source in zip(guessed.roles, guessed.sources):
        if role == "expert" or source.startswith("tag "):
            found.add(role, source)  # where it lives (an experts module) or what a tag says
        elif role in ("matrix", "vector") and source.endswith("-D"):
            continue
        elif traced & _FALLBACK_NEEDS.get(role, frozenset()):
            found.add(role, source)
        elif role not in traced:
            found.ignored.append((role, f"{source}; the forward uses it as {described}"))


def _example_for(example_inputs: ExampleInputs | Sequence[ExampleInputs | None] | None, index: int, chunks: int) -> ExampleInputs | None:
    if example_inputs is None or chunks == 1:
        return example_inputs
    if not isinstance(example_inputs, (list, tuple)) or len(example_inputs) != chunks:
        raise ValueError(
            f"`example_inputs`: with {chunks} model chunks, give one entry per chunk (None to make one); "
            f"got {type(example_inputs).__name__}"
            f"{f' of {len(example_inputs)}' if isinstance(example_inputs, (list, tuple)) else ''}; expected a list of {chunks}"
        )
    return example_inputs[index]  # type: ignore[no-any-return]


def infer_roles(
    model_chunks: Sequence[nn.Module] | nn.Module,
    *,
    example_inputs: ExampleInputs | Sequence[ExampleInputs | None] | None = None,
    trace: bool = True,
) -> dict[int, ParamRoles]:
    """The roles of every parameter of ``model_chunks``, keyed by ``id(param)``.

    Args:
        model_chunks: A module or a list of modules (several chunks, or the same tensor under
            several names, give one entry per tensor).
        example_inputs: The inputs of one forward: a tensor, a tuple or list of positional
            inputs, or a dict of keyword inputs (only shapes and dtypes matter); with several
            chunks, a list with one per chunk (``None`` entries are made). Default: made from
            the model (:mod:`optzoo.routing.inputs`).
        trace: Observe the forward (default). ``False`` guesses every role from module types
            and names, as when the forward cannot run.

    Raises:
        ValueError: A parameter's ``optzoo_role`` attribute names no known role, or
            ``example_inputs`` does not give one entry per chunk.
        TypeError: An ``example_inputs`` entry is not a tensor, a sequence or a mapping.

    Warns:
        GuessedRolesWarning: A chunk's forward could not be observed (why, and how to pass an input).

    Example:
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 10))
        >>> model[2].weight = model[0].weight  # tied head
        >>> roles = infer_roles(model)
        >>> [(name, ", ".join(roles[id(p)].roles)) for name, p in model.named_parameters()]
        [('0.weight', 'output, embedding'), ('1.weight', 'norm, elementwise'), ('1.bias', 'norm, elementwise, bias'), ('2.bias', 'bias')]
    """
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    params: dict[int, tuple[torch.Tensor, str]] = {}
    for chunk in chunks:
        for param_name, param in chunk.named_parameters(remove_duplicate=False):
            params.setdefault(id(param), (param, param_name))
    guessed = guess_roles(chunks, params)
    observed: dict[int, ParamUse] = {}
    if trace:
        for index, chunk in enumerate(chunks):
            example = _example_for(example_inputs, index, len(chunks))
            uses, how = trace_uses(chunk, example)
            if uses is None:
                if has_forward(chunk):  # a container of params has none to observe: nothing to say
                    _warn_guessed(chunk, how, index if len(chunks) > 1 else None)
                continue
            for key, use in uses.items():
                if use.used and key not in observed:
                    observed[key] = use
    roles: dict[int, ParamRoles] = {}
    for key, (tensor, tensor_name) in params.items():
        explicit = _explicit(tensor, tensor_name)
        observed_use = observed.get(key)
        if observed_use is None:
            fallback = guessed[key]
            fallback.add_shape_default(tensor)
            record = ParamRoles(tuple(fallback.roles), tuple(fallback.sources), tuple(fallback.ignored), guessed=True)
        else:
            found, view = _from_use(tensor, observed_use)
            _add_fallback(found, guessed[key])
            found.add_shape_default(tensor)
            record = ParamRoles(tuple(found.roles), tuple(found.sources), tuple(found.ignored), view=view)
        if explicit is not None:
            record = ParamRoles(explicit, tuple(f"tag {ROLE_ATTRIBUTE}" for _ in explicit), view=record.view)
        roles[key] = record
    return roles


def _warn_guessed(chunk: nn.Module, why: str, index: int | None) -> None:
    where = f"model chunk #{index} ({type(chunk).__name__})" if index is not None else f"`{type(chunk).__name__}`"
    warnings.warn(
        f"{where}: roles guessed from module types and names; could not observe its forward: {why}; "
        "expected inputs for one forward: pass example_inputs= to get_optimizer or resolve_param_groups "
        "(a tensor, a tuple of inputs or a dict of keyword inputs; only shapes and dtypes matter), "
        "or --example-inputs to the optzoo command",
        GuessedRolesWarning,
        stacklevel=3,
    )
