"""Planning problems: the candidate stage configurations a plan is chosen from.

Every pool offers rollout instances (tensor degree x batch size, those that fit, dominated ones
dropped), and every training island (same-type pools joined by fast links, see
`Cluster.training_islands`) offers training meshes of several sizes, each with its fastest mesh
shape. Errors here say what a cluster lacks for a model.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl.model.config import ModelConfig
from jaxrl.scheduler.catalog import GIB
from jaxrl.scheduler.cluster import Cluster
from jaxrl.scheduler.cost import (
  RolloutCost,
  TrainCost,
  Workload,
  mesh_divides,
  rollout_cost,
  train_cost,
  weight_bytes,
  weight_sync_seconds,
)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class PlanningError(ValueError):
  """No plan satisfies the request; the message says what is missing."""


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
  """Planner options.

  Attributes:
    budget_per_hour: upper limit on $/hour; inf for none.
    min_throughput: if > 0, find the cheapest plan reaching this many samples/s instead of
      the fastest plan within budget.
    train_on_preemptible: allow the training mesh on preemptible pools.
    mip_rel_gap: HiGHS relative optimality gap.
  """

  budget_per_hour: float = math.inf
  min_throughput: float = 0.0
  train_on_preemptible: bool = False
  mip_rel_gap: float = 1e-7


@dataclasses.dataclass(frozen=True)
class RolloutOption:
  pool: str
  cost: RolloutCost
  max_instances: int


@dataclasses.dataclass(frozen=True)
class TrainOption:
  island: tuple[str, ...]
  take: tuple[tuple[str, int], ...]  # (pool, devices) taken, in island order
  cost: TrainCost


@dataclasses.dataclass(frozen=True)
class Problem:
  """Everything a plan is chosen from, enumerated once per (cluster, model, workload)."""

  cluster: Cluster
  model: ModelConfig
  model_name: str
  workload: Workload
  rollout: tuple[RolloutOption, ...]
  train: tuple[TrainOption, ...]

  def tail_host_ok(self, index: int) -> bool:
    """Whether rollout option `index` can host a step's longest responses (its batch holds
    `lengths.tail_count` of them: the top 1%, or all that reach the cap)."""
    return self.rollout[index].cost.batch >= self.workload.lengths().tail_count

  def sync_seconds(self, option: TrainOption, pool: str) -> float:
    src = option.island[0]
    bandwidth = (
      self.cluster.bandwidth(src, pool)
      if pool not in option.island
      else (self.cluster.bandwidth(pool, pool))
    )
    return weight_sync_seconds(self.model, bandwidth)


def build_problem(
  cluster: Cluster,
  model: ModelConfig,
  workload: Workload,
  *,
  model_name: str = "model",
  train_on_preemptible: bool = False,
) -> Problem:
  """Enumerates the candidate rollout instances and training meshes; errors if none fits."""
  rollout = []
  for pool in cluster.pools:
    if not pool.devices:
      continue
    acc = cluster.accelerator(pool)
    for tensor in _tensor_degrees(model, pool.devices_per_node):
      costs = [rollout_cost(model, acc, tensor, b, workload) for b in BATCH_SIZES]
      costs = [c for c in costs if c is not None]
      # Drop options another batch size beats on rate and both tail latencies, unless only
      # this one can host a step's longest responses.
      hold = workload.lengths().tail_count
      kept = [c for c in costs if not any(o is not c and _beats(o, c, hold) for o in costs)]
      rollout += [RolloutOption(pool.name, c, pool.devices // tensor) for c in kept]
  if not rollout:
    raise PlanningError(_no_fit_message(cluster, model, "rollout"))

  train = []
  for island in cluster.training_islands():
    pools = [cluster.pool(n) for n in island]
    if not train_on_preemptible and any(p.preemptible for p in pools):
      continue
    total = sum(p.devices for p in pools)
    per_node = pools[0].devices_per_node
    network = min(p.inter_node_GBps for p in pools) * 1e9
    acc = cluster.accelerator(pools[0])
    for devices in _train_sizes(total, per_node):
      cost = train_cost(model, acc, devices, per_node, network, workload)
      if cost is None:
        continue
      take, left = [], devices
      for p in pools:
        n = min(left, p.devices)
        if n:
          take.append((p.name, n))
        left -= n
      train.append(TrainOption(island, tuple(take), cost))
  if not train:
    what = "on-demand " if not train_on_preemptible else ""
    raise PlanningError(_no_fit_message(cluster, model, f"training ({what}pools)"))
  return Problem(cluster, model, model_name, workload, tuple(rollout), tuple(train))


def _beats(o: RolloutCost, c: RolloutCost, hold: int) -> bool:
  return (
    o.samples_per_s >= c.samples_per_s
    and o.tail_seconds <= c.tail_seconds
    and o.bulk_tail_seconds <= c.bulk_tail_seconds
    and (o.batch >= hold or c.batch < hold)
  )


def _tensor_degrees(model: ModelConfig, devices_per_node: int) -> list[int]:
  """Tensor-parallel degrees of a rollout instance: inside one node, dividing the sharded
  dimensions (heads, KV heads, MLP, vocab) as the rollout rules require."""
  out, t = [], 1
  while t <= devices_per_node and mesh_divides(model, Workload(), 1, t, 1):
    out.append(t)
    t *= 2
  return out


def _train_sizes(total: int, per_node: int) -> list[int]:
  """Device counts a training mesh may have: any count inside one node, then whole nodes in
  steps of about 1.5x, and the whole island."""
  sizes = set(range(1, min(total, per_node) + 1))
  nodes = total // per_node
  k = 1
  while k <= nodes:
    sizes.add(k * per_node)
    sizes.add(min(nodes, (3 * k + 1) // 2) * per_node)
    k *= 2
  sizes.add(nodes * per_node if nodes else total)
  return sorted(s for s in sizes if 0 < s <= total)


def _no_fit_message(cluster: Cluster, model: ModelConfig, stage: str) -> str:
  biggest = max(cluster.pools, key=lambda p: cluster.accelerator(p).memory_bytes)
  acc = cluster.accelerator(biggest)
  return (
    f"the model ({model.num_params() / 1e9:.3g}B parameters, "
    f"{weight_bytes(model) / GIB:.3g} GiB of weights) fits no {stage} configuration on cluster "
    f"{cluster.name}: its largest device ({biggest.accelerator}, "
    f"{acc.memory_bytes / GIB:.0f} GiB, {biggest.devices_per_node} per node) cannot hold the "
    f"weights plus KV cache (rollout) or ~16 bytes/parameter of training state plus "
    f"activations (training) with the parallelism a pool allows. Use a smaller model or "
    f"response cap, or add pools with more or larger devices."
  )
