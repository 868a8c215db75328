"""Meshes over a stage's devices and logical-axis rules from annotations to mesh layouts.

Host arrays to and from a mesh that spans processes (`to_devices`, `readable`, `host_array`).

Also expert placements (`plan_placement`) that balance MoE token load over the expert axis, and
the expert-parallel MoE layer that uses them (`moe_expert_parallel`).
"""

from jaxrl.sharding.balance import METHODS, plan_placement
from jaxrl.sharding.expert import (
  EXCHANGES,
  ExpertParallelConfig,
  PlacementLayer,
  moe_expert_parallel,
  placement_arrays,
)
from jaxrl.sharding.hosts import (
  host_array,
  move_between_devices,
  readable,
  readable_from_threads,
  to_devices,
)
from jaxrl.sharding.mesh import MESH_AXES, make_mesh, split_devices
from jaxrl.sharding.placement import (
  Placement,
  bytes_moved,
  device_loads,
  home_placement,
  imbalance,
)
from jaxrl.sharding.rules import (
  LOGICAL_AXES,
  ROLLOUT_RULES,
  STAGE_RULES,
  TRAIN_RULES,
  MeshAxes,
  Rules,
  batch_sharding,
  check_rules,
  kernel_mesh,
  kv_pool_pspec,
  logical_to_pspec,
  tree_shardings,
)

__all__ = [
  "EXCHANGES",
  "LOGICAL_AXES",
  "MESH_AXES",
  "METHODS",
  "ROLLOUT_RULES",
  "STAGE_RULES",
  "TRAIN_RULES",
  "ExpertParallelConfig",
  "MeshAxes",
  "Placement",
  "PlacementLayer",
  "Rules",
  "batch_sharding",
  "bytes_moved",
  "check_rules",
  "device_loads",
  "home_placement",
  "host_array",
  "imbalance",
  "kernel_mesh",
  "kv_pool_pspec",
  "logical_to_pspec",
  "make_mesh",
  "move_between_devices",
  "moe_expert_parallel",
  "placement_arrays",
  "plan_placement",
  "readable",
  "readable_from_threads",
  "split_devices",
  "to_devices",
  "tree_shardings",
]
