"""The parameter map: for every trainable param, the tensors one step reads and writes.

:func:`build_param_map` makes it once, from the config, the resolved groups and (under the
distributed optimizers) the parts this rank owns. One :class:`ParamEntry` per parameter gives its
names, the model tensor, the *main* tensor the inner optimizer steps (the model param itself, a
flat view of a range of it, an fp32 copy, or a dense working copy of a param whose memory has
gaps), whether that main tensor shares the model's storage, and where its gradient goes. The wrapper's gradient stages, the distributed optimizer
and the state dict all walk this map, so nothing is guessed from storage pointers later.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from optzoo._common import dense_layout
from optzoo.config import OptimizerConfig
from optzoo.groups import ResolvedGroup

__all__ = [
    "canonical_name",
    "GradSource",
    "GradTarget",
    "ParamEntry",
    "ParamMap",
    "Part",
    "build_param_map",
    "check_param_dtypes",
    "follow_repointed_params",
    "part_of",
]

Part = tuple[int, int] | None
"""The flat element range ``[start, stop)`` of a model param that a main param stands for
(``None``: all of it). Ranges appear only under the sharded optimizer (:mod:`optzoo.distributed`)."""

GradSource = Literal["grad", "main_grad"]
"""Where model gradients are read: ``param.grad``, or a DDP-style ``param.main_grad`` buffer."""

GradTarget = Literal["shared", "fp32_copy", "decoupled"]
"""Where a gradient goes for the inner optimizer: ``shared``, ``main.grad`` is the model's fp32
gradient tensor itself (copied only where it is laid out otherwise than main); ``fp32_copy``,
``main.grad`` is an fp32 copy of a 16-bit gradient; ``decoupled``, ``main.decoupled_grad`` holds a
copy in :attr:`ParamMap.decoupled_grad_dtype`, where the precision-aware Adam reads it."""

LOW_PRECISION: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


WRAPPER_ATTRIBUTES = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
"""Name components that wrappers add and torch's DCP leaves out of canonical names: torch.compile's
``OptimizedModule``, FSDP1's wrapped module, activation checkpointing's wrapper (and ``module``
of ``DistributedDataParallel``/``DataParallel``, see :func:`canonical_name`)."""


def canonical_name(name: str, root: torch.nn.Module | None = None) -> str:
    """``name`` without the components wrappers add, as torch's DCP names params (its ``_get_fqns``).

    With ``root`` (the module ``name`` is relative to), ``module`` is dropped where its parent only
    wraps it: torch's ``DistributedDataParallel`` and ``DataParallel``, and wrappers built the same
    way (Megatron-Core's DDP and ``Float16Module``: one child called ``module``, no params of their
    own); without, a leading ``module.`` is (a checkpoint key, whose model is not at hand).

    Example:
        >>> canonical_name("_orig_mod.module.layers.0._checkpoint_wrapped_module.w")
        'layers.0.w'
    """
    kept: list[str] = []
    module: object = root
    for index, part in enumerate(name.split(".")):
        if part in WRAPPER_ATTRIBUTES:
            pass
        elif part == "module" and (_wraps_one_module(module) if root is not None else not kept):
            pass
        else:
            kept.append(part)
        module = getattr(module, part, None) if isinstance(module, torch.nn.Module) and index < name.count(".") else None
    return ".".join(kept)


def _wraps_one_module(module: object) -> bool:
    """Whether ``module`` only wraps its child ``module`` (as DDP does), so the name says nothing."""
    if isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return True
    return (
        isinstance(module, torch.nn.Module)
        and list(module._modules) == ["module"]
        and not module._parameters
    )


def part_of(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """``tensor`` itself, or the flat view of its elements ``part``."""
    return tensor if part is None else tensor.view(-1)[part[0] : part[1]]


@dataclass(frozen=True, eq=False)
class ParamEntry:
    """One trainable parameter, as this process steps it."""

    name: str
    """Its unique (first) name, chunk-qualified when there are several model chunks, without the
    components wrappers add (``_orig_mod.``, DDP's ``module.``: :func:`canonical_name`), so a
    checkpoint saved under torch.compile or DDP loads into the bare model and back."""
    names: tuple[str, ...]
    """Every name it has (a tied weight has several), canonical as ``name``; ``names[0] == name``."""
    group: int
    """Index of its resolved group (the same index in ``param_groups``)."""
    model: torch.Tensor
    """The whole model parameter."""
    main: torch.Tensor | None
    """What the inner optimizer steps; ``None`` when another rank owns the whole param."""
    part: Part
    """The elements of ``model`` that ``main`` stands for."""
    aliased: bool
    """``main`` shares the model's storage: nothing to copy back after a step."""
    grad_target: GradTarget
    """Where its gradient goes (see :data:`GradTarget`)."""
    working: bool = False
    """``main`` is a dense working copy of a param whose memory has gaps (a view such as
    ``x[..., 0]``; kernels that walk memory, torch's fused ones, cannot step it in place): it is
    refreshed from the model before every step and copied back after, so the model stays the
    truth, and checkpoints leave it out."""

    @property
    def master(self) -> bool:
        """``main`` holds values the model cannot restore: an fp32 copy of a 16-bit param."""
        return not self.aliased and not self.working

    @property
    def local(self) -> bool:
        """Whether this process steps (a part of) this param."""
        return self.main is not None

    @property
    def model_part(self) -> torch.Tensor:
        """The elements of the model param that ``main`` stands for."""
        return part_of(self.model, self.part)


@dataclass(frozen=True, eq=False)
class ParamMap:
    """Every trainable param in group order, with how this process steps it."""

    entries: tuple[ParamEntry, ...]
    """Every param, group by group, in routing order; owned by this rank or not."""
    num_groups: int
    grad_source: GradSource = "grad"
    decoupled_grad_dtype: torch.dtype | None = None
    """Dtype of ``main.decoupled_grad`` for the ``decoupled`` target (precision-aware Adam)."""
    holders: tuple[tuple[dict[str, Any], str] | None, ...] = ()
    """Per entry (when built from modules): its module's ``_parameters`` and its key there, where
    the model keeps the param; a cast that makes new Parameter objects is seen there."""

    def __post_init__(self) -> None:
        self.built_for  # noqa: B018 - recorded now, while the model is as the map is built for

    @functools.cached_property
    def local(self) -> tuple[ParamEntry, ...]:
        """The entries this process steps, in group order."""
        return tuple(entry for entry in self.entries if entry.local)

    @functools.cached_property
    def working_local(self) -> tuple[ParamEntry, ...]:
        """The local entries whose main is a working copy (see :attr:`ParamEntry.working`)."""
        return tuple(entry for entry in self.local if entry.working)

    @functools.cached_property
    def plain_local(self) -> tuple[bool, ...]:
        """For each local entry: is it the simplest case, the model param stepped whole in place
        with ``.grad`` as its gradient (fp32 models)? The step keeps that case cheap."""
        return tuple(
            self.grad_source == "grad" and e.main is e.model and e.part is None and e.grad_target == "shared" for e in self.local
        )

    @functools.cached_property
    def plain_models(self) -> tuple[torch.Tensor, ...] | None:
        """The local model params when every local entry is plain (see :attr:`plain_local`), else
        None: the step then collects gradients in one tight loop."""
        return tuple(e.model for e in self.local) if all(self.plain_local) else None

    @functools.cached_property
    def _by_name(self) -> dict[str, ParamEntry]:
        return {name: entry for entry in self.entries for name in entry.names}

    @functools.cached_property
    def built_for(self) -> list[tuple[torch.dtype, torch.device, torch.Size]]:
        """Each entry's model param as the map was built for it: dtype, device, shape."""
        return [(e.model.dtype, e.model.device, e.model.shape) for e in self.entries]

    def check_model_unchanged(self) -> None:
        """Refuse a model cast or moved after the map was built (``model.to(torch.bfloat16)``,
        ``.double()``, ``.to(device)``, ``param.data = ...`` of another dtype or shape): the main
        params, fp32 copies and optimizer state were made for the old dtype, device and shape, so
        stepping would fail inside torch midway or step stale copies. One comparison per param.

        Raises:
            ValueError: Naming the first param that changed, what it was and what it is.
        """
        now = [(e.model.dtype, e.model.device, e.model.shape) for e in self.entries]
        holders = self.holders
        replaced = [e for e, h in zip(self.entries, holders) if h is not None and h[0].get(h[1]) is not e.model]
        if now == self.built_for and not replaced:
            return
        if replaced:
            entry, holder = replaced[0], holders[self.entries.index(replaced[0])]
            assert holder is not None
            new = holder[0].get(holder[1])
            found = _layout((new.dtype, new.device, new.shape)) if isinstance(new, torch.Tensor) else type(new).__name__
            more = f" (and {len(replaced) - 1} more params)" if len(replaced) > 1 else ""
            raise ValueError(
                f"`{entry.name}`: the model param was replaced by a new object after get_optimizer{more} (as "
                f".to('meta'), to_empty() or assigning the attribute do); got {found}; expected the param the optimizer "
                "was built for: call get_optimizer again with the model as it is now"
            )
        changed = [(e, was, got) for e, was, got in zip(self.entries, self.built_for, now) if was != got]
        entry, was, got = changed[0]
        more = f" (and {len(changed) - 1} more params)" if len(changed) > 1 else ""
        raise ValueError(
            f"`{entry.name}`: the model param changed after get_optimizer{more}; got {_layout(got)}; expected "
            f"{_layout(was)}, as the optimizer was built for: cast or move the model before get_optimizer "
            "and call get_optimizer again (the optimizer state keeps the old dtype and device)"
        )

    def entry(self, name: str) -> ParamEntry | None:
        """The entry called ``name`` (any of its tied names, with or without wrapper prefixes such
        as ``_orig_mod.`` or ``module.``: see :func:`canonical_name`), or ``None``."""
        found = self._by_name.get(name)
        return found if found is not None else self._by_name.get(canonical_name(name))

    def group_names(self) -> list[list[str]]:
        """Every group's param names (first names), owned here or not."""
        names: list[list[str]] = [[] for _ in range(self.num_groups)]
        for entry in self.entries:
            names[entry.group].append(entry.name)
        return names

    def local_by_group(self) -> list[list[ParamEntry]]:
        """The local entries, one list per group (empty where this rank owns none of a group)."""
        grouped: list[list[ParamEntry]] = [[] for _ in range(self.num_groups)]
        for entry in self.local:
            grouped[entry.group].append(entry)
        return grouped

    def aliases(self) -> dict[str, tuple[str, ...]]:
        """``{name: every name}`` for the params that have more than one name (tied weights)."""
        return {entry.name: entry.names for entry in self.entries if len(entry.names) > 1}


def follow_repointed_params(
    param_map: ParamMap, param_groups: Sequence[Mapping[str, Any]], state: Mapping[torch.Tensor, Any]
) -> ParamMap | None:
    """The map for the params a framework re-pointed the optimizer at, by name; ``None`` if none was.

    accelerate's FSDP2 ``prepare(model, optimizer)`` shards the model (``fully_shard`` registers a
    new DTensor param under each name) and then writes into ``param_groups[i]["params"]`` the new
    param of the same name (``fsdp2_switch_optimizer_parameters``). The inner optimizers would then
    step the new params directly, while the map still points at the old ones: no gradient would
    be seen, so no clip, no norm and no inf/NaN skip. The re-pointing is followed when every
    re-pointed slot holds the param its module now holds under that entry's name, the old one was
    stepped in place (no fp32 copy, no working copy, not sharded by this optimizer), its shape is
    unchanged and it has no state yet; the new param keeps the old one's attributes.

    Raises:
        ValueError: Slots were re-pointed in a way that cannot be followed (the message says why,
            and what to do instead); nothing changes.
    """
    holders = param_map.holders
    moved: dict[int, torch.Tensor] = {}
    index = {id(entry): i for i, entry in enumerate(param_map.entries)}
    for group, entries in zip(param_groups, param_map.local_by_group(), strict=True):
        params = group["params"]
        if len(params) != len(entries):
            return None
        for entry, now in zip(entries, params):
            if now is not entry.main:
                moved[index[id(entry)]] = now
    if not moved:
        return None

    def refuse(name: str, problem: str) -> ValueError:
        return ValueError(
            f"`{name}`: the optimizer's param_groups were re-pointed at new tensors (as accelerate's FSDP2 prepare "
            f"does); got {problem}; expected each slot re-pointed at the model's new param of that name, before any "
            "step, for a param stepped in place: call accelerator.prepare(model, optimizer) before training, with "
            "OptimizerConfig(bf16=False) and accelerate's mixed_precision (or, without accelerate, build the "
            "optimizer after fully_shard)"
        )

    for i, now in moved.items():
        entry = param_map.entries[i]
        holder = holders[i] if holders else None
        held = holder[0].get(holder[1]) if holder is not None else None
        if held is None or id(held) != id(now):
            raise refuse(entry.name, "a tensor the model does not hold under that name")
        if not entry.aliased or entry.working or entry.part is not None:
            raise refuse(entry.name, "a param the optimizer steps through a copy (bf16/fp16 fp32 main params, a working copy or a shard)")
        if tuple(now.shape) != tuple(entry.model.shape):
            raise refuse(entry.name, f"shape {tuple(now.shape)} instead of {tuple(entry.model.shape)}")
        if entry.main is not None and state.get(entry.main):
            raise refuse(entry.name, "optimizer state for the old param (a step was taken before)")
    entries = list(param_map.entries)
    for i, now in moved.items():
        old = entries[i].model
        for key, value in old.__dict__.items():  # routing attributes FSDP2 drops (qkv_split_shapes, tags)
            now.__dict__.setdefault(key, value)
        entries[i] = dataclasses.replace(entries[i], model=now, main=now)
    return dataclasses.replace(param_map, entries=tuple(entries))


def _layout(layout: tuple[torch.dtype, torch.device, torch.Size]) -> str:
    dtype, device, shape = layout
    return f"{dtype} on {device}, shape {tuple(shape)}"


def check_param_dtypes(config: OptimizerConfig, groups: Sequence[ResolvedGroup]) -> None:
    """Parameter dtypes must fit ``fp16``/``bf16`` (and bf16 remainders need bf16 params)."""
    expected = torch.float16 if config.fp16 else torch.bfloat16 if config.bf16 else None
    for group in groups:
        for routed, name in zip(group.params, group.param_names):
            dtype = routed.param.dtype
            if expected is not None and dtype not in (expected, torch.float32):  # float64 too: the docs allow fp32 only
                raise ValueError(
                    f"`{name}`: parameter dtype does not match the config; got {dtype} with "
                    f"{'fp16' if config.fp16 else 'bf16'}=True; expected {expected} or torch.float32"
                )
            if config.store_param_remainders and config.use_precision_aware_optimizer and dtype != torch.bfloat16:
                raise ValueError(
                    f"`{name}`: store_param_remainders needs bf16 parameters; got {dtype}; "
                    "expected torch.bfloat16 (or store_param_remainders=False)"
                )


def build_param_map(
    config: OptimizerConfig,
    groups: Sequence[ResolvedGroup],
    *,
    owned: Mapping[tuple[int, int], Part] | None = None,
    params_have_main_grad: bool = False,
    model_chunks: Sequence[torch.nn.Module] | None = None,
) -> ParamMap:
    """Decide, once, what each param's main tensor is and where its gradient goes.

    The main tensor is an fp32 copy of an fp16/bf16 param under ``fp16``/``bf16``; otherwise,
    and under the precision-aware optimizer (which keeps its own master state), the model param
    itself, or, where the param's memory has gaps, a dense working copy of it (the inner
    optimizers' kernels may walk memory, and the fp32 copies are dense already). A param sharded
    by elements is stood for by a flat view of its range (sharing the model's storage), or by an
    fp32 copy of that range.

    Args:
        config: The model-wide config: ``fp16``, ``bf16``, ``use_precision_aware_optimizer`` and
            ``main_grads_dtype`` are read.
        groups: The resolved groups, in routing order.
        owned: The params this rank steps, by ``(group index, position in group)``, each with
            its element range (``None``: whole). Default: every param, whole (one process).
        params_have_main_grad: Gradients live in ``param.main_grad`` instead of ``param.grad``.
        model_chunks: The modules ``groups`` were routed from; each param's place in them is kept,
            so :meth:`ParamMap.check_model_unchanged` sees a param replaced by a new object.

    Raises:
        ValueError: A param's elements share memory (an expanded tensor), or a param sharded by
            elements is not contiguous.

    Example:
        >>> layer = torch.nn.Linear(2, 2).to(torch.bfloat16)
        >>> from optzoo.groups import resolve_group_configs
        >>> config = OptimizerConfig(lr=1.0, bf16=True)
        >>> groups, _ = resolve_group_configs(config, [layer], {})
        >>> [(e.name, e.main.dtype, e.aliased, e.grad_target) for e in build_param_map(config, groups).entries]
        [('weight', torch.float32, False, 'fp32_copy'), ('bias', torch.float32, False, 'fp32_copy')]
        >>> layer = torch.nn.Linear(2, 3, bias=False)
        >>> layer.weight = torch.nn.Parameter(torch.zeros(3, 2, 2)[..., 0])  # every other element
        >>> groups, _ = resolve_group_configs(OptimizerConfig(lr=1.0), [layer], {})
        >>> entry = build_param_map(OptimizerConfig(lr=1.0), groups).entries[0]
        >>> entry.working, entry.aliased, entry.main.stride(), entry.model.stride()
        (True, False, (2, 1), (4, 2))
    """
    precision_aware = config.use_precision_aware_optimizer
    copy_16bit = (config.fp16 or config.bf16) and not precision_aware
    entries: list[ParamEntry] = []
    holders: list[tuple[dict[str, Any], str] | None] = []
    for group in groups:
        for position, (routed, names) in enumerate(zip(group.params, group.all_names)):
            param = routed.param
            local = owned is None or (group.index, position) in owned
            part = None if owned is None else owned.get((group.index, position))
            _check_no_overlap(param, names[0])
            copied = copy_16bit and param.dtype in LOW_PRECISION
            working = part is None and not copied and not isinstance(param, DTensor) and not dense_layout(param)
            main = _main_tensor(param, part, copied, working, names[0]) if local else None
            target: GradTarget = "decoupled" if precision_aware else "fp32_copy" if copied else "shared"
            if model_chunks is not None:  # chunk-local names, each under its chunk's prefix (chunkN.)
                names = tuple(dict.fromkeys(
                    n[: len(n) - len(raw)] + canonical_name(raw, model_chunks[chunk])
                    for n, raw, chunk in zip(names, routed.names, routed.chunks)
                ))  # fmt: skip
            else:
                names = tuple(dict.fromkeys(canonical_name(n) for n in names))
            entries.append(ParamEntry(names[0], names, group.index, param, main, part, not (copied or working), target, working))
            holders.append(_holder(model_chunks, routed.chunks[0], routed.names[0]) if model_chunks is not None else None)
    return ParamMap(
        entries=tuple(entries),
        num_groups=len(groups),
        grad_source="main_grad" if params_have_main_grad else "grad",
        decoupled_grad_dtype=config.main_grads_dtype if precision_aware else None,
        holders=tuple(holders) if model_chunks is not None else (),
    )


def _holder(chunks: Sequence[torch.nn.Module], chunk: int, name: str) -> tuple[dict[str, Any], str]:
    """The ``_parameters`` dict of the module that holds param ``name`` of ``chunks[chunk]``, and its key."""
    prefix, _, leaf = name.rpartition(".")
    module = chunks[chunk].get_submodule(prefix) if prefix else chunks[chunk]
    return module._parameters, leaf


def _check_no_overlap(param: torch.Tensor, name: str) -> None:
    """Refuse a param whose elements share memory: no update can give them different values."""
    if param.is_contiguous():  # the common case, told without stride()
        return
    if any(stride == 0 and size > 1 for size, stride in zip(param.shape, param.stride())):
        raise ValueError(
            f"`{name}`: elements share memory (a broadcast view, as from expand); got strides "
            f"{param.stride()} for shape {tuple(param.shape)}; expected a parameter that owns each "
            "element: make it with .clone() or .contiguous()"
        )


def _main_tensor(param: torch.Tensor, part: Part, copied: bool, working: bool, name: str) -> torch.Tensor:
    if part is not None and not param.is_contiguous():
        raise ValueError(
            f"`{name}`: sharding by elements needs a contiguous parameter; "
            f"got strides {param.stride()}; expected a contiguous tensor"
        )
    if part is None and not copied and not working:
        return param
    view = part_of(param.detach(), part)
    # .to() and .clone() lay a tensor with gaps out densely (torch's preserve_format), and keep
    # any dense layout (transposed, channels-last) as it is
    data = view.to(torch.float32) if copied else view.clone() if working else view
    assert dense_layout(data), "fp32 copies and working copies are dense"
    main = torch.nn.Parameter(data, requires_grad=False)
    main.__dict__.update(param.__dict__)  # keep routing attributes visible to algorithms
    return main
