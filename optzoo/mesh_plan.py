"""Muon's owner-computes plan on an FSDP2 device mesh, before launch: layouts from a mesh spec and a tensor-parallel plan.

FSDP2 (``fully_shard``) and tensor parallelism (``parallelize_module``) give every param a
placement per mesh dim. This module writes them down from names and shapes alone, the way those
two calls produce them, so :func:`~optzoo.optimizers.owner_compute.plan_owner_compute` can show
who computes what without processes (``optzoo dump-param-groups --mesh``; the benchmark builds
its DTensors from the same placements):

- **Mesh dims**, outermost first, as ``fully_shard`` and ``parallelize_module`` lay them out:
  ``replicate`` (HSDP's replicate dim), ``shard`` (FSDP's dim-0 shard dim), ``tp``.
- **Tensor parallelism**, from a torchtitan-style plan of ``glob=style`` rules (a Hugging Face
  model's own ``base_model_tp_plan``: :func:`model_tp_plan`; else :data:`DEFAULT_TP_PLAN`): the
  first rule whose glob matches the param's module (its name without the last component) or its
  own name, whole or a dot-separated tail of it, decides. ``colwise`` shards
  the output dim (``Shard(-2)`` of a weight, ``Shard(0)`` of a bias), ``rowwise`` the input dim
  (``Shard(-1)``; a bias is replicated), as torchtitan's ``ColwiseParallel``/``RowwiseParallel``
  do. A param no rule matches, or one matched by ``replicate``, is left alone by TP: ``fully_shard``
  places it on the data-parallel dims only (:func:`param_mesh`).
- **FSDP's shard dim** shards dim 0: ``Shard(0)``, or ``_StridedShard(0, split_factor=tp)`` where
  TP already shards dim 0 (FSDP2 over a column-parallel weight); **replicate** is ``Replicate()``.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from optzoo._common import MatrixView, did_you_mean
from optzoo.groups import ResolvedGroup
from optzoo.optimizers.muon_ops import compute_dtype, matrix_shape
from optzoo.optimizers.owner_compute import (
    OWNER_COMPUTES_MAX_SHARE,
    OwnerPlan,
    ShardLayout,
    TPMode,
    Unit,
    matrix_box,
    plan_owner_compute,
)
from optzoo.optimizers.registry import get_spec, newton_schulz_cost

__all__ = [
    "DEFAULT_TP_PLAN",
    "MAX_MESH_RANKS",
    "MESH_DIMS",
    "MeshPlan",
    "MeshSpec",
    "TPStyle",
    "TensorPlan",
    "format_bytes",
    "gathered_params",
    "mesh_placements",
    "model_tp_plan",
    "owner_computes_applies",
    "param_mesh",
    "param_name",
    "parse_bytes",
    "parse_mesh",
    "parse_tp_plan",
    "plan_mesh",
    "tp_style",
    "unit_label",
    "unit_mode",
]

TPStyle = Literal["colwise", "rowwise", "replicate"]
"""How tensor parallelism places a module's params: torchtitan's ``ColwiseParallel``,
``RowwiseParallel``, or not at all."""

MESH_DIMS = ("replicate", "shard", "tp")
"""Mesh dim names, outermost first (the order ``fully_shard`` and ``parallelize_module`` use)."""

_ALIASES = {"replicate": "replicate", "rep": "replicate", "dp_replicate": "replicate",
            "shard": "shard", "dp": "shard", "fsdp": "shard", "dp_shard": "shard", "tp": "tp"}  # fmt: skip

MAX_MESH_RANKS = 4096
"""The largest mesh planned (a layout holds a box per rank for every param)."""

TensorPlan = tuple[tuple[str, TPStyle], ...]
"""``(glob, style)`` rules, first match wins."""

DEFAULT_TP_PLAN: TensorPlan = (
    # Megatron-Core's GPT: QKV and MLP up column-parallel, their outputs row-parallel
    ("linear_qkv", "colwise"), ("linear_fc1", "colwise"), ("linear_proj", "rowwise"), ("linear_fc2", "rowwise"),
    # Hugging Face (Llama, Mistral, Qwen, ...; fused in Phi-3) and torchtitan's Llama
    ("q_proj", "colwise"), ("k_proj", "colwise"), ("v_proj", "colwise"), ("qkv_proj", "colwise"),
    ("gate_proj", "colwise"), ("up_proj", "colwise"), ("gate_up_proj", "colwise"),
    ("wq", "colwise"), ("wk", "colwise"), ("wv", "colwise"), ("w1", "colwise"), ("w3", "colwise"),
    ("o_proj", "rowwise"), ("down_proj", "rowwise"), ("wo", "rowwise"), ("w2", "rowwise"),
)  # fmt: skip
"""The tensor-parallel plan ``--tp-plan`` replaces: Megatron-Core's and the Hugging Face /
torchtitan Llama names, as their own TP plans place them."""


_HF_STYLES: dict[str, TPStyle] = {
    "colwise": "colwise", "packed_colwise": "colwise", "local_colwise": "colwise", "colwise_rep": "colwise",
    "rowwise": "rowwise", "packed_rowwise": "rowwise", "local_rowwise": "rowwise", "rowwise_rep": "rowwise",
}  # fmt: skip
"""Hugging Face's TP styles as the placements they give a weight; the others (``gather``,
``replicated_with_grad_allreduce``, expert and sequence-parallel styles) leave it replicated over TP."""


def model_tp_plan(chunks: Sequence[torch.nn.Module]) -> TensorPlan | None:
    """The tensor-parallel plan a model carries: a Hugging Face model's ``config.base_model_tp_plan``
    (``{glob: style}``, as its ``from_pretrained(tp_plan="auto")`` applies it), its styles mapped by
    :data:`_HF_STYLES`; ``None`` when no chunk has one.

    Example:
        >>> import transformers
        >>> model = transformers.AutoModelForCausalLM.from_config(transformers.PhiConfig(num_hidden_layers=1,
        ...     hidden_size=8, intermediate_size=16, num_attention_heads=2, vocab_size=16))
        >>> model_tp_plan([model])[-2:]
        (('layers.*.mlp.fc1', 'colwise'), ('layers.*.mlp.fc2', 'rowwise'))
    """
    for chunk in chunks:
        plan = getattr(getattr(chunk, "config", None), "base_model_tp_plan", None)
        if isinstance(plan, Mapping) and plan:
            return tuple((str(glob), _HF_STYLES.get(str(style), "replicate")) for glob, style in plan.items())
    return None


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh by dim name: ``dims`` are ``(name, size)`` pairs in :data:`MESH_DIMS` order.

    Example:
        >>> parse_mesh("2x2").dims, parse_mesh("dp=2,tp=2").shape, parse_mesh("4").world_size
        ((('replicate', 2), ('shard', 2)), (2, 2), 4)
    """

    dims: tuple[tuple[str, int], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def without(self, name: str) -> MeshSpec:
        """The mesh without dim ``name`` (where a param tensor parallelism leaves alone lives)."""
        return MeshSpec(tuple(dim for dim in self.dims if dim[0] != name))

    def size(self, name: str) -> int:
        """The size of dim ``name``; 1 when the mesh lacks it."""
        return dict(self.dims).get(name, 1)

    def describe(self) -> str:
        """``replicate=2 x shard=2 (4 ranks)``."""
        return " x ".join(f"{name}={size}" for name, size in self.dims) + f" ({self.world_size} rank{'s' * (self.world_size > 1)})"


def parse_mesh(text: str, tp: int | None = None) -> MeshSpec:
    """``--mesh``: ``N`` (FSDP over N ranks), ``RxS`` (HSDP: R replicas of an S-way shard) or
    named sizes ``replicate=R,shard=S,tp=T`` (any order; ``dp``/``fsdp`` mean ``shard``, ``rep``
    means ``replicate``); ``tp`` (``--tp``) adds a tensor-parallel dim.

    Example:
        >>> parse_mesh("2", tp=2).dims
        (('shard', 2), ('tp', 2))
    """
    expected = "N, RxS, or named sizes such as dp=2,tp=2 (names: replicate, shard (or dp, fsdp), tp)"
    sizes: dict[str, int] = {}
    text = text.strip()
    if re.fullmatch(r"\d+(x\d+)?", text):
        numbers = [int(n) for n in text.split("x")]
        sizes = dict(zip(("replicate", "shard") if len(numbers) == 2 else ("shard",), numbers))
    else:
        for entry in text.split(","):
            name, equals, value = (part.strip() for part in entry.partition("="))
            if not equals or not value.isdigit() or name.lower() not in _ALIASES:
                hint = did_you_mean(name, list(_ALIASES)) if equals else ""
                raise ValueError(f"`--mesh`: not a mesh dim; got {entry.strip()!r} in {text!r}; expected {expected}{hint}")
            canonical = _ALIASES[name.lower()]
            if canonical in sizes:
                raise ValueError(f"`--mesh`: dim {canonical!r} given twice; got {text!r}; expected each dim once")
            sizes[canonical] = int(value)
    if tp is not None:
        if "tp" in sizes:
            raise ValueError(f"`--tp`: the mesh already has a tp dim; got --tp {tp} with --mesh {text!r}; expected one of them")
        sizes["tp"] = tp
    if "shard" not in sizes:
        raise ValueError(
            f"`--mesh`: needs FSDP's shard dim (owner-computes plans FSDP2 params); got {text!r}; expected {expected}"
        )
    for name, size in sizes.items():
        if size < 1:
            flag = "`--tp`" if name == "tp" and tp is not None else "`--mesh`"
            raise ValueError(f"{flag}: dim {name!r} must have at least 1 rank; got {size}; expected an integer >= 1")
    spec = MeshSpec(tuple((name, sizes[name]) for name in MESH_DIMS if name in sizes))
    if spec.world_size > MAX_MESH_RANKS:
        raise ValueError(f"`--mesh`: too many ranks; got {spec.describe()}; expected at most {MAX_MESH_RANKS}")
    return spec


def parse_tp_plan(text: str) -> TensorPlan:
    """``--tp-plan``: comma-separated ``glob=style`` rules, first match wins (it replaces :data:`DEFAULT_TP_PLAN`).

    Example:
        >>> parse_tp_plan("attention.wq=colwise, *.mlp.*=replicate")
        (('attention.wq', 'colwise'), ('*.mlp.*', 'replicate'))
    """
    styles = get_args(TPStyle)
    rules: list[tuple[str, TPStyle]] = []
    for entry in (part.strip() for part in text.split(",")):
        glob, equals, style = (part.strip() for part in entry.partition("="))
        if not equals or not glob or style not in styles:
            raise ValueError(
                f"`--tp-plan`: not a rule; got {entry!r}; expected GLOB=STYLE with STYLE one of {list(styles)}"
                f"{did_you_mean(style, styles) if equals else ''}"
            )
        rules.append((glob, style))  # type: ignore[arg-type]  # checked against TPStyle above
    return tuple(rules)


def tp_style(name: str, plan: TensorPlan) -> tuple[TPStyle, int | None]:
    """The style of param ``name`` and the index of the rule that decided (``None``: no rule
    matched, so replicated). A glob matches the param's module path, or the param's own name (a
    Hugging Face plan may name a fused expert param), whole or a dot-separated tail of it.

    Example:
        >>> tp_style("decoder.layers.0.self_attention.linear_qkv.weight", DEFAULT_TP_PLAN)
        ('colwise', 0)
        >>> tp_style("model.layers.0.mlp.down_proj.weight", DEFAULT_TP_PLAN)[0], tp_style("lm_head.weight", DEFAULT_TP_PLAN)
        ('rowwise', ('replicate', None))
    """
    paths = (name.rpartition(".")[0], name)
    for index, (glob, style) in enumerate(plan):
        if any(fnmatch.fnmatchcase(path, glob) or fnmatch.fnmatchcase(path, "*." + glob) for path in paths):
            return style, index
    return "replicate", None


def param_mesh(style: TPStyle, mesh: MeshSpec) -> MeshSpec:
    """The mesh a param of ``style`` lives on: the whole mesh, except that a param tensor parallelism
    leaves alone is no DTensor over TP, and ``fully_shard`` places it on the data-parallel dims only
    (its Newton–Schulz is then planned in each TP rank's data-parallel group, the same plan in each)."""
    return mesh.without("tp") if style == "replicate" else mesh


def mesh_placements(shape: Sequence[int], style: TPStyle, mesh: MeshSpec) -> tuple[Placement, ...]:
    """The placements ``fully_shard`` (after ``parallelize_module`` with ``style``) gives a param
    of ``shape``, over :func:`param_mesh`'s dims.

    Example:
        >>> mesh_placements((96, 32), "colwise", parse_mesh("dp=2,tp=2"))
        (_StridedShard(dim=0, sf=2), Shard(dim=0))
        >>> mesh_placements((32, 96), "rowwise", parse_mesh("2x2", tp=2))
        (Replicate(), Shard(dim=0), Shard(dim=1))
        >>> mesh_placements((32, 32), "replicate", parse_mesh("2x2", tp=2))  # on the (replicate, shard) mesh
        (Replicate(), Shard(dim=0))
    """
    mesh = param_mesh(style, mesh)
    ndim = len(shape)
    tp: Placement = Replicate()
    if style == "colwise":
        tp = Shard(ndim - 2 if ndim >= 2 else 0)
    elif style == "rowwise" and ndim >= 2:
        tp = Shard(ndim - 1)
    strided = "tp" in dict(mesh.dims) and isinstance(tp, Shard) and tp.dim == 0
    placements: list[Placement] = []
    for name, _ in mesh.dims:
        if name == "replicate":
            placements.append(Replicate())
        elif name == "shard":
            placements.append(_StridedShard(0, split_factor=mesh.size("tp")) if strided else Shard(0))
        else:
            placements.append(tp)
    return tuple(placements)


@dataclass
class MeshPlan:
    """What every rank of a Muon-family step under FSDP2 would do for the params on ``mesh``, from
    shapes alone (``mesh`` lacks the asked mesh's TP dim for params tensor parallelism leaves alone)."""

    mesh: MeshSpec
    tp_mode: TPMode
    bucket_size: int
    fsdp_orthogonalize: str  # as asked (``auto``, ``owner``, ``redundant``)
    orthogonalize: str  # what runs: ``owner`` or ``redundant``
    plan: OwnerPlan
    one_process_flops: float
    styles: dict[str, TPStyle] = field(default_factory=dict)  # every planned param's TP style
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # matrices per planned param
    gathered: list[str] = field(default_factory=list)  # params with a forward's view: every rank gathers and orthogonalises them
    unmatched_rules: list[str] = field(default_factory=list)
    dtype: str = "float32"  # what the directions are exchanged and orthogonalised in
    optimizer: str = "muon"  # the registry name of the optimizer instance that runs it
    tp_plan_source: str = ""  # where the TP plan came from, for readers (the CLI sets it)

    def rank_totals(self) -> list[dict[str, Any]]:
        """Per rank over all buckets: bytes sent and received, the largest bucket's transient
        bytes (two buckets are in flight: at most twice that), Newton–Schulz FLOPs, and their
        share of one process's."""
        world, buckets = self.plan.world_size, self.plan.buckets
        return [
            {
                "rank": rank,
                "sent": sum(b.sent[rank] for b in buckets),
                "received": sum(b.received[rank] for b in buckets),
                "transient_max": max((b.transient[rank] for b in buckets), default=0),
                "flops": self.plan.loads[rank],
                "vs_one_process": self.plan.loads[rank] / self.one_process_flops if self.one_process_flops else 0.0,
            }
            for rank in range(world)
        ]

    def as_json(self) -> dict[str, Any]:
        """A JSON-friendly form (``dump-param-groups --mesh --format json``); bytes and FLOPs as numbers."""
        per_rank = ("sent", "received", "transient", "flops")
        return {
            "optimizer": self.optimizer,
            "mesh": dict(self.mesh.dims),
            "world_size": self.mesh.world_size,
            "dtype": self.dtype,
            "tp_mode": self.tp_mode,
            "bucket_size": self.bucket_size,
            "fsdp_orthogonalize": self.fsdp_orthogonalize,
            "orthogonalize": self.orthogonalize,
            "tp_plan": self.tp_plan_source,
            "tp_styles": dict(self.styles),
            "gathered": list(self.gathered),
            "buckets": [
                {
                    "units": [
                        {
                            "label": unit_label(unit, self.counts),
                            "param": param_name(unit),
                            "box": [list(r) for r in unit.box],
                            "how": unit_mode(unit, self.orthogonalize),
                            "rows": unit.rows,
                            "cols": unit.cols,
                            "owners": list(unit.owners),
                            "flops": unit.cost,
                        }
                        for unit in bucket.units
                    ],
                    "ranks": [
                        {"rank": rank, **{what: getattr(bucket, what)[rank] for what in per_rank}}
                        for rank in range(self.plan.world_size)
                    ],
                }
                for bucket in self.plan.buckets
            ],
            "ranks": self.rank_totals(),
            "one_process_flops": self.one_process_flops,
            "busiest_vs_one_process": self.busiest_vs_one_process,
            "unmatched_tp_rules": list(self.unmatched_rules),
        }

    @property
    def busiest_vs_one_process(self) -> float:
        return max(self.plan.loads) / self.one_process_flops if self.one_process_flops else 0.0


def owner_computes_applies(group: ResolvedGroup) -> bool:
    """Whether the group's optimizer runs Muon's FSDP2 owner-computes: an unconstrained
    orthogonalized optimizer whose update is Newton–Schulz (constrained ones refuse DTensors)."""
    spec = get_spec(group.optimizer)
    return spec.family == "orthogonalized" and not spec.constraint and spec.update_cost is newton_schulz_cost


@dataclass(frozen=True)
class _Instance:
    """What a Muon-family optimizer instance decides about its plan (built once per group, on the meta device)."""

    optimizer: str
    tp_mode: TPMode
    bucket_size: int
    fsdp_orthogonalize: str
    whole: bool  # the update needs the orthogonalised matrix whole (NorMuon)
    distributable: bool  # ``tp_mode="distributed"`` can run it


def _instance(group: ResolvedGroup, settings: dict[str, Any]) -> _Instance:
    """The group's optimizer built as ``get_optimizer`` builds it (its config's instance fields,
    ``settings`` over them) on one meta matrix, asked what the plan needs; its errors are ``get_optimizer``'s."""
    spec = get_spec(group.optimizer)
    instance = {name: getattr(group.config, name) for name in spec.instance_fields}
    instance.update({name: value for name, value in settings.items() if name in instance and value is not None})
    shape = tuple(group.params[0].param.shape)
    optimizer: Any = spec.build([group.torch_param_group([torch.empty(shape, device="meta")], ["p"])], instance)
    return _Instance(
        group.optimizer, optimizer.tp_mode, optimizer.bucket_size, optimizer.fsdp_orthogonalize,
        "orthogonal" in optimizer._whole_inputs(optimizer.param_groups[0]), bool(optimizer.tp_distributable),
    )  # fmt: skip


def _stepped_through_a_view(group: ResolvedGroup, param: torch.Tensor) -> bool:
    """Whether Muon steps ``param`` through a forward's view: its plain path, which under FSDP2
    gathers the param whole on every rank (a view's blocks are no box of the param)."""
    view = group.matrix_view_of(param)
    return view is not None and view != MatrixView.default(tuple(param.shape), flatten=group.flatten)


def gathered_params(groups: Sequence[ResolvedGroup]) -> list[str]:
    """The Muon-family params that owner-computes leaves to Muon's plain path (:func:`_stepped_through_a_view`)."""
    return [
        name
        for group in groups if owner_computes_applies(group)
        for routed, name in zip(group.params, group.param_names) if _stepped_through_a_view(group, routed.param)
    ]  # fmt: skip


def plan_mesh(
    groups: Sequence[ResolvedGroup], mesh: MeshSpec, *, tp_plan: TensorPlan = DEFAULT_TP_PLAN,
    tp_mode: TPMode | None = None, bucket_size: int | None = None, fsdp_orthogonalize: str | None = None,
    per_replica: bool = False,
) -> list[MeshPlan]:
    """The owner-computes plans of the Muon-family params of ``groups`` on ``mesh``, as each rank
    of ``get_optimizer``'s optimizers would compute them: one per optimizer instance, mesh the
    params live on (:func:`param_mesh`: with a TP dim, the params TP leaves alone are on the
    data-parallel dims) and compute dtype, each exchanged on its own; the whole mesh's first.

    ``tp_mode``, ``bucket_size`` and ``fsdp_orthogonalize`` override the config's ``muon_tp_mode``,
    ``muon_bucket_size`` and ``muon_fsdp_orthogonalize`` (``None``: the config's). Under
    ``fsdp_orthogonalize="auto"`` the redundant path is taken where owner-computes would leave the
    busiest rank more than :data:`~optzoo.optimizers.owner_compute.OWNER_COMPUTES_MAX_SHARE` of
    the FLOPs, as Muon does. ``per_replica``: HSDP's replicas each compute their own copy (Muon's
    ``_per_replica``, for the benchmark). ``one_process_flops`` is one process's Newton–Schulz
    FLOPs for the same matrices.
    """
    for group in groups:  # as the record's build would refuse the DTensors fully_shard makes
        why = get_spec(group.optimizer).whole_params
        if why and group.params:
            raise ValueError(
                f"`{group.param_names[0]}`: {group.optimizer} needs whole matrices ({why}); got param group "
                f"#{group.index} ({len(group.params)} params) on FSDP2's mesh {mesh.describe()}; expected it off the "
                "mesh: route it to muon or adam, or leave its module out of fully_shard"
            )
    settings = {"muon_tp_mode": tp_mode, "muon_bucket_size": bucket_size, "muon_fsdp_orthogonalize": fsdp_orthogonalize}
    planned: dict[tuple[_Instance, MeshSpec, torch.dtype], list[tuple[Any, ...]]] = {}
    single: dict[tuple[_Instance, MeshSpec, torch.dtype], list[tuple[Any, ...]]] = {}
    steps: dict[str, int] = {}
    whole: dict[str, bool] = {}
    styles: dict[str, TPStyle] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    counts: dict[str, int] = {}
    gathered: list[str] = []
    used: set[int] = set()
    for group in groups:
        if not owner_computes_applies(group) or not group.params:
            continue
        instance = _instance(group, settings)
        for routed, name in zip(group.params, group.param_names):
            param = routed.param
            shape = tuple(param.shape)
            if _stepped_through_a_view(group, param):
                gathered.append(name)
                continue
            style, rule = tp_style(name, tp_plan) if "tp" in dict(mesh.dims) else ("replicate", None)
            if rule is not None:
                used.add(rule)
            styles[name], shapes[name] = style, shape
            home = param_mesh(style, mesh)
            layout = ShardLayout.of(shape, home.shape, mesh_placements(shape, style, mesh))
            alone = ShardLayout.of(shape, (1,), (Replicate(),))
            *stacked, rows, cols = matrix_shape(shape, flatten=group.flatten)
            count, dtype = math.prod(stacked), compute_dtype(param)
            counts[name], steps[name], whole[name] = count, group.config.muon_num_ns_steps, instance.whole
            for index in range(count):
                entry = ((name, index), shape, layout, (count, rows, cols), index, dtype.itemsize)
                planned.setdefault((instance, home, dtype), []).append(entry)
                single.setdefault((instance, home, dtype), []).append((*entry[:2], alone, *entry[3:]))
    unmatched = [f"{glob}={style}" for index, (glob, style) in enumerate(tp_plan) if index not in used]
    plans = []
    for key, entries in sorted(planned.items(), key=lambda item: -len(item[0][1].dims)):
        instance, home, dtype = key
        options: dict[str, Any] = {
            "bucket_size": instance.bucket_size, "num_ns_steps": lambda key: steps[key[0]],
            "whole": lambda key: whole[key[0]], "distributable": instance.distributable, "per_replica": per_replica,
        }  # fmt: skip
        redundant = instance.fsdp_orthogonalize == "redundant"
        plan = plan_owner_compute(entries, tp_mode=instance.tp_mode, redundant=redundant, **options)
        if instance.fsdp_orthogonalize == "auto" and plan.busiest_share > OWNER_COMPUTES_MAX_SHARE:
            redundant, plan = True, plan_owner_compute(entries, tp_mode=instance.tp_mode, redundant=True, **options)
        one = sum(plan_owner_compute(single[key], tp_mode="layer_sharded", **options).loads)
        plans.append(MeshPlan(
            home, instance.tp_mode, instance.bucket_size, instance.fsdp_orthogonalize, "redundant" if redundant else "owner",
            plan, one, {name: styles[name] for name in dict.fromkeys(e[0][0] for e in entries)}, shapes, counts, gathered, unmatched,
            str(dtype).removeprefix("torch."), instance.optimizer,
        ))  # fmt: skip
    return plans


def unit_label(unit: Unit, counts: dict[str, int]) -> str:
    """A unit as a reader finds it: the param's name, ``[i]`` for matrix ``i`` of a stack of
    ``counts[name]``, and, for a tensor-parallel block of a matrix (``blockwise``), its rows or columns.

    Example:
        >>> layout = ShardLayout.of((8, 4), (2,), (Shard(0),))
        >>> unit_label(Unit((("w", 0), ((4, 8), (0, 4))), ((4, 8), (0, 4)), layout, 0.0, 4, (0, 0)), {"w": 1})
        'w rows 4:8'
    """
    key: Any = unit.key
    block = isinstance(key[0], tuple)
    name, index = key[0] if block else key
    count = counts.get(name, 1)
    label = f"{name}[{index}]" if count > 1 else name
    if block:
        whole = matrix_box(unit.layout.shape, count, index)
        for what, got, full in zip(("rows", "cols"), unit.box[-2:], whole[-2:]):
            if got != full:
                label += f" {what} {got[0]}:{got[1]}"
    return label


def unit_mode(unit: Unit, orthogonalize: str) -> str:
    """How a unit is orthogonalised: ``whole`` (one owner), ``distributed`` (its TP group, each rank
    its block, together), ``duplicated`` (whole, once per TP rank class), ``blockwise`` (a TP block
    alone) or ``redundant`` (every rank); ``tp_mode="auto"`` picks per weight, so the plan says which."""
    if orthogonalize == "redundant":
        return "redundant"
    key: Any = unit.key
    if isinstance(key[0], tuple):
        return "blockwise"
    if unit.parts is not None:
        return "distributed"
    return "duplicated" if len(unit.owners) > 1 else "whole"


def param_name(unit: Unit) -> str:
    """The name of the param a unit of :func:`plan_mesh` belongs to."""
    key: Any = unit.key
    return str(key[0][0] if isinstance(key[0], tuple) else key[0])


def format_bytes(size: int) -> str:
    """``1 GiB``, ``64 MiB``, ``1536 bytes``: the largest binary unit that divides ``size`` exactly.

    Example:
        >>> format_bytes(1 << 30), format_bytes(3 << 19), format_bytes(1000)
        ('1 GiB', '1536 KiB', '1000 bytes')
    """
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} bytes"


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9}  # fmt: skip


def parse_bytes(text: str, flag: str = "`--bucket-size`") -> int:
    """A byte count: an integer with an optional unit (``KiB``, ``MiB``, ``GiB``, or ``kB``, ``MB``, ``GB``).

    Example:
        >>> parse_bytes("64MiB"), parse_bytes("1.5k"), parse_bytes("4096")
        (67108864, 1536, 4096)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or int(float(match.group(1)) * _UNITS[unit]) < 1:
        raise ValueError(
            f"{flag}: not a positive byte count; got {text!r}; expected an integer with an optional unit "
            "(KiB, MiB, GiB, kB, MB, GB), e.g. 64MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])
