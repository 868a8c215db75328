"""A scheduler plan run on a Ray cluster: which nodes each stage's processes go to.

Convention: every node of pool `P` of the cluster spec (`configs/clusters/*.py`) carries the
custom Ray resource `jaxrl-pool-P`, one unit per accelerator, e.g.

  ray start --address=HEAD:6379 --resources='{"jaxrl-pool-h100": 8}'

The planner's plan for the spec (`scheduler.planner.plan`) says which pools train and which
generate, with which meshes; `plan_placement` turns it into Ray actor options: each learner
process asks for its share of the training pool's units, each rollout instance for its mesh's
units of its pool, so Ray starts them on nodes of those pools only. Where the pool's nodes
report GPUs (or TPUs) to Ray, the same count is asked for, so that Ray also gives the process
its own devices (`CUDA_VISIBLE_DEVICES`); on nodes without (CPU nodes, or the test rig's fake
accelerators) the process takes that many simulated CPU devices.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.scheduler.cluster import Cluster, Pool, load_cluster
from jaxrl.scheduler.local import experiment_workload, plan_for_experiment
from jaxrl.scheduler.plan import Plan
from jaxrl.scheduler.problem import PlanningError, build_problem
from jaxrl.scheduler.replan import Decision, decide

log = logging.getLogger(__name__)

POOL_RESOURCE = "jaxrl-pool-{}"
# With `loop.ray_cluster="ray"` the spec is read from the nodes: each also carries its
# accelerator's catalog key as `jaxrl-accelerator-<key>` (1 unit).
ACCELERATOR_RESOURCE = "jaxrl-accelerator-{}"


def pool_resource(pool: str) -> str:
  """The custom resource the nodes of `pool` carry (one unit per accelerator)."""
  return POOL_RESOURCE.format(pool)


@dataclasses.dataclass(frozen=True)
class PoolNodes:
  """The alive Ray nodes of one pool: each node's units of the pool resource, and whether the
  nodes report GPUs or TPUs to Ray (then a process also asks for those)."""

  units: tuple[int, ...]
  device_resource: str | None  # "GPU", "TPU" or None
  accelerators: frozenset[str] = frozenset()  # catalog keys its nodes name, if any


def ray_pools(nodes: Sequence[Mapping[str, Any]]) -> dict[str, PoolNodes]:
  """The pools the Ray cluster's alive nodes (`ray.nodes()`) carry resources of."""
  prefix, accel = POOL_RESOURCE.format(""), ACCELERATOR_RESOURCE.format("")
  found: dict[str, list[tuple[int, str | None, frozenset[str]]]] = {}
  for node in nodes:
    if not node.get("Alive", False):
      continue
    resources = node.get("Resources", {})
    device = next((k for k in ("GPU", "TPU") if resources.get(k, 0) > 0), None)
    types = frozenset(k[len(accel) :] for k in resources if k.startswith(accel))
    for key, amount in resources.items():
      if key.startswith(prefix):
        found.setdefault(key[len(prefix) :], []).append((int(amount), device, types))
  return {
    pool: PoolNodes(
      tuple(u for u, _, _ in entries), entries[0][1], frozenset().union(*(t for *_, t in entries))
    )
    for pool, entries in found.items()
  }


def cluster_from_ray(pools: Mapping[str, PoolNodes]) -> Cluster:
  """The cluster spec the Ray cluster's nodes describe (`loop.ray_cluster="ray"`): a pool per
  `jaxrl-pool-<name>` resource, its accelerator from the nodes' `jaxrl-accelerator-<key>`, its
  nodes as many as carry it, each with the fewest units any of them has."""
  specs, problems = [], []
  for name, nodes in sorted(pools.items()):
    if len(nodes.accelerators) != 1:
      problems.append(
        f"pool {name!r}: its nodes name {sorted(nodes.accelerators) or 'no'} accelerator(s); "
        f"each must carry exactly one {ACCELERATOR_RESOURCE.format('<catalog key>')!r}"
      )
      continue
    (accelerator,) = nodes.accelerators
    specs.append(Pool(name, accelerator, nodes=len(nodes.units), devices_per_node=min(nodes.units)))
  if not specs and not problems:
    problems.append(f"no node carries a {POOL_RESOURCE.format('<pool>')!r} resource")
  if problems:
    raise ConfigError(
      "config.loop.ray_cluster='ray': the Ray cluster's nodes do not describe its pools: "
      + "; ".join(problems)
      + ". Start each node with both, e.g. ray start --address=HEAD:6379 --resources='"
      + '{"jaxrl-pool-h100": 8, "jaxrl-accelerator-H100": 1}\'.'
    )
  try:
    return Cluster("ray", tuple(specs))
  except ValueError as e:  # an accelerator the catalog does not know
    raise ConfigError(f"config.loop.ray_cluster='ray': {e}") from None


