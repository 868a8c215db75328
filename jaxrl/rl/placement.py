"""Which devices serve rollout and which train: the meshes of the two stages."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import jax

from jaxrl.config import ConfigError, ExperimentConfig, MeshConfig, PlacementConfig
from jaxrl.model import Model
from jaxrl.scheduler.local import plan_for_experiment
from jaxrl.scheduler.plan import Plan
from jaxrl.scheduler.problem import PlanningError
from jaxrl.sharding import STAGE_RULES, make_mesh, split_devices, tree_shardings

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
  """The rollout and training meshes; in colocated mode both span the same devices."""

  mode: str
  rollout_mesh: jax.sharding.Mesh
  train_mesh: jax.sharding.Mesh

  @property
  def shares_devices(self) -> bool:
    """Whether some device serves both stages (so their memory competes)."""
    return bool(set(self.rollout_mesh.devices.flat) & set(self.train_mesh.devices.flat))


def place_stages(
  cfg: ExperimentConfig, prompt_len: int, devices: Sequence[jax.Device] | None = None
) -> Placement:
  """The stages' meshes for `cfg.placement` over this process's devices (or `devices`).

  In "planned" mode the scheduler splits the devices between the stages. One device cannot be
  split: both stages are then colocated on it (and the log says so), so the job starts on a
  one-GPU machine as shipped. Where the planner finds no split of several devices, the error
  says what is missing.
  """
  devices = list(jax.devices() if devices is None else devices)
  if cfg.placement.mode != "planned":
    return make_placement(cfg.placement, devices)
  if len(devices) == 1:
    log.info(
      "config.placement.mode='planned': one %s device cannot be split between the stages; "
      "rollout and training are colocated on it.",
      devices[0].platform,
    )
    return make_placement(
      dataclasses.replace(cfg.placement, mode="colocated", train_devices=1), devices
    )
  try:
    plan = plan_for_experiment(cfg, prompt_len, devices)
  except PlanningError as e:
    raise ConfigError(
      f"config.placement.mode='planned': {e} Set placement.mode='colocated' (both stages on "
      "the same devices) or 'disaggregated' with explicit device counts, or change the batch "
      "settings."
    ) from None
  log.info("placement planned by the scheduler:\n%s", plan.table())
  return make_placement(cfg.placement, devices, plan=plan)


def make_placement(
  cfg: PlacementConfig, devices: Sequence[jax.Device] | None = None, plan: Plan | None = None
) -> Placement:
  """Builds the two stage meshes from the local devices (or `devices`).

  In "planned" mode the split and the mesh shapes come from `plan` (the scheduler's plan for
  these devices, `jaxrl.scheduler.local.plan_for_experiment`), laid out as in disaggregated
  mode: rollout first, as one mesh of `data` x `tensor` (the smallest tensor degree among the
  plan's rollout instances), then training with the plan's device count and mesh.
  """
  devices = list(jax.devices() if devices is None else devices)
  if cfg.mode == "planned":
    if plan is None:
      raise ConfigError("config.placement.mode='planned' needs a plan from jaxrl.scheduler.")
    cfg = _planned(cfg, plan)
  if cfg.mode == "colocated":
    groups = [_take(devices, [cfg.train_devices], "config.placement.train_devices")[0]] * 2
  else:
    groups = _take(
      devices,
      [cfg.rollout_devices, cfg.train_devices],
      "config.placement.rollout_devices + config.placement.train_devices",
    )
  meshes = []
  for group, axes, key in (
    (groups[0], cfg.rollout_mesh, "rollout_mesh"),
    (groups[1], cfg.train_mesh, "train_mesh"),
  ):
    try:
      meshes.append(make_mesh(group, axes.axes()))
    except ValueError as e:
      raise ConfigError(f"config.placement.{key}: {e}") from None
  return Placement(mode=cfg.mode, rollout_mesh=meshes[0], train_mesh=meshes[1])


def check_model_fits(placement: Placement, model: Model, rollout_model: Model) -> None:
  """Raises a `ConfigError` naming the mesh whose axes do not divide the dimensions they
  split: the training mesh holds the learner (training layout) and the eval engine (rollout
  layout), the rollout mesh the rollout workers (whose sub-meshes keep its model axes).
  Checked before anything is built, so that the error names the config key, not a weight."""
  stages = (
    ("train_mesh", placement.train_mesh, model, "train"),
    ("train_mesh", placement.train_mesh, rollout_model, "rollout"),
    ("rollout_mesh", placement.rollout_mesh, rollout_model, "rollout"),
  )
  for key, mesh, stage_model, stage in stages:
    shapes = jax.tree.map(lambda x: x.shape, stage_model.abstract_params())
    try:
      tree_shardings(stage_model.logical_axes, mesh, STAGE_RULES[stage], shapes)
    except ValueError as e:
      planned = " (as planned)" if placement.mode == "planned" else ""
      raise ConfigError(
        f"config.placement.{key}{planned} = {dict(mesh.shape)} does not fit the model: {e}"
      ) from None


def _planned(cfg: PlacementConfig, plan: Plan) -> PlacementConfig:
  tensor = min(r.mesh["tensor"] for r in plan.rollout)
  return dataclasses.replace(
    cfg,
    rollout_devices=sum(r.devices for r in plan.rollout),
    train_devices=plan.train.devices,
    rollout_mesh=MeshConfig(data=-1, tensor=tensor),
    train_mesh=MeshConfig(**plan.train.mesh),
  )


def _take(devices, sizes, what: str):
  try:
    return split_devices(devices, sizes)
  except ValueError as e:
    raise ConfigError(
      f"{what} = {sum(sizes)} devices, but this process has {len(devices)} "
      f"({devices[0].platform}); lower the device counts in config.placement. ({e})"
    ) from None
