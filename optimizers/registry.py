"""The optimizer registry: one frozen record per algorithm, all registered in this module.

A record says how to build the algorithm over torch param groups, which ``OptimizerConfig``
fields it reads (by name: this package never imports the rest of optzoo), and the facts about it
that the rest of optzoo acts on: whether its update is element-wise (the sharded optimizer may
then cut a param into ranges), what one update costs (the layer-wise planner balances ranks by
it), its family (MuP's rules), the shapes it takes and what it hands to a fallback optimizer
(routing). Nothing outside this module compares optimizer names.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import torch
from torch.distributed.tensor import DTensor

from .._common import SCALAR_ROLES, MatrixView, did_you_mean, fused_supported
from . import _emerging
from .adaptive_muon import AdaptiveMuon
from .muon import Muon, matrix_shape
from .orthogonalized import MOP, MuonHyperball, PolarGrad, Scion, SinkhornMuon, Spel
from .newton_schulz import NewtonSchulzWarning, newton_schulz_flops
from .precision_adam import PrecisionAwareAdam

__all__ = [
    "ELEMENTWISE_FLOPS_PER_ELEMENT",
    "Family",
    "OptimizerSpec",
    "Placement",
    "Source",
    "fused_supported",
    "get_spec",
    "register",
    "registered_names",
    "unregister",
]

Source = Literal["torch", "emerging-optimizers", "optzoo"]
Family = Literal["adam", "sgd", "sign", "orthogonalized", "preconditioned", "riemannian"]
"""An algorithm's lineage, which decides MuP's rules (:func:`optzoo.get_mup_config_overrides`):
``adam``, per-element adaptive (hidden lr and ``adam_eps`` scale by 1/width); ``sgd`` (the
vector-like params' lr scales by width); ``orthogonalized``, the Muon family (the matrices it
manages keep its own shape scaling); ``sign`` (Lion), ``preconditioned`` (SOAP, REKLS, PSGD) and
``riemannian`` (the oblique optimizers, whose matrices stay on unit spheres): hidden lr."""
ParamGroups = list[dict[str, Any]]
StateBytes = Callable[[tuple[int, ...], Mapping[str, Any], torch.dtype], int]
"""Bytes of the state tensors one param of this shape gets by its first step, given the group's
config fields and the dtype the algorithm steps (the main param's: float32 under mixed precision)."""
UpdateCost = Callable[[tuple[int, ...], Mapping[str, Any]], float]
"""FLOPs of one update of a param of this shape, given the group's config fields (``config_fields``),
``flatten`` (whether its N-D params are one flattened matrix) and ``matrix_view`` (the
:class:`~optzoo._common.MatrixView` the forward multiplies it by, or ``None``)."""
Placement = Literal["take", "take_flattened", "decline", "cannot"]
"""What an algorithm does with a parameter: takes it (as a matrix, a stack of matrices, or
``take_flattened``: one matrix of its first dim by the rest), declines it to its fallback
optimizer unless a rule routes it there explicitly, or cannot take it at all."""
Place = Callable[[torch.Tensor, frozenset[str], Mapping[str, Any], bool, MatrixView | None], Placement]
"""``place(param, roles, config fields, explicit, view)``: the :data:`Placement` of ``param``, given its
roles (:data:`optzoo._common.ROLES`), its group's config fields, whether a user rule set
``optimizer`` for it (an explicit rule overrides a decline, never a ``cannot``) and how the
forward multiplies by it (:class:`~optzoo._common.MatrixView`, or ``None`` when not known)."""

ELEMENTWISE_FLOPS_PER_ELEMENT = 10
"""Rough cost of one element of an element-wise update (Adam: ~10 flops), to weigh element-wise
params against Newton–Schulz FLOPs when the layer-wise planner balances ranks."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _float32_or_wider(dtype: torch.dtype) -> torch.dtype:
    """The dtype an optzoo class keeps state in: float32 for 16-bit params (``compute_dtype``)."""
    return torch.float32 if _itemsize(dtype) < 4 else dtype


def per_element_state(copies: int, *, float32: bool = False, step: bool = False) -> StateBytes:
    """``copies`` param-shaped state tensors (in the param's dtype, or float32 and wider with
    ``float32``), plus torch's 0-d float32 ``step`` tensor with ``step``."""

    def state_bytes(shape: tuple[int, ...], fields: Mapping[str, Any], dtype: torch.dtype) -> int:
        kept = _float32_or_wider(dtype) if float32 else dtype
        return copies * math.prod(shape) * _itemsize(kept) + (4 if step else 0)

    return state_bytes


def elementwise_cost(shape: tuple[int, ...], fields: Mapping[str, Any]) -> float:
    """:data:`ELEMENTWISE_FLOPS_PER_ELEMENT` per element: the cost of an element-wise update."""
    return float(torch.Size(shape).numel() * ELEMENTWISE_FLOPS_PER_ELEMENT)


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one algorithm from resolved per-group config fields, and the facts about it."""

    name: str
    """Registry name, the value of ``OptimizerConfig.optimizer``."""
    description: str
    """One line for ``optzoo list``."""
    source: Source
    """Where the algorithm's implementation comes from."""
    family: Family
    """Its lineage (see :data:`Family`): MuP reads it."""
    elementwise: bool
    """Each element's update depends on that element alone, so a param may be stepped in slices
    (the sharded optimizer cuts such params into element ranges)."""
    update_cost: UpdateCost
    """Estimated FLOPs of one update (the layer-wise planner balances ranks by it)."""
    shapes: str
    """Which parameter shapes it takes, in words, e.g. ``"any"`` or ``"2-D only"``."""
    state_bytes: StateBytes
    """Bytes of optimizer state per param (see :data:`StateBytes`): memory planners and the
    comparison table read it; ``tests/optimizers/test_state_bytes.py`` measures it."""
    config_fields: tuple[str, ...]
    """Config fields it reads besides ``lr`` and ``weight_decay``."""
    instance_fields: tuple[str, ...]
    """Fields that must agree within one optimizer instance (groups that differ get their own)."""
    group_options: Callable[[Mapping[str, Any]], dict[str, Any]]
    """Maps the group's resolved config fields to torch param-group hyperparameters."""
    build: Callable[[ParamGroups, Mapping[str, Any]], torch.optim.Optimizer]
    """Builds the optimizer from complete param groups and the instance fields."""
    place: Place | None = None
    """Which params it takes, by shape and role (``None``: every param). The params it declines
    or cannot take go to the optimizer named by ``fallback_field``."""
    fallback_field: str | None = None
    """Config field naming the optimizer for the params above, e.g. ``muon_scalar_optimizer``."""
    declines_what: str = ""
    """What ``place`` declines, in words, for explanations (e.g. "embeddings, output layers, ...")."""
    constraint: str = ""
    """What it keeps the weights on after every update, in words (SPEL: "orthogonal matrices");
    empty for an unconstrained algorithm. A constrained one moves the weights even at a zero
    gradient (onto its set) and reaches a target only on that set."""
    precision_aware: bool = False
    """It runs under ``use_precision_aware_optimizer`` (typed master weights and moments)."""
    scalar_fallback: bool = False
    """It may be a matrix optimizer's fallback (``muon_scalar_optimizer``): it takes any shape."""
    matrix_views: bool = False
    """It steps each param as the matrices its forward multiplies by (blocks and orientation: the
    group's ``matrix_views``, from the roles record), not as its stored shape says."""
    verified_step: bool = False
    """Finite gradients can still make its update non-finite, or make it raise midway (SOAP: its
    float32 Kronecker factors ``G·Gᵀ`` and their eigendecompositions overflow or fail to converge
    for gradients around 1e16 when nothing clips them). The wrapper steps it first, as a
    transaction: params and state are kept, the result checked, and everything put back and the
    step reported as skipped when it is not finite. Costs a copy of its state per step (small next
    to its O(n³) eigendecompositions)."""
    whole_params: str = ""
    """Why it needs each param whole and cannot step FSDP2 shards (DTensor params), in words;
    empty: it steps shards. ``build`` refuses such params by name, and ``optzoo estimate`` and
    ``dump-param-groups --mesh`` refuse a plan that would hand it shards."""

    def __post_init__(self) -> None:
        if self.whole_params:  # the fact is the check: the record's build refuses shards itself
            build, name, why = self.build, self.name, self.whole_params

            def build_whole(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
                _refuse_dtensors(groups, name, why)
                return build(groups, instance)

            object.__setattr__(self, "build", build_whole)


_REGISTRY: dict[str, OptimizerSpec] = {}


def register(spec: OptimizerSpec) -> OptimizerSpec:
    """Add ``spec``; a second record with the same name is an error."""
    if spec.name in _REGISTRY:
        raise ValueError(
            f"`{spec.name}`: optimizer already registered; got a second registration; "
            f"expected a new name (registered: {registered_names()})"
        )
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a record (for tests and experiments); an unknown name lists the registered ones."""
    get_spec(name)
    del _REGISTRY[name]


def registered_names() -> list[str]:
    """Registered optimizer names, in registration order."""
    return list(_REGISTRY)


def get_spec(name: str) -> OptimizerSpec:
    """The record for ``name``; an unknown name lists the registered ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"`optimizer`: unknown optimizer; got {name!r}; expected one of {registered_names()}"
            f"{did_you_mean(name, registered_names())}"
        ) from None


def _all_params(groups: ParamGroups) -> list[torch.Tensor]:
    return [p for group in groups for p in group["params"]]


class _Kernel(TypedDict, total=False):
    fused: bool
    foreach: bool


def _kernel(groups: ParamGroups, op: str) -> _Kernel:
    """torch's fused kernel (the aten op ``op``) wherever it exists and takes the params (on these
    CPUs ~9x faster than foreach for AdamW and ~4x for SGD with weight decay:
    ``benchmarks/bench_step.py``), else foreach."""
    return {"fused": True} if fused_supported(_all_params(groups), op) else {"foreach": True}


def _build_adam(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    if instance["use_precision_aware_optimizer"]:
        return _build_precision_aware_adam(groups, instance)
    if instance["decoupled_weight_decay"]:
        return torch.optim.AdamW(groups, **_kernel(groups, "_fused_adamw_"))
    return torch.optim.Adam(groups, **_kernel(groups, "_fused_adam_"))


def _build_precision_aware_adam(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    """Megatron's ``use_precision_aware_optimizer``: typed master and moments, fp32 math.

    16-bit params get a master copy (or, with ``store_param_remainders``, an int16 remainder);
    fp32 params are their own master. Gradients are read from ``param.decoupled_grad``.
    """
    sixteen_bit = [p for p in _all_params(groups) if p.dtype in (torch.float16, torch.bfloat16)]
    return PrecisionAwareAdam(
        groups,
        decoupled_weight_decay=instance["decoupled_weight_decay"],
        master_weights=bool(sixteen_bit),
        master_weight_dtype=instance["main_params_dtype"],
        store_param_remainders=bool(sixteen_bit) and instance["store_param_remainders"],
        exp_avg_dtype=instance["exp_avg_dtype"],
        exp_avg_sq_dtype=instance["exp_avg_sq_dtype"],
        use_decoupled_grad=True,
    )


def _adam_state_bytes(shape: tuple[int, ...], fields: Mapping[str, Any], dtype: torch.dtype) -> int:
    """torch's two moments in the param's dtype and a float32 ``step``; under
    ``use_precision_aware_optimizer``, typed moments and a master copy (or int16 remainder) of a 16-bit param."""
    numel = math.prod(shape)
    if not fields.get("use_precision_aware_optimizer"):
        return 2 * numel * _itemsize(dtype) + 4
    moments = numel * (_itemsize(fields["exp_avg_dtype"]) + _itemsize(fields["exp_avg_sq_dtype"])) + 4
    if _itemsize(dtype) >= 4:
        return moments
    master = 2 if fields["store_param_remainders"] else _itemsize(fields["main_params_dtype"])
    return moments + numel * master


register(
    OptimizerSpec(
        name="adam",
        description=(
            "Adam, or AdamW with decoupled_weight_decay (torch.optim, fused where supported; "
            "optzoo's PrecisionAwareAdam under use_precision_aware_optimizer)"
        ),
        source="torch",
        family="adam",
        elementwise=True,
        update_cost=elementwise_cost,
        shapes="any",
        state_bytes=_adam_state_bytes,
        config_fields=(
            "adam_beta1", "adam_beta2", "adam_eps", "decoupled_weight_decay",
            "use_precision_aware_optimizer", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
            "store_param_remainders",
        ),  # fmt: skip
        instance_fields=(
            "decoupled_weight_decay", "use_precision_aware_optimizer", "main_params_dtype",
            "exp_avg_dtype", "exp_avg_sq_dtype", "store_param_remainders",
        ),  # fmt: skip
        group_options=lambda c: {"betas": (c["adam_beta1"], c["adam_beta2"]), "eps": c["adam_eps"]},
        build=_build_adam,
        precision_aware=True,
        scalar_fallback=True,
    )
)

register(
    OptimizerSpec(
        name="sgd",
        description="SGD with momentum and L2 weight decay (torch.optim, fused where supported)",
        source="torch",
        family="sgd",
        elementwise=True,
        update_cost=elementwise_cost,
        shapes="any",
        state_bytes=lambda shape, fields, dtype: per_element_state(1 if fields["sgd_momentum"] else 0)(shape, fields, dtype),
        config_fields=("sgd_momentum",),
        instance_fields=(),
        group_options=lambda c: {"momentum": c["sgd_momentum"]},
        build=lambda groups, _: torch.optim.SGD(groups, **_kernel(groups, "_fused_sgd_")),
    )
)

def _refuse_complex(groups: ParamGroups, name: str, why: str) -> None:
    """Raise for complex params, which the element-wise upstream updates do not define (torch's adam and sgd step them)."""
    for group_index, group in enumerate(groups):
        names = group.get("param_names")
        for param_index, param in enumerate(group["params"]):
            if param.is_complex():
                where = f"`{names[param_index]}`" if names else f"param group #{group_index}, param #{param_index}"
                raise ValueError(
                    f"{where}: {name} takes real params ({why}); got a {param.dtype} param; "
                    "expected a real floating dtype: route it to adam or sgd"
                )


def _build_lion(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    _refuse_complex(groups, "lion", "its update is a sign")
    return _emerging.lion(groups)


register(
    OptimizerSpec(
        name="lion",
        description="Lion: sign of interpolated momentum, decoupled weight decay (Chen et al., 2023)",
        source="emerging-optimizers",
        family="sign",
        elementwise=True,
        update_cost=elementwise_cost,
        shapes="any",
        state_bytes=per_element_state(1),
        config_fields=("lion_beta1", "lion_beta2"),
        instance_fields=(),
        group_options=lambda c: {"betas": (c["lion_beta1"], c["lion_beta2"])},
        build=_build_lion,
        scalar_fallback=True,
    )
)


def _place_matrix(
    param: torch.Tensor, roles: frozenset[str], fields: Mapping[str, Any], explicit: bool, view: MatrixView | None, *, n_d: bool
) -> Placement:
    """The Muon family's and SOAP's placement (Keller Jordan's Muon, Megatron-Core, Moonlight).

    Matrices and routers are taken. Embeddings, output heads, biases, norms, elementwise params
    and vectors (by role) are declined, and input layers when ``muon_input_layers`` is off. With
    ``n_d`` (the Muon family), an N-D param is taken as the matrices its forward multiplies by
    (``view``: experts, heads, groups), else expert stacks as stacks of their last two dims and
    conv filters as one flattened matrix when ``muon_flatten_conv`` is set (else declined); other
    N-D params cannot be taken. Megatron's ``use_muon`` tag wins over roles: ``False`` declines,
    ``True`` takes (where the shape allows), as an explicit rule does.
    """
    ndim = param.dim()
    conv = "conv" in roles and ndim > 2
    if ndim < 2 or (ndim > 2 and not (n_d and (conv or "expert" in roles or view is not None))):
        return "cannot"
    if param.numel() == 0:  # a (4, 0) weight: no matrix to orthogonalise or precondition
        return "cannot"
    take: Placement = "take_flattened" if conv and view is None else "take"
    use_muon = getattr(param, "use_muon", None)
    if explicit or use_muon is True:
        return take
    declined = (
        use_muon is False
        or not SCALAR_ROLES.isdisjoint(roles)
        or (conv and not fields.get("muon_flatten_conv", True))
        or ("input" in roles and not fields.get("muon_input_layers", True))
    )
    return "decline" if declined else take


def _place_muon(param: torch.Tensor, roles: frozenset[str], fields: Mapping[str, Any], explicit: bool, view: MatrixView | None) -> Placement:
    return _place_matrix(param, roles, fields, explicit, view, n_d=True)


def _place_soap(param: torch.Tensor, roles: frozenset[str], fields: Mapping[str, Any], explicit: bool, view: MatrixView | None) -> Placement:
    return _place_matrix(param, roles, fields, explicit, view, n_d=False)


_DECLINES = "embeddings, heads, biases, norms, elementwise params, vectors, use_muon=False"


def _build_soap(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    if instance["soap_precondition_frequency"] != 1:
        # emerging-optimizers 0.3.0 refreshes the eigenbasis every step and has no such option;
        # Megatron-Core passes the field nowhere. Refuse rather than ignore it.
        raise ValueError(
            "`OptimizerConfig.soap_precondition_frequency`: emerging-optimizers 0.3.0's SOAP "
            f"refreshes its preconditioner every step; got {instance['soap_precondition_frequency']!r}; expected 1"
        )
    return _emerging.soap(groups, use_kl_shampoo=instance["soap_use_kl_shampoo"])


_PRECONDITIONS_SHARDS = "emerging-optimizers' class preconditions the tensor it is given and cannot gather FSDP2 shards"


def _refuse_dtensors(groups: ParamGroups, name: str, why: str = _PRECONDITIONS_SHARDS) -> None:
    """Raise for FSDP2-sharded (DTensor) params: a preconditioner built from a shard is wrong, not slow."""
    for group_index, group in enumerate(groups):
        names = group.get("param_names")
        for param_index, param in enumerate(group["params"]):
            if isinstance(param, DTensor):
                where = f"`{names[param_index]}`" if names else f"param group #{group_index}, param #{param_index}"
                raise ValueError(
                    f"{where}: {name} needs whole matrices ({why}); got a DTensor of shape "
                    f"{tuple(param.shape)} with placements {tuple(param.placements)}; expected a plain "
                    f"tensor: route it to muon or adam, or leave its module out of fully_shard"
                )


def _soap_state_bytes(shape: tuple[int, ...], fields: Mapping[str, Any], dtype: torch.dtype) -> int:
    """Upstream keeps float32 moments, and per side of the matrix a Kronecker factor and its eigenbasis."""
    rows, cols = shape
    return 4 * (2 * rows * cols + 2 * rows * rows + 2 * cols * cols)


def soap_cost(shape: tuple[int, ...], fields: Mapping[str, Any]) -> float:
    """One eigenbasis refresh of both Kronecker factors (``~10·(m³ + n³)``) plus the factor updates
    and rotations (``~4·m·n·(m + n)``)."""
    if len(shape) != 2:
        return elementwise_cost(shape, fields)
    rows, cols = shape
    return float(10 * (rows**3 + cols**3) + 4 * rows * cols * (rows + cols))


def newton_schulz_cost(shape: tuple[int, ...], fields: Mapping[str, Any]) -> float:
    """Newton–Schulz FLOPs of the cheaper variant (:func:`~optzoo.optimizers.newton_schulz.newton_schulz_flops`)
    of each matrix: the blocks the forward multiplies by (``matrix_view``), else a 2-D param,
    each matrix of a stack (an expert's), or the flattened matrix (``flatten``: ``shape[0]`` by
    the rest)."""
    if len(shape) < 2:
        return elementwise_cost(shape, fields)
    view = fields.get("matrix_view")
    if isinstance(view, MatrixView):
        count, (rows, cols) = view.count, view.shape
    elif fields.get("flatten"):
        count, (rows, cols) = 1, (shape[0], math.prod(shape[1:]))
    else:
        count, (rows, cols) = math.prod(shape[:-2]), shape[-2:]
    steps = fields["muon_num_ns_steps"]
    return float(count * min(newton_schulz_flops(rows, cols, steps=steps, variant=v) for v in ("standard", "gram")))


def _matrix_only(
    *,
    name: str,
    description: str,
    source: Source,
    family: Family,
    update_cost: UpdateCost,
    shapes: str,
    state_bytes: StateBytes,
    place: Place,
    config_fields: tuple[str, ...],
    instance_fields: tuple[str, ...],
    group_options: Callable[[Mapping[str, Any]], dict[str, Any]],
    build: Callable[[ParamGroups, Mapping[str, Any]], torch.optim.Optimizer],
    matrix_views: bool = False,
    verified_step: bool = False,
    constraint: str = "",
    whole_params: str = "",
) -> OptimizerSpec:
    """A record for a matrix algorithm that hands everything else to ``muon_scalar_optimizer``,
    as Megatron-Core routes Muon's and SOAP's non-matrix and embedding params to Adam."""
    return OptimizerSpec(
        name=name,
        description=description,
        source=source,
        family=family,
        elementwise=False,
        update_cost=update_cost,
        shapes=shapes,
        state_bytes=state_bytes,
        config_fields=config_fields,
        instance_fields=instance_fields,
        group_options=group_options,
        build=build,
        place=place,
        fallback_field="muon_scalar_optimizer",
        verified_step=verified_step,
        declines_what=_DECLINES,
        matrix_views=matrix_views,
        constraint=constraint,
        whole_params=whole_params,
    )


register(
    _matrix_only(
        name="soap",
        description="SOAP: Adam in Shampoo's eigenbasis (Vyas et al., 2024); other params -> muon_scalar_optimizer",
        source="emerging-optimizers",
        family="preconditioned",
        update_cost=soap_cost,
        shapes="2-D only",
        state_bytes=_soap_state_bytes,
        place=_place_soap,
        config_fields=(
            "adam_beta1", "adam_beta2", "adam_eps", "soap_shampoo_beta", "soap_precondition_frequency",
            "soap_use_kl_shampoo", "muon_scalar_optimizer", "muon_scalar_lr", "muon_input_layers",
        ),  # fmt: skip
        instance_fields=("soap_precondition_frequency", "soap_use_kl_shampoo"),
        group_options=lambda c: {
            "betas": (c["adam_beta1"], c["adam_beta2"]), "eps": c["adam_eps"], "shampoo_beta": c["soap_shampoo_beta"],
        },  # fmt: skip
        build=_build_soap,
        verified_step=True,  # its eigendecompositions of G·Gᵀ overflow float32 for finite grads ~1e16
        whole_params=_PRECONDITIONS_SHARDS,
    )
)


_MUON_FIELDS = (
    "muon_momentum", "muon_nesterov", "muon_fp32_matmul_prec", "muon_coefficient_type", "muon_num_ns_steps",
    "muon_scale_mode", "muon_extra_scale_factor", "muon_split_qkv", "muon_tp_mode", "muon_scalar_optimizer",
    "muon_scalar_lr", "muon_flatten_conv", "muon_input_layers", "muon_fsdp_orthogonalize", "muon_bucket_size",
    "muon_ns_variant",
)  # fmt: skip
_MUON_INSTANCE_FIELDS = ("muon_fsdp_orthogonalize", "muon_tp_mode", "muon_bucket_size", "muon_ns_variant")
"""Settings of a Muon instance, not of a group: how its FSDP2 step is planned across the mesh, and
which Newton–Schulz kernel it runs."""
_MUON_SHAPES = "matrices, expert stacks, conv filters"


def _without_ns_warning(cls: Callable[..., Muon], groups: ParamGroups, instance: Mapping[str, Any]) -> Muon:
    """Build a Muon from configs that already warned about their Newton–Schulz schedule
    (``OptimizerConfig`` does, once per config)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NewtonSchulzWarning)
        return cls(
            groups, fsdp_orthogonalize=instance["muon_fsdp_orthogonalize"], tp_mode=instance["muon_tp_mode"],
            bucket_size=instance["muon_bucket_size"], ns_variant=instance["muon_ns_variant"],
        )  # fmt: skip


def _muon_options(c: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "momentum": c["muon_momentum"], "nesterov": c["muon_nesterov"], "fp32_matmul_prec": c["muon_fp32_matmul_prec"],
        "coefficient_type": c["muon_coefficient_type"], "num_ns_steps": c["muon_num_ns_steps"],
        "scale_mode": c["muon_scale_mode"], "extra_scale_factor": c["muon_extra_scale_factor"],
        "split_qkv": c["muon_split_qkv"],
    }  # fmt: skip


register(
    _matrix_only(
        name="muon",
        description="Muon: momentum orthogonalised by batched Newton-Schulz (optzoo); other params -> muon_scalar_optimizer",
        source="optzoo",
        family="orthogonalized",
        update_cost=newton_schulz_cost,
        shapes=_MUON_SHAPES,
        state_bytes=per_element_state(1, float32=True),
        place=_place_muon,
        config_fields=_MUON_FIELDS,
        instance_fields=_MUON_INSTANCE_FIELDS,
        group_options=_muon_options,
        build=lambda groups, instance: _without_ns_warning(Muon, groups, instance),
        matrix_views=True,
    )
)

def _adaptive_muon_state_bytes(shape: tuple[int, ...], fields: Mapping[str, Any], dtype: torch.dtype) -> int:
    """Muon's momentum, and a second moment per element (adamuon), per row of a tall matrix or
    column of a wide one (normuon), or per matrix (namo); float32 for 16-bit params."""
    view = fields.get("matrix_view")
    *stacked, rows, cols = matrix_shape(shape, flatten=bool(fields.get("flatten")), view=view if isinstance(view, MatrixView) else None)
    moment2 = {"adamuon": rows * cols, "normuon": max(rows, cols), "namo": 1}[fields["adaptive_muon_moment2_method"]]
    return _itemsize(_float32_or_wider(dtype)) * (math.prod(shape) + math.prod(stacked) * moment2)


register(
    _matrix_only(
        name="adaptive_muon",
        description="Adaptive Muon: Muon with a second moment (adamuon/normuon/namo) after orthogonalisation (optzoo)",
        source="optzoo",
        family="orthogonalized",
        update_cost=newton_schulz_cost,
        shapes=_MUON_SHAPES,
        state_bytes=_adaptive_muon_state_bytes,
        place=_place_muon,
        config_fields=(*_MUON_FIELDS, "adaptive_muon_moment2_method", "adaptive_muon_beta2", "adaptive_muon_eps"),
        instance_fields=_MUON_INSTANCE_FIELDS,
        group_options=lambda c: {
            **_muon_options(c), "moment2_method": c["adaptive_muon_moment2_method"],
            "beta2": c["adaptive_muon_beta2"], "eps": c["adaptive_muon_eps"],
        },  # fmt: skip
        build=lambda groups, instance: _without_ns_warning(AdaptiveMuon, groups, instance),
        matrix_views=True,
    )
)


def _orthogonalized(
    name: str, description: str, cls: Callable[..., Muon], options: Callable[[Mapping[str, Any]], dict[str, Any]],
    fields: tuple[str, ...] = (), *, shapes: str = _MUON_SHAPES, update_cost: UpdateCost = newton_schulz_cost,
    constraint: str = "",
) -> OptimizerSpec:
    def build(groups: ParamGroups, instance: Mapping[str, Any]) -> Muon:
        return _without_ns_warning(cls, groups, instance)

    """A record for a variant on Muon's step loop (:mod:`optzoo.optimizers.orthogonalized`): Muon's
    placement, batching, expert and QKV blocks and state; ``options`` maps the config to its group keys."""
    return _matrix_only(
        name=name, description=description, source="optzoo", family="orthogonalized", update_cost=update_cost,
        shapes=shapes, state_bytes=per_element_state(1, float32=True), place=_place_muon,
        config_fields=(*_MUON_FIELDS, *fields), instance_fields=_MUON_INSTANCE_FIELDS,
        group_options=options, build=build, matrix_views=True, constraint=constraint,
        whole_params=f"it keeps the weights on {constraint} after each update" if constraint else "",
    )  # fmt: skip


def _svd_cost(shape: tuple[int, ...], fields: Mapping[str, Any]) -> float:
    """MOP: one thin SVD (``~20·m·n·min(m, n)``) and the product ``U·Vᵀ`` (``2·m·n·min(m, n)``) per matrix."""
    if len(shape) < 2:
        return elementwise_cost(shape, fields)
    view = fields.get("matrix_view")
    *stacked, rows, cols = matrix_shape(shape, flatten=bool(fields.get("flatten")), view=view if isinstance(view, MatrixView) else None)
    return float(math.prod(stacked) * 22 * rows * cols * min(rows, cols))


_WHOLE = "matrices, expert stacks, conv filters (no FSDP2 shards)"

register(_orthogonalized(
    "polargrad", "PolarGrad: Muon scaled by the direction's nuclear norm (Lau et al., 2025); other params -> muon_scalar_optimizer",
    PolarGrad, lambda c: _muon_options(c),
))  # fmt: skip
register(_orthogonalized(
    "mop", "MOP: momentum orthogonalised by SVD polar factor, nuclear-norm scaled; other params -> muon_scalar_optimizer",
    MOP, lambda c: {**_muon_options(c), "scale_mode": c["mop_scale_mode"]}, ("mop_scale_mode",), update_cost=_svd_cost,
))  # fmt: skip
register(_orthogonalized(
    "scion", "Scion: spectral-norm LMO, unit-RMS scaled (Pethick et al., 2025); other params -> muon_scalar_optimizer",
    Scion, lambda c: {**_muon_options(c), "nesterov": False, "spectral_radius": c["scion_spectral_radius"]},
    ("scion_spectral_radius",),
))  # fmt: skip
register(_orthogonalized(
    "spel", "SPEL: Muon step, then weights re-orthogonalised (Stiefel manifold); other params -> muon_scalar_optimizer",
    Spel, lambda c: _muon_options(c), shapes=_WHOLE, constraint="orthogonal matrices (Newton-Schulz of the weights)",
    update_cost=lambda shape, fields: 2 * newton_schulz_cost(shape, fields),
))  # fmt: skip
register(_orthogonalized(
    "muon_hyperball", "Muon-Hyperball: Muon on the sphere, each matrix keeps its norm; other params -> muon_scalar_optimizer",
    MuonHyperball, lambda c: {
        **_muon_options(c), "hyperball_eps": c["muon_hyperball_eps"], "hyperball_radius": c["muon_hyperball_radius"],
    }, ("muon_hyperball_eps", "muon_hyperball_radius"), shapes=_WHOLE,
    constraint="each matrix's Frobenius norm (muon_hyperball_radius, else its norm when built)",
))  # fmt: skip
register(_orthogonalized(
    "sinkhorn_muon", "Sinkhorn-Muon: Muon, then weights Sinkhorn-Knopp normalised; other params -> muon_scalar_optimizer",
    SinkhornMuon, lambda c: {
        **_muon_options(c), "num_iters": c["sinkhorn_muon_num_iters"], "eps": c["sinkhorn_muon_eps"],
        "doubly_stochastic_tolerance": c["sinkhorn_muon_doubly_stochastic_tolerance"],
        "normalize_at_start": c["sinkhorn_muon_normalize_at_start"],
    }, (
        "sinkhorn_muon_num_iters", "sinkhorn_muon_eps", "sinkhorn_muon_doubly_stochastic_tolerance",
        "sinkhorn_muon_normalize_at_start",
    ), shapes=_WHOLE, constraint="Sinkhorn-normalised non-negative matrices (row and column sums)",
))  # fmt: skip


def _build_laprop(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    _refuse_complex(groups, "laprop", "its second moment squares the gradient element-wise")
    return _emerging.laprop(groups)


register(
    OptimizerSpec(
        name="laprop",
        description="LaProp: Adam's second moment normalises the grad before momentum (Ziyin et al., 2020)",
        source="emerging-optimizers",
        family="preconditioned",  # MuP: hidden lr scales by 1/width; laprop_eps is left as set
        elementwise=True,
        update_cost=elementwise_cost,
        shapes="any",
        state_bytes=per_element_state(2),
        config_fields=("laprop_beta1", "laprop_beta2", "laprop_eps", "laprop_correct_bias"),
        instance_fields=(),
        group_options=lambda c: {
            "betas": (c["laprop_beta1"], c["laprop_beta2"]), "eps": c["laprop_eps"], "correct_bias": c["laprop_correct_bias"],
        },  # fmt: skip
        build=_build_laprop,
        scalar_fallback=True,
    )
)


def _adafactor_state_bytes(shape: tuple[int, ...], fields: Mapping[str, Any], dtype: torch.dtype) -> int:
    """torch's float32 ``step``; a row and a column second-moment factor per matrix of an N-D param
    (its last two dims), or an element-wise one for a vector or scalar; in the param's dtype."""
    if len(shape) < 2:
        return 4 + math.prod(shape) * _itemsize(dtype)
    *stacked, rows, cols = shape
    return 4 + math.prod(stacked) * (rows + cols) * _itemsize(dtype)


def _build_adafactor(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(groups, foreach=True)


def _build_torch_muon(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.Muon(groups)


def _adafactor_cost(shape: tuple[int, ...], fields: Mapping[str, Any]) -> float:
    return elementwise_cost(shape, fields)


register(
    OptimizerSpec(
        name="adafactor",
        description="Adafactor: factored second moment, relative step size (torch.optim, foreach)",
        source="torch",
        family="adam",  # MuP: per-element adaptive, as Adam
        elementwise=False,  # RMS(param) and the row/column factors span each matrix: no element slices
        update_cost=_adafactor_cost,
        shapes="any",
        state_bytes=_adafactor_state_bytes,
        config_fields=("adafactor_beta2_decay", "adafactor_eps1", "adafactor_eps2", "adafactor_d"),
        instance_fields=(),
        group_options=lambda c: {
            "beta2_decay": c["adafactor_beta2_decay"], "eps": (c["adafactor_eps1"], c["adafactor_eps2"]), "d": c["adafactor_d"],
        },  # fmt: skip
        build=_build_adafactor,
        scalar_fallback=True,
        whole_params="torch's Adafactor reduces each whole param, its RMS and row and column factors, and has no sharded kernel",
    )
)


def _place_2d(param: torch.Tensor, roles: frozenset[str], fields: Mapping[str, Any], explicit: bool, view: MatrixView | None) -> Placement:
    """torch.optim.Muon takes 2-D params only: Muon's placement without stacks or flattened filters."""
    return _place_matrix(param, roles, fields, explicit, None, n_d=False)


register(
    _matrix_only(
        name="torch_muon",
        description="torch.optim.Muon, as a reference beside optzoo's muon (2-D only); other params -> muon_scalar_optimizer",
        source="torch",
        family="orthogonalized",
        update_cost=lambda shape, fields: newton_schulz_cost(shape, {"muon_num_ns_steps": fields["torch_muon_ns_steps"]}),
        shapes="2-D only",
        state_bytes=per_element_state(1),
        place=_place_2d,
        config_fields=(
            "torch_muon_momentum", "torch_muon_nesterov", "torch_muon_ns_steps", "torch_muon_adjust_lr_fn",
            "muon_scalar_optimizer", "muon_scalar_lr", "muon_input_layers",
        ),  # fmt: skip
        instance_fields=(),
        group_options=lambda c: {
            "momentum": c["torch_muon_momentum"], "nesterov": c["torch_muon_nesterov"], "ns_steps": c["torch_muon_ns_steps"],
            "adjust_lr_fn": c["torch_muon_adjust_lr_fn"],
        },  # fmt: skip
        build=_build_torch_muon,
        whole_params="torch.optim.Muon orthogonalises the tensor it is given: a shard's Newton-Schulz is not the matrix's",
    )
)


# ---- SOAP's and PSGD's relatives, and the oblique (unit-norm) optimizers: emerging-optimizers 0.3.0 ----

_MATRIX_ONLY = "2-D only"
"""What these upstream classes take: one 2-D matrix per param (their factors, or their unit-norm
slices, are per matrix). Expert stacks and conv filters go to ``muon_scalar_optimizer``."""


def _build_rekls(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    return _emerging.rekls(groups)


register(
    _matrix_only(
        name="rekls",
        description="REKLS: SOAP with KL-Shampoo factors, eigh every step (emerging-optimizers); rest -> muon_scalar_optimizer",
        source="emerging-optimizers",
        family="preconditioned",
        update_cost=soap_cost,  # SOAP's arithmetic, with a full eigh every step
        shapes=_MATRIX_ONLY,
        state_bytes=_soap_state_bytes,
        place=_place_soap,
        config_fields=(
            "rekls_beta1", "rekls_beta2", "rekls_eps", "rekls_shampoo_beta",
            "muon_scalar_optimizer", "muon_scalar_lr", "muon_input_layers",
        ),  # fmt: skip
        instance_fields=(),
        group_options=lambda c: {
            "betas": (c["rekls_beta1"], c["rekls_beta2"]), "eps": c["rekls_eps"], "shampoo_beta": c["rekls_shampoo_beta"],
        },  # fmt: skip
        build=_build_rekls,
        verified_step=True,  # SOAP's: its eigendecompositions of G·Gᵀ overflow float32 for finite grads ~1e16
        whole_params=_PRECONDITIONS_SHARDS,
    )
)


def _refuse_16_bit(groups: ParamGroups, name: str, why: str) -> None:
    """Raise for float16/bfloat16 params an upstream class cannot step (the wrapper's main params are float32)."""
    for group_index, group in enumerate(groups):
        names = group.get("param_names")
        for param_index, param in enumerate(group["params"]):
            if param.dtype in (torch.float16, torch.bfloat16):
                where = f"`{names[param_index]}`" if names else f"param group #{group_index}, param #{param_index}"
                raise ValueError(
                    f"{where}: {name} steps float32 or float64 params ({why}); got a {param.dtype} param; "
                    "expected bf16=True or fp16=True (float32 main params), or a float32 model"
                )


def _build_psgd_pro(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
    _refuse_complex(groups, "psgd_pro", "its preconditioner fit takes real gradient covariances")
    _refuse_16_bit(groups, "psgd_pro", "upstream's Kronecker factors are float32 and its contractions need one dtype")
    return _emerging.psgd_pro(
        groups, precond_init_scale=instance["psgd_pro_precond_init_scale"], damping_noise_scale=instance["psgd_pro_damping_noise_scale"],
        warmup_steps=instance["psgd_pro_warmup_steps"], max_update_rms=instance["psgd_pro_max_update_rms"],
    )  # fmt: skip


def _psgd_pro_state_bytes(shape: tuple[int, ...], fields: Mapping[str, Any], dtype: torch.dtype) -> int:
    """Momentum in the param's dtype; per side of the matrix a square Kronecker factor and a 0-d
    Lipschitz constant, float32 (float64 for a float64 param)."""
    rows, cols = shape
    factor = _itemsize(_float32_or_wider(dtype))
    return math.prod(shape) * _itemsize(dtype) + factor * (rows * rows + cols * cols + 2)


def psgd_pro_cost(shape: tuple[int, ...], fields: Mapping[str, Any]) -> float:
    """Per step: the preconditioner applied twice (``Qᵀ Q`` on both sides: ``~8·m·n·(m + n)``), the
    two gradient covariances (``~2·m·n·(m + n)``), and per side its update and Procrustes step
    (``~6·d³``) with the subspace-iteration norm bounds (``~512·d²``)."""
    if len(shape) != 2:
        return elementwise_cost(shape, fields)
    rows, cols = shape
    return float(6 * (rows**3 + cols**3) + 10 * rows * cols * (rows + cols) + 512 * (rows**2 + cols**2))


register(
    _matrix_only(
        name="psgd_pro",
        description="PSGD-Kron-Whiten with a Procrustes step (Li, 2015/2024; emerging-optimizers); rest -> muon_scalar_optimizer",
        source="emerging-optimizers",
        family="preconditioned",
        update_cost=psgd_pro_cost,
        shapes=_MATRIX_ONLY,
        state_bytes=_psgd_pro_state_bytes,
        place=_place_soap,
        config_fields=(
            "psgd_pro_momentum", "psgd_pro_beta_lip", "psgd_pro_precond_lr", "psgd_pro_min_precond_lr",
            "psgd_pro_precond_init_scale", "psgd_pro_damping_noise_scale", "psgd_pro_warmup_steps", "psgd_pro_max_update_rms",
            "muon_scalar_optimizer", "muon_scalar_lr", "muon_input_layers",
        ),  # fmt: skip
        instance_fields=("psgd_pro_precond_init_scale", "psgd_pro_damping_noise_scale", "psgd_pro_warmup_steps", "psgd_pro_max_update_rms"),
        group_options=lambda c: {
            "momentum": c["psgd_pro_momentum"], "beta_lip": c["psgd_pro_beta_lip"],
            "precond_lr": c["psgd_pro_precond_lr"], "min_precond_lr": c["psgd_pro_min_precond_lr"],
        },  # fmt: skip
        build=_build_psgd_pro,
        # Nothing bounds the factors it fits (a step of precond_lr / L with L from random-subspace norm
        # estimates, then a Procrustes rotation sized from traces): a non-finite result from finite
        # grads is not ruled out, so it is checked; a copy of O(m² + n²) state next to an O(m³ + n³) step.
        verified_step=True,
        whole_params=_PRECONDITIONS_SHARDS,
    )
)


def _build_oblique(name: str, build: Callable[[ParamGroups], torch.optim.Optimizer]) -> Callable[[ParamGroups, Mapping[str, Any]], torch.optim.Optimizer]:
    def build_checked(groups: ParamGroups, instance: Mapping[str, Any]) -> torch.optim.Optimizer:
        _refuse_complex(groups, name, "its retraction normalises real rows or columns")
        return build(groups)

    return build_checked


register(
    _matrix_only(
        name="oblique_sgd",
        description="Oblique SGD: Riemannian SGD with unit-norm rows/columns (emerging-optimizers); rest -> muon_scalar_optimizer",
        source="emerging-optimizers",
        family="riemannian",
        update_cost=elementwise_cost,  # a projection and a normalisation: a few flops per element
        shapes=_MATRIX_ONLY,
        state_bytes=per_element_state(1),
        place=_place_soap,
        config_fields=(
            "oblique_sgd_momentum", "oblique_sgd_dim", "oblique_sgd_eps", "muon_scalar_optimizer", "muon_scalar_lr", "muon_input_layers",
        ),  # fmt: skip
        instance_fields=(),
        group_options=lambda c: {"momentum": c["oblique_sgd_momentum"], "dim": c["oblique_sgd_dim"], "eps": c["oblique_sgd_eps"]},
        build=_build_oblique("oblique_sgd", _emerging.oblique_sgd),
        whole_params=_PRECONDITIONS_SHARDS,
    )
)

register(
    _matrix_only(
        name="oblique_adam",
        description="Oblique Adam: Adam's step on unit-norm rows/columns (emerging-optimizers); rest -> muon_scalar_optimizer",
        source="emerging-optimizers",
        family="riemannian",
        update_cost=elementwise_cost,
        shapes=_MATRIX_ONLY,
        state_bytes=per_element_state(2),  # exp_avg and exp_avg_sq; upstream's step is a Python int
        place=_place_soap,
        config_fields=(
            "oblique_adam_beta1", "oblique_adam_beta2", "oblique_adam_dim", "oblique_adam_eps", "oblique_adam_correct_bias",
            "muon_scalar_optimizer", "muon_scalar_lr", "muon_input_layers",
        ),  # fmt: skip
        instance_fields=(),
        group_options=lambda c: {
            "betas": (c["oblique_adam_beta1"], c["oblique_adam_beta2"]), "dim": c["oblique_adam_dim"],
            "eps": c["oblique_adam_eps"], "correct_bias": c["oblique_adam_correct_bias"],
        },  # fmt: skip
        build=_build_oblique("oblique_adam", _emerging.oblique_adam),
        whole_params=_PRECONDITIONS_SHARDS,
    )
)
