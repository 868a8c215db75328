"""Meshes over a stage's devices and logical-axis rules from annotations to mesh layouts."""

from jaxrl.sharding.mesh import MESH_AXES, make_mesh, split_devices
from jaxrl.sharding.rules import (
  LOGICAL_AXES,
  ROLLOUT_RULES,
  STAGE_RULES,
  TRAIN_RULES,
  MeshAxes,
  Rules,
  batch_sharding,
  check_rules,
  logical_to_pspec,
  tree_shardings,
)

__all__ = [
  "LOGICAL_AXES",
  "MESH_AXES",
  "ROLLOUT_RULES",
  "STAGE_RULES",
  "TRAIN_RULES",
  "MeshAxes",
  "Rules",
  "batch_sharding",
  "check_rules",
  "logical_to_pspec",
  "make_mesh",
  "split_devices",
  "tree_shardings",
]
