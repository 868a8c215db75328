"""Re-planning when a pool changes: adopt a new plan only when it pays for its own disruption.

On an event (a preemptible pool grows, shrinks or is reclaimed) the current plan is first cut
down to what still exists (rollout instances on lost devices are dropped). If the training
mesh lost devices the job must re-plan. Otherwise the best plan for the new cluster is adopted
only if the samples it gains per second repay the samples lost while reconfiguring (weights
sent to new rollout devices, KV caches rebuilt, training state re-sharded) within `window_s`.
"""

from __future__ import annotations

import dataclasses

from jaxrl.scheduler.cost import TRAIN_STATE_BYTES_PER_PARAM, prefill_seconds, weight_bytes
from jaxrl.scheduler.plan import Plan
from jaxrl.scheduler.planner import PlannerConfig, PlanningError, Problem, evaluate, plan


@dataclasses.dataclass(frozen=True)
class PoolEvent:
  """Pool `pool` now has `nodes` machines (reclaims come `notice_s` seconds ahead)."""

  time_s: float
  pool: str
  nodes: int
  notice_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
  """What to run after an event.

  Attributes:
    plan: the plan to run from now on (the new one if adopted, else the kept one).
    adopted: the new plan was adopted.
    forced: the kept plan could not run (its training mesh lost devices).
    kept_throughput: samples/s of the current plan cut down to the new cluster (0 if forced).
    new_throughput: samples/s of the best plan for the new cluster.
    reconfigure_seconds: pipeline stall to switch plans.
    payback_seconds: stall x kept throughput / gain (inf when the new plan gains nothing).
  """

  plan: Plan
  adopted: bool
  forced: bool
  kept_throughput: float
  new_throughput: float
  reconfigure_seconds: float
  payback_seconds: float


def keep_plan(problem: Problem, current: Plan) -> Plan | None:
  """`current` on `problem`'s cluster: rollout instances that lost their devices dropped.

  None if the training mesh or every rollout instance is gone.
  """
  train = next(
    (
      t
      for t in problem.train
      if dict(t.take) == current.train.pools and t.cost.mesh == current.train.mesh
    ),
    None,
  )
  if train is None:
    return None
  free = {p.name: p.devices for p in problem.cluster.pools}
  for p, n in train.take:
    free[p] -= n
  counts = {}
  for stage in current.rollout:
    index = next(
      (
        i
        for i, o in enumerate(problem.rollout)
        if o.pool == stage.pool
        and o.cost.tensor == stage.mesh["tensor"]
        and o.cost.batch == stage.batch_size
      ),
      None,
    )
    if index is None or stage.pool not in free:
      continue
    n = min(stage.instances, max(free[stage.pool], 0) // stage.mesh["tensor"])
    if n:
      counts[index] = counts.get(index, 0) + n
      free[stage.pool] -= n * stage.mesh["tensor"]
  if not counts:
    return None
  return evaluate(problem, train, counts)


def reconfigure_seconds(problem: Problem, old: Plan, new: Plan) -> float:
  """Stall to move from `old` to `new`: weights to added rollout devices (pools in parallel),
  KV caches of changed instances rebuilt by re-prefill, training state re-sharded."""
  cluster, model, w = problem.cluster, problem.model, problem.workload
  src = next(iter(new.train.pools))
  weights = 0.0
  for stage in new.rollout:
    before = sum(r.devices for r in old.rollout if r.pool == stage.pool and r.mesh == stage.mesh)
    if stage.devices > before:
      weights = max(weights, weight_bytes(model) / cluster.bandwidth(src, stage.pool))
  caches = 0.0
  lengths = w.lengths()
  for stage in new.rollout:
    same = [r for r in old.rollout if r.pool == stage.pool and r.mesh == stage.mesh]
    if not same or same[0].batch_size != stage.batch_size or same[0].instances != stage.instances:
      acc = cluster.accelerator(cluster.pool(stage.pool))
      context = w.prompt_len + lengths.mean_position
      rebuild = stage.batch_size * prefill_seconds(model, acc, stage.mesh["tensor"], context)
      caches = max(caches, rebuild)
  train = 0.0
  if (old.train.pools, old.train.mesh) != (new.train.pools, new.train.mesh):
    pool = cluster.pool(src)
    state = TRAIN_STATE_BYTES_PER_PARAM * model.num_params()
    train = state / (new.train.devices * pool.inter_node_GBps * 1e9)
  return weights + caches + train


def decide(
  problem: Problem, current: Plan, config: PlannerConfig | None = None, window_s: float = 600
) -> Decision:
  """Re-plans `current` for `problem` (the cluster after an event)."""
  config = config or PlannerConfig()
  kept = keep_plan(problem, current)
  try:
    best = plan(problem, config)
  except PlanningError:
    if kept is None:
      raise
    best = kept
  if kept is None:
    stall = reconfigure_seconds(problem, current, best)
    return Decision(best, True, True, 0.0, best.throughput_samples_per_s, stall, 0.0)
  gain = best.throughput_samples_per_s - kept.throughput_samples_per_s
  stall = reconfigure_seconds(problem, kept, best)
  payback = kept.throughput_samples_per_s * stall / gain if gain > 0 else float("inf")
  adopt = gain > 0 and payback <= window_s
  return Decision(
    plan=best if adopt else kept,
    adopted=adopt,
    forced=False,
    kept_throughput=kept.throughput_samples_per_s,
    new_throughput=best.throughput_samples_per_s,
    reconfigure_seconds=stall,
    payback_seconds=payback,
  )
