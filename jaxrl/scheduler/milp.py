"""The MILP behind `planner.plan`, solved with HiGHS through `scipy.optimize.milp`.

Asynchronous plans (staleness >= 1) are linear in the throughput X: X is bounded by the rollout
rate (sum of instance rates), by the training rate, by the weight-sync rate and by the tail
latencies (of the instance hosting a step's longest responses, and of every other instance
used), spread over the staleness window of eta cycles. Synchronous plans minimise the cycle
time C = max(S / rollout rate, tail) + train + sync; the convex term S / rate is kept exact by
adding tangent cuts until the solution's cut is tight (Kelley's method). A second solve takes
the cheapest plan within 1e-6 of the best throughput.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array, diags

from jaxrl.scheduler.problem import PlannerConfig, PlanningError, Problem


class PlanMilp:
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
      caps = [min(self.big, s * eta / o.cost.tail_seconds) for o in p.rollout]
      self._row({x: 1, **{self.z(i): self.big - c for i, c in enumerate(caps)}}, ub=self.big)
      for i, o in enumerate(p.rollout):  # X <= S eta / bulk tail of every option used
        cap = s * eta / o.cost.bulk_tail_seconds
        if cap < self.big:
          self._row({x: 1, self.u(i): self.big - cap}, ub=self.big)
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
      for i, o in enumerate(p.rollout):
        self._row({rv: 1, self.u(i): -o.cost.bulk_tail_seconds}, lb=0)
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
    # HiGHS (scipy 1.17.1) now and then reports "optimal" for a plan short of the best: with
    # its presolve on some models, without it on others (tests/scheduler/planner_test.py's
    # seeds). Both answers are feasible points of the same model, so each model is solved both
    # ways and the better kept. It also stops with "Solve error" (status 4: "claims
    # optimality, but with primal infeasibilities" of its own tolerance) on a few models either
    # way; the same model with the continuous variables in other units (X or C counted in
    # halves or doubles: exact in floating point) then solves. Only "infeasible" (status 2) or
    # "unbounded" (3) means that no plan exists.
    results = []
    for scale in (1.0, 0.5, 2.0):
      units = np.ones(nv)
      units[self.base :] = scale  # a continuous variable's value is `scale` x the solver's
      for presolve in (True, False):
        with _solver_prints_to_stderr():
          res = milp(
            cost * units,
            constraints=LinearConstraint(a @ diags(units), lb, ub),
            integrality=integrality,
            bounds=Bounds(np.zeros(nv), upper / units),
            options={"mip_rel_gap": self.cfg.mip_rel_gap, "presolve": presolve},
          )
        results.append(res)
        if res.x is not None:
          res.x = res.x * units
      solved = [res for res in results if res.x is not None]
      if solved:
        return min(solved, key=lambda res: res.fun).x
    if any(res.status in (2, 3) for res in results):
      return None
    why = "; ".join(sorted({f"{res.message} (status {res.status})" for res in results}))
    raise PlanningError(f"the MILP solver failed on every attempt: {why}.")

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


@contextlib.contextmanager
def _solver_prints_to_stderr():
  """HiGHS sometimes prints debug lines from C to stdout; send them to stderr so that a
  caller's stdout (a plan as JSON, a table) stays clean."""
  sys.stdout.flush()
  saved = os.dup(1)
  os.dup2(2, 1)
  try:
    yield
  finally:
    os.dup2(saved, 1)
    os.close(saved)