def check_cluster(cluster: Cluster, pools: Mapping[str, PoolNodes]) -> None:
  """Raises a ConfigError naming every pool of the spec the Ray cluster does not have (or has
  fewer or smaller nodes of) and how to start a node of it."""
  problems = []
  for p in cluster.pools:
    if p.nodes == 0:
      continue
    have = pools.get(p.name)
    fitting = [u for u in (have.units if have else ()) if u >= p.devices_per_node]
    if len(fitting) < p.nodes:
      problems.append(
        f"pool {p.name!r} wants {p.nodes} node(s) of {p.devices_per_node} {p.accelerator}; "
        f"the Ray cluster has {len(fitting)} (nodes carrying {pool_resource(p.name)!r} "
        f"units: {list(have.units) if have else []})"
      )
  if problems:
    example = cluster.pools[0]
    raise ConfigError(
      f"config.loop.ray_cluster: the Ray cluster does not hold the cluster spec "
      f"{cluster.name!r}: " + "; ".join(problems) + ". Start each node of a pool with its "
      f"resource, e.g. ray start --address=HEAD:6379 --resources='"
      f'{{"{pool_resource(example.name)}": {example.devices_per_node}}}'
      f"' (pools found: {sorted(pools)})."
    )


@dataclasses.dataclass(frozen=True)
class ProcessSlot:
  """Where one actor process runs: Ray actor options (resources of its pool), how many devices
  it holds, and the mesh axes it builds over them (or its share of them, in a gang). A rollout
  instance's slot stands for its `processes` processes (`rollout.num_processes`), each placed
  with these options and holding `devices` devices; the learner has a slot per process."""

  pool: str
  devices: int
  actor_options: dict[str, Any]
  mesh: dict[str, int]
  processes: int = 1


@dataclasses.dataclass(frozen=True)
class RayPlacement:
  """The plan as Ray placement: the learner's gang (one slot per process, all with the whole
  training mesh's axes) and one slot per rollout instance."""

  plan: Plan
  learner: tuple[ProcessSlot, ...]
  rollout: tuple[ProcessSlot, ...]
  cluster: Cluster | None = None  # the cluster it was planned for

  @property
  def train_mesh(self) -> dict[str, int]:
    return dict(self.plan.train.mesh)


def _options(pool: str, devices: int, pools: Mapping[str, PoolNodes]) -> dict[str, Any]:
  options: dict[str, Any] = {"num_cpus": 0, "resources": {pool_resource(pool): devices}}
  device = pools[pool].device_resource if pool in pools else None
  if device == "GPU":
    options["num_gpus"] = devices
  elif device == "TPU":
    options["resources"]["TPU"] = devices
  return options


