"""The planner: the best plan for a problem, and the cost model's verdict on any plan.

`plan` solves the MILP of `milp.py` over the candidates of `problem.py`; `evaluate` scores a
(training option, rollout instance counts) pair with the cost model, and is what both the
planner's result and the exhaustive check in the tests are measured with. `plan_colocated`
gives the colocated baseline (both stages on the same devices, in turn).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from jaxrl.scheduler.catalog import GIB
from jaxrl.scheduler.cost import rollout_cost, weight_sync_seconds
from jaxrl.scheduler.milp import PlanMilp
from jaxrl.scheduler.plan import Plan, RolloutStage, TrainStage
from jaxrl.scheduler.problem import (
  PlannerConfig,
  PlanningError,
  Problem,
  RolloutOption,
  TrainOption,
  build_problem,
)

__all__ = [
  "PlannerConfig",
  "PlanningError",
  "Problem",
  "RolloutOption",
  "TrainOption",
  "build_problem",
  "evaluate",
  "exhaustive_best",
  "plan",
  "plan_colocated",
  "plan_cost_per_hour",
]


def plan(problem: Problem, config: PlannerConfig | None = None) -> Plan:
  """The best plan: max throughput within budget, or min cost for `config.min_throughput`."""
  config = config or PlannerConfig()
  start = time.perf_counter()
  _check_budget(problem, config)
  lp = PlanMilp(problem, config)
  counts, train_index = lp.solve()
  out = evaluate(problem, problem.train[train_index], counts)
  if config.min_throughput > 0 and out.throughput_samples_per_s < config.min_throughput * (
    1 - 1e-6
  ):
    raise PlanningError(
      f"no plan reaches {config.min_throughput:.4g} samples/s on {problem.cluster.name} "
      f"within ${config.budget_per_hour:.4g}/h; the best reaches "
      f"{out.throughput_samples_per_s:.4g} samples/s."
    )
  return dataclasses.replace(out, solve_seconds=time.perf_counter() - start)


def evaluate(problem: Problem, train: TrainOption, counts: dict[int, int]) -> Plan:
  """The cost model's prediction for one training option and rollout instance counts.

  `counts` maps an index into `problem.rollout` to its number of instances. The planner and
  the exhaustive check both score plans with this function.
  """
  w, cluster = problem.workload, problem.cluster
  s = w.samples_per_step
  used = {i: n for i, n in counts.items() if n > 0}
  if not used:
    raise PlanningError("a plan needs at least one rollout instance.")
  rate = sum(problem.rollout[i].cost.samples_per_s * n for i, n in used.items())
  # Skew-aware dispatch gives a step's longest responses to the instance option that finishes
  # them first (among those whose batch holds them all); every other instance still has to
  # finish the longest of the rest.
  hosts = [i for i in used if problem.tail_host_ok(i)]
  if not hosts:
    raise PlanningError(
      f"no rollout instance of this plan can hold a step's {w.lengths().tail_count} longest "
      f"responses at once; use larger batches."
    )
  tail = max(
    min(problem.rollout[i].cost.tail_seconds for i in hosts),
    max(problem.rollout[i].cost.bulk_tail_seconds for i in used),
  )
  pools = {problem.rollout[i].pool for i in used}
  sync = max(problem.sync_seconds(train, p) for p in pools)
  terms = {
    "rollout": s / rate,
    "rollout_tail": tail,
    "train": train.cost.step_seconds,
    "weight_sync": sync,
  }
  if w.max_staleness == 0:
    roll = max(terms["rollout"], terms["rollout_tail"])
    cycle = roll + terms["train"] + sync
    bottleneck = max(
      ("rollout" if terms["rollout"] >= tail else "rollout_tail", roll),
      ("train", terms["train"]),
      ("weight_sync", sync),
      key=lambda kv: kv[1],
    )[0]
  else:
    # A sample started under version v must be trained by the step after v + eta: at most
    # eta cycles to finish its longest response.
    terms["rollout_tail"] = tail / w.max_staleness
    bottleneck, cycle = max(terms.items(), key=lambda kv: kv[1])
  devices: dict[str, int] = dict(train.take)
  price = sum(cluster.price(cluster.pool(p)) * n for p, n in train.take)
  stages = []
  for i, n in sorted(used.items()):
    opt = problem.rollout[i]
    pool = cluster.pool(opt.pool)
    devices[opt.pool] = devices.get(opt.pool, 0) + n * opt.cost.tensor
    price += cluster.price(pool) * n * opt.cost.tensor
    stages.append(_rollout_stage(problem, opt, n))
  for p, n in devices.items():
    if n > cluster.pool(p).devices:
      raise PlanningError(
        f"plan uses {n} devices of pool {p}, which has {cluster.pool(p).devices}."
      )
  train_pool = cluster.pool(train.island[0])
  return Plan(
    cluster=cluster.name,
    model=problem.model_name,
    mode="sync" if w.max_staleness == 0 else "async",
    max_staleness=w.max_staleness,
    samples_per_step=s,
    train=TrainStage(
      pools=dict(train.take),
      accelerator=train_pool.accelerator,
      devices=train.cost.devices,
      mesh=dict(train.cost.mesh),
      step_seconds=train.cost.step_seconds,
      memory_per_device_gib=train.cost.memory_bytes / GIB,
    ),
    rollout=tuple(stages),
    cycle_seconds=cycle,
    throughput_samples_per_s=s / cycle,
    cost_per_hour=price,
    stage_seconds=terms,
    bottleneck=bottleneck,
    devices_used=devices,
  )


def plan_colocated(problem: Problem) -> Plan:
  """The best colocated plan: the training mesh's devices alternate between rollout (as
  identical instances) and training, with a local weight reshard in between."""
  if problem.workload.max_staleness:  # colocated stages alternate: synchronous by nature
    sync = dataclasses.replace(problem.workload, max_staleness=0)
    problem = dataclasses.replace(
      problem,
      workload=sync,
      rollout=tuple(
        dataclasses.replace(
          o,
          cost=rollout_cost(
            problem.model,
            problem.cluster.accelerator(problem.cluster.pool(o.pool)),
            o.cost.tensor,
            o.cost.batch,
            sync,
          ),
        )
        for o in problem.rollout
      ),
    )
  cluster, w = problem.cluster, problem.workload
  s = w.samples_per_step
  best = None
  for train in problem.train:
    pools = [cluster.pool(p) for p in train.island]
    for opt in problem.rollout:
      if opt.pool != train.island[0] or train.cost.devices % opt.cost.tensor:
        continue
      instances = train.cost.devices // opt.cost.tensor
      rate = instances * opt.cost.samples_per_s
      acc = cluster.accelerator(pools[0])
      reshard = weight_sync_seconds(problem.model, acc.link_bytes_per_s)
      terms = {
        "rollout": s / rate,
        "rollout_tail": max(opt.cost.tail_seconds, opt.cost.bulk_tail_seconds),
        "train": train.cost.step_seconds,
        "weight_sync": reshard,
      }
      cycle = max(terms["rollout"], terms["rollout_tail"]) + terms["train"] + reshard
      if best is None or cycle < best[0]:
        best = (cycle, train, opt, instances, terms)
  if best is None:
    raise PlanningError(
      f"no training mesh of cluster {cluster.name} can also hold rollout instances; "
      "colocation needs devices where both stages fit."
    )
  cycle, train, opt, instances, terms = best
  price = sum(cluster.price(cluster.pool(p)) * n for p, n in train.take)
  pool = cluster.pool(opt.pool)
  roll = max(terms["rollout"], terms["rollout_tail"])
  return Plan(
    cluster=cluster.name,
    model=problem.model_name,
    mode="colocated",
    max_staleness=0,
    samples_per_step=s,
    train=TrainStage(
      pools=dict(train.take),
      accelerator=pool.accelerator,
      devices=train.cost.devices,
      mesh=dict(train.cost.mesh),
      step_seconds=train.cost.step_seconds,
      memory_per_device_gib=max(train.cost.memory_bytes, opt.cost.memory_bytes) / GIB,
    ),
    rollout=(_rollout_stage(problem, opt, instances),),
    cycle_seconds=cycle,
    throughput_samples_per_s=s / cycle,
    cost_per_hour=price,
    stage_seconds=terms,
    bottleneck=max(
      ("rollout", roll),
      ("train", terms["train"]),
      ("weight_sync", terms["weight_sync"]),
      key=lambda kv: kv[1],
    )[0],
    devices_used=dict(train.take),
  )


def _rollout_stage(problem: Problem, opt: RolloutOption, instances: int) -> RolloutStage:
  return RolloutStage(
    pool=opt.pool,
    accelerator=problem.cluster.pool(opt.pool).accelerator,
    instances=instances,
    mesh={"data": 1, "fsdp": 1, "tensor": opt.cost.tensor, "expert": 1},
    batch_size=opt.cost.batch,
    samples_per_s=instances * opt.cost.samples_per_s,
    step_seconds=opt.cost.step_seconds,
    memory_per_device_gib=opt.cost.memory_bytes / GIB,
  )


def plan_cost_per_hour(problem: Problem, train: TrainOption, counts: dict[int, int]) -> float:
  c = problem.cluster
  price = sum(c.price(c.pool(p)) * n for p, n in train.take)
  for i, n in counts.items():
    opt = problem.rollout[i]
    price += c.price(c.pool(opt.pool)) * n * opt.cost.tensor
  return price


def _check_budget(problem: Problem, config: PlannerConfig) -> None:
  """Budget below the cheapest feasible plan: say what that plan costs."""
  if not math.isfinite(config.budget_per_hour):
    return
  c = problem.cluster
  cheapest_train = min(sum(c.price(c.pool(p)) * n for p, n in o.take) for o in problem.train)
  cheapest_rollout = min(c.price(c.pool(o.pool)) * o.cost.tensor for o in problem.rollout)
  floor = cheapest_train + cheapest_rollout
  if config.budget_per_hour < floor - 1e-9:
    raise PlanningError(
      f"budget ${config.budget_per_hour:.4g}/h is below the cheapest feasible plan on "
      f"{c.name}: at least ${cheapest_train:.4g}/h for the smallest training mesh that fits "
      f"plus ${cheapest_rollout:.4g}/h for one rollout instance = ${floor:.4g}/h."
    )


def exhaustive_best(problem: Problem, budget_per_hour: float = math.inf) -> Plan:
  """The best plan by trying every combination (tests only: exponential)."""
  best = None
  opts = problem.rollout
  for train in problem.train:
    free = {p.name: p.devices for p in problem.cluster.pools}
    for p, n in train.take:
      free[p] -= n
    for counts in _all_counts(opts, free):
      if not counts:
        continue
      if plan_cost_per_hour(problem, train, counts) > budget_per_hour + 1e-9:
        continue
      try:
        cand = evaluate(problem, train, counts)
      except PlanningError:  # no instance can host the tail
        continue
      if best is None or cand.throughput_samples_per_s > best.throughput_samples_per_s:
        best = cand
  if best is None:
    raise PlanningError("no feasible plan")
  return best


def _all_counts(opts: Sequence[RolloutOption], free: dict[str, int]):
  def rec(i, free, counts):
    if i == len(opts):
      yield dict(counts)
      return
    o = opts[i]
    for n in range(free[o.pool] // o.cost.tensor + 1):
      if n:
        counts[i] = n
      left = dict(free)
      left[o.pool] -= n * o.cost.tensor
      yield from rec(i + 1, left, counts)
      counts.pop(i, None)

  yield from rec(0, free, {})
