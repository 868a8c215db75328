"""The planner: a MILP over enumerated per-pool stage configurations.

Candidates: every pool offers rollout instances (tensor degree x batch size, those that fit,
dominated ones dropped), and every training island (same-type pools joined by fast links, see
`Cluster.training_islands`) offers training meshes of several sizes, each with its fastest mesh
shape. The MILP picks one training option and an integer count of every rollout option.

Asynchronous plans (staleness >= 1) are linear in the throughput X: X is bounded by the rollout
rate (sum of instance rates), by the training rate, by the weight-sync rate and by the tail
latency of the instance that hosts the longest responses, spread over the staleness window.
Synchronous plans minimise the cycle time C = max(S / rollout rate, tail) + train + sync; the
convex term S / rate is kept exact by adding tangent cuts until the solution's cut is tight
(Kelley's method).
A second solve takes the cheapest plan within 1e-6 of the best throughput.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

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
from jaxrl.scheduler.plan import Plan, RolloutStage, TrainStage

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
    """Whether rollout option `index` can host the longest responses (top 1% of a step)."""
    return self.rollout[index].cost.batch >= math.ceil(self.workload.samples_per_step / 100)

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
      # Drop options another batch size beats on both rate and tail latency.
      kept = [
        c
        for c in costs
        if not any(
          o is not c and o.samples_per_s >= c.samples_per_s and o.tail_seconds <= c.tail_seconds
          for o in costs
        )
      ]
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


def plan(problem: Problem, config: PlannerConfig | None = None) -> Plan:
  """The best plan: max throughput within budget, or min cost for `config.min_throughput`."""
  config = config or PlannerConfig()
  start = time.perf_counter()
  _check_budget(problem, config)
  lp = _Milp(problem, config)
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
  # Skew-aware dispatch gives the longest responses to the instances that finish them first
  # (among those whose batch holds a step's top 1%).
  hosts = [i for i in used if problem.tail_host_ok(i)]
  if not hosts:
    raise PlanningError(
      f"no rollout instance of this plan can hold a step's longest 1% of responses "
      f"(batch >= {math.ceil(s / 100)}); use larger batches."
    )
  tail = min(problem.rollout[i].cost.tail_seconds for i in hosts)
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
    terms["rollout_tail"] = tail / (w.max_staleness + 1)
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
        "rollout_tail": opt.cost.tail_seconds,
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


class _Milp:
  """Variables: n_c (instances of rollout option c), u_c (c used), v_p (pool p hosts
  rollout), y_t (training option t chosen), z_c (c hosts the longest responses), then X
  (async) or C, R, F, T (sync)."""

  def __init__(self, problem: Problem, config: PlannerConfig):
    self.p, self.cfg = problem, config
    self.nr, self.nt = len(problem.rollout), len(problem.train)
    self.pools = sorted({o.pool for o in problem.rollout})
    self.islands = sorted({t.island for t in problem.train})
    self.sync = problem.workload.max_staleness == 0
    names = ["n"] * self.nr + ["u"] * self.nr + ["v"] * len(self.pools) + ["y"] * self.nt
    names += ["z"] * self.nr
    names += ["C", "R", "F", "T"] if self.sync else ["X"]
    self.names = names
    self.base = 3 * self.nr + len(self.pools) + self.nt  # first continuous variable
    self.rows: list[tuple[dict[int, float], float, float]] = []
    self.cuts: list[float] = []
    self._common()

  # Variable indices.
  def n(self, c):
    return c

  def u(self, c):
    return self.nr + c

  def v(self, p):
    return 2 * self.nr + p

  def y(self, t):
    return 2 * self.nr + len(self.pools) + t

  def z(self, c):
    return 2 * self.nr + len(self.pools) + self.nt + c

  def var(self, name):
    return self.base + {"X": 0, "C": 0, "R": 1, "F": 2, "T": 3}[name]

  def _row(self, coeffs, lb=-np.inf, ub=np.inf):
    self.rows.append((coeffs, lb, ub))

  def _price(self):
    c = self.p.cluster
    coeffs = {}
    for i, o in enumerate(self.p.rollout):
      coeffs[self.n(i)] = c.price(c.pool(o.pool)) * o.cost.tensor
    for t, o in enumerate(self.p.train):
      coeffs[self.y(t)] = sum(c.price(c.pool(p)) * n for p, n in o.take)
    return coeffs

  def _common(self):
    p, pools = self.p, self.pools
    self._row({self.y(t): 1 for t in range(self.nt)}, 1, 1)
    self._row({self.n(i): 1 for i in range(self.nr)}, 1)
    for i, o in enumerate(p.rollout):
      self._row({self.n(i): 1, self.u(i): -o.max_instances}, ub=0)
      self._row({self.n(i): 1, self.u(i): -1}, lb=0)  # used means at least one instance
      self._row({self.u(i): 1, self.v(pools.index(o.pool)): -1}, ub=0)
      self._row({self.z(i): 1, self.u(i): -1}, ub=0)
    # One instance option is the tail host: skew-aware dispatch sends it the longest responses,
    # so its batch must hold the step's top 1% of them at once.
    self._row({self.z(i): 1 for i in range(self.nr)}, 1, 1)
    for i in range(self.nr):
      if not p.tail_host_ok(i):
        self._row({self.z(i): 1}, ub=0)
    for k, name in enumerate(pools):
      coeffs = {self.v(k): 0.0}
      for i, o in enumerate(p.rollout):
        if o.pool == name:
          coeffs[self.n(i)] = o.cost.tensor
      for t, o in enumerate(p.train):
        taken = dict(o.take).get(name, 0)
        if taken:
          coeffs[self.y(t)] = taken
      self._row(coeffs, ub=p.cluster.pool(name).devices)
    if math.isfinite(self.cfg.budget_per_hour):
      self._row(self._price(), ub=self.cfg.budget_per_hour)
    w = p.workload
    s = w.samples_per_step
    # Weight sync from the training island to every pool rollout uses.
    sync_rows = []
    for island in self.islands:
      ts = [t for t, o in enumerate(p.train) if o.island == island]
      for k, name in enumerate(pools):
        seconds = p.sync_seconds(p.train[ts[0]], name)
        sync_rows.append((ts, k, seconds))
    rates = [o.cost.samples_per_s for o in p.rollout]
    if not self.sync:
      x, eta = self.var("X"), w.max_staleness
      self.big = max(s / o.cost.step_seconds for o in p.train)
      self._row({x: 1, **{self.n(i): -r for i, r in enumerate(rates)}}, ub=0)
      self._row(
        {x: 1, **{self.y(t): -s / o.cost.step_seconds for t, o in enumerate(p.train)}}, ub=0
      )
      caps = [min(self.big, s * (eta + 1) / o.cost.tail_seconds) for o in p.rollout]
      self._row({x: 1, **{self.z(i): self.big - c for i, c in enumerate(caps)}}, ub=self.big)
      for ts, k, seconds in sync_rows:
        cap = s / seconds
        if cap < self.big:  # X <= cap + big * (2 - y_island - v_k)
          coeffs = {x: 1, self.v(k): self.big - cap, **{self.y(t): self.big - cap for t in ts}}
          self._row(coeffs, ub=2 * self.big - cap)
    else:
      cv, rv, fv, tv = (self.var(k) for k in "CRFT")
      train_s = {self.y(t): -o.cost.step_seconds for t, o in enumerate(p.train)}
      self._row({cv: 1, rv: -1, tv: -1, **train_s}, lb=0)
      self._row({rv: 1, fv: -1}, lb=0)
      self._row({rv: 1, **{self.z(i): -o.cost.tail_seconds for i, o in enumerate(p.rollout)}}, lb=0)
      for ts, k, seconds in sync_rows:  # T >= seconds * (y_island + v_k - 1)
        self._row({tv: 1, self.v(k): -seconds, **{self.y(t): -seconds for t in ts}}, lb=-seconds)
      self.rates = rates
      top = sum(r * o.max_instances for r, o in zip(rates, p.rollout, strict=True))
      low = min(rates)
      for q0 in np.geomspace(low, top, max(2, int(math.log(top / low) / math.log(1.5)) + 2)):
        self._add_cut(q0)

  def _add_cut(self, q0: float):
    # F >= S / Q, outer-approximated by its tangent at Q = q0: F >= 2S/q0 - S Q / q0^2.
    s = self.p.workload.samples_per_step
    coeffs = {self.var("F"): 1, **{self.n(i): s * r / q0**2 for i, r in enumerate(self.rates)}}
    self._row(coeffs, lb=2 * s / q0)
    self.cuts.append(q0)

  def _milp(self, objective: dict[int, float], extra_rows=()):
    nv = len(self.names)
    rows = self.rows + list(extra_rows)
    r, c, d = [], [], []
    for k, (coeffs, _, _) in enumerate(rows):
      for j, val in coeffs.items():
        r.append(k)
        c.append(j)
        d.append(val)
    a = coo_array((d, (r, c)), shape=(len(rows), nv)).tocsr()
    lb = np.array([row[1] for row in rows])
    ub = np.array([row[2] for row in rows])
    cost = np.zeros(nv)
    for j, val in objective.items():
      cost[j] = val
    integrality = np.array([1 if name in "nuvyz" else 0 for name in self.names])
    upper = np.full(nv, np.inf)
    upper[: self.nr] = [o.max_instances for o in self.p.rollout]
    upper[self.nr : self.base] = 1
    res = milp(
      cost,
      constraints=LinearConstraint(a, lb, ub),
      integrality=integrality,
      bounds=Bounds(np.zeros(nv), upper),
      options={"mip_rel_gap": self.cfg.mip_rel_gap, "presolve": True},
    )
    if res.x is None:
      return None
    return res.x

  def _decode(self, x):
    counts = {i: int(round(x[self.n(i)])) for i in range(self.nr) if round(x[self.n(i)]) > 0}
    train = int(np.argmax(x[self.y(0) : self.y(0) + self.nt]))
    return counts, train

  def _solve_with_cuts(self, objective, extra_rows=()):
    """Sync plans: re-solve with a new tangent until S / rate is represented exactly."""
    for _ in range(200):
      x = self._milp(objective, extra_rows)
      if x is None or not self.sync:
        return x
      q = sum(self.rates[i] * x[self.n(i)] for i in range(self.nr))
      s = self.p.workload.samples_per_step
      if s / q <= x[self.var("F")] * (1 + 1e-9) + 1e-12:
        return x
      self._add_cut(q)
    return x

  def solve(self) -> tuple[dict[int, int], int]:
    price = self._price()
    if self.cfg.min_throughput > 0:
      s = self.p.workload.samples_per_step
      if self.sync:
        need = [({self.var("C"): 1}, -np.inf, s / self.cfg.min_throughput)]
      else:
        need = [({self.var("X"): 1}, self.cfg.min_throughput, np.inf)]
      x = self._solve_with_cuts(price, need)
      if x is None:
        raise PlanningError(self._unreachable())
      return self._decode(x)
    key = self.var("C") if self.sync else self.var("X")
    sign = 1.0 if self.sync else -1.0
    x = self._solve_with_cuts({key: sign})
    if x is None:
      raise PlanningError(self._unreachable())
    best = x[key]
    # Second pass: the cheapest plan that keeps the best throughput (to solver precision).
    slack = 1e-6 * abs(best) + 1e-12
    keep = ({key: 1}, -np.inf, best + slack) if self.sync else ({key: 1}, best - slack, np.inf)
    y = self._solve_with_cuts(price, [keep])
    return self._decode(y if y is not None else x)

  def _unreachable(self) -> str:
    cfg = self.cfg
    what = []
    if math.isfinite(cfg.budget_per_hour):
      what.append(f"a budget of ${cfg.budget_per_hour:.4g}/h")
    if cfg.min_throughput > 0:
      what.append(f"{cfg.min_throughput:.4g} samples/s")
    return (
      f"no plan on cluster {self.p.cluster.name} meets {' and '.join(what) or 'the request'}: "
      f"raise the budget, lower the required throughput, or add devices."
    )


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