def plan_placement(
  plan: Plan, num_processes: int, pools: Mapping[str, PoolNodes], rollout_processes: int = 1
) -> RayPlacement:
  """The learner's `num_processes` processes on the training pools (each with an equal share
  of the plan's training devices, filling pools in the plan's order) and one slot per rollout
  instance of each rollout stage, of `rollout_processes` processes (`rollout.num_processes`)
  with an equal share of the instance's devices each."""
  train = plan.train
  if train.devices % num_processes:
    raise ConfigError(
      f"config.train.num_processes={num_processes}: the plan trains on {train.devices} "
      f"devices, which {num_processes} processes cannot hold equally; use a divisor."
    )
  per_process = train.devices // num_processes
  learner = []
  for pool, devices in train.pools.items():
    if devices % per_process:
      raise ConfigError(
        f"config.train.num_processes={num_processes}: the plan takes {devices} training "
        f"devices from pool {pool!r}, not a multiple of {per_process} per process; use fewer "
        f"processes."
      )
    learner += [
      ProcessSlot(pool, per_process, _options(pool, per_process, pools), dict(train.mesh))
    ] * (devices // per_process)
  rollout = []
  for stage in plan.rollout:
    size = stage.mesh.get("tensor", 1)
    if size % rollout_processes:
      raise ConfigError(
        f"config.rollout.num_processes={rollout_processes}: the plan's rollout instances on "
        f"pool {stage.pool!r} have {size} devices (mesh {stage.mesh}), which "
        f"{rollout_processes} processes cannot hold equally; use a divisor of {size}."
      )
    share = size // rollout_processes
    options = _options(stage.pool, share, pools)
    mesh = {"data": 1, **stage.mesh}
    slot = ProcessSlot(stage.pool, share, options, mesh, processes=rollout_processes)
    rollout += [slot] * stage.instances
  return RayPlacement(plan, tuple(learner), tuple(rollout))


def placement_for_job(cfg: ExperimentConfig, prompt_len: int, nodes) -> RayPlacement:
  """`config.loop.ray_cluster`'s spec checked against the Ray cluster's alive `nodes`
  (`ray.nodes()`), planned for the job's step, as Ray placement (logged)."""
  pools = ray_pools(nodes)
  if cfg.loop.ray_cluster == "ray":
    cluster = cluster_from_ray(pools)
  else:
    path, _, arg = cfg.loop.ray_cluster.partition(":")
    try:
      cluster = load_cluster(path, arg or None)
    except (OSError, ValueError) as e:
      raise ConfigError(f"config.loop.ray_cluster={cfg.loop.ray_cluster!r}: {e}") from None
  check_cluster(cluster, pools)
  plan = plan_for_experiment(cfg, prompt_len, cluster=cluster)
  placement = dataclasses.replace(
    plan_placement(plan, cfg.train.num_processes, pools, cfg.rollout.num_processes),
    cluster=cluster,
  )
  log.info(
    "Plan for Ray cluster %s: learner %d process(es) on %s (mesh %s); rollout %s.",
    cluster.name,
    len(placement.learner),
    sorted({s.pool for s in placement.learner}),
    placement.train_mesh,
    ", ".join(f"{r.instances} x {r.mesh} on {r.pool}" for r in plan.rollout),
  )
  return placement


def cluster_now(planned: Cluster, pools: Mapping[str, PoolNodes]) -> Cluster:
  """`planned` with each pool's node count as the Ray cluster's alive nodes have it now (nodes
  too small for the pool's node size not counted)."""

  def nodes(p: Pool) -> int:
    units = pools[p.name].units if p.name in pools else ()
    return sum(1 for u in units if u >= p.devices_per_node)

  return dataclasses.replace(
    planned, pools=tuple(dataclasses.replace(p, nodes=nodes(p)) for p in planned.pools)
  )


def replan_placement(
  cfg: ExperimentConfig, prompt_len: int, current: RayPlacement, nodes
) -> tuple[RayPlacement, Decision] | None:
  """After Ray nodes joined or left (`nodes`: `ray.nodes()`): the placement the scheduler's
  re-planning chooses for the cluster as it is now (`scheduler.replan.decide`: a new plan only
  if it repays its reconfiguration, else the current one cut down to the nodes still there),
  with the decision; None while every pool has the nodes it was planned for."""
  pools = ray_pools(nodes)
  cluster = cluster_now(current.cluster, pools)
  if cluster == current.cluster:
    return None
  now = ", ".join(f"{p.name}: {p.nodes} node(s)" for p in cluster.pools)
  try:
    workload = experiment_workload(cfg, prompt_len)
    problem = build_problem(cluster, cfg.model, workload, model_name="experiment")
    decision = decide(problem, current.plan)
  except PlanningError as e:
    raise RuntimeError(
      f"The Ray cluster changed ({now}) and no plan runs on what is left: {e} Start nodes of the "
      f"lost pools (each with its {POOL_RESOURCE.format('<pool>')!r} resource) and resume the "
      "run from its last checkpoint with --config.resume=True."
    ) from None
  placement = plan_placement(
    decision.plan, cfg.train.num_processes, pools, cfg.rollout.num_processes
  )
  log.warning(
    "Ray cluster changed (%s); re-planned: %s plan, rollout %s (%.0f samples/s kept, %.0f "
    "possible, %.1f s to reconfigure).",
    now,
    "forced" if decision.forced else ("a new" if decision.adopted else "the kept"),
    ", ".join(f"{r.instances} x {r.mesh} on {r.pool}" for r in decision.plan.rollout),
    decision.kept_throughput,
    decision.new_throughput,
    decision.reconfigure_seconds,
  )  # fmt: skip
  return dataclasses.replace(placement, cluster=cluster), decision
