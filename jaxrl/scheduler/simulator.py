"""Discrete-event simulation of an RL post-training job under a plan.

Rollout instances run continuous batching: a free slot admits the next waiting request at once
(after a prefill pause). An instance is advanced from one event to the next (a request finishes,
work arrives, weights change), never token by token: its decode steps between two events take
`cost.decode_step_seconds` at the running count and the mean context of the middle step. Each
instance keeps a step clock; a request's tokens are the clock ticks it ran for, split by the
weight version the instance held (a log of clock -> version), so finishing, preempting and
re-versioning a request cost O(log n).

The learner trains `samples_per_step` finished samples (whole groups) per step and publishes a
new version; an instance pays the weight transfer when it loads it, and admits only with the
newest weights. Admission control lets request r start only if r < (steps done + eta + 1) x
samples_per_step; sync policies are this machinery with eta = 0. The learner takes complete
groups oldest version first and, to keep every trained sample within the staleness bound,
waits while skipping an unfinished group would push it past the bound. `disagg_async` loads
new weights once its batch has drained; the `_partial` policies at the next step boundary,
paying the transfer plus a re-prefill of the running requests.

Availability events (`replan.PoolEvent`): when a pool shrinks, its newest instances are marked
at the announcement (time_s - notice_s) and stop admitting; at time_s they are removed and
hand their unfinished requests back with the generated prefix (tokens are streamed out, so
only the step in progress is lost); other instances resume them after re-prefilling prompt +
prefix. Every event is re-planned with `replan.decide`; added instances start after the
decision's reconfiguration stall.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import math
from collections.abc import Sequence

import numpy as np

from jaxrl.scheduler import cost, planner
from jaxrl.scheduler.planner import Problem
from jaxrl.scheduler.policies import (
  POLICIES,
  SimResult,
  policy_plan,
  policy_problem,
  policy_spec,
  random_trace,
)
from jaxrl.scheduler.replan import PoolEvent, decide
from jaxrl.scheduler.sim_state import SimInstance, SimRequest, WaitQueue
from jaxrl.scheduler.staleness import admission_cap, choose_batch
from jaxrl.scheduler.timeline import TRAIN_LANE, Recorder, plot_comparison, plot_timeline

__all__ = [
  "POLICIES",
  "SimResult",
  "plot_comparison",
  "plot_timeline",
  "policy_plan",
  "policy_problem",
  "random_trace",
  "simulate",
]

MAX_LANES = 64


def simulate(
  problem: Problem,
  policy: str,
  steps: int,
  *,
  seed: int = 0,
  trace: Sequence[PoolEvent] = (),
  window_s: float = 600.0,
  oracle_ranker: bool = False,
) -> SimResult:
  """Simulates `steps` training steps of `problem`'s job under `policy`.

  Args:
    problem: cluster, model and workload (`planner.build_problem`).
    policy: one of `POLICIES`.
    steps: training steps to run.
    seed: seed of the response lengths.
    trace: availability events; events on preemptible pools only reach the `_spot` policy.
    window_s: payback window of re-planning (`replan.decide`).
    oracle_ranker: dispatch waiting requests longest first (the simulator knows true lengths)
      to the instances fastest per token.
  """
  spec = policy_spec(policy)
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}.")
  sim_problem, sim_plan = policy_plan(problem, policy)
  return _Sim(problem, sim_problem, sim_plan, policy, spec, steps, seed, trace, window_s,
              oracle_ranker).run()  # fmt: skip


class _Sim:
  """One run: an event heap of (time, seq, kind, a, b); handlers in `run`."""

  def __init__(self, base, problem, plan_, policy, spec, steps, seed, trace, window_s, oracle):
    self.problem, self.plan, self.policy, self.spec = problem, plan_, policy, spec
    self.model, self.w = problem.model, problem.workload
    self.cluster = problem.cluster  # as the job sees it now (events applied)
    self.prices = {p.name: base.cluster.price(p) for p in base.cluster.pools}
    self.eta, self.steps, self.window_s, self.oracle = plan_.max_staleness, steps, window_s, oracle
    self.S, self.G = self.w.samples_per_step, self.w.group_size
    self.P = self.w.prompts_per_step
    total = (steps + self.eta + 1) * self.S
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(math.log(self.w.response_median), self.w.response_sigma, total)
    self.lengths = np.clip(np.rint(lengths), 1, self.w.response_cap).astype(np.int64).tolist()
    self.now, self.heap, self.seq, self.events = 0.0, [], 0, 0
    self.version = 0  # completed training steps = newest published weights
    self.queue = WaitQueue(oracle)
    self.released, self.reqs, self.groups = 0, {}, {}
    # Untrained groups by version: [complete ones in completion order, unfinished count].
    self.pending: dict[int, list] = {}
    self.instances: list[SimInstance] = []  # live (including doomed and starting)
    self.all_instances: list[SimInstance] = []
    self.stride = max(1, math.ceil(sum(s.instances for s in plan_.rollout) / (MAX_LANES - 1)))
    self.timeline = Recorder()
    self.training, self.train_s, self.train_busy = False, plan_.train.step_seconds, 0.0
    self.train_pool, self.complete = dict(plan_.train.pools), 0  # complete untrained groups
    self.train_blocked, self.train_idle_since, self.train_log = 0.0, 0.0, []
    self.cost, self.rate, self.rate_t = 0.0, 0.0, 0.0
    self.hist: dict[int, int] = {}
    self.tokens = self.off_tokens = self.reprefill = self.adopt_reprefill = 0
    self.preemptions = self.replans = self.adopted = 0
    self.audit = dict.fromkeys(
      ("started", "finished", "trained", "handed_back", "token_mismatch", "forced_trains",
       "duplicated", "trained_twice"), 0)  # fmt: skip
    self.steps_done, self.end, self.plan_initial = 0, None, plan_
    for stage in plan_.rollout:
      for _ in range(stage.instances):
        self._add(stage.pool, stage.mesh["tensor"], stage.batch_size)
    self._set_rate()
    for ev in trace:
      self._schedule_event(ev)

  # ------------------------------------------------------------------ bookkeeping
  def _push(self, t, kind, a=None, b=None):
    self.seq += 1
    heapq.heappush(self.heap, (t, self.seq, kind, a, b))

  def _set_rate(self):
    self.cost += self.rate * (self.now - self.rate_t) / 3600
    self.rate_t = self.now
    rate = sum(self.prices[p] * n for p, n in self.train_pool.items())
    if not self.spec.colocated:  # colocated instances share the training devices
      rate += sum(self.prices[i.pool] * i.tensor for i in self.instances)
    self.rate = rate

  def _sync_seconds(self, pool):
    if self.spec.colocated:
      return self.plan.stage_seconds["weight_sync"]
    src = next(iter(self.train_pool))
    return cost.weight_sync_seconds(self.model, self.cluster.bandwidth(src, pool))

  def _add(self, pool, tensor, batch, stall=None):
    """A new instance: ready now, or (stall given) after max(stall, its weight load)."""
    uid = len(self.all_instances)
    lane = None
    if uid % self.stride == 0 and len(self.timeline.lanes) < MAX_LANES:
      lane = self.timeline.lane(f"{pool}#{uid}")
    acc = self.cluster.accelerator(self.cluster.pool(pool))
    context = self.w.prompt_len + self.w.lengths().mean_position
    step = cost.decode_step_seconds(self.model, acc, tensor, batch, context)
    sync = self._sync_seconds(pool)
    inst = SimInstance(uid, self.model, pool, acc, tensor, batch, sync, lane, step, self.now,
                     self.version)  # fmt: skip
    self.instances.append(inst)
    self.all_instances.append(inst)
    self._rank()
    if stall is not None:
      inst.starting = True
      self._busy(inst, [(max(stall, inst.sync_s), "weight-sync")])
    return inst

  def _rank(self):
    """Oracle ranker: the instances fastest per token (a full batch's step within 5% of the
    fastest) take the longest waiting requests, the others the shortest (skew-aware)."""
    if self.oracle and self.instances:
      self.instances.sort(key=lambda i: (i.step, i.uid))
      fastest = self.instances[0].step
      for inst in self.instances:
        inst.longest = inst.step <= 1.05 * fastest

  # ------------------------------------------------------------------ instances
  def _busy(self, inst, phases):
    t, inst.phases = self.now, []
    for seconds, kind in phases:
      if seconds > 0:
        inst.phases.append((t, t + seconds, kind))
        t += seconds
    inst.state = "busy"
    inst.epoch += 1
    self._push(t, "inst", inst, inst.epoch)

  def _close(self, inst):
    """Accounts the instance's current state up to now (it is about to change)."""
    if inst.state == "decode":
      t0, c0, k, dt = inst.seg
      done = min(k, math.floor((self.now - t0) / dt + 1e-9)) if self.now < t0 + k * dt else k
      inst.clock = c0 + done
      inst.busy += done * dt
      self.timeline.add(inst.lane, t0, t0 + done * dt, "decode")
    elif inst.state == "busy":
      for s, e, kind in inst.phases:
        e = min(e, self.now)
        self.timeline.add(inst.lane, s, e, kind)
        if kind == "prefill" and e > s:
          inst.busy += e - s
      inst.phases = []
    elif inst.state == "idle":
      self.timeline.add(inst.lane, inst.since, self.now, "idle-wait")
    inst.state = None

  def _on_inst(self, inst, epoch):
    if epoch != inst.epoch or inst.state in (None, "dead"):
      return
    self._close(inst)
    if inst.starting:
      inst.starting = False
      self._set_version(inst)
    self._resume(inst)

  def _set_version(self, inst):
    inst.version = self.version
    inst.vclock.append(inst.clock)
    inst.vversion.append(self.version)

  def _resume(self, inst):
    """The instance is at a step boundary with nothing in progress: what next."""
    self._complete(inst)
    w = self.w
    if not inst.doomed and inst.version < self.version and (self.spec.partial or not inst.running):
      n, c = len(inst.running), inst.clock
      tokens = inst.ctx + n * c
      self.adopt_reprefill += tokens
      a, b = inst.prefill
      refill = a * tokens + b * (inst.ctx2 + 2 * c * inst.ctx + n * c * c)
      self._set_version(inst)
      self._busy(inst, [(inst.sync_s, "weight-sync"), (refill, "prefill")])
      return
    free = inst.batch - len(inst.running)
    if free and self.queue and not inst.doomed and inst.version == self.version:
      tokens = squares = 0
      while free and self.queue:
        rid = self.queue.pop(inst.longest)
        req = self._start(rid)
        if req.gen:
          self.reprefill += w.prompt_len + req.gen
        t = w.prompt_len + req.gen
        tokens, squares = tokens + t, squares + t * t
        req.admit = inst.clock
        inst.running[rid] = req
        heapq.heappush(inst.heap, (inst.clock + req.length - req.gen, rid))
        inst.ctx += t - inst.clock
        inst.ctx2 += (t - inst.clock) ** 2
        free -= 1
      a, b = inst.prefill
      self._busy(inst, [(a * tokens + b * squares, "prefill")])
      return
    if inst.running:
      n = len(inst.running)
      k = inst.heap[0][0] - inst.clock
      context = inst.ctx / n + inst.clock + (k - 1) / 2
      dt = cost.decode_step_seconds(self.model, inst.acc, inst.tensor, n, context)
      inst.state, inst.seg = "decode", (self.now, inst.clock, k, dt)
      inst.epoch += 1
      self._push(self.now + k * dt, "inst", inst, inst.epoch)
    else:
      inst.state, inst.since = "idle", self.now

  def _start(self, rid):
    req = self.reqs.get(rid)
    if req is None:  # first admission: the request's group gets its version now
      gid = rid // self.G
      req = self.reqs[rid] = SimRequest(gid, self.lengths[rid])
      self.audit["started"] += 1
      if gid not in self.groups:
        self.groups[gid] = [self.version, self.G]  # version, responses not finished
        self.pending.setdefault(self.version, [collections.deque(), 0])[1] += 1
    return req

  def _wants_boundary(self, inst):
    if inst.doomed:
      return False
    if inst.version < self.version:
      return self.spec.partial
    return len(inst.running) < inst.batch and bool(self.queue)

  def _notify(self):
    """Work arrived or weights changed: idle instances react now, decoding ones at the end of
    the step they are in."""
    for inst in self.instances:
      if inst.state == "idle":
        if not inst.doomed and (self.queue or inst.version < self.version):
          self._close(inst)
          self._resume(inst)
      elif inst.state == "decode" and self._wants_boundary(inst):
        t0, c0, k, dt = inst.seg
        done = min(k, max(0, math.ceil((self.now - t0) / dt - 1e-9)))
        if done < k:
          inst.seg = (t0, c0, done, dt)
          inst.epoch += 1
          self._push(t0 + done * dt, "inst", inst, inst.epoch)

  def _complete(self, inst):
    while inst.heap and inst.heap[0][0] <= inst.clock:
      _, rid = heapq.heappop(inst.heap)
      req = inst.running.pop(rid)
      c = self.w.prompt_len + req.gen - req.admit
      inst.ctx, inst.ctx2 = inst.ctx - c, inst.ctx2 - c * c
      self._record(inst, req, inst.clock)
      req.gen = req.length
      req.done += 1
      self.audit["finished"] += 1
      self.audit["duplicated"] += req.done > 1
      if sum(n for _, n in req.history) != req.length:
        self.audit["token_mismatch"] += 1
      group = self.groups[req.group]
      group[1] -= 1
      if group[1] == 0:
        entry = self.pending[group[0]]
        entry[0].append(req.group)
        entry[1] -= 1
        self.complete += 1
        self._try_train()

  def _record(self, inst, req, end):
    """Adds the tokens `req` made on `inst` up to clock `end` to its history, per version."""
    a = req.admit
    i = bisect.bisect_right(inst.vclock, a) - 1
    while a < end:
      nxt = inst.vclock[i + 1] if i + 1 < len(inst.vclock) else end
      stop = min(end, nxt)
      if stop > a:
        v = inst.vversion[i]
        if req.history and req.history[-1][0] == v:
          req.history[-1][1] += stop - a
        else:
          req.history.append([v, stop - a])
      a, i = max(a, stop), i + 1

  def _kill(self, inst, preempted):
    """Removes the instance; its running requests go back to the queue with their prefix
    (tokens were streamed out, so only the step in progress is lost)."""
    self._close(inst)
    self._complete(inst)
    for rid, req in inst.running.items():
      self._record(inst, req, inst.clock)
      req.gen += inst.clock - req.admit
      self.queue.push_resumed(rid)
      self.audit["handed_back"] += 1
    inst.running, inst.heap, inst.ctx, inst.ctx2 = {}, [], 0, 0
    inst.state, inst.died = "dead", self.now
    inst.epoch += 1
    self.instances.remove(inst)
    self._rank()
    self.preemptions += preempted

  # ------------------------------------------------------------------ learner
  def _release(self):
    # Requests of group k: admission control in groups, times G.
    cap = min(admission_cap(self.version, self.eta, self.P) * self.G, len(self.lengths))
    for rid in range(self.released, cap):
      self.queue.push_new(rid, self.lengths[rid])
    self.released = max(self.released, cap)

  def _try_train(self):
    if self.training or self.end is not None or self.now < self.train_blocked:
      return
    j = self.version
    ready = [(gid, v) for v, (done, _) in sorted(self.pending.items()) for gid in done]
    in_flight = [v for v, (_, n) in self.pending.items() for _ in range(n)]
    choice = choose_batch(ready, in_flight, j, self.eta, self.P)
    if choice is None:
      return
    self.audit["forced_trains"] += choice.forced
    self.complete -= self.P
    chosen = choice.groups
    for gid in chosen:
      v = self.groups[gid][0]
      self.pending[v][0].remove(gid)
      if not self.pending[v][0] and not self.pending[v][1]:
        del self.pending[v]
    for gid in chosen:
      for rid in range(gid * self.G, (gid + 1) * self.G):
        req = self.reqs[rid]
        req.trained += 1
        self.audit["trained_twice"] += req.trained > 1
        self.audit["trained"] += 1
        lag = j - req.history[0][0]
        self.hist[lag] = self.hist.get(lag, 0) + 1
        for v, n in req.history:
          self.tokens += n
          self.off_tokens += n if v < j else 0
    self.training = True
    self.timeline.add(TRAIN_LANE, self.train_idle_since, self.now, "idle-wait")
    self._push(self.now + self.train_s, "train")
    self.train_log.append((self.now, self.now + self.train_s))

  def _train_done(self):
    start, end = self.train_log[-1]
    self.timeline.add(TRAIN_LANE, start, end, "train")
    self.train_busy += end - start
    self.training, self.train_idle_since = False, self.now
    self.steps_done += 1
    self.version += 1
    if self.steps_done == self.steps:
      self.end = self.now
      return
    self._release()
    self._notify()
    self._try_train()

  # ------------------------------------------------------------------ availability
  def _schedule_event(self, ev):
    names = [p.name for p in self.problem.cluster.pools]
    if ev.pool not in names or ev.nodes < 0 or ev.notice_s < 0:
      raise ValueError(
        f"bad availability event {ev}: the pool must be one of {names}, nodes and notice_s >= 0."
      )
    if not self.spec.spot and self.problem.cluster.pool(ev.pool).preemptible:
      return  # this policy holds no preemptible devices
    if self.spec.colocated:
      if ev.pool in self.train_pool:
        raise ValueError(
          f"colocated_sync does not model availability events on the pool it runs on "
          f"({ev.pool}); drop them from the trace or use a disaggregated policy."
        )
      return
    self._push(max(0.0, ev.time_s - ev.notice_s), "announce", ev)

  def _announce(self, ev):
    self.cluster = self.cluster.with_pool_nodes(ev.pool, ev.nodes)
    devices = self.cluster.pool(ev.pool).devices
    live = [i for i in self.all_instances if i.pool == ev.pool and i.state != "dead"]
    live = [i for i in live if not i.doomed]  # all_instances is in creation order
    used = self.train_pool.get(ev.pool, 0) + sum(i.tensor for i in live)
    doomed = []
    while used > devices and live:  # the newest instances go first
      inst = live.pop()
      inst.doomed, used = True, used - inst.tensor
      doomed.append(inst)
    if doomed:
      self._push(max(self.now, ev.time_s), "reclaim", doomed)
    self._replan()

  def _reclaim(self, doomed):
    for inst in doomed:
      if inst.state != "dead":
        self._kill(inst, preempted=True)
    self._set_rate()
    self._notify()

  def _replan(self):
    try:
      name = self.problem.model_name
      problem = planner.build_problem(self.cluster, self.model, self.w, model_name=name)
      decision = decide(problem, self.plan, planner.PlannerConfig(), self.window_s)
    except planner.PlanningError:
      return  # nothing fits: keep what still runs
    self.replans += 1
    self.adopted += decision.adopted
    self._apply(decision.plan, decision.reconfigure_seconds if decision.adopted else 0.0)
    self.plan = decision.plan

  def _apply(self, target, stall):
    """Starts and stops instances so the live ones match `target` (new ones after `stall`)."""
    train = target.train
    if (train.pools, train.mesh) != (self.plan.train.pools, self.plan.train.mesh):
      self.train_s, self.train_pool = train.step_seconds, dict(train.pools)
      self.train_blocked = self.now + stall
      self._push(self.train_blocked, "unblock")
      for inst in self.instances:
        inst.sync_s = self._sync_seconds(inst.pool)
    want: dict[tuple, int] = {}
    for s in target.rollout:
      key = (s.pool, s.mesh["tensor"], s.batch_size)
      want[key] = want.get(key, 0) + s.instances
    have: dict[tuple, list] = {}
    for inst in self.instances:
      if not inst.doomed:
        have.setdefault((inst.pool, inst.tensor, inst.batch), []).append(inst)
    for key, insts in have.items():
      for inst in insts[want.get(key, 0) :]:
        self._kill(inst, preempted=False)
    for key, n in want.items():
      for _ in range(n - len(have.get(key, []))):
        self._add(*key, stall=stall)
    self._set_rate()
    self._notify()

  # ------------------------------------------------------------------ run
  def run(self) -> SimResult:
    self._release()
    self._notify()
    handlers = {
      "inst": self._on_inst,
      "train": lambda *_: self._train_done(),
      "announce": lambda ev, _: self._announce(ev),
      "reclaim": lambda doomed, _: self._reclaim(doomed),
      "unblock": lambda *_: self._try_train(),
    }
    while self.heap and self.end is None:
      self.now, _, kind, a, b = heapq.heappop(self.heap)
      self.events += 1
      handlers[kind](a, b)
    stalled = self.end is None
    self.end = self.now if stalled else self.end
    return self._result(stalled)

  def _result(self, stalled):
    wall = self.end
    self._set_rate()
    held = busy = 0.0
    for inst in self.all_instances:
      if inst.state not in ("dead", None):
        self._close(inst)
      held += min(inst.died, wall) - inst.born
      busy += inst.busy
    if not self.training:
      self.timeline.add(TRAIN_LANE, self.train_idle_since, wall, "idle-wait")
    running = sum(len(i.running) for i in self.instances)
    a = self.audit
    a["running_at_end"] = running
    a["queued_at_end"] = len(self.queue.resumed)
    a["lost"] = a["started"] - a["finished"] - running - a["queued_at_end"]
    a["stalled"] = int(stalled)
    trained = a["trained"]
    return SimResult(
      policy=self.policy,
      max_staleness=self.eta,
      steps=self.steps_done,
      samples_trained=trained,
      wall_seconds=wall,
      samples_per_s=trained / wall if wall > 0 else 0.0,
      cost_dollars=self.cost,
      cost_per_1k_samples=self.cost / trained * 1000 if trained else math.inf,
      utilisation={
        "rollout": busy / held if held > 0 else 0.0,
        "train": self.train_busy / wall if wall > 0 else 0.0,
      },
      staleness_histogram=dict(sorted(self.hist.items())),
      off_policy_token_fraction=self.off_tokens / self.tokens if self.tokens else 0.0,
      reprefilled_tokens=self.reprefill,
      adoption_reprefill_tokens=self.adopt_reprefill,
      preemptions=self.preemptions,
      replans=self.replans,
      replans_adopted=self.adopted,
      plan_samples_per_s=self.plan_initial.throughput_samples_per_s,
      plan_cost_per_1k_samples=self.plan_initial.cost_per_1k_samples,
      audit=dict(a),
      events=self.events,
      # Colocated devices are training, not waiting, while the learner runs.
      timeline=self.timeline.segments(self.train_log if self.spec.colocated else ()),
    )
