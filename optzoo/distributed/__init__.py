"""Distributed optimizers on ``torch.distributed``: layer-wise ownership and sharded state.

``use_layer_wise_distributed_optimizer`` gives each parameter one owner rank, balanced by the
cost of its update; ``use_distributed_optimizer`` (ZeRO-1) cuts the params of element-wise
optimizers into equal element ranges. Both are one :class:`DistributedOptimizer` over a
:class:`ShardingPlan`; see ``docs/distributed.md``.
"""

from optzoo.distributed.checkpoint import consolidate
from optzoo.distributed.dcp import load_dcp, save_dcp
from optzoo.distributed.optimizer import DistributedOptimizer, ParamSync
from optzoo.distributed.plan import Mode, Shard, ShardingPlan, param_cost, plan_shards
from optzoo.distributed.setup import (
    ExpertLayout,
    check_same_model,
    expert_data_parallel_group,
    expert_layout,
    is_expert,
    data_parallel_group,
    fsdp_process_group,
    mesh_process_group,
    preserve_param_attributes,
    replicated_params,
    resolve_process_group,
)

__all__ = [
    "DistributedOptimizer",
    "ExpertLayout",
    "Mode",
    "ParamSync",
    "Shard",
    "ShardingPlan",
    "check_same_model",
    "consolidate",
    "data_parallel_group",
    "expert_data_parallel_group",
    "expert_layout",
    "fsdp_process_group",
    "is_expert",
    "load_dcp",
    "mesh_process_group",
    "param_cost",
    "plan_shards",
    "preserve_param_attributes",
    "replicated_params",
    "resolve_process_group",
    "save_dcp",
]
